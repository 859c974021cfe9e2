//! The `text` section: text games, opponents and bots, seats, turn limits
//! and branching.

use relay_bridge::EnvSection;
use serde::{Deserialize, Serialize};

use crate::check::{invalid, positive, ConfigError};
use crate::league::LEAGUE_OPPONENT;

/// The bots a seat can hold (`text.learner`, `text.opponents`).
pub const BOT_NAMES: [&str; 3] = ["random", "minimax", "connect_four_bot"];

/// Whether bot `name` plays text game `env_id` under `env`: `random` plays
/// every game, `minimax` relay's TicTacToe only, `connect_four_bot` relay's
/// ConnectFour only (they search relay's own game types, so TextArena's
/// games of the same ids, under `env.backend: textarena`, have neither).
pub fn bot_plays(name: &str, env_id: &str, env: &EnvSection) -> bool {
    let builtin = !env.text_uses_python();
    match name {
        "random" => true,
        "minimax" => builtin && env_id == relay_envs::text::tic_tac_toe::ID,
        "connect_four_bot" => builtin && env_id == relay_envs::text::connect_four::ID,
        _ => false,
    }
}

/// Who sits opposite the learning policy (a key of `text.opponents`, or an
/// entry of the `vs-opponent` evaluator's `opponents` option).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Opponent {
    /// `self`: the learning adapter itself (mirror self-play: it holds every seat).
    SelfPlay,
    /// `base`: the base model without any adapter.
    Base,
    /// A bot of [`BOT_NAMES`].
    Bot(String),
    /// `adapter:<name>`: the LLM with another adapter the inference servers hold.
    Adapter(String),
}

impl Opponent {
    /// Parses `self`, `base`, a bot name or `adapter:<name>`.
    pub fn parse(text: &str) -> Result<Self, String> {
        let text = text.trim();
        match text {
            "self" => Ok(Self::SelfPlay),
            "base" => Ok(Self::Base),
            bot if BOT_NAMES.contains(&bot) => Ok(Self::Bot(bot.to_string())),
            other => match other.strip_prefix("adapter:") {
                Some(name) if valid_adapter_name(name) => Ok(Self::Adapter(name.to_string())),
                Some(name) => Err(format!(
                    "adapter name {name:?} must be 1 to 64 ASCII letters, digits, '-', '_' or '.'"
                )),
                None => Err(format!(
                    "unknown opponent {other:?}; known: self, base, {}, adapter:<name>",
                    BOT_NAMES.join(", ")
                )),
            },
        }
    }

    /// Its name as configs write it (`random`, `adapter:old`, ...).
    pub fn label(&self) -> String {
        match self {
            Self::SelfPlay => "self".into(),
            Self::Base => "base".into(),
            Self::Bot(name) => name.clone(),
            Self::Adapter(name) => format!("adapter:{name}"),
        }
    }

    /// Checks that it can play `env_id` under `env` (bots play only some games).
    pub fn check_game(&self, env_id: &str, env: &EnvSection) -> Result<(), String> {
        match self {
            Self::Bot(name) if !bot_plays(name, env_id, env) => {
                Err(format!("bot {name} does not play {env_id}"))
            }
            _ => Ok(()),
        }
    }
}

pub(crate) fn valid_adapter_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 64
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
}

/// Text-game runs (`run.env_id` one of the text games): who plays, and how
/// the LLM policy generates its moves. Ignored for classic-control envs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TextConfig {
    /// Who plays the learning side: `model` (the LLM with the learning
    /// adapter `policy`), or a bot (`random`, `minimax`,
    /// `connect_four_bot`) for a baseline run that needs no inference server.
    pub learner: String,
    /// Who sits opposite the learning side in training games, each with a
    /// relative weight (>= 0; one is drawn per game): `self` (mirror: the
    /// learning adapter in every seat), `base` (the base model without
    /// adapter), `random`, `minimax` (TicTacToe), `connect_four_bot`
    /// (ConnectFour), `adapter:<name>` (another adapter the inference
    /// servers hold), `league` (an opponent the `league.sampler` draws from
    /// the run's league pool: a past version of the learning adapter, the
    /// current one, or a fixed bot; two-player games with `learner: model`
    /// only). Every bot listed here, even at weight 0, is a fixed member
    /// of the league pool. Single-player games ignore it.
    pub opponents: std::collections::BTreeMap<String, f64>,
    /// Games each env-runner copy plays at the same time (their generate
    /// requests overlap, so the inference servers can batch them).
    pub games_in_flight: usize,
    /// Most tokens the model may generate for one move: its whole reply,
    /// or with an answer format and `constrained`, its thought (the
    /// constrained answer follows it).
    pub max_turn_tokens: u32,
    /// Where the move is in the model's reply: `raw` (the whole reply goes
    /// to the game, which finds the move in it: TextArena's way), `boxed`
    /// (the last `\boxed{...}`, bracketed unless it holds brackets:
    /// UnstableBaselines' and SPIRAL's), `last_bracket` (the last `[...]`),
    /// or `{regex: <pattern>}` (its last match: the first capture group,
    /// else the whole match). With a format the model may think in free
    /// text before its answer; a reply without an answer sends the game an
    /// empty move (refused, and counted as `no_answer`). The format reward
    /// (`rl.reward.format_bonus`) counts the moves whose answer was found.
    pub answer: relay_envs::AnswerFormat,
    /// Sampling temperature of the model's moves (0: greedy).
    pub temperature: f32,
    /// Nucleus sampling: keep the smallest set of tokens whose probability
    /// reaches this (1 keeps all).
    pub top_p: f32,
    /// Keep only the `top_k` most likely tokens (0 keeps all).
    pub top_k: u32,
    /// Ask for constrained decoding: the model's move is always one of the
    /// game's legal moves (`legal_moves()`), spelled token by token. Under
    /// `answer: raw` the whole reply is the move; under `boxed` and
    /// `last_bracket` the model thinks freely first and only the answer is
    /// constrained: from where it writes `\boxed{` (then a legal move and
    /// `}`), or where it ends its turn or reaches `max_turn_tokens` (then
    /// the whole answer is decoded there). Not available with `regex`.
    pub constrained: bool,
    /// System prompt put before each observation (none: the observation is
    /// the only chat turn).
    pub system_prompt: Option<String>,
    /// How the game's messages become the prompt: `full` (TextArena's
    /// default `LLMObservationWrapper`, the whole transcript) or
    /// `first_last` (`FirstLastObservationWrapper`: the game's rules and
    /// the latest message, i.e. the current board; short prompts that do
    /// not grow over the game) or `compact` (relay's own: the board from
    /// the player's side, its cells, the opponent's and the free ones: a
    /// TicTacToe prompt in about 90 tokens where `first_last` takes about
    /// 216; see `relay_envs::ObservationView::Compact`).
    pub observation: relay_envs::ObservationView,
    /// Time one generate request may take before it counts as failed.
    pub generate_timeout_ms: u64,
    /// Attempts per move (the first try and its retries) before the game is
    /// abandoned (and counted); a timeout, an undecodable reply and a
    /// missing inference server each fail one attempt.
    pub generate_attempts: u32,
    /// Search depth (plies) of `connect_four_bot`.
    pub connect_four_depth: u32,
    /// Multi-game runs: the text games trained on together, each with its
    /// relative sampling weight (finite, >= 0, not all 0), e.g.
    /// `{TicTacToe-v0: 2, KuhnPoker-v0: 1}`. Each env-runner draws the game
    /// of every new training game from these weights with its seeded RNG.
    /// Unset: the run plays `run.env_id` alone, as a single-game run. When
    /// set, `run.env_id` must be one of these games (it names the run in
    /// the registry and the `env_id` label), every entry of `opponents`
    /// (and `learner`, when it is a bot) must play every game, and the
    /// `league` opponent is refused: the league pool rates one game.
    pub games: Option<std::collections::BTreeMap<String, f64>>,
    /// Continuations of one position per training game (1: plain games).
    /// With `n > 1` each training game against a listed opponent is played
    /// to its end, then one position before a learning move (drawn
    /// uniformly among them) is played on `n - 1` more times: the learning
    /// seat's move there is sampled `n` times from one prompt, and those
    /// moves are one `rloo`/`grpo` group whose returns differ only by the
    /// move and what followed (a per-position baseline, where the games of
    /// one version and seat give a per-seat one). Costs `n - 1` game
    /// endings per game. League games branch too, or only those against the
    /// fixed members `league.branch_against` lists.
    pub branches: usize,
    /// Which position a game's continuations (`branches > 1`) play on
    /// from: `uniform` (one before a learning move, drawn uniformly) or
    /// `last_before_loss` (in a game the learning seat lost, the position
    /// of its last move, the one the opponent's win followed; in other
    /// games, uniform). The latter spends the continuations where a move
    /// is most likely to have decided the game: against a random bot a
    /// missed block loses only when the bot finds the cell, so the plain
    /// games rarely show the move's cost.
    pub branch_at: BranchPosition,
    /// Each continuation of a branched position moves there where the
    /// game and the earlier continuations did not (drawn by constrained
    /// decoding among the legal moves left, one continuation after the
    /// other; once none is left, among all). A group of one move repeated
    /// teaches nothing (its centred advantages cancel on that move), and
    /// a policy grown almost deterministic mostly repeats itself; distinct
    /// moves make every group a comparison.
    pub distinct_branch_moves: bool,
}

/// Where a training game is branched (`text.branch_at`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BranchPosition {
    /// Before a learning move drawn uniformly.
    #[default]
    Uniform,
    /// Before the learning seat's last move in a game it lost; uniform in
    /// the others.
    LastBeforeLoss,
}

impl Default for TextConfig {
    fn default() -> Self {
        Self {
            learner: "model".into(),
            opponents: [("random".to_string(), 1.0)].into_iter().collect(),
            games_in_flight: 4,
            max_turn_tokens: 32,
            answer: relay_envs::AnswerFormat::Raw,
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            constrained: false,
            system_prompt: None,
            observation: relay_envs::ObservationView::Full,
            generate_timeout_ms: 30_000,
            generate_attempts: 3,
            connect_four_depth: 4,
            games: None,
            branches: 1,
            branch_at: BranchPosition::Uniform,
            distinct_branch_moves: false,
        }
    }
}

impl TextConfig {
    /// The opponents with their weights, parsed (in name order), without
    /// the [`LEAGUE_OPPONENT`] entry (see [`TextConfig::league_weight`]).
    pub fn opponent_weights(&self) -> Result<Vec<(Opponent, f64)>, ConfigError> {
        self.opponents
            .iter()
            .filter(|(name, _)| name.as_str() != LEAGUE_OPPONENT)
            .map(|(name, &w)| {
                Opponent::parse(name)
                    .map(|o| (o, w))
                    .map_err(|e| invalid(&format!("text.opponents.{name}"), e))
            })
            .collect()
    }

    /// The relative weight of `league` in `opponents` (0 when absent): the
    /// share of training games whose opponent the league sampler draws.
    pub fn league_weight(&self) -> f64 {
        self.opponents.get(LEAGUE_OPPONENT).copied().unwrap_or(0.0)
    }

    /// The bots among `opponents` (whatever their weight), in name order.
    pub fn opponent_bots(&self) -> impl Iterator<Item = &str> {
        self.opponents
            .keys()
            .map(String::as_str)
            .filter(|name| BOT_NAMES.contains(name))
    }

    /// The games of a run whose `run.env_id` is `env_id`, with their
    /// sampling weights, in name order: `games` when set, else `env_id`
    /// alone at weight 1.
    pub fn game_weights(&self, env_id: &str) -> Vec<(String, f64)> {
        match &self.games {
            Some(games) => games.iter().map(|(g, &w)| (g.clone(), w)).collect(),
            None => vec![(env_id.to_string(), 1.0)],
        }
    }

    /// Whether the run trains on several games (`games` lists more than one).
    pub fn multi_game(&self) -> bool {
        self.games.as_ref().is_some_and(|g| g.len() > 1)
    }

    /// Checks `games` against the run's `env_id` (see the field's docs).
    pub(crate) fn validate_games(&self, env_id: &str, env: &EnvSection) -> Result<(), ConfigError> {
        let Some(games) = &self.games else {
            return Ok(());
        };
        if games.is_empty() {
            return Err(invalid(
                "text.games",
                "lists no game; leave it unset to play run.env_id alone",
            ));
        }
        for (game, &weight) in games {
            let field = format!("text.games.{game}");
            if !env.is_text_game(game) {
                let kind = if relay_envs::spec(game).is_ok() {
                    "is a classic-control env; text.games lists text games only (no mixing)"
                        .to_string()
                } else {
                    format!(
                        "unknown text game {game:?}; known: {}",
                        relay_envs::TEXT_GAME_IDS.join(", ")
                    )
                };
                return Err(invalid(&field, kind));
            }
            if !(weight.is_finite() && weight >= 0.0) {
                return Err(invalid(
                    &field,
                    format!("weight must be a number >= 0, got {weight}"),
                ));
            }
        }
        if games.values().all(|&w| w <= 0.0) {
            return Err(invalid(
                "text.games",
                "every weight is 0; at least one must be positive",
            ));
        }
        if !env.is_text_game(env_id) {
            return Err(invalid(
                "text.games",
                format!("run.env_id {env_id} is not a text game: a run cannot mix classic-control and text envs"),
            ));
        }
        if !games.contains_key(env_id) {
            return Err(invalid(
                "text.games",
                format!(
                    "does not list run.env_id {env_id}; a multi-game run names one of its games in run.env_id"
                ),
            ));
        }
        if games.len() > 1 && self.league_weight() > 0.0 {
            return Err(invalid(
                &format!("text.opponents.{LEAGUE_OPPONENT}"),
                "the league pool rates one game; a multi-game run (text.games) cannot use league opponents",
            ));
        }
        Ok(())
    }

    /// The learning side's bot, if `learner` names one (`None`: the model).
    pub fn learner_bot(&self) -> Option<&str> {
        (self.learner != "model").then_some(self.learner.as_str())
    }

    /// Checks every field; `env_id` is the run's (game-specific checks
    /// apply only when it is a text game).
    pub fn validate(&self, env_id: &str, env: &EnvSection) -> Result<(), ConfigError> {
        let game = env.is_text_game(env_id);
        self.validate_games(env_id, env)?;
        let games: Vec<String> = self
            .game_weights(env_id)
            .into_iter()
            .map(|(g, _)| g)
            .collect();
        if self.learner != "model" {
            if !BOT_NAMES.contains(&self.learner.as_str()) {
                return Err(invalid(
                    "text.learner",
                    format!(
                        "unknown learner {:?}; known: model, {}",
                        self.learner,
                        BOT_NAMES.join(", ")
                    ),
                ));
            }
            if game {
                if let Some(refused) = games.iter().find(|g| !bot_plays(&self.learner, g, env)) {
                    return Err(invalid(
                        "text.learner",
                        format!("bot {} does not play {refused}", self.learner),
                    ));
                }
            }
        }
        if self.opponents.is_empty() {
            return Err(invalid("text.opponents", "needs at least one opponent"));
        }
        for (opponent, weight) in self.opponent_weights()? {
            let field = format!("text.opponents.{}", opponent.label());
            if !(weight.is_finite() && weight >= 0.0) {
                return Err(invalid(
                    &field,
                    format!("weight must be a number >= 0, got {weight}"),
                ));
            }
            if game {
                for g in &games {
                    opponent
                        .check_game(g, env)
                        .map_err(|e| invalid(&field, e))?;
                }
            }
        }
        let league = self.league_weight();
        if !(league.is_finite() && league >= 0.0) {
            return Err(invalid(
                &format!("text.opponents.{LEAGUE_OPPONENT}"),
                format!("weight must be a number >= 0, got {league}"),
            ));
        }
        if league > 0.0 && game {
            let field = format!("text.opponents.{LEAGUE_OPPONENT}");
            if self.learner_bot().is_some() {
                return Err(invalid(
                    &field,
                    "league games train the model: text.learner must be `model`",
                ));
            }
            let players = relay_bridge::make_text_game(env_id, env)
                .map_err(|e| invalid("run.env_id", e.to_string()))?
                .num_players();
            if players != 2 {
                return Err(invalid(
                    &field,
                    format!("the league rates two-player games; {env_id} has {players} players"),
                ));
            }
        }
        if self.opponents.values().all(|&w| w <= 0.0) {
            return Err(invalid(
                "text.opponents",
                "every weight is 0; at least one must be positive",
            ));
        }
        positive("text.games_in_flight", self.games_in_flight)?;
        positive("text.branches", self.branches)?;
        if self.max_turn_tokens == 0 || self.max_turn_tokens > relay_proto::MAX_GENERATE_TOKENS {
            return Err(invalid(
                "text.max_turn_tokens",
                format!(
                    "must be in 1..={}, got {}",
                    relay_proto::MAX_GENERATE_TOKENS,
                    self.max_turn_tokens
                ),
            ));
        }
        relay_envs::AnswerReader::new(&self.answer).map_err(|e| invalid("text.answer", e))?;
        if self.constrained && matches!(self.answer, relay_envs::AnswerFormat::Regex(_)) {
            return Err(invalid(
                "text.constrained",
                "constrained decoding needs an answer with a known frame (raw, boxed or \
                 last_bracket); a regex answer has none",
            ));
        }
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return Err(invalid(
                "text.temperature",
                format!("must be a number >= 0, got {}", self.temperature),
            ));
        }
        if !(self.top_p.is_finite() && self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(invalid(
                "text.top_p",
                format!("must be in (0, 1], got {}", self.top_p),
            ));
        }
        if self
            .system_prompt
            .as_ref()
            .is_some_and(|p| p.trim().is_empty())
        {
            return Err(invalid(
                "text.system_prompt",
                "is empty; leave it unset for no system prompt",
            ));
        }
        positive(
            "text.generate_timeout_ms",
            self.generate_timeout_ms as usize,
        )?;
        positive("text.generate_attempts", self.generate_attempts as usize)?;
        positive("text.connect_four_depth", self.connect_four_depth as usize)?;
        Ok(())
    }
}
