//! `relay-algo`: the classic algorithms' updates, the code that must be
//! identical wherever an update runs (the learner's loops, the learners'
//! benchmark). Pure: no NATS, Redis or tokio; a replica's share of each
//! batch comes in as a [`relay_nn::BatchShare`].
//!
//! | module | owns |
//! |---|---|
//! | [`rollout`] | the on-policy data an update trains on: fragments decoded and checked, GAE, [`rollout::Rollout`]; [`rollout::UpdateError`] |
//! | [`optimizer`] | [`optimizer::Optimizer`] (Adam or RMSprop as `run.algo` says), the clipped step on one replica's share |
//! | [`ppo`] | PPO's update: epochs of shuffled minibatches, clipping, early stop on KL |
//! | [`a2c`] | A2C's update: one step on the whole rollout |
//! | [`reinforce`] | REINFORCE: whole episodes from fragments, returns, an optional baseline |
//! | [`dqn`] | DQN's gradient step on a sampled batch |
//! | [`sac`] | SAC's gradient step on a sampled batch and its settings |
//!
//! The loops that gather data, publish versions and checkpoint are the
//! learner's (`relay-learner`).

pub mod a2c;
pub mod dqn;
pub mod optimizer;
pub mod ppo;
pub mod reinforce;
pub mod rollout;
pub mod sac;

/// Why an off-policy gradient step failed: a field of the sampled batch
/// that does not decode or fit, or the networks' own error.
#[derive(Debug, thiserror::Error)]
pub enum StepError {
    #[error("batch field {field}: {detail}")]
    Batch { field: &'static str, detail: String },
    #[error(transparent)]
    Nn(#[from] relay_nn::NnError),
}
