//! tracker: the run's memory and its Prometheus face.
//!
//! It receives every metric report, episode report, eval result, status
//! change and log batch of a run over NATS, serves the values on its
//! `/metrics` endpoint (`relay_<name>{run_id,service,instance}`), and writes
//! the run directory `runs/<run-id>/`:
//!
//! - `config.yaml`: the resolved experiment config;
//! - `metrics.jsonl`: one JSON object per metric report, with `vec_steps`,
//!   and the tracker's own lines (`service: tracker`) with the training
//!   return of the episodes heard since its last flush;
//! - `metrics.csv`: the same values, one row each ([`csv`]);
//!   when a resumed learner rewinds the step axis, the lines of the
//!   abandoned timeline are purged from both ([`timeline`]);
//! - `plots/*.png`: learning curves, drawn when the learner finishes, after
//!   each later evaluation and at shutdown ([`relay_runs::plots`]);
//! - `episodes.jsonl`, `eval.jsonl`: every finished training episode batch and eval;
//! - `games.jsonl` (text runs): a sample of the training games and the
//!   evaluation games, as text, within a size bound ([`games`]);
//! - `status.json`: the run's status (never down from solved) and the last update;
//! - `logs/<service>.log`: every service's log lines.
//!
//! The learner writes `checkpoints/` into the same directory.
//! Each run is also recorded in `<runs_dir>/runs.json` ([`relay_runs::registry`]), and
//! the league's ratings, when the run has a pool, are exported ([`league`]).

pub mod alerts;
pub mod csv;
pub mod games;
pub mod league;
pub mod timeline;

use std::collections::{BTreeMap, HashMap};
use std::fs::{File, OpenOptions};
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use futures::StreamExt;
use prometheus::{Counter, Gauge, GaugeVec, IntCounter, Opts, Registry};
use relay_kit::{Service, ServiceConfig, ServiceError, Shutdown};
use relay_proto::{
    EpisodeReport, EvalGame, EvalReport, GameRecord, LogBatch, MetricKind, MetricsReport,
    RunStatus, RunStatusUpdate,
};
use serde_json::json;

/// Appending writers for the files of one run directory.
struct RunDir {
    root: PathBuf,
    metrics: BufWriter<File>,
    metrics_csv: csv::MetricsCsv,
    episodes: BufWriter<File>,
    eval: BufWriter<File>,
    games: games::GamesFile,
    logs: HashMap<String, BufWriter<File>>,
    timeline: timeline::Timeline,
}

fn append(path: &Path) -> std::io::Result<BufWriter<File>> {
    Ok(BufWriter::new(
        OpenOptions::new().create(true).append(true).open(path)?,
    ))
}

impl RunDir {
    fn open(
        root: PathBuf,
        config_yaml: &str,
        tracker: &relay_config::TrackerConfig,
    ) -> std::io::Result<Self> {
        std::fs::create_dir_all(root.join("logs"))?;
        let config_path = root.join("config.yaml");
        let tmp = root.join("config.yaml.tmp");
        std::fs::write(&tmp, config_yaml)?;
        std::fs::rename(&tmp, &config_path)?;
        Ok(Self {
            timeline: timeline::Timeline::scan(&root.join("metrics.jsonl"))?,
            metrics: append(&root.join("metrics.jsonl"))?,
            metrics_csv: csv::MetricsCsv::open(&root.join("metrics.csv"))?,
            episodes: append(&root.join("episodes.jsonl"))?,
            eval: append(&root.join("eval.jsonl"))?,
            games: games::GamesFile::new(root.clone(), tracker),
            logs: HashMap::new(),
            root,
        })
    }

    fn log(&mut self, batch: &LogBatch) -> std::io::Result<()> {
        if !self.logs.contains_key(&batch.service) {
            let file = append(
                &self
                    .root
                    .join("logs")
                    .join(format!("{}.log", batch.service)),
            )?;
            self.logs.insert(batch.service.clone(), file);
        }
        let file = self.logs.get_mut(&batch.service).expect("inserted above");
        for line in &batch.lines {
            writeln!(file, "[{}] {line}", batch.instance)?;
        }
        Ok(())
    }

    /// Writes the run's status (which never goes down: a learner's `stopped`
    /// after the evaluator's `solved` leaves the run solved) and, apart, the
    /// update just received.
    fn write_status(
        &self,
        run: &relay_runs::registry::RunRecord,
        update: &RunStatusUpdate,
    ) -> std::io::Result<()> {
        let tmp = self.root.join("status.json.tmp");
        std::fs::write(
            &tmp,
            serde_json::to_vec_pretty(&json!({
                "status": run.status,
                "detail": run.detail,
                "last_update": {
                    "status": update.status,
                    "service": update.service,
                    "policy_version": update.policy_version,
                    "detail": update.detail,
                },
                "time": now(),
            }))?,
        )?;
        std::fs::rename(tmp, self.root.join("status.json"))
    }

    /// Appends a metric report to `metrics.jsonl` and `metrics.csv`, first
    /// purging the abandoned timeline when the report rewinds the step axis.
    fn write_metrics(&mut self, report: &MetricsReport) -> std::io::Result<()> {
        if let Some(above) = self.timeline.on_report(report) {
            self.metrics.flush()?;
            self.metrics_csv.flush()?;
            let (jsonl, csv_path) = (
                self.root.join("metrics.jsonl"),
                self.root.join("metrics.csv"),
            );
            let removed = timeline::purge(&jsonl, &csv_path, above)?;
            self.metrics = append(&jsonl)?;
            self.metrics_csv = csv::MetricsCsv::open(&csv_path)?;
            tracing::info!(
                above,
                removed,
                "learner resumed: purged the abandoned timeline's metric lines"
            );
        }
        let values: serde_json::Map<String, serde_json::Value> = report
            .values
            .iter()
            .map(|v| (v.key(), json!(v.value)))
            .collect();
        let time = now();
        writeln!(
            self.metrics,
            "{}",
            json!({"time": time, "service": report.service, "instance": report.instance, "vec_steps": report.vec_steps, "values": values})
        )?;
        self.metrics_csv.write(&time, report)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.metrics.flush()?;
        self.metrics_csv.flush()?;
        self.episodes.flush()?;
        self.eval.flush()?;
        self.games.flush()?;
        for file in self.logs.values_mut() {
            file.flush()?;
        }
        Ok(())
    }
}

fn now() -> String {
    chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Millis, true)
}

/// Prometheus series built from the reports it receives. The tracker's
/// registry carries `run_id`, `service="tracker"` and `env_id` on every
/// series; reported gauges add `source` (the producing service) and
/// `copy` (its copy), reported counters are summed over copies into run
/// totals.
struct Exported {
    registry: Registry,
    gauges: HashMap<String, GaugeVec>,
    counters: HashMap<String, Counter>,
    /// Reported values with labels (per-game values): gauges keep
    /// `source` and `copy` and add the value's label keys; counters are
    /// summed over copies per label value. The label keys of a name are
    /// those of its first value; a value with other keys is ignored.
    labelled_gauges: HashMap<String, (Vec<String>, GaugeVec)>,
    labelled_counters: HashMap<String, (Vec<String>, prometheus::CounterVec)>,
    episodes: IntCounter,
    episode_return: Gauge,
    /// Parallel games played by one shared policy: each agent's mean
    /// return over the last 100 games.
    agent_return: GaugeVec,
    recent_agent_returns: HashMap<String, std::collections::VecDeque<f64>>,
    eval_return: GaugeVec,
    eval_version: GaugeVec,
    /// Outcome shares of the latest evaluation per game and opponent (text
    /// games), over both seats: label `outcome` is win, draw or loss.
    eval_outcome_rate: GaugeVec,
    eval_legal_move_rate: GaugeVec,
    recent_returns: std::collections::VecDeque<f64>,
}

impl Exported {
    fn new(registry: Registry) -> Self {
        let episodes = IntCounter::new(
            "relay_episodes_total",
            "Training episodes finished in the run.",
        )
        .unwrap();
        let episode_return = Gauge::new(
            "relay_episode_return_mean",
            "Mean return of the last 100 training episodes.",
        )
        .unwrap();
        let agent_return = GaugeVec::new(
            Opts::new(
                "relay_episode_agent_return_mean",
                "Mean return of each agent over the last 100 training games of a parallel game played by one shared policy (relay_episode_return_mean is the team's).",
            ),
            &["agent"],
        )
        .unwrap();
        let eval_return = GaugeVec::new(
            Opts::new(
                "relay_eval_return_mean",
                "Mean return of the latest evaluation.",
            ),
            &["evaluator"],
        )
        .unwrap();
        let eval_version = GaugeVec::new(
            Opts::new(
                "relay_eval_policy_version",
                "Weights version of the latest evaluation.",
            ),
            &["evaluator"],
        )
        .unwrap();
        let eval_outcome_rate = GaugeVec::new(
            Opts::new(
                "relay_eval_outcome_rate",
                "Share of the latest evaluation's games against an opponent won, drawn or lost (text games).",
            ),
            &["evaluator", "game", "opponent", "outcome"],
        )
        .unwrap();
        let eval_legal_move_rate = GaugeVec::new(
            Opts::new(
                "relay_eval_legal_move_rate",
                "Share of the policy's moves the game accepted in the latest evaluation against an opponent (text games).",
            ),
            &["evaluator", "game", "opponent"],
        )
        .unwrap();
        relay_kit::metrics::register(&registry, &episodes);
        relay_kit::metrics::register(&registry, &episode_return);
        relay_kit::metrics::register(&registry, &agent_return);
        relay_kit::metrics::register(&registry, &eval_return);
        relay_kit::metrics::register(&registry, &eval_version);
        relay_kit::metrics::register(&registry, &eval_outcome_rate);
        relay_kit::metrics::register(&registry, &eval_legal_move_rate);
        Self {
            registry,
            gauges: HashMap::new(),
            counters: HashMap::new(),
            labelled_gauges: HashMap::new(),
            labelled_counters: HashMap::new(),
            episodes,
            episode_return,
            agent_return,
            recent_agent_returns: HashMap::new(),
            eval_return,
            eval_version,
            eval_outcome_rate,
            eval_legal_move_rate,
            recent_returns: Default::default(),
        }
    }

    /// Re-exports the reported values the catalogue assigns to the tracker;
    /// the others are exported by their own service and only recorded here.
    fn metrics(&mut self, report: &MetricsReport) {
        let catalogue = relay_kit::metrics::Catalogue::get();
        for v in &report.values {
            let name = format!("relay_{}", v.name);
            let Some(spec) = catalogue.spec(&name) else {
                tracing::warn!(metric = %name, from = %report.service, "reported metric is not in the catalogue; not exported");
                continue;
            };
            if spec.exported_by != "tracker" {
                continue;
            }
            let help = spec.description.clone();
            let labelled_before = self.labelled_gauges.contains_key(&name)
                || self.labelled_counters.contains_key(&name);
            let unlabelled_before =
                self.gauges.contains_key(&name) || self.counters.contains_key(&name);
            if (v.labels.is_empty() && labelled_before)
                || (!v.labels.is_empty() && unlabelled_before)
            {
                tracing::warn!(metric = %name, labels = ?v.labels, from = %report.service, "reported metric came with labels before and now without (or the reverse); ignored");
                continue;
            }
            if !v.labels.is_empty() {
                self.labelled(report, v, name, help);
                continue;
            }
            match v.kind {
                MetricKind::Gauge => {
                    let registry = &self.registry;
                    let gauge = self.gauges.entry(name.clone()).or_insert_with(|| {
                        let g = GaugeVec::new(Opts::new(name.clone(), help), &["source", "copy"])
                            .unwrap();
                        relay_kit::metrics::register(registry, &g);
                        g
                    });
                    if let Ok(g) =
                        gauge.get_metric_with_label_values(&[&report.service, &report.instance])
                    {
                        g.set(v.value);
                    }
                }
                MetricKind::Counter => {
                    if !(v.value.is_finite() && v.value >= 0.0) {
                        tracing::warn!(metric = %name, value = v.value, "counter increment must be finite and >= 0; ignored");
                        continue;
                    }
                    let registry = &self.registry;
                    self.counters
                        .entry(name.clone())
                        .or_insert_with(|| {
                            let c = Counter::new(name.clone(), help).unwrap();
                            relay_kit::metrics::register(registry, &c);
                            c
                        })
                        .inc_by(v.value);
                }
            }
        }
    }

    /// Exports one labelled value (see [`Exported::labelled_gauges`]).
    fn labelled(
        &mut self,
        report: &MetricsReport,
        v: &relay_proto::MetricValue,
        name: String,
        help: String,
    ) {
        let keys: Vec<String> = v.labels.keys().cloned().collect();
        let values: Vec<&str> = v.labels.values().map(String::as_str).collect();
        let registry = &self.registry;
        match v.kind {
            MetricKind::Gauge => {
                let (known, gauge) =
                    self.labelled_gauges.entry(name.clone()).or_insert_with(|| {
                        let names: Vec<&str> = ["source", "copy"]
                            .into_iter()
                            .chain(keys.iter().map(String::as_str))
                            .collect();
                        let g = GaugeVec::new(Opts::new(name.clone(), help), &names).unwrap();
                        relay_kit::metrics::register(registry, &g);
                        (keys.clone(), g)
                    });
                if *known != keys {
                    tracing::warn!(metric = %name, labels = ?keys, expected = ?known, "reported metric has other labels than before; ignored");
                    return;
                }
                let all: Vec<&str> = [report.service.as_str(), report.instance.as_str()]
                    .into_iter()
                    .chain(values)
                    .collect();
                if let Ok(g) = gauge.get_metric_with_label_values(&all) {
                    g.set(v.value);
                }
            }
            MetricKind::Counter => {
                if !(v.value.is_finite() && v.value >= 0.0) {
                    tracing::warn!(metric = %name, value = v.value, "counter increment must be finite and >= 0; ignored");
                    return;
                }
                let (known, counter) =
                    self.labelled_counters
                        .entry(name.clone())
                        .or_insert_with(|| {
                            let names: Vec<&str> = keys.iter().map(String::as_str).collect();
                            let c =
                                prometheus::CounterVec::new(Opts::new(name.clone(), help), &names)
                                    .unwrap();
                            relay_kit::metrics::register(registry, &c);
                            (keys.clone(), c)
                        });
                if *known != keys {
                    tracing::warn!(metric = %name, labels = ?keys, expected = ?known, "reported metric has other labels than before; ignored");
                    return;
                }
                if let Ok(c) = counter.get_metric_with_label_values(&values) {
                    c.inc_by(v.value);
                }
            }
        }
    }

    /// Counts the episodes; returns the updated mean of the last 100 returns.
    fn episodes(&mut self, report: &EpisodeReport) -> Option<f64> {
        self.episodes.inc_by(report.episodes.len() as u64);
        for e in &report.episodes {
            if self.recent_returns.len() == 100 {
                self.recent_returns.pop_front();
            }
            self.recent_returns.push_back(e.episode_return);
            for a in e.agent_returns.iter().flatten() {
                let recent = self
                    .recent_agent_returns
                    .entry(a.agent.clone())
                    .or_default();
                if recent.len() == 100 {
                    recent.pop_front();
                }
                recent.push_back(a.episode_return);
                let mean = recent.iter().sum::<f64>() / recent.len() as f64;
                self.agent_return.with_label_values(&[&a.agent]).set(mean);
            }
        }
        if self.recent_returns.is_empty() {
            return None;
        }
        let mean = self.recent_returns.iter().sum::<f64>() / self.recent_returns.len() as f64;
        self.episode_return.set(mean);
        Some(mean)
    }

    fn eval(&mut self, report: &EvalReport) {
        self.eval_return
            .with_label_values(&[&report.evaluator])
            .set(report.mean_return);
        self.eval_version
            .with_label_values(&[&report.evaluator])
            .set(report.policy_version as f64);
        // Both seats' games of one game against one opponent add up.
        let mut by_opponent: BTreeMap<(&str, &str), [u32; 5]> = BTreeMap::new();
        for m in &report.matchups {
            let sums = by_opponent
                .entry((m.game_or(&report.env_id), &m.opponent))
                .or_default();
            for (sum, n) in
                sums.iter_mut()
                    .zip([m.wins, m.draws, m.losses, m.moves, m.invalid_moves])
            {
                *sum += n;
            }
        }
        for ((game, opponent), [wins, draws, losses, moves, invalid]) in by_opponent {
            let games = wins + draws + losses;
            if games > 0 {
                for (outcome, n) in [("win", wins), ("draw", draws), ("loss", losses)] {
                    self.eval_outcome_rate
                        .with_label_values(&[&report.evaluator, game, opponent, outcome])
                        .set(n as f64 / games as f64);
                }
            }
            if moves > 0 {
                self.eval_legal_move_rate
                    .with_label_values(&[&report.evaluator, game, opponent])
                    .set(1.0 - invalid as f64 / moves as f64);
            }
        }
    }
}

/// Writes the tracker's own metrics line with the training return (the
/// mean of the last 100 episodes heard), when there is a new one.
fn write_train_return(
    dir: &mut RunDir,
    instance: &str,
    mean: Option<f64>,
    write_metrics: bool,
) -> std::io::Result<()> {
    match mean {
        Some(mean) if write_metrics => dir.write_metrics(&MetricsReport {
            schema: relay_proto::SCHEMA_VERSION,
            service: "tracker".into(),
            instance: instance.to_string(),
            vec_steps: None,
            values: vec![relay_kit::gauge("episode_return_mean", mean)],
        }),
        _ => Ok(()),
    }
}

/// Runs the tracker until shutdown.
pub async fn run(config: ServiceConfig, shutdown: Shutdown) -> Result<(), ServiceError> {
    let service = Service::start("tracker", config, shutdown.clone()).await?;
    // From here on the service stops on the caller's signal or its own failure.
    let shutdown = service.shutdown.clone();
    let cfg = service.config.clone();
    let run_id = cfg.run_id()?.to_string();
    let mut dir = RunDir::open(cfg.run.runs_dir.join(&run_id), &cfg.to_yaml(), &cfg.tracker)?;
    let mut run_record = relay_runs::registry::RunRecorder::start(&cfg, &run_id);
    tokio::spawn(league::follow(
        service.config.clone(),
        service.registry.clone(),
        shutdown.clone(),
    ));
    let mut exported = Exported::new(service.registry.clone());
    let mut alerts = alerts::Alerts::open(&dir.root, &service)?;
    let s = &service.subjects;
    let mut metrics = service
        .nats
        .subscribe(s.metrics())
        .await
        .map_err(ServiceError::nats)?;
    let mut episodes = service
        .nats
        .subscribe(s.episodes())
        .await
        .map_err(ServiceError::nats)?;
    let mut evals = service
        .nats
        .subscribe(s.eval())
        .await
        .map_err(ServiceError::nats)?;
    // A plain subscription beside the replay buffers' queue group: the
    // tracker hears every game.
    let mut games = service
        .nats
        .subscribe(s.games())
        .await
        .map_err(ServiceError::nats)?;
    let mut eval_games = service
        .nats
        .subscribe(s.eval_games())
        .await
        .map_err(ServiceError::nats)?;
    let mut statuses = service
        .nats
        .subscribe(s.status())
        .await
        .map_err(ServiceError::nats)?;
    let mut logs = service
        .nats
        .subscribe(s.logs())
        .await
        .map_err(ServiceError::nats)?;
    service.health.set_ready(true);
    tracing::info!(run_dir = %dir.root.display(), "writing run directory");
    let mut flush = tokio::time::interval(std::time::Duration::from_millis(cfg.tracker.flush_ms));
    let write_metrics = cfg.tracker.write_metrics;
    let intake = service.intake.clone();
    // At shutdown the NATS connection is drained: each subscription hands
    // over what it still holds, then ends, and the loop stops once nothing
    // came for 50 ms. So the reports sent just before a stop (a learner's
    // last update, its final status) are written, not dropped.
    let mut draining = false;
    // Once the learner has finished, the plots are drawn at once (and again
    // after each later evaluation), not only at shutdown: a stack left up
    // for inspection shows the finished run's curves.
    let mut training_over = false;
    // The training return of the episodes heard since the last flush, for
    // metrics.jsonl/csv: an env-runner's once-a-second report misses a
    // run shorter than that.
    let mut train_return: Option<f64> = None;
    loop {
        let mut redraw = false;
        let result: std::io::Result<()> = tokio::select! {
            _ = shutdown.wait(), if !draining => {
                service.drain().await;
                draining = true;
                Ok(())
            }
            _ = tokio::time::sleep(std::time::Duration::from_millis(50)), if draining => break,
            Some(m) = metrics.next() => match intake.decode::<MetricsReport>("metrics", &m.payload) {
                Ok(report) => {
                    exported.metrics(&report);
                    alerts.on_report(&report).await;
                    if write_metrics { dir.write_metrics(&report) } else { Ok(()) }
                }
                Err(_) => Ok(()),
            },
            Some(m) = episodes.next() => match intake.decode::<EpisodeReport>("episodes", &m.payload) {
                Ok(report) => {
                    if let Some(mean) = exported.episodes(&report) {
                        alerts.on_value("episode_return_mean", mean).await;
                        train_return = Some(mean);
                    }
                    let rows: Vec<_> = report.episodes.iter().map(episode_row).collect();
                    writeln!(dir.episodes, "{}", json!({"time": now(), "runner": report.runner_id, "env_id": report.env_id, "policy_version": report.policy_version, "episodes": rows}))
                }
                Err(_) => Ok(()),
            },
            Some(m) = evals.next() => match intake.decode::<EvalReport>("eval", &m.payload) {
                Ok(report) => {
                    exported.eval(&report);
                    redraw = training_over;
                    writeln!(dir.eval, "{}", json!({"time": now(), "evaluator": report.evaluator, "instance": report.instance, "policy_version": report.policy_version, "learner_env_steps": report.learner_env_steps, "mean_return": report.mean_return, "std_return": report.std_return, "returns": report.returns, "threshold": report.threshold, "solved": report.solved, "matchups": report.matchups, "confirmation": report.confirmation}))
                }
                Err(_) => Ok(()),
            },
            Some(m) = games.next() => match intake.decode::<GameRecord>("games", &m.payload) {
                Ok(record) => dir.games.train(&record, now()),
                Err(_) => Ok(()),
            },
            Some(m) = eval_games.next() => match intake.decode::<EvalGame>("eval.games", &m.payload) {
                Ok(game) => dir.games.eval(&game, now()),
                Err(_) => Ok(()),
            },
            Some(m) = statuses.next() => match intake.decode::<RunStatusUpdate>("status", &m.payload) {
                Ok(status) => {
                    tracing::info!(status = ?status.status, from = %status.service, detail = %status.detail, "run status");
                    alerts.on_status(&status).await;
                    if status.service == "learner"
                        && matches!(status.status, RunStatus::Stopped | RunStatus::Failed | RunStatus::Solved)
                    {
                        training_over = true;
                        redraw = true;
                    }
                    run_record.status(&status);
                    dir.write_status(run_record.record(), &status)
                }
                Err(_) => Ok(()),
            },
            Some(m) = logs.next() => match intake.decode::<LogBatch>("logs", &m.payload) {
                Ok(batch) => dir.log(&batch),
                Err(_) => Ok(()),
            },
            _ = flush.tick(), if !draining => {
                alerts.tick().await;
                write_train_return(&mut dir, &service.instance, train_return.take(), write_metrics)
                    .and_then(|()| alerts.flush())
                    .and_then(|()| dir.flush())
            }
        };
        if let Err(e) = result {
            tracing::error!(error = %e, "writing the run directory failed");
        }
        if redraw && !draining {
            if let Err(e) = dir.flush() {
                tracing::error!(error = %e, "writing the run directory failed");
            }
            let root = dir.root.clone();
            let _ = tokio::task::spawn_blocking(move || relay_runs::plots::draw_run_logged(&root))
                .await;
        }
    }
    write_train_return(&mut dir, &service.instance, train_return, write_metrics)?;
    alerts.flush().and_then(|()| dir.flush())?;
    run_record.finish();
    let root = dir.root.clone();
    let _ = tokio::task::spawn_blocking(move || relay_runs::plots::draw_run_logged(&root)).await;
    service.health.set_ready(false);
    Ok(())
}

/// One episode as `episodes.jsonl` writes it; self-play episodes add the
/// learning seat and the opponent, a team's game each agent's return.
fn episode_row(e: &relay_proto::EpisodeSummary) -> serde_json::Value {
    let mut row =
        json!({"return": e.episode_return, "length": e.length, "terminated": e.terminated});
    if let Some(seat) = e.seat {
        row["seat"] = json!(seat);
    }
    if let Some(opponent) = &e.opponent {
        row["opponent"] = json!(opponent);
    }
    if let Some(agents) = &e.agent_returns {
        let returns: serde_json::Map<String, serde_json::Value> = agents
            .iter()
            .map(|a| (a.agent.clone(), json!(a.episode_return)))
            .collect();
        row["agent_returns"] = serde_json::Value::Object(returns);
    }
    row
}

#[cfg(test)]
mod tests {
    use super::*;
    use prometheus::Encoder;
    use relay_kit::{counter, gauge};
    use relay_proto::{EpisodeSummary, Matchup, SCHEMA_VERSION};

    fn exposition(registry: &Registry) -> String {
        let mut out = Vec::new();
        prometheus::TextEncoder::new()
            .encode(&registry.gather(), &mut out)
            .unwrap();
        String::from_utf8(out).unwrap()
    }

    fn report(instance: &str, values: Vec<relay_proto::MetricValue>) -> MetricsReport {
        MetricsReport {
            schema: SCHEMA_VERSION,
            service: "env-runner".into(),
            instance: instance.into(),
            vec_steps: None,
            values,
        }
    }

    #[test]
    fn labelled_values_are_exported_per_game_beside_the_unlabelled_ones() {
        let registry = Registry::new();
        let mut exported = Exported::new(registry.clone());
        for instance in ["e1", "e2"] {
            exported.metrics(&report(
                instance,
                vec![
                    counter("games_total", 3.0),
                    counter("text_games_total", 2.0).with_label("game", "TicTacToe-v0"),
                    counter("text_games_total", 1.0).with_label("game", "KuhnPoker-v0"),
                    gauge("env_runner_win_rate", 0.5),
                    gauge("env_runner_game_win_rate", 0.75).with_label("game", "TicTacToe-v0"),
                ],
            ));
        }
        // Other label keys than the first value's are ignored, not a panic.
        exported.metrics(&report("e1", vec![gauge("env_runner_game_win_rate", 0.1)]));
        let text = exposition(&registry);
        for line in [
            "relay_games_total 6",
            "relay_text_games_total{game=\"TicTacToe-v0\"} 4",
            "relay_text_games_total{game=\"KuhnPoker-v0\"} 2",
            "relay_env_runner_win_rate{copy=\"e1\",source=\"env-runner\"} 0.5",
            "relay_env_runner_game_win_rate{copy=\"e2\",game=\"TicTacToe-v0\",source=\"env-runner\"} 0.75",
        ] {
            assert!(text.lines().any(|l| l == line), "{line}:\n{text}");
        }
        assert!(!text.contains("0.1"), "{text}");
    }

    #[test]
    fn each_agents_return_of_a_team_game_is_exported_beside_the_teams() {
        let registry = Registry::new();
        let mut exported = Exported::new(registry.clone());
        let game = |a: f64, b: f64| EpisodeSummary {
            episode_return: a + b,
            length: 25,
            terminated: true,
            agent_returns: Some(vec![
                relay_proto::AgentReturn {
                    agent: "piston_0".into(),
                    episode_return: a,
                },
                relay_proto::AgentReturn {
                    agent: "piston_1".into(),
                    episode_return: b,
                },
            ]),
            ..Default::default()
        };
        let mean = exported.episodes(&EpisodeReport {
            schema: SCHEMA_VERSION,
            runner_id: "e1".into(),
            env_id: "pistonball_v6".into(),
            policy_version: 1,
            episodes: vec![game(1.0, 3.0), game(3.0, 5.0)],
        });
        assert_eq!(mean, Some(6.0));
        let text = exposition(&registry);
        for line in [
            "relay_episode_return_mean 6",
            "relay_episode_agent_return_mean{agent=\"piston_0\"} 2",
            "relay_episode_agent_return_mean{agent=\"piston_1\"} 4",
        ] {
            assert!(text.lines().any(|l| l == line), "{line}:\n{text}");
        }
    }

    #[test]
    fn eval_outcomes_are_split_by_game_and_old_matchups_take_the_reports_env() {
        let registry = Registry::new();
        let mut exported = Exported::new(registry.clone());
        let matchup = |game: &str, seat: u8, wins: u32, losses: u32| Matchup {
            opponent: "random".into(),
            seat,
            game: game.into(),
            games: wins + losses,
            wins,
            draws: 0,
            losses,
            abandoned: 0,
            moves: 4,
            invalid_moves: 1,
        };
        exported.eval(&EvalReport {
            schema: SCHEMA_VERSION,
            evaluator: "vs-opponent".into(),
            instance: "ev".into(),
            env_id: "TicTacToe-v0".into(),
            policy_version: 1,
            learner_env_steps: 0,
            returns: vec![1.0],
            mean_return: 1.0,
            std_return: 0.0,
            threshold: 1.0,
            solved: false,
            matchups: vec![
                // An older evaluator: no game, so the report's env.
                matchup("", 0, 1, 1),
                matchup("TicTacToe-v0", 1, 2, 0),
                matchup("KuhnPoker-v0", 0, 0, 4),
            ],
            confirmation: None,
        });
        let text = exposition(&registry);
        for line in [
            // TicTacToe: 3 wins of 4 over both seats.
            "relay_eval_outcome_rate{evaluator=\"vs-opponent\",game=\"TicTacToe-v0\",opponent=\"random\",outcome=\"win\"} 0.75",
            "relay_eval_outcome_rate{evaluator=\"vs-opponent\",game=\"KuhnPoker-v0\",opponent=\"random\",outcome=\"loss\"} 1",
            "relay_eval_legal_move_rate{evaluator=\"vs-opponent\",game=\"KuhnPoker-v0\",opponent=\"random\"} 0.75",
        ] {
            assert!(text.lines().any(|l| l == line), "{line}:\n{text}");
        }
    }
}
