//! The local stack: nats-server, redis-server, prometheus (and grafana-server
//! where installed) plus every relay service as its own process, with state
//! under one folder (`.relay/` by default) and a record of what runs in
//! `.relay/stack.json` so that `relay down` can stop a stack left running.
//! Redis and JetStream keep their data per run (`redis/<run-id>/`,
//! `nats/<run-id>/`): a resumed run finds its replay tables and adapter
//! versions again, and a new run does not load every earlier run's data
//! (one shared Redis folder had grown to 540 MB in memory, a second of
//! loading before each run could start).
//!
//! Every child runs in its own process group: Ctrl-C reaches only the
//! supervisor, which then stops the services in order (learner, workers,
//! tracker) before the infrastructure. A service asked to stop (SIGTERM)
//! ends within 2 s, in the middle of an evaluation episode or of a wait on
//! a Python worker too; one that breaks that promise is killed after the
//! grace with its whole process group, so the Python env workers it
//! started die with it, and a group that outlives its service is killed
//! as it exits: no process of the stack outlives `relay up`.

use std::net::SocketAddr;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use relay_local::{on_free_port, wait_for_port, Listen, Timeouts};
use serde::{Deserialize, Serialize};

/// A port that was free a moment ago (for the benchmarks, which start
/// servers of their own beside a stack).
pub use relay_local::free_port;

/// The services of a run, in the order they start; the learner goes last so
/// that training starts once everything else listens.
pub const SERVICES: [&str; 6] = [
    "tracker",
    "replay-buffer",
    "inference-server",
    "evaluator",
    "env-runner",
    "learner",
];

/// How many copies of each scalable service to start.
#[derive(Debug, Clone)]
pub struct Copies {
    pub env_runners: usize,
    pub inference_servers: usize,
    pub learners: usize,
}

/// What `relay down` needs to find a running stack.
#[derive(Debug, Serialize, Deserialize, Default)]
pub struct StackRecord {
    pub run_id: String,
    pub nats_url: String,
    pub redis_url: String,
    pub prometheus_url: String,
    pub processes: Vec<ProcessRecord>,
}

#[derive(Debug, Serialize, Deserialize)]
pub struct ProcessRecord {
    pub name: String,
    pub pid: u32,
    pub metrics_addr: Option<String>,
}

/// A child process of the stack.
pub struct Proc {
    pub name: String,
    pub child: Child,
    /// A service's /metrics address, known once it has written its
    /// `addr_file`; infrastructure has none.
    pub metrics_addr: Option<SocketAddr>,
    /// Where a service writes the address it bound (it binds port 0).
    pub addr_file: Option<PathBuf>,
}

/// Where a starting service stands ([`Proc::poll_start`]).
pub enum StartState {
    Starting,
    Healthy,
    Exited(std::process::ExitStatus),
}

impl Proc {
    /// Learns the service's address from its `addr_file` once written, then
    /// asks `/healthz`.
    pub fn poll_start(&mut self) -> Result<StartState> {
        if self.metrics_addr.is_none() {
            if let Some(file) = &self.addr_file {
                self.metrics_addr = std::fs::read_to_string(file)
                    .ok()
                    .and_then(|text| text.trim().parse().ok());
            }
        }
        if let Some(addr) = self.metrics_addr {
            if http_status(addr, "/healthz") == Some(200) {
                return Ok(StartState::Healthy);
            }
        }
        Ok(match self.child.try_wait()? {
            Some(status) => StartState::Exited(status),
            None => StartState::Starting,
        })
    }
}

/// Finds a program on PATH.
pub fn which(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join(name))
        .find(|p| p.is_file())
}

fn require(name: &str) -> Result<PathBuf> {
    which(name).with_context(|| {
        format!("{name} is not installed; run `bash deploy/install.sh` (or `just up`, which does)")
    })
}

/// How long a server of the stack has to listen on its port (30 s);
/// it counts as listening once the port answers while it runs.
const LISTEN: Listen = Listen {
    within: Duration::from_secs(30),
    settle: Duration::ZERO,
};

/// A nats-server of relay's own with JetStream, on a free port, stopped
/// on drop: for commands that need NATS and nothing else of the stack
/// (`relay sft --replicas N` on one machine).
pub struct LocalNats {
    pub url: String,
    proc: Proc,
    state_dir: PathBuf,
}

impl LocalNats {
    /// Starts it with its state and log under `state_dir`, which goes
    /// with it: nothing in it outlives the command.
    pub fn start(state_dir: &Path, name: &str) -> Result<Self> {
        std::fs::create_dir_all(state_dir.join("logs"))?;
        let (proc, port) = on_free_port("nats-server", |port| {
            spawn_nats(state_dir, name, port, relay_proto::DEFAULT_MAX_PAYLOAD)
        })?;
        Ok(Self {
            url: format!("nats://127.0.0.1:{port}"),
            proc,
            state_dir: state_dir.to_path_buf(),
        })
    }
}

impl Drop for LocalNats {
    fn drop(&mut self) {
        stop_all(
            std::slice::from_mut(&mut self.proc),
            Duration::from_secs(10),
        );
        let _ = std::fs::remove_dir_all(&self.state_dir);
    }
}

/// The time limits of a health probe: a service that does not answer
/// within them counts as not (yet) healthy.
const PROBE: Timeouts = Timeouts {
    connect: Duration::from_millis(300),
    read: Duration::from_secs(1),
};

/// The status of a GET of `path` from `addr` (a health probe,
/// [`relay_local::http::status`]); `None` when nothing answered in time.
pub fn http_status(addr: SocketAddr, path: &str) -> Option<u16> {
    relay_local::http::status(addr, path, PROBE).ok()
}

/// A service's `/metrics` text at `addr` ([`relay_local::http::get`]:
/// connecting within 300 ms, each of head and body within 5 s).
pub fn scrape(addr: SocketAddr) -> Option<String> {
    const SCRAPE: Timeouts = Timeouts {
        connect: Duration::from_millis(300),
        read: Duration::from_secs(5),
    };
    relay_local::http::get(addr, "/metrics", SCRAPE)
        .ok()
        .map(|(_, text)| text)
}

/// The value of the first sample of metric `name` (`name value` or
/// `name{labels} value`) in a `/metrics` text.
pub fn metric_value(text: &str, name: &str) -> Option<f64> {
    text.lines().find_map(|l| {
        let rest = l.strip_prefix(name)?;
        if !(rest.starts_with('{') || rest.starts_with(' ')) {
            return None;
        }
        rest.rsplit(' ').next()?.trim().parse().ok()
    })
}

fn log_file(dir: &Path, name: &str) -> Result<(Stdio, Stdio)> {
    let file = std::fs::File::create(dir.join(format!("{name}.log")))?;
    Ok((file.try_clone()?.into(), file.into()))
}

/// Like `log_file`, but keeps what an earlier copy (before a restart) wrote.
fn append_log_file(dir: &Path, name: &str) -> Result<(Stdio, Stdio)> {
    let file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(dir.join(format!("{name}.log")))?;
    Ok((file.try_clone()?.into(), file.into()))
}

/// A nats-server and a redis-server that run elsewhere (`relay up
/// --nats-url/--redis-url`): the stack connects to them instead of
/// starting its own.
#[derive(Debug, Clone, Default)]
pub struct ExternalInfra {
    pub nats_url: Option<String>,
    pub redis_url: Option<String>,
}

/// A running local stack; everything is stopped on drop.
pub struct Stack {
    pub state_dir: PathBuf,
    pub run_id: String,
    pub nats_url: String,
    pub redis_url: String,
    pub prometheus_url: Option<String>,
    /// grafana-server's URL, when it is installed and started.
    pub grafana_url: Option<String>,
    infra: Vec<Proc>,
    pub services: Vec<Proc>,
    /// The `max_payload` relay's own nats-server was started with.
    nats_max_payload: usize,
    /// Next copy number of each service: instance names are never reused
    /// within a stack (`env-runner-3` after `env-runner-2` was removed).
    next_copy: std::collections::HashMap<String, usize>,
    /// Config and overrides the services were started with (for `relay scale`).
    pub(crate) service_args: Option<(PathBuf, Vec<String>)>,
}

impl Stack {
    /// Starts nats-server (carrying messages of up to `nats_max_payload`
    /// bytes: see `ExperimentConfig::nats_max_payload`) and redis-server
    /// (each unless `external` names a running one) and (if installed)
    /// prometheus on free ports with state under `state_dir`.
    pub fn start_infra(
        state_dir: &Path,
        run_id: &str,
        external: &ExternalInfra,
        nats_max_payload: usize,
    ) -> Result<Self> {
        let logs = state_dir.join("logs");
        std::fs::create_dir_all(&logs)?;
        let mut infra = Vec::new();

        let nats_url = match &external.nats_url {
            Some(url) => url.clone(),
            None => {
                let (nats, port) = on_free_port("nats-server", |port| {
                    spawn_nats(state_dir, run_id, port, nats_max_payload)
                })?;
                infra.push(nats);
                format!("nats://127.0.0.1:{port}")
            }
        };
        let redis_url = match &external.redis_url {
            Some(url) => url.clone(),
            None => {
                let (redis, port) =
                    on_free_port("redis-server", |port| spawn_redis(state_dir, run_id, port))?;
                infra.push(redis);
                format!("redis://127.0.0.1:{port}")
            }
        };

        let mut stack = Self {
            state_dir: state_dir.to_path_buf(),
            run_id: run_id.to_string(),
            nats_url,
            redis_url,
            prometheus_url: None,
            grafana_url: None,
            infra,
            services: Vec::new(),
            nats_max_payload,
            next_copy: Default::default(),
            service_args: None,
        };
        stack.start_prometheus()?;
        stack.start_grafana()?;
        stack.write_record()?;
        Ok(stack)
    }

    fn start_prometheus(&mut self) -> Result<()> {
        let Some(bin) = which("prometheus") else {
            tracing::warn!("prometheus is not installed; metrics are served but not scraped");
            return Ok(());
        };
        let dir = self.state_dir.join("prometheus");
        std::fs::create_dir_all(&dir)?;
        let template = include_str!("../../../deploy/prometheus/prometheus.yml");
        let config = template.replace(
            "targets/*.json",
            &format!("{}/targets/*.json", dir.display()),
        );
        std::fs::create_dir_all(dir.join("targets"))?;
        std::fs::write(dir.join("prometheus.yml"), config)?;
        std::fs::write(
            dir.join("rules.yml"),
            include_str!("../../../deploy/prometheus/rules.yml"),
        )?;
        let logs = self.state_dir.join("logs");
        let (child, port) = on_free_port("prometheus", |port| {
            let (out, err) = log_file(&logs, "prometheus")?;
            let mut child = Command::new(&bin)
                .arg(format!(
                    "--config.file={}",
                    dir.join("prometheus.yml").display()
                ))
                .arg(format!(
                    "--storage.tsdb.path={}",
                    dir.join("data").display()
                ))
                .arg(format!("--web.listen-address=127.0.0.1:{port}"))
                .stdout(out)
                .stderr(err)
                .process_group(0)
                .spawn()
                .context("starting prometheus")?;
            wait_for_port(&mut child, port, "prometheus", LISTEN)?;
            Ok(child)
        })?;
        self.prometheus_url = Some(format!("http://127.0.0.1:{port}"));
        self.infra.push(Proc {
            name: "prometheus".into(),
            child,
            metrics_addr: None,
            addr_file: None,
        });
        Ok(())
    }

    /// Starts grafana-server with `grafana/provisioning` when it is installed.
    fn start_grafana(&mut self) -> Result<()> {
        let (Some(bin), Some(prometheus)) = (which("grafana-server"), self.prometheus_url.clone())
        else {
            return Ok(());
        };
        // `just up` runs from the repository root, where grafana/ lives.
        let Ok(grafana_dir) = Path::new("grafana").canonicalize() else {
            return Ok(());
        };
        let port = free_port()?;
        let data = self.state_dir.join("grafana");
        std::fs::create_dir_all(&data)?;
        let (out, err) = log_file(&self.state_dir.join("logs"), "grafana-server")?;
        let child = Command::new(bin)
            .args(["--homepath", "/usr/share/grafana"])
            .env("GF_PATHS_PROVISIONING", grafana_dir.join("provisioning"))
            .env("GF_PATHS_DATA", &data)
            .env("GF_SERVER_HTTP_ADDR", "127.0.0.1")
            .env("GF_SERVER_HTTP_PORT", port.to_string())
            .env("RELAY_PROMETHEUS_URL", prometheus)
            .env("RELAY_GRAFANA_DASHBOARDS", grafana_dir.join("dashboards"))
            .stdout(out)
            .stderr(err)
            .process_group(0)
            .spawn()
            .context("starting grafana-server")?;
        let url = format!("http://127.0.0.1:{port}");
        println!("relay: grafana {url}");
        self.grafana_url = Some(url);
        self.infra.push(Proc {
            name: "grafana-server".into(),
            child,
            metrics_addr: None,
            addr_file: None,
        });
        Ok(())
    }

    /// Starts one copy of a service binary (found beside this executable).
    pub fn spawn_service(
        &mut self,
        service: &str,
        config: &Path,
        overrides: &[String],
    ) -> Result<()> {
        let bin = sibling_binary(&format!("relay-{service}"))?;
        self.service_args = Some((config.to_path_buf(), overrides.to_vec()));
        let copy = self.next_copy.entry(service.to_string()).or_default();
        let name = format!("{service}-{copy}");
        *copy += 1;
        // The service binds port 0 and says which port it got: a port
        // picked free here could be taken before the service binds it.
        let addrs = self.state_dir.join("addrs");
        std::fs::create_dir_all(&addrs)?;
        let addr_file = addrs.join(&name);
        let _ = std::fs::remove_file(&addr_file);
        let (out, err) = log_file(&self.state_dir.join("logs"), &name)?;
        let mut command = Command::new(bin);
        command
            .arg("--config")
            .arg(config)
            .args([
                "--run-id",
                &self.run_id,
                "--nats-url",
                &self.nats_url,
                "--redis-url",
                &self.redis_url,
            ])
            .args(["--metrics-addr", "127.0.0.1:0", "--instance", &name])
            .arg("--addr-file")
            .arg(&addr_file);
        for o in overrides {
            command.args(["--set", o]);
        }
        let child = command
            .stdout(out)
            .stderr(err)
            .process_group(0)
            .spawn()
            .with_context(|| format!("starting {name}"))?;
        self.services.push(Proc {
            name,
            child,
            metrics_addr: None,
            addr_file: Some(addr_file),
        });
        self.write_record()
    }

    /// Waits until every service answers `/healthz` with 200, then lists
    /// their addresses for Prometheus and `relay top`.
    pub fn wait_healthy(&mut self, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        for p in &mut self.services {
            loop {
                match p.poll_start()? {
                    StartState::Healthy => break,
                    StartState::Exited(status) => {
                        let log = self.state_dir.join("logs").join(format!("{}.log", p.name));
                        let why = last_error_line(&log)
                            .unwrap_or_else(|| format!("see {}", log.display()));
                        bail!("{} exited with {status} during start-up: {why}", p.name);
                    }
                    StartState::Starting if Instant::now() > deadline => {
                        bail!("{} not healthy within {timeout:?}", p.name)
                    }
                    StartState::Starting => std::thread::sleep(Duration::from_millis(20)),
                }
            }
        }
        self.services_listed()
    }

    /// Writes the Prometheus targets and the stack record after services
    /// started or stopped.
    pub fn services_listed(&self) -> Result<()> {
        self.write_targets()?;
        self.write_record()
    }

    /// Names of services that have exited, with their status.
    pub fn exited(&mut self) -> Vec<(String, std::process::ExitStatus)> {
        self.services
            .iter_mut()
            .filter_map(|p| {
                p.child
                    .try_wait()
                    .ok()
                    .flatten()
                    .map(|s| (p.name.clone(), s))
            })
            .collect()
    }

    /// Starts one more copy of `service` with the config and overrides of
    /// the copies started before; returns its instance name.
    pub fn spawn_copy(&mut self, service: &str) -> Result<String> {
        let (config, overrides) = self
            .service_args
            .clone()
            .context("no service was started yet, so there is no config to start one with")?;
        self.spawn_service(service, &config, &overrides)?;
        Ok(self.services.last().expect("just spawned").name.clone())
    }

    /// Instance names of the running copies of `service`, oldest first.
    pub fn copies_of(&self, service: &str) -> Vec<String> {
        self.services
            .iter()
            .filter(|p| service_of(&p.name) == service)
            .map(|p| p.name.clone())
            .collect()
    }

    /// Takes the `n` newest copies of `service` out of the stack and sends
    /// them SIGTERM; the caller waits for them to drain. The record and the
    /// Prometheus targets no longer list them.
    pub fn take_copies(&mut self, service: &str, n: usize) -> Result<Vec<Proc>> {
        let mut taken = Vec::new();
        while taken.len() < n {
            let Some(i) = self
                .services
                .iter()
                .rposition(|p| service_of(&p.name) == service)
            else {
                break;
            };
            let p = self.services.remove(i);
            terminate(p.child.id());
            taken.push(p);
        }
        self.write_targets()?;
        self.write_record()?;
        Ok(taken)
    }

    /// The config and overrides `spawn_copy` starts new copies with.
    pub fn set_service_args(&mut self, config: &Path, overrides: &[String]) {
        self.service_args = Some((config.to_path_buf(), overrides.to_vec()));
    }

    /// SIGKILLs one service instance and takes it out of the stack (fault
    /// injection, `relay chaos`); `spawn_copy` starts its replacement.
    pub fn kill_service(&mut self, name: &str) -> Result<()> {
        let i = self
            .services
            .iter()
            .position(|p| p.name == name)
            .with_context(|| format!("{name} is not running here (not started by this stack)"))?;
        let mut p = self.services.remove(i);
        let _ = p.child.kill();
        let _ = p.child.wait();
        self.write_targets()?;
        self.write_record()
    }

    /// SIGKILLs `nats-server` or `redis-server` and starts it again on the
    /// same port with the same state folder (fault injection, `relay chaos`).
    pub fn restart_infra(&mut self, name: &str) -> Result<()> {
        let i = self
            .infra
            .iter()
            .position(|p| p.name == name)
            .with_context(|| format!("{name} is not running"))?;
        let mut old = self.infra.remove(i);
        let _ = old.child.kill();
        let _ = old.child.wait();
        let proc = match name {
            "nats-server" => spawn_nats(
                &self.state_dir,
                &self.run_id,
                url_port(&self.nats_url)?,
                self.nats_max_payload,
            )?,
            "redis-server" => {
                spawn_redis(&self.state_dir, &self.run_id, url_port(&self.redis_url)?)?
            }
            _ => bail!("{name}: only nats-server and redis-server can be restarted"),
        };
        self.infra.insert(i, proc);
        self.write_record()
    }

    /// Prometheus file-based discovery: one target per service copy.
    fn write_targets(&self) -> Result<()> {
        let dir = self.state_dir.join("prometheus").join("targets");
        if !dir.exists() {
            return Ok(());
        }
        let groups: Vec<serde_json::Value> = self
            .services
            .iter()
            .filter_map(|p| {
                Some(serde_json::json!({
                    "targets": [p.metrics_addr?.to_string()],
                    "labels": {"replica": p.name},
                }))
            })
            .collect();
        let tmp = dir.join("relay.json.tmp");
        std::fs::write(&tmp, serde_json::to_vec_pretty(&groups)?)?;
        std::fs::rename(tmp, dir.join("relay.json"))?;
        Ok(())
    }

    fn write_record(&self) -> Result<()> {
        let record = StackRecord {
            run_id: self.run_id.clone(),
            nats_url: self.nats_url.clone(),
            redis_url: self.redis_url.clone(),
            prometheus_url: self.prometheus_url.clone().unwrap_or_default(),
            processes: self
                .infra
                .iter()
                .chain(&self.services)
                .map(|p| ProcessRecord {
                    name: p.name.clone(),
                    pid: p.child.id(),
                    metrics_addr: p.metrics_addr.map(|a| a.to_string()),
                })
                .collect(),
        };
        std::fs::write(
            self.state_dir.join("stack.json"),
            serde_json::to_vec_pretty(&record)?,
        )?;
        Ok(())
    }

    /// Stops services (SIGTERM, then SIGKILL after `grace`), then the infrastructure.
    pub fn stop(&mut self, grace: Duration) {
        // The learner first (its final checkpoint and status still reach the
        // tracker), the tracker last (it writes what the others sent).
        let services = std::mem::take(&mut self.services);
        let (mut learners, rest): (Vec<Proc>, Vec<Proc>) = services
            .into_iter()
            .partition(|p| p.name.starts_with("learner"));
        let (mut trackers, mut rest): (Vec<Proc>, Vec<Proc>) = rest
            .into_iter()
            .partition(|p| p.name.starts_with("tracker"));
        stop_all(&mut learners, grace);
        stop_all(&mut rest, grace);
        stop_all(&mut trackers, grace);
        let mut infra = std::mem::take(&mut self.infra);
        infra.reverse();
        stop_all(&mut infra, grace);
        let _ = std::fs::remove_file(self.state_dir.join("stack.json"));
    }
}

impl Drop for Stack {
    fn drop(&mut self) {
        self.stop(Duration::from_secs(10));
    }
}

/// The last error a service logged (its `Error:` exit line, or the last
/// `ERROR` event), for a failure report that names the reason.
pub fn last_error_line(log: &Path) -> Option<String> {
    let text = std::fs::read_to_string(log).ok()?;
    let line = text
        .lines()
        .rev()
        .find(|l| l.contains("ERROR") || l.starts_with("Error:"))?;
    Some(line.trim().chars().take(400).collect())
}

/// The service of an instance name: `env-runner-3` -> `env-runner`.
pub fn service_of(instance: &str) -> &str {
    match instance.rsplit_once('-') {
        Some((service, n)) if n.chars().all(|c| c.is_ascii_digit()) && !n.is_empty() => service,
        _ => instance,
    }
}

fn terminate(pid: u32) {
    // SAFETY: kill(2) on a pid this process started; no memory is involved.
    unsafe {
        libc::kill(pid as i32, libc::SIGTERM);
    }
}

/// Whether `child` has exited, without reaping it: until it is reaped its
/// pid, which is its process group's id, cannot be taken by another
/// process, so [`kill_group`] still reaches only what it started.
pub(crate) fn has_exited(child: &Child) -> bool {
    // SAFETY: waitid(2) fills the zeroed siginfo_t it is given; WNOWAIT
    // leaves the child to be reaped by `Child::wait`.
    unsafe {
        let mut info: libc::siginfo_t = std::mem::zeroed();
        let flags = libc::WEXITED | libc::WNOHANG | libc::WNOWAIT;
        match libc::waitid(libc::P_PID, child.id(), &mut info, flags) {
            0 => info.si_pid() != 0,
            // Already reaped (or not ours): nothing to wait for.
            _ => true,
        }
    }
}

/// SIGKILLs the process group of `child`, which every child of the stack
/// leads (`process_group(0)`): the child and whatever it started that is
/// still there (a service's Python env workers), then reaps the child.
/// Only for a child not yet reaped ([`has_exited`]).
pub(crate) fn kill_group(child: &mut Child) -> Option<std::process::ExitStatus> {
    // SAFETY: kill(2) on the group of a child this process started and
    // has not reaped; no memory is involved.
    unsafe {
        libc::kill(-(child.id() as i32), libc::SIGKILL);
    }
    child.wait().ok()
}

/// Waits for `p`, sent SIGTERM, to exit until `deadline`, then kills it
/// (saying so); either way its process group goes with it.
fn reap(p: &mut Proc, grace: Duration, deadline: Instant) {
    while !has_exited(&p.child) {
        if Instant::now() > deadline {
            eprintln!("{} did not stop within {grace:?}; killing it", p.name);
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    kill_group(&mut p.child);
}

fn stop_all(procs: &mut [Proc], grace: Duration) {
    for p in procs.iter() {
        terminate(p.child.id());
    }
    let deadline = Instant::now() + grace;
    for p in procs.iter_mut() {
        reap(p, grace, deadline);
    }
}

/// Where `server` (`nats` or `redis`) keeps the data of run `run_id`.
fn run_data_dir(state_dir: &Path, server: &str, run_id: &str) -> Result<PathBuf> {
    let dir = state_dir.join(server).join(run_id);
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    Ok(dir)
}

/// Starts nats-server on `port` with JetStream (data under the run's
/// folder) and `max_payload` bytes a message, which only a config file
/// sets (nats-server has no flag for it).
fn spawn_nats(state_dir: &Path, run_id: &str, port: u16, max_payload: usize) -> Result<Proc> {
    let (out, err) = append_log_file(&state_dir.join("logs"), "nats-server")?;
    let data = run_data_dir(state_dir, "nats", run_id)?;
    let conf = data.join("relay-nats.conf");
    std::fs::write(
        &conf,
        format!("# Written by relay up: messages of up to what this run sends.\nmax_payload: {max_payload}\n"),
    )
    .with_context(|| format!("writing {}", conf.display()))?;
    let mut nats = Command::new(require("nats-server")?)
        .arg("-c")
        .arg(&conf)
        .args(["-a", "127.0.0.1", "-p", &port.to_string(), "-js", "-sd"])
        .arg(&data)
        .stdout(out)
        .stderr(err)
        .process_group(0)
        .spawn()
        .context("starting nats-server")?;
    wait_for_port(&mut nats, port, "nats-server", LISTEN)?;
    Ok(Proc {
        name: "nats-server".into(),
        child: nats,
        metrics_addr: None,
        addr_file: None,
    })
}

fn spawn_redis(state_dir: &Path, run_id: &str, port: u16) -> Result<Proc> {
    let redis_dir = run_data_dir(state_dir, "redis", run_id)?;
    let (out, err) = append_log_file(&state_dir.join("logs"), "redis-server")?;
    let mut redis = Command::new(require("redis-server")?)
        .args(["--bind", "127.0.0.1", "--port", &port.to_string()])
        .args(["--appendonly", "yes", "--save", "", "--dir"])
        .arg(&redis_dir)
        .stdout(out)
        .stderr(err)
        .process_group(0)
        .spawn()
        .context("starting redis-server")?;
    wait_for_port(&mut redis, port, "redis-server", LISTEN)?;
    Ok(Proc {
        name: "redis-server".into(),
        child: redis,
        metrics_addr: None,
        addr_file: None,
    })
}

fn url_port(url: &str) -> Result<u16> {
    url.rsplit(':')
        .next()
        .and_then(|p| p.trim_end_matches('/').parse().ok())
        .with_context(|| format!("no port in {url}"))
}

/// A binary of this workspace, found beside the running executable.
pub fn sibling_binary(name: &str) -> Result<PathBuf> {
    let exe = std::env::current_exe()?;
    let mut dir = exe
        .parent()
        .context("executable has a folder")?
        .to_path_buf();
    if dir.ends_with("deps") {
        dir.pop();
    }
    let path = dir.join(name);
    if !path.is_file() {
        bail!(
            "{} not found; build the workspace first (`cargo build --release`)",
            path.display()
        );
    }
    Ok(path)
}

/// `relay down`: stops the processes of a stack recorded in `state_dir`.
pub fn down(state_dir: &Path) -> Result<()> {
    let path = state_dir.join("stack.json");
    let Ok(text) = std::fs::read_to_string(&path) else {
        println!("no stack is recorded in {}", state_dir.display());
        return Ok(());
    };
    let record: StackRecord =
        serde_json::from_str(&text).with_context(|| format!("reading {}", path.display()))?;
    for p in record.processes.iter().rev() {
        terminate(p.pid);
        println!("stopped {} (pid {})", p.name, p.pid);
    }
    std::fs::remove_file(path)?;
    Ok(())
}

/// Whether a missing `llm.model` folder is one `relay up` writes itself:
/// its name is `tiny` or starts with `tiny-` (e.g. `models/tiny`).
pub fn is_tiny_model_path(path: &Path) -> bool {
    path.file_name()
        .and_then(|n| n.to_str())
        .is_some_and(|n| n == "tiny" || n.starts_with("tiny-"))
}

/// Before the services start: when the run serves an LLM whose `llm.model`
/// is a missing folder named `tiny` or `tiny-*`, writes the tiny random
/// Qwen2 there (as `relay model init tiny --out <folder>`, seed 0), so a
/// text-game config runs from a clean clone. Returns the folder written.
pub fn ensure_tiny_model(config: &relay_config::ExperimentConfig) -> Result<Option<PathBuf>> {
    let Some(model) = config.llm.model.as_deref() else {
        return Ok(None);
    };
    let path = PathBuf::from(model);
    if !config.serves_llm() || path.exists() || !is_tiny_model_path(&path) {
        return Ok(None);
    }
    crate::model::init_tiny(&path, 0)
        .with_context(|| format!("llm.model {}: writing the tiny model", path.display()))?;
    Ok(Some(path))
}
