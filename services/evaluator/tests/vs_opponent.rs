//! The `vs-opponent` evaluator plugin on a TicTacToe run against a real
//! nats-server: it evaluates at start (version 0; again once an inference
//! server answers, if none did), then each new adapter version the learner
//! announces, and reports win/draw/loss and the legal move rate per
//! opponent and seat; after each report it publishes the games it played
//! (`EvalGame`, for the tracker's `games.jsonl`).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use relay_config::ExperimentConfig;
use relay_kit::{ServiceConfig, Shutdown};
use relay_proto::{
    decode, encode, AdapterRef, AdapterUpdate, EvalControl, EvalGame, EvalReport, FinishReason,
    GenerateReply, GenerateRequest, Prompt, Subjects, Tensor, SCHEMA_VERSION,
};
use relay_testkit::{free_port, http_get, NatsServer};

/// A stand-in for the inference server's `generate` endpoint (written in
/// parallel elsewhere): it answers `GenerateRequest`s on the real NATS
/// subject `relay.<run>.generate` with a move from the prompt's "Available
/// Moves" line (every fourth answer an illegal one), made-up tokens and
/// log-probs, and the adapter version in `version`.
fn spawn_stand_in_inference_server(
    client: async_nats::Client,
    run_id: &str,
    version: Arc<AtomicU64>,
) -> Arc<AtomicUsize> {
    let subject = Subjects::new(run_id).generate();
    let served = Arc::new(AtomicUsize::new(0));
    let count = served.clone();
    tokio::spawn(async move {
        let mut requests = client.queue_subscribe(subject, "q".into()).await.unwrap();
        while let Some(message) = requests.next().await {
            let n = count.fetch_add(1, Ordering::SeqCst);
            let request: GenerateRequest = decode(&message.payload).expect("a valid request");
            let Prompt::Chat(turns) = &request.prompt else {
                panic!("chat prompts")
            };
            let moves: Vec<String> = turns
                .last()
                .unwrap()
                .content
                .lines()
                .rev()
                .find_map(|l| l.strip_prefix("Available Moves: "))
                .unwrap()
                .split(", ")
                .map(|m| m.trim_matches('\'').to_string())
                .collect();
            let text = if n % 4 == 3 {
                "no idea".to_string()
            } else {
                moves[n % moves.len()].clone()
            };
            let c = text.len();
            let reply = GenerateReply {
                schema: SCHEMA_VERSION,
                adapter: request.adapter.clone().map(|a| AdapterRef {
                    version: Some(version.load(Ordering::SeqCst)),
                    ..a
                }),
                prompt_tokens: Tensor::from_u32(&[3], &[1, 2, 3]),
                completion_tokens: Tensor::from_u32(&[c], &vec![9; c]),
                logprobs: Tensor::from_f32(&[c], &vec![-1.0; c]),
                text,
                finish: FinishReason::Stop,
                answer_start: None,
            };
            if let Some(to) = message.reply {
                let _ = client.publish(to, encode(&reply).into()).await;
            }
        }
    });
    served
}

async fn next_report(evals: &mut async_nats::Subscriber) -> EvalReport {
    let message = tokio::time::timeout(Duration::from_secs(60), evals.next())
        .await
        .expect("an eval report within 60 s")
        .unwrap();
    decode(&message.payload).expect("a valid EvalReport")
}

fn check_matchups(report: &EvalReport, games: u32) {
    assert_eq!(report.evaluator, "vs-opponent");
    assert_eq!(report.env_id, "TicTacToe-v0");
    let mut keys: Vec<(String, u8)> = report
        .matchups
        .iter()
        .map(|m| (m.opponent.clone(), m.seat))
        .collect();
    keys.sort();
    assert_eq!(
        keys,
        vec![
            ("minimax".to_string(), 0),
            ("minimax".to_string(), 1),
            ("random".to_string(), 0),
            ("random".to_string(), 1)
        ]
    );
    let mut finished = 0;
    for m in &report.matchups {
        assert_eq!(m.games + m.abandoned, games / 2, "{m:?}");
        assert_eq!(m.abandoned, 0, "{m:?}");
        assert_eq!(m.wins + m.draws + m.losses, m.games);
        assert!(m.moves > 0 && m.invalid_moves <= m.moves);
        if m.opponent == "minimax" {
            assert_eq!(m.wins, 0, "beat minimax: {m:?}");
        }
        finished += m.games;
    }
    // Every fourth answer is illegal somewhere.
    assert!(report.matchups.iter().any(|m| m.legal_move_rate() < 1.0));
    assert_eq!(report.returns.len(), finished as usize);
    let mean = report.returns.iter().sum::<f64>() / report.returns.len() as f64;
    assert!((report.mean_return - mean).abs() < 1e-12);
    let wins: u32 = report.matchups.iter().map(|m| m.wins).sum();
    let losses: u32 = report.matchups.iter().map(|m| m.losses).sum();
    assert_eq!(
        report.returns.iter().filter(|&&r| r > 0.0).count(),
        wins as usize
    );
    assert_eq!(
        report.returns.iter().filter(|&&r| r < 0.0).count(),
        losses as usize
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vs_opponent_reports_results_per_opponent_and_follows_adapter_versions() {
    let nats = NatsServer::start().unwrap();
    let client = async_nats::connect(nats.url()).await.unwrap();
    let s = Subjects::new("vs-opp");
    let mut evals = client.subscribe(s.eval()).await.unwrap();
    let mut eval_games = client.subscribe(s.eval_games()).await.unwrap();
    let version = Arc::new(AtomicU64::new(0));
    let yaml = format!(
        "run:\n  id: vs-opp\n  env_id: TicTacToe-v0\nconnections:\n  nats_url: {}\neval:\n  evaluator: vs-opponent\n  every_versions: 1\n  options: {{games: 6, opponents: 'random, minimax'}}\ntext:\n  games_in_flight: 4\n  generate_timeout_ms: 5000\n",
        nats.url()
    );
    let experiment = ExperimentConfig::from_layers(&yaml, "test", &[], &[]).unwrap();
    let addr: SocketAddr = ([127, 0, 0, 1], free_port()).into();
    let mut config = ServiceConfig::for_test(experiment);
    config.metrics_addr = addr;
    let (trigger, shutdown) = Shutdown::new();
    let evaluator = tokio::spawn(relay_evaluator::run(config, shutdown));

    // Nothing is evaluated before the learner's first version is known.
    let update = |version: u64, learner_env_steps: u64| AdapterUpdate {
        schema: SCHEMA_VERSION,
        name: "policy".into(),
        version,
        learner_env_steps,
        config_json: "{}".into(),
        weights: relay_proto::WeightsBlob::inline(vec![0; 8]),
        published_unix_ms: 0,
    };
    let mut started = client.subscribe(s.eval_started()).await.unwrap();
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(
        tokio::time::timeout(Duration::from_millis(100), started.next())
            .await
            .is_err(),
        "an evaluation started before any adapter version"
    );
    client
        .publish(s.adapters(), encode(&update(0, 0)).into())
        .await
        .unwrap();

    // No inference server at first: the games of the first evaluation are
    // abandoned, and it is tried again once one answers.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let served = spawn_stand_in_inference_server(client.clone(), "vs-opp", version.clone());

    // The learner's first version.
    let first = next_report(&mut evals).await;
    check_matchups(&first, 6);
    assert_eq!(first.policy_version, 0);
    assert!(served.load(Ordering::SeqCst) > 0);
    // Its games follow the report, one message each (the abandoned first
    // try published none), named by the matchups' opponents.
    let mut by_opponent: std::collections::BTreeMap<String, u32> = Default::default();
    for _ in 0..first.returns.len() {
        let message = tokio::time::timeout(Duration::from_secs(10), eval_games.next())
            .await
            .expect("the evaluation's games")
            .unwrap();
        let game: EvalGame = decode(&message.payload).expect("a valid EvalGame");
        assert_eq!(game.evaluator, "vs-opponent");
        assert_eq!(game.policy_version, 0);
        assert!(!game.confirmation);
        let record = &game.game;
        let seat = record.learner_seat.expect("the learning seat") as usize;
        let model_moves: Vec<_> = record
            .turns
            .iter()
            .filter(|t| t.player as usize == seat)
            .collect();
        assert!(!model_moves.is_empty());
        assert!(model_moves
            .iter()
            .all(|t| !t.completion.is_empty() && !t.observation.is_empty()));
        *by_opponent.entry(game.opponent.clone()).or_default() += 1;
    }
    let reported = |opponent: &str| -> u32 {
        first
            .matchups
            .iter()
            .filter(|m| m.opponent == opponent)
            .map(|m| m.games)
            .sum()
    };
    assert_eq!(by_opponent.len(), 2, "{by_opponent:?}");
    for (opponent, games) in &by_opponent {
        assert_eq!(*games, reported(opponent), "{opponent}");
    }

    // A classic plugin is refused on a text run; the current one stays.
    let control = EvalControl {
        schema: SCHEMA_VERSION,
        evaluator: "greedy".into(),
        options: vec![],
    };
    client
        .publish(s.eval_control(), encode(&control).into())
        .await
        .unwrap();

    // The learner announces version 2: evaluated with it.
    version.store(2, Ordering::SeqCst);
    client
        .publish(s.adapters(), encode(&update(2, 640)).into())
        .await
        .unwrap();
    let second = next_report(&mut evals).await;
    check_matchups(&second, 6);
    assert_eq!(second.policy_version, 2);
    assert_eq!(second.learner_env_steps, 640);

    let (_, body) = http_get(addr, "/metrics").unwrap();
    let line = |prefix: &str| {
        body.lines()
            .find(|l| l.starts_with(prefix))
            .unwrap_or_else(|| panic!("no {prefix} in\n{body}"))
            .rsplit(' ')
            .next()
            .unwrap()
            .parse::<f64>()
            .unwrap()
    };
    assert_eq!(line("relay_evaluator_control_rejected_total"), 1.0);
    assert_eq!(line("relay_evaluator_skipped_versions_total"), 1.0);
    assert!(body.contains("relay_evaluator_active{") && body.contains("evaluator=\"vs-opponent\""));
    assert!(body.contains("relay_evaluator_games{"));
    assert!(body.contains("relay_evaluator_legal_move_rate{"));

    trigger.trigger();
    tokio::time::timeout(Duration::from_secs(15), evaluator)
        .await
        .expect("the evaluator stops")
        .unwrap()
        .unwrap();
}

/// A two-player TextArena game of the test's own module whose
/// observations list no legal moves: each player says a word in brackets;
/// after four words it is a draw.
const WORDS_GAME: &str = r#"
import textarena as ta

class Words(ta.Env):
    def reset(self, num_players, seed=None):
        self.state = ta.TwoPlayerState(num_players=num_players, seed=seed)
        self.state.reset(game_state={"said": []}, player_prompt_function=lambda player_id, game_state:
            f"Player {player_id}, say any word in brackets, like [hello].")
    def step(self, action):
        self.state.add_observation(from_id=self.state.current_player_id, message=action,
            observation_type=ta.ObservationType.PLAYER_ACTION)
        self.state.game_state["said"].append(action)
        if len(self.state.game_state["said"]) == 4:
            self.state.set_draw(reason="four words said")
        return self.state.step()

ta.envs.registration.register(id="Words-v0", entry_point=Words)
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_game_without_legal_moves_is_evaluated_against_the_base_model_by_default() {
    let dir = relay_testkit::TempDir::new("vs-opp-words");
    std::fs::write(dir.path().join("relay_words_game.py"), WORDS_GAME).unwrap();
    let nats = NatsServer::start().unwrap();
    let client = async_nats::connect(nats.url()).await.unwrap();
    let s = Subjects::new("vs-words");
    let mut evals = client.subscribe(s.eval()).await.unwrap();
    let env = format!(
        "env:\n  backend: textarena\n  imports: [relay_words_game]\n  python_path: [{}]\n",
        dir.path().display()
    );
    let yaml = |options: &str| {
        format!(
            "run:\n  id: vs-words\n  env_id: Words-v0\nconnections:\n  nats_url: {}\n{env}eval:\n  evaluator: vs-opponent\n  options: {{games: 4{options}}}\ntext:\n  opponents: {{self: 1}}\n  generate_timeout_ms: 5000\n",
            nats.url()
        )
    };
    let experiment = ExperimentConfig::from_layers(&yaml(""), "test", &[], &[]).unwrap();

    // What `relay up` prints, and a random bot named by the user refused.
    let plugin = relay_eval::plugins::build("vs-opponent", &[]).unwrap();
    plugin.check_env("Words-v0", &experiment.env).unwrap();
    let described = plugin.describe(&experiment);
    assert!(
        described.contains("Words-v0 against base") && described.contains("no legal moves"),
        "{described}"
    );
    let random = relay_eval::plugins::build(
        "vs-opponent",
        &[("opponents".to_string(), "random".to_string())],
    )
    .unwrap();
    let err = random.check_env("Words-v0", &experiment.env).unwrap_err();
    assert!(err.contains("random bot needs the legal moves"), "{err}");

    // Every model seat says a word.
    let generate = client.clone();
    tokio::spawn(async move {
        let mut requests = generate
            .queue_subscribe(s.generate(), "q".into())
            .await
            .unwrap();
        while let Some(message) = requests.next().await {
            let request: GenerateRequest = decode(&message.payload).unwrap();
            let text = "[hello]".to_string();
            let reply = GenerateReply {
                schema: SCHEMA_VERSION,
                adapter: request.adapter.clone().map(|a| AdapterRef {
                    version: Some(0),
                    ..a
                }),
                prompt_tokens: Tensor::from_u32(&[3], &[1, 2, 3]),
                completion_tokens: Tensor::from_u32(&[2], &[9, 9]),
                logprobs: Tensor::from_f32(&[2], &[-1.0, -1.0]),
                text,
                finish: FinishReason::Stop,
                answer_start: None,
            };
            if let Some(to) = message.reply {
                let _ = generate.publish(to, encode(&reply).into()).await;
            }
        }
    });
    let mut config = ServiceConfig::for_test(experiment);
    config.metrics_addr = ([127, 0, 0, 1], free_port()).into();
    let (trigger, shutdown) = Shutdown::new();
    let evaluator = tokio::spawn(relay_evaluator::run(config, shutdown));
    let update = AdapterUpdate {
        schema: SCHEMA_VERSION,
        name: "policy".into(),
        version: 0,
        learner_env_steps: 0,
        config_json: "{}".into(),
        weights: relay_proto::WeightsBlob::inline(vec![0; 8]),
        published_unix_ms: 0,
    };
    // (Once the evaluator has subscribed.)
    tokio::time::sleep(Duration::from_secs(1)).await;
    client
        .publish(Subjects::new("vs-words").adapters(), encode(&update).into())
        .await
        .unwrap();
    let report = next_report(&mut evals).await;
    assert_eq!(report.env_id, "Words-v0");
    let opponents: Vec<&str> = report
        .matchups
        .iter()
        .map(|m| m.opponent.as_str())
        .collect();
    assert_eq!(opponents, ["base", "base"], "{report:?}");
    for m in &report.matchups {
        assert_eq!((m.games, m.abandoned, m.draws), (2, 0, 2), "{m:?}");
    }
    trigger.trigger();
    tokio::time::timeout(Duration::from_secs(15), evaluator)
        .await
        .expect("the evaluator stops")
        .unwrap()
        .unwrap();
}
