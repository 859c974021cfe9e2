//! evaluator: plays episodes with the learner's newest weights on eval seeds
//! distinct from the training seeds, and publishes the result.
//!
//! How it plays is a plugin ([`plugins`]): `eval.evaluator` and
//! `eval.options` choose it at start, and an `EvalControl` message on
//! `relay.<run>.eval.control` (`relay eval use <name> --set k=v`) switches
//! it without a restart; an unknown name or option is logged, counted
//! (`relay_evaluator_control_rejected_total`) and the current plugin stays.
//! Every copy applies the control message (no queue group); copies started
//! with different configs run different plugins side by side.
//!
//! It runs on its own schedule and never blocks training: it waits for a
//! version at least `eval.every_versions` past the last one it evaluated
//! (or, with `eval.every_seconds`, any newer version once that long has
//! passed since its last evaluation), always takes the newest (skipping
//! those it could not keep up with, and counting them in
//! `relay_evaluator_skipped_versions_total`), plays `eval.episodes` episodes (one per sub-env of a
//! vectorized env, each run to its end), and publishes an [`EvalReport`].
//! When the mean return reaches the threshold (the env's reward threshold
//! unless `eval.threshold` says otherwise) it also announces the run solved.

pub mod plugins;

use std::collections::VecDeque;
use std::sync::Arc;

use futures::StreamExt;
use prometheus::{Gauge, GaugeVec, IntCounter, Opts};
use relay_kit::{Service, ServiceConfig, ServiceError, Shutdown};
use relay_nn::ActorCritic;
use relay_policy::PolicyFollower;
use relay_proto::{
    EpisodeReport, EvalControl, EvalReport, RunStatus, RunStatusUpdate, SCHEMA_VERSION,
};

use plugins::{EvalContext, EvalOutcome, Evaluator};

/// Plays one episode per sub-env with the policy's deterministic actions;
/// returns each episode's return (the `greedy` plugin).
pub fn evaluate(
    model: &ActorCritic,
    env_id: &str,
    episodes: usize,
    seed: u64,
) -> Result<Vec<f64>, String> {
    Ok(plugins::play(model, env_id, episodes, seed, true, false)?
        .into_iter()
        .map(|e| e.ret)
        .collect())
}

fn mean_std(values: &[f64]) -> (f64, f64) {
    let mean = values.iter().sum::<f64>() / values.len() as f64;
    let var = values.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / values.len() as f64;
    (mean, var.sqrt())
}

/// Runs the evaluator until shutdown.
pub async fn run(config: ServiceConfig, shutdown: Shutdown) -> Result<(), ServiceError> {
    let service = Service::start("evaluator", config, shutdown.clone()).await?;
    let cfg = service.config.clone();
    let mut follower = PolicyFollower::start(&service).await?;
    let threshold = cfg.solved_threshold();
    let skipped = IntCounter::new(
        "relay_evaluator_skipped_versions_total",
        "Weights versions the evaluator did not evaluate because newer ones arrived.",
    )
    .unwrap();
    let last_return = Gauge::new(
        "relay_evaluator_return_mean",
        "Mean return of the latest evaluation.",
    )
    .unwrap();
    let control_rejected = IntCounter::new(
        "relay_evaluator_control_rejected_total",
        "EvalControl messages refused (unknown evaluator or option).",
    )
    .unwrap();
    let control_applied = IntCounter::new(
        "relay_evaluator_control_applied_total",
        "EvalControl messages applied (evaluator plugin switched).",
    )
    .unwrap();
    let active = GaugeVec::new(
        Opts::new(
            "relay_evaluator_active",
            "1 for the evaluator plugin this copy runs now.",
        ),
        &["evaluator"],
    )
    .unwrap();
    relay_kit::metrics::register(&service.registry, &active);
    relay_kit::metrics::register(&service.registry, &skipped);
    relay_kit::metrics::register(&service.registry, &last_return);
    relay_kit::metrics::register(&service.registry, &control_rejected);
    relay_kit::metrics::register(&service.registry, &control_applied);
    let mut plugin: Arc<dyn Evaluator> =
        plugins::build(&cfg.eval.evaluator, &cfg.eval.option_pairs())
            .map_err(|e| ServiceError::other(format!("eval.evaluator: {e}")))?
            .into();
    let mut controls = service
        .nats
        .subscribe(service.subjects.eval_control())
        .await
        .map_err(ServiceError::nats)?;
    let mut episodes = service
        .nats
        .subscribe(service.subjects.episodes())
        .await
        .map_err(ServiceError::nats)?;
    let mut recent: VecDeque<f64> = VecDeque::with_capacity(100);
    let run_dir = cfg.run.runs_dir.join(cfg.run_id()?);
    tracing::info!(evaluator = plugin.name(), "evaluator plugin");
    active.with_label_values(&[plugin.name()]).set(1.0);
    service.health.set_ready(true);
    let mut last: Option<u64> = None;
    let mut announced_solved = false;
    let every_seconds = cfg
        .eval
        .every_seconds
        .map(std::time::Duration::from_secs_f64);
    // When set, any version newer than the last evaluated one is due.
    let mut time_due_at = every_seconds.map(|d| tokio::time::Instant::now() + d);
    let mut time_due = false;
    loop {
        let wanted = match last {
            Some(v) if time_due => Some(v),
            Some(v) => Some(v + cfg.eval.every_versions - 1),
            None => None,
        };
        let policy = tokio::select! {
            _ = shutdown.wait() => break,
            _ = tokio::time::sleep_until(time_due_at.unwrap_or_else(tokio::time::Instant::now)), if time_due_at.is_some() && !time_due => {
                time_due = true;
                continue;
            }
            Some(m) = controls.next() => {
                match service.intake.decode::<EvalControl>("eval.control", &m.payload) {
                    Ok(control) => match plugins::build(&control.evaluator, &control.options) {
                        Ok(p) => {
                            tracing::info!(from = plugin.name(), to = p.name(), options = ?control.options, "evaluator plugin switched");
                            let _ = active.remove_label_values(&[plugin.name()]);
                            active.with_label_values(&[p.name()]).set(1.0);
                            plugin = p.into();
                            control_applied.inc();
                        }
                        Err(e) => {
                            tracing::warn!(error = %e, current = plugin.name(), "eval control refused");
                            control_rejected.inc();
                        }
                    },
                    Err(_) => control_rejected.inc(),
                }
                continue;
            }
            Some(m) = episodes.next() => {
                if let Ok(report) = service.intake.decode::<EpisodeReport>("episodes", &m.payload) {
                    for e in report.episodes {
                        if recent.len() == 100 {
                            recent.pop_front();
                        }
                        recent.push_back(e.episode_return);
                    }
                }
                continue;
            }
            p = follower.newer_than(wanted) => match p { Some(p) => p, None => break },
        };
        if let Some(previous) = last {
            skipped.inc_by(policy.version.saturating_sub(previous + 1));
        }
        last = Some(policy.version);
        time_due = false;
        time_due_at = every_seconds.map(|d| tokio::time::Instant::now() + d);
        let ctx = EvalContext {
            env_id: cfg.run.env_id.clone(),
            episodes: cfg.eval.episodes,
            seed: cfg.eval.seed,
            run_dir: run_dir.clone(),
            train_return: (!recent.is_empty())
                .then(|| recent.iter().sum::<f64>() / recent.len() as f64),
        };
        let (model_policy, evaluator) = (policy.clone(), plugin.clone());
        let outcome = tokio::task::spawn_blocking(move || evaluator.evaluate(&model_policy, &ctx))
            .await
            .map_err(ServiceError::other)?;
        let returns = match outcome {
            Ok(EvalOutcome::Returns(r)) if !r.is_empty() => r,
            Ok(EvalOutcome::Returns(_)) => continue,
            Ok(EvalOutcome::Skipped(reason)) => {
                tracing::debug!(evaluator = plugin.name(), version = policy.version, %reason, "evaluation skipped");
                continue;
            }
            Err(e) => {
                tracing::error!(error = %e, evaluator = plugin.name(), version = policy.version, "evaluation failed");
                continue;
            }
        };
        let (mean, std) = mean_std(&returns);
        let solved = threshold.is_some_and(|t| mean >= t);
        last_return.set(mean);
        tracing::info!(
            evaluator = plugin.name(),
            version = policy.version,
            mean_return = mean,
            std_return = std,
            solved,
            "evaluated"
        );
        let report = EvalReport {
            schema: SCHEMA_VERSION,
            evaluator: plugin.name().to_string(),
            instance: service.instance.clone(),
            env_id: cfg.run.env_id.clone(),
            policy_version: policy.version,
            learner_env_steps: policy.learner_env_steps,
            returns,
            mean_return: mean,
            std_return: std,
            threshold: threshold.unwrap_or(f64::NAN),
            solved,
        };
        service.publish(service.subjects.eval(), &report).await;
        if solved && !announced_solved {
            announced_solved = true;
            let status = RunStatusUpdate {
                schema: SCHEMA_VERSION,
                status: RunStatus::Solved,
                service: "evaluator".into(),
                policy_version: policy.version,
                detail: format!(
                    "eval mean return {mean:.1} >= {:.1} over {} episodes",
                    threshold.unwrap_or(f64::NAN),
                    cfg.eval.episodes
                ),
            };
            service.publish(service.subjects.status(), &status).await;
        }
    }
    service.health.set_ready(false);
    service.drain().await;
    Ok(())
}
