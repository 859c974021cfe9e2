//! `relay runs ls|repair` and `relay plot`: the run registry
//! (`runs/runs.json`, written by the trackers) and the learning curves of a
//! run, plus [`resolve_run_id`], which every command that takes a run id
//! uses so that `@last` names the newest run.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use relay_runs::registry::{RunRecord, RunRegistry};

/// The run id argument that names the newest run of the registry.
pub const LAST: &str = "@last";

/// The default runs folder (`run.runs_dir` of the configs).
pub const DEFAULT_RUNS_DIR: &str = "runs";

/// Flags of `relay runs`.
#[derive(Debug, Clone, clap::Args)]
pub struct RunsArgs {
    #[command(subcommand)]
    pub command: RunsCommand,
}

/// `relay runs <command>`.
#[derive(Debug, Clone, clap::Subcommand)]
pub enum RunsCommand {
    /// List the runs of the registry, newest first: id, start, env, algo, status.
    Ls {
        /// Folder holding the runs and `runs.json`.
        #[arg(long, env = "RELAY_RUNS_DIR", default_value = DEFAULT_RUNS_DIR)]
        runs_dir: PathBuf,
    },
    /// Rebuild an unreadable `runs.json` from the run directories (the old
    /// file is kept as `runs.json.bak`).
    Repair {
        /// Folder holding the runs and `runs.json`.
        #[arg(long, env = "RELAY_RUNS_DIR", default_value = DEFAULT_RUNS_DIR)]
        runs_dir: PathBuf,
    },
}

/// Flags of `relay plot`.
#[derive(Debug, Clone, clap::Args)]
pub struct PlotArgs {
    /// Run id, or `@last` for the newest run.
    pub run: String,
    /// Folder holding the runs and `runs.json`.
    #[arg(long, env = "RELAY_RUNS_DIR", default_value = DEFAULT_RUNS_DIR)]
    pub runs_dir: PathBuf,
}

/// Resolves a run id argument: `@last` is the newest run of
/// `<runs_dir>/runs.json`; any other value must be a valid run id.
pub fn resolve_run_id(runs_dir: &Path, arg: &str) -> Result<String> {
    if arg == LAST {
        let registry = RunRegistry::new(runs_dir);
        return match registry.newest()? {
            Some(record) => Ok(record.id),
            None => bail!(
                "{LAST}: no run recorded in {} (a tracker registers each run it writes)",
                registry.path().display()
            ),
        };
    }
    relay_proto::validate_run_id(arg)
        .map_err(anyhow::Error::msg)
        .with_context(|| format!("run id {arg:?}"))?;
    Ok(arg.to_string())
}

/// Resolves a run id argument to its existing run directory.
pub fn resolve_run_dir(runs_dir: &Path, arg: &str) -> Result<(String, PathBuf)> {
    let id = resolve_run_id(runs_dir, arg)?;
    let dir = runs_dir.join(&id);
    if !dir.is_dir() {
        bail!("run {id}: no directory {}", dir.display());
    }
    Ok((id, dir))
}

/// Runs `relay runs ...`.
pub fn runs(args: RunsArgs) -> Result<()> {
    match args.command {
        RunsCommand::Ls { runs_dir } => {
            let registry = RunRegistry::new(&runs_dir);
            let records = registry.load()?;
            if records.is_empty() {
                println!("no runs recorded in {}", registry.path().display());
            } else {
                print!("{}", table(&records));
            }
            Ok(())
        }
        RunsCommand::Repair { runs_dir } => {
            if !runs_dir.is_dir() {
                bail!("{} is not a folder", runs_dir.display());
            }
            let registry = RunRegistry::new(&runs_dir);
            let repair = registry.repair()?;
            match repair.backup {
                Some(backup) => println!(
                    "{} did not parse: kept it as {} and rebuilt it from the run directories ({} runs)",
                    registry.path().display(),
                    backup.display(),
                    repair.runs
                ),
                None => println!(
                    "{} is readable ({} runs); nothing to repair",
                    registry.path().display(),
                    repair.runs
                ),
            }
            Ok(())
        }
    }
}

/// Runs `relay plot`: draws `return.png`, `losses.png`, `sps.png` into
/// `<runs_dir>/<id>/plots/` and prints their paths.
pub fn plot(args: PlotArgs) -> Result<()> {
    let (id, dir) = resolve_run_dir(&args.runs_dir, &args.run)?;
    let paths = relay_runs::plots::draw_run(&dir).with_context(|| format!("run {id}"))?;
    println!("run {id}:");
    for path in paths {
        println!("  {}", path.display());
    }
    Ok(())
}

/// An RFC 3339 time of the run directory as local time
/// (`2026-11-26 22:16:50`); the text itself when it does not parse.
pub fn local_time(rfc3339: &str) -> String {
    chrono::DateTime::parse_from_rfc3339(rfc3339)
        .map(|t| {
            t.with_timezone(&chrono::Local)
                .format("%Y-%m-%d %H:%M:%S")
                .to_string()
        })
        .unwrap_or_else(|_| rfc3339.to_string())
}

/// The `relay runs ls` table: id, start (local time), env, algo, status.
pub fn table(records: &[RunRecord]) -> String {
    let rows: Vec<[String; 5]> = records
        .iter()
        .map(|r| {
            [
                r.id.clone(),
                local_time(&r.time),
                r.env_id.clone(),
                r.algo.clone(),
                serde_json::to_value(r.status)
                    .ok()
                    .and_then(|v| v.as_str().map(str::to_string))
                    .unwrap_or_default(),
            ]
        })
        .collect();
    let header = ["ID", "STARTED", "ENV", "ALGO", "STATUS"].map(String::from);
    let mut widths = header.clone().map(|h| h.len());
    for row in &rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let mut out = String::new();
    for row in std::iter::once(&header).chain(&rows) {
        let line: Vec<String> = row
            .iter()
            .zip(widths)
            .map(|(cell, w)| format!("{cell:<w$}"))
            .collect();
        out.push_str(line.join("  ").trim_end());
        out.push('\n');
    }
    out
}
