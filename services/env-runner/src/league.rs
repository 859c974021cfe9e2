//! Rates the learning policy's versions in the run's league pool
//! ([`relay_kit::league`], in Redis): every finished two-player game in
//! which the learning adapter played a fixed bot is a match between that
//! adapter version (`v<N>`) and the bot, recorded with a TrueSkill update.
//!
//! A version the pool has not seen joins it when its first game arrives,
//! inheriting the rating of the newest version before it (its parent);
//! bots join as fixed opponents. Results are sent to a background task
//! that writes them once a second in one compare-and-set, so games never
//! wait for Redis, and a missing Redis only delays the ratings.

use std::time::Duration;

use relay_kit::config::ExperimentConfig;
use relay_kit::league::LeagueStore;
use relay_kit::Shutdown;
use relay_league::{
    FixedKind, FixedOpponent, MemberId, Outcome, PolicyVersion, Pool, PoolConfig, PoolError,
};
use relay_policy::text::PlayedGame;
use tokio::sync::mpsc;

/// Results waiting to be written, at most (older ones are dropped, counted).
const QUEUE: usize = 10_000;

/// One rated game: the learning adapter's version against a bot.
#[derive(Debug, Clone, PartialEq)]
pub struct LeagueResult {
    pub version: u64,
    pub bot: String,
    /// The version's outcome.
    pub outcome: Outcome,
}

impl LeagueResult {
    /// The match a finished game is, if it is one: two players, the
    /// learning seat played by one adapter version throughout, the other
    /// seat a bot.
    pub fn of(game: &PlayedGame) -> Option<Self> {
        let record = &game.record;
        let learner = record.learner_seat? as usize;
        if record.seats.len() != 2 {
            return None;
        }
        let bot = match &record.seats[1 - learner] {
            relay_proto::SeatPolicy::Bot(name) => name.clone(),
            _ => return None,
        };
        let mut versions = record
            .turns
            .iter()
            .filter(|t| t.player as usize == learner)
            .map(|t| t.adapter.as_ref().and_then(|a| a.version));
        let version = versions.next()??;
        if !versions.all(|v| v == Some(version)) {
            return None;
        }
        let outcome = match game.outcome()? {
            relay_policy::text::Outcome::Win => Outcome::Win,
            relay_policy::text::Outcome::Draw => Outcome::Draw,
            relay_policy::text::Outcome::Loss => Outcome::Loss,
        };
        Some(Self {
            version,
            bot,
            outcome,
        })
    }
}

fn fixed_opponent(name: &str, config: &ExperimentConfig) -> FixedOpponent {
    let kind = match name {
        "minimax" => FixedKind::Minimax { depth: None },
        "connect_four_bot" => FixedKind::Minimax {
            depth: Some(config.text.connect_four_depth),
        },
        _ => FixedKind::Random,
    };
    FixedOpponent {
        name: name.to_string(),
        kind,
    }
}

/// Applies results to the pool; returns how many were recorded (a result
/// whose version left the pool, or is older than every version in it, is
/// skipped).
pub fn apply(
    pool: &mut Pool,
    results: &[LeagueResult],
    config: &ExperimentConfig,
) -> Result<usize, PoolError> {
    let mut recorded = 0;
    for result in results {
        let version = MemberId::Version(result.version);
        if pool.get(&version).is_none() {
            let newest = pool.current_version();
            if newest.is_some_and(|n| n > result.version) {
                continue;
            }
            pool.add_version(PolicyVersion {
                version: result.version,
                parent: newest,
                weights_ref: format!("adapter:policy@{}", result.version),
            })?;
        }
        let bot = MemberId::Fixed(result.bot.clone());
        if pool.get(&bot).is_none() {
            pool.add_fixed(fixed_opponent(&result.bot, config))?;
        }
        pool.record_result(&version, &bot, result.outcome)?;
        recorded += 1;
    }
    Ok(recorded)
}

/// Sends results to the writer task.
#[derive(Clone)]
pub struct LeagueRecorder {
    results: mpsc::Sender<LeagueResult>,
}

impl LeagueRecorder {
    /// Starts the writer task of the run's pool.
    pub fn start(config: std::sync::Arc<ExperimentConfig>, shutdown: Shutdown) -> Self {
        let (results, received) = mpsc::channel(QUEUE);
        tokio::spawn(write_results(config, received, shutdown));
        Self { results }
    }

    /// Queues the game's result if it is a rated match.
    pub fn game(&self, game: &PlayedGame) {
        if let Some(result) = LeagueResult::of(game) {
            if self.results.try_send(result).is_err() {
                tracing::warn!("league results queue full; a result is dropped");
            }
        }
    }
}

async fn write_results(
    config: std::sync::Arc<ExperimentConfig>,
    mut received: mpsc::Receiver<LeagueResult>,
    shutdown: Shutdown,
) {
    let Ok(run_id) = config.run_id().map(str::to_string) else {
        return;
    };
    let redis = match relay_kit::connect_redis_with(&config.connections, &shutdown).await {
        Ok(redis) => redis,
        Err(e) => {
            tracing::warn!(error = %e, "league results are not recorded: no Redis");
            return;
        }
    };
    let store = LeagueStore::new(redis, &run_id);
    let mut pending = Vec::new();
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    loop {
        let stopping = tokio::select! {
            Some(result) = received.recv() => {
                pending.push(result);
                continue;
            }
            _ = tick.tick() => false,
            _ = shutdown.wait() => true,
        };
        while let Ok(result) = received.try_recv() {
            pending.push(result);
        }
        if pending.len() > QUEUE {
            let dropped = pending.len() - QUEUE;
            pending.drain(..dropped);
            tracing::warn!(dropped, "league results dropped while Redis failed");
        }
        if !pending.is_empty() {
            let written = store
                .update(PoolConfig::default(), &[], |pool| {
                    apply(pool, &pending, &config)
                })
                .await;
            match written {
                Ok((recorded, _)) => {
                    tracing::debug!(recorded, "league results written");
                    pending.clear();
                }
                Err(e) => tracing::warn!(error = %e, "writing league results failed; retrying"),
            }
        }
        if stopping {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn result(version: u64, bot: &str, outcome: Outcome) -> LeagueResult {
        LeagueResult {
            version,
            bot: bot.into(),
            outcome,
        }
    }

    #[test]
    fn results_add_versions_and_bots_and_skip_versions_older_than_the_pool() {
        let config =
            ExperimentConfig::from_layers("run:\n  env_id: TicTacToe-v0\n", "test", &[], &[])
                .unwrap();
        let mut pool = Pool::new(PoolConfig::default()).unwrap();
        let results = [
            result(1, "random", Outcome::Win),
            result(1, "minimax", Outcome::Loss),
            result(2, "random", Outcome::Win),
            // v0 is older than every version in the pool by now: skipped.
            result(0, "random", Outcome::Loss),
        ];
        assert_eq!(apply(&mut pool, &results, &config).unwrap(), 3);
        let v1 = MemberId::Version(1);
        let v2 = MemberId::Version(2);
        let random = MemberId::Fixed("random".into());
        let minimax = MemberId::Fixed("minimax".into());
        assert_eq!(pool.versions().collect::<Vec<_>>(), vec![1, 2]);
        assert_eq!(pool.record(&v1, &random).wins, 1);
        assert_eq!(pool.record(&v1, &minimax).losses, 1);
        assert_eq!(pool.record(&v2, &random).wins, 1);
        assert!(pool.get(&MemberId::Version(0)).is_none());
        match &pool.get(&minimax).unwrap().kind {
            relay_league::MemberKind::Fixed(f) => {
                assert_eq!(f.kind, FixedKind::Minimax { depth: None })
            }
            other => panic!("{other:?}"),
        }
    }
}
