//! learner: trains the policy of a classic-control run with PPO ([`ppo`]),
//! A2C ([`a2c`]) or REINFORCE ([`reinforce`]), as `run.algo` says, on
//! rollouts pulled from the replay buffer, and publishes each new weights
//! version.
//!
//! One learner per run. Its loop, the same for every algorithm: gather what
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

pub mod a2c;
pub mod checkpoint;
pub mod dqn;
pub mod evaluated;
pub mod examples;
mod offpolicy;
pub mod optimizer;
pub mod ppo;
pub mod reinforce;
pub mod rollout;
pub mod sac;
pub mod text;

use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::StreamExt;
use prometheus::{Histogram, HistogramOpts, IntGauge};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use relay_config::{Algo, ExperimentConfig};
use relay_kit::{counter, gauge, Service, ServiceConfig, ServiceError, Shutdown};
use relay_nn::{ActorCritic, VecNormalize};
use relay_proto::{
    MetricValue, RolloutFragment, RunStatus, RunStatusUpdate, SampleReply, SampleRequest,
    TransitionBatch, TransitionSampleRequest, WeightsRequest, WeightsUpdate, SCHEMA_VERSION,
};

use crate::evaluated::RunEvents;
use crate::optimizer::Optimizer;
use crate::rollout::UpdateError;

/// Counters that a checkpoint carries.
#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize, PartialEq)]
pub struct Progress {
    pub version: u64,
    pub updates: u64,
    pub env_steps: u64,
    pub vec_steps: u64,
    /// Training episodes that ended in the rollouts trained on (0 in
    /// checkpoints written before it was counted).
    #[serde(default)]
    pub episodes: u64,
}

impl Progress {
    /// The progress gauges every learner reports after an update: counters,
    /// the version, the fraction of the `budget` (env steps) spent, SPS and
    /// the ETA at that rate.
    pub fn report_gauges(
        &self,
        budget: u64,
        sps: f64,
        resumed_at_vec_steps: u64,
    ) -> Vec<relay_proto::MetricValue> {
        vec![
            gauge("learner_updates", self.updates as f64),
            gauge("learner_policy_version", self.version as f64),
            gauge("learner_env_steps", self.env_steps as f64),
            gauge("learner_vec_steps", self.vec_steps as f64),
            gauge("learner_episodes", self.episodes as f64),
            gauge("learner_resumed_at_vec_steps", resumed_at_vec_steps as f64),
            gauge(
                "learner_progress",
                (self.env_steps as f64 / budget as f64).min(1.0),
            ),
            gauge("learner_sps", sps),
            gauge(
                "learner_eta_seconds",
                budget.saturating_sub(self.env_steps) as f64 / sps.max(1e-9),
            ),
        ]
    }
}

/// A normalising run's intake of one fragment: merges its statistics delta
/// into the run's statistics and, with `normalize.reward`, puts its scaled
/// rewards in place of the raw ones (see the module docs). A fragment
/// without what the run needs is refused, and nothing changes.
pub fn normalisation_intake(
    normalizer: &mut VecNormalize,
    fragment: &mut RolloutFragment,
) -> Result<(), relay_proto::Rejection> {
    let invalid = |field: &'static str, detail: String| relay_proto::Rejection::Invalid {
        kind: "RolloutFragment",
        field,
        detail,
    };
    let Some(stats) = &fragment.norm_delta else {
        return Err(invalid(
            "norm_delta",
            format!(
                "fragment from {} carries no normalisation statistics, but this run normalises (`normalize` section)",
                fragment.runner_id
            ),
        ));
    };
    if normalizer.config.norm_reward && fragment.norm_rewards.is_none() {
        return Err(invalid(
            "norm_rewards",
            format!(
                "fragment from {} carries no scaled rewards, but this run has normalize.reward on",
                fragment.runner_id
            ),
        ));
    }
    normalizer
        .merge(&relay_policy::stats_delta(stats))
        .map_err(|e| invalid("norm_delta", e.to_string()))?;
    if normalizer.config.norm_reward {
        fragment.rewards = fragment.norm_rewards.take().expect("checked above");
    }
    Ok(())
}

/// Why training stopped.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Finish {
    Budget,
    Solved(String),
    Shutdown,
}

/// Why training must stop before the next step, if it must: shutdown
/// asked for, the budget of env steps spent, or the run solved (with
/// `run.stop_when_solved`).
pub(crate) fn should_finish(
    shutdown: &Shutdown,
    env_steps: u64,
    budget: u64,
    solved: &Option<String>,
    stop_when_solved: bool,
) -> Option<Finish> {
    if shutdown.is_triggered() {
        Some(Finish::Shutdown)
    } else if env_steps >= budget {
        Some(Finish::Budget)
    } else {
        solved
            .as_ref()
            .filter(|_| stop_when_solved)
            .map(|detail| Finish::Solved(detail.clone()))
    }
}

/// Links of a checkpoint of the learner's own state (periodic, final).
pub(crate) const LINKS_LAST: &[&str] = &["last"];
/// Links of the final checkpoint of a run stopped because it is solved: it
/// holds the solving version's weights.
pub(crate) const LINKS_LAST_SOLVED: &[&str] = &["last", "solved"];

/// The weights a learner's final checkpoint holds when they are not its
/// current ones: with `run.stop_when_solved`, the solving version's (when
/// its weights were kept), also when shutdown came before the learner
/// stopped on its own.
pub(crate) fn final_weights<S>(
    cfg: &ExperimentConfig,
    events: &RunEvents<S>,
) -> Option<(u64, std::sync::Arc<S>)> {
    events
        .solved_weights
        .clone()
        .filter(|_| cfg.run.stop_when_solved)
}

/// The end every learner shares: announces how training ended (`budget`
/// names what the budget counts), keeps answering requests for the final
/// weights or adapter until the stack stops, then drains. Meanwhile, and
/// once more at shutdown, `evaluations` takes the reports that still
/// arrive (the evaluation of the last versions) and checkpoints them.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn finish_run(
    service: &Service,
    shutdown: &Shutdown,
    micro: async_nats::service::Service,
    finish: &Finish,
    budget: String,
    version: u64,
    env_steps: u64,
    mut evaluations: impl FnMut(),
) {
    let (status, detail) = match finish {
        Finish::Budget => (RunStatus::Stopped, format!("budget of {budget} spent")),
        Finish::Solved(d) => (RunStatus::Solved, d.clone()),
        Finish::Shutdown => (RunStatus::Stopped, "shutdown requested".to_string()),
    };
    tracing::info!(?status, %detail, version, env_steps, "training finished");
    let update = RunStatusUpdate {
        schema: SCHEMA_VERSION,
        status,
        service: "learner".into(),
        policy_version: version,
        detail,
    };
    service.publish(service.subjects.status(), &update).await;
    loop {
        tokio::select! {
            _ = shutdown.wait() => break,
            _ = tokio::time::sleep(Duration::from_millis(100)) => evaluations(),
        }
    }
    evaluations();
    service.health.set_ready(false);
    let _ = micro.stop().await;
    service.drain().await;
}

/// What the fragments taken since the last update hold.
#[derive(Debug, Default, Clone, Copy)]
struct Pending {
    env_steps: u64,
    vec_steps: u64,
    episodes: u64,
}

impl Pending {
    fn of(f: &RolloutFragment) -> Self {
        Self {
            env_steps: f.env_steps(),
            vec_steps: f.num_steps as u64,
            episodes: f.episodes_ended(),
        }
    }

    fn add(&mut self, other: Self) {
        self.env_steps += other.env_steps;
        self.vec_steps += other.vec_steps;
        self.episodes += other.episodes;
    }
}

/// The run's algorithm (`run.algo`) with what it has gathered towards its
/// next update: the seam between the shared loop of [`run`] and the
/// algorithm modules.
enum Algorithm {
    /// [`ppo`]: fragments until `ppo.rollout_steps` env steps.
    Ppo(Vec<RolloutFragment>),
    /// [`a2c`]: fragments until `a2c.n_steps x env_runner.num_envs` env
    /// steps (one fragment of an env-runner).
    A2c(Vec<RolloutFragment>),
    /// [`reinforce`]: whole episodes until `reinforce.batch_episodes`.
    Reinforce(reinforce::Episodes),
}

/// What an update reports beside the loop's own counters.
struct Updated {
    /// The algorithm's metrics (losses, learning rate, ...).
    metrics: Vec<MetricValue>,
    /// Oldest policy version that acted in the data trained on.
    oldest_version: u64,
}

impl Algorithm {
    fn for_run(cfg: &ExperimentConfig, model: &ActorCritic) -> Self {
        match cfg.run.algo {
            Algo::A2c => Self::A2c(Vec::new()),
            Algo::Reinforce => Self::Reinforce(reinforce::Episodes::new(
                model.spec().obs_dim,
                rollout::action_dim(model),
            )),
            Algo::Ppo | Algo::Dqn | Algo::Sac => Self::Ppo(Vec::new()),
        }
    }

    /// Env steps to ask the replay buffer for, or none when ready to update.
    fn wants(&self, cfg: &ExperimentConfig) -> Option<u64> {
        let missing = |fragments: &[RolloutFragment], want: u64| {
            let have: u64 = fragments.iter().map(RolloutFragment::env_steps).sum();
            (have < want).then(|| want - have)
        };
        match self {
            Self::Ppo(f) => missing(f, cfg.ppo.rollout_steps as u64),
            Self::A2c(f) => missing(f, (cfg.a2c.n_steps * cfg.env_runner.num_envs) as u64),
            Self::Reinforce(episodes) => (episodes.finished() < cfg.reinforce.batch_episodes)
                .then_some(cfg.replay.capacity_steps),
        }
    }

    /// Takes a fresh fragment of this run.
    fn absorb(&mut self, fragment: RolloutFragment) -> Result<(), UpdateError> {
        match self {
            Self::Ppo(f) | Self::A2c(f) => {
                f.push(fragment);
                Ok(())
            }
            Self::Reinforce(episodes) => episodes.absorb(&fragment),
        }
    }

    /// One update on what was gathered, which is used up whether or not it
    /// succeeds. `progress` is `env_steps / budget`, for the schedules.
    fn update(
        &mut self,
        cfg: &ExperimentConfig,
        model: &ActorCritic,
        optimizer: &mut Optimizer,
        progress: f64,
        rng: &mut ChaCha8Rng,
    ) -> Result<Updated, UpdateError> {
        match self {
            Self::Ppo(f) => {
                let fragments = std::mem::take(f);
                let p = &cfg.ppo;
                let rollout = rollout::prepare(model, &fragments, p.gamma, p.gae_lambda)?;
                let stats = ppo::update(model, optimizer, &rollout, p, progress, rng)?;
                Ok(Updated {
                    metrics: stats.metrics(),
                    oldest_version: rollout.oldest_version,
                })
            }
            Self::A2c(f) => {
                let fragments = std::mem::take(f);
                let a = &cfg.a2c;
                let rollout = rollout::prepare(model, &fragments, a.gamma, a.gae_lambda)?;
                let stats = a2c::update(model, optimizer, &rollout, a, progress)?;
                Ok(Updated {
                    metrics: stats.metrics(),
                    oldest_version: rollout.oldest_version,
                })
            }
            Self::Reinforce(episodes) => {
                let batch = episodes.take_finished();
                let stats = reinforce::update(model, optimizer, &batch, &cfg.reinforce, progress)?;
                Ok(Updated {
                    metrics: stats.metrics(),
                    oldest_version: stats.oldest_version,
                })
            }
        }
    }

    /// After an update: data acted by versions below `min_version` is no
    /// longer trained on (PPO and A2C hold none between updates).
    fn forget_older_than(&mut self, min_version: u64) {
        if let Self::Reinforce(episodes) = self {
            episodes.prune(min_version);
        }
    }
}

pub(crate) struct Metrics {
    pub(crate) version: IntGauge,
    pub(crate) policy_lag: Histogram,
    pub(crate) update_seconds: Histogram,
}

impl Metrics {
    fn register(registry: &prometheus::Registry) -> Self {
        let version = IntGauge::new(
            "relay_learner_weights_version",
            "Latest weights version published.",
        )
        .unwrap();
        let policy_lag = Histogram::with_opts(
            HistogramOpts::new(
                "relay_policy_lag",
                "Learner version minus the version that acted, per fragment trained on.",
            )
            .buckets(vec![0.0, 1.0, 2.0, 3.0, 5.0, 10.0]),
        )
        .unwrap();
        let update_seconds = Histogram::with_opts(
            HistogramOpts::new("relay_learner_update_seconds", "Wall time of one update.")
                .buckets(vec![0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0]),
        )
        .unwrap();
        relay_kit::metrics::register(registry, &version);
        relay_kit::metrics::register(registry, &policy_lag);
        relay_kit::metrics::register(registry, &update_seconds);
        Self {
            version,
            policy_lag,
            update_seconds,
        }
    }
}

/// Runs the learner until shutdown.
pub async fn run(config: ServiceConfig, shutdown: Shutdown) -> Result<(), ServiceError> {
    let service = Service::start("learner", config, shutdown.clone()).await?;
    let cfg = service.config.clone();
    let metrics = Metrics::register(&service.registry);
    if cfg.is_text_game() {
        return text::run(service, shutdown, metrics).await;
    }
    match cfg.run.algo {
        Algo::Dqn => {
            let dqn = dqn::Dqn::new(&service.config)?;
            return offpolicy::run(service, shutdown, metrics, dqn).await;
        }
        Algo::Sac => {
            let sac = sac::SacLearner::new(&service.config)?;
            return offpolicy::run(service, shutdown, metrics, sac).await;
        }
        Algo::Ppo | Algo::A2c | Algo::Reinforce => {}
    }
    let spec = relay_policy::spec_for(&cfg).map_err(ServiceError::other)?;
    let mut model = ActorCritic::with_layout(&spec, cfg.policy.trunk, cfg.run.seed)
        .map_err(ServiceError::other)?;
    let mut optimizer = Optimizer::for_run(&cfg, model.vars()).map_err(ServiceError::other)?;
    // The run's normalisation statistics (`normalize` section), merged from
    // the env-runners' deltas; never used to normalise here.
    let mut normalizer = match cfg.normalizer() {
        Some(norm) => Some(
            VecNormalize::new(norm, spec.obs_dim, 0)
                .map_err(|e| ServiceError::other(format!("normalize: {e}")))?,
        ),
        None => None,
    };
    let mut algorithm = Algorithm::for_run(&cfg, &model);
    let mut rng = ChaCha8Rng::seed_from_u64(cfg.run.seed.wrapping_add(0x5eed));
    let run_dir = cfg.run.runs_dir.join(cfg.run_id()?);
    let mut progress = Progress::default();
    let mut best_eval: Option<(f64, u64)> = None;
    // The oldest version whose rollouts belong to this learner's timeline.
    let mut version_floor = 0u64;
    let mut resumed_at_vec_steps = 0u64;
    let start_from = checkpoint::StartFrom::of(&cfg);
    if let Some(from) = &start_from {
        let dir = &from.dir;
        model
            .load(dir.join("model.safetensors"))
            .map_err(|e| from.error(e))?;
        if !cfg.run.reset_optimizer {
            optimizer
                .load(dir.join("optimizer.safetensors"))
                .map_err(|e| from.error(e))?;
        }
        if let Some(n) = normalizer.as_mut() {
            // A resumed run must find its statistics; a new run started
            // from another run's weights takes them when they are there.
            if from.resume || dir.join(checkpoint::VEC_NORMALIZE_FILE).is_file() {
                checkpoint::load_normalizer(dir, n).map_err(|e| from.error(e))?;
            }
        }
        if from.resume {
            checkpoint::Restored {
                progress,
                rng,
                best_eval,
            } = checkpoint::restore(dir, &run_dir, rng).map_err(|e| from.error(e))?;
            resumed_at_vec_steps = progress.vec_steps;
            version_floor = progress.version;
        }
        tracing::info!(from = %dir.display(), resume = from.resume, version = progress.version, updates = progress.updates, env_steps = progress.env_steps, vec_steps = progress.vec_steps, "loaded checkpoint");
    }
    count_resume(&service, &start_from);

    let micro = service.micro().await?;
    let latest = LatestWeights::serve(&service, &micro, &run_dir).await?;
    let weights = |model: &ActorCritic, normalizer: Option<&VecNormalize>, progress: &Progress| {
        let mut update = relay_policy::to_weights(model, progress.version, progress.env_steps);
        update.normalizer = normalizer.map(relay_policy::norm_stats);
        update
    };
    let mut events: RunEvents<WeightsUpdate> = RunEvents::subscribe(&service, best_eval).await?;
    let mut first = weights(&model, normalizer.as_ref(), &progress);
    latest.publish(&service, &mut first).await;
    events.record(first.version, first);
    metrics.version.set(progress.version as i64);
    service.health.set_ready(true);
    tracing::info!(env_id = %cfg.run.env_id, algo = %cfg.run.algo, params = model.named_tensors().iter().map(|t| t.2.len()).sum::<usize>(), "training starts");

    let budget = cfg.run.total_env_steps;
    let lag = relay_proto::PolicyLag {
        max_lag: cfg.replay.max_policy_lag,
        floor: version_floor,
    };
    // What the fragments taken since the last update hold.
    let mut pending = Pending::default();
    let (mut dropped_stale, mut reported_stale) = (0u64, 0u64);
    let started = Instant::now();
    let start_env_steps = progress.env_steps;
    let finish = loop {
        if let Some(finish) = should_finish(
            &shutdown,
            progress.env_steps,
            budget,
            &events.solved,
            cfg.run.stop_when_solved,
        ) {
            break finish;
        }
        // Take announcements (solved), evaluation starts and reports
        // without waiting; checkpoint each new best and the solving version.
        checkpoint_evaluations(
            &mut events,
            &service,
            &run_dir,
            (&model, &optimizer, normalizer.as_ref()),
            &cfg,
            &progress,
            &rng,
        );

        // Gather what the algorithm needs.
        if let Some(max_steps) = algorithm.wants(&cfg) {
            let ask = SampleRequest {
                schema: SCHEMA_VERSION,
                min_policy_version: lag.oldest_fresh(progress.version),
                max_steps: max_steps.min(u32::MAX as u64) as u32,
            };
            match relay_kit::request::<_, SampleReply>(
                &service.nats,
                &service.subjects.replay_sample(),
                &ask,
                service.request_timeout(),
            )
            .await
            {
                Ok(reply) => {
                    dropped_stale += reply.dropped_stale;
                    if reply.fragments.is_empty() {
                        pause(&shutdown, Duration::from_millis(1)).await;
                    }
                    for mut f in reply.fragments {
                        if f.env_id != cfg.run.env_id {
                            let detail = format!(
                                "fragment from {} is for {}, this run trains {}",
                                f.runner_id, f.env_id, cfg.run.env_id
                            );
                            service.intake.reject(
                                "replay.sample",
                                &relay_proto::Rejection::Invalid {
                                    kind: "RolloutFragment",
                                    field: "env_id",
                                    detail,
                                },
                            );
                            continue;
                        }
                        if let Some(n) = normalizer.as_mut() {
                            if let Err(rejection) = normalisation_intake(n, &mut f) {
                                service.intake.reject("replay.sample", &rejection);
                                continue;
                            }
                        }
                        // The buffer only drops what is older than we asked; a
                        // fragment that became stale while we gathered goes too.
                        if relay_proto::is_stale(
                            f.policy_version,
                            lag.oldest_fresh(progress.version),
                        ) {
                            dropped_stale += 1;
                            continue;
                        }
                        metrics
                            .policy_lag
                            .observe(progress.version.saturating_sub(f.policy_version) as f64);
                        let taken = Pending::of(&f);
                        match algorithm.absorb(f) {
                            Ok(()) => pending.add(taken),
                            Err(e) => tracing::error!(error = %e, "fragment dropped"),
                        }
                    }
                }
                Err(e) => {
                    tracing::debug!(error = %e, "sample failed; retrying");
                    pause(&shutdown, Duration::from_millis(50)).await;
                }
            }
            continue;
        }

        // Update.
        let update_started = Instant::now();
        let frac = progress.env_steps as f64 / budget as f64;
        let result = tokio::task::block_in_place(|| {
            algorithm.update(&cfg, &model, &mut optimizer, frac, &mut rng)
        });
        let taken = std::mem::take(&mut pending);
        let updated = match result {
            Ok(u) => u,
            Err(e) => {
                // Bad data must not stop training: drop this rollout and go on.
                tracing::error!(error = %e, "update failed; rollout dropped");
                continue;
            }
        };
        progress.updates += 1;
        progress.version += 1;
        progress.env_steps += taken.env_steps;
        progress.vec_steps += taken.vec_steps;
        progress.episodes += taken.episodes;
        algorithm.forget_older_than(lag.oldest_fresh(progress.version));
        let mut update = weights(&model, normalizer.as_ref(), &progress);
        latest.publish(&service, &mut update).await;
        events.record(update.version, update);
        metrics.version.set(progress.version as i64);
        let seconds = update_started.elapsed().as_secs_f64();
        metrics.update_seconds.observe(seconds);
        let sps = progress.env_steps.saturating_sub(start_env_steps) as f64
            / started.elapsed().as_secs_f64().max(1e-3);
        let mut values = progress.report_gauges(budget, sps, resumed_at_vec_steps);
        values.extend([
            gauge("learner_rollout_vec_steps", taken.vec_steps as f64),
            gauge("learner_last_update_seconds", seconds),
            gauge(
                "learner_policy_lag_max",
                progress.version.saturating_sub(updated.oldest_version + 1) as f64,
            ),
            counter(
                "learner_dropped_stale_fragments_total",
                (dropped_stale - reported_stale) as f64,
            ),
        ]);
        values.extend(updated.metrics);
        service.report(Some(progress.vec_steps), values).await;
        reported_stale = dropped_stale;
        if progress.updates % cfg.checkpoint_every() == 0 {
            let state = checkpoint::CheckpointState::of(&progress, &rng, events.best_eval);
            save_checkpoint(
                &run_dir,
                &model,
                &optimizer,
                normalizer.as_ref(),
                &state,
                &cfg,
                LINKS_LAST,
                None,
            );
        }
    };

    // Reports that arrived as training stopped.
    checkpoint_evaluations(
        &mut events,
        &service,
        &run_dir,
        (&model, &optimizer, normalizer.as_ref()),
        &cfg,
        &progress,
        &rng,
    );
    let state = checkpoint::CheckpointState::of(&progress, &rng, events.best_eval);
    let (state, links, evaluated) = match final_weights(&cfg, &events) {
        Some((version, weights)) => (state.holding(version), LINKS_LAST_SOLVED, Some(weights)),
        None => (state, LINKS_LAST, None),
    };
    save_checkpoint(
        &run_dir,
        &model,
        &optimizer,
        normalizer.as_ref(),
        &state,
        &cfg,
        links,
        evaluated.as_deref(),
    );
    finish_run(
        &service,
        &shutdown,
        micro,
        &finish,
        format!("{budget} env steps"),
        progress.version,
        progress.env_steps,
        || {
            checkpoint_evaluations(
                &mut events,
                &service,
                &run_dir,
                (&model, &optimizer, normalizer.as_ref()),
                &cfg,
                &progress,
                &rng,
            )
        },
    )
    .await;
    Ok(())
}

/// The newest published weights of the run: served on `weights.latest` to
/// services that join late, and recorded in the run directory before each
/// publish ([`checkpoint::record_published`]).
pub(crate) struct LatestWeights {
    run_dir: PathBuf,
    latest: Arc<RwLock<Bytes>>,
}

impl LatestWeights {
    /// Starts answering `weights.latest` until shutdown, in a background
    /// task (an empty answer until the first publish).
    pub(crate) async fn serve(
        service: &Service,
        micro: &async_nats::service::Service,
        run_dir: &Path,
    ) -> Result<Self, ServiceError> {
        let latest = Arc::new(RwLock::new(Bytes::new()));
        let mut weights_requests = micro
            .endpoint(service.subjects.weights_latest())
            .await
            .map_err(ServiceError::nats)?;
        let shutdown = service.shutdown.clone();
        let intake = service.intake.clone();
        let answers = latest.clone();
        tokio::spawn(async move {
            loop {
                let request = tokio::select! {
                    r = weights_requests.next() => match r { Some(r) => r, None => return },
                    _ = shutdown.wait() => return,
                };
                let answer = match intake
                    .decode::<WeightsRequest>("weights.latest", &request.message.payload)
                {
                    Ok(_) => Ok(answers.read().expect("weights lock").clone()),
                    Err(rejection) => Err(async_nats::service::error::Error {
                        status: rejection.to_string(),
                        code: 400,
                    }),
                };
                let _ = request.respond(answer).await;
            }
        });
        Ok(Self {
            run_dir: run_dir.to_path_buf(),
            latest,
        })
    }

    /// Records `update`'s version, keeps it as the latest and publishes it
    /// on `weights` (a failure is logged: the next version replaces it),
    /// stamped with the time of publishing.
    pub(crate) async fn publish(&self, service: &Service, update: &mut WeightsUpdate) {
        if let Err(e) = checkpoint::record_published(&self.run_dir, update.version) {
            tracing::warn!(error = %e, "could not record the published version");
        }
        update.published_unix_ms = relay_proto::unix_ms();
        let payload: Bytes = relay_proto::encode(update).into();
        *self.latest.write().expect("weights lock") = payload.clone();
        if payload.len() > relay_proto::MAX_MESSAGE_BYTES {
            tracing::error!(
                bytes = payload.len(),
                "weights exceed the message size limit; not published"
            );
            return;
        }
        if let Err(e) = service
            .nats
            .publish(service.subjects.weights(), payload)
            .await
        {
            tracing::warn!(error = %e, "weights publish failed");
        }
    }
}

/// Asks the replay-buffer's off-policy table for `batch_size` transitions
/// (0: only its counters), prioritized ones with importance weights at
/// `beta`.
pub(crate) async fn sample_transitions(
    service: &Service,
    batch_size: u32,
    beta: f64,
) -> Result<TransitionBatch, relay_kit::RequestError> {
    let ask = TransitionSampleRequest {
        schema: SCHEMA_VERSION,
        batch_size,
        beta,
    };
    relay_kit::request::<_, TransitionBatch>(
        &service.nats,
        &service.subjects.replay_transitions_sample(),
        &ask,
        service.request_timeout(),
    )
    .await
}

/// Waits `d`, or less if the service is shutting down.
pub(crate) async fn pause(shutdown: &Shutdown, d: Duration) {
    tokio::select! {
        _ = tokio::time::sleep(d) => {}
        _ = shutdown.wait() => {}
    }
}

/// Counts a start from the run's own checkpoint
/// (`relay_learner_resumes_total`; registered either way, so the series
/// exists from the start).
pub(crate) fn count_resume(service: &Service, start_from: &Option<checkpoint::StartFrom>) {
    let resumes = prometheus::IntCounter::new(
        "relay_learner_resumes_total",
        "Times this learner process started from a checkpoint of its own run.",
    )
    .unwrap();
    relay_kit::metrics::register(&service.registry, &resumes);
    if start_from.as_ref().is_some_and(|from| from.resume) {
        resumes.inc();
    }
}

/// Takes the run's events without waiting and writes the checkpoints of
/// evaluated weights they ask for (best, solved), with the rest of the
/// learner's state as it is now.
fn checkpoint_evaluations(
    events: &mut RunEvents<WeightsUpdate>,
    service: &Service,
    run_dir: &Path,
    (model, optimizer, normalizer): (&ActorCritic, &Optimizer, Option<&VecNormalize>),
    cfg: &ExperimentConfig,
    progress: &Progress,
    rng: &ChaCha8Rng,
) {
    for save in events.poll(service) {
        let state =
            checkpoint::CheckpointState::of(progress, rng, events.best_eval).holding(save.version);
        save_checkpoint(
            run_dir,
            model,
            optimizer,
            normalizer,
            &state,
            cfg,
            &save.links,
            Some(&save.weights),
        );
    }
}

#[allow(clippy::too_many_arguments)]
fn save_checkpoint(
    run_dir: &Path,
    model: &ActorCritic,
    optimizer: &Optimizer,
    normalizer: Option<&VecNormalize>,
    state: &checkpoint::CheckpointState,
    cfg: &ExperimentConfig,
    links: &[&str],
    evaluated: Option<&WeightsUpdate>,
) {
    checkpoint::log_written(
        checkpoint::save(
            run_dir, model, optimizer, normalizer, state, cfg, links, evaluated,
        ),
        state.weights_version.unwrap_or(state.progress.version),
        links,
    );
}
