//! `relay checkpoints ls|pin <run>`: a run's checkpoints
//! (`runs/<id>/checkpoints/<n>/`, written by the learner; see
//! `relay_runs::checkpoint` for their contents and the keep policy), and
//! [`resolve`], which `relay up --resume/--init-from`, `relay play` and
//! `relay eval checkpoint` use to turn `<run|@last>` and `best|last|solved|N`
//! into a checkpoint folder.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use relay_runs::checkpoint;

/// The default runs folder (`run.runs_dir` of the configs).
const DEFAULT_RUNS_DIR: &str = "runs";

/// Flags of `relay checkpoints`.
#[derive(Debug, Clone, clap::Args)]
pub struct CheckpointsArgs {
    #[command(subcommand)]
    pub command: CheckpointsCommand,
}

/// `relay checkpoints <command>`.
#[derive(Debug, Clone, clap::Subcommand)]
pub enum CheckpointsCommand {
    /// List a run's checkpoints: number, version, env steps, best eval, links, pinned.
    Ls {
        /// Run id, or `@last` for the newest run.
        run: String,
        /// Folder holding the runs.
        #[arg(long, env = "RELAY_RUNS_DIR", default_value = DEFAULT_RUNS_DIR)]
        runs_dir: PathBuf,
    },
    /// Keep checkpoint N whatever `ppo.keep_checkpoints` says.
    Pin {
        /// Run id, or `@last` for the newest run.
        run: String,
        /// Checkpoint number (`relay checkpoints ls` lists them), or `best`/`last`.
        checkpoint: String,
        /// Folder holding the runs.
        #[arg(long, env = "RELAY_RUNS_DIR", default_value = DEFAULT_RUNS_DIR)]
        runs_dir: PathBuf,
    },
}

/// Resolves `<run|@last>` and `best|last|N` to `(run id, run dir, checkpoint dir)`.
/// The checkpoint dir is canonical (links resolved), so it stays the same
/// checkpoint when `last` moves on.
pub fn resolve(runs_dir: &Path, run: &str, which: &str) -> Result<(String, PathBuf, PathBuf)> {
    let (id, run_dir) = crate::runs::resolve_run_dir(runs_dir, run)?;
    let dir = checkpoint::resolve(&run_dir, which).with_context(|| format!("run {id}"))?;
    let dir = dir
        .canonicalize()
        .with_context(|| format!("checkpoint {}", dir.display()))?;
    Ok((id, run_dir, dir))
}

/// `relay checkpoints`.
pub fn checkpoints(args: CheckpointsArgs) -> Result<()> {
    match args.command {
        CheckpointsCommand::Ls { run, runs_dir } => {
            let (id, run_dir) = crate::runs::resolve_run_dir(&runs_dir, &run)?;
            print!("{}", table(&run_dir));
            println!("({id})");
            Ok(())
        }
        CheckpointsCommand::Pin {
            run,
            checkpoint: which,
            runs_dir,
        } => {
            let (id, _, dir) = resolve(&runs_dir, &run, &which)?;
            let n: u64 = dir
                .file_name()
                .and_then(|n| n.to_str())
                .and_then(|n| n.parse().ok())
                .context("checkpoint folder is not numbered")?;
            let run_dir = runs_dir.join(&id);
            checkpoint::pin(&run_dir, n)?;
            println!("pinned checkpoint {n} of {id}");
            Ok(())
        }
    }
}

/// The checkpoints of a run as a table (`weights`: the version whose
/// weights the checkpoint holds, earlier than `version` for `best` and
/// `solved`, which hold an evaluated version's).
pub fn table(run_dir: &Path) -> String {
    let pinned = checkpoint::pinned(run_dir);
    let links: Vec<(&str, Option<u64>)> = checkpoint::LINKS
        .iter()
        .map(|l| (*l, checkpoint::link_target(run_dir, l)))
        .collect();
    let mut out = String::from(
        "checkpoint  weights  version  updates  env_steps  vec_steps  best_eval  tags\n",
    );
    for n in checkpoint::list(run_dir) {
        let state = checkpoint::load_state(&checkpoint::folder(run_dir, n)).ok();
        let mut tags: Vec<String> = links
            .iter()
            .filter(|(_, target)| *target == Some(n))
            .map(|(link, _)| format!("@{link}"))
            .collect();
        if pinned.contains(&n) {
            tags.push("pinned".into());
        }
        let (weights, version, updates, env, vec, best_eval) = match &state {
            Some(s) => (
                s.weights_version.unwrap_or(s.progress.version).to_string(),
                s.progress.version.to_string(),
                s.progress.updates.to_string(),
                s.progress.env_steps.to_string(),
                s.progress.vec_steps.to_string(),
                s.best_eval
                    .map_or("-".into(), |(m, v)| format!("{m:.1}@v{v}")),
            ),
            None => (
                "?".into(),
                "?".into(),
                "?".into(),
                "?".into(),
                "?".into(),
                "?".into(),
            ),
        };
        out.push_str(&format!(
            "{n:>10}  {weights:>7}  {version:>7}  {updates:>7}  {env:>9}  {vec:>9}  {best_eval:>9}  {}\n",
            tags.join(" ")
        ));
    }
    out
}
