//! The tracker against a real nats-server: reports published on the run's
//! subjects end up in `metrics.jsonl` and `metrics.csv` (the same rows),
//! the run registry follows the run's status, and the learning curves are
//! drawn at shutdown.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use relay_config::ExperimentConfig;
use relay_kit::{ServiceConfig, Shutdown};
use relay_proto::*;
use relay_runs::registry::RunRegistry;
use relay_testkit::{free_port, http_get, NatsServer, TempDir};
use relay_tracker::csv::{split_line, HEADER};

const RUN: &str = "tracker-files";

fn report(
    service: &str,
    instance: &str,
    vec_steps: Option<u64>,
    values: &[(&str, f64)],
) -> MetricsReport {
    MetricsReport {
        schema: SCHEMA_VERSION,
        service: service.into(),
        instance: instance.into(),
        vec_steps,
        values: values
            .iter()
            .map(|(name, value)| MetricValue {
                name: name.to_string(),
                kind: if name.ends_with("_total") {
                    MetricKind::Counter
                } else {
                    MetricKind::Gauge
                },
                value: *value,
                labels: Default::default(),
            })
            .collect(),
    }
}

fn status(status: RunStatus, service: &str) -> RunStatusUpdate {
    RunStatusUpdate {
        schema: SCHEMA_VERSION,
        status,
        service: service.into(),
        policy_version: 4,
        detail: format!("from {service}"),
    }
}

async fn wait_until(what: &str, mut check: impl FnMut() -> bool) {
    for _ in 0..400 {
        if check() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("timed out waiting for {what}");
}

fn lines(path: &Path) -> Vec<String> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .map(String::from)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tracker_writes_csv_registry_and_plots() {
    let nats = NatsServer::start().unwrap();
    let tmp = TempDir::new("tracker-files");
    let runs = tmp.path().join("runs");
    let text = format!(
        "run:\n  id: {RUN}\n  env_id: CartPole-v1\n  runs_dir: {}\nconnections:\n  nats_url: {}\nppo:\n  rollout_steps: 256\ntracker:\n  flush_ms: 20\n",
        runs.display(),
        nats.url()
    );
    let experiment = ExperimentConfig::from_layers(&text, "test", &[], &[]).unwrap();
    let addr: SocketAddr = ([127, 0, 0, 1], free_port()).into();
    let mut config = ServiceConfig::for_test(experiment);
    config.metrics_addr = addr;
    let (trigger, shutdown) = Shutdown::new();
    let tracker = tokio::spawn(relay_tracker::run(config, shutdown));
    wait_until("tracker healthy", || {
        http_get(addr, "/healthz").is_ok_and(|(s, _)| s == 200)
    })
    .await;

    let registry = RunRegistry::new(&runs);
    let record = registry.get(RUN).unwrap().expect("registered on start");
    assert_eq!(record.status, RunStatus::Running);
    assert_eq!(record.config_id, "cartpole-ppo");

    let client = async_nats::connect(nats.url()).await.unwrap();
    let s = Subjects::new(RUN);
    let publish = |subject: String, payload: Vec<u8>| {
        let client = client.clone();
        async move { client.publish(subject, payload.into()).await.unwrap() }
    };
    let mut published = 0;
    for v in 1..=12u64 {
        let runner = report(
            "env-runner",
            "runner,\"one\"",
            Some(v * 32),
            &[
                ("env_steps_total", 256.0),
                ("vec_steps_total", 32.0),
                ("env_runner_sps", 1000.0 + v as f64),
                ("env_runner_episode_return_mean", 10.0 * v as f64),
            ],
        );
        let learner = report(
            "learner",
            "learner-1",
            Some(v * 32),
            &[
                ("learner_policy_version", v as f64),
                ("learner_env_steps", (v * 256) as f64),
                ("learner_sps", 2000.0 + 0.5 * v as f64),
                ("learner_policy_loss", -0.01 / v as f64),
                ("learner_value_loss", 30.0 / v as f64),
                ("learner_entropy", 0.69 - 0.01 * v as f64),
            ],
        );
        publish(s.metrics(), encode(&runner)).await;
        publish(s.metrics(), encode(&learner)).await;
        published += 2;
        if v % 4 == 0 {
            let eval = EvalReport {
                schema: SCHEMA_VERSION,
                evaluator: "greedy".into(),
                instance: "evaluator-1".into(),
                env_id: "CartPole-v1".into(),
                policy_version: v,
                learner_env_steps: v * 256,
                returns: vec![40.0 * v as f64],
                mean_return: 40.0 * v as f64,
                std_return: 5.0,
                threshold: 475.0,
                solved: v == 12,
                matchups: Vec::new(),
                confirmation: None,
            };
            publish(s.eval(), encode(&eval)).await;
        }
    }
    // A report without vec_steps.
    publish(
        s.metrics(),
        encode(&report(
            "replay-buffer",
            "rb-1",
            None,
            &[("replay_size_steps", 512.0)],
        )),
    )
    .await;
    published += 1;
    client.flush().await.unwrap();
    let run_dir = runs.join(RUN);
    wait_until("every metrics line", || {
        lines(&run_dir.join("metrics.jsonl")).len() == published
    })
    .await;

    // The evaluator's solved, then the learner's stopped: the run stays solved.
    publish(s.status(), encode(&status(RunStatus::Solved, "evaluator"))).await;
    client.flush().await.unwrap();
    wait_until("solved in the registry", || {
        registry.get(RUN).unwrap().unwrap().status == RunStatus::Solved
    })
    .await;
    publish(s.status(), encode(&status(RunStatus::Stopped, "learner"))).await;
    client.flush().await.unwrap();
    let status_json = || -> serde_json::Value {
        std::fs::read(run_dir.join("status.json"))
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok())
            .unwrap_or_default()
    };
    wait_until("the learner's update in status.json", || {
        status_json()["last_update"]["service"] == "learner"
    })
    .await;
    assert_eq!(status_json()["status"], "solved", "{}", status_json());
    assert_eq!(status_json()["last_update"]["status"], "stopped");

    trigger.trigger();
    tokio::time::timeout(Duration::from_secs(30), tracker)
        .await
        .expect("tracker stops")
        .unwrap()
        .unwrap();

    let record = registry.get(RUN).unwrap().unwrap();
    assert_eq!(record.status, RunStatus::Solved, "{record:?}");

    // metrics.csv holds exactly the rows of metrics.jsonl.
    let csv = lines(&run_dir.join("metrics.csv"));
    assert_eq!(csv[0], HEADER);
    let mut from_csv: BTreeMap<(String, String, String, String, String), f64> = BTreeMap::new();
    for line in &csv[1..] {
        let f = split_line(line);
        assert_eq!(f.len(), 6, "{line}");
        let key = (
            f[0].clone(),
            f[1].clone(),
            f[2].clone(),
            f[3].clone(),
            f[4].clone(),
        );
        assert!(
            from_csv.insert(key, f[5].parse().unwrap()).is_none(),
            "duplicate {line}"
        );
    }
    let mut from_jsonl = BTreeMap::new();
    for line in lines(&run_dir.join("metrics.jsonl")) {
        let v: serde_json::Value = serde_json::from_str(&line).unwrap();
        let vec_steps = v["vec_steps"]
            .as_u64()
            .map(|s| s.to_string())
            .unwrap_or_default();
        for (name, value) in v["values"].as_object().unwrap() {
            from_jsonl.insert(
                (
                    v["time"].as_str().unwrap().to_string(),
                    v["service"].as_str().unwrap().to_string(),
                    v["instance"].as_str().unwrap().to_string(),
                    vec_steps.clone(),
                    name.clone(),
                ),
                value.as_f64().unwrap(),
            );
        }
    }
    assert_eq!(from_csv.len(), 12 * 4 + 12 * 6 + 1);
    assert_eq!(
        from_csv.keys().collect::<Vec<_>>(),
        from_jsonl.keys().collect::<Vec<_>>()
    );
    for (key, csv_value) in &from_csv {
        // serde_json's default float parser may be one ulp off; the CSV text is exact.
        let json_value = from_jsonl[key];
        assert!(
            (csv_value - json_value).abs() <= 1e-12 * json_value.abs().max(1.0),
            "{key:?}: csv {csv_value} jsonl {json_value}"
        );
    }
    assert!(csv.iter().any(|l| l.contains(",\"runner,\"\"one\"\"\",")));

    // The learning curves were drawn at shutdown.
    for name in ["return", "losses", "sps"] {
        let bytes = std::fs::read(run_dir.join("plots").join(format!("{name}.png"))).unwrap();
        assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n", "{name}.png");
        assert!(bytes.len() > 5_000, "{name}.png is {} bytes", bytes.len());
    }
}
