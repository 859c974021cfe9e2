//! Plumbing every relay service uses the same way.
//!
//! - [`service`]: flags, start-up, the [`Service`] context, `main`.
//! - [`collective`]: data-parallel groups of replicas: membership, views, ring all-reduce.
//! - [`connect`]: NATS and Redis connections with backoff; requests with timeouts.
//! - [`fit`]: messages of any size: requests, replies and publishes divided to fit.
//! - [`weights`]: the one weights transport (inline, direct, object store).
//! - [`direct`]: large weight versions straight from their publisher over TCP.
//! - [`intake`]: decoding received payloads and counting rejections.
//! - [`league`]: the league's model pool in Redis, where every service sees it.
//! - [`metrics`]: the metric catalogue and checked registration.
//! - [`http`]: `/metrics` and `/healthz`.
//! - [`telemetry`]: tracing setup and log forwarding to the tracker.
//! - [`shutdown`]: the signal passed into `run`.

pub mod collective;
pub mod connect;
pub mod direct;
pub mod fit;
pub mod http;
pub mod intake;
pub mod league;
pub mod metrics;
pub mod service;
pub mod shutdown;
pub mod telemetry;
pub mod weights;

pub use connect::{
    connect_nats, connect_nats_with, connect_redis, connect_redis_with, request, RequestError,
};
pub use fit::{publish_within, reply_within, request_within};
pub use http::Health;
pub use intake::Intake;
// The report's value constructors live with the message (pure crates use them too).
pub use relay_proto::{counter, gauge};
pub use service::{Service, ServiceArgs, ServiceConfig, ServiceError};
pub use shutdown::{Shutdown, ShutdownTrigger};
