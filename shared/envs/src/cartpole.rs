//! `CartPole-v1`, ported from Gymnasium 1.4.0 `classic_control/cartpole.py`
//! (Euler integrator, default reward: +1 per step including the terminating
//! one, 0 for steps taken after termination).
//!
//! State layout: `[x, x_dot, theta, theta_dot]`. Observation: the state cast
//! to `f32`. Actions: `Discrete(2)` (0 pushes left, 1 pushes right).

use rand::{Rng, RngCore};

use crate::env::{check_obs_len, check_state_len, discrete_action, EpisodeClock};
use crate::{Action, ActionSpace, BoxSpace, Env, EnvError, EnvSpec, StepResult};

/// Gymnasium id.
pub const ID: &str = "CartPole-v1";

const GRAVITY: f64 = 9.8;
const MASSCART: f64 = 1.0;
const MASSPOLE: f64 = 0.1;
const TOTAL_MASS: f64 = MASSPOLE + MASSCART;
const LENGTH: f64 = 0.5;
const POLEMASS_LENGTH: f64 = MASSPOLE * LENGTH;
const FORCE_MAG: f64 = 10.0;
const TAU: f64 = 0.02;
const THETA_THRESHOLD_RADIANS: f64 = 12.0 * 2.0 * std::f64::consts::PI / 360.0;
const X_THRESHOLD: f64 = 2.4;

/// The spec Gymnasium registers for `CartPole-v1`.
pub fn spec() -> EnvSpec {
    let high = [
        (X_THRESHOLD * 2.0) as f32,
        f32::MAX,
        (THETA_THRESHOLD_RADIANS * 2.0) as f32,
        f32::MAX,
    ];
    EnvSpec {
        id: ID,
        observation_space: BoxSpace {
            low: high.iter().map(|h| -h).collect(),
            high: high.to_vec(),
        },
        action_space: ActionSpace::Discrete { n: 2 },
        max_episode_steps: 500,
        reward_threshold: Some(475.0),
        image: None,
        action_mask: false,
        agents: Vec::new(),
        team: Vec::new(),
    }
}

/// Cart-pole balancing (Barto, Sutton & Anderson 1983).
#[derive(Debug, Clone)]
pub struct CartPole {
    spec: EnvSpec,
    clock: EpisodeClock,
    state: [f64; 4],
    /// Gymnasium's `steps_beyond_terminated`.
    steps_beyond_terminated: Option<u32>,
}

impl Default for CartPole {
    fn default() -> Self {
        Self::new()
    }
}

impl CartPole {
    /// A new environment; call [`Env::reset`] (or [`Env::set_state`]) first.
    pub fn new() -> Self {
        let spec = spec();
        let clock = EpisodeClock::new(spec.max_episode_steps);
        Self {
            spec,
            clock,
            state: [0.0; 4],
            steps_beyond_terminated: None,
        }
    }

    fn write_obs(&self, obs: &mut [f32]) {
        for (o, s) in obs.iter_mut().zip(&self.state) {
            *o = *s as f32;
        }
    }
}

impl Env for CartPole {
    fn spec(&self) -> &EnvSpec {
        &self.spec
    }

    fn reset(&mut self, rng: &mut dyn RngCore, obs: &mut [f32]) -> Result<(), EnvError> {
        check_obs_len(obs, 4)?;
        for s in &mut self.state {
            *s = rng.random_range(-0.05..0.05);
        }
        self.steps_beyond_terminated = None;
        self.clock.restart();
        self.write_obs(obs);
        Ok(())
    }

    fn step(&mut self, action: Action<'_>, obs: &mut [f32]) -> Result<StepResult, EnvError> {
        self.clock.ensure_reset(ID)?;
        let action = discrete_action(&self.spec, action)?;
        check_obs_len(obs, 4)?;

        let [mut x, mut x_dot, mut theta, mut theta_dot] = self.state;
        let force = if action == 1 { FORCE_MAG } else { -FORCE_MAG };
        let costheta = theta.cos();
        let sintheta = theta.sin();

        // Gymnasium uses np.square here, which is `x * x` (not `pow`).
        let temp = (force + POLEMASS_LENGTH * (theta_dot * theta_dot) * sintheta) / TOTAL_MASS;
        let thetaacc = (GRAVITY * sintheta - costheta * temp)
            / (LENGTH * (4.0 / 3.0 - MASSPOLE * (costheta * costheta) / TOTAL_MASS));
        let xacc = temp - POLEMASS_LENGTH * thetaacc * costheta / TOTAL_MASS;

        x += TAU * x_dot;
        x_dot += TAU * xacc;
        theta += TAU * theta_dot;
        theta_dot += TAU * thetaacc;
        self.state = [x, x_dot, theta, theta_dot];

        // Literal comparisons as in Python (a NaN state does not terminate).
        #[allow(clippy::manual_range_contains)]
        let terminated = x < -X_THRESHOLD
            || x > X_THRESHOLD
            || theta < -THETA_THRESHOLD_RADIANS
            || theta > THETA_THRESHOLD_RADIANS;

        let reward = if !terminated {
            1.0
        } else if let Some(n) = self.steps_beyond_terminated.as_mut() {
            // Gymnasium warns here: stepping a terminated episode is undefined.
            *n = n.saturating_add(1);
            0.0
        } else {
            self.steps_beyond_terminated = Some(0);
            1.0
        };

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
        self.state.copy_from_slice(state);
        self.steps_beyond_terminated = None;
        self.clock.restart();
        Ok(())
    }

    fn observe(&self, obs: &mut [f32]) -> Result<(), EnvError> {
        self.clock.ensure_reset(ID)?;
        check_obs_len(obs, 4)?;
        self.write_obs(obs);
        Ok(())
    }

    fn elapsed_steps(&self) -> u32 {
        self.clock.elapsed()
    }
}
