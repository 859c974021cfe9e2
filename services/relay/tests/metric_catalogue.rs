//! The metric catalogue (`configs/metrics.yaml`) and the services agree:
//! every metric any service registers or reports is catalogued, and every
//! catalogued metric is emitted by some service during a short real run.

use std::time::{Duration, Instant};

use relay_kit::metrics::{emitted, Catalogue};
use relay_kit::{ExperimentConfig, ServiceConfig, Shutdown};
use relay_testkit::{NatsServer, RedisServer, TempDir};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metric_catalogue_matches_what_services_emit() {
    let nats = NatsServer::start().unwrap();
    let redis = RedisServer::start().unwrap();
    let dir = TempDir::new("catalogue");
    let text = format!(
        "run:\n  id: catalogue\n  env_id: CartPole-v1\n  runs_dir: {}\n  total_env_steps: 100000\nconnections:\n  nats_url: {}\n  redis_url: {}\nreplay:\n  capacity_steps: 1024\nppo:\n  rollout_steps: 256\n  minibatch_size: 256\n  epochs: 2\neval:\n  every_versions: 1\n  episodes: 2\n  threshold: 100000\n",
        dir.path().display(),
        nats.url(),
        redis.url()
    );
    let experiment = ExperimentConfig::from_layers(&text, "test", &[], &[]).unwrap();
    let (trigger, shutdown) = Shutdown::new();
    let config = || ServiceConfig::for_test(experiment.clone());
    let tasks = vec![
        tokio::spawn(relay_tracker::run(config(), shutdown.clone())),
        tokio::spawn(relay_replay_buffer::run(config(), shutdown.clone())),
        tokio::spawn(relay_inference_server::run(config(), shutdown.clone())),
        tokio::spawn(relay_evaluator::run(config(), shutdown.clone())),
        tokio::spawn(relay_env_runner::run(config(), shutdown.clone())),
        tokio::spawn(relay_learner::run(config(), shutdown.clone())),
    ];
    // Until every catalogued metric has shown up (reports come each second,
    // the learner's after its first update), or a deadline.
    let catalogue: Vec<String> = Catalogue::get().names().map(String::from).collect();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let seen = emitted();
        if catalogue.iter().all(|n| seen.contains(n)) || Instant::now() > deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let seen = emitted();
    let missing: Vec<&String> = catalogue.iter().filter(|n| !seen.contains(*n)).collect();
    let uncatalogued: Vec<&String> = seen
        .iter()
        .filter(|n| Catalogue::get().spec(n).is_none())
        .collect();
    trigger.trigger();
    for task in tasks {
        tokio::time::timeout(Duration::from_secs(15), task)
            .await
            .expect("service stops")
            .unwrap()
            .unwrap();
    }
    assert!(
        uncatalogued.is_empty(),
        "emitted but not in configs/metrics.yaml: {uncatalogued:?}"
    );
    assert!(
        missing.is_empty(),
        "in configs/metrics.yaml but never emitted: {missing:?}"
    );
}
