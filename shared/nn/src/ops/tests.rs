//! Each fused op against the same function composed from basic candle
//! ops ([`composed`], what runs off the CPU): values and gradients; the
//! masking of [`mask`] on both paths. In their own file so that the ops
//! read without them.

use candle_core::Var;

use super::*;

fn close(a: &Tensor, b: &Tensor, tol: f32) {
    let a: Vec<f32> = a.flatten_all().unwrap().to_vec1().unwrap();
    let b: Vec<f32> = b.flatten_all().unwrap().to_vec1().unwrap();
    assert_eq!(a.len(), b.len());
    for (i, (x, y)) in a.iter().zip(&b).enumerate() {
        assert!(
            (x - y).abs() <= tol * (1.0 + y.abs()),
            "index {i}: {x} vs {y}"
        );
    }
}

fn var(shape: &[usize], seed: usize) -> Var {
    let n: usize = shape.iter().product();
    let data: Vec<f32> = (0..n)
        .map(|i| (((i + seed) * 7919 % 1000) as f32 / 500.0 - 1.0) * 0.9)
        .collect();
    Var::from_vec(data, shape, &Device::Cpu).unwrap()
}

fn weights(seed: usize) -> Tensor {
    var(&[5, 3], seed).as_detached_tensor()
}

#[test]
fn linear_matches_composition() {
    for act in [None, Some(Activation::Tanh), Some(Activation::Relu)] {
        let x = var(&[5, 4], 1);
        let w = var(&[3, 4], 2);
        let b = var(&[3], 3);
        let y = linear(&x, &w, &b, act).unwrap();
        let r = composed::linear(&x, &w, &b, act).unwrap();
        close(&y, &r, 1e-6);
        let c = weights(4);
        let g1 = (&y * &c).unwrap().sum_all().unwrap().backward().unwrap();
        let g2 = (&r * &c).unwrap().sum_all().unwrap().backward().unwrap();
        for v in [&x, &w, &b] {
            close(g1.get(v).unwrap(), g2.get(v).unwrap(), 1e-5);
        }
    }
}

#[test]
fn categorical_matches_composition() {
    let logits = var(&[5, 3], 5);
    let actions: Arc<[u32]> = vec![0, 2, 1, 1, 0].into();
    let lp = categorical_logprob(&logits, actions.clone()).unwrap();
    let ent = categorical_entropy(&logits).unwrap();
    let lp_ref = composed::categorical_logprob(&logits, &actions).unwrap();
    let ent_ref = composed::categorical_entropy(&logits).unwrap();
    close(&lp, &lp_ref, 1e-6);
    close(&ent, &ent_ref, 1e-6);
    let c1 = Tensor::new(&[1.0f32, -2.0, 0.5, 3.0, 1.5], &Device::Cpu).unwrap();
    let c2 = Tensor::new(&[0.3f32, 0.7, -1.0, 2.0, 0.1], &Device::Cpu).unwrap();
    let f = |lp: &Tensor, e: &Tensor| {
        ((lp * &c1).unwrap() + (e * &c2).unwrap())
            .unwrap()
            .sum_all()
            .unwrap()
    };
    let g1 = f(&lp, &ent).backward().unwrap();
    let g2 = f(&lp_ref, &ent_ref).backward().unwrap();
    close(g1.get(&logits).unwrap(), g2.get(&logits).unwrap(), 1e-5);
}

#[test]
fn gaussian_matches_composition() {
    let mean = var(&[4, 2], 6);
    let log_std = var(&[2], 7);
    let actions: Arc<[f32]> = vec![0.3, -1.2, 2.0, 0.0, -0.5, 0.5, 1.0, 1.0].into();
    let lp = gaussian_logprob(&mean, &log_std, actions.clone()).unwrap();
    let ent = gaussian_entropy(&log_std, 4).unwrap();
    let lp_ref = composed::gaussian_logprob(&mean, &log_std, &actions).unwrap();
    let ent_ref = composed::gaussian_entropy(&log_std, 4).unwrap();
    close(&lp, &lp_ref, 1e-6);
    close(&ent, &ent_ref, 1e-6);
    let c1 = Tensor::new(&[1.0f32, -2.0, 0.5, 3.0], &Device::Cpu).unwrap();
    let c2 = Tensor::new(&[0.3f32, 0.7, -1.0, 2.0], &Device::Cpu).unwrap();
    let f = |lp: &Tensor, e: &Tensor| {
        ((lp * &c1).unwrap() + (e * &c2).unwrap())
            .unwrap()
            .sum_all()
            .unwrap()
    };
    let g1 = f(&lp, &ent).backward().unwrap();
    let g2 = f(&lp_ref, &ent_ref).backward().unwrap();
    close(g1.get(&mean).unwrap(), g2.get(&mean).unwrap(), 1e-5);
    close(g1.get(&log_std).unwrap(), g2.get(&log_std).unwrap(), 1e-5);
}

#[test]
fn squashed_gaussian_matches_composition() {
    let mean = var(&[3, 2], 8);
    let log_std = var(&[3, 2], 9);
    let eps: Arc<[f32]> = vec![0.3, -1.2, 2.0, 0.0, -0.5, 3.5].into();
    let y = squashed_gaussian(&mean, &log_std, eps.clone()).unwrap();
    let r = composed::squashed_gaussian(&mean, &log_std, &eps).unwrap();
    close(&y, &r, 1e-5);
    let c = var(&[3, 3], 10).as_detached_tensor();
    let g1 = (&y * &c).unwrap().sum_all().unwrap().backward().unwrap();
    let g2 = (&r * &c).unwrap().sum_all().unwrap().backward().unwrap();
    close(g1.get(&mean).unwrap(), g2.get(&mean).unwrap(), 1e-5);
    close(g1.get(&log_std).unwrap(), g2.get(&log_std).unwrap(), 1e-5);
}

#[test]
fn precomputed_losses_match_composition() {
    let (a, b, c) = (var(&[4], 11), var(&[4], 12), var(&[2, 2], 13));
    let grads = [
        vec![1.0, -2.0, 0.5, 0.25],
        vec![0.0, 3.0, -1.0, 2.0],
        vec![0.5, 0.5, -0.5, 7.0],
    ];
    let fused = precomputed_loss3([&a, &b, &c], 1.25, grads.clone()).unwrap();
    let composed = composed_on_cpu(|| precomputed_loss3([&a, &b, &c], 1.25, grads.clone()));
    let composed = composed.unwrap();
    assert_eq!(fused.to_scalar::<f32>().unwrap(), 1.25);
    assert_eq!(composed.to_scalar::<f32>().unwrap(), 1.25);
    // Scaled by an outer factor, as a weighted sum of losses is.
    let g1 = (fused * 3.0).unwrap().backward().unwrap();
    let g2 = (composed * 3.0).unwrap().backward().unwrap();
    for v in [&a, &b, &c] {
        close(g1.get(v).unwrap(), g2.get(v).unwrap(), 1e-6);
    }
    let single = composed_on_cpu(|| precomputed_loss(&a, -0.5, grads[0].clone())).unwrap();
    assert_eq!(single.to_scalar::<f32>().unwrap(), -0.5);
    let g = single.backward().unwrap();
    close(
        g.get(&a).unwrap(),
        &Tensor::new(&grads[0][..], &Device::Cpu).unwrap(),
        0.0,
    );
}
/// Rows of `[1, 2, 3]` logits under masks `[1, 0, 1]` (actions 0 and 2)
/// and `[0, 1, 0]` (action 1, the only legal one).
fn masked_example() -> (Var, Tensor, Arc<[u32]>) {
    let logits = Var::from_vec(
        vec![1f32, 2.0, 3.0, 1.0, 2.0, 3.0, 1.0, 2.0, 3.0],
        (3, 3),
        &Device::Cpu,
    )
    .unwrap();
    let masks = Tensor::from_vec(vec![1u8, 0, 1, 1, 0, 1, 0, 1, 0], (3, 3), &Device::Cpu).unwrap();
    (logits, masks, vec![0u32, 2, 1].into())
}

fn assert_values(t: &Tensor, expected: &[f32], tol: f32) {
    let got: Vec<f32> = t.flatten_all().unwrap().to_vec1().unwrap();
    assert_eq!(got.len(), expected.len());
    for (i, (g, e)) in got.iter().zip(expected).enumerate() {
        assert!((g - e).abs() <= tol, "index {i}: {got:?} vs {expected:?}");
    }
}

#[test]
fn masked_categorical_hand_computed_on_both_paths() {
    // Mask [1, 0, 1] over logits [1, 2, 3]: the categorical over {0, 2},
    //   p0 = e^1 / (e^1 + e^3) = 1 / (1 + e^2) = 0.119_202_92
    //   p2 = e^3 / (e^1 + e^3) = 1 / (1 + e^-2) = 0.880_797_08
    //   log p0 = -ln(1 + e^2) = -2.126_928_0, log p2 = 2 - ln(1 + e^2) = -0.126_928_0
    //   H = -(p0 log p0 + p2 log p2) = 0.253_536 + 0.111_797 = 0.365_333_86
    // Mask [0, 1, 0]: p1 = 1, log p1 = 0, H = 0 (0 * log 0 must not be NaN).
    // d log p_a / d l_j = 1[j = a] - p_j on legal j, exactly 0 on illegal j:
    //   row 0 (a = 0): [1 - p0, 0, -p2] = [0.880_797_08, 0, -0.880_797_08]
    //   row 1 (a = 2): [-p0, 0, 1 - p2] = [-0.119_202_92, 0, 0.119_202_92]
    //   row 2 (a = 1): [0, 1 - 1, 0] = [0, 0, 0]
    // dH / d l_j = -p_j (log p_j + H) on legal j, 0 on illegal:
    //   -p0 (log p0 + H) = 0.119_202_92 * 1.761_594_2 = 0.209_987_17, and
    //   -p2 (log p2 + H) = -0.880_797_08 * 0.238_405_84 = -0.209_987_17.
    let lp_expected = [-2.126_928, -0.126_928, 0.0];
    let h_expected = [0.365_333_86, 0.365_333_86, 0.0];
    let g_lp = [
        0.880_797_1,
        0.0,
        -0.880_797_1,
        -0.119_202_92,
        0.0,
        0.119_202_92,
        0.0,
        0.0,
        0.0,
    ];
    let g_h = [
        0.209_987_17,
        0.0,
        -0.209_987_17,
        0.209_987_17,
        0.0,
        -0.209_987_17,
        0.0,
        0.0,
        0.0,
    ];
    let (logits, masks, actions) = masked_example();
    let run = || {
        let masked = mask_logits(&logits, &masks).unwrap();
        let lp = categorical_logprob(&masked, actions.clone()).unwrap();
        let h = categorical_entropy(&masked).unwrap();
        let g_lp = lp.sum_all().unwrap().backward().unwrap();
        let g_h = h.sum_all().unwrap().backward().unwrap();
        let grad = |g: &candle_core::backprop::GradStore| -> Vec<f32> {
            g.get(&logits)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap()
        };
        (masked, lp, h, grad(&g_lp), grad(&g_h))
    };
    let fused = run();
    let composed = composed_on_cpu(run);
    for (masked, lp, h, glp, gh) in [&fused, &composed] {
        // Replaced, not shifted: the illegal logits are exactly MASKED_LOGIT.
        assert_values(
            masked,
            &[
                1.0,
                MASKED_LOGIT,
                3.0,
                1.0,
                MASKED_LOGIT,
                3.0,
                MASKED_LOGIT,
                2.0,
                MASKED_LOGIT,
            ],
            0.0,
        );
        assert_values(lp, &lp_expected, 1e-6);
        assert_values(h, &h_expected, 1e-6);
        let h: Vec<f32> = h.to_vec1().unwrap();
        assert_eq!(h[2], 0.0, "a single legal action has entropy exactly 0");
        let t = |v: &[f32]| Tensor::new(v, &Device::Cpu).unwrap();
        assert_values(&t(glp), &g_lp, 1e-6);
        assert_values(&t(gh), &g_h, 1e-6);
        // No gradient at all reaches an illegal logit.
        for i in [1, 4, 6, 8] {
            assert_eq!(glp[i], 0.0, "logprob gradient at illegal index {i}");
            assert_eq!(gh[i], 0.0, "entropy gradient at illegal index {i}");
        }
        assert!(glp.iter().chain(gh).all(|g| g.is_finite()));
    }
    close(&fused.1, &composed.1, 1e-6);
    close(&fused.2, &composed.2, 1e-6);
}

#[test]
fn masked_categorical_matches_composition() {
    let logits = var(&[6, 4], 14);
    let mask: Vec<u8> = vec![
        1, 0, 1, 1, 0, 0, 1, 0, 1, 1, 1, 1, 0, 1, 0, 1, 1, 0, 0, 0, 0, 0, 0, 1,
    ];
    let masks = Tensor::from_vec(mask, (6, 4), &Device::Cpu).unwrap();
    let actions: Arc<[u32]> = vec![2, 2, 1, 3, 0, 3].into();
    let c1 = Tensor::new(&[1.0f32, -2.0, 0.5, 3.0, 1.5, -0.5], &Device::Cpu).unwrap();
    let c2 = Tensor::new(&[0.3f32, 0.7, -1.0, 2.0, 0.1, 1.0], &Device::Cpu).unwrap();
    let run = || {
        let masked = mask_logits(&logits, &masks).unwrap();
        let lp = categorical_logprob(&masked, actions.clone()).unwrap();
        let h = categorical_entropy(&masked).unwrap();
        let loss = ((&lp * &c1).unwrap() + (&h * &c2).unwrap())
            .unwrap()
            .sum_all()
            .unwrap();
        let g = loss.backward().unwrap().get(&logits).unwrap().clone();
        (lp, h, g)
    };
    let (lp, h, g) = run();
    let (lp_ref, h_ref, g_ref) = composed_on_cpu(run);
    close(&lp, &lp_ref, 1e-6);
    close(&h, &h_ref, 1e-6);
    close(&g, &g_ref, 1e-5);
    let h: Vec<f32> = h.to_vec1().unwrap();
    assert_eq!(h[5], 0.0);
}

#[test]
fn bad_masks_are_errors_naming_the_row() {
    let logits = var(&[3, 2], 15).as_detached_tensor();
    let masks = |v: Vec<u8>| Tensor::from_vec(v, (3, 2), &Device::Cpu).unwrap();
    let err = mask_logits(&logits, &masks(vec![1, 0, 0, 0, 0, 1])).unwrap_err();
    assert!(err.to_string().contains("row 1"), "{err}");
    let err = mask_logits(&logits, &masks(vec![1, 0, 0, 1, 2, 1])).unwrap_err();
    assert!(err.to_string().contains("row 2"), "{err}");
    // Wrong shape and wrong dtype.
    let short = Tensor::from_vec(vec![1u8; 4], (2, 2), &Device::Cpu).unwrap();
    assert!(mask_logits(&logits, &short).is_err());
    let wide = Tensor::from_vec(vec![1u32; 6], (3, 2), &Device::Cpu).unwrap();
    assert!(mask_logits(&logits, &wide).is_err());
    // The host check: length, values, a legal action in every row.
    check_masks(&[1, 0, 0, 1], 2, 2).unwrap();
    check_masks(&[], 0, 3).unwrap();
    assert!(check_masks(&[1, 0, 0], 2, 2).is_err());
    let err = check_masks(&[1, 1, 0, 1, 0, 0, 0, 0], 4, 2).unwrap_err();
    assert!(err.to_string().contains("row 2"), "{err}");
    assert!(check_masks(&[], 1, 0).is_err());
}

#[test]
fn masked_host_log_softmax_is_the_legal_one() {
    // [1, 2, 3] under [1, 0, 1]: as the hand-computed test above.
    let mut out = [0f32; 3];
    masked_log_softmax_row(&[1.0, 2.0, 3.0], Some(&[1, 0, 1]), &mut out);
    assert!((out[0] + 2.126_928).abs() < 1e-6 && (out[2] + 0.126_928).abs() < 1e-6);
    assert_eq!(out[1], f32::NEG_INFINITY);
    // Legal logits as low as MASKED_LOGIT: still only the legal entries count.
    masked_log_softmax_row(&[MASKED_LOGIT; 3], Some(&[0, 1, 1]), &mut out);
    assert_eq!(out[0], f32::NEG_INFINITY);
    assert!(out[1..].iter().all(|lp| lp.is_finite() && *lp <= 0.0));
    // All legal is the plain log-softmax, bit for bit.
    let (mut a, mut b) = ([0f32; 3], [0f32; 3]);
    masked_log_softmax_row(&[0.3, -1.0, 2.0], Some(&[1, 1, 1]), &mut a);
    log_softmax_row(&[0.3, -1.0, 2.0], &mut b);
    assert_eq!(a, b);
}

#[test]
fn masked_argmax_takes_the_first_legal_maximum() {
    assert_eq!(masked_argmax(&[5.0, 1.0, 3.0], Some(&[0, 1, 1])), 2);
    assert_eq!(masked_argmax(&[3.0, 3.0, 3.0], Some(&[0, 1, 1])), 1);
    assert_eq!(masked_argmax(&[1.0, 3.0, 3.0], None), 1);
    assert_eq!(masked_argmax(&[5.0, 1.0, 3.0], None), 0);
    // Ties with the masked value: the mask decides, not the values.
    assert_eq!(
        masked_argmax(&[MASKED_LOGIT, MASKED_LOGIT], Some(&[0, 1])),
        1
    );
    assert_eq!(masked_argmax(&[f32::NAN, 1.0], Some(&[0, 1])), 1);
    assert_eq!(masked_argmax(&[1.0, 2.0], Some(&[0, 0])), 0);
}
