//! DQN (`run.algo: dqn`): a Q-network trained off-policy on the
//! replay-buffer's transition table by the loop every off-policy learner
//! shares ([`crate::offpolicy::run`]); what a round does is [`Dqn`]'s.
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

use rand_chacha::ChaCha8Rng;
use relay_config::DqnConfig;
use relay_config::ExperimentConfig;
use relay_kit::{gauge, ServiceError};
use relay_nn::{Adam, AdamConfig, DqnStats, QNetwork};
use relay_policy::PolicyWeights;
use relay_proto::{MetricValue, TransitionBatch};
use serde::{Deserialize, Serialize};

use crate::checkpoint::{self, CheckpointError};
use crate::offpolicy::{OffPolicyAlgorithm, RoundSchedule};
use crate::progress::Progress;
use relay_algo::dqn::gradient_step;
use relay_nn::BatchShare;

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

/// What learner replicas hold alike: both networks, Adam's state and the
/// round bookkeeping.
#[derive(Serialize, Deserialize)]
pub(crate) struct DqnReplicaState {
    online: Vec<relay_nn::NamedTensor>,
    target: Vec<relay_nn::NamedTensor>,
    optimizer: relay_nn::AdamState,
    state: DqnState,
}

/// The round schedule of a config section.
pub(crate) fn schedule(cfg: &DqnConfig) -> RoundSchedule {
    RoundSchedule {
        learning_starts: cfg.learning_starts,
        train_freq: cfg.train_freq,
        batch_size: cfg.batch_size,
        gradient_steps: cfg.gradient_steps,
    }
}

/// Env steps at which round `rounds` (0-based) is due
/// ([`RoundSchedule::due_at`]).
pub fn round_due_at(cfg: &DqnConfig, rounds: u64) -> u64 {
    schedule(cfg).due_at(rounds)
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

/// Errors of a gradient step on a sampled batch, of a target update, or
/// of loading a checkpoint.
///
/// The gradient step itself is [`relay_algo::dqn::gradient_step`].
#[derive(Debug, thiserror::Error)]
pub enum DqnError {
    #[error(transparent)]
    Step(#[from] relay_algo::StepError),
    #[error(transparent)]
    Nn(#[from] relay_nn::NnError),
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
}

/// DQN's networks, optimizer and round bookkeeping, trained by the shared
/// off-policy loop ([`crate::offpolicy::run`]).
pub(crate) struct Dqn {
    cfg: DqnConfig,
    online: QNetwork,
    target: QNetwork,
    optimizer: Adam,
    state: DqnState,
    /// The round in progress: its statistics and its β.
    stats: RoundStats,
    beta: f64,
}

impl Dqn {
    /// A fresh Q-network (and its target copy) for the run's env.
    pub(crate) fn new(cfg: &ExperimentConfig) -> Result<Self, ServiceError> {
        let d = cfg.dqn.clone();
        let spec = relay_policy::qnet_spec_for(cfg).map_err(ServiceError::other)?;
        let device = relay_policy::policy_device(cfg).map_err(ServiceError::other)?;
        let online = QNetwork::new(&spec, cfg.run.seed)
            .and_then(|net| net.to_device(&device))
            .map_err(ServiceError::other)?;
        let target = online.duplicate().map_err(ServiceError::other)?;
        let optimizer = Adam::new(
            online.vars(),
            AdamConfig {
                lr: d.learning_rate.value(0.0),
                eps: d.adam_eps,
                ..AdamConfig::default()
            },
        )
        .map_err(ServiceError::other)?;
        tracing::info!(
            prioritized = d.prioritized,
            double_q = d.double_q,
            n_steps = d.n_steps,
            "dqn"
        );
        Ok(Self {
            cfg: d,
            online,
            target,
            optimizer,
            state: DqnState::default(),
            stats: RoundStats::default(),
            beta: 1.0,
        })
    }
}

impl OffPolicyAlgorithm for Dqn {
    const NAME: &'static str = "dqn";
    const REPORTS_PRIORITIES: bool = true;
    type Error = DqnError;
    type State = DqnReplicaState;

    fn rounds(&self) -> u64 {
        self.state.rounds
    }

    fn schedule(&self) -> RoundSchedule {
        schedule(&self.cfg)
    }

    fn num_parameters(&self) -> usize {
        self.online.num_parameters()
    }

    fn load(&mut self, dir: &Path, resume: bool, optimizers: bool) -> Result<(), DqnError> {
        self.online.load(dir.join("model.safetensors"))?;
        // Another run's checkpoint, or one written before targets were
        // saved: the target starts as a copy of the online network.
        let target_path = dir.join("target.safetensors");
        if resume && target_path.exists() {
            self.target.load(&target_path)?;
        } else {
            self.target.copy_from(&self.online)?;
        }
        if optimizers {
            self.optimizer.load(dir.join("optimizer.safetensors"))?;
        }
        if resume {
            self.state = checkpoint::read_json(&dir.join(STATE_FILE))?;
        }
        Ok(())
    }

    fn save(&mut self, dir: &Path) -> Result<(), CheckpointError> {
        let tensors = |e: relay_nn::NnError| CheckpointError::Tensors(e.to_string());
        self.online
            .save(dir.join("model.safetensors"))
            .map_err(tensors)?;
        self.target
            .save(dir.join("target.safetensors"))
            .map_err(tensors)?;
        self.optimizer
            .save(dir.join("optimizer.safetensors"))
            .map_err(tensors)?;
        checkpoint::write_json(&dir.join(STATE_FILE), &self.state)
    }

    fn weights(&self, progress: &Progress) -> PolicyWeights {
        PolicyWeights::from_tensors(
            self.online.named_tensors(),
            progress.version,
            progress.env_steps,
        )
    }

    fn parameters(&self) -> Vec<relay_nn::NamedTensor> {
        let mut tensors = self.online.named_tensors();
        tensors.extend(self.target.named_tensors());
        tensors
    }

    fn capture(&self) -> Result<DqnReplicaState, DqnError> {
        Ok(DqnReplicaState {
            online: self.online.named_tensors(),
            target: self.target.named_tensors(),
            optimizer: self.optimizer.state()?,
            state: self.state,
        })
    }

    fn restore(&mut self, state: DqnReplicaState) -> Result<(), DqnError> {
        self.online.load_named_tensors(&state.online)?;
        self.target.load_named_tensors(&state.target)?;
        self.optimizer.set_state(state.optimizer)?;
        self.state = state.state;
        Ok(())
    }

    fn sampling_beta(&self, frac: f64) -> f64 {
        if self.cfg.prioritized {
            self.cfg.prioritized_beta.value(frac)
        } else {
            1.0
        }
    }

    fn begin_round(&mut self, due_at: u64, frac: f64) -> Result<(), DqnError> {
        self.beta = self.sampling_beta(frac);
        let d = &self.cfg;
        self.optimizer.set_lr(d.learning_rate.value(frac));
        let owed = target_updates_between(d, self.state.target_checked_at, due_at);
        // A hard copy (tau 1) once covers any number owed.
        for _ in 0..owed.min(if d.tau >= 1.0 { 1 } else { u64::MAX }) {
            self.target.soft_update(&self.online, d.tau as f32)?;
            self.state.target_updates += 1;
        }
        self.state.target_checked_at = due_at;
        self.stats = RoundStats::default();
        Ok(())
    }

    fn gradient_step(
        &mut self,
        _step: usize,
        batch: &TransitionBatch,
        _rng: &mut ChaCha8Rng,
        sync: &mut BatchShare<'_>,
    ) -> Result<Option<Vec<f32>>, DqnError> {
        let (loss_stats, norm, priorities) = gradient_step(
            &self.cfg,
            &self.online,
            &self.target,
            &mut self.optimizer,
            batch,
            sync,
        )?;
        self.stats.add(&loss_stats, norm);
        Ok(self.cfg.prioritized.then_some(priorities))
    }

    fn prioritized(&self) -> bool {
        self.cfg.prioritized
    }

    fn end_round(&mut self, frac: f64) -> Vec<MetricValue> {
        self.state.rounds += 1;
        let stats = self.stats.mean();
        let d = &self.cfg;
        vec![
            gauge("learner_dqn_loss", stats.loss),
            gauge("learner_q_mean", stats.q_mean),
            gauge("learner_td_error_abs", stats.td_abs),
            gauge("learner_grad_norm", stats.grad_norm),
            gauge("learner_learning_rate", d.learning_rate.value(frac)),
            gauge("learner_epsilon", d.exploration_rate(frac)),
            gauge("learner_per_beta", self.beta),
            gauge("learner_target_updates", self.state.target_updates as f64),
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use relay_nn::QNetSpec;
    use relay_proto::{Tensor, SCHEMA_VERSION};

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
            weight_scale: None,
            size: b as u64,
            inserted_steps: b as u64,
            next_masks: None,
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
        let (first, _, p0) = gradient_step(
            &d,
            &online,
            &target,
            &mut adam,
            &b,
            &mut relay_nn::BatchShare::whole(),
        )
        .unwrap();
        assert_eq!(p0.len(), 2);
        assert!(p0.iter().all(|&p| p > 0.0));
        let mut last = first;
        for _ in 0..300 {
            last = gradient_step(
                &d,
                &online,
                &target,
                &mut adam,
                &b,
                &mut relay_nn::BatchShare::whole(),
            )
            .unwrap()
            .0;
        }
        assert!(last.loss < first.loss * 0.01, "{first:?} -> {last:?}");
        let q = online.q_values(&[0.5, -0.5], 1).unwrap();
        assert!((q[0] - 1.0).abs() < 0.05 && q[1].abs() < 0.05, "{q:?}");
        // A discrete action out of range is an error, not a panic.
        let bad = batch(&[0.5, -0.5], &[7], &[1.0], &[0.0; 2], &[0.0]);
        assert!(gradient_step(
            &d,
            &online,
            &target,
            &mut adam,
            &bad,
            &mut relay_nn::BatchShare::whole()
        )
        .is_err());
    }
}
