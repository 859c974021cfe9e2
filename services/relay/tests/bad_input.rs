//! Bad input sent to every subscriber of every subject: each message is
//! rejected with a counter `relay_messages_rejected_total{subject,reason}`
//! (and, for requests, an error reply), and every service keeps working.

use std::net::SocketAddr;
use std::time::Duration;

use relay_config::ExperimentConfig;
use relay_kit::{ServiceConfig, Shutdown};
use relay_proto::*;
use relay_testkit::{free_port, http_get, NatsServer, RedisServer, TempDir};

fn experiment(nats: &NatsServer, redis: &RedisServer, runs: &std::path::Path) -> ExperimentConfig {
    let text = format!(
        "run:\n  id: bad-input\n  env_id: CartPole-v1\n  runs_dir: {}\nconnections:\n  nats_url: {}\n  redis_url: {}\n  request_timeout_ms: 1000\nppo:\n  rollout_steps: 256\n",
        runs.display(),
        nats.url(),
        redis.url()
    );
    ExperimentConfig::from_layers(&text, "test", &[], &[]).unwrap()
}

fn with_port(experiment: &ExperimentConfig) -> (ServiceConfig, SocketAddr) {
    let addr: SocketAddr = ([127, 0, 0, 1], free_port()).into();
    let mut config = ServiceConfig::for_test(experiment.clone());
    config.metrics_addr = addr;
    (config, addr)
}

async fn wait_healthy(addr: SocketAddr) {
    for _ in 0..200 {
        if tokio::task::spawn_blocking(move || http_get(addr, "/healthz"))
            .await
            .unwrap()
            .is_ok_and(|(s, _)| s == 200)
        {
            return;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("{addr} never became healthy");
}

async fn metrics(addr: SocketAddr) -> String {
    tokio::task::spawn_blocking(move || http_get(addr, "/metrics"))
        .await
        .unwrap()
        .unwrap()
        .1
}

fn rejected(body: &str, subject: &str, reason: &str) -> u64 {
    let (subject, reason) = (
        format!("subject=\"{subject}\""),
        format!("reason=\"{reason}\""),
    );
    body.lines()
        .filter(|l| l.starts_with("relay_messages_rejected_total{"))
        .filter(|l| l.contains(&subject) && l.contains(&reason))
        .find_map(|l| l.rsplit(' ').next()?.parse().ok())
        .unwrap_or(0)
}

fn with_schema<T: WireMessage + Clone>(message: &T, set: impl FnOnce(&mut T)) -> Vec<u8> {
    let mut m = message.clone();
    set(&mut m);
    encode(&m)
}

async fn expect_error_reply(client: &async_nats::Client, subject: String, payload: Vec<u8>) {
    let reply = client
        .request(subject.clone(), payload.into())
        .await
        .unwrap();
    let headers = reply
        .headers
        .unwrap_or_else(|| panic!("{subject}: a bad request must get an error reply"));
    assert_eq!(
        headers.get("Nats-Service-Error-Code").unwrap().as_str(),
        "400",
        "{subject}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_subscriber_rejects_bad_input_and_keeps_running() {
    let nats = NatsServer::start().unwrap();
    let redis = RedisServer::start().unwrap();
    let dir = TempDir::new("bad-input");
    let exp = experiment(&nats, &redis, dir.path());
    let (trigger, shutdown) = Shutdown::new();
    let (tracker, tracker_addr) = with_port(&exp);
    let (replay, replay_addr) = with_port(&exp);
    let (learner, learner_addr) = with_port(&exp);
    let (inference, inference_addr) = with_port(&exp);
    let (evaluator, evaluator_addr) = with_port(&exp);
    let tasks = vec![
        tokio::spawn(relay_tracker::run(tracker, shutdown.clone())),
        tokio::spawn(relay_replay_buffer::run(replay, shutdown.clone())),
        tokio::spawn(relay_learner::run(learner, shutdown.clone())),
        tokio::spawn(relay_inference_server::run(inference, shutdown.clone())),
        tokio::spawn(relay_evaluator::run(evaluator, shutdown.clone())),
    ];
    for addr in [
        tracker_addr,
        replay_addr,
        learner_addr,
        inference_addr,
        evaluator_addr,
    ] {
        wait_healthy(addr).await;
    }
    let client = async_nats::connect(nats.url()).await.unwrap();
    let s = Subjects::new("bad-input");

    // A valid act request is answered once the inference server has the learner's weights.
    let good = ActRequest::new(Tensor::from_f32(&[2, 4], &[0.0; 8]), false);
    let mut answered = false;
    for _ in 0..100 {
        if relay_kit::request::<_, ActReply>(&client, &s.act(), &good, Duration::from_secs(1))
            .await
            .is_ok()
        {
            answered = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(answered, "inference server never answered");

    // Requests: garbage, another schema version, NaN, a wrong shape.
    let garbage = b"\xc1 definitely not msgpack".to_vec();
    expect_error_reply(&client, s.act(), garbage.clone()).await;
    expect_error_reply(&client, s.act(), with_schema(&good, |m| m.schema = 99)).await;
    expect_error_reply(
        &client,
        s.act(),
        with_schema(&good, |m| m.obs = Tensor::from_f32(&[2, 4], &[f32::NAN; 8])),
    )
    .await;
    expect_error_reply(
        &client,
        s.act(),
        with_schema(&good, |m| m.obs = Tensor::from_f32(&[2, 3], &[0.0; 6])),
    )
    .await;
    let sample = SampleRequest {
        schema: SCHEMA_VERSION,
        min_policy_version: 0,
        max_steps: 1,
    };
    expect_error_reply(&client, s.replay_sample(), garbage.clone()).await;
    expect_error_reply(
        &client,
        s.replay_sample(),
        with_schema(&sample, |m| m.schema = 0),
    )
    .await;
    let ask = WeightsRequest {
        schema: SCHEMA_VERSION,
    };
    expect_error_reply(&client, s.weights_latest(), garbage.clone()).await;
    expect_error_reply(
        &client,
        s.weights_latest(),
        with_schema(&ask, |m| m.schema = 2),
    )
    .await;

    // Published messages: the same kinds to every subscriber.
    let weights: WeightsUpdate =
        relay_kit::request(&client, &s.weights_latest(), &ask, Duration::from_secs(1))
            .await
            .unwrap();
    let parameters = relay_policy::PolicyWeights::from_update(
        &weights,
        weights
            .weights
            .inline
            .as_ref()
            .expect("a CartPole policy travels inline"),
    )
    .unwrap();
    let mut nan = parameters.clone();
    nan.version = 1_000;
    nan.tensors[0].2.fill(f32::NAN);
    let nan_weights = nan.inline_update();
    let mut wrong = parameters;
    wrong.version = 1_001;
    wrong.tensors[0] = (wrong.tensors[0].0.clone(), vec![3], vec![0.0; 3]);
    let wrong_shape = wrong.inline_update();
    let status = RunStatusUpdate {
        schema: SCHEMA_VERSION,
        status: RunStatus::Running,
        service: "test".into(),
        policy_version: 0,
        detail: String::new(),
    };
    let episodes = EpisodeReport {
        schema: SCHEMA_VERSION,
        runner_id: "t".into(),
        env_id: "CartPole-v1".into(),
        policy_version: 0,
        episodes: vec![EpisodeSummary {
            episode_return: f64::NAN,
            length: 3,
            terminated: true,
            ..Default::default()
        }],
    };
    let report = MetricsReport {
        schema: SCHEMA_VERSION,
        service: "t".into(),
        instance: "t".into(),
        vec_steps: None,
        values: vec![],
    };
    let logs = LogBatch {
        schema: SCHEMA_VERSION,
        service: "../etc".into(),
        instance: "t".into(),
        lines: vec!["x".into()],
    };
    let sends: Vec<(String, Vec<u8>)> = vec![
        (s.weights(), garbage.clone()),
        (s.weights(), with_schema(&weights, |m| m.schema = 7)),
        (s.weights_announce(), garbage.clone()),
        (
            s.weights_announce(),
            with_schema(&weights, |m| m.schema = 7),
        ),
        (s.status(), garbage.clone()),
        (s.status(), with_schema(&status, |m| m.schema = 7)),
        (s.metrics(), garbage.clone()),
        (s.metrics(), with_schema(&report, |m| m.schema = 7)),
        (s.episodes(), garbage.clone()),
        (s.episodes(), encode(&episodes)),
        (s.eval(), garbage.clone()),
        (s.logs(), garbage.clone()),
        (s.logs(), encode(&logs)),
    ];
    for (subject, payload) in sends {
        client.publish(subject, payload.into()).await.unwrap();
    }
    // Bad versions one at a time: a follower fetches only the newest of
    // the versions queued while it fetched the last.
    for bad in [&nan_weights, &wrong_shape] {
        client.flush().await.unwrap();
        tokio::time::sleep(Duration::from_millis(300)).await;
        client
            .publish(s.weights(), encode(bad).into())
            .await
            .unwrap();
    }
    client.flush().await.unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;

    let inference = metrics(inference_addr).await;
    for (subject, reason) in [
        ("act", "decode"),
        ("act", "schema_version"),
        ("act", "non_finite"),
        ("act", "invalid"),
        ("weights", "decode"),
        ("weights", "schema_version"),
        ("weights", "non_finite"),
        ("weights", "invalid"),
    ] {
        assert!(
            rejected(&inference, subject, reason) >= 1,
            "inference-server: no {subject}/{reason} rejection in\n{inference}"
        );
    }
    // NaN weights are refused on decode, wrong-shape weights when loaded
    // (naming the parameter): the server still serves version 0.
    assert_eq!(
        rejected(&inference, "weights", "non_finite"),
        1,
        "NaN weights"
    );
    assert_eq!(
        rejected(&inference, "weights", "invalid"),
        1,
        "wrong-shape weights"
    );
    // The evaluator hears versions announced (no weights in them) and
    // fetches the weights it plays from the learner (whose are valid).
    let evaluator = metrics(evaluator_addr).await;
    for (subject, reason) in [
        ("weights.announce", "decode"),
        ("weights.announce", "schema_version"),
    ] {
        assert!(
            rejected(&evaluator, subject, reason) >= 1,
            "evaluator: no {subject}/{reason} in\n{evaluator}"
        );
    }
    let replay = metrics(replay_addr).await;
    assert!(
        rejected(&replay, "replay.sample", "decode") >= 1
            && rejected(&replay, "replay.sample", "schema_version") >= 1,
        "{replay}"
    );
    let learner = metrics(learner_addr).await;
    for (subject, reason) in [
        ("status", "decode"),
        ("status", "schema_version"),
        ("weights.latest", "decode"),
        ("weights.latest", "schema_version"),
    ] {
        assert!(
            rejected(&learner, subject, reason) >= 1,
            "learner: no {subject}/{reason} in\n{learner}"
        );
    }
    let tracker = metrics(tracker_addr).await;
    for (subject, reason) in [
        ("status", "decode"),
        ("status", "schema_version"),
        ("metrics", "decode"),
        ("metrics", "schema_version"),
        ("episodes", "decode"),
        ("episodes", "invalid"),
        ("eval", "decode"),
        ("logs", "decode"),
        ("logs", "invalid"),
    ] {
        assert!(
            rejected(&tracker, subject, reason) >= 1,
            "tracker: no {subject}/{reason} in\n{tracker}"
        );
    }

    // Everyone still works: a valid act request is answered with version 0.
    let reply: ActReply = relay_kit::request(&client, &s.act(), &good, Duration::from_secs(2))
        .await
        .unwrap();
    assert_eq!(reply.policy_version, 0);
    for addr in [
        tracker_addr,
        replay_addr,
        learner_addr,
        inference_addr,
        evaluator_addr,
    ] {
        wait_healthy(addr).await;
    }
    trigger.trigger();
    for task in tasks {
        tokio::time::timeout(Duration::from_secs(15), task)
            .await
            .expect("service stops")
            .unwrap()
            .unwrap();
    }
}
