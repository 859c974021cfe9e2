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
//! | `log_std` (continuous only) | `[dim]`; `[latent, dim]` with gSDE ([`crate::gsde`]) | `init_log_std` |
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
//! This file holds the parameters (layout, init, weights, checkpoints) and
//! the training graph; the graph-free acting path is `model/act.rs`, the
//! tests `model/tests.rs`.
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

use std::collections::HashMap;
use std::fmt;
use std::path::Path;
use std::sync::Arc;

use candle_core::{DType, Device, Tensor, Var};
use candle_nn::VarMap;
use rand::SeedableRng;

use crate::conv::Cnn;
use crate::error::{NnError, Result};
use crate::gsde;
use crate::init::{Init, LayerInit};
use crate::io::{read_safetensors, write_safetensors, NamedTensor};
pub use crate::layers::HOST_KERNEL_MAX_BATCH;
use crate::layers::{head_graph, new_layer, trunk_graph, Dense};
use crate::ops::{self, check_masks};
use crate::params::Params;
use crate::recurrent::Core;
use crate::spec::{ActionKind, PolicySpec};
pub use relay_config::hyper::policy::TrunkLayout;

mod act;

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

/// The heads of a batch as a graph: the policy head (logits or means)
/// `[B, head]`, the values `[B, 1]`, and the actor's latent `[B, latent]`
/// (its last hidden layer), which gSDE's variance reads.
struct Heads {
    policy: Tensor,
    value: Tensor,
    latent: Tensor,
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
        let layer_init = |gain: f64| {
            if spec.ortho_init {
                LayerInit::Orthogonal(gain)
            } else {
                LayerInit::FanIn
            }
        };
        let cnn = match &spec.cnn {
            Some(c) => Some(Cnn::new(
                c,
                layer_init(hidden_gain),
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
                layer_init(gain),
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
            // gSDE's is a matrix over the latent (`crate::gsde`).
            ActionKind::Continuous { dim, .. } if spec.use_sde => {
                let latent = spec.sde_latent_dim();
                let v = Var::from_vec(vec![spec.init_log_std; latent * dim], (latent, *dim), dev)?;
                params.push(("log_std".into(), v.clone()));
                Some(v)
            }
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

    /// The heads of a batch as a graph.
    fn heads_graph(&self, obs: &Tensor) -> Result<Heads> {
        let act = self.spec.activation;
        let features;
        let obs = match &self.cnn {
            Some(cnn) => {
                features = cnn.graph(obs)?;
                &features
            }
            None => obs,
        };
        let latent = trunk_graph(obs, &self.policy_net, act)?;
        let value = match self.layout {
            TrunkLayout::Separate => {
                head_graph(&trunk_graph(obs, &self.value_net, act)?, &self.value_head)?
            }
            TrunkLayout::Shared => head_graph(&latent, &self.value_head)?,
        };
        Ok(Heads {
            policy: head_graph(&latent, &self.action_net)?,
            value,
            latent,
        })
    }

    /// A recurrent policy's heads over `T` steps of `B` sequences as a graph
    /// (`obs` `[T B, obs_dim]` time-major, `keep` `[T, B, 1]` 0 where a step
    /// starts an episode, `initial` `[B, state_width]`): the heads over the
    /// `T B` rows and the state after the last step `[B, state_width]`.
    fn heads_sequence_graph(
        &self,
        obs: &Tensor,
        t_len: usize,
        b: usize,
        keep: &Tensor,
        initial: &Tensor,
    ) -> Result<(Heads, Tensor)> {
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
        let latent = trunk_graph(&a, &self.policy_net, act)?;
        let (value, last) = match &cores.critic {
            Some(critic) => {
                let cw = critic.state_width();
                let (c, critic_last) =
                    critic.unroll(x, t_len, b, keep, &initial.narrow(1, aw, cw)?)?;
                (
                    head_graph(&trunk_graph(&c, &self.value_net, act)?, &self.value_head)?,
                    Tensor::cat(&[actor_last, critic_last], 1)?,
                )
            }
            None => (head_graph(&latent, &self.value_head)?, actor_last),
        };
        let heads = Heads {
            policy: head_graph(&latent, &self.action_net)?,
            value,
            latent,
        };
        Ok((heads, last))
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
        let heads = self.heads_graph(&obs)?;
        self.score(heads, actions, masks, b)
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
        let (heads, _) = self.heads_sequence_graph(&obs, t_len, b, &keep, &initial)?;
        self.score(heads, actions, masks, rows)
    }

    /// Log-probabilities of `actions`, entropies and values `[B]` from the
    /// heads of `b` rows (the end of [`Self::evaluate_masked`] and
    /// [`Self::evaluate_sequences`]).
    fn score(
        &self,
        heads: Heads,
        actions: &Tensor,
        masks: Option<&Tensor>,
        b: usize,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let Heads {
            policy: logits,
            value,
            latent,
        } = heads;
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
                if self.spec.use_sde {
                    gsde::logprob_entropy(&logits, log_std, &latent, &acts)?
                } else {
                    (
                        ops::gaussian_logprob(&logits, log_std, acts.into())?,
                        ops::gaussian_entropy(log_std, b)?,
                    )
                }
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

#[cfg(test)]
mod tests;
