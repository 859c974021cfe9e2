//! The adapters one base model serves: where every known (name, version)
//! comes from, and an LRU of the ones loaded.
//!
//! Sources are the folders of `llm.adapters` (version 0 of their name) and
//! every [`AdapterUpdate`] heard on `relay.<run>.adapters`: its config and
//! where its weights are ([`WeightsBlob`], through the one weights
//! transport, `relay_kit::weights`): inline bytes (kept, so an evicted
//! version reloads from them), or the learner's direct transfer server or
//! the JetStream object store (fetched again on reload); of each name the
//! sources of the [`VERSIONS_KEPT`] versions last published or asked for
//! are kept (an evaluation pins the version it plays, and must find it
//! until its last game, whatever is published meanwhile). A request names an
//! adapter and optionally a version (`None`: the newest known); at most
//! `llm.max_adapters` versions stay loaded, the least recently used one
//! dropped past it. Sequences already decoding keep their adapter (an
//! `Arc`) until they finish, whatever the LRU does.
//!
//! A request for a version the server does not know (older than the
//! versions it keeps, or published before it started) is looked up in the
//! run's league bucket (`relay-<run>-league`, where the learner of a
//! league run keeps every version: its [`AdapterUpdate`] at
//! `<name>/v<N>/update.msgpack`, naming its weights beside it,
//! [`relay_kit::league`]); found, it is loaded and then kept or dropped by
//! the LRU like any other (and fetched again when asked for after that).
//! Not found, the answer is 404.
//!
//! [`AdapterStore::follow`] hears the published versions through the
//! learner's one follower loop ([`relay_policy::VersionFeed`]): a server
//! that starts after the learner published asks it for the current version
//! of the learning adapter (`adapters.latest`) until it knows one.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;

use relay_llm::{LoraAdapter, ModelConfig};
use relay_proto::{AdapterRef, AdapterUpdate, WeightsBlob};

use super::metrics::LlmMetrics;

/// Versions of one name whose sources are kept: past it, the least
/// recently published or asked for is forgotten, so a version an evaluation
/// keeps playing stays however many are published meanwhile.
pub(crate) const VERSIONS_KEPT: usize = 16;

/// Why an adapter could not be served.
#[derive(Debug, thiserror::Error)]
pub(crate) enum AdapterError {
    #[error("unknown adapter {name:?} (known: {known})")]
    UnknownName { name: String, known: String },
    #[error("adapter {name:?} has no version {version} (known: {known}; not in the object store either)")]
    UnknownVersion {
        name: String,
        version: u64,
        known: String,
    },
    #[error("adapter {name:?} version {version}: {detail}")]
    Load {
        name: String,
        version: u64,
        detail: String,
    },
}

impl AdapterError {
    /// The NATS service error code: 404 for what is not known, 500 for a
    /// known adapter that failed to load.
    pub(crate) fn code(&self) -> usize {
        match self {
            Self::UnknownName { .. } | Self::UnknownVersion { .. } => 404,
            Self::Load { .. } => 500,
        }
    }
}

/// Where an adapter version's files are.
#[derive(Debug, Clone)]
enum Source {
    Folder(PathBuf),
    /// A published version: its config, and its weights inline or where
    /// to fetch them.
    Published {
        config_json: Arc<str>,
        weights: Arc<WeightsBlob>,
    },
}

/// A known version: where it comes from, and when it was last published
/// or asked for (on [`Inner::clock`]).
struct Known {
    source: Source,
    last_used: u64,
}

/// Forgets the least recently used versions past [`VERSIONS_KEPT`];
/// returns them.
fn forget_least_recently_used(versions: &mut BTreeMap<u64, Known>) -> Vec<u64> {
    let mut forgotten = Vec::new();
    while versions.len() > VERSIONS_KEPT {
        let lru = versions
            .iter()
            .min_by_key(|(_, known)| known.last_used)
            .map(|(version, _)| *version)
            .expect("non-empty");
        versions.remove(&lru);
        forgotten.push(lru);
    }
    forgotten
}

struct Loaded {
    name: String,
    version: u64,
    adapter: Arc<LoraAdapter>,
    last_used: u64,
}

struct Inner {
    known: BTreeMap<String, BTreeMap<u64, Known>>,
    loaded: Vec<Loaded>,
    clock: u64,
}

/// The names `inner` knows, for error messages.
fn known_names(inner: &Inner) -> String {
    let known: Vec<&str> = inner.known.keys().map(String::as_str).collect();
    if known.is_empty() {
        "none".into()
    } else {
        known.join(", ")
    }
}

/// The adapter registry; share it in an `Arc`.
pub(crate) struct AdapterStore {
    inner: tokio::sync::Mutex<Inner>,
    model: ModelConfig,
    /// Where the model computes: loaded adapters are placed there.
    backend: relay_llm::Backend,
    max_loaded: usize,
    nats: async_nats::Client,
    /// How long fetching one version may take.
    fetch_timeout: std::time::Duration,
    /// The run, whose league bucket is looked in for unknown versions.
    run_id: Option<String>,
    metrics: LlmMetrics,
    /// Counts the adapter bytes fetched from the object store.
    transfer: relay_kit::metrics::WeightsTransfer,
}

/// Why a version was not found in the object store.
enum StoredError {
    /// No such bucket or object.
    NotFound(String),
    /// The store did not answer properly.
    Failed(String),
}

impl AdapterStore {
    /// The registry of `service`'s run: fetches through its NATS
    /// connection within `weights.fetch_timeout_ms`, looks unknown
    /// versions up in the run's bucket, counts what it fetches.
    pub(crate) fn new(
        model: ModelConfig,
        backend: relay_llm::Backend,
        max_loaded: usize,
        service: &relay_kit::Service,
        metrics: LlmMetrics,
    ) -> Self {
        Self {
            inner: tokio::sync::Mutex::new(Inner {
                known: BTreeMap::new(),
                loaded: Vec::new(),
                clock: 0,
            }),
            model,
            backend,
            max_loaded,
            nats: service.nats.clone(),
            fetch_timeout: std::time::Duration::from_millis(
                service.config.weights.fetch_timeout_ms,
            ),
            run_id: service.config.run_id().ok().map(str::to_string),
            metrics,
            transfer: service.weights_transfer(),
        }
    }

    /// Adds a fixed adapter folder as version 0 of `name`, loading it now so
    /// a bad path fails at start.
    pub(crate) async fn add_folder(&self, name: &str, dir: PathBuf) -> Result<(), AdapterError> {
        self.add(name, 0, Source::Folder(dir)).await
    }

    /// Adds a published version (loading it now: a bad one is refused and
    /// the versions already known stay).
    pub(crate) async fn add_update(&self, update: AdapterUpdate) -> Result<(), AdapterError> {
        let source = Source::Published {
            config_json: update.config_json.into(),
            weights: Arc::new(update.weights),
        };
        self.add(&update.name, update.version, source).await
    }

    async fn add(&self, name: &str, version: u64, source: Source) -> Result<(), AdapterError> {
        let adapter = self.load(name, version, &source).await?;
        let mut guard = self.inner.lock().await;
        let inner = &mut *guard;
        // A re-published version replaces the old bytes.
        inner
            .loaded
            .retain(|l| !(l.name == name && l.version == version));
        inner.clock += 1;
        let last_used = inner.clock;
        let versions = inner.known.entry(name.to_string()).or_default();
        versions.insert(version, Known { source, last_used });
        for forgotten in forget_least_recently_used(versions) {
            inner
                .loaded
                .retain(|l| !(l.name == name && l.version == forgotten));
        }
        self.insert(inner, name, version, adapter);
        Ok(())
    }

    /// Whether any version of `name` is known.
    pub(crate) async fn knows(&self, name: &str) -> bool {
        self.inner.lock().await.known.contains_key(name)
    }

    /// Takes, in the background until shutdown, every adapter version
    /// published on `adapters` (a bad one is rejected and counted); in a
    /// text run whose learning side is the model, first the current version
    /// of `name` (`adapters.latest`), asked until one is known.
    pub(crate) async fn follow(
        self: &Arc<Self>,
        service: &relay_kit::Service,
        name: &str,
    ) -> Result<(), relay_kit::ServiceError> {
        let cfg = &service.config;
        let ask = (cfg.is_text_game() && cfg.text.learner_bot().is_none()).then(|| {
            relay_proto::AdapterRequest {
                schema: relay_proto::SCHEMA_VERSION,
                name: name.to_string(),
            }
        });
        let mut feed =
            relay_policy::VersionFeed::<AdapterUpdate>::subscribe(service, ask.as_ref(), false)
                .await?;
        let (store, service, name) = (self.clone(), service.clone(), name.to_string());
        let transfer = service.weights_transfer();
        tokio::spawn(async move {
            loop {
                let knows = store.knows(&name).await;
                let Some(heard) = feed.next(knows).await else {
                    return;
                };
                let subject = heard.subject();
                // Timed from its publication, as the classic follower
                // times a version it took from `weights.latest` too.
                let (published_unix_ms, at_start) = match &heard {
                    relay_policy::Heard::Latest(update) if update.name != name => continue,
                    relay_policy::Heard::Latest(update) => (update.published_unix_ms, true),
                    relay_policy::Heard::Published { update, bytes } => {
                        transfer.received(*bytes);
                        (update.published_unix_ms, false)
                    }
                };
                let update = heard.into_update();
                let (name, version) = (update.name.clone(), update.version);
                match store.add_update(update).await {
                    Ok(()) => {
                        transfer.ready(version, published_unix_ms);
                        if at_start {
                            tracing::info!(name, version, "loaded the current adapter version")
                        } else {
                            tracing::info!(name, version, "adapter version added")
                        }
                    }
                    Err(e) => service.intake.reject(
                        subject,
                        &relay_proto::Rejection::Invalid {
                            kind: "AdapterUpdate",
                            field: "weights",
                            detail: e.to_string(),
                        },
                    ),
                }
            }
        });
        Ok(())
    }

    /// The adapter a request asks for, loading it if needed (from the
    /// object store when the version is not known); returns the reference
    /// with the version used.
    pub(crate) async fn resolve(
        &self,
        wanted: &AdapterRef,
    ) -> Result<(AdapterRef, Arc<LoraAdapter>), AdapterError> {
        let mut guard = self.inner.lock().await;
        let inner = &mut *guard;
        let version = match (wanted.version, inner.known.get(&wanted.name)) {
            (Some(version), _) => version,
            (None, Some(versions)) => *versions
                .keys()
                .next_back()
                .expect("a known name has versions"),
            (None, None) => {
                return Err(AdapterError::UnknownName {
                    name: wanted.name.clone(),
                    known: known_names(inner),
                })
            }
        };
        let used = AdapterRef {
            name: wanted.name.clone(),
            version: Some(version),
        };
        inner.clock += 1;
        let now = inner.clock;
        if let Some(known) = inner
            .known
            .get_mut(&wanted.name)
            .and_then(|versions| versions.get_mut(&version))
        {
            known.last_used = now;
        }
        if let Some(hit) = inner
            .loaded
            .iter_mut()
            .find(|l| l.name == wanted.name && l.version == version)
        {
            hit.last_used = now;
            return Ok((used, hit.adapter.clone()));
        }
        let known_source = inner
            .known
            .get(&wanted.name)
            .and_then(|versions| versions.get(&version))
            .map(|known| known.source.clone());
        // Loads hold the lock: concurrent requests for the same evicted
        // version then load it once.
        let source = match known_source {
            Some(source) => source,
            None => match self.stored(&wanted.name, version).await {
                Ok(source) => {
                    tracing::info!(
                        name = wanted.name,
                        version,
                        "adapter version fetched from the object store"
                    );
                    source
                }
                Err(StoredError::NotFound(detail)) => {
                    tracing::debug!(%detail, "adapter version not in the object store");
                    return Err(match inner.known.get(&wanted.name) {
                        Some(versions) => AdapterError::UnknownVersion {
                            name: wanted.name.clone(),
                            version,
                            known: versions
                                .keys()
                                .map(u64::to_string)
                                .collect::<Vec<_>>()
                                .join(", "),
                        },
                        None => AdapterError::UnknownName {
                            name: wanted.name.clone(),
                            known: known_names(inner),
                        },
                    });
                }
                Err(StoredError::Failed(detail)) => {
                    return Err(AdapterError::Load {
                        name: wanted.name.clone(),
                        version,
                        detail,
                    })
                }
            },
        };
        let adapter = self.load(&wanted.name, version, &source).await?;
        self.insert(inner, &wanted.name, version, adapter.clone());
        Ok((used, adapter))
    }

    /// The source of a version the learner keeps in the run's league
    /// bucket, if it is there.
    async fn stored(&self, name: &str, version: u64) -> Result<Source, StoredError> {
        let Some(run_id) = &self.run_id else {
            return Err(StoredError::NotFound("no run, so no league bucket".into()));
        };
        match relay_kit::league::stored_update::<AdapterUpdate>(
            &self.nats,
            run_id,
            name,
            version,
            self.fetch_timeout,
        )
        .await
        {
            Ok(Some(update)) => Ok(Source::Published {
                config_json: update.config_json.into(),
                weights: Arc::new(update.weights),
            }),
            Ok(None) => Err(StoredError::NotFound(format!(
                "{}/{} is not there",
                relay_kit::league::versions_bucket(run_id),
                relay_kit::league::update_object(name, version)
            ))),
            Err(e) => Err(StoredError::Failed(e.to_string())),
        }
    }

    fn insert(&self, inner: &mut Inner, name: &str, version: u64, adapter: Arc<LoraAdapter>) {
        inner.clock += 1;
        let now = inner.clock;
        inner.loaded.push(Loaded {
            name: name.to_string(),
            version,
            adapter,
            last_used: now,
        });
        while inner.loaded.len() > self.max_loaded {
            let lru = inner
                .loaded
                .iter()
                .enumerate()
                .min_by_key(|(_, l)| l.last_used)
                .map(|(i, _)| i)
                .expect("non-empty");
            let evicted = inner.loaded.swap_remove(lru);
            tracing::debug!(
                name = evicted.name,
                version = evicted.version,
                "adapter evicted"
            );
            self.metrics.adapter_evictions.inc();
        }
        self.metrics.adapters_loaded.set(inner.loaded.len() as i64);
    }

    async fn load(
        &self,
        name: &str,
        version: u64,
        source: &Source,
    ) -> Result<Arc<LoraAdapter>, AdapterError> {
        let fail = |detail: String| AdapterError::Load {
            name: name.to_string(),
            version,
            detail,
        };
        let model = self.model.clone();
        let started = std::time::Instant::now();
        let adapter = match source {
            Source::Folder(dir) => {
                let dir = dir.clone();
                tokio::task::spawn_blocking(move || LoraAdapter::load_peft(&dir, &model))
                    .await
                    .map_err(|e| fail(e.to_string()))?
            }
            Source::Published {
                config_json,
                weights,
            } => {
                let safetensors =
                    relay_kit::weights::fetch(&self.nats, weights, self.fetch_timeout)
                        .await
                        .map_err(|e| fail(e.to_string()))?;
                if weights.inline.is_none() {
                    self.transfer.received(safetensors.len());
                }
                let config_json = config_json.clone();
                tokio::task::spawn_blocking(move || {
                    LoraAdapter::from_peft_bytes(&config_json, &safetensors, &model)
                })
                .await
                .map_err(|e| fail(e.to_string()))?
            }
        }
        .map_err(|e| fail(e.to_string()))?;
        let adapter = self
            .backend
            .place_frozen_adapter(&adapter)
            .map_err(|e| fail(e.to_string()))?;
        self.metrics.adapter_loads.inc();
        self.metrics
            .adapter_load_seconds
            .observe(started.elapsed().as_secs_f64());
        Ok(Arc::new(adapter))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_versions_forgotten_are_the_least_recently_used_not_the_oldest() {
        let known = |last_used| Known {
            source: Source::Folder(PathBuf::new()),
            last_used,
        };
        // Version 5 is asked for after all the others were published.
        let mut versions: BTreeMap<u64, Known> = (0..VERSIONS_KEPT as u64 + 2)
            .map(|v| (v, known(v)))
            .collect();
        versions.get_mut(&5).unwrap().last_used = 100;
        assert_eq!(forget_least_recently_used(&mut versions), vec![0, 1]);
        assert_eq!(versions.len(), VERSIONS_KEPT);
        for newer in 200..200 + VERSIONS_KEPT as u64 - 1 {
            versions.insert(newer, known(newer));
            forget_least_recently_used(&mut versions);
        }
        assert!(versions.contains_key(&5), "still in use");
        versions.insert(1000, known(1000));
        assert_eq!(forget_least_recently_used(&mut versions), vec![5]);
    }
}
