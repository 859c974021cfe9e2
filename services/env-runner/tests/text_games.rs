//! The env-runner's text mode against a real nats-server: TicTacToe games
//! against `random` and `minimax`, the published `GameRecord`s and
//! `EpisodeReport`s, the metrics, and a runner that survives garbled and
//! slow replies. A baseline with bots in every seat needs no model at all.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use relay_config::ExperimentConfig;
use relay_kit::{ServiceConfig, Shutdown};
use relay_proto::{
    decode, encode, AdapterRef, EpisodeReport, FinishReason, GameRecord, GenerateReply,
    GenerateRequest, MetricsReport, Prompt, SeatPolicy, Subjects, Tensor, SCHEMA_VERSION,
};
use relay_testkit::{free_port, http_get, NatsServer};

/// How the stand-in answers one request.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Answer {
    /// A legal move taken from the prompt's "Available Moves" line.
    Legal,
    /// Text the game refuses.
    Illegal,
    /// Bytes that are no `GenerateReply`.
    Garbled,
    /// A legal move, after this long (past the runner's timeout).
    Slow(Duration),
}

/// A stand-in for the inference server's `generate` endpoint (written in
/// parallel elsewhere): it answers `GenerateRequest`s on the real NATS
/// subject `relay.<run>.generate`, in the inference servers' queue group,
/// with a move parsed from the prompt and made-up token ids and log-probs
/// that pass `GenerateReply::validate`. `plan(n)` decides how the `n`th
/// request is answered.
fn spawn_stand_in_inference_server(
    client: async_nats::Client,
    run_id: &str,
    plan: impl Fn(usize) -> Answer + Send + 'static,
) -> Arc<AtomicUsize> {
    let subject = Subjects::new(run_id).generate();
    let served = Arc::new(AtomicUsize::new(0));
    let count = served.clone();
    tokio::spawn(async move {
        let mut requests = client.queue_subscribe(subject, "q".into()).await.unwrap();
        while let Some(message) = requests.next().await {
            let n = count.fetch_add(1, Ordering::SeqCst);
            let Some(reply_to) = message.reply.clone() else {
                continue;
            };
            let request: GenerateRequest = decode(&message.payload).expect("a valid request");
            let answer = plan(n);
            let payload = match answer {
                Answer::Garbled => b"\x93not a reply".to_vec(),
                Answer::Illegal => encode(&reply(&request, ["[9]", "I resign", "[ ]"][n % 3])),
                Answer::Legal | Answer::Slow(_) => {
                    let moves = available_moves(&request);
                    encode(&reply(&request, &moves[n % moves.len()]))
                }
            };
            let client = client.clone();
            tokio::spawn(async move {
                if let Answer::Slow(delay) = answer {
                    tokio::time::sleep(delay).await;
                }
                let _ = client.publish(reply_to, payload.into()).await;
            });
        }
    });
    served
}

/// The moves of the last "Available Moves: '[0]', '[4]'" line of the prompt.
fn available_moves(request: &GenerateRequest) -> Vec<String> {
    let Prompt::Chat(turns) = &request.prompt else {
        panic!("the runner sends chat prompts")
    };
    let observation = &turns.last().expect("a user turn").content;
    observation
        .lines()
        .rev()
        .find_map(|l| l.strip_prefix("Available Moves: "))
        .expect("a TicTacToe observation lists the available moves")
        .split(", ")
        .map(|m| m.trim_matches('\'').to_string())
        .collect()
}

fn reply(request: &GenerateRequest, text: &str) -> GenerateReply {
    let Prompt::Chat(turns) = &request.prompt else {
        panic!()
    };
    let prompt_len = turns.iter().map(|t| t.content.len()).sum::<usize>() / 4 + 1;
    let completion: Vec<u32> = text.bytes().map(|b| b as u32 + 1000).collect();
    let c = completion.len();
    GenerateReply {
        schema: SCHEMA_VERSION,
        adapter: request.adapter.clone().map(|a| AdapterRef {
            version: Some(3),
            ..a
        }),
        prompt_tokens: Tensor::from_u32(&[prompt_len], &vec![7; prompt_len]),
        completion_tokens: Tensor::from_u32(&[c], &completion),
        logprobs: Tensor::from_f32(&[c], &vec![-0.5; c]),
        text: text.to_string(),
        finish: FinishReason::Stop,
        answer_start: None,
    }
}

fn config(nats: &NatsServer, run_id: &str, text: &str) -> (ServiceConfig, SocketAddr) {
    let yaml = format!(
        "run:\n  id: {run_id}\n  env_id: TicTacToe-v0\n  seed: 3\nconnections:\n  nats_url: {}\ntext:\n{text}",
        nats.url()
    );
    let experiment = ExperimentConfig::from_layers(&yaml, "test", &[], &[]).unwrap();
    let addr: SocketAddr = ([127, 0, 0, 1], free_port()).into();
    let mut config = ServiceConfig::for_test(experiment);
    config.metrics_addr = addr;
    (config, addr)
}

async fn next_records(games: &mut async_nats::Subscriber, n: usize) -> Vec<GameRecord> {
    let mut records = Vec::new();
    while records.len() < n {
        let message = tokio::time::timeout(Duration::from_secs(60), games.next())
            .await
            .unwrap_or_else(|_| panic!("only {} games in 60 s", records.len()))
            .unwrap();
        records.push(decode::<GameRecord>(&message.payload).expect("a valid GameRecord"));
    }
    records
}

/// Sum of every sample of `name` whose labels contain `labels`.
fn metric(body: &str, name: &str, labels: &str) -> f64 {
    body.lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| {
            l.split([' ', '{']).next() == Some(name) && (labels.is_empty() || l.contains(labels))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Players alternate, except that the mover of a refused move moves again
/// (unless it ended the game).
fn check_turn_order(record: &GameRecord) {
    for pair in record.turns.windows(2) {
        let expected = if pair[0].invalid {
            pair[0].player
        } else {
            1 - pair[0].player
        };
        assert_eq!(pair[1].player, expected, "{:?}", record.turns);
    }
    assert_eq!(record.turns[0].player, 0, "player 0 moves first");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plays_tictactoe_against_random_and_minimax() {
    let nats = NatsServer::start().unwrap();
    let client = async_nats::connect(nats.url()).await.unwrap();
    let s = Subjects::new("text-e2e");
    let mut games = client.subscribe(s.games()).await.unwrap();
    let mut episodes = client.subscribe(s.episodes()).await.unwrap();
    let mut reports = client.subscribe(s.metrics()).await.unwrap();
    // Every fifth request gets an illegal answer.
    let served = spawn_stand_in_inference_server(client.clone(), "text-e2e", |n| {
        if n % 5 == 4 {
            Answer::Illegal
        } else {
            Answer::Legal
        }
    });
    let (config, metrics_addr) = config(
        &nats,
        "text-e2e",
        "  opponents: {random: 1, minimax: 1}\n  games_in_flight: 3\n  generate_timeout_ms: 5000\n",
    );
    let (trigger, shutdown) = Shutdown::new();
    let runner = tokio::spawn(relay_env_runner::run(config, shutdown));

    let records = next_records(&mut games, 30).await;
    let mut seats_seen = std::collections::BTreeSet::new();
    let mut opponents_seen = std::collections::BTreeSet::new();
    let mut seeds = std::collections::BTreeSet::new();
    let mut invalid_turns = 0;
    for r in &records {
        assert_eq!(r.env_id, "TicTacToe-v0");
        assert!(r.runner_id.starts_with("env-runner"), "{}", r.runner_id);
        let learner = r.learner_seat.expect("a learning seat") as usize;
        seats_seen.insert(learner);
        seeds.insert(r.seed);
        assert_eq!(
            r.seats[learner],
            SeatPolicy::Model(Some(AdapterRef {
                name: "policy".into(),
                version: None
            }))
        );
        let SeatPolicy::Bot(opponent) = &r.seats[1 - learner] else {
            panic!("the opponent is a bot: {:?}", r.seats)
        };
        opponents_seen.insert(opponent.clone());
        // TicTacToe is zero-sum: +1/-1, or a draw.
        assert_eq!(r.rewards.iter().sum::<f64>(), 0.0, "{:?}", r.rewards);
        assert!(r.rewards.iter().all(|x| [-1.0, 0.0, 1.0].contains(x)));
        if opponent == "minimax" {
            assert!(r.rewards[learner] <= 0.0, "beat minimax: {r:?}");
        }
        check_turn_order(r);
        for turn in &r.turns {
            let model = turn.player as usize == learner;
            assert_eq!(turn.completion_tokens.numel() > 0, model);
            assert_eq!(turn.prompt_tokens.numel() > 0, model);
            assert_eq!(turn.logprobs.numel(), turn.completion_tokens.numel());
            if model {
                assert_eq!(turn.adapter.as_ref().unwrap().version, Some(3));
                // The tokens are the stand-in's spelling of the action.
                let spelled: String = turn
                    .completion_tokens
                    .to_u32()
                    .unwrap()
                    .iter()
                    .map(|&t| (t - 1000) as u8 as char)
                    .collect();
                assert_eq!(spelled, turn.action);
            } else {
                // Bots always move legally.
                assert!(!turn.invalid);
            }
            invalid_turns += turn.invalid as usize;
        }
        assert!(r.reasons.iter().all(|reason| !reason.is_empty()));
    }
    assert_eq!(seats_seen.len(), 2, "seating never varied");
    assert_eq!(
        opponents_seen.into_iter().collect::<Vec<_>>(),
        vec!["minimax".to_string(), "random".to_string()]
    );
    assert!(seeds.len() > 1);
    assert!(invalid_turns > 0, "the illegal answers were never recorded");
    assert!(served.load(Ordering::SeqCst) > 0);

    // The training episodes are the learning seat's rewards, game by game.
    let mut returns = Vec::new();
    while returns.len() < records.len() {
        let message = tokio::time::timeout(Duration::from_secs(10), episodes.next())
            .await
            .expect("episode reports")
            .unwrap();
        let report: EpisodeReport = decode(&message.payload).unwrap();
        assert_eq!(report.env_id, "TicTacToe-v0");
        assert_eq!(report.policy_version, 3);
        returns.extend(report.episodes);
    }
    for (episode, r) in returns.iter().zip(&records) {
        assert_eq!(
            episode.episode_return,
            r.rewards[r.learner_seat.unwrap() as usize]
        );
        assert_eq!(episode.length as usize, r.turns.len());
    }

    // Reported values (to the tracker) and /metrics.
    // Reports come each second; read them up to the one that counts all the
    // games above (its rates cover the last 100 games).
    let mut reported = std::collections::BTreeMap::new();
    let mut games_reported = 0.0;
    while games_reported < records.len() as f64 {
        let message = tokio::time::timeout(Duration::from_secs(10), reports.next())
            .await
            .expect("metric reports")
            .unwrap();
        let report: MetricsReport = decode(&message.payload).unwrap();
        assert_eq!(report.service, "env-runner");
        for v in report.values {
            if v.name == "games_total" {
                games_reported += v.value;
            }
            reported.insert(v.name, v.value);
        }
    }
    let rate = |n: &str| reported[n];
    let sum =
        rate("env_runner_win_rate") + rate("env_runner_draw_rate") + rate("env_runner_loss_rate");
    assert!((sum - 1.0).abs() < 1e-9, "{reported:?}");
    assert!(
        rate("env_runner_invalid_move_rate") > 0.0 && rate("env_runner_invalid_move_rate") < 1.0
    );
    assert!(rate("env_runner_distinct_states") >= 9.0, "{reported:?}");
    assert!(rate("env_runner_move_entropy") > 0.0);
    assert!(reported.contains_key("env_runner_chars_per_second"));
    assert!(reported.contains_key("env_runner_episode_return_mean"));

    // /metrics: counters only grow, so they hold at least what the records show.
    let learner_turns: Vec<&relay_proto::TextTurn> = records
        .iter()
        .flat_map(|r| {
            let seat = r.learner_seat.unwrap();
            r.turns.iter().filter(move |t| t.player == seat)
        })
        .collect();
    let vs_minimax = records
        .iter()
        .filter(|r| r.seats.contains(&SeatPolicy::Bot("minimax".into())))
        .count();
    let (status, body) = http_get(metrics_addr, "/metrics").unwrap();
    assert_eq!(status, 200);
    let at_least = |name: &str, labels: &str, floor: usize| {
        let value = metric(&body, name, labels);
        assert!(
            value >= floor as f64,
            "{name}{{{labels}}} = {value} < {floor}"
        );
    };
    at_least("relay_env_runner_games_total", "", records.len());
    at_least(
        "relay_env_runner_games_total",
        "opponent=\"minimax\"",
        vs_minimax,
    );
    assert_eq!(
        metric(
            &body,
            "relay_env_runner_games_total",
            "opponent=\"minimax\",outcome=\"win\""
        ),
        0.0
    );
    at_least("relay_env_runner_invalid_moves_total", "", invalid_turns);
    at_least(
        "relay_env_runner_model_moves_total",
        "",
        learner_turns.len(),
    );
    at_least(
        "relay_env_runner_completion_tokens_total",
        "",
        learner_turns
            .iter()
            .map(|t| t.completion_tokens.numel())
            .sum(),
    );
    at_least(
        "relay_env_runner_generated_chars_total",
        "",
        learner_turns.iter().map(|t| t.action.chars().count()).sum(),
    );
    at_least(
        "relay_env_runner_turn_seconds_count",
        "",
        learner_turns.len(),
    );
    at_least("relay_env_runner_game_seconds_count", "", records.len());
    assert_eq!(
        metric(&body, "relay_env_runner_games_abandoned_total", ""),
        0.0
    );

    trigger.trigger();
    tokio::time::timeout(Duration::from_secs(15), runner)
        .await
        .expect("the runner stops")
        .unwrap()
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbled_and_slow_replies_do_not_stop_the_runner() {
    let nats = NatsServer::start().unwrap();
    let client = async_nats::connect(nats.url()).await.unwrap();
    let s = Subjects::new("text-faults");
    let mut games = client.subscribe(s.games()).await.unwrap();
    // One game at a time, so requests arrive in turn order: a garbled reply
    // followed by a slow one fails a move twice (abandoned); a garbled reply
    // alone is retried.
    spawn_stand_in_inference_server(client.clone(), "text-faults", |n| match n % 9 {
        3 => Answer::Garbled,
        4 => Answer::Slow(Duration::from_millis(1500)),
        7 => Answer::Garbled,
        _ => Answer::Legal,
    });
    let (config, metrics_addr) = config(
        &nats,
        "text-faults",
        "  opponents: {random: 1}\n  games_in_flight: 1\n  generate_timeout_ms: 300\n  generate_attempts: 2\n",
    );
    let (trigger, shutdown) = Shutdown::new();
    let runner = tokio::spawn(relay_env_runner::run(config, shutdown));
    let records = next_records(&mut games, 8).await;
    assert!(!runner.is_finished());
    for r in &records {
        check_turn_order(r);
    }
    let (_, body) = http_get(metrics_addr, "/metrics").unwrap();
    let abandoned = metric(
        &body,
        "relay_env_runner_games_abandoned_total",
        "reason=\"timeout\"",
    );
    assert!(abandoned >= 1.0, "no game abandoned:\n{body}");
    let retries = metric(&body, "relay_env_runner_generate_retries_total", "");
    assert!(
        retries >= abandoned,
        "an abandoned move was not retried: {retries}"
    );
    // Games still finish after the abandoned ones.
    let more = next_records(&mut games, 2).await;
    assert_eq!(more.len(), 2);
    trigger.trigger();
    tokio::time::timeout(Duration::from_secs(15), runner)
        .await
        .expect("the runner stops")
        .unwrap()
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bot_as_the_learning_side_plays_without_any_model() {
    let nats = NatsServer::start().unwrap();
    let client = async_nats::connect(nats.url()).await.unwrap();
    let s = Subjects::new("text-bots");
    let mut games = client.subscribe(s.games()).await.unwrap();
    let mut episodes = client.subscribe(s.episodes()).await.unwrap();
    // No stand-in: nobody answers generate requests.
    let (config, _) = config(
        &nats,
        "text-bots",
        "  learner: random\n  opponents: {minimax: 1}\n  games_in_flight: 2\n",
    );
    let (trigger, shutdown) = Shutdown::new();
    let runner = tokio::spawn(relay_env_runner::run(config, shutdown));
    // The learner's seat is drawn by an RNG seeded from the runner's random
    // instance id: 24 games leave both seats unseen with odds of 2^-23.
    let records = next_records(&mut games, 24).await;
    let mut seats_seen = std::collections::BTreeSet::new();
    for r in &records {
        let learner = r.learner_seat.unwrap() as usize;
        seats_seen.insert(learner);
        assert_eq!(r.seats[learner], SeatPolicy::Bot("random".into()));
        assert_eq!(r.seats[1 - learner], SeatPolicy::Bot("minimax".into()));
        assert!(r
            .turns
            .iter()
            .all(|t| t.completion_tokens.numel() == 0 && !t.invalid));
        assert!(r.rewards[learner] <= 0.0, "random beat minimax");
        check_turn_order(r);
    }
    assert_eq!(seats_seen.len(), 2);
    let message = tokio::time::timeout(Duration::from_secs(10), episodes.next())
        .await
        .unwrap()
        .unwrap();
    let report: EpisodeReport = decode(&message.payload).unwrap();
    assert!(report.episodes.iter().all(|e| e.episode_return <= 0.0));
    trigger.trigger();
    tokio::time::timeout(Duration::from_secs(15), runner)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
}

/// The env-runner of a multi-game run (`text.games`, bots in every seat,
/// one game at a time so records come in draw order): both games are
/// played about as their weights say, the draws are the same for the same
/// seed, episodes are published per game and the per-game values carry a
/// `game` label, on the tracker's reports and on `/metrics`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_multi_game_run_draws_its_games_by_weight_and_labels_them() {
    let nats = NatsServer::start().unwrap();
    let client = async_nats::connect(nats.url()).await.unwrap();
    let text = "  learner: random\n  opponents: {random: 1}\n  games_in_flight: 1\n  games: {TicTacToe-v0: 2, KuhnPoker-v0: 1}\n";
    let mut sequences = Vec::new();
    for run in ["multi-a", "multi-b"] {
        let s = Subjects::new(run);
        let mut games = client.subscribe(s.games()).await.unwrap();
        let mut episodes = client.subscribe(s.episodes()).await.unwrap();
        let mut metrics = client.subscribe(s.metrics()).await.unwrap();
        let (mut config, metrics_addr) = config(&nats, run, text);
        // The runner's seed comes from the run seed and its instance name.
        config.instance = Some("env-runner-0".into());
        let (trigger, shutdown) = Shutdown::new();
        let runner = tokio::spawn(relay_env_runner::run(config, shutdown));
        let records = next_records(&mut games, 60).await;
        let kuhn = records
            .iter()
            .filter(|r| r.env_id == "KuhnPoker-v0")
            .count();
        let ttt = records
            .iter()
            .filter(|r| r.env_id == "TicTacToe-v0")
            .count();
        assert_eq!(kuhn + ttt, 60);
        // 2:1 weights: 20 Kuhn games expected; a binomial(60, 1/3) is in
        // 8..=32 but for odds below 1e-3.
        assert!((8..=32).contains(&kuhn), "{kuhn} Kuhn poker games of 60");
        sequences.push(records.iter().map(|r| r.env_id.clone()).collect::<Vec<_>>());

        // Episodes per game, each report of one game.
        let mut episode_games = std::collections::BTreeSet::new();
        while episode_games.len() < 2 {
            let message = tokio::time::timeout(Duration::from_secs(10), episodes.next())
                .await
                .expect("episode reports of both games")
                .unwrap();
            let report: EpisodeReport = decode(&message.payload).unwrap();
            episode_games.insert(report.env_id);
        }
        // The reports to the tracker: per-game values with their label.
        let mut labelled = std::collections::BTreeMap::new();
        while labelled.len() < 2 {
            let message = tokio::time::timeout(Duration::from_secs(10), metrics.next())
                .await
                .expect("metric reports")
                .unwrap();
            let report: MetricsReport = decode(&message.payload).unwrap();
            for v in report.values {
                if v.name == "env_runner_game_win_rate" {
                    let game = v.labels["game"].clone();
                    assert!((0.0..=1.0).contains(&v.value));
                    labelled.insert(game, v.value);
                }
            }
        }
        assert_eq!(
            labelled.keys().map(String::as_str).collect::<Vec<_>>(),
            ["KuhnPoker-v0", "TicTacToe-v0"]
        );
        // /metrics: finished games by game.
        let (status, body) = http_get(metrics_addr, "/metrics").unwrap();
        assert_eq!(status, 200);
        for game in ["KuhnPoker-v0", "TicTacToe-v0"] {
            assert!(
                metric(
                    &body,
                    "relay_env_runner_games_total",
                    &format!("game=\"{game}\"")
                ) >= 1.0,
                "{body}"
            );
        }
        trigger.trigger();
        tokio::time::timeout(Duration::from_secs(15), runner)
            .await
            .unwrap()
            .unwrap()
            .unwrap();
    }
    // The same seed draws the same games.
    assert_eq!(sequences[0], sequences[1]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn branched_games_come_as_every_continuation_of_one_position() {
    use relay_proto::WireMessage;
    let nats = NatsServer::start().unwrap();
    let client = async_nats::connect(nats.url()).await.unwrap();
    let s = Subjects::new("text-branches");
    let mut games = client.subscribe(s.games()).await.unwrap();
    spawn_stand_in_inference_server(client.clone(), "text-branches", |_| Answer::Legal);
    let (config, _) = config(
        &nats,
        "text-branches",
        "  opponents: {random: 1}\n  games_in_flight: 2\n  branches: 3\n",
    );
    let (trigger, shutdown) = Shutdown::new();
    let runner = tokio::spawn(relay_env_runner::run(config, shutdown));

    let records = next_records(&mut games, 30).await;
    let mut positions: std::collections::BTreeMap<u64, Vec<&GameRecord>> = Default::default();
    for r in &records {
        r.validate().unwrap();
        let branch = r.branch.expect("every training game is branched");
        assert_eq!(branch.size, 3);
        positions.entry(branch.group).or_default().push(r);
    }
    let mut complete = 0;
    for continuations in positions.values() {
        // A task publishes its game and then its continuations, so every
        // position but the last one or two is whole here.
        if continuations.len() < 3 {
            continue;
        }
        complete += 1;
        let first = continuations[0];
        let b = first.branch.unwrap();
        let t = b.turn as usize;
        let learner = first.learner_seat.unwrap();
        assert_eq!(
            first.turns[t].player, learner,
            "branching at a learning move"
        );
        let indices: Vec<u32> = continuations
            .iter()
            .map(|r| r.branch.unwrap().index)
            .collect();
        assert_eq!(
            indices,
            vec![0, 1, 2],
            "the game first, then its continuations"
        );
        for r in continuations {
            assert_eq!((r.seed, r.learner_seat), (first.seed, first.learner_seat));
            assert_eq!(r.branch.unwrap().turn, b.turn);
            assert_eq!(r.turns[..t], first.turns[..t], "the shared turns");
            check_turn_order(r);
        }
    }
    assert!(complete >= 8, "only {complete} whole positions in 30 games");
    trigger.trigger();
    runner.await.unwrap().unwrap();
}
