//! The path a GPU takes (models placed with `to_device`, ops composed from
//! candle's basic ops, losses attached by composition, optimizer moments as
//! tensors) run on the CPU inside `composed_on_cpu`, against the fused CPU
//! path: the same actions, losses and parameters after several PPO and DQN
//! steps, for MLPs and for NatureCNN and IMPALA's ResNet at Atari's size.

use candle_core::{Device, Tensor};
use rand::{Rng, SeedableRng};
use relay_nn::ops::composed_on_cpu;
use relay_nn::{
    clip_grad_norm, dqn_loss, ppo_loss, Actions, ActorCritic, Adam, AdamConfig, CnnArch, CnnSpec,
    DqnBatch, DqnLossConfig, PolicySpec, PpoInputs, PpoLossConfig, QNetSpec, QNetwork,
};

fn rng(seed: u64) -> rand::rngs::StdRng {
    rand::rngs::StdRng::seed_from_u64(seed)
}

fn nature_cnn(actions: usize) -> PolicySpec {
    let mut spec = PolicySpec::discrete(4 * 84 * 84, actions);
    spec.hidden = vec![];
    spec.cnn = Some(CnnSpec {
        input: [4, 84, 84],
        ..CnnSpec::default()
    });
    spec
}

/// IMPALA's ResNet as CleanRL's `ppo_procgen.py` has it (channels 16, 32,
/// 32, two residual blocks each, 256 features).
fn impala_cnn(actions: usize) -> PolicySpec {
    let mut spec = nature_cnn(actions);
    spec.cnn = Some(CnnSpec {
        input: [4, 84, 84],
        arch: CnnArch::Impala {
            channels: vec![16, 32, 32],
            blocks: 2,
        },
        features_dim: 256,
    });
    spec
}

fn observations(spec: &PolicySpec, n: usize, seed: u64) -> Vec<f32> {
    let mut r = rng(seed);
    (0..n * spec.obs_dim)
        .map(|_| {
            if spec.cnn.is_some() {
                r.random_range(0..=255u8) as f32
            } else {
                r.random_range(-1.0..1.0)
            }
        })
        .collect()
}

fn assert_close(what: &str, a: &[f32], b: &[f32], tol: f32) {
    assert_eq!(a.len(), b.len(), "{what}: lengths");
    let worst = a
        .iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs() / (1.0 + y.abs()))
        .fold(0f32, f32::max);
    assert!(worst <= tol, "{what}: relative gap {worst:e} > {tol:e}");
}

fn parameters(model_tensors: Vec<relay_nn::NamedTensor>) -> Vec<f32> {
    model_tensors.into_iter().flat_map(|(_, _, d)| d).collect()
}

/// Three PPO minibatch steps (evaluate, loss, clip, Adam) on a model; returns
/// the losses and gradient norms.
fn ppo_steps(model: &ActorCritic, opt: &mut Adam, obs: &[f32], n: usize) -> Vec<(f32, f32)> {
    let d = model.spec().obs_dim;
    let out = model.act(obs, n, false, &mut rng(7)).unwrap();
    let actions = match &out.actions {
        Actions::Discrete(a) => Tensor::new(a.as_slice(), model.device()).unwrap(),
        Actions::Continuous(a) => {
            Tensor::from_vec(a.clone(), (n, a.len() / n), model.device()).unwrap()
        }
    };
    let obs_t = Tensor::from_slice(obs, (n, d), model.device()).unwrap();
    let mut r = rng(9);
    let advantages: Vec<f32> = (0..n).map(|_| r.random_range(-1.0..1.0)).collect();
    let returns: Vec<f32> = advantages.iter().map(|a| a * 0.5 + 0.1).collect();
    let config = PpoLossConfig {
        ent_coef: 0.01,
        clip_range_vf: Some(0.2),
        ..Default::default()
    };
    (0..3)
        .map(|_| {
            let (logprob, entropy, values) = model.evaluate(&obs_t, &actions).unwrap();
            let loss = ppo_loss(
                &config,
                &PpoInputs {
                    logprob: &logprob,
                    entropy: &entropy,
                    values: &values,
                    old_logprob: &out.logprobs,
                    old_values: &out.values,
                    advantages: &advantages,
                    returns: &returns,
                },
            )
            .unwrap();
            let mut grads = loss.loss.backward().unwrap();
            let norm = clip_grad_norm(&mut grads, opt.vars(), 0.5).unwrap();
            opt.step(&grads).unwrap();
            (loss.stats.loss, norm)
        })
        .collect()
}

#[test]
fn ppo_steps_on_the_device_path_match_the_fused_path() {
    let mut continuous = PolicySpec::continuous(5, vec![-1.0; 2], vec![1.0; 2]);
    continuous.hidden = vec![16, 16];
    // (spec, batch, tolerance): NatureCNN's 3136-wide linear layer sums in
    // another order in candle's conv/matmul than in the fused kernels.
    for (spec, n, tol) in [
        (PolicySpec::discrete(6, 3), 32, 1e-5),
        (continuous, 32, 1e-5),
        (nature_cnn(6), 8, 1e-4),
        (impala_cnn(6), 4, 1e-4),
    ] {
        let fused = ActorCritic::new(&spec, 3).unwrap();
        // Placed on the CPU, where `composed_on_cpu` takes the GPU's path.
        let composed = ActorCritic::new(&spec, 3)
            .unwrap()
            .to_device(&Device::Cpu)
            .unwrap();
        let config = AdamConfig {
            lr: 1e-3,
            ..Default::default()
        };
        let mut fused_opt = Adam::new(fused.vars(), config).unwrap();
        let mut composed_opt = composed_on_cpu(|| Adam::new(composed.vars(), config)).unwrap();
        let obs = observations(&spec, n, 1);

        let a = fused.act(&obs, n, false, &mut rng(5)).unwrap();
        let b = composed_on_cpu(|| composed.act(&obs, n, false, &mut rng(5))).unwrap();
        match (&a.actions, &b.actions) {
            (Actions::Discrete(x), Actions::Discrete(y)) => assert_eq!(x, y, "sampled actions"),
            (Actions::Continuous(x), Actions::Continuous(y)) => {
                assert_close("sampled actions", x, y, tol)
            }
            _ => panic!("both sides act alike"),
        }
        assert_close("act logprobs", &a.logprobs, &b.logprobs, tol);
        assert_close("act values", &a.values, &b.values, tol);

        let fused_steps = ppo_steps(&fused, &mut fused_opt, &obs, n);
        let composed_steps = composed_on_cpu(|| ppo_steps(&composed, &mut composed_opt, &obs, n));
        for ((l1, n1), (l2, n2)) in fused_steps.iter().zip(&composed_steps) {
            assert_close("ppo loss", &[*l1], &[*l2], tol);
            assert_close("grad norm", &[*n1], &[*n2], tol);
        }
        assert!(
            fused_steps[0].0 != fused_steps[2].0,
            "the steps must change the model"
        );
        assert_close(
            "parameters after 3 steps",
            &parameters(fused.named_tensors()),
            &parameters(composed.named_tensors()),
            tol,
        );
        let (s1, s2) = (fused_opt.state().unwrap(), composed_opt.state().unwrap());
        assert_eq!(s1.step, s2.step);
        assert_close(
            "adam second moments",
            &s1.v.concat(),
            &s2.v.concat(),
            10.0 * tol,
        );
    }
}

#[test]
fn dqn_steps_on_the_device_path_match_the_fused_path() {
    let policy = nature_cnn(4);
    let spec = QNetSpec::from_policy_spec(&policy).unwrap();
    let fused = QNetwork::new(&spec, 2).unwrap();
    let fused_target = fused.duplicate().unwrap();
    let composed = QNetwork::new(&spec, 2)
        .unwrap()
        .to_device(&Device::Cpu)
        .unwrap();
    let composed_target = composed.duplicate().unwrap();
    let n = 8;
    let obs = observations(&policy, n, 3);
    let next_obs = observations(&policy, n, 4);
    let mut r = rng(6);
    let actions: Vec<u32> = (0..n).map(|_| r.random_range(0..4)).collect();
    let returns: Vec<f32> = (0..n).map(|_| r.random_range(-1.0..1.0)).collect();
    let discounts: Vec<f32> = (0..n)
        .map(|i| if i % 3 == 0 { 0.0 } else { 0.99 })
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
    let config = AdamConfig {
        lr: 1e-3,
        ..Default::default()
    };
    let run = |online: &QNetwork, target: &QNetwork, opt: &mut Adam| -> Vec<f32> {
        let mut losses = Vec::new();
        for _ in 0..3 {
            let out = dqn_loss(&DqnLossConfig::default(), online, target, &batch).unwrap();
            let mut grads = out.loss.backward().unwrap();
            clip_grad_norm(&mut grads, opt.vars(), 10.0).unwrap();
            opt.step(&grads).unwrap();
            target.soft_update(online, 0.5).unwrap();
            losses.push(out.stats.loss);
        }
        losses
    };
    let mut fused_opt = Adam::new(fused.vars(), config).unwrap();
    let fused_losses = run(&fused, &fused_target, &mut fused_opt);
    let composed_losses = composed_on_cpu(|| {
        let mut opt = Adam::new(composed.vars(), config).unwrap();
        run(&composed, &composed_target, &mut opt)
    });
    assert_close("dqn losses", &fused_losses, &composed_losses, 1e-4);
    assert_close(
        "online parameters",
        &parameters(fused.named_tensors()),
        &parameters(composed.named_tensors()),
        1e-4,
    );
    assert_close(
        "target parameters",
        &parameters(fused_target.named_tensors()),
        &parameters(composed_target.named_tensors()),
        1e-4,
    );
    assert_eq!(
        fused.greedy_actions(&obs, n).unwrap(),
        composed_on_cpu(|| composed.greedy_actions(&obs, n)).unwrap()
    );
}
