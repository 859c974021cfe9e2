//! The `text` section: text games as env ids, several games by weight,
//! its fields and answer formats.

use super::*;

#[test]
fn text_games_are_env_ids_and_unknown_ids_list_both_kinds() {
    let c = ExperimentConfig::from_layers(TEXT, "t", &[], &[]).unwrap();
    assert!(c.is_text_game());
    assert_eq!(c.text.opponent_weights().unwrap().len(), 1);
    let err = ExperimentConfig::from_layers(
        TEXT,
        "t",
        &[],
        &[
            "run.env_id=TicTacToe-v9".into(),
            "env.backend=builtin".into(),
        ],
    )
    .unwrap_err()
    .to_string();
    for needle in [
        "run.env_id",
        "TicTacToe-v9",
        "CartPole-v1",
        "TicTacToe-v0",
        "KuhnPoker-v0",
    ] {
        assert!(err.contains(needle), "{needle}: {err}");
    }
}

#[test]
fn text_fields_are_checked_and_errors_name_them() {
    let cases: &[(&[&str], &str)] = &[
        (&["text.opponents.nobody=1"], "text.opponents.nobody"),
        (
            &["text.opponents.connect_four_bot=1"],
            "text.opponents.connect_four_bot",
        ),
        (&["text.opponents.random=-1"], "text.opponents.random"),
        (&["text.opponents.random=0"], "text.opponents"),
        (&["text.opponents.adapter:=1"], "text.opponents.adapter:"),
        (&["text.games_in_flight=0"], "text.games_in_flight"),
        (&["text.branches=0"], "text.branches"),
        (&["text.max_turn_tokens=0"], "text.max_turn_tokens"),
        (&["text.max_turn_tokens=100000"], "text.max_turn_tokens"),
        (&["text.temperature=-0.5"], "text.temperature"),
        (&["text.top_p=0"], "text.top_p"),
        (&["text.top_p=1.5"], "text.top_p"),
        (&["text.system_prompt=' '"], "text.system_prompt"),
        (&["text.learner=alphago"], "text.learner"),
        (&["text.learner=connect_four_bot"], "text.learner"),
        (&["text.generate_attempts=0"], "text.generate_attempts"),
        (&["text.generate_timeout_ms=0"], "text.generate_timeout_ms"),
        (&["text.constrainted=true"], "constrainted"),
        (&["text.observation=last"], "text.observation"),
        (&["text.branch_at=first_win"], "text.branch_at"),
        (&["text.answer=boxes"], "text.answer"),
        (&["text.answer.regex=("], "text.answer"),
        (
            &["text.answer.regex=Move (.*)", "text.constrained=true"],
            "text.constrained",
        ),
    ];
    for (sets, field) in cases {
        let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
        let err = ExperimentConfig::from_layers(TEXT, "t", &[], &sets)
            .unwrap_err()
            .to_string();
        assert!(err.contains(field), "{sets:?}: {err}");
    }
    let c = ExperimentConfig::from_layers(
        TEXT,
        "t",
        &[],
        &[
            "text.opponents.minimax=2".into(),
            "text.opponents.self=1".into(),
            "text.opponents.adapter:v1.old=0.5".into(),
            "text.learner=minimax".into(),
            "text.constrained=true".into(),
            "text.system_prompt=Play well.".into(),
        ],
    );
    // `--set` splits keys on dots, so an adapter name with a dot needs the file.
    assert!(c.is_err());
    let yaml = "run:\n  env_id: TicTacToe-v0\ntext:\n  learner: minimax\n  constrained: true\n  system_prompt: Play well.\n  opponents: {minimax: 2, self: 1, 'adapter:v1.old': 0.5}\n";
    let c = ExperimentConfig::from_layers(yaml, "t", &[], &[]).unwrap();
    let opponents = c.text.opponent_weights().unwrap();
    assert_eq!(
        opponents,
        vec![
            (Opponent::Adapter("v1.old".into()), 0.5),
            (Opponent::Bot("minimax".into()), 2.0),
            (Opponent::SelfPlay, 1.0),
        ]
    );
    assert_eq!(c.text.learner_bot(), Some("minimax"));
    // The text section does not bother classic runs, but is still checked.
    ExperimentConfig::from_layers(BASE, "t", &[], &["text.opponents.minimax=1".into()]).unwrap();
    assert!(ExperimentConfig::from_layers(BASE, "t", &[], &["text.top_p=2".into()]).is_err());
}

#[test]
fn text_games_weigh_several_games_and_bad_entries_are_named() {
    // Unset: the run's env alone.
    let c = ExperimentConfig::from_layers(TEXT, "t", &[], &[]).unwrap();
    assert_eq!(
        c.text.game_weights(&c.run.env_id),
        vec![("TicTacToe-v0".to_string(), 1.0)]
    );
    assert!(!c.text.multi_game());
    let yaml = "run:\n  env_id: TicTacToe-v0\ntext:\n  games: {TicTacToe-v0: 2, KuhnPoker-v0: 1}\n";
    let c = ExperimentConfig::from_layers(yaml, "t", &[], &[]).unwrap();
    assert_eq!(
        c.text.game_weights(&c.run.env_id),
        vec![
            ("KuhnPoker-v0".to_string(), 1.0),
            ("TicTacToe-v0".to_string(), 2.0)
        ]
    );
    assert!(c.text.multi_game());
    let cases: &[(&str, &[&str])] = &[
        (
            "text:\n  games: {TicTacToe-v0: 1, Chess-v0: 1}\n",
            &["text.games.Chess-v0", "unknown text game", "KuhnPoker-v0"],
        ),
        (
            "text:\n  games: {TicTacToe-v0: 1, CartPole-v1: 1}\n",
            &["text.games.CartPole-v1", "classic-control"],
        ),
        (
            "text:\n  games: {TicTacToe-v0: 1, KuhnPoker-v0: -1}\n",
            &["text.games.KuhnPoker-v0", ">= 0"],
        ),
        (
            "text:\n  games: {TicTacToe-v0: 1, KuhnPoker-v0: .nan}\n",
            &["text.games.KuhnPoker-v0", "NaN"],
        ),
        (
            "text:\n  games: {TicTacToe-v0: 0, KuhnPoker-v0: 0}\n",
            &["text.games", "every weight is 0"],
        ),
        ("text:\n  games: {}\n", &["text.games", "no game"]),
        (
            "text:\n  games: {KuhnPoker-v0: 1, ConnectFour-v0: 1}\n",
            &["text.games", "TicTacToe-v0"],
        ),
        (
            "text:\n  games: {TicTacToe-v0: 1, KuhnPoker-v0: 1}\n  opponents: {random: 1, minimax: 1}\n",
            &["text.opponents.minimax", "does not play KuhnPoker-v0"],
        ),
        (
            "text:\n  games: {TicTacToe-v0: 1, KuhnPoker-v0: 1}\n  learner: minimax\n",
            &["text.learner", "does not play KuhnPoker-v0"],
        ),
        (
            "text:\n  games: {TicTacToe-v0: 1, KuhnPoker-v0: 1}\n  opponents: {random: 1, league: 1}\n",
            &["text.opponents.league", "one game"],
        ),
    ];
    for (text, needles) in cases {
        let yaml = format!("{TEXT}{text}");
        let err = ExperimentConfig::from_layers(&yaml, "t", &[], &[])
            .unwrap_err()
            .to_string();
        for needle in *needles {
            assert!(err.contains(needle), "{text}: {needle}: {err}");
        }
    }
    // A classic run cannot list text games.
    let err = ExperimentConfig::from_layers(
        &format!("{BASE}text:\n  games: {{TicTacToe-v0: 1}}\n"),
        "t",
        &[],
        &[],
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("text.games") && err.contains("mix"), "{err}");
}

#[test]
fn answer_formats_are_set_by_name_or_pattern() {
    let format = |sets: &[&str]| {
        let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
        ExperimentConfig::from_layers(TEXT, "t", &[], &sets)
            .unwrap()
            .text
            .answer
    };
    assert_eq!(format(&[]), relay_envs::AnswerFormat::Raw);
    assert_eq!(
        format(&["text.answer=boxed", "text.constrained=true"]),
        relay_envs::AnswerFormat::Boxed
    );
    assert_eq!(
        format(&["text.answer=last_bracket"]),
        relay_envs::AnswerFormat::LastBracket
    );
    assert_eq!(
        format(&["text.answer.regex='Move: (\\[\\d\\])'"]),
        relay_envs::AnswerFormat::Regex("Move: (\\[\\d\\])".into())
    );
}
