//! The convolutional features extractor of image policies (a [`CnnSpec`]):
//! a plain stack of convolutions (Stable-Baselines3's `NatureCNN` by
//! default) or IMPALA's ResNet, each with its training graph and its
//! graph-free inference path. [`crate::ActorCritic`] and
//! [`crate::QNetwork`] put it in front of their hidden layers.
//!
//! This file owns the architectures: which convolutions, pools and
//! residual blocks an extractor has, their parameters and names, and the
//! forward passes that chain them (fused on the CPU, composed from
//! candle's ops elsewhere). How one convolution or stack computes (and
//! differentiates) is its parent's, [`super`].
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

use candle_core::{Device, Tensor, Var};

use super::{
    max_pool_composed, transpose_samples, ConvKind, ConvOp, Geometry, Pre, StackKind, StackOp,
    CHUNK_VALUES, PIXEL_SCALE,
};
use crate::error::Result;
use crate::init::{Init, LayerInit};
use crate::kernels;
use crate::layers::{dense_host, new_layer, Dense};
use crate::ops::{self, with_f32};
use crate::spec::{Activation, CnnArch, CnnSpec};

/// Name prefix of the extractor's parameters (SB3's).
pub const CNN_PREFIX: &str = "features_extractor";

/// The graph-free forward runs the whole network on chunks of samples
/// whose largest patch matrix holds at most this many values (16 MiB): the
/// activations of a chunk stay a few MiB, so glibc's malloc reuses the
/// freed blocks for the next chunk (its mmap threshold grows to 32 MiB)
/// instead of mapping and page-faulting fresh ones.
pub const HOST_CHUNK_VALUES: usize = 4 << 20;

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
