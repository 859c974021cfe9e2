//! [`PackedWeights`]: frozen f32 weight matrices laid out once for the
//! inference matmul `y = x · Wᵀ`, and that matmul.
//!
//! Why not candle's `x.matmul(&w.t())`: measured on SmolLM2-135M at
//! batch 32 (2 threads), about a sixth of a decode step went to `gemm`
//! re-packing the `(out, in)` weight operand on every call, and a quarter
//! to threads spinning at candle's elementwise-op barrier between the
//! dozens of small ops around each matmul. Here the weights are packed
//! once into panels of [`PANEL`] output features, each stored `k`-major
//! (`panel[k][j] = W[panel_start + j][k]`), so the micro-kernel streams
//! one panel with plain loads while it keeps a tile of up to [`TILE_ROWS`]
//! input rows by [`PANEL`] outputs in registers. Several matrices that
//! read the same input (q/k/v, gate/up) pack into one [`PackedWeights`],
//! so they are one pass over the input. [`InferenceWeights`] holds a
//! model's packed layers (built by `crate::infer`, kept by the model).
//!
//! Each output element is one chain of fused multiply-adds over `k` in
//! order, whatever the row's place in the batch, so a sequence gets
//! bit-identical projections alone or batched with others.

use rayon::prelude::*;

/// Output features per panel (two 8-lane vectors).
pub(crate) const PANEL: usize = 16;
/// Input rows per register tile.
const TILE_ROWS: usize = 6;
/// Input rows multiplied per pass over the weights, so the rows stay in
/// the L2 cache while every panel goes by (floats: rows x in_features).
const ROW_BLOCK_FLOATS: usize = 64 * 1024;

/// One or more `(out, in)` matrices with the same `in`, packed for
/// [`PackedWeights::matmul`]. Part `i` occupies output columns
/// `offsets[i] .. offsets[i] + outs[i]` (each part starts on a panel).
#[derive(Debug, Clone)]
pub(crate) struct PackedWeights {
    /// `(panels, in, PANEL)` floats.
    data: Vec<f32>,
    in_features: usize,
    panels: usize,
    outs: Vec<usize>,
    offsets: Vec<usize>,
}

impl PackedWeights {
    /// Packs matrices given as row-major `(outs[i], in_features)` slices.
    pub(crate) fn new(parts: &[(&[f32], usize)], in_features: usize) -> Self {
        let mut outs = Vec::with_capacity(parts.len());
        let mut offsets = Vec::with_capacity(parts.len());
        let mut panels = 0;
        for &(w, out) in parts {
            assert_eq!(w.len(), out * in_features, "weight shape");
            offsets.push(panels * PANEL);
            outs.push(out);
            panels += out.div_ceil(PANEL);
        }
        let mut data = vec![0f32; panels * in_features * PANEL];
        for (&(w, out), &offset) in parts.iter().zip(&offsets) {
            for o in 0..out {
                let col = offset + o;
                let (panel, j) = (col / PANEL, col % PANEL);
                let base = panel * in_features * PANEL + j;
                for (k, &value) in w[o * in_features..(o + 1) * in_features].iter().enumerate() {
                    data[base + k * PANEL] = value;
                }
            }
        }
        Self {
            data,
            in_features,
            panels,
            outs,
            offsets,
        }
    }

    /// Columns of [`PackedWeights::matmul`]'s output rows (every part,
    /// padded to whole panels).
    pub(crate) fn width(&self) -> usize {
        self.panels * PANEL
    }

    /// First output column of part `i`.
    pub(crate) fn offset(&self, part: usize) -> usize {
        self.offsets[part]
    }

    /// Output features of part `i`.
    pub(crate) fn out(&self, part: usize) -> usize {
        self.outs[part]
    }

    /// `x` `(rows, in)` row-major times every part's transpose: `(rows,
    /// width)` row-major (padding columns hold zeros).
    pub(crate) fn matmul(&self, x: &[f32], rows: usize) -> Vec<f32> {
        let k = self.in_features;
        assert_eq!(x.len(), rows * k, "input shape");
        let width = self.width();
        let mut y = vec![0f32; rows * width];
        if rows == 0 {
            return y;
        }
        let block_rows = (ROW_BLOCK_FLOATS / k.max(1)).max(TILE_ROWS) / TILE_ROWS * TILE_ROWS;
        let threads = rayon::current_num_threads().max(1);
        // Enough chunks to balance the threads, few enough to keep the
        // per-chunk overhead small.
        let panels_per_chunk = self.panels.div_ceil(threads * 4).max(1);
        let fma = has_fma();
        let mut start = 0;
        while start < rows {
            let n = block_rows.min(rows - start);
            let xs = &x[start * k..(start + n) * k];
            let ys = SendPtr(y[start * width..].as_mut_ptr());
            let work = |chunk: usize| {
                let first = chunk * panels_per_chunk;
                let last = (first + panels_per_chunk).min(self.panels);
                for panel in first..last {
                    let w = &self.data[panel * k * PANEL..(panel + 1) * k * PANEL];
                    // SAFETY: each panel writes only its own PANEL columns
                    // of the rows of this block, and panels are disjoint.
                    unsafe { panel_product(fma, xs, n, k, w, ys.add(panel * PANEL), width) };
                }
            };
            let chunks = self.panels.div_ceil(panels_per_chunk);
            if chunks == 1 || n * k * PANEL * self.panels < 1 << 16 {
                (0..chunks).for_each(work);
            } else {
                (0..chunks).into_par_iter().for_each(work);
            }
            start += n;
        }
        y
    }
}

#[derive(Clone, Copy)]
struct SendPtr(*mut f32);
// SAFETY: used only to hand disjoint output columns to rayon workers.
unsafe impl Send for SendPtr {}
unsafe impl Sync for SendPtr {}
impl SendPtr {
    unsafe fn add(self, n: usize) -> *mut f32 {
        self.0.add(n)
    }
}

/// Whether the CPU has AVX2 and FMA (checked once).
pub(crate) fn has_fma() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        static FMA: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *FMA.get_or_init(|| {
            std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma")
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// `y[r][0..PANEL] = sum_k x[r][k] * w[k][0..PANEL]` for the `rows` rows of
/// `x`; `y` points at column 0 of this panel in row 0, rows `ldy` apart.
///
/// # Safety
/// `y` must be valid for writes of `rows` rows of `ldy` floats.
unsafe fn panel_product(
    fma: bool,
    x: &[f32],
    rows: usize,
    k: usize,
    w: &[f32],
    y: *mut f32,
    ldy: usize,
) {
    let mut r = 0;
    while r < rows {
        let n = TILE_ROWS.min(rows - r);
        let xr = &x[r * k..(r + n) * k];
        let yr = y.add(r * ldy);
        #[cfg(target_arch = "x86_64")]
        if fma {
            match n {
                6 => avx::tile::<6>(xr, k, w, yr, ldy),
                5 => avx::tile::<5>(xr, k, w, yr, ldy),
                4 => avx::tile::<4>(xr, k, w, yr, ldy),
                3 => avx::tile::<3>(xr, k, w, yr, ldy),
                2 => avx::tile::<2>(xr, k, w, yr, ldy),
                _ => avx::tile::<1>(xr, k, w, yr, ldy),
            }
            r += n;
            continue;
        }
        let _ = fma;
        scalar_tile(xr, n, k, w, yr, ldy);
        r += n;
    }
}

/// Portable tile: the same per-element order of fused multiply-adds.
unsafe fn scalar_tile(x: &[f32], rows: usize, k: usize, w: &[f32], y: *mut f32, ldy: usize) {
    for r in 0..rows {
        let mut acc = [0f32; PANEL];
        let xr = &x[r * k..(r + 1) * k];
        for (kk, &xv) in xr.iter().enumerate() {
            let wk = &w[kk * PANEL..(kk + 1) * PANEL];
            for j in 0..PANEL {
                acc[j] = xv.mul_add(wk[j], acc[j]);
            }
        }
        std::ptr::copy_nonoverlapping(acc.as_ptr(), y.add(r * ldy), PANEL);
    }
}

#[cfg(target_arch = "x86_64")]
mod avx {
    use std::arch::x86_64::*;

    use super::PANEL;

    /// `R` rows by one panel, accumulators in registers.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn tile<const R: usize>(
        x: &[f32],
        k: usize,
        w: &[f32],
        y: *mut f32,
        ldy: usize,
    ) {
        debug_assert!(x.len() >= R * k && w.len() >= k * PANEL);
        let mut acc0 = [_mm256_setzero_ps(); R];
        let mut acc1 = [_mm256_setzero_ps(); R];
        let xp = x.as_ptr();
        let mut wp = w.as_ptr();
        for kk in 0..k {
            let w0 = _mm256_loadu_ps(wp);
            let w1 = _mm256_loadu_ps(wp.add(8));
            for r in 0..R {
                let b = _mm256_broadcast_ss(&*xp.add(r * k + kk));
                acc0[r] = _mm256_fmadd_ps(b, w0, acc0[r]);
                acc1[r] = _mm256_fmadd_ps(b, w1, acc1[r]);
            }
            wp = wp.add(PANEL);
        }
        for r in 0..R {
            _mm256_storeu_ps(y.add(r * ldy), acc0[r]);
            _mm256_storeu_ps(y.add(r * ldy + 8), acc1[r]);
        }
    }
}

/// What the inference forward keeps besides the model's tensors: plain
/// copies of the small vectors and, for a dense base, packed weights.
#[derive(Debug)]
pub(crate) struct InferenceWeights {
    pub(crate) input_norms: Vec<Vec<f32>>,
    pub(crate) post_attention_norms: Vec<Vec<f32>>,
    /// Per layer, Qwen3's per-head query and key norm weights.
    pub(crate) qk_norms: Vec<Option<(Vec<f32>, Vec<f32>)>>,
    pub(crate) final_norm: Vec<f32>,
    /// `(positions, head_dim / 2)` rotary tables.
    pub(crate) rope_cos: Vec<f32>,
    pub(crate) rope_sin: Vec<f32>,
    /// Per layer; `None` when the base is not dense f32.
    pub(crate) layers: Option<Vec<PackedLayer>>,
    pub(crate) lm_head: Option<PackedWeights>,
}

/// One block's packed projections.
#[derive(Debug)]
pub(crate) struct PackedLayer {
    pub(crate) qkv: PackedWeights,
    pub(crate) o: PackedWeights,
    pub(crate) gate_up: PackedWeights,
    pub(crate) down: PackedWeights,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reference(x: &[f32], rows: usize, w: &[f32], out: usize, k: usize) -> Vec<f32> {
        let mut y = vec![0f32; rows * out];
        for r in 0..rows {
            for o in 0..out {
                y[r * out + o] = (0..k)
                    .map(|i| x[r * k + i] as f64 * w[o * k + i] as f64)
                    .sum::<f64>() as f32;
            }
        }
        y
    }

    fn values(n: usize, seed: u32) -> Vec<f32> {
        (0..n)
            .map(|i| {
                ((i as u32).wrapping_mul(2654435761).wrapping_add(seed) % 1000) as f32 / 500.0 - 1.0
            })
            .collect()
    }

    #[test]
    fn packed_parts_multiply_like_the_transposed_matrices_and_rows_do_not_interact() {
        let k = 37;
        let (wa, wb) = (values(20 * k, 1), values(9 * k, 2));
        let packed = PackedWeights::new(&[(&wa, 20), (&wb, 9)], k);
        assert_eq!(packed.width(), 48);
        assert_eq!((packed.offset(1), packed.out(1)), (32, 9));
        for rows in [1, 5, 6, 7, 13, 2000] {
            let x = values(rows * k, rows as u32);
            let y = packed.matmul(&x, rows);
            for (part, (w, out)) in [(&wa, 20), (&wb, 9)].into_iter().enumerate() {
                let want = reference(&x, rows, w, out, k);
                for r in 0..rows {
                    for o in 0..out {
                        let got = y[r * packed.width() + packed.offset(part) + o];
                        let w = want[r * out + o];
                        assert!(
                            (got - w).abs() < 1e-4,
                            "rows {rows} r {r} o {o}: {got} vs {w}"
                        );
                    }
                }
            }
            // A row's result does not depend on the rows around it.
            let alone = packed.matmul(&x[(rows - 1) * k..], 1);
            assert_eq!(&alone[..], &y[(rows - 1) * packed.width()..]);
        }
    }
}
