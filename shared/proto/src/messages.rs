//! Every message type that crosses a process boundary.
//!
//! Each carries `schema` ([`SCHEMA_VERSION`](crate::SCHEMA_VERSION)) as its
//! first field and implements [`WireMessage`](crate::WireMessage), whose
//! `validate` checks what a receiver must not trust: shapes that agree with
//! each other and finite numbers.
//!
//! The types live in one module per subsystem they serve, all re-exported
//! here: `rollouts` (acting, rollout fragments, the on-policy replay),
//! `weights` (policy versions), `metrics` (episodes and metric values),
//! `eval` (evaluations) and `control` (run status, alerts, scaling,
//! logs). The checks they share are below.

use crate::codec::Rejection;
use crate::tensor::{DType, Tensor};

pub(crate) fn tensor_check(
    kind: &'static str,
    field: &'static str,
    result: Result<(), crate::TensorError>,
) -> Result<(), Rejection> {
    result.map_err(|source| Rejection::Tensor {
        kind,
        field: field.into(),
        source,
    })
}

fn finite_f32(kind: &'static str, field: &'static str, t: &Tensor) -> Result<(), Rejection> {
    tensor_check(kind, field, t.to_finite_f32().map(|_| ()))
}

/// Observations: f32 (finite) or uint8 pixels, shaped as `want`, and, when
/// `same_as` is given, of its dtype.
pub(crate) fn observations_check(
    kind: &'static str,
    field: &'static str,
    t: &Tensor,
    want: &[Option<usize>],
    same_as: Option<&Tensor>,
) -> Result<(), Rejection> {
    tensor_check(kind, field, t.expect_observations(want))?;
    if let Some(first) = same_as {
        if first.dtype != t.dtype {
            return Err(invalid(
                kind,
                field,
                format!("is {:?} but obs is {:?}", t.dtype, first.dtype),
            ));
        }
    }
    if t.dtype == DType::F32 {
        finite_f32(kind, field, t)?;
    }
    Ok(())
}

pub(crate) fn invalid(
    kind: &'static str,
    field: &'static str,
    detail: impl Into<String>,
) -> Rejection {
    Rejection::Invalid {
        kind,
        field,
        detail: detail.into(),
    }
}

/// Checks action masks: `[lead.., n_actions]` u8 of 0 and 1 (`n_actions`
/// of the policy when the caller knows it), every row allowing an action
/// (a row that allows none is named).
pub(crate) fn check_masks(
    kind: &'static str,
    field: &'static str,
    masks: &Tensor,
    lead: &[usize],
    n_actions: Option<usize>,
) -> Result<(), Rejection> {
    let mut shape: Vec<Option<usize>> = lead.iter().map(|&d| Some(d)).collect();
    shape.push(n_actions);
    tensor_check(kind, field, masks.expect(DType::U8, &shape))?;
    let width = *masks.shape.last().expect("rank checked") as usize;
    if width == 0 {
        return Err(invalid(kind, field, "masks of zero actions"));
    }
    for (row, mask) in masks.data.chunks_exact(width).enumerate() {
        if let Some(v) = mask.iter().find(|&&v| v > 1) {
            return Err(invalid(
                kind,
                field,
                format!("row {row} holds {v}, not 0 or 1"),
            ));
        }
        if !mask.contains(&1) {
            return Err(invalid(kind, field, format!("row {row} allows no action")));
        }
    }
    Ok(())
}

/// Checks an action tensor: `[lead.., ]` i64 for discrete spaces or
/// `[lead.., dim]` finite f32 for continuous ones.
pub(crate) fn check_actions(
    kind: &'static str,
    actions: &Tensor,
    lead: &[usize],
) -> Result<(), Rejection> {
    let lead: Vec<Option<usize>> = lead.iter().map(|&d| Some(d)).collect();
    match actions.dtype {
        DType::I64 => tensor_check(kind, "actions", actions.expect(DType::I64, &lead)),
        DType::F32 => {
            let mut shape = lead;
            shape.push(None);
            tensor_check(kind, "actions", actions.expect(DType::F32, &shape))?;
            finite_f32(kind, "actions", actions)
        }
        other => Err(invalid(
            kind,
            "actions",
            format!("dtype {other:?} is neither i64 (discrete) nor f32 (continuous)"),
        )),
    }
}

macro_rules! wire_message {
    ($ty:ty, $kind:literal) => {
        wire_message!($ty, $kind, |_m: &$ty| Ok(()));
    };
    ($ty:ty, $kind:literal, $validate:expr) => {
        impl WireMessage for $ty {
            const KIND: &'static str = $kind;
            fn schema(&self) -> u16 {
                self.schema
            }
            fn validate(&self) -> Result<(), Rejection> {
                #[allow(clippy::redundant_closure_call)]
                ($validate)(self)
            }
        }
    };
}

mod control;
mod eval;
mod metrics;
mod rollouts;
mod weights;

pub use control::*;
pub use eval::*;
pub use metrics::*;
pub use rollouts::*;
pub use weights::*;

#[cfg(test)]
mod tests;
