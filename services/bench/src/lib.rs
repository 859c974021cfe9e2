//! `relay-bench`: relay's benchmarks, fault injection, memory soak and
//! hyperparameter sweeps, each a subcommand of the `relay-bench` binary
//! (which `relay bench-*`, `relay chaos`, `relay soak` and `relay sweep`
//! run). They drive the stack through the `relay` library (`up`, the
//! supervisor) and print a table and a last JSON line.

pub mod bench_allreduce;
pub mod bench_bridge;
pub mod bench_cnn_step;
pub mod bench_envs;
pub mod bench_generate;
pub mod bench_gpu;
pub mod bench_hub_model;
pub mod bench_league;
pub mod bench_learners;
pub mod bench_learning;
pub mod bench_llamacpp;
pub mod bench_parity;
pub mod bench_scale;
pub mod bench_smollm2;
pub mod bench_solve;
pub mod bench_tictactoe;
pub mod bench_tracker;
pub mod bench_weights;
pub mod chaos;
mod parity_stats;
pub mod soak;
pub mod sweep;
mod text_game_run;

/// CPU seconds (user + system) the process `pid` has used, from
/// `/proc/<pid>/stat`; `None` off Linux or once the process is gone.
pub(crate) fn cpu_seconds(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the parenthesised command name; utime and stime are
    // fields 14 and 15 of the whole line.
    let rest = &stat[stat.rfind(')')? + 2..];
    let fields: Vec<&str> = rest.split(' ').collect();
    let ticks: f64 = fields.get(11)?.parse::<f64>().ok()? + fields.get(12)?.parse::<f64>().ok()?;
    // SAFETY: sysconf only reads a configuration value.
    let per_second = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    (per_second > 0).then(|| ticks / per_second as f64)
}

/// The record of the stack `relay up` runs for `run_id` (`stack.json` in
/// `state_dir`), once it is written.
pub(crate) fn stack_record(
    state_dir: &std::path::Path,
    run_id: &str,
) -> Option<relay::stack::StackRecord> {
    let text = std::fs::read_to_string(state_dir.join("stack.json")).ok()?;
    let record: relay::stack::StackRecord = serde_json::from_str(&text).ok()?;
    (record.run_id == run_id).then_some(record)
}

/// The CPU's model name (Linux), for the figures' record.
pub(crate) fn cpu_name() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .unwrap_or_default()
        .lines()
        .find(|l| l.starts_with("model name"))
        .and_then(|l| l.split(':').nth(1))
        .map_or_else(|| "unknown".into(), |n| n.trim().to_owned())
}

/// The widest x86 vector extension the CPU reports (Linux):
/// `AVX-512`, `AVX2`, `AVX` or `no AVX`.
pub(crate) fn cpu_simd() -> &'static str {
    let info = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let flags: Vec<&str> = info
        .lines()
        .find(|l| l.starts_with("flags"))
        .and_then(|l| l.split(':').nth(1))
        .map_or_else(Vec::new, |f| f.split_whitespace().collect());
    let has = |flag: &str| flags.contains(&flag);
    if has("avx512f") {
        "AVX-512"
    } else if has("avx2") {
        "AVX2"
    } else if has("avx") {
        "AVX"
    } else {
        "no AVX"
    }
}

/// Waits up to `within` for `group`'s agreed view to hold all `n` members
/// (the benchmarks' groups join together, then measure).
pub(crate) async fn full_view(
    group: &relay_kit::collective::Group,
    n: usize,
    within: std::time::Duration,
) -> anyhow::Result<relay_kit::collective::View> {
    let deadline = std::time::Instant::now() + within;
    loop {
        match group.current_view() {
            Some(v) if v.size() == n => return Ok(v),
            _ if std::time::Instant::now() > deadline => {
                anyhow::bail!("no view of {n} members within {within:?}")
            }
            _ => tokio::time::sleep(std::time::Duration::from_millis(20)).await,
        }
    }
}
