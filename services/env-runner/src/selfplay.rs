//! Self-play in multi-agent games stepped on observations (PettingZoo games
//! through the env bridge, `selfplay` in the config).
//!
//! Each env plays one game at a time. When a game starts the runner's
//! seeded RNG draws the learning policy's seat and the opponent that holds
//! the other seats (`selfplay.opponents`, by weight). Every vector step
//! moves each env's mover: the learning seat and `mirror` opponents are
//! acted by the inference servers (one request), the fixed bots
//! ([`relay_envs::SeatBot`]) here.
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
use std::time::{Duration, Instant};

use prometheus::{IntCounter, IntCounterVec, Opts};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use relay_bridge::{BridgeError, VecEnvs};
use relay_envs::{EnvSpec, SeatBot, VecActions};
use relay_kit::{Service, ServiceError, Shutdown};
use relay_proto::{EpisodeSummary, RolloutFragment};

use crate::fragment::{FragmentBuilder, FragmentPlan};
use crate::{act_until_answered, ActRows, Inserts, Metrics, Reported};

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

/// Who sits where in one env's current game.
struct Game {
    seat: usize,
    opponent: usize,
    learner_moves: u32,
    started: Instant,
}

/// The opponents of `selfplay.opponents`: names, weights, and the bot of
/// each (`None`: `mirror`, acted by the inference servers).
struct Opponents {
    names: Vec<String>,
    weights: Vec<f64>,
    bots: Vec<Option<SeatBot>>,
}

impl Opponents {
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
}

fn new_game(rng: &mut ChaCha8Rng, seats: usize, opponents: &Opponents) -> Game {
    Game {
        seat: rng.random_range(0..seats),
        opponent: opponents.draw(rng),
        learner_moves: 0,
        started: Instant::now(),
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
    let weighted = cfg.selfplay.weighted();
    let mut opponents = Opponents {
        names: weighted.iter().map(|(name, _)| name.to_string()).collect(),
        weights: weighted.iter().map(|(_, w)| *w).collect(),
        bots: weighted
            .iter()
            .map(|(name, _)| {
                (*name != relay_config::MIRROR_OPPONENT)
                    .then(|| SeatBot::new(name, &spec))
                    .transpose()
            })
            .collect::<Result<_, _>>()
            .map_err(|e| ServiceError::other(format!("selfplay.opponents: {e}")))?,
    };
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

    let mut obs = envs.reset().map_err(ServiceError::other)?.to_vec();
    let all_legal = vec![1u8; n * width];
    let current_masks = |envs: &VecEnvs| envs.masks().unwrap_or(&all_legal).to_vec();
    let mut masks = current_masks(&envs);
    let mut movers: Vec<u32> = envs.movers().map(<[u32]>::to_vec).unwrap_or(vec![0; n]);
    let mut games: Vec<Game> = (0..n)
        .map(|_| new_game(&mut rng, seats, &opponents))
        .collect();
    let mut pending: Vec<Option<Move>> = (0..n).map(|_| None).collect();
    let mut done: Vec<VecDeque<Transition>> = (0..n).map(|_| VecDeque::new()).collect();

    let act_subject = service.subjects.act();
    let max_message = service.max_message_bytes();
    let obs_bytes = cfg.observation_bytes(&spec);
    let plan = FragmentPlan::new(n, cfg.env_runner.fragment_steps, obs_bytes, 8, max_message);
    let mut fragments: Vec<FragmentBuilder> = plan
        .groups
        .iter()
        .map(|g| FragmentBuilder::new(g.clone(), d, pixels, spec.image, Some(width)))
        .collect();
    let act_chunk = (max_message.saturating_sub(64 * 1024) / obs_bytes.max(1)).max(1);
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
        // The rows the policy acts: the learning seat's, and mirror opponents'.
        let policy_rows: Vec<usize> = (0..n)
            .filter(|&i| learner_turn[i] || opponents.bots[games[i].opponent].is_none())
            .collect();
        let mut actions = vec![0i64; n];
        if !policy_rows.is_empty() {
            let rows_obs: Vec<f32> = policy_rows
                .iter()
                .flat_map(|&i| obs[i * d..(i + 1) * d].iter().copied())
                .collect();
            let rows_masks: Vec<u8> = policy_rows
                .iter()
                .flat_map(|&i| masks[i * width..(i + 1) * width].iter().copied())
                .collect();
            let Some(reply) = act_until_answered(
                &service,
                &metrics,
                &act_subject,
                ActRows {
                    obs: &rows_obs,
                    masks: Some(&rows_masks),
                    n: policy_rows.len(),
                    obs_dim: d,
                    pixels,
                },
                act_chunk,
                &spec.action_space,
            )
            .await
            else {
                break 'outer;
            };
            last_version = reply.policy_version;
            let acted = reply.actions.to_i64().expect("checked by act");
            let logprobs = reply.logprobs.to_f32().expect("checked by decode");
            let values = reply.values.to_f32().expect("checked by decode");
            for (k, &i) in policy_rows.iter().enumerate() {
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
            }
        }
        for i in 0..n {
            if let Some(bot) = opponents.bots[games[i].opponent]
                .as_mut()
                .filter(|_| !learner_turn[i])
            {
                actions[i] = bot.act(
                    &obs[i * d..(i + 1) * d],
                    &masks[i * width..(i + 1) * width],
                    &mut rng,
                );
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
                    games[i] = new_game(&mut rng, seats, &opponents);
                }
                pending.iter_mut().for_each(|p| *p = None);
                done.iter_mut().for_each(VecDeque::clear);
                fragments.iter_mut().for_each(FragmentBuilder::reset);
                obs.copy_from_slice(envs.obs());
                masks = current_masks(&envs);
                movers = envs.movers().map(<[u32]>::to_vec).unwrap_or(vec![0; n]);
                continue;
            }
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
            let game = std::mem::replace(&mut games[i], new_game(&mut rng, seats, &opponents));
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
            let opponent = &opponents.names[game.opponent];
            games_played
                .with_label_values(&[opponent.as_str(), outcome])
                .inc();
            episodes.push(EpisodeSummary {
                episode_return: ret,
                length: game.learner_moves,
                terminated,
                seat: Some(seat as u32),
                opponent: Some(opponent.clone()),
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

        if done.iter().all(|q| q.len() >= plan.steps) {
            let messages = cut_fragments(
                &mut fragments,
                &mut done,
                &pending,
                plan.steps,
                (d, width),
                &service.instance,
                spec.id,
            );
            inserts
                .ship(
                    &service,
                    &metrics,
                    messages,
                    spec.id,
                    last_version,
                    &mut episodes,
                )
                .await;
        }
        if reported.at.elapsed() >= Duration::from_secs(1) {
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

/// The fragments of the first `steps` finished transitions of every env
/// (observations of `d` values, masks of `width` actions), each env's
/// tail bootstrapped from the seat's next move (the next finished
/// transition, else the move in progress; a tail that ended its game
/// bootstraps from nothing, and takes its own observation as a filler).
fn cut_fragments(
    fragments: &mut [FragmentBuilder],
    done: &mut [VecDeque<Transition>],
    pending: &[Option<Move>],
    steps: usize,
    (d, width): (usize, usize),
    runner_id: &str,
    env_id: &str,
) -> Vec<RolloutFragment> {
    let n = done.len();
    let mut obs = vec![0f32; n * d];
    let mut masks = vec![0u8; n * width];
    for t in 0..steps {
        for (i, q) in done.iter().enumerate() {
            obs[i * d..(i + 1) * d].copy_from_slice(&q[t].step.obs);
            masks[i * width..(i + 1) * width].copy_from_slice(&q[t].step.mask);
        }
        for f in fragments.iter_mut() {
            f.push_obs(&obs, Some(&masks));
            for i in f.envs.clone() {
                let tr = &done[i][t];
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
    fragments
        .iter_mut()
        .map(|f| f.finish(runner_id, env_id, None, &obs, Some(&masks), false, None))
        .collect()
}
