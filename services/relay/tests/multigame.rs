//! End to end for multi-game text runs: the six services in-process on real
//! nats-server and redis-server, with the shipped `configs/multigame-grpo.yaml`
//! (TicTacToe-v0 and KuhnPoker-v0) and `relay model init tiny`'s model,
//! for a tiny budget. Both games are played (records say their game),
//! trained on (the learner's per-game examples), evaluated (the
//! `vs-opponent` report's matchups per game) and reported with their
//! `game` label (the tracker's `metrics.jsonl`, the episode reports).

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use futures::StreamExt;
use relay_config::ExperimentConfig;
use relay_kit::{ServiceConfig, Shutdown};
use relay_proto::{EpisodeReport, EvalReport, GameRecord, RunStatus, RunStatusUpdate, Subjects};
use relay_testkit::{NatsServer, RedisServer, TempDir};

const GAMES: [&str; 2] = ["KuhnPoker-v0", "TicTacToe-v0"];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn both_games_are_played_trained_on_evaluated_and_reported_by_game() {
    let nats = NatsServer::start().unwrap();
    let redis = RedisServer::start().unwrap();
    let dir = TempDir::new("multigame");
    let runs = dir.path().join("runs");
    let run_id = "multigame";
    let model_dir = dir.path().join("models/tiny");
    relay::model::init_tiny(&model_dir, 0).unwrap();
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../configs/multigame-grpo.yaml"
    );
    let yaml = std::fs::read_to_string(path).unwrap();
    let overrides: Vec<String> = vec![
        format!("run.id={run_id}"),
        format!("run.runs_dir={}", runs.display()),
        format!("connections.nats_url={}", nats.url()),
        format!("connections.redis_url={}", redis.url()),
        format!("llm.model={}", model_dir.display()),
        // The preset's weights (2 TicTacToe : 1 Kuhn poker).
        "run.total_env_steps=64".into(),
        "rl.batch_size=8".into(),
        "rl.minibatch_size=4".into(),
        "rl.checkpoint_every=100".into(),
        "text.games_in_flight=4".into(),
        "eval.every_versions=1000".into(),
        "eval.options={games: 2, opponents: random}".into(),
    ];
    let experiment = ExperimentConfig::from_layers(&yaml, "test", &[], &overrides).unwrap();
    assert!(experiment.text.multi_game());
    let subjects = Subjects::new(run_id);
    let client = async_nats::connect(nats.url()).await.unwrap();
    let mut games = client.subscribe(subjects.games()).await.unwrap();
    let mut episodes = client.subscribe(subjects.episodes()).await.unwrap();
    let mut evals = client.subscribe(subjects.eval()).await.unwrap();
    let mut statuses = client.subscribe(subjects.status()).await.unwrap();

    let (trigger, shutdown) = Shutdown::new();
    let config = || ServiceConfig::for_test(experiment.clone());
    let tasks = vec![
        tokio::spawn(relay_tracker::run(config(), shutdown.clone())),
        tokio::spawn(relay_replay_buffer::run(config(), shutdown.clone())),
        tokio::spawn(relay_inference_server::run(config(), shutdown.clone())),
        tokio::spawn(relay_evaluator::run(config(), shutdown.clone())),
        tokio::spawn(relay_env_runner::run(config(), shutdown.clone())),
        tokio::spawn(relay_learner::run(config(), shutdown.clone())),
    ];

    let mut played: BTreeSet<String> = BTreeSet::new();
    let mut episode_games: BTreeSet<String> = BTreeSet::new();
    let mut evaluated: Option<EvalReport> = None;
    let mut learner_done = false;
    let deadline = Instant::now() + Duration::from_secs(120);
    while !(learner_done && evaluated.is_some() && played.len() == 2 && episode_games.len() == 2) {
        assert!(
            Instant::now() < deadline,
            "timed out: games of {played:?}, episodes of {episode_games:?}, evaluated: {}, learner done: {learner_done}",
            evaluated.is_some()
        );
        tokio::select! {
            Some(m) = games.next() => {
                let game: GameRecord = relay_proto::decode(&m.payload).unwrap();
                assert!(GAMES.contains(&game.env_id.as_str()), "{}", game.env_id);
                played.insert(game.env_id);
            }
            Some(m) = episodes.next() => {
                let report: EpisodeReport = relay_proto::decode(&m.payload).unwrap();
                episode_games.insert(report.env_id);
            }
            Some(m) = evals.next() => {
                let report: EvalReport = relay_proto::decode(&m.payload).unwrap();
                evaluated.get_or_insert(report);
            }
            Some(m) = statuses.next() => {
                let status: RunStatusUpdate = relay_proto::decode(&m.payload).unwrap();
                if status.service == "learner" {
                    assert_eq!(status.status, RunStatus::Stopped, "{}", status.detail);
                    learner_done = true;
                }
            }
            _ = tokio::time::sleep(Duration::from_millis(200)) => {}
        }
    }
    assert_eq!(played, GAMES.iter().map(|g| g.to_string()).collect());
    assert_eq!(episode_games, played);

    // The evaluation played each game against random, from both seats.
    let report = evaluated.unwrap();
    let mut matchups: Vec<(String, String, u8)> = report
        .matchups
        .iter()
        .map(|m| (m.game.clone(), m.opponent.clone(), m.seat))
        .collect();
    matchups.sort();
    let want: Vec<(String, String, u8)> = GAMES
        .iter()
        .flat_map(|g| [0, 1].map(|seat| (g.to_string(), "random".to_string(), seat)))
        .collect();
    assert_eq!(matchups, want, "{:?}", report.matchups);
    assert!(report.matchups.iter().all(|m| m.games + m.abandoned == 1));

    trigger.trigger();
    for task in tasks {
        tokio::time::timeout(Duration::from_secs(30), task)
            .await
            .expect("service stops")
            .unwrap()
            .unwrap();
    }

    // The tracker's metrics.jsonl holds the per-game values under their
    // labelled keys: games finished by the env-runner, examples the
    // learner trained on, for both games.
    let metrics = std::fs::read_to_string(runs.join(run_id).join("metrics.jsonl")).unwrap();
    let total = |key: &str| -> f64 {
        metrics
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter_map(|v| v["values"][key].as_f64())
            .sum()
    };
    for game in GAMES {
        let finished = total(&format!("text_games_total{{game={game}}}"));
        assert!(finished >= 1.0, "{game}: {finished} games reported");
        let trained = total(&format!("learner_game_examples_total{{game={game}}}"));
        assert!(
            trained >= 1.0,
            "{game}: {trained} examples trained on ({} stale games dropped); keys: {:?}",
            total("learner_dropped_stale_games_total"),
            metrics
                .lines()
                .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
                .filter(|v| v["service"] == "learner")
                .flat_map(|v| v["values"]
                    .as_object()
                    .unwrap()
                    .keys()
                    .cloned()
                    .collect::<Vec<_>>())
                .filter(|k| k.contains("game"))
                .collect::<BTreeSet<_>>()
        );
        let rates: Vec<f64> = metrics
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter_map(|v| {
                v["values"][format!("env_runner_game_legal_move_rate{{game={game}}}")].as_f64()
            })
            .collect();
        // Constrained decoding: every move is legal.
        assert!(
            !rates.is_empty() && rates.iter().all(|&r| r == 1.0),
            "{game}: {rates:?}"
        );
    }
    // The run-wide values keep their names.
    assert!(total("games_total") >= 2.0);
    let csv = std::fs::read_to_string(runs.join(run_id).join("metrics.csv")).unwrap();
    assert!(
        csv.contains(",text_games_total{game=KuhnPoker-v0},"),
        "{csv}"
    );
}
