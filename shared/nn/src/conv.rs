//! The convolutional features extractor of image policies (a [`CnnSpec`]):
//! a plain stack of convolutions (Stable-Baselines3's `NatureCNN` by
//! default) or IMPALA's ResNet, each with its training graph and its
//! graph-free inference path. [`crate::ActorCritic`] and
//! [`crate::QNetwork`] put it in front of their hidden layers.
//!
//! # How a convolution runs
//! Each convolution is `im2col` (every receptive field copied out as one row
//! of a `[B * out_h * out_w, C * k * k]` patch matrix) times the kernel read
//! as `[out, C * k * k]`, through gemm (candle's kernels, called on the
//! slices so that no operand or result is copied), with bias and ReLU in
//! place: nearly all the work is the matmul. It runs in chunks of samples
//! whose patch matrix stays under `CHUNK_VALUES` (1 MiB, a core's L2
//! cache), in training too: the backward pass rebuilds each chunk's
//! patches for the kernel gradient and scatter-adds the input gradient with
//! `col2im`, so the patch matrix of a whole batch (100 MiB for NatureCNN's
//! first layer at batch 256) is never built.
//!
//! Padding (IMPALA's 3x3 convolutions keep the image size) is zeros that
//! `im2col` writes into the patches and `col2im` skips: no padded copy of
//! the input is made. A residual block's first convolution reads
//! `relu(x)`: `im2col` applies the ReLU to the patches (and the backward
//! pass masks the input gradient with `x > 0`), so `relu(x)` is never
//! stored.
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
//! # Graph ops
//! A plain stack is one graph op per convolution (`ConvOp`, with ReLU). An
//! IMPALA stack (convolution, 3x3/2 max-pool with padding 1, residual
//! blocks) is one graph op (`StackOp`) over its input and its parameters
//! packed into one vector: candle's backward pass allocates and adds a zero
//! gradient for every input of every node, which for the residual adds and
//! the convolutions between them cost more than the adds themselves. The
//! forward pass keeps what the backward pass needs: each block's input and
//! its first convolution's output, and for every max-pool output the index
//! of its maximum in the input (the first in window order on ties, as
//! PyTorch), where the backward pass scatter-adds its gradient. The
//! graph-free path runs the same code without keeping anything.
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

use candle_core::{CpuStorage, CustomOp2, CustomOp3, Device, Layout, Shape, Tensor, Var};

use crate::error::Result;
use crate::init::{Init, LayerInit};
use crate::kernels::{self, zip_lanes, PoolWindow};
use crate::layers::{dense_host, new_layer, Dense};
use crate::ops::{self, cpu_f32, with_f32};
use crate::spec::{Activation, CnnArch, CnnSpec};

/// Name prefix of the extractor's parameters (SB3's).
pub const CNN_PREFIX: &str = "features_extractor";

/// The graph-free forward runs the whole network on chunks of samples
/// whose largest patch matrix holds at most this many values (16 MiB): the
/// activations of a chunk stay a few MiB, so glibc's malloc reuses the
/// freed blocks for the next chunk (its mmap threshold grows to 32 MiB)
/// instead of mapping and page-faulting fresh ones.
pub const HOST_CHUNK_VALUES: usize = 4 << 20;

/// Largest patch matrix (in f32 values, 1 MiB) one convolution builds at a
/// time, forward and backward: it stays in a core's L2 cache while gemm
/// packs and reads it (IMPALA's train step took two thirds of the time of
/// 16 MiB chunks, NatureCNN's no longer).
const CHUNK_VALUES: usize = 1 << 18;

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
            Pre::Relu => mask_relu(gx, x),
        }
    }
}

/// Zeroes the gradient `g` where `y <= 0`: the gradient through a ReLU whose
/// output (or input) is `y`.
fn mask_relu(g: &mut [f32], y: &[f32]) {
    g.iter_mut()
        .zip(y)
        .for_each(|(g, &y)| *g = if y > 0.0 { *g } else { 0.0 });
}

/// `cols` (cleared first) := `[n, sample_len]` -> `[n * patches,
/// patch_len]`, every value through `pre`.
fn im2col_into(cols: &mut Vec<f32>, x: &[f32], n: usize, g: &Geometry, pre: Pre) {
    if let (false, 0, Pre::Scale(scale)) = (g.channels_last, g.pad, pre) {
        // A first layer on channels-first pixels copies runs of `kernel`
        // values: at a length known to the compiler each is a vector load,
        // multiply and store (NatureCNN's 8x8 layer: 2.5x faster than
        // through `for_each_run`).
        match g.kernel {
            8 => return im2col_planes::<8>(cols, x, n, g, scale),
            4 => return im2col_planes::<4>(cols, x, n, g, scale),
            3 => return im2col_planes::<3>(cols, x, n, g, scale),
            _ => {}
        }
    }
    im2col_runs(cols, x, n, g, pre)
}

/// [`im2col_into`] of any geometry, run by run.
fn im2col_runs(cols: &mut Vec<f32>, x: &[f32], n: usize, g: &Geometry, pre: Pre) {
    let (block, sl) = (g.patches() * g.patch_len(), g.sample_len());
    // Runs come in patch order, so the matrix is appended, never zeroed first.
    cols.clear();
    cols.reserve(n * block);
    for sample in x.chunks_exact(sl).take(n) {
        g.for_each_run(|_, from, len| {
            let Some(from) = from else {
                cols.resize(cols.len() + len, 0.0);
                return;
            };
            let src = &sample[from..from + len];
            match pre {
                // The first layer's runs are a few pixels: scaled as copied.
                Pre::Scale(s) if s != 1.0 => cols.extend(src.iter().map(|&v| v * s)),
                _ => cols.extend_from_slice(src),
            }
        });
    }
    debug_assert_eq!(cols.len(), n * block);
    // A block's ReLU in one pass over the patches (padding's zeros stay
    // zeros): its runs of a few channels are too short for vector loops.
    if pre == Pre::Relu {
        kernels::relu_inplace(cols);
    }
}

/// [`im2col_into`] of channels-first input without padding for a `K`x`K`
/// kernel, every value times `scale`.
fn im2col_planes<const K: usize>(
    cols: &mut Vec<f32>,
    x: &[f32],
    n: usize,
    g: &Geometry,
    scale: f32,
) {
    debug_assert!(!g.channels_last && g.pad == 0 && g.kernel == K);
    let (plane_len, w, stride) = (g.height * g.width, g.width, g.stride);
    cols.clear();
    cols.reserve(n * g.patches() * g.patch_len());
    for sample in x.chunks_exact(g.sample_len()).take(n) {
        for oy in 0..g.out_h {
            for ox in 0..g.out_w {
                for plane in sample.chunks_exact(plane_len) {
                    for ky in 0..K {
                        let at = (oy * stride + ky) * w + ox * stride;
                        let src: &[f32; K] = plane[at..at + K].try_into().expect("K values");
                        let run: [f32; K] = std::array::from_fn(|i| src[i] * scale);
                        cols.extend_from_slice(&run);
                    }
                }
            }
        }
    }
}

/// The adjoint of [`im2col_into`] (without its `pre`): scatter-adds the
/// patch gradients `cols` of `n` samples into `x` (padding's are dropped).
fn col2im_add(x: &mut [f32], cols: &[f32], n: usize, g: &Geometry) {
    let (block, sl) = (g.patches() * g.patch_len(), g.sample_len());
    for (sample, grad) in x.chunks_exact_mut(sl).zip(cols.chunks_exact(block)).take(n) {
        g.for_each_run(|to, from, len| {
            if let Some(from) = from {
                let (dst, src) = (&mut sample[from..from + len], &grad[to..to + len]);
                zip_lanes(dst, src, |d, v| *d += v);
            }
        });
    }
}

/// Max-pool of `n` channels-last samples `[n, sample_len]` (padding never
/// wins) -> `[n, out_h * out_w * channels]`; with `argmax`, also the index
/// in its sample of each output's maximum (the first in window order on
/// ties, as PyTorch).
fn max_pool(x: &[f32], n: usize, g: &Geometry, mut argmax: Option<&mut Vec<u32>>) -> Vec<f32> {
    debug_assert!(g.channels_last);
    let out_len = g.patches() * g.channels;
    let mut y = Vec::with_capacity(n * out_len);
    if let Some(a) = argmax.as_deref_mut() {
        a.clear();
        a.reserve(n * out_len);
    }
    let window = PoolWindow {
        kernel: g.kernel,
        stride: g.stride,
        pad: g.pad,
    };
    let image = [g.channels, g.height, g.width];
    kernels::max_pool(&x[..n * g.sample_len()], image, window, &mut y, argmax);
    y
}

/// The backward pass of [`max_pool`]: every output's gradient `g` (`[n,
/// out_len]`) added at its `argmax` -> `[n, sample_len]`.
fn max_pool_backward(g: &[f32], argmax: &[u32], n: usize, geometry: &Geometry) -> Vec<f32> {
    let (sl, out_len) = (
        geometry.sample_len(),
        geometry.patches() * geometry.channels,
    );
    let mut gx = vec![0f32; n * sl];
    for ((gx, g), at) in gx
        .chunks_exact_mut(sl)
        .zip(g.chunks_exact(out_len))
        .zip(argmax.chunks_exact(out_len))
    {
        for (&v, &i) in g.iter().zip(at) {
            gx[i as usize] += v;
        }
    }
    gx
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

/// `dst [m, n] (+)= a · b` on dense row-major slices through gemm (candle's
/// kernels, with candle's threads): `a` is `[m, k]`, stored as `[k, m]`
/// when `a_t`; `b` is `[k, n]`, stored as `[n, k]` when `b_t`. The result
/// lands in place, so no operand or result is copied.
fn matmul_into(
    dst: &mut [f32],
    (a, a_t): (&[f32], bool),
    (b, b_t): (&[f32], bool),
    (m, k, n): (usize, usize, usize),
    accumulate: bool,
) {
    assert!(
        dst.len() == m * n && a.len() == m * k && b.len() == k * n,
        "matmul: [{m}, {k}] x [{k}, {n}] into {} values from {} and {}",
        dst.len(),
        a.len(),
        b.len()
    );
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !accumulate {
            dst.fill(0.0);
        }
        return;
    }
    let (a_rs, a_cs) = if a_t { (1, m) } else { (k, 1) };
    let (b_rs, b_cs) = if b_t { (1, k) } else { (n, 1) };
    let threads = candle_core::utils::get_num_threads();
    let parallelism = if threads > 1 {
        gemm::Parallelism::Rayon(threads)
    } else {
        gemm::Parallelism::None
    };
    // SAFETY: `dst`, `a` and `b` hold exactly `m·n`, `m·k` and `k·n` values
    // (asserted above), and the strides address each of those matrices
    // densely, so every element gemm reads or writes is in bounds.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,
            n as isize,
            accumulate,
            a.as_ptr(),
            a_cs as isize,
            a_rs as isize,
            b.as_ptr(),
            b_cs as isize,
            b_rs as isize,
            1.0,
            1.0,
            false,
            false,
            false,
            parallelism,
        )
    }
}

/// What one convolution computes, without its parameters: `act(im2col(pre(x))
/// w^T + b)` on `[n, sample_len]` -> `[n, out_len]` (channels last), with
/// the kernel `w: [out, patch_len]` in patch column order and the bias `b:
/// [out]`. Forward and backward run in chunks of samples whose patch matrix
/// stays under `chunk_values`: the patch matrix of a whole batch (100 MiB
/// for NatureCNN's first layer at batch 256) is never built, and the
/// backward pass rebuilds each chunk's patches rather than keeping them.
#[derive(Debug, Clone, Copy, PartialEq)]
struct ConvKind {
    geometry: Geometry,
    /// Output channels.
    out: usize,
    /// What `im2col` applies to the input.
    pre: Pre,
    /// ReLU on the output.
    relu: bool,
    /// Largest patch matrix of one chunk, in values ([`CHUNK_VALUES`]).
    chunk_values: usize,
}

impl ConvKind {
    /// Values per sample of the output.
    fn out_len(&self) -> usize {
        self.geometry.patches() * self.out
    }

    /// Values of the kernel, `[out, patch_len]`.
    fn kernel_len(&self) -> usize {
        self.out * self.geometry.patch_len()
    }

    /// Values per sample of the patch matrix.
    fn patch_values(&self) -> usize {
        self.geometry.patches() * self.geometry.patch_len()
    }

    fn chunk_samples(&self) -> usize {
        (self.chunk_values / self.patch_values()).max(1)
    }

    /// The output of `n` samples `x`.
    fn forward(&self, x: &[f32], n: usize, w: &[f32], b: &[f32]) -> Vec<f32> {
        let g = &self.geometry;
        let (sl, pl, patches) = (g.sample_len(), g.patch_len(), g.patches());
        let mut y = vec![0f32; n * self.out_len()];
        let chunk = self.chunk_samples();
        let mut cols = Vec::new();
        for (xs, ys) in x[..n * sl]
            .chunks(chunk * sl)
            .zip(y.chunks_mut(chunk * self.out_len()))
        {
            let m = xs.len() / sl;
            im2col_into(&mut cols, xs, m, g, self.pre);
            matmul_into(
                ys,
                (&cols, false),
                (w, true),
                (m * patches, pl, self.out),
                false,
            );
            kernels::add_row_bias(ys, b);
            if self.relu {
                kernels::relu_inplace(ys);
            }
        }
        y
    }

    /// The backward pass of [`Self::forward`] from `gz`, the gradient at
    /// the output before its ReLU: adds the kernel and bias gradients to
    /// `gw` and `gb`, and returns the input gradient when `want_gx`.
    fn backward(
        &self,
        (x, n): (&[f32], usize),
        w: &[f32],
        gz: &[f32],
        (gw, gb): (&mut [f32], &mut [f32]),
        want_gx: bool,
    ) -> Option<Vec<f32>> {
        let g = &self.geometry;
        let (sl, pl, patches, out) = (g.sample_len(), g.patch_len(), g.patches(), self.out);
        let mut sums = vec![0f32; out];
        kernels::column_sums(gz, &mut sums);
        gb.iter_mut().zip(&sums).for_each(|(a, &b)| *a += b);
        let mut gx = want_gx.then(|| vec![0f32; n * sl]);
        let chunk = self.chunk_samples();
        let (mut cols, mut gcols) = (Vec::new(), Vec::new());
        for (i, (xs, gzs)) in x[..n * sl]
            .chunks(chunk * sl)
            .zip(gz.chunks(chunk * self.out_len()))
            .enumerate()
        {
            let (m, rows) = (xs.len() / sl, xs.len() / sl * patches);
            im2col_into(&mut cols, xs, m, g, self.pre);
            // gW += gz^T cols: [out, rows] x [rows, pl].
            matmul_into(gw, (gzs, true), (&cols, false), (out, rows, pl), true);
            if let Some(gx) = gx.as_mut() {
                // gX = col2im(gz W): [rows, out] x [out, pl].
                gcols.resize(rows * pl, 0.0);
                matmul_into(&mut gcols, (gzs, false), (w, false), (rows, out, pl), false);
                let gxs = &mut gx[i * chunk * sl..][..m * sl];
                col2im_add(gxs, &gcols, m, g);
                self.pre.backward(xs, gxs);
            }
        }
        gx
    }
}

/// One convolution as a graph op (NatureCNN-style stacks): `x: [n,
/// sample_len]`, the kernel `w: [out, patch_len]`, `b: [out]` -> `[n,
/// out_len]`.
struct ConvOp(ConvKind);

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
        let k = &self.0;
        let (n, len) = xl.shape().dims2()?;
        if len != k.geometry.sample_len() || wl.shape().elem_count() != k.kernel_len() {
            candle_core::bail!(
                "conv: input rows of {len} values and a kernel of {:?}, expected {} and [{}, {}]",
                wl.dims(),
                k.geometry.sample_len(),
                k.out,
                k.geometry.patch_len()
            )
        }
        let (x, w, b) = (
            cpu_f32(xs, xl, "conv input")?,
            cpu_f32(ws, wl, "conv kernel")?,
            cpu_f32(bs, bl, "conv bias")?,
        );
        let y = k.forward(x, n, w, b);
        Ok((CpuStorage::F32(y), Shape::from((n, k.out_len()))))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _b: &Tensor,
        y: &Tensor,
        g: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let k = &self.0;
        let n = x.dims2()?.0;
        let want_gx = x.track_op();
        let (mut gw, mut gb) = (vec![0f32; k.kernel_len()], vec![0f32; k.out]);
        let gx = with_f32(g, "conv bwd", |g| -> candle_core::Result<_> {
            // Gradient at the pre-activation.
            let masked = if k.relu {
                let mut gz = g.to_vec();
                with_f32(y, "conv bwd", |y| mask_relu(&mut gz, y))?;
                Some(gz)
            } else {
                None
            };
            let gz = masked.as_deref().unwrap_or(g);
            with_f32(x, "conv bwd", |x| {
                with_f32(w, "conv bwd", |w| {
                    k.backward((x, n), w, gz, (&mut gw, &mut gb), want_gx)
                })
            })?
        })??;
        let dev = &Device::Cpu;
        Ok((
            gx.map(|gx| Tensor::from_vec(gx, x.shape(), dev))
                .transpose()?,
            Some(Tensor::from_vec(gw, w.shape(), dev)?),
            Some(Tensor::from_vec(gb, k.out, dev)?),
        ))
    }
}

/// One IMPALA stack without its parameters: a convolution, a max-pool and
/// residual blocks, on channels-last `[n, sample_len]` -> `[n, out_len]`.
/// Its parameters travel packed in one vector: every convolution's kernel
/// (`[out, patch_len]`) then bias, in [`Self::convs`] order.
#[derive(Debug, Clone, PartialEq)]
struct StackKind {
    conv: ConvKind,
    pool: Geometry,
    /// Each block's two convolutions: `x + second(first(x))`, the first
    /// reading `relu(x)` (`Pre::Relu`) with ReLU after it.
    blocks: Vec<[ConvKind; 2]>,
}

/// What a stack's forward pass keeps for its backward pass.
#[derive(Default)]
struct StackSaved {
    /// The max-pool's argmax.
    argmax: Vec<u32>,
    /// Each block's input, and its first convolution's output.
    blocks: Vec<(Vec<f32>, Vec<f32>)>,
}

impl StackKind {
    /// Every convolution, in order.
    fn convs(&self) -> impl Iterator<Item = &ConvKind> {
        std::iter::once(&self.conv).chain(self.blocks.iter().flatten())
    }

    /// Where each convolution's kernel and bias sit in the packed parameters.
    fn param_ranges(&self) -> Vec<std::ops::Range<usize>> {
        let mut at = 0;
        self.convs()
            .map(|c| {
                at += c.kernel_len() + c.out;
                at - c.kernel_len() - c.out..at
            })
            .collect()
    }

    fn params_len(&self) -> usize {
        self.convs().map(|c| c.kernel_len() + c.out).sum()
    }

    /// Values per sample of the output.
    fn out_len(&self) -> usize {
        self.pool.patches() * self.pool.channels
    }

    /// The output of `n` samples `x` under the packed parameters `p`;
    /// with `saved`, what the backward pass needs is kept there.
    fn forward(
        &self,
        x: &[f32],
        n: usize,
        p: &[f32],
        mut saved: Option<&mut StackSaved>,
    ) -> Vec<f32> {
        let ranges = self.param_ranges();
        let param = |i: usize, c: &ConvKind| p[ranges[i].clone()].split_at(c.kernel_len());
        let (w, b) = param(0, &self.conv);
        let y = self.conv.forward(x, n, w, b);
        let mut h = max_pool(
            &y,
            n,
            &self.pool,
            saved.as_deref_mut().map(|s| &mut s.argmax),
        );
        for (j, [first, second]) in self.blocks.iter().enumerate() {
            let (w, b) = param(1 + 2 * j, first);
            let t = first.forward(&h, n, w, b);
            let (w, b) = param(2 + 2 * j, second);
            let mut next = second.forward(&t, n, w, b);
            next.iter_mut().zip(&h).for_each(|(r, &h)| *r += h);
            match saved.as_deref_mut() {
                Some(s) => s.blocks.push((std::mem::replace(&mut h, next), t)),
                None => h = next,
            }
        }
        h
    }

    /// The backward pass of [`Self::forward`] from `g`, the gradient at the
    /// output: the input gradient when `want_gx`, and the packed parameters'.
    fn backward(
        &self,
        (x, n): (&[f32], usize),
        p: &[f32],
        g: &[f32],
        saved: &StackSaved,
        want_gx: bool,
    ) -> (Option<Vec<f32>>, Vec<f32>) {
        let ranges = self.param_ranges();
        let mut gp = vec![0f32; p.len()];
        // Kernel and bias, and their gradients, of convolution `i`.
        let mut conv = |i: usize, c: &ConvKind, input: &[f32], gz: &[f32], want: bool| {
            let (w, _) = p[ranges[i].clone()].split_at(c.kernel_len());
            let grads = gp[ranges[i].clone()].split_at_mut(c.kernel_len());
            c.backward((input, n), w, gz, grads, want)
        };
        // The gradient at the current block's output, then at its input.
        let mut g = g.to_vec();
        for (j, ([first, second], (h, t))) in
            self.blocks.iter().zip(&saved.blocks).enumerate().rev()
        {
            let mut gt = conv(2 + 2 * j, second, t, &g, true).expect("asked for");
            mask_relu(&mut gt, t);
            let gh = conv(1 + 2 * j, first, h, &gt, true).expect("asked for");
            g.iter_mut().zip(&gh).for_each(|(a, &b)| *a += b);
        }
        let gy = max_pool_backward(&g, &saved.argmax, n, &self.pool);
        let gx = conv(0, &self.conv, x, &gy, want_gx);
        (gx, gp)
    }
}

/// One IMPALA stack as a graph op: `x: [n, sample_len]` (channels last) and
/// the packed parameters -> `[n, out_len]`. One node for the whole stack:
/// candle's backward pass allocates and adds a zero gradient for every
/// input of every node, which for the residual adds and the convolutions
/// between them cost more than the pool and the adds themselves.
struct StackOp {
    stack: StackKind,
    /// Set by the forward pass (one op per forward, so one set).
    saved: OnceLock<StackSaved>,
}

impl CustomOp2 for StackOp {
    fn name(&self) -> &'static str {
        "relay-impala-stack"
    }

    fn cpu_fwd(
        &self,
        xs: &CpuStorage,
        xl: &Layout,
        ps: &CpuStorage,
        pl: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let s = &self.stack;
        let (n, len) = xl.shape().dims2()?;
        if len != s.conv.geometry.sample_len() || pl.shape().elem_count() != s.params_len() {
            candle_core::bail!(
                "impala stack: input rows of {len} values and {} parameters, expected {} and {}",
                pl.shape().elem_count(),
                s.conv.geometry.sample_len(),
                s.params_len()
            )
        }
        let mut saved = StackSaved::default();
        let y = s.forward(
            cpu_f32(xs, xl, "stack input")?,
            n,
            cpu_f32(ps, pl, "stack parameters")?,
            Some(&mut saved),
        );
        if self.saved.set(saved).is_err() {
            candle_core::bail!("impala stack: one op ran forward twice")
        }
        Ok((CpuStorage::F32(y), Shape::from((n, s.out_len()))))
    }

    fn bwd(
        &self,
        x: &Tensor,
        p: &Tensor,
        _y: &Tensor,
        g: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let Some(saved) = self.saved.get() else {
            candle_core::bail!("impala stack: backward before forward")
        };
        let n = x.dims2()?.0;
        let want_gx = x.track_op();
        let (gx, gp) = with_f32(g, "stack bwd", |g| {
            with_f32(x, "stack bwd", |x| {
                with_f32(p, "stack bwd", |p| {
                    self.stack.backward((x, n), p, g, saved, want_gx)
                })
            })
        })???;
        let dev = &Device::Cpu;
        Ok((
            gx.map(|gx| Tensor::from_vec(gx, x.shape(), dev))
                .transpose()?,
            Some(Tensor::from_vec(gp, p.shape(), dev)?),
        ))
    }
}

/// The kernel of `layer` as `[out, patch_len]` in the patch column order of
/// its input (PyTorch's `[out, C, k, k]` permuted to `[out, k, k, C]` for
/// channels-last input); connected to the `Var` when `graph`.
fn kernel_matrix(layer: &Dense, kind: &ConvKind, graph: bool) -> candle_core::Result<Tensor> {
    let w = if graph {
        layer.w.as_tensor().clone()
    } else {
        layer.w.as_tensor().detach()
    };
    let w = if kind.geometry.channels_last {
        w.permute((0, 2, 3, 1))?.contiguous()?
    } else {
        w
    };
    w.reshape((kind.out, kind.geometry.patch_len()))
}

/// One convolution of a plain stack, with its parameters.
struct Conv {
    kind: ConvKind,
    layer: Dense,
}

impl Conv {
    /// `[n, sample_len]` -> `[n, out_len]` as a graph node.
    fn graph(&self, x: &Tensor) -> Result<Tensor> {
        let w = kernel_matrix(&self.layer, &self.kind, true)?;
        Ok(x.apply_op3(&w, &self.layer.b, ConvOp(self.kind))?)
    }

    /// `n` samples `[n, sample_len]` -> `[n, out_len]` without a graph.
    fn host(&self, x: &[f32], n: usize) -> Result<Vec<f32>> {
        let w = kernel_matrix(&self.layer, &self.kind, false)?;
        Ok(with_f32(&w, "conv kernel", |w| {
            with_f32(self.layer.b.as_tensor(), "conv bias", |b| {
                self.kind.forward(x, n, w, b)
            })
        })??)
    }
}

/// One IMPALA stack with its parameters.
struct Stack {
    kind: StackKind,
    /// The parameters of [`StackKind::convs`], in that order.
    layers: Vec<Dense>,
}

impl Stack {
    /// The packed parameters ([`StackKind`]); connected to the `Var`s when
    /// `graph`.
    fn packed(&self, graph: bool) -> Result<Tensor> {
        let mut parts = Vec::with_capacity(2 * self.layers.len());
        for (kind, layer) in self.kind.convs().zip(&self.layers) {
            parts.push(kernel_matrix(layer, kind, graph)?.flatten_all()?);
            let b = layer.b.as_tensor();
            parts.push(if graph { b.clone() } else { b.detach() });
        }
        Ok(Tensor::cat(&parts, 0)?)
    }
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

/// Max-pool of `x: [N, C, H, W]` over `g`'s windows (its `pad` a border
/// that never wins), from candle's basic ops: separably, rows then columns,
/// each the `maximum` of the `kernel` strided views of the padded axis
/// (candle's own `max_pool2d` has no backward for overlapping windows).
fn max_pool_composed(x: &Tensor, g: &Geometry) -> candle_core::Result<Tensor> {
    let rows = max_along(x, 2, g.out_h, g)?;
    max_along(&rows, 3, g.out_w, g)
}

/// The maximum over `g.kernel` consecutive entries of axis `dim`, every
/// `g.stride`-th window, `out` windows, after a border of `g.pad` lowest
/// values before.
fn max_along(x: &Tensor, dim: usize, out: usize, g: &Geometry) -> candle_core::Result<Tensor> {
    let (k, s, p) = (g.kernel, g.stride, g.pad);
    let len = x.dim(dim)?;
    // Every view below reads `out * s` entries from offset `dy < k`.
    let total = k - 1 + out * s;
    let kept = len.min(total - p);
    let x = x.narrow(dim, 0, kept)?;
    let border = |size: usize| -> candle_core::Result<Tensor> {
        let mut shape = x.dims().to_vec();
        shape[dim] = size;
        Tensor::full(f32::MIN, shape, x.device())?.to_dtype(x.dtype())
    };
    let padded = Tensor::cat(&[&border(p)?, &x, &border(total - p - kept)?], dim)?;
    let mut best: Option<Tensor> = None;
    for dy in 0..k {
        let mut split = padded.dims().to_vec();
        split[dim] = out;
        split.insert(dim + 1, s);
        let view = padded
            .narrow(dim, dy, out * s)?
            .reshape(split)?
            .narrow(dim + 1, 0, 1)?
            .squeeze(dim + 1)?;
        best = Some(match best {
            None => view,
            Some(b) => b.maximum(&view)?,
        });
    }
    Ok(best.expect("a window has entries"))
}

impl Cnn {
    /// Builds the extractor, its parameters drawn as `how` says and
    /// registered in `params`.
    pub(crate) fn new(
        spec: &CnnSpec,
        how: LayerInit,
        init: &mut Init<'_>,
        params: &mut Vec<(String, Var)>,
        device: &Device,
    ) -> Result<Self> {
        let shapes = spec.output_shapes()?;
        let mut input = spec.input;
        let mut layer = |name: String, kind: &ConvKind| {
            let (c, k) = (kind.geometry.channels, kind.geometry.kernel);
            new_layer(&name, &[kind.out, c, k, k], how, init, params, device)
        };
        let kind = |input, (kernel, stride, pad), out, pre, relu, channels_last| ConvKind {
            geometry: Geometry::new(input, kernel, stride, pad, channels_last),
            out,
            pre,
            relu,
            chunk_values: CHUNK_VALUES,
        };
        let body = match &spec.arch {
            CnnArch::Nature { conv } => Body::Plain(
                conv.iter()
                    .zip(&shapes)
                    .enumerate()
                    .map(|(i, (c, &out))| {
                        let first = i == 0;
                        let pre = Pre::Scale(if first { PIXEL_SCALE } else { 1.0 });
                        let kind = kind(
                            input,
                            (c.kernel, c.stride, 0),
                            c.channels,
                            pre,
                            true,
                            !first,
                        );
                        input = out;
                        let layer = layer(format!("{CNN_PREFIX}.cnn.{}", 2 * i), &kind)?;
                        Ok(Conv { kind, layer })
                    })
                    .collect::<Result<_>>()?,
            ),
            CnnArch::Impala { channels, blocks } => Body::Impala(
                channels
                    .iter()
                    .enumerate()
                    .map(|(i, &c)| {
                        let same = (3, 1, 1);
                        let conv = kind(input, same, c, Pre::Scale(1.0), false, true);
                        let pool = Geometry::new([c, input[1], input[2]], 3, 2, 1, true);
                        input = [c, pool.out_h, pool.out_w];
                        let block = [
                            kind(input, same, c, Pre::Relu, true, true),
                            kind(input, same, c, Pre::Scale(1.0), false, true),
                        ];
                        let kind = StackKind {
                            conv,
                            pool,
                            blocks: vec![block; *blocks],
                        };
                        let name = format!("{CNN_PREFIX}.cnn.{i}");
                        let mut names = vec![format!("{name}.conv")];
                        for j in 0..*blocks {
                            for k in 0..2 {
                                names.push(format!("{name}.res_block{j}.conv{k}"));
                            }
                        }
                        let layers = names
                            .into_iter()
                            .zip(kind.convs())
                            .map(|(name, conv)| layer(name, conv))
                            .collect::<Result<_>>()?;
                        Ok(Stack { kind, layers })
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
            device,
        )?;
        let largest = match &body {
            Body::Plain(convs) => convs.iter().map(|c| c.kind.patch_values()).max(),
            Body::Impala(stacks) => stacks
                .iter()
                .flat_map(|s| s.kind.convs().map(ConvKind::patch_values))
                .max(),
        };
        Ok(Self {
            body,
            linear,
            input: spec.input,
            last,
            host_chunk: (HOST_CHUNK_VALUES / largest.unwrap_or(1)).max(1),
        })
    }

    /// Features `[B, features_dim]` of raw observations `[B, C*H*W]` as a
    /// graph (the observations themselves get no gradient).
    pub(crate) fn graph(&self, obs: &Tensor) -> Result<Tensor> {
        if !crate::ops::fused_on(obs.device()) {
            return self.composed_graph(obs);
        }
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
                    let op = StackOp {
                        stack: stack.kind.clone(),
                        saved: OnceLock::new(),
                    };
                    h = h.apply_op2(&stack.packed(true)?, op)?;
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

    /// [`Cnn::graph`] composed of candle's basic ops (`conv2d`, ReLU,
    /// `maximum`, matmul), each with candle's own backward and a kernel on
    /// every device: what runs off the CPU, where the fused ops (CPU code)
    /// cannot. Channels first throughout, so flattening is PyTorch's.
    pub(crate) fn composed_graph(&self, obs: &Tensor) -> Result<Tensor> {
        let n = obs.dims2()?.0;
        let [c, height, width] = self.input;
        let mut x = (obs.reshape((n, c, height, width))? * PIXEL_SCALE as f64)?;
        let conv = |x: &Tensor, g: &Geometry, layer: &Dense| -> Result<Tensor> {
            let bias = layer.b.as_tensor().reshape((1, (), 1, 1))?;
            Ok(x.conv2d(layer.w.as_tensor(), g.pad, g.stride, 1, 1)?
                .broadcast_add(&bias)?)
        };
        match &self.body {
            Body::Plain(convs) => {
                for c in convs {
                    let g = &c.kind.geometry;
                    // Only the rows and columns a window reads: candle's
                    // backward of a strided conv2d assumes the windows
                    // cover the input.
                    let used = |out: usize| (out - 1) * g.stride + g.kernel;
                    let x_used = x.narrow(2, 0, used(g.out_h))?.narrow(3, 0, used(g.out_w))?;
                    x = conv(&x_used, g, &c.layer)?.relu()?;
                }
            }
            Body::Impala(stacks) => {
                for stack in stacks {
                    let k = &stack.kind;
                    let mut layers = stack.layers.iter();
                    let mut next = || layers.next().expect("a layer per convolution");
                    x = conv(&x, &k.conv.geometry, next())?;
                    x = max_pool_composed(&x, &k.pool)?;
                    for [first, second] in &k.blocks {
                        let h = conv(&x.relu()?, &first.geometry, next())?.relu()?;
                        x = x.add(&conv(&h, &second.geometry, next())?)?;
                    }
                }
                x = x.relu()?;
            }
        }
        Ok(ops::composed::linear(
            &x.flatten_from(1)?,
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
        let packed = match &self.body {
            Body::Plain(_) => Vec::new(),
            Body::Impala(stacks) => stacks
                .iter()
                .map(|s| Ok(s.packed(false)?.to_vec1::<f32>()?))
                .collect::<Result<_>>()?,
        };
        let mut features = Vec::with_capacity(n * self.linear.b.elem_count());
        for part in obs.chunks(self.host_chunk * d) {
            features.extend(self.host_chunk(part, part.len() / d, &packed)?);
        }
        Ok(features)
    }

    /// [`Self::host`] of one chunk; `packed` holds the IMPALA stacks' packed
    /// parameters.
    fn host_chunk(&self, obs: &[f32], n: usize, packed: &[Vec<f32>]) -> Result<Vec<f32>> {
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
                for (stack, p) in stacks.iter().zip(packed) {
                    h = stack.kind.forward(&h, n, p, None);
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
        for (k, s, p) in [
            (3, 2, 0),
            (3, 1, 1),
            (2, 1, 0),
            (4, 3, 2),
            (3, 2, 1),
            (4, 2, 0),
        ] {
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
                let mut cols = Vec::new();
                im2col_into(&mut cols, &xs, n, &g, Pre::Scale(1.0));
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
    fn the_first_layers_fast_path_copies_what_the_runs_copy() {
        for (input, k, s) in [([4, 84, 84], 8, 4), ([2, 10, 9], 4, 2), ([3, 10, 10], 3, 1)] {
            let g = Geometry::new(input, k, s, 0, false);
            let x: Vec<f32> = (0..2 * g.sample_len()).map(|i| (i % 251) as f32).collect();
            let (mut fast, mut runs) = (Vec::new(), Vec::new());
            im2col_into(&mut fast, &x, 2, &g, Pre::Scale(PIXEL_SCALE));
            im2col_runs(&mut runs, &x, 2, &g, Pre::Scale(PIXEL_SCALE));
            assert_eq!(fast, runs, "{input:?} k {k} s {s}");
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
                let mut cols = Vec::new();
                im2col_into(&mut cols, &x, 2, &g, Pre::Scale(1.0));
                let lhs: f32 = cols.iter().zip(&y).map(|(a, b)| a * b).sum();
                let mut back = vec![0f32; x.len()];
                col2im_add(&mut back, &y, 2, &g);
                let rhs: f32 = x.iter().zip(&back).map(|(a, b)| a * b).sum();
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
                let eps = 5e-4;
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
                let op = ConvOp(ConvKind {
                    geometry: g,
                    out,
                    pre,
                    relu,
                    chunk_values: CHUNK_VALUES,
                });
                weighted_sum(&t[0].apply_op3(&t[1], &t[2], op).unwrap(), 4)
            });
        }
    }

    /// A whole IMPALA stack (padded convolutions, max-pool, residual
    /// blocks) as one op, against finite differences in its input and every
    /// parameter; odd sizes, so the pool's padding shows. Small, since every
    /// ReLU and max is a kink that a step in a parameter may cross.
    #[test]
    fn impala_stack_gradients_match_finite_differences() {
        let (n, input, c) = (1, [2, 3, 4], 2);
        let same = |[c, h, w]: [usize; 3], out, pre, relu| ConvKind {
            geometry: Geometry::new([c, h, w], 3, 1, 1, true),
            out,
            pre,
            relu,
            chunk_values: CHUNK_VALUES,
        };
        let pool = Geometry::new([c, input[1], input[2]], 3, 2, 1, true);
        let pooled = [c, pool.out_h, pool.out_w];
        let stack = StackKind {
            conv: same(input, c, Pre::Scale(1.0), false),
            pool,
            blocks: vec![
                [
                    same(pooled, c, Pre::Relu, true),
                    same(pooled, c, Pre::Scale(1.0), false)
                ];
                2
            ],
        };
        let len = n * stack.conv.geometry.sample_len();
        let inputs = [
            (away_from_zero(len, 1), vec![n, len / n]),
            // Small enough that values stay near 1 through the five
            // convolutions, so f32 resolves the differences.
            (
                uniform(stack.params_len(), 2)
                    .into_iter()
                    .map(|v| 0.3 * v)
                    .collect(),
                vec![stack.params_len()],
            ),
        ];
        check_gradients(&inputs, |t| {
            let op = StackOp {
                stack: stack.clone(),
                saved: OnceLock::new(),
            };
            weighted_sum(&t[0].apply_op2(&t[1], op).unwrap(), 3)
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
                let op = ConvOp(ConvKind {
                    geometry: g,
                    out,
                    pre,
                    relu: true,
                    chunk_values,
                });
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
        let (cnn, params) = extractor_params(spec);
        let get = move |name: &str| -> Vec<f32> {
            let var = &params.iter().find(|(n, _)| n == name).unwrap().1;
            var.flatten_all().unwrap().to_vec1().unwrap()
        };
        (cnn, get)
    }

    /// [`extractor`]'s network and its parameters by name.
    fn extractor_params(spec: &CnnSpec) -> (Cnn, Vec<(String, Var)>) {
        let mut params = Vec::new();
        let cnn = Cnn::new(
            spec,
            LayerInit::Orthogonal(2f64.sqrt()),
            &mut Init::Draw(&mut rng(0)),
            &mut params,
            &Device::Cpu,
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
        (cnn, params)
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

    /// The composed NatureCNN graph (what runs off the CPU) gives the fused
    /// graph's features and the same gradients for every parameter.
    #[test]
    fn composed_extractors_match_the_fused_ones() {
        let plain = CnnSpec {
            input: [2, 12, 11],
            arch: CnnArch::Nature {
                conv: vec![
                    ConvSpec {
                        channels: 3,
                        kernel: 4,
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
        // Odd and even sides: the pools' last windows end on the border.
        let impala = CnnSpec {
            input: [2, 12, 11],
            arch: CnnArch::Impala {
                channels: vec![3, 4],
                blocks: 2,
            },
            features_dim: 5,
        };
        for spec in [plain, impala] {
            composed_extractor_matches_the_fused_one(&spec);
        }
    }

    fn composed_extractor_matches_the_fused_one(spec: &CnnSpec) {
        let (cnn, params) = extractor_params(spec);
        let (n, d) = (3, 2 * 12 * 11);
        let obs: Vec<f32> = (0..n * d).map(|i| ((i * 53) % 256) as f32).collect();
        let x = Tensor::from_vec(obs, (n, d), &Device::Cpu).unwrap();
        let run = |features: Tensor| {
            let loss = weighted_sum(&features, 9);
            let grads = loss.backward().unwrap();
            let mut out = vec![features.flatten_all().unwrap().to_vec1::<f32>().unwrap()];
            for (_, var) in &params {
                out.push(
                    grads
                        .get(var)
                        .unwrap()
                        .flatten_all()
                        .unwrap()
                        .to_vec1()
                        .unwrap(),
                );
            }
            out
        };
        let fused = run(cnn.graph(&x).unwrap());
        let composed = run(cnn.composed_graph(&x).unwrap());
        assert!(fused[0].iter().any(|&v| v > 0.0), "some feature is on");
        for (a, b) in fused.iter().zip(&composed) {
            for (u, v) in a.iter().zip(b) {
                assert!((u - v).abs() <= 1e-4 * (1.0 + u.abs()), "{a:?}\n{b:?}");
            }
        }
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
