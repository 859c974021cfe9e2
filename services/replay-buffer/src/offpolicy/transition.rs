//! What the table stores: an n-step [`Transition`], its byte encoding,
//! and the transitions a fragment becomes at insert (see the parent
//! module's "What a transition is").

use relay_proto::{DType, ObsField, RolloutFragment};

use super::{bad, TableError};

/// The two observations of a transition (`s_t` and `s_{t+k}`).
#[derive(Debug, Clone, PartialEq)]
pub enum Observations {
    /// f32 values.
    Values { obs: Vec<f32>, next_obs: Vec<f32> },
    /// As stored for image observations: the indices of their planes in
    /// the frames of the insert the transition came in, `offset` its
    /// position in that insert, `plane` the pixels of a plane.
    Planes {
        obs: Vec<u32>,
        next_obs: Vec<u32>,
        plane: u32,
        offset: u32,
    },
    /// As sampled for image observations: their pixels.
    Pixels { obs: Vec<u8>, next_obs: Vec<u8> },
}

/// One n-step transition (see the module docs).
#[derive(Debug, Clone, PartialEq)]
pub struct Transition {
    pub observations: Observations,
    /// Discrete action index, or the continuous action vector.
    pub action: Action,
    /// `R_t`, the discounted sum of the window's rewards.
    pub reward: f32,
    /// `γ^k`, 0 after a termination.
    pub discount: f32,
    pub terminated: bool,
    pub truncated: bool,
    /// Envs with action masks: the actions legal in the bootstrap
    /// observation (DQN's target maxes over those), 1 = legal.
    pub next_mask: Option<Vec<u8>>,
}

/// A stored action.
#[derive(Debug, Clone, PartialEq)]
pub enum Action {
    Discrete(i64),
    Continuous(Vec<f32>),
}

/// Stored with f32 observations.
const FORMAT_VALUES: u8 = 1;
/// Stored with plane indices (image observations stored once).
const FORMAT_PLANES: u8 = 2;

impl Transition {
    /// Little-endian bytes: format, then observation width `d` (values) or
    /// planes `C` (u16), action kind (u8: 0 discrete, 1 continuous, 2
    /// discrete with the bootstrap observation's action mask), action_dim
    /// (u16; kind 2: the mask's width), for planes the pixels of a plane
    /// and the offset in the insert (u32 each), the observations (`2d` f32
    /// or `2C` u32), action (kind 2: then the mask's bytes), reward,
    /// discount, terminated, truncated. Only stored forms (values, planes)
    /// encode.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(64);
        let (format, width) = match &self.observations {
            Observations::Values { obs, .. } => (FORMAT_VALUES, obs.len()),
            Observations::Planes { obs, .. } => (FORMAT_PLANES, obs.len()),
            Observations::Pixels { .. } => unreachable!("sampled rows are not stored"),
        };
        out.push(format);
        out.extend((width as u16).to_le_bytes());
        match (&self.action, &self.next_mask) {
            (Action::Discrete(_), Some(mask)) => {
                out.push(2);
                out.extend((mask.len() as u16).to_le_bytes());
            }
            (Action::Discrete(_), None) => {
                out.push(0);
                out.extend(1u16.to_le_bytes());
            }
            (Action::Continuous(a), _) => {
                out.push(1);
                out.extend((a.len() as u16).to_le_bytes());
            }
        }
        match &self.observations {
            Observations::Values { obs, next_obs } => {
                for x in obs.iter().chain(next_obs) {
                    out.extend(x.to_le_bytes());
                }
            }
            Observations::Planes {
                obs,
                next_obs,
                plane,
                offset,
            } => {
                out.extend(plane.to_le_bytes());
                out.extend(offset.to_le_bytes());
                for i in obs.iter().chain(next_obs) {
                    out.extend(i.to_le_bytes());
                }
            }
            Observations::Pixels { .. } => unreachable!(),
        }
        match &self.action {
            Action::Discrete(a) => out.extend(a.to_le_bytes()),
            Action::Continuous(a) => a.iter().for_each(|x| out.extend(x.to_le_bytes())),
        }
        if let (Action::Discrete(_), Some(mask)) = (&self.action, &self.next_mask) {
            out.extend_from_slice(mask);
        }
        out.extend(self.reward.to_le_bytes());
        out.extend(self.discount.to_le_bytes());
        out.push(self.terminated as u8);
        out.push(self.truncated as u8);
        out
    }

    /// The inverse of [`Transition::encode`]; a planes row followed by its
    /// planes' pixels (as the sample script returns it) decodes to
    /// [`Observations::Pixels`]. `None` on any mismatch.
    pub fn decode(bytes: &[u8]) -> Option<Self> {
        if bytes.len() < 6 {
            return None;
        }
        let format = bytes[0];
        let width = u16::from_le_bytes([bytes[1], bytes[2]]) as usize;
        let kind = bytes[3];
        let ad = u16::from_le_bytes([bytes[4], bytes[5]]) as usize;
        let action_bytes = match kind {
            0 => 8,
            1 => 4 * ad,
            2 => 8 + ad,
            _ => return None,
        };
        let u32_at = |o: usize| u32::from_le_bytes(bytes[o..o + 4].try_into().unwrap());
        let f32_at = |o: usize| f32::from_le_bytes(bytes[o..o + 4].try_into().unwrap());
        let tail = action_bytes + 10;
        let (observations, mut o) = match format {
            FORMAT_VALUES => {
                if bytes.len() != 6 + 8 * width + tail {
                    return None;
                }
                let obs = (0..width).map(|i| f32_at(6 + 4 * i)).collect();
                let next_obs = (0..width).map(|i| f32_at(6 + 4 * (width + i))).collect();
                (Observations::Values { obs, next_obs }, 6 + 8 * width)
            }
            FORMAT_PLANES => {
                if bytes.len() < 14 + 8 * width + tail {
                    return None;
                }
                let (plane, offset) = (u32_at(6), u32_at(10));
                let stored = 14 + 8 * width + tail;
                let observations = if bytes.len() == stored {
                    Observations::Planes {
                        obs: (0..width).map(|i| u32_at(14 + 4 * i)).collect(),
                        next_obs: (0..width).map(|i| u32_at(14 + 4 * (width + i))).collect(),
                        plane,
                        offset,
                    }
                } else {
                    let half = width * plane as usize;
                    if bytes.len() != stored + 2 * half {
                        return None;
                    }
                    Observations::Pixels {
                        obs: bytes[stored..stored + half].to_vec(),
                        next_obs: bytes[stored + half..].to_vec(),
                    }
                };
                (observations, 14 + 8 * width)
            }
            _ => return None,
        };
        let action = if kind == 1 {
            Action::Continuous((0..ad).map(|i| f32_at(o + 4 * i)).collect())
        } else {
            Action::Discrete(i64::from_le_bytes(bytes[o..o + 8].try_into().unwrap()))
        };
        let next_mask = (kind == 2).then(|| bytes[o + 8..o + 8 + ad].to_vec());
        o += action_bytes;
        Some(Self {
            observations,
            action,
            reward: f32_at(o),
            discount: f32_at(o + 4),
            terminated: bytes[o + 8] != 0,
            truncated: bytes[o + 9] != 0,
            next_mask,
        })
    }
}

/// A fragment's observations as the table stores them: f32 rows, or
/// plane-index rows when the fragment stores frames once.
enum Rows {
    Values {
        obs: Vec<f32>,
        next_obs: Vec<f32>,
        final_obs: Vec<f32>,
        width: usize,
    },
    Planes {
        obs: Vec<u32>,
        next_obs: Vec<u32>,
        final_obs: Vec<u32>,
        width: usize,
        plane: u32,
    },
}

/// One row of a [`Rows`]' field.
enum Row<'a> {
    Values(&'a [f32]),
    Planes(&'a [u32]),
}

impl Rows {
    fn of(f: &RolloutFragment) -> Result<Self, TableError> {
        let tensor = |field: &'static str, e: relay_proto::TensorError| bad(field, e.to_string());
        Ok(match &f.frames {
            None => Self::Values {
                obs: f
                    .observations(ObsField::Obs)
                    .map_err(|e| tensor("obs", e))?,
                next_obs: f
                    .observations(ObsField::Next)
                    .map_err(|e| tensor("next_obs", e))?,
                final_obs: f
                    .observations(ObsField::Final)
                    .map_err(|e| tensor("final_obs", e))?,
                width: f.obs_dim(),
            },
            Some(frames) => Self::Planes {
                obs: f.obs.to_u32().map_err(|e| tensor("obs", e))?,
                next_obs: f.next_obs.to_u32().map_err(|e| tensor("next_obs", e))?,
                final_obs: f.final_obs.to_u32().map_err(|e| tensor("final_obs", e))?,
                width: f.obs.shape[2] as usize,
                plane: frames.shape[1],
            },
        })
    }

    /// Row `i` of `field`.
    fn row(&self, field: ObsField, i: usize) -> Row<'_> {
        /// Row `i` of the array of `field`, whatever its element type.
        fn pick<T>(field: ObsField, [obs, next, last]: [&[T]; 3], i: usize, width: usize) -> &[T] {
            let all = match field {
                ObsField::Obs => obs,
                ObsField::Next => next,
                ObsField::Final => last,
            };
            &all[i * width..(i + 1) * width]
        }
        match self {
            Self::Values {
                obs,
                next_obs,
                final_obs,
                width,
            } => Row::Values(pick(field, [obs, next_obs, final_obs], i, *width)),
            Self::Planes {
                obs,
                next_obs,
                final_obs,
                width,
                ..
            } => Row::Planes(pick(field, [obs, next_obs, final_obs], i, *width)),
        }
    }

    /// The observations of a transition from `obs` to `next`; `offset`
    /// its position in the insert.
    fn observations(&self, obs: Row, next: Row, offset: usize) -> Observations {
        match (obs, next, self) {
            (Row::Values(o), Row::Values(n), _) => Observations::Values {
                obs: o.to_vec(),
                next_obs: n.to_vec(),
            },
            (Row::Planes(o), Row::Planes(n), Self::Planes { plane, .. }) => Observations::Planes {
                obs: o.to_vec(),
                next_obs: n.to_vec(),
                plane: *plane,
                offset: offset as u32,
            },
            _ => unreachable!("rows of one fragment are of one kind"),
        }
    }
}

/// The `T x N` n-step transitions of a validated fragment, in `(t, env)`
/// order (see the module docs).
pub fn fragment_transitions(
    f: &RolloutFragment,
    n_steps: usize,
    gamma: f64,
) -> Result<Vec<Transition>, TableError> {
    let (t_len, n) = (f.num_steps as usize, f.num_envs as usize);
    let tensor = |field: &'static str, e: relay_proto::TensorError| bad(field, e.to_string());
    let rows = Rows::of(f)?;
    let rewards = f.rewards.to_f32().map_err(|e| tensor("rewards", e))?;
    let terminated = f
        .terminated
        .to_bool()
        .map_err(|e| tensor("terminated", e))?;
    let truncated = f.truncated.to_bool().map_err(|e| tensor("truncated", e))?;
    let actions: Vec<Action> = match f.actions.dtype {
        DType::I64 => f
            .actions
            .to_i64()
            .map_err(|e| tensor("actions", e))?
            .into_iter()
            .map(Action::Discrete)
            .collect(),
        _ => {
            let a = f.actions.to_f32().map_err(|e| tensor("actions", e))?;
            let ad = a.len() / (t_len * n).max(1);
            a.chunks(ad.max(1))
                .map(|c| Action::Continuous(c.to_vec()))
                .collect()
        }
    };
    // Row (t, env) of the observation after step t: the next step's
    // observation, the final observation of a truncation (the vector env
    // resets in the same step), or the fragment's `next_obs` at its end.
    let mut final_rows = vec![None; t_len * n];
    let mut k = 0;
    for i in 0..t_len * n {
        if truncated[i] && !terminated[i] {
            final_rows[i] = Some(k);
            k += 1;
        }
    }
    // The masks of those observations, for envs with masks.
    let masks = f.masks.as_ref().map(|m| {
        let w = *m.obs.shape.last().expect("validated") as usize;
        (w, m)
    });
    let mask_after = |t: usize, e: usize| -> Option<Vec<u8>> {
        let (w, m) = masks?;
        let i = t * n + e;
        let (all, row) = if let Some(k) = final_rows[i] {
            (&m.final_obs.data, k)
        } else if t + 1 < t_len {
            (&m.obs.data, (t + 1) * n + e)
        } else {
            (&m.next_obs.data, e)
        };
        Some(all[row * w..(row + 1) * w].to_vec())
    };
    let after = |t: usize, e: usize| -> Row<'_> {
        let i = t * n + e;
        if let Some(k) = final_rows[i] {
            rows.row(ObsField::Final, k)
        } else if t + 1 < t_len {
            rows.row(ObsField::Obs, (t + 1) * n + e)
        } else {
            rows.row(ObsField::Next, e)
        }
    };
    let mut out = vec![None; t_len * n];
    for e in 0..n {
        let col = |v: &[bool]| (0..t_len).map(|t| v[t * n + e]).collect::<Vec<_>>();
        let r: Vec<f32> = (0..t_len).map(|t| rewards[t * n + e]).collect();
        let (term, trunc) = (col(&terminated), col(&truncated));
        let nstep = relay_nn::n_step_returns(&r, &term, &trunc, n_steps, gamma as f32)
            .map_err(|e| bad("n_steps", e.to_string()))?;
        for t in 0..t_len {
            let last = nstep.next_index[t];
            let at = t * n + e;
            out[at] = Some(Transition {
                observations: rows.observations(rows.row(ObsField::Obs, at), after(last, e), at),
                action: actions[at].clone(),
                reward: nstep.returns[t],
                discount: nstep.discounts[t],
                terminated: term[last],
                truncated: trunc[last],
                next_mask: mask_after(last, e),
            });
        }
    }
    Ok(out
        .into_iter()
        .map(|t| t.expect("every row filled"))
        .collect())
}
