//! League games of the env-runner against real nats-server and
//! redis-server: the opponents come from the run's league pool in Redis
//! (past versions pinned as `policy@v<N>`, and a fixed bot), the seating is
//! shuffled, every finished game against a past version or a bot is rated
//! in the pool, and a past version that no inference server serves (404)
//! turns its games into mirror games, counted on `/metrics`.
//!
//! A stand-in answers `generate` as the inference servers would: the
//! newest version is 3, versions 0 and 2 are served when asked for, and
//! version 1 is unknown (404).

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use relay_config::ExperimentConfig;
use relay_kit::league::LeagueStore;
use relay_kit::{ServiceConfig, Shutdown};
use relay_league::{FixedKind, FixedOpponent, MemberId, PolicyVersion, PoolConfig};
use relay_proto::{
    decode, encode, AdapterRef, FinishReason, GameRecord, GenerateReply, GenerateRequest, Prompt,
    SeatPolicy, Subjects, Tensor, SCHEMA_VERSION,
};
use relay_testkit::{free_port, http_get, NatsServer, RedisServer};

const RUN: &str = "league-games";
const NEWEST: u64 = 3;
const NOT_SERVED: u64 = 1;

fn policy(version: Option<u64>) -> Option<AdapterRef> {
    Some(AdapterRef {
        name: "policy".into(),
        version,
    })
}

/// Answers every request with the first legal move; records the adapter
/// versions asked for.
fn spawn_stand_in(client: async_nats::Client, asked: Arc<Mutex<Vec<Option<u64>>>>) {
    tokio::spawn(async move {
        let subject = Subjects::new(RUN).generate();
        let mut requests = client.queue_subscribe(subject, "q".into()).await.unwrap();
        while let Some(message) = requests.next().await {
            let Some(reply_to) = message.reply.clone() else {
                continue;
            };
            let request: GenerateRequest = decode(&message.payload).unwrap();
            let wanted = request.adapter.as_ref().and_then(|a| a.version);
            asked.lock().unwrap().push(wanted);
            if wanted == Some(NOT_SERVED) {
                let mut headers = async_nats::HeaderMap::new();
                headers.insert(
                    async_nats::service::NATS_SERVICE_ERROR,
                    "adapter \"policy\" has no version 1",
                );
                headers.insert(async_nats::service::NATS_SERVICE_ERROR_CODE, "404");
                client
                    .publish_with_headers(reply_to, headers, Vec::<u8>::new().into())
                    .await
                    .unwrap();
                continue;
            }
            let Prompt::Chat(turns) = &request.prompt else {
                panic!("chat prompts")
            };
            let text = turns
                .last()
                .unwrap()
                .content
                .lines()
                .rev()
                .find_map(|l| l.strip_prefix("Available Moves: "))
                .and_then(|moves| moves.split(", ").next())
                .unwrap()
                .trim_matches('\'')
                .to_string();
            let c = text.len();
            let reply = GenerateReply {
                schema: SCHEMA_VERSION,
                adapter: policy(Some(wanted.unwrap_or(NEWEST))),
                prompt_tokens: Tensor::from_u32(&[1], &[1]),
                completion_tokens: Tensor::from_u32(&[c], &vec![2; c]),
                logprobs: Tensor::from_f32(&[c], &vec![-0.5; c]),
                text,
                finish: FinishReason::Stop,
                answer_start: None,
            };
            client
                .publish(reply_to, encode(&reply).into())
                .await
                .unwrap();
        }
    });
}

/// Sum of every sample of `name` whose labels contain `labels`.
fn metric(body: &str, name: &str, labels: &str) -> f64 {
    body.lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| l.split([' ', '{']).next() == Some(name) && l.contains(labels))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn league_games_seat_past_versions_and_rate_them() {
    let nats = NatsServer::start().unwrap();
    let redis = RedisServer::start().unwrap();
    let client = async_nats::connect(nats.url()).await.unwrap();
    let mut games = client.subscribe(Subjects::new(RUN).games()).await.unwrap();
    let asked = Arc::new(Mutex::new(Vec::new()));
    spawn_stand_in(client.clone(), asked.clone());

    // The pool as the learner leaves it after publishing v0..v3.
    let (trigger, shutdown) = Shutdown::new();
    let store = LeagueStore::new(
        relay_kit::connect_redis(&redis.url(), &shutdown)
            .await
            .unwrap(),
        RUN,
    );
    let random = FixedOpponent {
        name: "random".into(),
        kind: FixedKind::Random,
    };
    store
        .update(PoolConfig::default(), &[random], |pool| {
            for version in 0..=NEWEST {
                pool.add_version(PolicyVersion {
                    version,
                    parent: version.checked_sub(1),
                    weights_ref: format!("policy/v{version}"),
                })?;
            }
            Ok(())
        })
        .await
        .unwrap();

    let yaml = format!(
        "run:\n  id: {RUN}\n  env_id: TicTacToe-v0\n  seed: 5\nconnections:\n  nats_url: {}\n  redis_url: {}\ntext:\n  opponents: {{league: 1}}\n  games_in_flight: 3\n  generate_timeout_ms: 5000\nleague:\n  fixed: [random]\n  sampler: {{kind: uniform, include_fixed: true}}\n",
        nats.url(),
        redis.url()
    );
    let experiment = ExperimentConfig::from_layers(&yaml, "test", &[], &[]).unwrap();
    let metrics_addr: SocketAddr = ([127, 0, 0, 1], free_port()).into();
    let mut config = ServiceConfig::for_test(experiment);
    config.metrics_addr = metrics_addr;
    let runner = tokio::spawn(relay_env_runner::run(config, shutdown.clone()));

    let mut records: Vec<GameRecord> = Vec::new();
    while records.len() < 60 {
        let message = tokio::time::timeout(Duration::from_secs(60), games.next())
            .await
            .unwrap_or_else(|_| panic!("only {} games in 60 s", records.len()))
            .unwrap();
        records.push(decode(&message.payload).unwrap());
    }

    let mut opponents = BTreeSet::new();
    let mut learner_seats = BTreeSet::new();
    let mut mirror_games = 0;
    for record in &records {
        let learner = record.learner_seat.unwrap() as usize;
        learner_seats.insert(learner);
        assert_eq!(record.seats[learner], SeatPolicy::Model(policy(None)));
        match &record.seats[1 - learner] {
            SeatPolicy::Model(Some(AdapterRef {
                version: Some(version),
                ..
            })) => {
                // A past version plays every move of its seat.
                assert_ne!(*version, NOT_SERVED, "{record:?}");
                for turn in record.turns.iter().filter(|t| t.player as usize != learner) {
                    assert_eq!(turn.adapter, policy(Some(*version)));
                }
                opponents.insert(format!("v{version}"));
            }
            SeatPolicy::Model(Some(AdapterRef { version: None, .. })) => {
                mirror_games += 1;
                opponents.insert("self".into());
            }
            SeatPolicy::Bot(name) => {
                opponents.insert(name.clone());
            }
            other => panic!("unexpected opponent {other:?}"),
        }
    }
    assert_eq!(learner_seats.len(), 2, "the seating never varied");
    for expected in ["v0", "v2", "random", "self"] {
        assert!(
            opponents.contains(expected),
            "{expected} never played: {opponents:?}"
        );
    }
    // v1 was asked for, refused, and its games went on as mirror games.
    assert!(asked.lock().unwrap().contains(&Some(NOT_SERVED)));
    assert!(mirror_games > 0);

    // The games are rated in the pool (written once a second).
    let deadline = Instant::now() + Duration::from_secs(20);
    let newest = MemberId::Version(NEWEST);
    let pool = loop {
        let pool = store.load().await.unwrap().unwrap();
        let rated = [0, 2]
            .iter()
            .all(|v| pool.games_between(&newest, &MemberId::Version(*v)) > 0)
            && pool.games_between(&newest, &MemberId::Fixed("random".into())) > 0;
        if rated || Instant::now() > deadline {
            break pool;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    for past in [0, 2] {
        let games = pool.games_between(&newest, &MemberId::Version(past));
        assert!(games > 0, "v{NEWEST} vs v{past} not rated: {pool:?}");
    }
    assert!(pool.games_between(&newest, &MemberId::Fixed("random".into())) > 0);
    // Never played, never rated: neither the refused v1 nor the mirror games.
    assert_eq!(
        pool.games_between(&newest, &MemberId::Version(NOT_SERVED)),
        0
    );
    assert_eq!(pool.games_between(&newest, &newest), 0);
    let rated = pool.get(&newest).unwrap().rating;
    assert_ne!(rated, PoolConfig::default().trueskill.new_rating());

    let (status, body) = http_get(metrics_addr, "/metrics").unwrap();
    assert_eq!(status, 200);
    let opponent_games = |opponent: &str| {
        metric(
            &body,
            "relay_league_opponent_games_total",
            &format!("opponent=\"{opponent}\""),
        )
    };
    assert!(opponent_games("past") > 0.0, "{body}");
    assert!(opponent_games("random") > 0.0, "{body}");
    assert!(opponent_games("self") > 0.0, "{body}");
    assert!(
        metric(
            &body,
            "relay_league_mirror_fallbacks_total",
            "reason=\"not_served\""
        ) > 0.0,
        "{body}"
    );
    assert!(
        metric(&body, "relay_league_opponent_lag_versions_count", "") > 0.0,
        "{body}"
    );
    assert!(metric(&body, "relay_env_runner_games_total", "opponent=\"league\"") >= 60.0);

    trigger.trigger();
    tokio::time::timeout(Duration::from_secs(15), runner)
        .await
        .expect("runner stops")
        .unwrap()
        .unwrap();
}
