//! The per-service NATS users of `deploy/nats/auth.conf` against a real
//! nats-server: each service can do its job and is refused outside its
//! subjects; and a service connects with the credentials of its config and
//! fails with a clear error without them.

use std::time::Duration;

use async_nats::{Client, ConnectOptions, Event, ServerError};
use futures::StreamExt;
use relay_config::{ConnectionsConfig, ExperimentConfig};
use relay_kit::connect::ConnectError;
use relay_kit::{connect_nats_with, Shutdown};
use relay_testkit::NatsServer;
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

const USERS: [&str; 7] = [
    "env-runner",
    "inference-server",
    "replay-buffer",
    "learner",
    "evaluator",
    "tracker",
    "operator",
];

fn password(user: &str) -> String {
    format!("pw-{user}")
}

/// The shipped auth.conf with the password variables it expects defined.
fn shipped_auth_conf() -> String {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../deploy/nats/auth.conf");
    let auth = std::fs::read_to_string(path).expect("read deploy/nats/auth.conf");
    let mut conf = String::new();
    for user in USERS {
        let var = format!(
            "RELAY_NATS_PASSWORD_{}",
            user.to_ascii_uppercase().replace('-', "_")
        );
        assert!(auth.contains(&format!("${var}")), "auth.conf lacks ${var}");
        conf.push_str(&format!("{var}: \"{}\"\n", password(user)));
    }
    conf.push_str(&auth);
    conf
}

/// A client of `user` and the server errors it receives (permission
/// violations arrive as asynchronous `-ERR` events).
async fn connect_as(server: &NatsServer, user: &str) -> (Client, UnboundedReceiver<String>) {
    let (tx, rx) = unbounded_channel();
    let client = ConnectOptions::with_user_and_password(user.into(), password(user))
        .event_callback(move |event| {
            let tx = tx.clone();
            async move {
                if let Event::ServerError(ServerError::Other(message)) = event {
                    let _ = tx.send(message);
                }
            }
        })
        .connect(server.url())
        .await
        .unwrap_or_else(|e| panic!("{user} connects: {e}"));
    (client, rx)
}

/// Waits for a permission violation naming `subject`.
async fn expect_violation(errors: &mut UnboundedReceiver<String>, kind: &str, subject: &str) {
    let wanted = format!("permissions violation for {kind} to \"{subject}\"");
    let found = tokio::time::timeout(Duration::from_secs(5), async {
        while let Some(message) = errors.recv().await {
            if message.to_ascii_lowercase().contains(&wanted) {
                return message;
            }
        }
        panic!("event stream ended");
    })
    .await
    .unwrap_or_else(|_| panic!("no server error {wanted:?}"));
    assert!(found.to_ascii_lowercase().contains(&wanted));
}

/// Publishes `probe` from `publisher` until `sub` receives it: async-nats'
/// `flush` only empties the socket, so this is how a test knows the server
/// has the subscription.
async fn until_delivered(publisher: &Client, subject: &str, sub: &mut async_nats::Subscriber) {
    for _ in 0..50 {
        publisher
            .publish(subject.to_string(), "probe".into())
            .await
            .unwrap();
        publisher.flush().await.unwrap();
        if let Ok(Some(msg)) = tokio::time::timeout(Duration::from_millis(100), sub.next()).await {
            assert_eq!(&msg.payload[..], b"probe");
            return;
        }
    }
    panic!("nothing delivered on {subject}");
}

async fn nothing_arrives(sub: &mut async_nats::Subscriber) {
    let got = tokio::time::timeout(Duration::from_millis(300), sub.next()).await;
    assert!(got.is_err(), "a refused message was delivered");
}

#[tokio::test]
async fn env_runner_inserts_but_cannot_publish_weights() {
    let server = NatsServer::start_with_config(&shipped_auth_conf()).expect("nats-server");
    let (replay, _) = connect_as(&server, "replay-buffer").await;
    let (runner, mut runner_errors) = connect_as(&server, "env-runner").await;
    let (inference, _) = connect_as(&server, "inference-server").await;

    // The replay-buffer answers inserts (queue group, as its micro endpoint does).
    let mut inserts = replay
        .queue_subscribe("relay.r.replay.insert", "q".into())
        .await
        .unwrap();
    let responder = replay.clone();
    tokio::spawn(async move {
        while let Some(msg) = inserts.next().await {
            if let Some(reply) = msg.reply {
                responder.publish(reply, "ack".into()).await.unwrap();
            }
        }
    });
    replay.flush().await.unwrap();
    let (learner, _) = connect_as(&server, "learner").await;
    let mut weights = inference.subscribe("relay.r.weights").await.unwrap();
    until_delivered(&learner, "relay.r.weights", &mut weights).await;

    let mut reply = None;
    for _ in 0..50 {
        match runner
            .request("relay.r.replay.insert", "fragment".into())
            .await
        {
            Ok(r) => {
                reply = Some(r);
                break;
            }
            // The responder's subscription may not have reached the server yet.
            Err(e) if e.kind() == async_nats::RequestErrorKind::NoResponders => {
                tokio::time::sleep(Duration::from_millis(100)).await
            }
            Err(e) => panic!("env-runner may request replay.insert: {e}"),
        }
    }
    assert_eq!(&reply.expect("insert answered").payload[..], b"ack");

    runner
        .publish("relay.r.weights", "forged".into())
        .await
        .unwrap();
    runner.flush().await.unwrap();
    expect_violation(&mut runner_errors, "publish", "relay.r.weights").await;
    nothing_arrives(&mut weights).await;

    // Nor may it listen to what is not its own.
    let _sub = runner.subscribe("relay.r.act").await.unwrap();
    runner.flush().await.unwrap();
    expect_violation(&mut runner_errors, "subscription", "relay.r.act").await;
}

#[tokio::test]
async fn tracker_cannot_publish_act_but_receives_metrics() {
    let server = NatsServer::start_with_config(&shipped_auth_conf()).expect("nats-server");
    let (tracker, mut tracker_errors) = connect_as(&server, "tracker").await;
    let (inference, _) = connect_as(&server, "inference-server").await;
    let (learner, _) = connect_as(&server, "learner").await;
    let (runner, _) = connect_as(&server, "env-runner").await;

    let mut act = inference.subscribe("relay.r.act").await.unwrap();
    until_delivered(&runner, "relay.r.act", &mut act).await;
    // The tracker receives what every service reports.
    let mut metrics = tracker.subscribe("relay.r.metrics").await.unwrap();
    until_delivered(&learner, "relay.r.metrics", &mut metrics).await;

    tracker.publish("relay.r.act", "obs".into()).await.unwrap();
    tracker.flush().await.unwrap();
    expect_violation(&mut tracker_errors, "publish", "relay.r.act").await;
    nothing_arrives(&mut act).await;
}

#[tokio::test]
async fn micro_services_answer_srv_ping_with_their_user() {
    use async_nats::service::ServiceExt;
    let server = NatsServer::start_with_config(&shipped_auth_conf()).expect("nats-server");
    let (learner, mut learner_errors) = connect_as(&server, "learner").await;
    let (operator, _) = connect_as(&server, "operator").await;
    let _service = learner
        .service_builder()
        .start("relay-learner", "0.1.0")
        .await
        .unwrap();
    let mut answer = None;
    for _ in 0..50 {
        match operator.request("$SRV.PING.relay-learner", "".into()).await {
            Ok(r) => {
                answer = Some(r);
                break;
            }
            Err(e) if e.kind() == async_nats::RequestErrorKind::NoResponders => {
                tokio::time::sleep(Duration::from_millis(100)).await
            }
            Err(e) => panic!("operator may ping micro services: {e}"),
        }
    }
    let reply = answer.expect("ping answered");
    assert!(
        String::from_utf8_lossy(&reply.payload).contains("relay-learner"),
        "{reply:?}"
    );
    assert!(
        learner_errors.try_recv().is_err(),
        "the learner hit a permission error"
    );
}

fn connections(server: &NatsServer, overrides: &[&str]) -> ConnectionsConfig {
    let base = "run:\n  env_id: CartPole-v1\nppo:\n  rollout_steps: 256\n";
    let mut sets = vec![format!("connections.nats_url={}", server.url())];
    sets.extend(overrides.iter().map(|s| s.to_string()));
    ExperimentConfig::from_layers(base, "test", &[], &sets)
        .expect("valid config")
        .connections
}

async fn connect(c: &ConnectionsConfig) -> Result<Client, ConnectError> {
    let (_trigger, shutdown) = Shutdown::new();
    tokio::time::timeout(
        Duration::from_secs(10),
        connect_nats_with(c, "test", &shutdown),
    )
    .await
    .expect("connect_nats_with returns instead of retrying forever")
}

#[tokio::test]
async fn a_service_connects_with_the_password_of_its_config() {
    let server = NatsServer::start_with_config(&shipped_auth_conf()).expect("nats-server");
    let good = connections(
        &server,
        &[
            "connections.nats_user=env-runner",
            "connections.nats_password=pw-env-runner",
        ],
    );
    let client = connect(&good)
        .await
        .expect("connects with user and password");
    client
        .publish("relay.r.episodes", "x".into())
        .await
        .unwrap();
    client.flush().await.unwrap();

    let err = connect(&connections(&server, &[])).await.unwrap_err();
    let text = err.to_string();
    assert!(matches!(err, ConnectError::NatsAuth { .. }), "{text}");
    assert!(
        text.contains("refused") && text.contains("nats_password"),
        "{text}"
    );

    let wrong = connections(
        &server,
        &[
            "connections.nats_user=env-runner",
            "connections.nats_password=not-it",
        ],
    );
    let err = connect(&wrong).await.unwrap_err();
    assert!(matches!(err, ConnectError::NatsAuth { .. }), "{err}");
    assert!(!err.to_string().contains("not-it"), "{err}");
}

#[tokio::test]
async fn a_service_connects_with_a_token() {
    let server =
        NatsServer::start_with_config("authorization { token: \"t0ken-123\" }\n").expect("nats");
    let good = connections(&server, &["connections.nats_token=t0ken-123"]);
    connect(&good).await.expect("connects with the token");
    let err = connect(&connections(&server, &["connections.nats_token=nope"]))
        .await
        .unwrap_err();
    assert!(matches!(err, ConnectError::NatsAuth { .. }), "{err}");
}

/// Requests `subject` until a responder answers (its subscription may not
/// have reached the server yet).
async fn request_answered(client: &Client, subject: &str) -> async_nats::Message {
    for _ in 0..50 {
        match client.request(subject.to_string(), "req".into()).await {
            Ok(reply) => return reply,
            Err(e) if e.kind() == async_nats::RequestErrorKind::NoResponders => {
                tokio::time::sleep(Duration::from_millis(100)).await
            }
            Err(e) => panic!("request on {subject}: {e}"),
        }
    }
    panic!("no responder on {subject}");
}

/// Answers every request on `subject` (queue group) with `answer`.
async fn respond(client: &Client, subject: &str, answer: &'static str) {
    let mut requests = client
        .queue_subscribe(subject.to_string(), "q".into())
        .await
        .unwrap();
    let responder = client.clone();
    tokio::spawn(async move {
        while let Some(msg) = requests.next().await {
            if let Some(reply) = msg.reply {
                responder.publish(reply, answer.into()).await.unwrap();
            }
        }
    });
    client.flush().await.unwrap();
}

#[tokio::test]
async fn text_runs_generate_replay_games_and_ship_adapters_through_the_object_store() {
    use async_nats::jetstream;
    let server = NatsServer::start_with_config(&shipped_auth_conf()).expect("nats-server");
    let (runner, mut runner_errors) = connect_as(&server, "env-runner").await;
    let (inference, mut inference_errors) = connect_as(&server, "inference-server").await;
    let (replay, mut replay_errors) = connect_as(&server, "replay-buffer").await;
    let (learner, mut learner_errors) = connect_as(&server, "learner").await;
    let (evaluator, mut evaluator_errors) = connect_as(&server, "evaluator").await;
    let (operator, _) = connect_as(&server, "operator").await;

    // Moves: env-runners and evaluators ask the inference servers.
    respond(&inference, "relay.r.generate", "move").await;
    for client in [&runner, &evaluator] {
        assert_eq!(
            &request_answered(client, "relay.r.generate").await.payload[..],
            b"move"
        );
    }
    // Games: env-runners publish, the replay-buffer stores, the learner samples.
    let mut games = replay
        .queue_subscribe("relay.r.games", "replay-buffer".into())
        .await
        .unwrap();
    until_delivered(&runner, "relay.r.games", &mut games).await;
    respond(&replay, "relay.r.replay.games.sample", "games").await;
    assert_eq!(
        &request_answered(&learner, "relay.r.replay.games.sample")
            .await
            .payload[..],
        b"games"
    );
    // Adapters: the learner publishes versions and answers `adapters.latest`.
    let mut adapters = inference.subscribe("relay.r.adapters").await.unwrap();
    let mut evaluator_adapters = evaluator.subscribe("relay.r.adapters").await.unwrap();
    until_delivered(&learner, "relay.r.adapters", &mut adapters).await;
    until_delivered(&learner, "relay.r.adapters", &mut evaluator_adapters).await;
    respond(&learner, "relay.r.adapters.latest", "v3").await;
    for client in [&inference, &evaluator] {
        assert_eq!(
            &request_answered(client, "relay.r.adapters.latest")
                .await
                .payload[..],
            b"v3"
        );
    }
    // Big adapters: the learner writes the object store, inference servers read it.
    let store = jetstream::new(learner.clone())
        .create_object_store(jetstream::object_store::Config {
            bucket: "relay-r-adapters".into(),
            ..Default::default()
        })
        .await
        .expect("the learner creates the adapter bucket");
    let bytes = vec![7u8; 300_000];
    store
        .put("policy/3/adapter_model.safetensors", &mut bytes.as_slice())
        .await
        .expect("the learner writes an adapter");
    let mut object = jetstream::new(inference.clone())
        .get_object_store("relay-r-adapters")
        .await
        .expect("inference servers open the bucket")
        .get("policy/3/adapter_model.safetensors")
        .await
        .expect("inference servers read the adapter");
    let mut read = Vec::new();
    tokio::io::AsyncReadExt::read_to_end(&mut object, &mut read)
        .await
        .unwrap();
    assert_eq!(read, bytes);
    // The operator switches evaluators.
    let mut control = evaluator.subscribe("relay.r.eval.control").await.unwrap();
    until_delivered(&operator, "relay.r.eval.control", &mut control).await;
    // The tracker reads the games, training and evaluation, for games.jsonl.
    let (tracker, mut tracker_errors) = connect_as(&server, "tracker").await;
    let mut tracked = tracker.subscribe("relay.r.games").await.unwrap();
    until_delivered(&runner, "relay.r.games", &mut tracked).await;
    let mut eval_games = tracker.subscribe("relay.r.eval.games").await.unwrap();
    until_delivered(&evaluator, "relay.r.eval.games", &mut eval_games).await;

    for (name, errors) in [
        ("env-runner", &mut runner_errors),
        ("inference-server", &mut inference_errors),
        ("replay-buffer", &mut replay_errors),
        ("learner", &mut learner_errors),
        ("evaluator", &mut evaluator_errors),
        ("tracker", &mut tracker_errors),
    ] {
        assert!(errors.try_recv().is_err(), "{name} hit a permission error");
    }
    // Only the learner publishes adapters.
    runner
        .publish("relay.r.adapters", "forged".into())
        .await
        .unwrap();
    runner.flush().await.unwrap();
    expect_violation(&mut runner_errors, "publish", "relay.r.adapters").await;
    // (Probes of `until_delivered` may still be queued; the forgery is not.)
    let forged = tokio::time::timeout(Duration::from_millis(300), async {
        while let Some(msg) = adapters.next().await {
            if &msg.payload[..] == b"forged" {
                return;
            }
        }
    })
    .await;
    assert!(forged.is_err(), "a forged adapter was delivered");
}
