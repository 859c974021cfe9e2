//! The run registry `runs/runs.json`: concurrent writers (threads and
//! processes), newest-first order, status transitions, corrupt files.

use std::path::Path;
use std::process::{Command, Stdio};

use relay_config::ExperimentConfig;
use relay_proto::{RunStatus, RunStatusUpdate, SCHEMA_VERSION};
use relay_runs::registry::{RegistryError, RunRecord, RunRecorder, RunRegistry};
use relay_testkit::TempDir;

const CHILD_DIR: &str = "RELAY_REGISTRY_TEST_CHILD_DIR";
const CHILD_TAG: &str = "RELAY_REGISTRY_TEST_CHILD_TAG";
const PER_WRITER: usize = 12;

fn record(id: &str, seconds: u32) -> RunRecord {
    let time = format!(
        "2025-01-01T{:02}:{:02}:{:02}.000Z",
        seconds / 3600,
        seconds / 60 % 60,
        seconds % 60
    );
    RunRecord {
        id: id.into(),
        time: time.clone(),
        config_id: "cartpole-ppo".into(),
        env_id: "CartPole-v1".into(),
        algo: "ppo".into(),
        seed: Some(1),
        status: RunStatus::Running,
        detail: String::new(),
        updated: time,
    }
}

/// One writer: registers its runs one by one, each then stopped and solved.
fn write_runs(dir: &Path, tag: usize) {
    let registry = RunRegistry::new(dir);
    for i in 0..PER_WRITER {
        let id = format!("w{tag}-r{i}");
        registry
            .upsert(record(&id, (tag * 100 + i) as u32))
            .unwrap();
        let r = registry
            .set_status(&id, RunStatus::Stopped, "budget spent")
            .unwrap();
        assert_eq!(r.unwrap().status, RunStatus::Stopped);
        if i % 2 == 0 {
            registry
                .set_status(&id, RunStatus::Solved, "eval mean 500")
                .unwrap();
        }
    }
}

/// Not a test on its own: the body of each child process of
/// `threads_and_processes_share_the_registry`.
#[test]
fn registry_child_writer() {
    let (Ok(dir), Ok(tag)) = (std::env::var(CHILD_DIR), std::env::var(CHILD_TAG)) else {
        return;
    };
    write_runs(Path::new(&dir), tag.parse().unwrap());
}

#[test]
fn threads_and_processes_share_the_registry() {
    let tmp = TempDir::new("registry-concurrent");
    let dir = tmp.path().join("runs");
    let exe = std::env::current_exe().unwrap();
    let processes: Vec<_> = (0..3)
        .map(|p| {
            Command::new(&exe)
                .args(["registry_child_writer", "--exact", "--nocapture"])
                .env(CHILD_DIR, &dir)
                .env(CHILD_TAG, (10 + p).to_string())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let threads: Vec<_> = (0..4)
        .map(|t| {
            let dir = dir.clone();
            std::thread::spawn(move || write_runs(&dir, t))
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    for p in processes {
        let out = p.wait_with_output().unwrap();
        assert!(
            out.status.success(),
            "a child writer failed:\n{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let records = RunRegistry::new(&dir).load().unwrap();
    let writers = [0, 1, 2, 3, 10, 11, 12];
    assert_eq!(records.len(), writers.len() * PER_WRITER, "a run was lost");
    for tag in writers {
        for i in 0..PER_WRITER {
            let id = format!("w{tag}-r{i}");
            let r = records
                .iter()
                .find(|r| r.id == id)
                .unwrap_or_else(|| panic!("{id} lost"));
            let expected = if i % 2 == 0 {
                RunStatus::Solved
            } else {
                RunStatus::Stopped
            };
            assert_eq!(r.status, expected, "{id}");
        }
    }
    // Newest first, in the file itself too.
    let text = std::fs::read_to_string(dir.join("runs.json")).unwrap();
    let raw: Vec<RunRecord> = serde_json::from_str(&text).unwrap();
    assert_eq!(raw, records);
    assert_eq!(records[0].id, format!("w12-r{}", PER_WRITER - 1));
    assert!(records.windows(2).all(|w| w[0].time >= w[1].time));
    // No temporary file is left.
    let mut names: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    assert_eq!(names, ["runs.json", "runs.json.lock"]);
}

fn config(runs: &Path) -> ExperimentConfig {
    let text = format!(
        "run:\n  env_id: CartPole-v1\n  seed: 7\n  runs_dir: {}\nppo:\n  rollout_steps: 256\n",
        runs.display()
    );
    ExperimentConfig::from_layers(&text, "test", &[], &[]).unwrap()
}

fn update(status: RunStatus, service: &str) -> RunStatusUpdate {
    RunStatusUpdate {
        schema: SCHEMA_VERSION,
        status,
        service: service.into(),
        policy_version: 3,
        detail: format!("{service} says {status:?}"),
    }
}

#[test]
fn status_transitions_of_a_tracked_run() {
    let tmp = TempDir::new("registry-status");
    let runs = tmp.path().join("runs");
    let cfg = config(&runs);
    let registry = RunRegistry::new(&runs);
    let status_of = |id: &str| registry.get(id).unwrap().unwrap().status;

    let mut a = RunRecorder::start(&cfg, "run-a");
    let stored = registry.get("run-a").unwrap().unwrap();
    assert_eq!(stored.status, RunStatus::Running);
    assert_eq!(stored.config_id, "cartpole-ppo");
    assert_eq!(stored.env_id, "CartPole-v1");
    assert_eq!(stored.algo, "ppo");
    assert_eq!(stored.seed, Some(7));
    chrono::DateTime::parse_from_rfc3339(&stored.time).unwrap();
    chrono::DateTime::parse_from_rfc3339(&stored.updated).unwrap();

    a.status(&update(RunStatus::Running, "learner"));
    assert_eq!(status_of("run-a"), RunStatus::Running);
    // The evaluator's solved, then the learner's stopped: solved wins.
    a.status(&update(RunStatus::Solved, "evaluator"));
    assert_eq!(status_of("run-a"), RunStatus::Solved);
    a.status(&update(RunStatus::Stopped, "learner"));
    assert_eq!(status_of("run-a"), RunStatus::Solved);
    a.finish();
    let done = registry.get("run-a").unwrap().unwrap();
    assert_eq!(done.status, RunStatus::Solved);
    assert_eq!(done.detail, "evaluator says Solved");

    // The learner's stopped, then a late solved: solved.
    let mut b = RunRecorder::start(&cfg, "run-b");
    b.status(&update(RunStatus::Stopped, "learner"));
    assert_eq!(status_of("run-b"), RunStatus::Stopped);
    b.status(&update(RunStatus::Solved, "evaluator"));
    assert_eq!(status_of("run-b"), RunStatus::Solved);

    // No status before shutdown: stopped.
    let mut c = RunRecorder::start(&cfg, "run-c");
    c.finish();
    assert_eq!(status_of("run-c"), RunStatus::Stopped);

    // A tracker starting again on a run makes it running, keeping its start time.
    let first_start = registry.get("run-c").unwrap().unwrap().time;
    std::thread::sleep(std::time::Duration::from_millis(5));
    let again = RunRecorder::start(&cfg, "run-c");
    assert_eq!(again.record().time, first_start);
    assert_eq!(status_of("run-c"), RunStatus::Running);

    // Newest first: c, b, a (started in that order, a first).
    let ids: Vec<String> = registry.load().unwrap().into_iter().map(|r| r.id).collect();
    assert_eq!(ids, ["run-c", "run-b", "run-a"]);
    assert_eq!(registry.newest().unwrap().unwrap().id, "run-c");
    // Unknown runs are not invented by a status update.
    assert!(registry
        .set_status("nope", RunStatus::Solved, "")
        .unwrap()
        .is_none());
}

#[test]
fn a_missing_registry_is_empty() {
    let tmp = TempDir::new("registry-missing");
    let registry = RunRegistry::new(tmp.path().join("runs"));
    assert!(registry.load().unwrap().is_empty());
    assert!(registry.newest().unwrap().is_none());
}

#[test]
fn a_corrupt_registry_is_reported_kept_and_rebuilt() {
    let tmp = TempDir::new("registry-corrupt");
    let runs = tmp.path().join("runs");
    let cfg = config(&runs);
    // Two finished runs with their directories, as trackers leave them.
    for (id, status) in [("old-1", "solved"), ("old-2", "stopped")] {
        let dir = runs.join(id);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("config.yaml"), cfg.to_yaml()).unwrap();
        std::fs::write(
            dir.join("status.json"),
            format!("{{\"status\": \"{status}\", \"detail\": \"d\"}}"),
        )
        .unwrap();
    }
    let garbage = "[{\"id\": \"old-1\", \"time\": ";
    std::fs::write(runs.join("runs.json"), garbage).unwrap();
    let registry = RunRegistry::new(&runs);

    // Readers and plain writers get a clear error and the file stays as it is.
    let e = registry.load().unwrap_err();
    assert!(matches!(e, RegistryError::Corrupt { .. }), "{e}");
    let message = e.to_string();
    assert!(
        message.contains("runs.json") && message.contains("not a valid run registry"),
        "{message}"
    );
    assert!(registry.upsert(record("x", 1)).is_err());
    assert_eq!(
        std::fs::read_to_string(runs.join("runs.json")).unwrap(),
        garbage
    );
    assert!(!runs.join("runs.json.bak").exists());

    // A tracker keeps it as a .bak and rebuilds from the run directories.
    std::thread::sleep(std::time::Duration::from_millis(20));
    std::fs::create_dir_all(runs.join("new-run")).unwrap();
    std::fs::write(runs.join("new-run/config.yaml"), cfg.to_yaml()).unwrap();
    let _tracker = RunRecorder::start(&cfg, "new-run");
    assert_eq!(
        std::fs::read_to_string(runs.join("runs.json.bak")).unwrap(),
        garbage
    );
    let records = registry.load().unwrap();
    let find = |id: &str| records.iter().find(|r| r.id == id).unwrap().clone();
    assert_eq!(records.len(), 3);
    assert_eq!(records[0].id, "new-run");
    assert_eq!(find("old-1").status, RunStatus::Solved);
    assert_eq!(find("old-1").config_id, "cartpole-ppo");
    assert_eq!(find("old-1").seed, Some(7));
    assert_eq!(find("old-2").status, RunStatus::Stopped);
    assert_eq!(find("new-run").status, RunStatus::Running);

    // A second corruption does not overwrite the first backup; repair() on a
    // readable registry changes nothing.
    std::fs::write(runs.join("runs.json"), "not json").unwrap();
    let repair = registry.repair().unwrap();
    assert_eq!(repair.backup, Some(runs.join("runs.json.1.bak")));
    assert_eq!(
        std::fs::read_to_string(runs.join("runs.json.bak")).unwrap(),
        garbage
    );
    assert_eq!(
        std::fs::read_to_string(runs.join("runs.json.1.bak")).unwrap(),
        "not json"
    );
    let again = registry.repair().unwrap();
    assert_eq!(again.backup, None);
    assert_eq!(again.runs, 3);
}
