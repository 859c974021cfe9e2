//! Classic-control environments identical to Gymnasium 1.4.0, plus a
//! vectorized wrapper with auto-reset, and text games identical to
//! TextArena 0.7.4 with scripted bots.
//!
//! Pure computation: no I/O, no async, no global state.
//!
//! # Modules
//! - [`spaces`] owns the observation/action spaces and [`EnvSpec`] (id, time
//!   limit, reward threshold).
//! - [`env`](mod@env) owns the [`Env`] trait, [`Action`], [`StepResult`], and the
//!   `TimeLimit` / `OrderEnforcing` behaviour every env embeds.
//! - [`cartpole`], [`acrobot`], [`mountain_car`] and [`pendulum`] own the
//!   physics, ported expression by expression from Gymnasium's Python so
//!   that `f64` rounding matches; each documents its state layout.
//! - [`no_velocity`] owns rl-zoo's partially observed variants
//!   (`CartPoleNoVel-v1`, `PendulumNoVel-v1`: velocities zeroed).
//! - [`registry`] (re-exported) owns [`make`], [`spec`] and [`ENV_IDS`].
//! - [`seat_bots`] owns [`SeatBot`], the fixed opponents (random-legal,
//!   minimax, connect_four_bot) of multi-agent games played on
//!   observations.
//! - [`vec_env`] owns [`VecEnv`] (SB3-`DummyVecEnv`-style auto-reset).
//! - [`error`] owns [`EnvError`].
//! - [`text`] owns the text games ([`TextGame`], TicTacToe, ConnectFour,
//!   KuhnPoker, GuessTheNumber), their registry ([`text::make`], also
//!   re-exported as [`make_text_game`], and [`TEXT_GAME_IDS`]) and the
//!   [`Bot`]s. See its docs for how observations accumulate and the
//!   invalid-move rule.
//!
//! # Semantics
//! - Internal state is `f64`, observations are its `f32` cast (as Gymnasium's
//!   `np.array(..., dtype=np.float32)`), rewards are `f64`.
//! - `truncated` is `elapsed_steps >= max_episode_steps`, computed exactly
//!   like Gymnasium's `TimeLimit` (independently of `terminated`).
//! - Reset distributions match Gymnasium's; the draws come from the caller's
//!   `rand` RNG, so they do not reproduce NumPy's streams.
//! - `step`/`observe` before the first `reset`/`set_state` fail with
//!   [`EnvError::NotReset`] (Gymnasium's `OrderEnforcing`).
//! - Bit-level fidelity: expressions keep Python's evaluation order, Python's
//!   `x**2` is computed with libm `pow` (as CPython / NumPy do) and
//!   `np.square` with `x * x`, `%` is floor modulo, and `sin`/`cos`/`pow` come
//!   from the platform libm, like NumPy's. On glibc the recorded Gymnasium
//!   trajectories are reproduced exactly (observations, rewards, flags).
//!
//! # Deviations from the suggested API
//! - [`Env::reset`] and [`Env::observe`] return `Result` (they reject an
//!   observation buffer of the wrong length instead of panicking), and
//!   `reset` takes `&mut dyn RngCore` so `Env` stays object safe.
//!
//! ```
//! use relay_envs::{VecActions, VecEnv};
//! let mut envs = VecEnv::new("CartPole-v1", 4, 7)?;
//! let obs = envs.reset()?;
//! assert_eq!(obs.len(), 4 * 4);
//! let step = envs.step(VecActions::Discrete(&[0, 1, 0, 1]))?;
//! assert_eq!(step.rewards, vec![1.0; 4]);
//! # Ok::<(), relay_envs::EnvError>(())
//! ```

pub mod acrobot;
pub mod cartpole;
pub mod env;
pub mod error;
pub mod mountain_car;
pub mod no_velocity;
pub mod pendulum;
pub mod registry;
pub mod seat_bots;
pub mod spaces;
pub mod team;
pub mod text;
pub mod vec_env;

pub use acrobot::Acrobot;
pub use cartpole::CartPole;
pub use env::{Action, Env, StepResult};
pub use error::EnvError;
pub use mountain_car::MountainCar;
pub use pendulum::Pendulum;
pub use registry::{make, spec, ENV_IDS};
pub use seat_bots::{random_legal, SeatBot, SEAT_BOT_NAMES};
pub use spaces::{ActionSpace, BoxSpace, EnvSpec};
pub use team::{team_episodes, TeamEpisode};
pub use text::{
    make as make_text_game, AnswerFormat, AnswerReader, Bot, ConnectFourBot, MinimaxBot,
    ObservationView, PlayerInfo, RandomBot, StepOutcome, TextGame, TEXT_GAME_IDS,
};
pub use vec_env::{
    check_actions, gather_rows, sub_seed, FinishedEpisode, VecActions, VecEnv, VecStep,
};

/// Re-export of the `rand` RNG trait taken by [`Env::reset`].
pub use rand::RngCore;
