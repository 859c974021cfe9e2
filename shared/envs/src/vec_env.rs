//! Vectorized environments with same-step auto-reset.
//!
//! This module owns [`VecEnv`]: `N` copies of one environment stepped in
//! lockstep, each with its own deterministic RNG, with Stable-Baselines3
//! `DummyVecEnv` semantics: when a sub-environment's episode ends
//! (terminated or truncated) it is reset inside the same `step`, the
//! returned observation is the first one of the new episode, and the last
//! observation of the finished episode is kept in the step's final-obs
//! buffer. Episode returns and lengths are accumulated here too.
//!
//! The step path does not allocate: all buffers, including the `finished`
//! list (at most one entry per sub-environment), are sized at construction.
//! Sub-environment RNGs are `StdRng` (ChaCha12, portable and reproducible).

use rand::rngs::StdRng;
use rand::SeedableRng;

use crate::env::{continuous_action, discrete_action};
use crate::{make, Action, Env, EnvError, EnvSpec};

/// Actions for every sub-environment of a [`VecEnv`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum VecActions<'a> {
    /// One action per sub-environment (`len == num_envs`).
    Discrete(&'a [i64]),
    /// Row-major `[num_envs * action_dim]` continuous actions.
    Continuous(&'a [f32]),
}

/// An episode that ended during a [`VecEnv::step`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FinishedEpisode {
    /// Which sub-environment it ran in.
    pub env_index: usize,
    /// Undiscounted sum of its rewards.
    pub episode_return: f64,
    /// Number of steps.
    pub length: u32,
    /// It ended in a terminal state.
    pub terminated: bool,
    /// It hit the time limit (may be set together with `terminated` when
    /// the last allowed step is also terminal, as in Gymnasium).
    pub truncated: bool,
}

/// The rows `rows` of `values`, rows of `width` values each, in that
/// order: the observations or masks of some of a vector's envs (those a
/// given policy or bot moves in), as one batch.
pub fn gather_rows<T: Copy>(values: &[T], width: usize, rows: &[usize]) -> Vec<T> {
    rows.iter()
        .flat_map(|&i| values[i * width..(i + 1) * width].iter().copied())
        .collect()
}

/// The outcome of one [`VecEnv::step`] (also holds the observations written
/// by [`VecEnv::reset`]).
#[derive(Debug, Clone)]
pub struct VecStep {
    /// `[num_envs * obs_dim]` observations; for a sub-environment whose
    /// episode just ended, the first observation of its next episode.
    pub obs: Vec<f32>,
    /// Reward per sub-environment.
    pub rewards: Vec<f64>,
    /// `terminated` per sub-environment.
    pub terminated: Vec<bool>,
    /// `truncated` per sub-environment.
    pub truncated: Vec<bool>,
    /// Episodes that ended in this step, in sub-environment order.
    pub finished: Vec<FinishedEpisode>,
    /// `[num_envs * obs_dim]`; row `i` is meaningful only when `done(i)`.
    final_obs: Vec<f32>,
    obs_dim: usize,
    /// Envs with [`EnvSpec::action_mask`]: `[num_envs * n_actions]`, 1 for
    /// each action legal in the row of `obs`; empty otherwise.
    masks: Vec<u8>,
    /// The masks of the final observations, as `final_obs`.
    final_masks: Vec<u8>,
    /// Actions per mask row (0: no masks).
    mask_width: usize,
    /// Multi-agent games: seats per env (0: a single-agent env).
    seats: usize,
    /// The seat of the agent whose observation is each row of `obs`: the
    /// one to move next.
    movers: Vec<u32>,
    /// `[num_envs * seats]`: each seat's rewards in this step (`rewards`
    /// and the finished episodes' returns are seat 0's).
    seat_rewards: Vec<f64>,
    /// `[num_envs * seats]`: each seat's return of the game that ended.
    seat_returns: Vec<f64>,
    /// `[num_envs * seats * obs_dim]`: each seat's last observation of the
    /// game that ended (what a truncated game bootstraps from).
    final_seat_obs: Vec<f32>,
}

impl VecStep {
    /// Zeroed buffers for `num_envs` sub-environments (for other vectorized
    /// backends that fill a `VecStep` themselves).
    pub fn new(num_envs: usize, obs_dim: usize) -> Self {
        Self {
            obs: vec![0.0; num_envs * obs_dim],
            rewards: vec![0.0; num_envs],
            terminated: vec![false; num_envs],
            truncated: vec![false; num_envs],
            finished: Vec::with_capacity(num_envs),
            final_obs: vec![0.0; num_envs * obs_dim],
            obs_dim,
            masks: Vec::new(),
            final_masks: Vec::new(),
            mask_width: 0,
            seats: 0,
            movers: Vec::new(),
            seat_rewards: Vec::new(),
            seat_returns: Vec::new(),
            final_seat_obs: Vec::new(),
        }
    }

    /// Buffers for a multi-agent game of `seats` agents taking turns.
    pub fn with_seats(mut self, seats: usize) -> Self {
        let n = self.num_envs();
        self.seats = seats;
        self.movers = vec![0; n];
        self.seat_rewards = vec![0.0; n * seats];
        self.seat_returns = vec![0.0; n * seats];
        self.final_seat_obs = vec![0.0; n * seats * self.obs_dim];
        self
    }

    /// Multi-agent games: the seat to move in each env (whose observation
    /// and mask are that env's rows); `None` for a single-agent env.
    pub fn movers(&self) -> Option<&[u32]> {
        (self.seats > 0).then_some(&self.movers[..])
    }

    /// Writable movers, seat rewards, returns and final observations of
    /// a multi-agent game (for backends that fill them).
    pub fn seats_mut(&mut self) -> (&mut [u32], &mut [f64], &mut [f64], &mut [f32]) {
        (
            &mut self.movers,
            &mut self.seat_rewards,
            &mut self.seat_returns,
            &mut self.final_seat_obs,
        )
    }

    /// Each seat's rewards in env `i` in this step (multi-agent games).
    pub fn seat_rewards(&self, i: usize) -> &[f64] {
        &self.seat_rewards[i * self.seats..(i + 1) * self.seats]
    }

    /// Each seat's return of the game env `i` just finished, `None` when
    /// it goes on (or for a single-agent env).
    pub fn seat_returns(&self, i: usize) -> Option<&[f64]> {
        (self.seats > 0 && self.done(i))
            .then(|| &self.seat_returns[i * self.seats..(i + 1) * self.seats])
    }

    /// The last observation `seat` had of the game env `i` just finished.
    pub fn final_seat_obs(&self, i: usize, seat: usize) -> Option<&[f32]> {
        let d = self.obs_dim;
        let row = i * self.seats + seat;
        (self.seats > 0 && seat < self.seats && self.done(i))
            .then(|| &self.final_seat_obs[row * d..(row + 1) * d])
    }

    /// Buffers for action masks of `n_actions` actions, every action legal
    /// until a backend writes the env's masks.
    pub fn with_masks(mut self, n_actions: usize) -> Self {
        let n = self.num_envs();
        self.masks = vec![1; n * n_actions];
        self.final_masks = vec![1; n * n_actions];
        self.mask_width = n_actions;
        self
    }

    /// The action masks of every row of `obs` (`[num_envs * n_actions]`, 1
    /// = legal), or `None` for an env without masks.
    pub fn masks(&self) -> Option<&[u8]> {
        (self.mask_width > 0).then_some(&self.masks[..])
    }

    /// Writable masks of sub-environments `range` (empty without masks).
    pub fn masks_mut(&mut self, range: std::ops::Range<usize>) -> &mut [u8] {
        let w = self.mask_width;
        &mut self.masks[range.start * w..range.end * w]
    }

    /// Records the mask of sub-environment `i`'s final observation.
    pub fn set_final_mask(&mut self, i: usize, mask: &[u8]) {
        let w = self.mask_width;
        self.final_masks[i * w..(i + 1) * w].copy_from_slice(mask);
    }

    /// The mask of the final observation of sub-environment `i`'s episode
    /// that just ended, as [`Self::final_obs`]; `None` without masks (and
    /// in multi-agent games, whose last states nobody acts in).
    pub fn final_mask(&self, i: usize) -> Option<&[u8]> {
        let w = self.mask_width;
        (w > 0 && self.seats == 0 && self.done(i)).then(|| &self.final_masks[i * w..(i + 1) * w])
    }

    /// Number of sub-environments.
    pub fn num_envs(&self) -> usize {
        self.rewards.len()
    }

    /// Whether sub-environment `i`'s episode ended in this step.
    pub fn done(&self, i: usize) -> bool {
        self.terminated.get(i).copied().unwrap_or(false)
            || self.truncated.get(i).copied().unwrap_or(false)
    }

    /// Observation of sub-environment `i` (after auto-reset).
    pub fn obs(&self, i: usize) -> &[f32] {
        &self.obs[i * self.obs_dim..(i + 1) * self.obs_dim]
    }

    /// Forgets the last step's rewards, flags and finished episodes (after a
    /// reset of every sub-environment).
    pub fn clear_outcomes(&mut self) {
        self.rewards.fill(0.0);
        self.terminated.fill(false);
        self.truncated.fill(false);
        self.finished.clear();
    }

    /// Records the last observation of the episode sub-environment `i` just
    /// finished (meaningful once `terminated[i]` or `truncated[i]` is set).
    pub fn set_final_obs(&mut self, i: usize, obs: &[f32]) {
        self.final_obs[i * self.obs_dim..(i + 1) * self.obs_dim].copy_from_slice(obs);
    }

    /// The last observation of the episode sub-environment `i` just
    /// finished (the one to bootstrap from on truncation), or `None` when
    /// its episode goes on.
    pub fn final_obs(&self, i: usize) -> Option<&[f32]> {
        self.done(i)
            .then(|| &self.final_obs[i * self.obs_dim..(i + 1) * self.obs_dim])
    }
}

/// Derives the seed of sub-environment `index` from the `VecEnv` seed
/// (SplitMix64 finalizer over a Weyl step, so nearby seeds/indices give
/// unrelated streams).
pub fn sub_seed(seed: u64, index: usize) -> u64 {
    let mut z = seed ^ (index as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// `num_envs` copies of one environment with auto-reset.
pub struct VecEnv {
    envs: Vec<Box<dyn Env>>,
    rngs: Vec<StdRng>,
    spec: EnvSpec,
    obs_dim: usize,
    act_dim: usize,
    returns: Vec<f64>,
    lengths: Vec<u32>,
    buf: VecStep,
    has_reset: bool,
}

impl std::fmt::Debug for VecEnv {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VecEnv")
            .field("id", &self.spec.id)
            .field("num_envs", &self.envs.len())
            .finish_non_exhaustive()
    }
}

impl VecEnv {
    /// `num_envs` instances of `id`; sub-environment `i` draws its resets
    /// from a `StdRng` seeded deterministically from `(seed, i)`, so the
    /// same seed reproduces the same episodes for the same actions.
    pub fn new(id: &str, num_envs: usize, seed: u64) -> Result<VecEnv, EnvError> {
        if num_envs == 0 {
            return Err(EnvError::NoEnvs);
        }
        let envs = (0..num_envs)
            .map(|_| make(id))
            .collect::<Result<Vec<_>, _>>()?;
        let spec = envs[0].spec().clone();
        let obs_dim = spec.obs_dim();
        let act_dim = spec.action_space.dim();
        Ok(VecEnv {
            envs,
            rngs: (0..num_envs)
                .map(|i| StdRng::seed_from_u64(sub_seed(seed, i)))
                .collect(),
            spec,
            obs_dim,
            act_dim,
            returns: vec![0.0; num_envs],
            lengths: vec![0; num_envs],
            buf: VecStep::new(num_envs, obs_dim),
            has_reset: false,
        })
    }

    /// Spec of the (identical) sub-environments.
    pub fn spec(&self) -> &EnvSpec {
        &self.spec
    }

    /// Number of sub-environments.
    pub fn num_envs(&self) -> usize {
        self.envs.len()
    }

    /// Observation dimension of one sub-environment.
    pub fn obs_dim(&self) -> usize {
        self.obs_dim
    }

    /// Action values per sub-environment (1 for discrete spaces).
    pub fn action_dim(&self) -> usize {
        self.act_dim
    }

    /// Current observations, `[num_envs * obs_dim]`.
    pub fn obs(&self) -> &[f32] {
        &self.buf.obs
    }

    /// Sub-environment `i` (e.g. to read its state).
    pub fn env(&self, i: usize) -> Option<&dyn Env> {
        self.envs.get(i).map(|e| e.as_ref())
    }

    /// Resets every sub-environment (continuing its RNG stream), clears the
    /// episode statistics and returns the `[num_envs * obs_dim]` first
    /// observations.
    pub fn reset(&mut self) -> Result<&[f32], EnvError> {
        let d = self.obs_dim;
        for (i, (env, rng)) in self.envs.iter_mut().zip(&mut self.rngs).enumerate() {
            env.reset(rng, &mut self.buf.obs[i * d..(i + 1) * d])
                .map_err(|e| sub_env(i, e))?;
        }
        self.returns.fill(0.0);
        self.lengths.fill(0);
        self.buf.clear_outcomes();
        self.has_reset = true;
        Ok(&self.buf.obs)
    }

    /// Steps every sub-environment, auto-resetting the ones whose episode
    /// ends. All actions are validated first: on error nothing is stepped.
    pub fn step(&mut self, actions: VecActions<'_>) -> Result<&VecStep, EnvError> {
        if !self.has_reset {
            return Err(EnvError::NotReset {
                env_id: self.spec.id,
            });
        }
        check_actions(&self.spec, self.envs.len(), actions)?;

        let d = self.obs_dim;
        let k = self.act_dim;
        let buf = &mut self.buf;
        buf.finished.clear();
        for (i, (env, rng)) in self.envs.iter_mut().zip(&mut self.rngs).enumerate() {
            let action = match actions {
                VecActions::Discrete(a) => Action::Discrete(a[i]),
                VecActions::Continuous(a) => Action::Continuous(&a[i * k..(i + 1) * k]),
            };
            let obs = &mut buf.obs[i * d..(i + 1) * d];
            let r = env.step(action, obs).map_err(|e| sub_env(i, e))?;
            buf.rewards[i] = r.reward;
            buf.terminated[i] = r.terminated;
            buf.truncated[i] = r.truncated;
            self.returns[i] += r.reward;
            self.lengths[i] = self.lengths[i].saturating_add(1);
            if r.done() {
                buf.final_obs[i * d..(i + 1) * d].copy_from_slice(obs);
                buf.finished.push(FinishedEpisode {
                    env_index: i,
                    episode_return: self.returns[i],
                    length: self.lengths[i],
                    terminated: r.terminated,
                    truncated: r.truncated,
                });
                self.returns[i] = 0.0;
                self.lengths[i] = 0;
                env.reset(rng, obs).map_err(|e| sub_env(i, e))?;
            }
        }
        Ok(&self.buf)
    }
}

/// Checks actions for `num_envs` sub-environments of `spec` (count, kind,
/// range, finiteness) before anything is stepped.
pub fn check_actions(
    spec: &EnvSpec,
    num_envs: usize,
    actions: VecActions<'_>,
) -> Result<(), EnvError> {
    let n = num_envs;
    let discrete = spec.action_space.is_discrete();
    match actions {
        VecActions::Discrete(a) if discrete => {
            if a.len() != n {
                return Err(EnvError::ActionCount {
                    expected: n,
                    got: a.len(),
                });
            }
            for (i, &ai) in a.iter().enumerate() {
                discrete_action(spec, Action::Discrete(ai)).map_err(|e| sub_env(i, e))?;
            }
        }
        VecActions::Continuous(a) if !discrete => {
            let k = spec.action_space.dim();
            if a.len() != n * k {
                return Err(EnvError::ActionCount {
                    expected: n * k,
                    got: a.len(),
                });
            }
            for (i, chunk) in a.chunks_exact(k.max(1)).enumerate() {
                continuous_action(spec, Action::Continuous(chunk)).map_err(|e| sub_env(i, e))?;
            }
        }
        VecActions::Discrete(_) | VecActions::Continuous(_) => {
            let kind = |d: bool| if d { "discrete" } else { "continuous" };
            return Err(EnvError::WrongActionKind {
                env_id: spec.id,
                expected: kind(discrete),
                got: kind(!discrete),
            });
        }
    }
    Ok(())
}

fn sub_env(index: usize, source: EnvError) -> EnvError {
    EnvError::SubEnv {
        index,
        source: Box::new(source),
    }
}
