//! Fused candle ops for the training forward, each with its own backward
//! ([`candle_core::CustomOp2`]/[`candle_core::CustomOp3`]/
//! [`candle_core::CustomOp1`]), CPU and f32 only.
//!
//! Why: composed of candle's basic ops, the training forward spent most
//! of its backward on bookkeeping rather than arithmetic. Each basic op
//! allocates its output and, in the backward, a zero tensor plus a sum
//! for every gradient; candle computes the gradient of every operand,
//! including frozen base weights and the constant causal mask; the
//! attention softmax was five ops over `(batch, heads, time, time)`
//! tensors. Here every op computes only the gradients of operands that
//! track one ([`Tensor::track_op`]) and keeps its intermediates per
//! attention head, in cache, instead of in graph tensors.
//!
//! This module owns:
//! - [`linear`]: `y = s · x Wᵀ (+ b)`; no gradient is computed for a
//!   frozen `W` or `b`;
//! - [`rms_norm`]: RMSNorm with gradients for the input and the weight;
//! - [`swiglu`]: `silu(gate) ⊙ up`;
//! - [`causal_attention`]: RoPE on queries and keys, grouped-query causal
//!   attention over an [`AttentionLayout`] (right-padded blocks, or a
//!   shared prefix held once and the rows' own parts after it); takes and
//!   gives `(rows, heads · head_dim)`, as the projections do; its
//!   backward recomputes each head's probabilities (flash-attention
//!   style) instead of storing them;
//! - [`target_log_probs`] and [`entropy`] of logit rows: log-softmax,
//!   gather and `−Σ p log p` without materialising the log-softmax.
//!
//! Every op is checked against its composition of candle ops (values and
//! gradients) in this module's tests.

use std::sync::Arc;

use candle_core::backend::BackendStorage;
use candle_core::{
    bail, CpuStorage, CustomOp1, CustomOp2, CustomOp3, DType, Device, Layout, Result, Shape,
    Storage, Tensor,
};
use gemm::Parallelism;
use rayon::prelude::*;

mod attention;
mod dense;
mod logits;
mod matmul;

pub(crate) use attention::*;
pub(crate) use dense::*;
pub(crate) use logits::*;
pub(crate) use matmul::*;

#[cfg(test)]
mod tests {
    use candle_core::{DType, Var, D};

    use super::*;

    fn randn(shape: &[usize], seed: u64) -> Tensor {
        use rand::SeedableRng;
        use rand_distr::{Distribution, Normal};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let n: usize = shape.iter().product();
        let normal = Normal::new(0f32, 1.0).unwrap();
        let data: Vec<f32> = (0..n).map(|_| normal.sample(&mut rng)).collect();
        Tensor::from_vec(data, shape, &Device::Cpu).unwrap()
    }

    fn var(shape: &[usize], seed: u64) -> Var {
        Var::from_tensor(&randn(shape, seed)).unwrap()
    }

    fn max_abs_diff(a: &Tensor, b: &Tensor) -> f32 {
        assert_eq!(a.dims(), b.dims());
        (a - b)
            .unwrap()
            .abs()
            .unwrap()
            .flatten_all()
            .unwrap()
            .max(0)
            .unwrap()
            .to_scalar::<f32>()
            .unwrap()
    }

    fn max_abs(a: &Tensor) -> f32 {
        a.abs()
            .unwrap()
            .flatten_all()
            .unwrap()
            .max(0)
            .unwrap()
            .to_scalar::<f32>()
            .unwrap()
    }

    /// `Σ out ⊙ r` with a fixed random `r`: a loss whose gradient w.r.t.
    /// `out` is `r`, so every output element matters.
    fn probe_loss(out: &Tensor, seed: u64) -> Tensor {
        let r = randn(out.dims(), seed);
        (out * r).unwrap().sum_all().unwrap()
    }

    /// Checks values and the gradients of `vars` of a fused function
    /// against a composed one.
    fn check(
        vars: &[&Var],
        fused: impl Fn() -> Tensor,
        composed: impl Fn() -> Tensor,
        tolerance: f32,
    ) {
        let (a, b) = (fused(), composed());
        let scale = max_abs(&b).max(1.0);
        let diff = max_abs_diff(&a, &b);
        assert!(diff <= tolerance * scale, "values differ by {diff}");
        let ga = probe_loss(&a, 99).backward().unwrap();
        let gb = probe_loss(&b, 99).backward().unwrap();
        for (i, v) in vars.iter().enumerate() {
            let ga = ga.get(v.as_tensor()).expect("fused gradient");
            let gb = gb.get(v.as_tensor()).expect("composed gradient");
            let scale = max_abs(gb).max(1e-3);
            let diff = max_abs_diff(ga, gb);
            assert!(
                diff <= tolerance * scale,
                "gradient of operand {i} differs by {diff} (scale {scale})"
            );
        }
    }

    #[test]
    fn linear_matches_matmul_with_and_without_bias() {
        let x = var(&[7, 5], 1);
        let w = var(&[3, 5], 2);
        let b = var(&[3], 3);
        check(
            &[&x, &w, &b],
            || linear(&x, &w, Some(&b)).unwrap(),
            || {
                x.matmul(&w.t().unwrap())
                    .unwrap()
                    .broadcast_add(&b)
                    .unwrap()
            },
            1e-5,
        );
        check(
            &[&x, &w],
            || scaled_linear(&x, &w, 0.5).unwrap(),
            || (x.matmul(&w.t().unwrap()).unwrap() * 0.5).unwrap(),
            1e-5,
        );
        // A transposed (strided) input works without a copy.
        let xt = var(&[5, 7], 4);
        check(
            &[&xt, &w],
            || linear(&xt.t().unwrap(), &w, None).unwrap(),
            || xt.t().unwrap().matmul(&w.t().unwrap()).unwrap(),
            1e-5,
        );
    }

    #[test]
    fn a_frozen_weight_gets_no_gradient() {
        let x = var(&[4, 6], 5);
        let w = randn(&[2, 6], 6);
        let b = randn(&[2], 7);
        let grads = probe_loss(&linear(&x, &w, Some(&b)).unwrap(), 1)
            .backward()
            .unwrap();
        assert!(grads.get(&w).is_none());
        assert!(grads.get(&b).is_none());
        let want = randn(&[4, 2], 1).matmul(&w).unwrap();
        assert!(max_abs_diff(grads.get(x.as_tensor()).unwrap(), &want) < 1e-5);
    }

    #[test]
    fn lora_linear_matches_its_composition() {
        let x = var(&[9, 6], 21);
        let w = randn(&[5, 6], 22);
        let bias = randn(&[5], 23);
        let a = var(&[3, 6], 24);
        let b = var(&[5, 3], 25);
        check(
            &[&x, &a, &b],
            || lora_linear(&x, &w, Some(&bias), (&a, &b), 0.7).unwrap(),
            || {
                let base = x
                    .matmul(&w.t().unwrap())
                    .unwrap()
                    .broadcast_add(&bias)
                    .unwrap();
                let low = x.matmul(&a.t().unwrap()).unwrap();
                (base + (low.matmul(&b.t().unwrap()).unwrap() * 0.7).unwrap()).unwrap()
            },
            1e-5,
        );
        let grads = probe_loss(&lora_linear(&x, &w, None, (&a, &b), 0.7).unwrap(), 2)
            .backward()
            .unwrap();
        assert!(grads.get(&w).is_none());
    }

    #[test]
    fn residual_matches_add() {
        let a = var(&[3, 40_000], 26);
        let b = var(&[3, 40_000], 27);
        check(
            &[&a, &b],
            || residual(&a, &b).unwrap(),
            || (a.as_tensor() + b.as_tensor()).unwrap(),
            1e-6,
        );
    }

    #[test]
    fn rms_norm_matches_its_composition() {
        let x = var(&[2, 9, 16], 8);
        let w = var(&[16], 9);
        let eps = 1e-6;
        check(
            &[&x, &w],
            || rms_norm(&x, &w, eps).unwrap(),
            || {
                let ms = x.sqr().unwrap().mean_keepdim(D::Minus1).unwrap();
                let inv = (ms + eps).unwrap().sqrt().unwrap().recip().unwrap();
                x.broadcast_mul(&inv).unwrap().broadcast_mul(&w).unwrap()
            },
            1e-5,
        );
    }

    #[test]
    fn swiglu_matches_silu_times_up() {
        let g = var(&[6, 10], 10);
        let u = var(&[6, 10], 11);
        check(
            &[&g, &u],
            || swiglu(&g, &u).unwrap(),
            || (g.silu().unwrap() * u.as_tensor()).unwrap(),
            1e-5,
        );
    }

    /// Causal attention from candle ops: RoPE, repeated key/value heads,
    /// masked softmax (the composition the model used before).
    #[allow(clippy::too_many_arguments)]
    fn composed_attention(
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        (b, t): (usize, usize),
        (h, kvh, d): (usize, usize, usize),
        cos: &Tensor,
        sin: &Tensor,
    ) -> Tensor {
        let rope = |x: &Tensor| {
            let half = d / 2;
            let cos = Tensor::cat(&[cos, cos], D::Minus1).unwrap();
            let sin = Tensor::cat(&[sin, sin], D::Minus1).unwrap();
            let x1 = x.narrow(D::Minus1, 0, half).unwrap();
            let x2 = x.narrow(D::Minus1, half, half).unwrap();
            let rotated = Tensor::cat(&[&x2.neg().unwrap(), &x1], D::Minus1).unwrap();
            (x.broadcast_mul(&cos).unwrap() + rotated.broadcast_mul(&sin).unwrap()).unwrap()
        };
        let split = |m: &Tensor, n: usize| {
            m.reshape((b, t, n, d))
                .unwrap()
                .transpose(1, 2)
                .unwrap()
                .contiguous()
                .unwrap()
        };
        let rep = h / kvh;
        let repeat = |m: Tensor| {
            // (b, kvh, t, d) -> (b, h, t, d), head i uses group i / rep.
            let parts: Vec<Tensor> = (0..h).map(|i| m.narrow(1, i / rep, 1).unwrap()).collect();
            Tensor::cat(&parts, 1).unwrap()
        };
        let q = rope(&split(q, h));
        let k = repeat(rope(&split(k, kvh)));
        let v = repeat(split(v, kvh));
        let mask: Vec<f32> = (0..t)
            .flat_map(|i| (0..t).map(move |j| if j <= i { 0.0 } else { f32::NEG_INFINITY }))
            .collect();
        let mask = Tensor::from_vec(mask, (t, t), &Device::Cpu).unwrap();
        let scores = (q.matmul(&k.t().unwrap()).unwrap() * (1.0 / (d as f64).sqrt()))
            .unwrap()
            .broadcast_add(&mask)
            .unwrap();
        let probs = candle_nn::ops::softmax(&scores, D::Minus1).unwrap();
        probs
            .matmul(&v)
            .unwrap()
            .transpose(1, 2)
            .unwrap()
            .reshape((b * t, h * d))
            .unwrap()
    }

    #[test]
    fn causal_attention_matches_its_composition() {
        let (b, t, h, kvh, d) = (2, 11, 4, 2, 8);
        let q = var(&[b * t, h * d], 12);
        let k = var(&[b * t, kvh * d], 13);
        let v = var(&[b * t, kvh * d], 14);
        let angles = randn(&[t + 3, d / 2], 15);
        let (cos, sin) = (angles.cos().unwrap(), angles.sin().unwrap());
        let (cos_t, sin_t) = (cos.narrow(0, 0, t).unwrap(), sin.narrow(0, 0, t).unwrap());
        check(
            &[&q, &k, &v],
            || {
                let layout = AttentionLayout::padded(b, t);
                causal_attention(&q, &k, &v, &layout, (h, kvh, d), (&cos, &sin)).unwrap()
            },
            || composed_attention(&q, &k, &v, (b, t), (h, kvh, d), &cos_t, &sin_t),
            1e-4,
        );
    }

    #[test]
    fn causal_attention_never_looks_ahead() {
        // Changing the last position of a sequence changes no earlier output.
        let (b, t, h, kvh, d) = (1, 6, 2, 1, 4);
        let q = randn(&[b * t, h * d], 16);
        let k = randn(&[b * t, kvh * d], 17);
        let v = randn(&[b * t, kvh * d], 18);
        let angles = randn(&[t, d / 2], 19);
        let (cos, sin) = (angles.cos().unwrap(), angles.sin().unwrap());
        let run = |k: &Tensor, v: &Tensor| {
            let layout = AttentionLayout::padded(b, t);
            causal_attention(&q, k, v, &layout, (h, kvh, d), (&cos, &sin))
                .unwrap()
                .narrow(0, 0, t - 1)
                .unwrap()
        };
        let bump = |m: &Tensor| {
            let last = (m.narrow(0, t - 1, 1).unwrap() + 5.0).unwrap();
            Tensor::cat(&[&m.narrow(0, 0, t - 1).unwrap(), &last], 0).unwrap()
        };
        assert_eq!(max_abs_diff(&run(&k, &v), &run(&bump(&k), &bump(&v))), 0.0);
    }

    #[test]
    fn a_shared_prefix_attends_as_it_does_in_every_padded_row() {
        // Three sequences opening with the same 5 rows, then 3, 1 and 4
        // rows of their own: packed once, against the padded block built
        // from the same rows (index_select, so the padded prefix rows'
        // gradients sum back into the packed ones).
        let (prefix, own, h, kvh, d) = (5, [3usize, 1, 4], 4, 2, 8);
        let rows = prefix + own.iter().sum::<usize>();
        let t = prefix + own.iter().max().unwrap();
        let q = var(&[rows, h * d], 21);
        let k = var(&[rows, kvh * d], 22);
        let v = var(&[rows, kvh * d], 23);
        let angles = randn(&[t + 2, d / 2], 24);
        let (cos, sin) = (angles.cos().unwrap(), angles.sin().unwrap());
        // Row of the packed layout at padded position (b, p); padding
        // repeats the sequence's last row.
        let mut padded_rows = Vec::new();
        let mut packed_of_padded = Vec::new();
        let mut start = prefix;
        for (b, &n) in own.iter().enumerate() {
            for p in 0..t {
                let own_p = p.saturating_sub(prefix).min(n - 1);
                padded_rows.push(if p < prefix { p } else { start + own_p } as u32);
            }
            for p in prefix..prefix + n {
                packed_of_padded.push((b * t + p) as u32);
            }
            start += n;
        }
        let padded_rows = Tensor::new(padded_rows.as_slice(), &Device::Cpu).unwrap();
        // Packed order of the padded outputs: the prefix (from the first
        // sequence), then each sequence's own rows.
        let mut order: Vec<u32> = (0..prefix as u32).collect();
        order.extend(packed_of_padded);
        let order = Tensor::new(order.as_slice(), &Device::Cpu).unwrap();
        let layout = AttentionLayout {
            prefix,
            segments: own.to_vec(),
        };
        assert_eq!(layout.rows(), rows);
        check(
            &[&q, &k, &v],
            || causal_attention(&q, &k, &v, &layout, (h, kvh, d), (&cos, &sin)).unwrap(),
            || {
                let pad = |m: &Var| m.as_tensor().index_select(&padded_rows, 0).unwrap();
                let block = AttentionLayout::padded(own.len(), t);
                causal_attention(
                    &pad(&q),
                    &pad(&k),
                    &pad(&v),
                    &block,
                    (h, kvh, d),
                    (&cos, &sin),
                )
                .unwrap()
                .index_select(&order, 0)
                .unwrap()
            },
            1e-5,
        );
    }

    #[test]
    fn target_log_probs_and_entropy_match_log_softmax() {
        let z = var(&[5, 13], 20);
        let targets = Tensor::new(&[0u32, 12, 3, 3, 7], &Device::Cpu).unwrap();
        check(
            &[&z],
            || target_log_probs(&z, &targets).unwrap(),
            || {
                candle_nn::ops::log_softmax(&z, D::Minus1)
                    .unwrap()
                    .gather(&targets.unsqueeze(1).unwrap(), 1)
                    .unwrap()
                    .squeeze(1)
                    .unwrap()
            },
            1e-5,
        );
        check(
            &[&z],
            || entropy(&z).unwrap(),
            || {
                let log_p = candle_nn::ops::log_softmax(&z, D::Minus1).unwrap();
                (log_p.exp().unwrap() * &log_p)
                    .unwrap()
                    .sum(1)
                    .unwrap()
                    .neg()
                    .unwrap()
            },
            1e-5,
        );
        let bad = Tensor::new(&[0u32, 13, 0, 0, 0], &Device::Cpu).unwrap();
        assert!(target_log_probs(&z.to_dtype(DType::F32).unwrap(), &bad).is_err());
    }
}
