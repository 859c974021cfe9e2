//! The convolutional features extractor of image policies (a [`CnnSpec`]:
//! Stable-Baselines3's `NatureCNN` by default), with its training graph and
//! its graph-free inference path.
//!
//! # How a convolution runs
//! Each convolution is `im2col` (every receptive field copied out as one row
//! of a `[B * out_h * out_w, C * k * k]` matrix) followed by the fused dense
//! layer of [`crate::ops`] with the kernel read as `[out, C * k * k]`, ReLU
//! included. The matmul, which is nearly all the work, goes through candle's
//! gemm, and the backward pass reuses the dense layer's; only `im2col` and
//! its adjoint (`col2im`, a scatter-add) are written here.
//!
//! The dense layer's output is `[B, out_h, out_w, C]` (channels last), so
//! the next `im2col` reads channels-last input; the first reads the
//! observation channels-first, as Gymnasium (after relay's worker) and
//! PyTorch lay images out. Before the final dense layer the features are
//! permuted to channels-first, so flattening matches PyTorch's
//! `nn.Flatten` and an SB3 `NatureCNN` state dict loads as is.
//!
//! # Parameters (SB3's names)
//! | name | shape | init |
//! |---|---|---|
//! | `features_extractor.cnn.{2i}.weight` / `.bias` | `[out, C, k, k]` / `[out]` | orthogonal, gain √2 / 0 |
//! | `features_extractor.linear.0.weight` / `.bias` | `[features_dim, flat]` / `[features_dim]` | orthogonal, gain √2 / 0 |

use std::borrow::Cow;

use candle_core::{CpuStorage, CustomOp1, DType, Device, Layout, Shape, Storage, Tensor, Var};
use rand::Rng;

use crate::error::Result;
use crate::init::orthogonal;
use crate::model::{dense_host, Dense};
use crate::ops::{self, cpu_f32, with_f32};
use crate::spec::{Activation, CnnSpec};

/// Name prefix of the extractor's parameters (SB3's).
pub const CNN_PREFIX: &str = "features_extractor";

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
    /// Element strides of channel, row and column in one input sample.
    strides: [usize; 3],
}

impl Geometry {
    fn new(input: [usize; 3], kernel: usize, stride: usize, channels_last: bool) -> Self {
        let [c, h, w] = input;
        let strides = if channels_last {
            [1, w * c, c]
        } else {
            [h * w, w, 1]
        };
        Self {
            channels: c,
            height: h,
            width: w,
            kernel,
            stride,
            out_h: (h - kernel) / stride + 1,
            out_w: (w - kernel) / stride + 1,
            strides,
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

    /// Calls `f(patch_row, input_offset)` for every element of every patch
    /// of one sample, in `im2col`'s column order `(c, ky, kx)`.
    #[inline]
    fn for_each(&self, mut f: impl FnMut(usize, usize, usize)) {
        let [sc, sy, sx] = self.strides;
        let k = self.kernel;
        for oy in 0..self.out_h {
            for ox in 0..self.out_w {
                let row = oy * self.out_w + ox;
                let origin = oy * self.stride * sy + ox * self.stride * sx;
                let mut col = 0;
                for c in 0..self.channels {
                    for ky in 0..k {
                        let base = origin + c * sc + ky * sy;
                        for kx in 0..k {
                            f(row, col, base + kx * sx);
                            col += 1;
                        }
                    }
                }
            }
        }
    }
}

/// `[n, sample_len]` -> `[n * patches, patch_len]`.
fn im2col(x: &[f32], n: usize, g: &Geometry, scale: f32) -> Vec<f32> {
    let (pl, sl) = (g.patch_len(), g.sample_len());
    let mut cols = vec![0f32; n * g.patches() * pl];
    for (sample, out) in x
        .chunks_exact(sl)
        .zip(cols.chunks_exact_mut(g.patches() * pl))
        .take(n)
    {
        g.for_each(|row, col, at| out[row * pl + col] = sample[at] * scale);
    }
    cols
}

/// The adjoint of [`im2col`]: scatter-adds patch gradients back to the input.
fn col2im(cols: &[f32], n: usize, g: &Geometry) -> Vec<f32> {
    let (pl, sl) = (g.patch_len(), g.sample_len());
    let mut x = vec![0f32; n * sl];
    for (sample, grad) in x
        .chunks_exact_mut(sl)
        .zip(cols.chunks_exact(g.patches() * pl))
    {
        g.for_each(|row, col, at| sample[at] += grad[row * pl + col]);
    }
    x
}

/// `im2col` as a graph op: `[n, sample_len]` -> `[n * patches, patch_len]`.
struct Im2Col {
    geometry: Geometry,
    /// Multiplies every value on the way (1/255 for the raw pixels).
    scale: f32,
}

impl CustomOp1 for Im2Col {
    fn name(&self) -> &'static str {
        "relay-im2col"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let (n, len) = l.shape().dims2()?;
        let g = &self.geometry;
        if len != g.sample_len() {
            candle_core::bail!("im2col: rows of {len} values, expected {}", g.sample_len())
        }
        let x = cpu_f32(s, l, "im2col")?;
        let cols = im2col(x, n, g, self.scale);
        Ok((
            CpuStorage::F32(cols),
            Shape::from((n * g.patches(), g.patch_len())),
        ))
    }

    fn bwd(&self, x: &Tensor, _res: &Tensor, g: &Tensor) -> candle_core::Result<Option<Tensor>> {
        if !x.track_op() {
            return Ok(None);
        }
        let n = x.dims2()?.0;
        let mut gx = with_f32(g, "im2col bwd", |g| col2im(g, n, &self.geometry))?;
        if self.scale != 1.0 {
            gx.iter_mut().for_each(|v| *v *= self.scale);
        }
        Ok(Some(Tensor::from_vec(gx, x.shape(), &Device::Cpu)?))
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
        rng: &mut impl Rng,
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
                orthogonal(c.channels, fan_in, gain, rng),
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
            orthogonal(spec.features_dim, flat, gain, rng),
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
            let cols = h.apply_op1(Im2Col {
                geometry: *g,
                scale: conv.scale,
            })?;
            let w = conv
                .layer
                .w
                .as_tensor()
                .reshape((conv.out_channels(), g.patch_len()))?;
            let y = ops::linear(&cols, &w, &conv.layer.b, Some(Activation::Relu))?;
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

    /// Features of `n` raw observations without a graph, weights read in place.
    pub(crate) fn host(&self, obs: &[f32], n: usize) -> Result<Vec<f32>> {
        let mut h: Cow<'_, [f32]> = Cow::Borrowed(obs);
        for conv in &self.convs {
            let g = &conv.geometry;
            let cols = im2col(&h, n, g, conv.scale);
            let (wg, wl) = conv.layer.w.storage_and_layout();
            let (bg, bl) = conv.layer.b.storage_and_layout();
            let (Storage::Cpu(ws), Storage::Cpu(bs)) = (&*wg, &*bg) else {
                return Err(
                    candle_core::Error::Msg("parameters must live on the CPU".into()).into(),
                );
            };
            let w_layout = Layout::contiguous_with_offset(
                (conv.out_channels(), g.patch_len()),
                wl.start_offset(),
            );
            let rows = n * g.patches();
            h = Cow::Owned(ops::linear_cpu(
                &CpuStorage::F32(cols),
                &Layout::contiguous((rows, g.patch_len())),
                ws,
                &w_layout,
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
        let cnn = Cnn::new(&spec, &mut rng, &mut params).unwrap();
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
}
