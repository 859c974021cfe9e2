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
    /// A replica's share of the update failed (its sum across the
    /// replicas, or shares that do not make one batch).
    #[error("learner replicas: {0}")]
    Share(#[from] relay_nn::ShareError),
    /// The learner is stopping ([`relay_nn::BatchShare::stopping`]):
    /// the update ended part-way, and the caller rolls it back.
    #[error("the update was stopped part-way: the learner is stopping")]
    Stopped,
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
    /// Recurrent policies: the rollout's sequences (each env column of each
    /// fragment), which minibatches take whole.
    pub sequences: Option<Sequences>,
}

/// A recurrent policy's rollout as sequences: each env column of each
/// fragment is one, of the fragments' common length, trained by
/// backpropagation through time from the state it started with.
pub struct Sequences {
    /// Steps of each sequence.
    pub t_len: usize,
    /// The row of each sequence's first step; step `t` is `t * stride`
    /// rows further (its fragment's env count).
    first_row: Vec<usize>,
    stride: Vec<usize>,
    /// Each sequence's state before its first step, `state_width` values.
    initial: Vec<f32>,
    state_width: usize,
    /// Per row: the step starts an episode inside its sequence (the state
    /// is zeroed before it). A sequence's first step never does: its
    /// initial state already is what the env-runner acted with.
    episode_starts: Vec<bool>,
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

/// The current critic's values of a fragment's observations `[T N]`, of
/// its `next_obs` `[N]` and of its final observations `[K]`. A recurrent
/// critic replays each env's column from the fragment's initial state,
/// zeroing it where an episode starts: a final observation is valued with
/// the state after its episode's last step, `next_obs` with the state
/// after the fragment's last step (zero where that step ended an episode).
fn fragment_values(
    model: &ActorCritic,
    f: &RolloutFragment,
    d: &Decoded,
) -> Result<FragmentValues, UpdateError> {
    let (t_len, n, obs_dim) = (d.t_len, d.n, model.spec().obs_dim);
    let width = model.state_width();
    if width == 0 {
        let final_values = if d.final_obs.is_empty() {
            Vec::new()
        } else {
            model.values(&d.final_obs, d.final_obs.len() / obs_dim)?
        };
        return Ok(FragmentValues {
            steps: model.values(&d.obs, t_len * n)?,
            tail: model.values(&d.next_obs, n)?,
            finals: final_values,
        });
    }
    let mut state = initial_state(f, n, width)?;
    let mut values = Vec::with_capacity(t_len * n);
    let mut final_values = Vec::new();
    let mut finals = d.final_obs.chunks_exact(obs_dim);
    for t in 0..t_len {
        let rows = t * n..(t + 1) * n;
        values.extend(model.values_recurrent(
            &d.obs[rows.start * obs_dim..rows.end * obs_dim],
            n,
            &mut state,
        )?);
        for i in 0..n {
            let idx = t * n + i;
            let row = &mut state[i * width..(i + 1) * width];
            if d.truncated[idx] && !d.terminated[idx] {
                let last = finals.next().expect("one final observation per truncation");
                let mut after = row.to_vec();
                final_values.extend(model.values_recurrent(last, 1, &mut after)?);
            }
            if d.terminated[idx] || d.truncated[idx] {
                row.fill(0.0);
            }
        }
    }
    let tail = model.values_recurrent(&d.next_obs, n, &mut state)?;
    Ok(FragmentValues {
        steps: values,
        tail,
        finals: final_values,
    })
}

/// [`fragment_values`]: `V` of each step's observation `[T N]`, of the
/// observation after the last step `[N]`, and of each final observation
/// of a truncated episode `[K]`.
struct FragmentValues {
    steps: Vec<f32>,
    tail: Vec<f32>,
    finals: Vec<f32>,
}

/// A recurrent policy's fragment's initial state, `n` rows of `width`.
fn initial_state(f: &RolloutFragment, n: usize, width: usize) -> Result<Vec<f32>, UpdateError> {
    let state = f.initial_state.as_ref().ok_or_else(|| {
        fragment_error(
            f,
            "no initial_state: the policy is recurrent (policy.recurrent), the env-runner sent a feed-forward fragment",
        )
    })?;
    let values = state.to_f32().map_err(|e| fragment_error(f, e))?;
    if values.len() != n * width {
        return Err(fragment_error(
            f,
            format!(
                "initial_state of {} values per env, the policy's state has {width}",
                values.len() / n.max(1)
            ),
        ));
    }
    Ok(values)
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
        sequences: None,
    };
    let state_width = model.state_width();
    let n_actions = mask_width(model);
    for f in fragments {
        check_mask_width(f, n_actions)?;
    }
    let masked = fragments.iter().any(|f| f.masks.is_some());
    if masked {
        out.mask_width = n_actions.expect("checked: masks only for discrete policies");
    }
    for f in fragments {
        let decoded = Decoded::new(f, obs_dim, action_dim)?;
        let FragmentValues {
            steps: values,
            tail: tail_values,
            finals: final_values,
        } = fragment_values(model, f, &decoded)?;
        let Decoded {
            t_len,
            n,
            obs,
            rewards,
            terminated,
            truncated,
            logprobs,
            actions_discrete,
            actions_continuous,
            masks,
            ..
        } = decoded;
        if state_width > 0 {
            let seqs = out.sequences.get_or_insert_with(|| Sequences {
                t_len,
                first_row: Vec::new(),
                stride: Vec::new(),
                initial: Vec::new(),
                state_width,
                episode_starts: Vec::new(),
            });
            if seqs.t_len != t_len {
                return Err(fragment_error(
                    f,
                    format!(
                        "a fragment of {t_len} steps among fragments of {}: a recurrent policy trains on sequences of one length (env_runner.fragment_steps)",
                        seqs.t_len
                    ),
                ));
            }
            seqs.initial.extend(initial_state(f, n, state_width)?);
            for i in 0..n {
                seqs.first_row.push(out.len + i);
                seqs.stride.push(n);
            }
            seqs.episode_starts.extend(
                (0..t_len * n).map(|idx| idx >= n && (terminated[idx - n] || truncated[idx - n])),
            );
        }
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
    /// What minibatches are drawn from: sequences for a recurrent policy,
    /// else rows.
    pub fn units(&self) -> usize {
        self.sequences
            .as_ref()
            .map_or(self.len, |s| s.first_row.len())
    }

    /// Rows per unit: a sequence's steps, or 1.
    pub fn unit_len(&self) -> usize {
        self.sequences.as_ref().map_or(1, |s| s.t_len)
    }

    /// The rows of `units`: themselves, or the sequences' steps time-major
    /// (step `t` of every sequence, then step `t + 1`), the order
    /// [`Rollout::evaluate`] scores them in.
    pub fn rows_of(&self, units: &[usize]) -> Vec<usize> {
        match &self.sequences {
            None => units.to_vec(),
            Some(s) => (0..s.t_len)
                .flat_map(|t| units.iter().map(move |&u| s.first_row[u] + t * s.stride[u]))
                .collect(),
        }
    }

    /// Log-probabilities, entropies and values of `units` (rows `rows`, as
    /// [`Rollout::rows_of`] gives them) under `model`, as a graph: row by
    /// row, or for a recurrent policy by backpropagation through time over
    /// whole sequences from their initial states.
    pub fn evaluate(
        &self,
        model: &ActorCritic,
        units: &[usize],
        rows: &[usize],
    ) -> Result<(Tensor, Tensor, Tensor), UpdateError> {
        let device = model.device();
        let obs = self.obs_tensor(rows, device)?;
        let actions = self.actions_tensor(rows, device)?;
        let masks = self.masks_tensor(rows, device)?;
        Ok(match &self.sequences {
            None => model.evaluate_masked(&obs, &actions, masks.as_ref())?,
            Some(s) => {
                let w = s.state_width;
                let initial: Vec<f32> = units
                    .iter()
                    .flat_map(|&u| s.initial[u * w..(u + 1) * w].iter().copied())
                    .collect();
                let starts: Vec<bool> = rows.iter().map(|&r| s.episode_starts[r]).collect();
                model.evaluate_sequences(
                    &obs,
                    s.t_len,
                    &starts,
                    &Tensor::from_vec(initial, (units.len(), w), device)?,
                    &actions,
                    masks.as_ref(),
                )?
            }
        })
    }

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
        initial_state: None,
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
            initial_state: None,
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
            initial_state: None,
        };
        let err = prepare(&model, &[fragment], 0.99, 0.95)
            .err()
            .expect("rejected");
        assert!(err.to_string().contains("features"), "{err}");
    }
}
