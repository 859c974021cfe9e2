//! The on-policy loop (PPO, A2C, REINFORCE): gather fresh fragments no
//! older than the policy lag allows, update, publish, checkpoint (see the
//! crate docs for the whole cycle, resume and normalisation).
//!
//! A stop in the middle of an update (a PPO update of many minibatches can
//! take minutes on CPU) ends it before its next gradient step; the
//! learner's state taken before the update is put back, so the final
//! checkpoint holds the last whole update, as if the stop had come
//! between two.

use std::path::Path;
use std::time::{Duration, Instant};

use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use relay_config::{Algo, ExperimentConfig};
use relay_kit::{counter, gauge, Service, ServiceError, Shutdown};
use relay_nn::{ActorCritic, VecNormalize};
use relay_policy::PolicyWeights;
use relay_proto::{MetricValue, RolloutFragment, SampleReply, SampleRequest, SCHEMA_VERSION};

use crate::evaluated::RunEvents;
use crate::optimizer::{Optimizer, OptimizerState};
use crate::progress::{
    count_resume, finish_run, pause, should_finish, Metrics, Progress, LINKS_LAST,
    LINKS_LAST_SOLVED,
};
use crate::publish::{final_weights, Publisher};
use crate::rollout::UpdateError;
use crate::{a2c, checkpoint, ppo, reinforce, rollout};
use relay_nn::BatchShare;
use relay_replicas::{Next, Replicas, Replicated, Turn, Undo};

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

/// What the fragments taken since the last update hold.
#[derive(Debug, Default, Clone, Copy, serde::Serialize, serde::Deserialize)]
struct Pending {
    env_steps: u64,
    vec_steps: u64,
    episodes: u64,
}

impl Pending {
    pub(crate) fn of(f: &RolloutFragment) -> Self {
        Self {
            env_steps: f.env_steps(),
            vec_steps: f.num_steps as u64,
            episodes: f.episodes_ended(),
        }
    }

    pub(crate) fn add(&mut self, other: Self) {
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

/// The data of one update, as rank 0 gathered it and hands it out.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
enum Batch {
    /// PPO's rollout or A2C's fragments.
    Fragments(Vec<RolloutFragment>),
    /// REINFORCE's finished episodes.
    Episodes(Vec<reinforce::Episode>),
}

/// One update on `batch` with the sums of `sync`. `progress` is
/// `env_steps / budget`, for the schedules.
fn update(
    cfg: &ExperimentConfig,
    model: &ActorCritic,
    optimizer: &mut Optimizer,
    batch: &Batch,
    progress: f64,
    rng: &mut ChaCha8Rng,
    sync: &mut BatchShare<'_>,
) -> Result<Updated, UpdateError> {
    if sync.stopping() {
        return Err(UpdateError::Stopped);
    }
    match (cfg.run.algo, batch) {
        (Algo::Reinforce, Batch::Episodes(batch)) => {
            let stats = reinforce::update(model, optimizer, batch, &cfg.reinforce, progress, sync)?;
            Ok(Updated {
                metrics: stats.metrics(),
                oldest_version: stats.oldest_version,
            })
        }
        (Algo::A2c | Algo::Ppo, Batch::Fragments(fragments)) => {
            let (gamma, gae_lambda) = match cfg.run.algo {
                Algo::A2c => (cfg.a2c.gamma, cfg.a2c.gae_lambda),
                _ => (cfg.ppo.gamma, cfg.ppo.gae_lambda),
            };
            let rollout = rollout::prepare(model, fragments, gamma, gae_lambda)?;
            let metrics = match cfg.run.algo {
                Algo::A2c => {
                    a2c::update(model, optimizer, &rollout, &cfg.a2c, progress, sync)?.metrics()
                }
                _ => ppo::update(model, optimizer, &rollout, &cfg.ppo, progress, rng, sync)?
                    .metrics(),
            };
            Ok(Updated {
                metrics,
                oldest_version: rollout.oldest_version,
            })
        }
        (algo, _) => Err(UpdateError::Replicas(format!(
            "a batch of the wrong kind for {algo}: the replicas run different algorithms"
        ))),
    }
}

/// Update number `updates` (the count before it) on `batch`, as rank 0
/// hands it to the other replicas.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
struct StepInput {
    updates: u64,
    frac: f64,
    taken: Pending,
    batch: Batch,
    /// Rank 0's best evaluation so far, for whoever leads next.
    best_eval: Option<(f64, u64)>,
    /// The run's normalisation statistics after taking the batch's
    /// fragments, for whoever leads next.
    normalizer: Option<Box<VecNormalize>>,
}

/// The learner's whole state, in memory: what rank 0 hands to every
/// replica of a new view, and the rollback point of a replicated step (or
/// of an update a stop cut short).
#[derive(serde::Serialize, serde::Deserialize)]
struct ReplicaState {
    params: Vec<relay_nn::NamedTensor>,
    optimizer: OptimizerState,
    /// The run's normalisation statistics, for runs that normalise.
    normalizer: Option<VecNormalize>,
    progress: Progress,
    rng: relay_runs::checkpoint::RngState,
    version_floor: u64,
}

/// What the replicas hold alike and step together: the model, its
/// optimizer, the run's normalisation statistics and the counters.
struct OnPolicy<'c> {
    cfg: &'c ExperimentConfig,
    model: ActorCritic,
    optimizer: Optimizer,
    normalizer: Option<VecNormalize>,
    progress: Progress,
    rng: ChaCha8Rng,
    /// The oldest version whose rollouts belong to this learner's timeline.
    version_floor: u64,
}

impl Replicated for OnPolicy<'_> {
    type State = ReplicaState;
    type Step = StepInput;
    type Output = Updated;
    type Error = UpdateError;
    // A whole update can take minutes (a CNN on CPU).
    const STOPS_PART_WAY: bool = true;
    const UNDO: Undo = Undo::Snapshot;

    fn capture(&self) -> Result<ReplicaState, String> {
        Ok(ReplicaState {
            params: self.model.named_tensors(),
            optimizer: self.optimizer.state().map_err(|e| e.to_string())?,
            normalizer: self.normalizer.clone(),
            progress: self.progress.clone(),
            rng: relay_runs::checkpoint::RngState::capture(&self.rng),
            version_floor: self.version_floor,
        })
    }

    /// Parameters and optimizer validated as a checkpoint's are.
    fn restore(&mut self, state: ReplicaState) -> Result<(), String> {
        self.model
            .load_named_tensors(&state.params)
            .map_err(|e| e.to_string())?;
        self.optimizer
            .set_state(state.optimizer)
            .map_err(|e| e.to_string())?;
        match (&mut self.normalizer, state.normalizer) {
            (Some(n), Some(held)) => *n = held,
            (None, None) => {}
            _ => return Err("one side normalises and the other does not".into()),
        }
        self.rng = state.rng.restore()?;
        self.progress = state.progress;
        self.version_floor = state.version_floor;
        Ok(())
    }

    fn took_over(&mut self) {
        // The old rank 0 may have published one version past what this
        // replica holds: skip it.
        self.progress.version += 2;
    }

    fn describe(step: &StepInput) -> String {
        step.updates.to_string()
    }

    fn is_next(&self, step: &StepInput) -> bool {
        step.updates == self.progress.updates
    }

    fn run(
        &mut self,
        step: &StepInput,
        share: &mut BatchShare<'_>,
    ) -> Result<Updated, UpdateError> {
        update(
            self.cfg,
            &self.model,
            &mut self.optimizer,
            &step.batch,
            step.frac,
            &mut self.rng,
            share,
        )
    }

    fn stopped(error: &UpdateError) -> bool {
        matches!(error, UpdateError::Stopped)
    }
}

/// What an update reports beside the loop's own counters.
struct Updated {
    /// The algorithm's metrics (losses, learning rate, ...).
    metrics: Vec<MetricValue>,
    /// Oldest policy version that acted in the data trained on.
    oldest_version: u64,
}

impl Algorithm {
    pub(crate) fn for_run(cfg: &ExperimentConfig, model: &ActorCritic) -> Self {
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
    pub(crate) fn wants(&self, cfg: &ExperimentConfig) -> Option<u64> {
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
    pub(crate) fn absorb(&mut self, fragment: RolloutFragment) -> Result<(), UpdateError> {
        match self {
            Self::Ppo(f) | Self::A2c(f) => {
                f.push(fragment);
                Ok(())
            }
            Self::Reinforce(episodes) => episodes.absorb(&fragment),
        }
    }

    /// Takes what was gathered for one update.
    pub(crate) fn take_batch(&mut self) -> Batch {
        match self {
            Self::Ppo(f) | Self::A2c(f) => Batch::Fragments(std::mem::take(f)),
            Self::Reinforce(episodes) => Batch::Episodes(episodes.take_finished()),
        }
    }

    /// After an update: data acted by versions below `min_version` is no
    /// longer trained on (PPO and A2C hold none between updates).
    pub(crate) fn forget_older_than(&mut self, min_version: u64) {
        if let Self::Reinforce(episodes) = self {
            episodes.prune(min_version);
        }
    }
}

/// Asks the replay buffer for up to `max_steps` env steps of fragments no
/// older than `oldest_fresh` and gives each valid one to `algorithm`
/// (rejecting by name what does not belong to the run).
#[allow(clippy::too_many_arguments)]
async fn gather(
    service: &Service,
    shutdown: &Shutdown,
    cfg: &ExperimentConfig,
    metrics: &Metrics,
    algorithm: &mut Algorithm,
    mut normalizer: Option<&mut VecNormalize>,
    pending: &mut Pending,
    dropped_stale: &mut u64,
    oldest_fresh: u64,
    version: u64,
    max_steps: u64,
) {
    let ask = SampleRequest {
        schema: SCHEMA_VERSION,
        min_policy_version: oldest_fresh,
        max_steps: max_steps.min(u32::MAX as u64) as u32,
    };
    let reply = match relay_kit::request::<_, SampleReply>(
        &service.nats,
        &service.subjects.replay_sample(),
        &ask,
        service.request_timeout(),
    )
    .await
    {
        Ok(reply) => reply,
        Err(e) => {
            tracing::debug!(error = %e, "sample failed; retrying");
            pause(shutdown, Duration::from_millis(50)).await;
            return;
        }
    };
    *dropped_stale += reply.dropped_stale;
    if reply.fragments.is_empty() {
        pause(shutdown, Duration::from_millis(1)).await;
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
        if let Some(n) = normalizer.as_deref_mut() {
            if let Err(rejection) = normalisation_intake(n, &mut f) {
                service.intake.reject("replay.sample", &rejection);
                continue;
            }
        }
        // The buffer only drops what is older than we asked; a fragment
        // that became stale while we gathered goes too.
        if relay_proto::is_stale(f.policy_version, oldest_fresh) {
            *dropped_stale += 1;
            continue;
        }
        metrics
            .policy_lag
            .observe(version.saturating_sub(f.policy_version) as f64);
        let taken = Pending::of(&f);
        match algorithm.absorb(f) {
            Ok(()) => pending.add(taken),
            Err(e) => tracing::error!(error = %e, "fragment dropped"),
        }
    }
}

/// Trains a PPO, A2C or REINFORCE run until shutdown.
pub(crate) async fn run(
    service: Service,
    shutdown: Shutdown,
    metrics: Metrics,
) -> Result<(), ServiceError> {
    let cfg = service.config.clone();
    let spec = relay_policy::spec_for(&cfg).map_err(ServiceError::other)?;
    let device = relay_policy::policy_device(&cfg).map_err(ServiceError::other)?;
    let mut model = ActorCritic::with_layout(&spec, cfg.policy.trunk, cfg.run.seed)
        .and_then(|m| m.to_device(&device))
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
                relay_policy::load_normalizer(dir, n).map_err(|e| from.error(e))?;
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
    let mut replicas = Replicas::join(&service).await?;
    let mut work = OnPolicy {
        cfg: &cfg,
        model,
        optimizer,
        normalizer,
        progress,
        rng,
        version_floor,
    };
    // Rank 0 alone publishes and takes the run's events (a replica that
    // takes over starts then).
    let mut leading: Option<(Publisher<PolicyWeights>, RunEvents<PolicyWeights>)> = None;
    let weights = |work: &OnPolicy| {
        let mut update =
            PolicyWeights::of(&work.model, work.progress.version, work.progress.env_steps);
        update.normalizer = work.normalizer.as_ref().map(relay_policy::norm_stats);
        update
    };
    service.health.set_ready(true);
    tracing::info!(env_id = %cfg.run.env_id, algo = %cfg.run.algo, params = work.model.named_tensors().iter().map(|t| t.2.len()).sum::<usize>(), "training starts");

    let budget = cfg.run.total_env_steps;
    let lag = |floor| relay_proto::PolicyLag {
        max_lag: cfg.replay.max_policy_lag,
        floor,
    };
    // What the fragments taken since the last update hold.
    let mut pending = Pending::default();
    let (mut dropped_stale, mut reported_stale) = (0u64, 0u64);
    let started = Instant::now();
    let start_env_steps = work.progress.env_steps;
    // The step handed out and not yet applied: kept across a failed step
    // so that the replicas redo it in the next view.
    let mut held: Option<StepInput> = None;
    let finish = loop {
        // A new view: rank 0's state goes to every replica.
        match replicas.sync_view(&mut work, &shutdown).await? {
            Next::Go(true) => metrics.version.set(work.progress.version as i64),
            Next::Go(false) => {}
            Next::Retry => continue,
            Next::Stop => break crate::progress::Finish::Shutdown,
        }
        if replicas.leads() && leading.is_none() {
            let serving = Publisher::serve(&service, &micro, &run_dir).await?;
            let mut events = RunEvents::subscribe(&service, best_eval).await?;
            let first = weights(&work);
            serving.publish(&service, &first, &Default::default()).await;
            events.record(first.version, first);
            metrics.version.set(work.progress.version as i64);
            leading = Some((serving, events));
        }
        let lag = lag(work.version_floor);

        let input = if let Some((_, events)) = leading.as_mut() {
            if let Some(finish) = should_finish(
                &shutdown,
                work.progress.env_steps,
                budget,
                &events.solved,
                cfg.run.stop_when_solved,
            ) {
                replicas.announce_stop().await;
                break finish;
            }
            // Take announcements (solved), evaluation starts and reports
            // without waiting; checkpoint each new best and the solving version.
            checkpoint_evaluations(events, &service, &run_dir, &work);
            best_eval = events.best_eval;
            Some(match held.take() {
                // A step that failed in the previous view is redone.
                Some(input) => input,
                None => {
                    // Gather what the algorithm needs.
                    if let Some(max_steps) = algorithm.wants(&cfg) {
                        gather(
                            &service,
                            &shutdown,
                            &cfg,
                            &metrics,
                            &mut algorithm,
                            work.normalizer.as_mut(),
                            &mut pending,
                            &mut dropped_stale,
                            lag.oldest_fresh(work.progress.version),
                            work.progress.version,
                            max_steps,
                        )
                        .await;
                        continue;
                    }
                    StepInput {
                        updates: work.progress.updates,
                        frac: work.progress.env_steps as f64 / budget as f64,
                        taken: std::mem::take(&mut pending),
                        batch: algorithm.take_batch(),
                        best_eval,
                        normalizer: work
                            .normalizer
                            .as_ref()
                            .filter(|_| !replicas.alone())
                            .map(|n| Box::new(n.clone())),
                    }
                }
            })
        } else {
            // A follower: the step barrier waits for rank 0's step.
            None
        };

        let update_started = Instant::now();
        let (input, updated) = match replicas
            .run_step(&mut work, input, &mut held, &shutdown)
            .await?
        {
            Turn::Done { step, output } => (step, output),
            Turn::Failed { error, .. } => {
                // Bad data must not stop training: drop this rollout and go on.
                tracing::error!(error = %error, "update failed; rollout dropped");
                continue;
            }
            Turn::Again => continue,
            Turn::Stop => break crate::progress::Finish::Shutdown,
        };
        let StepInput {
            taken,
            best_eval: best_eval_after,
            normalizer: normalizer_after,
            ..
        } = input;
        if leading.is_none() {
            best_eval = best_eval_after;
            if let (Some(n), Some(after)) = (work.normalizer.as_mut(), normalizer_after) {
                *n = *after;
            }
        }
        let progress = &mut work.progress;
        progress.updates += 1;
        progress.version += 1;
        progress.env_steps += taken.env_steps;
        progress.vec_steps += taken.vec_steps;
        progress.episodes += taken.episodes;
        algorithm.forget_older_than(lag.oldest_fresh(progress.version));
        metrics.version.set(progress.version as i64);
        let seconds = update_started.elapsed().as_secs_f64();
        let replica_values = replicas.gauges(work.progress.updates);
        replicas
            .check_parameters(work.progress.updates, || work.model.named_tensors())
            .await?;
        let Some((serving, events)) = leading.as_mut() else {
            service
                .report(Some(work.progress.vec_steps), replica_values)
                .await;
            continue;
        };
        let update = weights(&work);
        serving
            .publish(&service, &update, &Default::default())
            .await;
        events.record(update.version, update);
        metrics.update_seconds.observe(seconds);
        let progress = &work.progress;
        let sps = progress.env_steps.saturating_sub(start_env_steps) as f64
            / started.elapsed().as_secs_f64().max(1e-3);
        let mut values =
            crate::progress::report_gauges(progress, budget, sps, resumed_at_vec_steps);
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
        values.extend(replica_values);
        values.extend(updated.metrics);
        service.report(Some(progress.vec_steps), values).await;
        reported_stale = dropped_stale;
        if progress.updates.is_multiple_of(cfg.checkpoint_every()) {
            let state = checkpoint::CheckpointState::of(progress, &work.rng, events.best_eval);
            save_checkpoint(&run_dir, &work, &state, LINKS_LAST, None);
        }
    };
    replicas.leave().await;
    let Some((_latest, mut events)) = leading else {
        // A follower: rank 0 finishes the run; this replica waits for shutdown.
        shutdown.wait().await;
        let _ = micro.stop().await;
        return service.finish().await;
    };

    // Reports that arrived as training stopped.
    checkpoint_evaluations(&mut events, &service, &run_dir, &work);
    let state = checkpoint::CheckpointState::of(&work.progress, &work.rng, events.best_eval);
    let (state, links, evaluated) = match final_weights(&cfg, &events) {
        Some((version, weights)) => (state.holding(version), LINKS_LAST_SOLVED, Some(weights)),
        None => (state, LINKS_LAST, None),
    };
    save_checkpoint(&run_dir, &work, &state, links, evaluated.as_deref());
    finish_run(
        &service,
        &shutdown,
        micro,
        &finish,
        format!("{budget} env steps"),
        work.progress.version,
        work.progress.env_steps,
        || checkpoint_evaluations(&mut events, &service, &run_dir, &work),
    )
    .await
}

/// Takes the run's events without waiting and writes the checkpoints of
/// evaluated weights they ask for (best, solved), with the rest of the
/// learner's state as it is now.
fn checkpoint_evaluations(
    events: &mut RunEvents<PolicyWeights>,
    service: &Service,
    run_dir: &Path,
    work: &OnPolicy,
) {
    for save in events.poll(service) {
        let state = checkpoint::CheckpointState::of(&work.progress, &work.rng, events.best_eval)
            .holding(save.version);
        save_checkpoint(run_dir, work, &state, &save.links, Some(&save.weights));
    }
}

fn save_checkpoint(
    run_dir: &Path,
    work: &OnPolicy,
    state: &checkpoint::CheckpointState,
    links: &[&str],
    evaluated: Option<&PolicyWeights>,
) {
    checkpoint::log_written(
        checkpoint::save(
            run_dir,
            &work.model,
            &work.optimizer,
            work.normalizer.as_ref(),
            state,
            work.cfg,
            links,
            evaluated,
        ),
        state.weights_version.unwrap_or(state.progress.version),
        links,
    );
}
