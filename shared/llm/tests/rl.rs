//! The RL objectives against values computed by hand on a 2-token
//! vocabulary, the masks, the advantage estimators, and train steps of
//! `RlTrainer` on a small random Qwen2 model (`init::tiny_with_shape`).

use std::path::PathBuf;

use candle_core::{DType, Device, Tensor, Var};
use relay_llm::reward::{format_reward, ApplyShaping};
use relay_llm::rl::{
    compute_advantages, kl_estimate, rl_loss, MovingBaselines, RlLoss, RlMicroBatch, RlRow,
    TruncatedIs,
};
use relay_llm::token_batch::{fit_to_length, Fit};
use relay_llm::{
    init, AdvantageEstimator, Aggregation, Baseline, BatchConfig, BatchTotals, CausalLm,
    GameResult, KlConfig, KlEstimator, KlMode, LoraAdapter, LoraConfig, NormalizeConfig,
    ObjectiveConfig, PolicyLoss, RatioLevel, RewardNormalizer, RewardShaping, RlTrainConfig,
    RlTrainer, RunningStats, TinyShape, TinyVocab, TokenBatch, TokenExample, Truncation,
};

mod common;
use common::completion_logprobs;

const TOL: f64 = 1e-5;

fn close(a: f64, b: f64, what: &str) {
    assert!((a - b).abs() < TOL, "{what}: {a} != {b}");
}

fn close_vec(a: &[f32], b: &[f64], what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: lengths");
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert!(
            (f64::from(*x) - y).abs() < TOL,
            "{what}[{i}]: {a:?} != {b:?}"
        );
    }
}

// ---------------------------------------------------------------- advantages

#[test]
fn advantages_by_hand() {
    let reinforce = |baseline| AdvantageEstimator::Reinforce { baseline };
    let rewards = [1.0, 0.0, 0.0, 3.0];
    let groups = [0, 0, 0, 0];
    assert_eq!(
        compute_advantages(
            &reinforce(Baseline::BatchMean),
            &rewards,
            &groups,
            &vec![0; rewards.len()],
            &MovingBaselines::new()
        )
        .unwrap(),
        vec![0.0, -1.0, -1.0, 2.0]
    );
    assert_eq!(
        compute_advantages(
            &reinforce(Baseline::None),
            &rewards,
            &groups,
            &vec![0; rewards.len()],
            &MovingBaselines::new()
        )
        .unwrap(),
        rewards.to_vec()
    );
    let moving = reinforce(Baseline::MovingAverage { decay: 0.9 });
    assert_eq!(
        compute_advantages(&moving, &rewards, &groups, &groups, &[(0, 0.5)].into()).unwrap(),
        vec![0.5, -0.5, -0.5, 2.5]
    );
    // First batch: its own mean.
    assert_eq!(
        compute_advantages(
            &moving,
            &rewards,
            &groups,
            &vec![0; rewards.len()],
            &MovingBaselines::new()
        )
        .unwrap(),
        vec![0.0, -1.0, -1.0, 2.0]
    );

    // Moving averages per stratum: stratum 0 has one, stratum 1 none yet
    // (its own batch mean, 1.5); groups play no part.
    let a = compute_advantages(
        &moving,
        &[1.0, -1.0, 0.0, 3.0],
        &[5, 5, 5, 5],
        &[0, 0, 1, 1],
        &[(0, -0.5)].into(),
    )
    .unwrap();
    assert_eq!(a, vec![1.5, -0.5, -1.5, 1.5]);
    // A stratum whose rewards are all equal still gets non-zero
    // advantages from its average (the second seat losing every game).
    let a = compute_advantages(
        &moving,
        &[-1.0, -1.0],
        &[2, 2],
        &[1, 1],
        &[(1, -0.6)].into(),
    )
    .unwrap();
    for x in a {
        close(x, -0.4, "all losses");
    }

    // Two groups: [1, 0, 0] and [2, 4].
    let rewards = [1.0, 0.0, 2.0, 0.0, 4.0];
    let groups = [7, 7, 9, 7, 9];
    let rloo = compute_advantages(
        &AdvantageEstimator::Rloo,
        &rewards,
        &groups,
        &vec![0; rewards.len()],
        &MovingBaselines::new(),
    )
    .unwrap();
    assert_eq!(rloo, vec![1.0, -0.5, -2.0, -0.5, 2.0]);

    let grpo = |scale_by_std, std_eps| AdvantageEstimator::Grpo {
        scale_by_std,
        std_eps,
    };
    // Group [1, 0, 0]: mean 1/3, sample std sqrt(1/3); group [2, 4]: mean 3, std sqrt(2).
    let a = compute_advantages(
        &grpo(true, 0.0),
        &rewards,
        &groups,
        &vec![0; rewards.len()],
        &MovingBaselines::new(),
    )
    .unwrap();
    let s1 = (1.0f64 / 3.0).sqrt();
    let s2 = 2.0f64.sqrt();
    let expected = [
        (2.0 / 3.0) / s1,
        (-1.0 / 3.0) / s1,
        -1.0 / s2,
        (-1.0 / 3.0) / s1,
        1.0 / s2,
    ];
    for (x, y) in a.iter().zip(expected) {
        close(*x, y, "grpo");
    }
    let a = compute_advantages(
        &grpo(true, 0.5),
        &rewards,
        &groups,
        &vec![0; rewards.len()],
        &MovingBaselines::new(),
    )
    .unwrap();
    close(a[0], (2.0 / 3.0) / (s1 + 0.5), "grpo eps");
    let a = compute_advantages(
        &grpo(false, 0.0),
        &rewards,
        &groups,
        &vec![0; rewards.len()],
        &MovingBaselines::new(),
    )
    .unwrap();
    for (x, y) in a.iter().zip([2.0 / 3.0, -1.0 / 3.0, -1.0, -1.0 / 3.0, 1.0]) {
        close(*x, y, "dr grpo");
    }
}

#[test]
fn equal_rewards_and_singleton_groups_give_exactly_zero_advantages() {
    // 0.1 three times: the mean rounds to 0.10000000000000002.
    let rewards = [0.1, 0.1, 0.1, 5.0];
    let groups = [1, 1, 1, 2];
    for estimator in [
        AdvantageEstimator::Rloo,
        AdvantageEstimator::Grpo {
            scale_by_std: true,
            std_eps: 0.0,
        },
        AdvantageEstimator::Grpo {
            scale_by_std: true,
            std_eps: 1e-4,
        },
        AdvantageEstimator::Grpo {
            scale_by_std: false,
            std_eps: 0.0,
        },
    ] {
        let a = compute_advantages(
            &estimator,
            &rewards,
            &groups,
            &vec![0; rewards.len()],
            &MovingBaselines::new(),
        )
        .unwrap();
        assert_eq!(a, vec![0.0; 4], "{estimator:?}");
    }
    let a = compute_advantages(
        &AdvantageEstimator::Reinforce {
            baseline: Baseline::BatchMean,
        },
        &[0.1, 0.1, 0.1],
        &[0, 1, 2],
        &[0, 0, 0],
        &MovingBaselines::new(),
    )
    .unwrap();
    assert_eq!(a, vec![0.0; 3]);
}

// ------------------------------------------------------- losses by hand
//
// One row: prompt [0], completion [1, 0], vocabulary {0, 1}. The block
// fed is [0, 1] (time 2); position 0 predicts token 1, position 1
// predicts token 0. Logits [0, ln 3] give p(1) = 3/4 at position 0;
// [0, 0] give p(0) = 1/2 at position 1.

fn logits_var() -> Var {
    Var::from_vec(vec![0.0f32, 3f32.ln(), 0.0, 0.0], (1, 2, 2), &Device::Cpu).unwrap()
}

fn one_row_batch(behaviour: &[f32; 2], advantage: f64, aggregation: Aggregation) -> RlMicroBatch {
    RlMicroBatch::new(
        &[RlRow {
            learner_logprobs: None,
            prompt: &[0],
            completion: &[1, 0],
            behaviour_logprobs: behaviour,
            advantage,
        }],
        &aggregation,
        BatchTotals {
            sequences: 1,
            tokens: 2,
        },
        &Device::Cpu,
    )
    .unwrap()
}

fn objective(policy_loss: PolicyLoss) -> ObjectiveConfig {
    ObjectiveConfig {
        policy_loss,
        ..ObjectiveConfig::reinforce()
    }
}

fn ppo(clip_high: f64, ratio: RatioLevel) -> PolicyLoss {
    PolicyLoss::PpoClip {
        clip_low: 0.2,
        clip_high,
        ratio,
    }
}

/// Loss and the gradient on the logits, flattened `(time · vocab)`.
fn loss_and_grad(
    objective: &ObjectiveConfig,
    logits: &Var,
    reference: Option<&Tensor>,
    batch: &RlMicroBatch,
) -> (RlLoss, Vec<f32>) {
    let out = rl_loss(objective, logits.as_tensor(), reference, batch).unwrap();
    let grads = out.loss.backward().unwrap();
    let g = grads
        .get(logits.as_tensor())
        .map(|g| g.flatten_all().unwrap().to_vec1::<f32>().unwrap())
        .unwrap_or_else(|| vec![0.0; logits.elem_count()]);
    (out, g)
}

#[test]
fn policy_gradient_loss_and_gradient_by_hand() {
    let logits = logits_var();
    let batch = one_row_batch(&[-1.0, -1.0], 2.0, Aggregation::TokenMean);
    let (out, g) = loss_and_grad(
        &objective(PolicyLoss::PolicyGradient),
        &logits,
        None,
        &batch,
    );
    // −A · mean(log 3/4, log 1/2)
    let expected = -2.0 * (0.75f64.ln() + 0.5f64.ln()) / 2.0;
    close(out.sums.loss, expected, "loss");
    close(out.sums.policy_loss, expected, "policy loss");
    // d/dz = −A·w·(onehot − p): position 0 (target 1, p = [1/4, 3/4]),
    // position 1 (target 0, p = [1/2, 1/2]).
    close_vec(&g, &[0.25, -0.25, -0.5, 0.5], "gradient");
    // Exact entropies: H(1/4, 3/4) and ln 2.
    let h0 = -(0.25f64 * 0.25f64.ln() + 0.75 * 0.75f64.ln());
    close(out.sums.entropy, h0 + 2f64.ln(), "entropy");
    assert_eq!(out.sums.tokens, 2);
    assert_eq!(out.sums.clipped, 0);
    // approx KL with ρ = (3/4)/e^-1 and (1/2)/e^-1.
    let ak = |p: f64| {
        let lr = p.ln() + 1.0;
        lr.exp() - 1.0 - lr
    };
    close(out.sums.approx_kl, ak(0.75) + ak(0.5), "approx kl");

    // A negative advantage flips the gradient.
    let batch = one_row_batch(&[-1.0, -1.0], -1.0, Aggregation::TokenMean);
    let (_, g) = loss_and_grad(
        &objective(PolicyLoss::PolicyGradient),
        &logits,
        None,
        &batch,
    );
    close_vec(&g, &[-0.125, 0.125, 0.25, -0.25], "gradient, A = -1");
}

#[test]
fn ppo_clip_token_ratio_by_hand() {
    let logits = logits_var();
    // Behaviour p = 1/2 for both tokens: ρ0 = 1.5, ρ1 = 1.
    let old = [0.5f32.ln(), 0.5f32.ln()];

    // A = 2 > 0 and ρ0 > 1.2: token 0 is clipped (constant −1.2·A, no gradient).
    let batch = one_row_batch(&old, 2.0, Aggregation::TokenMean);
    let (out, g) = loss_and_grad(
        &objective(ppo(0.2, RatioLevel::Token)),
        &logits,
        None,
        &batch,
    );
    close(out.sums.loss, 0.5 * (-1.2 * 2.0) + 0.5 * (-2.0), "loss");
    assert_eq!(out.sums.clipped, 1);
    // Token 1 at ρ = 1: the policy-gradient gradient.
    close_vec(&g, &[0.0, 0.0, -0.5, 0.5], "gradient");

    // A = −1 < 0: ρ0 = 1.5 is not clipped from above; −ρA with gradient
    // −A·w·ρ·(onehot − p).
    let batch = one_row_batch(&old, -1.0, Aggregation::TokenMean);
    let (out, g) = loss_and_grad(
        &objective(ppo(0.2, RatioLevel::Token)),
        &logits,
        None,
        &batch,
    );
    close(out.sums.loss, 0.5 * 1.5 + 0.5 * 1.0, "loss, A < 0");
    assert_eq!(out.sums.clipped, 0);
    close_vec(&g, &[-0.1875, 0.1875, 0.25, -0.25], "gradient, A < 0");

    // Below the range with A < 0: clipped at 0.8.
    let old_low = [0.99f32.ln(), 0.5f32.ln()]; // ρ0 = 0.7576 < 0.8
    let batch = one_row_batch(&old_low, -1.0, Aggregation::TokenMean);
    let (out, g) = loss_and_grad(
        &objective(ppo(0.2, RatioLevel::Token)),
        &logits,
        None,
        &batch,
    );
    close(out.sums.loss, 0.5 * 0.8 + 0.5 * 1.0, "loss, clipped below");
    assert_eq!(out.sums.clipped, 1);
    close_vec(&g, &[0.0, 0.0, 0.25, -0.25], "gradient, clipped below");
}

#[test]
fn truncated_importance_sampling_by_hand() {
    let logits = logits_var();
    // Learner p = [3/4, 1/2], sampler p = [1/2, 1/2]: π_learner/π_sampler
    // = [1.5, 1], capped at 1.2 → weights [1.2, 1].
    let sampler = [0.5f32.ln(), 0.5f32.ln()];
    let tis = |policy_loss| ObjectiveConfig {
        truncated_is: Some(TruncatedIs { cap: 1.2 }),
        ..objective(policy_loss)
    };
    let batch = one_row_batch(&sampler, 2.0, Aggregation::TokenMean);
    let (out, g) = loss_and_grad(&tis(PolicyLoss::PolicyGradient), &logits, None, &batch);
    close(
        out.sums.loss,
        -2.0 * (1.2 * 0.75f64.ln() + 0.5f64.ln()) / 2.0,
        "weighted policy-gradient loss",
    );
    assert_eq!(out.sums.tis_capped, 1);
    close(out.sums.sampler_abs_diff, 1.5f64.ln(), "mismatch sum");
    close(out.sums.sampler_max_abs_diff, 1.5f64.ln(), "mismatch max");
    // The weight is a constant: −A·w·tis·(onehot − p).
    let weighted = [0.3, -0.3, -0.5, 0.5];
    close_vec(&g, &weighted, "weighted gradient");

    // PPO in the first epoch: the ratio is to the learner's own log-probs
    // (1, so nothing is clipped, where the sampler's ratio 1.5 would be).
    let (out, g) = loss_and_grad(&tis(ppo(0.2, RatioLevel::Token)), &logits, None, &batch);
    close(out.sums.loss, -(1.2 + 1.0), "ppo loss, first epoch");
    assert_eq!(out.sums.clipped, 0);
    close_vec(&g, &weighted, "ppo gradient, first epoch");

    // A later epoch: the learner's first-epoch log-probs were the
    // sampler's (weights 1), and the policy has since moved to [3/4, 1/2]:
    // token 0's ratio 1.5 is clipped, as PPO without the weights.
    let batch = RlMicroBatch::new(
        &[RlRow {
            learner_logprobs: Some(&sampler),
            prompt: &[0],
            completion: &[1, 0],
            behaviour_logprobs: &sampler,
            advantage: 2.0,
        }],
        &Aggregation::TokenMean,
        BatchTotals {
            sequences: 1,
            tokens: 2,
        },
        &Device::Cpu,
    )
    .unwrap();
    let (out, g) = loss_and_grad(&tis(ppo(0.2, RatioLevel::Token)), &logits, None, &batch);
    close(
        out.sums.loss,
        0.5 * (-1.2 * 2.0) + 0.5 * (-2.0),
        "ppo loss, later epoch",
    );
    assert_eq!((out.sums.clipped, out.sums.tis_capped), (1, 0));
    close(out.sums.sampler_abs_diff, 0.0, "no mismatch");
    close_vec(&g, &[0.0, 0.0, -0.5, 0.5], "ppo gradient, later epoch");

    // Off: today's behaviour, the mismatch still measured.
    let batch = one_row_batch(&sampler, 2.0, Aggregation::TokenMean);
    let (out, _) = loss_and_grad(
        &objective(ppo(0.2, RatioLevel::Token)),
        &logits,
        None,
        &batch,
    );
    assert_eq!((out.sums.clipped, out.sums.tis_capped), (1, 0));
    close(out.sums.sampler_max_abs_diff, 1.5f64.ln(), "mismatch, off");

    // A cap below 1 is refused by name.
    let mut bad = tis(PolicyLoss::PolicyGradient);
    bad.truncated_is = Some(TruncatedIs { cap: 0.5 });
    let err = bad.validate().unwrap_err().to_string();
    assert!(err.contains("truncated_is.cap"), "{err}");
}

#[test]
fn ppo_clip_sequence_ratio_by_hand() {
    let logits = logits_var();
    let old = [0.5f32.ln(), 0.5f32.ln()];
    // Sequence ratio: exp(mean(ln 1.5, 0)) = sqrt(1.5) = 1.2247 > 1.2: all clipped.
    let batch = one_row_batch(&old, 2.0, Aggregation::TokenMean);
    let (out, g) = loss_and_grad(
        &objective(ppo(0.2, RatioLevel::Sequence)),
        &logits,
        None,
        &batch,
    );
    close(out.sums.loss, -1.2 * 2.0, "clipped loss");
    assert_eq!(out.sums.clipped, 2);
    close_vec(&g, &[0.0; 4], "clipped gradient");

    // Clip 0.3: inside. Loss −A·ρ; ∂/∂logp_t = −A·ρ/2 for each token.
    let (out, g) = loss_and_grad(
        &objective(ppo(0.3, RatioLevel::Sequence)),
        &logits,
        None,
        &batch,
    );
    let rho = 1.5f64.sqrt();
    close(out.sums.loss, -2.0 * rho, "loss");
    let d = -2.0 * rho / 2.0;
    close_vec(&g, &[d * -0.25, d * 0.25, d * 0.5, d * -0.5], "gradient");
}

#[test]
fn kl_estimators_and_kl_loss_by_hand() {
    let logp = Tensor::new(&[0.75f32.ln(), 0.5f32.ln()], &Device::Cpu).unwrap();
    let reference = Tensor::new(&[0.5f32.ln(), 0.5f32.ln()], &Device::Cpu).unwrap();
    let d = (2.0f64 / 3.0).ln(); // ref − logp at token 0
    let values = |e| {
        kl_estimate(e, &logp, &reference)
            .unwrap()
            .to_vec1::<f32>()
            .unwrap()
    };
    close_vec(&values(KlEstimator::K1), &[-d, 0.0], "k1");
    close_vec(&values(KlEstimator::K2), &[0.5 * d * d, 0.0], "k2");
    close_vec(&values(KlEstimator::K3), &[d.exp() - d - 1.0, 0.0], "k3");

    // As a loss, A = 0 so only the KL term is left: β·Σ w·k3. The
    // reference logits give p_ref(1) = 1/2 at position 0, as the policy at
    // position 1.
    let logits = logits_var();
    let ref_logits = Tensor::zeros((1, 2, 2), DType::F32, &Device::Cpu).unwrap();
    let batch = one_row_batch(&[-1.0, -1.0], 0.0, Aggregation::TokenMean);
    let mut config = objective(PolicyLoss::PolicyGradient);
    config.kl = Some(KlConfig {
        coef: 0.5,
        estimator: KlEstimator::K3,
        mode: KlMode::Loss,
    });
    let (out, g) = loss_and_grad(&config, &logits, Some(&ref_logits), &batch);
    close(out.sums.loss, 0.5 * 0.5 * (d.exp() - d - 1.0), "kl loss");
    close(out.sums.kl, d.exp() - d - 1.0, "kl sum");
    // ∂k3/∂logp = 1 − exp(ref − logp) = 1/3 at token 0: descent lowers
    // logp(1) towards the reference; token 1 already agrees.
    let c = 0.5 * 0.5 * (1.0 / 3.0);
    close_vec(&g, &[c * -0.25, c * 0.25, 0.0, 0.0], "kl gradient");

    // Identical logits: exactly zero for every estimator.
    for estimator in [KlEstimator::K1, KlEstimator::K2, KlEstimator::K3] {
        config.kl.as_mut().unwrap().estimator = estimator;
        let out = rl_loss(
            &config,
            logits.as_tensor(),
            Some(&logits.as_tensor().detach()),
            &batch,
        )
        .unwrap();
        assert_eq!(out.sums.kl, 0.0, "{estimator:?}");
        assert_eq!(out.sums.loss, 0.0, "{estimator:?}");
    }
}

#[test]
fn entropy_bonus_gradient_raises_entropy() {
    let logits = logits_var();
    let batch = one_row_batch(&[-1.0, -1.0], 0.0, Aggregation::TokenMean);
    let mut config = objective(PolicyLoss::PolicyGradient);
    config.entropy_coef = 0.1;
    let (out, g) = loss_and_grad(&config, &logits, None, &batch);
    let h0 = -(0.25f64 * 0.25f64.ln() + 0.75 * 0.75f64.ln());
    close(out.sums.loss, -0.1 * 0.5 * (h0 + 2f64.ln()), "loss");
    // Position 0 is skewed towards token 1: descent moves it back
    // (positive gradient on token 1's logit); position 1 is at maximum
    // entropy (zero gradient).
    assert!(g[1] > 0.0 && g[0] < 0.0, "{g:?}");
    close_vec(&g[2..], &[0.0, 0.0], "uniform position");
}

#[test]
fn aggregation_weights_by_hand() {
    let totals = BatchTotals {
        sequences: 2,
        tokens: 4,
    };
    assert_eq!(Aggregation::TokenMean.token_weight(1, totals), 0.25);
    assert_eq!(Aggregation::TokenMean.token_weight(3, totals), 0.25);
    assert_eq!(Aggregation::SequenceMean.token_weight(1, totals), 0.5);
    assert_eq!(Aggregation::SequenceMean.token_weight(3, totals), 1.0 / 6.0);
    let constant = Aggregation::ConstantLength {
        max_completion_len: 4,
    };
    assert_eq!(constant.token_weight(1, totals), 0.125);
    assert_eq!(constant.token_weight(3, totals), 0.125);
}

// ------------------------------------------------------------- masks

/// Two rows of different lengths over a 3-token vocabulary: row 0 =
/// prompt [1], completion [2] (then padding); row 1 = prompt [0, 1, 1],
/// completion [0]. Positions with a loss: row 0 position 0, row 1
/// position 2.
fn masked_rows() -> Vec<(Vec<u32>, Vec<u32>, Vec<f32>)> {
    vec![
        (vec![1], vec![2], vec![-1.2]),
        (vec![0, 1, 1], vec![0], vec![-0.7]),
    ]
}

#[test]
fn token_batch_layout_and_loss_mask() {
    let rows = masked_rows();
    let pairs: Vec<(&[u32], &[u32])> = rows
        .iter()
        .map(|(p, c, _)| (p.as_slice(), c.as_slice()))
        .collect();
    let batch = TokenBatch::new(&pairs, &Device::Cpu).unwrap();
    assert_eq!(
        batch.input_ids.to_vec2::<u32>().unwrap(),
        vec![vec![1, 0, 0], vec![0, 1, 1]]
    );
    assert_eq!(
        batch.loss_mask.to_vec2::<f32>().unwrap(),
        vec![vec![1.0, 0.0, 0.0], vec![0.0, 0.0, 1.0]]
    );
    assert_eq!(batch.targets.to_vec1::<u32>().unwrap(), vec![2, 0]);
    assert_eq!(batch.positions.to_vec1::<u32>().unwrap(), vec![0, 5]);
    assert_eq!(batch.completion_lens, vec![1, 1]);
    assert_eq!(batch.seq_lens, vec![2, 4]);
    assert!(TokenBatch::new(&[(&[], &[1])], &Device::Cpu).is_err());
    assert!(TokenBatch::new(&[(&[1], &[])], &Device::Cpu).is_err());
}

#[test]
fn masked_positions_do_not_change_the_loss_or_get_gradient() {
    let rows = masked_rows();
    let rl_rows: Vec<RlRow> = rows
        .iter()
        .zip([1.5, -0.5])
        .map(|((p, c, b), advantage)| RlRow {
            learner_logprobs: None,
            prompt: p,
            completion: c,
            behaviour_logprobs: b,
            advantage,
        })
        .collect();
    let totals = BatchTotals {
        sequences: 2,
        tokens: 2,
    };
    let batch =
        RlMicroBatch::new(&rl_rows, &Aggregation::SequenceMean, totals, &Device::Cpu).unwrap();
    let mut config = objective(ppo(0.2, RatioLevel::Token));
    config.kl = Some(KlConfig {
        coef: 0.3,
        estimator: KlEstimator::K3,
        mode: KlMode::Loss,
    });
    config.entropy_coef = 0.05;
    let base: Vec<f32> = (0..18).map(|i| ((i * 7 % 11) as f32 - 5.0) * 0.3).collect();
    let reference = Tensor::from_vec(
        (0..18)
            .map(|i| ((i * 5 % 7) as f32 - 3.0) * 0.2)
            .collect::<Vec<_>>(),
        (2, 3, 3),
        &Device::Cpu,
    )
    .unwrap();
    let run = |values: Vec<f32>, reference: &Tensor| {
        let logits = Var::from_vec(values, (2, 3, 3), &Device::Cpu).unwrap();
        loss_and_grad(&config, &logits, Some(reference), &batch)
    };
    let (out, grad) = run(base.clone(), &reference);
    // Flat (row, position) slots without a loss: row 0 positions 1, 2; row 1 positions 0, 1.
    let masked_slots = [1usize, 2, 3, 4];
    for slot in 0..6 {
        let g = &grad[slot * 3..slot * 3 + 3];
        if masked_slots.contains(&slot) {
            assert_eq!(g, [0.0; 3], "slot {slot} got a gradient");
        } else {
            assert!(g.iter().any(|x| *x != 0.0), "slot {slot} got no gradient");
        }
    }
    // Any change to masked positions, in the policy's or the reference's
    // logits, leaves the loss bit-for-bit the same.
    let mut changed = base.clone();
    let mut changed_ref = reference.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    for slot in masked_slots {
        for v in 0..3 {
            changed[slot * 3 + v] += 4.0 * (v as f32 + 1.0);
            changed_ref[slot * 3 + v] -= 2.0;
        }
    }
    let changed_ref = Tensor::from_vec(changed_ref, (2, 3, 3), &Device::Cpu).unwrap();
    let (out2, _) = run(changed, &changed_ref);
    assert_eq!(out.sums, out2.sums);
    // A change at an unmasked position does change it.
    let mut moved = base;
    moved[0] += 1.0;
    let (out3, _) = run(moved, &reference);
    assert_ne!(out.sums.loss, out3.sums.loss);
}

#[test]
fn equal_rewards_in_a_group_give_zero_policy_gradient() {
    let rewards = [0.1, 0.1, 0.1];
    let estimator = ObjectiveConfig::grpo().advantage;
    let advantages = compute_advantages(
        &estimator,
        &rewards,
        &[3, 3, 3],
        &vec![0; rewards.len()],
        &MovingBaselines::new(),
    )
    .unwrap();
    let completions: [&[u32]; 3] = [&[1, 0], &[0], &[1, 1]];
    let behaviour: [&[f32]; 3] = [&[-0.3, -1.0], &[-0.2], &[-0.6, -0.9]];
    let rows: Vec<RlRow> = (0..3)
        .map(|i| RlRow {
            learner_logprobs: None,
            prompt: &[0],
            completion: completions[i],
            behaviour_logprobs: behaviour[i],
            advantage: advantages[i],
        })
        .collect();
    let batch = RlMicroBatch::new(
        &rows,
        &Aggregation::SequenceMean,
        BatchTotals {
            sequences: 3,
            tokens: 5,
        },
        &Device::Cpu,
    )
    .unwrap();
    let mut config = ObjectiveConfig::grpo();
    config.kl = None;
    let logits = Var::from_vec(
        (0..12).map(|i| (i as f32 * 0.37).sin()).collect(),
        (3, 2, 2),
        &Device::Cpu,
    )
    .unwrap();
    let (out, g) = loss_and_grad(&config, &logits, None, &batch);
    assert_eq!(out.sums.policy_loss, 0.0);
    assert!(g.iter().all(|x| *x == 0.0), "{g:?}");
    assert!(g.iter().all(|x| x.is_finite()));
}

#[test]
fn micro_batch_losses_sum_to_the_batch_loss() {
    let rows = masked_rows();
    let rl_rows: Vec<RlRow> = rows
        .iter()
        .zip([1.5, -0.5])
        .map(|((p, c, b), advantage)| RlRow {
            learner_logprobs: None,
            prompt: p,
            completion: c,
            behaviour_logprobs: b,
            advantage,
        })
        .collect();
    let totals = BatchTotals {
        sequences: 2,
        tokens: 2,
    };
    let config = objective(ppo(0.2, RatioLevel::Token));
    let values: Vec<f32> = (0..18).map(|i| (i as f32 * 0.71).cos()).collect();
    let whole = Tensor::from_vec(values, (2, 3, 3), &Device::Cpu).unwrap();
    let agg = Aggregation::SequenceMean;
    let full = RlMicroBatch::new(&rl_rows, &agg, totals, &Device::Cpu).unwrap();
    let full = rl_loss(&config, &whole, None, &full).unwrap().sums.loss;
    let first = RlMicroBatch::new(&rl_rows[..1], &agg, totals, &Device::Cpu).unwrap();
    let second = RlMicroBatch::new(&rl_rows[1..], &agg, totals, &Device::Cpu).unwrap();
    // Row 0 alone is fed with time 1; row 1 alone with time 3.
    let l0 = rl_loss(
        &config,
        &whole.narrow(0, 0, 1).unwrap().narrow(1, 0, 1).unwrap(),
        None,
        &first,
    )
    .unwrap()
    .sums
    .loss;
    let l1 = rl_loss(&config, &whole.narrow(0, 1, 1).unwrap(), None, &second)
        .unwrap()
        .sums
        .loss;
    close(l0 + l1, full, "sum of micro-batches");
}

#[test]
fn truncation_keeps_the_completion() {
    assert_eq!(
        fit_to_length(5, 3, 10, Truncation::CutPromptStart),
        Fit::Keep { prompt_start: 0 }
    );
    assert_eq!(
        fit_to_length(9, 3, 10, Truncation::CutPromptStart),
        Fit::Keep { prompt_start: 2 }
    );
    assert_eq!(fit_to_length(9, 3, 10, Truncation::Drop), Fit::Drop);
    // The completion must fit beside one prompt token.
    assert_eq!(
        fit_to_length(4, 9, 10, Truncation::CutPromptStart),
        Fit::Keep { prompt_start: 3 }
    );
    assert_eq!(
        fit_to_length(4, 10, 10, Truncation::CutPromptStart),
        Fit::Drop
    );
}

#[test]
fn configs_round_trip_through_json() {
    for objective in [
        ObjectiveConfig::reinforce(),
        ObjectiveConfig::rloo(),
        ObjectiveConfig::grpo(),
        ObjectiveConfig::dr_grpo(256),
        ObjectiveConfig::ppo(),
    ] {
        objective.validate().unwrap();
        let json = serde_json::to_string(&objective).unwrap();
        let back: ObjectiveConfig = serde_json::from_str(&json).unwrap();
        assert_eq!(back, objective, "{json}");
    }
    let config: RlTrainConfig = serde_json::from_str(
        r#"{
            "objective": {
                "advantage": {"kind": "grpo", "scale_by_std": false, "std_eps": 0.0},
                "policy_loss": {"kind": "ppo_clip", "clip_low": 0.2, "clip_high": 0.28, "ratio": "sequence"},
                "aggregation": {"kind": "constant_length", "max_completion_len": 64},
                "kl": {"coef": 0.01, "estimator": "k3", "mode": "reward_penalty"}
            },
            "batch": {"batch_size": 8, "minibatch_size": 2, "max_seq_len": 512},
            "optimizer": {"lr": 1e-5, "max_grad_norm": null}
        }"#,
    )
    .unwrap();
    config.validate().unwrap();
    assert_eq!(config.batch.truncation, Truncation::CutPromptStart);
    assert_eq!(config.optimizer.weight_decay, 0.0);
    assert!(config.optimizer.max_grad_norm.is_none());
    let bad = r#"{"advantage": {"kind": "rloo"}, "policy_loss": {"kind": "policy_gradient"}, "entropy": 1}"#;
    assert!(serde_json::from_str::<ObjectiveConfig>(bad).is_err());
    let mut bad = ObjectiveConfig::ppo();
    bad.policy_loss = ppo(-0.1, RatioLevel::Token);
    assert!(bad.validate().is_err());
}

// ------------------------------------------------------ the tiny model

struct TempDir(PathBuf);

impl TempDir {
    fn new(name: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("relay-llm-rl-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        Self(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn small_model(name: &str) -> CausalLm {
    let dir = TempDir::new(name);
    let vocab = TinyVocab {
        size: 64,
        bos_token_id: None,
        eos_token_id: Some(2),
        pad_token_id: Some(0),
    };
    let shape = TinyShape {
        hidden_size: 64,
        intermediate_size: 128,
        num_hidden_layers: 2,
        num_attention_heads: 4,
        num_key_value_heads: 2,
        max_position_embeddings: 128,
        ..TinyShape::default()
    };
    init::tiny_with_shape(&dir.0, 5, &vocab, &shape).unwrap();
    CausalLm::load_hf(&dir.0).unwrap()
}

fn example(
    model: &CausalLm,
    adapter: &LoraAdapter,
    prompt: &[u32],
    completion: &[u32],
    reward: f64,
    group: u64,
) -> TokenExample {
    TokenExample {
        prompt: prompt.to_vec(),
        completion: completion.to_vec(),
        behaviour_logprobs: completion_logprobs(model, Some(adapter), prompt, completion),
        reward,
        group,
        stratum: 0,
    }
}

fn train_config(
    objective: ObjectiveConfig,
    batch_size: usize,
    minibatch_size: usize,
) -> RlTrainConfig {
    RlTrainConfig {
        objective,
        batch: BatchConfig {
            batch_size,
            minibatch_size,
            max_seq_len: 64,
            truncation: Truncation::CutPromptStart,
            recompute_activations: true,
        },
        optimizer: relay_llm::AdamWConfig {
            lr: 1e-2,
            ..Default::default()
        },
    }
}

const GOOD: [u32; 3] = [10, 11, 2];
const BAD: [u32; 3] = [20, 21, 2];
const PROMPT: [u32; 5] = [1, 5, 6, 7, 8];

fn toy_batch(model: &CausalLm, adapter: &LoraAdapter) -> Vec<TokenExample> {
    vec![
        example(model, adapter, &PROMPT, &GOOD, 1.0, 0),
        example(model, adapter, &PROMPT, &BAD, 0.0, 0),
        example(model, adapter, &PROMPT, &GOOD, 1.0, 0),
        example(model, adapter, &PROMPT, &BAD, 0.0, 0),
        example(model, adapter, &[1, 9, 9], &[12, 2], 0.5, 1),
        example(model, adapter, &[1, 9, 9], &[13, 2], 0.5, 1),
    ]
}

#[test]
fn kl_to_the_base_is_exactly_zero_with_a_fresh_adapter() {
    let model = small_model("kl-zero");
    let adapter = LoraAdapter::new(model.config(), LoraConfig::all_projections(4, 8.0), 1).unwrap();
    for estimator in [KlEstimator::K1, KlEstimator::K2, KlEstimator::K3] {
        let mut objective = ObjectiveConfig::grpo();
        objective.kl.as_mut().unwrap().estimator = estimator;
        let mut trainer = RlTrainer::new(train_config(objective, 6, 4), &adapter).unwrap();
        let stats = trainer
            .accumulate_gradients(&model, &adapter, &toy_batch(&model, &adapter))
            .unwrap();
        assert_eq!(stats.kl, 0.0, "{estimator:?}");
        // The behaviour log-probs are the current policy's: ratio 1.
        assert!(stats.approx_kl.abs() < 1e-6, "{}", stats.approx_kl);
        assert_eq!(stats.clip_fraction, 0.0);
    }
}

#[test]
fn kl_to_a_reference_adapter_measures_from_the_warm_start() {
    // A warm start: an adapter one step away from the base.
    let model = small_model("kl-reference");
    let adapter = LoraAdapter::new(model.config(), LoraConfig::all_projections(4, 8.0), 6).unwrap();
    let mut warm = RlTrainer::new(train_config(ObjectiveConfig::rloo(), 6, 4), &adapter).unwrap();
    warm.train_step(&model, &adapter, &toy_batch(&model, &adapter))
        .unwrap();
    for mode in [KlMode::Loss, KlMode::RewardPenalty] {
        // Sampled by the adapter as it is now (each mode trains it on).
        let batch = toy_batch(&model, &adapter);
        let mut objective = ObjectiveConfig::grpo();
        objective.kl.as_mut().unwrap().mode = mode;
        let config = train_config(objective, 6, 4);
        // Against the base model the warm start is already away from it.
        let mut trainer = RlTrainer::new(config.clone(), &adapter).unwrap();
        let stats = trainer
            .accumulate_gradients(&model, &adapter, &batch)
            .unwrap();
        assert!(stats.kl > 1e-6, "{mode:?}: {}", stats.kl);
        // Against a frozen copy of the warm start it starts at exactly 0,
        // and the copy stays where it was while the adapter trains.
        let mut trainer = RlTrainer::new(config, &adapter).unwrap();
        let reference = adapter.deep_copy().unwrap();
        assert!(trainer.set_reference(Some(adapter.clone())).is_err());
        trainer.set_reference(Some(reference.clone())).unwrap();
        let first = trainer.train_step(&model, &adapter, &batch).unwrap();
        assert!(first.kl.abs() < 1e-6, "{mode:?}: {}", first.kl);
        if mode == KlMode::Loss {
            // (A reward penalty reads the behaviour log-probs, which stay.)
            let second = trainer
                .accumulate_gradients(&model, &adapter, &batch)
                .unwrap();
            assert!(second.kl > 1e-6, "{}", second.kl);
        }
        let frozen = completion_logprobs(&model, Some(&reference), &PROMPT, &GOOD);
        let started =
            completion_logprobs(&model, Some(&adapter.deep_copy().unwrap()), &PROMPT, &GOOD);
        assert_ne!(
            frozen, started,
            "{mode:?}: the reference moved with the adapter"
        );
        assert_eq!(
            frozen,
            completion_logprobs(&model, Some(trainer.reference().unwrap()), &PROMPT, &GOOD)
        );
    }
}

#[test]
fn every_lora_factor_gets_a_gradient_after_one_step() {
    // One RL update on the CPU engine and on the candle backend.
    let candle = relay_llm::Backend::Candle {
        device: candle_core::Device::Cpu,
        dtype: candle_core::DType::F32,
    };
    for backend in [relay_llm::Backend::Engine, candle] {
        let model = small_model("all-grads").to_backend(backend).unwrap();
        let adapter =
            LoraAdapter::new(model.config(), LoraConfig::all_projections(4, 8.0), 2).unwrap();
        let adapter = model.place_adapter(&adapter).unwrap();
        let mut trainer =
            RlTrainer::new(train_config(ObjectiveConfig::grpo(), 6, 2), &adapter).unwrap();
        let batch = toy_batch(&model, &adapter);
        let stats = trainer.train_step(&model, &adapter, &batch).unwrap();
        assert!(stats.grad_norm > 0.0);
        assert_eq!(trainer.optimizer().steps(), 1);
        // B moved away from zero, so A now gets a gradient too.
        trainer
            .accumulate_gradients(&model, &adapter, &batch)
            .unwrap();
        let mut count = 0;
        for (name, grad) in trainer.optimizer().accumulated_grads() {
            let grad = grad.unwrap_or_else(|| panic!("{name}: no gradient"));
            let norm = grad
                .sqr()
                .unwrap()
                .sum_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap();
            assert!(norm > 0.0, "{name}: zero gradient");
            count += 1;
        }
        assert_eq!(count, adapter.vars().len());
        assert_eq!(count, 2 * 7 * model.config().num_hidden_layers);
    }
}

#[test]
fn epochs_measure_the_sampler_mismatch_against_the_first_epoch() {
    let model = small_model("mismatch");
    let adapter = LoraAdapter::new(model.config(), LoraConfig::all_projections(4, 8.0), 4).unwrap();
    let mut batch = toy_batch(&model, &adapter);
    // The sampler saw every token 0.1 nats less likely than the learner.
    for e in &mut batch {
        for lp in &mut e.behaviour_logprobs {
            *lp -= 0.1;
        }
    }
    let mut objective = ObjectiveConfig::grpo();
    objective.truncated_is = Some(TruncatedIs { cap: 2.0 });
    let mut trainer = RlTrainer::new(train_config(objective, 6, 4), &adapter).unwrap();
    let steps = trainer.train_epochs(&model, &adapter, &batch, 3).unwrap();
    assert_eq!(steps.len(), 3);
    assert_eq!(trainer.optimizer().steps(), 3);
    for (epoch, s) in steps.iter().enumerate() {
        // Every epoch compares the first epoch's log-probs, not the moved policy's.
        assert!(
            (s.sampler_logprob_diff_mean - 0.1).abs() < 1e-4,
            "epoch {epoch}: {s:?}"
        );
        assert!(
            (s.sampler_logprob_diff_max - 0.1).abs() < 1e-4,
            "epoch {epoch}: {s:?}"
        );
        assert_eq!(s.tis_capped_fraction, 0.0);
    }
    // The first epoch's ratio to the learner's own log-probs is 1: no clip.
    assert_eq!(steps[0].clip_fraction, 0.0);
    assert!((steps[0].ratio_mean - 1.0).abs() < 1e-6 && steps[0].ratio_var < 1e-9);
    assert!(steps.iter().all(|s| s.grad_norm > 0.0));
    // Each later epoch measures how far the step before it moved the policy.
    assert_eq!(steps[0].epoch_kl, 0.0);
    for s in &steps[1..] {
        assert!(s.epoch_kl > 0.0 && s.epoch_kl.is_finite(), "{s:?}");
        assert!(s.ratio_var > 0.0, "the policy moved: {s:?}");
    }
}

#[test]
fn ratio_statistics_by_hand() {
    // The ratios to the sampler's log-probs, on a policy-gradient loss.
    let behaviour = [-0.2f32, 0.2];
    let (var, batch) = (
        logits_var(),
        one_row_batch(&behaviour, 1.0, Aggregation::TokenMean),
    );
    let out = rl_loss(
        &objective(PolicyLoss::PolicyGradient),
        var.as_tensor(),
        None,
        &batch,
    )
    .unwrap();
    let ratios: Vec<f64> = out
        .logprobs
        .iter()
        .zip(&behaviour)
        .map(|(lp, old)| f64::from(lp - old).exp())
        .collect();
    let n = ratios.len() as f64;
    let mean = ratios.iter().sum::<f64>() / n;
    close(out.sums.ratio / n, mean, "ratio mean");
    close(
        out.sums.ratio_sq / n - mean * mean,
        ratios.iter().map(|r| (r - mean).powi(2)).sum::<f64>() / n,
        "ratio variance",
    );
}

#[test]
fn gradient_accumulation_matches_one_big_batch() {
    let model = small_model("accumulate");
    let adapter = LoraAdapter::new(model.config(), LoraConfig::all_projections(4, 8.0), 3).unwrap();
    for (_, v) in adapter.named_vars() {
        let noise = Tensor::randn(0f32, 0.05, v.shape(), &Device::Cpu).unwrap();
        v.set(&noise).unwrap();
    }
    let batch = toy_batch(&model, &adapter);
    let mut objective = ObjectiveConfig::grpo();
    objective.entropy_coef = 0.01;
    let grads = |minibatch| {
        let mut trainer =
            RlTrainer::new(train_config(objective.clone(), 6, minibatch), &adapter).unwrap();
        let stats = trainer
            .accumulate_gradients(&model, &adapter, &batch)
            .unwrap();
        let g: Vec<Vec<f32>> = trainer
            .optimizer()
            .accumulated_grads()
            .map(|(_, g)| g.unwrap().flatten_all().unwrap().to_vec1().unwrap())
            .collect();
        (stats, g)
    };
    let (s1, g1) = grads(6);
    let (s2, g2) = grads(1);
    assert!(
        (s1.loss - s2.loss).abs() < 1e-5,
        "{} vs {}",
        s1.loss,
        s2.loss
    );
    assert!((s1.entropy - s2.entropy).abs() < 1e-5);
    for (a, b) in g1.iter().zip(&g2) {
        for (x, y) in a.iter().zip(b) {
            assert!((x - y).abs() < 1e-4 + 1e-3 * x.abs(), "{x} vs {y}");
        }
    }
}

#[test]
fn rl_steps_raise_the_rewarded_completion() {
    let model = small_model("toy-task");
    let seq_logprob = |adapter: &LoraAdapter, completion: &[u32]| -> f32 {
        completion_logprobs(&model, Some(adapter), &PROMPT, completion)
            .iter()
            .sum()
    };
    for objective in [
        ObjectiveConfig::reinforce(),
        ObjectiveConfig::rloo(),
        ObjectiveConfig::grpo(),
        ObjectiveConfig::dr_grpo(4),
        ObjectiveConfig::ppo(),
    ] {
        let adapter =
            LoraAdapter::new(model.config(), LoraConfig::all_projections(4, 8.0), 4).unwrap();
        let mut trainer = RlTrainer::new(train_config(objective.clone(), 6, 3), &adapter).unwrap();
        let (good0, bad0) = (seq_logprob(&adapter, &GOOD), seq_logprob(&adapter, &BAD));
        for _ in 0..4 {
            let batch = toy_batch(&model, &adapter);
            let stats = trainer.train_step(&model, &adapter, &batch).unwrap();
            assert!(stats.loss.is_finite());
            assert_eq!(stats.sequences, 6);
        }
        let (good1, bad1) = (seq_logprob(&adapter, &GOOD), seq_logprob(&adapter, &BAD));
        assert!(
            good1 > good0 + 0.5 && bad1 < bad0 - 0.5,
            "{objective:?}: good {good0} -> {good1}, bad {bad0} -> {bad1}"
        );
    }
}

#[test]
fn reward_penalty_and_truncation_are_reported() {
    let model = small_model("penalty");
    let adapter = LoraAdapter::new(model.config(), LoraConfig::all_projections(4, 8.0), 5).unwrap();
    let mut objective = ObjectiveConfig::rloo();
    objective.kl = Some(KlConfig {
        coef: 0.1,
        estimator: KlEstimator::K3,
        mode: KlMode::RewardPenalty,
    });
    let mut config = train_config(objective, 8, 3);
    config.batch.max_seq_len = 8;
    let mut trainer = RlTrainer::new(config.clone(), &adapter).unwrap();
    let mut batch = toy_batch(&model, &adapter);
    // 8 + 3 tokens: 3 prompt tokens cut.
    batch.push(example(
        &model,
        &adapter,
        &[1, 3, 3, 3, 3, 4, 5, 6],
        &GOOD,
        1.0,
        2,
    ));
    // 1 + 8 tokens: the completion alone does not fit beside a prompt token.
    batch.push(example(
        &model,
        &adapter,
        &[1],
        &[3, 3, 3, 3, 3, 3, 3, 2],
        1.0,
        2,
    ));
    let stats = trainer.train_step(&model, &adapter, &batch).unwrap();
    assert_eq!(stats.truncated, 1);
    assert_eq!(stats.tokens_cut, 3);
    assert_eq!(stats.dropped, 1);
    assert_eq!(stats.sequences, 7);
    // k3 is never negative.
    assert!(stats.kl >= 0.0, "{}", stats.kl);
    // After one step the adapter differs from the base: a positive penalty.
    let batch = toy_batch(&model, &adapter);
    let stats = trainer.train_step(&model, &adapter, &batch).unwrap();
    assert!(stats.kl > 0.0 && stats.kl_penalty > 0.0, "{stats:?}");

    config.batch.truncation = Truncation::Drop;
    let mut trainer = RlTrainer::new(config, &adapter).unwrap();
    let mut batch = toy_batch(&model, &adapter);
    batch.push(example(
        &model,
        &adapter,
        &[1, 3, 3, 3, 3, 4, 5, 6],
        &GOOD,
        1.0,
        2,
    ));
    let stats = trainer.train_step(&model, &adapter, &batch).unwrap();
    assert_eq!((stats.truncated, stats.dropped), (0, 1));

    // Too many sequences, or an adapter the trainer does not own.
    let other = LoraAdapter::new(model.config(), LoraConfig::all_projections(4, 8.0), 6).unwrap();
    assert!(trainer
        .train_step(&model, &other, &toy_batch(&model, &other))
        .is_err());
    let mut nine = toy_batch(&model, &adapter);
    nine.extend(toy_batch(&model, &adapter));
    assert!(trainer.train_step(&model, &adapter, &nine).is_err());
}

// ------------------------------------------------------- reward shaping

fn game(
    env_id: &str,
    reward: f64,
    turns: u32,
    well_formatted_turns: u32,
    invalid_moves: u32,
) -> GameResult {
    GameResult {
        env_id: env_id.into(),
        reward,
        turns,
        well_formatted_turns,
        invalid_moves,
        drawn: false,
    }
}

#[test]
fn format_reward_and_invalid_move_penalty_by_hand() {
    let g = game("TicTacToe-v0", 1.0, 4, 3, 2);
    close(format_reward(&g, 0.2), 0.15, "format");
    assert_eq!(format_reward(&game("x", 0.0, 0, 0, 0), 0.2), 0.0);
    let shaping = RewardShaping {
        normalize: None,
        format_bonus: 0.2,
        invalid_move_penalty: 0.5,
        ..RewardShaping::default()
    };
    shaping.validate().unwrap();
    let mut normalizer = RewardNormalizer::default();
    let seat = shaping.apply(&mut normalizer, &[g])[0];
    close(seat, 1.0 + 0.15, "shaped seat");
    close(shaping.move_reward(seat, false, 0), 1.15, "valid move");
    close(
        shaping.move_reward(seat, true, 0),
        1.15 - 0.5,
        "refused move",
    );
    close(
        shaping.move_reward(seat, false, 3),
        1.15,
        "no discount by default",
    );
    let discounted = RewardShaping {
        discount: 0.5,
        ..shaping.clone()
    };
    discounted.validate().unwrap();
    close(
        discounted.move_reward(seat, false, 0),
        1.15,
        "the last move",
    );
    close(
        discounted.move_reward(seat, false, 2),
        1.15 * 0.25,
        "two moves before the end",
    );
    close(
        discounted.move_reward(seat, true, 1),
        1.15 * 0.5 - 0.5,
        "the penalty is not discounted",
    );
    for bad in [0.0, -0.5, 1.5, f64::NAN] {
        let shaping = RewardShaping {
            discount: bad,
            ..shaping.clone()
        };
        assert!(shaping.validate().is_err(), "discount {bad}");
    }
    assert!(normalizer.per_env.is_empty());
}

#[test]
fn a_drawn_game_takes_the_draw_reward_before_normalisation() {
    let drawn = GameResult {
        drawn: true,
        ..game("TicTacToe-v0", 0.0, 4, 4, 0)
    };
    let results = [
        game("TicTacToe-v0", 1.0, 3, 3, 0),
        drawn,
        game("TicTacToe-v0", -1.0, 4, 4, 0),
    ];
    let mut normalizer = RewardNormalizer::default();
    let own = RewardShaping::default();
    assert_eq!(own.apply(&mut normalizer, &results), vec![1.0, 0.0, -1.0]);
    let as_win = RewardShaping {
        draw: Some(1.0),
        format_bonus: 0.1,
        ..RewardShaping::default()
    };
    as_win.validate().unwrap();
    let shaped = as_win.apply(&mut normalizer, &results);
    for (x, y) in shaped.iter().zip([1.1, 1.1, -0.9]) {
        close(*x, y, "a draw counts as a win");
    }
    // Normalised, the draw's reward is what the statistics see: 1, 1, -1
    // (mean 1/3, std sqrt(8)/3).
    let normalized = RewardShaping {
        normalize: Some(NormalizeConfig {
            center: true,
            eps: 1e-12,
            clip: None,
        }),
        ..as_win.clone()
    };
    let mut normalizer = RewardNormalizer::default();
    let shaped = normalized.apply(&mut normalizer, &results);
    let (mean, std) = (1.0 / 3.0, 8.0f64.sqrt() / 3.0);
    for (x, y) in shaped
        .iter()
        .zip([1.0, 1.0, -1.0].map(|r| (r - mean) / std + 0.1))
    {
        close(*x, y, "normalised");
    }
    close(normalizer.per_env["TicTacToe-v0"].mean, mean, "statistics");
    for bad in [f64::NAN, f64::INFINITY] {
        let shaping = RewardShaping {
            draw: Some(bad),
            ..as_win.clone()
        };
        assert!(shaping.validate().is_err(), "draw {bad}");
    }
}

#[test]
fn rewards_are_normalised_per_environment() {
    let config = NormalizeConfig {
        center: true,
        eps: 0.0,
        clip: None,
    };
    let shaping = RewardShaping {
        normalize: Some(NormalizeConfig {
            eps: 1e-12,
            ..config.clone()
        }),
        format_bonus: 1.0,
        invalid_move_penalty: 0.0,
        ..RewardShaping::default()
    };
    let mut normalizer = RewardNormalizer::default();
    // Env a: rewards 1 and 3 (mean 2, std 1); env b: 10, 30, 50 (mean 30, std sqrt(800/3)).
    let results = [
        game("a", 1.0, 1, 0, 0),
        game("b", 10.0, 1, 0, 0),
        game("a", 3.0, 1, 1, 0),
        game("b", 30.0, 1, 0, 0),
        game("b", 50.0, 1, 0, 0),
    ];
    let shaped = shaping.apply(&mut normalizer, &results);
    let sb = (800.0f64 / 3.0).sqrt();
    for (x, y) in shaped
        .iter()
        .zip([-1.0, -20.0 / sb, 1.0 + 1.0, 0.0, 20.0 / sb])
    {
        close(*x, y, "shaped");
    }
    assert_eq!(normalizer.per_env["a"].count, 2);
    assert_eq!(normalizer.per_env["b"].count, 3);
    // The next batch of env a is normalised by the running statistics of
    // all four rewards (1, 3, 5, 7: mean 4, population std sqrt(5)).
    let z = normalizer.normalize(&config, "a", &[5.0, 7.0]);
    close(z[0], 1.0 / 5f64.sqrt(), "running");
    close(z[1], 3.0 / 5f64.sqrt(), "running");
    let mut stats = RunningStats::default();
    stats.update(&[1.0, 3.0, 5.0, 7.0]);
    close(stats.mean, normalizer.per_env["a"].mean, "merged mean");
    close(stats.var, normalizer.per_env["a"].var, "merged var");
    // Clipping.
    let clipped = NormalizeConfig {
        clip: Some(0.5),
        ..config
    };
    assert_eq!(
        normalizer.normalize(&clipped, "c", &[0.0, 10.0]),
        vec![-0.5, 0.5]
    );
}
