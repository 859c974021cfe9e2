//! `relay sft`'s flags ([`SftArgs`], [`ReplicaArgs`]) and the small
//! parsers they use.

use std::path::PathBuf;

use relay_bridge::{Backend, EnvSection};
use relay_envs::ObservationView;

/// Flags of `relay sft`.
#[derive(Debug, Clone, clap::Args)]
pub struct SftArgs {
    /// The text game whose moves are learned (its bots make the data; its rules judge the evaluation).
    #[arg(long, default_value = "TicTacToe-v0")]
    pub env: String,
    /// The model: a Hugging Face folder (e.g. from `relay model init tiny`), a .gguf file or `smollm2` (LoRA only).
    #[arg(long)]
    pub model: String,
    /// Output folder: `adapter/` (LoRA) or `model/` (--full), and `sft.json`.
    #[arg(long)]
    pub out: PathBuf,
    /// Training data as JSONL (`{"prompt", "completion"}` or `{"messages": [...]}` per line); default: bot games.
    #[arg(long)]
    pub data: Option<PathBuf>,
    /// Games the bots play to make the data (each move of every seat is one example).
    #[arg(long, default_value_t = 400)]
    pub games: usize,
    /// The bots of those games, one per seat, comma separated (random, minimax, connect_four_bot).
    #[arg(long, default_value = "random,random")]
    pub bots: String,
    /// Also write the examples made from bot games to this JSONL file.
    #[arg(long)]
    pub write_data: Option<PathBuf>,
    /// Train every weight of a Hugging Face model instead of a LoRA adapter.
    #[arg(long)]
    pub full: bool,
    /// What trains and plays: `engine` (the tuned CPU engine), `candle`
    /// (candle tensor ops on `--device` in `--dtype`; `--full` in f32) or
    /// `auto` (the engine for f32 on the CPU, candle otherwise), as
    /// `llm.backend` in a config.
    #[arg(long, default_value = "auto")]
    pub backend: relay_llm::BackendKind,
    /// The candle backend's device: `cpu`, `cuda` or `cuda:N` (`llm.device`).
    #[arg(long, default_value = "cpu")]
    pub device: relay_llm::DeviceSpec,
    /// The candle backend's dtype: `f32`, `bf16` or `f16` (`llm.dtype`).
    #[arg(long, default_value = "f32")]
    pub dtype: relay_llm::LlmDtype,
    /// LoRA rank (on every attention and MLP projection).
    #[arg(long, default_value_t = 8)]
    pub rank: usize,
    /// LoRA alpha (the update is scaled by alpha / rank).
    #[arg(long, default_value_t = 16.0)]
    pub alpha: f64,
    /// Passes over the training examples.
    #[arg(long, default_value_t = 2)]
    pub epochs: usize,
    /// Examples per optimizer step.
    #[arg(long, default_value_t = 32)]
    pub batch_size: usize,
    /// Examples per forward/backward (gradient accumulation up to --batch-size).
    #[arg(long, default_value_t = 8)]
    pub minibatch_size: usize,
    /// AdamW learning rate.
    #[arg(long, default_value_t = 1e-3)]
    pub lr: f64,
    /// Longest prompt + completion in tokens (default: the model's context); longer examples lose the start of their prompt.
    #[arg(long)]
    pub max_seq_len: Option<usize>,
    /// How replies give their move (raw, boxed, last_bracket); give the runs' `text.answer`: the bot games' targets are written in it (`boxed`: `\boxed{4}`) and the evaluation reads moves the same way.
    #[arg(long, default_value = "raw")]
    pub answer: relay_envs::AnswerFormat,
    /// System prompt before each observation; give the runs' `text.system_prompt` if they set one.
    #[arg(long)]
    pub system_prompt: Option<String>,
    /// How observations are rendered (full, first_last, compact); give the runs' `text.observation`.
    #[arg(long, default_value = "full")]
    pub observation: ObservationView,
    /// Variables of the model's chat template, as a JSON object (e.g. `{"enable_thinking": false}` for Qwen3); give the runs' `llm.chat_template_kwargs`.
    #[arg(long, value_parser = parse_json_object)]
    pub chat_template_kwargs: Option<serde_json::Map<String, serde_json::Value>>,
    /// Share of the examples held out to measure the loss on unseen positions.
    #[arg(long, default_value_t = 0.05)]
    pub holdout: f64,
    /// Greedy games per opponent and seat before and after training (0: no evaluation).
    #[arg(long, default_value_t = 10)]
    pub eval_games: usize,
    /// Bots the evaluation plays against, comma separated.
    #[arg(long, default_value = "random,minimax")]
    pub eval_opponents: String,
    /// Most tokens the model may generate per move in the evaluation.
    #[arg(long, default_value_t = 16)]
    pub max_tokens: usize,
    /// Seed of the bot games, the shuffling, the adapter's initialisation and the evaluation.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// --env is a TextArena id (any of its registry), played through the env bridge.
    #[arg(long)]
    pub textarena: bool,
    /// Data-parallel replicas (see the module docs).
    #[command(flatten)]
    pub replicas: ReplicaArgs,
}

/// How `relay sft` trains as data-parallel replicas.
#[derive(Debug, Clone, clap::Args)]
pub struct ReplicaArgs {
    /// Replicas that train together, each a process taking its share of every batch's micro-batches (the batch stays --batch-size). Without --nats, relay sft starts a nats-server and the other replicas on this machine.
    #[arg(long, default_value_t = 1)]
    pub replicas: usize,
    /// NATS (with JetStream) through which replicas on several machines find each other: run the same command on each machine with the same --nats, --group and --replicas; the first to join is rank 0, which evaluates and writes --out.
    #[arg(long)]
    pub nats: Option<String>,
    /// The replicas' group on that NATS (one per training).
    #[arg(long, default_value = "relay-sft")]
    pub group: String,
    /// Where this replica's link of the all-reduce ring listens (default: the interface that reaches NATS, any port).
    #[arg(long)]
    pub listen: Option<String>,
    /// Seconds to wait for --replicas replicas to join before training starts.
    #[arg(long, default_value_t = 300)]
    pub join_timeout: u64,
}

impl Default for ReplicaArgs {
    fn default() -> Self {
        Self {
            replicas: 1,
            nats: None,
            group: "relay-sft".into(),
            listen: None,
            join_timeout: 300,
        }
    }
}

/// A command-line JSON object.
fn parse_json_object(text: &str) -> Result<serde_json::Map<String, serde_json::Value>, String> {
    match serde_json::from_str(text) {
        Ok(serde_json::Value::Object(map)) => Ok(map),
        Ok(other) => Err(format!("expected a JSON object, got {other}")),
        Err(e) => Err(format!("not JSON: {e}")),
    }
}

pub(super) fn comma_list(text: &str) -> Vec<String> {
    text.split(',')
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .collect()
}

/// Where the CLI's text games come from: TextArena's registry with
/// `--textarena`, else relay's built-in games.
pub fn text_section(textarena: bool) -> EnvSection {
    EnvSection {
        backend: if textarena {
            Backend::Textarena
        } else {
            Backend::Auto
        },
        ..EnvSection::default()
    }
}
