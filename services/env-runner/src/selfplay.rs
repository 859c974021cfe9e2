//! Self-play in multi-agent games stepped on observations (PettingZoo games
//! through the env bridge, `selfplay` in the config).
//!
//! Each env plays one game at a time. When a game starts the runner's
//! seeded RNG draws the learning policy's seat and the opponent that holds
//! the other seats (`selfplay.opponents`, by weight). A `league` game's
//! opponent and seating come from `league.sampler` over the run's pool
//! ([`crate::league`], as text runs draw theirs): the current version
//! (mirror), a past version, or a fixed bot. Every vector step moves each
//! env's mover: the learning seat and mirror opponents are acted by the
//! inference servers in one request, each past version's seats in one
//! request of their own that names the version (at the same time), the
//! fixed opponents (bots and saved checkpoints,
//! [`relay_policy::opponent::SeatOpponent`]) here, a batch each. A past
//! version no server holds (evicted meanwhile) is replaced by the current
//! one for the rest of that game, which then counts as a mirror game.
//!
//! League games against a past version or a bot are rated: their results
//! go to the pool's TrueSkill ([`LeagueRecorder`]) as the version of the
//! learning seat's last move (versions change within a game here, which
//! lasts a few of the learner's updates at most; the pool counts a version
//! between its admissions for the newest version it holds).
//!
//! Only the learning seat's moves are trained on. A move's transition ends
//! when that seat moves again or the game ends; its reward is everything
//! the seat earned in between (the other seats' moves included), so the
//! learner sees one agent's stream of steps whose next observation is that
//! agent's next turn, as PettingZoo's `env.last()` gives it. Each env keeps
//! its finished transitions in order, and a fragment is cut once every env
//! has `fragment_steps` of them. A game the learning seat never moved in
//! trains nothing and is counted, not reported as an episode.

use std::collections::VecDeque;
use std::time::Instant;

use prometheus::{IntCounter, IntCounterVec, Opts};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use relay_bridge::{BridgeError, VecEnvs};
use relay_envs::{gather_rows, EnvSpec, VecActions};
use relay_kit::{Service, ServiceError, Shutdown};
use relay_policy::opponent::SeatOpponent;
use relay_proto::{EpisodeSummary, RolloutFragment};

use crate::fragment::FragmentBuilder;
use crate::league::{FallbackReason, LeagueDraws, LeagueMetrics, LeagueRecorder, LeagueResult};
use crate::{act_until_answered, ActRows, Inserts, Metrics, Reported};
use relay_league::{MemberId, Outcome};

/// A move of the learning seat, its reward summed until its next move.
struct Move {
    obs: Vec<f32>,
    mask: Vec<u8>,
    action: i64,
    logprob: f32,
    value: f32,
    version: u64,
    reward: f64,
}

/// A finished transition of the learning seat.
struct Transition {
    step: Move,
    terminated: bool,
    truncated: bool,
    /// The seat's last observation of a game cut by the time limit.
    final_obs: Option<Vec<f32>>,
}

/// Who holds the seats the learning policy does not.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Against {
    /// The current policy, acted with the learning seat's rows.
    Current,
    /// A past version (a league opponent), acted in a request naming it.
    Past(u64),
    /// A fixed bot (an index into [`Opponents::bots`]), acted here.
    Bot(usize),
}

/// How a league game's opponent was drawn, for its metrics.
struct LeagueDraw {
    sampler: &'static str,
    fallback: Option<FallbackReason>,
}

/// Who sits where in one env's current game.
struct Game {
    seat: usize,
    against: Against,
    /// The opponent as episodes name it: `mirror`, a bot, or for league
    /// games `league:mirror`, `league:v<N>`, `league:<bot>`.
    label: String,
    league: Option<LeagueDraw>,
    learner_moves: u32,
    /// The version of the learning seat's last move.
    learner_version: u64,
    started: Instant,
}

/// An opponent kind of `selfplay.opponents`.
#[derive(Debug, Clone, Copy)]
enum Kind {
    Mirror,
    Bot(usize),
    League,
}

/// The opponents of `selfplay.opponents` (names, weights, kinds), the
/// bots they and the league's fixed members need, and the league's draws.
struct Opponents {
    names: Vec<String>,
    weights: Vec<f64>,
    kinds: Vec<Kind>,
    bot_names: Vec<String>,
    bots: Vec<SeatOpponent>,
    draws: Option<LeagueDraws>,
}

impl Opponents {
    fn new(
        cfg: &relay_config::ExperimentConfig,
        spec: &EnvSpec,
        draws: Option<LeagueDraws>,
    ) -> Result<Self, ServiceError> {
        let mut bot_names: Vec<String> = cfg.selfplay.bots().map(str::to_string).collect();
        if draws.is_some() {
            for fixed in cfg.league_fixed() {
                if !bot_names.contains(&fixed.name) {
                    bot_names.push(fixed.name);
                }
            }
        }
        let bots = bot_names
            .iter()
            .map(|name| SeatOpponent::new(name, spec))
            .collect::<Result<_, _>>()
            .map_err(|e| ServiceError::other(format!("selfplay.opponents: {e}")))?;
        let weighted = cfg.selfplay.weighted();
        let kinds = weighted
            .iter()
            .map(|(name, _)| match *name {
                relay_config::MIRROR_OPPONENT => Kind::Mirror,
                relay_config::LEAGUE_OPPONENT => Kind::League,
                bot => Kind::Bot(
                    bot_names
                        .iter()
                        .position(|b| b == bot)
                        .expect("every bot is made"),
                ),
            })
            .collect();
        Ok(Self {
            names: weighted.iter().map(|(name, _)| name.to_string()).collect(),
            weights: weighted.iter().map(|(_, w)| *w).collect(),
            kinds,
            bot_names,
            bots,
            draws,
        })
    }

    fn draw(&self, rng: &mut ChaCha8Rng) -> usize {
        let total: f64 = self.weights.iter().sum();
        let mut x = rng.random::<f64>() * total;
        for (i, w) in self.weights.iter().enumerate() {
            if x < *w {
                return i;
            }
            x -= w;
        }
        self.weights.len() - 1
    }

    /// A new game: the opponent drawn by weight, then for a league game
    /// the pool's draw (who moves first is the sampler's coin).
    fn new_game(&self, rng: &mut ChaCha8Rng, seats: usize) -> Game {
        let k = self.draw(rng);
        let game = |seat, against, label: String, league| Game {
            seat,
            against,
            label,
            league,
            learner_moves: 0,
            learner_version: 0,
            started: Instant::now(),
        };
        let (draws, Kind::League) = (&self.draws, self.kinds[k]) else {
            let against = match self.kinds[k] {
                Kind::Bot(b) => Against::Bot(b),
                _ => Against::Current,
            };
            return game(
                rng.random_range(0..seats),
                against,
                self.names[k].clone(),
                None,
            );
        };
        let draws = draws.as_ref().expect("a league opponent has draws");
        let mirror = |sampler, fallback| {
            (
                Against::Current,
                "league:mirror".to_string(),
                LeagueDraw { sampler, fallback },
            )
        };
        match draws.draw(rng) {
            Ok(matchup) => {
                let seat = if matchup.current_moves_first { 0 } else { 1 };
                let sampler = matchup.sampler.as_str();
                let (against, label, draw) = match &matchup.opponent {
                    MemberId::Version(v) if *v == matchup.current => mirror(sampler, None),
                    MemberId::Version(v) => (
                        Against::Past(*v),
                        format!("league:v{v}"),
                        LeagueDraw {
                            sampler,
                            fallback: None,
                        },
                    ),
                    MemberId::Fixed(name) => match self.bot_names.iter().position(|b| b == name) {
                        Some(b) => (
                            Against::Bot(b),
                            format!("league:{name}"),
                            LeagueDraw {
                                sampler,
                                fallback: None,
                            },
                        ),
                        None => mirror(sampler, Some(FallbackReason::Unplayable)),
                    },
                };
                game(seat, against, label, Some(draw))
            }
            Err(reason) => {
                let (against, label, draw) = mirror("none", Some(reason));
                game(rng.random_range(0..seats), against, label, Some(draw))
            }
        }
    }
}

/// Runs self-play on `envs` (a multi-agent game, checked by the config)
/// until shutdown.
pub(crate) async fn run(
    service: Service,
    shutdown: Shutdown,
    mut envs: VecEnvs,
    metrics: Metrics,
    seed: u64,
) -> Result<(), ServiceError> {
    let cfg = service.config.clone();
    let spec: EnvSpec = envs.spec().clone();
    let n = envs.num_envs();
    let d = envs.obs_dim();
    let seats = spec.agents.len();
    let width = spec.action_space.n().unwrap_or(0);
    let pixels = cfg.observations_as_pixels(&spec);
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0x5e47_5e47);
    let (draws, recorder) = if cfg.league_enabled() {
        (
            Some(LeagueDraws::start(cfg.clone(), shutdown.clone()).map_err(ServiceError::other)?),
            Some(LeagueRecorder::start(cfg.clone(), shutdown.clone())),
        )
    } else {
        (None, None)
    };
    let mut opponents = Opponents::new(&cfg, &spec, draws)?;
    let league_metrics = LeagueMetrics::register(&service.registry);
    let games_played = IntCounterVec::new(
        Opts::new(
            "relay_env_runner_selfplay_games_total",
            "Self-play games by opponent and the learning seat's outcome (win, draw, loss).",
        ),
        &["opponent", "outcome"],
    )
    .unwrap();
    let games_without_learner = IntCounter::new(
        "relay_env_runner_selfplay_games_without_learner_total",
        "Self-play games that ended before the learning seat moved (nothing trained).",
    )
    .unwrap();
    relay_kit::metrics::register(&service.registry, &games_played);
    relay_kit::metrics::register(&service.registry, &games_without_learner);

    let mut obs = match envs.reset() {
        Ok(obs) => obs.to_vec(),
        // Stopping (the envs' waits were cut short).
        Err(BridgeError::Cancelled { .. }) => return service.finish().await,
        Err(e) => return Err(ServiceError::other(e)),
    };
    let all_legal = vec![1u8; n * width];
    let current_masks = |envs: &VecEnvs| envs.masks().unwrap_or(&all_legal).to_vec();
    let mut masks = current_masks(&envs);
    let mut movers: Vec<u32> = envs.movers().map(<[u32]>::to_vec).unwrap_or(vec![0; n]);
    let mut games: Vec<Game> = (0..n)
        .map(|_| opponents.new_game(&mut rng, seats))
        .collect();
    let mut pending: Vec<Option<Move>> = (0..n).map(|_| None).collect();
    let mut done: Vec<VecDeque<Transition>> = (0..n).map(|_| VecDeque::new()).collect();

    let act_subject = service.subjects.act();
    let fragment_steps = cfg.env_runner.fragment_steps;
    let mut fragment = FragmentBuilder::new(n, d, pixels, spec.image, Some(width));
    let mut inserts = Inserts::default();
    let mut episodes: Vec<EpisodeSummary> = Vec::new();
    let mut recent_returns: VecDeque<f64> = VecDeque::with_capacity(100);
    let mut last_version = 0u64;
    let mut reported = Reported {
        at: Instant::now(),
        env_steps: 0,
        vec_steps: 0,
    };
    service.health.set_ready(true);

    'outer: while !shutdown.is_triggered() {
        let step_started = Instant::now();
        let learner_turn: Vec<bool> = (0..n)
            .map(|i| movers[i] as usize == games[i].seat)
            .collect();
        // The rows the inference servers act, by the version asked for:
        // the learning seat's and mirror opponents' (the newest), and each
        // past version's seats.
        let mut requests: Vec<(Option<u64>, Vec<usize>)> = vec![(None, Vec::new())];
        for i in 0..n {
            let version = match games[i].against {
                _ if learner_turn[i] => None,
                Against::Current => None,
                Against::Past(v) => Some(v),
                Against::Bot(_) => continue,
            };
            match requests.iter_mut().find(|(v, _)| *v == version) {
                Some((_, rows)) => rows.push(i),
                None => requests.push((version, vec![i])),
            }
        }
        requests.retain(|(_, rows)| !rows.is_empty());
        let rows_of =
            |rows: &[usize]| (gather_rows(&obs, d, rows), gather_rows(&masks, width, rows));
        let inputs: Vec<(Vec<f32>, Vec<u8>)> =
            requests.iter().map(|(_, rows)| rows_of(rows)).collect();
        let replies = futures::future::join_all(requests.iter().zip(&inputs).map(
            |((version, rows), (rows_obs, rows_masks))| {
                act_until_answered(
                    &service,
                    &metrics,
                    &act_subject,
                    ActRows {
                        obs: rows_obs,
                        masks: Some(rows_masks),
                        n: rows.len(),
                        obs_dim: d,
                        pixels,
                        version: *version,
                        state: None,
                        noise_seeds: None,
                    },
                    &spec.action_space,
                )
            },
        ))
        .await;
        let mut actions = vec![0i64; n];
        for ((version, rows), reply) in requests.iter().zip(replies) {
            let Some(reply) = reply else {
                break 'outer;
            };
            let acted = reply.actions.to_i64().expect("checked by act");
            if let Some(past) = version {
                for (k, &i) in rows.iter().enumerate() {
                    actions[i] = acted[k];
                    // No server holds that version any more: the current
                    // one plays the rest of the game, a mirror game now.
                    if reply.policy_version != *past {
                        let game = &mut games[i];
                        game.against = Against::Current;
                        game.label = "league:mirror".into();
                        if let Some(league) = game.league.as_mut() {
                            league.fallback = Some(FallbackReason::NotServed);
                        }
                    }
                }
                continue;
            }
            last_version = reply.policy_version;
            let logprobs = reply.logprobs.to_f32().expect("checked by decode");
            let values = reply.values.to_f32().expect("checked by decode");
            for (k, &i) in rows.iter().enumerate() {
                actions[i] = acted[k];
                if !learner_turn[i] {
                    continue;
                }
                let step = Move {
                    obs: obs[i * d..(i + 1) * d].to_vec(),
                    mask: masks[i * width..(i + 1) * width].to_vec(),
                    action: acted[k],
                    logprob: logprobs[k],
                    value: values[k],
                    version: reply.policy_version,
                    reward: 0.0,
                };
                // The seat moves again: its previous move's transition ends here.
                if let Some(previous) = pending[i].replace(step) {
                    done[i].push_back(Transition {
                        step: previous,
                        terminated: false,
                        truncated: false,
                        final_obs: None,
                    });
                }
                games[i].learner_moves += 1;
                games[i].learner_version = reply.policy_version;
            }
        }
        // The fixed opponents' moves, one batch per opponent.
        for (b, bot) in opponents.bots.iter_mut().enumerate() {
            let rows: Vec<usize> = (0..n)
                .filter(|&i| !learner_turn[i] && games[i].against == Against::Bot(b))
                .collect();
            if rows.is_empty() {
                continue;
            }
            let (rows_obs, rows_masks) = rows_of(&rows);
            let acted = bot
                .act(&rows_obs, &rows_masks, rows.len(), &mut rng)
                .map_err(|e| {
                    ServiceError::other(format!("opponent {}: {e}", opponents.bot_names[b]))
                })?;
            for (&i, action) in rows.iter().zip(acted) {
                actions[i] = action;
            }
        }
        let step = match envs.step(VecActions::Discrete(&actions)) {
            Ok(step) => step,
            Err(BridgeError::Faulted { faults }) => {
                // Faulted envs restarted their games; every stream in
                // progress is dropped with them, as the main loop drops its
                // fragment.
                metrics.count_faults(spec.id, &faults);
                for &i in faults.iter().flat_map(|f| &f.envs) {
                    games[i] = opponents.new_game(&mut rng, seats);
                }
                pending.iter_mut().for_each(|p| *p = None);
                done.iter_mut().for_each(VecDeque::clear);
                fragment.reset();
                obs.copy_from_slice(envs.obs());
                masks = current_masks(&envs);
                movers = envs.movers().map(<[u32]>::to_vec).unwrap_or(vec![0; n]);
                continue;
            }
            // Stopping: the wait on the workers was cut short.
            Err(BridgeError::Cancelled { .. }) => break 'outer,
            Err(e) => return Err(ServiceError::other(format!("{}: {e}", spec.id))),
        };
        for i in 0..n {
            let seat = games[i].seat;
            if let Some(p) = pending[i].as_mut() {
                p.reward += step.seat_rewards(i)[seat];
            }
            if !step.done(i) {
                continue;
            }
            let (terminated, truncated) = (step.terminated[i], step.truncated[i]);
            if let Some(last) = pending[i].take() {
                done[i].push_back(Transition {
                    step: last,
                    terminated,
                    truncated,
                    final_obs: (truncated && !terminated)
                        .then(|| step.final_seat_obs(i, seat).map(<[f32]>::to_vec))
                        .flatten(),
                });
            }
            let game = std::mem::replace(&mut games[i], opponents.new_game(&mut rng, seats));
            metrics
                .episode_seconds
                .observe(game.started.elapsed().as_secs_f64());
            if game.learner_moves == 0 {
                games_without_learner.inc();
                continue;
            }
            let ret = step.seat_returns(i).map_or(0.0, |r| r[seat]);
            let outcome = match ret {
                r if r > 0.0 => "win",
                r if r < 0.0 => "loss",
                _ => "draw",
            };
            games_played
                .with_label_values(&[metric_opponent(&game), outcome])
                .inc();
            if let Some(draw) = &game.league {
                record_league_game(
                    &league_metrics,
                    recorder.as_ref(),
                    &game,
                    draw,
                    &opponents.bot_names,
                    ret,
                );
            }
            episodes.push(EpisodeSummary {
                episode_return: ret,
                length: game.learner_moves,
                terminated,
                seat: Some(seat as u32),
                opponent: Some(game.label),
                agent_returns: None,
            });
            if recent_returns.len() == 100 {
                recent_returns.pop_front();
            }
            recent_returns.push_back(ret);
            metrics.episodes.inc();
        }
        obs.copy_from_slice(&step.obs);
        if let Some(m) = step.masks() {
            masks.copy_from_slice(m);
        }
        if let Some(m) = step.movers() {
            movers.copy_from_slice(m);
        }
        metrics.vec_steps.inc();
        metrics.env_steps.inc_by(n as u64);
        metrics
            .step_seconds
            .observe(step_started.elapsed().as_secs_f64());

        if done.iter().all(|q| q.len() >= fragment_steps) {
            let finished = cut_fragment(
                &mut fragment,
                &mut done,
                &pending,
                fragment_steps,
                (d, width),
                &service.instance,
                spec.id,
            );
            while !inserts.settled_within(crate::REPORT_EVERY).await {
                crate::report_progress(
                    &service,
                    &metrics,
                    &mut reported,
                    last_version,
                    &recent_returns,
                )
                .await;
            }
            inserts
                .ship(
                    &service,
                    &metrics,
                    finished,
                    spec.id,
                    last_version,
                    &mut episodes,
                )
                .await;
        }
        if reported.at.elapsed() >= crate::REPORT_EVERY {
            crate::report_progress(
                &service,
                &metrics,
                &mut reported,
                last_version,
                &recent_returns,
            )
            .await;
        }
    }
    crate::report_progress(
        &service,
        &metrics,
        &mut reported,
        last_version,
        &recent_returns,
    )
    .await;
    inserts.finish().await;
    service.finish().await
}

/// The opponent label of `relay_env_runner_selfplay_games_total`: the
/// `selfplay.opponents` kind, with `past` for any past version (a label a
/// version would grow without bound).
fn metric_opponent(game: &Game) -> &str {
    match (game.league.is_some(), game.against) {
        (true, Against::Past(_)) => "league:past",
        _ => &game.label,
    }
}

/// Counts a finished league game by the opponent it had, and records it
/// with the pool when it is a rated match (against a past version or a
/// bot; mirror games are not rated).
fn record_league_game(
    metrics: &LeagueMetrics,
    recorder: Option<&LeagueRecorder>,
    game: &Game,
    draw: &LeagueDraw,
    bot_names: &[String],
    learner_return: f64,
) {
    let opponent = match game.against {
        Against::Current => None,
        Against::Past(v) => Some(MemberId::Version(v)),
        Against::Bot(b) => Some(MemberId::Fixed(bot_names[b].clone())),
    };
    let label = match &opponent {
        None => "self",
        Some(MemberId::Version(_)) => "past",
        Some(MemberId::Fixed(name)) => name.as_str(),
    };
    metrics
        .opponent_games
        .with_label_values(&[label, draw.sampler])
        .inc();
    if let Some(reason) = draw.fallback {
        metrics
            .mirror_fallbacks
            .with_label_values(&[reason.label()])
            .inc();
    }
    let (Some(opponent), Some(recorder)) = (opponent, recorder) else {
        return;
    };
    if let MemberId::Version(past) = opponent {
        metrics
            .opponent_lag
            .observe(game.learner_version.saturating_sub(past) as f64);
    }
    recorder.result(LeagueResult {
        current: game.learner_version,
        opponent,
        outcome: match learner_return {
            r if r > 0.0 => Outcome::Win,
            r if r < 0.0 => Outcome::Loss,
            _ => Outcome::Draw,
        },
    });
}

/// The fragment of the first `steps` finished transitions of every env
/// (observations of `d` values, masks of `width` actions), each env's
/// tail bootstrapped from the seat's next move (the next finished
/// transition, else the move in progress; a tail that ended its game
/// bootstraps from nothing, and takes its own observation as a filler).
fn cut_fragment(
    f: &mut FragmentBuilder,
    done: &mut [VecDeque<Transition>],
    pending: &[Option<Move>],
    steps: usize,
    (d, width): (usize, usize),
    runner_id: &str,
    env_id: &str,
) -> RolloutFragment {
    let n = done.len();
    let mut obs = vec![0f32; n * d];
    let mut masks = vec![0u8; n * width];
    for t in 0..steps {
        for (i, q) in done.iter().enumerate() {
            obs[i * d..(i + 1) * d].copy_from_slice(&q[t].step.obs);
            masks[i * width..(i + 1) * width].copy_from_slice(&q[t].step.mask);
        }
        f.push_obs(&obs, Some(&masks), &[]);
        for (i, q) in done.iter().enumerate() {
            let tr = &q[t];
            f.min_version = f.min_version.min(tr.step.version);
            f.actions_i64.push(tr.step.action);
            f.logprobs.push(tr.step.logprob);
            f.values.push(tr.step.value);
            f.rewards.push(tr.step.reward as f32);
            f.terminated.push(tr.terminated);
            f.truncated.push(tr.truncated);
            if let Some(row) = &tr.final_obs {
                // Nobody acts in a game's last state: every action allowed.
                f.push_final_obs(i, row, Some(&vec![1; width]));
            }
        }
        f.steps += 1;
    }
    for (i, q) in done.iter().enumerate() {
        let next = q
            .get(steps)
            .map(|tr| &tr.step)
            .or(pending[i].as_ref())
            .unwrap_or(&q[steps - 1].step);
        obs[i * d..(i + 1) * d].copy_from_slice(&next.obs);
        masks[i * width..(i + 1) * width].copy_from_slice(&next.mask);
    }
    done.iter_mut().for_each(|q| drop(q.drain(..steps)));
    f.finish(runner_id, env_id, None, &obs, Some(&masks), false, None)
}
