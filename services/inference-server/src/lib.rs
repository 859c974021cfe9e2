//! inference-server: batched `act` for MLP policies and `generate` for LLM
//! policies, over NATS request-reply.
//!
//! Which endpoints a copy serves follows the config: `act` unless
//! `run.env_id` is a text game; `generate` (module [`llm`]) when it is one
//! or `llm.model` is set. Both are endpoints of one NATS micro service
//! (`relay-inference-server`) in its queue group.
//!
//! # act
//!
//! Requests arrive on `relay.<run>.act` in the service's queue group, so any
//! number of copies share the load. A batch takes every request already
//! queued, then waits up to `inference.batch_wait_us` for more (or until
//! `inference.max_batch` observations are gathered); one forward pass
//! answers them all, each reply naming the weights version used. New weights are built off the hot path
//! by the [`PolicyFollower`] and swapped in between batches, so no request is
//! dropped by a swap. A copy joins the queue group once it has weights.
//!
//! In runs with a `normalize` section on, observations arrive already
//! normalised: the env-runners normalise (with their running statistics,
//! as SB3's `VecNormalize` wrapper does) and the fragments keep exactly
//! what this server acted on. The server never normalises; the
//! statistics a version carries matter to those who run the policy on raw
//! observations (the evaluator, `relay play`).
//!
//! League runs (`selfplay.opponents.league`): a request may name a past
//! version (`ActRequest::policy_version`, a league opponent's). The server
//! builds it from the run's league bucket, where the learner stored it
//! ([`relay_policy::league`]), keeps the [`PAST_VERSIONS_HELD`] most
//! recently asked for, and answers 404 for a version that is not stored
//! (never admitted to the pool, or evicted), so the env-runner plays that
//! game against the current version instead. A past version is fetched
//! on the batch loop the first time it is asked for: a few milliseconds
//! for the MLPs and CNNs such games use, once per version and copy.
//!
//! DQN runs (`run.algo: dqn`): the weights are a Q-network and sampled
//! actions are epsilon-greedy, with `dqn.exploration_rate` at the env steps
//! the version was trained on (`WeightsUpdate::learner_env_steps`), so every
//! env-runner explores as the learner's schedule says; deterministic
//! requests (the evaluator's) get the greedy action. Exploration lives here
//! and not in the env-runners so that acting has one place and one schedule.
//!
//! SAC runs (`run.algo: sac`): the weights are the actor alone (`actor.*`;
//! the critics stay in the learner); sampled actions are the squashed
//! Gaussian's `tanh(μ + σ ε)` and deterministic ones `tanh(μ)`, both in env
//! units (scaled to the action bounds).

pub mod llm;

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::{FutureExt, StreamExt};
use prometheus::{Histogram, HistogramOpts, IntCounter, IntGauge};
use rand::{Rng, SeedableRng};
use relay_kit::{counter, gauge, Service, ServiceConfig, ServiceError, Shutdown};
use relay_nn::Actions;
use relay_policy::{Act, PolicyBuilder, PolicyFollower, VersionedPolicy};
use relay_proto::{ActReply, ActRequest, Tensor, SCHEMA_VERSION};

struct Metrics {
    past_versions_built: IntCounter,
    batch_size: Histogram,
    queue_depth: Histogram,
    forward_seconds: Histogram,
    requests: IntCounter,
    weights_version: IntGauge,
}

impl Metrics {
    fn register(registry: &prometheus::Registry) -> Self {
        let queue_depth = Histogram::with_opts(
            HistogramOpts::new(
                "relay_inference_queue_depth",
                "Act requests waiting together when a batch was formed.",
            )
            .buckets(vec![1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0]),
        )
        .unwrap();
        let batch_size = Histogram::with_opts(
            HistogramOpts::new(
                "relay_inference_batch_size",
                "Observations per forward pass.",
            )
            .buckets(vec![
                1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0,
            ]),
        )
        .unwrap();
        let forward_seconds = Histogram::with_opts(
            HistogramOpts::new(
                "relay_inference_forward_seconds",
                "Time of one batched forward pass.",
            )
            .buckets(vec![1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1]),
        )
        .unwrap();
        let requests =
            IntCounter::new("relay_inference_requests_total", "Act requests answered.").unwrap();
        let weights_version = IntGauge::new(
            "relay_inference_weights_version",
            "Weights version this copy serves.",
        )
        .unwrap();
        let past_versions_built = IntCounter::new(
            "relay_inference_past_versions_built_total",
            "Past weights versions built from the league bucket for league opponents.",
        )
        .unwrap();
        relay_kit::metrics::register(registry, &past_versions_built);
        relay_kit::metrics::register(registry, &batch_size);
        relay_kit::metrics::register(registry, &queue_depth);
        relay_kit::metrics::register(registry, &forward_seconds);
        relay_kit::metrics::register(registry, &requests);
        relay_kit::metrics::register(registry, &weights_version);
        Self {
            past_versions_built,
            batch_size,
            queue_depth,
            forward_seconds,
            requests,
            weights_version,
        }
    }
}

fn service_error(code: usize, status: impl Into<String>) -> async_nats::service::error::Error {
    async_nats::service::error::Error {
        status: status.into(),
        code,
    }
}

/// Runs the inference server until shutdown.
pub async fn run(config: ServiceConfig, shutdown: Shutdown) -> Result<(), ServiceError> {
    let service = Service::start("inference-server", config, shutdown).await?;
    let metrics = Metrics::register(&service.registry);
    // Registered in every mode, so the catalogue holds for any run.
    let llm_metrics = llm::metrics::LlmMetrics::register(&service.registry);
    let micro = service.micro().await?;
    let serve_act = !service.config.is_text_game();
    let serve_generate = service.config.serves_llm();
    let act = async {
        if serve_act {
            serve_act_requests(&service, &micro, metrics).await
        } else {
            Ok(())
        }
    };
    let generate = async {
        if serve_generate {
            llm::serve(service.clone(), &micro, llm_metrics).await
        } else {
            Ok(())
        }
    };
    let result = tokio::try_join!(act, generate).map(|_| ());
    let _ = micro.stop().await;
    result.and(service.finish().await)
}

/// Why an act request does not fit the policy: its observation width,
/// masks given to a continuous policy or of another action count, or a
/// recurrent state of another width than the policy's `state_width` (a
/// state for a feed-forward policy included).
fn act_mismatch(
    act: &ActRequest,
    obs_dim: usize,
    n_actions: Option<usize>,
    state_width: usize,
) -> Option<(&'static str, String)> {
    if act.obs.shape[1] as usize != obs_dim {
        return Some((
            "obs",
            format!(
                "obs has {} features, the policy takes {obs_dim}",
                act.obs.shape[1]
            ),
        ));
    }
    if let Some(state) = &act.state {
        let width = state.shape[1] as usize;
        if width != state_width {
            return Some((
                "state",
                match state_width {
                    0 => "a recurrent state for a feed-forward policy".into(),
                    w => format!("states of {width} values, the policy's are {w}"),
                },
            ));
        }
    }
    let width = act.masks.as_ref()?.shape[1] as usize;
    match n_actions {
        None => Some((
            "masks",
            "action masks for a policy of continuous actions".into(),
        )),
        Some(k) if k != width => Some((
            "masks",
            format!("masks of {width} actions, the policy has {k}"),
        )),
        Some(_) => None,
    }
}

/// Past versions held for league opponents, at most.
pub const PAST_VERSIONS_HELD: usize = 32;
/// How long a version found missing is answered 404 without looking again.
const MISSING_FOR: Duration = Duration::from_secs(5);

/// The past versions this copy built for league opponents, the most
/// recently asked for last.
struct PastVersions {
    build: PolicyBuilder,
    held: VecDeque<Arc<VersionedPolicy>>,
    missing: HashMap<u64, Instant>,
}

impl PastVersions {
    /// Version `version`, built from the league bucket if not held; an
    /// error is the code and status to answer.
    async fn get(
        &mut self,
        service: &Service,
        version: u64,
        metrics: &Metrics,
    ) -> Result<Arc<VersionedPolicy>, (usize, String)> {
        if let Some(k) = self.held.iter().position(|p| p.version == version) {
            let policy = self.held.remove(k).expect("found");
            self.held.push_back(policy.clone());
            return Ok(policy);
        }
        let not_stored = || {
            (
                404,
                format!("weights version {version} is not stored in the league (never admitted, or evicted)"),
            )
        };
        if self
            .missing
            .get(&version)
            .is_some_and(|at| at.elapsed() < MISSING_FOR)
        {
            return Err(not_stored());
        }
        let run_id = service.config.run_id().map_err(|e| (500, e.to_string()))?;
        let timeout = Duration::from_millis(service.config.weights.fetch_timeout_ms);
        let weights = match relay_policy::league::fetch_version(
            &service.nats,
            run_id,
            version,
            timeout,
        )
        .await
        {
            Ok(weights) => weights,
            Err(relay_policy::league::StoredVersionError::NotStored(_)) => {
                self.missing.retain(|_, at| at.elapsed() < MISSING_FOR);
                self.missing.insert(version, Instant::now());
                return Err(not_stored());
            }
            Err(e) => return Err((503, e.to_string())),
        };
        let policy = Arc::new((self.build)(&weights).map_err(|e| (500, e.to_string()))?);
        metrics.past_versions_built.inc();
        tracing::info!(version, "past version built for league games");
        if self.held.len() == PAST_VERSIONS_HELD {
            self.held.pop_front();
        }
        self.held.push_back(policy.clone());
        Ok(policy)
    }
}

/// Serves `act` until shutdown.
async fn serve_act_requests(
    service: &Service,
    micro: &async_nats::service::Service,
    metrics: Metrics,
) -> Result<(), ServiceError> {
    let shutdown = service.shutdown.clone();
    let cfg = service.config.clone();
    let mut follower = PolicyFollower::start(service).await?;
    let mut past_versions = PastVersions {
        build: relay_policy::policy_builder(&cfg)?,
        held: VecDeque::new(),
        missing: HashMap::new(),
    };
    // Healthy (alive, connected) at once; serving once weights are in.
    service.health.set_ready(true);
    // Join the queue group only with weights in hand, so that a new copy
    // never answers "no weights yet" while others could serve.
    tokio::select! {
        _ = follower.newer_than(None) => {}
        _ = shutdown.wait() => return Ok(()),
    }
    // The gauge says what this copy holds as soon as it holds it, not at
    // the next request: after a run's last update no request may come.
    let mut watching = follower.clone();
    let version_gauge = metrics.weights_version.clone();
    tokio::spawn(async move {
        let mut held = None;
        while let Some(policy) = watching.newer_than(held).await {
            version_gauge.set(policy.version as i64);
            held = Some(policy.version);
        }
    });
    let mut requests = micro
        .endpoint(service.subjects.act())
        .await
        .map_err(ServiceError::nats)?;
    service.health.set_ready(true);
    let policy_spec = relay_policy::spec_for(&cfg).map_err(ServiceError::other)?;
    let obs_dim = policy_spec.obs_dim;
    // Discrete policies take action masks of their action count.
    let n_actions = match policy_spec.action {
        relay_nn::ActionKind::Discrete { n } => Some(n),
        relay_nn::ActionKind::Continuous { .. } => None,
    };
    let state_width = cfg.policy.state_width();
    let max_reply = service.max_message_bytes();
    let mut rng = rand::rngs::StdRng::seed_from_u64(cfg.run.seed ^ std::process::id() as u64);
    let wait = Duration::from_micros(cfg.inference.batch_wait_us);
    let mut report_at = Instant::now() + Duration::from_secs(1);
    let mut reported_requests = 0;
    let mut reported_version: Option<u64> = None;
    loop {
        let first = tokio::select! {
            _ = shutdown.wait() => break,
            r = requests.next() => match r { Some(r) => r, None => break },
        };
        // Gather a batch: the first request waits a little for company.
        let mut batch = vec![first];
        let deadline = tokio::time::Instant::now() + wait;
        let mut total = 0usize;
        let mut decoded = Vec::with_capacity(8);
        loop {
            for request in batch.drain(..) {
                match service
                    .intake
                    .decode::<ActRequest>("act", &request.message.payload)
                {
                    Ok(act) if act_mismatch(&act, obs_dim, n_actions, state_width).is_some() => {
                        let (field, detail) =
                            act_mismatch(&act, obs_dim, n_actions, state_width).expect("guarded");
                        service.intake.reject(
                            "act",
                            &relay_proto::Rejection::Invalid {
                                kind: "ActRequest",
                                field,
                                detail: detail.clone(),
                            },
                        );
                        let _ = request.respond(Err(service_error(400, detail))).await;
                    }
                    Ok(act) => {
                        total += act.obs.shape[0] as usize;
                        decoded.push((request, act));
                    }
                    Err(rejection) => {
                        let _ = request
                            .respond(Err(service_error(400, rejection.to_string())))
                            .await;
                    }
                }
            }
            if total >= cfg.inference.max_batch {
                break;
            }
            // Requests already queued join at once; then wait up to the
            // deadline for more (a zero wait takes only what is queued).
            if let Some(Some(r)) = requests.next().now_or_never() {
                batch.push(r);
                continue;
            }
            if wait.is_zero() {
                break;
            }
            match tokio::time::timeout_at(deadline, requests.next()).await {
                Ok(Some(r)) => batch.push(r),
                _ => break,
            }
        }
        metrics.queue_depth.observe(decoded.len() as f64);
        if decoded.is_empty() {
            continue;
        }
        let Some(current) = follower.latest() else {
            for (request, _) in decoded {
                let _ = request
                    .respond(Err(service_error(503, "no weights yet")))
                    .await;
            }
            continue;
        };
        // One forward per determinism flag and past version asked for
        // (almost always a single group: the newest, sampling).
        let past = |act: &ActRequest| act.policy_version.filter(|&v| v != current.version);
        let mut groups: Vec<(bool, Option<u64>)> = decoded
            .iter()
            .map(|(_, a)| (a.deterministic, past(a)))
            .collect();
        groups.sort_unstable();
        groups.dedup();
        for (deterministic, version) in groups {
            let group: Vec<&(async_nats::service::Request, ActRequest)> = decoded
                .iter()
                .filter(|(_, a)| a.deterministic == deterministic && past(a) == version)
                .collect();
            let policy = match version {
                None => current.clone(),
                Some(v) => match past_versions.get(service, v, &metrics).await {
                    Ok(policy) => policy,
                    Err((code, status)) => {
                        for (request, _) in group {
                            let _ = request
                                .respond(Err(service_error(code, status.clone())))
                                .await;
                        }
                        continue;
                    }
                },
            };
            let mut obs = Vec::with_capacity(total * obs_dim);
            for (_, act) in &group {
                obs.extend(act.obs.observations_to_f32().expect("validated on decode"));
            }
            let n = obs.len() / obs_dim;
            // Requests without masks (all legal) may share a batch with masked ones.
            let masks = match n_actions {
                Some(k) if group.iter().any(|(_, a)| a.masks.is_some()) => {
                    let mut masks = Vec::with_capacity(n * k);
                    for (_, act) in &group {
                        match &act.masks {
                            Some(m) => masks.extend_from_slice(&m.data),
                            None => masks.resize(masks.len() + act.obs.shape[0] as usize * k, 1),
                        }
                    }
                    Some(masks)
                }
                _ => None,
            };
            // Recurrent policies: each row's state (zeros where a request
            // sent none: an episode's start), advanced by the forward.
            let mut state = Vec::with_capacity(n * state_width);
            if state_width > 0 {
                for (_, act) in &group {
                    match &act.state {
                        Some(s) => state.extend(s.to_f32().expect("validated on decode")),
                        None => {
                            state.resize(state.len() + act.obs.shape[0] as usize * state_width, 0.0)
                        }
                    }
                }
            }
            // gSDE: each row's exploration seed (a fresh one where a
            // request sent none).
            let noise_seeds: Option<Vec<u64>> =
                (!deterministic && group.iter().any(|(_, a)| a.noise_seeds.is_some())).then(|| {
                    group
                        .iter()
                        .flat_map(|(_, act)| match &act.noise_seeds {
                            Some(seeds) => seeds.clone(),
                            None => (0..act.obs.shape[0]).map(|_| rng.random()).collect(),
                        })
                        .collect()
                });
            let started = Instant::now();
            let acted = match &noise_seeds {
                Some(seeds) => {
                    policy
                        .model
                        .act_explore(&obs, n, &mut state, masks.as_deref(), seeds, &mut rng)
                }
                None => policy.model.act(
                    &obs,
                    n,
                    &mut state,
                    masks.as_deref(),
                    deterministic,
                    &mut rng,
                ),
            };
            let out = match acted {
                Ok(out) => out,
                Err(e) => {
                    tracing::error!(error = %e, "forward pass failed");
                    for (request, _) in group {
                        let _ = request
                            .respond(Err(service_error(500, format!("forward failed: {e}"))))
                            .await;
                    }
                    continue;
                }
            };
            metrics
                .forward_seconds
                .observe(started.elapsed().as_secs_f64());
            metrics.batch_size.observe(n as f64);
            let mut offset = 0;
            for (request, act) in group {
                let k = act.obs.shape[0] as usize;
                let actions = match &out.actions {
                    Actions::Discrete(a) => Tensor::from_i64(&[k], &a[offset..offset + k]),
                    Actions::Continuous(a) => {
                        let dim = a.len() / n;
                        Tensor::from_f32(&[k, dim], &a[offset * dim..(offset + k) * dim])
                    }
                };
                let reply = ActReply {
                    schema: SCHEMA_VERSION,
                    policy_version: policy.version,
                    actions,
                    logprobs: Tensor::from_f32(&[k], &out.logprobs[offset..offset + k]),
                    values: Tensor::from_f32(&[k], &out.values[offset..offset + k]),
                    state: (state_width > 0).then(|| {
                        Tensor::from_f32(
                            &[k, state_width],
                            &state[offset * state_width..(offset + k) * state_width],
                        )
                    }),
                };
                offset += k;
                // A reply too large for a message is answered 413: the
                // env-runner divides the request and asks again.
                let _ = request
                    .respond(relay_kit::reply_within(&reply, max_reply))
                    .await;
                metrics.requests.inc();
            }
        }
        // Each second, and at once when a new version is served (a short
        // run may end before the next second).
        if Instant::now() >= report_at || reported_version != Some(current.version) {
            report_at = Instant::now() + Duration::from_secs(1);
            reported_version = Some(current.version);
            let answered = metrics.requests.get();
            service
                .report(
                    None,
                    vec![
                        counter(
                            "inference_requests_total",
                            (answered - reported_requests) as f64,
                        ),
                        gauge("inference_weights_version", current.version as f64),
                    ],
                )
                .await;
            reported_requests = answered;
        }
    }
    Ok(())
}
