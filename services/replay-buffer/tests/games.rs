//! Text runs: the replay-buffer stores games from `relay.<run>.games` in a
//! real redis-server and hands them to the learner whole, oldest first,
//! over a real nats-server.

use std::time::{Duration, Instant};

use relay_config::ExperimentConfig;
use relay_kit::{ServiceConfig, Shutdown};
use relay_proto::{
    AdapterRef, GameRecord, GameSampleReply, GameSampleRequest, SeatPolicy, Subjects, Tensor,
    TextTurn, SCHEMA_VERSION,
};
use relay_testkit::{NatsServer, RedisServer};

fn config(nats: &NatsServer, redis: &RedisServer, run_id: &str) -> ServiceConfig {
    config_with(nats, redis, run_id, &[])
}

fn config_with(
    nats: &NatsServer,
    redis: &RedisServer,
    run_id: &str,
    overrides: &[&str],
) -> ServiceConfig {
    let text = format!(
        "run:\n  id: {run_id}\n  env_id: TicTacToe-v0\nconnections:\n  nats_url: {}\n  redis_url: {}\n  request_timeout_ms: 2000\nreplay:\n  capacity_steps: 10\n  max_policy_lag: 1\nppo:\n  rollout_steps: 4\nrl:\n  batch_size: 4\n  minibatch_size: 4\n",
        nats.url(),
        redis.url()
    );
    let overrides: Vec<String> = overrides.iter().map(|o| o.to_string()).collect();
    ServiceConfig::for_test(ExperimentConfig::from_layers(&text, "test", &[], &overrides).unwrap())
}

fn model_turn(player: u8, version: u64) -> TextTurn {
    TextTurn {
        player,
        prompt_tokens: Tensor::from_u32(&[3], &[1, 2, 3]),
        completion_tokens: Tensor::from_u32(&[2], &[4, 5]),
        logprobs: Tensor::from_f32(&[2], &[-0.5, -0.1]),
        action: "[4]".into(),
        invalid: false,
        adapter: Some(AdapterRef {
            name: "policy".into(),
            version: Some(version),
        }),
        observation: "[GAME] board".into(),
        completion: String::new(),
        no_answer: false,
        truncated: false,
    }
}

fn bot_turn(player: u8) -> TextTurn {
    TextTurn {
        player,
        prompt_tokens: Tensor::from_u32(&[0], &[]),
        completion_tokens: Tensor::from_u32(&[0], &[]),
        logprobs: Tensor::from_f32(&[0], &[]),
        action: "[0]".into(),
        invalid: false,
        adapter: None,
        observation: "[GAME] board".into(),
        completion: String::new(),
        no_answer: false,
        truncated: false,
    }
}

/// A game whose learning seat (0) made `moves` moves at `version`, with
/// the random bot between them; `seed` tells games apart.
fn game(seed: u64, version: u64, moves: usize) -> GameRecord {
    let mut turns = Vec::new();
    for _ in 0..moves {
        turns.push(model_turn(0, version));
        turns.push(bot_turn(1));
    }
    GameRecord {
        schema: SCHEMA_VERSION,
        runner_id: "test".into(),
        env_id: "TicTacToe-v0".into(),
        seed,
        seats: vec![
            SeatPolicy::Model(Some(AdapterRef {
                name: "policy".into(),
                version: None,
            })),
            SeatPolicy::Bot("random".into()),
        ],
        learner_seat: Some(0),
        turns,
        rewards: vec![1.0, -1.0],
        reasons: vec![String::new(), String::new()],
        duration_ms: 1,
        finished_unix_ms: 0,
        branch: None,
    }
}

async fn sample(
    client: &async_nats::Client,
    s: &Subjects,
    min_policy_version: u64,
    max_turns: u32,
) -> GameSampleReply {
    let ask = GameSampleRequest {
        schema: SCHEMA_VERSION,
        min_policy_version,
        max_turns,
    };
    relay_kit::request(
        client,
        &s.replay_games_sample(),
        &ask,
        Duration::from_secs(2),
    )
    .await
    .unwrap()
}

/// A metric's value: `spec` is its name, then optionally `{label="value"}`
/// (one label; the service adds its own constant labels).
async fn metric(addr: std::net::SocketAddr, spec: &str) -> f64 {
    let (name, label) = match spec.split_once('{') {
        Some((name, label)) => (name, label.trim_end_matches('}')),
        None => (spec, ""),
    };
    let (_, body) = relay_testkit::http_get(addr, "/metrics").unwrap();
    body.lines()
        .find(|l| l.starts_with(&format!("{name}{{")) && l.contains(label))
        .and_then(|l| l.rsplit(' ').next())
        .map_or(0.0, |v| v.parse().unwrap())
}

/// Waits until the buffer has stored `n` games since it started.
async fn wait_stored(addr: std::net::SocketAddr, n: f64) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while metric(addr, "relay_replay_games_inserted_total").await < n {
        assert!(Instant::now() < deadline, "games never stored");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Polls `sample` until it returns games (the published ones reach the
/// buffer asynchronously).
async fn sample_until_some(
    client: &async_nats::Client,
    s: &Subjects,
    min_version: u64,
    max_turns: u32,
) -> GameSampleReply {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let reply = sample(client, s, min_version, max_turns).await;
        if !reply.games.is_empty() || Instant::now() > deadline {
            return reply;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn games_are_stored_bounded_and_sampled_whole_and_fresh() {
    let nats = NatsServer::start().unwrap();
    let redis = RedisServer::start().unwrap();
    let run_id = "games-test";
    let (trigger, shutdown) = Shutdown::new();
    let mut service_config = config(&nats, &redis, run_id);
    let metrics_addr: std::net::SocketAddr = ([127, 0, 0, 1], relay_testkit::free_port()).into();
    service_config.metrics_addr = metrics_addr;
    let server = tokio::spawn(relay_replay_buffer::run(service_config, shutdown));
    let client = async_nats::connect(nats.url()).await.unwrap();
    let s = Subjects::new(run_id);
    // Ready once the sample endpoint answers (empty).
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let ask = GameSampleRequest {
            schema: SCHEMA_VERSION,
            min_policy_version: 0,
            max_turns: 1,
        };
        let answer: Result<GameSampleReply, _> = relay_kit::request(
            &client,
            &s.replay_games_sample(),
            &ask,
            Duration::from_millis(500),
        )
        .await;
        if answer.is_ok() {
            break;
        }
        assert!(Instant::now() < deadline, "replay-buffer never answered");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let publish = |g: &GameRecord| {
        let (client, subject, bytes) = (client.clone(), s.games(), relay_proto::encode(g));
        async move { client.publish(subject, bytes.into()).await.unwrap() }
    };

    // Three games of 3 learning turns: 9 of the capacity of 10.
    for seed in 1..=3 {
        publish(&game(seed, 0, 3)).await;
    }
    client.flush().await.unwrap();
    wait_stored(metrics_addr, 3.0).await;
    // Whole games, oldest first, until 4 turns are gathered: two games (6 turns).
    let reply = sample(&client, &s, 0, 4).await;
    let seeds: Vec<u64> = reply.games.iter().map(|g| g.seed).collect();
    assert_eq!(seeds, vec![1, 2], "{seeds:?}");
    assert_eq!(reply.games[0], game(1, 0, 3), "the game comes back intact");
    let reply = sample(&client, &s, 0, 100).await;
    assert_eq!(reply.games.iter().map(|g| g.seed).collect::<Vec<_>>(), [3]);
    assert!(sample(&client, &s, 0, 100).await.games.is_empty());

    // Over the capacity: the oldest games make room.
    for seed in 10..14 {
        publish(&game(seed, 0, 3)).await;
    }
    client.flush().await.unwrap();
    wait_stored(metrics_addr, 7.0).await;
    assert_eq!(
        metric(
            metrics_addr,
            "relay_replay_games_dropped_total{reason=\"evicted\"}"
        )
        .await,
        1.0
    );
    let reply = sample(&client, &s, 0, 100).await;
    assert_eq!(
        reply.games.iter().map(|g| g.seed).collect::<Vec<_>>(),
        [11, 12, 13]
    );

    // Staleness: once the learner asks for version 2, older games are
    // dropped at sample time and at insert.
    publish(&game(20, 1, 2)).await;
    publish(&game(21, 2, 2)).await;
    client.flush().await.unwrap();
    wait_stored(metrics_addr, 9.0).await;
    let reply = sample(&client, &s, 2, 100).await;
    assert_eq!(reply.games.iter().map(|g| g.seed).collect::<Vec<_>>(), [21]);
    assert_eq!(reply.dropped_stale, 1);
    publish(&game(22, 1, 2)).await;
    // A game whose moves span versions is as old as its oldest move.
    let mut mixed = game(23, 3, 2);
    mixed.turns[0] = model_turn(0, 1);
    publish(&mixed).await;
    publish(&game(24, 3, 2)).await;
    client.flush().await.unwrap();
    let reply = sample_until_some(&client, &s, 2, 100).await;
    assert_eq!(reply.games.iter().map(|g| g.seed).collect::<Vec<_>>(), [24]);

    // Bad input: undecodable payloads, invalid games and games without
    // learning turns are refused and counted; nothing stored is lost.
    publish(&game(30, 3, 1)).await;
    client
        .publish(s.games(), b"not a game".to_vec().into())
        .await
        .unwrap();
    let mut invalid = game(31, 3, 1);
    invalid.rewards.pop();
    publish(&invalid).await;
    let mut other_env = game(32, 3, 1);
    other_env.env_id = "ConnectFour-v0".into();
    publish(&other_env).await;
    let mut bots_only = game(33, 3, 0);
    bots_only.turns.push(bot_turn(1));
    publish(&bots_only).await;
    publish(&game(34, 3, 1)).await;
    client.flush().await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while metric(
        metrics_addr,
        "relay_replay_games_dropped_total{reason=\"no_learning_turns\"}",
    )
    .await
        < 1.0
    {
        assert!(
            Instant::now() < deadline,
            "the bot-only game was never seen"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let reply = sample_until_some(&client, &s, 3, 100).await;
    assert_eq!(
        reply.games.iter().map(|g| g.seed).collect::<Vec<_>>(),
        [30, 34]
    );
    let (_, body) = relay_testkit::http_get(metrics_addr, "/metrics").unwrap();
    let rejected = |reason: &str| {
        body.lines()
            .filter(|l| l.starts_with("relay_messages_rejected_total"))
            .filter(|l| {
                l.contains("subject=\"games\"") && l.contains(&format!("reason=\"{reason}\""))
            })
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum::<f64>()
    };
    assert_eq!(rejected("decode"), 1.0, "{body}");
    assert_eq!(rejected("invalid"), 2.0, "{body}");

    trigger.trigger();
    tokio::time::timeout(Duration::from_secs(10), server)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
}

/// `replay.max_age_s`: a game that ended longer ago than that is dropped at
/// sample whatever its version, and counted; one of unknown age (an older
/// env-runner) is kept.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn games_older_than_max_age_are_dropped_and_counted() {
    let nats = NatsServer::start().unwrap();
    let redis = RedisServer::start().unwrap();
    let run_id = "games-age";
    let (trigger, shutdown) = Shutdown::new();
    let mut service_config = config_with(&nats, &redis, run_id, &["replay.max_age_s=30"]);
    let metrics_addr: std::net::SocketAddr = ([127, 0, 0, 1], relay_testkit::free_port()).into();
    service_config.metrics_addr = metrics_addr;
    let server = tokio::spawn(relay_replay_buffer::run(service_config, shutdown));
    let client = async_nats::connect(nats.url()).await.unwrap();
    let s = Subjects::new(run_id);
    let aged = |seed: u64, finished_unix_ms: u64| GameRecord {
        finished_unix_ms,
        ..game(seed, 0, 1)
    };
    let now = relay_proto::unix_ms();
    // Published until the buffer listens (it drops nothing it has not heard).
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        for g in [aged(1, now - 60_000), aged(2, now), aged(3, 0)] {
            client
                .publish(s.games(), relay_proto::encode(&g).into())
                .await
                .unwrap();
        }
        client.flush().await.unwrap();
        tokio::time::sleep(Duration::from_millis(200)).await;
        if metric(metrics_addr, "relay_replay_games_inserted_total").await >= 3.0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "replay-buffer never stored the games"
        );
    }
    let reply = sample_until_some(&client, &s, 0, 100).await;
    let mut kept: Vec<u64> = reply.games.iter().map(|g| g.seed).collect();
    kept.sort();
    kept.dedup();
    assert_eq!(kept, [2, 3], "{kept:?}");
    assert!(reply.dropped_stale >= 1);
    assert!(
        metric(
            metrics_addr,
            r#"relay_replay_games_dropped_total{reason="too_old"}"#
        )
        .await
            >= 1.0
    );
    trigger.trigger();
    server.await.unwrap().unwrap();
}
