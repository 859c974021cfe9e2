//! Direct transfer of large weight versions from their publisher to each
//! reader over one TCP connection, the way weight-transfer servers in RL
//! stacks move full models (Marin's transfer server, vLLM and SGLang
//! weight sync): the publisher keeps its newest versions in memory behind a
//! [`DirectServer`], announces `addr` and key on NATS, and every reader
//! [`fetch`]es the bytes straight from it.
//!
//! Why not the JetStream object store for a full model: every byte is
//! written to the server's store first (a 538 MB model: 0.7 s), then
//! streamed and SHA-256-checked once per reader through nats-server. The
//! direct path skips the store and the relay hop; the object store stays
//! the path for what must outlive its publisher (LoRA adapters a league
//! serves later).
//!
//! The wire format, per request on a connection (several may follow):
//! the reader sends the key's length (u16, big-endian) and the key's
//! UTF-8 bytes; the server answers one status byte ([`FOUND`] or
//! [`UNKNOWN`]) and, when found, the length (u64, big-endian) and the
//! bytes. TCP's checksums guard the bytes; what they encode (safetensors)
//! is checked by whoever parses them.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// Status byte: the key is held; its length and bytes follow.
pub const FOUND: u8 = 0;
/// Status byte: the key is not (or no longer) held.
pub const UNKNOWN: u8 = 1;

/// What can go wrong serving or fetching a version directly.
#[derive(Debug, thiserror::Error)]
pub enum DirectError {
    #[error("direct transfer server: {0}")]
    Io(#[from] std::io::Error),
    #[error("the listen address {0} is unspecified: give the host readers reach it at")]
    NoAdvertisedHost(SocketAddr),
    #[error("key of {0} bytes is longer than 65535")]
    KeyTooLong(usize),
    #[error("{addr} does not hold {key:?} (evicted or never offered)")]
    Unknown { addr: String, key: String },
    #[error("{addr} answered {key:?} with {bytes} bytes, more than the {max} allowed")]
    TooLarge {
        addr: String,
        key: String,
        bytes: u64,
        max: u64,
    },
    #[error("{addr} answered with status byte {0}", addr = .1)]
    BadStatus(u8, String),
    #[error("fetching {key:?} from {addr} took longer than {timeout:?}")]
    Timeout {
        addr: String,
        key: String,
        timeout: Duration,
    },
}

type Held = Arc<Mutex<VecDeque<(String, Bytes)>>>;

/// A publisher's server of its newest versions. Dropping it stops serving.
pub struct DirectServer {
    addr: String,
    held: Held,
    keep: usize,
    accept: tokio::task::JoinHandle<()>,
}

impl DirectServer {
    /// Listens on `listen` (port 0: any free port) and serves the `keep`
    /// newest offered versions. `advertise`: the host readers connect to,
    /// needed when `listen` is an unspecified address such as `0.0.0.0`.
    pub async fn bind(
        listen: SocketAddr,
        advertise: Option<&str>,
        keep: usize,
    ) -> Result<Self, DirectError> {
        let listener = TcpListener::bind(listen).await?;
        let local = listener.local_addr()?;
        let addr = match advertise {
            Some(host) => format!("{host}:{}", local.port()),
            None if local.ip().is_unspecified() => {
                return Err(DirectError::NoAdvertisedHost(local))
            }
            None => local.to_string(),
        };
        let held: Held = Arc::default();
        let serving = held.clone();
        let accept = tokio::spawn(async move {
            loop {
                match listener.accept().await {
                    Ok((stream, peer)) => {
                        let held = serving.clone();
                        tokio::spawn(async move {
                            if let Err(e) = serve(stream, held).await {
                                tracing::debug!(%peer, error = %e, "direct transfer connection ended");
                            }
                        });
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "direct transfer server: accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                }
            }
        });
        Ok(Self {
            addr,
            held,
            keep: keep.max(1),
            accept,
        })
    }

    /// `host:port` readers fetch from.
    pub fn addr(&self) -> &str {
        &self.addr
    }

    /// Serves `bytes` under `key` from now on, replacing a version of the
    /// same key and dropping the oldest beyond `keep`. Connections already
    /// sending an evicted version finish it: they hold their own handle.
    pub fn offer(&self, key: &str, bytes: Bytes) {
        let mut held = self.held.lock().expect("direct transfer store poisoned");
        held.retain(|(k, _)| k != key);
        held.push_back((key.to_string(), bytes));
        while held.len() > self.keep {
            held.pop_front();
        }
    }
}

impl Drop for DirectServer {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

/// Answers the requests of one connection until the reader closes it.
async fn serve(mut stream: TcpStream, held: Held) -> std::io::Result<()> {
    stream.set_nodelay(true)?;
    loop {
        let key_len = match stream.read_u16().await {
            Ok(n) => n as usize,
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) => return Err(e),
        };
        let mut key = vec![0u8; key_len];
        stream.read_exact(&mut key).await?;
        let found = {
            let held = held.lock().expect("direct transfer store poisoned");
            held.iter()
                .find(|(k, _)| k.as_bytes() == key.as_slice())
                .map(|(_, b)| b.clone())
        };
        match found {
            Some(bytes) => {
                let mut header = [0u8; 9];
                header[0] = FOUND;
                header[1..].copy_from_slice(&(bytes.len() as u64).to_be_bytes());
                stream.write_all(&header).await?;
                stream.write_all(&bytes).await?;
            }
            None => stream.write_all(&[UNKNOWN]).await?,
        }
    }
}

/// Fetches `key` from the [`DirectServer`] at `addr` (`host:port`),
/// refusing answers over `max_bytes`, within `timeout` in all.
pub async fn fetch(
    addr: &str,
    key: &str,
    max_bytes: u64,
    timeout: Duration,
) -> Result<Vec<u8>, DirectError> {
    let work = async {
        if key.len() > u16::MAX as usize {
            return Err(DirectError::KeyTooLong(key.len()));
        }
        let mut stream = TcpStream::connect(addr).await?;
        stream.set_nodelay(true)?;
        let mut request = Vec::with_capacity(2 + key.len());
        request.extend_from_slice(&(key.len() as u16).to_be_bytes());
        request.extend_from_slice(key.as_bytes());
        stream.write_all(&request).await?;
        match stream.read_u8().await? {
            FOUND => {}
            UNKNOWN => {
                return Err(DirectError::Unknown {
                    addr: addr.to_string(),
                    key: key.to_string(),
                })
            }
            other => return Err(DirectError::BadStatus(other, addr.to_string())),
        }
        let bytes = stream.read_u64().await?;
        if bytes > max_bytes {
            return Err(DirectError::TooLarge {
                addr: addr.to_string(),
                key: key.to_string(),
                bytes,
                max: max_bytes,
            });
        }
        // Zeroed by the allocator's fresh pages, not by a pass over them.
        let mut held = vec![0u8; bytes as usize];
        stream.read_exact(&mut held).await?;
        Ok(held)
    };
    tokio::time::timeout(timeout, work)
        .await
        .map_err(|_| DirectError::Timeout {
            addr: addr.to_string(),
            key: key.to_string(),
            timeout,
        })?
}

#[cfg(test)]
mod tests {
    use super::*;

    const SECOND: Duration = Duration::from_secs(1);

    #[tokio::test]
    async fn readers_get_the_offered_bytes_and_evicted_keys_are_refused() {
        let server = DirectServer::bind("127.0.0.1:0".parse().unwrap(), None, 2)
            .await
            .unwrap();
        let big: Vec<u8> = (0..3_000_000u32).map(|i| (i * 7 % 251) as u8).collect();
        server.offer("v1", Bytes::from(big.clone()));
        server.offer("v2", Bytes::from_static(b"two"));
        let readers: Vec<_> = (0..4)
            .map(|_| {
                let addr = server.addr().to_string();
                tokio::spawn(async move { fetch(&addr, "v1", u64::MAX, SECOND * 10).await })
            })
            .collect();
        for r in readers {
            assert_eq!(r.await.unwrap().unwrap(), big);
        }
        server.offer("v3", Bytes::from_static(b"three"));
        let err = fetch(server.addr(), "v1", u64::MAX, SECOND)
            .await
            .unwrap_err();
        assert!(matches!(err, DirectError::Unknown { .. }), "{err}");
        assert_eq!(
            fetch(server.addr(), "v3", u64::MAX, SECOND).await.unwrap(),
            b"three"
        );
        let err = fetch(server.addr(), "v2", 2, SECOND).await.unwrap_err();
        assert!(
            matches!(err, DirectError::TooLarge { bytes: 3, .. }),
            "{err}"
        );
    }

    #[tokio::test]
    async fn an_unspecified_listen_address_needs_a_host_to_advertise() {
        let any: SocketAddr = "0.0.0.0:0".parse().unwrap();
        assert!(matches!(
            DirectServer::bind(any, None, 1).await,
            Err(DirectError::NoAdvertisedHost(_))
        ));
        let server = DirectServer::bind(any, Some("127.0.0.1"), 1).await.unwrap();
        server.offer("k", Bytes::from_static(b"bytes"));
        assert_eq!(
            fetch(server.addr(), "k", 100, SECOND).await.unwrap(),
            b"bytes"
        );
    }
}
