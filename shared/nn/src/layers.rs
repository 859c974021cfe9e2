//! The dense layers every network here is built from: [`Dense`] (one
//! layer's weight and bias `Var`s), their creation and init
//! ([`new_layer`], [`LayerBuilder`]), and their two forward paths: the
//! graph-free host path that inference takes ([`dense_host`],
//! [`trunk_host`], [`mlp_host`]: weights read in place, the hand-written
//! kernel for small batches, candle's gemm above
//! [`HOST_KERNEL_MAX_BATCH`] rows) and the differentiable graph of fused
//! linear ops that training takes ([`trunk_graph`], [`head_graph`]).
//!
//! Its own module so that the networks ([`crate::model`], [`crate::conv`],
//! [`crate::recurrent`], [`crate::qnet`], [`crate::sac`]) all build on it
//! and none has to import another network's file for its layers.

use std::borrow::Cow;

use candle_core::{CpuStorage, Device, Storage, Tensor, Var};

use crate::error::Result;
use crate::init::{Init, LayerInit};
use crate::kernels;
use crate::ops::{self, cpu_f32};
use crate::spec::Activation;

/// Largest batch for which [`crate::ActorCritic::act`] /
/// [`crate::ActorCritic::values`] use the hand-written dense kernel;
/// larger batches call candle's gemm.
pub const HOST_KERNEL_MAX_BATCH: usize = 16;

/// One dense layer's parameters (PyTorch layout: `w: [out, in]`, `b: [out]`).
#[derive(Clone)]
pub(crate) struct Dense {
    pub(crate) w: Var,
    pub(crate) b: Var,
}

/// The contiguous f32 data of a CPU var's storage guard.
pub(crate) fn storage_f32<'a>(s: &'a Storage, l: &candle_core::Layout) -> Result<&'a [f32]> {
    match s {
        Storage::Cpu(s) => Ok(cpu_f32(s, l, "parameter")?),
        _ => Err(candle_core::Error::Msg("parameters must live on the CPU".into()).into()),
    }
}

/// A layer's weight (`shape`, `[out, ...]`; fan-in the product of the rest)
/// and bias `[out]`, drawn as `how` says and registered in `params` as
/// `{name}.weight` and `{name}.bias`.
pub(crate) fn new_layer(
    name: &str,
    shape: &[usize],
    how: LayerInit,
    init: &mut Init<'_>,
    params: &mut Vec<(String, Var)>,
    device: &Device,
) -> Result<Dense> {
    let out = shape[0];
    let (w, b) = init.layer(how, out, shape[1..].iter().product());
    let w = Var::from_vec(w, shape, device)?;
    let b = Var::from_vec(b, out, device)?;
    params.push((format!("{name}.weight"), w.clone()));
    params.push((format!("{name}.bias"), b.clone()));
    Ok(Dense { w, b })
}

/// One dense layer `act(x W^T + b)` without a graph, weights read in place.
///
/// Batches of at most [`HOST_KERNEL_MAX_BATCH`] rows use the hand-written
/// dense kernel (no allocation beyond the output); larger ones call candle's
/// CPU gemm directly on the storages (no tensors, no graph).
pub(crate) fn dense_host(
    layer: &Dense,
    x: Cow<'_, [f32]>,
    n: usize,
    width: usize,
    act: Option<Activation>,
) -> Result<Vec<f32>> {
    let (wg, wl) = layer.w.storage_and_layout();
    let (bg, bl) = layer.b.storage_and_layout();
    let b = storage_f32(&bg, bl)?;
    if n <= HOST_KERNEL_MAX_BATCH {
        let w = storage_f32(&wg, wl)?;
        let mut out = vec![0f32; n * b.len()];
        kernels::dense(&x, width, w, b, &mut out, act);
        Ok(out)
    } else {
        let Storage::Cpu(ws) = &*wg else {
            return Err(candle_core::Error::Msg("parameters must live on the CPU".into()).into());
        };
        let xl = candle_core::Layout::contiguous((n, width));
        Ok(ops::linear_cpu(
            &CpuStorage::F32(x.into_owned()),
            &xl,
            ws,
            wl,
            b,
            act,
        )?)
    }
}

/// Hidden layers of an MLP without a graph; returns the last hidden
/// activations (or a copy of `x` when there are no hidden layers) and their width.
pub(crate) fn trunk_host<'a>(
    layers: &[Dense],
    act: Activation,
    x: &'a [f32],
    n: usize,
    in_dim: usize,
) -> Result<(Cow<'a, [f32]>, usize)> {
    let mut cur: Cow<'_, [f32]> = Cow::Borrowed(x);
    let mut width = in_dim;
    for layer in layers {
        let out = dense_host(layer, cur, n, width, Some(act))?;
        width = layer.b.elem_count();
        cur = Cow::Owned(out);
    }
    Ok((cur, width))
}

/// Forward of one MLP (hidden layers, then a linear head) without a graph.
pub(crate) fn mlp_host(
    layers: &[Dense],
    head: &Dense,
    act: Activation,
    x: &[f32],
    n: usize,
    in_dim: usize,
) -> Result<Vec<f32>> {
    let (h, width) = trunk_host(layers, act, x, n, in_dim)?;
    dense_host(head, h, n, width, None)
}

/// Hidden layers as a differentiable graph of fused linear ops.
pub(crate) fn trunk_graph(x: &Tensor, layers: &[Dense], act: Activation) -> Result<Tensor> {
    let mut h = x.clone();
    for l in layers {
        h = ops::linear(&h, &l.w, &l.b, Some(act))?;
    }
    Ok(h)
}

/// A linear head as a differentiable graph node.
pub(crate) fn head_graph(x: &Tensor, head: &Dense) -> Result<Tensor> {
    Ok(ops::linear(x, &head.w, &head.b, None)?)
}

/// Builds dense layers with PyTorch's default init and records their names.
pub(crate) struct LayerBuilder<'a> {
    pub(crate) params: Vec<(String, Var)>,
    pub(crate) init: Init<'a>,
    /// Where the parameters are placed.
    pub(crate) device: Device,
}

impl LayerBuilder<'_> {
    pub(crate) fn dense(&mut self, name: &str, inp: usize, out: usize) -> Result<Dense> {
        new_layer(
            name,
            &[out, inp],
            LayerInit::FanIn,
            &mut self.init,
            &mut self.params,
            &self.device,
        )
    }

    /// Hidden layers `{prefix}.{2i}` from `inp` through `hidden`.
    pub(crate) fn trunk(
        &mut self,
        prefix: &str,
        inp: usize,
        hidden: &[usize],
    ) -> Result<Vec<Dense>> {
        let mut width = inp;
        let mut layers = Vec::with_capacity(hidden.len());
        for (i, &h) in hidden.iter().enumerate() {
            layers.push(self.dense(&format!("{prefix}.{}", 2 * i), width, h)?);
            width = h;
        }
        Ok(layers)
    }
}
