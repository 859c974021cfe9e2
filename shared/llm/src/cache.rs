//! [`KvCache`]: the keys and values one sequence has produced so far, per
//! layer.
//!
//! One cache per sequence, not one per batch: sequences of any lengths can
//! be decoded together (see [`crate::CausalLm::forward_batch`]), a sequence
//! joins or leaves a running batch without touching the others' caches, and
//! [`KvCache::fork`] lets several samples share one prefilled prompt.
//!
//! Storage is a plain `Vec<f32>` per layer and per keys/values, position
//! major (`(positions, kv_heads, head_dim)`): appending a position is an
//! amortised O(1) `extend` that never moves the positions already held
//! into another layout, and the one-token decode attention
//! (`crate::model`) reads it in place without building candle tensors.
//! Prefill attention views it as a strided `(kv_heads, positions,
//! head_dim)` tensor. [`KvCache::truncate`] rolls a sequence back without
//! freeing.

use crate::config::ModelConfig;
use crate::model_error::{ModelError, Result};

/// Positions reserved when a layer's buffer is first used.
const MIN_CAPACITY: usize = 32;

/// Keys and values of one sequence for every layer of one model.
#[derive(Debug, Clone)]
pub struct KvCache {
    /// Per layer, `(capacity, kv_heads, head_dim)`; positions `[0, len)`
    /// valid, anything after them a write not yet committed.
    keys: Vec<Vec<f32>>,
    /// Same layout as `keys`.
    values: Vec<Vec<f32>>,
    len: usize,
    num_kv_heads: usize,
    head_dim: usize,
}

impl KvCache {
    /// An empty cache for a model of this shape. Allocates nothing until
    /// the first forward.
    pub fn new(config: &ModelConfig) -> Self {
        Self {
            keys: vec![Vec::new(); config.num_hidden_layers],
            values: vec![Vec::new(); config.num_hidden_layers],
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
    /// The memory is kept for reuse.
    pub fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
    }

    /// Bytes held by the buffers (capacity, not just the used part).
    pub fn allocated_bytes(&self) -> usize {
        self.keys
            .iter()
            .chain(&self.values)
            .map(|b| b.capacity() * std::mem::size_of::<f32>())
            .sum()
    }

    /// An independent copy holding the same positions (deep copy of the
    /// used part), e.g. to sample several continuations of one prefilled
    /// prompt.
    pub fn fork(&self) -> Result<Self> {
        Ok(self.fork_prefix(self.len))
    }

    /// An independent copy of the first `len` positions (all of them if
    /// fewer are held).
    pub fn fork_prefix(&self, len: usize) -> Self {
        let len = len.min(self.len);
        let used = len * self.row();
        let copy = |buffers: &Vec<Vec<f32>>| -> Vec<Vec<f32>> {
            buffers
                .iter()
                .map(|b| b[..used.min(b.len())].to_vec())
                .collect()
        };
        Self {
            keys: copy(&self.keys),
            values: copy(&self.values),
            len,
            num_kv_heads: self.num_kv_heads,
            head_dim: self.head_dim,
        }
    }

    /// Floats per position of one layer (`kv_heads * head_dim`).
    pub(crate) fn row(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }

    pub(crate) fn check_shape(&self, config: &ModelConfig) -> Result<()> {
        if self.keys.len() != config.num_hidden_layers
            || self.num_kv_heads != config.num_key_value_heads
            || self.head_dim != config.head_dim
        {
            return Err(ModelError::BadInput(format!(
                "cache for {} layers x {} kv heads x {} head dim used with a model of {} x {} x {}",
                self.keys.len(),
                self.num_kv_heads,
                self.head_dim,
                config.num_hidden_layers,
                config.num_key_value_heads,
                config.head_dim
            )));
        }
        Ok(())
    }

    /// Writes the keys and values of new positions (each `(t, kv_heads,
    /// head_dim)` flattened) after the committed ones of `layer`, dropping
    /// any uncommitted write left there. [`KvCache::advance`] commits them
    /// once every layer has been appended.
    pub(crate) fn append_rows(&mut self, layer: usize, keys: &[f32], values: &[f32]) {
        let committed = self.len * self.row();
        for (buffer, new) in [
            (&mut self.keys[layer], keys),
            (&mut self.values[layer], values),
        ] {
            buffer.truncate(committed);
            if buffer.capacity() == 0 {
                buffer.reserve(MIN_CAPACITY * self.num_kv_heads * self.head_dim);
            }
            buffer.extend_from_slice(new);
        }
    }

    /// Keys and values of `layer` (committed positions plus those appended
    /// since), each `(positions, kv_heads, head_dim)` flattened.
    pub(crate) fn layer(&self, layer: usize) -> (&[f32], &[f32]) {
        (&self.keys[layer], &self.values[layer])
    }

    /// Marks `added` more positions as valid in every layer.
    pub(crate) fn advance(&mut self, added: usize) {
        self.len += added;
    }
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
        Some(self.entries[index].cache.fork_prefix(shared))
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
        if self.entries.len() >= self.capacity {
            let lru = self
                .entries
                .iter()
                .enumerate()
                .min_by_key(|(_, e)| e.last_used)
                .map(|(i, _)| i)
                .expect("full, so non-empty");
            self.entries.swap_remove(lru);
        }
        self.entries.push(PrefixEntry {
            adapter: adapter.cloned(),
            tokens: prompt.to_vec(),
            cache: cache.fork_prefix(prompt.len()),
            last_used: self.clock,
        });
    }
}
