//! The `env` section of an experiment config: where `run.env_id` comes from
//! and how the Python side makes it.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// Where an env id is looked up.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Backend {
    /// relay's built-in env when it has the id (the fast path), else
    /// Gymnasium's when it registers the id, else PettingZoo's game of that
    /// name (`pistonball_v6`, `chess_v6`, `simple_spread_v3`).
    #[default]
    Auto,
    /// Only relay's built-in envs and text games.
    Builtin,
    /// `gymnasium.make(run.env_id)` in Python worker processes, also for an
    /// id relay has built in.
    Gymnasium,
    /// `textarena.make(id)` in a Python worker: `run.env_id` and every id of
    /// `text.games` is a TextArena game, also one relay has built in.
    Textarena,
    /// A PettingZoo game (`connect_four_v3`: `pettingzoo.classic.connect_four_v3`,
    /// `simple_spread_v3`: `mpe2.simple_spread_v3`; or `entry_point`
    /// `module:function`) in Python workers, played as
    /// [`EnvSection::multi_agent`] says.
    Pettingzoo,
}

/// How a PettingZoo game is played (`env.multi_agent`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MultiAgent {
    /// PettingZoo's classic games (turns, two sides) by self-play; every
    /// other family (butterfly, sisl, MPE, Atari) and any parallel env of
    /// an `entry_point` with one shared policy.
    #[default]
    Auto,
    /// Its agents take turns; the policy holds one seat of each game and
    /// plays the others (itself, past versions, bots).
    SelfPlay,
    /// All agents act at once with one policy shared by all of them
    /// (parameter sharing, as SuperSuit gives Stable-Baselines3): every
    /// agent is a row of the vector of envs and trains it with its own
    /// reward; `env_runner.num_envs` counts those rows.
    Shared,
}

/// A Gymnasium wrapper applied after `gymnasium.make`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WrapperConfig {
    /// A class of `gymnasium.wrappers` by name (`FrameStackObservation`) or
    /// any class as `module:Class`.
    pub name: String,
    /// Its keyword arguments.
    #[serde(default)]
    pub kwargs: BTreeMap<String, serde_json::Value>,
}

/// `env:`: the environment's source and the Python workers that step it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct EnvSection {
    /// Where `run.env_id` comes from: `auto` (relay's built-in env when it
    /// has the id, else Gymnasium's, else PettingZoo's), `builtin`,
    /// `gymnasium`, `pettingzoo` or `textarena` (TextArena's games, which
    /// `auto` never picks: set it for any TextArena id).
    pub backend: Backend,
    /// Keyword arguments of `gymnasium.make(run.env_id, **kwargs)` (or of
    /// `textarena.make`, overriding the id's registered ones).
    pub kwargs: BTreeMap<String, serde_json::Value>,
    /// Wrappers applied in order after `make`: Gymnasium's by class name,
    /// or for PettingZoo games SuperSuit's by function name
    /// (`color_reduction_v0`, `resize_v1`, `frame_stack_v1`); any as
    /// `module:Name`.
    pub wrappers: Vec<WrapperConfig>,
    /// Python modules imported before `make`, as `module`, or
    /// `module:function` to also call a function of it: how a user's own
    /// package registers its ids. (`ALE/...` and `MinAtar/...` ids register
    /// their package by themselves.)
    pub imports: Vec<String>,
    /// Folders put first on the workers' `sys.path`: where a user's own env
    /// module lives when it is not an installed package.
    pub python_path: Vec<PathBuf>,
    /// Registers `run.env_id` with this entry point (`module:Class`) before
    /// `make`, for a user's env class that no package registers.
    pub entry_point: Option<String>,
    /// Python interpreter. Default: `RELAY_PYTHON`, else the
    /// `.relay/python` environment that `just install` makes (looked for in
    /// the working directory and its parents), else `python3`.
    pub python: Option<PathBuf>,
    /// Python worker processes per env-runner; its envs are split among them
    /// and stepped in parallel (one round trip per worker per step).
    pub workers: usize,
    /// Seconds a worker may take to answer one step before it counts as
    /// hung, is killed and restarted.
    pub step_timeout_s: f64,
    /// Seconds a worker may take to start: imports, `make`, first reset.
    pub start_timeout_s: f64,
    /// Players of a TextArena game (`env.reset(num_players=...)`); unset:
    /// the first of 2, 1, 3, 4, 5, 6 that the game accepts.
    pub num_players: Option<usize>,
    /// Use the env's action masks where it has them (Gymnasium's
    /// `info["action_mask"]`): the policy samples, trains and is evaluated
    /// on legal actions only. `false`: every action counts as legal.
    pub action_masks: bool,
    /// Multi-agent games (PettingZoo's): end each observation with a
    /// one-hot of the seat (or agent) it belongs to, so that one policy and
    /// its value function know which role they play (role-conditioned
    /// values and advantages: a per-seat baseline, as the first mover of
    /// most games expects a different return; SuperSuit's
    /// `agent_indicator_v0`). Flat observations only.
    pub seat_feature: bool,
    /// How a PettingZoo game is played: `auto`, `self_play` or `shared`
    /// ([`MultiAgent`]).
    pub multi_agent: MultiAgent,
}

impl Default for EnvSection {
    fn default() -> Self {
        Self {
            backend: Backend::Auto,
            kwargs: BTreeMap::new(),
            wrappers: Vec::new(),
            imports: Vec::new(),
            python_path: Vec::new(),
            entry_point: None,
            python: None,
            workers: 1,
            step_timeout_s: 60.0,
            start_timeout_s: 120.0,
            num_players: None,
            action_masks: true,
            seat_feature: false,
            multi_agent: MultiAgent::Auto,
        }
    }
}

impl EnvSection {
    /// Whether `env_id` is stepped by Python workers under this section.
    pub fn uses_python(&self, env_id: &str) -> bool {
        match self.backend {
            Backend::Builtin | Backend::Textarena => false,
            Backend::Gymnasium | Backend::Pettingzoo => true,
            Backend::Auto => !is_builtin(env_id),
        }
    }

    /// Whether text games are TextArena's, played in a Python worker.
    pub fn text_uses_python(&self) -> bool {
        self.backend == Backend::Textarena
    }

    /// Whether `env_id` is a text game (played by LLM policies) under this
    /// section: one of relay's, or any id under `backend: textarena`.
    pub fn is_text_game(&self, env_id: &str) -> bool {
        self.backend == Backend::Textarena || relay_envs::TEXT_GAME_IDS.contains(&env_id)
    }

    /// Checks ranges and names (the id itself is checked when a worker
    /// makes it).
    pub fn validate(&self, env_id: &str) -> Result<(), (&'static str, String)> {
        if self.workers == 0 {
            return Err(("env.workers", "must be at least 1".into()));
        }
        if self.num_players == Some(0) {
            return Err(("env.num_players", "must be at least 1".into()));
        }
        for (field, v) in [
            ("env.step_timeout_s", self.step_timeout_s),
            ("env.start_timeout_s", self.start_timeout_s),
        ] {
            if !(v.is_finite() && v > 0.0) {
                return Err((
                    field,
                    format!("must be a positive number of seconds, got {v}"),
                ));
            }
        }
        if self.backend == Backend::Builtin && !is_builtin(env_id) {
            return Err((
                "run.env_id",
                format!(
                    "env.backend is builtin, but relay has no built-in env {env_id:?}; built in: {} (classic control), {} (text games); set env.backend: gymnasium (or auto) to make it with Gymnasium, or textarena for a TextArena game",
                    relay_envs::ENV_IDS.join(", "),
                    relay_envs::TEXT_GAME_IDS.join(", ")
                ),
            ));
        }
        if self.uses_python(env_id) && relay_envs::TEXT_GAME_IDS.contains(&env_id) {
            return Err((
                "env.backend",
                format!("{env_id} is a text game; text games run built in"),
            ));
        }
        if self.seat_feature && !matches!(self.backend, Backend::Pettingzoo | Backend::Auto) {
            return Err((
                "env.seat_feature",
                "marks the seat of multi-agent games (PettingZoo's); set env.backend: pettingzoo or auto".into(),
            ));
        }
        for w in &self.wrappers {
            if w.name.trim().is_empty() {
                return Err(("env.wrappers", "a wrapper has an empty name".into()));
            }
        }
        if let Some(entry) = &self.entry_point {
            if !entry.contains(':') {
                return Err((
                    "env.entry_point",
                    format!("{entry:?} is not `module:Class`"),
                ));
            }
        }
        Ok(())
    }

    /// The interpreter the workers run (see [`EnvSection::python`]).
    pub fn interpreter(&self) -> PathBuf {
        if let Some(p) = &self.python {
            return p.clone();
        }
        if let Some(p) = std::env::var_os("RELAY_PYTHON").filter(|p| !p.is_empty()) {
            return PathBuf::from(p);
        }
        if let Ok(cwd) = std::env::current_dir() {
            if let Some(p) = project_python(&cwd) {
                return p;
            }
        }
        PathBuf::from("python3")
    }
}

/// The `.relay/python` interpreter in `dir` or its nearest parent that has one.
pub fn project_python(dir: &Path) -> Option<PathBuf> {
    dir.ancestors()
        .map(|d| d.join(".relay/python/bin/python"))
        .find(|p| p.is_file())
}

/// Whether relay has `env_id` built in (a classic-control env or a text game).
pub fn is_builtin(env_id: &str) -> bool {
    relay_envs::ENV_IDS.contains(&env_id) || relay_envs::TEXT_GAME_IDS.contains(&env_id)
}
