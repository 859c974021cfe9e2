//! Generalized state-dependent exploration (gSDE; Raffin, Kober and Stulp,
//! "Smooth Exploration for Robotic Reinforcement Learning", 2021), the
//! action distribution of a continuous policy with
//! [`crate::PolicySpec::use_sde`], as Stable-Baselines3's
//! `StateDependentNoiseDistribution` with its PPO defaults (`full_std`, no
//! `expln`, features not learned).
//!
//! With `z` the actor's last hidden layer (`L` values, detached: the noise
//! trains `log_std` only, not the features) and `S = exp(log_std)` an
//! `[L, D]` matrix, the action is `mean + z (S ∘ E)` for an exploration
//! matrix `E` of standard normals, and its distribution, given `z`, is the
//! diagonal Gaussian of variance `σ_j² = Σ_i z_i² S_ij² + ε`. `E` is held
//! for several steps ([`exploration_matrix`] draws it from a seed that the
//! env-runner keeps per env), so the noise is a smooth function of the
//! state instead of fresh each step: what makes exploration on MuJoCo and
//! on the partially observed NoVel envs work at rl-zoo's settings.
//!
//! This file holds the distribution on both paths: the graph for training
//! ([`logprob_entropy`]) and one row on the host for acting ([`act_row`]).

use candle_core::Tensor;
use rand::SeedableRng;
use rand_distr::{Distribution, StandardNormal};

use crate::ops::HALF_LN_2PI;

/// Added to each variance, as SB3's `epsilon`, so that `σ` stays positive
/// where the latent is all zeros (a dead ReLU layer).
pub const VARIANCE_EPSILON: f32 = 1e-6;

/// The `[latent, dim]` exploration matrix of standard normals that `seed`
/// stands for: the same seed gives the same matrix on every server, so an
/// env acted by several inference servers keeps its noise.
pub fn exploration_matrix(seed: u64, latent: usize, dim: usize) -> Vec<f32> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    (0..latent * dim)
        .map(|_| StandardNormal.sample(&mut rng))
        .collect()
}

/// One row on the host: pushes `mean + z (std ∘ eps)` onto `actions` (the
/// mean itself without `eps`: the deterministic action) and returns its
/// log-probability. `z`: `L` latent values; `std` and `eps`: `[L, D]`
/// row-major.
pub(crate) fn act_row(
    mean: &[f32],
    z: &[f32],
    std: &[f32],
    eps: Option<&[f32]>,
    actions: &mut Vec<f32>,
) -> f32 {
    let d = mean.len();
    let mut logp = 0f32;
    for (j, &m) in mean.iter().enumerate() {
        let (mut variance, mut noise) = (0f32, 0f32);
        for (i, &zi) in z.iter().enumerate() {
            let s = std[i * d + j];
            variance += zi * zi * s * s;
            if let Some(eps) = eps {
                noise += zi * s * eps[i * d + j];
            }
        }
        let sigma = (variance + VARIANCE_EPSILON).sqrt();
        actions.push(m + noise);
        let u = noise / sigma;
        logp += -0.5 * u * u - sigma.ln() - HALF_LN_2PI;
    }
    logp
}

/// Log-probabilities of `actions` (`[B, D]` row-major, unclipped) and
/// entropies, `[B]` each, as a graph: differentiable in `mean` `[B, D]`
/// and `log_std` `[L, D]`, with `latent` `[B, L]` detached.
pub(crate) fn logprob_entropy(
    mean: &Tensor,
    log_std: &Tensor,
    latent: &Tensor,
    actions: &[f32],
) -> candle_core::Result<(Tensor, Tensor)> {
    let variance = latent
        .detach()
        .sqr()?
        .matmul(&log_std.affine(2.0, 0.0)?.exp()?)?;
    let log_sigma = variance
        .affine(1.0, f64::from(VARIANCE_EPSILON))?
        .log()?
        .affine(0.5, 0.0)?;
    let actions = Tensor::from_slice(actions, mean.shape(), mean.device())?;
    let u = actions.sub(mean)?.mul(&log_sigma.neg()?.exp()?)?;
    let logprob = u
        .sqr()?
        .affine(-0.5, -f64::from(HALF_LN_2PI))?
        .sub(&log_sigma)?
        .sum(1)?;
    let entropy = log_sigma
        .affine(1.0, 0.5 + f64::from(HALF_LN_2PI))?
        .sum(1)?;
    Ok((logprob, entropy))
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    /// The host row and the graph agree, and both are the Gaussian of
    /// variance `Σ z² S²`: checked against the density written out.
    #[test]
    fn host_row_and_graph_agree_with_the_written_out_density() {
        let (l, d) = (3, 2);
        let z = [0.5f32, -1.0, 2.0];
        let log_std: Vec<f32> = vec![0.1, -0.3, 0.0, 0.2, -0.5, 0.4];
        let std: Vec<f32> = log_std.iter().map(|v| v.exp()).collect();
        let mean = [0.3f32, -0.7];
        let eps = exploration_matrix(7, l, d);
        let mut actions = Vec::new();
        let logp = act_row(&mean, &z, &std, Some(&eps), &mut actions);
        let variances: Vec<f64> = (0..d)
            .map(|j| {
                (0..l)
                    .map(|i| f64::from(z[i] * z[i] * std[i * d + j] * std[i * d + j]))
                    .sum::<f64>()
                    + f64::from(VARIANCE_EPSILON)
            })
            .collect();
        let mut expected = 0f64;
        for (j, &var) in variances.iter().enumerate() {
            let noise: f64 = (0..l)
                .map(|i| f64::from(z[i] * std[i * d + j] * eps[i * d + j]))
                .sum();
            assert!((f64::from(actions[j]) - f64::from(mean[j]) - noise).abs() < 1e-5);
            expected += -0.5 * noise * noise / var - 0.5 * (2.0 * std::f64::consts::PI * var).ln();
        }
        assert!(
            (f64::from(logp) - expected).abs() < 1e-4,
            "{logp} vs {expected}"
        );

        let dev = Device::Cpu;
        let mean_t = Var::from_slice(&mean, (1, d), &dev).unwrap();
        let log_std_t = Var::from_slice(&log_std, (l, d), &dev).unwrap();
        let z_t = Tensor::from_slice(&z, (1, l), &dev).unwrap();
        let (lp, h) = logprob_entropy(&mean_t, &log_std_t, &z_t, &actions).unwrap();
        let lp = lp.to_vec1::<f32>().unwrap()[0];
        assert!((lp - logp).abs() < 1e-4, "graph {lp} vs host {logp}");
        // Entropy of a Gaussian: Σ_j 0.5 ln(2πe σ_j²).
        let h = h.to_vec1::<f32>().unwrap()[0];
        let expected_h: f64 = variances
            .iter()
            .map(|var| 0.5 * (2.0 * std::f64::consts::PI * std::f64::consts::E * var).ln())
            .sum();
        assert!(
            (f64::from(h) - expected_h).abs() < 1e-4,
            "{h} vs {expected_h}"
        );
        // Gradients reach the mean and log_std.
        let grads = lp_sum_grads(&mean_t, &log_std_t, &z_t, &actions);
        assert!(grads.0.iter().any(|g| g.abs() > 0.0));
        assert!(grads.1.iter().any(|g| g.abs() > 0.0));
    }

    fn lp_sum_grads(
        mean: &Var,
        log_std: &Var,
        z: &Tensor,
        actions: &[f32],
    ) -> (Vec<f32>, Vec<f32>) {
        let (lp, _) = logprob_entropy(mean, log_std, z, actions).unwrap();
        let grads = lp.sum_all().unwrap().backward().unwrap();
        let g = |v: &Var| {
            grads
                .get(v.as_tensor())
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap()
        };
        (g(mean), g(log_std))
    }

    #[test]
    fn a_seed_is_one_matrix_and_the_noise_is_held_with_it() {
        assert_eq!(exploration_matrix(3, 4, 2), exploration_matrix(3, 4, 2));
        assert_ne!(exploration_matrix(3, 4, 2), exploration_matrix(4, 4, 2));
        let (z, std, mean) = ([1.0f32, 0.5], [1.0f32; 2], [0.0f32]);
        let eps = exploration_matrix(9, 2, 1);
        let (mut a, mut b) = (Vec::new(), Vec::new());
        act_row(&mean, &z, &std, Some(&eps), &mut a);
        act_row(&mean, &z, &std, Some(&eps), &mut b);
        assert_eq!(a, b);
        // Deterministic: the mean.
        let mut c = Vec::new();
        act_row(&mean, &z, &std, None, &mut c);
        assert_eq!(c, vec![0.0]);
    }
}
