//! Supervised fine-tuning: cross-entropy on the completion tokens of
//! (observation → action) pairs, for a LoRA adapter or for every weight
//! of a model.
//!
//! This module owns:
//! - [`SftExample`] (token ids) and [`SftRecord`] (text), the JSONL reader
//!   [`read_sft_jsonl`] and the rendering [`encode_record`] / [`chat_pair`];
//! - [`sft_loss`] and [`SftTrainer`] (micro-batches, gradient accumulation,
//!   AdamW), with [`SftStats`];
//! - [`load_hf_trainable`] / [`save_hf_trainable`]: a Hugging Face model
//!   whose weights are `Var`s in a `VarMap`, so full fine-tuning trains all
//!   of them.
//!
//! # Data
//!
//! One JSON object per line, either a pair of texts
//! `{"prompt": "<observation>", "completion": "<move>"}` or a conversation
//! `{"messages": [{"role": "user", "content": ...}, {"role": "assistant",
//! "content": ...}]}` whose last message (the assistant's) is the
//! completion. Blank lines are skipped.
//!
//! With [`SftFormat::Chat`] (the default) a pair is rendered the way the
//! inference server prompts the policy: the observation as the user turn
//! (after an optional system prompt) through the tokenizer's chat
//! template with the generation prompt, then the move's tokens
//! (`encode(move, add_special_tokens = false)`, exactly what the server's
//! constrained decoding matches) followed by the end-of-turn token (the
//! tokenizer's EOS, `<|im_end|>` for ChatML), so the model learns to stop.
//! [`SftFormat::Raw`] tokenizes prompt and completion as they are.
//!
//! # Loss
//!
//! `−Σ_{i,t} w[i,t] · log p(completion[i,t] | prefix)` over completion
//! tokens only (prompt and padding are masked as in
//! [`crate::token_batch`]), with the weights of an [`Aggregation`]
//! (token mean by default). A pair may list `alternatives`: the moves its
//! policy would have played with equal probability (every legal move, for
//! a random player). Each completion token's target is then that policy's
//! next-token distribution ([`next_token_targets`]), so one example teaches
//! the whole distribution (e.g. "any legal move") instead of one sample of
//! it, whose noise hides that signal for thousands of steps.
//!
//! # Full fine-tuning
//!
//! [`CausalLm::new`] takes any `VarBuilder`; built from a `VarMap`, every
//! weight it reads is a `Var` (the tied LM head shares the embedding's),
//! and [`CausalLm::forward_train`] passes gradients to all of them. Hand
//! [`named_vars`] of the map to [`SftTrainer::new`] and call the step with
//! no adapter. The inference forward reads the same storage, so the
//! trained weights serve at once.

use std::collections::HashMap;
use std::path::Path;

use candle_core::{DType, Device, Tensor, Var};
use candle_nn::{VarBuilder, VarMap};
use serde::{Deserialize, Serialize};

use crate::backend::Backend;
use crate::chat::ChatMessage;
use crate::config::ModelConfig;
use crate::hf_weights::HfWeights;
use crate::lora::LoraAdapter;
use crate::model::CausalLm;
use crate::optim::{AdamW, AdamWConfig, StepReport};
use crate::token_batch::{
    fit_to_length, micro_batches, target_log_probs, Aggregation, BatchConfig, BatchTotals, Fit,
    TokenBatch, TruncationStats,
};
use crate::tokenizer::Tokenizer;
use crate::train_error::{TrainError, TrainResult};
pub use crate::vars::{named_vars, set_var_values, var_values};

/// One (prompt, completion) pair as token ids.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SftExample {
    /// Prompt tokens (no loss); at least one.
    pub prompt: Vec<u32>,
    /// Completion tokens (the loss), end-of-turn token included; at least one.
    pub completion: Vec<u32>,
    /// Completions the data's policy chooses among with equal probability
    /// at this prompt (the completion among them), tokenized like it. When
    /// not empty, each completion token's target is the policy's whole
    /// next-token distribution along the completion ([`next_token_targets`])
    /// rather than the one sampled token: the same expected loss, with far
    /// less noise. Empty: the completion's own tokens are the targets.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub alternatives: Vec<Vec<u32>>,
}

/// One line of an SFT JSONL file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum SftRecord {
    /// An observation and the move to learn.
    Pair {
        /// The observation (the user turn, in chat format).
        prompt: String,
        /// The move (the assistant turn).
        completion: String,
        /// Moves the data's policy would have played with equal
        /// probability here (e.g. every legal move, for a random player);
        /// see [`SftExample::alternatives`]. Optional.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        alternatives: Vec<String>,
    },
    /// A conversation whose last message is the assistant's completion.
    Messages {
        /// The messages, the last one from `assistant`.
        messages: Vec<ChatMessage>,
    },
}

/// How an [`SftRecord::Pair`] becomes tokens.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum SftFormat {
    /// The chat template, as the inference server prompts (module docs).
    Chat {
        /// A system message before the observation, if the server sends one.
        #[serde(default)]
        system_prompt: Option<String>,
    },
    /// Plain text: `encode(prompt)`, `encode(completion)` (no special
    /// tokens added), plus the EOS token when `append_eos`.
    Raw {
        /// End the completion with the EOS token.
        append_eos: bool,
    },
}

impl Default for SftFormat {
    fn default() -> Self {
        Self::Chat {
            system_prompt: None,
        }
    }
}

fn end_of_turn(tokenizer: &Tokenizer) -> TrainResult<u32> {
    tokenizer
        .eos_token_id()
        .ok_or_else(|| TrainError::BadInput("the tokenizer has no EOS (end-of-turn) token".into()))
}

/// A chat-rendered pair: `encode_chat([system?, user(observation)], true)`
/// then `encode(action) ++ [EOS]`.
pub fn chat_pair(
    tokenizer: &Tokenizer,
    system_prompt: Option<&str>,
    observation: &str,
    action: &str,
) -> TrainResult<SftExample> {
    let mut messages = Vec::with_capacity(2);
    if let Some(system) = system_prompt {
        messages.push(ChatMessage::system(system));
    }
    messages.push(ChatMessage::user(observation));
    let prompt = tokenizer.encode_chat(&messages, true)?;
    let mut completion = tokenizer.encode(action, false)?;
    completion.push(end_of_turn(tokenizer)?);
    Ok(SftExample {
        prompt,
        completion,
        alternatives: Vec::new(),
    })
}

/// Tokenizes one record (module docs).
pub fn encode_record(
    tokenizer: &Tokenizer,
    format: &SftFormat,
    record: &SftRecord,
) -> TrainResult<SftExample> {
    let example = match record {
        SftRecord::Pair {
            prompt,
            completion,
            alternatives,
        } => {
            let append_eos = match format {
                SftFormat::Chat { .. } => true,
                SftFormat::Raw { append_eos } => *append_eos,
            };
            let encode_move = |action: &str| -> TrainResult<Vec<u32>> {
                let mut tokens = tokenizer.encode(action, false)?;
                if append_eos {
                    tokens.push(end_of_turn(tokenizer)?);
                }
                Ok(tokens)
            };
            let mut example = match format {
                SftFormat::Chat { system_prompt } => {
                    chat_pair(tokenizer, system_prompt.as_deref(), prompt, completion)?
                }
                SftFormat::Raw { .. } => SftExample {
                    prompt: tokenizer.encode(prompt, false)?,
                    completion: encode_move(completion)?,
                    alternatives: Vec::new(),
                },
            };
            if !alternatives.is_empty() {
                let mut encoded = alternatives
                    .iter()
                    .map(|a| encode_move(a))
                    .collect::<TrainResult<Vec<_>>>()?;
                if !encoded.contains(&example.completion) {
                    encoded.push(example.completion.clone());
                }
                example.alternatives = encoded;
            }
            example
        }
        SftRecord::Messages { messages } => {
            let Some((last, context)) = messages.split_last() else {
                return Err(TrainError::BadInput("no messages".into()));
            };
            if last.role != "assistant" || context.is_empty() {
                return Err(TrainError::BadInput(
                    "the last message must be the assistant's, after at least one other".into(),
                ));
            }
            let prompt = tokenizer.encode_chat(context, true)?;
            let mut completion = tokenizer.encode(&last.content, false)?;
            completion.push(end_of_turn(tokenizer)?);
            SftExample {
                prompt,
                completion,
                alternatives: Vec::new(),
            }
        }
    };
    if example.prompt.is_empty() || example.completion.is_empty() {
        return Err(TrainError::BadInput(
            "the record renders to an empty prompt or completion".into(),
        ));
    }
    Ok(example)
}

/// Reads an SFT JSONL file (module docs); errors name the line.
pub fn read_sft_jsonl(path: &Path) -> TrainResult<Vec<SftRecord>> {
    let text = std::fs::read_to_string(path).map_err(|source| TrainError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let mut records = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let record: SftRecord = serde_json::from_str(line).map_err(|e| TrainError::Jsonl {
            path: path.to_path_buf(),
            line: i + 1,
            reason: format!(
                "{e} (expected {{\"prompt\", \"completion\"}} or {{\"messages\": [...]}})"
            ),
        })?;
        records.push(record);
    }
    Ok(records)
}

/// [`read_sft_jsonl`] then [`encode_record`] on every line.
pub fn load_sft_jsonl(
    path: &Path,
    tokenizer: &Tokenizer,
    format: &SftFormat,
) -> TrainResult<Vec<SftExample>> {
    read_sft_jsonl(path)?
        .iter()
        .enumerate()
        .map(|(i, r)| {
            encode_record(tokenizer, format, r).map_err(|e| TrainError::Jsonl {
                path: path.to_path_buf(),
                line: i + 1,
                reason: e.to_string(),
            })
        })
        .collect()
}

/// The target distribution of each completion token: for token `i`, the
/// share of `alternatives` that continue `completion[..i]` with each next
/// token (the data policy's next-token distribution along the completion,
/// all alternatives equally likely). Without alternatives, or where none
/// continues the completion's prefix, the completion's own token.
pub fn next_token_targets(completion: &[u32], alternatives: &[Vec<u32>]) -> Vec<Vec<(u32, f32)>> {
    (0..completion.len())
        .map(|i| {
            let mut counts: Vec<(u32, usize)> = Vec::new();
            for a in alternatives {
                if a.len() > i && a[..i] == completion[..i] {
                    match counts.iter_mut().find(|(t, _)| *t == a[i]) {
                        Some((_, n)) => *n += 1,
                        None => counts.push((a[i], 1)),
                    }
                }
            }
            let total: usize = counts.iter().map(|(_, n)| n).sum();
            if total == 0 {
                return vec![(completion[i], 1.0)];
            }
            counts
                .into_iter()
                .map(|(t, n)| (t, n as f32 / total as f32))
                .collect()
        })
        .collect()
}

/// The SFT loss of one micro-batch from logits `(rows, time, vocab)`, or
/// from the logits at the completion positions only, `(tokens, vocab)`
/// ([`CausalLm::forward_train_batch`]):
/// `−Σ_i w_i Σ_t q_i(t) log p_i(t)` with `targets[i]` = `q_i` as
/// (token, probability) pairs ([`next_token_targets`]), one per completion
/// token in batch order. Returns `(loss, its value as f64, completion
/// tokens whose greedy prediction has target probability > 0)`.
pub fn sft_loss(
    logits: &Tensor,
    batch: &TokenBatch,
    weights: &Tensor,
    targets: &[Vec<(u32, f32)>],
) -> TrainResult<(Tensor, f64, usize)> {
    let completion = batch.completion_logits(logits)?;
    if targets.len() != batch.num_tokens() {
        return Err(TrainError::BadInput(format!(
            "{} target distributions for {} completion tokens",
            targets.len(),
            batch.num_tokens()
        )));
    }
    // One row per (token, target) pair: a hard target is one row.
    let mut rows = Vec::with_capacity(targets.len());
    let (mut tokens, mut probs) = (Vec::with_capacity(targets.len()), Vec::new());
    for (i, q) in targets.iter().enumerate() {
        for &(t, p) in q {
            rows.push(i as u32);
            tokens.push(t);
            probs.push(p);
        }
    }
    let device = completion.device();
    let n = rows.len();
    let rows_t = Tensor::from_vec(rows, n, device)?;
    let expanded = if n == targets.len() {
        completion.clone()
    } else {
        completion.index_select(&rows_t, 0)?
    };
    let logp = target_log_probs(&expanded, &Tensor::from_vec(tokens, n, device)?)?;
    let w = (weights.index_select(&rows_t, 0)? * Tensor::from_vec(probs, n, device)?)?;
    let loss = (logp * w)?.sum_all()?.neg()?;
    let value = loss.to_dtype(DType::F64)?.to_scalar::<f64>()?;
    if !value.is_finite() {
        return Err(TrainError::NonFinite {
            what: "loss",
            value,
        });
    }
    let predicted: Vec<u32> = completion.argmax(1)?.to_vec1()?;
    let correct = predicted
        .iter()
        .zip(targets)
        .filter(|(p, q)| q.iter().any(|(t, prob)| t == *p && *prob > 0.0))
        .count();
    Ok((loss, value, correct))
}

/// SFT settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SftConfig {
    /// Batch and micro-batch sizes, truncation.
    pub batch: BatchConfig,
    /// AdamW over the trained vars.
    #[serde(default)]
    pub optimizer: AdamWConfig,
    /// Per-token losses to one loss (token mean by default).
    #[serde(default)]
    pub aggregation: Aggregation,
}

impl SftConfig {
    /// Checks every part.
    pub fn validate(&self) -> TrainResult<()> {
        self.batch.validate()?;
        self.optimizer.validate()?;
        Ok(self.aggregation.validate()?)
    }
}

/// What one SFT step (or evaluation) did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct SftStats {
    /// The loss (aggregated negative log-likelihood of completion tokens).
    pub loss: f64,
    /// Fraction of completion tokens the model predicts greedily.
    pub token_accuracy: f64,
    /// Sequences used.
    pub sequences: usize,
    /// Completion tokens used.
    pub tokens: usize,
    /// Mean prompt + completion tokens (after truncation).
    pub mean_seq_len: f64,
    /// Sequences cut to `max_seq_len`.
    pub truncated: usize,
    /// Prompt tokens cut.
    pub tokens_cut: usize,
    /// Sequences dropped (too long).
    pub dropped: usize,
    /// Global gradient norm before clipping (0 for an evaluation).
    pub grad_norm: f64,
    /// Whether clipping scaled the gradient.
    pub grad_clipped: bool,
}

/// Trains an adapter or a whole model on [`SftExample`]s.
#[derive(Debug)]
pub struct SftTrainer {
    config: SftConfig,
    optimizer: AdamW,
}

impl SftTrainer {
    /// A trainer over `params`: [`LoraAdapter::named_vars`] for LoRA, or
    /// [`named_vars`] of a [`load_hf_trainable`] map for the full model.
    pub fn new(config: SftConfig, params: Vec<(String, Var)>) -> TrainResult<Self> {
        config.validate()?;
        let optimizer = AdamW::new(params, config.optimizer.clone())?;
        Ok(Self { config, optimizer })
    }

    /// The configuration.
    pub fn config(&self) -> &SftConfig {
        &self.config
    }

    /// The optimizer.
    pub fn optimizer(&self) -> &AdamW {
        &self.optimizer
    }

    /// The optimizer, to change the learning rate.
    pub fn optimizer_mut(&mut self) -> &mut AdamW {
        &mut self.optimizer
    }

    /// One optimizer step on `examples` (`1..=batch_size`), with
    /// `adapter` applied (`None`: the model's own weights train).
    pub fn train_step(
        &mut self,
        model: &CausalLm,
        adapter: Option<&LoraAdapter>,
        examples: &[SftExample],
    ) -> TrainResult<SftStats> {
        self.train_step_part(model, adapter, examples, &mut relay_nn::BatchShare::whole())
    }

    /// [`SftTrainer::train_step`] as one of several learner replicas
    /// (`share`): every replica holds all `examples` and computes its part
    /// of the micro-batches; the gradients and the loss sums are summed
    /// across replicas before the step (the losses are weighted by the
    /// whole batch's totals), and every replica steps alike.
    pub fn train_step_part(
        &mut self,
        model: &CausalLm,
        adapter: Option<&LoraAdapter>,
        examples: &[SftExample],
        share: &mut relay_nn::BatchShare<'_>,
    ) -> TrainResult<SftStats> {
        let mut stats = self.run(model, adapter, examples, Some(share))?;
        let report: StepReport = self.optimizer.step()?;
        stats.grad_norm = report.grad_norm;
        stats.grad_clipped = report.clipped;
        Ok(stats)
    }

    /// Adds the gradients of `examples` to the optimizer's sums without
    /// stepping.
    pub fn accumulate_gradients(
        &mut self,
        model: &CausalLm,
        adapter: Option<&LoraAdapter>,
        examples: &[SftExample],
    ) -> TrainResult<SftStats> {
        self.run(
            model,
            adapter,
            examples,
            Some(&mut relay_nn::BatchShare::whole()),
        )
    }

    /// The loss of `examples` (any number; micro-batched), no gradients.
    pub fn evaluate(
        &mut self,
        model: &CausalLm,
        adapter: Option<&LoraAdapter>,
        examples: &[SftExample],
    ) -> TrainResult<SftStats> {
        self.run(model, adapter, examples, None)
    }

    /// An epoch: shuffles nothing (the caller orders `examples`), steps on
    /// consecutive chunks of `batch_size`; returns each step's stats.
    pub fn train_epoch(
        &mut self,
        model: &CausalLm,
        adapter: Option<&LoraAdapter>,
        examples: &[SftExample],
    ) -> TrainResult<Vec<SftStats>> {
        examples
            .chunks(self.config.batch.batch_size)
            .map(|chunk| self.train_step(model, adapter, chunk))
            .collect()
    }

    /// The loss of `examples`; when training (`train`: this replica's part
    /// of the micro-batches and the sum across replicas) also their
    /// gradients, summed across the replicas.
    fn run(
        &mut self,
        model: &CausalLm,
        adapter: Option<&LoraAdapter>,
        examples: &[SftExample],
        train: Option<&mut relay_nn::BatchShare<'_>>,
    ) -> TrainResult<SftStats> {
        let cfg = &self.config;
        if train.is_some() {
            crate::token_batch::check_batch_len(&cfg.batch, examples.len())?;
        } else if examples.is_empty() {
            return Err(TrainError::BadInput("nothing to evaluate".into()));
        }
        let device = model.rope_cos.device().clone();
        let mut truncation = TruncationStats::default();
        let mut kept: Vec<(&[u32], &SftExample)> = Vec::with_capacity(examples.len());
        for (i, e) in examples.iter().enumerate() {
            if e.prompt.is_empty() || e.completion.is_empty() {
                return Err(TrainError::BadInput(format!(
                    "example {i}: empty prompt or completion"
                )));
            }
            let fit = fit_to_length(
                e.prompt.len(),
                e.completion.len(),
                cfg.batch.max_seq_len,
                cfg.batch.truncation,
            );
            truncation.record(fit);
            if let Fit::Keep { prompt_start } = fit {
                kept.push((&e.prompt[prompt_start..], e));
            }
        }
        if kept.is_empty() {
            return Err(TrainError::BadInput(format!(
                "all {} sequences are longer than max_seq_len {}",
                examples.len(),
                cfg.batch.max_seq_len
            )));
        }
        let lens: Vec<usize> = kept
            .iter()
            .map(|(p, e)| p.len() + e.completion.len())
            .collect();
        let totals = BatchTotals {
            sequences: kept.len(),
            tokens: kept.iter().map(|(_, e)| e.completion.len()).sum(),
        };
        let (mut loss, mut correct) = (0.0, 0usize);
        let chunks = micro_batches(&lens, cfg.batch.minibatch_size);
        let mine = match &train {
            Some(share) => &chunks[share.rows(chunks.len())],
            None => &chunks[..],
        };
        for chunk in mine {
            let rows: Vec<(&[u32], &[u32])> = chunk
                .iter()
                .map(|&i| (kept[i].0, kept[i].1.completion.as_slice()))
                .collect();
            let targets: Vec<Vec<(u32, f32)>> = chunk
                .iter()
                .flat_map(|&i| next_token_targets(&kept[i].1.completion, &kept[i].1.alternatives))
                .collect();
            let batch = TokenBatch::new(&rows, &device)?;
            let weights = batch.token_weights(&cfg.aggregation, totals)?;
            if train.is_none() {
                let logits = model.forward_train_batch(&batch, adapter)?.detach();
                let (_, value, c) = sft_loss(&logits, &batch, &weights, &targets)?;
                loss += value;
                correct += c;
                continue;
            }
            let forward = model.forward_train_for_backward(
                &batch,
                adapter,
                cfg.batch.recompute_activations,
            )?;
            let (l, value, c) = sft_loss(forward.logits(), &batch, &weights, &targets)?;
            self.optimizer.accumulate(&forward.backward(&l)?)?;
            loss += value;
            correct += c;
        }
        if let Some(share) = train {
            if !share.is_alone() {
                let mut sums = [loss as f32, correct as f32];
                self.optimizer.sum_accumulated(share, &mut sums)?;
                (loss, correct) = (f64::from(sums[0]), sums[1].round() as usize);
            }
        }
        Ok(SftStats {
            loss,
            token_accuracy: correct as f64 / totals.tokens as f64,
            sequences: totals.sequences,
            tokens: totals.tokens,
            mean_seq_len: lens.iter().sum::<usize>() as f64 / lens.len() as f64,
            truncated: truncation.truncated,
            tokens_cut: truncation.tokens_cut,
            dropped: truncation.dropped,
            grad_norm: 0.0,
            grad_clipped: false,
        })
    }
}

/// Loads a Hugging Face model folder with every weight a trainable `Var`
/// in the returned map (f32, CPU, for the engine's fused training ops).
pub fn load_hf_trainable(dir: &Path) -> TrainResult<(CausalLm, VarMap)> {
    load_hf_trainable_on(dir, &Backend::Engine)
}

/// [`load_hf_trainable`] on `backend`: for [`Backend::Candle`] the vars
/// live on its device and train through the composed forward. Full
/// fine-tuning keeps f32 weights, so the candle backend must be f32.
pub fn load_hf_trainable_on(dir: &Path, backend: &Backend) -> TrainResult<(CausalLm, VarMap)> {
    let device = match backend {
        Backend::Engine => Device::Cpu,
        Backend::Candle { device, dtype } => {
            if *dtype != DType::F32 {
                return Err(TrainError::BadInput(format!(
                    "full fine-tuning trains f32 weights; the backend computes in {} (use f32)",
                    dtype.as_str()
                )));
            }
            device.clone()
        }
    };
    let config = ModelConfig::from_hf_file(&dir.join("config.json"))?;
    let varmap = VarMap::new();
    let mut model = CausalLm::new(
        &config,
        VarBuilder::from_varmap(&varmap, DType::F32, &device),
    )?;
    // The vars are the weights: placed as they are, never copied.
    model.set_backend(backend.clone());
    let weights = HfWeights::open(dir)?;
    let vars = varmap.data().lock().expect("VarMap lock");
    for (name, var) in vars.iter() {
        let t = weights.load(name, &Device::Cpu)?;
        var.set(&t.to_dtype(DType::F32)?.to_device(&device)?)?;
    }
    weights.check_all_used(&config, |name| vars.contains_key(name))?;
    drop(vars);
    Ok((model, varmap))
}

/// Writes a fully fine-tuned model as a Hugging Face folder:
/// `config.json` and `model.safetensors` (copy the tokenizer files
/// yourself).
pub fn save_hf_trainable(varmap: &VarMap, config: &ModelConfig, dir: &Path) -> TrainResult<()> {
    std::fs::create_dir_all(dir).map_err(|source| TrainError::Io {
        path: dir.to_path_buf(),
        source,
    })?;
    let vars = named_vars(varmap);
    let tensors: Vec<(String, Tensor)> = vars
        .iter()
        .map(|(n, v)| (n.clone(), v.as_tensor().detach()))
        .collect();
    let path = dir.join("model.safetensors");
    let metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
    safetensors::serialize_to_file(
        tensors.iter().map(|(n, t)| (n.as_str(), t)),
        Some(metadata),
        &path,
    )
    .map_err(|e| TrainError::BadInput(format!("{}: {e}", path.display())))?;
    let json = serde_json::to_string_pretty(&config.to_hf_json()?)
        .map_err(|e| TrainError::BadInput(e.to_string()))?;
    let config_path = dir.join("config.json");
    std::fs::write(&config_path, json).map_err(|source| TrainError::Io {
        path: config_path,
        source,
    })
}
