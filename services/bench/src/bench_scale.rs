//! `relay bench-scale`: CartPole env steps per second for several
//! env-runner and inference-server counts, one `relay up` stack scaled with
//! `relay scale`: the env steps the env-runners generate, and the env steps
//! the learner trains on (what the on-policy FIFO evicts unsampled, or the
//! learner drops as too stale, is generated but never trained on).

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use futures::StreamExt;
use relay::scale::{read_record, request};
use relay_proto::{MetricsReport, Subjects};

/// Flags of `relay bench-scale`.
#[derive(Debug, Clone, clap::Args)]
pub struct BenchScaleArgs {
    /// Experiment config.
    #[arg(long, default_value = "configs/cartpole-ppo.yaml")]
    pub config: PathBuf,
    /// Override config fields (repeatable).
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

/// `relay bench-scale`: one `relay up` stack (training, with the solving
/// threshold unreachable), scaled through every combination of env-runner
/// and inference-server counts with `relay scale`; each is measured over a
/// fixed window from the env-runners' `env_steps_total` counters.
pub fn bench_scale(args: BenchScaleArgs) -> Result<()> {
    let config = relay_config::ExperimentConfig::load(&args.config, &args.overrides)?;
    let run_id = format!("{}-scale", relay::make_run_id(&config));
    std::fs::create_dir_all(&args.state_dir)?;
    let _ = std::fs::remove_file(args.state_dir.join("stack.json"));
    let log = std::fs::File::create(args.state_dir.join("relay-up.log"))?;
    let mut command = Command::new(relay::stack::sibling_binary("relay")?);
    command
        .arg("up")
        .arg("--config")
        .arg(&args.config)
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
        "relay: bench-scale on run {run_id} ({}), {:.0}s warm-up + {:.0}s window per combination",
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
                let sps = steps / args.window_s;
                // Between the learner's first and last report in the window
                // (it reports once per update).
                let trained_sps = trained.map_or(0.0, |((first, from), (last, to))| {
                    (last - first) / (to - from).as_secs_f64().max(1e-3)
                });
                println!(
                    "relay: env-runners {runners} inference-servers {inference}: {sps:.0} env steps/s generated, {trained_sps:.0} trained on by the learner ({} runners reporting)",
                    instances.len()
                );
                rows.push((runners, inference, sps, trained_sps));
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
    let base = rows
        .iter()
        .find(|r| r.0 == 1 && r.1 == 1)
        .map_or(f64::NAN, |r| r.2);
    println!();
    println!("| env-runners | inference-servers | env steps/s generated | vs 1+1 | env steps/s trained on |");
    println!("|---:|---:|---:|---:|---:|");
    for (runners, inference, sps, trained) in &rows {
        println!(
            "| {runners} | {inference} | {sps:.0} | {:.2}x | {trained:.0} |",
            sps / base
        );
    }
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let json = serde_json::json!({
        "env": config.run.env_id,
        "cores": cores,
        "warmup_s": args.warmup_s,
        "window_s": args.window_s,
        "results": rows.iter().map(|(r, i, s, t)| serde_json::json!({"env_runners": r, "inference_servers": i, "sps": s.round(), "trained_sps": t.round()})).collect::<Vec<_>>(),
    });
    println!("{json}");
    Ok(())
}
