//! gSDE policies (`PolicySpec::use_sde`): SB3's `log_std` matrix, held
//! noise from a seed, and the acting and training paths agreeing, for
//! feed-forward (both trunk layouts) and recurrent policies.

use candle_core::{Device, Tensor};
use rand::{Rng, SeedableRng};
use relay_nn::{ActOutput, Actions, ActorCritic, CellKind, PolicySpec, RecurrentSpec, TrunkLayout};

fn sde_spec() -> PolicySpec {
    let mut spec = PolicySpec::continuous(3, vec![-2.0, -1.0], vec![2.0, 1.0]);
    spec.hidden = vec![8, 5];
    spec.use_sde = true;
    spec.init_log_std = -0.5;
    spec
}

fn random(n: usize, seed: u64) -> Vec<f32> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    (0..n).map(|_| rng.random_range(-1.5..1.5)).collect()
}

fn continuous(out: &ActOutput) -> Vec<f32> {
    match &out.actions {
        Actions::Continuous(a) => a.clone(),
        Actions::Discrete(_) => panic!("continuous actions"),
    }
}

fn close(a: &[f32], b: &[f32], what: &str) {
    assert_eq!(a.len(), b.len(), "{what}");
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert!(
            (x - y).abs() < 1e-4 * (1.0 + y.abs()),
            "{what} {i}: {x} vs {y}"
        );
    }
}

#[test]
fn log_std_is_a_matrix_over_the_last_hidden_layer() {
    let model = ActorCritic::new(&sde_spec(), 1).unwrap();
    let log_std = model
        .named_tensors()
        .into_iter()
        .find(|(name, _, _)| name == "log_std")
        .unwrap();
    assert_eq!(log_std.1, vec![5, 2]);
    assert!(log_std.2.iter().all(|&v| v == -0.5));
    let mut discrete = PolicySpec::discrete(3, 2);
    discrete.use_sde = true;
    let err = ActorCritic::new(&discrete, 1).unwrap_err().to_string();
    assert!(err.contains("use_sde"), "{err}");
}

#[test]
fn a_seed_holds_the_noise_and_acting_agrees_with_training() {
    for layout in [TrunkLayout::Separate, TrunkLayout::Shared] {
        let spec = sde_spec();
        let model = ActorCritic::with_layout(&spec, layout, 3).unwrap();
        let n = 6;
        let obs = random(n * 3, 4);
        let seeds: Vec<u64> = (0..n as u64).map(|i| 100 + i).collect();
        let mut rng = rand::rngs::StdRng::seed_from_u64(0);
        let a = model
            .act_explore(&obs, n, &mut [], None, &seeds, &mut rng)
            .unwrap();
        let b = model
            .act_explore(&obs, n, &mut [], None, &seeds, &mut rng)
            .unwrap();
        assert_eq!(a, b, "{layout:?}: the same seeds are the same noise");
        let other: Vec<u64> = seeds.iter().map(|s| s + 1000).collect();
        let c = model
            .act_explore(&obs, n, &mut [], None, &other, &mut rng)
            .unwrap();
        assert_ne!(continuous(&a), continuous(&c), "{layout:?}");
        let mode = model.act(&obs, n, true, &mut rng).unwrap();
        let means = continuous(&mode);
        assert_ne!(
            continuous(&a),
            means,
            "{layout:?}: sampled actions carry noise"
        );

        let dev = Device::Cpu;
        let x = Tensor::from_vec(obs.clone(), (n, 3), &dev).unwrap();
        for out in [&a, &c, &mode] {
            let acts = Tensor::from_vec(continuous(out), (n, 2), &dev).unwrap();
            let (lp, entropy, v) = model.evaluate(&x, &acts).unwrap();
            close(&lp.to_vec1::<f32>().unwrap(), &out.logprobs, "logprob");
            close(&v.to_vec1::<f32>().unwrap(), &out.values, "value");
            // State-dependent: the rows' entropies differ.
            let h: Vec<f32> = entropy.to_vec1().unwrap();
            assert!(h.iter().any(|&e| (e - h[0]).abs() > 1e-3), "{h:?}");
        }
    }
}

#[test]
fn recurrent_gsde_acts_as_it_trains() {
    let mut spec = sde_spec();
    spec.hidden = vec![4];
    spec.recurrent = Some(RecurrentSpec {
        cell: CellKind::Lstm,
        hidden: 6,
        layers: 1,
    });
    let model = ActorCritic::new(&spec, 5).unwrap();
    let (t_len, b, sw) = (4, 3, model.state_width());
    let obs = random(t_len * b * 3, 7);
    let starts: Vec<bool> = (0..t_len * b).map(|r| r < b || r == 2 * b + 1).collect();
    let mut state = vec![0f32; b * sw];
    let mut rng = rand::rngs::StdRng::seed_from_u64(0);
    let (mut actions, mut logprobs) = (Vec::new(), Vec::new());
    for t in 0..t_len {
        for i in 0..b {
            if starts[t * b + i] {
                state[i * sw..(i + 1) * sw].fill(0.0);
            }
        }
        // A new matrix every two steps, as `sde_sample_freq: 2` would.
        let seeds: Vec<u64> = (0..b as u64).map(|i| 10 * i + t as u64 / 2).collect();
        let out = model
            .act_explore(
                &obs[t * b * 3..(t + 1) * b * 3],
                b,
                &mut state,
                None,
                &seeds,
                &mut rng,
            )
            .unwrap();
        actions.extend(continuous(&out));
        logprobs.extend(out.logprobs);
    }
    let dev = Device::Cpu;
    let (lp, _, _) = model
        .evaluate_sequences(
            &Tensor::from_vec(obs, (t_len * b, 3), &dev).unwrap(),
            t_len,
            &starts,
            &Tensor::zeros((b, sw), candle_core::DType::F32, &dev).unwrap(),
            &Tensor::from_vec(actions, (t_len * b, 2), &dev).unwrap(),
            None,
        )
        .unwrap();
    close(&lp.to_vec1::<f32>().unwrap(), &logprobs, "logprob");
}

#[test]
fn seeds_are_one_a_row() {
    let model = ActorCritic::new(&sde_spec(), 1).unwrap();
    let mut rng = rand::rngs::StdRng::seed_from_u64(0);
    let err = model
        .act_explore(&random(6, 1), 2, &mut [], None, &[1], &mut rng)
        .unwrap_err()
        .to_string();
    assert!(err.contains("noise_seeds"), "{err}");
}
