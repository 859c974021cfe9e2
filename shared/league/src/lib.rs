//! The self-play league: who plays whom, and how good everyone is.
//!
//! - [`trueskill`]: TrueSkill ratings for 1 vs 1 matches, identical to the
//!   Python `trueskill` package 0.4.5.
//!
//! Pure: no I/O, no async, no NATS or Redis. The services keep the state
//! (serde types) wherever they like, e.g. Redis as JSON or MessagePack.

pub mod trueskill;

pub use trueskill::{Outcome, Rating, TrueSkill, TrueSkillError};
