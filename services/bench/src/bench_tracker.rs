//! `relay bench-tracker`: training SPS with and without the tracker.

use anyhow::Result;
use relay::{make_run_id, up, UpArgs};
use relay_config::ExperimentConfig;

/// `relay bench-tracker`: training SPS with the tracker against without it
/// (metrics then go to NATS with no subscriber, a sink that drops everything),
/// over a fixed budget with solving disabled, alternating, `rounds` times each.
pub fn bench_tracker(args: UpArgs, rounds: u64, env_steps: u64) -> Result<()> {
    let config = ExperimentConfig::load(&args.config, &args.overrides)?;
    let mut rows = Vec::new();
    for round in 1..=rounds {
        for tracker in [true, false] {
            let mut run = args.clone();
            run.until_solved = true;
            run.quiet = true;
            run.overrides
                .push(format!("run.total_env_steps={env_steps}"));
            run.overrides.push("eval.threshold=1000000000".into());
            run.run_id = Some(format!(
                "{}-tracker-{}-r{round}",
                make_run_id(&config),
                if tracker { "on" } else { "off" }
            ));
            if !tracker {
                run.without.push("tracker".into());
            }
            let outcome = up(run)?;
            rows.push((tracker, outcome.env_steps as f64 / outcome.wall_s.max(1e-9)));
        }
    }
    let median = |on: bool| {
        let mut v: Vec<f64> = rows
            .iter()
            .filter(|(t, _)| *t == on)
            .map(|(_, s)| *s)
            .collect();
        v.sort_by(|a, b| a.total_cmp(b));
        v[v.len() / 2]
    };
    println!();
    println!("| tracker | runs | median training SPS |");
    println!("|---|---:|---:|");
    let (on, off) = (median(true), median(false));
    println!("| on (writes the run directory, exports metrics) | {rounds} | {on:.0} |");
    println!("| off (metrics dropped) | {rounds} | {off:.0} |");
    let overhead = 100.0 * (off - on) / off;
    println!(
        "{}",
        serde_json::json!({"env": config.run.env_id, "env_steps": env_steps, "rounds": rounds, "sps_tracker_on": on.round(), "sps_tracker_off": off.round(), "overhead_percent": (overhead * 10.0).round() / 10.0})
    );
    Ok(())
}
