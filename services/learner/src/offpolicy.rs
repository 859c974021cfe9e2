//! The loop every off-policy learner shares (DQN, SAC), read top to bottom
//! in [`run`]: training rounds on the replay-buffer's transition table on
//! SB3's schedule, weights published after a round (at most every
//! `learner.publish_interval_ms`, and after the last), checkpoints and
//! resume. What a round does to the networks is the algorithm's
//! ([`OffPolicyAlgorithm`], implemented in [`crate::dqn`] and
//! [`crate::sac`]).
//!
//! 1. Start: from `run.resume_from` (networks, optimizers, the algorithm's
//!    round bookkeeping, progress, RNG, best eval) or `run.init_from`
//!    (networks, optimizers unless `run.reset_optimizer`); publish the
//!    starting weights.
//! 2. Loop until the budget of env steps is spent (inserted, and every
//!    round due within it done), the run is solved (with
//!    `run.stop_when_solved`) or shutdown:
//!    - checkpoint each new best eval and the solving one, with the
//!      evaluated version's weights ([`crate::evaluated`]);
//!    - read the table's counters: env steps inserted by all env-runners
//!      together, which are the run's env steps (continued from the
//!      checkpoint's count after a resume);
//!    - when the next round is due ([`OffPolicyAlgorithm::next_round_due_at`]):
//!      prepare it as of the env step it was due at, take
//!      `gradient_steps` batches of `batch_size` transitions (waiting while
//!      the replay-buffer's rate limiter holds them back), one gradient
//!      step each (a batch that fails its step is skipped and counted), and
//!      send the new priorities back when the algorithm returns them;
//!    - count version + 1 and publish it when `learner.publish_interval_ms`
//!      has passed since the last published one, report metrics,
//!      checkpoint every `checkpoint_every` rounds.
//! 3. The newest version published if it was held back, a last checkpoint
//!    (a solved run's holds the solving version's weights), then the run's
//!    end is announced.
//!
//! A round's minibatches are all drawn before it trains (the next round's
//! draw is asked while it trains), so that with learner replicas
//! (`relay_replicas`) rank 0 draws them and hands the round to the
//! others whole: every replica trains its part of each minibatch, and
//! rank 0 alone talks to the replay-buffer, publishes and checkpoints.

use std::path::Path;
use std::time::{Duration, Instant};

use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use relay_config::ExperimentConfig;
use relay_kit::{gauge, Service, ServiceError, Shutdown};
use relay_policy::PolicyWeights;
use relay_proto::{
    MetricValue, PriorityAck, PriorityUpdate, Tensor, TransitionBatch, TransitionSampleRequest,
    MAX_TRANSITION_SAMPLE, SCHEMA_VERSION,
};

use crate::checkpoint::{self, CheckpointError, CheckpointState};
use crate::evaluated::RunEvents;
use crate::progress::{
    count_resume, finish_run, pause, should_finish, Finish, Metrics, Progress, LINKS_LAST,
    LINKS_LAST_SOLVED,
};
use crate::publish::{final_weights, Publisher};
use relay_nn::BatchShare;
use relay_nn::NamedTensor;
use relay_replicas::{Next, Replicas, Replicated, Turn, Undo};
use serde::{de::DeserializeOwned, Deserialize, Serialize};

/// SB3's round schedule of an off-policy learner (its config section's
/// fields of the same names).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct RoundSchedule {
    /// Env steps before the first round.
    pub learning_starts: u64,
    /// Env steps between rounds.
    pub train_freq: u64,
    /// Transitions per gradient step.
    pub batch_size: usize,
    /// Gradient steps per round.
    pub gradient_steps: usize,
}

impl RoundSchedule {
    /// Env steps at which round `rounds` (0-based) is due: the first
    /// multiple of `train_freq` above `learning_starts`, then every
    /// `train_freq`.
    pub fn due_at(&self, rounds: u64) -> u64 {
        (self.learning_starts / self.train_freq + 1 + rounds) * self.train_freq
    }
}

/// Gradient steps taken per env step inserted since `learning_starts`:
/// the replay ratio the run reached (held to `gradient_steps / train_freq`
/// unless `replay.samples_per_insert` is off).
fn replay_ratio_reached<A: OffPolicyAlgorithm>(algorithm: &A, env_steps: u64) -> f64 {
    let schedule = algorithm.schedule();
    let learning = env_steps.saturating_sub(schedule.learning_starts).max(1);
    (algorithm.rounds() * schedule.gradient_steps as u64) as f64 / learning as f64
}

/// What an off-policy algorithm brings to the shared loop.
pub(crate) trait OffPolicyAlgorithm {
    /// `run.algo`, for logs.
    const NAME: &'static str;
    /// Whether it reports priority updates lost to eviction
    /// (`learner_stale_priorities`): algorithms that can train on
    /// prioritized replay.
    const REPORTS_PRIORITIES: bool;
    /// Why loading, a round's preparation or a gradient step failed.
    type Error: std::fmt::Display;
    /// Everything a replica must hold alike (networks, optimizers, round
    /// bookkeeping): handed to the replicas of a new view, and the
    /// rollback point of a round.
    type State: Serialize + DeserializeOwned;

    /// Training rounds done.
    fn rounds(&self) -> u64;
    /// When rounds are due and how big they are.
    fn schedule(&self) -> RoundSchedule;
    /// Trainable parameters, for the log.
    fn num_parameters(&self) -> usize;
    /// Loads checkpoint folder `dir`: the networks, the optimizers when
    /// `optimizers`, and the round bookkeeping when `resume`.
    fn load(&mut self, dir: &Path, resume: bool, optimizers: bool) -> Result<(), Self::Error>;
    /// Writes the networks, optimizers and round bookkeeping into a
    /// checkpoint folder being written.
    fn save(&mut self, dir: &Path) -> Result<(), CheckpointError>;
    /// The weights the inference servers act with, as `progress.version`.
    fn weights(&self, progress: &Progress) -> PolicyWeights;
    /// The parameters whose digest the replicas compare.
    fn parameters(&self) -> Vec<NamedTensor>;
    /// This replica's state, in memory.
    fn capture(&self) -> Result<Self::State, Self::Error>;
    /// Puts a replica's state in place (validated as a checkpoint is).
    fn restore(&mut self, state: Self::State) -> Result<(), Self::Error>;
    /// The importance-sampling exponent β a round with `frac` of the
    /// budget spent samples with (1 when uniform).
    fn sampling_beta(&self, frac: f64) -> f64;
    /// Prepares the next round as of env step `due_at`, with `frac` of the
    /// budget spent (schedules, target network updates).
    fn begin_round(&mut self, due_at: u64, frac: f64) -> Result<(), Self::Error>;
    /// Gradient step `step` (0-based within the round) on `batch`, with
    /// `sync` summing across replicas; returns the whole batch's new
    /// priorities when replay is prioritized.
    fn gradient_step(
        &mut self,
        step: usize,
        batch: &TransitionBatch,
        rng: &mut ChaCha8Rng,
        sync: &mut BatchShare<'_>,
    ) -> Result<Option<Vec<f32>>, Self::Error>;
    /// Ends the round (one more done); returns its metrics.
    fn end_round(&mut self, frac: f64) -> Vec<MetricValue>;
    /// Whether replay is prioritized: each round's sample then waits for
    /// the last round's priorities, and is not drawn ahead.
    fn prioritized(&self) -> bool;
}

/// Runs `algorithm` on the run's transition table until the budget is
/// spent, the run is solved (with `run.stop_when_solved`) or shutdown.
///
/// With learner replicas (`relay_replicas`) rank 0 does all of the
/// above that touches the replay-buffer and the run: it draws each
/// round's minibatches and hands them out (the step barrier), then every
/// replica trains the round, each on its part of every minibatch, the
/// gradients and new priorities summed across replicas; rank 0 sends the
/// priorities back, publishes and checkpoints. A round a failure
/// interrupted is rolled back and redone in the next view.
pub(crate) async fn run<A: OffPolicyAlgorithm>(
    service: Service,
    shutdown: Shutdown,
    metrics: Metrics,
    mut algorithm: A,
) -> Result<(), ServiceError> {
    let cfg: ExperimentConfig = (*service.config).clone();
    let mut rng = ChaCha8Rng::seed_from_u64(cfg.run.seed.wrapping_add(0x5eed));
    let run_dir = cfg.run.runs_dir.join(cfg.run_id()?);
    let mut progress = Progress::default();
    let mut best_eval: Option<(f64, u64)> = None;
    let mut resumed_at_vec_steps = 0u64;
    let start_from = checkpoint::StartFrom::of(&cfg);
    if let Some(from) = &start_from {
        algorithm
            .load(&from.dir, from.resume, !cfg.run.reset_optimizer)
            .map_err(|e| from.error(e))?;
        if from.resume {
            checkpoint::Restored {
                progress,
                rng,
                best_eval,
            } = checkpoint::restore(&from.dir, &run_dir, rng).map_err(|e| from.error(e))?;
            resumed_at_vec_steps = progress.vec_steps;
        }
        tracing::info!(from = %from.dir.display(), resume = from.resume, version = progress.version, rounds = algorithm.rounds(), env_steps = progress.env_steps, "loaded checkpoint");
    }
    count_resume(&service, &start_from);
    // A checkpoint linked as `links`; with `evaluated`, holding that
    // version's weights (the acting network: DQN's online, SAC's actor).
    let save = |algorithm: &mut A,
                counters: CheckpointState,
                links: &[&str],
                evaluated: Option<&PolicyWeights>| {
        let version = counters
            .weights_version
            .unwrap_or(counters.progress.version);
        let written = checkpoint::write(
            &run_dir,
            counters.progress.updates,
            &cfg,
            cfg.keep_checkpoints(),
            links,
            |tmp| {
                algorithm.save(tmp)?;
                if let Some(update) = evaluated {
                    checkpoint::put_weights(tmp, update, &cfg)?;
                }
                checkpoint::write_json(&tmp.join("state.json"), &counters)
            },
        );
        checkpoint::log_written(written, version, links);
    };
    // The checkpoints the run's evaluations ask for (best, solved).
    let save_evaluated = |algorithm: &mut A,
                          events: &mut RunEvents<PolicyWeights>,
                          progress: &Progress,
                          rng: &ChaCha8Rng| {
        for evaluated in events.poll(&service) {
            let counters =
                CheckpointState::of(progress, rng, events.best_eval).holding(evaluated.version);
            save(
                algorithm,
                counters,
                &evaluated.links,
                Some(&evaluated.weights),
            );
        }
    };

    let micro = service.micro().await?;
    let mut replicas = Replicas::join(&service).await?;
    // Rank 0 alone publishes and takes the run's events (a replica that
    // takes over starts then).
    let mut leading: Option<(Publisher<PolicyWeights>, RunEvents<PolicyWeights>)> = None;
    service.health.set_ready(true);
    tracing::info!(env_id = %cfg.run.env_id, algo = A::NAME, params = algorithm.num_parameters(), "training starts");

    let budget = cfg.run.total_env_steps;
    let num_envs = cfg.env_runner.num_envs.max(1) as u64;
    // The table counts env steps since the run began; a resumed learner
    // continues from its checkpoint's count.
    let table = TableCounters::default();
    let mut work = OffPolicy {
        algorithm,
        progress,
        rng,
        table,
        train_seconds: 0.0,
    };
    let started = Instant::now();
    let start_env_steps = work.progress.env_steps;
    let mut reported_vec_steps = work.progress.vec_steps;
    // Rounds can be one env step apart (SAC): their reports are sent at
    // most every MIN_REPORT_INTERVAL, the latest round's values with the
    // counts of every round since; the last one is sent when training stops.
    let mut last_report: Option<Instant> = None;
    let mut unreported: Option<Vec<MetricValue>> = None;
    let (mut rejected_since, mut stale_since) = (0u64, 0u64);
    let schedule = work.algorithm.schedule();
    let mut draw = DrawSize::new(service.max_message_bytes());
    // Rounds published at most this often; the newest round at the end.
    let publish_interval = Duration::from_millis(cfg.learner.publish_interval_ms);
    let (mut last_published, mut published_version) = (Instant::now(), 0);
    // The next round's draw, asked while this round trains (uniform
    // replay only): the sample's round trip then overlaps the training.
    let mut prefetched: Option<tokio::task::JoinHandle<SampleReply>> = None;
    // The round handed out and not yet trained: kept across a failed
    // round so that the replicas redo it in the next view.
    let mut held: Option<RoundInput> = None;
    let finish = loop {
        // A new view: rank 0's state goes to every replica.
        match replicas.sync_view(&mut work, &shutdown).await? {
            Next::Go(true) => metrics.version.set(work.progress.version as i64),
            Next::Go(false) => {}
            Next::Retry => continue,
            Next::Stop => break Finish::Shutdown,
        }
        if replicas.leads() && leading.is_none() {
            let latest = Publisher::serve(&service, &micro, &run_dir).await?;
            let mut events = RunEvents::subscribe(&service, best_eval).await?;
            published_version = publish(
                &service,
                &latest,
                &mut events,
                work.algorithm.weights(&work.progress),
            )
            .await;
            metrics.version.set(work.progress.version as i64);
            leading = Some((latest, events));
        }

        let round_started = Instant::now();
        let mut times = RoundTimes::default();
        let input = if let Some((_, events)) = leading.as_mut() {
            let due_at = schedule.due_at(work.algorithm.rounds());
            // The budget is spent once the table holds it and every round
            // due within it is done: env-runners running ahead of the
            // learner (within the rate limiter's slack) do not cut rounds
            // short.
            let trained_through = work.progress.env_steps.min(due_at.saturating_sub(1));
            if let Some(finish) = should_finish(
                &shutdown,
                trained_through,
                budget,
                &events.solved,
                cfg.run.stop_when_solved,
            ) {
                replicas.announce_stop().await;
                break finish;
            }
            save_evaluated(&mut work.algorithm, events, &work.progress, &work.rng);
            best_eval = events.best_eval;
            Some(match held.take() {
                // A round that failed in the previous view is redone.
                Some(input) => input,
                None => {
                    // The draw asked while the last round trained, if it
                    // came back.
                    let mut ready = None;
                    if let Some(handle) = prefetched.take() {
                        if let Ok(Ok(reply)) = handle.await {
                            work.table.observe(&reply, &mut work.progress, num_envs);
                            ready = Some(reply);
                        }
                    }
                    // How many env steps the table holds for us: every
                    // sample reply says, so the table is asked on its own
                    // only while the last count is short of the round due
                    // (SAC's rounds are one env step apart).
                    if work.table.base.is_none() || work.progress.env_steps < due_at {
                        match sample_transitions(&service, 0, 1.0).await {
                            Ok(reply) => work.table.observe(&reply, &mut work.progress, num_envs),
                            Err(e) => {
                                tracing::debug!(error = %e, "replay-buffer not answering; retrying");
                                pause(&shutdown, Duration::from_millis(50)).await;
                                continue;
                            }
                        }
                        if work.progress.env_steps < due_at {
                            pause(&shutdown, Duration::from_millis(1)).await;
                            continue;
                        }
                    }
                    // A training round, as of env step `due_at`.
                    let frac = (due_at as f64 / budget as f64).min(1.0);
                    let Some(batches) = draw_round(
                        &service,
                        &shutdown,
                        &mut draw,
                        schedule,
                        work.algorithm.sampling_beta(frac),
                        ready,
                        (&mut work.table, &mut work.progress, num_envs),
                        &mut times,
                    )
                    .await
                    else {
                        // Shutdown, or a minibatch that cannot be drawn.
                        continue;
                    };
                    // Drawn ahead only from a table that already holds the
                    // next round's env steps, so no drawn sample goes unused.
                    if !work.algorithm.prioritized()
                        && work.progress.env_steps >= schedule.due_at(work.algorithm.rounds() + 1)
                    {
                        let rows = schedule.batch_size
                            * draw
                                .minibatches(schedule.batch_size, schedule.gradient_steps)
                                .min(schedule.gradient_steps);
                        let service = service.clone();
                        prefetched = Some(tokio::spawn(async move {
                            sample_transitions(&service, rows as u32, 1.0).await
                        }));
                    }
                    RoundInput {
                        rounds: work.algorithm.rounds(),
                        due_at,
                        frac,
                        progress: work.progress.clone(),
                        table: work.table,
                        best_eval,
                        batches,
                    }
                }
            })
        } else {
            // A follower: the step barrier waits for rank 0's round.
            None
        };
        // The round's gradient steps, in one blocking section.
        let turn = replicas
            .run_step(&mut work, input, &mut held, &shutdown)
            .await?;
        times.train_s = work.train_seconds;
        let (input, trained) = match turn {
            Turn::Done { step, output } => (step, output),
            Turn::Failed { error, .. } => return Err(ServiceError::other(error)),
            Turn::Again => continue,
            Turn::Stop => break Finish::Shutdown,
        };
        if leading.is_none() {
            (work.progress, work.table, best_eval) = (input.progress, input.table, input.best_eval);
        }
        work.progress.updates += 1;
        work.progress.version += 1;
        metrics.version.set(work.progress.version as i64);
        let replica_values = replicas.gauges(work.progress.updates);
        replicas
            .check_parameters(work.progress.updates, || work.algorithm.parameters())
            .await?;
        let Some((latest, events)) = leading.as_mut() else {
            if last_report.is_none_or(|at| at.elapsed() >= MIN_REPORT_INTERVAL) {
                last_report = Some(Instant::now());
                service
                    .report(Some(work.progress.vec_steps), replica_values)
                    .await;
            }
            continue;
        };

        let sent = Instant::now();
        let stale_priorities = send_priorities(&service, &trained.priorities).await;
        times.priority_s = sent.elapsed().as_secs_f64();
        if last_published.elapsed() >= publish_interval {
            let update = work.algorithm.weights(&work.progress);
            published_version = publish(&service, latest, events, update).await;
            last_published = Instant::now();
        }
        let seconds = round_started.elapsed().as_secs_f64();
        metrics.update_seconds.observe(seconds);
        let sps = work.progress.env_steps.saturating_sub(start_env_steps) as f64
            / started.elapsed().as_secs_f64().max(1e-3);
        rejected_since += trained.rejected;
        stale_since += stale_priorities;
        let mut values =
            crate::progress::report_gauges(&work.progress, budget, sps, resumed_at_vec_steps);
        values.extend([
            gauge(
                "learner_rollout_vec_steps",
                (work.progress.vec_steps - reported_vec_steps) as f64,
            ),
            gauge("learner_last_update_seconds", seconds),
            gauge(
                "learner_gradient_steps_per_env_step",
                replay_ratio_reached(&work.algorithm, work.progress.env_steps),
            ),
            gauge("learner_replay_size", work.table.size as f64),
            gauge("learner_rejected_batches", rejected_since as f64),
            gauge("learner_round_sample_seconds", times.sample_s),
            gauge("learner_round_train_seconds", times.train_s),
            gauge("learner_round_priority_seconds", times.priority_s),
        ]);
        if A::REPORTS_PRIORITIES {
            values.push(gauge("learner_stale_priorities", stale_since as f64));
        }
        values.extend(trained.metrics);
        values.extend(replica_values);
        if last_report.is_none_or(|at| at.elapsed() >= MIN_REPORT_INTERVAL) {
            last_report = Some(Instant::now());
            reported_vec_steps = work.progress.vec_steps;
            (rejected_since, stale_since) = (0, 0);
            unreported = None;
            service.report(Some(work.progress.vec_steps), values).await;
        } else {
            unreported = Some(values);
        }
        if work.progress.updates % cfg.checkpoint_every() == 0 {
            let counters = CheckpointState::of(&work.progress, &work.rng, events.best_eval);
            save(&mut work.algorithm, counters, LINKS_LAST, None);
        }
    };

    replicas.leave().await;
    if let Some(handle) = prefetched.take() {
        handle.abort();
    }
    let Some((latest, mut events)) = leading else {
        // A follower: rank 0 finishes the run; this replica waits for shutdown.
        shutdown.wait().await;
        let _ = micro.stop().await;
        return service.finish().await;
    };
    if let Some(values) = unreported {
        service.report(Some(work.progress.vec_steps), values).await;
    }
    if published_version != work.progress.version {
        // The newest rounds, held back by `learner.publish_interval_ms`.
        let update = work.algorithm.weights(&work.progress);
        publish(&service, &latest, &mut events, update).await;
    }
    // Reports that arrived as training stopped, then the last checkpoint.
    save_evaluated(&mut work.algorithm, &mut events, &work.progress, &work.rng);
    let counters = CheckpointState::of(&work.progress, &work.rng, events.best_eval);
    match final_weights(&cfg, &events) {
        Some((version, weights)) => save(
            &mut work.algorithm,
            counters.holding(version),
            LINKS_LAST_SOLVED,
            Some(&weights),
        ),
        None => save(&mut work.algorithm, counters, LINKS_LAST, None),
    }
    finish_run(
        &service,
        &shutdown,
        micro,
        &finish,
        format!("{budget} env steps"),
        work.progress.version,
        work.progress.env_steps,
        || save_evaluated(&mut work.algorithm, &mut events, &work.progress, &work.rng),
    )
    .await
}

/// Publishes `update`, kept for the evaluations that may ask for its
/// checkpoint; returns its version.
async fn publish(
    service: &Service,
    latest: &Publisher<PolicyWeights>,
    events: &mut RunEvents<PolicyWeights>,
    update: PolicyWeights,
) -> u64 {
    let version = update.version;
    latest.publish(service, &update, &Default::default()).await;
    events.record(version, update);
    version
}

/// One training round as rank 0 hands it to the other replicas.
#[derive(Serialize, Deserialize)]
struct RoundInput {
    /// Rounds done before this one.
    rounds: u64,
    /// The env step the round is due at, and the budget's fraction then.
    due_at: u64,
    frac: f64,
    /// Rank 0's counters and table as it drew the round, and its best
    /// evaluation so far, for whoever leads next.
    progress: Progress,
    table: TableCounters,
    best_eval: Option<(f64, u64)>,
    /// `gradient_steps` minibatches of `batch_size` transitions.
    batches: Vec<TransitionBatch>,
}

/// What a trained round brings back.
struct TrainedRound {
    /// The algorithm's metrics of the round.
    metrics: Vec<MetricValue>,
    /// New priorities (prioritized replay), with the ids they are for.
    priorities: (Vec<u64>, Vec<f32>),
    /// Minibatches whose gradient step failed (skipped).
    rejected: u64,
}

/// Trains round `input` with `sync` summing across replicas: one gradient
/// step per minibatch (a minibatch that fails its step is skipped and
/// counted; every replica fails the same one).
fn train_round<A: OffPolicyAlgorithm>(
    algorithm: &mut A,
    input: &RoundInput,
    rng: &mut ChaCha8Rng,
    sync: &mut BatchShare<'_>,
) -> Result<TrainedRound, A::Error> {
    algorithm.begin_round(input.due_at, input.frac)?;
    let (mut ids, mut values) = (Vec::new(), Vec::new());
    let mut rejected = 0;
    for (step, batch) in input.batches.iter().enumerate() {
        match algorithm.gradient_step(step, batch, rng, sync) {
            Ok(Some(priorities)) => {
                ids.extend_from_slice(&batch.ids);
                values.extend(priorities);
            }
            Ok(None) => {}
            Err(e) => {
                // Bad data must not stop training: skip this batch.
                tracing::error!(error = %e, "gradient step failed; batch skipped");
                rejected += 1;
            }
        }
    }
    Ok(TrainedRound {
        metrics: algorithm.end_round(input.frac),
        priorities: (ids, values),
        rejected,
    })
}

/// Draws a round's `gradient_steps` minibatches of `batch_size`
/// transitions, several per request (a request per gradient step cost far
/// more than the step itself), starting with `ready` (drawn ahead),
/// waiting while the replay-buffer's rate limiter holds them back, and
/// taking each reply's counters into `table` and `progress`. `None`:
/// shutdown, or a minibatch too large for a message (the learner fails).
#[allow(clippy::too_many_arguments)]
async fn draw_round(
    service: &Service,
    shutdown: &Shutdown,
    draw: &mut DrawSize,
    schedule: RoundSchedule,
    beta: f64,
    mut ready: Option<TransitionBatch>,
    (table, progress, num_envs): (&mut TableCounters, &mut Progress, u64),
    times: &mut RoundTimes,
) -> Option<Vec<TransitionBatch>> {
    let batch_size = schedule.batch_size;
    let mut per_request = draw.minibatches(batch_size, schedule.gradient_steps);
    let mut batches = Vec::with_capacity(schedule.gradient_steps);
    while batches.len() < schedule.gradient_steps {
        if shutdown.is_triggered() {
            return None;
        }
        let k = per_request.min(schedule.gradient_steps - batches.len());
        let rows = batch_size * k;
        let asked = Instant::now();
        let sampled = match ready.take() {
            Some(reply) if reply.ids.len() == rows => Ok(reply),
            _ => sample_transitions(service, rows as u32, beta).await,
        };
        times.sample_s += asked.elapsed().as_secs_f64();
        match sampled {
            Ok(b) if b.ids.len() == rows => {
                table.observe(&b, progress, num_envs);
                draw.learn_row_bytes(&b);
                batches.extend(b.split_interleaved(k));
            }
            Ok(_) if k > 1 => {
                // The rate limiter's allowance is below k minibatches: ask
                // for fewer at a time.
                per_request = k / 2;
            }
            Ok(_) => {
                // Held back by the rate limiter (or not enough held yet).
                pause(shutdown, Duration::from_millis(1)).await;
            }
            Err(e) if e.is_too_large() => {
                // Not even one transition's reply fits a message. Fires
                // `shutdown`: the loops end with the failure.
                service.fail(format!("cannot draw a minibatch: {e}")).await;
                return None;
            }
            Err(e) => {
                tracing::debug!(error = %e, "sample failed; retrying");
                pause(shutdown, Duration::from_millis(20)).await;
            }
        }
    }
    Some(batches)
}

/// Sends a round's new priorities to the replay-buffer; returns how many
/// were for transitions evicted since they were drawn.
async fn send_priorities(service: &Service, (ids, priorities): &(Vec<u64>, Vec<f32>)) -> u64 {
    let mut stale = 0;
    for (ids, priorities) in ids
        .chunks(PRIORITIES_PER_UPDATE)
        .zip(priorities.chunks(PRIORITIES_PER_UPDATE))
    {
        let update = PriorityUpdate {
            schema: SCHEMA_VERSION,
            ids: ids.to_vec(),
            priorities: Tensor::from_f32(&[priorities.len()], priorities),
        };
        match relay_kit::request::<_, PriorityAck>(
            &service.nats,
            &service.subjects.replay_priorities(),
            &update,
            service.request_timeout(),
        )
        .await
        {
            Ok(ack) => stale += ack.evicted as u64,
            Err(e) => tracing::warn!(error = %e, "priority update lost"),
        }
    }
    stale
}

/// A replica's whole state, in memory: what rank 0 hands to every replica
/// of a new view, and the rollback point of a replicated round.
#[derive(Serialize, Deserialize)]
struct ReplicaState<S> {
    algorithm: S,
    progress: Progress,
    rng: relay_runs::checkpoint::RngState,
    table: TableCounters,
}

/// What the replicas hold alike and train together: the algorithm, the
/// counters, the RNG and the table's counters.
struct OffPolicy<A> {
    algorithm: A,
    progress: Progress,
    rng: ChaCha8Rng,
    table: TableCounters,
    /// Seconds the last round's gradient steps took.
    train_seconds: f64,
}

impl<A: OffPolicyAlgorithm> Replicated for OffPolicy<A> {
    type State = ReplicaState<A::State>;
    type Step = RoundInput;
    type Output = TrainedRound;
    type Error = A::Error;
    // A round's gradient steps are milliseconds each: a stop waits for
    // the round's end. Alone, a round whose preparation fails fails the
    // learner (a minibatch that fails its step is skipped inside it).
    const STOPS_PART_WAY: bool = false;
    const UNDO: Undo = Undo::SnapshotInGroup;

    fn capture(&self) -> Result<Self::State, String> {
        Ok(ReplicaState {
            algorithm: self.algorithm.capture().map_err(|e| e.to_string())?,
            progress: self.progress.clone(),
            rng: relay_runs::checkpoint::RngState::capture(&self.rng),
            table: self.table,
        })
    }

    fn restore(&mut self, state: Self::State) -> Result<(), String> {
        self.algorithm
            .restore(state.algorithm)
            .map_err(|e| e.to_string())?;
        self.rng = state.rng.restore()?;
        self.progress = state.progress;
        self.table = state.table;
        Ok(())
    }

    fn took_over(&mut self) {
        // The old rank 0 may have published one version past what this
        // replica holds: skip it.
        self.progress.version += 2;
    }

    fn describe(round: &RoundInput) -> String {
        round.rounds.to_string()
    }

    fn is_next(&self, round: &RoundInput) -> bool {
        round.rounds == self.algorithm.rounds()
    }

    fn run(
        &mut self,
        round: &RoundInput,
        share: &mut BatchShare<'_>,
    ) -> Result<TrainedRound, A::Error> {
        let started = Instant::now();
        let trained = train_round(&mut self.algorithm, round, &mut self.rng, share);
        self.train_seconds = started.elapsed().as_secs_f64();
        trained
    }

    fn stopped(_: &A::Error) -> bool {
        false
    }
}

/// The off-policy table's counters as the learner last heard them.
#[derive(Debug, Default, Clone, Copy, Serialize, Deserialize)]
struct TableCounters {
    /// The table's `inserted_steps` and the learner's env steps when it
    /// first answered (a resumed learner counts on from its checkpoint).
    base: Option<(u64, u64)>,
    /// Transitions held.
    size: u64,
}

impl TableCounters {
    /// Takes the counters of a sample reply into the learner's progress.
    fn observe(&mut self, reply: &TransitionBatch, progress: &mut Progress, num_envs: u64) {
        let (base_inserted, base_steps) = *self
            .base
            .get_or_insert((reply.inserted_steps, progress.env_steps));
        progress.env_steps = base_steps + reply.inserted_steps.saturating_sub(base_inserted);
        progress.vec_steps = progress.env_steps / num_envs;
        self.size = reply.size;
    }
}

/// Priorities sent in one [`PriorityUpdate`] (12 bytes each on the wire).
const PRIORITIES_PER_UPDATE: usize = 16_384;

/// Shortest time between two round reports (at most 20 a second).
const MIN_REPORT_INTERVAL: Duration = Duration::from_millis(50);

/// Seconds of a training round spent drawing minibatches, on gradient
/// steps and sending priorities back (`learner_round_*_seconds`).
#[derive(Debug, Default)]
struct RoundTimes {
    sample_s: f64,
    train_s: f64,
    priority_s: f64,
}

/// How many minibatches one sample request carries: one until a reply's
/// size per row is known, then as many as fit half a message of the NATS
/// server (`max_message`, its `max_payload`) and [`MAX_TRANSITION_SAMPLE`]
/// rows. (A minibatch whose reply does not fit one message is drawn in
/// parts by `relay_kit::request_within`, its importance weights joined on
/// one scale.)
#[derive(Debug)]
struct DrawSize {
    row_bytes: Option<usize>,
    max_message: usize,
}

impl DrawSize {
    fn new(max_message: usize) -> Self {
        Self {
            row_bytes: None,
            max_message,
        }
    }

    fn learn_row_bytes(&mut self, batch: &TransitionBatch) {
        if self.row_bytes.is_none() && !batch.ids.is_empty() {
            let bytes = relay_proto::encode(batch).len();
            self.row_bytes = Some(bytes.div_ceil(batch.ids.len()));
        }
    }

    fn minibatches(&self, batch_size: usize, gradient_steps: usize) -> usize {
        let Some(row_bytes) = self.row_bytes else {
            return 1;
        };
        let by_rows = MAX_TRANSITION_SAMPLE as usize / batch_size.max(1);
        let by_bytes = self.max_message / 2 / (row_bytes * batch_size).max(1);
        by_rows.min(by_bytes).min(gradient_steps).max(1)
    }
}

/// A sample request's outcome.
type SampleReply = Result<TransitionBatch, relay_kit::RequestError>;

/// Asks the replay-buffer's off-policy table for `batch_size` transitions
/// (0: only its counters), prioritized ones with importance weights at
/// `beta`.
async fn sample_transitions(service: &Service, batch_size: u32, beta: f64) -> SampleReply {
    let ask = TransitionSampleRequest {
        schema: SCHEMA_VERSION,
        batch_size,
        beta,
    };
    relay_kit::request_within::<_, TransitionBatch>(
        &service.nats,
        &service.subjects.replay_transitions_sample(),
        ask,
        service.request_timeout(),
    )
    .await
}
