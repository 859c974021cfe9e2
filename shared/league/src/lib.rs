//! The self-play league: who plays whom, and how good everyone is.
//!
//! - [`trueskill`]: TrueSkill ratings for 1 vs 1 matches, identical to the
//!   Python `trueskill` package 0.4.5.
//! - [`pool`]: the bounded pool of published policy versions and fixed
//!   opponents, their ratings and head-to-head records.
//! - [`sampler`]: opponent samplers chosen by config, and seating.
//!
//! A service's loop: [`Pool::add_version`] when the learner publishes,
//! [`OpponentSampler::sample`] for the next game, [`Pool::record_result`]
//! when it ends.
//!
//! Pure: no I/O, no async, no NATS or Redis. The state types are serde, so
//! the services keep them wherever they like (e.g. Redis as JSON or
//! MessagePack).

pub mod pool;
pub mod sampler;
pub mod trueskill;

pub use pool::{
    FixedKind, FixedOpponent, Member, MemberId, MemberKind, PolicyVersion, Pool, PoolConfig,
    PoolError, RatedMatch, WinDrawLoss,
};
pub use sampler::{
    Matchup, MixtureComponent, OpponentSampler, SampleError, SamplerConfig, SamplerConfigError,
    SamplerKind, WeightedOpponent,
};
pub use trueskill::{Outcome, Rating, TrueSkill, TrueSkillError};
