//! `relay-llm`: LLM policies for the text games, in candle on the CPU.
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
//! | [`model`] | [`CausalLm`]: Qwen2/Llama weights, the KV-cached batched inference forward and the differentiable training forward |
//! | [`cache`] | [`KvCache`]: one sequence's keys and values |
//! | [`lora`] | [`LoraAdapter`], [`LoraConfig`], [`LoraTarget`]: adapters kept apart from the base |
//! | [`peft`] | adapters to and from PEFT's `adapter_config.json` + `adapter_model.safetensors` |
//! | [`gguf`] | [`CausalLm`] from a GGUF file, quantized or dequantized |
//! | [`init`] | [`init::tiny`]: a small random Qwen2 checkpoint |
//! | [`generate`] | [`Sampler`], [`Sequence`], [`step`]: sampling and batched decoding |
//! | [`model_error`] | [`ModelError`] |

pub mod cache;
pub mod config;
pub mod generate;
pub mod gguf;
pub mod init;
pub mod lora;
pub mod model;
pub mod model_error;
pub mod peft;

pub use cache::KvCache;
pub use config::{Architecture, ModelConfig};
pub use generate::{
    generate, prefill, step, FinishReason, Sampled, Sampler, SamplingParams, Sequence, StepToken,
    StopCondition,
};
pub use gguf::GgufBase;
pub use init::{TinyShape, TinyVocab};
pub use lora::{LoraAdapter, LoraConfig, LoraTarget, LoraWeights};
pub use model::{token_log_probs, BatchItem, CausalLm, LogitsWanted};
pub use model_error::ModelError;
