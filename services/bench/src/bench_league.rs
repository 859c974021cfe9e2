//! `relay bench-league`: TicTacToe by self-play against past versions.
//!
//! 1. The warm start of `relay bench-tictactoe` (a tiny random Qwen2, full
//!    SFT on games of random legal moves; [`sft_warm_start`]).
//! 2. League training with all six services (`relay up` on `--config`, by
//!    default `configs/tictactoe-league.yaml`, over the SFT model) for
//!    `--minutes`. Every `--ratings-every-s` seconds the run's league pool
//!    is read from the stack's Redis and each member's TrueSkill mu and
//!    sigma printed (policy versions `v<N>` and the fixed bots); the
//!    `vs-opponent` evaluator plays the current version against random and
//!    minimax every `--eval-every-s` seconds, printed as it arrives.
//!
//! Each run ends with the ratings of the last read (best conservative
//! rating first), the first version (pinned by `league.pool.keep_first`)
//! against the newest one (mu +/- 2 sigma each, and whether the newest is
//! above with no overlap) and the latest evaluation (the newest version's
//! results against random and minimax). `--seeds` runs repeat step 2
//! with `run.seed` counting up from the config's; the benchmark ends with
//! a table of every seed (the targets: the newest version above the first
//! with no overlap, and at least 90 % non-loss against random in the last
//! evaluation; the best evaluated version beside them) and a JSON line
//! with each seed's rating history and evaluations.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use serde_json::{json, Value};

use crate::text_game_run::{
    bench_up_args, follow_evals, header, rl_overrides, sft_warm_start, Row,
};

/// Flags of `relay bench-league`.
#[derive(Debug, Clone, clap::Args)]
pub struct BenchLeagueArgs {
    /// Minutes of league training after the SFT warm start, per seed (as
    /// long as `bench-tictactoe` trains against the random bot, the result
    /// the league is compared with).
    #[arg(long, default_value_t = 15.0)]
    pub minutes: f64,
    /// League runs, one after the other from the same warm start, with
    /// `run.seed` the config's seed, then one more for each.
    #[arg(long, default_value_t = 3)]
    pub seeds: u64,
    /// The league config.
    #[arg(long, default_value = "configs/tictactoe-league.yaml")]
    pub config: PathBuf,
    /// Override config fields of the league run (repeatable).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub overrides: Vec<String>,
    /// Folder for the tiny model, the SFT output and the runs.
    #[arg(long, default_value = "bench/league")]
    pub work_dir: PathBuf,
    /// Games of random legal moves the SFT data comes from (as
    /// `bench-tictactoe`, whose result the league is compared with).
    #[arg(long, default_value_t = 1000)]
    pub sft_games: usize,
    /// Passes of SFT over those moves.
    #[arg(long, default_value_t = 4)]
    pub sft_epochs: usize,
    /// Games per opponent and seat in each evaluation (as
    /// `bench-tictactoe`: fewer games against the random bot miss the
    /// policy's rate by many points).
    #[arg(long, default_value_t = 100)]
    pub eval_games: usize,
    /// Seconds between evaluations of the current version.
    #[arg(long, default_value_t = 120)]
    pub eval_every_s: u64,
    /// Seconds between printed readings of the league's ratings.
    #[arg(long, default_value_t = 60)]
    pub ratings_every_s: u64,
    /// Folder for the stack's state.
    #[arg(long, default_value = ".relay")]
    pub state_dir: PathBuf,
}

/// One member's rating at one reading.
#[derive(Debug, Clone, PartialEq)]
struct Rated {
    player: String,
    mu: f64,
    sigma: f64,
    conservative: f64,
    games: u64,
}

/// The pool at one moment.
#[derive(Debug, Clone, PartialEq)]
struct Reading {
    minutes: f64,
    /// Best conservative rating first.
    members: Vec<Rated>,
}

impl Reading {
    fn of(pool: &relay_league::Pool, minutes: f64) -> Self {
        let members = pool
            .leaderboard()
            .into_iter()
            .map(|(member, conservative)| {
                let id = member.id();
                let games = pool
                    .members()
                    .map(|other| pool.games_between(&id, &other.id()))
                    .sum();
                Rated {
                    player: id.to_string(),
                    mu: member.rating.mu,
                    sigma: member.rating.sigma,
                    conservative,
                    games,
                }
            })
            .collect();
        Self { minutes, members }
    }

    fn print(&self) {
        println!("ratings at {:.1} min:", self.minutes);
        println!("| player | mu | sigma | mu - k sigma | games |");
        println!("|---|---:|---:|---:|---:|");
        for m in &self.members {
            println!(
                "| {} | {:.2} | {:.2} | {:.2} | {} |",
                m.player, m.mu, m.sigma, m.conservative, m.games
            );
        }
    }

    /// The first policy version in the pool and the newest one that has
    /// played (a version admitted moments ago holds only its parent's
    /// inherited rating).
    fn first_and_latest(&self) -> Option<(&Rated, &Rated)> {
        let first = self
            .members
            .iter()
            .min_by_key(|m| m.version().unwrap_or(u64::MAX))?;
        let latest = self
            .members
            .iter()
            .filter(|m| m.games > 0)
            .max_by_key(|m| m.version())?;
        (first.version().is_some() && latest.version() > first.version()).then_some((first, latest))
    }

    fn json(&self) -> Value {
        json!({
            "minutes": round(self.minutes),
            "members": self.members.iter().map(Rated::json).collect::<Vec<_>>(),
        })
    }
}

fn round(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

impl Rated {
    /// The policy version this member is, if it is one (`v<N>`).
    fn version(&self) -> Option<u64> {
        self.player.strip_prefix('v')?.parse().ok()
    }

    /// `mu - 2 sigma` and `mu + 2 sigma`.
    fn interval(&self) -> (f64, f64) {
        (self.mu - 2.0 * self.sigma, self.mu + 2.0 * self.sigma)
    }

    fn json(&self) -> Value {
        json!({
            "player": self.player,
            "mu": round(self.mu),
            "sigma": round(self.sigma),
            "games": self.games,
        })
    }
}

/// The first version against the newest: each one's mu +/- 2 sigma, and
/// whether the newest is rated above with no overlap (the benchmark's
/// target); printed, and returned as JSON.
fn first_vs_latest(reading: &Reading) -> Value {
    let Some((first, latest)) = reading.first_and_latest() else {
        println!("first vs latest: the pool does not hold two versions");
        return Value::Null;
    };
    let ((first_low, first_high), (latest_low, latest_high)) =
        (first.interval(), latest.interval());
    let above = latest_low > first_high;
    println!(
        "first vs latest: {} mu {:.2} [{:.2}, {:.2}] ({} games); {} mu {:.2} [{:.2}, {:.2}] ({} games); latest above first with no overlap of mu +/- 2 sigma: {}",
        first.player, first.mu, first_low, first_high, first.games,
        latest.player, latest.mu, latest_low, latest_high, latest.games,
        if above { "yes" } else { "no" }
    );
    json!({"first": first.json(), "latest": latest.json(), "latest_above_first": above})
}

/// The Redis URL of the stack running `run_id`, once its record is written.
fn stack_redis(state_dir: &Path, run_id: &str) -> Option<String> {
    crate::stack_record(state_dir, run_id)
        .map(|record| record.redis_url)
        .filter(|url| !url.is_empty())
}

/// Reads the run's pool every few seconds until `stop`; prints a reading
/// every `every`, and returns the printed ones plus the last one read.
fn follow_ratings(
    state_dir: PathBuf,
    run_id: String,
    every: Duration,
    started: Instant,
    stop: Arc<AtomicBool>,
) -> Vec<Reading> {
    let Ok(runtime) = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    else {
        return Vec::new();
    };
    let (_keep, shutdown) = relay_kit::Shutdown::new();
    let mut store: Option<relay_kit::league::LeagueStore> = None;
    let mut printed: Vec<Reading> = Vec::new();
    let mut last: Option<Reading> = None;
    let mut printed_at: Option<Instant> = None;
    while !stop.load(Ordering::Relaxed) {
        if store.is_none() {
            if let Some(url) = stack_redis(&state_dir, &run_id) {
                let connect = async {
                    tokio::time::timeout(
                        Duration::from_secs(2),
                        relay_kit::connect_redis(&url, &shutdown),
                    )
                    .await
                };
                if let Ok(Ok(redis)) = runtime.block_on(connect) {
                    store = Some(relay_kit::league::LeagueStore::new(redis, &run_id));
                }
            }
        }
        if let Some(store) = &store {
            let load = async { tokio::time::timeout(Duration::from_secs(2), store.load()).await };
            if let Ok(Ok(Some(pool))) = runtime.block_on(load) {
                let reading = Reading::of(&pool, started.elapsed().as_secs_f64() / 60.0);
                if printed_at.is_none_or(|t| t.elapsed() >= every) {
                    reading.print();
                    printed.push(reading.clone());
                    printed_at = Some(Instant::now());
                }
                last = Some(reading);
            }
        }
        std::thread::sleep(Duration::from_secs(2));
    }
    if let Some(last) = last {
        if printed.last() != Some(&last) {
            printed.push(last);
        }
    }
    printed
}

/// A run's league ratings, read in a thread from its stack's Redis while
/// it trains (a reading printed every 5 minutes), for benchmarks that run
/// the stack themselves.
pub struct RatingsFollower {
    stop: Arc<AtomicBool>,
    thread: std::thread::JoinHandle<Vec<Reading>>,
}

impl RatingsFollower {
    /// Follows run `run_id` of the stack recorded under `state_dir`.
    pub fn start(state_dir: &Path, run_id: &str) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let (dir, run, flag) = (state_dir.to_path_buf(), run_id.to_string(), stop.clone());
        let started = Instant::now();
        let thread = std::thread::spawn(move || {
            follow_ratings(dir, run, Duration::from_secs(300), started, flag)
        });
        Self { stop, thread }
    }

    /// Stops following; prints the last reading and returns it with the
    /// first version against the newest that played ([`first_vs_latest`]).
    pub fn finish(self) -> Value {
        self.stop.store(true, Ordering::Relaxed);
        let readings = self.thread.join().unwrap_or_default();
        match readings.last() {
            Some(last) => {
                last.print();
                let mut verdict = first_vs_latest(last);
                if let Value::Object(fields) = &mut verdict {
                    fields.insert("ratings".into(), last.json());
                }
                verdict
            }
            None => {
                println!("ratings: the run's league pool was never read");
                Value::Null
            }
        }
    }
}

/// What one seed's league run reached.
struct SeedOutcome {
    seed: u64,
    run_id: String,
    /// The pool's printed readings, the last one read at the end.
    readings: Vec<Reading>,
    /// The newest version against the first (JSON of [`first_vs_latest`]).
    first_vs_latest: Value,
    /// Every evaluation, in order (the first is of version 0).
    evaluations: Vec<Row>,
}

impl SeedOutcome {
    fn latest_above_first(&self) -> bool {
        self.first_vs_latest["latest_above_first"] == true
    }

    /// The last evaluation: the newest version's results.
    fn latest_eval(&self) -> Option<&Row> {
        self.evaluations.last()
    }

    /// The best evaluated RL version among complete evaluations (no game
    /// abandoned): highest non-loss against random, then against minimax.
    fn best_eval(&self) -> Option<&Row> {
        let score = |r: &Row| {
            (
                r.non_loss("random").unwrap_or(0.0),
                r.non_loss("minimax").unwrap_or(0.0),
            )
        };
        self.evaluations
            .iter()
            .filter(|r| r.version.is_some_and(|v| v > 0) && r.abandoned == 0)
            .max_by(|a, b| {
                score(a)
                    .partial_cmp(&score(b))
                    .unwrap_or(std::cmp::Ordering::Equal)
            })
    }

    /// The newest version above the first with no overlap, and at least
    /// 90 % non-loss against random in the last evaluation.
    fn meets_targets(&self) -> bool {
        self.latest_above_first()
            && self
                .latest_eval()
                .and_then(|r| r.non_loss("random"))
                .is_some_and(|v| v >= 0.9)
    }

    fn json(&self) -> Value {
        let newest_version = self
            .readings
            .last()
            .and_then(|r| r.members.iter().filter_map(Rated::version).max());
        json!({
            "seed": self.seed,
            "run_id": self.run_id,
            "newest_version": newest_version,
            "first_vs_latest": self.first_vs_latest,
            "latest_eval": self.latest_eval().map(Row::json),
            "best_eval": self.best_eval().map(Row::json),
            "evaluations": self.evaluations.iter().map(Row::json).collect::<Vec<_>>(),
            "ratings": self.readings.iter().map(Reading::json).collect::<Vec<_>>(),
            "meets_targets": self.meets_targets(),
        })
    }
}

/// `relay bench-league`.
pub fn bench_league(args: BenchLeagueArgs) -> Result<()> {
    let started = Instant::now();
    std::fs::create_dir_all(&args.work_dir)
        .with_context(|| format!("creating {}", args.work_dir.display()))?;
    let work = std::fs::canonicalize(&args.work_dir)?;
    let config = relay_config::ExperimentConfig::load(&args.config, &args.overrides)?;
    if !config.league_enabled() {
        anyhow::bail!(
            "{}: the league is off (text.opponents.league is 0 or missing)",
            args.config.display()
        );
    }
    let (sft_model, sft_row) = sft_warm_start(
        &work,
        args.sft_games,
        args.sft_epochs,
        args.eval_games,
        &config,
        started,
    )?;
    let mut outcomes = Vec::new();
    for seed in config.run.seed..config.run.seed + args.seeds.max(1) {
        outcomes.push(league_run(
            &args, &config, &work, &sft_model, &sft_row, seed,
        )?);
    }

    println!();
    println!(
        "== {} league runs of {} minutes",
        outcomes.len(),
        args.minutes
    );
    println!("| seed | newest above first | last eval: version | non-loss vs random | vs minimax | best eval: version | non-loss vs random | vs minimax | targets met |");
    println!("|---:|---|---:|---:|---:|---:|---:|---:|---|");
    let pct = |r: Option<&Row>, opponent: &str| {
        r.and_then(|r| r.non_loss(opponent))
            .map_or("-".to_string(), |v| format!("{:.1}%", 100.0 * v))
    };
    let version = |r: Option<&Row>| {
        r.and_then(|r| r.version)
            .map_or("-".into(), |v| v.to_string())
    };
    for o in &outcomes {
        let (latest, best) = (o.latest_eval(), o.best_eval());
        println!(
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            o.seed,
            if o.latest_above_first() { "yes" } else { "no" },
            version(latest),
            pct(latest, "random"),
            pct(latest, "minimax"),
            version(best),
            pct(best, "random"),
            pct(best, "minimax"),
            if o.meets_targets() { "yes" } else { "no" },
        );
    }
    let met = outcomes.iter().filter(|o| o.meets_targets()).count();
    println!(
        "{}",
        json!({
            "env": "TicTacToe-v0",
            "league_minutes": args.minutes,
            "sft_minutes": (sft_row.minutes * 100.0).round() / 100.0,
            "sft_only": sft_row.json(),
            "seeds": outcomes.iter().map(SeedOutcome::json).collect::<Vec<_>>(),
            "targets_met": format!("{met}/{}", outcomes.len()),
        })
    );
    Ok(())
}

/// One league run of `args.minutes` from the SFT model with `run.seed`
/// set to `seed`: its ratings and evaluations printed as they come, then
/// the last ratings, the first version against the newest and the last
/// evaluation.
fn league_run(
    args: &BenchLeagueArgs,
    config: &relay_config::ExperimentConfig,
    work: &Path,
    sft_model: &Path,
    sft_row: &Row,
    seed: u64,
) -> Result<SeedOutcome> {
    println!(
        "== league training for {} minutes, seed {seed}",
        args.minutes
    );
    let started = Instant::now();
    let run_id = format!("{}-league-seed{seed}", relay::make_run_id(config));
    let runs_dir = work.join("runs");
    let mut overrides = rl_overrides(
        &args.overrides,
        sft_model,
        &runs_dir,
        args.eval_every_s,
        args.eval_games,
    );
    overrides.push(format!("run.seed={seed}"));
    let up = bench_up_args(
        &args.config,
        overrides,
        &run_id,
        &args.state_dir,
        Some((args.minutes * 60.0).round().max(1.0) as u64),
    );
    header();
    sft_row.print();
    let stop = Arc::new(AtomicBool::new(false));
    let evals = {
        let (path, stop) = (runs_dir.join(&run_id).join("eval.jsonl"), stop.clone());
        std::thread::spawn(move || follow_evals(path, started, "SFT only", stop, |_| {}))
    };
    let ratings = {
        let (dir, run, stop) = (args.state_dir.clone(), run_id.clone(), stop.clone());
        let every = Duration::from_secs(args.ratings_every_s.max(1));
        std::thread::spawn(move || follow_ratings(dir, run, every, started, stop))
    };
    let outcome = relay::up(up);
    stop.store(true, Ordering::Relaxed);
    let evaluations = evals
        .join()
        .map_err(|_| anyhow::anyhow!("the eval follower panicked"))?;
    let readings = ratings
        .join()
        .map_err(|_| anyhow::anyhow!("the ratings follower panicked"))?;
    outcome?;

    println!();
    let first_vs_latest = match readings.last() {
        Some(last) => {
            last.print();
            first_vs_latest(last)
        }
        None => {
            println!("no league pool was read");
            Value::Null
        }
    };
    println!();
    header();
    sft_row.print();
    if let Some(row) = evaluations.last() {
        row.print();
    }
    Ok(SeedOutcome {
        seed,
        run_id,
        readings,
        first_vs_latest,
        evaluations,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rated(player: &str, mu: f64, sigma: f64) -> Rated {
        Rated {
            player: player.into(),
            mu,
            sigma,
            conservative: mu - 3.0 * sigma,
            games: 10,
        }
    }

    #[test]
    fn the_newest_version_is_above_the_first_only_without_overlap() {
        let reading = |latest_mu| Reading {
            minutes: 1.0,
            members: vec![
                rated("minimax", 40.0, 1.0),
                rated("v12", latest_mu, 1.5),
                Rated {
                    games: 0,
                    ..rated("v13", 20.0, 1.5)
                },
                rated("v0", 20.0, 1.0),
                rated("v3", 25.0, 1.0),
                rated("random", 22.0, 1.0),
            ],
        };
        let separated = first_vs_latest(&reading(25.5));
        assert_eq!(separated["first"]["player"], "v0");
        assert_eq!(separated["latest"]["player"], "v12");
        assert_eq!(separated["latest_above_first"], true);
        // 24.5 - 3 = 21.5 is below 20 + 2 = 22: the intervals overlap.
        assert_eq!(first_vs_latest(&reading(24.5))["latest_above_first"], false);
        let alone = Reading {
            minutes: 1.0,
            members: vec![rated("v0", 25.0, 8.0), rated("random", 25.0, 8.0)],
        };
        assert_eq!(first_vs_latest(&alone), Value::Null);
    }
}
