//! `MountainCar-v0`, ported from Gymnasium 1.4.0
//! `classic_control/mountain_car.py` (`goal_velocity = 0`).
//!
//! State layout: `[position, velocity]`. Observation: the state cast to
//! `f32`. Actions: `Discrete(3)` (accelerate left, don't, right). Reward `-1`
//! every step; terminated when `position >= 0.5` (and `velocity >= 0`).

use rand::{Rng, RngCore};

use crate::env::{check_obs_len, check_state_len, discrete_action, EpisodeClock};
use crate::{Action, ActionSpace, BoxSpace, Env, EnvError, EnvSpec, StepResult};

/// Gymnasium id.
pub const ID: &str = "MountainCar-v0";

const MIN_POSITION: f64 = -1.2;
const MAX_POSITION: f64 = 0.6;
const MAX_SPEED: f64 = 0.07;
const GOAL_POSITION: f64 = 0.5;
const GOAL_VELOCITY: f64 = 0.0;
const FORCE: f64 = 0.001;
const GRAVITY: f64 = 0.0025;

/// The spec Gymnasium registers for `MountainCar-v0`.
pub fn spec() -> EnvSpec {
    EnvSpec {
        id: ID,
        observation_space: BoxSpace {
            low: vec![MIN_POSITION as f32, -MAX_SPEED as f32],
            high: vec![MAX_POSITION as f32, MAX_SPEED as f32],
        },
        action_space: ActionSpace::Discrete { n: 3 },
        max_episode_steps: 200,
        reward_threshold: Some(-110.0),
        image: None,
        action_mask: false,
        agents: Vec::new(),
        team: Vec::new(),
    }
}

/// An under-powered car in a valley that must rock back and forth.
#[derive(Debug, Clone)]
pub struct MountainCar {
    spec: EnvSpec,
    clock: EpisodeClock,
    state: [f64; 2],
}

impl Default for MountainCar {
    fn default() -> Self {
        Self::new()
    }
}

impl MountainCar {
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
        for (o, s) in obs.iter_mut().zip(&self.state) {
            *o = *s as f32;
        }
    }
}

impl Env for MountainCar {
    fn spec(&self) -> &EnvSpec {
        &self.spec
    }

    fn reset(&mut self, rng: &mut dyn RngCore, obs: &mut [f32]) -> Result<(), EnvError> {
        check_obs_len(obs, 2)?;
        self.state = [rng.random_range(-0.6..-0.4), 0.0];
        self.clock.restart();
        self.write_obs(obs);
        Ok(())
    }

    fn step(&mut self, action: Action<'_>, obs: &mut [f32]) -> Result<StepResult, EnvError> {
        self.clock.ensure_reset(ID)?;
        let action = discrete_action(&self.spec, action)?;
        check_obs_len(obs, 2)?;

        let [mut position, mut velocity] = self.state;
        // (action - 1) is an exact small integer in Python, so this product
        // is exactly -0.001, 0.0 or 0.001.
        let push = (action as f64 - 1.0) * FORCE;
        velocity += push + (3.0 * position).cos() * (-GRAVITY);
        velocity = velocity.clamp(-MAX_SPEED, MAX_SPEED);
        position += velocity;
        position = position.clamp(MIN_POSITION, MAX_POSITION);
        if position == MIN_POSITION && velocity < 0.0 {
            velocity = 0.0;
        }
        let terminated = position >= GOAL_POSITION && velocity >= GOAL_VELOCITY;
        self.state = [position, velocity];

        let truncated = self.clock.tick();
        self.write_obs(obs);
        Ok(StepResult {
            reward: -1.0,
            terminated,
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
        check_obs_len(obs, 2)?;
        self.write_obs(obs);
        Ok(())
    }

    fn elapsed_steps(&self) -> u32 {
        self.clock.elapsed()
    }
}
