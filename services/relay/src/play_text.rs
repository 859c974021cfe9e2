//! `relay play` for the text games: a language model (a run's base model
//! with a checkpoint's LoRA adapter, or any model given by `--model`)
//! plays one seat; the other seat is you at the terminal (`--opponent
//! human`, the default) or a fixed bot (`random`, `minimax`,
//! `connect_four_bot`). Each turn prints what the player to move sees
//! since its last turn, then the move; the end prints the rewards and the
//! game's reasons.
//!
//! The model is prompted as the inference server prompts it: the player's
//! observation as the user turn of the model's chat template, followed by
//! the generation prompt; the completion (until an end-of-turn token or
//! `--max-tokens`) is the move.

use std::io::{BufRead, Write};
use std::path::Path;
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use relay_config::GgufBaseName;
use relay_envs::text::{AnswerReader, Bot, ObservationView, TextGame};
use relay_llm::{
    CausalLm, ChatMessage, LoraAdapter, Sampler, SamplingParams, Sequence, StopCondition, Tokenizer,
};

/// A language model ready to play: weights and tokenizer.
pub struct Player {
    model: CausalLm,
    tokenizer: Tokenizer,
    adapter: Option<Arc<LoraAdapter>>,
    /// Sent before each observation (`text.system_prompt`).
    system_prompt: Option<String>,
    /// How each observation is rendered (`text.observation`).
    observation: ObservationView,
    /// Where the move is in the reply (`text.answer`).
    answer: AnswerReader,
    stop: StopCondition,
    /// `None`: greedy.
    sampling: Option<SamplingParams>,
    /// Seed of the next move's sampler (each move draws with its own).
    seed: u64,
}

impl Player {
    /// Loads `model` with the PEFT adapter in `adapter` (if any).
    pub fn new(
        model: &str,
        adapter: Option<&Path>,
        temperature: f32,
        max_tokens: usize,
        seed: u64,
    ) -> Result<Self> {
        // Loaded as the inference server loads `llm.model`, dequantized (the fastest on a CPU).
        let relay_llm::LoadedModel {
            model, tokenizer, ..
        } = relay_llm::load_model(model, GgufBaseName::Dequantized)?;
        let adapter = adapter
            .map(|dir| {
                LoraAdapter::load_peft(dir, model.config())
                    .map(Arc::new)
                    .with_context(|| format!("adapter {}", dir.display()))
            })
            .transpose()?;
        Ok(Self::from_parts(
            model,
            tokenizer,
            adapter,
            temperature,
            max_tokens,
            seed,
        ))
    }

    /// A player over a model already in memory (e.g. one being trained).
    pub fn from_parts(
        model: CausalLm,
        tokenizer: Tokenizer,
        adapter: Option<Arc<LoraAdapter>>,
        temperature: f32,
        max_tokens: usize,
        seed: u64,
    ) -> Self {
        let mut stop_token_ids = model.config().eos_token_ids.clone();
        stop_token_ids.extend(tokenizer.eos_token_id());
        let sampling = (temperature > 0.0).then(|| SamplingParams {
            temperature,
            ..SamplingParams::default()
        });
        Self {
            model,
            tokenizer,
            adapter,
            system_prompt: None,
            observation: ObservationView::Full,
            answer: AnswerReader::new(&Default::default()).expect("raw needs no pattern"),
            stop: StopCondition {
                max_new_tokens: max_tokens,
                stop_token_ids,
            },
            sampling,
            seed,
        }
    }

    /// Prompts as `text.system_prompt` and `text.observation` make the
    /// env-runners do: `system` before each observation, rendered as
    /// `observation`.
    pub fn with_prompting(mut self, system: Option<String>, observation: ObservationView) -> Self {
        self.system_prompt = system;
        self.observation = observation;
        self
    }

    /// Reads the move from each reply as `text.answer` makes the
    /// env-runners read it.
    pub fn with_answer(mut self, answer: AnswerReader) -> Self {
        self.answer = answer;
        self
    }

    /// Reads moves as [`Self::with_answer`] and renders the chat template
    /// with `llm.chat_template_kwargs`: how a run's config prompts and
    /// reads its model.
    pub fn with_run_text(
        self,
        answer: AnswerReader,
        chat_template_kwargs: serde_json::Map<String, serde_json::Value>,
    ) -> Self {
        let mut player = self.with_answer(answer);
        player
            .tokenizer
            .set_chat_template_kwargs(chat_template_kwargs);
        player
    }

    /// The model's reply as `player` of `game`, and the move read from it.
    pub fn choose(&mut self, game: &dyn TextGame, player: usize) -> Result<ModelMove> {
        let observation = game.observation_as(player, self.observation);
        let mut messages = Vec::with_capacity(2);
        if let Some(system) = &self.system_prompt {
            messages.push(ChatMessage::system(system));
        }
        messages.push(ChatMessage::user(observation));
        let prompt = self.tokenizer.encode_chat(&messages, true)?;
        let sampler = match &self.sampling {
            None => Sampler::greedy(),
            Some(params) => Sampler::new(params.clone(), self.seed)?,
        };
        self.seed = self.seed.wrapping_add(1);
        let mut seq = Sequence::new(
            &self.model,
            prompt,
            self.adapter.clone(),
            sampler,
            self.stop.clone(),
        )?;
        relay_llm::generate(&self.model, &mut seq)?;
        let reply = self
            .tokenizer
            .decode(seq.tokens(), true)?
            .trim()
            .to_string();
        let action = self.answer.read(&reply).action;
        Ok(ModelMove { reply, action })
    }
}

/// What the model said, and the move the answer format read from it.
pub struct ModelMove {
    pub reply: String,
    pub action: String,
}

/// Who sits in a seat.
enum Seat<'a> {
    Model(&'a mut Player),
    Bot(Box<dyn Bot>),
    Human,
}

/// How one game went.
#[derive(Debug, Clone, PartialEq)]
pub struct GameSummary {
    /// Final reward per seat.
    pub rewards: Vec<f64>,
    /// Moves the model submitted.
    pub model_moves: u32,
    /// Of those, the moves the game refused.
    pub model_invalid_moves: u32,
}

/// Plays `game` (reset with `seed`) with the model in seat `model_seat`
/// and `opponent` in the other; prints every turn to `out`, reads the
/// human's moves from `input`.
pub fn play_game(
    mut game: Box<dyn TextGame>,
    player: &mut Player,
    model_seat: usize,
    opponent: &str,
    seed: u64,
    input: &mut dyn BufRead,
    out: &mut dyn Write,
) -> Result<GameSummary> {
    let env_id = game.id();
    game.reset(seed);
    let players = game.num_players();
    if model_seat >= players {
        bail!("--model-seat {model_seat}: {env_id} has {players} player(s)");
    }
    let mut opponents: Vec<Seat> = Vec::new();
    for _ in 1..players {
        opponents.push(match opponent {
            "human" => Seat::Human,
            name => Seat::Bot(
                relay_policy::text::make_bot(name, seed, &Default::default())
                    .map_err(|e| anyhow::anyhow!("--opponent: {e} (or human)"))?,
            ),
        });
    }
    let mut seats: Vec<Seat> = Vec::with_capacity(players);
    let mut others = opponents.into_iter();
    let mut model = Some(player);
    for p in 0..players {
        if p == model_seat {
            seats.push(Seat::Model(model.take().expect("one model seat")));
        } else {
            seats.push(others.next().expect("one opponent per other seat"));
        }
    }
    // What each player has been shown already.
    let mut shown = vec![0usize; players];
    let (mut model_moves, mut model_invalid_moves) = (0, 0);
    while !game.is_done() {
        let p = game.current_player();
        let observation = game.observation(p);
        let new = observation.get(shown[p]..).unwrap_or(&observation);
        writeln!(out, "--- player {p} sees:{new}")?;
        shown[p] = observation.len();
        let action = match &mut seats[p] {
            Seat::Model(player) => {
                let ModelMove { reply, action } = player.choose(game.as_ref(), p)?;
                if reply == action {
                    writeln!(out, "player {p} (model): {action}")?;
                } else {
                    writeln!(out, "player {p} (model) says: {reply}")?;
                    writeln!(out, "player {p} (model) answers: {action:?}")?;
                }
                action
            }
            Seat::Bot(bot) => {
                let action = bot.choose_move(game.as_ref())?;
                writeln!(out, "player {p} ({}): {action}", bot.name())?;
                action
            }
            Seat::Human => {
                write!(out, "your move ({}): ", game.legal_moves().join(" "))?;
                out.flush()?;
                let mut line = String::new();
                if input.read_line(&mut line)? == 0 {
                    bail!("no move: standard input closed");
                }
                line.trim().to_string()
            }
        };
        let outcome = game.step(&action)?;
        if p == model_seat {
            model_moves += 1;
            model_invalid_moves += u32::from(outcome.invalid_move);
        }
        if outcome.invalid_move {
            writeln!(out, "player {p}: invalid move {action:?}")?;
        }
    }
    let rewards = game.rewards().unwrap_or_default();
    for (p, info) in game.game_info().iter().enumerate() {
        let role = match &seats[p] {
            Seat::Model(_) => "model",
            Seat::Bot(b) => b.name(),
            Seat::Human => "you",
        };
        writeln!(
            out,
            "player {p} ({role}): reward {} {}",
            rewards.get(p).copied().unwrap_or(f64::NAN),
            info.reason.as_deref().unwrap_or("")
        )?;
    }
    Ok(GameSummary {
        rewards,
        model_moves,
        model_invalid_moves,
    })
}
