//! The shapes of a run's networks, read from the experiment config and
//! the env's spaces, and the device they run on: the learner, the
//! inference servers and the evaluators all shape a run's policy here, so
//! that every copy of it agrees.

use relay_config::ExperimentConfig;
use relay_envs::ActionSpace;
use relay_nn::{ActionKind, Activation, PolicySpec, QNetSpec, SacSpec};

/// Why a run's policy cannot be shaped: the env cannot be made, or the
/// config does not fit it (`policy.cnn` on flat observations, ...).
#[derive(Debug, thiserror::Error)]
pub enum SpecError {
    #[error(transparent)]
    Env(#[from] relay_bridge::BridgeError),
    #[error(transparent)]
    Config(#[from] relay_config::ConfigError),
}

/// The device `policy.device` names, opened once by each process that
/// trains or runs the policy ([`relay_nn::open_device`]).
pub fn policy_device(config: &ExperimentConfig) -> Result<candle_core::Device, String> {
    relay_nn::open_device(config.policy.device).map_err(|e| format!("policy.device: {e}"))
}

/// The policy network shape of a run.
pub fn spec_for(config: &ExperimentConfig) -> Result<PolicySpec, SpecError> {
    let env = config.env_spec()?;
    config.check_env(&env)?;
    let cnn = config.policy_cnn(&env);
    let action = match env.action_space {
        ActionSpace::Discrete { n } => ActionKind::Discrete { n },
        ActionSpace::Box { low, high } => ActionKind::Continuous {
            dim: low.len(),
            low,
            high,
        },
    };
    Ok(PolicySpec {
        obs_dim: env.observation_space.dim(),
        action,
        hidden: config.policy.hidden.clone(),
        activation: match config.policy.activation {
            relay_config::ActivationName::Tanh => Activation::Tanh,
            relay_config::ActivationName::Relu => Activation::Relu,
        },
        init_log_std: config.policy.init_log_std,
        ortho_init: config.policy.ortho_init,
        cnn,
        recurrent: config.policy.recurrent,
        use_sde: config.policy.use_sde,
    })
}

/// The Q-network of a DQN run: the policy's widths, activation and CNN
/// (`policy.cnn`, in front of the hidden layers), `dqn.dueling`.
pub fn qnet_spec_for(config: &ExperimentConfig) -> Result<QNetSpec, String> {
    let spec = spec_for(config).map_err(|e| e.to_string())?;
    let mut q = QNetSpec::from_policy_spec(&spec).map_err(|e| e.to_string())?;
    q.dueling = config.dqn.dueling;
    Ok(q)
}

/// The networks of a SAC run: the env's observation width and action
/// bounds, `sac.net_arch` (ReLU) and the log std clamps.
pub fn sac_spec_for(config: &ExperimentConfig) -> Result<SacSpec, String> {
    let env = config.env_spec().map_err(|e| e.to_string())?;
    let ActionSpace::Box { low, high } = env.action_space else {
        return Err(format!(
            "run.algo sac needs continuous (Box) actions; {} has discrete ones",
            config.run.env_id
        ));
    };
    let spec = SacSpec {
        hidden: config.sac.net_arch.clone(),
        activation: Activation::Relu,
        log_std_min: config.sac.log_std_min as f32,
        log_std_max: config.sac.log_std_max as f32,
        ..SacSpec::new(env.observation_space.dim(), low, high)
    };
    spec.validate().map_err(|e| e.to_string())?;
    Ok(spec)
}
