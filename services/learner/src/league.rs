//! The learner's part in the league (runs with `text.opponents.league` or
//! `selfplay.opponents.league`): keeping the versions it publishes in the
//! run's league bucket (the one layout of [`relay_kit::league`]: a folder
//! per version holding its bytes and its message), admitting them to the
//! run's pool (in Redis), and deleting the kept versions the pool evicted.
//!
//! Which versions are kept is the kind's ([`crate::publish::Version`]):
//! every LoRA adapter version (an evaluation may ask the inference servers
//! for any), and of a classic policy only the versions the pool may admit
//! ([`League::keeps`]: the first of each process and every
//! `league.pool.admit_every`-th, since the others never become opponents).
//! A version is kept and admitted before anyone hears of it
//! ([`crate::publish`]), so an env-runner that draws it finds it.
//!
//! Runs from before this layout kept their versions in
//! `relay-<run>-adapters`, in two layouts; at start the learner moves them
//! into the league bucket ([`League::start`]) and deletes that bucket.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, Ordering};

use futures::StreamExt;
use relay_kit::weights::{TransportError, VersionMessage};
use relay_kit::{Service, ServiceError, Shutdown};
use relay_league::{MemberId, PolicyVersion, Pool};
use relay_policy::text::LEARNING_ADAPTER;
use relay_proto::{AdapterUpdate, StoreLocation, WeightsBlob, WeightsUpdate};

/// The learner's handle on the league pool.
pub(crate) struct League {
    store: relay_kit::league::LeagueStore,
    config: relay_league::PoolConfig,
    fixed: Vec<relay_league::FixedOpponent>,
    /// Whether the bucket was compared with the pool since start (leftovers
    /// of an earlier process go at the first publication).
    pruned_once: AtomicBool,
    /// Whether this process stored a version yet (its first is stored
    /// whatever its number: it joins an empty pool).
    stored_once: AtomicBool,
}

impl League {
    /// The league of the run, if it has one (connecting to its Redis),
    /// with the versions an earlier learner kept in the old bucket moved
    /// into the league bucket ([`move_old_versions`]).
    pub(crate) async fn start(
        cfg: &relay_config::ExperimentConfig,
        nats: &async_nats::Client,
        shutdown: &Shutdown,
    ) -> Result<Option<Self>, ServiceError> {
        if !cfg.league_enabled() {
            return Ok(None);
        }
        let redis = relay_kit::connect_redis_with(&cfg.connections, shutdown)
            .await
            .map_err(|e| ServiceError::Other(format!("league pool: {e}")))?;
        match move_old_versions(nats, cfg.run_id()?).await {
            Ok(0) => {}
            Ok(moved) => tracing::info!(
                moved,
                "league versions of an earlier run moved to the league bucket"
            ),
            Err(e) => {
                tracing::warn!(error = %e, "league versions of an earlier run not moved; they cannot be played")
            }
        }
        Ok(Some(Self {
            store: relay_kit::league::LeagueStore::new(redis, cfg.run_id()?),
            config: cfg.league.pool,
            fixed: cfg.league_fixed(),
            pruned_once: AtomicBool::new(false),
            stored_once: AtomicBool::new(false),
        }))
    }

    /// Whether the league keeps `version`: every version when `every`,
    /// else only one the pool may admit (see the module docs).
    pub(crate) fn keeps(&self, version: u64, every: bool) -> bool {
        every
            || !self.stored_once.load(Ordering::Relaxed)
            || version.is_multiple_of(self.config.admit_every)
    }

    /// Keeps `update` in the league bucket beside its bytes (the weights
    /// transport put them there); a version that cannot be kept is logged
    /// and does not join. Returns whether it was kept.
    pub(crate) async fn keep<U: VersionMessage>(&self, service: &Service, update: &U) -> bool {
        let kept = match service.config.run_id() {
            Ok(run_id) => {
                relay_kit::league::store_update(&service.nats, run_id, LEARNING_ADAPTER, update)
                    .await
            }
            Err(e) => Err(TransportError::Unreachable(e.to_string())),
        };
        match kept {
            Ok(()) => {
                self.stored_once.store(true, Ordering::Relaxed);
                true
            }
            Err(e) => {
                tracing::warn!(error = %e, version = update.version(), "league version not kept; it does not join the pool");
                false
            }
        }
    }

    /// Admits `version` when the pool takes it, then prunes the bucket if
    /// anything was evicted (or at the first call), sparing `held`
    /// (versions under evaluation that inference servers may fetch again).
    /// Failures are logged: the run trains on, the pool catches up.
    pub(crate) async fn admit_and_prune(
        &self,
        service: &Service,
        version: u64,
        held: &BTreeSet<u64>,
    ) {
        match self.admit(version).await {
            Ok((pool, evicted)) => {
                if evicted || !self.pruned_once.swap(true, Ordering::Relaxed) {
                    match self.prune(service, &pool, held).await {
                        Ok(0) => {}
                        Ok(deleted) => tracing::info!(
                            deleted,
                            "evicted league versions deleted from the object store"
                        ),
                        Err(e) => {
                            tracing::warn!(error = %e, "evicted league versions not deleted")
                        }
                    }
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, version, "version not admitted to the league pool")
            }
        }
    }

    /// Admits `version` (parent: the newest version in the pool) when the
    /// pool takes it ([`Pool::admits`]), adding missing fixed members;
    /// returns the pool and whether anything was evicted.
    async fn admit(&self, version: u64) -> Result<(Pool, bool), String> {
        let (evicted, pool) = self
            .store
            .update(self.config, &self.fixed, |pool| {
                for fixed in &self.fixed {
                    let id = MemberId::Fixed(fixed.name.clone());
                    if pool.get(&id).is_none() {
                        pool.add_fixed(fixed.clone())?;
                    }
                }
                // Between admissions (`admit_every`) a version's games
                // count for the newest version in the pool.
                if !pool.admits(version) || pool.get(&MemberId::Version(version)).is_some() {
                    return Ok(0);
                }
                let parent = pool.current_version();
                let evicted = pool.add_version(PolicyVersion {
                    version,
                    parent,
                    weights_ref: relay_kit::league::version_key(LEARNING_ADAPTER, version),
                })?;
                Ok(evicted.len())
            })
            .await
            .map_err(|e| e.to_string())?;
        Ok((pool, evicted > 0))
    }

    /// Deletes the kept versions of the learning policy older than the
    /// pool's newest that neither the pool nor `held` holds; returns how
    /// many. A held version goes at a later prune.
    async fn prune(
        &self,
        service: &Service,
        pool: &Pool,
        held: &BTreeSet<u64>,
    ) -> Result<usize, String> {
        let Some(newest) = pool.current_version() else {
            return Ok(0);
        };
        let bucket =
            relay_kit::league::versions_bucket(service.config.run_id().map_err(|e| e.to_string())?);
        let store = relay_kit::weights::store(&service.nats, &bucket, "league versions")
            .await
            .map_err(|e| e.to_string())?;
        let mut objects = store
            .list()
            .await
            .map_err(|e| format!("listing {bucket}: {e}"))?;
        let mut doomed = Vec::new();
        while let Some(object) = objects.next().await {
            let object = object.map_err(|e| format!("listing {bucket}: {e}"))?;
            if let Some((name, version)) = relay_kit::league::parse_version_object(&object.name) {
                let kept = pool.get(&MemberId::Version(version)).is_some();
                if name == LEARNING_ADAPTER && version < newest && !kept && !held.contains(&version)
                {
                    doomed.push((object.name, version));
                }
            }
        }
        let mut versions = BTreeSet::new();
        for (object, version) in doomed {
            store
                .delete(&object)
                .await
                .map_err(|e| format!("deleting {bucket}/{object}: {e}"))?;
            versions.insert(version);
        }
        Ok(versions.len())
    }
}

/// The bucket where learners kept league versions before the one layout:
/// an adapter as `<name>/v<N>/adapter_config.json` and
/// `adapter_model.safetensors`, a classic version as
/// `<name>/v<N>/model.safetensors` and `update.msgpack`.
fn old_bucket(run_id: &str) -> String {
    format!("relay-{run_id}-adapters")
}

/// Moves the versions kept in run `run_id`'s [`old_bucket`] into its
/// league bucket, in the one layout, then deletes the old bucket; returns
/// how many versions moved. Objects that make no whole version (a text
/// run without a league kept only live adapters' weights there) are
/// dropped with it. Nothing to do when there is no old bucket.
async fn move_old_versions(nats: &async_nats::Client, run_id: &str) -> Result<usize, String> {
    let jetstream = async_nats::jetstream::new(nats.clone());
    let old = old_bucket(run_id);
    let Ok(store) = jetstream.get_object_store(&old).await else {
        return Ok(0);
    };
    let mut versions: BTreeMap<(String, u64), BTreeSet<String>> = BTreeMap::new();
    let mut objects = store
        .list()
        .await
        .map_err(|e| format!("listing {old}: {e}"))?;
    while let Some(object) = objects.next().await {
        let object = object.map_err(|e| format!("listing {old}: {e}"))?.name;
        if let Some((name, version)) = relay_kit::league::parse_version_object(&object) {
            let file =
                object[relay_kit::league::version_key(name, version).len() + 1..].to_string();
            versions
                .entry((name.to_string(), version))
                .or_default()
                .insert(file);
        }
    }
    let read = async |name: &str, version: u64, file: &str| {
        let object = format!("{}/{file}", relay_kit::league::version_key(name, version));
        relay_kit::weights::get_object(nats, &old, &object)
            .await
            .map_err(|e| e.to_string())
    };
    let mut moved = 0;
    for ((name, version), files) in versions {
        let has = |file: &str| files.contains(file);
        if has("update.msgpack") && has("model.safetensors") {
            let update: WeightsUpdate =
                relay_proto::decode(&read(&name, version, "update.msgpack").await?)
                    .map_err(|e| format!("{old}: {name}/v{version}/update.msgpack: {e}"))?;
            let bytes = read(&name, version, "model.safetensors").await?;
            keep_moved(nats, run_id, &name, update, &bytes).await?;
        } else if has(relay_proto::ADAPTER_CONFIG_OBJECT)
            && has(relay_proto::ADAPTER_WEIGHTS_OBJECT)
        {
            let config = read(&name, version, relay_proto::ADAPTER_CONFIG_OBJECT).await?;
            let bytes = read(&name, version, relay_proto::ADAPTER_WEIGHTS_OBJECT).await?;
            let update = AdapterUpdate {
                schema: relay_proto::SCHEMA_VERSION,
                name: name.clone(),
                version,
                // Not kept by the old layout; nothing reads it of a past version.
                learner_env_steps: 0,
                config_json: String::from_utf8(config)
                    .map_err(|_| format!("{old}: {name}/v{version}: config is not UTF-8"))?,
                weights: WeightsBlob::inline(Vec::new()),
                published_unix_ms: 0,
            };
            keep_moved(nats, run_id, &name, update, &bytes).await?;
        } else {
            continue;
        }
        moved += 1;
    }
    jetstream
        .delete_object_store(&old)
        .await
        .map_err(|e| format!("deleting {old}: {e}"))?;
    Ok(moved)
}

/// Puts `bytes` in the league bucket as version `update.version()` of
/// `name` and keeps `update` beside them, naming them.
async fn keep_moved<U: VersionMessage>(
    nats: &async_nats::Client,
    run_id: &str,
    name: &str,
    mut update: U,
    bytes: &[u8],
) -> Result<(), String> {
    let bucket = relay_kit::league::versions_bucket(run_id);
    let key = relay_kit::league::weights_object(name, update.version());
    let store = relay_kit::weights::store(nats, &bucket, "league versions")
        .await
        .map_err(|e| e.to_string())?;
    relay_kit::weights::put_object(nats, &store, &key, bytes)
        .await
        .map_err(|e| format!("{bucket}/{key}: {e}"))?;
    *update.blob_mut() = WeightsBlob {
        size: bytes.len() as u64,
        sha256: relay_proto::sha256(bytes),
        inline: None,
        direct: None,
        store: Some(StoreLocation { bucket, key }),
    };
    relay_kit::league::store_update(nats, run_id, name, &update)
        .await
        .map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Versions kept by a learner from before the one layout (an adapter's
    /// PEFT files, a classic version's parameters and message) move to the
    /// league bucket, whole and readable, and the old bucket goes.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn versions_in_the_old_bucket_move_to_the_league_bucket() {
        let nats = relay_testkit::NatsServer::start().unwrap();
        let client = async_nats::connect(nats.url()).await.unwrap();
        let run = "moved";
        let old = relay_kit::weights::store(&client, &old_bucket(run), "old")
            .await
            .unwrap();
        let put = async |object: &str, bytes: &[u8]| {
            relay_kit::weights::put_object(&client, &old, object, bytes)
                .await
                .unwrap()
        };
        // An adapter version, and the weights of a live one (no config).
        put("policy/v3/adapter_config.json", b"{\"r\": 8}").await;
        put("policy/v3/adapter_model.safetensors", b"adapter bytes").await;
        put("policy/v9/adapter_model.safetensors", b"live only").await;
        // A classic version: its parameters and its message naming them.
        let parameters = b"classic bytes".to_vec();
        let update = WeightsUpdate {
            schema: relay_proto::SCHEMA_VERSION,
            version: 4,
            learner_env_steps: 400,
            weights: WeightsBlob {
                inline: None,
                store: Some(StoreLocation {
                    bucket: old_bucket(run),
                    key: "policy/v4/model.safetensors".into(),
                }),
                ..WeightsBlob::inline(parameters.clone())
            },
            normalizer: None,
            published_unix_ms: 0,
        };
        put("policy/v4/model.safetensors", &parameters).await;
        put("policy/v4/update.msgpack", &relay_proto::encode(&update)).await;

        assert_eq!(move_old_versions(&client, run).await.unwrap(), 2);
        let timeout = std::time::Duration::from_secs(5);
        let adapter: AdapterUpdate =
            relay_kit::league::stored_update(&client, run, "policy", 3, timeout)
                .await
                .unwrap()
                .expect("the adapter moved");
        assert_eq!(adapter.config_json, "{\"r\": 8}");
        let bytes = relay_kit::weights::fetch(&client, &adapter.weights, timeout)
            .await
            .unwrap();
        assert_eq!(&bytes[..], b"adapter bytes");
        let classic: WeightsUpdate =
            relay_kit::league::stored_update(&client, run, "policy", 4, timeout)
                .await
                .unwrap()
                .expect("the classic version moved");
        assert_eq!(classic.learner_env_steps, 400);
        let bytes = relay_kit::weights::fetch(&client, &classic.weights, timeout)
            .await
            .unwrap();
        assert_eq!(&bytes[..], &parameters[..]);
        let none: Option<AdapterUpdate> =
            relay_kit::league::stored_update(&client, run, "policy", 9, timeout)
                .await
                .unwrap();
        assert!(none.is_none(), "no whole version 9 was kept");
        assert!(async_nats::jetstream::new(client.clone())
            .get_object_store(old_bucket(run))
            .await
            .is_err());
        // Nothing left to move.
        assert_eq!(move_old_versions(&client, run).await.unwrap(), 0);
    }
}
