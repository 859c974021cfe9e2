//! Intake of received payloads: decode, check, and on failure log one line
//! and count `relay_messages_rejected_total{subject,reason}`. The caller
//! simply skips the message; nothing stops.

use prometheus::{IntCounterVec, Opts, Registry};
use relay_proto::{Rejection, WireMessage};

/// Decodes messages and counts rejections.
#[derive(Clone)]
pub struct Intake {
    rejected: IntCounterVec,
}

impl Intake {
    pub fn new(registry: &Registry) -> Self {
        let rejected = IntCounterVec::new(
            Opts::new(
                "relay_messages_rejected_total",
                "Received messages refused, by subject topic and reason.",
            ),
            &["subject", "reason"],
        )
        .expect("valid metric");
        crate::metrics::register(registry, &rejected);
        Self { rejected }
    }

    /// Decodes `payload`; on failure logs and counts it under `topic`.
    pub fn decode<T: WireMessage>(&self, topic: &str, payload: &[u8]) -> Result<T, Rejection> {
        relay_proto::decode(payload).inspect_err(|rejection| self.reject(topic, rejection))
    }

    /// Counts and logs a rejection found after decoding (e.g. a shape that
    /// does not match this service's model).
    pub fn reject(&self, topic: &str, rejection: &Rejection) {
        tracing::warn!(subject = topic, reason = rejection.reason(), error = %rejection, "message rejected");
        self.rejected
            .with_label_values(&[topic, rejection.reason()])
            .inc();
    }

    /// Current count for one label pair (for tests and reports).
    pub fn count(&self, topic: &str, reason: &str) -> u64 {
        self.rejected.with_label_values(&[topic, reason]).get()
    }
}
