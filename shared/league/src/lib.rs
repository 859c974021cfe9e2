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
//! ```
//! use rand::SeedableRng;
//! use relay_league::*;
//!
//! let mut pool = Pool::new(PoolConfig::default()).unwrap();
//! pool.add_fixed(FixedOpponent { name: "random".into(), kind: FixedKind::Random }).unwrap();
//! let evicted = pool
//!     .add_version(PolicyVersion { version: 1, parent: None, weights_ref: "weights/1".into() })
//!     .unwrap();
//! assert!(evicted.is_empty());
//!
//! let sampler = OpponentSampler::new(SamplerConfig::Uniform { include_fixed: true }).unwrap();
//! let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
//! let matchup = sampler.sample(&pool, &mut rng).unwrap();
//! assert_eq!(matchup.opponent, MemberId::Fixed("random".into()));
//! // ... play `matchup.seats()`, seat 0 first; the current version won:
//! let rated = pool.record_result(&matchup.current_id(), &matchup.opponent, Outcome::Win).unwrap();
//! assert!(rated.a_after.mu > rated.a_before.mu);
//! let state = serde_json::to_string(&pool).unwrap(); // e.g. into Redis
//! ```
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
