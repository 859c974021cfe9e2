//! DQN through the whole stack, against real nats-server and redis-server:
//! every service in process, the learner as two replicas, with the shipped
//! preset
//! (`configs/cartpole-dqn.yaml`: double DQN, prioritized replay in the
//! replay-buffer's off-policy table, the sample-to-insert rate limiter).
//!
//! Improvement is measured against the untrained Q-network itself (a
//! function of `run.seed`), played greedily on the evaluator's own seeds.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use futures::StreamExt;
use relay_config::ExperimentConfig;
use relay_kit::{ServiceConfig, Shutdown};
use relay_nn::QNetwork;
use relay_policy::PolicyModel;
use relay_proto::{EvalReport, MetricsReport, Subjects, WeightsUpdate};
use relay_testkit::{NatsServer, RedisServer, TempDir};

const EVAL_EPISODES: usize = 10;

fn initial_mean_return(cfg: &ExperimentConfig) -> f64 {
    let spec = relay_policy::qnet_spec_for(cfg).unwrap();
    let model = PolicyModel::QNetwork {
        net: QNetwork::new(&spec, cfg.run.seed).unwrap(),
        epsilon: 0.0,
    };
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dqn_with_prioritized_replay_learns_cartpole() {
    let nats = NatsServer::start().unwrap();
    let redis = RedisServer::start().unwrap();
    let dir = TempDir::new("dqn");
    let path = format!(
        "{}/../../configs/cartpole-dqn.yaml",
        env!("CARGO_MANIFEST_DIR")
    );
    let text = std::fs::read_to_string(&path).unwrap();
    let overrides = vec![
        "run.id=dqn-e2e".to_string(),
        format!("run.runs_dir={}", dir.path().join("runs").display()),
        format!("connections.nats_url={}", nats.url()),
        format!("connections.redis_url={}", redis.url()),
        format!("eval.episodes={EVAL_EPISODES}"),
        "eval.every_seconds=2".into(),
        // Every round's version published, as SB3 acts.
        "learner.publish_interval_ms=0".into(),
    ];
    let cfg = ExperimentConfig::from_layers(&text, &path, &[], &overrides).unwrap();
    assert_eq!(cfg.algo_name(), "dqn");
    assert!(cfg.dqn.prioritized && cfg.dqn.double_q);
    let initial = initial_mean_return(&cfg);
    // Far beyond the untrained network and any state-blind policy (a
    // CartPole episode of constant or alternating pushes lasts well under
    // 100 steps). Measured here: 12.4 -> 144 within 3k env steps (60 s,
    // debug build on a busy 2-core machine).
    let target = (3.0 * initial).max(initial + 100.0).max(100.0);

    let (trigger, shutdown) = Shutdown::new();
    let client = async_nats::connect(nats.url()).await.unwrap();
    let subjects = Subjects::new("dqn-e2e");
    let mut eval_sub = client.subscribe(subjects.eval()).await.unwrap();
    let mut metric_sub = client.subscribe(subjects.metrics()).await.unwrap();
    let mut weights_sub = client.subscribe(subjects.weights()).await.unwrap();
    let config = || ServiceConfig::for_test(cfg.clone());
    let tasks = vec![
        tokio::spawn(relay_tracker::run(config(), shutdown.clone())),
        tokio::spawn(relay_replay_buffer::run(config(), shutdown.clone())),
        tokio::spawn(relay_inference_server::run(config(), shutdown.clone())),
        tokio::spawn(relay_evaluator::run(config(), shutdown.clone())),
        tokio::spawn(relay_env_runner::run(config(), shutdown.clone())),
        // Two learner replicas: each round's minibatches are drawn once
        // by rank 0 and shared out, priorities summed back.
        tokio::spawn(relay_learner::run(config(), shutdown.clone())),
        tokio::spawn(relay_learner::run(config(), shutdown.clone())),
    ];
    let mut evals: Vec<EvalReport> = Vec::new();
    let mut learner: BTreeMap<String, Vec<f64>> = BTreeMap::new();
    let mut versions: Vec<(u64, u64)> = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    while Instant::now() < deadline {
        tokio::select! {
            Some(m) = eval_sub.next() => {
                let report: EvalReport = relay_proto::decode(&m.payload).unwrap();
                let reached = report.mean_return >= target;
                evals.push(report);
                if reached {
                    break;
                }
            }
            Some(m) = metric_sub.next() => {
                if let Ok(r) = relay_proto::decode::<MetricsReport>(&m.payload) {
                    for v in r.values.into_iter().filter(|v| v.name.starts_with("learner_")) {
                        learner.entry(v.name).or_default().push(v.value);
                    }
                }
            }
            Some(m) = weights_sub.next() => {
                let w: WeightsUpdate = relay_proto::decode(&m.payload).unwrap();
                versions.push((w.version, w.learner_env_steps));
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
    let summary = evals
        .iter()
        .map(|e| {
            format!(
                "v{}@{}: {:.1}",
                e.policy_version, e.learner_env_steps, e.mean_return
            )
        })
        .collect::<Vec<_>>()
        .join(", ");
    println!("initial policy {initial:.1}, target {target:.1}; evals: {summary}");
    // Both replicas trained, in one view of two.
    let ranks = &learner["learner_replica_rank"];
    assert!(ranks.contains(&0.0) && ranks.contains(&1.0), "{ranks:?}");
    assert!(learner["learner_replicas"].contains(&2.0));
    assert!(learner["learner_allreduce_bytes"].iter().any(|&b| b > 0.0));
    // Versions are published once per training round, the first after
    // learning_starts, in order.
    assert!(versions.len() >= 2, "{versions:?}");
    assert!(versions
        .windows(2)
        .all(|w| w[1].0 == w[0].0 + 1 && w[1].1 >= w[0].1));
    let first_trained = versions.iter().find(|(v, _)| *v == 1);
    if let Some((_, steps)) = first_trained {
        assert!(*steps > cfg.dqn.learning_starts, "{versions:?}");
    }
    // The learner's DQN metrics: finite loss, epsilon falling on schedule,
    // beta rising.
    for name in [
        "learner_dqn_loss",
        "learner_q_mean",
        "learner_td_error_abs",
        "learner_epsilon",
        "learner_per_beta",
        "learner_grad_norm",
        "learner_replay_size",
    ] {
        let values = learner
            .get(name)
            .unwrap_or_else(|| panic!("{name} not reported: {:?}", learner.keys()));
        assert!(values.iter().all(|v| v.is_finite()), "{name}: {values:?}");
    }
    let eps = &learner["learner_epsilon"];
    assert!(eps.windows(2).all(|w| w[1] <= w[0]), "{eps:?}");
    assert!(eps[0] < 1.0 && eps.iter().all(|&e| e >= cfg.dqn.exploration_final_eps));
    let beta = &learner["learner_per_beta"];
    assert!(
        beta.windows(2).all(|w| w[1] >= w[0]) && beta[0] >= 0.4,
        "{beta:?}"
    );
    let best = evals
        .iter()
        .map(|e| e.mean_return)
        .fold(f64::NEG_INFINITY, f64::max);
    assert!(
        best >= target,
        "best eval {best:.1} < target {target:.1} (initial policy {initial:.1})"
    );
    // The final checkpoint holds the online and target networks, Adam's
    // state and the round bookkeeping.
    let last = dir.path().join("runs/dqn-e2e/checkpoints/last");
    let spec = relay_policy::qnet_spec_for(&cfg).unwrap();
    let mut online = QNetwork::new(&spec, 0).unwrap();
    online.load(last.join("model.safetensors")).unwrap();
    let mut target_net = QNetwork::new(&spec, 0).unwrap();
    target_net.load(last.join("target.safetensors")).unwrap();
    let mut adam = relay_nn::Adam::new(online.vars(), relay_nn::AdamConfig::default()).unwrap();
    adam.load(last.join("optimizer.safetensors")).unwrap();
    assert!(adam.state().unwrap().step > 0);
    let state: relay_learner::dqn::DqnState =
        serde_json::from_str(&std::fs::read_to_string(last.join("dqn.json")).unwrap()).unwrap();
    assert!(state.rounds >= 1 && state.target_updates >= 1, "{state:?}");
}
