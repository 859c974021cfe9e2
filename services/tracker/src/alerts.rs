//! Training alerts, evaluated by the tracker on smoothed metric values.
//!
//! Every rule looks at the mean of the last [`SMOOTHING`] values of a
//! metric (names as services report them, without the `relay_` prefix) and
//! raises or clears an alert; [`AlertEngine`] returns only the changes, so
//! each alert is logged once when raised and once when cleared. The same
//! rules exist for Prometheus in `deploy/prometheus/rules.yml`.
//!
//! | alert | raised when |
//! |---|---|
//! | `non_finite` | a value is NaN or infinite |
//! | `out_of_bounds` | the smoothed value leaves the catalogue's `[min, max]` |
//! | `step_stalled` | `learner_env_steps` has not grown for [`STALL`] while training |
//! | `entropy_collapse` | smoothed entropy is under a quarter of its initial mean |
//! | `return_stalled` | the smoothed training return has not beaten its best for [`RETURN_PATIENCE`] reports |
//! | `return_declining` | the smoothed training return fell more than 20% of its range below its best |
//! | `approx_kl_out_of_range` | smoothed approx KL outside [1e-3, 5e-2] |
//! | `clip_fraction_out_of_range` | smoothed clip fraction outside [0.05, 0.5] |
//! | `explained_variance_negative` | smoothed explained variance below 0 |
//! | `initial_policy_not_uniform` | the first entropy is under 90% of the uniform policy's |

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::time::{Duration, Instant};

use relay_kit::metrics::Catalogue;

/// Values averaged by every rule.
pub const SMOOTHING: usize = 10;
/// How long the learner's step counter may stand still while training.
pub const STALL: Duration = Duration::from_secs(60);
/// Training-return reports without a new best before `return_stalled`.
pub const RETURN_PATIENCE: usize = 300;
/// Healthy range of approx KL per update.
pub const APPROX_KL_RANGE: (f64, f64) = (1e-3, 5e-2);
/// Healthy range of the clip fraction.
pub const CLIP_FRACTION_RANGE: (f64, f64) = (0.05, 0.5);

/// Every alert name the engine can raise.
pub const ALERTS: [&str; 10] = [
    "non_finite",
    "out_of_bounds",
    "step_stalled",
    "entropy_collapse",
    "return_stalled",
    "return_declining",
    "approx_kl_out_of_range",
    "clip_fraction_out_of_range",
    "explained_variance_negative",
    "initial_policy_not_uniform",
];

/// An alert raised or cleared.
#[derive(Debug, Clone, PartialEq)]
pub struct AlertChange {
    pub alert: &'static str,
    pub metric: String,
    pub active: bool,
    pub value: f64,
    pub message: String,
}

/// State of every rule for one run.
pub struct AlertEngine {
    recent: HashMap<String, VecDeque<f64>>,
    initial_entropy: Vec<f64>,
    /// The learner's update count as last reported (it precedes the entropy
    /// in each report): a tracker that joins mid-run must not take the
    /// entropy it first sees for the initial policy's.
    learner_updates: Option<f64>,
    /// Entropy of the uniform policy (ln n) for discrete action spaces.
    uniform_entropy: Option<f64>,
    active: BTreeMap<(&'static str, String), f64>,
    steps: Option<(f64, Instant)>,
    training: bool,
    best_return: Option<(f64, usize)>,
    worst_return: f64,
    return_reports: usize,
}

impl AlertEngine {
    /// `actions` is the number of discrete actions (None for continuous).
    pub fn new(actions: Option<usize>) -> Self {
        Self {
            recent: HashMap::new(),
            initial_entropy: Vec::new(),
            learner_updates: None,
            uniform_entropy: actions.filter(|&n| n > 1).map(|n| (n as f64).ln()),
            active: BTreeMap::new(),
            steps: None,
            training: true,
            best_return: None,
            worst_return: f64::INFINITY,
            return_reports: 0,
        }
    }

    /// Currently raised alerts: (alert, metric) -> value.
    pub fn active(&self) -> &BTreeMap<(&'static str, String), f64> {
        &self.active
    }

    /// Training has ended (budget spent or solved): time-based rules stop.
    pub fn set_training(&mut self, training: bool, changes: &mut Vec<AlertChange>) {
        self.training = training;
        if !training {
            self.set(
                "step_stalled",
                "learner_env_steps",
                false,
                0.0,
                String::new(),
                changes,
            );
        }
    }

    fn set(
        &mut self,
        alert: &'static str,
        metric: &str,
        raise: bool,
        value: f64,
        message: String,
        changes: &mut Vec<AlertChange>,
    ) {
        let key = (alert, metric.to_string());
        let was = self.active.contains_key(&key);
        if raise {
            self.active.insert(key, value);
        } else {
            self.active.remove(&key);
        }
        if raise != was {
            let message = if raise {
                message
            } else {
                format!("{alert} cleared for {metric}")
            };
            changes.push(AlertChange {
                alert,
                metric: metric.to_string(),
                active: raise,
                value,
                message,
            });
        }
    }

    fn smoothed(&mut self, name: &str, value: f64) -> (f64, usize) {
        let window = self.recent.entry(name.to_string()).or_default();
        if window.len() == SMOOTHING {
            window.pop_front();
        }
        window.push_back(value);
        (
            window.iter().sum::<f64>() / window.len() as f64,
            window.len(),
        )
    }

    /// Takes one reported value; returns the alerts it raised or cleared.
    pub fn observe(&mut self, name: &str, value: f64, now: Instant) -> Vec<AlertChange> {
        let mut changes = Vec::new();
        if !value.is_finite() {
            self.set(
                "non_finite",
                name,
                true,
                value,
                format!("{name} is {value}"),
                &mut changes,
            );
            return changes;
        }
        self.set(
            "non_finite",
            name,
            false,
            value,
            String::new(),
            &mut changes,
        );
        let (mean, n) = self.smoothed(name, value);

        if let Some(spec) = Catalogue::get().spec(&format!("relay_{name}")) {
            let below = spec.min.is_some_and(|min| mean < min);
            let above = spec.max.is_some_and(|max| mean > max);
            let message = format!(
                "{name} smoothed to {mean:.4}, outside [{:?}, {:?}]",
                spec.min, spec.max
            );
            self.set(
                "out_of_bounds",
                name,
                below || above,
                mean,
                message,
                &mut changes,
            );
        }

        match name {
            "learner_env_steps" if self.steps.is_none_or(|(last, _)| value > last) => {
                self.steps = Some((value, now));
                self.set(
                    "step_stalled",
                    name,
                    false,
                    value,
                    String::new(),
                    &mut changes,
                );
            }
            "learner_updates" => self.learner_updates = Some(value),
            "learner_entropy" => {
                let first_update = self.learner_updates.is_none_or(|u| u <= 1.0);
                if self.initial_entropy.is_empty() && first_update {
                    if let Some(uniform) = self.uniform_entropy {
                        let message = format!("initial entropy {value:.4} is under 90% of the uniform policy's {uniform:.4}");
                        self.set(
                            "initial_policy_not_uniform",
                            name,
                            value < 0.9 * uniform,
                            value,
                            message,
                            &mut changes,
                        );
                    }
                }
                if self.initial_entropy.len() < SMOOTHING {
                    self.initial_entropy.push(value);
                }
                let initial =
                    self.initial_entropy.iter().sum::<f64>() / self.initial_entropy.len() as f64;
                if self.initial_entropy.len() == SMOOTHING && initial > 0.0 {
                    let message =
                        format!("entropy {mean:.4} is under a quarter of its initial {initial:.4}");
                    self.set(
                        "entropy_collapse",
                        name,
                        mean < 0.25 * initial,
                        mean,
                        message,
                        &mut changes,
                    );
                }
            }
            "learner_approx_kl" if n >= 3 => {
                let (lo, hi) = APPROX_KL_RANGE;
                let message = format!("approx_kl {mean:.5} outside [{lo}, {hi}]");
                self.set(
                    "approx_kl_out_of_range",
                    name,
                    !(lo..=hi).contains(&mean),
                    mean,
                    message,
                    &mut changes,
                );
            }
            "learner_clip_fraction" if n >= 3 => {
                let (lo, hi) = CLIP_FRACTION_RANGE;
                let message = format!("clip fraction {mean:.4} outside [{lo}, {hi}]");
                self.set(
                    "clip_fraction_out_of_range",
                    name,
                    !(lo..=hi).contains(&mean),
                    mean,
                    message,
                    &mut changes,
                );
            }
            "learner_explained_variance" if n >= 3 => {
                let message = format!("explained variance {mean:.4} is negative: the critic predicts worse than a constant");
                self.set(
                    "explained_variance_negative",
                    name,
                    mean < 0.0,
                    mean,
                    message,
                    &mut changes,
                );
            }
            "episode_return_mean" => {
                self.return_reports += 1;
                self.worst_return = self.worst_return.min(mean);
                match self.best_return {
                    Some((best, _)) if mean <= best => {}
                    _ => self.best_return = Some((mean, self.return_reports)),
                }
                let (best, at) = self.best_return.expect("set above");
                let since = self.return_reports - at;
                let message =
                    format!("training return has not beaten its best {best:.2} in {since} reports");
                self.set(
                    "return_stalled",
                    name,
                    since >= RETURN_PATIENCE,
                    mean,
                    message,
                    &mut changes,
                );
                let range = best - self.worst_return;
                let declining = range > 0.0 && mean < best - 0.2 * range;
                let message = format!("training return {mean:.2} fell below its best {best:.2} by more than 20% of its range");
                self.set(
                    "return_declining",
                    name,
                    declining,
                    mean,
                    message,
                    &mut changes,
                );
            }
            _ => {}
        }
        changes
    }

    /// Time-based rules; call periodically.
    pub fn tick(&mut self, now: Instant) -> Vec<AlertChange> {
        let mut changes = Vec::new();
        if let Some((steps, since)) = self.steps {
            if self.training && now.duration_since(since) > STALL {
                let message = format!(
                    "learner env steps stuck at {steps} for {:.0} s",
                    now.duration_since(since).as_secs_f64()
                );
                self.set(
                    "step_stalled",
                    "learner_env_steps",
                    true,
                    steps,
                    message,
                    &mut changes,
                );
            }
        }
        changes
    }
}

/// The alert engine wired to its outputs: the log, `relay_alert_active` and
/// `relay_alerts_raised_total`, `alerts.jsonl` in the run directory and
/// [`relay_proto::AlertEvent`]s on the run's `alerts` subject.
pub struct Alerts {
    engine: AlertEngine,
    active: prometheus::GaugeVec,
    raised: prometheus::IntCounterVec,
    file: std::io::BufWriter<std::fs::File>,
    service: relay_kit::Service,
    vec_steps: Option<u64>,
}

impl Alerts {
    pub fn open(run_dir: &std::path::Path, service: &relay_kit::Service) -> std::io::Result<Self> {
        let actions = (!service.config.is_text_game())
            .then(|| service.config.env_spec().ok())
            .flatten()
            .and_then(|s| s.action_space.n());
        let active = prometheus::GaugeVec::new(
            prometheus::Opts::new(
                "relay_alert_active",
                "1 while an alert is raised, 0 once cleared.",
            ),
            &["alert", "metric"],
        )
        .expect("valid metric");
        let raised = prometheus::IntCounterVec::new(
            prometheus::Opts::new("relay_alerts_raised_total", "Times an alert was raised."),
            &["alert"],
        )
        .expect("valid metric");
        relay_kit::metrics::register(&service.registry, &active);
        relay_kit::metrics::register(&service.registry, &raised);
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(run_dir.join("alerts.jsonl"))?;
        Ok(Self {
            engine: AlertEngine::new(actions),
            active,
            raised,
            file: std::io::BufWriter::new(file),
            service: service.clone(),
            vec_steps: None,
        })
    }

    /// Feeds every value of a metric report.
    pub async fn on_report(&mut self, report: &relay_proto::MetricsReport) {
        if report.vec_steps.is_some() {
            self.vec_steps = report.vec_steps;
        }
        let now = Instant::now();
        let changes: Vec<AlertChange> = report
            .values
            .iter()
            .flat_map(|v| self.engine.observe(&v.name, v.value, now))
            .collect();
        self.apply(changes).await;
    }

    /// Feeds one derived value (e.g. the training return mean).
    pub async fn on_value(&mut self, name: &str, value: f64) {
        let changes = self.engine.observe(name, value, Instant::now());
        self.apply(changes).await;
    }

    /// The learner stopped training: time-based rules stop.
    pub async fn on_status(&mut self, status: &relay_proto::RunStatusUpdate) {
        if status.service == "learner" && status.status != relay_proto::RunStatus::Running {
            let mut changes = Vec::new();
            self.engine.set_training(false, &mut changes);
            self.apply(changes).await;
        }
    }

    pub async fn tick(&mut self) {
        let changes = self.engine.tick(Instant::now());
        self.apply(changes).await;
    }

    pub fn flush(&mut self) -> std::io::Result<()> {
        use std::io::Write;
        self.file.flush()
    }

    async fn apply(&mut self, changes: Vec<AlertChange>) {
        use std::io::Write;
        for c in changes {
            if c.active {
                tracing::warn!(alert = c.alert, metric = %c.metric, value = c.value, "alert raised: {}", c.message);
                self.raised.with_label_values(&[c.alert]).inc();
            } else {
                tracing::info!(alert = c.alert, metric = %c.metric, "alert cleared");
            }
            self.active
                .with_label_values(&[c.alert, &c.metric])
                .set(c.active as u8 as f64);
            let line = serde_json::json!({
                "time": chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Millis, true),
                "alert": c.alert, "metric": c.metric, "active": c.active,
                "value": if c.value.is_finite() { serde_json::json!(c.value) } else { serde_json::json!(c.value.to_string()) },
                "vec_steps": self.vec_steps, "message": c.message,
            });
            if let Err(e) = writeln!(self.file, "{line}") {
                tracing::error!(error = %e, "writing alerts.jsonl failed");
            }
            let event = relay_proto::AlertEvent {
                schema: relay_proto::SCHEMA_VERSION,
                alert: c.alert.to_string(),
                metric: c.metric,
                active: c.active,
                value: c.value,
                vec_steps: self.vec_steps,
                message: c.message,
            };
            self.service
                .publish(self.service.subjects.alerts(), &event)
                .await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn feed(engine: &mut AlertEngine, name: &str, values: &[f64]) -> Vec<AlertChange> {
        let now = Instant::now();
        values
            .iter()
            .flat_map(|&v| engine.observe(name, v, now))
            .collect()
    }

    #[test]
    fn nan_raises_once_and_clears_once() {
        let mut e = AlertEngine::new(Some(2));
        let changes = feed(
            &mut e,
            "learner_policy_loss",
            &[0.1, f64::NAN, f64::NAN, 0.2],
        );
        let kinds: Vec<(&str, bool)> = changes.iter().map(|c| (c.alert, c.active)).collect();
        assert_eq!(kinds, vec![("non_finite", true), ("non_finite", false)]);
    }

    #[test]
    fn entropy_collapse_against_the_initial_mean() {
        let mut e = AlertEngine::new(Some(2));
        assert!(feed(&mut e, "learner_entropy", &[0.69; 10]).is_empty());
        let changes = feed(&mut e, "learner_entropy", &[0.05; 10]);
        assert!(
            changes
                .iter()
                .any(|c| c.alert == "entropy_collapse" && c.active),
            "{changes:?}"
        );
        let changes = feed(&mut e, "learner_entropy", &[0.6; 10]);
        assert!(
            changes
                .iter()
                .any(|c| c.alert == "entropy_collapse" && !c.active),
            "{changes:?}"
        );
    }

    #[test]
    fn a_tracker_joining_mid_run_does_not_judge_the_initial_policy() {
        let mut e = AlertEngine::new(Some(2));
        assert!(feed(&mut e, "learner_updates", &[40.0]).is_empty());
        assert!(feed(&mut e, "learner_entropy", &[0.2]).is_empty());
    }

    #[test]
    fn an_initial_policy_far_from_uniform_is_flagged() {
        let mut e = AlertEngine::new(Some(2));
        let changes = feed(&mut e, "learner_entropy", &[0.2]);
        assert!(changes
            .iter()
            .any(|c| c.alert == "initial_policy_not_uniform" && c.active));
        let mut e = AlertEngine::new(Some(2));
        assert!(feed(&mut e, "learner_entropy", &[0.69]).is_empty());
    }

    #[test]
    fn ranges_bounds_and_explained_variance() {
        let mut e = AlertEngine::new(None);
        let c = feed(&mut e, "learner_approx_kl", &[0.2, 0.2, 0.2]);
        assert!(c
            .iter()
            .any(|c| c.alert == "approx_kl_out_of_range" && c.active));
        let c = feed(&mut e, "learner_clip_fraction", &[0.01, 0.01, 0.01]);
        assert!(c
            .iter()
            .any(|c| c.alert == "clip_fraction_out_of_range" && c.active));
        let c = feed(&mut e, "learner_explained_variance", &[-0.5, -0.5, -0.5]);
        assert!(c
            .iter()
            .any(|c| c.alert == "explained_variance_negative" && c.active));
        // Catalogue bounds: progress lies in [0, 1].
        let c = feed(&mut e, "learner_progress", &[1.5]);
        assert!(c
            .iter()
            .any(|c| c.alert == "out_of_bounds" && c.active && c.metric == "learner_progress"));
    }

    #[test]
    fn stalled_steps_raise_while_training_only() {
        let mut e = AlertEngine::new(Some(2));
        let t0 = Instant::now();
        e.observe("learner_env_steps", 100.0, t0);
        assert!(e.tick(t0 + Duration::from_secs(1)).is_empty());
        let c = e.tick(t0 + STALL + Duration::from_secs(1));
        assert!(c.iter().any(|c| c.alert == "step_stalled" && c.active));
        let c = e.observe(
            "learner_env_steps",
            200.0,
            t0 + STALL + Duration::from_secs(2),
        );
        assert!(c.iter().any(|c| c.alert == "step_stalled" && !c.active));
        let mut changes = Vec::new();
        e.set_training(false, &mut changes);
        assert!(e.tick(t0 + STALL * 3).is_empty());
    }

    #[test]
    fn return_stalling_and_declining() {
        let mut e = AlertEngine::new(Some(2));
        let mut values: Vec<f64> = (0..50).map(|i| i as f64).collect();
        values.extend(std::iter::repeat_n(10.0, 30));
        let c = feed(&mut e, "episode_return_mean", &values);
        assert!(
            c.iter().any(|c| c.alert == "return_declining" && c.active),
            "{c:?}"
        );
        let c = feed(&mut e, "episode_return_mean", &vec![10.0; RETURN_PATIENCE]);
        assert!(
            c.iter().any(|c| c.alert == "return_stalled" && c.active),
            "{c:?}"
        );
    }
}
