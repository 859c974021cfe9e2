//! MessagePack encoding and the checks every received message goes through.
//!
//! A payload is rejected, with a [`Rejection`] whose `reason()` becomes the
//! `reason` label of `relay_messages_rejected_total`, when it is over
//! [`MAX_MESSAGE_BYTES`], does not decode, carries another schema version, or
//! fails its type's own validation (shapes, finiteness).

use serde::{de::DeserializeOwned, Deserialize, Serialize};

use crate::tensor::TensorError;

/// Version of every message layout in this crate. Bumped on any change that
/// an older reader would misread.
pub const SCHEMA_VERSION: u16 = 1;

/// Largest payload any reader accepts: the most nats-server's
/// `max_payload` can be set to (64 MB). What one connection can carry is
/// its server's `max_payload` (`relay_kit::Service::max_message_bytes`):
/// relay's own nats-server is started with one that fits the run's largest
/// message, and senders split or size what they send to the limit of
/// the server they are connected to.
pub const MAX_MESSAGE_BYTES: usize = 64 * 1024 * 1024;

/// nats-server's default `max_payload` (1 MiB): what a shared cluster
/// whose operator changed nothing carries.
pub const DEFAULT_MAX_PAYLOAD: usize = 1024 * 1024;

/// A message type that travels on the wire.
pub trait WireMessage: Serialize + DeserializeOwned {
    /// Short name used in logs.
    const KIND: &'static str;
    /// The schema version this value carries.
    fn schema(&self) -> u16;
    /// Type-specific checks: shapes agree, numbers are finite, ids are sane.
    fn validate(&self) -> Result<(), Rejection> {
        Ok(())
    }
}

/// Why a received payload was refused.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum Rejection {
    #[error("message of {size} bytes exceeds the limit of {limit} bytes")]
    Oversized { size: usize, limit: usize },
    #[error("cannot decode {kind}: {detail}")]
    Decode { kind: &'static str, detail: String },
    #[error("{kind} has schema version {got}, this build speaks {want}")]
    SchemaVersion {
        kind: &'static str,
        got: u16,
        want: u16,
    },
    /// `field` names the tensor: a message field, or e.g. `tensors[<name>]`.
    #[error("{kind}.{field}: {source}")]
    Tensor {
        kind: &'static str,
        field: std::borrow::Cow<'static, str>,
        source: TensorError,
    },
    #[error("{kind}.{field}: {detail}")]
    Invalid {
        kind: &'static str,
        field: &'static str,
        detail: String,
    },
}

impl Rejection {
    /// Low-cardinality label for the rejection counter.
    pub fn reason(&self) -> &'static str {
        match self {
            Rejection::Oversized { .. } => "oversized",
            Rejection::Decode { .. } => "decode",
            Rejection::SchemaVersion { .. } => "schema_version",
            Rejection::Tensor {
                source: TensorError::NonFinite { .. },
                ..
            } => "non_finite",
            Rejection::Tensor { .. } => "shape",
            Rejection::Invalid { .. } => "invalid",
        }
    }
}

/// Encodes a message as MessagePack with field names, so that readers can
/// check the schema version before trusting the layout.
pub fn encode<T: WireMessage>(message: &T) -> Vec<u8> {
    rmp_serde::to_vec_named(message).expect("wire messages always serialize")
}

#[derive(Deserialize)]
struct Header {
    schema: u16,
}

/// Deepest nesting of MessagePack arrays and maps a payload may hold. The
/// deepest message (`SampleReply` -> fragments -> fragment -> tensor ->
/// shape) nests 5 levels; rmp-serde's own limit of 1024 lets a payload of a
/// few kilobytes under an unknown field recurse deep enough to overflow a
/// 2 MiB thread stack (an abort, not a panic) in unoptimized builds.
const MAX_DEPTH: usize = 32;

fn from_slice<T: DeserializeOwned>(payload: &[u8]) -> Result<T, rmp_serde::decode::Error> {
    let mut deserializer = rmp_serde::Deserializer::from_read_ref(payload);
    deserializer.set_max_depth(MAX_DEPTH);
    T::deserialize(&mut deserializer)
}

/// Decodes and validates a payload.
pub fn decode<T: WireMessage>(payload: &[u8]) -> Result<T, Rejection> {
    if payload.len() > MAX_MESSAGE_BYTES {
        return Err(Rejection::Oversized {
            size: payload.len(),
            limit: MAX_MESSAGE_BYTES,
        });
    }
    // The header is read first so that a message from another schema version
    // is named as such rather than as an undecodable payload.
    let header: Header = from_slice(payload).map_err(|e| Rejection::Decode {
        kind: T::KIND,
        detail: e.to_string(),
    })?;
    if header.schema != SCHEMA_VERSION {
        return Err(Rejection::SchemaVersion {
            kind: T::KIND,
            got: header.schema,
            want: SCHEMA_VERSION,
        });
    }
    let message: T = from_slice(payload).map_err(|e| Rejection::Decode {
        kind: T::KIND,
        detail: e.to_string(),
    })?;
    message.validate()?;
    Ok(message)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::WeightsRequest;

    /// `{schema: 1, zz: [[[...]]]}`: nesting under a field nobody reads.
    fn nested(depth: usize) -> Vec<u8> {
        let mut payload = vec![0x82, 0xa6];
        payload.extend_from_slice(b"schema");
        payload.extend_from_slice(&[0x01, 0xa2, b'z', b'z']);
        payload.extend(std::iter::repeat_n(0x91, depth));
        payload.push(0xc0);
        payload
    }

    #[test]
    fn deep_nesting_is_refused_without_exhausting_the_stack() {
        // A small stack, as on a tokio worker; this used to abort the process.
        std::thread::Builder::new()
            .stack_size(256 * 1024)
            .spawn(|| {
                assert!(decode::<WeightsRequest>(&nested(MAX_DEPTH - 2)).is_ok());
                for depth in [MAX_DEPTH, 1000, 100_000] {
                    let err = decode::<WeightsRequest>(&nested(depth)).unwrap_err();
                    assert_eq!(err.reason(), "decode", "{err}");
                }
            })
            .unwrap()
            .join()
            .unwrap();
    }
}
