//! The `relay` command line: the local stack supervisor (`up`, `down`,
//! `scale`, `top`), runs, checkpoints, plots, offline evaluation, play,
//! a text run's games, models and SFT. See `main.rs` for the commands; the
//! benchmarks, chaos, soak and sweeps are `relay-bench`'s.
//!
//! Which file owns what:
//!
//! - `up/`: `relay up` ([`up()`], [`UpArgs`], [`Outcome`]): `up/mod.rs`
//!   checks the run and starts the stack, `up/watch.rs` follows the run
//!   over NATS until it ends.
//! - [`stack`]: the local stack's processes (infrastructure and services),
//!   its record for `relay down`, and `relay down`.
//! - [`scale`]: `relay scale`, and the supervisor's side of it.
//! - [`top`]: `relay top`.
//! - [`summary`]: the block printed when a run ends.
//! - [`runs`], [`checkpoints`], [`games`]: `relay runs` and `relay plot`,
//!   `relay checkpoints`, `relay games`.
//! - [`eval`]: `relay eval` (a running stack's evaluator plugin, a
//!   checkpoint evaluated offline). [`play`] ([`play_seats`],
//!   [`play_text`]): `relay play`, a checkpoint playing at the terminal.
//! - [`model`]: `relay model init`. [`sft`]: `relay sft`.
//! - This file: the modules and the subcommands run by `relay-bench`.

pub mod checkpoints;
pub mod eval;
pub mod games;
pub mod model;
pub mod play;
pub mod play_seats;
pub mod play_text;
pub mod runs;
pub mod scale;
pub mod sft;
pub mod stack;
pub mod summary;
pub mod top;
mod up;

pub use up::{make_run_id, up, FirstPass, Outcome, StopFlag, UpArgs};

/// The subcommands `relay` runs through the `relay-bench` binary beside it
/// (relay-bench's own tests check that they are exactly its subcommands).
pub const BENCH_COMMANDS: [&str; 21] = [
    "bench-scale",
    "soak",
    "bench-tracker",
    "bench-solve",
    "bench-learning",
    "bench-parity",
    "sweep",
    "chaos",
    "bench-tictactoe",
    "bench-smollm2",
    "bench-league",
    "bench-generate",
    "bench-gpu",
    "bench-cnn-step",
    "bench-allreduce",
    "bench-learners",
    "bench-hub-model",
    "bench-llamacpp",
    "bench-bridge",
    "bench-envs",
    "bench-weights",
];
