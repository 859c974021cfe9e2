//! `relay top` headless: real messages over a real nats-server reach a
//! [`TopState`] through the command's own subscriptions ([`Feed`]), and the
//! screen drawn on a ratatui `TestBackend` shows them. Health probes go to
//! real (tiny) HTTP endpoints listed in a stack record.

use std::io::{Read, Write};
use std::net::TcpListener;
use std::time::{Duration, Instant};

use crossterm::event::{KeyCode, KeyEvent, KeyEventKind, KeyModifiers};
use ratatui::backend::TestBackend;
use ratatui::Terminal;
use relay::stack::{ProcessRecord, StackRecord};
use relay::top::{
    draw, key_action, probe_state_dir, resolve_target, Action, CopyState, Feed, Health, TopArgs,
    TopState,
};
use relay_proto::*;
use relay_testkit::{free_port, NatsServer, TempDir};

const RUN: &str = "top-test-run";

fn metrics(service: &str, instance: &str, values: &[(&str, f64)]) -> MetricsReport {
    MetricsReport {
        schema: SCHEMA_VERSION,
        service: service.into(),
        instance: instance.into(),
        vec_steps: None,
        values: values
            .iter()
            .map(|(name, value)| MetricValue {
                name: name.to_string(),
                kind: MetricKind::Gauge,
                value: *value,
                labels: Default::default(),
            })
            .collect(),
    }
}

fn eval(mean: f64, version: u64, steps: u64) -> EvalReport {
    EvalReport {
        schema: SCHEMA_VERSION,
        evaluator: "greedy".into(),
        instance: "evaluator-0".into(),
        env_id: "CartPole-v1".into(),
        policy_version: version,
        learner_env_steps: steps,
        returns: vec![mean; 4],
        mean_return: mean,
        std_return: 12.25,
        threshold: 475.0,
        solved: false,
        matchups: Vec::new(),
        confirmation: None,
    }
}

fn alert(name: &str, metric: &str, active: bool) -> AlertEvent {
    AlertEvent {
        schema: SCHEMA_VERSION,
        alert: name.into(),
        metric: metric.into(),
        active,
        value: 0.0123,
        vec_steps: Some(3072),
        message: format!("{metric} looks wrong"),
    }
}

/// The screen as lines of text.
fn render(state: &TopState) -> Vec<String> {
    let mut terminal = Terminal::new(TestBackend::new(120, 40)).expect("test terminal");
    terminal.draw(|f| draw(f, state)).expect("draw");
    let buffer = terminal.backend().buffer();
    buffer
        .content
        .chunks(usize::from(buffer.area.width))
        .map(|row| row.iter().map(|c| c.symbol()).collect())
        .collect()
}

/// The cells of the services table row of `service` (the panel cell that
/// starts with the name and then a number), split on whitespace.
fn service_row(screen: &[String], service: &str) -> Option<Vec<String>> {
    screen.iter().find_map(|line| {
        line.split('│').find_map(|cell| {
            let tokens: Vec<String> = cell.split_whitespace().map(String::from).collect();
            (tokens.len() >= 3 && tokens[0] == service && tokens[1].parse::<u32>().is_ok())
                .then_some(tokens)
        })
    })
}

fn line_with<'a>(screen: &'a [String], text: &str) -> &'a str {
    screen
        .iter()
        .find(|l| l.contains(text))
        .unwrap_or_else(|| panic!("no line with {text:?} on screen:\n{}", screen.join("\n")))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn top_shows_a_live_run_from_nats() {
    let nats = NatsServer::start().expect("nats-server");
    let watcher = async_nats::connect(nats.url()).await.expect("connect");
    let mut feed = Feed::subscribe(&watcher, RUN).await.expect("subscribe");
    // A round trip on the same connection: the server has our subscriptions
    // once it answers (here: "no responders").
    let ping = watcher.request("top-test.ping", "".into()).await;
    assert!(ping.is_err(), "nobody answers the ping subject");

    let services = async_nats::connect(nats.url()).await.expect("connect");
    let subjects = Subjects::new(RUN);
    let mut sent: Vec<(String, Vec<u8>)> = vec![
        // Garbage on a subject is ignored.
        (subjects.metrics(), b"not msgpack".to_vec()),
        (subjects.eval(), encode(&eval(95.0, 10, 5120))),
        (subjects.eval(), encode(&eval(187.5, 20, 10240))),
        (
            subjects.alerts(),
            encode(&alert("kl_spike", "learner_approx_kl", true)),
        ),
        (
            subjects.alerts(),
            encode(&alert("kl_spike", "learner_approx_kl", false)),
        ),
        (
            subjects.alerts(),
            encode(&alert("entropy_collapse", "learner_entropy", true)),
        ),
        (
            subjects.status(),
            encode(&RunStatusUpdate {
                schema: SCHEMA_VERSION,
                status: RunStatus::Running,
                service: "learner".into(),
                policy_version: 24,
                detail: String::new(),
            }),
        ),
    ];
    let reports = [
        metrics(
            "learner",
            "learner-0",
            &[
                ("learner_updates", 24.0),
                ("learner_policy_version", 24.0),
                ("learner_env_steps", 12288.0),
                ("learner_progress", 12288.0 / 100_000.0),
                ("learner_policy_loss", -0.0123),
                ("learner_value_loss", 45.6789),
                ("learner_entropy", 0.6543),
                ("learner_approx_kl", 0.00421),
                ("learner_clip_fraction", 0.137),
                ("learner_explained_variance", 0.812),
                ("learner_learning_rate", 3e-4),
                ("learner_policy_lag_max", 1.0),
            ],
        ),
        metrics(
            "replay-buffer",
            "replay-buffer-0",
            &[("replay_size_steps", 4096.0)],
        ),
        metrics(
            "env-runner",
            "env-runner-0",
            &[
                ("env_runner_sps", 2500.0),
                ("env_runner_episode_return_mean", 50.0),
            ],
        ),
        metrics(
            "env-runner",
            "env-runner-1",
            &[
                ("env_runner_sps", 2600.0),
                ("env_runner_episode_return_mean", 60.0),
            ],
        ),
        metrics(
            "inference-server",
            "inference-server-0",
            &[("inference_weights_version", 24.0)],
        ),
    ];
    sent.extend(reports.iter().map(|r| (subjects.metrics(), encode(r))));
    for (subject, payload) in sent {
        services
            .publish(subject, payload.into())
            .await
            .expect("publish");
    }
    services.flush().await.expect("flush");

    let mut state = TopState::new(RUN);
    let complete = feed
        .feed_for(&mut state, Duration::from_secs(10), |s| {
            s.env_steps() == Some(12288)
                && s.eval_history().count() == 2
                && s.active_alerts().any(|a| a.alert == "entropy_collapse")
                && s.status().is_some()
                && s.gauge("replay_size_steps").is_some()
                && s.gauge("inference_weights_version").is_some()
                && s.services()
                    .iter()
                    .any(|r| r.service == "env-runner" && r.copies.len() == 2)
        })
        .await;
    assert!(complete, "not every message arrived: {state:?}");
    assert_eq!(state.budget(), Some(100_000));
    state.tick(Instant::now());

    let screen = render(&state);
    let text = screen.join("\n");
    assert!(text.contains(RUN), "run id:\n{text}");
    assert!(text.contains("running (learner)"), "status:\n{text}");
    assert!(
        text.contains("12288 / 100000 env steps (12.3%)"),
        "progress:\n{text}"
    );
    assert!(line_with(&screen, "latest mean").contains("187.5"));
    assert!(line_with(&screen, "threshold").contains("475.0"));
    assert!(line_with(&screen, "best").contains("evals 2"));
    assert!(
        line_with(&screen, "evaluators:").contains("greedy evaluator-0 v20"),
        "active evaluators:\n{text}"
    );
    assert!(line_with(&screen, "policy loss").contains("-0.0123"));
    assert!(line_with(&screen, "value loss").contains("45.6789"));
    assert!(line_with(&screen, "approx kl").contains("0.00421"));
    assert!(line_with(&screen, "learning rate").contains("3.00e-4"));
    assert!(line_with(&screen, "replay size (steps)").contains("4096"));
    assert!(line_with(&screen, "policy lag (max)").contains(" 1"));
    assert!(line_with(&screen, "env-runner sps").contains("5100"));
    assert!(line_with(&screen, "train return (mean)").contains("55.0"));
    assert!(line_with(&screen, "inference weights").contains("24"));
    assert!(text.contains("alerts (1 active)"), "alerts:\n{text}");
    assert!(line_with(&screen, "entropy_collapse").contains("learner_entropy"));
    assert!(
        !text.contains("kl_spike"),
        "a cleared alert is gone:\n{text}"
    );

    for (service, copies) in [
        ("learner", "1"),
        ("replay-buffer", "1"),
        ("inference-server", "1"),
        ("env-runner", "2"),
    ] {
        let row = service_row(&screen, service)
            .unwrap_or_else(|| panic!("no row for {service}:\n{text}"));
        assert_eq!(row[1], copies, "{service} copies: {row:?}");
        assert_eq!(row[2], copies, "{service} up: {row:?}");
        assert_eq!(row[3], "ok", "{service} health: {row:?}");
    }
    // Services that send no metric reports are not guessed at.
    assert!(service_row(&screen, "tracker").is_none(), "{text}");
    assert!(text.contains("health: metric reports"), "{text}");
}

/// The league table appears once the run has a pool, best rating first.
#[test]
fn top_shows_the_league_leaderboard() {
    use relay_league::{FixedKind, FixedOpponent, MemberId, Outcome, PolicyVersion, Pool};
    let mut state = TopState::new(RUN);
    let screen = render(&state);
    assert!(
        !screen.iter().any(|l| l.contains("league (")),
        "{}",
        screen.join("\n")
    );

    let mut pool = Pool::new(Default::default()).unwrap();
    pool.add_fixed(FixedOpponent {
        name: "random".into(),
        kind: FixedKind::Random,
    })
    .unwrap();
    for version in [1, 2] {
        pool.add_version(PolicyVersion {
            version,
            parent: (version > 1).then_some(version - 1),
            weights_ref: String::new(),
        })
        .unwrap();
    }
    for _ in 0..5 {
        pool.record_result(
            &MemberId::Version(2),
            &MemberId::Fixed("random".into()),
            Outcome::Win,
        )
        .unwrap();
    }
    state.set_league(Some(&pool));
    let rows = state.league();
    assert_eq!(rows.len(), 3);
    assert_eq!(rows[0].player, "v2", "{rows:?}");
    assert_eq!(rows[0].games, 5);
    let screen = render(&state);
    line_with(&screen, "league (3 members, TrueSkill)");
    let v2 = line_with(&screen, "v2 ");
    assert!(v2.contains(&format!("{:.2}", rows[0].mu)), "{v2}");
}

#[test]
fn top_quits_on_q_esc_and_ctrl_c() {
    let press = |code, modifiers| KeyEvent::new(code, modifiers);
    assert_eq!(
        key_action(&press(KeyCode::Char('q'), KeyModifiers::NONE)),
        Some(Action::Quit)
    );
    assert_eq!(
        key_action(&press(KeyCode::Esc, KeyModifiers::NONE)),
        Some(Action::Quit)
    );
    assert_eq!(
        key_action(&press(KeyCode::Char('c'), KeyModifiers::CONTROL)),
        Some(Action::Quit)
    );
    assert_eq!(
        key_action(&press(KeyCode::Char('c'), KeyModifiers::NONE)),
        None
    );
    assert_eq!(
        key_action(&press(KeyCode::Char('x'), KeyModifiers::NONE)),
        None
    );
    assert_eq!(key_action(&press(KeyCode::Enter, KeyModifiers::NONE)), None);
    let mut release = press(KeyCode::Char('q'), KeyModifiers::NONE);
    release.kind = KeyEventKind::Release;
    assert_eq!(key_action(&release), None, "a release does not act twice");
}

#[test]
fn top_measures_sps_eta_and_forgets_silent_copies() {
    let t0 = Instant::now();
    let mut state = TopState::new(RUN);
    let learner = |steps: f64| {
        metrics(
            "learner",
            "learner-0",
            &[
                ("learner_env_steps", steps),
                ("learner_progress", steps / 100_000.0),
            ],
        )
    };
    state.on_metrics(&learner(1000.0), t0);
    state.on_metrics(&learner(5000.0), t0 + Duration::from_secs(2));
    assert_eq!(state.env_steps(), Some(5000));
    assert_eq!(state.budget(), Some(100_000));
    let sps = state.sps().expect("sps");
    assert!((sps - 2000.0).abs() < 1e-6, "{sps}");
    let eta = state.eta().expect("eta").as_secs_f64();
    assert!((eta - 47.5).abs() < 1e-6, "{eta}");

    // Silent for 5 s: still counted, no longer up.
    state.tick(t0 + Duration::from_secs(7));
    let rows = state.services();
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0].up(), 0);
    assert!(matches!(rows[0].copies[0].1, CopyState::Silent(d) if d == Duration::from_secs(5)));
    let screen = render(&state);
    assert!(line_with(&screen, "learner-0 silent").contains("silent 5s"));
    // Silent for longer than the SPS window: the learner is not stepping.
    state.tick(t0 + Duration::from_secs(13));
    assert_eq!(state.sps(), Some(0.0));
    assert_eq!(state.eta(), None);
    // Silent for longer than the copy window: forgotten.
    state.tick(t0 + Duration::from_secs(40));
    assert!(state.services().is_empty());

    // A learner that starts over restarts the SPS window.
    state.on_metrics(&learner(100.0), t0 + Duration::from_secs(41));
    state.on_metrics(&learner(1100.0), t0 + Duration::from_secs(42));
    assert!((state.sps().expect("sps") - 1000.0).abs() < 1e-6);
}

#[test]
fn top_lists_the_learner_replicas_by_rank() {
    let now = Instant::now();
    let mut state = TopState::new(RUN);
    let replica = |instance: &str, rank: f64, wait: f64| {
        metrics(
            "learner",
            instance,
            &[
                ("learner_replicas", 2.0),
                ("learner_replica_rank", rank),
                ("learner_replica_updates", 47.0),
                ("learner_allreduce_seconds", 0.47),
                ("learner_barrier_wait_seconds", wait),
            ],
        )
    };
    // One learner: no replica lines.
    state.on_metrics(
        &metrics("learner", "learner-0", &[("learner_replicas", 1.0)]),
        now,
    );
    assert!(state.learner_replicas().is_empty());
    state.on_metrics(&replica("learner-2", 0.0, 0.0), now);
    state.on_metrics(&replica("learner-1", 1.0, 0.08), now);
    let rows = state.learner_replicas();
    let ranks: Vec<(&str, u64)> = rows.iter().map(|r| (r.instance.as_str(), r.rank)).collect();
    assert_eq!(ranks, [("learner-2", 0), ("learner-1", 1)]);
    let screen = render(&state);
    let rank0 = line_with(&screen, "learner-2");
    assert!(
        rank0.contains("rank 0") && rank0.contains("step 47") && rank0.contains("reduce 0.47s"),
        "{rank0}"
    );
    assert!(line_with(&screen, "learner-1").contains("wait 0.08s"));
}

/// A tiny HTTP endpoint that answers every request with `status`.
fn http_endpoint(status: u16) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr");
    std::thread::spawn(move || {
        for mut stream in listener.incoming().flatten() {
            // Read the whole request head: closing with unread bytes would
            // reset the connection before the client reads the answer.
            let (mut request, mut chunk) = (Vec::new(), [0u8; 512]);
            while !request.windows(4).any(|w| w == b"\r\n\r\n") {
                match stream.read(&mut chunk) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => request.extend_from_slice(&chunk[..n]),
                }
            }
            let _ = write!(stream, "HTTP/1.0 {status} X\r\nContent-Length: 0\r\n\r\n");
        }
    });
    addr.to_string()
}

#[test]
fn top_probes_the_stack_record_for_health() {
    let dir = TempDir::new("top");
    let process = |name: &str, metrics_addr: Option<String>| ProcessRecord {
        name: name.into(),
        pid: 1,
        metrics_addr,
    };
    let record = StackRecord {
        run_id: RUN.into(),
        nats_url: "nats://127.0.0.1:4999".into(),
        redis_url: String::new(),
        prometheus_url: String::new(),
        processes: vec![
            process("nats-server", None),
            process("learner-0", Some(http_endpoint(200))),
            process("replay-buffer-0", Some(http_endpoint(503))),
            process("evaluator-0", Some(format!("127.0.0.1:{}", free_port()))),
        ],
    };
    let args = |run_id: Option<&str>, nats_url: Option<&str>| TopArgs {
        run: run_id.map(String::from),
        run_id: None,
        nats_url: nats_url.map(String::from),
        state_dir: dir.path().to_path_buf(),
        redis_url: None,
        runs_dir: dir.path().join("runs"),
    };
    assert!(
        resolve_target(&args(None, None)).is_err(),
        "no record, no run id"
    );
    let target = resolve_target(&args(Some("other-run"), None)).expect("explicit run");
    assert_eq!(target.nats_url, relay::top::DEFAULT_NATS_URL);

    std::fs::write(
        dir.path().join("stack.json"),
        serde_json::to_vec(&record).expect("json"),
    )
    .expect("write stack.json");
    for run_id in [None, Some("@last")] {
        let target = resolve_target(&args(run_id, None)).expect("from the record");
        assert_eq!(target.run_id, RUN);
        assert_eq!(target.nats_url, "nats://127.0.0.1:4999");
        // This record names no Redis: no league to read.
        assert_eq!(target.redis_url, None);
    }
    let target = resolve_target(&args(Some("other-run"), Some("nats://h:1"))).expect("flags");
    assert_eq!(
        (target.run_id.as_str(), target.nats_url.as_str()),
        ("other-run", "nats://h:1")
    );
    assert!(resolve_target(&args(Some("bad.run"), None)).is_err());

    assert_eq!(probe_state_dir(dir.path(), "other-run"), None);
    let health = probe_state_dir(dir.path(), RUN).expect("a record of this run");
    let found: Vec<(&str, &str, Health)> = health
        .iter()
        .map(|p| (p.name.as_str(), p.service.as_str(), p.health))
        .collect();
    assert_eq!(
        found,
        [
            ("learner-0", "learner", Health::Up),
            ("replay-buffer-0", "replay-buffer", Health::Unhealthy(503)),
            ("evaluator-0", "evaluator", Health::Down),
        ]
    );

    let mut state = TopState::new(RUN);
    state.set_health(Some(health));
    // A copy started by hand elsewhere shows up from its metric reports.
    let now = Instant::now();
    state.on_metrics(
        &metrics(
            "env-runner",
            "env-runner-remote",
            &[("env_runner_sps", 1.0)],
        ),
        now,
    );
    // The learner's process also reports: counted once.
    state.on_metrics(
        &metrics("learner", "learner-0", &[("learner_updates", 1.0)]),
        now,
    );
    let screen = render(&state);
    let text = screen.join("\n");
    let row = |s| service_row(&screen, s).unwrap_or_else(|| panic!("no {s} row:\n{text}"));
    assert_eq!(row("learner")[1..4], ["1", "1", "ok"]);
    assert_eq!(row("replay-buffer")[1..3], ["1", "0"]);
    assert!(line_with(&screen, "replay-buffer-0 http 503").contains("replay-buffer"));
    assert_eq!(row("evaluator")[1..3], ["1", "0"]);
    assert!(text.contains("evaluator-0 down"), "{text}");
    assert_eq!(row("env-runner")[1..4], ["1", "1", "ok"]);
    assert!(text.contains("/healthz of the stack record"), "{text}");
}
