//! Tests of the text-training sections (`rl`, `lora`, `text`).

use super::*;
#[allow(unused_imports)]
use crate::hyper::policy::TrunkLayout;
#[allow(unused_imports)]
use relay_bridge::EnvSection;
#[allow(unused_imports)]
use std::path::{Path, PathBuf};

const TEXT: &str = "run:\n  env_id: TicTacToe-v0\n";

#[test]
fn rl_presets_are_chosen_by_name_and_a_full_objective_replaces_them() {
    let c = ExperimentConfig::from_layers(TEXT, "test", &[], &[]).unwrap();
    let train = c.rl.train_config(32).unwrap();
    assert_eq!(
        train.objective,
        crate::hyper::objective::ObjectiveConfig::grpo()
    );
    assert_eq!(train.batch.batch_size, c.rl.batch_size);
    let c = ExperimentConfig::from_layers(TEXT, "test", &[], &["rl.preset=rloo".into()]).unwrap();
    assert_eq!(
        c.rl.train_config(32).unwrap().objective,
        crate::hyper::objective::ObjectiveConfig::rloo()
    );
    let c =
        ExperimentConfig::from_layers(TEXT, "test", &[], &["rl.preset=dr_grpo".into()]).unwrap();
    assert_eq!(
        c.rl.train_config(7).unwrap().objective,
        crate::hyper::objective::ObjectiveConfig::dr_grpo(7)
    );
    let full = format!(
        "{TEXT}rl:\n  objective:\n    advantage: {{kind: rloo}}\n    policy_loss: {{kind: policy_gradient}}\n    entropy_coef: 0.01\n"
    );
    let c = ExperimentConfig::from_layers(&full, "test", &[], &[]).unwrap();
    let objective = c.rl.train_config(32).unwrap().objective;
    assert_eq!(objective.entropy_coef, 0.01);
    assert_eq!(
        objective.advantage,
        crate::hyper::objective::AdvantageEstimator::Rloo
    );
    // `rl.truncated_is` applies over the preset.
    let c =
        ExperimentConfig::from_layers(TEXT, "test", &[], &["rl.truncated_is={cap: 2.0}".into()])
            .unwrap();
    let objective = c.rl.train_config(32).unwrap().objective;
    assert_eq!(
        objective.truncated_is,
        Some(crate::hyper::objective::TruncatedIs { cap: 2.0 })
    );
    assert_eq!(
        objective.policy_loss,
        crate::hyper::objective::ObjectiveConfig::grpo().policy_loss
    );
    // `rl.kl` adds a KL term to a preset without one, towards the run's
    // start unless `rl.kl_reference` says the base model.
    let sets = [
        "rl.preset=dr_grpo".into(),
        "rl.kl={coef: 0.05, estimator: k3, mode: loss}".into(),
    ];
    let c = ExperimentConfig::from_layers(TEXT, "test", &[], &sets).unwrap();
    let objective = c.rl.train_config(16).unwrap().objective;
    assert_eq!(
        objective.kl,
        Some(crate::hyper::objective::KlConfig {
            coef: 0.05,
            estimator: crate::hyper::objective::KlEstimator::K3,
            mode: crate::hyper::objective::KlMode::Loss,
        })
    );
    assert_eq!(
        objective.aggregation,
        crate::hyper::objective::ObjectiveConfig::dr_grpo(16).aggregation
    );
    assert_eq!(c.rl.kl_reference, KlReference::Start);
    let c =
        ExperimentConfig::from_layers(TEXT, "test", &[], &["rl.kl_reference=base".into()]).unwrap();
    assert_eq!(c.rl.kl_reference, KlReference::Base);
}

#[test]
fn bad_rl_and_lora_fields_are_named() {
    let err = |set: &str| {
        ExperimentConfig::from_layers(TEXT, "test", &[], &[set.into()])
            .unwrap_err()
            .to_string()
    };
    assert!(err("rl.preset=a2c").contains("rl.preset"));
    assert!(err("rl.batch_size=0").contains("rl.batch_size"));
    assert!(err("rl.max_seq_len=1").contains("max_seq_len"));
    let e = err("rl.truncated_is={cap: 0.5}");
    assert!(e.contains("truncated_is.cap"), "{e}");
    let e = err("rl.kl={coef: -1, estimator: k3, mode: loss}");
    assert!(e.contains("kl.coef"), "{e}");
    let e = err("rl.kl_reference=sft");
    assert!(e.contains("kl_reference"), "{e}");
    for discount in ["0", "1.5"] {
        let e = err(&format!("rl.reward.discount={discount}"));
        assert!(e.contains("rl.reward: config `discount`"), "{e}");
    }
    let e = err("rl.reward.draw=.nan");
    assert!(e.contains("rl.reward: config `draw`"), "{e}");
    assert!(err("lora.rank=0").contains("lora.rank"));
    assert!(err("lora.target_modules=[qkv]").contains("lora.target_modules"));
    assert!(err("weights.inline_max_bytes=99999999").contains("weights.inline_max_bytes"));
    let c = ExperimentConfig::from_layers(
        TEXT,
        "test",
        &[],
        &["lora.target_modules=[q_proj, v_proj]".into()],
    )
    .unwrap();
    let lora = c.lora.lora_config().unwrap();
    assert_eq!(
        lora.targets,
        vec![
            crate::hyper::lora::LoraTarget::QProj,
            crate::hyper::lora::LoraTarget::VProj
        ]
    );
    assert_eq!(lora.scaling(), 2.0);
}
