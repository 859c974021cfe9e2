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

use std::io::Write;
use std::path::PathBuf;

use futures::future::BoxFuture;
use futures::StreamExt;
use rand::SeedableRng;
pub use relay_bridge::Cancel;
use relay_bridge::{EnvSection, VecEnvs};
use relay_config::{Opponent, TextConfig};
use relay_envs::{ActionSpace, VecActions};
use relay_nn::{Actions, VecNormalize};
use relay_policy::opponent::SeatOpponent;
use relay_policy::text::{
    arrange, play_game, GameError, GameSettings, GameSpec, NatsGenerate, Outcome, Seat,
    LEARNING_ADAPTER,
};
use relay_policy::VersionedPolicy;
use relay_proto::{GameRecord, Matchup};

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

/// Deterministic episodes (today's evaluation).
pub struct Greedy(Common);
impl Greedy {
    fn build(mut o: Options) -> Result<Box<dyn Evaluator>, String> {
        let c = o.common()?;
        o.finish()?;
        Ok(Box::new(Self(c)))
    }
}
impl Evaluator for Greedy {
    fn name(&self) -> &str {
        "greedy"
    }
    fn evaluate(&self, p: &VersionedPolicy, ctx: &EvalContext) -> Result<EvalOutcome, String> {
        let (episodes, seed) = self.0.apply(ctx);
        let eps = play(
            &p.model,
            p.normalizer.as_ref(),
            ctx.envs(episodes, seed)?,
            seed,
            true,
            false,
        )?;
        Ok(EvalOutcome::Returns(eps.iter().map(|e| e.ret).collect()))
    }
}

/// Episodes with sampled actions.
pub struct Stochastic(Common);
impl Stochastic {
    fn build(mut o: Options) -> Result<Box<dyn Evaluator>, String> {
        let c = o.common()?;
        o.finish()?;
        Ok(Box::new(Self(c)))
    }
}
impl Evaluator for Stochastic {
    fn name(&self) -> &str {
        "stochastic"
    }
    fn samples_actions(&self) -> bool {
        true
    }
    fn evaluate(&self, p: &VersionedPolicy, ctx: &EvalContext) -> Result<EvalOutcome, String> {
        let (episodes, seed) = self.0.apply(ctx);
        let eps = play(
            &p.model,
            p.normalizer.as_ref(),
            ctx.envs(episodes, seed)?,
            seed,
            false,
            false,
        )?;
        Ok(EvalOutcome::Returns(eps.iter().map(|e| e.ret).collect()))
    }
}

/// Deterministic episodes once the training return reaches `level`.
pub struct Threshold {
    common: Common,
    level: f64,
}
impl Threshold {
    fn build(mut o: Options) -> Result<Box<dyn Evaluator>, String> {
        let common = o.common()?;
        let level: f64 = o
            .parse("level")?
            .ok_or_else(|| "evaluator threshold: option level is required".to_string())?;
        if !level.is_finite() {
            return Err("evaluator threshold: option level must be finite".into());
        }
        o.finish()?;
        Ok(Box::new(Self { common, level }))
    }
}
impl Evaluator for Threshold {
    fn name(&self) -> &str {
        "threshold"
    }
    fn evaluate(&self, p: &VersionedPolicy, ctx: &EvalContext) -> Result<EvalOutcome, String> {
        match ctx.train_return {
            Some(r) if r >= self.level => {
                let (episodes, seed) = self.common.apply(ctx);
                let eps = play(
                    &p.model,
                    p.normalizer.as_ref(),
                    ctx.envs(episodes, seed)?,
                    seed,
                    true,
                    false,
                )?;
                Ok(EvalOutcome::Returns(eps.iter().map(|e| e.ret).collect()))
            }
            other => Ok(EvalOutcome::Skipped(format!(
                "training return {} below level {}",
                other.map_or("(none yet)".into(), |r| format!("{r:.1}")),
                self.level
            ))),
        }
    }
}

/// Deterministic episodes, each written as a trajectory.
pub struct Record(Common);
impl Record {
    fn build(mut o: Options) -> Result<Box<dyn Evaluator>, String> {
        let c = o.common()?;
        o.finish()?;
        Ok(Box::new(Self(c)))
    }
}
impl Evaluator for Record {
    fn name(&self) -> &str {
        "record"
    }
    fn evaluate(&self, p: &VersionedPolicy, ctx: &EvalContext) -> Result<EvalOutcome, String> {
        let (episodes, seed) = self.0.apply(ctx);
        let eps = play(
            &p.model,
            p.normalizer.as_ref(),
            ctx.envs(episodes, seed)?,
            seed,
            true,
            true,
        )?;
        let dir = ctx.run_dir.join("recordings");
        std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        let name = format!(
            "v{}{}.jsonl",
            p.version,
            if ctx.confirming { ".confirmation" } else { "" }
        );
        let path = dir.join(&name);
        let tmp = dir.join(format!(".{name}.tmp"));
        let mut out = std::io::BufWriter::new(
            std::fs::File::create(&tmp).map_err(|e| format!("{}: {e}", tmp.display()))?,
        );
        for (i, e) in eps.iter().enumerate() {
            let t = e.trajectory.as_ref().expect("recorded");
            let line = serde_json::json!({
                "policy_version": p.version,
                "episode": i,
                "return": e.ret,
                "obs": t.obs,
                "actions": t.actions,
                "rewards": t.rewards,
                "terminated": t.terminated,
                "truncated": t.truncated,
            });
            writeln!(out, "{line}").map_err(|e| format!("{}: {e}", tmp.display()))?;
        }
        out.flush().map_err(|e| format!("{}: {e}", tmp.display()))?;
        drop(out);
        std::fs::rename(&tmp, &path).map_err(|e| format!("{}: {e}", path.display()))?;
        Ok(EvalOutcome::Returns(eps.iter().map(|e| e.ret).collect()))
    }
}

/// The policy against each opponent, the games shared out among the seats
/// (`vs-opponent`). Text games: the learning adapter, in each game of the
/// run (`text.games`; an opponent is skipped for a game it does not play,
/// and the results are per game, opponent and seat), half of the games in
/// each seat. Multi-agent games on observations (PettingZoo's): the
/// version's greedy policy, game `e` from seat `e % seats`, against the
/// fixed opponents ([`SeatOpponent`]).
pub struct VsOpponent {
    games: Option<usize>,
    /// The names as given: text opponents ([`Opponent`]) or, in games on
    /// observations, bots and `checkpoint:<folder>`.
    opponents: Option<Vec<String>>,
    seed: Option<u64>,
    /// Sampling temperature of the evaluated moves (0: greedy); default
    /// the run's `text.temperature`, as in training. Text games only.
    temperature: Option<f32>,
    /// What each game counts for in the report's returns.
    score: Score,
}

/// What a `vs-opponent` game counts for (its `score` option): the policy's
/// reward (`return`, the default), 1 for a win and 0 otherwise (`win`), or
/// 1 for a win or a draw (`non_loss`). With `win` or `non_loss` the
/// evaluation's mean is a rate, and `eval.threshold` a rate to reach.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Score {
    Return,
    Win,
    NonLoss,
}

impl Score {
    fn parse(text: &str) -> Result<Self, String> {
        match text.trim() {
            "return" => Ok(Self::Return),
            "win" => Ok(Self::Win),
            "non_loss" => Ok(Self::NonLoss),
            other => Err(format!(
                "evaluator vs-opponent: option score {other:?}: expected return, win or non_loss"
            )),
        }
    }

    /// The score of a game the policy ended with `outcome` and `reward`.
    pub fn of(self, outcome: Outcome, reward: f64) -> f64 {
        match self {
            Self::Return => reward,
            Self::Win => f64::from(u8::from(outcome == Outcome::Win)),
            Self::NonLoss => f64::from(u8::from(outcome != Outcome::Loss)),
        }
    }
}

/// The outcome of a game on observations from the policy's return: a win
/// above 0, a loss below (PettingZoo's classic games give +1 / -1 / 0).
pub fn outcome_of_return(ret: f64) -> Outcome {
    match ret {
        r if r > 0.0 => Outcome::Win,
        r if r < 0.0 => Outcome::Loss,
        _ => Outcome::Draw,
    }
}

/// Whether `name` is a fixed opponent of games on observations (a bot of
/// [`relay_envs::SEAT_BOT_NAMES`] or `checkpoint:<folder>`).
fn seat_opponent_name(name: &str) -> bool {
    relay_envs::SEAT_BOT_NAMES.contains(&name) || relay_config::checkpoint_opponent(name).is_some()
}

impl VsOpponent {
    fn build(mut o: Options) -> Result<Box<dyn Evaluator>, String> {
        let games: Option<usize> = o.parse("games")?;
        if games == Some(0) {
            return Err("evaluator vs-opponent: option games must be positive".into());
        }
        let opponents = o
            .take("opponents")
            .map(|list| {
                let names: Vec<String> = list
                    .split(',')
                    .map(str::trim)
                    .filter(|s| !s.is_empty())
                    .map(String::from)
                    .collect();
                if names.is_empty() {
                    return Err("evaluator vs-opponent: option opponents is empty".to_string());
                }
                for name in &names {
                    if let (Err(e), false) = (Opponent::parse(name), seat_opponent_name(name)) {
                        return Err(format!(
                            "evaluator vs-opponent: option opponents: {e} (games on observations: {}, checkpoint:<folder>)",
                            relay_envs::SEAT_BOT_NAMES.join(", ")
                        ));
                    }
                }
                Ok(names)
            })
            .transpose()?;
        let seed = o.parse("seed")?;
        let temperature: Option<f32> = o.parse("temperature")?;
        if temperature.is_some_and(|t| !(t.is_finite() && t >= 0.0)) {
            return Err("evaluator vs-opponent: option temperature must be finite and >= 0".into());
        }
        let score = o
            .take("score")
            .map_or(Ok(Score::Return), |text| Score::parse(&text))?;
        o.finish()?;
        Ok(Box::new(Self {
            games,
            opponents,
            seed,
            temperature,
            score,
        }))
    }

    /// The text opponents: the option, else `random` plus the game's
    /// strong bot; in a game that lists no legal moves (some of
    /// TextArena's), where the random bot cannot move, `base`: the base
    /// model without adapter, the policy's first version (a new LoRA
    /// adapter is zero).
    fn opponents(
        &self,
        env_id: &str,
        env: &EnvSection,
        lists_moves: bool,
    ) -> Result<Vec<Opponent>, String> {
        if let Some(list) = &self.opponents {
            return list
                .iter()
                .map(|name| Opponent::parse(name))
                .collect::<Result<_, _>>()
                .map_err(|e| format!("evaluator vs-opponent: option opponents: {e}"));
        }
        let mut list = vec![if lists_moves {
            Opponent::Bot("random".into())
        } else {
            Opponent::Base
        }];
        for bot in ["minimax", "connect_four_bot"] {
            if relay_config::bot_plays(bot, env_id, env) {
                list.push(Opponent::Bot(bot.into()));
            }
        }
        Ok(list)
    }

    /// The opponents of a game on observations of `spec`: the option, else
    /// `random` plus each other bot that plays the game (`minimax` in
    /// TicTacToe).
    fn seat_opponents(&self, spec: &relay_envs::EnvSpec) -> Vec<String> {
        match &self.opponents {
            Some(list) => list.clone(),
            None => relay_envs::SEAT_BOT_NAMES
                .iter()
                .filter(|name| relay_envs::SeatBot::plays(name, spec))
                .map(|name| name.to_string())
                .collect(),
        }
    }

    /// The opponents of a multi-agent game on observations, each made (a
    /// checkpoint loaded); an error names the env when it is not such a
    /// game, or the opponent that cannot play it. `cancel` cuts short the
    /// wait for the game's spec (a Python worker, the first time).
    fn made_seat_opponents(
        &self,
        env_id: &str,
        env: &EnvSection,
        cancel: &Cancel,
    ) -> Result<(relay_envs::EnvSpec, Vec<(String, SeatOpponent)>), String> {
        let spec = relay_bridge::cancellable_spec(env_id, env, cancel).map_err(|e| match e {
            relay_bridge::BridgeError::Cancelled { .. } => STOPPED.to_string(),
            e => e.to_string(),
        })?;
        if spec.agents.is_empty() {
            return Err(format!(
                "evaluator vs-opponent plays text games and multi-agent games (env.backend: pettingzoo), not {env_id}"
            ));
        }
        let opponents = self
            .seat_opponents(&spec)
            .into_iter()
            .map(|name| {
                let opponent = SeatOpponent::new(&name, &spec)
                    .map_err(|e| format!("evaluator vs-opponent: option opponents: {e}"))?;
                Ok((name, opponent))
            })
            .collect::<Result<_, String>>()?;
        Ok((spec, opponents))
    }
}

/// Whether the random bot can play `game`: it lists its legal moves.
fn lists_legal_moves(game: &mut dyn relay_envs::TextGame) -> bool {
    game.reset(0);
    !game.legal_moves().is_empty()
}

/// `random` needs the legal moves; a game that lists none refuses it by name.
fn check_opponent(
    opponent: &Opponent,
    game_id: &str,
    env: &EnvSection,
    lists_moves: bool,
) -> Result<(), String> {
    opponent.check_game(game_id, env)?;
    match opponent {
        Opponent::Bot(name) if name == "random" && !lists_moves => Err(format!(
            "the random bot needs the legal moves, and {game_id} lists none in its observation; \
             evaluate against `base` (the policy's first version) or `adapter:<name>`"
        )),
        _ => Ok(()),
    }
}

/// A seat of the learning adapter asks for `version` (when set): an
/// evaluation plays one version, not whatever is newest move by move.
fn pin(seat: Seat, version: Option<u64>) -> Seat {
    match seat {
        Seat::Model(Some(adapter)) if adapter.name == LEARNING_ADAPTER && version.is_some() => {
            Seat::Model(Some(relay_proto::AdapterRef { version, ..adapter }))
        }
        other => other,
    }
}

/// One game of an evaluation.
struct EvalGame {
    /// Index into the matchups.
    matchup: usize,
    spec: GameSpec,
}

impl Evaluator for VsOpponent {
    fn name(&self) -> &str {
        "vs-opponent"
    }

    /// A multi-agent game on observations: the version's greedy policy
    /// against each opponent on the same games (seeds), game `e` from seat
    /// `e % seats`.
    fn evaluate(&self, p: &VersionedPolicy, ctx: &EvalContext) -> Result<EvalOutcome, String> {
        let (spec, opponents) = self.made_seat_opponents(&ctx.env_id, &ctx.env, &ctx.cancel)?;
        let (games, seed) = if ctx.confirming {
            (ctx.episodes, ctx.seed)
        } else {
            (
                self.games.unwrap_or(ctx.episodes),
                self.seed.unwrap_or(ctx.seed),
            )
        };
        let seats = spec.agents.len();
        if games < seats {
            return Err(format!(
                "evaluator vs-opponent: {games} games leave a seat of {} unplayed; play at least {seats}",
                ctx.env_id
            ));
        }
        let mut returns = Vec::with_capacity(games * opponents.len());
        let mut matchup_of = Vec::with_capacity(games * opponents.len());
        let mut matchups = Vec::new();
        for (name, mut opponent) in opponents {
            let episodes = play_against(
                &p.model,
                p.normalizer.as_ref(),
                ctx.envs(games, seed)?,
                seed,
                true,
                false,
                Some(&mut opponent),
            )?;
            let first = matchups.len();
            matchups.extend((0..seats).map(|seat| Matchup {
                opponent: name.clone(),
                seat: seat as u8,
                game: ctx.env_id.clone(),
                games: 0,
                wins: 0,
                draws: 0,
                losses: 0,
                abandoned: 0,
                moves: 0,
                invalid_moves: 0,
            }));
            for (e, episode) in episodes.iter().enumerate() {
                let index = first + e % seats;
                let m = &mut matchups[index];
                let outcome = outcome_of_return(episode.ret);
                match outcome {
                    Outcome::Win => m.wins += 1,
                    Outcome::Draw => m.draws += 1,
                    Outcome::Loss => m.losses += 1,
                }
                m.games += 1;
                returns.push(self.score.of(outcome, episode.ret));
                matchup_of.push(index);
            }
        }
        Ok(EvalOutcome::Games {
            returns,
            matchups,
            matchup_of,
            policy_version: Some(p.version),
            played: Vec::new(),
        })
    }

    fn plays_text(&self) -> bool {
        true
    }

    fn check_env(&self, env_id: &str, env: &EnvSection) -> Result<(), String> {
        if !env.is_text_game(env_id) {
            return self
                .made_seat_opponents(env_id, env, &Cancel::default())
                .map(drop);
        }
        let mut game = relay_bridge::make_text_game(env_id, env).map_err(|e| e.to_string())?;
        let lists_moves = lists_legal_moves(game.as_mut());
        for opponent in self.opponents(env_id, env, lists_moves)? {
            check_opponent(&opponent, env_id, env, lists_moves)
                .map_err(|e| format!("evaluator vs-opponent: option opponents: {e}"))?;
        }
        Ok(())
    }

    fn describe(&self, config: &relay_config::ExperimentConfig) -> String {
        let env = &config.env;
        let games = self.games.unwrap_or(config.eval.episodes);
        let score = match self.score {
            Score::Return => "",
            Score::Win => ", scored 1 a win",
            Score::NonLoss => ", scored 1 a win or a draw",
        };
        if !config.is_text_game() {
            let opponents = match config.env_spec() {
                Ok(spec) => self.seat_opponents(&spec).join(", "),
                Err(e) => format!("(the env does not open: {e})"),
            };
            return format!(
                "vs-opponent, {games} greedy games per opponent, game e from seat e % seats{score}: {} against {opponents}",
                config.run.env_id
            );
        }
        let per_game: Vec<String> = config
            .text
            .game_weights(&config.run.env_id)
            .into_iter()
            .map(|(game_id, _)| {
                let (players, lists_moves) = relay_bridge::make_text_game(&game_id, env)
                    .map(|mut game| (game.num_players(), lists_legal_moves(game.as_mut())))
                    .unwrap_or((2, true));
                if players == 1 {
                    return format!("{game_id} alone");
                }
                let opponents: Vec<String> = self
                    .opponents(&game_id, env, lists_moves)
                    .unwrap_or_default()
                    .iter()
                    .filter(|o| check_opponent(o, &game_id, env, lists_moves).is_ok())
                    .map(|o| match o {
                        Opponent::Base => {
                            "base (the base model: the policy's first version)".into()
                        }
                        other => other.label(),
                    })
                    .collect();
                let why = if !lists_moves && self.opponents.is_none() {
                    " (it lists no legal moves, so the random bot cannot play it)"
                } else {
                    ""
                };
                format!("{game_id} against {}{why}", opponents.join(", "))
            })
            .collect();
        format!(
            "vs-opponent, {games} games per opponent (half in each seat){score}: {}",
            per_game.join("; ")
        )
    }

    fn evaluate_text<'a>(
        &'a self,
        ctx: &'a TextEvalContext,
    ) -> BoxFuture<'a, Result<EvalOutcome, String>> {
        Box::pin(async move {
            self.check_env(&ctx.env_id, &ctx.env)?;
            let game_ids = if ctx.game_ids.is_empty() {
                vec![ctx.env_id.clone()]
            } else {
                ctx.game_ids.clone()
            };
            let (games, seed) = if ctx.confirming {
                (ctx.games, ctx.seed)
            } else {
                (
                    self.games.unwrap_or(ctx.games),
                    self.seed.unwrap_or(ctx.seed),
                )
            };
            // Each game of the run against each opponent that plays it;
            // the same game seeds against every opponent; the first half
            // of the games in seat 0, the rest in seat 1.
            let mut matchups: Vec<Matchup> = Vec::new();
            let mut planned = Vec::new();
            for game_id in &game_ids {
                if !ctx.env.is_text_game(game_id) {
                    return Err(format!(
                        "evaluator vs-opponent plays text games, not {game_id}"
                    ));
                }
                let mut game =
                    relay_bridge::make_text_game(game_id, &ctx.env).map_err(|e| e.to_string())?;
                let players = game.num_players();
                let lists_moves = lists_legal_moves(game.as_mut());
                let opponents: Vec<Option<Opponent>> = if players == 1 {
                    vec![None]
                } else {
                    let listed = self.opponents(game_id, &ctx.env, lists_moves)?;
                    let playing: Vec<Option<Opponent>> = listed
                        .iter()
                        .filter(|o| check_opponent(o, game_id, &ctx.env, lists_moves).is_ok())
                        .cloned()
                        .map(Some)
                        .collect();
                    if playing.is_empty() {
                        let names: Vec<String> = listed.iter().map(Opponent::label).collect();
                        return Err(format!(
                            "evaluator vs-opponent: option opponents: none of {} plays {game_id}",
                            names.join(", ")
                        ));
                    }
                    playing
                };
                for opponent in &opponents {
                    let label = opponent.as_ref().map_or("none".into(), Opponent::label);
                    for i in 0..games {
                        let seat = if players == 1 {
                            0
                        } else {
                            usize::from(i >= games.div_ceil(2))
                        };
                        let matchup = match matchups.iter().position(|m| {
                            m.opponent == label && m.seat as usize == seat && &m.game == game_id
                        }) {
                            Some(index) => index,
                            None => {
                                matchups.push(Matchup {
                                    opponent: label.clone(),
                                    seat: seat as u8,
                                    game: game_id.clone(),
                                    games: 0,
                                    wins: 0,
                                    draws: 0,
                                    losses: 0,
                                    abandoned: 0,
                                    moves: 0,
                                    invalid_moves: 0,
                                });
                                matchups.len() - 1
                            }
                        };
                        let game_seed = seed.wrapping_add(i as u64);
                        let learner = pin(Seat::learner(&ctx.text, game_seed)?, ctx.version);
                        let seats = arrange(
                            learner,
                            || match opponent {
                                Some(o) => Seat::opponent(o, game_seed ^ 0x5eed, &ctx.text)
                                    .map(|s| pin(s, ctx.version)),
                                None => Err("a single-player game has no opponent".into()),
                            },
                            players,
                            seat,
                        )?;
                        planned.push(EvalGame {
                            matchup,
                            spec: GameSpec {
                                env_id: game_id.clone(),
                                seed: game_seed,
                                seats,
                                learner_seat: Some(seat),
                                runner_id: ctx.instance.clone(),
                            },
                        });
                    }
                }
            }
            let mut settings = GameSettings::from_config(&ctx.text, &ctx.env);
            if let Some(temperature) = self.temperature {
                settings.sampling.temperature = temperature;
            }
            let results: Vec<_> = futures::stream::iter(planned.into_iter().map(|g| {
                let settings = &settings;
                async move { (g.matchup, play_game(&ctx.generator, g.spec, settings).await) }
            }))
            .buffered(ctx.text.games_in_flight.max(1))
            .collect()
            .await;
            let mut returns = Vec::new();
            let mut matchup_of = Vec::new();
            let mut policy_version: Option<u64> = None;
            let mut played = Vec::new();
            for (index, result) in results {
                let m = &mut matchups[index];
                let game = match result {
                    Ok(game) => game,
                    Err(GameError::Abandoned { .. }) => {
                        m.abandoned += 1;
                        continue;
                    }
                    Err(e) => return Err(e.to_string()),
                };
                let outcome = game.outcome().expect("learner seat set");
                match outcome {
                    Outcome::Win => m.wins += 1,
                    Outcome::Draw => m.draws += 1,
                    Outcome::Loss => m.losses += 1,
                }
                m.games += 1;
                let learning = game.learning_seats();
                for turn in &game.record.turns {
                    if learning.contains(&(turn.player as usize)) {
                        m.moves += 1;
                        m.invalid_moves += u32::from(turn.invalid);
                        if let Some(v) = turn.adapter.as_ref().and_then(|a| a.version) {
                            policy_version = Some(policy_version.map_or(v, |p| p.min(v)));
                        }
                    }
                }
                returns.push(
                    self.score
                        .of(outcome, game.learner_reward().expect("learner seat set")),
                );
                matchup_of.push(index);
                played.push(OpponentGame {
                    opponent: m.opponent.clone(),
                    record: game.record,
                });
            }
            if returns.is_empty() {
                return Ok(EvalOutcome::Skipped(format!(
                    "all {} games abandoned (no usable replies from the inference servers)",
                    matchups.iter().map(|m| m.abandoned).sum::<u32>()
                )));
            }
            Ok(EvalOutcome::Games {
                returns,
                matchups,
                matchup_of,
                policy_version,
                played,
            })
        })
    }
}

/// One episode's steps: observation before each step, action (a list of
/// numbers: one for discrete spaces), reward, terminated, truncated.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Trajectory {
    pub obs: Vec<Vec<f32>>,
    pub actions: Vec<Vec<f64>>,
    pub rewards: Vec<f64>,
    pub terminated: Vec<bool>,
    pub truncated: Vec<bool>,
}

/// A played episode.
#[derive(Debug, Clone, PartialEq)]
pub struct Episode {
    pub ret: f64,
    pub trajectory: Option<Trajectory>,
}

/// Most envs an evaluation steps at once. An evaluation of more episodes
/// plays them in turn on these: a Python env takes milliseconds to make
/// (Taxi's transition table: 4.4 ms), so one env per episode made a
/// 3,000-episode confirmation spend 13 s making envs.
pub const MAX_EVAL_ENVS: usize = 64;

/// The envs an evaluation of `episodes` episodes plays on ([`eval_envs`]).
#[derive(Debug)]
pub struct EvalEnvs {
    envs: VecEnvs,
    episodes: usize,
    cancel: Cancel,
}

/// What [`play`] returns when its [`Cancel`] stopped it.
pub const STOPPED: &str = "evaluation stopped (the evaluator is stopping)";

/// The envs [`play`] plays `episodes` episodes on: `min(episodes,
/// MAX_EVAL_ENVS)` copies of `env_id`, env `i` seeded from `(seed, i)`.
pub fn eval_envs(
    env_id: &str,
    section: &EnvSection,
    episodes: usize,
    seed: u64,
) -> Result<EvalEnvs, String> {
    cancellable_eval_envs(env_id, section, episodes, seed, &Cancel::default())
}

/// [`eval_envs`] that `cancel` stops: their start, and [`play`] on them
/// at its next step, end with [`STOPPED`].
pub fn cancellable_eval_envs(
    env_id: &str,
    section: &EnvSection,
    episodes: usize,
    seed: u64,
    cancel: &Cancel,
) -> Result<EvalEnvs, String> {
    let stopped = |e: relay_bridge::BridgeError| match e {
        relay_bridge::BridgeError::Cancelled { .. } => STOPPED.to_string(),
        e => e.to_string(),
    };
    // A parallel game of a team of agents is one episode on as many envs.
    let team = relay_bridge::cancellable_spec(env_id, section, cancel)
        .map_err(stopped)?
        .team
        .len()
        .max(1);
    let games = episodes.clamp(1, (MAX_EVAL_ENVS / team).max(1));
    let envs =
        VecEnvs::cancellable(env_id, section, games * team, seed, cancel).map_err(stopped)?;
    Ok(EvalEnvs {
        envs,
        episodes,
        cancel: cancel.clone(),
    })
}

/// Plays the episodes of `envs` ([`eval_envs`]) with deterministic or sampled actions (drawn from `seed`), recording
/// trajectories if asked. Env `i` of `n` plays episodes `i`, `i + n`,
/// `i + 2n`, ... in its own order: the first from its seed, the next ones
/// from its autoreset, so which episodes count never depends on how long
/// they last, and the same `(episodes, seed)` gives the same start states.
/// A Python env fault abandons the evaluation (its episodes would not be
/// the ones asked for), and so does the envs' [`Cancel`] ([`STOPPED`],
/// checked before each step).
///
/// With a `normalizer` (the weights version's, runs with a `normalize`
/// section) the model is given normalised observations; the normaliser is
/// only read (frozen, as SB3 evaluates with `training = False`), and the
/// returns and recorded observations and rewards are the env's raw ones.
pub fn play<M: relay_policy::Act>(
    model: &M,
    normalizer: Option<&VecNormalize>,
    envs: EvalEnvs,
    seed: u64,
    deterministic: bool,
    record: bool,
) -> Result<Vec<Episode>, String> {
    play_against(model, normalizer, envs, seed, deterministic, record, None)
}

/// [`play`], in a multi-agent game against `opponent` (`None`: the
/// random-legal bot): episode `e` is played from seat `e % seats`, the
/// opponent holding the other seats, and its return is that seat's. In a
/// parallel game played by one shared policy an episode is a game (its
/// agents' envs), its return the team's (a recording follows its first
/// agent).
pub fn play_against<M: relay_policy::Act>(
    model: &M,
    normalizer: Option<&VecNormalize>,
    envs: EvalEnvs,
    seed: u64,
    deterministic: bool,
    record: bool,
    opponent: Option<&mut SeatOpponent>,
) -> Result<Vec<Episode>, String> {
    let EvalEnvs {
        mut envs,
        episodes,
        cancel,
    } = envs;
    let stopped = |e: relay_bridge::BridgeError| match e {
        relay_bridge::BridgeError::Cancelled { .. } => STOPPED.to_string(),
        e => e.to_string(),
    };
    let num_envs = envs.num_envs();
    let spec = envs.spec().clone();
    // What plays an episode: an env, or the envs of a team's game.
    let team = spec.team.len().max(1);
    let units = num_envs / team;
    let env_id = spec.id;
    let obs_dim = envs.obs_dim();
    let mut obs = envs.reset().map_err(stopped)?.to_vec();
    let mut returns: Vec<Option<f64>> = vec![None; episodes];
    let mut unfinished = episodes;
    // The episode each env (or game) is playing: unit i's k-th is
    // i + k * units.
    let mut playing: Vec<usize> = (0..units).collect();
    let mut trajectories: Vec<Trajectory> =
        vec![Trajectory::default(); if record { episodes } else { 0 }];
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let mut clipped = Vec::new();
    let mut model_obs = obs.clone();
    // Multi-agent games: episode e is played from seat e % seats against
    // the opponent, by default the random-legal bot (the one self-play
    // trains against).
    let seats = spec.agents.len();
    let mut random_legal;
    let mut opponent = match (seats, opponent) {
        (0, _) => None,
        (_, Some(opponent)) => Some(opponent),
        (_, None) => {
            random_legal = SeatOpponent::new("random", &spec).map_err(|e| e.to_string())?;
            Some(&mut random_legal)
        }
    };
    let width = spec.action_space.n().unwrap_or(0);
    let all_legal = vec![1u8; num_envs * width];
    // A recurrent policy's state per env, zeroed as each episode starts.
    let state_width = model.state_width();
    if state_width > 0 && seats > 0 {
        return Err(format!(
            "{env_id} is a multi-agent game; recurrent policies play single-agent envs"
        ));
    }
    let mut state = vec![0f32; num_envs * state_width];
    while unfinished > 0 {
        // An episode can be thousands of steps (CarRacing's 1,000, a chess
        // game's hundreds of moves): a stop is seen between two of them.
        if cancel.is_cancelled() {
            return Err(STOPPED.into());
        }
        model_obs.copy_from_slice(&obs);
        if let Some(n) = normalizer {
            if let Some(i) = model_obs.iter().position(|x| !x.is_finite()) {
                return Err(format!(
                    "{env_id} returned a non-finite observation ({} at index {i})",
                    model_obs[i]
                ));
            }
            n.normalize_obs(&mut model_obs);
        }
        // Envs with action masks: the policy chooses among the legal actions.
        let masks = envs.masks().map(<[u8]>::to_vec);
        let out = model
            .act(
                &model_obs,
                num_envs,
                &mut state,
                masks.as_deref(),
                deterministic,
                &mut rng,
            )
            .map_err(|e| e.to_string())?;
        let mut out = out;
        let actions = &mut out.actions;
        let policy_moves: Vec<bool> = match (envs.movers(), opponent.as_deref_mut(), actions) {
            (Some(movers), Some(opponent), Actions::Discrete(a)) => {
                let mine: Vec<bool> = (0..num_envs)
                    .map(|i| movers[i] as usize == playing[i] % seats)
                    .collect();
                let rows: Vec<usize> = (0..num_envs).filter(|&i| !mine[i]).collect();
                if !rows.is_empty() {
                    let masks = masks.as_deref().unwrap_or(&all_legal);
                    let acted = opponent.act(
                        &relay_envs::gather_rows(&obs, obs_dim, &rows),
                        &relay_envs::gather_rows(masks, width, &rows),
                        rows.len(),
                        &mut rng,
                    )?;
                    for (&i, action) in rows.iter().zip(acted) {
                        a[i] = action;
                    }
                }
                mine
            }
            _ => vec![true; num_envs],
        };
        let step = match (&out.actions, &spec.action_space) {
            (Actions::Discrete(a), _) => envs.step(VecActions::Discrete(a)),
            (Actions::Continuous(a), ActionSpace::Box { low, high }) => {
                clipped.clear();
                clipped.extend(
                    a.iter()
                        .enumerate()
                        .map(|(i, v)| v.clamp(low[i % low.len()], high[i % low.len()])),
                );
                envs.step(VecActions::Continuous(&clipped))
            }
            (Actions::Continuous(_), ActionSpace::Discrete { .. }) => {
                return Err("continuous actions for a discrete env".into())
            }
        }
        .map_err(stopped)?;
        if record {
            for (unit, &episode) in playing.iter().enumerate() {
                let i = unit * team;
                let Some(t) = trajectories.get_mut(episode).filter(|_| policy_moves[i]) else {
                    continue;
                };
                t.obs.push(obs[i * obs_dim..(i + 1) * obs_dim].to_vec());
                t.actions.push(match &out.actions {
                    Actions::Discrete(a) => vec![a[i] as f64],
                    Actions::Continuous(a) => {
                        let width = a.len() / num_envs;
                        a[i * width..(i + 1) * width]
                            .iter()
                            .map(|&v| v as f64)
                            .collect()
                    }
                });
                t.rewards.push(step.rewards[i]);
                t.terminated.push(step.terminated[i]);
                t.truncated.push(step.truncated[i]);
            }
        }
        for e in &step.finished {
            state[e.env_index * state_width..(e.env_index + 1) * state_width].fill(0.0);
        }
        let ended: Vec<(usize, f64)> = if team > 1 {
            relay_envs::team_episodes(&step.finished, team)
                .iter()
                .map(|game| (game.game, game.team_return()))
                .collect()
        } else {
            // A multi-agent game's return is the policy's seat's.
            step.finished
                .iter()
                .map(|e| {
                    let ret = match step.seat_returns(e.env_index) {
                        Some(r) => r[playing[e.env_index] % seats],
                        None => e.episode_return,
                    };
                    (e.env_index, ret)
                })
                .collect()
        };
        for (unit, ret) in ended {
            let episode = &mut playing[unit];
            if let Some(slot) = returns.get_mut(*episode) {
                *slot = Some(ret);
                unfinished -= 1;
            }
            *episode += units;
        }
        obs.copy_from_slice(&step.obs);
    }
    Ok(returns
        .into_iter()
        .enumerate()
        .map(|(i, r)| Episode {
            ret: r.expect("every episode finished"),
            trajectory: record.then(|| std::mem::take(&mut trajectories[i])),
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use relay_nn::{ActorCritic, PolicySpec};

    /// Version 3 of an untrained CartPole policy.
    fn policy() -> VersionedPolicy {
        untrained(3, 4, 2)
    }

    /// Version `version` of an untrained policy of `obs_dim` observation
    /// values and `actions` discrete actions.
    fn untrained(version: u64, obs_dim: usize, actions: usize) -> VersionedPolicy {
        VersionedPolicy {
            version,
            learner_env_steps: 0,
            model: relay_policy::PolicyModel::ActorCritic(
                ActorCritic::new(&PolicySpec::discrete(obs_dim, actions), 1).unwrap(),
            ),
            normalizer: None,
        }
    }

    fn ctx(dir: &std::path::Path) -> EvalContext {
        EvalContext {
            env_id: "CartPole-v1".into(),
            episodes: 2,
            seed: 5,
            run_dir: dir.to_path_buf(),
            train_return: None,
            confirming: false,
            env: EnvSection::default(),
            cancel: Cancel::default(),
        }
    }

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

    /// `plugin` refuses `env_id`, naming it and `what`.
    fn refuses(plugin: &dyn Evaluator, env_id: &str, env: &EnvSection, what: &str) {
        let err = plugin.check_env(env_id, env).unwrap_err();
        assert!(err.contains(env_id) && err.contains(what), "{err}");
    }

    #[test]
    fn vs_opponent_checks_its_options_and_the_env() {
        let p = build(
            "vs-opponent",
            &[
                ("games".into(), "4".into()),
                ("opponents".into(), "random, minimax".into()),
                ("temperature".into(), "0".into()),
            ],
        )
        .unwrap();
        assert!(p.plays_text());
        p.check_env("TicTacToe-v0", &EnvSection::default()).unwrap();
        refuses(&*p, "ConnectFour-v0", &EnvSection::default(), "minimax");
        refuses(&*p, "CartPole-v1", &EnvSection::default(), "");
        // The default opponents fit each game.
        let default = build("vs-opponent", &[]).unwrap();
        for game in relay_envs::TEXT_GAME_IDS {
            default.check_env(game, &EnvSection::default()).unwrap();
        }
        for (key, value, needle) in [
            ("opponents", "random,gpt", "gpt"),
            ("opponents", " , ", "empty"),
            ("games", "0", "games"),
            ("episodes", "3", "episodes"),
            ("temperature", "-1", "temperature"),
            ("temperature", "NaN", "temperature"),
            ("temperature", "warm", "temperature"),
        ] {
            let err = build("vs-opponent", &[(key.into(), value.into())])
                .err()
                .unwrap();
            assert!(err.contains(needle), "{key}={value}: {err}");
        }
        // Classic plugins refuse text games.
        let err = build("greedy", &[])
            .unwrap()
            .check_env("TicTacToe-v0", &EnvSection::default())
            .unwrap_err();
        assert!(err.contains("vs-opponent"), "{err}");
        build("greedy", &[])
            .unwrap()
            .check_env("CartPole-v1", &EnvSection::default())
            .unwrap();
    }

    #[test]
    fn vs_opponent_plays_a_pettingzoo_game_from_every_seat_against_each_bot() {
        let env = EnvSection {
            backend: relay_bridge::Backend::Pettingzoo,
            ..EnvSection::default()
        };
        let plugin = build(
            "vs-opponent",
            &[
                ("games".into(), "6".into()),
                ("score".into(), "non_loss".into()),
            ],
        )
        .unwrap();
        plugin.check_env("tictactoe_v3", &env).unwrap();
        let minimax = build("vs-opponent", &[("opponents".into(), "minimax".into())]).unwrap();
        refuses(&*minimax, "connect_four_v3", &env, "minimax");
        refuses(&*plugin, "CartPole-v1", &EnvSection::default(), "");
        let checkpoint = build(
            "vs-opponent",
            &[("opponents".into(), "checkpoint:no/such/folder".into())],
        )
        .unwrap();
        let err = checkpoint.check_env("tictactoe_v3", &env).unwrap_err();
        assert!(err.contains("no/such/folder"), "{err}");

        // An untrained policy against the default opponents (random and
        // minimax): 3 games from each seat against each, on the same seeds.
        let policy = untrained(7, 18, 9);
        let dir = std::env::temp_dir();
        let ctx = EvalContext {
            env_id: "tictactoe_v3".into(),
            env,
            episodes: 6,
            ..ctx(&dir)
        };
        let EvalOutcome::Games {
            returns,
            matchups,
            matchup_of,
            policy_version,
            played,
        } = plugin.evaluate(&policy, &ctx).unwrap()
        else {
            panic!("games on observations report games");
        };
        assert_eq!(policy_version, Some(7));
        assert!(played.is_empty());
        let seen: Vec<(&str, u8, u32)> = matchups
            .iter()
            .map(|m| (m.opponent.as_str(), m.seat, m.games))
            .collect();
        assert_eq!(
            seen,
            [
                ("random", 0, 3),
                ("random", 1, 3),
                ("minimax", 0, 3),
                ("minimax", 1, 3)
            ]
        );
        assert_eq!(returns.len(), 12);
        assert_eq!(matchup_of, [0, 1, 0, 1, 0, 1, 2, 3, 2, 3, 2, 3]);
        // Non-loss scores are 0 or 1, and agree with the matchups' counts.
        for (k, m) in matchups.iter().enumerate() {
            let score: f64 = returns
                .iter()
                .zip(&matchup_of)
                .filter(|(_, &of)| of == k)
                .map(|(r, _)| r)
                .sum();
            assert_eq!(score, (m.wins + m.draws) as f64, "{m:?}");
            assert_eq!(m.wins + m.draws + m.losses, m.games);
        }
        // Perfect play never loses.
        assert!(matchups[2..].iter().all(|m| m.wins == 0), "{matchups:?}");
    }

    #[test]
    fn more_episodes_than_envs_are_played_in_turn_in_each_envs_order() {
        let model = policy().model;
        let n = 2 * MAX_EVAL_ENVS + 5;
        let envs = eval_envs("CartPole-v1", &EnvSection::default(), n, 9).unwrap();
        assert_eq!(envs.envs.num_envs(), MAX_EVAL_ENVS);
        let episodes = play(&model, None, envs, 9, true, true).unwrap();
        assert_eq!(episodes.len(), n);

        // Env i's k-th episode is episode i + k * MAX_EVAL_ENVS, whichever
        // episodes end first.
        let mut reference =
            VecEnvs::new("CartPole-v1", &EnvSection::default(), MAX_EVAL_ENVS, 9).unwrap();
        let mut obs = reference.reset().unwrap().to_vec();
        let mut by_env: Vec<Vec<f64>> = vec![Vec::new(); MAX_EVAL_ENVS];
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(0);
        while by_env
            .iter()
            .enumerate()
            .any(|(i, r)| i + r.len() * MAX_EVAL_ENVS < n)
        {
            let out =
                relay_policy::Act::act(&model, &obs, MAX_EVAL_ENVS, &mut [], None, true, &mut rng)
                    .unwrap();
            let Actions::Discrete(a) = &out.actions else {
                panic!("CartPole is discrete")
            };
            let step = reference.step(VecActions::Discrete(a.as_slice())).unwrap();
            for e in &step.finished {
                by_env[e.env_index].push(e.episode_return);
            }
            obs.copy_from_slice(&step.obs);
        }
        for (i, episode) in episodes.iter().enumerate() {
            let (env, k) = (i % MAX_EVAL_ENVS, i / MAX_EVAL_ENVS);
            assert_eq!(episode.ret, by_env[env][k], "episode {i}");
            let t = episode.trajectory.as_ref().unwrap();
            assert_eq!(t.rewards.iter().sum::<f64>(), episode.ret);
            assert_eq!(t.obs.len(), t.rewards.len());
            let ends = |j: usize| t.terminated[j] || t.truncated[j];
            assert!(ends(t.rewards.len() - 1) && (0..t.rewards.len() - 1).all(|j| !ends(j)));
        }

        // The first episodes are those of an evaluation of fewer.
        let few = play(
            &model,
            None,
            eval_envs("CartPole-v1", &EnvSection::default(), 7, 9).unwrap(),
            9,
            true,
            false,
        )
        .unwrap();
        let few: Vec<f64> = few.iter().map(|e| e.ret).collect();
        let many: Vec<f64> = episodes[..7].iter().map(|e| e.ret).collect();
        assert_eq!(few, many);
    }

    #[test]
    fn threshold_waits_for_the_training_return_and_record_writes_trajectories() {
        let dir = std::env::temp_dir().join(format!("relay-eval-plugins-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let mut c = ctx(&dir);
        let t = build("threshold", &[("level".into(), "50".into())]).unwrap();
        assert!(matches!(
            t.evaluate(&policy(), &c).unwrap(),
            EvalOutcome::Skipped(_)
        ));
        c.train_return = Some(60.0);
        assert!(matches!(
            t.evaluate(&policy(), &c).unwrap(),
            EvalOutcome::Returns(r) if r.len() == 2
        ));

        let r = build("record", &[]).unwrap();
        let EvalOutcome::Returns(returns) = r.evaluate(&policy(), &c).unwrap() else {
            panic!("record skipped")
        };
        let text = std::fs::read_to_string(dir.join("recordings/v3.jsonl")).unwrap();
        let lines: Vec<serde_json::Value> = text
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(lines.len(), 2);
        for (line, ret) in lines.iter().zip(&returns) {
            let rewards = line["rewards"].as_array().unwrap();
            assert_eq!(line["obs"].as_array().unwrap().len(), rewards.len());
            assert_eq!(line["actions"].as_array().unwrap().len(), rewards.len());
            let sum: f64 = rewards.iter().map(|r| r.as_f64().unwrap()).sum();
            assert!((sum - ret).abs() < 1e-9);
            let ends = line["terminated"].as_array().unwrap();
            assert!(ends.last().unwrap().as_bool().unwrap());
        }
        // Greedy is deterministic; stochastic samples.
        let g = build("greedy", &[]).unwrap();
        assert_eq!(
            g.evaluate(&policy(), &c).unwrap(),
            g.evaluate(&policy(), &c).unwrap()
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}
