//! Weights publishing: the latest version every follower can ask for
//! ([`LatestWeights`]), published with its send time, and which weights a
//! final checkpoint holds ([`final_weights`]).

use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};

use bytes::Bytes;
use futures::StreamExt;
use relay_config::ExperimentConfig;
use relay_kit::{Service, ServiceError};
use relay_proto::{WeightsRequest, WeightsUpdate};

use crate::checkpoint;
use crate::evaluated::RunEvents;

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
/// publish ([`checkpoint::record_published`]).
pub(crate) struct LatestWeights {
    pub(crate) run_dir: PathBuf,
    pub(crate) latest: Arc<RwLock<Bytes>>,
}

impl LatestWeights {
    /// Starts answering `weights.latest` until shutdown, in a background
    /// task (an empty answer until the first publish).
    pub(crate) async fn serve(
        service: &Service,
        micro: &async_nats::service::Service,
        run_dir: &Path,
    ) -> Result<Self, ServiceError> {
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
        })
    }

    /// Records `update`'s version, keeps it as the latest and publishes it
    /// on `weights` and, without its tensors, on `weights.announce` (a
    /// failure is logged: the next version replaces it), stamped with the
    /// time of publishing.
    pub(crate) async fn publish(&self, service: &Service, update: &mut WeightsUpdate) {
        if let Err(e) = checkpoint::record_published(&self.run_dir, update.version) {
            tracing::warn!(error = %e, "could not record the published version");
        }
        update.published_unix_ms = relay_proto::unix_ms();
        let payload: Bytes = relay_proto::encode(update).into();
        *self.latest.write().expect("weights lock") = payload.clone();
        if payload.len() > relay_proto::MAX_MESSAGE_BYTES {
            tracing::error!(
                bytes = payload.len(),
                "weights exceed the message size limit; not published"
            );
            return;
        }
        if let Err(e) = service
            .nats
            .publish(service.subjects.weights(), payload)
            .await
        {
            tracing::warn!(error = %e, "weights publish failed");
        }
        // The same version without its tensors, for services that fetch only
        // some versions (the evaluator).
        let announcement = WeightsUpdate {
            tensors: Vec::new(),
            normalizer: None,
            ..*update
        };
        if let Err(e) = service
            .nats
            .publish(
                service.subjects.weights_announce(),
                relay_proto::encode(&announcement).into(),
            )
            .await
        {
            tracing::warn!(error = %e, "weights announcement failed");
        }
    }
}
