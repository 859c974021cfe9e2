//! A PPO update of many minibatches ends before its next gradient step once
//! the learner is stopping (`GradientSync::stopping`), with
//! `UpdateError::Stopped`: a stop is not held up for the rest of an update
//! that can take minutes (a CNN on CPU). The learner rolls the part done
//! back (services/relay/tests/shutdown_e2e.rs checks it end to end).

use std::sync::atomic::{AtomicUsize, Ordering};

use rand::{Rng, SeedableRng};
use relay_config::PpoConfig;
use relay_learner::optimizer::Optimizer;
use relay_learner::ppo;
use relay_learner::replicas::GradientSync;
use relay_learner::rollout::{Rollout, UpdateError};
use relay_nn::{Actions, ActorCritic, Adam, AdamConfig, PolicySpec};

/// A learner alone, asked to stop once it has looked `after` times.
struct StopsAfter {
    looked: AtomicUsize,
    after: usize,
}

impl GradientSync for StopsAfter {
    fn share(&self) -> (usize, usize) {
        (0, 1)
    }

    fn sum(&mut self, _data: &mut [f32]) -> Result<(), UpdateError> {
        Ok(())
    }

    fn stopping(&self) -> bool {
        self.looked.fetch_add(1, Ordering::Relaxed) >= self.after
    }
}

/// A rollout of 256 steps acted by `model`, random advantages.
fn rollout(model: &ActorCritic) -> Rollout {
    let n = 256;
    let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(3);
    let obs: Vec<f32> = (0..n * 4).map(|_| r.random_range(-1.0..1.0)).collect();
    let out = model.act(&obs, n, false, &mut r).unwrap();
    let Actions::Discrete(actions) = out.actions else {
        unreachable!("a discrete policy")
    };
    let advantages: Vec<f32> = (0..n).map(|_| r.random_range(-1.0..1.0)).collect();
    let returns = advantages
        .iter()
        .zip(&out.values)
        .map(|(a, v)| a + v)
        .collect();
    Rollout {
        obs,
        obs_dim: 4,
        actions_discrete: actions.iter().map(|&a| a as u32).collect(),
        actions_continuous: Vec::new(),
        action_dim: 0,
        old_logprobs: out.logprobs,
        old_values: out.values,
        advantages,
        returns,
        masks: Vec::new(),
        mask_width: 0,
        len: n,
        vec_steps: n as u64,
        oldest_version: 0,
        sequences: None,
    }
}

#[test]
fn a_ppo_update_stops_between_two_gradient_steps() {
    let model = ActorCritic::new(&PolicySpec::discrete(4, 2), 1).unwrap();
    let mut optimizer = Optimizer::Adam(Adam::new(model.vars(), AdamConfig::default()).unwrap());
    let rollout = rollout(&model);
    // 4 epochs of 8 minibatches: 32 gradient steps unless stopped.
    let config = PpoConfig {
        minibatch_size: 32,
        epochs: 4,
        ..PpoConfig::default()
    };
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(1);
    let mut whole = StopsAfter {
        looked: AtomicUsize::new(0),
        after: usize::MAX,
    };
    let stats = ppo::update(
        &model,
        &mut optimizer,
        &rollout,
        &config,
        0.0,
        &mut rng,
        &mut whole,
    )
    .unwrap();
    assert_eq!(stats.gradient_steps, 32);
    assert_eq!(*whole.looked.get_mut(), 32, "one look before each step");

    let mut stopped = StopsAfter {
        looked: AtomicUsize::new(0),
        after: 5,
    };
    let result = ppo::update(
        &model,
        &mut optimizer,
        &rollout,
        &config,
        0.0,
        &mut rng,
        &mut stopped,
    );
    assert!(
        matches!(result, Err(UpdateError::Stopped)),
        "{:?}",
        result.err()
    );
    assert_eq!(*stopped.looked.get_mut(), 6, "5 steps, then the stop");
}
