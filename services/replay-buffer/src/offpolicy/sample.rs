//! Drawing from the table (uniformly or by priority, with importance
//! weights) and setting priorities: the sample and priority scripts and
//! the batch a sample becomes.

use relay_proto::{Tensor, TransitionBatch, SCHEMA_VERSION};

use super::transition::{Action, Observations, Transition};
use super::tree::id_of_slot;
use super::{Table, TableError};

/// KEYS: items, tree, meta, frames prefix. ARGV: capacity, P, batch,
/// prioritized (1/0), ratio ('' without limiter), min_size, min_diff,
/// uniforms... A row stored with plane indices comes back with its
/// planes' pixels after it (nil when its frames are gone).
/// Returns {size, next, inserted_steps, total (string), status,
/// [slot, leaf (string; "0" when uniform), payload]...}; status 1 sampled, 0 nothing held or
/// counters only (batch 0), -2 held back by the rate limiter.
pub(super) const SAMPLE_LUA: &str = r#"
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
pub(super) const PRIORITY_LUA: &str = r#"
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

/// What a sample returned: a batch (possibly empty) and why.
#[derive(Debug)]
pub struct TableSample {
    pub batch: TransitionBatch,
    /// Held back by the rate limiter.
    pub held: bool,
    /// Rows that did not decode (dropped from the batch).
    pub corrupt: u64,
}

impl Table {
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
}

/// Stacks transitions (all of one shape: the table only holds this run's)
/// into a [`TransitionBatch`].
pub(super) fn build_batch(
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
