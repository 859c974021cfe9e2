//! `relay-llm`: LLM policies for the text games, in candle on the CPU.
//!
//! Pure: no NATS, Redis or async; files are the only I/O (model folders,
//! GGUF files, adapters).
//!
//! Kept apart from `relay-nn` (the small actor-critic MLPs) so that the
//! classic-control services do not compile tokenizers and transformer code.

pub mod chat;
pub mod gguf_tokenizer;
pub mod smollm2;
pub mod tiny_tokenizer;
pub mod tokenizer;

pub use chat::{ChatMessage, ChatTemplate, ChatTemplateError};
pub use smollm2::{find_smollm2_gguf, FindGgufError, SMOLLM2_GGUF_ENV};
pub use tiny_tokenizer::{write_tiny_tokenizer, TINY_VOCAB_SIZE};
pub use tokenizer::{
    IncrementalDecoder, SpecialToken, SpecialTokens, TokenSequences, Tokenizer, TokenizerError,
};
