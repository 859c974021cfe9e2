//! The policy as services hold it.
//!
//! - [`spec_for`]: the network shape from the experiment config and the env's spaces,
//!   the same in the learner, the inference servers and the evaluators
//!   ([`qnet_spec_for`]: the Q-network of `run.algo: dqn`; [`sac_spec_for`]:
//!   the networks of `run.algo: sac`);
//! - [`PolicyModel`]: the acting model of a run, an actor-critic, (DQN) a
//!   Q-network acting epsilon-greedily with the epsilon of the learner's
//!   schedule at the version's env steps, greedily when asked for
//!   deterministic actions, or (SAC) the tanh-squashed Gaussian actor,
//!   sampled, `tanh(μ)` when deterministic; [`Act`] is what they can do;
//! - [`PolicyWeights`]: a version's parameters (named f32 tensors) as
//!   services hold them, as the safetensors bytes that travel
//!   ([`WeightsUpdate::weights`](relay_proto::WeightsUpdate::weights),
//!   through `relay_kit::weights` whatever the size), and loaded into a
//!   model ([`load_weights`], all-or-nothing with shape checks);
//! - [`PolicyFollower`]: keeps a copy of the learner's latest weights, fetching
//!   the current version at start (`weights.latest`) and each new one as it is
//!   published (`weights`), fetching its parameters and building each new
//!   model off the caller's hot path; [`StatsFollower`] keeps only each
//!   version's normalisation statistics (which travel in the message: it
//!   fetches no parameters);
//! - [`PolicyFetcher`]: for a service that plays only some versions, hears
//!   each one announced (`weights.announce`) and fetches a version's
//!   weights only when asked for one;
//! - [`norm_stats`] / [`delta_stats`] / [`frozen_normalizer`]: the
//!   normalisation statistics (`normalize:`) as they travel with fragments and
//!   weights, and back;
//! - [`AdapterFollower`]: the same for the LLM policy's LoRA adapter versions
//!   (`adapters`), metadata only (the inference servers load the bytes);
//! - [`VersionFeed`]: the one loop every follower hears versions through
//!   (ask `*.latest` until a version is held, then each one published),
//!   generic over the kind ([`Followed`]);
//! - [`text`]: the text-game loop the env-runner and the evaluator share;
//! - [`league`]: past versions of a classic policy stored for the league,
//!   and [`policy_builder`], which makes acting models of them;
//! - [`opponent`]: the fixed opponents of games on observations (bots and
//!   saved checkpoints), and loading a checkpoint's policy.
//!
//! # Layout
//!
//! Each file holds one of these ideas, and every item is re-exported here
//! (`relay_policy::X`, whichever file holds it):
//!
//! - `spec.rs`: the networks' shapes ([`spec_for`], [`qnet_spec_for`],
//!   [`sac_spec_for`], [`SpecError`]) and the device ([`policy_device`]);
//! - `model.rs`: [`Act`], [`PolicyModel`], [`VersionedPolicy`] and
//!   [`policy_builder`] ([`PolicyBuilder`]);
//! - `weights.rs`: [`PolicyWeights`] to and from the wire, fetched
//!   ([`WeightsError`]) and loaded ([`load_weights`]);
//! - `normalize.rs`: [`norm_stats`], [`delta_stats`], [`stats_delta`],
//!   [`stats_rms`], [`frozen_normalizer`] and [`load_normalizer`];
//! - `follow.rs`: [`Follower`] ([`PolicyFollower`], [`StatsFollower`],
//!   [`Versioned`], [`VersionedStats`]), [`PolicyFetcher`],
//!   [`announced_versions`], [`AdapterFollower`] ([`AdapterVersion`]);
//! - `feed.rs`: [`VersionFeed`] ([`Followed`], [`Heard`]);
//! - `text.rs`, `league.rs`, `opponent.rs`: the public modules above.

mod feed;
mod follow;
pub mod league;
mod model;
mod normalize;
pub mod opponent;
mod spec;
pub mod text;
mod weights;

pub use feed::{Followed, Heard, VersionFeed, FIRST_RETRY, MAX_RETRY};
pub use follow::{
    announced_versions, AdapterFollower, AdapterVersion, Follower, PolicyFetcher, PolicyFollower,
    StatsFollower, Versioned, VersionedStats,
};
pub use model::{policy_builder, Act, PolicyBuilder, PolicyModel, VersionedPolicy};
pub use normalize::{
    delta_stats, frozen_normalizer, load_normalizer, norm_stats, stats_delta, stats_rms,
};
pub use spec::{policy_device, qnet_spec_for, sac_spec_for, spec_for, SpecError};
pub use weights::{load_weights, PolicyWeights, WeightsError};
