//! evaluator: plays episodes with the learner's newest weights on eval seeds
//! distinct from the training seeds, and publishes the result.
//!
//! How it plays is a plugin ([`plugins`]): `eval.evaluator` and
//! `eval.options` choose it at start, and an `EvalControl` message on
//! `relay.<run>.eval.control` (`relay eval use <name> --set k=v`) switches
//! it without a restart; an unknown name or option is logged, counted
//! (`relay_evaluator_control_rejected_total`) and the current plugin stays.
//! Every copy applies the control message (no queue group); copies started
//! with different configs run different plugins side by side.
//!
//! It runs on its own schedule and never blocks training: it waits for a
//! version at least `eval.every_versions` past the last one it evaluated
//! (or, with `eval.every_seconds`, any newer version once that long has
//! passed since its last evaluation), always takes the newest (skipping
//! those it could not keep up with, and counting them in
//! `relay_evaluator_skipped_versions_total`; it hears each version on
//! `weights.announce` and fetches only the weights it plays, a
//! [`PolicyFetcher`]), announces the evaluation
//! ([`EvalStarted`], so the learner keeps that version's weights until the
//! report), plays `eval.episodes` episodes (one per sub-env of a
//! vectorized env, each run to its end: the screening, on the same seeds
//! every time), and publishes an [`EvalReport`].
//!
//! When the screening mean reaches the threshold (the env's reward
//! threshold unless `eval.threshold` says otherwise), the same plugin plays
//! the version again on `eval.confirm_episodes` episodes from
//! [`relay_config::EvalConfig::confirm_seed`], seeds that no other
//! evaluation of the run plays (the plugin's own `episodes` and `seed`
//! options do not apply there): picking the first of many versions that
//! pass one fixed set favours a policy that suits that set. The report
//! carries the confirmation; only when it passes too is the report
//! `solved` and the run announced solved, with both figures.
//!
//! `vs-opponent` in a multi-agent game on observations (PettingZoo's)
//! plays the version against each opponent from every seat and reports
//! the results per opponent and seat (`matchups`, and
//! `relay_evaluator_games`); such a run is judged by its weakest matchup
//! ([`relay_eval::weakest_matchup`]): the screening's lowest matchup mean
//! must reach the threshold, and so must every matchup of the
//! confirmation, less `eval.confirm_z` standard errors. The report's
//! `mean_return` and `std_return` are that matchup's.
//!
//! In runs with a `normalize` section on, each version carries the run's
//! normalisation statistics; the policy is given observations normalised
//! with them, frozen (never updated by evaluation, as SB3 evaluates with
//! `training = False`), and the returns reported are the envs' raw ones.
//!
//! Text games (`run.env_id` one of the text games) need a text plugin
//! (`vs-opponent`). The evaluator then follows the learning adapter's
//! versions (`AdapterUpdate`s on `relay.<run>.adapters`) instead of MLP
//! weights: it evaluates the learner's current version as soon as it is
//! known (published, or answered on `adapters.latest`), then new versions
//! with the same `every_versions` / `every_seconds` schedule. Every learning seat
//! asks the inference servers for the evaluated version (not the newest),
//! and a screening pass is confirmed as above, with `eval.confirm_episodes`
//! games per opponent. Games are played
//! asynchronously over `relay.<run>.generate` by a background task, so
//! control messages are handled meanwhile; versions published during an
//! evaluation are skipped but the newest (and counted). An evaluation whose
//! games were all abandoned (no inference server yet) is tried again after
//! 5 s unless a newer version arrives. The report's `matchups` hold the
//! results per opponent and seat; after the report, each game played
//! (screening and confirmation) is published as an [`EvalGame`] on
//! `relay.<run>.eval.games`, which the tracker writes to the run
//! directory's `games.jsonl` (the tracker is that file's one writer).
//!
//! Asked to stop, it stops within the promise of every service (2 s), in
//! the middle of an evaluation too: the classic plugins play on a blocking
//! thread that the stop cancels between two steps (and in any wait on the
//! Python workers, which die with their envs), and a text evaluation's task
//! is aborted. An evaluation cut short reports nothing; the learner's
//! checkpoints do not depend on it.

use std::collections::VecDeque;
use std::sync::Arc;

use futures::StreamExt;
use prometheus::{Gauge, GaugeVec, IntCounter, Opts};
use relay_kit::{Service, ServiceConfig, ServiceError, Shutdown};
use relay_policy::text::{NatsGenerate, LEARNING_ADAPTER};
use relay_policy::{AdapterFollower, AdapterVersion, PolicyFetcher};
use relay_proto::{
    Confirmation, EpisodeReport, EvalControl, EvalGame, EvalReport, EvalStarted, Matchup,
    RunStatus, RunStatusUpdate, SCHEMA_VERSION,
};

use plugins::{EvalContext, EvalOutcome, Evaluator, OpponentGame, TextEvalContext};
pub use relay_eval::{evaluate, mean_std, plugins};

/// Runs the evaluator until shutdown.
pub async fn run(config: ServiceConfig, shutdown: Shutdown) -> Result<(), ServiceError> {
    let service = Service::start("evaluator", config, shutdown.clone()).await?;
    // From here on the service stops on the caller's signal or its own failure.
    let shutdown = service.shutdown.clone();
    let cfg = service.config.clone();
    if cfg.is_text_game() {
        return run_text(service, shutdown).await;
    }
    let mut follower = PolicyFetcher::start(&service).await?;
    let threshold = cfg.solved_threshold();
    let EvalMetrics {
        skipped,
        last_return,
        control_rejected,
        control_applied,
        active,
    } = EvalMetrics::register(&service.registry);
    let matchup_metrics = MatchupMetrics::register(&service.registry);
    let build = |name: &str, options: &[(String, String)]| -> Result<Box<dyn Evaluator>, String> {
        let plugin = plugins::build(name, options)?;
        plugin.check_env(&cfg.run.env_id, &cfg.env)?;
        Ok(plugin)
    };
    let mut plugin: Arc<dyn Evaluator> = build(&cfg.eval.evaluator, &cfg.eval.option_pairs())
        .map_err(|e| ServiceError::other(format!("eval.evaluator: {e}")))?
        .into();
    let mut controls = service
        .nats
        .subscribe(service.subjects.eval_control())
        .await
        .map_err(ServiceError::nats)?;
    let mut episodes = service
        .nats
        .subscribe(service.subjects.episodes())
        .await
        .map_err(ServiceError::nats)?;
    let mut recent: VecDeque<f64> = VecDeque::with_capacity(100);
    let run_dir = cfg.run.runs_dir.join(cfg.run_id()?);
    let cancel = cancel_on(&shutdown);
    tracing::info!(evaluator = plugin.name(), "evaluator plugin");
    active.with_label_values(&[plugin.name()]).set(1.0);
    service.health.set_ready(true);
    let mut last: Option<u64> = None;
    let mut announced_solved = false;
    let every_seconds = cfg
        .eval
        .every_seconds
        .map(std::time::Duration::from_secs_f64);
    // When set, any version newer than the last evaluated one is due.
    let mut time_due_at = every_seconds.map(|d| tokio::time::Instant::now() + d);
    let mut time_due = false;
    loop {
        let wanted = match last {
            Some(v) if time_due => Some(v),
            Some(v) => Some(v + cfg.eval.every_versions - 1),
            None => None,
        };
        let policy = tokio::select! {
            _ = shutdown.wait() => break,
            _ = tokio::time::sleep_until(time_due_at.unwrap_or_else(tokio::time::Instant::now)), if time_due_at.is_some() && !time_due => {
                time_due = true;
                continue;
            }
            Some(m) = controls.next() => {
                match service.intake.decode::<EvalControl>("eval.control", &m.payload) {
                    Ok(control) => match build(&control.evaluator, &control.options) {
                        Ok(p) => {
                            tracing::info!(from = plugin.name(), to = p.name(), options = ?control.options, "evaluator plugin switched");
                            let _ = active.remove_label_values(&[plugin.name()]);
                            active.with_label_values(&[p.name()]).set(1.0);
                            plugin = p.into();
                            control_applied.inc();
                        }
                        Err(e) => {
                            tracing::warn!(error = %e, current = plugin.name(), "eval control refused");
                            control_rejected.inc();
                        }
                    },
                    Err(_) => control_rejected.inc(),
                }
                continue;
            }
            Some(m) = episodes.next() => {
                if let Ok(report) = service.intake.decode::<EpisodeReport>("episodes", &m.payload) {
                    for e in report.episodes {
                        if recent.len() == 100 {
                            recent.pop_front();
                        }
                        recent.push_back(e.episode_return);
                    }
                }
                continue;
            }
            p = follower.newer_than(wanted) => match p { Some(p) => p, None => break },
        };
        if let Some(previous) = last {
            skipped.inc_by(policy.version.saturating_sub(previous + 1));
        }
        last = Some(policy.version);
        time_due = false;
        time_due_at = every_seconds.map(|d| tokio::time::Instant::now() + d);
        announce_start(&service, plugin.name(), policy.version).await;
        let ctx = EvalContext {
            env_id: cfg.run.env_id.clone(),
            episodes: cfg.eval.episodes,
            seed: cfg.eval.seed,
            run_dir: run_dir.clone(),
            train_return: (!recent.is_empty())
                .then(|| recent.iter().sum::<f64>() / recent.len() as f64),
            confirming: false,
            env: cfg.env.clone(),
            cancel: cancel.clone(),
        };
        let played = play_classic(&plugin, &policy, &ctx).await?;
        if cancel.is_cancelled() {
            // Stopped part-way: there is nothing to report.
            break;
        }
        let played = match played {
            Ok(played) => played,
            Err(reason) => {
                tracing::debug!(evaluator = plugin.name(), version = policy.version, %reason, "evaluation skipped");
                continue;
            }
        };
        let (mean, std, _) = played.figure(0.0);
        let confirmation = match threshold.filter(|t| mean >= *t) {
            Some(t) => {
                let seed = cfg.eval.confirm_seed(policy.version);
                let ctx = EvalContext {
                    episodes: cfg.eval.confirm_episodes,
                    seed,
                    confirming: true,
                    ..ctx
                };
                let confirming = play_classic(&plugin, &policy, &ctx).await?;
                if cancel.is_cancelled() {
                    // A screening without its confirmation is not reported.
                    break;
                }
                match confirming {
                    Ok(confirming) => Some(confirmation(confirming, seed, t, cfg.eval.confirm_z)),
                    Err(reason) => {
                        tracing::warn!(evaluator = plugin.name(), version = policy.version, %reason, "confirmation not played");
                        None
                    }
                }
            }
            None => None,
        };
        let solved = confirmation.as_ref().is_some_and(|c| c.passed);
        last_return.set(mean);
        matchup_metrics.set(&cfg.run.env_id, &played.matchups);
        tracing::info!(
            evaluator = plugin.name(),
            version = policy.version,
            mean_return = mean,
            std_return = std,
            confirmation_mean = confirmation.as_ref().map(|c| c.mean_return),
            solved,
            "evaluated"
        );
        let report = EvalReport {
            schema: SCHEMA_VERSION,
            evaluator: plugin.name().to_string(),
            instance: service.instance.clone(),
            env_id: cfg.run.env_id.clone(),
            policy_version: policy.version,
            learner_env_steps: policy.learner_env_steps,
            returns: played.returns,
            mean_return: mean,
            std_return: std,
            threshold: threshold.unwrap_or(f64::NAN),
            solved,
            matchups: played.matchups,
            confirmation,
        };
        service.publish(service.subjects.eval(), &report).await;
        if solved && !announced_solved {
            announced_solved = true;
            announce_solved(&service, &report).await;
        }
    }
    service.finish().await
}

/// What a classic evaluation played: every episode's return and, for
/// `vs-opponent` in a game on observations, its results per opponent and
/// seat and the matchup of each return.
struct Played {
    returns: Vec<f64>,
    matchups: Vec<Matchup>,
    matchup_of: Vec<usize>,
}

impl Played {
    /// The figure the run is judged by, with its standard deviation and
    /// count: the mean of every return, or with matchups the weakest
    /// matchup's ([`relay_eval::weakest_matchup`], less `z` standard
    /// errors): a game is beaten from every seat against every opponent.
    fn figure(&self, z: f64) -> (f64, f64, usize) {
        match relay_eval::weakest_matchup(&self.returns, &self.matchup_of, z) {
            Some(weakest) => weakest,
            None => {
                let (mean, std) = mean_std(&self.returns);
                (mean, std, self.returns.len())
            }
        }
    }
}

/// A [`plugins::Cancel`] set when `shutdown` fires: it stops the
/// evaluation in progress at its next step.
fn cancel_on(shutdown: &Shutdown) -> plugins::Cancel {
    let cancel = plugins::Cancel::new();
    let set = cancel.clone();
    shutdown.on_trigger(move || set.cancel());
    cancel
}

/// Plays one classic evaluation (or confirmation) on a blocking thread:
/// what it played, or why nothing was (skipped or failed, logged by the
/// caller). Cancelled by `ctx.cancel`, it ends at the next step.
async fn play_classic(
    plugin: &Arc<dyn Evaluator>,
    policy: &Arc<relay_policy::VersionedPolicy>,
    ctx: &EvalContext,
) -> Result<Result<Played, String>, ServiceError> {
    let cancel = ctx.cancel.clone();
    let (evaluator, policy, ctx) = (plugin.clone(), policy.clone(), ctx.clone());
    let outcome = tokio::task::spawn_blocking(move || evaluator.evaluate(&policy, &ctx))
        .await
        .map_err(ServiceError::other)?;
    Ok(match outcome {
        Ok(EvalOutcome::Returns(returns)) if !returns.is_empty() => Ok(Played {
            returns,
            matchups: Vec::new(),
            matchup_of: Vec::new(),
        }),
        Ok(EvalOutcome::Games {
            returns,
            matchups,
            matchup_of,
            ..
        }) if !returns.is_empty() => Ok(Played {
            returns,
            matchups,
            matchup_of,
        }),
        Ok(EvalOutcome::Returns(_) | EvalOutcome::Games { .. }) => Err("no episodes".into()),
        Ok(EvalOutcome::Skipped(reason)) => Err(reason),
        // The evaluator is stopping (the caller looks at the cancel).
        Err(e) if cancel.is_cancelled() => Err(e),
        Err(e) => {
            tracing::error!(error = %e, evaluator = plugin.name(), "evaluation failed");
            Err(e)
        }
    })
}

/// The confirmation of a screening pass, played from `seed` on: it passes
/// when its figure ([`Played::figure`]: the mean, or the weakest
/// matchup's) less `z` standard errors reaches `threshold`
/// (`eval.confirm_z`), and reports that figure.
fn confirmation(played: Played, seed: u64, threshold: f64, z: f64) -> Confirmation {
    let (mean, std, n) = played.figure(z);
    let bound = relay_proto::mean_less_standard_errors(mean, std, n, z);
    Confirmation {
        episodes: played.returns.len() as u32,
        seed,
        returns: played.returns,
        mean_return: mean,
        std_return: std,
        passed: bound >= threshold,
    }
}

/// Tells the learner which version is being evaluated, so it keeps that
/// version's weights until the report arrives.
async fn announce_start(service: &Service, evaluator: &str, version: u64) {
    tracing::info!(evaluator, version, "evaluation started");
    let started = EvalStarted {
        schema: SCHEMA_VERSION,
        evaluator: evaluator.to_string(),
        instance: service.instance.clone(),
        policy_version: version,
    };
    service
        .publish(service.subjects.eval_started(), &started)
        .await;
}

/// Announces the run solved by `report` (screening and confirmation passed).
async fn announce_solved(service: &Service, report: &EvalReport) {
    let confirmation = report.confirmation.as_ref().expect("solved is confirmed");
    let z = service.config.eval.confirm_z;
    let status = RunStatusUpdate {
        schema: SCHEMA_VERSION,
        status: RunStatus::Solved,
        service: "evaluator".into(),
        policy_version: report.policy_version,
        detail: format!(
            "eval mean return {:.3} over {} screening episodes, confirmed {:.3} +/- {:.3} over {} fresh episodes (seed {}; less {} standard errors {:.3}), threshold {:.3}, version {} ({})",
            report.mean_return,
            report.returns.len(),
            confirmation.mean_return,
            confirmation.std_return,
            confirmation.episodes,
            confirmation.seed,
            z,
            relay_proto::mean_less_standard_errors(
                confirmation.mean_return,
                confirmation.std_return,
                confirmation.returns.len(),
                z
            ),
            report.threshold,
            report.policy_version,
            report.evaluator,
        ),
    };
    service.publish(service.subjects.status(), &status).await;
}

/// The metrics every evaluator exports (classic and text).
struct EvalMetrics {
    skipped: IntCounter,
    last_return: Gauge,
    control_rejected: IntCounter,
    control_applied: IntCounter,
    active: GaugeVec,
}

impl EvalMetrics {
    fn register(registry: &prometheus::Registry) -> Self {
        let m = Self {
            skipped: IntCounter::new(
                "relay_evaluator_skipped_versions_total",
                "Versions the evaluator did not evaluate because newer ones arrived.",
            )
            .unwrap(),
            last_return: Gauge::new(
                "relay_evaluator_return_mean",
                "Mean return of the latest evaluation.",
            )
            .unwrap(),
            control_rejected: IntCounter::new(
                "relay_evaluator_control_rejected_total",
                "EvalControl messages refused (unknown evaluator or option).",
            )
            .unwrap(),
            control_applied: IntCounter::new(
                "relay_evaluator_control_applied_total",
                "EvalControl messages applied (evaluator plugin switched).",
            )
            .unwrap(),
            active: GaugeVec::new(
                Opts::new(
                    "relay_evaluator_active",
                    "1 for the evaluator plugin this copy runs now.",
                ),
                &["evaluator"],
            )
            .unwrap(),
        };
        relay_kit::metrics::register(registry, &m.active);
        relay_kit::metrics::register(registry, &m.skipped);
        relay_kit::metrics::register(registry, &m.last_return);
        relay_kit::metrics::register(registry, &m.control_rejected);
        relay_kit::metrics::register(registry, &m.control_applied);
        m
    }
}

/// `vs-opponent` results of the latest evaluation, per opponent and seat.
struct MatchupMetrics {
    games: GaugeVec,
    legal_move_rate: GaugeVec,
}

impl MatchupMetrics {
    fn register(registry: &prometheus::Registry) -> Self {
        let m = Self {
            games: GaugeVec::new(
                Opts::new(
                    "relay_evaluator_games",
                    "Games of the latest vs-opponent evaluation, by game, opponent, the policy's seat and its outcome (win, draw, loss, abandoned).",
                ),
                &["game", "opponent", "seat", "outcome"],
            )
            .unwrap(),
            legal_move_rate: GaugeVec::new(
                Opts::new(
                    "relay_evaluator_legal_move_rate",
                    "Share of the policy's moves the game accepted in the latest vs-opponent evaluation, by game, opponent and seat (1 in games on observations, whose action masks allow only legal moves).",
                ),
                &["game", "opponent", "seat"],
            )
            .unwrap(),
        };
        relay_kit::metrics::register(registry, &m.games);
        relay_kit::metrics::register(registry, &m.legal_move_rate);
        m
    }

    fn set(&self, env_id: &str, matchups: &[Matchup]) {
        for m in matchups {
            let seat = m.seat.to_string();
            let game = m.game_or(env_id);
            for (outcome, n) in [
                ("win", m.wins),
                ("draw", m.draws),
                ("loss", m.losses),
                ("abandoned", m.abandoned),
            ] {
                self.games
                    .with_label_values(&[game, &m.opponent, &seat, outcome])
                    .set(n as f64);
            }
            self.legal_move_rate
                .with_label_values(&[game, &m.opponent, &seat])
                .set(m.legal_move_rate());
        }
    }
}

/// Pause before a text evaluation that played nothing is tried again.
const TEXT_EVAL_RETRY: std::time::Duration = std::time::Duration::from_secs(5);

/// What a background text evaluation hands back.
struct TextEvaluation {
    plugin: String,
    target: AdapterVersion,
    outcome: Result<EvalOutcome, String>,
    /// The confirmation's games (first seed and outcome), when the
    /// screening mean reached the threshold.
    confirmation: Option<(u64, Result<EvalOutcome, String>)>,
}

/// The rewards of a text evaluation's games, if it played any.
fn text_returns(outcome: &Result<EvalOutcome, String>) -> Option<&[f64]> {
    match outcome {
        Ok(EvalOutcome::Games { returns, .. } | EvalOutcome::Returns(returns))
            if !returns.is_empty() =>
        {
            Some(returns)
        }
        _ => None,
    }
}

/// Publishes the games of an evaluation (`confirmation`: of its
/// confirmation) for the run directory's `games.jsonl`, after its report.
async fn publish_games(
    service: &Service,
    report: &EvalReport,
    played: Vec<OpponentGame>,
    confirmation: bool,
) {
    for game in played {
        let message = EvalGame {
            schema: SCHEMA_VERSION,
            evaluator: report.evaluator.clone(),
            instance: report.instance.clone(),
            policy_version: report.policy_version,
            opponent: game.opponent,
            confirmation,
            game: game.record,
        };
        // Only the run directory's record; a game too large is logged.
        let _ = service
            .publish_within(service.subjects.eval_games(), message)
            .await;
    }
}

/// The evaluator of text-game runs (see the crate docs).
async fn run_text(service: Service, shutdown: Shutdown) -> Result<(), ServiceError> {
    let cfg = service.config.clone();
    let metrics = EvalMetrics::register(&service.registry);
    let matchup_metrics = MatchupMetrics::register(&service.registry);
    let threshold = cfg.eval.threshold;
    let env_id = cfg.run.env_id.clone();
    let build = |name: &str, options: &[(String, String)]| -> Result<Arc<dyn Evaluator>, String> {
        let plugin = plugins::build(name, options)?;
        plugin.check_env(&env_id, &cfg.env)?;
        Ok(plugin.into())
    };
    let mut plugin = build(&cfg.eval.evaluator, &cfg.eval.option_pairs())
        .map_err(|e| ServiceError::other(format!("eval.evaluator: {e}")))?;
    let mut follower = AdapterFollower::start(&service, LEARNING_ADAPTER).await?;
    let mut controls = service
        .nats
        .subscribe(service.subjects.eval_control())
        .await
        .map_err(ServiceError::nats)?;
    let ctx = TextEvalContext {
        env_id: env_id.clone(),
        game_ids: cfg
            .text
            .game_weights(&env_id)
            .into_iter()
            .filter(|(_, weight)| *weight > 0.0)
            .map(|(game, _)| game)
            .collect(),
        games: cfg.eval.episodes,
        seed: cfg.eval.seed,
        confirming: false,
        version: None,
        text: cfg.text.clone(),
        env: cfg.env.clone(),
        generator: NatsGenerate::new(service.nats.clone(), service.subjects.generate()),
        instance: service.instance.clone(),
    };
    tracing::info!(evaluator = plugin.name(), %env_id, "evaluator plugin (text games)");
    metrics.active.with_label_values(&[plugin.name()]).set(1.0);
    service.health.set_ready(true);
    let every_seconds = cfg
        .eval
        .every_seconds
        .map(std::time::Duration::from_secs_f64);
    let mut time_due_at = every_seconds.map(|d| tokio::time::Instant::now() + d);
    let mut time_due = false;
    let mut last: Option<u64> = None;
    let mut announced_solved = false;
    // The first evaluation plays the learner's current version once it is
    // known: asked for before the learner published it, the inference
    // servers know no adapter yet and abandon the games (16 to 56 of 400 in
    // `bench-league`). A bot learner publishes none: version 0 at once.
    let mut due: Option<AdapterVersion> = follower.latest().or_else(|| {
        cfg.text.learner_bot().map(|_| AdapterVersion {
            version: 0,
            learner_env_steps: 0,
        })
    });
    let mut running: Option<tokio::task::JoinHandle<TextEvaluation>> = None;
    // An evaluation that played nothing (every game abandoned: e.g. no
    // inference server yet) is tried again after a pause, unless a newer
    // version comes first.
    let mut retry: Option<(tokio::time::Instant, AdapterVersion)> = None;
    loop {
        if running.is_none() {
            if let Some(target) = due.take() {
                if let Some(previous) = last {
                    metrics
                        .skipped
                        .inc_by(target.version.saturating_sub(previous + 1));
                }
                last = Some(target.version);
                time_due = false;
                time_due_at = every_seconds.map(|d| tokio::time::Instant::now() + d);
                announce_start(&service, plugin.name(), target.version).await;
                let evaluator = plugin.clone();
                let ctx = TextEvalContext {
                    version: Some(target.version),
                    ..ctx.clone()
                };
                let confirm = (
                    cfg.eval.confirm_episodes,
                    cfg.eval.confirm_seed(target.version),
                );
                running = Some(tokio::spawn(async move {
                    let outcome = evaluator.evaluate_text(&ctx).await;
                    let screened = text_returns(&outcome)
                        .is_some_and(|r| threshold.is_some_and(|t| mean_std(r).0 >= t));
                    let confirmation = if screened {
                        let (games, seed) = confirm;
                        let ctx = TextEvalContext {
                            games,
                            seed,
                            confirming: true,
                            ..ctx
                        };
                        Some((seed, evaluator.evaluate_text(&ctx).await))
                    } else {
                        None
                    };
                    TextEvaluation {
                        plugin: evaluator.name().to_string(),
                        target,
                        outcome,
                        confirmation,
                    }
                }));
            }
        }
        let wanted = match last {
            Some(v) if time_due => Some(v),
            Some(v) => Some(v + cfg.eval.every_versions - 1),
            None => None,
        };
        tokio::select! {
            _ = shutdown.wait() => break,
            _ = tokio::time::sleep_until(time_due_at.unwrap_or_else(tokio::time::Instant::now)), if time_due_at.is_some() && !time_due => {
                time_due = true;
            }
            Some(m) = controls.next() => {
                match service.intake.decode::<EvalControl>("eval.control", &m.payload) {
                    Ok(control) => match build(&control.evaluator, &control.options) {
                        Ok(p) => {
                            tracing::info!(from = plugin.name(), to = p.name(), options = ?control.options, "evaluator plugin switched");
                            let _ = metrics.active.remove_label_values(&[plugin.name()]);
                            metrics.active.with_label_values(&[p.name()]).set(1.0);
                            plugin = p;
                            metrics.control_applied.inc();
                        }
                        Err(e) => {
                            tracing::warn!(error = %e, current = plugin.name(), "eval control refused");
                            metrics.control_rejected.inc();
                        }
                    },
                    Err(_) => metrics.control_rejected.inc(),
                }
            }
            v = follower.newer_than(wanted), if running.is_none() && due.is_none() => match v {
                Some(v) => {
                    due = Some(v);
                    retry = None;
                }
                None => break,
            },
            _ = tokio::time::sleep_until(retry.map_or_else(tokio::time::Instant::now, |r| r.0)), if retry.is_some() && running.is_none() && due.is_none() => {
                due = retry.take().map(|r| r.1);
            }
            finished = async { running.as_mut().expect("checked").await }, if running.is_some() => {
                running = None;
                let evaluation = finished.map_err(ServiceError::other)?;
                let version = evaluation.target.version;
                let (returns, matchups, acted, played) = match evaluation.outcome {
                    Ok(EvalOutcome::Games { returns, matchups, policy_version, played, .. }) if !returns.is_empty() => {
                        (returns, matchups, policy_version, played)
                    }
                    Ok(EvalOutcome::Returns(returns)) if !returns.is_empty() => (returns, Vec::new(), None, Vec::new()),
                    Ok(EvalOutcome::Skipped(reason)) => {
                        tracing::warn!(evaluator = %evaluation.plugin, version, %reason, retry_in_s = TEXT_EVAL_RETRY.as_secs(), "evaluation skipped");
                        retry = Some((tokio::time::Instant::now() + TEXT_EVAL_RETRY, evaluation.target));
                        continue;
                    }
                    Ok(_) => continue,
                    Err(e) => {
                        tracing::error!(error = %e, evaluator = %evaluation.plugin, version, "evaluation failed");
                        continue;
                    }
                };
                let (mean, std) = mean_std(&returns);
                let mut confirmation_played = Vec::new();
                let confirmation = match (evaluation.confirmation, threshold) {
                    (Some((seed, outcome)), Some(t)) => match text_returns(&outcome) {
                        Some(r) => {
                            // Text runs are judged by the mean of every game.
                            let all_games = Played {
                                returns: r.to_vec(),
                                matchups: Vec::new(),
                                matchup_of: Vec::new(),
                            };
                            let confirmed = confirmation(all_games, seed, t, cfg.eval.confirm_z);
                            if let Ok(EvalOutcome::Games { played, .. }) = outcome {
                                confirmation_played = played;
                            }
                            Some(confirmed)
                        }
                        None => {
                            tracing::warn!(evaluator = %evaluation.plugin, version, outcome = ?outcome.err(), "confirmation played no game");
                            None
                        }
                    },
                    _ => None,
                };
                let solved = confirmation.as_ref().is_some_and(|c| c.passed);
                metrics.last_return.set(mean);
                matchup_metrics.set(&env_id, &matchups);
                let policy_version = acted.unwrap_or(version);
                for m in &matchups {
                    tracing::info!(
                        game = %m.game_or(&env_id), opponent = %m.opponent, seat = m.seat, wins = m.wins, draws = m.draws,
                        losses = m.losses, abandoned = m.abandoned,
                        legal_move_rate = m.legal_move_rate(), "matchup"
                    );
                }
                tracing::info!(evaluator = %evaluation.plugin, version = policy_version, mean_return = mean, confirmation_mean = confirmation.as_ref().map(|c| c.mean_return), solved, "evaluated");
                let report = EvalReport {
                    schema: SCHEMA_VERSION,
                    evaluator: evaluation.plugin.clone(),
                    instance: service.instance.clone(),
                    env_id: env_id.clone(),
                    policy_version,
                    learner_env_steps: evaluation.target.learner_env_steps,
                    returns,
                    mean_return: mean,
                    std_return: std,
                    threshold: threshold.unwrap_or(f64::NAN),
                    solved,
                    matchups,
                    confirmation,
                };
                service.publish(service.subjects.eval(), &report).await;
                publish_games(&service, &report, played, false).await;
                publish_games(&service, &report, confirmation_played, true).await;
                if solved && !announced_solved {
                    announced_solved = true;
                    announce_solved(&service, &report).await;
                }
            }
        }
    }
    if let Some(task) = running.take() {
        task.abort();
    }
    service.finish().await
}
