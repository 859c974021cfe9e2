//! The token-level RL objective's hyperparameters (relay-llm's `rl`
//! computes it): advantage estimators and baselines, the policy loss,
//! KL, truncated importance sampling, the loss aggregation, batch shape
//! and truncation, AdamW, and the presets (REINFORCE, RLOO, GRPO,
//! Dr. GRPO, PPO).

use serde::{Deserialize, Serialize};

use crate::check::FieldError;

/// The baseline REINFORCE subtracts from rewards.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum Baseline {
    /// No baseline: `A = r`.
    None,
    /// The batch's mean reward.
    #[default]
    BatchMean,
    /// An exponential moving average of past batch means, one per
    /// [`TokenExample::stratum`] (`b_s ← decay·b_s + (1 − decay)·mean(r_s)`
    /// after each step over the batch's examples of stratum `s`; a
    /// stratum's first batch uses its own mean). Kept by the
    /// [`RlTrainer`]. Unlike group baselines it never vanishes when a
    /// whole group has the same reward (say, every game of the second
    /// seat lost): those moves are still pushed below the average.
    MovingAverage {
        /// Weight of the past, in `[0, 1)`.
        decay: f64,
    },
}

/// How rewards become per-sequence advantages (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum AdvantageEstimator {
    /// `r − b`.
    Reinforce {
        /// Which `b`.
        #[serde(default)]
        baseline: Baseline,
    },
    /// Leave-one-out baseline within each group.
    Rloo,
    /// Group-normalised: `(r − mean_g) / (std_g + eps)`.
    Grpo {
        /// Divide by the group's std (GRPO); `false` only centres (Dr. GRPO).
        scale_by_std: bool,
        /// Added to the std before dividing.
        std_eps: f64,
    },
}

/// Which importance ratio PPO clips.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RatioLevel {
    /// One ratio per token (PPO, GRPO).
    #[default]
    Token,
    /// One ratio per sequence, the geometric mean of its tokens' (GSPO).
    Sequence,
}

/// The per-token surrogate (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum PolicyLoss {
    /// `−A · logp`.
    PolicyGradient,
    /// `−min(ρA, clip(ρ, 1 − clip_low, 1 + clip_high) A)`.
    PpoClip {
        /// `ε_low`, in `[0, 1)`.
        clip_low: f64,
        /// `ε_high`, `>= 0` (DAPO's clip-higher uses 0.28 with 0.2 low).
        clip_high: f64,
        /// Token or sequence ratio.
        #[serde(default)]
        ratio: RatioLevel,
    },
}

/// Estimator of `KL(π ‖ π_ref)` from sampled tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum KlEstimator {
    /// `logp − ref`.
    K1,
    /// `(logp − ref)² / 2`.
    K2,
    /// `exp(ref − logp) − (ref − logp) − 1`.
    K3,
}

/// Where the KL term goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum KlMode {
    /// Added to the loss, with gradient (GRPO).
    Loss,
    /// Subtracted from each sequence's reward before the advantages,
    /// computed with the behaviour log-probs (InstructGPT).
    RewardPenalty,
}

/// KL regularisation towards a reference policy: in text runs the one
/// `rl.kl_reference` names (the run's start by default), else the base
/// model (the model without adapter).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KlConfig {
    /// `β`.
    pub coef: f64,
    /// Which estimator.
    pub estimator: KlEstimator,
    /// Loss term or reward penalty.
    pub mode: KlMode,
}

/// Truncated importance sampling between the sampler and the learner
/// (module docs).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TruncatedIs {
    /// Largest weight `π_learner / π_sampler` a token gets (2 in Yao et
    /// al.; larger keeps more of the correction, with more variance).
    pub cap: f64,
}

/// The RL objective (see the module docs for the formulas).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ObjectiveConfig {
    /// Rewards to advantages.
    pub advantage: AdvantageEstimator,
    /// Per-token surrogate.
    pub policy_loss: PolicyLoss,
    /// Per-token losses to one loss.
    #[serde(default)]
    pub aggregation: Aggregation,
    /// KL towards the reference (see [`KlConfig`]); `None`: no KL term
    /// (and no reference forward).
    #[serde(default)]
    pub kl: Option<KlConfig>,
    /// `c` of the entropy bonus (0: none; entropy is still reported).
    #[serde(default)]
    pub entropy_coef: f64,
    /// Truncated importance sampling against the sampler's log-probs;
    /// `None`: off (the sampler's log-probs are the old policy).
    #[serde(default)]
    pub truncated_is: Option<TruncatedIs>,
}

impl ObjectiveConfig {
    /// REINFORCE with the batch-mean baseline, token mean.
    pub fn reinforce() -> Self {
        Self {
            advantage: AdvantageEstimator::Reinforce {
                baseline: Baseline::BatchMean,
            },
            policy_loss: PolicyLoss::PolicyGradient,
            aggregation: Aggregation::TokenMean,
            kl: None,
            entropy_coef: 0.0,
            truncated_is: None,
        }
    }

    /// RLOO: leave-one-out baseline, policy gradient, token mean.
    pub fn rloo() -> Self {
        Self {
            advantage: AdvantageEstimator::Rloo,
            ..Self::reinforce()
        }
    }

    /// GRPO as in DeepSeekMath: group-normalised advantages, token PPO
    /// clip 0.2, mean per sequence, k3 KL loss with β = 0.04.
    pub fn grpo() -> Self {
        Self {
            advantage: AdvantageEstimator::Grpo {
                scale_by_std: true,
                std_eps: 1e-4,
            },
            policy_loss: PolicyLoss::PpoClip {
                clip_low: 0.2,
                clip_high: 0.2,
                ratio: RatioLevel::Token,
            },
            aggregation: Aggregation::SequenceMean,
            kl: Some(KlConfig {
                coef: 0.04,
                estimator: KlEstimator::K3,
                mode: KlMode::Loss,
            }),
            entropy_coef: 0.0,
            truncated_is: None,
        }
    }

    /// Dr. GRPO: centred (not scaled) group advantages, token PPO clip,
    /// sum over tokens divided by `max_completion_len`, no KL.
    pub fn dr_grpo(max_completion_len: usize) -> Self {
        Self {
            advantage: AdvantageEstimator::Grpo {
                scale_by_std: false,
                std_eps: 0.0,
            },
            aggregation: Aggregation::ConstantLength { max_completion_len },
            kl: None,
            ..Self::grpo()
        }
    }

    /// PPO-clip (0.2) on tokens with the batch-mean baseline (no critic),
    /// token mean.
    pub fn ppo() -> Self {
        Self {
            policy_loss: PolicyLoss::PpoClip {
                clip_low: 0.2,
                clip_high: 0.2,
                ratio: RatioLevel::Token,
            },
            ..Self::reinforce()
        }
    }

    /// Checks every field's range.
    pub fn validate(&self) -> Result<(), FieldError> {
        match self.advantage {
            AdvantageEstimator::Reinforce {
                baseline: Baseline::MovingAverage { decay },
            } if !(0.0..1.0).contains(&decay) => {
                return Err(FieldError::new(
                    "advantage.baseline.decay",
                    "must be in [0, 1)",
                ))
            }
            AdvantageEstimator::Grpo { std_eps, .. }
                if !(std_eps.is_finite() && std_eps >= 0.0) =>
            {
                return Err(FieldError::new(
                    "advantage.std_eps",
                    "must be finite and >= 0",
                ))
            }
            _ => {}
        }
        if let PolicyLoss::PpoClip {
            clip_low,
            clip_high,
            ..
        } = self.policy_loss
        {
            if !(0.0..1.0).contains(&clip_low) {
                return Err(FieldError::new("policy_loss.clip_low", "must be in [0, 1)"));
            }
            if !(clip_high.is_finite() && clip_high >= 0.0) {
                return Err(FieldError::new(
                    "policy_loss.clip_high",
                    "must be finite and >= 0",
                ));
            }
        }
        self.aggregation.validate()?;
        if let Some(kl) = &self.kl {
            if !(kl.coef.is_finite() && kl.coef >= 0.0) {
                return Err(FieldError::new("kl.coef", "must be finite and >= 0"));
            }
        }
        if !self.entropy_coef.is_finite() {
            return Err(FieldError::new("entropy_coef", "must be finite"));
        }
        if let Some(tis) = self.truncated_is {
            if !(tis.cap.is_finite() && tis.cap >= 1.0) {
                return Err(FieldError::new(
                    "truncated_is.cap",
                    format!("must be finite and >= 1, got {}", tis.cap),
                ));
            }
        }
        Ok(())
    }
}

/// Everything a train step needs to know.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RlTrainConfig {
    /// The objective.
    pub objective: ObjectiveConfig,
    /// Batch and micro-batch sizes, truncation.
    pub batch: BatchConfig,
    /// AdamW over the adapter's vars.
    #[serde(default)]
    pub optimizer: AdamWConfig,
}

impl RlTrainConfig {
    /// Checks every part.
    pub fn validate(&self) -> Result<(), FieldError> {
        self.objective.validate()?;
        self.batch.validate()?;
        self.optimizer.validate()
    }
}

/// What to do with a sequence longer than [`BatchConfig::max_seq_len`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Truncation {
    /// Keep the whole completion (the policy's own tokens, the only ones
    /// with a loss) and cut tokens from the start of the prompt; the
    /// last prompt token is always kept. The model then sees less context
    /// than when it sampled, so the recomputed log-probs differ from the
    /// behaviour ones (PPO's ratio absorbs that; REINFORCE does not).
    /// When the completion alone does not fit beside one prompt token,
    /// the sequence is dropped.
    #[default]
    CutPromptStart,
    /// Drop the whole sequence.
    Drop,
}

/// Batch shape of a train step.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BatchConfig {
    /// Most sequences in one optimizer step (what the learner gathers per
    /// step; for group objectives a multiple of the group size). A train
    /// step takes `1..=batch_size` sequences; losses are normalised by the
    /// number actually given.
    pub batch_size: usize,
    /// Sequences per forward/backward pass (micro-batch); gradients of the
    /// micro-batches of one step are summed before the step. Bounds memory;
    /// does not change the result.
    pub minibatch_size: usize,
    /// Longest sequence (prompt plus completion tokens) trained on; longer
    /// ones are cut or dropped as [`BatchConfig::truncation`] says. At most
    /// the model's `max_position_embeddings + 1` (the last token is never
    /// fed).
    pub max_seq_len: usize,
    /// What to do with longer sequences.
    #[serde(default)]
    pub truncation: Truncation,
    /// On the candle backend, keep only each block's input during the
    /// forward and recompute the block in the backward pass (activation
    /// checkpointing): memory for one block's activations (its attention
    /// scores are `time²` per head) instead of every block's, for one more
    /// forward's compute. The same gradients either way. The CPU engine's
    /// fused ops keep small activations of their own and ignore it.
    #[serde(default = "recompute_by_default")]
    pub recompute_activations: bool,
}

fn recompute_by_default() -> bool {
    true
}

impl BatchConfig {
    /// Checks sizes.
    pub fn validate(&self) -> Result<(), FieldError> {
        if self.batch_size == 0 {
            return Err(FieldError::new("batch_size", "must be positive"));
        }
        if self.minibatch_size == 0 {
            return Err(FieldError::new("minibatch_size", "must be positive"));
        }
        if self.max_seq_len < 2 {
            return Err(FieldError::new(
                "max_seq_len",
                "must be at least 2 (one prompt and one completion token)",
            ));
        }
        Ok(())
    }
}

/// How per-token losses `l[i, t]` of an optimizer batch of `N` sequences
/// (sequence `i` with `L_i` completion tokens) add up to one loss.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum Aggregation {
    /// `Σ_i Σ_t l[i,t] / Σ_i L_i`: every token of the batch weighs the
    /// same (DAPO, Yu et al. 2025, arXiv:2503.14476, "token-level loss").
    #[default]
    TokenMean,
    /// `(1/N) Σ_i (1/L_i) Σ_t l[i,t]`: mean per sequence, then over
    /// sequences (GRPO as written in DeepSeekMath, Shao et al. 2024,
    /// arXiv:2402.03300). Tokens of short sequences weigh more.
    SequenceMean,
    /// `(1/(N·M)) Σ_i Σ_t l[i,t]` with a constant `M`: no length
    /// normalisation (Dr. GRPO, Liu et al. 2025, "Understanding R1-Zero-Like
    /// Training", arXiv:2503.20783). `M = 1` is the classic REINFORCE
    /// "sum over tokens, mean over sequences".
    ConstantLength {
        /// `M`: typically the generation budget (max new tokens).
        max_completion_len: usize,
    },
}

/// Whole-batch counts that fix each token's loss weight.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchTotals {
    /// Sequences in the optimizer batch (after dropping).
    pub sequences: usize,
    /// Completion tokens in the optimizer batch.
    pub tokens: usize,
}

impl Aggregation {
    /// Checks the constant.
    pub fn validate(&self) -> Result<(), FieldError> {
        if let Self::ConstantLength {
            max_completion_len: 0,
        } = self
        {
            return Err(FieldError::new(
                "aggregation.max_completion_len",
                "must be positive",
            ));
        }
        Ok(())
    }

    /// The weight of each token of a sequence with `completion_len`
    /// tokens, so that `Σ weight · l` over the batch is the loss.
    pub fn token_weight(&self, completion_len: usize, totals: BatchTotals) -> f64 {
        match *self {
            Self::TokenMean => 1.0 / totals.tokens as f64,
            Self::SequenceMean => 1.0 / (totals.sequences as f64 * completion_len as f64),
            Self::ConstantLength { max_completion_len } => {
                1.0 / (totals.sequences as f64 * max_completion_len as f64)
            }
        }
    }
}

/// Hyperparameters of [`AdamW`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AdamWConfig {
    /// Learning rate.
    pub lr: f64,
    /// Decay of the first-moment (mean) estimate.
    pub beta1: f64,
    /// Decay of the second-moment (uncentred variance) estimate.
    pub beta2: f64,
    /// Added to the square root of the second moment, for stability.
    pub eps: f64,
    /// Decoupled weight decay per step (`θ ← θ − lr·wd·θ`). Default 0, as
    /// in TRL; `candle_nn::ParamsAdamW` and PyTorch default to 0.01. On a
    /// LoRA adapter it pulls the update towards the base model.
    pub weight_decay: f64,
    /// Clip the summed gradient to this global L2 norm before the step
    /// (PyTorch's `clip_grad_norm_`); `None` turns clipping off.
    pub max_grad_norm: Option<f64>,
}

impl Default for AdamWConfig {
    fn default() -> Self {
        Self {
            lr: 1e-4,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
            max_grad_norm: Some(1.0),
        }
    }
}

impl AdamWConfig {
    /// Checks every field's range.
    pub fn validate(&self) -> Result<(), FieldError> {
        if !(self.lr.is_finite() && self.lr >= 0.0) {
            return Err(FieldError::new("lr", "must be finite and >= 0"));
        }
        if !(0.0..1.0).contains(&self.beta1) {
            return Err(FieldError::new("beta1", "must be in [0, 1)"));
        }
        if !(0.0..1.0).contains(&self.beta2) {
            return Err(FieldError::new("beta2", "must be in [0, 1)"));
        }
        if !(self.eps.is_finite() && self.eps > 0.0) {
            return Err(FieldError::new("eps", "must be finite and > 0"));
        }
        if !(self.weight_decay.is_finite() && self.weight_decay >= 0.0) {
            return Err(FieldError::new("weight_decay", "must be finite and >= 0"));
        }
        if let Some(n) = self.max_grad_norm {
            if !(n.is_finite() && n > 0.0) {
                return Err(FieldError::new(
                    "max_grad_norm",
                    "must be finite and > 0 (or absent to turn clipping off)",
                ));
            }
        }
        Ok(())
    }
}
