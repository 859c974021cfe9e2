//! relay's wire protocol.
//!
//! Everything that crosses a process boundary lives here: the message types,
//! the schema version they carry, the NATS subjects (scoped by run id) and the
//! MessagePack codec that rejects what it cannot trust. `docs/protocol.md`
//! lists every subject with its payload, publishers and subscribers.
//!
//! Numeric arrays travel as raw little-endian bytes with dtype and shape
//! ([`Tensor`]): MessagePack writes each f32 as 5 bytes and is far slower on
//! numeric arrays than a byte copy.

pub mod blob;
pub mod codec;
pub mod divide;
pub mod fit;
pub mod llm;
pub mod messages;
pub mod offpolicy;
pub mod staleness;
pub mod subjects;
pub mod tensor;

pub use blob::{sha256, DirectLocation, StoreLocation, WeightsBlob};
pub use codec::{
    decode, encode, Rejection, WireMessage, DEFAULT_MAX_PAYLOAD, MAX_MESSAGE_BYTES, SCHEMA_VERSION,
};
pub use fit::{encode_within, part_limit, Divisible, Indivisible, Joinable, Part, ENVELOPE_BYTES};
pub use llm::*;
pub use messages::*;
pub use offpolicy::*;
pub use staleness::{is_stale, PolicyLag};
pub use subjects::{validate_run_id, Subjects};
pub use tensor::{DType, Tensor, TensorError};

/// Milliseconds since the Unix epoch on this machine's clock (what
/// timestamps in messages hold; 0 if the clock is before 1970).
pub fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}
