//! `relay-bench bench-allreduce` (`just bench-allreduce`): the learner
//! replicas' ring all-reduce ([`relay_kit::collective`]) on this machine:
//! for 2 and 4 members (processes' worth of groups in one process, each
//! member its own task) joined through a real nats-server, the time of one
//! all-reduce of 10 KB to 100 MB of f32 gradients (median of `--rounds`),
//! and the bus bandwidth a ring implies, `2 (N - 1) / N * bytes / time`,
//! NCCL's and Horovod's measure: a ring sends each byte about twice
//! whatever `N` is, so time should grow with the size, not with `N`. Over
//! loopback there is no link to saturate: the figures are the ring's CPU
//! cost (copies, sums, socket calls). A table, then one JSON line.

use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use relay::stack::{ExternalInfra, Stack};
use relay_kit::collective::{Group, GroupConfig, View};

/// `relay-bench bench-allreduce` flags.
#[derive(Debug, clap::Args)]
pub struct BenchAllreduceArgs {
    /// Group sizes, comma-separated.
    #[arg(long, default_value = "2,4", value_delimiter = ',')]
    pub members: Vec<usize>,
    /// Buffer sizes in KB (f32 gradients), comma-separated.
    #[arg(
        long,
        default_value = "10,100,1000,10000,100000",
        value_delimiter = ','
    )]
    pub sizes_kb: Vec<usize>,
    /// Timed all-reduces per size (the median is reported), after one warm-up.
    #[arg(long, default_value_t = 5)]
    pub rounds: usize,
    /// Where the nats-server keeps its state.
    #[arg(long, default_value = ".relay/bench-allreduce")]
    pub state_dir: std::path::PathBuf,
}

struct Row {
    members: usize,
    bytes: usize,
    seconds: f64,
}

/// One all-reduce on every member at once, each on its own task; returns
/// the members and the wall time from the first start to the last finish.
async fn reduce_once(
    groups: Vec<Group>,
    view: &View,
    tag: u64,
    floats: usize,
) -> Result<(Vec<Group>, f64)> {
    let started = Instant::now();
    let tasks: Vec<_> = groups
        .into_iter()
        .enumerate()
        .map(|(rank, mut group)| {
            let view = view.clone();
            tokio::spawn(async move {
                let mut data = vec![rank as f32 + 0.5; floats];
                let result = group.all_reduce_sum(&view, tag, &mut data).await;
                (group, result, data[floats / 2])
            })
        })
        .collect();
    let mut groups = Vec::with_capacity(tasks.len());
    let n = tasks.len() as f32;
    for task in tasks {
        let (group, result, middle) = task.await?;
        result?;
        // Σ (rank + 0.5) over the members.
        let want = n * n / 2.0;
        if (middle - want).abs() > 1e-3 * want {
            bail!("the sum is {middle}, not {want}");
        }
        groups.push(group);
    }
    Ok((groups, started.elapsed().as_secs_f64()))
}

pub fn bench_allreduce(args: BenchAllreduceArgs) -> Result<()> {
    if args.members.iter().any(|&n| n < 2) || args.rounds == 0 || args.sizes_kb.is_empty() {
        bail!("--members must be 2 or more, --rounds positive, --sizes-kb not empty");
    }
    std::fs::create_dir_all(&args.state_dir)?;
    let _ = std::fs::remove_dir_all(args.state_dir.join("nats"));
    let stack = Stack::start_infra(
        &args.state_dir,
        "bench-allreduce",
        &ExternalInfra::default(),
        relay_proto::DEFAULT_MAX_PAYLOAD,
    )?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let rows = runtime.block_on(async {
        let nats = async_nats::connect(&stack.nats_url).await?;
        let mut rows = Vec::new();
        for &n in &args.members {
            let name = format!("bench-allreduce-{n}-{}", std::process::id());
            let mut groups = Vec::with_capacity(n);
            for i in 0..n {
                let config = GroupConfig::new(&name, format!("m{i}"), "127.0.0.1:0".parse()?);
                groups.push(Group::join(&nats, config).await?);
            }
            let deadline = Instant::now() + Duration::from_secs(20);
            let view = loop {
                match groups[0].current_view() {
                    Some(v) if v.size() == n => break v,
                    _ if Instant::now() > deadline => bail!("no view of {n} members"),
                    _ => tokio::time::sleep(Duration::from_millis(50)).await,
                }
            };
            let mut tag = 0;
            for &kb in &args.sizes_kb {
                let floats = (kb * 1000 / 4).max(n);
                tag += 1;
                (groups, _) = reduce_once(groups, &view, tag, floats).await?;
                let mut times = Vec::with_capacity(args.rounds);
                for _ in 0..args.rounds {
                    tag += 1;
                    let seconds;
                    (groups, seconds) = reduce_once(groups, &view, tag, floats).await?;
                    times.push(seconds);
                }
                times.sort_by(f64::total_cmp);
                rows.push(Row {
                    members: n,
                    bytes: floats * 4,
                    seconds: times[times.len() / 2],
                });
            }
            for g in groups {
                g.leave().await?;
            }
        }
        Ok::<_, anyhow::Error>(rows)
    })?;
    drop(stack);

    let cpu = format!("{} ({})", crate::cpu_name(), crate::cpu_simd());
    println!("ring all-reduce over loopback TCP, groups through nats-server; {cpu}");
    println!("| members | size | time (median) | bus bandwidth 2(N-1)/N x size / time |");
    println!("|---:|---:|---:|---:|");
    let mut json_rows = Vec::new();
    for r in &rows {
        let bus = 2.0 * (r.members - 1) as f64 / r.members as f64 * r.bytes as f64 / r.seconds;
        println!(
            "| {} | {:.1} KB | {:.3} ms | {:.0} MB/s |",
            r.members,
            r.bytes as f64 / 1e3,
            r.seconds * 1e3,
            bus / 1e6
        );
        json_rows.push(serde_json::json!({
            "members": r.members,
            "bytes": r.bytes,
            "seconds": r.seconds,
            "bus_bytes_per_s": bus,
        }));
    }
    println!(
        "{}",
        serde_json::json!({"bench": "allreduce", "cpu": cpu, "rounds": args.rounds, "rows": json_rows})
    );
    Ok(())
}
