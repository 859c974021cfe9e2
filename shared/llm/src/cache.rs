//! [`KvCache`]: the keys and values one sequence has produced so far, per
//! layer.
//!
//! One cache per sequence, not one per batch: sequences of any lengths can
//! be decoded together (see [`crate::CausalLm::forward_batch`]), a sequence
//! joins or leaves a running batch without touching the others' caches, and
//! [`KvCache::fork`] lets several samples share one prefilled prompt.
//!
//! Storage grows by doubling, so appending one token is amortised O(1)
//! copies; [`KvCache::truncate`] rolls a sequence back without freeing.

use candle_core::{DType, Device, Tensor};

use crate::config::ModelConfig;
use crate::model_error::{ModelError, Result};

/// Smallest allocation, in positions, when a layer's buffer is first used.
const MIN_CAPACITY: usize = 32;

#[derive(Debug, Clone, Default)]
struct LayerBuffers {
    /// `(kv_heads, capacity, head_dim)`, positions `[0, len)` valid.
    keys: Option<Tensor>,
    /// Same layout as `keys`.
    values: Option<Tensor>,
}

/// Keys and values of one sequence for every layer of one model.
#[derive(Debug)]
pub struct KvCache {
    layers: Vec<LayerBuffers>,
    len: usize,
    num_kv_heads: usize,
    head_dim: usize,
}

impl KvCache {
    /// An empty cache for a model of this shape. Allocates nothing until
    /// the first forward.
    pub fn new(config: &ModelConfig) -> Self {
        Self {
            layers: vec![LayerBuffers::default(); config.num_hidden_layers],
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
        self.layers
            .iter()
            .flat_map(|l| [&l.keys, &l.values])
            .flatten()
            .map(|t| t.elem_count() * t.dtype().size_in_bytes())
            .sum()
    }

    /// An independent copy holding the same positions (deep copy of the
    /// used part), e.g. to sample several continuations of one prefilled
    /// prompt.
    pub fn fork(&self) -> Result<Self> {
        let len = self.len;
        let copy = |t: &Option<Tensor>| -> Result<Option<Tensor>> {
            match t {
                Some(t) if len > 0 => Ok(Some(t.narrow(1, 0, len)?.contiguous()?.copy()?)),
                _ => Ok(None),
            }
        };
        let layers = self
            .layers
            .iter()
            .map(|l| {
                Ok(LayerBuffers {
                    keys: copy(&l.keys)?,
                    values: copy(&l.values)?,
                })
            })
            .collect::<Result<_>>()?;
        Ok(Self {
            layers,
            len,
            num_kv_heads: self.num_kv_heads,
            head_dim: self.head_dim,
        })
    }

    pub(crate) fn check_shape(&self, config: &ModelConfig) -> Result<()> {
        if self.layers.len() != config.num_hidden_layers
            || self.num_kv_heads != config.num_key_value_heads
            || self.head_dim != config.head_dim
        {
            return Err(ModelError::BadInput(format!(
                "cache for {} layers x {} kv heads x {} head dim used with a model of {} x {} x {}",
                self.layers.len(),
                self.num_kv_heads,
                self.head_dim,
                config.num_hidden_layers,
                config.num_key_value_heads,
                config.head_dim
            )));
        }
        Ok(())
    }

    /// Writes `new_keys`/`new_values` (`(kv_heads, t, head_dim)`) after the
    /// current positions of `layer` and returns views of all
    /// `len + t` positions. [`KvCache::advance`] commits them once every
    /// layer has been appended.
    pub(crate) fn append(
        &mut self,
        layer: usize,
        new_keys: &Tensor,
        new_values: &Tensor,
    ) -> Result<(Tensor, Tensor)> {
        self.ensure_allocated(layer, new_keys.device())?;
        let added = new_keys.dim(1)?;
        let total = self.len + added;
        let buffers = &mut self.layers[layer];
        let keys = grow(&mut buffers.keys, self.len, total, new_keys.device())?;
        let values = grow(&mut buffers.values, self.len, total, new_values.device())?;
        keys.slice_set(&new_keys.contiguous()?, 1, self.len)?;
        values.slice_set(&new_values.contiguous()?, 1, self.len)?;
        Ok((keys.narrow(1, 0, total)?, values.narrow(1, 0, total)?))
    }

    /// Marks `added` more positions as valid in every layer.
    pub(crate) fn advance(&mut self, added: usize) {
        self.len += added;
    }

    fn zeros(&self, capacity: usize, device: &Device) -> Result<Tensor> {
        Ok(Tensor::zeros(
            (self.num_kv_heads, capacity, self.head_dim),
            DType::F32,
            device,
        )?)
    }
}

/// Makes sure `buffer` holds at least `needed` positions, keeping the first
/// `used`; returns a handle to it.
fn grow(
    buffer: &mut Option<Tensor>,
    used: usize,
    needed: usize,
    device: &Device,
) -> Result<Tensor> {
    if let Some(t) = buffer {
        if t.dim(1)? >= needed {
            return Ok(t.clone());
        }
    }
    let old_capacity = buffer.as_ref().map(|t| t.dim(1)).transpose()?.unwrap_or(0);
    let capacity = needed.max(2 * old_capacity).max(MIN_CAPACITY);
    let (kv_heads, head_dim) = match buffer {
        Some(t) => (t.dim(0)?, t.dim(2)?),
        None => (0, 0),
    };
    let fresh = match buffer.take() {
        Some(old) if used > 0 => {
            let tail = Tensor::zeros((kv_heads, capacity - used, head_dim), DType::F32, device)?;
            Tensor::cat(&[&old.narrow(1, 0, used)?, &tail], 1)?
        }
        Some(old) => Tensor::zeros((kv_heads, capacity, head_dim), DType::F32, old.device())?,
        None => return Err(ModelError::BadInput("unallocated cache buffer".into())),
    };
    *buffer = Some(fresh.clone());
    Ok(fresh)
}

impl KvCache {
    /// Allocates the first buffers of `layer` if needed.
    fn ensure_allocated(&mut self, layer: usize, device: &Device) -> Result<()> {
        if self.layers[layer].keys.is_none() {
            let keys = self.zeros(MIN_CAPACITY, device)?;
            let values = self.zeros(MIN_CAPACITY, device)?;
            self.layers[layer] = LayerBuffers {
                keys: Some(keys),
                values: Some(values),
            };
        }
        Ok(())
    }
}
