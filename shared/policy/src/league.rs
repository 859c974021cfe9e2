//! Past weights versions of a classic policy kept for the league: the
//! learner keeps each version the pool admits (or may admit) in the run's
//! league bucket, in the one layout of every kept version
//! ([`relay_kit::league`]: `policy/v<N>/weights.safetensors` and
//! `policy/v<N>/update.msgpack`, the version's [`WeightsUpdate`]), and
//! inference servers build the versions that env-runners ask for from
//! there ([`fetch_version`]). A kept version is fetched through the one
//! weights transport ([`relay_kit::weights::fetch`]) and checked like a
//! live one, at any size. Kept versions outlive the learner that wrote
//! them: the object store is the only place that does, which a live
//! version's direct transfer server does not.

use std::time::Duration;

use relay_kit::weights::TransportError;
use relay_proto::WeightsUpdate;

use crate::text::LEARNING_ADAPTER;
use crate::{PolicyWeights, WeightsError};

/// Why a stored version could not be had.
#[derive(Debug, thiserror::Error)]
pub enum StoredVersionError {
    /// Not in the bucket: never stored (not a league run, or a version the
    /// pool did not admit) or deleted when the pool evicted it.
    #[error("weights version {0} is not stored in the league (never admitted, or evicted)")]
    NotStored(u64),
    #[error(transparent)]
    Weights(#[from] WeightsError),
}

/// Version `version` of run `run_id`, read from its league bucket.
pub async fn fetch_version(
    nats: &async_nats::Client,
    run_id: &str,
    version: u64,
    timeout: Duration,
) -> Result<PolicyWeights, StoredVersionError> {
    let fetch_error = |source: TransportError| {
        StoredVersionError::Weights(WeightsError::Fetch { version, source })
    };
    let update: WeightsUpdate =
        relay_kit::league::stored_update(nats, run_id, LEARNING_ADAPTER, version, timeout)
            .await
            .map_err(fetch_error)?
            .ok_or(StoredVersionError::NotStored(version))?;
    let bytes = relay_kit::weights::fetch(nats, &update.weights, timeout)
        .await
        .map_err(fetch_error)?;
    Ok(PolicyWeights::from_update(&update, &bytes).map_err(WeightsError::Rejected)?)
}
