//! `relay-bench bench-allreduce` (`just bench-allreduce`): the learner
//! replicas' ring all-reduce ([`relay_kit::collective`]) on this machine:
//! for 2 and 4 members (processes' worth of groups in one process, each
//! member its own task) joined through a real nats-server, the time of one
//! all-reduce of 10 KB to 100 MB of f32 gradients (median of `--rounds`),
//! and the bus bandwidth a ring implies, `2 (N - 1) / N * bytes / time`,
//! NCCL's and Horovod's measure: a ring sends each byte about twice
//! whatever `N` is, so time should grow with the size, not with `N`. Over
//! loopback there is no link to saturate: the figures are the ring's CPU
//! cost (copies, sums, socket calls).
//!
//! With `--netns-rate 10gbit` every member is a thread in its own network
//! namespace (a "host", [`relay_testkit::netns`]) whose link sends at most
//! that rate (a `tc` token bucket on its veth), nats-server in another:
//! a model of a cluster with 10 Gbit/s NICs. The table then sets each time
//! beside a ring's model, `2 (N - 1) / N * size / rate`, which stays
//! nearly flat in `N`; a naive all-to-one reduce would grow as `N * size`.
//! On a machine with fewer cores than members the sums and copies compete
//! for CPU, so the time can exceed the model where the CPU, not the link,
//! is the bottleneck. Needs root and iproute2. A table, then one JSON line.

use std::net::Ipv4Addr;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
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
    /// Run every member in its own network namespace, its link limited to
    /// this rate (tc's units: `10gbit`, `1gbit`, `500mbit`). Needs root.
    #[arg(long, value_name = "RATE")]
    pub netns_rate: Option<String>,
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

/// Every member its own task in this process, over loopback.
fn loopback_rows(args: &BenchAllreduceArgs) -> Result<Vec<Row>> {
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
            let view = crate::full_view(&groups[0], n, Duration::from_secs(20)).await?;
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
    Ok(rows)
}

pub fn bench_allreduce(args: BenchAllreduceArgs) -> Result<()> {
    if args.members.iter().any(|&n| n < 2) || args.rounds == 0 || args.sizes_kb.is_empty() {
        bail!("--members must be 2 or more, --rounds positive, --sizes-kb not empty");
    }
    let rate = args
        .netns_rate
        .as_deref()
        .map(rate_bytes_per_s)
        .transpose()?;
    let rows = match &args.netns_rate {
        Some(rate) => netns_rows(&args, rate)?,
        None => loopback_rows(&args)?,
    };
    let cpu = format!("{} ({})", crate::cpu_name(), crate::cpu_simd());
    match (&args.netns_rate, rate) {
        (Some(r), Some(_)) => println!(
            "ring all-reduce between network namespaces, each link limited to {r} (tc tbf), groups through nats-server; {cpu}"
        ),
        _ => println!("ring all-reduce over loopback TCP, groups through nats-server; {cpu}"),
    }
    println!("| members | size | time (median) | bus bandwidth 2(N-1)/N x size / time | ring model 2(N-1)/N x size / rate |");
    println!("|---:|---:|---:|---:|---:|");
    let mut json_rows = Vec::new();
    for r in &rows {
        let ring_bytes = 2.0 * (r.members - 1) as f64 / r.members as f64 * r.bytes as f64;
        let bus = ring_bytes / r.seconds;
        let model = rate.map(|rate| ring_bytes / rate);
        println!(
            "| {} | {:.1} KB | {:.3} ms | {:.0} MB/s | {} |",
            r.members,
            r.bytes as f64 / 1e3,
            r.seconds * 1e3,
            bus / 1e6,
            model.map_or("-".into(), |m| format!("{:.3} ms", m * 1e3)),
        );
        json_rows.push(serde_json::json!({
            "members": r.members,
            "bytes": r.bytes,
            "seconds": r.seconds,
            "bus_bytes_per_s": bus,
            "ring_model_seconds": model,
        }));
    }
    println!(
        "{}",
        serde_json::json!({"bench": "allreduce", "cpu": cpu, "rounds": args.rounds, "netns_rate": args.netns_rate, "rows": json_rows})
    );
    Ok(())
}

/// `10gbit`, `1gbit`, `500mbit`, `100kbit` (tc's decimal units) in bytes per second.
fn rate_bytes_per_s(rate: &str) -> Result<f64> {
    let lower = rate.to_ascii_lowercase();
    let (number, scale) = [("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3), ("bit", 1.0)]
        .into_iter()
        .find_map(|(unit, scale)| lower.strip_suffix(unit).map(|n| (n.to_string(), scale)))
        .with_context(|| format!("--netns-rate {rate:?}: give e.g. 10gbit, 1gbit or 500mbit"))?;
    let value: f64 = number
        .parse()
        .ok()
        .filter(|v: &f64| v.is_finite() && *v > 0.0)
        .with_context(|| format!("--netns-rate {rate:?}: not a positive rate"))?;
    Ok(value * scale / 8.0)
}

/// Prefix of the namespaces: `relayar-<pid>-<host>`.
const NS_PREFIX: &str = "relayar-";
const SUBNET: &str = "10.215.0";

/// Every member a thread in its own namespace, each link limited to `rate`
/// (checked by the caller).
fn netns_rows(args: &BenchAllreduceArgs, rate: &str) -> Result<Vec<Row>> {
    use relay_testkit::netns::{self, iproute2_binary, spawn_in_netns, Network};
    let ip = iproute2_binary("ip").context("`ip` (iproute2) is not installed")?;
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        bail!("--netns-rate creates network namespaces: run as root");
    }
    let nats_bin = relay::stack::which("nats-server")
        .context("nats-server is not installed; run `bash deploy/install.sh`")?;
    netns::remove_leftovers(&ip, NS_PREFIX)?;
    let mut rows = Vec::new();
    for &n in &args.members {
        let names: Vec<String> = std::iter::once("nats".to_string())
            .chain((0..n).map(|i| format!("m{i}")))
            .collect();
        let hosts: Vec<(&str, Ipv4Addr)> = names
            .iter()
            .enumerate()
            .map(|(i, h)| Ok((h.as_str(), format!("{SUBNET}.{}", i + 1).parse()?)))
            .collect::<Result<_>>()?;
        let net = Network::create(&ip, NS_PREFIX, &hosts)?;
        for (host, _) in &hosts[1..] {
            net.limit_egress(host, rate)?;
        }
        let store = args.state_dir.join(format!("nats-netns-{n}"));
        let _ = std::fs::remove_dir_all(&store);
        std::fs::create_dir_all(&store)?;
        let nats_ip = hosts[0].1;
        let mut nats = net
            .command("nats", &nats_bin)
            .args(["-a", &nats_ip.to_string(), "-p", "4222", "-js", "-sd"])
            .arg(&store)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .context("starting nats-server")?;
        netns::wait_reachable(
            &net.ns(hosts[1].0),
            (nats_ip, 4222).into(),
            Duration::from_secs(20),
        )?;
        let url = format!("nats://{nats_ip}:4222");
        let barrier = std::sync::Arc::new(std::sync::Barrier::new(n));
        let members: Vec<_> = hosts[1..]
            .iter()
            .enumerate()
            .map(|(i, (host, address))| {
                let (url, barrier, address) = (url.clone(), barrier.clone(), *address);
                let (sizes, rounds, name) = (
                    args.sizes_kb.clone(),
                    args.rounds,
                    format!("bench-allreduce-netns-{n}"),
                );
                spawn_in_netns(&net.ns(host), move || {
                    netns_member(i, n, &url, &name, address, &sizes, rounds, &barrier)
                })
            })
            .collect::<Result<_>>()?;
        let mut times: Vec<Vec<Vec<f64>>> = Vec::new();
        for member in members {
            let joined = member
                .join()
                .map_err(|_| anyhow::anyhow!("a member thread panicked"))??;
            times.push(joined?);
        }
        let _ = nats.kill();
        let _ = nats.wait();
        drop(net);
        for (k, &kb) in args.sizes_kb.iter().enumerate() {
            let floats = (kb * 1000 / 4).max(n);
            // A round takes as long as its slowest member.
            let mut round: Vec<f64> = (0..args.rounds)
                .map(|r| times.iter().map(|t| t[k][r]).fold(0.0, f64::max))
                .collect();
            round.sort_by(f64::total_cmp);
            rows.push(Row {
                members: n,
                bytes: floats * 4,
                seconds: round[round.len() / 2],
            });
        }
    }
    Ok(rows)
}

/// One member in its namespace: joins, then per size one warm-up and
/// `rounds` timed all-reduces, every member starting each together.
/// Returns the seconds of each timed round, per size.
#[allow(clippy::too_many_arguments)]
fn netns_member(
    index: usize,
    n: usize,
    url: &str,
    name: &str,
    address: Ipv4Addr,
    sizes_kb: &[usize],
    rounds: usize,
    barrier: &std::sync::Barrier,
) -> Result<Vec<Vec<f64>>> {
    // Its worker threads are created from this thread, so they are in this
    // namespace too.
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    let (mut group, view) = runtime.block_on(async {
        let nats = async_nats::connect(url).await?;
        let config = GroupConfig::new(name, format!("m{index}"), (address, 0).into());
        let group = Group::join(&nats, config).await?;
        let view = crate::full_view(&group, n, Duration::from_secs(30)).await?;
        Ok::<_, anyhow::Error>((group, view))
    })?;
    let mut tag = 0;
    let mut times = Vec::new();
    for &kb in sizes_kb {
        let floats = (kb * 1000 / 4).max(n);
        let mut data = vec![index as f32 + 0.5; floats];
        let mut per_round = Vec::with_capacity(rounds);
        for round in 0..=rounds {
            data.fill(index as f32 + 0.5);
            barrier.wait();
            tag += 1;
            let started = Instant::now();
            runtime.block_on(group.all_reduce_sum(&view, tag, &mut data))?;
            if round > 0 {
                per_round.push(started.elapsed().as_secs_f64());
            }
        }
        let want = n as f32 * n as f32 / 2.0;
        if (data[floats / 2] - want).abs() > 1e-3 * want {
            bail!("the sum is {}, not {want}", data[floats / 2]);
        }
        times.push(per_round);
    }
    runtime.block_on(group.leave())?;
    Ok(times)
}
