//! Weights publishing: the latest version every follower can ask for
//! ([`LatestWeights`]), published through the one weights transport with
//! its send time, and which weights a final checkpoint holds
//! ([`final_weights`]).

use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};

use bytes::Bytes;
use futures::StreamExt;
use relay_config::ExperimentConfig;
use relay_kit::weights::{Outgoing, WeightsPublisher};
use relay_kit::{Service, ServiceError};
use relay_policy::PolicyWeights;
use relay_proto::{WeightsAnnouncement, WeightsRequest, WeightsUpdate, SCHEMA_VERSION};

use crate::checkpoint;
use crate::evaluated::RunEvents;
use crate::league::League;

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

/// The newest published weights of the run: served on `weights.latest` to
/// services that join late, and recorded in the run directory before each
/// publish ([`checkpoint::record_published`]). Each version's parameters
/// travel through the one weights transport ([`WeightsPublisher`]:
/// inline when small, else from this learner's direct transfer server or
/// the run's object store), so a policy of any size reaches every
/// follower.
pub(crate) struct LatestWeights {
    pub(crate) run_dir: PathBuf,
    /// The newest version's message, as answered on `weights.latest`.
    pub(crate) latest: Arc<RwLock<Bytes>>,
    publisher: WeightsPublisher,
    /// The run's object store bucket for policy versions.
    bucket: String,
    /// The run's league, when it has one: versions it may admit are stored
    /// and offered to its pool before they are announced.
    league: Option<League>,
}

/// The JetStream object store bucket of a run's policy versions (used when
/// `weights.store` puts them there).
pub fn weights_bucket(run_id: &str) -> String {
    format!("relay-{run_id}-weights")
}

impl LatestWeights {
    /// Starts the weights transport and answering `weights.latest` until
    /// shutdown, in a background task (an empty answer until the first
    /// publish).
    pub(crate) async fn serve(
        service: &Service,
        micro: &async_nats::service::Service,
        run_dir: &Path,
    ) -> Result<Self, ServiceError> {
        let publisher = WeightsPublisher::start(
            &service.nats,
            &service.config.weights,
            &service.config.connections.nats_url,
        )
        .await
        .map_err(ServiceError::other)?;
        let latest = Arc::new(RwLock::new(Bytes::new()));
        let mut weights_requests = micro
            .endpoint(service.subjects.weights_latest())
            .await
            .map_err(ServiceError::nats)?;
        let shutdown = service.shutdown.clone();
        let intake = service.intake.clone();
        let answers = latest.clone();
        tokio::spawn(async move {
            loop {
                let request = tokio::select! {
                    r = weights_requests.next() => match r { Some(r) => r, None => return },
                    _ = shutdown.wait() => return,
                };
                let answer = match intake
                    .decode::<WeightsRequest>("weights.latest", &request.message.payload)
                {
                    Ok(_) => Ok(answers.read().expect("weights lock").clone()),
                    Err(rejection) => Err(async_nats::service::error::Error {
                        status: rejection.to_string(),
                        code: 400,
                    }),
                };
                let _ = request.respond(answer).await;
            }
        });
        Ok(Self {
            run_dir: run_dir.to_path_buf(),
            latest,
            publisher,
            bucket: weights_bucket(service.config.run_id()?),
            league: League::start(&service.config, &service.shutdown).await?,
        })
    }

    /// Records `weights`' version, makes its parameters fetchable, keeps
    /// its message as the latest and publishes it on `weights` and, as an
    /// announcement, on `weights.announce`, stamped with the time
    /// publishing began. A version no follower could fetch fails the
    /// service ([`Service::fail`]): the run could not move past it. A
    /// message lost on the way is only logged: followers ask
    /// `weights.latest` and the next version replaces it.
    pub(crate) async fn publish(&self, service: &Service, weights: &PolicyWeights) {
        if let Err(e) = checkpoint::record_published(&self.run_dir, weights.version) {
            tracing::warn!(error = %e, "could not record the published version");
        }
        let published_unix_ms = relay_proto::unix_ms();
        let key = format!("weights/v{}", weights.version);
        let bytes = Bytes::from(weights.to_safetensors());
        let size = bytes.len();
        let blob = match self
            .publisher
            .publish(
                bytes,
                Outgoing {
                    key: &key,
                    bucket: &self.bucket,
                    keep_in_store: false,
                },
            )
            .await
        {
            Ok(blob) => blob,
            Err(e) => {
                service
                    .fail(format!(
                        "weights version {} ({size} bytes) cannot be published: {e}",
                        weights.version
                    ))
                    .await;
                return;
            }
        };
        let update = WeightsUpdate {
            published_unix_ms,
            ..weights.update(blob)
        };
        // Before the announcement, so the env-runners that hear of the
        // version find it in the pool.
        if let Some(league) = &self.league {
            if league.store_classic(service, weights).await {
                league
                    .admit_and_prune(service, weights.version, &Default::default())
                    .await;
            }
        }
        let payload: Bytes = relay_proto::encode(&update).into();
        *self.latest.write().expect("weights lock") = payload.clone();
        if let Err(e) = service
            .nats
            .publish(service.subjects.weights(), payload)
            .await
        {
            tracing::warn!(error = %e, version = weights.version, "weights message not sent");
        }
        let announcement = WeightsAnnouncement {
            schema: SCHEMA_VERSION,
            version: weights.version,
            learner_env_steps: weights.learner_env_steps,
        };
        service
            .publish(service.subjects.weights_announce(), &announcement)
            .await;
    }
}
