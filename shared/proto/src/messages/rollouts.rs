//! The data path of a run: acting (env-runner <-> inference-server), the
//! rollout fragments the env-runners ship with their normalisation
//! statistics, and the on-policy replay buffer's insert and sample.

use serde::{Deserialize, Serialize};

use super::{check_actions, check_masks, finite_f32, invalid, observations_check, tensor_check};
use crate::codec::{Rejection, WireMessage, SCHEMA_VERSION};
use crate::tensor::{DType, Tensor, TensorError};

/// env-runner -> inference-server: observations of a batch of envs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ActRequest {
    pub schema: u16,
    /// `[n, obs_dim]` f32, or uint8 for image observations.
    pub obs: Tensor,
    /// Take the mode of the action distribution instead of sampling.
    pub deterministic: bool,
    /// Envs with action masks: `[n, n_actions]` u8, 1 for each action legal
    /// in the observation; the policy acts among those only. Absent: every
    /// action is legal.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub masks: Option<Tensor>,
    /// Act with this past weights version (a league opponent) instead of
    /// the newest: servers build it from the run's league bucket and
    /// answer 404 when it is not stored there. Absent: the newest.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub policy_version: Option<u64>,
    /// Recurrent policies (`policy.recurrent`): `[n, state_width]` f32, each
    /// env's recurrent state before this step (zeros at an episode's
    /// start), which the env-runner keeps and the reply advances. Absent:
    /// zeros, or a feed-forward policy.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub state: Option<Tensor>,
    /// gSDE policies (`policy.use_sde`): each row's exploration-matrix
    /// seed, which the env-runner holds for `policy.sde_sample_freq` steps
    /// so that the env's noise is held whichever server acts it. Absent:
    /// a fresh matrix for each row.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub noise_seeds: Option<Vec<u64>>,
}

impl ActRequest {
    pub fn new(obs: Tensor, deterministic: bool) -> Self {
        Self {
            schema: SCHEMA_VERSION,
            obs,
            deterministic,
            masks: None,
            policy_version: None,
            state: None,
            noise_seeds: None,
        }
    }

    /// The request with each row's gSDE seed (see [`Self::noise_seeds`]).
    pub fn with_noise_seeds(mut self, seeds: Option<Vec<u64>>) -> Self {
        self.noise_seeds = seeds;
        self
    }

    /// The request with each row's recurrent state (see [`Self::state`]).
    pub fn with_state(mut self, state: Option<Tensor>) -> Self {
        self.state = state;
        self
    }

    /// The request for past version `version` (see [`Self::policy_version`]).
    pub fn at_version(mut self, version: Option<u64>) -> Self {
        self.policy_version = version;
        self
    }

    /// The request with the observations' action masks.
    pub fn with_masks(mut self, masks: Option<Tensor>) -> Self {
        self.masks = masks;
        self
    }
}

wire_message!(ActRequest, "ActRequest", |m: &ActRequest| {
    observations_check("ActRequest", "obs", &m.obs, &[None, None], None)?;
    if m.obs.shape[0] == 0 {
        return Err(invalid("ActRequest", "obs", "batch of zero observations"));
    }
    if let Some(masks) = &m.masks {
        check_masks(
            "ActRequest",
            "masks",
            masks,
            &[m.obs.shape[0] as usize],
            None,
        )?;
    }
    if let Some(state) = &m.state {
        let n = m.obs.shape[0] as usize;
        tensor_check(
            "ActRequest",
            "state",
            state.expect(DType::F32, &[Some(n), None]),
        )?;
        finite_f32("ActRequest", "state", state)?;
    }
    if let Some(seeds) = &m.noise_seeds {
        if seeds.len() != m.obs.shape[0] as usize {
            return Err(invalid(
                "ActRequest",
                "noise_seeds",
                format!(
                    "{} seeds for {} rows (one a row)",
                    seeds.len(),
                    m.obs.shape[0]
                ),
            ));
        }
    }
    Ok(())
});

/// inference-server -> env-runner: one action per observation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ActReply {
    pub schema: u16,
    /// The weights version that produced these actions.
    pub policy_version: u64,
    /// `[n]` i64 (discrete) or `[n, action_dim]` f32 (continuous, before clipping to the bounds).
    pub actions: Tensor,
    /// `[n]` f32 log-probability of each action under the policy.
    pub logprobs: Tensor,
    /// `[n]` f32 value estimates.
    pub values: Tensor,
    /// Recurrent policies: `[n, state_width]` f32, each env's state after
    /// this step (what its next request sends, unless its episode ended).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub state: Option<Tensor>,
}

wire_message!(ActReply, "ActReply", |m: &ActReply| {
    tensor_check(
        "ActReply",
        "logprobs",
        m.logprobs.expect(DType::F32, &[None]),
    )?;
    let n = m.logprobs.shape[0] as usize;
    tensor_check(
        "ActReply",
        "values",
        m.values.expect(DType::F32, &[Some(n)]),
    )?;
    check_actions("ActReply", &m.actions, &[n])?;
    finite_f32("ActReply", "logprobs", &m.logprobs)?;
    if let Some(state) = &m.state {
        tensor_check(
            "ActReply",
            "state",
            state.expect(DType::F32, &[Some(n), None]),
        )?;
        finite_f32("ActReply", "state", state)?;
    }
    finite_f32("ActReply", "values", &m.values)
});

/// env-runner -> replay-buffer: `num_steps` consecutive vector steps of
/// `num_envs` envs, all acted by one policy version.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RolloutFragment {
    pub schema: u16,
    /// Which env-runner copy produced it.
    pub runner_id: String,
    pub env_id: String,
    /// The oldest weights version that acted in this fragment.
    pub policy_version: u64,
    pub num_steps: u32,
    pub num_envs: u32,
    /// `[T, N, obs_dim]` f32 (uint8 for image observations): observation
    /// each action was taken in. With [`RolloutFragment::frames`]: `[T, N,
    /// planes]` u32, the index of each of the observation's planes in it.
    pub obs: Tensor,
    /// `[T, N]` i64 or `[T, N, action_dim]` f32.
    pub actions: Tensor,
    /// `[T, N]` f32 behaviour log-probabilities.
    pub logprobs: Tensor,
    /// `[T, N]` f32 behaviour value estimates.
    pub values: Tensor,
    /// `[T, N]` f32.
    pub rewards: Tensor,
    /// `[T, N]` u8: the episode ended in a terminal state (no bootstrap).
    pub terminated: Tensor,
    /// `[T, N]` u8: the episode was cut by a time limit. Gymnasium sets it
    /// whenever the limit is reached, even on a terminal step; a terminal
    /// step is never bootstrapped.
    pub truncated: Tensor,
    /// `[N, obs_dim]`, of `obs`'s dtype: observation after the last step
    /// (bootstraps the fragment's tail). With `frames`: `[N, planes]` u32.
    pub next_obs: Tensor,
    /// `[K, obs_dim]`, of `obs`'s dtype: the last observation of each episode that was
    /// truncated and not terminated (the ones to bootstrap from), in `(t, env)`
    /// row-major order. With `frames`: `[K, planes]` u32.
    pub final_obs: Tensor,
    /// Image observations stored once: `[F, plane]` uint8, each distinct
    /// plane (one frame of a frame stack, `plane = height x width`) of the
    /// fragment's observations. A stack of 4 frames shares 3 with the
    /// step before, so a fragment of `T` steps holds about `T + 3` frames
    /// per env instead of `4 T` (Stable-Baselines3's
    /// `optimize_memory_usage`, generalised). The observations are then
    /// `u32` plane indices; [`RolloutFragment::observations`] gives them
    /// back whole. Absent for flat observations (and from older writers).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub frames: Option<Tensor>,
    /// Runs with `normalize.reward`: `[T, N]` f32, each reward scaled by
    /// the env-runner's running std of the discounted return and clipped
    /// (what the learner trains on); `rewards` stays raw. Absent otherwise
    /// (and from env-runners that predate normalisation).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub norm_rewards: Option<Tensor>,
    /// Runs with a `normalize` section on: the observation and return
    /// statistics the env-runner gathered since its previous fragment
    /// (count 0 when nothing), which the learner merges into the run's
    /// statistics. In such runs `obs`, `next_obs` and `final_obs` are the
    /// normalised observations the policy saw.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub norm_delta: Option<NormStats>,
    /// Envs with action masks: the actions legal in each observation, which
    /// the losses mask the policy with. Absent for envs without masks (and
    /// with `env.action_masks: false`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub masks: Option<FragmentMasks>,
    /// Recurrent policies: `[N, state_width]` f32, each env's recurrent
    /// state before the fragment's first step, from which the learner
    /// replays the fragment (zeroing it at each episode start: a step
    /// after a terminated or truncated one). Absent for feed-forward
    /// policies.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub initial_state: Option<Tensor>,
}

/// The action masks of a fragment's observations: u8, 1 = legal, every row
/// allowing an action (a final state that allows none is sent as allowing
/// all: nothing acts in it, and a value taken over it is a plain max).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FragmentMasks {
    /// `[T, N, n_actions]`: of `obs`.
    pub obs: Tensor,
    /// `[N, n_actions]`: of `next_obs`.
    pub next_obs: Tensor,
    /// `[K, n_actions]`: of `final_obs`.
    pub final_obs: Tensor,
}

/// Running statistics of a stream of vectors (Stable-Baselines3's
/// `RunningMeanStd`): a few f64 numbers, so plain arrays rather than
/// tensors (the counts and merges need f64).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Moments {
    /// Vectors seen (a fresh run's statistics start at 1e-4; a delta may be 0).
    pub count: f64,
    /// Mean of each component.
    pub mean: Vec<f64>,
    /// Population variance of each component.
    pub var: Vec<f64>,
}

/// Observation and reward normalisation statistics (`normalize:`): of the
/// raw observations, and of the discounted return whose std scales rewards.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NormStats {
    /// `obs_dim` components.
    pub obs: Moments,
    /// One component.
    pub ret: Moments,
}

impl NormStats {
    /// Checks widths (`obs_dim` observation components when known, one
    /// return component) and that every number is finite, variances and
    /// counts non-negative.
    pub fn check(
        &self,
        kind: &'static str,
        field: &'static str,
        obs_dim: Option<usize>,
    ) -> Result<(), Rejection> {
        for (part, m) in [("obs", &self.obs), ("ret", &self.ret)] {
            if m.mean.len() != m.var.len() || m.mean.is_empty() {
                return Err(invalid(
                    kind,
                    field,
                    format!(
                        "{part}: {} means and {} variances",
                        m.mean.len(),
                        m.var.len()
                    ),
                ));
            }
            if !(m.count.is_finite() && m.count >= 0.0)
                || m.mean.iter().any(|x| !x.is_finite())
                || m.var.iter().any(|x| !(x.is_finite() && *x >= 0.0))
            {
                return Err(invalid(
                    kind,
                    field,
                    format!("{part}: count, means and variances must be finite, counts and variances >= 0"),
                ));
            }
        }
        if self.ret.mean.len() != 1 {
            return Err(invalid(
                kind,
                field,
                format!("ret has {} components, expected 1", self.ret.mean.len()),
            ));
        }
        if let Some(d) = obs_dim {
            if self.obs.mean.len() != d {
                return Err(invalid(
                    kind,
                    field,
                    format!(
                        "obs has {} components, the observations {d}",
                        self.obs.mean.len()
                    ),
                ));
            }
        }
        Ok(())
    }
}

/// Which observations of a fragment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ObsField {
    /// `obs`: `T x N` rows.
    Obs,
    /// `next_obs`: `N` rows.
    Next,
    /// `final_obs`: `K` rows.
    Final,
}

impl RolloutFragment {
    /// Values in one observation.
    pub fn obs_dim(&self) -> usize {
        let last = self.obs.shape.last().copied().unwrap_or(0) as usize;
        match &self.frames {
            Some(frames) => last * frames.shape.get(1).copied().unwrap_or(0) as usize,
            None => last,
        }
    }

    /// The observations of `field` as f32 rows of [`Self::obs_dim`] values
    /// (pixels widened, not scaled), planes put back together when the
    /// fragment stores frames once. Validated fragments never fail.
    pub fn observations(&self, field: ObsField) -> Result<Vec<f32>, TensorError> {
        let tensor = match field {
            ObsField::Obs => &self.obs,
            ObsField::Next => &self.next_obs,
            ObsField::Final => &self.final_obs,
        };
        let Some(frames) = &self.frames else {
            return tensor.observations_to_f32();
        };
        let plane = frames.shape.get(1).copied().unwrap_or(0) as usize;
        let indices = tensor.to_u32()?;
        let mut out = Vec::with_capacity(indices.len() * plane);
        for &i in &indices {
            let at = i as usize * plane;
            let Some(pixels) = frames.data.get(at..at + plane) else {
                return Err(TensorError::Shape {
                    want: frames.shape.clone(),
                    got: vec![i],
                });
            };
            out.extend(pixels.iter().map(|&b| f32::from(b)));
        }
        Ok(out)
    }

    /// Number of env steps (`T * N`).
    pub fn env_steps(&self) -> u64 {
        self.num_steps as u64 * self.num_envs as u64
    }

    /// Steps that end an episode, by termination or truncation.
    pub fn episodes_ended(&self) -> u64 {
        self.terminated
            .data
            .iter()
            .zip(&self.truncated.data)
            .filter(|(&term, &trunc)| term != 0 || trunc != 0)
            .count() as u64
    }

    /// Steps that end an episode by truncation alone: each has a `final_obs` row.
    pub fn bootstrap_count(&self) -> usize {
        self.terminated
            .data
            .iter()
            .zip(&self.truncated.data)
            .filter(|(&term, &trunc)| trunc != 0 && term == 0)
            .count()
    }
}

wire_message!(RolloutFragment, "RolloutFragment", |m: &RolloutFragment| {
    const K: &str = "RolloutFragment";
    let (t, n) = (m.num_steps as usize, m.num_envs as usize);
    if t == 0 || n == 0 {
        return Err(invalid(K, "num_steps", "fragment holds no steps"));
    }
    if m.env_id.is_empty() {
        return Err(invalid(K, "env_id", "empty"));
    }
    let truncations = m.bootstrap_count();
    let d = match &m.frames {
        None => {
            observations_check(K, "obs", &m.obs, &[Some(t), Some(n), None], None)?;
            let d = m.obs.shape[2] as usize;
            observations_check(
                K,
                "next_obs",
                &m.next_obs,
                &[Some(n), Some(d)],
                Some(&m.obs),
            )?;
            observations_check(
                K,
                "final_obs",
                &m.final_obs,
                &[Some(truncations), Some(d)],
                Some(&m.obs),
            )?;
            d
        }
        Some(frames) => {
            tensor_check(K, "frames", frames.expect(DType::U8, &[None, None]))?;
            let (count, plane) = (frames.shape[0], frames.shape[1] as usize);
            if count == 0 || plane == 0 {
                return Err(invalid(K, "frames", "holds no frame"));
            }
            tensor_check(
                K,
                "obs",
                m.obs.expect(DType::U32, &[Some(t), Some(n), None]),
            )?;
            let planes = m.obs.shape[2] as usize;
            if planes == 0 {
                return Err(invalid(K, "obs", "observations of no plane"));
            }
            tensor_check(
                K,
                "next_obs",
                m.next_obs.expect(DType::U32, &[Some(n), Some(planes)]),
            )?;
            tensor_check(
                K,
                "final_obs",
                m.final_obs
                    .expect(DType::U32, &[Some(truncations), Some(planes)]),
            )?;
            for (field, tensor) in [
                ("obs", &m.obs),
                ("next_obs", &m.next_obs),
                ("final_obs", &m.final_obs),
            ] {
                let indices = tensor.to_u32().map_err(|source| Rejection::Tensor {
                    kind: K,
                    field: field.into(),
                    source,
                })?;
                if let Some(bad) = indices.iter().find(|&&i| i >= count) {
                    return Err(invalid(
                        K,
                        field,
                        format!("frame index {bad} of {count} frames"),
                    ));
                }
            }
            planes * plane
        }
    };
    check_actions(K, &m.actions, &[t, n])?;
    for (field, tensor) in [
        ("logprobs", &m.logprobs),
        ("values", &m.values),
        ("rewards", &m.rewards),
    ] {
        tensor_check(K, field, tensor.expect(DType::F32, &[Some(t), Some(n)]))?;
        finite_f32(K, field, tensor)?;
    }
    tensor_check(
        K,
        "terminated",
        m.terminated.expect(DType::U8, &[Some(t), Some(n)]),
    )?;
    tensor_check(
        K,
        "truncated",
        m.truncated.expect(DType::U8, &[Some(t), Some(n)]),
    )?;
    if let Some(r) = &m.norm_rewards {
        tensor_check(K, "norm_rewards", r.expect(DType::F32, &[Some(t), Some(n)]))?;
        finite_f32(K, "norm_rewards", r)?;
    }
    if let Some(stats) = &m.norm_delta {
        stats.check(K, "norm_delta", Some(d))?;
    }
    if let Some(state) = &m.initial_state {
        tensor_check(
            K,
            "initial_state",
            state.expect(DType::F32, &[Some(n), None]),
        )?;
        finite_f32(K, "initial_state", state)?;
    }
    if let Some(masks) = &m.masks {
        if m.actions.dtype != DType::I64 {
            return Err(invalid(K, "masks", "action masks with continuous actions"));
        }
        check_masks(K, "masks.obs", &masks.obs, &[t, n], None)?;
        let width = Some(*masks.obs.shape.last().expect("rank checked") as usize);
        check_masks(K, "masks.next_obs", &masks.next_obs, &[n], width)?;
        check_masks(
            K,
            "masks.final_obs",
            &masks.final_obs,
            &[truncations],
            width,
        )?;
        let actions = m.actions.to_i64().expect("actions checked");
        let w = *masks.obs.shape.last().expect("rank checked") as usize;
        for (row, (&a, mask)) in actions
            .iter()
            .zip(masks.obs.data.chunks_exact(w))
            .enumerate()
        {
            if a < 0 || a as usize >= w || mask[a as usize] == 0 {
                return Err(invalid(
                    K,
                    "actions",
                    format!(
                        "action {a} at step {} of env {} is not legal under its mask",
                        row / n,
                        row % n
                    ),
                ));
            }
        }
    }
    Ok(())
});

/// replay-buffer -> env-runner: whether the fragment was stored.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct InsertAck {
    pub schema: u16,
    /// False when the buffer is full (backpressure) or the fragment too stale.
    pub accepted: bool,
    /// When refused because full: how long to wait before sending more.
    pub retry_after_ms: u32,
    /// Env steps held for the run after this insert.
    pub buffered_steps: u64,
    /// Why the fragment was refused, empty when accepted: `full` or `rate`
    /// (backpressure: retry after `retry_after_ms`), `stale` (dropped).
    pub reason: String,
}
wire_message!(InsertAck, "InsertAck");

/// learner -> replay-buffer: take fragments out of the on-policy FIFO.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SampleRequest {
    pub schema: u16,
    /// Fragments acted by an older version are dropped (and counted).
    pub min_policy_version: u64,
    /// Stop taking fragments once this many env steps are gathered.
    pub max_steps: u32,
}
wire_message!(SampleRequest, "SampleRequest");

/// replay-buffer -> learner.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SampleReply {
    pub schema: u16,
    pub fragments: Vec<RolloutFragment>,
    /// Fragments dropped for being older than `min_policy_version`.
    pub dropped_stale: u64,
}
wire_message!(SampleReply, "SampleReply", |m: &SampleReply| {
    m.fragments.iter().try_for_each(WireMessage::validate)
});
