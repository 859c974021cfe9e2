//! An evaluation stops when its context's `Cancel` is set, in the middle of
//! an episode that would last hours: the plugin returns `STOPPED` soon
//! after (the evaluator's shutdown sets it), and the Python env workers it
//! played on are gone by then.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use relay_bridge::EnvSection;
use relay_eval::plugins::{build, Cancel, EvalContext, STOPPED};
use relay_nn::{ActorCritic, PolicySpec};
use relay_policy::VersionedPolicy;

/// The promise of every service: stopped within 2 s of being asked.
const PROMISE: Duration = Duration::from_secs(2);

/// An env whose episodes never end (a step every 5 ms), whose worker
/// writes its pid to `<folder>/pid-<pid>`.
fn endless(dir: &Path) -> EnvSection {
    std::fs::write(
        dir.join("relay_endless_env.py"),
        r#"
import os, time
import numpy as np
import gymnasium as gym
from gymnasium import spaces

class Endless(gym.Env):
    observation_space = spaces.Box(-1.0, 1.0, (4,), np.float32)
    action_space = spaces.Discrete(2)
    def __init__(self, folder):
        open(os.path.join(folder, f"pid-{os.getpid()}"), "w").close()
    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return np.zeros(4, np.float32), {}
    def step(self, action):
        time.sleep(0.005)
        return np.zeros(4, np.float32), 1.0, False, False, {}
"#,
    )
    .unwrap();
    EnvSection {
        backend: relay_bridge::Backend::Gymnasium,
        python_path: vec![dir.to_path_buf()],
        entry_point: Some("relay_endless_env:Endless".into()),
        kwargs: [(
            "folder".to_string(),
            serde_json::Value::String(dir.display().to_string()),
        )]
        .into_iter()
        .collect(),
        ..EnvSection::default()
    }
}

fn worker_pids(dir: &Path) -> Vec<u32> {
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

#[test]
fn an_evaluation_stops_mid_episode_soon_after_its_cancel() {
    let dir: PathBuf = std::env::temp_dir().join(format!("relay-eval-stop-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let cancel = Cancel::new();
    let ctx = EvalContext {
        env_id: "Endless-v0".into(),
        episodes: 2,
        seed: 1,
        run_dir: dir.clone(),
        train_return: None,
        confirming: false,
        env: endless(&dir),
        cancel: cancel.clone(),
    };
    let policy = VersionedPolicy {
        version: 1,
        learner_env_steps: 0,
        model: relay_policy::PolicyModel::ActorCritic(
            ActorCritic::new(&PolicySpec::discrete(4, 2), 1).unwrap(),
        ),
        normalizer: None,
    };
    let plugin = build("greedy", &[]).unwrap();
    let playing = std::thread::spawn(move || {
        let outcome = plugin.evaluate(&policy, &ctx);
        (outcome, Instant::now())
    });
    // The episode is under way once the worker made the env, and a little after.
    let deadline = Instant::now() + Duration::from_secs(60);
    while worker_pids(&dir).is_empty() {
        assert!(Instant::now() < deadline, "the worker never made the env");
        std::thread::sleep(Duration::from_millis(10));
    }
    std::thread::sleep(Duration::from_millis(500));
    assert!(!playing.is_finished(), "an endless episode ended");
    let cancelled = Instant::now();
    cancel.cancel();
    let (outcome, returned) = playing.join().unwrap();
    assert_eq!(outcome, Err(STOPPED.to_string()));
    let late = returned - cancelled;
    assert!(late < PROMISE, "returned {late:?} after the cancel");
    for pid in worker_pids(&dir) {
        assert!(
            !Path::new(&format!("/proc/{pid}")).exists(),
            "worker {pid} outlived the evaluation"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}
