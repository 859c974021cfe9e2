//! Experiment configuration: the schema of `configs/*.yaml`, layered loading
//! (file, then `RELAY__SECTION__FIELD` environment variables, then
//! `--set section.field=value` flags) and validation with errors that name
//! the field.
//!
//! Every service reads the same file and uses its own section, so one file
//! describes a whole run. Unknown fields are errors (a typo must not be
//! silently ignored).

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// Why a configuration was refused.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("config {origin}: {detail}")]
    Parse { origin: String, detail: String },
    #[error("override {key:?}: {detail}")]
    Override { key: String, detail: String },
    #[error("config field {field}: {detail}")]
    Invalid { field: String, detail: String },
}

fn invalid(field: &str, detail: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        field: field.to_string(),
        detail: detail.into(),
    }
}

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
    pub replay: ReplayConfig,
    #[serde(default)]
    pub ppo: PpoConfig,
    #[serde(default)]
    pub eval: EvalConfig,
    #[serde(default)]
    pub tracker: TrackerConfig,
}

/// What is trained, for how long, and where its files go.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RunConfig {
    /// Run id (`<env>-<algo>-<yyyymmdd-hhmmss>` when `relay up` makes it);
    /// scopes every NATS subject and Redis key. Usually given by `--run-id`.
    #[serde(default)]
    pub id: Option<String>,
    /// Gymnasium id of the environment, e.g. `CartPole-v1`.
    pub env_id: String,
    /// Algorithm name, used in run ids; only `ppo` for now.
    #[serde(default = "default_algo")]
    pub algo: String,
    /// Base seed; every service derives its own streams from it.
    #[serde(default = "default_seed")]
    pub seed: u64,
    /// Folder holding one directory per run.
    #[serde(default = "default_runs_dir")]
    pub runs_dir: PathBuf,
    /// Training budget in env steps consumed by the learner.
    #[serde(default = "default_total_env_steps")]
    pub total_env_steps: u64,
    /// Stop training once the evaluator reports the run solved.
    #[serde(default = "yes")]
    pub stop_when_solved: bool,
}

/// Where NATS and Redis are.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ConnectionsConfig {
    /// NATS server URL(s), comma-separated.
    pub nats_url: String,
    /// Redis URL (used by the replay-buffer only).
    pub redis_url: String,
    /// Time after which a request over NATS is retried.
    pub request_timeout_ms: u64,
}

impl Default for ConnectionsConfig {
    fn default() -> Self {
        Self {
            nats_url: "nats://127.0.0.1:4222".into(),
            redis_url: "redis://127.0.0.1:6379".into(),
            request_timeout_ms: 2000,
        }
    }
}

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
}

impl Default for PolicyConfig {
    fn default() -> Self {
        Self {
            hidden: vec![64, 64],
            activation: ActivationName::Tanh,
            init_log_std: 0.0,
        }
    }
}

/// env-runner settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct EnvRunnerConfig {
    /// Environments stepped together by each env-runner copy.
    pub num_envs: usize,
    /// Vector steps per rollout fragment sent to the replay buffer.
    pub fragment_steps: usize,
    /// Compute threads (candle/rayon) for this process.
    pub threads: usize,
}

impl Default for EnvRunnerConfig {
    fn default() -> Self {
        Self {
            num_envs: 8,
            fragment_steps: 32,
            threads: 1,
        }
    }
}

/// inference-server settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct InferenceConfig {
    /// Largest number of observations run in one forward pass.
    pub max_batch: usize,
    /// After taking every request already queued, how long a batch waits for
    /// more before the forward pass (0: never wait; right for few env-runners).
    pub batch_wait_us: u64,
    /// Compute threads (candle/rayon) for this process.
    pub threads: usize,
}

impl Default for InferenceConfig {
    fn default() -> Self {
        Self {
            max_batch: 512,
            batch_wait_us: 0,
            threads: 1,
        }
    }
}

/// replay-buffer settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ReplayConfig {
    /// Env steps the on-policy FIFO holds before refusing inserts (backpressure).
    pub capacity_steps: u64,
    /// Fragments acted by a policy more than this many versions behind the
    /// learner are dropped (and counted).
    pub max_policy_lag: u64,
    /// How long an env-runner waits before retrying a refused insert.
    pub retry_after_ms: u32,
}

impl Default for ReplayConfig {
    fn default() -> Self {
        Self {
            capacity_steps: 8192,
            max_policy_lag: 1,
            retry_after_ms: 5,
        }
    }
}

/// How a hyperparameter changes over training progress.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Schedule {
    /// Stays at its initial value.
    Constant,
    /// Falls linearly from its initial value to zero at the end of the budget.
    Linear,
}

impl Schedule {
    /// Value at `progress` in `[0, 1]` of the training budget.
    pub fn at(self, initial: f64, progress: f64) -> f64 {
        match self {
            Schedule::Constant => initial,
            Schedule::Linear => initial * (1.0 - progress.clamp(0.0, 1.0)),
        }
    }
}

/// PPO hyperparameters (names and defaults as Stable-Baselines3's where they exist).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PpoConfig {
    /// Env steps gathered (from any number of env-runners) per update.
    pub rollout_steps: usize,
    /// Env steps per gradient step.
    pub minibatch_size: usize,
    /// Passes over each rollout.
    pub epochs: usize,
    /// Discount factor.
    pub gamma: f64,
    /// GAE lambda: bias/variance trade-off of the advantage estimate.
    pub gae_lambda: f64,
    /// Initial learning rate of Adam.
    pub learning_rate: f64,
    /// Schedule of the learning rate over the budget.
    pub lr_schedule: Schedule,
    /// Initial PPO clip range for the probability ratio.
    pub clip_range: f64,
    /// Schedule of the clip range over the budget.
    pub clip_schedule: Schedule,
    /// Clip range of the value function around the old values; none disables it.
    pub clip_range_vf: Option<f64>,
    /// Entropy bonus coefficient.
    pub ent_coef: f64,
    /// Value loss coefficient.
    pub vf_coef: f64,
    /// Global gradient-norm clip.
    pub max_grad_norm: f64,
    /// Normalise advantages per minibatch.
    pub normalize_advantage: bool,
    /// Stop the epochs of an update early when approx KL exceeds 1.5x this.
    pub target_kl: Option<f64>,
    /// Adam epsilon.
    pub adam_eps: f64,
    /// Write a checkpoint every this many updates (and at stop).
    pub checkpoint_every: u64,
}

impl Default for PpoConfig {
    fn default() -> Self {
        Self {
            rollout_steps: 2048,
            minibatch_size: 64,
            epochs: 10,
            gamma: 0.99,
            gae_lambda: 0.95,
            learning_rate: 3e-4,
            lr_schedule: Schedule::Constant,
            clip_range: 0.2,
            clip_schedule: Schedule::Constant,
            clip_range_vf: None,
            ent_coef: 0.0,
            vf_coef: 0.5,
            max_grad_norm: 0.5,
            normalize_advantage: true,
            target_kl: None,
            adam_eps: 1e-5,
            checkpoint_every: 50,
        }
    }
}

/// evaluator settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct EvalConfig {
    /// Evaluate every this many weights versions (the newest is taken; others are skipped).
    pub every_versions: u64,
    /// Episodes per evaluation.
    pub episodes: usize,
    /// Seed of the eval episodes, distinct from the training seeds.
    pub seed: u64,
    /// Solved threshold on the mean eval return; defaults to the env's reward threshold.
    pub threshold: Option<f64>,
}

impl Default for EvalConfig {
    fn default() -> Self {
        Self {
            every_versions: 5,
            episodes: 20,
            seed: 1_000_003,
            threshold: None,
        }
    }
}

/// tracker settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TrackerConfig {
    /// Write metrics to `runs/<id>/metrics.jsonl`.
    pub write_metrics: bool,
    /// How often buffered metric lines are flushed to disk.
    pub flush_ms: u64,
}

impl Default for TrackerConfig {
    fn default() -> Self {
        Self {
            write_metrics: true,
            flush_ms: 500,
        }
    }
}

fn default_algo() -> String {
    "ppo".into()
}
fn default_seed() -> u64 {
    1
}
fn default_runs_dir() -> PathBuf {
    PathBuf::from("runs")
}
fn default_total_env_steps() -> u64 {
    1_000_000
}
fn yes() -> bool {
    true
}

/// Environment variables of this form override config fields:
/// `RELAY__PPO__LEARNING_RATE=0.0003` sets `ppo.learning_rate`.
pub const ENV_PREFIX: &str = "RELAY__";

impl ExperimentConfig {
    /// Loads a file, applies environment overrides, then `--set` overrides, and validates.
    pub fn load(path: &Path, overrides: &[String]) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        let env: Vec<(String, String)> = std::env::vars()
            .filter_map(|(k, v)| {
                k.strip_prefix(ENV_PREFIX)
                    .map(|rest| (rest.to_ascii_lowercase().replace("__", "."), v))
            })
            .collect();
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
        let config: ExperimentConfig =
            serde_yaml::from_value(value).map_err(|e| ConfigError::Parse {
                origin: origin.to_string(),
                detail: e.to_string(),
            })?;
        config.validate()?;
        Ok(config)
    }

    /// Checks ranges and cross-field constraints.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if let Some(id) = &self.run.id {
            relay_proto::validate_run_id(id).map_err(|e| invalid("run.id", e))?;
        }
        relay_envs::spec(&self.run.env_id).map_err(|e| invalid("run.env_id", e.to_string()))?;
        if self.run.algo != "ppo" {
            return Err(invalid(
                "run.algo",
                format!("unknown algorithm {:?}; known: ppo", self.run.algo),
            ));
        }
        if self.run.total_env_steps == 0 {
            return Err(invalid("run.total_env_steps", "must be positive"));
        }
        if self.policy.hidden.is_empty() || self.policy.hidden.contains(&0) {
            return Err(invalid(
                "policy.hidden",
                "needs at least one layer, each wider than 0",
            ));
        }
        positive("env_runner.num_envs", self.env_runner.num_envs)?;
        positive("env_runner.fragment_steps", self.env_runner.fragment_steps)?;
        positive("env_runner.threads", self.env_runner.threads)?;
        positive("inference.max_batch", self.inference.max_batch)?;
        positive("inference.threads", self.inference.threads)?;
        if self.replay.capacity_steps < self.ppo.rollout_steps as u64 {
            return Err(invalid(
                "replay.capacity_steps",
                format!(
                    "{} is smaller than ppo.rollout_steps ({}): the learner could never gather a rollout",
                    self.replay.capacity_steps, self.ppo.rollout_steps
                ),
            ));
        }
        let p = &self.ppo;
        positive("ppo.rollout_steps", p.rollout_steps)?;
        positive("ppo.minibatch_size", p.minibatch_size)?;
        positive("ppo.epochs", p.epochs)?;
        unit_interval("ppo.gamma", p.gamma)?;
        unit_interval("ppo.gae_lambda", p.gae_lambda)?;
        positive_f("ppo.learning_rate", p.learning_rate)?;
        positive_f("ppo.clip_range", p.clip_range)?;
        if let Some(v) = p.clip_range_vf {
            positive_f("ppo.clip_range_vf", v)?;
        }
        non_negative_f("ppo.ent_coef", p.ent_coef)?;
        non_negative_f("ppo.vf_coef", p.vf_coef)?;
        positive_f("ppo.max_grad_norm", p.max_grad_norm)?;
        positive_f("ppo.adam_eps", p.adam_eps)?;
        if let Some(v) = p.target_kl {
            positive_f("ppo.target_kl", v)?;
        }
        positive("ppo.checkpoint_every", p.checkpoint_every as usize)?;
        positive("eval.episodes", self.eval.episodes)?;
        positive("eval.every_versions", self.eval.every_versions as usize)?;
        if let Some(t) = self.eval.threshold {
            if !t.is_finite() {
                return Err(invalid("eval.threshold", "must be finite"));
            }
        }
        Ok(())
    }

    /// The run id, which every service needs.
    pub fn run_id(&self) -> Result<&str, ConfigError> {
        self.run
            .id
            .as_deref()
            .ok_or_else(|| invalid("run.id", "no run id: pass --run-id or set RELAY_RUN_ID"))
    }

    /// Solved threshold: `eval.threshold`, else the env's reward threshold.
    pub fn solved_threshold(&self) -> Option<f64> {
        self.eval.threshold.or_else(|| {
            relay_envs::spec(&self.run.env_id)
                .ok()
                .and_then(|s| s.reward_threshold)
        })
    }

    /// The config as YAML, as written into the run directory.
    pub fn to_yaml(&self) -> String {
        serde_yaml::to_string(self).expect("config serializes")
    }
}

fn positive(field: &str, v: usize) -> Result<(), ConfigError> {
    if v == 0 {
        return Err(invalid(field, "must be positive, got 0"));
    }
    Ok(())
}

fn positive_f(field: &str, v: f64) -> Result<(), ConfigError> {
    if !(v.is_finite() && v > 0.0) {
        return Err(invalid(
            field,
            format!("must be a positive number, got {v}"),
        ));
    }
    Ok(())
}

fn non_negative_f(field: &str, v: f64) -> Result<(), ConfigError> {
    if !(v.is_finite() && v >= 0.0) {
        return Err(invalid(field, format!("must be >= 0, got {v}")));
    }
    Ok(())
}

fn unit_interval(field: &str, v: f64) -> Result<(), ConfigError> {
    if !(0.0..=1.0).contains(&v) {
        return Err(invalid(field, format!("must be in [0, 1], got {v}")));
    }
    Ok(())
}

/// Sets `a.b.c` in a YAML mapping to `raw` parsed as a YAML scalar.
fn set_dotted(root: &mut serde_yaml::Value, key: &str, raw: &str) -> Result<(), ConfigError> {
    let parsed: serde_yaml::Value =
        serde_yaml::from_str(raw).map_err(|e| ConfigError::Override {
            key: key.to_string(),
            detail: e.to_string(),
        })?;
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

#[cfg(test)]
mod tests {
    use super::*;

    const BASE: &str = "run:\n  env_id: CartPole-v1\nppo:\n  rollout_steps: 256\n";

    #[test]
    fn applies_env_then_flag_overrides() {
        let c = ExperimentConfig::from_layers(
            BASE,
            "test",
            &[("ppo.learning_rate".into(), "0.01".into())],
            &["ppo.learning_rate=0.02".into(), "run.id=abc".into()],
        )
        .unwrap();
        assert_eq!(c.ppo.learning_rate, 0.02);
        assert_eq!(c.run.id.as_deref(), Some("abc"));
    }

    #[test]
    fn a_typo_names_the_field() {
        let err = ExperimentConfig::from_layers(BASE, "test", &[], &["ppo.learnin_rate=1".into()])
            .unwrap_err()
            .to_string();
        assert!(err.contains("learnin_rate"), "{err}");
    }

    #[test]
    fn bad_values_name_the_field() {
        let err = ExperimentConfig::from_layers(BASE, "t", &[], &["ppo.gamma=1.5".into()])
            .unwrap_err()
            .to_string();
        assert!(err.contains("ppo.gamma"), "{err}");
        let err = ExperimentConfig::from_layers(BASE, "t", &[], &["run.env_id=Nope-v0".into()])
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("run.env_id") && err.contains("Nope-v0"),
            "{err}"
        );
        let err = ExperimentConfig::from_layers(BASE, "t", &[], &["run.id=a.b".into()])
            .unwrap_err()
            .to_string();
        assert!(err.contains("run.id"), "{err}");
    }

    #[test]
    fn shipped_configs_load() {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../../configs");
        let mut seen = 0;
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            let name = path.file_name().unwrap().to_string_lossy().to_string();
            if name.ends_with(".yaml") && name != "metrics.yaml" {
                ExperimentConfig::load(&path, &[]).unwrap_or_else(|e| panic!("{name}: {e}"));
                seen += 1;
            }
        }
        assert!(seen > 0, "no experiment configs found in {dir}");
    }
}
