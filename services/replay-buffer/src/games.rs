//! Text runs: finished games (`relay.<run>.games`, consumed in the queue
//! group `replay-buffer`, so copies share the stream) kept in Redis until
//! the learner takes them.
//!
//! Keys (under `relay:<run>:`): `games` (list, oldest first), `games:turns`
//! (learning turns held), and the run's `min_version` and `stats` (shared
//! with the fragment FIFO; a run is either classic or text). Each list
//! item is `<learning turns>|<encoded GameRecord>`, so the insert script
//! can evict by turns without decoding.
//!
//! - Capacity is `replay.capacity_steps`, counted in learning turns (the
//!   moves the learner trains on; what text-mode env-runners report as
//!   env steps). Games are published without acknowledgement, so there is
//!   no backpressure to give: an insert that overflows evicts the oldest
//!   games (counted as `evicted`), which on-policy training would find
//!   stale first anyway.
//! - A game is as old as the oldest adapter version among its learning
//!   turns; games older than the version the learner last asked for
//!   (`min_version`) are dropped at insert and at sample (counted as
//!   `stale`). With `replay.max_age_s`, a game that ended longer ago than
//!   that (`GameRecord::finished_unix_ms`) is dropped at sample too
//!   (`too_old`), whatever its version.
//! - Games without learning turns (bot learners, no learning seat) are
//!   not stored (`no_learning_turns`); a game of more turns than the
//!   capacity is refused (`too_big`).
//! - A sample pops whole games, oldest first, until `max_turns` learning
//!   turns are gathered or the reply would pass the message size limit
//!   (the game that does not fit goes back to the head of the list; a
//!   game that alone does not fit is dropped as `oversized`).

use redis::AsyncCommands;
use relay_proto::GameRecord;

/// Redis key names of one run's games.
#[derive(Clone)]
pub struct GameKeys {
    pub games: String,
    pub turns: String,
    pub min_version: String,
    pub stats: String,
}

impl GameKeys {
    pub fn new(run_id: &str) -> Self {
        let base = format!("relay:{run_id}");
        Self {
            games: format!("{base}:games"),
            turns: format!("{base}:games:turns"),
            min_version: format!("{base}:min_version"),
            stats: format!("{base}:stats"),
        }
    }
}

/// Appends a game unless stale or bigger than the capacity, then evicts the
/// oldest games past the capacity.
/// KEYS: games, turns, min_version, stats. ARGV: item, turns, capacity, version.
/// Returns {status, held, evicted}: status 1 stored, -1 stale, -2 too big.
const INSERT_GAME_SCRIPT: &str = r#"
local held = tonumber(redis.call('GET', KEYS[2]) or '0')
local min_version = tonumber(redis.call('GET', KEYS[3]) or '0')
if tonumber(ARGV[4]) < min_version then
  redis.call('HINCRBY', KEYS[4], 'dropped_stale_games', 1)
  return {-1, held, 0}
end
if tonumber(ARGV[2]) > tonumber(ARGV[3]) then
  redis.call('HINCRBY', KEYS[4], 'refused_too_big_games', 1)
  return {-2, held, 0}
end
redis.call('RPUSH', KEYS[1], ARGV[1])
redis.call('HINCRBY', KEYS[4], 'inserted_games', 1)
redis.call('HINCRBY', KEYS[4], 'inserted_turns', ARGV[2])
held = redis.call('INCRBY', KEYS[2], ARGV[2])
local evicted = 0
while held > tonumber(ARGV[3]) do
  local item = redis.call('LPOP', KEYS[1])
  if not item then break end
  local sep = string.find(item, '|', 1, true)
  local n = tonumber(string.sub(item, 1, sep - 1)) or 0
  held = redis.call('DECRBY', KEYS[2], n)
  evicted = evicted + 1
end
if evicted > 0 then
  redis.call('HINCRBY', KEYS[4], 'evicted_games', evicted)
end
return {1, held, evicted}
"#;

/// Outcome of a game insert.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GameInserted {
    /// Stored; `evicted` older games made room.
    Stored { held_turns: u64, evicted: u64 },
    /// Older than the learner accepts.
    Stale,
    /// More learning turns than the whole capacity.
    TooBig,
    /// No learning turns: nothing to train on.
    NoLearningTurns,
}

/// What a sample took out.
#[derive(Debug, Default)]
pub struct SampledGames {
    pub games: Vec<GameRecord>,
    pub dropped_stale: u64,
    /// Games that ended more than `replay.max_age_s` ago.
    pub dropped_old: u64,
    /// Items that no longer decode (another schema version); dropped.
    pub undecodable: u64,
    /// Games too big for one reply on their own; dropped.
    pub oversized: u64,
}

/// The games of one run, over a Redis connection.
#[derive(Clone)]
pub struct GameStore {
    redis: redis::aio::ConnectionManager,
    keys: GameKeys,
    capacity_turns: u64,
    /// `replay.max_age_s` in milliseconds.
    max_age_ms: Option<u64>,
    insert: redis::Script,
}

/// Room a reply keeps for its own framing beside the games' bytes.
const REPLY_OVERHEAD: usize = 16 * 1024;

/// Number of turns a game counts for.
pub fn learning_turn_count(game: &GameRecord) -> u64 {
    game.learning_turns().count() as u64
}

impl GameStore {
    pub fn new(
        redis: redis::aio::ConnectionManager,
        run_id: &str,
        capacity_turns: u64,
        max_age_s: Option<f64>,
    ) -> Self {
        Self {
            redis,
            keys: GameKeys::new(run_id),
            capacity_turns,
            max_age_ms: max_age_s.map(|s| (s * 1000.0) as u64),
            insert: redis::Script::new(INSERT_GAME_SCRIPT),
        }
    }

    /// Stores a validated game (`payload` is its encoding).
    pub async fn insert(
        &self,
        game: &GameRecord,
        payload: &[u8],
    ) -> redis::RedisResult<GameInserted> {
        let turns = learning_turn_count(game);
        if turns == 0 {
            let mut redis = self.redis.clone();
            let _: i64 = redis
                .hincr(&self.keys.stats, "dropped_no_learning_turns_games", 1)
                .await?;
            return Ok(GameInserted::NoLearningTurns);
        }
        let mut item = format!("{turns}|").into_bytes();
        item.extend_from_slice(payload);
        let mut redis = self.redis.clone();
        let (status, held, evicted): (i64, u64, u64) = self
            .insert
            .key(&self.keys.games)
            .key(&self.keys.turns)
            .key(&self.keys.min_version)
            .key(&self.keys.stats)
            .arg(item)
            .arg(turns)
            .arg(self.capacity_turns)
            .arg(game.learning_version().unwrap_or(0))
            .invoke_async(&mut redis)
            .await?;
        Ok(match status {
            1 => GameInserted::Stored {
                held_turns: held,
                evicted,
            },
            -2 => GameInserted::TooBig,
            _ => GameInserted::Stale,
        })
    }

    /// Pops whole games from the head (see the module docs).
    pub async fn sample(
        &self,
        min_policy_version: u64,
        max_turns: u64,
        max_reply_bytes: usize,
    ) -> redis::RedisResult<SampledGames> {
        let mut redis = self.redis.clone();
        let _: () = redis
            .set(&self.keys.min_version, min_policy_version)
            .await?;
        let budget = max_reply_bytes.saturating_sub(REPLY_OVERHEAD);
        let mut out = SampledGames::default();
        let (mut gathered, mut popped_turns, mut bytes) = (0u64, 0u64, 0usize);
        let now = relay_proto::unix_ms();
        let too_old = |game: &GameRecord| {
            self.max_age_ms.is_some_and(|max| {
                game.finished_unix_ms > 0 && now.saturating_sub(game.finished_unix_ms) > max
            })
        };
        while gathered < max_turns {
            let item: Option<Vec<u8>> = redis.lpop(&self.keys.games, None).await?;
            let Some(item) = item else { break };
            let Some(sep) = item.iter().position(|&b| b == b'|') else {
                out.undecodable += 1;
                continue;
            };
            let turns: u64 = std::str::from_utf8(&item[..sep])
                .ok()
                .and_then(|t| t.parse().ok())
                .unwrap_or(0);
            let payload = &item[sep + 1..];
            if bytes + payload.len() > budget {
                if out.games.is_empty() {
                    popped_turns += turns;
                    out.oversized += 1;
                    continue;
                }
                // The next batch starts with it.
                let _: i64 = redis.lpush(&self.keys.games, &item).await?;
                break;
            }
            popped_turns += turns;
            match relay_proto::decode::<GameRecord>(payload) {
                Ok(game)
                    if relay_proto::is_stale(
                        game.learning_version().unwrap_or(0),
                        min_policy_version,
                    ) =>
                {
                    out.dropped_stale += 1;
                }
                Ok(game) if too_old(&game) => out.dropped_old += 1,
                Ok(game) => {
                    bytes += payload.len();
                    gathered += turns;
                    out.games.push(game);
                }
                // Only validated games are stored; this is another schema version.
                Err(_) => out.undecodable += 1,
            }
        }
        if popped_turns > 0 {
            let _: i64 = redis.decr(&self.keys.turns, popped_turns).await?;
        }
        if out.dropped_stale > 0 {
            let _: i64 = redis
                .hincr(&self.keys.stats, "dropped_stale_games", out.dropped_stale)
                .await?;
        }
        if out.dropped_old > 0 {
            let _: i64 = redis
                .hincr(&self.keys.stats, "dropped_too_old_games", out.dropped_old)
                .await?;
        }
        if !out.games.is_empty() {
            let _: i64 = redis
                .hincr(&self.keys.stats, "sampled_games", out.games.len() as u64)
                .await?;
        }
        Ok(out)
    }

    /// Learning turns held.
    pub async fn held_turns(&self) -> redis::RedisResult<u64> {
        let mut redis = self.redis.clone();
        let held: Option<u64> = redis.get(&self.keys.turns).await?;
        Ok(held.unwrap_or(0))
    }

    /// Games held.
    pub async fn held_games(&self) -> redis::RedisResult<u64> {
        let mut redis = self.redis.clone();
        redis.llen(&self.keys.games).await
    }
}
