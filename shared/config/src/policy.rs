//! The `policy` section: the classic policy network's shape and device.

use crate::hyper::backend::{DeviceSpec, CUDA_BUILT};
use crate::hyper::policy::TrunkLayout;
use serde::{Deserialize, Serialize};

use crate::check::{invalid, ConfigError};
use crate::experiment::ExperimentConfig;
use crate::run::Algo;

/// Hidden-layer activation of the policy networks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ActivationName {
    Tanh,
    Relu,
}

/// Shape of the actor-critic networks (shared by learner, inference server and evaluator).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PolicyConfig {
    /// Hidden layer widths of both the actor and the critic MLP.
    pub hidden: Vec<usize>,
    /// Hidden-layer activation.
    pub activation: ActivationName,
    /// Initial log standard deviation of Gaussian policies (continuous actions).
    pub init_log_std: f32,
    /// Whether the actor-critic's layers start orthogonal (SB3's
    /// `ortho_init`, its default) or with PyTorch's default init (`false`,
    /// as rl-zoo's MuJoCo presets have it). PPO, A2C and REINFORCE.
    pub ortho_init: bool,
    /// Whether the actor and the critic share their hidden layers
    /// (`separate`, SB3's `MlpPolicy` default, or `shared`).
    pub trunk: TrunkLayout,
    /// A convolutional features extractor for image observations, shared by
    /// actor and critic (`cnn: {}` is SB3's NatureCNN; `conv` and
    /// `features_dim` change it; `{arch: impala}` is IMPALA's ResNet, with
    /// `channels`, `blocks` and `features_dim`). Its input shape comes from
    /// the env. With a CNN, `hidden: []` (SB3's `CnnPolicy`) puts the heads
    /// right on its features. PPO and A2C; DQN puts it in front of its
    /// Q-network (SB3's DQN `CnnPolicy`). Left out on image observations
    /// (uint8 pixels, `normalize.obs` off), relay picks one by the image's
    /// size, NatureCNN from 36x36 up and MinAtar's (16 3x3/1, dense 128)
    /// below, and says so: an MLP would read raw pixels of 0 to 255.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cnn: Option<crate::hyper::policy::CnnSpec>,
    /// A recurrent core for partially observed envs: `{cell: lstm | gru,
    /// hidden: 64, layers: 1}` between the features (the observation, or
    /// the CNN's) and the hidden layers, one for the actor and one for the
    /// critic (one for both with `trunk: shared`), as sb3-contrib's
    /// `RecurrentPPO`. Its state travels with each env's act requests and
    /// fragments, resets at each episode's start, and the learner trains
    /// through time over each fragment. PPO and A2C.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub recurrent: Option<crate::hyper::policy::RecurrentSpec>,
    /// Generalized state-dependent exploration (gSDE, SB3's `use_sde`) for
    /// continuous actions: the noise is a function of the actor's last
    /// hidden layer through an exploration matrix that each env holds for
    /// `sde_sample_freq` steps, so it is smooth along a trajectory, and
    /// `log_std` (initially `init_log_std`) is a `[hidden, action dim]`
    /// matrix. rl-zoo's MuJoCo and NoVel presets use it. PPO and A2C.
    pub use_sde: bool,
    /// With `use_sde`: each env draws a new exploration matrix every this
    /// many steps, and at the start of each fragment; 0 or less, only at
    /// the start of each fragment (SB3's `sde_sample_freq`, whose -1 draws
    /// at the start of each rollout).
    pub sde_sample_freq: i64,
    /// Where the learner trains the network and the inference server runs
    /// it: `cpu` (the default: fused CPU kernels, fastest for MLPs), `cuda`
    /// or `cuda:N` (a build with the `cuda` feature, `just build-cuda`; for
    /// CNN policies). PPO, A2C, REINFORCE and DQN; SAC trains on the CPU.
    #[serde(skip_serializing_if = "is_cpu")]
    pub device: DeviceSpec,
}

impl PolicyConfig {
    /// Recurrent state values per env (`policy.recurrent`; 0 for a
    /// feed-forward policy): what act requests and fragments carry.
    pub fn state_width(&self) -> usize {
        self.recurrent.map_or(0, |r| r.state_width(self.trunk))
    }
}

fn is_cpu(device: &DeviceSpec) -> bool {
    *device == DeviceSpec::Cpu
}

impl Default for PolicyConfig {
    fn default() -> Self {
        Self {
            hidden: vec![64, 64],
            activation: ActivationName::Tanh,
            init_log_std: 0.0,
            ortho_init: true,
            trunk: TrunkLayout::Separate,
            cnn: None,
            recurrent: None,
            use_sde: false,
            sde_sample_freq: -1,
            device: DeviceSpec::Cpu,
        }
    }
}

impl ExperimentConfig {
    /// `policy.cnn` on its own: algorithms that have CNN policies, and a
    /// spec whose input comes from the env.
    pub(crate) fn validate_cnn(
        &self,
        cnn: &crate::hyper::policy::CnnSpec,
    ) -> Result<(), ConfigError> {
        if self.is_text_game() || !matches!(self.run.algo, Algo::Ppo | Algo::A2c | Algo::Dqn) {
            return Err(invalid(
                "policy.cnn",
                format!(
                    "CNN policies are for ppo, a2c and dqn on image observations, not run.algo {} on {}",
                    self.run.algo, self.run.env_id
                ),
            ));
        }
        if cnn.input != [0; 3] {
            return Err(invalid(
                "policy.cnn.input",
                "comes from the env's image observations; leave it out",
            ));
        }
        cnn.validate_layers().map_err(cnn_error)
    }
}

impl ExperimentConfig {
    /// `policy.use_sde` on its own: algorithms that train a gSDE policy
    /// (the env's continuous actions are checked with the env).
    pub(crate) fn validate_sde(&self) -> Result<(), ConfigError> {
        if self.policy.use_sde
            && (self.is_text_game() || !matches!(self.run.algo, Algo::Ppo | Algo::A2c))
        {
            return Err(invalid(
                "policy.use_sde",
                format!(
                    "state-dependent exploration trains with ppo or a2c, not run.algo {} (relay's SAC has no gSDE); leave it false",
                    self.run.algo
                ),
            ));
        }
        Ok(())
    }

    /// `policy.recurrent` on its own: sizes, and algorithms that train a
    /// recurrent policy (PPO and A2C, on classic envs).
    pub(crate) fn validate_recurrent(
        &self,
        recurrent: &crate::hyper::policy::RecurrentSpec,
    ) -> Result<(), ConfigError> {
        recurrent
            .validate()
            .map_err(|e| invalid(&format!("policy.recurrent.{}", e.field), e.reason))?;
        if self.is_text_game() || !matches!(self.run.algo, Algo::Ppo | Algo::A2c) {
            return Err(invalid(
                "policy.recurrent",
                format!(
                    "recurrent policies train with ppo or a2c on classic envs, not run.algo {} on {}",
                    self.run.algo, self.run.env_id
                ),
            ));
        }
        Ok(())
    }

    /// `policy.device`: a classic run on an algorithm with a device path, in
    /// a build that can open it.
    pub(crate) fn validate_policy_device(&self) -> Result<(), ConfigError> {
        let device = self.policy.device;
        if device == DeviceSpec::Cpu {
            return Ok(());
        }
        if self.is_text_game() {
            return Err(invalid(
                "policy.device",
                format!(
                    "{device}: text games place their language model with llm.device, not policy.device"
                ),
            ));
        }
        if self.run.algo == Algo::Sac {
            return Err(invalid(
                "policy.device",
                format!("{device}: SAC trains on the CPU only; leave policy.device at cpu"),
            ));
        }
        if !CUDA_BUILT {
            return Err(invalid(
                "policy.device",
                format!(
                    "{device} needs a build with the `cuda` feature \
                     (`cargo build --release --features cuda`, or `just build-cuda`); this one has none"
                ),
            ));
        }
        Ok(())
    }
}

/// A [`crate::hyper::policy::CnnSpec`] check's error under `policy.`.
pub(crate) fn cnn_error(e: crate::FieldError) -> ConfigError {
    invalid(&format!("policy.{}", e.field), e.reason)
}
