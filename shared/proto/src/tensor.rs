//! Tensors on the wire: raw little-endian bytes with a dtype and a shape.

use serde::{Deserialize, Serialize};

/// Element type of a [`Tensor`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DType {
    F32,
    I64,
    U8,
    /// Token ids.
    U32,
}

impl DType {
    pub fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::I64 => 8,
            DType::U8 => 1,
            DType::U32 => 4,
        }
    }
}

/// Why a tensor cannot be read.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum TensorError {
    #[error("tensor holds {got} bytes but dtype {dtype:?} and shape {shape:?} need {want}")]
    ByteLength {
        dtype: DType,
        shape: Vec<u32>,
        want: usize,
        got: usize,
    },
    #[error("expected dtype {want:?}, got {got:?}")]
    DType { want: DType, got: DType },
    #[error("expected shape {want:?}, got {got:?}")]
    Shape { want: Vec<u32>, got: Vec<u32> },
    #[error("non-finite value at element {index}")]
    NonFinite { index: usize },
}

/// A dense array: raw little-endian bytes plus dtype and shape.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Tensor {
    pub dtype: DType,
    pub shape: Vec<u32>,
    #[serde(with = "serde_bytes")]
    pub data: Vec<u8>,
}

impl Tensor {
    pub fn from_f32(shape: &[usize], values: &[f32]) -> Self {
        debug_assert_eq!(shape.iter().product::<usize>(), values.len());
        let mut data = Vec::with_capacity(values.len() * 4);
        for v in values {
            data.extend_from_slice(&v.to_le_bytes());
        }
        Self {
            dtype: DType::F32,
            shape: shape.iter().map(|&d| d as u32).collect(),
            data,
        }
    }

    pub fn from_i64(shape: &[usize], values: &[i64]) -> Self {
        debug_assert_eq!(shape.iter().product::<usize>(), values.len());
        let mut data = Vec::with_capacity(values.len() * 8);
        for v in values {
            data.extend_from_slice(&v.to_le_bytes());
        }
        Self {
            dtype: DType::I64,
            shape: shape.iter().map(|&d| d as u32).collect(),
            data,
        }
    }

    pub fn from_u32(shape: &[usize], values: &[u32]) -> Self {
        debug_assert_eq!(shape.iter().product::<usize>(), values.len());
        let mut data = Vec::with_capacity(values.len() * 4);
        for v in values {
            data.extend_from_slice(&v.to_le_bytes());
        }
        Self {
            dtype: DType::U32,
            shape: shape.iter().map(|&d| d as u32).collect(),
            data,
        }
    }

    pub fn from_u8(shape: &[usize], values: &[u8]) -> Self {
        debug_assert_eq!(shape.iter().product::<usize>(), values.len());
        Self {
            dtype: DType::U8,
            shape: shape.iter().map(|&d| d as u32).collect(),
            data: values.to_vec(),
        }
    }

    /// Observations as they travel: one byte per value for image
    /// observations (`pixels`, whole numbers in `0..=255`), f32 otherwise.
    pub fn observations(shape: &[usize], values: &[f32], pixels: bool) -> Self {
        if pixels {
            debug_assert!(values
                .iter()
                .all(|v| v.fract() == 0.0 && (0.0..=255.0).contains(v)));
            let bytes: Vec<u8> = values.iter().map(|&v| v as u8).collect();
            Self::from_u8(shape, &bytes)
        } else {
            Self::from_f32(shape, values)
        }
    }

    /// Checks observations: f32 or uint8 pixels, with the shape `want`.
    pub fn expect_observations(&self, want: &[Option<usize>]) -> Result<(), TensorError> {
        let dtype = if self.dtype == DType::U8 {
            DType::U8
        } else {
            DType::F32
        };
        self.expect(dtype, want)
    }

    /// Observations as f32, whether they travel as f32 or as uint8 pixels
    /// (widened, not scaled: the model scales pixels).
    pub fn observations_to_f32(&self) -> Result<Vec<f32>, TensorError> {
        match self.dtype {
            DType::U8 => {
                self.check_len()?;
                Ok(self.data.iter().map(|&b| f32::from(b)).collect())
            }
            _ => self.to_f32(),
        }
    }

    pub fn from_bool(shape: &[usize], values: &[bool]) -> Self {
        debug_assert_eq!(shape.iter().product::<usize>(), values.len());
        Self {
            dtype: DType::U8,
            shape: shape.iter().map(|&d| d as u32).collect(),
            data: values.iter().map(|&b| b as u8).collect(),
        }
    }

    /// Number of elements the shape describes, saturating at `usize::MAX`
    /// (no payload holds that many): a received shape such as
    /// `[65536, 65536, 65536, 65536]` must neither overflow (a panic in debug
    /// builds) nor wrap to 0 and pass for an empty tensor.
    pub fn numel(&self) -> usize {
        self.shape
            .iter()
            .fold(1usize, |n, &d| n.saturating_mul(d as usize))
    }

    /// The rows `rows` of a tensor whose first dimension is `n` rows (a
    /// checked tensor: its byte length matches its shape), in that order.
    pub fn select_rows(&self, rows: &[usize]) -> Tensor {
        let n = self.shape.first().copied().unwrap_or(0) as usize;
        let width = self.data.len().checked_div(n).unwrap_or(0);
        let mut data = Vec::with_capacity(rows.len() * width);
        for &r in rows {
            data.extend_from_slice(&self.data[r * width..(r + 1) * width]);
        }
        let mut shape = self.shape.clone();
        if let Some(first) = shape.first_mut() {
            *first = rows.len() as u32;
        }
        Tensor {
            dtype: self.dtype,
            shape,
            data,
        }
    }

    /// Rows `rows` of a tensor whose first dimension is its rows (a checked
    /// tensor), as one contiguous copy.
    pub fn row_range(&self, rows: std::ops::Range<usize>) -> Tensor {
        let n = self.shape.first().copied().unwrap_or(0) as usize;
        let width = self.data.len().checked_div(n).unwrap_or(0);
        let mut shape = self.shape.clone();
        if let Some(first) = shape.first_mut() {
            *first = rows.len() as u32;
        }
        Tensor {
            dtype: self.dtype,
            shape,
            data: self.data[rows.start * width..rows.end * width].to_vec(),
        }
    }

    /// The block `steps x envs` of a `[T, N, ...]` tensor (a checked
    /// tensor), shaped `[steps, envs, ...]`.
    pub fn block(&self, steps: std::ops::Range<usize>, envs: std::ops::Range<usize>) -> Tensor {
        let (t, n) = (self.shape[0] as usize, self.shape[1] as usize);
        let width = self.data.len().checked_div(t * n).unwrap_or(0);
        let mut data = Vec::with_capacity(steps.len() * envs.len() * width);
        for step in steps.clone() {
            let row = step * n;
            data.extend_from_slice(
                &self.data[(row + envs.start) * width..(row + envs.end) * width],
            );
        }
        let mut shape = self.shape.clone();
        shape[0] = steps.len() as u32;
        shape[1] = envs.len() as u32;
        Tensor {
            dtype: self.dtype,
            shape,
            data,
        }
    }

    /// Tensors of the same dtype and trailing shape, one after another
    /// along their first dimension. `parts` is not empty.
    pub fn concat_rows<'a>(parts: impl IntoIterator<Item = &'a Tensor>) -> Tensor {
        let mut parts = parts.into_iter();
        let mut whole = parts.next().expect("at least one part").clone();
        for part in parts {
            whole.shape[0] += part.shape[0];
            whole.data.extend_from_slice(&part.data);
        }
        whole
    }

    pub fn shape_usize(&self) -> Vec<usize> {
        self.shape.iter().map(|&d| d as usize).collect()
    }

    /// Checks that the byte length matches dtype and shape.
    pub fn check_len(&self) -> Result<(), TensorError> {
        let want = self.numel().saturating_mul(self.dtype.size());
        if want != self.data.len() {
            return Err(TensorError::ByteLength {
                dtype: self.dtype,
                shape: self.shape.clone(),
                want,
                got: self.data.len(),
            });
        }
        Ok(())
    }

    /// Checks dtype, and the shape where `want` gives a dimension (`None` = any).
    pub fn expect(&self, dtype: DType, want: &[Option<usize>]) -> Result<(), TensorError> {
        if self.dtype != dtype {
            return Err(TensorError::DType {
                want: dtype,
                got: self.dtype,
            });
        }
        let matches = self.shape.len() == want.len()
            && self
                .shape
                .iter()
                .zip(want)
                .all(|(&got, w)| w.is_none_or(|w| w == got as usize));
        if !matches {
            return Err(TensorError::Shape {
                want: want
                    .iter()
                    .map(|w| w.map_or(u32::MAX, |w| w as u32))
                    .collect(),
                got: self.shape.clone(),
            });
        }
        self.check_len()
    }

    pub fn to_f32(&self) -> Result<Vec<f32>, TensorError> {
        self.ensure_dtype(DType::F32)?;
        Ok(self
            .data
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect())
    }

    /// Like [`Tensor::to_f32`], rejecting NaN and infinities.
    pub fn to_finite_f32(&self) -> Result<Vec<f32>, TensorError> {
        let values = self.to_f32()?;
        if let Some(index) = values.iter().position(|v| !v.is_finite()) {
            return Err(TensorError::NonFinite { index });
        }
        Ok(values)
    }

    pub fn to_i64(&self) -> Result<Vec<i64>, TensorError> {
        self.ensure_dtype(DType::I64)?;
        Ok(self
            .data
            .chunks_exact(8)
            .map(|c| i64::from_le_bytes(c.try_into().expect("chunk of 8")))
            .collect())
    }

    pub fn to_u32(&self) -> Result<Vec<u32>, TensorError> {
        self.ensure_dtype(DType::U32)?;
        Ok(self
            .data
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect())
    }

    pub fn to_bool(&self) -> Result<Vec<bool>, TensorError> {
        self.ensure_dtype(DType::U8)?;
        Ok(self.data.iter().map(|&b| b != 0).collect())
    }

    fn ensure_dtype(&self, dtype: DType) -> Result<(), TensorError> {
        if self.dtype != dtype {
            return Err(TensorError::DType {
                want: dtype,
                got: self.dtype,
            });
        }
        self.check_len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_each_dtype() {
        let t = Tensor::from_f32(&[2, 2], &[1.0, -2.5, 3.0, 0.0]);
        assert_eq!(t.to_f32().unwrap(), vec![1.0, -2.5, 3.0, 0.0]);
        let t = Tensor::from_i64(&[3], &[1, -7, 9]);
        assert_eq!(t.to_i64().unwrap(), vec![1, -7, 9]);
        let t = Tensor::from_bool(&[2], &[true, false]);
        assert_eq!(t.to_bool().unwrap(), vec![true, false]);
    }

    #[test]
    fn rejects_wrong_length_dtype_shape_and_nan() {
        let mut t = Tensor::from_f32(&[2], &[1.0, 2.0]);
        t.data.pop();
        assert!(matches!(t.check_len(), Err(TensorError::ByteLength { .. })));
        let t = Tensor::from_f32(&[2], &[1.0, f32::NAN]);
        assert_eq!(t.to_finite_f32(), Err(TensorError::NonFinite { index: 1 }));
        assert!(matches!(t.to_i64(), Err(TensorError::DType { .. })));
        assert!(matches!(
            t.expect(DType::F32, &[Some(3)]),
            Err(TensorError::Shape { .. })
        ));
        assert!(t.expect(DType::F32, &[None]).is_ok());
    }

    #[test]
    fn shapes_whose_size_overflows_are_refused() {
        // 2^64 elements would wrap to 0 and pass for an empty tensor.
        let t = Tensor {
            dtype: DType::F32,
            shape: vec![1 << 16; 4],
            data: vec![],
        };
        assert_eq!(t.numel(), usize::MAX);
        assert!(matches!(t.check_len(), Err(TensorError::ByteLength { .. })));
        let t = Tensor {
            dtype: DType::I64,
            shape: vec![u32::MAX, u32::MAX],
            data: vec![0; 8],
        };
        assert!(matches!(t.check_len(), Err(TensorError::ByteLength { .. })));
        let t = Tensor {
            dtype: DType::U8,
            shape: vec![u32::MAX, u32::MAX, u32::MAX, 0],
            data: vec![],
        };
        assert!(t.check_len().is_ok());
    }
}
