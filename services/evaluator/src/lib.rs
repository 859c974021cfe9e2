//! evaluator: plays deterministic episodes with the learner's newest weights
//! on eval seeds distinct from the training seeds, and publishes the result.
//!
//! It runs on its own schedule and never blocks training: it waits for a
//! version at least `eval.every_versions` past the last one it evaluated,
//! always takes the newest (skipping those it could not keep up with, and
//! counting them), plays `eval.episodes` episodes (one per sub-env of a
//! vectorized env, each run to its end), and publishes an [`EvalReport`].
//! When the mean return reaches the threshold (the env's reward threshold
//! unless `eval.threshold` says otherwise) it also announces the run solved.

use prometheus::{Gauge, IntCounter};
use rand::SeedableRng;
use relay_envs::{ActionSpace, VecActions, VecEnv};
use relay_kit::{Service, ServiceConfig, ServiceError, Shutdown};
use relay_nn::{Actions, ActorCritic};
use relay_policy::PolicyFollower;
use relay_proto::{EvalReport, RunStatus, RunStatusUpdate, SCHEMA_VERSION};

/// Plays one episode per sub-env with the policy's deterministic actions;
/// returns each episode's return.
pub fn evaluate(
    model: &ActorCritic,
    env_id: &str,
    episodes: usize,
    seed: u64,
) -> Result<Vec<f64>, String> {
    let mut envs = VecEnv::new(env_id, episodes, seed).map_err(|e| e.to_string())?;
    let spec = envs.spec().clone();
    let obs_dim = envs.obs_dim();
    let mut obs = envs.reset().map_err(|e| e.to_string())?.to_vec();
    let mut returns: Vec<Option<f64>> = vec![None; episodes];
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut clipped = Vec::new();
    while returns.iter().any(Option::is_none) {
        let out = model
            .act(&obs, obs.len() / obs_dim, true, &mut rng)
            .map_err(|e| e.to_string())?;
        let step = match (&out.actions, &spec.action_space) {
            (Actions::Discrete(a), _) => envs.step(VecActions::Discrete(a)),
            (Actions::Continuous(a), ActionSpace::Box { low, high }) => {
                clipped.clear();
                clipped.extend(
                    a.iter()
                        .enumerate()
                        .map(|(i, v)| v.clamp(low[i % low.len()], high[i % low.len()])),
                );
                envs.step(VecActions::Continuous(&clipped))
            }
            (Actions::Continuous(_), ActionSpace::Discrete { .. }) => {
                return Err("continuous actions for a discrete env".into())
            }
        }
        .map_err(|e| e.to_string())?;
        for e in &step.finished {
            returns[e.env_index].get_or_insert(e.episode_return);
        }
        obs.copy_from_slice(&step.obs);
    }
    Ok(returns
        .into_iter()
        .map(|r| r.expect("every episode finished"))
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
    relay_kit::metrics::register(&service.registry, &skipped);
    relay_kit::metrics::register(&service.registry, &last_return);
    service.health.set_ready(true);
    let mut last: Option<u64> = None;
    let mut announced_solved = false;
    loop {
        let wanted = last.map(|v| v + cfg.eval.every_versions - 1);
        let policy = tokio::select! {
            _ = shutdown.wait() => break,
            p = follower.newer_than(wanted) => match p { Some(p) => p, None => break },
        };
        if let Some(previous) = last {
            skipped.inc_by(policy.version.saturating_sub(previous + 1));
        }
        last = Some(policy.version);
        let (env_id, episodes, seed) = (cfg.run.env_id.clone(), cfg.eval.episodes, cfg.eval.seed);
        let model_policy = policy.clone();
        let returns = tokio::task::spawn_blocking(move || {
            evaluate(&model_policy.model, &env_id, episodes, seed)
        })
        .await
        .map_err(ServiceError::other)?;
        let returns = match returns {
            Ok(r) => r,
            Err(e) => {
                tracing::error!(error = %e, version = policy.version, "evaluation failed");
                continue;
            }
        };
        let (mean, std) = mean_std(&returns);
        let solved = threshold.is_some_and(|t| mean >= t);
        last_return.set(mean);
        tracing::info!(
            version = policy.version,
            mean_return = mean,
            std_return = std,
            solved,
            "evaluated"
        );
        let report = EvalReport {
            schema: SCHEMA_VERSION,
            evaluator: "greedy".into(),
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
