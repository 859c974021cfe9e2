//! The text learner as the replica driver runs it ([`TextTraining`]):
//! what an update is ([`TextStep`], as rank 0 hands it out), what a
//! replica holds ([`TextReplicaState`]: the adapter, AdamW's moments, the
//! moving baselines and the counters) and its share of an update.

use relay_llm::{
    CausalLm, LoraAdapter, RewardNormalizer, RlStats, RlTrainer, TokenExample, TrainError,
};
use relay_replicas::{Replicated, Undo};
use serde::{Deserialize, Serialize};

use super::TextCheckpointState;
use crate::examples::Converted;

/// One update as rank 0 hands it to the other replicas: update number
/// `updates` (the count before it) on `examples`, made of `games` games.
#[derive(Serialize, Deserialize)]
pub(super) struct TextStep {
    pub(super) updates: u64,
    pub(super) examples: Vec<TokenExample>,
    pub(super) games: u64,
    /// The reward statistics after the batch's games, and rank 0's best
    /// evaluation so far, for whoever leads next.
    pub(super) reward_normalizer: RewardNormalizer,
    pub(super) best_eval: Option<(f64, u64)>,
    /// What the games became (rank 0's report); not handed out.
    #[serde(skip)]
    pub(super) converted: Option<Converted>,
}

/// A text learner's whole state, in memory: what rank 0 hands to every
/// replica of a new view, and the rollback point of an update (a
/// replicated step that failed, or one a stop cut short).
#[derive(Serialize, Deserialize)]
pub(super) struct TextReplicaState {
    adapter: Vec<relay_nn::NamedTensor>,
    /// AdamW's moments and steps ([`relay_llm::AdamW::state_bytes`]).
    optimizer: Vec<u8>,
    moving_baselines: relay_llm::MovingBaselines,
    state: TextCheckpointState,
    version_floor: u64,
}

/// What the replicas hold alike and train together: the adapter (over
/// the frozen base), AdamW and the run's counters.
pub(super) struct TextTraining<'m> {
    pub(super) model: &'m CausalLm,
    pub(super) adapter: &'m LoraAdapter,
    pub(super) trainer: RlTrainer,
    pub(super) state: TextCheckpointState,
    /// The oldest version whose games belong to this learner's timeline.
    pub(super) version_floor: u64,
    /// Passes over each batch (`rl.epochs`).
    pub(super) epochs: usize,
}

impl Replicated for TextTraining<'_> {
    type State = TextReplicaState;
    type Step = TextStep;
    type Output = Vec<RlStats>;
    type Error = TrainError;
    // An update of an LLM's micro-batches takes seconds to minutes; a
    // failed batch may leave earlier epochs applied.
    const STOPS_PART_WAY: bool = true;
    const UNDO: Undo = Undo::Snapshot;

    fn capture(&self) -> Result<TextReplicaState, String> {
        Ok(TextReplicaState {
            adapter: adapter_values(self.adapter),
            optimizer: self
                .trainer
                .optimizer()
                .state_bytes()
                .map_err(|e| e.to_string())?,
            moving_baselines: self.trainer.moving_baselines().clone(),
            state: self.state.clone(),
            version_floor: self.version_floor,
        })
    }

    /// The adapter's names and shapes must match.
    fn restore(&mut self, held: TextReplicaState) -> Result<(), String> {
        self.trainer
            .optimizer_mut()
            .restore_bytes(&held.optimizer, "rank 0's optimizer state")
            .map_err(|e| e.to_string())?;
        relay_llm::sft::set_var_values(&self.adapter.named_vars(), &held.adapter)
            .map_err(|e| format!("adapter: {e}"))?;
        self.trainer.set_moving_baselines(held.moving_baselines);
        self.state = held.state;
        self.version_floor = held.version_floor;
        Ok(())
    }

    fn took_over(&mut self) {
        // The old rank 0 may have published one version past what this
        // replica holds: skip it.
        self.state.progress.version += 2;
    }

    fn describe(step: &TextStep) -> String {
        step.updates.to_string()
    }

    fn is_next(&self, step: &TextStep) -> bool {
        step.updates == self.state.progress.updates
    }

    fn run(
        &mut self,
        step: &TextStep,
        share: &mut relay_nn::BatchShare<'_>,
    ) -> Result<Vec<RlStats>, TrainError> {
        tracing::debug!(
            step = step.updates,
            examples = step.examples.len(),
            "update starts"
        );
        self.trainer
            .train_epochs_part(self.model, self.adapter, &step.examples, self.epochs, share)
    }

    fn stopped(error: &TrainError) -> bool {
        matches!(error, TrainError::Stopped)
    }
}

/// The adapter's trained values; reading a var back from its own device
/// fails only with the device itself.
pub(super) fn adapter_values(adapter: &LoraAdapter) -> Vec<relay_nn::NamedTensor> {
    adapter.named_values().expect("an adapter's vars read back")
}
