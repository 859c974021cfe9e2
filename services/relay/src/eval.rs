//! `relay eval use <name> [--set key=value]...`: publishes an `EvalControl`
//! on `relay.<run>.eval.control`; every running evaluator copy switches to
//! that plugin (or logs and counts a refusal) without restarting.
//!
//! `relay eval checkpoint <run>[:best|last|solved|N] [--episodes 100]
//! [--seed S]`: plays a saved checkpoint offline. Text runs: the
//! checkpoint's adapter against the bots ([`evaluate_text_checkpoint`]).
//! Classic runs: with the actions of the run's evaluator, sampled (drawn
//! from the seed) when it is `stochastic` (rl-zoo's way for Atari, whose
//! deterministic policies can stall), deterministic otherwise (one episode
//! per sub-env of a vectorized env seeded `S, S+1, ...`, each to its end), and
//! prints mean ± std, min and max, then a JSON line. The default seed is
//! the run's fresh one (`eval.seed + 2^48`), which no evaluation of the
//! run played; `--seed <eval.seed> --episodes <eval.episodes>` replays the
//! evaluator's screening of the version the checkpoint holds, and the
//! report's confirmation seed and episodes its confirmation, to the same
//! figure.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use relay_proto::{EvalControl, Subjects, SCHEMA_VERSION};

/// Flags of `relay eval`.
#[derive(Debug, Clone, clap::Args)]
pub struct EvalArgs {
    #[command(subcommand)]
    pub command: EvalCommand,
}

/// `relay eval <command>`.
#[derive(Debug, Clone, clap::Subcommand)]
pub enum EvalCommand {
    /// Play a checkpoint offline: mean ± std, min, max and a JSON line (text runs: games against the bots).
    Checkpoint {
        /// `<run>[:best|last|solved|N]`: run id (or `@last`) and checkpoint (default `best`).
        checkpoint: String,
        /// Episodes to play.
        #[arg(long, default_value_t = 100)]
        episodes: usize,
        /// First seed of the episodes (default: the run's fresh seed, `eval.seed + 2^48`, which no evaluation played).
        #[arg(long)]
        seed: Option<u64>,
        /// Runs evaluated by `vs-opponent` on a game on observations: play these opponents (comma list, e.g. `random,minimax` or `checkpoint:<folder>`) instead of the run's.
        #[arg(long)]
        opponents: Option<String>,
        /// Folder holding the runs.
        #[arg(long, env = "RELAY_RUNS_DIR", default_value = "runs")]
        runs_dir: PathBuf,
    },
    /// Switch the running evaluators to plugin NAME (greedy, stochastic, threshold, record).
    Use {
        /// Plugin name.
        name: String,
        /// Plugin option `key=value` (repeatable), e.g. `--set level=150`.
        #[arg(long = "set", value_name = "KEY=VALUE")]
        options: Vec<String>,
        /// Run id; defaults to the run of `<state-dir>/stack.json`.
        #[arg(long)]
        run_id: Option<String>,
        /// NATS URL; defaults to the one of `<state-dir>/stack.json`.
        #[arg(long)]
        nats_url: Option<String>,
        /// Folder holding the stack's state.
        #[arg(long, default_value = ".relay")]
        state_dir: PathBuf,
    },
}

/// Parses `key=value` options.
pub fn parse_options(options: &[String]) -> Result<Vec<(String, String)>> {
    options
        .iter()
        .map(|o| match o.split_once('=') {
            Some((k, v)) if !k.trim().is_empty() => Ok((k.trim().to_string(), v.to_string())),
            _ => bail!("--set {o:?}: expected key=value"),
        })
        .collect()
}

/// Connects to NATS and publishes the control message.
pub async fn send(nats_url: &str, run_id: &str, control: &EvalControl) -> Result<()> {
    let client = async_nats::connect(nats_url)
        .await
        .with_context(|| format!("connecting to {nats_url}"))?;
    publish(&client, run_id, control).await
}

/// Publishes the control message to run `run_id`'s evaluators over
/// `client` and flushes it.
pub async fn publish(
    client: &async_nats::Client,
    run_id: &str,
    control: &EvalControl,
) -> Result<()> {
    client
        .publish(
            Subjects::new(run_id).eval_control(),
            relay_proto::encode(control).into(),
        )
        .await?;
    client.flush().await?;
    Ok(())
}

/// What `relay eval checkpoint` measured.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct CheckpointEval {
    pub run_id: String,
    /// The checkpoint folder's number.
    pub checkpoint: String,
    /// The weights version the checkpoint holds.
    pub weights_version: u64,
    pub env_id: String,
    pub episodes: usize,
    pub seed: u64,
    /// `greedy` (deterministic actions) or `sampled`, as the run's evaluator.
    pub actions: &'static str,
    pub returns: Vec<f64>,
    pub mean_return: f64,
    pub std_return: f64,
    pub min_return: f64,
    pub max_return: f64,
    /// `vs-opponent` runs of games on observations: the results per
    /// opponent and seat (the returns are then the plugin's scores).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub matchups: Vec<relay_proto::Matchup>,
    /// `vs-opponent` runs of games on observations: the lowest mean of a
    /// matchup, what such a run is judged by.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub weakest_matchup_mean: Option<f64>,
    /// The run's solved threshold, when it has one.
    pub threshold: Option<f64>,
    /// `mean_return` (`weakest_matchup_mean` where there is one) `>= threshold`.
    pub passed: Option<bool>,
}

/// Plays `episodes` episodes from `seed` (default: the run's fresh seed)
/// with checkpoint `which` of run `run`, acting as the run's evaluator.
pub fn evaluate_checkpoint(
    runs_dir: &Path,
    run: &str,
    which: &str,
    episodes: usize,
    seed: Option<u64>,
) -> Result<CheckpointEval> {
    evaluate_checkpoint_against(runs_dir, run, which, episodes, seed, None)
}

/// [`evaluate_checkpoint`], for a run whose evaluator is `vs-opponent`
/// against `opponents` (its option: a comma list) instead of the run's.
pub fn evaluate_checkpoint_against(
    runs_dir: &Path,
    run: &str,
    which: &str,
    episodes: usize,
    seed: Option<u64>,
    opponents: Option<&str>,
) -> Result<CheckpointEval> {
    let (run_id, dir, config) = resolve(runs_dir, run, which)?;
    if config.is_text_game() {
        bail!("{run_id} is a text-game run: its checkpoints play games (evaluate_text_checkpoint), not episodes");
    }
    let config = against(config, opponents)?;
    evaluate_classic_checkpoint(run_id, &dir, &config, episodes, seed)
}

/// `config` with its `vs-opponent` evaluator playing `opponents` (when
/// given) instead of its own.
fn against(
    mut config: relay_config::ExperimentConfig,
    opponents: Option<&str>,
) -> Result<relay_config::ExperimentConfig> {
    if let Some(opponents) = opponents {
        if config.eval.evaluator != "vs-opponent" {
            bail!(
                "--opponents: the run is evaluated by {}, which plays no opponents",
                config.eval.evaluator
            );
        }
        config.eval.options.insert(
            "opponents".into(),
            serde_yaml::Value::String(opponents.into()),
        );
    }
    Ok(config)
}

/// A run's checkpoint `which`: the run id, the folder and its config.
pub fn resolve(
    runs_dir: &Path,
    run: &str,
    which: &str,
) -> Result<(String, PathBuf, relay_config::ExperimentConfig)> {
    let (run_id, _, dir) = crate::checkpoints::resolve(runs_dir, run, which)?;
    let config = crate::play::read_resolved_config(&dir.join("config.yaml"))?;
    Ok((run_id, dir, config))
}

/// [`evaluate_checkpoint`] of a resolved classic checkpoint.
fn evaluate_classic_checkpoint(
    run_id: String,
    dir: &Path,
    config: &relay_config::ExperimentConfig,
    episodes: usize,
    seed: Option<u64>,
) -> Result<CheckpointEval> {
    if episodes == 0 {
        bail!("--episodes must be at least 1");
    }
    let state = relay_runs::checkpoint::load_state(dir)?;
    let (model, normalizer) = crate::play::load_policy(config, dir)?;
    let seed = seed.unwrap_or_else(|| config.eval.fresh_seed());
    let plugin = relay_eval::plugins::build(&config.eval.evaluator, &config.eval.option_pairs())
        .map_err(|e| anyhow::anyhow!("eval.evaluator: {e}"))?;
    let deterministic = !plugin.samples_actions();
    let weights_version = state.weights_version.unwrap_or(state.progress.version);
    let envs = relay_eval::plugins::eval_envs(&config.run.env_id, &config.env, episodes, seed)
        .map_err(anyhow::Error::msg)?;
    let (returns, matchups, figure) = if plugin.name() == "vs-opponent" {
        // A multi-agent game on observations: the run's opponents, the
        // games shared out among the seats, judged by the weakest matchup.
        let policy = relay_policy::VersionedPolicy {
            version: weights_version,
            learner_env_steps: state.progress.env_steps,
            model,
            normalizer,
        };
        let ctx = relay_eval::plugins::EvalContext {
            env_id: config.run.env_id.clone(),
            episodes,
            seed,
            run_dir: dir.to_path_buf(),
            train_return: None,
            confirming: true,
            env: config.env.clone(),
            cancel: Default::default(),
        };
        match plugin.evaluate(&policy, &ctx).map_err(anyhow::Error::msg)? {
            relay_eval::plugins::EvalOutcome::Games {
                returns,
                matchups,
                matchup_of,
                ..
            } => {
                let weakest = relay_eval::weakest_matchup(&returns, &matchup_of, 0.0)
                    .map_or(f64::NAN, |(mean, _, _)| mean);
                (returns, matchups, Some(weakest))
            }
            other => bail!("vs-opponent played no games: {other:?}"),
        }
    } else {
        let returns: Vec<f64> = relay_eval::plugins::play(
            &model,
            normalizer.as_ref(),
            envs,
            seed,
            deterministic,
            false,
        )
        .map_err(anyhow::Error::msg)?
        .into_iter()
        .map(|e| e.ret)
        .collect();
        (returns, Vec::new(), None)
    };
    let (mean, std) = relay_eval::mean_std(&returns);
    let threshold = config.solved_threshold();
    let judged = figure.unwrap_or(mean);
    Ok(CheckpointEval {
        run_id,
        checkpoint: dir
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default(),
        weights_version,
        env_id: config.run.env_id.clone(),
        episodes,
        seed,
        actions: if deterministic { "greedy" } else { "sampled" },
        min_return: returns.iter().copied().fold(f64::INFINITY, f64::min),
        max_return: returns.iter().copied().fold(f64::NEG_INFINITY, f64::max),
        returns,
        mean_return: mean,
        std_return: std,
        weakest_matchup_mean: figure,
        matchups,
        threshold,
        passed: threshold.map(|t| judged >= t),
    })
}

/// The results against one bot of a text checkpoint's offline games.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct TextMatchup {
    pub opponent: String,
    pub games: u32,
    pub wins: u32,
    pub draws: u32,
    pub losses: u32,
    /// Share of the model's moves the game accepted.
    pub legal_move_rate: f64,
}

/// A text run's checkpoint played against bots: [`play_text_adapter`]
/// with the checkpoint's adapter, and a JSON report of it.
pub fn evaluate_text_checkpoint(
    run_id: &str,
    dir: &Path,
    config: &relay_config::ExperimentConfig,
    episodes: usize,
    seed: u64,
) -> Result<serde_json::Value> {
    let state = relay_runs::checkpoint::load_state(dir)?;
    let adapter = dir.join(relay_runs::checkpoint::ADAPTER_DIR);
    let played = play_text_adapter(config, Some(&adapter), episodes, seed)?;
    let (mean, std) = relay_eval::mean_std(&played.rewards);
    Ok(serde_json::json!({
        "run_id": run_id,
        "checkpoint": dir.file_name().map(|n| n.to_string_lossy().into_owned()),
        "weights_version": state.weights_version.unwrap_or(state.progress.version),
        "env_id": config.run.env_id,
        "episodes": episodes,
        "seed": seed,
        "mean_return": mean,
        "std_return": std,
        "matchups": played.matchups,
    }))
}

/// What [`play_text_adapter`] played.
#[derive(Debug, Clone, PartialEq)]
pub struct TextGamesPlayed {
    /// One per bot, in the order played.
    pub matchups: Vec<TextMatchup>,
    /// The model's reward of each game, in the order played.
    pub rewards: Vec<f64>,
}

/// Plays a text run's base model with the PEFT `adapter` (none: the base
/// model alone) against bots, in this process, as the run's `vs-opponent`
/// evaluations play by default: greedy, `episodes` games per bot, the
/// first half in seat 0, game `i` seeded `seed + i`, prompted and read as
/// the run's `text` section says. The bots are the run's
/// `eval.options.opponents` that are bots, else `random` (and `minimax` or
/// `connect_four_bot` where they play). The model decodes here, not in a
/// batched inference server, so a figure can differ from the evaluator's
/// by the batches' rounding.
pub fn play_text_adapter(
    config: &relay_config::ExperimentConfig,
    adapter: Option<&Path>,
    episodes: usize,
    seed: u64,
) -> Result<TextGamesPlayed> {
    let env_id = config.run.env_id.clone();
    let model = config
        .llm
        .model
        .clone()
        .context("the run's config names no llm.model")?;
    let mut player = crate::play_text::Player::new(
        &model,
        adapter,
        0.0,
        config.text.max_turn_tokens as usize,
        seed,
    )?
    .with_prompting(config.text.system_prompt.clone(), config.text.observation)
    .with_run_text(
        relay_envs::AnswerReader::new(&config.text.answer).map_err(anyhow::Error::msg)?,
        config.llm.chat_template_kwargs.clone(),
    );
    let listed: Vec<String> = config
        .eval
        .options
        .get("opponents")
        .and_then(|v| v.as_str())
        .map(|list| list.split(',').map(|o| o.trim().to_string()).collect())
        .unwrap_or_default();
    let mut bots: Vec<String> = listed
        .into_iter()
        .filter(|b| relay_config::bot_plays(b, &env_id, &config.env))
        .collect();
    if bots.is_empty() {
        bots = ["random", "minimax", "connect_four_bot"]
            .into_iter()
            .filter(|b| relay_config::bot_plays(b, &env_id, &config.env))
            .map(str::to_string)
            .collect();
    }
    let players = relay_bridge::make_text_game(&env_id, &config.env)?.num_players();
    let mut rewards = Vec::new();
    let mut matchups = Vec::new();
    for bot in &bots {
        let mut m = TextMatchup {
            opponent: bot.clone(),
            ..Default::default()
        };
        let (mut moves, mut invalid) = (0u32, 0u32);
        for i in 0..episodes {
            let seat = if players == 1 {
                0
            } else {
                usize::from(i >= episodes.div_ceil(2))
            };
            let game = crate::play_text::play_game(
                relay_bridge::make_text_game(&env_id, &config.env)?,
                &mut player,
                seat,
                bot,
                seed.wrapping_add(i as u64),
                &mut std::io::empty(),
                &mut std::io::sink(),
            )?;
            match relay_policy::text::Outcome::of(&game.rewards, seat) {
                relay_policy::text::Outcome::Win => m.wins += 1,
                relay_policy::text::Outcome::Draw => m.draws += 1,
                relay_policy::text::Outcome::Loss => m.losses += 1,
            }
            m.games += 1;
            moves += game.model_moves;
            invalid += game.model_invalid_moves;
            rewards.push(game.rewards[seat]);
        }
        m.legal_move_rate = if moves == 0 {
            1.0
        } else {
            1.0 - f64::from(invalid) / f64::from(moves)
        };
        matchups.push(m);
    }
    Ok(TextGamesPlayed { matchups, rewards })
}

/// `relay eval`.
pub fn eval(args: EvalArgs) -> Result<()> {
    let (name, options, run_id, nats_url, state_dir) = match args.command {
        EvalCommand::Checkpoint {
            checkpoint,
            episodes,
            seed,
            opponents,
            runs_dir,
        } => {
            let (run, which) = checkpoint.split_once(':').unwrap_or((&checkpoint, "best"));
            let (run_id, dir, config) = resolve(&runs_dir, run, which)?;
            if config.is_text_game() && opponents.is_some() {
                bail!("--opponents: text runs play the bots of their config");
            }
            if config.is_text_game() {
                let seed = seed.unwrap_or_else(|| config.eval.fresh_seed());
                let e = evaluate_text_checkpoint(&run_id, &dir, &config, episodes, seed)?;
                println!(
                    "relay: {run_id} checkpoint {} (adapter version {}) on {}: {episodes} greedy games per bot from seed {seed}",
                    e["checkpoint"].as_str().unwrap_or("?"),
                    e["weights_version"],
                    e["env_id"].as_str().unwrap_or("?"),
                );
                for m in e["matchups"].as_array().into_iter().flatten() {
                    println!(
                        "vs {}: W/D/L {}/{}/{}  legal moves {:.1} %",
                        m["opponent"].as_str().unwrap_or("?"),
                        m["wins"],
                        m["draws"],
                        m["losses"],
                        100.0 * m["legal_move_rate"].as_f64().unwrap_or(f64::NAN)
                    );
                }
                println!(
                    "reward {:.3} ± {:.3}",
                    e["mean_return"].as_f64().unwrap_or(f64::NAN),
                    e["std_return"].as_f64().unwrap_or(f64::NAN)
                );
                println!("{e}");
                return Ok(());
            }
            let config = against(config, opponents.as_deref())?;
            let e = evaluate_classic_checkpoint(run_id, &dir, &config, episodes, seed)?;
            println!(
                "relay: {} checkpoint {} (weights version {}) on {}: {} {} episodes from seed {}",
                e.run_id, e.checkpoint, e.weights_version, e.env_id, e.episodes, e.actions, e.seed
            );
            for m in &e.matchups {
                println!(
                    "vs {} from seat {}: W/D/L {}/{}/{}",
                    m.opponent, m.seat, m.wins, m.draws, m.losses
                );
            }
            if let Some(weakest) = e.weakest_matchup_mean {
                println!("weakest matchup {weakest:.3}");
            }
            println!(
                "return {:.2} ± {:.2}  min {:.2}  max {:.2}{}",
                e.mean_return,
                e.std_return,
                e.min_return,
                e.max_return,
                match (e.threshold, e.passed) {
                    (Some(t), Some(p)) =>
                        format!("  threshold {t}: {}", if p { "met" } else { "not met" }),
                    _ => String::new(),
                }
            );
            let mut json = serde_json::to_value(&e)?;
            json.as_object_mut().expect("an object").remove("returns");
            println!("{json}");
            return Ok(());
        }
        EvalCommand::Use {
            name,
            options,
            run_id,
            nats_url,
            state_dir,
        } => (name, options, run_id, nats_url, state_dir),
    };
    let options = parse_options(&options)?;
    // Refuse here what every evaluator would refuse.
    relay_eval::plugins::build(&name, &options).map_err(anyhow::Error::msg)?;
    let record = || -> Result<crate::stack::StackRecord> {
        let path = state_dir.join("stack.json");
        let text = std::fs::read_to_string(&path)
            .with_context(|| format!("no running stack recorded in {}", path.display()))?;
        Ok(serde_json::from_str(&text)?)
    };
    // `@last` is the run of the recorded stack.
    let run_id = run_id.filter(|r| r != "@last");
    let (run_id, nats_url) = match (run_id, nats_url) {
        (Some(r), Some(n)) => (r, n),
        (r, n) => {
            let rec = record()?;
            (r.unwrap_or(rec.run_id), n.unwrap_or(rec.nats_url))
        }
    };
    relay_proto::validate_run_id(&run_id).map_err(anyhow::Error::msg)?;
    let control = EvalControl {
        schema: SCHEMA_VERSION,
        evaluator: name.clone(),
        options,
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    runtime.block_on(send(&nats_url, &run_id, &control))?;
    println!("relay: evaluators of {run_id} switch to {name}");
    Ok(())
}
