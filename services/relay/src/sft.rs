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
use serde::{Deserialize, Serialize};

use relay_replicas::{Next, Replicas, Replicated, Turn};

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
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
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

/// `relay sft`, returning what it printed last (`None`: this process was
/// a replica other than rank 0, which prints and writes nothing).
pub fn run_sft(args: SftArgs) -> Result<Option<SftSummary>> {
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
    if args.replicas.replicas == 0 {
        bail!("--replicas must be at least 1");
    }
    let local = &args.replicas;
    if local.replicas > 1 && local.nats.is_none() && std::env::var_os("RAYON_NUM_THREADS").is_none()
    {
        // N replicas on this machine share its cores (torchrun likewise
        // gives each process one OpenMP thread); the others inherit it.
        // Edition 2021: set_var is safe; no thread pool has started yet.
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        std::env::set_var(
            "RAYON_NUM_THREADS",
            (cores / local.replicas).max(1).to_string(),
        );
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
    let trainable = match (&varmap, &adapter) {
        (Some(varmap), _) => named_vars(varmap),
        (None, Some(adapter)) => adapter.named_vars(),
        (None, None) => unreachable!("either the model or an adapter trains"),
    };

    // The examples.
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
        trainable.clone(),
    )?;

    // Joined once loaded, so that a replica can take rank 0's state as
    // soon as the group holds it.
    let mut team = Team::start(&args.replicas)?;
    if let Some(path) = args.write_data.as_ref().filter(|_| team.leads()) {
        let mut file = std::io::BufWriter::new(
            std::fs::File::create(path).with_context(|| format!("creating {}", path.display()))?,
        );
        for record in &records {
            writeln!(file, "{}", serde_json::to_string(record)?)?;
        }
        file.flush()?;
    }

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
    let before = if args.eval_games > 0 && team.leads() {
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

    team.wait_for_all(&args.replicas)?;
    if team.leads() {
        println!(
            "relay sft: {} examples ({} held out) from {}, training {}{}",
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
            },
            team.describe(),
        );
        println!(
            "{:>5} {:>6} {:>11} {:>10} {:>13} {:>12} {:>8}",
            "epoch", "steps", "train loss", "train acc", "holdout loss", "holdout acc", "seconds"
        );
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
    let epochs = progress.epochs;
    let truncated = progress.truncated;

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
    team.finish();

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
    Ok(Some(summary))
}

/// What one training's replicas share and what each holds alike.
struct TrainingSession<'a> {
    model: &'a CausalLm,
    adapter: Option<&'a LoraAdapter>,
    /// The weights that train (the adapter's factors, or every weight).
    trainable: &'a [(String, candle_core::Var)],
    examples: &'a [SftExample],
    holdout: &'a [SftExample],
    epochs: usize,
    seed: u64,
    /// [`training_identity`]: replicas of one training hold the same.
    identity: [u8; 32],
}

/// A digest of what makes one training: the examples and held-out
/// examples, and the flags that order and step them. A replica whose
/// digest differs from rank 0's (other data, flags or seed, or another
/// training sharing the group's name) stops with that reason instead of
/// mixing its gradients in.
fn training_identity(
    args: &SftArgs,
    examples: &[SftExample],
    holdout: &[SftExample],
) -> Result<[u8; 32]> {
    use sha2::Digest;
    let flags = (
        &args.model,
        args.full,
        args.rank,
        args.alpha,
        args.epochs,
        args.batch_size,
        args.minibatch_size,
        args.lr,
        args.seed,
    );
    let mut hash = sha2::Sha256::new();
    hash.update(serde_json::to_vec(&(flags, examples, holdout))?);
    Ok(hash.finalize().into())
}

/// Where a training stands: with the trainable weights and the optimizer,
/// what rank 0 hands to every replica of a new view, so that a replica
/// that joins (or survives a failed step) goes on from the same step.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
struct SftProgress {
    /// The epoch under way (from 0) and its next step.
    epoch: usize,
    step: usize,
    /// Optimizer steps taken, over all epochs.
    steps: u64,
    /// The statistics of this epoch's steps so far.
    epoch_stats: Vec<SftStats>,
    /// The finished epochs.
    epochs: Vec<EpochReport>,
    /// Sequences shortened to fit in the last finished epoch.
    truncated: usize,
}

/// Rank 0's state at a new view.
#[derive(Serialize, Deserialize)]
struct SftReplicaState {
    /// Rank 0's [`TrainingSession::identity`].
    identity: [u8; 32],
    trainable: Vec<relay_nn::NamedTensor>,
    /// AdamW's moments and step count ([`relay_llm::AdamW::state_bytes`]).
    optimizer: Vec<u8>,
    progress: SftProgress,
}

/// One replica's training as the replica driver runs it: rank 0 hands out
/// positions (epoch, step), each replica trains its share of that step's
/// batch.
struct SftTraining<'s, 'a> {
    session: &'s TrainingSession<'a>,
    trainer: &'s mut SftTrainer,
    progress: SftProgress,
    /// The epoch whose order of the examples is at hand, and that order.
    ordered: Option<(usize, Vec<SftExample>)>,
}

impl Replicated for SftTraining<'_, '_> {
    type State = SftReplicaState;
    type Step = (usize, usize);
    type Output = SftStats;
    type Error = anyhow::Error;
    // One optimizer step of one batch: it is applied whole or not at all.
    const STOPS_PART_WAY: bool = false;

    fn capture(&self) -> Result<SftReplicaState, String> {
        let trainable = relay_llm::sft::var_values(self.session.trainable);
        Ok(SftReplicaState {
            identity: self.session.identity,
            trainable: trainable.map_err(|e| e.to_string())?,
            optimizer: self
                .trainer
                .optimizer()
                .state_bytes()
                .map_err(|e| e.to_string())?,
            progress: self.progress.clone(),
        })
    }

    fn restore(&mut self, state: SftReplicaState) -> Result<(), String> {
        if state.identity != self.session.identity {
            return Err(
                "this replica's training differs from rank 0's (its examples, or \
                 --model, --full, --rank, --alpha, --epochs, --batch-size, \
                 --minibatch-size, --lr or --seed): give every replica the same \
                 data and flags, or another --group"
                    .into(),
            );
        }
        relay_llm::sft::set_var_values(self.session.trainable, &state.trainable)
            .map_err(|e| format!("weights: {e}"))?;
        let optimizer = self.trainer.optimizer_mut();
        optimizer
            .restore_bytes(&state.optimizer, "rank 0's optimizer state")
            .map_err(|e| e.to_string())?;
        // Gradients a failed step accumulated are not carried over.
        optimizer.zero_grad();
        self.progress = state.progress;
        Ok(())
    }

    fn is_next(&self, _: &(usize, usize)) -> bool {
        // Rank 0 hands out where its state is, which every replica holds
        // after the hand-over: a replica elsewhere fails in `run`.
        true
    }

    fn run(
        &mut self,
        &(epoch, step): &(usize, usize),
        share: &mut relay_nn::BatchShare<'_>,
    ) -> Result<SftStats> {
        if (epoch, step) != (self.progress.epoch, self.progress.step) {
            bail!(
                "replica at epoch {} step {} while rank 0 hands out epoch {} step {step}",
                self.progress.epoch + 1,
                self.progress.step,
                epoch + 1
            );
        }
        let session = self.session;
        if self.ordered.as_ref().is_none_or(|(e, _)| *e != epoch) {
            self.ordered = Some((epoch, epoch_order(session.examples, session.seed, epoch)));
        }
        let examples = &self.ordered.as_ref().expect("ordered above").1;
        let batch_size = self.trainer.config().batch.batch_size;
        let batch = &examples[step * batch_size..((step + 1) * batch_size).min(examples.len())];
        Ok(self
            .trainer
            .train_step_part(session.model, session.adapter, batch, share)?)
    }

    fn stopped(_: &anyhow::Error) -> bool {
        false
    }
}

impl TrainingSession<'_> {
    /// Trains every epoch, one optimizer step per `--batch-size` examples
    /// in each epoch's order, as one replica of `team`: at each new view
    /// rank 0's state goes to all; rank 0 hands out each step (the
    /// barrier), every replica computes its share and the sums, and a step
    /// a failed replica interrupted is dropped (the accumulated gradients
    /// cleared) and redone from the state rank 0 hands over in the next
    /// view, so no step is applied twice or lost. Rank 0 prints each
    /// epoch's row. `None`: this replica was told to stop (rank 0 ends
    /// the training).
    fn train(&self, team: &mut Team, trainer: &mut SftTrainer) -> Result<Option<SftProgress>> {
        let steps_per_epoch = self
            .examples
            .len()
            .div_ceil(trainer.config().batch.batch_size);
        let mut work = SftTraining {
            session: self,
            trainer,
            progress: SftProgress::default(),
            ordered: None,
        };
        // When the epoch under way started here (its time in the report).
        let (mut epoch_started, mut timed_epoch) = (Instant::now(), None);
        // The replicas' number in the last view (`None` before the first).
        let mut members = None;
        let replicas = &mut team.replicas;
        let shutdown = &team.shutdown;
        let _entered = team.runtime.enter();
        loop {
            match team
                .runtime
                .block_on(replicas.sync_view(&mut work, shutdown))?
            {
                Next::Go(true) => {
                    let now = replicas.share().1;
                    if let Some(before) = members.filter(|_| replicas.leads()) {
                        println!(
                            "replicas: {before} -> {now} at epoch {} step {}",
                            work.progress.epoch + 1,
                            work.progress.step
                        );
                    }
                    members = Some(now);
                }
                Next::Go(false) => {}
                Next::Retry => continue,
                Next::Stop => bail!("relay sft: stopped"),
            }
            let leads = replicas.leads();
            if leads && work.progress.epoch == self.epochs {
                team.runtime.block_on(replicas.announce_stop());
                return Ok(Some(work.progress));
            }
            if timed_epoch != Some(work.progress.epoch) {
                (epoch_started, timed_epoch) = (Instant::now(), Some(work.progress.epoch));
            }
            let position = leads.then_some((work.progress.epoch, work.progress.step));
            let stats = match team
                .runtime
                .block_on(replicas.run_step(&mut work, position, &mut None, shutdown))?
            {
                Turn::Done { output, .. } => output,
                Turn::Failed {
                    step: (epoch, step),
                    error,
                } => return Err(error.context(format!("epoch {} step {step}", epoch + 1))),
                Turn::Again => continue,
                Turn::Stop if leads => bail!("relay sft: stopped"),
                Turn::Stop => return Ok(None),
            };
            let progress = &mut work.progress;
            progress.epoch_stats.push(stats);
            progress.step += 1;
            progress.steps += 1;
            let steps = progress.steps;
            team.runtime.block_on(replicas.check_parameters(steps, || {
                relay_llm::sft::var_values(self.trainable).expect("trainable weights read back")
            }))?;
            let progress = &mut work.progress;
            if progress.step == steps_per_epoch {
                let stats = std::mem::take(&mut progress.epoch_stats);
                let epoch = progress.epoch;
                let report =
                    self.epoch_report(work.trainer, epoch, &stats, epoch_started, leads)?;
                let progress = &mut work.progress;
                progress.epochs.push(report);
                progress.truncated = stats.iter().map(|s| s.truncated).sum();
                progress.epoch += 1;
                progress.step = 0;
            }
        }
    }

    /// The figures of epoch `epoch` (from 0), held-out loss included; rank
    /// 0 (`print`) prints them as a row.
    fn epoch_report(
        &self,
        trainer: &mut SftTrainer,
        epoch: usize,
        stats: &[SftStats],
        started: Instant,
        print: bool,
    ) -> Result<EpochReport> {
        let (train_loss, train_token_accuracy) = mean_stats(stats);
        let held = if self.holdout.is_empty() {
            None
        } else {
            Some(trainer.evaluate(self.model, self.adapter, self.holdout)?)
        };
        let report = EpochReport {
            epoch: epoch + 1,
            steps: stats.len(),
            train_loss,
            train_token_accuracy,
            holdout_loss: held.map(|s| s.loss),
            holdout_token_accuracy: held.map(|s| s.token_accuracy),
            seconds: started.elapsed().as_secs_f64(),
        };
        if print {
            let optional =
                |v: Option<f64>| v.map(|v| format!("{v:.4}")).unwrap_or_else(|| "-".into());
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
        }
        Ok(report)
    }
}

/// Epoch `epoch`'s order of `examples`: a function of the seed and the
/// epoch alone, so that every replica, one that joins late included,
/// trains the same batches.
fn epoch_order(examples: &[SftExample], seed: u64, epoch: usize) -> Vec<SftExample> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    rng.set_stream(epoch as u64 + 1);
    let mut order = examples.to_vec();
    order.shuffle(&mut rng);
    order
}

/// This process's place among the replicas of one training, and what it
/// started for them: on one machine without `--nats`, the nats-server and
/// the other replicas (rank 0 is this process, which joins first).
struct Team {
    runtime: tokio::runtime::Runtime,
    replicas: Replicas,
    shutdown: relay_kit::Shutdown,
    /// Keeps `shutdown` from firing.
    _trigger: relay_kit::ShutdownTrigger,
    /// The group and NATS, for the heading.
    joined: Option<(String, String)>,
    /// The other replicas this process started, then the nats-server they
    /// share (dropped in that order).
    children: Vec<std::process::Child>,
    _nats: Option<crate::stack::LocalNats>,
}

impl Team {
    /// Joins the group (`--replicas` above 1 or `--nats`), starting the
    /// nats-server and the other replicas on this machine without
    /// `--nats`; or trains alone.
    fn start(args: &ReplicaArgs) -> Result<Self> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()?;
        let (trigger, shutdown) = relay_kit::Shutdown::new();
        let member = format!(
            "sft-{}-{}-{:08x}",
            hostname(),
            std::process::id(),
            rand::random::<u32>()
        );
        let mut team = Self {
            replicas: Replicas::single(member.clone()),
            runtime,
            shutdown,
            _trigger: trigger,
            joined: None,
            children: Vec::new(),
            _nats: None,
        };
        if args.replicas == 1 && args.nats.is_none() {
            return Ok(team);
        }
        let (nats_url, local) = match &args.nats {
            Some(url) => (url.clone(), false),
            None => {
                let nats = crate::stack::LocalNats::start(
                    &std::env::temp_dir().join(format!("relay-sft-{}", std::process::id())),
                    &args.group,
                )?;
                let url = nats.url.clone();
                team._nats = Some(nats);
                (url, true)
            }
        };
        let nats = team
            .runtime
            .block_on(async_nats::connect(&nats_url))
            .with_context(|| format!("--nats {nats_url}"))?;
        if !nats.server_info().jetstream {
            bail!("--nats {nats_url} has no JetStream, through which the replicas agree (start nats-server with -js)");
        }
        let listen = match &args.listen {
            Some(listen) => listen
                .parse()
                .with_context(|| format!("--listen {listen:?}: an address such as 10.0.0.5:0"))?,
            None => {
                let mut listen = relay_kit::weights::listen_address(
                    &relay_config::WeightsSection::default(),
                    &nats_url,
                )?;
                listen.set_port(0);
                listen
            }
        };
        let config = relay_kit::collective::GroupConfig::new(&args.group, member, listen);
        team.replicas = team.runtime.block_on(Replicas::join_group(&nats, config))?;
        if local {
            // Every other replica is this command again, joined to this NATS.
            let mut own: Vec<String> = std::env::args().skip(1).collect();
            if own.first().map(String::as_str) != Some("sft") {
                bail!("--replicas without --nats starts `relay sft` again for each replica; from a library, give --nats");
            }
            own.extend(["--nats".into(), nats_url.clone()]);
            for _ in 1..args.replicas {
                team.children.push(
                    std::process::Command::new(std::env::current_exe()?)
                        .args(&own)
                        .stdout(std::process::Stdio::null())
                        .spawn()
                        .context("starting a replica")?,
                );
            }
        }
        team.joined = Some((args.group.clone(), nats_url));
        Ok(team)
    }

    /// Waits until `--replicas` replicas have joined.
    fn wait_for_all(&mut self, args: &ReplicaArgs) -> Result<()> {
        let Some((group, url)) = &self.joined else {
            return Ok(());
        };
        let within = std::time::Duration::from_secs(args.join_timeout);
        self.runtime
            .block_on(
                self.replicas
                    .wait_for(args.replicas, within, &self.shutdown),
            )
            .with_context(|| format!("group {group} at {url}"))
    }

    /// Whether this process is rank 0: it evaluates, prints and writes.
    fn leads(&self) -> bool {
        self.replicas.leads()
    }

    /// The heading's words on the replicas.
    fn describe(&self) -> String {
        match &self.joined {
            Some((group, url)) => format!(
                " as {} data-parallel replicas (group {group} at {url})",
                self.replicas.share().1
            ),
            None => String::new(),
        }
    }

    /// Leaves the group and waits for the replicas this process started
    /// (rank 0 told them to stop), saying which failed.
    fn finish(&mut self) {
        let replicas = std::mem::replace(&mut self.replicas, Replicas::single(String::new()));
        self.runtime.block_on(replicas.leave());
        for child in &mut self.children {
            match child.wait() {
                Ok(status) if status.success() => {}
                Ok(status) => eprintln!("relay sft: a replica exited with {status}"),
                Err(e) => eprintln!("relay sft: waiting for a replica: {e}"),
            }
        }
        self.children.clear();
    }
}

impl Drop for Team {
    /// A failure of this process ends the replicas it started.
    fn drop(&mut self) {
        for child in &mut self.children {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// This machine's name, for replica ids.
fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_else(|_| "host".into())
}
