//! Text games as services play them: one game loop shared by the
//! env-runner (training games) and the evaluator (`vs-opponent`).
//!
//! [`play_game`] plays one game of a [`relay_envs::TextGame`] with one
//! [`Seat`] per player. A model seat sends a [`GenerateRequest`] (a chat
//! prompt: the optional system prompt, then the player's observation as the
//! user turn) through a [`Generate`] transport ([`NatsGenerate`] in the
//! services), applies the reply's text as its move and records a
//! [`TextTurn`] with the reply's tokens and log-probs; a bot seat moves
//! locally. The result is a [`GameRecord`] plus what the services measure
//! ([`PlayedGame`]).
//!
//! A request that fails (timeout, no inference server, an undecodable or
//! invalid reply) is retried up to [`GameSettings::attempts`] times in all;
//! then the game is abandoned ([`GameError::Abandoned`]) and the caller
//! counts it. A reply whose text is not a legal move is not a failure: the
//! game judges it, as it would judge any model output.

use std::future::Future;
use std::time::{Duration, Instant};

use relay_bridge::EnvSection;
use relay_config::{BranchPosition, Opponent, TextConfig};
use relay_envs::{
    AnswerReader, Bot, ConnectFourBot, EnvError, MinimaxBot, ObservationView, RandomBot,
};
use relay_kit::RequestError;
use relay_proto::{
    AdapterRef, AnswerFrame, Branch, ChatMessage, FinishReason, GameRecord, GenerateReply,
    GenerateRequest, Prompt, SamplingParams, SeatPolicy, Tensor, TextTurn, SCHEMA_VERSION,
};

/// Name of the run's learning adapter.
pub const LEARNING_ADAPTER: &str = "policy";

/// The learning adapter at the newest version the inference server holds.
pub fn learning_adapter() -> AdapterRef {
    AdapterRef {
        name: LEARNING_ADAPTER.to_string(),
        version: None,
    }
}

/// Who plays one seat.
pub enum Seat {
    /// The LLM with this adapter (`None`: the base model alone).
    Model(Option<AdapterRef>),
    /// A bot, moving locally.
    Bot(Box<dyn Bot>),
}

impl Seat {
    /// The learning policy's seat: the learning adapter, or the bot
    /// `text.learner` names (baselines); `seed` seeds a random bot.
    pub fn learner(config: &TextConfig, seed: u64) -> Result<Self, String> {
        match config.learner_bot() {
            None => Ok(Seat::Model(Some(learning_adapter()))),
            Some(bot) => Ok(Seat::Bot(make_bot(bot, seed, config)?)),
        }
    }

    /// An opponent's seat (`self` sits the learning adapter).
    pub fn opponent(opponent: &Opponent, seed: u64, config: &TextConfig) -> Result<Self, String> {
        Ok(match opponent {
            Opponent::SelfPlay => Seat::Model(Some(learning_adapter())),
            Opponent::Base => Seat::Model(None),
            Opponent::Adapter(name) => Seat::Model(Some(AdapterRef {
                name: name.clone(),
                version: None,
            })),
            Opponent::Bot(name) => Seat::Bot(make_bot(name, seed, config)?),
        })
    }

    /// How a [`GameRecord`] names this seat.
    pub fn policy(&self) -> SeatPolicy {
        match self {
            Seat::Model(adapter) => SeatPolicy::Model(adapter.clone()),
            Seat::Bot(bot) => SeatPolicy::Bot(bot.name().to_string()),
        }
    }
}

/// Builds bot `name` (one of `relay_config::BOT_NAMES`).
pub fn make_bot(name: &str, seed: u64, config: &TextConfig) -> Result<Box<dyn Bot>, String> {
    Ok(match name {
        "random" => Box::new(RandomBot::new(seed)),
        "minimax" => Box::new(MinimaxBot::new()),
        "connect_four_bot" => Box::new(ConnectFourBot::new(config.connect_four_depth)),
        other => return Err(format!("unknown bot {other:?}")),
    })
}

/// Seats `learner` at `learner_seat` and fills every other seat from
/// `opponent`: seat `i` is player `i`, and player 0 moves first.
pub fn arrange(
    learner: Seat,
    mut opponent: impl FnMut() -> Result<Seat, String>,
    players: usize,
    learner_seat: usize,
) -> Result<Vec<Seat>, String> {
    assert!(learner_seat < players, "seat {learner_seat} of {players}");
    let mut learner = Some(learner);
    (0..players)
        .map(|seat| {
            if seat == learner_seat {
                Ok(learner.take().expect("one learner seat"))
            } else {
                opponent()
            }
        })
        .collect()
}

/// How model seats ask for their moves.
#[derive(Debug, Clone, PartialEq)]
pub struct GameSettings {
    /// System prompt before each observation.
    pub system_prompt: Option<String>,
    /// How each observation is rendered.
    pub observation: ObservationView,
    /// Sampling of each move (its `seed` is replaced per move, derived from
    /// the game seed, so a game replays given the same replies).
    pub sampling: SamplingParams,
    /// Ask for constrained decoding to the legal moves (of the answer
    /// only, after the thought, when the answer format has a frame).
    pub constrained: bool,
    /// Where the move is in a reply (`text.answer`).
    pub answer: AnswerReader,
    /// Time one request may take.
    pub timeout: Duration,
    /// Tries per move before the game is abandoned (at least 1).
    pub attempts: u32,
    /// Wait before the first retry; doubles with each further one (up to 1 s).
    pub retry_backoff: Duration,
    /// Where [`play_branched`] branches a game.
    pub branch_at: BranchPosition,
    /// [`play_branched`]'s continuations move where the game and the
    /// earlier continuations did not, while such legal moves remain.
    pub distinct_branch_moves: bool,
    /// Where games come from: relay's built-in ones, or TextArena's through
    /// the env bridge (the config's `env` section).
    pub env: EnvSection,
}

impl GameSettings {
    /// The settings of the `text` and `env` config sections (validated:
    /// the answer pattern compiles).
    pub fn from_config(text: &TextConfig, env: &EnvSection) -> Self {
        Self {
            answer: AnswerReader::new(&text.answer)
                .expect("text.answer is checked when the config is validated"),
            env: env.clone(),
            system_prompt: text.system_prompt.clone(),
            observation: text.observation,
            sampling: SamplingParams {
                temperature: text.temperature,
                top_p: text.top_p,
                top_k: text.top_k,
                max_tokens: text.max_turn_tokens,
                stop: Vec::new(),
                seed: None,
            },
            constrained: text.constrained,
            timeout: Duration::from_millis(text.generate_timeout_ms),
            attempts: text.generate_attempts.max(1),
            retry_backoff: Duration::from_millis(50),
            branch_at: text.branch_at,
            distinct_branch_moves: text.distinct_branch_moves,
        }
    }

    /// The chat prompt of one move.
    pub fn prompt(&self, observation: &str) -> Prompt {
        let mut turns = Vec::with_capacity(2);
        if let Some(system) = &self.system_prompt {
            turns.push(ChatMessage {
                role: "system".into(),
                content: system.clone(),
            });
        }
        turns.push(ChatMessage {
            role: "user".into(),
            content: observation.to_string(),
        });
        Prompt::Chat(turns)
    }
}

/// Why one generate request failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GenerateError {
    #[error("no reply within the timeout")]
    Timeout,
    #[error("no inference server answers")]
    NoResponders,
    /// The reply did not decode or failed its checks.
    #[error("bad reply: {0}")]
    BadReply(String),
    #[error("{0}")]
    Other(String),
}

impl GenerateError {
    /// A short label for metrics: `timeout`, `no_responders`, `bad_reply`, `error`.
    pub fn label(&self) -> &'static str {
        match self {
            GenerateError::Timeout => "timeout",
            GenerateError::NoResponders => "no_responders",
            GenerateError::BadReply(_) => "bad_reply",
            GenerateError::Other(_) => "error",
        }
    }
}

/// Sends generate requests: [`NatsGenerate`] in the services, anything that
/// answers in unit tests.
pub trait Generate: Send + Sync {
    /// One request, answered within `timeout` or failed.
    fn generate(
        &self,
        request: &GenerateRequest,
        timeout: Duration,
    ) -> impl Future<Output = Result<GenerateReply, GenerateError>> + Send;
}

/// Generate requests over NATS request-reply (`relay.<run>.generate`, the
/// inference servers' queue group).
#[derive(Clone)]
pub struct NatsGenerate {
    client: async_nats::Client,
    subject: String,
}

impl NatsGenerate {
    pub fn new(client: async_nats::Client, subject: String) -> Self {
        Self { client, subject }
    }
}

impl Generate for NatsGenerate {
    async fn generate(
        &self,
        request: &GenerateRequest,
        timeout: Duration,
    ) -> Result<GenerateReply, GenerateError> {
        relay_kit::request::<_, GenerateReply>(&self.client, &self.subject, request, timeout)
            .await
            .map_err(|e| match e {
                RequestError::Timeout { .. } => GenerateError::Timeout,
                RequestError::NoResponders { .. } => GenerateError::NoResponders,
                RequestError::BadReply { source, .. } => {
                    GenerateError::BadReply(source.to_string())
                }
                other => GenerateError::Other(other.to_string()),
            })
    }
}

/// One game to play.
pub struct GameSpec {
    /// A text game id (`relay_envs::TEXT_GAME_IDS`).
    pub env_id: String,
    /// The game's reset seed (chance, and each move's sampling seed).
    pub seed: u64,
    /// One seat per player, seat `i` = player `i` (see [`arrange`]).
    pub seats: Vec<Seat>,
    /// The learning policy's seat, recorded in the [`GameRecord`].
    pub learner_seat: Option<usize>,
    /// Who plays it (the env-runner's or evaluator's instance), recorded.
    pub runner_id: String,
}

/// A finished game and what the services measure of it.
#[derive(Debug, Clone, PartialEq)]
pub struct PlayedGame {
    pub record: GameRecord,
    /// [`relay_envs::TextGame::state_key`] before each move (including the
    /// final state).
    pub states: Vec<String>,
    /// Wall time of each model move: its request(s) and the game's step.
    pub model_turn_seconds: Vec<f64>,
    /// Generate requests that failed and were retried.
    pub retries: u32,
    /// Characters of every model completion.
    pub completion_chars: usize,
}

impl PlayedGame {
    /// Reward of the learning seat.
    pub fn learner_reward(&self) -> Option<f64> {
        self.record
            .learner_seat
            .map(|s| self.record.rewards[s as usize])
    }

    /// Seats that play as the learning seat does (the learning seat itself,
    /// and every other seat with the same policy: mirror games).
    pub fn learning_seats(&self) -> Vec<usize> {
        let Some(learner) = self.record.learner_seat else {
            return Vec::new();
        };
        let own = &self.record.seats[learner as usize];
        (0..self.record.seats.len())
            .filter(|&s| &self.record.seats[s] == own)
            .collect()
    }

    /// The learning seat's result: see [`Outcome::of`].
    pub fn outcome(&self) -> Option<Outcome> {
        self.record
            .learner_seat
            .map(|s| Outcome::of(&self.record.rewards, s as usize))
    }
}

/// A game's result for one seat.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Outcome {
    Win,
    Draw,
    Loss,
}

impl Outcome {
    /// With several players: a win when the seat's reward is above every
    /// other seat's, a draw when it ties the best, a loss otherwise. Alone
    /// (GuessTheNumber): a win at a full score (>= 1), else a loss.
    pub fn of(rewards: &[f64], seat: usize) -> Self {
        let own = rewards[seat];
        if rewards.len() == 1 {
            return if own >= 1.0 {
                Outcome::Win
            } else {
                Outcome::Loss
            };
        }
        let best_other = rewards
            .iter()
            .enumerate()
            .filter(|&(s, _)| s != seat)
            .map(|(_, &r)| r)
            .fold(f64::NEG_INFINITY, f64::max);
        if own > best_other {
            Outcome::Win
        } else if own == best_other {
            Outcome::Draw
        } else {
            Outcome::Loss
        }
    }

    /// `win`, `draw` or `loss` (metric label).
    pub fn label(self) -> &'static str {
        match self {
            Outcome::Win => "win",
            Outcome::Draw => "draw",
            Outcome::Loss => "loss",
        }
    }
}

/// Why a game was not finished.
#[derive(Debug, thiserror::Error)]
pub enum GameError {
    /// A model seat got no usable reply in `attempts` tries.
    #[error("game abandoned at turn {turn}: player {player} got no usable reply in {attempts} attempts (last: {last})")]
    Abandoned {
        turn: usize,
        player: usize,
        attempts: u32,
        last: GenerateError,
    },
    /// The seats do not fit the game.
    #[error("{0}")]
    Setup(String),
    /// The game or a bot refused to go on.
    #[error(transparent)]
    Env(#[from] EnvError),
    /// The game could not be made (a TextArena game's worker did not start).
    #[error(transparent)]
    Make(#[from] relay_bridge::BridgeError),
}

/// Mixes the game seed and the move number into a sampling seed.
fn move_seed(game_seed: u64, turn: usize) -> u64 {
    let mut z = game_seed ^ (turn as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Plays one game to its end (see the module docs).
pub async fn play_game<G: Generate>(
    generator: &G,
    spec: GameSpec,
    settings: &GameSettings,
) -> Result<PlayedGame, GameError> {
    play(generator, spec, settings, &[], 0, None).await
}

/// Plays `spec` to its end, then plays one of its positions on again once
/// per seat set of `more` (concurrently): the position before one of the
/// learning seat's model moves, drawn uniformly (`pick` in `[0, 1)`), or
/// with [`BranchPosition::LastBeforeLoss`] the last of them in a game the
/// learning seat lost.
/// Each continuation replays the moves before it, samples its own move
/// there from the same prompt (with `distinct_branch_moves`, among the legal
/// moves not played there yet: [`distinct_branch_moves`]) and plays the
/// rest with its own seats, so the learning seat's moves at that position
/// are several completions of one prompt. The records carry [`Branch`]
/// `group` (the game itself is continuation 0). Without `more`, or without
/// a learning model move, the game is returned alone, as [`play_game`]
/// plays it.
pub async fn play_branched<G: Generate>(
    generator: &G,
    spec: GameSpec,
    more: Vec<Vec<Seat>>,
    pick: f64,
    group: u64,
    settings: &GameSettings,
) -> Result<Vec<PlayedGame>, GameError> {
    let (env_id, seed, learner_seat, runner_id) = (
        spec.env_id.clone(),
        spec.seed,
        spec.learner_seat,
        spec.runner_id.clone(),
    );
    let first = play(generator, spec, settings, &[], 0, None).await?;
    let learning_moves: Vec<usize> = first.record.learning_turn_indices().collect();
    if learning_moves.is_empty() || more.is_empty() {
        return Ok(vec![first]);
    }
    let lost = first.outcome() == Some(Outcome::Loss);
    let chosen = match settings.branch_at {
        BranchPosition::LastBeforeLoss if lost => learning_moves.len() - 1,
        _ => ((pick * learning_moves.len() as f64) as usize).min(learning_moves.len() - 1),
    };
    let turn = learning_moves[chosen];
    let shared = &first.record.turns[..turn];
    let branching = &first.record.turns[turn];
    let (branch_moves, retries) = match &first.record.seats[branching.player as usize] {
        SeatPolicy::Model(adapter) if settings.distinct_branch_moves => {
            let (replies, retries) = distinct_branch_moves(
                generator,
                (&env_id, seed, shared),
                &branching.action,
                adapter,
                more.len(),
                settings,
            )
            .await?;
            (replies.into_iter().map(Some).collect(), retries)
        }
        _ => (vec![None; more.len()], 0),
    };
    let others = futures::future::join_all(more.into_iter().zip(branch_moves).enumerate().map(
        |(i, (seats, branch_move))| {
            let spec = GameSpec {
                env_id: env_id.clone(),
                seed,
                seats,
                learner_seat,
                runner_id: runner_id.clone(),
            };
            play(generator, spec, settings, shared, i as u64 + 1, branch_move)
        },
    ))
    .await;
    let size = others.len() as u32 + 1;
    let mut games = vec![first];
    for game in others {
        games.push(game?);
    }
    games[1].retries += retries;
    for (index, game) in games.iter_mut().enumerate() {
        game.record.branch = Some(Branch {
            group,
            turn: turn as u32,
            index: index as u32,
            size,
        });
    }
    Ok(games)
}

/// `count` moves at the position `shared` leads to (in game `seed` of
/// `env_id`), made by `adapter`'s seat there, drawn one after the other
/// among the legal moves that neither `played` (the game's own move there)
/// nor an earlier draw names, while any is left (then among all). The
/// `i`-th draw is continuation `i + 1`'s move, sampled with its salt. A
/// reply names a move when its answer contains it (`[4]` in `I play [4]`). Also
/// returns the retries the requests took.
async fn distinct_branch_moves<G: Generate>(
    generator: &G,
    (env_id, seed, shared): (&str, u64, &[TextTurn]),
    played: &str,
    adapter: &Option<AdapterRef>,
    count: usize,
    settings: &GameSettings,
) -> Result<(Vec<GenerateReply>, u32), GameError> {
    let mut position = relay_bridge::make_text_game(env_id, &settings.env)?;
    position.reset(seed);
    for t in shared {
        position.step(&t.action)?;
    }
    let (player, turn) = (position.current_player(), shared.len());
    let legal = position.legal_moves();
    let mut named = vec![played.to_string()];
    let (mut replies, mut retries) = (Vec::with_capacity(count), 0);
    for salt in 1..=count as u64 {
        let mut request = model_request(
            position.as_ref(),
            &position.observation_as(player, settings.observation),
            adapter,
            settings,
            seed,
            salt,
            turn,
        );
        let untried: Vec<String> = legal
            .iter()
            .filter(|m| !named.iter().any(|reply| reply.contains(m.as_str())))
            .cloned()
            .collect();
        if !untried.is_empty() {
            request.allowed = untried;
        }
        let reply =
            request_with_retries(generator, &request, settings, turn, player, &mut retries).await?;
        named.push(settings.answer.read(&reply.text).action);
        replies.push(reply);
    }
    Ok((replies, retries))
}

/// The game loop: replays `replayed` (the first turns of another game of
/// the same seed), then plays on, sampling each model move with a seed
/// made of the game seed, the move number and `salt` (so continuations of
/// one position differ); `branch_move`, if given, is the reply of the
/// first move after the replayed ones, already drawn. What the services
/// measure (move times, retries, characters) covers the moves played here,
/// not the replayed ones.
async fn play<G: Generate>(
    generator: &G,
    spec: GameSpec,
    settings: &GameSettings,
    replayed: &[TextTurn],
    salt: u64,
    mut branch_move: Option<GenerateReply>,
) -> Result<PlayedGame, GameError> {
    let started = Instant::now();
    let GameSpec {
        env_id,
        seed,
        mut seats,
        learner_seat,
        runner_id,
    } = spec;
    let mut game = relay_bridge::make_text_game(&env_id, &settings.env)?;
    if seats.len() != game.num_players() {
        return Err(GameError::Setup(format!(
            "{env_id} has {} players, got {} seats",
            game.num_players(),
            seats.len()
        )));
    }
    if learner_seat.is_some_and(|s| s >= seats.len()) {
        return Err(GameError::Setup(format!(
            "learner seat {learner_seat:?} of {} seats",
            seats.len()
        )));
    }
    game.reset(seed);
    let policies: Vec<SeatPolicy> = seats.iter().map(Seat::policy).collect();
    let mut turns: Vec<TextTurn> = Vec::new();
    let mut states = Vec::new();
    for turn in replayed {
        states.push(game.state_key());
        game.step(&turn.action)?;
        turns.push(turn.clone());
    }
    let mut model_turn_seconds = Vec::new();
    let (mut retries, mut completion_chars) = (0u32, 0usize);
    while !game.is_done() {
        states.push(game.state_key());
        let player = game.current_player();
        let turn_started = Instant::now();
        let turn = match &mut seats[player] {
            Seat::Bot(bot) => {
                let observation = game.observation_as(player, settings.observation);
                let action = bot.choose_move(game.as_ref())?;
                let outcome = game.step(&action)?;
                TextTurn {
                    player: player as u8,
                    prompt_tokens: Tensor::from_u32(&[0], &[]),
                    completion_tokens: Tensor::from_u32(&[0], &[]),
                    logprobs: Tensor::from_f32(&[0], &[]),
                    action,
                    invalid: outcome.invalid_move,
                    adapter: None,
                    observation,
                    completion: String::new(),
                    no_answer: false,
                    truncated: false,
                }
            }
            Seat::Model(adapter) => {
                let observation = game.observation_as(player, settings.observation);
                let reply = match branch_move.take() {
                    Some(reply) => reply,
                    None => {
                        let request = model_request(
                            game.as_ref(),
                            &observation,
                            adapter,
                            settings,
                            seed,
                            salt,
                            turns.len(),
                        );
                        request_with_retries(
                            generator,
                            &request,
                            settings,
                            turns.len(),
                            player,
                            &mut retries,
                        )
                        .await?
                    }
                };
                completion_chars += reply.text.chars().count();
                let answer = settings.answer.read(&reply.text);
                let outcome = game.step(&answer.action)?;
                model_turn_seconds.push(turn_started.elapsed().as_secs_f64());
                let truncated = reply.finish == FinishReason::Length
                    || reply
                        .answer_start
                        .is_some_and(|start| start >= settings.sampling.max_tokens);
                TextTurn {
                    player: player as u8,
                    prompt_tokens: reply.prompt_tokens,
                    completion_tokens: reply.completion_tokens,
                    logprobs: reply.logprobs,
                    action: answer.action,
                    invalid: outcome.invalid_move,
                    adapter: reply.adapter,
                    observation,
                    completion: reply.text,
                    no_answer: !answer.found,
                    truncated,
                }
            }
        };
        turns.push(turn);
    }
    states.push(game.state_key());
    let rewards = game.rewards().expect("the game is over");
    let reasons = game
        .game_info()
        .into_iter()
        .map(|info| info.reason.unwrap_or_default())
        .collect();
    let record = GameRecord {
        schema: SCHEMA_VERSION,
        runner_id,
        env_id,
        seed,
        seats: policies,
        learner_seat: learner_seat.map(|s| s as u8),
        turns,
        rewards,
        reasons,
        duration_ms: started.elapsed().as_millis() as u64,
        finished_unix_ms: relay_proto::unix_ms(),
        branch: None,
    };
    Ok(PlayedGame {
        record,
        states,
        model_turn_seconds,
        retries,
        completion_chars,
    })
}

/// The request of the move at `turn` of the player who sees
/// `observation`: that as prompt, sampled with a seed made of the game
/// seed, `salt` and the move number, constrained to the legal moves if the
/// settings ask for it (the answer alone, in the answer format's frame,
/// when it has one).
fn model_request(
    game: &dyn relay_envs::TextGame,
    observation: &str,
    adapter: &Option<AdapterRef>,
    settings: &GameSettings,
    seed: u64,
    salt: u64,
    turn: usize,
) -> GenerateRequest {
    let mut sampling = settings.sampling.clone();
    sampling.seed = Some(move_seed(
        seed ^ salt.wrapping_mul(0xD6E8_FEB8_6659_FD93),
        turn,
    ));
    let mut request = GenerateRequest::new(adapter.clone(), settings.prompt(observation), sampling);
    if settings.constrained {
        request.allowed = game.legal_moves();
        request.answer_frame = settings.answer.frame().map(|frame| AnswerFrame {
            opener: frame.opener.to_string(),
            closer: frame.closer.to_string(),
        });
    }
    request
}

/// One move's request, retried on failure with a doubling backoff.
async fn request_with_retries<G: Generate>(
    generator: &G,
    request: &GenerateRequest,
    settings: &GameSettings,
    turn: usize,
    player: usize,
    retries: &mut u32,
) -> Result<GenerateReply, GameError> {
    let mut backoff = settings.retry_backoff;
    let attempts = settings.attempts.max(1);
    let mut attempt = 1;
    loop {
        match generator.generate(request, settings.timeout).await {
            Ok(reply) => return Ok(reply),
            Err(e) if attempt >= attempts => {
                return Err(GameError::Abandoned {
                    turn,
                    player,
                    attempts,
                    last: e,
                })
            }
            Err(e) => {
                tracing::debug!(error = %e, attempt, turn, "generate request failed; retrying");
                *retries += 1;
                attempt += 1;
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(1));
            }
        }
    }
}
