//! The classic policy's hyperparameter types that configs name: the trunk
//! layout, the CNN features extractor, and `VecNormalize`'s settings.
//! relay-nn builds the networks and the normaliser from them.

use serde::{Deserialize, Serialize};

use crate::check::FieldError;

type Result<T> = std::result::Result<T, FieldError>;

/// Whether the actor and the critic share their hidden layers.
///
/// Not a field of relay-nn's `PolicySpec` yet (adding one breaks code that
/// builds the spec as a struct literal); pass it to `ActorCritic::with_layout`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TrunkLayout {
    /// Separate actor and critic MLPs (SB3 >= 1.8 `MlpPolicy` default for PPO
    /// and A2C: `net_arch=dict(pi=hidden, vf=hidden)`).
    #[default]
    Separate,
    /// One hidden MLP feeding both heads (SB3 < 1.8 `net_arch=[..]`, CleanRL's
    /// Atari agents); its layers are named `mlp_extractor.shared_net.{2i}`.
    /// The value loss then also trains the actor's features, so `vf_coef`
    /// matters more.
    Shared,
}

/// One convolution of a [`CnnSpec`]: no padding, followed by ReLU.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConvSpec {
    /// Output channels.
    pub channels: usize,
    /// Square kernel size.
    pub kernel: usize,
    /// Stride in both directions.
    pub stride: usize,
}

/// A convolutional features extractor: convolutions with ReLU, flatten, one
/// dense layer with ReLU. The default is Stable-Baselines3's `NatureCNN`
/// (Mnih et al. 2015): 32 8x8/4, 64 4x4/2, 64 3x3/1, dense 512.
///
/// Observations are uint8 pixels; the extractor divides them by 255 first.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CnnSpec {
    /// Image shape, channels first: `[channels, height, width]`. Filled in
    /// from the environment's observation space (left empty in configs).
    #[serde(default)]
    pub input: [usize; 3],
    /// The convolutions, in order. Default: NatureCNN's three.
    #[serde(default = "nature_convs")]
    pub conv: Vec<ConvSpec>,
    /// Width of the dense layer after the convolutions. Default 512.
    #[serde(default = "default_features_dim")]
    pub features_dim: usize,
}

impl Default for CnnSpec {
    fn default() -> Self {
        Self {
            input: [0; 3],
            conv: nature_convs(),
            features_dim: default_features_dim(),
        }
    }
}

fn nature_convs() -> Vec<ConvSpec> {
    vec![
        ConvSpec {
            channels: 32,
            kernel: 8,
            stride: 4,
        },
        ConvSpec {
            channels: 64,
            kernel: 4,
            stride: 2,
        },
        ConvSpec {
            channels: 64,
            kernel: 3,
            stride: 1,
        },
    ]
}

fn default_features_dim() -> usize {
    512
}

impl CnnSpec {
    /// `(channels, height, width)` after each convolution, or an error naming
    /// the first one that does not fit its input.
    pub fn output_shapes(&self) -> Result<Vec<[usize; 3]>> {
        let mut shape = self.input;
        let mut shapes = Vec::with_capacity(self.conv.len());
        for (i, c) in self.conv.iter().enumerate() {
            let [_, h, w] = shape;
            if c.channels == 0 || c.kernel == 0 || c.stride == 0 {
                return Err(FieldError::new(
                    "cnn.conv",
                    format!("layer {i}: channels, kernel and stride must be at least 1"),
                ));
            }
            if c.kernel > h || c.kernel > w {
                return Err(FieldError::new(
                    "cnn.conv",
                    format!(
                        "layer {i}: a {k}x{k} kernel does not fit its {h}x{w} input \
                         (the image is {:?}); use smaller kernels or strides for small images",
                        self.input,
                        k = c.kernel
                    ),
                ));
            }
            shape = [
                c.channels,
                (h - c.kernel) / c.stride + 1,
                (w - c.kernel) / c.stride + 1,
            ];
            shapes.push(shape);
        }
        Ok(shapes)
    }

    /// Values per observation: `channels * height * width`.
    pub fn input_len(&self) -> usize {
        self.input.iter().product()
    }
}

/// Hyperparameters of relay-nn's `VecNormalize`. Defaults are SB3's.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct NormalizeConfig {
    /// Normalise observations. Default `true`.
    pub norm_obs: bool,
    /// Scale rewards by the running std of the discounted return. Default `true`.
    pub norm_reward: bool,
    /// Normalised observations are clipped to `[-clip_obs, clip_obs]`. Default `10`.
    pub clip_obs: f64,
    /// Scaled rewards are clipped to `[-clip_reward, clip_reward]`. Default `10`.
    pub clip_reward: f64,
    /// Discount of the running return whose variance scales rewards; use the
    /// algorithm's gamma. Default `0.99`.
    pub gamma: f64,
    /// Added to the variance before the square root. Default `1e-8`.
    pub epsilon: f64,
}

impl Default for NormalizeConfig {
    fn default() -> Self {
        Self {
            norm_obs: true,
            norm_reward: true,
            clip_obs: 10.0,
            clip_reward: 10.0,
            gamma: 0.99,
            epsilon: 1e-8,
        }
    }
}

impl NormalizeConfig {
    /// Checks ranges; the error names the field.
    pub fn validate(&self) -> Result<()> {
        for (field, v) in [
            ("clip_obs", self.clip_obs),
            ("clip_reward", self.clip_reward),
        ] {
            if v.is_nan() || v <= 0.0 {
                return Err(FieldError::new(field, format!("must be > 0, got {v}")));
            }
        }
        if !(0.0..=1.0).contains(&self.gamma) {
            return Err(FieldError::new(
                "gamma",
                format!("must be in [0, 1], got {}", self.gamma),
            ));
        }
        if !(self.epsilon.is_finite() && self.epsilon >= 0.0) {
            return Err(FieldError::new(
                "epsilon",
                format!("must be finite and >= 0, got {}", self.epsilon),
            ));
        }
        Ok(())
    }
}
