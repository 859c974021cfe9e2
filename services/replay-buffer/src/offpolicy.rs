//! The off-policy table (`run.algo: dqn`): transitions in Redis with FIFO
//! eviction, uniform or prioritized sampling, priority updates, and the
//! sample-to-insert rate limiter.
//!
//! # What a transition is
//!
//! Each inserted [`RolloutFragment`] (`T` steps of `N` envs) becomes `T x N`
//! transitions at insert ([`fragment_transitions`]). The n-step return is
//! computed there, per env over the fragment's consecutive steps, with
//! [`relay_nn::n_step_returns`]: transition `t` stores `s_t`, `a_t`, `R_t =
//! Σ_{i<k} γ^i r_{t+i}`, the bootstrap observation `s_{t+k}` and the
//! discount `γ^k`, where the window of `k <= n` steps stops at the episode's
//! end: 0 after a termination (no bootstrap), `γ^k` with the final
//! observation after a time-limit truncation (bootstrap through it, as SB3's
//! `handle_timeout_termination`). A window that reaches the fragment's end
//! before `n` steps bootstraps there from the fragment's `next_obs` with
//! its own `γ^k` (a shorter, still correct, target); with `n = 1` (SB3's
//! DQN) every target is exact. Fields stay generic (continuous actions,
//! `terminated` and `truncated` of the window's last step) for SAC.
//!
//! # Redis layout (all state in Redis: any number of copies)
//!
//! Keys under `relay:<run>:offpolicy:`: `items` (hash: slot → encoded
//! transition), `frames:<id>` and `blocks` (image observations, below),
//! `tree` (a string of `2P` little-endian f64: a sum tree
//! over the `P >= capacity` slots (a power of two), node `i` at byte `8i`,
//! leaves at `P + slot` hold `p^α`), `meta` (hash: `next`, the number of
//! transitions ever inserted; `max_priority`; `inserted_steps`, `taken`
//! (transitions sampled), refusal counters). Transition number `id` lives
//! in slot `id % capacity` (a ring: the oldest is overwritten first, FIFO
//! eviction) and is still held while `id >= next - capacity`. Every
//! operation is one Lua script, so copies never interleave inside one.
//! Random numbers come from the caller (`ARGV`), not from Lua.
//!
//! # Image observations, stored once
//! A fragment whose observations are stored as frames (see
//! [`RolloutFragment::frames`]) keeps them so in the table: its frames go
//! into one string `frames:<id>`, `id` the number of the insert's first
//! transition, and each of its transitions holds the plane indices of
//! its observation and bootstrap observation in it (with its position in
//! the insert, which leads back to `id`). A frame of Atari's 4-frame
//! stacks is then stored about once, not 8 times (4 in the observation, 4
//! in the next one), and as a byte, not an f32: 7 kB a transition instead
//! of 226 kB. `blocks` lists the inserts' `id:last-id`, oldest first; an
//! insert deletes the frames whose transitions were all evicted. The
//! sample script reads each sampled row's planes with `GETRANGE` and
//! returns them after the row, so the learner gets the pixels (uint8)
//! and the frames never leave Redis otherwise.
//!
//! # Sampling
//!
//! Uniform: slot `⌊u · size⌋`. Prioritized (proportional, Schaul et al.
//! 2016): the total mass is split in `B` equal segments and one point is
//! drawn in each (stratified, as OpenAI baselines), each found by walking
//! the sum tree; `P(i) = p_i^α / Σ p^α`. Importance weights
//! `w_i = (size · P(i))^-β`, normalised by the batch's largest weight
//! ([`importance_weights`]; baselines normalises by the buffer's smallest
//! probability instead, which needs a second, min, tree). New transitions
//! get the largest priority ever set (1 at first). A priority update for an
//! id that was evicted since it was sampled is skipped and counted.

mod sample;
mod transition;
mod tree;

use relay_config::OffPolicyTable;
use relay_proto::RolloutFragment;
use thiserror::Error;

pub use sample::{importance_weights, TableSample};
pub use transition::{fragment_transitions, Action, Observations, Transition};
pub use tree::{id_of_slot, tree_leaves};

use sample::{PRIORITY_LUA, SAMPLE_LUA};
use tree::TREE_LUA;

/// Redis key names of one run's off-policy table.
#[derive(Clone, Debug)]
pub struct TableKeys {
    pub items: String,
    pub tree: String,
    pub meta: String,
    /// Prefix of the frames of one insert: `frames:<first id>`.
    pub frames: String,
    pub blocks: String,
}

impl TableKeys {
    pub fn new(run_id: &str) -> Self {
        let base = format!("relay:{run_id}:offpolicy");
        Self {
            items: format!("{base}:items"),
            tree: format!("{base}:tree"),
            meta: format!("{base}:meta"),
            frames: format!("{base}:frames:"),
            blocks: format!("{base}:blocks"),
        }
    }
}

/// KEYS: items, tree, meta, frames prefix, blocks. ARGV: capacity, P,
/// alpha, ratio ('' without limiter), max_diff, env_steps, frames (''
/// without), min_size_to_sample (below it inserts are never held back:
/// sampling waits for them), payloads... Returns {status, size,
/// evicted}: status 1 stored, -2 rate-limited.
const INSERT_LUA: &str = r#"
local cap = tonumber(ARGV[1])
local alpha = tonumber(ARGV[3])
local steps = tonumber(ARGV[6])
local nxt = num('next', '0')
if ARGV[4] ~= '' then
  local ratio = tonumber(ARGV[4])
  local inserted = num('inserted_steps', '0')
  if inserted >= tonumber(ARGV[8]) and (inserted + steps) * ratio - num('taken', '0') > tonumber(ARGV[5]) then
    redis.call('HINCRBY', KEYS[3], 'refused_rate', 1)
    return {-2, math.min(nxt, cap), 0}
  end
end
local leaf = num('max_priority', '1') ^ alpha
local evicted = 0
local first = nxt
bulk(#ARGV - 8)
for a = 9, #ARGV do
  local slot = nxt % cap
  if nxt >= cap then evicted = evicted + 1 end
  redis.call('HSET', KEYS[1], slot, ARGV[a])
  set_leaf(slot, leaf)
  nxt = nxt + 1
end
flush()
if ARGV[7] ~= '' then
  redis.call('SET', KEYS[4] .. first, ARGV[7])
  redis.call('RPUSH', KEYS[5], first .. ':' .. (nxt - 1))
end
-- Frames whose transitions were all evicted go.
while true do
  local head = redis.call('LINDEX', KEYS[5], 0)
  if not head then break end
  local f, l = string.match(head, '(%d+):(%d+)')
  if tonumber(l) >= nxt - cap then break end
  redis.call('DEL', KEYS[4] .. f)
  redis.call('LPOP', KEYS[5])
end
redis.call('HSET', KEYS[3], 'next', nxt)
redis.call('HINCRBY', KEYS[3], 'inserted_steps', steps)
redis.call('HINCRBY', KEYS[3], 'evicted', evicted)
return {1, math.min(nxt, cap), evicted}
"#;

/// Errors of the off-policy table.
#[derive(Debug, Error)]
pub enum TableError {
    #[error("redis: {0}")]
    Redis(#[from] redis::RedisError),
    #[error("redis reply: {0}")]
    Parse(#[from] redis::ParsingError),
    /// The fragment does not fit this run (wrong env, observation size).
    #[error("{field}: {detail}")]
    BadInput { field: &'static str, detail: String },
    /// A stored transition does not decode (written by another version).
    #[error("stored transition in slot {slot} does not decode: {detail}")]
    Corrupt { slot: u64, detail: String },
}

fn bad(field: &'static str, detail: impl Into<String>) -> TableError {
    TableError::BadInput {
        field,
        detail: detail.into(),
    }
}

/// Outcome of a table insert.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TableInserted {
    Stored { size: u64, evicted: u64 },
    RateLimited { size: u64 },
}

/// The off-policy table of one run, over a Redis connection.
#[derive(Clone)]
pub struct Table {
    redis: redis::aio::ConnectionManager,
    keys: TableKeys,
    table: OffPolicyTable,
    rate_limit: Option<crate::RateLimit>,
    insert: redis::Script,
    sample: redis::Script,
    priorities: redis::Script,
}

impl Table {
    pub fn new(
        redis: redis::aio::ConnectionManager,
        run_id: &str,
        table: OffPolicyTable,
        rate_limit: Option<crate::RateLimit>,
    ) -> Self {
        Self {
            redis,
            keys: TableKeys::new(run_id),
            table,
            rate_limit,
            insert: redis::Script::new(&format!("{TREE_LUA}{INSERT_LUA}")),
            sample: redis::Script::new(&format!("{TREE_LUA}{SAMPLE_LUA}")),
            priorities: redis::Script::new(&format!("{TREE_LUA}{PRIORITY_LUA}")),
        }
    }

    fn script<'a>(&self, script: &'a redis::Script) -> redis::ScriptInvocation<'a> {
        let mut inv = script.key(&self.keys.items);
        inv.key(&self.keys.tree)
            .key(&self.keys.meta)
            .key(&self.keys.frames)
            .key(&self.keys.blocks)
            .arg(self.table.capacity)
            .arg(tree_leaves(self.table.capacity));
        inv
    }

    /// Inserts a validated fragment as transitions.
    pub async fn insert(&self, fragment: &RolloutFragment) -> Result<TableInserted, TableError> {
        let transitions = fragment_transitions(fragment, self.table.n_steps, self.table.gamma)?;
        let mut redis = self.redis.clone();
        let mut inv = self.script(&self.insert);
        inv.arg(self.table.alpha)
            .arg(
                self.rate_limit
                    .map_or(String::new(), |r| r.samples_per_insert.to_string()),
            )
            .arg(
                self.rate_limit
                    .map_or(String::new(), |r| r.max_diff().to_string()),
            )
            .arg(fragment.env_steps())
            .arg(fragment.frames.as_ref().map_or(&[][..], |f| &f.data[..]))
            .arg(self.rate_limit.map_or(0, |r| r.min_size_to_sample));
        for t in &transitions {
            inv.arg(t.encode());
        }
        let (status, size, evicted): (i64, u64, u64) = inv.invoke_async(&mut redis).await?;
        Ok(if status == 1 {
            TableInserted::Stored { size, evicted }
        } else {
            TableInserted::RateLimited { size }
        })
    }

    /// Transitions held.
    pub async fn size(&self) -> Result<u64, TableError> {
        let mut redis = self.redis.clone();
        let next: Option<u64> = redis::cmd("HGET")
            .arg(&self.keys.meta)
            .arg("next")
            .query_async(&mut redis)
            .await?;
        Ok(next.unwrap_or(0).min(self.table.capacity))
    }
}

#[cfg(test)]
mod tests;
