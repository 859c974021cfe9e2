//! `relay bench-scale`: CartPole env steps per second for several
//! env-runner and inference-server counts, one `relay up` stack per config
//! scaled with `relay scale`: the env steps the env-runners generate, the env
//! steps the learner trains on (what the on-policy FIFO evicts unsampled, or
//! the learner drops as too stale, is generated but never trained on), and
//! the CPU time each kind of process spends per env step generated.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use futures::StreamExt;
use relay::scale::{read_record, request};
use relay_proto::{MetricsReport, Subjects};

/// Env steps per second through the stack that issue 25 asks of CartPole PPO
/// on 2 cores.
const TARGET_SPS: f64 = 100_000.0;

/// Flags of `relay bench-scale`.
#[derive(Debug, Clone, clap::Args)]
pub struct BenchScaleArgs {
    /// Experiment configs, each measured on a stack of its own: the rl-zoo
    /// preset and the one shaped for throughput.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "configs/cartpole-ppo.yaml,configs/cartpole-ppo-throughput.yaml"
    )]
    pub configs: Vec<PathBuf>,
    /// Override config fields of every config (repeatable).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub overrides: Vec<String>,
    /// Folder for the benchmark stack's state.
    #[arg(long, default_value = ".relay/bench-scale")]
    pub state_dir: PathBuf,
    /// Seconds after each scale step before measuring.
    #[arg(long, default_value_t = 5.0)]
    pub warmup_s: f64,
    /// Seconds of each measurement window.
    #[arg(long, default_value_t = 10.0)]
    pub window_s: f64,
    /// Env-runner counts to measure.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4")]
    pub env_runners: Vec<u32>,
    /// Inference-server counts to measure.
    #[arg(long, value_delimiter = ',', default_value = "1,2")]
    pub inference_servers: Vec<u32>,
}

/// One measured combination of one config.
struct Row {
    /// The config file's stem.
    config: String,
    env_runners: u32,
    inference_servers: u32,
    /// Env steps per second the env-runners generated.
    sps: f64,
    /// Env steps per second the learner trained on.
    trained_sps: f64,
    /// CPU microseconds per generated env step of each kind of process
    /// (service copies summed; NATS, Redis and Prometheus included).
    cpu_us_per_step: BTreeMap<String, f64>,
}

/// The infrastructure processes of a stack, beside its services
/// ([`relay::stack::SERVICES`]) in the CPU breakdown.
const INFRA: [&str; 3] = ["nats-server", "redis-server", "prometheus"];

/// The kinds of process in the CPU breakdown, in the table's order.
fn process_kinds() -> impl Iterator<Item = &'static str> {
    relay::stack::SERVICES.into_iter().chain(INFRA)
}

/// Kills the benchmark's `relay up` if the benchmark fails half-way.
struct Supervisor(std::process::Child);

impl Drop for Supervisor {
    fn drop(&mut self) {
        if matches!(self.0.try_wait(), Ok(None)) {
            // SAFETY: kill(2) on a pid this process started.
            unsafe {
                libc::kill(self.0.id() as i32, libc::SIGINT);
            }
            let _ = self.0.wait();
        }
    }
}

/// `relay bench-scale`: each config on a `relay up` stack of its own, then
/// a table of every combination, a table of CPU per env step, and a JSON line.
pub fn bench_scale(args: BenchScaleArgs) -> Result<()> {
    let mut rows = Vec::new();
    let mut env_id = String::new();
    for config in &args.configs {
        let (env, measured) = measure_config(&args, config)?;
        env_id = env;
        rows.extend(measured);
    }
    println!();
    println!("| config | env-runners | inference-servers | env steps/s generated | vs 1+1 | env steps/s trained on |");
    println!("|---|---:|---:|---:|---:|---:|");
    for row in &rows {
        let base = rows
            .iter()
            .find(|r| r.config == row.config && r.env_runners == 1 && r.inference_servers == 1)
            .map_or(f64::NAN, |r| r.sps);
        println!(
            "| {} | {} | {} | {:.0} | {:.2}x | {:.0} |",
            row.config,
            row.env_runners,
            row.inference_servers,
            row.sps,
            row.sps / base,
            row.trained_sps
        );
    }
    println!();
    println!("CPU microseconds per env step generated, by process (copies summed):");
    println!();
    let kinds: Vec<&str> = process_kinds().collect();
    println!(
        "| config | runners x servers | {} | total |",
        kinds.join(" | ")
    );
    println!("|---|---|{}---:|", "---:|".repeat(kinds.len()));
    for row in &rows {
        let cells: Vec<String> = kinds
            .iter()
            .map(|k| format!("{:.2}", row.cpu_us_per_step.get(*k).copied().unwrap_or(0.0)))
            .collect();
        println!(
            "| {} | {} x {} | {} | {:.2} |",
            row.config,
            row.env_runners,
            row.inference_servers,
            cells.join(" | "),
            row.cpu_us_per_step.values().sum::<f64>()
        );
    }
    let best_trained = rows.iter().map(|r| r.trained_sps).fold(0.0, f64::max);
    let best_generated = rows.iter().map(|r| r.sps).fold(0.0, f64::max);
    println!();
    println!(
        "relay: best {best_trained:.0} env steps/s trained on ({best_generated:.0} generated); target {TARGET_SPS:.0}: {}",
        if best_trained >= TARGET_SPS { "met" } else { "not met" }
    );
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let json = serde_json::json!({
        "env": env_id,
        "cores": cores,
        "warmup_s": args.warmup_s,
        "window_s": args.window_s,
        "target_sps": TARGET_SPS,
        "best_trained_sps": best_trained.round(),
        "best_sps": best_generated.round(),
        "target_met": best_trained >= TARGET_SPS,
        "results": rows.iter().map(|r| serde_json::json!({
            "config": r.config,
            "env_runners": r.env_runners,
            "inference_servers": r.inference_servers,
            "sps": r.sps.round(),
            "trained_sps": r.trained_sps.round(),
            "cpu_us_per_step": r.cpu_us_per_step.iter().map(|(k, v)| (k.clone(), serde_json::json!((v * 100.0).round() / 100.0))).collect::<serde_json::Map<_, _>>(),
        })).collect::<Vec<_>>(),
    });
    println!("{json}");
    Ok(())
}

/// The CPU seconds used so far by every process of the stack, summed by
/// kind (`env-runner-1` counts as `env-runner`).
fn cpu_by_kind(state_dir: &Path) -> Result<BTreeMap<String, f64>> {
    let record = read_record(state_dir)?;
    let mut by_kind = BTreeMap::new();
    for p in &record.processes {
        let kind = match p.name.rsplit_once('-') {
            Some((kind, copy)) if copy.parse::<u32>().is_ok() => kind,
            _ => p.name.as_str(),
        };
        if let Some(seconds) = crate::cpu_seconds(p.pid) {
            *by_kind.entry(kind.to_string()).or_insert(0.0) += seconds;
        }
    }
    Ok(by_kind)
}

/// One `relay up` stack (training, with the solving threshold unreachable)
/// on `config_path`, scaled through every combination of env-runner and
/// inference-server counts with `relay scale`; each is measured over a
/// fixed window from the env-runners' `env_steps_total` counters, the
/// learner's `learner_env_steps` and every process's CPU time. Returns the
/// env id and the rows.
fn measure_config(args: &BenchScaleArgs, config_path: &Path) -> Result<(String, Vec<Row>)> {
    let config = relay_config::ExperimentConfig::load(config_path, &args.overrides)?;
    let config_name = config_path.file_stem().map_or_else(
        || config_path.display().to_string(),
        |s| s.to_string_lossy().into_owned(),
    );
    let run_id = format!("{}-scale", relay::make_run_id(&config));
    std::fs::create_dir_all(&args.state_dir)?;
    let _ = std::fs::remove_file(args.state_dir.join("stack.json"));
    let log = std::fs::File::create(args.state_dir.join("relay-up.log"))?;
    let mut command = Command::new(relay::stack::sibling_binary("relay")?);
    command
        .arg("up")
        .arg("--config")
        .arg(config_path)
        .arg("--state-dir")
        .arg(&args.state_dir)
        .args(["--run-id", &run_id, "--quiet"]);
    for o in &args.overrides {
        command.args(["--set", o]);
    }
    command.args([
        "--set",
        "run.total_env_steps=1000000000000",
        "--set",
        "eval.threshold=1000000000",
    ]);
    let mut supervisor = Supervisor(
        command
            .stdout(log.try_clone()?)
            .stderr(log)
            .stdin(Stdio::null())
            .spawn()
            .context("starting relay up")?,
    );
    let deadline = Instant::now() + Duration::from_secs(120);
    let record = loop {
        if let Ok(r) = read_record(&args.state_dir) {
            // stack.json is written before the services; wait for the learner.
            if r.processes.iter().any(|p| p.name.starts_with("learner")) {
                break r;
            }
        }
        if let Some(status) = supervisor.0.try_wait()? {
            bail!(
                "relay up exited with {status}; see {}/relay-up.log",
                args.state_dir.display()
            );
        }
        if Instant::now() > deadline {
            bail!("the stack did not start within 120 s");
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    println!(
        "relay: bench-scale of {config_name} on run {run_id} ({}), {:.0}s warm-up + {:.0}s window per combination",
        config.run.env_id, args.warmup_s, args.window_s
    );
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let rows = runtime.block_on(async {
        let client = async_nats::connect(&record.nats_url).await?;
        let mut metrics = client
            .subscribe(Subjects::new(&run_id).metrics())
            .await?;
        let mut rows = Vec::new();
        for &inference in &args.inference_servers {
            for &runners in &args.env_runners {
                request(&client, &run_id, "inference-server", inference).await?;
                request(&client, &run_id, "env-runner", runners).await?;
                let warm = tokio::time::sleep(Duration::from_secs_f64(args.warmup_s));
                tokio::pin!(warm);
                loop {
                    tokio::select! {
                        _ = &mut warm => break,
                        _ = metrics.next() => {}
                    }
                }
                // After the warm-up the record names every copy scaled to.
                let cpu_before = cpu_by_kind(&args.state_dir)?;
                let window = tokio::time::sleep(Duration::from_secs_f64(args.window_s));
                tokio::pin!(window);
                let mut steps = 0.0;
                let mut instances = std::collections::BTreeSet::new();
                // The learner's count of env steps it trained on, with
                // when it came, at the window's first and last learner report.
                let mut trained: Option<((f64, Instant), (f64, Instant))> = None;
                loop {
                    tokio::select! {
                        _ = &mut window => break,
                        Some(m) = metrics.next() => {
                            let Ok(report) = relay_proto::decode::<MetricsReport>(&m.payload) else { continue };
                            for v in &report.values {
                                if report.service == "env-runner" && v.name == "env_steps_total" {
                                    steps += v.value;
                                    instances.insert(report.instance.clone());
                                }
                                if report.service == "learner" && v.name == "learner_env_steps" {
                                    let now = (v.value, Instant::now());
                                    trained = Some((trained.map_or(now, |t| t.0), now));
                                }
                            }
                        }
                    }
                }
                let cpu_after = cpu_by_kind(&args.state_dir)?;
                let sps = steps / args.window_s;
                // Between the learner's first and last report in the window
                // (it reports once per update).
                let trained_sps = trained.map_or(0.0, |((first, from), (last, to))| {
                    (last - first) / (to - from).as_secs_f64().max(1e-3)
                });
                let cpu_us_per_step: BTreeMap<String, f64> = cpu_after
                    .iter()
                    .map(|(kind, after)| {
                        let used = after - cpu_before.get(kind).copied().unwrap_or(0.0);
                        (kind.clone(), used * 1e6 / steps.max(1.0))
                    })
                    .collect();
                println!(
                    "relay: {config_name}, env-runners {runners} inference-servers {inference}: {sps:.0} env steps/s generated, {trained_sps:.0} trained on by the learner ({} runners reporting); {:.2} CPU µs per env step",
                    instances.len(),
                    cpu_us_per_step.values().sum::<f64>()
                );
                rows.push(Row {
                    config: config_name.clone(),
                    env_runners: runners,
                    inference_servers: inference,
                    sps,
                    trained_sps,
                    cpu_us_per_step,
                });
            }
        }
        anyhow::Ok(rows)
    })?;
    // SIGINT: the supervisor stops the stack in order.
    // SAFETY: kill(2) on a pid this process started.
    unsafe {
        libc::kill(supervisor.0.id() as i32, libc::SIGINT);
    }
    let status = supervisor.0.wait()?;
    if !status.success() {
        eprintln!("relay: relay up exited with {status}");
    }
    Ok((config.run.env_id.clone(), rows))
}
