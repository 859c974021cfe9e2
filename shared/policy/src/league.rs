//! Past weights versions of a classic policy kept for the league: the
//! learner stores each version the pool admits (or may admit) in the
//! run's league bucket ([`relay_kit::league::adapter_bucket`], where text
//! runs keep their LoRA adapter versions, one folder per version,
//! [`relay_kit::league::adapter_key`]), and inference servers build the
//! versions that env-runners ask for from there.
//!
//! A version is two objects in its folder: `model.safetensors` (the
//! parameters) and `update.msgpack`, the version's [`WeightsUpdate`] whose
//! blob names the parameters' object with their length and SHA-256. So a
//! stored version is fetched through the one weights transport
//! ([`relay_kit::weights::fetch`]) and checked like a live one, at any
//! size, and the folder layout lets the learner prune it as text runs
//! prune adapters. Stored versions outlive the learner that wrote them: the
//! object store is the only place that does, which a live version's
//! direct transfer server does not.

use std::time::Duration;

use relay_kit::weights::TransportError;
use relay_proto::{StoreLocation, WeightsBlob, WeightsUpdate};

use crate::text::LEARNING_ADAPTER;
use crate::{PolicyWeights, WeightsError};

/// The object of a stored version's parameters.
pub fn model_object(version: u64) -> String {
    format!(
        "{}/model.safetensors",
        relay_kit::league::adapter_key(LEARNING_ADAPTER, version)
    )
}

/// The object of a stored version's [`WeightsUpdate`].
pub fn update_object(version: u64) -> String {
    format!(
        "{}/update.msgpack",
        relay_kit::league::adapter_key(LEARNING_ADAPTER, version)
    )
}

/// Stores `weights` in run `run_id`'s league bucket (parameters first, so
/// a version whose update is found is whole).
pub async fn store_version(
    nats: &async_nats::Client,
    run_id: &str,
    weights: &PolicyWeights,
) -> Result<(), TransportError> {
    let bucket = relay_kit::league::adapter_bucket(run_id);
    let store = relay_kit::weights::store(nats, &bucket, "league versions").await?;
    let put_error = |e: async_nats::jetstream::object_store::PutError| TransportError::Store {
        bucket: bucket.clone(),
        detail: e.to_string(),
    };
    let bytes = weights.to_safetensors();
    let model = model_object(weights.version);
    relay_kit::weights::put_object(nats, &store, &model, &bytes)
        .await
        .map_err(put_error)?;
    let blob = WeightsBlob {
        size: bytes.len() as u64,
        sha256: relay_proto::sha256(&bytes),
        inline: None,
        direct: None,
        store: Some(StoreLocation {
            bucket: bucket.clone(),
            key: model,
        }),
    };
    let update = relay_proto::encode(&weights.update(blob));
    relay_kit::weights::put_object(nats, &store, &update_object(weights.version), &update)
        .await
        .map_err(put_error)
}

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
    let bucket = relay_kit::league::adapter_bucket(run_id);
    let fetch_error = |source| StoredVersionError::Weights(WeightsError::Fetch { version, source });
    let read = tokio::time::timeout(
        timeout,
        relay_kit::weights::get_object(nats, &bucket, &update_object(version)),
    )
    .await
    .map_err(|_| {
        fetch_error(TransportError::Unreachable(format!(
            "{bucket}/{}: not read within {timeout:?}",
            update_object(version)
        )))
    })?;
    // A missing bucket or object: nothing was stored under that version.
    let Ok(message) = read else {
        return Err(StoredVersionError::NotStored(version));
    };
    let update: WeightsUpdate = relay_proto::decode(&message)
        .map_err(|e| StoredVersionError::Weights(WeightsError::Rejected(e)))?;
    let bytes = relay_kit::weights::fetch(nats, &update.weights, timeout)
        .await
        .map_err(fetch_error)?;
    Ok(PolicyWeights::from_update(&update, &bytes).map_err(WeightsError::Rejected)?)
}
