//! Tests of loading and validating configs.

use super::*;
#[allow(unused_imports)]
use crate::hyper::policy::TrunkLayout;
use crate::hyper::schedule::Schedule;
#[allow(unused_imports)]
use relay_bridge::EnvSection;
#[allow(unused_imports)]
use std::path::{Path, PathBuf};

const BASE: &str = "run:\n  env_id: CartPole-v1\nppo:\n  rollout_steps: 256\n";

#[test]
fn applies_env_then_flag_overrides() {
    let c = ExperimentConfig::from_layers(
        BASE,
        "test",
        &[("ppo.learning_rate".into(), "0.01".into())],
        &["ppo.learning_rate=0.02".into(), "run.id=abc".into()],
    )
    .unwrap();
    assert_eq!(c.ppo.learning_rate, Schedule::constant(0.02));
    assert_eq!(c.run.id.as_deref(), Some("abc"));
}

#[test]
fn a_typo_names_the_field() {
    let err = ExperimentConfig::from_layers(BASE, "test", &[], &["ppo.learnin_rate=1".into()])
        .unwrap_err()
        .to_string();
    assert!(err.contains("learnin_rate"), "{err}");
}

#[test]
fn cnn_policies_are_checked_against_the_env_and_the_algorithm() {
    let with = |overrides: &[&str]| {
        let overrides: Vec<String> = overrides.iter().map(|s| s.to_string()).collect();
        ExperimentConfig::from_layers(BASE, "t", &[], &overrides)
    };
    let err = |r: Result<ExperimentConfig, ConfigError>| r.unwrap_err().to_string();
    let e = err(with(&["policy.cnn={}", "run.algo=sac"]));
    assert!(e.contains("policy.cnn") && e.contains("sac"), "{e}");
    with(&["policy.cnn={}", "policy.hidden=[]", "run.algo=dqn"]).unwrap();
    let e = err(with(&["policy.cnn={input: [1, 2, 3]}"]));
    assert!(e.contains("policy.cnn.input"), "{e}");
    let e = err(with(&["policy.hidden=[]"]));
    assert!(e.contains("policy.hidden"), "{e}");

    let c = with(&["policy.cnn={}", "policy.hidden=[]"]).unwrap();
    let flat = relay_envs::spec("CartPole-v1").unwrap();
    let e = c.check_env(&flat).unwrap_err().to_string();
    assert!(
        e.contains("policy.cnn") && e.contains("flat observations"),
        "{e}"
    );
    let minatar = relay_envs::EnvSpec {
        id: "MinAtar/Breakout-v1",
        image: Some([4, 10, 10]),
        observation_space: relay_envs::BoxSpace {
            low: vec![0.0; 400],
            high: vec![255.0; 400],
        },
        ..flat
    };
    // NatureCNN's 8x8 kernel does not fit a 10x10 image.
    let e = c.check_env(&minatar).unwrap_err().to_string();
    assert!(
        e.contains("policy.cnn.conv") && e.contains("does not fit"),
        "{e}"
    );
    let small = with(&[
        "policy.cnn={conv: [{channels: 16, kernel: 3, stride: 1}], features_dim: 128}",
        "policy.hidden=[]",
    ])
    .unwrap();
    small.check_env(&minatar).unwrap();
    assert!(small.observations_as_pixels(&minatar));
    let mut normalized = small.clone();
    normalized.normalize.obs = true;
    let e = normalized.check_env(&minatar).unwrap_err().to_string();
    assert!(e.contains("normalize.obs"), "{e}");
}

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
fn cnn_arch_selects_the_body_and_its_options() {
    use crate::hyper::policy::{CnnArch, CnnSpec};
    let with = |cnn: &str| {
        ExperimentConfig::from_layers(
            BASE,
            "t",
            &[],
            &[format!("policy.cnn={cnn}"), "policy.hidden=[]".into()],
        )
    };
    let cnn = |s: &str| with(s).unwrap().policy.cnn.unwrap();
    // Every config written before `arch` means what it meant.
    assert_eq!(cnn("{}"), CnnSpec::default());
    let plain = cnn("{conv: [{channels: 16, kernel: 3, stride: 1}], features_dim: 128}");
    assert_eq!(plain.features_dim, 128);
    assert!(matches!(&plain.arch, CnnArch::Nature { conv } if conv.len() == 1));
    assert_eq!(cnn("{arch: nature}"), CnnSpec::default());
    // IMPALA's defaults, and its options.
    assert_eq!(cnn("{arch: impala}"), CnnSpec::impala());
    assert_eq!(CnnSpec::impala().features_dim, 256);
    let wide = cnn("{arch: impala, channels: [32, 64, 64], blocks: 1, features_dim: 512}");
    assert_eq!(
        wide.arch,
        CnnArch::Impala {
            channels: vec![32, 64, 64],
            blocks: 1
        }
    );
    assert_eq!(wide.features_dim, 512);
    // An option of the other architecture, or an unknown one, is refused.
    for (bad, says) in [
        ("{arch: impala, conv: []}", "conv"),
        ("{channels: [16]}", "channels"),
        ("{arch: resnet}", "resnet"),
        ("{arch: impala, chanels: [16]}", "chanels"),
    ] {
        let e = with(bad).unwrap_err().to_string();
        assert!(e.contains(says), "{bad}: {e}");
    }
    let e = with("{arch: impala, channels: [16, 0]}")
        .unwrap_err()
        .to_string();
    assert!(e.contains("policy.cnn.channels"), "{e}");
    // Serialized and read back (a checkpoint's spec) as the same spec.
    for spec in [CnnSpec::default(), wide] {
        let json = serde_json::to_string(&spec).unwrap();
        assert_eq!(
            serde_json::from_str::<CnnSpec>(&json).unwrap(),
            spec,
            "{json}"
        );
    }
    // Any image fits IMPALA: the stacks halve it, rounding up.
    let spec = CnnSpec {
        input: [4, 84, 84],
        ..CnnSpec::impala()
    };
    assert_eq!(
        spec.output_shapes().unwrap(),
        vec![[16, 42, 42], [32, 21, 21], [32, 11, 11]]
    );
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

/// DQN and SAC sample on their own schedule: one fragment must fit the
/// rate limiter's slack above it, or no insert could ever pass.
#[test]
fn the_rate_limiter_admits_a_fragment_beyond_the_learners_schedule() {
    let sac = |sets: &[&str]| {
        let mut all: Vec<String> = [
            "run.env_id=Pendulum-v1",
            "run.algo=sac",
            "replay.samples_per_insert=256",
            "replay.min_size_to_sample=100",
            "replay.rate_error_buffer=8192",
            "sac.learning_starts=100",
            "env_runner.fragment_steps=16",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        all.extend(sets.iter().map(|s| s.to_string()));
        ExperimentConfig::from_layers(BASE, "t", &[], &all)
    };
    // 8,192 / 256: 32 env steps of slack.
    assert!(sac(&["env_runner.num_envs=2"]).is_ok());
    let err = sac(&["env_runner.num_envs=3"]).unwrap_err().to_string();
    assert!(
        err.contains("replay.rate_error_buffer")
            && err.contains("admits 32 env steps")
            && err.contains("set it to at least 12288"),
        "{err}"
    );
    assert!(sac(&["env_runner.num_envs=3", "replay.rate_error_buffer=12288"]).is_ok());
    // What min_size_to_sample holds back beyond learning_starts counts too.
    assert!(sac(&["env_runner.num_envs=3", "sac.learning_starts=80"]).is_ok());
}

#[test]
fn bad_values_name_the_field() {
    let err = ExperimentConfig::from_layers(BASE, "t", &[], &["ppo.gamma=1.5".into()])
        .unwrap_err()
        .to_string();
    assert!(err.contains("ppo.gamma"), "{err}");
    for age in ["0", "-3", ".nan"] {
        let err =
            ExperimentConfig::from_layers(BASE, "t", &[], &[format!("replay.max_age_s={age}")])
                .unwrap_err()
                .to_string();
        assert!(err.contains("replay.max_age_s"), "{age}: {err}");
    }
    // With env.backend auto an id relay lacks goes to Gymnasium, which
    // names it when the env is made (relay_bridge's tests); `builtin`
    // refuses it here.
    let auto = ExperimentConfig::from_layers(BASE, "t", &[], &["run.env_id=Nope-v0".into()]);
    assert!(auto.unwrap().env.uses_python("Nope-v0"));
    let err = ExperimentConfig::from_layers(
        BASE,
        "t",
        &[],
        &["run.env_id=Nope-v0".into(), "env.backend=builtin".into()],
    )
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("run.env_id") && err.contains("Nope-v0"),
        "{err}"
    );
    let err = ExperimentConfig::from_layers(BASE, "t", &[], &["run.id=a.b".into()])
        .unwrap_err()
        .to_string();
    assert!(err.contains("run.id"), "{err}");
}

#[test]
fn learner_replicas_are_counted_for_every_kind_of_run() {
    let with = |overrides: &[&str]| {
        let overrides: Vec<String> = overrides.iter().map(|s| s.to_string()).collect();
        ExperimentConfig::from_layers(BASE, "t", &[], &overrides)
    };
    assert_eq!(with(&[]).unwrap().learner.replicas, 1);
    assert_eq!(with(&["learner.replicas=3"]).unwrap().learner.replicas, 3);
    let err = with(&["learner.replicas=0"]).unwrap_err().to_string();
    assert!(err.contains("learner.replicas"), "{err}");
    for (algo, env) in [("dqn", "CartPole-v1"), ("sac", "Pendulum-v1")] {
        let cfg = with(&[
            &format!("run.algo={algo}"),
            &format!("run.env_id={env}"),
            "learner.replicas=2",
        ])
        .unwrap();
        assert_eq!(cfg.learner.replicas, 2, "{algo}");
    }
    let text = with(&["run.env_id=TicTacToe-v0", "learner.replicas=2"]).unwrap();
    assert_eq!(text.learner.replicas, 2);
}

#[test]
fn normalize_section_defaults_off_resolves_gamma_and_names_bad_fields() {
    let c = ExperimentConfig::from_layers(BASE, "t", &[], &[]).unwrap();
    assert!(!c.normalize.enabled());
    assert_eq!(c.normalizer(), None);
    let c = ExperimentConfig::from_layers(
        BASE,
        "t",
        &[],
        &["normalize.obs=true".into(), "ppo.gamma=0.9".into()],
    )
    .unwrap();
    let n = c.normalizer().unwrap();
    assert!(n.norm_obs && !n.norm_reward);
    assert_eq!(
        (n.clip_obs, n.clip_reward, n.gamma, n.epsilon),
        (10.0, 10.0, 0.9, 1e-8)
    );
    let c = ExperimentConfig::from_layers(
        BASE,
        "t",
        &[],
        &[
            "normalize.reward=true".into(),
            "normalize.gamma=0.5".into(),
            "run.algo=a2c".into(),
            "env_runner.fragment_steps=5".into(),
        ],
    )
    .unwrap();
    assert_eq!(c.normalizer().unwrap().gamma, 0.5);
    for (set, field) in [
        ("normalize.clip_obs=0", "normalize.clip_obs"),
        ("normalize.clip_reward=-1", "normalize.clip_reward"),
        ("normalize.gamma=1.5", "normalize.gamma"),
        ("normalize.epsilon=0", "normalize.epsilon"),
        ("normalize.obss=true", "obss"),
    ] {
        let err = ExperimentConfig::from_layers(BASE, "t", &[], &[set.into()])
            .unwrap_err()
            .to_string();
        assert!(err.contains(field), "{set}: {err}");
    }
    let err = ExperimentConfig::from_layers(
        "run:\n  env_id: TicTacToe-v0\n",
        "t",
        &[],
        &["normalize.reward=true".into()],
    )
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("normalize.reward") && err.contains("text games"),
        "{err}"
    );
    let err = ExperimentConfig::from_layers(
        BASE,
        "t",
        &[],
        &["run.algo=dqn".into(), "normalize.obs=true".into()],
    )
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("normalize.obs") && err.contains("dqn"),
        "{err}"
    );
}

#[test]
fn secrets_never_print_or_serialise() {
    let c = ExperimentConfig::from_layers(
        BASE,
        "t",
        &[
            ("connections.nats_password".into(), "hunter2-nats".into()),
            ("connections.redis_password".into(), "12345".into()),
        ],
        &[
            "connections.nats_user=learner".into(),
            "connections.nats_url=nats://a:pw-in-url@h1:4222,nats://h2:4222".into(),
        ],
    )
    .unwrap();
    assert_eq!(
        c.connections.nats_password.as_ref().unwrap().expose(),
        "hunter2-nats"
    );
    // A numeric-looking secret stays a string.
    assert_eq!(
        c.connections.redis_password.as_ref().unwrap().expose(),
        "12345"
    );
    let yaml = c.to_yaml();
    let debug = format!("{c:?}");
    let json = serde_json::to_string(&c).unwrap();
    for text in [&yaml, &debug, &json] {
        for secret in ["hunter2-nats", "12345", "pw-in-url"] {
            assert!(!text.contains(secret), "{secret} leaked in {text}");
        }
        assert!(text.contains("***"), "{text}");
    }
    assert!(
        yaml.contains("nats://a:***@h1:4222,nats://h2:4222"),
        "{yaml}"
    );
    assert!(yaml.contains("nats_user: learner"), "{yaml}");

    let token = ExperimentConfig::from_layers(
        BASE,
        "t",
        &[("connections.nats_token".into(), "s3cr3t-token".into())],
        &["connections.redis_url=redis://:redispw@r:6379/0".into()],
    )
    .unwrap();
    let text = format!("{token:?}\n{}", token.to_yaml());
    assert!(
        !text.contains("s3cr3t-token") && !text.contains("redispw"),
        "{text}"
    );
    assert!(text.contains("redis://:***@r:6379/0"), "{text}");
}

#[test]
fn redacts_urls() {
    assert_eq!(redact_url("nats://127.0.0.1:4222"), "nats://127.0.0.1:4222");
    assert_eq!(redact_url("nats://u:p@h:1"), "nats://u:***@h:1");
    assert_eq!(redact_url("nats://tok@h:1"), "nats://***@h:1");
    assert_eq!(
        redact_url("redis://u:p@ss@h:6379/0?x=a@b"),
        "redis://u:***@h:6379/0?x=a@b"
    );
}

#[test]
fn incomplete_credentials_name_the_field() {
    let cases = [
        (vec!["connections.nats_user=u"], "connections.nats_password"),
        (vec!["connections.nats_password=p"], "connections.nats_user"),
        (
            vec![
                "connections.nats_user=u",
                "connections.nats_password=p",
                "connections.nats_token=t",
            ],
            "connections.nats_token",
        ),
        (
            vec!["connections.nats_tls_cert=c.pem"],
            "connections.nats_tls_key",
        ),
        (
            vec!["connections.nats_tls_key=k.pem"],
            "connections.nats_tls_cert",
        ),
        (vec!["connections.nats_token="], "connections.nats_token"),
        (
            vec![
                "connections.redis_url=redis://:a@h:1",
                "connections.redis_password=b",
            ],
            "connections.redis_password",
        ),
    ];
    for (sets, field) in cases {
        let sets: Vec<String> = sets.into_iter().map(String::from).collect();
        let err = ExperimentConfig::from_layers(BASE, "t", &[], &sets)
            .unwrap_err()
            .to_string();
        assert!(err.contains(field), "{sets:?}: {err}");
    }
}

const TEXT: &str = "run:\n  env_id: TicTacToe-v0\n";

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

#[test]
fn llm_section_is_validated_by_field() {
    let c = ExperimentConfig::from_layers(
        BASE,
        "t",
        &[],
        &[
            "llm.model=smollm2".into(),
            "llm.gguf_base=quantized".into(),
            "llm.adapters.opponent=adapters/opp".into(),
            "llm.chat_template_kwargs.enable_thinking=false".into(),
        ],
    )
    .unwrap();
    assert_eq!(
        c.llm.chat_template_kwargs["enable_thinking"],
        serde_json::Value::Bool(false)
    );
    assert_eq!(c.llm.gguf_base, GgufBaseName::Quantized);
    assert!(c.serves_llm() && !c.is_text_game());
    assert_eq!(c.llm.adapters["opponent"], PathBuf::from("adapters/opp"));
    let cases = [
        ("llm.max_sequences=0", "llm.max_sequences"),
        ("llm.max_queue=0", "llm.max_queue"),
        ("llm.max_adapters=0", "llm.max_adapters"),
        ("llm.threads=0", "llm.threads"),
        ("llm.model=''", "llm.model"),
        ("llm.gguf_base=q8", "gguf_base"),
        ("llm.adapters.x=''", "llm.adapters.x"),
        ("llm.max_sequence=3", "max_sequence"),
        ("llm.device=cuda", "llm.device"),
        ("llm.device=gpu0", "cuda:N"),
        ("llm.dtype=f8", "dtype"),
        ("llm.backend=vllm", "backend"),
    ];
    for (set, field) in cases {
        let err = ExperimentConfig::from_layers(BASE, "t", &[], &[set.into()])
            .unwrap_err()
            .to_string();
        assert!(err.contains(field), "{set}: {err}");
    }
    let text =
        ExperimentConfig::from_layers(BASE, "t", &[], &["run.env_id=TicTacToe-v0".into()]).unwrap();
    assert!(text.is_text_game() && text.serves_llm());
    let candle = ExperimentConfig::from_layers(
        BASE,
        "t",
        &[],
        &["llm.backend=candle".into(), "llm.dtype=bf16".into()],
    )
    .unwrap();
    assert_eq!(
        candle.llm.backend_spec().dtype,
        crate::hyper::backend::LlmDtype::Bf16
    );
    // `auto` (the default) takes the candle backend for bf16; the engine refuses it.
    let auto = ExperimentConfig::from_layers(BASE, "t", &[], &["llm.dtype=bf16".into()]).unwrap();
    assert_eq!(
        auto.llm.backend_spec().resolved_kind(),
        crate::hyper::backend::BackendKind::Candle
    );
    let err = ExperimentConfig::from_layers(
        BASE,
        "t",
        &[],
        &["llm.backend=engine".into(), "llm.dtype=bf16".into()],
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("llm.dtype"), "{err}");
    // CUDA without the feature: the field, and how to build with it.
    if !crate::hyper::backend::CUDA_BUILT {
        let err = ExperimentConfig::from_layers(
            BASE,
            "t",
            &[],
            &["llm.backend=candle".into(), "llm.device=cuda:0".into()],
        )
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("llm.device") && err.contains("just build-cuda"),
            "{err}"
        );
    }
}

#[test]
fn policy_device_names_what_cannot_work() {
    let err_of = |sets: &[&str]| {
        let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
        ExperimentConfig::from_layers(BASE, "t", &[], &sets)
            .unwrap_err()
            .to_string()
    };
    let err = err_of(&["policy.device=gpu"]);
    assert!(
        err.contains("policy.device") && err.contains("cuda:N"),
        "{err}"
    );
    let err = err_of(&[
        "run.algo=sac",
        "run.env_id=Pendulum-v1",
        "policy.device=cuda",
    ]);
    assert!(
        err.contains("policy.device") && err.contains("SAC"),
        "{err}"
    );
    let err = err_of(&["run.env_id=TicTacToe-v0", "policy.device=cuda:1"]);
    assert!(
        err.contains("policy.device") && err.contains("llm.device"),
        "{err}"
    );
    if !crate::hyper::backend::CUDA_BUILT {
        let err = err_of(&["policy.device=cuda:0"]);
        assert!(
            err.contains("policy.device") && err.contains("just build-cuda"),
            "{err}"
        );
    }
    let cpu = ExperimentConfig::from_layers(BASE, "t", &[], &["policy.device=cpu".into()]).unwrap();
    assert_eq!(cpu.policy.device, crate::hyper::backend::DeviceSpec::Cpu);
}

#[test]
fn unknown_algo_names_run_algo_and_the_known_ones() {
    let err = ExperimentConfig::from_layers(BASE, "t", &[], &["run.algo=td3".into()])
        .unwrap_err()
        .to_string();
    assert!(err.contains("run.algo") && err.contains("\"td3\""), "{err}");
    for algo in Algo::ALL.map(Algo::name) {
        assert!(err.contains(algo), "{err}");
    }
}

#[test]
fn a2c_and_reinforce_sections_have_sb3_defaults_and_checked_fields() {
    let c = ExperimentConfig::from_layers(
        BASE,
        "t",
        &[],
        &["run.algo=a2c".into(), "env_runner.fragment_steps=5".into()],
    )
    .unwrap();
    assert_eq!(c.algo_name(), "a2c");
    let a = &c.a2c;
    assert_eq!((a.n_steps, a.gamma, a.gae_lambda), (5, 0.99, 1.0));
    assert_eq!(a.learning_rate, Schedule::constant(7e-4));
    assert_eq!((a.vf_coef, a.max_grad_norm), (0.5, 0.5));
    assert!(a.use_rms_prop && !a.normalize_advantage);
    assert_eq!((a.rms_prop_alpha, a.rms_prop_eps), (0.99, 1e-5));
    assert_eq!(c.checkpoint_every(), a.checkpoint_every);
    // A2C's rollout is one fragment: the two lengths must agree.
    let err = ExperimentConfig::from_layers(BASE, "t", &[], &["run.algo=a2c".into()])
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("env_runner.fragment_steps") && err.contains("a2c.n_steps"),
        "{err}"
    );
    let err = ExperimentConfig::from_layers(
        BASE,
        "t",
        &[],
        &[
            "run.algo=a2c".into(),
            "env_runner.fragment_steps=100".into(),
            "a2c.n_steps=100".into(),
            "replay.capacity_steps=512".into(),
        ],
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("replay.capacity_steps"), "{err}");
    let r = ExperimentConfig::from_layers(BASE, "t", &[], &["run.algo=reinforce".into()]).unwrap();
    assert_eq!(r.reinforce.baseline, Baseline::Value);
    assert_eq!(r.keep_checkpoints(), r.reinforce.keep_checkpoints);
    let cases = [
        ("a2c.gamma=2", "a2c.gamma"),
        ("a2c.rms_prop_alpha=1", "a2c.rms_prop_alpha"),
        ("a2c.learning_rate=0", "a2c.learning_rate"),
        ("a2c.ent_coef=-0.1", "a2c.ent_coef"),
        ("reinforce.batch_episodes=0", "reinforce.batch_episodes"),
        ("reinforce.baseline=mean", "`value` or `none`"),
        ("reinforce.max_grad_norm=0", "reinforce.max_grad_norm"),
        ("reinforce.lr=1", "lr"),
    ];
    for (set, field) in cases {
        let err = ExperimentConfig::from_layers(BASE, "t", &[], &[set.into()])
            .unwrap_err()
            .to_string();
        assert!(err.contains(field), "{set}: {err}");
    }
}

#[test]
fn dqn_section_has_sb3_defaults_and_checked_fields() {
    let c = ExperimentConfig::from_layers(BASE, "t", &[], &["run.algo=dqn".into()]).unwrap();
    let d = &c.dqn;
    assert_eq!(
        (d.buffer_size, d.learning_starts, d.batch_size),
        (1_000_000, 100, 32)
    );
    assert_eq!(
        (d.train_freq, d.gradient_steps, d.target_update_interval),
        (4, 1, 10_000)
    );
    assert_eq!((d.tau, d.gamma, d.max_grad_norm), (1.0, 0.99, 10.0));
    assert_eq!(d.learning_rate, Schedule::constant(1e-4));
    assert_eq!(c.checkpoint_every(), d.checkpoint_every);
    let table = c.off_policy_table().unwrap();
    assert_eq!(
        (table.capacity, table.n_steps, table.prioritized),
        (1_000_000, 1, false)
    );
    // Epsilon: SB3's linear schedule, constant after exploration_fraction.
    assert_eq!(d.exploration_rate(0.0), 1.0);
    assert!((d.exploration_rate(0.05) - 0.525).abs() < 1e-12);
    assert_eq!(d.exploration_rate(0.1), 0.05);
    assert_eq!(d.exploration_rate(0.7), 0.05);
    let ppo = ExperimentConfig::from_layers(BASE, "t", &[], &[]).unwrap();
    assert!(ppo.off_policy_table().is_none());
    let cases = [
        ("dqn.gamma=1.5", "dqn.gamma"),
        ("dqn.tau=0", "dqn.tau"),
        ("dqn.batch_size=0", "dqn.batch_size"),
        ("dqn.train_freq=0", "dqn.train_freq"),
        (
            "dqn.exploration_final_eps=-0.1",
            "dqn.exploration_final_eps",
        ),
        ("dqn.n_steps=0", "dqn.n_steps"),
        ("dqn.prioritized_alpha=-1", "dqn.prioritized_alpha"),
        ("dqn.prioritized_beta=1.5", "dqn.prioritized_beta"),
        ("dqn.buffer_size=16", "dqn.batch_size"),
        ("dqn.learning_rate=0", "dqn.learning_rate"),
        ("dqn.epsilon=0.1", "epsilon"),
    ];
    for (set, field) in cases {
        let err =
            ExperimentConfig::from_layers(BASE, "t", &[], &["run.algo=dqn".into(), set.into()])
                .unwrap_err()
                .to_string();
        assert!(err.contains(field), "{set}: {err}");
    }
    let err = ExperimentConfig::from_layers(
        BASE,
        "t",
        &[],
        &["run.algo=dqn".into(), "run.env_id=Pendulum-v1".into()],
    )
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("run.algo") && err.contains("discrete"),
        "{err}"
    );
}

const PENDULUM: &str = "run:\n  env_id: Pendulum-v1\n  algo: sac\n";

#[test]
fn sac_section_has_sb3_defaults_and_checked_fields() {
    let c = ExperimentConfig::from_layers(PENDULUM, "t", &[], &[]).unwrap();
    let s = &c.sac;
    assert_eq!(
        (s.buffer_size, s.learning_starts, s.batch_size),
        (1_000_000, 100, 256)
    );
    assert_eq!(
        (s.train_freq, s.gradient_steps, s.target_update_interval),
        (1, 1, 1)
    );
    assert_eq!((s.tau, s.gamma), (0.005, 0.99));
    assert_eq!(s.learning_rate, Schedule::constant(3e-4));
    assert_eq!(s.net_arch, vec![256, 256]);
    assert_eq!((s.log_std_min, s.log_std_max), (-20.0, 2.0));
    assert_eq!(s.ent_coef().unwrap(), EntCoef::Auto { initial: 1.0 });
    assert_eq!(s.target_entropy_for(1).unwrap(), -1.0);
    assert_eq!(c.checkpoint_every(), s.checkpoint_every);
    assert_eq!(c.keep_checkpoints(), s.keep_checkpoints);
    let table = c.off_policy_table().unwrap();
    assert_eq!(
        (
            table.capacity,
            table.n_steps,
            table.prioritized,
            table.gamma
        ),
        (1_000_000, 1, false, 0.99)
    );
    // SB3's spellings of ent_coef and target_entropy.
    let with = |sets: &[&str]| {
        let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
        ExperimentConfig::from_layers(PENDULUM, "t", &[], &sets)
    };
    let c = with(&["sac.ent_coef=auto_0.1", "sac.target_entropy=-3.5"]).unwrap();
    assert_eq!(c.sac.ent_coef().unwrap(), EntCoef::Auto { initial: 0.1 });
    assert_eq!(c.sac.target_entropy_for(1).unwrap(), -3.5);
    let c = with(&["sac.ent_coef=0.2"]).unwrap();
    assert_eq!(c.sac.ent_coef().unwrap(), EntCoef::Fixed(0.2));
    // The written config reads back the same.
    let again = ExperimentConfig::from_layers(&c.to_yaml(), "t", &[], &[]).unwrap();
    assert_eq!(again.sac, c.sac);
    let cases = [
        ("sac.gamma=1.5", "sac.gamma"),
        ("sac.tau=2", "sac.tau"),
        ("sac.batch_size=0", "sac.batch_size"),
        ("sac.train_freq=0", "sac.train_freq"),
        ("sac.gradient_steps=0", "sac.gradient_steps"),
        ("sac.target_update_interval=0", "sac.target_update_interval"),
        ("sac.buffer_size=16", "sac.batch_size"),
        ("sac.learning_rate=0", "sac.learning_rate"),
        ("sac.ent_coef=automatic", "sac.ent_coef"),
        ("sac.ent_coef=auto_-1", "sac.ent_coef"),
        ("sac.ent_coef=0", "sac.ent_coef"),
        ("sac.target_entropy=high", "sac.target_entropy"),
        ("sac.net_arch=[]", "sac.net_arch"),
        ("sac.net_arch=[64, 0]", "sac.net_arch"),
        ("sac.log_std_min=3", "sac.log_std_min"),
        ("sac.use_sde=true", "use_sde"),
        ("normalize.obs=true", "normalize.obs"),
        ("normalize.reward=true", "normalize.reward"),
    ];
    for (set, field) in cases {
        let err = with(&[set]).unwrap_err().to_string();
        assert!(err.contains(field), "{set}: {err}");
    }
    // SAC needs continuous actions: CartPole's are discrete.
    let err = with(&["run.env_id=CartPole-v1"]).unwrap_err().to_string();
    assert!(
        err.contains("run.algo") && err.contains("continuous") && err.contains("CartPole-v1"),
        "{err}"
    );
}

#[test]
fn hyperparameters_take_schedules_and_the_old_shorthand() {
    // The old spelling: a constant plus `linear`.
    let c = ExperimentConfig::from_layers(
        BASE,
        "t",
        &[],
        &[
            "ppo.learning_rate=0.001".into(),
            "ppo.lr_schedule=linear".into(),
            "ppo.clip_schedule=constant".into(),
        ],
    )
    .unwrap();
    let lr = c.ppo.learning_rate_schedule();
    assert_eq!(lr, Schedule::linear(0.001, 0.0));
    assert!((lr.value(0.25) - 0.00075).abs() < 1e-12);
    assert_eq!(c.ppo.clip_range_schedule(), Schedule::constant(0.2));
    // Any shape in place, with warmup and offset, for lr, clip and entropy.
    let text = format!(
        "{BASE}  learning_rate: {{kind: cosine, start: 0.001, end: 0.0, warmup: {{fraction: 0.1}}}}\n  clip_range: {{kind: piecewise_linear, points: [[0.0, 0.3], [0.5, 0.1]]}}\n  ent_coef: {{kind: exponential, start: 0.01, end: 0.0001, offset: 0.5}}\na2c:\n  learning_rate: {{kind: linear, start: 0.0007, end: 0.0}}\n"
    );
    let c = ExperimentConfig::from_layers(&text, "t", &[], &[]).unwrap();
    let lr = c.ppo.learning_rate_schedule();
    assert_eq!(lr.value(0.0), 0.0);
    assert!((lr.value(0.1) - 0.001).abs() < 1e-12);
    assert!((c.ppo.clip_range_schedule().value(0.25) - 0.2).abs() < 1e-12);
    assert!((c.ppo.ent_coef.value(0.75) - 0.001).abs() < 1e-12);
    assert!((c.a2c.learning_rate.value(0.5) - 0.00035).abs() < 1e-12);
    // It round-trips through the YAML written into run directories.
    let back = ExperimentConfig::from_layers(&c.to_yaml(), "t", &[], &[]).unwrap();
    assert_eq!(back, c);
    // `linear` on a schedule map, a negative stretch, a bad shape: refused by name.
    let cases = [
        (
            "ppo.learning_rate={kind: cosine, start: 1, end: 0}",
            Some("ppo.lr_schedule=linear"),
            "ppo.lr_schedule",
        ),
        (
            "ppo.ent_coef={kind: linear, start: 0.01, end: -0.01}",
            None,
            "ppo.ent_coef",
        ),
        (
            "ppo.clip_range={kind: exponential, start: 0.2, end: 0}",
            None,
            "ppo.clip_range",
        ),
        ("ppo.clip_range={kind: step, value: 1}", None, "step"),
    ];
    for (set, extra, field) in cases {
        let mut sets = vec![set.to_string()];
        sets.extend(extra.map(String::from));
        let err = ExperimentConfig::from_layers(BASE, "t", &[], &sets)
            .unwrap_err()
            .to_string();
        assert!(err.contains(field), "{set}: {err}");
    }
}

#[test]
fn shipped_configs_load() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../../configs");
    let mut seen = 0;
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().to_string();
        if name.ends_with(".yaml") && name != "metrics.yaml" {
            ExperimentConfig::load(&path, &[]).unwrap_or_else(|e| panic!("{name}: {e}"));
            seen += 1;
        }
    }
    assert!(seen > 0, "no experiment configs found in {dir}");
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

#[test]
fn tracker_games_settings_default_and_are_checked_by_name() {
    let c = ExperimentConfig::from_layers(BASE, "t", &[], &[]).unwrap();
    assert_eq!(c.tracker.games_train_rate, 0.1);
    assert_eq!(c.tracker.games_eval_rate, 1.0);
    assert_eq!(c.tracker.games_max_bytes, Some(256 << 20));
    let c = ExperimentConfig::from_layers(BASE, "t", &[], &["tracker.games_max_bytes=null".into()])
        .unwrap();
    assert_eq!(c.tracker.games_max_bytes, None);
    for (set, field) in [
        ("tracker.games_train_rate=1.5", "tracker.games_train_rate"),
        ("tracker.games_eval_rate=-0.1", "tracker.games_eval_rate"),
        ("tracker.games_eval_rate=.nan", "tracker.games_eval_rate"),
        ("tracker.games_max_bytes=0", "tracker.games_max_bytes"),
        ("tracker.flush_ms=0", "tracker.flush_ms"),
    ] {
        let e = ExperimentConfig::from_layers(BASE, "t", &[], &[set.into()])
            .unwrap_err()
            .to_string();
        assert!(e.contains(field), "{set}: {e}");
    }
}
