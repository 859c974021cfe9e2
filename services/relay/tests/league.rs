//! The self-play league end to end: the six services in-process on real
//! nats-server and redis-server, with the shipped TicTacToe league config
//! (tiny budgets) and `relay model init tiny`'s model. The learner admits
//! every version to the pool and stores it in the run's bucket, the
//! env-runner plays the current version against past ones (served by the
//! inference server from the bucket) and rates those games, and the
//! versions the pool evicts leave the bucket, except one under evaluation.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use futures::StreamExt;
use relay_config::ExperimentConfig;
use relay_kit::{ServiceConfig, Shutdown};
use relay_league::MemberId;
use relay_proto::{
    AdapterRef, AdapterUpdate, EvalStarted, GameRecord, RunStatusUpdate, SeatPolicy, Subjects,
    SCHEMA_VERSION,
};
use relay_testkit::{NatsServer, RedisServer, TempDir};

/// Learning moves per batch, and the budget in batches.
const BATCH: u64 = 8;
const BUDGET_BATCHES: u64 = 5;
/// Versions the pool keeps (the newest; none for being best), so the
/// budget's versions overflow it.
const KEEP: usize = 3;
/// A version under evaluation when the pool evicts it.
const EVALUATED: u64 = 1;

/// The run's league pool as the services left it in Redis.
async fn stored_pool(redis: &RedisServer, run_id: &str) -> relay_league::Pool {
    let (_keep, redis_shutdown) = Shutdown::new();
    relay_kit::league::LeagueStore::new(
        relay_kit::connect_redis(&redis.url(), &redis_shutdown)
            .await
            .unwrap(),
        run_id,
    )
    .load()
    .await
    .unwrap()
    .expect("the learner created the pool")
}

/// Rated games between any two of `versions`.
fn games_between_versions(pool: &relay_league::Pool, versions: &[u64]) -> u64 {
    let mut games = 0;
    for (i, a) in versions.iter().enumerate() {
        for b in &versions[i + 1..] {
            games += pool.games_between(&MemberId::Version(*a), &MemberId::Version(*b));
        }
    }
    games
}

/// The names of the objects in the run's league bucket.
async fn stored_objects(client: &async_nats::Client, run_id: &str) -> Vec<String> {
    let store = async_nats::jetstream::new(client.clone())
        .get_object_store(relay_kit::league::versions_bucket(run_id))
        .await
        .unwrap();
    let mut listed = store.list().await.unwrap();
    let mut names = Vec::new();
    while let Some(object) = listed.next().await {
        names.push(object.unwrap().name);
    }
    names
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_versions_are_played_rated_and_evicted_versions_leave_the_bucket() {
    let nats = NatsServer::start().unwrap();
    let redis = RedisServer::start().unwrap();
    let dir = TempDir::new("league");
    let runs = dir.path().join("runs");
    let model = dir.path().join("models/tiny");
    relay::model::init_tiny(&model, 0).unwrap();
    let run_id = "ttt-league";
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../configs/tictactoe-league.yaml"
    );
    let overrides: Vec<String> = vec![
        format!("run.id={run_id}"),
        format!("run.runs_dir={}", runs.display()),
        format!("connections.nats_url={}", nats.url()),
        format!("connections.redis_url={}", redis.url()),
        format!("llm.model={}", model.display()),
        format!("run.total_env_steps={}", BUDGET_BATCHES * BATCH),
        format!("rl.batch_size={BATCH}"),
        "rl.minibatch_size=4".into(),
        "text.games_in_flight=4".into(),
        // League games branch like the others when asked to (all of them:
        // the preset branches only its games against the random bot).
        "text.branches=4".into(),
        "league.branch_against=null".into(),
        "eval.every_versions=1000".into(),
        format!("league.pool.keep_latest={KEEP}"),
        "league.pool.keep_best=0".into(),
        // Every version joins, so the budget's versions overflow the pool.
        "league.pool.admit_every=1".into(),
        "league.sampler={kind: mixture, components: [{weight: 1, sampler: {kind: mirror}}, {weight: 3, sampler: {kind: lagged, k: 1}}]}".into(),
    ];
    let text = std::fs::read_to_string(path).unwrap();
    let experiment = ExperimentConfig::from_layers(&text, "test", &[], &overrides).unwrap();
    assert!(experiment.league_enabled());
    let subjects = Subjects::new(run_id);
    let client = async_nats::connect(nats.url()).await.unwrap();
    let mut games = client.subscribe(subjects.games()).await.unwrap();
    let mut statuses = client.subscribe(subjects.status()).await.unwrap();
    let mut adapters = client.subscribe(subjects.adapters()).await.unwrap();

    let (trigger, shutdown) = Shutdown::new();
    let config = || ServiceConfig::for_test(experiment.clone());
    let tasks = vec![
        tokio::spawn(relay_tracker::run(config(), shutdown.clone())),
        tokio::spawn(relay_replay_buffer::run(config(), shutdown.clone())),
        tokio::spawn(relay_inference_server::run(config(), shutdown.clone())),
        tokio::spawn(relay_env_runner::run(config(), shutdown.clone())),
        tokio::spawn(relay_learner::run(config(), shutdown.clone())),
    ];

    // Until the learner is done and a game between two versions the pool
    // still holds at the end (the newest KEEP) was seen.
    let mut against_past: BTreeSet<(u64, u64)> = BTreeSet::new();
    let mut learner_done: Option<u64> = None;
    // League games branch at their lost position (`text.branches`).
    let mut continuations = 0;
    let deadline = Instant::now() + Duration::from_secs(150);
    let kept_pair_played = |played: &BTreeSet<(u64, u64)>, last: Option<u64>| {
        last.is_some_and(|last| {
            played
                .iter()
                .any(|&(current, past)| past + KEEP as u64 > last && current > past)
        })
    };
    while !kept_pair_played(&against_past, learner_done) {
        assert!(
            Instant::now() < deadline,
            "timed out: games against past versions {against_past:?}, learner done at {learner_done:?}"
        );
        tokio::select! {
            Some(m) = games.next() => {
                let game: GameRecord = relay_proto::decode(&m.payload).unwrap();
                continuations += game.branch.is_some_and(|b| b.index > 0) as usize;
                let learner = game.learner_seat.unwrap() as usize;
                if let SeatPolicy::Model(Some(AdapterRef { version: Some(past), .. })) = &game.seats[1 - learner] {
                    let current = game.learning_version().expect("model moves name versions");
                    against_past.insert((current, *past));
                }
            }
            // An evaluation of version EVALUATED begins as it is published
            // and never reports: the pool evicts that version, but the
            // bucket keeps it for the evaluation's inference servers.
            Some(m) = adapters.next() => {
                let update: AdapterUpdate = relay_proto::decode(&m.payload).unwrap();
                if update.version == EVALUATED {
                    let start = EvalStarted {
                        schema: SCHEMA_VERSION,
                        evaluator: "vs-opponent".into(),
                        instance: "test".into(),
                        policy_version: EVALUATED,
                    };
                    client
                        .publish(subjects.eval_started(), relay_proto::encode(&start).into())
                        .await
                        .unwrap();
                }
            }
            Some(m) = statuses.next() => {
                let status: RunStatusUpdate = relay_proto::decode(&m.payload).unwrap();
                if status.service == "learner" {
                    learner_done = Some(status.policy_version);
                }
            }
            _ = tokio::time::sleep(Duration::from_millis(200)) => {}
        }
    }
    let last = learner_done.unwrap();
    assert!(continuations > 0, "no league game was branched");
    assert!(
        last as usize > KEEP,
        "{last} versions do not overflow the pool"
    );
    // The pool is written once a second: give the last results a moment.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    trigger.trigger();
    for task in tasks {
        tokio::time::timeout(Duration::from_secs(30), task)
            .await
            .expect("service stops")
            .unwrap()
            .unwrap();
    }

    let pool = stored_pool(&redis, run_id).await;
    // Every version joined; the first (pinned: `keep_first`) and the
    // newest KEEP stayed; the bots are fixed members.
    let versions: Vec<u64> = pool.versions().collect();
    assert_eq!(
        versions,
        std::iter::once(0)
            .chain((last + 1 - KEEP as u64)..=last)
            .collect::<Vec<_>>()
    );
    assert!(pool.get(&MemberId::Version(0)).unwrap().pinned);
    for bot in ["random", "minimax"] {
        assert!(pool.get(&MemberId::Fixed(bot.into())).is_some(), "{pool:?}");
    }
    // Games between versions were rated (those still in the pool keep
    // their records).
    assert!(
        games_between_versions(&pool, &versions) > 0,
        "no game between versions rated: {pool:?}; played {against_past:?}"
    );
    // Rated games made some version's rating surer than a newcomer's.
    let prior = pool.config().trueskill.sigma;
    assert!(
        versions
            .iter()
            .any(|v| pool.get(&MemberId::Version(*v)).unwrap().rating.sigma < prior),
        "{pool:?}"
    );

    // The bucket holds exactly the pool's versions and the one under
    // evaluation.
    assert!(!versions.contains(&EVALUATED), "{versions:?}");
    let mut stored = BTreeSet::new();
    for object in stored_objects(&client, run_id).await {
        let (name, version) = relay_kit::league::parse_version_object(&object)
            .unwrap_or_else(|| panic!("unexpected object {object}"));
        assert_eq!(name, "policy");
        stored.insert(version);
    }
    let expected: BTreeSet<u64> = versions.iter().copied().chain([EVALUATED]).collect();
    assert_eq!(stored, expected);
}

/// The league in a game on observations: the shipped PettingZoo TicTacToe
/// league preset (PPO, tiny budget) with the five training services
/// in-process on real nats-server and redis-server, the env-runner
/// stepping PettingZoo in the project's Python. The learner stores and
/// admits every version, the inference server serves the past versions
/// the env-runner asks for, their games and the bots' are rated, the
/// bucket keeps only the pool's versions, and the episodes name the
/// learning seat and its opponent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn classic_policies_play_and_rate_their_past_versions_and_the_bots() {
    let nats = NatsServer::start().unwrap();
    let redis = RedisServer::start().unwrap();
    let dir = TempDir::new("classic-league");
    let runs = dir.path().join("runs");
    let run_id = "ttt-classic-league";
    /// Learning moves per update, and the budget in updates.
    const ROLLOUT: u64 = 64;
    const UPDATES: u64 = 10;
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../configs/tictactoe-ppo-league.yaml"
    );
    let overrides: Vec<String> = vec![
        format!("run.id={run_id}"),
        format!("run.runs_dir={}", runs.display()),
        format!("connections.nats_url={}", nats.url()),
        format!("connections.redis_url={}", redis.url()),
        format!("run.total_env_steps={}", UPDATES * ROLLOUT),
        format!("ppo.rollout_steps={ROLLOUT}"),
        "ppo.minibatch_size=32".into(),
        "policy.hidden=[32, 32]".into(),
        "env_runner.num_envs=4".into(),
        "eval.every_versions=1000".into(),
        format!("league.pool.keep_latest={KEEP}"),
        "league.pool.keep_best=0".into(),
        "league.pool.admit_every=1".into(),
        "league.sampler={kind: mixture, components: [{weight: 1, sampler: {kind: mirror}}, {weight: 3, sampler: {kind: lagged, k: 1}}, {weight: 1, sampler: {kind: fixed, opponents: [{opponent: minimax, weight: 1}]}}]}".into(),
    ];
    let text = std::fs::read_to_string(path).unwrap();
    let experiment = ExperimentConfig::from_layers(&text, "test", &[], &overrides).unwrap();
    assert!(experiment.league_enabled());

    let client = async_nats::connect(nats.url()).await.unwrap();
    let mut statuses = client
        .subscribe(Subjects::new(run_id).status())
        .await
        .unwrap();
    let (trigger, shutdown) = Shutdown::new();
    let config = || ServiceConfig::for_test(experiment.clone());
    let tasks = vec![
        tokio::spawn(relay_tracker::run(config(), shutdown.clone())),
        tokio::spawn(relay_replay_buffer::run(config(), shutdown.clone())),
        tokio::spawn(relay_inference_server::run(config(), shutdown.clone())),
        tokio::spawn(relay_env_runner::run(config(), shutdown.clone())),
        tokio::spawn(relay_learner::run(config(), shutdown.clone())),
    ];
    // Until the learner says its budget is spent.
    tokio::time::timeout(Duration::from_secs(300), async {
        while let Some(m) = statuses.next().await {
            let status: RunStatusUpdate = relay_proto::decode(&m.payload).unwrap();
            if status.service == "learner" {
                return;
            }
        }
    })
    .await
    .expect("the learner spends its budget");
    // The env-runner writes its results to the pool once a second.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    trigger.trigger();
    for task in tasks {
        tokio::time::timeout(Duration::from_secs(30), task)
            .await
            .expect("service stops")
            .unwrap()
            .unwrap();
    }

    let pool = stored_pool(&redis, run_id).await;
    let versions: Vec<u64> = pool.versions().collect();
    assert!(versions.len() > 2, "{pool:?}");
    let last = *versions.last().unwrap();
    assert!(last + 1 >= UPDATES, "{pool:?}");
    // The first (pinned) and the newest KEEP stayed.
    assert_eq!(
        versions,
        std::iter::once(0)
            .chain((last + 1 - KEEP as u64)..=last)
            .collect::<Vec<_>>()
    );
    let prior = pool.config().trueskill.sigma;
    for bot in ["random", "minimax"] {
        assert!(
            pool.get(&MemberId::Fixed(bot.into())).is_some(),
            "{bot}: {pool:?}"
        );
    }
    let minimax = MemberId::Fixed("minimax".into());
    assert!(
        versions
            .iter()
            .any(|v| pool.games_between(&MemberId::Version(*v), &minimax) > 0),
        "no rated game against minimax: {pool:?}"
    );
    assert!(
        games_between_versions(&pool, &versions) > 0,
        "no game between versions rated: {pool:?}"
    );
    assert!(
        pool.members().any(|m| m.rating.sigma < prior),
        "no rating moved: {pool:?}"
    );

    // The bucket holds a whole stored version for each version in the pool
    // and nothing else.
    let stored: BTreeSet<String> = stored_objects(&client, run_id).await.into_iter().collect();
    let expected: BTreeSet<String> = versions
        .iter()
        .flat_map(|&v| {
            [
                relay_kit::league::weights_object("policy", v),
                relay_kit::league::update_object("policy", v),
            ]
        })
        .collect();
    assert_eq!(stored, expected);

    // Episodes name the learning seat (both are drawn) and the opponent:
    // the random bot, and league games against the current policy, a past
    // version and minimax.
    let episodes = std::fs::read_to_string(runs.join(run_id).join("episodes.jsonl")).unwrap();
    let mut seats = BTreeSet::new();
    let mut opponents = BTreeSet::new();
    for line in episodes.lines() {
        let report: serde_json::Value = serde_json::from_str(line).unwrap();
        for episode in report["episodes"].as_array().unwrap() {
            seats.insert(episode["seat"].as_u64().expect("a seat"));
            let opponent = episode["opponent"].as_str().expect("an opponent");
            let kind = if opponent.starts_with("league:v") {
                "league:past"
            } else {
                opponent
            };
            opponents.insert(kind.to_string());
        }
    }
    assert_eq!(seats, BTreeSet::from([0, 1]));
    for kind in ["random", "league:mirror", "league:past", "league:minimax"] {
        assert!(opponents.contains(kind), "no {kind} game: {opponents:?}");
    }
}
