//! The `league` section and the opponents text games are played
//! against.

use super::*;

#[test]
fn league_section_is_validated_by_field() {
    let yaml = "run:\n  env_id: TicTacToe-v0\ntext:\n  opponents: {league: 3, random: 1, minimax: 0}\nleague:\n  fixed: [random]\n  pool: {keep_latest: 4}\n  sampler:\n    kind: mixture\n    components:\n      - {weight: 1, sampler: {kind: mirror}}\n      - {weight: 1, sampler: {kind: lagged, k: 2}}\n      - {weight: 1, sampler: {kind: fixed, opponents: [{opponent: minimax, weight: 1}]}}\n";
    let c = ExperimentConfig::from_layers(yaml, "t", &[], &[]).unwrap();
    assert!(c.league_enabled());
    assert_eq!(c.text.league_weight(), 3.0);
    // `league` is not an opponent of its own: the sampler chooses.
    assert_eq!(
        c.text.opponent_weights().unwrap(),
        vec![
            (Opponent::Bot("minimax".into()), 0.0),
            (Opponent::Bot("random".into()), 1.0),
        ]
    );
    let fixed: Vec<String> = c.league_fixed().into_iter().map(|f| f.name).collect();
    assert_eq!(fixed, vec!["minimax".to_string(), "random".to_string()]);
    assert_eq!(c.league.pool.keep_latest, 4);
    // Adapters join as fixed members, from text.opponents and league.fixed.
    let with_adapters = ExperimentConfig::from_layers(
        yaml,
        "t",
        &[],
        &[
            "text.opponents.adapter:sft=0".into(),
            "league.fixed=[random, 'adapter:best']".into(),
        ],
    )
    .unwrap();
    let fixed: Vec<(String, relay_league::FixedKind)> = with_adapters
        .league_fixed()
        .into_iter()
        .map(|f| (f.name, f.kind))
        .collect();
    assert_eq!(
        fixed[2..],
        [
            (
                "adapter:sft".to_string(),
                relay_league::FixedKind::Adapter { path: "sft".into() }
            ),
            (
                "adapter:best".to_string(),
                relay_league::FixedKind::Adapter {
                    path: "best".into()
                }
            ),
        ]
    );
    let off = ExperimentConfig::from_layers(TEXT, "t", &[], &[]).unwrap();
    assert!(!off.league_enabled());
    assert_eq!(off.league, LeagueSection::default());

    let cases: &[(&[&str], &str)] = &[
        (&["league.pool.keep_latest=0"], "league.pool.keep_latest"),
        (
            &["league.pool.trueskill.beta=-1"],
            "league.pool.trueskill.beta",
        ),
        (&["league.pool.keep_lates=3"], "keep_lates"),
        (&["league.fixed=[alphago]"], "league.fixed[0]"),
        (&["league.fixed=['adapter:']"], "league.fixed[0]"),
        (&["league.fixed=[connect_four_bot]"], "league.fixed[0]"),
        (
            &["league.sampler={kind: match_quality, temperature: 0}"],
            "league.sampler.temperature",
        ),
        (
            &["league.sampler={kind: mixture, components: [{weight: 1, sampler: {kind: fixed, opponents: [{opponent: minimax, weight: 1}]}}]}"],
            "league.sampler.components[0].sampler.opponents[0].opponent",
        ),
        (&["league.sampler={kind: best}"], "best"),
        (&["league.branch_against=[minimax]"], "league.branch_against[0]"),
        (&["text.opponents.league=-1"], "text.opponents.league"),
        (
            &["text.opponents.league=1", "text.learner=random"],
            "text.opponents.league",
        ),
        (
            &["text.opponents.league=1", "run.env_id=GuessTheNumber-v0"],
            "text.opponents.league",
        ),
    ];
    for (sets, field) in cases {
        let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
        let err = ExperimentConfig::from_layers(TEXT, "t", &[], &sets)
            .unwrap_err()
            .to_string();
        assert!(err.contains(field), "{sets:?}: {err}");
    }
    // league.fixed puts minimax in the pool, so a fixed sampler may name it.
    ExperimentConfig::from_layers(
        TEXT,
        "t",
        &[],
        &[
            "league.fixed=[minimax]".into(),
            "league.sampler={kind: fixed, opponents: [{opponent: minimax, weight: 1}]}".into(),
            "league.branch_against=[minimax]".into(),
        ],
    )
    .unwrap();
}

#[test]
fn opponents_parse_and_print_back() {
    for name in [
        "self",
        "base",
        "random",
        "minimax",
        "connect_four_bot",
        "adapter:old-1",
    ] {
        assert_eq!(Opponent::parse(name).unwrap().label(), name);
    }
    assert!(Opponent::parse("adapter:a b").is_err());
    let err = Opponent::parse("gpt").unwrap_err();
    assert!(err.contains("gpt") && err.contains("minimax"), "{err}");
    let builtin = EnvSection::default();
    let minimax = Opponent::parse("minimax").unwrap();
    assert!(minimax.check_game("ConnectFour-v0", &builtin).is_err());
    assert!(minimax.check_game("TicTacToe-v0", &builtin).is_ok());
    assert!(Opponent::parse("random")
        .unwrap()
        .check_game("KuhnPoker-v0", &builtin)
        .is_ok());
    // TextArena's TicTacToe is not relay's: minimax cannot search it.
    let textarena = EnvSection {
        backend: relay_bridge::Backend::Textarena,
        ..EnvSection::default()
    };
    let err = minimax.check_game("TicTacToe-v0", &textarena).unwrap_err();
    assert!(
        err.contains("minimax") && err.contains("TicTacToe-v0"),
        "{err}"
    );
}
