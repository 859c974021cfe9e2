//! Invalid-action masking of the discrete policy: acting and training,
//! against log-probabilities and entropies worked out by hand. In their
//! own file so that the model's code reads without them.

use super::*;
use crate::ops::{composed_on_cpu, MASKED_LOGIT};

fn rng(seed: u64) -> rand::rngs::StdRng {
    rand::rngs::StdRng::seed_from_u64(seed)
}

/// A discrete policy over 3 actions whose logits are `bias` for every
/// observation (action head weights 0).
fn fixed_logits(bias: [f32; 3]) -> ActorCritic {
    let mut model = ActorCritic::new(&PolicySpec::discrete(2, 3), 0).unwrap();
    let mut tensors = model.named_tensors();
    for (name, _, data) in tensors.iter_mut() {
        match name.as_str() {
            "action_net.weight" => data.fill(0.0),
            "action_net.bias" => data.copy_from_slice(&bias),
            _ => {}
        }
    }
    model.load_named_tensors(&tensors).unwrap();
    model
}

fn obs(n: usize) -> Vec<f32> {
    (0..2 * n).map(|i| (i as f32 * 0.37).sin()).collect()
}

fn close(got: &[f32], expected: &[f32], tol: f32) {
    assert_eq!(got.len(), expected.len());
    for (i, (g, e)) in got.iter().zip(expected).enumerate() {
        assert!((g - e).abs() <= tol, "index {i}: {got:?} vs {expected:?}");
    }
}

fn discrete(out: &ActOutput) -> &[i64] {
    match &out.actions {
        Actions::Discrete(a) => a,
        Actions::Continuous(_) => panic!("expected discrete actions"),
    }
}

#[test]
fn act_masked_never_picks_an_illegal_action() {
    // Logits [5, 0, 1]: the illegal action 0 is the most likely unmasked.
    // Masked log-probabilities, by hand:
    //   [0, 1, 1]: over logits {0, 1}: log p1 = -ln(1 + e) = -1.313_261_7,
    //              log p2 = -ln(1 + e^-1) = -0.313_261_7
    //   [1, 0, 1]: over {5, 1}: log p0 = -ln(1 + e^-4) = -0.018_149_6,
    //              log p2 = -ln(1 + e^4) = -4.018_149_6
    //   [0, 0, 1]: log p2 = 0
    let model = fixed_logits([5.0, 0.0, 1.0]);
    let kinds: [[u8; 3]; 3] = [[0, 1, 1], [1, 0, 1], [0, 0, 1]];
    let expected_lp = [
        [f32::NAN, -1.313_261_7, -0.313_261_7],
        [-0.018_149_6, f32::NAN, -4.018_149_6],
        [f32::NAN, f32::NAN, 0.0],
    ];
    let n = 900;
    let masks: Vec<u8> = (0..n).flat_map(|r| kinds[r % 3]).collect();
    let out = model
        .act_masked(&obs(n), n, Some(&masks), false, &mut rng(7))
        .unwrap();
    let mut counts = [[0usize; 3]; 3];
    for (r, (&a, &lp)) in discrete(&out).iter().zip(&out.logprobs).enumerate() {
        let a = a as usize;
        assert_eq!(kinds[r % 3][a], 1, "row {r}: illegal action {a}");
        assert!((lp - expected_lp[r % 3][a]).abs() < 1e-5, "row {r}: {lp}");
        counts[r % 3][a] += 1;
    }
    // [0, 1, 1]: p2 = 0.731 of 300 draws; [1, 0, 1]: p2 = 0.018.
    assert!((180..260).contains(&counts[0][2]), "{counts:?}");
    assert!(counts[0][1] > 0 && counts[1][0] > 250, "{counts:?}");

    // Deterministic: the legal arg-max, not the larger illegal logit.
    let det = model
        .act_masked(&obs(3), 3, Some(&masks[..9]), true, &mut rng(0))
        .unwrap();
    assert_eq!(discrete(&det), [2, 0, 2]);
    close(&det.logprobs, &[-0.313_261_7, -0.018_149_6, 0.0], 1e-5);
    let unmasked = model.act(&obs(1), 1, true, &mut rng(0)).unwrap();
    assert_eq!(discrete(&unmasked), [0]);
}

#[test]
fn act_masked_takes_the_mask_over_ties_with_the_masked_logit() {
    // Every logit equals MASKED_LOGIT: only the mask tells them apart.
    let model = fixed_logits([MASKED_LOGIT; 3]);
    let masks = [0u8, 0, 1, 0, 1, 1];
    let det = model
        .act_masked(&obs(2), 2, Some(&masks), true, &mut rng(0))
        .unwrap();
    assert_eq!(discrete(&det), [2, 1]);
    let n = 200;
    let many: Vec<u8> = (0..n).flat_map(|_| [0u8, 1, 1]).collect();
    let out = model
        .act_masked(&obs(n), n, Some(&many), false, &mut rng(3))
        .unwrap();
    assert!(discrete(&out).iter().all(|&a| a != 0));
    assert!(out.logprobs.iter().all(|lp| lp.is_finite()));
}

#[test]
fn act_with_no_or_all_legal_masks_is_unchanged() {
    let model = ActorCritic::new(&PolicySpec::discrete(2, 4), 3).unwrap();
    let (n, x) = (20, obs(20));
    let all = vec![1u8; n * 4];
    for det in [false, true] {
        let plain = model.act(&x, n, det, &mut rng(5)).unwrap();
        let none = model.act_masked(&x, n, None, det, &mut rng(5)).unwrap();
        let ones = model
            .act_masked(&x, n, Some(&all), det, &mut rng(5))
            .unwrap();
        assert_eq!(plain, none);
        assert_eq!(plain, ones);
    }
}

#[test]
fn bad_masks_are_refused() {
    let model = fixed_logits([1.0, 2.0, 3.0]);
    let err = model
        .act_masked(
            &obs(3),
            3,
            Some(&[1, 0, 0, 0, 0, 0, 0, 1, 0]),
            false,
            &mut rng(0),
        )
        .unwrap_err();
    assert!(err.to_string().contains("row 1"), "{err}");
    assert!(model
        .act_masked(&obs(3), 3, Some(&[1, 1, 1]), false, &mut rng(0))
        .is_err());
    let x = Tensor::from_vec(obs(2), (2, 2), &Device::Cpu).unwrap();
    let a = Tensor::new(&[0u32, 1], &Device::Cpu).unwrap();
    let m = Tensor::from_vec(vec![1u8, 1, 0, 0, 0, 0], (2, 3), &Device::Cpu).unwrap();
    let err = model.evaluate_masked(&x, &a, Some(&m)).unwrap_err();
    assert!(err.to_string().contains("row 1"), "{err}");

    let spec = PolicySpec::continuous(2, vec![-1.0], vec![1.0]);
    let cont = ActorCritic::new(&spec, 0).unwrap();
    assert!(cont
        .act_masked(&obs(2), 2, Some(&[1, 1]), false, &mut rng(0))
        .is_err());
    cont.act_masked(&obs(2), 2, None, false, &mut rng(0))
        .unwrap();
    let acts = Tensor::new(&[[0.5f32], [-0.5]], &Device::Cpu).unwrap();
    let m = Tensor::from_vec(vec![1u8, 1], (2, 1), &Device::Cpu).unwrap();
    assert!(cont.evaluate_masked(&x, &acts, Some(&m)).is_err());
}

#[test]
fn evaluate_masked_hand_computed_on_both_paths() {
    // Logits [1, 2, 3] on every row; masks [1, 0, 1], [1, 0, 1], [0, 1, 0];
    // actions 0, 2, 1. With p0 = 1 / (1 + e^2) = 0.119_202_92 and
    // p2 = 0.880_797_08 (see ops' hand-computed test):
    //   log-probs -ln(1 + e^2) = -2.126_928, 2 - ln(1 + e^2) = -0.126_928, 0
    //   entropies 0.365_333_86, 0.365_333_86, 0 (single legal action)
    // d sum(logprob) / d bias_j = Σ_rows (1[j = a] - p_j), illegal terms 0:
    //   j = 0: (1 - p0) - p0 + 0 = 0.761_594_16, j = 1: 0 + 0 + (1 - 1) = 0,
    //   j = 2: -p2 + (1 - p2) + 0 = -0.761_594_16.
    let model = fixed_logits([1.0, 2.0, 3.0]);
    let x = Tensor::from_vec(obs(3), (3, 2), &Device::Cpu).unwrap();
    let a = Tensor::new(&[0i64, 2, 1], &Device::Cpu).unwrap();
    let m = Tensor::from_vec(vec![1u8, 0, 1, 1, 0, 1, 0, 1, 0], (3, 3), &Device::Cpu).unwrap();
    let bias = model.action_net.b.clone();
    let run = || {
        let (lp, h, _) = model.evaluate_masked(&x, &a, Some(&m)).unwrap();
        let g = lp.sum_all().unwrap().backward().unwrap();
        let gb: Vec<f32> = g.get(&bias).unwrap().to_vec1().unwrap();
        let lp: Vec<f32> = lp.to_vec1().unwrap();
        let h: Vec<f32> = h.to_vec1().unwrap();
        (lp, h, gb)
    };
    let fused = run();
    let composed = composed_on_cpu(run);
    for (lp, h, gb) in [&fused, &composed] {
        close(lp, &[-2.126_928, -0.126_928, 0.0], 1e-6);
        close(h, &[0.365_333_86, 0.365_333_86, 0.0], 1e-6);
        assert_eq!(h[2], 0.0);
        close(gb, &[0.761_594_2, 0.0, -0.761_594_2], 1e-6);
    }
    close(&fused.0, &composed.0, 1e-6);
    close(&fused.1, &composed.1, 1e-6);
    close(&fused.2, &composed.2, 1e-6);

    // An action its mask marks illegal is refused, naming the row.
    let bad = Tensor::new(&[0i64, 2, 0], &Device::Cpu).unwrap();
    let err = model.evaluate_masked(&x, &bad, Some(&m)).unwrap_err();
    assert!(err.to_string().contains("row 2"), "{err}");
}

#[test]
fn act_masked_logprobs_are_what_evaluate_masked_scores() {
    let model = ActorCritic::new(&PolicySpec::discrete(2, 4), 11).unwrap();
    let n = 24;
    let x = obs(n);
    let masks: Vec<u8> = (0..n * 4)
        .map(|i| u8::from(i % 4 == i / 4 % 4 || i % 3 == 0))
        .collect();
    let out = model
        .act_masked(&x, n, Some(&masks), false, &mut rng(2))
        .unwrap();
    let a = Tensor::new(discrete(&out), &Device::Cpu).unwrap();
    let xt = Tensor::from_vec(x, (n, 2), &Device::Cpu).unwrap();
    let m = Tensor::from_vec(masks, (n, 4), &Device::Cpu).unwrap();
    let (lp, _, v) = model.evaluate_masked(&xt, &a, Some(&m)).unwrap();
    close(&lp.to_vec1::<f32>().unwrap(), &out.logprobs, 1e-5);
    close(&v.to_vec1::<f32>().unwrap(), &out.values, 1e-5);
    // All legal: the same as unmasked.
    let ones = Tensor::ones((n, 4), DType::U8, &Device::Cpu).unwrap();
    let (lp1, h1, _) = model.evaluate_masked(&xt, &a, Some(&ones)).unwrap();
    let (lp0, h0, _) = model.evaluate(&xt, &a).unwrap();
    assert_eq!(lp1.to_vec1::<f32>().unwrap(), lp0.to_vec1::<f32>().unwrap());
    assert_eq!(h1.to_vec1::<f32>().unwrap(), h0.to_vec1::<f32>().unwrap());
}
