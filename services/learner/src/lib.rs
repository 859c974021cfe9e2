//! learner: trains the policy with PPO ([`ppo`]) on rollouts pulled from the
//! replay buffer, and publishes each new weights version.
//!
//! One learner per run. Its loop: gather `ppo.rollout_steps` env steps of
//! fragments no more than `replay.max_policy_lag` versions old, update,
//! publish version + 1 on `weights` (and serve the latest on
//! `weights.latest` for services that join later), report metrics, and
//! checkpoint every `ppo.checkpoint_every` updates, at the first eval, at
//! each new best eval mean (it listens on `eval`) and at the end. It stops
//! training when the budget `run.total_env_steps` is spent or, with
//! `run.stop_when_solved`, when the evaluator announces the run solved; it
//! then writes a final checkpoint and keeps serving the weights until
//! shutdown.
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
//! Text runs (`run.env_id` a text game) train a LoRA adapter on games
//! instead: see [`text`].

pub mod checkpoint;
pub mod examples;
pub mod ppo;
pub mod text;

use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::{FutureExt, StreamExt};
use prometheus::{Histogram, HistogramOpts, IntGauge};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use relay_kit::{counter, gauge, Service, ServiceConfig, ServiceError, Shutdown};
use relay_nn::{ActorCritic, Adam, AdamConfig};
use relay_proto::{
    EvalReport, RolloutFragment, RunStatus, RunStatusUpdate, SampleReply, SampleRequest,
    WeightsRequest, SCHEMA_VERSION,
};

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

/// Why training stopped.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Finish {
    Budget,
    Solved(String),
    Shutdown,
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
            HistogramOpts::new(
                "relay_learner_update_seconds",
                "Wall time of one PPO update.",
            )
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
    let spec = relay_policy::spec_for(&cfg).map_err(ServiceError::other)?;
    let mut model = ActorCritic::new(&spec, cfg.run.seed).map_err(ServiceError::other)?;
    let adam_config = AdamConfig {
        lr: cfg.ppo.learning_rate,
        eps: cfg.ppo.adam_eps,
        ..AdamConfig::default()
    };
    let mut adam = Adam::new(model.vars(), adam_config).map_err(ServiceError::other)?;
    let mut rng = ChaCha8Rng::seed_from_u64(cfg.run.seed.wrapping_add(0x5eed));
    let run_dir = cfg.run.runs_dir.join(cfg.run_id()?);
    let mut progress = Progress::default();
    let mut best_eval: Option<(f64, u64)> = None;
    // The oldest version whose rollouts belong to this learner's timeline.
    let mut version_floor = 0u64;
    let mut resumed_at_vec_steps = 0u64;
    if let Some(dir) = cfg.run.resume_from.clone().or(cfg.run.init_from.clone()) {
        let resume = cfg.run.resume_from.is_some();
        let fail = |e: String| {
            ServiceError::other(format!(
                "{} {}: {e}",
                if resume {
                    "run.resume_from"
                } else {
                    "run.init_from"
                },
                dir.display()
            ))
        };
        model
            .load(dir.join("model.safetensors"))
            .map_err(|e| fail(e.to_string()))?;
        if !cfg.run.reset_optimizer {
            adam.load(dir.join("optimizer.safetensors"))
                .map_err(|e| fail(e.to_string()))?;
        }
        if resume {
            let state = checkpoint::load_state(&dir).map_err(|e| fail(e.to_string()))?;
            if let Some(r) = &state.rng {
                rng = r.restore().map_err(fail)?;
            }
            best_eval = state.best_eval;
            progress = state.progress;
            resumed_at_vec_steps = progress.vec_steps;
            progress.version = progress
                .version
                .max(checkpoint::published_version(&run_dir))
                + 1;
            version_floor = progress.version;
        }
        tracing::info!(from = %dir.display(), resume, version = progress.version, updates = progress.updates, env_steps = progress.env_steps, vec_steps = progress.vec_steps, "loaded checkpoint");
    }
    let resumes = prometheus::IntCounter::new(
        "relay_learner_resumes_total",
        "Times this learner process started from a checkpoint of its own run.",
    )
    .unwrap();
    relay_kit::metrics::register(&service.registry, &resumes);
    if cfg.run.resume_from.is_some() {
        resumes.inc();
    }

    // Serve the latest weights to services that join late.
    let latest: Arc<RwLock<Bytes>> = Arc::new(RwLock::new(Bytes::new()));
    let publish_weights = |model: &ActorCritic, progress: &Progress| -> Bytes {
        if let Err(e) = checkpoint::record_published(&run_dir, progress.version) {
            tracing::warn!(error = %e, "could not record the published version");
        }
        let payload: Bytes = relay_proto::encode(&relay_policy::to_weights(
            model,
            progress.version,
            progress.env_steps,
        ))
        .into();
        *latest.write().expect("weights lock") = payload.clone();
        payload
    };
    let micro = service.micro().await?;
    let mut weights_requests = micro
        .endpoint(service.subjects.weights_latest())
        .await
        .map_err(ServiceError::nats)?;
    {
        let latest = latest.clone();
        let shutdown = shutdown.clone();
        let intake = service.intake.clone();
        tokio::spawn(async move {
            loop {
                let request = tokio::select! {
                    r = weights_requests.next() => match r { Some(r) => r, None => return },
                    _ = shutdown.wait() => return,
                };
                let answer = match intake
                    .decode::<WeightsRequest>("weights.latest", &request.message.payload)
                {
                    Ok(_) => Ok(latest.read().expect("weights lock").clone()),
                    Err(rejection) => Err(async_nats::service::error::Error {
                        status: rejection.to_string(),
                        code: 400,
                    }),
                };
                let _ = request.respond(answer).await;
            }
        });
    }
    let mut statuses = service
        .nats
        .subscribe(service.subjects.status())
        .await
        .map_err(ServiceError::nats)?;

    let mut evals = service
        .nats
        .subscribe(service.subjects.eval())
        .await
        .map_err(ServiceError::nats)?;

    let payload = publish_weights(&model, &progress);
    publish(&service, payload).await;
    metrics.version.set(progress.version as i64);
    service.health.set_ready(true);
    tracing::info!(env_id = %cfg.run.env_id, params = model.named_tensors().iter().map(|t| t.2.len()).sum::<usize>(), "training starts");

    let budget = cfg.run.total_env_steps;
    let mut fragments: Vec<RolloutFragment> = Vec::new();
    let mut gathered = 0u64;
    let (mut dropped_stale, mut reported_stale) = (0u64, 0u64);
    let mut solved: Option<String> = None;
    let started = Instant::now();
    let start_env_steps = progress.env_steps;
    let finish = loop {
        if shutdown.is_triggered() {
            break Finish::Shutdown;
        }
        if progress.env_steps >= budget {
            break Finish::Budget;
        }
        if let Some(detail) = &solved {
            if cfg.run.stop_when_solved {
                break Finish::Solved(detail.clone());
            }
        }
        // Take announcements (solved) and evals without waiting; checkpoint
        // at the first eval heard and at each new best mean.
        take_solved(&service, &mut statuses, &mut solved);
        let checkpoint_best = take_evals(&service, &mut evals, &mut best_eval);
        if checkpoint_best {
            let state = checkpoint_state(&progress, &rng, best_eval);
            save_checkpoint(&run_dir, &model, &adam, &state, &cfg, true);
        }

        // Gather a rollout.
        let want = cfg.ppo.rollout_steps as u64;
        if gathered < want {
            let ask = SampleRequest {
                schema: SCHEMA_VERSION,
                min_policy_version: progress
                    .version
                    .saturating_sub(cfg.replay.max_policy_lag)
                    .max(version_floor),
                max_steps: (want - gathered) as u32,
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
                        tokio::select! {
                            _ = tokio::time::sleep(Duration::from_millis(1)) => {}
                            _ = shutdown.wait() => {}
                        }
                    }
                    for f in reply.fragments {
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
                        // The buffer only drops what is older than we asked; a
                        // fragment that became stale while we gathered goes too.
                        if f.policy_version + cfg.replay.max_policy_lag < progress.version
                            || f.policy_version < version_floor
                        {
                            dropped_stale += 1;
                            continue;
                        }
                        gathered += f.env_steps();
                        fragments.push(f);
                    }
                }
                Err(e) => {
                    tracing::debug!(error = %e, "sample failed; retrying");
                    tokio::select! {
                        _ = tokio::time::sleep(Duration::from_millis(50)) => {}
                        _ = shutdown.wait() => {}
                    }
                }
            }
            continue;
        }

        // Update.
        let update_started = Instant::now();
        for f in &fragments {
            metrics
                .policy_lag
                .observe(progress.version.saturating_sub(f.policy_version) as f64);
        }
        let frac = progress.env_steps as f64 / budget as f64;
        let result = tokio::task::block_in_place(|| {
            let rollout = ppo::prepare(&model, &fragments, cfg.ppo.gamma, cfg.ppo.gae_lambda)?;
            let stats = ppo::update(&model, &mut adam, &rollout, &cfg.ppo, frac, &mut rng)?;
            Ok::<_, ppo::PpoError>((rollout.vec_steps, rollout.oldest_version, stats))
        });
        let taken = std::mem::take(&mut fragments);
        gathered = 0;
        let (vec_steps, oldest, stats) = match result {
            Ok(r) => r,
            Err(e) => {
                // Bad data must not stop training: drop this rollout and go on.
                tracing::error!(error = %e, fragments = taken.len(), "update failed; rollout dropped");
                continue;
            }
        };
        progress.updates += 1;
        progress.version += 1;
        progress.env_steps += taken.iter().map(RolloutFragment::env_steps).sum::<u64>();
        progress.vec_steps += vec_steps;
        progress.episodes += taken
            .iter()
            .map(RolloutFragment::episodes_ended)
            .sum::<u64>();
        let payload = publish_weights(&model, &progress);
        publish(&service, payload).await;
        metrics.version.set(progress.version as i64);
        let seconds = update_started.elapsed().as_secs_f64();
        metrics.update_seconds.observe(seconds);
        let sps = progress.env_steps.saturating_sub(start_env_steps) as f64
            / started.elapsed().as_secs_f64().max(1e-3);
        service
            .report(
                Some(progress.vec_steps),
                vec![
                    gauge("learner_updates", progress.updates as f64),
                    gauge("learner_policy_version", progress.version as f64),
                    gauge("learner_env_steps", progress.env_steps as f64),
                    gauge("learner_vec_steps", progress.vec_steps as f64),
                    gauge("learner_episodes", progress.episodes as f64),
                    gauge("learner_rollout_vec_steps", vec_steps as f64),
                    gauge("learner_resumed_at_vec_steps", resumed_at_vec_steps as f64),
                    gauge(
                        "learner_progress",
                        (progress.env_steps as f64 / budget as f64).min(1.0),
                    ),
                    gauge("learner_sps", sps),
                    gauge(
                        "learner_eta_seconds",
                        budget.saturating_sub(progress.env_steps) as f64 / sps.max(1e-9),
                    ),
                    gauge("learner_policy_loss", stats.policy_loss),
                    gauge("learner_value_loss", stats.value_loss),
                    gauge("learner_entropy", stats.entropy),
                    gauge("learner_total_loss", stats.total_loss),
                    gauge("learner_approx_kl", stats.approx_kl),
                    gauge("learner_kl", stats.kl),
                    gauge("learner_clip_fraction", stats.clip_fraction),
                    gauge("learner_value_clip_fraction", stats.value_clip_fraction),
                    gauge("learner_ratio_mean", stats.ratio_mean),
                    gauge("learner_ratio_var", stats.ratio_var),
                    gauge("learner_explained_variance", stats.explained_variance),
                    gauge("learner_grad_norm", stats.grad_norm),
                    gauge("learner_learning_rate", stats.learning_rate),
                    gauge("learner_clip_range", stats.clip_range),
                    gauge("learner_epochs", stats.epochs_done as f64),
                    counter(
                        "learner_kl_early_stops_total",
                        stats.kl_early_stop as u8 as f64,
                    ),
                    gauge("learner_last_update_seconds", seconds),
                    gauge(
                        "learner_policy_lag_max",
                        progress.version.saturating_sub(oldest + 1) as f64,
                    ),
                    counter(
                        "learner_dropped_stale_fragments_total",
                        (dropped_stale - reported_stale) as f64,
                    ),
                ],
            )
            .await;
        reported_stale = dropped_stale;
        if progress.updates % cfg.ppo.checkpoint_every == 0 {
            let state = checkpoint_state(&progress, &rng, best_eval);
            save_checkpoint(&run_dir, &model, &adam, &state, &cfg, false);
        }
    };

    let state = checkpoint_state(&progress, &rng, best_eval);
    save_checkpoint(&run_dir, &model, &adam, &state, &cfg, false);
    let (status, detail) = match &finish {
        Finish::Budget => (
            RunStatus::Stopped,
            format!("budget of {budget} env steps spent"),
        ),
        Finish::Solved(d) => (RunStatus::Solved, d.clone()),
        Finish::Shutdown => (RunStatus::Stopped, "shutdown requested".to_string()),
    };
    tracing::info!(?status, %detail, updates = progress.updates, env_steps = progress.env_steps, "training finished");
    let update = RunStatusUpdate {
        schema: SCHEMA_VERSION,
        status,
        service: "learner".into(),
        policy_version: progress.version,
        detail,
    };
    service.publish(service.subjects.status(), &update).await;
    // Keep serving the final weights until the stack stops.
    shutdown.wait().await;
    service.health.set_ready(false);
    let _ = micro.stop().await;
    service.drain().await;
    Ok(())
}

async fn publish(service: &Service, payload: Bytes) {
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

fn checkpoint_state(
    progress: &Progress,
    rng: &ChaCha8Rng,
    best_eval: Option<(f64, u64)>,
) -> checkpoint::CheckpointState {
    checkpoint::CheckpointState {
        progress: progress.clone(),
        rng: Some(checkpoint::RngState::capture(rng)),
        best_eval,
    }
}

fn save_checkpoint(
    run_dir: &std::path::Path,
    model: &ActorCritic,
    adam: &Adam,
    state: &checkpoint::CheckpointState,
    cfg: &relay_kit::ExperimentConfig,
    best: bool,
) {
    match checkpoint::save(run_dir, model, adam, state, cfg, best) {
        Ok(path) => {
            tracing::info!(path = %path.display(), version = state.progress.version, best, "checkpoint written")
        }
        Err(e) => tracing::error!(error = %e, "checkpoint failed"),
    }
}

/// Takes the run's pending status announcements without waiting; the first
/// `solved` heard is kept in `solved`.
pub(crate) fn take_solved(
    service: &Service,
    statuses: &mut async_nats::Subscriber,
    solved: &mut Option<String>,
) {
    while let Some(Some(m)) = statuses.next().now_or_never() {
        if let Ok(status) = service
            .intake
            .decode::<RunStatusUpdate>("status", &m.payload)
        {
            if status.status == RunStatus::Solved && solved.is_none() {
                tracing::info!(detail = %status.detail, "run solved");
                *solved = Some(status.detail);
            }
        }
    }
}

/// Takes pending eval reports without waiting; returns whether one beat
/// `best_eval` (mean return, version), which it then replaces.
pub(crate) fn take_evals(
    service: &Service,
    evals: &mut async_nats::Subscriber,
    best_eval: &mut Option<(f64, u64)>,
) -> bool {
    let mut improved = false;
    while let Some(Some(m)) = evals.next().now_or_never() {
        if let Ok(report) = service.intake.decode::<EvalReport>("eval", &m.payload) {
            if report.returns.is_empty() || !report.mean_return.is_finite() {
                continue;
            }
            if best_eval.is_none_or(|(b, _)| report.mean_return > b) {
                *best_eval = Some((report.mean_return, report.policy_version));
                improved = true;
            }
        }
    }
    improved
}
