//! `relay runs ls`, `relay runs repair`, `relay plot @last` and `relay
//! games @last`, run as the real binary against a temporary runs folder,
//! and the `@last` resolver.

use std::io::Write;
use std::path::Path;
use std::process::{Command, Output};

use relay::runs::{resolve_run_dir, resolve_run_id};
use relay_proto::RunStatus;
use relay_runs::registry::{RunRecord, RunRegistry};
use relay_testkit::TempDir;
use serde_json::json;

fn relay(args: &[&str], runs: &Path) -> Output {
    Command::new(env!("CARGO_BIN_EXE_relay"))
        .args(args)
        .arg("--runs-dir")
        .arg(runs)
        .env_remove("RELAY_RUNS_DIR")
        .output()
        .expect("run relay")
}

fn text(output: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

/// A finished run: registry record, config.yaml, status.json and a few
/// metrics/eval lines.
fn add_run(runs: &Path, id: &str, time: &str, status: RunStatus) {
    let dir = runs.join(id);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(
        dir.join("config.yaml"),
        format!("run:\n  id: {id}\n  env_id: CartPole-v1\n  algo: ppo\n  seed: 1\n"),
    )
    .unwrap();
    std::fs::write(
        dir.join("status.json"),
        json!({"status": status, "detail": "test"}).to_string(),
    )
    .unwrap();
    let mut metrics = std::fs::File::create(dir.join("metrics.jsonl")).unwrap();
    let mut evals = std::fs::File::create(dir.join("eval.jsonl")).unwrap();
    for v in 1..=20u64 {
        let p = v as f64 / 20.0;
        writeln!(metrics, "{}", json!({"time": time, "service": "env-runner", "instance": "r1", "vec_steps": v * 32,
            "values": {"vec_steps_total": 32.0, "env_runner_sps": 3000.0, "env_runner_episode_return_mean": 20.0 + 300.0 * p}})).unwrap();
        writeln!(metrics, "{}", json!({"time": time, "service": "learner", "instance": "l1", "vec_steps": v * 32,
            "values": {"learner_policy_version": v as f64, "learner_sps": 4000.0 + 10.0 * v as f64,
                       "learner_policy_loss": -0.01 * (1.0 - p), "learner_value_loss": 20.0 * (1.0 - p), "learner_entropy": 0.69 - 0.3 * p}})).unwrap();
        if v % 5 == 0 {
            writeln!(evals, "{}", json!({"time": time, "evaluator": "greedy", "policy_version": v, "learner_env_steps": v * 256,
                "mean_return": 500.0 * p, "std_return": 10.0, "threshold": 475.0, "solved": p >= 0.95})).unwrap();
        }
    }
    let updated = time.to_string();
    RunRegistry::new(runs)
        .upsert(RunRecord {
            id: id.into(),
            time: time.into(),
            config_id: "cartpole-ppo".into(),
            env_id: "CartPole-v1".into(),
            algo: "ppo".into(),
            seed: Some(1),
            status,
            detail: "test".into(),
            updated,
        })
        .unwrap();
}

fn assert_png(path: &Path) {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n", "{}", path.display());
    assert!(
        bytes.len() > 8_000,
        "{} is {} bytes",
        path.display(),
        bytes.len()
    );
}

#[test]
fn at_last_resolves_to_the_newest_run() {
    let tmp = TempDir::new("runs-last");
    let runs = tmp.path().join("runs");
    let e = resolve_run_id(&runs, "@last").unwrap_err().to_string();
    assert!(e.contains("no run recorded"), "{e}");
    add_run(
        &runs,
        "older",
        "2025-03-01T10:00:00.000Z",
        RunStatus::Solved,
    );
    add_run(
        &runs,
        "newer",
        "2025-03-02T09:00:00.000Z",
        RunStatus::Running,
    );
    // Registered out of order: the start time decides.
    add_run(
        &runs,
        "oldest",
        "2025-02-01T10:00:00.000Z",
        RunStatus::Stopped,
    );
    assert_eq!(resolve_run_id(&runs, "@last").unwrap(), "newer");
    assert_eq!(resolve_run_id(&runs, "older").unwrap(), "older");
    assert!(resolve_run_id(&runs, "../etc").is_err());
    let (id, dir) = resolve_run_dir(&runs, "@last").unwrap();
    assert_eq!((id.as_str(), dir), ("newer", runs.join("newer")));
    let e = resolve_run_dir(&runs, "not-there").unwrap_err().to_string();
    assert!(e.contains("no directory"), "{e}");
}

#[test]
fn runs_ls_lists_the_registry_newest_first() {
    let tmp = TempDir::new("runs-ls");
    let runs = tmp.path().join("runs");

    let out = relay(&["runs", "ls"], &runs);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stdout}{stderr}");
    assert!(stdout.contains("no runs recorded"), "{stdout}");

    add_run(
        &runs,
        "cartpole-a",
        "2025-03-01T10:00:00.000Z",
        RunStatus::Solved,
    );
    add_run(
        &runs,
        "cartpole-b",
        "2025-03-02T10:00:00.000Z",
        RunStatus::Stopped,
    );
    let out = relay(&["runs", "ls"], &runs);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stdout}{stderr}");
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(lines.len(), 3, "{stdout}");
    for column in ["ID", "STARTED", "ENV", "ALGO", "STATUS"] {
        assert!(lines[0].contains(column), "{stdout}");
    }
    assert!(
        lines[1].starts_with("cartpole-b") && lines[1].ends_with("stopped"),
        "{stdout}"
    );
    assert!(
        lines[2].starts_with("cartpole-a") && lines[2].ends_with("solved"),
        "{stdout}"
    );
    assert!(
        lines[1].contains("CartPole-v1") && lines[1].contains("ppo"),
        "{stdout}"
    );
    assert!(lines[1].contains("2025-03-0"), "{stdout}");
}

#[test]
fn plot_at_last_draws_the_newest_run() {
    let tmp = TempDir::new("runs-plot");
    let runs = tmp.path().join("runs");

    let out = relay(&["plot", "@last"], &runs);
    let (stdout, stderr) = text(&out);
    assert!(!out.status.success(), "{stdout}");
    assert!(stderr.contains("no run recorded"), "{stderr}");

    add_run(
        &runs,
        "first",
        "2025-03-01T10:00:00.000Z",
        RunStatus::Solved,
    );
    add_run(
        &runs,
        "second",
        "2025-03-01T11:00:00.000Z",
        RunStatus::Solved,
    );
    let out = relay(&["plot", "@last"], &runs);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stdout}{stderr}");
    assert!(stdout.contains("run second"), "{stdout}");
    for name in ["return", "losses", "sps"] {
        let path = runs.join("second/plots").join(format!("{name}.png"));
        assert!(stdout.contains(&path.display().to_string()), "{stdout}");
        assert_png(&path);
    }
    assert!(!runs.join("first/plots").exists());

    // An explicit id works too.
    let out = relay(&["plot", "first"], &runs);
    assert!(out.status.success(), "{:?}", text(&out));
    assert_png(&runs.join("first/plots/return.png"));
}

#[test]
fn a_corrupt_registry_is_reported_and_repaired() {
    let tmp = TempDir::new("runs-corrupt");
    let runs = tmp.path().join("runs");
    add_run(
        &runs,
        "kept-a",
        "2025-03-01T10:00:00.000Z",
        RunStatus::Solved,
    );
    add_run(
        &runs,
        "kept-b",
        "2025-03-01T11:00:00.000Z",
        RunStatus::Stopped,
    );
    std::fs::write(runs.join("runs.json"), "[{\"id\": ").unwrap();

    let out = relay(&["runs", "ls"], &runs);
    let (stdout, stderr) = text(&out);
    assert!(!out.status.success(), "{stdout}");
    assert!(
        stderr.contains("not a valid run registry") && stderr.contains("relay runs repair"),
        "{stderr}"
    );
    let out = relay(&["plot", "@last"], &runs);
    assert!(!out.status.success());
    assert_eq!(
        std::fs::read_to_string(runs.join("runs.json")).unwrap(),
        "[{\"id\": "
    );

    let out = relay(&["runs", "repair"], &runs);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stdout}{stderr}");
    assert!(
        stdout.contains("runs.json.bak") && stdout.contains("2 runs"),
        "{stdout}"
    );
    assert_eq!(
        std::fs::read_to_string(runs.join("runs.json.bak")).unwrap(),
        "[{\"id\": "
    );
    let out = relay(&["runs", "ls"], &runs);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stdout}{stderr}");
    assert!(
        stdout.contains("kept-a") && stdout.contains("kept-b"),
        "{stdout}"
    );
    assert!(
        stdout.contains("solved") && stdout.contains("stopped"),
        "{stdout}"
    );
}

/// A `games.jsonl` line as the tracker writes it: the learning adapter
/// (seat 0, its moves at `version`) against `opponent`.
fn game_line(kind: &str, version: u64, opponent: &str, seed: u64) -> serde_json::Value {
    let observation = |free: &str| format!("Tic Tac Toe: cells 0-8.\nFree: {free}\n");
    json!({
        "time": "2026-12-01T10:41:07.512Z", "kind": kind, "opponent": opponent,
        "env_id": "TicTacToe-v0", "seed": seed, "runner": "env-runner-1", "version": version,
        "seats": [{"model": {"name": "policy", "version": null}}, {"bot": opponent}],
        "learner_seat": 0, "rewards": [1.0, -1.0], "reasons": ["Player 0 won.", "Player 0 won."],
        "duration_ms": 900, "finished_unix_ms": 0,
        "turns": [
            {"player": 0, "adapter": {"name": "policy", "version": version},
             "observation": observation("0 1 2 3 4 5 6 7 8"), "completion": format!("Centre first (game {seed}). [4]"),
             "action": "[4]", "invalid": false, "no_answer": false, "truncated": false,
             "prompt_tokens": 40, "completion_tokens": 9},
            {"player": 1, "observation": observation("0 1 2 3 5 6 7 8"), "completion": "", "action": "[0]",
             "invalid": false, "no_answer": false, "truncated": false, "prompt_tokens": 0, "completion_tokens": 0}
        ]
    })
}

#[test]
fn games_prints_the_newest_matching_games_of_a_run() {
    let tmp = TempDir::new("runs-games");
    let runs = tmp.path().join("runs");
    add_run(
        &runs,
        "text-run",
        "2026-12-01T10:00:00.000Z",
        RunStatus::Running,
    );
    let output = relay(&["games", "@last"], &runs);
    assert!(output.status.success(), "{:?}", text(&output));
    assert!(
        text(&output).0.contains("no games.jsonl yet"),
        "{:?}",
        text(&output)
    );

    let mut file = std::fs::File::create(runs.join("text-run/games.jsonl")).unwrap();
    for (kind, version, opponent, seed) in [
        ("train", 1, "random", 11),
        ("eval", 1, "minimax", 12),
        ("train", 2, "random", 13),
        ("train", 2, "random", 14),
        ("eval", 2, "minimax", 15),
    ] {
        writeln!(file, "{}", game_line(kind, version, opponent, seed)).unwrap();
    }
    drop(file);

    let output = relay(
        &["games", "@last", "--opponent", "random", "--last", "1"],
        &runs,
    );
    let (stdout, stderr) = text(&output);
    assert!(output.status.success(), "{stderr}");
    assert!(
        stdout.starts_with(
            "run text-run: 1 of 3 matching games [vs random] (5 in the file; oldest first)"
        ),
        "{stdout}"
    );
    assert!(
        stdout.contains("=== train · TicTacToe-v0 · seed 14 · v2 vs random · win · "),
        "{stdout}"
    );
    assert!(
        stdout.contains("  reply │ Centre first (game 14). [4]"),
        "{stdout}"
    );
    assert!(
        stdout.contains("--- move 2 · player 1 · bot random\n   move │ [0]"),
        "{stdout}"
    );
    assert!(
        !stdout.contains("\x1b["),
        "no colours off a terminal: {stdout}"
    );

    let output = relay(&["games", "text-run", "--eval", "--version", "1"], &runs);
    let stdout = text(&output).0;
    assert!(
        stdout.contains("1 of 1 matching game [eval, v1]"),
        "{stdout}"
    );
    assert!(stdout.contains("seed 12 · v1 vs minimax"), "{stdout}");
    assert!(!stdout.contains("seed 15"), "{stdout}");

    let output = relay(&["games", "text-run", "--eval", "--train"], &runs);
    assert!(!output.status.success(), "--eval and --train together");
}
