//! CNN policies and Q-networks, NatureCNN and IMPALA's ResNet: names and
//! shapes, inference and training paths agreeing, gradients against finite
//! differences, spec validation, checkpoints, DQN train steps.

use candle_core::{Device, Tensor};
use rand::{Rng, SeedableRng};
use relay_nn::{
    dqn_loss, ActorCritic, Adam, AdamConfig, CnnArch, CnnSpec, ConvSpec, DqnBatch, DqnLossConfig,
    PolicySpec, QNetSpec, QNetwork, TrunkLayout,
};

fn small_cnn(input: [usize; 3]) -> PolicySpec {
    let mut spec = PolicySpec::discrete(input.iter().product(), 3);
    spec.hidden = vec![];
    spec.cnn = Some(CnnSpec {
        input,
        arch: CnnArch::Nature {
            conv: vec![
                ConvSpec {
                    channels: 4,
                    kernel: 3,
                    stride: 1,
                },
                ConvSpec {
                    channels: 5,
                    kernel: 2,
                    stride: 2,
                },
            ],
        },
        features_dim: 8,
    });
    spec
}

/// A small IMPALA: 2 stacks of 3 and 4 channels, 2 residual blocks each.
fn small_impala(input: [usize; 3]) -> PolicySpec {
    let mut spec = PolicySpec::discrete(input.iter().product(), 3);
    spec.hidden = vec![];
    spec.cnn = Some(CnnSpec {
        input,
        arch: CnnArch::Impala {
            channels: vec![3, 4],
            blocks: 2,
        },
        features_dim: 8,
    });
    spec
}

fn pixels(n: usize, d: usize, seed: u64) -> Vec<f32> {
    let mut r = rand::rngs::StdRng::seed_from_u64(seed);
    (0..n * d)
        .map(|_| r.random_range(0..=255u8) as f32)
        .collect()
}

#[test]
fn nature_cnn_has_sb3_names_and_shapes() {
    let mut spec = PolicySpec::discrete(4 * 84 * 84, 6);
    spec.hidden = vec![];
    spec.cnn = Some(CnnSpec {
        input: [4, 84, 84],
        ..CnnSpec::default()
    });
    let model = ActorCritic::new(&spec, 0).unwrap();
    let shapes: Vec<(String, Vec<usize>)> = model
        .named_tensors()
        .into_iter()
        .map(|(n, s, _)| (n, s))
        .collect();
    let expected: Vec<(&str, Vec<usize>)> = vec![
        ("action_net.bias", vec![6]),
        ("action_net.weight", vec![6, 512]),
        ("features_extractor.cnn.0.bias", vec![32]),
        ("features_extractor.cnn.0.weight", vec![32, 4, 8, 8]),
        ("features_extractor.cnn.2.bias", vec![64]),
        ("features_extractor.cnn.2.weight", vec![64, 32, 4, 4]),
        ("features_extractor.cnn.4.bias", vec![64]),
        ("features_extractor.cnn.4.weight", vec![64, 64, 3, 3]),
        ("features_extractor.linear.0.bias", vec![512]),
        ("features_extractor.linear.0.weight", vec![512, 3136]),
        ("value_net.bias", vec![1]),
        ("value_net.weight", vec![1, 512]),
    ];
    let expected: Vec<(String, Vec<usize>)> = expected
        .into_iter()
        .map(|(n, s)| (n.to_string(), s))
        .collect();
    assert_eq!(shapes, expected);
    // 1,687,719 parameters for 6 actions, as SB3's CnnPolicy counts them (features shared).
    assert_eq!(model.num_parameters(), 1_687_719);
}

#[test]
fn impala_has_cleanrl_names_and_shapes() {
    let mut spec = PolicySpec::discrete(4 * 84 * 84, 6);
    spec.hidden = vec![];
    spec.cnn = Some(CnnSpec {
        input: [4, 84, 84],
        ..CnnSpec::impala()
    });
    let model = ActorCritic::new(&spec, 0).unwrap();
    let shapes: std::collections::BTreeMap<String, Vec<usize>> = model
        .named_tensors()
        .into_iter()
        .map(|(n, s, _)| (n, s))
        .collect();
    let mut expected = std::collections::BTreeMap::new();
    let mut input = 4;
    for (i, c) in [16, 32, 32].into_iter().enumerate() {
        let stack = format!("features_extractor.cnn.{i}");
        expected.insert(format!("{stack}.conv.weight"), vec![c, input, 3, 3]);
        expected.insert(format!("{stack}.conv.bias"), vec![c]);
        for j in 0..2 {
            for k in 0..2 {
                let conv = format!("{stack}.res_block{j}.conv{k}");
                expected.insert(format!("{conv}.weight"), vec![c, c, 3, 3]);
                expected.insert(format!("{conv}.bias"), vec![c]);
            }
        }
        input = c;
    }
    // 84 -> 42 -> 21 -> 11.
    for (name, shape) in [
        (
            "features_extractor.linear.0.weight",
            vec![256, 32 * 11 * 11],
        ),
        ("features_extractor.linear.0.bias", vec![256]),
        ("action_net.weight", vec![6, 256]),
        ("action_net.bias", vec![6]),
        ("value_net.weight", vec![1, 256]),
        ("value_net.bias", vec![1]),
    ] {
        expected.insert(name.to_string(), shape);
    }
    assert_eq!(shapes, expected);
    // As PyTorch counts CleanRL's `ppo_procgen.py` Agent on 4x84x84 frames
    // with 6 actions (`benches/torch_cnn.py` builds it).
    assert_eq!(model.num_parameters(), 1_091_031);
}

#[test]
fn act_agrees_with_evaluate() {
    for (spec, hidden) in [
        (small_cnn([2, 7, 6]), vec![]),
        (small_cnn([3, 8, 8]), vec![16]),
        (small_impala([2, 7, 6]), vec![]),
        (small_impala([3, 9, 8]), vec![16]),
    ] {
        let mut spec = spec;
        spec.hidden = hidden;
        let d = spec.obs_dim;
        let model = ActorCritic::new(&spec, 3).unwrap();
        // Batches below and above the host kernel's crossover.
        for n in [1, 5, 40] {
            let obs = pixels(n, d, n as u64);
            let out = model
                .act(&obs, n, false, &mut rand::rngs::StdRng::seed_from_u64(1))
                .unwrap();
            let relay_nn::Actions::Discrete(actions) = &out.actions else {
                panic!("discrete")
            };
            let obs_t = Tensor::from_vec(obs.clone(), (n, d), &Device::Cpu).unwrap();
            let act_t = Tensor::from_vec(actions.clone(), n, &Device::Cpu).unwrap();
            let (lp, _, v) = model.evaluate(&obs_t, &act_t).unwrap();
            let lp: Vec<f32> = lp.to_vec1().unwrap();
            let v: Vec<f32> = v.to_vec1().unwrap();
            for i in 0..n {
                assert!(
                    (lp[i] - out.logprobs[i]).abs() < 1e-5,
                    "{i}: {lp:?} {:?}",
                    out.logprobs
                );
                assert!(
                    (v[i] - out.values[i]).abs() < 1e-5,
                    "{i}: {v:?} {:?}",
                    out.values
                );
            }
            assert_eq!(model.values(&obs, n).unwrap(), out.values);
        }
    }
}

/// `sum(logprob + value)` as a function of every parameter, checked against
/// central differences in f64-accurate steps on a few entries of each.
#[test]
fn gradients_match_finite_differences() {
    for spec in [small_cnn([2, 7, 6]), small_impala([2, 7, 6])] {
        check_gradients(spec);
    }
}

fn check_gradients(spec: PolicySpec) {
    let d = spec.obs_dim;
    let mut model = ActorCritic::new(&spec, 5).unwrap();
    let n = 3;
    let obs = Tensor::from_vec(pixels(n, d, 9), (n, d), &Device::Cpu).unwrap();
    let actions = Tensor::from_vec(vec![0u32, 2, 1], n, &Device::Cpu).unwrap();
    let objective = |m: &ActorCritic| -> candle_core::Tensor {
        let (lp, _, v) = m.evaluate(&obs, &actions).unwrap();
        (lp + v).unwrap().sum_all().unwrap()
    };
    let grads = objective(&model).backward().unwrap();
    let analytic: Vec<(String, Vec<f32>)> = model
        .parameter_names()
        .iter()
        .zip(model.vars())
        .map(|(name, var)| {
            let g = grads
                .get(var.as_tensor())
                .expect("every parameter has a gradient");
            (
                name.to_string(),
                g.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            )
        })
        .collect();
    let base = model.named_tensors();
    for (name, grad) in &analytic {
        let (_, _, values) = base.iter().find(|(n, _, _)| n == name).unwrap();
        for j in (0..values.len()).step_by(values.len().div_ceil(4)) {
            let eps = 1e-3f32;
            let mut at = |delta: f32| -> f32 {
                let mut tensors = base.clone();
                tensors.iter_mut().find(|(n, _, _)| n == name).unwrap().2[j] += delta;
                model.load_named_tensors(&tensors).unwrap();
                objective(&model).to_scalar::<f32>().unwrap()
            };
            // Piecewise linear (ReLUs, max-pools): a step that crosses a
            // kink on one side still has the gradient's slope on the other.
            let (below, here, above) = (at(-eps), at(0.0), at(eps));
            let slopes = [
                (above - below) / (2.0 * eps),
                (above - here) / eps,
                (here - below) / eps,
            ];
            assert!(
                slopes
                    .iter()
                    .any(|s| (s - grad[j]).abs() < 2e-2 * (1.0 + s.abs())),
                "{name}[{j}]: analytic {} vs numeric (central, forward, backward) {slopes:?}",
                grad[j]
            );
        }
        model.load_named_tensors(&base).unwrap();
    }
}

#[test]
fn spec_validation_names_the_problem() {
    let mut spec = small_cnn([2, 7, 6]);
    spec.obs_dim += 1;
    let err = ActorCritic::new(&spec, 0).unwrap_err().to_string();
    assert!(err.contains("cnn.input"), "{err}");
    let mut spec = PolicySpec::discrete(100, 3);
    spec.cnn = Some(CnnSpec {
        input: [1, 10, 10],
        ..CnnSpec::default()
    });
    let err = ActorCritic::new(&spec, 0).unwrap_err().to_string();
    assert!(
        err.contains("cnn.conv") && err.contains("does not fit"),
        "{err}"
    );
    let mut spec = small_impala([2, 7, 6]);
    spec.cnn.as_mut().unwrap().arch = CnnArch::Impala {
        channels: vec![],
        blocks: 2,
    };
    let err = ActorCritic::new(&spec, 0).unwrap_err().to_string();
    assert!(err.contains("cnn.channels"), "{err}");
}

#[test]
fn checkpoint_round_trip() {
    for (i, spec) in [small_cnn([2, 7, 6]), small_impala([2, 7, 6])]
        .into_iter()
        .enumerate()
    {
        let model = ActorCritic::new(&spec, 1).unwrap();
        let path = std::env::temp_dir().join(format!(
            "relay-nn-cnn-{}-{i}.safetensors",
            std::process::id()
        ));
        model.save(&path).unwrap();
        let mut other = ActorCritic::new(&spec, 2).unwrap();
        other.load(&path).unwrap();
        assert_eq!(other.named_tensors(), model.named_tensors());
        std::fs::remove_file(&path).unwrap();
        let tensors = model.named_tensors();
        let built =
            ActorCritic::from_named_tensors(&spec, TrunkLayout::Separate, &tensors).unwrap();
        assert_eq!(built.named_tensors(), tensors);
    }
}

/// A missing or an extra tensor is refused, naming it, and the model is
/// left as it was.
#[test]
fn impala_weights_with_a_missing_or_extra_tensor_are_refused_by_name() {
    let spec = small_impala([2, 7, 6]);
    let mut model = ActorCritic::new(&spec, 1).unwrap();
    let before = model.named_tensors();
    let name = "features_extractor.cnn.1.res_block1.conv0.weight";
    let missing: Vec<_> = before.iter().filter(|t| t.0 != name).cloned().collect();
    let err = model.load_named_tensors(&missing).unwrap_err().to_string();
    assert!(err.contains(name) && err.contains("missing"), "{err}");
    let err = ActorCritic::from_named_tensors(&spec, TrunkLayout::Separate, &missing)
        .unwrap_err()
        .to_string();
    assert!(err.contains(name), "{err}");
    let mut extra = before.clone();
    extra.push((
        "features_extractor.cnn.1.res_block2.conv0.weight".into(),
        vec![4, 4, 3, 3],
        vec![0.0; 144],
    ));
    let err = model.load_named_tensors(&extra).unwrap_err().to_string();
    assert!(
        err.contains("features_extractor.cnn.1.res_block2.conv0.weight")
            && err.contains("unexpected"),
        "{err}"
    );
    assert_eq!(model.named_tensors(), before);
}

// ------------------------------------------------------------ Q-networks

/// The Q-network of a DQN run on `policy` (SB3's DQN `CnnPolicy` with
/// `hidden: []`).
fn q_spec(policy: &PolicySpec) -> QNetSpec {
    let spec = QNetSpec::from_policy_spec(policy).unwrap();
    assert_eq!(
        spec.cnn, policy.cnn,
        "from_policy_spec carries the CNN over"
    );
    spec
}

#[test]
fn cnn_q_network_has_sb3_names_and_its_paths_agree() {
    let mut policy = PolicySpec::discrete(4 * 84 * 84, 6);
    policy.hidden = vec![];
    policy.cnn = Some(CnnSpec {
        input: [4, 84, 84],
        ..CnnSpec::default()
    });
    let q = QNetwork::new(&q_spec(&policy), 0).unwrap();
    let names = q.parameter_names();
    assert_eq!(
        names,
        [
            "features_extractor.cnn.0.bias",
            "features_extractor.cnn.0.weight",
            "features_extractor.cnn.2.bias",
            "features_extractor.cnn.2.weight",
            "features_extractor.cnn.4.bias",
            "features_extractor.cnn.4.weight",
            "features_extractor.linear.0.bias",
            "features_extractor.linear.0.weight",
            "q_net.0.bias",
            "q_net.0.weight",
        ]
    );
    // SB3's `DQN("CnnPolicy").q_net` on 6 actions: NatureCNN's 1,684,128
    // and a 512 -> 6 linear layer.
    assert_eq!(q.num_parameters(), 1_684_128 + 6 * 512 + 6);

    // Graph-free Q-values (acting, targets) and the training graph agree,
    // both architectures, with and without hidden layers and dueling.
    for (policy, hidden, dueling) in [
        (small_cnn([2, 7, 6]), vec![], false),
        (small_impala([2, 7, 6]), vec![], false),
        (small_impala([3, 9, 8]), vec![16], true),
    ] {
        let spec = QNetSpec {
            hidden,
            dueling,
            ..q_spec(&policy)
        };
        let q = QNetwork::new(&spec, 3).unwrap();
        let d = spec.obs_dim;
        for n in [1, 5, 40] {
            let obs = pixels(n, d, n as u64);
            let host = q.q_values(&obs, n).unwrap();
            let x = Tensor::from_vec(obs.clone(), (n, d), &Device::Cpu).unwrap();
            let graph: Vec<f32> = q
                .forward(&x)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap();
            assert_eq!(host.len(), n * 3);
            for (h, g) in host.iter().zip(&graph) {
                assert!((h - g).abs() < 1e-5, "{host:?}\n{graph:?}");
            }
            assert!(host.iter().any(|&v| v != 0.0));
            let greedy = q.greedy_actions(&obs, n).unwrap();
            for (row, a) in host.chunks_exact(3).zip(greedy) {
                assert!(row.iter().all(|&v| v <= row[a as usize]));
            }
        }
    }
}

/// DQN train steps on a fixed batch reach every parameter, the CNN's
/// included, and bring the TD loss down.
#[test]
fn dqn_train_steps_on_a_cnn_q_network_reduce_the_td_loss() {
    for policy in [small_cnn([2, 7, 6]), small_impala([2, 7, 6])] {
        let spec = q_spec(&policy);
        let online = QNetwork::new(&spec, 5).unwrap();
        let target = online.duplicate().unwrap();
        let (b, d) = (16, spec.obs_dim);
        let obs = pixels(b, d, 1);
        let next_obs = pixels(b, d, 2);
        let mut r = rand::rngs::StdRng::seed_from_u64(3);
        let actions: Vec<u32> = (0..b).map(|_| r.random_range(0..3)).collect();
        let returns: Vec<f32> = (0..b).map(|_| r.random_range(-1.0..1.0)).collect();
        let discounts: Vec<f32> = (0..b)
            .map(|i| if i % 4 == 0 { 0.0 } else { 0.99 })
            .collect();
        let batch = DqnBatch {
            obs: &obs,
            actions: &actions,
            returns: &returns,
            next_obs: &next_obs,
            discounts: &discounts,
            weights: None,
            next_masks: None,
        };
        let cfg = DqnLossConfig::default();
        let mut opt = Adam::new(
            online.vars(),
            AdamConfig {
                lr: 1e-2,
                ..Default::default()
            },
        )
        .unwrap();
        let mut losses = Vec::new();
        for step in 0..60 {
            let out = dqn_loss(&cfg, &online, &target, &batch).unwrap();
            let grads = out.loss.backward().unwrap();
            if step == 0 {
                for (name, var) in online.parameter_names().iter().zip(online.vars()) {
                    let g: Vec<f32> = grads
                        .get(&var)
                        .unwrap()
                        .flatten_all()
                        .unwrap()
                        .to_vec1()
                        .unwrap();
                    assert!(g.iter().any(|&x| x != 0.0), "{name} got no gradient");
                }
            }
            opt.step(&grads).unwrap();
            losses.push(out.stats.loss);
        }
        let (first, last) = (losses[0], losses[losses.len() - 1]);
        assert!(last < 0.5 * first, "{:?}: {losses:?}", policy.cnn);
    }
}

/// Target updates, checkpoints and weight messages carry the CNN's
/// parameters.
#[test]
fn cnn_q_network_targets_and_checkpoints_include_the_cnn() {
    let spec = q_spec(&small_impala([2, 7, 6]));
    let online = QNetwork::new(&spec, 1).unwrap();
    let target = QNetwork::new(&spec, 2).unwrap();
    let cnn_param = "features_extractor.cnn.0.res_block0.conv0.weight";
    let get = |q: &QNetwork| {
        q.named_tensors()
            .into_iter()
            .find(|t| t.0 == cnn_param)
            .unwrap()
            .2
    };
    let (t0, s) = (get(&target), get(&online));
    target.soft_update(&online, 0.25).unwrap();
    for ((t1, t0), s) in get(&target).iter().zip(&t0).zip(&s) {
        assert!((t1 - (0.75 * t0 + 0.25 * s)).abs() < 1e-6);
    }
    target.copy_from(&online).unwrap();
    assert_eq!(target.named_tensors(), online.named_tensors());
    assert_eq!(
        online.duplicate().unwrap().named_tensors(),
        online.named_tensors()
    );

    let path =
        std::env::temp_dir().join(format!("relay-nn-cnn-q-{}.safetensors", std::process::id()));
    online.save(&path).unwrap();
    let mut loaded = QNetwork::new(&spec, 9).unwrap();
    loaded.load(&path).unwrap();
    std::fs::remove_file(&path).unwrap();
    assert_eq!(loaded.named_tensors(), online.named_tensors());
    let obs = pixels(4, spec.obs_dim, 4);
    assert_eq!(
        loaded.q_values(&obs, 4).unwrap(),
        online.q_values(&obs, 4).unwrap()
    );

    let tensors = online.named_tensors();
    assert_eq!(
        QNetwork::from_named_tensors(&spec, &tensors)
            .unwrap()
            .named_tensors(),
        tensors
    );
    let missing: Vec<_> = tensors
        .iter()
        .filter(|t| t.0 != cnn_param)
        .cloned()
        .collect();
    let err = QNetwork::from_named_tensors(&spec, &missing)
        .unwrap_err()
        .to_string();
    assert!(err.contains(cnn_param), "{err}");
    // An MLP Q-network's weights do not load into a CNN one.
    let mlp = QNetwork::new(&QNetSpec::new(spec.obs_dim, 3), 0).unwrap();
    assert!(QNetwork::from_named_tensors(&spec, &mlp.named_tensors()).is_err());
}
