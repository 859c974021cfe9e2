//! Partially observed classic control: rl-baselines3-zoo's
//! `MaskVelocityWrapper`, which zeroes the velocities of an observation so
//! that a policy must remember past observations to infer them (the
//! benchmarks of recurrent policies): `CartPoleNoVel-v1` (CartPole-v1
//! without the cart's velocity, index 1, and the pole's angular velocity,
//! index 3) and `PendulumNoVel-v1` (Pendulum-v1 without the angular
//! velocity, index 2). As rl-zoo's, the observation keeps its shape and
//! bounds, the masked entries always 0; dynamics, rewards and time limits
//! are the wrapped env's.

use rand::RngCore;

use crate::env::{Action, Env, StepResult};
use crate::{cartpole, pendulum, CartPole, EnvError, EnvSpec, Pendulum};

/// `CartPoleNoVel-v1`.
pub const CARTPOLE_ID: &str = "CartPoleNoVel-v1";
/// `PendulumNoVel-v1`.
pub const PENDULUM_ID: &str = "PendulumNoVel-v1";

/// The observation indices each id masks.
const CARTPOLE_VELOCITIES: &[usize] = &[1, 3];
const PENDULUM_VELOCITIES: &[usize] = &[2];

/// An env with some observation entries zeroed.
pub struct MaskVelocity {
    inner: Box<dyn Env>,
    spec: EnvSpec,
    masked: &'static [usize],
}

impl MaskVelocity {
    /// `CartPoleNoVel-v1`.
    pub fn cartpole() -> Self {
        Self {
            inner: Box::new(CartPole::new()),
            spec: cartpole_spec(),
            masked: CARTPOLE_VELOCITIES,
        }
    }

    /// `PendulumNoVel-v1`.
    pub fn pendulum() -> Self {
        Self {
            inner: Box::new(Pendulum::new()),
            spec: pendulum_spec(),
            masked: PENDULUM_VELOCITIES,
        }
    }

    fn mask(&self, obs: &mut [f32]) {
        for &i in self.masked {
            obs[i] = 0.0;
        }
    }
}

/// `CartPoleNoVel-v1`'s spec: CartPole-v1's under another id (the goal is
/// CartPole's 475).
pub fn cartpole_spec() -> EnvSpec {
    EnvSpec {
        id: CARTPOLE_ID,
        ..cartpole::spec()
    }
}

/// `PendulumNoVel-v1`'s spec: Pendulum-v1's under another id.
pub fn pendulum_spec() -> EnvSpec {
    EnvSpec {
        id: PENDULUM_ID,
        ..pendulum::spec()
    }
}

impl Env for MaskVelocity {
    fn spec(&self) -> &EnvSpec {
        &self.spec
    }

    fn reset(&mut self, rng: &mut dyn RngCore, obs: &mut [f32]) -> Result<(), EnvError> {
        self.inner
            .reset(rng, obs)
            .map_err(|e| e.for_env(self.spec.id))?;
        self.mask(obs);
        Ok(())
    }

    fn step(&mut self, action: Action<'_>, obs: &mut [f32]) -> Result<StepResult, EnvError> {
        let result = self
            .inner
            .step(action, obs)
            .map_err(|e| e.for_env(self.spec.id))?;
        self.mask(obs);
        Ok(result)
    }

    fn state(&self) -> Vec<f64> {
        self.inner.state()
    }

    fn set_state(&mut self, state: &[f64]) -> Result<(), EnvError> {
        self.inner
            .set_state(state)
            .map_err(|e| e.for_env(self.spec.id))
    }

    fn observe(&self, obs: &mut [f32]) -> Result<(), EnvError> {
        self.inner
            .observe(obs)
            .map_err(|e| e.for_env(self.spec.id))?;
        self.mask(obs);
        Ok(())
    }

    fn elapsed_steps(&self) -> u32 {
        self.inner.elapsed_steps()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    #[test]
    fn velocities_are_zeroed_and_the_rest_is_the_wrapped_env() {
        for (mut masked, mut full, zeroed) in [
            (
                MaskVelocity::cartpole(),
                Box::new(CartPole::new()) as Box<dyn Env>,
                CARTPOLE_VELOCITIES,
            ),
            (
                MaskVelocity::pendulum(),
                Box::new(Pendulum::new()) as Box<dyn Env>,
                PENDULUM_VELOCITIES,
            ),
        ] {
            let d = full.obs_dim();
            assert_eq!(masked.obs_dim(), d);
            let (mut a, mut b) = (vec![0f32; d], vec![0f32; d]);
            masked
                .reset(&mut rand::rngs::StdRng::seed_from_u64(4), &mut a)
                .unwrap();
            full.reset(&mut rand::rngs::StdRng::seed_from_u64(4), &mut b)
                .unwrap();
            for _ in 0..5 {
                for i in 0..d {
                    if zeroed.contains(&i) {
                        assert_eq!(a[i], 0.0);
                    } else {
                        assert_eq!(a[i], b[i]);
                    }
                }
                let action = if d == 4 {
                    Action::Discrete(1)
                } else {
                    Action::Continuous(&[0.5])
                };
                let (ra, rb) = (
                    masked.step(action, &mut a).unwrap(),
                    full.step(action, &mut b).unwrap(),
                );
                assert_eq!(ra, rb);
            }
            assert!(b
                .iter()
                .enumerate()
                .any(|(i, v)| zeroed.contains(&i) && *v != 0.0));
        }
    }
}
