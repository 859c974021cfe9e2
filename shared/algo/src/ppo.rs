//! PPO, top to bottom: a prepared rollout in, one policy update out.
//!
//! 1. [`crate::rollout::prepare`]: values from the current critic, then GAE
//!    per env column (bootstrapping through truncation, never through
//!    termination).
//! 2. [`update`]: `epochs` passes of shuffled minibatches: clipped surrogate,
//!    optional value clipping, entropy bonus, advantage normalisation per
//!    minibatch, global gradient-norm clipping, Adam; optional early stop
//!    when approx KL exceeds 1.5 x `target_kl`. Learning rate, clip range
//!    and entropy coefficient follow their schedules over training progress.
//!
//! With learner replicas (`relay_replicas`) each takes its part of every
//! minibatch: advantages are normalised over the whole minibatch first,
//! each part's loss and statistics are weighted by its share of it, and
//! the gradients and statistics are summed across replicas before the
//! clipped step, so every replica steps (and stops early) alike.
//!
//! Hyperparameters are the fields of [`relay_config::PpoConfig`], each
//! documented there.

use rand::seq::SliceRandom;
use relay_config::PpoConfig;
use relay_nn::{ppo_loss, PpoInputs, PpoLossConfig};
use relay_proto::MetricValue;
use relay_proto::{counter, gauge};

use crate::optimizer::Optimizer;
use crate::rollout::{Rollout, UpdateError};
use relay_nn::ActorCritic;
use relay_nn::BatchShare;

/// What one update did, averaged over its gradient steps.
#[derive(Debug, Clone, Default)]
pub struct UpdateStats {
    pub policy_loss: f64,
    pub value_loss: f64,
    pub entropy: f64,
    pub total_loss: f64,
    pub approx_kl: f64,
    /// mean(old log-prob - new log-prob), the plain KL(old || new) estimator.
    pub kl: f64,
    pub clip_fraction: f64,
    pub value_clip_fraction: f64,
    pub ratio_mean: f64,
    pub ratio_var: f64,
    pub grad_norm: f64,
    pub explained_variance: f64,
    pub learning_rate: f64,
    pub clip_range: f64,
    pub ent_coef: f64,
    pub gradient_steps: u64,
    pub epochs_done: usize,
    pub kl_early_stop: bool,
}

impl UpdateStats {
    /// The learner metrics of this update.
    pub fn metrics(&self) -> Vec<MetricValue> {
        vec![
            gauge("learner_policy_loss", self.policy_loss),
            gauge("learner_value_loss", self.value_loss),
            gauge("learner_entropy", self.entropy),
            gauge("learner_total_loss", self.total_loss),
            gauge("learner_approx_kl", self.approx_kl),
            gauge("learner_kl", self.kl),
            gauge("learner_clip_fraction", self.clip_fraction),
            gauge("learner_value_clip_fraction", self.value_clip_fraction),
            gauge("learner_ratio_mean", self.ratio_mean),
            gauge("learner_ratio_var", self.ratio_var),
            gauge("learner_explained_variance", self.explained_variance),
            gauge("learner_grad_norm", self.grad_norm),
            gauge("learner_learning_rate", self.learning_rate),
            gauge("learner_clip_range", self.clip_range),
            gauge("learner_ent_coef", self.ent_coef),
            gauge("learner_epochs", self.epochs_done as f64),
            counter(
                "learner_kl_early_stops_total",
                self.kl_early_stop as u8 as f64,
            ),
        ]
    }
}

/// The per-minibatch statistics summed across replicas, in this order.
const SUMMED_STATS: usize = 11;

/// Epochs of minibatch gradient steps on a prepared rollout at training
/// progress `progress` (`env_steps / budget`), this replica's part of each
/// minibatch as `sync` says ([`relay_nn::BatchShare::whole`]: all of it).
pub fn update(
    model: &ActorCritic,
    optimizer: &mut Optimizer,
    rollout: &Rollout,
    cfg: &PpoConfig,
    progress: f64,
    rng: &mut impl rand::Rng,
    sync: &mut BatchShare<'_>,
) -> Result<UpdateStats, UpdateError> {
    let learning_rate = cfg.learning_rate_schedule().value(progress);
    let clip_range = cfg.clip_range_schedule().value(progress);
    let ent_coef = cfg.ent_coef.value(progress);
    optimizer.set_lr(learning_rate);
    // Advantages are normalised here, over the whole minibatch, before it
    // is split among replicas.
    let loss_config = PpoLossConfig {
        clip_range,
        clip_range_vf: cfg.clip_range_vf,
        vf_coef: cfg.vf_coef,
        ent_coef,
        normalize_advantage: false,
    };
    let share = (sync.rank, sync.replicas);
    let mut stats = UpdateStats {
        learning_rate,
        clip_range,
        ent_coef,
        explained_variance: relay_nn::explained_variance(&rollout.old_values, &rollout.returns)
            as f64,
        ..Default::default()
    };
    // Minibatches of rows, or for a recurrent policy of whole sequences
    // (`minibatch_size` steps' worth, at least one sequence).
    let mut units: Vec<usize> = (0..rollout.units()).collect();
    let minibatch = (cfg.minibatch_size.min(rollout.len) / rollout.unit_len()).max(1);
    // Each minibatch's normalised advantages, by row.
    let mut normalized = rollout.advantages.clone();
    'epochs: for _ in 0..cfg.epochs {
        units.shuffle(rng);
        let mut epoch_kls = Vec::new();
        for chunk in units.chunks(minibatch) {
            // A whole update can take minutes (a CNN on CPU): a stop is
            // seen between two gradient steps.
            if sync.stopping() {
                return Err(UpdateError::Stopped);
            }
            let gather = |rows: &[usize], src: &[f32]| -> Vec<f32> {
                rows.iter().map(|&j| src[j]).collect()
            };
            let chunk_rows = rollout.rows_of(chunk);
            let m = chunk_rows.len();
            if cfg.normalize_advantage {
                let values = relay_nn::normalize(&gather(&chunk_rows, &rollout.advantages));
                for (&row, v) in chunk_rows.iter().zip(values) {
                    normalized[row] = v;
                }
            }
            let mine_units = sync.part(chunk);
            let mine = rollout.rows_of(mine_units);
            let weight = mine.len() as f64 / m as f64;
            // Weighted by this part's share: summed over replicas they are
            // the whole minibatch's means (ratio: its first two moments).
            let mut summed = [0f32; SUMMED_STATS];
            let loss = if mine.is_empty() {
                None
            } else {
                let (old_logprob, old_values) = (
                    gather(&mine, &rollout.old_logprobs),
                    gather(&mine, &rollout.old_values),
                );
                let returns = gather(&mine, &rollout.returns);
                let advantages = gather(&mine, &normalized);
                let (logprob, entropy, values) = rollout.evaluate(model, mine_units, &mine)?;
                // The plain estimator of KL(old || new), beside the loss's approx_kl.
                let kl = logprob
                    .to_vec1::<f32>()?
                    .iter()
                    .zip(&old_logprob)
                    .map(|(new, old)| (old - new) as f64)
                    .sum::<f64>()
                    / mine.len() as f64;
                let loss = ppo_loss(
                    &loss_config,
                    &PpoInputs {
                        logprob: &logprob,
                        entropy: &entropy,
                        values: &values,
                        old_logprob: &old_logprob,
                        old_values: &old_values,
                        advantages: &advantages,
                        returns: &returns,
                    },
                )?;
                let s = &loss.stats;
                let ratio_sq = s.ratio_var as f64 + (s.ratio_mean as f64).powi(2);
                for (slot, value) in summed.iter_mut().zip([
                    s.policy_loss as f64,
                    s.value_loss as f64,
                    s.entropy as f64,
                    s.loss as f64,
                    s.approx_kl as f64,
                    kl,
                    s.clip_fraction as f64,
                    s.value_clip_fraction as f64,
                    s.ratio_mean as f64,
                    ratio_sq,
                    1.0,
                ]) {
                    *slot = (value * weight) as f32;
                }
                Some(if share.1 == 1 {
                    loss.loss
                } else {
                    (loss.loss * weight)?
                })
            };
            let grad_norm = optimizer.minimise_shared(
                loss.as_ref(),
                Some(cfg.max_grad_norm),
                sync,
                &mut summed,
            )?;

            let [policy_loss, value_loss, entropy, total_loss, approx_kl, kl, clip_fraction, value_clip_fraction, ratio_mean, ratio_sq, covered] =
                summed.map(f64::from);
            BatchShare::check_covered(covered as f32)?;
            stats.policy_loss += policy_loss;
            stats.value_loss += value_loss;
            stats.entropy += entropy;
            stats.total_loss += total_loss;
            stats.approx_kl += approx_kl;
            stats.kl += kl;
            stats.clip_fraction += clip_fraction;
            stats.value_clip_fraction += value_clip_fraction;
            stats.ratio_mean += ratio_mean;
            stats.ratio_var += (ratio_sq - ratio_mean * ratio_mean).max(0.0);
            stats.grad_norm += grad_norm;
            stats.gradient_steps += 1;
            epoch_kls.push(approx_kl);
        }
        stats.epochs_done += 1;
        if let Some(target) = cfg.target_kl {
            let kl = epoch_kls.iter().sum::<f64>() / epoch_kls.len().max(1) as f64;
            if kl > 1.5 * target {
                stats.kl_early_stop = true;
                break 'epochs;
            }
        }
    }
    let steps = stats.gradient_steps.max(1) as f64;
    for v in [
        &mut stats.policy_loss,
        &mut stats.value_loss,
        &mut stats.entropy,
        &mut stats.total_loss,
        &mut stats.approx_kl,
        &mut stats.kl,
        &mut stats.clip_fraction,
        &mut stats.value_clip_fraction,
        &mut stats.ratio_mean,
        &mut stats.ratio_var,
        &mut stats.grad_norm,
    ] {
        *v /= steps;
    }
    Ok(stats)
}
