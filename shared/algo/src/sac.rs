//! SAC's gradient step on a sampled batch (the learner's round runs it
//! `gradient_steps` times; see the learner's `sac` module for the whole
//! algorithm), and its settings from the `sac` section.

use rand_chacha::ChaCha8Rng;
use relay_config::{EntCoef, SacSection};
use relay_nn::{
    sac_train_step_part, BatchShare, Pair, Sac, SacBatch, SacConfig, SacOptimizers, SacStats,
};
use relay_proto::TransitionBatch;

use crate::StepError;

/// The gradient step's settings from the `sac` section, for an actor of
/// `action_dim` dimensions at learning rate `lr`.
pub fn step_config(
    cfg: &SacSection,
    action_dim: usize,
    lr: f64,
) -> Result<SacConfig, relay_config::ConfigError> {
    Ok(SacConfig {
        tau: cfg.tau as f32,
        auto_entropy: matches!(cfg.ent_coef()?, EntCoef::Auto { .. }),
        target_entropy: Some(cfg.target_entropy_for(action_dim)? as f32),
        lr,
        update_target: true,
    })
}

/// The initial entropy coefficient α (`"auto"`: 1, `"auto_<x>"`: x, fixed: itself).
pub fn initial_ent_coef(cfg: &SacSection) -> Result<f64, relay_config::ConfigError> {
    Ok(match cfg.ent_coef()? {
        EntCoef::Auto { initial } => initial,
        EntCoef::Fixed(v) => v,
    })
}

/// One SAC gradient step on a sampled batch (actions in env units,
/// `[B, action_dim]`); a batch of the wrong shape is an error naming the
/// field, never a panic. With learner replicas (`relay_replicas`) every
/// replica holds the batch and takes its part of the rows; each of the
/// three optimizers' gradients is summed across replicas before its step
/// ([`relay_nn::sac_train_step_part`]).
pub fn gradient_step(
    step: &SacConfig,
    sac: &Sac,
    optimizers: &mut SacOptimizers,
    batch: &TransitionBatch,
    rng: &mut ChaCha8Rng,
    pair: &Pair,
    sync: &mut BatchShare<'_>,
) -> Result<SacStats, StepError> {
    let field = |field: &'static str, e: relay_proto::TensorError| StepError::Batch {
        field,
        detail: e.to_string(),
    };
    let obs = batch
        .obs
        .observations_to_f32()
        .map_err(|e| field("obs", e))?;
    let next_obs = batch
        .next_obs
        .observations_to_f32()
        .map_err(|e| field("next_obs", e))?;
    let actions = batch.actions.to_f32().map_err(|e| field("actions", e))?;
    let returns = batch.rewards.to_f32().map_err(|e| field("rewards", e))?;
    let discounts = batch
        .discounts
        .to_f32()
        .map_err(|e| field("discounts", e))?;
    Ok(sac_train_step_part(
        step,
        sac,
        optimizers,
        &SacBatch {
            obs: &obs,
            actions: &actions,
            returns: &returns,
            next_obs: &next_obs,
            discounts: &discounts,
        },
        rng,
        pair,
        sync,
    )?)
}
