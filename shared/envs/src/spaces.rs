//! Spaces and environment specs.
//!
//! This module owns the static description of an environment: its
//! observation space ([`BoxSpace`]), its action space ([`ActionSpace`]) and
//! the registration data Gymnasium keeps in `EnvSpec` ([`EnvSpec`]: id, time
//! limit, reward threshold). Bounds are `f32`, exactly as Gymnasium builds
//! them with `dtype=np.float32`.

use serde::{Deserialize, Serialize};

/// A box (product of intervals) of `f32` values, Gymnasium's `spaces.Box`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BoxSpace {
    /// Lower bound of every component.
    pub low: Vec<f32>,
    /// Upper bound of every component.
    pub high: Vec<f32>,
}

impl BoxSpace {
    /// Number of components.
    pub fn dim(&self) -> usize {
        self.low.len()
    }

    /// Whether `x` has the right length and every component lies within
    /// `[low, high]`.
    pub fn contains(&self, x: &[f32]) -> bool {
        x.len() == self.dim()
            && x.iter()
                .zip(self.low.iter().zip(&self.high))
                .all(|(v, (lo, hi))| *lo <= *v && *v <= *hi)
    }
}

/// The action space of an environment.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum ActionSpace {
    /// `spaces.Discrete(n)`: actions are the integers `0..n`.
    Discrete {
        /// Number of actions.
        n: usize,
    },
    /// `spaces.Box(low, high)`: actions are `f32` vectors.
    Box {
        /// Lower bounds.
        low: Vec<f32>,
        /// Upper bounds.
        high: Vec<f32>,
    },
}

impl ActionSpace {
    /// Number of action values one sub-environment takes per step: 1 for a
    /// discrete space, the vector length for a box.
    pub fn dim(&self) -> usize {
        match self {
            ActionSpace::Discrete { .. } => 1,
            ActionSpace::Box { low, .. } => low.len(),
        }
    }

    /// Whether this is a [`ActionSpace::Discrete`] space.
    pub fn is_discrete(&self) -> bool {
        matches!(self, ActionSpace::Discrete { .. })
    }

    /// Number of discrete actions, `None` for a box.
    pub fn n(&self) -> Option<usize> {
        match self {
            ActionSpace::Discrete { n } => Some(*n),
            ActionSpace::Box { .. } => None,
        }
    }
}

/// Registration data of an environment, as in Gymnasium's registry.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct EnvSpec {
    /// Gymnasium id, e.g. `"CartPole-v1"`.
    pub id: &'static str,
    /// Observation space.
    pub observation_space: BoxSpace,
    /// Action space.
    pub action_space: ActionSpace,
    /// Time limit: `truncated` is reported once this many steps have elapsed
    /// since the last reset.
    pub max_episode_steps: u32,
    /// Average return over 100 episodes at which the task counts as solved.
    pub reward_threshold: Option<f64>,
    /// `Some([channels, height, width])` when observations are uint8 images:
    /// the flat observation is that array, channels first, row-major, and
    /// every value is a whole number in `0..=255` (it travels as one byte).
    pub image: Option<[usize; 3]>,
    /// Discrete actions come with a mask of the legal ones for each
    /// observation ([`crate::VecStep::masks`]): Gymnasium's
    /// `info["action_mask"]`, PettingZoo's `action_mask`. relay's built-in
    /// envs have none.
    pub action_mask: bool,
    /// Multi-agent games (PettingZoo's): the agents, in seat order, who
    /// take turns sharing the observation and action spaces; each step's
    /// observation is of the agent to move ([`crate::VecStep::movers`]).
    /// Empty for single-agent envs.
    pub agents: Vec<String>,
    /// Parallel multi-agent games played by one shared policy: the agents
    /// of a game, each one env of the vector (a row), the agents of a game
    /// `team.len()` consecutive envs that begin and end their episodes
    /// together. Empty otherwise.
    pub team: Vec<String>,
}

impl EnvSpec {
    /// Observation dimension.
    pub fn obs_dim(&self) -> usize {
        self.observation_space.dim()
    }
}
