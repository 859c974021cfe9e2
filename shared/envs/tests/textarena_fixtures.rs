//! Replays every game recorded from TextArena 0.7.4 (default, LLM-wrapped
//! ids) and checks that the port reproduces it: whose turn it is, every
//! observation string exactly, `done` after every action, the final
//! rewards and game_info.
//!
//! Fixture folder: `$RELAY_TEXTARENA_FIXTURES`, default
//! `shared/fixtures/textarena` next to the repository (see
//! `shared/fixtures/README.md`).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use relay_envs::{make_text_game, PlayerInfo, TextGame};
use serde::Deserialize;

#[derive(Deserialize)]
struct Fixture {
    env_id: String,
    textarena_version: String,
    games: Vec<Game>,
}

#[derive(Deserialize)]
struct Game {
    seed: u64,
    steps: Vec<Step>,
    /// Player id (as a string) → reward.
    rewards: BTreeMap<String, f64>,
    /// Player id (as a string) → TextArena's game_info entry.
    game_info: BTreeMap<String, PlayerInfo>,
}

#[derive(Deserialize)]
struct Step {
    player: usize,
    observation: String,
    action: String,
    done: bool,
}

fn fixture_dir() -> PathBuf {
    match std::env::var_os("RELAY_TEXTARENA_FIXTURES") {
        Some(dir) => PathBuf::from(dir),
        None => PathBuf::from(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../../shared/fixtures/textarena"
        )),
    }
}

/// Where two strings first differ, with some context.
fn first_difference(got: &str, want: &str) -> String {
    let (got, want): (Vec<char>, Vec<char>) = (got.chars().collect(), want.chars().collect());
    let at = got
        .iter()
        .zip(&want)
        .position(|(g, w)| g != w)
        .unwrap_or(got.len().min(want.len()));
    let context = |s: &[char]| -> String {
        s[at.saturating_sub(80).min(s.len())..(at + 80).min(s.len())]
            .iter()
            .collect()
    };
    format!(
        "first difference at char {at} (lengths {} vs expected {}):\n  got:      {:?}\n  expected: {:?}",
        got.len(),
        want.len(),
        context(&got),
        context(&want)
    )
}

/// Per-player values of a fixture map keyed by player id strings.
fn by_player<T: Clone>(map: &BTreeMap<String, T>, num_players: usize) -> Result<Vec<T>, String> {
    (0..num_players)
        .map(|p| {
            map.get(&p.to_string())
                .cloned()
                .ok_or_else(|| format!("fixture has no entry for player {p}"))
        })
        .collect::<Result<_, _>>()
        .and_then(|values: Vec<T>| {
            if map.len() == num_players {
                Ok(values)
            } else {
                Err(format!(
                    "fixture has {} players, game has {num_players}",
                    map.len()
                ))
            }
        })
}

/// Replays one game; returns a description of the first divergence.
fn replay(game: &mut dyn TextGame, recorded: &Game) -> Result<usize, String> {
    game.reset(recorded.seed);
    for (t, step) in recorded.steps.iter().enumerate() {
        if game.is_done() {
            return Err(format!("step {t}: the game already ended"));
        }
        if game.current_player() != step.player {
            return Err(format!(
                "step {t}: current player {} != recorded {}",
                game.current_player(),
                step.player
            ));
        }
        let observation = game.observation(step.player);
        if observation != step.observation {
            return Err(format!(
                "step {t}: observation of player {}: {}",
                step.player,
                first_difference(&observation, &step.observation)
            ));
        }
        let outcome = game
            .step(&step.action)
            .map_err(|e| format!("step {t}: step failed: {e}"))?;
        if outcome.player != step.player || outcome.done != step.done {
            return Err(format!(
                "step {t}: action {:?}: (player, done) = ({}, {}), recorded ({}, {})",
                step.action, outcome.player, outcome.done, step.player, step.done
            ));
        }
    }
    if !game.is_done() {
        return Err("the recorded game ended but the port's did not".into());
    }
    let rewards = by_player(&recorded.rewards, game.num_players())?;
    if game.rewards().as_ref() != Some(&rewards) {
        return Err(format!(
            "rewards {:?} != recorded {rewards:?}",
            game.rewards()
        ));
    }
    let info = by_player(&recorded.game_info, game.num_players())?;
    if game.game_info() != info {
        return Err(format!(
            "game_info {:?} != recorded {info:?}",
            game.game_info()
        ));
    }
    Ok(recorded.steps.len())
}

#[test]
fn textarena_fixtures_replay_every_game() {
    let dir = fixture_dir();
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("cannot read fixture folder {}: {e}", dir.display()))
        .filter_map(|entry| entry.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|ext| ext == "json"))
        .collect();
    files.sort();
    assert!(
        !files.is_empty(),
        "no *.json fixtures in {} (set RELAY_TEXTARENA_FIXTURES)",
        dir.display()
    );

    let mut failures = String::new();
    let mut replayed_games = 0usize;
    let mut replayed_steps = 0usize;
    for path in &files {
        let name = path.file_name().map_or_else(
            || path.display().to_string(),
            |n| n.to_string_lossy().into_owned(),
        );
        let fixture = load(path);
        let mut game = match make_text_game(&fixture.env_id) {
            Ok(g) => g,
            Err(e) => {
                let _ = writeln!(failures, "{name}: {e}");
                continue;
            }
        };
        if fixture.games.is_empty() {
            let _ = writeln!(failures, "{name}: no games");
        }
        for (k, recorded) in fixture.games.iter().enumerate() {
            match replay(game.as_mut(), recorded) {
                Ok(n) => {
                    replayed_games += 1;
                    replayed_steps += n;
                }
                Err(msg) => {
                    let _ = writeln!(
                        failures,
                        "{name} ({} textarena {}): game {k} (seed {}): {msg}",
                        fixture.env_id, fixture.textarena_version, recorded.seed
                    );
                }
            }
        }
    }
    assert!(failures.is_empty(), "fixture replay diverged:\n{failures}");
    assert!(replayed_games > 0, "fixtures contain no games");
    assert!(replayed_steps > 0, "fixtures contain no steps");
    eprintln!(
        "replayed {replayed_games} games / {replayed_steps} steps from {} files",
        files.len()
    );
}

fn load(path: &Path) -> Fixture {
    let text = std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("cannot parse {}: {e}", path.display()))
}
