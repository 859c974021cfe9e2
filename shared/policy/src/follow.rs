//! Keeping up with the learner's versions: a [`Follower`] holds what it
//! builds of the newest weights version ([`PolicyFollower`]: the model;
//! [`StatsFollower`]: the normalisation statistics only), a
//! [`PolicyFetcher`] fetches a version only when asked for one (hearing
//! each one announced, [`announced_versions`]), and an
//! [`AdapterFollower`] follows the LLM policy's LoRA adapter versions.
//! The followers hear versions through the one loop of
//! [`crate::feed::VersionFeed`]; this file owns what each makes of them.

use std::sync::Arc;

use futures::StreamExt;
use relay_kit::Service;
use relay_nn::VecNormalize;
use relay_proto::{
    AdapterUpdate, Rejection, WeightsAnnouncement, WeightsRequest, WeightsUpdate, SCHEMA_VERSION,
};
use tokio::sync::watch;

use crate::feed::{Heard, VersionFeed};
use crate::{
    frozen_normalizer, policy_builder, spec_for, PolicyBuilder, PolicyWeights, VersionedPolicy,
    WeightsError,
};

/// What a [`Follower`] keeps of each weights version.
pub trait Versioned: Send + Sync + 'static {
    /// The weights version it was built from.
    fn version(&self) -> u64;
}

impl Versioned for VersionedPolicy {
    fn version(&self) -> u64 {
        self.version
    }
}

/// The normalisation statistics of a weights version (what an env-runner
/// needs of it), frozen; `None` when the run does not normalise.
pub struct VersionedStats {
    pub version: u64,
    pub normalizer: Option<VecNormalize>,
}

impl Versioned for VersionedStats {
    fn version(&self) -> u64 {
        self.version
    }
}

/// Follows the learner's weights, keeping what `T` takes of the newest
/// version; [`Follower::latest`] is the newest.
pub struct Follower<T> {
    rx: watch::Receiver<Option<Arc<T>>>,
}

// Derive would ask `T: Clone`; copies share the one fetch loop.
impl<T> Clone for Follower<T> {
    fn clone(&self) -> Self {
        Self {
            rx: self.rx.clone(),
        }
    }
}

/// Keeps the newest model (and its normaliser).
pub type PolicyFollower = Follower<VersionedPolicy>;

/// Keeps the newest version's normalisation statistics only (no model is
/// built).
pub type StatsFollower = Follower<VersionedStats>;

/// The learner's newest version, asked on `weights.latest`.
async fn latest_weights(service: &Service) -> Result<WeightsUpdate, relay_kit::RequestError> {
    let ask = WeightsRequest {
        schema: SCHEMA_VERSION,
    };
    relay_kit::request(
        &service.nats,
        &service.subjects.weights_latest(),
        &ask,
        service.request_timeout(),
    )
    .await
}

impl Follower<VersionedPolicy> {
    /// Starts following (a background task until shutdown).
    pub async fn start(service: &Service) -> Result<Self, relay_kit::ServiceError> {
        let build = policy_builder(&service.config)?;
        Self::follow(service, true, move |_, weights| {
            build(weights.expect("fetched: this follower builds models"))
        })
        .await
    }
}

/// The version last announced on `weights.announce` (a
/// [`relay_proto::WeightsAnnouncement`] per version the learner publishes;
/// lower than the one before after a learner restarted from an older
/// checkpoint), `None` before the first: a background task listens until
/// shutdown.
pub async fn announced_versions(
    service: &Service,
) -> Result<watch::Receiver<Option<u64>>, relay_kit::ServiceError> {
    let mut announcements = service
        .nats
        .subscribe(service.subjects.weights_announce())
        .await
        .map_err(relay_kit::ServiceError::nats)?;
    let (tx, announced) = watch::channel(None);
    let listener = service.clone();
    tokio::spawn(async move {
        loop {
            let message = tokio::select! {
                Some(m) = announcements.next() => m,
                _ = listener.shutdown.wait() => return,
                else => return,
            };
            if let Ok(announced) = listener
                .intake
                .decode::<WeightsAnnouncement>("weights.announce", &message.payload)
            {
                tx.send_if_modified(|v| {
                    let changed = *v != Some(announced.version);
                    *v = Some(announced.version);
                    changed
                });
            }
        }
    });
    Ok(announced)
}

/// The learner's weights for a service that plays only some versions (the
/// evaluator: one every `eval.every_versions`): it hears every version on
/// `weights.announce` (a [`relay_proto::WeightsAnnouncement`]) and fetches
/// a version's weights (`weights.latest`, then its parameters) only when
/// asked for one, instead of receiving and building each (SAC publishes
/// one per env step).
///
/// [`PolicyFetcher::newer_than`] is cancel-safe: a fetch runs in its own
/// task and a call dropped mid-way (the evaluator's `select!` woken by an
/// episode report) leaves it running for the next call to collect, so a
/// large version that takes longer to fetch than the gap between two
/// messages still arrives.
pub struct PolicyFetcher {
    service: Service,
    build: Arc<PolicyBuilder>,
    announced: watch::Receiver<Option<u64>>,
    /// The fetch under way, if any: it outlives a cancelled call.
    fetching: Option<tokio::task::JoinHandle<FetchAttempt>>,
    failures: FetchFailures,
}

/// What one fetch of the newest version came to.
enum FetchAttempt {
    Built(Arc<VersionedPolicy>),
    /// No version yet, or its parameters could not be fetched (a failure
    /// is counted), or it was rejected: try again after a pause.
    Failed(Option<WeightsError>),
}

impl PolicyFetcher {
    /// Starts listening to the announcements (a background task until shutdown).
    pub async fn start(service: &Service) -> Result<Self, relay_kit::ServiceError> {
        let build = Arc::new(policy_builder(&service.config)?);
        Ok(Self {
            service: service.clone(),
            build,
            announced: announced_versions(service).await?,
            fetching: None,
            failures: FetchFailures::default(),
        })
    }

    /// Waits until a version newer than `version` (any for `None`) is
    /// announced, then fetches and builds the newest; `None` on shutdown.
    /// Cancel-safe (see the type's docs).
    pub async fn newer_than(&mut self, version: Option<u64>) -> Option<Arc<VersionedPolicy>> {
        let mut backoff = crate::feed::FIRST_RETRY;
        loop {
            if self.fetching.is_none() {
                if let Some(seen) = version {
                    while self.announced.borrow_and_update().is_none_or(|v| v <= seen) {
                        tokio::select! {
                            changed = self.announced.changed() => changed.ok()?,
                            _ = self.service.shutdown.wait() => return None,
                        }
                    }
                }
                let (service, build) = (self.service.clone(), self.build.clone());
                self.fetching = Some(tokio::spawn(
                    async move { fetch_newest(&service, &build).await },
                ));
            }
            let attempt = tokio::select! {
                joined = self.fetching.as_mut().expect("a fetch is under way") => joined,
                _ = self.service.shutdown.wait() => return None,
            };
            self.fetching = None;
            match attempt {
                Ok(FetchAttempt::Built(policy)) => {
                    self.failures.succeeded();
                    // Older than asked for: fetched for an earlier call, or
                    // a restarted learner not yet at the announced version.
                    if version.is_none_or(|seen| policy.version > seen) {
                        return Some(policy);
                    }
                }
                Ok(FetchAttempt::Failed(Some(e))) => {
                    self.failures.failed(&self.service, &e, false).await
                }
                Ok(FetchAttempt::Failed(None)) => {}
                Err(e) => tracing::warn!(error = %e, "weights fetch task ended"),
            }
            tokio::select! {
                _ = tokio::time::sleep(backoff) => {}
                _ = self.service.shutdown.wait() => return None,
            }
            backoff = (backoff * 2).min(crate::feed::MAX_RETRY);
        }
    }
}

/// Asks `weights.latest`, fetches that version's parameters and builds it,
/// timing its transfer from the learner's stamp.
async fn fetch_newest(service: &Service, build: &PolicyBuilder) -> FetchAttempt {
    let update = match latest_weights(service).await {
        Ok(update) => update,
        Err(e) => {
            tracing::debug!(error = %e, "no weights yet");
            return FetchAttempt::Failed(None);
        }
    };
    let weights = match PolicyWeights::fetch(service, &update).await {
        Ok(weights) => weights,
        Err(WeightsError::Rejected(rejection)) => {
            service.intake.reject("weights.latest", &rejection);
            return FetchAttempt::Failed(None);
        }
        Err(e) => return FetchAttempt::Failed(Some(e)),
    };
    match build(&weights) {
        Ok(policy) => {
            let transfer = service.weights_transfer();
            transfer.received(update.weights.size as usize);
            transfer.ready(update.version, update.published_unix_ms);
            FetchAttempt::Built(Arc::new(policy))
        }
        Err(rejection) => {
            service.intake.reject("weights.latest", &rejection);
            FetchAttempt::Failed(None)
        }
    }
}

/// Versions in a row whose parameters could not be fetched, after which a
/// follower that holds no version fails its service: it would never act.
const FETCH_FAILURES_TO_FAIL: u32 = 3;

/// Consecutive fetch failures of a follower.
#[derive(Default)]
struct FetchFailures(u32);

impl FetchFailures {
    /// Logs a failed fetch; the [`FETCH_FAILURES_TO_FAIL`]th in a row,
    /// while nothing is `held`, fails the service with the reason.
    async fn failed(&mut self, service: &Service, error: &WeightsError, held: bool) {
        self.0 += 1;
        tracing::warn!(error = %error, "weights version not fetched");
        if !held && self.0 >= FETCH_FAILURES_TO_FAIL {
            service
                .fail(format!(
                "{} weights versions in a row could not be fetched, and none is held; the last: {error}. Readers must reach the learner's direct transfer server (weights.direct_listen / weights.direct_advertise) or the versions must be in the object store (weights.store: always)",
                    self.0
                ))
                .await;
        }
    }

    fn succeeded(&mut self) {
        self.0 = 0;
    }
}

impl Follower<VersionedStats> {
    /// Starts following the statistics (a background task until shutdown);
    /// they travel in the message, so no parameters are fetched.
    pub async fn start(service: &Service) -> Result<Self, relay_kit::ServiceError> {
        let obs_dim = spec_for(&service.config)
            .map_err(relay_kit::ServiceError::other)?
            .obs_dim;
        let config = service.config.clone();
        Self::follow(service, false, move |update, _| {
            Ok(VersionedStats {
                version: update.version,
                normalizer: frozen_normalizer(
                    &config,
                    obs_dim,
                    update.version,
                    update.normalizer.as_ref(),
                )?,
            })
        })
        .await
    }
}

impl<T: Versioned> Follower<T> {
    /// Takes the current version at start (`weights.latest`), then each
    /// one published (`weights`), skipping to the newest of those already
    /// queued ([`VersionFeed`]); fetches its parameters when `fetch` is set
    /// (see [`PolicyWeights::fetch`]), keeps what `build` makes of it, and
    /// measures each published one's transfer.
    async fn follow(
        service: &Service,
        fetch: bool,
        build: impl Fn(&WeightsUpdate, Option<&PolicyWeights>) -> Result<T, Rejection>
            + Send
            + Sync
            + 'static,
    ) -> Result<Self, relay_kit::ServiceError> {
        let transfer = service.weights_transfer();
        let (tx, rx) = watch::channel(None);
        let ask = WeightsRequest {
            schema: SCHEMA_VERSION,
        };
        let mut feed = VersionFeed::<WeightsUpdate>::subscribe(service, Some(&ask), true).await?;
        let service = service.clone();
        tokio::spawn(async move {
            let current =
                |tx: &watch::Sender<Option<Arc<T>>>| tx.borrow().as_ref().map(|p| p.version());
            let mut failures = FetchFailures::default();
            // Fetches and builds `update`; true when it is now the newest held.
            let take = async |update: WeightsUpdate,
                              subject: &str,
                              tx: &watch::Sender<Option<Arc<T>>>,
                              failures: &mut FetchFailures|
                   -> bool {
                let weights = if fetch {
                    match PolicyWeights::fetch(&service, &update).await {
                        Ok(w) => Some(w),
                        Err(WeightsError::Rejected(rejection)) => {
                            service.intake.reject(subject, &rejection);
                            return false;
                        }
                        Err(e) => {
                            failures.failed(&service, &e, current(tx).is_some()).await;
                            return false;
                        }
                    }
                } else {
                    None
                };
                failures.succeeded();
                match build(&update, weights.as_ref()) {
                    Ok(built) => {
                        let _ = tx.send(Some(Arc::new(built)));
                        // A statistics follower fetched no parameters.
                        if fetch {
                            transfer.received(update.weights.size as usize);
                        }
                        transfer.ready(update.version, update.published_unix_ms);
                        true
                    }
                    Err(rejection) => {
                        service.intake.reject(subject, &rejection);
                        false
                    }
                }
            };
            while let Some(heard) = feed.next(current(&tx).is_some()).await {
                let (subject, latest) = (heard.subject(), matches!(heard, Heard::Latest(_)));
                let update = heard.into_update();
                if current(&tx).is_some_and(|v| update.version <= v) {
                    continue;
                }
                if take(update, subject, &tx, &mut failures).await && latest {
                    tracing::info!(version = current(&tx), "loaded current weights");
                }
            }
        });
        Ok(Self { rx })
    }

    /// The newest version kept, if any has arrived.
    pub fn latest(&self) -> Option<Arc<T>> {
        self.rx.borrow().clone()
    }

    /// Waits until a version newer than `version` (any for `None`) arrives;
    /// `None` on shutdown of the follower.
    pub async fn newer_than(&mut self, version: Option<u64>) -> Option<Arc<T>> {
        loop {
            if let Some(p) = self.rx.borrow_and_update().clone() {
                if version.is_none_or(|v| p.version() > v) {
                    return Some(p);
                }
            }
            self.rx.changed().await.ok()?;
        }
    }
}

/// A published version of a LoRA adapter (what the evaluator needs of an
/// [`AdapterUpdate`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AdapterVersion {
    pub version: u64,
    pub learner_env_steps: u64,
}

/// Follows the versions the learner publishes of one adapter
/// (`relay.<run>.adapters`), starting from the current one (asked of the
/// learner on `adapters.latest`, retried until it answers or a version is
/// published: [`VersionFeed`]).
pub struct AdapterFollower {
    rx: watch::Receiver<Option<AdapterVersion>>,
}

impl AdapterFollower {
    /// Starts following adapter `name` (a background task until shutdown).
    pub async fn start(service: &Service, name: &str) -> Result<Self, relay_kit::ServiceError> {
        let (tx, rx) = watch::channel(None);
        let ask = relay_proto::AdapterRequest {
            schema: SCHEMA_VERSION,
            name: name.to_string(),
        };
        let mut feed = VersionFeed::<AdapterUpdate>::subscribe(service, Some(&ask), false).await?;
        let name = name.to_string();
        tokio::spawn(async move {
            loop {
                let holding = tx.borrow().is_some();
                let Some(heard) = feed.next(holding).await else {
                    return;
                };
                let update = heard.update();
                let newer = tx
                    .borrow()
                    .is_none_or(|current: AdapterVersion| update.version > current.version);
                if update.name == name && newer {
                    let _ = tx.send(Some(AdapterVersion {
                        version: update.version,
                        learner_env_steps: update.learner_env_steps,
                    }));
                }
            }
        });
        Ok(Self { rx })
    }

    /// The newest version known (the current one at start, then each one
    /// published), if any.
    pub fn latest(&self) -> Option<AdapterVersion> {
        *self.rx.borrow()
    }

    /// Waits until a version newer than `version` (any for `None`) is
    /// published; `None` once the follower stopped.
    pub async fn newer_than(&mut self, version: Option<u64>) -> Option<AdapterVersion> {
        loop {
            if let Some(v) = *self.rx.borrow_and_update() {
                if version.is_none_or(|seen| v.version > seen) {
                    return Some(v);
                }
            }
            self.rx.changed().await.ok()?;
        }
    }
}
