//! Publishing the policy's versions, of every kind, one way: the
//! [`Publisher`] of a [`Version`] kind (classic weights,
//! [`PolicyWeights`]; a LoRA adapter, [`AdapterFiles`]); and which weights
//! a final checkpoint holds ([`final_weights`]).
//!
//! Every version goes out in this order:
//! 1. recorded as published in the run directory
//!    ([`checkpoint::record_published`]) before anything of it is
//!    visible, so a restart after a crash never publishes its number
//!    again;
//! 2. made fetchable through the one weights transport
//!    ([`relay_kit::weights`]: inline when small, else from this learner's
//!    direct transfer server or the object store, at the version's one
//!    key, [`Placement`]); a version no follower could fetch fails the
//!    service ([`Service::fail`]): the run could not move past it;
//! 3. with a league, kept in its bucket and admitted to its pool
//!    ([`League`]) before anyone hears of it, so the env-runners that do
//!    find it in the pool;
//! 4. kept as the latest, answered on `*.latest` (`weights.latest`,
//!    `adapters.latest`) to services that join later; before the first
//!    version, a 503 service error "no version published yet", which every
//!    follower (`relay_policy::VersionFeed`) takes as "not yet, ask again";
//! 5. its message published (`weights`, `adapters`);
//! 6. its announcement, for a kind that has one (`weights.announce`).
//!
//! A message lost on the way is only logged: followers ask `*.latest` and
//! the next version replaces it.

use std::collections::BTreeSet;
use std::marker::PhantomData;
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};

use bytes::Bytes;
use futures::StreamExt;
use relay_config::ExperimentConfig;
use relay_kit::weights::{Placement, TransportError, WeightsPublisher};
use relay_kit::{Service, ServiceError};
use relay_llm::{LoraAdapter, PeftBytes};
use relay_policy::text::LEARNING_ADAPTER;
use relay_policy::{Followed, PolicyWeights};
use relay_proto::{
    AdapterRequest, AdapterUpdate, WeightsAnnouncement, WeightsRequest, WeightsUpdate, WireMessage,
    SCHEMA_VERSION,
};

use crate::checkpoint;
use crate::evaluated::RunEvents;
use crate::league::League;
use crate::progress::Progress;

/// The weights a learner's final checkpoint holds when they are not its
/// current ones: with `run.stop_when_solved`, the solving version's (when
/// its weights were kept), also when shutdown came before the learner
/// stopped on its own.
pub(crate) fn final_weights<S>(
    cfg: &ExperimentConfig,
    events: &RunEvents<S>,
) -> Option<(u64, std::sync::Arc<S>)> {
    events
        .solved_weights
        .clone()
        .filter(|_| cfg.run.stop_when_solved)
}

/// A kind of policy version: what the [`Publisher`] needs of it.
pub(crate) trait Version: Sync {
    /// Its message: published, answered on `*.latest`, kept by a league.
    type Update: Followed;
    /// The request on `*.latest`.
    type Ask: WireMessage;
    /// What a version of this kind is called in errors.
    const KIND: &'static str;
    /// Whether a league keeps every version of this kind, or only those
    /// its pool may admit ([`League::keeps`]).
    const LEAGUE_KEEPS_EVERY: bool;

    /// Whether this learner answers `ask`; else the code and status to
    /// answer.
    fn answers(_ask: &Self::Ask) -> Result<(), (usize, String)> {
        Ok(())
    }

    /// Its number.
    fn number(&self) -> u64;

    /// Makes it fetchable through `transport` (at its [`Placement`] in run
    /// `run_id`, kept for the league when `keep`) and returns its message,
    /// stamped with the time this began.
    async fn fetchable(
        &self,
        transport: &WeightsPublisher,
        run_id: &str,
        keep: bool,
    ) -> Result<Self::Update, TransportError>;

    /// What is announced on `weights.announce`, for a kind that is.
    fn announcement(&self) -> Option<WeightsAnnouncement> {
        None
    }
}

impl Version for PolicyWeights {
    type Update = WeightsUpdate;
    type Ask = WeightsRequest;
    const KIND: &'static str = "weights version";
    const LEAGUE_KEEPS_EVERY: bool = false;

    fn number(&self) -> u64 {
        self.version
    }

    async fn fetchable(
        &self,
        transport: &WeightsPublisher,
        run_id: &str,
        keep: bool,
    ) -> Result<WeightsUpdate, TransportError> {
        let published_unix_ms = relay_proto::unix_ms();
        let placement = Placement::of(run_id, LEARNING_ADAPTER, self.version, keep);
        let blob = transport
            .publish(Bytes::from(self.to_safetensors()), placement.outgoing())
            .await?;
        Ok(WeightsUpdate {
            published_unix_ms,
            ..self.update(blob)
        })
    }

    fn announcement(&self) -> Option<WeightsAnnouncement> {
        Some(WeightsAnnouncement {
            schema: SCHEMA_VERSION,
            version: self.version,
            learner_env_steps: self.learner_env_steps,
        })
    }
}

/// A version of the LoRA adapter a text run trains: its PEFT files.
pub(crate) struct AdapterFiles {
    pub version: u64,
    pub learner_env_steps: u64,
    pub files: PeftBytes,
}

impl Version for AdapterFiles {
    type Update = AdapterUpdate;
    type Ask = AdapterRequest;
    const KIND: &'static str = "adapter version";
    const LEAGUE_KEEPS_EVERY: bool = true;

    fn answers(ask: &AdapterRequest) -> Result<(), (usize, String)> {
        if ask.name == LEARNING_ADAPTER {
            Ok(())
        } else {
            Err((
                404,
                format!(
                    "this learner trains {LEARNING_ADAPTER:?}, not {:?}",
                    ask.name
                ),
            ))
        }
    }

    fn number(&self) -> u64 {
        self.version
    }

    async fn fetchable(
        &self,
        transport: &WeightsPublisher,
        run_id: &str,
        keep: bool,
    ) -> Result<AdapterUpdate, TransportError> {
        let version = relay_kit::weights::AdapterVersion {
            name: LEARNING_ADAPTER,
            version: self.version,
            learner_env_steps: self.learner_env_steps,
            config_json: &self.files.config_json,
            safetensors: self.files.safetensors.clone().into(),
            keep_in_store: keep,
        };
        relay_kit::weights::publish_adapter(transport, run_id, version).await
    }
}

/// Publishes the versions of kind `V` (see the module docs) and answers
/// `*.latest` with the newest.
pub(crate) struct Publisher<V> {
    run_dir: PathBuf,
    run_id: String,
    /// The newest version's message, as answered on `*.latest`; empty
    /// before the first.
    latest: Arc<RwLock<Bytes>>,
    transport: WeightsPublisher,
    /// The run's league, when it has one.
    league: Option<League>,
    kind: PhantomData<fn(&V)>,
}

impl<V: Version> Publisher<V> {
    /// Starts the weights transport, the league (when the run has one) and
    /// answering `*.latest` until shutdown, in a background task.
    pub(crate) async fn serve(
        service: &Service,
        micro: &async_nats::service::Service,
        run_dir: &Path,
    ) -> Result<Self, ServiceError> {
        let transport = WeightsPublisher::start(
            &service.nats,
            &service.config.weights,
            &service.config.connections.nats_url,
        )
        .await
        .map_err(ServiceError::other)?;
        let latest = Arc::new(RwLock::new(Bytes::new()));
        let mut requests = micro
            .endpoint(V::Update::latest_subject(&service.subjects))
            .await
            .map_err(ServiceError::nats)?;
        let shutdown = service.shutdown.clone();
        let intake = service.intake.clone();
        let answers = latest.clone();
        tokio::spawn(async move {
            loop {
                let request = tokio::select! {
                    r = requests.next() => match r { Some(r) => r, None => return },
                    _ = shutdown.wait() => return,
                };
                let answer = intake
                    .decode::<V::Ask>(V::Update::LATEST, &request.message.payload)
                    .map_err(|rejection| (400, rejection.to_string()))
                    .and_then(|ask| V::answers(&ask))
                    .and_then(|()| {
                        let newest = answers.read().expect("latest lock").clone();
                        if newest.is_empty() {
                            Err((503, "no version published yet".to_string()))
                        } else {
                            Ok(newest)
                        }
                    })
                    .map_err(|(code, status)| async_nats::service::error::Error { status, code });
                let _ = request.respond(answer).await;
            }
        });
        Ok(Self {
            run_dir: run_dir.to_path_buf(),
            run_id: service.config.run_id()?.to_string(),
            latest,
            transport,
            league: League::start(&service.config, &service.nats, &service.shutdown).await?,
            kind: PhantomData,
        })
    }

    /// Publishes `version` in the order of the module docs; a league prune
    /// spares the `held` versions (under evaluation: the inference servers
    /// may fetch them again). Returns whether it became fetchable (else
    /// the service failed).
    pub(crate) async fn publish(
        &self,
        service: &Service,
        version: &V,
        held: &BTreeSet<u64>,
    ) -> bool {
        let number = version.number();
        if let Err(e) = checkpoint::record_published(&self.run_dir, number) {
            tracing::warn!(error = %e, "could not record the published version");
        }
        let keep = self
            .league
            .as_ref()
            .is_some_and(|league| league.keeps(number, V::LEAGUE_KEEPS_EVERY));
        let update = match version.fetchable(&self.transport, &self.run_id, keep).await {
            Ok(update) => update,
            Err(e) => {
                service
                    .fail(format!("{} {number} cannot be published: {e}", V::KIND))
                    .await;
                return false;
            }
        };
        if let (Some(league), true) = (&self.league, keep) {
            if league.keep(service, &update).await {
                league.admit_and_prune(service, number, held).await;
            }
        }
        let payload: Bytes = relay_proto::encode(&update).into();
        *self.latest.write().expect("latest lock") = payload.clone();
        if let Err(e) = service
            .nats
            .publish(V::Update::published_subject(&service.subjects), payload)
            .await
        {
            tracing::warn!(error = %e, version = number, "{} message not sent", V::KIND);
        }
        if let Some(announcement) = version.announcement() {
            service
                .publish(service.subjects.weights_announce(), &announcement)
                .await;
        }
        true
    }
}

impl Publisher<AdapterFiles> {
    /// Publishes `adapter` as `progress.version`; returns its PEFT files
    /// as published, `None` when it could not be (the service failed).
    pub(crate) async fn publish_adapter(
        &self,
        service: &Service,
        progress: &Progress,
        adapter: &LoraAdapter,
        base_model: &str,
        held: &BTreeSet<u64>,
    ) -> Option<PeftBytes> {
        let files = match relay_llm::to_peft_bytes(adapter, Some(base_model)) {
            Ok(files) => files,
            Err(e) => {
                service
                    .fail(format!(
                        "{} {} cannot be published: {e}",
                        AdapterFiles::KIND,
                        progress.version
                    ))
                    .await;
                return None;
            }
        };
        let version = AdapterFiles {
            version: progress.version,
            learner_env_steps: progress.env_steps,
            files,
        };
        self.publish(service, &version, held)
            .await
            .then_some(version.files)
    }
}
