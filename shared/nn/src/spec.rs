//! What a policy looks like: observation size, action space, network widths.
//!
//! A [`PolicySpec`] is plain data (serde) so it can sit in an experiment
//! config and travel with a checkpoint; [`crate::ActorCritic::new`] builds a
//! model from it.

use serde::{Deserialize, Serialize};

use crate::error::{NnError, Result};
pub use relay_config::hyper::policy::{CellKind, CnnArch, CnnSpec, ConvSpec, RecurrentSpec};

/// The action space of the environment.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase", deny_unknown_fields)]
pub enum ActionKind {
    /// One of `n` actions, `0..n` (Gymnasium `Discrete(n)`); categorical policy.
    Discrete {
        /// Number of actions (at least 1).
        n: usize,
    },
    /// A real vector of `dim` values (Gymnasium `Box`); diagonal Gaussian policy.
    ///
    /// The bounds are carried for the env-runner, which clips sampled actions to
    /// `[low, high]` before stepping the environment. The model itself samples,
    /// scores and trains on *unclipped* actions (as Stable-Baselines3 does), so
    /// log-probabilities stay those of the Gaussian that produced the sample.
    Continuous {
        /// Number of action dimensions (at least 1).
        dim: usize,
        /// Lower bound of each dimension (`dim` values).
        low: Vec<f32>,
        /// Upper bound of each dimension (`dim` values).
        high: Vec<f32>,
    },
}

impl ActionKind {
    /// Width of the policy head: `n` logits or `dim` means.
    pub fn head_width(&self) -> usize {
        match self {
            ActionKind::Discrete { n } => *n,
            ActionKind::Continuous { dim, .. } => *dim,
        }
    }
}

/// Hidden-layer nonlinearity, used by both the actor and the critic.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Activation {
    /// `tanh` (the Stable-Baselines3 / CleanRL default for PPO).
    #[default]
    Tanh,
    /// `max(x, 0)`.
    Relu,
}

/// Everything needed to build an [`crate::ActorCritic`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PolicySpec {
    /// Length of one flat observation vector.
    pub obs_dim: usize,
    /// The action space.
    pub action: ActionKind,
    /// Widths of the hidden layers of the actor and, separately, of the critic
    /// (Stable-Baselines3 `net_arch=dict(pi=hidden, vf=hidden)`). Default `[64, 64]`.
    /// May be empty (linear policy and value heads on the observation).
    #[serde(default = "default_hidden")]
    pub hidden: Vec<usize>,
    /// Hidden-layer nonlinearity. Default `tanh`.
    #[serde(default)]
    pub activation: Activation,
    /// Initial value of every entry of the state-independent `log_std` vector
    /// of a continuous policy (Stable-Baselines3 default `0.0`, i.e. std 1).
    /// Ignored for discrete actions.
    #[serde(default)]
    pub init_log_std: f32,
    /// Whether the layers start orthogonal, gain sqrt(2) in the hidden
    /// layers, 0.01 in the action head and 1 in the value head (SB3's
    /// `ortho_init`, its default), or with PyTorch's default `nn.Linear`
    /// init, uniform in `±1/sqrt(fan_in)` (`ortho_init=False`, as rl-zoo's
    /// MuJoCo presets have it). Default true.
    #[serde(default = "default_ortho_init")]
    pub ortho_init: bool,
    /// A convolutional features extractor in front of the hidden layers, for
    /// image observations (`None`: the flat observation feeds the MLPs).
    /// Actor and critic share it, as Stable-Baselines3's `CnnPolicy` does.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cnn: Option<CnnSpec>,
    /// A recurrent core between the features and the hidden layers
    /// ([`crate::recurrent`]; `None`: a feed-forward policy).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub recurrent: Option<RecurrentSpec>,
    /// Generalized state-dependent exploration for a continuous policy
    /// ([`crate::gsde`]; SB3's `use_sde`): the noise is a function of the
    /// actor's last hidden layer, held for several steps, and `log_std` is
    /// a `[latent, dim]` matrix. Default false: state-independent noise.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub use_sde: bool,
}

/// Checks an image policy's CNN against the observations it reads: the
/// image is `obs_dim` values and every layer fits it; the error names the
/// field (`cnn.input`, `cnn.conv`, ...).
pub(crate) fn validate_cnn(cnn: Option<&CnnSpec>, obs_dim: usize) -> Result<()> {
    let Some(cnn) = cnn else { return Ok(()) };
    if cnn.input_len() != obs_dim {
        return Err(NnError::config(
            "cnn.input",
            format!(
                "{:?} is {} values, but observations have obs_dim = {obs_dim}",
                cnn.input,
                cnn.input_len(),
            ),
        ));
    }
    cnn.output_shapes()?;
    Ok(())
}

fn default_hidden() -> Vec<usize> {
    vec![64, 64]
}

fn default_ortho_init() -> bool {
    true
}

impl PolicySpec {
    /// A discrete policy with SB3 defaults: hidden `[64, 64]`, tanh.
    pub fn discrete(obs_dim: usize, n: usize) -> Self {
        Self {
            obs_dim,
            action: ActionKind::Discrete { n },
            hidden: default_hidden(),
            activation: Activation::Tanh,
            init_log_std: 0.0,
            ortho_init: true,
            cnn: None,
            recurrent: None,
            use_sde: false,
        }
    }

    /// A continuous policy with SB3 defaults: hidden `[64, 64]`, tanh, `log_std` 0.
    pub fn continuous(obs_dim: usize, low: Vec<f32>, high: Vec<f32>) -> Self {
        Self {
            obs_dim,
            action: ActionKind::Continuous {
                dim: low.len(),
                low,
                high,
            },
            hidden: default_hidden(),
            activation: Activation::Tanh,
            init_log_std: 0.0,
            ortho_init: true,
            cnn: None,
            recurrent: None,
            use_sde: false,
        }
    }

    /// Width of what the hidden layers read: the CNN's features, or the
    /// observation itself.
    pub fn features_dim(&self) -> usize {
        self.cnn.as_ref().map_or(self.obs_dim, |c| c.features_dim)
    }

    /// Width of what the hidden layers read: the recurrent core's output,
    /// else the features.
    pub fn trunk_input_dim(&self) -> usize {
        self.recurrent
            .as_ref()
            .map_or(self.features_dim(), |r| r.hidden)
    }

    /// Width of the actor's last hidden layer (the trunk input when there
    /// is none): the latent that gSDE's noise is a function of.
    pub fn sde_latent_dim(&self) -> usize {
        self.hidden
            .last()
            .copied()
            .unwrap_or(self.trunk_input_dim())
    }

    /// Checks every field; the error names the field.
    pub fn validate(&self) -> Result<()> {
        if self.obs_dim == 0 {
            return Err(NnError::config("obs_dim", "must be at least 1"));
        }
        if self.use_sde && matches!(self.action, ActionKind::Discrete { .. }) {
            return Err(NnError::config(
                "use_sde",
                "state-dependent exploration is for continuous actions; this policy's are discrete",
            ));
        }
        validate_cnn(self.cnn.as_ref(), self.obs_dim)?;
        if let Some(r) = &self.recurrent {
            r.validate().map_err(|e| {
                NnError::config(
                    match e.field {
                        "hidden" => "recurrent.hidden",
                        _ => "recurrent.layers",
                    },
                    e.reason,
                )
            })?;
        }
        if let Some(i) = self.hidden.iter().position(|&h| h == 0) {
            return Err(NnError::config(
                "hidden",
                format!("layer {i} has width 0; every width must be at least 1"),
            ));
        }
        if !self.init_log_std.is_finite() {
            return Err(NnError::config("init_log_std", "must be finite"));
        }
        match &self.action {
            ActionKind::Discrete { n } => {
                if *n == 0 {
                    return Err(NnError::config("action.n", "must be at least 1"));
                }
            }
            ActionKind::Continuous { dim, low, high } => {
                if *dim == 0 {
                    return Err(NnError::config("action.dim", "must be at least 1"));
                }
                if low.len() != *dim {
                    return Err(NnError::config(
                        "action.low",
                        format!("has {} values, expected dim = {dim}", low.len()),
                    ));
                }
                if high.len() != *dim {
                    return Err(NnError::config(
                        "action.high",
                        format!("has {} values, expected dim = {dim}", high.len()),
                    ));
                }
                for (i, (l, h)) in low.iter().zip(high).enumerate() {
                    if l.is_nan() || h.is_nan() || l > h {
                        return Err(NnError::config(
                            "action.low",
                            format!("dimension {i}: need low <= high, got low {l}, high {h}"),
                        ));
                    }
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn serde_round_trip_and_defaults() {
        let json = r#"{"obs_dim": 4, "action": {"kind": "discrete", "n": 2}}"#;
        let spec: PolicySpec = serde_json::from_str(json).unwrap();
        assert_eq!(spec, PolicySpec::discrete(4, 2));
        let json = r#"{"obs_dim": 3, "action": {"kind": "continuous", "dim": 1, "low": [-2.0], "high": [2.0]},
                       "hidden": [32], "activation": "relu", "init_log_std": -0.5}"#;
        let spec: PolicySpec = serde_json::from_str(json).unwrap();
        assert_eq!(spec.activation, Activation::Relu);
        assert_eq!(spec.action.head_width(), 1);
        let back: PolicySpec =
            serde_json::from_str(&serde_json::to_string(&spec).unwrap()).unwrap();
        assert_eq!(back, spec);
        assert!(serde_json::from_str::<PolicySpec>(
            r#"{"obs_dim": 4, "action": {"kind": "discrete", "n": 2}, "hiden": []}"#
        )
        .is_err());
    }

    #[test]
    fn validation_names_the_field() {
        let mut spec = PolicySpec::continuous(3, vec![-1.0, -1.0], vec![1.0]);
        let err = spec.validate().unwrap_err().to_string();
        assert!(err.contains("action.high"), "{err}");
        spec = PolicySpec::discrete(0, 2);
        assert!(spec.validate().unwrap_err().to_string().contains("obs_dim"));
        spec = PolicySpec::discrete(4, 2);
        spec.hidden = vec![64, 0];
        assert!(spec.validate().unwrap_err().to_string().contains("hidden"));
    }
}
