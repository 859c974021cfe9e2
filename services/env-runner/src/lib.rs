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

mod act;
mod exploration;
mod fragment;
mod insert;
pub mod league;
mod metrics;
mod pace;
mod selfplay;
mod text;

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use relay_bridge::{BridgeError, VecEnvs};
use relay_envs::{ActionSpace, VecActions};
use relay_kit::{Service, ServiceConfig, ServiceError, Shutdown};
use relay_nn::VecNormalize;
use relay_policy::StatsFollower;
use relay_proto::{AgentReturn, EpisodeSummary};

use fragment::FragmentBuilder;

pub(crate) use act::{act_until_answered, ActRows};
pub(crate) use insert::Inserts;
pub(crate) use metrics::{report_progress, Metrics, Reported, REPORT_EVERY};

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
    let mut exploration = exploration::ExplorationSeeds::new(
        &cfg.policy,
        n,
        runner_seed(cfg.run.seed, &service.instance) ^ 0x5DE,
    );
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
                noise_seeds: exploration.as_mut().map(|e| e.for_step(fragment.steps)),
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
            while !inserts.settled_within(REPORT_EVERY).await {
                report_progress(
                    &service,
                    &metrics,
                    &mut reported,
                    last_version,
                    &recent_returns,
                )
                .await;
            }
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

        if reported.at.elapsed() >= REPORT_EVERY {
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
