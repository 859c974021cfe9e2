//! Checkpoint resume and evaluator plugins, against real nats-server and
//! redis-server: the learner runs as its own process, is killed with SIGKILL
//! mid-run and resumed from its last checkpoint; evaluators switch plugins
//! while training runs.

use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use relay_config::ExperimentConfig;
use relay_kit::{ServiceConfig, Shutdown};
use relay_proto::{
    EvalControl, EvalReport, MetricsReport, Subjects, WeightsUpdate, SCHEMA_VERSION,
};
use relay_testkit::{ChildProcess, NatsServer, RedisServer, TempDir};

fn config_text(
    run_id: &str,
    runs: &std::path::Path,
    nats: &str,
    redis: &str,
    budget: u64,
) -> String {
    format!(
        "run:\n  id: {run_id}\n  env_id: CartPole-v1\n  runs_dir: {}\n  total_env_steps: {budget}\nconnections:\n  nats_url: {nats}\n  redis_url: {redis}\nreplay:\n  capacity_steps: 512\nppo:\n  rollout_steps: 256\n  minibatch_size: 256\n  epochs: 2\n  checkpoint_every: 2\n  keep_checkpoints: 3\neval:\n  every_versions: 2\n  episodes: 2\n  threshold: 1000000000\n",
        runs.display()
    )
}

fn learner(
    config: &std::path::Path,
    run_id: &str,
    nats: &str,
    redis: &str,
    extra: &[String],
    log_dir: &std::path::Path,
    name: &str,
) -> ChildProcess {
    let mut command = Command::new(relay_testkit::workspace_binary("relay-learner").unwrap());
    command.arg("--config").arg(config).args([
        "--run-id",
        run_id,
        "--nats-url",
        nats,
        "--redis-url",
        redis,
    ]);
    for e in extra {
        command.args(["--set", e]);
    }
    ChildProcess::spawn(command, name, log_dir).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_learner_resumes_from_its_checkpoint_and_the_run_solves() {
    let nats = NatsServer::start().unwrap();
    let redis = RedisServer::start().unwrap();
    let dir = TempDir::new("resume");
    let runs = dir.path().join("runs");
    let run_id = "resume-test";
    // The shipped CartPole config, checkpointing every 2 updates.
    let config_path = std::path::Path::new(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../configs/cartpole-ppo.yaml"
    ));
    let overrides: Vec<String> = vec![
        format!("run.id={run_id}"),
        format!("run.runs_dir={}", runs.display()),
        format!("connections.nats_url={}", nats.url()),
        format!("connections.redis_url={}", redis.url()),
        "run.total_env_steps=200000".into(),
        "ppo.checkpoint_every=2".into(),
        "ppo.keep_checkpoints=3".into(),
        "eval.every_versions=2".into(),
        "eval.episodes=5".into(),
    ];
    let text = std::fs::read_to_string(config_path).unwrap();
    let experiment = ExperimentConfig::from_layers(&text, "test", &[], &overrides).unwrap();
    let (trigger, shutdown) = Shutdown::new();
    let config = || ServiceConfig::for_test(experiment.clone());
    let tasks = vec![
        tokio::spawn(relay_tracker::run(config(), shutdown.clone())),
        tokio::spawn(relay_replay_buffer::run(config(), shutdown.clone())),
        tokio::spawn(relay_inference_server::run(config(), shutdown.clone())),
        tokio::spawn(relay_evaluator::run(config(), shutdown.clone())),
        tokio::spawn(relay_env_runner::run(config(), shutdown.clone())),
    ];
    // Every weights version published, in order.
    let client = async_nats::connect(nats.url()).await.unwrap();
    let subjects = Subjects::new(run_id);
    let mut weights = client.subscribe(subjects.weights()).await.unwrap();
    let versions: Arc<Mutex<Vec<u64>>> = Arc::default();
    {
        let versions = versions.clone();
        tokio::spawn(async move {
            while let Some(m) = weights.next().await {
                if let Ok(w) = relay_proto::decode::<WeightsUpdate>(&m.payload) {
                    versions.lock().unwrap().push(w.version);
                }
            }
        });
    }
    let run_dir = runs.join(run_id);
    let logs = dir.path().join("logs");
    std::fs::create_dir_all(&logs).unwrap();

    let mut first = learner(
        config_path,
        run_id,
        &nats.url(),
        &redis.url(),
        &overrides,
        &logs,
        "learner-1",
    );
    // Kill it once it has made 7 updates (checkpoints at 2, 4, 6 and the first eval).
    let deadline = Instant::now() + Duration::from_secs(120);
    while versions.lock().unwrap().last().copied().unwrap_or(0) < 7 {
        assert!(
            Instant::now() < deadline,
            "learner never reached version 7:\n{}",
            std::fs::read_to_string(&first.log).unwrap_or_default()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    first.child.kill().unwrap(); // SIGKILL
    first.child.wait().unwrap();
    let killed_at = *versions.lock().unwrap().last().unwrap();
    let checkpoint = std::fs::canonicalize(run_dir.join("checkpoints/last")).unwrap();
    let saved: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(checkpoint.join("state.json")).unwrap())
            .unwrap();
    assert!(saved["rng"]["word_pos"].is_string(), "{saved}");
    assert!(
        run_dir.join("checkpoints/best").exists(),
        "no best checkpoint after the first eval"
    );

    let resumed = [
        overrides.clone(),
        vec![format!("run.resume_from={}", checkpoint.display())],
    ]
    .concat();
    let mut second = learner(
        config_path,
        run_id,
        &nats.url(),
        &redis.url(),
        &resumed,
        &logs,
        "learner-2",
    );
    // The resumed run trains on until the evaluator announces it solved
    // (the learner then stops by itself: run.stop_when_solved), and the
    // resumed learner has published (an evaluation of a version from
    // before the kill, its confirmation still playing at the kill, can
    // solve the run first).
    let status_path = run_dir.join("status.json");
    let deadline = Instant::now() + Duration::from_secs(300);
    loop {
        let status = std::fs::read_to_string(&status_path).unwrap_or_default();
        let resumed_published = versions.lock().unwrap().last().copied() > Some(killed_at);
        // ... and the tracker has written a report of the resumed learner
        // (the run can solve between its publish and its report).
        let resumed_reported = std::fs::read_to_string(run_dir.join("metrics.jsonl"))
            .unwrap_or_default()
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .any(|v| v["values"]["learner_resumed_at_vec_steps"].as_f64() > Some(0.0));
        if status.contains("\"solved\"") && resumed_published && resumed_reported {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the resumed run never solved (status {status}):\n{}",
            std::fs::read_to_string(&second.log).unwrap_or_default()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    second.terminate(Duration::from_secs(10)).unwrap();
    trigger.trigger();
    for task in tasks {
        tokio::time::timeout(Duration::from_secs(15), task)
            .await
            .expect("service stops")
            .unwrap()
            .unwrap();
    }

    // The version never went back, and the resumed learner went past the kill.
    let versions = versions.lock().unwrap().clone();
    assert!(
        versions.windows(2).all(|w| w[1] > w[0]),
        "versions went back: {versions:?}"
    );
    assert!(*versions.last().unwrap() > killed_at);

    // One timeline: each learner line is the previous one plus its rollout's
    // vector steps, from the first update to the last, across the resume
    // (the tracker purged the lines of the updates redone after the checkpoint).
    let text = std::fs::read_to_string(run_dir.join("metrics.jsonl")).unwrap();
    let mut prev = 0;
    let mut resumed_lines = 0;
    for line in text.lines() {
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        let values = &v["values"];
        let (Some(vec), Some(rollout), Some(resumed)) = (
            values["learner_vec_steps"].as_f64(),
            values["learner_rollout_vec_steps"].as_f64(),
            values["learner_resumed_at_vec_steps"].as_f64(),
        ) else {
            continue;
        };
        let (vec, rollout) = (vec as u64, rollout as u64);
        assert!(rollout > 0);
        assert_eq!(vec, prev + rollout, "gap or overlap in vec_steps at {line}");
        if resumed > 0.0 {
            if resumed_lines == 0 {
                assert_eq!(resumed as u64, saved["vec_steps"].as_u64().unwrap());
                assert_eq!(
                    prev, resumed as u64,
                    "the resumed series starts at its checkpoint"
                );
            }
            resumed_lines += 1;
        }
        prev = vec;
    }
    assert!(
        resumed_lines > 0,
        "no resumed learner reports in metrics.jsonl"
    );
    // The CSV holds the same single timeline.
    let csv = std::fs::read_to_string(run_dir.join("metrics.csv")).unwrap();
    let learner_steps: Vec<u64> = csv
        .lines()
        .filter(|l| l.contains(",learner_vec_steps,"))
        .map(|l| l.split(',').nth(3).unwrap().parse().unwrap())
        .collect();
    assert!(
        learner_steps.windows(2).all(|w| w[1] > w[0]),
        "metrics.csv learner_vec_steps not one timeline: {learner_steps:?}"
    );
    assert!(saved["updates"].as_u64().unwrap() >= 2);
    drop(first);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn evaluator_plugins_switch_while_training_runs() {
    let nats = NatsServer::start().unwrap();
    let redis = RedisServer::start().unwrap();
    let dir = TempDir::new("evalswap");
    let runs = dir.path().join("runs");
    let run_id = "eval-swap";
    let text = config_text(run_id, &runs, &nats.url(), &redis.url(), 10_000_000)
        .replace("every_versions: 2", "every_versions: 1");
    let experiment = ExperimentConfig::from_layers(&text, "test", &[], &[]).unwrap();
    let (trigger, shutdown) = Shutdown::new();
    let config = || ServiceConfig::for_test(experiment.clone());
    let client = async_nats::connect(nats.url()).await.unwrap();
    let subjects = Subjects::new(run_id);
    let mut evals = client.subscribe(subjects.eval()).await.unwrap();
    let mut metrics = client.subscribe(subjects.metrics()).await.unwrap();
    let tasks = vec![
        tokio::spawn(relay_tracker::run(config(), shutdown.clone())),
        tokio::spawn(relay_replay_buffer::run(config(), shutdown.clone())),
        tokio::spawn(relay_inference_server::run(config(), shutdown.clone())),
        tokio::spawn(relay_evaluator::run(config(), shutdown.clone())),
        tokio::spawn(relay_env_runner::run(config(), shutdown.clone())),
        tokio::spawn(relay_learner::run(config(), shutdown.clone())),
    ];
    // Learner updates over a window, from its reports.
    async fn updates_per_second(metrics: &mut async_nats::Subscriber, window: Duration) -> f64 {
        let mut first: Option<(Instant, f64)> = None;
        let mut last = None;
        let end = Instant::now() + window;
        while Instant::now() < end {
            if let Ok(Some(m)) =
                tokio::time::timeout(Duration::from_millis(200), metrics.next()).await
            {
                if let Ok(r) = relay_proto::decode::<MetricsReport>(&m.payload) {
                    if let Some(v) = r.values.iter().find(|v| v.name == "learner_updates") {
                        let now = (Instant::now(), v.value);
                        first.get_or_insert(now);
                        last = Some(now);
                    }
                }
            }
        }
        let ((t0, u0), (t1, u1)) = (first.expect("learner reports"), last.unwrap());
        (u1 - u0) / (t1 - t0).as_secs_f64().max(1e-3)
    }
    async fn wait_for(evals: &mut async_nats::Subscriber, name: &str) -> EvalReport {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            assert!(Instant::now() < deadline, "no {name} eval");
            if let Ok(Some(m)) = tokio::time::timeout(Duration::from_secs(1), evals.next()).await {
                let r: EvalReport = relay_proto::decode(&m.payload).unwrap();
                if r.evaluator == name {
                    return r;
                }
            }
        }
    }
    let greedy = wait_for(&mut evals, "greedy").await;
    let before = updates_per_second(&mut metrics, Duration::from_secs(4)).await;
    let switch = |name: &str| EvalControl {
        schema: SCHEMA_VERSION,
        evaluator: name.into(),
        options: vec![],
    };
    // An unknown plugin is refused; the evaluator keeps going.
    relay::eval::send(&nats.url(), run_id, &switch("nope"))
        .await
        .unwrap();
    relay::eval::send(&nats.url(), run_id, &switch("stochastic"))
        .await
        .unwrap();
    let stochastic = wait_for(&mut evals, "stochastic").await;
    assert!(stochastic.policy_version > greedy.policy_version);
    relay::eval::send(
        &nats.url(),
        run_id,
        &EvalControl {
            options: vec![("episodes".into(), "3".into())],
            ..switch("record")
        },
    )
    .await
    .unwrap();
    let record = wait_for(&mut evals, "record").await;
    assert_eq!(record.returns.len(), 3);
    let after = updates_per_second(&mut metrics, Duration::from_secs(4)).await;
    let recording = runs
        .join(run_id)
        .join(format!("recordings/v{}.jsonl", record.policy_version));
    let lines = std::fs::read_to_string(&recording)
        .unwrap_or_else(|e| panic!("{}: {e}", recording.display()));
    assert_eq!(lines.lines().count(), 3);
    let first: serde_json::Value = serde_json::from_str(lines.lines().next().unwrap()).unwrap();
    for key in ["obs", "actions", "rewards", "terminated", "truncated"] {
        assert!(first[key].is_array(), "{key} missing: {first}");
    }
    trigger.trigger();
    for task in tasks {
        tokio::time::timeout(Duration::from_secs(15), task)
            .await
            .expect("service stops")
            .unwrap()
            .unwrap();
    }
    // Training never waited for the swaps: it kept updating after them.
    // (A rate comparison would be a timed assertion: on 2 shared cores the
    // recording plugin's episodes alone can halve the learner's rate.)
    assert!(
        before > 0.0 && after > 0.0,
        "updates/s {before:.2} before the swaps, {after:.2} after"
    );
}
