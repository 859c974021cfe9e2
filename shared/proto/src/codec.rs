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

/// Largest payload any subscriber accepts (NATS's default `max_payload`).
pub const MAX_MESSAGE_BYTES: usize = 1024 * 1024;

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
    #[error("{kind}.{field}: {source}")]
    Tensor {
        kind: &'static str,
        field: &'static str,
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
    let header: Header = rmp_serde::from_slice(payload).map_err(|e| Rejection::Decode {
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
    let message: T = rmp_serde::from_slice(payload).map_err(|e| Rejection::Decode {
        kind: T::KIND,
        detail: e.to_string(),
    })?;
    message.validate()?;
    Ok(message)
}
