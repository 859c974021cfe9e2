//! `relay play` on text games: the tiny Qwen2 fixture model plays
//! TicTacToe against a bot and against moves typed on standard input.

use std::io::Write;
use std::process::{Command, Stdio};

fn tiny_qwen2() -> String {
    relay_testkit::llm_fixture("tiny-qwen2")
        .to_string_lossy()
        .into_owned()
}

#[test]
fn the_model_plays_a_bot_to_the_end() {
    let mut player = relay::play_text::Player::new(&tiny_qwen2(), None, 0.0, 8, 1).unwrap();
    let mut out = Vec::new();
    let game = relay::play_text::play_game(
        relay_envs::make_text_game("TicTacToe-v0").unwrap(),
        &mut player,
        0,
        "minimax",
        3,
        &mut std::io::empty(),
        &mut out,
    )
    .unwrap();
    let text = String::from_utf8(out).unwrap();
    assert_eq!(game.rewards.len(), 2, "{text}");
    assert!(game.model_moves >= 1, "{text}");
    assert!(game.model_invalid_moves <= game.model_moves);
    assert!(text.contains("player 0 (model):"), "{text}");
    assert!(text.contains("(minimax)"), "{text}");
    assert!(text.contains("reward"), "{text}");
}

#[test]
fn a_human_plays_the_model_from_standard_input() {
    let mut child = Command::new(env!("CARGO_BIN_EXE_relay"))
        .args(["play", "--env", "TicTacToe-v0", "--model", &tiny_qwen2()])
        .args(["--model-seat", "1", "--max-tokens", "6"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // More moves than a game can take: the game ends (the untrained model
    // forfeits by invalid moves, or someone wins) before they run out.
    child
        .stdin
        .take()
        .unwrap()
        .write_all(b"[4]\n[0]\n[8]\n[2]\n[6]\n[1]\n[3]\n[5]\n[7]\n")
        .unwrap();
    let output = child.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "stdout:\n{stdout}\nstderr:\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(stdout.contains("your move ("), "{stdout}");
    assert!(stdout.contains("player 1 (model):"), "{stdout}");
    assert!(stdout.contains("player 0 (you): reward"), "{stdout}");
    assert!(stdout.contains("model rewards:"), "{stdout}");

    // A run id that does not exist and no --env is an error naming what to give.
    let output = Command::new(env!("CARGO_BIN_EXE_relay"))
        .args(["play"])
        .output()
        .unwrap();
    assert!(!output.status.success());
    assert!(String::from_utf8_lossy(&output.stderr).contains("--env and --model"));
}
