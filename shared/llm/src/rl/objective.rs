//! The RL objective as pure functions of rewards and logits (the
//! formulas of [`super`]'s module docs): [`compute_advantages`] (with the
//! [`MovingBaselines`] state), [`kl_estimate`], and the loss of one
//! micro-batch, [`rl_loss`], over an [`RlMicroBatch`] built from
//! [`RlRow`]s, with its parts as [`LossSums`].
//!
//! Its own file because the maths is tested by hand and reads apart from
//! the trainer ([`super::RlTrainer`]: truncation, micro-batching,
//! replicas, optimizer steps), which calls it; re-exported in [`super`].

use std::collections::BTreeMap;

use candle_core::{Device, Tensor};

use super::{
    by_key, AdvantageEstimator, Baseline, KlEstimator, KlMode, ObjectiveConfig, PolicyLoss,
    RatioLevel,
};
use crate::token_batch::{target_log_probs, Aggregation, BatchTotals, TokenBatch};
use crate::train_error::{TrainError, TrainResult};

/// The [`Baseline::MovingAverage`] state: the average of each stratum
/// seen so far.
pub type MovingBaselines = BTreeMap<u64, f64>;

/// Per-sequence advantages of `rewards` (with their `groups` and
/// `strata`), by `estimator`. `moving` is the [`Baseline::MovingAverage`]
/// state (empty before the first batch).
pub fn compute_advantages(
    estimator: &AdvantageEstimator,
    rewards: &[f64],
    groups: &[u64],
    strata: &[u64],
    moving: &MovingBaselines,
) -> TrainResult<Vec<f64>> {
    if rewards.len() != groups.len() || rewards.len() != strata.len() {
        return Err(TrainError::BadInput(format!(
            "{} rewards for {} group ids and {} strata",
            rewards.len(),
            groups.len(),
            strata.len()
        )));
    }
    let all_equal = |idx: &[usize]| idx.iter().all(|&i| rewards[i] == rewards[idx[0]]);
    let mean = |idx: &[usize]| idx.iter().map(|&i| rewards[i]).sum::<f64>() / idx.len() as f64;
    let mut adv = vec![0.0; rewards.len()];
    match *estimator {
        AdvantageEstimator::Reinforce { baseline } => {
            let all: Vec<usize> = (0..rewards.len()).collect();
            let batch_baseline = |idx: &[usize]| {
                if idx.is_empty() {
                    0.0
                } else if all_equal(idx) {
                    rewards[idx[0]]
                } else {
                    mean(idx)
                }
            };
            match baseline {
                Baseline::None => adv.copy_from_slice(rewards),
                Baseline::BatchMean => {
                    let b = batch_baseline(&all);
                    for (a, r) in adv.iter_mut().zip(rewards) {
                        *a = r - b;
                    }
                }
                Baseline::MovingAverage { .. } => {
                    for (stratum, idx) in by_key(strata) {
                        let b = moving
                            .get(&stratum)
                            .copied()
                            .unwrap_or_else(|| batch_baseline(&idx));
                        for i in idx {
                            adv[i] = rewards[i] - b;
                        }
                    }
                }
            }
        }
        AdvantageEstimator::Rloo | AdvantageEstimator::Grpo { .. } => {
            for idx in by_key(groups).values() {
                // Equal rewards: exactly zero (the arithmetic below may round).
                if idx.len() < 2 || all_equal(idx) {
                    continue;
                }
                let g = idx.len() as f64;
                let m = mean(idx);
                match *estimator {
                    AdvantageEstimator::Rloo => {
                        let sum: f64 = idx.iter().map(|&i| rewards[i]).sum();
                        for &i in idx {
                            adv[i] = rewards[i] - (sum - rewards[i]) / (g - 1.0);
                        }
                    }
                    AdvantageEstimator::Grpo {
                        scale_by_std,
                        std_eps,
                    } => {
                        let scale = if scale_by_std {
                            let var = idx.iter().map(|&i| (rewards[i] - m).powi(2)).sum::<f64>()
                                / (g - 1.0);
                            1.0 / (var.sqrt() + std_eps)
                        } else {
                            1.0
                        };
                        for &i in idx {
                            adv[i] = (rewards[i] - m) * scale;
                        }
                    }
                    AdvantageEstimator::Reinforce { .. } => unreachable!("handled above"),
                }
            }
        }
    }
    Ok(adv)
}

/// Per-token KL estimate `(tokens,)` between `logp` and `ref_logp`
/// (see [`KlEstimator`]); differentiable in both.
pub fn kl_estimate(
    estimator: KlEstimator,
    logp: &Tensor,
    ref_logp: &Tensor,
) -> TrainResult<Tensor> {
    let d = (ref_logp - logp)?;
    Ok(match estimator {
        KlEstimator::K1 => d.neg()?,
        KlEstimator::K2 => (d.sqr()? * 0.5)?,
        KlEstimator::K3 => {
            let d = d.clamp(-20f32, 20f32)?;
            ((d.exp()? - &d)? - 1.0)?
        }
    })
}

/// One sequence of an [`RlMicroBatch`].
#[derive(Debug, Clone, Copy)]
pub struct RlRow<'a> {
    /// Prompt tokens (after truncation).
    pub prompt: &'a [u32],
    /// Completion tokens.
    pub completion: &'a [u32],
    /// Behaviour log-prob per completion token.
    pub behaviour_logprobs: &'a [f32],
    /// The learner's log-prob per completion token before the batch's
    /// first step (epochs after the first); `None`: the current
    /// forward's, detached (the first epoch).
    pub learner_logprobs: Option<&'a [f32]>,
    /// The sequence's advantage.
    pub advantage: f64,
}

/// One micro-batch with everything [`rl_loss`] needs besides logits.
#[derive(Debug, Clone)]
pub struct RlMicroBatch {
    /// The token block and its completion positions.
    pub tokens: TokenBatch,
    /// `(tokens,)` each token's sequence advantage.
    pub advantages: Tensor,
    /// `(tokens,)` aggregation weights.
    pub weights: Tensor,
    /// `(rows, tokens)`: `1/L_i` where token belongs to row `i`.
    row_mean: Tensor,
    /// `(tokens,)` u32 row of each token.
    token_rows: Tensor,
    advantage_values: Vec<f32>,
    behaviour_values: Vec<f32>,
    /// The rows' [`RlRow::learner_logprobs`], when every row has them.
    learner_values: Option<Vec<f32>>,
}

impl RlMicroBatch {
    /// Builds a micro-batch; `totals` are the whole optimizer batch's.
    pub fn new(
        rows: &[RlRow<'_>],
        aggregation: &Aggregation,
        totals: BatchTotals,
        device: &Device,
    ) -> TrainResult<Self> {
        for (i, r) in rows.iter().enumerate() {
            if r.behaviour_logprobs.len() != r.completion.len() {
                return Err(TrainError::BadInput(format!(
                    "row {i}: {} behaviour log-probs for {} completion tokens",
                    r.behaviour_logprobs.len(),
                    r.completion.len()
                )));
            }
            if let Some(learner) = r.learner_logprobs {
                if learner.len() != r.completion.len() {
                    return Err(TrainError::BadInput(format!(
                        "row {i}: {} learner log-probs for {} completion tokens",
                        learner.len(),
                        r.completion.len()
                    )));
                }
            }
        }
        let learner_values: Option<Vec<f32>> = rows
            .iter()
            .map(|r| r.learner_logprobs)
            .collect::<Option<Vec<_>>>()
            .map(|rows| rows.concat());
        let pairs: Vec<(&[u32], &[u32])> = rows.iter().map(|r| (r.prompt, r.completion)).collect();
        let tokens = TokenBatch::new(&pairs, device)?;
        let n = tokens.num_tokens();
        let behaviour_values: Vec<f32> = rows
            .iter()
            .flat_map(|r| r.behaviour_logprobs.iter().copied())
            .collect();
        let advantage_values: Vec<f32> = tokens
            .token_rows
            .iter()
            .map(|&r| rows[r as usize].advantage as f32)
            .collect();
        let mut row_mean = vec![0f32; rows.len() * n];
        for (t, &r) in tokens.token_rows.iter().enumerate() {
            row_mean[r as usize * n + t] = 1.0 / tokens.completion_lens[r as usize] as f32;
        }
        Ok(Self {
            weights: tokens.token_weights(aggregation, totals)?,
            advantages: Tensor::from_vec(advantage_values.clone(), n, device)?,
            row_mean: Tensor::from_vec(row_mean, (rows.len(), n), device)?,
            token_rows: Tensor::from_vec(tokens.token_rows.clone(), n, device)?,
            tokens,
            advantage_values,
            behaviour_values,
            learner_values,
        })
    }
}

/// Sums over tokens (or the loss parts, already weighted) of one or more
/// micro-batches.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct LossSums {
    /// Total loss (policy + KL loss − entropy bonus).
    pub loss: f64,
    /// The policy part of the loss.
    pub policy_loss: f64,
    /// Completion tokens.
    pub tokens: usize,
    /// `Σ k` of the KL estimator against the reference (KL loss mode).
    pub kl: f64,
    /// `Σ H` of the token entropies.
    pub entropy: f64,
    /// Tokens whose gradient the PPO clip removed.
    pub clipped: usize,
    /// `Σ (ρ − 1 − log ρ)`, `ρ = exp(logp − old)`: KL(behaviour ‖ current).
    pub approx_kl: f64,
    /// `Σ |cur − old|`: the learner's log-probs before the batch's first
    /// step against the sampler's.
    pub sampler_abs_diff: f64,
    /// `max |cur − old|`.
    pub sampler_max_abs_diff: f64,
    /// Tokens whose importance weight the [`TruncatedIs`](super::TruncatedIs) cap cut.
    pub tis_capped: usize,
    /// `Σ ρ` and `Σ ρ²` of the token ratios `ρ = exp(logp − old)` to the
    /// policy PPO's clip compares with (the sampler's, or the learner's
    /// first epoch with truncated IS), whatever the policy loss.
    pub ratio: f64,
    pub ratio_sq: f64,
}

impl std::ops::AddAssign for LossSums {
    fn add_assign(&mut self, o: Self) {
        self.loss += o.loss;
        self.policy_loss += o.policy_loss;
        self.tokens += o.tokens;
        self.kl += o.kl;
        self.entropy += o.entropy;
        self.clipped += o.clipped;
        self.approx_kl += o.approx_kl;
        self.sampler_abs_diff += o.sampler_abs_diff;
        self.sampler_max_abs_diff = self.sampler_max_abs_diff.max(o.sampler_max_abs_diff);
        self.tis_capped += o.tis_capped;
        self.ratio += o.ratio;
        self.ratio_sq += o.ratio_sq;
    }
}

/// The loss of one micro-batch: `loss` to call `backward()` on, and its
/// parts as numbers.
#[derive(Debug)]
pub struct RlLoss {
    /// Scalar, differentiable.
    pub loss: Tensor,
    /// Values for the stats.
    pub sums: LossSums,
    /// The current log-prob of each completion token, rows in order.
    pub logprobs: Vec<f32>,
}

fn scalar(t: &Tensor) -> TrainResult<f64> {
    Ok(t.to_dtype(candle_core::DType::F64)?.to_scalar::<f64>()?)
}

/// The RL loss of one micro-batch (module docs) from the policy's logits
/// `(rows, time, vocab)` and, for a KL loss, the reference's (gradients
/// never flow into them). Either may instead be the logits at the
/// completion positions only, `(tokens, vocab)`
/// ([`CausalLm::forward_train_batch`](crate::CausalLm::forward_train_batch)), as the
/// trainer computes them.
pub fn rl_loss(
    objective: &ObjectiveConfig,
    logits: &Tensor,
    reference_logits: Option<&Tensor>,
    batch: &RlMicroBatch,
) -> TrainResult<RlLoss> {
    let tokens = &batch.tokens;
    let n = tokens.num_tokens();
    let completion = tokens.completion_logits(logits)?;
    let logp = target_log_probs(&completion, &tokens.targets)?;
    let logp_values: Vec<f32> = logp.to_vec1()?;
    let device = logp.device();
    let w = &batch.weights;
    let adv = &batch.advantages;

    let mut sums = LossSums {
        tokens: n,
        ..Default::default()
    };
    for (lp, old) in logp_values.iter().zip(&batch.behaviour_values) {
        let log_ratio = f64::from(lp - old);
        sums.approx_kl += log_ratio.exp() - 1.0 - log_ratio;
    }
    // The learner's old policy: the first epoch's log-probs, or this
    // forward's (the first epoch itself).
    let learner_old = batch.learner_values.as_deref().unwrap_or(&logp_values);
    let mut tis_weights = Vec::with_capacity(n);
    for (cur, old) in learner_old.iter().zip(&batch.behaviour_values) {
        let diff = f64::from(cur - old);
        sums.sampler_abs_diff += diff.abs();
        sums.sampler_max_abs_diff = sums.sampler_max_abs_diff.max(diff.abs());
        if let Some(tis) = objective.truncated_is {
            let weight = diff.exp();
            if weight > tis.cap {
                sums.tis_capped += 1;
            }
            tis_weights.push(weight.min(tis.cap) as f32);
        }
    }
    // PPO's old policy: the sampler's, or with truncated IS the learner's
    // (its first epoch, or this forward in the first epoch).
    let old_values: &[f32] = match (&objective.truncated_is, &batch.learner_values) {
        (None, _) => &batch.behaviour_values,
        (Some(_), Some(values)) => values,
        (Some(_), None) => &logp_values,
    };
    for (lp, old) in logp_values.iter().zip(old_values) {
        let ratio = f64::from(lp - old).exp();
        sums.ratio += ratio;
        sums.ratio_sq += ratio * ratio;
    }
    let ppo_old = Tensor::from_slice(old_values, n, device)?;

    let per_token = match objective.policy_loss {
        PolicyLoss::PolicyGradient => (&logp * adv)?.neg()?,
        PolicyLoss::PpoClip {
            clip_low,
            clip_high,
            ratio,
        } => {
            let log_ratio = (&logp - &ppo_old)?;
            let ratio_t = match ratio {
                RatioLevel::Token => log_ratio.exp()?,
                RatioLevel::Sequence => batch
                    .row_mean
                    .matmul(&log_ratio.unsqueeze(1)?)?
                    .squeeze(1)?
                    .exp()?
                    .index_select(&batch.token_rows, 0)?,
            };
            let ratios: Vec<f32> = ratio_t.to_vec1()?;
            let (lo, hi) = ((1.0 - clip_low) as f32, (1.0 + clip_high) as f32);
            let mut keep = vec![1f32; n];
            let mut clipped_part = vec![0f32; n];
            for t in 0..n {
                let (r, a) = (ratios[t], batch.advantage_values[t]);
                // min(ρA, clip(ρ)A) picks the constant clipped term exactly here.
                if (a > 0.0 && r > hi) || (a < 0.0 && r < lo) {
                    keep[t] = 0.0;
                    clipped_part[t] = -(r.clamp(lo, hi) * a);
                    sums.clipped += 1;
                }
            }
            let keep = Tensor::from_vec(keep, n, device)?;
            let clipped_part = Tensor::from_vec(clipped_part, n, device)?;
            ((ratio_t * (adv * keep)?)?.neg()? + clipped_part)?
        }
    };
    let per_token = if objective.truncated_is.is_some() {
        (per_token * Tensor::from_vec(tis_weights, n, device)?)?
    } else {
        per_token
    };
    let policy_loss = (per_token * w)?.sum_all()?;
    sums.policy_loss = scalar(&policy_loss)?;
    let mut loss = policy_loss;

    if let Some(kl) = objective.kl.filter(|k| k.mode == KlMode::Loss) {
        let reference = reference_logits
            .ok_or_else(|| TrainError::BadInput("a KL loss needs the reference logits".into()))?;
        let ref_completion = tokens.completion_logits(&reference.detach())?;
        let ref_logp = target_log_probs(&ref_completion, &tokens.targets)?;
        let k = kl_estimate(kl.estimator, &logp, &ref_logp.detach())?;
        sums.kl = scalar(&k.sum_all()?)?;
        if kl.coef != 0.0 {
            loss = (loss + ((k * w)?.sum_all()? * kl.coef)?)?;
        }
    }

    let entropy = crate::train_ops::entropy(&completion)?;
    sums.entropy = scalar(&entropy.sum_all()?)?;
    if objective.entropy_coef != 0.0 {
        loss = (loss - ((entropy * w)?.sum_all()? * objective.entropy_coef)?)?;
    }
    sums.loss = scalar(&loss)?;
    if !sums.loss.is_finite() {
        return Err(TrainError::NonFinite {
            what: "loss",
            value: sums.loss,
        });
    }
    Ok(RlLoss {
        loss,
        sums,
        logprobs: logp_values,
    })
}
