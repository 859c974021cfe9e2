//! `Pendulum-v1`, ported from Gymnasium 1.4.0 `classic_control/pendulum.py`
//! (`g = 10.0`, `m = l = 1`, `dt = 0.05`, torque clipped to `[-2, 2]`,
//! angular velocity clipped to `[-8, 8]`).
//!
//! State layout: `[theta, theta_dot]`. Observation:
//! `[cos theta, sin theta, theta_dot]` as `f32`. Action: `Box([-2], [2])`;
//! values outside the bounds are clipped, as Gymnasium does. Reward:
//! `-(angle_normalize(theta)^2 + 0.1 theta_dot^2 + 0.001 u^2)`. The env never
//! terminates; it is truncated after 200 steps.
//!
//! Precision: the action is `float32` (the dtype of the action space), and
//! under NumPy 2 promotion rules (NEP 50: Python floats do not upcast
//! `float32`) Gymnasium computes `0.001 * u**2` and `3.0 * u` in `float32`;
//! they are computed in `f32` here too and everything else in `f64`. The
//! recorded Gymnasium rewards agree with this bit for bit (and not with an
//! all-`f64` computation). Python's `x**2` is `pow(x, 2)`, mirrored by
//! `py_pow2`.

use std::f64::consts::PI;

use rand::{Rng, RngCore};

use crate::env::{
    check_obs_len, check_state_len, continuous_action, py_mod, py_pow2, py_pow2_f32, EpisodeClock,
};
use crate::{Action, ActionSpace, BoxSpace, Env, EnvError, EnvSpec, StepResult};

/// Gymnasium id.
pub const ID: &str = "Pendulum-v1";

const MAX_SPEED: f64 = 8.0;
const MAX_TORQUE: f64 = 2.0;
const DT: f64 = 0.05;
const G: f64 = 10.0;
const M: f64 = 1.0;
const L: f64 = 1.0;

/// The spec Gymnasium registers for `Pendulum-v1`.
pub fn spec() -> EnvSpec {
    let high = [1.0f32, 1.0, MAX_SPEED as f32];
    EnvSpec {
        id: ID,
        observation_space: BoxSpace {
            low: high.iter().map(|h| -h).collect(),
            high: high.to_vec(),
        },
        action_space: ActionSpace::Box {
            low: vec![-MAX_TORQUE as f32],
            high: vec![MAX_TORQUE as f32],
        },
        max_episode_steps: 200,
        reward_threshold: None,
        image: None,
        action_mask: false,
        agents: Vec::new(),
        team: Vec::new(),
    }
}

/// Gymnasium's `angle_normalize`: `((x + pi) % (2 pi)) - pi`.
fn angle_normalize(x: f64) -> f64 {
    py_mod(x + PI, 2.0 * PI) - PI
}

/// Inverted pendulum swing-up.
#[derive(Debug, Clone)]
pub struct Pendulum {
    spec: EnvSpec,
    clock: EpisodeClock,
    state: [f64; 2],
}

impl Default for Pendulum {
    fn default() -> Self {
        Self::new()
    }
}

impl Pendulum {
    /// A new environment; call [`Env::reset`] (or [`Env::set_state`]) first.
    pub fn new() -> Self {
        let spec = spec();
        let clock = EpisodeClock::new(spec.max_episode_steps);
        Self {
            spec,
            clock,
            state: [0.0; 2],
        }
    }

    fn write_obs(&self, obs: &mut [f32]) {
        let [th, thdot] = self.state;
        let o = [th.cos(), th.sin(), thdot];
        for (dst, v) in obs.iter_mut().zip(o) {
            *dst = v as f32;
        }
    }
}

impl Env for Pendulum {
    fn spec(&self) -> &EnvSpec {
        &self.spec
    }

    fn reset(&mut self, rng: &mut dyn RngCore, obs: &mut [f32]) -> Result<(), EnvError> {
        check_obs_len(obs, 3)?;
        self.state = [rng.random_range(-PI..PI), rng.random_range(-1.0..1.0)];
        self.clock.restart();
        self.write_obs(obs);
        Ok(())
    }

    fn step(&mut self, action: Action<'_>, obs: &mut [f32]) -> Result<StepResult, EnvError> {
        self.clock.ensure_reset(ID)?;
        let action = continuous_action(&self.spec, action)?;
        check_obs_len(obs, 3)?;

        let [th, thdot] = self.state;
        // np.clip(u, -2.0, 2.0)[0] stays float32; so do `0.001 * u**2` and
        // `3.0 / (m * l**2) * u` (NEP 50), which are then added to float64s.
        let u = action[0].clamp(-MAX_TORQUE as f32, MAX_TORQUE as f32);
        let u_cost = f64::from(0.001f32 * py_pow2_f32(u));
        let u_accel = f64::from((3.0 / (M * py_pow2(L))) as f32 * u);
        let costs = py_pow2(angle_normalize(th)) + 0.1 * py_pow2(thdot) + u_cost;

        let newthdot = thdot + (3.0 * G / (2.0 * L) * th.sin() + u_accel) * DT;
        let newthdot = newthdot.clamp(-MAX_SPEED, MAX_SPEED);
        let newth = th + newthdot * DT;
        self.state = [newth, newthdot];

        let truncated = self.clock.tick();
        self.write_obs(obs);
        Ok(StepResult {
            reward: -costs,
            terminated: false,
            truncated,
        })
    }

    fn state(&self) -> Vec<f64> {
        self.state.to_vec()
    }

    fn set_state(&mut self, state: &[f64]) -> Result<(), EnvError> {
        check_state_len(ID, state, 2)?;
        self.state.copy_from_slice(state);
        self.clock.restart();
        Ok(())
    }

    fn observe(&self, obs: &mut [f32]) -> Result<(), EnvError> {
        self.clock.ensure_reset(ID)?;
        check_obs_len(obs, 3)?;
        self.write_obs(obs);
        Ok(())
    }

    fn elapsed_steps(&self) -> u32 {
        self.clock.elapsed()
    }
}
