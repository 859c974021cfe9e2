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

use relay_config::OffPolicyTable;
use relay_proto::{DType, ObsField, RolloutFragment, Tensor, TransitionBatch, SCHEMA_VERSION};
use thiserror::Error;

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

/// Sum-tree helpers shared by the scripts (`P` is ARGV[2] in each). Every
/// `redis.call` costs about a microsecond, so a script reads each node
/// once (cached in `nodes`), and `flush` recomputes each changed leaf's
/// ancestors once, a level at a time (a parent is the sum of its
/// children's final values, as when each leaf's path is walked in turn),
/// then writes each changed node once. A script that touches many leaves
/// (a round's priorities, a large prioritized sample: at least
/// `BULK_LEAVES`) first calls `bulk`: the whole tree comes with one `GET`
/// and goes back with one `SET`, assembled in index order (levels are
/// contiguous, root first, so each level's sorted nodes keep that order),
/// instead of tens of thousands of `GETRANGE`s and `SETRANGE`s. Small
/// scripts (an env-runner's insert) keep to single nodes: moving the
/// whole tree for them costs more than it saves.
const TREE_LUA: &str = r#"
local P = tonumber(ARGV[2])
local BULK_LEAVES = 512
local tree = nil
local nodes, dirty, leaves = {}, {}, {}
local function bulk(touched)
  if touched >= BULK_LEAVES then tree = redis.call('GET', KEYS[2]) or '' end
end
local function get(i)
  local v = nodes[i]
  if v == nil then
    if tree then
      if i * 8 + 8 > #tree then v = 0 else v = (struct.unpack('<d', tree, i * 8 + 1)) end
    else
      local s = redis.call('GETRANGE', KEYS[2], i * 8, i * 8 + 7)
      if #s < 8 then v = 0 else v = (struct.unpack('<d', s)) end
    end
    nodes[i] = v
  end
  return v
end
local function set_leaf(slot, v)
  local i = P + slot
  if not dirty[i] then
    dirty[i] = true
    leaves[#leaves + 1] = i
  end
  nodes[i] = v
end
local function flush()
  if #leaves == 0 then return end
  table.sort(leaves)
  local levels = {leaves}
  local level = leaves
  while level[1] > 1 do
    local up, last = {}, nil
    for _, i in ipairs(level) do
      local parent = math.floor(i / 2)
      if parent ~= last then
        nodes[parent] = get(2 * parent) + get(2 * parent + 1)
        up[#up + 1] = parent
        last = parent
      end
    end
    levels[#levels + 1] = up
    level = up
  end
  if not tree then
    for _, changed in ipairs(levels) do
      for _, i in ipairs(changed) do
        redis.call('SETRANGE', KEYS[2], i * 8, struct.pack('<d', nodes[i]))
      end
    end
    return
  end
  local size = 2 * P * 8
  if #tree < size then tree = tree .. string.rep('\0', size - #tree) end
  local pieces, pos = {}, 1
  for l = #levels, 1, -1 do
    for _, i in ipairs(levels[l]) do
      local at = i * 8 + 1
      if at > pos then pieces[#pieces + 1] = string.sub(tree, pos, at - 1) end
      pieces[#pieces + 1] = struct.pack('<d', nodes[i])
      pos = at + 8
    end
  end
  if pos <= size then pieces[#pieces + 1] = string.sub(tree, pos) end
  redis.call('SET', KEYS[2], table.concat(pieces))
end
local function num(field, default)
  return tonumber(redis.call('HGET', KEYS[3], field) or default)
end
"#;

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

/// KEYS: items, tree, meta, frames prefix. ARGV: capacity, P, batch,
/// prioritized (1/0), ratio ('' without limiter), min_size, min_diff,
/// uniforms... A row stored with plane indices comes back with its
/// planes' pixels after it (nil when its frames are gone).
/// Returns {size, next, inserted_steps, total (string), status,
/// [slot, leaf (string; "0" when uniform), payload]...}; status 1 sampled, 0 nothing held or
/// counters only (batch 0), -2 held back by the rate limiter.
const SAMPLE_LUA: &str = r#"
local cap = tonumber(ARGV[1])
local batch = tonumber(ARGV[3])
if ARGV[4] == '1' then bulk(batch) end
local nxt = num('next', '0')
local size = math.min(nxt, cap)
local inserted = num('inserted_steps', '0')
local total = get(1)
local head = {size, nxt, inserted, string.format('%.17g', total)}
if batch == 0 or size == 0 then
  head[5] = 0
  return head
end
if ARGV[5] ~= '' then
  local allowance = inserted * tonumber(ARGV[5]) - num('taken', '0') - tonumber(ARGV[7])
  if inserted < tonumber(ARGV[6]) or allowance < batch then
    redis.call('HINCRBY', KEYS[3], 'held_samples', 1)
    head[5] = -2
    return head
  end
end
head[5] = 1
local prioritized = ARGV[4] == '1'
local slots = {}
for j = 0, batch - 1 do
  local u = tonumber(ARGV[8 + j])
  local slot
  if prioritized and total > 0 then
    local mass = (j + u) * total / batch
    local i = 1
    while i < P do
      local left = get(2 * i)
      if mass < left then
        i = 2 * i
      else
        mass = mass - left
        i = 2 * i + 1
      end
    end
    slot = i - P
  else
    slot = math.floor(u * size)
  end
  if slot >= size then slot = size - 1 end
  slots[j + 1] = slot
end
-- One HMGET for the batch; leaves only where they weigh the sample.
local items = redis.call('HMGET', KEYS[1], unpack(slots))
for j = 1, batch do
  local item = items[j]
  if item and string.byte(item, 1) == 2 then
    local c = struct.unpack('<I2', item, 2)
    local plane = struct.unpack('<I4', item, 7)
    local offset = struct.unpack('<I4', item, 11)
    local last = nxt - 1
    local id = last - (last + cap - slots[j]) % cap
    local key = KEYS[4] .. (id - offset)
    local parts = {item}
    for i = 0, 2 * c - 1 do
      local index = struct.unpack('<I4', item, 15 + 4 * i)
      local pixels = redis.call('GETRANGE', key, index * plane, (index + 1) * plane - 1)
      if #pixels ~= plane then
        parts = nil
        break
      end
      parts[#parts + 1] = pixels
    end
    items[j] = parts and table.concat(parts) or false
  end
end
for j = 1, batch do
  table.insert(head, slots[j])
  table.insert(head, prioritized and string.format('%.17g', get(P + slots[j])) or '0')
  table.insert(head, items[j])
end
redis.call('HINCRBY', KEYS[3], 'taken', batch)
return head
"#;

/// KEYS: items, tree, meta. ARGV: capacity, P, alpha, then (id, priority)
/// pairs. Returns {updated, evicted}.
const PRIORITY_LUA: &str = r#"
local cap = tonumber(ARGV[1])
local alpha = tonumber(ARGV[3])
local nxt = num('next', '0')
local maxp = num('max_priority', '1')
local updated, evicted = 0, 0
bulk((#ARGV - 3) / 2)
for a = 4, #ARGV, 2 do
  local id = tonumber(ARGV[a])
  local p = tonumber(ARGV[a + 1])
  if id < nxt and id + cap >= nxt then
    set_leaf(id % cap, p ^ alpha)
    if p > maxp then maxp = p end
    updated = updated + 1
  else
    evicted = evicted + 1
  end
end
flush()
redis.call('HSET', KEYS[3], 'max_priority', string.format('%.17g', maxp))
redis.call('HINCRBY', KEYS[3], 'stale_priorities', evicted)
return {updated, evicted}
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

/// The two observations of a transition (`s_t` and `s_{t+k}`).
#[derive(Debug, Clone, PartialEq)]
pub enum Observations {
    /// f32 values.
    Values { obs: Vec<f32>, next_obs: Vec<f32> },
    /// As stored for image observations: the indices of their planes in
    /// the frames of the insert the transition came in, `offset` its
    /// position in that insert, `plane` the pixels of a plane.
    Planes {
        obs: Vec<u32>,
        next_obs: Vec<u32>,
        plane: u32,
        offset: u32,
    },
    /// As sampled for image observations: their pixels.
    Pixels { obs: Vec<u8>, next_obs: Vec<u8> },
}

/// One n-step transition (see the module docs).
#[derive(Debug, Clone, PartialEq)]
pub struct Transition {
    pub observations: Observations,
    /// Discrete action index, or the continuous action vector.
    pub action: Action,
    /// `R_t`, the discounted sum of the window's rewards.
    pub reward: f32,
    /// `γ^k`, 0 after a termination.
    pub discount: f32,
    pub terminated: bool,
    pub truncated: bool,
    /// Envs with action masks: the actions legal in the bootstrap
    /// observation (DQN's target maxes over those), 1 = legal.
    pub next_mask: Option<Vec<u8>>,
}

/// A stored action.
#[derive(Debug, Clone, PartialEq)]
pub enum Action {
    Discrete(i64),
    Continuous(Vec<f32>),
}

/// Stored with f32 observations.
const FORMAT_VALUES: u8 = 1;
/// Stored with plane indices (image observations stored once).
const FORMAT_PLANES: u8 = 2;

impl Transition {
    /// Little-endian bytes: format, then observation width `d` (values) or
    /// planes `C` (u16), action kind (u8: 0 discrete, 1 continuous, 2
    /// discrete with the bootstrap observation's action mask), action_dim
    /// (u16; kind 2: the mask's width), for planes the pixels of a plane
    /// and the offset in the insert (u32 each), the observations (`2d` f32
    /// or `2C` u32), action (kind 2: then the mask's bytes), reward,
    /// discount, terminated, truncated. Only stored forms (values, planes)
    /// encode.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(64);
        let (format, width) = match &self.observations {
            Observations::Values { obs, .. } => (FORMAT_VALUES, obs.len()),
            Observations::Planes { obs, .. } => (FORMAT_PLANES, obs.len()),
            Observations::Pixels { .. } => unreachable!("sampled rows are not stored"),
        };
        out.push(format);
        out.extend((width as u16).to_le_bytes());
        match (&self.action, &self.next_mask) {
            (Action::Discrete(_), Some(mask)) => {
                out.push(2);
                out.extend((mask.len() as u16).to_le_bytes());
            }
            (Action::Discrete(_), None) => {
                out.push(0);
                out.extend(1u16.to_le_bytes());
            }
            (Action::Continuous(a), _) => {
                out.push(1);
                out.extend((a.len() as u16).to_le_bytes());
            }
        }
        match &self.observations {
            Observations::Values { obs, next_obs } => {
                for x in obs.iter().chain(next_obs) {
                    out.extend(x.to_le_bytes());
                }
            }
            Observations::Planes {
                obs,
                next_obs,
                plane,
                offset,
            } => {
                out.extend(plane.to_le_bytes());
                out.extend(offset.to_le_bytes());
                for i in obs.iter().chain(next_obs) {
                    out.extend(i.to_le_bytes());
                }
            }
            Observations::Pixels { .. } => unreachable!(),
        }
        match &self.action {
            Action::Discrete(a) => out.extend(a.to_le_bytes()),
            Action::Continuous(a) => a.iter().for_each(|x| out.extend(x.to_le_bytes())),
        }
        if let (Action::Discrete(_), Some(mask)) = (&self.action, &self.next_mask) {
            out.extend_from_slice(mask);
        }
        out.extend(self.reward.to_le_bytes());
        out.extend(self.discount.to_le_bytes());
        out.push(self.terminated as u8);
        out.push(self.truncated as u8);
        out
    }

    /// The inverse of [`Transition::encode`]; a planes row followed by its
    /// planes' pixels (as the sample script returns it) decodes to
    /// [`Observations::Pixels`]. `None` on any mismatch.
    pub fn decode(bytes: &[u8]) -> Option<Self> {
        if bytes.len() < 6 {
            return None;
        }
        let format = bytes[0];
        let width = u16::from_le_bytes([bytes[1], bytes[2]]) as usize;
        let kind = bytes[3];
        let ad = u16::from_le_bytes([bytes[4], bytes[5]]) as usize;
        let action_bytes = match kind {
            0 => 8,
            1 => 4 * ad,
            2 => 8 + ad,
            _ => return None,
        };
        let u32_at = |o: usize| u32::from_le_bytes(bytes[o..o + 4].try_into().unwrap());
        let f32_at = |o: usize| f32::from_le_bytes(bytes[o..o + 4].try_into().unwrap());
        let tail = action_bytes + 10;
        let (observations, mut o) = match format {
            FORMAT_VALUES => {
                if bytes.len() != 6 + 8 * width + tail {
                    return None;
                }
                let obs = (0..width).map(|i| f32_at(6 + 4 * i)).collect();
                let next_obs = (0..width).map(|i| f32_at(6 + 4 * (width + i))).collect();
                (Observations::Values { obs, next_obs }, 6 + 8 * width)
            }
            FORMAT_PLANES => {
                if bytes.len() < 14 + 8 * width + tail {
                    return None;
                }
                let (plane, offset) = (u32_at(6), u32_at(10));
                let stored = 14 + 8 * width + tail;
                let observations = if bytes.len() == stored {
                    Observations::Planes {
                        obs: (0..width).map(|i| u32_at(14 + 4 * i)).collect(),
                        next_obs: (0..width).map(|i| u32_at(14 + 4 * (width + i))).collect(),
                        plane,
                        offset,
                    }
                } else {
                    let half = width * plane as usize;
                    if bytes.len() != stored + 2 * half {
                        return None;
                    }
                    Observations::Pixels {
                        obs: bytes[stored..stored + half].to_vec(),
                        next_obs: bytes[stored + half..].to_vec(),
                    }
                };
                (observations, 14 + 8 * width)
            }
            _ => return None,
        };
        let action = if kind == 1 {
            Action::Continuous((0..ad).map(|i| f32_at(o + 4 * i)).collect())
        } else {
            Action::Discrete(i64::from_le_bytes(bytes[o..o + 8].try_into().unwrap()))
        };
        let next_mask = (kind == 2).then(|| bytes[o + 8..o + 8 + ad].to_vec());
        o += action_bytes;
        Some(Self {
            observations,
            action,
            reward: f32_at(o),
            discount: f32_at(o + 4),
            terminated: bytes[o + 8] != 0,
            truncated: bytes[o + 9] != 0,
            next_mask,
        })
    }
}

/// A fragment's observations as the table stores them: f32 rows, or
/// plane-index rows when the fragment stores frames once.
enum Rows {
    Values {
        obs: Vec<f32>,
        next_obs: Vec<f32>,
        final_obs: Vec<f32>,
        width: usize,
    },
    Planes {
        obs: Vec<u32>,
        next_obs: Vec<u32>,
        final_obs: Vec<u32>,
        width: usize,
        plane: u32,
    },
}

/// One row of a [`Rows`]' field.
enum Row<'a> {
    Values(&'a [f32]),
    Planes(&'a [u32]),
}

impl Rows {
    fn of(f: &RolloutFragment) -> Result<Self, TableError> {
        let tensor = |field: &'static str, e: relay_proto::TensorError| bad(field, e.to_string());
        Ok(match &f.frames {
            None => Self::Values {
                obs: f
                    .observations(ObsField::Obs)
                    .map_err(|e| tensor("obs", e))?,
                next_obs: f
                    .observations(ObsField::Next)
                    .map_err(|e| tensor("next_obs", e))?,
                final_obs: f
                    .observations(ObsField::Final)
                    .map_err(|e| tensor("final_obs", e))?,
                width: f.obs_dim(),
            },
            Some(frames) => Self::Planes {
                obs: f.obs.to_u32().map_err(|e| tensor("obs", e))?,
                next_obs: f.next_obs.to_u32().map_err(|e| tensor("next_obs", e))?,
                final_obs: f.final_obs.to_u32().map_err(|e| tensor("final_obs", e))?,
                width: f.obs.shape[2] as usize,
                plane: frames.shape[1],
            },
        })
    }

    /// Row `i` of `field`.
    fn row(&self, field: ObsField, i: usize) -> Row<'_> {
        /// Row `i` of the array of `field`, whatever its element type.
        fn pick<T>(field: ObsField, [obs, next, last]: [&[T]; 3], i: usize, width: usize) -> &[T] {
            let all = match field {
                ObsField::Obs => obs,
                ObsField::Next => next,
                ObsField::Final => last,
            };
            &all[i * width..(i + 1) * width]
        }
        match self {
            Self::Values {
                obs,
                next_obs,
                final_obs,
                width,
            } => Row::Values(pick(field, [obs, next_obs, final_obs], i, *width)),
            Self::Planes {
                obs,
                next_obs,
                final_obs,
                width,
                ..
            } => Row::Planes(pick(field, [obs, next_obs, final_obs], i, *width)),
        }
    }

    /// The observations of a transition from `obs` to `next`; `offset`
    /// its position in the insert.
    fn observations(&self, obs: Row, next: Row, offset: usize) -> Observations {
        match (obs, next, self) {
            (Row::Values(o), Row::Values(n), _) => Observations::Values {
                obs: o.to_vec(),
                next_obs: n.to_vec(),
            },
            (Row::Planes(o), Row::Planes(n), Self::Planes { plane, .. }) => Observations::Planes {
                obs: o.to_vec(),
                next_obs: n.to_vec(),
                plane: *plane,
                offset: offset as u32,
            },
            _ => unreachable!("rows of one fragment are of one kind"),
        }
    }
}

/// The `T x N` n-step transitions of a validated fragment, in `(t, env)`
/// order (see the module docs).
pub fn fragment_transitions(
    f: &RolloutFragment,
    n_steps: usize,
    gamma: f64,
) -> Result<Vec<Transition>, TableError> {
    let (t_len, n) = (f.num_steps as usize, f.num_envs as usize);
    let tensor = |field: &'static str, e: relay_proto::TensorError| bad(field, e.to_string());
    let rows = Rows::of(f)?;
    let rewards = f.rewards.to_f32().map_err(|e| tensor("rewards", e))?;
    let terminated = f
        .terminated
        .to_bool()
        .map_err(|e| tensor("terminated", e))?;
    let truncated = f.truncated.to_bool().map_err(|e| tensor("truncated", e))?;
    let actions: Vec<Action> = match f.actions.dtype {
        DType::I64 => f
            .actions
            .to_i64()
            .map_err(|e| tensor("actions", e))?
            .into_iter()
            .map(Action::Discrete)
            .collect(),
        _ => {
            let a = f.actions.to_f32().map_err(|e| tensor("actions", e))?;
            let ad = a.len() / (t_len * n).max(1);
            a.chunks(ad.max(1))
                .map(|c| Action::Continuous(c.to_vec()))
                .collect()
        }
    };
    // Row (t, env) of the observation after step t: the next step's
    // observation, the final observation of a truncation (the vector env
    // resets in the same step), or the fragment's `next_obs` at its end.
    let mut final_rows = vec![None; t_len * n];
    let mut k = 0;
    for i in 0..t_len * n {
        if truncated[i] && !terminated[i] {
            final_rows[i] = Some(k);
            k += 1;
        }
    }
    // The masks of those observations, for envs with masks.
    let masks = f.masks.as_ref().map(|m| {
        let w = *m.obs.shape.last().expect("validated") as usize;
        (w, m)
    });
    let mask_after = |t: usize, e: usize| -> Option<Vec<u8>> {
        let (w, m) = masks?;
        let i = t * n + e;
        let (all, row) = if let Some(k) = final_rows[i] {
            (&m.final_obs.data, k)
        } else if t + 1 < t_len {
            (&m.obs.data, (t + 1) * n + e)
        } else {
            (&m.next_obs.data, e)
        };
        Some(all[row * w..(row + 1) * w].to_vec())
    };
    let after = |t: usize, e: usize| -> Row<'_> {
        let i = t * n + e;
        if let Some(k) = final_rows[i] {
            rows.row(ObsField::Final, k)
        } else if t + 1 < t_len {
            rows.row(ObsField::Obs, (t + 1) * n + e)
        } else {
            rows.row(ObsField::Next, e)
        }
    };
    let mut out = vec![None; t_len * n];
    for e in 0..n {
        let col = |v: &[bool]| (0..t_len).map(|t| v[t * n + e]).collect::<Vec<_>>();
        let r: Vec<f32> = (0..t_len).map(|t| rewards[t * n + e]).collect();
        let (term, trunc) = (col(&terminated), col(&truncated));
        let nstep = relay_nn::n_step_returns(&r, &term, &trunc, n_steps, gamma as f32)
            .map_err(|e| bad("n_steps", e.to_string()))?;
        for t in 0..t_len {
            let last = nstep.next_index[t];
            let at = t * n + e;
            out[at] = Some(Transition {
                observations: rows.observations(rows.row(ObsField::Obs, at), after(last, e), at),
                action: actions[at].clone(),
                reward: nstep.returns[t],
                discount: nstep.discounts[t],
                terminated: term[last],
                truncated: trunc[last],
                next_mask: mask_after(last, e),
            });
        }
    }
    Ok(out
        .into_iter()
        .map(|t| t.expect("every row filled"))
        .collect())
}

/// Importance-sampling weights of prioritized replay: `w_i = (size ·
/// P(i))^-β`, divided by the batch's largest. `probs` are `P(i)`.
pub fn importance_weights(probs: &[f64], size: u64, beta: f64) -> Vec<f32> {
    importance_weights_scaled(probs, size, beta).0
}

/// [`importance_weights`] with the largest raw weight they were divided by
/// (the batch's `weight_scale`).
fn importance_weights_scaled(probs: &[f64], size: u64, beta: f64) -> (Vec<f32>, f64) {
    let raw: Vec<f64> = probs
        .iter()
        .map(|&p| (size as f64 * p).powf(-beta))
        .collect();
    let max = raw.iter().cloned().fold(0.0, f64::max);
    let weights = raw
        .iter()
        .map(|&w| if max > 0.0 { (w / max) as f32 } else { 1.0 })
        .collect();
    (weights, max)
}

/// The sum tree's leaf count: the smallest power of two >= `capacity`.
pub fn tree_leaves(capacity: u64) -> u64 {
    capacity.max(1).next_power_of_two()
}

/// Insert sequence number of the transition held in `slot` when `next`
/// were ever inserted.
pub fn id_of_slot(slot: u64, next: u64, capacity: u64) -> u64 {
    let last = next - 1;
    last - (last + capacity - slot) % capacity
}

/// Outcome of a table insert.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TableInserted {
    Stored { size: u64, evicted: u64 },
    RateLimited { size: u64 },
}

/// What a sample returned: a batch (possibly empty) and why.
#[derive(Debug)]
pub struct TableSample {
    pub batch: TransitionBatch,
    /// Held back by the rate limiter.
    pub held: bool,
    /// Rows that did not decode (dropped from the batch).
    pub corrupt: u64,
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

    /// Draws `batch` transitions (`uniforms`: `batch` numbers in `[0, 1)`).
    pub async fn sample(
        &self,
        batch: usize,
        beta: f64,
        uniforms: &[f64],
    ) -> Result<TableSample, TableError> {
        assert_eq!(uniforms.len(), batch, "one uniform per row");
        let mut redis = self.redis.clone();
        let mut inv = self.script(&self.sample);
        inv.arg(batch)
            .arg(if self.table.prioritized { "1" } else { "0" })
            .arg(
                self.rate_limit
                    .map_or(String::new(), |r| r.samples_per_insert.to_string()),
            )
            .arg(self.rate_limit.map_or(0, |r| r.min_size_to_sample))
            .arg(self.rate_limit.map_or(0.0, |r| r.min_diff()));
        for u in uniforms {
            inv.arg(u);
        }
        let reply: Vec<redis::Value> = inv.invoke_async(&mut redis).await?;
        let int = |v: &redis::Value| -> Result<i64, TableError> {
            redis::from_redis_value::<i64>(v.clone()).map_err(TableError::from)
        };
        let float = |v: &redis::Value| -> Result<f64, TableError> {
            let s: String = redis::from_redis_value(v.clone())?;
            s.parse::<f64>().map_err(|e| TableError::Corrupt {
                slot: 0,
                detail: format!("priority {s:?}: {e}"),
            })
        };
        if reply.len() < 5 {
            return Err(TableError::Corrupt {
                slot: 0,
                detail: format!("sample script returned {} values", reply.len()),
            });
        }
        let size = int(&reply[0])? as u64;
        let next = int(&reply[1])? as u64;
        let inserted_steps = int(&reply[2])? as u64;
        let total = float(&reply[3])?;
        let status = int(&reply[4])?;
        let mut rows: Vec<(u64, Transition)> = Vec::new();
        let mut probs = Vec::new();
        let mut corrupt = 0;
        for row in reply[5..].chunks_exact(3) {
            let slot = int(&row[0])? as u64;
            let leaf = float(&row[1])?;
            let payload: Option<Vec<u8>> = redis::from_redis_value(row[2].clone())?;
            match payload.as_deref().and_then(Transition::decode) {
                Some(t) => {
                    rows.push((id_of_slot(slot, next, self.table.capacity), t));
                    probs.push(if total > 0.0 { leaf / total } else { 0.0 });
                }
                None => corrupt += 1,
            }
        }
        let (weights, weight_scale) = if self.table.prioritized {
            let (weights, scale) = importance_weights_scaled(&probs, size, beta);
            (weights, Some(scale))
        } else {
            (vec![1.0; rows.len()], None)
        };
        let mut batch = build_batch(rows, weights, size, inserted_steps);
        batch.weight_scale = weight_scale;
        Ok(TableSample {
            batch,
            held: status == -2,
            corrupt,
        })
    }

    /// Sets the priorities of `ids` (already validated: finite, > 0).
    pub async fn update_priorities(
        &self,
        ids: &[u64],
        priorities: &[f32],
    ) -> Result<(u64, u64), TableError> {
        let mut redis = self.redis.clone();
        let mut inv = self.script(&self.priorities);
        inv.arg(self.table.alpha);
        for (id, p) in ids.iter().zip(priorities) {
            inv.arg(id).arg(*p as f64);
        }
        let (updated, evicted): (u64, u64) = inv.invoke_async(&mut redis).await?;
        Ok((updated, evicted))
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

/// Stacks transitions (all of one shape: the table only holds this run's)
/// into a [`TransitionBatch`].
fn build_batch(
    rows: Vec<(u64, Transition)>,
    weights: Vec<f32>,
    size: u64,
    inserted_steps: u64,
) -> TransitionBatch {
    let b = rows.len();
    let (mut values, mut next_values) = (Vec::new(), Vec::new());
    let (mut pixels, mut next_pixels) = (Vec::new(), Vec::new());
    let (mut discrete, mut continuous) = (Vec::new(), Vec::new());
    let mut ad = 0;
    let (mut rewards, mut discounts, mut term, mut trunc, mut ids) =
        (vec![], vec![], vec![], vec![], vec![]);
    // Rows of envs with masks; rows without (inserted with masking off)
    // allow every action.
    let mask_width = rows
        .iter()
        .find_map(|(_, t)| t.next_mask.as_ref().map(Vec::len));
    let mut next_masks = Vec::new();
    for (id, t) in rows {
        ids.push(id);
        if let Some(w) = mask_width {
            match &t.next_mask {
                Some(m) if m.len() == w => next_masks.extend_from_slice(m),
                _ => next_masks.resize(next_masks.len() + w, 1),
            }
        }
        match t.observations {
            Observations::Values { obs, next_obs } => {
                values.extend(obs);
                next_values.extend(next_obs);
            }
            Observations::Pixels { obs, next_obs } => {
                pixels.extend(obs);
                next_pixels.extend(next_obs);
            }
            Observations::Planes { .. } => unreachable!("samples return pixels"),
        }
        match t.action {
            Action::Discrete(a) => discrete.push(a),
            Action::Continuous(a) => {
                ad = a.len();
                continuous.extend(a);
            }
        }
        rewards.push(t.reward);
        discounts.push(t.discount);
        term.push(t.terminated);
        trunc.push(t.truncated);
    }
    let actions = if continuous.is_empty() {
        Tensor::from_i64(&[b], &discrete)
    } else {
        Tensor::from_f32(&[b, ad], &continuous)
    };
    // One table holds one run's transitions: all values or all pixels.
    let (obs, next_obs) = if pixels.is_empty() {
        let d = values.len() / b.max(1);
        (
            Tensor::from_f32(&[b, d], &values),
            Tensor::from_f32(&[b, d], &next_values),
        )
    } else {
        let d = pixels.len() / b;
        (
            Tensor::from_u8(&[b, d], &pixels),
            Tensor::from_u8(&[b, d], &next_pixels),
        )
    };
    TransitionBatch {
        schema: SCHEMA_VERSION,
        ids,
        obs,
        actions,
        rewards: Tensor::from_f32(&[b], &rewards),
        next_obs,
        discounts: Tensor::from_f32(&[b], &discounts),
        terminated: Tensor::from_bool(&[b], &term),
        truncated: Tensor::from_bool(&[b], &trunc),
        weights: Tensor::from_f32(&[b], &weights),
        weight_scale: None,
        size,
        inserted_steps,
        next_masks: mask_width.map(|w| Tensor::from_u8(&[b, w], &next_masks)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The bootstrap observation of a transition of f32 values.
    fn next_values(t: &Transition) -> Vec<f32> {
        match &t.observations {
            Observations::Values { next_obs, .. } => next_obs.clone(),
            other => panic!("not values: {other:?}"),
        }
    }

    fn fragment(t: usize, n: usize) -> RolloutFragment {
        // obs[t, e] = [10 t + e, -1]; reward of (t, e) = t + 1.
        let obs: Vec<f32> = (0..t * n)
            .flat_map(|i| [(10 * (i / n) + i % n) as f32, -1.0])
            .collect();
        let rewards: Vec<f32> = (0..t * n).map(|i| (i / n + 1) as f32).collect();
        RolloutFragment {
            schema: SCHEMA_VERSION,
            runner_id: "r".into(),
            env_id: "CartPole-v1".into(),
            policy_version: 0,
            num_steps: t as u32,
            num_envs: n as u32,
            obs: Tensor::from_f32(&[t, n, 2], &obs),
            actions: Tensor::from_i64(&[t, n], &(0..(t * n) as i64).collect::<Vec<_>>()),
            logprobs: Tensor::from_f32(&[t, n], &vec![0.0; t * n]),
            values: Tensor::from_f32(&[t, n], &vec![0.0; t * n]),
            rewards: Tensor::from_f32(&[t, n], &rewards),
            terminated: Tensor::from_bool(&[t, n], &vec![false; t * n]),
            truncated: Tensor::from_bool(&[t, n], &vec![false; t * n]),
            next_obs: Tensor::from_f32(&[n, 2], &vec![99.0; n * 2]),
            final_obs: Tensor::from_f32(&[0, 2], &[]),
            norm_rewards: None,
            norm_delta: None,
            masks: None,
            frames: None,
            initial_state: None,
        }
    }

    #[test]
    fn transitions_bootstrap_through_truncation_not_termination() {
        // 4 steps, 2 envs. Env 0 terminates at t=1; env 1 is truncated at
        // t=1 (final obs [7, 7]).
        let mut f = fragment(4, 2);
        let mut term = vec![false; 8];
        let mut trunc = vec![false; 8];
        term[2] = true; // (t=1, e=0)
        trunc[3] = true; // (t=1, e=1)
        f.terminated = Tensor::from_bool(&[4, 2], &term);
        f.truncated = Tensor::from_bool(&[4, 2], &trunc);
        f.final_obs = Tensor::from_f32(&[1, 2], &[7.0, 7.0]);
        let g = 0.5;
        let tr = fragment_transitions(&f, 2, g).unwrap();
        assert_eq!(tr.len(), 8);
        let at = |t: usize, e: usize| &tr[t * 2 + e];
        // (0, 0): window t=0..1, ends with a termination: no bootstrap.
        assert_eq!(at(0, 0).reward, 1.0 + 0.5 * 2.0);
        assert_eq!(at(0, 0).discount, 0.0);
        assert!(at(0, 0).terminated);
        // (0, 1): same rewards, ends with a truncation: bootstrap from the
        // final observation with γ^2.
        assert_eq!(at(0, 1).reward, 2.0);
        assert_eq!(at(0, 1).discount, 0.25);
        assert_eq!(next_values(at(0, 1)), vec![7.0, 7.0]);
        assert!(at(0, 1).truncated && !at(0, 1).terminated);
        // (1, 1): one step, truncated: γ^1 from the final obs.
        assert_eq!((at(1, 1).reward, at(1, 1).discount), (2.0, 0.5));
        assert_eq!(next_values(at(1, 1)), vec![7.0, 7.0]);
        // (2, 0): a full 2-step window, bootstrap from obs[t=4] = next_obs.
        assert_eq!(
            (at(2, 0).reward, at(2, 0).discount),
            (3.0 + 0.5 * 4.0, 0.25)
        );
        assert_eq!(next_values(at(2, 0)), vec![99.0, 99.0]);
        // (1, 0) ... (2, 1): next obs of a mid-fragment step is the next row.
        let one = fragment_transitions(&f, 1, g).unwrap();
        assert_eq!(next_values(&one[0]), vec![10.0, -1.0]);
        assert_eq!(one[0].discount, 0.5);
        // (3, e): the fragment's tail bootstraps from next_obs, 1 step.
        assert_eq!((at(3, 0).reward, at(3, 0).discount), (4.0, 0.5));
        assert_eq!(at(3, 0).action, Action::Discrete(6));
        for t in &tr {
            assert_eq!(Transition::decode(&t.encode()).as_ref(), Some(t));
        }
        let cont = Transition {
            action: Action::Continuous(vec![0.5, -0.25]),
            ..tr[0].clone()
        };
        assert_eq!(Transition::decode(&cont.encode()), Some(cont.clone()));
        assert_eq!(Transition::decode(&cont.encode()[..10]), None);
    }

    /// Each transition keeps the mask of its bootstrap observation: the
    /// next row's, a truncation's final one, or the tail's; it survives the
    /// stored bytes, and a batch of rows with and without masks allows every
    /// action in the latter.
    #[test]
    fn transitions_keep_the_mask_of_their_bootstrap_observation() {
        let mut f = fragment(3, 2);
        let mut trunc = vec![false; 6];
        trunc[1] = true; // (t=0, e=1)
        f.truncated = Tensor::from_bool(&[3, 2], &trunc);
        f.final_obs = Tensor::from_f32(&[1, 2], &[7.0, 7.0]);
        f.actions = Tensor::from_i64(&[3, 2], &[0, 1, 2, 0, 1, 2]);
        // 3 actions; row (t, e) allows its own action and action 2.
        let obs_masks = [1, 0, 1, 0, 1, 1, 0, 0, 1, 1, 0, 1, 0, 1, 1, 0, 0, 1];
        f.masks = Some(relay_proto::FragmentMasks {
            obs: Tensor::from_u8(&[3, 2, 3], &obs_masks),
            next_obs: Tensor::from_u8(&[2, 3], &[1, 1, 0, 0, 1, 0]),
            final_obs: Tensor::from_u8(&[1, 3], &[0, 0, 1]),
        });
        let tr = fragment_transitions(&f, 1, 0.9).unwrap();
        let mask = |i: usize| tr[i].next_mask.clone().unwrap();
        assert_eq!(mask(0), obs_masks[6..9], "(0, 0): the next row's, (1, 0)");
        assert_eq!(mask(1), [0, 0, 1], "(0, 1): the truncation's final mask");
        assert_eq!(mask(4), [1, 1, 0], "(2, 0): the tail's");
        assert_eq!(mask(5), [0, 1, 0]);
        for t in &tr {
            assert_eq!(Transition::decode(&t.encode()).as_ref(), Some(t));
        }
        let unmasked = Transition {
            next_mask: None,
            ..tr[0].clone()
        };
        let rows: Vec<(u64, Transition)> = vec![(0, tr[1].clone()), (1, unmasked)];
        let batch = build_batch(rows, vec![1.0; 2], 2, 2);
        assert_eq!(batch.next_masks.unwrap().data, [0, 0, 1, 1, 1, 1]);
    }

    #[test]
    fn importance_weights_follow_the_formula() {
        // Probabilities 0.5, 0.25, 0.25 of 4 held, β = 0.5:
        // w = (4 p)^-0.5 = [1/√2, 1, 1], normalised by 1.
        let w = importance_weights(&[0.5, 0.25, 0.25], 4, 0.5);
        assert!((w[0] - 0.5f32.sqrt()).abs() < 1e-6 && w[1] == 1.0 && w[2] == 1.0);
        // β = 0: uniform weights; β = 1 fully compensates: w ∝ 1/p.
        assert!(importance_weights(&[0.9, 0.1], 2, 0.0)
            .iter()
            .all(|&w| w == 1.0));
        let w = importance_weights(&[0.8, 0.2], 2, 1.0);
        assert!((w[0] - 0.25).abs() < 1e-6 && w[1] == 1.0);
    }

    #[test]
    fn ring_slots_map_back_to_ids() {
        assert_eq!(tree_leaves(100_000), 131_072);
        assert_eq!(tree_leaves(8), 8);
        // Capacity 4, 6 inserted: slots 0, 1 hold ids 4, 5; slots 2, 3 ids 2, 3.
        assert_eq!(
            (0..4).map(|s| id_of_slot(s, 6, 4)).collect::<Vec<_>>(),
            vec![4, 5, 2, 3]
        );
        assert_eq!(id_of_slot(1, 2, 4), 1);
    }
}
