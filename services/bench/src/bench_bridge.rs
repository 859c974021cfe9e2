//! `relay bench-bridge` (`just bench-bridge`): what the env bridge costs.
//!
//! For each number of envs N, env steps per second of Gymnasium's
//! CartPole-v1:
//! - `gymnasium`: Gymnasium's own `SyncVectorEnv` of N envs in one Python
//!   process, stepped with pre-drawn actions (the reference: what a
//!   Python trainer pays for its envs);
//! - `bridge`: the same N envs through relay's bridge ([`PyVecEnv`], one
//!   worker process), actions from Rust: one pipe round trip per step;
//! - `bridge xW`: the same with `--workers` processes stepping in parallel;
//! - `builtin`: relay's Rust CartPole (the fast path for the ids it has).
//!
//! `ratio` is bridge / gymnasium (target: at least 0.8). Each column is
//! measured `--rounds` times, in turn with the others, and the table shows
//! medians. Prints a table and, last, one JSON line.

use std::process::Command;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use rand::{Rng, SeedableRng};
use relay_bridge::{Backend, EnvSection, PyVecEnv};
use relay_envs::{VecActions, VecEnv};

/// `relay bench-bridge` flags.
#[derive(Debug, clap::Args)]
pub struct BenchBridgeArgs {
    /// Numbers of envs, comma-separated.
    #[arg(long, default_value = "1,8,64", value_delimiter = ',')]
    pub envs: Vec<usize>,
    /// Seconds each measurement runs (after a short warm-up).
    #[arg(long, default_value_t = 0.5)]
    pub seconds: f64,
    /// Measurements of each column per number of envs, taken in turn (the
    /// table shows their medians: a shared machine's noise hits all alike).
    #[arg(long, default_value_t = 9)]
    pub rounds: usize,
    /// Worker processes of the `bridge xW` column.
    #[arg(long, default_value_t = 2)]
    pub workers: usize,
    /// Gymnasium env id.
    #[arg(long, default_value = "CartPole-v1")]
    pub env_id: String,
}

#[derive(Debug, serde::Serialize)]
struct Row {
    envs: usize,
    gymnasium_sps: f64,
    bridge_sps: f64,
    bridge_workers_sps: f64,
    builtin_sps: Option<f64>,
    ratio: f64,
}

/// Gymnasium's `SyncVectorEnv`, timed inside Python.
const SYNC_VECTOR_ENV: &str = r#"
import sys, time, warnings
import numpy as np
import gymnasium as gym
warnings.filterwarnings("ignore")
env_id, n, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
envs = gym.vector.SyncVectorEnv([lambda: gym.make(env_id) for _ in range(n)])
envs.reset(seed=0)
rng = np.random.default_rng(0)
actions = [rng.integers(0, envs.single_action_space.n, size=n) for _ in range(1024)]
for i in range(100):
    envs.step(actions[i % 1024])
steps, start = 0, time.perf_counter()
while time.perf_counter() - start < seconds:
    for _ in range(50):
        envs.step(actions[steps % 1024])
        steps += 1
print(steps * n / (time.perf_counter() - start))
"#;

fn gymnasium_sps(section: &EnvSection, env_id: &str, n: usize, seconds: f64) -> Result<f64> {
    let python = section.interpreter();
    let out = Command::new(&python)
        .args([
            "-c",
            SYNC_VECTOR_ENV,
            env_id,
            &n.to_string(),
            &seconds.to_string(),
        ])
        .output()
        .with_context(|| format!("run {}", python.display()))?;
    if !out.status.success() {
        bail!(
            "SyncVectorEnv benchmark failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().parse()?)
}

/// Steps `step` with random discrete actions for `seconds`; env steps/s.
fn time_steps(
    n: usize,
    actions: usize,
    seconds: f64,
    mut step: impl FnMut(&[i64]) -> Result<()>,
) -> Result<f64> {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(0);
    let batches: Vec<Vec<i64>> = (0..1024)
        .map(|_| {
            (0..n)
                .map(|_| rng.random_range(0..actions as i64))
                .collect()
        })
        .collect();
    for b in batches.iter().take(100) {
        step(b)?;
    }
    let start = Instant::now();
    let mut steps = 0usize;
    while start.elapsed().as_secs_f64() < seconds {
        for _ in 0..50 {
            step(&batches[steps % 1024])?;
            steps += 1;
        }
    }
    Ok((steps * n) as f64 / start.elapsed().as_secs_f64())
}

fn bridge_sps(section: &EnvSection, env_id: &str, n: usize, seconds: f64) -> Result<f64> {
    let mut envs = PyVecEnv::new(env_id, section, n, 0)?;
    envs.reset()?;
    let actions = envs.spec().action_space.n().context("a discrete env")?;
    time_steps(n, actions, seconds, |a| {
        envs.step(VecActions::Discrete(a))?;
        Ok(())
    })
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// `relay bench-bridge`.
pub fn bench_bridge(args: BenchBridgeArgs) -> Result<()> {
    let section = EnvSection {
        backend: Backend::Gymnasium,
        ..EnvSection::default()
    };
    let parallel = EnvSection {
        workers: args.workers,
        ..section.clone()
    };
    let mut rows = Vec::new();
    for &n in &args.envs {
        let mut gymnasium = Vec::new();
        let mut bridge = Vec::new();
        let mut bridge_workers = Vec::new();
        let mut builtin = Vec::new();
        for _ in 0..args.rounds.max(1) {
            gymnasium.push(gymnasium_sps(&section, &args.env_id, n, args.seconds)?);
            bridge.push(bridge_sps(&section, &args.env_id, n, args.seconds)?);
            bridge_workers.push(bridge_sps(&parallel, &args.env_id, n, args.seconds)?);
            if let Ok(mut envs) = VecEnv::new(&args.env_id, n, 0) {
                envs.reset()?;
                let actions = envs.spec().action_space.n().unwrap_or(1);
                builtin.push(time_steps(n, actions, args.seconds, |a| {
                    envs.step(VecActions::Discrete(a))?;
                    Ok(())
                })?);
            }
        }
        let (gymnasium, bridge) = (median(gymnasium), median(bridge));
        rows.push(Row {
            envs: n,
            gymnasium_sps: gymnasium,
            bridge_sps: bridge,
            bridge_workers_sps: median(bridge_workers),
            builtin_sps: (!builtin.is_empty()).then(|| median(builtin)),
            ratio: bridge / gymnasium,
        });
    }
    println!(
        "{} env steps/s: Gymnasium SyncVectorEnv vs relay's env bridge (1 and {} workers) vs built in",
        args.env_id, args.workers
    );
    println!(
        "{:>6} {:>14} {:>14} {:>14} {:>14} {:>7}",
        "envs",
        "gymnasium",
        "bridge",
        format!("bridge x{}", args.workers),
        "builtin",
        "ratio"
    );
    for r in &rows {
        println!(
            "{:>6} {:>14.0} {:>14.0} {:>14.0} {:>14} {:>7.2}",
            r.envs,
            r.gymnasium_sps,
            r.bridge_sps,
            r.bridge_workers_sps,
            r.builtin_sps.map_or("-".into(), |s| format!("{s:.0}")),
            r.ratio
        );
    }
    println!(
        "{}",
        serde_json::json!({
            "bench": "bridge",
            "env_id": args.env_id,
            "workers": args.workers,
            "rows": rows,
            "min_ratio": rows.iter().map(|r| r.ratio).fold(f64::INFINITY, f64::min),
        })
    );
    Ok(())
}
