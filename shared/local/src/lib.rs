//! Local processes and their probes, the same for the `relay` command line
//! (the stack supervisor), `relay-bench` and the tests (`relay-testkit`).
//!
//! - [`port`]: a free loopback port, a server started on one (on another
//!   when it was taken meanwhile), waiting until a child process listens.
//! - [`http`]: the one HTTP client: a blocking GET of a service's
//!   `/healthz` or `/metrics` or Prometheus' API, with explicit timeouts.
//!
//! It depends on no other crate of the workspace, so that every crate may
//! use it, at run time or in tests.

pub mod http;
pub mod port;

pub use http::Timeouts;
pub use port::{free_port, on_free_port, wait_for_port, Listen};
