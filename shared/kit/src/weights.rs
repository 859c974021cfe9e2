//! The one weights transport: how a weights version of any kind (an MLP,
//! a CNN, a Q-network, a SAC actor, a LoRA adapter, a full LLM) travels
//! from its publisher (the learner, `relay-bench bench-weights`) to every
//! service that follows it (inference servers, evaluators, normalising
//! env-runners), whatever its size.
//!
//! The publisher's [`WeightsPublisher::publish`] turns a version's bytes
//! into a [`WeightsBlob`], the part of the version's message that says
//! where the bytes are:
//! - up to `weights.inline_max_bytes` (256 KiB by default), in the
//!   message itself;
//! - larger, on the publisher's direct transfer server
//!   ([`crate::direct`], one TCP connection per reader: no copy through
//!   nats-server, no store written first; 0.33 s for a 538 MB model to one
//!   reader, against 1.34 s through the object store), and in the run's
//!   JetStream object store when `weights.store` asks for it, when direct
//!   transfer is off, or when the version must outlive its publisher (a
//!   league serves past LoRA adapters from the store).
//!
//! A reader's [`fetch`] takes the inline bytes, or tries the direct server
//! and then the store, and checks what arrived against the blob's length
//! and SHA-256 digest. One code path for every kind: the followers in
//! `relay-policy` and the inference server's adapters call only these.
//!
//! Every version has one key, `<name>/v<N>/weights.safetensors`
//! ([`Placement`]), in one of two buckets of the run: the transport's
//! ([`weights_bucket`], `relay-<run>-weights`, where `weights.store` puts
//! versions and only the `weights.keep_versions` newest stay) or, for a
//! version the league keeps, the league's
//! ([`crate::league::versions_bucket`]). A version's message, whatever
//! its kind, is a [`VersionMessage`].
//!
//! Why not NATS messages for everything: nats-server carries at most 64
//! MB a message, 1 MiB by default, and a shared cluster's operator may not
//! raise it; a 100 MB policy would have to be chunked through the server
//! for every reader. Why not the object store alone: it writes every byte
//! to the server's store before the first reader starts, then streams one
//! copy per reader through nats-server. Marin, vLLM and SGLang move large
//! weights over direct connections for the same reason.

use std::collections::VecDeque;
use std::net::{SocketAddr, ToSocketAddrs, UdpSocket};
use std::sync::Mutex;
use std::time::Duration;

use async_nats::jetstream::object_store::{ObjectMetadata, ObjectStore};
use bytes::Bytes;
use relay_config::{StoreMode, WeightsSection};
use relay_proto::{
    AdapterUpdate, DirectLocation, StoreLocation, WeightsBlob, WeightsUpdate, WireMessage,
};
use tokio::io::AsyncReadExt;

use crate::direct::{DirectError, DirectServer};

/// Why a version could not be published or fetched.
#[derive(Debug, thiserror::Error)]
pub enum TransportError {
    #[error("weights.direct_listen {listen:?}: {detail}")]
    Listen { listen: String, detail: String },
    #[error(transparent)]
    Direct(#[from] DirectError),
    #[error("object store {bucket}: {detail}")]
    Store { bucket: String, detail: String },
    #[error("a version of {bytes} bytes is larger than weights.inline_max_bytes ({inline_max}), and {why}")]
    NoWay {
        bytes: usize,
        inline_max: usize,
        why: String,
    },
    #[error("weights.inline_max_bytes is {inline_max}, but this NATS server carries messages of at most {max_payload} bytes (less 64 KiB for the rest of the message): lower it, or raise the server's max_payload")]
    InlineTooLarge {
        inline_max: usize,
        max_payload: usize,
    },
    #[error("{source_name}: {detail}")]
    Corrupt { source_name: String, detail: String },
    #[error("no source of the version could be read: {0}")]
    Unreachable(String),
}

/// Room left in a chunk message for what the server counts beside the
/// chunk's bytes.
const CHUNK_HEADROOM: usize = 1024;

/// The run's object store bucket `bucket`, created if missing.
pub async fn store(
    nats: &async_nats::Client,
    bucket: &str,
    description: &str,
) -> Result<ObjectStore, TransportError> {
    let jetstream = async_nats::jetstream::new(nats.clone());
    match jetstream.get_object_store(bucket).await {
        Ok(store) => Ok(store),
        Err(_) => jetstream
            .create_object_store(async_nats::jetstream::object_store::Config {
                bucket: bucket.to_string(),
                description: Some(description.to_string()),
                ..Default::default()
            })
            .await
            .map_err(|e| TransportError::Store {
                bucket: bucket.to_string(),
                detail: format!("cannot create it ({e}); is JetStream on (nats-server -js)?"),
            }),
    }
}

/// Uploads `bytes` as object `name` of `store`, in chunks as large as one
/// message may be (the server's `max_payload` less [`CHUNK_HEADROOM`])
/// instead of async-nats' 128 KiB: each chunk waits for its JetStream
/// acknowledgement before the next is sent, so the number of chunks sets
/// the upload time (a 538 MB model: 4,100 round trips at 128 KiB, 520 at 1
/// MiB). Readers need nothing: the chunk size is in the object's info.
pub async fn put_object(
    nats: &async_nats::Client,
    store: &ObjectStore,
    name: &str,
    bytes: &[u8],
) -> Result<(), async_nats::jetstream::object_store::PutError> {
    let chunk_size = nats
        .max_payload()
        .saturating_sub(CHUNK_HEADROOM)
        .max(128 * 1024);
    let meta = ObjectMetadata {
        name: name.to_string(),
        chunk_size: Some(chunk_size),
        ..Default::default()
    };
    store.put(meta, &mut &bytes[..]).await.map(|_| ())
}

/// Reads object `name` of `bucket` whole (the store checks its SHA-256).
pub async fn get_object(
    nats: &async_nats::Client,
    bucket: &str,
    name: &str,
) -> Result<Vec<u8>, TransportError> {
    let err = |detail: String| TransportError::Store {
        bucket: bucket.to_string(),
        detail,
    };
    let jetstream = async_nats::jetstream::new(nats.clone());
    let store = jetstream
        .get_object_store(bucket)
        .await
        .map_err(|e| err(e.to_string()))?;
    let mut object = store
        .get(name)
        .await
        .map_err(|e| err(format!("{name}: {e}")))?;
    let mut bytes = Vec::new();
    object
        .read_to_end(&mut bytes)
        .await
        .map_err(|e| err(format!("{name}: {e}")))?;
    Ok(bytes)
}

/// The address the direct transfer server listens on: `weights.direct_listen`,
/// else this machine's address on the route to the NATS server (what
/// reaches NATS reaches this too), port 0. The learner replicas' ring
/// listens on the same host.
pub fn listen_address(
    config: &WeightsSection,
    nats_url: &str,
) -> Result<SocketAddr, TransportError> {
    let err = |listen: &str, detail: String| TransportError::Listen {
        listen: listen.to_string(),
        detail,
    };
    if let Some(listen) = &config.direct_listen {
        return listen
            .to_socket_addrs()
            .map_err(|e| err(listen, e.to_string()))?
            .next()
            .ok_or_else(|| err(listen, "resolves to no address".into()));
    }
    // The first server of the URL list; `nats://user:pass@host:port`.
    let first = nats_url.split(',').next().unwrap_or_default();
    let authority = first.split_once("://").map_or(first, |(_, rest)| rest);
    let authority = authority.rsplit_once('@').map_or(authority, |(_, h)| h);
    let authority = authority.trim_end_matches('/');
    let with_port = if authority.contains(':') {
        authority.to_string()
    } else {
        format!("{authority}:4222")
    };
    let server = with_port
        .to_socket_addrs()
        .ok()
        .and_then(|mut a| a.next())
        .ok_or_else(|| err("(from the NATS URL)", format!("cannot resolve {with_port}")))?;
    if server.ip().is_loopback() {
        return Ok((server.ip(), 0).into());
    }
    // A UDP "connection" sends nothing; it asks the kernel for the route.
    let unspecified: SocketAddr = if server.is_ipv4() {
        ([0, 0, 0, 0], 0).into()
    } else {
        (std::net::Ipv6Addr::UNSPECIFIED, 0).into()
    };
    let probe = UdpSocket::bind(unspecified)
        .and_then(|s| s.connect(server).map(|_| s))
        .and_then(|s| s.local_addr())
        .map_err(|e| err("(from the NATS URL)", format!("no route to {server}: {e}")))?;
    Ok((probe.ip(), 0).into())
}

/// A version's message, of any kind: it names the version and says where
/// its bytes are.
pub trait VersionMessage: WireMessage + Clone + Send + Sync + 'static {
    /// The version it publishes.
    fn version(&self) -> u64;
    /// Where the version's bytes are.
    fn blob(&self) -> &WeightsBlob;
    fn blob_mut(&mut self) -> &mut WeightsBlob;
}

impl VersionMessage for WeightsUpdate {
    fn version(&self) -> u64 {
        self.version
    }
    fn blob(&self) -> &WeightsBlob {
        &self.weights
    }
    fn blob_mut(&mut self) -> &mut WeightsBlob {
        &mut self.weights
    }
}

impl VersionMessage for AdapterUpdate {
    fn version(&self) -> u64 {
        self.version
    }
    fn blob(&self) -> &WeightsBlob {
        &self.weights
    }
    fn blob_mut(&mut self) -> &mut WeightsBlob {
        &mut self.weights
    }
}

/// The run's object store bucket of the versions the transport carries,
/// of every kind (`relay-<run>-weights`): `weights.store` puts them there,
/// and a publisher deletes its own past the `weights.keep_versions` newest.
pub fn weights_bucket(run_id: &str) -> String {
    format!("relay-{run_id}-weights")
}

/// Where version `version` of `name` goes: key
/// [`crate::league::weights_object`] (`<name>/v<N>/weights.safetensors`),
/// in the league's bucket when the league keeps it (`keep`: in the store
/// whatever its size, and never deleted by the transport, since past
/// versions are served from there long after their message), else in
/// [`weights_bucket`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement {
    pub bucket: String,
    pub key: String,
    pub keep: bool,
}

impl Placement {
    pub fn of(run_id: &str, name: &str, version: u64, keep: bool) -> Self {
        Self {
            bucket: if keep {
                crate::league::versions_bucket(run_id)
            } else {
                weights_bucket(run_id)
            },
            key: crate::league::weights_object(name, version),
            keep,
        }
    }

    /// What [`WeightsPublisher::publish`] takes.
    pub fn outgoing(&self) -> Outgoing<'_> {
        Outgoing {
            key: &self.key,
            bucket: &self.bucket,
            keep_in_store: self.keep,
        }
    }
}

/// A version a publisher is about to send: its bytes and where they go.
#[derive(Debug, Clone)]
pub struct Outgoing<'a> {
    /// The key (direct server and object store): unique per version,
    /// e.g. `weights/v12` or `learning/v3/adapter_model.safetensors`.
    pub key: &'a str,
    /// The run's object store bucket for this kind of weights.
    pub bucket: &'a str,
    /// Put the bytes in the store even when they travel inline or
    /// directly (they must outlive the publisher: a league's past
    /// adapters).
    pub keep_in_store: bool,
}

/// A publisher's side of the transport (see the module docs).
pub struct WeightsPublisher {
    nats: async_nats::Client,
    config: WeightsSection,
    direct: Option<DirectServer>,
    /// Objects uploaded by this publisher that it may delete once
    /// `keep_versions` newer ones are there: (bucket, key), oldest first.
    stored: Mutex<VecDeque<(String, String)>>,
}

impl WeightsPublisher {
    /// Checks the settings against the NATS server and starts the direct
    /// transfer server (`weights.direct`).
    pub async fn start(
        nats: &async_nats::Client,
        config: &WeightsSection,
        nats_url: &str,
    ) -> Result<Self, TransportError> {
        let max_payload = nats.max_payload();
        if config.inline_max_bytes + 64 * 1024 > max_payload {
            return Err(TransportError::InlineTooLarge {
                inline_max: config.inline_max_bytes,
                max_payload,
            });
        }
        let direct = if config.direct {
            let listen = listen_address(config, nats_url)?;
            Some(
                DirectServer::bind(
                    listen,
                    config.direct_advertise.as_deref(),
                    config.keep_versions,
                )
                .await?,
            )
        } else {
            None
        };
        if let Some(server) = &direct {
            tracing::info!(
                addr = server.addr(),
                "direct transfer server for weights versions"
            );
        }
        Ok(Self {
            nats: nats.clone(),
            config: config.clone(),
            direct,
            stored: Mutex::default(),
        })
    }

    /// `host:port` of the direct transfer server, when there is one.
    pub fn direct_addr(&self) -> Option<&str> {
        self.direct.as_ref().map(DirectServer::addr)
    }

    /// Makes `bytes` fetchable as described in the module docs and returns
    /// where they are. An error means no follower can get this version.
    pub async fn publish(
        &self,
        bytes: Bytes,
        out: Outgoing<'_>,
    ) -> Result<WeightsBlob, TransportError> {
        let digest = relay_proto::sha256(&bytes);
        let inline = bytes.len() <= self.config.inline_max_bytes;
        let to_store = out.keep_in_store
            || (!inline
                && match self.config.store {
                    StoreMode::Always => true,
                    StoreMode::Auto => self.direct.is_none(),
                    StoreMode::Never => false,
                });
        if !inline && self.direct.is_none() && !to_store {
            return Err(TransportError::NoWay {
                bytes: bytes.len(),
                inline_max: self.config.inline_max_bytes,
                why: "weights.direct is off and weights.store is never".into(),
            });
        }
        let store = if to_store {
            let store = store(
                &self.nats,
                out.bucket,
                "weights versions of the run's learner",
            )
            .await?;
            put_object(&self.nats, &store, out.key, &bytes)
                .await
                .map_err(|e| TransportError::Store {
                    bucket: out.bucket.to_string(),
                    detail: format!("{}: {e}", out.key),
                })?;
            if !out.keep_in_store {
                self.forget_old_objects(&store, out.bucket, out.key).await;
            }
            Some(StoreLocation {
                bucket: out.bucket.to_string(),
                key: out.key.to_string(),
            })
        } else {
            None
        };
        let direct = match (&self.direct, inline) {
            (Some(server), false) => {
                server.offer(out.key, bytes.clone());
                Some(DirectLocation {
                    addr: server.addr().to_string(),
                    key: out.key.to_string(),
                })
            }
            _ => None,
        };
        Ok(WeightsBlob {
            size: bytes.len() as u64,
            sha256: digest,
            inline: inline.then(|| bytes.to_vec()),
            direct,
            store,
        })
    }

    /// Deletes this publisher's objects older than the `keep_versions`
    /// newest (a failure only leaves an object behind).
    async fn forget_old_objects(&self, store: &ObjectStore, bucket: &str, key: &str) {
        let stale: Vec<(String, String)> = {
            let mut stored = self.stored.lock().expect("stored objects poisoned");
            stored.push_back((bucket.to_string(), key.to_string()));
            let excess = stored.len().saturating_sub(self.config.keep_versions);
            stored.drain(..excess).collect()
        };
        for (old_bucket, old_key) in stale {
            if old_bucket == bucket {
                if let Err(e) = store.delete(&old_key).await {
                    tracing::debug!(bucket, key = old_key, error = %e, "old weights object not deleted");
                }
            }
        }
    }
}

/// The bytes of `blob`: inline, else from its direct server, else from its
/// object store, checked against its length and digest, within `timeout`
/// for each source.
pub async fn fetch(
    nats: &async_nats::Client,
    blob: &WeightsBlob,
    timeout: Duration,
) -> Result<Bytes, TransportError> {
    if let Some(bytes) = &blob.inline {
        return Ok(Bytes::copy_from_slice(bytes));
    }
    let mut failures = Vec::new();
    if let Some(d) = &blob.direct {
        match crate::direct::fetch(&d.addr, &d.key, blob.size, timeout).await {
            Ok(bytes) => match blob.verify(&bytes) {
                Ok(()) => return Ok(bytes.into()),
                Err(detail) => failures.push(format!("{}: {detail}", d.addr)),
            },
            Err(e) => failures.push(e.to_string()),
        }
    }
    if let Some(s) = &blob.store {
        let read = tokio::time::timeout(timeout, get_object(nats, &s.bucket, &s.key)).await;
        match read {
            Ok(Ok(bytes)) => match blob.verify(&bytes) {
                Ok(()) => return Ok(bytes.into()),
                Err(detail) => failures.push(format!("object {}/{}: {detail}", s.bucket, s.key)),
            },
            Ok(Err(e)) => failures.push(e.to_string()),
            Err(_) => failures.push(format!(
                "object {}/{}: not read within {timeout:?}",
                s.bucket, s.key
            )),
        }
    }
    Err(TransportError::Unreachable(failures.join("; ")))
}

/// One LoRA adapter version to publish: its PEFT files.
#[derive(Debug, Clone)]
pub struct AdapterVersion<'a> {
    pub name: &'a str,
    pub version: u64,
    pub learner_env_steps: u64,
    /// `adapter_config.json`.
    pub config_json: &'a str,
    /// `adapter_model.safetensors`.
    pub safetensors: Bytes,
    /// The league keeps this version: its bytes go to the league's bucket
    /// whatever their size ([`Placement`]), where inference servers look
    /// past versions up long after their message.
    pub keep_in_store: bool,
}

/// Makes `adapter` fetchable through `publisher` (its safetensors as any
/// weights version, placed by [`Placement`]) and returns the
/// [`AdapterUpdate`] to send, which carries its config. Stamped with the
/// time this began, so receivers measure the whole transfer, upload
/// included.
pub async fn publish_adapter(
    publisher: &WeightsPublisher,
    run_id: &str,
    adapter: AdapterVersion<'_>,
) -> Result<AdapterUpdate, TransportError> {
    let published_unix_ms = relay_proto::unix_ms();
    let placement = Placement::of(run_id, adapter.name, adapter.version, adapter.keep_in_store);
    let weights = publisher
        .publish(adapter.safetensors, placement.outgoing())
        .await?;
    Ok(AdapterUpdate {
        schema: relay_proto::SCHEMA_VERSION,
        name: adapter.name.to_string(),
        version: adapter.version,
        learner_env_steps: adapter.learner_env_steps,
        config_json: adapter.config_json.to_string(),
        weights,
        published_unix_ms,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_direct_server_listens_where_nats_is_reached() {
        let config = WeightsSection::default();
        let local = listen_address(&config, "nats://127.0.0.1:4222").unwrap();
        assert!(local.ip().is_loopback() && local.port() == 0);
        let local = listen_address(
            &config,
            "nats://user:pw@localhost:4222,nats://10.0.0.9:4222",
        )
        .unwrap();
        assert!(local.ip().is_loopback());
        let set = WeightsSection {
            direct_listen: Some("0.0.0.0:7000".into()),
            ..config
        };
        assert_eq!(
            listen_address(&set, "nats://127.0.0.1:4222").unwrap(),
            "0.0.0.0:7000".parse().unwrap()
        );
    }

    #[test]
    fn a_version_has_one_key_in_the_bucket_of_who_keeps_it() {
        let live = Placement::of("ttt", "policy", 3, false);
        assert_eq!(live.bucket, "relay-ttt-weights");
        assert_eq!(live.key, "policy/v3/weights.safetensors");
        let kept = Placement::of("ttt", "policy", 3, true);
        assert_eq!(kept.bucket, "relay-ttt-league");
        assert_eq!(kept.key, live.key);
        assert!(kept.outgoing().keep_in_store && !live.outgoing().keep_in_store);
    }
}
