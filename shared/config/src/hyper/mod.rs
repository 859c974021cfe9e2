//! Hyperparameter types that configs name and the pure crates (relay-nn,
//! relay-llm) take from here, so that reading a config needs neither candle
//! nor a tokenizer. Each type owns its defaults and its own range checks
//! ([`crate::FieldError`]); the sections that hold them add the field path.

pub mod backend;
pub mod lora;
pub mod objective;
pub mod policy;
pub mod reward;
pub mod schedule;
