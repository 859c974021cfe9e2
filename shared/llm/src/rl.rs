//! Token-level RL objectives for LoRA adapters, and the train step that
//! applies them to a batch of rollouts.
//!
//! This module owns:
//! - [`TokenExample`]: one sampled completion with its behaviour log-probs,
//!   reward and group (the learner builds them from replayed games);
//! - the objective's config ([`ObjectiveConfig`]): an
//!   [`AdvantageEstimator`], a [`PolicyLoss`], an
//!   [`Aggregation`](crate::Aggregation), an optional [`KlConfig`] and an
//!   entropy bonus, each a serde enum or struct, with the published
//!   recipes as presets;
//! - [`compute_advantages`], [`rl_loss`] (pure functions of rewards and
//!   logits, tested by hand) and [`kl_estimate`], in `rl/objective.rs`;
//! - [`RlTrainer`]: truncation, micro-batching, gradient accumulation and
//!   one AdamW step over the adapter's vars, with [`RlStats`].
//!
//! # Formulas
//!
//! Sequence `i` of the batch has reward `r_i`, group `g(i)` (the
//! completions sampled for one prompt), completion tokens `t = 1..L_i`
//! with current log-probs `logp[i,t]` (the adapted model, differentiable),
//! behaviour log-probs `old[i,t]` (what the sampler reported: the policy
//! at temperature 1 over the full vocabulary) and reference log-probs
//! `ref[i,t]` (the base model without adapter, or the adapter set by
//! [`RlTrainer::set_reference`]: the policy a run started from).
//!
//! **Advantages** ([`AdvantageEstimator`]), one per sequence:
//!
//! | estimator | `A_i` | source |
//! |---|---|---|
//! | `reinforce` | `r_i − b` with `b` = 0, the batch mean, or a moving average of batch means | Williams 1992 |
//! | `rloo` | `r_i − (1/(G−1)) Σ_{j∈g(i), j≠i} r_j` | Ahmadian et al. 2024, "Back to Basics", arXiv:2402.14740; Kool et al. 2019 |
//! | `grpo` | `(r_i − mean_g) / (std_g + eps)`, or `r_i − mean_g` with `scale_by_std: false` | Shao et al. 2024 (DeepSeekMath), arXiv:2402.03300; Dr. GRPO (Liu et al. 2025, arXiv:2503.20783) drops the std |
//!
//! `std_g` is the sample standard deviation (`G − 1`, as `torch.std` in
//! TRL). A group (or for `reinforce` with the batch mean, the batch)
//! whose rewards are all equal gets advantages of exactly 0, and so does
//! a group of one under `rloo` and `grpo` (no baseline exists).
//!
//! **Per-token policy loss** ([`PolicyLoss`]):
//!
//! * `policy_gradient`: `l[i,t] = −A_i · logp[i,t]` (REINFORCE/RLOO; on
//!   policy, behaviour log-probs unused).
//! * `ppo_clip` (Schulman et al. 2017, arXiv:1707.06347):
//!   `l[i,t] = −min(ρ·A_i, clip(ρ, 1−ε_low, 1+ε_high)·A_i)` with
//!   `ρ = exp(logp[i,t] − old[i,t])` per token, or (`ratio: sequence`,
//!   GSPO, Zheng et al. 2025, arXiv:2507.18071) the sequence ratio
//!   `ρ_i = exp((1/L_i) Σ_t (logp[i,t] − old[i,t]))` for every token of
//!   the sequence. Separate `ε_low`/`ε_high` allow DAPO's clip-higher.
//!
//! **Aggregation** ([`Aggregation`](crate::Aggregation)): token mean over the batch (DAPO),
//! mean per sequence then over sequences (GRPO), or sum over tokens over a
//! constant `N·M` (Dr. GRPO). Weights use whole-batch counts, so the
//! micro-batch losses sum to the batch loss and gradient accumulation is
//! exact.
//!
//! **KL to the reference** ([`KlConfig`]), per token with `d = ref − logp`
//! (estimators from Schulman, "Approximating KL Divergence", 2020):
//! `k1 = −d` (unbiased, can be negative), `k2 = d²/2`,
//! `k3 = exp(d) − d − 1` (unbiased, non-negative; GRPO's choice), `d`
//! clamped to ±20 before `exp`. Either as a loss term `β · Σ w·k` (GRPO),
//! or as a reward penalty `r_i ← r_i − β Σ_t k(old, ref)` computed with
//! the behaviour log-probs before the advantages (InstructGPT, Ouyang et
//! al. 2022). A fresh PEFT adapter (`B = 0`) gives exactly the reference
//! logits, so every estimator is exactly 0.
//!
//! **Entropy bonus**: `−c · Σ w·H[i,t]` with the exact entropy
//! `H = −Σ_v p_v log p_v` of the next-token distribution at each
//! completion position.
//!
//! Total: `loss = policy + β·KL (loss mode) − c·entropy`.
//!
//! **Trainer/sampler mismatch.** The sampler (the inference server: other
//! kernels, maybe another dtype or device) and the learner compute
//! slightly different probabilities for the same token. Every step
//! compares the learner's log-prob of each completion token before the
//! batch's first optimizer step, `cur[i,t]`, with the sampler's `old[i,t]`
//! ([`RlStats::sampler_logprob_diff_mean`] and `_max`). With
//! [`TruncatedIs`] on (Yao et al. 2025, "Your Efficient RL Framework
//! Secretly Brings You Off-Policy RL Training"; as in Marin and prime-rl),
//! each token's policy loss is weighted by the constant
//! `min(exp(cur[i,t] − old[i,t]), cap)`, and the PPO ratio's denominator
//! is `cur` (the learner's own old policy) instead of `old`, so the clip
//! bounds the learner's policy change only. Off, nothing changes: the
//! PPO ratio is to the sampler's log-probs and no weight applies.
//!
//! # Presets
//!
//! [`ObjectiveConfig::reinforce`], [`ObjectiveConfig::rloo`],
//! [`ObjectiveConfig::grpo`], [`ObjectiveConfig::dr_grpo`],
//! [`ObjectiveConfig::ppo`]. In YAML:
//!
//! ```yaml
//! objective:
//!   advantage: { kind: grpo, scale_by_std: true, std_eps: 1.0e-4 }
//!   policy_loss: { kind: ppo_clip, clip_low: 0.2, clip_high: 0.2, ratio: token }
//!   aggregation: { kind: sequence_mean }
//!   kl: { coef: 0.04, estimator: k3, mode: loss }
//!   entropy_coef: 0.0
//! batch: { batch_size: 64, minibatch_size: 8, max_seq_len: 1024, truncation: cut_prompt_start }
//! optimizer: { lr: 1.0e-5, weight_decay: 0.0, max_grad_norm: 1.0 }
//! ```
//!
//! # The learner's loop
//!
//! ```no_run
//! use relay_llm::rl::{RlTrainConfig, RlTrainer, TokenExample};
//! use relay_llm::{CausalLm, LoraAdapter, LoraConfig};
//! # fn replay() -> Vec<TokenExample> { vec![] }
//! let model = CausalLm::load_hf("model-dir".as_ref())?;
//! let adapter = LoraAdapter::new(model.config(), LoraConfig::all_projections(8, 16.0), 0)?;
//! let config: RlTrainConfig = serde_yaml_or_json_from_your_config();
//! let mut trainer = RlTrainer::new(config, &adapter)?;
//! loop {
//!     let examples: Vec<TokenExample> = replay(); // 1..=batch_size, whole groups
//!     let stats = trainer.train_step(&model, &adapter, &examples)?;
//!     let _ = (stats.loss, stats.kl, stats.grad_norm); // to metrics
//!     // publish adapter.deep_copy()? / save_peft as version N + 1
//! #   break;
//! }
//! # fn serde_yaml_or_json_from_your_config() -> RlTrainConfig { unimplemented!() }
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! One call is one optimizer step; for several PPO epochs over one batch,
//! call [`RlTrainer::train_epochs`], which keeps the learner's log-probs
//! of the first epoch as the old policy of the later ones.

use std::collections::BTreeMap;

use candle_core::Tensor;
use serde::{Deserialize, Serialize};

pub use relay_config::hyper::objective::{
    AdvantageEstimator, Baseline, KlConfig, KlEstimator, KlMode, ObjectiveConfig, PolicyLoss,
    RatioLevel, RlTrainConfig, TruncatedIs,
};

use crate::lora::LoraAdapter;
use crate::model::CausalLm;
use crate::optim::{AdamW, StepReport};
use crate::token_batch::{
    fit_to_length, micro_batches, target_log_probs, BatchTotals, Fit, TokenBatch, TruncationStats,
};
use crate::train_error::{TrainError, TrainResult};

mod objective;

pub use objective::{
    compute_advantages, kl_estimate, rl_loss, LossSums, MovingBaselines, RlLoss, RlMicroBatch,
    RlRow,
};

/// One sampled completion, ready for the learner.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TokenExample {
    /// The prompt's token ids as the policy saw them (chat template
    /// applied); at least one.
    pub prompt: Vec<u32>,
    /// The sampled tokens (the policy's own output, end-of-turn token
    /// included when it was sampled); at least one.
    pub completion: Vec<u32>,
    /// Log-prob of each completion token under the behaviour policy
    /// (temperature 1, full vocabulary: `Sampled::logprob`).
    pub behaviour_logprobs: Vec<f32>,
    /// Scalar reward of the whole completion (after reward shaping).
    pub reward: f64,
    /// Group id: completions sampled for the same prompt/state share it
    /// (RLOO and GRPO baselines are computed within groups).
    pub group: u64,
    /// Stratum of the moving-average baseline: examples whose rewards
    /// have the same expected level share one average (the learner uses
    /// the seat, since the first mover wins more often; one stratum, e.g.
    /// 0, gives the classic single average).
    pub stratum: u64,
}

impl TokenExample {
    /// Checks lengths and finiteness.
    pub fn validate(&self) -> TrainResult<()> {
        if self.prompt.is_empty() {
            return Err(TrainError::BadInput("empty prompt".into()));
        }
        if self.completion.is_empty() {
            return Err(TrainError::BadInput("empty completion".into()));
        }
        if self.behaviour_logprobs.len() != self.completion.len() {
            return Err(TrainError::BadInput(format!(
                "{} behaviour log-probs for {} completion tokens",
                self.behaviour_logprobs.len(),
                self.completion.len()
            )));
        }
        if let Some(bad) = self.behaviour_logprobs.iter().find(|l| !l.is_finite()) {
            return Err(TrainError::BadInput(format!(
                "behaviour log-prob {bad} is not finite"
            )));
        }
        if !self.reward.is_finite() {
            return Err(TrainError::BadInput(format!(
                "reward {} is not finite",
                self.reward
            )));
        }
        Ok(())
    }
}

/// Indices of `keys` by key.
fn by_key(keys: &[u64]) -> BTreeMap<u64, Vec<usize>> {
    let mut out: BTreeMap<u64, Vec<usize>> = BTreeMap::new();
    for (i, k) in keys.iter().enumerate() {
        out.entry(*k).or_default().push(i);
    }
    out
}

/// What one train step did (means are over the kept sequences/tokens).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct RlStats {
    /// Total loss of the batch.
    pub loss: f64,
    /// Policy part of the loss.
    pub policy_loss: f64,
    /// Token mean of the KL estimator against the reference: with the
    /// current policy in loss mode, the behaviour policy in penalty mode;
    /// 0 without KL.
    pub kl: f64,
    /// Mean per-sequence reward penalty `β Σ_t k` (penalty mode), else 0.
    pub kl_penalty: f64,
    /// Token mean of the policy's entropy at completion positions.
    pub entropy: f64,
    /// Fraction of tokens whose gradient the PPO clip removed.
    pub clip_fraction: f64,
    /// Token mean of `ρ − 1 − log ρ` (KL from the behaviour policy).
    pub approx_kl: f64,
    /// Token mean of `|cur − old|`: the learner's log-probs before the
    /// batch's first step against the sampler's (module docs).
    pub sampler_logprob_diff_mean: f64,
    /// Largest `|cur − old|` of the batch.
    pub sampler_logprob_diff_max: f64,
    /// Fraction of tokens whose [`TruncatedIs`] weight was capped (0 when off).
    pub tis_capped_fraction: f64,
    /// Token mean and population variance of the ratio `ρ = exp(logp −
    /// old)` to the policy PPO's clip compares with.
    pub ratio_mean: f64,
    pub ratio_var: f64,
    /// Token mean of `ρ − 1 − log ρ` with `ρ` the ratio of this epoch's
    /// log-probs to the previous epoch's (of the same update): how far the
    /// last step moved the policy, PPO's approximate KL between epochs;
    /// 0 in the first epoch.
    pub epoch_kl: f64,
    /// Mean reward before any KL penalty.
    pub reward_mean: f64,
    /// Mean advantage.
    pub advantage_mean: f64,
    /// Population std of the advantages.
    pub advantage_std: f64,
    /// Mean prompt + completion tokens (after truncation).
    pub mean_seq_len: f64,
    /// Mean completion tokens.
    pub mean_completion_len: f64,
    /// Sequences trained on.
    pub sequences: usize,
    /// Completion tokens trained on.
    pub tokens: usize,
    /// Sequences cut to `max_seq_len`.
    pub truncated: usize,
    /// Prompt tokens cut.
    pub tokens_cut: usize,
    /// Sequences dropped (too long).
    pub dropped: usize,
    /// Global gradient norm before clipping (0 until the step is taken).
    pub grad_norm: f64,
    /// Whether clipping scaled the gradient.
    pub grad_clipped: bool,
}

/// Token mean of `ρ − 1 − log ρ`, `ρ = exp(new − old)`: the k3 estimate of
/// KL(old ‖ new) on the sampled tokens, by sequence (both as
/// [`RlTrainer::accumulate`] returns them).
fn approx_kl_between(old: &[Vec<f32>], new: &[Vec<f32>]) -> f64 {
    let (mut sum, mut tokens) = (0.0, 0usize);
    for (old, new) in old.iter().zip(new) {
        for (o, n) in old.iter().zip(new) {
            let log_ratio = f64::from(n - o);
            sum += log_ratio.exp() - 1.0 - log_ratio;
            tokens += 1;
        }
    }
    sum / tokens.max(1) as f64
}

/// Trains one LoRA adapter with an RL objective: one call of
/// [`RlTrainer::train_step`] per optimizer step.
#[derive(Debug)]
pub struct RlTrainer {
    config: RlTrainConfig,
    optimizer: AdamW,
    moving_baselines: MovingBaselines,
    /// The KL term's reference: `None` is the base model.
    reference: Option<LoraAdapter>,
}

struct Kept<'a> {
    example: &'a TokenExample,
    prompt: &'a [u32],
}

impl RlTrainer {
    /// A trainer whose optimizer holds `adapter`'s vars (and nothing else).
    pub fn new(config: RlTrainConfig, adapter: &LoraAdapter) -> TrainResult<Self> {
        config.validate()?;
        let optimizer = AdamW::new(adapter.named_vars(), config.optimizer.clone())?;
        Ok(Self {
            config,
            optimizer,
            moving_baselines: MovingBaselines::new(),
            reference: None,
        })
    }

    /// Measures the KL term against `reference` (a frozen adapter over the
    /// same base, e.g. a deep copy of the warm start a run began from)
    /// instead of the base model; `None` restores the base. Refused when
    /// it is the adapter being trained, which would make the KL 0.
    pub fn set_reference(&mut self, reference: Option<LoraAdapter>) -> TrainResult<()> {
        if let Some(r) = &reference {
            if r.vars().first().is_some_and(|v| self.optimizer.contains(v)) {
                return Err(TrainError::BadInput(
                    "the KL reference must be a copy of the adapter, not the trained one".into(),
                ));
            }
        }
        self.reference = reference;
        Ok(())
    }

    /// The KL term's reference adapter (`None`: the base model).
    pub fn reference(&self) -> Option<&LoraAdapter> {
        self.reference.as_ref()
    }

    /// The configuration.
    pub fn config(&self) -> &RlTrainConfig {
        &self.config
    }

    /// The optimizer (steps taken, accumulated gradients, learning rate).
    pub fn optimizer(&self) -> &AdamW {
        &self.optimizer
    }

    /// The optimizer, to change the learning rate.
    pub fn optimizer_mut(&mut self) -> &mut AdamW {
        &mut self.optimizer
    }

    /// The moving-average baselines by stratum (empty before the first
    /// batch, or with another baseline).
    pub fn moving_baselines(&self) -> &MovingBaselines {
        &self.moving_baselines
    }

    /// Restores the moving-average baselines (from a checkpoint).
    pub fn set_moving_baselines(&mut self, value: MovingBaselines) {
        self.moving_baselines = value;
    }

    /// One optimizer step on `examples` (`1..=batch_size`):
    /// [`RlTrainer::accumulate_gradients`] then
    /// [`RlTrainer::apply_gradients`].
    pub fn train_step(
        &mut self,
        model: &CausalLm,
        adapter: &LoraAdapter,
        examples: &[TokenExample],
    ) -> TrainResult<RlStats> {
        Ok(self.train_epochs(model, adapter, examples, 1)?.remove(0))
    }

    /// `epochs` optimizer steps on the same `examples` (PPO-style epochs):
    /// the learner's log-probs of the first are the old policy of the
    /// later ones (module docs: trainer/sampler mismatch). One
    /// [`RlStats`] per step.
    pub fn train_epochs(
        &mut self,
        model: &CausalLm,
        adapter: &LoraAdapter,
        examples: &[TokenExample],
        epochs: usize,
    ) -> TrainResult<Vec<RlStats>> {
        self.train_epochs_part(
            model,
            adapter,
            examples,
            epochs,
            &mut relay_nn::BatchShare::whole(),
        )
    }

    /// [`RlTrainer::train_epochs`] as one of several learner replicas
    /// (`share`): every replica holds all `examples` and computes its part
    /// of the micro-batches; the gradients, the statistics and the
    /// log-probs of every sequence are summed across replicas before each
    /// step (the losses are normalised by the whole batch's totals, so the
    /// sum is the whole batch's gradient), and every replica steps alike.
    ///
    /// A learner that is stopping ([`relay_nn::BatchShare::stopping`],
    /// asked before every block of every forward and backward pass) ends
    /// the call with [`TrainError::Stopped`]: an update of a 135 M model
    /// takes tens of seconds on CPU. Epochs already stepped stay applied
    /// and the current one's gradients stay accumulated: the caller puts
    /// back the adapter, the optimizer (which clears them) and the moving
    /// baselines it took before the call.
    pub fn train_epochs_part(
        &mut self,
        model: &CausalLm,
        adapter: &LoraAdapter,
        examples: &[TokenExample],
        epochs: usize,
        share: &mut relay_nn::BatchShare<'_>,
    ) -> TrainResult<Vec<RlStats>> {
        let mut all = Vec::with_capacity(epochs);
        let mut first_logprobs: Option<Vec<Vec<f32>>> = None;
        let mut previous: Option<Vec<Vec<f32>>> = None;
        for _ in 0..epochs {
            let (mut stats, logprobs) =
                self.accumulate(model, adapter, examples, first_logprobs.as_deref(), share)?;
            let report = self.apply_gradients()?;
            stats.grad_norm = report.grad_norm;
            stats.grad_clipped = report.clipped;
            if let Some(previous) = &previous {
                stats.epoch_kl = approx_kl_between(previous, &logprobs);
            }
            all.push(stats);
            if first_logprobs.is_none() {
                first_logprobs = Some(logprobs.clone());
            }
            previous = Some(logprobs);
        }
        Ok(all)
    }

    /// Computes the loss of `examples` micro-batch by micro-batch and adds
    /// its gradients to the optimizer's sums, without stepping (inspect
    /// them with [`AdamW::accumulated_grads`]). Updates the moving
    /// baseline.
    pub fn accumulate_gradients(
        &mut self,
        model: &CausalLm,
        adapter: &LoraAdapter,
        examples: &[TokenExample],
    ) -> TrainResult<RlStats> {
        Ok(self
            .accumulate(
                model,
                adapter,
                examples,
                None,
                &mut relay_nn::BatchShare::whole(),
            )?
            .0)
    }

    /// [`RlTrainer::accumulate_gradients`] with the learner's first-epoch
    /// log-probs (by kept sequence, as this returns them; `None` in the
    /// first epoch).
    fn accumulate(
        &mut self,
        model: &CausalLm,
        adapter: &LoraAdapter,
        examples: &[TokenExample],
        learner_logprobs: Option<&[Vec<f32>]>,
        share: &mut relay_nn::BatchShare<'_>,
    ) -> TrainResult<(RlStats, Vec<Vec<f32>>)> {
        let cfg = &self.config;
        crate::token_batch::check_batch_len(&cfg.batch, examples.len())?;
        match adapter.vars().first() {
            Some(v) if self.optimizer.contains(v) => {}
            _ => {
                return Err(TrainError::BadInput(
                    "the adapter is not the one this trainer was built with".into(),
                ))
            }
        }
        for (i, e) in examples.iter().enumerate() {
            e.validate()
                .map_err(|err| TrainError::BadInput(format!("example {i}: {err}")))?;
        }
        let device = model.rope_cos.device().clone();

        let mut truncation = TruncationStats::default();
        let mut kept = Vec::with_capacity(examples.len());
        for e in examples {
            let fit = fit_to_length(
                e.prompt.len(),
                e.completion.len(),
                cfg.batch.max_seq_len,
                cfg.batch.truncation,
            );
            truncation.record(fit);
            if let Fit::Keep { prompt_start } = fit {
                kept.push(Kept {
                    example: e,
                    prompt: &e.prompt[prompt_start..],
                });
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
            .map(|k| k.prompt.len() + k.example.completion.len())
            .collect();
        let chunks = micro_batches(&lens, cfg.batch.minibatch_size);
        // This replica's micro-batches (alone: all of them).
        let mine = &chunks[share.rows(chunks.len())];
        let stop = share.stop;
        let sum_across = |share: &mut relay_nn::BatchShare<'_>, data: &mut [f32]| {
            share.sum(data).map_err(TrainError::from)
        };
        let totals = BatchTotals {
            sequences: kept.len(),
            tokens: kept.iter().map(|k| k.example.completion.len()).sum(),
        };

        let raw_rewards: Vec<f64> = kept.iter().map(|k| k.example.reward).collect();
        let mut rewards = raw_rewards.clone();
        let mut kl_penalty_sum = 0.0;
        let mut penalty_kl_tokens = 0.0;
        if let Some(kl) = cfg.objective.kl.filter(|k| k.mode == KlMode::RewardPenalty) {
            let mut penalties = vec![0f64; kept.len()];
            for chunk in mine {
                let pairs: Vec<(&[u32], &[u32])> = chunk
                    .iter()
                    .map(|&i| (kept[i].prompt, kept[i].example.completion.as_slice()))
                    .collect();
                let batch = TokenBatch::new(&pairs, &device)?;
                let ref_logits = model
                    .forward_train_batch_until(&batch, self.reference.as_ref(), stop)?
                    .detach();
                let ref_logp = target_log_probs(&ref_logits, &batch.targets)?;
                let old: Vec<f32> = chunk
                    .iter()
                    .flat_map(|&i| kept[i].example.behaviour_logprobs.iter().copied())
                    .collect();
                let n = old.len();
                let old = Tensor::from_vec(old, n, &device)?;
                let k: Vec<f32> = kl_estimate(kl.estimator, &old, &ref_logp)?.to_vec1()?;
                for (t, &row) in batch.token_rows.iter().enumerate() {
                    let i = chunk[row as usize];
                    penalties[i] += kl.coef * f64::from(k[t]);
                    kl_penalty_sum += kl.coef * f64::from(k[t]);
                    penalty_kl_tokens += f64::from(k[t]);
                }
            }
            // Every sequence's penalty, whichever replica computed it,
            // before the advantages compare rewards across the batch.
            if !share.is_alone() {
                let mut summed: Vec<f32> = penalties.iter().map(|&p| p as f32).collect();
                summed.extend([kl_penalty_sum as f32, penalty_kl_tokens as f32]);
                sum_across(share, &mut summed)?;
                let n = kept.len();
                (kl_penalty_sum, penalty_kl_tokens) = (summed[n] as f64, summed[n + 1] as f64);
                penalties = summed[..n].iter().map(|&p| p as f64).collect();
            }
            for (reward, penalty) in rewards.iter_mut().zip(penalties) {
                *reward -= penalty;
            }
        }

        let groups: Vec<u64> = kept.iter().map(|k| k.example.group).collect();
        let strata: Vec<u64> = kept.iter().map(|k| k.example.stratum).collect();
        let advantages = compute_advantages(
            &cfg.objective.advantage,
            &rewards,
            &groups,
            &strata,
            &self.moving_baselines,
        )?;

        if let Some(learner) = learner_logprobs {
            if learner.len() != kept.len() {
                return Err(TrainError::BadInput(format!(
                    "{} sequences of learner log-probs for {} sequences",
                    learner.len(),
                    kept.len()
                )));
            }
        }
        let need_reference = cfg.objective.kl.is_some_and(|k| k.mode == KlMode::Loss);
        let mut sums = LossSums::default();
        let mut logprobs: Vec<Vec<f32>> = vec![Vec::new(); kept.len()];
        for chunk in mine {
            let rows: Vec<RlRow<'_>> = chunk
                .iter()
                .map(|&i| RlRow {
                    prompt: kept[i].prompt,
                    completion: &kept[i].example.completion,
                    behaviour_logprobs: &kept[i].example.behaviour_logprobs,
                    learner_logprobs: learner_logprobs.map(|l| l[i].as_slice()),
                    advantage: advantages[i],
                })
                .collect();
            let batch = RlMicroBatch::new(&rows, &cfg.objective.aggregation, totals, &device)?;
            let reference = if need_reference {
                Some(
                    model
                        .forward_train_batch_until(&batch.tokens, self.reference.as_ref(), stop)?
                        .detach(),
                )
            } else {
                None
            };
            let forward = model.forward_train_for_backward_until(
                &batch.tokens,
                Some(adapter),
                cfg.batch.recompute_activations,
                stop,
            )?;
            let out = rl_loss(&cfg.objective, forward.logits(), reference.as_ref(), &batch)?;
            let grads = forward.backward(&out.loss)?;
            self.optimizer.accumulate(&grads)?;
            sums += out.sums;
            for (&row, &lp) in batch.tokens.token_rows.iter().zip(&out.logprobs) {
                logprobs[chunk[row as usize]].push(lp);
            }
        }

        if !share.is_alone() {
            (sums, logprobs) =
                sum_across_replicas(&mut self.optimizer, share, sums, logprobs, &kept)?;
        }

        if let AdvantageEstimator::Reinforce {
            baseline: Baseline::MovingAverage { decay },
        } = cfg.objective.advantage
        {
            for (stratum, idx) in by_key(&strata) {
                let batch_mean = idx.iter().map(|&i| rewards[i]).sum::<f64>() / idx.len() as f64;
                self.moving_baselines
                    .entry(stratum)
                    .and_modify(|b| *b = decay * *b + (1.0 - decay) * batch_mean)
                    .or_insert(batch_mean);
            }
        }

        let n = kept.len() as f64;
        let tokens = sums.tokens as f64;
        let adv_mean = advantages.iter().sum::<f64>() / n;
        let adv_var = advantages
            .iter()
            .map(|a| (a - adv_mean).powi(2))
            .sum::<f64>()
            / n;
        let stats = RlStats {
            loss: sums.loss,
            policy_loss: sums.policy_loss,
            kl: if need_reference {
                sums.kl / tokens
            } else {
                penalty_kl_tokens / tokens
            },
            kl_penalty: kl_penalty_sum / n,
            entropy: sums.entropy / tokens,
            clip_fraction: sums.clipped as f64 / tokens,
            approx_kl: sums.approx_kl / tokens,
            sampler_logprob_diff_mean: sums.sampler_abs_diff / tokens,
            sampler_logprob_diff_max: sums.sampler_max_abs_diff,
            tis_capped_fraction: sums.tis_capped as f64 / tokens,
            ratio_mean: sums.ratio / tokens,
            ratio_var: (sums.ratio_sq / tokens - (sums.ratio / tokens).powi(2)).max(0.0),
            epoch_kl: 0.0,
            reward_mean: raw_rewards.iter().sum::<f64>() / n,
            advantage_mean: adv_mean,
            advantage_std: adv_var.sqrt(),
            mean_seq_len: lens.iter().sum::<usize>() as f64 / n,
            mean_completion_len: tokens / n,
            sequences: kept.len(),
            tokens: sums.tokens,
            truncated: truncation.truncated,
            tokens_cut: truncation.tokens_cut,
            dropped: truncation.dropped,
            grad_norm: 0.0,
            grad_clipped: false,
        };
        Ok((stats, logprobs))
    }

    /// Clips the accumulated gradients and takes the AdamW step.
    pub fn apply_gradients(&mut self) -> TrainResult<StepReport> {
        self.optimizer.step()
    }
}

/// The accumulated gradients, the loss sums and every kept sequence's
/// log-probs (each replica holds those of its micro-batches) summed
/// across the replicas in one all-reduce; the largest sampler gap is
/// the largest of the replicas' (each writes its own slot).
fn sum_across_replicas(
    optimizer: &mut AdamW,
    share: &mut relay_nn::BatchShare<'_>,
    sums: LossSums,
    logprobs: Vec<Vec<f32>>,
    kept: &[Kept<'_>],
) -> TrainResult<(LossSums, Vec<Vec<f32>>)> {
    const FIELDS: usize = 11;
    let lens: Vec<usize> = kept.iter().map(|k| k.example.completion.len()).collect();
    let mut extra = vec![0f32; FIELDS + share.replicas + lens.iter().sum::<usize>()];
    for (slot, x) in extra.iter_mut().zip([
        sums.loss,
        sums.policy_loss,
        sums.tokens as f64,
        sums.kl,
        sums.entropy,
        sums.clipped as f64,
        sums.approx_kl,
        sums.sampler_abs_diff,
        sums.tis_capped as f64,
        sums.ratio,
        sums.ratio_sq,
    ]) {
        *slot = x as f32;
    }
    extra[FIELDS + share.rank] = sums.sampler_max_abs_diff as f32;
    let mut at = FIELDS + share.replicas;
    for (lp, &n) in logprobs.iter().zip(&lens) {
        if lp.len() == n {
            extra[at..at + n].copy_from_slice(lp);
        }
        at += n;
    }
    optimizer.sum_accumulated(share, &mut extra)?;
    let f = |i: usize| f64::from(extra[i]);
    let summed = LossSums {
        loss: f(0),
        policy_loss: f(1),
        tokens: f(2).round() as usize,
        kl: f(3),
        entropy: f(4),
        clipped: f(5).round() as usize,
        approx_kl: f(6),
        sampler_abs_diff: f(7),
        sampler_max_abs_diff: extra[FIELDS..FIELDS + share.replicas]
            .iter()
            .fold(0f64, |m, &x| m.max(f64::from(x))),
        tis_capped: f(8).round() as usize,
        ratio: f(9),
        ratio_sq: f(10),
    };
    let mut at = FIELDS + share.replicas;
    let logprobs = lens
        .iter()
        .map(|&n| {
            let lp = extra[at..at + n].to_vec();
            at += n;
            lp
        })
        .collect();
    Ok((summed, logprobs))
}
