//! Finished text games ([`GameRecord`]s) into training sequences
//! ([`TokenExample`]s).
//!
//! - **Which moves**: those of the learning seats ([`GameRecord::learning_seats`]:
//!   the learning seat, and in mirror games every seat with the same
//!   policy) that carry tokens. Opponents' moves (bots, other adapters, the
//!   base model) never become examples.
//! - **Tokens**: the prompt tokens the inference server reported (chat
//!   template applied), the completion tokens the policy sampled, and the
//!   behaviour log-probs it reported; the loss mask then covers exactly
//!   the completion tokens (`relay_llm::TokenBatch`).
//! - **Reward**: every move of a seat gets that seat's final game reward,
//!   shaped by `rl.reward` (`relay_llm::RewardShaping`): replaced by
//!   `draw` in a drawn game if that is set (drawn: the seat ties the best
//!   other seat), normalised per game (`rl.reward.normalize`: a running
//!   mean and std per game id) if asked, plus `format_bonus` times the
//!   share of the seat's moves whose answer the run's answer format found
//!   (`text.answer`; under `raw`, a bracketed move such as `[4]`,
//!   `[col 3]`, `[Bet]`: the form every game asks for), discounted by
//!   `discount` per later move of the seat; a move the game refused gets
//!   `invalid_move_penalty` less than the seat's other moves.
//! - **Group** (the baseline of `rloo` and `grpo`): the games played by the
//!   same adapter version from the same seat. Their opening states follow
//!   the same distribution (the seat decides who moves first), and the
//!   version makes them samples of the same policy: the nearest thing to
//!   "several completions of one prompt" that games against a random
//!   opponent offer, since later positions rarely repeat. Games of
//!   different text games (multi-game runs) are never in one group: their
//!   rewards and openings have nothing in common. The group id is
//!   `(version * 16 + game) * 256 + seat`, `game` the index of the game
//!   in `relay_envs::TEXT_GAME_IDS` (other games: a slot of 4..16 hashed
//!   from the id).
//! - **Branched positions** (`text.branches`): the moves the continuations
//!   of one position sampled there share one group instead
//!   ([`branch_group_id`]): several completions of one prompt, whose
//!   returns differ only by the move and what followed. A continuation's
//!   replayed turns are trained once, in continuation 0.
//! - **Stratum** (the moving-average baseline of `reinforce`): the game
//!   and the seat, `game * 256 + seat`. The seats' rewards differ in
//!   level (the first mover wins more), so one average over both would
//!   credit everything the first seat does and blame everything the
//!   second does; games differ likewise.

use relay_llm::{ApplyShaping, GameResult, RewardNormalizer, RewardShaping, TokenExample};
use relay_policy::text::Outcome;
use relay_proto::GameRecord;

/// What a batch of games became.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Converted {
    pub examples: Vec<TokenExample>,
    /// Seats' game rewards before shaping (one per learning seat of each
    /// game), for the reported mean.
    pub game_rewards: Vec<f64>,
    /// Moves left out because their tokens or log-probs were unusable.
    pub skipped_moves: usize,
    /// The learning seats' model moves of the games (their format and
    /// correctness rates are reported).
    pub moves: usize,
    /// Of those, the moves whose answer was found (the format reward).
    pub well_formatted_moves: usize,
    /// Of those, the moves the game refused (the correctness reward's misses).
    pub invalid_moves: usize,
    /// The same figures per game id (multi-game runs report each).
    pub per_game: std::collections::BTreeMap<String, GameFigures>,
}

/// What one game id's seats of a batch became.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct GameFigures {
    /// Learning seats (each with at least one example).
    pub seats: usize,
    /// Sum of their game rewards before shaping.
    pub reward_sum: f64,
    /// Examples (moves) made of them.
    pub examples: usize,
    /// Their model moves, and of those the refused ones.
    pub moves: usize,
    pub invalid_moves: usize,
}

impl GameFigures {
    /// Mean game reward of the seats (before shaping).
    pub fn reward_mean(&self) -> f64 {
        self.reward_sum / self.seats.max(1) as f64
    }

    /// Share of the moves the game accepted (1 without moves).
    pub fn legal_move_rate(&self) -> f64 {
        1.0 - self.invalid_moves as f64 / self.moves.max(1) as f64
    }
}

/// The moving-average stratum of a learning seat's moves in a game of
/// `env_id` (see the module docs): its group at version 0.
pub fn stratum_id(env_id: &str, seat: usize) -> u64 {
    group_id(env_id, 0, seat)
}

/// The game slot of an id relay does not have built in (a TextArena game
/// through the env bridge): one of 4..16, from a hash of the id (FNV-1a),
/// the same in every process.
fn other_game_slot(env_id: &str) -> u64 {
    let hash = env_id.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    });
    4 + hash % 12
}

/// The group of a learning seat's moves in a game of `env_id` (see the
/// module docs).
pub fn group_id(env_id: &str, version: u64, seat: usize) -> u64 {
    let game = relay_envs::TEXT_GAME_IDS
        .iter()
        .position(|g| *g == env_id)
        .map_or_else(|| other_game_slot(env_id), |i| i as u64)
        % 16;
    version
        .wrapping_mul(16)
        .wrapping_add(game)
        .wrapping_mul(256)
        .wrapping_add(seat as u64 % 256)
}

/// The group of the moves sampled at one branched position
/// ([`relay_proto::Branch`]): its group with the top bit set, apart from
/// every [`group_id`] (below 2^63 for any version under 2^51).
pub fn branch_group_id(branch_group: u64) -> u64 {
    branch_group | 1 << 63
}

/// Converts `games` (see the module docs). `normalizer` holds the running
/// reward statistics when `shaping.normalize` is set.
pub fn games_to_examples(
    games: &[GameRecord],
    shaping: &RewardShaping,
    normalizer: &mut RewardNormalizer,
) -> Converted {
    struct SeatMoves {
        /// Each example with whether the game refused its move and the
        /// seat's moves after it.
        examples: Vec<(TokenExample, bool, usize)>,
        result: GameResult,
    }
    let mut seats: Vec<SeatMoves> = Vec::new();
    let mut out = Converted::default();
    for game in games {
        let version = game.learning_version().unwrap_or(0);
        for seat in game.learning_seats() {
            // A branch continuation's replayed turns are another record's.
            let moves: Vec<(usize, &relay_proto::TextTurn)> = game
                .turns
                .iter()
                .enumerate()
                .skip(game.own_turns_from())
                .filter(|(_, t)| t.player as usize == seat)
                .collect();
            let mut examples = Vec::new();
            for (position, &(index, turn)) in moves.iter().enumerate() {
                if turn.completion_tokens.numel() == 0 {
                    continue;
                }
                let example = match (
                    turn.prompt_tokens.to_u32(),
                    turn.completion_tokens.to_u32(),
                    turn.logprobs.to_f32(),
                ) {
                    (Ok(prompt), Ok(completion), Ok(behaviour_logprobs)) => TokenExample {
                        prompt,
                        completion,
                        behaviour_logprobs,
                        reward: 0.0,
                        group: match game.branch {
                            Some(b) if b.turn as usize == index => branch_group_id(b.group),
                            _ => group_id(&game.env_id, version, seat),
                        },
                        stratum: stratum_id(&game.env_id, seat),
                    },
                    _ => {
                        out.skipped_moves += 1;
                        continue;
                    }
                };
                if example.validate().is_err() {
                    out.skipped_moves += 1;
                    continue;
                }
                examples.push((example, turn.invalid, moves.len() - 1 - position));
            }
            if examples.is_empty() {
                continue;
            }
            let model_moves: Vec<_> = moves
                .iter()
                .map(|(_, t)| t)
                .filter(|t| t.completion_tokens.numel() > 0)
                .collect();
            let result = GameResult {
                env_id: game.env_id.clone(),
                reward: game.rewards[seat],
                drawn: Outcome::of(&game.rewards, seat) == Outcome::Draw,
                turns: model_moves.len() as u32,
                well_formatted_turns: model_moves.iter().filter(|t| !t.no_answer).count() as u32,
                invalid_moves: model_moves.iter().filter(|t| t.invalid).count() as u32,
            };
            out.game_rewards.push(result.reward);
            out.moves += result.turns as usize;
            out.well_formatted_moves += result.well_formatted_turns as usize;
            out.invalid_moves += result.invalid_moves as usize;
            let figures = out.per_game.entry(game.env_id.clone()).or_default();
            figures.seats += 1;
            figures.reward_sum += result.reward;
            figures.examples += examples.len();
            figures.moves += result.turns as usize;
            figures.invalid_moves += result.invalid_moves as usize;
            seats.push(SeatMoves { examples, result });
        }
    }
    let results: Vec<GameResult> = seats.iter().map(|s| s.result.clone()).collect();
    let shaped = shaping.apply(normalizer, &results);
    for (seat, reward) in seats.into_iter().zip(shaped) {
        out.examples.extend(
            seat.examples
                .into_iter()
                .map(|(e, invalid, later)| TokenExample {
                    reward: shaping.move_reward(reward, invalid, later),
                    ..e
                }),
        );
    }
    out
}

/// Games waiting for a batch, oldest first. The continuations of a
/// branched position ([`relay_proto::Branch`]) wait until all of them are
/// in and go into one batch together (their group is their baseline); they
/// are dropped together when one of them is too old.
#[derive(Debug, Default)]
pub struct PendingGames {
    games: std::collections::VecDeque<GameRecord>,
    /// Branch groups dropped as stale, so continuations still on their way
    /// are dropped too (cleared when it grows past a bound).
    dropped_groups: std::collections::HashSet<u64>,
}

/// Dropped branch groups remembered (their late continuations arrive
/// within a few batches).
const DROPPED_GROUPS_KEPT: usize = 4096;

impl PendingGames {
    /// Queues a game (a continuation of a dropped group is dropped:
    /// returns false).
    pub fn push(&mut self, game: GameRecord) -> bool {
        if game
            .branch
            .is_some_and(|b| self.dropped_groups.contains(&b.group))
        {
            return false;
        }
        self.games.push_back(game);
        true
    }

    /// Drops the games played (in part) by versions below `oldest_ok`, with
    /// every continuation of their positions; returns how many went.
    pub fn drop_stale(&mut self, oldest_ok: u64) -> usize {
        let stale =
            |g: &GameRecord| relay_proto::is_stale(g.learning_version().unwrap_or(0), oldest_ok);
        let stale_groups: std::collections::HashSet<u64> = self
            .games
            .iter()
            .filter(|g| stale(g))
            .filter_map(|g| g.branch.map(|b| b.group))
            .collect();
        let before = self.games.len();
        self.games
            .retain(|g| !stale(g) && !g.branch.is_some_and(|b| stale_groups.contains(&b.group)));
        if self.dropped_groups.len() + stale_groups.len() > DROPPED_GROUPS_KEPT {
            self.dropped_groups.clear();
        }
        self.dropped_groups.extend(stale_groups);
        before - self.games.len()
    }

    /// Learning moves of the games ready for a batch (plain games, and
    /// positions whose continuations are all in).
    pub fn ready_turns(&self) -> usize {
        let ready = self.ready();
        self.games
            .iter()
            .zip(ready)
            .filter(|(_, r)| *r)
            .map(|(g, _)| g.learning_turns().count())
            .sum()
    }

    /// One batch: ready games, oldest first, up to `batch_size` learning
    /// moves (at least one game or position); a position's continuations
    /// count as one.
    pub fn take_batch(&mut self, batch_size: usize) -> Vec<GameRecord> {
        let ready = self.ready();
        let mut take = vec![false; self.games.len()];
        let mut turns = 0usize;
        for i in 0..self.games.len() {
            if !ready[i] || take[i] {
                continue;
            }
            let unit: Vec<usize> = match self.games[i].branch {
                None => vec![i],
                Some(b) => (i..self.games.len())
                    .filter(|&j| self.games[j].branch.is_some_and(|o| o.group == b.group))
                    .collect(),
            };
            let n: usize = unit
                .iter()
                .map(|&j| self.games[j].learning_turns().count())
                .sum();
            if turns > 0 && turns + n > batch_size {
                break;
            }
            turns += n;
            for j in unit {
                take[j] = true;
            }
        }
        let mut batch = Vec::new();
        let mut kept = std::collections::VecDeque::new();
        for (game, take) in self.games.drain(..).zip(take) {
            if take {
                batch.push(game);
            } else {
                kept.push_back(game);
            }
        }
        self.games = kept;
        batch
    }

    /// Whether each game is ready for a batch.
    fn ready(&self) -> Vec<bool> {
        let mut present: std::collections::HashMap<u64, u32> = Default::default();
        for b in self.games.iter().filter_map(|g| g.branch) {
            *present.entry(b.group).or_default() += 1;
        }
        self.games
            .iter()
            .map(|g| g.branch.is_none_or(|b| present[&b.group] >= b.size))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use relay_proto::{AdapterRef, SeatPolicy, Tensor, TextTurn, SCHEMA_VERSION};

    fn policy(version: Option<u64>) -> Option<AdapterRef> {
        Some(AdapterRef {
            name: "policy".into(),
            version,
        })
    }

    fn model_turn(player: u8, prompt: &[u32], completion: &[u32], action: &str) -> TextTurn {
        let logprobs: Vec<f32> = completion.iter().map(|&t| -(t as f32) / 10.0).collect();
        TextTurn {
            player,
            prompt_tokens: Tensor::from_u32(&[prompt.len()], prompt),
            completion_tokens: Tensor::from_u32(&[completion.len()], completion),
            logprobs: Tensor::from_f32(&[completion.len()], &logprobs),
            action: action.into(),
            invalid: false,
            adapter: policy(Some(3)),
            observation: "[GAME] board".into(),
            completion: action.into(),
            no_answer: !relay_envs::text::answer::holds_bracketed_move(action),
            truncated: false,
        }
    }

    fn bot_turn(player: u8) -> TextTurn {
        TextTurn {
            player,
            prompt_tokens: Tensor::from_u32(&[0], &[]),
            completion_tokens: Tensor::from_u32(&[0], &[]),
            logprobs: Tensor::from_f32(&[0], &[]),
            action: "[0]".into(),
            invalid: false,
            adapter: None,
            observation: "[GAME] board".into(),
            completion: String::new(),
            no_answer: false,
            truncated: false,
        }
    }

    fn record(
        seats: Vec<SeatPolicy>,
        learner: u8,
        turns: Vec<TextTurn>,
        rewards: Vec<f64>,
    ) -> GameRecord {
        GameRecord {
            schema: SCHEMA_VERSION,
            runner_id: "t".into(),
            env_id: "TicTacToe-v0".into(),
            seed: 0,
            reasons: vec![String::new(); seats.len()],
            seats,
            learner_seat: Some(learner),
            turns,
            rewards,
            duration_ms: 0,
            finished_unix_ms: 0,
            branch: None,
        }
    }

    #[test]
    fn only_the_learning_seats_moves_become_examples_with_their_tokens() {
        // The policy is player 1; player 0 is another adapter (with tokens
        // of its own, which must not be trained on).
        let mut opponent = model_turn(0, &[9, 9], &[8, 8, 8], "[0]");
        opponent.adapter = Some(AdapterRef {
            name: "old".into(),
            version: Some(0),
        });
        let game = record(
            vec![
                SeatPolicy::Model(Some(AdapterRef {
                    name: "old".into(),
                    version: None,
                })),
                SeatPolicy::Model(policy(None)),
            ],
            1,
            vec![
                opponent,
                model_turn(1, &[1, 2, 3], &[10, 11], "[4]"),
                bot_turn(0),
                model_turn(1, &[1, 2, 3, 4, 5], &[12], "[5]"),
            ],
            vec![-1.0, 1.0],
        );
        let converted =
            games_to_examples(&[game], &RewardShaping::default(), &mut Default::default());
        assert_eq!(converted.examples.len(), 2);
        let (a, b) = (&converted.examples[0], &converted.examples[1]);
        assert_eq!(
            (a.prompt.as_slice(), a.completion.as_slice()),
            (&[1, 2, 3][..], &[10, 11][..])
        );
        assert_eq!(a.behaviour_logprobs, vec![-1.0, -1.1]);
        assert_eq!((b.prompt.len(), b.completion.as_slice()), (5, &[12][..]));
        assert_eq!((a.reward, b.reward), (1.0, 1.0));
        assert_eq!(a.group, group_id("TicTacToe-v0", 3, 1));
        assert_eq!(converted.game_rewards, vec![1.0]);

        // In a training batch, the loss mask covers exactly the completion
        // tokens of these moves: 2 + 1 tokens.
        let pairs: Vec<(&[u32], &[u32])> = converted
            .examples
            .iter()
            .map(|e| (e.prompt.as_slice(), e.completion.as_slice()))
            .collect();
        let batch = relay_llm::TokenBatch::new(&pairs, &candle_core::Device::Cpu).unwrap();
        let mask: Vec<Vec<f32>> = batch.loss_mask.to_vec2().unwrap();
        assert_eq!(mask.iter().flatten().sum::<f32>(), 3.0);
        // Row 0 = [1, 2, 3, 10, 11] fed as its first 4 tokens: positions 2
        // and 3 predict the completion.
        assert_eq!(mask[0], vec![0.0, 0.0, 1.0, 1.0, 0.0]);
        assert_eq!(mask[1], vec![0.0, 0.0, 0.0, 0.0, 1.0]);
    }

    #[test]
    fn rewards_are_shaped_per_seat_the_penalty_per_refused_move_and_groups_follow_version_and_seat()
    {
        let mut invalid = model_turn(0, &[1, 2], &[3], "I pick 4");
        invalid.invalid = true;
        let first = record(
            vec![
                SeatPolicy::Model(policy(None)),
                SeatPolicy::Bot("random".into()),
            ],
            0,
            vec![invalid, bot_turn(1), model_turn(0, &[1, 2], &[4], "[4]")],
            vec![-1.0, 1.0],
        );
        // Mirror self-play at version 5: both seats learn, each with its own reward.
        let mut mirror_turns = vec![
            model_turn(0, &[1], &[2], "[1]"),
            model_turn(1, &[1], &[3], "[2]"),
            model_turn(0, &[1], &[4], "[3]"),
        ];
        for t in &mut mirror_turns {
            t.adapter = policy(Some(5));
        }
        let mirror = record(
            vec![
                SeatPolicy::Model(policy(None)),
                SeatPolicy::Model(policy(None)),
            ],
            1,
            mirror_turns,
            vec![1.0, -1.0],
        );
        let shaping = RewardShaping {
            normalize: None,
            format_bonus: 0.2,
            invalid_move_penalty: 0.5,
            ..RewardShaping::default()
        };
        let games = [first, mirror];
        let converted = games_to_examples(&games, &shaping, &mut Default::default());
        let rewards: Vec<f64> = converted.examples.iter().map(|e| e.reward).collect();
        let groups: Vec<u64> = converted.examples.iter().map(|e| e.group).collect();
        // Seat 0 of the first game: -1, half its moves well formatted
        // (+0.1); its refused move alone loses another 0.5.
        let seat_reward = -1.0 + 0.1;
        assert!(
            (rewards[0] - (seat_reward - 0.5)).abs() < 1e-12,
            "{rewards:?}"
        );
        assert!((rewards[1] - seat_reward).abs() < 1e-12, "{rewards:?}");
        // Mirror: seat 0 won (+1 + 0.2), seat 1 lost (-1 + 0.2).
        assert_eq!(converted.examples.len(), 5);
        assert!((rewards[2] - 1.2).abs() < 1e-12 && (rewards[3] - 1.2).abs() < 1e-12);
        assert!((rewards[4] + 0.8).abs() < 1e-12, "{rewards:?}");
        assert_eq!(
            groups,
            vec![
                group_id("TicTacToe-v0", 3, 0),
                group_id("TicTacToe-v0", 3, 0),
                group_id("TicTacToe-v0", 5, 0),
                group_id("TicTacToe-v0", 5, 0),
                group_id("TicTacToe-v0", 5, 1)
            ]
        );
        assert_eq!(converted.game_rewards, vec![-1.0, 1.0, -1.0]);

        // Discounted: each seat's last move keeps its reward, the one
        // before gets half; the refused move's penalty stays whole.
        let discounted = RewardShaping {
            discount: 0.5,
            ..shaping.clone()
        };
        let converted = games_to_examples(&games, &discounted, &mut Default::default());
        let rewards: Vec<f64> = converted.examples.iter().map(|e| e.reward).collect();
        let expected = [seat_reward * 0.5 - 0.5, seat_reward, 0.6, 1.2, -0.8];
        for (got, want) in rewards.iter().zip(expected) {
            assert!((got - want).abs() < 1e-12, "{rewards:?} vs {expected:?}");
        }

        // With `draw: 1` both seats of the mirror game, drawn, get a win's
        // reward; the lost game keeps its own.
        let mut drawn = games[1].clone();
        drawn.rewards = vec![0.0, 0.0];
        let as_win = RewardShaping {
            draw: Some(1.0),
            ..shaping
        };
        let converted =
            games_to_examples(&[games[0].clone(), drawn], &as_win, &mut Default::default());
        let rewards: Vec<f64> = converted.examples.iter().map(|e| e.reward).collect();
        let expected = [seat_reward - 0.5, seat_reward, 1.2, 1.2, 1.2];
        for (got, want) in rewards.iter().zip(expected) {
            assert!((got - want).abs() < 1e-12, "{rewards:?} vs {expected:?}");
        }
        assert_eq!(converted.game_rewards, vec![-1.0, 0.0, 0.0]);
    }

    /// A game of `env_id` where the policy (seat 0, version 3) moves once
    /// against a bot and gets `reward`.
    fn one_move_game(env_id: &str, reward: f64) -> GameRecord {
        let mut game = record(
            vec![
                SeatPolicy::Model(policy(None)),
                SeatPolicy::Bot("random".into()),
            ],
            0,
            vec![model_turn(0, &[1, 2], &[3], "[1]"), bot_turn(1)],
            vec![reward, -reward],
        );
        game.env_id = env_id.into();
        game
    }

    #[test]
    fn several_games_never_share_a_group_and_rewards_are_normalised_per_game() {
        let shaping = RewardShaping {
            normalize: Some(relay_llm::NormalizeConfig {
                center: true,
                eps: 1e-8,
                clip: None,
            }),
            format_bonus: 0.0,
            invalid_move_penalty: 0.0,
            ..RewardShaping::default()
        };
        let mut normalizer = RewardNormalizer::default();
        let batch = [
            one_move_game("TicTacToe-v0", 1.0),
            one_move_game("KuhnPoker-v0", 3.0),
            one_move_game("TicTacToe-v0", -1.0),
            one_move_game("KuhnPoker-v0", 1.0),
        ];
        let converted = games_to_examples(&batch, &shaping, &mut normalizer);
        let rewards: Vec<f64> = converted.examples.iter().map(|e| e.reward).collect();
        // TicTacToe {1, -1}: mean 0, std 1; KuhnPoker {3, 1}: mean 2, std 1.
        // Each becomes {+1, -1}. (Pooled, mean 1 and std sqrt(2) would
        // have given 0, 1.41, -1.41, 0: Kuhn's larger rewards would win.)
        let want = [1.0, 1.0, -1.0, -1.0];
        for (got, want) in rewards.iter().zip(want) {
            assert!((got - want).abs() < 1e-6, "{rewards:?}");
        }
        // Same version and seat, different games: different groups.
        let groups: Vec<u64> = converted.examples.iter().map(|e| e.group).collect();
        assert_eq!(groups[0], groups[2]);
        assert_eq!(groups[1], groups[3]);
        assert_ne!(groups[0], groups[1]);
        assert_eq!(groups[0], group_id("TicTacToe-v0", 3, 0));
        assert_eq!(groups[1], group_id("KuhnPoker-v0", 3, 0));
        // Per-game figures.
        let ttt = &converted.per_game["TicTacToe-v0"];
        let kuhn = &converted.per_game["KuhnPoker-v0"];
        assert_eq!((ttt.seats, ttt.examples, ttt.reward_mean()), (2, 2, 0.0));
        assert_eq!((kuhn.seats, kuhn.examples, kuhn.reward_mean()), (2, 2, 2.0));
        assert_eq!(ttt.legal_move_rate(), 1.0);

        // The statistics run on per game: TicTacToe {1, -1, 1} has mean
        // 1/3 and variance 8/9, so 1 becomes (2/3) / (2 sqrt(2) / 3) =
        // 1/sqrt(2); KuhnPoker's statistics are untouched.
        let converted = games_to_examples(
            &[one_move_game("TicTacToe-v0", 1.0)],
            &shaping,
            &mut normalizer,
        );
        let z = converted.examples[0].reward;
        assert!((z - std::f64::consts::FRAC_1_SQRT_2).abs() < 1e-6, "{z}");
        let kuhn = normalizer.per_env["KuhnPoker-v0"];
        assert_eq!((kuhn.count, kuhn.mean, kuhn.var), (2, 2.0, 1.0));
    }

    #[test]
    fn unusable_moves_are_skipped_and_formats_are_recognised() {
        let mut bad = model_turn(0, &[], &[3], "[1]");
        bad.prompt_tokens = Tensor::from_u32(&[0], &[]);
        let game = record(
            vec![
                SeatPolicy::Model(policy(None)),
                SeatPolicy::Bot("random".into()),
            ],
            0,
            vec![bad, bot_turn(1), model_turn(0, &[1], &[2], "[2]")],
            vec![0.0, 0.0],
        );
        let converted =
            games_to_examples(&[game], &RewardShaping::default(), &mut Default::default());
        assert_eq!(converted.examples.len(), 1);
        assert_eq!(converted.skipped_moves, 1);
    }

    /// Continuation `index` of 3 of a position at turn 2 (learner seat 0
    /// against a bot): turns 0 and 1 are shared, the learner's move at 2 is
    /// the branching one; the reward is the continuation's.
    fn continuation(group: u64, index: u32, version: u64, reward: f64) -> GameRecord {
        let bot = SeatPolicy::Bot("random".into());
        let mut turns = vec![
            model_turn(0, &[1, 2], &[10], "[0]"),
            bot_turn(1),
            model_turn(0, &[1, 3], &[11 + index], "[4]"),
            bot_turn(1),
        ];
        for t in &mut turns {
            if t.adapter.is_some() {
                t.adapter = policy(Some(version));
            }
        }
        let mut game = record(
            vec![SeatPolicy::Model(policy(None)), bot],
            0,
            turns,
            vec![reward, -reward],
        );
        game.branch = Some(relay_proto::Branch {
            group,
            turn: 2,
            index,
            size: 3,
        });
        game
    }

    #[test]
    fn a_branched_positions_moves_share_one_group_and_replayed_turns_train_once() {
        let games: Vec<GameRecord> = (0..3)
            .map(|i| continuation(9, i, 3, if i == 1 { 1.0 } else { -1.0 }))
            .collect();
        let shaping = RewardShaping {
            normalize: None,
            format_bonus: 0.0,
            invalid_move_penalty: 0.0,
            ..RewardShaping::default()
        };
        let out = games_to_examples(&games, &shaping, &mut RewardNormalizer::default());
        // Continuation 0: both its moves; the others: the branching move only.
        let got: Vec<(Vec<u32>, u64, f64)> = out
            .examples
            .iter()
            .map(|e| (e.completion.clone(), e.group, e.reward))
            .collect();
        let plain = group_id("TicTacToe-v0", 3, 0);
        let branched = branch_group_id(9);
        assert_ne!(plain, branched);
        assert_eq!(
            got,
            vec![
                (vec![10], plain, -1.0),
                (vec![11], branched, -1.0),
                (vec![12], branched, 1.0),
                (vec![13], branched, -1.0),
            ]
        );
        assert_eq!(out.moves, 4, "replayed moves are counted once");
    }

    fn plain(version: u64) -> GameRecord {
        let mut game = continuation(0, 0, version, 1.0);
        game.branch = None;
        game
    }

    fn groups(batch: &[GameRecord]) -> Vec<Option<(u64, u32)>> {
        batch
            .iter()
            .map(|g| g.branch.map(|b| (b.group, b.index)))
            .collect()
    }

    #[test]
    fn pending_positions_wait_for_every_continuation_and_go_into_one_batch() {
        let mut pending = PendingGames::default();
        assert!(pending.push(plain(3)));
        assert!(pending.push(continuation(9, 0, 3, 1.0)));
        assert!(pending.push(continuation(9, 1, 3, 1.0)));
        // Group 9 lacks a continuation: only the plain game is ready.
        assert_eq!(pending.ready_turns(), 2);
        assert_eq!(groups(&pending.take_batch(100)), vec![None]);
        assert!(pending.take_batch(100).is_empty());
        assert!(pending.push(plain(3)));
        assert!(pending.push(continuation(9, 2, 3, 1.0)));
        // Complete: the position (2 + 1 + 1 moves) is the oldest and goes
        // whole, past a batch of 3; the plain game waits for the next.
        assert_eq!(pending.ready_turns(), 6);
        assert_eq!(
            groups(&pending.take_batch(3)),
            vec![Some((9, 0)), Some((9, 1)), Some((9, 2))],
            "a position is never split, even past the batch size"
        );
        assert_eq!(groups(&pending.take_batch(3)), vec![None]);
    }

    #[test]
    fn a_stale_continuation_drops_its_whole_position_and_its_late_ones() {
        let mut pending = PendingGames::default();
        pending.push(continuation(9, 0, 2, 1.0));
        pending.push(continuation(9, 1, 3, 1.0));
        pending.push(plain(3));
        assert_eq!(pending.drop_stale(3), 2);
        assert!(
            !pending.push(continuation(9, 2, 3, 1.0)),
            "late continuation dropped"
        );
        assert_eq!(groups(&pending.take_batch(100)), vec![None]);
    }
}
