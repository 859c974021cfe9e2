//! Text mode of the env-runner (`run.env_id` is a text game): plays
//! `text.games_in_flight` games at a time, continuously, with the shared
//! game loop ([`relay_policy::text::play_game`]).
//!
//! Multi-game runs (`text.games`): each new game's text game is drawn
//! from the games' weights by the same seeded RNG (single-game runs draw
//! nothing, so their games are those of before); every record says its
//! game (`GameRecord::env_id`), training episodes are published per game,
//! and the per-game values below carry a `game` label. The league (pool
//! ratings, `league` opponents) is single-game: off in multi-game runs.
//!
//! Each game seats the learning side (`text.learner`: the learning adapter,
//! or a bot for baselines) at a seat drawn by a seeded RNG and fills the
//! other seats with an opponent drawn from `text.opponents` by weight. Each
//! finished game is published as a [`relay_proto::GameRecord`] on
//! `relay.<run>.games`, and its learning-seat reward as a training episode
//! (`EpisodeReport`, batched each second) so the tracker's training-return
//! metrics keep working. A game whose model seat gets no usable reply after
//! `text.generate_attempts` tries is abandoned and counted
//! (`relay_env_runner_games_abandoned_total{reason}`), and new games wait a
//! second (`ABANDON_PAUSE`) so a missing inference server is not hammered.
//!
//! With `text.opponents.league` (the self-play league), that share of
//! games has its opponent drawn by `league.sampler` from the run's league
//! pool ([`crate::league`]): the current version itself (mirror), a past
//! version (seated as the learning adapter pinned at that version,
//! `policy@v<N>`), or a fixed bot; the sampler's coin decides who moves
//! first. A past version no inference server serves turns the game into a
//! mirror game (counted). Games of the learning adapter against bots and
//! past versions are recorded in the pool, which rates each version.
//! League games branch as the others do (`text.branches`), or only those
//! against the fixed members `league.branch_against` lists: the game as
//! drawn is rated, its continuations only train.
//!
//! Metrics: games by opponent and outcome, abandoned games, the learning
//! policy's moves and invalid moves, retries, time per model move and per
//! game, completion tokens and characters (on `/metrics`); win/draw/loss
//! and invalid-move rates, characters per second, distinct states seen
//! and move entropy (reported to the tracker each second). Per game
//! (label `game`, every run): `text_games_total`, and the
//! `env_runner_game_*` win/draw/loss rates, mean return, legal-move rate
//! and mean length (turns) of the last 100 games of that game.

mod metrics;

use std::time::{Duration, Instant};

use rand::distr::weighted::WeightedIndex;
use rand::distr::Distribution;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use relay_config::Opponent;
use relay_kit::{counter, gauge, Service, ServiceError, Shutdown};
use relay_league::{Matchup, MemberId};

use crate::league::{FallbackGenerate, FallbackReason, LeagueDraws, LeagueMetrics, LeagueRecorder};
use relay_policy::text::{
    arrange, learning_adapter, make_bot, play_branched, GameError, GameSettings, GameSpec,
    NatsGenerate, Outcome, PlayedGame, Seat, LEARNING_ADAPTER,
};
use relay_proto::{AdapterRef, GameRecord};
use tokio::task::JoinSet;

use metrics::{count_moves, publish_episodes, GameWindow, TextMetrics, Window};

/// How long new games wait after one was abandoned.
const ABANDON_PAUSE: Duration = Duration::from_secs(1);

/// Where a training game's opponent comes from: a `text.opponents` entry,
/// or the league sampler.
enum Pick {
    Listed(Opponent),
    League,
}

/// The opponent of a league game as seated.
enum LeagueOpponent {
    /// The current version itself.
    Mirror,
    /// A past version, pinned.
    Past(u64),
    /// A fixed bot.
    Bot(String),
    /// A fixed adapter the inference servers hold, by name.
    Adapter(String),
}

/// What a league game was meant to be, for its metrics.
struct LeagueGame {
    /// `self`, `past` or the bot's name.
    opponent: String,
    /// The sampler rule that chose it (`none` when there was no draw).
    sampler: &'static str,
    /// Why it is a mirror game instead of the drawn one, if it is.
    fallback: Option<FallbackReason>,
    /// The pinned past version, if one was seated.
    past: Option<u64>,
    /// The past version was not served and the current one played it.
    fell_back: bool,
}

/// What a finished game task hands back: the games-metric label, the
/// league game's details, the game followed by the continuations of its
/// branched position (`text.branches > 1`).
type Finished = (
    String,
    Option<LeagueGame>,
    Result<Vec<PlayedGame>, GameError>,
);

/// The opponent a draw seats (a fixed member that is not a bot this runner
/// plays is replaced by mirror play).
fn league_opponent(matchup: &Matchup) -> (LeagueOpponent, Option<FallbackReason>) {
    match &matchup.opponent {
        MemberId::Version(version) if *version == matchup.current => (LeagueOpponent::Mirror, None),
        MemberId::Version(version) => (LeagueOpponent::Past(*version), None),
        MemberId::Fixed(name) if relay_config::BOT_NAMES.contains(&name.as_str()) => {
            (LeagueOpponent::Bot(name.clone()), None)
        }
        MemberId::Fixed(name) => match name.strip_prefix("adapter:") {
            Some(adapter) => (LeagueOpponent::Adapter(adapter.to_string()), None),
            None => (LeagueOpponent::Mirror, Some(FallbackReason::Unplayable)),
        },
    }
}

/// Draws the opponent of one league game and seats it: the sampler's coin
/// decides who moves first (a random seat when there was no draw).
fn seat_league_game(
    draws: &LeagueDraws,
    rng: &mut ChaCha8Rng,
    text: &relay_config::TextConfig,
    branch_against: Option<&[String]>,
    players: usize,
    env_id: &str,
    runner_id: &str,
) -> Result<(BranchedGame, LeagueGame), ServiceError> {
    let (seated, learner_seat, sampler, fallback) = match draws.draw(rng) {
        Ok(matchup) => {
            let (seated, fallback) = league_opponent(&matchup);
            let seat = if matchup.current_moves_first { 0 } else { 1 };
            (seated, seat, matchup.sampler.as_str(), fallback)
        }
        Err(reason) => (
            LeagueOpponent::Mirror,
            rng.random_range(0..players),
            "none",
            Some(reason),
        ),
    };
    let (label, past) = match &seated {
        LeagueOpponent::Mirror => ("self".to_string(), None),
        LeagueOpponent::Past(version) => ("past".to_string(), Some(*version)),
        LeagueOpponent::Bot(name) => (name.clone(), None),
        LeagueOpponent::Adapter(name) => (format!("adapter:{name}"), None),
    };
    let branched = branched_game(
        rng,
        text,
        league_branches(&seated, text.branches, branch_against),
        (env_id, players, learner_seat),
        runner_id,
        |bot_seed| {
            Ok(match &seated {
                LeagueOpponent::Mirror => Seat::Model(Some(learning_adapter())),
                LeagueOpponent::Past(version) => Seat::Model(Some(AdapterRef {
                    name: LEARNING_ADAPTER.to_string(),
                    version: Some(*version),
                })),
                LeagueOpponent::Bot(name) => Seat::Bot(make_bot(name, bot_seed, text)?),
                LeagueOpponent::Adapter(name) => Seat::Model(Some(AdapterRef {
                    name: name.clone(),
                    version: None,
                })),
            })
        },
    )?;
    let game = LeagueGame {
        opponent: label,
        sampler,
        fallback,
        past,
        fell_back: false,
    };
    Ok((branched, game))
}

/// How many games a league game against `seated` plays from its branched
/// position: `text.branches` for every league game, unless
/// `league.branch_against` lists the fixed members whose games branch.
fn league_branches(
    seated: &LeagueOpponent,
    branches: usize,
    branch_against: Option<&[String]>,
) -> usize {
    let Some(listed) = branch_against else {
        return branches;
    };
    let member = match seated {
        LeagueOpponent::Bot(name) => name.clone(),
        LeagueOpponent::Adapter(name) => format!("adapter:{name}"),
        LeagueOpponent::Mirror | LeagueOpponent::Past(_) => return 1,
    };
    if listed.contains(&member) {
        branches
    } else {
        1
    }
}

/// A game to play and the seats of the continuations of its branched
/// position (`text.branches - 1` of them; see
/// [`relay_policy::text::play_branched`]).
struct BranchedGame {
    spec: GameSpec,
    more: Vec<Vec<Seat>>,
    pick: f64,
    group: u64,
}

impl BranchedGame {
    async fn play<G: relay_policy::text::Generate>(
        self,
        generator: &G,
        settings: &GameSettings,
    ) -> Result<Vec<PlayedGame>, GameError> {
        play_branched(
            generator, self.spec, self.more, self.pick, self.group, settings,
        )
        .await
    }
}

/// Seats a game of `env_id` for `players` with the learner at
/// `learner_seat` and `opponent(bot_seed)` in every other seat, and the
/// `branches - 1` continuations of its branched position with the same
/// policies, the learner and the bots seeded afresh each time.
fn branched_game(
    rng: &mut ChaCha8Rng,
    text: &relay_config::TextConfig,
    branches: usize,
    (env_id, players, learner_seat): (&str, usize, usize),
    runner_id: &str,
    opponent: impl Fn(u64) -> Result<Seat, String>,
) -> Result<BranchedGame, ServiceError> {
    let draw_seats = |rng: &mut ChaCha8Rng| -> Result<Vec<Seat>, ServiceError> {
        let learner = Seat::learner(text, rng.random()).map_err(ServiceError::other)?;
        let bot_seed: u64 = rng.random();
        arrange(learner, || opponent(bot_seed), players, learner_seat).map_err(ServiceError::other)
    };
    let seats = draw_seats(rng)?;
    let spec = GameSpec {
        env_id: env_id.to_string(),
        seed: rng.random(),
        seats,
        learner_seat: Some(learner_seat),
        runner_id: runner_id.to_string(),
    };
    let more = (1..branches)
        .map(|_| draw_seats(rng))
        .collect::<Result<Vec<_>, _>>()?;
    let (pick, group) = if more.is_empty() {
        (0.0, 0)
    } else {
        (rng.random(), rng.random())
    };
    Ok(BranchedGame {
        spec,
        more,
        pick,
        group,
    })
}

/// A league game whose past version was not served at all is the mirror
/// game it was played as: the opponent seat becomes the learning seat's
/// policy (so both seats train, and it is not rated). If the pinned
/// version played some moves before it was lost, the record stays as it
/// is (and is not rated: its versions are mixed).
fn as_mirror(game: &mut PlayedGame, past: u64) {
    let record = &mut game.record;
    let Some(learner) = record.learner_seat.map(usize::from) else {
        return;
    };
    if record.seats.len() != 2 || learner > 1 {
        return;
    }
    let other = 1 - learner;
    let pinned_moved = record.turns.iter().any(|t| {
        t.player as usize == other && t.adapter.as_ref().and_then(|a| a.version) == Some(past)
    });
    if !pinned_moved {
        record.seats[other] = record.seats[learner].clone();
    }
}

/// Runs text mode until shutdown.
pub(crate) async fn run(
    service: Service,
    shutdown: Shutdown,
    seed: u64,
) -> Result<(), ServiceError> {
    let cfg = service.config.clone();
    let text = &cfg.text;
    let env_id = cfg.run.env_id.clone();
    let metrics = TextMetrics::register(&service.registry);
    let settings = GameSettings::from_config(text, &cfg.env);
    let generator = NatsGenerate::new(service.nats.clone(), service.subjects.generate());
    // The run's games: id, players, weight (`text.games`, else `run.env_id`).
    let mut game_ids: Vec<(String, usize)> = Vec::new();
    let mut game_weights: Vec<f64> = Vec::new();
    for (game, weight) in text.game_weights(&env_id) {
        let players = relay_bridge::make_text_game(&game, &cfg.env)
            .map_err(|e| ServiceError::other(format!("text.games.{game}: {e}")))?
            .num_players();
        game_ids.push((game, players));
        game_weights.push(weight);
    }
    let pick_game = WeightedIndex::new(&game_weights)
        .map_err(|e| ServiceError::other(format!("text.games: {e}")))?;
    // Single-game runs: the run's game (and its league, when it has one).
    let players = game_ids
        .iter()
        .find(|(g, _)| *g == env_id)
        .map_or(2, |(_, p)| *p);
    let mut opponents: Vec<(Pick, f64)> = text
        .opponent_weights()?
        .into_iter()
        .map(|(opponent, weight)| (Pick::Listed(opponent), weight))
        .collect();
    let league_metrics = LeagueMetrics::register(&service.registry);
    // League games draw their opponents from the pool (two players, the
    // model learning: checked by the config).
    let draws = if cfg.league_enabled() && players == 2 {
        opponents.push((Pick::League, text.league_weight()));
        Some(LeagueDraws::start(cfg.clone(), shutdown.clone()).map_err(ServiceError::other)?)
    } else {
        None
    };
    let pick = WeightedIndex::new(opponents.iter().map(|(_, w)| *w))
        .map_err(|e| ServiceError::other(format!("text.opponents: {e}")))?;
    // Games of the learning adapter against bots and past versions rate
    // its versions.
    let league = (players == 2 && text.learner_bot().is_none() && !text.multi_game())
        .then(|| LeagueRecorder::start(cfg.clone(), shutdown.clone()));
    let mut window = Window::default();
    for (game, _) in &game_ids {
        window.games.insert(game.clone(), GameWindow::default());
    }
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut games: JoinSet<Finished> = JoinSet::new();
    let mut paused_until: Option<tokio::time::Instant> = None;
    let mut report = tokio::time::interval(Duration::from_secs(1));
    report.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let (mut reported_moves, mut reported_tokens, mut reported_chars) = (0u64, 0u64, 0u64);
    let (mut finished_games, mut reported_games) = (0u64, 0u64);
    let mut reported_at = Instant::now();
    tracing::info!(%env_id, games = ?game_ids, in_flight = text.games_in_flight, learner = %text.learner, "text mode");
    service.health.set_ready(true);

    loop {
        let paused = paused_until.is_some_and(|t| tokio::time::Instant::now() < t);
        while !paused && games.len() < text.games_in_flight {
            // Several games: draw this one's (one game: no draw, so the
            // RNG stream of single-game runs is unchanged).
            let (game_id, players) = if game_ids.len() > 1 {
                game_ids[pick_game.sample(&mut rng)].clone()
            } else {
                game_ids[0].clone()
            };
            let (opponent, _) = &opponents[pick.sample(&mut rng)];
            let opponent = match opponent {
                Pick::Listed(opponent) => opponent,
                Pick::League => {
                    let draws = draws.as_ref().expect("league picks need draws");
                    let (branched, game) = seat_league_game(
                        draws,
                        &mut rng,
                        text,
                        cfg.league.branch_against.as_deref(),
                        players,
                        &env_id,
                        &service.instance,
                    )?;
                    let settings = settings.clone();
                    if game.past.is_some() {
                        let pinned = FallbackGenerate::new(
                            service.nats.clone(),
                            service.subjects.generate(),
                        );
                        games.spawn(async move {
                            let played = branched.play(&pinned, &settings).await;
                            let game = LeagueGame {
                                fell_back: pinned.fell_back(),
                                ..game
                            };
                            ("league".to_string(), Some(game), played)
                        });
                    } else {
                        let generator = generator.clone();
                        games.spawn(async move {
                            let played = branched.play(&generator, &settings).await;
                            ("league".to_string(), Some(game), played)
                        });
                    }
                    continue;
                }
            };
            let label = if players == 1 {
                "none".to_string()
            } else {
                opponent.label()
            };
            let learner_seat = rng.random_range(0..players);
            let branched = branched_game(
                &mut rng,
                text,
                text.branches,
                (&game_id, players, learner_seat),
                &service.instance,
                |bot_seed| Seat::opponent(opponent, bot_seed, text),
            )?;
            let (generator, settings) = (generator.clone(), settings.clone());
            games.spawn(async move {
                let played = branched.play(&generator, &settings).await;
                (label, None, played)
            });
        }
        tokio::select! {
            _ = shutdown.wait() => break,
            _ = tokio::time::sleep_until(paused_until.unwrap_or_else(tokio::time::Instant::now)), if paused => {
                paused_until = None;
            }
            Some(joined) = games.join_next() => match joined {
                Ok((label, league_game, Ok(played))) => {
                    let mut played = played.into_iter();
                    let mut game = played.next().expect("a finished task holds its game");
                    finished_games += 1;
                    if let Some(league_game) = league_game {
                        count_league_game(&league_metrics, league_game, &mut game);
                    }
                    if let Some(league) = &league {
                        if let Some(result) = league.game(&game) {
                            if let MemberId::Version(past) = result.opponent {
                                league_metrics
                                    .opponent_lag
                                    .observe(result.current.saturating_sub(past) as f64);
                            }
                        }
                    }
                    finished(&service, &metrics, &mut window, &label, game).await;
                    for continuation in played {
                        finished_continuation(&service, &metrics, continuation).await;
                    }
                }
                Ok((_, _, Err(GameError::Abandoned { last, turn, player, attempts }))) => {
                    tracing::warn!(error = %last, turn, player, attempts, "game abandoned");
                    metrics.abandoned.with_label_values(&[last.label()]).inc();
                    metrics.retries.inc_by(attempts.saturating_sub(1) as u64);
                    paused_until = Some(tokio::time::Instant::now() + ABANDON_PAUSE);
                }
                Ok((_, _, Err(e))) => {
                    tracing::error!(error = %e, "game failed");
                    metrics.abandoned.with_label_values(&["error"]).inc();
                }
                Err(e) => {
                    tracing::error!(error = %e, "game task failed");
                    metrics.abandoned.with_label_values(&["panic"]).inc();
                }
            },
            _ = report.tick() => {
                // The bridge counts its worker restarts per process.
                let restarts = relay_bridge::text::worker_restarts();
                metrics
                    .worker_restarts
                    .inc_by(restarts.saturating_sub(metrics.worker_restarts.get()));
                let elapsed = reported_at.elapsed().as_secs_f64().max(1e-9);
                reported_at = Instant::now();
                let moves = metrics.moves.get();
                let tokens = metrics.completion_tokens.get();
                let chars = metrics.generated_chars.get();
                let mut values = vec![
                    counter("env_steps_total", (moves - reported_moves) as f64),
                    counter("vec_steps_total", (moves - reported_moves) as f64),
                    counter("games_total", (finished_games - reported_games) as f64),
                    counter("completion_tokens_total", (tokens - reported_tokens) as f64),
                    gauge("env_runner_sps", (moves - reported_moves) as f64 / elapsed),
                    gauge("env_runner_chars_per_second", (chars - reported_chars) as f64 / elapsed),
                    gauge("env_runner_policy_version", window.policy_version as f64),
                    gauge("env_runner_distinct_states", window.states.len() as f64),
                ];
                if !window.returns.is_empty() {
                    values.push(gauge(
                        "env_runner_episode_return_mean",
                        window.returns.iter().sum::<f64>() / window.returns.len() as f64,
                    ));
                }
                if !window.outcomes.is_empty() {
                    values.push(gauge("env_runner_win_rate", window.rate(Outcome::Win)));
                    values.push(gauge("env_runner_draw_rate", window.rate(Outcome::Draw)));
                    values.push(gauge("env_runner_loss_rate", window.rate(Outcome::Loss)));
                }
                if !window.moves.is_empty() {
                    values.push(gauge("env_runner_invalid_move_rate", window.invalid_move_rate()));
                }
                if let Some(entropy) = window.move_entropy() {
                    values.push(gauge("env_runner_move_entropy", entropy));
                }
                for (game, stats) in window.games.iter_mut() {
                    values.extend(stats.values(game));
                }
                service.report(Some(moves), values).await;
                (reported_moves, reported_tokens, reported_chars) = (moves, tokens, chars);
                reported_games = finished_games;
                publish_episodes(&service, &mut window).await;
            }
        }
    }
    games.abort_all();
    publish_episodes(&service, &mut window).await;
    service.finish().await
}

/// Counts a finished league game by the opponent it really had, turning a
/// game whose past version was not served into the mirror game it was.
fn count_league_game(metrics: &LeagueMetrics, league_game: LeagueGame, game: &mut PlayedGame) {
    let mut opponent = league_game.opponent;
    let mut fallback = league_game.fallback;
    if let (true, Some(past)) = (league_game.fell_back, league_game.past) {
        as_mirror(game, past);
        opponent = "self".to_string();
        fallback = Some(FallbackReason::NotServed);
    }
    metrics
        .opponent_games
        .with_label_values(&[opponent.as_str(), league_game.sampler])
        .inc();
    if let Some(reason) = fallback {
        metrics
            .mirror_fallbacks
            .with_label_values(&[reason.label()])
            .inc();
    }
}

async fn finished(
    service: &Service,
    metrics: &TextMetrics,
    window: &mut Window,
    label: &str,
    game: PlayedGame,
) {
    if let Some(outcome) = game.outcome() {
        metrics
            .games
            .with_label_values(&[&game.record.env_id, label, outcome.label()])
            .inc();
    }
    metrics
        .game_seconds
        .observe(game.record.duration_ms as f64 / 1000.0);
    for seconds in &game.model_turn_seconds {
        metrics.turn_seconds.observe(*seconds);
    }
    metrics.retries.inc_by(game.retries as u64);
    count_moves(metrics, &game);
    window.add_game(&game);
    publish_game(service, game.record).await;
}

/// A continuation of a branched position: published for training and
/// counted in the move and token counters (its own moves only), but left
/// out of the game outcomes, returns and states reported, which describe
/// the games as drawn (a continuation's is conditioned on its position).
async fn finished_continuation(service: &Service, metrics: &TextMetrics, game: PlayedGame) {
    metrics.retries.inc_by(game.retries as u64);
    count_moves(metrics, &game);
    publish_game(service, game.record).await;
}

/// Publishes a game for training; one too large for any NATS message
/// fails the run with the size it needs, since the games like it could
/// never train.
async fn publish_game(service: &Service, record: GameRecord) {
    if let Err(e) = service
        .publish_within(service.subjects.games(), record)
        .await
    {
        service
            .fail(format!("a text game cannot be sent: {e}"))
            .await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn league_games_branch_unless_branch_against_leaves_their_opponent_out() {
        let random = LeagueOpponent::Bot("random".into());
        let minimax = LeagueOpponent::Bot("minimax".into());
        let adapter = LeagueOpponent::Adapter("sft".into());
        for seated in [&random, &minimax, &adapter, &LeagueOpponent::Mirror] {
            assert_eq!(league_branches(seated, 4, None), 4);
        }
        let listed = ["random".to_string(), "adapter:sft".to_string()];
        assert_eq!(league_branches(&random, 4, Some(&listed)), 4);
        assert_eq!(league_branches(&adapter, 4, Some(&listed)), 4);
        assert_eq!(league_branches(&minimax, 4, Some(&listed)), 1);
        assert_eq!(
            league_branches(&LeagueOpponent::Mirror, 4, Some(&listed)),
            1
        );
        assert_eq!(
            league_branches(&LeagueOpponent::Past(3), 4, Some(&listed)),
            1
        );
    }
}
