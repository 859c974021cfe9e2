//! `relay top`: a terminal overview of one run, live or finished, refreshed
//! each second.
//!
//! This module owns the whole command, in layers that can be tested apart:
//!
//! - [`TopState`]: everything the screen shows, built only from decoded
//!   messages of the run ([`TopState::on_metrics`], [`TopState::on_eval`],
//!   [`TopState::on_status`], [`TopState::on_alert`]) and health probes
//!   ([`TopState::set_health`]). It does no I/O; every method that depends on
//!   time takes `now`.
//! - [`draw`]: renders a [`TopState`] into a ratatui [`Frame`]; pure, so a test
//!   renders it on a `TestBackend` and reads the screen.
//! - [`Feed`]: the NATS subscriptions of a run (`metrics`, `eval`, `status`,
//!   `alerts`) feeding a [`TopState`]; the command and the tests use the same one.
//! - [`probe_stack`] / [`probe_state_dir`]: the `/healthz` of each service
//!   process recorded by `relay up` in `<state-dir>/stack.json`.
//! - [`TopState::set_league`]: the run's league pool (read from Redis, the
//!   stack record's or `--redis-url`), shown as a leaderboard when it exists.
//! - [`TopState::load_run_dir`]: what the run directory (`runs/<id>/`, the
//!   tracker's) already holds, loaded on attach: a finished run, or one
//!   further along than the attach, shows its evaluations, status, last
//!   metrics and alerts. With no stack running (NATS unreachable), `relay
//!   top` shows the run directory alone.
//! - [`key_action`]: which key does what (`q`, Esc and Ctrl-C quit).
//! - [`run`]: the event loop. The terminal goes into raw mode and the
//!   alternate screen, and is restored on every exit path, panics included.
//!
//! Where the numbers come from: the learner's gauges (`learner_env_steps`,
//! `learner_updates`, the PPO losses, `learner_policy_lag_max`, and
//! `learner_progress`, from which the budget `run.total_env_steps` is
//! recovered as `env_steps / progress`), the replay buffer's
//! `replay_size_steps`, the env-runners' `env_runner_sps` and
//! `env_runner_episode_return_mean`, the inference servers'
//! `inference_weights_version`. SPS is measured here from how
//! `learner_env_steps` grows over the last [`SPS_WINDOW`]. Counters are not
//! shown: `top` would only see the increments since it started.
//!
//! Health: with a stack record of the same run, each recorded service process
//! is probed on `/healthz` (200 is up); without one (services started by hand),
//! a copy is up when it sent a metric report within [`UP_WITHIN`]. Copies seen
//! in metric reports but absent from the record are listed too.

use std::collections::{BTreeMap, VecDeque};
use std::io::{BufRead, IsTerminal};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use crossterm::event::{Event, EventStream, KeyCode, KeyEvent, KeyEventKind, KeyModifiers};
use futures::stream::{BoxStream, SelectAll};
use futures::StreamExt;
use ratatui::layout::{Constraint, Layout, Rect};
use ratatui::style::{Color, Modifier, Style};
use ratatui::text::{Line, Span};
use ratatui::widgets::{Block, Cell, Gauge, Paragraph, Row, Sparkline, Table, Wrap};
use ratatui::Frame;
use relay_proto::{
    AlertEvent, EvalReport, MetricKind, MetricsReport, RunStatus, RunStatusUpdate, Subjects,
};

use crate::stack::{http_status, StackRecord, SERVICES};

/// A copy that sent a metric report this recently is "up" (when there is no
/// stack record to probe).
pub const UP_WITHIN: Duration = Duration::from_secs(3);
/// A copy silent for longer than this is no longer counted.
pub const COPY_WINDOW: Duration = Duration::from_secs(30);
/// SPS is the growth of `learner_env_steps` over this window.
pub const SPS_WINDOW: Duration = Duration::from_secs(10);
/// Eval means kept for the sparkline.
pub const EVAL_HISTORY: usize = 240;
/// NATS server used when neither `--nats-url` nor a stack record names one.
pub const DEFAULT_NATS_URL: &str = "nats://127.0.0.1:4222";

/// Flags of `relay top`.
#[derive(Debug, Clone, clap::Args)]
pub struct TopArgs {
    /// Run to watch (`<run-id>` or `@last`); defaults to the run of
    /// `<state-dir>/stack.json`, else the newest run of `--runs-dir`.
    #[arg(value_name = "RUN")]
    pub run: Option<String>,
    /// The same as RUN, as a flag.
    #[arg(long, value_name = "RUN", conflicts_with = "run")]
    pub run_id: Option<String>,
    /// NATS server; defaults to the one in `<state-dir>/stack.json`, else nats://127.0.0.1:4222.
    #[arg(long)]
    pub nats_url: Option<String>,
    /// Folder holding the stack's state (`stack.json`, written by `relay up`).
    #[arg(long, default_value = ".relay")]
    pub state_dir: PathBuf,
    /// Redis holding the run's league pool; defaults to the one in `<state-dir>/stack.json`.
    #[arg(long)]
    pub redis_url: Option<String>,
    /// Folder holding the runs (`@last` without a stack record is the newest run there).
    #[arg(long, env = "RELAY_RUNS_DIR", default_value = crate::runs::DEFAULT_RUNS_DIR)]
    pub runs_dir: PathBuf,
}

/// One member of the league table.
#[derive(Debug, Clone, PartialEq)]
pub struct LeagueRow {
    /// `v<N>` or the fixed opponent's name.
    pub player: String,
    pub mu: f64,
    pub sigma: f64,
    /// Games against any other member.
    pub games: u64,
}

/// The subject a message came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Topic {
    /// `relay.<run>.metrics`: [`MetricsReport`].
    Metrics,
    /// `relay.<run>.eval`: [`EvalReport`].
    Eval,
    /// `relay.<run>.status`: [`RunStatusUpdate`].
    Status,
    /// `relay.<run>.alerts`: [`AlertEvent`].
    Alerts,
}

/// What a `/healthz` probe found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Health {
    /// Answered 200.
    Up,
    /// Answered with another status (503 while starting or stopping).
    Unhealthy(u16),
    /// Did not answer.
    Down,
}

/// The probe of one service process of the stack record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProcessHealth {
    /// Process (and instance) name, e.g. `env-runner-1`.
    pub name: String,
    /// Service it is a copy of, e.g. `env-runner`.
    pub service: String,
    pub health: Health,
}

/// The state of one copy of a service, as shown.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CopyState {
    /// `/healthz` answered 200, or (without a probe) it reported within [`UP_WITHIN`].
    Up,
    /// `/healthz` answered with this status.
    Unhealthy(u16),
    /// `/healthz` did not answer.
    Down,
    /// Not probed, and its last metric report is this old.
    Silent(Duration),
}

/// One line of the services table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServiceRow {
    pub service: String,
    /// Every copy by instance name.
    pub copies: Vec<(String, CopyState)>,
}

impl ServiceRow {
    /// Copies that are up.
    pub fn up(&self) -> usize {
        self.copies
            .iter()
            .filter(|(_, s)| *s == CopyState::Up)
            .count()
    }
}

/// What a key does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    Quit,
}

/// Maps a key event to an action: `q`, Esc and Ctrl-C quit. Only presses
/// count (terminals that report releases would otherwise act twice).
pub fn key_action(key: &KeyEvent) -> Option<Action> {
    if key.kind != KeyEventKind::Press {
        return None;
    }
    match key.code {
        KeyCode::Char('q') | KeyCode::Char('Q') | KeyCode::Esc => Some(Action::Quit),
        KeyCode::Char('c') | KeyCode::Char('C')
            if key.modifiers.contains(KeyModifiers::CONTROL) =>
        {
            Some(Action::Quit)
        }
        _ => None,
    }
}

/// The last report of one copy of a service.
#[derive(Debug, Clone)]
struct Sighting {
    last: Instant,
    gauges: BTreeMap<String, f64>,
}

/// Everything `relay top` shows, fed by decoded messages; see the module doc.
#[derive(Debug, Clone)]
pub struct TopState {
    run_id: String,
    now: Instant,
    nats: Option<(String, bool)>,
    last_message: Option<Instant>,
    /// Newest value of each gauge, whichever copy sent it.
    latest: BTreeMap<String, f64>,
    /// service -> instance -> last report.
    copies: BTreeMap<String, BTreeMap<String, Sighting>>,
    /// `(arrival, learner_env_steps)` over the last [`SPS_WINDOW`].
    steps: VecDeque<(Instant, u64)>,
    budget: Option<u64>,
    evals: VecDeque<f64>,
    last_eval: Option<EvalReport>,
    /// evaluator instance -> its latest report (the plugin it runs).
    evaluators: BTreeMap<String, (EvalReport, Instant)>,
    best_eval: Option<f64>,
    status: Option<RunStatusUpdate>,
    /// Raised alerts by `(alert, metric)`.
    alerts: BTreeMap<(String, String), AlertEvent>,
    health: Option<Vec<ProcessHealth>>,
    /// The league's leaderboard, best conservative rating first.
    league: Vec<LeagueRow>,
}

impl TopState {
    /// An empty state for `run_id`.
    pub fn new(run_id: &str) -> Self {
        Self {
            run_id: run_id.to_string(),
            now: Instant::now(),
            nats: None,
            last_message: None,
            latest: BTreeMap::new(),
            copies: BTreeMap::new(),
            steps: VecDeque::new(),
            budget: None,
            evals: VecDeque::new(),
            last_eval: None,
            evaluators: BTreeMap::new(),
            best_eval: None,
            status: None,
            alerts: BTreeMap::new(),
            health: None,
            league: Vec::new(),
        }
    }

    /// The league pool as last read (`None`: the run has none).
    pub fn set_league(&mut self, pool: Option<&relay_league::Pool>) {
        self.league = pool
            .map(|pool| {
                let members: Vec<_> = pool.members().map(|m| m.id()).collect();
                pool.leaderboard()
                    .into_iter()
                    .map(|(member, _)| {
                        let id = member.id();
                        LeagueRow {
                            player: id.to_string(),
                            mu: member.rating.mu,
                            sigma: member.rating.sigma,
                            games: members
                                .iter()
                                .map(|other| pool.games_between(&id, other))
                                .sum(),
                        }
                    })
                    .collect()
            })
            .unwrap_or_default();
    }

    /// The league's leaderboard (empty without a pool).
    pub fn league(&self) -> &[LeagueRow] {
        &self.league
    }

    /// The run shown.
    pub fn run_id(&self) -> &str {
        &self.run_id
    }

    /// Advances the clock the screen is drawn at and forgets copies silent for
    /// longer than [`COPY_WINDOW`].
    pub fn tick(&mut self, now: Instant) {
        self.now = self.now.max(now);
        let now = self.now;
        for instances in self.copies.values_mut() {
            instances.retain(|_, s| now.saturating_duration_since(s.last) <= COPY_WINDOW);
        }
        self.copies.retain(|_, instances| !instances.is_empty());
        self.prune_steps();
    }

    fn prune_steps(&mut self) {
        while self.steps.len() > 1
            && self
                .steps
                .front()
                .is_some_and(|(t, _)| self.now.saturating_duration_since(*t) > SPS_WINDOW)
        {
            self.steps.pop_front();
        }
    }

    fn seen(&mut self, now: Instant) {
        self.now = self.now.max(now);
        self.last_message = Some(now);
    }

    /// Decodes a payload of `topic` and applies it; returns false (and
    /// changes nothing) when it does not decode.
    pub fn ingest(&mut self, topic: Topic, payload: &[u8], now: Instant) -> bool {
        match topic {
            Topic::Metrics => relay_proto::decode::<MetricsReport>(payload)
                .map(|m| self.on_metrics(&m, now))
                .is_ok(),
            Topic::Eval => relay_proto::decode::<EvalReport>(payload)
                .map(|m| self.on_eval(&m, now))
                .is_ok(),
            Topic::Status => relay_proto::decode::<RunStatusUpdate>(payload)
                .map(|m| self.on_status(&m, now))
                .is_ok(),
            Topic::Alerts => relay_proto::decode::<AlertEvent>(payload)
                .map(|m| self.on_alert(&m, now))
                .is_ok(),
        }
    }

    /// A metric report: its gauges become the newest values, its sender a
    /// copy seen at `now`.
    pub fn on_metrics(&mut self, report: &MetricsReport, now: Instant) {
        self.seen(now);
        let sighting = self
            .copies
            .entry(report.service.clone())
            .or_default()
            .entry(report.instance.clone())
            .or_insert_with(|| Sighting {
                last: now,
                gauges: BTreeMap::new(),
            });
        sighting.last = sighting.last.max(now);
        for v in report.values.iter().filter(|v| v.kind == MetricKind::Gauge) {
            sighting.gauges.insert(v.name.clone(), v.value);
            self.latest.insert(v.name.clone(), v.value);
        }
        let gauge = |name: &str| {
            report
                .values
                .iter()
                .find(|v| v.name == name && v.kind == MetricKind::Gauge)
                .map(|v| v.value)
        };
        if let Some(steps) = gauge("learner_env_steps").filter(|s| s.is_finite() && *s >= 0.0) {
            let steps = steps as u64;
            // A learner that starts over (same run id, new process) restarts the window.
            if self.steps.back().is_some_and(|(_, last)| steps < *last) {
                self.steps.clear();
            }
            self.steps.push_back((now, steps));
            self.prune_steps();
            if let Some(progress) = gauge("learner_progress").filter(|p| p.is_finite()) {
                if progress > 0.0 && progress < 1.0 {
                    self.budget = Some((steps as f64 / progress).round() as u64);
                } else if progress >= 1.0 && self.budget.is_none() {
                    self.budget = Some(steps);
                }
            }
        }
    }

    /// An evaluation: its mean joins the history.
    pub fn on_eval(&mut self, report: &EvalReport, now: Instant) {
        self.seen(now);
        if report.mean_return.is_finite() {
            if self.evals.len() == EVAL_HISTORY {
                self.evals.pop_front();
            }
            self.evals.push_back(report.mean_return);
            self.best_eval = Some(
                self.best_eval
                    .map_or(report.mean_return, |b| b.max(report.mean_return)),
            );
        }
        self.evaluators
            .insert(report.instance.clone(), (report.clone(), now));
        self.last_eval = Some(report.clone());
    }

    /// Each evaluator copy heard within [`COPY_WINDOW`] of its last report, by
    /// instance: the plugin it ran and the version it evaluated.
    pub fn active_evaluators(&self) -> impl Iterator<Item = (&str, &EvalReport)> {
        self.evaluators
            .iter()
            .filter(|(_, (_, at))| self.now.saturating_duration_since(*at) <= COPY_WINDOW)
            .map(|(instance, (report, _))| (instance.as_str(), report))
    }

    /// A change of the run's status.
    pub fn on_status(&mut self, status: &RunStatusUpdate, now: Instant) {
        self.seen(now);
        self.status = Some(status.clone());
    }

    /// An alert raised (kept) or cleared (dropped).
    pub fn on_alert(&mut self, alert: &AlertEvent, now: Instant) {
        self.seen(now);
        let key = (alert.alert.clone(), alert.metric.clone());
        if alert.active {
            self.alerts.insert(key, alert.clone());
        } else {
            self.alerts.remove(&key);
        }
    }

    /// Loads what `run_dir` (`runs/<id>/`, written by the tracker) already
    /// holds: every evaluation, the newest value of each gauge, the run's
    /// status and its raised alerts. They are dated long enough before
    /// `now` that no copy counts as running and the SPS is 0 until live
    /// messages come. Returns the records read.
    pub fn load_run_dir(&mut self, run_dir: &Path, now: Instant) -> usize {
        let past = now.checked_sub(COPY_WINDOW + SPS_WINDOW).unwrap_or(now);
        // Line by line: a long run's metrics.jsonl is large.
        let lines = |name: &str| {
            std::fs::File::open(run_dir.join(name))
                .into_iter()
                .flat_map(|f| std::io::BufReader::new(f).lines())
                .map_while(Result::ok)
                .filter_map(|l| serde_json::from_str::<serde_json::Value>(&l).ok())
        };
        let text = |v: &serde_json::Value| v.as_str().unwrap_or_default().to_string();
        let mut read = 0;
        for v in lines("metrics.jsonl") {
            let Some(values) = v["values"].as_object() else {
                continue;
            };
            let report = MetricsReport {
                schema: relay_proto::SCHEMA_VERSION,
                service: text(&v["service"]),
                instance: text(&v["instance"]),
                vec_steps: v["vec_steps"].as_u64(),
                // Counters hold increments: only gauges are shown.
                values: values
                    .iter()
                    .filter(|(name, _)| !name.ends_with("_total"))
                    .filter_map(|(name, x)| Some(relay_kit::gauge(name, x.as_f64()?)))
                    .collect(),
            };
            self.on_metrics(&report, past);
            read += 1;
        }
        // The tracker's lines are the wire messages less their schema (and
        // the env id for evaluations).
        let message = |mut v: serde_json::Value| {
            v["schema"] = relay_proto::SCHEMA_VERSION.into();
            if v.get("env_id").is_none() {
                v["env_id"] = "".into();
            }
            v
        };
        for v in lines("eval.jsonl") {
            if let Ok(report) = serde_json::from_value::<EvalReport>(message(v)) {
                self.on_eval(&report, past);
                read += 1;
            }
        }
        for v in lines("alerts.jsonl") {
            if let Ok(alert) = serde_json::from_value::<AlertEvent>(message(v)) {
                self.on_alert(&alert, past);
                read += 1;
            }
        }
        let status: Option<serde_json::Value> =
            std::fs::read_to_string(run_dir.join("status.json"))
                .ok()
                .and_then(|t| serde_json::from_str(&t).ok());
        if let Some(v) = status {
            if let Ok(status) = serde_json::from_value::<RunStatus>(v["status"].clone()) {
                self.on_status(
                    &RunStatusUpdate {
                        schema: relay_proto::SCHEMA_VERSION,
                        status,
                        service: text(&v["last_update"]["service"]),
                        policy_version: v["last_update"]["policy_version"].as_u64().unwrap_or(0),
                        detail: text(&v["detail"]),
                    },
                    past,
                );
                read += 1;
            }
        }
        self.now = self.now.max(now);
        read
    }

    /// The probes of the stack's service processes, or `None` when there is
    /// no stack record of this run (health then comes from metric reports).
    pub fn set_health(&mut self, health: Option<Vec<ProcessHealth>>) {
        self.health = health;
    }

    /// The NATS server and whether the connection is up, for the header.
    pub fn set_nats(&mut self, url: &str, connected: bool) {
        self.nats = Some((url.to_string(), connected));
    }

    /// The newest value of a gauge.
    pub fn gauge(&self, name: &str) -> Option<f64> {
        self.latest.get(name).copied()
    }

    /// Env steps the learner has consumed.
    pub fn env_steps(&self) -> Option<u64> {
        self.steps.back().map(|(_, s)| *s)
    }

    /// The run's budget of env steps (`run.total_env_steps`), once the learner
    /// has reported its progress.
    pub fn budget(&self) -> Option<u64> {
        self.budget
    }

    /// Env steps per second over the last [`SPS_WINDOW`]: 0 when the learner
    /// has been silent that long, its own `learner_sps` while the window is
    /// too short to measure.
    pub fn sps(&self) -> Option<f64> {
        let (&(t1, s1), &(t0, s0)) = (self.steps.back()?, self.steps.front()?);
        if self.now.saturating_duration_since(t1) > SPS_WINDOW {
            return Some(0.0);
        }
        let dt = t1.saturating_duration_since(t0).as_secs_f64();
        if dt >= 0.5 {
            Some(s1.saturating_sub(s0) as f64 / dt)
        } else {
            self.gauge("learner_sps").filter(|v| v.is_finite())
        }
    }

    /// Time left to spend the budget at the current SPS.
    pub fn eta(&self) -> Option<Duration> {
        let (steps, budget) = (self.env_steps()?, self.budget?);
        if steps >= budget {
            return Some(Duration::ZERO);
        }
        let sps = self.sps().filter(|s| *s > 0.0)?;
        Duration::try_from_secs_f64((budget - steps) as f64 / sps).ok()
    }

    /// Eval means, oldest first.
    pub fn eval_history(&self) -> impl Iterator<Item = f64> + '_ {
        self.evals.iter().copied()
    }

    /// The newest evaluation.
    pub fn last_eval(&self) -> Option<&EvalReport> {
        self.last_eval.as_ref()
    }

    /// The newest status update of the run.
    pub fn status(&self) -> Option<&RunStatusUpdate> {
        self.status.as_ref()
    }

    /// Raised alerts, by name then metric.
    pub fn active_alerts(&self) -> impl Iterator<Item = &AlertEvent> {
        self.alerts.values()
    }

    /// Gauge values of the copies of `service` that reported within `within`.
    fn across(&self, service: &str, name: &str, within: Duration) -> Vec<f64> {
        self.copies
            .get(service)
            .into_iter()
            .flat_map(|instances| instances.values())
            .filter(|s| self.now.saturating_duration_since(s.last) <= within)
            .filter_map(|s| s.gauges.get(name).copied())
            .collect()
    }

    /// Each service with its copies: the probed processes of the stack
    /// record, plus copies seen only in metric reports. Services in start
    /// order, then by name.
    pub fn services(&self) -> Vec<ServiceRow> {
        let mut rows: BTreeMap<String, Vec<(String, CopyState)>> = BTreeMap::new();
        for p in self.health.iter().flatten() {
            let state = match p.health {
                Health::Up => CopyState::Up,
                Health::Unhealthy(code) => CopyState::Unhealthy(code),
                Health::Down => CopyState::Down,
            };
            rows.entry(p.service.clone())
                .or_default()
                .push((p.name.clone(), state));
        }
        for (service, instances) in &self.copies {
            let row = rows.entry(service.clone()).or_default();
            for (instance, sighting) in instances {
                if row.iter().any(|(name, _)| name == instance) {
                    continue;
                }
                let age = self.now.saturating_duration_since(sighting.last);
                if age > COPY_WINDOW {
                    continue;
                }
                let state = if age <= UP_WITHIN {
                    CopyState::Up
                } else {
                    CopyState::Silent(age)
                };
                row.push((instance.clone(), state));
            }
        }
        let mut rows: Vec<ServiceRow> = rows
            .into_iter()
            .filter(|(_, copies)| !copies.is_empty())
            .map(|(service, mut copies)| {
                copies.sort_by(|a, b| a.0.cmp(&b.0));
                ServiceRow { service, copies }
            })
            .collect();
        let rank = |s: &str| {
            SERVICES
                .iter()
                .position(|k| *k == s)
                .unwrap_or(SERVICES.len())
        };
        rows.sort_by(|a, b| {
            rank(&a.service)
                .cmp(&rank(&b.service))
                .then_with(|| a.service.cmp(&b.service))
        });
        rows
    }
}

/// The service a process of the stack record is a copy of: its name without
/// the `-<n>` copy suffix.
pub fn service_of(process: &str) -> &str {
    match process.rsplit_once('-') {
        Some((service, n))
            if !service.is_empty() && !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()) =>
        {
            service
        }
        _ => process,
    }
}

/// Reads `<state_dir>/stack.json`; `Ok(None)` when there is none.
pub fn read_stack_record(state_dir: &Path) -> Result<Option<StackRecord>> {
    let path = state_dir.join("stack.json");
    let text = match std::fs::read_to_string(&path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e).with_context(|| format!("reading {}", path.display())),
    };
    serde_json::from_str(&text)
        .map(Some)
        .with_context(|| format!("reading {}", path.display()))
}

/// Probes `/healthz` of every service process of a stack record (the
/// infrastructure, which has no metrics address, is left out). Blocking.
pub fn probe_stack(record: &StackRecord) -> Vec<ProcessHealth> {
    record
        .processes
        .iter()
        .filter_map(|p| {
            let addr: SocketAddr = p.metrics_addr.as_deref()?.parse().ok()?;
            let health = match http_status(addr, "/healthz") {
                Some(200) => Health::Up,
                Some(code) => Health::Unhealthy(code),
                None => Health::Down,
            };
            Some(ProcessHealth {
                name: p.name.clone(),
                service: service_of(&p.name).to_string(),
                health,
            })
        })
        .collect()
}

/// Probes the stack recorded in `state_dir` when it runs `run_id`; `None`
/// when there is no (readable) record of that run. Blocking.
pub fn probe_state_dir(state_dir: &Path, run_id: &str) -> Option<Vec<ProcessHealth>> {
    let record = read_stack_record(state_dir).ok().flatten()?;
    (record.run_id == run_id).then(|| probe_stack(&record))
}

/// The subscriptions of one run, merged; feeds a [`TopState`].
pub struct Feed {
    messages: SelectAll<BoxStream<'static, (Topic, async_nats::Message)>>,
}

impl Feed {
    /// Subscribes to the run's `metrics`, `eval`, `status` and `alerts`.
    pub async fn subscribe(client: &async_nats::Client, run_id: &str) -> Result<Self> {
        relay_proto::validate_run_id(run_id).map_err(anyhow::Error::msg)?;
        let subjects = Subjects::new(run_id);
        let mut messages = SelectAll::new();
        for (topic, subject) in [
            (Topic::Metrics, subjects.metrics()),
            (Topic::Eval, subjects.eval()),
            (Topic::Status, subjects.status()),
            (Topic::Alerts, subjects.alerts()),
        ] {
            let subscriber = client
                .subscribe(subject.clone())
                .await
                .with_context(|| format!("subscribing to {subject}"))?;
            messages.push(subscriber.map(move |m| (topic, m)).boxed());
        }
        client.flush().await.context("flushing subscriptions")?;
        Ok(Self { messages })
    }

    /// Waits for the next message and applies it to `state` (one that does
    /// not decode is ignored). Cancel-safe. Returns false once the
    /// subscriptions have ended (the client was closed).
    pub async fn next_into(&mut self, state: &mut TopState) -> bool {
        match self.messages.next().await {
            Some((topic, message)) => {
                state.ingest(topic, &message.payload, Instant::now());
                true
            }
            None => false,
        }
    }

    /// Feeds `state` for at most `max`, or until `until(state)` holds after a
    /// message; returns whether it held.
    pub async fn feed_for(
        &mut self,
        state: &mut TopState,
        max: Duration,
        mut until: impl FnMut(&TopState) -> bool,
    ) -> bool {
        let deadline = tokio::time::Instant::now() + max;
        loop {
            if until(state) {
                return true;
            }
            match tokio::time::timeout_at(deadline, self.next_into(state)).await {
                Ok(true) => {}
                Ok(false) | Err(_) => return until(state),
            }
        }
    }
}

/// The run and NATS server `relay top` watches.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    pub run_id: String,
    pub nats_url: String,
    /// Where the league pool is, if known.
    pub redis_url: Option<String>,
}

impl TopArgs {
    /// The run asked for, positional or flag.
    fn run(&self) -> Option<&str> {
        self.run.as_deref().or(self.run_id.as_deref())
    }
}

/// Resolves the flags against the stack record: the run id (`@last` or none:
/// the record's run) and the NATS URL (the flag, the record's, the default).
pub fn resolve_target(args: &TopArgs) -> Result<Target> {
    let record = match read_stack_record(&args.state_dir) {
        Ok(record) => record,
        // Both flags given: a damaged record does not matter.
        Err(_) if args.nats_url.is_some() && args.run().is_some_and(|r| r != "@last") => None,
        Err(e) => return Err(e),
    };
    let run_id = match args.run() {
        None | Some("@last") => match &record {
            Some(r) => r.run_id.clone(),
            // No stack: the newest run of the runs folder.
            None => crate::runs::resolve_run_id(&args.runs_dir, crate::runs::LAST).with_context(
                || {
                    format!(
                        "no stack is recorded in {} (start one with `relay up`), so name the run",
                        args.state_dir.join("stack.json").display()
                    )
                },
            )?,
        },
        Some(id) => id.to_string(),
    };
    relay_proto::validate_run_id(&run_id).map_err(anyhow::Error::msg)?;
    let redis_url = args
        .redis_url
        .clone()
        .or_else(|| record.as_ref().map(|r| r.redis_url.clone()))
        .filter(|url| !url.is_empty());
    let nats_url = args
        .nats_url
        .clone()
        .or_else(|| record.map(|r| r.nats_url))
        .unwrap_or_else(|| DEFAULT_NATS_URL.to_string());
    Ok(Target {
        run_id,
        nats_url,
        redis_url,
    })
}

/// The terminal in raw mode on the alternate screen; restored on drop.
/// `ratatui::try_init` also installs a panic hook that restores it first.
struct TerminalSession {
    terminal: ratatui::DefaultTerminal,
}

impl TerminalSession {
    fn enter() -> Result<Self> {
        match ratatui::try_init() {
            Ok(terminal) => Ok(Self { terminal }),
            Err(e) => {
                ratatui::restore();
                Err(e).context("setting up the terminal")
            }
        }
    }
}

impl Drop for TerminalSession {
    fn drop(&mut self) {
        ratatui::restore();
    }
}

/// `relay top`: connects, subscribes, and shows the run until `q`, Esc or Ctrl-C.
pub fn run(args: TopArgs) -> Result<()> {
    if !std::io::stdout().is_terminal() {
        bail!("relay top draws on a terminal, and stdout is not one");
    }
    let target = resolve_target(&args)?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    // Log lines on stderr would scribble over the screen (async-nats logs its
    // connects and reconnects): silence tracing on this thread, which runs
    // every task of the current-thread runtime. Errors are returned instead.
    let quiet = tracing::subscriber::NoSubscriber::default();
    tracing::subscriber::with_default(quiet, || {
        runtime.block_on(async {
            let run_dir = args.runs_dir.join(&target.run_id);
            let connected = async_nats::ConnectOptions::new()
                .name("relay-top")
                .connection_timeout(Duration::from_secs(5))
                .connect(&target.nats_url)
                .await
                .with_context(|| format!("connecting to NATS at {}", target.nats_url));
            // No stack running: a finished run is shown from its directory.
            let client = match connected {
                Ok(client) => Some(client),
                Err(_) if run_dir.is_dir() => None,
                Err(e) => return Err(e),
            };
            let feed = match &client {
                Some(client) => Some(Feed::subscribe(client, &target.run_id).await?),
                None => None,
            };
            let mut session = TerminalSession::enter()?;
            event_loop(
                &mut session,
                client.as_ref(),
                feed,
                &target,
                &args.state_dir,
                &run_dir,
            )
            .await
        })
    })
}

async fn event_loop(
    session: &mut TerminalSession,
    client: Option<&async_nats::Client>,
    mut feed: Option<Feed>,
    target: &Target,
    state_dir: &Path,
    run_dir: &Path,
) -> Result<()> {
    let mut state = TopState::new(&target.run_id);
    state.load_run_dir(run_dir, Instant::now());
    let mut keys = EventStream::new();
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    let (health_tx, mut health_rx) = tokio::sync::watch::channel(None);
    let prober = tokio::spawn(probe_loop(
        state_dir.to_path_buf(),
        target.run_id.clone(),
        health_tx,
    ));
    let (league_tx, mut league_rx) = tokio::sync::watch::channel(None);
    let league_reader = target
        .redis_url
        .clone()
        .map(|url| tokio::spawn(league_loop(url, target.run_id.clone(), league_tx)));
    let mut feed_open = feed.is_some();
    let result = loop {
        tokio::select! {
            _ = tick.tick() => {
                state.tick(Instant::now());
                let connected = client.is_some_and(|c| c.connection_state() == async_nats::connection::State::Connected);
                state.set_nats(&target.nats_url, connected);
                if let Err(e) = session.terminal.draw(|frame| draw(frame, &state)) {
                    break Err(anyhow::Error::from(e).context("drawing"));
                }
            }
            open = async { feed.as_mut().expect("open").next_into(&mut state).await }, if feed_open => feed_open = open,
            event = keys.next() => match event {
                Some(Ok(Event::Key(key))) if key_action(&key) == Some(Action::Quit) => break Ok(()),
                Some(Ok(Event::Resize(..))) => {
                    if let Err(e) = session.terminal.draw(|frame| draw(frame, &state)) {
                        break Err(anyhow::Error::from(e).context("drawing"));
                    }
                }
                Some(Ok(_)) => {}
                Some(Err(e)) => break Err(anyhow::Error::from(e).context("reading the terminal")),
                None => break Ok(()),
            },
            Ok(()) = health_rx.changed() => {
                let health = health_rx.borrow_and_update().clone();
                state.set_health(health);
            }
            Ok(()) = league_rx.changed() => {
                let pool = league_rx.borrow_and_update().clone();
                state.set_league(pool.as_ref());
            }
        }
    };
    prober.abort();
    if let Some(reader) = league_reader {
        reader.abort();
    }
    result
}

/// Reads the run's league pool every 2 s (a missing Redis or pool: nothing
/// to show).
async fn league_loop(
    redis_url: String,
    run_id: String,
    tx: tokio::sync::watch::Sender<Option<relay_league::Pool>>,
) {
    let (_never, shutdown) = relay_kit::Shutdown::new();
    let Ok(redis) = relay_kit::connect_redis(&redis_url, &shutdown).await else {
        return;
    };
    let store = relay_kit::league::LeagueStore::new(redis, &run_id);
    loop {
        if let Ok(pool) = store.load().await {
            if tx.send(pool).is_err() {
                return;
            }
        }
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
}

/// Probes the stack record once a second, off the async thread.
async fn probe_loop(
    state_dir: PathBuf,
    run_id: String,
    tx: tokio::sync::watch::Sender<Option<Vec<ProcessHealth>>>,
) {
    loop {
        let (dir, run) = (state_dir.clone(), run_id.clone());
        let health = tokio::task::spawn_blocking(move || probe_state_dir(&dir, &run))
            .await
            .ok()
            .flatten();
        if tx.send(health).is_err() {
            return;
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

fn fmt_opt(value: Option<f64>, precision: usize) -> String {
    match value {
        Some(v) if v.is_finite() => format!("{v:.precision$}"),
        Some(v) => v.to_string(),
        None => "-".to_string(),
    }
}

fn fmt_duration(d: Duration) -> String {
    let s = d.as_secs();
    match (s / 3600, s / 60 % 60, s % 60) {
        (0, 0, s) => format!("{s}s"),
        (0, m, s) => format!("{m}m{s:02}s"),
        (h, m, s) => format!("{h}h{m:02}m{s:02}s"),
    }
}

fn status_name(status: RunStatus) -> &'static str {
    match status {
        RunStatus::Running => "running",
        RunStatus::Solved => "solved",
        RunStatus::Stopped => "stopped",
        RunStatus::Failed => "failed",
    }
}

fn panel(title: &str) -> Block<'static> {
    Block::bordered().title(Span::styled(
        format!(" {title} "),
        Style::default().add_modifier(Modifier::BOLD),
    ))
}

/// Renders the whole screen from `state`; no I/O.
pub fn draw(frame: &mut Frame, state: &TopState) {
    let [header, progress, middle, bottom, footer] = Layout::vertical([
        Constraint::Length(3),
        Constraint::Length(3),
        Constraint::Length(17),
        Constraint::Min(5),
        Constraint::Length(1),
    ])
    .areas(frame.area());
    draw_header(frame, header, state);
    draw_progress(frame, progress, state);
    let [training, eval] =
        Layout::horizontal([Constraint::Percentage(50), Constraint::Percentage(50)]).areas(middle);
    draw_training(frame, training, state);
    draw_eval(frame, eval, state);
    if state.league.is_empty() {
        let [services, alerts] =
            Layout::horizontal([Constraint::Percentage(55), Constraint::Percentage(45)])
                .areas(bottom);
        draw_services(frame, services, state);
        draw_alerts(frame, alerts, state);
    } else {
        let [services, alerts, league] = Layout::horizontal([
            Constraint::Percentage(45),
            Constraint::Percentage(25),
            Constraint::Percentage(30),
        ])
        .areas(bottom);
        draw_services(frame, services, state);
        draw_alerts(frame, alerts, state);
        draw_league(frame, league, state);
    }
    let source = if state.health.is_some() {
        "health: /healthz of the stack record"
    } else {
        "health: metric reports (no stack record of this run)"
    };
    frame.render_widget(
        Paragraph::new(format!(
            " q / Esc / Ctrl-C quit · refreshed each second · {source}"
        ))
        .style(Style::default().fg(Color::DarkGray)),
        footer,
    );
}

fn draw_header(frame: &mut Frame, area: Rect, state: &TopState) {
    let status = match (&state.status, state.last_message) {
        (Some(s), _) => {
            let mut text = format!("{} ({})", status_name(s.status), s.service);
            if !s.detail.is_empty() {
                text.push_str(": ");
                text.push_str(&s.detail);
            }
            text
        }
        (None, Some(_)) => "running".to_string(),
        (None, None) => "waiting for messages".to_string(),
    };
    let status_color = match state.status.as_ref().map(|s| s.status) {
        Some(RunStatus::Solved) => Color::Green,
        Some(RunStatus::Failed) => Color::Red,
        Some(RunStatus::Stopped) => Color::Yellow,
        _ => Color::Reset,
    };
    let mut spans = vec![
        Span::raw("run "),
        Span::styled(
            state.run_id.clone(),
            Style::default().add_modifier(Modifier::BOLD),
        ),
        Span::raw("   status "),
        Span::styled(status, Style::default().fg(status_color)),
    ];
    if let Some(t) = state.last_message {
        let age = state.now.saturating_duration_since(t).as_secs_f64();
        spans.push(Span::raw(format!("   last message {age:.1}s ago")));
    }
    if let Some((url, connected)) = &state.nats {
        let (text, color) = if *connected {
            ("connected", Color::Reset)
        } else {
            ("disconnected", Color::Red)
        };
        spans.push(Span::raw(format!("   nats {url} ")));
        spans.push(Span::styled(text, Style::default().fg(color)));
    }
    frame.render_widget(
        Paragraph::new(Line::from(spans)).block(panel("relay top")),
        area,
    );
}

fn draw_progress(frame: &mut Frame, area: Rect, state: &TopState) {
    let sps = state.sps().map_or("-".to_string(), |s| format!("{s:.0}"));
    let eta = state.eta().map_or("-".to_string(), fmt_duration);
    let (ratio, label) = match (state.env_steps(), state.budget()) {
        (Some(steps), Some(budget)) if budget > 0 => {
            let ratio = (steps as f64 / budget as f64).clamp(0.0, 1.0);
            (
                ratio,
                format!(
                    "{steps} / {budget} env steps ({:.1}%)   SPS {sps}   ETA {eta}",
                    ratio * 100.0
                ),
            )
        }
        (Some(steps), _) => (0.0, format!("{steps} env steps   SPS {sps}")),
        (None, _) => (0.0, "waiting for the learner's first update".to_string()),
    };
    frame.render_widget(
        Gauge::default()
            .block(panel("progress"))
            .gauge_style(Style::default().fg(Color::Cyan).bg(Color::Black))
            .ratio(ratio)
            .label(label),
        area,
    );
}

fn draw_training(frame: &mut Frame, area: Rect, state: &TopState) {
    let g = |name: &str, precision: usize| fmt_opt(state.gauge(name), precision);
    let runner_sps = state.across("env-runner", "env_runner_sps", UP_WITHIN);
    let returns = state.across("env-runner", "env_runner_episode_return_mean", COPY_WINDOW);
    let mean = |v: &[f64]| (!v.is_empty()).then(|| v.iter().sum::<f64>() / v.len() as f64);
    let rows: [(&str, String); 15] = [
        ("updates", g("learner_updates", 0)),
        ("policy version", g("learner_policy_version", 0)),
        ("policy loss", g("learner_policy_loss", 4)),
        ("value loss", g("learner_value_loss", 4)),
        ("entropy", g("learner_entropy", 4)),
        ("approx kl", g("learner_approx_kl", 5)),
        ("clip fraction", g("learner_clip_fraction", 3)),
        ("explained variance", g("learner_explained_variance", 3)),
        (
            "learning rate",
            state
                .gauge("learner_learning_rate")
                .map_or("-".to_string(), |v| format!("{v:.2e}")),
        ),
        ("replay size (steps)", g("replay_size_steps", 0)),
        ("policy lag (max)", g("learner_policy_lag_max", 0)),
        ("train return (mean)", fmt_opt(mean(&returns), 1)),
        (
            "env-runner sps",
            fmt_opt((!runner_sps.is_empty()).then(|| runner_sps.iter().sum()), 0),
        ),
        ("inference weights", g("inference_weights_version", 0)),
        ("learner update (s)", g("learner_last_update_seconds", 3)),
    ];
    let lines: Vec<Line> = rows
        .into_iter()
        .map(|(name, value)| {
            Line::from(vec![
                Span::styled(format!("{name:<22}"), Style::default().fg(Color::DarkGray)),
                Span::raw(value),
            ])
        })
        .collect();
    frame.render_widget(Paragraph::new(lines).block(panel("learner")), area);
}

fn draw_eval(frame: &mut Frame, area: Rect, state: &TopState) {
    let block = panel("eval return");
    let inner = block.inner(area);
    frame.render_widget(block, area);
    let [text, chart] = Layout::vertical([Constraint::Length(5), Constraint::Min(1)]).areas(inner);
    let mut lines = match state.last_eval() {
        Some(e) => {
            let (word, color) = if e.solved {
                ("solved", Color::Green)
            } else {
                ("not solved", Color::Reset)
            };
            vec![
                Line::from(vec![
                    Span::raw("latest mean "),
                    Span::styled(
                        format!("{:.1}", e.mean_return),
                        Style::default().add_modifier(Modifier::BOLD),
                    ),
                    Span::raw(format!(
                        " ± {:.1}  at v{} ({} env steps)",
                        e.std_return, e.policy_version, e.learner_env_steps
                    )),
                ]),
                Line::from(vec![
                    Span::raw(format!("threshold {:.1}   ", e.threshold)),
                    Span::styled(word, Style::default().fg(color)),
                ]),
                Line::from(format!(
                    "best {}   evals {}",
                    fmt_opt(state.best_eval, 1),
                    state.evals.len()
                )),
            ]
        }
        None => vec![Line::from("no evaluation yet")],
    };
    let active: Vec<String> = state
        .active_evaluators()
        .map(|(instance, e)| format!("{} {} v{}", e.evaluator, instance, e.policy_version))
        .collect();
    if !active.is_empty() {
        lines.push(Line::from(format!("evaluators: {}", active.join(" · "))));
    }
    frame.render_widget(Paragraph::new(lines).wrap(Wrap { trim: true }), text);
    // Bars from the lowest to the highest of the history and the threshold,
    // so the threshold is the top of the chart until a run passes it.
    let threshold = state
        .last_eval()
        .map(|e| e.threshold)
        .filter(|t| t.is_finite());
    let values: Vec<f64> = state.eval_history().collect();
    if values.is_empty() {
        return;
    }
    let lo = values
        .iter()
        .chain(&threshold)
        .copied()
        .fold(f64::INFINITY, f64::min);
    let hi = values
        .iter()
        .chain(&threshold)
        .copied()
        .fold(f64::NEG_INFINITY, f64::max);
    let span = (hi - lo).max(1e-9);
    let width = usize::from(chart.width);
    let bars: Vec<u64> = values[values.len().saturating_sub(width)..]
        .iter()
        .map(|v| 1 + ((v - lo) / span * 100.0).round() as u64)
        .collect();
    frame.render_widget(
        Sparkline::default()
            .data(bars)
            .max(101)
            .style(Style::default().fg(Color::Green)),
        chart,
    );
}

fn draw_services(frame: &mut Frame, area: Rect, state: &TopState) {
    let rows: Vec<Row> = state
        .services()
        .into_iter()
        .map(|row| {
            let problems: Vec<String> = row
                .copies
                .iter()
                .filter_map(|(name, s)| match s {
                    CopyState::Up => None,
                    CopyState::Unhealthy(code) => Some(format!("{name} http {code}")),
                    CopyState::Down => Some(format!("{name} down")),
                    CopyState::Silent(age) => Some(format!("{name} silent {}s", age.as_secs())),
                })
                .collect();
            let up = row.up();
            let (health, color) = if problems.is_empty() {
                ("ok".to_string(), Color::Green)
            } else if up == 0 {
                (problems.join(", "), Color::Red)
            } else {
                (problems.join(", "), Color::Yellow)
            };
            Row::new(vec![
                Cell::from(row.service.clone()),
                Cell::from(row.copies.len().to_string()),
                Cell::from(up.to_string()),
                Cell::from(health).style(Style::default().fg(color)),
            ])
        })
        .collect();
    let empty = rows.is_empty();
    let table = Table::new(
        rows,
        [
            Constraint::Length(18),
            Constraint::Length(6),
            Constraint::Length(4),
            Constraint::Fill(1),
        ],
    )
    .header(
        Row::new(vec!["service", "copies", "up", "health"])
            .style(Style::default().add_modifier(Modifier::BOLD)),
    )
    .block(panel("services"));
    frame.render_widget(table, area);
    if empty {
        let inner = panel("services").inner(area);
        if inner.height > 1 {
            let below = Rect {
                y: inner.y + 1,
                height: 1,
                ..inner
            };
            frame.render_widget(Paragraph::new("no service seen yet"), below);
        }
    }
}

fn draw_league(frame: &mut Frame, area: Rect, state: &TopState) {
    let mut lines = vec![Line::styled(
        format!("{:<12} {:>7} {:>6} {:>6}", "player", "mu", "sigma", "games"),
        Style::default().add_modifier(Modifier::BOLD),
    )];
    lines.extend(state.league.iter().map(|row| {
        Line::raw(format!(
            "{:<12} {:>7.2} {:>6.2} {:>6}",
            row.player, row.mu, row.sigma, row.games
        ))
    }));
    let title = format!("league ({} members, TrueSkill)", state.league.len());
    frame.render_widget(Paragraph::new(lines).block(panel(&title)), area);
}

fn draw_alerts(frame: &mut Frame, area: Rect, state: &TopState) {
    let lines: Vec<Line> = state
        .active_alerts()
        .map(|a| {
            Line::from(vec![
                Span::styled(
                    a.alert.clone(),
                    Style::default().fg(Color::Red).add_modifier(Modifier::BOLD),
                ),
                Span::raw(format!(" {}={:.4}: {}", a.metric, a.value, a.message)),
            ])
        })
        .collect();
    let title = format!("alerts ({} active)", lines.len());
    let body = if lines.is_empty() {
        Paragraph::new("none")
    } else {
        Paragraph::new(lines).wrap(Wrap { trim: true })
    };
    frame.render_widget(body.block(panel(&title)), area);
}
