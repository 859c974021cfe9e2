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
use relay_envs::text::Bot;
use relay_kit::config::GgufBaseName;
use relay_llm::{
    CausalLm, ChatMessage, LoraAdapter, Sampler, SamplingParams, Sequence, StopCondition, Tokenizer,
};

/// A language model ready to play: weights and tokenizer.
pub struct Player {
    model: CausalLm,
    tokenizer: Tokenizer,
    adapter: Option<Arc<LoraAdapter>>,
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
        let relay_inference_server::llm::LoadedModel {
            model, tokenizer, ..
        } = relay_inference_server::llm::load_model(model, GgufBaseName::Dequantized)?;
        let adapter = adapter
            .map(|dir| {
                LoraAdapter::load_peft(dir, model.config())
                    .map(Arc::new)
                    .with_context(|| format!("adapter {}", dir.display()))
            })
            .transpose()?;
        let mut stop_token_ids = model.config().eos_token_ids.clone();
        stop_token_ids.extend(tokenizer.eos_token_id());
        let sampling = (temperature > 0.0).then(|| SamplingParams {
            temperature,
            ..SamplingParams::default()
        });
        Ok(Self {
            model,
            tokenizer,
            adapter,
            stop: StopCondition {
                max_new_tokens: max_tokens,
                stop_token_ids,
            },
            sampling,
            seed,
        })
    }

    /// The model's move for `observation`.
    pub fn choose(&mut self, observation: &str) -> Result<String> {
        let prompt = self
            .tokenizer
            .encode_chat(&[ChatMessage::user(observation)], true)?;
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
        Ok(self
            .tokenizer
            .decode(seq.tokens(), true)?
            .trim()
            .to_string())
    }
}

/// Who sits in a seat.
enum Seat<'a> {
    Model(&'a mut Player),
    Bot(Box<dyn Bot>),
    Human,
}

/// Plays one game of `env_id` with the model in seat `model_seat` and
/// `opponent` in the other; prints every turn to `out`, reads the human's
/// moves from `input`. Returns the final rewards.
pub fn play_game(
    env_id: &str,
    player: &mut Player,
    model_seat: usize,
    opponent: &str,
    seed: u64,
    input: &mut dyn BufRead,
    out: &mut dyn Write,
) -> Result<Vec<f64>> {
    let mut game = relay_envs::make_text_game(env_id)?;
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
    while !game.is_done() {
        let p = game.current_player();
        let observation = game.observation(p);
        let new = observation.get(shown[p]..).unwrap_or(&observation);
        writeln!(out, "--- player {p} sees:{new}")?;
        shown[p] = observation.len();
        let action = match &mut seats[p] {
            Seat::Model(player) => {
                let action = player.choose(&observation)?;
                writeln!(out, "player {p} (model): {action}")?;
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
    Ok(rewards)
}
