//! The env-runner's Prometheus metrics and its progress reports to the
//! tracker, shared by the classic loop and self-play.

use std::collections::VecDeque;
use std::time::Instant;

use prometheus::{Histogram, HistogramOpts, IntCounter, IntCounterVec, Opts};
use relay_bridge::FaultKind;
use relay_kit::{counter, gauge, Service};

pub(crate) struct Metrics {
    pub(crate) env_steps: IntCounter,
    pub(crate) vec_steps: IntCounter,
    pub(crate) episodes: IntCounter,
    pub(crate) act_latency: Histogram,
    pub(crate) step_seconds: Histogram,
    pub(crate) episode_seconds: Histogram,
    pub(crate) fragments: IntCounterVec,
    pub(crate) backpressure_waits: IntCounter,
    pub(crate) pace_wait_seconds: prometheus::Counter,
    pub(crate) env_faults: IntCounterVec,
    pub(crate) worker_restarts: IntCounter,
}

impl Metrics {
    pub(crate) fn register(registry: &prometheus::Registry) -> Self {
        let env_steps = IntCounter::new(
            "relay_env_runner_env_steps_total",
            "Env steps taken by this env-runner.",
        )
        .unwrap();
        let vec_steps = IntCounter::new(
            "relay_env_runner_vec_steps_total",
            "Vector steps taken by this env-runner.",
        )
        .unwrap();
        let episodes = IntCounter::new(
            "relay_env_runner_episodes_total",
            "Episodes finished by this env-runner.",
        )
        .unwrap();
        let act_latency = Histogram::with_opts(
            HistogramOpts::new(
                "relay_env_runner_act_latency_seconds",
                "Round trip of one act request.",
            )
            .buckets(vec![
                1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 5e-2, 0.25, 1.0,
            ]),
        )
        .unwrap();
        let step_seconds = Histogram::with_opts(
            HistogramOpts::new(
                "relay_env_runner_step_seconds",
                "Wall time of one vector step (a turn): act request plus env step.",
            )
            .buckets(vec![
                1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 5e-2, 0.25, 1.0,
            ]),
        )
        .unwrap();
        let episode_seconds = Histogram::with_opts(
            HistogramOpts::new(
                "relay_env_runner_episode_seconds",
                "Wall time of one episode.",
            )
            .buckets(vec![0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0, 100.0]),
        )
        .unwrap();
        let fragments = IntCounterVec::new(
            Opts::new(
                "relay_env_runner_fragments_total",
                "Rollout fragments by outcome (stored, stale, rejected).",
            ),
            &["outcome"],
        )
        .unwrap();
        let backpressure_waits = IntCounter::new(
            "relay_env_runner_backpressure_waits_total",
            "Inserts refused because the replay buffer was full.",
        )
        .unwrap();
        relay_kit::metrics::register(registry, &env_steps);
        relay_kit::metrics::register(registry, &vec_steps);
        relay_kit::metrics::register(registry, &episodes);
        relay_kit::metrics::register(registry, &act_latency);
        relay_kit::metrics::register(registry, &step_seconds);
        relay_kit::metrics::register(registry, &episode_seconds);
        relay_kit::metrics::register(registry, &fragments);
        relay_kit::metrics::register(registry, &backpressure_waits);
        let pace_wait_seconds = prometheus::Counter::new(
            "relay_env_runner_pace_wait_seconds_total",
            "Seconds an env-runner waited for the learner's next version with a whole rollout in the buffer (env_runner.pace).",
        )
        .unwrap();
        relay_kit::metrics::register(registry, &pace_wait_seconds);
        let env_faults = IntCounterVec::new(
            Opts::new(
                "relay_env_runner_env_faults_total",
                "Episodes dropped by a Python env fault, by kind (raised, crashed, hung).",
            ),
            &["kind"],
        )
        .unwrap();
        for kind in FaultKind::ALL {
            env_faults.with_label_values(&[kind.as_str()]);
        }
        let worker_restarts = IntCounter::new(
            "relay_env_runner_worker_restarts_total",
            "Python env workers restarted after a crash or a hang.",
        )
        .unwrap();
        relay_kit::metrics::register(registry, &env_faults);
        relay_kit::metrics::register(registry, &worker_restarts);
        Self {
            env_steps,
            vec_steps,
            episodes,
            act_latency,
            step_seconds,
            episode_seconds,
            fragments,
            backpressure_waits,
            pace_wait_seconds,
            env_faults,
            worker_restarts,
        }
    }
}

impl Metrics {
    /// Logs and counts the env faults of a step (their episodes are dropped).
    pub(crate) fn count_faults(&self, env_id: &str, faults: &[relay_bridge::Fault]) {
        for fault in faults {
            tracing::warn!(
                env_id,
                kind = fault.kind.as_str(),
                "env fault, episode dropped: {fault}"
            );
            self.env_faults
                .with_label_values(&[fault.kind.as_str()])
                .inc_by(fault.envs.len() as u64);
            if fault.kind.restarted() {
                self.worker_restarts.inc();
            }
        }
    }
}

/// How often a runner reports its progress (steps, step rate, version).
pub(crate) const REPORT_EVERY: std::time::Duration = std::time::Duration::from_secs(1);

/// The counters as of the last metrics report.
pub(crate) struct Reported {
    pub(crate) at: Instant,
    pub(crate) env_steps: u64,
    pub(crate) vec_steps: u64,
}

/// Reports the steps since `reported` (then moves it to now), the step
/// rate, the policy version last acted with and the mean return of the
/// recent episodes.
pub(crate) async fn report_progress(
    service: &Service,
    metrics: &Metrics,
    reported: &mut Reported,
    policy_version: u64,
    recent_returns: &VecDeque<f64>,
) {
    let (env_steps, vec_steps) = (metrics.env_steps.get(), metrics.vec_steps.get());
    let sps = (env_steps - reported.env_steps) as f64 / reported.at.elapsed().as_secs_f64();
    let mut values = vec![
        counter("env_steps_total", (env_steps - reported.env_steps) as f64),
        counter("vec_steps_total", (vec_steps - reported.vec_steps) as f64),
        gauge("env_runner_sps", sps),
        gauge("env_runner_policy_version", policy_version as f64),
    ];
    if !recent_returns.is_empty() {
        values.push(gauge(
            "env_runner_episode_return_mean",
            recent_returns.iter().sum::<f64>() / recent_returns.len() as f64,
        ));
    }
    service.report(Some(vec_steps), values).await;
    *reported = Reported {
        at: Instant::now(),
        env_steps,
        vec_steps,
    };
}
