//! The acting model of a classic-control run: [`Act`], what the
//! env-runners and evaluators ask of a policy, and [`PolicyModel`], the
//! model of each algorithm (actor-critic, DQN's Q-network, SAC's actor);
//! [`VersionedPolicy`], a model at a weights version, and
//! [`policy_builder`], which builds one from a version's tensors.

use std::sync::Arc;

use relay_config::{Algo, ExperimentConfig};
use relay_nn::{masked_argmax, ActOutput, Actions, ActorCritic, QNetwork, SacActor, VecNormalize};
use relay_proto::Rejection;

use crate::{
    frozen_normalizer, policy_device, qnet_spec_for, sac_spec_for, spec_for, PolicyWeights,
};

/// What a policy model does for the env-runners and evaluators: actions for
/// `n` observations, sampled or deterministic, among the legal ones where
/// `masks` (`n * n_actions` bytes, 1 = legal) are given. A recurrent
/// policy ([`Act::state_width`] above 0) reads each row's state from
/// `state` (`n * state_width` values; zeros start an episode) and advances
/// it past this step in place; a feed-forward one takes an empty `state`.
pub trait Act {
    /// Recurrent state values per row (0: a feed-forward policy).
    fn state_width(&self) -> usize {
        0
    }

    fn act<R: rand::Rng>(
        &self,
        obs: &[f32],
        n: usize,
        state: &mut [f32],
        masks: Option<&[u8]>,
        deterministic: bool,
        rng: &mut R,
    ) -> relay_nn::Result<ActOutput>;

    /// Sampled actions with each row's gSDE exploration seed
    /// ([`ActorCritic::act_explore`]); a policy without gSDE samples as
    /// [`Act::act`] does.
    fn act_explore<R: rand::Rng>(
        &self,
        obs: &[f32],
        n: usize,
        state: &mut [f32],
        masks: Option<&[u8]>,
        noise_seeds: &[u64],
        rng: &mut R,
    ) -> relay_nn::Result<ActOutput> {
        let _ = noise_seeds;
        self.act(obs, n, state, masks, false, rng)
    }
}

impl Act for ActorCritic {
    fn state_width(&self) -> usize {
        ActorCritic::state_width(self)
    }

    fn act<R: rand::Rng>(
        &self,
        obs: &[f32],
        n: usize,
        state: &mut [f32],
        masks: Option<&[u8]>,
        deterministic: bool,
        rng: &mut R,
    ) -> relay_nn::Result<ActOutput> {
        ActorCritic::act_recurrent(self, obs, n, state, masks, deterministic, rng)
    }

    fn act_explore<R: rand::Rng>(
        &self,
        obs: &[f32],
        n: usize,
        state: &mut [f32],
        masks: Option<&[u8]>,
        noise_seeds: &[u64],
        rng: &mut R,
    ) -> relay_nn::Result<ActOutput> {
        ActorCritic::act_explore(self, obs, n, state, masks, noise_seeds, rng)
    }
}

/// The acting model of a classic-control run.
pub enum PolicyModel {
    /// PPO, A2C, REINFORCE.
    ActorCritic(ActorCritic),
    /// DQN: greedy when deterministic, else epsilon-greedy.
    QNetwork {
        net: QNetwork,
        /// `dqn.exploration_rate` at the version's `learner_env_steps`.
        epsilon: f64,
    },
    /// SAC: the squashed Gaussian actor (the critics stay in the learner).
    Sac(SacActor),
}

impl Act for PolicyModel {
    /// Actor-critic: as [`ActorCritic::act_masked`]. Q-network: epsilon-greedy (or
    /// greedy) actions among the legal ones, `logprobs` the log-probability
    /// of each action under the epsilon-greedy policy, `values` the legal
    /// `max_a Q(s, a)`. SAC actor:
    /// continuous actions in env units (sampled, or `tanh(μ)` scaled when
    /// deterministic); `logprobs` and `values` are 0 (SAC's off-policy
    /// learner uses neither, and it has no state value).
    fn state_width(&self) -> usize {
        match self {
            Self::ActorCritic(model) => model.state_width(),
            Self::QNetwork { .. } | Self::Sac(_) => 0,
        }
    }

    fn act<R: rand::Rng>(
        &self,
        obs: &[f32],
        n: usize,
        state: &mut [f32],
        masks: Option<&[u8]>,
        deterministic: bool,
        rng: &mut R,
    ) -> relay_nn::Result<ActOutput> {
        if !matches!(self, Self::ActorCritic(_)) && !state.is_empty() {
            return Err(relay_nn::NnError::BadInput {
                what: "state",
                expected: "none (a feed-forward policy)".into(),
                got: format!("{} values", state.len()),
            });
        }
        match self {
            Self::ActorCritic(model) => {
                model.act_recurrent(obs, n, state, masks, deterministic, rng)
            }
            Self::QNetwork { net, epsilon } => {
                let eps = if deterministic { 0.0 } else { *epsilon };
                let k = net.spec().n_actions;
                let q = net.q_values(obs, n)?;
                let mask_of = |i: usize| masks.map(|m| &m[i * k..(i + 1) * k]);
                let greedy: Vec<usize> = q
                    .chunks_exact(k)
                    .enumerate()
                    .map(|(i, row)| masked_argmax(row, mask_of(i)))
                    .collect();
                let actions = net.act_epsilon_greedy_masked(obs, n, eps, masks, rng)?;
                let logprobs = actions
                    .iter()
                    .zip(&greedy)
                    .enumerate()
                    .map(|(i, (&a, &g))| {
                        // Exploration draws among the legal actions.
                        let legal = mask_of(i).map_or(k, |m| m.iter().filter(|&&b| b == 1).count());
                        let explore = eps / legal as f64;
                        let p = if a as usize == g {
                            1.0 - eps + explore
                        } else {
                            explore
                        };
                        p.max(1e-12).ln() as f32
                    })
                    .collect();
                let values = q
                    .chunks_exact(k)
                    .zip(&greedy)
                    .map(|(row, &g)| row[g])
                    .collect();
                Ok(ActOutput {
                    actions: Actions::Discrete(actions),
                    logprobs,
                    values,
                })
            }
            Self::Sac(actor) => {
                if masks.is_some() {
                    return Err(relay_nn::NnError::BadInput {
                        what: "masks",
                        expected: "none (SAC's actions are continuous)".into(),
                        got: "action masks".into(),
                    });
                }
                let actions = actor.act(obs, n, deterministic, rng)?;
                Ok(ActOutput {
                    actions: Actions::Continuous(actions),
                    logprobs: vec![0.0; n],
                    values: vec![0.0; n],
                })
            }
        }
    }

    fn act_explore<R: rand::Rng>(
        &self,
        obs: &[f32],
        n: usize,
        state: &mut [f32],
        masks: Option<&[u8]>,
        noise_seeds: &[u64],
        rng: &mut R,
    ) -> relay_nn::Result<ActOutput> {
        match self {
            Self::ActorCritic(model) => model.act_explore(obs, n, state, masks, noise_seeds, rng),
            _ => self.act(obs, n, state, masks, false, rng),
        }
    }
}

/// A model at a weights version.
pub struct VersionedPolicy {
    pub version: u64,
    pub learner_env_steps: u64,
    pub model: PolicyModel,
    /// The version's observation normaliser, frozen (runs with a
    /// `normalize` section on); the model takes normalised observations.
    pub normalizer: Option<VecNormalize>,
}

/// What builds a [`VersionedPolicy`] from a version of this run.
pub type PolicyBuilder =
    Box<dyn Fn(&PolicyWeights) -> Result<VersionedPolicy, Rejection> + Send + Sync>;

/// The run's acting model built straight from a version's tensors (no
/// init is drawn to be overwritten).
pub fn policy_builder(
    config: &Arc<ExperimentConfig>,
) -> Result<PolicyBuilder, relay_kit::ServiceError> {
    let spec = spec_for(config).map_err(relay_kit::ServiceError::other)?;
    let trunk = config.policy.trunk;
    let device = policy_device(config).map_err(relay_kit::ServiceError::other)?;
    let config = config.clone();
    // DQN runs act with a Q-network, epsilon-greedily at the version's env steps.
    let dqn = (config.run.algo == Algo::Dqn).then(|| {
        (
            qnet_spec_for(&config),
            config.dqn.clone(),
            config.run.total_env_steps,
        )
    });
    // SAC runs act with the actor alone.
    let sac = (config.run.algo == Algo::Sac).then(|| sac_spec_for(&config));
    Ok(Box::new(move |update: &PolicyWeights| {
        let invalid = |detail: String| Rejection::Invalid {
            kind: "WeightsUpdate",
            field: "weights",
            detail,
        };
        let parts = &update.tensors;
        let rejected = |e: relay_nn::NnError| invalid(e.to_string());
        let model = match (&sac, &dqn) {
            (Some(sac_spec), _) => {
                let sac_spec = sac_spec.clone().map_err(invalid)?;
                PolicyModel::Sac(SacActor::from_named_tensors(&sac_spec, parts).map_err(rejected)?)
            }
            (None, Some((qspec, dqn, budget))) => {
                let qspec = qspec.clone().map_err(invalid)?;
                let net = QNetwork::from_named_tensors(&qspec, parts)
                    .and_then(|net| net.to_device(&device))
                    .map_err(rejected)?;
                let progress = update.learner_env_steps as f64 / *budget as f64;
                PolicyModel::QNetwork {
                    net,
                    epsilon: dqn.exploration_rate(progress),
                }
            }
            (None, None) => {
                let model = ActorCritic::from_named_tensors(&spec, trunk, parts)
                    .and_then(|model| model.to_device(&device))
                    .map_err(rejected)?;
                PolicyModel::ActorCritic(model)
            }
        };
        let normalizer = frozen_normalizer(
            &config,
            spec.obs_dim,
            update.version,
            update.normalizer.as_ref(),
        )?;
        Ok(VersionedPolicy {
            version: update.version,
            learner_env_steps: update.learner_env_steps,
            model,
            normalizer,
        })
    }))
}
