//! Test support: real `nats-server`, `redis-server` and `prometheus`
//! processes on free loopback ports, each killed (and its state folder
//! removed) on drop, plus a helper to run this workspace's service binaries
//! as child processes. Free ports, starting on one and the HTTP client are
//! `relay-local`'s, which the stack supervisor uses too.
//!
//! The servers are found on `PATH` (`deploy/install.sh` installs them) or at
//! the path in `RELAY_NATS_SERVER` / `RELAY_REDIS_SERVER` / `RELAY_PROMETHEUS`.
//! Nothing here mocks a server.
//!
//! Also where the LLM reference data lives ([`llm_fixture`]), shared by
//! the model, inference-server and CLI tests.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use relay_local::{on_free_port, wait_for_port, Listen, Timeouts};

pub mod netns;

/// A folder of the LLM reference data (`tiny-qwen2`, `tiny-qwen3`,
/// `tiny-llama3`, `smollm2`): under `$RELAY_LLM_FIXTURES` when set (so
/// the same tests can be pointed at other models of the same layout),
/// else under `shared/fixtures` beside the repository.
pub fn llm_fixture(name: &str) -> PathBuf {
    let root = match std::env::var_os("RELAY_LLM_FIXTURES") {
        Some(dir) => PathBuf::from(dir),
        None => Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../shared/fixtures"),
    };
    root.join(name)
}

/// A port that was free a moment ago on 127.0.0.1 ([`relay_local::free_port`]).
pub fn free_port() -> u16 {
    relay_local::free_port().expect("bind an ephemeral port")
}

/// A fresh temporary folder, removed on drop.
pub struct TempDir(PathBuf);

impl TempDir {
    pub fn new(label: &str) -> Self {
        static COUNTER: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let path = std::env::temp_dir().join(format!(
            "relay-test-{label}-{}-{n}-{}",
            std::process::id(),
            free_port()
        ));
        std::fs::create_dir_all(&path).expect("create temp dir");
        Self(path)
    }
    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn binary(env_var: &str, name: &str) -> Result<PathBuf> {
    if let Ok(path) = std::env::var(env_var) {
        return Ok(PathBuf::from(path));
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    for dir in std::env::split_paths(&path) {
        let candidate = dir.join(name);
        if candidate.is_file() {
            return Ok(candidate);
        }
    }
    bail!("{name} not found on PATH (set {env_var}, or run deploy/install.sh)")
}

/// How long a test server has to listen: machines running many tests at
/// once start servers slowly. Another test's server may hold the port while
/// ours, unable to bind it, is exiting: ours must still be running a
/// moment after the port answers.
const LISTEN: Listen = Listen {
    within: Duration::from_secs(20),
    settle: Duration::from_millis(100),
};

/// Spawns the server `command(port)` builds on a free port, its output
/// discarded, and waits until it listens ([`relay_local::on_free_port`]:
/// a port found free can be taken by another test's server before ours
/// binds it, so a server that exits before listening is retried on a new
/// port a few times).
fn spawn_on_free_port(what: &str, command: impl Fn(u16) -> Command) -> Result<(Child, u16)> {
    on_free_port(what, |port| {
        let mut child = command(port)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .with_context(|| format!("starting {what}"))?;
        wait_for_port(&mut child, port, what, LISTEN)?;
        Ok(child)
    })
}

/// A running server process, killed on drop.
pub struct ServerProcess {
    child: Child,
    pub port: u16,
    pub dir: TempDir,
}

impl ServerProcess {
    /// Kills the process with SIGKILL (for fault tests) and waits for it.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Stops the process with SIGTERM, as a service manager would, and waits
    /// for it: Redis writes and fsyncs its append-only file on the way out,
    /// where SIGKILL may lose the last second of writes.
    pub fn terminate(&mut self, timeout: Duration) -> Result<std::process::ExitStatus> {
        terminate(&mut self.child, "server", timeout)
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }
}

/// Sends SIGTERM to `child` and waits up to `timeout` for it to exit
/// (SIGKILL after that, with an error).
fn terminate(child: &mut Child, name: &str, timeout: Duration) -> Result<std::process::ExitStatus> {
    // SAFETY: kill(2) with a pid we own; no memory is touched.
    unsafe {
        libc::kill(child.id() as i32, libc::SIGTERM);
    }
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(status) = child.try_wait()? {
            return Ok(status);
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            bail!("{name} did not exit within {timeout:?} of SIGTERM");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

impl Drop for ServerProcess {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A real nats-server with JetStream.
pub struct NatsServer(pub ServerProcess);

impl NatsServer {
    pub fn start() -> Result<Self> {
        Self::start_inner(None, true)
    }

    /// A nats-server without JetStream, as a shared cluster may run: no
    /// object store.
    pub fn start_without_jetstream() -> Result<Self> {
        Self::start_inner(None, false)
    }

    /// A nats-server that also reads `conf_text` as its config file (e.g.
    /// `authorization { users = [...] }`); address, port, JetStream and store
    /// folder still come from the command line.
    pub fn start_with_config(conf_text: &str) -> Result<Self> {
        Self::start_inner(Some(conf_text), true)
    }

    fn start_inner(conf_text: Option<&str>, jetstream: bool) -> Result<Self> {
        let bin = binary("RELAY_NATS_SERVER", "nats-server")?;
        let dir = TempDir::new("nats");
        let conf = match conf_text {
            Some(text) => {
                let conf = dir.path().join("nats-server.conf");
                std::fs::write(&conf, text).context("writing nats-server.conf")?;
                Some(conf)
            }
            None => None,
        };
        let (child, port) = spawn_on_free_port("nats-server", |port| {
            let mut command = Command::new(&bin);
            if let Some(conf) = &conf {
                command.arg("-c").arg(conf);
            }
            command.args(["-a", "127.0.0.1", "-p", &port.to_string()]);
            if jetstream {
                command.args(["-js", "-sd"]).arg(dir.path());
            }
            command
        })?;
        Ok(Self(ServerProcess { child, port, dir }))
    }

    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.0.port)
    }
}

/// A real redis-server without persistence.
pub struct RedisServer(pub ServerProcess);

impl RedisServer {
    pub fn start() -> Result<Self> {
        Self::start_with_args(&[])
    }

    /// Starts with extra `redis-server` arguments, e.g. `["--requirepass", "pw"]`.
    pub fn start_with_args(extra: &[&str]) -> Result<Self> {
        let bin = binary("RELAY_REDIS_SERVER", "redis-server")?;
        let dir = TempDir::new("redis");
        let (child, port) = spawn_on_free_port("redis-server", |port| {
            Self::command(&bin, port, &dir, extra)
        })?;
        Ok(Self(ServerProcess { child, port, dir }))
    }

    /// Starts with an append-only file in its folder, so that
    /// [`Self::restart_persistent`] brings its data back.
    pub fn start_persistent() -> Result<Self> {
        Self::start_with_args(&["--appendonly", "yes"])
    }

    /// Stops a [`Self::start_persistent`] server cleanly (SIGTERM: its
    /// append-only file is complete on disk; a SIGKILL can lose the writes
    /// of the last second) and starts it again on the same port and folder;
    /// returns once it listens, which is before it has loaded its data (it
    /// answers `LOADING` until then).
    pub fn restart_persistent(&mut self) -> Result<()> {
        self.0.terminate(Duration::from_secs(60))?;
        let bin = binary("RELAY_REDIS_SERVER", "redis-server")?;
        let mut child = Self::command(&bin, self.0.port, &self.0.dir, &["--appendonly", "yes"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("restarting redis-server")?;
        wait_for_port(&mut child, self.0.port, "redis-server", LISTEN)?;
        self.0.child = child;
        Ok(())
    }

    fn command(bin: &Path, port: u16, dir: &TempDir, extra: &[&str]) -> Command {
        let mut command = Command::new(bin);
        command
            .args([
                "--bind",
                "127.0.0.1",
                "--port",
                &port.to_string(),
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
            ])
            .arg(dir.path())
            .args(extra);
        command
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.0.port)
    }
}

/// A real Prometheus scraping the given `host:port` targets every second.
pub struct PrometheusServer(pub ServerProcess);

impl PrometheusServer {
    pub fn start(targets: &[String]) -> Result<Self> {
        let bin = binary("RELAY_PROMETHEUS", "prometheus")?;
        let dir = TempDir::new("prometheus");
        let targets = targets
            .iter()
            .map(|t| format!("'{t}'"))
            .collect::<Vec<_>>()
            .join(", ");
        let config = format!(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nscrape_configs:\n  - job_name: relay\n    static_configs:\n      - targets: [{targets}]\n"
        );
        let config_path = dir.path().join("prometheus.yml");
        std::fs::write(&config_path, config)?;
        let (child, port) = spawn_on_free_port("prometheus", |port| {
            let mut command = Command::new(&bin);
            command
                .arg(format!("--config.file={}", config_path.display()))
                .arg(format!(
                    "--storage.tsdb.path={}",
                    dir.path().join("data").display()
                ))
                .arg(format!("--web.listen-address=127.0.0.1:{port}"));
            command
        })?;
        Ok(Self(ServerProcess { child, port, dir }))
    }

    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.0.port)
    }
}

/// Path of a binary built from this workspace (`relay-learner`, ...), found
/// beside the test executable's `deps/` folder.
pub fn workspace_binary(name: &str) -> Result<PathBuf> {
    let exe = std::env::current_exe()?;
    let mut dir = exe.parent().context("test executable has a folder")?;
    if dir.ends_with("deps") {
        dir = dir.parent().context("deps has a parent")?;
    }
    let path = dir.join(name);
    if !path.is_file() {
        bail!(
            "{} is not built; run `cargo build --workspace` first",
            path.display()
        );
    }
    Ok(path)
}

/// A child process killed on drop; its output goes to a log file.
pub struct ChildProcess {
    pub child: Child,
    pub name: String,
    pub log: PathBuf,
}

impl ChildProcess {
    pub fn spawn(mut command: Command, name: &str, log_dir: &Path) -> Result<Self> {
        let log = log_dir.join(format!("{name}.log"));
        let file = std::fs::File::create(&log)?;
        let child = command
            .stdout(file.try_clone()?)
            .stderr(file)
            .spawn()
            .with_context(|| format!("spawning {name}"))?;
        Ok(Self {
            child,
            name: name.to_string(),
            log,
        })
    }

    /// Sends SIGTERM and waits up to `timeout` for a clean exit.
    pub fn terminate(&mut self, timeout: Duration) -> Result<std::process::ExitStatus> {
        terminate(&mut self.child, &self.name, timeout)
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for ChildProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A blocking GET on loopback: (status, body), whatever the status
/// ([`relay_local::http::get`], connecting within 2 s, each of head and
/// body within 5 s).
pub fn http_get(addr: SocketAddr, path: &str) -> Result<(u16, String)> {
    const TIMEOUTS: Timeouts = Timeouts {
        connect: Duration::from_secs(2),
        read: Duration::from_secs(5),
    };
    relay_local::http::get(addr, path, TIMEOUTS)
}

/// A `relay up` supervisor a test started: interrupted (SIGINT, as a
/// user's Ctrl-C) and waited for on drop, when a test fails half-way.
pub struct Supervisor(pub Child);

impl Supervisor {
    /// Sends SIGINT: the supervisor stops its stack and exits.
    pub fn interrupt(&self) {
        signal(self.0.id(), libc::SIGINT);
    }

    /// Ctrl-C, then how long after it each of `pids` ended, watched until
    /// all have and the supervisor itself has exited (one time for each
    /// look over them: a process seen ended in the same look as another
    /// ended no later). Fails after 60 s, showing `log`.
    pub fn interrupt_and_time(
        &mut self,
        pids: &[u32],
        log: &Path,
    ) -> std::collections::BTreeMap<u32, Duration> {
        let stopped = Instant::now();
        self.interrupt();
        let mut ended_at = std::collections::BTreeMap::new();
        while ended_at.len() < pids.len() || matches!(self.0.try_wait(), Ok(None)) {
            assert!(
                stopped.elapsed() < Duration::from_secs(60),
                "the stack did not stop:\n{}",
                std::fs::read_to_string(log).unwrap_or_default()
            );
            let now = stopped.elapsed();
            for &pid in pids {
                if !ended_at.contains_key(&pid) && process_ended(pid) {
                    ended_at.insert(pid, now);
                }
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        ended_at
    }
}

/// Whether process `pid` has ended (gone, or a zombie its parent has not
/// reaped yet).
pub fn process_ended(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => stat
            .rsplit_once(')')
            .is_some_and(|(_, rest)| rest.trim_start().starts_with('Z')),
        Err(_) => true,
    }
}

impl Drop for Supervisor {
    fn drop(&mut self) {
        if matches!(self.0.try_wait(), Ok(None)) {
            self.interrupt();
            let _ = self.0.wait();
        }
    }
}

/// Sends signal `sig` to process `pid`.
pub fn signal(pid: u32, sig: i32) {
    // SAFETY: kill(2) takes any pid and signal number; a wrong one fails
    // with an error code, which a test's later checks notice.
    unsafe {
        libc::kill(pid as i32, sig);
    }
}

/// `relay up`'s record of its stack (`<state>/stack.json`), once written.
pub fn stack_record(state: &Path) -> Option<serde_json::Value> {
    serde_json::from_str(&std::fs::read_to_string(state.join("stack.json")).ok()?).ok()
}
