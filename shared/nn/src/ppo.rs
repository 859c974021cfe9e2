//! RL math for PPO: generalized advantage estimation, the clipped surrogate
//! loss with its diagnostics, explained variance, advantage normalisation.
//!
//! Conventions follow Stable-Baselines3's `PPO` (names of hyperparameters,
//! MSE value loss, value clipping as `clip_range_vf`), with CleanRL's
//! `approx_kl` estimator. Terminated and truncated are different things:
//! GAE bootstraps through a time limit, never through a failure.

use candle_core::Tensor;
use serde::{Deserialize, Serialize};

use crate::error::{NnError, Result};
use crate::ops::{precomputed_loss3, with_f32};

/// Generalized advantage estimation over one environment's sequence of `T`
/// consecutive steps (the learner calls it once per env fragment).
///
/// Per step `t`:
/// - `rewards[t]`: reward received after the action at `t`;
/// - `values[t]`: `V(s_t)` recorded when acting;
/// - `next_values[t]`: `V(s_{t+1})` of the observation the step led to — for
///   a truncated step this is `V(final_obs)` (the observation before the
///   reset), for a terminated step it is ignored (use 0). For the last step of
///   a fragment that ends mid-episode it is `V(s_T)`, the bootstrap value;
/// - `terminated[t]`: the episode ended in a terminal state (no future reward);
/// - `ends[t]`: the episode ended at `t` for any reason (`terminated ||
///   truncated`); a `terminated` step counts as an end even if `ends` says not.
///
/// `delta_t = r_t + gamma * next_value_t * (1 - terminated_t) - v_t`,
/// `A_t = delta_t + gamma * lambda * (1 - end_t) * A_{t+1}` with `A_T = 0`,
/// `returns_t = A_t + v_t`. Returns `(advantages, returns)`, `T` each.
pub fn gae(
    rewards: &[f32],
    values: &[f32],
    next_values: &[f32],
    terminated: &[bool],
    ends: &[bool],
    gamma: f32,
    lambda: f32,
) -> Result<(Vec<f32>, Vec<f32>)> {
    let t = rewards.len();
    for (what, len) in [
        ("values", values.len()),
        ("next_values", next_values.len()),
        ("terminated", terminated.len()),
        ("ends", ends.len()),
    ] {
        if len != t {
            return Err(NnError::bad_input(
                what,
                format!("{t} steps (as rewards)"),
                format!("{len}"),
            ));
        }
    }
    let mut adv = vec![0f32; t];
    let mut next_adv = 0f32;
    for i in (0..t).rev() {
        let not_term = if terminated[i] { 0.0 } else { 1.0 };
        let not_end = if terminated[i] || ends[i] { 0.0 } else { 1.0 };
        let delta = rewards[i] + gamma * next_values[i] * not_term - values[i];
        next_adv = delta + gamma * lambda * not_end * next_adv;
        adv[i] = next_adv;
    }
    let returns = adv.iter().zip(values).map(|(a, v)| a + v).collect();
    Ok((adv, returns))
}

/// `(x - mean) / (std + 1e-8)` with the unbiased (n - 1) standard deviation,
/// as SB3 and CleanRL normalise advantages. Fewer than two values are
/// returned unchanged (SB3 skips normalisation for a batch of one).
pub fn normalize(adv: &[f32]) -> Vec<f32> {
    if adv.len() < 2 {
        return adv.to_vec();
    }
    let n = adv.len() as f64;
    let mean = adv.iter().map(|&x| x as f64).sum::<f64>() / n;
    let var = adv.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / (n - 1.0);
    let scale = 1.0 / (var.sqrt() + 1e-8);
    adv.iter()
        .map(|&x| ((x as f64 - mean) * scale) as f32)
        .collect()
}

/// `1 - Var[target - pred] / Var[target]` (population variances), as SB3's
/// `explained_variance`: 1 is a perfect critic, 0 no better than the mean,
/// negative worse. NaN when `target` has zero variance or is empty.
///
/// # Panics
/// If the slices have different lengths.
pub fn explained_variance(pred: &[f32], target: &[f32]) -> f32 {
    assert_eq!(
        pred.len(),
        target.len(),
        "explained_variance: length mismatch"
    );
    let n = target.len() as f64;
    if target.is_empty() {
        return f32::NAN;
    }
    let var = |it: &mut dyn Iterator<Item = f64>| {
        let xs: Vec<f64> = it.collect();
        let mean = xs.iter().sum::<f64>() / n;
        xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / n
    };
    let var_y = var(&mut target.iter().map(|&y| y as f64));
    if var_y == 0.0 {
        return f32::NAN;
    }
    let var_res = var(&mut pred.iter().zip(target).map(|(&p, &y)| y as f64 - p as f64));
    (1.0 - var_res / var_y) as f32
}

/// Hyperparameters of [`ppo_loss`]. Defaults are SB3's PPO defaults.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PpoLossConfig {
    /// Clipping parameter ε of the surrogate: the probability ratio
    /// `π_new / π_old` is clipped to `[1 - ε, 1 + ε]`. Default `0.2`.
    pub clip_range: f64,
    /// Value clipping: when set to `c`, the new value prediction is clipped
    /// to `old_value ± c` before the MSE (SB3's `clip_range_vf`; note this is
    /// SB3's form, not CleanRL's pessimistic max of clipped and unclipped).
    /// Depends on the reward scale. Default `None` (no clipping).
    pub clip_range_vf: Option<f64>,
    /// Weight of the entropy bonus: the loss includes `-ent_coef * mean
    /// entropy`. SB3 default `0.0`; CleanRL uses `0.01` for discrete tasks.
    pub ent_coef: f64,
    /// Weight of the value loss `mean((returns - value)^2)` in the total
    /// loss. Default `0.5`. (CleanRL writes the value loss with an extra 0.5
    /// factor, so its `vf_coef = 0.5` equals `0.25` here.)
    pub vf_coef: f64,
    /// Normalise the advantages of each minibatch to zero mean and unit
    /// standard deviation (see [`normalize`]) before the surrogate. Default `true`.
    pub normalize_advantage: bool,
}

impl Default for PpoLossConfig {
    fn default() -> Self {
        Self {
            clip_range: 0.2,
            clip_range_vf: None,
            ent_coef: 0.0,
            vf_coef: 0.5,
            normalize_advantage: true,
        }
    }
}

impl PpoLossConfig {
    /// Checks ranges; the error names the field.
    pub fn validate(&self) -> Result<()> {
        if !(self.clip_range.is_finite() && self.clip_range > 0.0) {
            return Err(NnError::config(
                "clip_range",
                format!("must be > 0, got {}", self.clip_range),
            ));
        }
        if let Some(c) = self.clip_range_vf {
            if !(c.is_finite() && c > 0.0) {
                return Err(NnError::config(
                    "clip_range_vf",
                    format!("must be > 0 when set, got {c}"),
                ));
            }
        }
        if !self.ent_coef.is_finite() {
            return Err(NnError::config("ent_coef", "must be finite"));
        }
        if !(self.vf_coef.is_finite() && self.vf_coef >= 0.0) {
            return Err(NnError::config(
                "vf_coef",
                format!("must be >= 0, got {}", self.vf_coef),
            ));
        }
        Ok(())
    }
}

/// One minibatch for [`ppo_loss`]; every field has `B` entries.
#[derive(Debug, Clone, Copy)]
pub struct PpoInputs<'a> {
    /// `log π_θ(a|s)` under the current parameters, `[B]`, differentiable
    /// (from [`crate::ActorCritic::evaluate`]).
    pub logprob: &'a Tensor,
    /// Policy entropy at each state, `[B]`, differentiable.
    pub entropy: &'a Tensor,
    /// Current value predictions `V_θ(s)`, `[B]`, differentiable.
    pub values: &'a Tensor,
    /// Log-probabilities recorded when the actions were taken.
    pub old_logprob: &'a [f32],
    /// Values recorded when the actions were taken (for value clipping).
    pub old_values: &'a [f32],
    /// Advantages (from [`gae`]); normalised here if the config says so.
    pub advantages: &'a [f32],
    /// Value targets (`advantages + old values`, from [`gae`]).
    pub returns: &'a [f32],
}

/// Scalar diagnostics of one [`ppo_loss`] evaluation (before the update).
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct PpoStats {
    /// Total loss `policy_loss - ent_coef * entropy + vf_coef * value_loss`.
    pub loss: f32,
    /// Clipped surrogate loss `-mean(min(r A, clip(r, 1±ε) A))`.
    pub policy_loss: f32,
    /// `mean((returns - value_pred)^2)`, `value_pred` clipped if configured.
    pub value_loss: f32,
    /// Mean policy entropy.
    pub entropy: f32,
    /// `mean((r - 1) - ln r)`, the low-variance KL(old || new) estimator (CleanRL).
    pub approx_kl: f32,
    /// Fraction of samples with `|r - 1| > ε`.
    pub clip_fraction: f32,
    /// Fraction of samples whose value prediction was clipped (0 without value clipping).
    pub value_clip_fraction: f32,
    /// Mean probability ratio `r = π_new / π_old`.
    pub ratio_mean: f32,
    /// Population variance of the probability ratio.
    pub ratio_var: f32,
}

/// The output of [`ppo_loss`].
#[derive(Debug, Clone)]
pub struct PpoLoss {
    /// Differentiable scalar total loss; call `.backward()` on it.
    pub loss: Tensor,
    /// Diagnostics.
    pub stats: PpoStats,
}

/// The PPO clipped-surrogate loss with value loss and entropy bonus
/// (SB3's `PPO.train` inner step):
///
/// ```text
/// A      = normalize(advantages)             if normalize_advantage
/// r      = exp(logprob - old_logprob)
/// L_pi   = -mean(min(r A, clip(r, 1 - ε, 1 + ε) A))
/// V'     = old_values + clip(values - old_values, -c, c)   if clip_range_vf = c, else values
/// L_v    = mean((returns - V')^2)
/// loss   = L_pi - ent_coef * mean(entropy) + vf_coef * L_v
/// ```
///
/// The value and its gradient with respect to `logprob`, `entropy` and
/// `values` are computed together in one pass over the minibatch (the
/// gradients where `min` and `clip` select are those of PyTorch); the
/// returned tensor carries that gradient into the graph, so
/// `loss.backward()` reaches the model's vars through those three tensors.
pub fn ppo_loss(config: &PpoLossConfig, inputs: &PpoInputs<'_>) -> Result<PpoLoss> {
    config.validate()?;
    let b = inputs.advantages.len();
    for (what, len) in [
        ("logprob", inputs.logprob.elem_count()),
        ("entropy", inputs.entropy.elem_count()),
        ("values", inputs.values.elem_count()),
        ("old_logprob", inputs.old_logprob.len()),
        ("old_values", inputs.old_values.len()),
        ("returns", inputs.returns.len()),
    ] {
        if len != b {
            return Err(NnError::bad_input(
                what,
                format!("{b} values (as advantages)"),
                len,
            ));
        }
    }
    if b == 0 {
        return Err(NnError::bad_input(
            "advantages",
            "a non-empty minibatch",
            "0 values",
        ));
    }
    let logprob: Vec<f32> = with_f32(inputs.logprob, "ppo_loss", |x| x.to_vec())?;
    let entropy: Vec<f32> = with_f32(inputs.entropy, "ppo_loss", |x| x.to_vec())?;
    let values: Vec<f32> = with_f32(inputs.values, "ppo_loss", |x| x.to_vec())?;
    let adv = if config.normalize_advantage {
        normalize(inputs.advantages)
    } else {
        inputs.advantages.to_vec()
    };

    let n = b as f64;
    let eps = config.clip_range as f32;
    let (lo, hi) = (1.0 - eps, 1.0 + eps);
    let (mut pl, mut vl, mut ent, mut kl, mut clipped, mut vclipped) =
        (0f64, 0f64, 0f64, 0f64, 0usize, 0usize);
    let (mut r_sum, mut r_sq) = (0f64, 0f64);
    let mut d_logprob = vec![0f32; b];
    let mut d_values = vec![0f32; b];
    let d_entropy = vec![(-config.ent_coef / n) as f32; b];
    let pg_scale = (1.0 / n) as f32;
    let v_scale = (2.0 * config.vf_coef / n) as f32;
    for i in 0..b {
        // Policy: surrogate and d/d logprob (d r / d logprob = r).
        let log_ratio = logprob[i] - inputs.old_logprob[i];
        let r = log_ratio.exp();
        let a = adv[i];
        let surr1 = r * a;
        let surr2 = r.clamp(lo, hi) * a;
        pl -= surr1.min(surr2) as f64;
        // The unclipped term carries the gradient when it is the minimum
        // (ties included); the clipped one only inside [1-ε, 1+ε], where
        // it equals the unclipped one. Outside, clip() has zero gradient.
        if surr1 <= surr2 {
            d_logprob[i] = -pg_scale * a * r;
        }
        kl += ((r - 1.0) - log_ratio) as f64;
        if (r - 1.0).abs() > eps {
            clipped += 1;
        }
        r_sum += r as f64;
        r_sq += (r as f64) * (r as f64);
        // Value.
        let (v, old_v, ret) = (values[i], inputs.old_values[i], inputs.returns[i]);
        let (pred, passes) = match config.clip_range_vf {
            None => (v, true),
            Some(c) => {
                let c = c as f32;
                let diff = v - old_v;
                if diff.abs() > c {
                    vclipped += 1;
                }
                (old_v + diff.clamp(-c, c), diff.abs() <= c)
            }
        };
        let err = pred - ret;
        vl += (err as f64) * (err as f64);
        if passes {
            d_values[i] = v_scale * err;
        }
        ent += entropy[i] as f64;
    }
    let policy_loss = pl / n;
    let value_loss = vl / n;
    let mean_entropy = ent / n;
    let loss = policy_loss - config.ent_coef * mean_entropy + config.vf_coef * value_loss;
    let ratio_mean = r_sum / n;
    let stats = PpoStats {
        loss: loss as f32,
        policy_loss: policy_loss as f32,
        value_loss: value_loss as f32,
        entropy: mean_entropy as f32,
        approx_kl: (kl / n) as f32,
        clip_fraction: (clipped as f64 / n) as f32,
        value_clip_fraction: (vclipped as f64 / n) as f32,
        ratio_mean: ratio_mean as f32,
        ratio_var: (r_sq / n - ratio_mean * ratio_mean).max(0.0) as f32,
    };
    let loss = precomputed_loss3(
        [inputs.logprob, inputs.entropy, inputs.values],
        loss as f32,
        [d_logprob, d_entropy, d_values],
    )?;
    Ok(PpoLoss { loss, stats })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: &[f32], b: &[f32], tol: f32) {
        assert_eq!(a.len(), b.len());
        for (x, y) in a.iter().zip(b) {
            assert!((x - y).abs() <= tol, "{a:?} vs {b:?}");
        }
    }

    #[test]
    fn gae_hand_computed_no_ends() {
        // gamma 0.5, lambda 0.5, no episode end: A_t = delta_t + 0.25 A_{t+1}.
        let r = [1.0, 2.0, 3.0];
        let v = [0.5, 1.0, 1.5];
        let nv = [1.0, 1.5, 2.0];
        let (adv, ret) = gae(&r, &v, &nv, &[false; 3], &[false; 3], 0.5, 0.5).unwrap();
        // deltas: 1 + .5 - .5 = 1; 2 + .75 - 1 = 1.75; 3 + 1 - 1.5 = 2.5
        let a2 = 2.5;
        let a1 = 1.75 + 0.25 * a2;
        let a0 = 1.0 + 0.25 * a1;
        close(&adv, &[a0, a1, a2], 1e-6);
        close(&ret, &[a0 + 0.5, a1 + 1.0, a2 + 1.5], 1e-6);
    }

    #[test]
    fn gae_bootstraps_through_truncation_not_termination() {
        let (g, l) = (0.9f32, 0.8f32);
        let r = [1.0, 1.0, 1.0, 1.0];
        let v = [2.0, 3.0, 4.0, 5.0];
        // Step 1 ends the episode: next value 10 (V(final_obs)) if truncated.
        // Step 3 is the fragment's last step, mid-episode: bootstrap V(s_4) = 6.
        let nv = [3.0, 10.0, 5.0, 6.0];
        let ends = [false, true, false, false];

        let (trunc, _) = gae(&r, &v, &nv, &[false; 4], &ends, g, l).unwrap();
        let d3 = 1.0 + g * 6.0 - 5.0;
        let d2 = 1.0 + g * 5.0 - 4.0;
        let d1_trunc = 1.0 + g * 10.0 - 3.0; // bootstraps from V(final_obs)
        let d0 = 1.0 + g * 3.0 - 2.0;
        let a3 = d3;
        let a2 = d2 + g * l * a3;
        let a1 = d1_trunc; // episode boundary: no flow from step 2
        let a0 = d0 + g * l * a1;
        close(&trunc, &[a0, a1, a2, a3], 1e-5);

        let term = [false, true, false, false];
        let (termd, ret) = gae(&r, &v, &nv, &term, &ends, g, l).unwrap();
        let a1_term = 1.0 - 3.0; // reward only; V(next) ignored
        close(&termd, &[d0 + g * l * a1_term, a1_term, a2, a3], 1e-5);
        close(
            &ret,
            &[
                termd[0] + 2.0,
                termd[1] + 3.0,
                termd[2] + 4.0,
                termd[3] + 5.0,
            ],
            1e-6,
        );
        // terminated implies an end even if `ends` disagrees.
        let (t2, _) = gae(&r, &v, &nv, &term, &[false; 4], g, l).unwrap();
        close(&t2, &termd, 1e-6);
        assert!(gae(&r, &v, &nv[..3], &term, &ends, g, l).is_err());
    }

    #[test]
    fn ppo_loss_hand_computed() {
        use candle_core::{Device, Var};
        let dev = &Device::Cpu;
        // ratios 1.5 (clipped to 1.2, no gradient) and 0.5 (unclipped minimum).
        let lp = Var::from_slice(&[1.5f32.ln(), 0.5f32.ln()], 2, dev).unwrap();
        let ent = Var::from_slice(&[0.6f32, 0.4], 2, dev).unwrap();
        let v = Var::from_slice(&[1.0f32, 2.0], 2, dev).unwrap();
        let cfg = PpoLossConfig {
            clip_range: 0.2,
            clip_range_vf: Some(0.3),
            ent_coef: 0.1,
            vf_coef: 0.5,
            normalize_advantage: false,
        };
        let out = ppo_loss(
            &cfg,
            &PpoInputs {
                logprob: &lp,
                entropy: &ent,
                values: &v,
                old_logprob: &[0.0, 0.0],
                old_values: &[0.5, 2.0],
                advantages: &[1.0, 1.0],
                returns: &[2.0, 1.0],
            },
        )
        .unwrap();
        let s = out.stats;
        let kl = ((0.5 - 1.5f64.ln()) + (-0.5 - 0.5f64.ln())) / 2.0;
        // value 0: moved 0.5 > 0.3 from 0.5 -> 0.8, error -1.2; value 1: error 1.
        let expect = [
            (s.policy_loss as f64, -0.85),
            (s.value_loss as f64, 1.22),
            (s.entropy as f64, 0.5),
            (s.approx_kl as f64, kl),
            (s.clip_fraction as f64, 1.0),
            (s.value_clip_fraction as f64, 0.5),
            (s.ratio_mean as f64, 1.0),
            (s.ratio_var as f64, 0.25),
            (s.loss as f64, -0.85 - 0.1 * 0.5 + 0.5 * 1.22),
        ];
        for (i, (g, e)) in expect.iter().enumerate() {
            assert!((g - e).abs() < 1e-6, "stat {i}: {g} vs {e} ({s:?})");
        }
        assert!((out.loss.to_scalar::<f32>().unwrap() - s.loss).abs() < 1e-7);
        let grads = out.loss.backward().unwrap();
        let g = |x: &Var| grads.get(x).unwrap().to_vec1::<f32>().unwrap();
        close(&g(&lp), &[0.0, -0.25], 1e-6);
        close(&g(&ent), &[-0.05, -0.05], 1e-7);
        close(&g(&v), &[0.0, 0.5], 1e-6);
        // Mismatched lengths are refused.
        let bad = PpoInputs {
            logprob: &lp,
            entropy: &ent,
            values: &v,
            old_logprob: &[0.0],
            old_values: &[0.5, 2.0],
            advantages: &[1.0, 1.0],
            returns: &[2.0, 1.0],
        };
        assert!(ppo_loss(&cfg, &bad)
            .unwrap_err()
            .to_string()
            .contains("old_logprob"));
        assert!(ppo_loss(
            &PpoLossConfig {
                clip_range: 0.0,
                ..cfg
            },
            &bad
        )
        .unwrap_err()
        .to_string()
        .contains("clip_range"));
    }

    #[test]
    fn normalize_and_explained_variance() {
        let x = normalize(&[1.0, 2.0, 3.0, 4.0]);
        // mean 2.5, unbiased std sqrt(5/3)
        let s = (5.0f32 / 3.0).sqrt();
        close(&x, &[-1.5 / s, -0.5 / s, 0.5 / s, 1.5 / s], 1e-6);
        assert_eq!(normalize(&[3.0]), vec![3.0]);
        assert_eq!(explained_variance(&[1.0, 2.0, 3.0], &[1.0, 2.0, 3.0]), 1.0);
        assert_eq!(explained_variance(&[2.0, 2.0, 2.0], &[1.0, 2.0, 3.0]), 0.0);
        // residual y - p = [0, 0, 1]: var 2/9; var y = 2/3 -> 1 - 1/3
        assert!((explained_variance(&[1.0, 2.0, 2.0], &[1.0, 2.0, 3.0]) - 2.0 / 3.0).abs() < 1e-6);
        assert!(explained_variance(&[1.0, 2.0], &[5.0, 5.0]).is_nan());
    }
}
