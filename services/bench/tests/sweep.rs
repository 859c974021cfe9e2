//! `relay sweep` as the real binary: a two-trial grid on CartPole with the
//! whole stack (nats-server, redis-server, the six services) per trial,
//! each a normal run in the registry, ranked in a table, a JSON line and
//! `<sweep>.sweep.json`; a bad search is refused before any trial starts.

use std::process::Command;

#[test]
fn a_grid_sweep_runs_each_trial_as_a_run_and_ranks_them() {
    let dir = relay_testkit::TempDir::new("sweep");
    let runs = dir.path().join("runs");
    let config = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../configs/cartpole-ppo.yaml"
    );
    let sweep = |extra: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_relay-bench"))
            .args(["sweep", "--config", config, "--run-id", "sw"])
            .arg("--state-dir")
            .arg(dir.path().join("state"))
            .args(["--set", &format!("run.runs_dir={}", runs.display())])
            .args([
                "--set",
                "run.total_env_steps=2048",
                "--set",
                "eval.every_versions=2",
                "--set",
                "eval.episodes=2",
            ])
            .args(extra)
            .output()
            .expect("run relay sweep")
    };

    // A bad dimension or a value the config refuses: nothing runs.
    for (extra, needle) in [
        (
            vec!["--random", "ppo.learning_rate=normal:0:1", "--trials", "2"],
            "unknown distribution",
        ),
        (
            vec!["--grid", "ppo.learning_rate=0.001,-1"],
            "ppo.learning_rate",
        ),
    ] {
        let output = sweep(&extra);
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(!output.status.success(), "{extra:?} was accepted");
        assert!(stderr.contains(needle), "{extra:?}: {stderr}");
        assert!(!runs.join("sw-t0").exists(), "{extra:?} started a trial");
    }

    let output = sweep(&["--grid", "ppo.learning_rate=0.001,0.0003"]);
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "relay sweep failed\nstdout:\n{stdout}\nstderr:\n{stderr}"
    );
    assert!(stdout.contains("| rank | trial | overrides |"), "{stdout}");
    let summary: serde_json::Value =
        serde_json::from_str(stdout.lines().last().expect("a JSON line")).expect("JSON line");
    assert_eq!(summary["trials"], 2);
    let record: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(runs.join("sw.sweep.json")).unwrap())
            .unwrap();
    let trials = record["trials"].as_array().unwrap();
    assert_eq!(trials.len(), 2);
    let mut overrides: Vec<String> = trials
        .iter()
        .map(|t| t["overrides"][0].as_str().unwrap().to_string())
        .collect();
    overrides.sort();
    assert_eq!(
        overrides,
        vec!["ppo.learning_rate=0.0003", "ppo.learning_rate=0.001"]
    );
    for t in trials {
        let run_id = t["run_id"].as_str().unwrap();
        // Each trial is a run: its own directory, with its overrides applied.
        let config = std::fs::read_to_string(runs.join(run_id).join("config.yaml")).unwrap();
        let lr = t["overrides"][0]
            .as_str()
            .unwrap()
            .split('=')
            .nth(1)
            .unwrap();
        assert!(config.contains(lr), "{run_id}: {config}");
        assert!(t["evaluations"].as_u64().unwrap() >= 1, "{t}");
        assert!(t["env_steps"].as_u64().unwrap() > 0, "{t}");
    }
    // Both trials are in the registry.
    let registry = std::fs::read_to_string(runs.join("runs.json")).unwrap();
    assert!(
        registry.contains("sw-t0") && registry.contains("sw-t1"),
        "{registry}"
    );
}

/// `--nats-url`/`--redis-url`: the trials run on a nats-server and a
/// redis-server the sweep did not start (another machine's, in real use),
/// where anyone connected sees the trial's traffic.
#[test]
fn a_sweep_against_a_remote_nats_runs_its_trials_there() {
    use futures::StreamExt;

    let dir = relay_testkit::TempDir::new("sweep-remote");
    let nats = relay_testkit::NatsServer::start().expect("nats-server");
    let redis = relay_testkit::RedisServer::start().expect("redis-server");
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let mut trial_messages = runtime.block_on(async {
        let client = async_nats::connect(nats.url()).await.unwrap();
        client.subscribe("relay.swr-t0.>").await.unwrap()
    });

    let config = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../configs/cartpole-ppo.yaml"
    );
    let state = dir.path().join("state");
    let output = Command::new(env!("CARGO_BIN_EXE_relay-bench"))
        .args(["sweep", "--config", config, "--run-id", "swr"])
        .args(["--grid", "ppo.learning_rate=0.001"])
        .args(["--nats-url", &nats.url(), "--redis-url", &redis.url()])
        .arg("--state-dir")
        .arg(&state)
        .args([
            "--set",
            &format!("run.runs_dir={}", dir.path().join("runs").display()),
            "--set",
            "run.total_env_steps=1024",
            "--set",
            "eval.every_versions=1",
            "--set",
            "eval.episodes=1",
        ])
        .output()
        .expect("run relay sweep");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "relay sweep failed\nstdout:\n{stdout}\nstderr:\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(stdout.contains(&nats.url()), "{stdout}");
    let seen = runtime.block_on(async {
        let mut seen = 0;
        while let Ok(Some(_)) =
            tokio::time::timeout(std::time::Duration::from_millis(200), trial_messages.next()).await
        {
            seen += 1;
        }
        seen
    });
    assert!(
        seen > 10,
        "only {seen} messages of trial swr-t0 on the remote NATS"
    );
    // Neither server was started by the sweep.
    let logs: Vec<String> = std::fs::read_dir(state.join("logs"))
        .map(|d| {
            d.filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    assert!(
        !logs
            .iter()
            .any(|l| l.starts_with("nats-server") || l.starts_with("redis-server")),
        "{logs:?}"
    );
}
