//! `relay model init tiny [--out DIR] [--seed N]`: writes a small random
//! Qwen2 model with its tokenizer (byte-level BPE, ChatML template) as a
//! Hugging Face folder, which the inference server serves with
//! `llm.model: DIR`, for tests, demos and benchmarks without a download.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use clap::{Args, Subcommand};
use relay_llm::{init, ModelConfig, TinyVocab, Tokenizer};

/// `relay model ...`.
#[derive(Debug, Args)]
pub struct ModelArgs {
    #[command(subcommand)]
    pub command: ModelCommand,
}

/// What `relay model` does.
#[derive(Debug, Subcommand)]
pub enum ModelCommand {
    /// Write a new model folder.
    Init {
        #[command(subcommand)]
        kind: InitKind,
    },
}

/// Which model `relay model init` writes.
#[derive(Debug, Subcommand)]
pub enum InitKind {
    /// A tiny random Qwen2 (3 layers, hidden 128, vocabulary 512) with its tokenizer.
    Tiny {
        /// Folder to write (created; files in it are replaced).
        #[arg(long, default_value = "models/tiny")]
        out: PathBuf,
        /// Seed of the random weights (the same seed writes the same model).
        #[arg(long, default_value_t = 0)]
        seed: u64,
    },
}

/// Runs `relay model ...`.
pub fn model(args: ModelArgs) -> Result<()> {
    match args.command {
        ModelCommand::Init {
            kind: InitKind::Tiny { out, seed },
        } => {
            let config = init_tiny(&out, seed)?;
            println!(
                "wrote a tiny Qwen2 model to {} ({} layers, hidden {}, vocabulary {}, seed {seed}); serve it with `--set llm.model={}`",
                out.display(),
                config.num_hidden_layers,
                config.hidden_size,
                config.vocab_size,
                out.display()
            );
            Ok(())
        }
    }
}

/// Writes the tiny tokenizer, then a random Qwen2 sized to its vocabulary
/// and special tokens, into `out`.
pub fn init_tiny(out: &Path, seed: u64) -> Result<ModelConfig> {
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    let size = relay_llm::write_tiny_tokenizer(out)
        .with_context(|| format!("writing the tokenizer into {}", out.display()))?;
    let tokenizer = Tokenizer::from_hf_dir(out)
        .with_context(|| format!("reading back the tokenizer of {}", out.display()))?;
    let vocab = TinyVocab {
        size,
        bos_token_id: tokenizer.bos_token_id(),
        eos_token_id: tokenizer.eos_token_id(),
        pad_token_id: tokenizer.special_tokens().pad.as_ref().map(|t| t.id),
    };
    init::tiny(out, seed, &vocab)
        .with_context(|| format!("writing the model into {}", out.display()))
}
