//! `relay chaos`: fault injection on a local stack training CartPole. Each
//! service (and NATS and Redis) is SIGKILLed in turn and restarted with its
//! former flags; the time until the learner's env steps grow again and the
//! rollout fragments lost are measured. At the end the run must reach solved
//! and its registry entry and checkpoints must still parse.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use futures::StreamExt;
use relay_config::ExperimentConfig;
use relay_proto::{EvalReport, MetricsReport, Subjects};

use relay::stack::{Stack, SERVICES};
use relay::{make_run_id, UpArgs};

/// What the watcher has heard on NATS.
#[derive(Default)]
struct Heard {
    /// Every `learner_env_steps` report: (when, value).
    steps: Vec<(Instant, f64)>,
    /// When a solved eval arrived.
    solved: Vec<Instant>,
    /// When any eval arrived.
    evals: Vec<Instant>,
}

struct Row {
    fault: String,
    recover_s: Option<f64>,
    lost: f64,
    note: String,
}

/// `relay chaos`.
pub fn chaos(mut args: UpArgs) -> Result<()> {
    let limit = Duration::from_secs(args.for_seconds.unwrap_or(300));
    let begun = Instant::now();
    args.overrides.extend([
        "run.total_env_steps=1000000000".to_string(),
        "run.stop_when_solved=false".to_string(),
        "ppo.checkpoint_every=5".to_string(),
    ]);
    let config = ExperimentConfig::load(&args.config, &args.overrides)?;
    let run_id = args
        .run_id
        .clone()
        .unwrap_or_else(|| format!("{}-chaos", make_run_id(&config)));
    let overrides: Vec<String> = args
        .overrides
        .iter()
        .filter(|o| !o.starts_with("run.id="))
        .cloned()
        .collect();
    std::fs::create_dir_all(&args.state_dir)?;
    let state_dir = args.state_dir.canonicalize()?;
    let config_path = args.config.canonicalize()?;
    let mut stack = Stack::start_infra(
        &state_dir,
        &run_id,
        &Default::default(),
        relay_proto::DEFAULT_MAX_PAYLOAD,
    )?;
    for service in SERVICES {
        stack.spawn_service(service, &config_path, &overrides)?;
        stack.wait_healthy(Duration::from_secs(60))?;
    }
    println!(
        "relay chaos: run {run_id}; {} services ready in {:.1}s",
        stack.services.len(),
        begun.elapsed().as_secs_f64()
    );
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let heard = Arc::new(Mutex::new(Heard::default()));
    {
        let (heard, url, subjects) = (
            heard.clone(),
            stack.nats_url.clone(),
            Subjects::new(&run_id),
        );
        let client = runtime.block_on(async_nats::connect(&url))?;
        let mut metrics = runtime.block_on(client.subscribe(subjects.metrics()))?;
        let mut evals = runtime.block_on(client.subscribe(subjects.eval()))?;
        runtime.spawn(async move {
            let _client = client;
            loop {
                tokio::select! {
                    Some(m) = metrics.next() => {
                        if let Ok(r) = relay_proto::decode::<MetricsReport>(&m.payload) {
                            for v in r.values.iter().filter(|v| v.name == "learner_env_steps") {
                                heard.lock().unwrap().steps.push((Instant::now(), v.value));
                            }
                        }
                    }
                    Some(m) = evals.next() => {
                        if let Ok(r) = relay_proto::decode::<EvalReport>(&m.payload) {
                            let mut h = heard.lock().unwrap();
                            h.evals.push(Instant::now());
                            if r.solved {
                                h.solved.push(Instant::now());
                            }
                        }
                    }
                    else => break,
                }
            }
        });
    }
    let run_dir = config.run.runs_dir.join(&run_id);
    let result = schedule(
        &mut stack,
        &heard,
        &config_path,
        &overrides,
        &run_dir,
        begun,
        limit,
        config.replay.capacity_steps as f64,
    );
    let stop_started = Instant::now();
    stack.stop(Duration::from_secs(15));
    drop(runtime);
    let (rows, solved) = result?;
    println!(
        "relay chaos: stack stopped in {:.1}s",
        stop_started.elapsed().as_secs_f64()
    );

    // The registry and the checkpoints must still parse.
    let runs_json = config.run.runs_dir.join("runs.json");
    let registry: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(&runs_json)
            .with_context(|| format!("reading {}", runs_json.display()))?,
    )
    .with_context(|| format!("parsing {}", runs_json.display()))?;
    let registered = registry
        .as_array()
        .is_some_and(|a| a.iter().any(|r| r["id"] == run_id.as_str()));
    let checkpoints = check_checkpoints(&run_dir)?;

    println!();
    println!("| fault | time to recover (s) | lost rollout fragments | outcome |");
    println!("|---|---:|---:|---|");
    for r in &rows {
        println!(
            "| {} | {} | {:.0} | {}{} |",
            r.fault,
            r.recover_s.map_or("-".into(), |s| format!("{s:.2}")),
            r.lost,
            if r.recover_s.is_some() {
                "recovered"
            } else {
                "not recovered"
            },
            if r.note.is_empty() {
                String::new()
            } else {
                format!(" ({})", r.note)
            }
        );
    }
    let all = rows.iter().all(|r| r.recover_s.is_some());
    println!(
        "{}",
        serde_json::json!({
            "run_id": run_id,
            "faults": rows.iter().map(|r| serde_json::json!({
                "fault": r.fault,
                "recover_s": r.recover_s.map(|s| (s * 100.0).round() / 100.0),
                "lost_fragments": r.lost,
                "recovered": r.recover_s.is_some(),
                "note": r.note,
            })).collect::<Vec<_>>(),
            "all_recovered": all,
            "solved": solved,
            "runs_json_ok": registered,
            "checkpoints_ok": checkpoints,
            "wall_s": (begun.elapsed().as_secs_f64() * 10.0).round() / 10.0,
        })
    );
    if !all || !solved || !registered || checkpoints == 0 {
        bail!("chaos: all_recovered {all}, solved {solved}, registered {registered}, checkpoints {checkpoints}");
    }
    Ok(())
}

/// Parses every checkpoint's JSON files; returns how many checkpoints there are.
fn check_checkpoints(run_dir: &Path) -> Result<usize> {
    let dir = run_dir.join("checkpoints");
    let last = dir
        .join("last")
        .canonicalize()
        .context("checkpoints/last")?;
    let mut n = 0;
    for entry in std::fs::read_dir(&dir)? {
        let path = entry?.path();
        if !path.is_dir() || path.is_symlink() {
            continue;
        }
        for file in std::fs::read_dir(&path)? {
            let file = file?.path();
            if file.extension().is_some_and(|e| e == "json") {
                serde_json::from_str::<serde_json::Value>(&std::fs::read_to_string(&file)?)
                    .with_context(|| format!("checkpoint file {} is corrupt", file.display()))?;
            }
        }
        n += 1;
    }
    if !last.is_dir() {
        bail!("checkpoints/last does not resolve");
    }
    Ok(n)
}

/// Sum of lost-fragment counters of one service's /metrics text.
fn lost_in(text: &str) -> f64 {
    text.lines()
        .filter(|l| {
            (l.starts_with("relay_env_runner_fragments_total{") && !l.contains("\"stored\""))
                // Stale inserts are already counted by the env-runner.
                || (l.starts_with("relay_replay_dropped_fragments_total{")
                    && l.contains("\"undecodable\""))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// A service's `/metrics` text, given 300 ms to connect and 2 s for each
/// of head and body: a fault can leave a service that no longer answers.
fn scrape(addr: SocketAddr) -> Option<String> {
    const TIMEOUTS: relay_local::Timeouts = relay_local::Timeouts {
        connect: Duration::from_millis(300),
        read: Duration::from_secs(2),
    };
    relay_local::http::get(addr, "/metrics", TIMEOUTS)
        .ok()
        .map(|(_, text)| text)
}

/// Lost fragments over the stack's life: the last value seen of each
/// instance's counters (a killed instance keeps its last scrape).
fn scrape_lost(stack: &Stack, seen: &mut HashMap<String, f64>) -> f64 {
    for p in &stack.services {
        if let Some(text) = p.metrics_addr.and_then(scrape) {
            seen.insert(p.name.clone(), lost_in(&text));
        }
    }
    seen.values().sum()
}

fn latest_steps(heard: &Mutex<Heard>) -> f64 {
    heard.lock().unwrap().steps.last().map_or(0.0, |s| s.1)
}

/// Waits until a learner env-steps report after `since` exceeds `baseline`
/// (or, with no baseline, exceeds the first report after `since`).
fn wait_steps(
    heard: &Mutex<Heard>,
    since: Instant,
    baseline: Option<f64>,
    timeout: Duration,
) -> Option<Instant> {
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        {
            let h = heard.lock().unwrap();
            let mut after = h.steps.iter().filter(|(t, _)| *t > since);
            let base = baseline.or_else(|| after.next().map(|s| s.1));
            if let Some(base) = base {
                if let Some((t, _)) = after.find(|(_, v)| *v > base) {
                    return Some(*t);
                }
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    None
}

#[allow(clippy::too_many_arguments)]
fn schedule(
    stack: &mut Stack,
    heard: &Mutex<Heard>,
    config: &Path,
    overrides: &[String],
    run_dir: &Path,
    begun: Instant,
    limit: Duration,
    margin: f64,
) -> Result<(Vec<Row>, bool)> {
    let fault_timeout = Duration::from_secs(20);
    // Warm-up: training runs and a checkpoint exists (the learner resumes from it).
    let warm = Instant::now() + Duration::from_secs(60);
    while latest_steps(heard) < 2048.0 || !run_dir.join("checkpoints/last").exists() {
        if Instant::now() > warm {
            bail!("no training progress and checkpoint within 60 s of start-up");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let mut seen = HashMap::new();
    let mut rows = Vec::new();
    let faults = [
        "env-runner",
        "inference-server (1 of 2)",
        "inference-server (only copy)",
        "replay-buffer",
        "evaluator",
        "tracker",
        "learner",
        "redis-server",
        "nats-server",
    ];
    for fault in faults {
        let before = scrape_lost(stack, &mut seen);
        let mut note = String::new();
        let service = fault.split(' ').next().unwrap_or(fault);
        if fault == "inference-server (1 of 2)" {
            stack.spawn_copy("inference-server")?;
            stack.wait_healthy(Duration::from_secs(30))?;
        }
        let baseline = latest_steps(heard);
        let t0 = Instant::now();
        match service {
            "redis-server" | "nats-server" => stack.restart_infra(service)?,
            _ => {
                let victim = stack
                    .copies_of(service)
                    .first()
                    .cloned()
                    .with_context(|| format!("no {service} to kill"))?;
                stack.kill_service(&victim)?;
                if service == "learner" {
                    let last = run_dir.join("checkpoints/last").canonicalize()?;
                    let mut o = overrides.to_vec();
                    o.push(format!("run.resume_from={}", last.display()));
                    stack.spawn_service("learner", config, &o)?;
                    // Later copies start with the run's own flags again.
                    stack.set_service_args(config, overrides);
                } else {
                    stack.spawn_copy(service)?;
                }
            }
        }
        if let Err(e) = stack.wait_healthy(fault_timeout) {
            note = format!("{e:#}");
        }
        // The learner restarts from its checkpoint, with fewer env steps than
        // it had: recovered once they grow again.
        // Beyond what the replay buffer may have held at the fault: the
        // learner trains on fragments collected after it.
        let base = (service != "learner").then_some(baseline + margin);
        let recovered = wait_steps(heard, t0, base, fault_timeout);
        // The evaluator and the tracker are off the training path: they have
        // recovered once they evaluate (or write the run's metrics) again.
        let recovered = recovered.and_then(|t| {
            let deadline = Instant::now() + fault_timeout;
            let size = || std::fs::metadata(run_dir.join("metrics.jsonl")).map_or(0, |m| m.len());
            let written = size();
            loop {
                let back = match service {
                    "evaluator" => heard
                        .lock()
                        .unwrap()
                        .evals
                        .iter()
                        .find(|e| **e > t0)
                        .copied(),
                    "tracker" => (size() > written).then(Instant::now),
                    _ => Some(t),
                };
                if let Some(b) = back {
                    break Some(b.max(t));
                }
                if Instant::now() > deadline {
                    break None;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        });
        let recover_s = recovered.map(|t| t.duration_since(t0).as_secs_f64());
        if fault == "inference-server (1 of 2)" {
            // Back to one copy for the next fault.
            for mut p in stack.take_copies("inference-server", 1)? {
                let _ = p.child.wait();
            }
        }
        for (name, status) in stack.exited() {
            note = format!("{note} {name} exited with {status}")
                .trim()
                .to_string();
        }
        let lost = scrape_lost(stack, &mut seen) - before;
        println!(
            "relay chaos: {fault}: {} ({:.0} lost fragments){}",
            recover_s.map_or("not recovered".into(), |s| format!("recovered in {s:.2}s")),
            lost,
            if note.is_empty() {
                String::new()
            } else {
                format!("; {note}")
            }
        );
        rows.push(Row {
            fault: fault.to_string(),
            recover_s: if note.is_empty() { recover_s } else { None },
            lost,
            note,
        });
    }
    // Solving: a solved eval after the last fault.
    let schedule_end = Instant::now();
    println!(
        "relay chaos: faults done after {:.1}s; waiting for the run to be solved",
        begun.elapsed().as_secs_f64()
    );
    let solved = loop {
        if heard
            .lock()
            .unwrap()
            .solved
            .iter()
            .any(|t| *t > schedule_end)
        {
            break true;
        }
        if begun.elapsed() > limit {
            break false;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    Ok((rows, solved))
}
