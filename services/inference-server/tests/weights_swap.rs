//! The inference server answers every request while new weights versions
//! arrive, always with the newest version it has, never going back; two
//! copies share the act subject through the queue group.

use std::time::Duration;

use futures::StreamExt;
use relay_config::ExperimentConfig;
use relay_kit::{ServiceConfig, Shutdown};
use relay_nn::ActorCritic;
use relay_proto::{encode, ActReply, ActRequest, Subjects, Tensor, WeightsUpdate};
use relay_testkit::NatsServer;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn swaps_weights_without_dropping_requests() {
    let nats = NatsServer::start().unwrap();
    let text = format!(
        "run:\n  id: swap\n  env_id: CartPole-v1\nconnections:\n  nats_url: {}\n  request_timeout_ms: 2000\n",
        nats.url()
    );
    let experiment = ExperimentConfig::from_layers(&text, "test", &[], &[]).unwrap();
    let spec = relay_policy::spec_for(&experiment).unwrap();
    let model = ActorCritic::new(&spec, 3).unwrap();
    let s = Subjects::new("swap");
    let client = async_nats::connect(nats.url()).await.unwrap();

    // Stand in for the learner: serve the latest weights, publish new versions.
    let latest = std::sync::Arc::new(std::sync::Mutex::new(
        relay_policy::PolicyWeights::of(&model, 0, 0).inline_update(),
    ));
    let mut latest_requests = client.subscribe(s.weights_latest()).await.unwrap();
    {
        let (client, latest) = (client.clone(), latest.clone());
        tokio::spawn(async move {
            while let Some(m) = latest_requests.next().await {
                let payload = encode(&*latest.lock().unwrap());
                let _ = client.publish(m.reply.unwrap(), payload.into()).await;
            }
        });
    }

    let (trigger, shutdown) = Shutdown::new();
    let servers: Vec<_> = (0..2)
        .map(|_| {
            tokio::spawn(relay_inference_server::run(
                ServiceConfig::for_test(experiment.clone()),
                shutdown.clone(),
            ))
        })
        .collect();

    let request = ActRequest::new(Tensor::from_f32(&[3, 4], &[0.01; 12]), false);
    let mut answered = 0;
    let mut last_seen = 0u64;
    let mut next_version = 1u64;
    for i in 0..600 {
        if i % 60 == 59 && next_version <= 8 {
            let update: WeightsUpdate =
                relay_policy::PolicyWeights::of(&model, next_version, 0).inline_update();
            *latest.lock().unwrap() = update.clone();
            client
                .publish(s.weights(), encode(&update).into())
                .await
                .unwrap();
            next_version += 1;
        }
        let reply: Result<ActReply, _> =
            relay_kit::request(&client, &s.act(), &request, Duration::from_secs(2)).await;
        match reply {
            Ok(reply) => {
                answered += 1;
                assert_eq!(reply.actions.shape, vec![3]);
                last_seen = last_seen.max(reply.policy_version);
            }
            // Only before the servers are up (no responders, no weights yet).
            Err(e) => {
                assert_eq!(answered, 0, "request {i} failed after service started: {e}");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    }
    assert!(answered > 500, "answered {answered}");
    assert_eq!(last_seen, 8, "servers reached the newest version");
    // Both copies, once caught up, answer with version 8 only.
    for _ in 0..20 {
        let reply: ActReply =
            relay_kit::request(&client, &s.act(), &request, Duration::from_secs(2))
                .await
                .unwrap();
        assert_eq!(reply.policy_version, 8);
    }
    trigger.trigger();
    for server in servers {
        tokio::time::timeout(Duration::from_secs(10), server)
            .await
            .unwrap()
            .unwrap()
            .unwrap();
    }
}

/// Each published version's transfer is measured: from the learner's
/// publish stamp to the version held ready, and the bytes received.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn weight_transfers_are_measured() {
    let nats = NatsServer::start().unwrap();
    let text = format!(
        "run:\n  id: transfer\n  env_id: CartPole-v1\nconnections:\n  nats_url: {}\n  request_timeout_ms: 2000\n",
        nats.url()
    );
    let experiment = ExperimentConfig::from_layers(&text, "test", &[], &[]).unwrap();
    let model = ActorCritic::new(&relay_policy::spec_for(&experiment).unwrap(), 3).unwrap();
    let s = Subjects::new("transfer");
    let client = async_nats::connect(nats.url()).await.unwrap();
    let mut config = ServiceConfig::for_test(experiment);
    let metrics_addr: std::net::SocketAddr = ([127, 0, 0, 1], relay_testkit::free_port()).into();
    config.metrics_addr = metrics_addr;
    let (trigger, shutdown) = Shutdown::new();
    let server = tokio::spawn(relay_inference_server::run(config, shutdown));
    let metric = |name: &str| -> f64 {
        let Ok((_, body)) = relay_testkit::http_get(metrics_addr, "/metrics") else {
            return 0.0;
        };
        body.lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.rsplit(' ').next())
            .map_or(0.0, |v| v.parse().unwrap())
    };
    // Published (stamped, as the learner does) until the server has taken some.
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let mut version = 1;
    let mut bytes = 0;
    while metric("relay_weights_transfer_seconds_count") < 2.0 {
        assert!(std::time::Instant::now() < deadline, "no transfer measured");
        let mut update = relay_policy::PolicyWeights::of(&model, version, 0).inline_update();
        update.published_unix_ms = relay_proto::unix_ms();
        bytes = update.weights.size;
        let payload = encode(&update);
        client.publish(s.weights(), payload.into()).await.unwrap();
        version += 1;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(metric("relay_weights_received_bytes_total") >= 2.0 * bytes as f64);
    // Same machine: well under a second each.
    let sum = metric("relay_weights_transfer_seconds_sum");
    assert!((0.0..2.0).contains(&sum), "{sum}");
    trigger.trigger();
    tokio::time::timeout(Duration::from_secs(10), server)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
}

/// Before the learner's first version, `weights.latest` answers 503 ("no
/// version published yet", as the learner does): a server started then
/// takes it as "not yet", asks again until there is a version, and serves
/// it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_started_before_the_first_version_asks_until_there_is_one() {
    use async_nats::service::ServiceExt;
    use std::sync::atomic::{AtomicUsize, Ordering};

    let nats = NatsServer::start().unwrap();
    let text = format!(
        "run:\n  id: early\n  env_id: CartPole-v1\nconnections:\n  nats_url: {}\n  request_timeout_ms: 2000\n",
        nats.url()
    );
    let experiment = ExperimentConfig::from_layers(&text, "test", &[], &[]).unwrap();
    let model = ActorCritic::new(&relay_policy::spec_for(&experiment).unwrap(), 3).unwrap();
    let s = Subjects::new("early");
    let client = async_nats::connect(nats.url()).await.unwrap();

    // Stand in for the learner: no version for the first asks.
    const NOT_YET: usize = 3;
    let micro = client
        .service_builder()
        .start("relay-learner", "0.0.0")
        .await
        .unwrap();
    let mut latest_requests = micro.endpoint(s.weights_latest()).await.unwrap();
    let asked = std::sync::Arc::new(AtomicUsize::new(0));
    {
        let asked = asked.clone();
        let update = relay_policy::PolicyWeights::of(&model, 5, 0).inline_update();
        tokio::spawn(async move {
            while let Some(request) = latest_requests.next().await {
                let answer = if asked.fetch_add(1, Ordering::SeqCst) < NOT_YET {
                    Err(async_nats::service::error::Error {
                        status: "no version published yet".into(),
                        code: 503,
                    })
                } else {
                    Ok(encode(&update).into())
                };
                let _ = request.respond(answer).await;
            }
        });
    }

    let (trigger, shutdown) = Shutdown::new();
    let server = tokio::spawn(relay_inference_server::run(
        ServiceConfig::for_test(experiment),
        shutdown,
    ));
    let request = ActRequest::new(Tensor::from_f32(&[1, 4], &[0.01; 4]), false);
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let reply: ActReply = loop {
        match relay_kit::request(&client, &s.act(), &request, Duration::from_secs(2)).await {
            Ok(reply) => break reply,
            Err(e) => {
                assert!(std::time::Instant::now() < deadline, "never served: {e}");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    };
    assert_eq!(reply.policy_version, 5);
    assert!(
        asked.load(Ordering::SeqCst) > NOT_YET,
        "asked again after 503"
    );
    trigger.trigger();
    tokio::time::timeout(Duration::from_secs(10), server)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
}
