//! `relay play <run|@last> [--checkpoint best|last|N] [--episodes 1]`: loads
//! a checkpoint's policy and plays episodes of the run's env with its
//! deterministic actions, printing one text frame per step (CartPole: the
//! track with the cart and the lean of its pole; other envs: the
//! observation vector), then the returns.

use std::path::PathBuf;

use anyhow::{Context, Result};
use relay_kit::ExperimentConfig;
use relay_nn::ActorCritic;

/// Flags of `relay play`.
#[derive(Debug, Clone, clap::Args)]
pub struct PlayArgs {
    /// Run id, or `@last` for the newest run.
    pub run: String,
    /// Which checkpoint: `last`, `best` or a number.
    #[arg(long, default_value = "last")]
    pub checkpoint: String,
    /// Episodes to play.
    #[arg(long, default_value_t = 1)]
    pub episodes: usize,
    /// Seed of the episodes.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Folder holding the runs.
    #[arg(long, env = "RELAY_RUNS_DIR", default_value = "runs")]
    pub runs_dir: PathBuf,
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
    let (id, _, dir) = crate::checkpoints::resolve(&args.runs_dir, &args.run, &args.checkpoint)?;
    let config_path = dir.join("config.yaml");
    let text = std::fs::read_to_string(&config_path)
        .with_context(|| format!("reading {}", config_path.display()))?;
    let config =
        ExperimentConfig::from_layers(&text, &config_path.display().to_string(), &[], &[])?;
    let spec = relay_policy::spec_for(&config)?;
    let mut model = ActorCritic::new(&spec, config.run.seed)?;
    model
        .load(dir.join("model.safetensors"))
        .with_context(|| format!("loading {}", dir.display()))?;
    let env_id = config.run.env_id.clone();
    println!("relay: {id} checkpoint {} on {env_id}", dir.display());
    let episodes = relay_evaluator::plugins::play(
        &model,
        &env_id,
        args.episodes.max(1),
        args.seed,
        true,
        true,
    )
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
