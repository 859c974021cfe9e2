//! The run checked against its env: message sizes and nats-server's
//! payload, and what self-play and league games of a multi-agent env
//! allow.

use super::*;

/// A 4x84x84 uint8 image env with 4 discrete actions (Atari's shape).
fn atari_spec() -> relay_envs::EnvSpec {
    relay_envs::EnvSpec {
        id: "ALE/Breakout-v5",
        image: Some([4, 84, 84]),
        observation_space: relay_envs::BoxSpace {
            low: vec![0.0; 4 * 84 * 84],
            high: vec![255.0; 4 * 84 * 84],
        },
        action_space: relay_envs::ActionSpace::Discrete { n: 4 },
        ..relay_envs::spec("CartPole-v1").unwrap()
    }
}

#[test]
fn relay_s_nats_server_is_sized_to_the_largest_message_of_the_run() {
    let with = |overrides: &[&str]| {
        let overrides: Vec<String> = overrides.iter().map(|s| s.to_string()).collect();
        ExperimentConfig::from_layers(BASE, "t", &[], &overrides).unwrap()
    };
    let atari = atari_spec();
    let frame_stack = 4 * 84 * 84;
    // 8 envs x 32 steps of uint8 frame stacks: about 7.3 MB of fragment.
    let ppo = with(&[
        "policy.cnn={}",
        "policy.hidden=[]",
        "env_runner.num_envs=8",
        "env_runner.fragment_steps=32",
    ]);
    ppo.check_env(&atari).unwrap();
    assert_eq!(ppo.observation_bytes(&atari), frame_stack);
    let bytes = ppo.largest_message_bytes(&atari);
    assert!(
        bytes > 8 * 32 * frame_stack && bytes < 8 * 35 * frame_stack,
        "{bytes}"
    );
    assert_eq!(ppo.nats_max_payload(&atari), 8 << 20);
    // Any size is accepted: past 64 MiB the env-runner splits fragments.
    let huge = with(&[
        "policy.cnn={}",
        "policy.hidden=[]",
        "env_runner.num_envs=64",
        "env_runner.fragment_steps=512",
    ]);
    huge.check_env(&atari).unwrap();
    assert_eq!(
        huge.nats_max_payload(&atari),
        relay_proto::MAX_MESSAGE_BYTES
    );
    // CartPole needs no more than nats-server's default.
    let flat = relay_envs::spec("CartPole-v1").unwrap();
    assert_eq!(
        with(&[]).nats_max_payload(&flat),
        relay_proto::DEFAULT_MAX_PAYLOAD
    );
    // Taxi's one-hot Discrete(500) at 16 envs x 128 steps: 4.2 MB.
    let taxi = relay_envs::EnvSpec {
        observation_space: relay_envs::BoxSpace {
            low: vec![0.0; 500],
            high: vec![1.0; 500],
        },
        ..flat.clone()
    };
    let wide = with(&["env_runner.num_envs=16", "env_runner.fragment_steps=128"]);
    wide.check_env(&taxi).unwrap();
    assert_eq!(wide.nats_max_payload(&taxi), 5 << 20);
    // An observation no message can carry is refused, naming the env.
    let giant = relay_envs::EnvSpec {
        image: None,
        observation_space: relay_envs::BoxSpace {
            low: vec![0.0; 8 << 20],
            high: vec![1.0; 8 << 20],
        },
        ..flat
    };
    let e = with(&[]).check_env(&giant).unwrap_err().to_string();
    assert!(
        e.contains("run.env_id") && e.contains("does not fit"),
        "{e}"
    );
    // A game whose agents take turns is trained by self-play, with what
    // self-play supports only.
    let game = relay_envs::EnvSpec {
        id: "tictactoe_v3",
        agents: vec!["player_1".into(), "player_2".into()],
        team: Vec::new(),
        action_mask: true,
        observation_space: relay_envs::BoxSpace {
            low: vec![0.0; 18],
            high: vec![1.0; 18],
        },
        action_space: relay_envs::ActionSpace::Discrete { n: 9 },
        ..relay_envs::spec("CartPole-v1").unwrap()
    };
    with(&[]).check_env(&game).unwrap();
    with(&["selfplay.opponents.minimax=0.5", "run.algo=dqn"])
        .check_env(&game)
        .unwrap();
    for (set, field, says) in [
        (
            "normalize.obs=true",
            "normalize",
            "tictactoe_v3 is a game of 2 agents (player_1, player_2)",
        ),
        ("env_runner.pace=true", "env_runner.pace", "turn it off"),
    ] {
        let e = with(&[set]).check_env(&game).unwrap_err().to_string();
        assert!(e.contains(field) && e.contains(says), "{set}: {e}");
    }
    let connect_four = relay_envs::EnvSpec {
        id: "connect_four_v3",
        ..game.clone()
    };
    let e = with(&["selfplay.opponents.minimax=1"])
        .check_env(&connect_four)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("selfplay.opponents.minimax") && e.contains("cannot play connect_four_v3"),
        "{e}"
    );
    // A league of past versions and bots: two-player games, bots that play
    // the game, and the bots of selfplay.opponents are pool members.
    let league = with(&[
        "selfplay.opponents.league=0.7",
        "league.fixed=[random, minimax]",
    ]);
    assert!(league.league_enabled());
    league.check_env(&game).unwrap();
    assert!(!with(&[]).league_enabled());
    let e = league.check_env(&connect_four).unwrap_err().to_string();
    assert!(
        e.contains("league.fixed[1]") && e.contains("cannot play connect_four_v3"),
        "{e}"
    );
    let three_seats = relay_envs::EnvSpec {
        agents: vec!["a".into(), "b".into(), "c".into()],
        team: Vec::new(),
        ..game.clone()
    };
    let e = league.check_env(&three_seats).unwrap_err().to_string();
    assert!(
        e.contains("selfplay.opponents.league") && e.contains("two-player games only"),
        "{e}"
    );
    let e = with(&["selfplay.opponents.random=1"])
        .check_env(&relay_envs::spec("CartPole-v1").unwrap())
        .unwrap_err()
        .to_string();
    assert!(e.contains("selfplay") && e.contains("CartPole-v1"), "{e}");
    for (set, says) in [
        ("selfplay.opponents.alphazero=1", "unknown opponent"),
        ("selfplay.opponents.mirror=-1", "must be finite and >= 0"),
        ("selfplay.opponents.mirror=0", "needs a positive weight"),
    ] {
        let e = ExperimentConfig::from_layers(BASE, "t", &[], &[set.into()])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("selfplay.opponents") && e.contains(says),
            "{set}: {e}"
        );
    }
    // A saved checkpoint as a fixed opponent: a folder that holds one.
    let dir = std::env::temp_dir().join(format!("relay-config-ckpt-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let with_checkpoint = |folder: &std::path::Path| {
        let text = format!(
            "{BASE}selfplay:\n  opponents: {{mirror: 1, 'checkpoint:{}': 1}}\nleague:\n  fixed: ['checkpoint:{}']\n",
            folder.display(),
            folder.display()
        );
        ExperimentConfig::from_layers(&text, "t", &[], &[])
    };
    let e = with_checkpoint(&dir).unwrap_err().to_string();
    assert!(
        e.contains("league.fixed[0]") && e.contains("not a checkpoint folder (no config.yaml)"),
        "{e}"
    );
    std::fs::write(dir.join("config.yaml"), "").unwrap();
    std::fs::write(dir.join("model.safetensors"), "").unwrap();
    let config = with_checkpoint(&dir).unwrap();
    let name = format!("checkpoint:{}", dir.display());
    assert!(config.selfplay.bots().any(|b| b == name));
    assert!(matches!(
        config.league_fixed()[0].kind,
        relay_league::FixedKind::Checkpoint { .. }
    ));
    std::fs::remove_dir_all(&dir).unwrap();
}
