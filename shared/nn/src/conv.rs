//! The convolutional features extractor of image policies (a [`CnnSpec`]:
//! Stable-Baselines3's `NatureCNN` by default), with its training graph and
//! its graph-free inference path.
//!
//! # How a convolution runs
//! Each convolution is `im2col` (every receptive field copied out as one row
//! of a `[B * out_h * out_w, C * k * k]` patch matrix) times the kernel read
//! as `[out, C * k * k]`, through candle's gemm, with bias and ReLU in place:
//! nearly all the work is the matmul. It runs in chunks of samples whose
//! patch matrix stays under [`HOST_CHUNK_VALUES`], in training too (one
//! graph op, `ConvRelu`, whose backward pass rebuilds each chunk's patches
//! for the kernel gradient and scatter-adds the input gradient with
//! `col2im`): the patch matrix of a whole batch (100 MiB for NatureCNN's
//! first layer at batch 256) is never built, and glibc reuses each chunk's
//! block for the next instead of mapping fresh pages.
//!
//! A convolution's output is `[B, out_h, out_w, C]` (channels last), so the
//! next one reads channels-last input, with patch columns in `(ky, kx, c)`
//! order (the kernel permuted to match), so that every run it copies is
//! contiguous; the first reads the observation channels first, as Gymnasium
//! (after relay's worker) and PyTorch lay images out, in PyTorch's `(c, ky,
//! kx)` order. Before the dense layer the features are permuted to channels
//! first, so flattening matches PyTorch's `nn.Flatten` and an SB3
//! `NatureCNN` state dict loads as is.
//!
//! # Parameters (SB3's names)
//! | name | shape | init |
//! |---|---|---|
//! | `features_extractor.cnn.{2i}.weight` / `.bias` | `[out, C, k, k]` / `[out]` | orthogonal, gain √2 / 0 |
//! | `features_extractor.linear.0.weight` / `.bias` | `[features_dim, flat]` / `[features_dim]` | orthogonal, gain √2 / 0 |

use std::borrow::Cow;

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp3, DType, Device, Layout, Shape, Storage, Tensor, Var};

use crate::error::Result;
use crate::init::Init;
use crate::kernels;
use crate::model::{dense_host, Dense};
use crate::ops::{self, cpu_f32, with_f32};
use crate::spec::{Activation, CnnSpec};

/// Name prefix of the extractor's parameters (SB3's).
pub const CNN_PREFIX: &str = "features_extractor";

/// Largest patch matrix (in f32 values, 16 MiB) one chunk of a graph-free
/// forward builds: glibc's malloc then reuses the freed block for the next
/// chunk (its mmap threshold grows to 32 MiB) instead of mapping and
/// page-faulting a fresh one, and the patches are read back while still
/// in cache.
pub const HOST_CHUNK_VALUES: usize = 4 << 20;

/// Where one convolution reads and what it writes, per sample.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Geometry {
    channels: usize,
    height: usize,
    width: usize,
    kernel: usize,
    stride: usize,
    out_h: usize,
    out_w: usize,
    /// Input laid out `(H, W, C)` (the previous layer's output) rather than
    /// `(C, H, W)` (the observation). Patch columns follow the input:
    /// `(ky, kx, c)` for channels-last, `(c, ky, kx)` (PyTorch's kernel
    /// order) for channels-first, so that every run copied is contiguous.
    channels_last: bool,
}

impl Geometry {
    fn new(input: [usize; 3], kernel: usize, stride: usize, channels_last: bool) -> Self {
        let [c, h, w] = input;
        Self {
            channels: c,
            height: h,
            width: w,
            kernel,
            stride,
            out_h: (h - kernel) / stride + 1,
            out_w: (w - kernel) / stride + 1,
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
    /// of every patch of one sample: `len` values of the input starting at
    /// `input_offset` are patch values `patch_offset..patch_offset + len`
    /// (offsets into the sample's `[patches, patch_len]` block).
    #[inline]
    fn for_each_run(&self, mut f: impl FnMut(usize, usize, usize)) {
        let (k, s, c, w) = (self.kernel, self.stride, self.channels, self.width);
        let pl = self.patch_len();
        for oy in 0..self.out_h {
            for ox in 0..self.out_w {
                let mut at = (oy * self.out_w + ox) * pl;
                if self.channels_last {
                    // Row ky of the patch: k pixels of c channels, contiguous.
                    for ky in 0..k {
                        f(at, ((oy * s + ky) * w + ox * s) * c, k * c);
                        at += k * c;
                    }
                } else {
                    let plane = self.height * w;
                    for ch in 0..c {
                        for ky in 0..k {
                            f(at, ch * plane + (oy * s + ky) * w + ox * s, k);
                            at += k;
                        }
                    }
                }
            }
        }
    }
}

/// `[n, sample_len]` -> `[n * patches, patch_len]`, every value times `scale`.
fn im2col(x: &[f32], n: usize, g: &Geometry, scale: f32) -> Vec<f32> {
    let (block, sl) = (g.patches() * g.patch_len(), g.sample_len());
    // Runs come in patch order, so the matrix is appended, never zeroed first.
    let mut cols = Vec::with_capacity(n * block);
    for sample in x.chunks_exact(sl).take(n) {
        g.for_each_run(|_, from, len| {
            let src = &sample[from..from + len];
            if scale == 1.0 {
                cols.extend_from_slice(src);
            } else {
                cols.extend(src.iter().map(|&v| v * scale));
            }
        });
    }
    debug_assert_eq!(cols.len(), n * block);
    cols
}

/// The adjoint of [`im2col`] (without its scale): scatter-adds patch
/// gradients back to the input.
fn col2im(cols: &[f32], n: usize, g: &Geometry) -> Vec<f32> {
    let (block, sl) = (g.patches() * g.patch_len(), g.sample_len());
    let mut x = vec![0f32; n * sl];
    for (sample, grad) in x.chunks_exact_mut(sl).zip(cols.chunks_exact(block)) {
        g.for_each_run(|to, from, len| {
            let (dst, src) = (&mut sample[from..from + len], &grad[to..to + len]);
            dst.iter_mut().zip(src).for_each(|(d, &v)| *d += v);
        });
    }
    x
}

/// One convolution with ReLU as a graph op: `x: [n, sample_len]`, the
/// kernel `w: [out, patch_len]` (patch column order), `b: [out]` ->
/// `[n * patches, out]` (channels last). Forward and backward run in chunks
/// of samples whose patch matrices stay under [`HOST_CHUNK_VALUES`]: the
/// patch matrix of the whole batch (100 MiB for NatureCNN's first layer at
/// batch 256) is never built, and the backward pass rebuilds each chunk's
/// patches rather than keeping them.
struct ConvRelu {
    geometry: Geometry,
    /// What `im2col` multiplies the input by (1/255 for the raw pixels).
    scale: f32,
    /// Largest patch matrix of one chunk, in values ([`HOST_CHUNK_VALUES`]).
    chunk_values: usize,
}

impl ConvRelu {
    fn chunk_samples(&self) -> usize {
        let g = &self.geometry;
        (self.chunk_values / (g.patches() * g.patch_len())).max(1)
    }
}

impl CustomOp3 for ConvRelu {
    fn name(&self) -> &'static str {
        "relay-conv-relu"
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
            let cols = im2col(part, part.len() / len, g, self.scale);
            y.extend(ops::linear_cpu(
                &CpuStorage::F32(cols),
                &Layout::contiguous((rows, pl)),
                ws,
                wl,
                bias,
                Some(Activation::Relu),
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
        let gz = with_f32(y, "conv bwd", |y| {
            with_f32(g, "conv bwd", |g| {
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
                let cols = im2col(part, samples, geo, self.scale);
                // gW += gz^T cols: [out, rows] x [rows, pl].
                let part_gw = CpuStorage::F32(gz.to_vec()).matmul(
                    &CpuStorage::F32(cols),
                    (1, out, pl, rows),
                    &Layout::contiguous((rows, out)).transpose(0, 1)?,
                    &Layout::contiguous((rows, pl)),
                )?;
                let CpuStorage::F32(part_gw) = part_gw else {
                    candle_core::bail!("conv: matmul returned a non-f32 result")
                };
                gw.iter_mut().zip(&part_gw).for_each(|(a, &b)| *a += b);
                if want_gx {
                    // gX = col2im(gz W): [rows, out] x [out, pl].
                    let gcols = CpuStorage::F32(gz.to_vec()).matmul(
                        ws,
                        (1, rows, pl, out),
                        &Layout::contiguous((rows, out)),
                        w_layout,
                    )?;
                    let CpuStorage::F32(gcols) = gcols else {
                        candle_core::bail!("conv: matmul returned a non-f32 result")
                    };
                    let mut part_gx = col2im(&gcols, samples, geo);
                    if self.scale != 1.0 {
                        part_gx.iter_mut().for_each(|v| *v *= self.scale);
                    }
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

/// One convolution: its geometry and its kernel and bias.
struct Conv {
    geometry: Geometry,
    layer: Dense,
    /// What `im2col` multiplies the input by: 1/255 for the first layer.
    scale: f32,
}

impl Conv {
    fn out_channels(&self) -> usize {
        self.layer.b.elem_count()
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
}

/// The features extractor: convolutions, flatten, dense; ReLU after each.
pub(crate) struct Cnn {
    convs: Vec<Conv>,
    linear: Dense,
    /// `(channels, height, width)` after the last convolution.
    last: [usize; 3],
}

impl Cnn {
    /// Builds the extractor with SB3's init, registering its parameters in `params`.
    pub(crate) fn new(
        spec: &CnnSpec,
        init: &mut Init<'_>,
        params: &mut Vec<(String, Var)>,
    ) -> Result<Self> {
        let dev = Device::Cpu;
        let gain = 2f64.sqrt();
        let shapes = spec.output_shapes()?;
        let mut input = spec.input;
        let mut convs = Vec::with_capacity(spec.conv.len());
        for (i, (c, &out)) in spec.conv.iter().zip(&shapes).enumerate() {
            let fan_in = input[0] * c.kernel * c.kernel;
            let w = Var::from_vec(
                init.orthogonal(c.channels, fan_in, gain),
                (c.channels, input[0], c.kernel, c.kernel),
                &dev,
            )?;
            let b = Var::zeros(c.channels, DType::F32, &dev)?;
            let name = format!("{CNN_PREFIX}.cnn.{}", 2 * i);
            params.push((format!("{name}.weight"), w.clone()));
            params.push((format!("{name}.bias"), b.clone()));
            convs.push(Conv {
                geometry: Geometry::new(input, c.kernel, c.stride, i > 0),
                layer: Dense { w, b },
                scale: if i == 0 { 1.0 / 255.0 } else { 1.0 },
            });
            input = out;
        }
        let flat: usize = input.iter().product();
        let w = Var::from_vec(
            init.orthogonal(spec.features_dim, flat, gain),
            (spec.features_dim, flat),
            &dev,
        )?;
        let b = Var::zeros(spec.features_dim, DType::F32, &dev)?;
        params.push((format!("{CNN_PREFIX}.linear.0.weight"), w.clone()));
        params.push((format!("{CNN_PREFIX}.linear.0.bias"), b.clone()));
        Ok(Self {
            convs,
            linear: Dense { w, b },
            last: input,
        })
    }

    /// Features `[B, features_dim]` of raw observations `[B, C*H*W]` as a graph.
    pub(crate) fn graph(&self, obs: &Tensor) -> Result<Tensor> {
        let n = obs.dims2()?.0;
        let mut h = obs.clone();
        for conv in &self.convs {
            let g = &conv.geometry;
            let w = conv.kernel_matrix(true)?;
            let y = h.apply_op3(
                &w,
                &conv.layer.b,
                ConvRelu {
                    geometry: *g,
                    scale: conv.scale,
                    chunk_values: HOST_CHUNK_VALUES,
                },
            )?;
            h = y.reshape((n, g.patches() * conv.out_channels()))?;
        }
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
        let per_sample = self
            .convs
            .iter()
            .map(|c| c.geometry.patches() * c.geometry.patch_len())
            .max()
            .unwrap_or(1);
        let chunk = (HOST_CHUNK_VALUES / per_sample).max(1);
        let d = obs.len() / n.max(1);
        let mut features = Vec::with_capacity(n * self.linear.b.elem_count());
        for part in obs.chunks(chunk * d) {
            features.extend(self.host_chunk(part, part.len() / d)?);
        }
        Ok(features)
    }

    fn host_chunk(&self, obs: &[f32], n: usize) -> Result<Vec<f32>> {
        let mut h: Cow<'_, [f32]> = Cow::Borrowed(obs);
        for conv in &self.convs {
            let g = &conv.geometry;
            let cols = im2col(&h, n, g, conv.scale);
            let kernel = conv.kernel_matrix(false)?;
            let (wg, wl) = kernel.storage_and_layout();
            let (bg, bl) = conv.layer.b.storage_and_layout();
            let (Storage::Cpu(ws), Storage::Cpu(bs)) = (&*wg, &*bg) else {
                return Err(
                    candle_core::Error::Msg("parameters must live on the CPU".into()).into(),
                );
            };
            let rows = n * g.patches();
            h = Cow::Owned(ops::linear_cpu(
                &CpuStorage::F32(cols),
                &Layout::contiguous((rows, g.patch_len())),
                ws,
                wl,
                cpu_f32(bs, bl, "conv bias")?,
                Some(Activation::Relu),
            )?);
        }
        let [c, oh, ow] = self.last;
        let mut flat = vec![0f32; h.len()];
        for (src, dst) in h
            .chunks_exact(c * oh * ow)
            .zip(flat.chunks_exact_mut(c * oh * ow))
        {
            for (p, pixel) in src.chunks_exact(c).enumerate() {
                for (ch, &v) in pixel.iter().enumerate() {
                    dst[ch * oh * ow + p] = v;
                }
            }
        }
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

    /// A direct convolution (no im2col) of channels-first input, for reference.
    fn direct(x: &[f32], input: [usize; 3], w: &[f32], out: usize, k: usize, s: usize) -> Vec<f32> {
        let [c, h, wd] = input;
        let (oh, ow) = ((h - k) / s + 1, (wd - k) / s + 1);
        let mut y = vec![0f32; out * oh * ow];
        for o in 0..out {
            for oy in 0..oh {
                for ox in 0..ow {
                    let mut acc = 0f32;
                    for ci in 0..c {
                        for ky in 0..k {
                            for kx in 0..k {
                                acc += w[((o * c + ci) * k + ky) * k + kx]
                                    * x[(ci * h + oy * s + ky) * wd + ox * s + kx];
                            }
                        }
                    }
                    y[(o * oh + oy) * ow + ox] = acc;
                }
            }
        }
        y
    }

    #[test]
    fn im2col_times_kernel_is_the_direct_convolution() {
        let input = [3, 9, 7];
        let (out, k, s) = (4, 3, 2);
        let x: Vec<f32> = (0..2 * 3 * 9 * 7)
            .map(|i| ((i * 37) % 11) as f32 - 5.0)
            .collect();
        let w: Vec<f32> = (0..out * 3 * k * k)
            .map(|i| ((i * 13) % 7) as f32 - 3.0)
            .collect();
        let g = Geometry::new(input, k, s, false);
        let cols = im2col(&x, 2, &g, 1.0);
        for b in 0..2 {
            let want = direct(&x[b * 189..(b + 1) * 189], input, &w, out, k, s);
            for p in 0..g.patches() {
                for o in 0..out {
                    let row = &cols[(b * g.patches() + p) * g.patch_len()..][..g.patch_len()];
                    let got: f32 = row
                        .iter()
                        .zip(&w[o * g.patch_len()..])
                        .map(|(a, b)| a * b)
                        .sum();
                    assert_eq!(got, want[o * g.patches() + p]);
                }
            }
        }
    }

    #[test]
    fn col2im_is_the_adjoint_of_im2col() {
        // <im2col(x), y> == <x, col2im(y)> for any x, y, in both layouts.
        for channels_last in [false, true] {
            let g = Geometry::new([2, 6, 5], 3, 1, channels_last);
            let x: Vec<f32> = (0..2 * g.sample_len()).map(|i| (i % 5) as f32).collect();
            let y: Vec<f32> = (0..2 * g.patches() * g.patch_len())
                .map(|i| ((i * 7) % 3) as f32)
                .collect();
            let lhs: f32 = im2col(&x, 2, &g, 1.0)
                .iter()
                .zip(&y)
                .map(|(a, b)| a * b)
                .sum();
            let rhs: f32 = x.iter().zip(col2im(&y, 2, &g)).map(|(a, b)| a * b).sum();
            assert_eq!(lhs, rhs);
        }
    }

    /// The extractor against direct convolutions in PyTorch's layout
    /// (channels-first between layers, `nn.Flatten` order), host and graph.
    #[test]
    fn extractor_matches_direct_convolutions() {
        use crate::spec::ConvSpec;
        use rand::SeedableRng;
        let spec = CnnSpec {
            input: [2, 9, 8],
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
            features_dim: 5,
        };
        let mut params = Vec::new();
        let mut rng = rand::rngs::StdRng::seed_from_u64(0);
        let cnn = Cnn::new(&spec, &mut Init::Draw(&mut rng), &mut params).unwrap();
        let get = |name: &str| -> Vec<f32> {
            let var = &params.iter().find(|(n, _)| n == name).unwrap().1;
            var.flatten_all().unwrap().to_vec1().unwrap()
        };
        // Non-zero biases, so a bias applied at the wrong place shows.
        for (name, var) in &params {
            if name.ends_with("bias") {
                let n = var.elem_count();
                let b: Vec<f32> = (0..n).map(|i| 0.1 * i as f32 - 0.2).collect();
                var.set(&Tensor::from_vec(b, n, &Device::Cpu).unwrap())
                    .unwrap();
            }
        }
        let n = 2;
        let obs: Vec<f32> = (0..n * 144).map(|i| ((i * 53) % 256) as f32).collect();
        let mut want = Vec::new();
        for sample in obs.chunks_exact(144) {
            let x: Vec<f32> = sample.iter().map(|v| v / 255.0).collect();
            let relu_bias = |mut y: Vec<f32>, b: Vec<f32>| {
                let per = y.len() / b.len();
                for (i, v) in y.iter_mut().enumerate() {
                    *v = (*v + b[i / per]).max(0.0);
                }
                y
            };
            let h1 = relu_bias(
                direct(
                    &x,
                    [2, 9, 8],
                    &get("features_extractor.cnn.0.weight"),
                    3,
                    3,
                    2,
                ),
                get("features_extractor.cnn.0.bias"),
            );
            let h2 = relu_bias(
                direct(
                    &h1,
                    [3, 4, 3],
                    &get("features_extractor.cnn.2.weight"),
                    4,
                    2,
                    1,
                ),
                get("features_extractor.cnn.2.bias"),
            );
            let (w, b) = (
                get("features_extractor.linear.0.weight"),
                get("features_extractor.linear.0.bias"),
            );
            for o in 0..5 {
                let z: f32 = h2.iter().zip(&w[o * h2.len()..]).map(|(a, b)| a * b).sum();
                want.push((z + b[o]).max(0.0));
            }
        }
        let host = cnn.host(&obs, n).unwrap();
        let x = Tensor::from_vec(obs, (n, 144), &Device::Cpu).unwrap();
        let graph: Vec<f32> = cnn
            .graph(&x)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        for ((h, g), w) in host.iter().zip(&graph).zip(&want) {
            assert!(
                (h - w).abs() < 1e-5 && (g - w).abs() < 1e-5,
                "{host:?} {graph:?} {want:?}"
            );
        }
        assert!(
            want.iter().any(|&v| v > 0.0),
            "a test with all-zero features shows nothing"
        );
    }

    /// Chunked and whole-batch convolutions agree, forward and backward.
    #[test]
    fn chunks_do_not_change_the_convolution_or_its_gradients() {
        let g = Geometry::new([3, 6, 5], 2, 1, true);
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
            let op = ConvRelu {
                geometry: g,
                scale: 0.5,
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
