//! The `normalize` section.

use super::*;

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
