//! DQN (`run.algo: dqn`): a Q-network trained off-policy on the
//! replay-buffer's transition table, read top to bottom in [`run`].
//!
//! What it does, with SB3's `DQN` as the reference:
//!
//! 1. The env-runners act through the inference servers, which act
//!    epsilon-greedily with the published Q-network and
//!    `dqn.exploration_rate` at the version's env steps; their fragments
//!    become n-step transitions in the replay-buffer's off-policy table
//!    (returns computed at insert; see `relay_replay_buffer::offpolicy`).
//! 2. A training round is due every `train_freq` env steps inserted (all
//!    env-runners together), from the first multiple of `train_freq`
//!    above `learning_starts` (SB3 trains once `num_timesteps >
//!    learning_starts`, at the end of each `train_freq` collection).
//! 3. Before a round, the target network is updated once per multiple of
//!    `target_update_interval` env steps passed since the last round
//!    (`tau` 1 copies; below 1 a Polyak step), which is what SB3's
//!    per-env-step `_on_step` amounts to, since no gradient step happens
//!    between rounds.
//! 4. A round is `gradient_steps` steps: sample `batch_size` transitions
//!    (prioritized: with importance weights at the scheduled β), the TD
//!    loss with (double) DQN targets `R + γ^k Q_target(s', a*)` (0 after a
//!    termination, bootstrapped through a time-limit truncation), Huber,
//!    weighted by the importance weights, a clipped Adam step, and the new
//!    priorities `|δ| + prioritized_eps` sent back.
//! 5. After each round: publish weights version + 1 (with the env steps
//!    it was trained on, which set the inference servers' epsilon),
//!    report metrics, checkpoint every `checkpoint_every` rounds (also at
//!    the first eval, each new best eval, and at the end).
//!
//! Checkpoints hold the online network (`model.safetensors`), the target
//! network (`target.safetensors`), Adam's state (`optimizer.safetensors`),
//! the counters and RNG (`state.json`) and the round bookkeeping
//! (`dqn.json`).

use std::path::Path;
use std::time::{Duration, Instant};

use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use relay_kit::config::DqnConfig;
use relay_kit::{gauge, ExperimentConfig, Service, ServiceError, Shutdown};
use relay_nn::{
    clip_grad_norm, dqn_loss, Adam, AdamConfig, DqnBatch, DqnLossConfig, DqnStats, QNetwork,
};
use relay_proto::{PriorityAck, PriorityUpdate, Tensor, TransitionBatch, SCHEMA_VERSION};
use serde::{Deserialize, Serialize};

use crate::checkpoint::{self, CheckpointError, CheckpointState};
use crate::{
    pause, sample_transitions, take_evals, take_solved, Finish, LatestWeights, Metrics, Progress,
};

/// The checkpoint file of [`DqnState`].
const STATE_FILE: &str = "dqn.json";

/// Round bookkeeping a checkpoint carries beside [`Progress`] (`dqn.json`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct DqnState {
    /// Training rounds done.
    pub rounds: u64,
    /// Env steps at the last target update check.
    pub target_checked_at: u64,
    /// Target network updates made.
    pub target_updates: u64,
}

/// Env steps at which round `rounds` (0-based) is due: the first multiple
/// of `train_freq` above `learning_starts`, then every `train_freq`.
pub fn round_due_at(cfg: &DqnConfig, rounds: u64) -> u64 {
    (cfg.learning_starts / cfg.train_freq + 1 + rounds) * cfg.train_freq
}

/// Target updates owed when env steps go from `from` to `to`: one per
/// multiple of `target_update_interval` passed.
pub fn target_updates_between(cfg: &DqnConfig, from: u64, to: u64) -> u64 {
    (to / cfg.target_update_interval).saturating_sub(from / cfg.target_update_interval)
}

/// Statistics of one training round (means over its gradient steps).
#[derive(Debug, Clone, Copy, Default)]
pub struct RoundStats {
    pub loss: f64,
    pub q_mean: f64,
    pub target_mean: f64,
    pub td_abs: f64,
    pub grad_norm: f64,
    pub steps: u64,
}

impl RoundStats {
    fn add(&mut self, s: &DqnStats, grad_norm: f32) {
        self.loss += s.loss as f64;
        self.q_mean += s.q_mean as f64;
        self.target_mean += s.target_mean as f64;
        self.td_abs += s.td_abs_mean as f64;
        self.grad_norm += grad_norm as f64;
        self.steps += 1;
    }

    fn mean(mut self) -> Self {
        let n = self.steps.max(1) as f64;
        self.loss /= n;
        self.q_mean /= n;
        self.target_mean /= n;
        self.td_abs /= n;
        self.grad_norm /= n;
        self
    }
}

/// Errors of one gradient step on a sampled batch.
#[derive(Debug, thiserror::Error)]
pub enum StepError {
    #[error("batch field {field}: {detail}")]
    Batch { field: &'static str, detail: String },
    #[error(transparent)]
    Nn(#[from] relay_nn::NnError),
}

/// One gradient step on a sampled batch: the DQN loss, a clipped Adam
/// step. Returns the loss statistics, the gradient norm before clipping
/// and the new priorities `|δ| + eps`.
pub fn gradient_step(
    cfg: &DqnConfig,
    online: &QNetwork,
    target: &QNetwork,
    optimizer: &mut Adam,
    batch: &TransitionBatch,
) -> Result<(DqnStats, f32, Vec<f32>), StepError> {
    let field = |field: &'static str, e: relay_proto::TensorError| StepError::Batch {
        field,
        detail: e.to_string(),
    };
    let obs = batch.obs.to_f32().map_err(|e| field("obs", e))?;
    let next_obs = batch.next_obs.to_f32().map_err(|e| field("next_obs", e))?;
    let actions: Vec<u32> = batch
        .actions
        .to_i64()
        .map_err(|e| field("actions", e))?
        .into_iter()
        .map(|a| u32::try_from(a).unwrap_or(u32::MAX))
        .collect();
    let returns = batch.rewards.to_f32().map_err(|e| field("rewards", e))?;
    let discounts = batch
        .discounts
        .to_f32()
        .map_err(|e| field("discounts", e))?;
    let weights = batch.weights.to_f32().map_err(|e| field("weights", e))?;
    let loss_cfg = DqnLossConfig {
        double_q: cfg.double_q,
        huber_delta: cfg.huber_delta as f32,
    };
    let out = dqn_loss(
        &loss_cfg,
        online,
        target,
        &DqnBatch {
            obs: &obs,
            actions: &actions,
            returns: &returns,
            next_obs: &next_obs,
            discounts: &discounts,
            weights: Some(&weights),
        },
    )?;
    let mut grads = out.loss.backward().map_err(relay_nn::NnError::from)?;
    let norm = clip_grad_norm(&mut grads, optimizer.vars(), cfg.max_grad_norm as f32)?;
    optimizer.step(&grads)?;
    let priorities = out
        .td_errors
        .iter()
        .map(|d| d.abs() + cfg.prioritized_eps as f32)
        .collect();
    Ok((out.stats, norm, priorities))
}

/// Runs the DQN learner until shutdown.
pub(crate) async fn run(
    service: Service,
    shutdown: Shutdown,
    metrics: Metrics,
) -> Result<(), ServiceError> {
    let cfg: ExperimentConfig = (*service.config).clone();
    let d = cfg.dqn.clone();
    let spec = relay_policy::qnet_spec_for(&cfg).map_err(ServiceError::other)?;
    let mut online = QNetwork::new(&spec, cfg.run.seed).map_err(ServiceError::other)?;
    let mut target = online.duplicate().map_err(ServiceError::other)?;
    let mut optimizer = Adam::new(
        online.vars(),
        AdamConfig {
            lr: d.learning_rate.value(0.0),
            eps: d.adam_eps,
            ..AdamConfig::default()
        },
    )
    .map_err(ServiceError::other)?;
    let mut rng = ChaCha8Rng::seed_from_u64(cfg.run.seed.wrapping_add(0x5eed));
    let run_dir = cfg.run.runs_dir.join(cfg.run_id()?);
    let mut progress = Progress::default();
    let mut state = DqnState::default();
    let mut best_eval: Option<(f64, u64)> = None;
    let mut resumed_at_vec_steps = 0u64;
    let start_from = checkpoint::StartFrom::of(&cfg);
    if let Some(from) = &start_from {
        let dir = &from.dir;
        online
            .load(dir.join("model.safetensors"))
            .map_err(|e| from.error(e))?;
        let target_path = dir.join("target.safetensors");
        if from.resume && target_path.exists() {
            target.load(&target_path).map_err(|e| from.error(e))?;
        } else {
            target.copy_from(&online).map_err(|e| from.error(e))?;
        }
        if !cfg.run.reset_optimizer {
            optimizer
                .load(dir.join("optimizer.safetensors"))
                .map_err(|e| from.error(e))?;
        }
        if from.resume {
            checkpoint::Restored {
                progress,
                rng,
                best_eval,
            } = checkpoint::restore(dir, &run_dir, rng).map_err(|e| from.error(e))?;
            resumed_at_vec_steps = progress.vec_steps;
            state = checkpoint::read_json(&dir.join(STATE_FILE)).map_err(|e| from.error(e))?;
        }
        tracing::info!(from = %dir.display(), resume = from.resume, version = progress.version, rounds = state.rounds, env_steps = progress.env_steps, "loaded checkpoint");
    }
    crate::count_resume(&service, &start_from);

    let micro = service.micro().await?;
    let latest = LatestWeights::serve(&service, &micro, &run_dir).await?;
    let weights = |net: &QNetwork, progress: &Progress| {
        relay_policy::tensors_to_weights(&net.named_tensors(), progress.version, progress.env_steps)
    };
    let (mut statuses, mut evals) = crate::subscribe_run_events(&service).await?;
    latest.publish(&service, &weights(&online, &progress)).await;
    metrics.version.set(progress.version as i64);
    service.health.set_ready(true);
    tracing::info!(env_id = %cfg.run.env_id, algo = "dqn", params = online.num_parameters(), prioritized = d.prioritized, double_q = d.double_q, n_steps = d.n_steps, "training starts");

    let budget = cfg.run.total_env_steps;
    let num_envs = cfg.env_runner.num_envs.max(1) as u64;
    // The table counts env steps since the run began; a resumed learner
    // continues from its checkpoint's count.
    let mut table_base: Option<(u64, u64)> = None;
    let mut solved: Option<String> = None;
    let started = Instant::now();
    let start_env_steps = progress.env_steps;
    let mut reported_vec_steps = progress.vec_steps;
    let finish = loop {
        if let Some(finish) = crate::should_finish(
            &shutdown,
            progress.env_steps,
            budget,
            &solved,
            cfg.run.stop_when_solved,
        ) {
            break finish;
        }
        take_solved(&service, &mut statuses, &mut solved);
        if take_evals(&service, &mut evals, &mut best_eval) {
            save(
                &run_dir, &online, &target, &optimizer, &progress, &state, &rng, best_eval, &cfg,
                true,
            );
        }

        // How many env steps the table holds for us.
        let counters = match sample_transitions(&service, 0, 0.0).await {
            Ok(b) => b,
            Err(e) => {
                tracing::debug!(error = %e, "replay-buffer not answering; retrying");
                pause(&shutdown, Duration::from_millis(50)).await;
                continue;
            }
        };
        let (base_inserted, base_steps) =
            *table_base.get_or_insert((counters.inserted_steps, progress.env_steps));
        progress.env_steps = base_steps + counters.inserted_steps.saturating_sub(base_inserted);
        progress.vec_steps = progress.env_steps / num_envs;
        let due_at = round_due_at(&d, state.rounds);
        if progress.env_steps < due_at {
            pause(&shutdown, Duration::from_millis(1)).await;
            continue;
        }

        // A training round, as of env step `due_at`.
        let round_started = Instant::now();
        let frac = (due_at as f64 / budget as f64).min(1.0);
        optimizer.set_lr(d.learning_rate.value(frac));
        let beta = if d.prioritized {
            d.prioritized_beta.value(frac)
        } else {
            1.0
        };
        let owed = target_updates_between(&d, state.target_checked_at, due_at);
        for _ in 0..owed.min(if d.tau >= 1.0 { 1 } else { u64::MAX }) {
            target
                .soft_update(&online, d.tau as f32)
                .map_err(ServiceError::other)?;
            state.target_updates += 1;
        }
        state.target_checked_at = due_at;
        let mut stats = RoundStats::default();
        let mut rejected = 0u64;
        let mut stale_priorities = 0u64;
        let mut step = 0;
        while step < d.gradient_steps && !shutdown.is_triggered() {
            let batch = match sample_transitions(&service, d.batch_size as u32, beta).await {
                Ok(b) if b.ids.len() == d.batch_size => b,
                Ok(_) => {
                    // Held back by the rate limiter (or nothing held yet).
                    pause(&shutdown, Duration::from_millis(1)).await;
                    continue;
                }
                Err(e) => {
                    tracing::debug!(error = %e, "sample failed; retrying");
                    pause(&shutdown, Duration::from_millis(20)).await;
                    continue;
                }
            };
            step += 1;
            let result = tokio::task::block_in_place(|| {
                gradient_step(&d, &online, &target, &mut optimizer, &batch)
            });
            let (loss_stats, norm, priorities) = match result {
                Ok(r) => r,
                Err(e) => {
                    // Bad data must not stop training: skip this batch.
                    tracing::error!(error = %e, "gradient step failed; batch skipped");
                    rejected += 1;
                    continue;
                }
            };
            stats.add(&loss_stats, norm);
            if d.prioritized {
                let update = PriorityUpdate {
                    schema: SCHEMA_VERSION,
                    ids: batch.ids.clone(),
                    priorities: Tensor::from_f32(&[priorities.len()], &priorities),
                };
                match relay_kit::request::<_, PriorityAck>(
                    &service.nats,
                    &service.subjects.replay_priorities(),
                    &update,
                    service.request_timeout(),
                )
                .await
                {
                    Ok(ack) => stale_priorities += ack.evicted as u64,
                    Err(e) => tracing::warn!(error = %e, "priority update lost"),
                }
            }
        }
        if shutdown.is_triggered() {
            break Finish::Shutdown;
        }
        state.rounds += 1;
        progress.updates += 1;
        progress.version += 1;
        latest.publish(&service, &weights(&online, &progress)).await;
        metrics.version.set(progress.version as i64);
        let seconds = round_started.elapsed().as_secs_f64();
        metrics.update_seconds.observe(seconds);
        let stats = stats.mean();
        let sps = progress.env_steps.saturating_sub(start_env_steps) as f64
            / started.elapsed().as_secs_f64().max(1e-3);
        let mut values = progress.report_gauges(budget, sps, resumed_at_vec_steps);
        values.extend([
            gauge(
                "learner_rollout_vec_steps",
                (progress.vec_steps - reported_vec_steps) as f64,
            ),
            gauge("learner_last_update_seconds", seconds),
            gauge("learner_dqn_loss", stats.loss),
            gauge("learner_q_mean", stats.q_mean),
            gauge("learner_td_error_abs", stats.td_abs),
            gauge("learner_grad_norm", stats.grad_norm),
            gauge("learner_learning_rate", d.learning_rate.value(frac)),
            gauge("learner_epsilon", d.exploration_rate(frac)),
            gauge("learner_per_beta", beta),
            gauge("learner_replay_size", counters.size as f64),
            gauge("learner_target_updates", state.target_updates as f64),
            gauge("learner_stale_priorities", stale_priorities as f64),
            gauge("learner_rejected_batches", rejected as f64),
        ]);
        reported_vec_steps = progress.vec_steps;
        service.report(Some(progress.vec_steps), values).await;
        if progress.updates % cfg.checkpoint_every() == 0 {
            save(
                &run_dir, &online, &target, &optimizer, &progress, &state, &rng, best_eval, &cfg,
                false,
            );
        }
    };

    save(
        &run_dir, &online, &target, &optimizer, &progress, &state, &rng, best_eval, &cfg, false,
    );
    crate::finish_run(
        &service,
        &shutdown,
        micro,
        &finish,
        format!("{budget} env steps"),
        progress.version,
        progress.env_steps,
    )
    .await;
    Ok(())
}

#[allow(clippy::too_many_arguments)]
fn save(
    run_dir: &Path,
    online: &QNetwork,
    target: &QNetwork,
    optimizer: &Adam,
    progress: &Progress,
    state: &DqnState,
    rng: &ChaCha8Rng,
    best_eval: Option<(f64, u64)>,
    cfg: &ExperimentConfig,
    best: bool,
) {
    let counters = CheckpointState::of(progress, rng, best_eval);
    let tensors = |e: relay_nn::NnError| CheckpointError::Tensors(e.to_string());
    let written = checkpoint::write(
        run_dir,
        progress.updates,
        cfg,
        cfg.keep_checkpoints(),
        best,
        |tmp| {
            online
                .save(tmp.join("model.safetensors"))
                .map_err(tensors)?;
            target
                .save(tmp.join("target.safetensors"))
                .map_err(tensors)?;
            optimizer
                .save(tmp.join("optimizer.safetensors"))
                .map_err(tensors)?;
            checkpoint::write_json(&tmp.join("state.json"), &counters)?;
            checkpoint::write_json(&tmp.join(STATE_FILE), state)
        },
    );
    checkpoint::log_written(written, progress.version, best);
}

#[cfg(test)]
mod tests {
    use super::*;
    use relay_nn::QNetSpec;

    #[test]
    fn rounds_and_target_updates_follow_sb3() {
        // rl-zoo CartPole: learning_starts 1000, train_freq 256.
        let d = DqnConfig {
            learning_starts: 1000,
            train_freq: 256,
            target_update_interval: 10,
            ..DqnConfig::default()
        };
        assert_eq!(round_due_at(&d, 0), 1024);
        assert_eq!(round_due_at(&d, 1), 1280);
        // learning_starts on a multiple: SB3 trains once num_timesteps > it.
        let on = DqnConfig {
            learning_starts: 1024,
            ..d.clone()
        };
        assert_eq!(round_due_at(&on, 0), 1280);
        assert_eq!(target_updates_between(&d, 1024, 1280), 26);
        assert_eq!(target_updates_between(&d, 0, 9), 0);
        let mc = DqnConfig {
            target_update_interval: 600,
            ..d
        };
        assert_eq!(target_updates_between(&mc, 1190, 1206), 1);
        assert_eq!(target_updates_between(&mc, 1206, 1222), 0);
    }

    fn batch(
        obs: &[f32],
        actions: &[i64],
        rewards: &[f32],
        next: &[f32],
        disc: &[f32],
    ) -> TransitionBatch {
        let b = actions.len();
        let d = obs.len() / b;
        TransitionBatch {
            schema: SCHEMA_VERSION,
            ids: (0..b as u64).collect(),
            obs: Tensor::from_f32(&[b, d], obs),
            actions: Tensor::from_i64(&[b], actions),
            rewards: Tensor::from_f32(&[b], rewards),
            next_obs: Tensor::from_f32(&[b, d], next),
            discounts: Tensor::from_f32(&[b], disc),
            terminated: Tensor::from_bool(&[b], &vec![false; b]),
            truncated: Tensor::from_bool(&[b], &vec![false; b]),
            weights: Tensor::from_f32(&[b], &vec![1.0; b]),
            size: b as u64,
            inserted_steps: b as u64,
        }
    }

    #[test]
    fn gradient_steps_fit_a_fixed_target_and_return_priorities() {
        // One state, two actions: rewards 1 for action 0 and 0 for action
        // 1, terminal (discount 0): Q(s, 0) -> 1, Q(s, 1) -> 0.
        let spec = QNetSpec {
            hidden: vec![16],
            ..QNetSpec::new(2, 2)
        };
        let online = QNetwork::new(&spec, 3).unwrap();
        let target = online.duplicate().unwrap();
        let d = DqnConfig {
            max_grad_norm: 10.0,
            double_q: true,
            ..DqnConfig::default()
        };
        let mut adam = Adam::new(
            online.vars(),
            AdamConfig {
                lr: 1e-2,
                ..AdamConfig::default()
            },
        )
        .unwrap();
        let b = batch(
            &[0.5, -0.5, 0.5, -0.5],
            &[0, 1],
            &[1.0, 0.0],
            &[0.0; 4],
            &[0.0, 0.0],
        );
        let (first, _, p0) = gradient_step(&d, &online, &target, &mut adam, &b).unwrap();
        assert_eq!(p0.len(), 2);
        assert!(p0.iter().all(|&p| p > 0.0));
        let mut last = first;
        for _ in 0..300 {
            last = gradient_step(&d, &online, &target, &mut adam, &b)
                .unwrap()
                .0;
        }
        assert!(last.loss < first.loss * 0.01, "{first:?} -> {last:?}");
        let q = online.q_values(&[0.5, -0.5], 1).unwrap();
        assert!((q[0] - 1.0).abs() < 0.05 && q[1].abs() < 0.05, "{q:?}");
        // A discrete action out of range is an error, not a panic.
        let bad = batch(&[0.5, -0.5], &[7], &[1.0], &[0.0; 2], &[0.0]);
        assert!(gradient_step(&d, &online, &target, &mut adam, &bad).is_err());
    }
}
