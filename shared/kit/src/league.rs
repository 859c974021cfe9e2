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
//! It also names where the league's adapter versions are stored: the run's
//! JetStream object store bucket ([`adapter_bucket`]), one folder per
//! version ([`adapter_key`]), which the learner writes and prunes and the
//! inference servers read from on demand.

use redis::aio::ConnectionManager;
use relay_league::{FixedOpponent, Pool, PoolConfig, PoolError};
use serde::{Deserialize, Serialize};

/// The JetStream object store bucket of a run's adapter versions.
pub fn adapter_bucket(run_id: &str) -> String {
    format!("relay-{run_id}-adapters")
}

/// The folder of one adapter version in [`adapter_bucket`]: its files are
/// `<key>/adapter_config.json` and `<key>/adapter_model.safetensors`.
pub fn adapter_key(name: &str, version: u64) -> String {
    format!("{name}/v{version}")
}

/// The adapter name and version of an object inside [`adapter_key`]'s
/// folder (`policy/v12/adapter_config.json` is `("policy", 12)`).
pub fn parse_adapter_object(object: &str) -> Option<(&str, u64)> {
    let mut parts = object.splitn(3, '/');
    let name = parts.next().filter(|n| !n.is_empty())?;
    let digits = parts.next()?.strip_prefix('v')?;
    parts.next()?;
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    Some((name, digits.parse().ok()?))
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
    fn adapter_objects_name_their_version() {
        let key = adapter_key("policy", 12);
        assert_eq!(key, "policy/v12");
        assert_eq!(
            parse_adapter_object(&format!("{key}/adapter_config.json")),
            Some(("policy", 12))
        );
        for bad in [
            "policy/v12",
            "policy/12/x",
            "policy/v/x",
            "/v1/x",
            "policy/v1x/y",
        ] {
            assert_eq!(parse_adapter_object(bad), None, "{bad}");
        }
        assert_eq!(adapter_bucket("ttt"), "relay-ttt-adapters");
    }
}
