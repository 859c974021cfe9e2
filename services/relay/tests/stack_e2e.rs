//! End to end: `relay up` starts real nats-server, redis-server (and
//! prometheus) and all six services as separate processes, trains CartPole
//! on a tiny budget, and stops everything cleanly.

use std::process::Command;

fn read(path: &std::path::Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

#[test]
fn six_services_train_over_nats_and_redis() {
    let dir = relay_testkit::TempDir::new("e2e");
    let runs = dir.path().join("runs");
    let run_id = "e2e-cartpole";
    let config = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../configs/cartpole-ppo.yaml"
    );
    let output = Command::new(env!("CARGO_BIN_EXE_relay"))
        .args([
            "up",
            "--until-solved",
            "--quiet",
            "--config",
            config,
            "--run-id",
            run_id,
        ])
        .arg("--state-dir")
        .arg(dir.path().join("state"))
        .args(["--set", &format!("run.runs_dir={}", runs.display())])
        .args([
            "--set",
            "run.total_env_steps=3072",
            "--set",
            "eval.every_versions=4",
            "--set",
            "eval.episodes=4",
        ])
        .output()
        .expect("run relay up");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "relay up failed\nstdout:\n{stdout}\nstderr:\n{stderr}"
    );
    assert!(stdout.contains("learner finished"), "{stdout}");

    let run_dir = runs.join(run_id);
    // The tracker wrote the run directory.
    assert!(read(&run_dir.join("config.yaml")).contains("CartPole-v1"));
    let metrics = read(&run_dir.join("metrics.jsonl"));
    // Rollouts flowed and the learner updated: 3072 env steps is 12 updates of 256.
    let max_of = |name: &str| -> f64 {
        metrics
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter_map(|v| v["values"][name].as_f64())
            .fold(f64::NAN, f64::max)
    };
    assert!(
        max_of("learner_updates") >= 12.0,
        "learner_updates {}",
        max_of("learner_updates")
    );
    assert!(max_of("learner_env_steps") >= 3072.0);
    // Weights reached the inference server and the env-runner acted with them.
    assert!(
        max_of("inference_weights_version") >= 1.0,
        "inference server never served a new version"
    );
    assert!(max_of("env_runner_policy_version") >= 1.0);
    assert!(max_of("replay_inserted_steps_total") > 0.0 || metrics.contains("replay_size_steps"));
    // Episodes, evals, a status, logs of every service, a checkpoint.
    assert!(!read(&run_dir.join("episodes.jsonl")).is_empty());
    assert!(read(&run_dir.join("eval.jsonl")).contains("\"evaluator\":\"greedy\""));
    assert!(
        read(&run_dir.join("status.json")).contains("\"stopped\"")
            || read(&run_dir.join("status.json")).contains("\"solved\"")
    );
    // The tracker's own first lines precede its subscription to the logs subject.
    for service in [
        "replay-buffer",
        "inference-server",
        "evaluator",
        "env-runner",
        "learner",
    ] {
        let log = read(&run_dir.join("logs").join(format!("{service}.log")));
        assert!(
            log.contains("started"),
            "{service} log lacks its start line:\n{log}"
        );
    }
    assert!(read(&run_dir.join("logs/tracker.log")).contains("run status"));
    assert!(read(&run_dir.join("logs/learner.log")).contains("training finished"));
    assert!(run_dir.join("checkpoints/last/model.safetensors").is_file());
    assert!(run_dir
        .join("checkpoints/last/optimizer.safetensors")
        .is_file());
    // Every service stopped on SIGTERM (none had to be killed).
    assert!(
        !stdout.contains("did not stop") && !stderr.contains("did not stop"),
        "{stdout}\n{stderr}"
    );
}
