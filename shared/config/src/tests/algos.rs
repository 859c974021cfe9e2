//! The algorithm sections (`a2c`, `reinforce`, `dqn`, `sac`): their
//! defaults and checks, hyperparameter schedules, and the off-policy
//! rate limiter's fit with the learner's schedule.

use super::*;

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

/// `auto` holds an off-policy run to its own schedule's ratio (SB3's one
/// gradient step of 256 per env step for SAC), from `learning_starts` on
/// with two fragments of slack; `off` and an on-policy run have no
/// limiter; a saved config's `null` still means none.
#[test]
fn the_replay_ratio_defaults_to_the_algorithms_schedule() {
    let load = |sets: &[&str]| {
        let all: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
        ExperimentConfig::from_layers(BASE, "t", &[], &all).unwrap()
    };
    let sac = load(&[
        "run.env_id=Pendulum-v1",
        "run.algo=sac",
        "sac.learning_starts=100",
        "env_runner.num_envs=4",
        "env_runner.fragment_steps=16",
    ]);
    assert_eq!(sac.replay.samples_per_insert, SamplesPerInsert::Auto);
    let limit = sac
        .rate_limit()
        .expect("an off-policy run is held to its ratio");
    assert_eq!(limit.samples_per_insert, 256.0);
    assert_eq!(limit.min_size_to_sample, 100);
    assert_eq!(limit.error_buffer, 2 * 64 * 256);
    assert!(limit.derived);
    let said = sac.replay_ratio_summary().unwrap();
    assert!(
        said.contains("256 samples per env step") && said.contains("auto: 1 x 256 / 1"),
        "{said}"
    );

    let dqn = load(&["run.algo=dqn", "dqn.train_freq=4", "dqn.batch_size=32"]);
    assert_eq!(dqn.rate_limit().unwrap().samples_per_insert, 8.0);

    let off = load(&[
        "run.env_id=Pendulum-v1",
        "run.algo=sac",
        "replay.samples_per_insert=off",
    ]);
    assert_eq!(off.rate_limit(), None);
    assert!(off.replay_ratio_summary().unwrap().contains("not held"));
    let null = load(&[
        "run.env_id=Pendulum-v1",
        "run.algo=sac",
        "replay.samples_per_insert=null",
    ]);
    assert_eq!(null.replay.samples_per_insert, SamplesPerInsert::Off);

    let ppo = load(&["run.algo=ppo"]);
    assert_eq!(ppo.rate_limit(), None);
    assert_eq!(ppo.replay_ratio_summary(), None);

    let err =
        ExperimentConfig::from_layers(BASE, "t", &[], &["replay.samples_per_insert=fast".into()])
            .unwrap_err()
            .to_string();
    assert!(err.contains("`auto`, `off` or a number"), "{err}");
}
