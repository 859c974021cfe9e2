//! Shutdown within its promise, end to end: `relay up` on CarRacing-v3
//! (Box2D, 96x96x3 images, episodes of 1,000 steps) with every service a
//! process, stopped by Ctrl-C while the evaluator plays an episode and the
//! learner is in the middle of an update. Every service ends within 2 s of
//! being asked (the learner first, then the workers, then the tracker: the
//! stack's order), nobody is killed, and the Python env workers die with
//! the services that own them.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use relay_testkit::{stack_record, Supervisor};

/// The promise of every service: stopped within 2 s of its SIGTERM.
const PROMISE: Duration = Duration::from_secs(2);

/// CarRacing with a small CNN run: an evaluation every version (version 0,
/// published at the learner's start, is the first), one episode each;
/// PPO updates of many minibatches, so the learner is still in its first
/// one when the test stops the stack.
const CONFIG: &str = "
run:
  env_id: CarRacing-v3
  algo: ppo
  seed: 1
  total_env_steps: 1000000
env:
  backend: gymnasium
policy:
  cnn: {}
  hidden: []
env_runner:
  num_envs: 2
  fragment_steps: 16
replay:
  capacity_steps: 256
ppo:
  rollout_steps: 64
  minibatch_size: 8
  epochs: 100
eval:
  every_versions: 1
  episodes: 1
";

/// The children of process `pid` (every thread's).
fn children(pid: u32) -> Vec<u32> {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return Vec::new();
    };
    tasks
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("children")).ok())
        .flat_map(|list| {
            list.split_whitespace()
                .filter_map(|p| p.parse().ok())
                .collect::<Vec<u32>>()
        })
        .collect()
}

/// A counter's value on a service's `/metrics`, 0 until it answers.
fn metric(addr: &str, name: &str) -> f64 {
    let Ok(addr) = addr.parse::<SocketAddr>() else {
        return 0.0;
    };
    let Ok((_, body)) = relay_testkit::http_get(addr, "/metrics") else {
        return 0.0;
    };
    body.lines()
        .filter(|l| l.starts_with(name))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_default()
}

#[test]
fn the_stack_stops_within_its_promise_during_a_carracing_evaluation() {
    let dir = relay_testkit::TempDir::new("shutdown-e2e");
    let config = dir.path().join("carracing.yaml");
    std::fs::write(&config, CONFIG).unwrap();
    let state = dir.path().join("state");
    let output = dir.path().join("relay-up.log");
    let log = std::fs::File::create(&output).unwrap();
    let mut up = Supervisor(
        Command::new(env!("CARGO_BIN_EXE_relay"))
            .args(["up", "--quiet", "--run-id", "e2e-shutdown", "--config"])
            .arg(&config)
            .arg("--state-dir")
            .arg(&state)
            .args([
                "--set",
                &format!("run.runs_dir={}", dir.path().join("runs").display()),
            ])
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("start relay up"),
    );
    let logs = state.join("logs");

    // Wait until the evaluator plays its episode (its Python worker made
    // the env a while ago) and the learner is inside its first update (it
    // took a whole rollout and has published no version after 0).
    let deadline = Instant::now() + Duration::from_secs(240);
    let mut evaluating_since: Option<Instant> = None;
    let pids: BTreeMap<String, u32> = loop {
        assert!(
            matches!(up.0.try_wait(), Ok(None)),
            "relay up ended early:\n{}",
            read(&output)
        );
        assert!(
            Instant::now() < deadline,
            "the evaluation or the update never began:\n{}\nevaluator:\n{}",
            read(&output),
            read(&logs.join("evaluator-0.log"))
        );
        std::thread::sleep(Duration::from_millis(50));
        let Some(record) = stack_record(&state) else {
            continue;
        };
        let procs = record["processes"].as_array().unwrap();
        let pid = |name: &str| {
            procs
                .iter()
                .find(|p| p["name"] == name)
                .and_then(|p| p["pid"].as_u64())
        };
        let addr = |name: &str| {
            procs
                .iter()
                .find(|p| p["name"] == name)
                .and_then(|p| p["metrics_addr"].as_str())
                .unwrap_or("")
                .to_string()
        };
        let (Some(evaluator), Some(_)) = (pid("evaluator-0"), pid("learner-0")) else {
            continue;
        };
        let evaluating = read(&logs.join("evaluator-0.log")).contains("evaluation started")
            && !children(evaluator as u32).is_empty();
        if !evaluating {
            continue;
        }
        let since = *evaluating_since.get_or_insert_with(Instant::now);
        let updating = metric(&addr("replay-buffer-0"), "relay_replay_sampled_steps_total") >= 64.0
            && metric(&addr("learner-0"), "relay_learner_weights_version") == 0.0;
        // Making the env and its first reset take about a second.
        if updating && since.elapsed() > Duration::from_secs(2) {
            break procs
                .iter()
                .map(|p| {
                    (
                        p["name"].as_str().unwrap().to_string(),
                        p["pid"].as_u64().unwrap() as u32,
                    )
                })
                .collect();
        }
    };
    // The Python env workers, each named after the service that owns it.
    let mut workers: Vec<(String, u32)> = Vec::new();
    for (name, &pid) in &pids {
        workers.extend(children(pid).into_iter().map(|w| (name.clone(), w)));
    }
    for owner in ["evaluator-0", "env-runner-0"] {
        assert!(
            workers.iter().any(|(o, _)| o == owner),
            "{owner} has no Python worker: {workers:?}"
        );
    }

    // Ctrl-C, and each process's end, from then (a worker seen ended in
    // the same look as its owner ended no later).
    let all: Vec<u32> = pids
        .values()
        .copied()
        .chain(workers.iter().map(|w| w.1))
        .collect();
    let ended_at = up.interrupt_and_time(&all, &output);
    let status = up.0.wait().unwrap();
    let text = read(&output);
    assert!(status.success(), "relay up: {status}\n{text}");
    assert!(
        !text.contains("did not stop within") && !text.contains("killing"),
        "{text}"
    );
    let at = |name: &str| ended_at[&pids[name]];
    let report: Vec<String> = pids
        .iter()
        .map(|(name, pid)| format!("{name} {:.2}s", ended_at[pid].as_secs_f64()))
        .collect();
    eprintln!("ended after Ctrl-C: {report:?}");
    // In the stack's order, each within the promise of its SIGTERM: the
    // learner at once, the workers once it ended, the tracker after them.
    let learner = at("learner-0");
    assert!(learner < PROMISE, "learner-0: {learner:?}; {report:?}");
    let mut workers_ended = learner;
    for name in [
        "replay-buffer-0",
        "inference-server-0",
        "evaluator-0",
        "env-runner-0",
    ] {
        let took = at(name).saturating_sub(learner);
        assert!(
            took < PROMISE,
            "{name}: {took:?} after its SIGTERM; {report:?}"
        );
        workers_ended = workers_ended.max(at(name));
    }
    let tracker = at("tracker-0").saturating_sub(workers_ended);
    assert!(tracker < PROMISE, "tracker-0: {tracker:?}; {report:?}");
    // The Python workers ended with (before) the service that owns them.
    for (owner, worker) in &workers {
        assert!(
            ended_at[worker] <= at(owner),
            "a Python worker of {owner} outlived it ({:?} against {:?})",
            ended_at[worker],
            at(owner)
        );
    }

    // The evaluation was cut short: nothing was reported for it.
    let evaluator = read(&logs.join("evaluator-0.log"));
    assert!(!evaluator.contains("evaluated"), "{evaluator}");
    // The learner's update was cut short and rolled back: the final
    // checkpoint holds version 0, the last whole update.
    let learner_log = read(&logs.join("learner-0.log"));
    assert!(
        learner_log.contains("update stopped part-way and rolled back"),
        "{learner_log}"
    );
    let last =
        std::fs::canonicalize(dir.path().join("runs/e2e-shutdown/checkpoints/last")).unwrap();
    let saved: serde_json::Value = serde_json::from_str(&read(&last.join("state.json"))).unwrap();
    assert_eq!(saved["updates"], 0, "{saved}");
}
