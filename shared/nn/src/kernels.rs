//! Hand-written f32 kernels: a fast `tanh`, activation gradients, a small
//! dense layer `y = act(x W^T + b)` for tiny batches, bias and column sums,
//! the Adam update, and a channels-last max-pool (with its argmax).
//!
//! Why they exist: candle's CPU `tanh` calls libm's scalar `tanhf` per element
//! and dominated the 4-64-64-2 MLP (1.8 ms vs 0.37 ms with ReLU at batch 512),
//! and candle's per-op overhead dominates tiny batches. These
//! kernels are plain loops written so LLVM vectorizes them; on x86-64 they are
//! also compiled for AVX2+FMA and for AVX-512 and the widest one the CPU
//! supports is picked at run time, so a portable build still gets the wide
//! instructions (the small-batch dense layer has explicit AVX2 intrinsics).
//!
//! `tanh` follows Cephes' `tanhf` (polynomial for small |x|, `exp` form
//! above) with a branch-free polynomial `exp`; it is within 1.1 ULP of the exact
//! value (tested below; libm's `tanhf` is about 1 ULP). Both the training path
//! ([`crate::ops`]) and the inference path ([`crate::ActorCritic::act`]) use
//! this same function, so they agree.

use crate::spec::Activation;

/// `a * b + c`, fused when the caller is compiled with FMA.
#[inline(always)]
fn fmadd<const FMA: bool>(a: f32, b: f32, c: f32) -> f32 {
    if FMA {
        a.mul_add(b, c)
    } else {
        a * b + c
    }
}

/// `e^x` for `x` in about `[-87, 88]` (Cephes `expf`: `x = n ln2 + r`,
/// degree-6 polynomial on `r`, `2^n` assembled in the exponent bits).
/// Branch-free, so it vectorizes.
#[inline(always)]
fn exp_one<const FMA: bool>(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // Adding 1.5 * 2^23 rounds to an integer, which lands in the low mantissa bits.
    const ROUND: f32 = 12_582_912.0;
    let t = fmadd::<FMA>(x, LOG2E, ROUND);
    let n = t - ROUND;
    let r = fmadd::<FMA>(n, -LN2_HI, x);
    let r = fmadd::<FMA>(n, -LN2_LO, r);
    let mut p: f32 = 1.987_569_1e-4;
    p = fmadd::<FMA>(p, r, 1.398_199_9e-3);
    p = fmadd::<FMA>(p, r, 8.333_452e-3);
    p = fmadd::<FMA>(p, r, 4.166_579_6e-2);
    p = fmadd::<FMA>(p, r, 1.666_666_5e-1);
    p = fmadd::<FMA>(p, r, 5e-1);
    let y = fmadd::<FMA>(p, r * r, r) + 1.0;
    let n_int = t.to_bits() as i32 - ROUND.to_bits() as i32;
    y * f32::from_bits(((n_int + 127) << 23) as u32)
}

/// `tanh` as Cephes `tanhf`: an odd polynomial below |x| = 0.625, else
/// `1 - 2 / (e^{2|x|} + 1)` with the sign restored; saturates at |x| = 9
/// (where `tanh` rounds to 1 in f32). Both branches are computed and one is
/// selected, so the loop vectorizes.
#[inline(always)]
fn tanh_one<const FMA: bool>(x: f32) -> f32 {
    let ax = x.abs().min(9.0);
    let e = exp_one::<FMA>(ax + ax);
    let big = (1.0 - 2.0 / (e + 1.0)).copysign(x);
    let z = x * x;
    let mut p: f32 = -5.704_988_7e-3;
    p = fmadd::<FMA>(p, z, 2.063_909e-2);
    p = fmadd::<FMA>(p, z, -5.373_971_6e-2);
    p = fmadd::<FMA>(p, z, 1.333_144_2e-1);
    p = fmadd::<FMA>(p, z, -3.333_328e-1);
    let small = fmadd::<FMA>(x * z, p, x);
    let y = if ax < 0.625 { small } else { big };
    // `min` above swallowed NaN; give it back. (A constant rather than `x`:
    // with `x` LLVM turns the in-place loop into a masked store, slow on AMD.)
    if x.is_nan() {
        f32::NAN
    } else {
        y
    }
}

/// Scalar fast `tanh` (same function the vector kernels compute).
#[inline]
pub fn tanh_scalar(x: f32) -> f32 {
    tanh_one::<false>(x)
}

#[inline(always)]
fn tanh_inplace_generic<const FMA: bool>(xs: &mut [f32]) {
    for x in xs.iter_mut() {
        *x = tanh_one::<FMA>(*x);
    }
}

#[inline(always)]
fn tanh_grad_generic(y: &[f32], g: &[f32], out: &mut [f32]) {
    for ((o, &y), &g) in out.iter_mut().zip(y).zip(g) {
        *o = g * (1.0 - y * y);
    }
}

#[inline(always)]
fn relu_grad_generic(y: &[f32], g: &[f32], out: &mut [f32]) {
    for ((o, &y), &g) in out.iter_mut().zip(y).zip(g) {
        *o = if y > 0.0 { g } else { 0.0 };
    }
}

#[inline(always)]
fn column_sums_generic(x: &[f32], sums: &mut [f32]) {
    sums.fill(0.0);
    for row in x.chunks_exact(sums.len()) {
        for (s, &v) in sums.iter_mut().zip(row) {
            *s += v;
        }
    }
}

/// The window of a max-pool over channels-last images: `kernel`, `stride`
/// and `pad` (which never wins), in both directions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolWindow {
    /// Square window size.
    pub kernel: usize,
    /// Step between windows.
    pub stride: usize,
    /// Border on every side, smaller than `kernel`.
    pub pad: usize,
}

impl PoolWindow {
    /// Output size of an input size.
    pub fn out(&self, size: usize) -> usize {
        (size + 2 * self.pad - self.kernel) / self.stride + 1
    }
}

/// Values per block of [`zip_lanes`]: one AVX-512 vector.
const LANES: usize = 16;

/// `f(d, s)` for every pair of `dst` and `src` values, in blocks of
/// [`LANES`]: LLVM's vector loops want several vectors' worth of values
/// before they start, so runs of a few channels would stay scalar.
#[inline(always)]
pub(crate) fn zip_lanes(dst: &mut [f32], src: &[f32], f: impl Fn(&mut f32, f32)) {
    let mut d = dst.chunks_exact_mut(LANES);
    let mut s = src.chunks_exact(LANES);
    for (d, s) in (&mut d).zip(&mut s) {
        let (d, s): (&mut [f32; LANES], &[f32; LANES]) = (
            d.try_into().expect("LANES values"),
            s.try_into().expect("LANES values"),
        );
        // On local copies: on the slices LLVM cannot rule out aliasing
        // and keeps the block scalar.
        let (mut dv, sv) = (*d, *s);
        for (d, s) in dv.iter_mut().zip(sv) {
            f(d, s);
        }
        *d = dv;
    }
    for (d, &s) in d.into_remainder().iter_mut().zip(s.remainder()) {
        f(d, s);
    }
}

/// Where `pixel` beats `best`, takes its values, and their indices
/// (`at`, `at + 1`, ...) into `arg`; in blocks of [`LANES`], branch-free.
#[inline(always)]
fn max_argmax_lanes(best: &mut [f32], arg: &mut [u32], pixel: &[f32], at: u32) {
    // Selects by bit masks on local copies: LLVM turns `if` selects on the
    // slices into branches and scalar stores.
    #[inline(always)]
    fn step<const N: usize>(m: &mut [f32; N], a: &mut [u32; N], v: &[f32; N], at: u32) {
        let (mut mv, mut av) = (*m, *a);
        for l in 0..N {
            let take = ((v[l] > mv[l]) as u32).wrapping_neg();
            mv[l] = f32::from_bits((v[l].to_bits() & take) | (mv[l].to_bits() & !take));
            av[l] = ((at + l as u32) & take) | (av[l] & !take);
        }
        (*m, *a) = (mv, av);
    }
    let n = pixel.len();
    let full = n - n % LANES;
    for block in (0..full).step_by(LANES) {
        let range = block..block + LANES;
        step::<LANES>(
            (&mut best[range.clone()]).try_into().expect("LANES"),
            (&mut arg[range.clone()]).try_into().expect("LANES"),
            pixel[range].try_into().expect("LANES"),
            at + block as u32,
        );
    }
    for i in full..n {
        step::<1>(
            (&mut best[i..i + 1]).try_into().expect("1"),
            (&mut arg[i..i + 1]).try_into().expect("1"),
            pixel[i..i + 1].try_into().expect("1"),
            at + i as u32,
        );
    }
}

#[inline(always)]
fn max_pool_generic<const ARGMAX: bool>(
    x: &[f32],
    [c, h, w]: [usize; 3],
    win: PoolWindow,
    y: &mut Vec<f32>,
    argmax: &mut Vec<u32>,
) {
    let PoolWindow {
        kernel: k,
        stride: s,
        pad: p,
    } = win;
    // The in-image part of a window: `lo..hi` of a row or column.
    let span = |o: usize, size: usize| ((o * s).saturating_sub(p), (o * s + k - p).min(size));
    for sample in x.chunks_exact(c * h * w) {
        for oy in 0..win.out(h) {
            let (y0, y1) = span(oy, h);
            for ox in 0..win.out(w) {
                let (x0, x1) = span(ox, w);
                // The window's first pixel, then the rest against it.
                let (start, first) = (y.len(), (y0 * w + x0) * c);
                y.extend_from_slice(&sample[first..first + c]);
                if ARGMAX {
                    argmax.extend((first..first + c).map(|i| i as u32));
                }
                for iy in y0..y1 {
                    for ix in x0..x1 {
                        let at = (iy * w + ix) * c;
                        let pixel = &sample[at..at + c];
                        let best = &mut y[start..];
                        if ARGMAX {
                            max_argmax_lanes(best, &mut argmax[start..], pixel, at as u32);
                        } else {
                            zip_lanes(best, pixel, |m, v| *m = if v > *m { v } else { *m });
                        }
                    }
                }
            }
        }
    }
}

#[inline(always)]
fn add_row_bias_generic(x: &mut [f32], b: &[f32]) {
    for row in x.chunks_exact_mut(b.len()) {
        for (v, &bj) in row.iter_mut().zip(b) {
            *v += bj;
        }
    }
}

#[inline(always)]
fn relu_inplace_generic(xs: &mut [f32]) {
    for x in xs.iter_mut() {
        // `max` would turn NaN into 0; keep NaN visible. A select with an
        // unconditional store vectorizes (a conditional store did not, and
        // cost a seventh of a SAC train step).
        *x = if *x < 0.0 { 0.0 } else { *x };
    }
}

/// Dot product with 8 independent lanes (vectorizable without reassociation
/// flags) and a scalar tail.
#[inline(always)]
fn dot<const FMA: bool>(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let ca = a.chunks_exact(8);
    let cb = b.chunks_exact(8);
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (xa, xb) in ca.zip(cb) {
        for l in 0..8 {
            acc[l] = fmadd::<FMA>(xa[l], xb[l], acc[l]);
        }
    }
    let mut s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (&xa, &xb) in ra.iter().zip(rb) {
        s = fmadd::<FMA>(xa, xb, s);
    }
    s
}

#[inline(always)]
fn dense_generic<const FMA: bool>(
    x: &[f32],
    inp: usize,
    w: &[f32],
    b: &[f32],
    out: &mut [f32],
    act: Option<Activation>,
) {
    for (xr, orow) in x.chunks_exact(inp).zip(out.chunks_exact_mut(b.len())) {
        for ((o, wj), &bj) in orow.iter_mut().zip(w.chunks_exact(inp)).zip(b) {
            *o = dot::<FMA>(xr, wj) + bj;
        }
    }
    match act {
        Some(Activation::Tanh) => tanh_inplace_generic::<FMA>(out),
        Some(Activation::Relu) => relu_inplace_generic(out),
        None => {}
    }
}

/// Coefficients of one Adam step (see [`crate::optim::Adam`]).
#[derive(Debug, Clone, Copy)]
pub(crate) struct AdamCoeffs {
    pub beta1: f32,
    pub beta2: f32,
    /// `lr / (1 - beta1^t)`.
    pub step_size: f32,
    /// `1 / sqrt(1 - beta2^t)`.
    pub inv_bc2_sqrt: f32,
    pub eps: f32,
    pub weight_decay: f32,
}

#[inline(always)]
fn adam_generic<const FMA: bool>(
    p: &mut [f32],
    g: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    c: AdamCoeffs,
) {
    let (b1c, b2c) = (1.0 - c.beta1, 1.0 - c.beta2);
    for (((p, &g), m), v) in p.iter_mut().zip(g).zip(m.iter_mut()).zip(v.iter_mut()) {
        let g = fmadd::<FMA>(c.weight_decay, *p, g);
        *m = fmadd::<FMA>(c.beta1, *m, b1c * g);
        *v = fmadd::<FMA>(c.beta2, *v, b2c * g * g);
        let denom = fmadd::<FMA>(v.sqrt(), c.inv_bc2_sqrt, c.eps);
        *p -= c.step_size * *m / denom;
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    //! The kernels compiled for AVX2 + FMA and for AVX-512, picked at run time.
    use super::*;

    /// Which instruction set the run-time dispatch picked.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub(super) enum Level {
        Avx512,
        Avx2,
        Portable,
    }

    /// The widest supported level (the feature checks are cached by std).
    #[inline]
    pub(super) fn level() -> Level {
        use std::arch::is_x86_feature_detected as has;
        if has!("avx512f")
            && has!("avx512vl")
            && has!("avx512dq")
            && has!("avx512bw")
            && has!("fma")
        {
            Level::Avx512
        } else if has!("avx2") && has!("fma") {
            Level::Avx2
        } else {
            Level::Portable
        }
    }

    /// Compiles an elementwise kernel twice, for AVX2 + FMA and for AVX-512
    /// (LLVM then uses 16-wide vectors and 32 registers).
    macro_rules! versions {
        ($avx2:ident, $avx512:ident, ($($arg:ident: $ty:ty),*), $body:expr) => {
            #[target_feature(enable = "avx2,fma")]
            pub(super) fn $avx2($($arg: $ty),*) {
                $body
            }

            #[target_feature(enable = "avx512f,avx512vl,avx512dq,avx512bw,avx2,fma")]
            pub(super) fn $avx512($($arg: $ty),*) {
                $body
            }
        };
    }

    versions!(tanh_inplace, tanh_inplace_512, (xs: &mut [f32]), tanh_inplace_generic::<true>(xs));
    versions!(tanh_grad, tanh_grad_512, (y: &[f32], g: &[f32], out: &mut [f32]), tanh_grad_generic(y, g, out));
    versions!(relu_grad, relu_grad_512, (y: &[f32], g: &[f32], out: &mut [f32]), relu_grad_generic(y, g, out));
    versions!(column_sums, column_sums_512, (x: &[f32], sums: &mut [f32]), column_sums_generic(x, sums));
    versions!(relu_inplace, relu_inplace_512, (xs: &mut [f32]), relu_inplace_generic(xs));
    versions!(add_row_bias, add_row_bias_512, (x: &mut [f32], b: &[f32]), add_row_bias_generic(x, b));
    versions!(
        max_pool,
        max_pool_512,
        (x: &[f32], image: [usize; 3], win: PoolWindow, y: &mut Vec<f32>, argmax: &mut Vec<u32>),
        max_pool_generic::<false>(x, image, win, y, argmax)
    );
    versions!(
        max_pool_argmax,
        max_pool_argmax_512,
        (x: &[f32], image: [usize; 3], win: PoolWindow, y: &mut Vec<f32>, argmax: &mut Vec<u32>),
        max_pool_generic::<true>(x, image, win, y, argmax)
    );
    versions!(
        adam,
        adam_512,
        (p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32], c: AdamCoeffs),
        adam_generic::<true>(p, g, m, v, c)
    );

    /// The inputs of one dense layer; `full` is `inp` rounded down to a multiple of 8.
    #[derive(Clone, Copy)]
    struct Operands<'a> {
        x: &'a [f32],
        w: &'a [f32],
        b: &'a [f32],
        inp: usize,
        full: usize,
    }

    /// Dot products of `R` rows of `x` with `C` rows of `w` over the first
    /// `full` (a multiple of 8) columns: `R * C` independent accumulators,
    /// each loaded vector reused `C` or `R` times.
    ///
    /// SAFETY: rows `r0..r0 + R` of `x` and `j0..j0 + C` of `w` exist
    /// (row length `inp >= full`).
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn block<const R: usize, const C: usize>(
        op: &Operands<'_>,
        r0: usize,
        j0: usize,
    ) -> [[f32; C]; R] {
        use std::arch::x86_64::*;
        let Operands {
            x, w, inp, full, ..
        } = *op;
        debug_assert!((r0 + R) * inp <= x.len() && (j0 + C) * inp <= w.len());
        let xp = x.as_ptr().add(r0 * inp);
        let wp = w.as_ptr().add(j0 * inp);
        let mut acc = [[_mm256_setzero_ps(); C]; R];
        let mut k = 0;
        while k < full {
            let mut wv = [_mm256_setzero_ps(); C];
            for (c, v) in wv.iter_mut().enumerate() {
                *v = _mm256_loadu_ps(wp.add(c * inp + k));
            }
            for (r, row) in acc.iter_mut().enumerate() {
                let xv = _mm256_loadu_ps(xp.add(r * inp + k));
                for (a, v) in row.iter_mut().zip(&wv) {
                    *a = _mm256_fmadd_ps(xv, *v, *a);
                }
            }
            k += 8;
        }
        let mut out = [[0f32; C]; R];
        for (o_row, a_row) in out.iter_mut().zip(&acc) {
            for (o, a) in o_row.iter_mut().zip(a_row) {
                let s4 = _mm_add_ps(_mm256_castps256_ps128(*a), _mm256_extractf128_ps::<1>(*a));
                let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
                let s1 = _mm_add_ss(s2, _mm_shuffle_ps::<0b01>(s2, s2));
                *o = _mm_cvtss_f32(s1);
            }
        }
        out
    }

    /// Writes `R x C` results plus the scalar tail `full..inp` and the bias.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    fn emit<const R: usize, const C: usize>(
        op: &Operands<'_>,
        out: &mut [f32],
        r0: usize,
        j0: usize,
    ) {
        let Operands { x, w, b, inp, full } = *op;
        let outw = b.len();
        assert!((r0 + R) * inp <= x.len() && (j0 + C) * inp <= w.len() && j0 + C <= outw);
        // SAFETY: bounds asserted above.
        let s = unsafe { block::<R, C>(op, r0, j0) };
        for (r, s_row) in s.iter().enumerate() {
            let xr = &x[(r0 + r) * inp..(r0 + r + 1) * inp];
            for (c, &v) in s_row.iter().enumerate() {
                let wj = &w[(j0 + c) * inp..(j0 + c + 1) * inp];
                let mut v = v;
                for k in full..inp {
                    v = xr[k].mul_add(wj[k], v);
                }
                out[(r0 + r) * outw + j0 + c] = v + b[j0 + c];
            }
        }
    }

    /// `out = x W^T + b` with explicit AVX2 register blocking: 4 rows x 2
    /// outputs (8 accumulators, 6 loads per 8 FMAs), 1 row x 4 outputs for
    /// leftover rows (a batch of one), single outputs for leftover columns.
    #[target_feature(enable = "avx2,fma")]
    pub(super) fn dense_matmul(x: &[f32], inp: usize, w: &[f32], b: &[f32], out: &mut [f32]) {
        if inp < 8 {
            // e.g. the first layer on a 4-value observation: nothing to vectorize along k.
            return dense_generic::<true>(x, inp, w, b, out, None);
        }
        let outw = b.len();
        let rows = out.len() / outw;
        let full = inp - inp % 8;
        let op = Operands { x, w, b, inp, full };
        let mut r = 0;
        while r + 4 <= rows {
            let mut j = 0;
            while j + 2 <= outw {
                emit::<4, 2>(&op, out, r, j);
                j += 2;
            }
            if j < outw {
                emit::<4, 1>(&op, out, r, j);
            }
            r += 4;
        }
        while r < rows {
            let mut j = 0;
            while j + 4 <= outw {
                emit::<1, 4>(&op, out, r, j);
                j += 4;
            }
            while j < outw {
                emit::<1, 1>(&op, out, r, j);
                j += 1;
            }
            r += 1;
        }
    }
}

/// Calls the widest compiled version of a kernel the CPU supports.
macro_rules! dispatch {
    ($avx2:ident, $avx512:ident, ($($arg:expr),*), $portable:expr) => {{
        #[cfg(target_arch = "x86_64")]
        match x86::level() {
            // SAFETY: the CPU supports the features each version is compiled for.
            x86::Level::Avx512 => return unsafe { x86::$avx512($($arg),*) },
            x86::Level::Avx2 => return unsafe { x86::$avx2($($arg),*) },
            x86::Level::Portable => {}
        }
        $portable
    }};
}

/// `xs[i] = tanh(xs[i])` with the fast approximation.
pub fn tanh_inplace(xs: &mut [f32]) {
    dispatch!(
        tanh_inplace,
        tanh_inplace_512,
        (xs),
        tanh_inplace_generic::<false>(xs)
    )
}

/// `xs[i] = max(xs[i], 0)` (NaN stays NaN).
pub fn relu_inplace(xs: &mut [f32]) {
    dispatch!(
        relu_inplace,
        relu_inplace_512,
        (xs),
        relu_inplace_generic(xs)
    )
}

/// Gradient through `y = tanh(z)`: `out = g * (1 - y^2)`. All slices have equal length.
pub fn tanh_grad(y: &[f32], g: &[f32], out: &mut [f32]) {
    assert!(y.len() == g.len() && g.len() == out.len());
    dispatch!(
        tanh_grad,
        tanh_grad_512,
        (y, g, out),
        tanh_grad_generic(y, g, out)
    )
}

/// Gradient through `y = relu(z)`: `out = g * (y > 0)`. All slices have equal length.
pub fn relu_grad(y: &[f32], g: &[f32], out: &mut [f32]) {
    assert!(y.len() == g.len() && g.len() == out.len());
    dispatch!(
        relu_grad,
        relu_grad_512,
        (y, g, out),
        relu_grad_generic(y, g, out)
    )
}

/// Dense layer on row-major buffers: `out[r, j] = act(sum_k x[r, k] w[j, k] + b[j])`.
///
/// `x` is `[rows, inp]`, `w` is `[b.len(), inp]` (PyTorch `Linear` layout),
/// `out` is `[rows, b.len()]`; `rows` is `out.len() / b.len()`. Meant for
/// a handful of rows; candle's gemm is faster from about 20.
pub fn dense(
    x: &[f32],
    inp: usize,
    w: &[f32],
    b: &[f32],
    out: &mut [f32],
    act: Option<Activation>,
) {
    assert!(!b.is_empty() && out.len().is_multiple_of(b.len()));
    assert_eq!(w.len(), b.len() * inp);
    assert_eq!(x.len(), out.len() / b.len() * inp);
    #[cfg(target_arch = "x86_64")]
    if x86::level() != x86::Level::Portable {
        // SAFETY: the CPU supports AVX2 and FMA.
        unsafe { x86::dense_matmul(x, inp, w, b, out) };
        return match act {
            Some(Activation::Tanh) => tanh_inplace(out),
            Some(Activation::Relu) => relu_inplace(out),
            None => {}
        };
    }
    dense_generic::<false>(x, inp, w, b, out, act)
}

/// `sums[j] = sum_r x[r, j]` for row-major `x: [rows, sums.len()]`.
pub fn column_sums(x: &[f32], sums: &mut [f32]) {
    dispatch!(
        column_sums,
        column_sums_512,
        (x, sums),
        column_sums_generic(x, sums)
    )
}

/// Max-pool of channels-last images `x: [n, h, w, c]` (`image` is `[c, h,
/// w]`) appended to `y` as `[n, out_h, out_w, c]`; with `argmax`, also the
/// index in its image of each output's maximum (the first in window order
/// on ties, as PyTorch), appended there.
pub fn max_pool(
    x: &[f32],
    image: [usize; 3],
    win: PoolWindow,
    y: &mut Vec<f32>,
    argmax: Option<&mut Vec<u32>>,
) {
    assert!(
        win.pad < win.kernel
            && x.len()
                .is_multiple_of(image.iter().product::<usize>().max(1))
    );
    match argmax {
        None => {
            let none = &mut Vec::new();
            dispatch!(
                max_pool,
                max_pool_512,
                (x, image, win, y, none),
                max_pool_generic::<false>(x, image, win, y, none)
            )
        }
        Some(argmax) => dispatch!(
            max_pool_argmax,
            max_pool_argmax_512,
            (x, image, win, y, argmax),
            max_pool_generic::<true>(x, image, win, y, argmax)
        ),
    }
}

/// `x[r, j] += b[j]` for row-major `x: [rows, b.len()]`.
pub fn add_row_bias(x: &mut [f32], b: &[f32]) {
    dispatch!(
        add_row_bias,
        add_row_bias_512,
        (x, b),
        add_row_bias_generic(x, b)
    )
}

/// One Adam update of parameters `p` with gradient `g` and moments `m`, `v`
/// (all the same length), in place.
pub(crate) fn adam(p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32], c: AdamCoeffs) {
    assert!(p.len() == g.len() && g.len() == m.len() && m.len() == v.len());
    dispatch!(
        adam,
        adam_512,
        (p, g, m, v, c),
        adam_generic::<false>(p, g, m, v, c)
    )
}

#[cfg(test)]
mod tests;
