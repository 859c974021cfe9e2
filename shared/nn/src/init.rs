//! Weight initialisation: orthogonal matrices as `torch.nn.init.orthogonal_`,
//! and PyTorch's default `nn.Linear` init (uniform in `±1/sqrt(fan_in)`).

use rand::Rng;
use rand_distr::StandardNormal;

/// Where a new model's parameters come from.
pub(crate) enum Init<'a> {
    /// Drawn: each layer's own init (orthogonal or uniform), from this generator.
    Draw(&'a mut rand::rngs::StdRng),
    /// Zeros, for a model whose tensors are loaded right after (a followed
    /// weights version): drawing SAC's actor cost more than loading it.
    Zeros,
}

impl Init<'_> {
    /// [`orthogonal`], or zeros.
    pub(crate) fn orthogonal(&mut self, rows: usize, cols: usize, gain: f64) -> Vec<f32> {
        match self {
            Init::Draw(rng) => orthogonal(rows, cols, gain, *rng),
            Init::Zeros => vec![0.0; rows * cols],
        }
    }

    /// [`uniform_fan_in`], or zeros.
    pub(crate) fn uniform_fan_in(&mut self, n: usize, fan_in: usize) -> Vec<f32> {
        match self {
            Init::Draw(rng) => uniform_fan_in(n, fan_in, *rng),
            Init::Zeros => vec![0.0; n],
        }
    }
}

/// How one layer's weight and bias are drawn.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum LayerInit {
    /// An orthogonal weight with this gain and a zero bias (SB3's
    /// `ortho_init`, which actor-critic policies use).
    Orthogonal(f64),
    /// PyTorch's default `nn.Linear` / `nn.Conv2d` init, weight and bias
    /// uniform in `±1/sqrt(fan_in)` (SB3's DQN and SAC networks keep it).
    FanIn,
}

impl Init<'_> {
    /// One layer's weight, `[out, fan_in]` row-major (a convolution's
    /// `[out, C, k, k]` with `fan_in = C k k`), and bias `[out]`, drawn as
    /// `how` says (the weight first), or zeros.
    pub(crate) fn layer(
        &mut self,
        how: LayerInit,
        out: usize,
        fan_in: usize,
    ) -> (Vec<f32>, Vec<f32>) {
        match how {
            LayerInit::Orthogonal(gain) => (self.orthogonal(out, fan_in, gain), vec![0.0; out]),
            LayerInit::FanIn => (
                self.uniform_fan_in(out * fan_in, fan_in),
                self.uniform_fan_in(out, fan_in),
            ),
        }
    }
}

/// A `rows x cols` row-major matrix with orthonormal rows (if `rows <= cols`)
/// or orthonormal columns (otherwise), scaled by `gain`.
///
/// Same construction as PyTorch's `orthogonal_`: fill with N(0, 1), take the
/// QR decomposition of the tall orientation, fix the signs so `R` has a
/// positive diagonal (which makes `Q` unique), transpose back. The QR here is
/// modified Gram-Schmidt with one re-orthogonalisation pass, in f64.
pub fn orthogonal(rows: usize, cols: usize, gain: f64, rng: &mut impl Rng) -> Vec<f32> {
    let gauss: Vec<f64> = (0..rows * cols)
        .map(|_| rng.sample(StandardNormal))
        .collect();
    // Tall orientation: m x k with m >= k; column j of it is `col(j)`.
    let transpose = rows < cols;
    let (m, k) = if transpose {
        (cols, rows)
    } else {
        (rows, cols)
    };
    // Store the columns of the tall matrix contiguously.
    let mut q: Vec<Vec<f64>> = (0..k)
        .map(|j| {
            (0..m)
                .map(|i| {
                    if transpose {
                        gauss[j * cols + i]
                    } else {
                        gauss[i * cols + j]
                    }
                })
                .collect()
        })
        .collect();
    for j in 0..k {
        let (done, rest) = q.split_at_mut(j);
        let v = &mut rest[0];
        for _pass in 0..2 {
            for u in done.iter() {
                let d: f64 = u.iter().zip(v.iter()).map(|(a, b)| a * b).sum();
                for (vi, ui) in v.iter_mut().zip(u) {
                    *vi -= d * ui;
                }
            }
        }
        let norm = v.iter().map(|x| x * x).sum::<f64>().sqrt();
        // A zero column has probability zero with Gaussian input; guard anyway.
        let inv = if norm > 0.0 { 1.0 / norm } else { 0.0 };
        for x in v.iter_mut() {
            *x *= inv;
        }
    }
    let mut out = vec![0f32; rows * cols];
    for (j, col) in q.iter().enumerate() {
        for (i, &x) in col.iter().enumerate() {
            let (r, c) = if transpose { (j, i) } else { (i, j) };
            out[r * cols + c] = (gain * x) as f32;
        }
    }
    out
}

/// `n` values uniform in `[-1/sqrt(fan_in), 1/sqrt(fan_in))`: PyTorch's
/// default `nn.Linear` init for both weight (`kaiming_uniform_(a=sqrt(5))`
/// works out to this bound) and bias. SB3's DQN and SAC networks keep it.
pub fn uniform_fan_in(n: usize, fan_in: usize, rng: &mut impl Rng) -> Vec<f32> {
    let bound = 1.0 / (fan_in.max(1) as f64).sqrt();
    (0..n)
        .map(|_| rng.random_range(-bound..bound) as f32)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    fn check(rows: usize, cols: usize, gain: f64) {
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        let w = orthogonal(rows, cols, gain, &mut rng);
        // W W^T = gain^2 I (rows <= cols) or W^T W = gain^2 I.
        let (n, len, stride_outer, stride_inner) = if rows <= cols {
            (rows, cols, cols, 1)
        } else {
            (cols, rows, 1, cols)
        };
        for a in 0..n {
            for b in 0..n {
                let d: f64 = (0..len)
                    .map(|t| {
                        w[a * stride_outer + t * stride_inner] as f64
                            * w[b * stride_outer + t * stride_inner] as f64
                    })
                    .sum();
                let e = if a == b { gain * gain } else { 0.0 };
                assert!(
                    (d - e).abs() < 1e-5 * (1.0 + gain * gain),
                    "{rows}x{cols} ({a},{b}): {d}"
                );
            }
        }
    }

    #[test]
    fn uniform_fan_in_bound_and_spread() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(5);
        let w = uniform_fan_in(10_000, 16, &mut rng);
        assert!(w.iter().all(|x| x.abs() <= 0.25));
        let mean = w.iter().map(|&x| x as f64).sum::<f64>() / 1e4;
        let var = w.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / 1e4;
        assert!(mean.abs() < 0.01, "{mean}");
        // Uniform on [-b, b] has variance b^2 / 3.
        assert!((var - 0.0625 / 3.0).abs() < 0.002, "{var}");
    }

    #[test]
    fn orthogonal_rows_or_columns() {
        check(64, 4, 2f64.sqrt());
        check(4, 64, 1.0);
        check(64, 64, 2f64.sqrt());
        check(2, 64, 0.01);
        check(1, 64, 1.0);
        check(3, 3, 1.0);
    }
}
