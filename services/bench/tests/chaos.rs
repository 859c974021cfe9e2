//! Fault injection: `relay chaos` SIGKILLs every service (the inference
//! server with and without a second copy), restarts Redis and NATS, during a
//! CartPole run; every fault must be recovered from and the run must still
//! reach solved with its registry entry and checkpoints intact.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

#[test]
fn chaos_every_fault_recovers_and_the_run_solves() {
    let dir = relay_testkit::TempDir::new("chaos");
    let runs = dir.path().join("runs");
    let config = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../configs/cartpole-ppo.yaml"
    );
    let out_path = dir.path().join("chaos.out");
    let err_path = dir.path().join("chaos.err");
    let mut child = Command::new(env!("CARGO_BIN_EXE_relay-bench"))
        .args(["chaos", "--config", config, "--for-seconds", "100"])
        .arg("--state-dir")
        .arg(dir.path().join("state"))
        .args(["--set", &format!("run.runs_dir={}", runs.display())])
        .stdout(Stdio::from(std::fs::File::create(&out_path).unwrap()))
        .stderr(Stdio::from(std::fs::File::create(&err_path).unwrap()))
        .spawn()
        .expect("run relay chaos");
    // Bounded: the chaos run limits itself to 100 s of schedule and solving.
    let deadline = Instant::now() + Duration::from_secs(150);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break Some(status);
        }
        if Instant::now() > deadline {
            // SIGTERM: the supervisor stops its stack on the way out.
            // SAFETY: kill(2) on the child this test started.
            unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
            std::thread::sleep(Duration::from_secs(20));
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    let stdout = std::fs::read_to_string(&out_path).unwrap_or_default();
    let stderr = std::fs::read_to_string(&err_path).unwrap_or_default();
    let status = status.unwrap_or_else(|| {
        panic!("relay chaos did not finish within 150 s\nstdout:\n{stdout}\nstderr:\n{stderr}")
    });
    assert!(
        status.success(),
        "relay chaos failed ({status})\nstdout:\n{stdout}\nstderr:\n{stderr}"
    );
    let summary: serde_json::Value = stdout
        .lines()
        .rev()
        .find(|l| l.starts_with('{'))
        .and_then(|l| serde_json::from_str(l).ok())
        .unwrap_or_else(|| panic!("no JSON summary line\n{stdout}"));
    let faults = summary["faults"].as_array().expect("faults");
    let names: Vec<&str> = faults.iter().filter_map(|f| f["fault"].as_str()).collect();
    for expected in [
        "env-runner",
        "inference-server (1 of 2)",
        "inference-server (only copy)",
        "replay-buffer",
        "evaluator",
        "tracker",
        "learner",
        "redis-server",
        "nats-server",
    ] {
        assert!(names.contains(&expected), "{expected} missing: {summary}");
    }
    for f in faults {
        assert_eq!(f["recovered"], true, "{f}\n{stdout}");
        assert!(f["recover_s"].as_f64().is_some_and(|s| s < 20.0), "{f}");
    }
    assert_eq!(summary["all_recovered"], true, "{summary}");
    assert_eq!(summary["solved"], true, "{summary}");
    assert_eq!(summary["runs_json_ok"], true, "{summary}");
    assert!(
        summary["checkpoints_ok"].as_u64().unwrap_or(0) > 0,
        "{summary}"
    );
    assert!(stdout.contains("| fault | time to recover (s)"), "{stdout}");

    // The registry still parses and lists the run.
    let registry: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(runs.join("runs.json")).unwrap()).unwrap();
    let run_id = summary["run_id"].as_str().unwrap();
    assert!(
        registry
            .as_array()
            .unwrap()
            .iter()
            .any(|r| r["id"] == run_id),
        "{registry}"
    );
}
