//! [`KvCache`]: the keys and values one sequence has produced so far, per
//! layer; [`KvPool`]: the paged store the candle backend's caches live in.
//!
//! One cache per sequence, not one per batch: sequences of any lengths can
//! be decoded together (see [`crate::CausalLm::forward_batch`]), a sequence
//! joins or leaves a running batch without touching the others' caches, and
//! [`KvCache::fork`] lets several samples share one prefilled prompt.
//!
//! Storage depends on the model's backend ([`crate::Backend`]):
//!
//! * The CPU engine's: a plain `Vec<f32>` per layer and per keys/values,
//!   position major (`(positions, kv_heads, head_dim)`). Appending a
//!   position is an amortised O(1) `extend` that never moves the positions
//!   already held, and the engine's attention reads it in place without
//!   building candle tensors.
//! * The candle backend's: blocks of [`BLOCK_POSITIONS`] positions in the
//!   model's [`KvPool`], one tensor per layer and per keys/values on the
//!   device, in its dtype, `(kv_heads, slots, head_dim)`, as vLLM's
//!   PagedAttention keeps them. A cache is a list of block ids. This is
//!   what lets one step attend for every decoding sequence at once: the
//!   step writes all new keys with one `scatter_set` per layer and gathers
//!   every sequence's keys with one `index_select`, whatever the number of
//!   sequences, where per-sequence buffers cost several kernels per
//!   sequence and layer. Memory is taken in blocks, so the pool knows how
//!   much is held and a server admits requests by memory
//!   ([`KvPool::usage`]). A fork shares its parent's blocks (reference
//!   counts) instead of copying them; a block is copied only when a cache
//!   writes into a block another cache also holds (copy on write).
//!
//! [`KvCache::truncate`] rolls a sequence back (the candle backend's cache
//! gives back the blocks it no longer needs).

use std::sync::{Arc, Mutex, MutexGuard};

use candle_core::{DType, Device, Tensor};

use crate::config::ModelConfig;
use crate::model_error::{ModelError, Result};

/// Positions reserved when a host layer buffer is first used.
const MIN_CAPACITY: usize = 32;

/// Positions per block of a [`KvPool`]: small enough that a sequence
/// wastes at most 15 positions, large enough that a block table stays short
/// (vLLM's default is 16 too).
pub const BLOCK_POSITIONS: usize = 16;

/// Blocks a pool holds at its first allocation; it doubles from there.
const INITIAL_BLOCKS: usize = 64;

/// The candle backend's paged key/value store for every cache of one model
/// (see the module docs). Each model on the candle backend has one; clones
/// of a model share it.
///
/// Block 0 is never handed out: it stays zero, and the batched attention
/// points the padding of shorter sequences at it (masked out, but finite:
/// a NaN there would poison the softmax's weighted sum even at weight 0).
#[derive(Debug)]
pub struct KvPool {
    state: Mutex<PoolState>,
    layers: usize,
    kv_heads: usize,
    head_dim: usize,
    dtype: DType,
    device: Device,
}

/// Blocks in use and the pool's size, for admission by memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvUsage {
    /// Blocks held by caches (a block shared by forks counts once).
    pub used_blocks: usize,
    /// Most blocks the pool may hold ([`KvPool::set_limit_bytes`]); `None`:
    /// it grows until the device is full.
    pub limit_blocks: Option<usize>,
    /// Bytes of one block: keys and values of [`BLOCK_POSITIONS`]
    /// positions in every layer.
    pub block_bytes: usize,
}

impl KvUsage {
    /// Blocks needed to hold `positions` positions.
    pub fn blocks_for(positions: usize) -> usize {
        positions.div_ceil(BLOCK_POSITIONS)
    }

    /// Blocks that can still be taken, if the pool is bounded.
    pub fn free_blocks(&self) -> Option<usize> {
        self.limit_blocks
            .map(|limit| limit.saturating_sub(self.used_blocks))
    }
}

#[derive(Debug, Default)]
pub(crate) struct PoolState {
    /// Per layer, `(kv_heads, capacity * BLOCK_POSITIONS, head_dim)`;
    /// empty until the first block is taken.
    keys: Vec<Tensor>,
    values: Vec<Tensor>,
    /// Caches holding each block (block 0: the zero block, never taken).
    refs: Vec<u32>,
    free: Vec<u32>,
    limit_blocks: Option<usize>,
}

impl PoolState {
    /// Keys and values of `layer`, each `(kv_heads, slots, head_dim)`.
    pub(crate) fn layer(&self, layer: usize) -> (&Tensor, &Tensor) {
        (&self.keys[layer], &self.values[layer])
    }
}

impl KvPool {
    pub(crate) fn new(config: &ModelConfig, dtype: DType, device: &Device) -> Self {
        Self {
            state: Mutex::new(PoolState::default()),
            layers: config.num_hidden_layers,
            kv_heads: config.num_key_value_heads,
            head_dim: config.head_dim,
            dtype,
            device: device.clone(),
        }
    }

    /// The state, locked; a forward holds it from its first write to its
    /// last read, so that no growth of the pool can replace a tensor under
    /// it. (A panic while it was held leaves counts that are still right.)
    pub(crate) fn lock(&self) -> MutexGuard<'_, PoolState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Bytes of one block in every layer, keys and values.
    pub fn block_bytes(&self) -> usize {
        2 * self.layers
            * BLOCK_POSITIONS
            * self.kv_heads
            * self.head_dim
            * self.dtype.size_in_bytes()
    }

    /// Bounds the pool to `bytes` of keys and values (`None`: no bound but
    /// the device's memory). Taking a block past it is
    /// [`ModelError::KvCacheFull`]; blocks already held are kept.
    pub fn set_limit_bytes(&self, bytes: Option<usize>) {
        self.lock().limit_blocks = bytes.map(|b| b / self.block_bytes());
    }

    /// Blocks in use and the bound.
    pub fn usage(&self) -> KvUsage {
        let state = self.lock();
        let capacity = state.refs.len().saturating_sub(1);
        KvUsage {
            used_blocks: capacity - state.free.len(),
            limit_blocks: state.limit_blocks,
            block_bytes: self.block_bytes(),
        }
    }

    /// A block for one cache, growing the pool if none is free.
    fn take(&self, state: &mut PoolState) -> Result<u32> {
        if state.free.is_empty() {
            self.grow(state)?;
        }
        let block = state.free.pop().expect("grown");
        state.refs[block as usize] = 1;
        Ok(block)
    }

    /// Doubles the pool (up to its bound), copying what it holds.
    fn grow(&self, state: &mut PoolState) -> Result<()> {
        let capacity = state.refs.len().saturating_sub(1);
        let mut grown = (2 * capacity).max(INITIAL_BLOCKS);
        if let Some(limit) = state.limit_blocks {
            grown = grown.min(limit);
        }
        if grown <= capacity {
            return Err(ModelError::KvCacheFull {
                blocks: capacity,
                bytes: capacity * self.block_bytes(),
            });
        }
        let slots = (grown + 1) * BLOCK_POSITIONS;
        let fresh = |old: Option<&Tensor>| -> Result<Tensor> {
            let t = Tensor::zeros(
                (self.kv_heads, slots, self.head_dim),
                self.dtype,
                &self.device,
            )?;
            if let Some(old) = old {
                t.slice_set(old, 1, 0)?;
            }
            Ok(t)
        };
        for layer in 0..self.layers {
            let keys = fresh(state.keys.get(layer))?;
            let values = fresh(state.values.get(layer))?;
            if layer < state.keys.len() {
                state.keys[layer] = keys;
                state.values[layer] = values;
            } else {
                state.keys.push(keys);
                state.values.push(values);
            }
        }
        let first_new = capacity + 1;
        state.refs.resize(grown + 1, 0);
        // Lowest ids popped first.
        state.free.extend((first_new as u32..=grown as u32).rev());
        Ok(())
    }

    /// One more cache holds `block`.
    fn share(&self, state: &mut PoolState, block: u32) {
        state.refs[block as usize] += 1;
    }

    /// One cache fewer holds each of `blocks`.
    fn release(&self, state: &mut PoolState, blocks: &[u32]) {
        for &b in blocks {
            let refs = &mut state.refs[b as usize];
            *refs -= 1;
            if *refs == 0 {
                state.free.push(b);
            }
        }
    }

    /// Performs the copies [`KvCache::reserve_slots`] asked for: the
    /// positions of blocks `from[i]` into blocks `to[i]`, every layer (one
    /// gather and one scatter per layer and keys/values).
    pub(crate) fn copy_on_write(
        &self,
        state: &PoolState,
        (from, to): &(Vec<u32>, Vec<u32>),
    ) -> Result<()> {
        if from.is_empty() {
            return Ok(());
        }
        let slots_of = |blocks: &[u32]| -> Vec<u32> {
            blocks
                .iter()
                .flat_map(|&b| {
                    let first = b * BLOCK_POSITIONS as u32;
                    first..first + BLOCK_POSITIONS as u32
                })
                .collect()
        };
        let n = from.len() * BLOCK_POSITIONS;
        let from = Tensor::from_vec(slots_of(from), n, &self.device)?;
        let to = self.scatter_index(slots_of(to))?;
        for layer in 0..self.layers {
            for t in [&state.keys[layer], &state.values[layer]] {
                t.scatter_set(&to, &t.index_select(&from, 1)?, 1)?;
            }
        }
        Ok(())
    }

    /// The index `scatter_set` along the slots takes to write `n` new
    /// positions into `slots`: `(kv_heads, n, head_dim)`, each slot id
    /// repeated over its heads and head dimensions.
    pub(crate) fn scatter_index(&self, slots: Vec<u32>) -> Result<Tensor> {
        let n = slots.len();
        Ok(Tensor::from_vec(slots, (1, n, 1), &self.device)?
            .broadcast_as((self.kv_heads, n, self.head_dim))?
            .contiguous()?)
    }
}

/// Keys and values of one sequence for every layer of one model.
#[derive(Debug)]
pub struct KvCache {
    storage: Storage,
    len: usize,
    num_kv_heads: usize,
    head_dim: usize,
}

#[derive(Debug)]
enum Storage {
    /// The CPU engine's: per layer, `(capacity, kv_heads, head_dim)`
    /// flattened; positions `[0, len)` valid, anything after them a write
    /// not yet committed.
    Host {
        keys: Vec<Vec<f32>>,
        values: Vec<Vec<f32>>,
    },
    /// The candle backend's: position `p` is in slot `p %
    /// BLOCK_POSITIONS` of block `blocks[p / BLOCK_POSITIONS]` of the
    /// pool; blocks past `len` hold writes not yet committed.
    Paged {
        pool: Arc<KvPool>,
        blocks: Vec<u32>,
        num_layers: usize,
    },
}

impl Drop for KvCache {
    fn drop(&mut self) {
        if let Storage::Paged { pool, blocks, .. } = &self.storage {
            pool.release(&mut pool.lock(), blocks);
        }
    }
}

impl KvCache {
    /// An empty cache of host buffers (the CPU engine's) for a model of
    /// this shape. Allocates nothing until the first forward; use
    /// [`crate::CausalLm::new_cache`] to get the kind the model's backend
    /// needs.
    pub fn new(config: &ModelConfig) -> Self {
        Self {
            storage: Storage::Host {
                keys: vec![Vec::new(); config.num_hidden_layers],
                values: vec![Vec::new(); config.num_hidden_layers],
            },
            len: 0,
            num_kv_heads: config.num_key_value_heads,
            head_dim: config.head_dim,
        }
    }

    /// An empty cache in `pool` (the candle backend's); holds no block
    /// until the first forward.
    pub(crate) fn paged(config: &ModelConfig, pool: Arc<KvPool>) -> Self {
        Self {
            storage: Storage::Paged {
                pool,
                blocks: Vec::new(),
                num_layers: config.num_hidden_layers,
            },
            len: 0,
            num_kv_heads: config.num_key_value_heads,
            head_dim: config.head_dim,
        }
    }

    /// Number of positions (tokens) held.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether no token has been fed yet.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Forgets every position at or after `len` (no-op if already shorter).
    /// Host buffers keep their memory for reuse; a paged cache gives back
    /// the blocks it no longer needs.
    pub fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
        if let Storage::Paged { pool, blocks, .. } = &mut self.storage {
            let keep = self.len.div_ceil(BLOCK_POSITIONS);
            if blocks.len() > keep {
                let dropped = blocks.split_off(keep);
                pool.release(&mut pool.lock(), &dropped);
            }
        }
    }

    /// Bytes held by the buffers (capacity, not just the used part; a
    /// block shared with forks counts in each of them).
    pub fn allocated_bytes(&self) -> usize {
        match &self.storage {
            Storage::Host { keys, values } => keys
                .iter()
                .chain(values)
                .map(|b| b.capacity() * std::mem::size_of::<f32>())
                .sum(),
            Storage::Paged { pool, blocks, .. } => blocks.len() * pool.block_bytes(),
        }
    }

    /// A cache holding the same positions, e.g. to sample several
    /// continuations of one prefilled prompt: a deep copy of host
    /// buffers; a paged cache shares its blocks (copied on write).
    pub fn fork(&self) -> Result<Self> {
        self.fork_prefix(self.len)
    }

    /// [`KvCache::fork`] of the first `len` positions (all of them if
    /// fewer are held).
    pub fn fork_prefix(&self, len: usize) -> Result<Self> {
        let len = len.min(self.len);
        let storage = match &self.storage {
            Storage::Host { keys, values } => {
                let used = len * self.row();
                let copy = |buffers: &Vec<Vec<f32>>| -> Vec<Vec<f32>> {
                    buffers
                        .iter()
                        .map(|b| b[..used.min(b.len())].to_vec())
                        .collect()
                };
                Storage::Host {
                    keys: copy(keys),
                    values: copy(values),
                }
            }
            Storage::Paged {
                pool,
                blocks,
                num_layers,
            } => {
                let shared = blocks[..len.div_ceil(BLOCK_POSITIONS)].to_vec();
                let mut state = pool.lock();
                for &b in &shared {
                    pool.share(&mut state, b);
                }
                Storage::Paged {
                    pool: pool.clone(),
                    blocks: shared,
                    num_layers: *num_layers,
                }
            }
        };
        Ok(Self {
            storage,
            len,
            num_kv_heads: self.num_kv_heads,
            head_dim: self.head_dim,
        })
    }

    /// Floats per position of one layer (`kv_heads * head_dim`).
    pub(crate) fn row(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }

    /// The pool a paged cache lives in.
    pub(crate) fn pool(&self) -> Option<&Arc<KvPool>> {
        match &self.storage {
            Storage::Host { .. } => None,
            Storage::Paged { pool, .. } => Some(pool),
        }
    }

    /// Checks that the cache fits a model of this shape, and has the
    /// storage of its backend (`pool`: the candle backend's, which must be
    /// the model's own).
    pub(crate) fn check_shape(
        &self,
        config: &ModelConfig,
        pool: Option<&Arc<KvPool>>,
    ) -> Result<()> {
        let num_layers = match &self.storage {
            Storage::Host { keys, .. } => keys.len(),
            Storage::Paged { num_layers, .. } => *num_layers,
        };
        if num_layers != config.num_hidden_layers
            || self.num_kv_heads != config.num_key_value_heads
            || self.head_dim != config.head_dim
        {
            return Err(ModelError::BadInput(format!(
                "cache for {} layers x {} kv heads x {} head dim used with a model of {} x {} x {}",
                num_layers,
                self.num_kv_heads,
                self.head_dim,
                config.num_hidden_layers,
                config.num_key_value_heads,
                config.head_dim
            )));
        }
        let same_store = match (self.pool(), pool) {
            (None, None) => true,
            (Some(a), Some(b)) => Arc::ptr_eq(a, b),
            _ => false,
        };
        if !same_store {
            return Err(ModelError::BadInput(
                "cache made for another backend or model; make caches with CausalLm::new_cache"
                    .into(),
            ));
        }
        Ok(())
    }

    /// Writes the keys and values of new positions (each `(t, kv_heads,
    /// head_dim)` flattened) after the committed ones of `layer`, dropping
    /// any uncommitted write left there. [`KvCache::advance`] commits them
    /// once every layer has been appended. Host storage only.
    pub(crate) fn append_rows(&mut self, layer: usize, new_keys: &[f32], new_values: &[f32]) {
        let committed = self.len * self.row();
        let reserve = MIN_CAPACITY * self.row();
        let Storage::Host { keys, values } = &mut self.storage else {
            unreachable!("checked by check_shape");
        };
        for (buffer, new) in [
            (&mut keys[layer], new_keys),
            (&mut values[layer], new_values),
        ] {
            buffer.truncate(committed);
            if buffer.capacity() == 0 {
                buffer.reserve(reserve);
            }
            buffer.extend_from_slice(new);
        }
    }

    /// Keys and values of `layer` (committed positions plus those appended
    /// since), each `(positions, kv_heads, head_dim)` flattened. Host
    /// storage only.
    pub(crate) fn layer(&self, layer: usize) -> (&[f32], &[f32]) {
        let Storage::Host { keys, values } = &self.storage else {
            unreachable!("checked by check_shape");
        };
        (&keys[layer], &values[layer])
    }

    /// Makes room for `added` positions after the committed ones and
    /// returns the pool slots they go to. A block this cache shares with
    /// another is replaced by a fresh one first, and the pair is pushed to
    /// `copies` (`(from, to)`) for [`KvPool::copy_on_write`] to fill before
    /// anything is written. Paged storage only.
    pub(crate) fn reserve_slots(
        &mut self,
        state: &mut PoolState,
        added: usize,
        copies: &mut (Vec<u32>, Vec<u32>),
    ) -> Result<Vec<u32>> {
        let Storage::Paged { pool, blocks, .. } = &mut self.storage else {
            unreachable!("checked by check_shape");
        };
        let end = self.len + added;
        for b in self.len / BLOCK_POSITIONS..end.div_ceil(BLOCK_POSITIONS) {
            if b == blocks.len() {
                blocks.push(pool.take(state)?);
            } else if state.refs[blocks[b] as usize] > 1 {
                let fresh = pool.take(state)?;
                copies.0.push(blocks[b]);
                copies.1.push(fresh);
                pool.release(state, &[blocks[b]]);
                blocks[b] = fresh;
            }
        }
        Ok((self.len..end).map(|p| slot(blocks, p)).collect())
    }

    /// Pool slots of positions `[0, n)`. Paged storage only.
    pub(crate) fn slots(&self, n: usize) -> impl Iterator<Item = u32> + '_ {
        let Storage::Paged { blocks, .. } = &self.storage else {
            unreachable!("checked by check_shape");
        };
        (0..n).map(|p| slot(blocks, p))
    }

    /// Marks `added` more positions as valid in every layer.
    pub(crate) fn advance(&mut self, added: usize) {
        self.len += added;
    }
}

/// The pool slot of position `p` of a cache with these blocks.
fn slot(blocks: &[u32], p: usize) -> u32 {
    blocks[p / BLOCK_POSITIONS] * BLOCK_POSITIONS as u32 + (p % BLOCK_POSITIONS) as u32
}

/// Caches of recent prompts, so that a new prompt sharing a long prefix
/// with one of them (a game's instructions, the earlier turns of the same
/// game) starts from a copy of that prefix's keys and values instead of
/// prefilling it again.
///
/// Entries are keyed by their tokens and their adapter (the same `Arc`:
/// the keys and values depend on the adapter); at most `capacity` are kept,
/// the least recently used dropped first.
#[derive(Debug)]
pub struct PrefixCache {
    entries: Vec<PrefixEntry>,
    capacity: usize,
    min_tokens: usize,
    clock: u64,
}

#[derive(Debug)]
struct PrefixEntry {
    adapter: Option<std::sync::Arc<crate::LoraAdapter>>,
    tokens: Vec<u32>,
    cache: KvCache,
    last_used: u64,
}

fn same_adapter(
    a: Option<&std::sync::Arc<crate::LoraAdapter>>,
    b: Option<&std::sync::Arc<crate::LoraAdapter>>,
) -> bool {
    match (a, b) {
        (None, None) => true,
        (Some(a), Some(b)) => std::sync::Arc::ptr_eq(a, b),
        _ => false,
    }
}

impl PrefixCache {
    /// Keeps up to `capacity` prompts (0 disables it); a cached prefix is
    /// used only when at least `min_tokens` long.
    pub fn new(capacity: usize, min_tokens: usize) -> Self {
        Self {
            entries: Vec::new(),
            capacity,
            min_tokens: min_tokens.max(1),
            clock: 0,
        }
    }

    /// Number of prompts held.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Drops the least recently used prompt, to give its memory back;
    /// false if none was held.
    pub fn evict_oldest(&mut self) -> bool {
        let Some(lru) = self
            .entries
            .iter()
            .enumerate()
            .min_by_key(|(_, e)| e.last_used)
            .map(|(i, _)| i)
        else {
            return false;
        };
        self.entries.swap_remove(lru);
        true
    }

    /// Whether no prompt is held.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The held entry sharing the longest prefix with `prompt` for this
    /// adapter, and how many positions of it a lookup would copy.
    fn best(
        &self,
        adapter: Option<&std::sync::Arc<crate::LoraAdapter>>,
        prompt: &[u32],
    ) -> Option<(usize, usize)> {
        let limit = prompt.len().saturating_sub(1);
        let (index, shared) = self
            .entries
            .iter()
            .enumerate()
            .filter(|(_, e)| same_adapter(e.adapter.as_ref(), adapter))
            .map(|(i, e)| {
                let shared = e
                    .tokens
                    .iter()
                    .zip(prompt)
                    .take_while(|(a, b)| a == b)
                    .count()
                    .min(limit)
                    .min(e.cache.len());
                (i, shared)
            })
            .max_by_key(|&(_, shared)| shared)?;
        (shared >= self.min_tokens).then_some((index, shared))
    }

    /// How many positions [`PrefixCache::lookup`] would return for
    /// `prompt` (0 for none), without copying anything.
    pub fn shared_len(
        &self,
        adapter: Option<&std::sync::Arc<crate::LoraAdapter>>,
        prompt: &[u32],
    ) -> usize {
        self.best(adapter, prompt).map_or(0, |(_, shared)| shared)
    }

    /// A copy of the cache of the longest held prefix of `prompt` for this
    /// adapter, at most `prompt.len() - 1` positions (the last prompt token
    /// must still be fed to get the first logits); `None` if no held prompt
    /// shares `min_tokens` or more.
    pub fn lookup(
        &mut self,
        adapter: Option<&std::sync::Arc<crate::LoraAdapter>>,
        prompt: &[u32],
    ) -> Option<KvCache> {
        let (index, shared) = self.best(adapter, prompt)?;
        self.clock += 1;
        self.entries[index].last_used = self.clock;
        self.entries[index].cache.fork_prefix(shared).ok()
    }

    /// Remembers the first `prompt.len()` positions of `cache` as the
    /// cache of `prompt` (a prompt already held is only refreshed).
    pub fn insert(
        &mut self,
        adapter: Option<&std::sync::Arc<crate::LoraAdapter>>,
        prompt: &[u32],
        cache: &KvCache,
    ) {
        if self.capacity == 0 || prompt.len() < self.min_tokens || cache.len() < prompt.len() {
            return;
        }
        self.clock += 1;
        if let Some(e) = self
            .entries
            .iter_mut()
            .find(|e| same_adapter(e.adapter.as_ref(), adapter) && e.tokens == prompt)
        {
            e.last_used = self.clock;
            return;
        }
        // Out of device memory: this prompt is not remembered.
        let Ok(copy) = cache.fork_prefix(prompt.len()) else {
            return;
        };
        if self.entries.len() >= self.capacity {
            self.evict_oldest();
        }
        self.entries.push(PrefixEntry {
            adapter: adapter.cloned(),
            tokens: prompt.to_vec(),
            cache: copy,
            last_used: self.clock,
        });
    }
}
