//! The f32 matrix products the fused ops share: strided views ([`Mat`]),
//! gemm with a parallelism chosen by size, and reading CPU storage.

use super::*;

/// A strided f32 matrix inside a slice.
#[derive(Clone, Copy)]
pub(crate) struct Mat<'a> {
    pub(crate) data: &'a [f32],
    pub(crate) offset: usize,
    pub(crate) rows: usize,
    pub(crate) cols: usize,
    pub(crate) row_stride: usize,
    pub(crate) col_stride: usize,
}

impl<'a> Mat<'a> {
    pub(crate) fn new(
        data: &'a [f32],
        offset: usize,
        (rows, cols): (usize, usize),
        (row_stride, col_stride): (usize, usize),
    ) -> Self {
        if rows > 0 && cols > 0 {
            // Every element gemm may read lies inside `data`.
            assert!(offset + (rows - 1) * row_stride + (cols - 1) * col_stride < data.len());
        }
        Self {
            data,
            offset,
            rows,
            cols,
            row_stride,
            col_stride,
        }
    }

    pub(crate) fn dense(data: &'a [f32], rows: usize, cols: usize) -> Self {
        Self::new(data, 0, (rows, cols), (cols, 1))
    }

    /// A 2-D tensor layout over its storage.
    pub(crate) fn of_layout(data: &'a [f32], layout: &Layout) -> Result<Self> {
        let (rows, cols) = layout.shape().dims2()?;
        let stride = layout.stride();
        Ok(Self::new(
            data,
            layout.start_offset(),
            (rows, cols),
            (stride[0], stride[1]),
        ))
    }

    pub(crate) fn t(self) -> Self {
        Self {
            rows: self.cols,
            cols: self.rows,
            row_stride: self.col_stride,
            col_stride: self.row_stride,
            ..self
        }
    }
}

/// Threads for one product: small products run on the calling thread.
pub(crate) fn parallelism(m: usize, n: usize, k: usize) -> Parallelism {
    let threads = rayon::current_num_threads();
    if threads > 1 && m * n * k >= 1 << 20 {
        Parallelism::Rayon(threads)
    } else {
        Parallelism::None
    }
}

/// `dst = [dst +] scale · a · b`, `dst` dense `(a.rows, b.cols)`.
pub(crate) fn matmul_into(
    dst: &mut [f32],
    a: Mat<'_>,
    b: Mat<'_>,
    scale: f32,
    accumulate: bool,
    parallelism: Parallelism,
) {
    let (m, k, n) = (a.rows, a.cols, b.cols);
    assert_eq!(b.rows, k, "inner dimensions");
    assert_eq!(dst.len(), m * n, "destination size");
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !accumulate {
            dst.fill(0.0);
        }
        return;
    }
    // SAFETY: `Mat::new` checked that every strided element of `a` and `b`
    // is in bounds, and `dst` holds exactly `m · n` dense elements.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,
            n as isize,
            accumulate,
            a.data[a.offset..].as_ptr(),
            a.col_stride as isize,
            a.row_stride as isize,
            b.data[b.offset..].as_ptr(),
            b.col_stride as isize,
            b.row_stride as isize,
            1.0,
            scale,
            false,
            false,
            false,
            parallelism,
        )
    }
}

/// `scale · a · b` as a new dense vector.
pub(crate) fn matmul(a: Mat<'_>, b: Mat<'_>, scale: f32) -> Vec<f32> {
    let mut out = vec![0f32; a.rows * b.cols];
    let par = parallelism(a.rows, b.cols, a.cols);
    matmul_into(&mut out, a, b, scale, false, par);
    out
}

/// The f32 data of a CPU storage.
pub(crate) fn cpu_f32(storage: &CpuStorage) -> Result<&[f32]> {
    match storage {
        CpuStorage::F32(data) => Ok(data),
        other => bail!("training ops take f32 tensors, got {:?}", other.dtype()),
    }
}

/// The contiguous f32 elements of a layout over a storage.
pub(crate) fn contiguous<'a>(
    storage: &'a CpuStorage,
    layout: &Layout,
    op: &str,
) -> Result<&'a [f32]> {
    match layout.contiguous_offsets() {
        Some((start, end)) => Ok(&cpu_f32(storage)?[start..end]),
        None => bail!("{op}: input must be contiguous"),
    }
}

/// Runs `f` on a 2-D tensor as a strided matrix (no copy).
pub(crate) fn with_mat<R>(t: &Tensor, f: impl FnOnce(Mat<'_>) -> R) -> Result<R> {
    let (storage, layout) = t.storage_and_layout();
    let Storage::Cpu(cpu) = &*storage else {
        bail!("training ops run on the CPU")
    };
    Ok(f(Mat::of_layout(cpu_f32(cpu)?, layout)?))
}

/// Runs `f` on a tensor's elements in row-major order (copies only a
/// non-contiguous tensor).
pub(crate) fn with_slice<R>(t: &Tensor, f: impl FnOnce(&[f32]) -> R) -> Result<R> {
    let t = t.detach().contiguous()?;
    let (storage, layout) = t.storage_and_layout();
    let Storage::Cpu(cpu) = &*storage else {
        bail!("training ops run on the CPU")
    };
    let data = contiguous(cpu, layout, "training op")?;
    Ok(f(data))
}

/// `scale · op(a) · op(b)` of 2-D tensors, `op` transposing when asked.
pub(crate) fn product(a: &Tensor, a_t: bool, b: &Tensor, b_t: bool, scale: f32) -> Result<Tensor> {
    let (data, rows, cols) = with_mat(a, |a| {
        let a = if a_t { a.t() } else { a };
        with_mat(b, |b| {
            let b = if b_t { b.t() } else { b };
            (matmul(a, b, scale), a.rows, b.cols)
        })
    })??;
    Tensor::from_vec(data, (rows, cols), &Device::Cpu)
}

/// Rows per parallel chunk so that a chunk holds about 16 K elements.
pub(crate) fn rows_per_chunk(width: usize) -> usize {
    (16 * 1024 / width.max(1)).max(1)
}

/// Column sums of a `(rows, cols)` row-major slice.
pub(crate) fn column_sums(data: &[f32], cols: usize) -> Vec<f32> {
    data.par_chunks(cols * rows_per_chunk(cols))
        .map(|chunk| {
            let mut sums = vec![0f32; cols];
            for row in chunk.chunks_exact(cols) {
                for (s, v) in sums.iter_mut().zip(row) {
                    *s += v;
                }
            }
            sums
        })
        .reduce(
            || vec![0f32; cols],
            |mut a, b| {
                for (x, y) in a.iter_mut().zip(&b) {
                    *x += y;
                }
                a
            },
        )
}
