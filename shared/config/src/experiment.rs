//! [`ExperimentConfig`], a whole run's config: layered loading (file, then
//! `RELAY__` environment variables, then `--set`), validation across
//! sections, and what services derive from several sections at once.

use std::path::Path;

use relay_bridge::EnvSection;
use serde::{Deserialize, Serialize};

use crate::a2c::A2cConfig;
use crate::check::{invalid, positive, positive_f, ConfigError};
use crate::connections::{ConnectionsConfig, SECRET_ENV_VARS};
use crate::dqn::DqnConfig;
use crate::eval::EvalConfig;
use crate::league::{fixed_opponent, league_fixed_names, LeagueSection};
use crate::llm::LlmConfig;
use crate::lora::LoraSection;
use crate::normalize::NormalizeSection;
use crate::policy::PolicyConfig;
use crate::ppo::PpoConfig;
use crate::reinforce::ReinforceConfig;
use crate::rl::RlConfig;
use crate::run::{Algo, RunConfig};
use crate::sac::SacSection;
use crate::selfplay::SelfPlaySection;
use crate::services::{
    EnvRunnerConfig, InferenceConfig, LearnerConfig, ReplayConfig, TrackerConfig,
};
use crate::text::TextConfig;
use crate::weights::WeightsSection;

/// A whole experiment.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExperimentConfig {
    pub run: RunConfig,
    #[serde(default)]
    pub connections: ConnectionsConfig,
    #[serde(default)]
    pub policy: PolicyConfig,
    #[serde(default)]
    pub env_runner: EnvRunnerConfig,
    #[serde(default)]
    pub inference: InferenceConfig,
    #[serde(default)]
    pub llm: LlmConfig,
    #[serde(default)]
    pub learner: LearnerConfig,
    #[serde(default)]
    pub replay: ReplayConfig,
    #[serde(default)]
    pub ppo: PpoConfig,
    #[serde(default)]
    pub a2c: A2cConfig,
    #[serde(default)]
    pub reinforce: ReinforceConfig,
    #[serde(default)]
    pub dqn: DqnConfig,
    #[serde(default)]
    pub sac: SacSection,
    #[serde(default)]
    pub eval: EvalConfig,
    #[serde(default)]
    pub tracker: TrackerConfig,
    #[serde(default)]
    pub text: TextConfig,
    #[serde(default)]
    pub lora: LoraSection,
    #[serde(default)]
    pub rl: RlConfig,
    #[serde(default)]
    pub league: LeagueSection,
    /// Who the policy plays in a multi-agent game stepped on observations.
    #[serde(default)]
    pub selfplay: SelfPlaySection,
    #[serde(default)]
    pub normalize: NormalizeSection,
    /// How weights versions travel to the services that follow them.
    #[serde(default)]
    pub weights: WeightsSection,
    /// Where `run.env_id` comes from (built in, or Gymnasium through Python
    /// workers) and how it is made.
    #[serde(default)]
    pub env: EnvSection,
}

/// What a message holds besides its arrays (field names, ids, schema,
/// normalisation statistics of a wide observation), with room to spare.
const MESSAGE_OVERHEAD: usize = 64 * 1024;

/// Environment variables of this form override config fields:
/// `RELAY__PPO__LEARNING_RATE=0.0003` sets `ppo.learning_rate`.
pub const ENV_PREFIX: &str = "RELAY__";

/// Sets `a.b.c` in a YAML mapping to `raw` parsed as a YAML scalar.
/// Secrets (`*_password`, `*_token`) are taken verbatim as strings, so a
/// password such as `123` or `yes` stays what it is.
pub(crate) fn set_dotted(
    root: &mut serde_yaml::Value,
    key: &str,
    raw: &str,
) -> Result<(), ConfigError> {
    let parsed: serde_yaml::Value = if key.ends_with("_password") || key.ends_with("_token") {
        serde_yaml::Value::String(raw.to_string())
    } else {
        serde_yaml::from_str(raw).map_err(|e| ConfigError::Override {
            key: key.to_string(),
            detail: e.to_string(),
        })?
    };
    let parts: Vec<&str> = key.split('.').collect();
    if parts.iter().any(|p| p.is_empty()) {
        return Err(ConfigError::Override {
            key: key.to_string(),
            detail: "empty path segment".into(),
        });
    }
    let mut node = root;
    for part in &parts[..parts.len() - 1] {
        let map = node.as_mapping_mut().ok_or_else(|| ConfigError::Override {
            key: key.to_string(),
            detail: format!("{part} is not inside a mapping"),
        })?;
        node = map
            .entry(serde_yaml::Value::String(part.to_string()))
            .or_insert_with(|| serde_yaml::Value::Mapping(Default::default()));
    }
    let map = node.as_mapping_mut().ok_or_else(|| ConfigError::Override {
        key: key.to_string(),
        detail: "parent is not a mapping".into(),
    })?;
    map.insert(
        serde_yaml::Value::String(parts[parts.len() - 1].to_string()),
        parsed,
    );
    Ok(())
}

impl ExperimentConfig {
    /// Loads a file, applies environment overrides, then `--set` overrides, and validates.
    pub fn load(path: &Path, overrides: &[String]) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        let mut env: Vec<(String, String)> = std::env::vars()
            .filter_map(|(k, v)| {
                k.strip_prefix(ENV_PREFIX)
                    .map(|rest| (rest.to_ascii_lowercase().replace("__", "."), v))
            })
            .collect();
        for (var, key) in SECRET_ENV_VARS {
            if let Ok(value) = std::env::var(var) {
                env.push((key.to_string(), value));
            }
        }
        Self::from_layers(&text, &path.display().to_string(), &env, overrides)
    }

    /// Parses YAML text and applies `(dotted.key, value)` overrides, then `key=value` ones.
    pub fn from_layers(
        text: &str,
        origin: &str,
        env: &[(String, String)],
        overrides: &[String],
    ) -> Result<Self, ConfigError> {
        let mut value: serde_yaml::Value =
            serde_yaml::from_str(text).map_err(|e| ConfigError::Parse {
                origin: origin.to_string(),
                detail: e.to_string(),
            })?;
        for (key, raw) in env {
            set_dotted(&mut value, key, raw)?;
        }
        for item in overrides {
            let (key, raw) = item.split_once('=').ok_or_else(|| ConfigError::Override {
                key: item.clone(),
                detail: "expected key=value, e.g. ppo.learning_rate=0.0003".into(),
            })?;
            set_dotted(&mut value, key.trim(), raw)?;
        }
        // The path names the field of a value that does not parse.
        let config: ExperimentConfig =
            serde_path_to_error::deserialize(value).map_err(|e| ConfigError::Parse {
                origin: origin.to_string(),
                detail: match e.path().to_string().as_str() {
                    "." => e.inner().to_string(),
                    path => format!("{path}: {}", e.inner()),
                },
            })?;
        config.validate()?;
        Ok(config)
    }

    /// Checks ranges and cross-field constraints.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.connections.validate()?;
        if let Some(id) = &self.run.id {
            relay_proto::validate_run_id(id).map_err(|e| invalid("run.id", e))?;
        }
        // An id relay does not have is made by Gymnasium (env.backend auto),
        // which names an unknown id when a service first makes it.
        self.env
            .validate(&self.run.env_id)
            .map_err(|(field, detail)| invalid(field, detail))?;
        self.text.validate(&self.run.env_id, &self.env)?;
        self.league
            .validate(&self.text, &self.selfplay, &self.run.env_id, &self.env)?;
        self.selfplay.validate()?;
        self.lora.validate()?;
        self.weights.validate()?;
        self.rl.validate(self.text.max_turn_tokens as usize)?;
        if self.run.total_env_steps == 0 {
            return Err(invalid("run.total_env_steps", "must be positive"));
        }
        if self.policy.hidden.contains(&0)
            || (self.policy.hidden.is_empty() && self.policy.cnn.is_none())
        {
            return Err(invalid(
                "policy.hidden",
                "needs at least one layer (none is allowed with policy.cnn), each wider than 0",
            ));
        }
        if let Some(recurrent) = &self.policy.recurrent {
            self.validate_recurrent(recurrent)?;
        }
        if let Some(cnn) = &self.policy.cnn {
            self.validate_cnn(cnn)?;
        }
        self.validate_sde()?;
        self.validate_policy_device()?;
        positive("env_runner.num_envs", self.env_runner.num_envs)?;
        positive("env_runner.fragment_steps", self.env_runner.fragment_steps)?;
        positive("env_runner.threads", self.env_runner.threads)?;
        positive_f("env_runner.pace_timeout_s", self.env_runner.pace_timeout_s)?;
        positive("inference.max_batch", self.inference.max_batch)?;
        positive("inference.threads", self.inference.threads)?;
        positive("learner.replicas", self.learner.replicas)?;
        self.llm.validate()?;
        // Text runs gather `rl.batch_size` learning moves (a replay "step").
        if self.is_text_game() {
            if self.replay.capacity_steps < self.rl.batch_size as u64 {
                return Err(invalid(
                    "replay.capacity_steps",
                    format!(
                        "{} is smaller than rl.batch_size ({}): the learner could never gather a batch",
                        self.replay.capacity_steps, self.rl.batch_size
                    ),
                ));
            }
        } else if let Some((field, steps)) = self.rollout_env_steps() {
            if self.replay.capacity_steps < steps {
                return Err(invalid(
                    "replay.capacity_steps",
                    format!(
                        "{} is smaller than {field} ({steps} env steps): the learner could never gather a rollout",
                        self.replay.capacity_steps
                    ),
                ));
            }
        }
        if let Some(age) = self.replay.max_age_s {
            positive_f("replay.max_age_s", age)?;
        }
        self.validate_rate_limit()?;
        self.ppo.validate()?;
        self.validate_a2c()?;
        self.validate_reinforce()?;
        self.validate_dqn()?;
        self.validate_sac()?;
        if self.run.resume_from.is_some() && self.run.init_from.is_some() {
            return Err(invalid(
                "run.init_from",
                "cannot be set together with run.resume_from (resume continues a run, init_from starts a new one)",
            ));
        }
        for (field, path) in [
            ("run.resume_from", &self.run.resume_from),
            ("run.init_from", &self.run.init_from),
        ] {
            if path.as_ref().is_some_and(|p| p.as_os_str().is_empty()) {
                return Err(invalid(field, "is empty; give a checkpoint folder"));
            }
        }
        self.normalize.validate()?;
        if self.normalize.enabled() && self.is_text_game() {
            return Err(invalid(
                if self.normalize.obs {
                    "normalize.obs"
                } else {
                    "normalize.reward"
                },
                "normalisation applies to classic-control envs, not text games",
            ));
        }
        if self.normalize.enabled() && self.run.algo.is_off_policy() {
            // The off-policy table stores raw transitions; DQN and SAC do
            // not take normalised ones yet.
            return Err(invalid(
                if self.normalize.obs {
                    "normalize.obs"
                } else {
                    "normalize.reward"
                },
                format!(
                    "not supported with run.algo {} yet (its replay table keeps raw transitions)",
                    self.run.algo
                ),
            ));
        }
        self.tracker.validate()?;
        self.eval.validate()?;
        positive("eval.episodes", self.eval.episodes)?;
        positive("eval.every_versions", self.eval.every_versions as usize)?;
        if let Some(t) = self.eval.threshold {
            if !t.is_finite() {
                return Err(invalid("eval.threshold", "must be finite"));
            }
        }
        Ok(())
    }

    /// The section configuring the run's algorithm's rollout and its size in
    /// env steps, for algorithms that train on a fixed number of env steps
    /// (PPO, A2C); none for REINFORCE, which trains on whole episodes.
    pub fn rollout_env_steps(&self) -> Option<(&'static str, u64)> {
        match self.run.algo {
            Algo::A2c => Some((
                "a2c.n_steps x env_runner.num_envs",
                (self.a2c.n_steps * self.env_runner.num_envs) as u64,
            )),
            Algo::Reinforce | Algo::Dqn | Algo::Sac => None,
            Algo::Ppo => Some(("ppo.rollout_steps", self.ppo.rollout_steps as u64)),
        }
    }

    /// Updates between periodic checkpoints of the run's algorithm
    /// (`<algo>.checkpoint_every`; text runs: `rl.checkpoint_every`).
    pub fn checkpoint_every(&self) -> u64 {
        if self.is_text_game() {
            return self.rl.checkpoint_every;
        }
        match self.run.algo {
            Algo::Ppo => self.ppo.checkpoint_every,
            Algo::A2c => self.a2c.checkpoint_every,
            Algo::Reinforce => self.reinforce.checkpoint_every,
            Algo::Dqn => self.dqn.checkpoint_every,
            Algo::Sac => self.sac.checkpoint_every,
        }
    }

    /// Numbered checkpoints kept (`<algo>.keep_checkpoints`; text runs:
    /// `rl.keep_checkpoints`).
    pub fn keep_checkpoints(&self) -> usize {
        if self.is_text_game() {
            return self.rl.keep_checkpoints;
        }
        match self.run.algo {
            Algo::Ppo => self.ppo.keep_checkpoints,
            Algo::A2c => self.a2c.keep_checkpoints,
            Algo::Reinforce => self.reinforce.keep_checkpoints,
            Algo::Dqn => self.dqn.keep_checkpoints,
            Algo::Sac => self.sac.keep_checkpoints,
        }
    }

    /// The discount of the run's algorithm (`ppo.gamma`, `a2c.gamma` or
    /// `reinforce.gamma`).
    pub fn algo_gamma(&self) -> f64 {
        match self.run.algo {
            Algo::A2c => self.a2c.gamma,
            Algo::Reinforce => self.reinforce.gamma,
            Algo::Ppo | Algo::Dqn | Algo::Sac => self.ppo.gamma,
        }
    }

    /// The `normalize` section resolved for relay-nn's `VecNormalize`
    /// (`gamma` defaulting to the algorithm's); `None` when it is off.
    pub fn normalizer(&self) -> Option<crate::hyper::policy::NormalizeConfig> {
        let n = &self.normalize;
        n.enabled().then(|| crate::hyper::policy::NormalizeConfig {
            norm_obs: n.obs,
            norm_reward: n.reward,
            clip_obs: n.clip_obs,
            clip_reward: n.clip_reward,
            gamma: n.gamma.unwrap_or_else(|| self.algo_gamma()),
            epsilon: n.epsilon,
        })
    }

    /// Whether `run.env_id` is a text game (played by LLM policies).
    pub fn is_text_game(&self) -> bool {
        self.env.is_text_game(&self.run.env_id)
    }

    /// Whether the self-play league is on: a text game whose
    /// `text.opponents.league` weight is positive (validation made sure the
    /// game has two players and the model learns), or a game on
    /// observations whose `selfplay.opponents.league` is (checked to be a
    /// two-player game once it is made, [`ExperimentConfig::check_env`]).
    pub fn league_enabled(&self) -> bool {
        if self.is_text_game() {
            self.text.league_weight() > 0.0
        } else {
            self.selfplay.league_weight() > 0.0
        }
    }

    /// The fixed members of the league pool: the bots of `text.opponents`
    /// (text games) or `selfplay.opponents` (games on observations),
    /// whatever their weight, then those of `league.fixed`.
    pub fn league_fixed(&self) -> Vec<relay_league::FixedOpponent> {
        league_fixed_names(
            &self.text,
            &self.selfplay,
            &self.league,
            self.is_text_game(),
        )
        .iter()
        .map(|name| fixed_opponent(name, &self.text))
        .collect()
    }

    /// The algorithm that trains the run, for run ids and the registry:
    /// `run.algo` for classic envs; for text games the `rl` preset (or
    /// `custom` when `rl.objective` replaces it).
    pub fn algo_name(&self) -> &str {
        if !self.is_text_game() {
            self.run.algo.name()
        } else if self.rl.objective.is_some() {
            "custom"
        } else {
            &self.rl.preset
        }
    }

    /// Whether the inference servers serve `generate`: a text game, or an
    /// `llm.model` set.
    pub fn serves_llm(&self) -> bool {
        self.is_text_game() || self.llm.model.is_some()
    }

    /// The run id, which every service needs.
    pub fn run_id(&self) -> Result<&str, ConfigError> {
        self.run
            .id
            .as_deref()
            .ok_or_else(|| invalid("run.id", "no run id: pass --run-id or set RELAY_RUN_ID"))
    }

    /// Solved threshold: `eval.threshold`, else the env's reward threshold
    /// (Gymnasium's registration for an env made through Python).
    pub fn solved_threshold(&self) -> Option<f64> {
        self.eval.threshold.or_else(|| {
            if self.is_text_game() {
                return None;
            }
            self.env_spec().ok().and_then(|s| s.reward_threshold)
        })
    }

    /// The spec (spaces, time limit, reward threshold) of `run.env_id`: the
    /// built-in env's, or what a Python worker reports for a Gymnasium env
    /// (asked once per process, then cached).
    pub fn env_spec(&self) -> Result<relay_envs::EnvSpec, relay_bridge::BridgeError> {
        relay_bridge::spec(&self.run.env_id, &self.env)
    }

    /// Whether observations travel as uint8 pixels: image observations that
    /// `normalize.obs` does not turn into floats.
    pub fn observations_as_pixels(&self, spec: &relay_envs::EnvSpec) -> bool {
        spec.image.is_some() && !self.normalize.obs
    }

    /// The policy's CNN on this env, its input the env's image: `policy.cnn`,
    /// or, for image observations that travel as pixels to a policy that
    /// can have a CNN (ppo, a2c, dqn), one chosen by the image's size
    /// ([`crate::hyper::policy::CnnSpec::for_image`]): an MLP would read
    /// raw pixels of 0 to 255. `None` for flat observations.
    pub fn policy_cnn(&self, spec: &relay_envs::EnvSpec) -> Option<crate::hyper::policy::CnnSpec> {
        let image = spec.image?;
        match &self.policy.cnn {
            Some(cnn) => Some(crate::hyper::policy::CnnSpec {
                input: image,
                ..cnn.clone()
            }),
            None => (self.observations_as_pixels(spec)
                && !self.is_text_game()
                && matches!(self.run.algo, Algo::Ppo | Algo::A2c | Algo::Dqn))
            .then(|| crate::hyper::policy::CnnSpec::for_image(image)),
        }
    }

    /// Checks the config against the env it runs on (known only once the
    /// env is made): `policy.cnn` needs image observations that its
    /// convolutions fit, and one observation must fit in a message.
    pub fn check_env(&self, spec: &relay_envs::EnvSpec) -> Result<(), ConfigError> {
        if self.env.seat_feature && spec.agents.is_empty() && spec.team.is_empty() {
            return Err(invalid(
                "env.seat_feature",
                format!(
                    "marks the seat of multi-agent games; {} is a single-agent env",
                    spec.id
                ),
            ));
        }
        if !spec.team.is_empty() {
            self.check_team(spec)?;
        }
        if !spec.agents.is_empty() {
            self.check_selfplay(spec)?;
        } else if self.selfplay != SelfPlaySection::default() && !self.is_text_game() {
            return Err(invalid(
                "selfplay",
                format!(
                    "{} is a single-agent env; self-play opponents apply to multi-agent games",
                    spec.id
                ),
            ));
        }
        if self.policy.cnn.is_some() {
            if spec.image.is_none() {
                return Err(invalid(
                    "policy.cnn",
                    format!(
                        "needs image observations; {} has flat observations of {} values",
                        spec.id,
                        spec.obs_dim()
                    ),
                ));
            }
            if !self.observations_as_pixels(spec) {
                return Err(invalid(
                    "normalize.obs",
                    "image observations are not normalized (the CNN scales pixels by 1/255, as SB3 does); set normalize.obs: false",
                ));
            }
        }
        if let Some(cnn) = self.policy_cnn(spec) {
            cnn.output_shapes().map_err(crate::policy::cnn_error)?;
        }
        if self.policy.use_sde && spec.action_space.is_discrete() {
            return Err(invalid(
                "policy.use_sde",
                format!(
                    "state-dependent exploration is for continuous actions; {} has discrete ones: leave it false",
                    spec.id
                ),
            ));
        }
        self.check_observation_size(spec)
    }

    /// A parallel game played by one shared policy: each agent is a row of
    /// a runner's vector of envs, so the vector holds whole games.
    fn check_team(&self, spec: &relay_envs::EnvSpec) -> Result<(), ConfigError> {
        let agents = spec.team.len();
        if !self.env_runner.num_envs.is_multiple_of(agents) {
            return Err(invalid(
                "env_runner.num_envs",
                format!(
                    "is {}, but {} has {agents} agents sharing one policy, each one env of the vector: set a multiple of {agents} ({} = one game)",
                    self.env_runner.num_envs, spec.id, agents
                ),
            ));
        }
        if self.selfplay != SelfPlaySection::default() {
            return Err(invalid(
                "selfplay",
                format!(
                    "{} is played by one policy shared by its {agents} agents (env.multi_agent: shared); self-play opponents apply to games taken in turns (env.multi_agent: self_play)",
                    spec.id
                ),
            ));
        }
        Ok(())
    }

    /// A multi-agent game is trained by self-play ([`SelfPlaySection`]):
    /// discrete actions, an on-policy or DQN learner, every opponent able
    /// to play the game, and none of what assumes one agent's stream of
    /// steps.
    fn check_selfplay(&self, spec: &relay_envs::EnvSpec) -> Result<(), ConfigError> {
        let game = || {
            format!(
                "{} is a game of {} agents ({}) trained by self-play",
                spec.id,
                spec.agents.len(),
                spec.agents.join(", ")
            )
        };
        if !spec.action_space.is_discrete() {
            return Err(invalid(
                "run.env_id",
                format!("{}: self-play needs discrete actions", game()),
            ));
        }
        if self.run.algo == Algo::Sac {
            return Err(invalid(
                "run.algo",
                format!("{}: use ppo, a2c, reinforce or dqn", game()),
            ));
        }
        if self.normalize.obs || self.normalize.reward {
            return Err(invalid(
                "normalize",
                format!("{}: normalisation is not supported in self-play; turn normalize.obs and normalize.reward off", game()),
            ));
        }
        if self.policy.recurrent.is_some() {
            return Err(invalid(
                "policy.recurrent",
                format!(
                    "{}: recurrent policies are not built for self-play (each seat would need its own state); use a feed-forward policy",
                    game()
                ),
            ));
        }
        if self.env_runner.pace {
            return Err(invalid(
                "env_runner.pace",
                format!(
                    "{}: pacing counts one agent's env steps; turn it off",
                    game()
                ),
            ));
        }
        // Checkpoints are checked to play the game when they are loaded.
        let bot_plays = |name: &str, field: &str| match crate::checkpoint_opponent(name) {
            Some(_) => Ok(()),
            None => relay_envs::SeatBot::new(name, spec)
                .map(drop)
                .map_err(|e| invalid(field, e.to_string())),
        };
        for name in self.selfplay.bots() {
            bot_plays(name, &format!("selfplay.opponents.{name}"))?;
        }
        if self.league_enabled() {
            if spec.agents.len() != 2 {
                return Err(invalid(
                    "selfplay.opponents.league",
                    format!("{}: the league rates two-player games only", game()),
                ));
            }
            for (index, name) in self.league.fixed.iter().enumerate() {
                bot_plays(name, &format!("league.fixed[{index}]"))?;
            }
        }
        Ok(())
    }

    /// Bytes one observation of `spec` takes on the wire: a byte a pixel,
    /// else an f32 a value.
    pub fn observation_bytes(&self, spec: &relay_envs::EnvSpec) -> usize {
        let value_bytes = if self.observations_as_pixels(spec) {
            1
        } else {
            4
        };
        spec.obs_dim() * value_bytes
    }

    /// Refuses observations too large for any NATS message: the smallest
    /// fragment (one step of one env, with its next and final
    /// observations) must fit in the most nats-server carries. Anything
    /// larger is split by whoever sends it.
    fn check_observation_size(&self, spec: &relay_envs::EnvSpec) -> Result<(), ConfigError> {
        let smallest = 3 * self.observation_bytes(spec) + MESSAGE_OVERHEAD;
        if smallest > relay_proto::MAX_MESSAGE_BYTES {
            return Err(invalid(
                "run.env_id",
                format!(
                    "{} has observations of {} bytes; one env step with its next and final observations ({smallest} bytes) does not fit in a NATS message (at most {} bytes)",
                    spec.id,
                    self.observation_bytes(spec),
                    relay_proto::MAX_MESSAGE_BYTES
                ),
            ));
        }
        Ok(())
    }

    /// About the largest message this run sends at its configured sizes:
    /// a fragment of `env_runner.fragment_steps` steps of
    /// `env_runner.num_envs` envs (observations not deduplicated, with
    /// their action masks and a recurrent policy's state, the next
    /// observations and one final observation per env), an act request of
    /// `num_envs` observations, and for DQN and SAC a minibatch of
    /// transitions. Only what relay's own nats-server is sized to
    /// ([`Self::nats_max_payload`]): senders measure what they send and
    /// divide what does not fit (`relay_proto::fit`), so nothing depends
    /// on this being right.
    pub fn largest_message_bytes(&self, spec: &relay_envs::EnvSpec) -> usize {
        let mask = if spec.action_mask && self.env.action_masks {
            spec.action_space.n().unwrap_or(0)
        } else {
            0
        };
        let obs = self.observation_bytes(spec) + mask;
        let action = spec.action_space.dim() * 8;
        let state = self.policy.state_width() * 4;
        let (steps, n) = (self.env_runner.fragment_steps, self.env_runner.num_envs);
        // Per env step: observation and mask, action (i64 or f32s),
        // logprob, value, reward, scaled reward, two flags.
        let fragment = steps * n * (obs + action + 18) + n * (2 * obs + state);
        let act = n * (obs + state);
        let batch = match self.run.algo {
            Algo::Dqn => self.dqn.batch_size,
            Algo::Sac => self.sac.batch_size,
            _ => 0,
        };
        // Per transition: observation and next observation, action, reward,
        // discount, importance weight, id, two flags.
        let transitions = batch * (2 * obs + action + 22);
        fragment.max(act).max(transitions) + MESSAGE_OVERHEAD
    }

    /// The `max_payload` relay's own nats-server is started with for this
    /// run: the largest message it sends ([`Self::largest_message_bytes`])
    /// rounded up to a whole MiB, at least nats-server's default of 1 MiB
    /// and at most the 64 MiB nats-server allows (past it, fragments are
    /// split to fit).
    pub fn nats_max_payload(&self, spec: &relay_envs::EnvSpec) -> usize {
        const MIB: usize = 1 << 20;
        self.largest_message_bytes(spec)
            .div_ceil(MIB)
            .saturating_mul(MIB)
            .clamp(
                relay_proto::DEFAULT_MAX_PAYLOAD,
                relay_proto::MAX_MESSAGE_BYTES,
            )
    }

    /// The spec of a built-in classic-control `run.env_id`; `None` for a
    /// text game or an env made through Python (validation asks no Python).
    pub(crate) fn builtin_env_spec(&self) -> Option<relay_envs::EnvSpec> {
        if self.env.uses_python(&self.run.env_id) {
            return None;
        }
        relay_envs::spec(&self.run.env_id).ok()
    }

    /// The config as YAML, as written into the run directory and checkpoints:
    /// passwords and tokens print as `***`, URLs lose their passwords.
    pub fn to_yaml(&self) -> String {
        serde_yaml::to_string(self).expect("config serializes")
    }
}
