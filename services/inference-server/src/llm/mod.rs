//! The `generate` endpoint: LLM completions for the text games.
//!
//! | module | owns |
//! |---|---|
//! | this one | loading the model (`llm.model`), the endpoint: decoding, tokenizing and checking each [`GenerateRequest`], resolving its adapter, handing it to the decode thread and replying |
//! | [`engine`] | the decode thread: continuous batching, stop strings, replies |
//! | [`adapters`] | adapter sources and the LRU of loaded ones |
//! | [`metrics`] | the endpoint's metrics |
//!
//! Requests are handled concurrently (one task each) up to the point where
//! they join the decode thread's queue, so tokenizing a prompt never waits
//! for a decode step, and a decode step never waits for NATS.
//!
//! Stopping: no new request is taken; completions that end within
//! [`STOP_GRACE`] are answered as usual, and whatever still runs or waits
//! after it is answered 503, so the server stops within the promise of
//! every service (2 s) however long its completions are.

pub(crate) mod adapters;
pub(crate) mod engine;
pub(crate) mod metrics;

use std::sync::Arc;
use std::time::Instant;

use futures::StreamExt;
use relay_kit::{Service, ServiceError};
use relay_llm::{AnswerAfterThought, TokenSequences, Tokenizer};
use relay_proto::{GenerateRequest, Prompt, Rejection};

use adapters::AdapterStore;
use engine::{Engine, Job, JobAnswer, JobError};
use metrics::LlmMetrics;

pub use relay_llm::{load_model, LoadError, LoadedModel};

fn service_error(code: usize, status: impl Into<String>) -> async_nats::service::error::Error {
    async_nats::service::error::Error {
        status: status.into(),
        code,
    }
}

/// What a request handler needs; shared by every handler task.
struct Frontend {
    service: Service,
    tokenizer: Arc<Tokenizer>,
    vocab_size: usize,
    context: usize,
    adapters: Arc<AdapterStore>,
    jobs: std::sync::Mutex<Option<std::sync::mpsc::Sender<Job>>>,
    /// Jobs sent to the decode thread and not yet admitted (see
    /// [`Engine::waiting`]).
    waiting: Arc<std::sync::atomic::AtomicUsize>,
    /// `llm.max_queue`.
    max_queue: usize,
    metrics: LlmMetrics,
    seeds: std::sync::atomic::AtomicU64,
}

impl Frontend {
    fn bad(&self, field: &'static str, detail: impl Into<String>) -> JobError {
        let rejection = Rejection::Invalid {
            kind: "GenerateRequest",
            field,
            detail: detail.into(),
        };
        self.service.intake.reject("generate", &rejection);
        JobError {
            code: 400,
            message: rejection.to_string(),
        }
    }

    fn prompt_ids(&self, prompt: &Prompt) -> Result<Vec<u32>, JobError> {
        let ids = match prompt {
            Prompt::Text(text) => self.tokenizer.encode(text, false),
            Prompt::Chat(turns) => {
                let messages: Vec<relay_llm::ChatMessage> = turns
                    .iter()
                    .map(|t| relay_llm::ChatMessage {
                        role: t.role.clone(),
                        content: t.content.clone(),
                    })
                    .collect();
                self.tokenizer.encode_chat(&messages, true)
            }
            Prompt::Tokens(t) => Ok(t.to_u32().expect("validated on decode")),
        }
        .map_err(|e| self.bad("prompt", e.to_string()))?;
        if ids.is_empty() {
            return Err(self.bad("prompt", "tokenizes to no tokens"));
        }
        if let Some(bad) = ids.iter().find(|&&t| t as usize >= self.vocab_size) {
            return Err(self.bad(
                "prompt",
                format!(
                    "token {bad} is outside the vocabulary of {}",
                    self.vocab_size
                ),
            ));
        }
        if ids.len() >= self.context {
            return Err(self.bad(
                "prompt",
                format!(
                    "{} tokens leave no room in the model's context of {}",
                    ids.len(),
                    self.context
                ),
            ));
        }
        Ok(ids)
    }

    /// Decodes and checks a request, resolves its adapter, and waits for
    /// the decode thread's answer.
    async fn handle(&self, payload: &[u8]) -> Result<Vec<u8>, JobError> {
        let received = Instant::now();
        let request: GenerateRequest =
            self.service
                .intake
                .decode("generate", payload)
                .map_err(|rejection| JobError {
                    code: 400,
                    message: rejection.to_string(),
                })?;
        let prompt = self.prompt_ids(&request.prompt)?;
        let allowed = if request.allowed.is_empty() {
            None
        } else {
            let texts: Vec<String> = match &request.answer_frame {
                // Checked here: the answer decoded where a thought ends.
                Some(frame) => request
                    .allowed
                    .iter()
                    .map(|m| format!("{}{m}{}", frame.opener, frame.closer))
                    .collect(),
                None => request.allowed.clone(),
            };
            let sequences = TokenSequences::new(&self.tokenizer, &texts)
                .map_err(|e| self.bad("allowed", e.to_string()))?;
            for (text, ids) in sequences.texts().iter().zip(sequences.sequences()) {
                if ids.is_empty() {
                    return Err(self.bad("allowed", format!("{text:?} tokenizes to no tokens")));
                }
            }
            let longest = sequences
                .sequences()
                .iter()
                .map(Vec::len)
                .max()
                .unwrap_or(0);
            if prompt.len() + longest + 1 > self.context {
                return Err(self.bad(
                    "allowed",
                    format!(
                        "a completion of {longest} tokens after {} prompt tokens does not fit the context of {}",
                        prompt.len(),
                        self.context
                    ),
                ));
            }
            Some(Arc::new(sequences))
        };
        let answer = match (&request.answer_frame, &allowed) {
            (Some(frame), Some(whole)) => {
                let after: Vec<String> = request
                    .allowed
                    .iter()
                    .map(|m| format!("{m}{}", frame.closer))
                    .collect();
                let after_opener = TokenSequences::new(&self.tokenizer, &after)
                    .map_err(|e| self.bad("allowed", e.to_string()))?;
                if let Some(text) = after_opener
                    .texts()
                    .iter()
                    .zip(after_opener.sequences())
                    .find_map(|(text, ids)| ids.is_empty().then_some(text))
                {
                    return Err(self.bad("allowed", format!("{text:?} tokenizes to no tokens")));
                }
                Some(JobAnswer {
                    opener: frame.opener.clone(),
                    answer: AnswerAfterThought {
                        after_opener: Arc::new(after_opener),
                        whole: whole.clone(),
                    },
                })
            }
            _ => None,
        };
        let allowed = if answer.is_some() { None } else { allowed };
        let adapter = match &request.adapter {
            Some(wanted) => Some(self.adapters.resolve(wanted).await.map_err(|e| {
                if e.code() == 404 {
                    tracing::warn!(error = %e, "generate request for an unknown adapter");
                }
                JobError {
                    code: e.code(),
                    message: e.to_string(),
                }
            })?),
            None => None,
        };
        let s = &request.sampling;
        let seed = s.seed.unwrap_or_else(|| {
            self.seeds
                .fetch_add(0x9E37_79B9_7F4A_7C15, std::sync::atomic::Ordering::Relaxed)
        });
        let (reply_tx, reply_rx) = tokio::sync::oneshot::channel();
        let job = Job {
            prompt,
            adapter,
            sampling: relay_llm::SamplingParams {
                temperature: s.temperature,
                top_k: s.top_k as usize,
                top_p: s.top_p,
            },
            seed,
            max_tokens: s.max_tokens as usize,
            stop: s.stop.clone(),
            allowed,
            answer,
            received,
            reply: reply_tx,
        };
        // Count the job in before it is sent (the decode thread counts it
        // out), refusing it if the queue is full.
        use std::sync::atomic::Ordering;
        if let Err(waiting) =
            self.waiting
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |waiting| {
                    (waiting < self.max_queue).then_some(waiting + 1)
                })
        {
            self.metrics.queue_full.inc();
            return Err(JobError {
                code: 503,
                message: format!("queue full ({waiting} waiting)"),
            });
        }
        let sent = match &*self.jobs.lock().expect("jobs lock") {
            Some(jobs) => jobs.send(job).is_ok(),
            None => false,
        };
        if !sent {
            self.waiting.fetch_sub(1, Ordering::Relaxed);
            return Err(JobError {
                code: 503,
                message: "the inference server is stopping".into(),
            });
        }
        let reply = reply_rx.await.map_err(|_| JobError {
            code: 500,
            message: "the decode thread stopped".into(),
        })??;
        Ok(relay_proto::encode(&reply))
    }
}

/// How long a stopping server lets running completions finish before it
/// answers them 503.
const STOP_GRACE: std::time::Duration = std::time::Duration::from_millis(500);

/// Serves `generate` until shutdown, then lets running completions finish
/// for [`STOP_GRACE`] at most.
pub(crate) async fn serve(
    service: Service,
    micro: &async_nats::service::Service,
    metrics: LlmMetrics,
) -> Result<(), ServiceError> {
    let cfg = service.config.llm.clone();
    let Some(model_name) = cfg.model.clone() else {
        return Err(ServiceError::Other(format!(
            "llm.model: not set, but run.env_id {} is a text game: give a model folder, a .gguf file or `smollm2`",
            service.config.run.env_id
        )));
    };
    let started = Instant::now();
    let backend = relay_llm::Backend::open(&cfg.backend_spec())
        .map_err(|e| ServiceError::other(e.to_string()))?;
    if cfg.kv_cache_mib > 0 && matches!(backend, relay_llm::Backend::Engine) {
        return Err(ServiceError::Other(
            "llm.kv_cache_mib: bounds the candle backend's paged KV pool, but this server runs \
             the CPU engine (llm.backend: engine, or auto for f32 on the CPU), whose host \
             caches llm.max_sequences bounds; set it to 0 or use llm.backend: candle"
                .into(),
        ));
    }
    let placed = backend.clone();
    let loaded = tokio::task::spawn_blocking(move || {
        let mut loaded = relay_llm::load_model_on(&model_name, cfg.gguf_base, &placed)?;
        loaded
            .tokenizer
            .set_chat_template_kwargs(cfg.chat_template_kwargs.clone());
        let failed = |e: relay_llm::ModelError| LoadError::Load {
            path: loaded.path.clone(),
            detail: e.to_string(),
        };
        // Pack the weights now, not inside the first request, and hold a
        // dense base once: the server only runs the engine's forward.
        loaded.model.keep_packed_only().map_err(&failed)?;
        Ok::<_, LoadError>(loaded)
    })
    .await
    .map_err(ServiceError::other)?
    .map_err(|e| ServiceError::other(format!("llm.model: {e}")))?;
    let cfg = &service.config.llm;
    if let Some(pool) = loaded.model.kv_pool() {
        pool.set_limit_bytes((cfg.kv_cache_mib > 0).then_some(cfg.kv_cache_mib << 20));
    }
    let model_config = loaded.model.config().clone();
    tracing::info!(
        model = %loaded.path.display(),
        architecture = ?model_config.architecture,
        layers = model_config.num_hidden_layers,
        vocab = model_config.vocab_size,
        backend = %backend.describe(),
        seconds = started.elapsed().as_secs_f64(),
        "LLM loaded"
    );
    let adapters = Arc::new(AdapterStore::new(
        model_config.clone(),
        backend,
        cfg.max_adapters,
        &service,
        metrics.clone(),
    ));
    for (name, dir) in &cfg.adapters {
        adapters
            .add_folder(name, dir.clone())
            .await
            .map_err(|e| ServiceError::Other(format!("llm.adapters.{name}: {e}")))?;
    }
    // Adapter versions published by the learner (or anyone), from the
    // current one on.
    adapters
        .follow(&service, relay_policy::text::LEARNING_ADAPTER)
        .await?;

    let tokenizer = Arc::new(loaded.tokenizer);
    let mut stop_token_ids = model_config.eos_token_ids.clone();
    stop_token_ids.extend(tokenizer.eos_token_id());
    stop_token_ids.sort_unstable();
    stop_token_ids.dedup();
    let (jobs_tx, jobs_rx) = std::sync::mpsc::channel::<Job>();
    let waiting = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let abandon = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let engine = Engine {
        abandon: abandon.clone(),
        model: loaded.model,
        tokenizer: tokenizer.clone(),
        stop_token_ids,
        max_sequences: cfg.max_sequences,
        prefix_cache: cfg.prefix_cache,
        waiting: waiting.clone(),
        metrics: metrics.clone(),
    };
    let decode_thread = std::thread::Builder::new()
        .name("llm-decode".into())
        .spawn(move || engine.run(jobs_rx))
        .map_err(ServiceError::Io)?;

    let frontend = Arc::new(Frontend {
        service: service.clone(),
        tokenizer,
        vocab_size: model_config.vocab_size,
        context: model_config.max_position_embeddings,
        adapters,
        jobs: std::sync::Mutex::new(Some(jobs_tx)),
        waiting,
        max_queue: cfg.max_queue,
        metrics,
        seeds: std::sync::atomic::AtomicU64::new(
            service.config.run.seed ^ (std::process::id() as u64) << 32,
        ),
    });
    let mut requests = micro
        .endpoint(service.subjects.generate())
        .await
        .map_err(ServiceError::nats)?;
    service.health.set_ready(true);
    let mut handlers = tokio::task::JoinSet::new();
    loop {
        let request = tokio::select! {
            _ = service.shutdown.wait() => break,
            r = requests.next() => match r { Some(r) => r, None => break },
        };
        let frontend = frontend.clone();
        handlers.spawn(async move {
            let result = frontend.handle(&request.message.payload).await;
            let response = match result {
                Ok(bytes) => Ok(bytes.into()),
                Err(e) => Err(service_error(e.code, e.message)),
            };
            let _ = request.respond(response).await;
        });
        // Reap finished handlers so the set stays small.
        while handlers.try_join_next().is_some() {}
    }
    // No new jobs; the decode thread finishes the running ones and stops,
    // or answers what is left 503 after the grace.
    frontend.jobs.lock().expect("jobs lock").take();
    let drain = async { while handlers.join_next().await.is_some() {} };
    tokio::pin!(drain);
    if tokio::time::timeout(STOP_GRACE, &mut drain).await.is_err() {
        tracing::info!(
            grace_s = STOP_GRACE.as_secs_f64(),
            "completions still running at the end of the stop's grace; answering them 503"
        );
        abandon.store(true, std::sync::atomic::Ordering::Relaxed);
        if tokio::time::timeout(std::time::Duration::from_secs(1), drain)
            .await
            .is_err()
        {
            tracing::warn!("generate requests still unanswered after the decode thread gave up");
        }
    }
    let _ = tokio::task::spawn_blocking(move || decode_thread.join()).await;
    Ok(())
}
