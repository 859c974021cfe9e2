//! Experiment configuration: the schema of `configs/*.yaml`, layered loading
//! (file, then `RELAY__SECTION__FIELD` environment variables, then
//! `--set section.field=value` flags) and validation with errors that name
//! the field.
//!
//! Every service reads the same file and uses its own section, so one file
//! describes a whole run. Unknown fields are errors (a typo must not be
//! silently ignored).

use std::path::{Path, PathBuf};

use relay_bridge::EnvSection;
use relay_nn::{Schedule, Shape, TrunkLayout};
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
    pub llm: LlmConfig,
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
    #[serde(default)]
    pub normalize: NormalizeSection,
    /// Where `run.env_id` comes from (built in, or Gymnasium through Python
    /// workers) and how it is made.
    #[serde(default)]
    pub env: EnvSection,
}

/// What is trained, for how long, and where its files go.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RunConfig {
    /// Run id (`<env>-<algo>-<yyyymmdd-hhmmss>` when `relay up` makes it);
    /// scopes every NATS subject and Redis key. Usually given by `--run-id`.
    #[serde(default)]
    pub id: Option<String>,
    /// Id of the environment: a Gymnasium classic-control id (`CartPole-v1`,
    /// ...) or a text game (`TicTacToe-v0`, `ConnectFour-v0`,
    /// `KuhnPoker-v0`, `GuessTheNumber-v0`: the env-runners play games
    /// with the LLM policy, see the `text` section).
    pub env_id: String,
    /// Algorithm of classic-control runs: `ppo`, `a2c`, `reinforce`, `dqn`
    /// (discrete actions) or `sac` (continuous actions), each
    /// configured by its own section; used in run ids (text games train
    /// with the `rl` section, whose preset names them).
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
    /// Resume this run from a checkpoint folder (`runs/<id>/checkpoints/<n>`):
    /// the learner loads the model, optimizer (unless `reset_optimizer`),
    /// counters and RNG from it, and publishes weights versions above every
    /// version published before. `relay up --resume` sets it.
    #[serde(default)]
    pub resume_from: Option<PathBuf>,
    /// Start a new run from the weights of another run's checkpoint folder
    /// (shape-checked; counters start at zero). `relay up --init-from` sets it.
    #[serde(default)]
    pub init_from: Option<PathBuf>,
    /// With `resume_from` or `init_from`: do not load the optimizer state
    /// (Adam starts afresh).
    #[serde(default)]
    pub reset_optimizer: bool,
}

/// A credential (password, token) read from the config or the environment.
///
/// It never shows itself: `Debug`, `Display` and `Serialize` print `***`, so
/// the resolved config that the tracker writes into the run directory and
/// the learner into each checkpoint, and every log line, hold no secret.
/// Reading a written config back therefore gives `***`: supply secrets again
/// through the environment (`RELAY_NATS_PASSWORD`, ...). [`Secret::expose`]
/// is the one way to the value.
#[derive(Clone, PartialEq, Eq, Deserialize)]
#[serde(transparent)]
pub struct Secret(String);

impl Secret {
    /// What every redacted value prints as.
    pub const REDACTED: &'static str = "***";

    pub fn new(value: impl Into<String>) -> Self {
        Self(value.into())
    }

    /// The secret itself, for the one place that hands it to a client.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(Self::REDACTED)
    }
}

impl std::fmt::Display for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(Self::REDACTED)
    }
}

impl Serialize for Secret {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(Self::REDACTED)
    }
}

/// A URL (or a comma-separated list of them) with the password of any
/// `user:password@` part replaced by `***`, and a lone `token@` too; for logs
/// and written configs.
pub fn redact_url(url: &str) -> String {
    url.split(',')
        .map(|one| {
            let Some((scheme, rest)) = one.split_once("://") else {
                return one.to_string();
            };
            let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
            let (authority, tail) = rest.split_at(authority_end);
            let Some((userinfo, host)) = authority.rsplit_once('@') else {
                return one.to_string();
            };
            let userinfo = match userinfo.split_once(':') {
                Some((user, _)) => format!("{user}:{}", Secret::REDACTED),
                None => Secret::REDACTED.to_string(),
            };
            format!("{scheme}://{userinfo}@{host}{tail}")
        })
        .collect::<Vec<_>>()
        .join(",")
}

fn serialize_redacted_url<S: serde::Serializer>(url: &str, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&redact_url(url))
}

/// Where NATS and Redis are, and how to authenticate to them.
///
/// Secrets may sit in the file, but are better given by the environment:
/// `RELAY_NATS_PASSWORD`, `RELAY_NATS_TOKEN`, `RELAY_REDIS_PASSWORD`, or any
/// field as `RELAY__CONNECTIONS__<FIELD>` (e.g. `RELAY__CONNECTIONS__NATS_USER`).
/// Passwords and tokens are [`Secret`]s and URLs are redacted wherever the
/// config is printed or written.
#[derive(Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ConnectionsConfig {
    /// NATS server URL(s), comma-separated.
    #[serde(serialize_with = "serialize_redacted_url")]
    pub nats_url: String,
    /// NATS user name (user/password authentication); needs `nats_password`.
    pub nats_user: Option<String>,
    /// NATS password of `nats_user` (env: `RELAY_NATS_PASSWORD`).
    pub nats_password: Option<Secret>,
    /// NATS authentication token, instead of a user (env: `RELAY_NATS_TOKEN`).
    pub nats_token: Option<Secret>,
    /// NATS credentials file (JWT and nkey seed, as `nsc` writes it), instead
    /// of a user or a token.
    pub nats_creds_file: Option<PathBuf>,
    /// PEM file of the CA(s) that signed the NATS server's certificate
    /// (implies TLS).
    pub nats_tls_ca: Option<PathBuf>,
    /// PEM client certificate for mutual TLS; needs `nats_tls_key`.
    pub nats_tls_cert: Option<PathBuf>,
    /// PEM private key of `nats_tls_cert`.
    pub nats_tls_key: Option<PathBuf>,
    /// Refuse to talk to NATS without TLS.
    pub nats_tls_required: bool,
    /// Redis URL (used by the replay-buffer only); may carry a password
    /// (`redis://:password@host:6379` or `redis://user:password@host:6379`).
    #[serde(serialize_with = "serialize_redacted_url")]
    pub redis_url: String,
    /// Redis password (`requirepass`/ACL), when the URL carries none
    /// (env: `RELAY_REDIS_PASSWORD`).
    pub redis_password: Option<Secret>,
    /// Time after which a request over NATS is retried.
    pub request_timeout_ms: u64,
}

impl Default for ConnectionsConfig {
    fn default() -> Self {
        Self {
            nats_url: "nats://127.0.0.1:4222".into(),
            nats_user: None,
            nats_password: None,
            nats_token: None,
            nats_creds_file: None,
            nats_tls_ca: None,
            nats_tls_cert: None,
            nats_tls_key: None,
            nats_tls_required: false,
            redis_url: "redis://127.0.0.1:6379".into(),
            redis_password: None,
            request_timeout_ms: 2000,
        }
    }
}

impl std::fmt::Debug for ConnectionsConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConnectionsConfig")
            .field("nats_url", &redact_url(&self.nats_url))
            .field("nats_user", &self.nats_user)
            .field("nats_password", &self.nats_password)
            .field("nats_token", &self.nats_token)
            .field("nats_creds_file", &self.nats_creds_file)
            .field("nats_tls_ca", &self.nats_tls_ca)
            .field("nats_tls_cert", &self.nats_tls_cert)
            .field("nats_tls_key", &self.nats_tls_key)
            .field("nats_tls_required", &self.nats_tls_required)
            .field("redis_url", &redact_url(&self.redis_url))
            .field("redis_password", &self.redis_password)
            .field("request_timeout_ms", &self.request_timeout_ms)
            .finish()
    }
}

impl ConnectionsConfig {
    /// Checks that the credentials given make one complete NATS
    /// authentication method and one Redis password.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let empty = |field: &str, v: Option<&str>| match v {
            Some("") => Err(invalid(field, "must not be empty when set")),
            _ => Ok(()),
        };
        fn path_str(p: &Option<PathBuf>) -> Option<&str> {
            p.as_ref().map(|p| p.to_str().unwrap_or("?"))
        }
        empty("connections.nats_user", self.nats_user.as_deref())?;
        empty(
            "connections.nats_password",
            self.nats_password.as_ref().map(Secret::expose),
        )?;
        empty(
            "connections.nats_token",
            self.nats_token.as_ref().map(Secret::expose),
        )?;
        empty(
            "connections.redis_password",
            self.redis_password.as_ref().map(Secret::expose),
        )?;
        empty(
            "connections.nats_creds_file",
            path_str(&self.nats_creds_file),
        )?;
        empty("connections.nats_tls_ca", path_str(&self.nats_tls_ca))?;
        empty("connections.nats_tls_cert", path_str(&self.nats_tls_cert))?;
        empty("connections.nats_tls_key", path_str(&self.nats_tls_key))?;
        if self.nats_url.trim().is_empty() {
            return Err(invalid("connections.nats_url", "must not be empty"));
        }
        match (&self.nats_user, &self.nats_password) {
            (Some(_), None) => {
                return Err(invalid(
                    "connections.nats_password",
                    "connections.nats_user is set but no password is (set RELAY_NATS_PASSWORD)",
                ))
            }
            (None, Some(_)) => {
                return Err(invalid(
                    "connections.nats_user",
                    "connections.nats_password is set but no user is",
                ))
            }
            _ => {}
        }
        let methods = [
            self.nats_user.is_some().then_some("nats_user"),
            self.nats_token.is_some().then_some("nats_token"),
            self.nats_creds_file.is_some().then_some("nats_creds_file"),
        ];
        let methods: Vec<&str> = methods.into_iter().flatten().collect();
        if methods.len() > 1 {
            return Err(invalid(
                &format!("connections.{}", methods[1]),
                format!(
                    "NATS takes one authentication method; {} are set",
                    methods.join(" and ")
                ),
            ));
        }
        match (&self.nats_tls_cert, &self.nats_tls_key) {
            (Some(_), None) => {
                return Err(invalid(
                    "connections.nats_tls_key",
                    "connections.nats_tls_cert is set but its key is not",
                ))
            }
            (None, Some(_)) => {
                return Err(invalid(
                    "connections.nats_tls_cert",
                    "connections.nats_tls_key is set but no certificate is",
                ))
            }
            _ => {}
        }
        if self.redis_password.is_some() && url_has_password(&self.redis_url) {
            return Err(invalid(
                "connections.redis_password",
                "connections.redis_url already carries a password; give it once",
            ));
        }
        Ok(())
    }
}

fn url_has_password(url: &str) -> bool {
    redact_url(url) != url
}

/// Conventional environment variables for secrets, beside `RELAY__*`.
pub const SECRET_ENV_VARS: [(&str, &str); 3] = [
    ("RELAY_NATS_PASSWORD", "connections.nats_password"),
    ("RELAY_NATS_TOKEN", "connections.nats_token"),
    ("RELAY_REDIS_PASSWORD", "connections.redis_password"),
];

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
    /// Whether the actor and the critic share their hidden layers
    /// (`separate`, SB3's `MlpPolicy` default, or `shared`).
    pub trunk: TrunkLayout,
    /// A convolutional features extractor for image observations, shared by
    /// actor and critic (`cnn: {}` is SB3's NatureCNN; `conv` and
    /// `features_dim` change it). Its input shape comes from the env. With a
    /// CNN, `hidden: []` (SB3's `CnnPolicy`) puts the heads right on its
    /// features. PPO and A2C.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cnn: Option<relay_nn::CnnSpec>,
}

impl Default for PolicyConfig {
    fn default() -> Self {
        Self {
            hidden: vec![64, 64],
            activation: ActivationName::Tanh,
            init_log_std: 0.0,
            trunk: TrunkLayout::Separate,
            cnn: None,
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

/// How the inference server holds a GGUF model's weights (see
/// `relay_llm::GgufBase`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase", try_from = "String")]
pub enum GgufBaseName {
    /// Quantized blocks in memory, dequantized for each product: the least
    /// memory, slower decode steps.
    Quantized,
    /// Dequantized to f32 once at load: about 4x the memory of Q4, the
    /// fastest decode steps on a CPU.
    Dequantized,
}

impl TryFrom<String> for GgufBaseName {
    type Error = String;
    /// serde's own error would not name the field.
    fn try_from(value: String) -> Result<Self, String> {
        match value.as_str() {
            "quantized" => Ok(Self::Quantized),
            "dequantized" => Ok(Self::Dequantized),
            other => Err(format!(
                "llm.gguf_base: {other:?} is neither `quantized` nor `dequantized`"
            )),
        }
    }
}

/// The LLM the inference server serves on `relay.<run>.generate` (text
/// games): the base model, its adapters and the continuous batch.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LlmConfig {
    /// The base model: a Hugging Face folder (`config.json`,
    /// `model.safetensors`, `tokenizer.json`; e.g. one written by `relay
    /// model init tiny`), a `.gguf` file, or `smollm2` for
    /// SmolLM2-135M-Instruct as `deploy/install.sh` installs it. Unset: no
    /// `generate` endpoint unless `run.env_id` is a text game (then it is
    /// required).
    pub model: Option<String>,
    /// How a GGUF model's weights are held (ignored for other models).
    pub gguf_base: GgufBaseName,
    /// Most sequences decoded together (the continuous batch); requests
    /// beyond it wait in a queue and join as others finish.
    pub max_sequences: usize,
    /// Most generate requests waiting for a place in the continuous batch;
    /// a request arriving when this many wait is refused at once with a
    /// 503 service error "queue full (N waiting)"
    /// (`relay_llm_queue_full_total`) instead of waiting without bound.
    pub max_queue: usize,
    /// Most LoRA adapters (name, version) kept loaded; the least recently
    /// used is dropped past it and reloaded from its source when asked for.
    pub max_adapters: usize,
    /// Fixed adapters (e.g. opponents), name -> PEFT adapter folder;
    /// served as version 0 of that name.
    pub adapters: std::collections::BTreeMap<String, PathBuf>,
    /// Compute threads (candle/rayon) of the inference server when it serves
    /// an LLM (it then replaces `inference.threads`).
    pub threads: usize,
    /// Recent prompts whose keys and values are kept, so a new prompt that
    /// shares a prefix of 16 tokens or more with one (a game's
    /// instructions, the earlier turns of a game) prefills only the rest;
    /// 0 disables it. Memory: prompt tokens x layers x 2 x kv width x 4 bytes
    /// each (SmolLM2: 46 KB per token).
    pub prefix_cache: usize,
    /// What computes the LLM, in the inference servers and the learner of a
    /// text run: `engine` (the tuned CPU engine, f32), `candle` (candle
    /// tensor ops on `device` in `dtype`: the path to a GPU), or `auto`
    /// (the default: the engine for f32 on the CPU, candle otherwise, so
    /// `llm.device: cuda` alone is enough).
    pub backend: relay_llm::BackendKind,
    /// Where the `candle` backend computes: `cpu`, `cuda` (GPU 0) or
    /// `cuda:N`; CUDA needs a build with the `cuda` feature (`just
    /// build-cuda`) and the NVIDIA driver.
    pub device: relay_llm::DeviceSpec,
    /// The `candle` backend's weights and matmuls: `f32`, `bf16` or `f16`
    /// (norms, softmax and logits stay f32).
    pub dtype: relay_llm::LlmDtype,
}

impl Default for LlmConfig {
    fn default() -> Self {
        Self {
            model: None,
            gguf_base: GgufBaseName::Dequantized,
            max_sequences: 32,
            max_queue: 256,
            max_adapters: 8,
            adapters: Default::default(),
            threads: 2,
            prefix_cache: 16,
            backend: Default::default(),
            device: Default::default(),
            dtype: Default::default(),
        }
    }
}

impl LlmConfig {
    /// The inference backend the config asks for.
    pub fn backend_spec(&self) -> relay_llm::BackendSpec {
        relay_llm::BackendSpec {
            kind: self.backend,
            device: self.device,
            dtype: self.dtype,
        }
    }

    fn validate(&self) -> Result<(), ConfigError> {
        self.backend_spec()
            .validate()
            .map_err(|e| invalid(e.field, e.detail))?;
        if let Some(model) = &self.model {
            if model.trim().is_empty() {
                return Err(invalid(
                    "llm.model",
                    "is empty; give a model folder, a .gguf file or `smollm2`",
                ));
            }
        }
        positive("llm.max_sequences", self.max_sequences)?;
        positive("llm.max_queue", self.max_queue)?;
        positive("llm.max_adapters", self.max_adapters)?;
        positive("llm.threads", self.threads)?;
        for (name, path) in &self.adapters {
            if name.is_empty() || name.chars().any(char::is_whitespace) {
                return Err(invalid(
                    "llm.adapters",
                    format!("adapter name {name:?} must be non-empty without spaces"),
                ));
            }
            if path.as_os_str().is_empty() {
                return Err(invalid(
                    &format!("llm.adapters.{name}"),
                    "is empty; give a PEFT adapter folder",
                ));
            }
        }
        Ok(())
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
    /// Rate limiter (as Reverb's `SampleToInsertRatio`): env steps taken out
    /// per env step inserted (DQN's off-policy table: transitions sampled
    /// per env step inserted; `rate_error_buffer` then counts samples). None disables it (the FIFO's capacity and the
    /// policy lag still bound the data). With it, an insert is refused
    /// ("rate") while `inserted * ratio - taken` would exceed
    /// `ratio * min_size_to_sample + rate_error_buffer`, and a sample takes
    /// nothing while fewer than `min_size_to_sample` steps were inserted or
    /// `inserted * ratio - taken` is under `ratio * min_size_to_sample -
    /// rate_error_buffer`. Taken counts sampled and stale-dropped steps.
    pub samples_per_insert: Option<f64>,
    /// Env steps inserted before the learner may sample (rate limiter).
    pub min_size_to_sample: u64,
    /// Slack of the rate limiter, in env steps.
    pub rate_error_buffer: u64,
    /// Text runs: games that ended more than this many seconds before the
    /// learner samples them are dropped (counted as `too_old`) whatever
    /// their adapter version: the bound in time beside `max_policy_lag`'s
    /// in versions (slow learners, stalled runs, a queue of old games
    /// after a restart). None: versions only.
    pub max_age_s: Option<f64>,
}

impl Default for ReplayConfig {
    fn default() -> Self {
        Self {
            capacity_steps: 8192,
            max_policy_lag: 1,
            retry_after_ms: 5,
            samples_per_insert: None,
            min_size_to_sample: 0,
            rate_error_buffer: 8192,
            max_age_s: None,
        }
    }
}

/// The older, one-word spelling of a schedule, kept so configs written
/// before schedules could be given in place still load: `linear` turns the
/// field's constant value `v` into `{kind: linear, start: v, end: 0}`
/// (SB3's `linear_schedule`). A field written as a schedule map already
/// says how it changes; combining it with `linear` is an error.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ScheduleShorthand {
    /// The field's schedule as written.
    #[default]
    Constant,
    /// The field's constant value falls linearly to zero at the end of the budget.
    Linear,
}

impl ScheduleShorthand {
    /// The schedule `written` after applying the shorthand.
    pub fn apply(self, written: &Schedule) -> Schedule {
        match (self, &written.shape) {
            (ScheduleShorthand::Linear, Shape::Constant { value }) => Schedule {
                shape: Shape::Linear {
                    start: *value,
                    end: 0.0,
                },
                ..written.clone()
            },
            _ => written.clone(),
        }
    }
}

/// PPO hyperparameters (names and defaults as Stable-Baselines3's where they exist).
///
/// `learning_rate`, `clip_range` and `ent_coef` are [`Schedule`]s over
/// training progress `env_steps / run.total_env_steps`: a bare number is a
/// constant, a map gives the shape (`{kind: cosine, start: 1e-3, end: 0,
/// warmup: {fraction: 0.05}}`; kinds `constant`, `linear`, `cosine`,
/// `exponential`, `piecewise_linear`, with optional `warmup` and `offset`,
/// see [`relay_nn::schedule`]).
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
    /// Learning rate of Adam (a schedule over training progress).
    pub learning_rate: Schedule,
    /// Shorthand schedule of a constant `learning_rate` (`constant` or
    /// `linear` to zero); see [`ScheduleShorthand`].
    pub lr_schedule: ScheduleShorthand,
    /// PPO clip range for the probability ratio (a schedule).
    pub clip_range: Schedule,
    /// Shorthand schedule of a constant `clip_range`; see [`ScheduleShorthand`].
    pub clip_schedule: ScheduleShorthand,
    /// Clip range of the value function around the old values; none disables it.
    pub clip_range_vf: Option<f64>,
    /// Entropy bonus coefficient (a schedule).
    pub ent_coef: Schedule,
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
    /// Write a checkpoint every this many updates (and at stop, at the first
    /// eval and at each new best eval mean).
    pub checkpoint_every: u64,
    /// Numbered checkpoints kept: the newest this many, plus the pinned ones
    /// (`checkpoints/pinned.json`) and the best; older ones are removed.
    pub keep_checkpoints: usize,
}

impl Default for PpoConfig {
    fn default() -> Self {
        Self {
            rollout_steps: 2048,
            minibatch_size: 64,
            epochs: 10,
            gamma: 0.99,
            gae_lambda: 0.95,
            learning_rate: Schedule::constant(3e-4),
            lr_schedule: ScheduleShorthand::Constant,
            clip_range: Schedule::constant(0.2),
            clip_schedule: ScheduleShorthand::Constant,
            clip_range_vf: None,
            ent_coef: Schedule::constant(0.0),
            vf_coef: 0.5,
            max_grad_norm: 0.5,
            normalize_advantage: true,
            target_kl: None,
            adam_eps: 1e-5,
            checkpoint_every: 50,
            keep_checkpoints: 5,
        }
    }
}

impl PpoConfig {
    /// The learning rate's schedule, `lr_schedule` applied.
    pub fn learning_rate_schedule(&self) -> Schedule {
        self.lr_schedule.apply(&self.learning_rate)
    }

    /// The clip range's schedule, `clip_schedule` applied.
    pub fn clip_range_schedule(&self) -> Schedule {
        self.clip_schedule.apply(&self.clip_range)
    }
}

/// A2C hyperparameters (Stable-Baselines3's `A2C`: names and defaults).
///
/// Each update is one gradient step on `n_steps` vector steps of every env
/// of one env-runner (`n_steps x env_runner.num_envs` env steps), with
/// `gae_lambda`-returns bootstrapped from the critic at the fragment's end
/// and through time-limit truncations, never through terminations.
/// `learning_rate` and `ent_coef` are [`Schedule`]s (see [`PpoConfig`]).
/// Whether actor and critic share their hidden layers is `policy.trunk`
/// (SB3's A2C `MlpPolicy` default: separate).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct A2cConfig {
    /// Vector steps per env per update (SB3 `n_steps`); must equal
    /// `env_runner.fragment_steps`, so each fragment is one rollout.
    pub n_steps: usize,
    /// Discount factor.
    pub gamma: f64,
    /// GAE lambda; `1.0` gives plain n-step returns (SB3's default).
    pub gae_lambda: f64,
    /// Learning rate (a schedule over training progress).
    pub learning_rate: Schedule,
    /// Entropy bonus coefficient (a schedule).
    pub ent_coef: Schedule,
    /// Value loss coefficient.
    pub vf_coef: f64,
    /// Global gradient-norm clip.
    pub max_grad_norm: f64,
    /// Normalise advantages over each update's batch.
    pub normalize_advantage: bool,
    /// Optimise with RMSprop (SB3's default); otherwise Adam.
    pub use_rms_prop: bool,
    /// RMSprop's decay of the running mean of squared gradients.
    pub rms_prop_alpha: f64,
    /// RMSprop epsilon (added to the root-mean-square).
    pub rms_prop_eps: f64,
    /// Adam epsilon (with `use_rms_prop: false`; SB3 sets 1e-5 for Adam).
    pub adam_eps: f64,
    /// Write a checkpoint every this many updates (and at stop, at the first
    /// eval and at each new best eval mean).
    pub checkpoint_every: u64,
    /// Numbered checkpoints kept besides the pinned ones and the best.
    pub keep_checkpoints: usize,
}

impl Default for A2cConfig {
    fn default() -> Self {
        Self {
            n_steps: 5,
            gamma: 0.99,
            gae_lambda: 1.0,
            learning_rate: Schedule::constant(7e-4),
            ent_coef: Schedule::constant(0.0),
            vf_coef: 0.5,
            max_grad_norm: 0.5,
            normalize_advantage: false,
            use_rms_prop: true,
            rms_prop_alpha: 0.99,
            rms_prop_eps: 1e-5,
            adam_eps: 1e-5,
            checkpoint_every: 1000,
            keep_checkpoints: 5,
        }
    }
}

/// The baseline REINFORCE subtracts from the returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Baseline {
    /// The critic's value `V(s_t)`, trained towards the returns alongside.
    #[default]
    Value,
    /// No baseline: the policy gradient weighs log-probabilities by the
    /// returns themselves (the critic is not trained).
    None,
}

/// REINFORCE hyperparameters: Monte-Carlo returns over whole episodes.
///
/// The learner assembles each env's episodes from consecutive fragments
/// and trains, one gradient step with Adam, once `batch_episodes` of them
/// have ended. An episode cut by a time limit bootstraps its last return
/// from the critic's value of the final observation (with `baseline:
/// value`; without a trained critic, from 0); a terminated one never does.
/// Steps acted more than `replay.max_policy_lag` versions ago are left out
/// (their returns stay exact: returns look forward only).
/// `learning_rate` and `ent_coef` are [`Schedule`]s (see [`PpoConfig`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ReinforceConfig {
    /// Completed episodes per update.
    pub batch_episodes: usize,
    /// Discount factor.
    pub gamma: f64,
    /// Learning rate of Adam (a schedule over training progress).
    pub learning_rate: Schedule,
    /// What is subtracted from the returns: `value` or `none`.
    pub baseline: Baseline,
    /// Entropy bonus coefficient (a schedule).
    pub ent_coef: Schedule,
    /// Value loss coefficient (with `baseline: value`).
    pub vf_coef: f64,
    /// Global gradient-norm clip; none disables it (classic REINFORCE).
    pub max_grad_norm: Option<f64>,
    /// Normalise `returns - baseline` over each update's batch.
    pub normalize_advantage: bool,
    /// Adam epsilon.
    pub adam_eps: f64,
    /// Write a checkpoint every this many updates (and at stop, at the first
    /// eval and at each new best eval mean).
    pub checkpoint_every: u64,
    /// Numbered checkpoints kept besides the pinned ones and the best.
    pub keep_checkpoints: usize,
}

impl Default for ReinforceConfig {
    fn default() -> Self {
        Self {
            batch_episodes: 8,
            gamma: 0.99,
            learning_rate: Schedule::constant(1e-3),
            baseline: Baseline::Value,
            ent_coef: Schedule::constant(0.0),
            vf_coef: 0.5,
            max_grad_norm: None,
            normalize_advantage: true,
            adam_eps: 1e-8,
            checkpoint_every: 100,
            keep_checkpoints: 5,
        }
    }
}

/// Running observation and reward normalisation of classic-control runs,
/// as Stable-Baselines3's `VecNormalize` (same formulas, names and
/// defaults; [`relay_nn::VecNormalize`]). Off by default: with `obs` and
/// `reward` both false nothing is normalised and no statistics travel.
///
/// Each env-runner normalises what its envs return with the statistics of
/// the newest weights version plus what it has seen since, gathers the
/// statistics of its raw observations and discounted returns, and ships
/// them with each fragment; the learner merges them into the run's
/// statistics, which travel with every weights version and are saved in
/// checkpoints (`vec_normalize.safetensors`). Evaluation uses the version's
/// statistics frozen and reports raw returns.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct NormalizeSection {
    /// Normalise observations: `clip((obs - mean) / sqrt(var + epsilon),
    /// -clip_obs, clip_obs)` with the running mean and variance of the raw
    /// observations. Default `false`.
    pub obs: bool,
    /// Scale rewards by the running std of each env's discounted return
    /// (`ret = ret * gamma + reward`, reset when an episode ends by
    /// termination or truncation), clipped to `±clip_reward`; never
    /// shifted. The learner trains on the scaled rewards; episode returns
    /// and evaluations stay raw. Default `false`.
    pub reward: bool,
    /// Bound of normalised observations. Default `10`.
    pub clip_obs: f64,
    /// Bound of scaled rewards. Default `10`.
    pub clip_reward: f64,
    /// Discount of the running return that scales rewards; unset: the
    /// algorithm's own (`ppo.gamma`, `a2c.gamma` or `reinforce.gamma`), as
    /// rl-zoo does.
    pub gamma: Option<f64>,
    /// Added to the variance before the square root. Default `1e-8`.
    pub epsilon: f64,
}

impl Default for NormalizeSection {
    fn default() -> Self {
        Self {
            obs: false,
            reward: false,
            clip_obs: 10.0,
            clip_reward: 10.0,
            gamma: None,
            epsilon: 1e-8,
        }
    }
}

/// DQN hyperparameters (names and defaults as Stable-Baselines3's `DQN`;
/// prioritized replay as Schaul et al. 2016, proportional variant).
///
/// The env-runners' fragments become transitions in the replay-buffer's
/// off-policy table (`relay:<run>:offpolicy:*`, at most `buffer_size`,
/// oldest evicted first), with `n_steps`-step returns computed at insert.
/// Once more than `learning_starts` env steps were inserted, the learner
/// takes `gradient_steps` gradient steps of `batch_size` transitions per
/// `train_freq` env steps inserted, updates the target network every
/// `target_update_interval` env steps and publishes a weights version
/// after each round. The inference servers act epsilon-greedily with the
/// `exploration_*` schedule at the published version's env steps; the
/// evaluator acts greedily. Network widths and activation come from
/// `policy.hidden` and `policy.activation`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DqnConfig {
    /// Learning rate of Adam (a schedule over training progress). SB3: 1e-4.
    pub learning_rate: Schedule,
    /// Transitions the off-policy table holds; past it the oldest are evicted. SB3: 1,000,000.
    pub buffer_size: u64,
    /// Env steps inserted before the first gradient step. SB3: 100.
    pub learning_starts: u64,
    /// Transitions per gradient step. SB3: 32.
    pub batch_size: usize,
    /// Target network update coefficient: 1 copies the online network (hard
    /// update), below 1 is a Polyak average. SB3: 1.0.
    pub tau: f64,
    /// Discount factor. SB3: 0.99.
    pub gamma: f64,
    /// Env steps (inserted, all env-runners together) per training round. SB3: 4.
    pub train_freq: u64,
    /// Gradient steps per training round. SB3: 1.
    pub gradient_steps: usize,
    /// Env steps between target network updates. SB3: 10,000.
    pub target_update_interval: u64,
    /// Fraction of `run.total_env_steps` over which epsilon falls linearly
    /// from `exploration_initial_eps` to `exploration_final_eps`. SB3: 0.1.
    pub exploration_fraction: f64,
    /// Epsilon at the start. SB3: 1.0.
    pub exploration_initial_eps: f64,
    /// Epsilon after `exploration_fraction` of the budget. SB3: 0.05.
    pub exploration_final_eps: f64,
    /// Global gradient-norm clip. SB3: 10.
    pub max_grad_norm: f64,
    /// Steps of the returns (`R = Σ_{i<k} γ^i r_i`, bootstrap with `γ^k`);
    /// 1 is SB3's DQN.
    pub n_steps: usize,
    /// Double DQN: the online network picks the next action, the target
    /// network values it. SB3's DQN: false.
    pub double_q: bool,
    /// Dueling Q-network (value and mean-subtracted advantage streams). Default false.
    pub dueling: bool,
    /// Huber loss threshold (1.0 is SB3's `smooth_l1_loss`).
    pub huber_delta: f64,
    /// Adam epsilon (PyTorch's default, which SB3 uses).
    pub adam_eps: f64,
    /// Prioritized replay (proportional): sample transition `i` with
    /// probability `p_i^α / Σ p^α`; new transitions get the largest priority
    /// seen; the learner sends `|td error| + prioritized_eps` back after
    /// each step. False samples uniformly (SB3).
    pub prioritized: bool,
    /// Priority exponent α (0 is uniform). Schaul et al.: 0.6.
    pub prioritized_alpha: f64,
    /// Importance-sampling exponent β (a schedule over training progress,
    /// annealed towards 1). Schaul et al.: 0.4 to 1.0.
    pub prioritized_beta: Schedule,
    /// Added to `|td error|` so that no priority is 0.
    pub prioritized_eps: f64,
    /// Write a checkpoint every this many training rounds (and at stop, at
    /// the first eval and at each new best eval mean).
    pub checkpoint_every: u64,
    /// Numbered checkpoints kept besides the pinned ones and the best.
    pub keep_checkpoints: usize,
}

impl Default for DqnConfig {
    fn default() -> Self {
        Self {
            learning_rate: Schedule::constant(1e-4),
            buffer_size: 1_000_000,
            learning_starts: 100,
            batch_size: 32,
            tau: 1.0,
            gamma: 0.99,
            train_freq: 4,
            gradient_steps: 1,
            target_update_interval: 10_000,
            exploration_fraction: 0.1,
            exploration_initial_eps: 1.0,
            exploration_final_eps: 0.05,
            max_grad_norm: 10.0,
            n_steps: 1,
            double_q: false,
            dueling: false,
            huber_delta: 1.0,
            adam_eps: 1e-8,
            prioritized: false,
            prioritized_alpha: 0.6,
            prioritized_beta: Schedule::linear(0.4, 1.0),
            prioritized_eps: 1e-6,
            checkpoint_every: 100,
            keep_checkpoints: 5,
        }
    }
}

impl NormalizeSection {
    /// Whether anything is normalised (`obs` or `reward`).
    pub fn enabled(&self) -> bool {
        self.obs || self.reward
    }

    fn validate(&self) -> Result<(), ConfigError> {
        positive_f("normalize.clip_obs", self.clip_obs)?;
        positive_f("normalize.clip_reward", self.clip_reward)?;
        if let Some(g) = self.gamma {
            unit_interval("normalize.gamma", g)?;
        }
        positive_f("normalize.epsilon", self.epsilon)?;
        Ok(())
    }
}

impl DqnConfig {
    /// Epsilon at `progress` (`env_steps / run.total_env_steps`): SB3's
    /// `get_linear_fn(initial, final, exploration_fraction)`.
    pub fn exploration_rate(&self, progress: f64) -> f64 {
        let (a, b) = (self.exploration_initial_eps, self.exploration_final_eps);
        if self.exploration_fraction <= 0.0 || progress >= self.exploration_fraction {
            return b;
        }
        a + (b - a) * (progress.max(0.0) / self.exploration_fraction)
    }
}

/// What the replay-buffer's off-policy table needs to know (from the
/// algorithm's section, so another off-policy learner can supply its own).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct OffPolicyTable {
    /// Transitions held; the oldest are evicted past it.
    pub capacity: u64,
    /// Steps of the returns computed at insert.
    pub n_steps: usize,
    /// Discount of those returns.
    pub gamma: f64,
    /// Prioritized (proportional) or uniform sampling.
    pub prioritized: bool,
    /// Priority exponent α.
    pub alpha: f64,
}

/// Algorithms that train classic-control runs (`run.algo`).
pub const CLASSIC_ALGOS: [&str; 5] = ["ppo", "a2c", "reinforce", "dqn", "sac"];

/// A hyperparameter given as a number or a name (`"auto"`, `"auto_0.1"`):
/// SAC's `ent_coef` and `target_entropy`, spelled as in SB3.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum NumberOrName {
    /// A number.
    Number(f64),
    /// A name.
    Name(String),
}

/// How SAC's entropy coefficient α is set ([`SacSection::ent_coef`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum EntCoef {
    /// Tuned towards the target entropy, starting at `initial`.
    Auto { initial: f64 },
    /// Fixed at this value.
    Fixed(f64),
}

/// SAC hyperparameters (names and defaults as Stable-Baselines3's `SAC`,
/// without gSDE).
///
/// The env-runners' fragments become 1-step transitions in the
/// replay-buffer's off-policy table (as DQN's, actions in env units, at
/// most `buffer_size`, oldest evicted first, uniform sampling). Once more
/// than `learning_starts` env steps were inserted, the learner takes
/// `gradient_steps` SAC gradient steps of `batch_size` transitions per
/// `train_freq` env steps inserted and publishes the actor as a weights
/// version after each round. The inference servers sample the
/// tanh-squashed Gaussian actor (env units); the evaluator asks
/// deterministic actions, `tanh(μ)` scaled. Needs a continuous (Box)
/// action space.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SacSection {
    /// Learning rate of the three Adam optimizers (actor, critics, `log α`),
    /// a schedule over training progress. SB3: 3e-4.
    pub learning_rate: Schedule,
    /// Transitions the off-policy table holds; past it the oldest are evicted. SB3: 1,000,000.
    pub buffer_size: u64,
    /// Env steps inserted before the first gradient step. SB3: 100.
    pub learning_starts: u64,
    /// Transitions per gradient step. SB3: 256.
    pub batch_size: usize,
    /// Polyak coefficient of the target critics. SB3: 0.005.
    pub tau: f64,
    /// Discount factor. SB3: 0.99.
    pub gamma: f64,
    /// Env steps (inserted, all env-runners together) per training round. SB3: 1.
    pub train_freq: u64,
    /// Gradient steps per training round. SB3: 1.
    pub gradient_steps: usize,
    /// Entropy coefficient α: `"auto"` (tuned towards `target_entropy`,
    /// starting at 1), `"auto_<init>"` (tuned, starting at `<init>`, e.g.
    /// `"auto_0.1"`) or a number (fixed). SB3: `"auto"`.
    pub ent_coef: NumberOrName,
    /// Entropy target of the tuned α: `"auto"` is `-action_dim`, or a
    /// number. SB3: `"auto"`.
    pub target_entropy: NumberOrName,
    /// Gradient steps between Polyak updates of the target critics. SB3: 1.
    pub target_update_interval: u64,
    /// Hidden widths of the actor and of each of the two critics (ReLU). SB3: [256, 256].
    pub net_arch: Vec<usize>,
    /// Lower clamp of the actor's log std. SB3: -20.
    pub log_std_min: f64,
    /// Upper clamp of the actor's log std. SB3: 2.
    pub log_std_max: f64,
    /// Write a checkpoint every this many training rounds (and at stop, at
    /// the first eval and at each new best eval mean).
    pub checkpoint_every: u64,
    /// Numbered checkpoints kept besides the pinned ones and the best.
    pub keep_checkpoints: usize,
}

impl Default for SacSection {
    fn default() -> Self {
        Self {
            learning_rate: Schedule::constant(3e-4),
            buffer_size: 1_000_000,
            learning_starts: 100,
            batch_size: 256,
            tau: 0.005,
            gamma: 0.99,
            train_freq: 1,
            gradient_steps: 1,
            ent_coef: NumberOrName::Name("auto".into()),
            target_entropy: NumberOrName::Name("auto".into()),
            target_update_interval: 1,
            net_arch: vec![256, 256],
            log_std_min: -20.0,
            log_std_max: 2.0,
            checkpoint_every: 1000,
            keep_checkpoints: 5,
        }
    }
}

impl SacSection {
    /// The entropy coefficient setting; the error names `sac.ent_coef`.
    pub fn ent_coef(&self) -> Result<EntCoef, ConfigError> {
        let bad = |detail: String| invalid("sac.ent_coef", detail);
        match &self.ent_coef {
            NumberOrName::Number(v) if v.is_finite() && *v > 0.0 => Ok(EntCoef::Fixed(*v)),
            NumberOrName::Number(v) => Err(bad(format!("a fixed value must be > 0, got {v}"))),
            NumberOrName::Name(name) if name == "auto" => Ok(EntCoef::Auto { initial: 1.0 }),
            NumberOrName::Name(name) => match name.strip_prefix("auto_").map(str::parse::<f64>) {
                Some(Ok(v)) if v.is_finite() && v > 0.0 => Ok(EntCoef::Auto { initial: v }),
                _ => Err(bad(format!(
                    "{name:?} is not \"auto\", \"auto_<initial value > 0>\" (e.g. \"auto_0.1\") or a number > 0"
                ))),
            },
        }
    }

    /// The entropy target for `action_dim` action dimensions; the error
    /// names `sac.target_entropy`.
    pub fn target_entropy_for(&self, action_dim: usize) -> Result<f64, ConfigError> {
        match &self.target_entropy {
            NumberOrName::Number(v) if v.is_finite() => Ok(*v),
            NumberOrName::Name(name) if name == "auto" => Ok(-(action_dim as f64)),
            other => Err(invalid(
                "sac.target_entropy",
                format!("{other:?} is not \"auto\" or a finite number"),
            )),
        }
    }
}

/// evaluator settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct EvalConfig {
    /// Evaluate every this many weights versions (the newest is taken; others are skipped).
    pub every_versions: u64,
    /// Also evaluate once this many seconds have passed since the last
    /// evaluation and any newer version exists, whichever of the two comes
    /// first (unset: versions only). For slow learners whose versions are far apart.
    pub every_seconds: Option<f64>,
    /// Episodes per evaluation.
    pub episodes: usize,
    /// Seed of the eval episodes, distinct from the training seeds.
    pub seed: u64,
    /// Solved threshold on the mean eval return; defaults to the env's reward threshold.
    pub threshold: Option<f64>,
    /// Episodes (text games: games per opponent) of the confirmation: a
    /// version whose screening mean (the `episodes` on `seed`, the same set
    /// every time) reaches the threshold is played again on this many
    /// episodes from seeds no earlier evaluation of the run used, and only
    /// a pass there solves the run (100: Gymnasium's classic criterion of
    /// 100 consecutive episodes).
    pub confirm_episodes: usize,
    /// Evaluator plugin this evaluator copy runs (see the evaluator crate's
    /// registry): `greedy` (deterministic actions), `stochastic` (sampled
    /// actions), `threshold` (evaluates only once the training return crosses
    /// `options.level`), `record` (greedy, and writes each episode's
    /// trajectory to `runs/<id>/recordings/v<version>.jsonl`), and for
    /// text-game runs `vs-opponent` (the learning adapter against each of
    /// `options.opponents`, half of `options.games` in each seat). `relay
    /// eval use` switches a running evaluator to another one.
    pub evaluator: String,
    /// Options of the plugin, `key: value` (scalars); each plugin documents
    /// its own and rejects unknown ones.
    pub options: std::collections::BTreeMap<String, serde_yaml::Value>,
}

/// Where confirmation seeds start, above the eval seed: far past any
/// screening set (`eval.episodes` seeds from `eval.seed`).
const CONFIRM_SEED_OFFSET: u64 = 1 << 32;
/// Where fresh seeds for offline re-evaluation start, above the eval seed:
/// past every confirmation of any version a run can reach.
const FRESH_SEED_OFFSET: u64 = 1 << 48;

impl EvalConfig {
    /// First seed of the confirmation of `version`: `eval.seed + 2^32 +
    /// version * confirm_episodes`, so no two versions' confirmations, nor
    /// a confirmation and the screening set, share a seed.
    pub fn confirm_seed(&self, version: u64) -> u64 {
        self.seed
            .wrapping_add(CONFIRM_SEED_OFFSET)
            .wrapping_add(version.wrapping_mul(self.confirm_episodes as u64))
    }

    /// First seed of episodes that no evaluation of the run plays
    /// (`eval.seed + 2^48`): what `relay eval checkpoint` and the
    /// benchmarks re-evaluate saved checkpoints on by default.
    pub fn fresh_seed(&self) -> u64 {
        self.seed.wrapping_add(FRESH_SEED_OFFSET)
    }

    /// The plugin options as `key=value` strings.
    pub fn option_pairs(&self) -> Vec<(String, String)> {
        self.options
            .iter()
            .map(|(k, v)| {
                let text = match v {
                    serde_yaml::Value::String(s) => s.clone(),
                    other => serde_yaml::to_string(other)
                        .unwrap_or_default()
                        .trim()
                        .to_string(),
                };
                (k.clone(), text)
            })
            .collect()
    }

    fn validate(&self) -> Result<(), ConfigError> {
        if self
            .every_seconds
            .is_some_and(|s| !(s.is_finite() && s > 0.0))
        {
            return Err(invalid(
                "eval.every_seconds",
                "must be a positive number of seconds",
            ));
        }
        positive("eval.confirm_episodes", self.confirm_episodes)?;
        if self.evaluator.trim().is_empty() {
            return Err(invalid("eval.evaluator", "must name an evaluator plugin"));
        }
        for (k, v) in &self.options {
            if matches!(
                v,
                serde_yaml::Value::Mapping(_) | serde_yaml::Value::Sequence(_)
            ) {
                return Err(invalid(
                    &format!("eval.options.{k}"),
                    "must be a scalar (string, number or bool)",
                ));
            }
        }
        Ok(())
    }
}

impl Default for EvalConfig {
    fn default() -> Self {
        Self {
            every_versions: 5,
            every_seconds: None,
            episodes: 20,
            seed: 1_000_003,
            threshold: None,
            confirm_episodes: 100,
            evaluator: "greedy".into(),
            options: Default::default(),
        }
    }
}

/// The bots a seat can hold (`text.learner`, `text.opponents`).
pub const BOT_NAMES: [&str; 3] = ["random", "minimax", "connect_four_bot"];

/// Whether bot `name` plays text game `env_id` under `env`: `random` plays
/// every game, `minimax` relay's TicTacToe only, `connect_four_bot` relay's
/// ConnectFour only (they search relay's own game types, so TextArena's
/// games of the same ids, under `env.backend: textarena`, have neither).
pub fn bot_plays(name: &str, env_id: &str, env: &EnvSection) -> bool {
    let builtin = !env.text_uses_python();
    match name {
        "random" => true,
        "minimax" => builtin && env_id == relay_envs::text::tic_tac_toe::ID,
        "connect_four_bot" => builtin && env_id == relay_envs::text::connect_four::ID,
        _ => false,
    }
}

/// Who sits opposite the learning policy (a key of `text.opponents`, or an
/// entry of the `vs-opponent` evaluator's `opponents` option).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Opponent {
    /// `self`: the learning adapter itself (mirror self-play: it holds every seat).
    SelfPlay,
    /// `base`: the base model without any adapter.
    Base,
    /// A bot of [`BOT_NAMES`].
    Bot(String),
    /// `adapter:<name>`: the LLM with another adapter the inference servers hold.
    Adapter(String),
}

impl Opponent {
    /// Parses `self`, `base`, a bot name or `adapter:<name>`.
    pub fn parse(text: &str) -> Result<Self, String> {
        let text = text.trim();
        match text {
            "self" => Ok(Self::SelfPlay),
            "base" => Ok(Self::Base),
            bot if BOT_NAMES.contains(&bot) => Ok(Self::Bot(bot.to_string())),
            other => match other.strip_prefix("adapter:") {
                Some(name) if valid_adapter_name(name) => Ok(Self::Adapter(name.to_string())),
                Some(name) => Err(format!(
                    "adapter name {name:?} must be 1 to 64 ASCII letters, digits, '-', '_' or '.'"
                )),
                None => Err(format!(
                    "unknown opponent {other:?}; known: self, base, {}, adapter:<name>",
                    BOT_NAMES.join(", ")
                )),
            },
        }
    }

    /// Its name as configs write it (`random`, `adapter:old`, ...).
    pub fn label(&self) -> String {
        match self {
            Self::SelfPlay => "self".into(),
            Self::Base => "base".into(),
            Self::Bot(name) => name.clone(),
            Self::Adapter(name) => format!("adapter:{name}"),
        }
    }

    /// Checks that it can play `env_id` under `env` (bots play only some games).
    pub fn check_game(&self, env_id: &str, env: &EnvSection) -> Result<(), String> {
        match self {
            Self::Bot(name) if !bot_plays(name, env_id, env) => {
                Err(format!("bot {name} does not play {env_id}"))
            }
            _ => Ok(()),
        }
    }
}

fn valid_adapter_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 64
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
}

/// Text-game runs (`run.env_id` one of the text games): who plays, and how
/// the LLM policy generates its moves. Ignored for classic-control envs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TextConfig {
    /// Who plays the learning side: `model` (the LLM with the learning
    /// adapter `policy`), or a bot (`random`, `minimax`,
    /// `connect_four_bot`) for a baseline run that needs no inference server.
    pub learner: String,
    /// Who sits opposite the learning side in training games, each with a
    /// relative weight (>= 0; one is drawn per game): `self` (mirror: the
    /// learning adapter in every seat), `base` (the base model without
    /// adapter), `random`, `minimax` (TicTacToe), `connect_four_bot`
    /// (ConnectFour), `adapter:<name>` (another adapter the inference
    /// servers hold), `league` (an opponent the `league.sampler` draws from
    /// the run's league pool: a past version of the learning adapter, the
    /// current one, or a fixed bot; two-player games with `learner: model`
    /// only). Every bot listed here, even at weight 0, is a fixed member
    /// of the league pool. Single-player games ignore it.
    pub opponents: std::collections::BTreeMap<String, f64>,
    /// Games each env-runner copy plays at the same time (their generate
    /// requests overlap, so the inference servers can batch them).
    pub games_in_flight: usize,
    /// Most tokens the model may generate for one move.
    pub max_turn_tokens: u32,
    /// Sampling temperature of the model's moves (0: greedy).
    pub temperature: f32,
    /// Nucleus sampling: keep the smallest set of tokens whose probability
    /// reaches this (1 keeps all).
    pub top_p: f32,
    /// Keep only the `top_k` most likely tokens (0 keeps all).
    pub top_k: u32,
    /// Ask for constrained decoding: the model's move is always one of the
    /// game's legal moves (`legal_moves()`), spelled token by token.
    pub constrained: bool,
    /// System prompt put before each observation (none: the observation is
    /// the only chat turn).
    pub system_prompt: Option<String>,
    /// How the game's messages become the prompt: `full` (TextArena's
    /// default `LLMObservationWrapper`, the whole transcript) or
    /// `first_last` (`FirstLastObservationWrapper`: the game's rules and
    /// the latest message, i.e. the current board; short prompts that do
    /// not grow over the game) or `compact` (relay's own: the board from
    /// the player's side, its cells, the opponent's and the free ones: a
    /// TicTacToe prompt in about 90 tokens where `first_last` takes about
    /// 216; see `relay_envs::ObservationView::Compact`).
    pub observation: relay_envs::ObservationView,
    /// Time one generate request may take before it counts as failed.
    pub generate_timeout_ms: u64,
    /// Attempts per move (the first try and its retries) before the game is
    /// abandoned (and counted); a timeout, an undecodable reply and a
    /// missing inference server each fail one attempt.
    pub generate_attempts: u32,
    /// Search depth (plies) of `connect_four_bot`.
    pub connect_four_depth: u32,
    /// Multi-game runs: the text games trained on together, each with its
    /// relative sampling weight (finite, >= 0, not all 0), e.g.
    /// `{TicTacToe-v0: 2, KuhnPoker-v0: 1}`. Each env-runner draws the game
    /// of every new training game from these weights with its seeded RNG.
    /// Unset: the run plays `run.env_id` alone, as a single-game run. When
    /// set, `run.env_id` must be one of these games (it names the run in
    /// the registry and the `env_id` label), every entry of `opponents`
    /// (and `learner`, when it is a bot) must play every game, and the
    /// `league` opponent is refused: the league pool rates one game.
    pub games: Option<std::collections::BTreeMap<String, f64>>,
    /// Continuations of one position per training game (1: plain games).
    /// With `n > 1` each training game against a listed opponent is played
    /// to its end, then one position before a learning move (drawn
    /// uniformly among them) is played on `n - 1` more times: the learning
    /// seat's move there is sampled `n` times from one prompt, and those
    /// moves are one `rloo`/`grpo` group whose returns differ only by the
    /// move and what followed (a per-position baseline, where the games of
    /// one version and seat give a per-seat one). Costs `n - 1` game
    /// endings per game; league games are never branched.
    pub branches: usize,
    /// Which position a game's continuations (`branches > 1`) play on
    /// from: `uniform` (one before a learning move, drawn uniformly) or
    /// `last_before_loss` (in a game the learning seat lost, the position
    /// of its last move, the one the opponent's win followed; in other
    /// games, uniform). The latter spends the continuations where a move
    /// is most likely to have decided the game: against a random bot a
    /// missed block loses only when the bot finds the cell, so the plain
    /// games rarely show the move's cost.
    pub branch_at: BranchPosition,
    /// Each continuation of a branched position moves there where the
    /// game and the earlier continuations did not (drawn by constrained
    /// decoding among the legal moves left, one continuation after the
    /// other; once none is left, among all). A group of one move repeated
    /// teaches nothing (its centred advantages cancel on that move), and
    /// a policy grown almost deterministic mostly repeats itself; distinct
    /// moves make every group a comparison.
    pub distinct_branch_moves: bool,
}

/// Where a training game is branched (`text.branch_at`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BranchPosition {
    /// Before a learning move drawn uniformly.
    #[default]
    Uniform,
    /// Before the learning seat's last move in a game it lost; uniform in
    /// the others.
    LastBeforeLoss,
}

impl Default for TextConfig {
    fn default() -> Self {
        Self {
            learner: "model".into(),
            opponents: [("random".to_string(), 1.0)].into_iter().collect(),
            games_in_flight: 4,
            max_turn_tokens: 32,
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            constrained: false,
            system_prompt: None,
            observation: relay_envs::ObservationView::Full,
            generate_timeout_ms: 30_000,
            generate_attempts: 3,
            connect_four_depth: 4,
            games: None,
            branches: 1,
            branch_at: BranchPosition::Uniform,
            distinct_branch_moves: false,
        }
    }
}

impl TextConfig {
    /// The opponents with their weights, parsed (in name order), without
    /// the [`LEAGUE_OPPONENT`] entry (see [`TextConfig::league_weight`]).
    pub fn opponent_weights(&self) -> Result<Vec<(Opponent, f64)>, ConfigError> {
        self.opponents
            .iter()
            .filter(|(name, _)| name.as_str() != LEAGUE_OPPONENT)
            .map(|(name, &w)| {
                Opponent::parse(name)
                    .map(|o| (o, w))
                    .map_err(|e| invalid(&format!("text.opponents.{name}"), e))
            })
            .collect()
    }

    /// The relative weight of `league` in `opponents` (0 when absent): the
    /// share of training games whose opponent the league sampler draws.
    pub fn league_weight(&self) -> f64 {
        self.opponents.get(LEAGUE_OPPONENT).copied().unwrap_or(0.0)
    }

    /// The bots among `opponents` (whatever their weight), in name order.
    pub fn opponent_bots(&self) -> impl Iterator<Item = &str> {
        self.opponents
            .keys()
            .map(String::as_str)
            .filter(|name| BOT_NAMES.contains(name))
    }

    /// The games of a run whose `run.env_id` is `env_id`, with their
    /// sampling weights, in name order: `games` when set, else `env_id`
    /// alone at weight 1.
    pub fn game_weights(&self, env_id: &str) -> Vec<(String, f64)> {
        match &self.games {
            Some(games) => games.iter().map(|(g, &w)| (g.clone(), w)).collect(),
            None => vec![(env_id.to_string(), 1.0)],
        }
    }

    /// Whether the run trains on several games (`games` lists more than one).
    pub fn multi_game(&self) -> bool {
        self.games.as_ref().is_some_and(|g| g.len() > 1)
    }

    /// Checks `games` against the run's `env_id` (see the field's docs).
    fn validate_games(&self, env_id: &str, env: &EnvSection) -> Result<(), ConfigError> {
        let Some(games) = &self.games else {
            return Ok(());
        };
        if games.is_empty() {
            return Err(invalid(
                "text.games",
                "lists no game; leave it unset to play run.env_id alone",
            ));
        }
        for (game, &weight) in games {
            let field = format!("text.games.{game}");
            if !env.is_text_game(game) {
                let kind = if relay_envs::spec(game).is_ok() {
                    "is a classic-control env; text.games lists text games only (no mixing)"
                        .to_string()
                } else {
                    format!(
                        "unknown text game {game:?}; known: {}",
                        relay_envs::TEXT_GAME_IDS.join(", ")
                    )
                };
                return Err(invalid(&field, kind));
            }
            if !(weight.is_finite() && weight >= 0.0) {
                return Err(invalid(
                    &field,
                    format!("weight must be a number >= 0, got {weight}"),
                ));
            }
        }
        if games.values().all(|&w| w <= 0.0) {
            return Err(invalid(
                "text.games",
                "every weight is 0; at least one must be positive",
            ));
        }
        if !env.is_text_game(env_id) {
            return Err(invalid(
                "text.games",
                format!("run.env_id {env_id} is not a text game: a run cannot mix classic-control and text envs"),
            ));
        }
        if !games.contains_key(env_id) {
            return Err(invalid(
                "text.games",
                format!(
                    "does not list run.env_id {env_id}; a multi-game run names one of its games in run.env_id"
                ),
            ));
        }
        if games.len() > 1 && self.league_weight() > 0.0 {
            return Err(invalid(
                &format!("text.opponents.{LEAGUE_OPPONENT}"),
                "the league pool rates one game; a multi-game run (text.games) cannot use league opponents",
            ));
        }
        Ok(())
    }

    /// The learning side's bot, if `learner` names one (`None`: the model).
    pub fn learner_bot(&self) -> Option<&str> {
        (self.learner != "model").then_some(self.learner.as_str())
    }

    /// Checks every field; `env_id` is the run's (game-specific checks
    /// apply only when it is a text game).
    pub fn validate(&self, env_id: &str, env: &EnvSection) -> Result<(), ConfigError> {
        let game = env.is_text_game(env_id);
        self.validate_games(env_id, env)?;
        let games: Vec<String> = self
            .game_weights(env_id)
            .into_iter()
            .map(|(g, _)| g)
            .collect();
        if self.learner != "model" {
            if !BOT_NAMES.contains(&self.learner.as_str()) {
                return Err(invalid(
                    "text.learner",
                    format!(
                        "unknown learner {:?}; known: model, {}",
                        self.learner,
                        BOT_NAMES.join(", ")
                    ),
                ));
            }
            if game {
                if let Some(refused) = games.iter().find(|g| !bot_plays(&self.learner, g, env)) {
                    return Err(invalid(
                        "text.learner",
                        format!("bot {} does not play {refused}", self.learner),
                    ));
                }
            }
        }
        if self.opponents.is_empty() {
            return Err(invalid("text.opponents", "needs at least one opponent"));
        }
        for (opponent, weight) in self.opponent_weights()? {
            let field = format!("text.opponents.{}", opponent.label());
            if !(weight.is_finite() && weight >= 0.0) {
                return Err(invalid(
                    &field,
                    format!("weight must be a number >= 0, got {weight}"),
                ));
            }
            if game {
                for g in &games {
                    opponent
                        .check_game(g, env)
                        .map_err(|e| invalid(&field, e))?;
                }
            }
        }
        let league = self.league_weight();
        if !(league.is_finite() && league >= 0.0) {
            return Err(invalid(
                &format!("text.opponents.{LEAGUE_OPPONENT}"),
                format!("weight must be a number >= 0, got {league}"),
            ));
        }
        if league > 0.0 && game {
            let field = format!("text.opponents.{LEAGUE_OPPONENT}");
            if self.learner_bot().is_some() {
                return Err(invalid(
                    &field,
                    "league games train the model: text.learner must be `model`",
                ));
            }
            let players = relay_bridge::make_text_game(env_id, env)
                .map_err(|e| invalid("run.env_id", e.to_string()))?
                .num_players();
            if players != 2 {
                return Err(invalid(
                    &field,
                    format!("the league rates two-player games; {env_id} has {players} players"),
                ));
            }
        }
        if self.opponents.values().all(|&w| w <= 0.0) {
            return Err(invalid(
                "text.opponents",
                "every weight is 0; at least one must be positive",
            ));
        }
        positive("text.games_in_flight", self.games_in_flight)?;
        positive("text.branches", self.branches)?;
        if self.max_turn_tokens == 0 || self.max_turn_tokens > relay_proto::MAX_GENERATE_TOKENS {
            return Err(invalid(
                "text.max_turn_tokens",
                format!(
                    "must be in 1..={}, got {}",
                    relay_proto::MAX_GENERATE_TOKENS,
                    self.max_turn_tokens
                ),
            ));
        }
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return Err(invalid(
                "text.temperature",
                format!("must be a number >= 0, got {}", self.temperature),
            ));
        }
        if !(self.top_p.is_finite() && self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(invalid(
                "text.top_p",
                format!("must be in (0, 1], got {}", self.top_p),
            ));
        }
        if self
            .system_prompt
            .as_ref()
            .is_some_and(|p| p.trim().is_empty())
        {
            return Err(invalid(
                "text.system_prompt",
                "is empty; leave it unset for no system prompt",
            ));
        }
        positive(
            "text.generate_timeout_ms",
            self.generate_timeout_ms as usize,
        )?;
        positive("text.generate_attempts", self.generate_attempts as usize)?;
        positive("text.connect_four_depth", self.connect_four_depth as usize)?;
        Ok(())
    }
}

/// The key of `text.opponents` whose weight is the share of training games
/// played against an opponent drawn from the league pool.
pub const LEAGUE_OPPONENT: &str = "league";

/// The self-play league of a text run ([`relay_league`]): the pool of the
/// learning adapter's published versions and fixed bots, rated by
/// TrueSkill from the games the env-runners play, and the sampler that
/// draws the opponent of each `league` game (`text.opponents.league`).
///
/// The pool lives in Redis (`relay:<run>:league`, [`crate::league`]); it is
/// created from `pool` and the fixed members when the run first needs it
/// and keeps its own settings afterwards (a resumed run keeps its ratings).
/// With the league on (`text.opponents.league` > 0) the learner admits
/// every version it publishes (inheriting the parent's rating) and stores
/// it in the run's object store bucket, so inference servers can serve any
/// version still in the pool.
///
/// Example (YAML):
///
/// ```yaml
/// text:
///   opponents: {league: 1, random: 0, minimax: 0}
/// league:
///   pool: {keep_latest: 8, keep_best: 2}
///   sampler:
///     kind: mixture
///     components:
///       - {weight: 0.4, sampler: {kind: mirror}}
///       - {weight: 0.3, sampler: {kind: lagged, k: 2}}
///       - {weight: 0.3, sampler: {kind: match_quality, temperature: 0.5}}
/// ```
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LeagueSection {
    /// How the pool rates and bounds itself (`relay_league::PoolConfig`):
    /// `trueskill` {`mu`, `sigma`, `beta`, `tau`, `draw_probability`} (the
    /// rating environment, defaults as the Python `trueskill` package),
    /// `keep_latest` (newest versions always kept, default 10),
    /// `keep_best` (best versions by `mu - conservative_k * sigma` kept
    /// besides, default 3), `conservative_k` (default 3), `sigma_widen`
    /// (the uncertainty a version adds to its parent's rating, in
    /// quadrature, default 0.5), `admit_every` (every this many published
    /// versions join; the games of those in between count for the newest
    /// pool version; default 10), `keep_first` (the first version stays as
    /// the reference, default true). Versions outside these bounds are
    /// evicted, and their stored adapters deleted.
    pub pool: relay_league::PoolConfig,
    /// Who the current version plays in a `league` game
    /// (`relay_league::SamplerConfig`, tagged by `kind`): `mirror` (itself;
    /// the default), `fixed` {`opponents`: [{`opponent`, `weight`}]} (named
    /// members: a bot or `v<N>`), `lagged` {`k`} (the version k back),
    /// `uniform` {`include_fixed`}, `match_quality` {`temperature`,
    /// `floor`, `include_fixed`} (TrueSkill match quality, even matches
    /// most), `least_played` {`include_fixed`}, or `mixture`
    /// {`components`: [{`weight`, `sampler`}]}. Who moves first is a fair
    /// coin each game.
    pub sampler: relay_league::SamplerConfig,
    /// Fixed members of the pool besides the bots and adapters named in
    /// `text.opponents`: bots (`random`, `minimax`, `connect_four_bot`;
    /// each must play the run's game) or `adapter:<name>` (a LoRA adapter
    /// the inference servers hold, e.g. from `llm.adapters`: a saved
    /// policy to beat), so samplers can draw them without the env-runners
    /// also playing them directly.
    pub fixed: Vec<String>,
}

impl LeagueSection {
    /// Checks every field against the run's `text` section and game.
    fn validate(
        &self,
        text: &TextConfig,
        env_id: &str,
        env: &EnvSection,
    ) -> Result<(), ConfigError> {
        if let Err(e) = self.pool.validate() {
            return Err(match e {
                relay_league::PoolError::InvalidConfig { field, reason } => {
                    invalid(&format!("league.pool.{field}"), reason)
                }
                other => invalid("league.pool", other.to_string()),
            });
        }
        relay_league::OpponentSampler::new(self.sampler.clone()).map_err(|e| {
            let field = if e.path.is_empty() {
                "league.sampler".to_string()
            } else {
                format!("league.sampler.{}", e.path)
            };
            invalid(&field, e.reason)
        })?;
        for (index, name) in self.fixed.iter().enumerate() {
            let field = format!("league.fixed[{index}]");
            if let Some(adapter) = name.strip_prefix("adapter:") {
                if !valid_adapter_name(adapter) {
                    return Err(invalid(
                        &field,
                        format!("adapter name {adapter:?} must be 1 to 64 ASCII letters, digits, '-', '_' or '.'"),
                    ));
                }
                continue;
            }
            if !BOT_NAMES.contains(&name.as_str()) {
                return Err(invalid(
                    &field,
                    format!(
                        "unknown bot {name:?}; known: {}, or adapter:<name>",
                        BOT_NAMES.join(", ")
                    ),
                ));
            }
            if env.is_text_game(env_id) && !bot_plays(name, env_id, env) {
                return Err(invalid(
                    &field,
                    format!("bot {name} does not play {env_id}"),
                ));
            }
        }
        let members: Vec<String> = league_fixed_names(text, self);
        check_sampler_members(&self.sampler, "league.sampler", &members)
    }
}

/// The bots and `adapter:<name>` entries of `text.opponents`, then
/// `league.fixed`, without repeats.
fn league_fixed_names(text: &TextConfig, league: &LeagueSection) -> Vec<String> {
    let mut names: Vec<String> = Vec::new();
    for name in text
        .opponent_bots()
        .chain(
            text.opponents
                .keys()
                .map(String::as_str)
                .filter(|name| name.starts_with("adapter:")),
        )
        .chain(league.fixed.iter().map(String::as_str))
    {
        if !names.iter().any(|n| n == name) {
            names.push(name.to_string());
        }
    }
    names
}

/// A `fixed` sampler may name only fixed members the pool will hold (or
/// policy versions, which come and go).
fn check_sampler_members(
    sampler: &relay_league::SamplerConfig,
    path: &str,
    members: &[String],
) -> Result<(), ConfigError> {
    use relay_league::{MemberId, SamplerConfig};
    match sampler {
        SamplerConfig::Fixed { opponents } => {
            for (index, entry) in opponents.iter().enumerate() {
                if let MemberId::Fixed(name) = &entry.opponent {
                    if !members.contains(name) {
                        return Err(invalid(
                            &format!("{path}.opponents[{index}].opponent"),
                            format!(
                                "{name:?} is not a fixed member of the pool (the bots and adapters of text.opponents and league.fixed: {})",
                                if members.is_empty() { "none".to_string() } else { members.join(", ") }
                            ),
                        ));
                    }
                }
            }
            Ok(())
        }
        SamplerConfig::Mixture { components } => {
            for (index, component) in components.iter().enumerate() {
                check_sampler_members(
                    &component.sampler,
                    &format!("{path}.components[{index}].sampler"),
                    members,
                )?;
            }
            Ok(())
        }
        _ => Ok(()),
    }
}

/// The league member a fixed opponent is: `adapter:<name>` the LoRA
/// adapter the inference servers hold under that name (`llm.adapters`),
/// `minimax` a search to the end, `connect_four_bot` one to
/// `text.connect_four_depth`, any other bot random moves.
pub fn fixed_opponent(name: &str, text: &TextConfig) -> relay_league::FixedOpponent {
    use relay_league::FixedKind;
    let kind = match name {
        "minimax" => FixedKind::Minimax { depth: None },
        "connect_four_bot" => FixedKind::Minimax {
            depth: Some(text.connect_four_depth),
        },
        other => match other.strip_prefix("adapter:") {
            Some(adapter) => FixedKind::Adapter {
                path: adapter.to_string(),
            },
            None => FixedKind::Random,
        },
    };
    relay_league::FixedOpponent {
        name: name.to_string(),
        kind,
    }
}

/// The LoRA adapter the learner trains in text runs (PEFT's `LoraConfig`
/// fields); ignored for classic-control envs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LoraSection {
    /// Rank `r` of the update.
    pub rank: usize,
    /// `lora_alpha`: the update is scaled by `alpha / rank` (or
    /// `alpha / sqrt(rank)` with `use_rslora`).
    pub alpha: f64,
    /// `lora_dropout`, saved in the adapter config (training here applies
    /// none), in `[0, 1)`.
    pub dropout: f64,
    /// Projections adapted in every layer: any of `q_proj`, `k_proj`,
    /// `v_proj`, `o_proj`, `gate_proj`, `up_proj`, `down_proj`.
    pub target_modules: Vec<String>,
    /// Rank-stabilised scaling `alpha / sqrt(rank)`.
    pub use_rslora: bool,
    /// Seed of the initial `A` factors (`B` starts at zero, so version 0
    /// plays exactly as the base model).
    pub seed: u64,
    /// Adapter versions up to this many bytes (config plus safetensors)
    /// are published inside the `AdapterUpdate`; bigger ones go through
    /// the JetStream object store (bucket `relay-<run>-adapters`). At most
    /// the NATS message limit less 64 KiB.
    pub inline_max_bytes: usize,
}

impl Default for LoraSection {
    fn default() -> Self {
        Self {
            rank: 8,
            alpha: 16.0,
            dropout: 0.0,
            target_modules: relay_llm::LoraTarget::ALL
                .iter()
                .map(|t| t.module_name().to_string())
                .collect(),
            use_rslora: false,
            seed: 0,
            inline_max_bytes: relay_proto::MAX_MESSAGE_BYTES - 64 * 1024,
        }
    }
}

impl LoraSection {
    /// The adapter's hyperparameters.
    pub fn lora_config(&self) -> Result<relay_llm::LoraConfig, ConfigError> {
        let mut targets = Vec::with_capacity(self.target_modules.len());
        for name in &self.target_modules {
            let target = relay_llm::LoraTarget::from_module_name(name).ok_or_else(|| {
                invalid(
                    "lora.target_modules",
                    format!(
                        "unknown module {name:?}; known: {}",
                        relay_llm::LoraTarget::ALL
                            .map(|t| t.module_name())
                            .join(", ")
                    ),
                )
            })?;
            if !targets.contains(&target) {
                targets.push(target);
            }
        }
        let config = relay_llm::LoraConfig {
            rank: self.rank,
            alpha: self.alpha,
            dropout: self.dropout,
            targets,
            use_rslora: self.use_rslora,
        };
        config
            .validate()
            .map_err(|e| invalid("lora", e.to_string()))?;
        Ok(config)
    }

    fn validate(&self) -> Result<(), ConfigError> {
        positive("lora.rank", self.rank)?;
        if !self.alpha.is_finite() {
            return Err(invalid("lora.alpha", "must be finite"));
        }
        if !(0.0..1.0).contains(&self.dropout) {
            return Err(invalid("lora.dropout", "must be in [0, 1)"));
        }
        if self.target_modules.is_empty() {
            return Err(invalid("lora.target_modules", "needs at least one module"));
        }
        let limit = relay_proto::MAX_MESSAGE_BYTES - 64 * 1024;
        if self.inline_max_bytes > limit {
            return Err(invalid(
                "lora.inline_max_bytes",
                format!("{} is over the limit of {limit}", self.inline_max_bytes),
            ));
        }
        self.lora_config().map(|_| ())
    }
}

/// Names of the RL objective presets (`rl.preset`).
pub const RL_PRESETS: [&str; 5] = ["reinforce", "rloo", "grpo", "dr_grpo", "ppo"];

/// How the learner trains the LoRA adapter in text runs (see
/// `relay_llm::rl` for the objectives' formulas); ignored for
/// classic-control envs.
///
/// Each learning move of a game is one training sequence (its prompt and
/// completion tokens, the behaviour log-probs); its reward is its seat's
/// final game reward shaped by `reward`. Sequences are grouped (the
/// baselines of `rloo` and `grpo`) by the adapter version that played the
/// game and the seat it played from.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RlConfig {
    /// Objective preset: `reinforce` (batch-mean baseline), `rloo`,
    /// `grpo` (DeepSeekMath: group-normalised advantages, PPO clip 0.2,
    /// k3 KL loss 0.04), `dr_grpo` (its length is `text.max_turn_tokens`),
    /// `ppo` (clip 0.2, batch-mean baseline).
    pub preset: String,
    /// A full objective (advantage, policy_loss, aggregation, kl,
    /// entropy_coef) that replaces the preset.
    pub objective: Option<relay_llm::ObjectiveConfig>,
    /// Most learning moves (sequences) per optimizer step; the learner
    /// gathers whole games up to it.
    pub batch_size: usize,
    /// Sequences per forward/backward pass (bounds memory; the gradients
    /// of one step are summed).
    pub minibatch_size: usize,
    /// Longest prompt plus completion trained on; at most the model's
    /// context + 1.
    pub max_seq_len: usize,
    /// Longer sequences: `cut_prompt_start` (keep the completion, cut the
    /// prompt's start) or `drop`.
    pub truncation: relay_llm::Truncation,
    /// Optimizer steps on each batch (PPO-style epochs; 1 is on-policy).
    pub epochs: usize,
    /// Truncated importance sampling between the inference servers'
    /// token log-probs and the learner's: `{cap: 2.0}` weights each
    /// token's loss by `min(π_learner / π_sampler, cap)` and makes PPO's
    /// ratio relative to the learner's own log-probs (see
    /// `relay_llm::rl`); unset: off. Set over the preset's or
    /// `objective`'s.
    pub truncated_is: Option<relay_llm::TruncatedIs>,
    /// AdamW over the adapter: `lr`, `beta1`, `beta2`, `eps`,
    /// `weight_decay`, `max_grad_norm`.
    pub optimizer: relay_llm::AdamWConfig,
    /// Reward transforms: `invalid_move_penalty` (taken from each move the
    /// game refused), `format_bonus` (times the share of the seat's moves that
    /// contain a bracketed move such as `[4]`), `normalize` (`{center,
    /// eps, clip}`: each game's reward by its own running mean and std, per
    /// game id, before the objective's group normalisation; recommended for
    /// multi-game runs, see `relay_llm::reward`), `discount` (in `(0,
    /// 1]`: each move's reward times `discount^k`, `k` the seat's later
    /// moves in the game; 1 by default), `draw` (a drawn game's reward in
    /// place of the game's own; 1 counts a draw as a win, so that not
    /// losing is the objective; unset by default).
    pub reward: relay_llm::RewardShaping,
    /// Write a checkpoint every this many updates (and at the end).
    pub checkpoint_every: u64,
    /// Numbered checkpoints kept (the newest ones, plus pinned ones).
    pub keep_checkpoints: usize,
}

impl Default for RlConfig {
    fn default() -> Self {
        Self {
            preset: "grpo".into(),
            objective: None,
            batch_size: 32,
            minibatch_size: 8,
            max_seq_len: 1024,
            truncation: relay_llm::Truncation::CutPromptStart,
            epochs: 1,
            truncated_is: None,
            optimizer: relay_llm::AdamWConfig {
                lr: 1e-4,
                ..Default::default()
            },
            reward: relay_llm::RewardShaping {
                normalize: None,
                format_bonus: 0.0,
                invalid_move_penalty: 0.1,
                ..Default::default()
            },
            checkpoint_every: 10,
            keep_checkpoints: 5,
        }
    }
}

impl RlConfig {
    /// The objective: `objective` if given, else the preset's.
    pub fn objective_config(
        &self,
        max_completion_len: usize,
    ) -> Result<relay_llm::ObjectiveConfig, ConfigError> {
        let mut objective = match &self.objective {
            Some(objective) => objective.clone(),
            None => self.preset_objective(max_completion_len)?,
        };
        if self.truncated_is.is_some() {
            objective.truncated_is = self.truncated_is;
        }
        Ok(objective)
    }

    fn preset_objective(
        &self,
        max_completion_len: usize,
    ) -> Result<relay_llm::ObjectiveConfig, ConfigError> {
        Ok(match self.preset.as_str() {
            "reinforce" => relay_llm::ObjectiveConfig::reinforce(),
            "rloo" => relay_llm::ObjectiveConfig::rloo(),
            "grpo" => relay_llm::ObjectiveConfig::grpo(),
            "dr_grpo" => relay_llm::ObjectiveConfig::dr_grpo(max_completion_len),
            "ppo" => relay_llm::ObjectiveConfig::ppo(),
            other => {
                return Err(invalid(
                    "rl.preset",
                    format!("unknown preset {other:?}; known: {}", RL_PRESETS.join(", ")),
                ))
            }
        })
    }

    /// The trainer's whole configuration (`max_completion_len` sizes the
    /// `dr_grpo` preset).
    pub fn train_config(
        &self,
        max_completion_len: usize,
    ) -> Result<relay_llm::RlTrainConfig, ConfigError> {
        let config = relay_llm::RlTrainConfig {
            objective: self.objective_config(max_completion_len)?,
            batch: relay_llm::BatchConfig {
                batch_size: self.batch_size,
                minibatch_size: self.minibatch_size,
                max_seq_len: self.max_seq_len,
                truncation: self.truncation,
            },
            optimizer: self.optimizer.clone(),
        };
        config
            .validate()
            .map_err(|e| invalid("rl", e.to_string()))?;
        Ok(config)
    }

    fn validate(&self, max_completion_len: usize) -> Result<(), ConfigError> {
        positive("rl.batch_size", self.batch_size)?;
        positive("rl.minibatch_size", self.minibatch_size)?;
        positive("rl.epochs", self.epochs)?;
        positive("rl.checkpoint_every", self.checkpoint_every as usize)?;
        positive("rl.keep_checkpoints", self.keep_checkpoints)?;
        self.reward
            .validate()
            .map_err(|e| invalid("rl.reward", e.to_string()))?;
        self.train_config(max_completion_len).map(|_| ())
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
            .validate(&self.text, &self.run.env_id, &self.env)?;
        self.lora.validate()?;
        self.rl.validate(self.text.max_turn_tokens as usize)?;
        if !CLASSIC_ALGOS.contains(&self.run.algo.as_str()) {
            return Err(invalid(
                "run.algo",
                format!(
                    "unknown algorithm {:?}; known: {}",
                    self.run.algo,
                    CLASSIC_ALGOS.join(", ")
                ),
            ));
        }
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
        if let Some(cnn) = &self.policy.cnn {
            self.validate_cnn(cnn)?;
        }
        positive("env_runner.num_envs", self.env_runner.num_envs)?;
        positive("env_runner.fragment_steps", self.env_runner.fragment_steps)?;
        positive("env_runner.threads", self.env_runner.threads)?;
        positive("inference.max_batch", self.inference.max_batch)?;
        positive("inference.threads", self.inference.threads)?;
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
        if let Some(ratio) = self.replay.samples_per_insert {
            positive_f("replay.samples_per_insert", ratio)?;
            // One fragment must fit in the limiter's slack, or no insert could ever pass.
            let fragment = (self.env_runner.num_envs * self.env_runner.fragment_steps) as f64;
            let max_diff = ratio * self.replay.min_size_to_sample as f64
                + self.replay.rate_error_buffer as f64;
            if ratio * fragment > max_diff {
                return Err(invalid(
                    "replay.rate_error_buffer",
                    format!(
                        "{} (+ samples_per_insert x min_size_to_sample) admits less than one fragment of {fragment} env steps",
                        self.replay.rate_error_buffer
                    ),
                ));
            }
        }
        let p = &self.ppo;
        positive("ppo.rollout_steps", p.rollout_steps)?;
        positive("ppo.minibatch_size", p.minibatch_size)?;
        positive("ppo.epochs", p.epochs)?;
        unit_interval("ppo.gamma", p.gamma)?;
        unit_interval("ppo.gae_lambda", p.gae_lambda)?;
        if let Some(v) = p.clip_range_vf {
            positive_f("ppo.clip_range_vf", v)?;
        }
        schedule("ppo.learning_rate", &p.learning_rate_schedule(), true)?;
        schedule("ppo.clip_range", &p.clip_range_schedule(), true)?;
        schedule("ppo.ent_coef", &p.ent_coef, false)?;
        for (field, short, written) in [
            ("ppo.lr_schedule", p.lr_schedule, &p.learning_rate),
            ("ppo.clip_schedule", p.clip_schedule, &p.clip_range),
        ] {
            if short == ScheduleShorthand::Linear
                && !matches!(written.shape, Shape::Constant { .. })
            {
                return Err(invalid(
                    field,
                    "`linear` applies to a constant value only; write the schedule in place instead",
                ));
            }
        }
        non_negative_f("ppo.vf_coef", p.vf_coef)?;
        positive_f("ppo.max_grad_norm", p.max_grad_norm)?;
        positive_f("ppo.adam_eps", p.adam_eps)?;
        if let Some(v) = p.target_kl {
            positive_f("ppo.target_kl", v)?;
        }
        positive("ppo.checkpoint_every", p.checkpoint_every as usize)?;
        positive("ppo.keep_checkpoints", p.keep_checkpoints)?;
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
        if self.normalize.enabled() && matches!(self.run.algo.as_str(), "dqn" | "sac") {
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

    fn validate_a2c(&self) -> Result<(), ConfigError> {
        let a = &self.a2c;
        positive("a2c.n_steps", a.n_steps)?;
        unit_interval("a2c.gamma", a.gamma)?;
        unit_interval("a2c.gae_lambda", a.gae_lambda)?;
        schedule("a2c.learning_rate", &a.learning_rate, true)?;
        schedule("a2c.ent_coef", &a.ent_coef, false)?;
        non_negative_f("a2c.vf_coef", a.vf_coef)?;
        positive_f("a2c.max_grad_norm", a.max_grad_norm)?;
        if !(0.0..1.0).contains(&a.rms_prop_alpha) {
            return Err(invalid(
                "a2c.rms_prop_alpha",
                format!("must be in [0, 1), got {}", a.rms_prop_alpha),
            ));
        }
        positive_f("a2c.rms_prop_eps", a.rms_prop_eps)?;
        positive_f("a2c.adam_eps", a.adam_eps)?;
        positive("a2c.checkpoint_every", a.checkpoint_every as usize)?;
        positive("a2c.keep_checkpoints", a.keep_checkpoints)?;
        if self.run.algo == "a2c" && self.env_runner.fragment_steps != a.n_steps {
            return Err(invalid(
                "env_runner.fragment_steps",
                format!(
                    "is {} but A2C trains on fragments of a2c.n_steps = {} steps; set both to the same value",
                    self.env_runner.fragment_steps, a.n_steps
                ),
            ));
        }
        Ok(())
    }

    fn validate_reinforce(&self) -> Result<(), ConfigError> {
        let r = &self.reinforce;
        positive("reinforce.batch_episodes", r.batch_episodes)?;
        unit_interval("reinforce.gamma", r.gamma)?;
        schedule("reinforce.learning_rate", &r.learning_rate, true)?;
        schedule("reinforce.ent_coef", &r.ent_coef, false)?;
        non_negative_f("reinforce.vf_coef", r.vf_coef)?;
        if let Some(v) = r.max_grad_norm {
            positive_f("reinforce.max_grad_norm", v)?;
        }
        positive_f("reinforce.adam_eps", r.adam_eps)?;
        positive("reinforce.checkpoint_every", r.checkpoint_every as usize)?;
        positive("reinforce.keep_checkpoints", r.keep_checkpoints)?;
        Ok(())
    }

    fn validate_dqn(&self) -> Result<(), ConfigError> {
        let d = &self.dqn;
        schedule("dqn.learning_rate", &d.learning_rate, true)?;
        positive(
            "dqn.buffer_size",
            d.buffer_size.min(usize::MAX as u64) as usize,
        )?;
        if d.buffer_size > 1 << 24 {
            return Err(invalid(
                "dqn.buffer_size",
                format!(
                    "{} is above the table's limit of 16,777,216 transitions",
                    d.buffer_size
                ),
            ));
        }
        positive("dqn.batch_size", d.batch_size)?;
        if !(d.tau.is_finite() && d.tau > 0.0 && d.tau <= 1.0) {
            return Err(invalid(
                "dqn.tau",
                format!("must be in (0, 1], got {}", d.tau),
            ));
        }
        unit_interval("dqn.gamma", d.gamma)?;
        positive(
            "dqn.train_freq",
            d.train_freq.min(usize::MAX as u64) as usize,
        )?;
        positive("dqn.gradient_steps", d.gradient_steps)?;
        positive(
            "dqn.target_update_interval",
            d.target_update_interval.min(usize::MAX as u64) as usize,
        )?;
        unit_interval("dqn.exploration_fraction", d.exploration_fraction)?;
        unit_interval("dqn.exploration_initial_eps", d.exploration_initial_eps)?;
        unit_interval("dqn.exploration_final_eps", d.exploration_final_eps)?;
        positive_f("dqn.max_grad_norm", d.max_grad_norm)?;
        positive("dqn.n_steps", d.n_steps)?;
        if d.n_steps > 100 {
            return Err(invalid(
                "dqn.n_steps",
                format!("must be at most 100, got {}", d.n_steps),
            ));
        }
        positive_f("dqn.huber_delta", d.huber_delta)?;
        positive_f("dqn.adam_eps", d.adam_eps)?;
        non_negative_f("dqn.prioritized_alpha", d.prioritized_alpha)?;
        schedule("dqn.prioritized_beta", &d.prioritized_beta, false)?;
        for q in [0.0, 1.0] {
            let beta = d.prioritized_beta.value(q);
            if !(0.0..=1.0).contains(&beta) {
                return Err(invalid(
                    "dqn.prioritized_beta",
                    format!("must stay in [0, 1], is {beta} at progress {q}"),
                ));
            }
        }
        positive_f("dqn.prioritized_eps", d.prioritized_eps)?;
        positive("dqn.checkpoint_every", d.checkpoint_every as usize)?;
        positive("dqn.keep_checkpoints", d.keep_checkpoints)?;
        if self.run.algo == "dqn" {
            if let Some(env) = self.builtin_env_spec() {
                if !matches!(env.action_space, relay_envs::ActionSpace::Discrete { .. }) {
                    return Err(invalid(
                        "run.algo",
                        format!(
                            "dqn needs discrete actions; {} has continuous ones",
                            self.run.env_id
                        ),
                    ));
                }
            }
            if d.batch_size as u64 > d.buffer_size {
                return Err(invalid(
                    "dqn.batch_size",
                    format!(
                        "{} is larger than dqn.buffer_size ({})",
                        d.batch_size, d.buffer_size
                    ),
                ));
            }
        }
        Ok(())
    }

    fn validate_sac(&self) -> Result<(), ConfigError> {
        let s = &self.sac;
        schedule("sac.learning_rate", &s.learning_rate, true)?;
        positive(
            "sac.buffer_size",
            s.buffer_size.min(usize::MAX as u64) as usize,
        )?;
        if s.buffer_size > 1 << 24 {
            return Err(invalid(
                "sac.buffer_size",
                format!(
                    "{} is above the table's limit of 16,777,216 transitions",
                    s.buffer_size
                ),
            ));
        }
        positive("sac.batch_size", s.batch_size)?;
        unit_interval("sac.tau", s.tau)?;
        unit_interval("sac.gamma", s.gamma)?;
        positive(
            "sac.train_freq",
            s.train_freq.min(usize::MAX as u64) as usize,
        )?;
        positive("sac.gradient_steps", s.gradient_steps)?;
        positive(
            "sac.target_update_interval",
            s.target_update_interval.min(usize::MAX as u64) as usize,
        )?;
        s.ent_coef()?;
        s.target_entropy_for(1)?;
        if s.net_arch.is_empty() || s.net_arch.contains(&0) {
            return Err(invalid(
                "sac.net_arch",
                format!(
                    "needs at least one hidden layer, each of width >= 1, got {:?}",
                    s.net_arch
                ),
            ));
        }
        if !(s.log_std_min.is_finite() && s.log_std_max.is_finite())
            || s.log_std_min >= s.log_std_max
        {
            return Err(invalid(
                "sac.log_std_min",
                format!(
                    "must be finite and below sac.log_std_max, got {} and {}",
                    s.log_std_min, s.log_std_max
                ),
            ));
        }
        positive("sac.checkpoint_every", s.checkpoint_every as usize)?;
        positive("sac.keep_checkpoints", s.keep_checkpoints)?;
        if self.run.algo == "sac" {
            if let Some(env) = self.builtin_env_spec() {
                if !matches!(env.action_space, relay_envs::ActionSpace::Box { .. }) {
                    return Err(invalid(
                        "run.algo",
                        format!(
                            "sac needs continuous (Box) actions; {} has discrete ones (use dqn, ppo, a2c or reinforce)",
                            self.run.env_id
                        ),
                    ));
                }
            }
            if s.batch_size as u64 > s.buffer_size {
                return Err(invalid(
                    "sac.batch_size",
                    format!(
                        "{} is larger than sac.buffer_size ({})",
                        s.batch_size, s.buffer_size
                    ),
                ));
            }
        }
        Ok(())
    }

    /// The replay-buffer's off-policy table of this run, if its algorithm
    /// trains off-policy (`dqn`, `sac`: 1-step, uniform); none for the
    /// on-policy FIFO.
    pub fn off_policy_table(&self) -> Option<OffPolicyTable> {
        if self.is_text_game() {
            return None;
        }
        match self.run.algo.as_str() {
            "dqn" => Some(OffPolicyTable {
                capacity: self.dqn.buffer_size,
                n_steps: self.dqn.n_steps,
                gamma: self.dqn.gamma,
                prioritized: self.dqn.prioritized,
                alpha: self.dqn.prioritized_alpha,
            }),
            "sac" => Some(OffPolicyTable {
                capacity: self.sac.buffer_size,
                n_steps: 1,
                gamma: self.sac.gamma,
                prioritized: false,
                alpha: 0.0,
            }),
            _ => None,
        }
    }

    /// The section configuring the run's algorithm's rollout and its size in
    /// env steps, for algorithms that train on a fixed number of env steps
    /// (PPO, A2C); none for REINFORCE, which trains on whole episodes.
    fn rollout_env_steps(&self) -> Option<(&'static str, u64)> {
        match self.run.algo.as_str() {
            "a2c" => Some((
                "a2c.n_steps x env_runner.num_envs",
                (self.a2c.n_steps * self.env_runner.num_envs) as u64,
            )),
            "reinforce" | "dqn" | "sac" => None,
            _ => Some(("ppo.rollout_steps", self.ppo.rollout_steps as u64)),
        }
    }

    /// Updates between periodic checkpoints of the run's algorithm
    /// (`<algo>.checkpoint_every`; text runs: `rl.checkpoint_every`).
    pub fn checkpoint_every(&self) -> u64 {
        if self.is_text_game() {
            return self.rl.checkpoint_every;
        }
        match self.run.algo.as_str() {
            "a2c" => self.a2c.checkpoint_every,
            "reinforce" => self.reinforce.checkpoint_every,
            "dqn" => self.dqn.checkpoint_every,
            "sac" => self.sac.checkpoint_every,
            _ => self.ppo.checkpoint_every,
        }
    }

    /// Numbered checkpoints kept (`<algo>.keep_checkpoints`; text runs:
    /// `rl.keep_checkpoints`).
    pub fn keep_checkpoints(&self) -> usize {
        if self.is_text_game() {
            return self.rl.keep_checkpoints;
        }
        match self.run.algo.as_str() {
            "a2c" => self.a2c.keep_checkpoints,
            "reinforce" => self.reinforce.keep_checkpoints,
            "dqn" => self.dqn.keep_checkpoints,
            "sac" => self.sac.keep_checkpoints,
            _ => self.ppo.keep_checkpoints,
        }
    }

    /// The discount of the run's algorithm (`ppo.gamma`, `a2c.gamma` or
    /// `reinforce.gamma`).
    pub fn algo_gamma(&self) -> f64 {
        match self.run.algo.as_str() {
            "a2c" => self.a2c.gamma,
            "reinforce" => self.reinforce.gamma,
            _ => self.ppo.gamma,
        }
    }

    /// The `normalize` section resolved for [`relay_nn::VecNormalize`]
    /// (`gamma` defaulting to the algorithm's); `None` when it is off.
    pub fn normalizer(&self) -> Option<relay_nn::NormalizeConfig> {
        let n = &self.normalize;
        n.enabled().then(|| relay_nn::NormalizeConfig {
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
    /// game has two players and the model learns).
    pub fn league_enabled(&self) -> bool {
        self.is_text_game() && self.text.league_weight() > 0.0
    }

    /// The fixed members of the league pool: the bots of `text.opponents`
    /// (whatever their weight), then those of `league.fixed`.
    pub fn league_fixed(&self) -> Vec<relay_league::FixedOpponent> {
        league_fixed_names(&self.text, &self.league)
            .iter()
            .map(|name| fixed_opponent(name, &self.text))
            .collect()
    }

    /// The algorithm that trains the run, for run ids and the registry:
    /// `run.algo` for classic envs; for text games the `rl` preset (or
    /// `custom` when `rl.objective` replaces it).
    pub fn algo_name(&self) -> &str {
        if !self.is_text_game() {
            &self.run.algo
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

    /// `policy.cnn` on its own: algorithms that have CNN policies, and a
    /// spec whose input comes from the env.
    fn validate_cnn(&self, cnn: &relay_nn::CnnSpec) -> Result<(), ConfigError> {
        if self.is_text_game() || !["ppo", "a2c"].contains(&self.run.algo.as_str()) {
            return Err(invalid(
                "policy.cnn",
                format!(
                    "CNN policies are for ppo and a2c on image observations, not run.algo {} on {}",
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
        if cnn.conv.is_empty() {
            return Err(invalid("policy.cnn.conv", "needs at least one convolution"));
        }
        if let Some(i) = cnn
            .conv
            .iter()
            .position(|c| c.channels == 0 || c.kernel == 0 || c.stride == 0)
        {
            return Err(invalid(
                "policy.cnn.conv",
                format!("layer {i}: channels, kernel and stride must be at least 1"),
            ));
        }
        positive("policy.cnn.features_dim", cnn.features_dim)
    }

    /// Whether observations travel as uint8 pixels: image observations that
    /// `normalize.obs` does not turn into floats.
    pub fn observations_as_pixels(&self, spec: &relay_envs::EnvSpec) -> bool {
        spec.image.is_some() && !self.normalize.obs
    }

    /// Checks the config against the env it runs on (known only once the
    /// env is made): `policy.cnn` needs image observations that its
    /// convolutions fit, and fragments must fit in a message.
    pub fn check_env(&self, spec: &relay_envs::EnvSpec) -> Result<(), ConfigError> {
        if let Some(cnn) = &self.policy.cnn {
            let Some(image) = spec.image else {
                return Err(invalid(
                    "policy.cnn",
                    format!(
                        "needs image observations; {} has flat observations of {} values",
                        spec.id,
                        spec.obs_dim()
                    ),
                ));
            };
            if !self.observations_as_pixels(spec) {
                return Err(invalid(
                    "normalize.obs",
                    "image observations are not normalized (the CNN scales pixels by 1/255, as SB3 does); set normalize.obs: false",
                ));
            }
            let cnn = relay_nn::CnnSpec {
                input: image,
                ..cnn.clone()
            };
            cnn.output_shapes()
                .map_err(|e| invalid("policy.cnn.conv", e.to_string()))?;
        }
        let value_bytes = if self.observations_as_pixels(spec) {
            1
        } else {
            4
        };
        self.check_fragment_size(spec.obs_dim(), value_bytes, spec.action_space.dim())
    }

    /// Refuses a fragment size that cannot travel: a wide observation (a
    /// one-hot `Discrete(500)`, an image) times `fragment_steps x num_envs`
    /// can outgrow a NATS message, and every insert would fail.
    fn check_fragment_size(
        &self,
        obs_dim: usize,
        obs_value_bytes: usize,
        action_values: usize,
    ) -> Result<(), ConfigError> {
        let (steps, n) = (self.env_runner.fragment_steps, self.env_runner.num_envs);
        // Per env step: observation, action (i64 or f32s), logprob, value,
        // reward, scaled reward, two flags; per fragment: next observations
        // and about one final observation per env; then headers.
        let obs_bytes = obs_dim * obs_value_bytes;
        let per_step = n * (obs_bytes + action_values * 8 + 16 + 2);
        let fixed = 2 * n * obs_bytes + 4096;
        let bytes = steps * per_step + fixed;
        let limit = relay_proto::MAX_MESSAGE_BYTES;
        if bytes > limit {
            let fits = limit.saturating_sub(fixed) / per_step;
            return Err(invalid(
                "env_runner.fragment_steps",
                format!(
                    "{steps} vector steps of {n} envs with {obs_dim} observation values make fragments of about {bytes} bytes, above the {limit} bytes a message may have; use at most {fits} (or fewer env_runner.num_envs)"
                ),
            ));
        }
        Ok(())
    }

    /// The spec of a built-in classic-control `run.env_id`; `None` for a
    /// text game or an env made through Python (validation asks no Python).
    fn builtin_env_spec(&self) -> Option<relay_envs::EnvSpec> {
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

/// A scheduled hyperparameter: the schedule itself is valid (errors name
/// `field.<its field>`) and its value is finite and never negative over
/// training; with `positive`, it is above zero somewhere (a learning rate
/// may warm up from 0 or decay to 0, but not stay there).
fn schedule(field: &str, s: &Schedule, positive: bool) -> Result<(), ConfigError> {
    s.validate().map_err(|e| invalid(field, e.to_string()))?;
    // Every shape is monotone or piecewise linear between its points, so
    // its extremes are at the ends, the warmup/offset joints or the points;
    // a fine grid includes all of them to within a step.
    let mut joints: Vec<f64> = (0..=1000).map(|i| i as f64 / 1000.0).collect();
    joints.extend(s.warmup.map(|w| w.fraction));
    joints.push(s.offset);
    if let Shape::PiecewiseLinear { points } = &s.shape {
        let begin = s.offset.max(s.warmup.map_or(0.0, |w| w.fraction));
        joints.extend(points.iter().map(|(q, _)| begin + q * (1.0 - begin)));
    }
    let values: Vec<f64> = joints.iter().map(|&p| s.value(p)).collect();
    if let Some(v) = values.iter().find(|v| !(v.is_finite() && **v >= 0.0)) {
        return Err(invalid(
            field,
            format!("must stay finite and >= 0 over training, reaches {v}"),
        ));
    }
    if positive && values.iter().all(|&v| v == 0.0) {
        return Err(invalid(field, "must be above zero somewhere in training"));
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
/// Secrets (`*_password`, `*_token`) are taken verbatim as strings, so a
/// password such as `123` or `yes` stays what it is.
fn set_dotted(root: &mut serde_yaml::Value, key: &str, raw: &str) -> Result<(), ConfigError> {
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
        assert_eq!(c.ppo.learning_rate, Schedule::constant(0.02));
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
    fn cnn_policies_are_checked_against_the_env_and_the_algorithm() {
        let with = |overrides: &[&str]| {
            let overrides: Vec<String> = overrides.iter().map(|s| s.to_string()).collect();
            ExperimentConfig::from_layers(BASE, "t", &[], &overrides)
        };
        let err = |r: Result<ExperimentConfig, ConfigError>| r.unwrap_err().to_string();
        let e = err(with(&["policy.cnn={}", "run.algo=dqn"]));
        assert!(e.contains("policy.cnn") && e.contains("dqn"), "{e}");
        let e = err(with(&["policy.cnn={input: [1, 2, 3]}"]));
        assert!(e.contains("policy.cnn.input"), "{e}");
        let e = err(with(&["policy.hidden=[]"]));
        assert!(e.contains("policy.hidden"), "{e}");

        let c = with(&["policy.cnn={}", "policy.hidden=[]"]).unwrap();
        let flat = relay_envs::spec("CartPole-v1").unwrap();
        let e = c.check_env(&flat).unwrap_err().to_string();
        assert!(
            e.contains("policy.cnn") && e.contains("flat observations"),
            "{e}"
        );
        let minatar = relay_envs::EnvSpec {
            id: "MinAtar/Breakout-v1",
            image: Some([4, 10, 10]),
            observation_space: relay_envs::BoxSpace {
                low: vec![0.0; 400],
                high: vec![255.0; 400],
            },
            ..flat
        };
        // NatureCNN's 8x8 kernel does not fit a 10x10 image.
        let e = c.check_env(&minatar).unwrap_err().to_string();
        assert!(
            e.contains("policy.cnn.conv") && e.contains("does not fit"),
            "{e}"
        );
        let small = with(&[
            "policy.cnn={conv: [{channels: 16, kernel: 3, stride: 1}], features_dim: 128}",
            "policy.hidden=[]",
        ])
        .unwrap();
        small.check_env(&minatar).unwrap();
        assert!(small.observations_as_pixels(&minatar));
        let mut normalized = small.clone();
        normalized.normalize.obs = true;
        let e = normalized.check_env(&minatar).unwrap_err().to_string();
        assert!(e.contains("normalize.obs"), "{e}");
    }

    #[test]
    fn fragments_too_large_for_a_message_are_refused_naming_the_field() {
        let c = ExperimentConfig::from_layers(
            BASE,
            "t",
            &[],
            &[
                "env_runner.num_envs=16".into(),
                "env_runner.fragment_steps=128".into(),
            ],
        )
        .unwrap();
        c.check_fragment_size(4, 4, 1).unwrap();
        // Taxi's one-hot Discrete(500).
        let err = c.check_fragment_size(500, 4, 1).unwrap_err().to_string();
        assert!(
            err.contains("env_runner.fragment_steps") && err.contains("at most 30"),
            "{err}"
        );
    }

    #[test]
    fn bad_values_name_the_field() {
        let err = ExperimentConfig::from_layers(BASE, "t", &[], &["ppo.gamma=1.5".into()])
            .unwrap_err()
            .to_string();
        assert!(err.contains("ppo.gamma"), "{err}");
        for age in ["0", "-3", ".nan"] {
            let err =
                ExperimentConfig::from_layers(BASE, "t", &[], &[format!("replay.max_age_s={age}")])
                    .unwrap_err()
                    .to_string();
            assert!(err.contains("replay.max_age_s"), "{age}: {err}");
        }
        // With env.backend auto an id relay lacks goes to Gymnasium, which
        // names it when the env is made (relay_bridge's tests); `builtin`
        // refuses it here.
        let auto = ExperimentConfig::from_layers(BASE, "t", &[], &["run.env_id=Nope-v0".into()]);
        assert!(auto.unwrap().env.uses_python("Nope-v0"));
        let err = ExperimentConfig::from_layers(
            BASE,
            "t",
            &[],
            &["run.env_id=Nope-v0".into(), "env.backend=builtin".into()],
        )
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
    fn normalize_section_defaults_off_resolves_gamma_and_names_bad_fields() {
        let c = ExperimentConfig::from_layers(BASE, "t", &[], &[]).unwrap();
        assert!(!c.normalize.enabled());
        assert_eq!(c.normalizer(), None);
        let c = ExperimentConfig::from_layers(
            BASE,
            "t",
            &[],
            &["normalize.obs=true".into(), "ppo.gamma=0.9".into()],
        )
        .unwrap();
        let n = c.normalizer().unwrap();
        assert!(n.norm_obs && !n.norm_reward);
        assert_eq!(
            (n.clip_obs, n.clip_reward, n.gamma, n.epsilon),
            (10.0, 10.0, 0.9, 1e-8)
        );
        let c = ExperimentConfig::from_layers(
            BASE,
            "t",
            &[],
            &[
                "normalize.reward=true".into(),
                "normalize.gamma=0.5".into(),
                "run.algo=a2c".into(),
                "env_runner.fragment_steps=5".into(),
            ],
        )
        .unwrap();
        assert_eq!(c.normalizer().unwrap().gamma, 0.5);
        for (set, field) in [
            ("normalize.clip_obs=0", "normalize.clip_obs"),
            ("normalize.clip_reward=-1", "normalize.clip_reward"),
            ("normalize.gamma=1.5", "normalize.gamma"),
            ("normalize.epsilon=0", "normalize.epsilon"),
            ("normalize.obss=true", "obss"),
        ] {
            let err = ExperimentConfig::from_layers(BASE, "t", &[], &[set.into()])
                .unwrap_err()
                .to_string();
            assert!(err.contains(field), "{set}: {err}");
        }
        let err = ExperimentConfig::from_layers(
            "run:\n  env_id: TicTacToe-v0\n",
            "t",
            &[],
            &["normalize.reward=true".into()],
        )
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("normalize.reward") && err.contains("text games"),
            "{err}"
        );
        let err = ExperimentConfig::from_layers(
            BASE,
            "t",
            &[],
            &["run.algo=dqn".into(), "normalize.obs=true".into()],
        )
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("normalize.obs") && err.contains("dqn"),
            "{err}"
        );
    }

    #[test]
    fn secrets_never_print_or_serialise() {
        let c = ExperimentConfig::from_layers(
            BASE,
            "t",
            &[
                ("connections.nats_password".into(), "hunter2-nats".into()),
                ("connections.redis_password".into(), "12345".into()),
            ],
            &[
                "connections.nats_user=learner".into(),
                "connections.nats_url=nats://a:pw-in-url@h1:4222,nats://h2:4222".into(),
            ],
        )
        .unwrap();
        assert_eq!(
            c.connections.nats_password.as_ref().unwrap().expose(),
            "hunter2-nats"
        );
        // A numeric-looking secret stays a string.
        assert_eq!(
            c.connections.redis_password.as_ref().unwrap().expose(),
            "12345"
        );
        let yaml = c.to_yaml();
        let debug = format!("{c:?}");
        let json = serde_json::to_string(&c).unwrap();
        for text in [&yaml, &debug, &json] {
            for secret in ["hunter2-nats", "12345", "pw-in-url"] {
                assert!(!text.contains(secret), "{secret} leaked in {text}");
            }
            assert!(text.contains("***"), "{text}");
        }
        assert!(
            yaml.contains("nats://a:***@h1:4222,nats://h2:4222"),
            "{yaml}"
        );
        assert!(yaml.contains("nats_user: learner"), "{yaml}");

        let token = ExperimentConfig::from_layers(
            BASE,
            "t",
            &[("connections.nats_token".into(), "s3cr3t-token".into())],
            &["connections.redis_url=redis://:redispw@r:6379/0".into()],
        )
        .unwrap();
        let text = format!("{token:?}\n{}", token.to_yaml());
        assert!(
            !text.contains("s3cr3t-token") && !text.contains("redispw"),
            "{text}"
        );
        assert!(text.contains("redis://:***@r:6379/0"), "{text}");
    }

    #[test]
    fn redacts_urls() {
        assert_eq!(redact_url("nats://127.0.0.1:4222"), "nats://127.0.0.1:4222");
        assert_eq!(redact_url("nats://u:p@h:1"), "nats://u:***@h:1");
        assert_eq!(redact_url("nats://tok@h:1"), "nats://***@h:1");
        assert_eq!(
            redact_url("redis://u:p@ss@h:6379/0?x=a@b"),
            "redis://u:***@h:6379/0?x=a@b"
        );
    }

    #[test]
    fn incomplete_credentials_name_the_field() {
        let cases = [
            (vec!["connections.nats_user=u"], "connections.nats_password"),
            (vec!["connections.nats_password=p"], "connections.nats_user"),
            (
                vec![
                    "connections.nats_user=u",
                    "connections.nats_password=p",
                    "connections.nats_token=t",
                ],
                "connections.nats_token",
            ),
            (
                vec!["connections.nats_tls_cert=c.pem"],
                "connections.nats_tls_key",
            ),
            (
                vec!["connections.nats_tls_key=k.pem"],
                "connections.nats_tls_cert",
            ),
            (vec!["connections.nats_token="], "connections.nats_token"),
            (
                vec![
                    "connections.redis_url=redis://:a@h:1",
                    "connections.redis_password=b",
                ],
                "connections.redis_password",
            ),
        ];
        for (sets, field) in cases {
            let sets: Vec<String> = sets.into_iter().map(String::from).collect();
            let err = ExperimentConfig::from_layers(BASE, "t", &[], &sets)
                .unwrap_err()
                .to_string();
            assert!(err.contains(field), "{sets:?}: {err}");
        }
    }

    const TEXT: &str = "run:\n  env_id: TicTacToe-v0\n";

    #[test]
    fn text_games_are_env_ids_and_unknown_ids_list_both_kinds() {
        let c = ExperimentConfig::from_layers(TEXT, "t", &[], &[]).unwrap();
        assert!(c.is_text_game());
        assert_eq!(c.text.opponent_weights().unwrap().len(), 1);
        let err = ExperimentConfig::from_layers(
            TEXT,
            "t",
            &[],
            &[
                "run.env_id=TicTacToe-v9".into(),
                "env.backend=builtin".into(),
            ],
        )
        .unwrap_err()
        .to_string();
        for needle in [
            "run.env_id",
            "TicTacToe-v9",
            "CartPole-v1",
            "TicTacToe-v0",
            "KuhnPoker-v0",
        ] {
            assert!(err.contains(needle), "{needle}: {err}");
        }
    }

    #[test]
    fn text_fields_are_checked_and_errors_name_them() {
        let cases: &[(&[&str], &str)] = &[
            (&["text.opponents.nobody=1"], "text.opponents.nobody"),
            (
                &["text.opponents.connect_four_bot=1"],
                "text.opponents.connect_four_bot",
            ),
            (&["text.opponents.random=-1"], "text.opponents.random"),
            (&["text.opponents.random=0"], "text.opponents"),
            (&["text.opponents.adapter:=1"], "text.opponents.adapter:"),
            (&["text.games_in_flight=0"], "text.games_in_flight"),
            (&["text.branches=0"], "text.branches"),
            (&["text.max_turn_tokens=0"], "text.max_turn_tokens"),
            (&["text.max_turn_tokens=100000"], "text.max_turn_tokens"),
            (&["text.temperature=-0.5"], "text.temperature"),
            (&["text.top_p=0"], "text.top_p"),
            (&["text.top_p=1.5"], "text.top_p"),
            (&["text.system_prompt=' '"], "text.system_prompt"),
            (&["text.learner=alphago"], "text.learner"),
            (&["text.learner=connect_four_bot"], "text.learner"),
            (&["text.generate_attempts=0"], "text.generate_attempts"),
            (&["text.generate_timeout_ms=0"], "text.generate_timeout_ms"),
            (&["text.constrainted=true"], "constrainted"),
            (&["text.observation=last"], "text.observation"),
            (&["text.branch_at=first_win"], "text.branch_at"),
        ];
        for (sets, field) in cases {
            let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
            let err = ExperimentConfig::from_layers(TEXT, "t", &[], &sets)
                .unwrap_err()
                .to_string();
            assert!(err.contains(field), "{sets:?}: {err}");
        }
        let c = ExperimentConfig::from_layers(
            TEXT,
            "t",
            &[],
            &[
                "text.opponents.minimax=2".into(),
                "text.opponents.self=1".into(),
                "text.opponents.adapter:v1.old=0.5".into(),
                "text.learner=minimax".into(),
                "text.constrained=true".into(),
                "text.system_prompt=Play well.".into(),
            ],
        );
        // `--set` splits keys on dots, so an adapter name with a dot needs the file.
        assert!(c.is_err());
        let yaml = "run:\n  env_id: TicTacToe-v0\ntext:\n  learner: minimax\n  constrained: true\n  system_prompt: Play well.\n  opponents: {minimax: 2, self: 1, 'adapter:v1.old': 0.5}\n";
        let c = ExperimentConfig::from_layers(yaml, "t", &[], &[]).unwrap();
        let opponents = c.text.opponent_weights().unwrap();
        assert_eq!(
            opponents,
            vec![
                (Opponent::Adapter("v1.old".into()), 0.5),
                (Opponent::Bot("minimax".into()), 2.0),
                (Opponent::SelfPlay, 1.0),
            ]
        );
        assert_eq!(c.text.learner_bot(), Some("minimax"));
        // The text section does not bother classic runs, but is still checked.
        ExperimentConfig::from_layers(BASE, "t", &[], &["text.opponents.minimax=1".into()])
            .unwrap();
        assert!(ExperimentConfig::from_layers(BASE, "t", &[], &["text.top_p=2".into()]).is_err());
    }

    #[test]
    fn text_games_weigh_several_games_and_bad_entries_are_named() {
        // Unset: the run's env alone.
        let c = ExperimentConfig::from_layers(TEXT, "t", &[], &[]).unwrap();
        assert_eq!(
            c.text.game_weights(&c.run.env_id),
            vec![("TicTacToe-v0".to_string(), 1.0)]
        );
        assert!(!c.text.multi_game());
        let yaml =
            "run:\n  env_id: TicTacToe-v0\ntext:\n  games: {TicTacToe-v0: 2, KuhnPoker-v0: 1}\n";
        let c = ExperimentConfig::from_layers(yaml, "t", &[], &[]).unwrap();
        assert_eq!(
            c.text.game_weights(&c.run.env_id),
            vec![
                ("KuhnPoker-v0".to_string(), 1.0),
                ("TicTacToe-v0".to_string(), 2.0)
            ]
        );
        assert!(c.text.multi_game());
        let cases: &[(&str, &[&str])] = &[
            (
                "text:\n  games: {TicTacToe-v0: 1, Chess-v0: 1}\n",
                &["text.games.Chess-v0", "unknown text game", "KuhnPoker-v0"],
            ),
            (
                "text:\n  games: {TicTacToe-v0: 1, CartPole-v1: 1}\n",
                &["text.games.CartPole-v1", "classic-control"],
            ),
            (
                "text:\n  games: {TicTacToe-v0: 1, KuhnPoker-v0: -1}\n",
                &["text.games.KuhnPoker-v0", ">= 0"],
            ),
            (
                "text:\n  games: {TicTacToe-v0: 1, KuhnPoker-v0: .nan}\n",
                &["text.games.KuhnPoker-v0", "NaN"],
            ),
            (
                "text:\n  games: {TicTacToe-v0: 0, KuhnPoker-v0: 0}\n",
                &["text.games", "every weight is 0"],
            ),
            ("text:\n  games: {}\n", &["text.games", "no game"]),
            (
                "text:\n  games: {KuhnPoker-v0: 1, ConnectFour-v0: 1}\n",
                &["text.games", "TicTacToe-v0"],
            ),
            (
                "text:\n  games: {TicTacToe-v0: 1, KuhnPoker-v0: 1}\n  opponents: {random: 1, minimax: 1}\n",
                &["text.opponents.minimax", "does not play KuhnPoker-v0"],
            ),
            (
                "text:\n  games: {TicTacToe-v0: 1, KuhnPoker-v0: 1}\n  learner: minimax\n",
                &["text.learner", "does not play KuhnPoker-v0"],
            ),
            (
                "text:\n  games: {TicTacToe-v0: 1, KuhnPoker-v0: 1}\n  opponents: {random: 1, league: 1}\n",
                &["text.opponents.league", "one game"],
            ),
        ];
        for (text, needles) in cases {
            let yaml = format!("{TEXT}{text}");
            let err = ExperimentConfig::from_layers(&yaml, "t", &[], &[])
                .unwrap_err()
                .to_string();
            for needle in *needles {
                assert!(err.contains(needle), "{text}: {needle}: {err}");
            }
        }
        // A classic run cannot list text games.
        let err = ExperimentConfig::from_layers(
            &format!("{BASE}text:\n  games: {{TicTacToe-v0: 1}}\n"),
            "t",
            &[],
            &[],
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("text.games") && err.contains("mix"), "{err}");
    }

    #[test]
    fn league_section_is_validated_by_field() {
        let yaml = "run:\n  env_id: TicTacToe-v0\ntext:\n  opponents: {league: 3, random: 1, minimax: 0}\nleague:\n  fixed: [random]\n  pool: {keep_latest: 4}\n  sampler:\n    kind: mixture\n    components:\n      - {weight: 1, sampler: {kind: mirror}}\n      - {weight: 1, sampler: {kind: lagged, k: 2}}\n      - {weight: 1, sampler: {kind: fixed, opponents: [{opponent: minimax, weight: 1}]}}\n";
        let c = ExperimentConfig::from_layers(yaml, "t", &[], &[]).unwrap();
        assert!(c.league_enabled());
        assert_eq!(c.text.league_weight(), 3.0);
        // `league` is not an opponent of its own: the sampler chooses.
        assert_eq!(
            c.text.opponent_weights().unwrap(),
            vec![
                (Opponent::Bot("minimax".into()), 0.0),
                (Opponent::Bot("random".into()), 1.0),
            ]
        );
        let fixed: Vec<String> = c.league_fixed().into_iter().map(|f| f.name).collect();
        assert_eq!(fixed, vec!["minimax".to_string(), "random".to_string()]);
        assert_eq!(c.league.pool.keep_latest, 4);
        // Adapters join as fixed members, from text.opponents and league.fixed.
        let with_adapters = ExperimentConfig::from_layers(
            yaml,
            "t",
            &[],
            &[
                "text.opponents.adapter:sft=0".into(),
                "league.fixed=[random, 'adapter:best']".into(),
            ],
        )
        .unwrap();
        let fixed: Vec<(String, relay_league::FixedKind)> = with_adapters
            .league_fixed()
            .into_iter()
            .map(|f| (f.name, f.kind))
            .collect();
        assert_eq!(
            fixed[2..],
            [
                (
                    "adapter:sft".to_string(),
                    relay_league::FixedKind::Adapter { path: "sft".into() }
                ),
                (
                    "adapter:best".to_string(),
                    relay_league::FixedKind::Adapter {
                        path: "best".into()
                    }
                ),
            ]
        );
        let off = ExperimentConfig::from_layers(TEXT, "t", &[], &[]).unwrap();
        assert!(!off.league_enabled());
        assert_eq!(off.league, LeagueSection::default());

        let cases: &[(&[&str], &str)] = &[
            (&["league.pool.keep_latest=0"], "league.pool.keep_latest"),
            (
                &["league.pool.trueskill.beta=-1"],
                "league.pool.trueskill.beta",
            ),
            (&["league.pool.keep_lates=3"], "keep_lates"),
            (&["league.fixed=[alphago]"], "league.fixed[0]"),
            (&["league.fixed=['adapter:']"], "league.fixed[0]"),
            (&["league.fixed=[connect_four_bot]"], "league.fixed[0]"),
            (
                &["league.sampler={kind: match_quality, temperature: 0}"],
                "league.sampler.temperature",
            ),
            (
                &["league.sampler={kind: mixture, components: [{weight: 1, sampler: {kind: fixed, opponents: [{opponent: minimax, weight: 1}]}}]}"],
                "league.sampler.components[0].sampler.opponents[0].opponent",
            ),
            (&["league.sampler={kind: best}"], "best"),
            (&["text.opponents.league=-1"], "text.opponents.league"),
            (
                &["text.opponents.league=1", "text.learner=random"],
                "text.opponents.league",
            ),
            (
                &["text.opponents.league=1", "run.env_id=GuessTheNumber-v0"],
                "text.opponents.league",
            ),
        ];
        for (sets, field) in cases {
            let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
            let err = ExperimentConfig::from_layers(TEXT, "t", &[], &sets)
                .unwrap_err()
                .to_string();
            assert!(err.contains(field), "{sets:?}: {err}");
        }
        // league.fixed puts minimax in the pool, so a fixed sampler may name it.
        ExperimentConfig::from_layers(
            TEXT,
            "t",
            &[],
            &[
                "league.fixed=[minimax]".into(),
                "league.sampler={kind: fixed, opponents: [{opponent: minimax, weight: 1}]}".into(),
            ],
        )
        .unwrap();
    }

    #[test]
    fn opponents_parse_and_print_back() {
        for name in [
            "self",
            "base",
            "random",
            "minimax",
            "connect_four_bot",
            "adapter:old-1",
        ] {
            assert_eq!(Opponent::parse(name).unwrap().label(), name);
        }
        assert!(Opponent::parse("adapter:a b").is_err());
        let err = Opponent::parse("gpt").unwrap_err();
        assert!(err.contains("gpt") && err.contains("minimax"), "{err}");
        let builtin = EnvSection::default();
        let minimax = Opponent::parse("minimax").unwrap();
        assert!(minimax.check_game("ConnectFour-v0", &builtin).is_err());
        assert!(minimax.check_game("TicTacToe-v0", &builtin).is_ok());
        assert!(Opponent::parse("random")
            .unwrap()
            .check_game("KuhnPoker-v0", &builtin)
            .is_ok());
        // TextArena's TicTacToe is not relay's: minimax cannot search it.
        let textarena = EnvSection {
            backend: relay_bridge::Backend::Textarena,
            ..EnvSection::default()
        };
        let err = minimax.check_game("TicTacToe-v0", &textarena).unwrap_err();
        assert!(
            err.contains("minimax") && err.contains("TicTacToe-v0"),
            "{err}"
        );
    }

    #[test]
    fn llm_section_is_validated_by_field() {
        let c = ExperimentConfig::from_layers(
            BASE,
            "t",
            &[],
            &[
                "llm.model=smollm2".into(),
                "llm.gguf_base=quantized".into(),
                "llm.adapters.opponent=adapters/opp".into(),
            ],
        )
        .unwrap();
        assert_eq!(c.llm.gguf_base, GgufBaseName::Quantized);
        assert!(c.serves_llm() && !c.is_text_game());
        assert_eq!(c.llm.adapters["opponent"], PathBuf::from("adapters/opp"));
        let cases = [
            ("llm.max_sequences=0", "llm.max_sequences"),
            ("llm.max_queue=0", "llm.max_queue"),
            ("llm.max_adapters=0", "llm.max_adapters"),
            ("llm.threads=0", "llm.threads"),
            ("llm.model=''", "llm.model"),
            ("llm.gguf_base=q8", "gguf_base"),
            ("llm.adapters.x=''", "llm.adapters.x"),
            ("llm.max_sequence=3", "max_sequence"),
            ("llm.device=cuda", "llm.device"),
            ("llm.device=gpu0", "cuda:N"),
            ("llm.dtype=f8", "dtype"),
            ("llm.backend=vllm", "backend"),
        ];
        for (set, field) in cases {
            let err = ExperimentConfig::from_layers(BASE, "t", &[], &[set.into()])
                .unwrap_err()
                .to_string();
            assert!(err.contains(field), "{set}: {err}");
        }
        let text =
            ExperimentConfig::from_layers(BASE, "t", &[], &["run.env_id=TicTacToe-v0".into()])
                .unwrap();
        assert!(text.is_text_game() && text.serves_llm());
        let candle = ExperimentConfig::from_layers(
            BASE,
            "t",
            &[],
            &["llm.backend=candle".into(), "llm.dtype=bf16".into()],
        )
        .unwrap();
        assert_eq!(candle.llm.backend_spec().dtype, relay_llm::LlmDtype::Bf16);
        // `auto` (the default) takes the candle backend for bf16; the engine refuses it.
        let auto =
            ExperimentConfig::from_layers(BASE, "t", &[], &["llm.dtype=bf16".into()]).unwrap();
        assert_eq!(
            auto.llm.backend_spec().resolved_kind(),
            relay_llm::BackendKind::Candle
        );
        let err = ExperimentConfig::from_layers(
            BASE,
            "t",
            &[],
            &["llm.backend=engine".into(), "llm.dtype=bf16".into()],
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("llm.dtype"), "{err}");
        // CUDA without the feature: the field, and how to build with it.
        if !relay_llm::CUDA_BUILT {
            let err = ExperimentConfig::from_layers(
                BASE,
                "t",
                &[],
                &["llm.backend=candle".into(), "llm.device=cuda:0".into()],
            )
            .unwrap_err()
            .to_string();
            assert!(
                err.contains("llm.device") && err.contains("just build-cuda"),
                "{err}"
            );
        }
    }

    #[test]
    fn unknown_algo_names_run_algo_and_the_known_ones() {
        let err = ExperimentConfig::from_layers(BASE, "t", &[], &["run.algo=td3".into()])
            .unwrap_err()
            .to_string();
        assert!(err.contains("run.algo") && err.contains("\"td3\""), "{err}");
        for algo in CLASSIC_ALGOS {
            assert!(err.contains(algo), "{err}");
        }
    }

    #[test]
    fn a2c_and_reinforce_sections_have_sb3_defaults_and_checked_fields() {
        let c = ExperimentConfig::from_layers(
            BASE,
            "t",
            &[],
            &["run.algo=a2c".into(), "env_runner.fragment_steps=5".into()],
        )
        .unwrap();
        assert_eq!(c.algo_name(), "a2c");
        let a = &c.a2c;
        assert_eq!((a.n_steps, a.gamma, a.gae_lambda), (5, 0.99, 1.0));
        assert_eq!(a.learning_rate, Schedule::constant(7e-4));
        assert_eq!((a.vf_coef, a.max_grad_norm), (0.5, 0.5));
        assert!(a.use_rms_prop && !a.normalize_advantage);
        assert_eq!((a.rms_prop_alpha, a.rms_prop_eps), (0.99, 1e-5));
        assert_eq!(c.checkpoint_every(), a.checkpoint_every);
        // A2C's rollout is one fragment: the two lengths must agree.
        let err = ExperimentConfig::from_layers(BASE, "t", &[], &["run.algo=a2c".into()])
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("env_runner.fragment_steps") && err.contains("a2c.n_steps"),
            "{err}"
        );
        let err = ExperimentConfig::from_layers(
            BASE,
            "t",
            &[],
            &[
                "run.algo=a2c".into(),
                "env_runner.fragment_steps=100".into(),
                "a2c.n_steps=100".into(),
                "replay.capacity_steps=512".into(),
            ],
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("replay.capacity_steps"), "{err}");
        let r =
            ExperimentConfig::from_layers(BASE, "t", &[], &["run.algo=reinforce".into()]).unwrap();
        assert_eq!(r.reinforce.baseline, Baseline::Value);
        assert_eq!(r.keep_checkpoints(), r.reinforce.keep_checkpoints);
        let cases = [
            ("a2c.gamma=2", "a2c.gamma"),
            ("a2c.rms_prop_alpha=1", "a2c.rms_prop_alpha"),
            ("a2c.learning_rate=0", "a2c.learning_rate"),
            ("a2c.ent_coef=-0.1", "a2c.ent_coef"),
            ("reinforce.batch_episodes=0", "reinforce.batch_episodes"),
            ("reinforce.baseline=mean", "`value` or `none`"),
            ("reinforce.max_grad_norm=0", "reinforce.max_grad_norm"),
            ("reinforce.lr=1", "lr"),
        ];
        for (set, field) in cases {
            let err = ExperimentConfig::from_layers(BASE, "t", &[], &[set.into()])
                .unwrap_err()
                .to_string();
            assert!(err.contains(field), "{set}: {err}");
        }
    }

    #[test]
    fn dqn_section_has_sb3_defaults_and_checked_fields() {
        let c = ExperimentConfig::from_layers(BASE, "t", &[], &["run.algo=dqn".into()]).unwrap();
        let d = &c.dqn;
        assert_eq!(
            (d.buffer_size, d.learning_starts, d.batch_size),
            (1_000_000, 100, 32)
        );
        assert_eq!(
            (d.train_freq, d.gradient_steps, d.target_update_interval),
            (4, 1, 10_000)
        );
        assert_eq!((d.tau, d.gamma, d.max_grad_norm), (1.0, 0.99, 10.0));
        assert_eq!(d.learning_rate, Schedule::constant(1e-4));
        assert_eq!(c.checkpoint_every(), d.checkpoint_every);
        let table = c.off_policy_table().unwrap();
        assert_eq!(
            (table.capacity, table.n_steps, table.prioritized),
            (1_000_000, 1, false)
        );
        // Epsilon: SB3's linear schedule, constant after exploration_fraction.
        assert_eq!(d.exploration_rate(0.0), 1.0);
        assert!((d.exploration_rate(0.05) - 0.525).abs() < 1e-12);
        assert_eq!(d.exploration_rate(0.1), 0.05);
        assert_eq!(d.exploration_rate(0.7), 0.05);
        let ppo = ExperimentConfig::from_layers(BASE, "t", &[], &[]).unwrap();
        assert!(ppo.off_policy_table().is_none());
        let cases = [
            ("dqn.gamma=1.5", "dqn.gamma"),
            ("dqn.tau=0", "dqn.tau"),
            ("dqn.batch_size=0", "dqn.batch_size"),
            ("dqn.train_freq=0", "dqn.train_freq"),
            (
                "dqn.exploration_final_eps=-0.1",
                "dqn.exploration_final_eps",
            ),
            ("dqn.n_steps=0", "dqn.n_steps"),
            ("dqn.prioritized_alpha=-1", "dqn.prioritized_alpha"),
            ("dqn.prioritized_beta=1.5", "dqn.prioritized_beta"),
            ("dqn.buffer_size=16", "dqn.batch_size"),
            ("dqn.learning_rate=0", "dqn.learning_rate"),
            ("dqn.epsilon=0.1", "epsilon"),
        ];
        for (set, field) in cases {
            let err =
                ExperimentConfig::from_layers(BASE, "t", &[], &["run.algo=dqn".into(), set.into()])
                    .unwrap_err()
                    .to_string();
            assert!(err.contains(field), "{set}: {err}");
        }
        let err = ExperimentConfig::from_layers(
            BASE,
            "t",
            &[],
            &["run.algo=dqn".into(), "run.env_id=Pendulum-v1".into()],
        )
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("run.algo") && err.contains("discrete"),
            "{err}"
        );
    }

    const PENDULUM: &str = "run:\n  env_id: Pendulum-v1\n  algo: sac\n";

    #[test]
    fn sac_section_has_sb3_defaults_and_checked_fields() {
        let c = ExperimentConfig::from_layers(PENDULUM, "t", &[], &[]).unwrap();
        let s = &c.sac;
        assert_eq!(
            (s.buffer_size, s.learning_starts, s.batch_size),
            (1_000_000, 100, 256)
        );
        assert_eq!(
            (s.train_freq, s.gradient_steps, s.target_update_interval),
            (1, 1, 1)
        );
        assert_eq!((s.tau, s.gamma), (0.005, 0.99));
        assert_eq!(s.learning_rate, Schedule::constant(3e-4));
        assert_eq!(s.net_arch, vec![256, 256]);
        assert_eq!((s.log_std_min, s.log_std_max), (-20.0, 2.0));
        assert_eq!(s.ent_coef().unwrap(), EntCoef::Auto { initial: 1.0 });
        assert_eq!(s.target_entropy_for(1).unwrap(), -1.0);
        assert_eq!(c.checkpoint_every(), s.checkpoint_every);
        assert_eq!(c.keep_checkpoints(), s.keep_checkpoints);
        let table = c.off_policy_table().unwrap();
        assert_eq!(
            (
                table.capacity,
                table.n_steps,
                table.prioritized,
                table.gamma
            ),
            (1_000_000, 1, false, 0.99)
        );
        // SB3's spellings of ent_coef and target_entropy.
        let with = |sets: &[&str]| {
            let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
            ExperimentConfig::from_layers(PENDULUM, "t", &[], &sets)
        };
        let c = with(&["sac.ent_coef=auto_0.1", "sac.target_entropy=-3.5"]).unwrap();
        assert_eq!(c.sac.ent_coef().unwrap(), EntCoef::Auto { initial: 0.1 });
        assert_eq!(c.sac.target_entropy_for(1).unwrap(), -3.5);
        let c = with(&["sac.ent_coef=0.2"]).unwrap();
        assert_eq!(c.sac.ent_coef().unwrap(), EntCoef::Fixed(0.2));
        // The written config reads back the same.
        let again = ExperimentConfig::from_layers(&c.to_yaml(), "t", &[], &[]).unwrap();
        assert_eq!(again.sac, c.sac);
        let cases = [
            ("sac.gamma=1.5", "sac.gamma"),
            ("sac.tau=2", "sac.tau"),
            ("sac.batch_size=0", "sac.batch_size"),
            ("sac.train_freq=0", "sac.train_freq"),
            ("sac.gradient_steps=0", "sac.gradient_steps"),
            ("sac.target_update_interval=0", "sac.target_update_interval"),
            ("sac.buffer_size=16", "sac.batch_size"),
            ("sac.learning_rate=0", "sac.learning_rate"),
            ("sac.ent_coef=automatic", "sac.ent_coef"),
            ("sac.ent_coef=auto_-1", "sac.ent_coef"),
            ("sac.ent_coef=0", "sac.ent_coef"),
            ("sac.target_entropy=high", "sac.target_entropy"),
            ("sac.net_arch=[]", "sac.net_arch"),
            ("sac.net_arch=[64, 0]", "sac.net_arch"),
            ("sac.log_std_min=3", "sac.log_std_min"),
            ("sac.use_sde=true", "use_sde"),
            ("normalize.obs=true", "normalize.obs"),
            ("normalize.reward=true", "normalize.reward"),
        ];
        for (set, field) in cases {
            let err = with(&[set]).unwrap_err().to_string();
            assert!(err.contains(field), "{set}: {err}");
        }
        // SAC needs continuous actions: CartPole's are discrete.
        let err = with(&["run.env_id=CartPole-v1"]).unwrap_err().to_string();
        assert!(
            err.contains("run.algo") && err.contains("continuous") && err.contains("CartPole-v1"),
            "{err}"
        );
    }

    #[test]
    fn hyperparameters_take_schedules_and_the_old_shorthand() {
        // The old spelling: a constant plus `linear`.
        let c = ExperimentConfig::from_layers(
            BASE,
            "t",
            &[],
            &[
                "ppo.learning_rate=0.001".into(),
                "ppo.lr_schedule=linear".into(),
                "ppo.clip_schedule=constant".into(),
            ],
        )
        .unwrap();
        let lr = c.ppo.learning_rate_schedule();
        assert_eq!(lr, Schedule::linear(0.001, 0.0));
        assert!((lr.value(0.25) - 0.00075).abs() < 1e-12);
        assert_eq!(c.ppo.clip_range_schedule(), Schedule::constant(0.2));
        // Any shape in place, with warmup and offset, for lr, clip and entropy.
        let text = format!(
            "{BASE}  learning_rate: {{kind: cosine, start: 0.001, end: 0.0, warmup: {{fraction: 0.1}}}}\n  clip_range: {{kind: piecewise_linear, points: [[0.0, 0.3], [0.5, 0.1]]}}\n  ent_coef: {{kind: exponential, start: 0.01, end: 0.0001, offset: 0.5}}\na2c:\n  learning_rate: {{kind: linear, start: 0.0007, end: 0.0}}\n"
        );
        let c = ExperimentConfig::from_layers(&text, "t", &[], &[]).unwrap();
        let lr = c.ppo.learning_rate_schedule();
        assert_eq!(lr.value(0.0), 0.0);
        assert!((lr.value(0.1) - 0.001).abs() < 1e-12);
        assert!((c.ppo.clip_range_schedule().value(0.25) - 0.2).abs() < 1e-12);
        assert!((c.ppo.ent_coef.value(0.75) - 0.001).abs() < 1e-12);
        assert!((c.a2c.learning_rate.value(0.5) - 0.00035).abs() < 1e-12);
        // It round-trips through the YAML written into run directories.
        let back = ExperimentConfig::from_layers(&c.to_yaml(), "t", &[], &[]).unwrap();
        assert_eq!(back, c);
        // `linear` on a schedule map, a negative stretch, a bad shape: refused by name.
        let cases = [
            (
                "ppo.learning_rate={kind: cosine, start: 1, end: 0}",
                Some("ppo.lr_schedule=linear"),
                "ppo.lr_schedule",
            ),
            (
                "ppo.ent_coef={kind: linear, start: 0.01, end: -0.01}",
                None,
                "ppo.ent_coef",
            ),
            (
                "ppo.clip_range={kind: exponential, start: 0.2, end: 0}",
                None,
                "ppo.clip_range",
            ),
            ("ppo.clip_range={kind: step, value: 1}", None, "step"),
        ];
        for (set, extra, field) in cases {
            let mut sets = vec![set.to_string()];
            sets.extend(extra.map(String::from));
            let err = ExperimentConfig::from_layers(BASE, "t", &[], &sets)
                .unwrap_err()
                .to_string();
            assert!(err.contains(field), "{set}: {err}");
        }
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

#[cfg(test)]
mod text_training_tests {
    use super::*;

    const TEXT: &str = "run:\n  env_id: TicTacToe-v0\n";

    #[test]
    fn rl_presets_are_chosen_by_name_and_a_full_objective_replaces_them() {
        let c = ExperimentConfig::from_layers(TEXT, "test", &[], &[]).unwrap();
        let train = c.rl.train_config(32).unwrap();
        assert_eq!(train.objective, relay_llm::ObjectiveConfig::grpo());
        assert_eq!(train.batch.batch_size, c.rl.batch_size);
        let c =
            ExperimentConfig::from_layers(TEXT, "test", &[], &["rl.preset=rloo".into()]).unwrap();
        assert_eq!(
            c.rl.train_config(32).unwrap().objective,
            relay_llm::ObjectiveConfig::rloo()
        );
        let c = ExperimentConfig::from_layers(TEXT, "test", &[], &["rl.preset=dr_grpo".into()])
            .unwrap();
        assert_eq!(
            c.rl.train_config(7).unwrap().objective,
            relay_llm::ObjectiveConfig::dr_grpo(7)
        );
        let full = format!(
            "{TEXT}rl:\n  objective:\n    advantage: {{kind: rloo}}\n    policy_loss: {{kind: policy_gradient}}\n    entropy_coef: 0.01\n"
        );
        let c = ExperimentConfig::from_layers(&full, "test", &[], &[]).unwrap();
        let objective = c.rl.train_config(32).unwrap().objective;
        assert_eq!(objective.entropy_coef, 0.01);
        assert_eq!(objective.advantage, relay_llm::AdvantageEstimator::Rloo);
        // `rl.truncated_is` applies over the preset.
        let c = ExperimentConfig::from_layers(
            TEXT,
            "test",
            &[],
            &["rl.truncated_is={cap: 2.0}".into()],
        )
        .unwrap();
        let objective = c.rl.train_config(32).unwrap().objective;
        assert_eq!(
            objective.truncated_is,
            Some(relay_llm::TruncatedIs { cap: 2.0 })
        );
        assert_eq!(
            objective.policy_loss,
            relay_llm::ObjectiveConfig::grpo().policy_loss
        );
    }

    #[test]
    fn bad_rl_and_lora_fields_are_named() {
        let err = |set: &str| {
            ExperimentConfig::from_layers(TEXT, "test", &[], &[set.into()])
                .unwrap_err()
                .to_string()
        };
        assert!(err("rl.preset=a2c").contains("rl.preset"));
        assert!(err("rl.batch_size=0").contains("rl.batch_size"));
        assert!(err("rl.max_seq_len=1").contains("max_seq_len"));
        let e = err("rl.truncated_is={cap: 0.5}");
        assert!(e.contains("truncated_is.cap"), "{e}");
        for discount in ["0", "1.5"] {
            let e = err(&format!("rl.reward.discount={discount}"));
            assert!(e.contains("rl.reward: config `discount`"), "{e}");
        }
        let e = err("rl.reward.draw=.nan");
        assert!(e.contains("rl.reward: config `draw`"), "{e}");
        assert!(err("lora.rank=0").contains("lora.rank"));
        assert!(err("lora.target_modules=[qkv]").contains("lora.target_modules"));
        assert!(err("lora.inline_max_bytes=99999999").contains("lora.inline_max_bytes"));
        let c = ExperimentConfig::from_layers(
            TEXT,
            "test",
            &[],
            &["lora.target_modules=[q_proj, v_proj]".into()],
        )
        .unwrap();
        let lora = c.lora.lora_config().unwrap();
        assert_eq!(
            lora.targets,
            vec![relay_llm::LoraTarget::QProj, relay_llm::LoraTarget::VProj]
        );
        assert_eq!(lora.scaling(), 2.0);
    }
}
