//! A2C and REINFORCE through the whole stack, against real nats-server and
//! redis-server: every service in process, the shipped presets
//! (`configs/cartpole-a2c.yaml`, `configs/cartpole-reinforce.yaml`).
//!
//! Improvement is measured against the untrained policy itself: the
//! learner's initial model is a function of `run.seed`, so the test plays
//! it greedily on the evaluator's own seeds and asks the trained policy for
//! a far better mean return on the same episodes.

use std::time::{Duration, Instant};

use futures::StreamExt;
use relay_config::ExperimentConfig;
use relay_kit::{ServiceConfig, Shutdown};
use relay_nn::ActorCritic;
use relay_proto::{EvalReport, MetricsReport, Subjects};
use relay_testkit::{NatsServer, RedisServer, TempDir};

const EVAL_EPISODES: usize = 10;

fn preset(
    file: &str,
    run_id: &str,
    dir: &TempDir,
    nats: &NatsServer,
    redis: &RedisServer,
) -> ExperimentConfig {
    let path = format!("{}/../../configs/{file}", env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(&path).unwrap();
    let overrides = vec![
        format!("run.id={run_id}"),
        format!("run.runs_dir={}", dir.path().join("runs").display()),
        format!("connections.nats_url={}", nats.url()),
        format!("connections.redis_url={}", redis.url()),
        format!("eval.episodes={EVAL_EPISODES}"),
        "eval.every_seconds=2".into(),
    ];
    ExperimentConfig::from_layers(&text, &path, &[], &overrides).unwrap()
}

/// Mean greedy return of the learner's initial policy on the evaluator's episodes.
fn initial_mean_return(cfg: &ExperimentConfig) -> f64 {
    let spec = relay_policy::spec_for(cfg).unwrap();
    let model = ActorCritic::with_layout(&spec, cfg.policy.trunk, cfg.run.seed).unwrap();
    let episodes = relay_evaluator::plugins::play(
        &model,
        None,
        relay_evaluator::plugins::eval_envs(
            &cfg.run.env_id,
            &cfg.env,
            EVAL_EPISODES,
            cfg.eval.seed,
        )
        .unwrap(),
        cfg.eval.seed,
        true,
        false,
    )
    .unwrap();
    episodes.iter().map(|e| e.ret).sum::<f64>() / EVAL_EPISODES as f64
}

/// What a training run showed before the test stopped it.
struct Trained {
    /// Eval reports, in arrival order.
    evals: Vec<EvalReport>,
    /// Names of the learner's reported metrics.
    learner_metrics: std::collections::BTreeSet<String>,
}

/// Runs the six services until an eval mean reaches `target` or `limit` passes.
async fn train(cfg: &ExperimentConfig, target: f64, limit: Duration) -> Trained {
    let (trigger, shutdown) = Shutdown::new();
    let client = async_nats::connect(&cfg.connections.nats_url)
        .await
        .unwrap();
    let subjects = Subjects::new(cfg.run_id().unwrap());
    let mut eval_sub = client.subscribe(subjects.eval()).await.unwrap();
    let mut metric_sub = client.subscribe(subjects.metrics()).await.unwrap();
    let config = || ServiceConfig::for_test(cfg.clone());
    let tasks = vec![
        tokio::spawn(relay_tracker::run(config(), shutdown.clone())),
        tokio::spawn(relay_replay_buffer::run(config(), shutdown.clone())),
        tokio::spawn(relay_inference_server::run(config(), shutdown.clone())),
        tokio::spawn(relay_evaluator::run(config(), shutdown.clone())),
        tokio::spawn(relay_env_runner::run(config(), shutdown.clone())),
        tokio::spawn(relay_learner::run(config(), shutdown.clone())),
    ];
    let mut trained = Trained {
        evals: Vec::new(),
        learner_metrics: Default::default(),
    };
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline {
        tokio::select! {
            Some(m) = eval_sub.next() => {
                let report: EvalReport = relay_proto::decode(&m.payload).unwrap();
                let reached = report.mean_return >= target;
                trained.evals.push(report);
                if reached {
                    break;
                }
            }
            Some(m) = metric_sub.next() => {
                if let Ok(r) = relay_proto::decode::<MetricsReport>(&m.payload) {
                    trained.learner_metrics.extend(
                        r.values.into_iter().map(|v| v.name).filter(|n| n.starts_with("learner_")),
                    );
                }
            }
            _ = tokio::time::sleep(Duration::from_millis(200)) => {}
        }
    }
    trigger.trigger();
    for task in tasks {
        tokio::time::timeout(Duration::from_secs(15), task)
            .await
            .expect("service stops")
            .unwrap()
            .unwrap();
    }
    trained
}

fn summary(evals: &[EvalReport]) -> String {
    evals
        .iter()
        .map(|e| {
            format!(
                "v{}@{}: {:.1}",
                e.policy_version, e.learner_env_steps, e.mean_return
            )
        })
        .collect::<Vec<_>>()
        .join(", ")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a2c_learns_cartpole_far_beyond_its_initial_policy() {
    let nats = NatsServer::start().unwrap();
    let redis = RedisServer::start().unwrap();
    let dir = TempDir::new("a2c");
    let cfg = preset("cartpole-a2c.yaml", "a2c-e2e", &dir, &nats, &redis);
    assert_eq!(cfg.algo_name(), "a2c");
    let initial = initial_mean_return(&cfg);
    // Far beyond the initial policy, and beyond what any policy that
    // ignores the state gets (a CartPole episode of constant or alternating
    // pushes lasts well under 100 steps).
    let target = (3.0 * initial).max(initial + 100.0).max(150.0);
    let trained = train(&cfg, target, Duration::from_secs(45)).await;
    let best = trained
        .evals
        .iter()
        .map(|e| e.mean_return)
        .fold(f64::NEG_INFINITY, f64::max);
    println!(
        "initial policy {initial:.1}, target {target:.1}; evals: {}",
        summary(&trained.evals)
    );
    assert!(
        best >= target,
        "best eval {best:.1} < target {target:.1} (initial policy {initial:.1})"
    );
    // The evaluator's view of version 0, when it saw it, is the initial policy.
    if let Some(v0) = trained.evals.iter().find(|e| e.policy_version == 0) {
        assert_eq!(v0.mean_return, initial);
    }
    // A2C reports the learner metrics PPO does where they apply, not PPO's own.
    for name in [
        "learner_policy_loss",
        "learner_value_loss",
        "learner_entropy",
        "learner_grad_norm",
        "learner_learning_rate",
        "learner_explained_variance",
        "learner_ent_coef",
        "learner_sps",
        "learner_updates",
    ] {
        assert!(
            trained.learner_metrics.contains(name),
            "{name} not reported: {:?}",
            trained.learner_metrics
        );
    }
    assert!(!trained.learner_metrics.contains("learner_clip_fraction"));
    // The final checkpoint holds RMSprop's state, which a resumed A2C learner loads.
    let last = dir.path().join("runs/a2c-e2e/checkpoints/last");
    let model = ActorCritic::with_layout(
        &relay_policy::spec_for(&cfg).unwrap(),
        cfg.policy.trunk,
        cfg.run.seed,
    )
    .unwrap();
    let mut optimizer = relay_learner::optimizer::Optimizer::for_run(&cfg, model.vars()).unwrap();
    optimizer
        .load(last.join("optimizer.safetensors"))
        .expect("RMSprop state in the checkpoint");
    assert!(optimizer.step_count() > 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reinforce_learns_cartpole_beyond_its_initial_policy() {
    let nats = NatsServer::start().unwrap();
    let redis = RedisServer::start().unwrap();
    let dir = TempDir::new("reinforce");
    let cfg = preset(
        "cartpole-reinforce.yaml",
        "reinforce-e2e",
        &dir,
        &nats,
        &redis,
    );
    assert_eq!(cfg.algo_name(), "reinforce");
    let initial = initial_mean_return(&cfg);
    let target = (2.0 * initial).max(initial + 60.0).max(100.0);
    let trained = train(&cfg, target, Duration::from_secs(45)).await;
    let best = trained
        .evals
        .iter()
        .map(|e| e.mean_return)
        .fold(f64::NEG_INFINITY, f64::max);
    println!(
        "initial policy {initial:.1}, target {target:.1}; evals: {}",
        summary(&trained.evals)
    );
    assert!(
        best >= target,
        "best eval {best:.1} < target {target:.1} (initial policy {initial:.1})"
    );
    for name in [
        "learner_policy_loss",
        "learner_value_loss",
        "learner_explained_variance",
    ] {
        assert!(
            trained.learner_metrics.contains(name),
            "{name} not reported"
        );
    }
}
