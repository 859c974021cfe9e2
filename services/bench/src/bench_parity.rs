//! `relay bench-parity`: relay's learning curve beside its anchor's
//! (Stable-Baselines3, one torch thread) at equal env steps, as RL
//! libraries are judged (CleanRL's Open RL Benchmark, rl-zoo's table,
//! rliable's statistics).
//!
//! For each task of [`TASKS`] (an algorithm, an env, rl-zoo's
//! hyperparameters: relay's preset plus the task's overrides where the
//! preset departs from them, `services/bench/sb3/parity.py` for the anchor)
//! and each seed:
//! - relay trains the whole budget (`relay up`, never stopped as solved,
//!   without its evaluator, so that its wall time, like the anchor's, is
//!   training alone) and saves a checkpoint every `budget / points` env
//!   steps (a whole number of the algorithm's updates); after the run each
//!   checkpoint is evaluated offline, greedy, on `--episodes` fresh
//!   episodes from the bench's evaluation seed: the model a user would
//!   take at that point;
//! - the anchor trains to the same env steps and is evaluated the same way
//!   at the same points (its first vector step at or past each).
//!
//! Per task: the final return and the area under the curve (the mean over
//! the points), each as the mean and the interquartile mean over seeds with
//! its 95 % bootstrap interval ([`crate::parity_stats`]); a verdict on the
//! final return's IQM (**at least as good**: relay's interval overlaps the
//! anchor's or lies above it; **above**: entirely above; else **behind**);
//! wall time and env steps/s of both; and both curves on one plot
//! (`bench/parity-<task>-<time>.png`). Prints a table and a last JSON line.
//!
//! `--merge FILE...` trains nothing: it reads the JSON lines of earlier
//! runs (seeds run apart, `--first-seed`) and reports their runs together,
//! task by task and side by side, with the same statistics and plot.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use relay::{up, UpArgs};
use relay_config::{Algo, ExperimentConfig};
use serde_json::json;

use crate::parity_stats::{area_under, bootstrap, iqm, mean, Interval};

/// One task: relay's preset and the anchor's script entry of the same name.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Task {
    /// Name in the table, and the anchor's `--task`.
    pub name: &'static str,
    /// The preset under `configs/`.
    pub config: &'static str,
    /// Overrides that bring the preset to rl-zoo's hyperparameters.
    pub sets: &'static [&'static str],
    /// Env steps each side trains (rl-zoo's `n_timesteps`).
    pub budget: u64,
    /// Seeds by default: 5 where a run costs under 5 minutes here, else 3.
    pub seeds: u64,
}

/// The tasks, cheapest first.
pub const TASKS: &[Task] = &[
    Task {
        name: "ppo-cartpole",
        config: "cartpole-ppo.yaml",
        sets: &[],
        budget: 100_000,
        seeds: 5,
    },
    Task {
        name: "sac-pendulum",
        config: "pendulum-sac.yaml",
        sets: &[],
        budget: 20_000,
        seeds: 5,
    },
    Task {
        name: "dqn-cartpole",
        config: "cartpole-dqn.yaml",
        // rl-zoo's DQN is SB3's: neither double Q-learning nor prioritized replay.
        sets: &["dqn.double_q=false", "dqn.prioritized=false"],
        budget: 50_000,
        seeds: 5,
    },
    Task {
        name: "dqn-mountaincar",
        config: "mountaincar-dqn.yaml",
        sets: &["dqn.double_q=false", "dqn.prioritized=false"],
        budget: 120_000,
        seeds: 5,
    },
    Task {
        name: "ppo-acrobot",
        config: "acrobot-ppo.yaml",
        // The preset trains 10 epochs at 1e-3; rl-zoo 4 at SB3's 3e-4.
        sets: &["ppo.epochs=4", "ppo.learning_rate=0.0003"],
        budget: 1_000_000,
        seeds: 3,
    },
    Task {
        name: "ppo-lunarlander",
        config: "lunarlander-ppo.yaml",
        sets: &[],
        budget: 1_000_000,
        seeds: 3,
    },
    Task {
        name: "ppo-hopper",
        config: "hopper-ppo.yaml",
        sets: &[],
        budget: 1_000_000,
        seeds: 3,
    },
    Task {
        name: "ppo-halfcheetah",
        config: "halfcheetah-ppo.yaml",
        sets: &[],
        budget: 1_000_000,
        seeds: 3,
    },
    Task {
        name: "ppo-walker2d",
        config: "walker2d-ppo.yaml",
        sets: &[],
        budget: 1_000_000,
        seeds: 3,
    },
    Task {
        name: "sac-hopper",
        config: "hopper-sac.yaml",
        sets: &[],
        budget: 1_000_000,
        seeds: 3,
    },
    // The MinAtar suite: PPO at gymnax-blines' hyperparameters (those of
    // the published MinAtar PPO returns), DQN at the MinAtar paper's; both
    // sides train MinAtar's CNN.
    Task {
        name: "ppo-minatar-asterix",
        config: "minatar-asterix-ppo.yaml",
        sets: &[],
        budget: 10_000_000,
        seeds: 3,
    },
    Task {
        name: "ppo-minatar-breakout",
        config: "minatar-breakout-ppo.yaml",
        sets: &[],
        budget: 10_000_000,
        seeds: 3,
    },
    Task {
        name: "ppo-minatar-freeway",
        config: "minatar-freeway-ppo.yaml",
        sets: &[],
        budget: 10_000_000,
        seeds: 3,
    },
    Task {
        name: "ppo-minatar-seaquest",
        config: "minatar-seaquest-ppo.yaml",
        sets: &[],
        budget: 10_000_000,
        seeds: 3,
    },
    Task {
        name: "ppo-minatar-spaceinvaders",
        config: "minatar-spaceinvaders-ppo.yaml",
        sets: &[],
        budget: 10_000_000,
        seeds: 3,
    },
    Task {
        name: "dqn-minatar-asterix",
        config: "minatar-asterix-dqn.yaml",
        sets: &[],
        budget: 5_000_000,
        seeds: 3,
    },
    Task {
        name: "dqn-minatar-breakout",
        config: "minatar-breakout-dqn.yaml",
        sets: &[],
        budget: 5_000_000,
        seeds: 3,
    },
    Task {
        name: "dqn-minatar-freeway",
        config: "minatar-freeway-dqn.yaml",
        sets: &[],
        budget: 5_000_000,
        seeds: 3,
    },
    Task {
        name: "dqn-minatar-seaquest",
        config: "minatar-seaquest-dqn.yaml",
        sets: &[],
        budget: 5_000_000,
        seeds: 3,
    },
    Task {
        name: "dqn-minatar-spaceinvaders",
        config: "minatar-spaceinvaders-dqn.yaml",
        sets: &[],
        budget: 5_000_000,
        seeds: 3,
    },
    // sb3-contrib's RecurrentPPO is the anchor of the two memory tasks.
    Task {
        name: "ppo-lstm-cartpole-novel",
        config: "cartpole-novel-ppo-lstm.yaml",
        sets: &[],
        budget: 100_000,
        seeds: 3,
    },
    Task {
        name: "ppo-lstm-pendulum-novel",
        config: "pendulum-novel-ppo-lstm.yaml",
        sets: &[],
        budget: 100_000,
        seeds: 3,
    },
];

/// The evaluation episodes' first seed, on both sides.
pub const EVAL_SEED: u64 = 1_000_003;

/// Flags of `relay bench-parity` (besides those of `relay up`, whose
/// `--config` is ignored: each task has its preset).
#[derive(Debug, Clone, clap::Args)]
pub struct BenchParityArgs {
    /// Tasks to run, comma separated (default: all).
    #[arg(long)]
    pub only: Option<String>,
    /// Seeds per task (default: the task's, 5 or 3): `first_seed`, `first_seed + 1`, ...
    #[arg(long)]
    pub seeds: Option<u64>,
    /// The first seed.
    #[arg(long, default_value_t = 1)]
    pub first_seed: u64,
    /// Evaluation points over the budget.
    #[arg(long, default_value_t = 20)]
    pub points: u64,
    /// Fresh episodes per evaluation point.
    #[arg(long, default_value_t = 10)]
    pub episodes: usize,
    /// Train this many env steps instead of the task's budget (a quick look).
    #[arg(long)]
    pub budget: Option<u64>,
    /// Train relay's side alone (an ablation of relay's settings through
    /// `--set`; the anchor's side is then not measured).
    #[arg(long, conflicts_with = "no_relay")]
    pub no_anchor: bool,
    /// Train the anchor's side alone, at the points relay's side is
    /// evaluated at: run beside a `--no-anchor` run of the same seeds, on
    /// the other core, and `--merge` the two.
    #[arg(long)]
    pub no_relay: bool,
    /// Where the presets are.
    #[arg(long, default_value = "configs")]
    pub configs: PathBuf,
    /// Where the plots go.
    #[arg(long, default_value = "bench")]
    pub out: PathBuf,
    /// Train nothing: report together the runs recorded in these files
    /// (the output of earlier bench-parity runs, whose last JSON line
    /// holds every seed's curve), e.g. seeds 1-3 and 4-6 run apart. A
    /// file named `relay:FILE` or `anchor:FILE` gives that side only (an
    /// anchor measured before relay's preset changed).
    #[arg(long, num_args = 1..)]
    pub merge: Vec<String>,
}

/// One side's run of one seed.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
struct Run {
    seed: u64,
    /// `(env steps, mean return)` per evaluation point.
    curve: Vec<(u64, f64)>,
    /// Training wall time.
    wall_s: f64,
    env_steps: u64,
}

/// One side of a task, over its seeds.
#[derive(Debug, Clone, serde::Serialize)]
struct Side {
    runs: Vec<Run>,
    final_mean: f64,
    final_iqm: Interval,
    auc_mean: f64,
    auc_iqm: Interval,
    env_steps_per_s: f64,
}

impl Side {
    fn new(runs: Vec<Run>) -> Option<Self> {
        if runs.is_empty() || runs.iter().any(|r| r.curve.is_empty()) {
            return None;
        }
        let finals: Vec<f64> = runs.iter().map(|r| r.curve.last().unwrap().1).collect();
        let aucs: Vec<f64> = runs.iter().map(|r| area_under(&r.curve)).collect();
        let steps: u64 = runs.iter().map(|r| r.env_steps).sum();
        let seconds: f64 = runs.iter().map(|r| r.wall_s).sum();
        Some(Self {
            final_mean: mean(&finals),
            final_iqm: bootstrap(&finals, iqm, 1),
            auc_mean: mean(&aucs),
            auc_iqm: bootstrap(&aucs, iqm, 2),
            env_steps_per_s: steps as f64 / seconds.max(1e-9),
            runs,
        })
    }

    /// Per point: `(env steps, mean over seeds, bootstrap interval)`, the
    /// points at the same index on every seed.
    fn mean_curve(&self) -> Vec<(f64, f64, f64, f64)> {
        let n = self.runs.iter().map(|r| r.curve.len()).min().unwrap_or(0);
        (0..n)
            .map(|i| {
                let at: Vec<f64> = self.runs.iter().map(|r| r.curve[i].1).collect();
                let x = mean(
                    &self
                        .runs
                        .iter()
                        .map(|r| r.curve[i].0 as f64)
                        .collect::<Vec<_>>(),
                );
                let ci = bootstrap(&at, mean, 3 + i as u64);
                (x, ci.point, ci.low, ci.high)
            })
            .collect()
    }
}

/// The verdict on the final return's IQM intervals.
fn verdict(relay: &Side, anchor: &Side) -> &'static str {
    if relay.final_iqm.low > anchor.final_iqm.high {
        "above"
    } else if relay.final_iqm.overlaps(&anchor.final_iqm) {
        "at least as good"
    } else {
        "behind"
    }
}

/// Env steps of one update of the run's algorithm: what a checkpoint
/// interval is a whole number of.
fn update_env_steps(config: &ExperimentConfig) -> u64 {
    match config.run.algo {
        Algo::Dqn => config.dqn.train_freq,
        Algo::Sac => config.sac.train_freq,
        Algo::Ppo | Algo::A2c | Algo::Reinforce => config
            .rollout_env_steps()
            .map_or(config.env_runner.fragment_steps as u64, |(_, steps)| steps),
    }
}

/// The evaluation points: `points` whole multiples of the update size
/// spanning `budget`.
fn grid(budget: u64, points: u64, update: u64) -> (u64, Vec<u64>) {
    let every_updates = ((budget as f64 / points as f64 / update as f64).round() as u64).max(1);
    let interval = every_updates * update;
    let n = (budget / interval).max(1);
    (every_updates, (1..=n).map(|j| j * interval).collect())
}

/// Relay's settings of `task`: the task's first, so that the user's
/// `--set`s (`user`) win.
fn task_overrides(task: &Task, user: &[String]) -> Vec<String> {
    task.sets
        .iter()
        .map(|s| s.to_string())
        .chain(user.iter().cloned())
        .collect()
}

/// The task's preset under `overrides` ([`task_overrides`]) and
/// its evaluation grid: checkpoints every `.1` updates, at the points `.2`.
fn task_grid(
    args: &BenchParityArgs,
    task: &Task,
    overrides: &[String],
) -> Result<(ExperimentConfig, u64, Vec<u64>)> {
    let preset = ExperimentConfig::load(&args.configs.join(task.config), overrides)
        .with_context(|| format!("{}: {}", task.name, task.config))?;
    let budget = args.budget.unwrap_or(task.budget);
    let (every_updates, points) = grid(budget, args.points, update_env_steps(&preset));
    Ok((preset, every_updates, points))
}

/// Trains one relay seed and evaluates its checkpoints at the points.
fn relay_run(
    base: &UpArgs,
    args: &BenchParityArgs,
    task: &Task,
    seed: u64,
    stamp: &str,
) -> Result<Run> {
    let mut run = base.clone();
    run.config = args.configs.join(task.config);
    run.quiet = true;
    run.until_solved = true;
    run.without.push("evaluator".into());
    run.overrides = task_overrides(task, &run.overrides);
    run.overrides.push(format!("run.seed={seed}"));
    let (preset, every_updates, points) = task_grid(args, task, &run.overrides)?;
    // Each algorithm's config section is named as the algorithm.
    let algo = preset.run.algo.name();
    run.overrides.extend([
        format!("run.total_env_steps={}", points.last().unwrap()),
        "run.stop_when_solved=false".into(),
        "eval.threshold=1e12".into(),
        format!("{algo}.checkpoint_every={every_updates}"),
        format!("{algo}.keep_checkpoints={}", points.len() + 8),
    ]);
    let run_id = format!("bench-parity-{}-s{seed}-{stamp}", task.name);
    run.run_id = Some(run_id.clone());
    let outcome = up(run)?;
    let run_dir = preset.run.runs_dir.join(&run_id);
    // Each point's checkpoint: the one whose env steps are nearest.
    let saved: Vec<(u64, u64)> = relay_runs::checkpoint::list(&run_dir)
        .into_iter()
        .filter_map(|n| {
            let dir = relay_runs::checkpoint::folder(&run_dir, n);
            let progress = relay_runs::checkpoint::load_progress(&dir).ok()?;
            Some((n, progress.env_steps))
        })
        .collect();
    let interval = points[0];
    let mut curve = Vec::new();
    for &point in &points {
        let Some(&(n, steps)) = saved.iter().min_by_key(|(_, s)| s.abs_diff(point)) else {
            bail!("{run_id}: no checkpoint was saved");
        };
        if steps.abs_diff(point) > interval / 2 {
            println!("   {run_id}: no checkpoint near {point} env steps (nearest: {steps}); the point is left out");
            continue;
        }
        let eval = relay::eval::evaluate_checkpoint(
            &preset.run.runs_dir,
            &run_id,
            &n.to_string(),
            args.episodes,
            Some(EVAL_SEED),
        )?;
        curve.push((steps, eval.mean_return));
    }
    println!(
        "   relay seed {seed}: final {:.1} at {} env steps, {:.1} s training",
        curve.last().map_or(f64::NAN, |p| p.1),
        outcome.trained_env_steps,
        outcome.trained_s
    );
    Ok(Run {
        seed,
        curve,
        wall_s: outcome.trained_s,
        env_steps: outcome.trained_env_steps,
    })
}

/// Trains the anchor's seeds at the same points; why not, when it cannot.
fn anchor_runs(
    task: &Task,
    seeds: &[u64],
    points: &[u64],
    episodes: usize,
) -> Result<Vec<Run>, String> {
    let list = |v: &[u64]| v.iter().map(u64::to_string).collect::<Vec<_>>().join(",");
    let report = crate::bench_learning::run_anchor_script(
        "parity.py",
        &[
            "--task".into(),
            task.name.into(),
            "--seeds".into(),
            list(seeds),
            "--points".into(),
            list(points),
            "--episodes".into(),
            episodes.to_string(),
            "--eval-seed".into(),
            EVAL_SEED.to_string(),
        ],
    )?;
    let runs = report["runs"]
        .as_array()
        .ok_or("parity.py printed no runs")?;
    runs.iter()
        .map(|r| {
            let curve = r["curve"]
                .as_array()
                .ok_or("a run without a curve")?
                .iter()
                .filter_map(|p| Some((p[0].as_u64()?, p[1].as_f64()?)))
                .collect();
            Ok(Run {
                seed: r["seed"].as_u64().unwrap_or(0),
                curve,
                wall_s: r["train_s"].as_f64().unwrap_or(f64::NAN),
                env_steps: r["env_steps"].as_u64().unwrap_or(0),
            })
        })
        .collect()
}

fn selected(only: Option<&str>) -> Vec<Task> {
    match only {
        None => TASKS.to_vec(),
        Some(names) => names
            .split(',')
            .filter_map(|n| TASKS.iter().find(|t| t.name == n.trim()).copied())
            .collect(),
    }
}

/// `relay bench-parity`.
pub fn bench_parity(base: UpArgs, args: BenchParityArgs) -> Result<()> {
    let tasks = selected(args.only.as_deref());
    if tasks.is_empty() {
        bail!(
            "--only {:?} matches no task; tasks: {}",
            args.only.unwrap_or_default(),
            TASKS.iter().map(|t| t.name).collect::<Vec<_>>().join(", ")
        );
    }
    if args.points == 0 || args.episodes == 0 {
        bail!("--points and --episodes must be at least 1");
    }
    let stamp = chrono::Local::now().format("%Y%m%d-%H%M%S").to_string();
    std::fs::create_dir_all(&args.out).with_context(|| args.out.display().to_string())?;
    if !args.merge.is_empty() {
        return merge(&args, &tasks, &stamp);
    }
    let mut rows = Vec::new();
    for task in tasks {
        let seeds: Vec<u64> =
            (args.first_seed..args.first_seed + args.seeds.unwrap_or(task.seeds)).collect();
        println!(
            "== {}: {} seeds of relay, then of the anchor",
            task.name,
            seeds.len()
        );
        let (relay, points) = if args.no_relay {
            let overrides = task_overrides(&task, &base.overrides);
            (None, task_grid(&args, &task, &overrides)?.2)
        } else {
            let mut relay_runs = Vec::new();
            for &seed in &seeds {
                relay_runs.push(relay_run(&base, &args, &task, seed, &stamp)?);
            }
            let points = relay_runs[0].curve.iter().map(|p| p.0).collect();
            (Side::new(relay_runs), points)
        };
        let anchor = match args.no_anchor {
            true => None,
            false => match anchor_runs(&task, &seeds, &points, args.episodes) {
                Ok(runs) => Side::new(runs),
                Err(e) => {
                    println!("   anchor not measured: {e}");
                    None
                }
            },
        };
        rows.push(row(&args, task, relay, anchor, &stamp));
    }
    print_table(&rows, &args, &base.overrides);
    Ok(())
}

/// A task's row of the table, its plot drawn.
fn row(
    args: &BenchParityArgs,
    task: Task,
    relay: Option<Side>,
    anchor: Option<Side>,
    stamp: &str,
) -> Row {
    let plot = args.out.join(format!("parity-{}-{stamp}.png", task.name));
    let curves: Vec<relay_runs::plots::ComparedCurve> =
        [("relay", &relay), ("Stable-Baselines3", &anchor)]
            .into_iter()
            .filter_map(|(label, side)| Some((label.to_string(), side.as_ref()?.mean_curve())))
            .collect();
    if let Err(e) = relay_runs::plots::draw_compared(
        &plot,
        &format!(
            "{}: mean return over seeds (95 % bootstrap interval)",
            task.name
        ),
        "env steps",
        &curves,
    ) {
        println!("   plot not drawn: {e}");
    }
    (task, relay, anchor, plot)
}

/// `--merge`: the runs of `args.merge`'s JSON lines, reported together per
/// task of `tasks` found in them. A seed recorded twice for one side, or
/// files whose relay settings differ (`--set`), are refused by name.
fn merge(args: &BenchParityArgs, tasks: &[Task], stamp: &str) -> Result<()> {
    /// A task's runs found so far: relay's, the anchor's, relay's overrides.
    type Found = (Vec<Run>, Vec<Run>, Option<serde_json::Value>);
    let mut found: std::collections::BTreeMap<&str, Found> = Default::default();
    for arg in &args.merge {
        let (only_side, file) = match arg.split_once(':') {
            Some((side @ ("relay" | "anchor"), file)) => (Some(side), std::path::Path::new(file)),
            _ => (None, std::path::Path::new(arg)),
        };
        let text =
            std::fs::read_to_string(file).with_context(|| format!("--merge {}", file.display()))?;
        let line = text
            .lines()
            .rev()
            .find(|l| l.starts_with(r#"{"bench":"parity""#))
            .with_context(|| format!("--merge {}: no bench-parity JSON line", file.display()))?;
        let record: serde_json::Value = serde_json::from_str(line)
            .with_context(|| format!("--merge {}: its JSON line", file.display()))?;
        for entry in record["tasks"].as_array().into_iter().flatten() {
            let Some(task) = tasks.iter().find(|t| entry["task"] == t.name) else {
                continue;
            };
            let (relay, anchor, overrides) = found.entry(task.name).or_default();
            match overrides {
                _ if only_side == Some("anchor") => {}
                Some(seen) if *seen != entry["overrides"] => bail!(
                    "--merge {}: {} was run with relay settings {} there and {} in an earlier file; merge runs of one setting",
                    file.display(),
                    task.name,
                    entry["overrides"],
                    seen
                ),
                _ => *overrides = Some(entry["overrides"].clone()),
            }
            for (side, runs) in [("relay", &mut *relay), ("anchor", &mut *anchor)] {
                if entry[side].is_null() || only_side.is_some_and(|only| only != side) {
                    continue;
                }
                let recorded: Vec<Run> = serde_json::from_value(entry[side]["runs"].clone())
                    .with_context(|| {
                        format!("--merge {}: {}'s {side} runs", file.display(), task.name)
                    })?;
                for run in recorded {
                    if runs.iter().any(|r| r.seed == run.seed) {
                        bail!(
                            "--merge {}: {}'s {side} seed {} is in an earlier file too",
                            file.display(),
                            task.name,
                            run.seed
                        );
                    }
                    runs.push(run);
                }
            }
        }
    }
    if found.is_empty() {
        bail!(
            "--merge: no task of {} in the files",
            tasks.iter().map(|t| t.name).collect::<Vec<_>>().join(", ")
        );
    }
    let mut rows = Vec::new();
    let mut overrides = Vec::new();
    for task in tasks {
        let Some((mut relay, mut anchor, set)) = found.remove(task.name) else {
            continue;
        };
        relay.sort_by_key(|r| r.seed);
        anchor.sort_by_key(|r| r.seed);
        println!(
            "== {}: relay seeds {:?}, the anchor's {:?}",
            task.name,
            relay.iter().map(|r| r.seed).collect::<Vec<_>>(),
            anchor.iter().map(|r| r.seed).collect::<Vec<_>>()
        );
        if let Some(set) = set.and_then(|s| serde_json::from_value::<Vec<String>>(s).ok()) {
            overrides = set;
        }
        rows.push(row(args, *task, Side::new(relay), Side::new(anchor), stamp));
    }
    print_table(&rows, args, &overrides);
    Ok(())
}

type Row = (Task, Option<Side>, Option<Side>, PathBuf);

/// Prints the table and the JSON line; `overrides` are the user's `--set`s
/// on relay's side.
fn print_table(rows: &[Row], args: &BenchParityArgs, overrides: &[String]) {
    let interval = |i: &Interval| format!("{:.1} [{:.1}, {:.1}]", i.point, i.low, i.high);
    println!();
    println!(
        "{:<16} {:<8} {:>5} {:>9} {:>26} {:>26} {:>9} {:>10}  verdict",
        "task",
        "side",
        "seeds",
        "final",
        "final IQM [95% CI]",
        "AUC IQM [95% CI]",
        "wall s",
        "steps/s"
    );
    let mut json_rows = Vec::new();
    for (task, relay, anchor, plot) in rows {
        let verdict = match (relay, anchor) {
            (Some(r), Some(a)) => verdict(r, a),
            _ => "not compared",
        };
        for (name, side) in [("relay", relay), ("sb3", anchor)] {
            match side {
                Some(s) => println!(
                    "{:<16} {:<8} {:>5} {:>9.1} {:>26} {:>26} {:>9.1} {:>10.0}  {}",
                    task.name,
                    name,
                    s.runs.len(),
                    s.final_mean,
                    interval(&s.final_iqm),
                    interval(&s.auc_iqm),
                    s.runs.iter().map(|r| r.wall_s).sum::<f64>() / s.runs.len() as f64,
                    s.env_steps_per_s,
                    if name == "relay" { verdict } else { "" }
                ),
                None => println!("{:<16} {:<8} not measured", task.name, name),
            }
        }
        json_rows.push(json!({
            "task": task.name,
            "config": task.config,
            "sets": task.sets,
            "overrides": overrides,
            "verdict": verdict,
            "relay": relay,
            "anchor": anchor,
            "plot": plot.display().to_string(),
        }));
    }
    println!(
        "{}",
        json!({
            "bench": "parity",
            "points": args.points,
            "episodes": args.episodes,
            "eval_seed": EVAL_SEED,
            "cpu": crate::cpu_name(),
            "tasks": json_rows,
        })
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;
    use std::path::Path;

    /// The flags as a user who names none gets them.
    fn defaults() -> BenchParityArgs {
        #[derive(Parser)]
        struct Cli {
            #[command(flatten)]
            args: BenchParityArgs,
        }
        Cli::parse_from(["bench-parity"]).args
    }

    #[test]
    fn the_points_are_whole_updates_spanning_the_budget() {
        // CartPole PPO: 256 env steps an update, 100k in 20 points.
        let (every, points) = grid(100_000, 20, 256);
        assert_eq!(every, 20);
        assert_eq!(points.len(), 19);
        assert_eq!(points[0], 5120);
        assert!(points.iter().all(|p| p % 256 == 0) && *points.last().unwrap() <= 100_000);
        // SAC: one env step an update.
        let (every, points) = grid(20_000, 20, 1);
        assert_eq!((every, points.len(), points[19]), (1000, 20, 20_000));
    }

    #[test]
    fn every_task_has_its_preset() {
        let configs = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../configs");
        for task in TASKS {
            let config = ExperimentConfig::load(
                &configs.join(task.config),
                &task.sets.iter().map(|s| s.to_string()).collect::<Vec<_>>(),
            )
            .unwrap_or_else(|e| panic!("{}: {e}", task.name));
            assert!(update_env_steps(&config) > 0, "{}", task.name);
        }
    }

    #[test]
    fn the_anchor_alone_is_evaluated_at_relays_points() {
        // `--no-relay` takes the grid from the preset: Hopper's PPO
        // rollouts of 512 env steps, a checkpoint every 98.
        let args = BenchParityArgs {
            no_relay: true,
            configs: Path::new(env!("CARGO_MANIFEST_DIR")).join("../../configs"),
            ..defaults()
        };
        let task = selected(Some("ppo-hopper"))[0];
        let (_, every, points) = task_grid(&args, &task, &[]).unwrap();
        assert_eq!(every, 98);
        assert_eq!((points.len(), points[0], points[18]), (19, 50_176, 953_344));
    }

    /// A bench-parity record of `seeds` on both sides of ppo-cartpole,
    /// each seed's final return its number.
    fn record(seeds: &[u64], overrides: &[&str]) -> String {
        let runs: Vec<Run> = seeds
            .iter()
            .map(|&seed| Run {
                seed,
                curve: vec![(1000, 0.0), (2000, seed as f64)],
                wall_s: 1.0,
                env_steps: 2000,
            })
            .collect();
        let side = Side::new(runs).unwrap();
        let line = json!({"bench": "parity", "tasks": [{
            "task": "ppo-cartpole", "overrides": overrides,
            "relay": side, "anchor": side,
        }]});
        format!("some output\n{line}\n")
    }

    #[test]
    fn merge_reports_seeds_run_apart_together_and_refuses_a_seed_twice() {
        let dir = std::env::temp_dir().join(format!("relay-parity-merge-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = |name: &str, text: String| {
            let path = dir.join(name);
            std::fs::write(&path, text).unwrap();
            path
        };
        let first = file("a.log", record(&[1, 2, 3], &[]));
        let second = file("b.log", record(&[4, 5, 6], &[]));
        let again = file("c.log", record(&[3], &[]));
        let ablation = file("d.log", record(&[7], &["ppo.epochs=1"]));
        let args = |files: Vec<PathBuf>| BenchParityArgs {
            merge: files.iter().map(|f| f.display().to_string()).collect(),
            out: dir.clone(),
            ..defaults()
        };
        let tasks = selected(Some("ppo-cartpole"));
        merge(&args(vec![first.clone(), second]), &tasks, "t").unwrap();
        let e = merge(&args(vec![first.clone(), again]), &tasks, "t")
            .unwrap_err()
            .to_string();
        assert!(e.contains("seed 3 is in an earlier file"), "{e}");
        let e = merge(&args(vec![first.clone(), ablation]), &tasks, "t")
            .unwrap_err()
            .to_string();
        assert!(e.contains("relay settings"), "{e}");
        // One side of a file: the anchor of an ablation run.
        let mut one_side = args(vec![first]);
        one_side
            .merge
            .push(format!("anchor:{}", dir.join("d.log").display()));
        merge(&one_side, &tasks, "t").unwrap();
        let _ = std::fs::remove_dir_all(&dir);
    }
}
