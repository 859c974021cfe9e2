//! The text-game loop with an in-process [`Generate`] (no NATS): what a
//! game records, seating, retries, abandonment, constrained decoding.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use relay_config::TextConfig;
use relay_policy::text::{
    arrange, learning_adapter, make_bot, play_game, GameError, GameSettings, GameSpec, Generate,
    GenerateError, Outcome, Seat,
};
use relay_proto::{
    AdapterRef, FinishReason, GameRecord, GenerateReply, GenerateRequest, Prompt, SeatPolicy,
    Tensor, SCHEMA_VERSION,
};

/// The cells listed on the last "Available Moves:" line of the prompt.
fn available_moves(request: &GenerateRequest) -> Vec<String> {
    let Prompt::Chat(turns) = &request.prompt else {
        panic!("expected a chat prompt")
    };
    let user = &turns.last().unwrap().content;
    let line = user
        .lines()
        .rev()
        .find_map(|l| l.strip_prefix("Available Moves: "))
        .expect("an Available Moves line");
    line.split(", ")
        .map(|m| m.trim_matches('\'').to_string())
        .collect()
}

fn reply(request: &GenerateRequest, text: &str) -> GenerateReply {
    let c = text.len();
    GenerateReply {
        schema: SCHEMA_VERSION,
        adapter: request.adapter.clone().map(|a| AdapterRef {
            version: Some(7),
            ..a
        }),
        prompt_tokens: Tensor::from_u32(&[5], &[1, 2, 3, 4, 5]),
        completion_tokens: Tensor::from_u32(&[c], &vec![42; c]),
        logprobs: Tensor::from_f32(&[c], &vec![-0.25; c]),
        text: text.to_string(),
        finish: FinishReason::Stop,
        answer_start: None,
    }
}

/// Answers by a rule of (request, call number); records every request.
struct Scripted<F> {
    rule: F,
    calls: AtomicUsize,
    requests: Mutex<Vec<GenerateRequest>>,
}

impl<F> Scripted<F>
where
    F: Fn(&GenerateRequest, usize) -> Result<GenerateReply, GenerateError> + Send + Sync,
{
    fn new(rule: F) -> Self {
        Self {
            rule,
            calls: AtomicUsize::new(0),
            requests: Mutex::new(Vec::new()),
        }
    }
}

impl<F> Generate for Scripted<F>
where
    F: Fn(&GenerateRequest, usize) -> Result<GenerateReply, GenerateError> + Send + Sync,
{
    async fn generate(
        &self,
        request: &GenerateRequest,
        _timeout: Duration,
    ) -> Result<GenerateReply, GenerateError> {
        let n = self.calls.fetch_add(1, Ordering::SeqCst);
        self.requests.lock().unwrap().push(request.clone());
        (self.rule)(request, n)
    }
}

fn settings() -> GameSettings {
    let mut s = GameSettings::from_config(&TextConfig::default(), &Default::default());
    s.retry_backoff = Duration::from_millis(1);
    s
}

fn vs_minimax(learner_seat: usize) -> GameSpec {
    let text = TextConfig::default();
    GameSpec {
        env_id: "TicTacToe-v0".into(),
        seed: 11,
        seats: arrange(
            Seat::learner(&text, 1).unwrap(),
            || Ok(Seat::Bot(make_bot("minimax", 2, &text)?)),
            2,
            learner_seat,
        )
        .unwrap(),
        learner_seat: Some(learner_seat),
        runner_id: "test".into(),
    }
}

fn roundtrip(record: &GameRecord) {
    let back: GameRecord = relay_proto::decode(&relay_proto::encode(record)).unwrap();
    assert_eq!(&back, record);
}

#[tokio::test]
async fn model_seat_plays_minimax_from_either_seat_and_records_every_turn() {
    let generator = Scripted::new(|r: &GenerateRequest, _| Ok(reply(r, &available_moves(r)[0])));
    for seat in [0, 1] {
        let game = play_game(&generator, vs_minimax(seat), &settings())
            .await
            .unwrap();
        let r = &game.record;
        roundtrip(r);
        assert_eq!(r.learner_seat, Some(seat as u8));
        assert_eq!(r.seats[seat], SeatPolicy::Model(Some(learning_adapter())));
        assert_eq!(r.seats[1 - seat], SeatPolicy::Bot("minimax".into()));
        // Players alternate (every move here is legal), player 0 first.
        for (i, turn) in r.turns.iter().enumerate() {
            assert_eq!(turn.player as usize, i % 2);
            assert!(!turn.invalid);
            let model = turn.player as usize == seat;
            assert_eq!(turn.completion_tokens.numel() > 0, model, "turn {i}");
            assert_eq!(turn.logprobs.numel(), turn.completion_tokens.numel());
            assert_eq!(turn.prompt_tokens.numel() > 0, model);
            assert_eq!(
                turn.adapter,
                model.then(|| AdapterRef {
                    name: "policy".into(),
                    version: Some(7)
                })
            );
        }
        // Lowest free cell against perfect play never wins.
        assert_eq!(r.rewards.iter().sum::<f64>(), 0.0);
        assert!(r.rewards[seat] <= 0.0);
        assert_ne!(game.outcome(), Some(Outcome::Win));
        assert_eq!(game.learner_reward(), Some(r.rewards[seat]));
        assert_eq!(game.learning_seats(), vec![seat]);
        assert_eq!(game.states.len(), r.turns.len() + 1);
        let model_turns = r.turns.iter().filter(|t| t.player as usize == seat).count();
        assert_eq!(game.model_turn_seconds.len(), model_turns);
        assert!(r.reasons.iter().all(|reason| !reason.is_empty()));
    }
}

#[tokio::test]
async fn an_illegal_reply_is_judged_by_the_game_and_the_same_player_moves_again() {
    // First answer of the game is an occupied-or-absent cell, then legal moves.
    let generator = Scripted::new(|r: &GenerateRequest, n| {
        if n == 0 {
            Ok(reply(r, "I pick [9]"))
        } else {
            Ok(reply(r, &available_moves(r)[0]))
        }
    });
    let game = play_game(&generator, vs_minimax(0), &settings())
        .await
        .unwrap();
    let turns = &game.record.turns;
    assert!(turns[0].invalid && turns[0].player == 0);
    assert_eq!(turns[0].action, "I pick [9]");
    assert!(!turns[1].invalid && turns[1].player == 0);
    // The second prompt carries the game's warning.
    let requests = generator.requests.lock().unwrap();
    let Prompt::Chat(chat) = &requests[1].prompt else {
        panic!()
    };
    assert!(chat[0].content.contains("attempted an invalid move"));
}

#[tokio::test]
async fn failed_requests_are_retried_then_the_game_is_abandoned() {
    // Two failures, then answers: the game finishes with two retries.
    let flaky = Scripted::new(|r: &GenerateRequest, n| match n {
        0 => Err(GenerateError::Timeout),
        1 => Err(GenerateError::BadReply("garbled".into())),
        _ => Ok(reply(r, &available_moves(r)[0])),
    });
    let game = play_game(&flaky, vs_minimax(0), &settings()).await.unwrap();
    assert_eq!(game.retries, 2);
    assert!(!game.record.turns.is_empty());

    // Never an answer: abandoned after exactly `attempts` tries.
    let dead = Scripted::new(|_: &GenerateRequest, _| Err(GenerateError::NoResponders));
    let mut s = settings();
    s.attempts = 4;
    let err = play_game(&dead, vs_minimax(0), &s).await.unwrap_err();
    match err {
        GameError::Abandoned {
            turn,
            player,
            attempts,
            last,
        } => {
            assert_eq!((turn, player, attempts), (0, 0, 4));
            assert_eq!(last, GenerateError::NoResponders);
        }
        other => panic!("{other}"),
    }
    assert_eq!(dead.calls.load(Ordering::SeqCst), 4);
}

#[tokio::test]
async fn requests_carry_the_system_prompt_sampling_and_legal_moves_when_constrained() {
    let generator = Scripted::new(|r: &GenerateRequest, _| Ok(reply(r, &r.allowed[0])));
    let text = TextConfig {
        constrained: true,
        system_prompt: Some("You play to win.".into()),
        temperature: 0.5,
        max_turn_tokens: 7,
        ..TextConfig::default()
    };
    let mut s = GameSettings::from_config(&text, &Default::default());
    s.retry_backoff = Duration::from_millis(1);
    let spec = vs_minimax(1);
    let seed = spec.seed;
    play_game(&generator, spec, &s).await.unwrap();
    let requests = generator.requests.lock().unwrap();
    assert!(!requests.is_empty());
    let mut seeds = std::collections::HashSet::new();
    for r in requests.iter() {
        relay_proto::decode::<GenerateRequest>(&relay_proto::encode(r)).unwrap();
        let Prompt::Chat(chat) = &r.prompt else {
            panic!()
        };
        assert_eq!(chat.len(), 2);
        assert_eq!(
            (chat[0].role.as_str(), chat[0].content.as_str()),
            ("system", "You play to win.")
        );
        assert_eq!(chat[1].role, "user");
        assert!(chat[1].content.starts_with("\n[GAME] You are Player 1"));
        assert_eq!(r.allowed, available_moves(r));
        assert_eq!((r.sampling.temperature, r.sampling.max_tokens), (0.5, 7));
        assert_eq!(r.adapter, Some(learning_adapter()));
        seeds.insert(r.sampling.seed.expect("a per-move seed"));
    }
    assert_eq!(seeds.len(), requests.len(), "each move has its own seed");
    assert!(!seeds.contains(&seed));
}

#[tokio::test]
async fn answer_formats_send_the_game_the_answer_and_record_the_thought() {
    // Thinks aloud about a taken-looking cell, then answers with a free one;
    // every third reply runs out of tokens before answering.
    let generator = Scripted::new(|r: &GenerateRequest, n| {
        let moves = available_moves(r);
        let cell = moves[0].trim_matches(|c| c == '[' || c == ']');
        if n % 3 == 2 {
            let mut cut = reply(r, "Let me think about [0] and");
            cut.finish = FinishReason::Length;
            return Ok(cut);
        }
        Ok(reply(r, &format!("Not [0], I think. \\boxed{{{cell}}}")))
    });
    let text = TextConfig {
        answer: relay_envs::AnswerFormat::Boxed,
        ..TextConfig::default()
    };
    let mut s = GameSettings::from_config(&text, &Default::default());
    s.retry_backoff = Duration::from_millis(1);
    let game = play_game(&generator, vs_minimax(0), &s).await.unwrap();
    roundtrip(&game.record);
    let model: Vec<_> = game.record.turns.iter().filter(|t| t.player == 0).collect();
    assert!(model.len() >= 3, "{model:?}");
    for (n, turn) in model.iter().enumerate() {
        assert!(turn.observation.starts_with("\n[GAME] You are Player 0"));
        if n % 3 == 2 {
            assert_eq!(turn.completion, "Let me think about [0] and");
            assert_eq!(turn.action, "", "no answer: an empty move");
            assert!(turn.no_answer && turn.truncated && turn.invalid);
        } else {
            assert!(turn.completion.starts_with("Not [0], I think. \\boxed{"));
            assert!(turn.action.starts_with('[') && !turn.action.contains("Not"));
            assert!(
                !turn.no_answer && !turn.truncated && !turn.invalid,
                "{turn:?}"
            );
        }
    }
    let bot = game.record.turns.iter().find(|t| t.player == 1).unwrap();
    assert!(bot.observation.starts_with("\n[GAME] You are Player 1"));
    assert!(bot.completion.is_empty() && !bot.no_answer);
}

#[tokio::test]
async fn constrained_decoding_with_an_answer_format_frames_the_answer() {
    let generator = Scripted::new(|r: &GenerateRequest, _| {
        Ok(reply(r, &format!("Hmm. \\boxed{{{}}}", r.allowed[0])))
    });
    for (answer, frame) in [
        (relay_envs::AnswerFormat::Boxed, Some(("\\boxed{", "}"))),
        (relay_envs::AnswerFormat::LastBracket, Some(("", ""))),
        (relay_envs::AnswerFormat::Raw, None),
    ] {
        let text = TextConfig {
            answer,
            constrained: true,
            ..TextConfig::default()
        };
        let s = GameSettings::from_config(&text, &Default::default());
        play_game(&generator, vs_minimax(0), &s).await.unwrap();
        let requests = std::mem::take(&mut *generator.requests.lock().unwrap());
        for r in &requests {
            assert!(!r.allowed.is_empty());
            let got = r
                .answer_frame
                .as_ref()
                .map(|f| (f.opener.as_str(), f.closer.as_str()));
            assert_eq!(got, frame);
        }
    }
}

#[tokio::test]
async fn bot_seats_play_without_any_generate_request() {
    let generator = Scripted::new(
        |_: &GenerateRequest, _| -> Result<GenerateReply, GenerateError> {
            panic!("no model seat")
        },
    );
    let text = TextConfig {
        learner: "random".into(),
        ..TextConfig::default()
    };
    let mut outcomes = std::collections::HashSet::new();
    for seed in 0..12u64 {
        let seat = (seed % 2) as usize;
        let seats = arrange(
            Seat::learner(&text, seed).unwrap(),
            || Ok(Seat::Bot(make_bot("random", seed + 100, &text)?)),
            2,
            seat,
        )
        .unwrap();
        let spec = GameSpec {
            env_id: "TicTacToe-v0".into(),
            seed,
            seats,
            learner_seat: Some(seat),
            runner_id: "bots".into(),
        };
        let game = play_game(&generator, spec, &settings()).await.unwrap();
        roundtrip(&game.record);
        assert!(game
            .record
            .turns
            .iter()
            .all(|t| t.completion_tokens.numel() == 0 && !t.invalid));
        // Mirror of the learner: both seats are "random", so both learn.
        assert_eq!(game.learning_seats(), vec![0, 1]);
        outcomes.insert(game.outcome().unwrap());
    }
    assert!(
        outcomes.len() >= 2,
        "random vs random always ended alike: {outcomes:?}"
    );
    assert_eq!(generator.calls.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn seats_that_do_not_fit_the_game_are_refused() {
    let generator = Scripted::new(|r: &GenerateRequest, _| Ok(reply(r, "[0]")));
    let spec = GameSpec {
        env_id: "TicTacToe-v0".into(),
        seed: 0,
        seats: vec![Seat::Model(None)],
        learner_seat: Some(0),
        runner_id: "x".into(),
    };
    assert!(matches!(
        play_game(&generator, spec, &settings()).await,
        Err(GameError::Setup(_))
    ));
}

#[test]
fn outcomes_compare_rewards() {
    assert_eq!(Outcome::of(&[1.0, -1.0], 0), Outcome::Win);
    assert_eq!(Outcome::of(&[1.0, -1.0], 1), Outcome::Loss);
    assert_eq!(Outcome::of(&[0.0, 0.0], 1), Outcome::Draw);
    assert_eq!(Outcome::of(&[1.0], 0), Outcome::Win);
    assert_eq!(Outcome::of(&[0.6], 0), Outcome::Loss);
}

fn vs_random(learner_seat: usize, bot_seed: u64) -> Vec<Seat> {
    let text = TextConfig::default();
    arrange(
        Seat::learner(&text, 1).unwrap(),
        || Ok(Seat::Bot(make_bot("random", bot_seed, &text)?)),
        2,
        learner_seat,
    )
    .unwrap()
}

#[tokio::test]
async fn a_branched_game_plays_one_position_on_with_its_own_moves_and_the_shared_ones_replayed() {
    use relay_policy::text::play_branched;
    use relay_proto::WireMessage;
    // The model takes the available move its sampling seed points at, so
    // continuations sampling with other seeds move elsewhere.
    let rule = |r: &GenerateRequest, _| {
        let moves = available_moves(r);
        let seed = r.sampling.seed.expect("a sampling seed");
        Ok(reply(r, &moves[(seed % moves.len() as u64) as usize]))
    };
    for (learner_seat, pick) in [(0, 0.0), (1, 0.5), (0, 0.999)] {
        let spec = |seats| GameSpec {
            env_id: "TicTacToe-v0".into(),
            seed: 5,
            seats,
            learner_seat: Some(learner_seat),
            runner_id: "test".into(),
        };
        let generator = Scripted::new(rule);
        let more = (0..3).map(|i| vs_random(learner_seat, 50 + i)).collect();
        let games = play_branched(
            &generator,
            spec(vs_random(learner_seat, 9)),
            more,
            pick,
            77,
            &settings(),
        )
        .await
        .unwrap();
        // Continuation 0 is the game as `play_game` plays it.
        let plain = play_game(
            &Scripted::new(rule),
            spec(vs_random(learner_seat, 9)),
            &settings(),
        )
        .await
        .unwrap();
        assert_eq!(games.len(), 4);
        let branch = games[0].record.branch.expect("branched");
        assert_eq!(
            games[0].record.turns, plain.record.turns,
            "continuation 0 is the plain game"
        );
        let learning: Vec<usize> = plain.record.learning_turn_indices().collect();
        let expected = learning[((pick * learning.len() as f64) as usize).min(learning.len() - 1)];
        assert_eq!(
            branch.turn as usize, expected,
            "pick {pick} of {learning:?}"
        );
        let t = branch.turn as usize;
        for (i, game) in games.iter().enumerate() {
            let r = &game.record;
            r.validate().unwrap();
            roundtrip(r);
            assert_eq!(
                r.branch,
                Some(relay_proto::Branch {
                    group: 77,
                    turn: t as u32,
                    index: i as u32,
                    size: 4
                })
            );
            assert_eq!(
                r.turns[..t],
                plain.record.turns[..t],
                "shared turns replayed"
            );
            assert_eq!(
                r.turns[t].player as usize, learner_seat,
                "branching at a learning move"
            );
            assert_eq!(r.own_turns_from(), if i == 0 { 0 } else { t });
            assert!(r.learning_turn_indices().all(|j| i == 0 || j >= t));
        }
        // The branching prompt was asked 4 times, each with its own seed
        // (as was any prompt asked more than once).
        let mut seeds: std::collections::HashMap<String, Vec<u64>> = Default::default();
        for r in generator.requests.lock().unwrap().iter() {
            seeds
                .entry(format!("{:?}", r.prompt))
                .or_default()
                .push(r.sampling.seed.unwrap());
        }
        assert!(seeds.values().any(|s| s.len() >= 4));
        for s in seeds.values() {
            let distinct: std::collections::HashSet<_> = s.iter().collect();
            assert_eq!(distinct.len(), s.len(), "one prompt, repeated seeds: {s:?}");
        }
    }
}

#[tokio::test]
async fn last_before_loss_branches_a_lost_game_at_its_last_learning_move_and_others_uniformly() {
    use relay_config::BranchPosition;
    use relay_policy::text::play_branched;
    let rule = |r: &GenerateRequest, _| {
        let moves = available_moves(r);
        let seed = r.sampling.seed.expect("a sampling seed");
        Ok(reply(r, &moves[(seed % moves.len() as u64) as usize]))
    };
    let settings = GameSettings {
        branch_at: BranchPosition::LastBeforeLoss,
        ..settings()
    };
    let (mut lost, mut other) = (0, 0);
    for seed in 0..40u64 {
        let learner_seat = (seed % 2) as usize;
        let spec = GameSpec {
            env_id: "TicTacToe-v0".into(),
            seed,
            seats: vs_random(learner_seat, seed + 100),
            learner_seat: Some(learner_seat),
            runner_id: "test".into(),
        };
        let more = vec![vs_random(learner_seat, seed + 200)];
        let games = play_branched(&Scripted::new(rule), spec, more, 0.0, seed, &settings)
            .await
            .unwrap();
        let learning: Vec<usize> = games[0].record.learning_turn_indices().collect();
        let turn = games[0].record.branch.expect("branched").turn as usize;
        if games[0].outcome() == Some(Outcome::Loss) {
            lost += 1;
            assert_eq!(
                turn,
                *learning.last().unwrap(),
                "seed {seed}: the last move"
            );
            // The opponent won right after it: the learner's move was the last before the loss.
            assert_eq!(turn + 2, games[0].record.turns.len(), "seed {seed}");
        } else {
            other += 1;
            assert_eq!(
                turn, learning[0],
                "seed {seed}: pick 0 draws the first move"
            );
        }
    }
    assert!(lost > 0 && other > 0, "{lost} lost, {other} not");
}

#[tokio::test]
async fn distinct_branch_moves_differ_until_the_legal_moves_run_out() {
    use relay_policy::text::play_branched;
    use relay_proto::WireMessage;
    // A deterministic policy: the first move it may play.
    let rule = |r: &GenerateRequest, _| {
        let moves = if r.allowed.is_empty() {
            available_moves(r)
        } else {
            r.allowed.clone()
        };
        Ok(reply(r, &moves[0]))
    };
    let distinct = GameSettings {
        distinct_branch_moves: true,
        ..settings()
    };
    for (pick, learner_seat) in [(0.0, 0), (0.0, 1), (0.999, 0), (0.999, 1)] {
        let spec = GameSpec {
            env_id: "TicTacToe-v0".into(),
            seed: 3,
            seats: vs_random(learner_seat, 7),
            learner_seat: Some(learner_seat),
            runner_id: "test".into(),
        };
        let more = (0..3).map(|i| vs_random(learner_seat, 20 + i)).collect();
        let games = play_branched(&Scripted::new(rule), spec, more, pick, 1, &distinct)
            .await
            .unwrap();
        let t = games[0].record.branch.unwrap().turn as usize;
        let legal = 9 - t;
        let moves: Vec<&str> = games
            .iter()
            .map(|g| g.record.turns[t].action.as_str())
            .collect();
        let distinct: std::collections::HashSet<_> = moves.iter().collect();
        assert_eq!(
            distinct.len(),
            legal.min(4),
            "pick {pick}, seat {learner_seat}: {moves:?}"
        );
        for g in &games {
            assert!(!g.record.turns[t].invalid);
            g.record.validate().unwrap();
        }
    }
    // Without the setting, the deterministic policy repeats its move.
    let spec = GameSpec {
        env_id: "TicTacToe-v0".into(),
        seed: 3,
        seats: vs_random(0, 7),
        learner_seat: Some(0),
        runner_id: "test".into(),
    };
    let more = (0..3).map(|i| vs_random(0, 20 + i)).collect();
    let games = play_branched(&Scripted::new(rule), spec, more, 0.0, 1, &settings())
        .await
        .unwrap();
    assert!(games
        .iter()
        .all(|g| g.record.turns[0].action == games[0].record.turns[0].action));
}
