//! What text mode measures: its Prometheus counters, the windows of
//! recent games behind the values reported to the tracker (overall and
//! per game), and the training episodes it publishes.

use std::collections::{HashMap, HashSet, VecDeque};
use std::hash::{Hash, Hasher};

use prometheus::{Histogram, HistogramOpts, IntCounter, IntCounterVec, Opts};
use relay_kit::{counter, gauge, Service};
use relay_policy::text::{Outcome, PlayedGame};
use relay_proto::{EpisodeReport, EpisodeSummary, SCHEMA_VERSION};

/// Recent games behind the reported win/draw/loss rates and mean return.
const RECENT_GAMES: usize = 100;
/// Recent learning moves behind the invalid-move rate and the move entropy.
const RECENT_MOVES: usize = 1000;
/// Distinct states remembered; the count saturates there (bounded memory).
const MAX_DISTINCT_STATES: usize = 1 << 20;

pub(super) struct TextMetrics {
    pub(super) games: IntCounterVec,
    pub(super) abandoned: IntCounterVec,
    pub(super) moves: IntCounter,
    invalid_moves: IntCounter,
    no_answer: IntCounter,
    illegal_answers: IntCounter,
    truncated_thoughts: IntCounter,
    pub(super) retries: IntCounter,
    pub(super) turn_seconds: Histogram,
    pub(super) game_seconds: Histogram,
    pub(super) completion_tokens: IntCounter,
    pub(super) generated_chars: IntCounter,
    pub(super) worker_restarts: IntCounter,
}

impl TextMetrics {
    pub(super) fn register(registry: &prometheus::Registry) -> Self {
        let games = IntCounterVec::new(
            Opts::new(
                "relay_env_runner_games_total",
                "Text games finished, by game, opponent and the learning seat's outcome (win, draw, loss).",
            ),
            &["game", "opponent", "outcome"],
        )
        .unwrap();
        let abandoned = IntCounterVec::new(
            Opts::new(
                "relay_env_runner_games_abandoned_total",
                "Text games abandoned because a model seat got no usable reply, by the last failure.",
            ),
            &["reason"],
        )
        .unwrap();
        let moves = IntCounter::new(
            "relay_env_runner_model_moves_total",
            "Moves the learning policy submitted in finished text games.",
        )
        .unwrap();
        let invalid_moves = IntCounter::new(
            "relay_env_runner_invalid_moves_total",
            "Moves of the learning policy that the game refused.",
        )
        .unwrap();
        let no_answer = IntCounter::new(
            "relay_env_runner_no_answer_total",
            "Moves of the learning policy whose reply held no answer in the run's answer format (text.answer).",
        )
        .unwrap();
        let illegal_answers = IntCounter::new(
            "relay_env_runner_illegal_answers_total",
            "Moves of the learning policy whose answer was found but refused by the game.",
        )
        .unwrap();
        let truncated_thoughts = IntCounter::new(
            "relay_env_runner_truncated_thoughts_total",
            "Moves of the learning policy whose reply reached text.max_turn_tokens before its answer.",
        )
        .unwrap();
        let retries = IntCounter::new(
            "relay_env_runner_generate_retries_total",
            "Generate requests that failed and were retried.",
        )
        .unwrap();
        let turn_seconds = Histogram::with_opts(
            HistogramOpts::new(
                "relay_env_runner_turn_seconds",
                "Wall time of one model move: generate request(s) and the game's step.",
            )
            .buckets(vec![
                1e-3, 3e-3, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0, 100.0,
            ]),
        )
        .unwrap();
        let game_seconds = Histogram::with_opts(
            HistogramOpts::new(
                "relay_env_runner_game_seconds",
                "Wall time of one text game.",
            )
            .buckets(vec![
                0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0, 100.0, 300.0,
            ]),
        )
        .unwrap();
        let completion_tokens = IntCounter::new(
            "relay_env_runner_completion_tokens_total",
            "Completion tokens generated for this env-runner's model seats.",
        )
        .unwrap();
        let generated_chars = IntCounter::new(
            "relay_env_runner_generated_chars_total",
            "Characters of the completions generated for this env-runner's model seats.",
        )
        .unwrap();
        // The same series as a Gymnasium run's: TextArena workers are the
        // bridge's Python workers too.
        let worker_restarts = IntCounter::new(
            "relay_env_runner_worker_restarts_total",
            "Python env workers restarted after a crash or a hang.",
        )
        .unwrap();
        relay_kit::metrics::register(registry, &games);
        relay_kit::metrics::register(registry, &abandoned);
        relay_kit::metrics::register(registry, &moves);
        relay_kit::metrics::register(registry, &invalid_moves);
        relay_kit::metrics::register(registry, &no_answer);
        relay_kit::metrics::register(registry, &illegal_answers);
        relay_kit::metrics::register(registry, &truncated_thoughts);
        relay_kit::metrics::register(registry, &retries);
        relay_kit::metrics::register(registry, &turn_seconds);
        relay_kit::metrics::register(registry, &game_seconds);
        relay_kit::metrics::register(registry, &completion_tokens);
        relay_kit::metrics::register(registry, &generated_chars);
        relay_kit::metrics::register(registry, &worker_restarts);
        Self {
            games,
            abandoned,
            moves,
            invalid_moves,
            no_answer,
            illegal_answers,
            truncated_thoughts,
            retries,
            turn_seconds,
            game_seconds,
            completion_tokens,
            generated_chars,
            worker_restarts,
        }
    }
}

/// Running statistics of one game (a `text.games` entry) behind its
/// labelled values.
#[derive(Default)]
pub(super) struct GameWindow {
    /// Games finished since the last report.
    finished: u64,
    outcomes: VecDeque<Outcome>,
    returns: VecDeque<f64>,
    /// Turns of the recent games (every seat's).
    lengths: VecDeque<f64>,
    /// Recent learning moves: whether the game accepted each.
    moves: VecDeque<bool>,
}

impl GameWindow {
    fn add_game(&mut self, game: &PlayedGame) {
        self.finished += 1;
        push_bounded(&mut self.outcomes, game.outcome(), RECENT_GAMES);
        push_bounded(&mut self.returns, game.learner_reward(), RECENT_GAMES);
        push_bounded(
            &mut self.lengths,
            Some(game.record.turns.len() as f64),
            RECENT_GAMES,
        );
        let learning = game.learning_seats();
        for turn in &game.record.turns {
            if learning.contains(&(turn.player as usize)) {
                push_bounded(&mut self.moves, Some(!turn.invalid), RECENT_MOVES);
            }
        }
    }

    /// The values reported for `game`, each labelled with it; the count of
    /// games since the last report is taken.
    pub(super) fn values(&mut self, game: &str) -> Vec<relay_proto::MetricValue> {
        let mean = |q: &VecDeque<f64>| q.iter().sum::<f64>() / q.len().max(1) as f64;
        let rate = |o: Outcome| {
            self.outcomes.iter().filter(|&&x| x == o).count() as f64
                / self.outcomes.len().max(1) as f64
        };
        let mut values = vec![counter(
            "text_games_total",
            std::mem::take(&mut self.finished) as f64,
        )];
        if !self.returns.is_empty() {
            values.push(gauge("env_runner_game_return_mean", mean(&self.returns)));
        }
        if !self.lengths.is_empty() {
            values.push(gauge("env_runner_game_length_mean", mean(&self.lengths)));
        }
        if !self.outcomes.is_empty() {
            values.push(gauge("env_runner_game_win_rate", rate(Outcome::Win)));
            values.push(gauge("env_runner_game_draw_rate", rate(Outcome::Draw)));
            values.push(gauge("env_runner_game_loss_rate", rate(Outcome::Loss)));
        }
        if !self.moves.is_empty() {
            values.push(gauge(
                "env_runner_game_legal_move_rate",
                self.moves.iter().filter(|&&ok| ok).count() as f64 / self.moves.len() as f64,
            ));
        }
        values
            .into_iter()
            .map(|v| v.with_label("game", game))
            .collect()
    }
}

/// Running statistics behind the reported values.
#[derive(Default)]
pub(super) struct Window {
    pub(super) outcomes: VecDeque<Outcome>,
    pub(super) returns: VecDeque<f64>,
    /// Recent learning moves: (valid, action text).
    pub(super) moves: VecDeque<(bool, String)>,
    pub(super) states: HashSet<u64>,
    /// Finished training episodes not yet published, per game.
    episodes: std::collections::BTreeMap<String, Vec<EpisodeSummary>>,
    pub(super) policy_version: u64,
    /// Per game (every game of the run, from the start).
    pub(super) games: std::collections::BTreeMap<String, GameWindow>,
}

impl Window {
    pub(super) fn add_game(&mut self, game: &PlayedGame) {
        push_bounded(&mut self.outcomes, game.outcome(), RECENT_GAMES);
        if let Some(reward) = game.learner_reward() {
            push_bounded(&mut self.returns, Some(reward), RECENT_GAMES);
            self.episodes
                .entry(game.record.env_id.clone())
                .or_default()
                .push(EpisodeSummary {
                    episode_return: reward,
                    length: game.record.turns.len() as u32,
                    terminated: true,
                    ..Default::default()
                });
        }
        self.games
            .entry(game.record.env_id.clone())
            .or_default()
            .add_game(game);
        let learning = game.learning_seats();
        for turn in &game.record.turns {
            if learning.contains(&(turn.player as usize)) {
                let action = turn.action.trim().to_string();
                push_bounded(&mut self.moves, Some((!turn.invalid, action)), RECENT_MOVES);
                if let Some(version) = turn.adapter.as_ref().and_then(|a| a.version) {
                    self.policy_version = version;
                }
            }
        }
        for key in &game.states {
            if self.states.len() >= MAX_DISTINCT_STATES {
                break;
            }
            let mut hasher = std::collections::hash_map::DefaultHasher::new();
            key.hash(&mut hasher);
            self.states.insert(hasher.finish());
        }
    }

    pub(super) fn rate(&self, outcome: Outcome) -> f64 {
        self.outcomes.iter().filter(|&&o| o == outcome).count() as f64
            / self.outcomes.len().max(1) as f64
    }

    pub(super) fn invalid_move_rate(&self) -> f64 {
        self.moves.iter().filter(|(valid, _)| !valid).count() as f64
            / self.moves.len().max(1) as f64
    }

    /// Entropy in bits of the learning policy's recent valid moves (their
    /// trimmed text).
    pub(super) fn move_entropy(&self) -> Option<f64> {
        let mut counts: HashMap<&str, usize> = HashMap::new();
        for (_, action) in self.moves.iter().filter(|(valid, _)| *valid) {
            *counts.entry(action).or_default() += 1;
        }
        let total: usize = counts.values().sum();
        (total > 0).then(|| {
            counts
                .values()
                .map(|&c| {
                    let p = c as f64 / total as f64;
                    -p * p.log2()
                })
                .sum::<f64>()
                .max(0.0)
        })
    }
}

fn push_bounded<T>(queue: &mut VecDeque<T>, item: Option<T>, bound: usize) {
    if let Some(item) = item {
        if queue.len() == bound {
            queue.pop_front();
        }
        queue.push_back(item);
    }
}
/// Counts a game's own moves (not the ones a continuation replayed): the
/// learning seats' moves, refusals, missing answers and truncated
/// thoughts, completion tokens and characters.
pub(super) fn count_moves(metrics: &TextMetrics, game: &PlayedGame) {
    let own = &game.record.turns[game.record.own_turns_from()..];
    let tokens: usize = own.iter().map(|t| t.completion_tokens.numel()).sum();
    metrics.completion_tokens.inc_by(tokens as u64);
    metrics.generated_chars.inc_by(game.completion_chars as u64);
    let learning = game.learning_seats();
    for turn in own {
        if learning.contains(&(turn.player as usize)) {
            metrics.moves.inc();
            if turn.invalid {
                metrics.invalid_moves.inc();
            }
            if turn.no_answer {
                metrics.no_answer.inc();
            } else if turn.invalid {
                metrics.illegal_answers.inc();
            }
            if turn.truncated {
                metrics.truncated_thoughts.inc();
            }
        }
    }
}

/// Publishes the finished training episodes, one report per game.
pub(super) async fn publish_episodes(service: &Service, window: &mut Window) {
    for (env_id, episodes) in std::mem::take(&mut window.episodes) {
        if episodes.is_empty() {
            continue;
        }
        let report = EpisodeReport {
            schema: SCHEMA_VERSION,
            runner_id: service.instance.clone(),
            env_id,
            policy_version: window.policy_version,
            episodes,
        };
        let _ = service
            .publish_within(service.subjects.episodes(), report)
            .await;
    }
}
