//! The id → environment registry (Gymnasium's `gym.make` / `gym.spec`).

use crate::no_velocity::{self, MaskVelocity};
use crate::{acrobot, cartpole, mountain_car, pendulum};
use crate::{Acrobot, CartPole, Env, EnvError, EnvSpec, MountainCar, Pendulum};

/// Every environment id this crate provides: Gymnasium's classic control,
/// and rl-zoo's partially observed variants without velocities.
pub const ENV_IDS: &[&str] = &[
    cartpole::ID,
    acrobot::ID,
    mountain_car::ID,
    pendulum::ID,
    no_velocity::CARTPOLE_ID,
    no_velocity::PENDULUM_ID,
];

fn unknown(id: &str) -> EnvError {
    EnvError::UnknownEnv {
        id: id.to_string(),
        known: ENV_IDS.to_vec(),
    }
}

/// Creates the environment registered under `id` (exact, case-sensitive
/// match). It must be reset (or given a state) before stepping.
pub fn make(id: &str) -> Result<Box<dyn Env>, EnvError> {
    Ok(match id {
        cartpole::ID => Box::new(CartPole::new()),
        acrobot::ID => Box::new(Acrobot::new()),
        mountain_car::ID => Box::new(MountainCar::new()),
        pendulum::ID => Box::new(Pendulum::new()),
        no_velocity::CARTPOLE_ID => Box::new(MaskVelocity::cartpole()),
        no_velocity::PENDULUM_ID => Box::new(MaskVelocity::pendulum()),
        _ => return Err(unknown(id)),
    })
}

/// The spec of the environment registered under `id`.
pub fn spec(id: &str) -> Result<EnvSpec, EnvError> {
    Ok(match id {
        cartpole::ID => cartpole::spec(),
        acrobot::ID => acrobot::spec(),
        mountain_car::ID => mountain_car::spec(),
        pendulum::ID => pendulum::spec(),
        no_velocity::CARTPOLE_ID => no_velocity::cartpole_spec(),
        no_velocity::PENDULUM_ID => no_velocity::pendulum_spec(),
        _ => return Err(unknown(id)),
    })
}
