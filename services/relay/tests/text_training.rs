//! End to end for text runs: the six services in-process on real
//! nats-server and redis-server, with the shipped TicTacToe GRPO config
//! and `relay model init tiny`'s model as the base, train the LoRA adapter
//! for a few updates: adapter versions go up, the env-runner's games are
//! played with the new versions, the checkpoint holds a PEFT adapter that
//! `relay_llm` loads back, the `best` checkpoint holds the adapter files of
//! the version the evaluator played, byte for byte, the tracker writes the
//! learner's losses and the games (`games.jsonl`, training and
//! evaluation, as `relay games` prints them); then a
//! learner resumed from that checkpoint publishes above every earlier
//! version and answers `adapters.latest` with it.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use futures::StreamExt;
use relay_config::ExperimentConfig;
use relay_kit::{ServiceConfig, Shutdown};
use relay_proto::{
    AdapterRequest, AdapterUpdate, EvalReport, GameRecord, RunStatus, RunStatusUpdate, Subjects,
    SCHEMA_VERSION,
};
use relay_testkit::{NatsServer, RedisServer, TempDir};

/// The model of `relay model init tiny` (its context of 2048 tokens holds
/// a whole TicTacToe game's prompts; the tiny-qwen2 fixture's 512 does not).
fn tiny_model(dir: &std::path::Path) -> std::path::PathBuf {
    let path = dir.join("models/tiny");
    relay::model::init_tiny(&path, 0).unwrap();
    path
}

/// Learning moves per batch; the budget is `BUDGET_BATCHES` of them (a
/// batch holds whole games, so it may hold fewer moves: there are at least
/// that many updates).
const BATCH: u64 = 8;
const BUDGET_BATCHES: u64 = 3;

fn experiment(
    run_id: &str,
    runs: &std::path::Path,
    model: &std::path::Path,
    nats: &str,
    redis: &str,
    extra: &[&str],
) -> ExperimentConfig {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../configs/tictactoe-grpo.yaml"
    );
    let text = std::fs::read_to_string(path).unwrap();
    let mut overrides: Vec<String> = vec![
        format!("run.id={run_id}"),
        format!("run.runs_dir={}", runs.display()),
        format!("connections.nats_url={nats}"),
        format!("connections.redis_url={redis}"),
        format!("llm.model={}", model.display()),
        format!("run.total_env_steps={}", BUDGET_BATCHES * BATCH),
        format!("rl.batch_size={BATCH}"),
        "rl.minibatch_size=4".into(),
        "rl.checkpoint_every=2".into(),
        "text.games_in_flight=4".into(),
        // Every game comes with a continuation of one of its positions, so
        // the branched path (replay, the learner's waiting for a position's
        // continuations) runs end to end.
        "text.branches=2".into(),
        "eval.every_versions=1000".into(),
        "eval.options={games: 2, opponents: random}".into(),
        // Every training game into games.jsonl (the default writes a tenth).
        "tracker.games_train_rate=1".into(),
        // GRPO gives a group whose games all ended alike no gradient, and a
        // few short batches can hold only such groups; without a baseline
        // every decided game moves the adapter, which the test checks.
        "rl.objective={advantage: {kind: reinforce, baseline: {kind: none}}, policy_loss: {kind: policy_gradient}, aggregation: {kind: token_mean}}".into(),
    ];
    overrides.extend(extra.iter().map(|s| s.to_string()));
    ExperimentConfig::from_layers(&text, "test", &[], &overrides).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_learner_trains_the_adapter_on_games_and_versions_reach_the_games() {
    trains_on_games("ttt-grpo", &[], 1).await;
}

/// The same run with `llm.backend: candle` (inference servers and learner
/// on the device-generic backend; the CPU here, a GPU with `llm.device:
/// cuda`), and two learner replicas: each trains its part of every
/// batch's micro-batches, rank 0 publishes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_candle_backend_trains_the_adapter_on_games_too() {
    trains_on_games("ttt-grpo-candle", &["llm.backend=candle"], 2).await;
}

async fn trains_on_games(run_id: &str, extra: &[&str], learners: usize) {
    let nats = NatsServer::start().unwrap();
    let redis = RedisServer::start().unwrap();
    let dir = TempDir::new(run_id);
    let runs = dir.path().join("runs");
    let model_dir = tiny_model(dir.path());
    let experiment = experiment(run_id, &runs, &model_dir, &nats.url(), &redis.url(), extra);
    let subjects = Subjects::new(run_id);
    let client = async_nats::connect(nats.url()).await.unwrap();
    let mut adapters = client.subscribe(subjects.adapters()).await.unwrap();
    let mut games = client.subscribe(subjects.games()).await.unwrap();
    let mut statuses = client.subscribe(subjects.status()).await.unwrap();
    let mut evals = client.subscribe(subjects.eval()).await.unwrap();

    let (trigger, shutdown) = Shutdown::new();
    let config = || ServiceConfig::for_test(experiment.clone());
    let tasks = vec![
        tokio::spawn(relay_tracker::run(config(), shutdown.clone())),
        tokio::spawn(relay_replay_buffer::run(config(), shutdown.clone())),
        tokio::spawn(relay_inference_server::run(config(), shutdown.clone())),
        tokio::spawn(relay_evaluator::run(config(), shutdown.clone())),
        tokio::spawn(relay_env_runner::run(config(), shutdown.clone())),
    ];
    let mut tasks = tasks;
    for _ in 0..learners {
        tasks.push(tokio::spawn(relay_learner::run(config(), shutdown.clone())));
    }
    let mut metrics = client.subscribe(subjects.metrics()).await.unwrap();
    // Each learner instance's last view size and rank.
    let mut replicas: BTreeMap<String, (f64, f64)> = BTreeMap::new();

    // Until the learner has spent its budget and a game played by a
    // trained version (>= 1) has been seen.
    let mut published: Vec<u64> = Vec::new();
    // The adapter files of each version, as published.
    let mut files: BTreeMap<u64, Vec<u8>> = BTreeMap::new();
    let mut evaluated: Vec<EvalReport> = Vec::new();
    let mut played: BTreeSet<u64> = BTreeSet::new();
    // The final version, from the learner's status.
    let mut learner_done: Option<u64> = None;
    let mut continuations = 0usize;
    let deadline = Instant::now() + Duration::from_secs(120);
    while !(learner_done.is_some_and(|last| published.last() == Some(&last))
        && played.iter().any(|&v| v >= 1)
        && !evaluated.is_empty())
    {
        assert!(
            Instant::now() < deadline,
            "timed out: published {published:?}, games played by {played:?}, learner done at {learner_done:?}"
        );
        tokio::select! {
            Some(m) = adapters.next() => {
                let update: AdapterUpdate = relay_proto::decode(&m.payload).unwrap();
                assert_eq!(update.name, "policy");
                published.push(update.version);
                if let Some(safetensors) = update.weights.inline {
                    files.insert(update.version, safetensors);
                }
            }
            Some(m) = evals.next() => {
                evaluated.push(relay_proto::decode(&m.payload).unwrap());
            }
            Some(m) = metrics.next() => {
                if let Ok(r) = relay_proto::decode::<relay_proto::MetricsReport>(&m.payload) {
                    let value = |name: &str| r.values.iter().find(|v| v.name == name).map(|v| v.value);
                    if let (Some(n), Some(rank)) = (value("learner_replicas"), value("learner_replica_rank")) {
                        replicas.insert(r.instance.clone(), (n, rank));
                    }
                }
            }
            Some(m) = games.next() => {
                let game: GameRecord = relay_proto::decode(&m.payload).unwrap();
                continuations += game.branch.is_some_and(|b| b.index > 0) as usize;
                // The learning seat's moves name the adapter version that made them.
                for turn in game.learning_turns() {
                    let adapter = turn.adapter.as_ref().expect("model moves name their adapter");
                    assert_eq!(adapter.name, "policy");
                    played.insert(adapter.version.expect("the server reports the version"));
                }
            }
            Some(m) = statuses.next() => {
                let status: RunStatusUpdate = relay_proto::decode(&m.payload).unwrap();
                if status.service == "learner" {
                    assert_eq!(status.status, RunStatus::Stopped, "{}", status.detail);
                    learner_done = Some(status.policy_version);
                }
            }
            _ = tokio::time::sleep(Duration::from_millis(200)) => {}
        }
    }
    assert!(continuations > 0, "no branched game was played");
    // Every learner trained in one view of them all, with its own rank.
    let ranks: BTreeSet<u64> = replicas.values().map(|&(_, rank)| rank as u64).collect();
    assert_eq!(ranks, (0..learners as u64).collect(), "{replicas:?}");
    assert!(
        replicas.values().all(|&(n, _)| n == learners as f64),
        "{replicas:?}"
    );
    // Version 0 at start, then one per update, never going back.
    let updates = *published.last().unwrap();
    assert!(updates >= BUDGET_BATCHES, "{published:?}");
    assert_eq!(
        published,
        (0..=updates).collect::<Vec<_>>(),
        "published adapter versions"
    );

    // `adapters.latest` answers with the newest version.
    let ask = AdapterRequest {
        schema: SCHEMA_VERSION,
        name: "policy".into(),
    };
    let latest: AdapterUpdate = relay_kit::request(
        &client,
        &subjects.adapters_latest(),
        &ask,
        Duration::from_secs(5),
    )
    .await
    .unwrap();
    assert_eq!(latest.version, updates);

    // The tracker wrote the games as text: training games as they came,
    // and the evaluation's (published after its report).
    let run_dir = runs.join(run_id);
    let deadline = Instant::now() + Duration::from_secs(20);
    let written = loop {
        let games = relay_runs::games::read(&run_dir).unwrap();
        let kinds: BTreeSet<_> = games.games.iter().map(|g| g.kind.label()).collect();
        if kinds.len() == 2 {
            break games;
        }
        assert!(Instant::now() < deadline, "games.jsonl holds {kinds:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    for game in &written.games {
        assert_eq!(game.env_id, "TicTacToe-v0");
        let seat = game.learner_seat.expect("a learning seat");
        let moves: Vec<_> = game.turns.iter().filter(|t| t.player == seat).collect();
        assert!(!moves.is_empty(), "{game:?}");
        for turn in moves {
            assert!(!turn.observation.is_empty() && !turn.completion.is_empty());
            assert!(turn.prompt_tokens > 0 && turn.completion_tokens > 0);
            assert_eq!(turn.adapter.as_ref().unwrap().name, "policy");
        }
        match game.kind {
            relay_runs::games::GameKind::Train => assert_eq!(game.opponent, "random"),
            relay_runs::games::GameKind::Eval => {
                assert_eq!(game.opponent, "random");
                assert_eq!(game.evaluator.as_deref(), Some("vs-opponent"));
                assert!(evaluated
                    .iter()
                    .any(|r| Some(r.policy_version) == game.version));
            }
        }
    }
    let printed = relay::games::render(
        run_id,
        &written,
        &relay::games::Filter::default(),
        false,
        relay::games::Style::default(),
    );
    assert!(
        printed.contains("=== train · TicTacToe-v0 · seed "),
        "{printed}"
    );
    assert!(
        printed.contains("=== eval (vs-opponent) · TicTacToe-v0 · seed "),
        "{printed}"
    );
    assert!(printed.contains("  reply │ "), "{printed}");

    trigger.trigger();
    for task in tasks {
        tokio::time::timeout(Duration::from_secs(30), task)
            .await
            .expect("service stops")
            .unwrap()
            .unwrap();
    }

    // The games against the random bot rated the adapter versions in the
    // league pool (written by the env-runner, flushed as it stopped).
    let (_keep, redis_shutdown) = Shutdown::new();
    let pool = relay_kit::league::LeagueStore::new(
        relay_kit::connect_redis(&redis.url(), &redis_shutdown)
            .await
            .unwrap(),
        run_id,
    )
    .load()
    .await
    .unwrap()
    .expect("the env-runner created the league pool");
    let random = relay_league::MemberId::Fixed("random".into());
    assert!(pool.get(&random).is_some(), "{pool:?}");
    let versions: Vec<u64> = pool.versions().collect();
    assert!(
        !versions.is_empty() && versions.iter().all(|&v| v <= updates),
        "{versions:?}"
    );
    let rated: u64 = versions
        .iter()
        .map(|&v| pool.games_between(&relay_league::MemberId::Version(v), &random))
        .sum();
    assert!(rated > 0, "no game was rated: {pool:?}");

    // The checkpoint: a PEFT adapter relay_llm loads, moved away from the
    // fresh one (B = 0), the optimizer's moments and the counters.
    // The evaluation's version (played with that version only), saved as
    // `best` with the files it was published with, whatever the learner
    // held when the report came.
    let best = run_dir.join("checkpoints/best");
    let best_state: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(best.join("state.json")).unwrap()).unwrap();
    let best_version = best_state["weights_version"].as_u64().unwrap();
    assert!(
        evaluated.iter().any(|r| r.policy_version == best_version),
        "best holds version {best_version}; evaluated {:?}",
        evaluated
            .iter()
            .map(|r| r.policy_version)
            .collect::<Vec<_>>()
    );
    assert_eq!(
        std::fs::read(best.join("adapter/adapter_model.safetensors")).unwrap(),
        files[&best_version],
        "best's adapter is version {best_version}'s as published"
    );
    // Played offline against the run's bots (random), two games each.
    let best_dir = best.canonicalize().unwrap();
    let offline =
        relay::eval::evaluate_text_checkpoint(run_id, &best_dir, &experiment, 2, 7).unwrap();
    assert_eq!(offline["weights_version"], best_version);
    let matchups = offline["matchups"].as_array().unwrap();
    assert_eq!(matchups.len(), 1, "{offline}");
    assert_eq!(matchups[0]["opponent"], "random");
    assert_eq!(matchups[0]["games"], 2);
    let last = run_dir.join("checkpoints/last");
    assert!(last.join("adapter/adapter_config.json").is_file());
    assert!(last.join("adapter/adapter_model.safetensors").is_file());
    assert!(last.join("optimizer.safetensors").is_file());
    let state: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(last.join("state.json")).unwrap()).unwrap();
    assert_eq!(state["updates"], updates);
    assert_eq!(state["version"], updates);
    let moves = state["env_steps"].as_u64().unwrap();
    assert!(
        (BUDGET_BATCHES * BATCH..BUDGET_BATCHES * BATCH + BATCH).contains(&moves),
        "{moves} moves trained on"
    );
    assert!(state["episodes"].as_u64().unwrap() >= updates);
    let model = relay_llm::CausalLm::load_hf(&model_dir).unwrap();
    let adapter = relay_llm::LoraAdapter::load_peft(&last.join("adapter"), model.config()).unwrap();
    assert_eq!(adapter.config().rank, experiment.lora.rank);
    let moved: f32 = adapter
        .named_vars()
        .iter()
        .filter(|(name, _)| name.contains("lora_B"))
        .map(|(_, v)| {
            v.as_tensor()
                .abs()
                .unwrap()
                .sum_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap()
        })
        .sum();
    assert!(moved > 0.0, "training never moved the adapter's B factors");

    // The tracker wrote the learner's metrics.
    let metrics = std::fs::read_to_string(run_dir.join("metrics.jsonl")).unwrap();
    let values = |name: &str| -> Vec<f64> {
        metrics
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter_map(|v| v["values"][name].as_f64())
            .collect()
    };
    let losses = values("learner_loss");
    assert_eq!(losses.len() as u64, updates, "{metrics}");
    assert!(losses.iter().all(|l| l.is_finite()));
    assert_eq!(
        values("learner_adapter_version").last(),
        Some(&(updates as f64))
    );
    assert!(values("learner_tokens_per_second").iter().all(|&t| t > 0.0));
    assert!(values("learner_mean_seq_len").iter().all(|&t| t > 1.0));
    assert!(values("learner_entropy").iter().all(|&e| e > 0.0));

    // Resume: a new learner from that checkpoint publishes version
    // `updates + 1` first, and serves it on `adapters.latest`.
    let mut adapters = client.subscribe(subjects.adapters()).await.unwrap();
    let mut resumed = experiment.clone();
    resumed.run.resume_from = Some(last.clone());
    let (trigger, shutdown) = Shutdown::new();
    let learner = tokio::spawn(relay_learner::run(
        ServiceConfig::for_test(resumed),
        shutdown.clone(),
    ));
    let first = tokio::time::timeout(Duration::from_secs(30), adapters.next())
        .await
        .expect("the resumed learner publishes")
        .unwrap();
    let first: AdapterUpdate = relay_proto::decode(&first.payload).unwrap();
    assert_eq!(first.version, updates + 1);
    let latest: AdapterUpdate = relay_kit::request(
        &client,
        &subjects.adapters_latest(),
        &ask,
        Duration::from_secs(5),
    )
    .await
    .unwrap();
    assert_eq!(latest.version, updates + 1);
    // The resumed adapter is the checkpoint's.
    let Some(safetensors) = &latest.weights.inline else {
        panic!("a tiny adapter is published inline");
    };
    let served =
        relay_llm::LoraAdapter::from_peft_bytes(&latest.config_json, safetensors, model.config())
            .unwrap();
    for ((name, a), (_, b)) in adapter.named_vars().iter().zip(served.named_vars()) {
        let (a, b): (Vec<f32>, Vec<f32>) = (
            a.as_tensor().flatten_all().unwrap().to_vec1().unwrap(),
            b.as_tensor().flatten_all().unwrap().to_vec1().unwrap(),
        );
        assert_eq!(a, b, "{name}");
    }
    trigger.trigger();
    tokio::time::timeout(Duration::from_secs(30), learner)
        .await
        .expect("learner stops")
        .unwrap()
        .unwrap();
}

#[test]
fn relay_up_writes_a_missing_tiny_model_and_nothing_else() {
    let dir = TempDir::new("tiny-model");
    let config = |model: &std::path::Path| {
        let text = format!(
            "run:\n  env_id: TicTacToe-v0\nllm:\n  model: {}\n",
            model.display()
        );
        ExperimentConfig::from_layers(&text, "test", &[], &[]).unwrap()
    };
    let tiny = dir.path().join("models/tiny");
    assert_eq!(
        relay::stack::ensure_tiny_model(&config(&tiny)).unwrap(),
        Some(tiny.clone())
    );
    let loaded = relay_llm::CausalLm::load_hf(&tiny).unwrap();
    assert_eq!(loaded.config().num_hidden_layers, 3);
    // Present: left alone.
    assert_eq!(
        relay::stack::ensure_tiny_model(&config(&tiny)).unwrap(),
        None
    );
    // Any other missing model is not invented (the services then report it).
    let other = dir.path().join("models/qwen");
    assert_eq!(
        relay::stack::ensure_tiny_model(&config(&other)).unwrap(),
        None
    );
    assert!(!other.exists());
}

/// A big adapter goes through the JetStream object store (direct transfer
/// off), and an inference server that starts after the learner published
/// gets the current version from `adapters.latest` and serves it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_inference_server_serves_the_current_adapter_from_the_object_store() {
    let nats = NatsServer::start().unwrap();
    let redis = RedisServer::start().unwrap();
    let dir = TempDir::new("late-server");
    let runs = dir.path().join("runs");
    let run_id = "late-server";
    let model_dir = tiny_model(dir.path());
    let mut experiment = experiment(run_id, &runs, &model_dir, &nats.url(), &redis.url(), &[]);
    // Every version through the object store.
    experiment.weights.inline_max_bytes = 0;
    experiment.weights.direct = false;
    let subjects = Subjects::new(run_id);
    let client = async_nats::connect(nats.url()).await.unwrap();
    let mut adapters = client.subscribe(subjects.adapters()).await.unwrap();
    let (trigger, shutdown) = Shutdown::new();
    let config = || ServiceConfig::for_test(experiment.clone());
    let learner = tokio::spawn(relay_learner::run(config(), shutdown.clone()));
    let first = tokio::time::timeout(Duration::from_secs(30), adapters.next())
        .await
        .expect("the learner publishes version 0")
        .unwrap();
    let first: AdapterUpdate = relay_proto::decode(&first.payload).unwrap();
    assert_eq!(first.version, 0);
    let (Some(stored), None, None) = (
        &first.weights.store,
        &first.weights.inline,
        &first.weights.direct,
    ) else {
        panic!(
            "inline_max_bytes 0 and no direct transfer send every version through the object store"
        );
    };
    assert_eq!(stored.bucket, format!("relay-{run_id}-weights"));
    assert_eq!(stored.key, "policy/v0/weights.safetensors");

    // Only now the inference server starts: it asks for the current version.
    let server = tokio::spawn(relay_inference_server::run(config(), shutdown.clone()));
    let request = relay_proto::GenerateRequest::new(
        Some(relay_proto::AdapterRef {
            name: "policy".into(),
            version: None,
        }),
        relay_proto::Prompt::Text("hello".into()),
        relay_proto::SamplingParams {
            max_tokens: 2,
            ..Default::default()
        },
    );
    let deadline = Instant::now() + Duration::from_secs(30);
    let reply: relay_proto::GenerateReply = loop {
        match relay_kit::request(
            &client,
            &subjects.generate(),
            &request,
            Duration::from_secs(5),
        )
        .await
        {
            Ok(reply) => break reply,
            Err(e) => {
                assert!(Instant::now() < deadline, "never served: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    };
    assert_eq!(
        reply.adapter,
        Some(relay_proto::AdapterRef {
            name: "policy".into(),
            version: Some(0)
        })
    );
    trigger.trigger();
    for task in [learner, server] {
        tokio::time::timeout(Duration::from_secs(30), task)
            .await
            .expect("service stops")
            .unwrap()
            .unwrap();
    }
}
