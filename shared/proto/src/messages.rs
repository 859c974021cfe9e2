//! Every message type that crosses a process boundary.
//!
//! Each carries `schema` ([`SCHEMA_VERSION`]) as its first field and
//! implements [`WireMessage`], whose `validate` checks what a receiver must
//! not trust: shapes that agree with each other and finite numbers.

use serde::{Deserialize, Serialize};

use crate::blob::WeightsBlob;
use crate::codec::{Rejection, WireMessage, SCHEMA_VERSION};
use crate::tensor::{DType, Tensor, TensorError};

pub(crate) fn tensor_check(
    kind: &'static str,
    field: &'static str,
    result: Result<(), crate::TensorError>,
) -> Result<(), Rejection> {
    result.map_err(|source| Rejection::Tensor {
        kind,
        field: field.into(),
        source,
    })
}

fn finite_f32(kind: &'static str, field: &'static str, t: &Tensor) -> Result<(), Rejection> {
    tensor_check(kind, field, t.to_finite_f32().map(|_| ()))
}

/// Observations: f32 (finite) or uint8 pixels, shaped as `want`, and, when
/// `same_as` is given, of its dtype.
pub(crate) fn observations_check(
    kind: &'static str,
    field: &'static str,
    t: &Tensor,
    want: &[Option<usize>],
    same_as: Option<&Tensor>,
) -> Result<(), Rejection> {
    tensor_check(kind, field, t.expect_observations(want))?;
    if let Some(first) = same_as {
        if first.dtype != t.dtype {
            return Err(invalid(
                kind,
                field,
                format!("is {:?} but obs is {:?}", t.dtype, first.dtype),
            ));
        }
    }
    if t.dtype == DType::F32 {
        finite_f32(kind, field, t)?;
    }
    Ok(())
}

pub(crate) fn invalid(
    kind: &'static str,
    field: &'static str,
    detail: impl Into<String>,
) -> Rejection {
    Rejection::Invalid {
        kind,
        field,
        detail: detail.into(),
    }
}

/// Checks action masks: `[lead.., n_actions]` u8 of 0 and 1 (`n_actions`
/// of the policy when the caller knows it), every row allowing an action
/// (a row that allows none is named).
pub(crate) fn check_masks(
    kind: &'static str,
    field: &'static str,
    masks: &Tensor,
    lead: &[usize],
    n_actions: Option<usize>,
) -> Result<(), Rejection> {
    let mut shape: Vec<Option<usize>> = lead.iter().map(|&d| Some(d)).collect();
    shape.push(n_actions);
    tensor_check(kind, field, masks.expect(DType::U8, &shape))?;
    let width = *masks.shape.last().expect("rank checked") as usize;
    if width == 0 {
        return Err(invalid(kind, field, "masks of zero actions"));
    }
    for (row, mask) in masks.data.chunks_exact(width).enumerate() {
        if let Some(v) = mask.iter().find(|&&v| v > 1) {
            return Err(invalid(
                kind,
                field,
                format!("row {row} holds {v}, not 0 or 1"),
            ));
        }
        if !mask.contains(&1) {
            return Err(invalid(kind, field, format!("row {row} allows no action")));
        }
    }
    Ok(())
}

/// Checks an action tensor: `[lead.., ]` i64 for discrete spaces or
/// `[lead.., dim]` finite f32 for continuous ones.
pub(crate) fn check_actions(
    kind: &'static str,
    actions: &Tensor,
    lead: &[usize],
) -> Result<(), Rejection> {
    let lead: Vec<Option<usize>> = lead.iter().map(|&d| Some(d)).collect();
    match actions.dtype {
        DType::I64 => tensor_check(kind, "actions", actions.expect(DType::I64, &lead)),
        DType::F32 => {
            let mut shape = lead;
            shape.push(None);
            tensor_check(kind, "actions", actions.expect(DType::F32, &shape))?;
            finite_f32(kind, "actions", actions)
        }
        other => Err(invalid(
            kind,
            "actions",
            format!("dtype {other:?} is neither i64 (discrete) nor f32 (continuous)"),
        )),
    }
}

macro_rules! wire_message {
    ($ty:ty, $kind:literal) => {
        wire_message!($ty, $kind, |_m: &$ty| Ok(()));
    };
    ($ty:ty, $kind:literal, $validate:expr) => {
        impl WireMessage for $ty {
            const KIND: &'static str = $kind;
            fn schema(&self) -> u16 {
                self.schema
            }
            fn validate(&self) -> Result<(), Rejection> {
                #[allow(clippy::redundant_closure_call)]
                ($validate)(self)
            }
        }
    };
}

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
        }
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

/// learner -> inference-server, evaluator, normalising env-runners: a new
/// policy version. Its parameters are a safetensors file (named f32
/// tensors) in [`WeightsUpdate::weights`]: inline when small, else fetched
/// by each reader (see [`crate::blob`]), whatever the policy's size.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WeightsUpdate {
    pub schema: u16,
    /// Increases by one with each learner update; never goes back within a run.
    pub version: u64,
    /// Env steps the learner had consumed when it made this version.
    pub learner_env_steps: u64,
    /// Every parameter of the policy, by name, as safetensors bytes.
    pub weights: WeightsBlob,
    /// Runs with a `normalize` section on: the run's observation and return
    /// statistics as of this version. Whoever runs the policy normalises
    /// raw observations with them (frozen: never updated from evaluation);
    /// env-runners adopt them as their starting point. Absent otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub normalizer: Option<NormStats>,
    /// When the learner began publishing this version ([`crate::unix_ms`]
    /// on its clock, before any upload), so receivers measure the whole
    /// transfer; 0: unknown.
    #[serde(default)]
    pub published_unix_ms: u64,
}
wire_message!(WeightsUpdate, "WeightsUpdate", |m: &WeightsUpdate| {
    if let Some(stats) = &m.normalizer {
        stats.check("WeightsUpdate", "normalizer", None)?;
    }
    m.weights.check("WeightsUpdate", "weights")
});

/// learner -> evaluators (`weights.announce`): a version was published;
/// services that play only some versions fetch the ones they want.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WeightsAnnouncement {
    pub schema: u16,
    pub version: u64,
    pub learner_env_steps: u64,
}
wire_message!(WeightsAnnouncement, "WeightsAnnouncement");

/// Any service -> learner: ask for the latest [`WeightsUpdate`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WeightsRequest {
    pub schema: u16,
}
wire_message!(WeightsRequest, "WeightsRequest");

/// One finished episode.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct EpisodeSummary {
    /// Undiscounted sum of rewards (in a self-play game, the learning
    /// seat's).
    pub episode_return: f64,
    /// Steps (in a self-play game, the learning seat's moves).
    pub length: u32,
    /// True when it ended in a terminal state, false when cut by the time limit.
    pub terminated: bool,
    /// Self-play games: the learning policy's seat (0 moves first), drawn
    /// with the runner's seeded RNG.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seat: Option<u32>,
    /// Self-play games: who held the other seats (`mirror`, `random`,
    /// `minimax`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub opponent: Option<String>,
    /// Parallel games played by one shared policy: each agent's return, in
    /// the game's agent order; `episode_return` is their sum, the team's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent_returns: Option<Vec<AgentReturn>>,
}

/// One agent's return in a game of a team ([`EpisodeSummary::agent_returns`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AgentReturn {
    pub agent: String,
    pub episode_return: f64,
}

/// env-runner -> tracker: episodes finished since the last report.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EpisodeReport {
    pub schema: u16,
    pub runner_id: String,
    pub env_id: String,
    pub policy_version: u64,
    pub episodes: Vec<EpisodeSummary>,
}
wire_message!(EpisodeReport, "EpisodeReport", |m: &EpisodeReport| {
    match m
        .episodes
        .iter()
        .position(|e| !e.episode_return.is_finite())
    {
        Some(i) => Err(invalid(
            "EpisodeReport",
            "episodes",
            format!("episode {i} has a non-finite return"),
        )),
        None => Ok(()),
    }
});

/// How the tracker aggregates a metric value.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MetricKind {
    /// The latest value replaces the previous one.
    Gauge,
    /// The value is an increment added to a running total.
    Counter,
}

/// Label keys a [`MetricValue`] may carry (the tracker adds each as a
/// Prometheus label): `game`, the text game a per-game value is about.
pub const METRIC_LABELS: &[&str] = &["game"];

/// Longest label value a [`MetricValue`] may carry.
pub const MAX_METRIC_LABEL_LEN: usize = 64;

/// One named value.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MetricValue {
    /// Name without the `relay_` prefix, e.g. `learner_policy_loss`.
    pub name: String,
    pub kind: MetricKind,
    pub value: f64,
    /// Labels of this value (keys from [`METRIC_LABELS`]), e.g.
    /// `{game: TicTacToe-v0}` for a per-game value. Empty for most values;
    /// absent on the wire when empty, so older readers and writers agree.
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub labels: std::collections::BTreeMap<String, String>,
}

/// A gauge value for a [`MetricsReport`].
pub fn gauge(name: &str, value: f64) -> MetricValue {
    MetricValue {
        name: name.to_string(),
        kind: MetricKind::Gauge,
        value,
        labels: Default::default(),
    }
}

/// A counter increment for a [`MetricsReport`].
pub fn counter(name: &str, increment: f64) -> MetricValue {
    MetricValue {
        name: name.to_string(),
        kind: MetricKind::Counter,
        value: increment,
        labels: Default::default(),
    }
}

impl MetricValue {
    /// This value with label `key` set to `value`.
    pub fn with_label(mut self, key: &str, value: &str) -> Self {
        self.labels.insert(key.to_string(), value.to_string());
        self
    }

    /// The name with its labels, as the run directory's files key it:
    /// `name` alone, or `name{game=TicTacToe-v0}` (labels in key order,
    /// comma-separated).
    pub fn key(&self) -> String {
        if self.labels.is_empty() {
            return self.name.clone();
        }
        let labels: Vec<String> = self
            .labels
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect();
        format!("{}{{{}}}", self.name, labels.join(","))
    }
}

/// Any service -> tracker: a batch of metric values.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MetricsReport {
    pub schema: u16,
    pub service: String,
    pub instance: String,
    /// Vectorized env steps at which these values hold, when the producer knows it.
    pub vec_steps: Option<u64>,
    pub values: Vec<MetricValue>,
}
wire_message!(MetricsReport, "MetricsReport", |m: &MetricsReport| {
    for v in &m.values {
        if v.name.is_empty()
            || !v
                .name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_')
        {
            return Err(invalid(
                "MetricsReport",
                "values",
                format!("bad metric name {:?}", v.name),
            ));
        }
        for (key, value) in &v.labels {
            if !METRIC_LABELS.contains(&key.as_str()) {
                return Err(invalid(
                    "MetricsReport",
                    "values",
                    format!(
                        "metric {} has unknown label {key:?}; known: {}",
                        v.name,
                        METRIC_LABELS.join(", ")
                    ),
                ));
            }
            if value.is_empty()
                || value.len() > MAX_METRIC_LABEL_LEN
                || !value
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | ':'))
            {
                return Err(invalid(
                    "MetricsReport",
                    "values",
                    format!(
                        "metric {} has bad {key} label {value:?} (1 to {MAX_METRIC_LABEL_LEN} ASCII letters, digits, '-', '_', '.' or ':')",
                        v.name
                    ),
                ));
            }
        }
    }
    Ok(())
});

/// evaluator -> tracker, supervisor: the result of one evaluation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EvalReport {
    pub schema: u16,
    /// Name of the evaluator plugin that produced it, e.g. `greedy`.
    pub evaluator: String,
    pub instance: String,
    pub env_id: String,
    pub policy_version: u64,
    /// Env steps the learner had consumed when it published this version.
    pub learner_env_steps: u64,
    pub returns: Vec<f64>,
    pub mean_return: f64,
    pub std_return: f64,
    /// The env's reward threshold.
    pub threshold: f64,
    /// The run is solved by this version: the screening mean (`mean_return`,
    /// on the run's fixed eval seeds) reached the threshold and so did the
    /// confirmation on fresh seeds (`confirmation.passed`).
    pub solved: bool,
    /// Text games (`vs-opponent`): the policy's results per opponent and
    /// seat; empty for classic-control evaluations.
    #[serde(default)]
    pub matchups: Vec<Matchup>,
    /// Present when the screening mean reached the threshold: the same
    /// version played again on episodes no earlier evaluation of the run
    /// used (absent from older writers).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub confirmation: Option<Confirmation>,
}
wire_message!(EvalReport, "EvalReport", |m: &EvalReport| {
    for r in &m.matchups {
        r.validate()?;
    }
    if let Some(c) = &m.confirmation {
        if c.returns.is_empty() || c.returns.len() != c.episodes as usize {
            return Err(invalid(
                "EvalReport",
                "confirmation.returns",
                format!("{} returns for {} episodes", c.returns.len(), c.episodes),
            ));
        }
        if !(c.mean_return.is_finite() && c.std_return.is_finite()) {
            return Err(invalid(
                "EvalReport",
                "confirmation.mean_return",
                "must be finite",
            ));
        }
    }
    Ok(())
});

/// The confirmation of a version that passed the screening: `episodes`
/// episodes from seeds `seed, seed + 1, ...`, which no earlier evaluation
/// of the run used (see the evaluator crate for how they are drawn).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Confirmation {
    /// Episodes (text games: games) played.
    pub episodes: u32,
    /// First seed of the episodes.
    pub seed: u64,
    pub returns: Vec<f64>,
    pub mean_return: f64,
    pub std_return: f64,
    /// `mean_return - z * std_return / sqrt(episodes) >= threshold`
    /// ([`mean_less_standard_errors`]), `z` the run's `eval.confirm_z` (2
    /// by default; 0: the mean alone).
    pub passed: bool,
}

/// `mean - z * std / sqrt(episodes)`: a mean over `episodes` less `z`
/// standard errors, what a confirmation must bring to the threshold and
/// what ranks evaluated versions for the `best` checkpoint.
pub fn mean_less_standard_errors(mean: f64, std: f64, episodes: usize, z: f64) -> f64 {
    mean - z * std / (episodes.max(1) as f64).sqrt()
}

/// evaluator -> learner: an evaluation of `policy_version` begins. The
/// learner keeps that version's weights until its [`EvalReport`] arrives,
/// so a best (or solved) checkpoint holds exactly what was evaluated.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EvalStarted {
    pub schema: u16,
    /// Name of the evaluator plugin, e.g. `greedy`.
    pub evaluator: String,
    pub instance: String,
    pub policy_version: u64,
}
wire_message!(EvalStarted, "EvalStarted");

/// The policy's results against one opponent from one seat (text games).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Matchup {
    /// Who sat opposite, as `text.opponents` names it: `random`, `minimax`,
    /// `connect_four_bot`, `self`, `base`, `adapter:<name>`; `none` in
    /// single-player games.
    pub opponent: String,
    /// The policy's seat (player index; 0 moves first).
    pub seat: u8,
    /// The text game played (multi-game runs evaluate each of their
    /// games); empty from writers that predate it: the report's `env_id`.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub game: String,
    /// Games finished (`wins + draws + losses`).
    pub games: u32,
    pub wins: u32,
    pub draws: u32,
    pub losses: u32,
    /// Games given up because the inference servers gave no usable reply.
    pub abandoned: u32,
    /// Moves the policy submitted in the finished games.
    pub moves: u32,
    /// Of those, the moves the game refused.
    pub invalid_moves: u32,
}

impl Matchup {
    /// The game played: `game`, else (an older writer) `env_id`, the
    /// report's.
    pub fn game_or<'a>(&'a self, env_id: &'a str) -> &'a str {
        if self.game.is_empty() {
            env_id
        } else {
            &self.game
        }
    }

    /// Share of the policy's moves the game accepted (1 when it made none).
    pub fn legal_move_rate(&self) -> f64 {
        if self.moves == 0 {
            1.0
        } else {
            1.0 - self.invalid_moves as f64 / self.moves as f64
        }
    }

    fn validate(&self) -> Result<(), Rejection> {
        const K: &str = "EvalReport";
        if self.opponent.is_empty() {
            return Err(invalid(K, "matchups.opponent", "empty"));
        }
        if self.wins as u64 + self.draws as u64 + self.losses as u64 != self.games as u64 {
            return Err(invalid(
                K,
                "matchups.games",
                format!(
                    "{} wins + {} draws + {} losses != {} games",
                    self.wins, self.draws, self.losses, self.games
                ),
            ));
        }
        if self.invalid_moves > self.moves {
            return Err(invalid(
                K,
                "matchups.invalid_moves",
                format!("{} of {} moves", self.invalid_moves, self.moves),
            ));
        }
        Ok(())
    }
}

/// Lifecycle of a run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RunStatus {
    Running,
    Solved,
    Stopped,
    Failed,
}

/// Any service -> tracker, supervisor: the run changed state.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunStatusUpdate {
    pub schema: u16,
    pub status: RunStatus,
    pub service: String,
    pub policy_version: u64,
    pub detail: String,
}
wire_message!(RunStatusUpdate, "RunStatusUpdate");

/// tracker -> anyone watching (`relay top`, the supervisor): an alert was
/// raised or cleared.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AlertEvent {
    pub schema: u16,
    /// Rule name, e.g. `entropy_collapse`.
    pub alert: String,
    /// The metric the rule watches.
    pub metric: String,
    /// True when raised, false when cleared.
    pub active: bool,
    /// The smoothed value that raised or cleared it.
    pub value: f64,
    /// Vectorized env steps at the time, when known.
    pub vec_steps: Option<u64>,
    /// Human-readable explanation.
    pub message: String,
}
wire_message!(AlertEvent, "AlertEvent");

/// `relay eval use` -> evaluators: switch to another evaluator plugin
/// without restarting. Each evaluator copy validates the name and options and
/// applies them, or logs the refusal and counts it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EvalControl {
    pub schema: u16,
    /// Plugin name, e.g. `stochastic`.
    pub evaluator: String,
    /// Plugin options as `(key, value)` strings.
    pub options: Vec<(String, String)>,
}
wire_message!(EvalControl, "EvalControl", |m: &EvalControl| {
    if m.evaluator.is_empty() || m.evaluator.len() > 64 {
        return Err(invalid(
            "EvalControl",
            "evaluator",
            "must be a plugin name of 1 to 64 characters",
        ));
    }
    Ok(())
});

/// Largest number of copies of one service a [`ScaleRequest`] may ask for.
pub const MAX_COPIES: u32 = 64;

/// `relay scale` -> supervisor (`relay up`): run `copies` copies of `service`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ScaleRequest {
    pub schema: u16,
    /// Service name, e.g. `env-runner`.
    pub service: String,
    /// Wanted number of copies (0 stops them all; the learner must stay at 1).
    pub copies: u32,
}
wire_message!(ScaleRequest, "ScaleRequest", |m: &ScaleRequest| {
    if m.service.is_empty()
        || m.service.len() > 64
        || !m
            .service
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
    {
        return Err(invalid(
            "ScaleRequest",
            "service",
            format!("bad service name {:?}", m.service),
        ));
    }
    if m.copies > MAX_COPIES {
        return Err(invalid(
            "ScaleRequest",
            "copies",
            format!("{} copies is over the limit of {MAX_COPIES}", m.copies),
        ));
    }
    Ok(())
});

/// A copy that a scale-down stopped, with its exit code (`None`: killed by a
/// signal, e.g. SIGKILL after the grace period).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StoppedCopy {
    pub instance: String,
    pub exit_code: Option<i32>,
}

/// Supervisor -> `relay scale`: what changed. `error` is set (and nothing
/// changed) when the request was refused.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ScaleReply {
    pub schema: u16,
    pub service: String,
    /// Copies running now.
    pub copies: u32,
    /// Instance names of the running copies.
    pub instances: Vec<String>,
    /// Copies started by this request (healthy when the reply is sent).
    pub started: Vec<String>,
    /// Copies stopped by this request, after draining.
    pub stopped: Vec<StoppedCopy>,
    pub error: Option<String>,
}
wire_message!(ScaleReply, "ScaleReply");

/// Any service -> tracker: formatted log lines for `runs/<id>/logs/<service>.log`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LogBatch {
    pub schema: u16,
    pub service: String,
    pub instance: String,
    pub lines: Vec<String>,
}
wire_message!(LogBatch, "LogBatch", |m: &LogBatch| {
    if m.service.is_empty()
        || !m
            .service
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
    {
        return Err(invalid(
            "LogBatch",
            "service",
            format!("bad service name {:?}", m.service),
        ));
    }
    Ok(())
});

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{decode, encode};

    #[test]
    fn metric_labels_are_optional_on_the_wire_and_checked() {
        // A value without labels encodes as before (no `labels` key), and
        // an older writer's value (no `labels` key) decodes with none.
        #[derive(Serialize)]
        struct OldValue {
            name: String,
            kind: MetricKind,
            value: f64,
        }
        #[derive(Serialize)]
        struct OldReport {
            schema: u16,
            service: String,
            instance: String,
            vec_steps: Option<u64>,
            values: Vec<OldValue>,
        }
        let old = rmp_serde::to_vec_named(&OldReport {
            schema: SCHEMA_VERSION,
            service: "env-runner".into(),
            instance: "e1".into(),
            vec_steps: None,
            values: vec![OldValue {
                name: "games_total".into(),
                kind: MetricKind::Counter,
                value: 2.0,
            }],
        })
        .unwrap();
        let report: MetricsReport = decode(&old).unwrap();
        assert!(report.values[0].labels.is_empty());
        assert_eq!(encode(&report), old);
        assert_eq!(report.values[0].key(), "games_total");

        let mut labelled = report.clone();
        labelled.values[0] = labelled.values[0]
            .clone()
            .with_label("game", "KuhnPoker-v0");
        let back: MetricsReport = decode(&encode(&labelled)).unwrap();
        assert_eq!(back, labelled);
        assert_eq!(back.values[0].key(), "games_total{game=KuhnPoker-v0}");

        for (key, value, needle) in [
            ("opponent", "random", "unknown label \"opponent\""),
            ("game", "", "bad game label"),
            ("game", "Tic Tac", "bad game label"),
        ] {
            let mut bad = report.clone();
            bad.values[0].labels.insert(key.into(), value.into());
            let err = decode::<MetricsReport>(&encode(&bad)).unwrap_err();
            assert!(err.to_string().contains(needle), "{err}");
            assert_eq!(err.reason(), "invalid");
        }
    }

    pub(crate) fn fragment(t: usize, n: usize, d: usize) -> RolloutFragment {
        let mut truncated = vec![false; t * n];
        truncated[n] = true;
        RolloutFragment {
            schema: SCHEMA_VERSION,
            runner_id: "r0".into(),
            env_id: "CartPole-v1".into(),
            policy_version: 3,
            num_steps: t as u32,
            num_envs: n as u32,
            obs: Tensor::from_f32(&[t, n, d], &vec![0.5; t * n * d]),
            actions: Tensor::from_i64(&[t, n], &vec![1; t * n]),
            logprobs: Tensor::from_f32(&[t, n], &vec![-0.7; t * n]),
            values: Tensor::from_f32(&[t, n], &vec![0.0; t * n]),
            rewards: Tensor::from_f32(&[t, n], &vec![1.0; t * n]),
            terminated: Tensor::from_bool(&[t, n], &vec![false; t * n]),
            truncated: Tensor::from_bool(&[t, n], &truncated),
            next_obs: Tensor::from_f32(&[n, d], &vec![0.1; n * d]),
            final_obs: Tensor::from_f32(&[1, d], &vec![0.2; d]),
            norm_rewards: None,
            norm_delta: None,
            masks: None,
            frames: None,
            initial_state: None,
        }
    }

    fn stats(d: usize) -> NormStats {
        NormStats {
            obs: Moments {
                count: 12.0,
                mean: vec![0.25; d],
                var: vec![2.0; d],
            },
            ret: Moments {
                count: 12.0,
                mean: vec![1.5],
                var: vec![0.5],
            },
        }
    }

    /// The normalisation fields are additive (schema version unchanged): a
    /// fragment without them is what older env-runners send and decodes to
    /// `None`; a reader that predates them ignores them.
    #[test]
    fn normalisation_fields_round_trip_and_stay_optional() {
        let plain = fragment(4, 2, 3);
        let bytes = encode(&plain);
        assert!(!bytes.windows(10).any(|w| w == b"norm_delta"));
        let back: RolloutFragment = decode(&bytes).unwrap();
        assert_eq!(back.norm_delta, None);
        let mut f = fragment(4, 2, 3);
        f.norm_rewards = Some(Tensor::from_f32(&[4, 2], &[0.5; 8]));
        f.norm_delta = Some(stats(3));
        let back: RolloutFragment = decode(&encode(&f)).unwrap();
        assert_eq!(back, f);
        #[derive(Deserialize)]
        struct OlderReader {
            schema: u16,
            rewards: Tensor,
        }
        let old: OlderReader = rmp_serde::from_slice(&encode(&f)).unwrap();
        assert_eq!(
            (old.schema, old.rewards),
            (SCHEMA_VERSION, f.rewards.clone())
        );

        let weights = WeightsUpdate {
            schema: SCHEMA_VERSION,
            version: 2,
            learner_env_steps: 10,
            weights: WeightsBlob::inline(vec![1, 2, 3]),
            normalizer: Some(stats(4)),
            published_unix_ms: 0,
        };
        assert_eq!(decode::<WeightsUpdate>(&encode(&weights)).unwrap(), weights);
    }

    #[test]
    fn bad_normalisation_fields_are_rejected_by_name() {
        let mut f = fragment(4, 2, 3);
        f.norm_delta = Some(stats(2));
        let err = decode::<RolloutFragment>(&encode(&f)).unwrap_err();
        assert_eq!(err.reason(), "invalid");
        assert!(
            err.to_string().contains("norm_delta") && err.to_string().contains("components"),
            "{err}"
        );
        let mut bad = stats(3);
        bad.obs.mean[1] = f64::NAN;
        f.norm_delta = Some(bad);
        let err = decode::<RolloutFragment>(&encode(&f)).unwrap_err();
        assert!(err.to_string().contains("finite"), "{err}");
        f.norm_delta = None;
        f.norm_rewards = Some(Tensor::from_f32(
            &[4, 2],
            &[0.5, f32::NAN, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0],
        ));
        let err = decode::<RolloutFragment>(&encode(&f)).unwrap_err();
        assert_eq!(err.reason(), "non_finite");
        assert!(err.to_string().contains("norm_rewards"), "{err}");
        f.norm_rewards = Some(Tensor::from_f32(&[2, 2], &[0.5; 4]));
        let err = decode::<RolloutFragment>(&encode(&f)).unwrap_err();
        assert_eq!(err.reason(), "shape");
        let mut bad = stats(3);
        bad.ret.var[0] = -1.0;
        let weights = WeightsUpdate {
            schema: SCHEMA_VERSION,
            version: 2,
            learner_env_steps: 10,
            weights: WeightsBlob::inline(vec![1, 2, 3]),
            normalizer: Some(bad),
            published_unix_ms: 0,
        };
        let err = decode::<WeightsUpdate>(&encode(&weights)).unwrap_err();
        assert!(
            err.to_string().contains("WeightsUpdate.normalizer"),
            "{err}"
        );
    }

    /// Masks are additive like the normalisation fields; a mask must be
    /// 0/1 bytes of one width everywhere, allow an action in every row,
    /// and allow the action taken.
    #[test]
    fn action_masks_round_trip_and_bad_ones_are_named() {
        let plain = fragment(2, 2, 3);
        assert!(!encode(&plain).windows(5).any(|w| w == b"masks"));
        let mut f = plain.clone();
        // 3 actions; every fragment action is 1.
        f.masks = Some(FragmentMasks {
            obs: Tensor::from_u8(&[2, 2, 3], &[0, 1, 0, 1, 1, 1, 0, 1, 1, 0, 1, 0]),
            next_obs: Tensor::from_u8(&[2, 3], &[1, 0, 0, 0, 0, 1]),
            final_obs: Tensor::from_u8(&[1, 3], &[1, 1, 0]),
        });
        let back: RolloutFragment = decode(&encode(&f)).unwrap();
        assert_eq!(back, f);
        let reject = |edit: &dyn Fn(&mut FragmentMasks)| {
            let mut bad = f.clone();
            edit(bad.masks.as_mut().unwrap());
            decode::<RolloutFragment>(&encode(&bad))
                .unwrap_err()
                .to_string()
        };
        let e = reject(&|m| m.obs.data[3..6].copy_from_slice(&[0, 0, 0]));
        assert!(
            e.contains("masks.obs") && e.contains("row 1 allows no action"),
            "{e}"
        );
        let e = reject(&|m| m.obs.data[0..2].copy_from_slice(&[1, 0]));
        assert!(
            e.contains("action 1 at step 0 of env 0 is not legal under its mask"),
            "{e}"
        );
        let e = reject(&|m| m.next_obs = Tensor::from_u8(&[2, 2], &[1; 4]));
        assert!(e.contains("masks.next_obs"), "{e}");
        let e = reject(&|m| m.final_obs.data[2] = 2);
        assert!(
            e.contains("masks.final_obs") && e.contains("not 0 or 1"),
            "{e}"
        );

        let obs = Tensor::from_f32(&[2, 2], &[0.0; 4]);
        let good = ActRequest::new(obs.clone(), false)
            .with_masks(Some(Tensor::from_u8(&[2, 3], &[1, 0, 0, 0, 1, 1])));
        assert_eq!(decode::<ActRequest>(&encode(&good)).unwrap(), good);
        let empty = ActRequest::new(obs.clone(), false)
            .with_masks(Some(Tensor::from_u8(&[2, 3], &[1, 0, 0, 0, 0, 0])));
        let e = decode::<ActRequest>(&encode(&empty))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("ActRequest.masks") && e.contains("row 1 allows no action"),
            "{e}"
        );
        let short = ActRequest::new(obs, false).with_masks(Some(Tensor::from_u8(&[1, 3], &[1; 3])));
        assert!(decode::<ActRequest>(&encode(&short)).is_err());
    }

    #[test]
    fn fragment_round_trips() {
        let f = fragment(4, 2, 3);
        let back: RolloutFragment = decode(&encode(&f)).unwrap();
        assert_eq!(back, f);
    }

    #[test]
    fn rejects_wrong_schema_version() {
        let mut f = fragment(2, 2, 3);
        f.schema = SCHEMA_VERSION + 1;
        let err = decode::<RolloutFragment>(&encode(&f)).unwrap_err();
        assert_eq!(err.reason(), "schema_version");
    }

    #[test]
    fn rejects_garbage_and_oversized_payloads() {
        assert_eq!(
            decode::<ActRequest>(b"\x01\x02garbage")
                .unwrap_err()
                .reason(),
            "decode"
        );
        let big = vec![0u8; crate::MAX_MESSAGE_BYTES + 1];
        assert_eq!(
            decode::<ActRequest>(&big).unwrap_err().reason(),
            "oversized"
        );
    }

    #[test]
    fn rejects_bad_shapes_and_nan() {
        let mut f = fragment(2, 2, 3);
        f.rewards = Tensor::from_f32(&[2, 2], &[1.0, f32::NAN, 1.0, 1.0]);
        assert_eq!(
            decode::<RolloutFragment>(&encode(&f)).unwrap_err().reason(),
            "non_finite"
        );
        let mut f = fragment(2, 2, 3);
        f.final_obs = Tensor::from_f32(&[0, 3], &[]);
        assert_eq!(
            decode::<RolloutFragment>(&encode(&f)).unwrap_err().reason(),
            "shape"
        );
        let req = ActRequest::new(Tensor::from_f32(&[1, 2], &[f32::INFINITY, 0.0]), false);
        assert_eq!(
            decode::<ActRequest>(&encode(&req)).unwrap_err().reason(),
            "non_finite"
        );
    }

    #[test]
    fn image_observations_travel_as_bytes() {
        let (t, n, d) = (2, 2, 6);
        let pixels: Vec<f32> = (0..t * n * d).map(|i| (i * 20 % 256) as f32).collect();
        let mut f = fragment(t, n, d);
        f.truncated = Tensor::from_bool(&[t, n], &[false; 4]);
        f.obs = Tensor::observations(&[t, n, d], &pixels, true);
        f.next_obs = Tensor::observations(&[n, d], &pixels[..n * d], true);
        f.final_obs = Tensor::observations(&[0, d], &[], true);
        let back = decode::<RolloutFragment>(&encode(&f)).unwrap();
        assert_eq!(back.obs.dtype, DType::U8);
        assert_eq!(back.obs.data.len(), t * n * d, "one byte per value");
        assert_eq!(back.obs.observations_to_f32().unwrap(), pixels);
        // Bootstrap observations of another dtype than `obs` are refused.
        f.next_obs = Tensor::from_f32(&[n, d], &pixels[..n * d]);
        let err = decode::<RolloutFragment>(&encode(&f)).unwrap_err();
        assert!(err.to_string().contains("next_obs"), "{err}");
        let req = ActRequest::new(Tensor::observations(&[1, 2], &[0.0, 255.0], true), false);
        assert_eq!(decode::<ActRequest>(&encode(&req)).unwrap(), req);
        let req = ActRequest::new(Tensor::from_i64(&[1, 2], &[0, 1]), false);
        let err = decode::<ActRequest>(&encode(&req)).unwrap_err().to_string();
        assert!(err.contains("obs") && err.contains("I64"), "{err}");
    }

    #[test]
    fn scale_request_is_validated() {
        let req = |service: &str, copies| ScaleRequest {
            schema: SCHEMA_VERSION,
            service: service.into(),
            copies,
        };
        let ok = req("env-runner", 3);
        assert_eq!(decode::<ScaleRequest>(&encode(&ok)).unwrap(), ok);
        assert!(decode::<ScaleRequest>(&encode(&req("env-runner", 0))).is_ok());
        for bad in [
            req("", 1),
            req("env.runner", 1),
            req("env-runner", MAX_COPIES + 1),
        ] {
            assert_eq!(
                decode::<ScaleRequest>(&encode(&bad)).unwrap_err().reason(),
                "invalid"
            );
        }
    }

    proptest::proptest! {
        #[test]
        fn decoding_arbitrary_bytes_never_panics(bytes in proptest::collection::vec(proptest::num::u8::ANY, 0..512)) {
            let _ = decode::<RolloutFragment>(&bytes);
            let _ = decode::<ActRequest>(&bytes);
            let _ = decode::<WeightsUpdate>(&bytes);
            let _ = decode::<MetricsReport>(&bytes);
        }
    }
}
