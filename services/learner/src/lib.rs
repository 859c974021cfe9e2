//! learner: trains the policy of a classic-control run with PPO ([`ppo`]),
//! A2C ([`a2c`]) or REINFORCE ([`reinforce`]), as `run.algo` says, on
//! rollouts pulled from the replay buffer, and publishes each new weights
//! version.
//!
//! Every run may have several learner replicas (synchronous data
//! parallelism, driven by `relay_replicas`; the on-policy, off-policy and
//! text loops alike, each a `relay_replicas::Replicated` trainer): rank 0
//! runs the loop below and hands each batch to the others, and all apply
//! the same update. The loop, the same for every on-policy
//! algorithm: gather what
//! the algorithm needs from fragments no more than `replay.max_policy_lag`
//! versions old (PPO: `ppo.rollout_steps` env steps; A2C: one fragment of
//! `a2c.n_steps` per env of an env-runner; REINFORCE: `batch_episodes` whole
//! episodes, assembled from consecutive fragments), update, publish the
//! next version on `weights` (and serve the latest on `weights.latest` for
//! services that join later), report metrics, and checkpoint every
//! `<algo>.checkpoint_every` updates and at the end. For each new best
//! eval figure, and for the evaluation that solves the run, it writes a
//! checkpoint holding the evaluated version's weights ([`evaluated`]:
//! linked `best` and `solved`). It stops training when the budget
//! `run.total_env_steps` is spent or, with `run.stop_when_solved`, when the
//! evaluator announces the run solved (screening and confirmation passed);
//! it then writes a final checkpoint (a solved run's holds the solving
//! version's weights) and keeps serving the weights, and checkpointing the
//! evaluations that still arrive, until shutdown. The data each algorithm
//! trains on and the rollout maths they share live in [`rollout`]; the
//! optimizer (Adam or RMSprop) and the gradient step in [`optimizer`].
//!
//! Resume (`run.resume_from`): the model, optimizer (unless
//! `run.reset_optimizer`), counters and RNG come from the checkpoint. Weights
//! versions are a publication counter that never goes back: the first
//! version published after a resume is one above the highest version any
//! learner of the run published (`checkpoints/published.json`), carrying the
//! checkpoint's weights; the replay buffer is asked for fragments acted by
//! that version or newer only, so rollouts of the abandoned timeline are
//! dropped. `updates`, `env_steps` and `vec_steps` continue from the
//! checkpoint, so the updates made after it before a crash are redone; each
//! metric report carries `learner_resumed_at_vec_steps` (0 for a fresh
//! start) and `learner_rollout_vec_steps`, so a reader can check that the
//! series continues without gap or overlap. `run.init_from` loads only the
//! weights (and the optimizer unless reset) of another run's checkpoint.
//!
//! Normalisation (`normalize:` with `obs` or `reward` on, as SB3's
//! `VecNormalize`): the env-runners normalise (see `relay-env-runner`), so
//! the fragments' observations are already the normalised ones the policy
//! acted on and the learner never renormalises them. It holds the run's
//! statistics: each fragment's `norm_delta` (the statistics of the raw data
//! its env-runner saw since its previous fragment) is merged into them as
//! the fragment arrives (also when it is then dropped as stale: the data
//! was seen); with `normalize.reward` the fragment's `norm_rewards` replace
//! its raw `rewards` for every algorithm. A fragment of a normalising run
//! without them is rejected by name. The statistics travel with every
//! weights version (`WeightsUpdate.normalizer`) and are saved in each
//! checkpoint (`vec_normalize.safetensors`); resume continues from them
//! (`run.init_from` takes them too when the checkpoint has them).
//!
//! Text runs (`run.env_id` a text game) train a LoRA adapter on games
//! instead: see [`text`]. DQN (`run.algo: dqn`) and SAC (`run.algo: sac`)
//! train off-policy on the replay-buffer's transition table, each with its
//! own loop: see [`dqn`] and [`sac`].

pub mod checkpoint;
pub mod dqn;
pub mod evaluated;
pub mod examples;
mod league;
mod offpolicy;
mod onpolicy;
pub mod progress;
mod publish;
pub mod sac;
pub mod text;

// The updates themselves are relay-algo's (pure, shared with the benchmarks).
pub use relay_algo::{a2c, optimizer, ppo, reinforce, rollout};

use relay_config::Algo;
use relay_kit::{Service, ServiceConfig, ServiceError, Shutdown};

pub use onpolicy::normalisation_intake;
use progress::Metrics;
pub use progress::Progress;

/// Runs the learner until shutdown: the loop of the run's kind (text game,
/// on-policy or off-policy algorithm).
pub async fn run(config: ServiceConfig, shutdown: Shutdown) -> Result<(), ServiceError> {
    let service = Service::start("learner", config, shutdown.clone()).await?;
    // From here on the service stops on the caller's signal or its own failure.
    let shutdown = service.shutdown.clone();
    let metrics = Metrics::register(&service.registry);
    if service.config.is_text_game() {
        return text::run(service, shutdown, metrics).await;
    }
    match service.config.run.algo {
        Algo::Ppo | Algo::A2c | Algo::Reinforce => onpolicy::run(service, shutdown, metrics).await,
        Algo::Dqn => {
            let dqn = dqn::Dqn::new(&service.config)?;
            offpolicy::run(service, shutdown, metrics, dqn).await
        }
        Algo::Sac => {
            let sac = sac::SacLearner::new(&service.config)?;
            offpolicy::run(service, shutdown, metrics, sac).await
        }
    }
}
