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

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use rand::seq::SliceRandom;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use relay_bridge::{Backend, EnvSection};
use relay_config::GgufBaseName;
use relay_envs::ObservationView;
use relay_llm::sft::{
    encode_record, load_hf_trainable_on, named_vars, read_sft_jsonl, save_hf_trainable, SftConfig,
    SftExample, SftFormat, SftRecord, SftStats, SftTrainer,
};
use relay_llm::token_batch::BatchConfig;
use relay_llm::{AdamWConfig, CausalLm, LoraAdapter, LoraConfig, Tokenizer};
use relay_policy::text::Outcome;
use serde::Serialize;

use crate::play_text::{play_game, Player};

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
}

/// A command-line JSON object.
fn parse_json_object(text: &str) -> Result<serde_json::Map<String, serde_json::Value>, String> {
    match serde_json::from_str(text) {
        Ok(serde_json::Value::Object(map)) => Ok(map),
        Ok(other) => Err(format!("expected a JSON object, got {other}")),
        Err(e) => Err(format!("not JSON: {e}")),
    }
}

/// Results against one opponent, both seats together.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct EvalResult {
    pub opponent: String,
    pub games: u32,
    pub wins: u32,
    pub draws: u32,
    pub losses: u32,
    pub moves: u32,
    pub invalid_moves: u32,
}

impl EvalResult {
    /// Share of the model's moves the game accepted.
    pub fn legal_move_rate(&self) -> f64 {
        if self.moves == 0 {
            1.0
        } else {
            1.0 - self.invalid_moves as f64 / self.moves as f64
        }
    }

    /// Share of games not lost.
    pub fn non_loss_rate(&self) -> f64 {
        if self.games == 0 {
            0.0
        } else {
            (self.wins + self.draws) as f64 / self.games as f64
        }
    }
}

/// One epoch's figures.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct EpochReport {
    pub epoch: usize,
    pub steps: usize,
    pub train_loss: f64,
    pub train_token_accuracy: f64,
    pub holdout_loss: Option<f64>,
    pub holdout_token_accuracy: Option<f64>,
    pub seconds: f64,
}

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

/// Plays one move sequence per game between `bots` (one per seat) and
/// returns every move as an (observation rendered as `view`, move written
/// in `answer`'s format) pair.
pub fn bot_game_records(
    env: &str,
    section: &EnvSection,
    bots: &[String],
    games: usize,
    seed: u64,
    view: ObservationView,
    answer: &relay_envs::AnswerFormat,
) -> Result<Vec<SftRecord>> {
    let write = |action: &str| {
        answer.write(action).with_context(|| {
            format!("the answer format {answer:?} is a pattern to read answers by, not a way to write the bots' moves; give --data")
        })
    };
    let mut records = Vec::new();
    for game_index in 0..games {
        let game_seed = seed.wrapping_add(game_index as u64);
        let mut game = relay_bridge::make_text_game(env, section)?;
        if bots.len() != game.num_players() {
            bail!(
                "--bots: {env} has {} seats, got {} bots ({})",
                game.num_players(),
                bots.len(),
                bots.join(",")
            );
        }
        let mut players = bots
            .iter()
            .enumerate()
            .map(|(seat, name)| {
                relay_policy::text::make_bot(
                    name,
                    game_seed.wrapping_mul(31).wrapping_add(seat as u64),
                    &Default::default(),
                )
                .map_err(|e| anyhow::anyhow!("--bots: {e}"))
            })
            .collect::<Result<Vec<_>>>()?;
        game.reset(game_seed);
        while !game.is_done() {
            let player = game.current_player();
            let observation = game.observation_as(player, view);
            let alternatives = players[player]
                .move_support(game.as_ref())
                .unwrap_or_default()
                .iter()
                .map(|m| write(m))
                .collect::<Result<Vec<_>>>()?;
            let action = players[player].choose_move(game.as_ref())?;
            game.step(&action)?;
            records.push(SftRecord::Pair {
                prompt: observation,
                completion: write(&action)?,
                alternatives,
            });
        }
    }
    Ok(records)
}

/// Plays `games` greedy games per seat against each opponent.
fn evaluate(
    env: &str,
    section: &EnvSection,
    player: &mut Player,
    opponents: &[String],
    games: usize,
    seed: u64,
) -> Result<Vec<EvalResult>> {
    let seats = relay_bridge::make_text_game(env, section)?.num_players();
    let mut results = Vec::new();
    for opponent in opponents {
        let mut result = EvalResult {
            opponent: opponent.clone(),
            ..Default::default()
        };
        for seat in 0..seats {
            for g in 0..games {
                let game = play_game(
                    relay_bridge::make_text_game(env, section)?,
                    player,
                    seat,
                    opponent,
                    seed.wrapping_add((seat * games + g) as u64),
                    &mut std::io::empty(),
                    &mut std::io::sink(),
                )?;
                result.games += 1;
                result.moves += game.model_moves;
                result.invalid_moves += game.model_invalid_moves;
                match Outcome::of(&game.rewards, seat) {
                    Outcome::Win => result.wins += 1,
                    Outcome::Draw => result.draws += 1,
                    Outcome::Loss => result.losses += 1,
                }
            }
        }
        results.push(result);
    }
    Ok(results)
}

fn print_eval(when: &str, results: &[EvalResult]) {
    for r in results {
        println!(
            "{when:<7} {:<10} {:>5} {:>5} {:>5} {:>5} {:>10.1}% {:>9.1}%",
            r.opponent,
            r.games,
            r.wins,
            r.draws,
            r.losses,
            100.0 * r.legal_move_rate(),
            100.0 * r.non_loss_rate()
        );
    }
}

fn mean_stats(stats: &[SftStats]) -> (f64, f64) {
    let tokens: usize = stats.iter().map(|s| s.tokens).sum::<usize>().max(1);
    let loss = stats.iter().map(|s| s.loss * s.tokens as f64).sum::<f64>() / tokens as f64;
    let accuracy = stats
        .iter()
        .map(|s| s.token_accuracy * s.tokens as f64)
        .sum::<f64>()
        / tokens as f64;
    (loss, accuracy)
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

fn comma_list(text: &str) -> Vec<String> {
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

/// `relay sft`.
pub fn sft(args: SftArgs) -> Result<()> {
    run_sft(args).map(|_| ())
}

/// `relay sft`, returning what it printed last.
pub fn run_sft(args: SftArgs) -> Result<SftSummary> {
    let started = Instant::now();
    let section = text_section(args.textarena);
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
    let backend = relay_llm::BackendSpec {
        kind: args.backend,
        device: args.device,
        dtype: args.dtype,
    };
    let backend = relay_llm::Backend::open(&backend)?;
    // The model: trainable weights for --full, else a frozen base with a new adapter.
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
    let adapter = match &varmap {
        Some(_) => None,
        None => Some(Arc::new(model.place_adapter(&LoraAdapter::new(
            model.config(),
            LoraConfig::all_projections(args.rank, args.alpha),
            args.seed,
        )?)?)),
    };

    // The examples.
    let records = match &args.data {
        Some(path) => read_sft_jsonl(path)?,
        None => {
            let bots = comma_list(&args.bots);
            let records = bot_game_records(
                &args.env,
                &section,
                &bots,
                args.games,
                args.seed,
                args.observation,
                &args.answer,
            )?;
            if let Some(path) = &args.write_data {
                let mut file = std::io::BufWriter::new(
                    std::fs::File::create(path)
                        .with_context(|| format!("creating {}", path.display()))?,
                );
                for record in &records {
                    writeln!(file, "{}", serde_json::to_string(record)?)?;
                }
                file.flush()?;
            }
            records
        }
    };
    let format = SftFormat::Chat {
        system_prompt: args.system_prompt.clone(),
    };
    let mut examples: Vec<SftExample> = records
        .iter()
        .enumerate()
        .map(|(i, r)| encode_record(&tokenizer, &format, r).with_context(|| format!("example {i}")))
        .collect::<Result<_>>()?;
    if examples.is_empty() {
        bail!("no training examples");
    }
    let mut rng = ChaCha8Rng::seed_from_u64(args.seed);
    examples.shuffle(&mut rng);
    let holdout_len = ((examples.len() as f64 * args.holdout) as usize).min(examples.len() - 1);
    let holdout = examples.split_off(examples.len() - holdout_len);

    let mut trainer = SftTrainer::new(
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
        },
        match (&varmap, &adapter) {
            (Some(varmap), _) => named_vars(varmap),
            (None, Some(adapter)) => adapter.named_vars(),
            (None, None) => unreachable!("either the model or an adapter trains"),
        },
    )?;

    let opponents = comma_list(&args.eval_opponents);
    let answer = relay_envs::AnswerReader::new(&args.answer).map_err(anyhow::Error::msg)?;
    let player = |model: &CausalLm| {
        Player::from_parts(
            model.clone(),
            tokenizer.clone(),
            adapter.clone(),
            0.0,
            args.max_tokens,
            args.seed,
        )
        .with_prompting(args.system_prompt.clone(), args.observation)
        .with_answer(answer.clone())
    };
    let eval_header = || {
        println!(
            "{:<7} {:<10} {:>5} {:>5} {:>5} {:>5} {:>11} {:>10}",
            "when", "opponent", "games", "win", "draw", "loss", "legal moves", "non-loss"
        )
    };
    let before = if args.eval_games > 0 {
        let results = evaluate(
            &args.env,
            &section,
            &mut player(&model),
            &opponents,
            args.eval_games,
            args.seed,
        )?;
        eval_header();
        print_eval("before", &results);
        results
    } else {
        Vec::new()
    };

    println!(
        "relay sft: {} examples ({} held out) from {}, training {}",
        examples.len(),
        holdout.len(),
        args.data
            .as_ref()
            .map(|p| p.display().to_string())
            .unwrap_or_else(|| format!("{} games of {}", args.games, args.bots)),
        if args.full {
            "every weight"
        } else {
            "a LoRA adapter"
        }
    );
    println!(
        "{:>5} {:>6} {:>11} {:>10} {:>13} {:>12} {:>8}",
        "epoch", "steps", "train loss", "train acc", "holdout loss", "holdout acc", "seconds"
    );
    let mut epochs = Vec::new();
    let mut truncated = 0;
    for epoch in 1..=args.epochs {
        let epoch_started = Instant::now();
        examples.shuffle(&mut rng);
        let stats = trainer.train_epoch(&model, adapter.as_deref(), &examples)?;
        truncated = stats.iter().map(|s| s.truncated).sum();
        let (train_loss, train_token_accuracy) = mean_stats(&stats);
        let held = if holdout.is_empty() {
            None
        } else {
            Some(trainer.evaluate(&model, adapter.as_deref(), &holdout)?)
        };
        let report = EpochReport {
            epoch,
            steps: stats.len(),
            train_loss,
            train_token_accuracy,
            holdout_loss: held.map(|s| s.loss),
            holdout_token_accuracy: held.map(|s| s.token_accuracy),
            seconds: epoch_started.elapsed().as_secs_f64(),
        };
        let optional = |v: Option<f64>| v.map(|v| format!("{v:.4}")).unwrap_or_else(|| "-".into());
        println!(
            "{:>5} {:>6} {:>11.4} {:>10.4} {:>13} {:>12} {:>8.1}",
            report.epoch,
            report.steps,
            report.train_loss,
            report.train_token_accuracy,
            optional(report.holdout_loss),
            optional(report.holdout_token_accuracy),
            report.seconds
        );
        epochs.push(report);
    }

    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("creating {}", args.out.display()))?;
    let output = match (&varmap, &adapter) {
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
    };

    let after = if args.eval_games > 0 {
        let results = evaluate(
            &args.env,
            &section,
            &mut player(&model),
            &opponents,
            args.eval_games,
            args.seed,
        )?;
        eval_header();
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
        truncated,
        epochs,
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
    Ok(summary)
}
