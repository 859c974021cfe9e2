//! Tests of the off-policy table's transitions, weights and slots.

use super::sample::build_batch;
use super::*;
use relay_proto::{Tensor, SCHEMA_VERSION};

/// The bootstrap observation of a transition of f32 values.
fn next_values(t: &Transition) -> Vec<f32> {
    match &t.observations {
        Observations::Values { next_obs, .. } => next_obs.clone(),
        other => panic!("not values: {other:?}"),
    }
}

fn fragment(t: usize, n: usize) -> RolloutFragment {
    // obs[t, e] = [10 t + e, -1]; reward of (t, e) = t + 1.
    let obs: Vec<f32> = (0..t * n)
        .flat_map(|i| [(10 * (i / n) + i % n) as f32, -1.0])
        .collect();
    let rewards: Vec<f32> = (0..t * n).map(|i| (i / n + 1) as f32).collect();
    RolloutFragment {
        schema: SCHEMA_VERSION,
        runner_id: "r".into(),
        env_id: "CartPole-v1".into(),
        policy_version: 0,
        num_steps: t as u32,
        num_envs: n as u32,
        obs: Tensor::from_f32(&[t, n, 2], &obs),
        actions: Tensor::from_i64(&[t, n], &(0..(t * n) as i64).collect::<Vec<_>>()),
        logprobs: Tensor::from_f32(&[t, n], &vec![0.0; t * n]),
        values: Tensor::from_f32(&[t, n], &vec![0.0; t * n]),
        rewards: Tensor::from_f32(&[t, n], &rewards),
        terminated: Tensor::from_bool(&[t, n], &vec![false; t * n]),
        truncated: Tensor::from_bool(&[t, n], &vec![false; t * n]),
        next_obs: Tensor::from_f32(&[n, 2], &vec![99.0; n * 2]),
        final_obs: Tensor::from_f32(&[0, 2], &[]),
        norm_rewards: None,
        norm_delta: None,
        masks: None,
        frames: None,
        initial_state: None,
    }
}

#[test]
fn transitions_bootstrap_through_truncation_not_termination() {
    // 4 steps, 2 envs. Env 0 terminates at t=1; env 1 is truncated at
    // t=1 (final obs [7, 7]).
    let mut f = fragment(4, 2);
    let mut term = vec![false; 8];
    let mut trunc = vec![false; 8];
    term[2] = true; // (t=1, e=0)
    trunc[3] = true; // (t=1, e=1)
    f.terminated = Tensor::from_bool(&[4, 2], &term);
    f.truncated = Tensor::from_bool(&[4, 2], &trunc);
    f.final_obs = Tensor::from_f32(&[1, 2], &[7.0, 7.0]);
    let g = 0.5;
    let tr = fragment_transitions(&f, 2, g).unwrap();
    assert_eq!(tr.len(), 8);
    let at = |t: usize, e: usize| &tr[t * 2 + e];
    // (0, 0): window t=0..1, ends with a termination: no bootstrap.
    assert_eq!(at(0, 0).reward, 1.0 + 0.5 * 2.0);
    assert_eq!(at(0, 0).discount, 0.0);
    assert!(at(0, 0).terminated);
    // (0, 1): same rewards, ends with a truncation: bootstrap from the
    // final observation with γ^2.
    assert_eq!(at(0, 1).reward, 2.0);
    assert_eq!(at(0, 1).discount, 0.25);
    assert_eq!(next_values(at(0, 1)), vec![7.0, 7.0]);
    assert!(at(0, 1).truncated && !at(0, 1).terminated);
    // (1, 1): one step, truncated: γ^1 from the final obs.
    assert_eq!((at(1, 1).reward, at(1, 1).discount), (2.0, 0.5));
    assert_eq!(next_values(at(1, 1)), vec![7.0, 7.0]);
    // (2, 0): a full 2-step window, bootstrap from obs[t=4] = next_obs.
    assert_eq!(
        (at(2, 0).reward, at(2, 0).discount),
        (3.0 + 0.5 * 4.0, 0.25)
    );
    assert_eq!(next_values(at(2, 0)), vec![99.0, 99.0]);
    // (1, 0) ... (2, 1): next obs of a mid-fragment step is the next row.
    let one = fragment_transitions(&f, 1, g).unwrap();
    assert_eq!(next_values(&one[0]), vec![10.0, -1.0]);
    assert_eq!(one[0].discount, 0.5);
    // (3, e): the fragment's tail bootstraps from next_obs, 1 step.
    assert_eq!((at(3, 0).reward, at(3, 0).discount), (4.0, 0.5));
    assert_eq!(at(3, 0).action, Action::Discrete(6));
    for t in &tr {
        assert_eq!(Transition::decode(&t.encode()).as_ref(), Some(t));
    }
    let cont = Transition {
        action: Action::Continuous(vec![0.5, -0.25]),
        ..tr[0].clone()
    };
    assert_eq!(Transition::decode(&cont.encode()), Some(cont.clone()));
    assert_eq!(Transition::decode(&cont.encode()[..10]), None);
}

/// Each transition keeps the mask of its bootstrap observation: the
/// next row's, a truncation's final one, or the tail's; it survives the
/// stored bytes, and a batch of rows with and without masks allows every
/// action in the latter.
#[test]
fn transitions_keep_the_mask_of_their_bootstrap_observation() {
    let mut f = fragment(3, 2);
    let mut trunc = vec![false; 6];
    trunc[1] = true; // (t=0, e=1)
    f.truncated = Tensor::from_bool(&[3, 2], &trunc);
    f.final_obs = Tensor::from_f32(&[1, 2], &[7.0, 7.0]);
    f.actions = Tensor::from_i64(&[3, 2], &[0, 1, 2, 0, 1, 2]);
    // 3 actions; row (t, e) allows its own action and action 2.
    let obs_masks = [1, 0, 1, 0, 1, 1, 0, 0, 1, 1, 0, 1, 0, 1, 1, 0, 0, 1];
    f.masks = Some(relay_proto::FragmentMasks {
        obs: Tensor::from_u8(&[3, 2, 3], &obs_masks),
        next_obs: Tensor::from_u8(&[2, 3], &[1, 1, 0, 0, 1, 0]),
        final_obs: Tensor::from_u8(&[1, 3], &[0, 0, 1]),
    });
    let tr = fragment_transitions(&f, 1, 0.9).unwrap();
    let mask = |i: usize| tr[i].next_mask.clone().unwrap();
    assert_eq!(mask(0), obs_masks[6..9], "(0, 0): the next row's, (1, 0)");
    assert_eq!(mask(1), [0, 0, 1], "(0, 1): the truncation's final mask");
    assert_eq!(mask(4), [1, 1, 0], "(2, 0): the tail's");
    assert_eq!(mask(5), [0, 1, 0]);
    for t in &tr {
        assert_eq!(Transition::decode(&t.encode()).as_ref(), Some(t));
    }
    let unmasked = Transition {
        next_mask: None,
        ..tr[0].clone()
    };
    let rows: Vec<(u64, Transition)> = vec![(0, tr[1].clone()), (1, unmasked)];
    let batch = build_batch(rows, vec![1.0; 2], 2, 2);
    assert_eq!(batch.next_masks.unwrap().data, [0, 0, 1, 1, 1, 1]);
}

#[test]
fn importance_weights_follow_the_formula() {
    // Probabilities 0.5, 0.25, 0.25 of 4 held, β = 0.5:
    // w = (4 p)^-0.5 = [1/√2, 1, 1], normalised by 1.
    let w = importance_weights(&[0.5, 0.25, 0.25], 4, 0.5);
    assert!((w[0] - 0.5f32.sqrt()).abs() < 1e-6 && w[1] == 1.0 && w[2] == 1.0);
    // β = 0: uniform weights; β = 1 fully compensates: w ∝ 1/p.
    assert!(importance_weights(&[0.9, 0.1], 2, 0.0)
        .iter()
        .all(|&w| w == 1.0));
    let w = importance_weights(&[0.8, 0.2], 2, 1.0);
    assert!((w[0] - 0.25).abs() < 1e-6 && w[1] == 1.0);
}

#[test]
fn ring_slots_map_back_to_ids() {
    assert_eq!(tree_leaves(100_000), 131_072);
    assert_eq!(tree_leaves(8), 8);
    // Capacity 4, 6 inserted: slots 0, 1 hold ids 4, 5; slots 2, 3 ids 2, 3.
    assert_eq!(
        (0..4).map(|s| id_of_slot(s, 6, 4)).collect::<Vec<_>>(),
        vec![4, 5, 2, 3]
    );
    assert_eq!(id_of_slot(1, 2, 4), 1);
}
