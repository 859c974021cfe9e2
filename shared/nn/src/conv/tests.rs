//! The convolutions' tests: im2col, col2im and max-pool against direct
//! loops, the graph ops' gradients against finite differences, and the
//! extractors (plain and IMPALA, fused and composed) against direct
//! convolutions. Its own file because they outgrow the code they test.

use candle_core::Var;
use rand::{Rng, SeedableRng};

use super::*;
use crate::init::{Init, LayerInit};
use crate::spec::{CnnArch, CnnSpec, ConvSpec};

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
                slopes
                    .iter()
                    .any(|s| (s - a).abs() < 5e-3 * (1.0 + s.abs())),
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
