//! Evaluator plugins: one [`Evaluator`] trait, a [`registry`] of named
//! factories, and the plugins `greedy`, `stochastic`, `threshold`,
//! `record` and `vs-opponent`. A plugin is chosen by `eval.evaluator` and `eval.options`, and
//! switched at run time by an `EvalControl` message (`relay eval use`).
//!
//! Options every plugin takes: `episodes` (default `eval.episodes`) and
//! `seed` (default `eval.seed`). Plugin options:
//!
//! | plugin | actions | options | writes |
//! |---|---|---|---|
//! | `greedy` | deterministic (arg-max / mean) | — | — |
//! | `stochastic` | sampled from the policy | — | — |
//! | `threshold` | deterministic, only once the training return (mean of the last 100 training episodes) reaches `level` | `level` (required) | — |
//! | `record` | deterministic | — | `runs/<id>/recordings/v<version>.jsonl`: one JSON line per episode with `obs`, `actions`, `rewards`, `terminated`, `truncated`, `return` |
//! | `vs-opponent` | text games: the LLM policy (learning adapter, newest version) against each opponent, half of the games in each seat, through the env-runner's game loop; multi-agent games on observations (PettingZoo's): the version's greedy policy against each opponent, game `e` from seat `e % seats`, on the same seeds for every opponent | `games` (per opponent; default `eval.episodes`), `opponents` (comma list; text games: `random`, `minimax`, `connect_four_bot`, `self`, `base`, `adapter:<name>`, default `random` (`base`, the policy's first version, in a game that lists no legal moves) plus `minimax` for TicTacToe or `connect_four_bot` for ConnectFour; games on observations: `random`, `minimax`, `connect_four_bot`, `checkpoint:<folder>`, default every bot that plays the game), `score` (`return`, `win` or `non_loss`: what a game counts for in the returns), `seed`, `temperature` (text games) | text games: its games, published on `relay.<run>.eval.games` for the tracker's `runs/<id>/games.jsonl` |
//!
//! A `vs-opponent` evaluation reports its results per opponent and seat
//! (`EvalReport::matchups`). A text run is judged by the mean of every
//! game; a game on observations by its weakest matchup
//! ([`crate::weakest_matchup`]), so it is solved only when the policy
//! reaches the threshold against every opponent from every seat.
//!
//! Classic plugins evaluate weights versions of the MLP policy on a
//! blocking thread ([`Evaluator::evaluate`]), which the context's
//! [`Cancel`] stops between two steps (and in any wait on Python workers):
//! the evaluator sets it when it is asked to stop, so that an episode of
//! thousands of steps does not hold up its shutdown; text-game plugins
//! ([`Evaluator::plays_text`]) play asynchronously over NATS
//! ([`Evaluator::evaluate_text`]). [`Evaluator::check_env`] refuses a plugin
//! that cannot evaluate the run's env.
//!
//! An unknown plugin name or option is an error naming it.
//!
//! # Layout
//!
//! This file holds what every plugin shares: the [`Evaluator`] trait, what
//! a plugin is given ([`EvalContext`], [`TextEvalContext`]) and returns
//! ([`EvalOutcome`]), the [`registry`] and the [`Options`] every plugin
//! parses. Each plugin has its own file: `greedy.rs`, `stochastic.rs`,
//! `threshold.rs`, `record.rs` and `vs_opponent.rs` (with [`Score`]).
//! Playing episodes on vectorized envs is no plugin's own: it lives in
//! [`crate::play`] (the command line plays through it too) and is
//! re-exported here, so `plugins::play` and `plugins::eval_envs` stay.

mod greedy;
mod record;
mod stochastic;
mod threshold;
mod vs_opponent;

use std::path::PathBuf;

use futures::future::BoxFuture;
pub use relay_bridge::Cancel;
use relay_bridge::EnvSection;
use relay_config::TextConfig;
use relay_policy::text::NatsGenerate;
use relay_policy::VersionedPolicy;
use relay_proto::{GameRecord, Matchup};

pub use crate::play::{
    cancellable_eval_envs, eval_envs, play, play_against, Episode, EvalEnvs, Trajectory,
    MAX_EVAL_ENVS, STOPPED,
};
pub use greedy::Greedy;
pub use record::Record;
pub use stochastic::Stochastic;
pub use threshold::Threshold;
pub use vs_opponent::{outcome_of_return, Score, VsOpponent};

/// What a plugin knows about the run when it evaluates.
#[derive(Debug, Clone)]
pub struct EvalContext {
    pub env_id: String,
    /// `eval.episodes`, unless the plugin's `episodes` option says otherwise.
    pub episodes: usize,
    /// `eval.seed`, unless the plugin's `seed` option says otherwise.
    pub seed: u64,
    /// `runs/<run-id>`.
    pub run_dir: PathBuf,
    /// Mean return of the latest training episodes (up to 100), if any arrived.
    pub train_return: Option<f64>,
    /// A confirmation: `episodes` and `seed` are the confirmation's and
    /// the plugin's own `episodes` and `seed` options do not apply.
    pub confirming: bool,
    /// The `env` section: how `env_id` is made.
    pub env: EnvSection,
    /// Set when the evaluation must stop (the evaluator stops): [`play`]
    /// then ends with [`STOPPED`] at its next step.
    pub cancel: Cancel,
}

impl EvalContext {
    /// The run's envs to [`play`] `episodes` episodes on ([`eval_envs`]),
    /// stopped by the context's [`Cancel`].
    pub fn envs(&self, episodes: usize, seed: u64) -> Result<EvalEnvs, String> {
        cancellable_eval_envs(&self.env_id, &self.env, episodes, seed, &self.cancel)
    }
}

/// What a text-game plugin needs to play: the run's game, how model seats
/// generate, and the learning adapter version it evaluates.
#[derive(Clone)]
pub struct TextEvalContext {
    /// A text game id: the run's `run.env_id`.
    pub env_id: String,
    /// Every game of the run with a positive `text.games` weight (the
    /// run's `env_id` alone in single-game runs); `vs-opponent` plays each.
    pub game_ids: Vec<String>,
    /// `eval.episodes`: games per opponent unless the plugin says otherwise.
    pub games: usize,
    /// `eval.seed`, unless the plugin's `seed` option says otherwise.
    pub seed: u64,
    /// A confirmation: `games` and `seed` are the confirmation's and the
    /// plugin's own `games` and `seed` options do not apply.
    pub confirming: bool,
    /// The learning adapter version every game plays (its seats ask the
    /// inference servers for exactly this version); `None`: the newest.
    pub version: Option<u64>,
    /// The run's `text` section (bots, sampling, `games_in_flight`).
    pub text: TextConfig,
    /// The run's `env` section: where its games come from.
    pub env: EnvSection,
    /// Generate requests to the inference servers.
    pub generator: NatsGenerate,
    /// Recorded as each game's runner.
    pub instance: String,
}

/// The result of one evaluation.
#[derive(Debug, Clone, PartialEq)]
pub enum EvalOutcome {
    /// Episodes played: their returns (published as an `EvalReport`).
    Returns(Vec<f64>),
    /// Games against opponents played (`vs-opponent`): the policy's
    /// rewards (or scores, its `score` option), its results per opponent
    /// and seat, the oldest adapter version that moved (text games, when
    /// the inference servers reported one; the evaluated version in games
    /// on observations), and the text games themselves (the evaluator
    /// publishes them for the run directory's `games.jsonl`).
    Games {
        returns: Vec<f64>,
        matchups: Vec<Matchup>,
        /// The matchup (index into `matchups`) of each return.
        matchup_of: Vec<usize>,
        policy_version: Option<u64>,
        played: Vec<OpponentGame>,
    },
    /// Nothing played (and nothing published), with the reason.
    Skipped(String),
}

/// A game a text evaluation finished, with the plugin's name for its
/// opponent (a matchup's `opponent`).
#[derive(Debug, Clone, PartialEq)]
pub struct OpponentGame {
    pub opponent: String,
    pub record: GameRecord,
}

/// An evaluator plugin.
pub trait Evaluator: Send + Sync {
    /// The registry name, reported as `EvalReport::evaluator`.
    fn name(&self) -> &str;
    /// Evaluates one policy version (runs on a blocking thread).
    fn evaluate(&self, policy: &VersionedPolicy, ctx: &EvalContext) -> Result<EvalOutcome, String>;
    /// Plays text games (with [`Evaluator::evaluate_text`]) rather than
    /// classic-control episodes.
    fn plays_text(&self) -> bool {
        false
    }
    /// Acts by sampling the policy's distribution rather than taking its
    /// mode (what `relay eval checkpoint` does to judge a saved checkpoint
    /// as the run's evaluator judged its versions).
    fn samples_actions(&self) -> bool {
        false
    }
    /// Checks that this plugin can evaluate runs of `env_id` (made as the
    /// `env` section says).
    fn check_env(&self, env_id: &str, env: &EnvSection) -> Result<(), String> {
        match (self.plays_text(), env.is_text_game(env_id)) {
            (false, true) => Err(format!(
                "evaluator {} plays classic-control envs, not the text game {env_id}; use vs-opponent",
                self.name()
            )),
            (true, false) => Err(format!(
                "evaluator {} plays text games, not {env_id}",
                self.name()
            )),
            _ => Ok(()),
        }
    }
    /// What the plugin will do in a run of `config`, in one line for the
    /// user starting it (`relay up` prints it).
    fn describe(&self, config: &relay_config::ExperimentConfig) -> String {
        format!(
            "{}, {} episodes{}",
            self.name(),
            config.eval.episodes,
            if self.samples_actions() {
                " (sampled actions)"
            } else {
                ""
            }
        )
    }
    /// Evaluates the learning adapter in text games (asynchronously).
    fn evaluate_text<'a>(
        &'a self,
        _ctx: &'a TextEvalContext,
    ) -> BoxFuture<'a, Result<EvalOutcome, String>> {
        let name = self.name().to_string();
        Box::pin(async move { Err(format!("evaluator {name} does not play text games")) })
    }
}

/// Builds a plugin from its options.
pub type Factory = fn(Options) -> Result<Box<dyn Evaluator>, String>;

/// Every plugin by name.
pub fn registry() -> Vec<(&'static str, Factory)> {
    vec![
        ("greedy", Greedy::build as Factory),
        ("stochastic", Stochastic::build),
        ("threshold", Threshold::build),
        ("record", Record::build),
        ("vs-opponent", VsOpponent::build),
    ]
}

/// Builds plugin `name` with `options`; errors name the plugin or option.
pub fn build(name: &str, options: &[(String, String)]) -> Result<Box<dyn Evaluator>, String> {
    let registry = registry();
    let Some((_, factory)) = registry.iter().find(|(n, _)| *n == name) else {
        let known: Vec<&str> = registry.iter().map(|(n, _)| *n).collect();
        return Err(format!("unknown evaluator {name:?}; known: {known:?}"));
    };
    factory(Options::new(name, options))
}

/// Plugin options: each plugin takes what it knows, then [`Options::finish`]
/// refuses the rest.
pub struct Options {
    plugin: String,
    pairs: Vec<(String, String)>,
}

impl Options {
    pub fn new(plugin: &str, pairs: &[(String, String)]) -> Self {
        Self {
            plugin: plugin.to_string(),
            pairs: pairs.to_vec(),
        }
    }

    fn take(&mut self, key: &str) -> Option<String> {
        let i = self.pairs.iter().position(|(k, _)| k == key)?;
        Some(self.pairs.remove(i).1)
    }

    fn parse<T: std::str::FromStr>(&mut self, key: &str) -> Result<Option<T>, String>
    where
        T::Err: std::fmt::Display,
    {
        self.take(key)
            .map(|v| {
                v.trim()
                    .parse::<T>()
                    .map_err(|e| format!("evaluator {}: option {key}={v:?}: {e}", self.plugin))
            })
            .transpose()
    }

    /// The options every plugin takes.
    fn common(&mut self) -> Result<Common, String> {
        let episodes: Option<usize> = self.parse("episodes")?;
        if episodes == Some(0) {
            return Err(format!(
                "evaluator {}: option episodes must be positive",
                self.plugin
            ));
        }
        Ok(Common {
            episodes,
            seed: self.parse("seed")?,
        })
    }

    fn finish(self) -> Result<(), String> {
        match self.pairs.first() {
            None => Ok(()),
            Some((k, _)) => Err(format!(
                "evaluator {}: unknown option {k:?} (known: {})",
                self.plugin,
                match self.plugin.as_str() {
                    "threshold" => "episodes, seed, level",
                    "vs-opponent" => "games, opponents, seed",
                    _ => "episodes, seed",
                }
            )),
        }
    }
}

#[derive(Debug, Clone, Copy, Default)]
struct Common {
    episodes: Option<usize>,
    seed: Option<u64>,
}

impl Common {
    fn apply(&self, ctx: &EvalContext) -> (usize, u64) {
        if ctx.confirming {
            return (ctx.episodes, ctx.seed);
        }
        (
            self.episodes.unwrap_or(ctx.episodes),
            self.seed.unwrap_or(ctx.seed),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn registry_builds_each_plugin_and_refuses_unknown_names_and_options() {
        for (name, _) in registry() {
            let opts: Vec<(String, String)> = if name == "threshold" {
                vec![("level".into(), "10".into())]
            } else {
                vec![]
            };
            assert_eq!(build(name, &opts).unwrap().name(), name);
        }
        let err = build("nope", &[]).err().unwrap();
        assert!(err.contains("nope") && err.contains("greedy"), "{err}");
        let err = build("greedy", &[("colour".into(), "red".into())])
            .err()
            .unwrap();
        assert!(err.contains("colour"), "{err}");
        let err = build("threshold", &[]).err().unwrap();
        assert!(err.contains("level"), "{err}");
        let err = build("greedy", &[("episodes".into(), "x".into())])
            .err()
            .unwrap();
        assert!(err.contains("episodes"), "{err}");
    }
}
