//! Linux network namespaces as separate "hosts" on one machine, for the
//! multi-host test and the bandwidth-limited all-reduce benchmark: one
//! namespace holds a bridge, every host namespace has one veth (`eth0`)
//! whose peer sits on that bridge, so nothing is added to the root
//! namespace and no host reaches another over loopback. A thread enters a
//! host with [`spawn_in_netns`]; a host's link can be shaped with `tc`
//! ([`Network::limit_egress`]) as a model of a cluster's NICs. Needs root
//! and iproute2 (`ip`, `tc`).

use std::fs::File;
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

/// An iproute2 binary (`ip`, `tc`) on PATH or in the usual sbin folders
/// (the PATH of a test may lack them).
pub fn iproute2_binary(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/sbin", "/sbin", "/usr/bin", "/bin"].map(PathBuf::from))
        .map(|d| d.join(name))
        .find(|p| p.is_file())
}

/// Runs an iproute2 command; its stdout, or an error naming the command.
pub fn run_iproute2(binary: &Path, args: &[&str]) -> Result<String> {
    let out = Command::new(binary)
        .args(args)
        .output()
        .with_context(|| format!("running {} {}", binary.display(), args.join(" ")))?;
    if !out.status.success() {
        bail!(
            "`{} {}` failed with {}: {}",
            binary.display(),
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Kills what still runs in `ns` (SIGKILL) and deletes it; its veths go with it.
pub fn destroy_netns(ip: &Path, ns: &str) {
    if let Ok(pids) = run_iproute2(ip, &["netns", "pids", ns]) {
        for pid in pids
            .split_whitespace()
            .filter_map(|p| p.parse::<i32>().ok())
        {
            // SAFETY: kill(2) on a process inside a namespace this run created.
            unsafe {
                libc::kill(pid, libc::SIGKILL);
            }
        }
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline
            && run_iproute2(ip, &["netns", "pids", ns]).is_ok_and(|p| !p.trim().is_empty())
        {
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    if let Err(e) = run_iproute2(ip, &["netns", "del", ns]) {
        eprintln!("netns: could not delete namespace {ns}: {e}");
    }
}

/// Deletes the namespaces named `<prefix><pid>-...` whose process is gone
/// (left by a run that crashed).
pub fn remove_leftovers(ip: &Path, prefix: &str) -> Result<()> {
    let list = run_iproute2(ip, &["netns", "list"])?;
    for name in list.lines().filter_map(|l| l.split_whitespace().next()) {
        let Some(rest) = name.strip_prefix(prefix) else {
            continue;
        };
        let Some(pid) = rest.split('-').next().and_then(|p| p.parse::<u32>().ok()) else {
            continue;
        };
        if pid != std::process::id() && Path::new(&format!("/proc/{pid}")).exists() {
            continue; // another run, still alive
        }
        eprintln!("netns: removing namespace {name} left by an earlier run");
        destroy_netns(ip, name);
    }
    Ok(())
}

/// A bridge and hosts; every namespace is deleted on drop.
pub struct Network {
    ip: PathBuf,
    prefix: String,
    created: Vec<String>,
}

impl Network {
    /// A bridge namespace and one namespace per `(host, address)`, each
    /// host's `eth0` on the bridge with its address in a /24. Namespaces are
    /// named `<prefix><pid>-<host>`.
    pub fn create(ip: &Path, prefix: &str, hosts: &[(&str, Ipv4Addr)]) -> Result<Self> {
        let mut net = Self {
            ip: ip.to_path_buf(),
            prefix: format!("{prefix}{}-", std::process::id()),
            created: Vec::new(),
        };
        let br = net.add_ns("bridge")?;
        run_iproute2(ip, &["-n", &br, "link", "add", "br0", "type", "bridge"])?;
        run_iproute2(ip, &["-n", &br, "link", "set", "br0", "up"])?;
        for (host, address) in hosts {
            let ns = net.add_ns(host)?;
            let port = format!("v-{host}");
            run_iproute2(
                ip,
                &[
                    "-n", &br, "link", "add", &port, "type", "veth", "peer", "name", "eth0",
                    "netns", &ns,
                ],
            )?;
            run_iproute2(
                ip,
                &["-n", &br, "link", "set", &port, "master", "br0", "up"],
            )?;
            let cidr = format!("{address}/24");
            run_iproute2(ip, &["-n", &ns, "addr", "add", &cidr, "dev", "eth0"])?;
            run_iproute2(ip, &["-n", &ns, "link", "set", "eth0", "up"])?;
        }
        Ok(net)
    }

    fn add_ns(&mut self, host: &str) -> Result<String> {
        let ns = self.ns(host);
        run_iproute2(&self.ip, &["netns", "add", &ns])?;
        self.created.push(ns.clone());
        run_iproute2(&self.ip, &["-n", &ns, "link", "set", "lo", "up"])?;
        Ok(ns)
    }

    /// The namespace of `host`.
    pub fn ns(&self, host: &str) -> String {
        format!("{}{host}", self.prefix)
    }

    /// `program` to be run inside `host` (`ip netns exec`, which execs it:
    /// the child's pid is the program's).
    pub fn command(&self, host: &str, program: &Path) -> Command {
        let mut command = Command::new(&self.ip);
        command.args(["netns", "exec", &self.ns(host)]).arg(program);
        command
    }

    /// Every namespace created, the bridge's first.
    pub fn created(&self) -> &[String] {
        &self.created
    }

    /// Limits what `host` sends to `rate` (tc's units, e.g. `10gbit`) with a
    /// token bucket on its `eth0`: a NIC of that speed. Each direction of a
    /// link between two hosts is then limited by its sender's bucket.
    pub fn limit_egress(&self, host: &str, rate: &str) -> Result<()> {
        let tc = iproute2_binary("tc").context("`tc` (iproute2) is not installed")?;
        let args = ["qdisc", "add", "dev", "eth0", "root", "tbf", "rate", rate];
        let out = self
            .command(host, &tc)
            .args(args)
            .args(["burst", "4mb", "latency", "100ms"])
            .output()?;
        if !out.status.success() {
            bail!(
                "tc {} in {host}: {}",
                args.join(" "),
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        Ok(())
    }
}

impl Drop for Network {
    fn drop(&mut self) {
        for ns in self.created.iter().rev() {
            destroy_netns(&self.ip, ns);
        }
    }
}

/// Runs `f` on a thread that has entered network namespace `ns`.
pub fn in_netns<T: Send + 'static>(ns: &str, f: impl FnOnce() -> T + Send + 'static) -> Result<T> {
    let handle = spawn_in_netns(ns, f)?;
    handle
        .join()
        .map_err(|_| anyhow::anyhow!("thread in {ns} panicked"))?
}

/// Starts `f` on a thread that has entered network namespace `ns`: every
/// socket it opens is that host's.
pub fn spawn_in_netns<T: Send + 'static>(
    ns: &str,
    f: impl FnOnce() -> T + Send + 'static,
) -> Result<std::thread::JoinHandle<Result<T>>> {
    let path = format!("/run/netns/{ns}");
    let file = File::open(&path).with_context(|| format!("opening {path}"))?;
    let ns = ns.to_string();
    Ok(std::thread::spawn(move || {
        use std::os::fd::AsRawFd;
        // SAFETY: setns(2) on an open namespace file; it changes only this
        // thread's network namespace.
        if unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
            bail!("setns into {ns}: {}", std::io::Error::last_os_error());
        }
        Ok(f())
    }))
}

/// Waits until `addr` accepts TCP connections from namespace `ns`.
pub fn wait_reachable(ns: &str, addr: SocketAddr, timeout: Duration) -> Result<()> {
    in_netns(ns, move || {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok() {
                return true;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        false
    })?
    .then_some(())
    .with_context(|| format!("{addr} not reachable from {ns} within {timeout:?}"))
}
