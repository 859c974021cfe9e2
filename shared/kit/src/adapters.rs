//! How a LoRA adapter version travels from whoever publishes it (the
//! learner) to the inference servers: inline in its [`AdapterUpdate`] when
//! small, else as the two PEFT files in the run's JetStream object store
//! bucket ([`crate::league::adapter_bucket`], folder
//! [`crate::league::adapter_key`]), which the servers fetch. One code path
//! for the learner and for `relay-bench bench-weights`, which times it.

use async_nats::jetstream::object_store::{ObjectMetadata, ObjectStore};
use relay_proto::{
    AdapterPayload, AdapterUpdate, ADAPTER_CONFIG_OBJECT, ADAPTER_WEIGHTS_OBJECT, SCHEMA_VERSION,
};

/// The run's adapter bucket, created if missing; returns its name too.
pub async fn store(
    nats: &async_nats::Client,
    run_id: &str,
) -> Result<(String, ObjectStore), String> {
    let bucket = crate::league::adapter_bucket(run_id);
    let jetstream = async_nats::jetstream::new(nats.clone());
    let store = match jetstream.get_object_store(&bucket).await {
        Ok(store) => store,
        Err(_) => jetstream
            .create_object_store(async_nats::jetstream::object_store::Config {
                bucket: bucket.clone(),
                description: Some("LoRA adapter versions of the learner".into()),
                ..Default::default()
            })
            .await
            .map_err(|e| format!("object store bucket {bucket}: {e}"))?,
    };
    Ok((bucket, store))
}

/// Room left in a chunk message for what the server counts beside the
/// chunk's bytes.
const CHUNK_HEADROOM: usize = 1024;

/// Uploads `bytes` as object `name` of `store`, in chunks as large as one
/// message may be (the server's `max_payload`, 1 MiB by default, less
/// [`CHUNK_HEADROOM`]) instead of async-nats' 128 KiB: each chunk waits
/// for its JetStream acknowledgement before the next is sent, so the
/// number of chunks sets the upload time (a 538 MB model: 4,100 round
/// trips at 128 KiB, 520 at 1 MiB). Readers need nothing: the chunk size
/// is in the object's info.
pub async fn put_object(
    nats: &async_nats::Client,
    store: &ObjectStore,
    name: &str,
    bytes: &[u8],
) -> Result<(), async_nats::jetstream::object_store::PutError> {
    let chunk_size = nats
        .max_payload()
        .saturating_sub(CHUNK_HEADROOM)
        .max(128 * 1024);
    let meta = ObjectMetadata {
        name: name.to_string(),
        chunk_size: Some(chunk_size),
        ..Default::default()
    };
    store.put(meta, &mut &bytes[..]).await.map(|_| ())
}

/// One adapter version to publish: its PEFT files and where it should go.
#[derive(Debug, Clone, Copy)]
pub struct AdapterVersion<'a> {
    pub name: &'a str,
    pub version: u64,
    pub learner_env_steps: u64,
    /// `adapter_config.json`.
    pub config_json: &'a str,
    /// `adapter_model.safetensors`.
    pub safetensors: &'a [u8],
    /// Files of at most this many bytes (both together) travel inline.
    pub inline_max_bytes: usize,
    /// Store the files even when they travel inline (a league serves past
    /// versions from the store).
    pub store_always: bool,
}

/// Builds the [`AdapterUpdate`] of `adapter`, uploading its files to the
/// object store first when they do not travel inline (or always with
/// `store_always`). Stamped with the time this began, so receivers
/// measure the whole transfer, upload included.
pub async fn adapter_update(
    nats: &async_nats::Client,
    run_id: &str,
    adapter: AdapterVersion<'_>,
) -> Result<AdapterUpdate, String> {
    let published_unix_ms = relay_proto::unix_ms();
    let bytes = adapter.config_json.len() + adapter.safetensors.len();
    let inline = bytes <= adapter.inline_max_bytes;
    let key = crate::league::adapter_key(adapter.name, adapter.version);
    let mut stored_in = None;
    if adapter.store_always || !inline {
        let upload = async {
            let (bucket, store) = store(nats, run_id).await?;
            for (file, bytes) in [
                (ADAPTER_CONFIG_OBJECT, adapter.config_json.as_bytes()),
                (ADAPTER_WEIGHTS_OBJECT, adapter.safetensors),
            ] {
                let name = format!("{key}/{file}");
                put_object(nats, &store, &name, bytes)
                    .await
                    .map_err(|e| format!("object {bucket}/{name}: {e}"))?;
            }
            Ok::<_, String>(bucket)
        };
        match upload.await {
            Ok(bucket) => stored_in = Some(bucket),
            // Inline still reaches the inference servers; only serving it
            // later as a past version needs the store.
            Err(e) if inline => {
                tracing::warn!(error = %e, version = adapter.version, "adapter version not stored")
            }
            Err(e) => return Err(e),
        }
    }
    let payload = match stored_in {
        Some(bucket) if !inline => AdapterPayload::ObjectStore { bucket, key },
        _ => AdapterPayload::Inline {
            config_json: adapter.config_json.to_string(),
            safetensors: adapter.safetensors.to_vec(),
        },
    };
    Ok(AdapterUpdate {
        schema: SCHEMA_VERSION,
        name: adapter.name.to_string(),
        version: adapter.version,
        learner_env_steps: adapter.learner_env_steps,
        payload,
        published_unix_ms,
    })
}
