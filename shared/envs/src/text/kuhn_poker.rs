//! KuhnPoker-v0, ported from TextArena 0.7.4's `envs/KuhnPoker/env.py`
//! (3 rounds).
//!
//! This module owns the deck, the betting tree and the chip count. Each
//! round both players ante 1 chip and get one private card of J < Q < K;
//! the round's first player alternates (player 1 opens round 1). Moves are
//! `[check]`, `[bet]`, `[call]`, `[fold]` (case-insensitive), legal
//! following the tree check → {check: showdown, bet → {fold, call}},
//! bet → {fold, call}. After the last round the player with more chips
//! wins (+1 / -1).
//!
//! TextArena's quirks are kept on purpose, so transcripts and outcomes
//! match its rules:
//! - bets and calls do not add chips to the pot: every pot is the two
//!   antes, so each round moves exactly one chip from loser to winner;
//! - the player who does not open a round receives its "Starting round"
//!   message twice (TextArena reuses the message variable);
//! - when a round ends, the turn is credited to the *next* round's opening
//!   player in `turn_count`, and after the last round a message announcing
//!   a round beyond the last is still sent.
//!
//! The deal comes from a `StdRng` seeded by `reset`; it does not reproduce
//! the deal Python's `random` makes for the same seed.

use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::SeedableRng;

use crate::text::arena::{format_action, Arena, Seats, Sender};
use crate::text::{arena_accessors, ensure_running, parse, StepOutcome, TextGame};
use crate::EnvError;

/// Registry id.
pub const ID: &str = "KuhnPoker-v0";
/// Rounds of the registered id.
const MAX_ROUNDS: u32 = 3;
/// Chips each player puts in the pot at the start of a round.
const ANTE: i32 = 1;

/// Card rank: 0 = J, 1 = Q, 2 = K.
fn rank_name(rank: u8) -> char {
    match rank {
        0 => 'J',
        1 => 'Q',
        2 => 'K',
        _ => '?',
    }
}

/// A node of TextArena's `legal_action_tree`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Node {
    /// Nobody has acted: check or bet.
    Opening,
    /// The opener checked: check (showdown) or bet.
    AfterCheck,
    /// A bet is on the table: fold or call (showdown).
    FacingBet,
}

/// Where a move leads.
enum Transition {
    Next(Node),
    Showdown,
    Fold,
}

impl Node {
    /// The legal moves in TextArena's dict order.
    fn moves(self) -> &'static [&'static str] {
        match self {
            Node::Opening | Node::AfterCheck => &["check", "bet"],
            Node::FacingBet => &["fold", "call"],
        }
    }

    fn after(self, action: &str) -> Transition {
        match (self, action) {
            (Node::Opening, "check") => Transition::Next(Node::AfterCheck),
            (Node::AfterCheck, "check") | (Node::FacingBet, "call") => Transition::Showdown,
            (Node::FacingBet, _) => Transition::Fold,
            _ => Transition::Next(Node::FacingBet),
        }
    }
}

/// TextArena's KuhnPoker with its default wrappers.
#[derive(Debug, Clone)]
pub struct KuhnPoker {
    arena: Arena,
    rng: StdRng,
    /// Shuffled in place each round, as TextArena's `self.deck`.
    deck: [u8; 3],
    cards: [u8; 2],
    chips: [i32; 2],
    pot: i32,
    round: u32,
    starting_player: usize,
    node: Node,
    /// Moves of the current round, one letter each (c, b, f, k = call).
    history: String,
}

impl Default for KuhnPoker {
    fn default() -> Self {
        Self::new()
    }
}

impl KuhnPoker {
    /// Registry id.
    pub const ID: &'static str = ID;

    /// A game reset with seed 0.
    pub fn new() -> Self {
        let mut game = Self {
            arena: Arena::new(Seats::Two),
            rng: StdRng::seed_from_u64(0),
            deck: [0, 1, 2],
            cards: [0, 1],
            chips: [0; 2],
            pot: 0,
            round: 0,
            starting_player: 0,
            node: Node::Opening,
            history: String::new(),
        };
        game.reset(0);
        game
    }

    /// Each player's card this round (0 = J, 1 = Q, 2 = K).
    pub fn cards(&self) -> [u8; 2] {
        self.cards
    }

    /// Each player's chips relative to the start (antes included).
    pub fn chips(&self) -> [i32; 2] {
        self.chips
    }

    /// The round being played, from 1.
    pub fn round(&self) -> u32 {
        self.round
    }

    fn prompt(player: usize) -> String {
        format!(
            "You are Player {player} in a {MAX_ROUNDS} round game of Kuhn Poker.\n\
             Game Rules:\n\
             - Kuhn Poker uses a 3-card deck with J, Q, K (J lowest, K highest)\n\
             - Each player antes {ANTE} chip and receives 1 card each round \
             (note that the cards are dealt without replacement, so you cannot have the same card as your opponent).\n\
             - Game continues for {MAX_ROUNDS} rounds\n\
             - The player with the most chips after all rounds wins\n\n\
             Action Rules:\n\
             - '[check]': Pass without betting (only if no bet is on the table)\n\
             - '[bet]': Add 1 chip to the pot (only if no bet is on the table)\n\
             - '[call]': Match an opponent's bet by adding 1 chip to the pot\n\
             - '[fold]': Surrender your hand and let your opponent win the pot\n"
        )
    }

    fn quoted_moves(node: Node) -> String {
        let moves: Vec<String> = node.moves().iter().map(|m| format!("'[{m}]'")).collect();
        moves.join(", ")
    }

    /// TextArena's `_init_round`, including its end-of-game check.
    fn start_round(&mut self) {
        self.round += 1;
        if self.round > MAX_ROUNDS {
            let [c0, c1] = self.chips;
            if c0 > c1 {
                self.arena.set_winner(
                    0,
                    &format!(
                        "Player 0 won by having more chips at the end of all {MAX_ROUNDS} rounds."
                    ),
                );
            } else if c0 < c1 {
                self.arena.set_winner(
                    1,
                    &format!(
                        "Player 1 won by having more chips at the end of all {MAX_ROUNDS} rounds."
                    ),
                );
            } else {
                self.arena.set_draw(&format!(
                    "At the end of {MAX_ROUNDS} rounds, both players had the same number of chips."
                ));
            }
        }
        self.deck.shuffle(&mut self.rng);
        self.cards = [self.deck[0], self.deck[1]];
        self.pot = ANTE * 2;
        self.chips[0] -= ANTE;
        self.chips[1] -= ANTE;
        self.node = Node::Opening;
        self.history.clear();

        let starting = 1 - self.starting_player;
        self.starting_player = starting;
        self.arena.set_current_player(starting);

        for player in 0..2 {
            let start = format!(
                "### Starting round {} out of {MAX_ROUNDS} rounds. Your card is: '{}'",
                self.round,
                rank_name(self.cards[player])
            );
            self.arena
                .add_observation(Sender::Game, Some(player), &start);
            let second = if player == starting {
                format!(
                    "Your available actions are: {}",
                    Self::quoted_moves(self.node)
                )
            } else {
                start
            };
            self.arena
                .add_observation(Sender::Game, Some(player), &second);
        }
    }

    fn finish_round(&mut self, winner: usize, reason: &str) {
        self.chips[winner] += self.pot;
        let message = format!(
            "{reason} Current scores: Player 0: '{}'; Player 1: '{}'",
            self.chips[0], self.chips[1]
        );
        self.arena.add_observation(Sender::Game, None, &message);
        self.start_round();
    }

    fn showdown(&mut self) {
        let [c0, c1] = self.cards;
        let winner = if c0 > c1 { 0 } else { 1 };
        let (win_card, lose_card) = if winner == 0 { (c0, c1) } else { (c1, c0) };
        let reason = format!(
            "Showdown: Player {winner}'s {} beats Player {}'s {}. Player {winner} wins pot of {} chips.",
            rank_name(win_card),
            1 - winner,
            rank_name(lose_card),
            self.pot
        );
        self.finish_round(winner, &reason);
    }

    /// Applies a formatted action; returns whether the turn rotates.
    fn apply(&mut self, action: &str) -> bool {
        let player = self.arena.current_player();
        let Some(action) = parse::kuhn_move(action) else {
            self.arena
                .set_invalid_move("Action must be [Check], [Bet], [Call], or [Fold].");
            return true;
        };
        if !self.node.moves().contains(&action) {
            let legal: Vec<String> = self.node.moves().iter().map(|m| format!("[{m}]")).collect();
            self.arena
                .set_invalid_move(&format!("Action must be {}.", legal.join(", ")));
            return true;
        }
        self.arena.add_observation(
            Sender::Game,
            None,
            &format!("Player {player}, submitted move: '[{action}]'."),
        );
        self.history.push(match action {
            "check" => 'c',
            "bet" => 'b',
            "fold" => 'f',
            _ => 'k',
        });
        match self.node.after(action) {
            Transition::Fold => {
                self.finish_round(1 - player, &format!("Player {player} has folded."));
                false
            }
            Transition::Showdown => {
                self.showdown();
                false
            }
            Transition::Next(node) => {
                self.node = node;
                let message = format!("Your available actions are: {}", Self::quoted_moves(node));
                self.arena
                    .add_observation(Sender::Game, Some(1 - player), &message);
                true
            }
        }
    }
}

impl TextGame for KuhnPoker {
    arena_accessors!();

    fn reset(&mut self, seed: u64) {
        self.rng = StdRng::seed_from_u64(seed);
        self.deck = [0, 1, 2];
        self.chips = [0; 2];
        self.pot = 0;
        self.round = 0;
        self.starting_player = 0;
        self.arena.reset(Self::prompt);
        self.start_round();
    }

    fn legal_moves(&self) -> Vec<String> {
        if self.arena.is_done() {
            return Vec::new();
        }
        self.node.moves().iter().map(|m| format!("[{m}]")).collect()
    }

    fn step(&mut self, action: &str) -> Result<StepOutcome, EnvError> {
        ensure_running(ID, self.arena.is_done())?;
        let player = self.arena.current_player();
        let action = format_action(action);
        self.arena.begin_step(&action);
        let rotate = self.apply(&action);
        let done = self.arena.finish_step(rotate);
        Ok(StepOutcome {
            player,
            invalid_move: self.arena.step_was_invalid(),
            done,
        })
    }

    /// Round, player to move, both cards, both chip counts and the round's
    /// betting so far; e.g. `"r2:p0:KJ:0,0:cb"` (c check, b bet, f fold,
    /// k call).
    fn state_key(&self) -> String {
        format!(
            "r{}:p{}:{}{}:{},{}:{}",
            self.round,
            self.arena.current_player(),
            rank_name(self.cards[0]),
            rank_name(self.cards[1]),
            self.chips[0],
            self.chips[1],
            self.history
        )
    }
}
