//! `relay play <run|@last> [--checkpoint best|last|N] [--episodes 1]`: loads
//! a checkpoint's policy and plays episodes of the run's env with its
//! deterministic actions, printing one text frame per step (CartPole: the
//! track with the cart and the lean of its pole; other envs: the
//! observation vector), then the returns.
//!
//! For the text games (TicTacToe-v0, ConnectFour-v0, KuhnPoker-v0, ...) the
//! checkpoint's language model plays against you at the terminal or a bot
//! ([`crate::play_text`]); `--env` and `--model` play a model without a run.
//! For multi-agent games on observations (PettingZoo's) the checkpoint's
//! greedy policy plays against you or a fixed opponent
//! ([`crate::play_seats`]).

use std::path::PathBuf;

use anyhow::{Context, Result};
use relay_config::ExperimentConfig;

/// Flags of `relay play`.
#[derive(Debug, Clone, clap::Args)]
pub struct PlayArgs {
    /// Run id, or `@last` for the newest run (text games: optional with `--env` and `--model`).
    pub run: Option<String>,
    /// Which checkpoint: `last`, `best` or a number.
    #[arg(long, default_value = "last")]
    pub checkpoint: String,
    /// Episodes to play.
    #[arg(long, default_value_t = 1)]
    pub episodes: usize,
    /// Seed of the episodes.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// --env is a TextArena id (any of its registry), played through the env bridge.
    #[arg(long)]
    pub textarena: bool,
    /// Folder holding the runs.
    #[arg(long, env = "RELAY_RUNS_DIR", default_value = "runs")]
    pub runs_dir: PathBuf,
    /// Text games: the game to play when no run is given (e.g. TicTacToe-v0).
    #[arg(long)]
    pub env: Option<String>,
    /// Text games: the model (a Hugging Face folder, a .gguf file or `smollm2`); default the run's `llm.model`.
    #[arg(long)]
    pub model: Option<String>,
    /// Text games: a PEFT adapter folder; default the checkpoint's `adapter/` when it has one.
    #[arg(long)]
    pub adapter: Option<PathBuf>,
    /// Text games and multi-agent games on observations: who plays the model: `human` (you, at the terminal), `random`, `minimax`, `connect_four_bot`, `checkpoint:<folder>` (games on observations).
    #[arg(long, default_value = "human")]
    pub opponent: String,
    /// Text games and multi-agent games on observations: the model's seat (player 0 moves first).
    #[arg(long, default_value_t = 1)]
    pub model_seat: usize,
    /// Text games: sampling temperature of the model's moves (0: greedy).
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    /// Text games: most tokens the model may generate per move.
    #[arg(long, default_value_t = 16)]
    pub max_tokens: usize,
}

/// A run's or checkpoint's resolved `config.yaml`, as it was written (no
/// environment overrides).
pub fn read_resolved_config(path: &std::path::Path) -> Result<ExperimentConfig> {
    relay_policy::opponent::read_resolved_config(path).map_err(anyhow::Error::msg)
}

/// `relay play` of a text game: the model (and the checkpoint's adapter)
/// against `--opponent`, `--episodes` games, seats as `--model-seat` says;
/// the run's config (if any) supplies `llm.model` and `text.system_prompt`.
fn play_text_games(
    args: &PlayArgs,
    env_id: &str,
    config: Option<&ExperimentConfig>,
    checkpoint: Option<&std::path::Path>,
) -> Result<()> {
    let model = args
        .model
        .clone()
        .or_else(|| config.and_then(|c| c.llm.model.clone()))
        .context("no model: give --model (a Hugging Face folder, a .gguf file or smollm2)")?;
    let adapter = args.adapter.clone().or_else(|| {
        checkpoint
            .map(|c| c.join("adapter"))
            .filter(|a| a.join("adapter_config.json").exists())
    });
    println!(
        "relay: {env_id}, model {model}{}, against {}",
        adapter
            .as_ref()
            .map(|a| format!(" with adapter {}", a.display()))
            .unwrap_or_default(),
        args.opponent
    );
    let mut player = crate::play_text::Player::new(
        &model,
        adapter.as_deref(),
        args.temperature,
        args.max_tokens,
        args.seed,
    )?
    .with_prompting(
        config.and_then(|c| c.text.system_prompt.clone()),
        config.map(|c| c.text.observation).unwrap_or_default(),
    );
    if let Some(config) = config {
        player = player.with_run_text(
            relay_envs::AnswerReader::new(&config.text.answer).map_err(anyhow::Error::msg)?,
            config.llm.chat_template_kwargs.clone(),
        );
    }
    let stdin = std::io::stdin();
    let mut input = stdin.lock();
    let mut out = std::io::stdout();
    let mut totals = Vec::new();
    let section = config.map_or_else(
        || crate::sft::text_section(args.textarena),
        |c| c.env.clone(),
    );
    for game in 0..args.episodes.max(1) {
        println!("game {game}");
        let game = crate::play_text::play_game(
            relay_bridge::make_text_game(env_id, &section)?,
            &mut player,
            args.model_seat,
            &args.opponent,
            args.seed.wrapping_add(game as u64),
            &mut input,
            &mut out,
        )?;
        totals.push(
            game.rewards
                .get(args.model_seat)
                .copied()
                .unwrap_or(f64::NAN),
        );
    }
    let returns: Vec<String> = totals.iter().map(|r| format!("{r:.1}")).collect();
    println!("model rewards: {}", returns.join(" "));
    Ok(())
}

/// The acting model saved in a classic run's checkpoint folder `dir`, and
/// its frozen normaliser ([`relay_policy::opponent::load_checkpoint_policy`]).
pub fn load_policy(
    config: &ExperimentConfig,
    dir: &std::path::Path,
) -> Result<(relay_policy::PolicyModel, Option<relay_nn::VecNormalize>)> {
    relay_policy::opponent::load_checkpoint_policy(config, dir).map_err(anyhow::Error::msg)
}

/// One CartPole frame: the track `[-2.4, 2.4]` with the cart and its pole.
pub fn cartpole_frame(obs: &[f32]) -> String {
    const WIDTH: usize = 41;
    let (x, theta) = (obs[0] as f64, obs[2] as f64);
    let pos = (((x + 2.4) / 4.8) * (WIDTH - 1) as f64)
        .round()
        .clamp(0.0, (WIDTH - 1) as f64) as usize;
    let pole = if theta > 0.05 {
        '/'
    } else if theta < -0.05 {
        '\\'
    } else {
        '|'
    };
    let mut track: Vec<char> = vec!['_'; WIDTH];
    track[pos] = pole;
    let track: String = track.into_iter().collect();
    format!("|{track}| x {x:+.2} theta {theta:+.3}")
}

/// `relay play`.
pub fn play(args: PlayArgs) -> Result<()> {
    let Some(run) = args.run.clone() else {
        let env = args
            .env
            .clone()
            .context("give a run (or @last), or --env and --model for a text game")?;
        if !crate::sft::text_section(args.textarena).is_text_game(&env) {
            anyhow::bail!(
                "--env {env:?}: without a run only text games can be played (relay's: {}; add --textarena for a TextArena id)",
                relay_envs::TEXT_GAME_IDS.join(", ")
            );
        }
        return play_text_games(&args, &env, None, None);
    };
    let (id, run_dir) = crate::runs::resolve_run_dir(&args.runs_dir, &run)?;
    let checkpoint = crate::checkpoints::resolve(&args.runs_dir, &id, &args.checkpoint);
    // A text-game run may have no checkpoint yet: its base model still plays.
    let dir = match checkpoint {
        Ok((_, _, dir)) => dir,
        Err(e) => {
            let config = read_resolved_config(&run_dir.join("config.yaml")).ok();
            match config {
                Some(config) if config.is_text_game() => {
                    println!("relay: {id} has no checkpoint yet; its base model plays");
                    return play_text_games(&args, &config.run.env_id, Some(&config), None);
                }
                _ => return Err(e),
            }
        }
    };
    let config = read_resolved_config(&dir.join("config.yaml"))?;
    if config.is_text_game() {
        return play_text_games(&args, &config.run.env_id, Some(&config), Some(&dir));
    }
    let env_id = config.run.env_id.clone();
    println!("relay: {id} checkpoint {} on {env_id}", dir.display());
    if !config.env_spec()?.agents.is_empty() {
        let games = crate::play_seats::play_seat_games(
            &config,
            &dir,
            args.model_seat,
            &args.opponent,
            args.episodes,
            args.seed,
            &mut std::io::stdin().lock(),
            &mut std::io::stdout(),
        )?;
        let returns: Vec<String> = games
            .iter()
            .map(|g| format!("{:.1}", g.returns[args.model_seat]))
            .collect();
        println!("model returns: {}", returns.join(" "));
        return Ok(());
    }
    let (model, normalizer) = load_policy(&config, &dir)?;
    let envs =
        relay_eval::plugins::eval_envs(&env_id, &config.env, args.episodes.max(1), args.seed)
            .map_err(anyhow::Error::msg)?;
    let episodes =
        relay_eval::plugins::play(&model, normalizer.as_ref(), envs, args.seed, true, true)
            .map_err(anyhow::Error::msg)?;
    for (i, e) in episodes.iter().enumerate() {
        println!("episode {i}");
        let t = e.trajectory.as_ref().expect("recorded");
        for (step, obs) in t.obs.iter().enumerate() {
            let frame = if env_id.starts_with("CartPole") {
                cartpole_frame(obs)
            } else {
                format!("{obs:?}")
            };
            println!(
                "{step:>5} {frame} action {:?} reward {}",
                t.actions[step], t.rewards[step]
            );
        }
    }
    let returns: Vec<String> = episodes.iter().map(|e| format!("{:.1}", e.ret)).collect();
    println!("returns: {}", returns.join(" "));
    Ok(())
}
