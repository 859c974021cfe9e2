//! ActorCritic: shapes, determinism, init, hand-computed distributions,
//! inference/training path agreement, weight exchange and checkpoints.

use std::collections::HashMap;

use candle_core::{DType, Device, Tensor};
use rand::{Rng, SeedableRng};
use relay_nn::{
    ActOutput, ActionKind, Actions, Activation, ActorCritic, NamedTensor, NnError, PolicySpec,
};

fn rng(seed: u64) -> rand::rngs::StdRng {
    rand::rngs::StdRng::seed_from_u64(seed)
}

fn random_obs(n: usize, d: usize, seed: u64) -> Vec<f32> {
    let mut r = rng(seed);
    (0..n * d).map(|_| r.random_range(-2.0..2.0)).collect()
}

fn continuous_spec() -> PolicySpec {
    let mut spec = PolicySpec::continuous(3, vec![-2.0, -1.0], vec![2.0, 1.0]);
    spec.init_log_std = -0.5;
    spec
}

fn tmp_path(name: &str) -> std::path::PathBuf {
    std::env::temp_dir().join(format!("relay-nn-test-{}-{name}", std::process::id()))
}

/// Sets every parameter to zero, then applies `overrides`.
fn set_params(model: &mut ActorCritic, overrides: &[(&str, Vec<f32>)]) {
    let mut tensors = model.named_tensors();
    for (name, _, data) in tensors.iter_mut() {
        data.fill(0.0);
        if let Some((_, v)) = overrides.iter().find(|(n, _)| n == name) {
            data.copy_from_slice(v);
        }
    }
    model.load_named_tensors(&tensors).unwrap();
}

#[test]
fn parameter_names_and_shapes_follow_sb3() {
    let model = ActorCritic::new(&continuous_spec(), 0).unwrap();
    let shapes: Vec<(String, Vec<usize>)> = model
        .named_tensors()
        .into_iter()
        .map(|(n, s, _)| (n, s))
        .collect();
    let expected: Vec<(&str, Vec<usize>)> = vec![
        ("action_net.bias", vec![2]),
        ("action_net.weight", vec![2, 64]),
        ("log_std", vec![2]),
        ("mlp_extractor.policy_net.0.bias", vec![64]),
        ("mlp_extractor.policy_net.0.weight", vec![64, 3]),
        ("mlp_extractor.policy_net.2.bias", vec![64]),
        ("mlp_extractor.policy_net.2.weight", vec![64, 64]),
        ("mlp_extractor.value_net.0.bias", vec![64]),
        ("mlp_extractor.value_net.0.weight", vec![64, 3]),
        ("mlp_extractor.value_net.2.bias", vec![64]),
        ("mlp_extractor.value_net.2.weight", vec![64, 64]),
        ("value_net.bias", vec![1]),
        ("value_net.weight", vec![1, 64]),
    ];
    let expected: Vec<(String, Vec<usize>)> = expected
        .into_iter()
        .map(|(n, s)| (n.to_string(), s))
        .collect();
    assert_eq!(shapes, expected);
    assert_eq!(model.vars().len(), expected.len());
    for ((name, var), (ename, eshape)) in model
        .parameter_names()
        .iter()
        .zip(model.vars())
        .zip(&expected)
    {
        assert_eq!(name, ename);
        assert_eq!(var.dims(), eshape.as_slice());
    }
    assert_eq!(model.varmap().all_vars().len(), expected.len());
    let n: usize = expected
        .iter()
        .map(|(_, s)| s.iter().product::<usize>())
        .sum();
    assert_eq!(model.num_parameters(), n);
}

#[test]
fn init_is_orthogonal_with_sb3_gains_and_zero_biases() {
    let model = ActorCritic::new(&continuous_spec(), 7).unwrap();
    let params: HashMap<String, (Vec<usize>, Vec<f32>)> = model
        .named_tensors()
        .into_iter()
        .map(|(n, s, d)| (n, (s, d)))
        .collect();
    for (name, (_, data)) in &params {
        if name.ends_with(".bias") {
            assert!(data.iter().all(|&x| x == 0.0), "{name} not zero");
        }
    }
    assert_eq!(params["log_std"].1, vec![-0.5, -0.5]);
    // Row norms: rows are orthonormal * gain when rows <= cols.
    let row_norms = |name: &str| -> Vec<f64> {
        let (shape, data) = &params[name];
        data.chunks(shape[1])
            .map(|r| r.iter().map(|&x| (x as f64).powi(2)).sum::<f64>().sqrt())
            .collect()
    };
    for n in row_norms("action_net.weight") {
        assert!((n - 0.01).abs() < 1e-6, "{n}");
    }
    for n in row_norms("value_net.weight") {
        assert!((n - 1.0).abs() < 1e-5, "{n}");
    }
    for n in row_norms("mlp_extractor.policy_net.2.weight") {
        assert!((n - 2f64.sqrt()).abs() < 1e-5, "{n}");
    }
    // [64, 3]: columns are orthonormal * sqrt(2).
    let (shape, w) = &params["mlp_extractor.value_net.0.weight"];
    for a in 0..shape[1] {
        for b in 0..shape[1] {
            let d: f64 = (0..shape[0])
                .map(|r| w[r * 3 + a] as f64 * w[r * 3 + b] as f64)
                .sum();
            let e = if a == b { 2.0 } else { 0.0 };
            assert!((d - e).abs() < 1e-5, "{d}");
        }
    }
}

/// `ortho_init: false` (rl-zoo's MuJoCo presets): every layer as PyTorch's
/// default `nn.Linear`, weight and bias uniform in `±1/sqrt(fan_in)`.
#[test]
fn without_ortho_init_layers_start_as_pytorchs_default() {
    let spec = PolicySpec {
        ortho_init: false,
        ..continuous_spec()
    };
    let model = ActorCritic::new(&spec, 7).unwrap();
    let mut nonzero_bias = false;
    for (name, shape, data) in model.named_tensors() {
        if name == "log_std" {
            assert_eq!(data, vec![-0.5, -0.5]);
            continue;
        }
        let fan_in = if name.ends_with(".weight") {
            shape[1]
        } else {
            let weight = name.replace(".bias", ".weight");
            model
                .named_tensors()
                .into_iter()
                .find(|(n, ..)| *n == weight)
                .unwrap()
                .1[1]
        };
        let bound = 1.0 / (fan_in as f32).sqrt();
        assert!(data.iter().all(|x| x.abs() <= bound), "{name}");
        // Spread over the range, not a gain-scaled orthogonal matrix.
        let max = data.iter().fold(0f32, |m, x| m.max(x.abs()));
        assert!(max > 0.5 * bound, "{name}: {max} of {bound}");
        nonzero_bias |= name.ends_with(".bias") && data.iter().any(|&x| x != 0.0);
    }
    assert!(nonzero_bias);
}

#[test]
fn deterministic_given_seed() {
    for spec in [PolicySpec::discrete(4, 2), continuous_spec()] {
        let a = ActorCritic::new(&spec, 42).unwrap();
        let b = ActorCritic::new(&spec, 42).unwrap();
        let c = ActorCritic::new(&spec, 43).unwrap();
        assert_eq!(a.named_tensors(), b.named_tensors());
        assert_ne!(a.named_tensors(), c.named_tensors());
        let obs = random_obs(5, spec.obs_dim, 1);
        let oa = a.act(&obs, 5, false, &mut rng(9)).unwrap();
        let ob = b.act(&obs, 5, false, &mut rng(9)).unwrap();
        assert_eq!(oa, ob);
    }
}

#[test]
fn act_shapes_and_validation() {
    let model = ActorCritic::new(&PolicySpec::discrete(4, 3), 0).unwrap();
    for n in [0usize, 1, 5, 40] {
        let out = model
            .act(&random_obs(n, 4, 2), n, false, &mut rng(1))
            .unwrap();
        let Actions::Discrete(a) = &out.actions else {
            panic!("expected discrete")
        };
        assert_eq!(a.len(), n);
        assert!(a.iter().all(|&x| (0..3).contains(&x)));
        assert_eq!(out.logprobs.len(), n);
        assert_eq!(out.values.len(), n);
        assert_eq!(model.values(&random_obs(n, 4, 2), n).unwrap(), out.values);
    }
    let err = model.act(&[0.0; 7], 2, false, &mut rng(1)).unwrap_err();
    assert!(
        matches!(err, NnError::BadInput { what: "obs", .. }),
        "{err}"
    );

    let model = ActorCritic::new(&continuous_spec(), 0).unwrap();
    let out = model
        .act(&random_obs(6, 3, 2), 6, false, &mut rng(1))
        .unwrap();
    let Actions::Continuous(a) = &out.actions else {
        panic!("expected continuous")
    };
    assert_eq!(a.len(), 12);
    assert_eq!(out.logprobs.len(), 6);

    let obs = Tensor::from_vec(random_obs(6, 3, 2), (6, 3), &Device::Cpu).unwrap();
    let acts = Tensor::from_vec(a.clone(), (6, 2), &Device::Cpu).unwrap();
    let (lp, ent, v) = model.evaluate(&obs, &acts).unwrap();
    assert_eq!(
        (lp.dims(), ent.dims(), v.dims()),
        (&[6][..], &[6][..], &[6][..])
    );
    let bad = Tensor::zeros((6, 3), DType::F32, &Device::Cpu).unwrap();
    assert!(model.evaluate(&obs, &bad).is_err());
    let bad_obs = Tensor::zeros((6, 4), DType::F32, &Device::Cpu).unwrap();
    assert!(model.evaluate(&bad_obs, &acts).is_err());
}

#[test]
fn discrete_actions_are_validated() {
    let model = ActorCritic::new(&PolicySpec::discrete(4, 3), 0).unwrap();
    let obs = Tensor::zeros((2, 4), DType::F32, &Device::Cpu).unwrap();
    for ok in [
        Tensor::new(&[0u32, 2], &Device::Cpu).unwrap(),
        Tensor::new(&[0i64, 2], &Device::Cpu).unwrap(),
        Tensor::new(&[[0f32], [2.0]], &Device::Cpu).unwrap(),
    ] {
        model.evaluate(&obs, &ok).unwrap();
    }
    for bad in [
        Tensor::new(&[0u32, 3], &Device::Cpu).unwrap(),
        Tensor::new(&[-1i64, 0], &Device::Cpu).unwrap(),
        Tensor::new(&[0.5f32, 0.0], &Device::Cpu).unwrap(),
        Tensor::new(&[0u32, 1, 2], &Device::Cpu).unwrap(),
    ] {
        let err = model.evaluate(&obs, &bad).unwrap_err();
        assert!(err.to_string().contains("actions"), "{err}");
    }
}

#[test]
fn discrete_logprob_entropy_match_hand_computation() {
    let mut model = ActorCritic::new(&PolicySpec::discrete(4, 2), 0).unwrap();
    // All weights zero: logits = action_net.bias = [0, ln 3] -> p = [1/4, 3/4]; V = value_net.bias.
    set_params(
        &mut model,
        &[
            ("action_net.bias", vec![0.0, 3f32.ln()]),
            ("value_net.bias", vec![1.5]),
        ],
    );
    let (p0, p1) = (0.25f64, 0.75f64);
    let entropy = -(p0 * p0.ln() + p1 * p1.ln());
    let obs = random_obs(4, 4, 3);
    let x = Tensor::from_vec(obs.clone(), (4, 4), &Device::Cpu).unwrap();
    let a = Tensor::new(&[0u32, 1, 1, 0], &Device::Cpu).unwrap();
    let (lp, ent, v) = model.evaluate(&x, &a).unwrap();
    let lp: Vec<f32> = lp.to_vec1().unwrap();
    let expect = [p0.ln(), p1.ln(), p1.ln(), p0.ln()];
    for (g, e) in lp.iter().zip(expect) {
        assert!((*g as f64 - e).abs() < 1e-6, "{g} vs {e}");
    }
    for g in ent.to_vec1::<f32>().unwrap() {
        assert!((g as f64 - entropy).abs() < 1e-6);
    }
    assert_eq!(v.to_vec1::<f32>().unwrap(), vec![1.5; 4]);

    let det = model.act(&obs, 4, true, &mut rng(0)).unwrap();
    assert_eq!(det.actions, Actions::Discrete(vec![1; 4]));
    assert!(det
        .logprobs
        .iter()
        .all(|&l| (l as f64 - p1.ln()).abs() < 1e-6));
    assert_eq!(det.values, vec![1.5; 4]);

    // Sampling frequencies: 20000 draws of p = 3/4, sd of the mean 0.003.
    let n = 20_000;
    let obs = vec![0.0; n * 4];
    let out = model.act(&obs, n, false, &mut rng(5)).unwrap();
    let Actions::Discrete(acts) = out.actions else {
        unreachable!()
    };
    let freq = acts.iter().filter(|&&a| a == 1).count() as f64 / n as f64;
    assert!((freq - 0.75).abs() < 0.015, "{freq}");
    for (a, lp) in acts.iter().zip(&out.logprobs) {
        let e = if *a == 1 { p1.ln() } else { p0.ln() };
        assert!((*lp as f64 - e).abs() < 1e-6);
    }
}

#[test]
fn gaussian_logprob_entropy_match_hand_computation() {
    let mut model = ActorCritic::new(&continuous_spec(), 0).unwrap();
    // mean = [0.5, -1.0], std = [2, 0.5]
    set_params(
        &mut model,
        &[
            ("action_net.bias", vec![0.5, -1.0]),
            ("log_std", vec![2f32.ln(), 0.5f32.ln()]),
        ],
    );
    let half_ln_2pi = 0.5 * (2.0 * std::f64::consts::PI).ln();
    let obs = random_obs(2, 3, 4);
    let x = Tensor::from_vec(obs.clone(), (2, 3), &Device::Cpu).unwrap();
    let acts = [1.5f32, -1.0, 0.5, 0.0];
    let a = Tensor::from_vec(acts.to_vec(), (2, 2), &Device::Cpu).unwrap();
    let (lp, ent, _) = model.evaluate(&x, &a).unwrap();
    // z = (a - mean) / std
    let logp = |z: [f64; 2]| -> f64 {
        z.iter().map(|z| -0.5 * z * z).sum::<f64>() - 2f64.ln() - 0.5f64.ln() - 2.0 * half_ln_2pi
    };
    let expect = [logp([0.5, 0.0]), logp([0.0, 2.0])];
    for (g, e) in lp.to_vec1::<f32>().unwrap().iter().zip(expect) {
        assert!((*g as f64 - e).abs() < 1e-5, "{g} vs {e}");
    }
    let entropy = 2.0 * (0.5 + half_ln_2pi) + 2f64.ln() + 0.5f64.ln();
    for g in ent.to_vec1::<f32>().unwrap() {
        assert!((g as f64 - entropy).abs() < 1e-5);
    }

    let det = model.act(&obs, 2, true, &mut rng(0)).unwrap();
    assert_eq!(det.actions, Actions::Continuous(vec![0.5, -1.0, 0.5, -1.0]));
    assert!(det
        .logprobs
        .iter()
        .all(|&l| (l as f64 - logp([0.0, 0.0])).abs() < 1e-5));

    // Samples: mean and std per dimension, and not clipped to [-1, 1] in dim 1.
    let n = 20_000;
    let out = model.act(&vec![0.0; n * 3], n, false, &mut rng(6)).unwrap();
    let Actions::Continuous(a) = out.actions else {
        unreachable!()
    };
    for (d, (m, s)) in [(0.5f64, 2.0f64), (-1.0, 0.5)].into_iter().enumerate() {
        let xs: Vec<f64> = a.iter().skip(d).step_by(2).map(|&x| x as f64).collect();
        let mean = xs.iter().sum::<f64>() / n as f64;
        let sd = (xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / n as f64).sqrt();
        assert!(
            (mean - m).abs() < 4.0 * s / (n as f64).sqrt(),
            "dim {d}: mean {mean}"
        );
        assert!((sd - s).abs() < 0.03 * s, "dim {d}: sd {sd}");
    }
    assert!(
        a.iter().skip(1).step_by(2).any(|&x| x < -1.5),
        "samples must be unclipped"
    );
}

/// `act`'s no-graph path and `evaluate`'s graph path agree, on both sides of
/// the kernel/gemm threshold and across chunks.
#[test]
fn act_agrees_with_evaluate() {
    for spec in [PolicySpec::discrete(4, 3), continuous_spec(), {
        let mut s = PolicySpec::discrete(5, 2);
        s.activation = Activation::Relu;
        s.hidden = vec![17, 9, 33];
        s
    }] {
        let model = ActorCritic::new(&spec, 3).unwrap();
        for n in [1usize, 3, 16, 17, 40, 300] {
            let obs = random_obs(n, spec.obs_dim, n as u64);
            let out: ActOutput = model.act(&obs, n, false, &mut rng(2)).unwrap();
            let x = Tensor::from_vec(obs.clone(), (n, spec.obs_dim), &Device::Cpu).unwrap();
            let a = match &out.actions {
                Actions::Discrete(a) => Tensor::new(a.as_slice(), &Device::Cpu).unwrap(),
                Actions::Continuous(a) => {
                    Tensor::from_vec(a.clone(), (n, spec.action.head_width()), &Device::Cpu)
                        .unwrap()
                }
            };
            let (lp, _, v) = model.evaluate(&x, &a).unwrap();
            for (g, e) in lp.to_vec1::<f32>().unwrap().iter().zip(&out.logprobs) {
                assert!(
                    (g - e).abs() < 1e-4 * (1.0 + e.abs()),
                    "n {n}: logprob {g} vs {e}"
                );
            }
            for (g, e) in v.to_vec1::<f32>().unwrap().iter().zip(&out.values) {
                assert!(
                    (g - e).abs() < 1e-4 * (1.0 + e.abs()),
                    "n {n}: value {g} vs {e}"
                );
            }
        }
    }
}

#[test]
fn empty_hidden_is_a_linear_policy() {
    let mut spec = PolicySpec::discrete(3, 2);
    spec.hidden = vec![];
    let model = ActorCritic::new(&spec, 0).unwrap();
    assert_eq!(
        model.parameter_names(),
        vec![
            "action_net.bias",
            "action_net.weight",
            "value_net.bias",
            "value_net.weight"
        ]
    );
    let out = model.act(&[1.0, 2.0, 3.0], 1, true, &mut rng(0)).unwrap();
    assert_eq!(out.values.len(), 1);
}

fn expect_unchanged(model: &ActorCritic, before: &[NamedTensor]) {
    assert_eq!(
        model.named_tensors(),
        before,
        "model changed after a rejected load"
    );
}

#[test]
fn load_named_tensors_is_validated_and_all_or_nothing() {
    let mut model = ActorCritic::new(&PolicySpec::discrete(4, 2), 0).unwrap();
    let before = model.named_tensors();
    let other = ActorCritic::new(&PolicySpec::discrete(4, 2), 1)
        .unwrap()
        .named_tensors();

    // Wrong shape on a parameter that sorts last, so earlier ones would have been written.
    let mut bad = other.clone();
    let last = bad
        .iter_mut()
        .find(|(n, _, _)| n == "value_net.weight")
        .unwrap();
    last.1 = vec![64, 1];
    let err = model.load_named_tensors(&bad).unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains("value_net.weight") && msg.contains("[1, 64]") && msg.contains("[64, 1]"),
        "{msg}"
    );
    assert!(matches!(err, NnError::ShapeMismatch { .. }));
    expect_unchanged(&model, &before);

    // Data that does not fill the shape.
    let mut bad = other.clone();
    bad[3].2.pop();
    let msg = model.load_named_tensors(&bad).unwrap_err().to_string();
    assert!(msg.contains(&bad[3].0) && msg.contains("values"), "{msg}");
    expect_unchanged(&model, &before);

    // Missing.
    let bad: Vec<NamedTensor> = other
        .iter()
        .filter(|(n, _, _)| n != "action_net.bias")
        .cloned()
        .collect();
    let msg = model.load_named_tensors(&bad).unwrap_err().to_string();
    assert!(
        msg.contains("action_net.bias") && msg.contains("missing") && msg.contains("[2]"),
        "{msg}"
    );
    expect_unchanged(&model, &before);

    // Extra.
    let mut bad = other.clone();
    bad.push(("log_std".into(), vec![2], vec![0.0, 0.0]));
    let msg = model.load_named_tensors(&bad).unwrap_err().to_string();
    assert!(
        msg.contains("log_std") && msg.contains("unexpected") && msg.contains("[2]"),
        "{msg}"
    );
    expect_unchanged(&model, &before);

    // Non-finite.
    let mut bad = other.clone();
    bad.last_mut().unwrap().2[5] = f32::NAN;
    let msg = model.load_named_tensors(&bad).unwrap_err().to_string();
    assert!(
        msg.contains("value_net.weight") && msg.contains("NaN") && msg.contains("index 5"),
        "{msg}"
    );
    expect_unchanged(&model, &before);

    // Duplicate.
    let mut bad = other.clone();
    bad.push(bad[0].clone());
    assert!(model.load_named_tensors(&bad).is_err());
    expect_unchanged(&model, &before);

    // A good load (in any order) takes effect everywhere, act included.
    let mut shuffled = other.clone();
    shuffled.reverse();
    model.load_named_tensors(&shuffled).unwrap();
    assert_eq!(model.named_tensors(), other);
    let twin = ActorCritic::new(&PolicySpec::discrete(4, 2), 1).unwrap();
    let obs = random_obs(7, 4, 8);
    assert_eq!(
        model.act(&obs, 7, false, &mut rng(3)).unwrap(),
        twin.act(&obs, 7, false, &mut rng(3)).unwrap()
    );
}

#[test]
fn save_and_load_round_trip() {
    let spec = continuous_spec();
    let a = ActorCritic::new(&spec, 11).unwrap();
    let mut b = ActorCritic::new(&spec, 12).unwrap();
    let path = tmp_path("model.safetensors");
    a.save(&path).unwrap();
    b.load(&path).unwrap();
    assert_eq!(a.named_tensors(), b.named_tensors());

    // A model of another shape refuses the file, naming a parameter.
    let mut c =
        ActorCritic::new(&PolicySpec::continuous(4, vec![-1.0; 2], vec![1.0; 2]), 0).unwrap();
    let msg = c.load(&path).unwrap_err().to_string();
    assert!(
        msg.contains("mlp_extractor.policy_net.0.weight")
            && msg.contains("[64, 4]")
            && msg.contains("[64, 3]"),
        "{msg}"
    );

    // A file of another kind is refused by its format tag.
    let adam = relay_nn::Adam::new(a.vars(), relay_nn::AdamConfig::default()).unwrap();
    let apath = tmp_path("adam.safetensors");
    adam.save(&apath).unwrap();
    let msg = b.load(&apath).unwrap_err().to_string();
    assert!(msg.contains("format"), "{msg}");
    assert!(b.load(tmp_path("does-not-exist")).is_err());
    let _ = std::fs::remove_file(path);
    let _ = std::fs::remove_file(apath);
}

#[test]
fn spec_is_kept() {
    let spec = continuous_spec();
    let model = ActorCritic::new(&spec, 0).unwrap();
    assert_eq!(model.spec(), &spec);
    assert!(matches!(
        model.spec().action,
        ActionKind::Continuous { dim: 2, .. }
    ));
    let mut bad = spec.clone();
    bad.hidden = vec![0];
    assert!(ActorCritic::new(&bad, 0).is_err());
}

#[test]
fn model_and_optimizer_can_be_shared_across_threads() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<ActorCritic>();
    assert_send_sync::<relay_nn::Adam>();
}
