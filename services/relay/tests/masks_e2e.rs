//! Action masks end to end: `relay up` with every service a process over
//! real NATS and Redis trains a Gymnasium env whose `info["action_mask"]`
//! allows one action per step and which raises on any other, so a single
//! unmasked sample (env-runner), greedy pick (evaluator) or epsilon draw
//! (DQN) would fault an episode. PPO, REINFORCE and DQN each train through
//! it, and the evaluator's greedy episodes all play out.

use std::path::Path;
use std::process::Command;

/// The test env: episodes of 8 steps, reward 1 a step; at step `t` only
/// action `t % 3` is legal (the observation is `t`, one-hot).
const MODULE: &str = r#"
import numpy as np
import gymnasium as gym
from gymnasium import spaces

class OneLegal(gym.Env):
    observation_space = spaces.Discrete(8)
    action_space = spaces.Discrete(3)
    def _info(self):
        mask = np.zeros(3, np.int8)
        mask[self.t % 3] = 1
        return {"action_mask": mask}
    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return 0, self._info()
    def step(self, action):
        if action != self.t % 3:
            raise ValueError(f"illegal action {action} at step {self.t}")
        self.t += 1
        return self.t % 8, 1.0, self.t >= 8, False, self._info()
"#;

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn up(dir: &Path, run_id: &str, algo: &str, sets: &[&str]) -> String {
    std::fs::write(dir.join("relay_masked_env.py"), MODULE).unwrap();
    let config = dir.join(format!("{run_id}.yaml"));
    std::fs::write(
        &config,
        format!(
            "run:\n  env_id: RelayOneLegal-v0\n  algo: {algo}\n  seed: 3\n\
             env:\n  backend: gymnasium\n  entry_point: relay_masked_env:OneLegal\n  python_path: [{}]\n\
             eval:\n  every_versions: 2\n  episodes: 4\n",
            dir.display()
        ),
    )
    .unwrap();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_relay"));
    cmd.args(["up", "--until-solved", "--quiet", "--config"])
        .arg(&config)
        .args(["--run-id", run_id])
        .arg("--state-dir")
        .arg(dir.join(format!("state-{run_id}")))
        .args([
            "--set",
            &format!("run.runs_dir={}", dir.join("runs").display()),
        ]);
    for s in sets {
        cmd.args(["--set", s]);
    }
    let output = cmd.output().expect("run relay up");
    let stdout = String::from_utf8_lossy(&output.stdout).to_string();
    assert!(
        output.status.success(),
        "relay up failed\nstdout:\n{stdout}\nstderr:\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(stdout.contains("learner finished"), "{stdout}");
    let logs = dir.join(format!("state-{run_id}/logs"));
    for entry in std::fs::read_dir(&logs).unwrap() {
        let log = read(&entry.unwrap().path());
        assert!(
            !log.contains("illegal action"),
            "an action the mask forbids reached the env:\n{log}"
        );
    }
    let run_dir = dir.join("runs").join(run_id);
    let episodes = read(&run_dir.join("episodes.jsonl"));
    assert!(episodes.contains("\"length\":8"), "{episodes}");
    let eval = read(&run_dir.join("eval.jsonl"));
    let last: serde_json::Value =
        serde_json::from_str(eval.lines().last().expect("an evaluation")).unwrap();
    assert_eq!(
        last["returns"],
        serde_json::json!([8.0, 8.0, 8.0, 8.0]),
        "{eval}"
    );
    stdout
}

#[test]
fn masked_actions_never_reach_the_env_in_ppo_reinforce_and_dqn() {
    let dir = relay_testkit::TempDir::new("masks-e2e");
    let stdout = up(
        dir.path(),
        "masked-ppo",
        "ppo",
        &[
            "run.total_env_steps=2048",
            "env_runner.num_envs=4",
            "env_runner.fragment_steps=32",
            "ppo.rollout_steps=512",
            "ppo.minibatch_size=128",
        ],
    );
    assert!(
        stdout.contains("RelayOneLegal-v0 from Gymnasium"),
        "{stdout}"
    );
    up(
        dir.path(),
        "masked-reinforce",
        "reinforce",
        &[
            "run.total_env_steps=1024",
            "env_runner.num_envs=4",
            "env_runner.fragment_steps=32",
        ],
    );
    up(
        dir.path(),
        "masked-dqn",
        "dqn",
        &[
            "run.total_env_steps=1500",
            "env_runner.num_envs=2",
            "env_runner.fragment_steps=16",
            "dqn.learning_starts=200",
            "dqn.exploration_fraction=0.5",
        ],
    );
}
