//! Reading and writing named f32 tensors as safetensors, in files
//! (checkpoints) and in memory (weights versions on the wire).
//!
//! The only file I/O in the crate. Writes go to a temporary file beside the
//! target and are renamed into place, so a crash never leaves a truncated
//! checkpoint under the real name.

use std::borrow::Cow;
use std::collections::HashMap;
use std::path::Path;

use safetensors::{Dtype, SafeTensors, View};

use crate::error::{NnError, Result};

/// A named f32 tensor: name, shape, row-major data.
pub type NamedTensor = (String, Vec<usize>, Vec<f32>);

struct F32View<'a> {
    shape: &'a [usize],
    data: &'a [f32],
}

impl View for F32View<'_> {
    fn dtype(&self) -> Dtype {
        Dtype::F32
    }

    fn shape(&self) -> &[usize] {
        self.shape
    }

    fn data(&self) -> Cow<'_, [u8]> {
        Cow::Owned(self.data.iter().flat_map(|x| x.to_le_bytes()).collect())
    }

    fn data_len(&self) -> usize {
        self.data.len() * 4
    }
}

fn ckpt_err(path: &Path, reason: impl std::fmt::Display) -> NnError {
    NnError::Checkpoint {
        path: path.to_path_buf(),
        reason: reason.to_string(),
    }
}

/// Views of `tensors` for the safetensors writer, each checked to fill
/// its shape.
fn views(tensors: &[NamedTensor]) -> Result<Vec<(&str, F32View<'_>)>> {
    tensors
        .iter()
        .map(|(name, shape, data)| {
            if shape.iter().product::<usize>() != data.len() {
                return Err(NnError::ShapeMismatch {
                    name: name.clone(),
                    expected: shape.clone(),
                    got: shape.clone(),
                    detail: format!("; data has {} values", data.len()),
                });
            }
            Ok((name.as_str(), F32View { shape, data }))
        })
        .collect()
}

/// Writes `tensors` (f32) and string `metadata` to `path` atomically.
pub fn write_safetensors(
    path: &Path,
    tensors: &[NamedTensor],
    metadata: HashMap<String, String>,
) -> Result<()> {
    let views = views(tensors)?;
    let file_name = path
        .file_name()
        .ok_or_else(|| ckpt_err(path, "path has no file name"))?
        .to_string_lossy();
    let tmp = path.with_file_name(format!(".{file_name}.tmp-{}", std::process::id()));
    safetensors::serialize_to_file(views, Some(metadata), &tmp).map_err(|e| ckpt_err(&tmp, e))?;
    std::fs::rename(&tmp, path).map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        ckpt_err(path, format!("rename from {}: {e}", tmp.display()))
    })
}

/// `tensors` (f32) and string `metadata` as the bytes of a safetensors file.
pub fn to_safetensors(
    tensors: &[NamedTensor],
    metadata: HashMap<String, String>,
) -> Result<Vec<u8>> {
    safetensors::serialize(views(tensors)?, Some(metadata))
        .map_err(|e| ckpt_err(Path::new("(in memory)"), e))
}

/// Splits named tensors into those whose name starts with `prefix` (with
/// the prefix removed) and the rest, e.g. `vec_normalize.*` statistics
/// stored beside a model's parameters in one checkpoint or weight message.
pub fn split_prefixed(
    tensors: Vec<NamedTensor>,
    prefix: &str,
) -> (Vec<NamedTensor>, Vec<NamedTensor>) {
    let mut with = Vec::new();
    let mut rest = Vec::new();
    for (name, shape, data) in tensors {
        match name.strip_prefix(prefix) {
            Some(stripped) => with.push((stripped.to_string(), shape, data)),
            None => rest.push((name, shape, data)),
        }
    }
    (with, rest)
}

/// Reads every tensor of a safetensors file (all must be f32), sorted by
/// name, and its string metadata.
pub fn read_safetensors(path: &Path) -> Result<(Vec<NamedTensor>, HashMap<String, String>)> {
    let bytes = std::fs::read(path).map_err(|e| ckpt_err(path, e))?;
    parse(&bytes, path)
}

/// [`read_safetensors`] of a file's bytes held in memory.
pub fn from_safetensors(bytes: &[u8]) -> Result<(Vec<NamedTensor>, HashMap<String, String>)> {
    parse(bytes, Path::new("(in memory)"))
}

fn parse(bytes: &[u8], path: &Path) -> Result<(Vec<NamedTensor>, HashMap<String, String>)> {
    let (_, meta) = SafeTensors::read_metadata(bytes).map_err(|e| ckpt_err(path, e))?;
    let metadata = meta.metadata().clone().unwrap_or_default();
    let st = SafeTensors::deserialize(bytes).map_err(|e| ckpt_err(path, e))?;
    let mut out = Vec::with_capacity(st.len());
    for (name, view) in st.tensors() {
        if view.dtype() != Dtype::F32 {
            return Err(ckpt_err(
                path,
                format!("tensor `{name}` has dtype {:?}, expected F32", view.dtype()),
            ));
        }
        let data = view
            .data()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        out.push((name, view.shape().to_vec(), data));
    }
    out.sort_by(|a, b| a.0.cmp(&b.0));
    Ok((out, metadata))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_prefixed_separates_and_strips() {
        let t: Vec<NamedTensor> = vec![
            ("vec_normalize.obs_rms.mean".into(), vec![1], vec![0.5]),
            ("action_net.bias".into(), vec![1], vec![1.0]),
            ("vec_normalize.ret_rms.var".into(), vec![1], vec![2.0]),
        ];
        let (with, rest) = split_prefixed(t, "vec_normalize.");
        assert_eq!(
            with.iter().map(|t| t.0.as_str()).collect::<Vec<_>>(),
            ["obs_rms.mean", "ret_rms.var"]
        );
        assert_eq!(
            rest,
            vec![("action_net.bias".to_string(), vec![1], vec![1.0])]
        );
    }
}
