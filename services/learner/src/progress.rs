//! What the learner's three loops (on-policy, off-policy, text) share:
//! the counters a checkpoint carries ([`Progress`]), the learner's metrics,
//! the rule that stops training ([`should_finish`]), resume counting, and the
//! end of a run ([`finish_run`]).

use std::time::Duration;

use prometheus::{Histogram, HistogramOpts, IntGauge};
use relay_kit::{gauge, Service, ServiceError, Shutdown};
use relay_proto::{RunStatus, RunStatusUpdate, SCHEMA_VERSION};

use crate::checkpoint;
pub use relay_runs::checkpoint::Progress;

/// The progress gauges every learner reports after an update: counters,
/// the version, the fraction of the `budget` (env steps) spent, SPS and
/// the ETA at that rate.
pub(crate) fn report_gauges(
    progress: &Progress,
    budget: u64,
    sps: f64,
    resumed_at_vec_steps: u64,
) -> Vec<relay_proto::MetricValue> {
    vec![
        gauge("learner_updates", progress.updates as f64),
        gauge("learner_policy_version", progress.version as f64),
        gauge("learner_env_steps", progress.env_steps as f64),
        gauge("learner_vec_steps", progress.vec_steps as f64),
        gauge("learner_episodes", progress.episodes as f64),
        gauge("learner_resumed_at_vec_steps", resumed_at_vec_steps as f64),
        gauge(
            "learner_progress",
            (progress.env_steps as f64 / budget as f64).min(1.0),
        ),
        gauge("learner_sps", sps),
        gauge(
            "learner_eta_seconds",
            budget.saturating_sub(progress.env_steps) as f64 / sps.max(1e-9),
        ),
    ]
}

/// Why training stopped.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Finish {
    Budget,
    Solved(String),
    Shutdown,
}

/// Why training must stop before the next step, if it must: shutdown
/// asked for, the budget of env steps spent, or the run solved (with
/// `run.stop_when_solved`).
pub(crate) fn should_finish(
    shutdown: &Shutdown,
    env_steps: u64,
    budget: u64,
    solved: &Option<String>,
    stop_when_solved: bool,
) -> Option<Finish> {
    if shutdown.is_triggered() {
        Some(Finish::Shutdown)
    } else if env_steps >= budget {
        Some(Finish::Budget)
    } else {
        solved
            .as_ref()
            .filter(|_| stop_when_solved)
            .map(|detail| Finish::Solved(detail.clone()))
    }
}

/// Links of a checkpoint of the learner's own state (periodic, final).
pub(crate) const LINKS_LAST: &[&str] = &["last"];

/// Links of the final checkpoint of a run stopped because it is solved: it
/// holds the solving version's weights.
pub(crate) const LINKS_LAST_SOLVED: &[&str] = &["last", "solved"];

/// The end every learner shares: announces how training ended (`budget`
/// names what the budget counts), keeps answering requests for the final
/// weights or adapter until the stack stops, then drains. Meanwhile, and
/// once more at shutdown, `evaluations` takes the reports that still
/// arrive (the evaluation of the last versions) and checkpoints them. A
/// learner that failed ([`Service::fail`]) announced that already: it
/// stops at once and returns the failure.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn finish_run(
    service: &Service,
    shutdown: &Shutdown,
    micro: async_nats::service::Service,
    finish: &Finish,
    budget: String,
    version: u64,
    env_steps: u64,
    mut evaluations: impl FnMut(),
) -> Result<(), ServiceError> {
    if service.failure().is_none() {
        let (status, detail) = match finish {
            Finish::Budget => (RunStatus::Stopped, format!("budget of {budget} spent")),
            Finish::Solved(d) => (RunStatus::Solved, d.clone()),
            Finish::Shutdown => (RunStatus::Stopped, "shutdown requested".to_string()),
        };
        tracing::info!(?status, %detail, version, env_steps, "training finished");
        let update = RunStatusUpdate {
            schema: SCHEMA_VERSION,
            status,
            service: "learner".into(),
            policy_version: version,
            detail,
        };
        service.publish(service.subjects.status(), &update).await;
        loop {
            tokio::select! {
                _ = shutdown.wait() => break,
                _ = tokio::time::sleep(Duration::from_millis(100)) => evaluations(),
            }
        }
    }
    evaluations();
    let _ = micro.stop().await;
    service.finish().await
}

pub(crate) struct Metrics {
    pub(crate) version: IntGauge,
    pub(crate) policy_lag: Histogram,
    pub(crate) update_seconds: Histogram,
}

impl Metrics {
    pub(crate) fn register(registry: &prometheus::Registry) -> Self {
        let version = IntGauge::new(
            "relay_learner_weights_version",
            "Latest weights version published.",
        )
        .unwrap();
        let policy_lag = Histogram::with_opts(
            HistogramOpts::new(
                "relay_policy_lag",
                "Learner version minus the version that acted, per fragment trained on.",
            )
            .buckets(vec![0.0, 1.0, 2.0, 3.0, 5.0, 10.0]),
        )
        .unwrap();
        let update_seconds = Histogram::with_opts(
            HistogramOpts::new("relay_learner_update_seconds", "Wall time of one update.")
                .buckets(vec![0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0]),
        )
        .unwrap();
        relay_kit::metrics::register(registry, &version);
        relay_kit::metrics::register(registry, &policy_lag);
        relay_kit::metrics::register(registry, &update_seconds);
        Self {
            version,
            policy_lag,
            update_seconds,
        }
    }
}

/// Waits `d`, or less if the service is shutting down.
pub(crate) async fn pause(shutdown: &Shutdown, d: Duration) {
    tokio::select! {
        _ = tokio::time::sleep(d) => {}
        _ = shutdown.wait() => {}
    }
}

/// Counts a start from the run's own checkpoint
/// (`relay_learner_resumes_total`; registered either way, so the series
/// exists from the start).
pub(crate) fn count_resume(service: &Service, start_from: &Option<checkpoint::StartFrom>) {
    let resumes = prometheus::IntCounter::new(
        "relay_learner_resumes_total",
        "Times this learner process started from a checkpoint of its own run.",
    )
    .unwrap();
    relay_kit::metrics::register(&service.registry, &resumes);
    if start_from.as_ref().is_some_and(|from| from.resume) {
        resumes.inc();
    }
}
