//! `relay scale` against a real `relay up` stack: new copies join and report
//! metrics, removed copies drain and exit cleanly, instance names are not
//! reused, the supervisor still stops cleanly on SIGINT.

use std::collections::BTreeSet;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use futures::StreamExt;
use relay_testkit::{stack_record, Supervisor};

fn names(state: &Path) -> BTreeSet<String> {
    stack_record(state).map_or_else(BTreeSet::new, |r| {
        r["processes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| p["name"].as_str().unwrap().to_string())
            .collect()
    })
}

fn relay_scale(state: &Path, targets: &[&str]) -> (bool, String) {
    let output = Command::new(env!("CARGO_BIN_EXE_relay"))
        .arg("scale")
        .args(targets)
        .arg("--state-dir")
        .arg(state)
        .output()
        .expect("run relay scale");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    (output.status.success(), text)
}

/// Instances that reported `metric` on `relay.<run>.metrics` within `within`,
/// stopping early once `want` are all seen.
async fn reporting(
    metrics: &mut async_nats::Subscriber,
    metric: &str,
    want: &BTreeSet<String>,
    within: Duration,
) -> BTreeSet<String> {
    let mut seen = BTreeSet::new();
    let deadline = tokio::time::Instant::now() + within;
    while !want.is_subset(&seen) {
        match tokio::time::timeout_at(deadline, metrics.next()).await {
            Ok(Some(m)) => {
                if let Ok(r) = relay_proto::decode::<relay_proto::MetricsReport>(&m.payload) {
                    if r.values.iter().any(|v| v.name == metric) {
                        seen.insert(r.instance);
                    }
                }
            }
            _ => break,
        }
    }
    seen
}

fn set(names: &[&str]) -> BTreeSet<String> {
    names.iter().map(|s| s.to_string()).collect()
}

#[test]
fn scale_refuses_no_learner_and_unknown_services() {
    let dir = relay_testkit::TempDir::new("scale-refuse");
    for (target, expect) in [
        ("learner=0", "at least one learner"),
        ("trainer=2", "not a service"),
        ("env-runner", "expected <service>=<copies>"),
        ("env-runner=-1", "not a number"),
    ] {
        let (ok, text) = relay_scale(dir.path(), &[target]);
        assert!(!ok, "{target} was accepted: {text}");
        assert!(text.contains(expect), "{target}: {text}");
    }
    // Valid, but no stack runs there.
    let (ok, text) = relay_scale(dir.path(), &["env-runner=2"]);
    assert!(!ok && text.contains("no running stack"), "{text}");
}

#[test]
fn scale_adds_and_drains_copies_of_a_running_stack() {
    let dir = relay_testkit::TempDir::new("scale");
    let state = dir.path().join("state");
    let run_id = "scale-cartpole";
    let config = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../configs/cartpole-ppo.yaml"
    );
    let log = std::fs::File::create(dir.path().join("relay-up.log")).unwrap();
    let mut up = Supervisor(
        Command::new(env!("CARGO_BIN_EXE_relay"))
            .args(["up", "--quiet", "--config", config, "--run-id", run_id])
            .arg("--state-dir")
            .arg(&state)
            .args([
                "--set",
                &format!("run.runs_dir={}", dir.path().join("runs").display()),
                "--set",
                "run.total_env_steps=200000",
                "--set",
                "eval.threshold=100000",
            ])
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("start relay up"),
    );
    let up_log = || std::fs::read_to_string(dir.path().join("relay-up.log")).unwrap_or_default();

    // stack.json lists the learner once every service was started.
    let deadline = Instant::now() + Duration::from_secs(120);
    while !names(&state).contains("learner-0") {
        assert!(
            up.0.try_wait().unwrap().is_none(),
            "relay up exited:\n{}",
            up_log()
        );
        assert!(Instant::now() < deadline, "no stack.json:\n{}", up_log());
        std::thread::sleep(Duration::from_millis(100));
    }
    let nats_url = stack_record(&state).unwrap()["nats_url"]
        .as_str()
        .unwrap()
        .to_string();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let client = runtime.block_on(async_nats::connect(&nats_url)).unwrap();
    let mut metrics = runtime
        .block_on(client.subscribe(format!("relay.{run_id}.metrics")))
        .unwrap();

    // Scale up: new copies are in stack.json and report metrics within seconds.
    let (ok, text) = relay_scale(&state, &["env-runner=3", "inference-server=2"]);
    assert!(ok, "relay scale failed: {text}\n{}", up_log());
    for started in ["env-runner-1", "env-runner-2", "inference-server-1"] {
        assert!(text.contains(&format!("started {started}")), "{text}");
    }
    let now = names(&state);
    for name in [
        "env-runner-0",
        "env-runner-1",
        "env-runner-2",
        "inference-server-0",
        "inference-server-1",
    ] {
        assert!(now.contains(name), "{name} not in stack.json: {now:?}");
    }
    let runners = set(&["env-runner-0", "env-runner-1", "env-runner-2"]);
    let seen = runtime.block_on(reporting(
        &mut metrics,
        "env_runner_sps",
        &runners,
        Duration::from_secs(10),
    ));
    assert!(
        runners.is_subset(&seen),
        "env_runner_sps only from {seen:?}"
    );
    // The Prometheus targets follow (when prometheus is installed).
    let targets = state.join("prometheus/targets/relay.json");
    if targets.exists() {
        let text = std::fs::read_to_string(&targets).unwrap();
        assert!(text.contains("env-runner-2") && text.contains("inference-server-1"));
    }

    // Scale down: the two newest runners drain and exit with code 0.
    let (ok, text) = relay_scale(&state, &["env-runner=1"]);
    assert!(ok, "relay scale failed: {text}");
    for stopped in ["env-runner-1", "env-runner-2"] {
        assert!(
            text.contains(&format!("stopped {stopped} (exit code 0)")),
            "{text}"
        );
    }
    let now = names(&state);
    assert!(
        now.contains("env-runner-0")
            && !now.contains("env-runner-1")
            && !now.contains("env-runner-2")
    );
    if targets.exists() {
        assert!(!std::fs::read_to_string(&targets)
            .unwrap()
            .contains("env-runner-2"));
    }

    // Scaling up again never reuses a name: the next runner is env-runner-3.
    let (ok, text) = relay_scale(&state, &["env-runner=2", "inference-server=0"]);
    assert!(ok, "relay scale failed: {text}");
    assert!(text.contains("started env-runner-3"), "{text}");
    assert!(
        text.contains("stopped inference-server-1 (exit code 0)"),
        "{text}"
    );
    assert!(
        text.contains("stopped inference-server-0 (exit code 0)"),
        "{text}"
    );
    let (ok, text) = relay_scale(&state, &["inference-server=1"]);
    assert!(ok && text.contains("started inference-server-2"), "{text}");
    let runners = set(&["env-runner-0", "env-runner-3"]);
    let seen = runtime.block_on(reporting(
        &mut metrics,
        "env_runner_sps",
        &runners,
        Duration::from_secs(10),
    ));
    assert!(
        runners.is_subset(&seen),
        "env_runner_sps only from {seen:?}"
    );

    // SIGINT: the supervisor stops everything and exits 0.
    up.interrupt();
    let deadline = Instant::now() + Duration::from_secs(90);
    let status = loop {
        if let Some(status) = up.0.try_wait().unwrap() {
            break status;
        }
        assert!(
            Instant::now() < deadline,
            "relay up did not stop:\n{}",
            up_log()
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(
        status.success(),
        "relay up exited with {status}:\n{}",
        up_log()
    );
    assert!(!state.join("stack.json").exists());
}
