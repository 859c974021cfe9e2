//! env-runner: steps `env_runner.num_envs` environments together, asks the
//! inference servers for actions (NATS request-reply), and ships rollout
//! fragments of `env_runner.fragment_steps` vector steps, tagged with the
//! oldest policy version that acted in them, to the replay buffer. Finished
//! episodes are published for the tracker. Any number of copies can run;
//! each seeds its envs from the run seed and its instance name.
//!
//! Backpressure: a fragment refused because the buffer is full is retried
//! after the delay the buffer asks for, one the rate limiter holds back
//! after twice as long with each refusal in a row (up to 16 ms), and
//! stepping waits meanwhile. At most one insert is in flight while the
//! next fragment is collected. With `env_runner.pace` a copy in a PPO or
//! A2C run also paces itself ([`pace`]): while the buffer holds a whole
//! rollout for the learner it begins no fragment, but waits for the
//! learner's next version, rather than act steps that would be dropped as
//! stale.
//!
//! Normalisation (`normalize:` with `obs` or `reward` on): this copy is
//! the run's `VecNormalize` wrapper, as in Stable-Baselines3. It keeps a
//! [`VecNormalize`] that starts from the statistics of the newest weights
//! version (followed on `weights` by a [`StatsFollower`], which builds no
//! model) plus everything it has seen since, and updates it with each
//! step's raw observations and discounted returns.
//! Observations are normalised here: the inference servers act on them as
//! they arrive, and the fragment's `obs`, `next_obs` and `final_obs` are the
//! normalised observations the policy saw (so the learner's log-prob ratios
//! start at exactly 1, as in SB3's rollout buffer). `rewards` stay raw;
//! with `normalize.reward` the scaled rewards go in `norm_rewards`, which
//! the learner trains on. Each fragment carries `norm_delta`, the
//! statistics of the raw data seen since the previous fragment, which the
//! learner merges into the run's statistics. A fragment the replay buffer
//! refuses takes its delta with it (those steps are then missing from the
//! statistics, as they are from training). Episode returns are the envs'
//! raw returns.
//!
//! Recurrent policies (`policy.recurrent`): each env's state (the LSTM's h
//! and c, or the GRU's h, of actor and critic) lives here, beside the env
//! it belongs to. Each act request carries the rows' states and the reply
//! the states after the step; the state is zeroed when an episode ends
//! (terminated or truncated) and when an env is rebuilt after a fault, and
//! each fragment records the states of its first step (`initial_state`),
//! from which the learner replays it by backpropagation through time. The
//! inference servers keep no state, unlike SEED RL's (which pins each env
//! to one server's memory): any server can answer any step, so a server
//! that restarts, a `relay scale` that adds or removes servers, or a reply
//! from another copy can never hand an env another env's state or lose
//! one, and an env-runner that restarts starts its envs' episodes over
//! with zero states, as it does its envs. A new weights version mid-episode
//! continues from the state the previous version left, as in SEED RL,
//! R2D2 and RecurrentPPO's rollouts; the learner replays each fragment
//! from that stored state, so a version change costs only the usual
//! off-policy lag. The price is the state on the wire, `4 x state_width`
//! bytes per row each way (1 KiB for an LSTM of 64 in actor and critic),
//! small beside most observations.
//!
//! A multi-agent game (PettingZoo's) is played by self-play instead
//! ([`selfplay`]): the policy holds one seat of each game.
//!
//! When `run.env_id` is a text game the env-runner plays games instead
//! ([`text`]): `text.games_in_flight` at a time, with the LLM policy over
//! `relay.<run>.generate`, publishing each finished game.
//!
//! Stopping: the loop looks at the shutdown signal before each step, and
//! the signal also cancels any wait on the Python workers
//! ([`relay_bridge::Cancel`]: their start, a step of a hung worker), whose
//! processes die with the envs; so a copy stops within the promise of
//! every service (2 s), not after `env.start_timeout_s` or
//! `env.step_timeout_s`.

mod fragment;
pub mod league;
mod pace;
mod selfplay;
mod text;

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use prometheus::{Histogram, HistogramOpts, IntCounter, IntCounterVec, Opts};
use relay_bridge::{BridgeError, FaultKind, VecEnvs};
use relay_envs::{ActionSpace, VecActions};
use relay_kit::{counter, gauge, RequestError, Service, ServiceConfig, ServiceError, Shutdown};
use relay_nn::VecNormalize;
use relay_policy::StatsFollower;
use relay_proto::{
    ActReply, ActRequest, AgentReturn, DType, EpisodeReport, EpisodeSummary, InsertAck,
    RolloutFragment, Tensor, SCHEMA_VERSION,
};

use fragment::FragmentBuilder;

pub(crate) struct Metrics {
    env_steps: IntCounter,
    vec_steps: IntCounter,
    episodes: IntCounter,
    act_latency: Histogram,
    step_seconds: Histogram,
    episode_seconds: Histogram,
    fragments: IntCounterVec,
    backpressure_waits: IntCounter,
    pace_wait_seconds: prometheus::Counter,
    env_faults: IntCounterVec,
    worker_restarts: IntCounter,
}

impl Metrics {
    fn register(registry: &prometheus::Registry) -> Self {
        let env_steps = IntCounter::new(
            "relay_env_runner_env_steps_total",
            "Env steps taken by this env-runner.",
        )
        .unwrap();
        let vec_steps = IntCounter::new(
            "relay_env_runner_vec_steps_total",
            "Vector steps taken by this env-runner.",
        )
        .unwrap();
        let episodes = IntCounter::new(
            "relay_env_runner_episodes_total",
            "Episodes finished by this env-runner.",
        )
        .unwrap();
        let act_latency = Histogram::with_opts(
            HistogramOpts::new(
                "relay_env_runner_act_latency_seconds",
                "Round trip of one act request.",
            )
            .buckets(vec![
                1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 5e-2, 0.25, 1.0,
            ]),
        )
        .unwrap();
        let step_seconds = Histogram::with_opts(
            HistogramOpts::new(
                "relay_env_runner_step_seconds",
                "Wall time of one vector step (a turn): act request plus env step.",
            )
            .buckets(vec![
                1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 5e-2, 0.25, 1.0,
            ]),
        )
        .unwrap();
        let episode_seconds = Histogram::with_opts(
            HistogramOpts::new(
                "relay_env_runner_episode_seconds",
                "Wall time of one episode.",
            )
            .buckets(vec![0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0, 100.0]),
        )
        .unwrap();
        let fragments = IntCounterVec::new(
            Opts::new(
                "relay_env_runner_fragments_total",
                "Rollout fragments by outcome (stored, stale, rejected).",
            ),
            &["outcome"],
        )
        .unwrap();
        let backpressure_waits = IntCounter::new(
            "relay_env_runner_backpressure_waits_total",
            "Inserts refused because the replay buffer was full.",
        )
        .unwrap();
        relay_kit::metrics::register(registry, &env_steps);
        relay_kit::metrics::register(registry, &vec_steps);
        relay_kit::metrics::register(registry, &episodes);
        relay_kit::metrics::register(registry, &act_latency);
        relay_kit::metrics::register(registry, &step_seconds);
        relay_kit::metrics::register(registry, &episode_seconds);
        relay_kit::metrics::register(registry, &fragments);
        relay_kit::metrics::register(registry, &backpressure_waits);
        let pace_wait_seconds = prometheus::Counter::new(
            "relay_env_runner_pace_wait_seconds_total",
            "Seconds an env-runner waited for the learner's next version with a whole rollout in the buffer (env_runner.pace).",
        )
        .unwrap();
        relay_kit::metrics::register(registry, &pace_wait_seconds);
        let env_faults = IntCounterVec::new(
            Opts::new(
                "relay_env_runner_env_faults_total",
                "Episodes dropped by a Python env fault, by kind (raised, crashed, hung).",
            ),
            &["kind"],
        )
        .unwrap();
        for kind in FaultKind::ALL {
            env_faults.with_label_values(&[kind.as_str()]);
        }
        let worker_restarts = IntCounter::new(
            "relay_env_runner_worker_restarts_total",
            "Python env workers restarted after a crash or a hang.",
        )
        .unwrap();
        relay_kit::metrics::register(registry, &env_faults);
        relay_kit::metrics::register(registry, &worker_restarts);
        Self {
            env_steps,
            vec_steps,
            episodes,
            act_latency,
            step_seconds,
            episode_seconds,
            fragments,
            backpressure_waits,
            pace_wait_seconds,
            env_faults,
            worker_restarts,
        }
    }
}

impl Metrics {
    /// Logs and counts the env faults of a step (their episodes are dropped).
    pub(crate) fn count_faults(&self, env_id: &str, faults: &[relay_bridge::Fault]) {
        for fault in faults {
            tracing::warn!(
                env_id,
                kind = fault.kind.as_str(),
                "env fault, episode dropped: {fault}"
            );
            self.env_faults
                .with_label_values(&[fault.kind.as_str()])
                .inc_by(fault.envs.len() as u64);
            if fault.kind.restarted() {
                self.worker_restarts.inc();
            }
        }
    }
}

/// The episodes a step finished: one per env, or for a parallel game
/// played by one shared policy (`team`, its agents) one per game, its
/// return the team's with each agent's beside it.
fn episode_summaries(
    finished: &[relay_envs::FinishedEpisode],
    team: &[String],
) -> Vec<EpisodeSummary> {
    if team.is_empty() {
        return finished
            .iter()
            .map(|e| EpisodeSummary {
                episode_return: e.episode_return,
                length: e.length,
                terminated: e.terminated,
                ..Default::default()
            })
            .collect();
    }
    relay_envs::team_episodes(finished, team.len())
        .into_iter()
        .map(|game| EpisodeSummary {
            episode_return: game.team_return(),
            length: game.length,
            terminated: game.terminated,
            agent_returns: Some(
                team.iter()
                    .zip(&game.returns)
                    .map(|(agent, &r)| AgentReturn {
                        agent: agent.clone(),
                        episode_return: r,
                    })
                    .collect(),
            ),
            ..Default::default()
        })
        .collect()
}

/// A [`relay_bridge::Cancel`] set when `shutdown` fires: the envs' waits
/// on their Python workers end then.
pub(crate) fn cancel_on(shutdown: &Shutdown) -> relay_bridge::Cancel {
    let cancel = relay_bridge::Cancel::new();
    let set = cancel.clone();
    shutdown.on_trigger(move || set.cancel());
    cancel
}

/// Derives this copy's env seed from the run seed and its instance name, so
/// that copies do not replay each other's episodes.
fn runner_seed(seed: u64, instance: &str) -> u64 {
    instance.bytes().fold(seed ^ 0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ b as u64).wrapping_mul(0x1000_0000_01b3)
    })
}

/// Checks an act reply against the request size and the action space.
fn check_reply(
    reply: &ActReply,
    n: usize,
    space: &ActionSpace,
    masks: Option<&[u8]>,
    state: Option<&[f32]>,
) -> Result<(), String> {
    // A recurrent policy's reply carries each row's next state, as wide as
    // the one sent.
    if let Some(sent) = state {
        let width = sent.len() / n;
        let next = reply.state.as_ref().ok_or_else(|| {
            "no recurrent state in the reply (the inference server serves a feed-forward policy?)"
                .to_string()
        })?;
        next.expect(DType::F32, &[Some(n), Some(width)])
            .map_err(|e| format!("state: {e}"))?;
    }
    match space {
        ActionSpace::Discrete { n: actions } => {
            reply
                .actions
                .expect(DType::I64, &[Some(n)])
                .map_err(|e| e.to_string())?;
            let values = reply.actions.to_i64().map_err(|e| e.to_string())?;
            if let Some(a) = values.iter().find(|&&a| a < 0 || a as usize >= *actions) {
                return Err(format!("action {a} outside Discrete({actions})"));
            }
            if let Some(masks) = masks {
                let illegal = values
                    .iter()
                    .zip(masks.chunks_exact(*actions))
                    .position(|(&a, mask)| mask[a as usize] == 0);
                if let Some(i) = illegal {
                    return Err(format!(
                        "action {} for env {i} is illegal under its action mask",
                        values[i]
                    ));
                }
            }
        }
        ActionSpace::Box { low, .. } => {
            reply
                .actions
                .expect(DType::F32, &[Some(n), Some(low.len())])
                .map_err(|e| e.to_string())?;
        }
    }
    Ok(())
}

/// Runs the env-runner until shutdown: text mode ([`text`]) when
/// `run.env_id` is a text game, else the vectorized classic-control loop.
pub async fn run(config: ServiceConfig, shutdown: Shutdown) -> Result<(), ServiceError> {
    let service = Service::start("env-runner", config, shutdown.clone()).await?;
    // From here on the service stops on the caller's signal or its own failure.
    let shutdown = service.shutdown.clone();
    let cfg = service.config.clone();
    if cfg.is_text_game() {
        let seed = runner_seed(cfg.run.seed, &service.instance);
        return text::run(service, shutdown, seed).await;
    }
    let metrics = Metrics::register(&service.registry);
    let n = cfg.env_runner.num_envs;
    let mut envs = match VecEnvs::cancellable(
        &cfg.run.env_id,
        &cfg.env,
        n,
        runner_seed(cfg.run.seed, &service.instance),
        &cancel_on(&shutdown),
    ) {
        Ok(envs) => envs,
        Err(BridgeError::Cancelled { .. }) => return service.finish().await,
        Err(e) => return Err(ServiceError::other(format!("run.env_id: {e}"))),
    };
    let spec = envs.spec().clone();
    let obs_dim = envs.obs_dim();
    let action_dim = (!spec.action_space.is_discrete()).then(|| spec.action_space.dim());
    let (low, high) = match &spec.action_space {
        ActionSpace::Box { low, high } => (low.clone(), high.clone()),
        ActionSpace::Discrete { .. } => (Vec::new(), Vec::new()),
    };
    cfg.check_env(&spec).map_err(ServiceError::other)?;
    if !spec.agents.is_empty() {
        let seed = runner_seed(cfg.run.seed, &service.instance);
        return selfplay::run(service, shutdown, envs, metrics, seed).await;
    }
    let pixels = cfg.observations_as_pixels(&spec);
    let mut obs = match envs.reset() {
        Ok(obs) => obs.to_vec(),
        Err(BridgeError::Cancelled { .. }) => return service.finish().await,
        Err(e) => return Err(ServiceError::other(e)),
    };
    // The legal actions of each env in `obs` (envs with action masks).
    let mut masks: Option<Vec<u8>> = envs.masks().map(<[u8]>::to_vec);
    let mask_width = masks.as_ref().and(spec.action_space.n());
    // Normalisation: local statistics (and the delta to ship), synced to
    // each weights version's statistics as it arrives.
    let mut normalizer = match cfg.normalizer() {
        Some(norm) => {
            let mut v = VecNormalize::new(norm, obs_dim, n)
                .map_err(|e| ServiceError::other(format!("normalize: {e}")))?;
            v.track_delta();
            v.reset(&mut obs)
                .map_err(|e| ServiceError::other(format!("normalize: first observations: {e}")))?;
            Some(v)
        }
        None => None,
    };
    let follower = match normalizer {
        Some(_) => Some(StatsFollower::start(&service).await?),
        None => None,
    };
    let mut synced_version: Option<u64> = None;
    let act_subject = service.subjects.act();
    let mut fragment = FragmentBuilder::new(n, obs_dim, pixels, spec.image, mask_width);
    let mut inserts = Inserts::default();
    // Env steps of the insert in flight, and those the buffer held at the
    // last ack (the pacer's view of what waits for the learner).
    let mut pending_steps = 0u64;
    let mut episodes: Vec<EpisodeSummary> = Vec::new();
    let mut recent_returns: VecDeque<f64> = VecDeque::with_capacity(100);
    let mut last_version = 0u64;
    let mut pacer = match cfg.rollout_env_steps() {
        Some((_, rollout)) if cfg.env_runner.pace => Some(pace::Pacer::new(
            rollout,
            Duration::from_secs_f64(cfg.env_runner.pace_timeout_s),
            relay_policy::announced_versions(&service).await?,
        )),
        _ => None,
    };
    let mut reported = Reported {
        at: Instant::now(),
        env_steps: 0,
        vec_steps: 0,
    };
    let mut clipped = vec![0f32; action_dim.unwrap_or(0) * n];
    service.health.set_ready(true);

    let mut episode_started = vec![Instant::now(); n];
    // A recurrent policy's state per env, kept here and sent with each act
    // request (module docs): zeros at each episode's start.
    let state_width = cfg.policy.state_width();
    let mut state = vec![0f32; n * state_width];
    'outer: while !service.shutdown.is_triggered() {
        let step_started = Instant::now();
        if let (Some(v), Some(latest)) = (
            normalizer.as_mut(),
            follower.as_ref().and_then(StatsFollower::latest),
        ) {
            if synced_version.is_none_or(|s| latest.version > s) {
                if let Some(global) = &latest.normalizer {
                    v.sync(&global.obs_rms, &global.ret_rms).map_err(|e| {
                        ServiceError::other(format!(
                            "normalize: statistics of version {}: {e}",
                            latest.version
                        ))
                    })?;
                }
                synced_version = Some(latest.version);
            }
        }
        if let (0, Some(p)) = (fragment.steps, pacer.as_mut()) {
            let paced = Instant::now();
            let in_flight = match &inserts.pending {
                Some(insert) if !insert.is_finished() => pending_steps,
                _ => 0,
            };
            let held = inserts.buffered.load(std::sync::atomic::Ordering::Relaxed) + in_flight;
            match p.before_fragment(held, last_version, &shutdown).await {
                None => break 'outer,
                // The learner took what the last ack counted; the next ack
                // says what is held now.
                Some(true) => inserts
                    .buffered
                    .store(0, std::sync::atomic::Ordering::Relaxed),
                Some(false) => {}
            }
            metrics
                .pace_wait_seconds
                .inc_by(paced.elapsed().as_secs_f64());
        }
        let Some(reply) = act_until_answered(
            &service,
            &metrics,
            &act_subject,
            ActRows {
                obs: &obs,
                masks: masks.as_deref(),
                n,
                obs_dim,
                pixels,
                version: None,
                state: (state_width > 0).then_some(&state[..]),
            },
            &spec.action_space,
        )
        .await
        else {
            break 'outer;
        };
        if pacer
            .as_mut()
            .is_some_and(|p| p.ask_again(reply.policy_version))
        {
            tokio::select! {
                _ = tokio::time::sleep(pace::RETRY_ACT_AFTER) => continue,
                _ = shutdown.wait() => break 'outer,
            }
        }
        last_version = reply.policy_version;
        let logprobs = reply.logprobs.to_f32().expect("checked by decode");
        let values = reply.values.to_f32().expect("checked by decode");
        let (actions_i64, actions_f32) = match action_dim {
            None => (reply.actions.to_i64().expect("checked above"), Vec::new()),
            Some(_) => (Vec::new(), reply.actions.to_f32().expect("checked above")),
        };
        fragment.min_version = fragment.min_version.min(reply.policy_version);
        fragment.push_obs(&obs, masks.as_deref(), &state);
        fragment.logprobs.extend_from_slice(&logprobs);
        fragment.values.extend_from_slice(&values);
        fragment.actions_i64.extend_from_slice(&actions_i64);
        fragment.actions_f32.extend_from_slice(&actions_f32);
        if let Some(next) = &reply.state {
            state = next.to_f32().expect("checked by check_reply");
        }
        let step = match action_dim {
            None => envs.step(VecActions::Discrete(&actions_i64)),
            Some(dim) => {
                // The policy samples unbounded Gaussian actions; the env gets them clipped.
                for (i, (c, a)) in clipped.iter_mut().zip(&actions_f32).enumerate() {
                    *c = a.clamp(low[i % dim], high[i % dim]);
                }
                envs.step(VecActions::Continuous(&clipped))
            }
        };
        let step = match step {
            Ok(step) => step,
            Err(BridgeError::Faulted { faults }) => {
                // Faulted envs were reset: their episodes and this step's
                // transitions (the whole fragment in progress) are dropped.
                metrics.count_faults(spec.id, &faults);
                for &i in faults.iter().flat_map(|f| &f.envs) {
                    episode_started[i] = Instant::now();
                    state[i * state_width..(i + 1) * state_width].fill(0.0);
                }
                fragment.reset();
                obs.copy_from_slice(envs.obs());
                masks = envs.masks().map(<[u8]>::to_vec);
                if let Some(v) = &normalizer {
                    v.normalize_obs(&mut obs);
                }
                continue;
            }
            // Stopping: the wait on the workers was cut short.
            Err(BridgeError::Cancelled { .. }) => break 'outer,
            Err(e) => return Err(ServiceError::other(format!("{}: {e}", spec.id))),
        };
        let raw_rewards: Vec<f32> = step.rewards.iter().map(|&r| r as f32).collect();
        let mut next_obs = step.obs.to_vec();
        let mut scaled = Vec::new();
        if let Some(v) = normalizer.as_mut() {
            // SB3's VecNormalize.step_wait: statistics from the new (auto-reset)
            // observations and returns, then normalise; returns reset on any end.
            let dones: Vec<bool> = (0..n)
                .map(|i| step.terminated[i] || step.truncated[i])
                .collect();
            scaled.clone_from(&raw_rewards);
            v.step(&mut next_obs, &mut scaled, &dones)
                .map_err(|e| ServiceError::other(format!("normalize: {} step: {e}", spec.id)))?;
        }
        let norm_rewards = normalizer.as_ref().is_some_and(|v| v.config.norm_reward);
        if norm_rewards {
            fragment.norm_rewards.extend_from_slice(&scaled);
        }
        fragment.rewards.extend_from_slice(&raw_rewards);
        fragment.terminated.extend_from_slice(&step.terminated);
        fragment.truncated.extend_from_slice(&step.truncated);
        for i in (0..n).filter(|&i| step.truncated[i] && !step.terminated[i]) {
            let mut row = step.final_obs(i).expect("episode ended").to_vec();
            // The final observation is normalised without a statistics update (SB3's terminal_observation).
            if let Some(v) = &normalizer {
                v.normalize_obs(&mut row);
            }
            fragment.push_final_obs(i, &row, step.final_mask(i));
        }
        for e in &step.finished {
            // The next step starts an episode: from a zero state.
            state[e.env_index * state_width..(e.env_index + 1) * state_width].fill(0.0);
            let started = std::mem::replace(&mut episode_started[e.env_index], Instant::now());
            metrics
                .episode_seconds
                .observe(started.elapsed().as_secs_f64());
        }
        let finished = episode_summaries(&step.finished, &spec.team);
        metrics.episodes.inc_by(finished.len() as u64);
        for e in finished {
            if recent_returns.len() == 100 {
                recent_returns.pop_front();
            }
            recent_returns.push_back(e.episode_return);
            episodes.push(e);
        }
        obs.copy_from_slice(&next_obs);
        if let (Some(m), Some(next)) = (masks.as_mut(), step.masks()) {
            m.copy_from_slice(next);
        }
        fragment.steps += 1;
        metrics.vec_steps.inc();
        metrics.env_steps.inc_by(n as u64);
        metrics
            .step_seconds
            .observe(step_started.elapsed().as_secs_f64());

        if fragment.steps == cfg.env_runner.fragment_steps {
            // The statistics gathered since the last fragment go with it.
            let delta = normalizer
                .as_mut()
                .and_then(|v| v.take_delta())
                .map(|d| relay_policy::delta_stats(&d));
            let finished = fragment.finish(
                &service.instance,
                spec.id,
                action_dim,
                &obs,
                masks.as_deref(),
                norm_rewards,
                delta,
            );
            pending_steps = finished.env_steps();
            inserts
                .ship(
                    &service,
                    &metrics,
                    finished,
                    spec.id,
                    last_version,
                    &mut episodes,
                )
                .await;
        }

        if reported.at.elapsed() >= Duration::from_secs(1) {
            report_progress(
                &service,
                &metrics,
                &mut reported,
                last_version,
                &recent_returns,
            )
            .await;
        }
    }
    // The steps since the last report, so a run shorter than a report
    // period (or its last second) is not lost.
    report_progress(
        &service,
        &metrics,
        &mut reported,
        last_version,
        &recent_returns,
    )
    .await;
    inserts.finish().await;
    service.finish().await
}

/// The inserts of a runner's fragments: at most one in flight while the
/// next fragment is collected.
#[derive(Default)]
pub(crate) struct Inserts {
    /// The insert in flight.
    pending: Option<tokio::task::JoinHandle<()>>,
    /// Fragments refused as bad in a row.
    rejected_in_a_row: std::sync::Arc<std::sync::atomic::AtomicU32>,
    /// Env steps the replay buffer held at the last ack.
    buffered: std::sync::Arc<std::sync::atomic::AtomicU64>,
}

impl Inserts {
    /// Ships one collection period: waits for the insert in flight (the
    /// backpressure), starts inserting `fragment`, and publishes the
    /// `episodes` finished since the last period.
    pub(crate) async fn ship(
        &mut self,
        service: &Service,
        metrics: &Metrics,
        fragment: RolloutFragment,
        env_id: &str,
        policy_version: u64,
        episodes: &mut Vec<EpisodeSummary>,
    ) {
        if let Some(previous) = self.pending.take() {
            let _ = previous.await;
        }
        self.pending = Some(tokio::spawn(insert_all_with_retry(
            service.clone(),
            fragment,
            metrics.fragments.clone(),
            metrics.backpressure_waits.clone(),
            self.rejected_in_a_row.clone(),
            self.buffered.clone(),
        )));
        if !episodes.is_empty() {
            let report = EpisodeReport {
                schema: SCHEMA_VERSION,
                runner_id: service.instance.clone(),
                env_id: env_id.to_string(),
                policy_version,
                episodes: std::mem::take(episodes),
            };
            // Logged when it cannot be sent; the episodes are only reported.
            let _ = service
                .publish_within(service.subjects.episodes(), report)
                .await;
        }
    }

    /// Waits a little for the insert in flight, at shutdown: half the
    /// service's 2 s promise. The replay-buffer is stopped beside it, so an
    /// insert not answered by then (its request left waiting on a buffer
    /// that exited, or retrying one that is full) would not be.
    pub(crate) async fn finish(&mut self) {
        if let Some(previous) = self.pending.take() {
            let _ = tokio::time::timeout(Duration::from_secs(1), previous).await;
        }
    }
}

/// Observations to act on: `n` rows of `obs_dim` values (uint8 pixels
/// when `pixels`), with their legal actions `masks`.
#[derive(Clone, Copy)]
pub(crate) struct ActRows<'a> {
    pub obs: &'a [f32],
    pub masks: Option<&'a [u8]>,
    pub n: usize,
    pub obs_dim: usize,
    pub pixels: bool,
    /// A past version to act with (a league opponent); `None`: the newest.
    pub version: Option<u64>,
    /// Recurrent policies: each row's state, `n` rows of equal width.
    pub state: Option<&'a [f32]>,
}

/// Asks for actions for `rows` ([`act`]), retrying while no inference
/// server (or no weights) is there and rejecting bad replies; `None` once
/// the service stops (or fails: a request can never fit a message). Rows
/// for a past version that no server holds (404) are acted by the newest
/// version instead, which the reply's `policy_version` shows.
pub(crate) async fn act_until_answered(
    service: &Service,
    metrics: &Metrics,
    subject: &str,
    mut rows: ActRows<'_>,
    space: &ActionSpace,
) -> Option<ActReply> {
    let timeout = service.request_timeout();
    let mut backoff = Duration::from_millis(10);
    loop {
        let sent = Instant::now();
        match act(service, subject, rows, timeout).await {
            Err(RequestError::Service { code, .. }) if code == "404" && rows.version.is_some() => {
                rows.version = None;
                continue;
            }
            Ok(reply) => match check_reply(&reply, rows.n, space, rows.masks, rows.state) {
                Ok(()) => {
                    metrics.act_latency.observe(sent.elapsed().as_secs_f64());
                    return Some(reply);
                }
                Err(detail) => service.intake.reject(
                    "act.reply",
                    &relay_proto::Rejection::Invalid {
                        kind: "ActReply",
                        field: "actions",
                        detail,
                    },
                ),
            },
            Err(RequestError::BadReply { source, .. }) => {
                service.intake.reject("act.reply", &source)
            }
            // A request, or the reply to one row, that no message carries.
            Err(e) if e.is_too_large() => {
                service.fail(format!("cannot ask for actions: {e}")).await;
                return None;
            }
            Err(e) => tracing::debug!(error = %e, "act request failed; retrying"),
        }
        tokio::select! {
            _ = tokio::time::sleep(backoff) => {}
            _ = service.shutdown.wait() => return None,
        }
        backoff = (backoff * 2).min(Duration::from_secs(1));
    }
}

/// Actions for `rows`: one act request, divided into as many as it takes
/// to fit NATS messages (`relay_kit::fit`), answered as one reply acted by
/// the oldest version among them.
async fn act(
    service: &Service,
    subject: &str,
    rows: ActRows<'_>,
    timeout: Duration,
) -> Result<ActReply, RequestError> {
    let ActRows {
        obs,
        masks,
        n,
        obs_dim,
        pixels,
        version,
        state,
    } = rows;
    let request = ActRequest::new(Tensor::observations(&[n, obs_dim], obs, pixels), false)
        .with_masks(masks.map(|m| Tensor::from_u8(&[n, m.len() / n], m)))
        .with_state(state.map(|s| Tensor::from_f32(&[n, s.len() / n], s)))
        .at_version(version);
    relay_kit::request_within(&service.nats, subject, request, timeout).await
}

/// The counters as of the last metrics report.
pub(crate) struct Reported {
    at: Instant,
    env_steps: u64,
    vec_steps: u64,
}

/// Reports the steps since `reported` (then moves it to now), the step
/// rate, the policy version last acted with and the mean return of the
/// recent episodes.
pub(crate) async fn report_progress(
    service: &Service,
    metrics: &Metrics,
    reported: &mut Reported,
    policy_version: u64,
    recent_returns: &VecDeque<f64>,
) {
    let (env_steps, vec_steps) = (metrics.env_steps.get(), metrics.vec_steps.get());
    let sps = (env_steps - reported.env_steps) as f64 / reported.at.elapsed().as_secs_f64();
    let mut values = vec![
        counter("env_steps_total", (env_steps - reported.env_steps) as f64),
        counter("vec_steps_total", (vec_steps - reported.vec_steps) as f64),
        gauge("env_runner_sps", sps),
        gauge("env_runner_policy_version", policy_version as f64),
    ];
    if !recent_returns.is_empty() {
        values.push(gauge(
            "env_runner_episode_return_mean",
            recent_returns.iter().sum::<f64>() / recent_returns.len() as f64,
        ));
    }
    service.report(Some(vec_steps), values).await;
    *reported = Reported {
        at: Instant::now(),
        env_steps,
        vec_steps,
    };
}

/// Longest wait between two inserts the rate limiter refused. When a
/// refused fragment fits, the table still holds the limiter's slack less
/// one fragment for the learner, far more than this at the presets' rates.
const RATE_WAIT_CAP: Duration = Duration::from_millis(16);

/// Fragments in a row the replay buffer refused as bad, after which the
/// env-runner fails: what it sends cannot be stored.
const REJECTED_FRAGMENTS_TO_FAIL: u32 = 3;

/// Sends the fragment of one collection period, divided into parts that
/// fit NATS messages (`relay_proto::fit`), in turn ([`insert_with_retry`]);
/// fails the service once [`REJECTED_FRAGMENTS_TO_FAIL`] in a row were
/// refused as bad, or at once when one env step alone does not fit.
async fn insert_all_with_retry(
    service: Service,
    fragment: RolloutFragment,
    outcomes: IntCounterVec,
    waits: IntCounter,
    rejected_in_a_row: std::sync::Arc<std::sync::atomic::AtomicU32>,
    buffered: std::sync::Arc<std::sync::atomic::AtomicU64>,
) {
    use std::sync::atomic::Ordering;
    let parts = match relay_proto::encode_within(fragment, service.max_message_bytes()) {
        Ok(parts) => parts,
        Err(e) => {
            outcomes.with_label_values(&["rejected"]).inc();
            service
                .fail(format!("a rollout fragment cannot be sent: {e}"))
                .await;
            return;
        }
    };
    for part in parts {
        match insert_with_retry(&service, part, &outcomes, &waits, &buffered).await {
            Err(reason) => {
                if rejected_in_a_row.fetch_add(1, Ordering::Relaxed) + 1
                    >= REJECTED_FRAGMENTS_TO_FAIL
                {
                    service
                        .fail(format!(
                            "{REJECTED_FRAGMENTS_TO_FAIL} fragments in a row could not be stored; the last: {reason}"
                        ))
                        .await;
                }
            }
            Ok(()) => rejected_in_a_row.store(0, Ordering::Relaxed),
        }
    }
}

/// Sends a fragment (encoded to fit a message) to the replay buffer,
/// retrying while it is full or absent; an error says why the fragment can
/// never be stored (the buffer rejected it as bad).
async fn insert_with_retry(
    service: &Service,
    fragment: relay_proto::Part<RolloutFragment>,
    outcomes: &IntCounterVec,
    waits: &IntCounter,
    buffered: &std::sync::atomic::AtomicU64,
) -> Result<(), String> {
    let subject = service.subjects.replay_insert();
    let timeout = service.request_timeout();
    let payload = bytes::Bytes::from(fragment.bytes);
    let mut backoff = Duration::from_millis(5);
    let mut rate_refusals = 0u32;
    loop {
        let acked = relay_kit::connect::request_encoded::<InsertAck>(
            &service.nats,
            &subject,
            payload.clone(),
            timeout,
        )
        .await
        .inspect(|ack| buffered.store(ack.buffered_steps, std::sync::atomic::Ordering::Relaxed));
        match acked {
            Ok(ack) if ack.accepted => {
                outcomes.with_label_values(&["stored"]).inc();
                return Ok(());
            }
            // Backpressure: the buffer is full or the rate limiter holds inserts back.
            Ok(ack) if ack.reason == "full" || ack.reason == "rate" => {
                waits.inc();
                backoff = Duration::from_millis(ack.retry_after_ms.max(1) as u64);
                if ack.reason == "rate" {
                    // The insert fits once the learner has sampled enough,
                    // which takes longer the further ahead this runner is:
                    // the wait doubles with each refusal in a row (up to a
                    // cap), so a runner held back asks a few times, not
                    // every millisecond, each time with its whole fragment.
                    backoff =
                        (backoff * 2u32.pow(rate_refusals.min(8))).min(RATE_WAIT_CAP.max(backoff));
                    rate_refusals += 1;
                }
            }
            Ok(ack) => {
                tracing::debug!(reason = %ack.reason, version = fragment.message.policy_version, "fragment dropped by the replay buffer");
                outcomes
                    .with_label_values(&[if ack.reason == "stale" {
                        "stale"
                    } else {
                        "refused"
                    }])
                    .inc();
                return Ok(());
            }
            Err(RequestError::Service { code, status, .. }) if code == "400" => {
                // The fragment itself is bad: retrying cannot help.
                tracing::warn!(%status, "replay buffer rejected a fragment");
                outcomes.with_label_values(&["rejected"]).inc();
                return Err(format!("the replay buffer rejected it: {status}"));
            }
            Err(e) => {
                tracing::debug!(error = %e, "insert failed; retrying");
                backoff = (backoff * 2).min(Duration::from_secs(1));
            }
        }
        if service.shutdown.is_triggered() {
            return Ok(());
        }
        tokio::time::sleep(backoff).await;
    }
}
