//! The `weights` section: how a weights version (any policy's parameters,
//! a LoRA adapter) travels from its publisher to every service that
//! follows it (`relay_kit::weights`): inline in its message when small,
//! else from the publisher's direct transfer server and/or the run's
//! JetStream object store.

use serde::{Deserialize, Serialize};

use crate::check::{invalid, positive, ConfigError};

/// Whether versions too large to travel inline are also put in the run's
/// JetStream object store (bucket `relay-<run>-weights`, for classic
/// policies and LoRA adapters alike; a league's versions are kept in
/// `relay-<run>-league` whatever this says).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StoreMode {
    /// When the direct transfer server is off, and always for LoRA adapters
    /// of league runs (the inference servers serve past versions from it).
    #[default]
    Auto,
    /// Every version too large to travel inline: readers that cannot reach
    /// the publisher's direct transfer server fetch from the store instead.
    Always,
    /// Never (with `direct: false`, a version too large to travel inline
    /// cannot be published: the run fails, saying so).
    Never,
}

/// The `weights` section (see the module docs).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct WeightsSection {
    /// Versions of at most this many bytes travel inside their NATS
    /// message; larger ones are fetched by each reader. Default 256 KiB (a
    /// CartPole policy, 37.5 kB, travels inline; Atari's NatureCNN, 6.7 MB,
    /// is fetched). It must stay under the NATS server's `max_payload`
    /// less 64 KiB, which the publisher checks when it starts.
    pub inline_max_bytes: usize,
    /// Serve larger versions from the publisher's direct transfer server
    /// (one TCP connection per reader, no copy through nats-server).
    /// Default true.
    pub direct: bool,
    /// Address the direct transfer server listens on, `host:port` (port
    /// 0: any free port). Default: the address of this machine's
    /// interface that reaches the NATS server, any free port (127.0.0.1
    /// when NATS runs here), so that whoever reaches NATS the same way
    /// reaches it too.
    pub direct_listen: Option<String>,
    /// Host readers connect to, when it is not the listen address's (a
    /// listen address of `0.0.0.0`, or NAT between the machines).
    pub direct_advertise: Option<String>,
    /// Also put larger versions in the run's JetStream object store (see
    /// [`StoreMode`]). Default `auto`.
    pub store: StoreMode,
    /// Versions the publisher keeps fetchable (on its direct transfer
    /// server and in the store): a reader that asks for an older one takes
    /// the newest instead. Default 4.
    pub keep_versions: usize,
    /// How long a reader may take to fetch one version before it gives up
    /// and waits for the next, in milliseconds. Default 60,000.
    pub fetch_timeout_ms: u64,
}

impl Default for WeightsSection {
    fn default() -> Self {
        Self {
            inline_max_bytes: 256 * 1024,
            direct: true,
            direct_listen: None,
            direct_advertise: None,
            store: StoreMode::Auto,
            keep_versions: 4,
            fetch_timeout_ms: 60_000,
        }
    }
}

impl WeightsSection {
    pub(crate) fn validate(&self) -> Result<(), ConfigError> {
        let limit = relay_proto::MAX_MESSAGE_BYTES - 64 * 1024;
        if self.inline_max_bytes > limit {
            return Err(invalid(
                "weights.inline_max_bytes",
                format!(
                    "{} is over {limit}, the largest NATS message less 64 KiB",
                    self.inline_max_bytes
                ),
            ));
        }
        if !self.direct && self.store == StoreMode::Never {
            return Err(invalid(
                "weights.store",
                "never, with weights.direct false, leaves versions larger than weights.inline_max_bytes no way to travel",
            ));
        }
        if let Some(listen) = &self.direct_listen {
            if listen
                .rsplit_once(':')
                .is_none_or(|(_, port)| port.parse::<u16>().is_err())
            {
                return Err(invalid(
                    "weights.direct_listen",
                    format!("{listen:?} is not host:port"),
                ));
            }
        }
        if self.direct_advertise.as_deref() == Some("") {
            return Err(invalid("weights.direct_advertise", "empty host"));
        }
        positive("weights.keep_versions", self.keep_versions)?;
        if self.fetch_timeout_ms == 0 {
            return Err(invalid("weights.fetch_timeout_ms", "must be positive"));
        }
        Ok(())
    }
}
