//! Rollout fragments as an env-runner collects them: the columns of each
//! vector step, and image observations stored once ([`FrameTable`]). A
//! fragment holds `env_runner.fragment_steps` steps of all the runner's
//! envs; one too large for a NATS message is divided when it is sent
//! (`relay_proto::fit`: by envs, then by steps), measured rather than
//! planned from the config.
//!
//! # Frames stored once
//! An image observation is `C` planes of `height x width` pixels; with
//! frame stacking each plane is a frame, and an observation shares `C - 1`
//! of them with the one before. Every plane is interned in the fragment's
//! table the first time it is seen: a plane equal to the plane one place
//! later of the env's previous observation (the stack shifted by a frame),
//! to the same plane of it (a still plane), or to the plane before it in
//! the same observation (a fresh stack padded with its first frame) takes
//! that plane's index; any other is stored. Equality is checked byte for
//! byte, so nothing is assumed of the env: MinAtar's channels, which are
//! not frames, are simply all stored. A fragment of `T` steps of Atari's 4
//! stacked frames holds about `T + 3` frames per env instead of `4 T`, on
//! the wire and in Redis.
//!
use relay_proto::{FragmentMasks, RolloutFragment, Tensor, SCHEMA_VERSION};

/// Each distinct plane of a fragment's image observations, once (see the
/// module docs).
#[derive(Debug)]
pub struct FrameTable {
    /// Pixels of one plane (`height x width`).
    plane: usize,
    /// Planes of one observation (`C`).
    planes: usize,
    /// Every interned plane, one after another.
    pixels: Vec<u8>,
    /// The plane indices of each env's last interned observation.
    last: Vec<Option<Vec<u32>>>,
    /// One observation's planes as bytes, reused.
    scratch: Vec<u8>,
}

impl FrameTable {
    /// A table for `envs` envs of `[channels, height, width]` images.
    pub fn new(image: [usize; 3], envs: usize) -> Self {
        let [channels, height, width] = image;
        Self {
            plane: height * width,
            planes: channels,
            pixels: Vec::new(),
            last: vec![None; envs],
            scratch: Vec::with_capacity(channels * height * width),
        }
    }

    fn count(&self) -> usize {
        self.pixels.len() / self.plane.max(1)
    }

    fn stored(&self, index: u32) -> &[u8] {
        let at = index as usize * self.plane;
        &self.pixels[at..at + self.plane]
    }

    /// Interns observation `obs` (pixel values as f32) of env `env`
    /// (the table's own numbering) and appends its plane indices to `out`.
    pub fn intern(&mut self, env: usize, obs: &[f32], out: &mut Vec<u32>) {
        debug_assert_eq!(obs.len(), self.plane * self.planes);
        self.scratch.clear();
        self.scratch.extend(obs.iter().map(|&v| v as u8));
        let previous = self.last[env].take();
        let mut indices = Vec::with_capacity(self.planes);
        for c in 0..self.planes {
            let span = c * self.plane..(c + 1) * self.plane;
            let shifted = previous.as_ref().and_then(|p| p.get(c + 1)).copied();
            let still = previous.as_ref().map(|p| p[c]);
            let padded = c.checked_sub(1).map(|before| indices[before]);
            let found = [shifted, still, padded]
                .into_iter()
                .flatten()
                .find(|&i| self.stored(i) == &self.scratch[span.clone()]);
            let index = match found {
                Some(index) => index,
                None => {
                    let index = self.count() as u32;
                    self.pixels.extend_from_slice(&self.scratch[span]);
                    index
                }
            };
            indices.push(index);
        }
        out.extend_from_slice(&indices);
        self.last[env] = Some(indices);
    }

    /// The table as a fragment's `frames`: `[F, plane]` uint8.
    fn tensor(&self) -> Tensor {
        Tensor::from_u8(&[self.count(), self.plane], &self.pixels)
    }
}

/// How a fragment being collected keeps its observations.
#[derive(Debug)]
enum Observations {
    /// As they travel: f32, or uint8 pixels (`pixels`) converted at the end.
    Whole {
        obs: Vec<f32>,
        final_obs: Vec<f32>,
        pixels: bool,
    },
    /// Image observations as plane indices into a table.
    Frames {
        table: FrameTable,
        obs: Vec<u32>,
        final_obs: Vec<u32>,
    },
}

/// The columns of one fragment being collected, of every env of the runner.
#[derive(Debug)]
pub struct FragmentBuilder {
    num_envs: usize,
    obs_dim: usize,
    /// `Some` for image observations stored once.
    image: Option<[usize; 3]>,
    pixels: bool,
    observations: Observations,
    pub actions_i64: Vec<i64>,
    pub actions_f32: Vec<f32>,
    pub logprobs: Vec<f32>,
    pub values: Vec<f32>,
    pub rewards: Vec<f32>,
    /// Scaled rewards (`normalize.reward` runs only).
    pub norm_rewards: Vec<f32>,
    pub terminated: Vec<bool>,
    pub truncated: Vec<bool>,
    /// Envs with action masks: actions per mask row, and the masks of the
    /// observations and of the final observations.
    mask_width: Option<usize>,
    masks: Vec<u8>,
    final_masks: Vec<u8>,
    /// The oldest policy version that acted in it.
    pub min_version: u64,
    /// Vector steps recorded.
    pub steps: usize,
    /// Recurrent policies: each env's state before the first step (empty
    /// otherwise).
    initial_state: Vec<f32>,
}

impl FragmentBuilder {
    /// An empty fragment of `num_envs` envs with observations of `obs_dim`
    /// values: uint8 pixels when `pixels`, stored once as frames when
    /// `image` is given too; with action masks of `mask_width` actions.
    pub fn new(
        num_envs: usize,
        obs_dim: usize,
        pixels: bool,
        image: Option<[usize; 3]>,
        mask_width: Option<usize>,
    ) -> Self {
        let image = image.filter(|_| pixels);
        let observations = match image {
            Some(image) => Observations::Frames {
                table: FrameTable::new(image, num_envs),
                obs: Vec::new(),
                final_obs: Vec::new(),
            },
            None => Observations::Whole {
                obs: Vec::new(),
                final_obs: Vec::new(),
                pixels,
            },
        };
        Self {
            num_envs,
            obs_dim,
            image,
            pixels,
            observations,
            actions_i64: Vec::new(),
            actions_f32: Vec::new(),
            logprobs: Vec::new(),
            values: Vec::new(),
            rewards: Vec::new(),
            norm_rewards: Vec::new(),
            terminated: Vec::new(),
            truncated: Vec::new(),
            mask_width,
            masks: Vec::new(),
            final_masks: Vec::new(),
            min_version: u64::MAX,
            steps: 0,
            initial_state: Vec::new(),
        }
    }

    /// A fresh fragment of the same envs (the previous one sent or dropped).
    pub fn reset(&mut self) {
        *self = Self::new(
            self.num_envs,
            self.obs_dim,
            self.pixels,
            self.image,
            self.mask_width,
        );
    }

    /// Records the observations the step's actions are taken in: the
    /// runner's `rows` (and their masks, and for a recurrent policy the
    /// envs' states, kept from the first step).
    pub fn push_obs(&mut self, rows: &[f32], masks: Option<&[u8]>, state: &[f32]) {
        if self.steps == 0 {
            self.initial_state = state.to_vec();
        }
        if let (Some(_), Some(masks)) = (self.mask_width, masks) {
            self.masks.extend_from_slice(masks);
        }
        let d = self.obs_dim;
        match &mut self.observations {
            Observations::Whole { obs, .. } => obs.extend_from_slice(rows),
            Observations::Frames { table, obs, .. } => {
                for (i, row) in rows.chunks_exact(d).enumerate() {
                    table.intern(i, row, obs);
                }
            }
        }
    }

    /// Records the last observation of a truncated episode of env `env`,
    /// and its mask.
    pub fn push_final_obs(&mut self, env: usize, row: &[f32], mask: Option<&[u8]>) {
        if let (Some(_), Some(mask)) = (self.mask_width, mask) {
            // A last state that allows no action (a game over) is sent as
            // allowing all: nothing acts in it, and a max over it stays defined.
            if mask.contains(&1) {
                self.final_masks.extend_from_slice(mask);
            } else {
                self.final_masks.extend(std::iter::repeat_n(1, mask.len()));
            }
        }
        match &mut self.observations {
            Observations::Whole { final_obs, .. } => final_obs.extend_from_slice(row),
            Observations::Frames {
                table, final_obs, ..
            } => table.intern(env, row, final_obs),
        }
    }

    /// The fragment, its tail bootstrapped from the runner's `next_obs`
    /// (with their masks `next_masks`); `norm_rewards` when the
    /// run scales rewards, `norm_delta` the statistics to ship with it.
    #[allow(clippy::too_many_arguments)]
    pub fn finish(
        &mut self,
        runner_id: &str,
        env_id: &str,
        action_dim: Option<usize>,
        next_obs: &[f32],
        next_masks: Option<&[u8]>,
        norm_rewards: bool,
        norm_delta: Option<relay_proto::NormStats>,
    ) -> RolloutFragment {
        let (t, n, d) = (self.steps, self.num_envs, self.obs_dim);
        let next_rows = next_obs;
        let (obs, next_obs, final_obs, frames) = match &mut self.observations {
            Observations::Whole {
                obs,
                final_obs,
                pixels,
            } => (
                Tensor::observations(&[t, n, d], obs, *pixels),
                Tensor::observations(&[n, d], next_rows, *pixels),
                Tensor::observations(&[final_obs.len() / d, d], final_obs, *pixels),
                None,
            ),
            Observations::Frames {
                table,
                obs,
                final_obs,
            } => {
                let mut next = Vec::with_capacity(n * table.planes);
                for (i, row) in next_rows.chunks_exact(d).enumerate() {
                    table.intern(i, row, &mut next);
                }
                let planes = table.planes;
                (
                    Tensor::from_u32(&[t, n, planes], obs),
                    Tensor::from_u32(&[n, planes], &next),
                    Tensor::from_u32(&[final_obs.len() / planes, planes], final_obs),
                    Some(table.tensor()),
                )
            }
        };
        let actions = match action_dim {
            None => Tensor::from_i64(&[t, n], &self.actions_i64),
            Some(a) => Tensor::from_f32(&[t, n, a], &self.actions_f32),
        };
        let masks = match (self.mask_width, next_masks) {
            (Some(w), Some(next)) => Some(FragmentMasks {
                obs: Tensor::from_u8(&[t, n, w], &self.masks),
                next_obs: Tensor::from_u8(&[n, w], next),
                final_obs: Tensor::from_u8(&[self.final_masks.len() / w, w], &self.final_masks),
            }),
            _ => None,
        };
        let fragment = RolloutFragment {
            schema: SCHEMA_VERSION,
            runner_id: runner_id.to_string(),
            env_id: env_id.to_string(),
            policy_version: self.min_version,
            num_steps: t as u32,
            num_envs: n as u32,
            obs,
            actions,
            logprobs: Tensor::from_f32(&[t, n], &self.logprobs),
            values: Tensor::from_f32(&[t, n], &self.values),
            rewards: Tensor::from_f32(&[t, n], &self.rewards),
            terminated: Tensor::from_bool(&[t, n], &self.terminated),
            truncated: Tensor::from_bool(&[t, n], &self.truncated),
            next_obs,
            final_obs,
            norm_rewards: norm_rewards.then(|| Tensor::from_f32(&[t, n], &self.norm_rewards)),
            norm_delta,
            frames,
            masks,
            initial_state: (!self.initial_state.is_empty())
                .then(|| Tensor::from_f32(&[n, self.initial_state.len() / n], &self.initial_state)),
        };
        self.reset();
        fragment
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use relay_proto::ObsField;

    /// A frame-stacked observation of 4 planes of 2x2 pixels from frames
    /// `frames` (oldest first).
    fn stacked(frames: [u8; 4]) -> Vec<f32> {
        frames
            .iter()
            .flat_map(|&f| std::iter::repeat_n(f as f32, 4))
            .collect()
    }

    #[test]
    fn stacked_frames_are_stored_once_and_observations_come_back_whole() {
        // 2 envs, 3 steps: env 0 shifts a new frame in each step; env 1
        // starts a fresh stack (padded with its first frame) at step 2.
        let mut builder = FragmentBuilder::new(2, 16, true, Some([4, 2, 2]), None);
        let steps = [
            [stacked([1, 2, 3, 4]), stacked([9, 9, 9, 10])],
            [stacked([2, 3, 4, 5]), stacked([9, 9, 10, 11])],
            [stacked([3, 4, 5, 6]), stacked([20, 20, 20, 20])],
        ];
        let mut all_rows = Vec::new();
        for step in &steps {
            let all: Vec<f32> = step.concat();
            builder.push_obs(&all, None, &[]);
            all_rows.extend(all);
            builder.actions_i64.extend([0, 1]);
            builder.logprobs.extend([0.0; 2]);
            builder.values.extend([0.0; 2]);
            builder.rewards.extend([1.0; 2]);
            builder.terminated.extend([false; 2]);
            builder.truncated.extend([false; 2]);
            builder.min_version = 3;
            builder.steps += 1;
        }
        // Env 0's episode was truncated at the last step (its final
        // observation shifts once more); env 1 goes on.
        builder.truncated[2 * 2] = true;
        builder.push_final_obs(0, &stacked([4, 5, 6, 7]), None);
        let next: Vec<f32> = [stacked([30, 30, 30, 30]), stacked([20, 20, 20, 21])].concat();
        let fragment = builder.finish("r", "ALE/Breakout-v5", None, &next, None, false, None);
        let fragment: RolloutFragment =
            relay_proto::decode(&relay_proto::encode(&fragment)).unwrap();

        // Distinct frames: env 0: 1-7 and 30; env 1: 9, 10, 11, 20, 21.
        let frames = fragment.frames.as_ref().unwrap();
        assert_eq!(frames.shape, vec![13, 4]);
        assert_eq!(fragment.obs_dim(), 16);
        assert_eq!(fragment.observations(ObsField::Obs).unwrap(), all_rows);
        assert_eq!(fragment.observations(ObsField::Next).unwrap(), next);
        assert_eq!(
            fragment.observations(ObsField::Final).unwrap(),
            stacked([4, 5, 6, 7])
        );
    }

    /// The masks go with their observations; a final state that allows
    /// nothing is sent as allowing all.
    #[test]
    fn masks_follow_their_observations_and_an_empty_final_mask_allows_all() {
        // 2 envs, 2 actions, 2 steps.
        let mut builder = FragmentBuilder::new(2, 1, false, None, Some(2));
        let all_masks: [[u8; 4]; 2] = [[1, 0, 1, 1], [1, 0, 0, 1]];
        for (t, masks) in all_masks.iter().enumerate() {
            builder.push_obs(&[t as f32; 2], Some(masks), &[]);
            // Legal: env 0 takes action 0 twice, env 1 action 1 then 1.
            builder.actions_i64.extend([0, 1]);
            builder.logprobs.extend([0.0; 2]);
            builder.values.extend([0.0; 2]);
            builder.rewards.extend([1.0; 2]);
            builder.terminated.extend([false; 2]);
            builder.truncated.extend([t == 1, false]);
            builder.min_version = 0;
            builder.steps += 1;
        }
        builder.push_final_obs(0, &[5.0], Some(&[0, 0]));
        let next_masks = [0, 1, 1, 0];
        let f = builder.finish(
            "r",
            "Taxi-v4",
            None,
            &[9.0; 2],
            Some(&next_masks),
            false,
            None,
        );
        let f: RolloutFragment = relay_proto::decode(&relay_proto::encode(&f)).unwrap();
        let masks = f.masks.unwrap();
        assert_eq!(masks.obs.data, [1, 0, 1, 1, 1, 0, 0, 1]);
        assert_eq!(masks.next_obs.data, [0, 1, 1, 0]);
        assert_eq!(masks.final_obs.data, [1, 1]);
    }
}
