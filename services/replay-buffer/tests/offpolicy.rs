//! The replay-buffer's off-policy table (`run.algo: dqn`) against a real
//! redis-server and nats-server, served by two replay-buffer copies that
//! share it: insert, uniform and prioritized sampling, priority updates,
//! FIFO eviction, the rate limiter, the sum tree kept exact through
//! batched updates, and bad input refused while the service keeps
//! answering.

use std::collections::HashMap;
use std::time::Duration;

use relay_config::ExperimentConfig;
use relay_kit::{RequestError, ServiceConfig, Shutdown, ShutdownTrigger};
use relay_proto::{
    InsertAck, PriorityAck, PriorityUpdate, RolloutFragment, Subjects, Tensor, TransitionBatch,
    TransitionSampleRequest, SCHEMA_VERSION,
};
use relay_testkit::{NatsServer, RedisServer};

fn config(nats: &NatsServer, redis: &RedisServer, run_id: &str, extra: &str) -> ServiceConfig {
    let text = format!(
        "run:\n  id: {run_id}\n  env_id: CartPole-v1\n  algo: dqn\nconnections:\n  nats_url: {}\n  redis_url: {}\n  request_timeout_ms: 2000\nenv_runner:\n  num_envs: 1\n  fragment_steps: 4\n{extra}",
        nats.url(),
        redis.url()
    );
    ServiceConfig::for_test(ExperimentConfig::from_layers(&text, "test", &[], &[]).unwrap())
}

/// `t` steps of one env; rewards `first, first + 1, ...` (so a transition's
/// reward names it), no episode end.
fn fragment(t: usize, first: f32) -> RolloutFragment {
    RolloutFragment {
        schema: SCHEMA_VERSION,
        runner_id: "test".into(),
        env_id: "CartPole-v1".into(),
        policy_version: 0,
        num_steps: t as u32,
        num_envs: 1,
        obs: Tensor::from_f32(&[t, 1, 4], &vec![0.1; t * 4]),
        actions: Tensor::from_i64(&[t, 1], &vec![1; t]),
        logprobs: Tensor::from_f32(&[t, 1], &vec![0.0; t]),
        values: Tensor::from_f32(&[t, 1], &vec![0.0; t]),
        rewards: Tensor::from_f32(
            &[t, 1],
            &(0..t).map(|i| first + i as f32).collect::<Vec<_>>(),
        ),
        terminated: Tensor::from_bool(&[t, 1], &vec![false; t]),
        truncated: Tensor::from_bool(&[t, 1], &vec![false; t]),
        next_obs: Tensor::from_f32(&[1, 4], &[0.2; 4]),
        final_obs: Tensor::from_f32(&[0, 4], &[]),
        norm_rewards: None,
        norm_delta: None,
        masks: None,
        frames: None,
        initial_state: None,
    }
}

struct Client {
    nats: async_nats::Client,
    s: Subjects,
}

impl Client {
    async fn insert(&self, f: &RolloutFragment) -> Result<InsertAck, RequestError> {
        relay_kit::request(
            &self.nats,
            &self.s.replay_insert(),
            f,
            Duration::from_secs(2),
        )
        .await
    }
    async fn sample(&self, batch_size: u32, beta: f64) -> Result<TransitionBatch, RequestError> {
        let ask = TransitionSampleRequest {
            schema: SCHEMA_VERSION,
            batch_size,
            beta,
        };
        relay_kit::request(
            &self.nats,
            &self.s.replay_transitions_sample(),
            &ask,
            Duration::from_secs(2),
        )
        .await
    }
    async fn priorities(&self, ids: &[u64], p: &[f32]) -> Result<PriorityAck, RequestError> {
        let update = PriorityUpdate {
            schema: SCHEMA_VERSION,
            ids: ids.to_vec(),
            priorities: Tensor::from_f32(&[p.len()], p),
        };
        relay_kit::request(
            &self.nats,
            &self.s.replay_priorities(),
            &update,
            Duration::from_secs(2),
        )
        .await
    }
    /// Waits until a copy answers.
    async fn ready(&self) {
        for _ in 0..200 {
            if self.sample(0, 0.0).await.is_ok() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("replay-buffer never answered");
    }
}

/// `copies` replay-buffer copies serving table `run_id` (config `extra`),
/// and a client once one answers.
async fn serve(
    nats: &NatsServer,
    redis: &RedisServer,
    run_id: &str,
    extra: &str,
    copies: usize,
) -> (Client, Copies) {
    let (trigger, shutdown) = Shutdown::new();
    let handles = (0..copies)
        .map(|_| {
            tokio::spawn(relay_replay_buffer::run(
                config(nats, redis, run_id, extra),
                shutdown.clone(),
            ))
        })
        .collect();
    let c = Client {
        nats: async_nats::connect(nats.url()).await.unwrap(),
        s: Subjects::new(run_id),
    };
    c.ready().await;
    (c, Copies { trigger, handles })
}

/// Running replay-buffer copies, stopped together.
struct Copies {
    trigger: ShutdownTrigger,
    handles: Vec<tokio::task::JoinHandle<Result<(), relay_kit::ServiceError>>>,
}

impl Copies {
    /// Signals shutdown and waits for every copy to return cleanly.
    async fn stop(self) {
        self.trigger.trigger();
        for copy in self.handles {
            tokio::time::timeout(Duration::from_secs(10), copy)
                .await
                .expect("copy stops")
                .unwrap()
                .unwrap();
        }
    }
}

fn service_error(e: RequestError) -> (String, String) {
    match e {
        RequestError::Service { code, status, .. } => (code, status),
        other => panic!("expected an error reply, got {other}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prioritized_table_samples_by_priority_evicts_fifo_and_refuses_bad_input() {
    let nats = NatsServer::start().unwrap();
    let redis = RedisServer::start().unwrap();
    let run_id = "offpolicy-per";
    // Capacity 8, alpha 1 (priorities are probabilities up to a constant),
    // 1-step returns.
    // The table alone, sampled freely: no rate limiter.
    let extra = "dqn:\n  buffer_size: 8\n  batch_size: 4\n  prioritized: true\n  prioritized_alpha: 1.0\n  gamma: 0.5\nreplay:\n  samples_per_insert: off\n";
    let (c, copies) = serve(&nats, &redis, run_id, extra, 2).await;

    // Empty table: counters only, no rows.
    let empty = c.sample(16, 0.4).await.unwrap();
    assert_eq!(
        (empty.ids.len(), empty.size, empty.inserted_steps),
        (0, 0, 0)
    );

    // Four transitions (ids 0..4, rewards 0..4): each holds its 1-step
    // return and bootstraps with γ from the next observation.
    let ack = c.insert(&fragment(4, 0.0)).await.unwrap();
    assert!(ack.accepted, "{ack:?}");
    assert_eq!(ack.buffered_steps, 4);
    let b = c.sample(64, 1.0).await.unwrap();
    assert_eq!((b.ids.len(), b.size, b.inserted_steps), (64, 4, 4));
    let rewards = b.rewards.to_f32().unwrap();
    for (id, r) in b.ids.iter().zip(&rewards) {
        assert!(*id < 4 && *r == *id as f32, "id {id} reward {r}");
    }
    assert!(b.discounts.to_f32().unwrap().iter().all(|&d| d == 0.5));
    assert_eq!(b.next_obs.to_f32().unwrap()[..4], [0.1; 4]);
    // Every new transition has the same (maximal) priority: equal weights.
    assert!(b.weights.to_f32().unwrap().iter().all(|&w| w == 1.0));

    // Priorities 1, 1, 1, 7: id 3 is drawn with probability 0.7.
    let ack = c
        .priorities(&[0, 1, 2, 3], &[1.0, 1.0, 1.0, 7.0])
        .await
        .unwrap();
    assert_eq!((ack.updated, ack.evicted), (4, 0));
    let mut counts: HashMap<u64, u32> = HashMap::new();
    let mut weight_of: HashMap<u64, f32> = HashMap::new();
    let draws = 4000;
    let b = c.sample(draws, 1.0).await.unwrap();
    for (id, w) in b.ids.iter().zip(b.weights.to_f32().unwrap()) {
        *counts.entry(*id).or_default() += 1;
        weight_of.insert(*id, w);
    }
    let freq = |id: u64| counts.get(&id).copied().unwrap_or(0) as f64 / draws as f64;
    assert!((freq(3) - 0.7).abs() < 0.03, "{counts:?}");
    for id in 0..3 {
        assert!((freq(id) - 0.1).abs() < 0.03, "{counts:?}");
    }
    // Importance weights (β = 1): (N P)^-1 over the largest: 1 for the
    // rare ones, 1/7 for id 3.
    assert!((weight_of[&3] - 1.0 / 7.0).abs() < 1e-5, "{weight_of:?}");
    assert!((weight_of[&0] - 1.0).abs() < 1e-6);
    // β = 0: no correction.
    let b = c.sample(32, 0.0).await.unwrap();
    assert!(b.weights.to_f32().unwrap().iter().all(|&w| w == 1.0));

    // New transitions get the largest priority seen (7): ids 4..8.
    assert!(c.insert(&fragment(4, 4.0)).await.unwrap().accepted);
    let b = c.sample(256, 1.0).await.unwrap();
    assert_eq!(b.size, 8);
    for (id, w) in b.ids.iter().zip(b.weights.to_f32().unwrap()) {
        let want = if *id >= 3 { 1.0 / 7.0 } else { 1.0 };
        assert!((w - want).abs() < 1e-5, "id {id} weight {w}");
    }

    // Full: the next four evict ids 0..4 (FIFO); their slots hold ids 8..12.
    let ack = c.insert(&fragment(4, 8.0)).await.unwrap();
    assert!(ack.accepted);
    assert_eq!(ack.buffered_steps, 8);
    let b = c.sample(512, 0.5).await.unwrap();
    assert_eq!((b.size, b.inserted_steps), (8, 12));
    let rewards = b.rewards.to_f32().unwrap();
    for (id, r) in b.ids.iter().zip(&rewards) {
        assert!(
            (4..12).contains(id) && *r == *id as f32,
            "id {id} reward {r}"
        );
    }
    // A priority for an evicted id is skipped and counted.
    let ack = c.priorities(&[0, 9], &[5.0, 0.5]).await.unwrap();
    assert_eq!((ack.updated, ack.evicted), (1, 1));

    // Bad input gets a clear error naming the field; the table is unchanged.
    let (code, status) = service_error(c.priorities(&[4], &[f32::NAN]).await.unwrap_err());
    assert_eq!(code, "400");
    assert!(status.contains("priorities"), "{status}");
    let (code, status) = service_error(c.priorities(&[4], &[-1.0]).await.unwrap_err());
    assert!(code == "400" && status.contains("priorities"), "{status}");
    let (code, status) = service_error(c.sample(4, 1.5).await.unwrap_err());
    assert!(code == "400" && status.contains("beta"), "{status}");
    let (code, status) = service_error(c.sample(100_000, 0.5).await.unwrap_err());
    assert!(code == "400" && status.contains("batch_size"), "{status}");
    let mut other_env = fragment(4, 0.0);
    other_env.env_id = "Acrobot-v1".into();
    let (code, status) = service_error(c.insert(&other_env).await.unwrap_err());
    assert!(code == "400" && status.contains("env_id"), "{status}");
    let mut wide = fragment(2, 0.0);
    wide.obs = Tensor::from_f32(&[2, 1, 6], &[0.0; 12]);
    wide.next_obs = Tensor::from_f32(&[1, 6], &[0.0; 6]);
    wide.final_obs = Tensor::from_f32(&[0, 6], &[]);
    let (code, status) = service_error(c.insert(&wide).await.unwrap_err());
    assert!(code == "400" && status.contains("obs"), "{status}");
    // The on-policy sample names the endpoint to use instead.
    let wrong: Result<relay_proto::SampleReply, _> = relay_kit::request(
        &c.nats,
        &c.s.replay_sample(),
        &relay_proto::SampleRequest {
            schema: SCHEMA_VERSION,
            min_policy_version: 0,
            max_steps: 8,
        },
        Duration::from_secs(2),
    )
    .await;
    let (_, status) = service_error(wrong.unwrap_err());
    assert!(status.contains("replay.transitions.sample"), "{status}");
    // Still serving, table intact.
    let b = c.sample(8, 1.0).await.unwrap();
    assert_eq!((b.ids.len(), b.size, b.inserted_steps), (8, 8, 12));

    copies.stop().await;
}

/// The sum tree as stored: `2P` little-endian f64, node `i` at `8i`.
async fn stored_tree(redis: &RedisServer, run_id: &str) -> Vec<f64> {
    let mut conn = redis::Client::open(redis.url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let bytes: Vec<u8> = redis::cmd("GET")
        .arg(format!("relay:{run_id}:offpolicy:tree"))
        .query_async(&mut conn)
        .await
        .unwrap();
    bytes
        .chunks_exact(8)
        .map(|c| f64::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sum_tree_stays_exact_through_batched_updates_and_wraparound() {
    let nats = NatsServer::start().unwrap();
    let redis = RedisServer::start().unwrap();
    let run_id = "offpolicy-tree";
    // Capacity 1000: 1024 leaves, 24 of them never used.
    let extra = "dqn:\n  buffer_size: 1000\n  batch_size: 32\n  prioritized: true\n  prioritized_alpha: 0.6\nreplay:\n  samples_per_insert: off\n";
    let (c, copies) = serve(&nats, &redis, run_id, extra, 1).await;
    // Ids 0..1300 in small inserts (the last 300 overwrite the slots of
    // ids 0..300), each followed by a small batch of priorities.
    let mut priority_of: HashMap<u64, f64> = HashMap::new();
    let mut next = 0u64;
    for round in 0..13u64 {
        assert!(
            c.insert(&fragment(100, next as f32))
                .await
                .unwrap()
                .accepted
        );
        next += 100;
        // A batch of priorities for held ids, scattered and repeated
        // (the last value of an id counts), and one evicted id.
        let ids: Vec<u64> = (0..120)
            .map(|k| (next.saturating_sub(1000)) + (k * 37 + round * 11) % next.min(1000))
            .collect();
        let p: Vec<f32> = (0..ids.len())
            .map(|k| 0.05 + ((k as u64 * 7919 + round * 104_729) % 1000) as f32 / 100.0)
            .collect();
        let mut sent_ids = ids.clone();
        let mut sent_p = p.clone();
        if next > 1000 {
            sent_ids.push(0);
            sent_p.push(3.0);
        }
        let ack = c.priorities(&sent_ids, &sent_p).await.unwrap();
        assert_eq!(ack.updated as usize, ids.len());
        assert_eq!(ack.evicted as usize, sent_ids.len() - ids.len());
        for (id, p) in ids.iter().zip(&p) {
            priority_of.insert(*id, *p as f64);
        }
    }
    // Then a large insert and a large batch of priorities: scripts that
    // move the whole tree at once.
    assert!(
        c.insert(&fragment(600, next as f32))
            .await
            .unwrap()
            .accepted
    );
    next += 600;
    let ids: Vec<u64> = (0..700).map(|k| next - 1000 + (k * 13) % 1000).collect();
    let p: Vec<f32> = (0..ids.len())
        .map(|k| 0.01 + ((k as u64 * 6007) % 997) as f32 / 50.0)
        .collect();
    let ack = c.priorities(&ids, &p).await.unwrap();
    assert_eq!((ack.updated as usize, ack.evicted), (ids.len(), 0));
    for (id, p) in ids.iter().zip(&p) {
        priority_of.insert(*id, *p as f64);
    }

    let tree = stored_tree(&redis, run_id).await;
    let leaves = 1024usize;
    assert_eq!(tree.len(), 2 * leaves);
    // Every inner node is exactly the sum of its children.
    for i in 1..leaves {
        assert_eq!(tree[i], tree[2 * i] + tree[2 * i + 1], "node {i}");
    }
    // Held ids: their priority^alpha where one was sent after they were
    // inserted, else the largest priority seen before their insert
    // (checked loosely: some mass).
    let held = next - 1000..next;
    for id in held.clone() {
        let leaf = tree[leaves + (id % 1000) as usize];
        match priority_of.get(&id) {
            Some(p) => assert!(
                (leaf - p.powf(0.6)).abs() < 1e-6 * leaf,
                "id {id}: {leaf} vs {p}"
            ),
            None => assert!(leaf > 0.0, "id {id} has no mass"),
        }
    }
    // Slots past the capacity hold nothing, and sampling follows the
    // stored masses: the root is their total.
    assert!(tree[leaves + 1000..].iter().all(|&v| v == 0.0));
    let total: f64 = tree[leaves..].iter().sum();
    assert!((tree[1] - total).abs() < 1e-9 * total);
    for batch in [256, 1024] {
        let b = c.sample(batch, 1.0).await.unwrap();
        assert_eq!(b.ids.len(), batch as usize);
        assert!(b.ids.iter().all(|id| held.contains(id)), "{:?}", b.ids);
    }

    copies.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn uniform_table_with_rate_limiter_paces_inserts_against_samples() {
    let nats = NatsServer::start().unwrap();
    let redis = RedisServer::start().unwrap();
    let run_id = "offpolicy-rate";
    // 2 transitions sampled per env step inserted, sampling from 4 env
    // steps on, slack 4: inserts stop while inserted * 2 - taken > 12,
    // samples while inserted * 2 - taken - 4 < batch. (A learner would
    // sample from its first step on: learning_starts 0.)
    let extra = "dqn:\n  buffer_size: 64\n  batch_size: 4\n  learning_starts: 0\nreplay:\n  samples_per_insert: 2.0\n  min_size_to_sample: 4\n  rate_error_buffer: 4\n";
    let (c, copies) = serve(&nats, &redis, run_id, extra, 1).await;

    assert!(c.insert(&fragment(4, 0.0)).await.unwrap().accepted);
    let refused = c.insert(&fragment(4, 4.0)).await.unwrap();
    assert!(!refused.accepted);
    assert_eq!(refused.reason, "rate");
    assert!(refused.retry_after_ms > 0);
    // The learner may take 4; then it is held back (empty batch).
    let b = c.sample(4, 1.0).await.unwrap();
    assert_eq!(b.ids.len(), 4);
    assert!(b.weights.to_f32().unwrap().iter().all(|&w| w == 1.0));
    let held = c.sample(4, 1.0).await.unwrap();
    assert_eq!((held.ids.len(), held.size), (0, 4));
    // What it took makes room for the next insert.
    assert!(c.insert(&fragment(4, 4.0)).await.unwrap().accepted);
    let b = c.sample(4, 1.0).await.unwrap();
    assert_eq!((b.ids.len(), b.size, b.inserted_steps), (4, 8, 8));

    // Uniform: each of the 8 held drawn about equally often.
    let mut counts = [0u32; 8];
    // (The limiter allows no more now; a fresh table without it samples freely.)
    drop(b);
    copies.stop().await;
    let (c, copies) = serve(
        &nats,
        &redis,
        "offpolicy-uniform",
        "dqn:\n  buffer_size: 64\nreplay:\n  samples_per_insert: off\n",
        1,
    )
    .await;
    assert!(c.insert(&fragment(4, 0.0)).await.unwrap().accepted);
    assert!(c.insert(&fragment(4, 4.0)).await.unwrap().accepted);
    let b = c.sample(4000, 0.4).await.unwrap();
    for id in &b.ids {
        counts[*id as usize] += 1;
    }
    for n in counts {
        assert!((n as f64 / 4000.0 - 0.125).abs() < 0.03, "{counts:?}");
    }
    assert!(b.weights.to_f32().unwrap().iter().all(|&w| w == 1.0));
    copies.stop().await;
}
