//! Learner replicas' updates against a real nats-server: two replicas,
//! each computing its half of every minibatch and summing gradients by the
//! group's ring all-reduce, end with bit-identical parameters, equal to one
//! learner's on the same global batches within 1e-5 (relative): PPO after
//! 24 gradient steps (3 updates of 2 epochs of 4 minibatches), A2C
//! (RMSprop) after 20, DQN (importance weights, priorities, Polyak target
//! updates) after 20, REINFORCE with a value baseline and normalised
//! advantages (their statistics summed across replicas first) after 20,
//! SAC (entropy tuning, twin critics, actor: three optimizers, each
//! summed) after 20, and a LoRA GRPO update of a tiny language model
//! (a KL penalty in the rewards, two epochs: every sequence's penalty and
//! log-probs summed too) after 6, and LoRA SFT after 4. The sums are the same numbers added in another
//! order (two halves, then the halves together), which float addition
//! does not keep exactly, and the optimizers carry those last-bit
//! differences forward.

use std::time::Duration;

use rand::{Rng, SeedableRng};
use relay_algo::optimizer::Optimizer;
use relay_algo::reinforce::{self, End, Episode};
use relay_algo::rollout::Rollout;
use relay_algo::{a2c, dqn, ppo, sac};
use relay_config::{A2cConfig, Baseline, DqnConfig, PpoConfig, ReinforceConfig};
use relay_kit::collective::{Group, GroupConfig, View};
use relay_nn::{
    Actions, ActorCritic, Adam, AdamConfig, BatchShare, Pair, PolicySpec, QNetSpec, QNetwork,
    RmsProp, RmsPropConfig, Sac, SacConfig, SacOptimizers, SacSpec,
};
use relay_proto::{Tensor as Wire, TransitionBatch, SCHEMA_VERSION};
use relay_testkit::NatsServer;

const SEED: u64 = 11;

fn model() -> ActorCritic {
    let mut spec = PolicySpec::discrete(4, 3);
    spec.hidden = vec![32, 32];
    ActorCritic::new(&spec, SEED).unwrap()
}

/// A rollout of 256 steps acted by `model` itself, random advantages.
fn rollout(model: &ActorCritic, round: u64) -> Rollout {
    let n = 256;
    let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(round);
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

fn config() -> PpoConfig {
    PpoConfig {
        minibatch_size: 64,
        epochs: 2,
        ent_coef: relay_nn::Schedule::constant(0.01),
        ..PpoConfig::default()
    }
}

/// Every parameter's values, in name order.
fn flat(tensors: Vec<relay_nn::NamedTensor>) -> Vec<f32> {
    tensors.into_iter().flat_map(|(_, _, d)| d).collect()
}

/// A random batch of 64 transitions with 4 observations (one in five
/// terminal), drawn from `seed`, carrying `actions` and importance `weights`.
fn transitions(seed: u64, actions: Wire, weights: &[f32]) -> TransitionBatch {
    let b = 64;
    let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let mut uniform =
        |k: usize| -> Vec<f32> { (0..k).map(|_| r.random_range(-1.0..1.0)).collect() };
    let (obs, next, rewards) = (uniform(b * 4), uniform(b * 4), uniform(b));
    let discounts: Vec<f32> = (0..b)
        .map(|i| if i % 5 == 0 { 0.0 } else { 0.99 })
        .collect();
    TransitionBatch {
        schema: SCHEMA_VERSION,
        ids: (0..b as u64).collect(),
        obs: Wire::from_f32(&[b, 4], &obs),
        actions,
        rewards: Wire::from_f32(&[b], &rewards),
        next_obs: Wire::from_f32(&[b, 4], &next),
        discounts: Wire::from_f32(&[b], &discounts),
        terminated: Wire::from_bool(&[b], &vec![false; b]),
        truncated: Wire::from_bool(&[b], &vec![false; b]),
        weights: Wire::from_f32(&[b], weights),
        weight_scale: None,
        size: b as u64,
        inserted_steps: b as u64,
        next_masks: None,
    }
}

/// Three PPO updates (each on a fresh rollout the model acted) as `sync`
/// shares them; returns the parameters and each update's approx KL.
fn train_ppo(sync: &mut BatchShare<'_>) -> (Vec<f32>, Vec<f64>) {
    let model = model();
    let mut optimizer = Optimizer::Adam(
        Adam::new(
            model.vars(),
            AdamConfig {
                lr: 1e-3,
                ..Default::default()
            },
        )
        .unwrap(),
    );
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(SEED);
    let mut kls = Vec::new();
    for round in 0..3 {
        let rollout = rollout(&model, round);
        let stats = ppo::update(
            &model,
            &mut optimizer,
            &rollout,
            &config(),
            round as f64 / 3.0,
            &mut rng,
            sync,
        )
        .unwrap();
        assert_eq!(stats.gradient_steps, 8);
        kls.push(stats.approx_kl);
    }
    (flat(model.named_tensors()), kls)
}

/// Twenty A2C steps with RMSprop as `sync` shares them; returns the
/// parameters and each step's total loss.
fn train_a2c(sync: &mut BatchShare<'_>) -> (Vec<f32>, Vec<f64>) {
    let model = model();
    let mut optimizer = Optimizer::RmsProp(
        RmsProp::new(
            model.vars(),
            RmsPropConfig {
                lr: 1e-3,
                ..Default::default()
            },
        )
        .unwrap(),
    );
    let cfg = A2cConfig {
        normalize_advantage: true,
        ..A2cConfig::default()
    };
    let losses = (0..20)
        .map(|step| {
            let rollout = rollout(&model, 100 + step);
            a2c::update(&model, &mut optimizer, &rollout, &cfg, 0.5, sync)
                .unwrap()
                .total_loss
        })
        .collect();
    (flat(model.named_tensors()), losses)
}

/// Twenty DQN steps on random prioritized batches of 64 (importance
/// weights below 1), a Polyak target update after each, as `sync` shares
/// them; returns the online parameters and each step's loss and summed
/// priorities.
fn train_dqn(sync: &mut BatchShare<'_>) -> (Vec<f32>, Vec<f64>) {
    let spec = QNetSpec {
        hidden: vec![32, 32],
        ..QNetSpec::new(4, 3)
    };
    let online = QNetwork::new(&spec, SEED).unwrap();
    let target = online.duplicate().unwrap();
    let mut adam = Adam::new(
        online.vars(),
        AdamConfig {
            lr: 1e-3,
            ..Default::default()
        },
    )
    .unwrap();
    let cfg = DqnConfig::default();
    let mut stats = Vec::new();
    for step in 0..20u64 {
        let b = 64;
        let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(1200 + step);
        let weights: Vec<f32> = (0..b).map(|_| r.random_range(0.3..1.0)).collect();
        let actions: Vec<i64> = (0..b).map(|i| ((i as u64 * 7 + step) % 3) as i64).collect();
        let batch = transitions(200 + step, Wire::from_i64(&[b], &actions), &weights);
        let (loss, _, priorities) =
            dqn::gradient_step(&cfg, &online, &target, &mut adam, &batch, sync).unwrap();
        assert_eq!(
            priorities.len(),
            b,
            "every replica has the whole batch's priorities"
        );
        target.soft_update(&online, 0.1).unwrap();
        stats.push(loss.loss as f64);
        stats.push(priorities.iter().map(|&p| p as f64).sum());
    }
    (flat(online.named_tensors()), stats)
}

/// Twenty REINFORCE steps (value baseline, normalised advantages) on 5
/// random episodes of 20 to 59 steps each, one cut by a time limit, as
/// `sync` shares them; returns the parameters and each step's loss.
fn train_reinforce(sync: &mut BatchShare<'_>) -> (Vec<f32>, Vec<f64>) {
    let model = model();
    let mut optimizer = Optimizer::Adam(
        Adam::new(
            model.vars(),
            AdamConfig {
                lr: 1e-3,
                ..Default::default()
            },
        )
        .unwrap(),
    );
    let cfg = ReinforceConfig {
        baseline: Baseline::Value,
        normalize_advantage: true,
        ..ReinforceConfig::default()
    };
    let losses = (0..20u64)
        .map(|step| {
            let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(300 + step);
            let episodes: Vec<Episode> = (0..5)
                .map(|e| {
                    let len = r.random_range(20..60);
                    Episode {
                        obs: (0..len * 4).map(|_| r.random_range(-1.0..1.0)).collect(),
                        actions_discrete: (0..len).map(|_| r.random_range(0..3)).collect(),
                        actions_continuous: Vec::new(),
                        rewards: (0..len).map(|_| r.random_range(0.0..1.0)).collect(),
                        versions: vec![0; len],
                        end: Some(if e == 0 {
                            End::Truncated(vec![0.1, -0.2, 0.3, 0.0])
                        } else {
                            End::Terminated
                        }),
                        masks: Vec::new(),
                    }
                })
                .collect();
            reinforce::update(&model, &mut optimizer, &episodes, &cfg, 0.5, sync)
                .unwrap()
                .total_loss
        })
        .collect();
    (flat(model.named_tensors()), losses)
}

/// Twenty SAC steps on random batches of 64 (2-dimensional actions in
/// [-2, 2]) as `sync` shares them; returns every parameter and each step's
/// critic and actor losses and entropy coefficient.
fn train_sac(sync: &mut BatchShare<'_>) -> (Vec<f32>, Vec<f64>) {
    let mut spec = SacSpec::new(4, vec![-2.0; 2], vec![2.0; 2]);
    spec.hidden = vec![32, 32];
    let model = Sac::new(&spec, 1.0, SEED).unwrap();
    let config = SacConfig::default();
    let mut optimizers = SacOptimizers::new(&model, &config).unwrap();
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(SEED);
    let mut stats = Vec::new();
    for step in 0..20u64 {
        let b = 64;
        let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(1400 + step);
        let actions: Vec<f32> = (0..b * 2).map(|_| r.random_range(-2.0..2.0)).collect();
        let batch = transitions(400 + step, Wire::from_f32(&[b, 2], &actions), &vec![1.0; b]);
        let s = sac::gradient_step(
            &config,
            &model,
            &mut optimizers,
            &batch,
            &mut rng,
            &Pair::sequential(),
            sync,
        )
        .unwrap();
        stats.extend([s.critic_loss as f64, s.actor_loss as f64, s.ent_coef as f64]);
    }
    (flat(model.named_tensors()), stats)
}

/// A tiny random Qwen-shaped model (its folder kept alive) and a rank-4
/// LoRA adapter on every projection.
fn tiny_model_and_adapter(
    name: &str,
) -> (
    relay_testkit::TempDir,
    relay_llm::CausalLm,
    relay_llm::LoraAdapter,
) {
    use relay_llm::{CausalLm, LoraAdapter, LoraConfig, TinyShape, TinyVocab};
    let dir = relay_testkit::TempDir::new(name);
    let vocab = TinyVocab {
        size: 64,
        bos_token_id: None,
        eos_token_id: Some(2),
        pad_token_id: Some(0),
    };
    let shape = TinyShape {
        hidden_size: 64,
        intermediate_size: 128,
        num_hidden_layers: 2,
        num_attention_heads: 4,
        num_key_value_heads: 2,
        max_position_embeddings: 128,
        ..TinyShape::default()
    };
    relay_llm::init::tiny_with_shape(dir.path(), 5, &vocab, &shape).unwrap();
    let model = CausalLm::load_hf(dir.path()).unwrap();
    let adapter = LoraAdapter::new(model.config(), LoraConfig::all_projections(4, 8.0), 3).unwrap();
    (dir, model, adapter)
}

fn adapter_factors(adapter: &relay_llm::LoraAdapter) -> Vec<f32> {
    adapter
        .named_vars()
        .into_iter()
        .flat_map(|(_, v)| {
            v.as_tensor()
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap()
        })
        .collect()
}

/// Four LoRA SFT steps on batches of 8 random completions, micro-batches
/// of 2, as `sync` shares them; returns the factors and each step's loss
/// and token accuracy.
fn train_sft(sync: &mut BatchShare<'_>) -> (Vec<f32>, Vec<f64>) {
    use relay_llm::{BatchConfig, SftConfig, SftExample, SftTrainer, Truncation};
    let (_dir, model, adapter) = tiny_model_and_adapter("replicas-sft");
    let config = SftConfig {
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
        aggregation: Default::default(),
    };
    let mut trainer = SftTrainer::new(config, adapter.named_vars()).unwrap();
    let mut stats = Vec::new();
    for round in 0..4u64 {
        let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(600 + round);
        let examples: Vec<SftExample> = (0..8)
            .map(|_| SftExample {
                prompt: vec![1, r.random_range(3..60), 6],
                completion: (0..r.random_range(2..6))
                    .map(|_| r.random_range(3..60))
                    .chain([2])
                    .collect(),
                alternatives: Vec::new(),
            })
            .collect();
        let s = trainer
            .train_step_part(&model, Some(&adapter), &examples, sync)
            .unwrap();
        stats.extend([s.loss, s.token_accuracy]);
    }
    (adapter_factors(&adapter), stats)
}

/// Three GRPO batches of 8 completions (2 groups of 4) on a tiny random
/// Qwen-shaped model with a rank-4 LoRA adapter, two epochs each, micro-
/// batches of 2 (4 per batch: 2 per replica), with a KL penalty to the
/// base model in the rewards; returns the adapter's factors and each
/// step's loss and KL penalty.
fn train_grpo(sync: &mut BatchShare<'_>) -> (Vec<f32>, Vec<f64>) {
    use relay_llm::{
        BatchConfig, KlMode, ObjectiveConfig, RlTrainConfig, RlTrainer, TokenExample, Truncation,
    };
    let (_dir, model, adapter) = tiny_model_and_adapter("replicas-grpo");
    let mut objective = ObjectiveConfig::grpo();
    objective.kl.as_mut().unwrap().mode = KlMode::RewardPenalty;
    let config = RlTrainConfig {
        objective,
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
    let mut trainer = RlTrainer::new(config, &adapter).unwrap();
    let mut stats = Vec::new();
    for round in 0..3u64 {
        let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(500 + round);
        let examples: Vec<TokenExample> = (0..8u64)
            .map(|i| {
                let completion: Vec<u32> = (0..r.random_range(2..6))
                    .map(|_| r.random_range(3..60))
                    .chain([2])
                    .collect();
                TokenExample {
                    prompt: vec![1, 5 + i as u32 % 2, 6, 7],
                    behaviour_logprobs: completion
                        .iter()
                        .map(|_| r.random_range(-4.5f32..-3.5))
                        .collect(),
                    completion,
                    reward: r.random_range(0.0..1.0),
                    group: i / 4,
                    stratum: 0,
                }
            })
            .collect();
        let steps = trainer
            .train_epochs_part(&model, &adapter, &examples, 2, sync)
            .unwrap();
        for s in steps {
            stats.extend([s.loss, s.kl_penalty, s.epoch_kl]);
        }
    }
    (adapter_factors(&adapter), stats)
}

/// A training run as a replica shares it: the parameters and a statistic per update.
type Training = fn(&mut BatchShare<'_>) -> (Vec<f32>, Vec<f64>);

/// `train` alone, then by two replicas of a group over a real nats-server;
/// checks the replicas agree bit for bit, and with the lone learner.
async fn two_replicas_train_as_one(group: &str, train: Training) {
    let (alone, alone_stats) = tokio::task::spawn_blocking(move || train(&mut BatchShare::whole()))
        .await
        .unwrap();

    let server = NatsServer::start().unwrap();
    let nats = async_nats::connect(server.url()).await.unwrap();
    let mut groups = Vec::new();
    for id in ["r0", "r1"] {
        let mut c = GroupConfig::new(group, id, "127.0.0.1:0".parse().unwrap());
        c.settle = Duration::from_millis(200);
        groups.push(Group::join(&nats, c).await.unwrap());
    }
    let mut view: Option<View> = None;
    for g in &mut groups {
        view = Some(g.view_after(None, Duration::from_secs(10)).await.unwrap());
    }
    let view = view.unwrap();
    assert_eq!(view.size(), 2, "{view:?}");
    let replicas = groups.into_iter().map(|mut group| {
        let view = view.clone();
        tokio::task::spawn_blocking(move || {
            let (trained, summed) = relay_replicas::in_group(&mut group, &view, 1, None, train);
            assert_eq!(summed.broken, None);
            trained
        })
    });
    let results: Vec<(Vec<f32>, Vec<f64>)> = futures::future::join_all(replicas)
        .await
        .into_iter()
        .map(Result::unwrap)
        .collect();

    let (first, first_stats) = &results[0];
    let (second, second_stats) = &results[1];
    assert!(
        first
            .iter()
            .zip(second)
            .all(|(a, b)| a.to_bits() == b.to_bits()),
        "{group}: the replicas' parameters differ"
    );
    assert_eq!(
        first_stats, second_stats,
        "{group}: the replicas saw different statistics"
    );
    let worst = first
        .iter()
        .zip(&alone)
        .map(|(a, b)| (a - b).abs() / (1.0 + b.abs()))
        .fold(0f32, f32::max);
    assert!(
        worst < 1e-5,
        "{group}: two replicas against one learner: gap {worst:e}"
    );
    let changed = alone_stats.windows(2).any(|w| w[0] != w[1]);
    assert!(changed, "{group}: the updates must change the model");
    for (a, b) in first_stats.iter().zip(&alone_stats) {
        assert!(
            (a - b).abs() < 1e-5 * (1.0 + b.abs()),
            "{group}: statistic {a} vs {b}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_ppo_replicas_train_as_one_learner_does() {
    two_replicas_train_as_one("ppo-learner", train_ppo).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_dqn_replicas_train_as_one_learner_does() {
    two_replicas_train_as_one("dqn-learner", train_dqn).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_reinforce_replicas_train_as_one_learner_does() {
    two_replicas_train_as_one("reinforce-learner", train_reinforce).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_sac_replicas_train_as_one_learner_does() {
    two_replicas_train_as_one("sac-learner", train_sac).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_grpo_replicas_train_as_one_learner_does() {
    two_replicas_train_as_one("grpo-learner", train_grpo).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_sft_replicas_train_as_one_learner_does() {
    two_replicas_train_as_one("sft-learner", train_sft).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_a2c_replicas_train_as_one_learner_does() {
    two_replicas_train_as_one("a2c-learner", train_a2c).await;
}
