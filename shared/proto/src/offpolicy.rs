//! Messages of the replay-buffer's off-policy table (DQN; generic enough
//! for SAC): sampling minibatches of n-step transitions and sending new
//! priorities back.

use serde::{Deserialize, Serialize};

use crate::codec::{Rejection, WireMessage};
use crate::messages::{check_actions, check_masks, invalid, observations_check, tensor_check};
use crate::tensor::{DType, Tensor};

/// Most transitions one [`TransitionSampleRequest`] may ask for.
pub const MAX_TRANSITION_SAMPLE: u32 = 4096;

/// learner -> replay-buffer (`relay.<run>.replay.transitions.sample`):
/// transitions from the off-policy table: one minibatch, or several drawn
/// at once ([`TransitionBatch::split_interleaved`] parts them).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TransitionSampleRequest {
    pub schema: u16,
    /// Transitions to draw (with replacement). 0 asks for the table's
    /// counters only (`size`, `inserted_steps`).
    pub batch_size: u32,
    /// Importance-sampling exponent β of prioritized replay, in `[0, 1]`
    /// (ignored by a uniform table).
    pub beta: f64,
}

impl WireMessage for TransitionSampleRequest {
    const KIND: &'static str = "TransitionSampleRequest";
    fn schema(&self) -> u16 {
        self.schema
    }
    fn validate(&self) -> Result<(), Rejection> {
        if !(self.beta.is_finite() && (0.0..=1.0).contains(&self.beta)) {
            return Err(invalid(
                Self::KIND,
                "beta",
                format!("must be in [0, 1], got {}", self.beta),
            ));
        }
        Ok(())
    }
}

/// replay-buffer -> learner: `B` n-step transitions (`B` may be 0 when the
/// table holds nothing yet or the rate limiter holds samples back).
///
/// Row `i` is `(s_t, a_t, R_t, s_{t+k}, γ^k)` where `R_t` is the
/// discounted sum of the `k <= n` rewards of the window and `discounts[i]`
/// is `γ^k`, or 0 when the window ended with a termination (a time-limit
/// truncation bootstraps from the final observation).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TransitionBatch {
    pub schema: u16,
    /// Insert sequence number of each row (what [`PriorityUpdate`] names).
    pub ids: Vec<u64>,
    /// `[B, obs_dim]` f32, or uint8 for image observations.
    pub obs: Tensor,
    /// `[B]` i64 (discrete) or `[B, action_dim]` f32.
    pub actions: Tensor,
    /// `[B]` f32: n-step discounted reward sums.
    pub rewards: Tensor,
    /// `[B, obs_dim]`, of `obs`'s dtype: the bootstrap observation `s_{t+k}`.
    pub next_obs: Tensor,
    /// `[B]` f32: `γ^k`, 0 after a termination.
    pub discounts: Tensor,
    /// `[B]` u8: the window's last step terminated.
    pub terminated: Tensor,
    /// `[B]` u8: the window's last step was cut by a time limit.
    pub truncated: Tensor,
    /// `[B]` f32: importance-sampling weights (all 1 for a uniform table),
    /// normalised by the batch's largest.
    pub weights: Tensor,
    /// Prioritized tables: the largest raw importance weight `(size ·
    /// P(i))^-β` of the batch, which `weights` were divided by: what puts
    /// the parts of a draw divided across messages back on one scale.
    /// Absent for a uniform table (and from older buffers).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weight_scale: Option<f64>,
    /// Transitions the table holds.
    pub size: u64,
    /// Env steps inserted into the table since the run began.
    pub inserted_steps: u64,
    /// Envs with action masks: `[B, n_actions]` u8, the actions legal in
    /// each `next_obs` (DQN's target maxes over those). Absent otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next_masks: Option<Tensor>,
}

impl TransitionBatch {
    /// Parts a draw of `k · B` rows into `k` minibatches of `B` rows:
    /// minibatch `s` takes rows `s, s + k, s + 2k, ...`, so a prioritized
    /// draw, stratified over all its rows, stays stratified in each part.
    /// Importance weights are renormalised by each part's largest, as a
    /// draw of `B` rows alone would be. `k` divides the row count.
    pub fn split_interleaved(&self, k: usize) -> Vec<TransitionBatch> {
        let n = self.ids.len();
        assert!(
            k > 0 && n.is_multiple_of(k),
            "{n} rows do not part into {k} minibatches"
        );
        let weights = self.weights.to_f32().unwrap_or_else(|_| vec![1.0; n]);
        (0..k)
            .map(|s| {
                let rows: Vec<usize> = (s..n).step_by(k).collect();
                let mut part: Vec<f32> = rows.iter().map(|&r| weights[r]).collect();
                let largest = part.iter().copied().fold(0.0f32, f32::max);
                if largest > 0.0 {
                    part.iter_mut().for_each(|w| *w /= largest);
                }
                let weight_scale = self.weight_scale.map(|s| s * f64::from(largest));
                TransitionBatch {
                    schema: self.schema,
                    ids: rows.iter().map(|&r| self.ids[r]).collect(),
                    obs: self.obs.select_rows(&rows),
                    actions: self.actions.select_rows(&rows),
                    rewards: self.rewards.select_rows(&rows),
                    next_obs: self.next_obs.select_rows(&rows),
                    discounts: self.discounts.select_rows(&rows),
                    terminated: self.terminated.select_rows(&rows),
                    truncated: self.truncated.select_rows(&rows),
                    weights: Tensor::from_f32(&[rows.len()], &part),
                    weight_scale,
                    size: self.size,
                    inserted_steps: self.inserted_steps,
                    next_masks: self.next_masks.as_ref().map(|m| m.select_rows(&rows)),
                }
            })
            .collect()
    }
}

impl WireMessage for TransitionBatch {
    const KIND: &'static str = "TransitionBatch";
    fn schema(&self) -> u16 {
        self.schema
    }
    fn validate(&self) -> Result<(), Rejection> {
        const K: &str = "TransitionBatch";
        let b = self.ids.len();
        observations_check(K, "obs", &self.obs, &[Some(b), None], None)?;
        let d = self.obs.shape[1] as usize;
        observations_check(
            K,
            "next_obs",
            &self.next_obs,
            &[Some(b), Some(d)],
            Some(&self.obs),
        )?;
        check_actions(K, &self.actions, &[b])?;
        for (field, t) in [
            ("rewards", &self.rewards),
            ("discounts", &self.discounts),
            ("weights", &self.weights),
        ] {
            tensor_check(K, field, t.expect(DType::F32, &[Some(b)]))?;
        }
        for (field, t) in [
            ("terminated", &self.terminated),
            ("truncated", &self.truncated),
        ] {
            tensor_check(K, field, t.expect(DType::U8, &[Some(b)]))?;
        }
        for (field, t) in [
            ("rewards", &self.rewards),
            ("discounts", &self.discounts),
            ("weights", &self.weights),
        ] {
            tensor_check(K, field, t.to_finite_f32().map(|_| ()))?;
        }
        if let Some(masks) = &self.next_masks {
            if self.actions.dtype != DType::I64 {
                return Err(invalid(
                    K,
                    "next_masks",
                    "action masks with continuous actions",
                ));
            }
            check_masks(K, "next_masks", masks, &[b], None)?;
        }
        Ok(())
    }
}

/// learner -> replay-buffer (`relay.<run>.replay.priorities`): new
/// priorities (`|td error| + ε`) of sampled transitions.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PriorityUpdate {
    pub schema: u16,
    /// Insert sequence numbers, as [`TransitionBatch::ids`].
    pub ids: Vec<u64>,
    /// `[len(ids)]` f32, each finite and > 0.
    pub priorities: Tensor,
}

impl WireMessage for PriorityUpdate {
    const KIND: &'static str = "PriorityUpdate";
    fn schema(&self) -> u16 {
        self.schema
    }
    fn validate(&self) -> Result<(), Rejection> {
        const K: &str = "PriorityUpdate";
        tensor_check(
            K,
            "priorities",
            self.priorities.expect(DType::F32, &[Some(self.ids.len())]),
        )?;
        let values = self
            .priorities
            .to_f32()
            .map_err(|source| Rejection::Tensor {
                kind: K,
                field: "priorities".into(),
                source,
            })?;
        if let Some((i, p)) = values
            .iter()
            .enumerate()
            .find(|(_, p)| !(p.is_finite() && **p > 0.0))
        {
            return Err(invalid(
                K,
                "priorities",
                format!("priority {i} is {p}; each must be finite and > 0"),
            ));
        }
        Ok(())
    }
}

/// replay-buffer -> learner: what a [`PriorityUpdate`] changed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PriorityAck {
    pub schema: u16,
    /// Transitions whose priority was set.
    pub updated: u32,
    /// Ids no longer in the table (evicted since they were sampled), skipped.
    pub evicted: u32,
}

impl WireMessage for PriorityAck {
    const KIND: &'static str = "PriorityAck";
    fn schema(&self) -> u16 {
        self.schema
    }
    fn validate(&self) -> Result<(), Rejection> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::SCHEMA_VERSION;

    #[test]
    fn a_draw_parts_into_interleaved_minibatches_with_their_own_weight_scale() {
        let n = 6;
        let obs: Vec<f32> = (0..n * 2).map(|v| v as f32).collect();
        let draw = TransitionBatch {
            schema: SCHEMA_VERSION,
            ids: (10..16).collect(),
            obs: Tensor::from_f32(&[n, 2], &obs),
            actions: Tensor::from_i64(&[n], &[0, 1, 2, 3, 4, 5]),
            rewards: Tensor::from_f32(&[n], &[0.0, 1.0, 2.0, 3.0, 4.0, 5.0]),
            next_obs: Tensor::from_f32(&[n, 2], &obs),
            discounts: Tensor::from_f32(&[n], &[0.9; 6]),
            terminated: Tensor::from_u8(&[n], &[0, 0, 0, 0, 0, 1]),
            truncated: Tensor::from_u8(&[n], &[0; 6]),
            weights: Tensor::from_f32(&[n], &[0.2, 1.0, 0.5, 0.25, 0.1, 0.5]),
            weight_scale: None,
            size: 100,
            inserted_steps: 120,
            next_masks: None,
        };
        let parts = draw.split_interleaved(2);
        assert_eq!(parts.len(), 2);
        assert_eq!(parts[0].ids, vec![10, 12, 14]);
        assert_eq!(parts[1].ids, vec![11, 13, 15]);
        assert_eq!(
            parts[1].obs.to_f32().unwrap(),
            vec![2.0, 3.0, 6.0, 7.0, 10.0, 11.0]
        );
        assert_eq!(parts[1].actions.to_i64().unwrap(), vec![1, 3, 5]);
        assert_eq!(
            parts[1].terminated.to_bool().unwrap(),
            vec![false, false, true]
        );
        // Each part's weights are scaled by its own largest.
        assert_eq!(parts[0].weights.to_f32().unwrap(), vec![0.4, 1.0, 0.2]);
        assert_eq!(parts[1].weights.to_f32().unwrap(), vec![1.0, 0.25, 0.5]);
        for p in &parts {
            p.validate().unwrap();
            assert_eq!((p.size, p.inserted_steps), (100, 120));
        }
    }

    #[test]
    fn rejects_bad_priorities_and_beta() {
        let ok = PriorityUpdate {
            schema: SCHEMA_VERSION,
            ids: vec![1, 2],
            priorities: Tensor::from_f32(&[2], &[0.5, 1.0]),
        };
        assert!(ok.validate().is_ok());
        for bad in [f32::NAN, 0.0, -1.0, f32::INFINITY] {
            let m = PriorityUpdate {
                priorities: Tensor::from_f32(&[2], &[0.5, bad]),
                ..ok.clone()
            };
            let e = m.validate().unwrap_err().to_string();
            assert!(e.contains("priorities"), "{e}");
        }
        let short = PriorityUpdate {
            ids: vec![1],
            ..ok.clone()
        };
        assert!(short.validate().is_err());
        let ask = TransitionSampleRequest {
            schema: SCHEMA_VERSION,
            batch_size: 4,
            beta: 1.5,
        };
        assert!(ask.validate().unwrap_err().to_string().contains("beta"));
    }
}
