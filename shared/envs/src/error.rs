//! Error type of the crate.
//!
//! Every fallible operation (looking up an id, stepping with a bad action,
//! restoring a state of the wrong length, ...) reports an [`EnvError`]. Errors
//! are detected before any environment state is modified, so a failed call
//! leaves the environment exactly as it was.

use thiserror::Error;

/// Everything that can go wrong when creating or driving an environment.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum EnvError {
    /// The id is not one of [`crate::ENV_IDS`] (for [`crate::make`]) or of
    /// [`crate::TEXT_GAME_IDS`] (for [`crate::text::make`]).
    #[error("unknown environment id {id:?}; known ids: {}", known.join(", "))]
    UnknownEnv {
        /// The id that was asked for.
        id: String,
        /// Every id this crate knows.
        known: Vec<&'static str>,
    },

    /// A discrete action outside `0..n`.
    #[error("action {action} is out of range for Discrete({n}): valid actions are 0..={max}", max = *n as i64 - 1)]
    ActionOutOfRange {
        /// The rejected action.
        action: i64,
        /// Number of discrete actions of the space.
        n: usize,
    },

    /// A discrete action given to a continuous environment, or the reverse.
    #[error("{env_id} takes {expected} actions, got a {got} action")]
    WrongActionKind {
        /// Environment id.
        env_id: &'static str,
        /// `"discrete"` or `"continuous"`.
        expected: &'static str,
        /// `"discrete"` or `"continuous"`.
        got: &'static str,
    },

    /// A continuous action with the wrong number of components.
    #[error("{env_id} takes continuous actions of dimension {expected}, got {got} components")]
    ActionDim {
        /// Environment id.
        env_id: &'static str,
        /// Dimension of the action space.
        expected: usize,
        /// Number of components given.
        got: usize,
    },

    /// A continuous action component that is NaN or infinite.
    #[error("continuous action component {index} is not finite ({value})")]
    NonFiniteAction {
        /// Index of the offending component.
        index: usize,
        /// Its value.
        value: f64,
    },

    /// [`crate::Env::set_state`] with a state of the wrong length.
    #[error("{env_id} state has {expected} components, got {got}")]
    StateLength {
        /// Environment id.
        env_id: &'static str,
        /// Length of the state layout.
        expected: usize,
        /// Length given.
        got: usize,
    },

    /// An observation buffer whose length is not the observation dimension.
    #[error("observation buffer has length {got}, expected {expected}")]
    ObsLength {
        /// Observation dimension.
        expected: usize,
        /// Length of the buffer given.
        got: usize,
    },

    /// `step` or `observe` before the first `reset` (or `set_state`), as
    /// Gymnasium's `OrderEnforcing` wrapper refuses it.
    #[error("{env_id}: reset (or set_state) must be called before step/observe")]
    NotReset {
        /// Environment id.
        env_id: &'static str,
    },

    /// A vectorized step whose action slice has the wrong length.
    #[error("expected {expected} action values for the vectorized env, got {got}")]
    ActionCount {
        /// `num_envs` (discrete) or `num_envs * action_dim` (continuous).
        expected: usize,
        /// Length given.
        got: usize,
    },

    /// [`crate::VecEnv::new`] with `num_envs == 0`.
    #[error("a vectorized env needs at least one sub-environment")]
    NoEnvs,

    /// An error raised by one sub-environment of a [`crate::VecEnv`].
    #[error("sub-environment {index}: {source}")]
    SubEnv {
        /// Index of the sub-environment.
        index: usize,
        /// What went wrong there.
        #[source]
        source: Box<EnvError>,
    },

    /// A game implemented outside this crate (the env bridge's TextArena
    /// games) failed: its Python code raised, or its worker ended or hung.
    /// The game is lost; a new one may be made.
    #[error("{id}: {message}")]
    External {
        /// Text game id.
        id: String,
        /// What went wrong, with the traceback where there is one.
        message: String,
    },

    /// [`crate::TextGame::step`] after the game has ended.
    #[error("{id}: the game is over; reset it before stepping")]
    GameOver {
        /// Text game id.
        id: &'static str,
    },

    /// A bot asked to move in a game it does not know how to play.
    #[error("bot {bot} cannot play {game}")]
    BotCannotPlay {
        /// The bot's name.
        bot: &'static str,
        /// Text game id.
        game: &'static str,
    },
}

impl EnvError {
    /// The error as env `id` reports it: the env id it names replaced (a
    /// wrapper's errors name the wrapper's id, not the wrapped env's).
    pub fn for_env(self, id: &'static str) -> Self {
        match self {
            Self::WrongActionKind { expected, got, .. } => Self::WrongActionKind {
                env_id: id,
                expected,
                got,
            },
            Self::ActionDim { expected, got, .. } => Self::ActionDim {
                env_id: id,
                expected,
                got,
            },
            Self::StateLength { expected, got, .. } => Self::StateLength {
                env_id: id,
                expected,
                got,
            },
            Self::NotReset { .. } => Self::NotReset { env_id: id },
            other => other,
        }
    }
}
