//! What a text learner starts from ([`start`]): the base model (its
//! gradients flow through the base, so GGUF weights are dequantized), the
//! LoRA adapter placed on the model's device (fresh, or a checkpoint's),
//! the RL trainer with its KL reference, and, on resume, the optimizer,
//! counters and moving baselines.

use std::path::Path;
use std::time::Instant;

use relay_config::ExperimentConfig;
use relay_kit::ServiceError;
use relay_llm::{CausalLm, GgufBase, LoraAdapter, RewardNormalizer, RlTrainer};

use super::{load_state, TextCheckpointState, ADAPTER_DIR, REFERENCE_DIR};
use crate::checkpoint;
use crate::progress::Progress;

/// The model, the adapter and the trainer, and where the counters stand.
pub(super) struct Start {
    pub(super) model: CausalLm,
    /// The base model's path, as checkpoints and adapters name it.
    pub(super) base_model: String,
    /// Completions ending on one of these stopped by themselves.
    pub(super) eos_ids: Vec<u32>,
    pub(super) adapter: LoraAdapter,
    pub(super) trainer: RlTrainer,
    pub(super) state: TextCheckpointState,
    /// The oldest version whose games belong to this learner's timeline.
    pub(super) version_floor: u64,
    pub(super) resumed_at_vec_steps: u64,
}

/// Loads `model_spec` and builds the trainer, from `start_from` when the
/// run resumes or starts from another run's adapter.
pub(super) async fn start(
    cfg: &ExperimentConfig,
    model_spec: String,
    run_dir: &Path,
    start_from: Option<&checkpoint::StartFrom>,
) -> Result<Start, ServiceError> {
    let mut train_config = cfg
        .rl
        .train_config(cfg.text.max_turn_tokens as usize)
        .map_err(ServiceError::other)?;
    let lora_config = cfg.lora.lora_config().map_err(ServiceError::other)?;
    let started_loading = Instant::now();
    let spec = model_spec.clone();
    // The fused CPU ops (engine), or the composed forward on llm.device.
    let backend = relay_llm::Backend::open(&cfg.llm.backend_spec())
        .map_err(|e| ServiceError::Other(e.to_string()))?;
    let placed = backend.clone();
    let (model, model_path) = tokio::task::spawn_blocking(move || {
        // Training needs gradients through the base: GGUF weights dequantized.
        relay_llm::load_causal_lm_on(&spec, GgufBase::Dequantized, &placed)
    })
    .await
    .map_err(ServiceError::other)?
    .map_err(|e| ServiceError::Other(format!("llm.model: {e}")))?;
    if !model.supports_training() {
        return Err(ServiceError::Other(format!(
            "llm.model {model_spec}: this base cannot be trained through"
        )));
    }
    // Completions ending on one of these stopped by themselves.
    let eos_ids = model.config().eos_token_ids.clone();
    let context = model.config().max_position_embeddings + 1;
    if train_config.batch.max_seq_len > context {
        tracing::info!(
            max_seq_len = train_config.batch.max_seq_len,
            context,
            "rl.max_seq_len is longer than the model's context; using the context"
        );
        train_config.batch.max_seq_len = context;
    }
    let base_model = model_path.display().to_string();
    tracing::info!(model = %base_model, layers = model.config().num_hidden_layers, backend = %backend.describe(), seconds = started_loading.elapsed().as_secs_f64(), "base model loaded");

    let mut state = TextCheckpointState {
        progress: Progress::default(),
        moving_baselines: Default::default(),
        reward_normalizer: RewardNormalizer::default(),
        best_eval: None,
        weights_version: None,
    };
    let mut version_floor = 0u64;
    let mut resumed_at_vec_steps = 0u64;
    let adapter = match start_from {
        Some(from) => LoraAdapter::load_peft(&from.dir.join(ADAPTER_DIR), model.config())
            .map_err(|e| from.error(e))?,
        None => LoraAdapter::new(model.config(), lora_config, cfg.lora.seed)
            .map_err(ServiceError::other)?,
    };
    // On the model's device: the optimizer trains these vars.
    let adapter = model.place_adapter(&adapter).map_err(ServiceError::other)?;
    let reference = kl_reference(
        &train_config,
        cfg.rl.kl_reference,
        start_from,
        &adapter,
        model.config(),
    )?;
    if train_config.objective.kl.is_some() {
        let against = if reference.is_some() {
            "the adapter the run started from"
        } else {
            "the base model"
        };
        tracing::info!(reference = against, "KL term towards {against}");
    }
    let mut trainer = RlTrainer::new(train_config, &adapter).map_err(ServiceError::other)?;
    if let Some(reference) = reference {
        let reference = model
            .place_frozen_adapter(&reference)
            .map_err(ServiceError::other)?;
        trainer
            .set_reference(Some(reference))
            .map_err(ServiceError::other)?;
    }
    if let Some(from) = start_from {
        let dir = &from.dir;
        if !cfg.run.reset_optimizer {
            trainer
                .optimizer_mut()
                .load(&dir.join("optimizer.safetensors"))
                .map_err(|e| from.error(e))?;
        }
        if from.resume {
            state = load_state(dir).map_err(|e| from.error(e))?;
            trainer.set_moving_baselines(state.moving_baselines.clone());
            resumed_at_vec_steps = state.progress.vec_steps;
            state.progress.version = checkpoint::next_version(state.progress.version, run_dir);
            version_floor = state.progress.version;
        }
        tracing::info!(from = %dir.display(), resume = from.resume, version = state.progress.version, updates = state.progress.updates, "loaded checkpoint");
    }
    Ok(Start {
        model,
        base_model,
        eos_ids,
        adapter,
        trainer,
        state,
        version_floor,
        resumed_at_vec_steps,
    })
}

/// The KL term's reference adapter (`None`: the base model): with a KL
/// term and `rl.kl_reference: start`, the adapter the run started from. A
/// warm start (`run.init_from`) is that adapter as loaded, before any
/// update; a resumed run takes its checkpoint's `reference/`, and measures
/// against the base model when there is none (the run began from a fresh
/// adapter, which is exactly the base).
pub(super) fn kl_reference(
    train_config: &relay_llm::rl::RlTrainConfig,
    kind: relay_config::KlReference,
    start_from: Option<&checkpoint::StartFrom>,
    start: &LoraAdapter,
    model: &relay_llm::ModelConfig,
) -> Result<Option<LoraAdapter>, ServiceError> {
    if train_config.objective.kl.is_none() || kind == relay_config::KlReference::Base {
        return Ok(None);
    }
    let Some(from) = start_from else {
        return Ok(None);
    };
    if !from.resume {
        return start
            .deep_copy()
            .map(Some)
            .map_err(|e| from.error(format!("copying the adapter as the KL reference: {e}")));
    }
    let dir = from.dir.join(REFERENCE_DIR);
    if !dir.exists() {
        return Ok(None);
    }
    LoraAdapter::load_peft(&dir, model)
        .map(Some)
        .map_err(|e| from.error(format!("{REFERENCE_DIR}/: {e}")))
}
