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

use candle_core::{DType, Tensor};

use crate::lora::LoraAdapter;
use crate::model::{
    attend, causal_mask, rms_norm as composed_rms_norm, rope, BaseWeight, CausalLm, Embedding,
    Projection, Routing,
};
use crate::model_error::{ModelError, Result};
use crate::token_batch::TokenBatch;
use crate::train_ops::{self, AttentionLayout};

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

    /// The residual stream after the last block, one row per input token
    /// in `layout`'s order (before the final norm).
    fn train_trunk(
        &self,
        flat_ids: &Tensor,
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
        let mut x = match &self.embed {
            Embedding::Dense(w) => w.index_select(flat_ids, 0)?,
            Embedding::Quantized(q) => q.embedding(flat_ids)?,
        };
        for (layer, block) in self.blocks.iter().enumerate() {
            let h = train_ops::rms_norm(&x, &block.input_norm, eps)?;
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
            x = train_ops::residual(&x, &project(&block.o_proj, &attn, layer, adapter)?)?;
            let h = train_ops::rms_norm(&x, &block.post_attention_norm, eps)?;
            let gate = project(&block.gate_proj, &h, layer, adapter)?;
            let up = project(&block.up_proj, &h, layer, adapter)?;
            let inner = train_ops::swiglu(&gate, &up)?;
            x = train_ops::residual(&x, &project(&block.down_proj, &inner, layer, adapter)?)?;
        }
        Ok(x)
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
        let x = self.train_trunk(&flat_ids, &layout, adapter)?;
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
            let x = self.composed_trunk(&flat_ids, (batch, time), adapter)?;
            return self.composed_head(&x.index_select(&positions.to_device(x.device())?, 0)?);
        }
        let layout = AttentionLayout::padded(batch, time);
        let x = self.train_trunk(&flat_ids, &layout, adapter)?;
        self.train_head(&x.index_select(&positions, 0)?)
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
        if self.on_candle() {
            return self.forward_train_at(&batch.input_ids, adapter, &batch.positions);
        }
        // Checks the tokens, their length and the adapter.
        self.check_train_input(&batch.input_ids, adapter)?;
        let packed = &batch.packed;
        let device = candle_core::Device::Cpu;
        let ids = Tensor::new(packed.input_ids.as_slice(), &device)?;
        let positions = Tensor::new(packed.positions.as_slice(), &device)?;
        let layout = AttentionLayout {
            prefix: packed.prefix_len,
            segments: packed.suffix_lens.clone(),
        };
        let x = self.train_trunk(&ids, &layout, adapter)?;
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
        let x = self.composed_trunk(&flat_ids, (batch, time), adapter)?;
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
    /// RoPE and the attention softmax in f32.
    pub(crate) fn composed_trunk(
        &self,
        flat_ids: &Tensor,
        shape: (usize, usize),
        adapter: Option<&LoraAdapter>,
    ) -> Result<Tensor> {
        let context = BlockContext::new(self, shape, adapter)?;
        let mut x = self.embed.lookup(flat_ids)?.to_dtype(DType::F32)?;
        for layer in 0..self.blocks.len() {
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
    /// backward pass that recomputes the trunk's activations when
    /// `recompute` is set on the candle backend (activation checkpointing,
    /// see [`TrainForward`]); otherwise the plain forward.
    pub fn forward_train_for_backward<'a>(
        &'a self,
        batch: &TokenBatch,
        adapter: Option<&'a LoraAdapter>,
        recompute: bool,
    ) -> Result<TrainForward<'a>> {
        if !(recompute && self.on_candle()) {
            return Ok(TrainForward::Kept(
                self.forward_train_batch(batch, adapter)?,
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
        })))
    }
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
    /// Each block recomputed in the backward pass.
    Recomputed(Box<Recomputed<'a>>),
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
}

impl TrainForward<'_> {
    /// The logits, `(tokens, vocab)` in the batch's target order.
    pub fn logits(&self) -> &Tensor {
        match self {
            TrainForward::Kept(logits) => logits,
            TrainForward::Recomputed(r) => &r.logits,
        }
    }

    /// The gradients of `loss` (computed from [`TrainForward::logits`]) for
    /// every var it depends on.
    pub fn backward(self, loss: &Tensor) -> Result<candle_core::backprop::GradStore> {
        let r = match self {
            TrainForward::Kept(_) => return Ok(loss.backward()?),
            TrainForward::Recomputed(r) => r,
        };
        let mut grads = loss.backward()?;
        let mut upstream = grads.remove(r.trunk_out.as_tensor());
        let context = BlockContext::new(r.model, r.shape, r.adapter)?;
        for layer in (0..r.inputs.len()).rev() {
            let Some(grad_out) = upstream.take() else {
                break;
            };
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
