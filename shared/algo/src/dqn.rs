//! DQN's gradient step on a sampled batch (the learner's round runs it
//! `gradient_steps` times; see the learner's `dqn` module for the whole
//! algorithm): the TD loss with (double) DQN targets, Huber, importance
//! weights, a clipped Adam step, and the batch's new priorities.

use relay_config::DqnConfig;
use relay_nn::{
    clip_grad_norm, dqn_loss, Adam, BatchShare, DqnBatch, DqnLossConfig, DqnStats, QNetwork,
};
use relay_proto::TransitionBatch;

use crate::StepError;

/// One gradient step on a sampled batch: the DQN loss, a clipped Adam
/// step. Returns the loss statistics, the gradient norm before clipping
/// and the new priorities `|δ| + eps` of the whole batch.
///
/// With learner replicas (`relay_replicas`) every replica holds the
/// batch and takes its part of the rows (so prioritized replay's sample,
/// drawn once, keeps its distribution); losses, statistics and priorities
/// are weighted and summed across replicas with the gradients.
pub fn gradient_step(
    cfg: &DqnConfig,
    online: &QNetwork,
    target: &QNetwork,
    optimizer: &mut Adam,
    batch: &TransitionBatch,
    sync: &mut BatchShare<'_>,
) -> Result<(DqnStats, f32, Vec<f32>), StepError> {
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
    let actions: Vec<u32> = batch
        .actions
        .to_i64()
        .map_err(|e| field("actions", e))?
        .into_iter()
        .map(|a| u32::try_from(a).unwrap_or(u32::MAX))
        .collect();
    let returns = batch.rewards.to_f32().map_err(|e| field("rewards", e))?;
    let discounts = batch
        .discounts
        .to_f32()
        .map_err(|e| field("discounts", e))?;
    let weights = batch.weights.to_f32().map_err(|e| field("weights", e))?;
    let k = online.spec().n_actions;
    let next_masks = match &batch.next_masks {
        Some(m) if m.shape.last().copied() != Some(k as u32) => {
            return Err(StepError::Batch {
                field: "next_masks",
                detail: format!(
                    "masks of {:?} actions, the Q-network has {k}",
                    m.shape.last()
                ),
            })
        }
        m => m.as_ref().map(|m| &m.data[..]),
    };
    let loss_cfg = DqnLossConfig {
        double_q: cfg.double_q,
        huber_delta: cfg.huber_delta as f32,
    };
    let b = actions.len();
    let d = obs.len() / b.max(1);
    let share = (sync.rank, sync.replicas);
    let rows = sync.rows(b);
    let weight = rows.len() as f64 / b.max(1) as f64;
    // The weighted statistics (loss, Q, target, |δ|, the share itself),
    // then the batch's priorities, each replica writing its own rows'.
    let mut summed = vec![0f32; 5 + b];
    let loss = if rows.is_empty() {
        None
    } else {
        let out = dqn_loss(
            &loss_cfg,
            online,
            target,
            &DqnBatch {
                obs: &obs[rows.start * d..rows.end * d],
                actions: &actions[rows.clone()],
                returns: &returns[rows.clone()],
                next_obs: &next_obs[rows.start * d..rows.end * d],
                discounts: &discounts[rows.clone()],
                weights: Some(&weights[rows.clone()]),
                next_masks: next_masks.map(|m| &m[rows.start * k..rows.end * k]),
            },
        )?;
        let s = &out.stats;
        for (slot, value) in
            summed
                .iter_mut()
                .zip([s.loss, s.q_mean, s.target_mean, s.td_abs_mean, 1.0])
        {
            *slot = (value as f64 * weight) as f32;
        }
        for (slot, td) in summed[5 + rows.start..5 + rows.end]
            .iter_mut()
            .zip(&out.td_errors)
        {
            *slot = td.abs() + cfg.prioritized_eps as f32;
        }
        Some(if share.1 == 1 {
            out.loss
        } else {
            (out.loss * weight).map_err(relay_nn::NnError::from)?
        })
    };
    let mut grads = sync.sum_gradients(
        loss.as_ref()
            .map(candle_core::Tensor::backward)
            .transpose()
            .map_err(relay_nn::NnError::from)?,
        optimizer.vars(),
        &mut summed,
    )?;
    BatchShare::check_covered(summed[4]).map_err(relay_nn::NnError::from)?;
    let norm = clip_grad_norm(&mut grads, optimizer.vars(), cfg.max_grad_norm as f32)?;
    optimizer.step(&grads)?;
    let stats = DqnStats {
        loss: summed[0],
        q_mean: summed[1],
        target_mean: summed[2],
        td_abs_mean: summed[3],
    };
    Ok((stats, norm, summed.split_off(5)))
}
