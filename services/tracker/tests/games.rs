//! The tracker's `games.jsonl` against a real nats-server: training games
//! published on `relay.<run>.games` (beside a replay-buffer queue group,
//! which still gets every game) are written at `tracker.games_train_rate`,
//! the same games whatever their order; evaluation games
//! (`relay.<run>.eval.games`) are written whole as `"kind": "eval"`; and a
//! tracker process keeps the file within `tracker.games_max_bytes`,
//! saying so once in its log (and the run's `logs/tracker.log`).

use std::net::SocketAddr;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use futures::StreamExt;
use relay_config::ExperimentConfig;
use relay_kit::{ServiceConfig, Shutdown};
use relay_proto::*;
use relay_runs::games::{read, sampled, FILE, ROTATED};
use relay_testkit::{free_port, http_get, ChildProcess, NatsServer, TempDir};

async fn wait_until(what: &str, mut check: impl FnMut() -> bool) {
    for _ in 0..400 {
        if check() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("timed out waiting for {what}");
}

fn config(run: &str, runs: &Path, nats: &str, tracker: &str) -> String {
    format!(
        "run:\n  id: {run}\n  env_id: TicTacToe-v0\n  runs_dir: {}\nconnections:\n  nats_url: {nats}\ntracker:\n  flush_ms: 20\n{tracker}",
        runs.display()
    )
}

fn policy(version: Option<u64>) -> AdapterRef {
    AdapterRef {
        name: "policy".into(),
        version,
    }
}

/// A TicTacToe game of the learning adapter (seat 0, version 3) against
/// the random bot: two model moves (the second refused) and a bot move.
fn game(seed: u64) -> GameRecord {
    let model = |observation: &str, completion: &str, action: &str, invalid| TextTurn {
        player: 0,
        prompt_tokens: Tensor::from_u32(&[4], &[1, 2, 3, 4]),
        completion_tokens: Tensor::from_u32(&[3], &[5, 6, 7]),
        logprobs: Tensor::from_f32(&[3], &[-0.1, -0.2, -0.3]),
        action: action.into(),
        invalid,
        adapter: Some(policy(Some(3))),
        observation: observation.into(),
        completion: completion.into(),
        no_answer: false,
        truncated: invalid,
    };
    GameRecord {
        schema: SCHEMA_VERSION,
        runner_id: "env-runner-7".into(),
        env_id: "TicTacToe-v0".into(),
        seed,
        seats: vec![
            SeatPolicy::Model(Some(policy(None))),
            SeatPolicy::Bot("random".into()),
        ],
        learner_seat: Some(0),
        turns: vec![
            model(
                "Yours: \nTheirs: \nFree: 0 1 2 3 4 5 6 7 8",
                "The centre is the strongest square. \\boxed{4}",
                "[4]",
                false,
            ),
            TextTurn {
                player: 1,
                prompt_tokens: Tensor::from_u32(&[0], &[]),
                completion_tokens: Tensor::from_u32(&[0], &[]),
                logprobs: Tensor::from_f32(&[0], &[]),
                action: "[0]".into(),
                invalid: false,
                adapter: None,
                observation: "Yours: \nTheirs: 4".into(),
                completion: String::new(),
                no_answer: false,
                truncated: false,
            },
            model(
                "Yours: 4\nTheirs: 0\nFree: 1 2 3 5 6 7 8",
                "I will take the square again",
                "[4]",
                true,
            ),
        ],
        rewards: vec![-1.0, 0.0],
        reasons: vec!["Player 0 made an invalid move.".into(); 2],
        duration_ms: 840,
        finished_unix_ms: 1_760_000_000_000 + seed,
        branch: None,
    }
}

fn eval_game(seed: u64, confirmation: bool) -> EvalGame {
    let mut record = game(seed);
    record.runner_id = "evaluator-1".into();
    record.seats[0] = SeatPolicy::Model(Some(policy(Some(3))));
    record.seats[1] = SeatPolicy::Bot("minimax".into());
    EvalGame {
        schema: SCHEMA_VERSION,
        evaluator: "vs-opponent".into(),
        instance: "evaluator-1".into(),
        policy_version: 3,
        opponent: "minimax".into(),
        confirmation,
        game: record,
    }
}

fn json_lines(path: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tracker_writes_a_sample_of_training_games_and_every_eval_game() {
    const RUN: &str = "tracker-games";
    let nats = NatsServer::start().unwrap();
    let tmp = TempDir::new("tracker-games");
    let runs = tmp.path().join("runs");
    let text = config(
        RUN,
        &runs,
        &nats.url(),
        "  games_train_rate: 0.5\n  games_eval_rate: 1.0\n",
    );
    let experiment = ExperimentConfig::from_layers(&text, "test", &[], &[]).unwrap();
    let addr: SocketAddr = ([127, 0, 0, 1], free_port()).into();
    let mut service = ServiceConfig::for_test(experiment);
    service.metrics_addr = addr;
    let (trigger, shutdown) = Shutdown::new();
    let tracker = tokio::spawn(relay_tracker::run(service, shutdown));
    wait_until("tracker healthy", || {
        http_get(addr, "/healthz").is_ok_and(|(s, _)| s == 200)
    })
    .await;

    let client = async_nats::connect(nats.url()).await.unwrap();
    let s = Subjects::new(RUN);
    // A replay buffer's queue group: the tracker must not take its games.
    let mut replay = client
        .queue_subscribe(s.games(), "replay-buffer".into())
        .await
        .unwrap();
    client.flush().await.unwrap();
    let games: Vec<GameRecord> = (0..200).map(game).collect();
    // Not a game: rejected and counted, nothing written.
    client
        .publish(s.games(), b"not a game".to_vec().into())
        .await
        .unwrap();
    for g in &games {
        client.publish(s.games(), encode(g).into()).await.unwrap();
    }
    for seed in 0..6 {
        let e = eval_game(1000 + seed, seed >= 4);
        client
            .publish(s.eval_games(), encode(&e).into())
            .await
            .unwrap();
    }
    client.flush().await.unwrap();
    for _ in 0..200 {
        tokio::time::timeout(Duration::from_secs(10), replay.next())
            .await
            .expect("the queue group gets every game")
            .unwrap();
    }

    let expected: Vec<u64> = games
        .iter()
        .filter(|g| sampled(g, 0.5))
        .map(|g| g.seed)
        .collect();
    assert!(
        (70..=130).contains(&expected.len()),
        "{} of 200 sampled",
        expected.len()
    );
    let path = runs.join(RUN).join(FILE);
    wait_until("every sampled game and every eval game", || {
        json_lines(&path).len() == expected.len() + 6
    })
    .await;
    trigger.trigger();
    tokio::time::timeout(Duration::from_secs(30), tracker)
        .await
        .expect("tracker stops")
        .unwrap()
        .unwrap();

    let lines = json_lines(&path);
    let train: Vec<&serde_json::Value> = lines.iter().filter(|l| l["kind"] == "train").collect();
    let seeds: Vec<u64> = train.iter().map(|l| l["seed"].as_u64().unwrap()).collect();
    assert_eq!(seeds, expected);
    let first = train[0];
    assert_eq!(first["env_id"], "TicTacToe-v0");
    assert_eq!(first["runner"], "env-runner-7");
    assert_eq!(first["opponent"], "random");
    assert_eq!(first["version"], 3);
    assert_eq!(first["learner_seat"], 0);
    assert_eq!(first["seats"][0]["model"]["name"], "policy");
    assert_eq!(first["seats"][1]["bot"], "random");
    assert_eq!(first["rewards"], serde_json::json!([-1.0, 0.0]));
    assert_eq!(first["reasons"][0], "Player 0 made an invalid move.");
    let turns = first["turns"].as_array().unwrap();
    assert_eq!(turns.len(), 3);
    assert_eq!(
        turns[0]["completion"],
        "The centre is the strongest square. \\boxed{4}"
    );
    assert_eq!(
        turns[0]["observation"],
        "Yours: \nTheirs: \nFree: 0 1 2 3 4 5 6 7 8"
    );
    assert_eq!(turns[0]["action"], "[4]");
    assert_eq!(turns[0]["adapter"]["version"], 3);
    assert_eq!(turns[0]["prompt_tokens"], 4);
    assert_eq!(turns[0]["completion_tokens"], 3);
    assert_eq!(turns[1]["completion_tokens"], 0);
    assert!(turns[1].get("adapter").is_none());
    assert_eq!(turns[2]["invalid"], true);
    assert_eq!(turns[2]["truncated"], true);
    assert_eq!(turns[2]["no_answer"], false);
    // Text only: no token ids or log-probs.
    let raw = std::fs::read_to_string(&path).unwrap();
    assert!(!raw.contains("logprobs") && !raw.contains("\"data\""));

    let eval: Vec<&serde_json::Value> = lines.iter().filter(|l| l["kind"] == "eval").collect();
    assert_eq!(eval.len(), 6);
    for (i, line) in eval.iter().enumerate() {
        assert_eq!(line["evaluator"], "vs-opponent");
        assert_eq!(line["opponent"], "minimax");
        assert_eq!(line["version"], 3);
        assert_eq!(line["runner"], "evaluator-1");
        assert_eq!(line["confirmation"], i >= 4);
        assert_eq!(line["seed"], 1000 + i as u64);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_tracker_keeps_the_newest_games_within_the_bound_and_says_so_once() {
    const RUN: &str = "tracker-games-bound";
    const MAX: u64 = 12_000;
    let nats = NatsServer::start().unwrap();
    let tmp = TempDir::new("tracker-games-bound");
    let runs = tmp.path().join("runs");
    let config_path = tmp.path().join("config.yaml");
    std::fs::write(
        &config_path,
        config(
            RUN,
            &runs,
            &nats.url(),
            &format!("  games_train_rate: 1.0\n  games_max_bytes: {MAX}\n"),
        ),
    )
    .unwrap();
    let addr_file = tmp.path().join("tracker.addr");
    let mut command = Command::new(env!("CARGO_BIN_EXE_relay-tracker"));
    command
        .arg("--config")
        .arg(&config_path)
        .arg("--addr-file")
        .arg(&addr_file)
        .env("RUST_LOG", "info")
        .env_remove("RELAY_LOG_FORMAT");
    let mut tracker = ChildProcess::spawn(command, "relay-tracker", tmp.path()).unwrap();
    wait_until("tracker healthy", || {
        std::fs::read_to_string(&addr_file)
            .ok()
            .and_then(|a| a.parse::<SocketAddr>().ok())
            .is_some_and(|addr| http_get(addr, "/healthz").is_ok_and(|(s, _)| s == 200))
    })
    .await;

    let client = async_nats::connect(nats.url()).await.unwrap();
    let s = Subjects::new(RUN);
    for seed in 0..60 {
        client
            .publish(s.games(), encode(&game(seed)).into())
            .await
            .unwrap();
    }
    client.flush().await.unwrap();
    let run_dir = runs.join(RUN);
    wait_until("the newest game written", || {
        read(&run_dir)
            .ok()
            .and_then(|g| g.games.last().map(|l| l.seed))
            == Some(59)
    })
    .await;
    const MESSAGE: &str = "games.jsonl reached half of tracker.games_max_bytes";
    let tracker_log = run_dir.join("logs").join("tracker.log");
    wait_until("the warning in the run's tracker.log", || {
        std::fs::read_to_string(&tracker_log).is_ok_and(|l| l.contains(MESSAGE))
    })
    .await;
    tracker.terminate(Duration::from_secs(15)).unwrap();

    let size = |name: &str| std::fs::metadata(run_dir.join(name)).unwrap().len();
    assert!(size(FILE) <= MAX / 2 && size(ROTATED) <= MAX / 2);
    let games = read(&run_dir).unwrap();
    assert!(games.rotated);
    let seeds: Vec<u64> = games.games.iter().map(|g| g.seed).collect();
    // The newest games, none missing between them; the oldest dropped.
    assert!(seeds.len() < 60 && seeds.len() >= 4, "{seeds:?}");
    assert!(seeds.windows(2).all(|w| w[1] == w[0] + 1), "{seeds:?}");
    // Rotated several times, said once (the process's log and the run's).
    assert_eq!(tracker.log_text().matches(MESSAGE).count(), 1);
    let run_log = std::fs::read_to_string(&tracker_log).unwrap();
    assert_eq!(run_log.matches(MESSAGE).count(), 1, "{run_log}");
}
