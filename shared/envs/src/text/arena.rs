//! The bookkeeping every TextArena game shares.
//!
//! This module owns [`Arena`], a port of TextArena 0.7.4's `State` with its
//! `TwoPlayerState` / `SinglePlayerState` subclasses (`textarena/state.py`,
//! `textarena/core.py`) and of the two wrappers the default environment ids
//! apply: `ActionFormattingWrapper` ([`format_action`]) and
//! `LLMObservationWrapper` (the per-player transcripts). The games own only
//! their rules and their messages.

use crate::text::{ObservationView, PlayerInfo, Transcript};

/// TextArena's `error_allowance` default: one invalid move is forgiven with
/// a warning, the next consecutive one ends the game.
const ERROR_ALLOWANCE: u32 = 1;

/// Who sent a message (TextArena's `from_id`; `GAME_ID == -1` is the game).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Sender {
    Game,
    Player(usize),
}

/// Which TextArena state class the game uses; it decides the role names,
/// the wording of invalid-move warnings and the reward of a forfeit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Seats {
    /// `SinglePlayerState`: role mapping `{0: "Player"}`.
    Single,
    /// `TwoPlayerState`: role mapping `{0: "Player 0", 1: "Player 1"}`.
    Two,
}

impl Seats {
    fn num_players(self) -> usize {
        match self {
            Seats::Single => 1,
            Seats::Two => 2,
        }
    }

    /// The role name LLMObservationWrapper prints for a player.
    fn role_name(self, player: usize) -> String {
        match self {
            Seats::Single => "Player".to_string(),
            Seats::Two => format!("Player {player}"),
        }
    }

    /// The role-mapping values in TextArena's dict order (players, then
    /// `GAME`), whose `[tag]`s are cut out of submitted actions.
    fn role_tags(self) -> &'static [&'static str] {
        match self {
            Seats::Single => &["[Player]", "[GAME]"],
            Seats::Two => &["[Player 0]", "[Player 1]", "[GAME]"],
        }
    }
}

/// TextArena's `ActionFormattingWrapper`: an action containing neither `[`
/// nor `]` is wrapped in brackets, anything else passes unchanged.
pub(crate) fn format_action(action: &str) -> String {
    if action.contains('[') || action.contains(']') {
        action.to_string()
    } else {
        format!("[{action}]")
    }
}

/// State shared by every game: whose turn it is, the turn counters, the
/// invalid-move allowance, the outcome, and each player's transcript.
#[derive(Debug, Clone)]
pub(crate) struct Arena {
    seats: Seats,
    current_player: usize,
    /// TextArena's `state.turn`: valid (or game-ending) moves so far.
    turn: u32,
    done: bool,
    error_count: u32,
    made_invalid_move: bool,
    /// The move being processed was rejected (warning or forfeit).
    step_invalid: bool,
    /// Per player, every message addressed to them.
    transcripts: Vec<Transcript>,
    rewards: Option<Vec<f64>>,
    info: Vec<PlayerInfo>,
}

impl Arena {
    /// A state that still needs [`Arena::reset`].
    pub(crate) fn new(seats: Seats) -> Self {
        let n = seats.num_players();
        Self {
            seats,
            current_player: 0,
            turn: 0,
            done: false,
            error_count: 0,
            made_invalid_move: false,
            step_invalid: false,
            transcripts: vec![Transcript::default(); n],
            rewards: None,
            info: (0..n).map(PlayerInfo::initial).collect(),
        }
    }

    /// TextArena's `standard_resets` plus the subclass resets: clears
    /// everything and sends each player its prompt.
    pub(crate) fn reset(&mut self, prompt: impl Fn(usize) -> String) {
        *self = Self::new(self.seats);
        for player in 0..self.num_players() {
            self.add_observation(Sender::Game, Some(player), &prompt(player));
        }
    }

    pub(crate) fn num_players(&self) -> usize {
        self.seats.num_players()
    }

    pub(crate) fn current_player(&self) -> usize {
        self.current_player
    }

    pub(crate) fn turn(&self) -> u32 {
        self.turn
    }

    pub(crate) fn is_done(&self) -> bool {
        self.done
    }

    /// What `player` is shown, as `view` renders it (`Compact` is the
    /// game's to render: here it falls back to `FirstLast`).
    pub(crate) fn observation(&self, player: usize, view: ObservationView) -> String {
        self.transcripts[player].render(view)
    }

    pub(crate) fn rewards(&self) -> Option<&[f64]> {
        self.rewards.as_deref()
    }

    pub(crate) fn info(&self) -> &[PlayerInfo] {
        &self.info
    }

    /// Whether the move being processed has been rejected.
    pub(crate) fn step_was_invalid(&self) -> bool {
        self.step_invalid
    }

    /// TextArena's `add_observation`: `to == None` broadcasts.
    pub(crate) fn add_observation(&mut self, from: Sender, to: Option<usize>, message: &str) {
        let sender = match from {
            Sender::Game => "GAME".to_string(),
            Sender::Player(p) => self.seats.role_name(p),
        };
        let players = match to {
            Some(player) => player..player + 1,
            None => 0..self.num_players(),
        };
        for player in players {
            self.transcripts[player].push(&sender, message);
        }
    }

    /// Starts processing a move: records the (already formatted) action as
    /// the current player's broadcast message, with role tags such as
    /// `[Player 0]` or `[GAME]` cut out as TextArena does for
    /// `PLAYER_ACTION` observations.
    pub(crate) fn begin_step(&mut self, action: &str) {
        self.step_invalid = false;
        let mut message = action.to_string();
        for tag in self.seats.role_tags() {
            message = message.replace(tag, "");
        }
        self.add_observation(Sender::Player(self.current_player), None, &message);
    }

    /// Two-player `set_invalid_move`: a private warning while the allowance
    /// lasts, otherwise the mover loses (-1 / +1).
    pub(crate) fn set_invalid_move(&mut self, reason: &str) {
        self.step_invalid = true;
        let player = self.current_player;
        if ERROR_ALLOWANCE > self.error_count {
            self.error_count += 1;
            self.made_invalid_move = true;
            let warning = format!(
                "Player {player} attempted an invalid move. Reason: {reason} Please resubmit a valid move and remember to follow the game rules to avoid penalties."
            );
            self.add_observation(Sender::Game, Some(player), &warning);
        } else {
            let mut rewards = vec![1.0; 2];
            rewards[player] = -1.0;
            self.rewards = Some(rewards);
            for info in &mut self.info {
                info.reason = Some(reason.to_string());
            }
            self.info[player].invalid_move = true;
            self.done = true;
        }
    }

    /// Single-player `set_invalid_move`: a warning while the allowance
    /// lasts, otherwise the game ends with `reward`.
    pub(crate) fn set_invalid_move_single(&mut self, reason: &str, reward: f64) {
        self.step_invalid = true;
        if ERROR_ALLOWANCE > self.error_count {
            self.error_count += 1;
            self.made_invalid_move = true;
            let warning = format!(
                "You attempted an invalid move. Reason: {reason} Please resubmit a valid move and remember to follow the game rules to avoid penalties."
            );
            self.add_observation(Sender::Game, None, &warning);
        } else {
            self.rewards = Some(vec![reward]);
            self.info[0].reason = Some(format!("Invalid Move: {reason}"));
            self.info[0].invalid_move = true;
            self.done = true;
        }
    }

    /// Two-player `set_winner`.
    pub(crate) fn set_winner(&mut self, winner: usize, reason: &str) {
        let mut rewards = vec![-1.0; 2];
        rewards[winner] = 1.0;
        self.rewards = Some(rewards);
        self.set_reason_and_finish(reason);
    }

    /// Two-player `set_draw`.
    pub(crate) fn set_draw(&mut self, reason: &str) {
        self.rewards = Some(vec![0.0; 2]);
        self.set_reason_and_finish(reason);
    }

    /// Single-player `set_outcome`.
    pub(crate) fn set_outcome(&mut self, reward: f64, reason: &str) {
        self.rewards = Some(vec![reward]);
        self.set_reason_and_finish(reason);
    }

    fn set_reason_and_finish(&mut self, reason: &str) {
        for info in &mut self.info {
            info.reason = Some(reason.to_string());
        }
        self.done = true;
    }

    /// `manually_set_current_player_id`: ignored after an invalid move.
    pub(crate) fn set_current_player(&mut self, player: usize) {
        if !self.made_invalid_move {
            self.current_player = player;
            self.error_count = 0;
        }
    }

    /// The state's `step()`, run at the end of every move: counts the turn
    /// unless the move was forgiven as invalid (the turn is credited to
    /// whoever is current *now*, which a game may already have changed),
    /// then passes the turn on (two players, `rotate`) unless the game is
    /// over or the mover must retry. Returns `done`.
    pub(crate) fn finish_step(&mut self, rotate: bool) -> bool {
        if !self.made_invalid_move {
            self.error_count = 0;
            self.turn += 1;
            self.info[self.current_player].turn_count += 1;
        }
        if self.done {
            return true;
        }
        if self.seats == Seats::Two && rotate && !self.made_invalid_move {
            self.current_player = 1 - self.current_player;
            self.error_count = 0;
        }
        self.made_invalid_move = false;
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn action_formatting_adds_brackets_only_when_there_are_none() {
        assert_eq!(format_action("I pass"), "[I pass]");
        assert_eq!(format_action(""), "[]");
        assert_eq!(format_action("[4]"), "[4]");
        assert_eq!(format_action("move ] 4"), "move ] 4");
        assert_eq!(format_action("[col 3"), "[col 3");
    }

    #[test]
    fn role_tags_are_cut_from_player_actions_in_dict_order() {
        let mut arena = Arena::new(Seats::Two);
        arena.reset(|p| format!("hello {p}"));
        // "[GAME]" is removed after "[Player 0]", so the tag it hid survives.
        arena.begin_step("[Player 1][4] [Player [GAME]0]");
        assert_eq!(
            arena.observation(1, ObservationView::Full),
            "\n[GAME] hello 1\n[Player 0] [4] [Player 0]"
        );
    }

    #[test]
    fn second_consecutive_invalid_move_forfeits() {
        let mut arena = Arena::new(Seats::Two);
        arena.reset(|_| String::new());
        arena.begin_step("[x]");
        arena.set_invalid_move("bad");
        assert!(!arena.finish_step(true));
        assert_eq!(arena.current_player(), 0, "the mover retries");
        assert!(arena.observation(0, ObservationView::Full).ends_with("Reason: bad Please resubmit a valid move and remember to follow the game rules to avoid penalties."));
        assert!(
            !arena
                .observation(1, ObservationView::Full)
                .contains("Reason"),
            "warnings are private"
        );
        arena.begin_step("[y]");
        arena.set_invalid_move("worse");
        assert!(arena.finish_step(true));
        assert_eq!(arena.rewards(), Some(&[-1.0, 1.0][..]));
        assert!(arena.info()[0].invalid_move);
        assert_eq!(arena.info()[1].reason.as_deref(), Some("worse"));
        assert_eq!(arena.info()[0].turn_count, 1);
    }

    #[test]
    fn a_valid_move_restores_the_allowance() {
        let mut arena = Arena::new(Seats::Two);
        arena.reset(|_| String::new());
        for player in [0, 1, 0] {
            assert_eq!(arena.current_player(), player);
            arena.begin_step("[x]");
            arena.set_invalid_move("bad");
            assert!(!arena.finish_step(true));
            arena.begin_step("[ok]");
            assert!(!arena.finish_step(true));
        }
        assert_eq!(arena.turn(), 3);
    }
}
