//! Playing episodes of a policy on vectorized envs: [`eval_envs`] makes
//! the envs an evaluation of `episodes` episodes plays on, [`play`] plays
//! them (deterministic or sampled actions, optionally recorded as
//! [`Trajectory`]s), and [`play_against`] does so in a multi-agent game
//! against a fixed opponent. The evaluator plugins play through here, and
//! so do the command line's `relay play` and [`crate::evaluate`]; the
//! plugins re-export these, so `plugins::play` is the same function.

use rand::SeedableRng;
use relay_bridge::{Cancel, EnvSection, VecEnvs};
use relay_envs::{ActionSpace, VecActions};
use relay_nn::{Actions, VecNormalize};
use relay_policy::opponent::SeatOpponent;

/// One episode's steps: observation before each step, action (a list of
/// numbers: one for discrete spaces), reward, terminated, truncated.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Trajectory {
    pub obs: Vec<Vec<f32>>,
    pub actions: Vec<Vec<f64>>,
    pub rewards: Vec<f64>,
    pub terminated: Vec<bool>,
    pub truncated: Vec<bool>,
}

/// A played episode.
#[derive(Debug, Clone, PartialEq)]
pub struct Episode {
    pub ret: f64,
    pub trajectory: Option<Trajectory>,
}

/// Most envs an evaluation steps at once. An evaluation of more episodes
/// plays them in turn on these: a Python env takes milliseconds to make
/// (Taxi's transition table: 4.4 ms), so one env per episode made a
/// 3,000-episode confirmation spend 13 s making envs.
pub const MAX_EVAL_ENVS: usize = 64;

/// The envs an evaluation of `episodes` episodes plays on ([`eval_envs`]).
#[derive(Debug)]
pub struct EvalEnvs {
    envs: VecEnvs,
    episodes: usize,
    cancel: Cancel,
}

/// What [`play`] returns when its [`Cancel`] stopped it.
pub const STOPPED: &str = "evaluation stopped (the evaluator is stopping)";

/// The envs [`play`] plays `episodes` episodes on: `min(episodes,
/// MAX_EVAL_ENVS)` copies of `env_id`, env `i` seeded from `(seed, i)`.
pub fn eval_envs(
    env_id: &str,
    section: &EnvSection,
    episodes: usize,
    seed: u64,
) -> Result<EvalEnvs, String> {
    cancellable_eval_envs(env_id, section, episodes, seed, &Cancel::default())
}

/// [`eval_envs`] that `cancel` stops: their start, and [`play`] on them
/// at its next step, end with [`STOPPED`].
pub fn cancellable_eval_envs(
    env_id: &str,
    section: &EnvSection,
    episodes: usize,
    seed: u64,
    cancel: &Cancel,
) -> Result<EvalEnvs, String> {
    let stopped = |e: relay_bridge::BridgeError| match e {
        relay_bridge::BridgeError::Cancelled { .. } => STOPPED.to_string(),
        e => e.to_string(),
    };
    // A parallel game of a team of agents is one episode on as many envs.
    let team = relay_bridge::cancellable_spec(env_id, section, cancel)
        .map_err(stopped)?
        .team
        .len()
        .max(1);
    let games = episodes.clamp(1, (MAX_EVAL_ENVS / team).max(1));
    let envs =
        VecEnvs::cancellable(env_id, section, games * team, seed, cancel).map_err(stopped)?;
    Ok(EvalEnvs {
        envs,
        episodes,
        cancel: cancel.clone(),
    })
}

/// Plays the episodes of `envs` ([`eval_envs`]) with deterministic or sampled actions (drawn from `seed`), recording
/// trajectories if asked. Env `i` of `n` plays episodes `i`, `i + n`,
/// `i + 2n`, ... in its own order: the first from its seed, the next ones
/// from its autoreset, so which episodes count never depends on how long
/// they last, and the same `(episodes, seed)` gives the same start states.
/// A Python env fault abandons the evaluation (its episodes would not be
/// the ones asked for), and so does the envs' [`Cancel`] ([`STOPPED`],
/// checked before each step).
///
/// With a `normalizer` (the weights version's, runs with a `normalize`
/// section) the model is given normalised observations; the normaliser is
/// only read (frozen, as SB3 evaluates with `training = False`), and the
/// returns and recorded observations and rewards are the env's raw ones.
pub fn play<M: relay_policy::Act>(
    model: &M,
    normalizer: Option<&VecNormalize>,
    envs: EvalEnvs,
    seed: u64,
    deterministic: bool,
    record: bool,
) -> Result<Vec<Episode>, String> {
    play_against(model, normalizer, envs, seed, deterministic, record, None)
}

/// [`play`], in a multi-agent game against `opponent` (`None`: the
/// random-legal bot): episode `e` is played from seat `e % seats`, the
/// opponent holding the other seats, and its return is that seat's. In a
/// parallel game played by one shared policy an episode is a game (its
/// agents' envs), its return the team's (a recording follows its first
/// agent).
pub fn play_against<M: relay_policy::Act>(
    model: &M,
    normalizer: Option<&VecNormalize>,
    envs: EvalEnvs,
    seed: u64,
    deterministic: bool,
    record: bool,
    opponent: Option<&mut SeatOpponent>,
) -> Result<Vec<Episode>, String> {
    let EvalEnvs {
        mut envs,
        episodes,
        cancel,
    } = envs;
    let stopped = |e: relay_bridge::BridgeError| match e {
        relay_bridge::BridgeError::Cancelled { .. } => STOPPED.to_string(),
        e => e.to_string(),
    };
    let num_envs = envs.num_envs();
    let spec = envs.spec().clone();
    // What plays an episode: an env, or the envs of a team's game.
    let team = spec.team.len().max(1);
    let units = num_envs / team;
    let env_id = spec.id;
    let obs_dim = envs.obs_dim();
    let mut obs = envs.reset().map_err(stopped)?.to_vec();
    let mut returns: Vec<Option<f64>> = vec![None; episodes];
    let mut unfinished = episodes;
    // The episode each env (or game) is playing: unit i's k-th is
    // i + k * units.
    let mut playing: Vec<usize> = (0..units).collect();
    let mut trajectories: Vec<Trajectory> =
        vec![Trajectory::default(); if record { episodes } else { 0 }];
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let mut clipped = Vec::new();
    let mut model_obs = obs.clone();
    // Multi-agent games: episode e is played from seat e % seats against
    // the opponent, by default the random-legal bot (the one self-play
    // trains against).
    let seats = spec.agents.len();
    let mut random_legal;
    let mut opponent = match (seats, opponent) {
        (0, _) => None,
        (_, Some(opponent)) => Some(opponent),
        (_, None) => {
            random_legal = SeatOpponent::new("random", &spec).map_err(|e| e.to_string())?;
            Some(&mut random_legal)
        }
    };
    let width = spec.action_space.n().unwrap_or(0);
    let all_legal = vec![1u8; num_envs * width];
    // A recurrent policy's state per env, zeroed as each episode starts.
    let state_width = model.state_width();
    if state_width > 0 && seats > 0 {
        return Err(format!(
            "{env_id} is a multi-agent game; recurrent policies play single-agent envs"
        ));
    }
    let mut state = vec![0f32; num_envs * state_width];
    while unfinished > 0 {
        // An episode can be thousands of steps (CarRacing's 1,000, a chess
        // game's hundreds of moves): a stop is seen between two of them.
        if cancel.is_cancelled() {
            return Err(STOPPED.into());
        }
        model_obs.copy_from_slice(&obs);
        if let Some(n) = normalizer {
            if let Some(i) = model_obs.iter().position(|x| !x.is_finite()) {
                return Err(format!(
                    "{env_id} returned a non-finite observation ({} at index {i})",
                    model_obs[i]
                ));
            }
            n.normalize_obs(&mut model_obs);
        }
        // Envs with action masks: the policy chooses among the legal actions.
        let masks = envs.masks().map(<[u8]>::to_vec);
        let out = model
            .act(
                &model_obs,
                num_envs,
                &mut state,
                masks.as_deref(),
                deterministic,
                &mut rng,
            )
            .map_err(|e| e.to_string())?;
        let mut out = out;
        let actions = &mut out.actions;
        let policy_moves: Vec<bool> = match (envs.movers(), opponent.as_deref_mut(), actions) {
            (Some(movers), Some(opponent), Actions::Discrete(a)) => {
                let mine: Vec<bool> = (0..num_envs)
                    .map(|i| movers[i] as usize == playing[i] % seats)
                    .collect();
                let rows: Vec<usize> = (0..num_envs).filter(|&i| !mine[i]).collect();
                if !rows.is_empty() {
                    let masks = masks.as_deref().unwrap_or(&all_legal);
                    let acted = opponent.act(
                        &relay_envs::gather_rows(&obs, obs_dim, &rows),
                        &relay_envs::gather_rows(masks, width, &rows),
                        rows.len(),
                        &mut rng,
                    )?;
                    for (&i, action) in rows.iter().zip(acted) {
                        a[i] = action;
                    }
                }
                mine
            }
            _ => vec![true; num_envs],
        };
        let step = match (&out.actions, &spec.action_space) {
            (Actions::Discrete(a), _) => envs.step(VecActions::Discrete(a)),
            (Actions::Continuous(a), ActionSpace::Box { low, high }) => {
                clipped.clear();
                clipped.extend(
                    a.iter()
                        .enumerate()
                        .map(|(i, v)| v.clamp(low[i % low.len()], high[i % low.len()])),
                );
                envs.step(VecActions::Continuous(&clipped))
            }
            (Actions::Continuous(_), ActionSpace::Discrete { .. }) => {
                return Err("continuous actions for a discrete env".into())
            }
        }
        .map_err(stopped)?;
        if record {
            for (unit, &episode) in playing.iter().enumerate() {
                let i = unit * team;
                let Some(t) = trajectories.get_mut(episode).filter(|_| policy_moves[i]) else {
                    continue;
                };
                t.obs.push(obs[i * obs_dim..(i + 1) * obs_dim].to_vec());
                t.actions.push(match &out.actions {
                    Actions::Discrete(a) => vec![a[i] as f64],
                    Actions::Continuous(a) => {
                        let width = a.len() / num_envs;
                        a[i * width..(i + 1) * width]
                            .iter()
                            .map(|&v| v as f64)
                            .collect()
                    }
                });
                t.rewards.push(step.rewards[i]);
                t.terminated.push(step.terminated[i]);
                t.truncated.push(step.truncated[i]);
            }
        }
        for e in &step.finished {
            state[e.env_index * state_width..(e.env_index + 1) * state_width].fill(0.0);
        }
        let ended: Vec<(usize, f64)> = if team > 1 {
            relay_envs::team_episodes(&step.finished, team)
                .iter()
                .map(|game| (game.game, game.team_return()))
                .collect()
        } else {
            // A multi-agent game's return is the policy's seat's.
            step.finished
                .iter()
                .map(|e| {
                    let ret = match step.seat_returns(e.env_index) {
                        Some(r) => r[playing[e.env_index] % seats],
                        None => e.episode_return,
                    };
                    (e.env_index, ret)
                })
                .collect()
        };
        for (unit, ret) in ended {
            let episode = &mut playing[unit];
            if let Some(slot) = returns.get_mut(*episode) {
                *slot = Some(ret);
                unfinished -= 1;
            }
            *episode += units;
        }
        obs.copy_from_slice(&step.obs);
    }
    Ok(returns
        .into_iter()
        .enumerate()
        .map(|(i, r)| Episode {
            ret: r.expect("every episode finished"),
            trajectory: record.then(|| std::mem::take(&mut trajectories[i])),
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fixtures::policy;

    #[test]
    fn more_episodes_than_envs_are_played_in_turn_in_each_envs_order() {
        let model = policy().model;
        let n = 2 * MAX_EVAL_ENVS + 5;
        let envs = eval_envs("CartPole-v1", &EnvSection::default(), n, 9).unwrap();
        assert_eq!(envs.envs.num_envs(), MAX_EVAL_ENVS);
        let episodes = play(&model, None, envs, 9, true, true).unwrap();
        assert_eq!(episodes.len(), n);

        // Env i's k-th episode is episode i + k * MAX_EVAL_ENVS, whichever
        // episodes end first.
        let mut reference =
            VecEnvs::new("CartPole-v1", &EnvSection::default(), MAX_EVAL_ENVS, 9).unwrap();
        let mut obs = reference.reset().unwrap().to_vec();
        let mut by_env: Vec<Vec<f64>> = vec![Vec::new(); MAX_EVAL_ENVS];
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(0);
        while by_env
            .iter()
            .enumerate()
            .any(|(i, r)| i + r.len() * MAX_EVAL_ENVS < n)
        {
            let out =
                relay_policy::Act::act(&model, &obs, MAX_EVAL_ENVS, &mut [], None, true, &mut rng)
                    .unwrap();
            let Actions::Discrete(a) = &out.actions else {
                panic!("CartPole is discrete")
            };
            let step = reference.step(VecActions::Discrete(a.as_slice())).unwrap();
            for e in &step.finished {
                by_env[e.env_index].push(e.episode_return);
            }
            obs.copy_from_slice(&step.obs);
        }
        for (i, episode) in episodes.iter().enumerate() {
            let (env, k) = (i % MAX_EVAL_ENVS, i / MAX_EVAL_ENVS);
            assert_eq!(episode.ret, by_env[env][k], "episode {i}");
            let t = episode.trajectory.as_ref().unwrap();
            assert_eq!(t.rewards.iter().sum::<f64>(), episode.ret);
            assert_eq!(t.obs.len(), t.rewards.len());
            let ends = |j: usize| t.terminated[j] || t.truncated[j];
            assert!(ends(t.rewards.len() - 1) && (0..t.rewards.len() - 1).all(|j| !ends(j)));
        }

        // The first episodes are those of an evaluation of fewer.
        let few = play(
            &model,
            None,
            eval_envs("CartPole-v1", &EnvSection::default(), 7, 9).unwrap(),
            9,
            true,
            false,
        )
        .unwrap();
        let few: Vec<f64> = few.iter().map(|e| e.ret).collect();
        let many: Vec<f64> = episodes[..7].iter().map(|e| e.ret).collect();
        assert_eq!(few, many);
    }
}
