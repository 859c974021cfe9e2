//! Wire types of LLM policies and text games: generation requests to the
//! inference servers, adapter versions published by the learner, and the
//! games the env-runners play.
//!
//! Token ids travel as `u32` tensors, per-token log-probs as `f32` tensors.

use serde::{Deserialize, Serialize};

use crate::blob::WeightsBlob;
use crate::codec::{Rejection, WireMessage, SCHEMA_VERSION};
use crate::messages::{invalid, tensor_check};
use crate::tensor::{DType, Tensor};

/// Which LoRA adapter to apply over the base model.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct AdapterRef {
    /// The adapter's name: `policy` for the run's learning adapter, or the
    /// name of an opponent the inference servers were given.
    pub name: String,
    /// A published version; `None` asks for the newest one the server knows.
    pub version: Option<u64>,
}

/// One chat turn.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatMessage {
    /// `system`, `user` or `assistant`.
    pub role: String,
    pub content: String,
}

/// What to complete.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Prompt {
    /// Raw text, tokenized as is: no chat template, no special tokens added
    /// (write a BOS token into the text if the model wants one).
    Text(String),
    /// Chat turns, rendered with the model's chat template and a generation prompt.
    Chat(Vec<ChatMessage>),
    /// Token ids, `u32 [p]`.
    Tokens(Tensor),
}

/// How to pick each next token.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SamplingParams {
    /// 0 is greedy (arg-max).
    pub temperature: f32,
    /// Nucleus sampling: the smallest set of tokens whose probability reaches
    /// this (1 keeps all).
    pub top_p: f32,
    /// Keep only the `top_k` most likely tokens (0 keeps all).
    pub top_k: u32,
    /// Most completion tokens to generate (not applied under `allowed`,
    /// whose strings bound the length).
    pub max_tokens: u32,
    /// Stop once the completion text contains one of these (the text ends
    /// with the stop string; not applied under `allowed`).
    pub stop: Vec<String>,
    /// Seed of this request's sampling; `None` draws one.
    pub seed: Option<u64>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            max_tokens: 32,
            stop: Vec::new(),
            seed: None,
        }
    }
}

/// env-runner / evaluator / `relay play` -> inference-server (`relay.<run>.generate`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GenerateRequest {
    pub schema: u16,
    /// Adapter to apply; `None` is the base model alone.
    pub adapter: Option<AdapterRef>,
    pub prompt: Prompt,
    pub sampling: SamplingParams,
    /// Constrained decoding: when not empty, the completion is exactly one of
    /// these strings (e.g. a game's legal moves), sampled token by token
    /// among the tokens that keep it on one of them (each string's tokens
    /// are its own tokenization, without special tokens). Where one string's
    /// tokens are a prefix of another's, the model may also end with its
    /// end-of-sequence token there. The reply's `logprobs` stay those of
    /// the unconstrained policy.
    pub allowed: Vec<String>,
    /// With `allowed`: the model first writes free text (its thought, up
    /// to `sampling.max_tokens` tokens), and the constraint applies only to
    /// the answer after it (see [`AnswerFrame`]). `None`: the whole
    /// completion is constrained.
    #[serde(default)]
    pub answer_frame: Option<AnswerFrame>,
}

/// How a constrained answer sits in a free-text completion: where the
/// model writes `opener` (e.g. `\boxed{`), the rest of its completion is
/// one of the allowed strings and then `closer` (`}`); where it ends its
/// turn or reaches `max_tokens` first, `opener`, one of the allowed strings
/// and `closer` are decoded in place of that end (the end-of-turn token it
/// sampled is dropped). An empty `opener` (answers read as the last `[...]`)
/// leaves only the second way.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AnswerFrame {
    pub opener: String,
    pub closer: String,
}

impl GenerateRequest {
    pub fn new(adapter: Option<AdapterRef>, prompt: Prompt, sampling: SamplingParams) -> Self {
        Self {
            schema: SCHEMA_VERSION,
            adapter,
            prompt,
            sampling,
            allowed: Vec::new(),
            answer_frame: None,
        }
    }
}

/// Most tokens one request may ask for.
pub const MAX_GENERATE_TOKENS: u32 = 4096;

impl WireMessage for GenerateRequest {
    const KIND: &'static str = "GenerateRequest";
    fn schema(&self) -> u16 {
        self.schema
    }
    fn validate(&self) -> Result<(), Rejection> {
        const K: &str = "GenerateRequest";
        let s = &self.sampling;
        if !(s.temperature.is_finite() && s.temperature >= 0.0) {
            return Err(invalid(
                K,
                "sampling.temperature",
                "must be finite and >= 0",
            ));
        }
        if !(s.top_p.is_finite() && s.top_p > 0.0 && s.top_p <= 1.0) {
            return Err(invalid(K, "sampling.top_p", "must be in (0, 1]"));
        }
        if s.max_tokens == 0 || s.max_tokens > MAX_GENERATE_TOKENS {
            return Err(invalid(
                K,
                "sampling.max_tokens",
                format!("must be in 1..={MAX_GENERATE_TOKENS}"),
            ));
        }
        if s.stop.iter().any(String::is_empty) {
            return Err(invalid(K, "sampling.stop", "empty stop string"));
        }
        if self.allowed.iter().any(String::is_empty) {
            return Err(invalid(K, "allowed", "empty allowed completion"));
        }
        if self.answer_frame.is_some() && self.allowed.is_empty() {
            return Err(invalid(
                K,
                "answer_frame",
                "set without allowed completions to constrain the answer to",
            ));
        }
        if self.adapter.as_ref().is_some_and(|a| a.name.is_empty()) {
            return Err(invalid(K, "adapter.name", "empty"));
        }
        match &self.prompt {
            Prompt::Tokens(t) => {
                tensor_check(K, "prompt", t.expect(DType::U32, &[None]))?;
                if t.numel() == 0 {
                    return Err(invalid(K, "prompt", "no tokens"));
                }
            }
            Prompt::Chat(turns) if turns.is_empty() => {
                return Err(invalid(K, "prompt", "no chat turns"));
            }
            _ => {}
        }
        Ok(())
    }
}

/// Why a completion ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum FinishReason {
    /// The model produced an end-of-sequence token: the last of
    /// `completion_tokens` (with its log-prob, as the policy chose it), left
    /// out of `text`.
    Eos,
    /// A stop string appeared.
    Stop,
    /// `max_tokens` reached, or the model's context is full.
    Length,
    /// The completion spelled one of the allowed strings in full; `text`
    /// is that string (an end-of-sequence token that ended it is the last
    /// of `completion_tokens`).
    Allowed,
}

/// inference-server -> requester.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GenerateReply {
    pub schema: u16,
    /// The adapter applied, with the version actually used (`None`: the base model).
    pub adapter: Option<AdapterRef>,
    /// `u32 [p]`: the prompt as the model saw it (after the chat template).
    pub prompt_tokens: Tensor,
    /// `u32 [c]`: the completion.
    pub completion_tokens: Tensor,
    /// `f32 [c]`: log-probability of each completion token under the policy
    /// at temperature 1, before top-k / top-p / constraints (what the
    /// learner's importance ratios need); finite and <= 0.
    pub logprobs: Tensor,
    /// The completion decoded.
    pub text: String,
    pub finish: FinishReason,
    /// With an [`AnswerFrame`]: the index in `completion_tokens` where the
    /// constrained part began (the thought is before it; equal to the
    /// request's `max_tokens` when the thought used them all). `None`:
    /// no answer frame.
    #[serde(default)]
    pub answer_start: Option<u32>,
}

impl WireMessage for GenerateReply {
    const KIND: &'static str = "GenerateReply";
    fn schema(&self) -> u16 {
        self.schema
    }
    fn validate(&self) -> Result<(), Rejection> {
        const K: &str = "GenerateReply";
        tensor_check(
            K,
            "prompt_tokens",
            self.prompt_tokens.expect(DType::U32, &[None]),
        )?;
        tensor_check(
            K,
            "completion_tokens",
            self.completion_tokens.expect(DType::U32, &[None]),
        )?;
        let c = self.completion_tokens.numel();
        tensor_check(K, "logprobs", self.logprobs.expect(DType::F32, &[Some(c)]))?;
        // A sampled token always has mass under the policy, so its log-prob
        // is finite.
        let lp = self.logprobs.to_f32().expect("checked dtype");
        if let Some(index) = lp.iter().position(|v| !v.is_finite()) {
            return Err(Rejection::Tensor {
                kind: K,
                field: "logprobs".into(),
                source: crate::TensorError::NonFinite { index },
            });
        }
        if let Some(index) = lp.iter().position(|v| *v > 0.0) {
            return Err(invalid(
                K,
                "logprobs",
                format!("log-prob {} at {index} is positive", lp[index]),
            ));
        }
        Ok(())
    }
}

/// The object holding an adapter version's PEFT `adapter_config.json` in
/// the run's adapter bucket, under the version's key (`<name>/v<N>`).
pub const ADAPTER_CONFIG_OBJECT: &str = "adapter_config.json";
/// The object holding an adapter version's `adapter_model.safetensors`,
/// under the same key.
pub const ADAPTER_WEIGHTS_OBJECT: &str = "adapter_model.safetensors";

/// learner -> inference-servers, evaluators (`relay.<run>.adapters`): a
/// new version of a LoRA adapter over the run's base model. Its
/// `adapter_model.safetensors` travels as every weights version does
/// ([`WeightsBlob`]: inline when small, else fetched).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AdapterUpdate {
    pub schema: u16,
    pub name: String,
    pub version: u64,
    pub learner_env_steps: u64,
    /// PEFT `adapter_config.json`.
    pub config_json: String,
    /// PEFT `adapter_model.safetensors`.
    pub weights: WeightsBlob,
    /// When the publisher began publishing this version ([`crate::unix_ms`]
    /// on its clock, before any upload), so receivers measure the whole
    /// transfer; 0: unknown.
    #[serde(default)]
    pub published_unix_ms: u64,
}

impl WireMessage for AdapterUpdate {
    const KIND: &'static str = "AdapterUpdate";
    fn schema(&self) -> u16 {
        self.schema
    }
    fn validate(&self) -> Result<(), Rejection> {
        const K: &str = "AdapterUpdate";
        if self.name.is_empty() {
            return Err(invalid(K, "name", "empty"));
        }
        if self.config_json.is_empty() {
            return Err(invalid(K, "config_json", "empty"));
        }
        self.weights.check(K, "weights")
    }
}

/// Who sits in one seat of a game.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum SeatPolicy {
    /// An LLM with this adapter (`None`: the base model).
    Model(Option<AdapterRef>),
    /// A fixed bot: `random`, `minimax`, ...
    Bot(String),
}

/// One move of one player: what it saw and what it generated.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TextTurn {
    pub player: u8,
    /// `u32 [p]`: the prompt tokens (empty for bots).
    pub prompt_tokens: Tensor,
    /// `u32 [c]`: the completion tokens (empty for bots).
    pub completion_tokens: Tensor,
    /// `f32 [c]`: behaviour log-prob of each completion token.
    pub logprobs: Tensor,
    /// The action sent to the game: the answer the run's answer format
    /// read from `completion` (all of it under the `raw` format; empty when
    /// it found none), or a bot's move.
    pub action: String,
    /// The game refused the move.
    pub invalid: bool,
    /// The adapter that generated this move, with the version the inference
    /// server reported (`None`: a bot, or the base model alone).
    pub adapter: Option<AdapterRef>,
    /// What the player saw: its observation as the prompt's user turn
    /// carried it (before the chat template); for a bot, the same view.
    #[serde(default)]
    pub observation: String,
    /// The model's whole reply, thought and answer (empty for bots).
    #[serde(default)]
    pub completion: String,
    /// The answer format found no answer in `completion`.
    #[serde(default)]
    pub no_answer: bool,
    /// The reply reached the token limit before its answer (a truncated
    /// thought; with an answer frame, the answer was then decoded after it).
    #[serde(default)]
    pub truncated: bool,
}

/// env-runner -> replay-buffer (a queue group), tracker
/// (`relay.<run>.games`): one finished game. The evaluator's games travel
/// inside an [`EvalGame`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GameRecord {
    pub schema: u16,
    pub runner_id: String,
    pub env_id: String,
    /// The game's reset seed.
    pub seed: u64,
    /// Seat `i` is player `i` (player 0 moves first); the seating was drawn
    /// by the game's player (a seeded shuffle in the env-runner).
    pub seats: Vec<SeatPolicy>,
    /// The seat of the learning policy, whose reward is the episode return
    /// (in mirror games, where the learning adapter holds every seat, the
    /// seat drawn for it); `None` when no seat learns.
    pub learner_seat: Option<u8>,
    pub turns: Vec<TextTurn>,
    /// Final reward of each player.
    pub rewards: Vec<f64>,
    /// The game's reason for its outcome, per player (TextArena's game_info).
    pub reasons: Vec<String>,
    /// Wall time of the game.
    pub duration_ms: u64,
    /// When the game ended ([`crate::unix_ms`] on the env-runner's clock),
    /// for the replay buffer's age bound (`replay.max_age_s`); 0: unknown
    /// (an older env-runner), never too old.
    #[serde(default)]
    pub finished_unix_ms: u64,
    /// Set when the game is one of several continuations of one position
    /// (`text.branches`); `None` for a plain game.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub branch: Option<Branch>,
}

/// One of `size` games that share their first `turn` turns and go on
/// independently from there: the learning seat's move at `turn` is sampled
/// once per game from the same prompt, so those moves form a group of
/// several completions of one prompt whose returns differ only by what
/// followed (the learner's `rloo`/`grpo` baseline for that position).
/// Continuation 0 is the whole game; the others replayed the shared turns
/// and train on their own moves only (from `turn` on).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Branch {
    /// Shared by the continuations of one position (unique per position).
    pub group: u64,
    /// Index of the branching move: turns before it are shared.
    pub turn: u32,
    /// This continuation, `0..size`.
    pub index: u32,
    /// Continuations of the position.
    pub size: u32,
}

impl WireMessage for GameRecord {
    const KIND: &'static str = "GameRecord";
    fn schema(&self) -> u16 {
        self.schema
    }
    fn validate(&self) -> Result<(), Rejection> {
        const K: &str = "GameRecord";
        let n = self.seats.len();
        if n == 0 {
            return Err(invalid(K, "seats", "no players"));
        }
        if self.rewards.len() != n {
            return Err(invalid(
                K,
                "rewards",
                format!("{} rewards for {n} seats", self.rewards.len()),
            ));
        }
        if self.rewards.iter().any(|r| !r.is_finite()) {
            return Err(invalid(K, "rewards", "non-finite reward"));
        }
        if let Some(seat) = self.learner_seat {
            if seat as usize >= n {
                return Err(invalid(K, "learner_seat", format!("seat {seat} of {n}")));
            }
        }
        if self.env_id.is_empty() {
            return Err(invalid(K, "env_id", "empty"));
        }
        for seat in &self.seats {
            match seat {
                SeatPolicy::Model(Some(a)) if a.name.is_empty() => {
                    return Err(invalid(K, "seats", "empty adapter name"));
                }
                SeatPolicy::Bot(name) if name.is_empty() => {
                    return Err(invalid(K, "seats", "empty bot name"));
                }
                _ => {}
            }
        }
        for turn in &self.turns {
            if turn.player as usize >= n {
                return Err(invalid(
                    K,
                    "turns.player",
                    format!("player {} of {n}", turn.player),
                ));
            }
            tensor_check(
                K,
                "turns.prompt_tokens",
                turn.prompt_tokens.expect(DType::U32, &[None]),
            )?;
            tensor_check(
                K,
                "turns.completion_tokens",
                turn.completion_tokens.expect(DType::U32, &[None]),
            )?;
            let c = turn.completion_tokens.numel();
            tensor_check(
                K,
                "turns.logprobs",
                turn.logprobs.expect(DType::F32, &[Some(c)]),
            )?;
            let lp = turn.logprobs.to_f32().expect("checked dtype");
            if lp.iter().any(|v| !v.is_finite() || *v > 0.0) {
                return Err(invalid(
                    K,
                    "turns.logprobs",
                    "non-finite or positive log-prob",
                ));
            }
            if turn.adapter.as_ref().is_some_and(|a| a.name.is_empty()) {
                return Err(invalid(K, "turns.adapter", "empty adapter name"));
            }
        }
        if let Some(b) = self.branch {
            if b.size < 2 || b.index >= b.size {
                return Err(invalid(
                    K,
                    "branch",
                    format!("continuation {} of {}", b.index, b.size),
                ));
            }
            if b.turn as usize >= self.turns.len() {
                return Err(invalid(
                    K,
                    "branch.turn",
                    format!("turn {} of {}", b.turn, self.turns.len()),
                ));
            }
        }
        Ok(())
    }
}

impl GameRecord {
    /// Seats that play as the learning seat does: the learning seat itself
    /// and, in mirror games, every other seat with the same policy (empty
    /// when no seat learns).
    pub fn learning_seats(&self) -> Vec<usize> {
        let Some(learner) = self.learner_seat else {
            return Vec::new();
        };
        let own = &self.seats[learner as usize];
        (0..self.seats.len())
            .filter(|&s| &self.seats[s] == own)
            .collect()
    }

    /// Moves of the learning seats that the model generated (with tokens):
    /// what the learner trains on and the replay buffer counts.
    pub fn learning_turns(&self) -> impl Iterator<Item = &TextTurn> {
        self.learning_turn_indices().map(|i| &self.turns[i])
    }

    /// Indices (into `turns`) of [`Self::learning_turns`]. A branch
    /// continuation other than the first leaves out the turns it replayed.
    pub fn learning_turn_indices(&self) -> impl Iterator<Item = usize> + '_ {
        let seats = self.learning_seats();
        (self.own_turns_from()..self.turns.len()).filter(move |&i| {
            let t = &self.turns[i];
            seats.contains(&(t.player as usize)) && t.completion_tokens.numel() > 0
        })
    }

    /// Index of the first turn this record played itself: 0, or the
    /// branching move of a continuation that replayed the turns before it.
    pub fn own_turns_from(&self) -> usize {
        match self.branch {
            Some(b) if b.index > 0 => b.turn as usize,
            _ => 0,
        }
    }

    /// The oldest adapter version among the learning turns (a game may
    /// span versions; it is as stale as its oldest move). `None` when no
    /// learning turn names a version.
    pub fn learning_version(&self) -> Option<u64> {
        self.learning_turns()
            .filter_map(|t| t.adapter.as_ref().and_then(|a| a.version))
            .min()
    }
}

/// evaluator -> tracker (`relay.<run>.eval.games`): one game a text
/// evaluation played, for the run directory's `games.jsonl` (the tracker
/// is its one writer, of training and evaluation games alike).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EvalGame {
    pub schema: u16,
    /// The plugin that played it (`vs-opponent`), as its `EvalReport` names it.
    pub evaluator: String,
    /// The evaluator copy.
    pub instance: String,
    /// The learning adapter version the evaluation played.
    pub policy_version: u64,
    /// The opponent as the plugin names it: `random`, `minimax`, `self`,
    /// `base`, `adapter:<name>`; `none` in a single-player game.
    pub opponent: String,
    /// One of the confirmation's games (else the screening's).
    pub confirmation: bool,
    pub game: GameRecord,
}

impl WireMessage for EvalGame {
    const KIND: &'static str = "EvalGame";
    fn schema(&self) -> u16 {
        self.schema
    }
    fn validate(&self) -> Result<(), Rejection> {
        if self.evaluator.is_empty() {
            return Err(invalid("EvalGame", "evaluator", "empty"));
        }
        if self.opponent.is_empty() {
            return Err(invalid("EvalGame", "opponent", "empty"));
        }
        self.game.validate()
    }
}

/// learner -> replay-buffer (`relay.<run>.replay.games.sample`): whole
/// games, oldest first, for one training batch.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GameSampleRequest {
    pub schema: u16,
    /// Games whose learning turns were played by an older adapter version
    /// are dropped (and counted).
    pub min_policy_version: u64,
    /// Stop taking games once this many learning turns are gathered (the
    /// last game may overshoot it).
    pub max_turns: u32,
}

impl WireMessage for GameSampleRequest {
    const KIND: &'static str = "GameSampleRequest";
    fn schema(&self) -> u16 {
        self.schema
    }
    fn validate(&self) -> Result<(), Rejection> {
        if self.max_turns == 0 {
            return Err(invalid(
                "GameSampleRequest",
                "max_turns",
                "must be positive",
            ));
        }
        Ok(())
    }
}

/// replay-buffer -> learner: the games taken, oldest first.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GameSampleReply {
    pub schema: u16,
    pub games: Vec<GameRecord>,
    /// Games dropped for being older than `min_policy_version`.
    pub dropped_stale: u64,
}

impl WireMessage for GameSampleReply {
    const KIND: &'static str = "GameSampleReply";
    fn schema(&self) -> u16 {
        self.schema
    }
    fn validate(&self) -> Result<(), Rejection> {
        self.games.iter().try_for_each(WireMessage::validate)
    }
}

/// inference-server, evaluator -> learner (`relay.<run>.adapters.latest`):
/// the newest published version of adapter `name`, answered with its
/// [`AdapterUpdate`] (so a service that starts after a publication still
/// gets the current version).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AdapterRequest {
    pub schema: u16,
    pub name: String,
}

impl WireMessage for AdapterRequest {
    const KIND: &'static str = "AdapterRequest";
    fn schema(&self) -> u16 {
        self.schema
    }
    fn validate(&self) -> Result<(), Rejection> {
        if self.name.is_empty() {
            return Err(invalid("AdapterRequest", "name", "empty"));
        }
        Ok(())
    }
}
