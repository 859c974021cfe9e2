//! How each message that may outgrow a NATS message divides into smaller
//! ones of its kind, and how the replies to divided requests join
//! ([`crate::fit`] owns the rule that uses them).
//!
//! - [`RolloutFragment`]: by envs (each env's columns stay whole, so the
//!   learner's advantages and a recurrent policy's sequences are those of
//!   the undivided fragment), then, for one env, by steps (not for a
//!   recurrent policy's fragment: it carries only its first step's state).
//! - [`ActRequest`] by rows, its [`ActReply`]s joined in order.
//! - [`TransitionSampleRequest`] by transitions, its [`TransitionBatch`]es
//!   joined on one importance-weight scale.
//! - [`EpisodeReport`] by episodes.
//! - [`GameRecord`] and [`EvalGame`]: a game is one unit.

use std::collections::HashMap;
use std::ops::Range;

use crate::fit::{shares, Divisible, Joinable};
use crate::llm::{EvalGame, GameRecord};
use crate::messages::{ActReply, ActRequest, EpisodeReport, FragmentMasks, RolloutFragment};
use crate::offpolicy::{TransitionBatch, TransitionSampleRequest};
use crate::tensor::Tensor;

impl Divisible for RolloutFragment {
    const UNIT: &'static str = "env step";

    fn divide(self, parts: usize) -> Result<Vec<Self>, Self> {
        let (t, n) = (self.num_steps as usize, self.num_envs as usize);
        let blocks: Vec<(Range<usize>, Range<usize>)> = if n >= 2 {
            shares(n, parts)
                .into_iter()
                .map(|envs| (0..t, envs))
                .collect()
        } else if t >= 2 && self.initial_state.is_none() {
            shares(t, parts)
                .into_iter()
                .map(|steps| (steps, 0..n))
                .collect()
        } else {
            return Err(self);
        };
        let mut pieces: Vec<Self> = blocks
            .into_iter()
            .map(|(steps, envs)| self.block(steps, envs))
            .collect();
        // The statistics gathered with the fragment are merged once.
        pieces[0].norm_delta = self.norm_delta;
        Ok(pieces)
    }
}

impl RolloutFragment {
    /// Steps `steps` of envs `envs` as a fragment of their own (a valid
    /// fragment: its tail bootstraps from the observation after its last
    /// step, its frame table holds only the planes it uses); without the
    /// normalisation statistics, which go with one piece only.
    fn block(&self, steps: Range<usize>, envs: Range<usize>) -> RolloutFragment {
        let (t, n) = (self.num_steps as usize, self.num_envs as usize);
        let grid = |tensor: &Tensor| tensor.block(steps.clone(), envs.clone());
        // What follows the last step: the fragment's own next observation
        // at its end, else the observation of the step after.
        let after = |obs: &Tensor, next: &Tensor| {
            if steps.end == t {
                next.row_range(envs.clone())
            } else {
                let mut row = obs.block(steps.end..steps.end + 1, envs.clone());
                row.shape.remove(0);
                row
            }
        };
        // final_obs rows are the truncated (not terminated) steps, in
        // (step, env) order; keep the block's.
        let bootstraps: Vec<usize> = {
            let ends = self.terminated.data.iter().zip(&self.truncated.data);
            let mut k = 0;
            let mut kept = Vec::new();
            for (i, (&term, &trunc)) in ends.enumerate() {
                if trunc != 0 && term == 0 {
                    let (step, env) = (i / n, i % n);
                    if steps.contains(&step) && envs.contains(&env) {
                        kept.push(k);
                    }
                    k += 1;
                }
            }
            kept
        };
        let mut obs = grid(&self.obs);
        let mut next_obs = after(&self.obs, &self.next_obs);
        let mut final_obs = self.final_obs.select_rows(&bootstraps);
        let frames = self
            .frames
            .as_ref()
            .map(|frames| compact_frames(frames, [&mut obs, &mut next_obs, &mut final_obs]));
        RolloutFragment {
            schema: self.schema,
            runner_id: self.runner_id.clone(),
            env_id: self.env_id.clone(),
            policy_version: self.policy_version,
            num_steps: steps.len() as u32,
            num_envs: envs.len() as u32,
            obs,
            actions: grid(&self.actions),
            logprobs: grid(&self.logprobs),
            values: grid(&self.values),
            rewards: grid(&self.rewards),
            terminated: grid(&self.terminated),
            truncated: grid(&self.truncated),
            next_obs,
            final_obs,
            frames,
            norm_rewards: self.norm_rewards.as_ref().map(grid),
            norm_delta: None,
            masks: self.masks.as_ref().map(|m| FragmentMasks {
                obs: grid(&m.obs),
                next_obs: after(&m.obs, &m.next_obs),
                final_obs: m.final_obs.select_rows(&bootstraps),
            }),
            // Only whole env columns are cut when there is a state.
            initial_state: self
                .initial_state
                .as_ref()
                .map(|s| s.row_range(envs.clone())),
        }
    }
}

/// The planes of `frames` that `indices` use, in first-use order, with the
/// indices renumbered into that table.
fn compact_frames(frames: &Tensor, indices: [&mut Tensor; 3]) -> Tensor {
    let mut renumbered: HashMap<u32, u32> = HashMap::new();
    let mut kept: Vec<usize> = Vec::new();
    for tensor in indices {
        let old = tensor.to_u32().expect("frame indices are u32");
        let new: Vec<u32> = old
            .iter()
            .map(|&i| {
                *renumbered.entry(i).or_insert_with(|| {
                    kept.push(i as usize);
                    kept.len() as u32 - 1
                })
            })
            .collect();
        let shape = tensor.shape_usize();
        *tensor = Tensor::from_u32(&shape, &new);
    }
    frames.select_rows(&kept)
}

impl Divisible for ActRequest {
    const UNIT: &'static str = "row";

    fn divide(self, parts: usize) -> Result<Vec<Self>, Self> {
        let n = self.obs.shape[0] as usize;
        if n < 2 {
            return Err(self);
        }
        Ok(shares(n, parts)
            .into_iter()
            .map(|rows| ActRequest {
                schema: self.schema,
                obs: self.obs.row_range(rows.clone()),
                deterministic: self.deterministic,
                masks: self.masks.as_ref().map(|m| m.row_range(rows.clone())),
                policy_version: self.policy_version,
                state: self.state.as_ref().map(|s| s.row_range(rows.clone())),
                noise_seeds: self.noise_seeds.as_ref().map(|s| s[rows.clone()].to_vec()),
            })
            .collect())
    }
}

impl Joinable for ActReply {
    /// Acted by the oldest version among the parts.
    fn join(parts: Vec<Self>) -> Self {
        ActReply {
            schema: parts[0].schema,
            policy_version: parts.iter().map(|r| r.policy_version).min().unwrap_or(0),
            actions: Tensor::concat_rows(parts.iter().map(|r| &r.actions)),
            logprobs: Tensor::concat_rows(parts.iter().map(|r| &r.logprobs)),
            values: Tensor::concat_rows(parts.iter().map(|r| &r.values)),
            state: parts
                .iter()
                .map(|r| r.state.as_ref())
                .collect::<Option<Vec<_>>>()
                .map(Tensor::concat_rows),
        }
    }
}

impl Divisible for TransitionSampleRequest {
    const UNIT: &'static str = "transition";

    fn divide(self, parts: usize) -> Result<Vec<Self>, Self> {
        if self.batch_size < 2 {
            return Err(self);
        }
        Ok(shares(self.batch_size as usize, parts)
            .into_iter()
            .map(|rows| TransitionSampleRequest {
                batch_size: rows.len() as u32,
                ..self.clone()
            })
            .collect())
    }
}

impl Joinable for TransitionBatch {
    /// The rows of every part; importance weights put back on one scale
    /// (each part's are divided by its own largest raw weight) and divided
    /// by the largest of all, as one draw's would be.
    fn join(parts: Vec<Self>) -> Self {
        let scale = parts
            .iter()
            .filter_map(|p| p.weight_scale)
            .fold(None, |max: Option<f64>, s| {
                Some(max.map_or(s, |m| m.max(s)))
            });
        let weights: Vec<f32> = parts
            .iter()
            .flat_map(|p| {
                let ratio = match (p.weight_scale, scale) {
                    (Some(own), Some(all)) if all > 0.0 => own / all,
                    _ => 1.0,
                };
                let w = p.weights.to_f32().unwrap_or_default();
                w.into_iter().map(move |w| (f64::from(w) * ratio) as f32)
            })
            .collect();
        let last = parts.last().expect("at least one part");
        TransitionBatch {
            schema: last.schema,
            ids: parts.iter().flat_map(|p| p.ids.iter().copied()).collect(),
            obs: Tensor::concat_rows(parts.iter().map(|p| &p.obs)),
            actions: Tensor::concat_rows(parts.iter().map(|p| &p.actions)),
            rewards: Tensor::concat_rows(parts.iter().map(|p| &p.rewards)),
            next_obs: Tensor::concat_rows(parts.iter().map(|p| &p.next_obs)),
            discounts: Tensor::concat_rows(parts.iter().map(|p| &p.discounts)),
            terminated: Tensor::concat_rows(parts.iter().map(|p| &p.terminated)),
            truncated: Tensor::concat_rows(parts.iter().map(|p| &p.truncated)),
            weights: Tensor::from_f32(&[weights.len()], &weights),
            weight_scale: scale,
            size: last.size,
            inserted_steps: last.inserted_steps,
            next_masks: parts
                .iter()
                .map(|p| p.next_masks.as_ref())
                .collect::<Option<Vec<_>>>()
                .map(Tensor::concat_rows),
        }
    }
}

impl Divisible for EpisodeReport {
    const UNIT: &'static str = "episode";

    fn divide(mut self, parts: usize) -> Result<Vec<Self>, Self> {
        if self.episodes.len() < 2 {
            return Err(self);
        }
        let episodes = std::mem::take(&mut self.episodes);
        Ok(shares(episodes.len(), parts)
            .into_iter()
            .map(|range| EpisodeReport {
                episodes: episodes[range].to_vec(),
                ..self.clone()
            })
            .collect())
    }
}

impl Divisible for GameRecord {
    /// A game trains whole: its turns share its rewards and its group's
    /// baseline.
    const UNIT: &'static str = "game";

    fn divide(self, _parts: usize) -> Result<Vec<Self>, Self> {
        Err(self)
    }
}

impl Divisible for EvalGame {
    const UNIT: &'static str = "game";

    fn divide(self, _parts: usize) -> Result<Vec<Self>, Self> {
        Err(self)
    }
}
