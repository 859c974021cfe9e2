//! The `policy` section: CNN bodies and their options, checked against
//! the env and the algorithm, and the devices a policy may run on.

use super::*;

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

#[test]
fn image_observations_get_a_cnn_when_the_config_names_none() {
    let with = |overrides: &[&str]| {
        let overrides: Vec<String> = overrides.iter().map(|s| s.to_string()).collect();
        ExperimentConfig::from_layers(BASE, "t", &[], &overrides).unwrap()
    };
    let flat = relay_envs::spec("CartPole-v1").unwrap();
    let image = |shape: [usize; 3]| relay_envs::EnvSpec {
        image: Some(shape),
        observation_space: relay_envs::BoxSpace {
            low: vec![0.0; shape.iter().product()],
            high: vec![255.0; shape.iter().product()],
        },
        ..flat.clone()
    };
    let (minatar, atari) = (image([4, 10, 10]), image([4, 84, 84]));
    let ppo = with(&[]);
    assert_eq!(ppo.policy_cnn(&flat), None);
    // MinAtar's 10x10 is too small for NatureCNN's 8x8/4: MinAtar's own net.
    assert_eq!(
        ppo.policy_cnn(&minatar),
        Some(CnnSpec {
            input: [4, 10, 10],
            ..CnnSpec::minatar()
        })
    );
    ppo.check_env(&minatar).unwrap();
    assert_eq!(
        with(&["run.algo=dqn"]).policy_cnn(&atari),
        Some(CnnSpec {
            input: [4, 84, 84],
            ..CnnSpec::default()
        })
    );
    // The config's own CNN, its input from the env.
    let impala = with(&["policy.cnn={arch: impala}"])
        .policy_cnn(&atari)
        .unwrap();
    assert_eq!((impala.input, impala.features_dim), ([4, 84, 84], 256));
    // Normalized observations are floats an MLP reads well; REINFORCE has no CNN.
    let mut normalized = with(&[]);
    normalized.normalize.obs = true;
    assert_eq!(normalized.policy_cnn(&minatar), None);
    assert_eq!(with(&["run.algo=reinforce"]).policy_cnn(&minatar), None);
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
fn gsde_is_for_actor_critics_on_continuous_actions() {
    let with = |overrides: &[&str]| {
        let overrides: Vec<String> = overrides.iter().map(|s| s.to_string()).collect();
        ExperimentConfig::from_layers(BASE, "t", &[], &overrides)
    };
    let e = with(&["policy.use_sde=true", "run.algo=sac"])
        .unwrap_err()
        .to_string();
    assert!(e.contains("policy.use_sde") && e.contains("sac"), "{e}");
    let c = with(&["policy.use_sde=true", "policy.sde_sample_freq=4"]).unwrap();
    assert_eq!(c.policy.sde_sample_freq, 4);
    let e = c
        .check_env(&relay_envs::spec("CartPole-v1").unwrap())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("policy.use_sde") && e.contains("discrete"),
        "{e}"
    );
    c.check_env(&relay_envs::spec("Pendulum-v1").unwrap())
        .unwrap();
}
