//! A stopping owner cuts its waits on Python workers short: a step of a
//! worker that does not answer and a start that does not finish both end
//! with `BridgeError::Cancelled` soon after the `Cancel` is set, whatever
//! `env.step_timeout_s` (60 s) and `env.start_timeout_s` (120 s) say, and
//! the workers die with the envs (no process outlives its owner).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use relay_bridge::{BridgeError, Cancel, EnvSection, VecEnvs};
use relay_envs::VecActions;

/// The promise of every service: stopped within 2 s of being asked.
/// The bridge's part is a small share of it (it notices within tens of
/// milliseconds); the bound leaves the loaded test machine its margin.
const PROMISE: Duration = Duration::from_secs(2);

/// A module of test envs in `dir` whose workers write their pid to
/// `dir/pid-<pid>` as each env is made.
fn slow_envs(dir: &Path, entry: &str) -> EnvSection {
    std::fs::write(
        dir.join("relay_slow_envs.py"),
        r#"
import os, time
import numpy as np
import gymnasium as gym
from gymnasium import spaces

def _mark(folder):
    open(os.path.join(folder, f"pid-{os.getpid()}"), "w").close()

class Stuck(gym.Env):
    """Its first step never returns (a hung worker)."""
    observation_space = spaces.Box(-1.0, 1.0, (2,), np.float32)
    action_space = spaces.Discrete(2)
    def __init__(self, folder):
        _mark(folder)
    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return np.zeros(2, np.float32), {}
    def step(self, action):
        time.sleep(600)

class SlowToMake(gym.Env):
    """Never finishes being made (an import or a start that hangs)."""
    observation_space = spaces.Box(-1.0, 1.0, (2,), np.float32)
    action_space = spaces.Discrete(2)
    def __init__(self, folder):
        _mark(folder)
        time.sleep(600)
"#,
    )
    .unwrap();
    EnvSection {
        backend: relay_bridge::Backend::Gymnasium,
        python_path: vec![dir.to_path_buf()],
        entry_point: Some(format!("relay_slow_envs:{entry}")),
        kwargs: [(
            "folder".to_string(),
            serde_json::Value::String(dir.display().to_string()),
        )]
        .into_iter()
        .collect(),
        workers: 2,
        ..EnvSection::default()
    }
}

fn tempdir(label: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("relay-cancel-{label}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// The pids the workers wrote to `dir`.
fn worker_pids(dir: &Path) -> Vec<i32> {
    std::fs::read_dir(dir)
        .unwrap()
        .filter_map(|e| {
            e.ok()?
                .file_name()
                .to_str()?
                .strip_prefix("pid-")?
                .parse()
                .ok()
        })
        .collect()
}

/// Whether process `pid` still exists (a zombie counts: nobody waited for it).
fn alive(pid: i32) -> bool {
    // SAFETY: kill(2) with signal 0 only checks that the process exists.
    unsafe { libc::kill(pid, 0) == 0 }
}

/// Sets `cancel` once `workers` workers have written their pid (they are
/// inside the env's code), and returns when it did.
fn cancel_once_started(
    dir: PathBuf,
    workers: usize,
    cancel: Cancel,
) -> std::thread::JoinHandle<Instant> {
    std::thread::spawn(move || {
        let deadline = Instant::now() + Duration::from_secs(60);
        while worker_pids(&dir).len() < workers {
            assert!(Instant::now() < deadline, "the workers never started");
            std::thread::sleep(Duration::from_millis(10));
        }
        // Inside the sleep now (or about to be).
        std::thread::sleep(Duration::from_millis(200));
        let at = Instant::now();
        cancel.cancel();
        at
    })
}

#[test]
fn a_step_of_a_stuck_worker_ends_soon_after_cancel_and_its_workers_die() {
    let dir = tempdir("step");
    let section = slow_envs(&dir, "Stuck");
    assert_eq!(section.step_timeout_s, 60.0, "the default step timeout");
    let cancel = Cancel::new();
    let mut envs = VecEnvs::cancellable("Stuck-v0", &section, 4, 1, &cancel).unwrap();
    envs.reset().unwrap();
    let canceller = cancel_once_started(dir.clone(), 2, cancel.clone());
    let stepped = envs.step(VecActions::Discrete(&[0, 1, 0, 1])).map(|_| ());
    let returned = Instant::now();
    let cancelled_at = canceller.join().unwrap();
    assert!(
        matches!(stepped, Err(BridgeError::Cancelled { .. })),
        "{stepped:?}"
    );
    let late = returned - cancelled_at;
    assert!(
        late < PROMISE,
        "the step returned {late:?} after the cancel"
    );
    // Cancelled for good: nothing waits again.
    assert!(matches!(
        envs.step(VecActions::Discrete(&[0, 1, 0, 1])),
        Err(BridgeError::Cancelled { .. })
    ));
    let pids = worker_pids(&dir);
    assert_eq!(pids.len(), 2, "{pids:?}");
    drop(envs);
    for pid in pids {
        assert!(!alive(pid), "worker {pid} outlived its envs");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_start_that_does_not_finish_ends_soon_after_cancel_and_its_workers_die() {
    let dir = tempdir("start");
    let section = slow_envs(&dir, "SlowToMake");
    assert_eq!(section.start_timeout_s, 120.0, "the default start timeout");
    let cancel = Cancel::new();
    let canceller = cancel_once_started(dir.clone(), 2, cancel.clone());
    let made = VecEnvs::cancellable("SlowToMake-v0", &section, 2, 1, &cancel).map(|_| ());
    let returned = Instant::now();
    let cancelled_at = canceller.join().unwrap();
    assert!(
        matches!(made, Err(BridgeError::Cancelled { .. })),
        "{made:?}"
    );
    let late = returned - cancelled_at;
    assert!(
        late < PROMISE,
        "the start returned {late:?} after the cancel"
    );
    for pid in worker_pids(&dir) {
        assert!(!alive(pid), "worker {pid} outlived the failed start");
    }
    // Already cancelled: no worker is started at all.
    let again = VecEnvs::cancellable("SlowToMake-v0", &section, 2, 1, &cancel).map(|_| ());
    assert!(matches!(again, Err(BridgeError::Cancelled { .. })));
    let _ = std::fs::remove_dir_all(&dir);
}
