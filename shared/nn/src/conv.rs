//! The convolutional features extractor of image policies (a [`CnnSpec`]):
//! a plain stack of convolutions (Stable-Baselines3's `NatureCNN` by
//! default) or IMPALA's ResNet, each with its training graph and its
//! graph-free inference path. [`crate::ActorCritic`] and
//! [`crate::QNetwork`] put it in front of their hidden layers.
//!
//! # How a convolution runs
//! Each convolution is `im2col` (every receptive field copied out as one row
//! of a `[B * out_h * out_w, C * k * k]` patch matrix) times the kernel read
//! as `[out, C * k * k]`, through candle's gemm, with bias and ReLU in place:
//! nearly all the work is the matmul. It runs in chunks of samples whose
//! patch matrix stays under [`HOST_CHUNK_VALUES`], in training too (one
//! graph op, `ConvOp`, whose backward pass rebuilds each chunk's patches
//! for the kernel gradient and scatter-adds the input gradient with
//! `col2im`): the patch matrix of a whole batch (100 MiB for NatureCNN's
//! first layer at batch 256) is never built, and glibc reuses each chunk's
//! block for the next instead of mapping fresh pages.
//!
//! Padding (IMPALA's 3x3 convolutions keep the image size) is zeros that
//! `im2col` writes into the patches and `col2im` skips: no padded copy of
//! the input is made. A residual block's first convolution reads
//! `relu(x)`: `im2col` applies the ReLU as it copies (and the backward pass
//! masks the input gradient with `x > 0`), so `relu(x)` is never stored.
//!
//! A convolution's output is `[B, out_h, out_w, C]` (channels last), so the
//! next one reads channels-last input, with patch columns in `(ky, kx, c)`
//! order (the kernel permuted to match), so that every run it copies is
//! contiguous. NatureCNN's first convolution reads the observation channels
//! first, as Gymnasium (after relay's worker) and PyTorch lay images out,
//! in PyTorch's `(c, ky, kx)` order (runs of `k` = 8 pixels); IMPALA's
//! first 3x3 kernel would copy runs of 3, so IMPALA transposes the
//! observation to channels last once, scaled by 1/255 on the way. Before
//! the dense layer the features are permuted to channels first, so
//! flattening matches PyTorch's `nn.Flatten` and a PyTorch state dict loads
//! as is.
//!
//! # IMPALA's max-pool and residual adds
//! The 3x3/2 max-pool (padding 1, which never wins) is its own graph op on
//! channels-last values: the forward pass records, for every output, the
//! index of its maximum in the input sample (the first in window order on
//! ties, as PyTorch), and the backward pass scatter-adds the gradient there.
//! The residual adds and the ReLU after the last stack are candle's.
//!
//! # Parameters
//! Names are those of a Stable-Baselines3 features extractor whose modules
//! are `cnn` (an `nn.Sequential`) and `linear` (`nn.Sequential(nn.Linear,
//! nn.ReLU)`): SB3's `NatureCNN` exactly, and for IMPALA CleanRL's
//! `ConvSequence` / `ResidualBlock` modules (`ppo_procgen.py`) inside `cnn`.
//!
//! | architecture | name | shape |
//! |---|---|---|
//! | `nature` | `features_extractor.cnn.{2i}.weight` / `.bias` | `[conv[i].channels, in, k, k]` / `[conv[i].channels]` |
//! | `impala` | `features_extractor.cnn.{i}.conv.weight` / `.bias` | `[channels[i], in, 3, 3]` / `[channels[i]]` |
//! | `impala` | `features_extractor.cnn.{i}.res_block{j}.conv0.weight` / `.bias` (and `conv1`) | `[channels[i], channels[i], 3, 3]` / `[channels[i]]` |
//! | both | `features_extractor.linear.0.weight` / `.bias` | `[features_dim, flat]` / `[features_dim]` |
//!
//! (`{2i}` because `nn.Sequential` interleaves ReLU modules; `in` is the
//! previous layer's channels, the image's for the first; `j` counts the
//! residual blocks of stack `i`; `flat` is channels x height x width after
//! the body.) Init: orthogonal with gain √2 and zero biases in an
//! actor-critic (SB3's `ortho_init`), PyTorch's default in a Q-network
//! (SB3's DQN).

use std::borrow::Cow;
use std::sync::OnceLock;

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, CustomOp3, Device, Layout, Shape, Storage, Tensor, Var};

use crate::error::Result;
use crate::init::{Init, LayerInit};
use crate::kernels;
use crate::model::{dense_host, new_layer, Dense};
use crate::ops::{self, cpu_f32, with_f32};
use crate::spec::{Activation, CnnArch, CnnSpec};

/// Name prefix of the extractor's parameters (SB3's).
pub const CNN_PREFIX: &str = "features_extractor";

/// Largest patch matrix (in f32 values, 16 MiB) one chunk of a graph-free
/// forward builds: glibc's malloc then reuses the freed block for the next
/// chunk (its mmap threshold grows to 32 MiB) instead of mapping and
/// page-faulting a fresh one, and the patches are read back while still
/// in cache.
pub const HOST_CHUNK_VALUES: usize = 4 << 20;

/// What raw pixels are multiplied by before the first layer.
const PIXEL_SCALE: f32 = 1.0 / 255.0;

/// Where one convolution (or max-pool) reads and what it writes, per sample.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Geometry {
    channels: usize,
    height: usize,
    width: usize,
    kernel: usize,
    stride: usize,
    /// Zero (convolution) or ignored (max-pool) border on every side.
    pad: usize,
    out_h: usize,
    out_w: usize,
    /// Input laid out `(H, W, C)` (the previous layer's output) rather than
    /// `(C, H, W)` (the observation). Patch columns follow the input:
    /// `(ky, kx, c)` for channels-last, `(c, ky, kx)` (PyTorch's kernel
    /// order) for channels-first, so that every run copied is contiguous.
    channels_last: bool,
}

impl Geometry {
    fn new(
        input: [usize; 3],
        kernel: usize,
        stride: usize,
        pad: usize,
        channels_last: bool,
    ) -> Self {
        let [c, h, w] = input;
        Self {
            channels: c,
            height: h,
            width: w,
            kernel,
            stride,
            pad,
            out_h: (h + 2 * pad - kernel) / stride + 1,
            out_w: (w + 2 * pad - kernel) / stride + 1,
            channels_last,
        }
    }

    fn sample_len(&self) -> usize {
        self.channels * self.height * self.width
    }

    fn patch_len(&self) -> usize {
        self.channels * self.kernel * self.kernel
    }

    fn patches(&self) -> usize {
        self.out_h * self.out_w
    }

    /// Calls `f(patch_offset, input_offset, len)` for every contiguous run
    /// of every patch of one sample, in patch order: `len` values of the
    /// input starting at `Some(input_offset)` are patch values
    /// `patch_offset..patch_offset + len` (offsets into the sample's
    /// `[patches, patch_len]` block); with `None` they are padding, zeros.
    #[inline]
    fn for_each_run(&self, mut f: impl FnMut(usize, Option<usize>, usize)) {
        let (k, s, p) = (self.kernel, self.stride, self.pad);
        let (h, w) = (self.height, self.width);
        // A kernel row is `k` pixels of `unit` values; channels-first input
        // repeats the rows once per channel plane.
        let (unit, planes, plane) = if self.channels_last {
            (self.channels, 1, 0)
        } else {
            (1, self.channels, h * w)
        };
        let mut at = 0;
        for oy in 0..self.out_h {
            for ox in 0..self.out_w {
                // Pixels of the kernel row left and right of the image.
                let left = p.saturating_sub(ox * s).min(k);
                let right = (ox * s + k).saturating_sub(p + w).min(k - left);
                let mid = k - left - right;
                for plane_at in (0..planes).map(|i| i * plane) {
                    for ky in 0..k {
                        // Wraps to above `h` when the row is in the top padding.
                        let y = (oy * s + ky).wrapping_sub(p);
                        if y >= h {
                            f(at, None, k * unit);
                        } else {
                            if left > 0 {
                                f(at, None, left * unit);
                            }
                            if mid > 0 {
                                let x = ox * s + left - p;
                                f(
                                    at + left * unit,
                                    Some(plane_at + (y * w + x) * unit),
                                    mid * unit,
                                );
                            }
                            if right > 0 {
                                f(at + (left + mid) * unit, None, right * unit);
                            }
                        }
                        at += k * unit;
                    }
                }
            }
        }
    }
}

/// What `im2col` applies to each input value it copies.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Pre {
    /// Times this factor: [`PIXEL_SCALE`] for raw pixels, 1 for the rest.
    Scale(f32),
    /// `max(x, 0)`: a residual block's pre-activation.
    Relu,
}

impl Pre {
    /// The input gradient through `self`, in place: `gx` is the gradient at
    /// the transformed values, `x` the input.
    fn backward(self, x: &[f32], gx: &mut [f32]) {
        match self {
            Pre::Scale(1.0) => {}
            Pre::Scale(s) => gx.iter_mut().for_each(|v| *v *= s),
            // relu(x) > 0 exactly where x > 0.
            Pre::Relu => {
                let g = gx.to_vec();
                kernels::relu_grad(x, &g, gx);
            }
        }
    }
}

/// `[n, sample_len]` -> `[n * patches, patch_len]`, every value through `pre`.
fn im2col(x: &[f32], n: usize, g: &Geometry, pre: Pre) -> Vec<f32> {
    let (block, sl) = (g.patches() * g.patch_len(), g.sample_len());
    // Runs come in patch order, so the matrix is appended, never zeroed first.
    let mut cols = Vec::with_capacity(n * block);
    for sample in x.chunks_exact(sl).take(n) {
        g.for_each_run(|_, from, len| {
            let Some(from) = from else {
                cols.resize(cols.len() + len, 0.0);
                return;
            };
            let src = &sample[from..from + len];
            match pre {
                Pre::Scale(1.0) => cols.extend_from_slice(src),
                Pre::Scale(s) => cols.extend(src.iter().map(|&v| v * s)),
                Pre::Relu => cols.extend(src.iter().map(|&v| v.max(0.0))),
            }
        });
    }
    debug_assert_eq!(cols.len(), n * block);
    cols
}

/// The adjoint of [`im2col`] (without its `pre`): scatter-adds patch
/// gradients back to the input (padding's are dropped).
fn col2im(cols: &[f32], n: usize, g: &Geometry) -> Vec<f32> {
    let (block, sl) = (g.patches() * g.patch_len(), g.sample_len());
    let mut x = vec![0f32; n * sl];
    for (sample, grad) in x.chunks_exact_mut(sl).zip(cols.chunks_exact(block)) {
        g.for_each_run(|to, from, len| {
            if let Some(from) = from {
                let (dst, src) = (&mut sample[from..from + len], &grad[to..to + len]);
                dst.iter_mut().zip(src).for_each(|(d, &v)| *d += v);
            }
        });
    }
    x
}

/// Max-pool of `n` channels-last samples `[n, sample_len]` (padding never
/// wins) -> `[n, out_h * out_w * channels]`; with `argmax`, also the index
/// in its sample of each output's maximum (the first in window order on
/// ties, as PyTorch).
fn max_pool(x: &[f32], n: usize, g: &Geometry, mut argmax: Option<&mut Vec<u32>>) -> Vec<f32> {
    debug_assert!(g.channels_last && g.pad < g.kernel);
    let (c, h, w, k, s, p) = (g.channels, g.height, g.width, g.kernel, g.stride, g.pad);
    let out_len = g.patches() * c;
    let mut y = Vec::with_capacity(n * out_len);
    if let Some(a) = argmax.as_deref_mut() {
        a.clear();
        a.reserve(n * out_len);
    }
    // The in-image part of a window: `lo..hi` of a row or column.
    let span = |o: usize, size: usize| ((o * s).saturating_sub(p), (o * s + k - p).min(size));
    for sample in x.chunks_exact(g.sample_len()).take(n) {
        for oy in 0..g.out_h {
            let (y0, y1) = span(oy, h);
            for ox in 0..g.out_w {
                let (x0, x1) = span(ox, w);
                // The window's first pixel, then the rest against it.
                let (start, first) = (y.len(), (y0 * w + x0) * c);
                y.extend_from_slice(&sample[first..first + c]);
                if let Some(a) = argmax.as_deref_mut() {
                    a.extend((first..first + c).map(|i| i as u32));
                }
                let best = &mut y[start..];
                for iy in y0..y1 {
                    for ix in x0..x1 {
                        let at = (iy * w + ix) * c;
                        let pixel = &sample[at..at + c];
                        match argmax.as_deref_mut() {
                            None => best.iter_mut().zip(pixel).for_each(|(m, &v)| *m = m.max(v)),
                            Some(a) => {
                                let a = &mut a[start..];
                                for (ch, (m, &v)) in best.iter_mut().zip(pixel).enumerate() {
                                    if v > *m {
                                        *m = v;
                                        a[ch] = (at + ch) as u32;
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
    }
    y
}

/// `[n, a * b]` -> `[n, b * a]`: each sample's `a x b` matrix transposed,
/// times `scale` (channels first to channels last and back).
fn transpose_samples(x: &[f32], n: usize, a: usize, b: usize, scale: f32) -> Vec<f32> {
    let mut out = vec![0f32; n * a * b];
    for (src, dst) in x.chunks_exact(a * b).zip(out.chunks_exact_mut(a * b)) {
        for (i, row) in src.chunks_exact(b).enumerate() {
            for (j, &v) in row.iter().enumerate() {
                dst[j * a + i] = v * scale;
            }
        }
    }
    out
}

/// One convolution as a graph op: `x: [n, sample_len]`, the kernel `w:
/// [out, patch_len]` (patch column order), `b: [out]` -> `[n * patches,
/// out]` (channels last), ReLU after when `relu`. Forward and backward run
/// in chunks of samples whose patch matrices stay under
/// [`HOST_CHUNK_VALUES`]: the patch matrix of the whole batch (100 MiB for
/// NatureCNN's first layer at batch 256) is never built, and the backward
/// pass rebuilds each chunk's patches rather than keeping them.
struct ConvOp {
    geometry: Geometry,
    /// What `im2col` applies to the input.
    pre: Pre,
    /// ReLU on the output.
    relu: bool,
    /// Largest patch matrix of one chunk, in values ([`HOST_CHUNK_VALUES`]).
    chunk_values: usize,
}

impl ConvOp {
    fn chunk_samples(&self) -> usize {
        let g = &self.geometry;
        (self.chunk_values / (g.patches() * g.patch_len())).max(1)
    }
}

/// The f32 result of a CPU matmul.
fn matmul_f32(
    a: Vec<f32>,
    b: &CpuStorage,
    bmnk: (usize, usize, usize, usize),
    al: &Layout,
    bl: &Layout,
) -> candle_core::Result<Vec<f32>> {
    match CpuStorage::F32(a).matmul(b, bmnk, al, bl)? {
        CpuStorage::F32(v) => Ok(v),
        _ => candle_core::bail!("conv: matmul returned a non-f32 result"),
    }
}

impl CustomOp3 for ConvOp {
    fn name(&self) -> &'static str {
        "relay-conv"
    }

    fn cpu_fwd(
        &self,
        xs: &CpuStorage,
        xl: &Layout,
        ws: &CpuStorage,
        wl: &Layout,
        bs: &CpuStorage,
        bl: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let g = &self.geometry;
        let (n, len) = xl.shape().dims2()?;
        let (out, pl) = wl.shape().dims2()?;
        if len != g.sample_len() || pl != g.patch_len() {
            candle_core::bail!(
                "conv: input rows of {len} values and a kernel of {pl} columns, expected {} and {}",
                g.sample_len(),
                g.patch_len()
            )
        }
        let x = cpu_f32(xs, xl, "conv input")?;
        let bias = cpu_f32(bs, bl, "conv bias")?;
        let mut y = Vec::with_capacity(n * g.patches() * out);
        for part in x.chunks(self.chunk_samples() * len) {
            let rows = part.len() / len * g.patches();
            let cols = im2col(part, part.len() / len, g, self.pre);
            y.extend(ops::linear_cpu(
                &CpuStorage::F32(cols),
                &Layout::contiguous((rows, pl)),
                ws,
                wl,
                bias,
                self.relu.then_some(Activation::Relu),
            )?);
        }
        Ok((CpuStorage::F32(y), Shape::from((n * g.patches(), out))))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _b: &Tensor,
        y: &Tensor,
        g: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let geo = &self.geometry;
        let (n, len) = x.dims2()?;
        let (out, pl) = w.dims2()?;
        // Gradient at the pre-activation, and the bias gradient.
        let gz = with_f32(g, "conv bwd", |g| {
            if !self.relu {
                return Ok(g.to_vec());
            }
            with_f32(y, "conv bwd", |y| {
                let mut gz = vec![0f32; y.len()];
                kernels::relu_grad(y, g, &mut gz);
                gz
            })
        })??;
        let mut gb = vec![0f32; out];
        kernels::column_sums(&gz, &mut gb);
        let w = w.detach().contiguous()?;
        let (w_guard, w_layout) = w.storage_and_layout();
        let Storage::Cpu(ws) = &*w_guard else {
            candle_core::bail!("conv: only the CPU device is supported")
        };
        let want_gx = x.track_op();
        let mut gw = vec![0f32; out * pl];
        let mut gx = Vec::with_capacity(if want_gx { n * len } else { 0 });
        let x = x.detach().contiguous()?;
        with_f32(&x, "conv bwd", |x| -> candle_core::Result<()> {
            let chunk = self.chunk_samples();
            for (part, gz) in x
                .chunks(chunk * len)
                .zip(gz.chunks(chunk * geo.patches() * out))
            {
                let samples = part.len() / len;
                let rows = samples * geo.patches();
                let cols = im2col(part, samples, geo, self.pre);
                // gW += gz^T cols: [out, rows] x [rows, pl].
                let part_gw = matmul_f32(
                    gz.to_vec(),
                    &CpuStorage::F32(cols),
                    (1, out, pl, rows),
                    &Layout::contiguous((rows, out)).transpose(0, 1)?,
                    &Layout::contiguous((rows, pl)),
                )?;
                gw.iter_mut().zip(&part_gw).for_each(|(a, &b)| *a += b);
                if want_gx {
                    // gX = col2im(gz W): [rows, out] x [out, pl].
                    let gcols = matmul_f32(
                        gz.to_vec(),
                        ws,
                        (1, rows, pl, out),
                        &Layout::contiguous((rows, out)),
                        w_layout,
                    )?;
                    let mut part_gx = col2im(&gcols, samples, geo);
                    self.pre.backward(part, &mut part_gx);
                    gx.extend(part_gx);
                }
            }
            Ok(())
        })??;
        let dev = &Device::Cpu;
        Ok((
            if want_gx {
                Some(Tensor::from_vec(gx, (n, len), dev)?)
            } else {
                None
            },
            Some(Tensor::from_vec(gw, (out, pl), dev)?),
            Some(Tensor::from_vec(gb, out, dev)?),
        ))
    }
}

/// A max-pool as a graph op: `x: [n, sample_len]` channels last -> `[n,
/// out_h * out_w * channels]`. The forward pass keeps the argmax of every
/// output for the backward pass (one op per forward, so one set of indices).
struct MaxPoolOp {
    geometry: Geometry,
    /// Index in its sample of each output's maximum, set by the forward pass.
    argmax: OnceLock<Vec<u32>>,
}

impl CustomOp1 for MaxPoolOp {
    fn name(&self) -> &'static str {
        "relay-max-pool"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let g = &self.geometry;
        let (n, len) = l.shape().dims2()?;
        if len != g.sample_len() {
            candle_core::bail!(
                "max-pool: input rows of {len} values, expected {}",
                g.sample_len()
            )
        }
        let mut argmax = Vec::new();
        let y = max_pool(cpu_f32(s, l, "max-pool input")?, n, g, Some(&mut argmax));
        if self.argmax.set(argmax).is_err() {
            candle_core::bail!("max-pool: one op ran forward twice")
        }
        Ok((
            CpuStorage::F32(y),
            Shape::from((n, g.patches() * g.channels)),
        ))
    }

    fn bwd(&self, x: &Tensor, _y: &Tensor, g: &Tensor) -> candle_core::Result<Option<Tensor>> {
        let Some(argmax) = self.argmax.get() else {
            candle_core::bail!("max-pool: backward before forward")
        };
        let (n, len) = x.dims2()?;
        let out_len = self.geometry.patches() * self.geometry.channels;
        let mut gx = vec![0f32; n * len];
        with_f32(g, "max-pool bwd", |g| {
            for ((gx, g), at) in gx
                .chunks_exact_mut(len)
                .zip(g.chunks_exact(out_len))
                .zip(argmax.chunks_exact(out_len))
            {
                for (&v, &i) in g.iter().zip(at) {
                    gx[i as usize] += v;
                }
            }
        })?;
        Ok(Some(Tensor::from_vec(gx, (n, len), &Device::Cpu)?))
    }
}

/// One convolution: its geometry, kernel and bias, and what it applies
/// before and after.
struct Conv {
    geometry: Geometry,
    layer: Dense,
    /// What `im2col` applies to the input: 1/255 for raw pixels, ReLU for
    /// a residual block's first convolution.
    pre: Pre,
    /// ReLU on the output.
    relu: bool,
}

impl Conv {
    /// A convolution of `out` channels with parameters `{name}.weight`
    /// (`[out, C, k, k]`) and `{name}.bias`, drawn as `how` says.
    #[allow(clippy::too_many_arguments)]
    fn new(
        name: &str,
        geometry: Geometry,
        out: usize,
        pre: Pre,
        relu: bool,
        how: LayerInit,
        init: &mut Init<'_>,
        params: &mut Vec<(String, Var)>,
    ) -> Result<Self> {
        let (c, k) = (geometry.channels, geometry.kernel);
        let layer = new_layer(name, &[out, c, k, k], how, init, params)?;
        Ok(Self {
            geometry,
            layer,
            pre,
            relu,
        })
    }

    fn out_channels(&self) -> usize {
        self.layer.b.elem_count()
    }

    /// Values per sample of the output.
    fn out_len(&self) -> usize {
        self.geometry.patches() * self.out_channels()
    }

    /// Values per sample of the patch matrix.
    fn patch_values(&self) -> usize {
        self.geometry.patches() * self.geometry.patch_len()
    }

    /// The kernel as `[out, patch_len]` in the patch column order of its
    /// input (PyTorch's `[out, C, k, k]` permuted to `[out, k, k, C]` for
    /// channels-last input); connected to the `Var` when `graph`.
    fn kernel_matrix(&self, graph: bool) -> candle_core::Result<Tensor> {
        let w = if graph {
            self.layer.w.as_tensor().clone()
        } else {
            self.layer.w.as_tensor().detach()
        };
        let w = if self.geometry.channels_last {
            w.permute((0, 2, 3, 1))?.contiguous()?
        } else {
            w
        };
        w.reshape((self.out_channels(), self.geometry.patch_len()))
    }

    /// `[n, sample_len]` -> `[n, out_len]` as a graph node.
    fn graph(&self, x: &Tensor) -> Result<Tensor> {
        let n = x.dims2()?.0;
        let op = ConvOp {
            geometry: self.geometry,
            pre: self.pre,
            relu: self.relu,
            chunk_values: HOST_CHUNK_VALUES,
        };
        let y = x.apply_op3(&self.kernel_matrix(true)?, &self.layer.b, op)?;
        Ok(y.reshape((n, self.out_len()))?)
    }

    /// `n` samples `[n, sample_len]` -> `[n, out_len]` without a graph,
    /// weights read in place.
    fn host(&self, x: &[f32], n: usize) -> Result<Vec<f32>> {
        let g = &self.geometry;
        let cols = im2col(x, n, g, self.pre);
        let kernel = self.kernel_matrix(false)?;
        let (wg, wl) = kernel.storage_and_layout();
        let (bg, bl) = self.layer.b.storage_and_layout();
        let (Storage::Cpu(ws), Storage::Cpu(bs)) = (&*wg, &*bg) else {
            return Err(candle_core::Error::Msg("parameters must live on the CPU".into()).into());
        };
        Ok(ops::linear_cpu(
            &CpuStorage::F32(cols),
            &Layout::contiguous((n * g.patches(), g.patch_len())),
            ws,
            wl,
            cpu_f32(bs, bl, "conv bias")?,
            self.relu.then_some(Activation::Relu),
        )?)
    }
}

/// One IMPALA stack: convolution, max-pool, residual blocks.
struct Stack {
    conv: Conv,
    pool: Geometry,
    /// Each block's two convolutions: `x + blocks[j][1](blocks[j][0](x))`,
    /// with `relu(x)` read by the first (`Pre::Relu`) and ReLU after it.
    blocks: Vec<[Conv; 2]>,
}

/// The convolutional body of a [`Cnn`].
enum Body {
    /// [`CnnArch::Nature`]: convolutions with ReLU, the first reading the
    /// observation channels first.
    Plain(Vec<Conv>),
    /// [`CnnArch::Impala`]: stacks on the observation made channels last.
    Impala(Vec<Stack>),
}

/// The features extractor: a convolutional body, flatten, dense with ReLU.
pub(crate) struct Cnn {
    body: Body,
    linear: Dense,
    /// The image, `(channels, height, width)`.
    input: [usize; 3],
    /// `(channels, height, width)` after the body.
    last: [usize; 3],
    /// Samples per chunk of [`Self::host`].
    host_chunk: usize,
}

impl Cnn {
    /// Builds the extractor, its parameters drawn as `how` says and
    /// registered in `params`.
    pub(crate) fn new(
        spec: &CnnSpec,
        how: LayerInit,
        init: &mut Init<'_>,
        params: &mut Vec<(String, Var)>,
    ) -> Result<Self> {
        let shapes = spec.output_shapes()?;
        let mut input = spec.input;
        let mut layer = |name: String, geometry: Geometry, out: usize, pre: Pre, relu: bool| {
            Conv::new(&name, geometry, out, pre, relu, how, init, params)
        };
        let body = match &spec.arch {
            CnnArch::Nature { conv } => Body::Plain(
                conv.iter()
                    .zip(&shapes)
                    .enumerate()
                    .map(|(i, (c, &out))| {
                        let first = i == 0;
                        let geometry = Geometry::new(input, c.kernel, c.stride, 0, !first);
                        let pre = Pre::Scale(if first { PIXEL_SCALE } else { 1.0 });
                        input = out;
                        layer(
                            format!("{CNN_PREFIX}.cnn.{}", 2 * i),
                            geometry,
                            c.channels,
                            pre,
                            true,
                        )
                    })
                    .collect::<Result<_>>()?,
            ),
            CnnArch::Impala { channels, blocks } => Body::Impala(
                channels
                    .iter()
                    .enumerate()
                    .map(|(i, &c)| {
                        let name = format!("{CNN_PREFIX}.cnn.{i}");
                        let same = |[_, h, w]: [usize; 3]| Geometry::new([c, h, w], 3, 1, 1, true);
                        let conv = layer(
                            format!("{name}.conv"),
                            Geometry::new(input, 3, 1, 1, true),
                            c,
                            Pre::Scale(1.0),
                            false,
                        )?;
                        let pool = Geometry::new([c, input[1], input[2]], 3, 2, 1, true);
                        input = [c, pool.out_h, pool.out_w];
                        let blocks = (0..*blocks)
                            .map(|j| -> Result<[Conv; 2]> {
                                let block = format!("{name}.res_block{j}");
                                Ok([
                                    layer(
                                        format!("{block}.conv0"),
                                        same(input),
                                        c,
                                        Pre::Relu,
                                        true,
                                    )?,
                                    layer(
                                        format!("{block}.conv1"),
                                        same(input),
                                        c,
                                        Pre::Scale(1.0),
                                        false,
                                    )?,
                                ])
                            })
                            .collect::<Result<_>>()?;
                        Ok(Stack { conv, pool, blocks })
                    })
                    .collect::<Result<_>>()?,
            ),
        };
        let last = *shapes.last().expect("a validated spec has layers");
        debug_assert_eq!(last, input, "the spec's shapes and the geometry agree");
        let flat: usize = last.iter().product();
        let linear = new_layer(
            &format!("{CNN_PREFIX}.linear.0"),
            &[spec.features_dim, flat],
            how,
            init,
            params,
        )?;
        let mut cnn = Self {
            body,
            linear,
            input: spec.input,
            last,
            host_chunk: 1,
        };
        let per_sample = cnn.convs().map(Conv::patch_values).max().unwrap_or(1);
        cnn.host_chunk = (HOST_CHUNK_VALUES / per_sample).max(1);
        Ok(cnn)
    }

    /// Every convolution, in order.
    fn convs(&self) -> Box<dyn Iterator<Item = &Conv> + '_> {
        match &self.body {
            Body::Plain(convs) => Box::new(convs.iter()),
            Body::Impala(stacks) => Box::new(
                stacks
                    .iter()
                    .flat_map(|s| std::iter::once(&s.conv).chain(s.blocks.iter().flatten())),
            ),
        }
    }

    /// Features `[B, features_dim]` of raw observations `[B, C*H*W]` as a
    /// graph (the observations themselves get no gradient).
    pub(crate) fn graph(&self, obs: &Tensor) -> Result<Tensor> {
        let n = obs.dims2()?.0;
        let h = match &self.body {
            Body::Plain(convs) => {
                let mut h = obs.clone();
                for conv in convs {
                    h = conv.graph(&h)?;
                }
                h
            }
            Body::Impala(stacks) => {
                let [c, height, width] = self.input;
                let x = with_f32(obs, "cnn input", |o| {
                    transpose_samples(o, n, c, height * width, PIXEL_SCALE)
                })?;
                let mut h = Tensor::from_vec(x, (n, c * height * width), &Device::Cpu)?;
                for stack in stacks {
                    let pool = MaxPoolOp {
                        geometry: stack.pool,
                        argmax: OnceLock::new(),
                    };
                    h = stack.conv.graph(&h)?.apply_op1(pool)?;
                    for [first, second] in &stack.blocks {
                        h = (&h + second.graph(&first.graph(&h)?)?)?;
                    }
                }
                h.relu()?
            }
        };
        let [c, oh, ow] = self.last;
        let flat = h
            .reshape((n, oh * ow, c))?
            .transpose(1, 2)?
            .contiguous()?
            .reshape((n, c * oh * ow))?;
        Ok(ops::linear(
            &flat,
            &self.linear.w,
            &self.linear.b,
            Some(Activation::Relu),
        )?)
    }

    /// Features of `n` raw observations without a graph, weights read in
    /// place, in chunks of samples whose patch matrices stay under
    /// [`HOST_CHUNK_VALUES`].
    pub(crate) fn host(&self, obs: &[f32], n: usize) -> Result<Vec<f32>> {
        let d = obs.len() / n.max(1);
        let mut features = Vec::with_capacity(n * self.linear.b.elem_count());
        for part in obs.chunks(self.host_chunk * d) {
            features.extend(self.host_chunk(part, part.len() / d)?);
        }
        Ok(features)
    }

    fn host_chunk(&self, obs: &[f32], n: usize) -> Result<Vec<f32>> {
        let h: Cow<'_, [f32]> = match &self.body {
            Body::Plain(convs) => {
                let mut h = Cow::Borrowed(obs);
                for conv in convs {
                    h = Cow::Owned(conv.host(&h, n)?);
                }
                h
            }
            Body::Impala(stacks) => {
                let [c, height, width] = self.input;
                let mut h = transpose_samples(obs, n, c, height * width, PIXEL_SCALE);
                for stack in stacks {
                    h = max_pool(&stack.conv.host(&h, n)?, n, &stack.pool, None);
                    for [first, second] in &stack.blocks {
                        let r = second.host(&first.host(&h, n)?, n)?;
                        h.iter_mut().zip(&r).for_each(|(a, &b)| *a += b);
                    }
                }
                kernels::relu_inplace(&mut h);
                Cow::Owned(h)
            }
        };
        let [c, oh, ow] = self.last;
        let flat = transpose_samples(&h, n, oh * ow, c, 1.0);
        dense_host(
            &self.linear,
            Cow::Owned(flat),
            n,
            c * oh * ow,
            Some(Activation::Relu),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::ConvSpec;
    use rand::{Rng, SeedableRng};

    fn rng(seed: u64) -> rand::rngs::StdRng {
        rand::rngs::StdRng::seed_from_u64(seed)
    }

    fn uniform(n: usize, seed: u64) -> Vec<f32> {
        let mut r = rng(seed);
        (0..n).map(|_| r.random_range(-1.0..1.0)).collect()
    }

    /// A direct convolution (no im2col) of channels-first input with zero
    /// padding `p`, for reference: `[out, oh, ow]`.
    fn direct(
        x: &[f32],
        input: [usize; 3],
        w: &[f32],
        out: usize,
        k: usize,
        s: usize,
        p: usize,
    ) -> Vec<f32> {
        let [c, h, wd] = input;
        let (oh, ow) = ((h + 2 * p - k) / s + 1, (wd + 2 * p - k) / s + 1);
        let mut y = vec![0f32; out * oh * ow];
        for o in 0..out {
            for oy in 0..oh {
                for ox in 0..ow {
                    let mut acc = 0f32;
                    for ci in 0..c {
                        for ky in 0..k {
                            for kx in 0..k {
                                let (iy, ix) = (oy * s + ky, ox * s + kx);
                                if iy < p || ix < p || iy - p >= h || ix - p >= wd {
                                    continue;
                                }
                                acc += w[((o * c + ci) * k + ky) * k + kx]
                                    * x[(ci * h + iy - p) * wd + ix - p];
                            }
                        }
                    }
                    y[(o * oh + oy) * ow + ox] = acc;
                }
            }
        }
        y
    }

    /// A direct max-pool of channels-first input (padding never wins):
    /// `[c, oh, ow]`.
    fn direct_pool(x: &[f32], [c, h, w]: [usize; 3], k: usize, s: usize, p: usize) -> Vec<f32> {
        let (oh, ow) = ((h + 2 * p - k) / s + 1, (w + 2 * p - k) / s + 1);
        let mut y = vec![f32::NEG_INFINITY; c * oh * ow];
        for ci in 0..c {
            for oy in 0..oh {
                for ox in 0..ow {
                    for ky in 0..k {
                        for kx in 0..k {
                            let (iy, ix) = (oy * s + ky, ox * s + kx);
                            if iy < p || ix < p || iy - p >= h || ix - p >= w {
                                continue;
                            }
                            let v = x[(ci * h + iy - p) * w + ix - p];
                            let m = &mut y[(ci * oh + oy) * ow + ox];
                            *m = m.max(v);
                        }
                    }
                }
            }
        }
        y
    }

    /// Adds `b[o]` to every value of channel `o` of `[out, pixels]`.
    fn add_bias(mut y: Vec<f32>, b: &[f32]) -> Vec<f32> {
        let per = y.len() / b.len();
        for (i, v) in y.iter_mut().enumerate() {
            *v += b[i / per];
        }
        y
    }

    fn relu(mut y: Vec<f32>) -> Vec<f32> {
        y.iter_mut().for_each(|v| *v = v.max(0.0));
        y
    }

    /// `act(W x + b)` of a flat vector.
    fn dense(x: &[f32], w: &[f32], b: &[f32]) -> Vec<f32> {
        b.iter()
            .enumerate()
            .map(|(o, &b)| {
                let z: f32 = x.iter().zip(&w[o * x.len()..]).map(|(a, w)| a * w).sum();
                (z + b).max(0.0)
            })
            .collect()
    }

    /// `[c, k, k]`-ordered kernel rows permuted to `(ky, kx, c)` order.
    fn kernel_channels_last(w: &[f32], out: usize, c: usize, k: usize) -> Vec<f32> {
        let mut p = vec![0f32; w.len()];
        for o in 0..out {
            for ci in 0..c {
                for ky in 0..k {
                    for kx in 0..k {
                        p[((o * k + ky) * k + kx) * c + ci] = w[((o * c + ci) * k + ky) * k + kx];
                    }
                }
            }
        }
        p
    }

    #[test]
    fn im2col_times_kernel_is_the_direct_convolution() {
        let input = [3, 9, 7];
        let [c, h, wd] = input;
        let (n, out) = (2, 4);
        let x: Vec<f32> = (0..n * c * h * wd)
            .map(|i| ((i * 37) % 11) as f32 - 5.0)
            .collect();
        for (k, s, p) in [(3, 2, 0), (3, 1, 1), (2, 1, 0), (4, 3, 2), (3, 2, 1)] {
            let w: Vec<f32> = (0..out * c * k * k)
                .map(|i| ((i * 13) % 7) as f32 - 3.0)
                .collect();
            for channels_last in [false, true] {
                let g = Geometry::new(input, k, s, p, channels_last);
                let (xs, ws) = if channels_last {
                    (
                        transpose_samples(&x, n, c, h * wd, 1.0),
                        kernel_channels_last(&w, out, c, k),
                    )
                } else {
                    (x.clone(), w.clone())
                };
                let cols = im2col(&xs, n, &g, Pre::Scale(1.0));
                for b in 0..n {
                    let sample = &x[b * g.sample_len()..][..g.sample_len()];
                    let want = direct(sample, input, &w, out, k, s, p);
                    for q in 0..g.patches() {
                        let row = &cols[(b * g.patches() + q) * g.patch_len()..][..g.patch_len()];
                        for o in 0..out {
                            let got: f32 = row
                                .iter()
                                .zip(&ws[o * g.patch_len()..])
                                .map(|(a, b)| a * b)
                                .sum();
                            assert_eq!(
                                got,
                                want[o * g.patches() + q],
                                "k {k} s {s} p {p} last {channels_last}"
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn col2im_is_the_adjoint_of_im2col() {
        // <im2col(x), y> == <x, col2im(y)> for any x, y, in both layouts,
        // with and without padding.
        for channels_last in [false, true] {
            for (k, s, p) in [(3, 1, 0), (3, 1, 1), (3, 2, 1), (2, 2, 1)] {
                let g = Geometry::new([2, 6, 5], k, s, p, channels_last);
                let x: Vec<f32> = (0..2 * g.sample_len()).map(|i| (i % 5) as f32).collect();
                let y: Vec<f32> = (0..2 * g.patches() * g.patch_len())
                    .map(|i| ((i * 7) % 3) as f32)
                    .collect();
                let lhs: f32 = im2col(&x, 2, &g, Pre::Scale(1.0))
                    .iter()
                    .zip(&y)
                    .map(|(a, b)| a * b)
                    .sum();
                let rhs: f32 = x.iter().zip(col2im(&y, 2, &g)).map(|(a, b)| a * b).sum();
                assert_eq!(lhs, rhs, "k {k} s {s} p {p} last {channels_last}");
            }
        }
    }

    #[test]
    fn max_pool_is_the_direct_max_and_its_argmax_points_at_it() {
        for (input, k, s, p) in [
            ([3, 7, 6], 3, 2, 1),
            ([2, 8, 8], 3, 2, 1),
            ([1, 5, 5], 2, 2, 0),
        ] {
            let [c, h, w] = input;
            let n = 2;
            let x = uniform(n * c * h * w, 3);
            let g = Geometry::new(input, k, s, p, true);
            let xl = transpose_samples(&x, n, c, h * w, 1.0);
            let mut argmax = Vec::new();
            let y = max_pool(&xl, n, &g, Some(&mut argmax));
            assert_eq!(y, max_pool(&xl, n, &g, None));
            for b in 0..n {
                let want = direct_pool(&x[b * c * h * w..][..c * h * w], input, k, s, p);
                let got = &y[b * g.patches() * c..][..g.patches() * c];
                assert_eq!(transpose_samples(got, 1, g.patches(), c, 1.0), want);
                for (v, &i) in got.iter().zip(&argmax[b * g.patches() * c..]) {
                    assert_eq!(xl[b * g.sample_len() + i as usize], *v);
                }
            }
        }
    }

    /// Gradients `loss` gives every input through candle's backward, against
    /// finite differences at every entry. The ops are piecewise linear: a
    /// step that crosses a kink (a ReLU's, a max's) on one side still has
    /// the gradient's slope on the other, so the gradient must match the
    /// central or a one-sided difference.
    fn check_gradients(inputs: &[(Vec<f32>, Vec<usize>)], loss: impl Fn(&[Tensor]) -> Tensor) {
        let dev = &Device::Cpu;
        let vars: Vec<Var> = inputs
            .iter()
            .map(|(v, s)| Var::from_vec(v.clone(), s.as_slice(), dev).unwrap())
            .collect();
        let tensors: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
        let grads = loss(&tensors).backward().unwrap();
        for (i, (values, _)) in inputs.iter().enumerate() {
            let analytic: Vec<f32> = grads
                .get(&tensors[i])
                .expect("every input has a gradient")
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap();
            assert_eq!(analytic.len(), values.len());
            for (j, &a) in analytic.iter().enumerate() {
                let at = |delta: f32| {
                    let moved: Vec<Tensor> = inputs
                        .iter()
                        .enumerate()
                        .map(|(m, (v, s))| {
                            let mut v = v.clone();
                            if m == i {
                                v[j] += delta;
                            }
                            Tensor::from_vec(v, s.as_slice(), dev).unwrap()
                        })
                        .collect();
                    loss(&moved).to_scalar::<f32>().unwrap()
                };
                let eps = 2e-3;
                let (below, here, above) = (at(-eps), at(0.0), at(eps));
                let slopes = [
                    (above - below) / (2.0 * eps),
                    (above - here) / eps,
                    (here - below) / eps,
                ];
                assert!(
                    slopes.iter().any(|s| (s - a).abs() < 5e-3 * (1.0 + s.abs())),
                    "input {i}[{j}]: analytic {a} vs numeric (central, forward, backward) {slopes:?}"
                );
            }
        }
    }

    /// `sum(y * r)` for a fixed random `r`: every output weighs differently.
    fn weighted_sum(y: &Tensor, seed: u64) -> Tensor {
        let r = Tensor::from_vec(uniform(y.elem_count(), seed), y.shape(), &Device::Cpu).unwrap();
        (y * r).unwrap().sum_all().unwrap()
    }

    /// Values at least 0.1 away from 0, so a small step crosses no ReLU kink.
    fn away_from_zero(n: usize, seed: u64) -> Vec<f32> {
        uniform(n, seed)
            .into_iter()
            .map(|v| v.signum() * (0.1 + v.abs()))
            .collect()
    }

    #[test]
    fn padded_convolution_gradients_match_finite_differences() {
        let n = 2;
        for (input, channels_last, pre, relu) in [
            ([3, 5, 4], true, Pre::Relu, false),
            ([2, 5, 5], false, Pre::Scale(0.5), false),
            ([2, 4, 5], true, Pre::Scale(1.0), true),
        ] {
            let g = Geometry::new(input, 3, 1, 1, channels_last);
            let out = 3;
            let inputs = [
                (
                    away_from_zero(n * g.sample_len(), 1),
                    vec![n, g.sample_len()],
                ),
                (uniform(out * g.patch_len(), 2), vec![out, g.patch_len()]),
                (uniform(out, 3), vec![out]),
            ];
            check_gradients(&inputs, |t| {
                let op = ConvOp {
                    geometry: g,
                    pre,
                    relu,
                    chunk_values: HOST_CHUNK_VALUES,
                };
                weighted_sum(&t[0].apply_op3(&t[1], &t[2], op).unwrap(), 4)
            });
        }
    }

    #[test]
    fn max_pool_gradients_match_finite_differences() {
        let (n, input) = (2, [3, 5, 6]);
        let g = Geometry::new(input, 3, 2, 1, true);
        // Distinct values 0.05 apart: a small step changes no maximum.
        let len = n * g.sample_len();
        let mut order: Vec<usize> = (0..len).collect();
        let mut r = rng(7);
        for i in (1..len).rev() {
            order.swap(i, r.random_range(0..=i));
        }
        let x: Vec<f32> = order.iter().map(|&i| 0.05 * i as f32 - 2.0).collect();
        check_gradients(&[(x, vec![n, g.sample_len()])], |t| {
            let op = MaxPoolOp {
                geometry: g,
                argmax: OnceLock::new(),
            };
            weighted_sum(&t[0].apply_op1(op).unwrap(), 8)
        });
    }

    /// Chunked and whole-batch convolutions agree, forward and backward.
    #[test]
    fn chunks_do_not_change_the_convolution_or_its_gradients() {
        for (pad, pre) in [(0, Pre::Scale(0.5)), (1, Pre::Relu)] {
            let g = Geometry::new([3, 6, 5], 2, 1, pad, true);
            let (n, out) = (5, 4);
            let x: Vec<f32> = (0..n * g.sample_len())
                .map(|i| ((i * 7) % 13) as f32 - 6.0)
                .collect();
            let w: Vec<f32> = (0..out * g.patch_len())
                .map(|i| ((i * 5) % 9) as f32 * 0.1 - 0.4)
                .collect();
            let run = |chunk_values: usize| {
                let dev = &Device::Cpu;
                let x = Var::from_vec(x.clone(), (n, g.sample_len()), dev).unwrap();
                let w = Var::from_vec(w.clone(), (out, g.patch_len()), dev).unwrap();
                let b = Var::from_vec(vec![0.1f32, -0.2, 0.0, 0.3], out, dev).unwrap();
                let op = ConvOp {
                    geometry: g,
                    pre,
                    relu: true,
                    chunk_values,
                };
                let y = x.apply_op3(&w, &b, op).unwrap();
                let loss = (y.sqr().unwrap().sum_all().unwrap() * 0.5).unwrap();
                let grads = loss.backward().unwrap();
                let flat = |t: &Tensor| -> Vec<f32> { t.flatten_all().unwrap().to_vec1().unwrap() };
                [
                    flat(&y),
                    flat(grads.get(&x).unwrap()),
                    flat(grads.get(&w).unwrap()),
                    flat(grads.get(&b).unwrap()),
                ]
            };
            let whole = run(usize::MAX);
            let chunked = run(2 * g.patches() * g.patch_len());
            for (a, b) in whole.iter().zip(&chunked) {
                for (u, v) in a.iter().zip(b) {
                    assert!((u - v).abs() <= 1e-4 * (1.0 + u.abs()), "{a:?}\n{b:?}");
                }
            }
            assert!(whole[1].iter().any(|&v| v != 0.0), "input gradients flow");
        }
    }

    /// An extractor with non-zero biases (so a bias applied at the wrong
    /// place shows), and a getter of its parameters by name.
    fn extractor(spec: &CnnSpec) -> (Cnn, impl Fn(&str) -> Vec<f32>) {
        let mut params = Vec::new();
        let cnn = Cnn::new(
            spec,
            LayerInit::Orthogonal(2f64.sqrt()),
            &mut Init::Draw(&mut rng(0)),
            &mut params,
        )
        .unwrap();
        for (name, var) in &params {
            if name.ends_with("bias") {
                let n = var.elem_count();
                let b: Vec<f32> = (0..n).map(|i| 0.1 * i as f32 - 0.2).collect();
                var.set(&Tensor::from_vec(b, n, &Device::Cpu).unwrap())
                    .unwrap();
            }
        }
        let get = move |name: &str| -> Vec<f32> {
            let var = &params.iter().find(|(n, _)| n == name).unwrap().1;
            var.flatten_all().unwrap().to_vec1().unwrap()
        };
        (cnn, get)
    }

    /// The extractor's host and graph features of `n` random pixel
    /// observations against `want(sample scaled to 0..1)`.
    fn check_extractor(cnn: &Cnn, d: usize, want: impl Fn(&[f32]) -> Vec<f32>) {
        let n = 3;
        let obs: Vec<f32> = (0..n * d).map(|i| ((i * 53) % 256) as f32).collect();
        let want: Vec<f32> = obs
            .chunks_exact(d)
            .flat_map(|s| want(&s.iter().map(|v| v / 255.0).collect::<Vec<_>>()))
            .collect();
        let host = cnn.host(&obs, n).unwrap();
        let x = Tensor::from_vec(obs, (n, d), &Device::Cpu).unwrap();
        let graph: Vec<f32> = cnn
            .graph(&x)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        assert_eq!(host.len(), want.len());
        for ((h, g), w) in host.iter().zip(&graph).zip(&want) {
            assert!(
                (h - w).abs() < 1e-5 && (g - w).abs() < 1e-5,
                "{host:?}\n{graph:?}\n{want:?}"
            );
        }
        assert!(
            want.iter().any(|&v| v > 0.0),
            "a test with all-zero features shows nothing"
        );
    }

    /// NatureCNN-style stacks against direct convolutions in PyTorch's
    /// layout (channels-first between layers, `nn.Flatten` order).
    #[test]
    fn plain_extractor_matches_direct_convolutions() {
        let spec = CnnSpec {
            input: [2, 9, 8],
            arch: CnnArch::Nature {
                conv: vec![
                    ConvSpec {
                        channels: 3,
                        kernel: 3,
                        stride: 2,
                    },
                    ConvSpec {
                        channels: 4,
                        kernel: 2,
                        stride: 1,
                    },
                ],
            },
            features_dim: 5,
        };
        let (cnn, get) = extractor(&spec);
        check_extractor(&cnn, 144, |x| {
            let p = |name: &str| get(&format!("features_extractor.{name}"));
            let h1 = relu(add_bias(
                direct(x, [2, 9, 8], &p("cnn.0.weight"), 3, 3, 2, 0),
                &p("cnn.0.bias"),
            ));
            let h2 = relu(add_bias(
                direct(&h1, [3, 4, 3], &p("cnn.2.weight"), 4, 2, 1, 0),
                &p("cnn.2.bias"),
            ));
            dense(&h2, &p("linear.0.weight"), &p("linear.0.bias"))
        });
    }

    /// IMPALA against direct loops in PyTorch's layout, as CleanRL's
    /// `ConvSequence` / `ResidualBlock` compute it; odd sizes, so the
    /// max-pool's padding and rounding show.
    #[test]
    fn impala_extractor_matches_direct_loops() {
        let input = [2, 7, 6];
        let spec = CnnSpec {
            input,
            arch: CnnArch::Impala {
                channels: vec![3, 4],
                blocks: 2,
            },
            features_dim: 5,
        };
        let (cnn, get) = extractor(&spec);
        check_extractor(&cnn, 84, |x| {
            let p = |name: &str| get(&format!("features_extractor.{name}"));
            let conv = |x: &[f32], shape: [usize; 3], name: &str, out: usize| {
                add_bias(
                    direct(x, shape, &p(&format!("{name}.weight")), out, 3, 1, 1),
                    &p(&format!("{name}.bias")),
                )
            };
            let (mut h, mut shape) = (x.to_vec(), input);
            for (i, out) in [3, 4].into_iter().enumerate() {
                h = conv(&h, shape, &format!("cnn.{i}.conv"), out);
                h = direct_pool(&h, [out, shape[1], shape[2]], 3, 2, 1);
                shape = [out, shape[1].div_ceil(2), shape[2].div_ceil(2)];
                for j in 0..2 {
                    let block = format!("cnn.{i}.res_block{j}");
                    let t = relu(conv(
                        &relu(h.clone()),
                        shape,
                        &format!("{block}.conv0"),
                        out,
                    ));
                    let t = conv(&t, shape, &format!("{block}.conv1"), out);
                    h.iter_mut().zip(&t).for_each(|(a, b)| *a += b);
                }
            }
            assert_eq!(shape, [4, 2, 2]);
            dense(&relu(h), &p("linear.0.weight"), &p("linear.0.bias"))
        });
    }
}
