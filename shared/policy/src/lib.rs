//! The policy as services hold it.
//!
//! - [`spec_for`]: the network shape from the experiment config and the env's spaces,
//!   the same in the learner, the inference servers and the evaluators
//!   ([`qnet_spec_for`]: the Q-network of `run.algo: dqn`; [`sac_spec_for`]:
//!   the networks of `run.algo: sac`);
//! - [`PolicyModel`]: the acting model of a run, an actor-critic, (DQN) a
//!   Q-network acting epsilon-greedily with the epsilon of the learner's
//!   schedule at the version's env steps, greedily when asked for
//!   deterministic actions, or (SAC) the tanh-squashed Gaussian actor,
//!   sampled, `tanh(μ)` when deterministic; [`Act`] is what they can do;
//! - [`PolicyWeights`]: a version's parameters (named f32 tensors) as
//!   services hold them, as the safetensors bytes that travel
//!   ([`WeightsUpdate::weights`], through `relay_kit::weights` whatever the
//!   size), and loaded into a model ([`load_weights`], all-or-nothing with
//!   shape checks);
//! - [`PolicyFollower`]: keeps a copy of the learner's latest weights, fetching
//!   the current version at start (`weights.latest`) and each new one as it is
//!   published (`weights`), fetching its parameters and building each new
//!   model off the caller's hot path; [`StatsFollower`] keeps only each
//!   version's normalisation statistics (which travel in the message: it
//!   fetches no parameters);
//! - [`PolicyFetcher`]: for a service that plays only some versions, hears
//!   each one announced (`weights.announce`) and fetches a version's
//!   weights only when asked for one;
//! - [`norm_stats`] / [`delta_stats`] / [`frozen_normalizer`]: the
//!   normalisation statistics (`normalize:`) as they travel with fragments and
//!   weights, and back;
//! - [`AdapterFollower`]: the same for the LLM policy's LoRA adapter versions
//!   (`adapters`), metadata only (the inference servers load the bytes);
//! - [`text`]: the text-game loop the env-runner and the evaluator share;
//! - [`league`]: past versions of a classic policy stored for the league,
//!   and [`policy_builder`], which makes acting models of them;
//! - [`opponent`]: the fixed opponents of games on observations (bots and
//!   saved checkpoints), and loading a checkpoint's policy.

pub mod league;
pub mod opponent;
pub mod text;

use std::sync::Arc;
use std::time::Duration;

use futures::{FutureExt, StreamExt};
use relay_config::{Algo, ExperimentConfig};
use relay_envs::ActionSpace;
use relay_kit::Service;
use relay_nn::{
    masked_argmax, ActOutput, ActionKind, Actions, Activation, ActorCritic, NormDelta, PolicySpec,
    QNetSpec, QNetwork, RunningMeanStd, SacActor, SacSpec, VecNormalize,
};
use relay_proto::{
    AdapterUpdate, Moments, NormStats, Rejection, WeightsAnnouncement, WeightsRequest,
    WeightsUpdate, SCHEMA_VERSION,
};
use tokio::sync::watch;

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
        cnn: config
            .policy
            .cnn
            .as_ref()
            .zip(env.image)
            .map(|(cnn, input)| relay_nn::CnnSpec {
                input,
                ..cnn.clone()
            }),
        recurrent: config.policy.recurrent,
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
}

/// A weights version's parameters and what comes with them, as the
/// learner keeps them and followers build models from them.
#[derive(Debug, Clone, PartialEq)]
pub struct PolicyWeights {
    pub version: u64,
    /// Env steps the learner had consumed when it made this version.
    pub learner_env_steps: u64,
    /// Every parameter of the model (any model's: actor-critic, Q-network,
    /// SAC actor), by name.
    pub tensors: Vec<relay_nn::NamedTensor>,
    /// The run's normalisation statistics as of this version (runs with a
    /// `normalize` section on).
    pub normalizer: Option<NormStats>,
}

/// Why a version's parameters cannot be had: not fetched, or not what a
/// policy's parameters must be.
#[derive(Debug, thiserror::Error)]
pub enum WeightsError {
    #[error("weights version {version}: {source}")]
    Fetch {
        version: u64,
        source: relay_kit::weights::TransportError,
    },
    #[error(transparent)]
    Rejected(#[from] Rejection),
}

impl PolicyWeights {
    /// Every parameter of `model` at `version` (without normalisation
    /// statistics: set `normalizer` for runs that normalise).
    pub fn of(model: &ActorCritic, version: u64, learner_env_steps: u64) -> Self {
        Self::from_tensors(model.named_tensors(), version, learner_env_steps)
    }

    /// Named tensors (any model's) at `version`.
    pub fn from_tensors(
        tensors: Vec<relay_nn::NamedTensor>,
        version: u64,
        learner_env_steps: u64,
    ) -> Self {
        Self {
            version,
            learner_env_steps,
            tensors,
            normalizer: None,
        }
    }

    /// The parameters as the bytes of a safetensors file (what travels).
    pub fn to_safetensors(&self) -> Vec<u8> {
        relay_nn::to_safetensors(&self.tensors, Default::default())
            .expect("a model's parameters fill their shapes")
    }

    /// The version a message describes, with its parameters read from
    /// `bytes` (the message's blob, fetched): rejected when they are not
    /// a safetensors file of finite f32 tensors.
    pub fn from_update(update: &WeightsUpdate, bytes: &[u8]) -> Result<Self, Rejection> {
        let invalid = |detail: String| Rejection::Invalid {
            kind: "WeightsUpdate",
            field: "weights",
            detail,
        };
        let (tensors, _) = relay_nn::from_safetensors(bytes).map_err(|e| invalid(e.to_string()))?;
        for (name, _, values) in &tensors {
            if let Some(index) = values.iter().position(|v| !v.is_finite()) {
                return Err(Rejection::Tensor {
                    kind: "WeightsUpdate",
                    field: format!("weights[{name}]").into(),
                    source: relay_proto::TensorError::NonFinite { index },
                });
            }
        }
        Ok(Self {
            version: update.version,
            learner_env_steps: update.learner_env_steps,
            tensors,
            normalizer: update.normalizer.clone(),
        })
    }

    /// The message of this version with its parameters inline, however
    /// large (tests; a publisher sends larger ones through
    /// `relay_kit::weights`).
    pub fn inline_update(&self) -> WeightsUpdate {
        self.update(relay_proto::WeightsBlob::inline(self.to_safetensors()))
    }

    /// The message of this version, its parameters where `weights` says.
    pub fn update(&self, weights: relay_proto::WeightsBlob) -> WeightsUpdate {
        WeightsUpdate {
            schema: SCHEMA_VERSION,
            version: self.version,
            learner_env_steps: self.learner_env_steps,
            weights,
            normalizer: self.normalizer.clone(),
            published_unix_ms: 0,
        }
    }

    /// The version a message describes, its parameters fetched (inline,
    /// from the publisher, or from the object store) and checked.
    pub async fn fetch(service: &Service, update: &WeightsUpdate) -> Result<Self, WeightsError> {
        let timeout = Duration::from_millis(service.config.weights.fetch_timeout_ms);
        let bytes = relay_kit::weights::fetch(&service.nats, &update.weights, timeout)
            .await
            .map_err(|source| WeightsError::Fetch {
                version: update.version,
                source,
            })?;
        Ok(Self::from_update(update, &bytes)?)
    }
}

/// Loads `weights` into `model`; on any mismatch the model is unchanged.
pub fn load_weights(model: &mut ActorCritic, weights: &PolicyWeights) -> Result<(), Rejection> {
    model
        .load_named_tensors(&weights.tensors)
        .map_err(|e| Rejection::Invalid {
            kind: "WeightsUpdate",
            field: "weights",
            detail: e.to_string(),
        })
}

fn moments(rms: &RunningMeanStd) -> Moments {
    Moments {
        count: rms.count,
        mean: rms.mean.clone(),
        var: rms.var.clone(),
    }
}

fn rms(m: &Moments) -> RunningMeanStd {
    RunningMeanStd {
        mean: m.mean.clone(),
        var: m.var.clone(),
        count: m.count,
    }
}

/// A normaliser's statistics as they travel with a weights version.
pub fn norm_stats(normalizer: &VecNormalize) -> NormStats {
    NormStats {
        obs: moments(&normalizer.obs_rms),
        ret: moments(&normalizer.ret_rms),
    }
}

/// An env-runner's delta as it travels with a fragment.
pub fn delta_stats(delta: &NormDelta) -> NormStats {
    NormStats {
        obs: moments(&delta.obs_rms),
        ret: moments(&delta.ret_rms),
    }
}

/// A fragment's delta (checked by the wire) as the learner merges it.
pub fn stats_delta(stats: &NormStats) -> NormDelta {
    NormDelta {
        obs_rms: rms(&stats.obs),
        ret_rms: rms(&stats.ret),
    }
}

/// The observation and return statistics of a weights message.
pub fn stats_rms(stats: &NormStats) -> (RunningMeanStd, RunningMeanStd) {
    (rms(&stats.obs), rms(&stats.ret))
}

/// The normaliser a weights version prescribes for a run, frozen (never
/// updated): `None` when the run's `normalize` section is off (statistics
/// a version may carry are then ignored). A normalising run's version
/// without statistics, or with statistics of another width, is rejected.
pub fn frozen_normalizer(
    config: &ExperimentConfig,
    obs_dim: usize,
    version: u64,
    stats: Option<&NormStats>,
) -> Result<Option<VecNormalize>, Rejection> {
    let Some(norm) = config.normalizer() else {
        return Ok(None);
    };
    let invalid = |detail: String| Rejection::Invalid {
        kind: "WeightsUpdate",
        field: "normalizer",
        detail,
    };
    let stats = stats.ok_or_else(|| {
        invalid(format!(
            "version {version} carries no normalisation statistics, but this run normalises (`normalize` section)"
        ))
    })?;
    let mut n = VecNormalize::new(norm, obs_dim, 0).map_err(|e| invalid(e.to_string()))?;
    let (obs, ret) = stats_rms(stats);
    n.sync(&obs, &ret).map_err(|e| invalid(e.to_string()))?;
    n.set_training(false);
    Ok(Some(n))
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

/// What a [`Follower`] keeps of each weights version.
pub trait Versioned: Send + Sync + 'static {
    /// The weights version it was built from.
    fn version(&self) -> u64;
}

impl Versioned for VersionedPolicy {
    fn version(&self) -> u64 {
        self.version
    }
}

/// The normalisation statistics of a weights version (what an env-runner
/// needs of it), frozen; `None` when the run does not normalise.
pub struct VersionedStats {
    pub version: u64,
    pub normalizer: Option<VecNormalize>,
}

impl Versioned for VersionedStats {
    fn version(&self) -> u64 {
        self.version
    }
}

/// Follows the learner's weights, keeping what `T` takes of the newest
/// version; [`Follower::latest`] is the newest.
pub struct Follower<T> {
    rx: watch::Receiver<Option<Arc<T>>>,
}

// Derive would ask `T: Clone`; copies share the one fetch loop.
impl<T> Clone for Follower<T> {
    fn clone(&self) -> Self {
        Self {
            rx: self.rx.clone(),
        }
    }
}

/// Keeps the newest model (and its normaliser).
pub type PolicyFollower = Follower<VersionedPolicy>;

/// Keeps the newest version's normalisation statistics only (no model is
/// built).
pub type StatsFollower = Follower<VersionedStats>;

/// The learner's newest version, asked on `weights.latest`.
async fn latest_weights(service: &Service) -> Result<WeightsUpdate, relay_kit::RequestError> {
    let ask = WeightsRequest {
        schema: SCHEMA_VERSION,
    };
    relay_kit::request(
        &service.nats,
        &service.subjects.weights_latest(),
        &ask,
        service.request_timeout(),
    )
    .await
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

impl Follower<VersionedPolicy> {
    /// Starts following (a background task until shutdown).
    pub async fn start(service: &Service) -> Result<Self, relay_kit::ServiceError> {
        let build = policy_builder(&service.config)?;
        Self::follow(service, true, move |_, weights| {
            build(weights.expect("fetched: this follower builds models"))
        })
        .await
    }
}

/// The version last announced on `weights.announce` (a
/// [`relay_proto::WeightsAnnouncement`] per version the learner publishes;
/// lower than the one before after a learner restarted from an older
/// checkpoint), `None` before the first: a background task listens until
/// shutdown.
pub async fn announced_versions(
    service: &Service,
) -> Result<watch::Receiver<Option<u64>>, relay_kit::ServiceError> {
    let mut announcements = service
        .nats
        .subscribe(service.subjects.weights_announce())
        .await
        .map_err(relay_kit::ServiceError::nats)?;
    let (tx, announced) = watch::channel(None);
    let listener = service.clone();
    tokio::spawn(async move {
        loop {
            let message = tokio::select! {
                Some(m) = announcements.next() => m,
                _ = listener.shutdown.wait() => return,
                else => return,
            };
            if let Ok(announced) = listener
                .intake
                .decode::<WeightsAnnouncement>("weights.announce", &message.payload)
            {
                tx.send_if_modified(|v| {
                    let changed = *v != Some(announced.version);
                    *v = Some(announced.version);
                    changed
                });
            }
        }
    });
    Ok(announced)
}

/// The learner's weights for a service that plays only some versions (the
/// evaluator: one every `eval.every_versions`): it hears every version on
/// `weights.announce` (a [`relay_proto::WeightsAnnouncement`]) and fetches
/// a version's weights (`weights.latest`, then its parameters) only when
/// asked for one, instead of receiving and building each (SAC publishes
/// one per env step).
///
/// [`PolicyFetcher::newer_than`] is cancel-safe: a fetch runs in its own
/// task and a call dropped mid-way (the evaluator's `select!` woken by an
/// episode report) leaves it running for the next call to collect, so a
/// large version that takes longer to fetch than the gap between two
/// messages still arrives.
pub struct PolicyFetcher {
    service: Service,
    build: Arc<PolicyBuilder>,
    announced: watch::Receiver<Option<u64>>,
    /// The fetch under way, if any: it outlives a cancelled call.
    fetching: Option<tokio::task::JoinHandle<FetchAttempt>>,
    failures: FetchFailures,
}

/// What one fetch of the newest version came to.
enum FetchAttempt {
    Built(Arc<VersionedPolicy>),
    /// No version yet, or its parameters could not be fetched (a failure
    /// is counted), or it was rejected: try again after a pause.
    Failed(Option<WeightsError>),
}

impl PolicyFetcher {
    /// Starts listening to the announcements (a background task until shutdown).
    pub async fn start(service: &Service) -> Result<Self, relay_kit::ServiceError> {
        let build = Arc::new(policy_builder(&service.config)?);
        Ok(Self {
            service: service.clone(),
            build,
            announced: announced_versions(service).await?,
            fetching: None,
            failures: FetchFailures::default(),
        })
    }

    /// Waits until a version newer than `version` (any for `None`) is
    /// announced, then fetches and builds the newest; `None` on shutdown.
    /// Cancel-safe (see the type's docs).
    pub async fn newer_than(&mut self, version: Option<u64>) -> Option<Arc<VersionedPolicy>> {
        let mut backoff = Duration::from_millis(20);
        loop {
            if self.fetching.is_none() {
                if let Some(seen) = version {
                    while self.announced.borrow_and_update().is_none_or(|v| v <= seen) {
                        tokio::select! {
                            changed = self.announced.changed() => changed.ok()?,
                            _ = self.service.shutdown.wait() => return None,
                        }
                    }
                }
                let (service, build) = (self.service.clone(), self.build.clone());
                self.fetching = Some(tokio::spawn(
                    async move { fetch_newest(&service, &build).await },
                ));
            }
            let attempt = tokio::select! {
                joined = self.fetching.as_mut().expect("a fetch is under way") => joined,
                _ = self.service.shutdown.wait() => return None,
            };
            self.fetching = None;
            match attempt {
                Ok(FetchAttempt::Built(policy)) => {
                    self.failures.succeeded();
                    // Older than asked for: fetched for an earlier call, or
                    // a restarted learner not yet at the announced version.
                    if version.is_none_or(|seen| policy.version > seen) {
                        return Some(policy);
                    }
                }
                Ok(FetchAttempt::Failed(Some(e))) => {
                    self.failures.failed(&self.service, &e, false).await
                }
                Ok(FetchAttempt::Failed(None)) => {}
                Err(e) => tracing::warn!(error = %e, "weights fetch task ended"),
            }
            tokio::select! {
                _ = tokio::time::sleep(backoff) => {}
                _ = self.service.shutdown.wait() => return None,
            }
            backoff = (backoff * 2).min(Duration::from_millis(500));
        }
    }
}

/// Asks `weights.latest`, fetches that version's parameters and builds it,
/// timing its transfer from the learner's stamp.
async fn fetch_newest(service: &Service, build: &PolicyBuilder) -> FetchAttempt {
    let update = match latest_weights(service).await {
        Ok(update) => update,
        Err(e) => {
            tracing::debug!(error = %e, "no weights yet");
            return FetchAttempt::Failed(None);
        }
    };
    let weights = match PolicyWeights::fetch(service, &update).await {
        Ok(weights) => weights,
        Err(WeightsError::Rejected(rejection)) => {
            service.intake.reject("weights.latest", &rejection);
            return FetchAttempt::Failed(None);
        }
        Err(e) => return FetchAttempt::Failed(Some(e)),
    };
    match build(&weights) {
        Ok(policy) => {
            if update.published_unix_ms > 0 {
                service
                    .weights_transfer()
                    .record(update.published_unix_ms, update.weights.size as usize);
            }
            FetchAttempt::Built(Arc::new(policy))
        }
        Err(rejection) => {
            service.intake.reject("weights.latest", &rejection);
            FetchAttempt::Failed(None)
        }
    }
}

/// Versions in a row whose parameters could not be fetched, after which a
/// follower that holds no version fails its service: it would never act.
const FETCH_FAILURES_TO_FAIL: u32 = 3;

/// Consecutive fetch failures of a follower.
#[derive(Default)]
struct FetchFailures(u32);

impl FetchFailures {
    /// Logs a failed fetch; the [`FETCH_FAILURES_TO_FAIL`]th in a row,
    /// while nothing is `held`, fails the service with the reason.
    async fn failed(&mut self, service: &Service, error: &WeightsError, held: bool) {
        self.0 += 1;
        tracing::warn!(error = %error, "weights version not fetched");
        if !held && self.0 >= FETCH_FAILURES_TO_FAIL {
            service
                .fail(format!(
                "{} weights versions in a row could not be fetched, and none is held; the last: {error}. Readers must reach the learner's direct transfer server (weights.direct_listen / weights.direct_advertise) or the versions must be in the object store (weights.store: always)",
                    self.0
                ))
                .await;
        }
    }

    fn succeeded(&mut self) {
        self.0 = 0;
    }
}

impl Follower<VersionedStats> {
    /// Starts following the statistics (a background task until shutdown);
    /// they travel in the message, so no parameters are fetched.
    pub async fn start(service: &Service) -> Result<Self, relay_kit::ServiceError> {
        let obs_dim = spec_for(&service.config)
            .map_err(relay_kit::ServiceError::other)?
            .obs_dim;
        let config = service.config.clone();
        Self::follow(service, false, move |update, _| {
            Ok(VersionedStats {
                version: update.version,
                normalizer: frozen_normalizer(
                    &config,
                    obs_dim,
                    update.version,
                    update.normalizer.as_ref(),
                )?,
            })
        })
        .await
    }
}

impl<T: Versioned> Follower<T> {
    /// Takes the current version at start (`weights.latest`), then each
    /// one published (`weights`), skipping to the newest of those already
    /// queued; fetches its parameters when `fetch` is set (see
    /// [`PolicyWeights::fetch`]), keeps what `build` makes of it, and
    /// measures each published one's transfer.
    async fn follow(
        service: &Service,
        fetch: bool,
        build: impl Fn(&WeightsUpdate, Option<&PolicyWeights>) -> Result<T, Rejection>
            + Send
            + Sync
            + 'static,
    ) -> Result<Self, relay_kit::ServiceError> {
        let transfer = service.weights_transfer();
        let (tx, rx) = watch::channel(None);
        let mut updates = service
            .nats
            .subscribe(service.subjects.weights())
            .await
            .map_err(relay_kit::ServiceError::nats)?;
        let service = service.clone();
        tokio::spawn(async move {
            let current =
                |tx: &watch::Sender<Option<Arc<T>>>| tx.borrow().as_ref().map(|p| p.version());
            let mut failures = FetchFailures::default();
            // Fetches and builds `update`; true when it is now the newest held.
            let take = async |update: WeightsUpdate,
                              subject: &str,
                              tx: &watch::Sender<Option<Arc<T>>>,
                              failures: &mut FetchFailures|
                   -> bool {
                let weights = if fetch {
                    match PolicyWeights::fetch(&service, &update).await {
                        Ok(w) => Some(w),
                        Err(WeightsError::Rejected(rejection)) => {
                            service.intake.reject(subject, &rejection);
                            return false;
                        }
                        Err(e) => {
                            failures.failed(&service, &e, current(tx).is_some()).await;
                            return false;
                        }
                    }
                } else {
                    None
                };
                failures.succeeded();
                match build(&update, weights.as_ref()) {
                    Ok(built) => {
                        let _ = tx.send(Some(Arc::new(built)));
                        if update.published_unix_ms > 0 {
                            transfer.record(update.published_unix_ms, update.weights.size as usize);
                        }
                        true
                    }
                    Err(rejection) => {
                        service.intake.reject(subject, &rejection);
                        false
                    }
                }
            };
            // The current version, in case the learner published it before we subscribed.
            let mut backoff = Duration::from_millis(20);
            while current(&tx).is_none() && !service.shutdown.is_triggered() {
                match latest_weights(&service).await {
                    Ok(update) => {
                        if take(update, "weights.latest", &tx, &mut failures).await {
                            tracing::info!(version = current(&tx), "loaded current weights");
                        }
                    }
                    Err(e) => tracing::debug!(error = %e, "no weights yet"),
                }
                if current(&tx).is_some() {
                    break;
                }
                tokio::select! {
                    _ = tokio::time::sleep(backoff) => {}
                    Some(m) = updates.next() => {
                        // A published version arrived first: take it.
                        if let Ok(update) = service.intake.decode::<WeightsUpdate>("weights", &m.payload) {
                            take(update, "weights", &tx, &mut failures).await;
                        }
                    }
                    _ = service.shutdown.wait() => return,
                }
                backoff = (backoff * 2).min(Duration::from_millis(500));
            }
            loop {
                let first = tokio::select! {
                    Some(m) = updates.next() => m,
                    _ = service.shutdown.wait() => return,
                    else => return,
                };
                // Every message is checked (a bad one is counted), but of
                // the versions published while the last one was fetched
                // only the newest is worth fetching.
                let mut newest: Option<WeightsUpdate> = None;
                let mut message = Some(first);
                while let Some(m) = message {
                    if let Ok(update) = service
                        .intake
                        .decode::<WeightsUpdate>("weights", &m.payload)
                    {
                        if newest.as_ref().is_none_or(|n| update.version > n.version) {
                            newest = Some(update);
                        }
                    }
                    message = updates.next().now_or_never().flatten();
                }
                let Some(update) = newest else { continue };
                if current(&tx).is_some_and(|v| update.version <= v) {
                    continue;
                }
                take(update, "weights", &tx, &mut failures).await;
            }
        });
        Ok(Self { rx })
    }

    /// The newest version kept, if any has arrived.
    pub fn latest(&self) -> Option<Arc<T>> {
        self.rx.borrow().clone()
    }

    /// Waits until a version newer than `version` (any for `None`) arrives;
    /// `None` on shutdown of the follower.
    pub async fn newer_than(&mut self, version: Option<u64>) -> Option<Arc<T>> {
        loop {
            if let Some(p) = self.rx.borrow_and_update().clone() {
                if version.is_none_or(|v| p.version() > v) {
                    return Some(p);
                }
            }
            self.rx.changed().await.ok()?;
        }
    }
}

/// A published version of a LoRA adapter (what the evaluator needs of an
/// [`AdapterUpdate`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AdapterVersion {
    pub version: u64,
    pub learner_env_steps: u64,
}

/// Follows the versions the learner publishes of one adapter
/// (`relay.<run>.adapters`), starting from the current one (asked of the
/// learner on `adapters.latest`, retried until it answers or a version is
/// published).
pub struct AdapterFollower {
    rx: watch::Receiver<Option<AdapterVersion>>,
}

impl AdapterFollower {
    /// Starts following adapter `name` (a background task until shutdown).
    pub async fn start(service: &Service, name: &str) -> Result<Self, relay_kit::ServiceError> {
        let (tx, rx) = watch::channel(None);
        let mut updates = service
            .nats
            .subscribe(service.subjects.adapters())
            .await
            .map_err(relay_kit::ServiceError::nats)?;
        let (service, name) = (service.clone(), name.to_string());
        tokio::spawn(async move {
            let offer = |tx: &watch::Sender<Option<AdapterVersion>>, update: &AdapterUpdate| {
                let newer = tx
                    .borrow()
                    .is_none_or(|current: AdapterVersion| update.version > current.version);
                if update.name == name && newer {
                    let _ = tx.send(Some(AdapterVersion {
                        version: update.version,
                        learner_env_steps: update.learner_env_steps,
                    }));
                }
            };
            // The current version, in case the learner published it before we subscribed.
            let ask = relay_proto::AdapterRequest {
                schema: SCHEMA_VERSION,
                name: name.clone(),
            };
            let mut backoff = Duration::from_millis(20);
            while tx.borrow().is_none() && !service.shutdown.is_triggered() {
                match relay_kit::request::<_, AdapterUpdate>(
                    &service.nats,
                    &service.subjects.adapters_latest(),
                    &ask,
                    service.request_timeout(),
                )
                .await
                {
                    Ok(update) => offer(&tx, &update),
                    Err(e) => tracing::debug!(error = %e, "no adapter version yet"),
                }
                if tx.borrow().is_some() {
                    break;
                }
                tokio::select! {
                    _ = tokio::time::sleep(backoff) => {}
                    Some(m) = updates.next() => {
                        if let Ok(update) = service.intake.decode::<AdapterUpdate>("adapters", &m.payload) {
                            offer(&tx, &update);
                        }
                    }
                    _ = service.shutdown.wait() => return,
                }
                backoff = (backoff * 2).min(Duration::from_millis(1000));
            }
            loop {
                let message = tokio::select! {
                    Some(m) = updates.next() => m,
                    _ = service.shutdown.wait() => return,
                    else => return,
                };
                let Ok(update) = service
                    .intake
                    .decode::<AdapterUpdate>("adapters", &message.payload)
                else {
                    continue;
                };
                offer(&tx, &update);
            }
        });
        Ok(Self { rx })
    }

    /// The newest version known (the current one at start, then each one
    /// published), if any.
    pub fn latest(&self) -> Option<AdapterVersion> {
        *self.rx.borrow()
    }

    /// Waits until a version newer than `version` (any for `None`) is
    /// published; `None` once the follower stopped.
    pub async fn newer_than(&mut self, version: Option<u64>) -> Option<AdapterVersion> {
        loop {
            if let Some(v) = *self.rx.borrow_and_update() {
                if version.is_none_or(|seen| v.version > seen) {
                    return Some(v);
                }
            }
            self.rx.changed().await.ok()?;
        }
    }
}

/// Restores `normalizer`'s statistics from checkpoint folder `dir`.
pub fn load_normalizer(
    dir: &std::path::Path,
    normalizer: &mut VecNormalize,
) -> Result<(), relay_runs::checkpoint::CheckpointError> {
    let path = dir.join(relay_runs::checkpoint::VEC_NORMALIZE_FILE);
    if !path.is_file() {
        return Err(relay_runs::checkpoint::CheckpointError::State {
            path,
            detail: "missing: the run normalises (`normalize` section) but this checkpoint holds no statistics".into(),
        });
    }
    normalizer
        .load(&path)
        .map_err(|e| relay_runs::checkpoint::CheckpointError::Tensors(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(sets: &[&str]) -> ExperimentConfig {
        let overrides: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
        ExperimentConfig::from_layers("run:\n  env_id: CartPole-v1\n", "t", &[], &overrides)
            .unwrap()
    }

    fn weights(normalizer: Option<NormStats>) -> PolicyWeights {
        let model = ActorCritic::new(&PolicySpec::discrete(4, 2), 1).unwrap();
        let mut w = PolicyWeights::of(&model, 7, 100);
        w.normalizer = normalizer;
        w
    }

    /// [`frozen_normalizer`] of a version.
    fn frozen(
        config: &ExperimentConfig,
        obs_dim: usize,
        w: &PolicyWeights,
    ) -> Result<Option<VecNormalize>, Rejection> {
        frozen_normalizer(config, obs_dim, w.version, w.normalizer.as_ref())
    }

    #[test]
    fn a_version_travels_as_safetensors_and_refuses_what_is_not_finite() {
        let w = weights(None);
        let update = w.inline_update();
        let bytes = update.weights.inline.clone().unwrap();
        assert_eq!(PolicyWeights::from_update(&update, &bytes).unwrap(), w);
        let mut bad = w.clone();
        bad.tensors[0].2[1] = f32::NAN;
        let err = PolicyWeights::from_update(&update, &bad.to_safetensors()).unwrap_err();
        assert_eq!(err.reason(), "non_finite", "{err}");
        let err = PolicyWeights::from_update(&update, b"not safetensors").unwrap_err();
        assert!(err.to_string().contains("WeightsUpdate.weights"), "{err}");
    }

    #[test]
    fn a_version_prescribes_its_statistics_frozen_or_is_rejected_without_them() {
        let mut source = VecNormalize::new(relay_nn::NormalizeConfig::default(), 4, 2).unwrap();
        let mut obs = [0.5f32, 1.0, -0.5, 2.0, 0.1, 0.2, 0.3, 0.4];
        source.reset(&mut obs).unwrap();
        let stats = norm_stats(&source);

        // Off: no normaliser, whatever the version carries.
        let off = config(&[]);
        assert!(frozen(&off, 4, &weights(Some(stats.clone())))
            .unwrap()
            .is_none());

        let on = config(&["normalize.obs=true"]);
        let n = frozen(&on, 4, &weights(Some(stats.clone())))
            .unwrap()
            .unwrap();
        assert!(!n.training());
        assert_eq!((n.obs_rms.clone(), n.ret_rms.clone()), stats_rms(&stats));
        let err = frozen(&on, 4, &weights(None)).unwrap_err();
        assert!(
            err.to_string().contains("WeightsUpdate.normalizer")
                && err.to_string().contains("version 7"),
            "{err}"
        );
        let err = frozen(&on, 3, &weights(Some(stats))).unwrap_err();
        assert!(err.to_string().contains("normalizer"), "{err}");

        // Deltas survive the trip through the wire form.
        let mut delta = NormDelta::empty(4);
        delta.obs_rms.update(&obs).unwrap();
        assert_eq!(stats_delta(&delta_stats(&delta)), delta);
    }
}
