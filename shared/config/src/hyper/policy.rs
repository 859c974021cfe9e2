//! The classic policy's hyperparameter types that configs name: the trunk
//! layout, the CNN features extractor, the recurrent core, and
//! `VecNormalize`'s settings.
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

/// One convolution of a plain ([`CnnArch::Nature`]) stack: no padding,
/// followed by ReLU.
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

/// The convolutional body of a [`CnnSpec`], before its dense layer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CnnArch {
    /// A plain stack of unpadded convolutions, each followed by ReLU
    /// (`arch: nature`, the default): Stable-Baselines3's `NatureCNN`
    /// (Mnih et al. 2015) with its default `conv`.
    Nature {
        /// The convolutions, in order. Default: NatureCNN's three, 32 8x8/4,
        /// 64 4x4/2, 64 3x3/1.
        conv: Vec<ConvSpec>,
    },
    /// IMPALA's ResNet (`arch: impala`; Espeholt et al. 2018, CleanRL's
    /// `ppo_procgen.py`, Sample Factory's `resnet_impala`): per stack a 3x3
    /// convolution with stride 1 and padding 1, a 3x3 max-pool with stride 2
    /// and padding 1, and `blocks` residual blocks
    /// `x + conv(relu(conv(relu(x))))`; ReLU after the last stack.
    Impala {
        /// Output channels of each stack, in order. Default `[16, 32, 32]`.
        channels: Vec<usize>,
        /// Residual blocks per stack. Default 2.
        blocks: usize,
    },
}

/// A convolutional features extractor: a convolutional body ([`CnnArch`]),
/// flatten, one dense layer with ReLU. The default is Stable-Baselines3's
/// `NatureCNN`: 32 8x8/4, 64 4x4/2, 64 3x3/1, dense 512.
///
/// Observations are uint8 pixels; the extractor divides them by 255 first.
///
/// In a config (`policy.cnn`), `arch` picks the body and the other keys
/// are its options: `{}` is NatureCNN, `{conv: [...], features_dim: 128}` a
/// plain stack of one's own, `{arch: impala}` IMPALA's ResNet with
/// `channels`, `blocks` and `features_dim` (default 256) to change it. A
/// key of the other architecture is refused.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(try_from = "CnnFields", into = "CnnFields")]
pub struct CnnSpec {
    /// Image shape, channels first: `[channels, height, width]`. Filled in
    /// from the environment's observation space (left empty in configs).
    pub input: [usize; 3],
    /// The convolutional body.
    pub arch: CnnArch,
    /// Width of the dense layer after the body. Default 512 (NatureCNN),
    /// 256 (IMPALA).
    pub features_dim: usize,
}

/// The names `arch` takes in a config.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
enum ArchName {
    /// [`CnnArch::Nature`].
    #[default]
    Nature,
    /// [`CnnArch::Impala`].
    Impala,
}

/// [`CnnSpec`] as a config writes it: every key optional, defaults by `arch`.
#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct CnnFields {
    /// [`CnnSpec::input`].
    #[serde(default)]
    input: [usize; 3],
    /// Which [`CnnArch`]. Default `nature`.
    #[serde(default)]
    arch: ArchName,
    /// `nature` only: [`CnnArch::Nature::conv`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    conv: Option<Vec<ConvSpec>>,
    /// `impala` only: [`CnnArch::Impala::channels`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    channels: Option<Vec<usize>>,
    /// `impala` only: [`CnnArch::Impala::blocks`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    blocks: Option<usize>,
    /// [`CnnSpec::features_dim`]; its default depends on `arch`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    features_dim: Option<usize>,
}

impl TryFrom<CnnFields> for CnnSpec {
    type Error = String;

    fn try_from(f: CnnFields) -> std::result::Result<Self, String> {
        let (arch, features_dim) = match f.arch {
            ArchName::Nature => {
                if f.channels.is_some() || f.blocks.is_some() {
                    return Err("`channels` and `blocks` are options of arch: impala; \
                                arch: nature takes `conv`"
                        .into());
                }
                let conv = f.conv.unwrap_or_else(nature_convs);
                (CnnArch::Nature { conv }, NATURE_FEATURES_DIM)
            }
            ArchName::Impala => {
                if f.conv.is_some() {
                    return Err("`conv` is an option of arch: nature; \
                                arch: impala takes `channels` and `blocks`"
                        .into());
                }
                let channels = f.channels.unwrap_or_else(|| IMPALA_CHANNELS.to_vec());
                let blocks = f.blocks.unwrap_or(IMPALA_BLOCKS);
                (CnnArch::Impala { channels, blocks }, IMPALA_FEATURES_DIM)
            }
        };
        Ok(Self {
            input: f.input,
            arch,
            features_dim: f.features_dim.unwrap_or(features_dim),
        })
    }
}

impl From<CnnSpec> for CnnFields {
    fn from(spec: CnnSpec) -> Self {
        let (arch, conv, channels, blocks) = match spec.arch {
            CnnArch::Nature { conv } => (ArchName::Nature, Some(conv), None, None),
            CnnArch::Impala { channels, blocks } => {
                (ArchName::Impala, None, Some(channels), Some(blocks))
            }
        };
        Self {
            input: spec.input,
            arch,
            conv,
            channels,
            blocks,
            features_dim: Some(spec.features_dim),
        }
    }
}

impl Default for CnnSpec {
    fn default() -> Self {
        Self {
            input: [0; 3],
            arch: CnnArch::Nature {
                conv: nature_convs(),
            },
            features_dim: NATURE_FEATURES_DIM,
        }
    }
}

/// NatureCNN's dense width.
const NATURE_FEATURES_DIM: usize = 512;
/// IMPALA's stack channels (CleanRL's and Sample Factory's).
const IMPALA_CHANNELS: [usize; 3] = [16, 32, 32];
/// IMPALA's residual blocks per stack.
const IMPALA_BLOCKS: usize = 2;
/// IMPALA's dense width.
const IMPALA_FEATURES_DIM: usize = 256;

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

impl CnnSpec {
    /// MinAtar's network (Young & Tian 2019, the paper's DQN): one 3x3/1
    /// convolution of 16 channels, dense 128: made for 10x10 images, which
    /// NatureCNN's 8x8/4 first layer does not fit.
    pub fn minatar() -> Self {
        Self {
            input: [0; 3],
            arch: CnnArch::Nature {
                conv: vec![ConvSpec {
                    channels: 16,
                    kernel: 3,
                    stride: 1,
                }],
            },
            features_dim: 128,
        }
    }

    /// The extractor for `input` images when a config names none:
    /// NatureCNN where its convolutions fit (36x36 and larger), else
    /// MinAtar's ([`Self::minatar`]). Its input is `input`.
    pub fn for_image(input: [usize; 3]) -> Self {
        let nature = Self {
            input,
            ..Self::default()
        };
        if nature.output_shapes().is_ok() {
            return nature;
        }
        Self {
            input,
            ..Self::minatar()
        }
    }

    /// IMPALA's ResNet with its defaults (`policy.cnn: {arch: impala}`):
    /// channels `[16, 32, 32]`, 2 residual blocks per stack, dense 256.
    pub fn impala() -> Self {
        Self {
            input: [0; 3],
            arch: CnnArch::Impala {
                channels: IMPALA_CHANNELS.to_vec(),
                blocks: IMPALA_BLOCKS,
            },
            features_dim: IMPALA_FEATURES_DIM,
        }
    }

    /// Checks what does not depend on the image: at least one convolution
    /// (or stack), every size at least 1 (`blocks` may be 0). The error
    /// names the field (`cnn.conv`, `cnn.channels`, `cnn.features_dim`).
    pub fn validate_layers(&self) -> Result<()> {
        match &self.arch {
            CnnArch::Nature { conv } => {
                if conv.is_empty() {
                    return Err(FieldError::new(
                        "cnn.conv",
                        "needs at least one convolution",
                    ));
                }
                if let Some(i) = conv
                    .iter()
                    .position(|c| c.channels == 0 || c.kernel == 0 || c.stride == 0)
                {
                    return Err(FieldError::new(
                        "cnn.conv",
                        format!("layer {i}: channels, kernel and stride must be at least 1"),
                    ));
                }
            }
            CnnArch::Impala { channels, .. } => {
                if channels.is_empty() {
                    return Err(FieldError::new("cnn.channels", "needs at least one stack"));
                }
                if let Some(i) = channels.iter().position(|&c| c == 0) {
                    return Err(FieldError::new(
                        "cnn.channels",
                        format!("stack {i} has 0 channels; every stack needs at least 1"),
                    ));
                }
            }
        }
        if self.features_dim == 0 {
            return Err(FieldError::new("cnn.features_dim", "must be at least 1"));
        }
        Ok(())
    }

    /// `(channels, height, width)` after each convolution (`nature`) or
    /// stack (`impala`), or an error naming the first layer that is invalid
    /// ([`Self::validate_layers`]) or does not fit its input.
    pub fn output_shapes(&self) -> Result<Vec<[usize; 3]>> {
        self.validate_layers()?;
        let mut shape = self.input;
        match &self.arch {
            CnnArch::Nature { conv } => conv
                .iter()
                .enumerate()
                .map(|(i, c)| {
                    let [_, h, w] = shape;
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
                    Ok(shape)
                })
                .collect(),
            // The padded 3x3 convolution keeps the size; the 3x3/2 max-pool
            // with padding 1 halves it, rounding up.
            CnnArch::Impala { channels, .. } => Ok(channels
                .iter()
                .map(|&c| {
                    let [_, h, w] = shape;
                    shape = [c, h.div_ceil(2), w.div_ceil(2)];
                    shape
                })
                .collect()),
        }
    }

    /// Values per observation: `channels * height * width`.
    pub fn input_len(&self) -> usize {
        self.input.iter().product()
    }
}

/// The recurrent cell of a [`RecurrentSpec`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CellKind {
    /// Long short-term memory (PyTorch's `nn.LSTM`: gates i, f, g, o; state
    /// `h` and `c`), the cell of sb3-contrib's `RecurrentPPO` and CleanRL's
    /// `ppo_atari_lstm.py`.
    #[default]
    Lstm,
    /// Gated recurrent unit (PyTorch's `nn.GRU`: gates r, z, n; state `h`).
    Gru,
}

impl CellKind {
    /// Gate blocks of width `hidden` in its weights: 4 (LSTM), 3 (GRU).
    pub fn gates(self) -> usize {
        match self {
            CellKind::Lstm => 4,
            CellKind::Gru => 3,
        }
    }

    /// State vectors of width `hidden` per layer: `h` and `c` (LSTM), `h` (GRU).
    pub fn state_vectors(self) -> usize {
        match self {
            CellKind::Lstm => 2,
            CellKind::Gru => 1,
        }
    }

    /// Its name in configs and parameter names.
    pub fn name(self) -> &'static str {
        match self {
            CellKind::Lstm => "lstm",
            CellKind::Gru => "gru",
        }
    }
}

/// A recurrent core between the features (the observation, or a CNN's
/// features) and the MLP trunks (`policy.recurrent`): `layers` stacked
/// cells of width `hidden`, one core for the actor and one for the critic
/// (sb3-contrib's `RecurrentPPO` default, `enable_critic_lstm`), or one for
/// both with `policy.trunk: shared`. Its state is carried from step to step
/// and reset to zeros at each episode's start.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RecurrentSpec {
    /// `lstm` (default) or `gru`.
    pub cell: CellKind,
    /// Width of each cell's hidden state. Default 64.
    pub hidden: usize,
    /// Stacked cells. Default 1.
    pub layers: usize,
}

impl Default for RecurrentSpec {
    fn default() -> Self {
        Self {
            cell: CellKind::Lstm,
            hidden: 64,
            layers: 1,
        }
    }
}

impl RecurrentSpec {
    /// Checks the sizes; the error names the field.
    pub fn validate(&self) -> Result<()> {
        if self.hidden == 0 {
            return Err(FieldError::new("hidden", "must be at least 1".to_string()));
        }
        if self.layers == 0 {
            return Err(FieldError::new("layers", "must be at least 1".to_string()));
        }
        Ok(())
    }

    /// State values of one core: `layers * state_vectors * hidden`.
    pub fn core_state_width(&self) -> usize {
        self.layers * self.cell.state_vectors() * self.hidden
    }

    /// State values per env of a policy of trunk `layout`: the actor
    /// core's, then the critic core's (one core with a shared trunk).
    pub fn state_width(&self, layout: TrunkLayout) -> usize {
        match layout {
            TrunkLayout::Separate => 2 * self.core_state_width(),
            TrunkLayout::Shared => self.core_state_width(),
        }
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
