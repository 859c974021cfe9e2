//! `relay bench-envs` (`just bench-envs`): raw env stepping on one core.
//!
//! For each built-in env (CartPole-v1, Acrobot-v1, MountainCar-v0,
//! Pendulum-v1) and each number of envs N, env steps per second of:
//! - `relay`: relay's Rust [`VecEnv`] in this process, one thread;
//! - `gymnasium`: Gymnasium's `SyncVectorEnv` of N envs in one Python
//!   process (the env bridge's interpreter, `.relay/python`);
//! - `envpool`: EnvPool (PyPI `envpool`) with `num_threads=1` and
//!   `batch_size=N`, from its own interpreter (`.relay/envpool`, made by
//!   `deploy/install.sh --envpool`, or `RELAY_ENVPOOL_PYTHON`); reported
//!   as missing where it does not install or lacks the id.
//!
//! All step with pre-drawn uniformly random actions, episodes reset
//! automatically (Gymnasium's and EnvPool's autoreset included), and each
//! figure is the median of `--rounds` measurements of `--seconds`.
//! Targets (issue "speed"): relay at least as fast per core as EnvPool and
//! at least 100x Gymnasium. Prints a table and, last, one JSON line.

use std::path::PathBuf;
use std::process::Command;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use rand::{Rng, SeedableRng};
use relay_bridge::EnvSection;
use relay_envs::{ActionSpace, VecActions, VecEnv};
use serde_json::json;

/// `relay bench-envs` flags.
#[derive(Debug, clap::Args)]
pub struct BenchEnvsArgs {
    /// Env ids (built-in ones), comma-separated.
    #[arg(
        long,
        default_value = "CartPole-v1,Acrobot-v1,MountainCar-v0,Pendulum-v1",
        value_delimiter = ','
    )]
    pub ids: Vec<String>,
    /// Numbers of envs, comma-separated.
    #[arg(long, default_value = "1,16", value_delimiter = ',')]
    pub envs: Vec<usize>,
    /// Seconds each measurement runs (after a short warm-up).
    #[arg(long, default_value_t = 0.5)]
    pub seconds: f64,
    /// Measurements per figure (the table shows their median).
    #[arg(long, default_value_t = 5)]
    pub rounds: usize,
}

/// Steps Python vector envs (`gymnasium` or `envpool`) and prints one JSON
/// object: `{"<id>/<n>": median env steps/s or an error string}`.
const PYTHON_BENCH: &str = r#"
import json, sys, time, warnings
warnings.filterwarnings("ignore")
import numpy as np
kind, ids, ns, seconds, rounds = sys.argv[1], sys.argv[2].split(","), [int(n) for n in sys.argv[3].split(",")], float(sys.argv[4]), int(sys.argv[5])
out = {}
for env_id in ids:
    for n in ns:
        key = f"{env_id}/{n}"
        try:
            if kind == "gymnasium":
                import gymnasium as gym
                envs = gym.vector.SyncVectorEnv([lambda: gym.make(env_id) for _ in range(n)])
                envs.reset(seed=0)
                space = envs.single_action_space
            else:
                import envpool
                envs = envpool.make(env_id, env_type="gymnasium", num_envs=n, batch_size=n, num_threads=1, seed=0)
                envs.reset()
                space = envs.action_space
            rng = np.random.default_rng(0)
            if hasattr(space, "n"):
                actions = [rng.integers(0, space.n, size=n).astype(space.dtype) for _ in range(1024)]
            else:
                actions = [rng.uniform(space.low, space.high, size=(n,) + space.shape).astype(space.dtype) for _ in range(1024)]
            for i in range(100):
                envs.step(actions[i % 1024])
            figures = []
            for _ in range(rounds):
                steps, start = 0, time.perf_counter()
                while time.perf_counter() - start < seconds:
                    for _ in range(50):
                        envs.step(actions[steps % 1024])
                        steps += 1
                figures.append(steps * n / (time.perf_counter() - start))
            out[key] = float(np.median(figures))
            envs.close()
        except Exception as e:
            out[key] = f"{type(e).__name__}: {e}"
print(json.dumps(out))
"#;

/// The interpreter EnvPool runs in, if there is one.
fn envpool_python() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("RELAY_ENVPOOL_PYTHON") {
        return Some(PathBuf::from(p));
    }
    let local = PathBuf::from(".relay/envpool/bin/python");
    local.is_file().then_some(local)
}

/// Runs [`PYTHON_BENCH`] under `python`: `"<id>/<n>"` -> steps/s or why not.
fn python_figures(
    python: &std::path::Path,
    kind: &str,
    args: &BenchEnvsArgs,
) -> Result<serde_json::Map<String, serde_json::Value>> {
    let ns: Vec<String> = args.envs.iter().map(|n| n.to_string()).collect();
    let out = Command::new(python)
        .args([
            "-c",
            PYTHON_BENCH,
            kind,
            &args.ids.join(","),
            &ns.join(","),
            &args.seconds.to_string(),
            &args.rounds.to_string(),
        ])
        // One core: no BLAS or OpenMP threads behind numpy.
        .env("OMP_NUM_THREADS", "1")
        .output()
        .with_context(|| format!("run {}", python.display()))?;
    if !out.status.success() {
        bail!(
            "{kind} benchmark failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let stdout = String::from_utf8_lossy(&out.stdout);
    let last = stdout.lines().last().unwrap_or_default();
    serde_json::from_str(last).with_context(|| format!("{kind} benchmark printed {last:?}"))
}

/// Median env steps/s of relay's `VecEnv` of `id` with `n` envs.
fn relay_sps(id: &str, n: usize, seconds: f64, rounds: usize) -> Result<f64> {
    let mut envs = VecEnv::new(id, n, 0)?;
    envs.reset()?;
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(0);
    let space = envs.spec().action_space.clone();
    let (discrete, continuous): (Vec<Vec<i64>>, Vec<Vec<f32>>) = match &space {
        ActionSpace::Discrete { n: k } => (
            (0..1024)
                .map(|_| (0..n).map(|_| rng.random_range(0..*k as i64)).collect())
                .collect(),
            Vec::new(),
        ),
        ActionSpace::Box { low, high } => (
            Vec::new(),
            (0..1024)
                .map(|_| {
                    (0..n)
                        .flat_map(|_| {
                            low.iter()
                                .zip(high)
                                .map(|(l, h)| l + (h - l) * rng.random::<f32>())
                                .collect::<Vec<_>>()
                        })
                        .collect()
                })
                .collect(),
        ),
    };
    let mut step = |i: usize| -> Result<()> {
        let actions = match &space {
            ActionSpace::Discrete { .. } => VecActions::Discrete(&discrete[i % 1024]),
            ActionSpace::Box { .. } => VecActions::Continuous(&continuous[i % 1024]),
        };
        envs.step(actions)?;
        Ok(())
    };
    for i in 0..100 {
        step(i)?;
    }
    let mut figures = Vec::with_capacity(rounds);
    for _ in 0..rounds {
        let start = Instant::now();
        let mut steps = 0usize;
        while start.elapsed().as_secs_f64() < seconds {
            for _ in 0..1000 {
                step(steps)?;
                steps += 1;
            }
        }
        figures.push((steps * n) as f64 / start.elapsed().as_secs_f64());
    }
    Ok(median(figures))
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn fmt_sps(v: Option<f64>) -> String {
    v.map_or("missing".into(), |v| format!("{:.0}", v))
}

/// `relay bench-envs`.
pub fn bench_envs(args: BenchEnvsArgs) -> Result<()> {
    if args.rounds == 0 || args.envs.is_empty() || args.ids.is_empty() {
        bail!("--rounds, --envs and --ids must not be empty");
    }
    for id in &args.ids {
        if !relay_envs::ENV_IDS.contains(&id.as_str()) {
            bail!(
                "{id} is not one of relay's built-in envs ({})",
                relay_envs::ENV_IDS.join(", ")
            );
        }
    }
    let gymnasium = python_figures(&EnvSection::default().interpreter(), "gymnasium", &args)?;
    let envpool = match envpool_python() {
        Some(python) => python_figures(&python, "envpool", &args).unwrap_or_else(|e| {
            eprintln!("relay: envpool: {e}");
            Default::default()
        }),
        None => {
            eprintln!("relay: EnvPool is not installed (bash deploy/install.sh --envpool); its column is missing");
            Default::default()
        }
    };
    let figure = |m: &serde_json::Map<String, serde_json::Value>, key: &str| match m.get(key) {
        Some(serde_json::Value::Number(n)) => n.as_f64(),
        Some(serde_json::Value::String(why)) => {
            eprintln!("relay: {key}: {why}");
            None
        }
        _ => None,
    };
    println!("| env | envs | relay VecEnv (1 core) | Gymnasium SyncVectorEnv | EnvPool (1 thread) | relay / Gymnasium | relay / EnvPool |");
    println!("|---|---:|---:|---:|---:|---:|---:|");
    let mut rows = Vec::new();
    let (mut beats_envpool, mut hundredfold) = (true, true);
    for id in &args.ids {
        for &n in &args.envs {
            let key = format!("{id}/{n}");
            let relay = relay_sps(id, n, args.seconds, args.rounds)?;
            let gym = figure(&gymnasium, &key);
            let pool = figure(&envpool, &key);
            let vs_gym = gym.map(|g| relay / g);
            let vs_pool = pool.map(|p| relay / p);
            hundredfold &= vs_gym.is_some_and(|r| r >= 100.0);
            beats_envpool &= vs_pool.is_some_and(|r| r >= 1.0);
            println!(
                "| {id} | {n} | {:.0} | {} | {} | {} | {} |",
                relay,
                fmt_sps(gym),
                fmt_sps(pool),
                vs_gym.map_or("-".into(), |r| format!("{r:.0}x")),
                vs_pool.map_or("-".into(), |r| format!("{r:.1}x")),
            );
            rows.push(json!({
                "env_id": id, "envs": n, "relay_sps": relay, "gymnasium_sps": gym,
                "envpool_sps": pool, "relay_over_gymnasium": vs_gym, "relay_over_envpool": vs_pool,
            }));
        }
    }
    println!(
        "{}",
        json!({
            "rows": rows,
            "seconds": args.seconds,
            "rounds": args.rounds,
            "at_least_100x_gymnasium": hundredfold,
            "at_least_envpool": beats_envpool,
        })
    );
    Ok(())
}
