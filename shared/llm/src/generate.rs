//! Generation primitives, pure and synchronous: a seeded [`Sampler`]
//! (greedy, temperature, top-k, top-p) and [`step`], which advances a batch
//! of [`Sequence`]s by one token each.
//!
//! # Continuous batching
//!
//! A [`Sequence`] owns everything about one generation: its [`KvCache`],
//! its adapter, its sampler, its stop condition and the tokens still to
//! feed. A server keeps a list of running sequences and calls [`step`] on
//! all of them in a loop: a new request joins by being pushed onto the
//! list (its whole prompt is prefilled inside the next step, packed with
//! the others' one-token decodes), and a finished one leaves by being
//! removed. Nothing is padded or copied when the batch changes.
//!
//! # Where tokens are drawn
//!
//! Logits in host memory (the CPU engine, candle on the CPU) are drawn
//! from by [`Sampler`] where they are. Logits on a GPU stay there and
//! [`step`] draws on the device (`crate::device_sample`): only each row's
//! token and log-probabilities cross to the host. Both take the same numbers from
//! the sequence's stream for the same decisions and walk the kept tokens
//! in id order, so on the same logits they draw the same tokens (up to f32
//! rounding at a boundary, and top-k ties, which the device keeps).
//!
//! # Log-probabilities
//!
//! Every sampled token comes with two log-probabilities:
//! * `logprob`: under the model's own policy, `log_softmax(logits)` at
//!   temperature 1 over the whole vocabulary. This is what the learner
//!   recomputes from the same weights, so it is the one RL (PPO's ratio,
//!   KL penalties) needs.
//! * `sampling_logprob`: under the distribution the token was actually
//!   drawn from (after temperature, top-k, top-p, constraint; 0 for
//!   greedy), for off-policy corrections.
//!
//! # Constrained decoding
//!
//! [`Sequence::with_constraint`] limits a completion to one of a set of
//! token sequences ([`TokenSequences`], e.g. a game's legal moves): at each
//! step every token that would leave all of them is masked out before
//! sampling (temperature, top-k and top-p then apply among the rest), and
//! the sequence finishes with [`FinishReason::Allowed`] once it spells one
//! in full. When a complete sequence is also the prefix of a longer one
//! (`[1]` and `[12]` as token lists), the stop tokens are allowed there
//! too, and sampling one ends the completion on the shorter sequence.
//! `logprob` stays the unconstrained policy's (the mask changes what is
//! drawn, not the policy the learner recomputes); `sampling_logprob` is
//! that of the masked distribution.
//!
//! # An answer after a thought
//!
//! [`Sequence::with_answer_after_thought`] leaves the completion free
//! (the model's thought, up to `max_new_tokens`) and constrains only its
//! answer: from where the caller sees the model write the answer's opener
//! (`\boxed{`) and calls [`Sequence::begin_answer`], the rest must spell
//! one of [`AnswerAfterThought::after_opener`] (the move and the closer);
//! where the model samples a stop token or reaches `max_new_tokens` first,
//! the stop token is dropped and one of [`AnswerAfterThought::whole`]
//! (opener, move, closer) is decoded in its place, the first of its tokens
//! sampled from the same logits. Either way the completion is the thought
//! then an answer, whose tokens start at [`Sequence::answer_start`]. The
//! thought is found in text, not tokens (a model spells `\boxed{` in more
//! than one way), so noticing the opener is the caller's: it decodes.

use std::sync::Arc;

use rayon::prelude::*;

use candle_core::Tensor;

use crate::cache::KvCache;
use crate::device_sample::{sample_rows, RowDraw};
use crate::lora::LoraAdapter;
use crate::model::{BatchItem, CausalLm, LogitsWanted};
use crate::model_error::{ModelError, Result};
pub use crate::sampling::{Sampled, Sampler, SamplingParams};
use crate::tokenizer::TokenSequences;

/// When a sequence stops.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct StopCondition {
    /// Most tokens to generate.
    pub max_new_tokens: usize,
    /// Tokens that end the generation (kept as its last token), e.g. the
    /// model's EOS ids.
    pub stop_token_ids: Vec<u32>,
}

/// Why a sequence finished.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// It generated this stop token.
    Stop(u32),
    /// It generated `max_new_tokens` tokens.
    Length,
    /// The next token would not fit in the model's context.
    ContextFull,
    /// The completion spells the constraint's sequence of this index in
    /// full (see [`Sequence::with_constraint`]); a stop token that ended it
    /// is kept as its last token.
    Allowed(usize),
}

/// The answers of [`Sequence::with_answer_after_thought`].
#[derive(Debug, Clone)]
pub struct AnswerAfterThought {
    /// What may follow the opener the model wrote itself: each allowed
    /// move, then the closer.
    pub after_opener: Arc<TokenSequences>,
    /// What is decoded where the thought ends without an opener: the
    /// opener, each allowed move, then the closer.
    pub whole: Arc<TokenSequences>,
}

/// One generation in progress. See the module docs for how a server
/// batches them.
#[derive(Debug)]
pub struct Sequence {
    cache: KvCache,
    adapter: Option<Arc<LoraAdapter>>,
    sampler: Sampler,
    stop: StopCondition,
    /// Completions allowed, if constrained: of the whole completion, or of
    /// the tokens from `answer_start` on.
    constraint: Option<Arc<TokenSequences>>,
    /// Where an answer after a thought started.
    answer_start: Option<usize>,
    /// The answer still to come after the thought (cleared once it starts).
    answer: Option<AnswerAfterThought>,
    /// Tokens not yet fed to the model (the prompt, then the last sample).
    pending: Vec<u32>,
    prompt_len: usize,
    tokens: Vec<u32>,
    logprobs: Vec<f32>,
    sampling_logprobs: Vec<f32>,
    finished: Option<FinishReason>,
}

/// What [`step`] produced for one sequence.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepToken {
    /// The new token and its log-probabilities.
    pub sampled: Sampled,
    /// Set when this token ended the sequence.
    pub finished: Option<FinishReason>,
}

impl Sequence {
    /// A generation of `prompt` (at least one token) with `adapter` (or
    /// the base model). Nothing runs until [`step`] (or [`prefill`]).
    pub fn new(
        model: &CausalLm,
        prompt: Vec<u32>,
        adapter: Option<Arc<LoraAdapter>>,
        sampler: Sampler,
        stop: StopCondition,
    ) -> Result<Self> {
        if prompt.is_empty() {
            return Err(ModelError::BadInput("empty prompt".into()));
        }
        if stop.max_new_tokens == 0 {
            return Err(ModelError::config("max_new_tokens", "must be at least 1"));
        }
        Ok(Self {
            cache: model.new_cache(),
            adapter,
            sampler,
            stop,
            constraint: None,
            answer_start: None,
            answer: None,
            prompt_len: prompt.len(),
            pending: prompt,
            tokens: Vec::new(),
            logprobs: Vec::new(),
            sampling_logprobs: Vec::new(),
            finished: None,
        })
    }

    /// Like [`Sequence::new`], but starting from `cache`, which already
    /// holds the keys and values of the first `cache.len()` tokens of
    /// `prompt` (e.g. from a [`crate::PrefixCache`]); only the rest is
    /// prefilled. At least one prompt token must remain to be fed.
    pub fn with_cached_prefix(
        model: &CausalLm,
        prompt: Vec<u32>,
        cache: KvCache,
        adapter: Option<Arc<LoraAdapter>>,
        sampler: Sampler,
        stop: StopCondition,
    ) -> Result<Self> {
        if cache.len() >= prompt.len() {
            return Err(ModelError::BadInput(format!(
                "a cached prefix of {} tokens leaves none of the {}-token prompt to feed",
                cache.len(),
                prompt.len()
            )));
        }
        let mut seq = Self::new(model, prompt, adapter, sampler, stop)?;
        seq.pending.drain(..cache.len());
        seq.cache = cache;
        Ok(seq)
    }

    /// An independent copy at the same point (cache deep-copied) that
    /// samples with `sampler`: prefill a prompt once with [`prefill`], then
    /// fork it into a group of samples.
    pub fn fork(&self, sampler: Sampler) -> Result<Self> {
        Ok(Self {
            cache: self.cache.fork()?,
            adapter: self.adapter.clone(),
            sampler,
            stop: self.stop.clone(),
            constraint: self.constraint.clone(),
            answer_start: self.answer_start,
            answer: self.answer.clone(),
            pending: self.pending.clone(),
            prompt_len: self.prompt_len,
            tokens: self.tokens.clone(),
            logprobs: self.logprobs.clone(),
            sampling_logprobs: self.sampling_logprobs.clone(),
            finished: self.finished,
        })
    }

    /// Limits the completion to one of `allowed`'s token sequences (see
    /// the module docs). Every sequence must hold at least one token;
    /// `max_new_tokens` still applies, so give at least the longest
    /// sequence's length (plus one for a stop token).
    pub fn with_constraint(mut self, allowed: Arc<TokenSequences>) -> Result<Self> {
        self.check_unstarted(&allowed)?;
        self.constraint = Some(allowed);
        Ok(self)
    }

    /// Leaves the thought free and constrains the answer after it (see
    /// the module docs); `max_new_tokens` bounds the thought, the answer
    /// comes on top.
    pub fn with_answer_after_thought(mut self, answer: AnswerAfterThought) -> Result<Self> {
        self.check_unstarted(&answer.after_opener)?;
        self.check_unstarted(&answer.whole)?;
        self.answer = Some(answer);
        Ok(self)
    }

    fn check_unstarted(&self, allowed: &TokenSequences) -> Result<()> {
        if allowed.sequences().is_empty() {
            return Err(ModelError::BadInput("no allowed completions".into()));
        }
        if let Some(i) = allowed.sequences().iter().position(Vec::is_empty) {
            return Err(ModelError::BadInput(format!(
                "allowed completion {i} ({:?}) has no tokens",
                allowed.texts().get(i)
            )));
        }
        if !self.tokens.is_empty() {
            return Err(ModelError::BadInput(
                "a constraint must be set before the first token".into(),
            ));
        }
        Ok(())
    }

    /// The model has written the answer's opener: the tokens from here on
    /// spell one of [`AnswerAfterThought::after_opener`]. Returns `false`
    /// (and does nothing) when no answer is waiting for its thought.
    pub fn begin_answer(&mut self) -> bool {
        match self.answer.take() {
            Some(answer) => {
                self.start_constraint(answer.after_opener);
                true
            }
            None => false,
        }
    }

    /// The thought ended without an opener: the whole answer follows.
    fn answer_in_place_of_end(&mut self) {
        if let Some(answer) = self.answer.take() {
            self.start_constraint(answer.whole);
        }
    }

    fn start_constraint(&mut self, allowed: Arc<TokenSequences>) {
        self.constraint = Some(allowed);
        self.answer_start = Some(self.tokens.len());
    }

    /// Whether an answer waits for the end of the thought.
    pub fn thinking(&self) -> bool {
        self.answer.is_some()
    }

    /// Where the constrained answer began in [`Sequence::tokens`], once
    /// an answer after a thought has (`None` otherwise).
    pub fn answer_start(&self) -> Option<usize> {
        self.answer_start
    }

    /// The constraint, if any.
    pub fn constraint(&self) -> Option<&Arc<TokenSequences>> {
        self.constraint.as_ref()
    }

    /// The constrained part of the completion.
    fn constrained_tokens(&self) -> &[u32] {
        &self.tokens[self.answer_start.unwrap_or(0)..]
    }

    /// The tokens the constraint lets come next (`None`: unconstrained).
    fn allowed_next(&self) -> Option<Vec<u32>> {
        let constraint = self.constraint.as_ref()?;
        let mut next = constraint.allowed_next(self.constrained_tokens());
        if constraint.completed(self.constrained_tokens()).is_some() {
            next.extend(&self.stop.stop_token_ids);
            next.sort_unstable();
            next.dedup();
        }
        Some(next)
    }

    /// Length of the prompt.
    pub fn prompt_len(&self) -> usize {
        self.prompt_len
    }

    /// Tokens generated so far.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// Policy log-probabilities (temperature 1) of [`Sequence::tokens`].
    pub fn logprobs(&self) -> &[f32] {
        &self.logprobs
    }

    /// Log-probabilities under the sampling distribution actually used.
    pub fn sampling_logprobs(&self) -> &[f32] {
        &self.sampling_logprobs
    }

    /// Why it finished, or `None` while running.
    pub fn finish_reason(&self) -> Option<FinishReason> {
        self.finished
    }

    /// Whether it is done.
    pub fn is_finished(&self) -> bool {
        self.finished.is_some()
    }

    /// Its cache (e.g. to account for memory).
    pub fn cache(&self) -> &KvCache {
        &self.cache
    }

    /// The adapter it runs with.
    pub fn adapter(&self) -> Option<&Arc<LoraAdapter>> {
        self.adapter.as_ref()
    }

    fn record(&mut self, sampled: Sampled, max_positions: usize) -> Option<FinishReason> {
        self.tokens.push(sampled.token);
        self.logprobs.push(sampled.logprob);
        self.sampling_logprobs.push(sampled.sampling_logprob);
        self.pending = vec![sampled.token];
        let is_stop = self.stop.stop_token_ids.contains(&sampled.token);
        let allowed_done = self.constraint.as_ref().and_then(|c| {
            let constrained = self.constrained_tokens();
            let n = constrained.len();
            match c.completed(constrained) {
                Some(i) if c.allowed_next(constrained).is_empty() => Some(i),
                // A stop token sampled where the constraint allowed it.
                _ if is_stop => c.completed(&constrained[..n - 1]),
                _ => None,
            }
        });
        // An answer after a thought ends by its constraint alone.
        let thought_used_up =
            self.answer_start.is_none() && self.tokens.len() >= self.stop.max_new_tokens;
        self.finished = if let Some(i) = allowed_done {
            Some(FinishReason::Allowed(i))
        } else if is_stop {
            Some(FinishReason::Stop(sampled.token))
        } else if thought_used_up && !self.thinking() {
            // (A thought that used its tokens is followed by its answer at
            // the next step, after the caller had a look for the opener.)
            Some(FinishReason::Length)
        } else if self.cache.len() >= max_positions {
            Some(FinishReason::ContextFull)
        } else {
            None
        };
        self.finished
    }
}

/// Feeds every token of each unfinished sequence's pending input except
/// the last (no sampling), so the sequence can be [`Sequence::fork`]ed
/// with its prompt already in the cache.
pub fn prefill(model: &CausalLm, seqs: &mut [&mut Sequence]) -> Result<()> {
    let mut items = Vec::new();
    for seq in seqs.iter_mut() {
        let seq = &mut **seq;
        if seq.finished.is_some() || seq.pending.len() < 2 {
            continue;
        }
        let keep = seq.pending.len() - 1;
        items.push(BatchItem {
            tokens: &seq.pending[..keep],
            cache: &mut seq.cache,
            adapter: seq.adapter.as_deref(),
        });
    }
    if items.is_empty() {
        return Ok(());
    }
    model.forward_batch(&mut items, LogitsWanted::Last)?;
    drop(items);
    for seq in seqs.iter_mut() {
        if seq.finished.is_none() && seq.pending.len() >= 2 {
            let last = *seq.pending.last().expect("non-empty");
            seq.pending = vec![last];
        }
    }
    Ok(())
}

/// Advances every unfinished sequence by one sampled token in one batched
/// forward (new sequences' prompts are prefilled in the same forward).
/// Returns, per sequence in order, the new token or `None` if it was
/// already finished (or could not take another token). On error no
/// sequence changes.
pub fn step(model: &CausalLm, seqs: &mut [&mut Sequence]) -> Result<Vec<Option<StepToken>>> {
    step_sampling(model, seqs, |logits, seqs| {
        // Logits already in host memory (the engine, candle on the CPU) are
        // cheaper to sample where they are.
        if logits.device().is_cpu() {
            sample_on_host(logits, seqs)
        } else {
            sample_on_device(logits, seqs)
        }
    })
}

/// Each unfinished sequence's token from its row of the logits (rows in
/// the order of the unfinished sequences).
type Sampling = fn(&Tensor, &mut [&mut Sequence]) -> Result<Vec<Option<Sampled>>>;

/// [`step`] with the tokens drawn by `sample`.
fn step_sampling(
    model: &CausalLm,
    seqs: &mut [&mut Sequence],
    sample: Sampling,
) -> Result<Vec<Option<StepToken>>> {
    let limit = model.config().max_position_embeddings;
    for seq in seqs.iter_mut() {
        if seq.finished.is_none() && seq.cache.len() + seq.pending.len() > limit {
            seq.finished = Some(FinishReason::ContextFull);
        }
    }
    let mut items = Vec::new();
    for seq in seqs.iter_mut() {
        let seq = &mut **seq;
        if seq.finished.is_some() {
            continue;
        }
        items.push(BatchItem {
            tokens: &seq.pending,
            cache: &mut seq.cache,
            adapter: seq.adapter.as_deref(),
        });
    }
    if items.is_empty() {
        return Ok(vec![None; seqs.len()]);
    }
    let logits = model.forward_batch(&mut items, LogitsWanted::Last)?;
    drop(items);
    let sampled = sample(&logits, seqs)?;
    let mut out = Vec::with_capacity(seqs.len());
    for (seq, sampled) in seqs.iter_mut().zip(sampled) {
        out.push(sampled.map(|sampled| {
            let finished = seq.record(sampled, limit);
            StepToken { sampled, finished }
        }));
    }
    Ok(out)
}

/// [`Sampling`] with the logits copied to the host.
fn sample_on_host(logits: &Tensor, seqs: &mut [&mut Sequence]) -> Result<Vec<Option<Sampled>>> {
    let vocab = logits.dim(1)?;
    let logits: Vec<f32> = logits.flatten_all()?.to_vec1()?;
    // Row of each running sequence in `logits`.
    let mut rows = Vec::with_capacity(seqs.len());
    let mut next_row = 0;
    for seq in seqs.iter() {
        rows.push(seq.finished.is_none().then(|| {
            next_row += 1;
            next_row - 1
        }));
    }
    // Sampling is independent per sequence (each has its own random
    // stream), and a pass over a large vocabulary is not free: in parallel.
    seqs.par_iter_mut()
        .zip(rows.par_iter())
        .map(|(seq, row)| {
            row.map(|r| {
                let row = &logits[r * vocab..(r + 1) * vocab];
                if seq.thinking() && seq.tokens.len() >= seq.stop.max_new_tokens {
                    seq.answer_in_place_of_end();
                }
                let sampled = match seq.allowed_next() {
                    Some(allowed) => seq.sampler.sample_among(row, &allowed)?,
                    None => seq.sampler.sample(row)?,
                };
                if seq.thinking() && seq.stop.stop_token_ids.contains(&sampled.token) {
                    // The thought ends here: the answer takes the stop
                    // token's place.
                    seq.answer_in_place_of_end();
                    let allowed = seq.allowed_next().expect("the answer is constrained");
                    return seq.sampler.sample_among(row, &allowed);
                }
                Ok(sampled)
            })
            .transpose()
        })
        .collect()
}

/// [`sample_on_host`]'s draws made on the logits' device
/// ([`crate::device_sample`]): the same decisions, in the same order, each
/// taking the same numbers from the sequence's stream.
fn sample_on_device(logits: &Tensor, seqs: &mut [&mut Sequence]) -> Result<Vec<Option<Sampled>>> {
    let draw_for = |seq: &mut Sequence| RowDraw {
        allowed: seq.allowed_next(),
        uniform: if seq.sampler.params().temperature > 0.0 {
            seq.sampler.next_uniform()
        } else {
            0.0
        },
        params: seq.sampler.params().clone(),
    };
    let mut draws = Vec::new();
    let mut running = Vec::new();
    for (i, seq) in seqs.iter_mut().enumerate() {
        if seq.finished.is_some() {
            continue;
        }
        if seq.thinking() && seq.tokens.len() >= seq.stop.max_new_tokens {
            seq.answer_in_place_of_end();
        }
        draws.push(draw_for(seq));
        running.push(i);
    }
    let mut sampled = sample_rows(logits, &draws)?;
    // A thought that sampled its stop token: its answer takes the token's
    // place, drawn from the same row.
    let mut again = Vec::new();
    let mut again_rows = Vec::new();
    for (row, &i) in running.iter().enumerate() {
        let seq = &mut *seqs[i];
        if seq.thinking() && seq.stop.stop_token_ids.contains(&sampled[row].token) {
            seq.answer_in_place_of_end();
            again.push(draw_for(seq));
            again_rows.push(row as u32);
        }
    }
    if !again.is_empty() {
        let n = again_rows.len();
        let rows = Tensor::from_vec(again_rows.clone(), n, logits.device())?;
        let redrawn = sample_rows(&logits.index_select(&rows, 0)?, &again)?;
        for (row, s) in again_rows.into_iter().zip(redrawn) {
            sampled[row as usize] = s;
        }
    }
    let mut out = vec![None; seqs.len()];
    for (i, s) in running.into_iter().zip(sampled) {
        out[i] = Some(s);
    }
    Ok(out)
}

/// Runs one sequence to the end (a loop over [`step`]).
pub fn generate(model: &CausalLm, seq: &mut Sequence) -> Result<()> {
    while !seq.is_finished() {
        step(model, &mut [&mut *seq])?;
    }
    Ok(())
}

#[cfg(test)]
mod tests;
