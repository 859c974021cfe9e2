//! Messages of the replay-buffer's off-policy table (DQN; generic enough
//! for SAC): sampling minibatches of n-step transitions and sending new
//! priorities back.

use serde::{Deserialize, Serialize};

use crate::codec::{Rejection, WireMessage};
use crate::messages::{check_actions, invalid, tensor_check};
use crate::tensor::{DType, Tensor};

/// learner -> replay-buffer (`relay.<run>.replay.transitions.sample`): one
/// minibatch of transitions from the off-policy table.
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
    /// `[B, obs_dim]` f32.
    pub obs: Tensor,
    /// `[B]` i64 (discrete) or `[B, action_dim]` f32.
    pub actions: Tensor,
    /// `[B]` f32: n-step discounted reward sums.
    pub rewards: Tensor,
    /// `[B, obs_dim]` f32: the bootstrap observation `s_{t+k}`.
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
    /// Transitions the table holds.
    pub size: u64,
    /// Env steps inserted into the table since the run began.
    pub inserted_steps: u64,
}

impl WireMessage for TransitionBatch {
    const KIND: &'static str = "TransitionBatch";
    fn schema(&self) -> u16 {
        self.schema
    }
    fn validate(&self) -> Result<(), Rejection> {
        const K: &str = "TransitionBatch";
        let b = self.ids.len();
        tensor_check(K, "obs", self.obs.expect(DType::F32, &[Some(b), None]))?;
        let d = self.obs.shape[1] as usize;
        tensor_check(
            K,
            "next_obs",
            self.next_obs.expect(DType::F32, &[Some(b), Some(d)]),
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
            ("obs", &self.obs),
            ("next_obs", &self.next_obs),
            ("rewards", &self.rewards),
            ("discounts", &self.discounts),
            ("weights", &self.weights),
        ] {
            tensor_check(K, field, t.to_finite_f32().map(|_| ()))?;
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
