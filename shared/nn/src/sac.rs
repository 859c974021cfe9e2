//! Soft Actor-Critic for continuous actions (Haarnoja et al. 2018), as
//! Stable-Baselines3's `SAC`: a tanh-squashed Gaussian actor, twin Q
//! critics with Polyak-averaged targets, and automatic entropy tuning.
//!
//! # Networks and names (SB3's `SAC.policy` state dict)
//!
//! | name | what |
//! |---|---|
//! | `actor.latent_pi.{2i}.weight/bias` | actor hidden layers on the observation |
//! | `actor.mu.weight/bias` | mean of the pre-squash Gaussian |
//! | `actor.log_std.weight/bias` | its log std (state dependent), clamped to `[log_std_min, log_std_max]` |
//! | `critic.qf{0,1}.{2i}.weight/bias` | each critic's layers on `concat(obs, action)`, last one to `[1]` |
//! | `critic_target.qf{0,1}...` | the target critics (same shapes) |
//! | `log_ent_coef` | `log α`, `[1]` |
//!
//! Init is PyTorch's default (uniform `±1/√fan_in`), as SB3's SAC.
//!
//! # Actions
//!
//! The actor samples `u = μ + σ ε`, squashes `y = tanh(u)` into `(-1, 1)`
//! and the env gets `scale * y + bias` with `scale = (high - low) / 2`,
//! `bias = (high + low) / 2` ([`SacActor::act`]). Log-probabilities are those
//! of `y` (SB3; CleanRL also subtracts `Σ log scale`, a constant that only
//! shifts the entropy target):
//!
//! ```text
//! log π(y|s) = Σ_j log N(u_j; μ_j, σ_j) - Σ_j log(1 - tanh(u_j)^2)
//! log(1 - tanh(u)^2) = 2 (log 2 - u - softplus(-2u))      (stable, exact)
//! ```
//!
//! The replay buffer stores actions in **env units** (what the env-runner
//! stepped); the losses map them back to `(-1, 1)` for the critics, which
//! see squashed actions as in SB3.
//!
//! # One gradient step ([`sac_train_step`], SB3's `SAC.train` order)
//!
//! 1. Sample `a ~ π(·|s)` with log-probs (graph kept for the actor loss).
//! 2. `α = exp(log α)`; if tuned, `L_α = -log α * mean(log π(a|s) + target_entropy)`, step.
//! 3. Critic target `y = R + γ^k (min_i Q'_i(s', a') - α log π(a'|s'))`, `a' ~ π(·|s')`;
//!    `L_Q = 0.5 Σ_i mean((Q_i(s, a) - y)^2)`, step the critics.
//! 4. `L_π = mean(α log π(a|s) - min_i Q_i(s, a))` with the updated critics, step the actor.
//! 5. Polyak update of the target critics with `tau` (when `update_target`).
//!
//! This file holds the networks (spec, actor, twin critic, their acting,
//! weights and checkpoints); the step, its losses and optimizers are
//! `sac/train.rs`, re-exported here.

use std::collections::HashMap;
use std::fmt;
use std::path::Path;
use std::sync::Arc;

use candle_core::{DType, Device, Tensor, Var};
use rand::{Rng, SeedableRng};
use rand_distr::StandardNormal;
use serde::{Deserialize, Serialize};

use crate::error::{NnError, Result};
use crate::init::Init;
use crate::io::NamedTensor;
use crate::layers::{
    dense_host, head_graph, mlp_host, trunk_graph, trunk_host, Dense, LayerBuilder,
};
use crate::ops::{self, precomputed_loss, with_f32};
use crate::params::Params;
use crate::spec::Activation;

mod train;

pub use train::{
    sac_actor_loss, sac_critic_loss, sac_ent_coef_loss, sac_targets, sac_train_step,
    sac_train_step_part, SacBatch, SacConfig, SacOptimizers, SacStats,
};

/// `format` metadata of SAC checkpoints (actor, critics, targets, `log α`).
pub const SAC_FORMAT: &str = "relay-nn/sac";

/// Everything needed to build the SAC networks.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SacSpec {
    /// Length of one flat observation vector.
    pub obs_dim: usize,
    /// Lower bound of each action dimension (env units).
    pub low: Vec<f32>,
    /// Upper bound of each action dimension (env units); `high > low`.
    pub high: Vec<f32>,
    /// Hidden widths of the actor and of each critic. Default `[256, 256]`
    /// (SB3 and CleanRL).
    #[serde(default = "default_hidden")]
    pub hidden: Vec<usize>,
    /// Hidden nonlinearity. Default `relu`.
    #[serde(default = "default_activation")]
    pub activation: Activation,
    /// Lower clamp of the actor's log std. Default `-20` (SB3).
    #[serde(default = "default_log_std_min")]
    pub log_std_min: f32,
    /// Upper clamp of the actor's log std. Default `2` (SB3).
    #[serde(default = "default_log_std_max")]
    pub log_std_max: f32,
}

fn default_hidden() -> Vec<usize> {
    vec![256, 256]
}
fn default_activation() -> Activation {
    Activation::Relu
}
fn default_log_std_min() -> f32 {
    -20.0
}
fn default_log_std_max() -> f32 {
    2.0
}

impl SacSpec {
    /// SB3 defaults for an env with `obs_dim` observations and action bounds.
    pub fn new(obs_dim: usize, low: Vec<f32>, high: Vec<f32>) -> Self {
        Self {
            obs_dim,
            low,
            high,
            hidden: default_hidden(),
            activation: default_activation(),
            log_std_min: default_log_std_min(),
            log_std_max: default_log_std_max(),
        }
    }

    /// Number of action dimensions.
    pub fn action_dim(&self) -> usize {
        self.low.len()
    }

    /// Checks every field; the error names the field.
    pub fn validate(&self) -> Result<()> {
        if self.obs_dim == 0 {
            return Err(NnError::config("obs_dim", "must be at least 1"));
        }
        if self.low.is_empty() {
            return Err(NnError::config(
                "low",
                "needs at least one action dimension",
            ));
        }
        if self.high.len() != self.low.len() {
            return Err(NnError::config(
                "high",
                format!("has {} values, low has {}", self.high.len(), self.low.len()),
            ));
        }
        for (i, (l, h)) in self.low.iter().zip(&self.high).enumerate() {
            if !(l.is_finite() && h.is_finite() && l < h) {
                return Err(NnError::config(
                    "low",
                    format!("dimension {i}: need finite low < high, got {l} and {h}"),
                ));
            }
        }
        if let Some(i) = self.hidden.iter().position(|&h| h == 0) {
            return Err(NnError::config(
                "hidden",
                format!("layer {i} has width 0; every width must be at least 1"),
            ));
        }
        if self.log_std_min.partial_cmp(&self.log_std_max) != Some(std::cmp::Ordering::Less) {
            return Err(NnError::config(
                "log_std_min",
                format!(
                    "must be below log_std_max, got {} and {}",
                    self.log_std_min, self.log_std_max
                ),
            ));
        }
        Ok(())
    }
}

/// A differentiable batch of actor samples ([`SacActor::sample`]).
#[derive(Debug, Clone)]
pub struct ActorSample {
    /// Squashed actions in `(-1, 1)`, `[B, A]`.
    pub actions: Tensor,
    /// `log π(actions | obs)`, `[B]`.
    pub logprob: Tensor,
}

/// The tanh-squashed Gaussian policy.
pub struct SacActor {
    spec: SacSpec,
    trunk: Vec<Dense>,
    mu: Dense,
    log_std: Dense,
    scale: Vec<f32>,
    bias: Vec<f32>,
    params: Params,
}

impl fmt::Debug for SacActor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SacActor")
            .field("spec", &self.spec)
            .field("parameters", &self.params.num_parameters())
            .finish()
    }
}

impl SacActor {
    fn build(spec: &SacSpec, b: &mut LayerBuilder<'_>) -> Result<Self> {
        let start = b.params.len();
        let trunk = b.trunk("actor.latent_pi", spec.obs_dim, &spec.hidden)?;
        let last = spec.hidden.last().copied().unwrap_or(spec.obs_dim);
        let a = spec.action_dim();
        let mu = b.dense("actor.mu", last, a)?;
        let log_std = b.dense("actor.log_std", last, a)?;
        let params = Params::new(b.params[start..].to_vec());
        Ok(Self {
            spec: spec.clone(),
            trunk,
            mu,
            log_std,
            scale: spec
                .low
                .iter()
                .zip(&spec.high)
                .map(|(l, h)| (h - l) / 2.0)
                .collect(),
            bias: spec
                .low
                .iter()
                .zip(&spec.high)
                .map(|(l, h)| (h + l) / 2.0)
                .collect(),
            params,
        })
    }

    /// A standalone actor (e.g. for the inference server, which loads the
    /// learner's `actor.*` tensors into it); deterministic given `seed`.
    pub fn new(spec: &SacSpec, seed: u64) -> Result<Self> {
        spec.validate()?;
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let mut b = LayerBuilder {
            params: Vec::new(),
            init: Init::Draw(&mut rng),
            device: Device::Cpu,
        };
        Self::build(spec, &mut b)
    }

    /// An actor holding `tensors` (the learner's `actor.*`, validated as
    /// [`Self::load_named_tensors`]), with no init drawn.
    pub fn from_named_tensors(spec: &SacSpec, tensors: &[NamedTensor]) -> Result<Self> {
        spec.validate()?;
        let mut b = LayerBuilder {
            params: Vec::new(),
            init: Init::Zeros,
            device: Device::Cpu,
        };
        let mut actor = Self::build(spec, &mut b)?;
        actor.load_named_tensors(tensors)?;
        Ok(actor)
    }

    /// The spec.
    pub fn spec(&self) -> &SacSpec {
        &self.spec
    }

    /// The actor's variables, in parameter-name order.
    pub fn vars(&self) -> Vec<Var> {
        self.params.vars()
    }

    /// Names of the actor's parameters, sorted.
    pub fn parameter_names(&self) -> Vec<&str> {
        self.params.names()
    }

    /// `scale * y + bias`: squashed actions to env units, in place.
    pub fn to_env_units(&self, actions: &mut [f32]) {
        let a = self.spec.action_dim();
        for row in actions.chunks_exact_mut(a) {
            for ((x, s), b) in row.iter_mut().zip(&self.scale).zip(&self.bias) {
                *x = s * *x + b;
            }
        }
    }

    /// `(x - bias) / scale`: env-unit actions to `[-1, 1]`, in place.
    pub fn to_squashed(&self, actions: &mut [f32]) {
        let a = self.spec.action_dim();
        for row in actions.chunks_exact_mut(a) {
            for ((x, s), b) in row.iter_mut().zip(&self.scale).zip(&self.bias) {
                *x = (*x - b) / s;
            }
        }
    }

    /// Actions in env units for `n` observations (`n * obs_dim` values), no
    /// graph: `deterministic` gives `tanh(μ)` scaled, otherwise a sample
    /// (one standard-normal draw per dimension). `n * action_dim` values.
    pub fn act(
        &self,
        obs: &[f32],
        n: usize,
        deterministic: bool,
        rng: &mut impl Rng,
    ) -> Result<Vec<f32>> {
        let d = self.spec.obs_dim;
        if obs.len() != n * d {
            return Err(NnError::bad_input(
                "obs",
                format!("{n} x {d} values"),
                obs.len(),
            ));
        }
        let (h, width) = trunk_host(&self.trunk, self.spec.activation, obs, n, d)?;
        let mu = dense_host(&self.mu, std::borrow::Cow::Borrowed(&h), n, width, None)?;
        let mut out = if deterministic {
            mu.iter().map(|m| m.tanh()).collect()
        } else {
            let log_std = dense_host(&self.log_std, h, n, width, None)?;
            let (lo, hi) = (self.spec.log_std_min, self.spec.log_std_max);
            mu.iter()
                .zip(&log_std)
                .map(|(m, s)| {
                    let eps: f32 = rng.sample(StandardNormal);
                    (m + s.clamp(lo, hi).exp() * eps).tanh()
                })
                .collect::<Vec<f32>>()
        };
        self.to_env_units(&mut out);
        Ok(out)
    }

    /// Mean and clamped log std of the pre-squash Gaussian, `[B, A]` each, as a graph.
    pub fn distribution(&self, obs: &Tensor) -> Result<(Tensor, Tensor)> {
        let obs = check_obs_tensor(obs, self.spec.obs_dim)?;
        let h = trunk_graph(&obs, &self.trunk, self.spec.activation)?;
        let mu = head_graph(&h, &self.mu)?;
        let log_std =
            head_graph(&h, &self.log_std)?.clamp(self.spec.log_std_min, self.spec.log_std_max)?;
        Ok((mu, log_std))
    }

    /// Reparameterised sample with log-probabilities for `obs: [B, obs_dim]`,
    /// differentiable with respect to the actor's vars; draws `B * A`
    /// standard normals from `rng`.
    pub fn sample(&self, obs: &Tensor, rng: &mut impl Rng) -> Result<ActorSample> {
        let n = obs.dims().first().copied().unwrap_or(0) * self.spec.action_dim();
        let eps: Arc<[f32]> = (0..n).map(|_| rng.sample(StandardNormal)).collect();
        self.sample_noise(obs, eps)
    }

    /// [`Self::sample`] with given noise (`B * A` standard-normal values).
    pub fn sample_noise(&self, obs: &Tensor, eps: Arc<[f32]>) -> Result<ActorSample> {
        let (mu, log_std) = self.distribution(obs)?;
        self.sample_with_noise(&mu, &log_std, eps)
    }

    /// [`Self::sample`] with given noise (`B * A` standard-normal values) on
    /// a [`Self::distribution`] output.
    pub fn sample_with_noise(
        &self,
        mu: &Tensor,
        log_std: &Tensor,
        eps: Arc<[f32]>,
    ) -> Result<ActorSample> {
        let a = self.spec.action_dim();
        let out = ops::squashed_gaussian(mu, log_std, eps)?;
        Ok(ActorSample {
            actions: out.narrow(1, 0, a)?,
            logprob: out.narrow(1, a, 1)?.squeeze(1)?,
        })
    }

    /// The actor's parameters (`actor.*`), for the inference server.
    pub fn named_tensors(&self) -> Vec<NamedTensor> {
        self.params.named_tensors()
    }

    /// Replaces the actor's parameters; validated, all-or-nothing.
    pub fn load_named_tensors(&mut self, tensors: &[NamedTensor]) -> Result<()> {
        self.params.load_named_tensors(tensors)
    }
}

fn check_obs_tensor(obs: &Tensor, d: usize) -> Result<Tensor> {
    match obs.dims() {
        [_, w] if *w == d => Ok(obs.to_dtype(DType::F32)?.contiguous()?),
        dims => Err(NnError::bad_input(
            "obs",
            format!("[B, {d}]"),
            format!("{dims:?}"),
        )),
    }
}

/// Two Q critics on `concat(obs, squashed action)`.
pub struct TwinCritic {
    obs_dim: usize,
    action_dim: usize,
    activation: Activation,
    nets: [(Vec<Dense>, Dense); 2],
    params: Params,
}

impl fmt::Debug for TwinCritic {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TwinCritic")
            .field("parameters", &self.params.num_parameters())
            .finish()
    }
}

impl TwinCritic {
    fn build(spec: &SacSpec, prefix: &str, b: &mut LayerBuilder<'_>) -> Result<Self> {
        let start = b.params.len();
        let inp = spec.obs_dim + spec.action_dim();
        let last = spec.hidden.last().copied().unwrap_or(inp);
        let mut net = |i: usize| -> Result<(Vec<Dense>, Dense)> {
            let p = format!("{prefix}.qf{i}");
            let trunk = b.trunk(&p, inp, &spec.hidden)?;
            let head = b.dense(&format!("{p}.{}", 2 * spec.hidden.len()), last, 1)?;
            Ok((trunk, head))
        };
        let nets = [net(0)?, net(1)?];
        let params = Params::new(b.params[start..].to_vec());
        Ok(Self {
            obs_dim: spec.obs_dim,
            action_dim: spec.action_dim(),
            activation: spec.activation,
            nets,
            params,
        })
    }

    /// The critics' variables, in parameter-name order.
    pub fn vars(&self) -> Vec<Var> {
        self.params.vars()
    }

    /// `(Q_0, Q_1)`, `[B]` each, for `obs: [B, obs_dim]` and squashed
    /// `actions: [B, A]`, as a graph.
    pub fn forward(&self, obs: &Tensor, actions: &Tensor) -> Result<(Tensor, Tensor)> {
        let x = self.input(obs, actions)?;
        Ok((self.q_graph(0, &x, false)?, self.q_graph(1, &x, false)?))
    }

    /// `concat(obs, actions)`, `[B, obs_dim + A]`, checked.
    fn input(&self, obs: &Tensor, actions: &Tensor) -> Result<Tensor> {
        let obs = check_obs_tensor(obs, self.obs_dim)?;
        let b = obs.dims2()?.0;
        if actions.dims() != [b, self.action_dim] {
            return Err(NnError::bad_input(
                "actions",
                format!("[{b}, {}]", self.action_dim),
                format!("{:?}", actions.dims()),
            ));
        }
        Ok(Tensor::cat(&[&obs, actions], 1)?)
    }

    /// `Q_i`, `[B]`, on `x = concat(obs, squashed action)`, as a graph
    /// (with the critic's parameters held constant when `frozen`).
    fn q_graph(&self, i: usize, x: &Tensor, frozen: bool) -> Result<Tensor> {
        let layer = |h: &Tensor, l: &Dense, act: Option<Activation>| -> Result<Tensor> {
            Ok(if frozen {
                ops::linear(h, &l.w.as_tensor().detach(), &l.b.as_tensor().detach(), act)?
            } else {
                ops::linear(h, &l.w, &l.b, act)?
            })
        };
        let (trunk, head) = &self.nets[i];
        let mut h = x.clone();
        for l in trunk {
            h = layer(&h, l, Some(self.activation))?;
        }
        Ok(layer(&h, head, None)?.squeeze(1)?)
    }

    /// `Q_i` for `n` rows of `concat(obs, squashed action)`
    /// (`n * (obs_dim + A)` values), no graph.
    pub fn q_host(&self, i: usize, obs_actions: &[f32], n: usize) -> Result<Vec<f32>> {
        let w = self.obs_dim + self.action_dim;
        if obs_actions.len() != n * w {
            return Err(NnError::bad_input(
                "obs_actions",
                format!("{n} x {w} values"),
                obs_actions.len(),
            ));
        }
        let (trunk, head) = &self.nets[i];
        mlp_host(trunk, head, self.activation, obs_actions, n, w)
    }

    /// `Q_i(s, a)`, `[B]`, and its gradient with respect to each row's
    /// squashed action, `[B * A]`, with the critic's parameters held
    /// constant: what the actor loss needs of critic `i`.
    pub fn q_and_action_grad(
        &self,
        i: usize,
        obs: &Tensor,
        actions: &[f32],
    ) -> Result<(Vec<f32>, Vec<f32>)> {
        let b = check_obs_tensor(obs, self.obs_dim)?.dims2()?.0;
        let a = Var::from_slice(actions, (b, self.action_dim), &Device::Cpu)?;
        let q = self.q_graph(i, &self.input(obs, a.as_tensor())?, true)?;
        let q_values: Vec<f32> = with_f32(&q, "q_and_action_grad", |x| x.to_vec())?;
        // Rows are independent, so one backward of Σ_r Q_i[r] gives every
        // row's own ∂Q_i[r]/∂a[r].
        let grads = precomputed_loss(&q, 0.0, vec![1.0; b])?.backward()?;
        let grad = grads.get(a.as_tensor()).ok_or_else(|| {
            NnError::bad_input("actions", "a gradient path to the critic", "none")
        })?;
        let grad: Vec<f32> = with_f32(grad, "q_and_action_grad", |x| x.to_vec())?;
        Ok((q_values, grad))
    }

    /// Polyak update `self = (1 - tau) self + tau source` (target critics).
    /// Names differ (`critic_target.*` vs `critic.*`) but are matched by
    /// position, which is the same sorted order.
    pub fn soft_update(&self, source: &TwinCritic, tau: f32) -> Result<()> {
        self.params.soft_update_positional(&source.params, tau)
    }

    /// The critics' parameters.
    pub fn named_tensors(&self) -> Vec<NamedTensor> {
        self.params.named_tensors()
    }
}

/// Actor, twin critics, target critics and `log α`.
pub struct Sac {
    /// The policy.
    pub actor: SacActor,
    /// The critics being trained.
    pub critic: TwinCritic,
    /// Polyak-averaged copies of the critics, for the targets.
    pub critic_target: TwinCritic,
    /// `log α`, `[1]` (trained when entropy tuning is on).
    pub log_ent_coef: Var,
    spec: SacSpec,
    all: Params,
}

impl fmt::Debug for Sac {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Sac")
            .field("spec", &self.spec)
            .field("parameters", &self.all.num_parameters())
            .finish()
    }
}

impl Sac {
    /// Fresh networks (targets equal to the critics), `log α = ln(init_ent_coef)`;
    /// deterministic given `seed`.
    pub fn new(spec: &SacSpec, init_ent_coef: f64, seed: u64) -> Result<Self> {
        spec.validate()?;
        if !(init_ent_coef.is_finite() && init_ent_coef > 0.0) {
            return Err(NnError::config(
                "init_ent_coef",
                format!("must be > 0, got {init_ent_coef}"),
            ));
        }
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let mut b = LayerBuilder {
            params: Vec::new(),
            init: Init::Draw(&mut rng),
            device: Device::Cpu,
        };
        let actor = SacActor::build(spec, &mut b)?;
        let critic = TwinCritic::build(spec, "critic", &mut b)?;
        let critic_target = TwinCritic::build(spec, "critic_target", &mut b)?;
        critic_target
            .params
            .soft_update_positional(&critic.params, 1.0)?;
        let log_ent_coef = Var::from_vec(vec![init_ent_coef.ln() as f32], 1, &Device::Cpu)?;
        let mut all = b.params;
        all.push(("log_ent_coef".into(), log_ent_coef.clone()));
        Ok(Self {
            actor,
            critic,
            critic_target,
            log_ent_coef,
            spec: spec.clone(),
            all: Params::new(all),
        })
    }

    /// The spec.
    pub fn spec(&self) -> &SacSpec {
        &self.spec
    }

    /// `α = exp(log α)`.
    pub fn ent_coef(&self) -> Result<f32> {
        Ok(self.log_ent_coef.as_tensor().to_vec1::<f32>()?[0].exp())
    }

    /// Every parameter (actor, critics, targets, `log_ent_coef`), sorted.
    pub fn named_tensors(&self) -> Vec<NamedTensor> {
        self.all.named_tensors()
    }

    /// Replaces every parameter; validated, all-or-nothing.
    pub fn load_named_tensors(&mut self, tensors: &[NamedTensor]) -> Result<()> {
        self.all.load_named_tensors(tensors)
    }

    /// Total number of scalar parameters (targets included).
    pub fn num_parameters(&self) -> usize {
        self.all.num_parameters()
    }

    /// Writes every parameter to a safetensors file (atomic).
    pub fn save(&self, path: impl AsRef<Path>) -> Result<()> {
        let meta: HashMap<String, String> = [
            ("obs_dim", self.spec.obs_dim.to_string()),
            ("low", format!("{:?}", self.spec.low)),
            ("high", format!("{:?}", self.spec.high)),
            ("hidden", format!("{:?}", self.spec.hidden)),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
        self.all.save(path.as_ref(), SAC_FORMAT, meta)
    }

    /// Loads a file written by [`Self::save`]; validated, all-or-nothing.
    pub fn load(&mut self, path: impl AsRef<Path>) -> Result<()> {
        self.all.load(path.as_ref(), SAC_FORMAT).map(|_| ())
    }
}
