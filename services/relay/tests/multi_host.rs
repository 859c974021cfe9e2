//! Multi-host: the stack spread over three "hosts" made of Linux network
//! namespaces, so that no service can reach another over loopback.
//!
//! ```text
//!   infra   10.213.0.1   nats-server, redis-server, tracker
//!   runners 10.213.0.2   env-runner x2, evaluator, learner replica 2
//!   trainer 10.213.0.3   inference-server, replay-buffer, learner replica 1
//! ```
//!
//! The two learner replicas (data parallel, one run) agree on their view
//! through NATS and sum gradients over a TCP ring between the two hosts'
//! addresses; both must report training in a view of 2.
//!
//! Each host has one veth (`eth0`) whose peer sits on a bridge in a fourth
//! namespace, so nothing is added to the root namespace and the test subnet
//! 10.213.0.0/24 exists only inside namespaces this test creates. Every
//! process is started with `ip netns exec <ns> ...` and given the infra
//! address for NATS and Redis and its own address for `/metrics`. The run
//! trains CartPole-v1 until an `EvalReport` with `solved: true` arrives on
//! `relay.<run>.eval` (an observer subscribes from the runners namespace),
//! then everything is stopped with SIGTERM and the namespaces are deleted,
//! also when the test fails (drop guards). Namespaces left by a crashed
//! earlier run (named with its pid) are removed at start.
//!
//! Needs root and iproute2 (`ip`); without them the test fails with a clear
//! message unless `RELAY_SKIP_NETNS=1` is set.

use std::fs::File;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use relay_testkit::netns::{
    self, in_netns, iproute2_binary, run_iproute2, spawn_in_netns, wait_reachable, Network,
};

/// Prefix of every namespace this test creates: `relaymh-<pid>-<host>`.
const NS_PREFIX: &str = "relaymh-";
const SUBNET: &str = "10.213.0";
const NATS_PORT: u16 = 4222;
const REDIS_PORT: u16 = 6379;
const SOLVE_TIMEOUT: Duration = Duration::from_secs(120);
const STOP_GRACE: Duration = Duration::from_secs(15);

/// The hosts: name and last octet of the address.
const HOSTS: [(&str, u8); 3] = [("infra", 1), ("runners", 2), ("trainer", 3)];

fn host_ip(host: &str) -> Ipv4Addr {
    let octet = HOSTS
        .iter()
        .find(|(h, _)| *h == host)
        .map(|(_, o)| *o)
        .expect("known host");
    format!("{SUBNET}.{octet}").parse().expect("valid address")
}

// ---------------------------------------------------------------------------
// Preconditions

/// Returns the `ip` binary, or `None` when the test is to be skipped
/// (`RELAY_SKIP_NETNS=1`); panics with a clear message otherwise.
fn preconditions() -> Option<PathBuf> {
    let skip = std::env::var("RELAY_SKIP_NETNS").is_ok_and(|v| v == "1");
    let problem = {
        // SAFETY: geteuid has no preconditions.
        let euid = unsafe { libc::geteuid() };
        match iproute2_binary("ip") {
            None => Some(
                "`ip` (iproute2) is not installed; run `bash deploy/install.sh` or `apt-get install iproute2`"
                    .to_string(),
            ),
            Some(_) if euid != 0 => Some(format!(
                "the multi-host test creates network namespaces and must run as root (euid is {euid})"
            )),
            Some(ip) => return Some(ip),
        }
    };
    let problem = problem.expect("set above");
    if skip {
        eprintln!("multi_host: skipped because RELAY_SKIP_NETNS=1: {problem}");
        return None;
    }
    panic!("{problem}; set RELAY_SKIP_NETNS=1 to skip this test");
}

// ---------------------------------------------------------------------------
// Namespaces

/// Namespaces and temporary folders of this test's earlier runs whose
/// process is gone.
fn remove_leftovers(ip: &Path) -> Result<()> {
    netns::remove_leftovers(ip, NS_PREFIX)?;
    // The temporary folder of a crashed run (`relay-test-multi-host-<pid>-...`).
    if let Ok(entries) = std::fs::read_dir(std::env::temp_dir()) {
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            let Some(pid) = name
                .strip_prefix("relay-test-multi-host-")
                .and_then(|rest| rest.split('-').next())
                .and_then(|p| p.parse::<u32>().ok())
            else {
                continue;
            };
            if pid != std::process::id() && !Path::new(&format!("/proc/{pid}")).exists() {
                let _ = std::fs::remove_dir_all(entry.path());
            }
        }
    }
    Ok(())
}

/// The test network: a bridge and the three hosts.
fn create_network(ip: &Path) -> Result<Network> {
    let hosts: Vec<(&str, Ipv4Addr)> = HOSTS.iter().map(|(h, _)| (*h, host_ip(h))).collect();
    Network::create(ip, NS_PREFIX, &hosts)
}

// ---------------------------------------------------------------------------
// Processes

struct Proc {
    name: String,
    host: &'static str,
    child: Child,
    log: PathBuf,
}

/// Every process of the test; SIGKILLed on drop if still running.
#[derive(Default)]
struct Procs(Vec<Proc>);

impl Procs {
    fn spawn(
        &mut self,
        net: &Network,
        host: &'static str,
        name: &str,
        program: &Path,
        args: &[String],
        logs: &Path,
    ) -> Result<()> {
        let log = logs.join(format!("{name}.log"));
        let file = File::create(&log)?;
        let child = net
            .command(host, program)
            .args(args)
            .stdin(Stdio::null())
            .stdout(file.try_clone()?)
            .stderr(file)
            .process_group(0)
            .spawn()
            .with_context(|| format!("starting {name}"))?;
        self.0.push(Proc {
            name: name.to_string(),
            host,
            child,
            log,
        });
        Ok(())
    }

    fn get(&mut self, name: &str) -> &mut Proc {
        self.0
            .iter_mut()
            .find(|p| p.name == name)
            .unwrap_or_else(|| panic!("no process {name}"))
    }

    /// Log tails of every process, for failure messages.
    fn logs(&self) -> String {
        let mut out = String::new();
        for p in &self.0 {
            let text = std::fs::read_to_string(&p.log).unwrap_or_default();
            let lines: Vec<&str> = text.lines().collect();
            let tail = lines[lines.len().saturating_sub(15)..].join("\n");
            out.push_str(&format!("\n----- {} ({}) -----\n{tail}\n", p.name, p.host));
        }
        out
    }

    /// SIGTERM to the named processes, then waits up to `grace` for each;
    /// returns their exit statuses (`None`: had to be killed).
    fn stop(&mut self, names: &[&str], grace: Duration) -> Vec<(String, Option<ExitStatus>)> {
        let procs: Vec<&mut Proc> = self
            .0
            .iter_mut()
            .filter(|p| names.iter().any(|n| p.name == *n))
            .collect();
        for p in &procs {
            // SAFETY: kill(2) on a child this test started; `ip netns exec`
            // execs the program, so the pid is the program's.
            unsafe {
                libc::kill(p.child.id() as i32, libc::SIGTERM);
            }
        }
        let deadline = Instant::now() + grace;
        procs
            .into_iter()
            .map(|p| loop {
                match p.child.try_wait() {
                    Ok(Some(status)) => break (p.name.clone(), Some(status)),
                    Ok(None) if Instant::now() < deadline => {
                        std::thread::sleep(Duration::from_millis(20))
                    }
                    _ => {
                        let _ = p.child.kill();
                        let _ = p.child.wait();
                        break (p.name.clone(), None);
                    }
                }
            })
            .collect()
    }
}

impl Drop for Procs {
    fn drop(&mut self) {
        for p in &mut self.0 {
            let _ = p.child.kill();
            let _ = p.child.wait();
        }
    }
}

// ---------------------------------------------------------------------------
// Sockets: /proc/<pid>/net/tcp{,6} lists the sockets of that pid's namespace.

#[derive(Debug)]
struct Socket {
    local: SocketAddr,
    remote: SocketAddr,
    /// 0x0A listen, 0x01 established.
    state: u8,
}

fn parse_proc_addr(text: &str) -> Option<SocketAddr> {
    let (ip, port) = text.split_once(':')?;
    let port = u16::from_str_radix(port, 16).ok()?;
    let ip = match ip.len() {
        8 => IpAddr::V4(Ipv4Addr::from(
            u32::from_str_radix(ip, 16).ok()?.to_ne_bytes(),
        )),
        32 => {
            let mut bytes = [0u8; 16];
            for i in 0..4 {
                let word = u32::from_str_radix(&ip[i * 8..i * 8 + 8], 16).ok()?;
                bytes[i * 4..i * 4 + 4].copy_from_slice(&word.to_ne_bytes());
            }
            IpAddr::V6(Ipv6Addr::from(bytes))
        }
        _ => return None,
    };
    Some(SocketAddr::new(ip, port))
}

fn sockets_of_namespace(pid: u32) -> Vec<Socket> {
    let mut out = Vec::new();
    for file in ["tcp", "tcp6"] {
        let Ok(text) = std::fs::read_to_string(format!("/proc/{pid}/net/{file}")) else {
            continue;
        };
        for line in text.lines().skip(1) {
            let f: Vec<&str> = line.split_whitespace().collect();
            if f.len() < 4 {
                continue;
            }
            if let (Some(local), Some(remote), Ok(state)) = (
                parse_proc_addr(f[1]),
                parse_proc_addr(f[2]),
                u8::from_str_radix(f[3], 16),
            ) {
                out.push(Socket {
                    local,
                    remote,
                    state,
                });
            }
        }
    }
    out
}

fn is_loopback(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => v4.is_loopback(),
        IpAddr::V6(v6) => v6.is_loopback() || v6.to_ipv4_mapped().is_some_and(|v| v.is_loopback()),
    }
}

// ---------------------------------------------------------------------------
// Observer: subscribes to `relay.<run>.eval` from a namespace.

fn observe_evals(
    ns: &str,
    nats_url: String,
    run_id: String,
    tx: mpsc::Sender<relay_proto::EvalReport>,
) -> Result<std::thread::JoinHandle<Result<Result<()>>>> {
    spawn_in_netns(ns, move || -> Result<()> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        runtime.block_on(async move {
            use futures::StreamExt;
            let client =
                tokio::time::timeout(Duration::from_secs(10), async_nats::connect(&nats_url))
                    .await
                    .context("observer: connecting to NATS timed out")?
                    .context("observer: connecting to NATS")?;
            let subject = relay_proto::Subjects::new(&run_id).eval();
            let mut sub = client.subscribe(subject).await?;
            client.flush().await?;
            let deadline = tokio::time::Instant::now() + SOLVE_TIMEOUT + Duration::from_secs(30);
            while let Ok(Some(msg)) = tokio::time::timeout_at(deadline, sub.next()).await {
                let Ok(report) = relay_proto::decode::<relay_proto::EvalReport>(&msg.payload)
                else {
                    continue;
                };
                let solved = report.solved;
                if tx.send(report).is_err() || solved {
                    break;
                }
            }
            Ok(())
        })
    })
}

// ---------------------------------------------------------------------------

fn max_metric(metrics: &str, name: &str) -> f64 {
    metrics
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter_map(|v| v["values"][name].as_f64())
        .fold(f64::NAN, f64::max)
}

#[test]
fn multi_host_cartpole_trains_across_network_namespaces() {
    let Some(ip) = preconditions() else {
        return;
    };
    let started = Instant::now();
    remove_leftovers(&ip).expect("listing network namespaces");

    let dir = relay_testkit::TempDir::new("multi-host");
    let logs = dir.path().join("logs");
    std::fs::create_dir_all(&logs).unwrap();
    let runs = dir.path().join("runs");
    let run_id = format!("multi-host-{}", std::process::id());
    let config = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../configs/cartpole-ppo.yaml"
    );

    let net = create_network(&ip).unwrap_or_else(|e| {
        panic!(
            "creating network namespaces failed: {e:#}\n(needs root with CAP_SYS_ADMIN and CAP_NET_ADMIN; set RELAY_SKIP_NETNS=1 to skip this test)"
        )
    });
    let infra_ip = host_ip("infra");
    let nats_url = format!("nats://{infra_ip}:{NATS_PORT}");
    let redis_url = format!("redis://{infra_ip}:{REDIS_PORT}");

    let mut procs = Procs::default();
    let nats_bin = relay_stack_which("nats-server");
    let redis_bin = relay_stack_which("redis-server");

    // Infrastructure on the infra host, bound to its address only.
    let nats_dir = dir.path().join("nats");
    let redis_dir = dir.path().join("redis");
    std::fs::create_dir_all(&redis_dir).unwrap();
    procs
        .spawn(
            &net,
            "infra",
            "nats-server",
            &nats_bin,
            &[
                "-a".into(),
                infra_ip.to_string(),
                "-p".into(),
                NATS_PORT.to_string(),
                "-js".into(),
                "-sd".into(),
                nats_dir.display().to_string(),
            ],
            &logs,
        )
        .unwrap();
    procs
        .spawn(
            &net,
            "infra",
            "redis-server",
            &redis_bin,
            &[
                "--bind".into(),
                infra_ip.to_string(),
                "--port".into(),
                REDIS_PORT.to_string(),
                "--protected-mode".into(),
                "no".into(),
                "--save".into(),
                "".into(),
                "--appendonly".into(),
                "no".into(),
                "--dir".into(),
                redis_dir.display().to_string(),
            ],
            &logs,
        )
        .unwrap();
    // Reached across the bridge, from the trainer host.
    for port in [NATS_PORT, REDIS_PORT] {
        if let Err(e) = wait_reachable(
            &net.ns("trainer"),
            (infra_ip, port).into(),
            Duration::from_secs(20),
        ) {
            panic!("{e:#}{}", procs.logs());
        }
    }

    // Services, in the order `relay up` starts them (learner last).
    let placement: [(&str, &'static str, &str, u16); 8] = [
        ("tracker", "infra", "tracker-0", 9101),
        ("replay-buffer", "trainer", "replay-buffer-0", 9102),
        ("inference-server", "trainer", "inference-server-0", 9103),
        ("evaluator", "runners", "evaluator-0", 9104),
        ("env-runner", "runners", "env-runner-0", 9105),
        ("env-runner", "runners", "env-runner-1", 9106),
        ("learner", "trainer", "learner-0", 9107),
        ("learner", "runners", "learner-1", 9108),
    ];
    let observer_rx = {
        let (tx, rx) = mpsc::channel();
        let handle = observe_evals(&net.ns("runners"), nats_url.clone(), run_id.clone(), tx)
            .expect("starting the observer");
        (rx, handle)
    };
    for (service, host, instance, port) in placement {
        let bin = relay_testkit::workspace_binary(&format!("relay-{service}"))
            .expect("service binaries are built (cargo build --workspace --bins)");
        let metrics_addr = SocketAddr::from((host_ip(host), port));
        let args: Vec<String> = [
            "--config",
            config,
            "--run-id",
            &run_id,
            "--nats-url",
            &nats_url,
            "--redis-url",
            &redis_url,
            "--metrics-addr",
            &metrics_addr.to_string(),
            "--instance",
            instance,
            "--set",
            &format!("run.runs_dir={}", runs.display()),
        ]
        .map(String::from)
        .to_vec();
        procs
            .spawn(&net, host, instance, &bin, &args, &logs)
            .unwrap();
        // Healthy, as seen from another host.
        let from = if host == "infra" { "trainer" } else { "infra" };
        let from_ns = net.ns(from);
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let healthy = in_netns(&from_ns, move || {
                relay_testkit::http_get(metrics_addr, "/healthz").is_ok_and(|(s, _)| s == 200)
            })
            .unwrap();
            if healthy {
                break;
            }
            if let Ok(Some(status)) = procs.get(instance).child.try_wait() {
                panic!(
                    "{instance} exited with {status} during start-up{}",
                    procs.logs()
                );
            }
            if Instant::now() > deadline {
                panic!(
                    "{instance} not healthy at {metrics_addr} within 30 s{}",
                    procs.logs()
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    let startup = started.elapsed();

    // Train until an EvalReport says solved.
    let (rx, observer) = observer_rx;
    let deadline = Instant::now() + SOLVE_TIMEOUT;
    let mut last_eval = None;
    let solved = loop {
        match rx.recv_timeout(Duration::from_millis(250)) {
            Ok(report) if report.solved => break report,
            Ok(report) => last_eval = Some(report),
            Err(mpsc::RecvTimeoutError::Timeout) => {}
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                let why = observer.join();
                panic!(
                    "the eval observer stopped before the run was solved: {why:?}{}",
                    procs.logs()
                );
            }
        }
        let exited = procs.0.iter_mut().find_map(|p| {
            let status = p.child.try_wait().ok().flatten()?;
            Some(format!("{} ({}) exited with {status}", p.name, p.host))
        });
        if let Some(exited) = exited {
            panic!("{exited} before the run was solved{}", procs.logs());
        }
        if Instant::now() > deadline {
            panic!(
                "not solved within {SOLVE_TIMEOUT:?}; last eval: {last_eval:?}{}",
                procs.logs()
            );
        }
    };
    let solve_time = started.elapsed();
    let _ = observer.join();
    assert!(solved.mean_return >= solved.threshold, "{solved:?}");
    // The evaluator's RunStatusUpdate follows its EvalReport: give the
    // tracker (on another host) the moment to write it before stopping.
    let status_deadline = Instant::now() + Duration::from_secs(10);
    while !std::fs::read_to_string(runs.join(&run_id).join("status.json"))
        .unwrap_or_default()
        .contains("\"solved\"")
        && Instant::now() < status_deadline
    {
        std::thread::sleep(Duration::from_millis(50));
    }

    // No loopback for anything: every listener is bound to its host's own
    // address, no connection uses loopback, and the runners and the trainer
    // reach NATS (and the trainer Redis) on the infra address.
    let nats_addr = SocketAddr::from((infra_ip, NATS_PORT));
    let redis_addr = SocketAddr::from((infra_ip, REDIS_PORT));
    for (host, _) in HOSTS {
        let pid = procs
            .0
            .iter()
            .find(|p| p.host == host)
            .map(|p| p.child.id())
            .expect("every host runs a process");
        let sockets = sockets_of_namespace(pid);
        let own = IpAddr::V4(host_ip(host));
        for s in &sockets {
            let listen = s.state == 0x0A;
            let established = s.state == 0x01;
            assert!(
                !(listen && s.local.ip() != own),
                "{host}: a process listens on {} instead of {own}: {sockets:?}",
                s.local
            );
            assert!(
                !(established && (is_loopback(s.local.ip()) || is_loopback(s.remote.ip()))),
                "{host}: a connection over loopback ({} -> {}): {sockets:?}",
                s.local,
                s.remote
            );
        }
        let connected_to = |addr: SocketAddr| {
            sockets
                .iter()
                .any(|s| s.state == 0x01 && s.remote == addr && s.local.ip() == own)
        };
        if host != "infra" {
            assert!(
                connected_to(nats_addr),
                "{host}: no connection to NATS at {nats_addr}: {sockets:?}"
            );
        }
        if host == "trainer" {
            assert!(
                connected_to(redis_addr),
                "{host}: no connection to Redis at {redis_addr}: {sockets:?}"
            );
        }
    }

    // The tracker (on the infra host) wrote the solved eval to the shared
    // filesystem as well.
    let run_dir = runs.join(&run_id);
    let written = Instant::now() + Duration::from_secs(15);
    loop {
        let evals = std::fs::read_to_string(run_dir.join("eval.jsonl")).unwrap_or_default();
        if evals.contains("\"solved\":true") {
            break;
        }
        assert!(
            Instant::now() < written,
            "the tracker did not write the solved eval to {}:\n{evals}{}",
            run_dir.join("eval.jsonl").display(),
            procs.logs()
        );
        std::thread::sleep(Duration::from_millis(100));
    }

    // Stop with SIGTERM: the learner, then the workers, then the tracker,
    // then the infrastructure; every service drains and exits cleanly.
    let mut stopped = procs.stop(&["learner-0", "learner-1"], STOP_GRACE);
    stopped.extend(procs.stop(
        &[
            "env-runner-0",
            "env-runner-1",
            "inference-server-0",
            "evaluator-0",
            "replay-buffer-0",
        ],
        STOP_GRACE,
    ));
    stopped.extend(procs.stop(&["tracker-0"], STOP_GRACE));
    let infra_stopped = procs.stop(&["redis-server", "nats-server"], STOP_GRACE);
    for (name, status) in &stopped {
        assert!(
            status.is_some_and(|s| s.success()),
            "{name} did not exit cleanly on SIGTERM: {status:?}{}",
            procs.logs()
        );
    }
    for (name, status) in &infra_stopped {
        assert!(status.is_some(), "{name} had to be killed");
    }

    // The env-runners' fragments reached the learner: it updated.
    let metrics = std::fs::read_to_string(run_dir.join("metrics.jsonl")).unwrap_or_default();
    let updates = max_metric(&metrics, "learner_updates");
    assert!(
        updates > 0.0,
        "learner_updates is {updates} in {}",
        run_dir.join("metrics.jsonl").display()
    );
    assert!(max_metric(&metrics, "learner_env_steps") > 0.0);
    // Both learner replicas trained in a view of two, each reporting its rank.
    for rank in [0.0, 1.0] {
        let in_two = metrics
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .any(|v| {
                v["values"]["learner_replicas"].as_f64() == Some(2.0)
                    && v["values"]["learner_replica_rank"].as_f64() == Some(rank)
                    && v["values"]["learner_replica_updates"].as_f64() > Some(0.0)
            });
        assert!(
            in_two,
            "no update of learner replica rank {rank} in a view of 2"
        );
    }
    assert!(
        std::fs::read_to_string(run_dir.join("status.json"))
            .unwrap_or_default()
            .contains("\"solved\""),
        "status.json does not say solved"
    );

    drop(procs);
    let ns_names: Vec<String> = net.created().to_vec();
    drop(net);
    let left = run_iproute2(&ip, &["netns", "list"]).unwrap_or_default();
    for ns in &ns_names {
        assert!(
            !left
                .lines()
                .any(|l| l.split_whitespace().next() == Some(ns)),
            "namespace {ns} was not deleted"
        );
    }
    eprintln!(
        "multi_host: healthy after {startup:.1?}, solved (eval mean {:.1} >= {:.1} at version {}) after {solve_time:.1?}, done after {:.1?}; learner_updates {updates}",
        solved.mean_return,
        solved.threshold,
        solved.policy_version,
        started.elapsed()
    );
}

/// nats-server / redis-server from PATH (as the testkit finds them), or
/// `RELAY_NATS_SERVER` / `RELAY_REDIS_SERVER`.
fn relay_stack_which(name: &str) -> PathBuf {
    let var = match name {
        "nats-server" => "RELAY_NATS_SERVER",
        _ => "RELAY_REDIS_SERVER",
    };
    if let Ok(path) = std::env::var(var) {
        return PathBuf::from(path);
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .map(|d| d.join(name))
        .find(|p| p.is_file())
        .unwrap_or_else(|| panic!("{name} not found on PATH (set {var}, or run deploy/install.sh)"))
}

#[test]
fn multi_host_parses_proc_net_addresses() {
    // 127.0.0.1:8080 and [::1]:4222 as the kernel prints them (little endian).
    let v4 = parse_proc_addr("0100007F:1F90").unwrap();
    assert_eq!(v4, "127.0.0.1:8080".parse().unwrap());
    assert!(is_loopback(v4.ip()));
    let v6 = parse_proc_addr("00000000000000000000000001000000:107E").unwrap();
    assert_eq!(v6, "[::1]:4222".parse().unwrap());
    assert!(is_loopback(v6.ip()));
    let mapped = parse_proc_addr("0000000000000000FFFF00000100007F:0050").unwrap();
    assert!(is_loopback(mapped.ip()));
    let infra = parse_proc_addr("0100D50A:107E").unwrap();
    assert_eq!(infra, SocketAddr::from((host_ip("infra"), NATS_PORT)));
    assert!(!is_loopback(infra.ip()));
}
