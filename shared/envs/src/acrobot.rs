//! `Acrobot-v1`, ported from Gymnasium 1.4.0 `classic_control/acrobot.py`:
//! the book dynamics (`book_or_nips = "book"`), no torque noise, one
//! fourth-order Runge-Kutta step over `dt = 0.2`, then `wrap` of both angles
//! into `[-pi, pi]` and `bound` of the velocities to `±4pi` / `±9pi`.
//!
//! State layout: `[theta1, theta2, theta1_dot, theta2_dot]`. Observation:
//! `[cos theta1, sin theta1, cos theta2, sin theta2, theta1_dot, theta2_dot]`
//! as `f32`. Actions: `Discrete(3)`, torques `-1, 0, +1`. Reward `-1` per
//! step, `0` on the terminating step.
//!
//! As in Gymnasium, the reset state is drawn in `f64` and rounded to `f32`
//! (`.astype(np.float32)`); every later state is `f64`.

use std::f64::consts::PI;

use rand::{Rng, RngCore};

use crate::env::{check_obs_len, check_state_len, discrete_action, py_pow2, EpisodeClock};
use crate::{Action, ActionSpace, BoxSpace, Env, EnvError, EnvSpec, StepResult};

/// Gymnasium id.
pub const ID: &str = "Acrobot-v1";

const DT: f64 = 0.2;
const LINK_LENGTH_1: f64 = 1.0;
const LINK_MASS_1: f64 = 1.0;
const LINK_MASS_2: f64 = 1.0;
const LINK_COM_POS_1: f64 = 0.5;
const LINK_COM_POS_2: f64 = 0.5;
const LINK_MOI: f64 = 1.0;
const MAX_VEL_1: f64 = 4.0 * PI;
const MAX_VEL_2: f64 = 9.0 * PI;
const AVAIL_TORQUE: [f64; 3] = [-1.0, 0.0, 1.0];

/// The spec Gymnasium registers for `Acrobot-v1`.
pub fn spec() -> EnvSpec {
    let high = [1.0, 1.0, 1.0, 1.0, MAX_VEL_1 as f32, MAX_VEL_2 as f32];
    EnvSpec {
        id: ID,
        observation_space: BoxSpace {
            low: high.iter().map(|h| -h).collect(),
            high: high.to_vec(),
        },
        action_space: ActionSpace::Discrete { n: 3 },
        max_episode_steps: 500,
        reward_threshold: Some(-100.0),
        image: None,
        action_mask: false,
        agents: Vec::new(),
        team: Vec::new(),
    }
}

/// Two-link underactuated pendulum swing-up.
#[derive(Debug, Clone)]
pub struct Acrobot {
    spec: EnvSpec,
    clock: EpisodeClock,
    state: [f64; 4],
    /// `[cos theta1, sin theta1, cos theta2, sin theta2]` of `state`: the
    /// observation, the terminal test and the next step's first RK4 stage
    /// all need them, and the trigonometry is most of a step's time.
    trig: [f64; 4],
}

impl Default for Acrobot {
    fn default() -> Self {
        Self::new()
    }
}

/// `_dsdt` of the augmented state `[theta1, theta2, dtheta1, dtheta2, a]`,
/// the expression order kept as in Python so rounding is identical (`x**2`
/// is `pow(x, 2)` there, hence `py_pow2`; the constants' squares, 0.25 and
/// 1, are exact both ways, so they are plain products).
///
/// `(cos theta2, sin theta2)` come from the caller, which may know them.
fn dsdt(s: &[f64; 5], (cos_t2, sin_t2): (f64, f64)) -> [f64; 5] {
    let m1 = LINK_MASS_1;
    let m2 = LINK_MASS_2;
    let l1 = LINK_LENGTH_1;
    let lc1 = LINK_COM_POS_1;
    let lc2 = LINK_COM_POS_2;
    let i1 = LINK_MOI;
    let i2 = LINK_MOI;
    let g = 9.8;
    let a = s[4];
    let theta1 = s[0];
    let theta2 = s[1];
    let dtheta1 = s[2];
    let dtheta2 = s[3];
    let d1 = m1 * (lc1 * lc1) + m2 * ((l1 * l1) + (lc2 * lc2) + 2.0 * l1 * lc2 * cos_t2) + i1 + i2;
    let d2 = m2 * ((lc2 * lc2) + l1 * lc2 * cos_t2) + i2;
    let phi2 = m2 * lc2 * g * (theta1 + theta2 - PI / 2.0).cos();
    let phi1 = -m2 * l1 * lc2 * py_pow2(dtheta2) * sin_t2
        - 2.0 * m2 * l1 * lc2 * dtheta2 * dtheta1 * sin_t2
        + (m1 * lc1 + m2 * l1) * g * (theta1 - PI / 2.0).cos()
        + phi2;
    // book dynamics
    let ddtheta2 = (a + d2 / d1 * phi1 - m2 * l1 * lc2 * py_pow2(dtheta1) * sin_t2 - phi2)
        / (m2 * (lc2 * lc2) + i2 - py_pow2(d2) / d1);
    let ddtheta1 = -(d2 * ddtheta2 + phi1) / d1;
    [dtheta1, dtheta2, ddtheta1, ddtheta2, 0.0]
}

/// `y + h * k`, element-wise.
fn axpy(y: &[f64; 5], h: f64, k: &[f64; 5]) -> [f64; 5] {
    std::array::from_fn(|i| y[i] + h * k[i])
}

/// `dsdt` computing its own `cos theta2, sin theta2`.
fn dsdt_at(s: &[f64; 5]) -> [f64; 5] {
    dsdt(s, (s[1].cos(), s[1].sin()))
}

/// One step of Gymnasium's `rk4(derivs, y0, [0, dt])`; `trig_t2`:
/// `(cos, sin)` of `y0`'s `theta2`.
fn rk4(y0: &[f64; 5], trig_t2: (f64, f64)) -> [f64; 5] {
    let dt = DT - 0.0;
    let dt2 = dt / 2.0;
    let k1 = dsdt(y0, trig_t2);
    let k2 = dsdt_at(&axpy(y0, dt2, &k1));
    let k3 = dsdt_at(&axpy(y0, dt2, &k2));
    let k4 = dsdt_at(&axpy(y0, dt, &k3));
    let h = dt / 6.0;
    std::array::from_fn(|i| y0[i] + h * (k1[i] + 2.0 * k2[i] + 2.0 * k3[i] + k4[i]))
}

/// Gymnasium's `wrap(x, m, M)`.
fn wrap(mut x: f64, m: f64, big_m: f64) -> f64 {
    let diff = big_m - m;
    while x > big_m {
        x -= diff;
    }
    while x < m {
        x += diff;
    }
    x
}

/// Gymnasium's `bound(x, m, M)`: `min(max(x, m), M)` with Python semantics.
fn bound(x: f64, m: f64, big_m: f64) -> f64 {
    let lo = if m > x { m } else { x };
    if big_m < lo {
        big_m
    } else {
        lo
    }
}

impl Acrobot {
    /// A new environment; call [`Env::reset`] (or [`Env::set_state`]) first.
    pub fn new() -> Self {
        let spec = spec();
        let clock = EpisodeClock::new(spec.max_episode_steps);
        Self {
            spec,
            clock,
            state: [0.0; 4],
            trig: [1.0, 0.0, 1.0, 0.0],
        }
    }

    /// Sets the state and its [`Self::trig`].
    fn set(&mut self, state: [f64; 4]) {
        self.state = state;
        let (sin1, cos1) = state[0].sin_cos();
        let (sin2, cos2) = state[1].sin_cos();
        self.trig = [cos1, sin1, cos2, sin2];
    }

    fn write_obs(&self, obs: &mut [f32]) {
        let (s, t) = (&self.state, &self.trig);
        let o = [t[0], t[1], t[2], t[3], s[2], s[3]];
        for (dst, v) in obs.iter_mut().zip(o) {
            *dst = v as f32;
        }
    }

    fn terminal(&self) -> bool {
        let s = &self.state;
        -self.trig[0] - (s[1] + s[0]).cos() > 1.0
    }
}

impl Env for Acrobot {
    fn spec(&self) -> &EnvSpec {
        &self.spec
    }

    fn reset(&mut self, rng: &mut dyn RngCore, obs: &mut [f32]) -> Result<(), EnvError> {
        check_obs_len(obs, 6)?;
        let mut state = [0.0; 4];
        for s in &mut state {
            let v: f64 = rng.random_range(-0.1..0.1);
            *s = f64::from(v as f32);
        }
        self.set(state);
        self.clock.restart();
        self.write_obs(obs);
        Ok(())
    }

    fn step(&mut self, action: Action<'_>, obs: &mut [f32]) -> Result<StepResult, EnvError> {
        self.clock.ensure_reset(ID)?;
        let action = discrete_action(&self.spec, action)?;
        check_obs_len(obs, 6)?;

        let torque = AVAIL_TORQUE[action];
        let s = &self.state;
        let ns = rk4(
            &[s[0], s[1], s[2], s[3], torque],
            (self.trig[2], self.trig[3]),
        );
        self.set([
            wrap(ns[0], -PI, PI),
            wrap(ns[1], -PI, PI),
            bound(ns[2], -MAX_VEL_1, MAX_VEL_1),
            bound(ns[3], -MAX_VEL_2, MAX_VEL_2),
        ]);
        let terminated = self.terminal();
        let reward = if terminated { 0.0 } else { -1.0 };

        let truncated = self.clock.tick();
        self.write_obs(obs);
        Ok(StepResult {
            reward,
            terminated,
            truncated,
        })
    }

    fn state(&self) -> Vec<f64> {
        self.state.to_vec()
    }

    fn set_state(&mut self, state: &[f64]) -> Result<(), EnvError> {
        check_state_len(ID, state, 4)?;
        self.set([state[0], state[1], state[2], state[3]]);
        self.clock.restart();
        Ok(())
    }

    fn observe(&self, obs: &mut [f32]) -> Result<(), EnvError> {
        self.clock.ensure_reset(ID)?;
        check_obs_len(obs, 6)?;
        self.write_obs(obs);
        Ok(())
    }

    fn elapsed_steps(&self) -> u32 {
        self.clock.elapsed()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wrap_and_bound_match_gymnasium() {
        assert_eq!(wrap(3.0 * PI / 2.0, -PI, PI), 3.0 * PI / 2.0 - 2.0 * PI);
        assert_eq!(wrap(-7.0, -PI, PI), -7.0 + 2.0 * PI + 2.0 * PI - 2.0 * PI);
        assert_eq!(wrap(PI, -PI, PI), PI);
        assert_eq!(wrap(0.5, -PI, PI), 0.5);
        assert_eq!(bound(20.0, -MAX_VEL_1, MAX_VEL_1), MAX_VEL_1);
        assert_eq!(bound(-30.0, -MAX_VEL_2, MAX_VEL_2), -MAX_VEL_2);
        assert_eq!(bound(1.5, -MAX_VEL_1, MAX_VEL_1), 1.5);
    }

    #[test]
    fn rk4_keeps_the_torque_component() {
        let y = rk4(
            &[0.1, -0.2, 0.3, -0.4, 1.0],
            ((-0.2f64).cos(), (-0.2f64).sin()),
        );
        assert_eq!(y[4], 1.0);
        // At rest hanging down with no torque, nothing moves (up to the
        // rounding of cos(-pi/2)).
        assert!(rk4(&[0.0; 5], (1.0, 0.0)).iter().all(|v| v.abs() < 1e-14));
    }
}
