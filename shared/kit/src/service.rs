//! What every service does the same way at start: flags, config, thread
//! budget, telemetry, the NATS connection, the `/metrics` + `/healthz`
//! endpoint, NATS micro service registration and periodic metric reports to
//! the tracker.

use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use prometheus::Registry;
use relay_proto::{
    MetricValue, MetricsReport, RunStatus, RunStatusUpdate, Subjects, SCHEMA_VERSION,
};

use crate::connect::{connect_nats_with, ConnectError};
use crate::http::{serve, Health};
use crate::intake::Intake;
use crate::telemetry::LogForwarding;
use crate::Shutdown;
use relay_config::{ConfigError, ExperimentConfig};

/// Flags shared by every service binary.
#[derive(Debug, Clone, clap::Args)]
pub struct ServiceArgs {
    /// Experiment config file.
    #[arg(
        long,
        env = "RELAY_CONFIG",
        default_value = "configs/cartpole-ppo.yaml"
    )]
    pub config: PathBuf,
    /// Run id; scopes every subject and key.
    #[arg(long, env = "RELAY_RUN_ID")]
    pub run_id: Option<String>,
    /// NATS URL (overrides connections.nats_url).
    #[arg(long, env = "RELAY_NATS_URL")]
    pub nats_url: Option<String>,
    /// Redis URL (overrides connections.redis_url).
    #[arg(long, env = "RELAY_REDIS_URL")]
    pub redis_url: Option<String>,
    /// Address of the /metrics and /healthz endpoint (port 0 picks one).
    #[arg(long, env = "RELAY_METRICS_ADDR", default_value = "127.0.0.1:0")]
    pub metrics_addr: SocketAddr,
    /// File the bound /metrics address is written to once the endpoint
    /// listens, so that a launcher can pass port 0 and learn the port the
    /// kernel chose (a port picked free beforehand can be taken meanwhile).
    #[arg(long, env = "RELAY_ADDR_FILE")]
    pub addr_file: Option<PathBuf>,
    /// Name of this copy; defaults to `<service>-<pid>`.
    #[arg(long, env = "RELAY_INSTANCE")]
    pub instance: Option<String>,
    /// Override any config field: `--set ppo.learning_rate=0.0003` (repeatable).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub overrides: Vec<String>,
}

/// Everything `run` needs: the experiment and this process's own settings.
#[derive(Debug, Clone)]
pub struct ServiceConfig {
    pub experiment: ExperimentConfig,
    pub metrics_addr: SocketAddr,
    /// Where to write the bound metrics address ([`ServiceArgs::addr_file`]).
    pub addr_file: Option<PathBuf>,
    pub instance: Option<String>,
}

impl ServiceConfig {
    /// A config for tests: the given experiment, an ephemeral metrics port.
    pub fn for_test(experiment: ExperimentConfig) -> Self {
        Self {
            experiment,
            metrics_addr: ([127, 0, 0, 1], 0).into(),
            addr_file: None,
            instance: None,
        }
    }
}

impl ServiceArgs {
    /// Loads the config file with every override applied, in order: file,
    /// `RELAY__*` variables, `--set`, then the dedicated flags.
    pub fn load(&self) -> Result<ServiceConfig, ConfigError> {
        let mut overrides = self.overrides.clone();
        if let Some(id) = &self.run_id {
            overrides.push(format!("run.id={id}"));
        }
        if let Some(url) = &self.nats_url {
            overrides.push(format!("connections.nats_url={url}"));
        }
        if let Some(url) = &self.redis_url {
            overrides.push(format!("connections.redis_url={url}"));
        }
        let experiment = ExperimentConfig::load(&self.config, &overrides)?;
        experiment.run_id()?;
        Ok(ServiceConfig {
            experiment,
            metrics_addr: self.metrics_addr,
            addr_file: self.addr_file.clone(),
            instance: self.instance.clone(),
        })
    }
}

/// Why a service could not start or stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum ServiceError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Connect(#[from] ConnectError),
    #[error("NATS: {0}")]
    Nats(String),
    #[error("Redis: {0}")]
    Redis(#[from] redis::RedisError),
    #[error("I/O: {0}")]
    Io(#[from] std::io::Error),
    #[error("{0}")]
    Other(String),
    /// The service could not do its part of the run ([`Service::fail`]).
    #[error("failed: {0}")]
    Failed(String),
}

impl ServiceError {
    pub fn nats(e: impl std::fmt::Display) -> Self {
        ServiceError::Nats(e.to_string())
    }
    pub fn other(e: impl std::fmt::Display) -> Self {
        ServiceError::Other(e.to_string())
    }
}

static LOGS: std::sync::OnceLock<LogForwarding> = std::sync::OnceLock::new();

/// The first service this process started, so that `main` can report an
/// error `run` returned as the service's failure.
static STARTED: std::sync::OnceLock<Service> = std::sync::OnceLock::new();

/// The common parts of a started service.
#[derive(Clone)]
pub struct Service {
    pub name: &'static str,
    pub instance: String,
    pub config: Arc<ExperimentConfig>,
    pub subjects: Subjects,
    pub nats: async_nats::Client,
    pub registry: Registry,
    pub intake: Intake,
    pub health: Health,
    pub metrics_addr: SocketAddr,
    /// Fires on the caller's shutdown signal or on [`Self::fail`]: every
    /// loop of the service waits on this one.
    pub shutdown: Shutdown,
    stop: crate::ShutdownTrigger,
    /// Why the service failed, once it has ([`Self::fail`]).
    failure: Arc<std::sync::Mutex<Option<String>>>,
    /// Registered on first use ([`Self::weights_transfer`]).
    weights_transfer: Arc<std::sync::OnceLock<crate::metrics::WeightsTransfer>>,
}

impl Service {
    /// Connects to NATS, serves /metrics and /healthz, starts log forwarding.
    pub async fn start(
        name: &'static str,
        config: ServiceConfig,
        shutdown: Shutdown,
    ) -> Result<Self, ServiceError> {
        let experiment = config.experiment;
        let run_id = experiment.run_id()?.to_string();
        let subjects = Subjects::new(&run_id);
        let instance = config
            .instance
            .unwrap_or_else(|| format!("{name}-{}-{}", std::process::id(), short_random()));
        let nats = connect_nats_with(
            &experiment.connections,
            &format!("{name}/{instance}"),
            &shutdown,
        )
        .await?;
        // Every series this process exports carries the run, service and env.
        let labels = [
            ("run_id".to_string(), run_id.clone()),
            ("service".to_string(), name.to_string()),
            ("env_id".to_string(), experiment.run.env_id.clone()),
        ];
        let registry = Registry::new_custom(None, Some(labels.into_iter().collect()))
            .expect("valid const labels");
        let intake = Intake::new(&registry);
        let health = Health::default();
        let metrics_addr = serve(
            config.metrics_addr,
            registry.clone(),
            health.clone(),
            shutdown.clone(),
        )
        .await?;
        if let Some(path) = &config.addr_file {
            // Written whole, then renamed: a reader never sees half an address.
            let tmp = path.with_extension("tmp");
            std::fs::write(&tmp, metrics_addr.to_string())?;
            std::fs::rename(&tmp, path)?;
        }
        if let Some(logs) = LOGS.get() {
            logs.start(
                nats.clone(),
                subjects.logs(),
                name.to_string(),
                instance.clone(),
                shutdown.clone(),
            );
        }
        tracing::info!(service = name, %instance, run_id, %metrics_addr, "started");
        // The service stops on the caller's signal or on its own failure.
        let (stop, own_shutdown) = Shutdown::new();
        let forward = stop.clone();
        tokio::spawn(async move {
            shutdown.wait().await;
            forward.trigger();
        });
        let service = Self {
            name,
            instance,
            config: Arc::new(experiment),
            subjects,
            nats,
            registry,
            intake,
            health,
            metrics_addr,
            shutdown: own_shutdown,
            stop,
            failure: Arc::default(),
            weights_transfer: Arc::default(),
        };
        let _ = STARTED.set(service.clone());
        Ok(service)
    }

    /// Marks the service failed: it cannot do its part of the run (a
    /// version it cannot publish or fetch, a message it cannot send, a
    /// model it cannot load). Logs `reason`, publishes it as a
    /// [`RunStatus::Failed`] status (which `relay up` prints before it
    /// stops the stack and exits non-zero), and stops the service
    /// ([`Self::shutdown`] fires; [`Self::finish`] then returns the
    /// failure). Only the first failure is reported.
    pub async fn fail(&self, reason: impl Into<String>) {
        let reason = reason.into();
        {
            let mut failure = self.failure.lock().expect("failure lock");
            if failure.is_some() {
                return;
            }
            *failure = Some(reason.clone());
        }
        tracing::error!(service = self.name, %reason, "service failed; stopping");
        let status = RunStatusUpdate {
            schema: SCHEMA_VERSION,
            status: RunStatus::Failed,
            service: self.name.to_string(),
            policy_version: 0,
            detail: format!("{}: {reason}", self.instance),
        };
        self.publish(self.subjects.status(), &status).await;
        let _ = tokio::time::timeout(Duration::from_secs(2), self.nats.flush()).await;
        self.stop.trigger();
    }

    /// Why the service failed, if it has.
    pub fn failure(&self) -> Option<String> {
        self.failure.lock().expect("failure lock").clone()
    }

    /// The end of every service's `run`: drains the NATS connection and
    /// returns the failure, if [`Self::fail`] was called.
    pub async fn finish(&self) -> Result<(), ServiceError> {
        self.health.set_ready(false);
        self.drain().await;
        match self.failure() {
            Some(reason) => Err(ServiceError::Failed(reason)),
            None => Ok(()),
        }
    }

    /// The largest message the NATS server this service is connected to
    /// carries (its `max_payload`): what senders split or size their
    /// messages to.
    pub fn max_message_bytes(&self) -> usize {
        self.nats.max_payload()
    }

    /// This process's weights-transfer metrics, registered the first time
    /// anything here receives weights (a classic policy's follower, an
    /// inference server's LoRA adapters), shared by all of them after.
    pub fn weights_transfer(&self) -> crate::metrics::WeightsTransfer {
        self.weights_transfer
            .get_or_init(|| crate::metrics::WeightsTransfer::register(&self.registry))
            .clone()
    }

    /// Registers this process as a NATS micro service (`$SRV.PING/INFO/STATS`),
    /// whose endpoints share the default queue group.
    pub async fn micro(&self) -> Result<async_nats::service::Service, ServiceError> {
        use async_nats::service::ServiceExt;
        self.nats
            .service_builder()
            .description(format!("relay {}", self.name))
            .metadata([("instance".to_string(), self.instance.clone())].into())
            .start(format!("relay-{}", self.name), env!("CARGO_PKG_VERSION"))
            .await
            .map_err(ServiceError::nats)
    }

    pub fn request_timeout(&self) -> Duration {
        Duration::from_millis(self.config.connections.request_timeout_ms)
    }

    /// Publishes metric values to the tracker (fire and forget).
    pub async fn report(&self, vec_steps: Option<u64>, values: Vec<MetricValue>) {
        if values.is_empty() {
            return;
        }
        for v in &values {
            let name = format!("relay_{}", v.name);
            if crate::metrics::Catalogue::get().spec(&name).is_none() {
                tracing::error!(metric = %name, "reported metric is not in configs/metrics.yaml");
            }
            crate::metrics::record_emitted(&name);
        }
        let report = MetricsReport {
            schema: SCHEMA_VERSION,
            service: self.name.to_string(),
            instance: self.instance.clone(),
            vec_steps,
            values,
        };
        if let Err(e) = self
            .nats
            .publish(self.subjects.metrics(), relay_proto::encode(&report).into())
            .await
        {
            tracing::debug!(error = %e, "metrics report not sent");
        }
    }

    /// Publishes any wire message (fire and forget, logged on failure).
    pub async fn publish<T: relay_proto::WireMessage>(&self, subject: String, message: &T) {
        if let Err(e) = self
            .nats
            .publish(subject.clone(), relay_proto::encode(message).into())
            .await
        {
            tracing::warn!(subject, error = %e, "publish failed");
        }
    }

    /// Publishes a message that may outgrow a NATS message, divided into
    /// parts that fit ([`crate::fit`]); a message of one unit too large
    /// for any is logged as an error and not sent (the `Err`).
    pub async fn publish_within<M: relay_proto::Divisible>(
        &self,
        subject: String,
        message: M,
    ) -> Result<usize, relay_proto::Indivisible> {
        crate::fit::publish_within(&self.nats, &subject, message)
            .await
            .inspect_err(|e| tracing::error!(subject, "not sent: {e}"))
    }

    /// Drains the NATS connection (flushes what is queued, unsubscribes).
    pub async fn drain(&self) {
        let _ = tokio::time::timeout(Duration::from_secs(2), self.nats.flush()).await;
        let _ = tokio::time::timeout(Duration::from_secs(2), self.nats.drain()).await;
    }
}

fn short_random() -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    format!("{:04x}", nanos & 0xffff)
}

/// glibc returns freed blocks of 128 KiB and more to the OS at once, so a
/// forward or train step over a few hundred rows pays its page faults again
/// on every call (measured: 1.8x slower at 512 rows). Keep them instead.
/// Call first thing in `main`, before any other thread exists.
pub fn keep_freed_memory() {
    #[cfg(target_env = "gnu")]
    // SAFETY: mallopt only changes allocator thresholds; called before any
    // other thread exists.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 256 << 20);
    }
}

/// candle runs elementwise ops over more than 64K elements on its own pool
/// (`CANDLE_NUM_THREADS`, default every core), and the caller spins until
/// each pool thread has checked in: on cores shared by several processes
/// every such op waits for a descheduled thread (relay-llm's `train_step`
/// bench: 1.3-2x the CPU per train step). Turn that pool off unless the
/// user sized it; matmuls keep rayon's threads. Call before any other
/// thread exists.
pub fn calm_candle_pool() {
    if std::env::var_os("CANDLE_NUM_THREADS").is_none() {
        std::env::set_var("CANDLE_NUM_THREADS", "1");
    }
}

/// The body of every service's `main`: parse flags, load config, set the
/// compute thread budget, start telemetry, run until SIGINT/SIGTERM.
pub fn main<F, Fut>(
    name: &'static str,
    threads: fn(&ExperimentConfig) -> usize,
    run: F,
) -> anyhow::Result<()>
where
    F: FnOnce(ServiceConfig, Shutdown) -> Fut,
    Fut: Future<Output = Result<(), ServiceError>>,
{
    use clap::Parser;
    #[derive(clap::Parser)]
    struct Cli {
        #[command(flatten)]
        args: ServiceArgs,
    }
    let cli = Cli::parse();
    let config = cli
        .args
        .load()
        .map_err(|e| anyhow::anyhow!("{name}: {e}"))?;
    // candle's CPU kernels size their thread pool from this variable; many
    // processes share two cores, so each gets an explicit budget.
    if std::env::var_os("RAYON_NUM_THREADS").is_none() {
        std::env::set_var("RAYON_NUM_THREADS", threads(&config.experiment).to_string());
    }
    calm_candle_pool();
    keep_freed_memory();
    let _ = LOGS.set(crate::telemetry::init());
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    runtime.block_on(async move {
        let shutdown = Shutdown::on_signals();
        let result = run(config, shutdown).await;
        if let (Err(e), Some(service)) = (&result, STARTED.get()) {
            // An error `run` returned is the service's failure too.
            if !matches!(e, ServiceError::Failed(_)) {
                service.fail(e.to_string()).await;
            }
        }
        result
    })?;
    tracing::info!(service = name, "stopped");
    Ok(())
}
