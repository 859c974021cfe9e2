//! End to end (`relay up`, every service a process, real nats-server and
//! redis-server): a policy whose weights are about 20 MB trains for several
//! versions and every follower takes each of them; a run that cannot
//! progress fails loudly: a learner that cannot publish, and a stall,
//! stop the stack and make `relay up` exit non-zero with the reason.

use std::io::BufRead;
use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use relay_testkit::{NatsServer, TempDir};

const CARTPOLE: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../configs/cartpole-ppo.yaml"
);

/// `relay up` on CartPole with `args`, its state and runs under `dir`.
fn relay_up(dir: &TempDir, run_id: &str, args: &[&str]) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_relay"));
    command
        .args(["up", "--config", CARTPOLE, "--run-id", run_id])
        .arg("--state-dir")
        .arg(dir.path().join("state"))
        .args([
            "--set",
            &format!("run.runs_dir={}", dir.path().join("runs").display()),
        ])
        .args(args);
    command
}

/// The value of metric `name` (its first sample) in a `/metrics` text.
fn metric(text: &str, name: &str) -> Option<f64> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .find(|l| l.starts_with(name) && l[name.len()..].starts_with([' ', '{']))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
}

/// Every service copy of the stack recorded in `state/stack.json`, with
/// its `/metrics` text.
fn scrape_all(dir: &TempDir) -> Vec<(String, String)> {
    let record: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(dir.path().join("state/stack.json")).expect("stack.json"),
    )
    .unwrap();
    record["processes"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|p| {
            let addr: SocketAddr = p["metrics_addr"].as_str()?.parse().ok()?;
            let (_, text) = relay_testkit::http_get(addr, "/metrics").ok()?;
            Some((p["name"].as_str()?.to_string(), text))
        })
        .collect()
}

#[test]
fn a_policy_of_20_mb_trains_and_every_follower_takes_each_version() {
    let dir = TempDir::new("big-policy");
    // Two hidden layers of 1,600 for the actor and the critic: 5.1M
    // parameters, 20.6 MB of f32. Observation normalisation on, so the
    // env-runner follows the versions too (their statistics only).
    let mut child = relay_up(
        &dir,
        "big-policy",
        &[
            "--inference-servers",
            "2",
            "--stall-timeout",
            "120",
            "--set",
            "policy.hidden=[1600, 1600]",
            "--set",
            "normalize.obs=true",
            "--set",
            "ppo.rollout_steps=256",
            "--set",
            "ppo.minibatch_size=256",
            "--set",
            "ppo.epochs=1",
            "--set",
            "run.total_env_steps=1536",
            "--set",
            "eval.every_versions=1",
            "--set",
            "eval.episodes=2",
            "--set",
            "eval.threshold=100000",
        ],
    )
    .stdout(Stdio::piped())
    .stderr(Stdio::null())
    .spawn()
    .expect("run relay up");
    let (tx, rx) = mpsc::channel::<String>();
    let stdout = child.stdout.take().unwrap();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stdout)
            .lines()
            .map_while(Result::ok)
        {
            let _ = tx.send(line);
        }
    });
    let mut printed = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(600);
    while !printed
        .iter()
        .any(|l: &String| l.contains("learner finished"))
    {
        assert!(
            Instant::now() < deadline,
            "the learner did not finish:\n{}",
            printed.join("\n")
        );
        match rx.recv_timeout(Duration::from_secs(1)) {
            Ok(line) => printed.push(line),
            Err(mpsc::RecvTimeoutError::Timeout) => {}
            Err(e) => panic!("relay up ended: {e}\n{}", printed.join("\n")),
        }
    }
    // 1,536 env steps of 256: versions 1 to 6 after version 0. Every
    // follower holds the last (the normalising env-runner its statistics,
    // though a full replay buffer may hold it back from acting with them
    // once the learner has stopped taking data); the inference servers
    // fetched each.
    let settle = Instant::now() + Duration::from_secs(30);
    let services = loop {
        let services = scrape_all(&dir);
        let learner = services
            .iter()
            .find(|(n, _)| n.starts_with("learner"))
            .unwrap();
        let last = metric(&learner.1, "relay_learner_weights_version").unwrap();
        assert_eq!(last, 6.0, "learner's last version");
        let followers: Vec<_> = services
            .iter()
            .filter(|(n, _)| n.starts_with("inference-server") || n.starts_with("env-runner"))
            .collect();
        assert_eq!(followers.len(), 3, "two inference servers, one env-runner");
        if followers
            .iter()
            .all(|(_, t)| metric(t, "relay_weights_version_held") == Some(last))
            || Instant::now() > settle
        {
            break services;
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    for (name, text) in &services {
        if name.starts_with("env-runner") {
            assert_eq!(
                metric(text, "relay_weights_version_held"),
                Some(6.0),
                "{name}"
            );
        }
        if name.starts_with("inference-server") {
            assert_eq!(
                metric(text, "relay_weights_version_held"),
                Some(6.0),
                "{name}"
            );
            assert_eq!(
                metric(text, "relay_inference_weights_version"),
                Some(6.0),
                "{name}"
            );
            // Versions come about a second apart, each fetched whole.
            let fetched = metric(text, "relay_weights_transfer_seconds_count").unwrap_or(0.0);
            let bytes = metric(text, "relay_weights_received_bytes_total").unwrap_or(0.0);
            assert!(fetched >= 6.0, "{name} fetched {fetched} versions");
            assert!(bytes >= 6.0 * 20e6, "{name} received {bytes} bytes");
        }
    }
    // The evaluator plays the last version after it fetched it (2
    // episodes of up to 500 steps): wait for its report.
    let run_dir = dir.path().join("runs/big-policy");
    let evaluated = Instant::now() + Duration::from_secs(60);
    while !std::fs::read_to_string(run_dir.join("eval.jsonl"))
        .unwrap_or_default()
        .contains("\"policy_version\":6")
        && Instant::now() < evaluated
    {
        std::thread::sleep(Duration::from_millis(200));
    }
    let _ = Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status();
    let status = child.wait().unwrap();
    assert!(status.success(), "relay up exited with {status}");
    let metrics = std::fs::read_to_string(run_dir.join("metrics.jsonl")).unwrap();
    let last_seen = |service: &str, name: &str| -> f64 {
        metrics
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter(|v| v["service"] == service)
            .filter_map(|v| v["values"][name].as_f64())
            .fold(0.0, f64::max)
    };
    // The env-runner acted with the learner's versions while it took data
    // (which it last acted with depends on when a full replay buffer held
    // it back); the evaluator fetched and played the last.
    assert!(last_seen("env-runner", "env_runner_policy_version") >= 1.0);
    let evals = std::fs::read_to_string(run_dir.join("eval.jsonl")).unwrap();
    assert!(
        evals.contains("\"policy_version\":6"),
        "the evaluator never played version 6:\n{evals}"
    );
}

#[test]
fn a_learner_that_cannot_publish_fails_the_run_with_the_reason() {
    // An operator's NATS without JetStream, and direct transfer off: a
    // version larger than weights.inline_max_bytes has no way to travel.
    let nats = NatsServer::start_without_jetstream().unwrap();
    let dir = TempDir::new("cannot-publish");
    let started = Instant::now();
    let output = relay_up(
        &dir,
        "cannot-publish",
        &[
            "--nats-url",
            &nats.url(),
            "--set",
            "weights.direct=false",
            "--set",
            "weights.inline_max_bytes=1024",
        ],
    )
    .output()
    .expect("run relay up");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "relay up succeeded:\n{stdout}");
    assert!(
        // The stack hears of it from the learner's exit or from its failed
        // status, whichever comes first.
        (stdout.contains("relay: learner-0 exited")
            || stdout.contains("relay: learner failed: learner-0"))
            && stdout.contains("cannot be published"),
        "{stdout}"
    );
    assert!(
        stdout.contains("JetStream"),
        "the reason is named:\n{stdout}"
    );
    assert!(stderr.contains("failed"), "{stderr}");
    assert!(stdout.contains("relay: stack stopped"), "{stdout}");
    assert!(started.elapsed() < Duration::from_secs(60));
}

#[test]
fn a_run_with_no_env_step_and_no_update_fails_as_stalled() {
    let dir = TempDir::new("stall");
    let output = relay_up(
        &dir,
        "stalled",
        &["--without", "env-runner", "--stall-timeout", "5"],
    )
    .output()
    .expect("run relay up");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(!output.status.success(), "relay up succeeded:\n{stdout}");
    assert!(
        stdout.contains("stalled: no env step and no learner update for"),
        "{stdout}"
    );
    // What each service last reported, by name.
    for service in ["learner-0", "inference-server-0", "replay-buffer-0"] {
        assert!(stdout.contains(service), "{service} not named:\n{stdout}");
    }
}
