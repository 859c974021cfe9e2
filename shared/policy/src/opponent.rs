//! Fixed opponents of multi-agent games played on observations (PettingZoo
//! games through the env bridge): the bots of [`relay_envs::SeatBot`] and
//! saved checkpoints (`checkpoint:<folder>`), as [`SeatOpponent`]. The
//! env-runner's self-play games, the league's fixed members and the
//! evaluator's `vs-opponent` games draw them from here, so an opponent
//! plays identically in training and in evaluation.
//!
//! A checkpoint opponent is a run's checkpoint folder (`config.yaml`,
//! `model.safetensors`, and the normaliser's statistics when the run
//! normalised), loaded with [`load_checkpoint`] the way `relay play` loads
//! one: every weight or none. It must have been trained on the same game
//! (env id, observation width and actions), and it samples its moves
//! among the legal ones, as the league's past versions do.

use std::path::{Path, PathBuf};

use relay_config::ExperimentConfig;
use relay_envs::{EnvSpec, SeatBot};
use relay_nn::{Actions, ActorCritic, VecNormalize};

use crate::{Act, PolicyModel, VersionedPolicy};

/// Why an opponent or a checkpoint cannot play.
#[derive(Debug, thiserror::Error)]
pub enum OpponentError {
    #[error(transparent)]
    Bot(#[from] relay_envs::EnvError),
    #[error("checkpoint {path}: {detail}")]
    Checkpoint { path: PathBuf, detail: String },
}

/// A fixed opponent holding the seats the learning policy does not.
pub enum SeatOpponent {
    /// A scripted or search bot ([`SeatBot`]).
    Bot(SeatBot),
    /// A saved checkpoint's policy, sampling among the legal moves.
    Checkpoint(Box<VersionedPolicy>),
}

impl SeatOpponent {
    /// The opponent `name` (a bot of [`relay_envs::SEAT_BOT_NAMES`] or
    /// `checkpoint:<folder>`) for games of `spec`; an error names what it
    /// cannot play.
    pub fn new(name: &str, spec: &EnvSpec) -> Result<Self, OpponentError> {
        let Some(folder) = relay_config::checkpoint_opponent(name) else {
            return Ok(Self::Bot(SeatBot::new(name, spec)?));
        };
        let dir = Path::new(folder);
        let checkpoint_error = |detail: String| OpponentError::Checkpoint {
            path: dir.to_path_buf(),
            detail,
        };
        let (config, policy) = load_checkpoint(dir).map_err(checkpoint_error)?;
        let trained_on = config
            .env_spec()
            .map_err(|e| checkpoint_error(e.to_string()))?;
        if config.run.env_id != spec.id
            || trained_on.obs_dim() != spec.obs_dim()
            || trained_on.action_space != spec.action_space
        {
            return Err(checkpoint_error(format!(
                "trained on {} ({} observation values, {:?}), not on {} ({} values, {:?})",
                config.run.env_id,
                trained_on.obs_dim(),
                trained_on.action_space,
                spec.id,
                spec.obs_dim(),
                spec.action_space
            )));
        }
        if policy.model.state_width() > 0 {
            return Err(checkpoint_error(
                "a recurrent policy's checkpoint: opponents of games on observations are feed-forward, as self-play trains them".into(),
            ));
        }
        Ok(Self::Checkpoint(Box::new(policy)))
    }

    /// The actions of `n` movers whose observations are `obs` (`n` rows)
    /// and legal actions `masks` (`n` rows, each allowing one).
    pub fn act(
        &mut self,
        obs: &[f32],
        masks: &[u8],
        n: usize,
        rng: &mut impl rand::Rng,
    ) -> Result<Vec<i64>, String> {
        let (d, width) = (obs.len() / n.max(1), masks.len() / n.max(1));
        match self {
            Self::Bot(bot) => Ok((0..n)
                .map(|i| {
                    bot.act(
                        &obs[i * d..(i + 1) * d],
                        &masks[i * width..(i + 1) * width],
                        rng,
                    )
                })
                .collect()),
            Self::Checkpoint(policy) => {
                let normalized;
                let obs = match &policy.normalizer {
                    Some(normalizer) => {
                        let mut rows = obs.to_vec();
                        normalizer.normalize_obs(&mut rows);
                        normalized = rows;
                        &normalized[..]
                    }
                    None => obs,
                };
                let out = policy
                    .model
                    .act(obs, n, &mut [], Some(masks), false, rng)
                    .map_err(|e| e.to_string())?;
                match out.actions {
                    Actions::Discrete(actions) => Ok(actions),
                    Actions::Continuous(_) => Err("a checkpoint of continuous actions".into()),
                }
            }
        }
    }
}

/// A run's resolved `config.yaml` (a run folder's or a checkpoint's), as it
/// was written (no environment overrides).
pub fn read_resolved_config(path: &Path) -> Result<ExperimentConfig, String> {
    let text =
        std::fs::read_to_string(path).map_err(|e| format!("reading {}: {e}", path.display()))?;
    ExperimentConfig::from_layers(&text, &path.display().to_string(), &[], &[])
        .map_err(|e| e.to_string())
}

/// Checkpoint folder `dir` of a classic run: its config and its acting
/// policy ([`load_checkpoint_policy`]) at the version it holds.
pub fn load_checkpoint(dir: &Path) -> Result<(ExperimentConfig, VersionedPolicy), String> {
    let config = read_resolved_config(&dir.join("config.yaml"))?;
    if config.is_text_game() {
        return Err(format!(
            "a checkpoint of a text-game run ({}): its adapter plays text games, not observations",
            config.run.env_id
        ));
    }
    let state = relay_runs::checkpoint::load_state(dir).map_err(|e| e.to_string())?;
    let (model, normalizer) = load_checkpoint_policy(&config, dir)?;
    Ok((
        config,
        VersionedPolicy {
            version: state.weights_version.unwrap_or(state.progress.version),
            learner_env_steps: state.progress.env_steps,
            model,
            normalizer,
        },
    ))
}

/// The acting model saved in checkpoint folder `dir` of a classic run
/// configured by `config` (DQN: the Q-network, greedy; SAC: the actor;
/// else the actor-critic), every weight or none, and for a normalising
/// run its normaliser with the checkpoint's statistics (frozen): what the
/// evaluator played when the checkpoint holds an evaluated version.
pub fn load_checkpoint_policy(
    config: &ExperimentConfig,
    dir: &Path,
) -> Result<(PolicyModel, Option<VecNormalize>), String> {
    let model_file = dir.join("model.safetensors");
    let loading = |e: relay_nn::NnError| format!("loading {}: {e}", model_file.display());
    let model = match config.run.algo {
        relay_config::Algo::Dqn => {
            let spec = crate::qnet_spec_for(config)?;
            let mut net = relay_nn::QNetwork::new(&spec, config.run.seed).map_err(loading)?;
            net.load(&model_file).map_err(loading)?;
            PolicyModel::QNetwork { net, epsilon: 0.0 }
        }
        relay_config::Algo::Sac => {
            // The checkpoint holds actor, critics, targets and log α; play
            // with the actor's deterministic action tanh(μ).
            let spec = crate::sac_spec_for(config)?;
            let mut sac = relay_nn::Sac::new(&spec, 1.0, config.run.seed).map_err(loading)?;
            sac.load(&model_file).map_err(loading)?;
            PolicyModel::Sac(sac.actor)
        }
        relay_config::Algo::Ppo | relay_config::Algo::A2c | relay_config::Algo::Reinforce => {
            let spec = crate::spec_for(config).map_err(|e| e.to_string())?;
            let mut model = ActorCritic::with_layout(&spec, config.policy.trunk, config.run.seed)
                .map_err(loading)?;
            model.load(&model_file).map_err(loading)?;
            PolicyModel::ActorCritic(model)
        }
    };
    let normalizer = match config.normalizer() {
        Some(norm) => {
            let obs_dim = config.env_spec().map_err(|e| e.to_string())?.obs_dim();
            let mut n = VecNormalize::new(norm, obs_dim, 0).map_err(|e| e.to_string())?;
            crate::load_normalizer(dir, &mut n).map_err(|e| e.to_string())?;
            n.set_training(false);
            Some(n)
        }
        None => None,
    };
    Ok((model, normalizer))
}
