//! The `vs-opponent` plugin: the policy against each opponent from every
//! seat, in text games (the learning adapter, over NATS through the shared
//! game loop) and in multi-agent games on observations (the version's
//! greedy policy against bots or saved checkpoints), reported per
//! opponent and seat; and [`Score`], what each game counts for.

use futures::future::BoxFuture;
use futures::StreamExt;
use relay_bridge::EnvSection;
use relay_config::Opponent;
use relay_policy::opponent::SeatOpponent;
use relay_policy::text::{
    arrange, play_game, GameError, GameSettings, GameSpec, Outcome, Seat, LEARNING_ADAPTER,
};
use relay_policy::VersionedPolicy;
use relay_proto::Matchup;

use super::{
    play_against, Cancel, EvalContext, EvalOutcome, Evaluator, OpponentGame, Options,
    TextEvalContext, STOPPED,
};

/// The policy against each opponent, the games shared out among the seats
/// (`vs-opponent`). Text games: the learning adapter, in each game of the
/// run (`text.games`; an opponent is skipped for a game it does not play,
/// and the results are per game, opponent and seat), half of the games in
/// each seat. Multi-agent games on observations (PettingZoo's): the
/// version's greedy policy, game `e` from seat `e % seats`, against the
/// fixed opponents ([`SeatOpponent`]).
pub struct VsOpponent {
    games: Option<usize>,
    /// The names as given: text opponents ([`Opponent`]) or, in games on
    /// observations, bots and `checkpoint:<folder>`.
    opponents: Option<Vec<String>>,
    seed: Option<u64>,
    /// Sampling temperature of the evaluated moves (0: greedy); default
    /// the run's `text.temperature`, as in training. Text games only.
    temperature: Option<f32>,
    /// What each game counts for in the report's returns.
    score: Score,
}

/// What a `vs-opponent` game counts for (its `score` option): the policy's
/// reward (`return`, the default), 1 for a win and 0 otherwise (`win`), or
/// 1 for a win or a draw (`non_loss`). With `win` or `non_loss` the
/// evaluation's mean is a rate, and `eval.threshold` a rate to reach.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Score {
    Return,
    Win,
    NonLoss,
}

impl Score {
    fn parse(text: &str) -> Result<Self, String> {
        match text.trim() {
            "return" => Ok(Self::Return),
            "win" => Ok(Self::Win),
            "non_loss" => Ok(Self::NonLoss),
            other => Err(format!(
                "evaluator vs-opponent: option score {other:?}: expected return, win or non_loss"
            )),
        }
    }

    /// The score of a game the policy ended with `outcome` and `reward`.
    pub fn of(self, outcome: Outcome, reward: f64) -> f64 {
        match self {
            Self::Return => reward,
            Self::Win => f64::from(u8::from(outcome == Outcome::Win)),
            Self::NonLoss => f64::from(u8::from(outcome != Outcome::Loss)),
        }
    }
}

/// The outcome of a game on observations from the policy's return: a win
/// above 0, a loss below (PettingZoo's classic games give +1 / -1 / 0).
pub fn outcome_of_return(ret: f64) -> Outcome {
    match ret {
        r if r > 0.0 => Outcome::Win,
        r if r < 0.0 => Outcome::Loss,
        _ => Outcome::Draw,
    }
}

/// Whether `name` is a fixed opponent of games on observations (a bot of
/// [`relay_envs::SEAT_BOT_NAMES`] or `checkpoint:<folder>`).
fn seat_opponent_name(name: &str) -> bool {
    relay_envs::SEAT_BOT_NAMES.contains(&name) || relay_config::checkpoint_opponent(name).is_some()
}

impl VsOpponent {
    pub(super) fn build(mut o: Options) -> Result<Box<dyn Evaluator>, String> {
        let games: Option<usize> = o.parse("games")?;
        if games == Some(0) {
            return Err("evaluator vs-opponent: option games must be positive".into());
        }
        let opponents = o
            .take("opponents")
            .map(|list| {
                let names: Vec<String> = list
                    .split(',')
                    .map(str::trim)
                    .filter(|s| !s.is_empty())
                    .map(String::from)
                    .collect();
                if names.is_empty() {
                    return Err("evaluator vs-opponent: option opponents is empty".to_string());
                }
                for name in &names {
                    if let (Err(e), false) = (Opponent::parse(name), seat_opponent_name(name)) {
                        return Err(format!(
                            "evaluator vs-opponent: option opponents: {e} (games on observations: {}, checkpoint:<folder>)",
                            relay_envs::SEAT_BOT_NAMES.join(", ")
                        ));
                    }
                }
                Ok(names)
            })
            .transpose()?;
        let seed = o.parse("seed")?;
        let temperature: Option<f32> = o.parse("temperature")?;
        if temperature.is_some_and(|t| !(t.is_finite() && t >= 0.0)) {
            return Err("evaluator vs-opponent: option temperature must be finite and >= 0".into());
        }
        let score = o
            .take("score")
            .map_or(Ok(Score::Return), |text| Score::parse(&text))?;
        o.finish()?;
        Ok(Box::new(Self {
            games,
            opponents,
            seed,
            temperature,
            score,
        }))
    }

    /// The text opponents: the option, else `random` plus the game's
    /// strong bot; in a game that lists no legal moves (some of
    /// TextArena's), where the random bot cannot move, `base`: the base
    /// model without adapter, the policy's first version (a new LoRA
    /// adapter is zero).
    fn opponents(
        &self,
        env_id: &str,
        env: &EnvSection,
        lists_moves: bool,
    ) -> Result<Vec<Opponent>, String> {
        if let Some(list) = &self.opponents {
            return list
                .iter()
                .map(|name| Opponent::parse(name))
                .collect::<Result<_, _>>()
                .map_err(|e| format!("evaluator vs-opponent: option opponents: {e}"));
        }
        let mut list = vec![if lists_moves {
            Opponent::Bot("random".into())
        } else {
            Opponent::Base
        }];
        for bot in ["minimax", "connect_four_bot"] {
            if relay_config::bot_plays(bot, env_id, env) {
                list.push(Opponent::Bot(bot.into()));
            }
        }
        Ok(list)
    }

    /// The opponents of a game on observations of `spec`: the option, else
    /// `random` plus each other bot that plays the game (`minimax` in
    /// TicTacToe).
    fn seat_opponents(&self, spec: &relay_envs::EnvSpec) -> Vec<String> {
        match &self.opponents {
            Some(list) => list.clone(),
            None => relay_envs::SEAT_BOT_NAMES
                .iter()
                .filter(|name| relay_envs::SeatBot::plays(name, spec))
                .map(|name| name.to_string())
                .collect(),
        }
    }

    /// The opponents of a multi-agent game on observations, each made (a
    /// checkpoint loaded); an error names the env when it is not such a
    /// game, or the opponent that cannot play it. `cancel` cuts short the
    /// wait for the game's spec (a Python worker, the first time).
    fn made_seat_opponents(
        &self,
        env_id: &str,
        env: &EnvSection,
        cancel: &Cancel,
    ) -> Result<(relay_envs::EnvSpec, Vec<(String, SeatOpponent)>), String> {
        let spec = relay_bridge::cancellable_spec(env_id, env, cancel).map_err(|e| match e {
            relay_bridge::BridgeError::Cancelled { .. } => STOPPED.to_string(),
            e => e.to_string(),
        })?;
        if spec.agents.is_empty() {
            return Err(format!(
                "evaluator vs-opponent plays text games and multi-agent games (env.backend: pettingzoo), not {env_id}"
            ));
        }
        let opponents = self
            .seat_opponents(&spec)
            .into_iter()
            .map(|name| {
                let opponent = SeatOpponent::new(&name, &spec)
                    .map_err(|e| format!("evaluator vs-opponent: option opponents: {e}"))?;
                Ok((name, opponent))
            })
            .collect::<Result<_, String>>()?;
        Ok((spec, opponents))
    }
}

/// Whether the random bot can play `game`: it lists its legal moves.
fn lists_legal_moves(game: &mut dyn relay_envs::TextGame) -> bool {
    game.reset(0);
    !game.legal_moves().is_empty()
}

/// `random` needs the legal moves; a game that lists none refuses it by name.
fn check_opponent(
    opponent: &Opponent,
    game_id: &str,
    env: &EnvSection,
    lists_moves: bool,
) -> Result<(), String> {
    opponent.check_game(game_id, env)?;
    match opponent {
        Opponent::Bot(name) if name == "random" && !lists_moves => Err(format!(
            "the random bot needs the legal moves, and {game_id} lists none in its observation; \
             evaluate against `base` (the policy's first version) or `adapter:<name>`"
        )),
        _ => Ok(()),
    }
}

/// A seat of the learning adapter asks for `version` (when set): an
/// evaluation plays one version, not whatever is newest move by move.
fn pin(seat: Seat, version: Option<u64>) -> Seat {
    match seat {
        Seat::Model(Some(adapter)) if adapter.name == LEARNING_ADAPTER && version.is_some() => {
            Seat::Model(Some(relay_proto::AdapterRef { version, ..adapter }))
        }
        other => other,
    }
}

/// One game of an evaluation.
struct EvalGame {
    /// Index into the matchups.
    matchup: usize,
    spec: GameSpec,
}

impl Evaluator for VsOpponent {
    fn name(&self) -> &str {
        "vs-opponent"
    }

    /// A multi-agent game on observations: the version's greedy policy
    /// against each opponent on the same games (seeds), game `e` from seat
    /// `e % seats`.
    fn evaluate(&self, p: &VersionedPolicy, ctx: &EvalContext) -> Result<EvalOutcome, String> {
        let (spec, opponents) = self.made_seat_opponents(&ctx.env_id, &ctx.env, &ctx.cancel)?;
        let (games, seed) = if ctx.confirming {
            (ctx.episodes, ctx.seed)
        } else {
            (
                self.games.unwrap_or(ctx.episodes),
                self.seed.unwrap_or(ctx.seed),
            )
        };
        let seats = spec.agents.len();
        if games < seats {
            return Err(format!(
                "evaluator vs-opponent: {games} games leave a seat of {} unplayed; play at least {seats}",
                ctx.env_id
            ));
        }
        let mut returns = Vec::with_capacity(games * opponents.len());
        let mut matchup_of = Vec::with_capacity(games * opponents.len());
        let mut matchups = Vec::new();
        for (name, mut opponent) in opponents {
            let episodes = play_against(
                &p.model,
                p.normalizer.as_ref(),
                ctx.envs(games, seed)?,
                seed,
                true,
                false,
                Some(&mut opponent),
            )?;
            let first = matchups.len();
            matchups.extend((0..seats).map(|seat| Matchup {
                opponent: name.clone(),
                seat: seat as u8,
                game: ctx.env_id.clone(),
                games: 0,
                wins: 0,
                draws: 0,
                losses: 0,
                abandoned: 0,
                moves: 0,
                invalid_moves: 0,
            }));
            for (e, episode) in episodes.iter().enumerate() {
                let index = first + e % seats;
                let m = &mut matchups[index];
                let outcome = outcome_of_return(episode.ret);
                match outcome {
                    Outcome::Win => m.wins += 1,
                    Outcome::Draw => m.draws += 1,
                    Outcome::Loss => m.losses += 1,
                }
                m.games += 1;
                returns.push(self.score.of(outcome, episode.ret));
                matchup_of.push(index);
            }
        }
        Ok(EvalOutcome::Games {
            returns,
            matchups,
            matchup_of,
            policy_version: Some(p.version),
            played: Vec::new(),
        })
    }

    fn plays_text(&self) -> bool {
        true
    }

    fn check_env(&self, env_id: &str, env: &EnvSection) -> Result<(), String> {
        if !env.is_text_game(env_id) {
            return self
                .made_seat_opponents(env_id, env, &Cancel::default())
                .map(drop);
        }
        let mut game = relay_bridge::make_text_game(env_id, env).map_err(|e| e.to_string())?;
        let lists_moves = lists_legal_moves(game.as_mut());
        for opponent in self.opponents(env_id, env, lists_moves)? {
            check_opponent(&opponent, env_id, env, lists_moves)
                .map_err(|e| format!("evaluator vs-opponent: option opponents: {e}"))?;
        }
        Ok(())
    }

    fn describe(&self, config: &relay_config::ExperimentConfig) -> String {
        let env = &config.env;
        let games = self.games.unwrap_or(config.eval.episodes);
        let score = match self.score {
            Score::Return => "",
            Score::Win => ", scored 1 a win",
            Score::NonLoss => ", scored 1 a win or a draw",
        };
        if !config.is_text_game() {
            let opponents = match config.env_spec() {
                Ok(spec) => self.seat_opponents(&spec).join(", "),
                Err(e) => format!("(the env does not open: {e})"),
            };
            return format!(
                "vs-opponent, {games} greedy games per opponent, game e from seat e % seats{score}: {} against {opponents}",
                config.run.env_id
            );
        }
        let per_game: Vec<String> = config
            .text
            .game_weights(&config.run.env_id)
            .into_iter()
            .map(|(game_id, _)| {
                let (players, lists_moves) = relay_bridge::make_text_game(&game_id, env)
                    .map(|mut game| (game.num_players(), lists_legal_moves(game.as_mut())))
                    .unwrap_or((2, true));
                if players == 1 {
                    return format!("{game_id} alone");
                }
                let opponents: Vec<String> = self
                    .opponents(&game_id, env, lists_moves)
                    .unwrap_or_default()
                    .iter()
                    .filter(|o| check_opponent(o, &game_id, env, lists_moves).is_ok())
                    .map(|o| match o {
                        Opponent::Base => {
                            "base (the base model: the policy's first version)".into()
                        }
                        other => other.label(),
                    })
                    .collect();
                let why = if !lists_moves && self.opponents.is_none() {
                    " (it lists no legal moves, so the random bot cannot play it)"
                } else {
                    ""
                };
                format!("{game_id} against {}{why}", opponents.join(", "))
            })
            .collect();
        format!(
            "vs-opponent, {games} games per opponent (half in each seat){score}: {}",
            per_game.join("; ")
        )
    }

    fn evaluate_text<'a>(
        &'a self,
        ctx: &'a TextEvalContext,
    ) -> BoxFuture<'a, Result<EvalOutcome, String>> {
        Box::pin(async move {
            self.check_env(&ctx.env_id, &ctx.env)?;
            let game_ids = if ctx.game_ids.is_empty() {
                vec![ctx.env_id.clone()]
            } else {
                ctx.game_ids.clone()
            };
            let (games, seed) = if ctx.confirming {
                (ctx.games, ctx.seed)
            } else {
                (
                    self.games.unwrap_or(ctx.games),
                    self.seed.unwrap_or(ctx.seed),
                )
            };
            // Each game of the run against each opponent that plays it;
            // the same game seeds against every opponent; the first half
            // of the games in seat 0, the rest in seat 1.
            let mut matchups: Vec<Matchup> = Vec::new();
            let mut planned = Vec::new();
            for game_id in &game_ids {
                if !ctx.env.is_text_game(game_id) {
                    return Err(format!(
                        "evaluator vs-opponent plays text games, not {game_id}"
                    ));
                }
                let mut game =
                    relay_bridge::make_text_game(game_id, &ctx.env).map_err(|e| e.to_string())?;
                let players = game.num_players();
                let lists_moves = lists_legal_moves(game.as_mut());
                let opponents: Vec<Option<Opponent>> = if players == 1 {
                    vec![None]
                } else {
                    let listed = self.opponents(game_id, &ctx.env, lists_moves)?;
                    let playing: Vec<Option<Opponent>> = listed
                        .iter()
                        .filter(|o| check_opponent(o, game_id, &ctx.env, lists_moves).is_ok())
                        .cloned()
                        .map(Some)
                        .collect();
                    if playing.is_empty() {
                        let names: Vec<String> = listed.iter().map(Opponent::label).collect();
                        return Err(format!(
                            "evaluator vs-opponent: option opponents: none of {} plays {game_id}",
                            names.join(", ")
                        ));
                    }
                    playing
                };
                for opponent in &opponents {
                    let label = opponent.as_ref().map_or("none".into(), Opponent::label);
                    for i in 0..games {
                        let seat = if players == 1 {
                            0
                        } else {
                            usize::from(i >= games.div_ceil(2))
                        };
                        let matchup = match matchups.iter().position(|m| {
                            m.opponent == label && m.seat as usize == seat && &m.game == game_id
                        }) {
                            Some(index) => index,
                            None => {
                                matchups.push(Matchup {
                                    opponent: label.clone(),
                                    seat: seat as u8,
                                    game: game_id.clone(),
                                    games: 0,
                                    wins: 0,
                                    draws: 0,
                                    losses: 0,
                                    abandoned: 0,
                                    moves: 0,
                                    invalid_moves: 0,
                                });
                                matchups.len() - 1
                            }
                        };
                        let game_seed = seed.wrapping_add(i as u64);
                        let learner = pin(Seat::learner(&ctx.text, game_seed)?, ctx.version);
                        let seats = arrange(
                            learner,
                            || match opponent {
                                Some(o) => Seat::opponent(o, game_seed ^ 0x5eed, &ctx.text)
                                    .map(|s| pin(s, ctx.version)),
                                None => Err("a single-player game has no opponent".into()),
                            },
                            players,
                            seat,
                        )?;
                        planned.push(EvalGame {
                            matchup,
                            spec: GameSpec {
                                env_id: game_id.clone(),
                                seed: game_seed,
                                seats,
                                learner_seat: Some(seat),
                                runner_id: ctx.instance.clone(),
                            },
                        });
                    }
                }
            }
            let mut settings = GameSettings::from_config(&ctx.text, &ctx.env);
            if let Some(temperature) = self.temperature {
                settings.sampling.temperature = temperature;
            }
            let results: Vec<_> = futures::stream::iter(planned.into_iter().map(|g| {
                let settings = &settings;
                async move { (g.matchup, play_game(&ctx.generator, g.spec, settings).await) }
            }))
            .buffered(ctx.text.games_in_flight.max(1))
            .collect()
            .await;
            let mut returns = Vec::new();
            let mut matchup_of = Vec::new();
            let mut policy_version: Option<u64> = None;
            let mut played = Vec::new();
            for (index, result) in results {
                let m = &mut matchups[index];
                let game = match result {
                    Ok(game) => game,
                    Err(GameError::Abandoned { .. }) => {
                        m.abandoned += 1;
                        continue;
                    }
                    Err(e) => return Err(e.to_string()),
                };
                let outcome = game.outcome().expect("learner seat set");
                match outcome {
                    Outcome::Win => m.wins += 1,
                    Outcome::Draw => m.draws += 1,
                    Outcome::Loss => m.losses += 1,
                }
                m.games += 1;
                let learning = game.learning_seats();
                for turn in &game.record.turns {
                    if learning.contains(&(turn.player as usize)) {
                        m.moves += 1;
                        m.invalid_moves += u32::from(turn.invalid);
                        if let Some(v) = turn.adapter.as_ref().and_then(|a| a.version) {
                            policy_version = Some(policy_version.map_or(v, |p| p.min(v)));
                        }
                    }
                }
                returns.push(
                    self.score
                        .of(outcome, game.learner_reward().expect("learner seat set")),
                );
                matchup_of.push(index);
                played.push(OpponentGame {
                    opponent: m.opponent.clone(),
                    record: game.record,
                });
            }
            if returns.is_empty() {
                return Ok(EvalOutcome::Skipped(format!(
                    "all {} games abandoned (no usable replies from the inference servers)",
                    matchups.iter().map(|m| m.abandoned).sum::<u32>()
                )));
            }
            Ok(EvalOutcome::Games {
                returns,
                matchups,
                matchup_of,
                policy_version,
                played,
            })
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fixtures::{ctx, untrained};
    use crate::plugins::build;

    /// `plugin` refuses `env_id`, naming it and `what`.
    fn refuses(plugin: &dyn Evaluator, env_id: &str, env: &EnvSection, what: &str) {
        let err = plugin.check_env(env_id, env).unwrap_err();
        assert!(err.contains(env_id) && err.contains(what), "{err}");
    }

    #[test]
    fn vs_opponent_checks_its_options_and_the_env() {
        let p = build(
            "vs-opponent",
            &[
                ("games".into(), "4".into()),
                ("opponents".into(), "random, minimax".into()),
                ("temperature".into(), "0".into()),
            ],
        )
        .unwrap();
        assert!(p.plays_text());
        p.check_env("TicTacToe-v0", &EnvSection::default()).unwrap();
        refuses(&*p, "ConnectFour-v0", &EnvSection::default(), "minimax");
        refuses(&*p, "CartPole-v1", &EnvSection::default(), "");
        // The default opponents fit each game.
        let default = build("vs-opponent", &[]).unwrap();
        for game in relay_envs::TEXT_GAME_IDS {
            default.check_env(game, &EnvSection::default()).unwrap();
        }
        for (key, value, needle) in [
            ("opponents", "random,gpt", "gpt"),
            ("opponents", " , ", "empty"),
            ("games", "0", "games"),
            ("episodes", "3", "episodes"),
            ("temperature", "-1", "temperature"),
            ("temperature", "NaN", "temperature"),
            ("temperature", "warm", "temperature"),
        ] {
            let err = build("vs-opponent", &[(key.into(), value.into())])
                .err()
                .unwrap();
            assert!(err.contains(needle), "{key}={value}: {err}");
        }
        // Classic plugins refuse text games.
        let err = build("greedy", &[])
            .unwrap()
            .check_env("TicTacToe-v0", &EnvSection::default())
            .unwrap_err();
        assert!(err.contains("vs-opponent"), "{err}");
        build("greedy", &[])
            .unwrap()
            .check_env("CartPole-v1", &EnvSection::default())
            .unwrap();
    }

    #[test]
    fn vs_opponent_plays_a_pettingzoo_game_from_every_seat_against_each_bot() {
        let env = EnvSection {
            backend: relay_bridge::Backend::Pettingzoo,
            ..EnvSection::default()
        };
        let plugin = build(
            "vs-opponent",
            &[
                ("games".into(), "6".into()),
                ("score".into(), "non_loss".into()),
            ],
        )
        .unwrap();
        plugin.check_env("tictactoe_v3", &env).unwrap();
        let minimax = build("vs-opponent", &[("opponents".into(), "minimax".into())]).unwrap();
        refuses(&*minimax, "connect_four_v3", &env, "minimax");
        refuses(&*plugin, "CartPole-v1", &EnvSection::default(), "");
        let checkpoint = build(
            "vs-opponent",
            &[("opponents".into(), "checkpoint:no/such/folder".into())],
        )
        .unwrap();
        let err = checkpoint.check_env("tictactoe_v3", &env).unwrap_err();
        assert!(err.contains("no/such/folder"), "{err}");

        // An untrained policy against the default opponents (random and
        // minimax): 3 games from each seat against each, on the same seeds.
        let policy = untrained(7, 18, 9);
        let dir = std::env::temp_dir();
        let ctx = EvalContext {
            env_id: "tictactoe_v3".into(),
            env,
            episodes: 6,
            ..ctx(&dir)
        };
        let EvalOutcome::Games {
            returns,
            matchups,
            matchup_of,
            policy_version,
            played,
        } = plugin.evaluate(&policy, &ctx).unwrap()
        else {
            panic!("games on observations report games");
        };
        assert_eq!(policy_version, Some(7));
        assert!(played.is_empty());
        let seen: Vec<(&str, u8, u32)> = matchups
            .iter()
            .map(|m| (m.opponent.as_str(), m.seat, m.games))
            .collect();
        assert_eq!(
            seen,
            [
                ("random", 0, 3),
                ("random", 1, 3),
                ("minimax", 0, 3),
                ("minimax", 1, 3)
            ]
        );
        assert_eq!(returns.len(), 12);
        assert_eq!(matchup_of, [0, 1, 0, 1, 0, 1, 2, 3, 2, 3, 2, 3]);
        // Non-loss scores are 0 or 1, and agree with the matchups' counts.
        for (k, m) in matchups.iter().enumerate() {
            let score: f64 = returns
                .iter()
                .zip(&matchup_of)
                .filter(|(_, &of)| of == k)
                .map(|(r, _)| r)
                .sum();
            assert_eq!(score, (m.wins + m.draws) as f64, "{m:?}");
            assert_eq!(m.wins + m.draws + m.losses, m.games);
        }
        // Perfect play never loses.
        assert!(matchups[2..].iter().all(|m| m.wins == 0), "{matchups:?}");
    }
}
