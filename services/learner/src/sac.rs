//! SAC (`run.algo: sac`): a tanh-squashed Gaussian actor and twin critics
//! trained off-policy on the replay-buffer's transition table, read top to
//! bottom in [`run`]. The maths of one gradient step is
//! [`relay_nn::sac_train_step`].
//!
//! What it does, with SB3's `SAC` as the reference:
//!
//! 1. The env-runners act through the inference servers, which sample the
//!    published actor (actions in env units); their fragments become 1-step
//!    transitions in the replay-buffer's off-policy table (actions stored
//!    in env units, `γ` for a step that did not end the episode or ended
//!    it by a time-limit truncation, 0 after a termination; see
//!    `relay_replay_buffer::offpolicy`).
//! 2. A training round is due every `train_freq` env steps inserted (all
//!    env-runners together), from the first multiple of `train_freq`
//!    above `learning_starts` (SB3 trains once `num_timesteps >
//!    learning_starts`, at the end of each `train_freq` collection).
//! 3. A round is `gradient_steps` steps at the learning rate scheduled at
//!    the round's env steps: sample `batch_size` transitions uniformly,
//!    one SAC step (α, then the critics towards `R + γ (min Q'(s', a') -
//!    α log π(a'|s'))`, then the actor), and the Polyak update of the
//!    target critics with `tau` on the round's gradient steps `i` with `i %
//!    target_update_interval == 0` (SB3's condition).
//! 4. After each round: publish the actor as weights version + 1 (the
//!    critics stay here), report metrics, checkpoint every
//!    `checkpoint_every` rounds (also at the first eval, each new best
//!    eval, and at the end).
//!
//! Checkpoints hold every network (`model.safetensors`: actor, critics,
//! target critics, `log_ent_coef`, [`relay_nn::Sac::save`]), the three Adam
//! states (`optimizer.safetensors` of the actor, `critic_optimizer.safetensors`,
//! `ent_coef_optimizer.safetensors`), the counters and RNG (`state.json`) and
//! the round bookkeeping (`sac.json`).

use std::path::Path;
use std::time::{Duration, Instant};

use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use relay_kit::config::{EntCoef, SacSection};
use relay_kit::{gauge, ExperimentConfig, Service, ServiceError, Shutdown};
use relay_nn::{sac_train_step, Sac, SacBatch, SacConfig, SacOptimizers, SacStats};
use relay_proto::TransitionBatch;
use serde::{Deserialize, Serialize};

use crate::checkpoint::{self, CheckpointError, CheckpointState};
use crate::{
    pause, sample_transitions, take_evals, take_solved, Finish, LatestWeights, Metrics, Progress,
};

/// The checkpoint file of [`SacState`].
const STATE_FILE: &str = "sac.json";

/// Round bookkeeping a checkpoint carries beside [`Progress`] (`sac.json`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct SacState {
    /// Training rounds done.
    pub rounds: u64,
    /// Gradient steps done (SB3's `_n_updates`).
    pub gradient_steps: u64,
    /// Polyak updates of the target critics made.
    pub target_updates: u64,
}

/// Env steps at which round `rounds` (0-based) is due: the first multiple
/// of `train_freq` above `learning_starts`, then every `train_freq`.
pub fn round_due_at(cfg: &SacSection, rounds: u64) -> u64 {
    (cfg.learning_starts / cfg.train_freq + 1 + rounds) * cfg.train_freq
}

/// The gradient step's settings from the `sac` section, for an actor of
/// `action_dim` dimensions at learning rate `lr`.
pub fn step_config(
    cfg: &SacSection,
    action_dim: usize,
    lr: f64,
) -> Result<SacConfig, relay_kit::config::ConfigError> {
    Ok(SacConfig {
        tau: cfg.tau as f32,
        auto_entropy: matches!(cfg.ent_coef()?, EntCoef::Auto { .. }),
        target_entropy: Some(cfg.target_entropy_for(action_dim)? as f32),
        lr,
        update_target: true,
    })
}

/// The initial entropy coefficient α (`"auto"`: 1, `"auto_<x>"`: x, fixed: itself).
pub fn initial_ent_coef(cfg: &SacSection) -> Result<f64, relay_kit::config::ConfigError> {
    Ok(match cfg.ent_coef()? {
        EntCoef::Auto { initial } => initial,
        EntCoef::Fixed(v) => v,
    })
}

/// Statistics of one training round (means over its gradient steps).
#[derive(Debug, Clone, Copy, Default)]
pub struct RoundStats {
    pub actor_loss: f64,
    pub critic_loss: f64,
    pub ent_coef_loss: f64,
    pub ent_coef: f64,
    pub logprob: f64,
    pub q_mean: f64,
    pub steps: u64,
}

impl RoundStats {
    fn add(&mut self, s: &SacStats) {
        self.actor_loss += s.actor_loss as f64;
        self.critic_loss += s.critic_loss as f64;
        self.ent_coef_loss += s.ent_coef_loss as f64;
        self.ent_coef += s.ent_coef as f64;
        self.logprob += s.logprob_mean as f64;
        self.q_mean += s.q_mean as f64;
        self.steps += 1;
    }

    fn mean(mut self) -> Self {
        let n = self.steps.max(1) as f64;
        for v in [
            &mut self.actor_loss,
            &mut self.critic_loss,
            &mut self.ent_coef_loss,
            &mut self.ent_coef,
            &mut self.logprob,
            &mut self.q_mean,
        ] {
            *v /= n;
        }
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

/// One SAC gradient step on a sampled batch (actions in env units,
/// `[B, action_dim]`); a batch of the wrong shape is an error naming the
/// field, never a panic.
pub fn gradient_step(
    step: &SacConfig,
    sac: &Sac,
    optimizers: &mut SacOptimizers,
    batch: &TransitionBatch,
    rng: &mut ChaCha8Rng,
) -> Result<SacStats, StepError> {
    let field = |field: &'static str, e: relay_proto::TensorError| StepError::Batch {
        field,
        detail: e.to_string(),
    };
    let obs = batch.obs.to_f32().map_err(|e| field("obs", e))?;
    let next_obs = batch.next_obs.to_f32().map_err(|e| field("next_obs", e))?;
    let actions = batch.actions.to_f32().map_err(|e| field("actions", e))?;
    let returns = batch.rewards.to_f32().map_err(|e| field("rewards", e))?;
    let discounts = batch
        .discounts
        .to_f32()
        .map_err(|e| field("discounts", e))?;
    let stats = sac_train_step(
        step,
        sac,
        optimizers,
        &SacBatch {
            obs: &obs,
            actions: &actions,
            returns: &returns,
            next_obs: &next_obs,
            discounts: &discounts,
        },
        rng,
    )?;
    Ok(stats)
}

/// Runs the SAC learner until shutdown.
pub(crate) async fn run(
    service: Service,
    shutdown: Shutdown,
    metrics: Metrics,
) -> Result<(), ServiceError> {
    let cfg: ExperimentConfig = (*service.config).clone();
    let s = cfg.sac.clone();
    let spec = relay_policy::sac_spec_for(&cfg).map_err(ServiceError::other)?;
    let init_ent_coef = initial_ent_coef(&s).map_err(ServiceError::other)?;
    let mut step_cfg = step_config(&s, spec.action_dim(), s.learning_rate.value(0.0))
        .map_err(ServiceError::other)?;
    let mut sac = Sac::new(&spec, init_ent_coef, cfg.run.seed).map_err(ServiceError::other)?;
    let mut optimizers = SacOptimizers::new(&sac, &step_cfg).map_err(ServiceError::other)?;
    let mut rng = ChaCha8Rng::seed_from_u64(cfg.run.seed.wrapping_add(0x5eed));
    let run_dir = cfg.run.runs_dir.join(cfg.run_id()?);
    let mut progress = Progress::default();
    let mut state = SacState::default();
    let mut best_eval: Option<(f64, u64)> = None;
    let mut resumed_at_vec_steps = 0u64;
    let start_from = checkpoint::StartFrom::of(&cfg);
    if let Some(from) = &start_from {
        let dir = &from.dir;
        sac.load(dir.join("model.safetensors"))
            .map_err(|e| from.error(e))?;
        if !cfg.run.reset_optimizer {
            for (file, adam) in optimizer_files(&mut optimizers) {
                adam.load(dir.join(file)).map_err(|e| from.error(e))?;
            }
        }
        if from.resume {
            checkpoint::Restored {
                progress,
                rng,
                best_eval,
            } = checkpoint::restore(dir, &run_dir, rng).map_err(|e| from.error(e))?;
            resumed_at_vec_steps = progress.vec_steps;
            state = load_sac_state(dir).map_err(|e| from.error(e))?;
        }
        tracing::info!(from = %dir.display(), resume = from.resume, version = progress.version, rounds = state.rounds, env_steps = progress.env_steps, "loaded checkpoint");
    }
    crate::count_resume(&service, &start_from);

    // Only the actor is published: the critics stay here.
    let micro = service.micro().await?;
    let latest = LatestWeights::serve(&service, &micro, &run_dir).await?;
    let weights = |sac: &Sac, progress: &Progress| {
        relay_policy::tensors_to_weights(
            &sac.actor.named_tensors(),
            progress.version,
            progress.env_steps,
        )
    };
    let (mut statuses, mut evals) = crate::subscribe_run_events(&service).await?;
    latest.publish(&service, &weights(&sac, &progress)).await;
    metrics.version.set(progress.version as i64);
    service.health.set_ready(true);
    tracing::info!(env_id = %cfg.run.env_id, algo = "sac", params = sac.num_parameters(), ent_coef = ?s.ent_coef, target_entropy = ?step_cfg.target_entropy, "training starts");

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
                &run_dir,
                &sac,
                &mut optimizers,
                &progress,
                &state,
                &rng,
                best_eval,
                &cfg,
                true,
            );
        }

        // How many env steps the table holds for us.
        let counters = match sample_transitions(&service, 0, 1.0).await {
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
        let due_at = round_due_at(&s, state.rounds);
        if progress.env_steps < due_at {
            pause(&shutdown, Duration::from_millis(1)).await;
            continue;
        }

        // A training round, as of env step `due_at`.
        let round_started = Instant::now();
        let frac = (due_at as f64 / budget as f64).min(1.0);
        let lr = s.learning_rate.value(frac);
        optimizers.set_lr(lr);
        step_cfg.lr = lr;
        let mut stats = RoundStats::default();
        let mut rejected = 0u64;
        let mut step = 0;
        while step < s.gradient_steps && !shutdown.is_triggered() {
            let batch = match sample_transitions(&service, s.batch_size as u32, 1.0).await {
                Ok(b) if b.ids.len() == s.batch_size => b,
                Ok(_) => {
                    // Held back by the rate limiter (or not enough held yet).
                    pause(&shutdown, Duration::from_millis(1)).await;
                    continue;
                }
                Err(e) => {
                    tracing::debug!(error = %e, "sample failed; retrying");
                    pause(&shutdown, Duration::from_millis(20)).await;
                    continue;
                }
            };
            step_cfg.update_target = (step as u64).is_multiple_of(s.target_update_interval);
            step += 1;
            state.gradient_steps += 1;
            let result = tokio::task::block_in_place(|| {
                gradient_step(&step_cfg, &sac, &mut optimizers, &batch, &mut rng)
            });
            match result {
                Ok(step_stats) => {
                    stats.add(&step_stats);
                    if step_cfg.update_target {
                        state.target_updates += 1;
                    }
                }
                Err(e) => {
                    // Bad data must not stop training: skip this batch.
                    tracing::error!(error = %e, "gradient step failed; batch skipped");
                    rejected += 1;
                }
            }
        }
        if shutdown.is_triggered() {
            break Finish::Shutdown;
        }
        state.rounds += 1;
        progress.updates += 1;
        progress.version += 1;
        latest.publish(&service, &weights(&sac, &progress)).await;
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
            gauge("learner_policy_loss", stats.actor_loss),
            gauge("learner_value_loss", stats.critic_loss),
            gauge("learner_ent_coef_loss", stats.ent_coef_loss),
            gauge("learner_ent_coef", stats.ent_coef),
            // -E[log π(a|s)] of fresh actions: an estimate of the entropy
            // of the squashed policy.
            gauge("learner_entropy", -stats.logprob),
            gauge("learner_q_mean", stats.q_mean),
            gauge("learner_learning_rate", lr),
            gauge("learner_replay_size", counters.size as f64),
            gauge("learner_target_updates", state.target_updates as f64),
            gauge("learner_rejected_batches", rejected as f64),
        ]);
        reported_vec_steps = progress.vec_steps;
        service.report(Some(progress.vec_steps), values).await;
        if progress.updates % cfg.checkpoint_every() == 0 {
            save(
                &run_dir,
                &sac,
                &mut optimizers,
                &progress,
                &state,
                &rng,
                best_eval,
                &cfg,
                false,
            );
        }
    };

    save(
        &run_dir,
        &sac,
        &mut optimizers,
        &progress,
        &state,
        &rng,
        best_eval,
        &cfg,
        false,
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

/// The checkpoint file of each of SAC's three Adam states.
pub fn optimizer_files(optimizers: &mut SacOptimizers) -> [(&'static str, &mut relay_nn::Adam); 3] {
    [
        ("optimizer.safetensors", &mut optimizers.actor),
        ("critic_optimizer.safetensors", &mut optimizers.critic),
        ("ent_coef_optimizer.safetensors", &mut optimizers.ent_coef),
    ]
}

/// Reads a checkpoint's round bookkeeping (`sac.json`).
pub fn load_sac_state(dir: &Path) -> Result<SacState, CheckpointError> {
    checkpoint::read_json(&dir.join(STATE_FILE))
}

#[allow(clippy::too_many_arguments)]
fn save(
    run_dir: &Path,
    sac: &Sac,
    optimizers: &mut SacOptimizers,
    progress: &Progress,
    state: &SacState,
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
            sac.save(tmp.join("model.safetensors")).map_err(tensors)?;
            for (file, adam) in optimizer_files(optimizers) {
                adam.save(tmp.join(file)).map_err(tensors)?;
            }
            checkpoint::write_json(&tmp.join("state.json"), &counters)?;
            checkpoint::write_json(&tmp.join(STATE_FILE), state)
        },
    );
    checkpoint::log_written(written, progress.version, best);
}

#[cfg(test)]
mod tests {
    use super::*;
    use relay_nn::SacSpec;
    use relay_proto::{Tensor, SCHEMA_VERSION};

    #[test]
    fn rounds_follow_sb3_and_settings_come_from_the_section() {
        let s = SacSection::default();
        // SB3 defaults: learning_starts 100, train_freq 1.
        assert_eq!(round_due_at(&s, 0), 101);
        assert_eq!(round_due_at(&s, 1), 102);
        let every_64 = SacSection {
            train_freq: 64,
            learning_starts: 128,
            ..s.clone()
        };
        assert_eq!(round_due_at(&every_64, 0), 192);
        let step = step_config(&s, 3, 1e-3).unwrap();
        assert!(step.auto_entropy);
        assert_eq!(step.target_entropy, Some(-3.0));
        assert_eq!((step.tau, step.lr), (0.005, 1e-3));
        assert_eq!(initial_ent_coef(&s).unwrap(), 1.0);
        let fixed = SacSection {
            ent_coef: relay_kit::config::NumberOrName::Number(0.2),
            ..s.clone()
        };
        assert!(!step_config(&fixed, 1, 1e-3).unwrap().auto_entropy);
        assert_eq!(initial_ent_coef(&fixed).unwrap(), 0.2);
        let bad = SacSection {
            ent_coef: relay_kit::config::NumberOrName::Name("sometimes".into()),
            ..s
        };
        assert!(step_config(&bad, 1, 1e-3)
            .unwrap_err()
            .to_string()
            .contains("sac.ent_coef"));
    }

    fn batch(b: usize, obs_dim: usize, action_dim: usize, actions: &[f32]) -> TransitionBatch {
        TransitionBatch {
            schema: SCHEMA_VERSION,
            ids: (0..b as u64).collect(),
            obs: Tensor::from_f32(&[b, obs_dim], &vec![0.1; b * obs_dim]),
            actions: Tensor::from_f32(&[b, action_dim], actions),
            rewards: Tensor::from_f32(&[b], &vec![1.0; b]),
            next_obs: Tensor::from_f32(&[b, obs_dim], &vec![0.2; b * obs_dim]),
            discounts: Tensor::from_f32(&[b], &vec![0.99; b]),
            terminated: Tensor::from_bool(&[b], &vec![false; b]),
            truncated: Tensor::from_bool(&[b], &vec![false; b]),
            weights: Tensor::from_f32(&[b], &vec![1.0; b]),
            size: b as u64,
            inserted_steps: b as u64,
        }
    }

    #[test]
    fn a_gradient_step_trains_alpha_and_refuses_a_batch_of_the_wrong_shape() {
        let spec = SacSpec {
            hidden: vec![16],
            ..SacSpec::new(3, vec![-2.0], vec![2.0])
        };
        let sac = Sac::new(&spec, 1.0, 5).unwrap();
        let step = step_config(&SacSection::default(), 1, 1e-2).unwrap();
        let mut opt = SacOptimizers::new(&sac, &step).unwrap();
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        let before = sac.ent_coef().unwrap();
        let good = batch(8, 3, 1, &[0.5; 8]);
        let stats = gradient_step(&step, &sac, &mut opt, &good, &mut rng).unwrap();
        assert!(stats.critic_loss.is_finite() && stats.actor_loss.is_finite());
        assert_eq!(stats.ent_coef, before);
        assert_ne!(sac.ent_coef().unwrap(), before);
        // Two action values per row for a one-dimensional actor.
        let bad = batch(8, 3, 2, &[0.5; 16]);
        let err = gradient_step(&step, &sac, &mut opt, &bad, &mut rng).unwrap_err();
        assert!(err.to_string().contains("actions"), "{err}");
    }
}
