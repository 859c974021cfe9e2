//! `relay-bench`: relay's benchmarks, fault injection, memory soak and
//! hyperparameter sweeps, each a subcommand of the `relay-bench` binary
//! (which `relay bench-*`, `relay chaos`, `relay soak` and `relay sweep`
//! run). They drive the stack through the `relay` library (`up`, the
//! supervisor) and print a table and a last JSON line.

pub mod bench_bridge;
pub mod bench_envs;
pub mod bench_generate;
pub mod bench_gpu;
pub mod bench_league;
pub mod bench_learning;
pub mod bench_scale;
pub mod bench_smollm2;
pub mod bench_solve;
pub mod bench_tictactoe;
pub mod bench_tracker;
pub mod bench_weights;
pub mod chaos;
pub mod soak;
pub mod sweep;
