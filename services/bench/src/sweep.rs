//! `relay sweep`: hyperparameter search on the local stack, or against a
//! remote NATS.
//!
//! Each trial is a normal run (`relay up --until-solved` with the trial's
//! `--set` overrides, its own run id `<sweep>-t<k>`, in the registry like any
//! other run), one after the other. With `--nats-url` (and `--redis-url`)
//! the trials use that nats-server (and redis-server) instead of starting
//! their own, so service copies started on other machines (`relay-env-runner
//! --run-id <sweep>-t<k> --nats-url ...`) can join a trial. The search:
//! - `--grid key=v1,v2,...` (repeatable): every combination, in order;
//! - `--random key=DIST` (repeatable) with `--trials N`: N draws from a
//!   seeded RNG, where DIST is `uniform:LO:HI`, `loguniform:LO:HI`,
//!   `int:LO:HI` (inclusive) or `choice:a,b,c`.
//!
//! Early stopping is the median rule (as Optuna's `MedianPruner` and
//! Google Vizier's median stopping): once a trial has spent
//! `--prune-after` of its env-step budget, each evaluation compares the
//! trial's best evaluation so far with the median of the finished trials'
//! best evaluations at the same env steps; below it, the trial is stopped
//! as hopeless. It needs `--prune-min-trials` finished trials first.
//!
//! The trials are ranked solved first (fewest env steps to solve), then by
//! best evaluation; the table and a JSON line are printed and the whole
//! sweep is written to `<runs_dir>/<sweep>.sweep.json`.

use std::io::{BufRead, BufReader, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use relay_config::ExperimentConfig;
use serde::Serialize;

use relay::{make_run_id, up, StopFlag, UpArgs};

/// Flags of `relay sweep` (besides those of `relay up`).
#[derive(Debug, Clone, clap::Args)]
pub struct SweepArgs {
    /// A grid dimension `key=v1,v2,...` (repeatable; every combination runs).
    #[arg(long = "grid", value_name = "KEY=V1,V2,...")]
    pub grid: Vec<String>,
    /// A random dimension `key=uniform:LO:HI | loguniform:LO:HI | int:LO:HI | choice:a,b,...` (repeatable).
    #[arg(long = "random", value_name = "KEY=DIST")]
    pub random: Vec<String>,
    /// Trials of a random search (a grid runs each combination; this caps it).
    #[arg(long)]
    pub trials: Option<usize>,
    /// Seed of the random draws.
    #[arg(long, default_value_t = 0)]
    pub sweep_seed: u64,
    /// Share of a trial's env-step budget before the median rule may stop it.
    #[arg(long, default_value_t = 0.25)]
    pub prune_after: f64,
    /// Finished trials needed before the median rule stops any (0: never stop early).
    #[arg(long, default_value_t = 2)]
    pub prune_min_trials: usize,
}

/// One dimension of the search.
#[derive(Debug, Clone, PartialEq)]
pub enum Dimension {
    /// Every listed value.
    Grid(Vec<String>),
    Uniform(f64, f64),
    LogUniform(f64, f64),
    /// Integers from the first to the second, both included.
    Int(i64, i64),
    Choice(Vec<String>),
}

/// Parses `key=...` of `--grid` (`random: false`) or `--random`.
pub fn parse_dimension(spec: &str, random: bool) -> Result<(String, Dimension)> {
    let flag = if random { "--random" } else { "--grid" };
    let (key, value) = spec
        .split_once('=')
        .with_context(|| format!("{flag} {spec:?}: expected key=..."))?;
    let key = key.trim();
    if key.is_empty() {
        bail!("{flag} {spec:?}: empty key");
    }
    let list = |text: &str| -> Result<Vec<String>> {
        let values: Vec<String> = text
            .split(',')
            .map(|v| v.trim().to_string())
            .filter(|v| !v.is_empty())
            .collect();
        if values.is_empty() {
            bail!("{flag} {spec:?}: no values");
        }
        Ok(values)
    };
    if !random {
        return Ok((key.to_string(), Dimension::Grid(list(value)?)));
    }
    let (kind, args) = value.split_once(':').with_context(|| {
        format!(
            "--random {spec:?}: expected uniform:LO:HI, loguniform:LO:HI, int:LO:HI or choice:a,b"
        )
    })?;
    let bounds = |args: &str| -> Result<(f64, f64)> {
        let (lo, hi) = args
            .split_once(':')
            .with_context(|| format!("--random {spec:?}: expected {kind}:LO:HI"))?;
        let (lo, hi): (f64, f64) = (
            lo.trim()
                .parse()
                .with_context(|| format!("--random {spec:?}: low bound"))?,
            hi.trim()
                .parse()
                .with_context(|| format!("--random {spec:?}: high bound"))?,
        );
        if !(lo.is_finite() && hi.is_finite() && lo <= hi) {
            bail!("--random {spec:?}: bounds must be finite with LO <= HI");
        }
        Ok((lo, hi))
    };
    let dimension = match kind {
        "uniform" => {
            let (lo, hi) = bounds(args)?;
            Dimension::Uniform(lo, hi)
        }
        "loguniform" => {
            let (lo, hi) = bounds(args)?;
            if lo <= 0.0 {
                bail!("--random {spec:?}: loguniform bounds must be > 0");
            }
            Dimension::LogUniform(lo, hi)
        }
        "int" => {
            let (lo, hi) = bounds(args)?;
            if lo.fract() != 0.0 || hi.fract() != 0.0 {
                bail!("--random {spec:?}: int bounds must be integers");
            }
            Dimension::Int(lo as i64, hi as i64)
        }
        "choice" => Dimension::Choice(list(args)?),
        other => bail!(
            "--random {spec:?}: unknown distribution {other:?}; known: uniform, loguniform, int, choice"
        ),
    };
    Ok((key.to_string(), dimension))
}

/// The `key=value` overrides of each trial: the grid's combinations in
/// order (the last dimension varies fastest), or `trials` random draws.
pub fn plan_trials(
    dimensions: &[(String, Dimension)],
    trials: Option<usize>,
    seed: u64,
) -> Result<Vec<Vec<String>>> {
    if dimensions.is_empty() {
        bail!("nothing to search: give --grid key=v1,v2 or --random key=DIST");
    }
    let grid = dimensions
        .iter()
        .all(|(_, d)| matches!(d, Dimension::Grid(_)));
    if !grid
        && dimensions
            .iter()
            .any(|(_, d)| matches!(d, Dimension::Grid(_)))
    {
        bail!("--grid and --random do not mix: a sweep is a grid or a random search");
    }
    if grid {
        let mut plans: Vec<Vec<String>> = vec![Vec::new()];
        for (key, dimension) in dimensions {
            let Dimension::Grid(values) = dimension else {
                unreachable!("grid dimensions only")
            };
            plans = plans
                .into_iter()
                .flat_map(|plan| {
                    values.iter().map(move |v| {
                        let mut next = plan.clone();
                        next.push(format!("{key}={v}"));
                        next
                    })
                })
                .collect();
        }
        if let Some(cap) = trials {
            plans.truncate(cap);
        }
        return Ok(plans);
    }
    let trials = trials.context("a random search needs --trials N")?;
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    Ok((0..trials)
        .map(|_| {
            dimensions
                .iter()
                .map(|(key, dimension)| {
                    let value = match dimension {
                        Dimension::Uniform(lo, hi) => {
                            format!("{}", lo + (hi - lo) * rng.random::<f64>())
                        }
                        Dimension::LogUniform(lo, hi) => {
                            format!(
                                "{}",
                                (lo.ln() + (hi.ln() - lo.ln()) * rng.random::<f64>()).exp()
                            )
                        }
                        Dimension::Int(lo, hi) => format!("{}", rng.random_range(*lo..=*hi)),
                        Dimension::Choice(values) => {
                            values[rng.random_range(0..values.len())].clone()
                        }
                        Dimension::Grid(_) => unreachable!("random dimensions only"),
                    };
                    format!("{key}={value}")
                })
                .collect()
        })
        .collect())
}

/// A trial's evaluations: (learner env steps, mean return), in order.
pub type Curve = Vec<(u64, f64)>;

/// The best return of `curve` up to `env_steps` (`None` before its first
/// evaluation).
fn best_until(curve: &Curve, env_steps: u64) -> Option<f64> {
    curve
        .iter()
        .take_while(|(steps, _)| *steps <= env_steps)
        .map(|(_, r)| *r)
        .reduce(f64::max)
}

/// The median stopping rule: stop a trial whose best evaluation so far is
/// below the median of the finished trials' best evaluations at the same
/// env steps, once it has spent `warmup_steps` and `min_trials` trials
/// have finished.
pub fn should_prune(
    curve: &Curve,
    finished: &[Curve],
    warmup_steps: u64,
    min_trials: usize,
) -> bool {
    let Some(&(steps, _)) = curve.last() else {
        return false;
    };
    if min_trials == 0 || finished.len() < min_trials || steps < warmup_steps {
        return false;
    }
    let mut others: Vec<f64> = finished
        .iter()
        .filter_map(|c| best_until(c, steps))
        .collect();
    if others.len() < min_trials {
        return false;
    }
    others.sort_by(f64::total_cmp);
    let n = others.len();
    let median = if n % 2 == 1 {
        others[n / 2]
    } else {
        (others[n / 2 - 1] + others[n / 2]) / 2.0
    };
    best_until(curve, steps).is_some_and(|best| best < median)
}

/// How one trial went.
#[derive(Debug, Clone, Serialize)]
pub struct Trial {
    pub index: usize,
    pub run_id: String,
    pub overrides: Vec<String>,
    pub solved: bool,
    pub pruned: bool,
    /// Env steps at the solving evaluation, or at the end.
    pub env_steps: u64,
    pub wall_s: f64,
    pub best_eval: Option<f64>,
    pub last_eval: Option<f64>,
    pub evaluations: usize,
    /// Set when the trial's run failed to start or run.
    pub error: Option<String>,
}

/// Solved trials first (fewest env steps), then the best evaluation.
fn rank(trials: &mut [Trial]) {
    trials.sort_by(|a, b| {
        b.solved
            .cmp(&a.solved)
            .then_with(|| {
                if a.solved {
                    a.env_steps.cmp(&b.env_steps)
                } else {
                    std::cmp::Ordering::Equal
                }
            })
            .then_with(|| {
                b.best_eval
                    .unwrap_or(f64::NEG_INFINITY)
                    .total_cmp(&a.best_eval.unwrap_or(f64::NEG_INFINITY))
            })
    });
}

/// Reads the evaluations appended to `path` from `offset` on into `curve`.
fn read_evals(path: &Path, offset: &mut u64, curve: &mut Curve) {
    let Ok(mut file) = std::fs::File::open(path) else {
        return;
    };
    if file.seek(SeekFrom::Start(*offset)).is_err() {
        return;
    }
    let mut reader = BufReader::new(file);
    let mut line = String::new();
    while let Ok(n) = reader.read_line(&mut line) {
        if n == 0 || !line.ends_with('\n') {
            break;
        }
        *offset += n as u64;
        if let Ok(v) = serde_json::from_str::<serde_json::Value>(line.trim()) {
            if let (Some(steps), Some(ret)) =
                (v["learner_env_steps"].as_u64(), v["mean_return"].as_f64())
            {
                curve.push((steps, ret));
            }
        }
        line.clear();
    }
}

/// `relay sweep`.
pub fn sweep(up_args: UpArgs, args: SweepArgs) -> Result<()> {
    if !(0.0..=1.0).contains(&args.prune_after) {
        bail!(
            "--prune-after must be within 0..=1, got {}",
            args.prune_after
        );
    }
    let mut dimensions = Vec::new();
    for spec in &args.grid {
        dimensions.push(parse_dimension(spec, false)?);
    }
    for spec in &args.random {
        dimensions.push(parse_dimension(spec, true)?);
    }
    let plans = plan_trials(&dimensions, args.trials, args.sweep_seed)?;
    let config = ExperimentConfig::load(&up_args.config, &up_args.overrides)?;
    // Every trial's overrides must make a valid config before any runs.
    for plan in &plans {
        let mut overrides = up_args.overrides.clone();
        overrides.extend(plan.iter().cloned());
        ExperimentConfig::load(&up_args.config, &overrides)
            .with_context(|| format!("trial {}", plan.join(" ")))?;
    }
    let sweep_id = up_args
        .run_id
        .clone()
        .unwrap_or_else(|| format!("{}-sweep", make_run_id(&config)));
    let warmup_steps = (args.prune_after * config.run.total_env_steps as f64) as u64;
    println!(
        "relay sweep {sweep_id}: {} trials of {} (budget {} env steps each, median stopping after {warmup_steps})",
        plans.len(),
        up_args.config.display(),
        config.run.total_env_steps
    );

    let mut finished: Vec<Curve> = Vec::new();
    let mut trials: Vec<Trial> = Vec::new();
    for (index, plan) in plans.iter().enumerate() {
        let run_id = format!("{sweep_id}-t{index}");
        println!("== trial {index}: {}", plan.join(" "));
        let mut run = up_args.clone();
        run.overrides.extend(plan.iter().cloned());
        run.run_id = Some(run_id.clone());
        run.until_solved = true;
        run.quiet = true;
        let stop = StopFlag::default();
        run.stop = Some(stop.clone());
        let eval_path = config.run.runs_dir.join(&run_id).join("eval.jsonl");
        let done = Arc::new(AtomicBool::new(false));
        let curve = Arc::new(Mutex::new(Curve::new()));
        let pruned = Arc::new(AtomicBool::new(false));
        let watcher = {
            let (done, curve, pruned, stop) =
                (done.clone(), curve.clone(), pruned.clone(), stop.clone());
            let finished = finished.clone();
            let min_trials = args.prune_min_trials;
            std::thread::spawn(move || {
                let mut offset = 0;
                loop {
                    let stopping = done.load(Ordering::Relaxed);
                    let mut curve = curve.lock().expect("curve lock");
                    let before = curve.len();
                    read_evals(&eval_path, &mut offset, &mut curve);
                    if curve.len() > before
                        && !pruned.load(Ordering::Relaxed)
                        && should_prune(&curve, &finished, warmup_steps, min_trials)
                    {
                        pruned.store(true, Ordering::Relaxed);
                        stop.stop();
                    }
                    drop(curve);
                    if stopping {
                        return;
                    }
                    std::thread::sleep(Duration::from_millis(200));
                }
            })
        };
        let outcome = up(run);
        done.store(true, Ordering::Relaxed);
        watcher
            .join()
            .map_err(|_| anyhow::anyhow!("the evaluation watcher panicked"))?;
        let curve = std::mem::take(&mut *curve.lock().expect("curve lock"));
        let pruned = pruned.load(Ordering::Relaxed);
        let trial = match outcome {
            Ok(o) => Trial {
                index,
                run_id,
                overrides: plan.clone(),
                solved: o.solved,
                pruned: pruned && !o.solved,
                env_steps: o.env_steps,
                wall_s: o.wall_s,
                best_eval: curve.iter().map(|(_, r)| *r).reduce(f64::max),
                last_eval: curve.last().map(|(_, r)| *r),
                evaluations: curve.len(),
                error: None,
            },
            Err(e) => Trial {
                index,
                run_id,
                overrides: plan.clone(),
                solved: false,
                pruned: false,
                env_steps: 0,
                wall_s: 0.0,
                best_eval: None,
                last_eval: None,
                evaluations: curve.len(),
                error: Some(format!("{e:#}")),
            },
        };
        println!(
            "   {}: {} env steps, {:.1}s, best eval {}",
            if trial.solved {
                "solved"
            } else if trial.pruned {
                "stopped early (below the median)"
            } else if trial.error.is_some() {
                "failed"
            } else {
                "not solved"
            },
            trial.env_steps,
            trial.wall_s,
            trial
                .best_eval
                .map_or("-".to_string(), |r| format!("{r:.1}"))
        );
        if let Some(e) = &trial.error {
            println!("   error: {e}");
        }
        // Only trials that ran their course set the median.
        if !trial.pruned && trial.error.is_none() {
            finished.push(curve);
        }
        trials.push(trial);
    }

    rank(&mut trials);
    println!();
    println!("| rank | trial | overrides | solved | env_steps | wall_s | best eval | last eval | status |");
    println!("|---:|---:|---|:---:|---:|---:|---:|---:|---|");
    for (rank, t) in trials.iter().enumerate() {
        println!(
            "| {} | {} | {} | {} | {} | {:.1} | {} | {} | {} |",
            rank + 1,
            t.index,
            t.overrides.join(" "),
            if t.solved { "yes" } else { "no" },
            t.env_steps,
            t.wall_s,
            t.best_eval.map_or("-".to_string(), |r| format!("{r:.1}")),
            t.last_eval.map_or("-".to_string(), |r| format!("{r:.1}")),
            if t.pruned {
                "pruned"
            } else if t.error.is_some() {
                "failed"
            } else {
                "done"
            }
        );
    }
    let summary = serde_json::json!({
        "sweep": sweep_id,
        "config": up_args.config.display().to_string(),
        "trials": trials.len(),
        "solved": trials.iter().filter(|t| t.solved).count(),
        "pruned": trials.iter().filter(|t| t.pruned).count(),
        "best": trials.first().map(|t| serde_json::json!({
            "trial": t.index, "run_id": t.run_id, "overrides": t.overrides,
            "solved": t.solved, "env_steps": t.env_steps, "best_eval": t.best_eval,
        })),
    });
    let record: PathBuf = config.run.runs_dir.join(format!("{sweep_id}.sweep.json"));
    std::fs::create_dir_all(&config.run.runs_dir)
        .with_context(|| format!("creating {}", config.run.runs_dir.display()))?;
    std::fs::write(
        &record,
        serde_json::to_string_pretty(&serde_json::json!({"summary": summary, "trials": trials}))?,
    )
    .with_context(|| format!("writing {}", record.display()))?;
    println!("{summary}");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dimensions_parse_and_bad_ones_are_named() {
        assert_eq!(
            parse_dimension("ppo.n_epochs=4, 10", false).unwrap(),
            (
                "ppo.n_epochs".to_string(),
                Dimension::Grid(vec!["4".into(), "10".into()])
            )
        );
        assert_eq!(
            parse_dimension("ppo.learning_rate=loguniform:1e-5:1e-3", true)
                .unwrap()
                .1,
            Dimension::LogUniform(1e-5, 1e-3)
        );
        assert_eq!(
            parse_dimension("ppo.n_steps=choice:64,128", true)
                .unwrap()
                .1,
            Dimension::Choice(vec!["64".into(), "128".into()])
        );
        for (spec, random, needle) in [
            ("ppo.n_epochs", false, "key=..."),
            ("=1,2", false, "empty key"),
            ("a=", false, "no values"),
            ("a=normal:0:1", true, "unknown distribution"),
            ("a=uniform:2:1", true, "LO <= HI"),
            ("a=loguniform:0:1", true, "> 0"),
            ("a=int:0.5:3", true, "integers"),
            ("a=uniform:x:1", true, "low bound"),
        ] {
            let err = format!("{:#}", parse_dimension(spec, random).unwrap_err());
            assert!(err.contains(needle), "{spec}: {err}");
        }
    }

    #[test]
    fn grids_cover_every_combination_and_random_draws_stay_in_bounds() {
        let grid = vec![
            (
                "a".to_string(),
                Dimension::Grid(vec!["1".into(), "2".into()]),
            ),
            (
                "b".to_string(),
                Dimension::Grid(vec!["x".into(), "y".into(), "z".into()]),
            ),
        ];
        let plans = plan_trials(&grid, None, 0).unwrap();
        assert_eq!(plans.len(), 6);
        assert_eq!(plans[0], vec!["a=1", "b=x"]);
        assert_eq!(plans[5], vec!["a=2", "b=z"]);
        assert_eq!(plan_trials(&grid, Some(4), 0).unwrap().len(), 4);

        let random = vec![
            ("lr".to_string(), Dimension::LogUniform(1e-5, 1e-3)),
            ("n".to_string(), Dimension::Int(1, 3)),
            (
                "c".to_string(),
                Dimension::Choice(vec!["p".into(), "q".into()]),
            ),
        ];
        let plans = plan_trials(&random, Some(50), 7).unwrap();
        assert_eq!(plans.len(), 50);
        assert_eq!(plans, plan_trials(&random, Some(50), 7).unwrap(), "seeded");
        let mut ints = std::collections::BTreeSet::new();
        for plan in &plans {
            let lr: f64 = plan[0].strip_prefix("lr=").unwrap().parse().unwrap();
            assert!((1e-5..=1e-3).contains(&lr), "{lr}");
            let n: i64 = plan[1].strip_prefix("n=").unwrap().parse().unwrap();
            ints.insert(n);
            assert!(["c=p", "c=q"].contains(&plan[2].as_str()));
        }
        assert_eq!(ints, [1, 2, 3].into_iter().collect());
        assert!(
            plan_trials(&random, None, 0).is_err(),
            "random needs --trials"
        );
        let mixed = vec![grid[0].clone(), random[0].clone()];
        assert!(plan_trials(&mixed, Some(2), 0).is_err());
        assert!(plan_trials(&[], Some(2), 0).is_err());
    }

    #[test]
    fn the_median_rule_stops_only_trials_below_the_finished_median_after_warmup() {
        let finished = vec![
            vec![(1000, 20.0), (2000, 100.0), (3000, 500.0)],
            vec![(1000, 10.0), (2000, 60.0), (3000, 200.0)],
            vec![(1000, 30.0), (2000, 40.0), (3000, 300.0)],
        ];
        // Best so far by 2000 steps: 100, 60, 40: median 60.
        let behind = vec![(1000, 5.0), (2000, 50.0)];
        assert!(should_prune(&behind, &finished, 1500, 2));
        let ahead = vec![(1000, 5.0), (2000, 70.0)];
        assert!(!should_prune(&ahead, &finished, 1500, 2));
        // Not before the warm-up, nor with too few finished trials.
        assert!(!should_prune(&behind, &finished, 2500, 2));
        assert!(!should_prune(&behind, &finished[..1], 1500, 2));
        assert!(!should_prune(&behind, &finished, 1500, 0));
        // Finished trials without an evaluation by then do not count.
        let late = vec![vec![(5000, 1.0)], vec![(5000, 1.0)], vec![(1000, 90.0)]];
        assert!(!should_prune(&behind, &late, 1500, 2));
        assert!(!should_prune(&Vec::new(), &finished, 0, 1));
    }

    #[test]
    fn trials_rank_solved_fastest_first_then_by_best_evaluation() {
        let trial = |index, solved, env_steps, best: Option<f64>| Trial {
            index,
            run_id: format!("t{index}"),
            overrides: Vec::new(),
            solved,
            pruned: false,
            env_steps,
            wall_s: 0.0,
            best_eval: best,
            last_eval: best,
            evaluations: 1,
            error: None,
        };
        let mut trials = vec![
            trial(0, false, 100, Some(300.0)),
            trial(1, true, 9000, Some(500.0)),
            trial(2, false, 100, None),
            trial(3, true, 4000, Some(480.0)),
            trial(4, false, 100, Some(450.0)),
        ];
        rank(&mut trials);
        let order: Vec<usize> = trials.iter().map(|t| t.index).collect();
        assert_eq!(order, vec![3, 1, 4, 0, 2]);
    }
}
