//! The single-environment interface.
//!
//! This module owns the [`Env`] trait every environment implements, the
//! [`Action`] and [`StepResult`] types that cross it, and the pieces of
//! Gymnasium's wrapper stack that `gym.make` adds and that every environment
//! here embeds: the `TimeLimit` step counter and `OrderEnforcing` (no `step`
//! before `reset`). The physics lives in the per-environment modules.

use rand::RngCore;

use crate::error::EnvError;
use crate::spaces::{ActionSpace, EnvSpec};

/// One action for one environment.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Action<'a> {
    /// An action of a discrete space; must lie in `0..n`.
    Discrete(i64),
    /// A continuous action (`float32`, the dtype of Gymnasium's `Box`
    /// action spaces). Arithmetic that NumPy >= 2 (NEP 50 promotion) carries
    /// out in `float32` with such an action is carried out in `f32` here too.
    Continuous(&'a [f32]),
}

impl Action<'_> {
    fn kind(&self) -> &'static str {
        match self {
            Action::Discrete(_) => "discrete",
            Action::Continuous(_) => "continuous",
        }
    }
}

/// What a step returns besides the observation.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepResult {
    /// Reward of the transition (Gymnasium's Python `float`).
    pub reward: f64,
    /// The MDP reached a terminal state (pole fell, goal reached, ...).
    pub terminated: bool,
    /// The time limit was reached: `elapsed_steps >= max_episode_steps`,
    /// independently of `terminated` (exactly as Gymnasium's `TimeLimit`).
    pub truncated: bool,
}

impl StepResult {
    /// The episode is over (`terminated || truncated`).
    pub fn done(&self) -> bool {
        self.terminated || self.truncated
    }
}

/// A Gymnasium environment as returned by `gym.make(id)`: the raw
/// environment plus its time limit and reset-before-step enforcement.
///
/// Observations are written into caller-provided buffers of length
/// [`EnvSpec::obs_dim`]; internal state is `f64` as in Gymnasium, and the
/// observation is its `f32` cast.
pub trait Env: Send {
    /// The environment's spec (spaces, time limit, reward threshold).
    fn spec(&self) -> &EnvSpec;

    /// Observation dimension.
    fn obs_dim(&self) -> usize {
        self.spec().obs_dim()
    }

    /// Starts a new episode: draws an initial state from `rng` with
    /// Gymnasium's reset distribution, resets the step counter and writes
    /// the first observation into `obs`.
    fn reset(&mut self, rng: &mut dyn RngCore, obs: &mut [f32]) -> Result<(), EnvError>;

    /// Applies `action`, writes the next observation into `obs` and returns
    /// the reward and the termination / truncation flags. Invalid actions are
    /// rejected without changing the state.
    fn step(&mut self, action: Action<'_>, obs: &mut [f32]) -> Result<StepResult, EnvError>;

    /// The internal `f64` state (layout documented on each environment).
    fn state(&self) -> Vec<f64>;

    /// Replaces the internal state as if a reset had produced it: the step
    /// counter restarts at zero and per-episode bookkeeping is cleared.
    fn set_state(&mut self, state: &[f64]) -> Result<(), EnvError>;

    /// Writes the observation of the current state into `obs`.
    fn observe(&self, obs: &mut [f32]) -> Result<(), EnvError>;

    /// Steps taken since the last reset / `set_state`.
    fn elapsed_steps(&self) -> u32;
}

/// Gymnasium's `TimeLimit` plus `OrderEnforcing`, embedded in every env.
#[derive(Debug, Clone)]
pub(crate) struct EpisodeClock {
    max_episode_steps: u32,
    elapsed: u32,
    has_reset: bool,
}

impl EpisodeClock {
    pub(crate) fn new(max_episode_steps: u32) -> Self {
        Self {
            max_episode_steps,
            elapsed: 0,
            has_reset: false,
        }
    }

    /// A new episode starts.
    pub(crate) fn restart(&mut self) {
        self.elapsed = 0;
        self.has_reset = true;
    }

    pub(crate) fn ensure_reset(&self, env_id: &'static str) -> Result<(), EnvError> {
        if self.has_reset {
            Ok(())
        } else {
            Err(EnvError::NotReset { env_id })
        }
    }

    /// Counts one step and returns `truncated`.
    pub(crate) fn tick(&mut self) -> bool {
        self.elapsed = self.elapsed.saturating_add(1);
        self.elapsed >= self.max_episode_steps
    }

    pub(crate) fn elapsed(&self) -> u32 {
        self.elapsed
    }
}

pub(crate) fn check_obs_len(obs: &[f32], expected: usize) -> Result<(), EnvError> {
    if obs.len() == expected {
        Ok(())
    } else {
        Err(EnvError::ObsLength {
            expected,
            got: obs.len(),
        })
    }
}

pub(crate) fn check_state_len(
    env_id: &'static str,
    state: &[f64],
    expected: usize,
) -> Result<(), EnvError> {
    if state.len() == expected {
        Ok(())
    } else {
        Err(EnvError::StateLength {
            env_id,
            expected,
            got: state.len(),
        })
    }
}

/// Validates an action against a discrete space and returns its index.
pub(crate) fn discrete_action(spec: &EnvSpec, action: Action<'_>) -> Result<usize, EnvError> {
    let n = match spec.action_space {
        ActionSpace::Discrete { n } => n,
        ActionSpace::Box { .. } => {
            return Err(EnvError::WrongActionKind {
                env_id: spec.id,
                expected: "continuous",
                got: action.kind(),
            })
        }
    };
    match action {
        Action::Discrete(a) => match usize::try_from(a) {
            Ok(i) if i < n => Ok(i),
            _ => Err(EnvError::ActionOutOfRange { action: a, n }),
        },
        _ => Err(EnvError::WrongActionKind {
            env_id: spec.id,
            expected: "discrete",
            got: action.kind(),
        }),
    }
}

/// Validates an action against a box space (kind, dimension, finiteness)
/// and returns its components. Values outside the bounds are accepted: the
/// environments clip them, as Gymnasium does.
pub(crate) fn continuous_action<'a>(
    spec: &EnvSpec,
    action: Action<'a>,
) -> Result<&'a [f32], EnvError> {
    let dim = match &spec.action_space {
        ActionSpace::Box { low, .. } => low.len(),
        ActionSpace::Discrete { .. } => {
            return Err(EnvError::WrongActionKind {
                env_id: spec.id,
                expected: "discrete",
                got: action.kind(),
            })
        }
    };
    let a = match action {
        Action::Continuous(a) => a,
        Action::Discrete(_) => {
            return Err(EnvError::WrongActionKind {
                env_id: spec.id,
                expected: "continuous",
                got: action.kind(),
            })
        }
    };
    if a.len() != dim {
        return Err(EnvError::ActionDim {
            env_id: spec.id,
            expected: dim,
            got: a.len(),
        });
    }
    if let Some(index) = a.iter().position(|v| !v.is_finite()) {
        return Err(EnvError::NonFiniteAction {
            index,
            value: f64::from(a[index]),
        });
    }
    Ok(a)
}

/// Python's `x ** 2` on a `float` / `np.float64`: C `pow(x, 2.0)`. glibc's
/// `pow` is not correctly rounded (worst case 0.54 ulp), so it occasionally
/// differs from `x * x` by one ulp, and Gymnasium's trajectories follow
/// `pow`.
///
/// `pow` costs about 9 ns, and Acrobot calls this 12 times a step, so
/// the product is used where `pow` provably returns it: the exact square
/// is `x * x + e`, with `e` exact from Dekker's product (no fused
/// multiply-add: on the baseline x86-64 target that is a software call).
/// When `|e|` is under 0.4 ulp, every other double is over 0.6 ulp from the
/// exact square, beyond `pow`'s error, so `pow` returns the rounded product
/// too. Near a rounding midpoint (about one case in five), at a power of
/// two (a neighbour half an ulp away), and for squares outside
/// `[2^-900, 2^900]` (where the split could overflow or lose bits),
/// `pow` itself is called, its exponent through `black_box` so LLVM cannot
/// rewrite the call into `x * x`. (NumPy's `np.square`, by contrast, is
/// `x * x`.)
pub(crate) fn py_pow2(x: f64) -> f64 {
    const MANTISSA: u64 = 0x000f_ffff_ffff_ffff;
    // Biased exponents of 2^-900 and 2^900.
    const SAFE: std::ops::RangeInclusive<u64> = (1023 - 900)..=(1023 + 900);
    let p = x * x;
    let bits = p.to_bits();
    let exponent = bits >> 52;
    if SAFE.contains(&exponent) && bits & MANTISSA != 0 {
        // Veltkamp's split: x = hi + lo, each half fits 26 bits, so the
        // partial products below are exact.
        let c = 134_217_729.0 * x; // 2^27 + 1
        let hi = c - (c - x);
        let lo = x - hi;
        let error = ((hi * hi - p) + 2.0 * hi * lo) + lo * lo;
        // ulp(p) = 2^(exponent - 1023 - 52).
        let ulp = f64::from_bits(exponent << 52) * f64::EPSILON;
        if error.abs() < 0.4 * ulp {
            return p;
        }
    }
    x.powf(std::hint::black_box(2.0))
}

/// `x ** 2` on an `np.float32`: C `powf(x, 2.0f)` (see [`py_pow2`]).
pub(crate) fn py_pow2_f32(x: f32) -> f32 {
    x.powf(std::hint::black_box(2.0))
}

/// Python's / NumPy's float `%` (floor modulo: the result has the sign of
/// the divisor), as `np.remainder` computes it for `float64`.
pub(crate) fn py_mod(a: f64, b: f64) -> f64 {
    let m = a % b; // C fmod
    if m != 0.0 {
        if (b < 0.0) != (m < 0.0) {
            m + b
        } else {
            m
        }
    } else {
        0.0f64.copysign(b)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};
    use std::f64::consts::PI;

    #[test]
    fn py_mod_is_floor_modulo() {
        // Values as printed by CPython.
        assert_eq!(py_mod(-1.0, 2.0 * PI), 5.283185307179586);
        assert_eq!(py_mod(7.0, 2.0 * PI), 0.7168146928204138);
        assert_eq!(py_mod(7.0, -3.0), -2.0);
        assert_eq!(py_mod(-7.0, 3.0), 2.0);
        assert!(py_mod(-0.0, 3.0).is_sign_positive());
        assert!(py_mod(6.0, -3.0).is_sign_negative());
    }

    #[test]
    fn py_pow2_follows_libm_pow() {
        // CPython: (-6.6462969421827065)**2 == 44.17326304366719, one ulp
        // away from the correctly rounded product.
        let x = -6.6462969421827065f64;
        assert_eq!(x * x, 44.1732630436672);
        assert_eq!(py_pow2(x), 44.17326304366719);
        assert_eq!(py_pow2(0.5), 0.25);
        assert_eq!(py_pow2_f32(3.0), 9.0);
    }

    #[test]
    fn py_pow2_is_libm_pow_bit_for_bit() {
        let pow = |x: f64| x.powf(std::hint::black_box(2.0));
        let mut rng = rand::rngs::SmallRng::seed_from_u64(7);
        let mut product_differs = 0;
        for i in 0..2_000_000u32 {
            let x = match i % 4 {
                0 => rng.random_range(-10.0..10.0),
                1 => rng.random_range(-1e-3..1e-3),
                2 => f64::from_bits(rng.random::<u64>()),
                // Squares of powers of two and their neighbours.
                _ => f64::from_bits(
                    (1.0f64 + f64::from(rng.random_range(-8i32..8))).to_bits()
                        ^ u64::from(rng.random::<u8>() & 3),
                ),
            };
            let (got, want) = (py_pow2(x), pow(x));
            assert!(
                got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
                "{x:e}: {got:e} != pow's {want:e}"
            );
            product_differs += usize::from((x * x).to_bits() != want.to_bits());
        }
        // The cases the fast path must leave to pow do occur.
        assert!(product_differs > 0);
        for x in [0.0, -0.0, 1e-200, f64::INFINITY, f64::NAN, 1e200, 2.0, 0.5] {
            let (got, want) = (py_pow2(x), pow(x));
            assert!(
                got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
                "{x:e}"
            );
        }
    }
}
