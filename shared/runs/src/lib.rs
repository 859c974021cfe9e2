//! What runs leave on disk, shared by the tracker (which writes it) and the
//! command line (which reads it, and redraws plots):
//!
//! - [`registry`]: `runs/runs.json`, one record per run, safe to share
//!   between threads and processes.
//! - [`checkpoint`]: the checkpoint folders of a run: their layout, numbers,
//!   links, pins and pruning, and the state a checkpoint carries.
//! - [`plots`]: a run directory's PNG plots, drawn from its CSV files.
//! - [`games`]: `games.jsonl`, the text games of a run (the line format,
//!   which games are written, and reading them back).

pub mod checkpoint;
pub mod games;
pub mod plots;
pub mod registry;
