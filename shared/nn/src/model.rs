//! The actor-critic MLP policy: parameters, acting, and the differentiable
//! evaluation used by the PPO learner.
//!
//! # Layout
//!
//! Separate actor and critic MLPs, as Stable-Baselines3's `MlpPolicy` with
//! `net_arch=dict(pi=hidden, vf=hidden)`, and with SB3's parameter names, so
//! an SB3 `state_dict` exported to safetensors loads as is:
//!
//! | name | shape | init |
//! |---|---|---|
//! | `mlp_extractor.policy_net.{2i}.weight` / `.bias` | `[hidden[i], in]` / `[hidden[i]]` | orthogonal, gain √2 / 0 |
//! | `mlp_extractor.value_net.{2i}.weight` / `.bias` | same | orthogonal, gain √2 / 0 |
//! | `action_net.weight` / `.bias` | `[n or dim, last]` / `[n or dim]` | orthogonal, gain 0.01 / 0 |
//! | `value_net.weight` / `.bias` | `[1, last]` / `[1]` | orthogonal, gain 1 / 0 |
//! | `log_std` (continuous only) | `[dim]` | `init_log_std` |
//!
//! (`{2i}` because SB3's `nn.Sequential` interleaves activation modules.)
//!
//! # One source of truth, two forward paths
//!
//! The parameters live in candle [`Var`]s (registered in a [`VarMap`]).
//!
//! - [`ActorCritic::evaluate`] (training) builds a candle graph from the fused,
//!   differentiable ops of [`crate::ops`].
//! - [`ActorCritic::act`] and [`ActorCritic::values`] (inference) build no
//!   graph and no tensors: they read the `Var`s' storage in place, under
//!   their read locks, and run the hand-written dense kernel of
//!   [`crate::kernels`] for batches up to [`HOST_KERNEL_MAX_BATCH`], candle's
//!   CPU gemm (called directly on the storages) above that, where it is
//!   faster (measured crossover about 20 rows for the 4-64-64 MLP). There
//!   is no cached copy to go stale: an optimizer step or a load is visible
//!   to the next `act`. Both paths use the same `tanh` as training.
//!
//! # Invalid-action masks
//!
//! Discrete policies take optional masks (`n_actions` bytes per row, 1
//! legal, 0 illegal): [`ActorCritic::act_masked`] and
//! [`ActorCritic::evaluate_masked`] replace the illegal logits by
//! [`ops::MASKED_LOGIT`] (see [`crate::ops`] for why a large finite negative
//! and not `-inf`) and sample, score and take the entropy of that masked
//! categorical; [`ActorCritic::act`] and [`ActorCritic::evaluate`] are the
//! unmasked cases.
//!
//! # Action bounds
//!
//! Continuous actions are returned *unclipped*, and their log-probability is
//! that of the unclipped sample. Clipping to `[low, high]` is the env-runner's
//! job, just before it steps the environment; the learner trains on the
//! unclipped sample (as SB3 does).

use std::borrow::Cow;
use std::collections::HashMap;
use std::fmt;
use std::path::Path;
use std::sync::Arc;

use candle_core::{DType, Device, Tensor, Var};
use candle_nn::VarMap;
use rand::{Rng, SeedableRng};
use rand_distr::StandardNormal;

use crate::conv::Cnn;
use crate::error::{NnError, Result};
use crate::init::{Init, LayerInit};
use crate::io::{read_safetensors, write_safetensors, NamedTensor};
pub use crate::layers::HOST_KERNEL_MAX_BATCH;
use crate::layers::{dense_host, head_graph, mlp_host, new_layer, trunk_graph, trunk_host, Dense};
use crate::ops::{self, check_masks, HALF_LN_2PI};
use crate::params::Params;
use crate::qnet::masked_argmax;
use crate::recurrent::Core;
use crate::spec::{ActionKind, PolicySpec};
pub use relay_config::hyper::policy::TrunkLayout;

/// `format` metadata written into model checkpoints.
pub const MODEL_FORMAT: &str = "relay-nn/actor-critic";

/// Largest activation buffer (in f32 values, 64 KiB) one chunk of a large
/// `act` / `values` batch may allocate; see `ActorCritic::infer`.
pub const HOST_CHUNK_FLOATS: usize = 16 * 1024;

/// Actions chosen by [`ActorCritic::act`] for a batch of `n` observations.
#[derive(Debug, Clone, PartialEq)]
pub enum Actions {
    /// One action index in `0..n_actions` per observation.
    Discrete(Vec<i64>),
    /// `n * dim` values, row-major, **unclipped** samples of the Gaussian.
    Continuous(Vec<f32>),
}

/// Result of [`ActorCritic::act`].
#[derive(Debug, Clone, PartialEq)]
pub struct ActOutput {
    /// The actions.
    pub actions: Actions,
    /// Log-probability of each action under the current policy (of the
    /// unclipped sample for continuous actions), `n` values.
    pub logprobs: Vec<f32>,
    /// Critic value `V(s)` of each observation, `n` values.
    pub values: Vec<f32>,
}

/// A recurrent policy's cores: the actor's, and the critic's unless the
/// trunk is shared (then the actor's feeds both heads).
#[derive(Clone)]
struct Cores {
    actor: Core,
    critic: Option<Core>,
}

impl Cores {
    /// State values per row: the actor core's, then the critic core's.
    fn state_width(&self) -> usize {
        self.actor.state_width() + self.critic.as_ref().map_or(0, Core::state_width)
    }
}

/// Actor-critic MLP policy (see the module docs for layout and init).
pub struct ActorCritic {
    spec: PolicySpec,
    varmap: VarMap,
    /// The shared image features extractor of a CNN policy.
    cnn: Option<Cnn>,
    /// The recurrent cores of a recurrent policy ([`crate::recurrent`]).
    cores: Option<Cores>,
    policy_net: Vec<Dense>,
    value_net: Vec<Dense>,
    action_net: Dense,
    value_head: Dense,
    log_std: Option<Var>,
    layout: TrunkLayout,
    /// Every parameter, sorted by name.
    params: Params,
}

impl fmt::Debug for ActorCritic {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ActorCritic")
            .field("spec", &self.spec)
            .field("layout", &self.layout)
            .field("parameters", &self.num_parameters())
            .finish()
    }
}

impl ActorCritic {
    /// Builds a freshly initialised model on the CPU; deterministic given
    /// `seed` (draws from `rand`'s `StdRng`, so for a given `rand` version).
    pub fn new(spec: &PolicySpec, seed: u64) -> Result<Self> {
        Self::with_layout(spec, TrunkLayout::Separate, seed)
    }

    /// As [`Self::new`], choosing whether actor and critic share the hidden
    /// layers ([`TrunkLayout::Separate`] is exactly [`Self::new`]).
    pub fn with_layout(spec: &PolicySpec, layout: TrunkLayout, seed: u64) -> Result<Self> {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        Self::build(spec, layout, Init::Draw(&mut rng), &Device::Cpu)
    }

    /// A model of `layout` holding `tensors` (validated as
    /// [`Self::load_named_tensors`]), with no init drawn: orthogonal init
    /// takes a QR decomposition per layer, wasted on a followed version.
    pub fn from_named_tensors(
        spec: &PolicySpec,
        layout: TrunkLayout,
        tensors: &[NamedTensor],
    ) -> Result<Self> {
        let mut model = Self::build(spec, layout, Init::Zeros, &Device::Cpu)?;
        model.load_named_tensors(tensors)?;
        Ok(model)
    }

    /// This model with its parameters on `device` (a GPU: the graph paths
    /// then run there, composed from candle's ops, and `act` reads back only
    /// its outputs); itself when it is there already.
    pub fn to_device(self, device: &Device) -> Result<Self> {
        if self.device().same_device(device) {
            return Ok(self);
        }
        let mut model = Self::build(&self.spec, self.layout, Init::Zeros, device)?;
        model.load_named_tensors(&self.named_tensors())?;
        Ok(model)
    }

    /// The device the parameters live on.
    pub fn device(&self) -> &Device {
        self.value_head.b.device()
    }

    fn build(
        spec: &PolicySpec,
        layout: TrunkLayout,
        mut init: Init<'_>,
        dev: &Device,
    ) -> Result<Self> {
        spec.validate()?;
        let mut params: Vec<(String, Var)> = Vec::new();
        let hidden_gain = 2f64.sqrt();
        let cnn = match &spec.cnn {
            Some(c) => Some(Cnn::new(
                c,
                LayerInit::Orthogonal(hidden_gain),
                &mut init,
                &mut params,
                dev,
            )?),
            None => None,
        };
        let cores = match &spec.recurrent {
            Some(r) => {
                let core = |who: &str, init: &mut Init<'_>, params: &mut Vec<(String, Var)>| {
                    Core::new(
                        &format!("{}_{who}", r.cell.name()),
                        r,
                        spec.features_dim(),
                        init,
                        params,
                        dev,
                    )
                };
                let actor = core("actor", &mut init, &mut params)?;
                let critic = match layout {
                    TrunkLayout::Separate => Some(core("critic", &mut init, &mut params)?),
                    TrunkLayout::Shared => None,
                };
                Some(Cores { actor, critic })
            }
            None => None,
        };
        let mut dense = |prefix: String,
                         inp: usize,
                         out: usize,
                         gain: f64,
                         init: &mut Init<'_>|
         -> Result<Dense> {
            new_layer(
                &prefix,
                &[out, inp],
                LayerInit::Orthogonal(gain),
                init,
                &mut params,
                dev,
            )
        };
        let mut build_trunk = |net: &str, init: &mut Init<'_>| -> Result<Vec<Dense>> {
            let mut inp = spec.trunk_input_dim();
            let mut layers = Vec::new();
            for (i, &h) in spec.hidden.iter().enumerate() {
                layers.push(dense(
                    format!("mlp_extractor.{net}.{}", 2 * i),
                    inp,
                    h,
                    hidden_gain,
                    init,
                )?);
                inp = h;
            }
            Ok(layers)
        };
        let (policy_net, value_net) = match layout {
            TrunkLayout::Separate => (
                build_trunk("policy_net", &mut init)?,
                build_trunk("value_net", &mut init)?,
            ),
            // The same `Var`s on both paths: gradients from both heads add up.
            TrunkLayout::Shared => {
                let shared = build_trunk("shared_net", &mut init)?;
                (shared.clone(), shared)
            }
        };
        let last = spec
            .hidden
            .last()
            .copied()
            .unwrap_or(spec.trunk_input_dim());
        let action_net = dense(
            "action_net".into(),
            last,
            spec.action.head_width(),
            0.01,
            &mut init,
        )?;
        let value_head = dense("value_net".into(), last, 1, 1.0, &mut init)?;
        let log_std = match &spec.action {
            ActionKind::Discrete { .. } => None,
            ActionKind::Continuous { dim, .. } => {
                let v = Var::from_vec(vec![spec.init_log_std; *dim], *dim, dev)?;
                params.push(("log_std".into(), v.clone()));
                Some(v)
            }
        };
        let params = Params::new(params);
        let varmap = VarMap::new();
        {
            let mut data = varmap
                .data()
                .lock()
                .map_err(|_| candle_core::Error::Msg("VarMap lock poisoned".into()))?;
            for (name, var) in params.iter() {
                data.insert(name.clone(), var.clone());
            }
        }
        Ok(Self {
            spec: spec.clone(),
            varmap,
            cnn,
            cores,
            policy_net,
            value_net,
            action_net,
            value_head,
            log_std,
            layout,
            params,
        })
    }

    /// The spec the model was built from.
    pub fn spec(&self) -> &PolicySpec {
        &self.spec
    }

    /// Whether actor and critic share their hidden layers.
    pub fn layout(&self) -> TrunkLayout {
        self.layout
    }

    /// Recurrent state values per observation row ([`crate::recurrent`]):
    /// 0 for a feed-forward policy.
    pub fn state_width(&self) -> usize {
        self.cores.as_ref().map_or(0, Cores::state_width)
    }

    /// The candle `VarMap` holding the same `Var`s (for interop; prefer
    /// [`Self::load_named_tensors`] to change weights, it validates).
    pub fn varmap(&self) -> &VarMap {
        &self.varmap
    }

    /// Total number of scalar parameters.
    pub fn num_parameters(&self) -> usize {
        self.params.num_parameters()
    }

    /// Names of all parameters, sorted.
    pub fn parameter_names(&self) -> Vec<&str> {
        self.params.names()
    }

    /// The trainable variables, in parameter-name order (stable).
    pub fn vars(&self) -> Vec<Var> {
        self.params.vars()
    }

    fn check_obs(&self, obs: &[f32], n: usize) -> Result<()> {
        if obs.len() != n * self.spec.obs_dim {
            return Err(NnError::bad_input(
                "obs",
                format!(
                    "{n} x {} = {} values",
                    self.spec.obs_dim,
                    n * self.spec.obs_dim
                ),
                format!("{} values", obs.len()),
            ));
        }
        Ok(())
    }

    /// Policy-head output (logits or means), `[n, head]`, and values `[n]`, no graph.
    ///
    /// Large batches run in chunks whose activations stay at or below
    /// [`HOST_CHUNK_FLOATS`] floats: with glibc's default malloc, blocks of
    /// 128 KiB and more are mmapped (or trimmed back to the OS) and freshly
    /// page-faulted on every call, which made a 512-row `act` 1.8x slower.
    fn infer(&self, obs: &[f32], n: usize, actor: bool) -> Result<(Vec<f32>, Vec<f32>)> {
        if !ops::fused_on(self.device()) {
            return self.infer_on_device(obs, n);
        }
        let features;
        let obs = match &self.cnn {
            Some(cnn) => {
                features = cnn.host(obs, n)?;
                &features[..]
            }
            None => obs,
        };
        let (act, d) = (self.spec.activation, self.spec.features_dim());
        let widest = self
            .spec
            .hidden
            .iter()
            .copied()
            .chain([d])
            .max()
            .unwrap_or(d);
        let chunk_rows = (HOST_CHUNK_FLOATS / widest).max(HOST_KERNEL_MAX_BATCH + 1);
        let head_w = self.spec.action.head_width();
        let mut head = Vec::with_capacity(if actor { n * head_w } else { 0 });
        let mut values = Vec::with_capacity(n);
        for chunk in obs.chunks(chunk_rows * d) {
            let rows = chunk.len() / d;
            if self.layout == TrunkLayout::Shared {
                let (h, width) = trunk_host(&self.policy_net, act, chunk, rows, d)?;
                if actor {
                    head.extend(dense_host(
                        &self.action_net,
                        Cow::Borrowed(&h),
                        rows,
                        width,
                        None,
                    )?);
                }
                values.extend(dense_host(&self.value_head, h, rows, width, None)?);
                continue;
            }
            if actor {
                head.extend(mlp_host(
                    &self.policy_net,
                    &self.action_net,
                    act,
                    chunk,
                    rows,
                    d,
                )?);
            }
            values.extend(mlp_host(
                &self.value_net,
                &self.value_head,
                act,
                chunk,
                rows,
                d,
            )?);
        }
        Ok((head, values))
    }

    /// [`Self::infer`] off the fused path: the graph forward on the
    /// parameters' device, one upload of the observations and one read-back
    /// of the head and the values.
    fn infer_on_device(&self, obs: &[f32], n: usize) -> Result<(Vec<f32>, Vec<f32>)> {
        let x = Tensor::from_slice(obs, (n, self.spec.obs_dim), self.device())?;
        let (head, values) = self.heads_graph(&x)?;
        Ok((
            head.detach().flatten_all()?.to_vec1()?,
            values.detach().flatten_all()?.to_vec1()?,
        ))
    }

    /// Chooses actions for `n` observations (`obs` is `n * obs_dim` values,
    /// row-major) and returns them with their log-probabilities and the
    /// critic's values. No gradient graph is built.
    ///
    /// Discrete: samples the categorical over the logits by inverse CDF with
    /// one `rng` draw per observation; `deterministic` takes the arg-max
    /// (first on ties). Continuous: `mean + exp(log_std) * N(0, 1)` (one
    /// standard normal draw per dimension); `deterministic` returns the mean.
    /// Continuous actions are **not** clipped to the bounds (see module docs).
    ///
    /// [`Self::act_masked`] with no masks.
    pub fn act(
        &self,
        obs: &[f32],
        n: usize,
        deterministic: bool,
        rng: &mut impl Rng,
    ) -> Result<ActOutput> {
        self.act_masked(obs, n, None, deterministic, rng)
    }

    /// [`Self::act`] restricted to the legal actions of each observation:
    /// `masks` is `n * n_actions` bytes row-major, 1 legal, 0 illegal
    /// (checked as [`check_masks`]: a row with no legal action is an error
    /// naming the row).
    ///
    /// Sampling draws from the categorical over the legal actions and the
    /// returned log-probability is that of this masked distribution (the
    /// one [`Self::evaluate_masked`] scores, where [`ops::mask_logits`]
    /// replaces the illegal logits by [`ops::MASKED_LOGIT`]). An illegal
    /// action is never chosen: neither sampled nor taken by
    /// `deterministic`'s arg-max, which is the first legal maximum, decided
    /// by the mask even where legal logits tie with the masked value. Same
    /// `rng` draws as [`Self::act`]. `Some` masks for a continuous policy
    /// are an error.
    pub fn act_masked(
        &self,
        obs: &[f32],
        n: usize,
        masks: Option<&[u8]>,
        deterministic: bool,
        rng: &mut impl Rng,
    ) -> Result<ActOutput> {
        self.check_feed_forward("act")?;
        self.act_step(obs, n, None, masks, deterministic, rng)
    }

    /// [`Self::act_masked`] of a recurrent policy: `state` holds each row's
    /// recurrent state ([`Self::state_width`] values a row; zeros at an
    /// episode's start) and is advanced past this step in place. On a
    /// feed-forward policy `state` must be empty and this is
    /// [`Self::act_masked`].
    pub fn act_recurrent(
        &self,
        obs: &[f32],
        n: usize,
        state: &mut [f32],
        masks: Option<&[u8]>,
        deterministic: bool,
        rng: &mut impl Rng,
    ) -> Result<ActOutput> {
        self.check_state(state, n)?;
        let state = (self.cores.is_some()).then_some(state);
        self.act_step(obs, n, state, masks, deterministic, rng)
    }

    /// A feed-forward call on a recurrent policy is an error naming `what`.
    fn check_feed_forward(&self, what: &str) -> Result<()> {
        if self.cores.is_some() {
            return Err(NnError::bad_input(
                "state",
                format!("the recurrent state of each row ({what} of a recurrent policy: act_recurrent / values_recurrent)"),
                "none",
            ));
        }
        Ok(())
    }

    /// `state` holds `n` rows of [`Self::state_width`] finite values.
    fn check_state(&self, state: &[f32], n: usize) -> Result<()> {
        let width = self.state_width();
        if state.len() != n * width {
            return Err(NnError::bad_input(
                "state",
                format!("{n} x {width} = {} values", n * width),
                format!("{} values", state.len()),
            ));
        }
        if let Some(bad) = state.iter().find(|v| !v.is_finite()) {
            return Err(NnError::bad_input("state", "finite values", bad));
        }
        Ok(())
    }

    /// Acting on `n` rows, advancing `state` for a recurrent policy.
    fn act_step(
        &self,
        obs: &[f32],
        n: usize,
        state: Option<&mut [f32]>,
        masks: Option<&[u8]>,
        deterministic: bool,
        rng: &mut impl Rng,
    ) -> Result<ActOutput> {
        self.check_obs(obs, n)?;
        self.check_host_masks(masks, n)?;
        let (head, values) = match state {
            Some(state) => self.infer_recurrent(obs, n, state)?,
            None => self.infer(obs, n, true)?,
        };
        let mut logprobs = Vec::with_capacity(n);
        let actions = match &self.spec.action {
            ActionKind::Discrete { n: k } => {
                let k = *k;
                let mut lsm = vec![0f32; k];
                let mut actions = Vec::with_capacity(n);
                for (r, row) in head.chunks_exact(k).enumerate() {
                    let mask = masks.map(|m| &m[r * k..(r + 1) * k]);
                    ops::masked_log_softmax_row(row, mask, &mut lsm);
                    let a = if deterministic {
                        masked_argmax(&lsm, mask)
                    } else {
                        sample_categorical(&lsm, mask, rng.random::<f32>())
                    };
                    actions.push(a as i64);
                    logprobs.push(lsm[a]);
                }
                Actions::Discrete(actions)
            }
            ActionKind::Continuous { dim, .. } => {
                let dim = *dim;
                let log_std = self.log_std_values()?;
                let std: Vec<f32> = log_std.iter().map(|s| s.exp()).collect();
                let norm: f32 = log_std.iter().sum::<f32>() + HALF_LN_2PI * dim as f32;
                let mut actions = Vec::with_capacity(n * dim);
                for mean in head.chunks_exact(dim) {
                    let mut q = 0f32;
                    for (&m, &s) in mean.iter().zip(&std) {
                        let eps: f32 = if deterministic {
                            0.0
                        } else {
                            rng.sample(StandardNormal)
                        };
                        actions.push(m + s * eps);
                        q += eps * eps;
                    }
                    logprobs.push(-0.5 * q - norm);
                }
                Actions::Continuous(actions)
            }
        };
        Ok(ActOutput {
            actions,
            logprobs,
            values,
        })
    }

    /// Checks `n` rows of host masks against the action space: none, or
    /// [`check_masks`] for a discrete policy; masks for a continuous one are
    /// an error.
    fn check_host_masks(&self, masks: Option<&[u8]>, n: usize) -> Result<()> {
        let Some(masks) = masks else { return Ok(()) };
        match self.spec.action {
            ActionKind::Discrete { n: k } => check_masks(masks, n, k),
            ActionKind::Continuous { .. } => Err(continuous_masks(masks.len())),
        }
    }

    /// Critic values `V(s)` of `n` observations (`n * obs_dim` values), no graph.
    pub fn values(&self, obs: &[f32], n: usize) -> Result<Vec<f32>> {
        self.check_feed_forward("values")?;
        self.check_obs(obs, n)?;
        Ok(self.infer(obs, n, false)?.1)
    }

    /// [`Self::values`] of a recurrent policy, advancing `state` (as
    /// [`Self::act_recurrent`]).
    pub fn values_recurrent(&self, obs: &[f32], n: usize, state: &mut [f32]) -> Result<Vec<f32>> {
        if self.cores.is_none() {
            return self.values(obs, n);
        }
        self.check_obs(obs, n)?;
        self.check_state(state, n)?;
        Ok(self.infer_recurrent(obs, n, state)?.1)
    }

    /// One step of a recurrent policy on `n` rows without a graph: head and
    /// values, `state` advanced in place.
    fn infer_recurrent(
        &self,
        obs: &[f32],
        n: usize,
        state: &mut [f32],
    ) -> Result<(Vec<f32>, Vec<f32>)> {
        let cores = self.cores.as_ref().expect("a recurrent policy");
        if !ops::fused_on(self.device()) {
            let x = Tensor::from_slice(obs, (n, self.spec.obs_dim), self.device())?;
            let keep = Tensor::ones((1, n, 1), DType::F32, self.device())?;
            let initial = Tensor::from_slice(state, (n, cores.state_width()), self.device())?;
            let (head, values, last) = self.heads_sequence_graph(&x, 1, n, &keep, &initial)?;
            state.copy_from_slice(&last.detach().flatten_all()?.to_vec1::<f32>()?);
            return Ok((
                head.detach().flatten_all()?.to_vec1()?,
                values.detach().flatten_all()?.to_vec1()?,
            ));
        }
        let features;
        let x = match &self.cnn {
            Some(cnn) => {
                features = cnn.host(obs, n)?;
                &features[..]
            }
            None => obs,
        };
        let (d, sw) = (self.spec.features_dim(), cores.state_width());
        let hidden = cores.actor.hidden();
        let actor_in = cores.actor.step_host(x, n, d, state, sw, 0)?;
        let act = self.spec.activation;
        match &cores.critic {
            Some(critic) => {
                let critic_in = critic.step_host(x, n, d, state, sw, cores.actor.state_width())?;
                Ok((
                    mlp_host(
                        &self.policy_net,
                        &self.action_net,
                        act,
                        &actor_in,
                        n,
                        hidden,
                    )?,
                    mlp_host(
                        &self.value_net,
                        &self.value_head,
                        act,
                        &critic_in,
                        n,
                        hidden,
                    )?,
                ))
            }
            None => {
                let (h, width) = trunk_host(&self.policy_net, act, &actor_in, n, hidden)?;
                Ok((
                    dense_host(&self.action_net, Cow::Borrowed(&h), n, width, None)?,
                    dense_host(&self.value_head, h, n, width, None)?,
                ))
            }
        }
    }

    fn log_std_values(&self) -> Result<Vec<f32>> {
        let v = self
            .log_std
            .as_ref()
            .ok_or_else(|| candle_core::Error::Msg("discrete policy has no log_std".into()))?;
        Ok(v.as_tensor().to_vec1()?)
    }

    /// Policy-head output `[B, head]` and values `[B, 1]` as a graph.
    fn heads_graph(&self, obs: &Tensor) -> Result<(Tensor, Tensor)> {
        let act = self.spec.activation;
        let features;
        let obs = match &self.cnn {
            Some(cnn) => {
                features = cnn.graph(obs)?;
                &features
            }
            None => obs,
        };
        match self.layout {
            TrunkLayout::Separate => Ok((
                head_graph(&trunk_graph(obs, &self.policy_net, act)?, &self.action_net)?,
                head_graph(&trunk_graph(obs, &self.value_net, act)?, &self.value_head)?,
            )),
            TrunkLayout::Shared => {
                let h = trunk_graph(obs, &self.policy_net, act)?;
                Ok((
                    head_graph(&h, &self.action_net)?,
                    head_graph(&h, &self.value_head)?,
                ))
            }
        }
    }

    /// A recurrent policy's heads over `T` steps of `B` sequences as a graph
    /// (`obs` `[T B, obs_dim]` time-major, `keep` `[T, B, 1]` 0 where a step
    /// starts an episode, `initial` `[B, state_width]`): the policy head
    /// `[T B, head]`, the values `[T B, 1]` and the state after the last
    /// step `[B, state_width]`.
    fn heads_sequence_graph(
        &self,
        obs: &Tensor,
        t_len: usize,
        b: usize,
        keep: &Tensor,
        initial: &Tensor,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let cores = self.cores.as_ref().expect("a recurrent policy");
        let act = self.spec.activation;
        let features;
        let x = match &self.cnn {
            Some(cnn) => {
                features = cnn.graph(obs)?;
                &features
            }
            None => obs,
        };
        let aw = cores.actor.state_width();
        let (a, actor_last) = cores
            .actor
            .unroll(x, t_len, b, keep, &initial.narrow(1, 0, aw)?)?;
        match &cores.critic {
            Some(critic) => {
                let cw = critic.state_width();
                let (c, critic_last) =
                    critic.unroll(x, t_len, b, keep, &initial.narrow(1, aw, cw)?)?;
                Ok((
                    head_graph(&trunk_graph(&a, &self.policy_net, act)?, &self.action_net)?,
                    head_graph(&trunk_graph(&c, &self.value_net, act)?, &self.value_head)?,
                    Tensor::cat(&[actor_last, critic_last], 1)?,
                ))
            }
            None => {
                let h = trunk_graph(&a, &self.policy_net, act)?;
                Ok((
                    head_graph(&h, &self.action_net)?,
                    head_graph(&h, &self.value_head)?,
                    actor_last,
                ))
            }
        }
    }

    /// Differentiable evaluation of a batch for training.
    ///
    /// `obs`: `[B, obs_dim]` f32. `actions`: discrete, `[B]` or `[B, 1]` of any
    /// integer or float dtype holding indices in `0..n`; continuous, `[B, dim]`
    /// (or `[B * dim]`) f32 unclipped samples. Returns `(logprob [B],
    /// entropy [B], value [B])`, all connected to [`Self::vars`] by the graph.
    ///
    /// [`Self::evaluate_masked`] with no masks.
    pub fn evaluate(&self, obs: &Tensor, actions: &Tensor) -> Result<(Tensor, Tensor, Tensor)> {
        self.evaluate_masked(obs, actions, None)
    }

    /// [`Self::evaluate`] of a discrete policy under invalid-action masks:
    /// `masks: [B, n]` u8, 1 legal, 0 illegal (the masks the actions were
    /// chosen under by [`Self::act_masked`]). The logits go through
    /// [`ops::mask_logits`], so the log-probability and the entropy are
    /// those of the categorical over the legal actions (the entropy sums
    /// over them only, finite, 0 with a single legal action), and no
    /// gradient reaches an illegal logit. Checked on the host: a row with no
    /// legal action, or an action its row's mask marks illegal, is an error
    /// naming the row. Runs on the fused CPU path and the composed one
    /// alike. `Some` masks for a continuous policy are an error.
    pub fn evaluate_masked(
        &self,
        obs: &Tensor,
        actions: &Tensor,
        masks: Option<&Tensor>,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let (b, d) = obs.dims2().map_err(|_| {
            NnError::bad_input(
                "obs",
                format!("[B, {}]", self.spec.obs_dim),
                format!("{:?}", obs.dims()),
            )
        })?;
        if d != self.spec.obs_dim {
            return Err(NnError::bad_input(
                "obs",
                format!("[B, {}]", self.spec.obs_dim),
                format!("{:?}", obs.dims()),
            ));
        }
        if let (Some(m), ActionKind::Continuous { .. }) = (masks, &self.spec.action) {
            return Err(continuous_masks(m.elem_count()));
        }
        self.check_feed_forward("evaluate")?;
        let obs = obs.to_dtype(DType::F32)?.contiguous()?;
        let (logits, value) = self.heads_graph(&obs)?;
        self.score(logits, value, actions, masks, b)
    }

    /// [`Self::evaluate_masked`] of a recurrent policy over `B` sequences
    /// of `t_len` steps, by backpropagation through time: `obs` `[T B,
    /// obs_dim]` time-major (row `t B + b` is sequence `b`'s step `t`, and
    /// `actions`, `masks` and the results follow the same rows),
    /// `episode_starts` (`T B`, the same rows) true where a step starts an
    /// episode (the state is zeroed before it), `initial` `[B, state_width]`
    /// each sequence's state at its first step (constant: no gradient
    /// flows into it).
    pub fn evaluate_sequences(
        &self,
        obs: &Tensor,
        t_len: usize,
        episode_starts: &[bool],
        initial: &Tensor,
        actions: &Tensor,
        masks: Option<&Tensor>,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let cores = self.cores.as_ref().ok_or_else(|| {
            NnError::bad_input("model", "a recurrent policy", "a feed-forward one")
        })?;
        let rows = obs.dim(0)?;
        let b = rows / t_len.max(1);
        if t_len == 0 || b * t_len != rows || episode_starts.len() != rows {
            return Err(NnError::bad_input(
                "obs",
                format!("{t_len} steps of B sequences, and as many episode starts"),
                format!("{rows} rows, {} episode starts", episode_starts.len()),
            ));
        }
        if initial.dims() != [b, cores.state_width()] {
            return Err(NnError::bad_input(
                "initial",
                format!("[{b}, {}]", cores.state_width()),
                format!("{:?}", initial.dims()),
            ));
        }
        if let (Some(m), ActionKind::Continuous { .. }) = (masks, &self.spec.action) {
            return Err(continuous_masks(m.elem_count()));
        }
        let keep: Vec<f32> = episode_starts
            .iter()
            .map(|&s| f32::from(u8::from(!s)))
            .collect();
        let keep = Tensor::from_vec(keep, (t_len, b, 1), self.device())?;
        let obs = obs.to_dtype(DType::F32)?.contiguous()?;
        let initial = initial.to_dtype(DType::F32)?.detach();
        let (logits, value, _) = self.heads_sequence_graph(&obs, t_len, b, &keep, &initial)?;
        self.score(logits, value, actions, masks, rows)
    }

    /// Log-probabilities of `actions`, entropies and values `[B]` from the
    /// heads of `b` rows (the end of [`Self::evaluate_masked`] and
    /// [`Self::evaluate_sequences`]).
    fn score(
        &self,
        logits: Tensor,
        value: Tensor,
        actions: &Tensor,
        masks: Option<&Tensor>,
        b: usize,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let value = value.reshape(b)?;
        let (logprob, entropy) = match &self.spec.action {
            ActionKind::Discrete { n } => {
                let acts = discrete_actions(actions, b, *n)?;
                let logits = match masks {
                    None => logits,
                    Some(masks) => {
                        let host = ops::masks_host(masks, b, *n)?;
                        check_masks(&host, b, *n)?;
                        check_legal(&acts, &host, *n)?;
                        ops::apply_masks(&logits, masks)?
                    }
                };
                (
                    ops::categorical_logprob(&logits, acts)?,
                    ops::categorical_entropy(&logits)?,
                )
            }
            ActionKind::Continuous { dim, .. } => {
                if actions.elem_count() != b * dim
                    || !(actions.dims() == [b, *dim] || actions.dims() == [b * dim])
                {
                    return Err(NnError::bad_input(
                        "actions",
                        format!("[{b}, {dim}]"),
                        format!("{:?}", actions.dims()),
                    ));
                }
                let acts: Vec<f32> = actions.flatten_all()?.to_dtype(DType::F32)?.to_vec1()?;
                let log_std = self
                    .log_std
                    .as_ref()
                    .map(|v| v.as_tensor())
                    .expect("continuous policy has log_std");
                (
                    ops::gaussian_logprob(&logits, log_std, acts.into())?,
                    ops::gaussian_entropy(log_std, b)?,
                )
            }
        };
        Ok((logprob, entropy, value))
    }

    /// Every parameter as `(name, shape, row-major data)`, sorted by name.
    pub fn named_tensors(&self) -> Vec<NamedTensor> {
        self.params.named_tensors()
    }

    /// Replaces every parameter. All-or-nothing: every name must be present
    /// exactly once with the right shape, a matching number of values and
    /// only finite values; otherwise the error names the parameter with the
    /// expected and the received shape, and the model is left unchanged.
    pub fn load_named_tensors(&mut self, tensors: &[NamedTensor]) -> Result<()> {
        self.params.load_named_tensors(tensors)
    }

    /// Writes all parameters to a safetensors file (atomically: temp file + rename).
    pub fn save(&self, path: impl AsRef<Path>) -> Result<()> {
        let mut meta = HashMap::new();
        meta.insert("format".to_string(), MODEL_FORMAT.to_string());
        meta.insert("obs_dim".to_string(), self.spec.obs_dim.to_string());
        meta.insert("action".to_string(), format!("{:?}", self.spec.action));
        meta.insert("hidden".to_string(), format!("{:?}", self.spec.hidden));
        meta.insert(
            "activation".to_string(),
            format!("{:?}", self.spec.activation).to_lowercase(),
        );
        if let Some(cnn) = &self.spec.cnn {
            meta.insert("cnn".to_string(), format!("{cnn:?}"));
        }
        meta.insert(
            "layout".to_string(),
            format!("{:?}", self.layout).to_lowercase(),
        );
        write_safetensors(path.as_ref(), &self.named_tensors(), meta)
    }

    /// Loads parameters from a safetensors file written by [`Self::save`] (or
    /// any f32 safetensors file with the same names and shapes, e.g. an SB3
    /// export); validated as [`Self::load_named_tensors`].
    pub fn load(&mut self, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        let (tensors, meta) = read_safetensors(path)?;
        if let Some(format) = meta.get("format") {
            if format != MODEL_FORMAT {
                return Err(NnError::Checkpoint {
                    path: path.to_path_buf(),
                    reason: format!("format is `{format}`, expected `{MODEL_FORMAT}`"),
                });
            }
        }
        self.load_named_tensors(&tensors)
    }
}

/// Discrete actions from any dtype, validated to be whole numbers in `0..n`.
fn discrete_actions(actions: &Tensor, b: usize, n: usize) -> Result<Arc<[u32]>> {
    if actions.elem_count() != b || !(actions.dims() == [b] || actions.dims() == [b, 1]) {
        return Err(NnError::bad_input(
            "actions",
            format!("[{b}] or [{b}, 1]"),
            format!("{:?}", actions.dims()),
        ));
    }
    let raw: Vec<f64> = actions.flatten_all()?.to_dtype(DType::F64)?.to_vec1()?;
    raw.iter()
        .map(|&a| {
            if a >= 0.0 && a < n as f64 && a.fract() == 0.0 {
                Ok(a as u32)
            } else {
                Err(NnError::bad_input(
                    "actions",
                    format!("integers in 0..{n}"),
                    a,
                ))
            }
        })
        .collect()
}

/// The error for masks given to a continuous policy.
fn continuous_masks(len: usize) -> NnError {
    NnError::bad_input(
        "masks",
        "none (action masks apply to discrete policies only)",
        format!("{len} mask values for a continuous policy"),
    )
}

/// Checks that every action is legal under its row's mask (`n` bytes a row).
fn check_legal(actions: &[u32], masks: &[u8], n: usize) -> Result<()> {
    match actions
        .iter()
        .enumerate()
        .find(|&(r, &a)| masks[r * n + a as usize] == 0)
    {
        Some((r, &a)) => Err(NnError::bad_input(
            "actions",
            "actions legal under their masks",
            format!("action {a} at row {r}, which its mask marks illegal"),
        )),
        None => Ok(()),
    }
}

/// Inverse CDF: the first index whose cumulative probability exceeds `u`
/// (`u` uniform in `[0, 1)`); rounding slack goes to the last action with
/// non-zero probability. With a `mask`, illegal actions are skipped (their
/// probability counts as 0 whatever `log_probs` says), so one is never
/// returned when the row has a legal action.
fn sample_categorical(log_probs: &[f32], mask: Option<&[u8]>, u: f32) -> usize {
    let legal = |i: usize| mask.is_none_or(|m| m[i] != 0);
    let mut cum = 0f32;
    let mut last = (0..log_probs.len()).find(|&i| legal(i)).unwrap_or(0);
    for (i, &lp) in log_probs.iter().enumerate() {
        if !legal(i) {
            continue;
        }
        let p = lp.exp();
        if p > 0.0 {
            last = i;
        }
        cum += p;
        if u < cum {
            return i;
        }
    }
    last
}

#[cfg(test)]
mod tests {
    //! Invalid-action masking of the discrete policy: acting and training,
    //! against log-probabilities and entropies worked out by hand.
    use super::*;
    use crate::ops::{composed_on_cpu, MASKED_LOGIT};

    fn rng(seed: u64) -> rand::rngs::StdRng {
        rand::rngs::StdRng::seed_from_u64(seed)
    }

    /// A discrete policy over 3 actions whose logits are `bias` for every
    /// observation (action head weights 0).
    fn fixed_logits(bias: [f32; 3]) -> ActorCritic {
        let mut model = ActorCritic::new(&PolicySpec::discrete(2, 3), 0).unwrap();
        let mut tensors = model.named_tensors();
        for (name, _, data) in tensors.iter_mut() {
            match name.as_str() {
                "action_net.weight" => data.fill(0.0),
                "action_net.bias" => data.copy_from_slice(&bias),
                _ => {}
            }
        }
        model.load_named_tensors(&tensors).unwrap();
        model
    }

    fn obs(n: usize) -> Vec<f32> {
        (0..2 * n).map(|i| (i as f32 * 0.37).sin()).collect()
    }

    fn close(got: &[f32], expected: &[f32], tol: f32) {
        assert_eq!(got.len(), expected.len());
        for (i, (g, e)) in got.iter().zip(expected).enumerate() {
            assert!((g - e).abs() <= tol, "index {i}: {got:?} vs {expected:?}");
        }
    }

    fn discrete(out: &ActOutput) -> &[i64] {
        match &out.actions {
            Actions::Discrete(a) => a,
            Actions::Continuous(_) => panic!("expected discrete actions"),
        }
    }

    #[test]
    fn act_masked_never_picks_an_illegal_action() {
        // Logits [5, 0, 1]: the illegal action 0 is the most likely unmasked.
        // Masked log-probabilities, by hand:
        //   [0, 1, 1]: over logits {0, 1}: log p1 = -ln(1 + e) = -1.313_261_7,
        //              log p2 = -ln(1 + e^-1) = -0.313_261_7
        //   [1, 0, 1]: over {5, 1}: log p0 = -ln(1 + e^-4) = -0.018_149_6,
        //              log p2 = -ln(1 + e^4) = -4.018_149_6
        //   [0, 0, 1]: log p2 = 0
        let model = fixed_logits([5.0, 0.0, 1.0]);
        let kinds: [[u8; 3]; 3] = [[0, 1, 1], [1, 0, 1], [0, 0, 1]];
        let expected_lp = [
            [f32::NAN, -1.313_261_7, -0.313_261_7],
            [-0.018_149_6, f32::NAN, -4.018_149_6],
            [f32::NAN, f32::NAN, 0.0],
        ];
        let n = 900;
        let masks: Vec<u8> = (0..n).flat_map(|r| kinds[r % 3]).collect();
        let out = model
            .act_masked(&obs(n), n, Some(&masks), false, &mut rng(7))
            .unwrap();
        let mut counts = [[0usize; 3]; 3];
        for (r, (&a, &lp)) in discrete(&out).iter().zip(&out.logprobs).enumerate() {
            let a = a as usize;
            assert_eq!(kinds[r % 3][a], 1, "row {r}: illegal action {a}");
            assert!((lp - expected_lp[r % 3][a]).abs() < 1e-5, "row {r}: {lp}");
            counts[r % 3][a] += 1;
        }
        // [0, 1, 1]: p2 = 0.731 of 300 draws; [1, 0, 1]: p2 = 0.018.
        assert!((180..260).contains(&counts[0][2]), "{counts:?}");
        assert!(counts[0][1] > 0 && counts[1][0] > 250, "{counts:?}");

        // Deterministic: the legal arg-max, not the larger illegal logit.
        let det = model
            .act_masked(&obs(3), 3, Some(&masks[..9]), true, &mut rng(0))
            .unwrap();
        assert_eq!(discrete(&det), [2, 0, 2]);
        close(&det.logprobs, &[-0.313_261_7, -0.018_149_6, 0.0], 1e-5);
        let unmasked = model.act(&obs(1), 1, true, &mut rng(0)).unwrap();
        assert_eq!(discrete(&unmasked), [0]);
    }

    #[test]
    fn act_masked_takes_the_mask_over_ties_with_the_masked_logit() {
        // Every logit equals MASKED_LOGIT: only the mask tells them apart.
        let model = fixed_logits([MASKED_LOGIT; 3]);
        let masks = [0u8, 0, 1, 0, 1, 1];
        let det = model
            .act_masked(&obs(2), 2, Some(&masks), true, &mut rng(0))
            .unwrap();
        assert_eq!(discrete(&det), [2, 1]);
        let n = 200;
        let many: Vec<u8> = (0..n).flat_map(|_| [0u8, 1, 1]).collect();
        let out = model
            .act_masked(&obs(n), n, Some(&many), false, &mut rng(3))
            .unwrap();
        assert!(discrete(&out).iter().all(|&a| a != 0));
        assert!(out.logprobs.iter().all(|lp| lp.is_finite()));
    }

    #[test]
    fn act_with_no_or_all_legal_masks_is_unchanged() {
        let model = ActorCritic::new(&PolicySpec::discrete(2, 4), 3).unwrap();
        let (n, x) = (20, obs(20));
        let all = vec![1u8; n * 4];
        for det in [false, true] {
            let plain = model.act(&x, n, det, &mut rng(5)).unwrap();
            let none = model.act_masked(&x, n, None, det, &mut rng(5)).unwrap();
            let ones = model
                .act_masked(&x, n, Some(&all), det, &mut rng(5))
                .unwrap();
            assert_eq!(plain, none);
            assert_eq!(plain, ones);
        }
    }

    #[test]
    fn bad_masks_are_refused() {
        let model = fixed_logits([1.0, 2.0, 3.0]);
        let err = model
            .act_masked(
                &obs(3),
                3,
                Some(&[1, 0, 0, 0, 0, 0, 0, 1, 0]),
                false,
                &mut rng(0),
            )
            .unwrap_err();
        assert!(err.to_string().contains("row 1"), "{err}");
        assert!(model
            .act_masked(&obs(3), 3, Some(&[1, 1, 1]), false, &mut rng(0))
            .is_err());
        let x = Tensor::from_vec(obs(2), (2, 2), &Device::Cpu).unwrap();
        let a = Tensor::new(&[0u32, 1], &Device::Cpu).unwrap();
        let m = Tensor::from_vec(vec![1u8, 1, 0, 0, 0, 0], (2, 3), &Device::Cpu).unwrap();
        let err = model.evaluate_masked(&x, &a, Some(&m)).unwrap_err();
        assert!(err.to_string().contains("row 1"), "{err}");

        let spec = PolicySpec::continuous(2, vec![-1.0], vec![1.0]);
        let cont = ActorCritic::new(&spec, 0).unwrap();
        assert!(cont
            .act_masked(&obs(2), 2, Some(&[1, 1]), false, &mut rng(0))
            .is_err());
        cont.act_masked(&obs(2), 2, None, false, &mut rng(0))
            .unwrap();
        let acts = Tensor::new(&[[0.5f32], [-0.5]], &Device::Cpu).unwrap();
        let m = Tensor::from_vec(vec![1u8, 1], (2, 1), &Device::Cpu).unwrap();
        assert!(cont.evaluate_masked(&x, &acts, Some(&m)).is_err());
    }

    #[test]
    fn evaluate_masked_hand_computed_on_both_paths() {
        // Logits [1, 2, 3] on every row; masks [1, 0, 1], [1, 0, 1], [0, 1, 0];
        // actions 0, 2, 1. With p0 = 1 / (1 + e^2) = 0.119_202_92 and
        // p2 = 0.880_797_08 (see ops' hand-computed test):
        //   log-probs -ln(1 + e^2) = -2.126_928, 2 - ln(1 + e^2) = -0.126_928, 0
        //   entropies 0.365_333_86, 0.365_333_86, 0 (single legal action)
        // d sum(logprob) / d bias_j = Σ_rows (1[j = a] - p_j), illegal terms 0:
        //   j = 0: (1 - p0) - p0 + 0 = 0.761_594_16, j = 1: 0 + 0 + (1 - 1) = 0,
        //   j = 2: -p2 + (1 - p2) + 0 = -0.761_594_16.
        let model = fixed_logits([1.0, 2.0, 3.0]);
        let x = Tensor::from_vec(obs(3), (3, 2), &Device::Cpu).unwrap();
        let a = Tensor::new(&[0i64, 2, 1], &Device::Cpu).unwrap();
        let m = Tensor::from_vec(vec![1u8, 0, 1, 1, 0, 1, 0, 1, 0], (3, 3), &Device::Cpu).unwrap();
        let bias = model.action_net.b.clone();
        let run = || {
            let (lp, h, _) = model.evaluate_masked(&x, &a, Some(&m)).unwrap();
            let g = lp.sum_all().unwrap().backward().unwrap();
            let gb: Vec<f32> = g.get(&bias).unwrap().to_vec1().unwrap();
            let lp: Vec<f32> = lp.to_vec1().unwrap();
            let h: Vec<f32> = h.to_vec1().unwrap();
            (lp, h, gb)
        };
        let fused = run();
        let composed = composed_on_cpu(run);
        for (lp, h, gb) in [&fused, &composed] {
            close(lp, &[-2.126_928, -0.126_928, 0.0], 1e-6);
            close(h, &[0.365_333_86, 0.365_333_86, 0.0], 1e-6);
            assert_eq!(h[2], 0.0);
            close(gb, &[0.761_594_2, 0.0, -0.761_594_2], 1e-6);
        }
        close(&fused.0, &composed.0, 1e-6);
        close(&fused.1, &composed.1, 1e-6);
        close(&fused.2, &composed.2, 1e-6);

        // An action its mask marks illegal is refused, naming the row.
        let bad = Tensor::new(&[0i64, 2, 0], &Device::Cpu).unwrap();
        let err = model.evaluate_masked(&x, &bad, Some(&m)).unwrap_err();
        assert!(err.to_string().contains("row 2"), "{err}");
    }

    #[test]
    fn act_masked_logprobs_are_what_evaluate_masked_scores() {
        let model = ActorCritic::new(&PolicySpec::discrete(2, 4), 11).unwrap();
        let n = 24;
        let x = obs(n);
        let masks: Vec<u8> = (0..n * 4)
            .map(|i| u8::from(i % 4 == i / 4 % 4 || i % 3 == 0))
            .collect();
        let out = model
            .act_masked(&x, n, Some(&masks), false, &mut rng(2))
            .unwrap();
        let a = Tensor::new(discrete(&out), &Device::Cpu).unwrap();
        let xt = Tensor::from_vec(x, (n, 2), &Device::Cpu).unwrap();
        let m = Tensor::from_vec(masks, (n, 4), &Device::Cpu).unwrap();
        let (lp, _, v) = model.evaluate_masked(&xt, &a, Some(&m)).unwrap();
        close(&lp.to_vec1::<f32>().unwrap(), &out.logprobs, 1e-5);
        close(&v.to_vec1::<f32>().unwrap(), &out.values, 1e-5);
        // All legal: the same as unmasked.
        let ones = Tensor::ones((n, 4), DType::U8, &Device::Cpu).unwrap();
        let (lp1, h1, _) = model.evaluate_masked(&xt, &a, Some(&ones)).unwrap();
        let (lp0, h0, _) = model.evaluate(&xt, &a).unwrap();
        assert_eq!(lp1.to_vec1::<f32>().unwrap(), lp0.to_vec1::<f32>().unwrap());
        assert_eq!(h1.to_vec1::<f32>().unwrap(), h0.to_vec1::<f32>().unwrap());
    }
}
