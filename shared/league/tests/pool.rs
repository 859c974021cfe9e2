//! The model pool: rating inheritance with widened sigma, result recording,
//! bounding, serde round-trips and the checks on stored state.

use relay_league::{
    FixedKind, FixedOpponent, MemberId, Outcome, PolicyVersion, Pool, PoolConfig, PoolError,
    Rating, TrueSkill, TrueSkillError,
};

fn policy(version: u64, parent: Option<u64>) -> PolicyVersion {
    PolicyVersion {
        version,
        parent,
        weights_ref: format!("weights/{version}.safetensors"),
    }
}

fn v(version: u64) -> MemberId {
    MemberId::Version(version)
}

fn fixed(name: &str) -> MemberId {
    MemberId::Fixed(name.to_string())
}

fn rating(pool: &Pool, id: &MemberId) -> Rating {
    pool.get(id).unwrap().rating
}

fn versions(pool: &Pool) -> Vec<u64> {
    pool.versions().collect()
}

#[test]
fn a_new_version_inherits_its_parents_mu_with_a_widened_capped_sigma() {
    let config = PoolConfig {
        sigma_widen: 1.5,
        ..PoolConfig::default()
    };
    let env = config.trueskill;
    let mut pool = Pool::new(config).unwrap();
    pool.add_version(policy(1, None)).unwrap();
    assert_eq!(rating(&pool, &v(1)), env.new_rating());
    pool.add_fixed(FixedOpponent {
        name: "random".into(),
        kind: FixedKind::Random,
    })
    .unwrap();
    for _ in 0..20 {
        pool.record_result(&v(1), &fixed("random"), Outcome::Win)
            .unwrap();
    }
    let parent = rating(&pool, &v(1));
    assert!(parent.mu > env.mu && parent.sigma.hypot(1.5) < env.sigma);

    pool.add_version(policy(2, Some(1))).unwrap();
    assert_eq!(
        rating(&pool, &v(2)),
        Rating::new(parent.mu, (parent.sigma.powi(2) + 1.5f64.powi(2)).sqrt())
    );

    // A parent still uncertain: the widened sigma is capped at sigma0.
    pool.add_version(policy(3, None)).unwrap();
    pool.add_version(policy(4, Some(3))).unwrap();
    assert_eq!(rating(&pool, &v(4)), Rating::new(env.mu, env.sigma));

    // A parent not in the pool: the prior.
    pool.add_version(policy(5, Some(99))).unwrap();
    assert_eq!(rating(&pool, &v(5)), env.new_rating());

    assert_eq!(
        pool.add_version(policy(5, None)),
        Err(PoolError::DuplicateVersion(5))
    );
}

#[test]
fn record_result_rates_like_trueskill_and_counts_per_pair() {
    let mut pool = Pool::new(PoolConfig::default()).unwrap();
    let env = pool.config().trueskill;
    pool.add_version(policy(1, None)).unwrap();
    pool.add_fixed(FixedOpponent {
        name: "minimax".into(),
        kind: FixedKind::Minimax { depth: Some(4) },
    })
    .unwrap();
    let (a, b) = (v(1), fixed("minimax"));
    let results = [
        (&a, &b, Outcome::Win),
        (&b, &a, Outcome::Win),
        (&a, &b, Outcome::Draw),
        (&b, &a, Outcome::Loss),
        (&a, &b, Outcome::Loss),
    ];
    let mut want_a = env.new_rating();
    let mut want_b = env.new_rating();
    for (first, second, outcome) in results {
        let rated = pool.record_result(first, second, outcome).unwrap();
        assert_eq!(rated.rating_error, None);
        let (new_a, new_b) = if first == &a {
            env.rate_1vs1(want_a, want_b, outcome).unwrap()
        } else {
            let (new_b, new_a) = env.rate_1vs1(want_b, want_a, outcome).unwrap();
            (new_a, new_b)
        };
        want_a = new_a;
        want_b = new_b;
        assert_eq!(rating(&pool, &a), want_a);
        assert_eq!(rating(&pool, &b), want_b);
    }
    // v1's record: wins in results 1 and 4, draw in 3, losses in 2 and 5.
    let record = pool.record(&a, &b);
    assert_eq!((record.wins, record.draws, record.losses), (2, 1, 2));
    assert_eq!(pool.record(&b, &a), record.flipped());
    assert_eq!(pool.games_between(&b, &a), 5);

    // Mirror games are counted, not rated.
    let before = rating(&pool, &a);
    let rated = pool.record_result(&a, &a, Outcome::Win).unwrap();
    assert_eq!((rated.a_after, rated.b_after), (before, before));
    assert_eq!(rating(&pool, &a), before);
    assert_eq!(pool.games_between(&a, &a), 1);

    // Unknown members change nothing.
    let snapshot = pool.clone();
    assert_eq!(
        pool.record_result(&a, &v(7), Outcome::Win).unwrap_err(),
        PoolError::UnknownMember(v(7))
    );
    assert_eq!(pool, snapshot);
}

#[test]
fn a_result_too_extreme_to_rate_is_still_counted() {
    let mut pool = Pool::new(PoolConfig::default()).unwrap();
    pool.add_version(policy(1, None)).unwrap();
    pool.add_fixed(FixedOpponent {
        name: "random".into(),
        kind: FixedKind::Random,
    })
    .unwrap();
    let mut state: serde_json::Value = serde_json::to_value(&pool).unwrap();
    // Far beyond what double precision can rate as an upset.
    state["members"]["v1"]["rating"] = serde_json::json!({ "mu": 400.0, "sigma": 1.0 });
    state["members"]["random"]["rating"] = serde_json::json!({ "mu": 0.0, "sigma": 1.0 });
    let mut pool: Pool = serde_json::from_value(state).unwrap();
    let before = rating(&pool, &v(1));
    let rated = pool
        .record_result(&fixed("random"), &v(1), Outcome::Win)
        .unwrap();
    assert!(matches!(
        rated.rating_error,
        Some(TrueSkillError::Precision(_))
    ));
    assert_eq!(rating(&pool, &v(1)), before);
    assert_eq!(pool.record(&v(1), &fixed("random")).losses, 1);
}

#[test]
fn the_pool_keeps_the_latest_the_pinned_and_the_best() {
    let config = PoolConfig {
        keep_latest: 3,
        keep_best: 1,
        ..PoolConfig::default()
    };
    let mut pool = Pool::new(config).unwrap();
    pool.add_fixed(FixedOpponent {
        name: "random".into(),
        kind: FixedKind::Random,
    })
    .unwrap();
    pool.add_fixed(FixedOpponent {
        name: "old-sft".into(),
        kind: FixedKind::Adapter {
            path: "adapters/sft".into(),
        },
    })
    .unwrap();
    for version in 1..=3 {
        assert!(pool
            .add_version(policy(version, version.checked_sub(1).filter(|p| *p > 0)))
            .unwrap()
            .is_empty());
    }
    // v2 becomes clearly the best: many wins against everyone.
    for _ in 0..30 {
        for other in [v(1), v(3), fixed("random"), fixed("old-sft")] {
            pool.record_result(&v(2), &other, Outcome::Win).unwrap();
        }
    }
    // The first version is pinned (`keep_first`), the others are not.
    assert!(pool.get(&v(1)).unwrap().pinned);
    assert!(!pool.get(&v(2)).unwrap().pinned);
    let mut evicted_all = Vec::new();
    for version in 4..=9 {
        // New versions start from the prior so v2 stays the best.
        let evicted = pool.add_version(policy(version, None)).unwrap();
        evicted_all.extend(evicted.iter().map(|member| member.version().unwrap()));
    }
    // Latest 3 (7, 8, 9) + pinned (1) + best (2); 3..=6 evicted in order.
    assert_eq!(versions(&pool), vec![1, 2, 7, 8, 9]);
    assert_eq!(evicted_all, vec![3, 4, 5, 6]);
    assert!(pool.get(&fixed("random")).is_some() && pool.get(&fixed("old-sft")).is_some());
    assert_eq!(pool.leaderboard()[0].0.id(), v(2));
    // Records of evicted members are gone with them.
    assert_eq!(pool.games_between(&v(2), &v(3)), 0);
    assert_eq!(pool.games_between(&v(2), &v(1)), 30);

    // Unpinning v1 evicts it: it is neither recent nor the best.
    let evicted = pool.unpin(1).unwrap();
    assert_eq!(evicted.len(), 1);
    assert_eq!(evicted[0].id(), v(1));
    assert_eq!(pool.games_between(&v(2), &v(1)), 0);

    // Tighter bounds through set_config.
    let evicted = pool
        .set_config(PoolConfig {
            keep_latest: 1,
            keep_best: 0,
            ..*pool.config()
        })
        .unwrap();
    let evicted: Vec<u64> = evicted.iter().filter_map(|m| m.version()).collect();
    assert_eq!(evicted, vec![2, 7, 8]);
    assert_eq!(versions(&pool), vec![9]);
    assert_eq!(pool.current_version(), Some(9));
    assert_eq!(pool.len(), 3);

    // Without keep_first the first version is evicted like any other.
    let mut pool = Pool::new(PoolConfig {
        keep_latest: 1,
        keep_best: 0,
        keep_first: false,
        ..PoolConfig::default()
    })
    .unwrap();
    pool.add_version(policy(1, None)).unwrap();
    let evicted = pool.add_version(policy(2, Some(1))).unwrap();
    assert_eq!(evicted[0].id(), v(1));
    assert_eq!(versions(&pool), vec![2]);
}

#[test]
fn fixed_opponents_are_validated_and_removable() {
    let mut pool = Pool::new(PoolConfig::default()).unwrap();
    for bad in ["", "v12", " random"] {
        let err = pool
            .add_fixed(FixedOpponent {
                name: bad.into(),
                kind: FixedKind::Random,
            })
            .unwrap_err();
        assert!(matches!(err, PoolError::InvalidFixedName { .. }), "{bad:?}");
    }
    let ckpt = FixedOpponent {
        name: "ckpt-1000".into(),
        kind: FixedKind::Checkpoint {
            path: "runs/a/ckpt-1000".into(),
        },
    };
    pool.add_fixed(ckpt.clone()).unwrap();
    assert_eq!(
        pool.add_fixed(ckpt.clone()),
        Err(PoolError::DuplicateFixed("ckpt-1000".into()))
    );
    assert_eq!(pool.current_version(), None);
    let removed = pool.remove_fixed("ckpt-1000").unwrap();
    assert_eq!(removed.kind, relay_league::MemberKind::Fixed(ckpt));
    assert!(pool.is_empty());
}

#[test]
fn member_ids_are_strings_both_ways() {
    for (text, id) in [
        ("v0", v(0)),
        ("v12", v(12)),
        ("minimax", fixed("minimax")),
        ("v", fixed("v")),
        ("v1x", fixed("v1x")),
    ] {
        assert_eq!(text.parse::<MemberId>().unwrap(), id);
        assert_eq!(id.to_string(), text);
        assert_eq!(serde_json::to_string(&id).unwrap(), format!("\"{text}\""));
    }
    assert!("".parse::<MemberId>().is_err());
}

#[test]
fn configs_are_validated_with_the_field_named() {
    for (config, field) in [
        (
            PoolConfig {
                keep_latest: 0,
                ..PoolConfig::default()
            },
            "keep_latest",
        ),
        (
            PoolConfig {
                sigma_widen: -1.0,
                ..PoolConfig::default()
            },
            "sigma_widen",
        ),
        (
            PoolConfig {
                conservative_k: f64::NAN,
                ..PoolConfig::default()
            },
            "conservative_k",
        ),
        (
            PoolConfig {
                trueskill: TrueSkill {
                    tau: -0.1,
                    ..TrueSkill::default()
                },
                ..PoolConfig::default()
            },
            "trueskill.tau",
        ),
    ] {
        let err = Pool::new(config).unwrap_err();
        assert!(
            matches!(&err, PoolError::InvalidConfig { field: f, .. } if f == field),
            "{err}"
        );
    }
    // Partial configs take defaults; unknown fields are rejected.
    let config: PoolConfig =
        serde_json::from_str(r#"{"keep_latest": 4, "trueskill": {"beta": 4.0}}"#).unwrap();
    assert_eq!(config.keep_latest, 4);
    assert_eq!(config.trueskill.beta, 4.0);
    assert_eq!(config.trueskill.mu, 25.0);
    assert!(serde_json::from_str::<PoolConfig>(r#"{"keep_lastest": 4}"#).is_err());
}

fn busy_pool() -> Pool {
    let mut pool = Pool::new(PoolConfig {
        keep_latest: 4,
        ..PoolConfig::default()
    })
    .unwrap();
    pool.add_fixed(FixedOpponent {
        name: "random".into(),
        kind: FixedKind::Random,
    })
    .unwrap();
    pool.add_fixed(FixedOpponent {
        name: "minimax".into(),
        kind: FixedKind::Minimax { depth: None },
    })
    .unwrap();
    for version in 1..=6 {
        pool.add_version(policy(version, Some(version - 1)))
            .unwrap();
        let outcomes = [Outcome::Win, Outcome::Draw, Outcome::Loss];
        pool.record_result(&v(version), &fixed("random"), Outcome::Win)
            .unwrap();
        pool.record_result(
            &fixed("minimax"),
            &v(version),
            outcomes[version as usize % 3],
        )
        .unwrap();
        if version > 1 {
            pool.record_result(&v(version), &v(version - 1), Outcome::Draw)
                .unwrap();
        }
    }
    pool.pin(3).unwrap();
    pool
}

#[test]
fn the_pool_round_trips_through_json_and_messagepack() {
    let pool = busy_pool();
    let json = serde_json::to_string(&pool).unwrap();
    assert_eq!(serde_json::from_str::<Pool>(&json).unwrap(), pool);
    let packed = rmp_serde::to_vec(&pool).unwrap();
    assert_eq!(rmp_serde::from_slice::<Pool>(&packed).unwrap(), pool);
    let named = rmp_serde::to_vec_named(&pool).unwrap();
    assert_eq!(rmp_serde::from_slice::<Pool>(&named).unwrap(), pool);
}

#[test]
fn an_inconsistent_stored_pool_is_rejected() {
    let pool = busy_pool();
    let state = serde_json::to_value(&pool).unwrap();

    let mut unknown = state.clone();
    unknown["records"]["v5"]["v99"] = serde_json::json!({"wins": 1, "draws": 0, "losses": 0});
    assert!(serde_json::from_value::<Pool>(unknown)
        .unwrap_err()
        .to_string()
        .contains("v99"));

    let mut misfiled = state.clone();
    let member = misfiled["members"]["v5"].clone();
    misfiled["members"]["v77"] = member;
    assert!(serde_json::from_value::<Pool>(misfiled).is_err());

    let mut bad_config = state;
    bad_config["config"]["keep_latest"] = serde_json::json!(0);
    assert!(serde_json::from_value::<Pool>(bad_config)
        .unwrap_err()
        .to_string()
        .contains("keep_latest"));
}
