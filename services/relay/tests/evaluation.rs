//! Evaluation you can trust, against real nats-server and redis-server:
//! the checkpoint saved for an evaluation holds exactly the weights that
//! were evaluated (even when the report arrives versions later), a
//! screening pass that fails its confirmation does not solve the run, and
//! a checkpoint re-evaluated offline with the run's eval seed gives the
//! evaluator's figure.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use relay_config::ExperimentConfig;
use relay_kit::{ServiceConfig, Shutdown};
use relay_proto::{
    EvalReport, EvalStarted, RunStatus, RunStatusUpdate, Subjects, WeightsUpdate, SCHEMA_VERSION,
};
use relay_testkit::{NatsServer, RedisServer, TempDir};

/// The shipped CartPole PPO config with the run's id, folders and servers.
fn cartpole(
    run_id: &str,
    runs: &std::path::Path,
    nats: &NatsServer,
    redis: &RedisServer,
    extra: &[&str],
) -> ExperimentConfig {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../configs/cartpole-ppo.yaml"
    );
    let text = std::fs::read_to_string(path).unwrap();
    let mut overrides = vec![
        format!("run.id={run_id}"),
        format!("run.runs_dir={}", runs.display()),
        format!("connections.nats_url={}", nats.url()),
        format!("connections.redis_url={}", redis.url()),
    ];
    overrides.extend(extra.iter().map(|e| e.to_string()));
    ExperimentConfig::from_layers(&text, "test", &[], &overrides).unwrap()
}

/// Every weights version the learner publishes, by version.
fn record_weights(mut weights: async_nats::Subscriber) -> Arc<Mutex<BTreeMap<u64, WeightsUpdate>>> {
    let seen: Arc<Mutex<BTreeMap<u64, WeightsUpdate>>> = Arc::default();
    let out = seen.clone();
    tokio::spawn(async move {
        while let Some(m) = weights.next().await {
            if let Ok(w) = relay_proto::decode::<WeightsUpdate>(&m.payload) {
                out.lock().unwrap().insert(w.version, w);
            }
        }
    });
    seen
}

/// Waits until `done` holds (panics after `seconds`, naming `what`).
async fn wait_until(seconds: u64, what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(seconds);
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The tensors of a safetensors file, by name, as f32 bits.
fn tensor_bits(path: &std::path::Path) -> BTreeMap<String, (Vec<usize>, Vec<u32>)> {
    let (tensors, _) = relay_nn::io::read_safetensors(path).unwrap();
    tensors
        .into_iter()
        .map(|(name, shape, values)| (name, (shape, values.iter().map(|v| v.to_bits()).collect())))
        .collect()
}

fn report(run_env: &str, version: u64, mean: f64) -> EvalReport {
    EvalReport {
        schema: SCHEMA_VERSION,
        evaluator: "greedy".into(),
        instance: "test-evaluator".into(),
        env_id: run_env.into(),
        policy_version: version,
        learner_env_steps: 0,
        returns: vec![mean],
        mean_return: mean,
        std_return: 0.0,
        threshold: 1e9,
        solved: false,
        matchups: Vec::new(),
        confirmation: None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_report_saves_the_evaluated_versions_weights_byte_for_byte() {
    let nats = NatsServer::start().unwrap();
    let redis = RedisServer::start().unwrap();
    let dir = TempDir::new("evaluated-weights");
    let runs = dir.path().join("runs");
    let run_id = "evaluated-weights";
    let experiment = cartpole(
        run_id,
        &runs,
        &nats,
        &redis,
        &[
            "run.total_env_steps=100000000",
            "run.stop_when_solved=false",
            "ppo.epochs=2",
        ],
    );
    let client = async_nats::connect(nats.url()).await.unwrap();
    let subjects = Subjects::new(run_id);
    let published = record_weights(client.subscribe(subjects.weights()).await.unwrap());
    // The test plays the evaluator: no evaluator service runs.
    let (trigger, shutdown) = Shutdown::new();
    let config = || ServiceConfig::for_test(experiment.clone());
    let tasks = vec![
        tokio::spawn(relay_replay_buffer::run(config(), shutdown.clone())),
        tokio::spawn(relay_inference_server::run(config(), shutdown.clone())),
        tokio::spawn(relay_env_runner::run(config(), shutdown.clone())),
        tokio::spawn(relay_learner::run(config(), shutdown.clone())),
    ];
    let newest = || published.lock().unwrap().keys().next_back().copied();

    // An evaluation of version N starts, and reports after N+2 is out.
    wait_until(60, "version 3", || newest() >= Some(3)).await;
    let evaluated = newest().unwrap();
    let start = EvalStarted {
        schema: SCHEMA_VERSION,
        evaluator: "greedy".into(),
        instance: "test-evaluator".into(),
        policy_version: evaluated,
    };
    client
        .publish(subjects.eval_started(), relay_proto::encode(&start).into())
        .await
        .unwrap();
    client.flush().await.unwrap();
    wait_until(60, "two more versions", || newest() >= Some(evaluated + 2)).await;
    client
        .publish(
            subjects.eval(),
            relay_proto::encode(&report("CartPole-v1", evaluated, 123.0)).into(),
        )
        .await
        .unwrap();
    client.flush().await.unwrap();

    let run_dir = runs.join(run_id);
    wait_until(30, "the best checkpoint", || {
        relay_learner::checkpoint::link_target(&run_dir, "best").is_some()
    })
    .await;
    let best = relay_learner::checkpoint::resolve(&run_dir, "best").unwrap();
    let state = relay_learner::checkpoint::load_state(&best).unwrap();
    assert_eq!(state.weights_version, Some(evaluated));
    assert!(
        state.progress.version > evaluated,
        "the learner had moved on: {:?}",
        state.progress
    );
    assert_eq!(state.best_eval, Some((123.0, evaluated)));
    let saved = tensor_bits(&best.join("model.safetensors"));
    let parameters = |update: &WeightsUpdate| {
        let bytes = update
            .weights
            .inline
            .as_ref()
            .expect("CartPole travels inline");
        relay_policy::PolicyWeights::from_update(update, bytes)
            .unwrap()
            .tensors
    };
    let update = parameters(&published.lock().unwrap()[&evaluated]);
    assert_eq!(saved.len(), update.len());
    for (name, shape, values) in &update {
        let bits: Vec<u32> = values.iter().map(|v| v.to_bits()).collect();
        assert_eq!(
            saved[name],
            (shape.clone(), bits),
            "{name} differs from version {evaluated}"
        );
    }
    // The current weights differ, so the check above could fail. (The
    // checkpoint may be written before that version reaches the test's
    // subscription.)
    let current = state.progress.version;
    wait_until(30, "the checkpoint's current version", || {
        published.lock().unwrap().contains_key(&current)
    })
    .await;
    let newer = parameters(&published.lock().unwrap()[&current]);
    assert_ne!(newer, update);

    // A version that passed the screening (500) but not its confirmation
    // (100) is judged by the confirmation: not the best.
    let lucky = newest().unwrap();
    let start = EvalStarted {
        policy_version: lucky,
        ..start
    };
    client
        .publish(subjects.eval_started(), relay_proto::encode(&start).into())
        .await
        .unwrap();
    let mut screened = report("CartPole-v1", lucky, 500.0);
    screened.confirmation = Some(relay_proto::Confirmation {
        episodes: 1,
        seed: experiment.eval.confirm_seed(lucky),
        returns: vec![100.0],
        mean_return: 100.0,
        std_return: 0.0,
        passed: false,
    });
    client
        .publish(subjects.eval(), relay_proto::encode(&screened).into())
        .await
        .unwrap();
    client.flush().await.unwrap();

    // A better report for a version announced by no evaluation and long
    // gone saves nothing: `best` never points at other weights.
    let held = newest().unwrap();
    wait_until(60, "ten more versions", || newest() >= Some(held + 10)).await;
    client
        .publish(
            subjects.eval(),
            relay_proto::encode(&report("CartPole-v1", held, 999.0)).into(),
        )
        .await
        .unwrap();
    client.flush().await.unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let best_now = relay_learner::checkpoint::resolve(&run_dir, "best").unwrap();
    let state_now = relay_learner::checkpoint::load_state(&best_now).unwrap();
    assert_eq!(state_now.weights_version, Some(evaluated));
    assert_eq!(state_now.best_eval, Some((123.0, evaluated)));

    trigger.trigger();
    for t in tasks {
        tokio::time::timeout(Duration::from_secs(30), t)
            .await
            .expect("service stops")
            .unwrap()
            .unwrap();
    }
    // The final checkpoint holds the learner's own weights and is `last`.
    let last = relay_learner::checkpoint::resolve(&run_dir, "last").unwrap();
    let state = relay_learner::checkpoint::load_state(&last).unwrap();
    assert_eq!(state.weights_version, Some(state.progress.version));
    assert_ne!(last, best);
}

/// A CartPole policy (random weights of seed `k`) and its greedy mean
/// return on the screening set and on version 1's confirmation set.
fn screening_and_confirmation(
    experiment: &ExperimentConfig,
    k: u64,
) -> (relay_nn::ActorCritic, f64, f64) {
    let spec = relay_policy::spec_for(experiment).unwrap();
    let model = relay_nn::ActorCritic::with_layout(&spec, experiment.policy.trunk, k).unwrap();
    let mean = |episodes: usize, seed: u64| {
        let r = relay_evaluator::evaluate(&model, "CartPole-v1", episodes, seed).unwrap();
        r.iter().sum::<f64>() / r.len() as f64
    };
    let eval = &experiment.eval;
    let screening = mean(eval.episodes, eval.seed);
    let confirmation = mean(eval.confirm_episodes, eval.confirm_seed(1));
    (model, screening, confirmation)
}

/// Runs the evaluator on one weights version (published by the test) and
/// returns its report and whether the run was announced solved.
async fn evaluate_once(
    experiment: ExperimentConfig,
    nats: &NatsServer,
    model: &relay_nn::ActorCritic,
) -> (EvalReport, Option<RunStatusUpdate>) {
    let run_id = experiment.run.id.clone().unwrap();
    let client = async_nats::connect(nats.url()).await.unwrap();
    let subjects = Subjects::new(&run_id);
    let mut evals = client.subscribe(subjects.eval()).await.unwrap();
    let mut statuses = client.subscribe(subjects.status()).await.unwrap();
    let mut starts = client.subscribe(subjects.eval_started()).await.unwrap();
    let (trigger, shutdown) = Shutdown::new();
    let evaluator = tokio::spawn(relay_evaluator::run(
        ServiceConfig::for_test(experiment),
        shutdown,
    ));
    let weights = relay_policy::PolicyWeights::of(model, 1, 1000).inline_update();
    // The test is the learner: it answers `weights.latest` and announces the version.
    let mut latest = client.subscribe(subjects.weights_latest()).await.unwrap();
    let (answers, payload) = (client.clone(), relay_proto::encode(&weights));
    let answering = tokio::spawn(async move {
        while let Some(m) = latest.next().await {
            if let Some(reply) = m.reply {
                answers
                    .publish(reply, payload.clone().into())
                    .await
                    .unwrap();
            }
        }
    });
    let announcement = relay_proto::WeightsAnnouncement {
        schema: SCHEMA_VERSION,
        version: weights.version,
        learner_env_steps: weights.learner_env_steps,
    };
    let report = tokio::time::timeout(Duration::from_secs(60), async {
        loop {
            // Until the evaluator hears it (it may subscribe after a publish).
            client
                .publish(
                    subjects.weights_announce(),
                    relay_proto::encode(&announcement).into(),
                )
                .await
                .unwrap();
            if let Ok(Some(m)) =
                tokio::time::timeout(Duration::from_millis(300), evals.next()).await
            {
                break relay_proto::decode::<EvalReport>(&m.payload).unwrap();
            }
        }
    })
    .await
    .expect("an eval report");
    let started =
        relay_proto::decode::<EvalStarted>(&starts.next().await.unwrap().payload).unwrap();
    assert_eq!(started.policy_version, 1, "the evaluation was announced");
    let status = tokio::time::timeout(Duration::from_millis(500), statuses.next())
        .await
        .ok()
        .flatten()
        .map(|m| relay_proto::decode::<RunStatusUpdate>(&m.payload).unwrap());
    trigger.trigger();
    evaluator.await.unwrap().unwrap();
    answering.abort();
    (report, status)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_screening_pass_solves_the_run_only_when_fresh_episodes_confirm_it() {
    let nats = NatsServer::start().unwrap();
    let redis = RedisServer::start().unwrap();
    let dir = TempDir::new("confirmation");
    let runs = dir.path().join("runs");
    let base = cartpole(
        "confirmation",
        &runs,
        &nats,
        &redis,
        &["eval.episodes=5", "eval.confirm_episodes=40"],
    );
    // A policy that does better on the 5 screening episodes than on the
    // 40 fresh ones (random weights: its returns vary with the start).
    let (model, screening, confirmation) = (0..200)
        .map(|k| screening_and_confirmation(&base, k))
        .find(|(_, s, c)| s - c > 2.0)
        .expect("a policy better on the screening set");

    // Threshold between the two: screened, not confirmed, not solved.
    let between = (screening + confirmation) / 2.0;
    let experiment = cartpole(
        "confirmation-fails",
        &runs,
        &nats,
        &redis,
        &[
            "eval.episodes=5",
            "eval.confirm_episodes=40",
            &format!("eval.threshold={between}"),
        ],
    );
    let (report, status) = evaluate_once(experiment.clone(), &nats, &model).await;
    assert_eq!(report.mean_return, screening);
    assert!(report.mean_return >= between);
    let c = report.confirmation.expect("a screening pass is confirmed");
    assert_eq!(c.episodes, 40);
    assert_eq!(c.seed, experiment.eval.confirm_seed(1));
    assert_eq!(c.mean_return, confirmation);
    assert!(!c.passed);
    assert!(!report.solved);
    assert!(status.is_none(), "not announced solved: {status:?}");

    // A threshold the confirmation's mean meets exactly: by the default
    // `eval.confirm_z` of 2 its mean must clear it by two standard
    // errors, so this is not solved either.
    let experiment = cartpole(
        "confirmation-without-margin",
        &runs,
        &nats,
        &redis,
        &[
            "eval.episodes=5",
            "eval.confirm_episodes=40",
            &format!("eval.threshold={confirmation}"),
        ],
    );
    let (report, status) = evaluate_once(experiment, &nats, &model).await;
    let c = report.confirmation.expect("a screening pass is confirmed");
    assert_eq!(c.mean_return, confirmation);
    assert!(c.std_return > 0.0);
    assert!(!c.passed && !report.solved);
    assert!(status.is_none(), "not announced solved: {status:?}");

    // A threshold both meet, the mean alone counting (`confirm_z=0`):
    // solved, announced with both figures.
    let below = confirmation.min(screening) - 1.0;
    let experiment = cartpole(
        "confirmation-passes",
        &runs,
        &nats,
        &redis,
        &[
            "eval.episodes=5",
            "eval.confirm_episodes=40",
            "eval.confirm_z=0",
            &format!("eval.threshold={below}"),
        ],
    );
    let (report, status) = evaluate_once(experiment, &nats, &model).await;
    assert!(report.solved);
    assert!(report.confirmation.as_ref().unwrap().passed);
    let status = status.expect("announced solved");
    assert_eq!(status.status, RunStatus::Solved);
    assert_eq!(status.policy_version, 1);
    assert!(
        status.detail.contains(&format!("{confirmation:.3}"))
            && status.detail.contains(&format!("{screening:.3}")),
        "{}",
        status.detail
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_checkpoint_reevaluated_offline_with_the_runs_eval_seed_gives_the_evaluators_figure() {
    let nats = NatsServer::start().unwrap();
    let redis = RedisServer::start().unwrap();
    let dir = TempDir::new("offline-eval");
    let runs = dir.path().join("runs");
    let run_id = "offline-eval";
    // Normalised observations: the checkpoint must also hold the
    // statistics the evaluated version carried, exactly.
    let experiment = cartpole(
        run_id,
        &runs,
        &nats,
        &redis,
        &[
            "run.total_env_steps=100000000",
            "run.stop_when_solved=false",
            "ppo.epochs=2",
            "normalize.obs=true",
            "eval.every_versions=1",
            "eval.episodes=4",
            "eval.threshold=1000000000",
        ],
    );
    let client = async_nats::connect(nats.url()).await.unwrap();
    let subjects = Subjects::new(run_id);
    let mut evals = client.subscribe(subjects.eval()).await.unwrap();
    let (trigger, shutdown) = Shutdown::new();
    let config = || ServiceConfig::for_test(experiment.clone());
    let tasks = vec![
        tokio::spawn(relay_replay_buffer::run(config(), shutdown.clone())),
        tokio::spawn(relay_inference_server::run(config(), shutdown.clone())),
        tokio::spawn(relay_evaluator::run(config(), shutdown.clone())),
        tokio::spawn(relay_env_runner::run(config(), shutdown.clone())),
        tokio::spawn(relay_learner::run(config(), shutdown.clone())),
    ];
    // Reports of a few versions past the first.
    let mut reports: BTreeMap<u64, EvalReport> = BTreeMap::new();
    tokio::time::timeout(Duration::from_secs(90), async {
        while reports.keys().filter(|v| **v >= 2).count() < 3 {
            let m = evals.next().await.unwrap();
            let r = relay_proto::decode::<EvalReport>(&m.payload).unwrap();
            reports.insert(r.policy_version, r);
        }
    })
    .await
    .expect("eval reports");
    trigger.trigger();
    for t in tasks {
        tokio::time::timeout(Duration::from_secs(30), t)
            .await
            .expect("service stops")
            .unwrap()
            .unwrap();
    }
    // Reports the learner may have heard as it stopped.
    while let Ok(Some(m)) = tokio::time::timeout(Duration::from_millis(200), evals.next()).await {
        let r = relay_proto::decode::<EvalReport>(&m.payload).unwrap();
        reports.insert(r.policy_version, r);
    }

    let run_dir = runs.join(run_id);
    let best = relay_learner::checkpoint::resolve(&run_dir, "best").unwrap();
    let version = relay_learner::checkpoint::load_state(&best)
        .unwrap()
        .weights_version
        .unwrap();
    let reported = &reports[&version];
    assert!(best
        .join(relay_learner::checkpoint::VEC_NORMALIZE_FILE)
        .is_file());
    let offline = relay::eval::evaluate_checkpoint(
        &runs,
        run_id,
        "best",
        experiment.eval.episodes,
        Some(experiment.eval.seed),
    )
    .unwrap();
    assert_eq!(offline.weights_version, version);
    assert_eq!(offline.returns, reported.returns, "version {version}");
    assert_eq!(offline.mean_return, reported.mean_return);
    // By default the episodes are fresh ones: another set of starts.
    let fresh = relay::eval::evaluate_checkpoint(&runs, run_id, "best", 4, None).unwrap();
    assert_eq!(fresh.seed, experiment.eval.fresh_seed());
}
