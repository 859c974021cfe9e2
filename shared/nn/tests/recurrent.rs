//! Recurrent actor-critics (`PolicySpec::recurrent`): sb3-contrib's
//! parameter names, the acting step against a hand-computed cell, acting
//! and training paths agreeing step by step across an episode start, and
//! backpropagation through time against finite differences.

use candle_core::{DType, Device, Tensor, Var};
use rand::{Rng, SeedableRng};
use relay_nn::{ActorCritic, CellKind, PolicySpec, RecurrentSpec, TrunkLayout};

fn spec(cell: CellKind, hidden: usize, layers: usize) -> PolicySpec {
    let mut spec = PolicySpec::discrete(3, 2);
    spec.hidden = vec![5];
    spec.recurrent = Some(RecurrentSpec {
        cell,
        hidden,
        layers,
    });
    spec
}

fn random(n: usize, seed: u64) -> Vec<f32> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    (0..n).map(|_| rng.random_range(-1.5..1.5)).collect()
}

#[test]
fn parameters_are_named_as_sb3_contrib_names_them() {
    let model = ActorCritic::new(&spec(CellKind::Lstm, 4, 2), 0).unwrap();
    let shapes: Vec<(String, Vec<usize>)> = model
        .named_tensors()
        .into_iter()
        .map(|(n, s, _)| (n, s))
        .filter(|(n, _)| n.starts_with("lstm_"))
        .collect();
    for core in ["actor", "critic"] {
        for (name, shape) in [
            ("weight_ih_l0", vec![16, 3]),
            ("weight_hh_l0", vec![16, 4]),
            ("bias_ih_l0", vec![16]),
            ("bias_hh_l0", vec![16]),
            ("weight_ih_l1", vec![16, 4]),
        ] {
            let full = format!("lstm_{core}.{name}");
            assert!(
                shapes.contains(&(full.clone(), shape.clone())),
                "{full} {shape:?} not in {shapes:?}"
            );
        }
    }
    // Two layers of h and c, for the actor and the critic: the width the
    // config gives the env-runners.
    assert_eq!(model.state_width(), 2 * 2 * 2 * 4);
    assert_eq!(
        model.state_width(),
        model
            .spec()
            .recurrent
            .unwrap()
            .state_width(TrunkLayout::Separate)
    );
    // The hidden layers read the core's output.
    let trunk = model
        .named_tensors()
        .into_iter()
        .find(|(n, _, _)| n == "mlp_extractor.policy_net.0.weight")
        .unwrap();
    assert_eq!(trunk.1, vec![5, 4]);
    // A shared trunk has one core, for both heads.
    let shared =
        ActorCritic::with_layout(&spec(CellKind::Gru, 4, 1), TrunkLayout::Shared, 0).unwrap();
    assert_eq!(shared.state_width(), 4);
    assert_eq!(
        shared.state_width(),
        shared
            .spec()
            .recurrent
            .unwrap()
            .state_width(TrunkLayout::Shared)
    );
    assert!(shared
        .parameter_names()
        .iter()
        .all(|n| !n.starts_with("gru_critic")));
}

/// One LSTM step computed by hand from the parameters.
fn lstm_by_hand(
    model: &ActorCritic,
    core: &str,
    x: &[f32],
    h: &[f32],
    c: &[f32],
) -> (Vec<f32>, Vec<f32>) {
    let tensors = model.named_tensors();
    let get = |name: &str| {
        tensors
            .iter()
            .find(|(n, _, _)| n == &format!("lstm_{core}.{name}"))
            .unwrap()
            .2
            .clone()
    };
    let (w_ih, w_hh, b_ih, b_hh) = (
        get("weight_ih_l0"),
        get("weight_hh_l0"),
        get("bias_ih_l0"),
        get("bias_hh_l0"),
    );
    let hdim = h.len();
    let gate = |row: usize| -> f32 {
        let mut s = b_ih[row] + b_hh[row];
        for (k, xv) in x.iter().enumerate() {
            s += w_ih[row * x.len() + k] * xv;
        }
        for (k, hv) in h.iter().enumerate() {
            s += w_hh[row * hdim + k] * hv;
        }
        s
    };
    let sig = |v: f32| 1.0 / (1.0 + (-v).exp());
    let mut h2 = vec![0.0; hdim];
    let mut c2 = vec![0.0; hdim];
    for j in 0..hdim {
        let i = sig(gate(j));
        let f = sig(gate(hdim + j));
        let g = gate(2 * hdim + j).tanh();
        let o = sig(gate(3 * hdim + j));
        c2[j] = f * c[j] + i * g;
        h2[j] = o * c2[j].tanh();
    }
    (h2, c2)
}

#[test]
fn an_acting_step_is_the_lstm_cell_computed_by_hand() {
    let model = ActorCritic::new(&spec(CellKind::Lstm, 4, 1), 3).unwrap();
    let x = random(3, 1);
    let mut state = random(model.state_width(), 2);
    let before = state.clone();
    let mut rng = rand::rngs::StdRng::seed_from_u64(0);
    model
        .act_recurrent(&x, 1, &mut state, None, true, &mut rng)
        .unwrap();
    let (h, c) = lstm_by_hand(&model, "actor", &x, &before[0..4], &before[4..8]);
    let (hc, cc) = lstm_by_hand(&model, "critic", &x, &before[8..12], &before[12..16]);
    for (got, want) in state.iter().zip(h.iter().chain(&c).chain(&hc).chain(&cc)) {
        assert!((got - want).abs() < 1e-5, "{state:?}");
    }
    // Feed-forward calls on a recurrent policy name what is missing.
    let err = model
        .act_masked(&x, 1, None, true, &mut rng)
        .unwrap_err()
        .to_string();
    assert!(err.contains("state"), "{err}");
    let err = model
        .act_recurrent(&x, 1, &mut [0.0; 3], None, true, &mut rng)
        .unwrap_err()
        .to_string();
    assert!(err.contains("16 values"), "{err}");
}

/// The training graph over a sequence gives, step by step, the values and
/// log-probs that acting gave with the state carried, across an episode
/// start (state zeroed) in one of the sequences.
#[test]
fn training_unrolls_as_acting_steps_across_an_episode_start() {
    for (cell, layout) in [
        (CellKind::Lstm, TrunkLayout::Separate),
        (CellKind::Gru, TrunkLayout::Separate),
        (CellKind::Lstm, TrunkLayout::Shared),
    ] {
        let model = ActorCritic::with_layout(&spec(cell, 6, 2), layout, 5).unwrap();
        let (t_len, b, sw) = (5, 3, model.state_width());
        let obs = random(t_len * b * 3, 7);
        let initial = random(b * sw, 8);
        // Sequence 1 starts an episode at step 2; sequence 2 at step 0.
        let starts: Vec<bool> = (0..t_len * b)
            .map(|r| (r / b == 2 && r % b == 1) || (r / b == 0 && r % b == 2))
            .collect();
        let mut state = initial.clone();
        let mut rng = rand::rngs::StdRng::seed_from_u64(0);
        let mut actions = Vec::new();
        let mut logprobs = Vec::new();
        let mut values = Vec::new();
        for t in 0..t_len {
            for i in 0..b {
                if starts[t * b + i] {
                    state[i * sw..(i + 1) * sw].fill(0.0);
                }
            }
            let out = model
                .act_recurrent(
                    &obs[t * b * 3..(t + 1) * b * 3],
                    b,
                    &mut state,
                    None,
                    false,
                    &mut rng,
                )
                .unwrap();
            let relay_nn::Actions::Discrete(a) = out.actions else {
                panic!("discrete")
            };
            actions.extend(a.iter().map(|&a| a as u32));
            logprobs.extend(out.logprobs);
            values.extend(out.values);
        }
        let dev = Device::Cpu;
        let (logprob, _, value) = model
            .evaluate_sequences(
                &Tensor::from_vec(obs.clone(), (t_len * b, 3), &dev).unwrap(),
                t_len,
                &starts,
                &Tensor::from_vec(initial.clone(), (b, sw), &dev).unwrap(),
                &Tensor::from_vec(actions.clone(), t_len * b, &dev).unwrap(),
                None,
            )
            .unwrap();
        let logprob: Vec<f32> = logprob.to_vec1().unwrap();
        let value: Vec<f32> = value.to_vec1().unwrap();
        for r in 0..t_len * b {
            assert!(
                (logprob[r] - logprobs[r]).abs() < 1e-4,
                "{cell:?} {layout:?} row {r}: {logprob:?} vs {logprobs:?}"
            );
            assert!(
                (value[r] - values[r]).abs() < 1e-4,
                "{cell:?} {layout:?} row {r}: {value:?} vs {values:?}"
            );
        }
        // values_recurrent advances the state as acting does.
        let mut again = initial.clone();
        for i in 0..b {
            if starts[i] {
                again[i * sw..(i + 1) * sw].fill(0.0);
            }
        }
        let v0 = model
            .values_recurrent(&obs[..b * 3], b, &mut again)
            .unwrap();
        assert!(v0
            .iter()
            .zip(&values[..b])
            .all(|(a, b)| (a - b).abs() < 1e-5));
    }
}

/// Backpropagation through time: the gradient of a loss over a whole
/// sequence (through the recurrence and across an episode start) matches
/// central finite differences on every parameter of a tiny cell.
#[test]
fn bptt_gradients_match_finite_differences() {
    for cell in [CellKind::Lstm, CellKind::Gru] {
        let mut small = PolicySpec::discrete(2, 2);
        small.hidden = vec![3];
        small.recurrent = Some(RecurrentSpec {
            cell,
            hidden: 2,
            layers: 1,
        });
        let model = ActorCritic::new(&small, 11).unwrap();
        let (t_len, b, sw) = (4, 2, model.state_width());
        let obs = random(t_len * b * 2, 12);
        let initial = random(b * sw, 13);
        let starts: Vec<bool> = (0..t_len * b).map(|r| r == 2 * b + 1).collect();
        let actions: Vec<u32> = (0..t_len * b).map(|r| (r % 2) as u32).collect();
        let dev = Device::Cpu;
        let loss_of = |model: &ActorCritic| -> candle_core::Tensor {
            let (logprob, entropy, value) = model
                .evaluate_sequences(
                    &Tensor::from_vec(obs.clone(), (t_len * b, 2), &dev).unwrap(),
                    t_len,
                    &starts,
                    &Tensor::from_vec(initial.clone(), (b, sw), &dev).unwrap(),
                    &Tensor::from_vec(actions.clone(), t_len * b, &dev).unwrap(),
                    None,
                )
                .unwrap();
            // A mix of every output, weighted by row, so each step matters.
            let weights = Tensor::from_vec(
                (0..t_len * b)
                    .map(|r| 0.3 + r as f32 * 0.1)
                    .collect::<Vec<_>>(),
                t_len * b,
                &dev,
            )
            .unwrap();
            let mixed =
                ((logprob + (entropy * 0.5).unwrap()).unwrap() + value.sqr().unwrap()).unwrap();
            (mixed * weights).unwrap().sum_all().unwrap()
        };
        let grads = loss_of(&model).backward().unwrap();
        let vars: Vec<Var> = model.vars();
        let names = model.parameter_names();
        let eps = 1e-2f64;
        let mut checked = 0;
        for (name, var) in names.iter().zip(&vars) {
            let analytic: Vec<f32> = grads
                .get(var.as_tensor())
                .unwrap_or_else(|| panic!("no gradient for {name}"))
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap();
            let base: Vec<f32> = var.as_tensor().flatten_all().unwrap().to_vec1().unwrap();
            for k in 0..base.len() {
                let value_at = |delta: f64| -> f64 {
                    let mut moved = base.clone();
                    moved[k] = (base[k] as f64 + delta) as f32;
                    var.set(&Tensor::from_vec(moved, var.shape(), &dev).unwrap())
                        .unwrap();
                    let v = loss_of(&model)
                        .to_dtype(DType::F64)
                        .unwrap()
                        .to_scalar::<f64>()
                        .unwrap();
                    var.set(&Tensor::from_vec(base.clone(), var.shape(), &dev).unwrap())
                        .unwrap();
                    v
                };
                let numeric = (value_at(eps) - value_at(-eps)) / (2.0 * eps);
                let a = analytic[k] as f64;
                assert!(
                    (a - numeric).abs() <= 2e-2 * (1.0 + numeric.abs()),
                    "{cell:?} {name}[{k}]: backprop {a} vs finite differences {numeric}"
                );
                checked += 1;
            }
        }
        assert!(checked > 50, "{checked} parameters checked");
    }
}
