//! The league's model pool where every service sees it: one Redis key per
//! run, `relay:<run>:league`, holding a JSON document `{"revision": n,
//! "pool": <relay_league::Pool>}`.
//!
//! This module owns reading and changing that document. A change is
//! optimistic: read the pool and its revision, apply the change in Rust
//! ([`relay_league::Pool`] holds all the rules), then write it back with a
//! Lua compare-and-set that succeeds only if the revision is still the one
//! read; on a conflict (another env-runner recorded games meanwhile) the
//! change is applied again to the fresh pool. Redis' persistence keeps the
//! pool across restarts of every service.
//!
//! It also owns where and how the league keeps its versions, classic
//! policies and LoRA adapters alike: the run's JetStream object store
//! bucket [`versions_bucket`] (`relay-<run>-league`), one folder per
//! version ([`version_key`], `<name>/v<N>`, the pool's `weights_ref`)
//! holding two objects:
//! - [`WEIGHTS_OBJECT`] (`weights.safetensors`): the version's bytes, a
//!   classic policy's parameters or an adapter's
//!   `adapter_model.safetensors`, put there by the weights transport
//!   ([`crate::weights::Placement`]);
//! - [`UPDATE_OBJECT`] (`update.msgpack`): the message the version was
//!   published with (`WeightsUpdate` or `AdapterUpdate`, MessagePack), its
//!   blob naming the bytes' object with their length and SHA-256, so a
//!   kept version is fetched ([`crate::weights::fetch`]) and checked like
//!   a live one, at any size. Written last ([`store_update`]): a version
//!   whose message is found is whole.
//!
//! The learner writes versions and deletes those the pool evicted; the
//! inference servers read them ([`stored_update`]) when a league game or an
//! evaluation asks for a past version.

use std::time::Duration;

use redis::aio::ConnectionManager;
use relay_league::{FixedOpponent, Pool, PoolConfig, PoolError};
use serde::{Deserialize, Serialize};
use tokio::io::AsyncReadExt;

use crate::weights::{TransportError, VersionMessage};

/// The JetStream object store bucket of the versions a run's league keeps.
pub fn versions_bucket(run_id: &str) -> String {
    format!("relay-{run_id}-league")
}

/// The folder of version `version` of `name` in [`versions_bucket`] (and
/// the pool's `weights_ref` of that version).
pub fn version_key(name: &str, version: u64) -> String {
    format!("{name}/v{version}")
}

/// The object of a version's bytes, in its folder.
pub const WEIGHTS_OBJECT: &str = "weights.safetensors";
/// The object of a version's message, in its folder.
pub const UPDATE_OBJECT: &str = "update.msgpack";

/// The key of version `version` of `name`'s bytes (also its key on the
/// weights transport, kept or not).
pub fn weights_object(name: &str, version: u64) -> String {
    format!("{}/{WEIGHTS_OBJECT}", version_key(name, version))
}

/// The key of version `version` of `name`'s message.
pub fn update_object(name: &str, version: u64) -> String {
    format!("{}/{UPDATE_OBJECT}", version_key(name, version))
}

/// The name and version of an object inside a version's folder
/// (`policy/v12/update.msgpack` is `("policy", 12)`).
pub fn parse_version_object(object: &str) -> Option<(&str, u64)> {
    let mut parts = object.splitn(3, '/');
    let name = parts.next().filter(|n| !n.is_empty())?;
    let digits = parts.next()?.strip_prefix('v')?;
    parts.next()?;
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    Some((name, digits.parse().ok()?))
}

/// Keeps `update`, version `update.version()` of `name`, in run `run_id`'s
/// league bucket: its message beside its bytes, which the weights
/// transport already put at [`weights_object`] (a kept
/// [`crate::weights::Placement`]). The message kept names the store only:
/// inline bytes and the publisher's direct server do not last.
pub async fn store_update<U: VersionMessage>(
    nats: &async_nats::Client,
    run_id: &str,
    name: &str,
    update: &U,
) -> Result<(), TransportError> {
    let bucket = versions_bucket(run_id);
    let version = update.version();
    let key = weights_object(name, version);
    let mut kept = update.clone();
    let blob = kept.blob_mut();
    if blob
        .store
        .as_ref()
        .is_none_or(|s| s.bucket != bucket || s.key != key)
    {
        return Err(TransportError::Store {
            bucket,
            detail: format!("{key}: the version's bytes were not put there"),
        });
    }
    blob.inline = None;
    blob.direct = None;
    let store = crate::weights::store(nats, &bucket, "league versions").await?;
    let object = update_object(name, version);
    crate::weights::put_object(nats, &store, &object, &relay_proto::encode(&kept))
        .await
        .map_err(|e| TransportError::Store {
            bucket,
            detail: format!("{object}: {e}"),
        })
}

/// The message of version `version` of `name` as run `run_id`'s league
/// keeps it (its blob names the bytes in the bucket), read within
/// `timeout`; `None` when it is not kept: no bucket, never stored, or
/// deleted when the pool evicted it.
pub async fn stored_update<U: VersionMessage>(
    nats: &async_nats::Client,
    run_id: &str,
    name: &str,
    version: u64,
    timeout: Duration,
) -> Result<Option<U>, TransportError> {
    use async_nats::jetstream::object_store::GetErrorKind;
    let bucket = versions_bucket(run_id);
    let object = update_object(name, version);
    let failed = |detail: String| TransportError::Store {
        bucket: bucket.clone(),
        detail: format!("{object}: {detail}"),
    };
    let read = async {
        let Ok(store) = async_nats::jetstream::new(nats.clone())
            .get_object_store(&bucket)
            .await
        else {
            return Ok(None);
        };
        let mut reader = match store.get(&object).await {
            Ok(reader) => reader,
            Err(e) if e.kind() == GetErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(failed(e.to_string())),
        };
        let mut bytes = Vec::new();
        reader
            .read_to_end(&mut bytes)
            .await
            .map_err(|e| failed(e.to_string()))?;
        Ok(Some(bytes))
    };
    let Some(bytes) = tokio::time::timeout(timeout, read)
        .await
        .map_err(|_| failed(format!("not read within {timeout:?}")))??
    else {
        return Ok(None);
    };
    relay_proto::decode(&bytes)
        .map(Some)
        .map_err(|e| TransportError::Corrupt {
            source_name: format!("{bucket}/{object}"),
            detail: e.to_string(),
        })
}

/// Writes `ARGV[2]` (with revision `ARGV[1] + 1`) if the stored revision is
/// `ARGV[1]` (0: no document yet). Returns 1 when written, 0 on conflict.
const COMPARE_AND_SET: &str = r#"
local doc = redis.call('GET', KEYS[1])
local revision = 0
if doc then
  revision = cjson.decode(doc)['revision']
end
if revision ~= tonumber(ARGV[1]) then
  return 0
end
redis.call('SET', KEYS[1], ARGV[2])
return 1
"#;

/// Attempts of one change before giving up (each conflict means another
/// writer made progress, so this bounds only pathological contention).
const MAX_ATTEMPTS: usize = 50;

/// Why a league operation failed.
#[derive(Debug, thiserror::Error)]
pub enum LeagueError {
    #[error("league store: {0}")]
    Redis(#[from] redis::RedisError),
    #[error("league store: the pool at {key} does not parse: {detail}")]
    Corrupt { key: String, detail: String },
    #[error("league: {0}")]
    Pool(#[from] PoolError),
    #[error("league store: {attempts} conflicting writes in a row on {key}")]
    Contended { key: String, attempts: usize },
}

#[derive(Deserialize)]
struct Document {
    revision: u64,
    pool: Pool,
}

#[derive(Serialize)]
struct DocumentRef<'a> {
    revision: u64,
    pool: &'a Pool,
}

/// The pool of one run in Redis.
#[derive(Clone)]
pub struct LeagueStore {
    redis: ConnectionManager,
    key: String,
    script: redis::Script,
}

impl LeagueStore {
    /// The store of `run_id`; nothing is read or written yet.
    pub fn new(redis: ConnectionManager, run_id: &str) -> Self {
        Self {
            redis,
            key: format!("relay:{run_id}:league"),
            script: redis::Script::new(COMPARE_AND_SET),
        }
    }

    /// The Redis key holding the pool.
    pub fn key(&self) -> &str {
        &self.key
    }

    async fn read(&self) -> Result<Option<Document>, LeagueError> {
        let mut redis = self.redis.clone();
        let text: Option<String> = redis::cmd("GET")
            .arg(&self.key)
            .query_async(&mut redis)
            .await?;
        text.map(|t| {
            serde_json::from_str(&t).map_err(|e| LeagueError::Corrupt {
                key: self.key.clone(),
                detail: e.to_string(),
            })
        })
        .transpose()
    }

    /// The pool as stored, `None` before anyone created it.
    pub async fn load(&self) -> Result<Option<Pool>, LeagueError> {
        Ok(self.read().await?.map(|d| d.pool))
    }

    /// Applies `change` to the stored pool (a new pool of `config` with the
    /// `fixed` opponents when there is none) and stores the result; retries
    /// on conflicting writes. A stored pool keeps its own config.
    pub async fn update<T>(
        &self,
        config: PoolConfig,
        fixed: &[FixedOpponent],
        mut change: impl FnMut(&mut Pool) -> Result<T, PoolError>,
    ) -> Result<(T, Pool), LeagueError> {
        for _ in 0..MAX_ATTEMPTS {
            let (revision, mut pool) = match self.read().await? {
                Some(doc) => (doc.revision, doc.pool),
                None => {
                    let mut pool = Pool::new(config)?;
                    for opponent in fixed {
                        pool.add_fixed(opponent.clone())?;
                    }
                    (0, pool)
                }
            };
            let out = change(&mut pool)?;
            let doc = serde_json::to_string(&DocumentRef {
                revision: revision + 1,
                pool: &pool,
            })
            .expect("a pool serializes");
            let mut redis = self.redis.clone();
            let written: i64 = self
                .script
                .key(&self.key)
                .arg(revision)
                .arg(&doc)
                .invoke_async(&mut redis)
                .await?;
            if written == 1 {
                return Ok((out, pool));
            }
        }
        Err(LeagueError::Contended {
            key: self.key.clone(),
            attempts: MAX_ATTEMPTS,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn version_objects_name_their_version() {
        let key = version_key("policy", 12);
        assert_eq!(key, "policy/v12");
        assert_eq!(
            weights_object("policy", 12),
            "policy/v12/weights.safetensors"
        );
        assert_eq!(update_object("policy", 12), "policy/v12/update.msgpack");
        for object in [weights_object("policy", 12), update_object("policy", 12)] {
            assert_eq!(parse_version_object(&object), Some(("policy", 12)));
        }
        for bad in [
            "policy/v12",
            "policy/12/x",
            "policy/v/x",
            "/v1/x",
            "policy/v1x/y",
        ] {
            assert_eq!(parse_version_object(bad), None, "{bad}");
        }
        assert_eq!(versions_bucket("ttt"), "relay-ttt-league");
    }
}
