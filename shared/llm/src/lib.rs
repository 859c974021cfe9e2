//! `relay-llm`: LLM policies for the text games, in candle on the CPU.
//!
//! Pure: no NATS, Redis or async; files are the only I/O (model folders,
//! GGUF files, adapters).
//!
//! Kept apart from `relay-nn` (the small actor-critic MLPs) so that the
//! classic-control services do not compile tokenizers and transformer code.
