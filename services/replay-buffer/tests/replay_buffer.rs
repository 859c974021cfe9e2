//! The replay-buffer against a real redis-server and nats-server.

use std::time::Duration;

use relay_config::ExperimentConfig;
use relay_kit::{ServiceConfig, Shutdown};
use relay_proto::{
    InsertAck, RolloutFragment, SampleReply, SampleRequest, Subjects, Tensor, SCHEMA_VERSION,
};
use relay_testkit::{NatsServer, RedisServer};

fn config(nats: &NatsServer, redis: &RedisServer, run_id: &str) -> ServiceConfig {
    let text = format!(
        "run:\n  id: {run_id}\n  env_id: CartPole-v1\nconnections:\n  nats_url: {}\n  redis_url: {}\n  request_timeout_ms: 2000\nreplay:\n  capacity_steps: 48\n  max_policy_lag: 1\nppo:\n  rollout_steps: 16\n",
        nats.url(),
        redis.url()
    );
    ServiceConfig::for_test(ExperimentConfig::from_layers(&text, "test", &[], &[]).unwrap())
}

fn fragment(version: u64, t: usize, n: usize) -> RolloutFragment {
    RolloutFragment {
        schema: SCHEMA_VERSION,
        runner_id: "test".into(),
        env_id: "CartPole-v1".into(),
        policy_version: version,
        num_steps: t as u32,
        num_envs: n as u32,
        obs: Tensor::from_f32(&[t, n, 4], &vec![0.1; t * n * 4]),
        actions: Tensor::from_i64(&[t, n], &vec![0; t * n]),
        logprobs: Tensor::from_f32(&[t, n], &vec![-0.69; t * n]),
        values: Tensor::from_f32(&[t, n], &vec![0.0; t * n]),
        rewards: Tensor::from_f32(&[t, n], &vec![1.0; t * n]),
        terminated: Tensor::from_bool(&[t, n], &vec![false; t * n]),
        truncated: Tensor::from_bool(&[t, n], &vec![false; t * n]),
        next_obs: Tensor::from_f32(&[n, 4], &vec![0.1; n * 4]),
        final_obs: Tensor::from_f32(&[0, 4], &[]),
        norm_rewards: None,
        norm_delta: None,
        masks: None,
        frames: None,
        initial_state: None,
    }
}

async fn insert(client: &async_nats::Client, s: &Subjects, f: &RolloutFragment) -> InsertAck {
    relay_kit::request(client, &s.replay_insert(), f, Duration::from_secs(2))
        .await
        .unwrap()
}

/// The learner's sample request: fragments of `min_policy_version` or
/// newer, up to `max_steps` env steps.
async fn sample(
    client: &async_nats::Client,
    s: &Subjects,
    min_policy_version: u64,
    max_steps: u32,
) -> SampleReply {
    let ask = SampleRequest {
        schema: SCHEMA_VERSION,
        min_policy_version,
        max_steps,
    };
    relay_kit::request(client, &s.replay_sample(), &ask, Duration::from_secs(5))
        .await
        .unwrap()
}

/// The first insert, retried until the freshly started service answers.
async fn first_insert(client: &async_nats::Client, s: &Subjects, f: &RolloutFragment) -> InsertAck {
    for _ in 0..100 {
        match relay_kit::request(client, &s.replay_insert(), f, Duration::from_millis(500)).await {
            Ok(ack) => return ack,
            Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    }
    panic!("replay-buffer answers");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifo_backpressure_staleness_and_bad_input() {
    let nats = NatsServer::start().unwrap();
    let redis = RedisServer::start().unwrap();
    let run_id = "replay-test";
    let (trigger, shutdown) = Shutdown::new();
    let mut service_config = config(&nats, &redis, run_id);
    let metrics_addr: std::net::SocketAddr = ([127, 0, 0, 1], relay_testkit::free_port()).into();
    service_config.metrics_addr = metrics_addr;
    let server = tokio::spawn(relay_replay_buffer::run(service_config, shutdown));
    let client = async_nats::connect(nats.url()).await.unwrap();
    let s = Subjects::new(run_id);

    // Wait for the service to answer.
    let first = first_insert(&client, &s, &fragment(0, 4, 4)).await;
    assert!(first.accepted);
    assert_eq!(first.buffered_steps, 16);

    // Capacity 48 steps: two more fit, the fourth is refused (backpressure).
    assert!(insert(&client, &s, &fragment(1, 4, 4)).await.accepted);
    assert!(insert(&client, &s, &fragment(1, 4, 4)).await.accepted);
    let full = insert(&client, &s, &fragment(1, 4, 4)).await;
    assert!(!full.accepted);
    assert_eq!(full.reason, "full");
    assert!(full.retry_after_ms > 0);

    // Bad input: garbage, wrong schema, NaN. Each is refused with an error
    // reply, and what is stored stays.
    let mut wrong_schema = fragment(1, 4, 4);
    wrong_schema.schema = SCHEMA_VERSION + 7;
    let mut nan = fragment(1, 4, 4);
    nan.rewards = Tensor::from_f32(&[4, 4], &[f32::NAN; 16]);
    for payload in [
        b"not msgpack".to_vec(),
        relay_proto::encode(&wrong_schema),
        relay_proto::encode(&nan),
    ] {
        let reply = client
            .request(s.replay_insert(), payload.into())
            .await
            .unwrap();
        let headers = reply.headers.expect("error reply carries headers");
        assert_eq!(
            headers.get("Nats-Service-Error-Code").unwrap().as_str(),
            "400"
        );
    }

    // The learner is at version 2 with max lag 1: version 0 is dropped as stale.
    let reply = sample(&client, &s, 1, 32).await;
    assert_eq!(reply.dropped_stale, 1);
    assert_eq!(reply.fragments.len(), 2);
    assert!(reply.fragments.iter().all(|f| f.policy_version == 1));

    // Inserts older than the learner's minimum are refused as stale.
    let stale = insert(&client, &s, &fragment(0, 4, 4)).await;
    assert_eq!(stale.reason, "stale");
    assert!(insert(&client, &s, &fragment(1, 4, 4)).await.accepted);

    // Rejections are counted on /metrics by subject and reason.
    let (status, body) = relay_testkit::http_get(metrics_addr, "/metrics").unwrap();
    assert_eq!(status, 200);
    // The series whose labels include every one given.
    let value = |name: &str, labels: &[&str]| -> Option<f64> {
        body.lines()
            .filter(|l| l.starts_with(&format!("{name}{{")) && labels.iter().all(|x| l.contains(x)))
            .find_map(|l| l.rsplit(' ').next()?.parse().ok())
    };
    let (run, service) = ("run_id=\"replay-test\"", "service=\"replay-buffer\"");
    for reason in ["decode", "schema_version", "non_finite"] {
        let reason_label = format!("reason=\"{reason}\"");
        let labels = [
            reason_label.as_str(),
            "subject=\"replay.insert\"",
            run,
            service,
        ];
        assert_eq!(
            value("relay_messages_rejected_total", &labels),
            Some(1.0),
            "{reason} in\n{body}"
        );
    }
    let stale = value(
        "relay_replay_dropped_fragments_total",
        &["reason=\"stale\"", run],
    );
    assert_eq!(stale, Some(2.0), "{body}");

    trigger.trigger();
    tokio::time::timeout(Duration::from_secs(10), server)
        .await
        .unwrap()
        .unwrap()
        .unwrap();

    // A new copy of the service finds the stored fragment in Redis.
    let (trigger, shutdown) = Shutdown::new();
    let server = tokio::spawn(relay_replay_buffer::run(
        config(&nats, &redis, run_id),
        shutdown,
    ));
    let mut reply = None;
    for _ in 0..100 {
        let ask = SampleRequest {
            schema: SCHEMA_VERSION,
            min_policy_version: 1,
            max_steps: 32,
        };
        if let Ok(r) = relay_kit::request::<_, SampleReply>(
            &client,
            &s.replay_sample(),
            &ask,
            Duration::from_millis(500),
        )
        .await
        {
            reply = Some(r);
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(
        reply
            .expect("restarted replay-buffer answers")
            .fragments
            .len(),
        1
    );
    trigger.trigger();
    tokio::time::timeout(Duration::from_secs(10), server)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
}

/// Reverb-style sample-to-insert limiting: inserts wait for samples, samples
/// wait for the minimum size.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_rate_limiter_paces_inserts_and_samples() {
    let nats = NatsServer::start().unwrap();
    let redis = RedisServer::start().unwrap();
    let run_id = "rate-test";
    let mut service_config = config(&nats, &redis, run_id);
    service_config.experiment.replay.capacity_steps = 1024;
    service_config.experiment.replay.samples_per_insert =
        relay_config::SamplesPerInsert::Ratio(1.0);
    service_config.experiment.replay.min_size_to_sample = 32;
    service_config.experiment.replay.rate_error_buffer = 16;
    let (trigger, shutdown) = Shutdown::new();
    let server = tokio::spawn(relay_replay_buffer::run(service_config, shutdown));
    let client = async_nats::connect(nats.url()).await.unwrap();
    let s = Subjects::new(run_id);
    let sampled_steps = |client: async_nats::Client| async move {
        let reply = sample(&client, &Subjects::new(run_id), 0, 1000).await;
        reply.fragments.iter().map(|f| f.env_steps()).sum::<u64>()
    };

    // Wait for the service, then insert: max diff = 1 x 32 + 16 = 48 steps.
    assert!(first_insert(&client, &s, &fragment(0, 4, 4)).await.accepted);
    // 16 inserted: under min_size_to_sample, the learner gets nothing.
    assert_eq!(sampled_steps(client.clone()).await, 0);
    assert!(insert(&client, &s, &fragment(0, 4, 4)).await.accepted);
    assert!(insert(&client, &s, &fragment(0, 4, 4)).await.accepted);
    let held = insert(&client, &s, &fragment(0, 4, 4)).await;
    assert!(!held.accepted);
    assert_eq!(
        held.reason, "rate",
        "48 inserted, nothing sampled: inserts wait"
    );
    // 48 inserted, min diff = 32 - 16 = 16: the learner may take 32 steps.
    assert_eq!(sampled_steps(client.clone()).await, 32);
    assert_eq!(
        sampled_steps(client.clone()).await,
        0,
        "the allowance is spent"
    );
    // Sampling made room for inserts again.
    assert!(insert(&client, &s, &fragment(0, 4, 4)).await.accepted);
    trigger.trigger();
    tokio::time::timeout(Duration::from_secs(10), server)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
}

/// A sample reply is one NATS message: fragments that together would not fit
/// in one are handed out over several samples, none lost, in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn samples_of_large_fragments_fit_in_a_message_and_lose_nothing() {
    let nats = NatsServer::start().unwrap();
    let redis = RedisServer::start().unwrap();
    let run_id = "replay-large";
    let (trigger, shutdown) = Shutdown::new();
    let text = format!(
        "run:\n  id: {run_id}\n  env_id: CartPole-v1\nconnections:\n  nats_url: {}\n  redis_url: {}\n  request_timeout_ms: 5000\nreplay:\n  capacity_steps: 100000\n  max_policy_lag: 1\nppo:\n  rollout_steps: 50000\n",
        nats.url(),
        redis.url()
    );
    let config =
        ServiceConfig::for_test(ExperimentConfig::from_layers(&text, "test", &[], &[]).unwrap());
    let server = tokio::spawn(relay_replay_buffer::run(config, shutdown));
    let client = async_nats::connect(nats.url()).await.unwrap();
    let s = Subjects::new(run_id);
    // About 540 kB each: two do not fit in one 1 MiB message.
    let (t, n) = (500, 28);
    let big = |k: usize| {
        let mut f = fragment(0, t, n);
        f.rewards = Tensor::from_f32(&[t, n], &vec![k as f32; t * n]);
        f
    };
    // The test server carries nats-server's default max_payload.
    assert!(relay_proto::encode(&big(0)).len() > relay_proto::DEFAULT_MAX_PAYLOAD / 2);
    for k in 0..3 {
        let mut accepted = false;
        for _ in 0..100 {
            match relay_kit::request::<_, InsertAck>(
                &client,
                &s.replay_insert(),
                &big(k),
                Duration::from_millis(1000),
            )
            .await
            {
                Ok(ack) => {
                    accepted = ack.accepted;
                    break;
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
            }
        }
        assert!(accepted, "fragment {k} stored");
    }
    let mut seen = Vec::new();
    for _ in 0..3 {
        let reply = sample(&client, &s, 0, 1_000_000).await;
        assert_eq!(reply.fragments.len(), 1, "one fragment fits a reply");
        seen.extend(
            reply
                .fragments
                .iter()
                .map(|f| f.rewards.to_f32().unwrap()[0]),
        );
    }
    assert_eq!(seen, vec![0.0, 1.0, 2.0], "every fragment, in order");
    trigger.trigger();
    server.await.unwrap().unwrap();
}

/// A Redis killed between a sample's pops and its decrement (the
/// append-only file keeps the pops) leaves the held-steps counter above
/// what the FIFO holds: inserts are refused as full until the learner's
/// next sample finds the FIFO empty and zeroes the counter.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_count_left_by_a_killed_redis_heals_once_the_fifo_is_empty() {
    let nats = NatsServer::start().unwrap();
    let redis = RedisServer::start().unwrap();
    let run_id = "replay-heal";
    let (trigger, shutdown) = Shutdown::new();
    let server = tokio::spawn(relay_replay_buffer::run(
        config(&nats, &redis, run_id),
        shutdown,
    ));
    let client = async_nats::connect(nats.url()).await.unwrap();
    let s = Subjects::new(run_id);
    assert!(first_insert(&client, &s, &fragment(0, 4, 4)).await.accepted);
    assert_eq!(sample(&client, &s, 0, 48).await.fragments.len(), 1);
    // The counter says the FIFO is full; the list is empty.
    let mut conn = redis::Client::open(redis.url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let _: () = redis::cmd("SET")
        .arg(format!("relay:{run_id}:fifo:steps"))
        .arg(48)
        .query_async(&mut conn)
        .await
        .unwrap();
    let refused = insert(&client, &s, &fragment(0, 4, 4)).await;
    assert!(!refused.accepted);
    assert_eq!(refused.reason, "full");
    assert!(sample(&client, &s, 0, 48).await.fragments.is_empty());
    let healed = insert(&client, &s, &fragment(0, 4, 4)).await;
    assert!(healed.accepted, "{healed:?}");
    assert_eq!(healed.buffered_steps, 16);
    trigger.trigger();
    tokio::time::timeout(Duration::from_secs(10), server)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
}
