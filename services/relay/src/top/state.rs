//! What `relay top` knows of a run: [`TopState`], fed by metric reports,
//! evaluations, status updates, alerts and health probes.

use super::*;

/// The last report of one copy of a service.
#[derive(Debug, Clone)]
pub(crate) struct Sighting {
    pub(crate) last: Instant,
    pub(crate) gauges: BTreeMap<String, f64>,
}

/// Everything `relay top` shows, fed by decoded messages; see the module doc.
#[derive(Debug, Clone)]
pub struct TopState {
    pub(crate) run_id: String,
    pub(crate) now: Instant,
    pub(crate) nats: Option<(String, bool)>,
    pub(crate) last_message: Option<Instant>,
    /// Newest value of each gauge, whichever copy sent it.
    pub(crate) latest: BTreeMap<String, f64>,
    /// service -> instance -> last report.
    pub(crate) copies: BTreeMap<String, BTreeMap<String, Sighting>>,
    /// `(arrival, learner_env_steps)` over the last [`SPS_WINDOW`].
    pub(crate) steps: VecDeque<(Instant, u64)>,
    pub(crate) budget: Option<u64>,
    pub(crate) evals: VecDeque<f64>,
    pub(crate) last_eval: Option<EvalReport>,
    /// evaluator instance -> its latest report (the plugin it runs).
    pub(crate) evaluators: BTreeMap<String, (EvalReport, Instant)>,
    pub(crate) best_eval: Option<f64>,
    pub(crate) status: Option<RunStatusUpdate>,
    /// Raised alerts by `(alert, metric)`.
    pub(crate) alerts: BTreeMap<(String, String), AlertEvent>,
    pub(crate) health: Option<Vec<ProcessHealth>>,
    /// The league's leaderboard, best conservative rating first.
    pub(crate) league: Vec<LeagueRow>,
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

    pub(crate) fn prune_steps(&mut self) {
        while self.steps.len() > 1
            && self
                .steps
                .front()
                .is_some_and(|(t, _)| self.now.saturating_duration_since(*t) > SPS_WINDOW)
        {
            self.steps.pop_front();
        }
    }

    pub(crate) fn seen(&mut self, now: Instant) {
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
    pub(crate) fn across(&self, service: &str, name: &str, within: Duration) -> Vec<f64> {
        self.copies
            .get(service)
            .into_iter()
            .flat_map(|instances| instances.values())
            .filter(|s| self.now.saturating_duration_since(s.last) <= within)
            .filter_map(|s| s.gauges.get(name).copied())
            .collect()
    }

    /// The learner replicas that reported within [`COPY_WINDOW`], by rank;
    /// empty for a run with one learner.
    pub fn learner_replicas(&self) -> Vec<ReplicaRow> {
        let mut rows: Vec<ReplicaRow> = self
            .copies
            .get("learner")
            .into_iter()
            .flat_map(|instances| instances.iter())
            .filter(|(_, s)| self.now.saturating_duration_since(s.last) <= COPY_WINDOW)
            .filter(|(_, s)| s.gauges.get("learner_replicas").is_some_and(|n| *n > 1.0))
            .filter_map(|(instance, s)| {
                let g = |name: &str| s.gauges.get(name).copied().filter(|v| v.is_finite());
                Some(ReplicaRow {
                    instance: instance.clone(),
                    rank: g("learner_replica_rank")? as u64,
                    updates: g("learner_replica_updates").map(|u| u as u64),
                    allreduce_seconds: g("learner_allreduce_seconds"),
                    barrier_wait_seconds: g("learner_barrier_wait_seconds"),
                })
            })
            .collect();
        rows.sort_by(|a, b| {
            a.rank
                .cmp(&b.rank)
                .then_with(|| a.instance.cmp(&b.instance))
        });
        rows
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
