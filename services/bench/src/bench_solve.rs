//! `relay bench-solve`: the stack solving a config for several seeds, each
//! solve confirmed by re-evaluating the run's best checkpoint offline.

use anyhow::{bail, Result};
use relay::{eval, make_run_id, up, FirstPass, Outcome, UpArgs};
use relay_config::ExperimentConfig;

/// Episodes of the offline re-evaluation of each benchmark run's best
/// checkpoint (on the run's fresh seeds, which no evaluation played). A
/// thousand, so the judge is at least as precise as the confirmations it
/// checks: over 100, Acrobot's heavy-tailed greedy returns (std 15-30)
/// scatter the mean by 3 points either way, failing checkpoints whose mean
/// over thousands of episodes clears the goal and passing some that do not.
pub const REEVAL_EPISODES: usize = 1000;

/// A benchmark run's `best` checkpoint played offline over
/// [`REEVAL_EPISODES`] fresh episodes (`None`, logged, when the run has no
/// best checkpoint or it cannot be played).
pub fn reevaluate_best(config: &ExperimentConfig, run_id: &str) -> Option<eval::CheckpointEval> {
    reevaluate(config, run_id, "best")
}

/// A run's checkpoint `which` (`best`, `last`) re-evaluated like
/// [`reevaluate_best`].
pub fn reevaluate(
    config: &ExperimentConfig,
    run_id: &str,
    which: &str,
) -> Option<eval::CheckpointEval> {
    let episodes = reeval_episodes(config);
    match eval::evaluate_checkpoint(&config.run.runs_dir, run_id, which, episodes, None) {
        Ok(e) => Some(e),
        Err(e) => {
            println!("relay: {run_id}: {which} checkpoint not re-evaluated: {e:#}");
            None
        }
    }
}

/// Fresh episodes a re-evaluation plays: [`REEVAL_EPISODES`], or for a
/// parallel game played by one shared policy as many games as make that
/// many agents' episodes (50 games of Pistonball's 20 pistons).
pub fn reeval_episodes(config: &ExperimentConfig) -> usize {
    let team = config.env_spec().map_or(1, |s| s.team.len().max(1));
    (REEVAL_EPISODES / team).max(1)
}

/// A self-play benchmark run's `best` checkpoint against `opponents` (a
/// comma list of `vs-opponent`'s), on the same fresh games as
/// [`reevaluate_best`] (`None`, logged, when it cannot be played).
pub fn reevaluate_best_against(
    config: &ExperimentConfig,
    run_id: &str,
    opponents: &str,
) -> Option<eval::CheckpointEval> {
    match eval::evaluate_checkpoint_against(
        &config.run.runs_dir,
        run_id,
        "best",
        REEVAL_EPISODES,
        None,
        Some(opponents),
    ) {
        Ok(e) => Some(e),
        Err(e) => {
            println!("relay: {run_id}: best checkpoint not played against {opponents}: {e:#}");
            None
        }
    }
}

/// `relay bench-solve`: one full-stack run per seed, each until solved
/// (screening and confirmation), then its best checkpoint re-evaluated
/// offline; a seed reaches the goal only if that re-evaluation passes too.
pub fn bench_solve(args: UpArgs, seeds: u64) -> Result<()> {
    if seeds == 0 {
        bail!("--seeds must be at least 1");
    }
    let config = ExperimentConfig::load(&args.config, &args.overrides)?;
    let mut rows = Vec::new();
    for seed in 1..=seeds {
        let mut run = args.clone();
        run.until_solved = true;
        run.quiet = true;
        run.overrides.push(format!("run.seed={seed}"));
        run.run_id = Some(format!("{}-s{seed}", make_run_id(&config)));
        let outcome = up(run)?;
        let reeval = reevaluate_best(&config, &outcome.run_id);
        rows.push((seed, outcome, reeval));
    }
    let threshold = config.solved_threshold();
    let fmt = |v: Option<f64>| v.map_or("-".to_string(), |r| format!("{r:.1}"));
    println!();
    println!("| seed | solved (confirmed) | startup_s | wall_s | env_steps | sps | screening | confirmation | first pass: wall_s | first pass: env_steps | best re-evaluated ({REEVAL_EPISODES} fresh) | reached |");
    println!("|-----:|:------:|----------:|-------:|----------:|----:|------:|------:|------:|------:|------:|:---:|");
    let reached = |o: &Outcome, r: &Option<eval::CheckpointEval>| {
        o.solved && r.as_ref().and_then(|r| r.passed).unwrap_or(false)
    };
    for (seed, o, r) in &rows {
        println!(
            "| {seed} | {} | {:.1} | {:.2} | {} | {:.0} | {} | {} | {} | {} | {} | {} |",
            if o.solved { "yes" } else { "no" },
            o.startup_s,
            o.wall_s,
            o.env_steps,
            o.env_steps as f64 / o.wall_s.max(1e-9),
            fmt(o.eval_return),
            fmt(o.confirmed_return),
            o.first_pass
                .map_or("-".into(), |f| format!("{:.2}", f.wall_s)),
            o.first_pass.map_or("-".into(), |f| f.env_steps.to_string()),
            r.as_ref().map_or("-".into(), |r| format!(
                "{:.1} ± {:.1} (min {:.0})",
                r.mean_return, r.std_return, r.min_return
            )),
            if reached(o, r) { "yes" } else { "no" },
        );
    }
    let median = |mut v: Vec<f64>| {
        if v.is_empty() {
            return serde_json::Value::Null;
        }
        v.sort_by(|a, b| a.total_cmp(b));
        serde_json::json!(v[v.len() / 2])
    };
    let solved: Vec<&Outcome> = rows
        .iter()
        .map(|(_, o, _)| o)
        .filter(|o| o.solved)
        .collect();
    let pick = |f: &dyn Fn(&Outcome) -> f64| median(solved.iter().map(|o| f(o)).collect());
    let first: Vec<FirstPass> = rows.iter().filter_map(|(_, o, _)| o.first_pass).collect();
    let json = serde_json::json!({
        "env": config.run.env_id,
        "seeds": seeds,
        "threshold": threshold,
        "solved": solved.len(),
        "reached": rows.iter().filter(|(_, o, r)| reached(o, r)).count(),
        "median_wall_s": pick(&|o| (o.wall_s * 100.0).round() / 100.0),
        "median_env_steps": pick(&|o| o.env_steps as f64),
        "median_sps": pick(&|o| (o.env_steps as f64 / o.wall_s.max(1e-9)).round()),
        "median_startup_s": pick(&|o| (o.startup_s * 100.0).round() / 100.0),
        "first_pass_median_wall_s": median(first.iter().map(|f| (f.wall_s * 100.0).round() / 100.0).collect()),
        "first_pass_median_env_steps": median(first.iter().map(|f| f.env_steps as f64).collect()),
        "best_reeval_returns": rows.iter().map(|(_, _, r)| r.as_ref().map(|r| (r.mean_return * 10.0).round() / 10.0)).collect::<Vec<_>>(),
    });
    println!("{json}");
    Ok(())
}
