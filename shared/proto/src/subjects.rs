//! NATS subjects, all scoped by run: `relay.<run_id>.<topic>`.
//!
//! `docs/protocol.md` is the table of who publishes and who subscribes.

/// Checks that a run id can be one NATS subject token and a directory name.
pub fn validate_run_id(run_id: &str) -> Result<(), String> {
    if run_id.is_empty() || run_id.len() > 128 {
        return Err(format!(
            "run id must have 1 to 128 characters, got {}",
            run_id.len()
        ));
    }
    if let Some(c) = run_id
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || *c == '-' || *c == '_'))
    {
        return Err(format!(
            "run id {run_id:?} contains {c:?}; only ASCII letters, digits, '-' and '_' are allowed"
        ));
    }
    Ok(())
}

/// The subjects of one run.
#[derive(Debug, Clone)]
pub struct Subjects {
    prefix: String,
}

impl Subjects {
    /// Panics on an invalid run id: validate configuration with
    /// [`validate_run_id`] first.
    pub fn new(run_id: &str) -> Self {
        validate_run_id(run_id).expect("valid run id");
        Self {
            prefix: format!("relay.{run_id}"),
        }
    }

    fn subject(&self, topic: &str) -> String {
        format!("{}.{topic}", self.prefix)
    }

    /// Request-reply, queue group: [`crate::ActRequest`] -> [`crate::ActReply`].
    pub fn act(&self) -> String {
        self.subject("act")
    }
    /// Request-reply, queue group: [`crate::GenerateRequest`] -> [`crate::GenerateReply`].
    pub fn generate(&self) -> String {
        self.subject("generate")
    }
    /// Publish: [`crate::AdapterUpdate`], each new version of a LoRA adapter.
    pub fn adapters(&self) -> String {
        self.subject("adapters")
    }
    /// Request-reply: [`crate::AdapterRequest`] -> [`crate::AdapterUpdate`]
    /// (the newest version of that adapter), answered by the learner.
    pub fn adapters_latest(&self) -> String {
        self.subject("adapters.latest")
    }
    /// Publish: [`crate::GameRecord`], every finished text game (the
    /// replay-buffers consume it in a queue group; the tracker writes a
    /// sample of them to the run directory's `games.jsonl`).
    pub fn games(&self) -> String {
        self.subject("games")
    }
    /// Request-reply, queue group: [`crate::GameSampleRequest`] ->
    /// [`crate::GameSampleReply`] (text runs).
    pub fn replay_games_sample(&self) -> String {
        self.subject("replay.games.sample")
    }
    /// Request-reply, queue group: [`crate::RolloutFragment`] -> [`crate::InsertAck`].
    pub fn replay_insert(&self) -> String {
        self.subject("replay.insert")
    }
    /// Request-reply, queue group: [`crate::SampleRequest`] -> [`crate::SampleReply`].
    pub fn replay_sample(&self) -> String {
        self.subject("replay.sample")
    }
    /// Request-reply, queue group: [`crate::TransitionSampleRequest`] ->
    /// [`crate::TransitionBatch`] (off-policy table, `run.algo: dqn`).
    pub fn replay_transitions_sample(&self) -> String {
        self.subject("replay.transitions.sample")
    }
    /// Request-reply, queue group: [`crate::PriorityUpdate`] ->
    /// [`crate::PriorityAck`] (prioritized off-policy table).
    pub fn replay_priorities(&self) -> String {
        self.subject("replay.priorities")
    }
    /// Publish: [`crate::WeightsUpdate`], each new policy version.
    pub fn weights(&self) -> String {
        self.subject("weights")
    }
    /// Publish: each new policy version's [`crate::WeightsUpdate`] without
    /// its tensors (for services that fetch only some versions).
    pub fn weights_announce(&self) -> String {
        self.subject("weights.announce")
    }
    /// Request-reply: [`crate::WeightsRequest`] -> [`crate::WeightsUpdate`] (latest).
    pub fn weights_latest(&self) -> String {
        self.subject("weights.latest")
    }
    /// Publish: [`crate::EpisodeReport`].
    pub fn episodes(&self) -> String {
        self.subject("episodes")
    }
    /// Publish: [`crate::MetricsReport`].
    pub fn metrics(&self) -> String {
        self.subject("metrics")
    }
    /// Publish: [`crate::EvalReport`].
    pub fn eval(&self) -> String {
        self.subject("eval")
    }
    /// Publish: [`crate::EvalGame`], each game a text evaluation played (the
    /// tracker writes them to the run directory's `games.jsonl`).
    pub fn eval_games(&self) -> String {
        self.subject("eval.games")
    }
    /// Publish: [`crate::EvalStarted`], an evaluation of a version begins.
    pub fn eval_started(&self) -> String {
        self.subject("eval.started")
    }
    /// Publish: [`crate::EvalControl`], switches the running evaluators' plugin.
    pub fn eval_control(&self) -> String {
        self.subject("eval.control")
    }
    /// Publish: [`crate::RunStatusUpdate`].
    pub fn status(&self) -> String {
        self.subject("status")
    }
    /// Publish: [`crate::AlertEvent`], raised and cleared alerts.
    pub fn alerts(&self) -> String {
        self.subject("alerts")
    }
    /// Publish: [`crate::LogBatch`].
    pub fn logs(&self) -> String {
        self.subject("logs")
    }
    /// Request-reply: [`crate::ScaleRequest`] -> [`crate::ScaleReply`], answered
    /// by the local supervisor (`relay up`); `relay scale` sends it.
    pub fn supervisor_scale(&self) -> String {
        self.subject("supervisor.scale")
    }
    /// Wildcard matching every subject of the run.
    pub fn all(&self) -> String {
        self.subject(">")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scopes_subjects_by_run() {
        let s = Subjects::new("cartpole-ppo-1");
        assert_eq!(s.act(), "relay.cartpole-ppo-1.act");
        assert_eq!(s.replay_insert(), "relay.cartpole-ppo-1.replay.insert");
        assert_eq!(s.eval_games(), "relay.cartpole-ppo-1.eval.games");
        assert_eq!(
            s.supervisor_scale(),
            "relay.cartpole-ppo-1.supervisor.scale"
        );
    }

    #[test]
    fn rejects_run_ids_that_break_subjects() {
        assert!(validate_run_id("a.b").is_err());
        assert!(validate_run_id("a b").is_err());
        assert!(validate_run_id("a*").is_err());
        assert!(validate_run_id("").is_err());
        assert!(validate_run_id("CartPole-v1-ppo-20261122-101010").is_ok());
    }
}
