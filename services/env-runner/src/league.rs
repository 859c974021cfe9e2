//! The env-runner's side of the run's self-play league
//! ([`relay_kit::league`], the pool in Redis):
//!
//! - **Recording.** Every finished two-player game in which the learning
//!   adapter played one version throughout against a fixed bot or a pinned
//!   past version (`policy@v<N>`, a `league` game) is a match between those
//!   two pool members, recorded with a TrueSkill update. Self-play games on
//!   observations (`crate::selfplay`) are recorded the same way, as the
//!   version of the learning seat's last move. Results go to a
//!   background task that writes them once a second in one
//!   compare-and-set ([`LeagueRecorder`]), so games never wait for Redis,
//!   and a missing Redis only delays the ratings. Mirror games are not
//!   rated (nobody gains on themselves).
//! - **Drawing opponents** ([`LeagueDraws`]): for a `league` game
//!   (`text.opponents.league`), `league.sampler` draws a [`Matchup`] from a
//!   copy of the pool that a background task refreshes from Redis once a
//!   second (never per game or move).
//! - **Serving fallbacks** ([`FallbackGenerate`]): a past version that no
//!   inference server can serve (404) is replaced by the current version
//!   for the rest of that game, which then counts as a mirror game.
//!
//! Versions join the pool when the learner publishes them (league runs);
//! a version the pool has not seen when its first result arrives joins
//! here, inheriting the rating of the newest version before it, and bots
//! join as fixed opponents.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use prometheus::{Histogram, HistogramOpts, IntCounterVec, Opts};
use rand::Rng;
use relay_config::ExperimentConfig;
use relay_kit::league::{version_key, LeagueStore};
use relay_kit::{RequestError, Shutdown};
use relay_league::{
    Matchup, MemberId, OpponentSampler, Outcome, PolicyVersion, Pool, PoolError, SampleError,
};
use relay_policy::text::{Generate, GenerateError, NatsGenerate, PlayedGame, LEARNING_ADAPTER};
use relay_proto::{AdapterRef, GenerateReply, GenerateRequest, SeatPolicy};
use tokio::sync::{mpsc, watch};

/// Results waiting to be written, at most (older ones are dropped, counted).
const QUEUE: usize = 10_000;
/// How often the pool copy that opponents are drawn from is refreshed.
const REFRESH: Duration = Duration::from_secs(1);

/// The league's metrics on the env-runner's `/metrics`.
#[derive(Clone)]
pub struct LeagueMetrics {
    /// League games finished, by opponent (`self`, `past`, a bot) and the
    /// rule that chose it.
    pub opponent_games: IntCounterVec,
    /// League games played as mirror games instead of the drawn opponent.
    pub mirror_fallbacks: IntCounterVec,
    /// Versions between the current version and a past-version opponent.
    pub opponent_lag: Histogram,
}

impl LeagueMetrics {
    /// Registers the league metrics (text mode, whether the league is on or
    /// not, so the series are known).
    pub fn register(registry: &prometheus::Registry) -> Self {
        let opponent_games = IntCounterVec::new(
            Opts::new(
                "relay_league_opponent_games_total",
                "League games finished, by opponent (self: mirror, past: a past version, or a fixed bot's name) and the sampler rule that chose it.",
            ),
            &["opponent", "sampler"],
        )
        .unwrap();
        let mirror_fallbacks = IntCounterVec::new(
            Opts::new(
                "relay_league_mirror_fallbacks_total",
                "League games played as mirror games instead of the drawn opponent, by reason.",
            ),
            &["reason"],
        )
        .unwrap();
        let opponent_lag = Histogram::with_opts(
            HistogramOpts::new(
                "relay_league_opponent_lag_versions",
                "Versions between the learning adapter and the past version it played in a league game.",
            )
            .buckets(vec![1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0]),
        )
        .unwrap();
        relay_kit::metrics::register(registry, &opponent_games);
        relay_kit::metrics::register(registry, &mirror_fallbacks);
        relay_kit::metrics::register(registry, &opponent_lag);
        Self {
            opponent_games,
            mirror_fallbacks,
            opponent_lag,
        }
    }
}

/// Why a `league` game was played as a mirror game.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FallbackReason {
    /// No pool read from Redis yet.
    NoPool,
    /// The pool holds no policy version yet.
    NoVersion,
    /// The sampler had no candidate (e.g. no past version yet).
    NoCandidate,
    /// The drawn fixed member is not a bot this runner can play.
    Unplayable,
    /// No inference server could serve the drawn past version (404).
    NotServed,
}

impl FallbackReason {
    /// The metric label.
    pub fn label(self) -> &'static str {
        match self {
            FallbackReason::NoPool => "no_pool",
            FallbackReason::NoVersion => "no_version",
            FallbackReason::NoCandidate => "no_candidate",
            FallbackReason::Unplayable => "unplayable",
            FallbackReason::NotServed => "not_served",
        }
    }
}

/// One rated game: a version of the learning adapter against another
/// pool member.
#[derive(Debug, Clone, PartialEq)]
pub struct LeagueResult {
    /// The version that held the learning seat.
    pub current: u64,
    /// Its opponent: a fixed bot, or a past (or the same) version.
    pub opponent: MemberId,
    /// The current version's outcome.
    pub outcome: Outcome,
}

/// The one version every turn of `seat` was played with: `Some(None)` if
/// the seat made no move, `None` if a move names no version or versions
/// differ.
fn seat_version(record: &relay_proto::GameRecord, seat: usize) -> Option<Option<u64>> {
    let mut versions = record
        .turns
        .iter()
        .filter(|t| t.player as usize == seat)
        .map(|t| t.adapter.as_ref().and_then(|a| a.version));
    let Some(first) = versions.next() else {
        return Some(None);
    };
    let version = first?;
    versions
        .all(|v| v == Some(version))
        .then_some(Some(version))
}

impl LeagueResult {
    /// The match a finished game is, if it is one: two players, the
    /// learning seat played by one adapter version throughout, the other
    /// seat a bot or a pinned version of the learning adapter (which every
    /// move it made was played with).
    pub fn of(game: &PlayedGame) -> Option<Self> {
        let record = &game.record;
        let learner = record.learner_seat? as usize;
        if record.seats.len() != 2 || learner > 1 {
            return None;
        }
        let other = 1 - learner;
        let current = seat_version(record, learner)??;
        let opponent = match &record.seats[other] {
            SeatPolicy::Bot(name) => MemberId::Fixed(name.clone()),
            // A fixed adapter (`adapter:<name>`): another policy entirely.
            SeatPolicy::Model(Some(AdapterRef {
                name,
                version: None,
            })) if name != LEARNING_ADAPTER => MemberId::Fixed(format!("adapter:{name}")),
            SeatPolicy::Model(Some(AdapterRef {
                name,
                version: Some(version),
            })) if name == LEARNING_ADAPTER => {
                let played = seat_version(record, other)?;
                if played.is_some_and(|p| p != *version) {
                    return None;
                }
                MemberId::Version(*version)
            }
            // Mirror games, the base model, pinned other adapters: not rated.
            _ => return None,
        };
        let outcome = match game.outcome()? {
            relay_policy::text::Outcome::Win => Outcome::Win,
            relay_policy::text::Outcome::Draw => Outcome::Draw,
            relay_policy::text::Outcome::Loss => Outcome::Loss,
        };
        Some(Self {
            current,
            opponent,
            outcome,
        })
    }
}

/// Applies results to the pool; returns how many were recorded. A version
/// between the pool's admissions is rated as the newest version in the
/// pool ([`Pool::rated_as`]). A result whose version left the pool (or is
/// older than every version in it), or whose opponent version was evicted
/// meanwhile, is skipped; no result can fail the whole batch.
pub fn apply(
    pool: &mut Pool,
    results: &[LeagueResult],
    config: &ExperimentConfig,
) -> Result<usize, PoolError> {
    let mut recorded = 0;
    for result in results {
        let current = match pool.rated_as(result.current) {
            Some(member) => member,
            None => {
                // Older than the pool's newest (evicted), or a version that
                // joins but has not: the learner admits before announcing,
                // this covers a learner that failed to.
                let newest = pool.current_version();
                if newest.is_some_and(|n| n > result.current) {
                    continue;
                }
                let current = MemberId::Version(result.current);
                let admitted = pool.add_version(PolicyVersion {
                    version: result.current,
                    parent: newest,
                    weights_ref: version_key(LEARNING_ADAPTER, result.current),
                });
                if admitted.is_err() || pool.get(&current).is_none() {
                    continue;
                }
                current
            }
        };
        if pool.get(&result.opponent).is_none() {
            match &result.opponent {
                MemberId::Fixed(name) => {
                    let bot = relay_config::fixed_opponent(name, &config.text);
                    if pool.add_fixed(bot).is_err() {
                        continue;
                    }
                }
                MemberId::Version(_) => continue,
            }
        }
        if pool
            .record_result(&current, &result.opponent, result.outcome)
            .is_ok()
        {
            recorded += 1;
        }
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
    pub fn start(config: Arc<ExperimentConfig>, shutdown: Shutdown) -> Self {
        let (results, received) = mpsc::channel(QUEUE);
        tokio::spawn(write_results(config, received, shutdown));
        Self { results }
    }

    /// Queues the game's result if it is a rated match; returns it.
    pub fn game(&self, game: &PlayedGame) -> Option<LeagueResult> {
        let result = LeagueResult::of(game)?;
        self.result(result.clone());
        Some(result)
    }

    /// Queues a rated match's result.
    pub fn result(&self, result: LeagueResult) {
        if self.results.try_send(result).is_err() {
            tracing::warn!("league results queue full; a result is dropped");
        }
    }
}

async fn write_results(
    config: Arc<ExperimentConfig>,
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
    let fixed = config.league_fixed();
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
                .update(config.league.pool, &fixed, |pool| {
                    apply(pool, &pending, &config)
                })
                .await;
            match written {
                Ok((recorded, _)) => {
                    tracing::debug!(recorded, of = pending.len(), "league results written");
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

/// Draws the opponents of `league` games from a copy of the pool.
pub struct LeagueDraws {
    sampler: OpponentSampler,
    pool: watch::Receiver<Option<Arc<Pool>>>,
}

impl LeagueDraws {
    /// Starts refreshing the pool copy from Redis in the background.
    pub fn start(config: Arc<ExperimentConfig>, shutdown: Shutdown) -> Result<Self, String> {
        let sampler = OpponentSampler::new(config.league.sampler.clone())
            .map_err(|e| format!("league.sampler: {e}"))?;
        let (sender, pool) = watch::channel(None);
        tokio::spawn(refresh_pool(config, sender, shutdown));
        Ok(Self { sampler, pool })
    }

    /// A draw from a given pool (tests, and [`LeagueDraws::draw`]).
    pub fn draw_from<R: Rng + ?Sized>(
        sampler: &OpponentSampler,
        pool: Option<&Pool>,
        rng: &mut R,
    ) -> Result<Matchup, FallbackReason> {
        let pool = pool.ok_or(FallbackReason::NoPool)?;
        match sampler.sample(pool, rng) {
            Ok(matchup) if matchup.fallback_to_mirror => Err(FallbackReason::NoCandidate),
            Ok(matchup) => Ok(matchup),
            Err(SampleError::NoCurrentVersion) => Err(FallbackReason::NoVersion),
            Err(SampleError::NoListedOpponentInPool(_)) => Err(FallbackReason::NoCandidate),
        }
    }

    /// The next league game's matchup, or why it is a mirror game.
    pub fn draw<R: Rng + ?Sized>(&self, rng: &mut R) -> Result<Matchup, FallbackReason> {
        let pool = self.pool.borrow().clone();
        Self::draw_from(&self.sampler, pool.as_deref(), rng)
    }

    /// The current pool copy, if one was read.
    pub fn pool(&self) -> Option<Arc<Pool>> {
        self.pool.borrow().clone()
    }
}

async fn refresh_pool(
    config: Arc<ExperimentConfig>,
    sender: watch::Sender<Option<Arc<Pool>>>,
    shutdown: Shutdown,
) {
    let Ok(run_id) = config.run_id().map(str::to_string) else {
        return;
    };
    let redis = match relay_kit::connect_redis_with(&config.connections, &shutdown).await {
        Ok(redis) => redis,
        Err(e) => {
            tracing::warn!(error = %e, "league games are mirror games: no Redis");
            return;
        }
    };
    let store = LeagueStore::new(redis, &run_id);
    let mut tick = tokio::time::interval(REFRESH);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = shutdown.wait() => return,
        }
        match store.load().await {
            Ok(Some(pool)) => {
                sender.send_replace(Some(Arc::new(pool)));
            }
            Ok(None) => {}
            Err(e) => tracing::debug!(error = %e, "league pool not refreshed"),
        }
    }
}

/// The generate transport of one league game against a pinned past
/// version: requests for that version that no inference server can serve
/// (404) are sent again for the current version, as are all later ones of
/// the game, and [`FallbackGenerate::fell_back`] says so afterwards.
pub struct FallbackGenerate {
    client: async_nats::Client,
    subject: String,
    inner: NatsGenerate,
    fell_back: AtomicBool,
}

impl FallbackGenerate {
    pub fn new(client: async_nats::Client, subject: String) -> Self {
        Self {
            inner: NatsGenerate::new(client.clone(), subject.clone()),
            client,
            subject,
            fell_back: AtomicBool::new(false),
        }
    }

    /// Whether the pinned version was replaced by the current one.
    pub fn fell_back(&self) -> bool {
        self.fell_back.load(Ordering::Relaxed)
    }

    fn as_current(request: &GenerateRequest) -> GenerateRequest {
        let mut request = request.clone();
        request.adapter = Some(relay_policy::text::learning_adapter());
        request
    }
}

/// How [`NatsGenerate`] reports a failed request.
fn generate_error(e: RequestError) -> GenerateError {
    match e {
        RequestError::Timeout { .. } => GenerateError::Timeout,
        RequestError::NoResponders { .. } => GenerateError::NoResponders,
        RequestError::BadReply { source, .. } => GenerateError::BadReply(source.to_string()),
        other => GenerateError::Other(other.to_string()),
    }
}

impl Generate for FallbackGenerate {
    async fn generate(
        &self,
        request: &GenerateRequest,
        timeout: Duration,
    ) -> Result<GenerateReply, GenerateError> {
        let pinned = request
            .adapter
            .as_ref()
            .is_some_and(|a| a.name == LEARNING_ADAPTER && a.version.is_some());
        if !pinned {
            return self.inner.generate(request, timeout).await;
        }
        if self.fell_back() {
            return self
                .inner
                .generate(&Self::as_current(request), timeout)
                .await;
        }
        match relay_kit::request::<_, GenerateReply>(&self.client, &self.subject, request, timeout)
            .await
        {
            Ok(reply) => Ok(reply),
            Err(RequestError::Service { code, status, .. }) if code == "404" => {
                tracing::debug!(%status, "past version not served; the game goes on as a mirror game");
                self.fell_back.store(true, Ordering::Relaxed);
                self.inner
                    .generate(&Self::as_current(request), timeout)
                    .await
            }
            Err(e) => Err(generate_error(e)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use relay_league::{FixedKind, PoolConfig, SamplerConfig};
    use relay_proto::{GameRecord, Tensor, TextTurn, SCHEMA_VERSION};

    fn result(current: u64, opponent: &str, outcome: Outcome) -> LeagueResult {
        LeagueResult {
            current,
            opponent: opponent.parse().unwrap(),
            outcome,
        }
    }

    fn config() -> ExperimentConfig {
        ExperimentConfig::from_layers("run:\n  env_id: TicTacToe-v0\n", "test", &[], &[]).unwrap()
    }

    #[test]
    fn results_add_versions_and_bots_and_skip_versions_older_than_the_pool() {
        let config = config();
        let mut pool = Pool::new(PoolConfig {
            admit_every: 1,
            ..PoolConfig::default()
        })
        .unwrap();
        let results = [
            result(1, "random", Outcome::Win),
            result(1, "minimax", Outcome::Loss),
            result(2, "random", Outcome::Win),
            // v0 is older than every version in the pool by now: skipped.
            result(0, "random", Outcome::Loss),
            // A version against a past one, and against one never admitted.
            result(2, "v1", Outcome::Draw),
            result(2, "v7", Outcome::Win),
            // A fixed adapter joins as what it is.
            result(2, "adapter:old", Outcome::Loss),
        ];
        assert_eq!(apply(&mut pool, &results, &config).unwrap(), 5);
        let old = MemberId::Fixed("adapter:old".into());
        assert_eq!(pool.record(&MemberId::Version(2), &old).losses, 1);
        match &pool.get(&old).unwrap().kind {
            relay_league::MemberKind::Fixed(f) => {
                assert_eq!(f.kind, FixedKind::Adapter { path: "old".into() })
            }
            other => panic!("{other:?}"),
        }
        let v1 = MemberId::Version(1);
        let v2 = MemberId::Version(2);
        let random = MemberId::Fixed("random".into());
        let minimax = MemberId::Fixed("minimax".into());
        assert_eq!(pool.versions().collect::<Vec<_>>(), vec![1, 2]);
        assert_eq!(pool.record(&v1, &random).wins, 1);
        assert_eq!(pool.record(&v1, &minimax).losses, 1);
        assert_eq!(pool.record(&v2, &random).wins, 1);
        assert_eq!(pool.record(&v2, &v1).draws, 1);
        assert!(pool.get(&MemberId::Version(0)).is_none());
        match &pool.get(&minimax).unwrap().kind {
            relay_league::MemberKind::Fixed(f) => {
                assert_eq!(f.kind, FixedKind::Minimax { depth: None })
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn versions_between_admissions_are_rated_as_the_newest_in_the_pool() {
        let config = config();
        let mut pool = Pool::new(PoolConfig {
            admit_every: 10,
            ..PoolConfig::default()
        })
        .unwrap();
        let results = [
            // The first version joins whatever its number.
            result(3, "random", Outcome::Win),
            // v4..v9 do not join: their games are v3's.
            result(4, "random", Outcome::Win),
            result(9, "minimax", Outcome::Loss),
            // v10 joins (inheriting v3's rating), and v12 plays as v10.
            result(10, "random", Outcome::Draw),
            result(12, "v3", Outcome::Win),
        ];
        assert_eq!(apply(&mut pool, &results, &config).unwrap(), 5);
        assert_eq!(pool.versions().collect::<Vec<_>>(), vec![3, 10]);
        let (v3, v10) = (MemberId::Version(3), MemberId::Version(10));
        let random = MemberId::Fixed("random".into());
        assert_eq!(pool.record(&v3, &random).wins, 2);
        assert_eq!(pool.record(&v3, &"minimax".parse().unwrap()).losses, 1);
        assert_eq!(pool.record(&v10, &random).draws, 1);
        assert_eq!(pool.record(&v10, &v3).wins, 1);
        // A version older than the newest in the pool is not rated.
        assert_eq!(
            apply(&mut pool, &[result(5, "random", Outcome::Win)], &config).unwrap(),
            0
        );
        assert_eq!(pool.rated_as(11), Some(v10.clone()));
        assert_eq!(pool.rated_as(20), None);
        assert_eq!(pool.rated_as(10), Some(v10));
    }

    fn turn(player: u8, version: Option<u64>) -> TextTurn {
        TextTurn {
            player,
            prompt_tokens: Tensor::from_u32(&[1], &[1]),
            completion_tokens: Tensor::from_u32(&[1], &[2]),
            logprobs: Tensor::from_f32(&[1], &[-0.5]),
            action: "[4]".into(),
            invalid: false,
            adapter: version.map(|v| AdapterRef {
                name: LEARNING_ADAPTER.into(),
                version: Some(v),
            }),
            observation: "[GAME] board".into(),
            completion: String::new(),
            no_answer: false,
            truncated: false,
        }
    }

    fn game(
        seats: [SeatPolicy; 2],
        learner: u8,
        turns: Vec<TextTurn>,
        rewards: [f64; 2],
    ) -> PlayedGame {
        PlayedGame {
            record: GameRecord {
                schema: SCHEMA_VERSION,
                runner_id: "r".into(),
                env_id: "TicTacToe-v0".into(),
                seed: 0,
                seats: seats.to_vec(),
                learner_seat: Some(learner),
                turns,
                rewards: rewards.to_vec(),
                reasons: vec![String::new(); 2],
                duration_ms: 1,
                finished_unix_ms: 0,
                branch: None,
            },
            states: Vec::new(),
            model_turn_seconds: Vec::new(),
            retries: 0,
            completion_chars: 0,
        }
    }

    fn model(version: Option<u64>) -> SeatPolicy {
        SeatPolicy::Model(Some(AdapterRef {
            name: LEARNING_ADAPTER.into(),
            version,
        }))
    }

    #[test]
    fn games_against_past_versions_and_bots_are_matches_and_mirror_games_are_not() {
        // The learner (seat 1, v5) beat v3 (seat 0).
        let played = game(
            [model(Some(3)), model(None)],
            1,
            vec![turn(0, Some(3)), turn(1, Some(5)), turn(0, Some(3))],
            [-1.0, 1.0],
        );
        assert_eq!(
            LeagueResult::of(&played),
            Some(result(5, "v3", Outcome::Win))
        );
        // The opponent seat was played by another version than pinned.
        let mixed = game(
            [model(Some(3)), model(None)],
            1,
            vec![turn(0, Some(4)), turn(1, Some(5))],
            [-1.0, 1.0],
        );
        assert_eq!(LeagueResult::of(&mixed), None);
        // The learner moved with two versions.
        let spanning = game(
            [SeatPolicy::Bot("random".into()), model(None)],
            1,
            vec![
                turn(0, None),
                turn(1, Some(5)),
                turn(0, None),
                turn(1, Some(6)),
            ],
            [0.0, 0.0],
        );
        assert_eq!(LeagueResult::of(&spanning), None);
        let against_bot = game(
            [model(None), SeatPolicy::Bot("minimax".into())],
            0,
            vec![turn(0, Some(2)), turn(1, None)],
            [0.0, 0.0],
        );
        assert_eq!(
            LeagueResult::of(&against_bot),
            Some(result(2, "minimax", Outcome::Draw))
        );
        let mirror = game(
            [model(None), model(None)],
            0,
            vec![turn(0, Some(2)), turn(1, Some(2))],
            [1.0, -1.0],
        );
        assert_eq!(LeagueResult::of(&mirror), None);
        // Another adapter the servers hold is a fixed member.
        let against_adapter = game(
            [
                SeatPolicy::Model(Some(AdapterRef {
                    name: "old".into(),
                    version: None,
                })),
                model(None),
            ],
            1,
            vec![turn(0, None), turn(1, Some(4))],
            [1.0, -1.0],
        );
        assert_eq!(
            LeagueResult::of(&against_adapter),
            Some(result(4, "adapter:old", Outcome::Loss))
        );
    }

    #[test]
    fn draws_fall_back_to_mirror_until_there_is_someone_to_play() {
        let sampler = OpponentSampler::new(SamplerConfig::Lagged { k: 1 }).unwrap();
        let mut rng = <rand_chacha::ChaCha8Rng as rand::SeedableRng>::seed_from_u64(1);
        assert_eq!(
            LeagueDraws::draw_from(&sampler, None, &mut rng),
            Err(FallbackReason::NoPool)
        );
        let mut pool = Pool::new(PoolConfig::default()).unwrap();
        assert_eq!(
            LeagueDraws::draw_from(&sampler, Some(&pool), &mut rng),
            Err(FallbackReason::NoVersion)
        );
        for version in [0, 1] {
            pool.add_version(PolicyVersion {
                version,
                parent: version.checked_sub(1),
                weights_ref: version_key(LEARNING_ADAPTER, version),
            })
            .unwrap();
        }
        let matchup = LeagueDraws::draw_from(&sampler, Some(&pool), &mut rng).unwrap();
        assert_eq!(
            (matchup.current, matchup.opponent),
            (1, MemberId::Version(0))
        );
        let uniform = OpponentSampler::new(SamplerConfig::Uniform {
            include_fixed: true,
        })
        .unwrap();
        let mut lone = Pool::new(PoolConfig::default()).unwrap();
        lone.add_version(PolicyVersion {
            version: 0,
            parent: None,
            weights_ref: String::new(),
        })
        .unwrap();
        assert_eq!(
            LeagueDraws::draw_from(&uniform, Some(&lone), &mut rng),
            Err(FallbackReason::NoCandidate)
        );
    }
}
