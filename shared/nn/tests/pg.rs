//! A2C / REINFORCE with the actor-critic: the shared-trunk layout (names,
//! both forward paths agree, gradients reach every parameter), and A2C with
//! RMSprop learning a contextual bandit.

use candle_core::{Device, Tensor};
use rand::{Rng, SeedableRng};
use relay_nn::{
    a2c_loss, clip_grad_norm, discounted_returns, reinforce_loss, A2cInputs, A2cLossConfig,
    Actions, ActorCritic, PolicySpec, ReinforceConfig, ReinforceInputs, RmsProp, RmsPropConfig,
    TrunkLayout,
};

fn rng(seed: u64) -> rand::rngs::StdRng {
    rand::rngs::StdRng::seed_from_u64(seed)
}

#[test]
fn shared_trunk_names_paths_and_gradients() {
    let mut cont = PolicySpec::continuous(3, vec![-1.0; 2], vec![1.0; 2]);
    cont.hidden = vec![16, 8];
    for spec in [PolicySpec::discrete(4, 3), cont] {
        let model = ActorCritic::with_layout(&spec, TrunkLayout::Shared, 1).unwrap();
        assert_eq!(model.layout(), TrunkLayout::Shared);
        let names = model.parameter_names();
        assert!(
            names.contains(&"mlp_extractor.shared_net.0.weight"),
            "{names:?}"
        );
        assert!(!names
            .iter()
            .any(|n| n.contains("policy_net") || n.contains("value_net.0")));
        let separate = ActorCritic::new(&spec, 1).unwrap();
        let last = *spec.hidden.last().unwrap();
        let trunk: usize = spec
            .hidden
            .iter()
            .scan(spec.obs_dim, |inp, &h| {
                let n = *inp * h + h;
                *inp = h;
                Some(n)
            })
            .sum();
        assert_eq!(separate.num_parameters() - model.num_parameters(), trunk);
        assert!(last > 0);

        let n = 24;
        let d = spec.obs_dim;
        let mut r = rng(2);
        let obs: Vec<f32> = (0..n * d).map(|_| r.random_range(-1.0..1.0)).collect();
        let out = model.act(&obs, n, false, &mut r).unwrap();
        let x = Tensor::from_slice(&obs, (n, d), &Device::Cpu).unwrap();
        let a = match &out.actions {
            Actions::Discrete(a) => Tensor::new(a.as_slice(), &Device::Cpu).unwrap(),
            Actions::Continuous(a) => {
                Tensor::from_slice(a, (n, a.len() / n), &Device::Cpu).unwrap()
            }
        };
        let (lp, ent, v) = model.evaluate(&x, &a).unwrap();
        let lp_v: Vec<f32> = lp.to_vec1().unwrap();
        let v_v: Vec<f32> = v.to_vec1().unwrap();
        for i in 0..n {
            assert!((lp_v[i] - out.logprobs[i]).abs() < 1e-4, "logprob {i}");
            assert!((v_v[i] - out.values[i]).abs() < 1e-4, "value {i}");
        }
        let adv: Vec<f32> = (0..n).map(|_| r.random_range(-1.0..1.0)).collect();
        let returns: Vec<f32> = (0..n).map(|_| r.random_range(-1.0..1.0)).collect();
        let loss = a2c_loss(
            &A2cLossConfig {
                ent_coef: 0.01,
                ..Default::default()
            },
            &A2cInputs {
                logprob: &lp,
                entropy: &ent,
                values: &v,
                advantages: &adv,
                returns: &returns,
            },
        )
        .unwrap();
        let grads = loss.loss.backward().unwrap();
        for (name, var) in names.iter().zip(model.vars()) {
            let g: Vec<f32> = grads
                .get(&var)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap();
            assert!(g.iter().any(|&x| x != 0.0), "{name} got no gradient");
        }
        // REINFORCE without a baseline leaves the value head without gradient.
        let loss = reinforce_loss(
            &ReinforceConfig {
                baseline: false,
                ..Default::default()
            },
            &ReinforceInputs {
                logprob: &lp,
                entropy: &ent,
                values: None,
                returns: &returns,
                advantage_stats: None,
            },
        )
        .unwrap();
        let grads = loss.loss.backward().unwrap();
        let vars = model.vars();
        let head = names.iter().position(|n| *n == "value_net.weight").unwrap();
        assert!(grads.get(&vars[head]).is_none());
    }
}

#[test]
fn a2c_with_rmsprop_learns_a_contextual_bandit() {
    // Reward 1 for action 0 when obs[0] > 0 (flipped: when obs[0] < 0),
    // for action 1 otherwise. Both mappings, so chance agreement of the
    // initial policy with one of them proves nothing.
    for flip in [false, true] {
        bandit(flip);
    }
}

fn bandit(flip: bool) {
    let spec = PolicySpec::discrete(2, 2);
    let model = ActorCritic::new(&spec, 3).unwrap();
    let mut opt = RmsProp::new(
        model.vars(),
        RmsPropConfig {
            lr: 3e-3,
            ..Default::default()
        },
    )
    .unwrap();
    let n = 64;
    let mut r = rng(4);
    let accuracy = |model: &ActorCritic, r: &mut rand::rngs::StdRng| -> f64 {
        let obs: Vec<f32> = (0..400).map(|_| r.random_range(-1.0..1.0)).collect();
        let out = model.act(&obs, 200, true, r).unwrap();
        let Actions::Discrete(a) = out.actions else {
            unreachable!()
        };
        a.iter()
            .zip(obs.chunks(2))
            .filter(|(&a, o)| (a == 0) == ((o[0] > 0.0) != flip))
            .count() as f64
            / 200.0
    };
    let before = accuracy(&model, &mut r);
    for _ in 0..150 {
        let obs: Vec<f32> = (0..n * 2).map(|_| r.random_range(-1.0..1.0)).collect();
        let out = model.act(&obs, n, false, &mut r).unwrap();
        let Actions::Discrete(acts) = out.actions else {
            unreachable!()
        };
        let rewards: Vec<f32> = acts
            .iter()
            .zip(obs.chunks(2))
            .map(|(&a, o)| {
                if (a == 0) == ((o[0] > 0.0) != flip) {
                    1.0
                } else {
                    0.0
                }
            })
            .collect();
        // One-step episodes: every step terminates.
        let term = vec![true; n];
        let (adv, returns) = relay_nn::gae(
            &rewards,
            &out.values,
            &vec![0.0; n],
            &term,
            &term,
            0.99,
            1.0,
        )
        .unwrap();
        let mc = discounted_returns(&rewards, &vec![0.0; n], &term, &term, 0.99).unwrap();
        assert!(returns.iter().zip(&mc).all(|(a, b)| (a - b).abs() < 1e-6));
        let x = Tensor::from_vec(obs, (n, 2), &Device::Cpu).unwrap();
        let a = Tensor::new(acts.as_slice(), &Device::Cpu).unwrap();
        let (lp, ent, v) = model.evaluate(&x, &a).unwrap();
        let loss = a2c_loss(
            &A2cLossConfig::default(),
            &A2cInputs {
                logprob: &lp,
                entropy: &ent,
                values: &v,
                advantages: &adv,
                returns: &returns,
            },
        )
        .unwrap();
        let mut grads = loss.loss.backward().unwrap();
        clip_grad_norm(&mut grads, opt.vars(), 0.5).unwrap();
        opt.step(&grads).unwrap();
    }
    let after = accuracy(&model, &mut r);
    eprintln!("contextual bandit (flip {flip}) accuracy {before:.3} -> {after:.3}");
    assert!(after > 0.9, "accuracy {before} -> {after}");
}
