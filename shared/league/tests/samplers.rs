//! Opponent samplers: each rule's choice and distribution, determinism
//! under a seed, fallbacks and errors, seating, config validation.

use std::collections::BTreeMap;

use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use relay_league::{
    FixedKind, FixedOpponent, Matchup, MemberId, MixtureComponent, OpponentSampler, Outcome,
    PolicyVersion, Pool, PoolConfig, Rating, SampleError, SamplerConfig, SamplerKind,
    WeightedOpponent,
};

/// Draws per distribution check: the standard error of a frequency is then
/// at most 0.0035, so the 0.02 tolerance is over 5 standard errors.
const DRAWS: usize = 20_000;
const TOLERANCE: f64 = 0.02;

fn v(version: u64) -> MemberId {
    MemberId::Version(version)
}

fn fixed(name: &str) -> MemberId {
    MemberId::Fixed(name.to_string())
}

fn sampler(config: SamplerConfig) -> OpponentSampler {
    OpponentSampler::new(config).unwrap()
}

/// Versions 1..=`newest` (no bounding in play) and fixed `random` and
/// `minimax`, all at the prior rating.
fn pool_with(newest: u64) -> Pool {
    let mut pool = Pool::new(PoolConfig {
        keep_latest: 100,
        ..PoolConfig::default()
    })
    .unwrap();
    for version in 1..=newest {
        pool.add_version(PolicyVersion {
            version,
            parent: None,
            weights_ref: format!("w{version}"),
        })
        .unwrap();
    }
    for (name, kind) in [
        ("random", FixedKind::Random),
        ("minimax", FixedKind::Minimax { depth: Some(2) }),
    ] {
        pool.add_fixed(FixedOpponent {
            name: name.into(),
            kind,
        })
        .unwrap();
    }
    pool
}

fn draws(sampler: &OpponentSampler, pool: &Pool, seed: u64) -> Vec<Matchup> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..DRAWS)
        .map(|_| sampler.sample(pool, &mut rng).unwrap())
        .collect()
}

fn frequencies(matchups: &[Matchup]) -> BTreeMap<MemberId, f64> {
    let mut counts = BTreeMap::new();
    for matchup in matchups {
        *counts.entry(matchup.opponent.clone()).or_insert(0.0) += 1.0;
    }
    for count in counts.values_mut() {
        *count /= matchups.len() as f64;
    }
    counts
}

fn assert_frequencies(got: &BTreeMap<MemberId, f64>, want: &[(MemberId, f64)]) {
    assert_eq!(got.len(), want.len(), "chosen: {got:?}, want {want:?}");
    for (id, p) in want {
        let freq = got.get(id).copied().unwrap_or(0.0);
        assert!(
            (freq - p).abs() < TOLERANCE,
            "{id}: frequency {freq}, want {p} (all: {got:?})"
        );
    }
}

#[test]
fn mirror_plays_the_current_version() {
    let pool = pool_with(3);
    let matchups = draws(&sampler(SamplerConfig::Mirror), &pool, 1);
    assert!(matchups.iter().all(|m| m.opponent == v(3)
        && m.current == 3
        && m.sampler == SamplerKind::Mirror
        && !m.fallback_to_mirror));
}

#[test]
fn fixed_seats_the_current_version_first_as_often_as_moves_first_says() {
    let pool = pool_with(2);
    for (moves_first, expected) in [(None, 0.5), (Some(0.25), 0.25)] {
        let config = SamplerConfig::Fixed {
            opponents: vec![WeightedOpponent {
                opponent: fixed("random"),
                weight: 1.0,
            }],
            moves_first,
        };
        let matchups = draws(&sampler(config), &pool, 3);
        let first = matchups.iter().filter(|m| m.current_moves_first).count();
        let share = first as f64 / matchups.len() as f64;
        assert!(
            (share - expected).abs() < 0.03,
            "moves_first {moves_first:?}: {share}"
        );
    }
}

#[test]
fn fixed_follows_its_weights_and_skips_missing_members() {
    let pool = pool_with(2);
    let config = SamplerConfig::Fixed {
        opponents: vec![
            WeightedOpponent {
                opponent: fixed("random"),
                weight: 1.0,
            },
            WeightedOpponent {
                opponent: fixed("minimax"),
                weight: 3.0,
            },
            WeightedOpponent {
                opponent: fixed("not-there"),
                weight: 100.0,
            },
        ],
        moves_first: None,
    };
    let matchups = draws(&sampler(config), &pool, 2);
    assert_frequencies(
        &frequencies(&matchups),
        &[(fixed("random"), 0.25), (fixed("minimax"), 0.75)],
    );
    assert!(matchups.iter().all(|m| m.sampler == SamplerKind::Fixed));

    let nobody = sampler(SamplerConfig::Fixed {
        opponents: vec![WeightedOpponent {
            opponent: fixed("gone"),
            weight: 1.0,
        }],
        moves_first: None,
    });
    let err = nobody
        .sample(&pool, &mut ChaCha8Rng::seed_from_u64(0))
        .unwrap_err();
    assert_eq!(
        err,
        SampleError::NoListedOpponentInPool(vec![fixed("gone")])
    );
    assert!(err.to_string().contains("gone"));
}

#[test]
fn lagged_goes_k_versions_back_clamped_to_the_oldest() {
    let mut pool = pool_with(10);
    let mut rng = ChaCha8Rng::seed_from_u64(3);
    let lagged = |k| sampler(SamplerConfig::Lagged { k });
    let opponent = |pool: &Pool, k, rng: &mut ChaCha8Rng| lagged(k).sample(pool, rng).unwrap();
    assert_eq!(opponent(&pool, 3, &mut rng).opponent, v(7));
    assert_eq!(opponent(&pool, 9, &mut rng).opponent, v(1));
    assert_eq!(opponent(&pool, 50, &mut rng).opponent, v(1));
    let zero = opponent(&pool, 0, &mut rng);
    assert_eq!((zero.opponent, zero.fallback_to_mirror), (v(10), false));

    // With gaps left by eviction (the first version stays, pinned by
    // `keep_first`): the newest version at most k back.
    pool.set_config(PoolConfig {
        keep_latest: 3,
        keep_best: 0,
        ..*pool.config()
    })
    .unwrap();
    pool.add_version(PolicyVersion {
        version: 14,
        parent: None,
        weights_ref: "w14".into(),
    })
    .unwrap();
    assert_eq!(pool.versions().collect::<Vec<_>>(), vec![1, 9, 10, 14]);
    assert_eq!(opponent(&pool, 2, &mut rng).opponent, v(10));
    assert_eq!(opponent(&pool, 1, &mut rng).opponent, v(10));
    assert_eq!(opponent(&pool, 5, &mut rng).opponent, v(9));
    assert_eq!(opponent(&pool, 100, &mut rng).opponent, v(1));

    // Only the current version: mirror, flagged.
    let alone = pool_with(1);
    let m = opponent(&alone, 2, &mut rng);
    assert_eq!((m.opponent, m.fallback_to_mirror), (v(1), true));
}

#[test]
fn uniform_covers_every_other_member_equally() {
    let pool = pool_with(4);
    let everyone = draws(
        &sampler(SamplerConfig::Uniform {
            include_fixed: true,
        }),
        &pool,
        4,
    );
    let fifth = 1.0 / 5.0;
    assert_frequencies(
        &frequencies(&everyone),
        &[
            (v(1), fifth),
            (v(2), fifth),
            (v(3), fifth),
            (fixed("random"), fifth),
            (fixed("minimax"), fifth),
        ],
    );
    let past_only = draws(
        &sampler(SamplerConfig::Uniform {
            include_fixed: false,
        }),
        &pool,
        4,
    );
    let third = 1.0 / 3.0;
    assert_frequencies(
        &frequencies(&past_only),
        &[(v(1), third), (v(2), third), (v(3), third)],
    );
}

/// Ratings set through the serde form, so a test can place members freely.
fn with_ratings(pool: &Pool, ratings: &[(MemberId, Rating)]) -> Pool {
    let mut state = serde_json::to_value(pool).unwrap();
    for (id, rating) in ratings {
        state["members"][id.to_string()]["rating"] = serde_json::to_value(rating).unwrap();
    }
    serde_json::from_value(state).unwrap()
}

#[test]
fn match_quality_is_proportional_to_quality_sharpened_by_temperature() {
    let pool = with_ratings(
        &pool_with(3),
        &[
            (v(3), Rating::new(30.0, 2.0)),
            (v(2), Rating::new(29.0, 2.0)),
            (v(1), Rating::new(22.0, 3.0)),
            (fixed("random"), Rating::new(5.0, 2.0)),
            (fixed("minimax"), Rating::new(33.0, 4.0)),
        ],
    );
    let env = pool.config().trueskill;
    let current = pool.get(&v(3)).unwrap().rating;
    let candidates = [v(1), v(2), fixed("random"), fixed("minimax")];
    let expected = |temperature: f64, floor: f64| -> Vec<(MemberId, f64)> {
        let weights: Vec<f64> = candidates
            .iter()
            .map(|id| {
                env.quality_1vs1(current, pool.get(id).unwrap().rating)
                    .max(floor)
                    .powf(1.0 / temperature)
            })
            .collect();
        let total: f64 = weights.iter().sum();
        candidates
            .iter()
            .zip(weights)
            .map(|(id, w)| (id.clone(), w / total))
            .collect()
    };
    for (temperature, floor) in [(1.0, 0.0), (0.3, 0.0), (1.0, 0.2)] {
        let config = SamplerConfig::MatchQuality {
            temperature,
            floor,
            include_fixed: true,
        };
        let got = frequencies(&draws(&sampler(config), &pool, 5));
        let want = expected(temperature, floor);
        // A hopeless match with no floor is never (or almost never) drawn.
        let want: Vec<_> = want.into_iter().filter(|(_, p)| *p > 1e-4).collect();
        assert_frequencies(&got, &want);
    }
    // The closest rating is the most likely opponent, and a low temperature
    // concentrates on it.
    let sharp = frequencies(&draws(
        &sampler(SamplerConfig::MatchQuality {
            temperature: 0.05,
            floor: 0.0,
            include_fixed: true,
        }),
        &pool,
        6,
    ));
    assert!(sharp[&v(2)] > 0.95, "{sharp:?}");
}

#[test]
fn least_played_picks_the_fewest_games_and_breaks_ties_at_random() {
    let mut pool = pool_with(3);
    for _ in 0..3 {
        pool.record_result(&v(3), &v(2), Outcome::Win).unwrap();
    }
    pool.record_result(&fixed("random"), &v(3), Outcome::Loss)
        .unwrap();
    pool.record_result(&v(3), &fixed("minimax"), Outcome::Draw)
        .unwrap();
    // Games of other pairs do not count against the current version.
    pool.record_result(&v(1), &v(2), Outcome::Draw).unwrap();
    let least = sampler(SamplerConfig::LeastPlayed {
        include_fixed: true,
    });
    let matchups = draws(&least, &pool, 7);
    assert!(matchups.iter().all(|m| m.opponent == v(1)));

    pool.record_result(&v(3), &v(1), Outcome::Win).unwrap();
    // Now v1, random and minimax have one game each: a fair three-way tie.
    let third = 1.0 / 3.0;
    assert_frequencies(
        &frequencies(&draws(&least, &pool, 8)),
        &[
            (v(1), third),
            (fixed("random"), third),
            (fixed("minimax"), third),
        ],
    );
    // Without fixed opponents only v1 is left at the minimum.
    let versions_only = sampler(SamplerConfig::LeastPlayed {
        include_fixed: false,
    });
    assert!(draws(&versions_only, &pool, 9)
        .iter()
        .all(|m| m.opponent == v(1)));
}

fn mixture() -> SamplerConfig {
    SamplerConfig::Mixture {
        components: vec![
            MixtureComponent {
                weight: 0.6,
                sampler: SamplerConfig::Mirror,
            },
            MixtureComponent {
                weight: 0.3,
                sampler: SamplerConfig::Uniform {
                    include_fixed: false,
                },
            },
            MixtureComponent {
                weight: 0.1,
                sampler: SamplerConfig::Fixed {
                    opponents: vec![WeightedOpponent {
                        opponent: fixed("minimax"),
                        weight: 1.0,
                    }],
                    moves_first: None,
                },
            },
        ],
    }
}

#[test]
fn mixture_chooses_components_by_weight() {
    let pool = pool_with(3);
    let matchups = draws(&sampler(mixture()), &pool, 10);
    let share =
        |kind| matchups.iter().filter(|m| m.sampler == kind).count() as f64 / matchups.len() as f64;
    assert!((share(SamplerKind::Mirror) - 0.6).abs() < TOLERANCE);
    assert!((share(SamplerKind::Uniform) - 0.3).abs() < TOLERANCE);
    assert!((share(SamplerKind::Fixed) - 0.1).abs() < TOLERANCE);
    assert_frequencies(
        &frequencies(&matchups),
        &[
            (v(3), 0.6),
            (v(1), 0.15),
            (v(2), 0.15),
            (fixed("minimax"), 0.1),
        ],
    );
}

#[test]
fn a_seed_fixes_the_sequence_of_matchups_and_seats() {
    let pool = pool_with(5);
    let mixed = sampler(SamplerConfig::Mixture {
        components: vec![
            MixtureComponent {
                weight: 1.0,
                sampler: mixture(),
            },
            MixtureComponent {
                weight: 1.0,
                sampler: SamplerConfig::MatchQuality {
                    temperature: 1.0,
                    floor: 0.0,
                    include_fixed: true,
                },
            },
            MixtureComponent {
                weight: 1.0,
                sampler: SamplerConfig::LeastPlayed {
                    include_fixed: true,
                },
            },
        ],
    });
    let run = |seed| {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        (0..200)
            .map(|_| mixed.sample(&pool, &mut rng).unwrap())
            .collect::<Vec<_>>()
    };
    assert_eq!(run(11), run(11));
    assert_ne!(run(11), run(12));
}

#[test]
fn seating_is_a_fair_coin_and_seats_follow_it() {
    let pool = pool_with(2);
    let matchups = draws(
        &sampler(SamplerConfig::Uniform {
            include_fixed: true,
        }),
        &pool,
        13,
    );
    let first = matchups.iter().filter(|m| m.current_moves_first).count() as f64;
    assert!((first / DRAWS as f64 - 0.5).abs() < TOLERANCE);
    for m in &matchups[..50] {
        let seats = m.seats();
        let current_seat = if m.current_moves_first { 0 } else { 1 };
        assert_eq!(seats[current_seat], v(2));
        assert_eq!(seats[1 - current_seat], m.opponent);
    }
}

#[test]
fn an_empty_pool_is_an_error_and_a_lonely_current_version_plays_itself() {
    let mut rng = ChaCha8Rng::seed_from_u64(14);
    let mut pool = Pool::new(PoolConfig::default()).unwrap();
    for config in [
        SamplerConfig::Mirror,
        SamplerConfig::Lagged { k: 1 },
        mixture(),
    ] {
        assert_eq!(
            sampler(config).sample(&pool, &mut rng),
            Err(SampleError::NoCurrentVersion)
        );
    }
    pool.add_version(PolicyVersion {
        version: 1,
        parent: None,
        weights_ref: "w1".into(),
    })
    .unwrap();
    for (config, kind) in [
        (
            SamplerConfig::Uniform {
                include_fixed: true,
            },
            SamplerKind::Uniform,
        ),
        (
            SamplerConfig::MatchQuality {
                temperature: 1.0,
                floor: 0.0,
                include_fixed: true,
            },
            SamplerKind::MatchQuality,
        ),
        (
            SamplerConfig::LeastPlayed {
                include_fixed: true,
            },
            SamplerKind::LeastPlayed,
        ),
    ] {
        let m = sampler(config).sample(&pool, &mut rng).unwrap();
        assert_eq!(
            (m.opponent, m.sampler, m.fallback_to_mirror),
            (v(1), kind, true)
        );
    }
}

#[test]
fn configs_parse_with_defaults_and_invalid_ones_name_the_path() {
    let parsed: SamplerConfig = serde_json::from_str(
        r#"{"kind": "mixture", "components": [
            {"weight": 0.5, "sampler": {"kind": "mirror"}},
            {"weight": 0.5, "sampler": {"kind": "match_quality", "temperature": 0.5}},
            {"weight": 1, "sampler": {"kind": "fixed", "opponents": [{"opponent": "minimax", "weight": 2}, {"opponent": "v3", "weight": 1}]}}
        ]}"#,
    )
    .unwrap();
    let SamplerConfig::Mixture { components } = &parsed else {
        panic!("{parsed:?}")
    };
    assert_eq!(
        components[1].sampler,
        SamplerConfig::MatchQuality {
            temperature: 0.5,
            floor: 0.0,
            include_fixed: true
        }
    );
    let SamplerConfig::Fixed { opponents, .. } = &components[2].sampler else {
        panic!("{parsed:?}")
    };
    assert_eq!(opponents[1].opponent, v(3));
    OpponentSampler::new(parsed.clone()).unwrap();
    let round_trip: SamplerConfig =
        serde_json::from_str(&serde_json::to_string(&parsed).unwrap()).unwrap();
    assert_eq!(round_trip, parsed);

    assert!(
        serde_json::from_str::<SamplerConfig>(r#"{"kind": "lagged", "k": 2, "kk": 1}"#).is_err()
    );
    assert!(serde_json::from_str::<SamplerConfig>(r#"{"kind": "elo"}"#).is_err());

    for (config, path) in [
        (
            SamplerConfig::Mixture {
                components: vec![MixtureComponent {
                    weight: 1.0,
                    sampler: SamplerConfig::MatchQuality {
                        temperature: 0.0,
                        floor: 0.0,
                        include_fixed: true,
                    },
                }],
            },
            "components[0].sampler.temperature",
        ),
        (
            SamplerConfig::MatchQuality {
                temperature: 1.0,
                floor: 1.5,
                include_fixed: true,
            },
            "floor",
        ),
        (
            SamplerConfig::Fixed {
                opponents: vec![],
                moves_first: None,
            },
            "opponents",
        ),
        (
            SamplerConfig::Fixed {
                opponents: vec![WeightedOpponent {
                    opponent: fixed("random"),
                    weight: -1.0,
                }],
                moves_first: None,
            },
            "opponents[0].weight",
        ),
        (
            SamplerConfig::Fixed {
                opponents: vec![WeightedOpponent {
                    opponent: fixed("random"),
                    weight: 1.0,
                }],
                moves_first: Some(1.0),
            },
            "moves_first",
        ),
        (SamplerConfig::Mixture { components: vec![] }, "components"),
    ] {
        let err = OpponentSampler::new(config).unwrap_err();
        assert_eq!(err.path, path, "{err}");
    }
}
