//! The rollout that PPO ([`crate::ppo`]) and A2C ([`crate::a2c`]) train on:
//! fragments flattened into one batch, with GAE advantages and returns.
//!
//! [`prepare`] takes the values of every observation from the current
//! critic (fresher than the acting policy's when the rollout lags a
//! version), then runs GAE per env column of each fragment. A terminated
//! step is never bootstrapped; a truncated one (time limit) bootstraps from
//! the value of its final observation; the fragment's tail bootstraps from
//! `next_obs`.

use candle_core::{Device, Tensor};
use relay_nn::{ActorCritic, NnError};
use relay_proto::{ObsField, RolloutFragment};

/// Why an update could not be made.
#[derive(Debug, thiserror::Error)]
pub enum UpdateError {
    #[error(transparent)]
    Nn(#[from] NnError),
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
    #[error("fragment from {runner}: {detail}")]
    Fragment { runner: String, detail: String },
    #[error("learner replicas: {0}")]
    Replicas(String),
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
    /// Envs with action masks: `len * n_actions`, 1 = legal (rows of
    /// fragments without masks allow every action); empty otherwise.
    pub masks: Vec<u8>,
    /// Actions per mask row (0: no masks).
    pub mask_width: usize,
    pub len: usize,
    /// Vector steps (sum of fragment lengths) in this rollout.
    pub vec_steps: u64,
    /// Oldest policy version that acted in it.
    pub oldest_version: u64,
}

fn fragment_error(f: &RolloutFragment, detail: impl std::fmt::Display) -> UpdateError {
    UpdateError::Fragment {
        runner: f.runner_id.clone(),
        detail: detail.to_string(),
    }
}

/// One fragment's arrays, decoded and checked against the policy's shape
/// (the wire already checked them against each other). Rows are `t * n + i`.
pub struct Decoded {
    /// Vector steps `T`.
    pub t_len: usize,
    /// Envs `N`.
    pub n: usize,
    /// `[T * N * obs_dim]`.
    pub obs: Vec<f32>,
    /// `[N * obs_dim]`: the observation after the last step of each env.
    pub next_obs: Vec<f32>,
    /// `[K * obs_dim]`: last observation of each truncated, not terminated
    /// episode, in row order.
    pub final_obs: Vec<f32>,
    pub rewards: Vec<f32>,
    pub terminated: Vec<bool>,
    pub truncated: Vec<bool>,
    pub logprobs: Vec<f32>,
    /// Discrete actions (empty for a continuous policy).
    pub actions_discrete: Vec<u32>,
    /// Continuous actions, `T * N * action_dim` (empty for a discrete policy).
    pub actions_continuous: Vec<f32>,
    /// Envs with action masks: `T * N * n_actions`, 1 = legal.
    pub masks: Option<Vec<u8>>,
}

impl Decoded {
    /// Decodes `f` for a policy of `obs_dim` inputs and `action_dim`
    /// continuous outputs (0: discrete).
    pub fn new(
        f: &RolloutFragment,
        obs_dim: usize,
        action_dim: usize,
    ) -> Result<Self, UpdateError> {
        let (t_len, n) = (f.num_steps as usize, f.num_envs as usize);
        let masks = f.masks.as_ref().map(|m| m.obs.data.clone());
        let rows = |field| f.observations(field).map_err(|e| fragment_error(f, e));
        let obs = rows(ObsField::Obs)?;
        if obs.len() != t_len * n * obs_dim {
            return Err(fragment_error(
                f,
                format!(
                    "observations have {} features per step, the policy takes {obs_dim}",
                    obs.len() / (t_len * n).max(1)
                ),
            ));
        }
        let (mut actions_discrete, mut actions_continuous) = (Vec::new(), Vec::new());
        match action_dim {
            0 => {
                let a = f.actions.to_i64().map_err(|e| {
                    fragment_error(f, format!("actions: {e} (the policy is discrete)"))
                })?;
                actions_discrete.extend(a.iter().map(|&a| a as u32));
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
                actions_continuous = a;
            }
        }
        Ok(Self {
            t_len,
            n,
            obs,
            next_obs: rows(ObsField::Next)?,
            final_obs: rows(ObsField::Final)?,
            rewards: f.rewards.to_f32().map_err(|e| fragment_error(f, e))?,
            terminated: f.terminated.to_bool().map_err(|e| fragment_error(f, e))?,
            truncated: f.truncated.to_bool().map_err(|e| fragment_error(f, e))?,
            logprobs: f.logprobs.to_f32().map_err(|e| fragment_error(f, e))?,
            actions_discrete,
            actions_continuous,
            masks,
        })
    }
}

/// The policy's discrete action count (`None`: continuous), the width of
/// its action masks.
pub fn mask_width(model: &ActorCritic) -> Option<usize> {
    match &model.spec().action {
        relay_nn::ActionKind::Discrete { n } => Some(*n),
        relay_nn::ActionKind::Continuous { .. } => None,
    }
}

/// Checks that a fragment's masks are of the policy's action count.
pub fn check_mask_width(f: &RolloutFragment, n_actions: Option<usize>) -> Result<(), UpdateError> {
    let Some(masks) = &f.masks else {
        return Ok(());
    };
    let width = masks.obs.shape.last().copied().unwrap_or(0) as usize;
    match n_actions {
        Some(k) if k == width => Ok(()),
        Some(k) => Err(fragment_error(
            f,
            format!("action masks of {width} actions, the policy has {k}"),
        )),
        None => Err(fragment_error(
            f,
            "action masks for a policy of continuous actions",
        )),
    }
}

/// The policy's action width for [`Decoded::new`]: 0 for discrete actions.
pub fn action_dim(model: &ActorCritic) -> usize {
    match &model.spec().action {
        relay_nn::ActionKind::Discrete { .. } => 0,
        relay_nn::ActionKind::Continuous { dim, .. } => *dim,
    }
}

/// Values from the current critic, then GAE per env column.
pub fn prepare(
    model: &ActorCritic,
    fragments: &[RolloutFragment],
    gamma: f64,
    gae_lambda: f64,
) -> Result<Rollout, UpdateError> {
    let obs_dim = model.spec().obs_dim;
    let action_dim = action_dim(model);
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
        masks: Vec::new(),
        mask_width: 0,
        len: 0,
        vec_steps: 0,
        oldest_version: u64::MAX,
    };
    let n_actions = mask_width(model);
    for f in fragments {
        check_mask_width(f, n_actions)?;
    }
    let masked = fragments.iter().any(|f| f.masks.is_some());
    if masked {
        out.mask_width = n_actions.expect("checked: masks only for discrete policies");
    }
    for f in fragments {
        let Decoded {
            t_len,
            n,
            obs,
            next_obs,
            final_obs,
            rewards,
            terminated,
            truncated,
            logprobs,
            actions_discrete,
            actions_continuous,
            masks,
        } = Decoded::new(f, obs_dim, action_dim)?;
        if masked {
            match masks {
                Some(m) => out.masks.extend(m),
                None => out
                    .masks
                    .resize(out.masks.len() + t_len * n * out.mask_width, 1),
            }
        }
        out.actions_discrete.extend(actions_discrete);
        out.actions_continuous.extend(actions_continuous);

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

impl Rollout {
    /// Observations of rows `rows` as a `[rows, obs_dim]` tensor on `device`.
    pub fn obs_tensor(&self, rows: &[usize], device: &Device) -> Result<Tensor, UpdateError> {
        let d = self.obs_dim;
        let obs: Vec<f32> = rows
            .iter()
            .flat_map(|&j| self.obs[j * d..(j + 1) * d].iter().copied())
            .collect();
        Ok(Tensor::from_vec(obs, (rows.len(), d), device)?)
    }

    /// Action masks of rows `rows` as a `[rows, n_actions]` u8 tensor on
    /// `device`, for a rollout with masks.
    pub fn masks_tensor(
        &self,
        rows: &[usize],
        device: &Device,
    ) -> Result<Option<Tensor>, UpdateError> {
        let w = self.mask_width;
        if w == 0 {
            return Ok(None);
        }
        let masks: Vec<u8> = rows
            .iter()
            .flat_map(|&j| self.masks[j * w..(j + 1) * w].iter().copied())
            .collect();
        Ok(Some(Tensor::from_vec(masks, (rows.len(), w), device)?))
    }

    /// Actions of rows `rows` on `device`: `[rows]` u32 (discrete) or
    /// `[rows, action_dim]` f32.
    pub fn actions_tensor(&self, rows: &[usize], device: &Device) -> Result<Tensor, UpdateError> {
        let (m, a) = (rows.len(), self.action_dim);
        Ok(if a == 0 {
            Tensor::from_vec(
                rows.iter()
                    .map(|&j| self.actions_discrete[j])
                    .collect::<Vec<u32>>(),
                m,
                device,
            )?
        } else {
            let v: Vec<f32> = rows
                .iter()
                .flat_map(|&j| self.actions_continuous[j * a..(j + 1) * a].iter().copied())
                .collect();
            Tensor::from_vec(v, (m, a), device)?
        })
    }
}

/// Steps of a fragment for tests, row-major `(t, env)`.
#[cfg(test)]
pub(crate) struct TestSteps<'a> {
    pub obs: &'a [f32],
    pub actions: &'a [i64],
    pub rewards: &'a [f32],
    pub terminated: &'a [bool],
    pub truncated: &'a [bool],
    pub next_obs: &'a [f32],
    pub final_obs: &'a [f32],
}

/// A fragment of `t x n` steps of a discrete-action env (`obs_dim` taken
/// from the sizes), for tests.
#[cfg(test)]
pub(crate) fn test_fragment(
    runner: &str,
    version: u64,
    t: usize,
    n: usize,
    steps: TestSteps<'_>,
) -> RolloutFragment {
    use relay_proto::Tensor as Wire;
    let d = steps.obs.len() / (t * n);
    RolloutFragment {
        schema: relay_proto::SCHEMA_VERSION,
        runner_id: runner.into(),
        env_id: "CartPole-v1".into(),
        policy_version: version,
        num_steps: t as u32,
        num_envs: n as u32,
        obs: Wire::from_f32(&[t, n, d], steps.obs),
        actions: Wire::from_i64(&[t, n], steps.actions),
        logprobs: Wire::from_f32(&[t, n], &vec![-0.7; t * n]),
        values: Wire::from_f32(&[t, n], &vec![0.0; t * n]),
        rewards: Wire::from_f32(&[t, n], steps.rewards),
        terminated: Wire::from_bool(&[t, n], steps.terminated),
        truncated: Wire::from_bool(&[t, n], steps.truncated),
        next_obs: Wire::from_f32(&[n, d], steps.next_obs),
        final_obs: Wire::from_f32(&[steps.final_obs.len() / d, d], steps.final_obs),
        norm_rewards: None,
        norm_delta: None,
        masks: None,
        frames: None,
    }
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
            norm_rewards: None,
            norm_delta: None,
            masks: None,
            frames: None,
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
            norm_rewards: None,
            norm_delta: None,
            masks: None,
            frames: None,
        };
        let err = prepare(&model, &[fragment], 0.99, 0.95)
            .err()
            .expect("rejected");
        assert!(err.to_string().contains("features"), "{err}");
    }
}
