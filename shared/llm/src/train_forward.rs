//! The training forward of [`CausalLm`]: [`CausalLm::forward_train`],
//! [`CausalLm::forward_train_at`] and [`CausalLm::forward_train_batch`],
//! built from the fused ops of [`crate::train_ops`], each with its own
//! backward.
//!
//! The layout stays one row of features per input token from the
//! embedding to the head: a padded block's `batch · time` rows, or a
//! [`TokenBatch`]'s packed rows (the shared prefix once, then each row's
//! own tokens). The projections, norms and MLP work on rows whatever their
//! order; only the attention op knows which rows see which (its
//! `AttentionLayout`), and it reads each head's columns of the rows in
//! place (RoPE included), so no activation is transposed or copied
//! between ops.
//! Frozen base weights (the LoRA case) get no gradient computed at all;
//! a model loaded into a `VarMap` (full fine-tuning) gets gradients for
//! every weight. The composition of candle's basic ops,
//! [`CausalLm::forward_train_composed`], is the candle backend's training
//! forward (any device and dtype), and the reference the tests compare
//! this path with.
//!
//! A training pass can be stopped between two blocks
//! ([`CausalLm::forward_train_for_backward_until`]): a micro-batch of a
//! 135 M model takes seconds on two loaded CPU cores, longer than a
//! stopping learner may take, so its forward asks before each block and
//! its backward goes block by block ([`TrainForward`]) asking before each.

use candle_core::{DType, Tensor, Var};
use relay_nn::StopCheck;

use crate::lora::LoraAdapter;
use crate::model::{
    attend, causal_mask, rms_norm as composed_rms_norm, rope, BaseWeight, CausalLm, Embedding,
    Projection, Routing,
};
use crate::model_error::{ModelError, Result};
use crate::token_batch::TokenBatch;
use crate::train_ops::{self, AttentionLayout};

/// [`ModelError::Stopped`] when `stop` says the caller is stopping.
fn check_stop(stop: Option<StopCheck<'_>>) -> Result<()> {
    if stop.is_some_and(|stop| stop()) {
        return Err(ModelError::Stopped);
    }
    Ok(())
}

/// The weight of a projection as a dense f32 matrix for training.
fn dense_weight(projection: &Projection) -> Result<Tensor> {
    match &projection.weight {
        BaseWeight::Dense(w) => Ok(w.clone()),
        BaseWeight::Quantized(q) => Ok(q.dequantize(&candle_core::Device::Cpu)?),
        BaseWeight::QMatMul(_) => Err(ModelError::BadInput(
            "forward_train cannot pass gradients through QMatMul".into(),
        )),
        BaseWeight::PackedOnly => Err(crate::model::packed_only_error("forward_train")),
    }
}

/// `x Wᵀ + b`, plus `scaling · B (A x)` when `adapter` adapts this
/// projection of `layer`.
fn project(
    projection: &Projection,
    x: &Tensor,
    layer: usize,
    adapter: Option<&LoraAdapter>,
) -> Result<Tensor> {
    let w = dense_weight(projection)?;
    let bias = projection.bias.as_ref();
    let lora = adapter.and_then(|a| Some((a.weights(layer, projection.target)?, a.scaling())));
    let Some((lora, scaling)) = lora else {
        return Ok(train_ops::linear(x, &w, bias)?);
    };
    let (a, b) = (lora.a.as_tensor(), lora.b.as_tensor());
    if !w.track_op() && !bias.is_some_and(Tensor::track_op) {
        return Ok(train_ops::lora_linear(x, &w, bias, (a, b), scaling)?);
    }
    // A trainable base under an adapter: the base product keeps its own
    // weight gradient.
    let y = train_ops::linear(x, &w, bias)?;
    let low = train_ops::linear(x, a, None)?;
    let up = train_ops::scaled_linear(&low, b, scaling)?;
    Ok(train_ops::residual(&y, &up)?)
}

impl CausalLm {
    /// Whether the candle backend computes this model (the training forward
    /// is then [`CausalLm::forward_train_composed`]: the fused ops are CPU
    /// and f32 only).
    fn on_candle(&self) -> bool {
        matches!(self.backend, crate::backend::Backend::Candle { .. })
    }

    /// Checks a training input and returns `(batch, time)`.
    pub(crate) fn check_train_input(
        &self,
        input_ids: &Tensor,
        adapter: Option<&LoraAdapter>,
    ) -> Result<(usize, usize, Tensor)> {
        if self.is_packed_only() {
            return Err(crate::model::packed_only_error("forward_train"));
        }
        if !self.supports_training() {
            return Err(ModelError::BadInput(
                "forward_train cannot pass gradients through QMatMul: \
                 load the GGUF with GgufBase::Quantized or Dequantized"
                    .into(),
            ));
        }
        if let Some(a) = adapter {
            a.check_fits(&self.config)?;
        }
        let (batch, time) = input_ids.dims2()?;
        if time == 0 || batch == 0 {
            return Err(ModelError::BadInput("empty input_ids".into()));
        }
        if time > self.config.max_position_embeddings {
            return Err(ModelError::ContextOverflow {
                position: time - 1,
                limit: self.config.max_position_embeddings,
            });
        }
        let flat_ids = input_ids.flatten_all()?.to_dtype(DType::U32)?;
        let vocab = self.config.vocab_size;
        if let Some(bad) = flat_ids
            .to_vec1::<u32>()?
            .into_iter()
            .find(|&t| t as usize >= vocab)
        {
            return Err(ModelError::BadInput(format!(
                "token {bad} is outside the vocabulary of {vocab}"
            )));
        }
        // On the model's device (the candle backend's may be a GPU).
        Ok((batch, time, flat_ids.to_device(self.rope_cos.device())?))
    }

    /// The embedding rows of `flat_ids`.
    fn train_embed(&self, flat_ids: &Tensor) -> Result<Tensor> {
        Ok(match &self.embed {
            Embedding::Dense(w) => w.index_select(flat_ids, 0)?,
            Embedding::Quantized(q) => q.embedding(flat_ids)?,
        })
    }

    /// The residual stream after the last block, one row per input token
    /// in `layout`'s order (before the final norm); `stop` is asked before
    /// each block.
    fn train_trunk(
        &self,
        flat_ids: &Tensor,
        layout: &AttentionLayout,
        adapter: Option<&LoraAdapter>,
        stop: Option<StopCheck<'_>>,
    ) -> Result<Tensor> {
        let mut x = self.train_embed(flat_ids)?;
        for layer in 0..self.blocks.len() {
            check_stop(stop)?;
            x = self.train_block(layer, &x, layout, adapter)?;
        }
        Ok(x)
    }

    /// Block `layer` of the fused trunk on residual rows `x`.
    fn train_block(
        &self,
        layer: usize,
        x: &Tensor,
        layout: &AttentionLayout,
        adapter: Option<&LoraAdapter>,
    ) -> Result<Tensor> {
        let cfg = &self.config;
        let eps = cfg.rms_norm_eps;
        let shape = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        );
        let block = &self.blocks[layer];
        let h = train_ops::rms_norm(x, &block.input_norm, eps)?;
        let mut q = project(&block.q_proj, &h, layer, adapter)?;
        let mut k = project(&block.k_proj, &h, layer, adapter)?;
        let v = project(&block.v_proj, &h, layer, adapter)?;
        if let Some(norm) = &block.qk_norm {
            // Each head's `head_dim` columns are one row of the norm.
            let per_head = |m: &Tensor, weight: &Tensor| -> Result<Tensor> {
                let rows = m.dims2()?;
                let heads = m.reshape(((), cfg.head_dim))?;
                Ok(train_ops::rms_norm(&heads, weight, eps)?.reshape(rows)?)
            };
            q = per_head(&q, &norm.q)?;
            k = per_head(&k, &norm.k)?;
        }
        let attn = train_ops::causal_attention(
            &q,
            &k,
            &v,
            layout,
            shape,
            (&self.rope_cos, &self.rope_sin),
        )?;
        let x = train_ops::residual(x, &project(&block.o_proj, &attn, layer, adapter)?)?;
        let h = train_ops::rms_norm(&x, &block.post_attention_norm, eps)?;
        let gate = project(&block.gate_proj, &h, layer, adapter)?;
        let up = project(&block.up_proj, &h, layer, adapter)?;
        let inner = train_ops::swiglu(&gate, &up)?;
        Ok(train_ops::residual(
            &x,
            &project(&block.down_proj, &inner, layer, adapter)?,
        )?)
    }

    /// Final norm and LM head of residual rows `(rows, hidden)`.
    fn train_head(&self, x: &Tensor) -> Result<Tensor> {
        let x = train_ops::rms_norm(x, &self.final_norm, self.config.rms_norm_eps)?;
        project(&self.lm_head, &x, 0, None)
    }

    /// The training forward: logits `(batch, time, vocab)` for a
    /// right-padded block of token ids `(batch, time)` (u32), every
    /// sequence starting at position 0, with `adapter` applied.
    ///
    /// Every op passes gradients, so `loss.backward()` reaches the
    /// adapter's vars (and, for a model loaded into a `VarMap`, every
    /// weight). Works on a dense base and on a GGUF base held as
    /// [`crate::GgufBase::Quantized`] or `Dequantized` (not `QMatMul8Bit`:
    /// `QMatMul` has no backward). Right padding needs no mask under
    /// causal attention: real tokens never attend to the padding after
    /// them; mask the padded positions in the loss.
    pub fn forward_train(
        &self,
        input_ids: &Tensor,
        adapter: Option<&LoraAdapter>,
    ) -> Result<Tensor> {
        if self.on_candle() {
            return self.forward_train_composed(input_ids, adapter);
        }
        let (batch, time, flat_ids) = self.check_train_input(input_ids, adapter)?;
        let layout = AttentionLayout::padded(batch, time);
        let x = self.train_trunk(&flat_ids, &layout, adapter, None)?;
        let logits = self.train_head(&x)?;
        Ok(logits.reshape((batch, time, self.config.vocab_size))?)
    }

    /// [`CausalLm::forward_train`] but only the logits at `positions`
    /// `(n,)` (u32 flat indices `row · time + position` into the block,
    /// e.g. [`crate::TokenBatch::positions`]): `(n, vocab)`, in that order.
    ///
    /// The same values as picking those rows out of `forward_train`'s
    /// logits, without computing the head (and its backward) at the
    /// prompt and padding positions no loss reads.
    pub fn forward_train_at(
        &self,
        input_ids: &Tensor,
        adapter: Option<&LoraAdapter>,
        positions: &Tensor,
    ) -> Result<Tensor> {
        let (batch, time, flat_ids) = self.check_train_input(input_ids, adapter)?;
        let positions = positions.to_dtype(DType::U32)?;
        if let Some(bad) = positions
            .to_vec1::<u32>()?
            .into_iter()
            .find(|&p| p as usize >= batch * time)
        {
            return Err(ModelError::BadInput(format!(
                "position {bad} is outside the ({batch}, {time}) block"
            )));
        }
        if self.on_candle() {
            return self.composed_at(&flat_ids, (batch, time), adapter, &positions, None);
        }
        let layout = AttentionLayout::padded(batch, time);
        let x = self.train_trunk(&flat_ids, &layout, adapter, None)?;
        self.train_head(&x.index_select(&positions, 0)?)
    }

    /// The composed forward's logits at `positions` (u32, in range) of a
    /// `shape` block of `flat_ids`, `stop` asked before each block.
    fn composed_at(
        &self,
        flat_ids: &Tensor,
        shape: (usize, usize),
        adapter: Option<&LoraAdapter>,
        positions: &Tensor,
        stop: Option<StopCheck<'_>>,
    ) -> Result<Tensor> {
        let x = self.composed_trunk(flat_ids, shape, adapter, stop)?;
        self.composed_head(&x.index_select(&positions.to_device(x.device())?, 0)?)
    }

    /// The logits predicting `batch`'s completion tokens, `(tokens,
    /// vocab)`, in [`TokenBatch::targets`]' order: what every trainer's
    /// loss reads.
    ///
    /// The same values as [`CausalLm::forward_train_at`] with the batch's
    /// block and positions. On the CPU engine the tokens every row opens
    /// with ([`TokenBatch::packed`]: a text game's system prompt, chat
    /// header and rules) go through the model once, not once a row, and
    /// the right padding not at all; their gradient is the sum over the
    /// rows, as it is in the padded block. The candle backend runs the
    /// padded block.
    pub fn forward_train_batch(
        &self,
        batch: &TokenBatch,
        adapter: Option<&LoraAdapter>,
    ) -> Result<Tensor> {
        self.forward_train_batch_until(batch, adapter, None)
    }

    /// [`CausalLm::forward_train_batch`] asking `stop` before each block:
    /// [`ModelError::Stopped`] once it says the caller is stopping.
    pub fn forward_train_batch_until(
        &self,
        batch: &TokenBatch,
        adapter: Option<&LoraAdapter>,
        stop: Option<StopCheck<'_>>,
    ) -> Result<Tensor> {
        // Checks the tokens, their length and the adapter.
        let (batch_size, time, flat_ids) = self.check_train_input(&batch.input_ids, adapter)?;
        if self.on_candle() {
            let positions = batch.positions.to_dtype(DType::U32)?;
            return self.composed_at(&flat_ids, (batch_size, time), adapter, &positions, stop);
        }
        let (ids, positions, layout) = packed_input(batch)?;
        let x = self.train_trunk(&ids, &layout, adapter, stop)?;
        self.train_head(&x.index_select(&positions, 0)?)
    }

    /// The training forward composed of candle's basic ops (all with a
    /// backward, all with CUDA kernels): logits `(batch, time, vocab)` of a
    /// right-padded block from position 0. The candle backend trains
    /// through it ([`CausalLm::forward_train`] dispatches here); on the CPU
    /// engine it is the reference the fused ops are tested against.
    pub fn forward_train_composed(
        &self,
        input_ids: &Tensor,
        adapter: Option<&LoraAdapter>,
    ) -> Result<Tensor> {
        let (batch, time, flat_ids) = self.check_train_input(input_ids, adapter)?;
        let x = self.composed_trunk(&flat_ids, (batch, time), adapter, None)?;
        let logits = self.composed_head(&x)?;
        Ok(logits.reshape((batch, time, self.config.vocab_size))?)
    }

    /// Final norm and LM head of composed residual rows: f32 logits.
    pub(crate) fn composed_head(&self, x: &Tensor) -> Result<Tensor> {
        let x = composed_rms_norm(x, &self.final_norm, self.config.rms_norm_eps)?;
        let logits = self
            .lm_head
            .forward(&x.to_dtype(self.compute_dtype())?, 0, &Routing::Base)?;
        Ok(logits.to_dtype(DType::F32)?)
    }

    /// The residual rows `(batch · time, hidden)` after the last block, in
    /// f32, from candle's basic ops: matmuls in the weights' dtype; norms,
    /// RoPE and the attention softmax in f32. `stop` is asked before each
    /// block.
    pub(crate) fn composed_trunk(
        &self,
        flat_ids: &Tensor,
        shape: (usize, usize),
        adapter: Option<&LoraAdapter>,
        stop: Option<StopCheck<'_>>,
    ) -> Result<Tensor> {
        let context = BlockContext::new(self, shape, adapter)?;
        let mut x = self.embed.lookup(flat_ids)?.to_dtype(DType::F32)?;
        for layer in 0..self.blocks.len() {
            check_stop(stop)?;
            x = self.composed_block(layer, &x, &context)?;
        }
        Ok(x)
    }

    /// Block `layer` of the composed trunk on residual rows `x`.
    fn composed_block(&self, layer: usize, x: &Tensor, c: &BlockContext<'_>) -> Result<Tensor> {
        let block = &self.blocks[layer];
        let cfg = &self.config;
        let (batch, time) = c.shape;
        let (heads, kv_heads, head_dim) = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        );
        let rep = cfg.kv_group_size();
        let f32_rows = |t: Tensor| -> Result<Tensor> { Ok(t.to_dtype(DType::F32)?) };
        let h = composed_rms_norm(x, &block.input_norm, cfg.rms_norm_eps)?.to_dtype(c.dtype)?;
        let split = |m: Tensor, n: usize| -> Result<Tensor> {
            Ok(f32_rows(m)?
                .reshape((batch, time, n, head_dim))?
                .transpose(1, 2)?)
        };
        let mut q = split(block.q_proj.forward(&h, layer, &c.routing)?, heads)?;
        let mut k = split(block.k_proj.forward(&h, layer, &c.routing)?, kv_heads)?;
        let v = split(block.v_proj.forward(&h, layer, &c.routing)?, kv_heads)?;
        if let Some(norm) = &block.qk_norm {
            q = composed_rms_norm(&q, &norm.q, cfg.rms_norm_eps)?;
            k = composed_rms_norm(&k, &norm.k, cfg.rms_norm_eps)?;
        }
        let q = rope(&q, &c.cos, &c.sin)?.contiguous()?.reshape((
            batch * kv_heads,
            rep * time,
            head_dim,
        ))?;
        let k =
            rope(&k, &c.cos, &c.sin)?
                .contiguous()?
                .reshape((batch * kv_heads, time, head_dim))?;
        let v = v
            .contiguous()?
            .reshape((batch * kv_heads, time, head_dim))?;
        let out = attend(&q, &k, &v, rep, c.mask.as_ref())?;
        let attn = out
            .reshape((batch, heads, time, head_dim))?
            .transpose(1, 2)?
            .reshape((batch * time, heads * head_dim))?
            .to_dtype(c.dtype)?;
        let x = (x + f32_rows(block.o_proj.forward(&attn, layer, &c.routing)?)?)?;
        let h = composed_rms_norm(&x, &block.post_attention_norm, cfg.rms_norm_eps)?
            .to_dtype(c.dtype)?;
        Ok((&x + f32_rows(self.mlp(block, &h, layer, &c.routing)?)?)?)
    }

    /// The logits of [`CausalLm::forward_train_batch`], ready for a
    /// backward pass: block by block on the CPU engine, recomputing the
    /// trunk's activations when `recompute` is set on the candle backend
    /// (activation checkpointing), otherwise the plain one (see
    /// [`TrainForward`]).
    pub fn forward_train_for_backward<'a>(
        &'a self,
        batch: &TokenBatch,
        adapter: Option<&'a LoraAdapter>,
        recompute: bool,
    ) -> Result<TrainForward<'a>> {
        self.forward_train_for_backward_until(batch, adapter, recompute, None)
    }

    /// [`CausalLm::forward_train_for_backward`] asking `stop` before each
    /// block of the forward and (except the candle backend's plain
    /// backward, one call) of the backward: [`ModelError::Stopped`] once it
    /// says the caller is stopping.
    pub fn forward_train_for_backward_until<'a>(
        &'a self,
        batch: &TokenBatch,
        adapter: Option<&'a LoraAdapter>,
        recompute: bool,
        stop: Option<StopCheck<'a>>,
    ) -> Result<TrainForward<'a>> {
        if !self.on_candle() {
            return self.segmented_forward(batch, adapter, stop);
        }
        if !recompute {
            return Ok(TrainForward::Kept(
                self.forward_train_batch_until(batch, adapter, stop)?,
            ));
        }
        let (batch_size, time, flat_ids) = self.check_train_input(&batch.input_ids, adapter)?;
        let positions = batch.positions.to_dtype(DType::U32)?;
        let shape = (batch_size, time);
        let context = BlockContext::new(self, shape, adapter)?;
        // Each block's input, without the graph that made it.
        let mut inputs = Vec::with_capacity(self.blocks.len());
        let mut x = self.embed.lookup(&flat_ids)?.to_dtype(DType::F32)?.detach();
        for layer in 0..self.blocks.len() {
            check_stop(stop)?;
            let next = self.composed_block(layer, &x, &context)?.detach();
            inputs.push(std::mem::replace(&mut x, next));
        }
        let trunk_out = candle_core::Var::from_tensor(&x)?;
        drop(x);
        let rows = trunk_out
            .as_tensor()
            .index_select(&positions.to_device(trunk_out.device())?, 0)?;
        let logits = self.composed_head(&rows)?;
        Ok(TrainForward::Recomputed(Box::new(Recomputed {
            model: self,
            adapter,
            flat_ids,
            shape,
            inputs,
            trunk_out,
            logits,
            stop,
        })))
    }

    /// The CPU engine's training forward of `batch` cut into blocks: each
    /// block's input a leaf of its own, so that the backward can go block
    /// by block ([`Segmented`]).
    fn segmented_forward<'a>(
        &self,
        batch: &TokenBatch,
        adapter: Option<&LoraAdapter>,
        stop: Option<StopCheck<'a>>,
    ) -> Result<TrainForward<'a>> {
        self.check_train_input(&batch.input_ids, adapter)?;
        let (ids, positions, layout) = packed_input(batch)?;
        let embedded = self.train_embed(&ids)?;
        let mut blocks = Vec::with_capacity(self.blocks.len());
        let mut x = embedded.clone();
        for layer in 0..self.blocks.len() {
            check_stop(stop)?;
            // A copy of the rows without the graph that made them.
            let input = Var::from_tensor(&x)?;
            x = self.train_block(layer, input.as_tensor(), &layout, adapter)?;
            blocks.push((input, x.clone()));
        }
        let trunk_out = Var::from_tensor(&x)?;
        drop(x);
        let logits = self.train_head(&trunk_out.as_tensor().index_select(&positions, 0)?)?;
        Ok(TrainForward::Segmented(Box::new(Segmented {
            embedded: embedded.track_op().then_some(embedded),
            blocks,
            trunk_out,
            logits,
            stop,
        })))
    }
}

/// The CPU engine's input of `batch`: the packed token ids (the shared
/// prefix once), the rows the loss reads, and the attention layout.
fn packed_input(batch: &TokenBatch) -> Result<(Tensor, Tensor, AttentionLayout)> {
    let packed = &batch.packed;
    let device = candle_core::Device::Cpu;
    Ok((
        Tensor::new(packed.input_ids.as_slice(), &device)?,
        Tensor::new(packed.positions.as_slice(), &device)?,
        AttentionLayout {
            prefix: packed.prefix_len,
            segments: packed.suffix_lens.clone(),
        },
    ))
}

/// What every block of one composed training forward shares.
struct BlockContext<'a> {
    shape: (usize, usize),
    routing: Routing<'a>,
    dtype: DType,
    /// Rotary tables of positions `[0, time)`.
    cos: Tensor,
    sin: Tensor,
    /// Causal, `(time, time)`; none for one token.
    mask: Option<Tensor>,
}

impl<'a> BlockContext<'a> {
    fn new(
        model: &CausalLm,
        (batch, time): (usize, usize),
        adapter: Option<&'a LoraAdapter>,
    ) -> Result<Self> {
        let device = model.rope_cos.device();
        Ok(Self {
            shape: (batch, time),
            routing: match adapter {
                Some(a) => Routing::All(a),
                None => Routing::Base,
            },
            dtype: model.compute_dtype(),
            cos: model.rope_cos.narrow(0, 0, time)?,
            sin: model.rope_sin.narrow(0, 0, time)?,
            mask: (time > 1)
                .then(|| causal_mask(time, 0, device))
                .transpose()?,
        })
    }
}

/// Training logits and how their backward pass runs: [`TrainForward::logits`]
/// go into the loss, [`TrainForward::backward`] takes the loss.
///
/// `Segmented` is the CPU engine's: the graph is cut at every block's
/// input, and the backward goes from the last block to the first, each a
/// backward of its own, so that a stop is seen between two blocks rather
/// than after the whole backward (seconds for a 135 M model). Where the
/// graph is cut a block's output gradient is passed on as it is, so the
/// gradients are one whole backward's: bit for bit for LoRA; a weight
/// used both before and after a cut (a tied embedding, in full
/// fine-tuning) sums its parts in another order.
///
/// `Recomputed` is activation checkpointing (Chen et al. 2016,
/// arXiv:1604.06174; PyTorch's `torch.utils.checkpoint` per decoder
/// layer, as TRL's `gradient_checkpointing` does): the forward keeps only
/// each block's input rows, and the backward goes block by block from the
/// last, recomputing the block's forward from its input and passing the
/// gradient of its output through it. So the memory is one block's
/// activations (for attention: its `time²` scores per head) plus
/// `layers · rows · hidden` floats, not every block's activations, for
/// the cost of one more forward. The gradients are those of the plain
/// backward (the same ops on the same values).
pub enum TrainForward<'a> {
    /// The whole graph kept: `loss.backward()`.
    Kept(Tensor),
    /// The whole graph kept, its backward block by block.
    Segmented(Box<Segmented<'a>>),
    /// Each block recomputed in the backward pass.
    Recomputed(Box<Recomputed<'a>>),
}

/// The state of a [`TrainForward::Segmented`] forward.
pub struct Segmented<'a> {
    /// The embedding rows, when they carry a gradient (full fine-tuning).
    embedded: Option<Tensor>,
    /// Each block's input (a leaf: a copy of the rows before it) and its
    /// output, with the block's graph between them.
    blocks: Vec<(Var, Tensor)>,
    /// The rows after the last block, as the leaf the head starts from.
    trunk_out: Var,
    logits: Tensor,
    stop: Option<StopCheck<'a>>,
}

/// The state of a [`TrainForward::Recomputed`] forward.
pub struct Recomputed<'a> {
    model: &'a CausalLm,
    adapter: Option<&'a LoraAdapter>,
    flat_ids: Tensor,
    shape: (usize, usize),
    /// `inputs[l]`: the rows entering block `l`, detached.
    inputs: Vec<Tensor>,
    /// The rows after the last block, as the leaf the head starts from.
    trunk_out: candle_core::Var,
    logits: Tensor,
    stop: Option<StopCheck<'a>>,
}

impl TrainForward<'_> {
    /// The logits, `(tokens, vocab)` in the batch's target order.
    pub fn logits(&self) -> &Tensor {
        match self {
            TrainForward::Kept(logits) => logits,
            TrainForward::Segmented(s) => &s.logits,
            TrainForward::Recomputed(r) => &r.logits,
        }
    }

    /// The gradients of `loss` (computed from [`TrainForward::logits`]) for
    /// every var it depends on; [`ModelError::Stopped`] when the forward's
    /// stop check says so between two blocks.
    pub fn backward(self, loss: &Tensor) -> Result<candle_core::backprop::GradStore> {
        let r = match self {
            TrainForward::Kept(_) => return Ok(loss.backward()?),
            TrainForward::Segmented(s) => return s.backward(loss),
            TrainForward::Recomputed(r) => r,
        };
        let mut grads = loss.backward()?;
        let mut upstream = grads.remove(r.trunk_out.as_tensor());
        let context = BlockContext::new(r.model, r.shape, r.adapter)?;
        for layer in (0..r.inputs.len()).rev() {
            let Some(grad_out) = upstream.take() else {
                break;
            };
            check_stop(r.stop)?;
            let input = candle_core::Var::from_tensor(&r.inputs[layer])?;
            let out = r.model.composed_block(layer, input.as_tensor(), &context)?;
            // d(sum(out · g))/d(out) = g: the block's vector-Jacobian product.
            let mut block_grads = (out * grad_out)?.sum_all()?.backward()?;
            upstream = block_grads.remove(input.as_tensor());
            grads.extend(block_grads)?;
        }
        // A trainable embedding (full fine-tuning) gets the rest.
        if let Some(grad_out) = upstream {
            let embedded = r.model.embed.lookup(&r.flat_ids)?.to_dtype(DType::F32)?;
            if embedded.track_op() {
                grads.extend((embedded * grad_out)?.sum_all()?.backward()?)?;
            }
        }
        Ok(grads)
    }
}

impl Segmented<'_> {
    /// The head's backward, then each block's from the last, its output's
    /// gradient the one its successor passed back.
    fn backward(self, loss: &Tensor) -> Result<candle_core::backprop::GradStore> {
        let mut grads = loss.backward()?;
        let mut upstream = grads.remove(self.trunk_out.as_tensor());
        // Each block's graph goes as soon as its backward is done.
        for (input, out) in self.blocks.into_iter().rev() {
            let Some(grad_out) = upstream.take() else {
                break;
            };
            check_stop(self.stop)?;
            // d(sum(out · g))/d(out) = g: the block's vector-Jacobian product.
            let mut block_grads = (out * grad_out)?.sum_all()?.backward()?;
            upstream = block_grads.remove(input.as_tensor());
            grads.extend(block_grads)?;
        }
        // A trainable embedding (full fine-tuning) gets the rest.
        if let (Some(embedded), Some(grad_out)) = (self.embedded, upstream) {
            grads.extend((embedded * grad_out)?.sum_all()?.backward()?)?;
        }
        Ok(grads)
    }
}
