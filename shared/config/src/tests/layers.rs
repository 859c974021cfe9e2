//! Loading a config: the layers (file, environment, flags), errors that
//! name the field, the algorithms `run.algo` knows, the shipped configs.

use super::*;

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
