//! [`KvCache`]: the keys and values one sequence has produced so far, per
//! layer.
//!
//! One cache per sequence, not one per batch: sequences of any lengths can
//! be decoded together (see [`crate::CausalLm::forward_batch`]), a sequence
//! joins or leaves a running batch without touching the others' caches, and
//! [`KvCache::fork`] lets several samples share one prefilled prompt.
//!
//! Storage depends on the model's backend ([`crate::Backend`]). For the
//! CPU engine it is a plain `Vec<f32>` per layer and per keys/values,
//! position major (`(positions, kv_heads, head_dim)`): appending a
//! position is an amortised O(1) `extend` that never moves the positions
//! already held into another layout, and the engine's attention reads it
//! in place without building candle tensors. For the candle backend it is
//! one `(kv_heads, capacity, head_dim)` tensor per layer and per
//! keys/values on the model's device, in its dtype, written in place
//! (`slice_set`) and grown by doubling. [`KvCache::truncate`] rolls a
//! sequence back without freeing.

use candle_core::Tensor;

use crate::config::ModelConfig;
use crate::model_error::{ModelError, Result};

/// Positions reserved when a layer's buffer is first used.
const MIN_CAPACITY: usize = 32;

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
    /// The candle backend's: per layer, `(kv_heads, capacity, head_dim)`
    /// on the model's device (none until the first write).
    Device {
        keys: Vec<Option<Tensor>>,
        values: Vec<Option<Tensor>>,
    },
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

    /// An empty cache of device tensors (the candle backend's).
    pub(crate) fn new_on_device(config: &ModelConfig) -> Self {
        Self {
            storage: Storage::Device {
                keys: vec![None; config.num_hidden_layers],
                values: vec![None; config.num_hidden_layers],
            },
            ..Self::new(config)
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
        match &self.storage {
            Storage::Host { keys, values } => keys
                .iter()
                .chain(values)
                .map(|b| b.capacity() * std::mem::size_of::<f32>())
                .sum(),
            Storage::Device { keys, values } => keys
                .iter()
                .chain(values)
                .flatten()
                .map(|t| t.elem_count() * t.dtype().size_in_bytes())
                .sum(),
        }
    }

    /// An independent copy holding the same positions (deep copy of the
    /// used part), e.g. to sample several continuations of one prefilled
    /// prompt.
    pub fn fork(&self) -> Result<Self> {
        self.fork_prefix(self.len)
    }

    /// An independent copy of the first `len` positions (all of them if
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
            Storage::Device { keys, values } => {
                let copy = |buffers: &Vec<Option<Tensor>>| -> Result<Vec<Option<Tensor>>> {
                    buffers
                        .iter()
                        .map(|b| match b {
                            Some(t) if len > 0 => Ok(Some(t.narrow(1, 0, len)?.copy()?)),
                            _ => Ok(None),
                        })
                        .collect()
                };
                Storage::Device {
                    keys: copy(keys)?,
                    values: copy(values)?,
                }
            }
        };
        Ok(Self {
            storage,
            len,
            ..*self
        })
    }

    /// Floats per position of one layer (`kv_heads * head_dim`).
    pub(crate) fn row(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }

    /// Checks that the cache fits a model of this shape, and has the
    /// storage of its backend (`on_device`: the candle backend's).
    pub(crate) fn check_shape(&self, config: &ModelConfig, on_device: bool) -> Result<()> {
        let num_layers = match &self.storage {
            Storage::Host { keys, .. } => keys.len(),
            Storage::Device { keys, .. } => keys.len(),
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
        if on_device != matches!(self.storage, Storage::Device { .. }) {
            return Err(ModelError::BadInput(
                "cache made for another backend; make caches with CausalLm::new_cache".into(),
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

    /// Writes keys and values of new positions, each `(kv_heads, t,
    /// head_dim)` on the device, after the committed ones of `layer`
    /// (overwriting any uncommitted write), and returns the layer's keys
    /// and values up to and including them, `(kv_heads, len + t,
    /// head_dim)`. Device storage only.
    pub(crate) fn append_on_device(
        &mut self,
        layer: usize,
        new_keys: &Tensor,
        new_values: &Tensor,
    ) -> Result<(Tensor, Tensor)> {
        let (len, t) = (self.len, new_keys.dim(1)?);
        let Storage::Device { keys, values } = &mut self.storage else {
            unreachable!("checked by check_shape");
        };
        let mut out = Vec::with_capacity(2);
        for (buffer, new) in [
            (&mut keys[layer], new_keys),
            (&mut values[layer], new_values),
        ] {
            let capacity = buffer.as_ref().map_or(0, |b| b.dim(1).unwrap_or(0));
            if len + t > capacity {
                let grown = (len + t).max(2 * capacity).max(MIN_CAPACITY);
                let (kv_heads, _, head_dim) = new.dims3()?;
                let fresh = Tensor::zeros((kv_heads, grown, head_dim), new.dtype(), new.device())?;
                if let (Some(old), true) = (buffer.as_ref(), len > 0) {
                    fresh.slice_set(&old.narrow(1, 0, len)?.contiguous()?, 1, 0)?;
                }
                *buffer = Some(fresh);
            }
            let b = buffer.as_ref().expect("allocated above");
            b.slice_set(&new.contiguous()?, 1, len)?;
            out.push(b.narrow(1, 0, len + t)?);
        }
        let values = out.pop().expect("two");
        Ok((out.pop().expect("two"), values))
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
            cache: copy,
            last_used: self.clock,
        });
    }
}
