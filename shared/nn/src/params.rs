//! A model's named parameters: the one place that validates weight loading,
//! writes and reads checkpoints, and copies or Polyak-averages one network
//! into another (target networks).
//!
//! Every model of the crate ([`crate::ActorCritic`], [`crate::QNetwork`], the
//! SAC networks) keeps its `Var`s in a [`Params`] sorted by name, so weight
//! exchange, checkpoints and target updates behave the same everywhere.

use std::collections::HashMap;
use std::path::Path;

use candle_core::{bail, CpuStorage, InplaceOp2, Layout, Tensor, Var};

use crate::error::{NnError, Result};
use crate::io::{read_safetensors, write_safetensors, NamedTensor};
use crate::ops::{cpu_f32, fused_on, with_f32};

/// Parameters sorted by name (names unique).
#[derive(Clone, Default)]
pub(crate) struct Params(Vec<(String, Var)>);

/// `target = target * (1 - tau) + tau * source`, in place, in the order of
/// SB3's `polyak_update` (`mul_(1 - tau)` then `add(.., alpha=tau)`).
struct Polyak(f32);

impl InplaceOp2 for Polyak {
    fn name(&self) -> &'static str {
        "relay-polyak"
    }

    fn cpu_fwd(
        &self,
        ts: &mut CpuStorage,
        tl: &Layout,
        ss: &CpuStorage,
        sl: &Layout,
    ) -> candle_core::Result<()> {
        let src = cpu_f32(ss, sl, "polyak source")?;
        let CpuStorage::F32(t) = ts else {
            bail!("polyak: parameters must be f32")
        };
        let Some((a, b)) = tl.contiguous_offsets() else {
            bail!("polyak: parameters must be contiguous")
        };
        let t = &mut t[a..b];
        if t.len() != src.len() {
            bail!(
                "polyak: {} target values, {} source values",
                t.len(),
                src.len()
            )
        }
        let tau = self.0;
        let keep = 1.0 - tau;
        for (t, &s) in t.iter_mut().zip(src) {
            *t = *t * keep + tau * s;
        }
        Ok(())
    }
}

impl Params {
    /// Sorts by name; names must be unique (a bug in the model otherwise).
    pub(crate) fn new(mut params: Vec<(String, Var)>) -> Self {
        params.sort_by(|a, b| a.0.cmp(&b.0));
        debug_assert!(params.windows(2).all(|w| w[0].0 != w[1].0));
        Self(params)
    }

    pub(crate) fn iter(&self) -> impl Iterator<Item = &(String, Var)> {
        self.0.iter()
    }

    pub(crate) fn names(&self) -> Vec<&str> {
        self.0.iter().map(|(n, _)| n.as_str()).collect()
    }

    pub(crate) fn vars(&self) -> Vec<Var> {
        self.0.iter().map(|(_, v)| v.clone()).collect()
    }

    pub(crate) fn num_parameters(&self) -> usize {
        self.0.iter().map(|(_, v)| v.elem_count()).sum()
    }

    /// Every parameter as `(name, shape, data)`, sorted by name.
    pub(crate) fn named_tensors(&self) -> Vec<NamedTensor> {
        self.0
            .iter()
            .map(|(name, var)| {
                let data = with_f32(var.as_tensor(), "named_tensors", |d| d.to_vec())
                    .expect("parameters are f32 tensors");
                (name.clone(), var.dims().to_vec(), data)
            })
            .collect()
    }

    /// Replaces every parameter; all-or-nothing (see
    /// [`crate::ActorCritic::load_named_tensors`] for the rules).
    pub(crate) fn load_named_tensors(&self, tensors: &[NamedTensor]) -> Result<()> {
        let mut given: HashMap<&str, (&[usize], &[f32])> = HashMap::with_capacity(tensors.len());
        for (name, shape, data) in tensors {
            if given.insert(name.as_str(), (shape, data)).is_some() {
                return Err(NnError::bad_input(
                    "named tensors",
                    "each name once",
                    format!("`{name}` twice"),
                ));
            }
        }
        for (name, var) in &self.0 {
            let expected = var.dims();
            let Some(&(shape, data)) = given.get(name.as_str()) else {
                return Err(NnError::MissingParameter {
                    name: name.clone(),
                    expected: expected.to_vec(),
                });
            };
            if shape != expected || data.len() != expected.iter().product::<usize>() {
                let detail = if shape == expected {
                    format!("; data has {} values", data.len())
                } else {
                    String::new()
                };
                return Err(NnError::ShapeMismatch {
                    name: name.clone(),
                    expected: expected.to_vec(),
                    got: shape.to_vec(),
                    detail,
                });
            }
            if let Some((index, &value)) = data.iter().enumerate().find(|(_, x)| !x.is_finite()) {
                return Err(NnError::NonFinite {
                    name: name.clone(),
                    shape: shape.to_vec(),
                    index,
                    value,
                });
            }
        }
        if given.len() != self.0.len() {
            let mut extra: Vec<(&str, &[usize])> = given
                .iter()
                .filter(|(n, _)| self.0.binary_search_by(|(p, _)| p.as_str().cmp(n)).is_err())
                .map(|(n, (s, _))| (*n, *s))
                .collect();
            extra.sort();
            let (name, shape) = extra[0];
            return Err(NnError::UnexpectedParameter {
                name: name.to_string(),
                got: shape.to_vec(),
            });
        }
        // Validated: building the tensors and `Var::set` cannot fail now.
        for (name, var) in &self.0 {
            let (shape, data) = given[name.as_str()];
            var.set(&Tensor::from_slice(data, shape, var.device())?)?;
        }
        Ok(())
    }

    /// Checks that `other` has the same names (unless `positional`) and
    /// shapes, for copies between an online and a target network.
    fn check_same_layout(&self, other: &Params, positional: bool) -> Result<()> {
        if self.0.len() != other.0.len() {
            return Err(NnError::bad_input(
                "source network",
                format!("{} parameters", self.0.len()),
                format!("{} parameters", other.0.len()),
            ));
        }
        for ((n, v), (m, w)) in self.0.iter().zip(&other.0) {
            if n != m && !positional {
                return Err(NnError::MissingParameter {
                    name: n.clone(),
                    expected: v.dims().to_vec(),
                });
            }
            if v.dims() != w.dims() {
                return Err(NnError::ShapeMismatch {
                    name: n.clone(),
                    expected: v.dims().to_vec(),
                    got: w.dims().to_vec(),
                    detail: String::new(),
                });
            }
        }
        Ok(())
    }

    /// Copies every value of `source` into these parameters (hard target update).
    pub(crate) fn copy_from(&self, source: &Params) -> Result<()> {
        self.check_same_layout(source, false)?;
        self.copy_unchecked(source)
    }

    fn copy_unchecked(&self, source: &Params) -> Result<()> {
        for ((_, t), (_, s)) in self.0.iter().zip(&source.0) {
            t.set(&s.as_tensor().copy()?)?;
        }
        Ok(())
    }

    /// Polyak averaging `self = (1 - tau) self + tau source`, in place;
    /// parameters are matched by name.
    pub(crate) fn soft_update(&self, source: &Params, tau: f32) -> Result<()> {
        self.check_same_layout(source, false)?;
        self.soft_update_unchecked(source, tau)
    }

    /// [`Self::soft_update`] matching parameters by position (same count and
    /// shapes), for networks whose names differ by a prefix
    /// (`critic_target.*` and `critic.*`).
    pub(crate) fn soft_update_positional(&self, source: &Params, tau: f32) -> Result<()> {
        self.check_same_layout(source, true)?;
        self.soft_update_unchecked(source, tau)
    }

    fn soft_update_unchecked(&self, source: &Params, tau: f32) -> Result<()> {
        if !(0.0..=1.0).contains(&tau) {
            return Err(NnError::config(
                "tau",
                format!("must be in [0, 1], got {tau}"),
            ));
        }
        if tau == 1.0 {
            return self.copy_unchecked(source);
        }
        for ((_, t), (_, s)) in self.0.iter().zip(&source.0) {
            if fused_on(t.device()) {
                let s = s.as_tensor().contiguous()?;
                t.inplace_op2(&s, &Polyak(tau))?;
            } else {
                let kept = t.as_detached_tensor().affine(1.0 - tau as f64, 0.0)?;
                t.set(&kept.add(&s.as_detached_tensor().affine(tau as f64, 0.0)?)?)?;
            }
        }
        Ok(())
    }

    /// Writes all parameters with `format` and extra metadata (atomic).
    pub(crate) fn save(
        &self,
        path: &Path,
        format: &str,
        mut meta: HashMap<String, String>,
    ) -> Result<()> {
        meta.insert("format".to_string(), format.to_string());
        write_safetensors(path, &self.named_tensors(), meta)
    }

    /// Loads parameters from a file written by [`Self::save`]; a file with a
    /// different `format` is refused (one without any `format` is accepted,
    /// e.g. an SB3 export). Returns the file's metadata.
    pub(crate) fn load(&self, path: &Path, format: &str) -> Result<HashMap<String, String>> {
        let (tensors, meta) = read_safetensors(path)?;
        if let Some(f) = meta.get("format") {
            if f != format {
                return Err(NnError::Checkpoint {
                    path: path.to_path_buf(),
                    reason: format!("format is `{f}`, expected `{format}`"),
                });
            }
        }
        self.load_named_tensors(&tensors)?;
        Ok(meta)
    }
}
