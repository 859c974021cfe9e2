//! TextArena's games through the env bridge, against the real `textarena`
//! 0.7.4 in the project's Python environment (`just install` makes it):
//! the recorded fixture games and relay's own games agree with it byte for
//! byte, a game with listed moves plays to its end with the random bot and
//! replays from its seed, and errors and faults are named.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use relay_bridge::{make_text_game, Backend, BridgeError, EnvSection};
use relay_envs::{Bot, EnvError, PlayerInfo, RandomBot, TextGame};
use serde::Deserialize;

fn textarena() -> EnvSection {
    EnvSection {
        backend: Backend::Textarena,
        ..EnvSection::default()
    }
}

#[derive(Deserialize)]
struct Fixture {
    env_id: String,
    games: Vec<FixtureGame>,
}

#[derive(Deserialize)]
struct FixtureGame {
    seed: u64,
    steps: Vec<FixtureStep>,
    rewards: BTreeMap<String, f64>,
    game_info: BTreeMap<String, PlayerInfo>,
}

#[derive(Deserialize)]
struct FixtureStep {
    player: usize,
    observation: String,
    action: String,
    done: bool,
}

fn fixtures() -> Vec<Fixture> {
    let dir = PathBuf::from(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../../shared/fixtures/textarena"
    ));
    let mut paths: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .collect();
    paths.sort();
    assert!(!paths.is_empty(), "no fixtures in {}", dir.display());
    paths
        .iter()
        .map(|p| serde_json::from_slice(&std::fs::read(p).unwrap()).unwrap())
        .collect()
}

#[test]
fn fixture_games_through_the_bridge_match_textarena_and_relays_games_byte_for_byte() {
    for fixture in fixtures() {
        let id = &fixture.env_id;
        let mut bridged = make_text_game(id, &textarena()).expect("TextArena makes the game");
        let mut builtin = relay_envs::make_text_game(id).expect("relay has the game");
        assert_eq!(bridged.num_players(), builtin.num_players(), "{id}");
        for (g, game) in fixture.games.iter().enumerate() {
            bridged.reset(game.seed);
            builtin.reset(game.seed);
            for (t, step) in game.steps.iter().enumerate() {
                let at = format!("{id} game {g} step {t}");
                assert_eq!(bridged.current_player(), step.player, "{at}");
                assert_eq!(builtin.current_player(), step.player, "{at}");
                let seen = bridged.observation(step.player);
                assert_eq!(
                    seen, step.observation,
                    "{at}: the bridge vs TextArena's record"
                );
                assert_eq!(
                    builtin.observation(step.player),
                    seen,
                    "{at}: relay vs the bridge"
                );
                let a = bridged.step(&step.action).unwrap();
                let b = builtin.step(&step.action).unwrap();
                assert_eq!(a, b, "{at}: step outcomes");
                assert_eq!(a.done, step.done, "{at}");
                assert_eq!(bridged.turn(), builtin.turn(), "{at}: turns");
            }
            let want: Vec<f64> = (0..bridged.num_players())
                .map(|p| game.rewards[&p.to_string()])
                .collect();
            assert_eq!(bridged.rewards(), Some(want.clone()), "{id} game {g}");
            assert_eq!(builtin.rewards(), Some(want), "{id} game {g}");
            let info: Vec<PlayerInfo> = (0..bridged.num_players())
                .map(|p| game.game_info[&p.to_string()].clone())
                .collect();
            assert_eq!(bridged.game_info(), info, "{id} game {g}");
            assert_eq!(builtin.game_info(), info, "{id} game {g}");
        }
    }
}

/// Plays `game` to its end with random bots, returning every observation
/// and action.
fn play_out(game: &mut dyn TextGame, bot_seed: u64) -> Vec<(String, String)> {
    let mut bots = [RandomBot::new(bot_seed), RandomBot::new(bot_seed + 1)];
    let mut record = Vec::new();
    while !game.is_done() {
        let player = game.current_player();
        let observation = game.observation(player);
        let action = bots[player].choose_move(game).expect("listed moves");
        let outcome = game.step(&action).unwrap();
        assert!(!outcome.invalid_move, "a listed move was refused: {action}");
        record.push((observation, action));
        assert!(record.len() < 100, "SimpleTak ends within its 16 cells");
    }
    record
}

#[test]
fn simpletak_plays_to_its_end_with_the_random_bot_and_replays_from_its_seed() {
    let mut game = make_text_game("SimpleTak-v0", &textarena()).unwrap();
    assert_eq!(game.id(), "SimpleTak-v0");
    assert_eq!(game.num_players(), 2);
    game.reset(11);
    let opening: Vec<String> = (0..16).map(|c| format!("[{c}]")).collect();
    assert_eq!(
        game.legal_moves(),
        opening,
        "SimpleTak lists its empty cells"
    );
    assert!(game
        .observation(0)
        .starts_with("\n[GAME] You are Player 0 in SimpleTak."));
    let record = play_out(game.as_mut(), 5);
    let rewards = game.rewards().expect("the game ended");
    assert_eq!(rewards.len(), 2);
    assert!(
        rewards.iter().all(|r| [-1.0, 0.0, 1.0].contains(r)),
        "{rewards:?}"
    );
    assert!(game.legal_moves().is_empty());

    // The same seed and moves give the same game, in a fresh game and in
    // one reset, and a clone taken midway goes on as the original did.
    let mut again = make_text_game("SimpleTak-v0", &textarena()).unwrap();
    for replay in [&mut again, &mut game] {
        replay.reset(11);
        let mut midway = None;
        for (i, (observation, action)) in record.iter().enumerate() {
            let player = replay.current_player();
            assert_eq!(&replay.observation(player), observation, "move {i}");
            if i == record.len() / 2 {
                midway = Some((replay.clone_box(), i));
            }
            replay.step(action).unwrap();
        }
        assert_eq!(replay.rewards(), Some(rewards.clone()));
        let (mut clone, from) = midway.unwrap();
        for (observation, action) in &record[from..] {
            assert_eq!(&clone.observation(clone.current_player()), observation);
            clone.step(action).unwrap();
        }
        assert_eq!(clone.rewards(), Some(rewards.clone()));
    }
    assert!(matches!(
        game.step("[0]"),
        Err(EnvError::GameOver { id: "SimpleTak-v0" })
    ));
}

#[test]
fn kuhn_poker_lists_its_actions_and_an_invalid_move_is_warned_then_forfeits() {
    let mut game = make_text_game("KuhnPoker-v0", &textarena()).unwrap();
    game.reset(3);
    let mover = game.current_player();
    assert_eq!(game.legal_moves(), ["[check]", "[bet]"]);
    let warned = game.step("[raise]").unwrap();
    assert!(warned.invalid_move && !warned.done);
    assert_eq!(game.current_player(), mover, "the same player moves again");
    assert!(game
        .observation(mover)
        .contains("attempted an invalid move"));
    let forfeit = game.step("[raise]").unwrap();
    assert!(forfeit.invalid_move && forfeit.done);
    let mut rewards = vec![1.0; 2];
    rewards[mover] = -1.0;
    assert_eq!(game.rewards(), Some(rewards));
    assert!(game.game_info()[mover].invalid_move);
}

#[test]
fn unknown_ids_and_textarena_ids_under_gymnasium_are_named() {
    let Err(err) = make_text_game("SimpleTakk-v0", &textarena()) else {
        panic!("TextArena has no SimpleTakk-v0");
    };
    let text = err.to_string();
    assert!(
        matches!(err, BridgeError::UnknownEnv { .. }) && text.contains("SimpleTak-v0"),
        "{text}"
    );
    let gymnasium = EnvSection {
        backend: Backend::Gymnasium,
        ..EnvSection::default()
    };
    let err = relay_bridge::PyVecEnv::new("SimpleTak-v0", &gymnasium, 1, 0).unwrap_err();
    assert!(
        err.to_string().contains("set env.backend: textarena"),
        "{err}"
    );
    // relay's own games stay built in unless the section asks for TextArena.
    let builtin = make_text_game("TicTacToe-v0", &EnvSection::default()).unwrap();
    assert!(builtin.as_any().is::<relay_envs::text::TicTacToe>());
}

/// A TextArena game of a user's own module, which raises or kills its
/// worker when told to.
fn user_games(dir: &Path) -> EnvSection {
    std::fs::write(
        dir.join("relay_test_games.py"),
        r#"
import os
import textarena as ta

class Faulty(ta.Env):
    def reset(self, num_players, seed=None):
        self.state = ta.TwoPlayerState(num_players=num_players, seed=seed)
        self.state.reset(game_state={"said": []}, player_prompt_function=lambda player_id, game_state:
            f"Player {player_id}, say a word. Available Moves: '[a]', '[b]', '[raise]', '[exit]'")
    def step(self, action):
        if "raise" in action:
            raise ValueError("the test game broke on purpose")
        if "exit" in action:
            os._exit(7)
        self.state.add_observation(from_id=self.state.current_player_id, message=action,
            observation_type=ta.ObservationType.PLAYER_ACTION)
        self.state.game_state["said"].append(action)
        if len(self.state.game_state["said"]) == 4:
            self.state.set_draw(reason="four words said")
        return self.state.step()

ta.envs.registration.register(id="Faulty-v0", entry_point=Faulty)
"#,
    )
    .unwrap();
    EnvSection {
        backend: Backend::Textarena,
        imports: vec!["relay_test_games".into()],
        python_path: vec![dir.to_path_buf()],
        ..EnvSection::default()
    }
}

#[test]
fn a_raising_game_is_lost_with_its_traceback_and_a_dead_worker_is_replaced() {
    let dir = std::env::temp_dir().join(format!("relay-textarena-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let section = user_games(&dir);
    let mut game = make_text_game("Faulty-v0", &section).unwrap();
    let mut other = make_text_game("Faulty-v0", &section).unwrap();
    for _ in 0..4 {
        other.step("[a]").unwrap();
    }
    assert_eq!(other.rewards(), Some(vec![0.0, 0.0]));
    let err = game.step("[raise]").unwrap_err().to_string();
    assert!(
        err.contains("the test game broke on purpose") && err.contains("Traceback"),
        "{err}"
    );
    assert!(game.step("[a]").is_err(), "a game that raised stays lost");
    game.reset(1);
    game.step("[a]").expect("a reset game plays again");

    let restarts = relay_bridge::text::worker_restarts();
    let err = game.step("[exit]").unwrap_err().to_string();
    assert!(err.contains("Faulty-v0"), "{err}");
    other.reset(2);
    other.step("[b]").expect("a new worker serves new games");
    assert_eq!(relay_bridge::text::worker_restarts(), restarts + 1);
    let _ = std::fs::remove_dir_all(&dir);
}
