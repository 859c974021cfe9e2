//! Vanilla policy-gradient losses: A2C (SB3's `A2C`) and REINFORCE with an
//! optional learned baseline, plus discounted Monte-Carlo returns.
//!
//! Both use the same [`crate::ActorCritic`] as PPO (its `evaluate` gives
//! log-probabilities, entropies and values; a shared or separate critic is
//! chosen with [`crate::TrunkLayout`]).
//!
//! # A2C (SB3 defaults: `n_steps = 5`, `gae_lambda = 1`, RMSprop)
//!
//! 1. Per env fragment: `(advantages, returns) = gae(.., gamma, gae_lambda)`
//!    ([`crate::gae`]; `gae_lambda = 1` gives n-step bootstrapped returns).
//! 2. One gradient step on the whole rollout: [`a2c_loss`], backward,
//!    [`crate::clip_grad_norm`] (`max_grad_norm = 0.5`), [`crate::RmsProp`].
//!
//! # REINFORCE
//!
//! Returns `G_t` over whole episodes ([`discounted_returns`]), then
//! [`reinforce_loss`]: `-mean((G_t - b(s_t)) log π(a_t|s_t))` with
//! `b = V` (trained by the value loss, detached in the policy term) or
//! `b = 0`.

use candle_core::Tensor;
use serde::{Deserialize, Serialize};

use crate::error::{NnError, Result};
use crate::ops::{precomputed_loss, with_f32};
use crate::ppo::normalize;

/// Discounted returns over one env's sequence of `T` steps, with the same
/// conventions as [`crate::gae`]:
///
/// ```text
/// G_t = r_t + γ * (  0               if terminated_t
///                  | next_values_t   if ends_t (truncated) or t = T - 1
///                  | G_{t+1}         otherwise )
/// ```
///
/// For pure Monte-Carlo returns of complete episodes pass zeros as
/// `next_values`; a truncated episode bootstraps from `next_values[t]`
/// (`V(final_obs)`), as does a fragment cut mid-episode at its last step.
pub fn discounted_returns(
    rewards: &[f32],
    next_values: &[f32],
    terminated: &[bool],
    ends: &[bool],
    gamma: f32,
) -> Result<Vec<f32>> {
    let t = rewards.len();
    for (what, len) in [
        ("next_values", next_values.len()),
        ("terminated", terminated.len()),
        ("ends", ends.len()),
    ] {
        if len != t {
            return Err(NnError::bad_input(
                what,
                format!("{t} steps (as rewards)"),
                len,
            ));
        }
    }
    let mut out = vec![0f32; t];
    for i in (0..t).rev() {
        let future = if terminated[i] {
            0.0
        } else if ends[i] || i + 1 == t {
            next_values[i]
        } else {
            out[i + 1]
        };
        out[i] = rewards[i] + gamma * future;
    }
    Ok(out)
}

/// Hyperparameters of [`a2c_loss`]. Defaults are SB3's A2C.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct A2cLossConfig {
    /// Weight of the entropy bonus. Default `0.0`.
    pub ent_coef: f64,
    /// Weight of the value loss. Default `0.5`.
    pub vf_coef: f64,
    /// Normalise advantages over the batch (as [`crate::normalize`]). Default `false`.
    pub normalize_advantage: bool,
}

impl Default for A2cLossConfig {
    fn default() -> Self {
        Self {
            ent_coef: 0.0,
            vf_coef: 0.5,
            normalize_advantage: false,
        }
    }
}

/// Hyperparameters of [`reinforce_loss`].
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ReinforceConfig {
    /// Subtract the critic's value as a baseline (and train it with the
    /// value loss). Default `true`.
    pub baseline: bool,
    /// Weight of the entropy bonus. Default `0.0`.
    pub ent_coef: f64,
    /// Weight of the value loss (with a baseline). Default `0.5`.
    pub vf_coef: f64,
    /// Normalise `G - b` over the batch. Default `false`.
    pub normalize_advantage: bool,
}

impl Default for ReinforceConfig {
    fn default() -> Self {
        Self {
            baseline: true,
            ent_coef: 0.0,
            vf_coef: 0.5,
            normalize_advantage: false,
        }
    }
}

fn check_coefs(ent_coef: f64, vf_coef: f64) -> Result<()> {
    if !ent_coef.is_finite() {
        return Err(NnError::config("ent_coef", "must be finite"));
    }
    if !(vf_coef.is_finite() && vf_coef >= 0.0) {
        return Err(NnError::config(
            "vf_coef",
            format!("must be >= 0, got {vf_coef}"),
        ));
    }
    Ok(())
}

/// One batch for [`a2c_loss`]; every field has `B` entries.
#[derive(Debug, Clone, Copy)]
pub struct A2cInputs<'a> {
    /// `log π(a|s)`, `[B]`, differentiable.
    pub logprob: &'a Tensor,
    /// Policy entropy, `[B]`, differentiable.
    pub entropy: &'a Tensor,
    /// `V(s)`, `[B]`, differentiable.
    pub values: &'a Tensor,
    /// Advantages (from [`crate::gae`]).
    pub advantages: &'a [f32],
    /// Value targets (from [`crate::gae`]).
    pub returns: &'a [f32],
}

/// Scalar diagnostics of a policy-gradient loss.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct PgStats {
    /// Total loss `policy_loss - ent_coef * entropy + vf_coef * value_loss`.
    pub loss: f32,
    /// `-mean(A log π)`.
    pub policy_loss: f32,
    /// `mean((returns - V)^2)` (0 without a critic).
    pub value_loss: f32,
    /// Mean entropy.
    pub entropy: f32,
}

/// The output of [`a2c_loss`] / [`reinforce_loss`].
#[derive(Debug, Clone)]
pub struct PgLoss {
    /// Differentiable scalar loss.
    pub loss: Tensor,
    /// Diagnostics.
    pub stats: PgStats,
}

/// The shared core: value and input gradients in one pass.
#[allow(clippy::too_many_arguments)]
fn pg_loss(
    ent_coef: f64,
    vf_coef: f64,
    normalize_advantage: bool,
    logprob: &Tensor,
    entropy: &Tensor,
    values: Option<&Tensor>,
    advantages: &[f32],
    returns: &[f32],
) -> Result<PgLoss> {
    check_coefs(ent_coef, vf_coef)?;
    let b = advantages.len();
    for (what, len) in [
        ("logprob", logprob.elem_count()),
        ("entropy", entropy.elem_count()),
        ("values", values.map_or(b, Tensor::elem_count)),
        ("returns", returns.len()),
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
            "a non-empty batch",
            "0 values",
        ));
    }
    let adv = if normalize_advantage {
        normalize(advantages)
    } else {
        advantages.to_vec()
    };
    let lp: Vec<f32> = with_f32(logprob, "pg_loss", |x| x.to_vec())?;
    let ent: Vec<f32> = with_f32(entropy, "pg_loss", |x| x.to_vec())?;
    let n = b as f64;
    let policy_loss = -lp
        .iter()
        .zip(&adv)
        .map(|(l, a)| (l * a) as f64)
        .sum::<f64>()
        / n;
    let d_logprob: Vec<f32> = adv.iter().map(|a| (-(*a as f64) / n) as f32).collect();
    let mean_entropy = ent.iter().map(|&h| h as f64).sum::<f64>() / n;
    let d_entropy = vec![(-ent_coef / n) as f32; b];
    let mut loss = precomputed_loss(logprob, policy_loss as f32, d_logprob)?;
    loss = (loss + precomputed_loss(entropy, (-ent_coef * mean_entropy) as f32, d_entropy)?)?;
    let mut value_loss = 0f64;
    if let Some(values) = values {
        let v: Vec<f32> = with_f32(values, "pg_loss", |x| x.to_vec())?;
        value_loss = v
            .iter()
            .zip(returns)
            .map(|(v, r)| ((v - r) as f64).powi(2))
            .sum::<f64>()
            / n;
        let d_values: Vec<f32> = v
            .iter()
            .zip(returns)
            .map(|(v, r)| (2.0 * vf_coef * (v - r) as f64 / n) as f32)
            .collect();
        loss = (loss + precomputed_loss(values, (vf_coef * value_loss) as f32, d_values)?)?;
    }
    let total = policy_loss - ent_coef * mean_entropy + vf_coef * value_loss;
    Ok(PgLoss {
        loss,
        stats: PgStats {
            loss: total as f32,
            policy_loss: policy_loss as f32,
            value_loss: value_loss as f32,
            entropy: mean_entropy as f32,
        },
    })
}

/// SB3's A2C loss:
///
/// ```text
/// A     = normalize(advantages)    if normalize_advantage
/// loss  = -mean(A log π) - ent_coef * mean(entropy) + vf_coef * mean((returns - V)^2)
/// ```
pub fn a2c_loss(config: &A2cLossConfig, inputs: &A2cInputs<'_>) -> Result<PgLoss> {
    pg_loss(
        config.ent_coef,
        config.vf_coef,
        config.normalize_advantage,
        inputs.logprob,
        inputs.entropy,
        Some(inputs.values),
        inputs.advantages,
        inputs.returns,
    )
}

/// One batch for [`reinforce_loss`]; every field has `B` entries.
#[derive(Debug, Clone, Copy)]
pub struct ReinforceInputs<'a> {
    /// `log π(a|s)`, `[B]`, differentiable.
    pub logprob: &'a Tensor,
    /// Policy entropy, `[B]`, differentiable.
    pub entropy: &'a Tensor,
    /// `V(s)`, `[B]`, differentiable; required when `baseline` is on,
    /// ignored otherwise.
    pub values: Option<&'a Tensor>,
    /// Discounted returns `G_t` ([`discounted_returns`]).
    pub returns: &'a [f32],
    /// With `normalize_advantage`: the mean and unbiased standard deviation
    /// the advantages are normalised with. `None`: this batch's own; learner
    /// replicas pass the whole batch's, this batch being their part of it.
    pub advantage_stats: Option<(f64, f64)>,
}

/// REINFORCE: `-mean((G - b) log π) - ent_coef * mean(entropy) +
/// vf_coef * mean((G - V)^2)` with `b = V` detached (baseline) or `b = 0`
/// (no value loss then).
pub fn reinforce_loss(config: &ReinforceConfig, inputs: &ReinforceInputs<'_>) -> Result<PgLoss> {
    let values = if config.baseline {
        Some(inputs.values.ok_or_else(|| {
            NnError::bad_input("values", "the critic's values (baseline is on)", "none")
        })?)
    } else {
        None
    };
    let advantages: Vec<f32> = match values {
        Some(v) => {
            let v: Vec<f32> = with_f32(v, "reinforce_loss", |x| x.to_vec())?;
            if v.len() != inputs.returns.len() {
                return Err(NnError::bad_input(
                    "values",
                    format!("{} values (as returns)", inputs.returns.len()),
                    v.len(),
                ));
            }
            inputs.returns.iter().zip(&v).map(|(g, v)| g - v).collect()
        }
        None => inputs.returns.to_vec(),
    };
    let (advantages, normalize_here) = match inputs.advantage_stats {
        Some((mean, std)) if config.normalize_advantage => {
            let scale = 1.0 / (std + 1e-8);
            let normalized = advantages
                .iter()
                .map(|&a| ((a as f64 - mean) * scale) as f32)
                .collect();
            (normalized, false)
        }
        _ => (advantages, config.normalize_advantage),
    };
    pg_loss(
        config.ent_coef,
        if config.baseline { config.vf_coef } else { 0.0 },
        normalize_here,
        inputs.logprob,
        inputs.entropy,
        values,
        &advantages,
        inputs.returns,
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    fn close(a: &[f32], b: &[f32], tol: f32) {
        assert_eq!(a.len(), b.len());
        for (x, y) in a.iter().zip(b) {
            assert!((x - y).abs() <= tol, "{a:?} vs {b:?}");
        }
    }

    #[test]
    fn discounted_returns_hand_computed() {
        let r = [1.0, 2.0, 3.0, 4.0];
        let g = 0.5;
        // Episode ends at step 1 (terminated), fragment ends mid-episode at 3.
        let nv = [9.0, 9.0, 9.0, 10.0];
        let term = [false, true, false, false];
        let ends = [false, true, false, false];
        let out = discounted_returns(&r, &nv, &term, &ends, g).unwrap();
        let g3 = 4.0 + 0.5 * 10.0;
        let g2 = 3.0 + 0.5 * g3;
        close(&out, &[1.0 + 0.5 * 2.0, 2.0, g2, g3], 1e-6);
        // Truncated at step 1: bootstrap from V(final obs) = 9.
        let out = discounted_returns(&r, &nv, &[false; 4], &ends, g).unwrap();
        let g1 = 2.0 + 0.5 * 9.0;
        close(&out, &[1.0 + 0.5 * g1, g1, g2, g3], 1e-6);
        // Equals gae with lambda 1 on zero values (whose next values inside
        // an episode are then 0 too).
        let nv_gae = [0.0, 9.0, 0.0, 10.0];
        let (_, ret) = crate::gae(&r, &[0.0; 4], &nv_gae, &[false; 4], &ends, g, 1.0).unwrap();
        close(&out, &ret, 1e-6);
        assert!(discounted_returns(&r, &nv[..3], &term, &ends, g).is_err());
    }

    fn vars() -> (Var, Var, Var) {
        let dev = &Device::Cpu;
        (
            Var::from_slice(&[-0.5f32, -1.0, -2.0], 3, dev).unwrap(),
            Var::from_slice(&[0.6f32, 0.4, 0.5], 3, dev).unwrap(),
            Var::from_slice(&[1.0f32, 0.0, -1.0], 3, dev).unwrap(),
        )
    }

    #[test]
    fn a2c_loss_hand_computed() {
        let (lp, ent, v) = vars();
        let cfg = A2cLossConfig {
            ent_coef: 0.1,
            vf_coef: 0.5,
            normalize_advantage: false,
        };
        let out = a2c_loss(
            &cfg,
            &A2cInputs {
                logprob: &lp,
                entropy: &ent,
                values: &v,
                advantages: &[1.0, -2.0, 0.5],
                returns: &[2.0, 1.0, -1.0],
            },
        )
        .unwrap();
        // -mean(A lp) = -(-0.5 + 2 - 1) / 3
        let pl = -(0.5f32) / 3.0;
        let vl = (1.0 + 1.0 + 0.0) / 3.0;
        let h = 0.5;
        let s = out.stats;
        assert!((s.policy_loss - pl).abs() < 1e-6);
        assert!((s.value_loss - vl).abs() < 1e-6);
        assert!((s.entropy - h).abs() < 1e-6);
        let total = pl - 0.1 * h + 0.5 * vl;
        assert!((s.loss - total).abs() < 1e-6);
        assert!((out.loss.to_scalar::<f32>().unwrap() - total).abs() < 1e-6);
        let g = out.loss.backward().unwrap();
        let grad = |x: &Var| g.get(x).unwrap().to_vec1::<f32>().unwrap();
        close(&grad(&lp), &[-1.0 / 3.0, 2.0 / 3.0, -0.5 / 3.0], 1e-6);
        close(&grad(&ent), &[-0.1 / 3.0; 3], 1e-7);
        // 2 * 0.5 * (v - R) / 3
        close(&grad(&v), &[-1.0 / 3.0, -1.0 / 3.0, 0.0], 1e-6);
    }

    #[test]
    fn reinforce_with_and_without_baseline() {
        let (lp, ent, v) = vars();
        let returns = [3.0f32, 1.0, -2.0];
        let with = reinforce_loss(
            &ReinforceConfig::default(),
            &ReinforceInputs {
                logprob: &lp,
                entropy: &ent,
                values: Some(&v),
                returns: &returns,
                advantage_stats: None,
            },
        )
        .unwrap();
        // A = G - V = [2, 1, -1]; -mean(A lp) = -(-1 - 1 + 2) / 3 = 0.
        assert!(with.stats.policy_loss.abs() < 1e-6);
        // value loss mean([4, 1, 1]) = 2
        assert!((with.stats.value_loss - 2.0).abs() < 1e-6);
        let g = with.loss.backward().unwrap();
        close(
            &g.get(&lp).unwrap().to_vec1::<f32>().unwrap(),
            &[-2.0 / 3.0, -1.0 / 3.0, 1.0 / 3.0],
            1e-6,
        );
        close(
            &g.get(&v).unwrap().to_vec1::<f32>().unwrap(),
            &[-2.0 / 3.0, -1.0 / 3.0, 1.0 / 3.0],
            1e-6,
        );
        let without = reinforce_loss(
            &ReinforceConfig {
                baseline: false,
                ..Default::default()
            },
            &ReinforceInputs {
                logprob: &lp,
                entropy: &ent,
                values: Some(&v),
                returns: &returns,
                advantage_stats: None,
            },
        )
        .unwrap();
        // -mean(G lp) = -(-1.5 - 1 + 4) / 3
        assert!((without.stats.policy_loss - (-1.5 / 3.0)).abs() < 1e-6);
        assert_eq!(without.stats.value_loss, 0.0);
        let g = without.loss.backward().unwrap();
        assert!(g.get(&v).is_none());
        assert!(reinforce_loss(
            &ReinforceConfig::default(),
            &ReinforceInputs {
                logprob: &lp,
                entropy: &ent,
                values: None,
                returns: &returns,
                advantage_stats: None,
            },
        )
        .is_err());
    }
}
