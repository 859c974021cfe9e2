//! End to end through the env bridge: `relay up` with every service a
//! process over real NATS and Redis trains envs that exist only in Python:
//! Gymnasium's LunarLander-v3 (Box2D), MinAtar's Breakout with a CNN policy
//! on uint8 images, a user's own env module whose worker crashes once,
//! which the env-runner survives, and TextArena's SimpleTak-v0 with a LoRA
//! adapter on the tiny model.

use std::path::Path;
use std::process::{Command, Output};

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn up(dir: &Path, config: &str, run_id: &str, sets: &[String]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_relay"));
    cmd.args([
        "up",
        "--until-solved",
        "--quiet",
        "--config",
        config,
        "--run-id",
        run_id,
    ])
    .arg("--state-dir")
    .arg(dir.join("state"))
    .args([
        "--set",
        &format!("run.runs_dir={}", dir.join("runs").display()),
    ]);
    for s in sets {
        cmd.args(["--set", s]);
    }
    let output = cmd.output().expect("run relay up");
    assert!(
        output.status.success(),
        "relay up failed\nstdout:\n{}\nstderr:\n{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    output
}

fn tiny_ppo() -> Vec<String> {
    [
        "run.total_env_steps=2048",
        "env_runner.num_envs=4",
        "env_runner.fragment_steps=64",
        "replay.capacity_steps=4096",
        "ppo.rollout_steps=512",
        "ppo.minibatch_size=128",
        "eval.every_versions=2",
        "eval.episodes=2",
    ]
    .map(String::from)
    .to_vec()
}

fn max_of(metrics: &str, name: &str) -> f64 {
    metrics
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter_map(|v| v["values"][name].as_f64())
        .fold(f64::NAN, f64::max)
}

#[test]
fn lunar_lander_trains_through_the_bridge() {
    let dir = relay_testkit::TempDir::new("gym-e2e");
    let config = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../configs/lunarlander-ppo.yaml"
    );
    let output = up(dir.path(), config, "e2e-lunar", &tiny_ppo());
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(stdout.contains("LunarLander-v3 from Gymnasium"), "{stdout}");
    assert!(
        stdout.contains("8 observations, 4 discrete actions"),
        "{stdout}"
    );
    assert!(stdout.contains("learner finished"), "{stdout}");
    let run_dir = dir.path().join("runs/e2e-lunar");
    let metrics = read(&run_dir.join("metrics.jsonl"));
    assert!(max_of(&metrics, "learner_updates") >= 4.0, "{metrics}");
    assert!(max_of(&metrics, "env_runner_policy_version") >= 1.0);
    // Episodes ended (a lander crashes or lands long before 2048 steps) and
    // the evaluator played LunarLander through its own workers; Gymnasium's
    // reward threshold (200) is the run's solved line.
    let episodes = read(&run_dir.join("episodes.jsonl"));
    assert!(episodes.contains("LunarLander-v3"), "{episodes}");
    let eval = read(&run_dir.join("eval.jsonl"));
    assert!(eval.contains("\"evaluator\":\"greedy\""), "{eval}");
    assert!(eval.contains("\"threshold\":200"), "{eval}");
    assert!(run_dir.join("checkpoints/last/model.safetensors").is_file());
    assert!(
        !stdout.contains("did not stop")
            && !String::from_utf8_lossy(&output.stderr).contains("did not stop"),
        "{stdout}"
    );
}

#[test]
fn a_cnn_policy_trains_on_minatar_images() {
    let dir = relay_testkit::TempDir::new("gym-cnn-e2e");
    let config = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../configs/minatar-breakout-ppo.yaml"
    );
    let output = up(dir.path(), config, "e2e-minatar", &tiny_ppo());
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        stdout.contains("MinAtar/Breakout-v1 from Gymnasium")
            && stdout.contains("4x10x10 image (uint8) observations, 3 discrete actions"),
        "{stdout}"
    );
    assert!(stdout.contains("learner finished"), "{stdout}");
    let run_dir = dir.path().join("runs/e2e-minatar");
    let metrics = read(&run_dir.join("metrics.jsonl"));
    assert!(max_of(&metrics, "learner_updates") >= 4.0, "{metrics}");
    let eval = read(&run_dir.join("eval.jsonl"));
    assert!(eval.contains("\"evaluator\":\"greedy\""), "{eval}");
    // The checkpoint holds the CNN under SB3's names (safetensors' header is JSON).
    let model = std::fs::read(run_dir.join("checkpoints/last/model.safetensors")).unwrap();
    let header = String::from_utf8_lossy(&model[..model.len().min(8192)]);
    assert!(
        header.contains("features_extractor.cnn.0.weight")
            && header.contains("features_extractor.linear.0.weight"),
        "{header}"
    );
}

#[test]
fn a_users_own_env_module_trains_and_a_crashed_worker_is_restarted() {
    let dir = relay_testkit::TempDir::new("gym-user-env");
    std::fs::write(
        dir.path().join("my_envs.py"),
        r#"
import os
import numpy as np
import gymnasium as gym
from gymnasium import spaces

class Corridor(gym.Env):
    """Walk right to the end of a corridor of 8 cells (+1), truncated at 30
    steps. The first env to reach 100 steps in all (only the env-runner's
    live that long: an evaluation's envs play one episode each) kills its
    worker, once."""
    def __init__(self, marker):
        self.observation_space = spaces.Discrete(8)
        self.action_space = spaces.Discrete(2)
        self.marker, self.steps = marker, 0
    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.pos, self.t = 0, 0
        return self.pos, {}
    def step(self, action):
        self.steps += 1
        self.t += 1
        if self.steps == 100 and not os.path.exists(self.marker):
            open(self.marker, "w").close()
            os._exit(9)
        self.pos = max(0, min(7, self.pos + (1 if action == 1 else -1)))
        return self.pos, float(self.pos == 7), self.pos == 7, self.t >= 30, {}
"#,
    )
    .unwrap();
    let config = dir.path().join("corridor.yaml");
    std::fs::write(
        &config,
        format!(
            r#"
run:
  env_id: Corridor-v0
  algo: ppo
env:
  python_path: ["{dir}"]
  entry_point: "my_envs:Corridor"
  kwargs: {{marker: "{dir}/crashed"}}
"#,
            dir = dir.path().display()
        ),
    )
    .unwrap();
    let mut sets = tiny_ppo();
    sets.push("eval.threshold=1000".into());
    let output = up(dir.path(), config.to_str().unwrap(), "e2e-corridor", &sets);
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        stdout.contains("8 observations, 2 discrete actions"),
        "{stdout}"
    );
    assert!(stdout.contains("learner finished"), "{stdout}");
    assert!(
        dir.path().join("crashed").exists(),
        "the worker never crashed"
    );
    let run_dir = dir.path().join("runs/e2e-corridor");
    let log = read(&run_dir.join("logs/env-runner.log"));
    assert!(log.contains("restarting a Python env worker"), "{log}");
    assert!(log.contains("env fault, episode dropped"), "{log}");
    let metrics = read(&run_dir.join("metrics.jsonl"));
    assert!(max_of(&metrics, "learner_updates") >= 4.0, "{metrics}");
}

#[test]
fn a_textarena_game_trains_the_adapter_through_the_bridge() {
    let dir = relay_testkit::TempDir::new("textarena-e2e");
    let config = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../configs/simpletak-grpo.yaml"
    );
    let sets: Vec<String> = vec![
        format!("llm.model={}", dir.path().join("models/tiny").display()),
        "run.total_env_steps=16".into(),
        "rl.batch_size=8".into(),
        "rl.minibatch_size=4".into(),
        "rl.checkpoint_every=1".into(),
        "text.games_in_flight=4".into(),
        "eval.every_versions=1".into(),
        "eval.options={games: 2, opponents: random, temperature: 0}".into(),
        // No baseline: every decided game moves the adapter.
        "rl.objective={advantage: {kind: reinforce, baseline: {kind: none}}, policy_loss: {kind: policy_gradient}, aggregation: {kind: token_mean}}".into(),
    ];
    let output = up(dir.path(), config, "e2e-simpletak", &sets);
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        stdout.contains("SimpleTak-v0 from TextArena")
            && stdout.contains("2 player(s), 16 legal moves listed"),
        "{stdout}"
    );
    assert!(stdout.contains("learner finished"), "{stdout}");
    let run_dir = dir.path().join("runs/e2e-simpletak");
    let metrics = read(&run_dir.join("metrics.jsonl"));
    assert!(max_of(&metrics, "learner_updates") >= 2.0, "{metrics}");
    // The evaluator played the adapter against the random bot through
    // its own TextArena worker.
    let eval = read(&run_dir.join("eval.jsonl"));
    assert!(
        eval.contains("\"evaluator\":\"vs-opponent\"") && eval.contains("random"),
        "{eval}"
    );
    assert!(run_dir
        .join("checkpoints/last/adapter/adapter_model.safetensors")
        .is_file());
}
