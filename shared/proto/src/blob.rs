//! Where the bytes of a weights version are: one description for every
//! kind of policy (an MLP, a CNN, a Q-network, a SAC actor, a LoRA
//! adapter, a full LLM), so that one transport carries them all
//! (`relay_kit::weights`).
//!
//! The bytes are safetensors (a policy's parameters, a LoRA adapter's
//! `adapter_model.safetensors`). A small version travels inside its
//! message ([`WeightsBlob::inline`]); a larger one is fetched by each
//! reader from the publisher's direct transfer server
//! ([`WeightsBlob::direct`]) or the run's JetStream object store
//! ([`WeightsBlob::store`]), whichever it lists and the reader reaches,
//! and checked against its length and SHA-256 digest.

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::codec::Rejection;

/// A version's bytes: inline, or where to fetch them (see the module docs).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WeightsBlob {
    /// Length of the bytes.
    pub size: u64,
    /// SHA-256 of the bytes (32 bytes): a fetched copy must match it.
    #[serde(with = "serde_bytes")]
    pub sha256: Vec<u8>,
    /// The bytes themselves, for versions small enough to travel in the
    /// message.
    #[serde(default, with = "serde_bytes", skip_serializing_if = "Option::is_none")]
    pub inline: Option<Vec<u8>>,
    /// Served by the publisher's direct transfer server.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub direct: Option<DirectLocation>,
    /// Stored in the run's JetStream object store.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub store: Option<StoreLocation>,
}

/// A key on a publisher's direct transfer server.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DirectLocation {
    /// `host:port` readers connect to.
    pub addr: String,
    pub key: String,
}

/// An object in a JetStream object store bucket.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoreLocation {
    pub bucket: String,
    pub key: String,
}

/// SHA-256 of `bytes`.
pub fn sha256(bytes: &[u8]) -> Vec<u8> {
    Sha256::digest(bytes).to_vec()
}

/// Longest key a direct transfer request can name.
const MAX_KEY_BYTES: usize = u16::MAX as usize;

impl WeightsBlob {
    /// `bytes` carried in the message.
    pub fn inline(bytes: Vec<u8>) -> Self {
        Self {
            size: bytes.len() as u64,
            sha256: sha256(&bytes),
            inline: Some(bytes),
            direct: None,
            store: None,
        }
    }

    /// Whether a fetched copy is these bytes: the length and the digest
    /// agree. The error says which did not.
    pub fn verify(&self, bytes: &[u8]) -> Result<(), String> {
        if bytes.len() as u64 != self.size {
            return Err(format!(
                "{} bytes arrived, the version has {}",
                bytes.len(),
                self.size
            ));
        }
        if sha256(bytes) != self.sha256 {
            return Err("the bytes do not match the version's SHA-256 digest".into());
        }
        Ok(())
    }

    /// The checks a receiver makes before trusting the description:
    /// a length, a 32-byte digest, and somewhere to find the bytes.
    pub fn check(&self, kind: &'static str, field: &'static str) -> Result<(), Rejection> {
        let bad = |detail: String| Rejection::Invalid {
            kind,
            field,
            detail,
        };
        if self.size == 0 {
            return Err(bad("empty (0 bytes)".into()));
        }
        if self.sha256.len() != 32 {
            return Err(bad(format!(
                "sha256 has {} bytes, not 32",
                self.sha256.len()
            )));
        }
        if let Some(bytes) = &self.inline {
            if bytes.len() as u64 != self.size {
                return Err(bad(format!(
                    "inline bytes: {} of {}",
                    bytes.len(),
                    self.size
                )));
            }
        }
        if let Some(d) = &self.direct {
            if d.addr.is_empty() || !d.addr.contains(':') {
                return Err(bad(format!("direct address {:?} is not host:port", d.addr)));
            }
            if d.key.is_empty() || d.key.len() > MAX_KEY_BYTES {
                return Err(bad(format!("direct key of {} bytes", d.key.len())));
            }
        }
        if let Some(s) = &self.store {
            if s.bucket.is_empty() || s.key.is_empty() {
                return Err(bad("empty object store bucket or key".into()));
            }
        }
        if self.inline.is_none() && self.direct.is_none() && self.store.is_none() {
            return Err(bad("neither inline nor where to fetch it".into()));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_blob_names_where_its_bytes_are_and_what_they_are() {
        let blob = WeightsBlob::inline(b"weights".to_vec());
        assert!(blob.check("T", "weights").is_ok());
        assert!(blob.verify(b"weights").is_ok());
        assert!(blob.verify(b"weightz").unwrap_err().contains("SHA-256"));
        assert!(blob.verify(b"w").unwrap_err().contains("1 bytes arrived"));

        let remote = WeightsBlob {
            inline: None,
            ..blob.clone()
        };
        let err = remote.check("T", "weights").unwrap_err().to_string();
        assert!(err.contains("neither inline"), "{err}");
        let direct = WeightsBlob {
            direct: Some(DirectLocation {
                addr: "10.0.0.2:4000".into(),
                key: "weights/v3".into(),
            }),
            ..remote.clone()
        };
        assert!(direct.check("T", "weights").is_ok());
        let no_port = WeightsBlob {
            direct: Some(DirectLocation {
                addr: "10.0.0.2".into(),
                key: "k".into(),
            }),
            ..remote.clone()
        };
        assert!(no_port.check("T", "weights").is_err());
        let short_digest = WeightsBlob {
            sha256: vec![0; 31],
            ..blob
        };
        assert!(short_digest.check("T", "weights").is_err());
    }
}
