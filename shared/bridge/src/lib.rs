//! The Python edge of relay: environments that exist only in Python
//! (any Gymnasium id, Box2D, Atari, MinAtar, a user's own) behind the same
//! vectorized-env API as relay's built-in envs, and TextArena's games
//! behind the same text-game trait as relay's built-in games.
//!
//! # Why worker processes
//! A batch of envs is stepped by Python processes that the caller owns
//! (Stable-Baselines3's `SubprocVecEnv` design), not by an interpreter
//! embedded with PyO3:
//! - a crash in Python or in a C extension (Box2D, ALE) kills one worker,
//!   which is restarted and counted, never the service;
//! - a hung worker can be killed; a hung embedded interpreter cannot;
//! - several workers step in parallel on several cores, with no GIL between
//!   them;
//! - relay's binaries do not link libpython, so they build and run the same
//!   with or without Python, and the interpreter (a project venv, a user's
//!   conda env) is chosen at run time by `env.python`.
//!
//! The cost is one pipe round trip per worker per step, carrying the batch's
//! actions in and its observations out as raw little-endian bytes inside a
//! MessagePack map (`just bench-bridge` measures it against Gymnasium's own
//! `SyncVectorEnv`).
//!
//! # Modules
//! - [`section`] owns the config's `env` section ([`EnvSection`]).
//! - [`python`] owns [`PyVecEnv`]: spaces, seeding, autoreset, faults and
//!   restarts.
//! - [`text`] owns [`PyTextGame`]: TextArena's games behind relay's
//!   `TextGame` trait ([`make_text_game`]).
//! - `worker` owns one worker process and the pipe protocol, and [`Cancel`],
//!   with which an owner that stops cuts every wait on its workers short;
//!   the worker program itself is `python/relay_env_worker.py`, compiled in.
//! - [`error`] owns [`BridgeError`] and [`Fault`].
//!
//! This crate is plumbing for the services that step envs (env-runner,
//! evaluator, the CLI's `play` and `eval`): std processes and threads, no
//! NATS, Redis or tokio.

pub mod error;
pub mod python;
pub mod section;
pub mod text;
mod worker;

use std::collections::{HashMap, HashSet};
use std::sync::{Mutex, OnceLock};

pub use error::{BridgeError, Fault, FaultKind, INSTALL_HINT};
pub use python::PyVecEnv;
use relay_envs::{EnvSpec, VecActions, VecEnv, VecStep};
pub use section::{is_builtin, project_python, Backend, EnvSection, MultiAgent, WrapperConfig};
pub use text::{make_text_game, PyTextGame};
pub use worker::{Cancel, WORKER_SOURCE};

/// A batch of envs: relay's built-in ones, or Gymnasium's through Python.
// A batch is made once per service and never moved in a hot loop: no box.
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
pub enum VecEnvs {
    Builtin(VecEnv),
    Python(PyVecEnv),
}

impl VecEnvs {
    /// `num_envs` copies of `env_id` from the backend `section` chooses;
    /// env `i` is seeded from `(seed, i)`.
    pub fn new(
        env_id: &str,
        section: &EnvSection,
        num_envs: usize,
        seed: u64,
    ) -> Result<VecEnvs, BridgeError> {
        Self::cancellable(env_id, section, num_envs, seed, &Cancel::default())
    }

    /// [`VecEnvs::new`], whose waits on Python workers (this start
    /// included) `cancel` cuts short with [`BridgeError::Cancelled`]: what
    /// a service that stops sets. Built-in envs never wait.
    pub fn cancellable(
        env_id: &str,
        section: &EnvSection,
        num_envs: usize,
        seed: u64,
        cancel: &Cancel,
    ) -> Result<VecEnvs, BridgeError> {
        if section.uses_python(env_id) {
            let envs = PyVecEnv::cancellable(env_id, section, num_envs, seed, cancel)?;
            remember_spec(env_id, section, envs.spec());
            Ok(VecEnvs::Python(envs))
        } else {
            Ok(VecEnvs::Builtin(VecEnv::new(env_id, num_envs, seed)?))
        }
    }

    pub fn spec(&self) -> &EnvSpec {
        match self {
            VecEnvs::Builtin(e) => e.spec(),
            VecEnvs::Python(e) => e.spec(),
        }
    }

    pub fn num_envs(&self) -> usize {
        match self {
            VecEnvs::Builtin(e) => e.num_envs(),
            VecEnvs::Python(e) => e.num_envs(),
        }
    }

    /// Observation width (flattened).
    pub fn obs_dim(&self) -> usize {
        match self {
            VecEnvs::Builtin(e) => e.obs_dim(),
            VecEnvs::Python(e) => e.obs_dim(),
        }
    }

    /// Current observations, `[num_envs * obs_dim]`.
    pub fn obs(&self) -> &[f32] {
        match self {
            VecEnvs::Builtin(e) => e.obs(),
            VecEnvs::Python(e) => e.obs(),
        }
    }

    /// Resets every env and returns the first observations.
    pub fn reset(&mut self) -> Result<&[f32], BridgeError> {
        match self {
            VecEnvs::Builtin(e) => Ok(e.reset()?),
            VecEnvs::Python(e) => e.reset(),
        }
    }

    /// Steps every env with autoreset; see [`PyVecEnv::step`] for the
    /// recoverable [`BridgeError::Faulted`].
    pub fn step(&mut self, actions: VecActions<'_>) -> Result<&VecStep, BridgeError> {
        match self {
            VecEnvs::Builtin(e) => Ok(e.step(actions)?),
            VecEnvs::Python(e) => e.step(actions),
        }
    }

    /// The action masks of the current observations (`[num_envs *
    /// n_actions]`, 1 = legal), for an env with masks.
    pub fn masks(&self) -> Option<&[u8]> {
        match self {
            VecEnvs::Builtin(_) => None,
            VecEnvs::Python(e) => e.masks(),
        }
    }

    /// Multi-agent games: the seat to move in each env, whose observation
    /// and mask are that env's rows; `None` for single-agent envs.
    pub fn movers(&self) -> Option<&[u32]> {
        match self {
            VecEnvs::Builtin(_) => None,
            VecEnvs::Python(e) => e.movers(),
        }
    }

    /// Python workers restarted so far (0 for built-in envs).
    pub fn restarts(&self) -> u64 {
        match self {
            VecEnvs::Builtin(_) => 0,
            VecEnvs::Python(e) => e.restarts(),
        }
    }
}

/// The spec of `env_id` under `section`: the built-in one, or what a Python
/// worker reports (asked once per process and env config, then cached).
pub fn spec(env_id: &str, section: &EnvSection) -> Result<EnvSpec, BridgeError> {
    cancellable_spec(env_id, section, &Cancel::default())
}

/// [`spec`], whose wait on a worker (the first time it is asked) `cancel`
/// cuts short with [`BridgeError::Cancelled`].
pub fn cancellable_spec(
    env_id: &str,
    section: &EnvSection,
    cancel: &Cancel,
) -> Result<EnvSpec, BridgeError> {
    if !section.uses_python(env_id) {
        return Ok(relay_envs::spec(env_id)?);
    }
    let key = cache_key(env_id, section);
    if let Some(spec) = spec_cache().lock().expect("spec cache").get(&key) {
        return Ok(spec.clone());
    }
    let spec = PyVecEnv::probe(env_id, section, cancel)?;
    remember_spec(env_id, section, &spec);
    Ok(spec)
}

fn spec_cache() -> &'static Mutex<HashMap<String, EnvSpec>> {
    static CACHE: OnceLock<Mutex<HashMap<String, EnvSpec>>> = OnceLock::new();
    CACHE.get_or_init(Default::default)
}

/// What makes the env (not how many workers step it or their timeouts).
pub(crate) fn cache_key(env_id: &str, section: &EnvSection) -> String {
    serde_json::json!([
        env_id,
        section.backend,
        section.kwargs,
        section.wrappers,
        section.imports,
        section.python_path,
        section.entry_point,
        section.interpreter(),
        section.num_players,
        section.action_masks,
        section.seat_feature,
        section.multi_agent,
    ])
    .to_string()
}

fn remember_spec(env_id: &str, section: &EnvSection, spec: &EnvSpec) {
    spec_cache()
        .lock()
        .expect("spec cache")
        .insert(cache_key(env_id, section), spec.clone());
}

/// The id as the `&'static str` of [`EnvSpec::id`]: one leaked copy per
/// distinct id for the life of the process (a run has one or a few).
pub(crate) fn intern(id: &str) -> &'static str {
    static IDS: OnceLock<Mutex<HashSet<&'static str>>> = OnceLock::new();
    let mut ids = IDS.get_or_init(Default::default).lock().expect("ids");
    if let Some(known) = ids.get(id) {
        return known;
    }
    let leaked: &'static str = Box::leak(id.to_string().into_boxed_str());
    ids.insert(leaked);
    leaked
}
