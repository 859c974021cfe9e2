//! `relay-llm`: LLM policies for the text games: the CPU engine, and
//! candle on any device (a GPU included, with the `cuda` feature).
//!
//! Pure: no NATS, Redis or async; files are the only I/O (model folders,
//! GGUF files, adapters).
//!
//! Kept apart from `relay-nn` (the small actor-critic MLPs) so that the
//! classic-control services do not compile tokenizers and transformer code.
//!
//! # Model side
//!
//! | module | owns |
//! |---|---|
//! | [`config`] | [`ModelConfig`], [`Architecture`]: a checkpoint's shape, from `config.json` or GGUF metadata |
//! | [`model`] | [`CausalLm`]: Qwen2/Qwen3/Llama weights and the differentiable training forward |
//! | [`infer`] | [`CausalLm::forward_batch`]: the KV-cached batched inference forward of the CPU engine (plain-Rust attention, packed dense weights from `packed`) |
//! | [`backend`] | [`Backend`], [`BackendSpec`]: the engine or candle on a device in a dtype (`llm.backend`, `llm.device`, `llm.dtype`); [`CausalLm::to_backend`], [`CausalLm::place_adapter`] |
//! | [`generic`] | the candle backend's inference forward: candle tensor ops only, any device and dtype |
//! | [`cache`] | [`KvCache`]: one sequence's keys and values; [`PrefixCache`]: recent prompts' caches, to skip prefilling a shared prefix |
//! | [`lora`] | [`LoraAdapter`], [`LoraConfig`], [`LoraTarget`]: adapters kept apart from the base |
//! | [`peft`] | adapters to and from PEFT's `adapter_config.json` + `adapter_model.safetensors` |
//! | [`adapter_bytes`] | [`to_peft_bytes`]: those two files in memory, for publishing |
//! | [`load`] | [`load_causal_lm`] / [`load_causal_lm_on`] (onto a backend: a folder's tensors go to the device as stored), [`load_tokenizer`]: a model spec (`smollm2`, `.gguf`, folder) loaded |
//! | `hf_weights` | a Hugging Face folder's safetensors (one file or shards, any float dtype), memory-mapped; a tensor the model does not use is an error |
//! | [`gguf`] | [`CausalLm`] from a GGUF file, quantized or dequantized |
//! | [`init`] | [`init::tiny`]: a small random Qwen2 checkpoint |
//! | [`sampling`] | [`SamplingParams`], [`Sampler`], [`Sampled`]: one token drawn from a row of logits on the host (greedy, temperature, top-k, top-p, a constraint) |
//! | [`mod@generate`] | [`Sequence`], [`step`]: batched decoding (continuous batching, constrained answers), drawing on the host ([`sampling`]) or on the logits' device (`device_sample`) |
//! | [`model_error`] | [`ModelError`] |
//!
//! ## Choices
//!
//! * **One cache per sequence** ([`KvCache`]), and a forward that packs
//!   the new tokens of any number of sequences into one matrix
//!   ([`CausalLm::forward_batch`]): projections and MLPs run once for the
//!   whole batch, attention per sequence against its own cache. A request
//!   joins a running batch by being listed in the next call (its prompt is
//!   prefilled in the same forward as the others' decode tokens); no
//!   padding, no copying of other sequences' caches.
//! * **Adapters are arguments**, never merged into the base: each batch
//!   item names its [`LoraAdapter`] (or none), so one loaded base serves
//!   many adapters, mixed within one batch.
//! * **Two forwards**: the inference one uses candle's fused kernels; the
//!   training one ([`CausalLm::forward_train`]) only ops with a backward
//!   (candle's fused softmax, RMSNorm and RoPE and its `QMatMul` have no
//!   backward). Tests check they agree and that every LoRA factor gets a
//!   gradient.
//! * **Log-probs for RL**: [`Sampled::logprob`] is the policy's
//!   (temperature 1, full vocabulary), what the learner recomputes;
//!   [`Sampled::sampling_logprob`] is that of the truncated/tempered
//!   distribution actually sampled from.
//! * **Threads**: nothing global is set; candle's rayon pool follows
//!   `RAYON_NUM_THREADS`.
//!
//! ## Decoding a batch
//!
//! ```no_run
//! use std::sync::Arc;
//! use relay_llm::{step, CausalLm, LoraAdapter, Sampler, SamplingParams, Sequence, StopCondition};
//!
//! let model = CausalLm::load_hf("model-dir".as_ref())?;
//! let adapter = Arc::new(LoraAdapter::load_peft("adapter-dir".as_ref(), model.config())?);
//! let stop = StopCondition { max_new_tokens: 64, stop_token_ids: model.config().eos_token_ids.clone() };
//! let mut running = vec![Sequence::new(
//!     &model, vec![1, 2, 3], Some(adapter), Sampler::new(SamplingParams::default(), 7)?, stop,
//! )?];
//! while running.iter().any(|s| !s.is_finished()) {
//!     // New requests: `running.push(Sequence::new(..)?)` here, between steps.
//!     let mut refs: Vec<&mut Sequence> = running.iter_mut().collect();
//!     for token in step(&model, &mut refs)?.into_iter().flatten() {
//!         let _ = (token.sampled.token, token.sampled.logprob, token.finished);
//!     }
//!     running.retain(|s| !s.is_finished());
//! }
//! # Ok::<(), relay_llm::ModelError>(())
//! ```
//!
//! # Training side
//!
//! | module | owns |
//! |---|---|
//! | [`train_forward`] | [`CausalLm::forward_train`] / [`CausalLm::forward_train_at`] / [`CausalLm::forward_train_batch`]: the training forward from fused ops with their own backward (`train_ops`: linear and LoRA-linear without frozen-weight gradients, RMSNorm, SwiGLU, RoPE + causal attention over padded blocks or a shared prefix, target log-prob, entropy); [`TrainForward`]: the backward block by block on the engine and with activation checkpointing on the candle backend, a stop looked at before every block (`*_until`) |
//! | [`token_batch`] | [`BatchConfig`], [`Truncation`], [`TokenBatch`] (right-padded blocks, completion-only loss mask; [`PackedRows`]: the rows' shared prefix once), [`Aggregation`] |
//! | [`rl`] | [`TokenExample`], the RL objectives' config ([`ObjectiveConfig`]: REINFORCE, RLOO, GRPO, Dr. GRPO, PPO-clip, KL, entropy) and [`RlTrainer`]; `rl/objective.rs` their maths (advantages, KL estimates, the micro-batch loss) |
//! | [`reward`] | [`GameResult`], [`RewardShaping`]: per-env normalisation, format reward, invalid-move penalty |
//! | [`sft`] | [`SftTrainer`], the SFT JSONL reader and chat rendering, full-model training through a `VarMap` |
//! | [`vars`] | [`vars::named_vars`], [`vars::var_values`], [`vars::set_var_values`]: trainable vars by name and their values, for the adapter, the SFT trainer and replicas (re-exported in [`sft`]) |
//! | [`optim`] | [`AdamW`] (multi-tensor: one flat update per bucket of parameters) with gradient accumulation, global-norm clipping and saved state |
//! | [`train_error`] | [`TrainError`] |
//!
//! All training goes through [`CausalLm::forward_train`] (the trainers
//! call [`CausalLm::forward_train_batch`]: the head only where a loss
//! reads, a micro-batch's shared prompt prefix once); only the vars handed to the optimizer change (a LoRA
//! adapter's, or a `VarMap`'s).
//!
//! Threads: the fused training ops run on rayon (`RAYON_NUM_THREADS`).
//! candle's own elementwise ops (in training: only the gradient sums of
//! its backward loop) use candle's spinning barrier pool, sized by
//! `CANDLE_NUM_THREADS`; on a shared, oversubscribed CPU every such op
//! waits for a descheduled pool thread, so training processes should
//! run with `CANDLE_NUM_THREADS=1` (measured in `benches/train_step.rs`).
//!
//! # Text side
//!
//! | module | owns |
//! |---|---|
//! | [`tokenizer`] | [`Tokenizer`] (from a Hugging Face folder or GGUF metadata), [`IncrementalDecoder`], [`TokenSequences`] (constrained decoding to a list of strings) |
//! | [`chat`] | [`ChatTemplate`]: Hugging Face chat templates rendered with minijinja |
//! | [`gguf_tokenizer`] | the byte-level BPE tokenizer of a GGUF file, as transformers builds it |
//! | [`smollm2`] | [`find_smollm2_gguf`]: where `deploy/install.sh` put SmolLM2-135M-Instruct |
//! | [`tiny_tokenizer`] | [`write_tiny_tokenizer`]: the tokenizer of `relay model init tiny` |
//!

pub mod adapter_bytes;
pub mod backend;
pub mod cache;
pub mod chat;
pub mod config;
mod device_sample;
pub mod generate;
pub mod generic;
pub mod gguf;
pub mod gguf_tokenizer;
mod hf_weights;
pub mod infer;
pub mod init;
pub mod load;
pub mod lora;
pub mod model;
pub mod model_error;
pub mod optim;
pub(crate) mod packed;
pub mod peft;
pub mod reward;
pub mod rl;
pub mod sampling;
pub mod sft;
pub mod smollm2;
pub mod tiny_tokenizer;
pub mod token_batch;
pub mod tokenizer;
pub mod train_error;
pub mod train_forward;
mod train_ops;
pub mod vars;

pub use adapter_bytes::{to_peft_bytes, PeftBytes};
pub use backend::{
    candle_dtype, open_device, Backend, BackendKind, BackendSpec, DeviceSpec, LlmDtype, SpecError,
    CUDA_BUILT,
};
pub use cache::{KvCache, KvPool, KvUsage, PrefixCache, BLOCK_POSITIONS};
pub use chat::{ChatMessage, ChatTemplate, ChatTemplateError};
pub use config::{Architecture, ModelConfig, RopeScaling};
pub use generate::{
    generate, prefill, step, AnswerAfterThought, FinishReason, Sequence, StepToken, StopCondition,
};
pub use gguf::GgufBase;
pub use init::{TinyShape, TinyVocab};
pub use load::{
    load_causal_lm, load_causal_lm_on, load_model, load_model_on, load_tokenizer,
    resolve_model_path, LoadError, LoadedModel,
};
pub use lora::{LoraAdapter, LoraConfig, LoraTarget, LoraWeights};
pub use model::{token_log_probs, BatchItem, CausalLm, LogitsWanted};
pub use model_error::ModelError;
pub use optim::{AdamW, AdamWConfig, StepReport};
pub use reward::{
    ApplyShaping, GameResult, NormalizeConfig, RewardNormalizer, RewardShaping, RunningStats,
};
pub use rl::{
    AdvantageEstimator, Baseline, KlConfig, KlEstimator, KlMode, MovingBaselines, ObjectiveConfig,
    PolicyLoss, RatioLevel, RlStats, RlTrainConfig, RlTrainer, TokenExample, TruncatedIs,
};
pub use sampling::{Sampled, Sampler, SamplingParams};
pub use sft::{SftConfig, SftExample, SftFormat, SftRecord, SftStats, SftTrainer};
pub use smollm2::{find_smollm2_gguf, FindGgufError, SMOLLM2_GGUF_ENV};
pub use tiny_tokenizer::{write_tiny_tokenizer, TINY_VOCAB_SIZE};
pub use token_batch::{Aggregation, BatchConfig, BatchTotals, PackedRows, TokenBatch, Truncation};
pub use tokenizer::{
    IncrementalDecoder, SpecialToken, SpecialTokens, TokenSequences, Tokenizer, TokenizerError,
};
pub use train_error::{TrainError, TrainResult};
pub use train_forward::TrainForward;
