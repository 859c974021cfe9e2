//! The Q-network of DQN: an MLP from an observation (or, for images, from
//! a CNN's features) to one value per discrete action, optionally dueling;
//! acting (greedy and epsilon-greedy), weight exchange, checkpoints, and
//! target-network updates.
//!
//! # Layout
//!
//! Names follow SB3's `QNetwork` (`DQN.policy.q_net` state dict), so an SB3
//! export loads as is:
//!
//! | name | shape | init |
//! |---|---|---|
//! | `features_extractor.*` (with `cnn`) | the CNN's, see [`crate::conv`] | PyTorch default |
//! | `q_net.{2i}.weight` / `.bias` | `[hidden[i], in]` / `[hidden[i]]` | PyTorch default (uniform ±1/√in) |
//! | `q_net.{2L}.weight` / `.bias` (not dueling; `L = hidden.len()`) | `[n_actions, last]` / `[n_actions]` | same |
//! | `value_stream.weight` / `.bias` (dueling) | `[1, last]` / `[1]` | same |
//! | `advantage_stream.weight` / `.bias` (dueling) | `[n_actions, last]` / `[n_actions]` | same |
//!
//! Dueling (Wang et al. 2016): `Q(s, a) = V(s) + A(s, a) - mean_a' A(s, a')`,
//! both streams linear heads on the shared hidden layers.
//!
//! With a CNN (`QNetSpec::cnn`, SB3's DQN `CnnPolicy`: NatureCNN's 512
//! features, then `net_arch=[]`, a linear layer to the actions), the hidden
//! layers read its features instead of the observation; observations are
//! then pixel values `0..=255` as f32, which the CNN scales.
//!
//! # Invalid-action masks
//!
//! The `_masked` acting functions take optional masks (`n_actions` bytes per
//! observation, 1 legal, 0 illegal, checked as [`crate::ops::check_masks`]):
//! the greedy action is the first legal maximum ([`masked_argmax`]) and
//! exploration draws uniformly among the legal actions. The Q-values
//! themselves are not masked; [`crate::dqn_targets`] takes the masks of the
//! next states to bootstrap from their legal actions only.
//!
//! # Two forward paths
//!
//! As [`crate::ActorCritic`]: [`QNetwork::forward`] builds a differentiable
//! graph of fused ops (training); [`QNetwork::q_values`] and the acting
//! functions read the `Var`s in place with no graph (inference, and the
//! target network's values in [`crate::dqn_loss`]); a CNN runs its own
//! graph and graph-free paths in front of them.

use std::borrow::Cow;
use std::collections::HashMap;
use std::fmt;
use std::path::Path;

use candle_core::{DType, Device, Tensor, Var};
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};

use crate::conv::Cnn;
use crate::error::{NnError, Result};
use crate::init::{Init, LayerInit};
use crate::io::NamedTensor;
use crate::layers::{dense_host, head_graph, trunk_graph, trunk_host, Dense, LayerBuilder};
use crate::ops::check_masks;
pub use crate::ops::masked_argmax;
use crate::params::Params;
use crate::spec::{validate_cnn, ActionKind, Activation, CnnSpec, PolicySpec};

/// `format` metadata written into Q-network checkpoints.
pub const QNET_FORMAT: &str = "relay-nn/q-network";

/// Everything needed to build a [`QNetwork`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct QNetSpec {
    /// Length of one flat observation vector.
    pub obs_dim: usize,
    /// Number of discrete actions (at least 1).
    pub n_actions: usize,
    /// Hidden-layer widths. Default `[64, 64]` (SB3 DQN; CleanRL uses `[120, 84]`).
    #[serde(default = "default_hidden")]
    pub hidden: Vec<usize>,
    /// Hidden-layer nonlinearity. Default `relu` (SB3 DQN and CleanRL).
    #[serde(default = "default_activation")]
    pub activation: Activation,
    /// Dueling streams (value + mean-subtracted advantage). Default `false`.
    #[serde(default)]
    pub dueling: bool,
    /// A convolutional features extractor in front of the hidden layers,
    /// for image observations (`None`: the flat observation feeds them).
    /// SB3's DQN `CnnPolicy` is NatureCNN with `hidden: []`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cnn: Option<CnnSpec>,
}

fn default_hidden() -> Vec<usize> {
    vec![64, 64]
}

fn default_activation() -> Activation {
    Activation::Relu
}

impl QNetSpec {
    /// SB3 DQN defaults: hidden `[64, 64]`, ReLU, not dueling.
    pub fn new(obs_dim: usize, n_actions: usize) -> Self {
        Self {
            obs_dim,
            n_actions,
            hidden: default_hidden(),
            activation: default_activation(),
            dueling: false,
            cnn: None,
        }
    }

    /// The Q-network for a run's discrete [`PolicySpec`] (same observation
    /// size, action count, widths, activation and CNN).
    pub fn from_policy_spec(spec: &PolicySpec) -> Result<Self> {
        let ActionKind::Discrete { n } = spec.action else {
            return Err(NnError::config(
                "action",
                "a Q-network needs discrete actions",
            ));
        };
        Ok(Self {
            obs_dim: spec.obs_dim,
            n_actions: n,
            hidden: spec.hidden.clone(),
            activation: spec.activation,
            dueling: false,
            cnn: spec.cnn.clone(),
        })
    }

    /// Width of what the hidden layers read: the CNN's features, or the
    /// observation itself.
    pub fn features_dim(&self) -> usize {
        self.cnn.as_ref().map_or(self.obs_dim, |c| c.features_dim)
    }

    /// Checks every field; the error names the field.
    pub fn validate(&self) -> Result<()> {
        if self.obs_dim == 0 {
            return Err(NnError::config("obs_dim", "must be at least 1"));
        }
        if self.n_actions == 0 {
            return Err(NnError::config("n_actions", "must be at least 1"));
        }
        if let Some(i) = self.hidden.iter().position(|&h| h == 0) {
            return Err(NnError::config(
                "hidden",
                format!("layer {i} has width 0; every width must be at least 1"),
            ));
        }
        validate_cnn(self.cnn.as_ref(), self.obs_dim)
    }
}

enum Head {
    Plain(Dense),
    Dueling { value: Dense, advantage: Dense },
}

/// A Q-network (see the module docs).
pub struct QNetwork {
    spec: QNetSpec,
    /// The image features extractor of a CNN Q-network.
    cnn: Option<Cnn>,
    trunk: Vec<Dense>,
    head: Head,
    params: Params,
}

impl fmt::Debug for QNetwork {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("QNetwork")
            .field("spec", &self.spec)
            .field("parameters", &self.num_parameters())
            .finish()
    }
}

impl QNetwork {
    /// A freshly initialised network; deterministic given `seed`.
    pub fn new(spec: &QNetSpec, seed: u64) -> Result<Self> {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        Self::build(spec, Init::Draw(&mut rng), &Device::Cpu)
    }

    /// A network holding `tensors` (validated as
    /// [`Self::load_named_tensors`]), with no init drawn.
    pub fn from_named_tensors(spec: &QNetSpec, tensors: &[NamedTensor]) -> Result<Self> {
        let mut net = Self::build(spec, Init::Zeros, &Device::Cpu)?;
        net.load_named_tensors(tensors)?;
        Ok(net)
    }

    /// This network with its parameters on `device`; itself when it is
    /// there already (see [`crate::ActorCritic::to_device`]).
    pub fn to_device(self, device: &Device) -> Result<Self> {
        if self.device().same_device(device) {
            return Ok(self);
        }
        let mut net = Self::build(&self.spec, Init::Zeros, device)?;
        net.load_named_tensors(&self.named_tensors())?;
        Ok(net)
    }

    /// The device the parameters live on.
    pub fn device(&self) -> &Device {
        self.params
            .iter()
            .next()
            .expect("a network has parameters")
            .1
            .device()
    }

    fn build(spec: &QNetSpec, init: Init<'_>, device: &Device) -> Result<Self> {
        spec.validate()?;
        let mut b = LayerBuilder {
            params: Vec::new(),
            init,
            device: device.clone(),
        };
        let cnn = match &spec.cnn {
            Some(c) => Some(Cnn::new(
                c,
                LayerInit::FanIn,
                &mut b.init,
                &mut b.params,
                device,
            )?),
            None => None,
        };
        let trunk = b.trunk("q_net", spec.features_dim(), &spec.hidden)?;
        let last = spec.hidden.last().copied().unwrap_or(spec.features_dim());
        let head = if spec.dueling {
            Head::Dueling {
                value: b.dense("value_stream", last, 1)?,
                advantage: b.dense("advantage_stream", last, spec.n_actions)?,
            }
        } else {
            Head::Plain(b.dense(
                &format!("q_net.{}", 2 * spec.hidden.len()),
                last,
                spec.n_actions,
            )?)
        };
        Ok(Self {
            spec: spec.clone(),
            cnn,
            trunk,
            head,
            params: Params::new(b.params),
        })
    }

    /// A network of the same spec whose parameters equal this one's (the
    /// initial target network).
    pub fn duplicate(&self) -> Result<Self> {
        let copy = Self::build(&self.spec, Init::Zeros, self.device())?;
        copy.copy_from(self)?;
        Ok(copy)
    }

    /// The spec the network was built from.
    pub fn spec(&self) -> &QNetSpec {
        &self.spec
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
        let d = self.spec.obs_dim;
        if obs.len() != n * d {
            return Err(NnError::bad_input(
                "obs",
                format!("{n} x {d} = {} values", n * d),
                format!("{} values", obs.len()),
            ));
        }
        Ok(())
    }

    /// `Q(s, ·)` of `n` observations (`n * obs_dim` values), `n * n_actions`
    /// values row-major; no graph.
    pub fn q_values(&self, obs: &[f32], n: usize) -> Result<Vec<f32>> {
        self.check_obs(obs, n)?;
        if !crate::ops::fused_on(self.device()) {
            // The graph forward where the parameters are; one read-back.
            let x = Tensor::from_slice(obs, (n, self.spec.obs_dim), self.device())?;
            return Ok(self.forward(&x)?.detach().flatten_all()?.to_vec1()?);
        }
        let features;
        let x = match &self.cnn {
            Some(cnn) => {
                features = cnn.host(obs, n)?;
                &features[..]
            }
            None => obs,
        };
        let d = self.spec.features_dim();
        let (h, width) = trunk_host(&self.trunk, self.spec.activation, x, n, d)?;
        match &self.head {
            Head::Plain(head) => dense_host(head, h, n, width, None),
            Head::Dueling { value, advantage } => {
                let v = dense_host(value, Cow::Borrowed(&h), n, width, None)?;
                let mut q = dense_host(advantage, h, n, width, None)?;
                let k = self.spec.n_actions;
                for (row, v) in q.chunks_exact_mut(k).zip(v) {
                    let mean = row.iter().sum::<f32>() / k as f32;
                    for x in row.iter_mut() {
                        *x = v + (*x - mean);
                    }
                }
                Ok(q)
            }
        }
    }

    /// The arg-max action of each of `n` observations (first on ties).
    ///
    /// [`Self::greedy_actions_masked`] with no masks.
    pub fn greedy_actions(&self, obs: &[f32], n: usize) -> Result<Vec<i64>> {
        self.greedy_actions_masked(obs, n, None)
    }

    /// The legal arg-max action of each of `n` observations ([`masked_argmax`]:
    /// the first legal maximum): `masks` is `n * n_actions` bytes, 1 legal, 0
    /// illegal (`None`: all legal), checked as [`check_masks`] (a row with
    /// no legal action is an error naming the row).
    pub fn greedy_actions_masked(
        &self,
        obs: &[f32],
        n: usize,
        masks: Option<&[u8]>,
    ) -> Result<Vec<i64>> {
        let k = self.spec.n_actions;
        self.check_obs(obs, n)?;
        if let Some(m) = masks {
            check_masks(m, n, k)?;
        }
        let q = self.q_values(obs, n)?;
        Ok(q.chunks_exact(k)
            .enumerate()
            .map(|(r, row)| masked_argmax(row, masks.map(|m| &m[r * k..(r + 1) * k])) as i64)
            .collect())
    }

    /// Epsilon-greedy actions: for each observation independently, with
    /// probability `epsilon` a uniform random action, else the greedy one.
    /// (SB3 and CleanRL draw once per vector-env step and explore in all
    /// envs together; per observation is what a batching inference server
    /// serving many runners can do, and the marginal per env is the same.)
    /// Uses one `rng` draw per observation, plus one per random action.
    ///
    /// [`Self::act_epsilon_greedy_masked`] with no masks.
    pub fn act_epsilon_greedy(
        &self,
        obs: &[f32],
        n: usize,
        epsilon: f64,
        rng: &mut impl Rng,
    ) -> Result<Vec<i64>> {
        self.act_epsilon_greedy_masked(obs, n, epsilon, None, rng)
    }

    /// [`Self::act_epsilon_greedy`] among the legal actions of each
    /// observation (`masks` as [`Self::greedy_actions_masked`]): exploration
    /// draws uniformly among the legal actions, exploitation takes the legal
    /// arg-max. The same `rng` draws as unmasked: one per observation, plus
    /// one per random action.
    pub fn act_epsilon_greedy_masked(
        &self,
        obs: &[f32],
        n: usize,
        epsilon: f64,
        masks: Option<&[u8]>,
        rng: &mut impl Rng,
    ) -> Result<Vec<i64>> {
        if !(0.0..=1.0).contains(&epsilon) {
            return Err(NnError::bad_input("epsilon", "a value in [0, 1]", epsilon));
        }
        let k = self.spec.n_actions;
        let greedy = self.greedy_actions_masked(obs, n, masks)?;
        Ok(greedy
            .into_iter()
            .enumerate()
            .map(|(r, a)| {
                if rng.random::<f64>() >= epsilon {
                    return a;
                }
                match masks {
                    None => rng.random_range(0..k) as i64,
                    Some(m) => {
                        let row = &m[r * k..(r + 1) * k];
                        let legal = row.iter().filter(|&&ok| ok != 0).count();
                        let pick = rng.random_range(0..legal);
                        row.iter()
                            .enumerate()
                            .filter(|&(_, &ok)| ok != 0)
                            .nth(pick)
                            .map_or(a, |(j, _)| j as i64)
                    }
                }
            })
            .collect())
    }

    /// Differentiable `Q(s, ·)`, `obs: [B, obs_dim]` → `[B, n_actions]`,
    /// connected to [`Self::vars`] by the graph.
    pub fn forward(&self, obs: &Tensor) -> Result<Tensor> {
        let d = self.spec.obs_dim;
        match obs.dims() {
            [_, w] if *w == d => {}
            dims => {
                return Err(NnError::bad_input(
                    "obs",
                    format!("[B, {d}]"),
                    format!("{dims:?}"),
                ))
            }
        }
        let mut x = obs.to_dtype(DType::F32)?.contiguous()?;
        if let Some(cnn) = &self.cnn {
            x = cnn.graph(&x)?;
        }
        let h = trunk_graph(&x, &self.trunk, self.spec.activation)?;
        match &self.head {
            Head::Plain(head) => head_graph(&h, head),
            Head::Dueling { value, advantage } => {
                let v = head_graph(&h, value)?;
                let a = head_graph(&h, advantage)?;
                let centred = a.broadcast_sub(&a.mean_keepdim(1)?)?;
                Ok(centred.broadcast_add(&v)?)
            }
        }
    }

    /// Every parameter as `(name, shape, row-major data)`, sorted by name.
    pub fn named_tensors(&self) -> Vec<NamedTensor> {
        self.params.named_tensors()
    }

    /// Replaces every parameter; validated and all-or-nothing as
    /// [`crate::ActorCritic::load_named_tensors`].
    pub fn load_named_tensors(&mut self, tensors: &[NamedTensor]) -> Result<()> {
        self.params.load_named_tensors(tensors)
    }

    /// Hard update: copies every parameter of `source` (same spec) into this
    /// network (DQN's target update with `tau = 1`).
    pub fn copy_from(&self, source: &QNetwork) -> Result<()> {
        self.params.copy_from(&source.params)
    }

    /// Polyak update `self = (1 - tau) self + tau source`, in place (SB3's
    /// `polyak_update`); `tau = 1` copies exactly.
    pub fn soft_update(&self, source: &QNetwork, tau: f32) -> Result<()> {
        self.params.soft_update(&source.params, tau)
    }

    /// Writes all parameters to a safetensors file (atomic).
    pub fn save(&self, path: impl AsRef<Path>) -> Result<()> {
        let s = &self.spec;
        let meta: HashMap<String, String> = [
            ("obs_dim", s.obs_dim.to_string()),
            ("n_actions", s.n_actions.to_string()),
            ("hidden", format!("{:?}", s.hidden)),
            ("activation", format!("{:?}", s.activation).to_lowercase()),
            ("dueling", s.dueling.to_string()),
        ]
        .into_iter()
        .chain(s.cnn.as_ref().map(|c| ("cnn", format!("{c:?}"))))
        .map(|(k, v)| (k.to_string(), v))
        .collect();
        self.params.save(path.as_ref(), QNET_FORMAT, meta)
    }

    /// Loads parameters from a file written by [`Self::save`] (or an SB3
    /// export with the same names); validated as [`Self::load_named_tensors`].
    pub fn load(&mut self, path: impl AsRef<Path>) -> Result<()> {
        self.params.load(path.as_ref(), QNET_FORMAT).map(|_| ())
    }
}

#[cfg(test)]
pub(crate) mod tests {
    //! Masked greedy and epsilon-greedy acting.
    use super::*;

    /// A linear Q-network over 3 actions whose Q-values are `bias` for every
    /// observation (weights 0).
    pub(crate) fn fixed_q(bias: [f32; 3]) -> QNetwork {
        let spec = QNetSpec {
            hidden: vec![],
            ..QNetSpec::new(1, 3)
        };
        let mut net = QNetwork::new(&spec, 0).unwrap();
        net.load_named_tensors(&[
            ("q_net.0.bias".into(), vec![3], bias.to_vec()),
            ("q_net.0.weight".into(), vec![3, 1], vec![0.0; 3]),
        ])
        .unwrap();
        net
    }

    #[test]
    fn greedy_masked_picks_the_legal_argmax() {
        let net = fixed_q([5.0, 1.0, 3.0]);
        let obs = [0.1, -0.2, 0.3];
        let masks = [0, 1, 1, 1, 0, 0, 0, 1, 0];
        assert_eq!(
            net.greedy_actions_masked(&obs, 3, Some(&masks)).unwrap(),
            [2, 0, 1]
        );
        assert_eq!(net.greedy_actions(&obs, 3).unwrap(), [0, 0, 0]);
        assert_eq!(net.greedy_actions_masked(&obs, 3, None).unwrap(), [0, 0, 0]);
        // Epsilon 0 is the masked greedy action.
        let mut rng = rand::rngs::StdRng::seed_from_u64(0);
        let eps0 = net.act_epsilon_greedy_masked(&obs, 3, 0.0, Some(&masks), &mut rng);
        assert_eq!(eps0.unwrap(), [2, 0, 1]);
        let err = net
            .greedy_actions_masked(&obs, 3, Some(&[1, 1, 1, 0, 0, 0, 0, 1, 0]))
            .unwrap_err();
        assert!(err.to_string().contains("row 1"), "{err}");
        assert!(net.greedy_actions_masked(&obs, 3, Some(&[1, 1])).is_err());
    }

    #[test]
    fn epsilon_one_draws_only_legal_actions() {
        let net = fixed_q([5.0, 1.0, 3.0]);
        let kinds: [[u8; 3]; 3] = [[0, 1, 1], [1, 0, 1], [0, 0, 1]];
        let n = 900;
        let obs = vec![0.5; n];
        let masks: Vec<u8> = (0..n).flat_map(|r| kinds[r % 3]).collect();
        let mut rng = rand::rngs::StdRng::seed_from_u64(1);
        let acts = net
            .act_epsilon_greedy_masked(&obs, n, 1.0, Some(&masks), &mut rng)
            .unwrap();
        let mut counts = [[0usize; 3]; 3];
        for (r, &a) in acts.iter().enumerate() {
            assert_eq!(kinds[r % 3][a as usize], 1, "row {r}: illegal action {a}");
            counts[r % 3][a as usize] += 1;
        }
        // Uniform over the 2 legal actions: 150 of 300 each expected.
        for (kind, c) in counts.iter().enumerate().take(2) {
            let legal: Vec<usize> = (0..3).filter(|&j| kinds[kind][j] == 1).collect();
            for j in legal {
                assert!((110..190).contains(&c[j]), "{counts:?}");
            }
        }
        assert_eq!(counts[2][2], 300);
        // No masks: the unmasked function, draw for draw.
        let a = net
            .act_epsilon_greedy(&obs, n, 0.5, &mut rand::rngs::StdRng::seed_from_u64(4))
            .unwrap();
        let b = net
            .act_epsilon_greedy_masked(
                &obs,
                n,
                0.5,
                None,
                &mut rand::rngs::StdRng::seed_from_u64(4),
            )
            .unwrap();
        assert_eq!(a, b);
        assert!(a.iter().any(|&x| x != 0));
    }
}
