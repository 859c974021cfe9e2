//! API-level tests of the text games: registry, the TextGame contract
//! (legal moves are accepted, games end, errors), the invalid-move rule,
//! KuhnPoker's and GuessTheNumber's rules and texts, and the bots.

use relay_envs::text::tic_tac_toe::completing_cells;
use relay_envs::text::{ConnectFour, GuessTheNumber, KuhnPoker, TicTacToe};
use relay_envs::{
    make_text_game, Bot, ConnectFourBot, EnvError, MinimaxBot, ObservationView, RandomBot,
    TextGame, TEXT_GAME_IDS,
};

/// Plays `game` to the end with one bot per seat; returns the rewards.
fn play(game: &mut dyn TextGame, bots: &mut [&mut dyn Bot]) -> Vec<f64> {
    while !game.is_done() {
        let player = game.current_player();
        let action = bots[player].choose_move(game).expect("bot move");
        assert!(game.legal_moves().contains(&action), "{action} not legal");
        let outcome = game.step(&action).expect("step");
        assert_eq!(outcome.player, player);
        assert!(!outcome.invalid_move, "legal move {action:?} was rejected");
    }
    game.rewards().expect("rewards once done")
}

#[test]
fn unknown_text_game_error_lists_known_ids() {
    let err = make_text_game("Chess-v0")
        .err()
        .expect("unknown id must fail");
    let msg = err.to_string();
    assert!(msg.contains("\"Chess-v0\""), "{msg}");
    for id in TEXT_GAME_IDS {
        assert!(msg.contains(id), "{msg} does not list {id}");
    }
    assert!(matches!(err, EnvError::UnknownEnv { .. }));
}

#[test]
fn every_registered_game_plays_to_the_end_with_random_legal_moves() {
    for &id in TEXT_GAME_IDS {
        let mut game = make_text_game(id).expect("registered id");
        assert_eq!(game.id(), id);
        let n = game.num_players();
        for seed in 0..30 {
            game.reset(seed);
            assert!(!game.is_done());
            assert_eq!(game.rewards(), None);
            assert_eq!(game.turn(), 0);
            for p in 0..n {
                assert!(
                    game.observation(p)
                        .starts_with(&format!("\n[GAME] You are Player {p}")),
                    "{id}: {:?}",
                    game.observation(p)
                );
            }
            let mut b0 = RandomBot::new(seed);
            let mut b1 = RandomBot::new(seed + 1000);
            let mut bots: [&mut dyn Bot; 2] = [&mut b0, &mut b1];
            let rewards = play(game.as_mut(), &mut bots[..n]);
            assert_eq!(rewards.len(), n);
            if n == 2 {
                assert_eq!(rewards[0], -rewards[1], "{id}: zero-sum");
                assert!([-1.0, 0.0, 1.0].contains(&rewards[0]));
            } else {
                assert!((0.0..=1.0).contains(&rewards[0]));
            }
            let info = game.game_info();
            assert_eq!(info.len(), n);
            for (p, entry) in info.iter().enumerate() {
                assert_eq!(entry.role, format!("Player {p}"));
                assert!(!entry.invalid_move);
                assert!(entry.reason.is_some(), "{id}: a finished game has a reason");
            }
            assert!(game.legal_moves().is_empty());
            assert_eq!(
                game.step("[1]").err(),
                Some(EnvError::GameOver { id }),
                "{id}: stepping a finished game"
            );
            assert!(RandomBot::new(0).choose_move(game.as_ref()).is_err());
        }
    }
}

/// The messages of a full transcript: its `"\n[<sender>] "` lines, bare.
fn messages(transcript: &str) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for piece in transcript.split("\n[").skip(1) {
        match piece.split_once("] ") {
            Some((sender, text)) if sender == "GAME" || sender.starts_with("Player") => {
                out.push(text.to_string())
            }
            // A `[`...`]` inside a message (e.g. `'[4]'`) is not a new one.
            _ => out
                .last_mut()
                .expect("a message")
                .push_str(&format!("\n[{piece}")),
        }
    }
    out
}

#[test]
fn first_last_view_is_the_prompt_and_the_latest_message_as_textarena_renders_them() {
    for &id in TEXT_GAME_IDS {
        let mut game = make_text_game(id).expect("registered id");
        game.reset(3);
        let mut bot = RandomBot::new(3);
        let mut checked = 0;
        while !game.is_done() {
            for p in 0..game.num_players() {
                let full = messages(&game.observation(p));
                let expected = match full.as_slice() {
                    [first] => format!("{first}\n\n"),
                    [first, .., last] => format!("{first}\n\n{last}\n\n"),
                    [] => unreachable!("every player gets a prompt"),
                };
                assert_eq!(game.observation_as(p, ObservationView::FirstLast), expected);
                assert_eq!(
                    game.observation_as(p, ObservationView::Full),
                    game.observation(p)
                );
                checked += 1;
            }
            let action = bot.choose_move(game.as_ref()).expect("bot move");
            game.step(&action).expect("step");
        }
        assert!(checked > 0, "{id}");
    }
    // TicTacToe: the rules, then the current board with its moves.
    let mut game = make_text_game("TicTacToe-v0").unwrap();
    game.reset(0);
    game.step("[4]").unwrap();
    let view = game.observation_as(1, ObservationView::FirstLast);
    assert!(
        view.starts_with("You are Player 1 in Tic Tac Toe."),
        "{view}"
    );
    assert!(
        view.ends_with(
            "\n\nAvailable Moves: '[0]', '[1]', '[2]', '[3]', '[5]', '[6]', '[7]', '[8]'\n\n"
        ),
        "{view}"
    );
    assert!(
        !view.contains("[GAME]") && !view.contains("[Player 0]"),
        "{view}"
    );
    assert_eq!("first_last".parse(), Ok(ObservationView::FirstLast));
    let err = "last".parse::<ObservationView>().unwrap_err();
    assert!(
        err.contains("\"last\"") && err.contains("first_last"),
        "{err}"
    );
}

#[test]
fn completing_cells_are_the_free_cells_that_finish_a_line() {
    // O (player 0) holds 0 and 4; X (player 1) holds 2 and 5, and 8 is taken.
    let mut board = [None; 9];
    for (cell, player) in [(0, 0), (4, 0), (2, 1), (5, 1), (6, 0)] {
        board[cell] = Some(player);
    }
    // O: 8 (the diagonal 0-4-8) and 3 (the column 0-3-6); 2 is not free.
    assert_eq!(completing_cells(&board, 0), vec![3, 8]);
    // X: 8 (the column 2-5-8).
    assert_eq!(completing_cells(&board, 1), vec![8]);
    assert!(completing_cells(&[None; 9], 0).is_empty());
}

#[test]
fn compact_view_shows_the_board_from_the_players_side() {
    let mut game = make_text_game("TicTacToe-v0").unwrap();
    game.reset(0);
    game.step("[4]").unwrap();
    game.step("[0]").unwrap();
    game.step("[8]").unwrap();
    let for_player = |p| game.observation_as(p, ObservationView::Compact);
    assert!(
        for_player(0).contains("\nYours: 4 8\nTheirs: 0\nFree: 1 2 3 5 6 7\n"),
        "{}",
        for_player(0)
    );
    assert!(
        for_player(1).contains("\nYours: 0\nTheirs: 4 8\nFree: 1 2 3 5 6 7\n"),
        "{}",
        for_player(1)
    );
    assert!(!for_player(1).contains("Player"), "{}", for_player(1));

    let mut game = make_text_game("ConnectFour-v0").unwrap();
    game.reset(0);
    for column in ["[3]", "[3]", "[0]"] {
        game.step(column).unwrap();
    }
    let view = game.observation_as(1, ObservationView::Compact);
    assert!(view.contains("\n0: t\n1:\n2:\n3: t y\n4:\n"), "{view}");
    assert!(view.contains("\nOpen: 0 1 2 3 4 5 6\n"), "{view}");

    // Games without a board show first_last.
    let mut game = make_text_game("KuhnPoker-v0").unwrap();
    game.reset(5);
    assert_eq!(
        game.observation_as(0, ObservationView::Compact),
        game.observation_as(0, ObservationView::FirstLast)
    );
    assert_eq!("compact".parse(), Ok(ObservationView::Compact));
}

#[test]
fn actions_without_brackets_are_bracketed_and_role_tags_removed() {
    let mut game = TicTacToe::new();
    let outcome = game.step("4").unwrap();
    assert!(!outcome.invalid_move && !outcome.done);
    assert_eq!(game.board()[4], Some(0));
    assert!(game
        .observation(1)
        .contains("\n[Player 0] [4]\n[GAME] Player 0 placed their symbol (O) in cell 4."));
    game.step("[Player 1] I take [GAME][0]").unwrap();
    assert_eq!(game.board()[0], Some(1));
    assert!(game.observation(0).contains("\n[Player 1]  I take [0]\n"));
}

#[test]
fn first_invalid_move_warns_the_mover_privately_and_the_second_forfeits() {
    let mut game = ConnectFour::new();
    game.step("[col 3]").unwrap();
    let before_p0 = game.observation(0);
    let outcome = game.step("[col 9]").unwrap();
    assert!(outcome.invalid_move && !outcome.done);
    assert_eq!(game.current_player(), 1, "the same player retries");
    assert!(game.observation(1).ends_with(
        "\n[Player 1] [col 9]\n[GAME] Player 1 attempted an invalid move. Reason: Player 1, \
         Invalid action. Column 9 is out of bounds. Please resubmit a valid move and remember \
         to follow the game rules to avoid penalties."
    ));
    assert_eq!(
        game.observation(0),
        format!("{before_p0}\n[Player 1] [col 9]"),
        "the opponent sees the action, not the warning"
    );
    // A valid move restores the allowance.
    game.step("[col 3]").unwrap();
    game.step("nonsense").unwrap();
    assert!(!game.is_done());
    game.step("[col 0]").unwrap();
    assert_eq!(game.current_player(), 1);
    game.step("x").unwrap();
    let outcome = game.step("[col 8]").unwrap();
    assert!(outcome.invalid_move && outcome.done);
    assert_eq!(game.rewards(), Some(vec![1.0, -1.0]));
    let info = game.game_info();
    assert!(info[1].invalid_move && !info[0].invalid_move);
    assert_eq!(
        info[0].reason.as_deref(),
        Some("Player 1, Invalid action. Column 8 is out of bounds.")
    );
    assert_eq!((info[0].turn_count, info[1].turn_count), (2, 2));
}

#[test]
fn state_key_identifies_positions_and_clones_are_independent() {
    let mut a = make_text_game("TicTacToe-v0").unwrap();
    assert_eq!(a.state_key(), ".........:0");
    a.step("[4]").unwrap();
    let b = a.clone();
    a.step("[0]").unwrap();
    assert_eq!(a.state_key(), "X...O....:0");
    assert_eq!(b.state_key(), "....O....:1");
    let mut c = make_text_game("TicTacToe-v0").unwrap();
    c.step("[4]").unwrap();
    assert_eq!(c.state_key(), b.state_key());
    assert_eq!(c.observation(0), b.observation(0));

    let mut c4 = make_text_game("ConnectFour-v0").unwrap();
    c4.step("[col 0]").unwrap();
    assert_eq!(
        c4.state_key(),
        "......./......./......./......./......./X......:1"
    );
}

fn card(rank: u8) -> char {
    ['J', 'Q', 'K'][rank as usize]
}

#[test]
fn kuhn_poker_follows_textarena_rules_and_texts() {
    let mut game = KuhnPoker::new();
    game.reset(7);
    let [c0, c1] = game.cards();
    assert_ne!(c0, c1);
    // Player 1 opens round 1; player 0 gets the round message twice.
    assert_eq!(game.current_player(), 1);
    let start = |rank: u8| {
        format!(
            "\n[GAME] ### Starting round 1 out of 3 rounds. Your card is: '{}'",
            card(rank)
        )
    };
    assert!(game.observation(1).ends_with(&format!(
        "{}\n[GAME] Your available actions are: '[check]', '[bet]'",
        start(c1)
    )));
    assert!(game
        .observation(0)
        .ends_with(&format!("{}{}", start(c0), start(c0))));
    assert!(game.observation(0).contains("in a 3 round game of Kuhn Poker.\nGame Rules:\n- Kuhn Poker uses a 3-card deck with J, Q, K (J lowest, K highest)\n- Each player antes 1 chip and receives 1 card each round (note that"));
    assert_eq!(game.legal_moves(), ["[check]", "[bet]"]);
    assert_eq!(game.chips(), [-1, -1]);

    // Illegal in this node: warned with the legal list.
    let outcome = game.step("[call]").unwrap();
    assert!(outcome.invalid_move && !outcome.done);
    assert!(game
        .observation(1)
        .ends_with("Reason: Action must be [check], [bet]. Please resubmit a valid move and remember to follow the game rules to avoid penalties."));

    // Bet, fold: player 1 wins the pot of the two antes.
    game.step("BET").unwrap();
    assert_eq!(game.current_player(), 0);
    assert_eq!(game.legal_moves(), ["[fold]", "[call]"]);
    assert!(game
        .observation(0)
        .ends_with("\n[GAME] Player 1, submitted move: '[bet]'.\n[GAME] Your available actions are: '[fold]', '[call]'"));
    game.step("[Fold]").unwrap();
    assert!(game.observation(1).contains(
        "\n[GAME] Player 0 has folded. Current scores: Player 0: '-1'; Player 1: '1'\n[GAME] ### Starting round 2 out of 3 rounds."
    ));
    assert_eq!(game.round(), 2);
    assert_eq!(game.chips(), [-2, 0]);
    // Round 2 is opened by player 0; the finished round's turn went to it.
    assert_eq!(game.current_player(), 0);
    assert_eq!(game.game_info()[0].turn_count, 1);
    assert_eq!(game.game_info()[1].turn_count, 1);

    // Check, check: showdown.
    let [c0, c1] = game.cards();
    game.step("[check]").unwrap();
    game.step("[check]").unwrap();
    let (w, l) = if c0 > c1 { (0, 1) } else { (1, 0) };
    let (wc, lc) = if w == 0 { (c0, c1) } else { (c1, c0) };
    assert!(game.observation(0).contains(&format!(
        "Showdown: Player {w}'s {} beats Player {l}'s {}. Player {w} wins pot of 2 chips.",
        card(wc),
        card(lc)
    )));
    assert_eq!(game.round(), 3);

    // Round 3: check, bet, call (the pot stays at the antes, as in TextArena).
    let chips_before = game.chips();
    let [c0, c1] = game.cards();
    let opener = game.current_player();
    assert_eq!(opener, 1);
    game.step("[check]").unwrap();
    game.step("[bet]").unwrap();
    assert_eq!(game.current_player(), opener);
    let outcome = game.step("[call]").unwrap();
    assert!(outcome.done && !outcome.invalid_move);
    let w = if c0 > c1 { 0 } else { 1 };
    let mut chips = chips_before;
    chips[w] += 2;
    // The game-ending `_init_round` still antes for a fourth round.
    assert_eq!(game.chips(), [chips[0] - 1, chips[1] - 1]);
    let winner = if chips[0] > chips[1] { 0 } else { 1 };
    let mut rewards = vec![-1.0; 2];
    rewards[winner] = 1.0;
    assert_eq!(game.rewards(), Some(rewards));
    assert_eq!(
        game.game_info()[0].reason.as_deref(),
        Some(
            format!("Player {winner} won by having more chips at the end of all 3 rounds.")
                .as_str()
        )
    );
    assert!(game
        .observation(0)
        .contains("### Starting round 4 out of 3 rounds."));
}

#[test]
fn kuhn_poker_deals_depend_on_the_seed() {
    let mut game = KuhnPoker::new();
    let mut deals = std::collections::BTreeSet::new();
    for seed in 0..60 {
        game.reset(seed);
        let again = {
            let mut other = KuhnPoker::new();
            other.reset(seed);
            other.cards()
        };
        assert_eq!(game.cards(), again, "same seed, same deal");
        deals.insert(game.cards());
    }
    assert_eq!(
        deals.len(),
        6,
        "every ordered pair of distinct cards is dealt"
    );
}

/// Binary search over `[lo, hi]` using the game's hints.
fn solve_guess_the_number(game: &mut GuessTheNumber) -> u32 {
    let (mut lo, mut hi) = (1usize, 20usize);
    let mut guesses = 0;
    while !game.is_done() {
        let guess = (lo + hi) / 2;
        guesses += 1;
        game.step(&format!("My guess is [{guess}].")).unwrap();
        let obs = game.observation(0);
        if obs.ends_with("The target number is higher.") {
            lo = guess + 1;
        } else if obs.ends_with("The target number is lower.") {
            hi = guess - 1;
        }
    }
    guesses
}

#[test]
fn guess_the_number_is_solved_by_binary_search() {
    let mut game = GuessTheNumber::new();
    let mut targets = std::collections::BTreeSet::new();
    for seed in 0..50 {
        game.reset(seed);
        targets.insert(game.target());
        assert!((1..=20).contains(&game.target()));
        let guesses = solve_guess_the_number(&mut game);
        assert!(guesses <= 5);
        assert_eq!(game.rewards(), Some(vec![1.0]));
        assert_eq!(
            game.game_info()[0].reason.as_deref(),
            Some("Congratulations! You guessed the correct number.")
        );
    }
    assert!(
        targets.len() > 10,
        "targets vary with the seed: {targets:?}"
    );
}

#[test]
fn guess_the_number_scores_partial_progress_and_invalid_moves() {
    let mut game = GuessTheNumber::new();
    let seed = (0..).find(|&s| {
        game.reset(s);
        game.target() <= 10
    });
    game.reset(seed.unwrap());
    let target = game.target();
    assert!(game.observation(0).starts_with(
        "\n[GAME] You are Player 0. You are playing Guess The Number.\nYou have to guess the number between 1 and 20 within 10 turns.\n"
    ));
    // Out of range: warning (broadcast in the single-player wording).
    let outcome = game.step("[25]").unwrap();
    assert!(outcome.invalid_move && !outcome.done);
    assert!(game.observation(0).ends_with(
        "\n[Player] [25]\n[GAME] You attempted an invalid move. Reason: Invalid move. Player 0 guessed a number outside the range specified. Please resubmit a valid move and remember to follow the game rules to avoid penalties."
    ));
    game.step("[20]").unwrap();
    assert!(game
        .observation(0)
        .ends_with("\n[GAME] The target number is lower."));
    // Repeated guess twice in a row: forfeit with the score of the last guess.
    game.step("[20]").unwrap();
    let outcome = game.step("[20]").unwrap();
    assert!(outcome.done && outcome.invalid_move);
    let score = 1.0 - ((20 - target) as f64 / 19.0);
    assert_eq!(game.rewards(), Some(vec![score]));
    let info = &game.game_info()[0];
    assert!(info.invalid_move);
    assert_eq!(
        info.reason.as_deref(),
        Some("Invalid Move: Invalid move. Player 0 has already guessed the number.")
    );
    assert_eq!(info.turn_count, 2);
}

#[test]
fn guess_the_number_turn_limit_is_checked_before_the_guess_counts() {
    let mut game = GuessTheNumber::new();
    let seed = (0..).find(|&s| {
        game.reset(s);
        game.target() == 20
    });
    game.reset(seed.unwrap());
    for guess in 1..=10 {
        let outcome = game.step(&format!("[{guess}]")).unwrap();
        assert!(!outcome.done, "guess {guess}");
    }
    assert_eq!(game.turn(), 10);
    let outcome = game.step("[11]").unwrap();
    assert!(outcome.done);
    assert_eq!(game.rewards(), Some(vec![1.0 - 9.0 / 19.0]));
    assert_eq!(
        game.game_info()[0].reason.as_deref(),
        Some("The turn limit has been reached. Guess: 11, Target: 20")
    );
}

#[test]
fn minimax_never_loses_to_random_in_either_seat() {
    let mut minimax = MinimaxBot::new();
    let mut game = TicTacToe::new();
    let mut wins = 0;
    for seed in 0..200u64 {
        let mut random = RandomBot::new(seed);
        let minimax_seat = (seed % 2) as usize;
        game.reset(seed);
        let rewards = if minimax_seat == 0 {
            play(&mut game, &mut [&mut minimax as &mut dyn Bot, &mut random])
        } else {
            play(&mut game, &mut [&mut random as &mut dyn Bot, &mut minimax])
        };
        assert!(
            rewards[minimax_seat] >= 0.0,
            "minimax lost game {seed}: {}",
            game.observation(0)
        );
        wins += usize::from(rewards[minimax_seat] > 0.0);
    }
    assert!(
        wins > 100,
        "minimax should beat random most of the time ({wins}/200)"
    );
}

#[test]
fn two_minimax_bots_always_draw() {
    let mut game = TicTacToe::new();
    let (mut a, mut b) = (MinimaxBot::new(), MinimaxBot::new());
    // Also from every first move, so the defence is tested from all openings.
    for first in 0..10 {
        game.reset(0);
        if first < 9 {
            game.step(&format!("[{first}]")).unwrap();
        }
        let rewards = play(&mut game, &mut [&mut a as &mut dyn Bot, &mut b]);
        assert_eq!(rewards, vec![0.0, 0.0], "opening {first}");
        assert_eq!(
            game.game_info()[0].reason.as_deref(),
            Some("The game is a draw!")
        );
    }
}

#[test]
fn minimax_takes_a_win_and_refuses_other_games() {
    let mut game = TicTacToe::new();
    for cell in ["[0]", "[3]", "[1]", "[4]"] {
        game.step(cell).unwrap();
    }
    // O holds 0 and 1; X holds 3 and 4. O to move wins at 2 (X threatens 5).
    assert_eq!(MinimaxBot::new().choose_move(&game).unwrap(), "[2]");
    let c4 = ConnectFour::new();
    assert!(matches!(
        MinimaxBot::new().choose_move(&c4),
        Err(EnvError::BotCannotPlay { .. })
    ));
}

#[test]
fn connect_four_bot_wins_blocks_and_beats_random() {
    let mut bot = ConnectFourBot::default();
    // Player 0 has three in column 0 (with player 1 stacking column 6).
    let mut game = ConnectFour::new();
    for col in [0, 6, 0, 6, 0] {
        game.step(&format!("[col {col}]")).unwrap();
    }
    // Player 1 to move must block column 0.
    assert_eq!(bot.choose_move(&game).unwrap(), "[col 0]");
    game.step("[col 5]").unwrap();
    // Player 0 to move wins in column 0.
    assert_eq!(bot.choose_move(&game).unwrap(), "[col 0]");

    for seed in 0..12u64 {
        let mut random = RandomBot::new(seed);
        let seat = (seed % 2) as usize;
        game.reset(seed);
        let rewards = if seat == 0 {
            play(&mut game, &mut [&mut bot as &mut dyn Bot, &mut random])
        } else {
            play(&mut game, &mut [&mut random as &mut dyn Bot, &mut bot])
        };
        assert_eq!(rewards[seat], 1.0, "game {seed}: {}", game.state_key());
    }
}
