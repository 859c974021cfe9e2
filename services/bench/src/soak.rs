//! `relay soak`: memory stays bounded while a stack trains for a long time.

use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use relay::{up, UpArgs};

/// Resident memory of a process in KiB (Linux `/proc`).
fn rss_kib(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

/// `relay soak`: trains (solving disabled) for `minutes` with the given
/// copies and reports each process's resident memory after warm-up and at
/// the end; memory must stay bounded.
pub fn soak(mut args: UpArgs, minutes: f64) -> Result<()> {
    let duration = Duration::from_secs_f64(minutes * 60.0);
    let warmup = (duration / 5).min(Duration::from_secs(60));
    args.quiet = true;
    args.until_solved = false;
    args.for_seconds = Some(duration.as_secs().max(1));
    args.overrides.extend([
        "run.total_env_steps=1000000000000".to_string(),
        "run.stop_when_solved=false".to_string(),
        "eval.threshold=1000000000".to_string(),
    ]);
    let record_path = args.state_dir.join("stack.json");
    let _ = std::fs::remove_file(&record_path);
    let sampler = std::thread::spawn(move || -> Result<Vec<(String, u64, u64)>> {
        let deadline = Instant::now() + Duration::from_secs(120);
        let record: relay::stack::StackRecord = loop {
            let ready = std::fs::read_to_string(&record_path)
                .ok()
                .and_then(|t| serde_json::from_str::<relay::stack::StackRecord>(&t).ok());
            match ready {
                // Every service copy and the infrastructure are recorded.
                Some(r) if r.processes.iter().any(|p| p.name.starts_with("learner")) => break r,
                _ if Instant::now() > deadline => bail!("the stack did not start within 120 s"),
                _ => std::thread::sleep(Duration::from_millis(200)),
            }
        };
        let started = Instant::now();
        std::thread::sleep(warmup);
        let first: Vec<(String, u32, Option<u64>)> = record
            .processes
            .iter()
            .map(|p| (p.name.clone(), p.pid, rss_kib(p.pid)))
            .collect();
        std::thread::sleep(duration.saturating_sub(started.elapsed() + Duration::from_secs(3)));
        Ok(first
            .into_iter()
            .filter_map(|(name, pid, start)| Some((name, start?, rss_kib(pid)?)))
            .collect())
    });
    let outcome = up(args)?;
    let rows = sampler
        .join()
        .map_err(|_| anyhow::anyhow!("the memory sampler panicked"))??;
    println!();
    println!(
        "| process | RSS after {:.0} s (MiB) | RSS at the end (MiB) | growth |",
        warmup.as_secs_f64()
    );
    println!("|---|---:|---:|---:|");
    // The relay services, not the infrastructure (Prometheus's store grows by design).
    let infrastructure = [
        "nats-server",
        "redis-server",
        "prometheus",
        "grafana-server",
    ];
    let mut worst = f64::MIN;
    for (name, start, end) in &rows {
        let growth = 100.0 * (*end as f64 - *start as f64) / *start as f64;
        if !infrastructure.contains(&name.as_str()) {
            worst = worst.max(growth);
        }
        println!(
            "| {name} | {:.1} | {:.1} | {growth:+.1} % |",
            *start as f64 / 1024.0,
            *end as f64 / 1024.0
        );
    }
    println!(
        "{}",
        serde_json::json!({"minutes": minutes, "processes": rows.len(), "env_steps": outcome.env_steps, "max_service_growth_percent": (worst * 10.0).round() / 10.0,
            "rss_mib": rows.iter().map(|(n, s, e)| serde_json::json!({"process": n, "start": *s as f64 / 1024.0, "end": *e as f64 / 1024.0})).collect::<Vec<_>>()})
    );
    Ok(())
}
