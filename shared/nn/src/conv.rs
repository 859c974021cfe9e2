//! The convolutions of the image features extractor: `im2col` + gemm
//! convolutions (padded, optionally reading `relu(x)`), max-pool with its
//! argmax, their backward passes, and the graph ops (`ConvOp`, `StackOp`)
//! that carry them into candle's graph; max-pool composed from candle's
//! basic ops for other devices.
//!
//! The extractor built from them, a plain stack of convolutions
//! (Stable-Baselines3's `NatureCNN` by default) or IMPALA's ResNet, with
//! its parameters, training graph and graph-free inference path, is the
//! `cnn` submodule (`Cnn`, re-exported here); [`crate::ActorCritic`] and
//! [`crate::QNetwork`] put it in front of their hidden layers. The kernels
//! stay here, the architectures there, so each can be read alone; the
//! tests of both are in `conv/tests.rs`.
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

use std::sync::OnceLock;

use candle_core::{CpuStorage, CustomOp2, CustomOp3, Device, Layout, Shape, Tensor};

use crate::kernels::{self, zip_lanes, PoolWindow};
use crate::ops::{cpu_f32, with_f32};

mod cnn;

pub(crate) use cnn::Cnn;
pub use cnn::{CNN_PREFIX, HOST_CHUNK_VALUES};

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

#[cfg(test)]
mod tests;
