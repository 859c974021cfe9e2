//! Self-play on a PettingZoo game end to end: `relay up` with every service
//! a process over real NATS and Redis trains `tictactoe_v3` with its action
//! masks and the league (the shipped preset, tiny budget): the learner
//! stores and admits versions, the inference servers serve past versions,
//! the env-runner plays them, the bots and the policy itself, and the
//! `vs-opponent` evaluator plays the random bot from both seats. Then the
//! saved checkpoint is played by `relay eval checkpoint`, against a bot and
//! a human at the terminal by `relay play`, and becomes a fixed opponent
//! (`checkpoint:<folder>`) of a second run, in training and evaluation.

use std::collections::BTreeSet;
use std::io::Write;
use std::path::Path;
use std::process::{Command, Stdio};

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn config() -> String {
    concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../configs/tictactoe-ppo-league.yaml"
    )
    .to_string()
}

/// `relay up --until-solved` of the TicTacToe league preset, tiny budget,
/// with `sets` on top; returns the run's folder.
fn up(dir: &Path, run_id: &str, sets: &[String]) -> std::path::PathBuf {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_relay"));
    cmd.args(["up", "--until-solved", "--quiet", "--config", &config()])
        .args(["--run-id", run_id])
        .arg("--state-dir")
        .arg(dir.join(format!("state-{run_id}")));
    for set in [
        format!("run.runs_dir={}", dir.join("runs").display()),
        "run.total_env_steps=4096".into(),
        "ppo.rollout_steps=512".into(),
        "ppo.minibatch_size=128".into(),
        "policy.hidden=[32, 32]".into(),
        "env_runner.num_envs=8".into(),
        "league.pool.admit_every=1".into(),
        "eval.every_versions=3".into(),
        "eval.episodes=20".into(),
    ]
    .iter()
    .chain(sets)
    {
        cmd.args(["--set", set]);
    }
    let output = cmd.output().expect("run relay up");
    let stdout = String::from_utf8_lossy(&output.stdout).to_string();
    assert!(
        output.status.success() && stdout.contains("learner finished"),
        "relay up failed\nstdout:\n{stdout}\nstderr:\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let logs = dir.join(format!("state-{run_id}/logs"));
    for entry in std::fs::read_dir(&logs).unwrap() {
        let path = entry.unwrap().path();
        let log = read(&path);
        assert!(
            !log.contains("Traceback") && !log.contains("env fault"),
            "{}: the game faulted:\n{log}",
            path.display()
        );
    }
    dir.join("runs").join(run_id)
}

/// The opponents of the run's training episodes (past versions as
/// `league:past`) and the seats the learning policy played.
fn episodes(run_dir: &Path) -> (BTreeSet<String>, BTreeSet<u64>) {
    let mut opponents = BTreeSet::new();
    let mut seats = BTreeSet::new();
    for line in read(&run_dir.join("episodes.jsonl")).lines() {
        let report: serde_json::Value = serde_json::from_str(line).unwrap();
        for episode in report["episodes"].as_array().unwrap() {
            seats.insert(episode["seat"].as_u64().expect("a seat"));
            let opponent = episode["opponent"].as_str().expect("an opponent");
            opponents.insert(if opponent.starts_with("league:v") {
                "league:past".to_string()
            } else {
                opponent.to_string()
            });
        }
    }
    (opponents, seats)
}

/// The `(opponent, seat, games)` of the run's last evaluation.
fn last_matchups(run_dir: &Path) -> Vec<(String, u64, u64)> {
    let eval = read(&run_dir.join("eval.jsonl"));
    let last: serde_json::Value =
        serde_json::from_str(eval.lines().last().expect("an evaluation")).unwrap();
    last["matchups"]
        .as_array()
        .unwrap_or_else(|| panic!("no matchups: {last}"))
        .iter()
        .map(|m| {
            (
                m["opponent"].as_str().unwrap().to_string(),
                m["seat"].as_u64().unwrap(),
                m["games"].as_u64().unwrap(),
            )
        })
        .collect()
}

fn relay(args: &[&str], stdin: &[u8]) -> String {
    let mut child = Command::new(env!("CARGO_BIN_EXE_relay"))
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(stdin).unwrap();
    let output = child.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout).to_string();
    assert!(
        output.status.success(),
        "relay {args:?} failed\nstdout:\n{stdout}\nstderr:\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    stdout
}

#[test]
fn a_pettingzoo_game_trains_with_the_league_and_its_checkpoint_plays_on() {
    let dir = relay_testkit::TempDir::new("selfplay-e2e");
    let runs = dir.path().join("runs");
    let runs_dir = runs.to_str().unwrap();
    let first = up(dir.path(), "ttt-league", &[]);

    let (opponents, seats) = episodes(&first);
    assert_eq!(seats, BTreeSet::from([0, 1]));
    for kind in ["random", "league:mirror", "league:past"] {
        assert!(opponents.contains(kind), "no {kind} game: {opponents:?}");
    }
    let inference = read(
        &dir.path()
            .join("state-ttt-league/logs/inference-server-0.log"),
    );
    assert!(
        inference.contains("past version built for league games"),
        "{inference}"
    );
    assert_eq!(
        last_matchups(&first),
        [("random".to_string(), 0, 10), ("random".to_string(), 1, 10)]
    );

    // The saved checkpoint on fresh games, from both seats.
    let eval = relay(
        &[
            "eval",
            "checkpoint",
            "ttt-league:last",
            "--episodes",
            "8",
            "--runs-dir",
            runs_dir,
        ],
        b"",
    );
    for seat in [0, 1] {
        assert!(
            eval.contains(&format!("vs random from seat {seat}: W/D/L")),
            "{eval}"
        );
    }
    assert!(eval.contains("weakest matchup"), "{eval}");

    // Against a bot, and against moves typed at the terminal: the first
    // free cell each turn; an occupied one is refused and asked again.
    let play = relay(
        &[
            "play",
            "ttt-league",
            "--opponent",
            "minimax",
            "--episodes",
            "2",
            "--runs-dir",
            runs_dir,
        ],
        b"",
    );
    assert!(play.contains("(opponent): "), "{play}");
    assert_eq!(play.matches("(model): return").count(), 2, "{play}");
    let moves: String = (0..9)
        .map(|k| format!("{k}\n"))
        .collect::<String>()
        .repeat(2);
    let play = relay(
        &[
            "play",
            "ttt-league",
            "--model-seat",
            "1",
            "--runs-dir",
            runs_dir,
        ],
        format!("x\n{moves}").as_bytes(),
    );
    assert!(play.contains("your move (0 1 2 3 4 5 6 7 8): "), "{play}");
    assert!(play.contains("\"x\" is not a legal move"), "{play}");
    assert!(play.contains("(you): return"), "{play}");
    assert!(play.contains("model returns:"), "{play}");

    // The checkpoint as a fixed opponent of a second run: in its training
    // games, in the league's pool, and in its evaluations.
    let checkpoint = format!("checkpoint:{}/ttt-league/checkpoints/last", runs_dir);
    let second = up(
        dir.path(),
        "ttt-vs-checkpoint",
        &[
            format!("selfplay.opponents={{league: 1, '{checkpoint}': 1}}"),
            format!("league.fixed=[random, minimax, '{checkpoint}']"),
            format!("eval.options.opponents=random,{checkpoint}"),
        ],
    );
    let (opponents, _) = episodes(&second);
    assert!(opponents.contains(&checkpoint), "{opponents:?}");
    let matchups = last_matchups(&second);
    for seat in [0, 1] {
        assert!(
            matchups.contains(&(checkpoint.clone(), seat, 10)),
            "{matchups:?}"
        );
    }
}
