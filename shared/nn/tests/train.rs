//! Training path: gradients reach every parameter, the PPO loss matches a
//! composition of basic candle ops, a bandit is learned, Adam matches
//! PyTorch's update and resumes exactly, gradient clipping.

use candle_core::{Device, Tensor, Var};
use rand::{Rng, SeedableRng};
use relay_nn::{
    clip_grad_norm, ppo_loss, Actions, ActorCritic, Adam, AdamConfig, PolicySpec, PpoInputs,
    PpoLossConfig,
};

fn rng(seed: u64) -> rand::rngs::StdRng {
    rand::rngs::StdRng::seed_from_u64(seed)
}

fn tmp_path(name: &str) -> std::path::PathBuf {
    std::env::temp_dir().join(format!("relay-nn-test-{}-{name}", std::process::id()))
}

/// A minibatch collected by acting with `model` itself, with random advantages.
struct Batch {
    obs: Tensor,
    actions: Tensor,
    old_logprob: Vec<f32>,
    old_values: Vec<f32>,
    advantages: Vec<f32>,
    returns: Vec<f32>,
}

fn collect(model: &ActorCritic, n: usize, seed: u64) -> Batch {
    let mut r = rng(seed);
    let d = model.spec().obs_dim;
    let obs: Vec<f32> = (0..n * d).map(|_| r.random_range(-1.0..1.0)).collect();
    let out = model.act(&obs, n, false, &mut r).unwrap();
    let actions = match &out.actions {
        Actions::Discrete(a) => Tensor::new(a.as_slice(), &Device::Cpu).unwrap(),
        Actions::Continuous(a) => {
            Tensor::from_vec(a.clone(), (n, a.len() / n), &Device::Cpu).unwrap()
        }
    };
    let advantages: Vec<f32> = (0..n).map(|_| r.random_range(-1.0..1.0)).collect();
    let returns = advantages
        .iter()
        .zip(&out.values)
        .map(|(a, v)| a + v)
        .collect();
    Batch {
        obs: Tensor::from_vec(obs, (n, d), &Device::Cpu).unwrap(),
        actions,
        old_logprob: out.logprobs,
        old_values: out.values,
        advantages,
        returns,
    }
}

fn loss_of(model: &ActorCritic, b: &Batch, cfg: &PpoLossConfig) -> relay_nn::PpoLoss {
    let (lp, ent, v) = model.evaluate(&b.obs, &b.actions).unwrap();
    ppo_loss(
        cfg,
        &PpoInputs {
            logprob: &lp,
            entropy: &ent,
            values: &v,
            old_logprob: &b.old_logprob,
            old_values: &b.old_values,
            advantages: &b.advantages,
            returns: &b.returns,
        },
    )
    .unwrap()
}

#[test]
fn every_var_gets_a_nonzero_gradient() {
    let cfg = PpoLossConfig {
        ent_coef: 0.01,
        ..Default::default()
    };
    let mut cont = PolicySpec::continuous(3, vec![-1.0; 2], vec![1.0; 2]);
    cont.hidden = vec![16, 8];
    let mut relu = PolicySpec::discrete(4, 3);
    relu.activation = relay_nn::Activation::Relu;
    for spec in [PolicySpec::discrete(4, 2), cont, relu] {
        let model = ActorCritic::new(&spec, 0).unwrap();
        let batch = collect(&model, 32, 1);
        let out = loss_of(&model, &batch, &cfg);
        let grads = out.loss.backward().unwrap();
        for (name, var) in model.parameter_names().iter().zip(model.vars()) {
            let g = grads
                .get(&var)
                .unwrap_or_else(|| panic!("{spec:?}: no gradient for {name}"));
            assert_eq!(g.dims(), var.dims(), "{name}");
            let norm: f32 = g.sqr().unwrap().sum_all().unwrap().to_scalar().unwrap();
            assert!(
                norm > 0.0 && norm.is_finite(),
                "{spec:?}: gradient of {name} is {norm}"
            );
        }
    }
}

/// The same loss from basic candle ops (the way one would write it in PyTorch).
fn reference_loss(cfg: &PpoLossConfig, lp: &Tensor, ent: &Tensor, v: &Tensor, b: &Batch) -> Tensor {
    let dev = &Device::Cpu;
    let n = b.advantages.len();
    let t = |x: &[f32]| Tensor::from_slice(x, n, dev).unwrap();
    let adv = if cfg.normalize_advantage {
        relay_nn::normalize(&b.advantages)
    } else {
        b.advantages.clone()
    };
    let adv = t(&adv);
    let ratio = (lp - t(&b.old_logprob)).unwrap().exp().unwrap();
    let s1 = (&ratio * &adv).unwrap();
    let c = cfg.clip_range as f32;
    let s2 = (ratio.clamp(1.0 - c, 1.0 + c).unwrap() * &adv).unwrap();
    let pl = s1.minimum(&s2).unwrap().mean_all().unwrap().neg().unwrap();
    let old_v = t(&b.old_values);
    let pred = match cfg.clip_range_vf {
        None => v.clone(),
        Some(cv) => (&old_v + (v - &old_v).unwrap().clamp(-cv as f32, cv as f32).unwrap()).unwrap(),
    };
    let vl = (t(&b.returns) - pred)
        .unwrap()
        .sqr()
        .unwrap()
        .mean_all()
        .unwrap();
    let el = ent.mean_all().unwrap().neg().unwrap();
    ((pl + (vl * cfg.vf_coef).unwrap()).unwrap() + (el * cfg.ent_coef).unwrap()).unwrap()
}

#[test]
fn ppo_loss_matches_candle_composition_in_value_and_gradient() {
    let model =
        ActorCritic::new(&PolicySpec::continuous(3, vec![-1.0; 2], vec![1.0; 2]), 0).unwrap();
    let mut batch = collect(&model, 64, 3);
    // Move the policy away from the behaviour one so clipping is active.
    let mut r = rng(4);
    for (lp, v) in batch
        .old_logprob
        .iter_mut()
        .zip(batch.old_values.iter_mut())
    {
        *lp += r.random_range(-0.5..0.5);
        *v += r.random_range(-0.5..0.5);
    }
    for cfg in [
        PpoLossConfig::default(),
        PpoLossConfig {
            clip_range: 0.1,
            clip_range_vf: Some(0.2),
            ent_coef: 0.05,
            vf_coef: 0.7,
            normalize_advantage: false,
        },
    ] {
        let (lp, ent, v) = model.evaluate(&batch.obs, &batch.actions).unwrap();
        let out = ppo_loss(
            &cfg,
            &PpoInputs {
                logprob: &lp,
                entropy: &ent,
                values: &v,
                old_logprob: &batch.old_logprob,
                old_values: &batch.old_values,
                advantages: &batch.advantages,
                returns: &batch.returns,
            },
        )
        .unwrap();
        let reference = reference_loss(&cfg, &lp, &ent, &v, &batch);
        let (l, r): (f32, f32) = (
            out.loss.to_scalar().unwrap(),
            reference.to_scalar().unwrap(),
        );
        assert!((l - r).abs() < 1e-5 * (1.0 + r.abs()), "{l} vs {r}");
        assert!((out.stats.loss - l).abs() < 1e-6);
        assert!(
            out.stats.clip_fraction > 0.05,
            "clipping not exercised: {:?}",
            out.stats
        );
        if cfg.clip_range_vf.is_some() {
            assert!(out.stats.value_clip_fraction > 0.05, "{:?}", out.stats);
        }
        let g1 = out.loss.backward().unwrap();
        let g2 = reference.backward().unwrap();
        for var in model.vars() {
            let a: Vec<f32> = g1
                .get(&var)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap();
            let b: Vec<f32> = g2
                .get(&var)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap();
            let scale = b.iter().fold(0f32, |m, x| m.max(x.abs()));
            for (x, y) in a.iter().zip(&b) {
                assert!(
                    (x - y).abs() <= 1e-4 * scale + 1e-7,
                    "{x} vs {y} (scale {scale})"
                );
            }
        }
    }
}

/// A contextual bandit where action 0 is always better: a few hundred Adam
/// steps of PPO on fixed states must push P(a = 0) from 1/2 to near 1, and
/// the mirrored batch must push it to near 0.
#[test]
fn ppo_learns_a_bandit() {
    let spec = PolicySpec::discrete(4, 2);
    let mut r = rng(10);
    let n = 64;
    let obs: Vec<f32> = (0..n * 4).map(|_| r.random_range(-1.0..1.0)).collect();
    let x = Tensor::from_vec(obs.clone(), (n, 4), &Device::Cpu).unwrap();
    let p_first = |model: &ActorCritic| -> f64 {
        let out = model.act(&obs, n, true, &mut rng(0)).unwrap();
        let Actions::Discrete(a) = out.actions else {
            unreachable!()
        };
        // Probability of action 0 from the deterministic action's log-prob.
        a.iter()
            .zip(&out.logprobs)
            .map(|(&a, &lp)| {
                if a == 0 {
                    (lp as f64).exp()
                } else {
                    1.0 - (lp as f64).exp()
                }
            })
            .sum::<f64>()
            / n as f64
    };
    for good in [0i64, 1] {
        let model = ActorCritic::new(&spec, 5).unwrap();
        let p0 = p_first(&model);
        assert!((p0 - 0.5).abs() < 0.05, "initial P(a=0) {p0}");
        let mut opt = Adam::new(
            model.vars(),
            AdamConfig {
                lr: 1e-3,
                ..Default::default()
            },
        )
        .unwrap();
        let cfg = PpoLossConfig::default();
        let mut sampler = rng(good as u64);
        for _round in 0..30 {
            // Fresh "rollout": sample actions from the current policy.
            let out = model.act(&obs, n, false, &mut sampler).unwrap();
            let Actions::Discrete(acts) = out.actions else {
                unreachable!()
            };
            let adv: Vec<f32> = acts
                .iter()
                .map(|&a| if a == good { 1.0 } else { -1.0 })
                .collect();
            let returns = adv.clone();
            let a = Tensor::new(acts.as_slice(), &Device::Cpu).unwrap();
            for _epoch in 0..10 {
                let (lp, ent, v) = model.evaluate(&x, &a).unwrap();
                let loss = ppo_loss(
                    &cfg,
                    &PpoInputs {
                        logprob: &lp,
                        entropy: &ent,
                        values: &v,
                        old_logprob: &out.logprobs,
                        old_values: &out.values,
                        advantages: &adv,
                        returns: &returns,
                    },
                )
                .unwrap();
                let mut grads = loss.loss.backward().unwrap();
                clip_grad_norm(&mut grads, opt.vars(), 0.5).unwrap();
                opt.step(&grads).unwrap();
            }
        }
        let p = p_first(&model);
        eprintln!("good action {good}: P(a=0) {p0:.3} -> {p:.4}");
        if good == 0 {
            assert!(p > 0.95, "P(a=0) after training for action 0: {p}");
        } else {
            assert!(p < 0.05, "P(a=0) after training for action 1: {p}");
        }
    }
}

#[test]
fn adam_matches_the_pytorch_update() {
    // One var, two steps with hand-chosen gradients, against the formula in f64.
    let w0 = [0.5f32, -1.0, 2.0];
    let var = Var::from_slice(&w0, 3, &Device::Cpu).unwrap();
    let cfg = AdamConfig {
        lr: 0.1,
        beta1: 0.8,
        beta2: 0.9,
        eps: 1e-3,
        weight_decay: 0.01,
    };
    let mut opt = Adam::new(vec![var.clone()], cfg).unwrap();
    let coefs = [[1.0f32, -2.0, 0.5], [0.3, 0.3, -4.0]];
    let (mut p, mut m, mut v) = (w0.map(|x| x as f64), [0f64; 3], [0f64; 3]);
    for (t, c) in coefs.iter().enumerate() {
        // loss = sum(c * w) -> grad = c
        let loss = (var.as_tensor() * Tensor::new(c, &Device::Cpu).unwrap())
            .unwrap()
            .sum_all()
            .unwrap();
        opt.step(&loss.backward().unwrap()).unwrap();
        let t = (t + 1) as f64;
        for i in 0..3 {
            let g = c[i] as f64 + cfg.weight_decay * p[i];
            m[i] = cfg.beta1 * m[i] + (1.0 - cfg.beta1) * g;
            v[i] = cfg.beta2 * v[i] + (1.0 - cfg.beta2) * g * g;
            let mhat = m[i] / (1.0 - cfg.beta1.powf(t));
            let denom = v[i].sqrt() / (1.0 - cfg.beta2.powf(t)).sqrt() + cfg.eps;
            p[i] -= cfg.lr * mhat / denom;
        }
        let got: Vec<f32> = var.as_tensor().to_vec1().unwrap();
        for (g, e) in got.iter().zip(p) {
            assert!((*g as f64 - e).abs() < 1e-6, "step {t}: {g} vs {e}");
        }
    }
    assert_eq!(opt.step_count(), 2);
    opt.set_lr(0.5);
    assert_eq!(opt.lr(), 0.5);
    assert!(Adam::new(vec![var], AdamConfig { beta1: 1.0, ..cfg })
        .unwrap_err()
        .to_string()
        .contains("beta1"));
}

#[test]
fn adam_state_round_trip_resumes_exactly() {
    let spec = PolicySpec::discrete(4, 2);
    let cfg = PpoLossConfig::default();
    let adam_cfg = AdamConfig {
        lr: 3e-3,
        ..Default::default()
    };
    let a = ActorCritic::new(&spec, 1).unwrap();
    let mut opt_a = Adam::new(a.vars(), adam_cfg).unwrap();
    let batch = collect(&a, 32, 2);
    for _ in 0..5 {
        let mut g = loss_of(&a, &batch, &cfg).loss.backward().unwrap();
        clip_grad_norm(&mut g, opt_a.vars(), 0.5).unwrap();
        opt_a.step(&g).unwrap();
    }
    let (mpath, opath) = (
        tmp_path("resume-model.safetensors"),
        tmp_path("resume-adam.safetensors"),
    );
    a.save(&mpath).unwrap();
    opt_a.save(&opath).unwrap();

    // A different model and a fresh optimizer, restored from the files.
    let mut b = ActorCritic::new(&spec, 99).unwrap();
    b.load(&mpath).unwrap();
    let mut opt_b = Adam::new(b.vars(), adam_cfg).unwrap();
    opt_b.load(&opath).unwrap();
    assert_eq!(opt_b.step_count(), 5);
    assert_eq!(opt_b.state().unwrap(), opt_a.state().unwrap());

    for _ in 0..3 {
        for (m, opt) in [(&a, &mut opt_a), (&b, &mut opt_b)] {
            let mut g = loss_of(m, &batch, &cfg).loss.backward().unwrap();
            clip_grad_norm(&mut g, opt.vars(), 0.5).unwrap();
            opt.step(&g).unwrap();
        }
        assert_eq!(
            a.named_tensors(),
            b.named_tensors(),
            "diverged after resume"
        );
    }
    assert_eq!(opt_a.state().unwrap(), opt_b.state().unwrap());

    // Wrong shapes are refused and leave the optimizer unchanged.
    let other = ActorCritic::new(&PolicySpec::discrete(5, 2), 0).unwrap();
    let mut opt_c = Adam::new(other.vars(), adam_cfg).unwrap();
    let err = opt_c.load(&opath).unwrap_err().to_string();
    assert!(
        err.contains("expected shape") && err.contains("[64, 5]") && err.contains("[64, 4]"),
        "{err}"
    );
    assert_eq!(opt_c.step_count(), 0);
    // A model file is not an optimizer file.
    assert!(opt_b
        .load(&mpath)
        .unwrap_err()
        .to_string()
        .contains("format"));
    let _ = std::fs::remove_file(mpath);
    let _ = std::fs::remove_file(opath);
}

#[test]
fn clip_grad_norm_scales_to_max_norm() {
    let a = Var::from_slice(&[1.0f32, 2.0], 2, &Device::Cpu).unwrap();
    let b = Var::from_slice(&[3.0f32], 1, &Device::Cpu).unwrap();
    let unused = Var::from_slice(&[1.0f32], 1, &Device::Cpu).unwrap();
    let vars = vec![a.clone(), b.clone(), unused];
    // loss = 3 a0 + 4 a1 + 12 b -> grads [3, 4], [12]; norm 13.
    let loss = || {
        let ca = Tensor::new(&[3.0f32, 4.0], &Device::Cpu).unwrap();
        ((a.as_tensor() * ca).unwrap().sum_all().unwrap()
            + (b.as_tensor() * 12.0).unwrap().sum_all().unwrap())
        .unwrap()
    };
    let mut g = loss().backward().unwrap();
    let norm = clip_grad_norm(&mut g, &vars, 100.0).unwrap();
    assert!((norm - 13.0).abs() < 1e-5);
    assert_eq!(g.get(&a).unwrap().to_vec1::<f32>().unwrap(), vec![3.0, 4.0]);
    let mut g = loss().backward().unwrap();
    let norm = clip_grad_norm(&mut g, &vars, 1.3).unwrap();
    assert!((norm - 13.0).abs() < 1e-5);
    let ga: Vec<f32> = g.get(&a).unwrap().to_vec1().unwrap();
    let gb: Vec<f32> = g.get(&b).unwrap().to_vec1().unwrap();
    for (x, e) in ga.iter().chain(&gb).zip([0.3, 0.4, 1.2]) {
        assert!((x - e).abs() < 1e-5, "{x} vs {e}");
    }
    // The clipped gradients have the target norm.
    let n2: f32 = ga.iter().chain(&gb).map(|x| x * x).sum();
    assert!((n2.sqrt() - 1.3).abs() < 1e-4);
}
