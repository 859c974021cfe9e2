//! SAC (`run.algo: sac`): a tanh-squashed Gaussian actor and twin critics
//! trained off-policy on the replay-buffer's transition table by the loop
//! every off-policy learner shares ([`crate::offpolicy::run`]); what a
//! round does is [`SacLearner`]'s, and the maths of one gradient step is
//! [`relay_nn::sac_train_step`].
//!
//! What it does, with SB3's `SAC` as the reference:
//!
//! 1. The env-runners act through the inference servers, which sample the
//!    published actor (actions in env units); their fragments become 1-step
//!    transitions in the replay-buffer's off-policy table (actions stored
//!    in env units, `γ` for a step that did not end the episode or ended
//!    it by a time-limit truncation, 0 after a termination; see
//!    `relay_replay_buffer::offpolicy`).
//! 2. A training round is due every `train_freq` env steps inserted (all
//!    env-runners together), from the first multiple of `train_freq`
//!    above `learning_starts` (SB3 trains once `num_timesteps >
//!    learning_starts`, at the end of each `train_freq` collection).
//! 3. A round is `gradient_steps` steps at the learning rate scheduled at
//!    the round's env steps: sample `batch_size` transitions uniformly,
//!    one SAC step (α, then the critics towards `R + γ (min Q'(s', a') -
//!    α log π(a'|s'))`, then the actor), and the Polyak update of the
//!    target critics with `tau` on the round's gradient steps `i` with `i %
//!    target_update_interval == 0` (SB3's condition).
//! 4. After each round: publish the actor as weights version + 1 (the
//!    critics stay here), report metrics, checkpoint every
//!    `checkpoint_every` rounds (also at the first eval, each new best
//!    eval, and at the end).
//!
//! Checkpoints hold every network (`model.safetensors`: actor, critics,
//! target critics, `log_ent_coef`, [`relay_nn::Sac::save`]), the three Adam
//! states (`optimizer.safetensors` of the actor, `critic_optimizer.safetensors`,
//! `ent_coef_optimizer.safetensors`), the counters and RNG (`state.json`) and
//! the round bookkeeping (`sac.json`).

use std::path::Path;

use rand_chacha::ChaCha8Rng;
use relay_config::ExperimentConfig;
use relay_config::SacSection;
use relay_kit::{gauge, ServiceError};
use relay_nn::{Pair, Sac, SacConfig, SacOptimizers, SacStats};

use relay_nn::BatchShare;
use relay_policy::PolicyWeights;
use relay_proto::{MetricValue, TransitionBatch};
use serde::{Deserialize, Serialize};

use crate::checkpoint::{self, CheckpointError};
use crate::offpolicy::{OffPolicyAlgorithm, RoundSchedule};
use crate::progress::Progress;
use relay_algo::sac::{gradient_step, initial_ent_coef, step_config};

/// The checkpoint file of [`SacState`].
const STATE_FILE: &str = "sac.json";

/// Round bookkeeping a checkpoint carries beside [`Progress`] (`sac.json`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct SacState {
    /// Training rounds done.
    pub rounds: u64,
    /// Gradient steps done (SB3's `_n_updates`).
    pub gradient_steps: u64,
    /// Polyak updates of the target critics made.
    pub target_updates: u64,
}

/// What learner replicas hold alike: every parameter (actor, critics,
/// targets, `log α`), the three optimizers' states (actor, critic,
/// entropy coefficient) and the round bookkeeping.
#[derive(Serialize, Deserialize)]
pub(crate) struct SacReplicaState {
    parameters: Vec<relay_nn::NamedTensor>,
    optimizers: [relay_nn::AdamState; 3],
    state: SacState,
}

/// The round schedule of a config section.
pub(crate) fn schedule(cfg: &SacSection) -> RoundSchedule {
    RoundSchedule {
        learning_starts: cfg.learning_starts,
        train_freq: cfg.train_freq,
        batch_size: cfg.batch_size,
        gradient_steps: cfg.gradient_steps,
    }
}

/// Env steps at which round `rounds` (0-based) is due
/// ([`RoundSchedule::due_at`]).
pub fn round_due_at(cfg: &SacSection, rounds: u64) -> u64 {
    schedule(cfg).due_at(rounds)
}

/// Statistics of one training round (means over its gradient steps).
#[derive(Debug, Clone, Copy, Default)]
pub struct RoundStats {
    pub actor_loss: f64,
    pub critic_loss: f64,
    pub ent_coef_loss: f64,
    pub ent_coef: f64,
    pub logprob: f64,
    pub q_mean: f64,
    pub steps: u64,
}

impl RoundStats {
    fn add(&mut self, s: &SacStats) {
        self.actor_loss += s.actor_loss as f64;
        self.critic_loss += s.critic_loss as f64;
        self.ent_coef_loss += s.ent_coef_loss as f64;
        self.ent_coef += s.ent_coef as f64;
        self.logprob += s.logprob_mean as f64;
        self.q_mean += s.q_mean as f64;
        self.steps += 1;
    }

    fn mean(mut self) -> Self {
        let n = self.steps.max(1) as f64;
        for v in [
            &mut self.actor_loss,
            &mut self.critic_loss,
            &mut self.ent_coef_loss,
            &mut self.ent_coef,
            &mut self.logprob,
            &mut self.q_mean,
        ] {
            *v /= n;
        }
        self
    }
}

/// Errors of a gradient step on a sampled batch or of loading a
/// checkpoint.
#[derive(Debug, thiserror::Error)]
pub enum SacError {
    #[error(transparent)]
    Step(#[from] relay_algo::StepError),
    #[error(transparent)]
    Nn(#[from] relay_nn::NnError),
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
}

/// SAC's networks, optimizers and round bookkeeping, trained by the shared
/// off-policy loop ([`crate::offpolicy::run`]).
pub(crate) struct SacLearner {
    cfg: SacSection,
    sac: Sac,
    optimizers: SacOptimizers,
    step: SacConfig,
    state: SacState,
    /// Statistics of the round in progress.
    stats: RoundStats,
    /// The gradient step's threads (`sac.threads`).
    pair: Pair,
}

impl SacLearner {
    /// A fresh actor and critics for the run's env.
    pub(crate) fn new(cfg: &ExperimentConfig) -> Result<Self, ServiceError> {
        let s = cfg.sac.clone();
        let spec = relay_policy::sac_spec_for(cfg).map_err(ServiceError::other)?;
        let init_ent_coef = initial_ent_coef(&s).map_err(ServiceError::other)?;
        let step = step_config(&s, spec.action_dim(), s.learning_rate.value(0.0))
            .map_err(ServiceError::other)?;
        let sac = Sac::new(&spec, init_ent_coef, cfg.run.seed).map_err(ServiceError::other)?;
        let optimizers = SacOptimizers::new(&sac, &step).map_err(ServiceError::other)?;
        let pair = Pair::new(s.threads).map_err(ServiceError::other)?;
        tracing::info!(ent_coef = ?s.ent_coef, target_entropy = ?step.target_entropy, "sac");
        Ok(Self {
            cfg: s,
            sac,
            optimizers,
            step,
            state: SacState::default(),
            stats: RoundStats::default(),
            pair,
        })
    }
}

impl OffPolicyAlgorithm for SacLearner {
    const NAME: &'static str = "sac";
    const REPORTS_PRIORITIES: bool = false;
    type Error = SacError;
    type State = SacReplicaState;

    fn rounds(&self) -> u64 {
        self.state.rounds
    }

    fn schedule(&self) -> RoundSchedule {
        schedule(&self.cfg)
    }

    fn num_parameters(&self) -> usize {
        self.sac.num_parameters()
    }

    fn load(&mut self, dir: &Path, resume: bool, optimizers: bool) -> Result<(), SacError> {
        self.sac.load(dir.join("model.safetensors"))?;
        if optimizers {
            for (file, adam) in optimizer_files(&mut self.optimizers) {
                adam.load(dir.join(file))?;
            }
        }
        if resume {
            self.state = load_sac_state(dir)?;
        }
        Ok(())
    }

    fn save(&mut self, dir: &Path) -> Result<(), CheckpointError> {
        let tensors = |e: relay_nn::NnError| CheckpointError::Tensors(e.to_string());
        self.sac
            .save(dir.join("model.safetensors"))
            .map_err(tensors)?;
        for (file, adam) in optimizer_files(&mut self.optimizers) {
            adam.save(dir.join(file)).map_err(tensors)?;
        }
        checkpoint::write_json(&dir.join(STATE_FILE), &self.state)
    }

    /// Only the actor: the critics stay here.
    fn weights(&self, progress: &Progress) -> PolicyWeights {
        PolicyWeights::from_tensors(
            self.sac.actor.named_tensors(),
            progress.version,
            progress.env_steps,
        )
    }

    fn parameters(&self) -> Vec<relay_nn::NamedTensor> {
        self.sac.named_tensors()
    }

    fn capture(&self) -> Result<SacReplicaState, SacError> {
        let o = &self.optimizers;
        Ok(SacReplicaState {
            parameters: self.sac.named_tensors(),
            optimizers: [o.actor.state()?, o.critic.state()?, o.ent_coef.state()?],
            state: self.state,
        })
    }

    fn restore(&mut self, state: SacReplicaState) -> Result<(), SacError> {
        self.sac.load_named_tensors(&state.parameters)?;
        let [actor, critic, ent_coef] = state.optimizers;
        let o = &mut self.optimizers;
        o.actor.set_state(actor)?;
        o.critic.set_state(critic)?;
        o.ent_coef.set_state(ent_coef)?;
        self.state = state.state;
        Ok(())
    }

    fn sampling_beta(&self, _frac: f64) -> f64 {
        1.0
    }

    fn begin_round(&mut self, _due_at: u64, frac: f64) -> Result<(), SacError> {
        let lr = self.cfg.learning_rate.value(frac);
        self.optimizers.set_lr(lr);
        self.step.lr = lr;
        self.stats = RoundStats::default();
        Ok(())
    }

    fn gradient_step(
        &mut self,
        step: usize,
        batch: &TransitionBatch,
        rng: &mut ChaCha8Rng,
        sync: &mut BatchShare<'_>,
    ) -> Result<Option<Vec<f32>>, SacError> {
        // SB3's condition, on the round's gradient steps.
        self.step.update_target = (step as u64).is_multiple_of(self.cfg.target_update_interval);
        self.state.gradient_steps += 1;
        let stats = gradient_step(
            &self.step,
            &self.sac,
            &mut self.optimizers,
            batch,
            rng,
            &self.pair,
            sync,
        )?;
        self.stats.add(&stats);
        if self.step.update_target {
            self.state.target_updates += 1;
        }
        Ok(None)
    }

    fn prioritized(&self) -> bool {
        false
    }

    fn end_round(&mut self, frac: f64) -> Vec<MetricValue> {
        self.state.rounds += 1;
        let stats = self.stats.mean();
        vec![
            gauge("learner_policy_loss", stats.actor_loss),
            gauge("learner_value_loss", stats.critic_loss),
            gauge("learner_ent_coef_loss", stats.ent_coef_loss),
            gauge("learner_ent_coef", stats.ent_coef),
            // -E[log π(a|s)] of fresh actions: an estimate of the entropy
            // of the squashed policy.
            gauge("learner_entropy", -stats.logprob),
            gauge("learner_q_mean", stats.q_mean),
            gauge("learner_learning_rate", self.cfg.learning_rate.value(frac)),
            gauge("learner_target_updates", self.state.target_updates as f64),
        ]
    }
}

/// The checkpoint file of each of SAC's three Adam states.
pub fn optimizer_files(optimizers: &mut SacOptimizers) -> [(&'static str, &mut relay_nn::Adam); 3] {
    [
        ("optimizer.safetensors", &mut optimizers.actor),
        ("critic_optimizer.safetensors", &mut optimizers.critic),
        ("ent_coef_optimizer.safetensors", &mut optimizers.ent_coef),
    ]
}

/// Reads a checkpoint's round bookkeeping (`sac.json`).
pub fn load_sac_state(dir: &Path) -> Result<SacState, CheckpointError> {
    checkpoint::read_json(&dir.join(STATE_FILE))
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;
    use relay_nn::SacSpec;
    use relay_proto::{Tensor, SCHEMA_VERSION};

    #[test]
    fn rounds_follow_sb3_and_settings_come_from_the_section() {
        let s = SacSection::default();
        // SB3 defaults: learning_starts 100, train_freq 1.
        assert_eq!(round_due_at(&s, 0), 101);
        assert_eq!(round_due_at(&s, 1), 102);
        let every_64 = SacSection {
            train_freq: 64,
            learning_starts: 128,
            ..s.clone()
        };
        assert_eq!(round_due_at(&every_64, 0), 192);
        let step = step_config(&s, 3, 1e-3).unwrap();
        assert!(step.auto_entropy);
        assert_eq!(step.target_entropy, Some(-3.0));
        assert_eq!((step.tau, step.lr), (0.005, 1e-3));
        assert_eq!(initial_ent_coef(&s).unwrap(), 1.0);
        let fixed = SacSection {
            ent_coef: relay_config::NumberOrName::Number(0.2),
            ..s.clone()
        };
        assert!(!step_config(&fixed, 1, 1e-3).unwrap().auto_entropy);
        assert_eq!(initial_ent_coef(&fixed).unwrap(), 0.2);
        let bad = SacSection {
            ent_coef: relay_config::NumberOrName::Name("sometimes".into()),
            ..s
        };
        assert!(step_config(&bad, 1, 1e-3)
            .unwrap_err()
            .to_string()
            .contains("sac.ent_coef"));
    }

    fn batch(b: usize, obs_dim: usize, action_dim: usize, actions: &[f32]) -> TransitionBatch {
        TransitionBatch {
            schema: SCHEMA_VERSION,
            ids: (0..b as u64).collect(),
            obs: Tensor::from_f32(&[b, obs_dim], &vec![0.1; b * obs_dim]),
            actions: Tensor::from_f32(&[b, action_dim], actions),
            rewards: Tensor::from_f32(&[b], &vec![1.0; b]),
            next_obs: Tensor::from_f32(&[b, obs_dim], &vec![0.2; b * obs_dim]),
            discounts: Tensor::from_f32(&[b], &vec![0.99; b]),
            terminated: Tensor::from_bool(&[b], &vec![false; b]),
            truncated: Tensor::from_bool(&[b], &vec![false; b]),
            weights: Tensor::from_f32(&[b], &vec![1.0; b]),
            weight_scale: None,
            size: b as u64,
            inserted_steps: b as u64,
            next_masks: None,
        }
    }

    #[test]
    fn a_gradient_step_trains_alpha_and_refuses_a_batch_of_the_wrong_shape() {
        let spec = SacSpec {
            hidden: vec![16],
            ..SacSpec::new(3, vec![-2.0], vec![2.0])
        };
        let sac = Sac::new(&spec, 1.0, 5).unwrap();
        let step = step_config(&SacSection::default(), 1, 1e-2).unwrap();
        let mut opt = SacOptimizers::new(&sac, &step).unwrap();
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        let before = sac.ent_coef().unwrap();
        let good = batch(8, 3, 1, &[0.5; 8]);
        let stats = gradient_step(
            &step,
            &sac,
            &mut opt,
            &good,
            &mut rng,
            &Pair::sequential(),
            &mut relay_nn::BatchShare::whole(),
        )
        .unwrap();
        assert!(stats.critic_loss.is_finite() && stats.actor_loss.is_finite());
        assert_eq!(stats.ent_coef, before);
        assert_ne!(sac.ent_coef().unwrap(), before);
        // Two action values per row for a one-dimensional actor.
        let bad = batch(8, 3, 2, &[0.5; 16]);
        let err = gradient_step(
            &step,
            &sac,
            &mut opt,
            &bad,
            &mut rng,
            &Pair::sequential(),
            &mut relay_nn::BatchShare::whole(),
        )
        .unwrap_err();
        assert!(err.to_string().contains("actions"), "{err}");
    }
}
