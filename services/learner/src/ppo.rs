//! PPO, top to bottom: rollout fragments in, one policy update out.
//!
//! 1. [`prepare`]: values of every observation from the current critic
//!    (fresher than the acting policy's when the rollout lags a version),
//!    then GAE per env column of each fragment. A terminated step is never
//!    bootstrapped; a truncated one bootstraps from the value of its final
//!    observation; the fragment's tail bootstraps from `next_obs`.
//! 2. [`update`]: `epochs` passes of shuffled minibatches: clipped surrogate,
//!    optional value clipping, entropy bonus, advantage normalisation per
//!    minibatch, global gradient-norm clipping, Adam; optional early stop
//!    when approx KL exceeds 1.5 x `target_kl`. Learning rate and clip range
//!    follow their schedules over training progress.
//!
//! Hyperparameters are the fields of [`relay_kit::config::PpoConfig`], each
//! documented there.

use candle_core::{Device, Tensor};
use rand::seq::SliceRandom;
use relay_kit::config::PpoConfig;
use relay_nn::{clip_grad_norm, ppo_loss, ActorCritic, Adam, NnError, PpoInputs, PpoLossConfig};
use relay_proto::RolloutFragment;

/// Why an update could not be made.
#[derive(Debug, thiserror::Error)]
pub enum PpoError {
    #[error(transparent)]
    Nn(#[from] NnError),
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
    #[error("fragment from {runner}: {detail}")]
    Fragment { runner: String, detail: String },
}

/// A rollout flattened for training: `len` steps.
pub struct Rollout {
    pub obs: Vec<f32>,
    pub obs_dim: usize,
    /// Discrete actions (empty for continuous).
    pub actions_discrete: Vec<u32>,
    /// Continuous actions, `len * action_dim` (empty for discrete).
    pub actions_continuous: Vec<f32>,
    pub action_dim: usize,
    pub old_logprobs: Vec<f32>,
    pub old_values: Vec<f32>,
    pub advantages: Vec<f32>,
    pub returns: Vec<f32>,
    pub len: usize,
    /// Vector steps (sum of fragment lengths) in this rollout.
    pub vec_steps: u64,
    /// Oldest policy version that acted in it.
    pub oldest_version: u64,
}

fn fragment_error(f: &RolloutFragment, detail: impl std::fmt::Display) -> PpoError {
    PpoError::Fragment {
        runner: f.runner_id.clone(),
        detail: detail.to_string(),
    }
}

/// Step 1: values from the current critic, then GAE per env column.
pub fn prepare(
    model: &ActorCritic,
    fragments: &[RolloutFragment],
    gamma: f64,
    gae_lambda: f64,
) -> Result<Rollout, PpoError> {
    let spec = model.spec();
    let obs_dim = spec.obs_dim;
    let action_dim = match &spec.action {
        relay_nn::ActionKind::Discrete { .. } => 0,
        relay_nn::ActionKind::Continuous { dim, .. } => *dim,
    };
    let mut out = Rollout {
        obs: Vec::new(),
        obs_dim,
        actions_discrete: Vec::new(),
        actions_continuous: Vec::new(),
        action_dim,
        old_logprobs: Vec::new(),
        old_values: Vec::new(),
        advantages: Vec::new(),
        returns: Vec::new(),
        len: 0,
        vec_steps: 0,
        oldest_version: u64::MAX,
    };
    for f in fragments {
        let (t_len, n) = (f.num_steps as usize, f.num_envs as usize);
        let obs = f.obs.to_f32().map_err(|e| fragment_error(f, e))?;
        if obs.len() != t_len * n * obs_dim {
            return Err(fragment_error(
                f,
                format!(
                    "observations have {} features per step, the policy takes {obs_dim}",
                    obs.len() / (t_len * n).max(1)
                ),
            ));
        }
        let next_obs = f.next_obs.to_f32().map_err(|e| fragment_error(f, e))?;
        let final_obs = f.final_obs.to_f32().map_err(|e| fragment_error(f, e))?;
        let rewards = f.rewards.to_f32().map_err(|e| fragment_error(f, e))?;
        let terminated = f.terminated.to_bool().map_err(|e| fragment_error(f, e))?;
        let truncated = f.truncated.to_bool().map_err(|e| fragment_error(f, e))?;
        let logprobs = f.logprobs.to_f32().map_err(|e| fragment_error(f, e))?;
        match action_dim {
            0 => {
                let a = f.actions.to_i64().map_err(|e| {
                    fragment_error(f, format!("actions: {e} (the policy is discrete)"))
                })?;
                out.actions_discrete.extend(a.iter().map(|&a| a as u32));
            }
            dim => {
                let a = f.actions.to_f32().map_err(|e| {
                    fragment_error(f, format!("actions: {e} (the policy is continuous)"))
                })?;
                if a.len() != t_len * n * dim {
                    return Err(fragment_error(
                        f,
                        format!(
                            "actions have {} dims, the policy has {dim}",
                            a.len() / (t_len * n)
                        ),
                    ));
                }
                out.actions_continuous.extend_from_slice(&a);
            }
        }

        let values = model.values(&obs, t_len * n)?;
        let tail_values = model.values(&next_obs, n)?;
        let final_values = if final_obs.is_empty() {
            Vec::new()
        } else {
            model.values(&final_obs, final_obs.len() / obs_dim)?
        };

        // V(s_{t+1}) for each step: the next row, the tail, or (truncation
        // alone) the value of the episode's final observation.
        let mut final_values = final_values.into_iter();
        let next_values: Vec<f32> = (0..t_len * n)
            .map(|idx| {
                if truncated[idx] && !terminated[idx] {
                    final_values
                        .next()
                        .expect("one final observation per truncation")
                } else if idx + n < t_len * n {
                    values[idx + n]
                } else {
                    tail_values[idx % n]
                }
            })
            .collect();

        let mut advantages = vec![0f32; t_len * n];
        let mut returns = vec![0f32; t_len * n];
        let column =
            |v: &[f32], i: usize| -> Vec<f32> { (0..t_len).map(|t| v[t * n + i]).collect() };
        let column_b =
            |v: &[bool], i: usize| -> Vec<bool> { (0..t_len).map(|t| v[t * n + i]).collect() };
        for i in 0..n {
            let term = column_b(&terminated, i);
            let ends: Vec<bool> = (0..t_len)
                .map(|t| terminated[t * n + i] || truncated[t * n + i])
                .collect();
            let (adv, ret) = relay_nn::gae(
                &column(&rewards, i),
                &column(&values, i),
                &column(&next_values, i),
                &term,
                &ends,
                gamma as f32,
                gae_lambda as f32,
            )?;
            for t in 0..t_len {
                advantages[t * n + i] = adv[t];
                returns[t * n + i] = ret[t];
            }
        }

        out.obs.extend_from_slice(&obs);
        out.old_logprobs.extend_from_slice(&logprobs);
        out.old_values.extend_from_slice(&values);
        out.advantages.extend_from_slice(&advantages);
        out.returns.extend_from_slice(&returns);
        out.len += t_len * n;
        out.vec_steps += t_len as u64;
        out.oldest_version = out.oldest_version.min(f.policy_version);
    }
    Ok(out)
}

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
    pub gradient_steps: u64,
    pub epochs_done: usize,
    pub kl_early_stop: bool,
}

/// Step 2: epochs of minibatch gradient steps on a prepared rollout.
pub fn update(
    model: &ActorCritic,
    adam: &mut Adam,
    rollout: &Rollout,
    cfg: &PpoConfig,
    progress: f64,
    rng: &mut impl rand::Rng,
) -> Result<UpdateStats, PpoError> {
    let learning_rate = cfg.lr_schedule.at(cfg.learning_rate, progress);
    let clip_range = cfg.clip_schedule.at(cfg.clip_range, progress);
    adam.set_lr(learning_rate);
    let loss_config = PpoLossConfig {
        clip_range,
        clip_range_vf: cfg.clip_range_vf,
        vf_coef: cfg.vf_coef,
        ent_coef: cfg.ent_coef,
        normalize_advantage: cfg.normalize_advantage,
    };
    let device = Device::Cpu;
    let mut stats = UpdateStats {
        learning_rate,
        clip_range,
        explained_variance: relay_nn::explained_variance(&rollout.old_values, &rollout.returns)
            as f64,
        ..Default::default()
    };
    let mut indices: Vec<usize> = (0..rollout.len).collect();
    let minibatch = cfg.minibatch_size.min(rollout.len).max(1);
    let (d, a) = (rollout.obs_dim, rollout.action_dim);
    'epochs: for _ in 0..cfg.epochs {
        indices.shuffle(rng);
        let mut epoch_kls = Vec::new();
        for chunk in indices.chunks(minibatch) {
            let m = chunk.len();
            let gather = |src: &[f32]| -> Vec<f32> { chunk.iter().map(|&j| src[j]).collect() };
            let obs: Vec<f32> = chunk
                .iter()
                .flat_map(|&j| rollout.obs[j * d..(j + 1) * d].iter().copied())
                .collect();
            let obs = Tensor::from_vec(obs, (m, d), &device)?;
            let actions = if a == 0 {
                Tensor::from_vec(
                    chunk
                        .iter()
                        .map(|&j| rollout.actions_discrete[j])
                        .collect::<Vec<u32>>(),
                    m,
                    &device,
                )?
            } else {
                let v: Vec<f32> = chunk
                    .iter()
                    .flat_map(|&j| {
                        rollout.actions_continuous[j * a..(j + 1) * a]
                            .iter()
                            .copied()
                    })
                    .collect();
                Tensor::from_vec(v, (m, a), &device)?
            };
            let (old_logprob, old_values) =
                (gather(&rollout.old_logprobs), gather(&rollout.old_values));
            let (advantages, returns) = (gather(&rollout.advantages), gather(&rollout.returns));

            let (logprob, entropy, values) = model.evaluate(&obs, &actions)?;
            // The plain estimator of KL(old || new), beside the loss's approx_kl.
            let kl = logprob
                .to_vec1::<f32>()?
                .iter()
                .zip(&old_logprob)
                .map(|(new, old)| (old - new) as f64)
                .sum::<f64>()
                / m as f64;
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
            let mut grads = loss.loss.backward()?;
            let grad_norm = clip_grad_norm(&mut grads, adam.vars(), cfg.max_grad_norm as f32)?;
            adam.step(&grads)?;

            let s = &loss.stats;
            stats.policy_loss += s.policy_loss as f64;
            stats.value_loss += s.value_loss as f64;
            stats.entropy += s.entropy as f64;
            stats.total_loss += s.loss as f64;
            stats.approx_kl += s.approx_kl as f64;
            stats.kl += kl;
            stats.clip_fraction += s.clip_fraction as f64;
            stats.value_clip_fraction += s.value_clip_fraction as f64;
            stats.ratio_mean += s.ratio_mean as f64;
            stats.ratio_var += s.ratio_var as f64;
            stats.grad_norm += grad_norm as f64;
            stats.gradient_steps += 1;
            epoch_kls.push(s.approx_kl as f64);
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

#[cfg(test)]
mod tests {
    use super::*;
    use relay_nn::PolicySpec;
    use relay_proto::{Tensor, SCHEMA_VERSION};

    /// T = 3 steps, N = 2 envs. Env 0 is truncated at t = 1 (bootstrap from
    /// its final observation), env 1 terminates at t = 1 (no bootstrap), and
    /// both run on past t = 2 (bootstrap from `next_obs`).
    #[test]
    fn gae_bootstraps_through_truncation_not_termination() {
        let model = ActorCritic::new(&PolicySpec::discrete(4, 2), 7).unwrap();
        let obs: Vec<f32> = (0..24).map(|i| (i as f32 * 0.37).sin()).collect();
        let next_obs: Vec<f32> = (0..8).map(|i| (i as f32 * 0.91).cos()).collect();
        let final_obs: Vec<f32> = vec![0.3, -0.2, 0.1, 0.05];
        let rewards = [1.0f32, 0.5, 2.0, -1.0, 0.25, 1.5];
        let terminated = [false, false, false, true, false, false];
        let truncated = [false, false, true, false, false, false];
        let fragment = RolloutFragment {
            schema: SCHEMA_VERSION,
            runner_id: "t".into(),
            env_id: "CartPole-v1".into(),
            policy_version: 0,
            num_steps: 3,
            num_envs: 2,
            obs: Tensor::from_f32(&[3, 2, 4], &obs),
            actions: Tensor::from_i64(&[3, 2], &[0, 1, 1, 0, 0, 1]),
            logprobs: Tensor::from_f32(&[3, 2], &[-0.7; 6]),
            values: Tensor::from_f32(&[3, 2], &[0.0; 6]),
            rewards: Tensor::from_f32(&[3, 2], &rewards),
            terminated: Tensor::from_bool(&[3, 2], &terminated),
            truncated: Tensor::from_bool(&[3, 2], &truncated),
            next_obs: Tensor::from_f32(&[2, 4], &next_obs),
            final_obs: Tensor::from_f32(&[1, 4], &final_obs),
        };
        let (gamma, lambda) = (0.9f32, 0.8f32);
        let rollout = prepare(&model, &[fragment], gamma as f64, lambda as f64).unwrap();

        let v = model.values(&obs, 6).unwrap();
        let tail = model.values(&next_obs, 2).unwrap();
        let v_final = model.values(&final_obs, 1).unwrap()[0];
        // Env 0: t2 bootstraps from tail; t1 is truncated (bootstrap from final obs, no carry); t0 carries from t1.
        let d02 = rewards[4] + gamma * tail[0] - v[4];
        let d01 = rewards[2] + gamma * v_final - v[2];
        let d00 = rewards[0] + gamma * v[2] - v[0];
        let a0 = [d00 + gamma * lambda * d01, d01, d02];
        // Env 1: t1 terminated (no bootstrap, no carry).
        let d12 = rewards[5] + gamma * tail[1] - v[5];
        let d11 = rewards[3] - v[3];
        let d10 = rewards[1] + gamma * v[3] - v[1];
        let a1 = [d10 + gamma * lambda * d11, d11, d12];
        let expected = [a0[0], a1[0], a0[1], a1[1], a0[2], a1[2]];
        for (i, (got, want)) in rollout.advantages.iter().zip(expected).enumerate() {
            assert!((got - want).abs() < 1e-5, "step {i}: {got} vs {want}");
        }
        for i in 0..6 {
            assert!((rollout.returns[i] - (expected[i] + v[i])).abs() < 1e-5);
        }
        assert_eq!(rollout.len, 6);
        assert_eq!(rollout.vec_steps, 3);
    }

    #[test]
    fn a_fragment_of_another_shape_is_an_error_not_a_panic() {
        let model = ActorCritic::new(&PolicySpec::discrete(4, 2), 7).unwrap();
        let fragment = RolloutFragment {
            schema: SCHEMA_VERSION,
            runner_id: "t".into(),
            env_id: "Acrobot-v1".into(),
            policy_version: 0,
            num_steps: 1,
            num_envs: 1,
            obs: Tensor::from_f32(&[1, 1, 6], &[0.0; 6]),
            actions: Tensor::from_i64(&[1, 1], &[0]),
            logprobs: Tensor::from_f32(&[1, 1], &[-0.7]),
            values: Tensor::from_f32(&[1, 1], &[0.0]),
            rewards: Tensor::from_f32(&[1, 1], &[1.0]),
            terminated: Tensor::from_bool(&[1, 1], &[false]),
            truncated: Tensor::from_bool(&[1, 1], &[false]),
            next_obs: Tensor::from_f32(&[1, 6], &[0.0; 6]),
            final_obs: Tensor::from_f32(&[0, 6], &[]),
        };
        let err = prepare(&model, &[fragment], 0.99, 0.95)
            .err()
            .expect("rejected");
        assert!(err.to_string().contains("features"), "{err}");
    }
}
