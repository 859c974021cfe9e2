//! `relay sft`: the supervised warm start of a text-game policy.
//!
//! Trains on (observation → move) pairs, from a JSONL file (`--data`) or
//! from games that fixed bots play against each other (`--games`,
//! `--bots random,random`: every move of every seat is one example, so the
//! model learns the game's format, and with `minimax` a strategy). The
//! pairs are rendered exactly as the env-runners prompt the policy (the
//! observation as the user turn of the chat template, after
//! `--system-prompt` if the runs will send one); the loss covers the move
//! and its end-of-turn token only.
//!
//! A LoRA adapter is trained on the model by default (written as
//! `<out>/adapter/` in PEFT's format, for `llm.adapters` or as the
//! learner's starting adapter); `--full` trains every weight of a Hugging
//! Face model instead (written as the model folder `<out>/model/`, with
//! the tokenizer files copied: the `llm.model` of the runs that follow).
//! This is how a model made by `relay model init tiny` learns to play
//! legal moves before RL.
//!
//! Before and after training, the model plays `--eval-games` greedy games
//! from each seat against each `--eval-opponents` bot (the same game code
//! as `relay play`): the legal-move rate and win/draw/loss show what SFT
//! did. Prints a table per epoch and per evaluation, and a last JSON line;
//! `<out>/sft.json` holds the same summary.
//!
//! `--replicas N` trains as N data-parallel replicas, as the learner's
//! replicas do (`relay_replicas`, the same driver): every replica
//! holds all the examples, each epoch's order comes from the seed and the
//! epoch alone, and each optimizer step's micro-batches are shared out,
//! their gradients summed by the ring all-reduce, so the batch is
//! `--batch-size` whatever N is and every replica steps alike (checked by
//! a digest every 10 steps). Without `--nats` the command starts a
//! nats-server and the other N-1 replicas on this machine itself; with
//! `--nats` (and `--group`) the same command run on several machines
//! makes one group, whose first member is rank 0: it evaluates, prints
//! and writes `--out`, and the others print nothing. A replica that dies
//! is noticed within its lease (3 s), and the others re-form and go on
//! with the step it interrupted; one that joins later (the same command
//! again) takes rank 0's weights, optimizer state and position before its
//! first step. The step barrier is rank 0 handing out each step's
//! position, so every replica takes the same steps.
//!
//! | file | owns |
//! |---|---|
//! | `mod.rs` | the command: [`run_sft`] loads the model, gathers the examples, evaluates, trains and writes the output |
//! | [`args`] | the flags |
//! | [`data`] | the examples: bot games or JSONL |
//! | [`evaluate`] | games against the bots before and after |
//! | [`train`] | one training as a replica runs it |
//! | [`team`] | this process's place among the replicas |

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use rand::seq::SliceRandom;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use relay_config::GgufBaseName;
use relay_llm::sft::{
    encode_record, load_hf_trainable_on, named_vars, read_sft_jsonl, save_hf_trainable, SftConfig,
    SftExample, SftFormat, SftTrainer,
};
use relay_llm::token_batch::BatchConfig;
use relay_llm::{AdamWConfig, CausalLm, LoraAdapter, LoraConfig, Tokenizer};
use serde::Serialize;

use crate::play_text::Player;
use args::comma_list;
use evaluate::{evaluate, print_eval};
use team::Team;
use train::{training_identity, TrainingSession};

mod args;
mod data;
mod evaluate;
mod team;
mod train;

pub use args::{text_section, ReplicaArgs, SftArgs};
pub use data::bot_game_records;
pub use evaluate::EvalResult;
pub use train::EpochReport;

/// What `relay sft` did (`sft.json` and the last line printed).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SftSummary {
    pub env: String,
    pub model: String,
    pub trained: &'static str,
    pub output: PathBuf,
    pub examples: usize,
    pub holdout_examples: usize,
    pub truncated: usize,
    pub epochs: Vec<EpochReport>,
    pub before: Vec<EvalResult>,
    pub after: Vec<EvalResult>,
    pub seconds: f64,
}

/// `relay sft`.
pub fn sft(args: SftArgs) -> Result<()> {
    run_sft(args).map(|_| ())
}

/// `relay sft`, returning what it printed last (`None`: this process was
/// a replica other than rank 0, which prints and writes nothing).
pub fn run_sft(args: SftArgs) -> Result<Option<SftSummary>> {
    let started = Instant::now();
    let section = text_section(args.textarena);
    check_args(&args, &section)?;
    share_cores(&args.replicas);
    let Loaded {
        model,
        tokenizer,
        varmap,
        adapter,
        trainable,
    } = load(&args)?;
    let records = match &args.data {
        Some(path) => read_sft_jsonl(path)?,
        None => bot_game_records(
            &args.env,
            &section,
            &comma_list(&args.bots),
            args.games,
            args.seed,
            args.observation,
            &args.answer,
        )?,
    };
    let (examples, holdout) = encode_and_hold_out(&args, &tokenizer, &records)?;
    let mut trainer = SftTrainer::new(sft_config(&args, &model), trainable.clone())?;

    // Joined once loaded, so that a replica can take rank 0's state as
    // soon as the group holds it.
    let mut team = Team::start(&args.replicas)?;
    if let Some(path) = args.write_data.as_ref().filter(|_| team.leads()) {
        write_records(path, &records)?;
    }
    let opponents = comma_list(&args.eval_opponents);
    let answer = relay_envs::AnswerReader::new(&args.answer).map_err(anyhow::Error::msg)?;
    let evaluate_now = || -> Result<Vec<EvalResult>> {
        let mut player = Player::from_parts(
            model.clone(),
            tokenizer.clone(),
            adapter.clone(),
            0.0,
            args.max_tokens,
            args.seed,
        )
        .with_prompting(args.system_prompt.clone(), args.observation)
        .with_answer(answer.clone());
        evaluate(
            &args.env,
            &section,
            &mut player,
            &opponents,
            args.eval_games,
            args.seed,
        )
    };
    let before = if args.eval_games > 0 && team.leads() {
        let results = evaluate_now()?;
        print_eval_header();
        print_eval("before", &results);
        results
    } else {
        Vec::new()
    };

    team.wait_for_all(&args.replicas)?;
    if team.leads() {
        print_training_heading(&args, &team, examples.len(), holdout.len());
    }
    let session = TrainingSession {
        model: &model,
        adapter: adapter.as_deref(),
        trainable: &trainable,
        examples: &examples,
        holdout: &holdout,
        epochs: args.epochs,
        seed: args.seed,
        identity: training_identity(&args, &examples, &holdout)?,
    };
    let Some(progress) = session.train(&mut team, &mut trainer)? else {
        team.finish();
        return Ok(None);
    };
    let output = write_output(&args, &model, varmap.as_ref(), adapter.as_deref())?;
    team.finish();

    let after = if args.eval_games > 0 {
        let results = evaluate_now()?;
        print_eval_header();
        print_eval("before", &before);
        print_eval("after", &results);
        results
    } else {
        Vec::new()
    };
    let summary = SftSummary {
        env: args.env.clone(),
        model: args.model.clone(),
        trained: if args.full { "model" } else { "adapter" },
        output,
        examples: examples.len(),
        holdout_examples: holdout.len(),
        truncated: progress.truncated,
        epochs: progress.epochs,
        before,
        after,
        seconds: started.elapsed().as_secs_f64(),
    };
    std::fs::write(
        args.out.join("sft.json"),
        serde_json::to_string_pretty(&summary)?,
    )?;
    println!("wrote {}", summary.output.display());
    println!("{}", serde_json::to_string(&summary)?);
    Ok(Some(summary))
}

/// Refuses flags that cannot make a training.
fn check_args(args: &SftArgs, section: &relay_bridge::EnvSection) -> Result<()> {
    if !section.is_text_game(&args.env) {
        bail!(
            "--env {:?} is not a text game of relay's (known: {}); add --textarena for a TextArena id",
            args.env,
            relay_envs::TEXT_GAME_IDS.join(", ")
        );
    }
    if !(0.0..1.0).contains(&args.holdout) {
        bail!("--holdout {} must be in [0, 1)", args.holdout);
    }
    if args.replicas.replicas == 0 {
        bail!("--replicas must be at least 1");
    }
    Ok(())
}

/// N replicas on this machine share its cores (torchrun likewise gives
/// each process one OpenMP thread); the others inherit the setting.
fn share_cores(local: &ReplicaArgs) {
    if local.replicas > 1 && local.nats.is_none() && std::env::var_os("RAYON_NUM_THREADS").is_none()
    {
        // Edition 2021: set_var is safe; no thread pool has started yet.
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        std::env::set_var(
            "RAYON_NUM_THREADS",
            (cores / local.replicas).max(1).to_string(),
        );
    }
}

/// The model and what trains: every weight with `--full`, else a new
/// LoRA adapter over a frozen base.
struct Loaded {
    model: CausalLm,
    tokenizer: Tokenizer,
    /// `--full`: the model's own weights, trainable.
    varmap: Option<candle_nn::VarMap>,
    adapter: Option<Arc<LoraAdapter>>,
    /// The weights that train (the varmap's or the adapter's), by name.
    trainable: Vec<(String, candle_core::Var)>,
}

fn load(args: &SftArgs) -> Result<Loaded> {
    let backend = relay_llm::BackendSpec {
        kind: args.backend,
        device: args.device,
        dtype: args.dtype,
    };
    let backend = relay_llm::Backend::open(&backend)?;
    let (model, mut tokenizer, varmap) = if args.full {
        let dir = PathBuf::from(&args.model);
        if !dir.join("config.json").is_file() {
            bail!(
                "--full trains a Hugging Face folder; {} has no config.json",
                dir.display()
            );
        }
        let (model, varmap) = load_hf_trainable_on(&dir, &backend)?;
        let tokenizer = Tokenizer::from_hf_dir(&dir)?;
        (model, tokenizer, Some(varmap))
    } else {
        let loaded = relay_llm::load_model_on(&args.model, GgufBaseName::Dequantized, &backend)?;
        (loaded.model, loaded.tokenizer, None)
    };
    if let Some(kwargs) = &args.chat_template_kwargs {
        tokenizer.set_chat_template_kwargs(kwargs.clone());
    }
    let (adapter, trainable) = match &varmap {
        Some(varmap) => (None, named_vars(varmap)),
        None => {
            let adapter = Arc::new(model.place_adapter(&LoraAdapter::new(
                model.config(),
                LoraConfig::all_projections(args.rank, args.alpha),
                args.seed,
            )?)?);
            let trainable = adapter.named_vars();
            (Some(adapter), trainable)
        }
    };
    Ok(Loaded {
        model,
        tokenizer,
        varmap,
        adapter,
        trainable,
    })
}

/// The records as the env-runners prompt the policy, shuffled by the seed;
/// the last `--holdout` share of them held out.
fn encode_and_hold_out(
    args: &SftArgs,
    tokenizer: &Tokenizer,
    records: &[relay_llm::sft::SftRecord],
) -> Result<(Vec<SftExample>, Vec<SftExample>)> {
    let format = SftFormat::Chat {
        system_prompt: args.system_prompt.clone(),
    };
    let mut examples: Vec<SftExample> = records
        .iter()
        .enumerate()
        .map(|(i, r)| encode_record(tokenizer, &format, r).with_context(|| format!("example {i}")))
        .collect::<Result<_>>()?;
    if examples.is_empty() {
        bail!("no training examples");
    }
    let mut rng = ChaCha8Rng::seed_from_u64(args.seed);
    examples.shuffle(&mut rng);
    let holdout_len = ((examples.len() as f64 * args.holdout) as usize).min(examples.len() - 1);
    let holdout = examples.split_off(examples.len() - holdout_len);
    Ok((examples, holdout))
}

fn sft_config(args: &SftArgs, model: &CausalLm) -> SftConfig {
    SftConfig {
        batch: BatchConfig {
            batch_size: args.batch_size,
            minibatch_size: args.minibatch_size,
            max_seq_len: args
                .max_seq_len
                .unwrap_or(model.config().max_position_embeddings + 1),
            truncation: Default::default(),
            recompute_activations: true,
        },
        optimizer: AdamWConfig {
            lr: args.lr,
            ..Default::default()
        },
        aggregation: Default::default(),
    }
}

/// `--write-data`: the records as JSONL, one per line.
fn write_records(path: &Path, records: &[relay_llm::sft::SftRecord]) -> Result<()> {
    let mut file = std::io::BufWriter::new(
        std::fs::File::create(path).with_context(|| format!("creating {}", path.display()))?,
    );
    for record in records {
        writeln!(file, "{}", serde_json::to_string(record)?)?;
    }
    file.flush()?;
    Ok(())
}

fn print_eval_header() {
    println!(
        "{:<7} {:<10} {:>5} {:>5} {:>5} {:>5} {:>11} {:>10}",
        "when", "opponent", "games", "win", "draw", "loss", "legal moves", "non-loss"
    );
}

fn print_training_heading(args: &SftArgs, team: &Team, examples: usize, holdout: usize) {
    println!(
        "relay sft: {examples} examples ({holdout} held out) from {}, training {}{}",
        args.data
            .as_ref()
            .map(|p| p.display().to_string())
            .unwrap_or_else(|| format!("{} games of {}", args.games, args.bots)),
        if args.full {
            "every weight"
        } else {
            "a LoRA adapter"
        },
        team.describe(),
    );
    println!(
        "{:>5} {:>6} {:>11} {:>10} {:>13} {:>12} {:>8}",
        "epoch", "steps", "train loss", "train acc", "holdout loss", "holdout acc", "seconds"
    );
}

/// Writes what trained into `--out`: the model folder (`--full`, with the
/// tokenizer files) or the adapter in PEFT's format; returns its path.
fn write_output(
    args: &SftArgs,
    model: &CausalLm,
    varmap: Option<&candle_nn::VarMap>,
    adapter: Option<&LoraAdapter>,
) -> Result<PathBuf> {
    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("creating {}", args.out.display()))?;
    Ok(match (varmap, adapter) {
        (Some(varmap), _) => {
            let dir = args.out.join("model");
            save_hf_trainable(varmap, model.config(), &dir)?;
            copy_tokenizer_files(Path::new(&args.model), &dir)?;
            dir
        }
        (None, Some(adapter)) => {
            let dir = args.out.join("adapter");
            adapter.save_peft(&dir, Some(&args.model))?;
            dir
        }
        (None, None) => unreachable!("either the model or an adapter trains"),
    })
}

/// Copies the tokenizer and template files of a Hugging Face folder (all
/// but the weights and `config.json`, which the trained model replaces).
fn copy_tokenizer_files(from: &Path, to: &Path) -> Result<()> {
    for entry in std::fs::read_dir(from).with_context(|| format!("reading {}", from.display()))? {
        let path = entry?.path();
        let name = path
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or_default();
        let weights = name.ends_with(".safetensors") || name.ends_with(".safetensors.index.json");
        if path.is_file() && !weights && name != "config.json" {
            std::fs::copy(&path, to.join(name))
                .with_context(|| format!("copying {}", path.display()))?;
        }
    }
    Ok(())
}
