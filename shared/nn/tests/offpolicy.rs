//! Off-policy learners: the Q-network and DQN loss (hand-computed targets,
//! terminated vs truncated, double DQN, Huber regimes, importance weights,
//! gradients), target-network updates, and SAC (log-prob correction against
//! a numeric check, gradients to every parameter, target updates, a step).

use std::sync::Arc;

use candle_core::{Device, Tensor, Var};
use rand::{Rng, SeedableRng};
use relay_nn::{
    dqn_loss, n_step_returns, sac_actor_loss, sac_critic_loss, sac_ent_coef_loss, sac_targets,
    sac_train_step, Activation, DqnBatch, DqnLossConfig, NamedTensor, Pair, QNetSpec, QNetwork,
    Sac, SacBatch, SacConfig, SacOptimizers, SacSpec,
};

fn rng(seed: u64) -> rand::rngs::StdRng {
    rand::rngs::StdRng::seed_from_u64(seed)
}

fn tmp_path(name: &str) -> std::path::PathBuf {
    std::env::temp_dir().join(format!("relay-nn-test-{}-{name}", std::process::id()))
}

fn close(a: &[f32], b: &[f32], tol: f32) {
    assert_eq!(a.len(), b.len(), "{a:?} vs {b:?}");
    for (x, y) in a.iter().zip(b) {
        assert!((x - y).abs() <= tol * (1.0 + y.abs()), "{a:?} vs {b:?}");
    }
}

fn get<'a>(t: &'a [NamedTensor], name: &str) -> &'a NamedTensor {
    t.iter().find(|(n, _, _)| n == name).unwrap()
}

/// A linear Q-network `Q(s) = W s + b` (no hidden layers) with given weights.
fn linear_q(w: &[f32], b: &[f32], obs_dim: usize) -> QNetwork {
    let spec = QNetSpec {
        obs_dim,
        n_actions: b.len(),
        hidden: vec![],
        activation: Activation::Relu,
        dueling: false,
        cnn: None,
    };
    let mut q = QNetwork::new(&spec, 0).unwrap();
    q.load_named_tensors(&[
        ("q_net.0.weight".into(), vec![b.len(), obs_dim], w.to_vec()),
        ("q_net.0.bias".into(), vec![b.len()], b.to_vec()),
    ])
    .unwrap();
    q
}

#[test]
fn q_network_names_shapes_and_paths_agree() {
    let spec = QNetSpec::new(4, 3);
    let q = QNetwork::new(&spec, 1).unwrap();
    assert_eq!(
        q.parameter_names(),
        vec![
            "q_net.0.bias",
            "q_net.0.weight",
            "q_net.2.bias",
            "q_net.2.weight",
            "q_net.4.bias",
            "q_net.4.weight"
        ]
    );
    assert_eq!(get(&q.named_tensors(), "q_net.4.weight").1, vec![3, 64]);
    // PyTorch default init bound 1/sqrt(fan_in).
    let named = q.named_tensors();
    let w0 = &get(&named, "q_net.0.weight").2;
    assert!(w0.iter().all(|x| x.abs() <= 0.5) && w0.iter().any(|x| x.abs() > 0.3));
    for dueling in [false, true] {
        let spec = QNetSpec {
            dueling,
            hidden: vec![16, 8],
            ..QNetSpec::new(4, 3)
        };
        let q = QNetwork::new(&spec, 2).unwrap();
        for n in [1usize, 5, 40] {
            let obs: Vec<f32> = (0..n * 4)
                .map(|i| ((i * 7 % 11) as f32 - 5.0) * 0.3)
                .collect();
            let host = q.q_values(&obs, n).unwrap();
            let graph = q
                .forward(&Tensor::from_slice(&obs, (n, 4), &Device::Cpu).unwrap())
                .unwrap();
            close(
                &host,
                &graph.flatten_all().unwrap().to_vec1().unwrap(),
                1e-5,
            );
        }
    }
    assert!(QNetwork::new(&QNetSpec::new(0, 2), 0).is_err());
    assert!(q.q_values(&[0.0; 3], 1).is_err());
}

#[test]
fn dueling_head_is_value_plus_centred_advantage() {
    let spec = QNetSpec {
        dueling: true,
        hidden: vec![],
        ..QNetSpec::new(2, 3)
    };
    let mut q = QNetwork::new(&spec, 0).unwrap();
    assert_eq!(
        q.parameter_names(),
        vec![
            "advantage_stream.bias",
            "advantage_stream.weight",
            "value_stream.bias",
            "value_stream.weight"
        ]
    );
    q.load_named_tensors(&[
        ("value_stream.weight".into(), vec![1, 2], vec![1.0, 2.0]),
        ("value_stream.bias".into(), vec![1], vec![0.5]),
        (
            "advantage_stream.weight".into(),
            vec![3, 2],
            vec![1.0, 0.0, 0.0, 1.0, 1.0, 1.0],
        ),
        ("advantage_stream.bias".into(), vec![3], vec![0.0, 0.0, 3.0]),
    ])
    .unwrap();
    // s = [1, 2]: V = 1 + 4 + 0.5 = 5.5; A = [1, 2, 6], mean 3.
    let out = q.q_values(&[1.0, 2.0], 1).unwrap();
    close(&out, &[3.5, 4.5, 8.5], 1e-6);
    assert_eq!(q.greedy_actions(&[1.0, 2.0], 1).unwrap(), vec![2]);
}

#[test]
fn epsilon_greedy_explores_at_the_given_rate() {
    let q = linear_q(&[1.0, 0.0, 0.0, 1.0, -1.0, -1.0], &[0.0, 0.0, 0.0], 2);
    let obs: Vec<f32> = [2.0f32, 1.0].repeat(1000);
    let mut r = rng(3);
    assert!(q
        .act_epsilon_greedy(&obs, 1000, 0.0, &mut r)
        .unwrap()
        .iter()
        .all(|&a| a == 0));
    let acts = q.act_epsilon_greedy(&obs, 1000, 0.3, &mut r).unwrap();
    let non_greedy = acts.iter().filter(|&&a| a != 0).count();
    // Expected 0.3 * 2/3 * 1000 = 200 non-greedy actions.
    assert!((150..250).contains(&non_greedy), "{non_greedy}");
    assert!(acts.iter().all(|&a| (0..3).contains(&a)));
    let all_random = q.act_epsilon_greedy(&obs, 1000, 1.0, &mut r).unwrap();
    for a in 0..3 {
        let c = all_random.iter().filter(|&&x| x == a).count();
        assert!((250..420).contains(&c), "action {a}: {c}");
    }
    assert!(q.act_epsilon_greedy(&obs, 1000, 1.5, &mut r).is_err());
}

#[test]
fn dqn_loss_hand_computed_terminated_truncated_double() {
    // Online Q(s) = [s0, s1]; target Q(s) = [2 s0, s1 + 1].
    let online = linear_q(&[1.0, 0.0, 0.0, 1.0], &[0.0, 0.0], 2);
    let target = linear_q(&[2.0, 0.0, 0.0, 1.0], &[0.0, 1.0], 2);
    let gamma = 0.9f32;
    // Three transitions of one env: step 0 normal, step 1 truncated, step 2 terminated.
    let rewards = [1.0, 2.0, 3.0];
    let nst = n_step_returns(
        &rewards,
        &[false, false, true],
        &[false, true, false],
        1,
        gamma,
    )
    .unwrap();
    assert_eq!(nst.discounts, vec![0.9, 0.9, 0.0]);
    let obs = [1.0, 0.0, 0.0, 1.0, 2.0, 2.0];
    // s' of step 0; final obs of truncated step 1; (ignored) s' of step 2.
    let next_obs = [3.0, 1.0, 1.0, 4.0, 100.0, 100.0];
    let actions = [0u32, 1, 1];
    let batch = DqnBatch {
        obs: &obs,
        actions: &actions,
        returns: &nst.returns,
        next_obs: &next_obs,
        discounts: &nst.discounts,
        weights: None,
        next_masks: None,
    };
    let out = dqn_loss(&DqnLossConfig::default(), &online, &target, &batch).unwrap();
    // Target maxes: s'=[3,1] -> [6, 2] -> 6; s'=[1,4] -> [2, 5] -> 5.
    let y = [1.0 + 0.9 * 6.0, 2.0 + 0.9 * 5.0, 3.0];
    close(&out.targets, &y, 1e-6);
    let q = [1.0, 1.0, 2.0];
    let td: Vec<f32> = q.iter().zip(&y).map(|(q, y)| q - y).collect();
    close(&out.td_errors, &td, 1e-6);
    // All |td| > 1: Huber is |td| - 0.5.
    let loss: f32 = td.iter().map(|t| t.abs() - 0.5).sum::<f32>() / 3.0;
    assert!((out.stats.loss - loss).abs() < 1e-5);
    assert!((out.loss.to_scalar::<f32>().unwrap() - loss).abs() < 1e-5);

    // Double DQN: online picks argmax of [3, 1] = 0 and [1, 4] = 1: same as
    // target here; make them differ with s' = [1, 1.5]: online picks 1
    // (1.5), target values it 2.5 instead of its own max 2.5 vs 2 -> pick.
    let next2 = [1.0, 1.5, 1.0, 1.5, 0.0, 0.0];
    let b2 = DqnBatch {
        next_obs: &next2,
        ..batch
    };
    let plain = dqn_loss(&DqnLossConfig::default(), &online, &target, &b2).unwrap();
    let double = dqn_loss(
        &DqnLossConfig {
            double_q: true,
            ..Default::default()
        },
        &online,
        &target,
        &b2,
    )
    .unwrap();
    // target(s') = [2, 2.5]: plain max 2.5 (action 1); online(s') = [1, 1.5] -> action 1 too.
    close(&plain.targets[..1], &[1.0 + 0.9 * 2.5], 1e-6);
    close(&double.targets[..1], &[1.0 + 0.9 * 2.5], 1e-6);
    // An online net preferring action 0 makes double DQN use target's action-0 value 2.
    let online0 = linear_q(&[0.0, 0.0, 0.0, 0.0], &[1.0, 0.0], 2);
    let double0 = dqn_loss(
        &DqnLossConfig {
            double_q: true,
            ..Default::default()
        },
        &online0,
        &target,
        &b2,
    )
    .unwrap();
    close(
        &double0.targets,
        &[1.0 + 0.9 * 2.0, 2.0 + 0.9 * 2.0, 3.0],
        1e-6,
    );
}

#[test]
fn dqn_loss_gradient_weights_and_huber_regimes() {
    // Q(s) = W s + b with 2 actions, obs_dim 2.
    let w = [0.5, -0.5, 1.0, 0.25];
    let online = linear_q(&w, &[0.1, -0.2], 2);
    let target = linear_q(&[0.0; 4], &[0.0, 0.0], 2);
    let obs = [1.0, 2.0, -1.0, 0.5];
    let actions = [1u32, 0];
    // Targets are just the returns (target net outputs 0).
    let returns = [2.0f32, -0.3];
    let weights = [0.5f32, 2.0];
    let out = dqn_loss(
        &DqnLossConfig::default(),
        &online,
        &target,
        &DqnBatch {
            obs: &obs,
            actions: &actions,
            returns: &returns,
            next_obs: &[0.0; 4],
            discounts: &[0.99, 0.99],
            weights: Some(&weights),
            next_masks: None,
        },
    )
    .unwrap();
    // q(s0, a1) = 1 + 0.5 - 0.2 = 1.3, td -0.7 (quadratic); q(s1, a0) = -0.5 - 0.25 + 0.1 = -0.65, td -0.35.
    close(&out.td_errors, &[-0.7, -0.35], 1e-6);
    let loss = (0.5 * 0.5 * 0.49 + 2.0 * 0.5 * 0.35 * 0.35) / 2.0;
    assert!((out.stats.loss - loss).abs() < 1e-6);
    let vars = online.vars(); // sorted: bias, weight
    let grads = out.loss.backward().unwrap();
    let gb: Vec<f32> = grads.get(&vars[0]).unwrap().to_vec1().unwrap();
    let gw: Vec<f32> = grads
        .get(&vars[1])
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap();
    // d/dq = w * td / B at the taken action.
    let (g0, g1) = (0.5 * -0.7 / 2.0, 2.0 * -0.35 / 2.0);
    close(&gb, &[g1, g0], 1e-6);
    close(&gw, &[-g1, g1 * 0.5, g0, g0 * 2.0], 1e-6);

    // Linear regime with a small delta: slope delta * sign.
    let out = dqn_loss(
        &DqnLossConfig {
            huber_delta: 0.5,
            ..Default::default()
        },
        &online,
        &target,
        &DqnBatch {
            obs: &obs,
            actions: &actions,
            returns: &returns,
            next_obs: &[0.0; 4],
            discounts: &[0.0, 0.0],
            weights: None,
            next_masks: None,
        },
    )
    .unwrap();
    let loss = (0.5 * (0.7 - 0.25) + 0.5 * 0.35 * 0.35) / 2.0;
    assert!((out.stats.loss - loss).abs() < 1e-6);
    let grads = out.loss.backward().unwrap();
    let gb: Vec<f32> = grads.get(&vars[0]).unwrap().to_vec1().unwrap();
    close(&gb, &[-0.35 / 2.0, -0.5 / 2.0], 1e-6);
    // Bad inputs are refused.
    assert!(dqn_loss(
        &DqnLossConfig::default(),
        &online,
        &target,
        &DqnBatch {
            obs: &obs,
            actions: &[0, 2],
            returns: &returns,
            next_obs: &[0.0; 4],
            discounts: &[0.0, 0.0],
            weights: None,
            next_masks: None,
        },
    )
    .is_err());
}

#[test]
fn dqn_gradients_reach_every_parameter_and_training_fits_targets() {
    for dueling in [false, true] {
        let spec = QNetSpec {
            dueling,
            hidden: vec![32, 32],
            ..QNetSpec::new(3, 4)
        };
        let online = QNetwork::new(&spec, 5).unwrap();
        let target = online.duplicate().unwrap();
        assert_eq!(online.named_tensors(), target.named_tensors());
        let mut r = rng(6);
        let b = 64;
        let obs: Vec<f32> = (0..b * 3).map(|_| r.random_range(-1.0..1.0)).collect();
        let actions: Vec<u32> = (0..b).map(|_| r.random_range(0..4)).collect();
        let returns: Vec<f32> = obs.chunks(3).map(|o| o[0] - 2.0 * o[1]).collect();
        let batch = DqnBatch {
            obs: &obs,
            actions: &actions,
            returns: &returns,
            next_obs: &obs,
            discounts: &vec![0.0; b],
            weights: None,
            next_masks: None,
        };
        let out = dqn_loss(&DqnLossConfig::default(), &online, &target, &batch).unwrap();
        let grads = out.loss.backward().unwrap();
        for (name, var) in online.parameter_names().iter().zip(online.vars()) {
            let g: Vec<f32> = grads
                .get(&var)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap();
            assert!(
                g.iter().any(|&x| x != 0.0),
                "{name} (dueling {dueling}) got no gradient"
            );
        }
        // A few hundred Adam steps fit the targets.
        let mut opt = relay_nn::Adam::new(
            online.vars(),
            relay_nn::AdamConfig {
                lr: 3e-3,
                ..Default::default()
            },
        )
        .unwrap();
        let first = out.stats.loss;
        let mut last = first;
        for _ in 0..300 {
            let out = dqn_loss(&DqnLossConfig::default(), &online, &target, &batch).unwrap();
            opt.step(&out.loss.backward().unwrap()).unwrap();
            last = out.stats.loss;
        }
        assert!(last < 0.1 * first, "dueling {dueling}: {first} -> {last}");
    }
}

#[test]
fn target_updates_copy_and_move_by_tau() {
    let spec = QNetSpec {
        hidden: vec![8],
        ..QNetSpec::new(3, 2)
    };
    let online = QNetwork::new(&spec, 1).unwrap();
    let target = QNetwork::new(&spec, 2).unwrap();
    let before = target.named_tensors();
    let src = online.named_tensors();
    target.soft_update(&online, 0.25).unwrap();
    for ((_, _, t0), ((name, _, s), (_, _, t1))) in before
        .iter()
        .zip(src.iter().zip(target.named_tensors().iter()))
    {
        let expect: Vec<f32> = t0.iter().zip(s).map(|(t, s)| 0.75 * t + 0.25 * s).collect();
        close(t1, &expect, 1e-6);
        assert!(t1 != t0, "{name} did not move");
    }
    target.soft_update(&online, 1.0).unwrap();
    assert_eq!(target.named_tensors(), online.named_tensors());
    let other = QNetwork::new(&QNetSpec::new(3, 2), 0).unwrap();
    assert!(target.copy_from(&other).is_err());
    assert!(target.soft_update(&online, 1.5).is_err());
    // Save / load round trip.
    let path = tmp_path("qnet.safetensors");
    online.save(&path).unwrap();
    let mut loaded = QNetwork::new(&spec, 9).unwrap();
    loaded.load(&path).unwrap();
    assert_eq!(loaded.named_tensors(), online.named_tensors());
    std::fs::remove_file(&path).unwrap();
}

// ------------------------------------------------------------------- SAC

fn sac_spec() -> SacSpec {
    SacSpec {
        hidden: vec![32, 32],
        ..SacSpec::new(3, vec![-2.0, 0.0], vec![2.0, 1.0])
    }
}

#[test]
fn squashed_logprob_matches_numeric_density() {
    let sac = Sac::new(&sac_spec(), 1.0, 0).unwrap();
    // 1-D check on the first dimension: m = 0.3, log std -0.2.
    let (m, s) = (0.3f64, -0.2f64);
    let sigma = s.exp();
    let us = [-8.0f64, -3.0, -0.5, 0.0, 0.4, 2.0, 6.0];
    let b = us.len();
    let mean = Tensor::from_vec(vec![m as f32; b * 2], (b, 2), &Device::Cpu).unwrap();
    let log_std = Tensor::from_vec(vec![s as f32; b * 2], (b, 2), &Device::Cpu).unwrap();
    // Dimension 0 at u, dimension 1 at its mean (eps 0).
    let eps: Vec<f32> = us
        .iter()
        .flat_map(|u| [((u - m) / sigma) as f32, 0.0])
        .collect();
    let out = sac
        .actor
        .sample_with_noise(&mean, &log_std, Arc::from(eps))
        .unwrap();
    let lp: Vec<f32> = out.logprob.to_vec1().unwrap();
    let acts: Vec<f32> = out.actions.flatten_all().unwrap().to_vec1().unwrap();
    let log_n =
        |u: f64| -0.5 * ((u - m) / sigma).powi(2) - s - 0.5 * (2.0 * std::f64::consts::PI).ln();
    for (i, &u) in us.iter().enumerate() {
        // Numeric |dy/du| by central differences of tanh.
        let h = 1e-5;
        let dy = ((u + h).tanh() - (u - h).tanh()) / (2.0 * h);
        let expect = log_n(u) - dy.ln() + (log_n(m) - 0.0); // second dim: u = m
        let expect = expect - (1.0 - m.tanh().powi(2)).ln();
        if dy > 1e-12 {
            assert!(
                (lp[i] as f64 - expect).abs() < 2e-3 * (1.0 + expect.abs()),
                "u {u}: {} vs {expect}",
                lp[i]
            );
        }
        assert!(lp[i].is_finite(), "u {u}");
        assert!((acts[2 * i] as f64 - u.tanh()).abs() < 1e-6);
    }
    // Far in the tail the stable form stays finite where log(1 - tanh^2) is -inf in f32.
    assert!(((8.0f32).tanh().powi(2) - 1.0).abs() < 1e-6);

    // The squashed density integrates to 1 over (-1, 1) (1-D: the second
    // dimension's term is removed by subtracting its log-density at eps 0).
    let n = 4000;
    let ys: Vec<f64> = (0..n)
        .map(|k| -1.0 + (k as f64 + 0.5) * 2.0 / n as f64)
        .collect();
    let mean = Tensor::from_vec(vec![m as f32; n * 2], (n, 2), &Device::Cpu).unwrap();
    let log_std = Tensor::from_vec(vec![s as f32; n * 2], (n, 2), &Device::Cpu).unwrap();
    let eps: Vec<f32> = ys
        .iter()
        .flat_map(|y| [((y.atanh() - m) / sigma) as f32, 0.0])
        .collect();
    let lp: Vec<f32> = sac
        .actor
        .sample_with_noise(&mean, &log_std, Arc::from(eps))
        .unwrap()
        .logprob
        .to_vec1()
        .unwrap();
    let second = log_n(m) - (1.0 - m.tanh().powi(2)).ln();
    let integral: f64 = lp
        .iter()
        .map(|&l| (l as f64 - second).exp() * 2.0 / n as f64)
        .sum();
    assert!((integral - 1.0).abs() < 2e-3, "{integral}");
}

#[test]
fn squashed_gaussian_gradient_matches_composition() {
    let sac = Sac::new(&sac_spec(), 1.0, 0).unwrap();
    let dev = &Device::Cpu;
    let mean = Var::from_vec(vec![0.3f32, -1.2, 2.0, 0.1, -0.4, 0.7], (3, 2), dev).unwrap();
    let log_std = Var::from_vec(vec![-0.5f32, 0.2, 0.0, -1.0, 0.4, -0.1], (3, 2), dev).unwrap();
    let eps = vec![0.5f32, -1.0, 1.5, 0.2, -0.3, 2.0];
    let out = sac
        .actor
        .sample_with_noise(&mean, &log_std, Arc::from(eps.clone()))
        .unwrap();
    let e = Tensor::from_vec(eps, (3, 2), dev).unwrap();
    let u = (mean.as_tensor() + (log_std.exp().unwrap() * &e).unwrap()).unwrap();
    let y = u.tanh().unwrap();
    // log(1 - tanh^2) = 2 (ln 2 - u - softplus(-2u)), softplus composed directly (moderate u).
    let softplus = ((u.affine(-2.0, 0.0).unwrap().exp().unwrap() + 1.0).unwrap())
        .log()
        .unwrap();
    let corr = ((u.neg().unwrap() - softplus).unwrap() + std::f64::consts::LN_2)
        .unwrap()
        .affine(2.0, 0.0)
        .unwrap();
    let log_n = ((e.sqr().unwrap() * -0.5).unwrap() - log_std.as_tensor()).unwrap()
        - 0.5 * (2.0 * std::f64::consts::PI).ln();
    let lp = (log_n.unwrap() - corr).unwrap().sum(1).unwrap();
    close(
        &out.logprob.to_vec1::<f32>().unwrap(),
        &lp.to_vec1::<f32>().unwrap(),
        1e-5,
    );
    let c = Tensor::new(&[[1.0f32, -2.0], [0.5, 3.0], [-1.0, 0.25]], dev).unwrap();
    let d = Tensor::new(&[0.7f32, -1.3, 2.0], dev).unwrap();
    let f = |y: &Tensor, lp: &Tensor| {
        ((y * &c).unwrap().sum_all().unwrap() + (lp * &d).unwrap().sum_all().unwrap()).unwrap()
    };
    let g1 = f(&out.actions, &out.logprob).backward().unwrap();
    let g2 = f(&y, &lp).backward().unwrap();
    for v in [&mean, &log_std] {
        close(
            &g1.get(v)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap(),
            &g2.get(v)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap(),
            1e-4,
        );
    }
}

/// `(obs, actions, returns, next_obs, discounts)`.
type SacData = (Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>);

fn sac_batch((obs, actions, returns, next_obs, discounts): &SacData) -> SacBatch<'_> {
    SacBatch {
        obs,
        actions,
        returns,
        next_obs,
        discounts,
    }
}

fn sac_batch_data(spec: &SacSpec, b: usize, seed: u64) -> SacData {
    let mut r = rng(seed);
    let d = spec.obs_dim;
    let a = spec.action_dim();
    let obs: Vec<f32> = (0..b * d).map(|_| r.random_range(-1.0..1.0)).collect();
    let actions: Vec<f32> = (0..b * a)
        .map(|i| r.random_range(spec.low[i % a]..spec.high[i % a]))
        .collect();
    let rewards: Vec<f32> = (0..b).map(|_| r.random_range(-1.0..1.0)).collect();
    let next_obs: Vec<f32> = (0..b * d).map(|_| r.random_range(-1.0..1.0)).collect();
    let discounts: Vec<f32> = (0..b)
        .map(|i| if i % 5 == 0 { 0.0 } else { 0.99 })
        .collect();
    (obs, actions, rewards, next_obs, discounts)
}

#[test]
fn sac_gradients_reach_every_parameter() {
    let spec = sac_spec();
    let sac = Sac::new(&spec, 0.5, 1).unwrap();
    let data = sac_batch_data(&spec, 32, 2);
    let (obs, next_obs) = (&data.0, &data.3);
    let batch = sac_batch(&data);
    let mut r = rng(3);
    let pair = Pair::sequential();
    let next_t = Tensor::from_slice(next_obs, (32, 3), &Device::Cpu).unwrap();
    let next = sac.actor.sample(&next_t, &mut r).unwrap();
    let targets = sac_targets(&sac, &batch, &next, 0.5, &pair).unwrap();
    let (loss0, _, _) = sac_critic_loss(&sac, 0, &batch, &targets).unwrap();
    let (loss1, _, _) = sac_critic_loss(&sac, 1, &batch, &targets).unwrap();
    let g = (loss0 + loss1).unwrap().backward().unwrap();
    let nonzero = |g: &candle_core::backprop::GradStore, v: &Var| {
        g.get(v).is_some_and(|t| {
            t.flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap()
                .iter()
                .any(|&x| x != 0.0)
        })
    };
    for v in sac.critic.vars() {
        assert!(nonzero(&g, &v), "critic var {:?} got no gradient", v.dims());
    }
    for v in sac.critic_target.vars().iter().chain(&sac.actor.vars()) {
        assert!(g.get(v).is_none(), "critic loss reached a non-critic var");
    }
    let obs_t = Tensor::from_slice(obs, (32, 3), &Device::Cpu).unwrap();
    let sample = sac.actor.sample(&obs_t, &mut r).unwrap();
    let (actor_loss, actor_value) =
        sac_actor_loss(&sac.critic, &obs_t, &sample, 0.5, &pair).unwrap();
    let g = actor_loss.backward().unwrap();
    for (name, v) in sac.actor.parameter_names().iter().zip(sac.actor.vars()) {
        assert!(nonzero(&g, &v), "actor {name} got no gradient");
    }
    for v in sac.critic.vars() {
        assert!(g.get(&v).is_none(), "the actor loss reached a critic var");
    }
    // The same value and actor gradients as autograd through
    // `mean(α log π - min(Q_0, Q_1))` composed from candle ops.
    let (q0, q1) = sac.critic.forward(&obs_t, &sample.actions).unwrap();
    let reference = ((&sample.logprob * 0.5).unwrap() - q0.minimum(&q1).unwrap())
        .unwrap()
        .mean_all()
        .unwrap();
    assert!((reference.to_scalar::<f32>().unwrap() - actor_value).abs() < 1e-5);
    let g_ref = reference.backward().unwrap();
    for v in sac.actor.vars() {
        let got: Vec<f32> = g.get(&v).unwrap().flatten_all().unwrap().to_vec1().unwrap();
        let want: Vec<f32> = g_ref
            .get(&v)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        close(&got, &want, 1e-5);
    }
    let lp: Vec<f32> = sample.logprob.to_vec1().unwrap();
    let (ent_loss, value) = sac_ent_coef_loss(&sac.log_ent_coef, &lp, -2.0).unwrap();
    let g = ent_loss.backward().unwrap();
    assert!(nonzero(&g, &sac.log_ent_coef));
    let mean_lp = lp.iter().sum::<f32>() / lp.len() as f32;
    assert!((value - (-(0.5f32.ln()) * (mean_lp - 2.0))).abs() < 1e-5);
}

#[test]
fn sac_targets_hand_check_and_train_step() {
    let spec = sac_spec();
    let sac = Sac::new(&spec, 1.0, 4).unwrap();
    // Targets start equal to the critics.
    let t0: Vec<Vec<f32>> = sac
        .critic_target
        .named_tensors()
        .into_iter()
        .map(|t| t.2)
        .collect();
    let c0: Vec<Vec<f32>> = sac
        .critic
        .named_tensors()
        .into_iter()
        .map(|t| t.2)
        .collect();
    assert_eq!(t0, c0);
    let data = sac_batch_data(&spec, 16, 5);
    let (obs, returns, next_obs, discounts) = (&data.0, &data.2, &data.3, &data.4);
    let batch = sac_batch(&data);
    // Terminated samples (discount 0) have target = reward exactly.
    let next = Tensor::from_slice(next_obs, (16, 3), &Device::Cpu).unwrap();
    let s = sac.actor.sample(&next, &mut rng(1)).unwrap();
    let targets = sac_targets(&sac, &batch, &s, 0.2, &Pair::new(2).unwrap()).unwrap();
    for i in (0..16).step_by(5) {
        assert_eq!(targets[i], returns[i]);
    }
    // target = r + γ (min Q' - α logπ), recomputed from the parts.
    let (q0, q1) = sac.critic_target.forward(&next, &s.actions).unwrap();
    let q0: Vec<f32> = q0.to_vec1().unwrap();
    let q1: Vec<f32> = q1.to_vec1().unwrap();
    let lp: Vec<f32> = s.logprob.to_vec1().unwrap();
    let expect: Vec<f32> = (0..16)
        .map(|i| returns[i] + discounts[i] * (q0[i].min(q1[i]) - 0.2 * lp[i]))
        .collect();
    close(&targets, &expect, 1e-5);

    let cfg = SacConfig::default();
    let mut opt = SacOptimizers::new(&sac, &cfg).unwrap();
    let actor0 = sac.actor.named_tensors();
    let mut r = rng(7);
    let stats =
        sac_train_step(&cfg, &sac, &mut opt, &batch, &mut r, &Pair::new(2).unwrap()).unwrap();
    assert_eq!(stats.ent_coef, 1.0);
    assert!(stats.critic_loss.is_finite() && stats.actor_loss.is_finite());
    // Every part moved.
    assert_ne!(sac.actor.named_tensors(), actor0);
    let c1: Vec<Vec<f32>> = sac
        .critic
        .named_tensors()
        .into_iter()
        .map(|t| t.2)
        .collect();
    let t1: Vec<Vec<f32>> = sac
        .critic_target
        .named_tensors()
        .into_iter()
        .map(|t| t.2)
        .collect();
    // Targets moved by tau towards the updated critics.
    for ((t0, t1), c1) in t0.iter().zip(&t1).zip(&c1) {
        let expect: Vec<f32> = t0
            .iter()
            .zip(c1)
            .map(|(t, c)| t * 0.995 + 0.005 * c)
            .collect();
        close(t1, &expect, 1e-6);
    }
    // α moves against the entropy gap: log α' = -lr * sign(-(mean logπ + target)).
    let alpha = sac.ent_coef().unwrap();
    let gap = stats.logprob_mean + cfg.target_entropy_for(2);
    assert!(
        if gap > 0.0 { alpha > 1.0 } else { alpha < 1.0 },
        "{alpha} {gap}"
    );
    // Actions in bounds.
    let a = sac.actor.act(obs, 16, false, &mut r).unwrap();
    for (i, x) in a.iter().enumerate() {
        assert!(*x >= spec.low[i % 2] && *x <= spec.high[i % 2]);
    }
    let det = sac.actor.act(obs, 16, true, &mut r).unwrap();
    let (mu, _) = sac
        .actor
        .distribution(&Tensor::from_slice(obs, (16, 3), &Device::Cpu).unwrap())
        .unwrap();
    let mut expect: Vec<f32> = mu
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap()
        .iter()
        .map(|m| m.tanh())
        .collect();
    sac.actor.to_env_units(&mut expect);
    close(&det, &expect, 1e-5);
    // A standalone actor (inference server) loads the actor's tensors and acts the same.
    let mut standalone = relay_nn::SacActor::new(&spec, 123).unwrap();
    standalone
        .load_named_tensors(&sac.actor.named_tensors())
        .unwrap();
    close(&standalone.act(obs, 16, true, &mut r).unwrap(), &det, 0.0);
    // Checkpoint round trip.
    let path = tmp_path("sac.safetensors");
    sac.save(&path).unwrap();
    let mut other = Sac::new(&spec, 1.0, 99).unwrap();
    other.load(&path).unwrap();
    assert_eq!(other.named_tensors(), sac.named_tensors());
    std::fs::remove_file(&path).unwrap();
}

#[test]
fn sac_learns_a_continuous_bandit() {
    // One-step episodes: reward -(a - 0.5 s0)^2 with actions in [-1, 1]; the
    // deterministic action must approach 0.5 s0 (and the sample's spread
    // shrink as α is tuned down towards the entropy target).
    let spec = SacSpec {
        hidden: vec![64, 64],
        ..SacSpec::new(2, vec![-1.0], vec![1.0])
    };
    let sac = Sac::new(&spec, 1.0, 11).unwrap();
    let cfg = SacConfig {
        lr: 3e-3,
        ..Default::default()
    };
    let mut opt = SacOptimizers::new(&sac, &cfg).unwrap();
    let mut r = rng(12);
    let b = 64;
    let error = |sac: &Sac, r: &mut rand::rngs::StdRng| -> f32 {
        let obs: Vec<f32> = (0..200 * 2).map(|_| r.random_range(-1.0..1.0)).collect();
        let a = sac.actor.act(&obs, 200, true, r).unwrap();
        a.iter()
            .zip(obs.chunks(2))
            .map(|(a, o)| (a - 0.5 * o[0]).abs())
            .sum::<f32>()
            / 200.0
    };
    let before = error(&sac, &mut r);
    let pair = Pair::new(2).unwrap();
    for _ in 0..400 {
        let obs: Vec<f32> = (0..b * 2).map(|_| r.random_range(-1.0..1.0)).collect();
        let actions = sac.actor.act(&obs, b, false, &mut r).unwrap();
        let rewards: Vec<f32> = actions
            .iter()
            .zip(obs.chunks(2))
            .map(|(a, o)| -(a - 0.5 * o[0]).powi(2))
            .collect();
        sac_train_step(
            &cfg,
            &sac,
            &mut opt,
            &SacBatch {
                obs: &obs,
                actions: &actions,
                returns: &rewards,
                next_obs: &obs,
                discounts: &vec![0.0; b],
            },
            &mut r,
            &pair,
        )
        .unwrap();
    }
    let after = error(&sac, &mut r);
    eprintln!(
        "SAC bandit mean |a - a*|: {before:.3} -> {after:.3}, alpha {}",
        sac.ent_coef().unwrap()
    );
    assert!(after < 0.1 && after < 0.5 * before, "{before} -> {after}");
}

#[test]
fn sac_steps_on_one_and_two_threads_agree_exactly() {
    let spec = sac_spec();
    let data = sac_batch_data(&spec, 64, 21);
    let batch = sac_batch(&data);
    let cfg = SacConfig::default();
    let run = |threads: usize| {
        let sac = Sac::new(&spec, 1.0, 22).unwrap();
        let mut opt = SacOptimizers::new(&sac, &cfg).unwrap();
        let pair = Pair::new(threads).unwrap();
        let mut r = rng(23);
        let stats: Vec<_> = (0..5)
            .map(|_| sac_train_step(&cfg, &sac, &mut opt, &batch, &mut r, &pair).unwrap())
            .collect();
        (stats, sac.named_tensors())
    };
    let (one, two) = (run(1), run(2));
    assert_eq!(one.0, two.0);
    assert_eq!(one.1, two.1);
}
