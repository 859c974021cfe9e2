//! Trainable variables by name: [`named_vars`] (a `VarMap`'s vars in a
//! stable order, for full fine-tuning), [`var_values`] (their current
//! values as named f32 tensors) and [`set_var_values`] (the inverse,
//! all-or-nothing). What replicas hand over and compare, checkpoints
//! hold, and [`crate::LoraAdapter::named_values`] reads.
//!
//! Its own module so that the adapter ([`crate::lora`]) and the SFT
//! trainer ([`crate::sft`]) share these helpers without the adapter
//! importing a trainer; [`crate::sft`] re-exports them at their old paths.

use candle_core::{DType, Tensor, Var};
use candle_nn::VarMap;

/// Every var of a map with its name, sorted by name (a stable order for
/// the optimizer).
pub fn named_vars(varmap: &VarMap) -> Vec<(String, Var)> {
    let mut vars: Vec<(String, Var)> = varmap
        .data()
        .lock()
        .expect("VarMap lock")
        .iter()
        .map(|(n, v)| (n.clone(), v.clone()))
        .collect();
    vars.sort_by(|a, b| a.0.cmp(&b.0));
    vars
}

/// The current values of `vars` (name, shape, f32 data) in their order:
/// what replicas hand over and compare.
pub fn var_values(vars: &[(String, Var)]) -> candle_core::Result<Vec<relay_nn::NamedTensor>> {
    vars.iter()
        .map(|(name, var)| {
            let t = var.as_tensor();
            let data = t.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?;
            Ok((name.clone(), t.dims().to_vec(), data))
        })
        .collect()
}

/// Sets `vars` to `values` ([`var_values`] of the same vars elsewhere):
/// names and shapes must match one for one, and on error no var changed.
pub fn set_var_values(
    vars: &[(String, Var)],
    values: &[relay_nn::NamedTensor],
) -> Result<(), String> {
    if vars.len() != values.len() {
        return Err(format!(
            "{} tensors, this replica has {}",
            values.len(),
            vars.len()
        ));
    }
    let mut converted = Vec::with_capacity(vars.len());
    for ((name, var), (held, shape, data)) in vars.iter().zip(values) {
        let t = var.as_tensor();
        if name != held || t.dims() != shape.as_slice() {
            return Err(format!(
                "tensor {held} {shape:?} where this replica has {name} {:?}",
                t.dims()
            ));
        }
        let value = Tensor::from_slice(data, t.dims(), t.device())
            .and_then(|v| v.to_dtype(t.dtype()))
            .map_err(|e| format!("{name}: {e}"))?;
        converted.push(value);
    }
    for ((name, var), value) in vars.iter().zip(converted) {
        var.set(&value).map_err(|e| format!("{name}: {e}"))?;
    }
    Ok(())
}
