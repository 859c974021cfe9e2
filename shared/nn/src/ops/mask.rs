//! Invalid-action masking: [`mask_logits`] for the training graph,
//! [`check_masks`] for host masks, and the host acting path's masked
//! log-softmax and [`masked_argmax`] (greedy acting of the actor-critic
//! and the Q-network, DQN's bootstrap). Its own module because masking is
//! one rule that every consumer must apply alike, apart from the fused
//! ops it feeds ([`super`]), which re-exports it.
//!
//! # The rule
//!
//! A mask is `n` bytes per row, row-major `[B, n]`: 1 for a legal action, 0
//! for an illegal one (Huang & Ontañón, "A Closer Look at Invalid Action
//! Masking in Policy Gradient Algorithms", as CleanRL's masked PPO). The
//! illegal logits are *replaced* by [`MASKED_LOGIT`], a large finite
//! negative, and the categorical ops then run on the masked logits: `exp`
//! of an illegal logit minus the row's maximum underflows to exactly 0, so
//! the masked softmax puts no mass there and its log-softmax equals the
//! log-softmax over the legal actions alone, while `p log p = 0 * (-1e8)`
//! stays 0 in the entropy (with `-inf` it would be `0 * -inf = NaN`).
//! Replacing rather than adding keeps the value independent of the raw
//! logit and makes its gradient exactly 0.

use candle_core::{DType, Tensor};

use super::log_softmax_row;
use crate::error::{NnError, Result};

/// What an illegal action's logit is replaced by (see the module docs): a
/// large finite negative, so its probability underflows to exactly 0 while
/// `0 * log p` stays 0 (no NaN, unlike `-inf`).
pub const MASKED_LOGIT: f32 = -1e8;

/// Checks one mask row (`r` its index in the batch, for the error): values
/// 0 or 1, at least one legal action.
pub(crate) fn check_mask_row(row: &[u8], r: usize) -> Result<()> {
    if let Some(j) = row.iter().position(|&m| m > 1) {
        return Err(NnError::bad_input(
            "masks",
            "0 (illegal) or 1 (legal) per action",
            format!("{} at row {r}, action {j}", row[j]),
        ));
    }
    if !row.contains(&1) {
        return Err(NnError::bad_input(
            "masks",
            "at least one legal action (a 1) in every row",
            format!("row {r} with no legal action"),
        ));
    }
    Ok(())
}

/// Checks host action masks for `rows` rows of `n` actions: `rows * n`
/// bytes, each 0 (illegal) or 1 (legal), and at least one legal action per
/// row. The error names the first bad row.
pub fn check_masks(masks: &[u8], rows: usize, n: usize) -> Result<()> {
    if masks.len() != rows * n {
        return Err(NnError::bad_input(
            "masks",
            format!("{rows} x {n} = {} values", rows * n),
            format!("{} values", masks.len()),
        ));
    }
    if n == 0 {
        return match rows {
            0 => Ok(()),
            _ => check_mask_row(&[], 0),
        };
    }
    for (r, row) in masks.chunks_exact(n).enumerate() {
        check_mask_row(row, r)?;
    }
    Ok(())
}

/// The bytes of a `[rows, n]` u8 mask tensor (read back from a device),
/// after checking its shape and dtype against the logits'.
pub(crate) fn masks_host(masks: &Tensor, rows: usize, n: usize) -> Result<Vec<u8>> {
    if masks.dims() != [rows, n] || masks.dtype() != DType::U8 {
        return Err(NnError::bad_input(
            "masks",
            format!("u8 [{rows}, {n}] (as the logits)"),
            format!("{:?} [{:?}]", masks.dtype(), masks.dims()),
        ));
    }
    Ok(masks.flatten_all()?.to_vec1()?)
}

/// [`mask_logits`] without the checks: `masks` (u8, the shape of `logits`)
/// already validated.
pub(crate) fn apply_masks(logits: &Tensor, masks: &Tensor) -> Result<Tensor> {
    let masks = masks.to_device(logits.device())?;
    let fill =
        Tensor::full(MASKED_LOGIT, logits.shape(), logits.device())?.to_dtype(logits.dtype())?;
    Ok(masks.where_cond(logits, &fill)?)
}

/// Invalid-action masking of `logits: [B, n]` with `masks: [B, n]` u8 (1
/// legal, 0 illegal): the illegal logits are replaced (not shifted) by
/// [`MASKED_LOGIT`], so [`categorical_logprob`](super::categorical_logprob) /
/// [`categorical_entropy`](super::categorical_entropy)
/// of the result are those of the categorical over the legal actions.
/// Differentiable: the gradient reaching a replaced logit is exactly 0, a
/// legal one gets the masked distribution's. The masks are checked as
/// [`check_masks`] (read back to the host); a row with no legal action is
/// an error naming the row.
pub fn mask_logits(logits: &Tensor, masks: &Tensor) -> Result<Tensor> {
    let (rows, n) = logits
        .dims2()
        .map_err(|_| NnError::bad_input("logits", "[B, n]", format!("{:?}", logits.dims())))?;
    check_masks(&masks_host(masks, rows, n)?, rows, n)?;
    apply_masks(logits, masks)
}

/// The log-softmax of the categorical over the legal actions of one row
/// (`mask`: 1 legal, 0 illegal; `None`: all legal, [`log_softmax_row`])
/// into `out`, the illegal entries `-inf` (the host acting path only reads
/// the legal ones, so no `0 * -inf` arises). Wherever a legal logit is well
/// above [`MASKED_LOGIT`] this is bit for bit the log-softmax of the
/// [`mask_logits`] row that training scores (the replaced logits add
/// exactly 0 to the sum and do not change the maximum).
#[inline]
pub(crate) fn masked_log_softmax_row(logits: &[f32], mask: Option<&[u8]>, out: &mut [f32]) {
    let Some(mask) = mask else {
        return log_softmax_row(logits, out);
    };
    let legal = || {
        logits
            .iter()
            .zip(mask)
            .filter(|&(_, &ok)| ok != 0)
            .map(|(&l, _)| l)
    };
    let m = legal().fold(f32::NEG_INFINITY, f32::max);
    let s: f32 = legal().map(|l| (l - m).exp()).sum();
    let lse = m + s.ln();
    for ((o, &l), &ok) in out.iter_mut().zip(logits).zip(mask) {
        *o = if ok != 0 { l - lse } else { f32::NEG_INFINITY };
    }
}

/// Index of the largest value of `row` among the actions `mask` marks
/// legal (non-zero; `None`: all), the first on ties. Decided by the mask,
/// not by the values: an illegal action is never returned while the row
/// has a legal one, even where legal values tie with
/// [`MASKED_LOGIT`] or are NaN. A mask with no legal action (see
/// [`check_masks`]) gives 0.
pub fn masked_argmax(row: &[f32], mask: Option<&[u8]>) -> usize {
    let legal = |i: usize| mask.is_none_or(|m| m.get(i).is_some_and(|&ok| ok != 0));
    let mut best: Option<usize> = None;
    for (i, &x) in row.iter().enumerate() {
        if legal(i) && best.is_none_or(|b| x > row[b]) {
            best = Some(i);
        }
    }
    best.unwrap_or(0)
}
