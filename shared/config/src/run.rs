//! The `run` section: the run's id, env, algorithm, seed, budget and
//! folders, and where it resumes or starts from.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::check::yes;

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
    #[serde(default)]
    pub algo: Algo,
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

/// The algorithm that trains a classic-control run (`run.algo`), parsed
/// once from its name; code matches on it, never on the name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum Algo {
    #[default]
    Ppo,
    A2c,
    Reinforce,
    Dqn,
    Sac,
}

impl Algo {
    /// Every algorithm, in the order error messages list them.
    pub const ALL: [Algo; 5] = [Algo::Ppo, Algo::A2c, Algo::Reinforce, Algo::Dqn, Algo::Sac];

    /// The name configs and run ids use.
    pub fn name(self) -> &'static str {
        match self {
            Algo::Ppo => "ppo",
            Algo::A2c => "a2c",
            Algo::Reinforce => "reinforce",
            Algo::Dqn => "dqn",
            Algo::Sac => "sac",
        }
    }

    /// Trains from a replay table of transitions (DQN, SAC) rather than
    /// from fresh rollouts.
    pub fn is_off_policy(self) -> bool {
        matches!(self, Algo::Dqn | Algo::Sac)
    }
}

impl std::fmt::Display for Algo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Algo {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        Algo::ALL
            .into_iter()
            .find(|a| a.name() == s)
            .ok_or_else(|| {
                let known: Vec<&str> = Algo::ALL.iter().map(|a| a.name()).collect();
                format!("unknown algorithm {s:?}; known: {}", known.join(", "))
            })
    }
}

impl TryFrom<String> for Algo {
    type Error = String;

    fn try_from(s: String) -> Result<Self, String> {
        s.parse()
    }
}

impl From<Algo> for String {
    fn from(a: Algo) -> String {
        a.name().to_string()
    }
}

pub(crate) fn default_seed() -> u64 {
    1
}

pub(crate) fn default_runs_dir() -> PathBuf {
    PathBuf::from("runs")
}

pub(crate) fn default_total_env_steps() -> u64 {
    1_000_000
}
