//! PettingZoo end to end (`relay up`, every service a process, real
//! nats-server and redis-server), as a user names the games, with no
//! `env.backend`:
//! - `chess_v6` at the default preset's settings, through a nats-server
//!   that carries messages of 128 KiB: its fragments (4,672-action masks
//!   beside every board) and act requests are divided to fit, and the run
//!   trains several versions;
//! - `pistonball_v6` (discrete, images) with one PPO policy shared by its
//!   pistons: each game is one episode with the team's return and each
//!   piston's, and the evaluator scores whole games;
//! - MPE's `simple_spread_v3` with continuous actions under SAC and PPO.

use std::path::Path;
use std::process::{Command, Output};

use relay_testkit::{NatsServer, TempDir};

fn config(name: &str) -> String {
    format!("{}/../../configs/{name}", env!("CARGO_MANIFEST_DIR"))
}

/// `relay up --config <preset>` with `args`, its state and runs under `dir`.
fn relay_up(dir: &Path, preset: &str, run_id: &str, args: &[&str]) -> Output {
    let output = Command::new(env!("CARGO_BIN_EXE_relay"))
        .args([
            "up",
            "--until-solved",
            "--quiet",
            "--config",
            &config(preset),
        ])
        .args(["--run-id", run_id])
        .arg("--state-dir")
        .arg(dir.join(format!("state-{run_id}")))
        .args([
            "--set",
            &format!("run.runs_dir={}", dir.join("runs").display()),
            // Trained to the budget: never solved.
            "--set",
            "run.stop_when_solved=false",
            "--set",
            "eval.threshold=1000000",
        ])
        .args(args)
        .output()
        .expect("run relay up");
    assert!(
        output.status.success(),
        "relay up failed\nstdout:\n{}\nstderr:\n{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    output
}

/// Every episode of a run's `episodes.jsonl` (a line per report).
fn episodes(run: &Path) -> Vec<serde_json::Value> {
    lines(&run.join("episodes.jsonl"))
        .iter()
        .flat_map(|report| report["episodes"].as_array().cloned().unwrap_or_default())
        .collect()
}

fn lines(path: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

/// The largest value of `name` a service reported in the run's metrics.
fn last_seen(run: &Path, service: &str, name: &str) -> f64 {
    lines(&run.join("metrics.jsonl"))
        .iter()
        .filter(|v| v["service"] == service)
        .filter_map(|v| v["values"][name].as_f64())
        .fold(0.0, f64::max)
}

#[test]
fn chess_trains_through_a_server_that_carries_a_tenth_of_its_fragments() {
    let nats = NatsServer::start_with_config("max_payload: 131072\n").unwrap();
    let dir = TempDir::new("chess");
    let output = relay_up(
        dir.path(),
        "cartpole-ppo.yaml",
        "chess",
        &[
            "--nats-url",
            &nats.url(),
            "--set",
            "run.env_id=chess_v6",
            // 16 boards: an act request of about 190 KB, a fragment of 6 MB.
            "--set",
            "env_runner.num_envs=16",
            "--set",
            "run.total_env_steps=1536",
            "--set",
            "weights.inline_max_bytes=32768",
            "--set",
            "eval.every_versions=1000",
        ],
    );
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        stdout.contains("chess_v6 from PettingZoo, a game of 2 agents taking turns"),
        "what auto picked is printed:\n{stdout}"
    );
    assert!(
        stdout.contains("so fragments, act requests and batches are divided to fit"),
        "{stdout}"
    );
    let run = dir.path().join("runs/chess");
    let versions = last_seen(&run, "learner", "learner_policy_version");
    assert!(versions >= 5.0, "versions trained: {versions}");
    let logs = dir.path().join("state-chess/logs");
    for entry in std::fs::read_dir(&logs).unwrap() {
        let path = entry.unwrap().path();
        let log = std::fs::read_to_string(&path).unwrap();
        assert!(
            !log.contains("larger than") && !log.contains("cannot be sent"),
            "{}:\n{log}",
            path.display()
        );
    }
}

#[test]
fn pistons_share_one_policy_and_a_game_is_one_episode_of_the_team() {
    let dir = TempDir::new("pistonball");
    let output = relay_up(
        dir.path(),
        "pistonball-ppo.yaml",
        "pistons",
        &[
            // 4 pistons; 6 rows are rounded up to 2 whole games.
            "--set",
            "env.kwargs.n_pistons=4",
            "--set",
            "env_runner.num_envs=6",
            "--set",
            "ppo.rollout_steps=400",
            "--set",
            "replay.capacity_steps=400",
            "--set",
            "run.total_env_steps=1200",
            "--set",
            "eval.episodes=2",
        ],
    );
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        stdout.contains("pistonball_v6 from PettingZoo, a parallel game of 4 agents (piston_0, piston_1, piston_2, ...) sharing one policy"),
        "{stdout}"
    );
    assert!(
        stdout.contains("env_runner.num_envs 6 -> 8 (2 game(s) a runner)"),
        "{stdout}"
    );
    let run = dir.path().join("runs/pistons");
    assert!(last_seen(&run, "learner", "learner_policy_version") >= 3.0);
    // Each game (of at most 25 cycles) is one episode: the team's return,
    // the sum of its pistons'.
    let games = episodes(&run);
    assert!(!games.is_empty());
    for e in &games {
        let agents = e["agent_returns"]
            .as_object()
            .expect("each piston's return");
        assert_eq!(agents.len(), 4, "{e}");
        let sum: f64 = agents.values().map(|r| r.as_f64().unwrap()).sum();
        assert!((sum - e["return"].as_f64().unwrap()).abs() < 1e-6, "{e}");
        assert!(
            e["length"].as_u64().is_some_and(|l| (1..=25).contains(&l)),
            "{e}"
        );
    }
    let evals = lines(&run.join("eval.jsonl"));
    assert!(!evals.is_empty(), "the evaluator scored games");
}

#[test]
fn mpe_spreads_with_continuous_actions_under_sac_and_ppo() {
    let dir = TempDir::new("mpe");
    for (preset, run_id, steps) in [
        ("pendulum-sac.yaml", "spread-sac", "600"),
        ("cartpole-ppo.yaml", "spread-ppo", "1536"),
    ] {
        relay_up(
            dir.path(),
            preset,
            run_id,
            &[
                "--set",
                "run.env_id=simple_spread_v3",
                "--set",
                "env.kwargs.continuous_actions=true",
                "--set",
                "env_runner.num_envs=3",
                // 24 env steps a fragment: within the SAC preset's rate
                // limiter slack of 32.
                "--set",
                "env_runner.fragment_steps=8",
                "--set",
                &format!("run.total_env_steps={steps}"),
                "--set",
                "eval.episodes=2",
            ],
        );
        let run = dir.path().join("runs").join(run_id);
        assert!(
            last_seen(&run, "learner", "learner_policy_version") >= 2.0,
            "{run_id} trained"
        );
        let games = episodes(&run);
        assert!(
            !games.is_empty()
                && games
                    .iter()
                    .all(|e| e["agent_returns"].as_object().is_some_and(|a| a.len() == 3)),
            "{run_id}: {games:?}"
        );
    }
}
