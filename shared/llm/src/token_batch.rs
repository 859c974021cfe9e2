//! Token sequences (prompt, then completion) into right-padded training
//! blocks for [`crate::CausalLm::forward_train`], shared by the RL
//! ([`crate::rl`]) and SFT ([`crate::sft`]) losses.
//!
//! This module owns:
//! - [`BatchConfig`]: sequences per optimizer step, per backward pass, and
//!   the longest sequence trained on, with [`Truncation`];
//! - [`fit_to_length`]: where a too-long sequence is cut (or dropped);
//! - [`TokenBatch`]: one micro-batch as tensors, with its loss mask over
//!   the completion tokens only, and the same rows packed with their
//!   shared prefix once ([`PackedRows`]);
//! - [`Aggregation`] and [`BatchTotals`]: how per-token losses add up to
//!   the batch loss, with weights fixed by the whole optimizer batch so
//!   that micro-batch losses sum to it exactly.
//!
//! # Layout
//!
//! A sequence `s = prompt ++ completion` of length `L` is fed as its first
//! `L − 1` tokens; the logits at position `p` predict `s[p + 1]`. The
//! completion token `completion[j]` sits at `s[P + j]` (`P` = prompt
//! length) and is predicted at position `P + j − 1`, so the loss mask of a
//! row is 1 on positions `P − 1 .. P + C − 1` and 0 on the prompt's other
//! positions and on the right padding. A prompt must keep at least one
//! token. Padding uses token id 0 (any id works: under causal attention
//! real positions never see the padding after them, and the mask drops
//! the padded positions).
//!
//! [`PackedRows`] holds the same inputs without padding and with the
//! tokens every row opens with (a text game's system prompt, chat header
//! and rules: most of a move's prompt) once, so the CPU engine computes
//! them once per micro-batch ([`crate::CausalLm::forward_train_batch`]).
//! The prefix stops before every row's first predicting position, so each
//! row keeps at least one input token of its own and every target is
//! predicted from a row's own part.

use candle_core::{Device, Tensor};
use serde::{Deserialize, Serialize};

pub use relay_config::hyper::objective::{Aggregation, BatchConfig, BatchTotals, Truncation};

use crate::train_error::{TrainError, TrainResult};

/// Checks that a train step may take `n` sequences.
pub(crate) fn check_batch_len(config: &BatchConfig, n: usize) -> TrainResult<()> {
    if n == 0 || n > config.batch_size {
        return Err(TrainError::BadInput(format!(
            "a train step takes 1..={} sequences (batch_size), got {n}",
            config.batch_size
        )));
    }
    Ok(())
}

/// Where one sequence goes after [`fit_to_length`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fit {
    /// Train on `prompt[prompt_start..] ++ completion`.
    Keep {
        /// Prompt tokens cut from the start (0 when it fits).
        prompt_start: usize,
    },
    /// Too long: left out of the batch.
    Drop,
}

/// Fits a `prompt_len + completion_len` sequence into `max_seq_len`.
pub fn fit_to_length(
    prompt_len: usize,
    completion_len: usize,
    max_seq_len: usize,
    truncation: Truncation,
) -> Fit {
    let total = prompt_len + completion_len;
    if total <= max_seq_len {
        return Fit::Keep { prompt_start: 0 };
    }
    match truncation {
        Truncation::Drop => Fit::Drop,
        Truncation::CutPromptStart => {
            if completion_len + 1 > max_seq_len {
                Fit::Drop
            } else {
                Fit::Keep {
                    prompt_start: total - max_seq_len,
                }
            }
        }
    }
}

/// Counts of what truncation did to one batch.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TruncationStats {
    /// Sequences kept but cut.
    pub truncated: usize,
    /// Tokens removed from kept sequences (prompt tokens).
    pub tokens_cut: usize,
    /// Sequences dropped whole.
    pub dropped: usize,
}

impl TruncationStats {
    pub(crate) fn record(&mut self, fit: Fit) {
        match fit {
            Fit::Keep { prompt_start: 0 } => {}
            Fit::Keep { prompt_start } => {
                self.truncated += 1;
                self.tokens_cut += prompt_start;
            }
            Fit::Drop => self.dropped += 1,
        }
    }
}

/// One micro-batch of (prompt, completion) rows as tensors.
///
/// Per-token quantities (`targets`, and the losses' per-token inputs)
/// list the completion tokens row by row, in order: `num_tokens()` of
/// them. [`TokenBatch::completion_logits`] picks their logits out of the
/// `(rows, time, vocab)` block, so no prompt or padding position enters a
/// loss at all.
#[derive(Debug, Clone)]
pub struct TokenBatch {
    /// `(rows, time)` u32: each row's sequence without its last token,
    /// right-padded with id 0; `time` = longest row − 1.
    pub input_ids: Tensor,
    /// `(rows, time)` f32: 1 at positions whose next token is a
    /// completion token, 0 at prompt positions and padding.
    pub loss_mask: Tensor,
    /// `(tokens,)` u32: the completion tokens, row by row.
    pub targets: Tensor,
    /// `(tokens,)` u32: flat index `row · time + position` of the logits
    /// predicting each target.
    pub positions: Tensor,
    /// Row of each completion token.
    pub token_rows: Vec<u32>,
    /// Completion tokens per row.
    pub completion_lens: Vec<usize>,
    /// Prompt plus completion tokens per row.
    pub seq_lens: Vec<usize>,
    /// The same inputs with their shared prefix once and no padding.
    pub packed: PackedRows,
}

/// A [`TokenBatch`]'s inputs as one run of tokens: the prefix every row
/// shares, then each row's remaining input tokens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PackedRows {
    /// Leading input tokens all rows share (held once), at most the
    /// shortest prompt less one token.
    pub prefix_len: usize,
    /// Each row's input tokens after the prefix (at least one).
    pub suffix_lens: Vec<usize>,
    /// The prefix, then each row's suffix: `prefix_len + Σ suffix_lens`.
    pub input_ids: Vec<u32>,
    /// Index into `input_ids` of the token whose logits predict each
    /// target, in [`TokenBatch::targets`]' order.
    pub positions: Vec<u32>,
}

impl PackedRows {
    /// Packs `rows` (each `prompt ++ completion`, fed without its last
    /// token); prompts and completions non-empty.
    fn new(rows: &[(&[u32], &[u32])]) -> Self {
        let input = |(p, c): &(&[u32], &[u32])| -> Vec<u32> {
            let mut s = p.to_vec();
            s.extend_from_slice(&c[..c.len() - 1]);
            s
        };
        let inputs: Vec<Vec<u32>> = rows.iter().map(input).collect();
        let shortest_prompt = rows.iter().map(|(p, _)| p.len()).min().unwrap_or(1);
        let first = &inputs[0];
        let prefix_len = (0..shortest_prompt - 1)
            .take_while(|&i| inputs.iter().all(|s| s[i] == first[i]))
            .count();
        let mut input_ids = first[..prefix_len].to_vec();
        let mut positions = Vec::new();
        let mut suffix_lens = Vec::with_capacity(rows.len());
        for ((prompt, completion), seq) in rows.iter().zip(&inputs) {
            let start = input_ids.len() - prefix_len;
            for j in 0..completion.len() {
                positions.push((start + prompt.len() + j - 1) as u32);
            }
            input_ids.extend_from_slice(&seq[prefix_len..]);
            suffix_lens.push(seq.len() - prefix_len);
        }
        Self {
            prefix_len,
            suffix_lens,
            input_ids,
            positions,
        }
    }
}

impl TokenBatch {
    /// Builds the block from `(prompt, completion)` rows (already fitted
    /// to length). Every prompt and every completion must be non-empty.
    pub fn new(rows: &[(&[u32], &[u32])], device: &Device) -> TrainResult<Self> {
        if rows.is_empty() {
            return Err(TrainError::BadInput("empty micro-batch".into()));
        }
        for (i, (p, c)) in rows.iter().enumerate() {
            if p.is_empty() {
                return Err(TrainError::BadInput(format!(
                    "row {i}: empty prompt (the first completion token needs one token before it)"
                )));
            }
            if c.is_empty() {
                return Err(TrainError::BadInput(format!("row {i}: empty completion")));
            }
        }
        let seq_lens: Vec<usize> = rows.iter().map(|(p, c)| p.len() + c.len()).collect();
        let time = seq_lens.iter().max().copied().unwrap_or(0) - 1;
        let b = rows.len();
        let mut ids = vec![0u32; b * time];
        let mut mask = vec![0f32; b * time];
        let mut targets = Vec::new();
        let mut positions = Vec::new();
        let mut token_rows = Vec::new();
        for (row, (prompt, completion)) in rows.iter().enumerate() {
            let base = row * time;
            let seq = prompt.iter().chain(completion.iter());
            for (p, &id) in seq.take(prompt.len() + completion.len() - 1).enumerate() {
                ids[base + p] = id;
            }
            for (j, &target) in completion.iter().enumerate() {
                let p = prompt.len() + j - 1;
                mask[base + p] = 1.0;
                targets.push(target);
                positions.push((base + p) as u32);
                token_rows.push(row as u32);
            }
        }
        let n = targets.len();
        Ok(Self {
            input_ids: Tensor::from_vec(ids, (b, time), device)?,
            loss_mask: Tensor::from_vec(mask, (b, time), device)?,
            targets: Tensor::from_vec(targets, n, device)?,
            positions: Tensor::from_vec(positions, n, device)?,
            token_rows,
            completion_lens: rows.iter().map(|(_, c)| c.len()).collect(),
            seq_lens,
            packed: PackedRows::new(rows),
        })
    }

    /// Number of rows.
    pub fn rows(&self) -> usize {
        self.completion_lens.len()
    }

    /// Number of completion tokens (the per-token length).
    pub fn num_tokens(&self) -> usize {
        self.token_rows.len()
    }

    /// The logits predicting the completion tokens, `(tokens, vocab)`,
    /// out of `logits` `(rows, time, vocab)`; differentiable. Logits
    /// already at those positions, `(tokens, vocab)` (from
    /// [`crate::CausalLm::forward_train_at`] with
    /// [`TokenBatch::positions`]), are returned as they are.
    pub fn completion_logits(&self, logits: &Tensor) -> TrainResult<Tensor> {
        if let [n, _] = *logits.dims() {
            if n != self.num_tokens() {
                return Err(TrainError::BadInput(format!(
                    "{n} rows of completion logits for {} completion tokens",
                    self.num_tokens()
                )));
            }
            return Ok(logits.clone());
        }
        let (b, t, v) = logits.dims3()?;
        let (eb, et) = self.input_ids.dims2()?;
        if (b, t) != (eb, et) {
            return Err(TrainError::BadInput(format!(
                "logits are ({b}, {t}, {v}); the batch is ({eb}, {et})"
            )));
        }
        Ok(logits
            .reshape((b * t, v))?
            .index_select(&self.positions, 0)?)
    }

    /// `(tokens,)` f32 per-token weights from an [`Aggregation`].
    pub fn token_weights(
        &self,
        aggregation: &Aggregation,
        totals: BatchTotals,
    ) -> TrainResult<Tensor> {
        let w: Vec<f32> = self
            .token_rows
            .iter()
            .map(|&r| aggregation.token_weight(self.completion_lens[r as usize], totals) as f32)
            .collect();
        let n = w.len();
        Ok(Tensor::from_vec(w, n, self.targets.device())?)
    }
}

/// Log-probs `(tokens,)` of the targets under completion logits
/// `(tokens, vocab)`: log-softmax and gather in one op with its own
/// backward.
pub(crate) fn target_log_probs(
    completion_logits: &Tensor,
    targets: &Tensor,
) -> TrainResult<Tensor> {
    Ok(crate::train_ops::target_log_probs(
        completion_logits,
        targets,
    )?)
}

/// Sorts indices by sequence length (so micro-batches pad little) and
/// chunks them by `minibatch_size`.
pub(crate) fn micro_batches(lens: &[usize], minibatch_size: usize) -> Vec<Vec<usize>> {
    let mut order: Vec<usize> = (0..lens.len()).collect();
    order.sort_by_key(|&i| (lens[i], i));
    order.chunks(minibatch_size).map(|c| c.to_vec()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Packs `rows`, checking that each target's packed position holds the
    /// token just before it in its row.
    fn checked_packing(rows: &[(&[u32], &[u32])]) -> PackedRows {
        let batch = TokenBatch::new(rows, &Device::Cpu).unwrap();
        let packed = &batch.packed;
        let mut t = 0;
        for (prompt, completion) in rows {
            let seq: Vec<u32> = prompt.iter().chain(completion.iter()).copied().collect();
            for j in 0..completion.len() {
                let at = packed.positions[t] as usize;
                assert_eq!(packed.input_ids[at], seq[prompt.len() + j - 1]);
                t += 1;
            }
        }
        assert_eq!(t, batch.num_tokens());
        batch.packed
    }

    #[test]
    fn the_shared_prefix_stops_before_every_rows_first_prediction() {
        // Identical prompts: everything but each prompt's last token is
        // shared, so every row keeps the token that predicts its first
        // completion token.
        let rows: [(&[u32], &[u32]); 2] = [(&[1, 2, 3, 4], &[7, 8]), (&[1, 2, 3, 4], &[9])];
        let packed = checked_packing(&rows);
        assert_eq!(packed.prefix_len, 3);
        assert_eq!(packed.suffix_lens, [2, 1]);
        assert_eq!(packed.input_ids, [1, 2, 3, 4, 7, 4]);

        // A shorter prompt caps the prefix.
        let rows: [(&[u32], &[u32]); 2] = [(&[1, 2, 3, 4, 5], &[7]), (&[1, 2], &[3, 4])];
        assert_eq!(checked_packing(&rows).prefix_len, 1);

        // No common opening: the rows are packed without padding.
        let rows: [(&[u32], &[u32]); 3] = [(&[1, 2], &[3]), (&[2, 2, 2], &[3, 4]), (&[1], &[5])];
        let packed = checked_packing(&rows);
        assert_eq!(packed.prefix_len, 0);
        assert_eq!(packed.suffix_lens, [2, 4, 1]);

        // One row: its whole prompt but the last token is the prefix.
        let rows: [(&[u32], &[u32]); 1] = [(&[4, 5, 6], &[7, 8, 9])];
        assert_eq!(checked_packing(&rows).prefix_len, 2);
    }
}
