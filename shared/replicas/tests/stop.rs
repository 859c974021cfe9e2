//! A PPO update of many minibatches ends before its next gradient step once
//! the learner is stopping (`BatchShare::stopping`), with
//! `UpdateError::Stopped`: a stop is not held up for the rest of an update
//! that can take minutes (a CNN on CPU). The learner rolls the part done
//! back (services/relay/tests/shutdown_e2e.rs checks it end to end).
//!
//! The same for a text update (LoRA GRPO, tens of seconds for SmolLM2 on
//! CPU): it ends between two blocks of a forward or backward pass with
//! `TrainError::Stopped`, and a replica that stops leaves its peer no
//! wait: the peer's sum fails as the stopped replica leaves the group
//! (services/relay/tests/text_shutdown_e2e.rs checks the learner end to
//! end).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use rand::{Rng, SeedableRng};
use relay_algo::optimizer::Optimizer;
use relay_algo::ppo;
use relay_algo::rollout::{Rollout, UpdateError};
use relay_config::PpoConfig;
use relay_kit::collective::{Group, GroupConfig, View};
use relay_llm::{
    BatchConfig, CausalLm, LoraAdapter, LoraConfig, ObjectiveConfig, RlStats, RlTrainConfig,
    RlTrainer, TokenExample, TrainError, TrainResult, Truncation,
};
use relay_nn::{Actions, ActorCritic, Adam, AdamConfig, BatchShare, PolicySpec};
use relay_testkit::NatsServer;

/// A stop check that says "stop" once it has been asked `after` times;
/// the stop comes `late` after that look began (a peer meanwhile waits
/// in the step's sum).
struct StopsAfter {
    looked: AtomicUsize,
    after: usize,
    late: Duration,
}

impl StopsAfter {
    fn new(after: usize) -> Self {
        Self {
            looked: AtomicUsize::new(0),
            after,
            late: Duration::ZERO,
        }
    }

    fn stopping(&self) -> bool {
        let looked = self.looked.fetch_add(1, Ordering::Relaxed);
        if looked == self.after {
            std::thread::sleep(self.late);
        }
        looked >= self.after
    }

    /// Runs `f` as a learner alone that stops as this check says.
    fn alone<R>(&self, f: impl FnOnce(&mut BatchShare<'_>) -> R) -> R {
        let check = || self.stopping();
        f(&mut BatchShare {
            stop: Some(&check),
            ..BatchShare::whole()
        })
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
    let mut whole = StopsAfter::new(usize::MAX);
    let stats = whole
        .alone(|share| {
            ppo::update(
                &model,
                &mut optimizer,
                &rollout,
                &config,
                0.0,
                &mut rng,
                share,
            )
        })
        .unwrap();
    assert_eq!(stats.gradient_steps, 32);
    assert_eq!(*whole.looked.get_mut(), 32, "one look before each step");

    let mut stopped = StopsAfter::new(5);
    let result = stopped.alone(|share| {
        ppo::update(
            &model,
            &mut optimizer,
            &rollout,
            &config,
            0.0,
            &mut rng,
            share,
        )
    });
    assert!(
        matches!(result, Err(UpdateError::Stopped)),
        "{:?}",
        result.err()
    );
    assert_eq!(*stopped.looked.get_mut(), 6, "5 steps, then the stop");
}

/// The tiny-qwen2 fixture (2 blocks), a rank-4 LoRA adapter on every
/// projection, and a GRPO trainer (KL loss term: a reference forward per
/// micro-batch) taking batches of 8 in micro-batches of 2.
fn text_learner() -> (CausalLm, LoraAdapter, RlTrainer) {
    let model = CausalLm::load_hf(&relay_testkit::llm_fixture("tiny-qwen2")).unwrap();
    let adapter = LoraAdapter::new(model.config(), LoraConfig::all_projections(4, 8.0), 3).unwrap();
    let config = RlTrainConfig {
        objective: ObjectiveConfig::grpo(),
        batch: BatchConfig {
            batch_size: 8,
            minibatch_size: 2,
            max_seq_len: 64,
            truncation: Truncation::CutPromptStart,
            recompute_activations: true,
        },
        optimizer: relay_llm::AdamWConfig {
            lr: 1e-2,
            ..Default::default()
        },
    };
    let trainer = RlTrainer::new(config, &adapter).unwrap();
    (model, adapter, trainer)
}

/// 8 completions of 2 groups, random rewards.
fn text_batch() -> Vec<TokenExample> {
    let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(5);
    (0..8u64)
        .map(|i| {
            let completion: Vec<u32> = (0..r.random_range(2..6))
                .map(|_| r.random_range(3..300))
                .collect();
            TokenExample {
                prompt: vec![1, 5 + i as u32 % 2, 6, 7],
                behaviour_logprobs: completion
                    .iter()
                    .map(|_| r.random_range(-6.5f32..-5.5))
                    .collect(),
                completion,
                reward: r.random_range(0.0..1.0),
                group: i / 4,
                stratum: 0,
            }
        })
        .collect()
}

fn adapter_values(adapter: &LoraAdapter) -> Vec<f32> {
    adapter
        .named_values()
        .unwrap()
        .into_iter()
        .flat_map(|t| t.2)
        .collect()
}

/// Two epochs of the text batch as `share` says.
fn text_update(
    model: &CausalLm,
    adapter: &LoraAdapter,
    trainer: &mut RlTrainer,
    share: &mut BatchShare<'_>,
) -> TrainResult<Vec<RlStats>> {
    trainer.train_epochs_part(model, adapter, &text_batch(), 2, share)
}

#[test]
fn a_text_update_stops_between_two_blocks() {
    let (model, adapter, mut trainer) = text_learner();
    let mut whole = StopsAfter::new(usize::MAX);
    let stats = whole
        .alone(|share| text_update(&model, &adapter, &mut trainer, share))
        .unwrap();
    assert_eq!(stats.len(), 2);
    assert_eq!(trainer.optimizer().steps(), 2);
    // 2 epochs of 4 micro-batches, each a reference forward, a forward
    // and a backward through 2 blocks: a look before each block.
    let blocks = model.config().num_hidden_layers;
    assert_eq!(*whole.looked.get_mut(), 2 * 4 * 3 * blocks);

    // Stopped between the two blocks of the second epoch's first
    // backward: the first epoch's step was taken (the learner puts back
    // the state it took before the update), the second's is not.
    let before = adapter_values(&adapter);
    let after = 4 * 3 * blocks + 2 * blocks + 1;
    let mut stopped = StopsAfter::new(after);
    let result = stopped.alone(|share| text_update(&model, &adapter, &mut trainer, share));
    assert!(
        matches!(result, Err(TrainError::Stopped)),
        "{:?}",
        result.err()
    );
    assert_eq!(
        *stopped.looked.get_mut(),
        after + 1,
        "no look after the stop"
    );
    assert_eq!(trainer.optimizer().steps(), 3, "one epoch stepped");
    assert_ne!(adapter_values(&adapter), before);
}

/// A replica that stops in the middle of a text update and leaves the
/// group (as the learner does once it has rolled the update back) does
/// not leave its peer waiting in the step's sum, where the peer waited
/// meanwhile: the peer's update fails (the learner then rolls it back and
/// waits for the next view, or stops) at once, well within a lease (3 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_replica_that_stops_mid_update_leaves_its_peer_no_wait() {
    let server = NatsServer::start().unwrap();
    let nats = async_nats::connect(server.url()).await.unwrap();
    let mut groups = Vec::new();
    for id in ["r0", "r1"] {
        let mut c = GroupConfig::new("text-stop", id, "127.0.0.1:0".parse().unwrap());
        c.settle = Duration::from_millis(200);
        groups.push(Group::join(&nats, c).await.unwrap());
    }
    let mut view: Option<View> = None;
    for g in &mut groups {
        view = Some(g.view_after(None, Duration::from_secs(10)).await.unwrap());
    }
    let view = view.unwrap();
    assert_eq!(view.size(), 2, "{view:?}");
    let mut groups = groups.into_iter();
    let (mut stopping, mut going) = (groups.next().unwrap(), groups.next().unwrap());

    let runtime = tokio::runtime::Handle::current();
    let stopper = {
        let view = view.clone();
        tokio::task::spawn_blocking(move || {
            let (model, adapter, mut trainer) = text_learner();
            // Between the two blocks of the first micro-batch's backward.
            let stops = StopsAfter {
                late: Duration::from_millis(500),
                ..StopsAfter::new(5)
            };
            let check = || stops.stopping();
            let (result, _) =
                relay_replicas::in_group(&mut stopping, &view, 1, Some(&check), |share| {
                    text_update(&model, &adapter, &mut trainer, share)
                });
            assert!(
                matches!(result, Err(TrainError::Stopped)),
                "{:?}",
                result.err()
            );
            runtime.block_on(stopping.leave()).unwrap();
            Instant::now()
        })
    };
    let peer = tokio::task::spawn_blocking(move || {
        let (model, adapter, mut trainer) = text_learner();
        let (result, summed) = relay_replicas::in_group(&mut going, &view, 1, None, |share| {
            text_update(&model, &adapter, &mut trainer, share)
        });
        let ended = Instant::now();
        let error = result.err().map(|e| e.to_string());
        (error, summed.broken, summed.reduced.seconds, ended)
    });
    let left = stopper.await.unwrap();
    let (error, broken, in_sum, ended) = peer.await.unwrap();
    assert!(error.is_some() && broken.is_some(), "{error:?} {broken:?}");
    assert!(in_sum > 0.3, "the peer waited {in_sum} s in the sum");
    let waited = ended.saturating_duration_since(left);
    eprintln!(
        "the peer's update failed {waited:?} after the stopped replica left ({in_sum:.2} s in the sum): {error:?}"
    );
    assert!(waited < Duration::from_secs(2), "{waited:?}");
}
