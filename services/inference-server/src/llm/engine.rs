//! The decode loop: one OS thread owns the model and runs continuous
//! batching over every admitted request.
//!
//! Each turn of the loop takes the requests that arrived, admits waiting
//! ones while fewer than `llm.max_sequences` run and (on the candle
//! backend, with `llm.kv_cache_mib`) while the paged KV pool can hold
//! each one's prompt and every token it may generate, advances every running
//! sequence by one token in one batched forward (a new request's prompt is
//! prefilled in the same forward as the others' one-token decodes), checks
//! each completion's stop strings on its incrementally decoded text, and
//! replies to the finished ones, which leave the batch. A prompt that
//! shares a long prefix with a recent one starts from a copy of that
//! prefix's cache (`llm.prefix_cache`); prompts admitted together that
//! share a prefix not yet cached (a game's instructions, when many
//! requests arrive at once) get it prefilled once, in one forward before
//! they join, and all start from copies of it. The loop blocks
//! only when nothing runs or waits; it ends once the job channel is closed
//! and the last running sequence has finished, or, when the server stops,
//! once it is told to give up ([`Engine::abandon`]): a completion of
//! hundreds of tokens must not hold up the stop, so what still runs or
//! waits then is answered 503.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, TryRecvError};
use std::sync::Arc;
use std::time::Instant;

use relay_llm::{
    step, AnswerAfterThought, BatchItem, CausalLm, FinishReason as LlmFinish, IncrementalDecoder,
    KvUsage, LogitsWanted, LoraAdapter, PrefixCache, Sampler, SamplingParams, Sequence,
    StopCondition, TokenSequences, Tokenizer,
};
use relay_proto::{AdapterRef, FinishReason, GenerateReply, Tensor, SCHEMA_VERSION};

use super::metrics::LlmMetrics;

/// Why a job got no completion; carries the NATS service error code.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub(crate) struct JobError {
    /// NATS micro service error code (400 bad request, 500 failure).
    pub code: usize,
    pub message: String,
}

/// One request, tokenized and resolved, as the decode thread takes it.
pub(crate) struct Job {
    /// The prompt's token ids (non-empty, inside the vocabulary, leaving
    /// room for at least one token in the context).
    pub prompt: Vec<u32>,
    /// The adapter with the version resolved, or the base model.
    pub adapter: Option<(AdapterRef, Arc<LoraAdapter>)>,
    pub sampling: SamplingParams,
    pub seed: u64,
    /// Most completion tokens.
    pub max_tokens: usize,
    /// Stop strings (ignored under a constraint).
    pub stop: Vec<String>,
    /// Constrained decoding to these completions.
    pub allowed: Option<Arc<TokenSequences>>,
    /// Or a free thought, then a constrained answer.
    pub answer: Option<JobAnswer>,
    /// When the request arrived (latency and time to first token).
    pub received: Instant,
    pub reply: tokio::sync::oneshot::Sender<Result<GenerateReply, JobError>>,
}

/// A thought's answer: where the model writes `opener`, the answer
/// (constrained) begins.
pub(crate) struct JobAnswer {
    pub opener: String,
    pub answer: AnswerAfterThought,
}

/// Whether the KV pool can take a job now.
enum Room {
    Fits,
    /// Not until running sequences finish.
    Later,
    /// Never: it needs more than the whole pool (the reason).
    Never(String),
}

/// A job being decoded.
struct Running {
    seq: Sequence,
    /// KV pool blocks it may come to hold ([`Engine::promised_blocks`]).
    promised_blocks: usize,
    adapter: Option<AdapterRef>,
    prompt: Vec<u32>,
    stop: Vec<String>,
    longest_stop: usize,
    /// The opener of an answer after a thought ("" for none, or none to
    /// look for).
    opener: String,
    /// Bytes of decoded text before the answer after a thought.
    thought_text_len: Option<usize>,
    decoder: IncrementalDecoder,
    received: Instant,
    first_token: bool,
    reply: tokio::sync::oneshot::Sender<Result<GenerateReply, JobError>>,
}

/// Everything the loop needs besides the jobs.
pub(crate) struct Engine {
    pub model: CausalLm,
    pub tokenizer: Arc<Tokenizer>,
    /// Tokens that end a completion (`FinishReason::Eos`).
    pub stop_token_ids: Vec<u32>,
    pub max_sequences: usize,
    /// Prompts whose caches are kept (`llm.prefix_cache`).
    pub prefix_cache: usize,
    /// Jobs sent to this loop and not yet admitted or dropped (the
    /// frontend counts them up, the loop down; `llm.max_queue` bounds it).
    pub waiting: Arc<AtomicUsize>,
    pub metrics: LlmMetrics,
    /// Set by a stopping server once its grace is over: the loop answers
    /// every job it holds with 503 and ends at its next turn.
    pub abandon: Arc<AtomicBool>,
}

/// The first `len` tokens of `prompt`, which several admitted prompts
/// share (`len < prompt.len()`).
struct SharedPrefix<'a> {
    adapter: Option<Arc<LoraAdapter>>,
    prompt: &'a [u32],
    len: usize,
}

/// Shortest shared prefix worth a copy of a cached prompt.
const MIN_PREFIX_TOKENS: usize = 16;

impl Engine {
    /// Runs until `jobs` is closed and every admitted job has been answered.
    pub(crate) fn run(self, jobs: Receiver<Job>) {
        let mut waiting: VecDeque<Job> = VecDeque::new();
        let mut running: Vec<Running> = Vec::with_capacity(self.max_sequences);
        let mut open = true;
        let mut rate = TokenRate::new();
        let mut prefixes = PrefixCache::new(self.prefix_cache, MIN_PREFIX_TOKENS);
        loop {
            if self.abandon.load(Ordering::Relaxed) {
                self.give_up(running, waiting, &jobs);
                break;
            }
            if running.is_empty() && waiting.is_empty() {
                if !open {
                    break;
                }
                self.metrics.tokens_per_second.set(0.0);
                match jobs.recv() {
                    Ok(job) => waiting.push_back(job),
                    Err(_) => break,
                }
                rate = TokenRate::new();
            }
            while open {
                match jobs.try_recv() {
                    Ok(job) => waiting.push_back(job),
                    Err(TryRecvError::Empty) => break,
                    Err(TryRecvError::Disconnected) => open = false,
                }
            }
            let mut admitted = Vec::new();
            while running.len() + admitted.len() < self.max_sequences {
                let Some(job) = waiting.front() else {
                    break;
                };
                // (The requester timed out or went away: skip the work.)
                let refused = if job.reply.is_closed() {
                    None
                } else {
                    match self.kv_room(job, &running, &admitted, &mut prefixes) {
                        Room::Fits => None,
                        Room::Later => break,
                        Room::Never(message) => Some(message),
                    }
                };
                let job = waiting.pop_front().expect("front");
                self.waiting.fetch_sub(1, Ordering::Relaxed);
                match refused {
                    Some(message) => {
                        let _ = job.reply.send(Err(JobError { code: 400, message }));
                    }
                    None if job.reply.is_closed() => {}
                    None => admitted.push(job),
                }
            }
            self.share_prefixes(&admitted, &mut prefixes);
            for job in admitted {
                if let Some(r) = self.admit(job, &mut prefixes) {
                    running.push(r);
                }
            }
            self.metrics.queue_depth.set(waiting.len() as i64);
            if let Some(pool) = self.model.kv_pool() {
                let usage = pool.usage();
                self.metrics
                    .kv_cache_bytes
                    .set((usage.used_blocks * usage.block_bytes) as i64);
            }
            if running.is_empty() {
                continue;
            }
            self.metrics
                .sequences_per_step
                .observe(running.len() as f64);
            let result = {
                let mut refs: Vec<&mut Sequence> = running.iter_mut().map(|r| &mut r.seq).collect();
                step(&self.model, &mut refs)
            };
            let tokens = match result {
                Ok(tokens) => tokens,
                Err(e) => {
                    tracing::error!(error = %e, sequences = running.len(), "decode step failed");
                    for r in running.drain(..) {
                        let _ = r.reply.send(Err(JobError {
                            code: 500,
                            message: format!("decode step failed: {e}"),
                        }));
                    }
                    continue;
                }
            };
            let now = Instant::now();
            let mut generated = 0u64;
            let mut done = Vec::new();
            for (i, (r, token)) in running.iter_mut().zip(tokens).enumerate() {
                let Some(token) = token else {
                    // Context already full before this step.
                    done.push((i, FinishReason::Length, None));
                    continue;
                };
                generated += 1;
                if !r.first_token {
                    r.first_token = true;
                    self.metrics
                        .time_to_first_token
                        .observe((now - r.received).as_secs_f64());
                    // Its prompt is now in its cache.
                    prefixes.insert(r.seq.adapter(), &r.prompt, r.seq.cache());
                }
                if let Some(finish) = self.after_token(r, token.sampled.token, token.finished) {
                    done.push((i, finish.0, finish.1));
                }
            }
            self.metrics.generated_tokens.inc_by(generated);
            if let Some(per_second) = rate.add(generated, now) {
                self.metrics.tokens_per_second.set(per_second);
            }
            for (i, finish, text) in done.into_iter().rev() {
                let r = running.swap_remove(i);
                self.finish(r, finish, text);
            }
        }
        self.metrics.queue_depth.set(0);
    }

    /// Prefills once each prefix that several of `jobs` share (same
    /// adapter, at least [`MIN_PREFIX_TOKENS`]) beyond what the prefix
    /// cache holds for them, and caches it, so their admission copies it
    /// instead of each prefilling it. Prompts sorted in order put those
    /// sharing the longest prefixes side by side; each run of neighbours
    /// gets the prefix common to all of it.
    fn share_prefixes(&self, jobs: &[Job], prefixes: &mut PrefixCache) {
        if self.prefix_cache == 0 || jobs.len() < 2 {
            return;
        }
        let adapter_of = |j: &Job| j.adapter.as_ref().map(|(_, a)| a.clone());
        let key = |j: &Job| {
            j.adapter
                .as_ref()
                .map_or(0, |(_, a)| Arc::as_ptr(a) as usize)
        };
        let mut order: Vec<&Job> = jobs.iter().collect();
        order.sort_by(|a, b| key(a).cmp(&key(b)).then_with(|| a.prompt.cmp(&b.prompt)));
        // (adapter, prefix tokens) to prefill.
        let mut shared: Vec<SharedPrefix> = Vec::new();
        let mut i = 0;
        while i < order.len() {
            let first = &order[i].prompt;
            // The last prompt token is always fed by the step itself.
            let mut common = first.len() - 1;
            let mut j = i + 1;
            while j < order.len() && key(order[j]) == key(order[i]) {
                let other = &order[j].prompt;
                let lcp = first.iter().zip(other).take_while(|(a, b)| a == b).count();
                let len = lcp.min(other.len() - 1).min(common);
                if len < MIN_PREFIX_TOKENS {
                    break;
                }
                common = len;
                j += 1;
            }
            let adapter = adapter_of(order[i]);
            // Worth a forward only if it saves more than the cache does.
            let cached = prefixes.shared_len(adapter.as_ref(), &first[..=common]);
            if j - i >= 2 && common >= cached + MIN_PREFIX_TOKENS {
                shared.push(SharedPrefix {
                    adapter,
                    prompt: first,
                    len: common,
                });
            }
            i = j.max(i + 1);
        }
        if shared.is_empty() {
            return;
        }
        // Extend what the cache holds rather than start over (a lookup of
        // the prefix and one token more copies at most the prefix).
        let mut caches: Vec<relay_llm::KvCache> = shared
            .iter()
            .map(|s| {
                prefixes
                    .lookup(s.adapter.as_ref(), &s.prompt[..=s.len])
                    .unwrap_or_else(|| self.model.new_cache())
            })
            .collect();
        let mut items: Vec<BatchItem> = shared
            .iter()
            .zip(caches.iter_mut())
            .map(|(s, cache)| BatchItem {
                tokens: &s.prompt[cache.len()..s.len],
                cache,
                adapter: s.adapter.as_deref(),
            })
            .collect();
        if let Err(e) = self.model.forward_batch(&mut items, LogitsWanted::Last) {
            tracing::warn!(error = %e, "prefilling shared prompt prefixes failed");
            return;
        }
        drop(items);
        for (s, cache) in shared.iter().zip(&caches) {
            prefixes.insert(s.adapter.as_ref(), &s.prompt[..s.len], cache);
        }
    }

    /// Blocks of the KV pool a job may come to hold: its prompt and every
    /// token it may generate, and one more for the copy of a block it
    /// shares with a cached prefix.
    fn promised_blocks(&self, job: &Job) -> usize {
        let longest = |s: &TokenSequences| s.sequences().iter().map(Vec::len).max().unwrap_or(0);
        let most_new = match (&job.allowed, &job.answer) {
            (Some(allowed), _) => longest(allowed) + 1,
            (None, Some(answer)) => job.max_tokens + longest(&answer.answer.whole),
            (None, None) => job.max_tokens,
        };
        let positions =
            (job.prompt.len() + most_new).min(self.model.config().max_position_embeddings);
        KvUsage::blocks_for(positions) + 1
    }

    /// Whether the KV pool (when `llm.kv_cache_mib` bounds it) can take
    /// `job` beside what the running and just admitted sequences may still
    /// take; cached prefixes are dropped, oldest first, to make room.
    fn kv_room(
        &self,
        job: &Job,
        running: &[Running],
        admitted: &[Job],
        prefixes: &mut PrefixCache,
    ) -> Room {
        let Some(pool) = self.model.kv_pool() else {
            return Room::Fits;
        };
        let Some(limit) = pool.usage().limit_blocks else {
            return Room::Fits;
        };
        let need = self.promised_blocks(job);
        if need > limit {
            return Room::Never(format!(
                "a prompt of {} tokens and up to {} new ones need {need} KV blocks of {} \
                 positions; llm.kv_cache_mib holds {limit}",
                job.prompt.len(),
                job.max_tokens,
                relay_llm::BLOCK_POSITIONS
            ));
        }
        let block_bytes = pool.block_bytes();
        let growth: usize = running
            .iter()
            .map(|r| {
                r.promised_blocks
                    .saturating_sub(r.seq.cache().allocated_bytes() / block_bytes)
            })
            .chain(admitted.iter().map(|j| self.promised_blocks(j)))
            .sum();
        loop {
            if pool.usage().used_blocks + growth + need <= limit {
                return Room::Fits;
            }
            if !prefixes.evict_oldest() {
                return Room::Later;
            }
        }
    }

    /// Starts a job's sequence; on a bad job replies with the error.
    fn admit(&self, job: Job, prefixes: &mut PrefixCache) -> Option<Running> {
        let longest_stop = job.stop.iter().map(String::len).max().unwrap_or(0);
        let built = Sampler::new(job.sampling.clone(), job.seed)
            .and_then(|sampler| {
                let max_new_tokens = match &job.allowed {
                    // The constraint bounds the length: its longest
                    // sequence, plus a stop token after a prefix.
                    Some(allowed) => {
                        allowed.sequences().iter().map(Vec::len).max().unwrap_or(0) + 1
                    }
                    None => job.max_tokens,
                };
                let adapter = job.adapter.as_ref().map(|(_, a)| a.clone());
                let stop = StopCondition {
                    max_new_tokens,
                    stop_token_ids: self.stop_token_ids.clone(),
                };
                self.metrics.prompt_tokens.inc_by(job.prompt.len() as u64);
                match prefixes.lookup(adapter.as_ref(), &job.prompt) {
                    Some(cache) => {
                        self.metrics.prompt_tokens_cached.inc_by(cache.len() as u64);
                        Sequence::with_cached_prefix(
                            &self.model,
                            job.prompt.clone(),
                            cache,
                            adapter,
                            sampler,
                            stop,
                        )
                    }
                    None => Sequence::new(&self.model, job.prompt.clone(), adapter, sampler, stop),
                }
            })
            .and_then(|seq| match (&job.allowed, &job.answer) {
                (Some(allowed), _) => seq.with_constraint(allowed.clone()),
                (None, Some(answer)) => seq.with_answer_after_thought(answer.answer.clone()),
                (None, None) => Ok(seq),
            });
        let promised_blocks = self.promised_blocks(&job);
        match built {
            Ok(seq) => Some(Running {
                seq,
                promised_blocks,
                adapter: job.adapter.map(|(r, _)| r),
                prompt: job.prompt,
                stop: if job.allowed.is_some() || job.answer.is_some() {
                    Vec::new()
                } else {
                    job.stop
                },
                longest_stop,
                opener: job.answer.map(|a| a.opener).unwrap_or_default(),
                thought_text_len: None,
                decoder: IncrementalDecoder::new(true),
                received: job.received,
                first_token: false,
                reply: job.reply,
            }),
            Err(e) => {
                let _ = job.reply.send(Err(JobError {
                    code: 400,
                    message: e.to_string(),
                }));
                None
            }
        }
    }

    /// Decodes the new token and decides whether the completion ends:
    /// `Some((reason, text override))`.
    fn after_token(
        &self,
        r: &mut Running,
        token: u32,
        finished: Option<LlmFinish>,
    ) -> Option<(FinishReason, Option<String>)> {
        let before = r.decoder.text().len();
        if r.thought_text_len.is_none() && r.seq.answer_start().is_some() {
            r.thought_text_len = Some(before);
        }
        if let Err(e) = r.decoder.push(&self.tokenizer, token) {
            tracing::warn!(error = %e, token, "decoding a completion token failed");
        }
        if let Some(finished) = finished {
            return Some(match finished {
                LlmFinish::Stop(_) => (FinishReason::Eos, None),
                LlmFinish::Length | LlmFinish::ContextFull => (FinishReason::Length, None),
                LlmFinish::Allowed(i) => {
                    let answer = r.seq.constraint().and_then(|c| c.texts().get(i));
                    let thought = &r.decoder.text()[..r.thought_text_len.unwrap_or(0)];
                    (
                        FinishReason::Allowed,
                        answer.map(|answer| format!("{thought}{answer}")),
                    )
                }
            });
        }
        if r.seq.thinking() && !r.opener.is_empty() && r.decoder.text().ends_with(&r.opener) {
            r.seq.begin_answer();
        }
        if r.stop.is_empty() {
            return None;
        }
        // Only the tail can hold a new match: what a stop string could
        // span across the previous text and the new piece.
        let text = r.decoder.text();
        let mut from = before.saturating_sub(r.longest_stop.saturating_sub(1));
        while !text.is_char_boundary(from) {
            from -= 1;
        }
        let end = r
            .stop
            .iter()
            .filter_map(|s| text[from..].find(s.as_str()).map(|p| from + p + s.len()))
            .min()?;
        Some((FinishReason::Stop, Some(text[..end].to_string())))
    }

    /// Answers every job still held (running, waiting, or not yet taken
    /// from the channel) with 503: the server is stopping.
    fn give_up(&self, running: Vec<Running>, waiting: VecDeque<Job>, jobs: &Receiver<Job>) {
        let stopping = || JobError {
            code: 503,
            message: "the inference server is stopping".into(),
        };
        for r in running {
            let _ = r.reply.send(Err(stopping()));
        }
        for job in waiting.into_iter().chain(jobs.try_iter()) {
            self.waiting.fetch_sub(1, Ordering::Relaxed);
            let _ = job.reply.send(Err(stopping()));
        }
        self.metrics.queue_depth.set(0);
    }

    fn finish(&self, mut r: Running, finish: FinishReason, text: Option<String>) {
        let text = match text {
            Some(text) => text,
            None => {
                let _ = r.decoder.finish(&self.tokenizer);
                r.decoder.text().to_string()
            }
        };
        let tokens = r.seq.tokens();
        let reply = GenerateReply {
            schema: SCHEMA_VERSION,
            adapter: r.adapter,
            prompt_tokens: Tensor::from_u32(&[r.prompt.len()], &r.prompt),
            completion_tokens: Tensor::from_u32(&[tokens.len()], tokens),
            logprobs: Tensor::from_f32(&[tokens.len()], r.seq.logprobs()),
            text,
            finish,
            answer_start: r.seq.answer_start().map(|start| start as u32),
        };
        self.metrics
            .request_seconds
            .observe(r.received.elapsed().as_secs_f64());
        self.metrics.requests.inc();
        let _ = r.reply.send(Ok(reply));
    }
}

/// Generated tokens per second over windows of at least one second.
struct TokenRate {
    since: Instant,
    tokens: u64,
}

impl TokenRate {
    fn new() -> Self {
        Self {
            since: Instant::now(),
            tokens: 0,
        }
    }

    /// Adds tokens; returns the rate when a window closes.
    fn add(&mut self, tokens: u64, now: Instant) -> Option<f64> {
        self.tokens += tokens;
        let elapsed = (now - self.since).as_secs_f64();
        if elapsed < 1.0 {
            return None;
        }
        let rate = self.tokens as f64 / elapsed;
        self.since = now;
        self.tokens = 0;
        Some(rate)
    }
}
