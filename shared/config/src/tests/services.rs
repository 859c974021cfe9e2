//! The services' sections: `learner.replicas` and the tracker's game
//! records.

use super::*;

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
