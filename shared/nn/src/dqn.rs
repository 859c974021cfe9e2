//! DQN math: n-step returns over a sequence of transitions, and the TD loss
//! with (double) DQN targets, Huber loss, importance weights and TD errors.
//!
//! # Data flow
//!
//! 1. The replay side keeps each env's transitions in order and turns them
//!    into n-step samples with [`n_step_returns`]: for transition `t`, the
//!    discounted reward sum `R_t`, the discount `γ^k` to apply to the
//!    bootstrap value (0 after a termination) and the index of the
//!    transition whose next observation is the bootstrap state `s_{t+k}`.
//! 2. The learner samples a minibatch of `(s_t, a_t, R_t, s_{t+k}, γ^k)`
//!    (plus importance weights for prioritized replay) into a [`DqnBatch`]
//!    and calls [`dqn_loss`] with the online and the target network.
//! 3. It backpropagates `loss`, steps the optimizer, sends `|td_errors|`
//!    back as new priorities, and updates the target network
//!    ([`crate::QNetwork::soft_update`]) on its own schedule.
//!
//! Terminated and truncated are different: a termination ends the return
//! with no bootstrap; a truncation (time limit) also ends the n-step window,
//! but bootstraps from the truncated step's final observation, as SB3 does
//! (`handle_timeout_termination`).
//!
//! # Invalid-action masks
//!
//! With the masks of the bootstrap states ([`DqnBatch::next_masks`], 1
//! legal, 0 illegal), the bootstrap value is the max over the legal next
//! actions only (double DQN: the online network's legal arg-max), so an
//! action the agent can never take does not inflate the target. Rows whose
//! discount is 0 do not bootstrap and their masks are not read.

use candle_core::Tensor;
use serde::{Deserialize, Serialize};

use crate::error::{NnError, Result};
use crate::ops::{check_mask_row, masked_argmax, precomputed_loss, with_f32};
use crate::qnet::QNetwork;

/// n-step targets of a sequence of `T` transitions (see [`n_step_returns`]).
#[derive(Debug, Clone, PartialEq)]
pub struct NStepReturns {
    /// `R_t = Σ_{i<k} γ^i r_{t+i}`, `T` values.
    pub returns: Vec<f32>,
    /// `γ^k` when the window ends without termination (bootstrap), `0.0`
    /// when it ends with a termination; `T` values.
    pub discounts: Vec<f32>,
    /// `t + k - 1`: the transition whose next observation (its final
    /// observation if it was truncated) is the bootstrap state `s_{t+k}`.
    pub next_index: Vec<usize>,
    /// `true` when the window is final: it has `n` steps or ends with the
    /// episode. `false` when the sequence ended first (a fragment cut
    /// mid-episode): its target bootstraps early from the last available
    /// step; a caller that wants exact n-step targets keeps such
    /// transitions until the next fragment of that env arrives.
    pub complete: Vec<bool>,
}

/// n-step returns over one env's sequence of `T` consecutive transitions.
///
/// Per transition `t` (`rewards[t]`, `terminated[t]`, `truncated[t]` of the
/// step from `s_t`), the window covers steps `t .. t + k` where `k <= n`
/// stops early at the first step that terminates or truncates (that step
/// included) or at the end of the sequence:
///
/// ```text
/// R_t        = r_t + γ r_{t+1} + ... + γ^{k-1} r_{t+k-1}
/// discount_t = 0    if step t+k-1 terminated
///            = γ^k  otherwise (n steps, a truncation, or the sequence end)
/// target_t   = R_t + discount_t * max_a Q_target(s_{t+k}, a)
/// ```
pub fn n_step_returns(
    rewards: &[f32],
    terminated: &[bool],
    truncated: &[bool],
    n: usize,
    gamma: f32,
) -> Result<NStepReturns> {
    let t_len = rewards.len();
    for (what, len) in [
        ("terminated", terminated.len()),
        ("truncated", truncated.len()),
    ] {
        if len != t_len {
            return Err(NnError::bad_input(
                what,
                format!("{t_len} steps (as rewards)"),
                len,
            ));
        }
    }
    if n == 0 {
        return Err(NnError::config("n_steps", "must be at least 1"));
    }
    let mut out = NStepReturns {
        returns: Vec::with_capacity(t_len),
        discounts: Vec::with_capacity(t_len),
        next_index: Vec::with_capacity(t_len),
        complete: Vec::with_capacity(t_len),
    };
    for t in 0..t_len {
        let (mut ret, mut discount) = (0f32, 1f32);
        let mut last = t;
        let mut complete = false;
        for i in t..(t + n).min(t_len) {
            ret += discount * rewards[i];
            discount *= gamma;
            last = i;
            if terminated[i] {
                discount = 0.0;
                complete = true;
                break;
            }
            if truncated[i] || i + 1 == t + n {
                complete = true;
                break;
            }
        }
        out.returns.push(ret);
        out.discounts.push(discount);
        out.next_index.push(last);
        out.complete.push(complete);
    }
    Ok(out)
}

/// Hyperparameters of [`dqn_loss`]. Defaults are SB3's DQN.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DqnLossConfig {
    /// Double DQN (van Hasselt et al.): the online network picks the next
    /// action, the target network values it. Default `false` (SB3's DQN).
    pub double_q: bool,
    /// Huber threshold δ: quadratic `0.5 x^2` below, linear `δ(|x| - δ/2)`
    /// above. Default `1.0`, which is SB3's `smooth_l1_loss`.
    pub huber_delta: f32,
}

impl Default for DqnLossConfig {
    fn default() -> Self {
        Self {
            double_q: false,
            huber_delta: 1.0,
        }
    }
}

impl DqnLossConfig {
    /// Checks ranges; the error names the field.
    pub fn validate(&self) -> Result<()> {
        if !(self.huber_delta.is_finite() && self.huber_delta > 0.0) {
            return Err(NnError::config(
                "huber_delta",
                format!("must be > 0, got {}", self.huber_delta),
            ));
        }
        Ok(())
    }
}

/// One minibatch of `B` n-step samples for [`dqn_loss`].
#[derive(Debug, Clone, Copy)]
pub struct DqnBatch<'a> {
    /// `s_t`, `B * obs_dim` values row-major.
    pub obs: &'a [f32],
    /// `a_t`, indices in `0..n_actions`.
    pub actions: &'a [u32],
    /// `R_t` from [`n_step_returns`] (for 1-step samples just `r_t`).
    pub returns: &'a [f32],
    /// `s_{t+k}`, `B * obs_dim` values (ignored where the discount is 0).
    pub next_obs: &'a [f32],
    /// `γ^k`, or 0 after a termination (1-step: `γ (1 - terminated)`).
    pub discounts: &'a [f32],
    /// Importance-sampling weights of prioritized replay (`None`: all 1).
    pub weights: Option<&'a [f32]>,
    /// Invalid-action masks of `s_{t+k}`, `B * n_actions` bytes row-major
    /// (1 legal, 0 illegal; `None`: all legal): the bootstrap takes the max
    /// over legal next actions only. Rows whose discount is 0 are not read
    /// (all-ones filler is fine there); every other row needs a legal action.
    pub next_masks: Option<&'a [u8]>,
}

/// Scalar diagnostics of one [`dqn_loss`] evaluation.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct DqnStats {
    /// The (weighted) mean Huber loss.
    pub loss: f32,
    /// Mean `Q(s_t, a_t)` of the online network.
    pub q_mean: f32,
    /// Mean TD target.
    pub target_mean: f32,
    /// Mean `|td_error|`.
    pub td_abs_mean: f32,
}

/// The output of [`dqn_loss`].
#[derive(Debug, Clone)]
pub struct DqnLoss {
    /// Differentiable scalar loss; `.backward()` reaches the online network.
    pub loss: Tensor,
    /// `Q(s_t, a_t) - target_t` per sample (new priorities are `|td| + ε`).
    pub td_errors: Vec<f32>,
    /// The targets `R_t + γ^k max_a Q_target(s_{t+k}, a)` (double DQN: the
    /// target network's value of the online network's arg-max), over the
    /// legal `a` under [`DqnBatch::next_masks`].
    pub targets: Vec<f32>,
    /// Diagnostics.
    pub stats: DqnStats,
}

/// TD targets `returns + discounts * V'(next_obs)` with `V'` the target
/// network's max, or (double DQN) its value of the online arg-max. No graph.
///
/// `next_masks` (`B * n_actions` bytes, 1 legal, 0 illegal; `None`: all
/// legal) restricts that max / arg-max to the legal actions of each next
/// state (the first legal maximum on ties). Only rows with a non-zero
/// discount are checked (values 0 or 1, at least one legal action; the
/// error names the row): the others do not bootstrap.
pub fn dqn_targets(
    config: &DqnLossConfig,
    online: &QNetwork,
    target: &QNetwork,
    returns: &[f32],
    next_obs: &[f32],
    discounts: &[f32],
    next_masks: Option<&[u8]>,
) -> Result<Vec<f32>> {
    let b = returns.len();
    if discounts.len() != b {
        return Err(NnError::bad_input(
            "discounts",
            format!("{b} values (as returns)"),
            discounts.len(),
        ));
    }
    let k = target.spec().n_actions;
    let mask_row = |r: usize| next_masks.map(|m| &m[r * k..(r + 1) * k]);
    if let Some(m) = next_masks {
        if m.len() != b * k {
            return Err(NnError::bad_input(
                "next_masks",
                format!("{b} x {k} = {} values", b * k),
                format!("{} values", m.len()),
            ));
        }
        for (r, &d) in discounts.iter().enumerate() {
            if d != 0.0 {
                check_mask_row(&m[r * k..(r + 1) * k], r)?;
            }
        }
    }
    let q_next = target.q_values(next_obs, b)?;
    let legal_argmax = |q: &[f32]| -> Vec<usize> {
        q.chunks_exact(k)
            .enumerate()
            .map(|(r, row)| masked_argmax(row, mask_row(r)))
            .collect()
    };
    let next_actions = if config.double_q {
        legal_argmax(&online.q_values(next_obs, b)?)
    } else {
        legal_argmax(&q_next)
    };
    Ok(returns
        .iter()
        .zip(discounts)
        .zip(q_next.chunks_exact(k).zip(next_actions))
        .map(|((&r, &d), (row, a))| if d == 0.0 { r } else { r + d * row[a] })
        .collect())
}

/// The DQN loss of a minibatch (SB3's `DQN.train` step, with n-step
/// returns, optional double DQN and importance weights):
///
/// ```text
/// y_i    = R_i + γ^k_i max_a Q_target(s'_i, a)            (dqn_targets; legal a)
/// δ_i    = Q_online(s_i, a_i) - y_i
/// loss   = (1/B) Σ_i w_i huber(δ_i)
/// ```
///
/// Value and gradient with respect to `Q_online(s, ·)` are computed in one
/// pass; `loss.backward()` reaches the online network only.
pub fn dqn_loss(
    config: &DqnLossConfig,
    online: &QNetwork,
    target: &QNetwork,
    batch: &DqnBatch<'_>,
) -> Result<DqnLoss> {
    config.validate()?;
    let b = batch.actions.len();
    let d = online.spec().obs_dim;
    let k = online.spec().n_actions;
    if target.spec() != online.spec() {
        return Err(NnError::bad_input(
            "target",
            format!("{:?}", online.spec()),
            format!("{:?}", target.spec()),
        ));
    }
    for (what, len) in [
        ("returns", batch.returns.len()),
        ("discounts", batch.discounts.len()),
        ("weights", batch.weights.map_or(b, <[f32]>::len)),
        ("obs rows", batch.obs.len() / d.max(1)),
        ("next_obs rows", batch.next_obs.len() / d.max(1)),
    ] {
        if len != b {
            return Err(NnError::bad_input(what, format!("{b} (as actions)"), len));
        }
    }
    if b == 0 {
        return Err(NnError::bad_input(
            "actions",
            "a non-empty minibatch",
            "0 values",
        ));
    }
    if let Some(&a) = batch.actions.iter().find(|&&a| a as usize >= k) {
        return Err(NnError::bad_input(
            "actions",
            format!("indices in 0..{k}"),
            a,
        ));
    }
    let targets = dqn_targets(
        config,
        online,
        target,
        batch.returns,
        batch.next_obs,
        batch.discounts,
        batch.next_masks,
    )?;

    let obs = Tensor::from_slice(batch.obs, (b, d), online.device())?;
    let q_all = online.forward(&obs)?;
    let q_host: Vec<f32> = with_f32(&q_all, "dqn_loss", |q| q.to_vec())?;
    let delta = config.huber_delta;
    let inv_b = 1.0 / b as f32;
    let mut grad = vec![0f32; b * k];
    let mut td_errors = Vec::with_capacity(b);
    let (mut loss, mut q_sum, mut y_sum, mut td_abs) = (0f64, 0f64, 0f64, 0f64);
    for i in 0..b {
        let a = batch.actions[i] as usize;
        let w = batch.weights.map_or(1.0, |w| w[i]);
        let q = q_host[i * k + a];
        let td = q - targets[i];
        let (huber, slope) = if td.abs() < delta {
            (0.5 * td * td, td)
        } else {
            (delta * (td.abs() - 0.5 * delta), delta * td.signum())
        };
        loss += (w * huber) as f64;
        grad[i * k + a] = w * slope * inv_b;
        td_errors.push(td);
        q_sum += q as f64;
        y_sum += targets[i] as f64;
        td_abs += td.abs() as f64;
    }
    let n = b as f64;
    let stats = DqnStats {
        loss: (loss / n) as f32,
        q_mean: (q_sum / n) as f32,
        target_mean: (y_sum / n) as f32,
        td_abs_mean: (td_abs / n) as f32,
    };
    let loss = precomputed_loss(&q_all, stats.loss, grad)?;
    Ok(DqnLoss {
        loss,
        td_errors,
        targets,
        stats,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The first index of the largest value, written out again so the
    /// expected targets do not come from the code under test.
    fn argmax(xs: &[f32]) -> usize {
        let mut best = 0;
        for (i, &x) in xs.iter().enumerate() {
            if x > xs[best] {
                best = i;
            }
        }
        best
    }

    fn close(a: &[f32], b: &[f32], tol: f32) {
        assert_eq!(a.len(), b.len(), "{a:?} vs {b:?}");
        for (x, y) in a.iter().zip(b) {
            assert!((x - y).abs() <= tol, "{a:?} vs {b:?}");
        }
    }

    #[test]
    fn n_step_hand_computed_terminated_vs_truncated() {
        let g = 0.5f32;
        let r = [1.0, 2.0, 4.0, 8.0, 16.0];
        // Episode ends at step 2; the next one runs through step 4 (fragment end).
        let no = [false; 5];
        let ends = [false, false, true, false, false];

        let term = n_step_returns(&r, &ends, &no, 3, g).unwrap();
        close(
            &term.returns,
            &[
                1.0 + 0.5 * 2.0 + 0.25 * 4.0,
                2.0 + 0.5 * 4.0,
                4.0,
                8.0 + 0.5 * 16.0,
                16.0,
            ],
            1e-6,
        );
        // Termination inside the window: no bootstrap.
        close(&term.discounts, &[0.0, 0.0, 0.0, 0.25, 0.5], 1e-7);
        assert_eq!(term.next_index, vec![2, 2, 2, 4, 4]);
        assert_eq!(term.complete, vec![true, true, true, false, false]);

        let trunc = n_step_returns(&r, &no, &ends, 3, g).unwrap();
        assert_eq!(trunc.returns, term.returns);
        // Truncation inside the window: bootstrap from step 2's final obs with γ^k.
        close(&trunc.discounts, &[0.125, 0.25, 0.5, 0.25, 0.5], 1e-7);
        assert_eq!(trunc.next_index, vec![2, 2, 2, 4, 4]);
        assert_eq!(trunc.complete, term.complete);

        // No episode end, n = 2: every window has two steps but the last.
        let plain = n_step_returns(&r, &no, &no, 2, g).unwrap();
        close(&plain.returns, &[2.0, 4.0, 8.0, 16.0, 16.0], 1e-6);
        close(&plain.discounts, &[0.25, 0.25, 0.25, 0.25, 0.5], 1e-7);
        assert_eq!(plain.next_index, vec![1, 2, 3, 4, 4]);
        assert_eq!(plain.complete, vec![true, true, true, true, false]);
        // n = 1 is the 1-step target.
        let one = n_step_returns(&r, &ends, &no, 1, g).unwrap();
        assert_eq!(one.returns, r.to_vec());
        close(&one.discounts, &[0.5, 0.5, 0.0, 0.5, 0.5], 1e-7);
        assert!(one.complete.iter().all(|&c| c));
        assert!(n_step_returns(&r, &ends[..4], &no, 1, g).is_err());
        assert!(n_step_returns(&r, &ends, &no, 0, g).is_err());
    }

    #[test]
    fn double_dqn_target_values_the_online_argmax_with_the_target_net() {
        use crate::qnet::QNetSpec;
        let spec = QNetSpec {
            hidden: vec![8],
            ..QNetSpec::new(3, 4)
        };
        let online = QNetwork::new(&spec, 1).unwrap();
        let target = QNetwork::new(&spec, 2).unwrap();
        let next: Vec<f32> = (0..15).map(|i| (i as f32 * 0.37).sin()).collect();
        let returns = [1.0, -0.5, 2.0, 0.25, 0.0];
        let discounts = [0.99, 0.9801, 0.0, 0.5, 1.0];
        let q_on = online.q_values(&next, 5).unwrap();
        let q_tg = target.q_values(&next, 5).unwrap();
        let (mut double_differs, mut expected_double, mut expected_plain) = (false, vec![], vec![]);
        for i in 0..5 {
            let (on, tg) = (&q_on[i * 4..i * 4 + 4], &q_tg[i * 4..i * 4 + 4]);
            let a_star = argmax(on);
            double_differs |= a_star != argmax(tg);
            let boot = |v: f32| {
                if discounts[i] == 0.0 {
                    returns[i]
                } else {
                    returns[i] + discounts[i] * v
                }
            };
            expected_double.push(boot(tg[a_star]));
            expected_plain.push(boot(tg.iter().cloned().fold(f32::MIN, f32::max)));
        }
        // The two networks disagree somewhere, so the test tells the variants apart.
        assert!(double_differs);
        let double = DqnLossConfig {
            double_q: true,
            ..Default::default()
        };
        let plain = DqnLossConfig::default();
        let got =
            dqn_targets(&double, &online, &target, &returns, &next, &discounts, None).unwrap();
        close(&got, &expected_double, 1e-5);
        let got = dqn_targets(&plain, &online, &target, &returns, &next, &discounts, None).unwrap();
        close(&got, &expected_plain, 1e-5);
        // A terminated sample (discount 0) is its return alone.
        assert_eq!(got[2], 2.0);
    }

    #[test]
    fn masked_targets_bootstrap_from_the_legal_max() {
        use crate::qnet::tests::fixed_q;
        // Linear networks over 3 actions with constant Q-values (weights 0):
        // target Q = [1, 5, 2], online Q = [3, 9, 0] in every state.
        let (target, online) = (fixed_q([1.0, 5.0, 2.0]), fixed_q([3.0, 9.0, 0.0]));
        let returns = [1.0, 0.5, 2.0];
        let discounts = [0.5, 1.0, 0.0];
        let next = [0.0, 0.0, 0.0];
        // Row 2 is terminal (discount 0): its all-zero filler mask is not read.
        let masks = [1, 0, 1, 0, 1, 1, 0, 0, 0];
        let plain = DqnLossConfig::default();
        let double = DqnLossConfig {
            double_q: true,
            ..Default::default()
        };
        let targets = |config, m: Option<&[u8]>| {
            dqn_targets(config, &online, &target, &returns, &next, &discounts, m)
        };
        // Plain, legal max of the target: row 0 over {0, 2}: max(1, 2) = 2,
        // 1 + 0.5 * 2 = 2; row 1 over {1, 2}: 5, 0.5 + 1 * 5 = 5.5; row 2: 2.
        close(
            &targets(&plain, Some(&masks)).unwrap(),
            &[2.0, 5.5, 2.0],
            1e-6,
        );
        // Unmasked: row 0 takes the illegal 5: 1 + 0.5 * 5 = 3.5.
        close(&targets(&plain, None).unwrap(), &[3.5, 5.5, 2.0], 1e-6);
        // Double DQN: the online legal arg-max over {0, 2} of [3, 9, 0] is 0,
        // valued 1 by the target: 1 + 0.5 * 1 = 1.5; row 1 over {1, 2}: 1
        // (9), valued 5: 5.5. Unmasked, row 0 would take 1 (9): 3.5.
        close(
            &targets(&double, Some(&masks)).unwrap(),
            &[1.5, 5.5, 2.0],
            1e-6,
        );
        close(&targets(&double, None).unwrap(), &[3.5, 5.5, 2.0], 1e-6);

        // A bootstrapping row needs a legal action; the error names the row.
        let bootstrap_all = [0.5, 1.0, 0.9];
        let err = dqn_targets(
            &plain,
            &online,
            &target,
            &returns,
            &next,
            &bootstrap_all,
            Some(&masks),
        )
        .unwrap_err();
        assert!(err.to_string().contains("row 2"), "{err}");
        assert!(targets(&plain, Some(&masks[..6])).is_err());

        // dqn_loss reads the batch's next_masks.
        let batch = DqnBatch {
            obs: &next,
            actions: &[0, 1, 2],
            returns: &returns,
            next_obs: &next,
            discounts: &discounts,
            weights: None,
            next_masks: Some(&masks),
        };
        let out = dqn_loss(&plain, &online, &target, &batch).unwrap();
        close(&out.targets, &[2.0, 5.5, 2.0], 1e-6);
    }
}
