//! `relay up` while the run trains: the supervisor follows the run over
//! NATS ([`watch`]), prints a progress line each second, answers `relay
//! scale`, notices a service that exits or a run that stalls, and decides
//! when the run is over.

use std::collections::{BTreeMap, VecDeque};
use std::ops::ControlFlow::{self, Break, Continue};
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::Result;
use async_nats::Subscriber;
use futures::StreamExt;
use relay_proto::{EvalReport, MetricsReport, RunStatus, RunStatusUpdate, Subjects};
use tokio::signal::unix::{signal, SignalKind};

use super::{run_end, FirstPass, Outcome, StopFlag, UpArgs};
use crate::stack::{self, last_error_line, Stack};
use crate::{scale, summary};

/// Env steps arrive an update at a time (1,024 every few seconds on
/// Atari): the rate is taken over the last `SPS_WINDOW`, not one tick.
const SPS_WINDOW: Duration = Duration::from_secs(20);

/// Follows the run over NATS, printing a progress line each second, until
/// Ctrl-C, or (with `--until-solved`) the run is solved or the learner stops.
/// When training ends with the stack left up, prints the run's summary
/// once (after the last evaluation and the tracker's plots, or a few
/// seconds) and no more progress lines.
pub(super) async fn watch(
    stack: &mut Stack,
    run_id: &str,
    threshold: Option<f64>,
    run_dir: &Path,
    args: &UpArgs,
) -> Result<Outcome> {
    let client = async_nats::connect(&stack.nats_url).await?;
    let mut feeds = Feeds::subscribe(&client, run_id).await?;
    let mut run = Watch::new(run_id, threshold, run_dir, args);
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    // Installed once: a `ctrl_c()` future made anew each turn of the loop
    // misses a SIGINT that arrives while the loop handles something else.
    let mut interrupt = signal(SignalKind::interrupt())?;
    let mut terminate = signal(SignalKind::terminate())?;
    loop {
        let next = tokio::select! {
            _ = interrupt.recv() => {
                println!("\nrelay: Ctrl-C; stopping the stack");
                run.stopped_by = "stopped by Ctrl-C";
                Break(())
            }
            _ = terminate.recv() => {
                println!("\nrelay: SIGTERM; stopping the stack");
                run.stopped_by = "stopped by SIGTERM";
                Break(())
            }
            Some(m) = feeds.metrics.next() => run.on_metrics(&m.payload),
            Some(m) = feeds.episodes.next() => run.on_episodes(&m.payload),
            Some(m) = feeds.evals.next() => run.on_eval(&m.payload),
            Some(m) = feeds.scales.next() => answer_scale(stack, &client, m, args.quiet).await,
            Some(m) = feeds.statuses.next() => run.on_status(&m.payload),
            _ = tick.tick() => run.on_tick(stack)?,
        };
        if next.is_break() {
            break;
        }
    }
    Ok(run.finish())
}

/// The run's subjects the supervisor listens to.
struct Feeds {
    metrics: Subscriber,
    evals: Subscriber,
    statuses: Subscriber,
    /// Training return from the episodes themselves: an env-runner's
    /// once-a-second metrics miss a run shorter than that.
    episodes: Subscriber,
    /// `relay scale` requests (see scale.rs).
    scales: Subscriber,
}

impl Feeds {
    async fn subscribe(client: &async_nats::Client, run_id: &str) -> Result<Self> {
        let subjects = Subjects::new(run_id);
        Ok(Self {
            metrics: client.subscribe(subjects.metrics()).await?,
            evals: client.subscribe(subjects.eval()).await?,
            statuses: client.subscribe(subjects.status()).await?,
            episodes: client.subscribe(subjects.episodes()).await?,
            scales: client.subscribe(subjects.supervisor_scale()).await?,
        })
    }
}

/// What the supervisor knows of the run while it watches: each message
/// updates it, each tick reads it. Every `on_*` says whether to stop
/// watching.
struct Watch<'a> {
    args: &'a UpArgs,
    threshold: Option<f64>,
    run_dir: &'a Path,
    /// When every service was ready: the run's clock starts here.
    ready: Instant,
    outcome: Outcome,
    /// How the learner said it finished, and when it did.
    learner_end: Option<String>,
    learner_done: Option<Instant>,
    /// How the run ended when the supervisor ended it.
    stopped_by: &'static str,
    last_eval: Option<EvalReport>,
    updates: f64,
    version: f64,
    /// The returns of the last 100 training episodes, and their mean.
    recent_returns: VecDeque<f64>,
    episode_return: f64,
    /// The learner's env steps at each tick of the last `SPS_WINDOW`.
    recent_steps: VecDeque<(Instant, u64)>,
    /// The stall watchdog: when an env step or an update last happened,
    /// and what each service instance last reported.
    last_progress: Instant,
    last_reports: BTreeMap<String, (Instant, String)>,
}

impl<'a> Watch<'a> {
    fn new(run_id: &str, threshold: Option<f64>, run_dir: &'a Path, args: &'a UpArgs) -> Self {
        Self {
            args,
            threshold,
            run_dir,
            ready: Instant::now(),
            outcome: Outcome {
                run_id: run_id.to_string(),
                solved: false,
                startup_s: 0.0,
                wall_s: 0.0,
                env_steps: 0,
                trained_env_steps: 0,
                trained_s: 0.0,
                eval_return: None,
                confirmed_return: None,
                first_pass: None,
                how: String::new(),
                best: None,
                summarized: false,
                failure: None,
            },
            learner_end: None,
            learner_done: None,
            stopped_by: "stopped",
            last_eval: None,
            updates: 0.0,
            version: 0.0,
            recent_returns: VecDeque::with_capacity(100),
            episode_return: f64::NAN,
            recent_steps: [(Instant::now(), 0)].into(),
            last_progress: Instant::now(),
            last_reports: BTreeMap::new(),
        }
    }

    /// A metrics report: the learner's env steps, updates and version, and
    /// progress for the stall watchdog.
    fn on_metrics(&mut self, payload: &[u8]) -> ControlFlow<()> {
        let Ok(report) = relay_proto::decode::<MetricsReport>(payload) else {
            return Continue(());
        };
        let outcome = &mut self.outcome;
        let before = (outcome.trained_env_steps, self.updates);
        self.last_reports.insert(
            report.instance.clone(),
            (Instant::now(), report_summary(&report)),
        );
        if report
            .values
            .iter()
            .any(|v| v.name == "env_steps_total" && v.value > 0.0)
        {
            self.last_progress = Instant::now();
        }
        for v in &report.values {
            match v.name.as_str() {
                "learner_env_steps" => {
                    outcome.trained_env_steps = v.value as u64;
                    // Frozen at the solving evaluation once solved.
                    if !outcome.solved {
                        outcome.env_steps = outcome.trained_env_steps;
                    }
                }
                "learner_updates" => self.updates = v.value,
                "learner_policy_version" => self.version = v.value,
                _ => {}
            }
        }
        if (outcome.trained_env_steps, self.updates) != before {
            self.last_progress = Instant::now();
        }
        Continue(())
    }

    /// Finished training episodes: the mean return of the last 100.
    fn on_episodes(&mut self, payload: &[u8]) -> ControlFlow<()> {
        let Ok(report) = relay_proto::decode::<relay_proto::EpisodeReport>(payload) else {
            return Continue(());
        };
        for e in report
            .episodes
            .iter()
            .filter(|e| e.episode_return.is_finite())
        {
            if self.recent_returns.len() == 100 {
                self.recent_returns.pop_front();
            }
            self.recent_returns.push_back(e.episode_return);
        }
        if !self.recent_returns.is_empty() {
            self.episode_return =
                self.recent_returns.iter().sum::<f64>() / self.recent_returns.len() as f64;
        }
        Continue(())
    }

    /// An evaluation: the first pass, a confirmation said, the best one,
    /// the solve. With `--until-solved`, the solve stops the stack once the
    /// learner has stopped too (it stops on the same news and saves its
    /// checkpoints).
    fn on_eval(&mut self, payload: &[u8]) -> ControlFlow<()> {
        let Ok(report) = relay_proto::decode::<EvalReport>(payload) else {
            return Continue(());
        };
        let outcome = &mut self.outcome;
        if report.mean_return >= report.threshold && outcome.first_pass.is_none() {
            outcome.first_pass = Some(FirstPass {
                wall_s: self.ready.elapsed().as_secs_f64(),
                env_steps: report.learner_env_steps,
            });
        }
        if let Some(c) = report.confirmation.as_ref().filter(|_| !outcome.solved) {
            println!("relay: {} version {}: eval mean {} over {} screening episodes, {} ± {} over {} fresh episodes (seed {}), threshold {}",
                if c.passed { "solved by" } else { "not confirmed:" },
                report.policy_version, summary::figure(report.mean_return), report.returns.len(),
                summary::figure(c.mean_return), summary::figure(c.std_return), c.episodes, c.seed, report.threshold);
        }
        outcome.best = summary::BestEval::update(outcome.best, &report);
        if report.solved && !outcome.solved {
            outcome.solved = true;
            outcome.wall_s = self.ready.elapsed().as_secs_f64();
            outcome.env_steps = report.learner_env_steps;
            outcome.eval_return = Some(report.mean_return);
            outcome.confirmed_return = report.confirmation.as_ref().map(|c| c.mean_return);
            println!(
                "relay: solved at version {} ({} env steps, {:.1}s)",
                report.policy_version, report.learner_env_steps, outcome.wall_s
            );
            if self.args.until_solved {
                self.stopped_by = "solved (--until-solved stopped the stack)";
                if self.learner_done.is_some() {
                    return Break(());
                }
            }
        }
        self.last_eval = Some(report);
        Continue(())
    }

    /// A service's status: a failure ends the run; the learner's end is
    /// noted (and with `--until-solved` ends a solved run).
    fn on_status(&mut self, payload: &[u8]) -> ControlFlow<()> {
        let Ok(status) = relay_proto::decode::<RunStatusUpdate>(payload) else {
            return Continue(());
        };
        if status.status == RunStatus::Failed {
            println!("relay: {} failed: {}", status.service, status.detail);
            self.outcome.failure = Some(format!("{} failed: {}", status.service, status.detail));
            return Break(());
        }
        if status.service == "learner"
            && matches!(status.status, RunStatus::Stopped | RunStatus::Solved)
        {
            self.learner_done.get_or_insert_with(Instant::now);
            println!(
                "relay: learner finished: {:?} ({})",
                status.status, status.detail
            );
            self.learner_end.get_or_insert(match status.status {
                RunStatus::Solved => format!("solved ({})", status.detail),
                _ => format!("stopped: {}", status.detail),
            });
            if self.args.until_solved && self.outcome.solved {
                return Break(());
            }
        }
        Continue(())
    }

    /// Each second: the progress line, then whatever ends the run (a
    /// service that exited, a stall, `--for-seconds`, a stop asked for,
    /// with `--until-solved` the end of training), else the summary once
    /// training is over and the stack stays up.
    fn on_tick(&mut self, stack: &mut Stack) -> Result<ControlFlow<()>> {
        let sps = self.steps_per_second();
        if !self.args.quiet && !self.outcome.summarized {
            self.print_progress(sps);
        }
        if let Some(failure) = self.service_exits(stack)? {
            self.outcome.failure = Some(failure);
            return Ok(Break(()));
        }
        if let Some(failure) = self.stall(stack) {
            println!("relay: {failure}");
            self.outcome.failure = Some(failure);
            return Ok(Break(()));
        }
        let args = self.args;
        if args
            .for_seconds
            .is_some_and(|limit| self.ready.elapsed() >= Duration::from_secs(limit))
        {
            self.stopped_by = "stopped (--for-seconds)";
            return Ok(Break(()));
        }
        if args.stop.as_ref().is_some_and(StopFlag::is_set) {
            return Ok(Break(()));
        }
        let wait = Duration::from_secs(args.final_eval_wait);
        let training_over = self.training_over(wait);
        // Solved, and the learner did not stop within the wait
        // (`run.stop_when_solved: false`).
        let solved_long_ago = self.outcome.solved
            && self.ready.elapsed().as_secs_f64() > self.outcome.wall_s + wait.as_secs_f64();
        if args.until_solved && (training_over || solved_long_ago) {
            return Ok(Break(()));
        }
        // The stack stays up: the summary once the tracker has drawn the
        // plots of the finished run (or a few seconds on).
        if training_over
            && !self.outcome.summarized
            && (self.plots_drawn()
                || self
                    .learner_done
                    .is_some_and(|t| t.elapsed() > wait + Duration::from_secs(5)))
        {
            self.summarize(stack);
        }
        Ok(Continue(()))
    }

    /// The learner's env steps a second over the last `SPS_WINDOW`.
    fn steps_per_second(&mut self) -> f64 {
        let now = Instant::now();
        let steps = self.outcome.trained_env_steps;
        self.recent_steps.push_back((now, steps));
        while self.recent_steps.len() > 2 && now - self.recent_steps[1].0 >= SPS_WINDOW {
            self.recent_steps.pop_front();
        }
        let (since, steps_then) = self.recent_steps[0];
        steps.saturating_sub(steps_then) as f64 / (now - since).as_secs_f64().max(1e-3)
    }

    /// The progress line.
    fn print_progress(&self, sps: f64) {
        let eval = self.last_eval.as_ref().map_or("-".to_string(), |e| {
            format!(
                "{}@v{}{}",
                summary::figure(e.mean_return),
                e.policy_version,
                e.confirmation.as_ref().map_or(String::new(), |c| format!(
                    " (confirmed {})",
                    summary::figure(c.mean_return)
                ))
            )
        });
        // "-": no episode has finished yet.
        let train_return = if self.episode_return.is_finite() {
            format!("{:.1}", self.episode_return)
        } else {
            "-".into()
        };
        println!(
            "[{:>6.1}s] env_steps {:>8}  sps {:>7.0}  updates {:>5}  version {:>5}  train_return {:>7}  eval {}{}",
            self.ready.elapsed().as_secs_f64(), self.outcome.trained_env_steps, sps, self.updates, self.version, train_return, eval,
            self.threshold.map_or(String::new(), |t| format!(" / {t}")),
        );
    }

    /// The failure of a service that exited on its own: it cannot do its
    /// part of the run, except a learner replica whose peers go on
    /// without it (taken out of the stack).
    fn service_exits(&self, stack: &mut Stack) -> Result<Option<String>> {
        for (name, status) in stack.exited() {
            let log = stack.state_dir.join("logs").join(format!("{name}.log"));
            let why = last_error_line(&log).unwrap_or_else(|| format!("see {}", log.display()));
            let learners = stack.copies_of("learner").len();
            if stack::service_of(&name) == "learner" && learners > 1 {
                println!(
                    "relay: learner replica {name} exited with {status}: {why}; {} learner replicas go on",
                    learners - 1
                );
                stack.kill_service(&name)?;
                continue;
            }
            println!("relay: {name} exited with {status}: {why}");
            return Ok(Some(format!("{name} exited with {status}: {why}")));
        }
        Ok(None)
    }

    /// The stall report, once no env step and no update happened for
    /// `--stall-timeout` while the learner trains.
    fn stall(&self, stack: &Stack) -> Option<String> {
        let stalled = self.last_progress.elapsed();
        let timeout = self.args.stall_timeout;
        if timeout == 0 || self.learner_done.is_some() || stalled < Duration::from_secs(timeout) {
            return None;
        }
        let instances: Vec<String> = stack.services.iter().map(|p| p.name.clone()).collect();
        Some(stall_report(stalled, &self.last_reports, &instances))
    }

    /// The learner has stopped training and the evaluation of its last
    /// version arrived, or `wait` passed without it. By env steps: a text
    /// evaluation reports the version its games were served with, which
    /// can trail the one it was started for.
    fn training_over(&self, wait: Duration) -> bool {
        let final_evaluated = self
            .last_eval
            .as_ref()
            .is_some_and(|e| e.learner_env_steps >= self.outcome.trained_env_steps);
        self.learner_done
            .is_some_and(|t| final_evaluated || t.elapsed() > wait)
    }

    /// Whether the tracker has drawn the return plot since the learner
    /// finished (by the clock files are dated with).
    fn plots_drawn(&self) -> bool {
        let drawn = std::fs::metadata(self.run_dir.join("plots").join("return.png"))
            .and_then(|m| m.modified());
        let done = self
            .learner_done
            .and_then(|t| std::time::SystemTime::now().checked_sub(t.elapsed()));
        matches!((drawn, done), (Ok(drawn), Some(done)) if drawn >= done)
    }

    /// Prints the run's summary while the stack stays up; no progress
    /// lines after it.
    fn summarize(&mut self, stack: &Stack) {
        let outcome = &mut self.outcome;
        outcome.summarized = true;
        outcome.how = self.learner_end.clone().unwrap_or_default();
        let end = self.learner_done.unwrap_or_else(Instant::now);
        outcome.trained_s = end.duration_since(self.ready).as_secs_f64();
        if !outcome.solved {
            outcome.wall_s = outcome.trained_s;
        }
        println!(
            "{}",
            run_end(stack, outcome, self.run_dir.to_path_buf()).render()
        );
        println!("relay: training is over; the stack stays up for inspection (relay top, Prometheus, Grafana, relay eval switch); Ctrl-C stops it");
    }

    /// The outcome once watching stopped: how the run ended, and its
    /// times until training ended (not until the supervisor stopped
    /// watching).
    fn finish(self) -> Outcome {
        let mut outcome = self.outcome;
        if let Some(failure) = &outcome.failure {
            outcome.how = format!("failed: {failure}");
        }
        if outcome.how.is_empty() {
            outcome.how = self
                .learner_end
                .unwrap_or_else(|| self.stopped_by.to_string());
        }
        let end = self.learner_done.unwrap_or_else(Instant::now);
        outcome.trained_s = end.duration_since(self.ready).as_secs_f64();
        if !outcome.solved {
            outcome.wall_s = outcome.trained_s;
            outcome.eval_return = self.last_eval.map(|e| e.mean_return);
        }
        outcome
    }
}

/// Answers a `relay scale` request (see scale.rs): starts or stops copies
/// and replies with what runs now.
async fn answer_scale(
    stack: &mut Stack,
    client: &async_nats::Client,
    m: async_nats::Message,
    quiet: bool,
) -> ControlFlow<()> {
    let reply = match relay_proto::decode::<relay_proto::ScaleRequest>(&m.payload) {
        Ok(req) => {
            let reply = scale::handle(stack, req).await;
            if !quiet || reply.error.is_some() {
                println!(
                    "relay: scale {}: {} copies{}",
                    reply.service,
                    reply.copies,
                    reply
                        .error
                        .as_ref()
                        .map_or(String::new(), |e| format!(" ({e})"))
                );
            }
            reply
        }
        Err(e) => relay_proto::ScaleReply {
            schema: relay_proto::SCHEMA_VERSION,
            service: String::new(),
            copies: 0,
            instances: Vec::new(),
            started: Vec::new(),
            stopped: Vec::new(),
            error: Some(format!("bad scale request: {e}")),
        },
    };
    if let Some(to) = m.reply {
        let _ = client.publish(to, relay_proto::encode(&reply).into()).await;
    }
    Continue(())
}

/// What a metrics report says of progress, for the stall report: its
/// counters and step, version and update gauges.
fn report_summary(report: &MetricsReport) -> String {
    let shown: Vec<String> = report
        .values
        .iter()
        .filter(|v| {
            v.name.ends_with("_total")
                || ["env_steps", "version", "updates", "sps"]
                    .iter()
                    .any(|k| v.name.ends_with(k))
        })
        .take(6)
        .map(|v| format!("{} {}", v.name, v.value))
        .collect();
    if shown.is_empty() {
        format!("{} values", report.values.len())
    } else {
        shown.join(", ")
    }
}

/// The failure of a run with no env step and no update for `stalled`:
/// what every service instance last reported, and when, and which of the
/// stack's `instances` never did.
fn stall_report(
    stalled: Duration,
    last_reports: &std::collections::BTreeMap<String, (Instant, String)>,
    instances: &[String],
) -> String {
    let mut report = format!(
        "stalled: no env step and no learner update for {:.0} s (--stall-timeout);",
        stalled.as_secs_f64()
    );
    for silent in instances.iter().filter(|i| !last_reports.contains_key(*i)) {
        report.push_str(&format!(" {silent} never reported;"));
    }
    for (instance, (at, summary)) in last_reports {
        report.push_str(&format!(
            " {instance} last reported {:.0} s ago ({summary});",
            at.elapsed().as_secs_f64()
        ));
    }
    report.trim_end_matches(';').to_string()
}
