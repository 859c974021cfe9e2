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

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, Ordering};

use futures::StreamExt;
use relay_kit::weights::{TransportError, VersionMessage};
use relay_kit::{Service, ServiceError, Shutdown};
use relay_league::{MemberId, PolicyVersion, Pool};
use relay_policy::text::LEARNING_ADAPTER;

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
    /// The league of the run, if it has one (connecting to its Redis).
    pub(crate) async fn start(
        cfg: &relay_config::ExperimentConfig,
        shutdown: &Shutdown,
    ) -> Result<Option<Self>, ServiceError> {
        if !cfg.league_enabled() {
            return Ok(None);
        }
        let redis = relay_kit::connect_redis_with(&cfg.connections, shutdown)
            .await
            .map_err(|e| ServiceError::Other(format!("league pool: {e}")))?;
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
