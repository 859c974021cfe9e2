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
//! Learner replicas (a run with more than one) are listed under the
//! learner's row by rank, from each replica's `learner_replica_rank`,
//! `learner_replica_updates`, `learner_allreduce_seconds` and
//! `learner_barrier_wait_seconds`: replicas in step show the same step.
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

mod draw;
mod feed;
mod state;

pub use draw::*;
pub use feed::*;
pub use state::*;

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

/// One learner replica as its latest report shows it (`relay_learner_replica_*`,
/// the all-reduce and barrier gauges).
#[derive(Debug, Clone, PartialEq)]
pub struct ReplicaRow {
    pub instance: String,
    pub rank: u64,
    pub updates: Option<u64>,
    /// Seconds its latest update spent in all-reduces.
    pub allreduce_seconds: Option<f64>,
    /// Seconds it waited at the step barrier for rank 0's step.
    pub barrier_wait_seconds: Option<f64>,
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
