//! `relay games <run|@last> [--version N] [--opponent NAME] [--last K]
//! [--eval|--train] [--env ID] [--full]`: a text run's games, as the
//! tracker wrote them to `runs/<id>/games.jsonl` ([`relay_runs::games`]),
//! printed for a person at a terminal: the first thing to read when a
//! self-play run goes wrong (what the model saw, what it thought, what it
//! played, and what the game made of it).
//!
//! Each game is a header (kind, game, seed, version, opponent, the
//! learning seat's outcome, time), its seats, rewards and reasons, then
//! each move: the player and who played it, the observation, the model's
//! completion and the action with its flags (`INVALID`, `NO ANSWER`,
//! `TRUNCATED`). Without `--full`, an observation that repeats the
//! player's previous one shows only what is new, long observations their
//! last lines, long completions their first and last lines, and bots'
//! observations not at all. This module owns the selection and the
//! printing; reading the file and the line format are relay-runs'.

use std::fmt::Write as _;
use std::path::PathBuf;

use anyhow::{Context, Result};
use relay_runs::games::{GameKind, GameLine, Games, SeatLine};

use crate::runs::{local_time, resolve_run_dir, DEFAULT_RUNS_DIR};

/// Flags of `relay games`.
#[derive(Debug, Clone, clap::Args)]
pub struct GamesArgs {
    /// Run id, or `@last` for the newest run.
    pub run: String,
    /// Only games of this learning adapter version (a game's version is the
    /// oldest among its learning moves).
    #[arg(long)]
    pub version: Option<u64>,
    /// Only games against this opponent, named as `text.opponents` and the
    /// league name them: a bot (`random`, `minimax`, ...), `self`, `base`,
    /// `adapter:<name>`, a past version `v<N>`, or `past` for any past version.
    #[arg(long)]
    pub opponent: Option<String>,
    /// Print the K most recent matching games (0: all).
    #[arg(long, default_value_t = 10)]
    pub last: usize,
    /// Only evaluation games.
    #[arg(long, conflicts_with = "train")]
    pub eval: bool,
    /// Only training games.
    #[arg(long)]
    pub train: bool,
    /// Only games of this game id (multi-game runs), e.g. `KuhnPoker-v0`.
    #[arg(long)]
    pub env: Option<String>,
    /// Print observations and completions whole.
    #[arg(long)]
    pub full: bool,
    /// Folder holding the runs.
    #[arg(long, env = "RELAY_RUNS_DIR", default_value = DEFAULT_RUNS_DIR)]
    pub runs_dir: PathBuf,
}

/// Which games to print.
#[derive(Debug, Clone, Default)]
pub struct Filter {
    pub version: Option<u64>,
    pub opponent: Option<String>,
    pub kind: Option<GameKind>,
    pub env: Option<String>,
    /// The most recent this many (0: all).
    pub last: usize,
}

impl Filter {
    fn from_args(args: &GamesArgs) -> Self {
        Self {
            version: args.version,
            opponent: args.opponent.clone(),
            kind: match (args.eval, args.train) {
                (true, _) => Some(GameKind::Eval),
                (_, true) => Some(GameKind::Train),
                _ => None,
            },
            env: args.env.clone(),
            last: args.last,
        }
    }

    fn matches(&self, game: &GameLine) -> bool {
        self.version.is_none_or(|v| game.version == Some(v))
            && self.kind.is_none_or(|k| game.kind == k)
            && self.env.as_ref().is_none_or(|e| &game.env_id == e)
            && self.opponent.as_ref().is_none_or(|o| {
                (o == "past" && game.against_past_version())
                    || game.opponent.split(',').any(|name| name == o)
            })
    }

    /// The matching games, oldest first, and how many matched in all.
    pub fn select<'a>(&self, games: &'a [GameLine]) -> (Vec<&'a GameLine>, usize) {
        let matching: Vec<&GameLine> = games.iter().filter(|g| self.matches(g)).collect();
        let total = matching.len();
        let skip = if self.last == 0 {
            0
        } else {
            total.saturating_sub(self.last)
        };
        (matching.into_iter().skip(skip).collect(), total)
    }

    /// The filters set, for the summary line (`v3, vs random, eval`).
    fn describe(&self) -> String {
        let mut parts = Vec::new();
        if let Some(kind) = self.kind {
            parts.push(kind.label().to_string());
        }
        if let Some(env) = &self.env {
            parts.push(env.clone());
        }
        if let Some(v) = self.version {
            parts.push(format!("v{v}"));
        }
        if let Some(o) = &self.opponent {
            parts.push(format!("vs {o}"));
        }
        parts.join(", ")
    }
}

/// Runs `relay games`.
pub fn games(args: GamesArgs) -> Result<()> {
    let (id, dir) = resolve_run_dir(&args.runs_dir, &args.run)?;
    let games = relay_runs::games::read(&dir).with_context(|| format!("run {id}"))?;
    let style = Style::for_stdout();
    print!(
        "{}",
        render(&id, &games, &Filter::from_args(&args), args.full, style)
    );
    Ok(())
}

/// Terminal styling: ANSI bold, dim and red when printing to a terminal
/// (and `NO_COLOR` is not set), nothing otherwise.
#[derive(Debug, Clone, Copy, Default)]
pub struct Style {
    pub color: bool,
}

impl Style {
    fn for_stdout() -> Self {
        use std::io::IsTerminal;
        Self {
            color: std::io::stdout().is_terminal() && std::env::var_os("NO_COLOR").is_none(),
        }
    }
    fn paint(self, code: &str, text: &str) -> String {
        if self.color {
            format!("\x1b[{code}m{text}\x1b[0m")
        } else {
            text.to_string()
        }
    }
    fn bold(self, text: &str) -> String {
        self.paint("1", text)
    }
    fn dim(self, text: &str) -> String {
        self.paint("2", text)
    }
    fn alert(self, text: &str) -> String {
        self.paint("1;31", text)
    }
}

/// Lines of an observation shown without `--full` (its end: the board).
const OBSERVATION_LINES: usize = 12;
/// Lines shown from each end of a completion without `--full`.
const COMPLETION_LINES: usize = 8;
/// Characters shown of one line without `--full` (half from each end).
const LINE_CHARS: usize = 400;

/// The whole output of `relay games` for a run's games.
pub fn render(run: &str, games: &Games, filter: &Filter, full: bool, style: Style) -> String {
    let mut out = String::new();
    if games.missing {
        let _ = writeln!(
            out,
            "run {run}: no games.jsonl yet (the tracker writes text runs' games there: \
             tracker.games_train_rate of the training games, tracker.games_eval_rate of the evaluation games)"
        );
        return out;
    }
    let (shown, matching) = filter.select(&games.games);
    let described = filter.describe();
    let _ = writeln!(
        out,
        "run {run}: {} of {matching} matching game{}{} ({} in the file; oldest first)",
        shown.len(),
        if matching == 1 { "" } else { "s" },
        if described.is_empty() {
            String::new()
        } else {
            format!(" [{described}]")
        },
        games.games.len(),
    );
    for game in shown {
        out.push('\n');
        game_text(&mut out, game, full, style);
    }
    if games.rotated {
        let _ = writeln!(
            out,
            "\n{}",
            style.dim(
                "note: the games reached tracker.games_max_bytes; the file was rotated \
                 (games.1.jsonl holds the older games kept), and games before those were dropped"
            )
        );
    }
    if games.unreadable > 0 {
        let _ = writeln!(
            out,
            "{}",
            style.dim(&format!(
                "note: {} line(s) did not parse and were skipped",
                games.unreadable
            ))
        );
    }
    out
}

/// Who sits in `seat`, as printed (`policy@v3`, `bot random`, `base`).
fn seat_name(game: &GameLine, seat: usize) -> String {
    game.seats
        .get(seat)
        .map_or_else(|| "?".to_string(), SeatLine::to_string)
}

/// One game: header, seats and result, then its moves.
fn game_text(out: &mut String, game: &GameLine, full: bool, style: Style) {
    let mut title = vec![game.kind.label().to_string()];
    if let Some(evaluator) = &game.evaluator {
        let confirmation = if game.confirmation == Some(true) {
            " confirmation"
        } else {
            ""
        };
        title[0] = format!("eval ({evaluator}{confirmation})");
    }
    title.push(game.env_id.clone());
    title.push(format!("seed {}", game.seed));
    let version = game.version.map_or("v?".to_string(), |v| format!("v{v}"));
    title.push(format!("{version} vs {}", game.opponent));
    if let Some(seat) = game.learner_seat {
        if (seat as usize) < game.rewards.len() {
            let outcome = relay_policy::text::Outcome::of(&game.rewards, seat as usize);
            title.push(outcome.label().to_string());
        }
    }
    title.push(local_time(&game.time));
    let _ = writeln!(
        out,
        "{}",
        style.bold(&format!("=== {} ===", title.join(" · ")))
    );
    let seats: Vec<String> = (0..game.seats.len())
        .map(|s| {
            let learning = if game.learner_seat == Some(s as u8) {
                " (learning)"
            } else {
                ""
            };
            format!("{s}: {}{learning}", seat_name(game, s))
        })
        .collect();
    let _ = writeln!(out, "seats    {}", seats.join(" | "));
    let rewards: Vec<String> = game
        .rewards
        .iter()
        .enumerate()
        .map(|(s, r)| format!("{s}: {r}"))
        .collect();
    let moves = game.turns.len();
    let _ = writeln!(
        out,
        "rewards  {} · {moves} move{} · {:.1} s · {}{}",
        rewards.join(" | "),
        if moves == 1 { "" } else { "s" },
        game.duration_ms as f64 / 1000.0,
        game.runner,
        game.branch.map_or(String::new(), |b| format!(
            " · branch {}/{} at move {}",
            b.index + 1,
            b.size,
            b.turn + 1
        )),
    );
    let mut reasons: Vec<&str> = Vec::new();
    for reason in game.reasons.iter().map(|r| r.trim()) {
        if !reason.is_empty() && !reasons.contains(&reason) {
            reasons.push(reason);
        }
    }
    for reason in reasons {
        let _ = writeln!(out, "reason   {reason}");
    }
    // Each player's previous observation: a transcript that grows shows
    // only what is new.
    let mut seen: Vec<Option<&str>> = vec![None; game.seats.len()];
    for (i, turn) in game.turns.iter().enumerate() {
        let player = turn.player as usize;
        let who = match &turn.adapter {
            Some(adapter) => SeatLine::Model(Some(adapter.clone())).to_string(),
            None => seat_name(game, player),
        };
        let model = turn.completion_tokens > 0 || !turn.completion.is_empty();
        let mut head = format!("--- move {} · player {player} · {who}", i + 1);
        if model {
            let _ = write!(
                head,
                " · {} prompt + {} reply tokens",
                turn.prompt_tokens, turn.completion_tokens
            );
        }
        let flags: Vec<&str> = [
            (turn.invalid, "INVALID"),
            (turn.no_answer, "NO ANSWER"),
            (turn.truncated, "TRUNCATED"),
        ]
        .into_iter()
        .filter_map(|(set, flag)| set.then_some(flag))
        .collect();
        let _ = write!(out, "{}", style.dim(&head));
        if !flags.is_empty() {
            let _ = write!(out, " {}", style.alert(&flags.join(" ")));
        }
        out.push('\n');
        let previous = seen.get_mut(player).and_then(Option::take);
        if let Some(slot) = seen.get_mut(player) {
            *slot = Some(turn.observation.as_str());
        }
        if model || full {
            let observation = if full {
                turn.observation.clone()
            } else {
                let new = previous
                    .filter(|p| !p.is_empty())
                    .and_then(|p| turn.observation.strip_prefix(p));
                match new.map(|rest| rest.trim_start_matches('\n')) {
                    Some(rest) if !rest.trim().is_empty() => format!(
                        "… (what it saw before, then:)\n{}",
                        last_lines(rest, OBSERVATION_LINES)
                    ),
                    _ => last_lines(&turn.observation, OBSERVATION_LINES),
                }
            };
            block(out, "sees", &observation, style);
        }
        if model {
            let completion = if full {
                turn.completion.clone()
            } else {
                ends(&turn.completion, COMPLETION_LINES)
            };
            block(out, "reply", &completion, style);
        }
        block(out, "move", &turn.action, style);
    }
}

/// Prints `text` under a right-aligned label: `  reply │ ...`.
fn block(out: &mut String, label: &str, text: &str, style: Style) {
    let text = text.trim_end();
    let mut lines = text.lines();
    let first = lines.next().unwrap_or("");
    let empty = text.is_empty();
    let _ = writeln!(
        out,
        "{} {}",
        style.dim(&format!("{label:>7} │")),
        if empty {
            style.dim("(empty)")
        } else {
            first.to_string()
        }
    );
    for line in lines {
        let _ = writeln!(out, "{} {line}", style.dim("        │"));
    }
}

/// The last `n` lines, with a note of how many were left out; each line
/// shortened to [`LINE_CHARS`].
fn last_lines(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.trim_end().lines().collect();
    let skip = lines.len().saturating_sub(n);
    let mut out: Vec<String> = Vec::new();
    if skip > 0 {
        out.push(format!("… {skip} earlier line(s); --full shows them"));
    }
    out.extend(lines[skip..].iter().map(|l| shorten(l)));
    out.join("\n")
}

/// The first and last `n` lines, with a note of how many were left out
/// between; each line shortened to [`LINE_CHARS`].
fn ends(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.trim_end().lines().collect();
    if lines.len() <= 2 * n {
        return lines
            .iter()
            .map(|l| shorten(l))
            .collect::<Vec<_>>()
            .join("\n");
    }
    let mut out: Vec<String> = lines[..n].iter().map(|l| shorten(l)).collect();
    out.push(format!(
        "… {} line(s); --full shows them",
        lines.len() - 2 * n
    ));
    out.extend(lines[lines.len() - n..].iter().map(|l| shorten(l)));
    out.join("\n")
}

/// A line of at most [`LINE_CHARS`] characters: its two ends around a note.
fn shorten(line: &str) -> String {
    let count = line.chars().count();
    if count <= LINE_CHARS {
        return line.to_string();
    }
    let half = LINE_CHARS / 2;
    let head: String = line.chars().take(half).collect();
    let tail: String = line.chars().skip(count - half).collect();
    format!("{head} … {} chars … {tail}", count - 2 * half)
}

#[cfg(test)]
mod tests {
    use super::*;
    use relay_proto::AdapterRef;
    use relay_runs::games::TurnLine;

    fn turn(player: u8, version: Option<u64>, observation: &str, completion: &str) -> TurnLine {
        TurnLine {
            player,
            adapter: version.map(|v| AdapterRef {
                name: "policy".into(),
                version: Some(v),
            }),
            observation: observation.into(),
            completion: completion.into(),
            action: if version.is_some() { "[4]" } else { "[0]" }.into(),
            invalid: false,
            no_answer: false,
            truncated: false,
            prompt_tokens: if version.is_some() { 40 } else { 0 },
            completion_tokens: if version.is_some() { 9 } else { 0 },
        }
    }

    fn game(kind: GameKind, version: u64, opponent: &str, seed: u64) -> GameLine {
        let policy = SeatLine::Model(Some(AdapterRef {
            name: "policy".into(),
            version: None,
        }));
        let other = match opponent {
            "self" => policy.clone(),
            o if o.starts_with('v') => SeatLine::Model(Some(AdapterRef {
                name: "policy".into(),
                version: o[1..].parse().ok(),
            })),
            bot => SeatLine::Bot(bot.into()),
        };
        GameLine {
            time: "2026-03-01T12:00:00.000Z".into(),
            kind,
            evaluator: (kind == GameKind::Eval).then(|| "vs-opponent".into()),
            confirmation: (kind == GameKind::Eval).then_some(false),
            opponent: opponent.into(),
            env_id: "TicTacToe-v0".into(),
            seed,
            runner: "env-runner-1".into(),
            version: Some(version),
            seats: vec![policy, other],
            learner_seat: Some(0),
            rewards: vec![1.0, -1.0],
            reasons: vec!["Player 0 won.".into(), "Player 0 won.".into()],
            duration_ms: 1500,
            finished_unix_ms: 0,
            branch: None,
            turns: vec![
                turn(
                    0,
                    Some(version),
                    "Rules.\nYours: \nFree: 0 1 2",
                    "Take the centre. [4]",
                ),
                turn(1, None, "Rules.\nTheirs: 4", ""),
                turn(
                    0,
                    Some(version),
                    "Rules.\nYours: \nFree: 0 1 2\nPlayer 1 played [0].\nYours: 4",
                    "Line up. [8]",
                ),
            ],
        }
    }

    fn file() -> Games {
        Games {
            games: vec![
                game(GameKind::Train, 1, "random", 1),
                game(GameKind::Train, 2, "self", 2),
                game(GameKind::Eval, 2, "minimax", 3),
                game(GameKind::Train, 3, "v1", 4),
                game(GameKind::Train, 3, "random", 5),
            ],
            ..Default::default()
        }
    }

    fn seeds(filter: Filter) -> Vec<u64> {
        let file = file();
        filter
            .select(&file.games)
            .0
            .iter()
            .map(|g| g.seed)
            .collect()
    }

    #[test]
    fn filters_by_version_opponent_kind_and_keeps_the_last() {
        assert_eq!(seeds(Filter::default()), [1, 2, 3, 4, 5]);
        let last = |n| Filter {
            last: n,
            ..Default::default()
        };
        assert_eq!(seeds(last(2)), [4, 5]);
        let version = Filter {
            version: Some(2),
            ..Default::default()
        };
        assert_eq!(seeds(version), [2, 3]);
        let opponent = |o: &str| Filter {
            opponent: Some(o.into()),
            ..Default::default()
        };
        assert_eq!(seeds(opponent("random")), [1, 5]);
        assert_eq!(seeds(opponent("past")), [4]);
        assert_eq!(seeds(opponent("v1")), [4]);
        assert_eq!(seeds(opponent("self")), [2]);
        let eval = Filter {
            kind: Some(GameKind::Eval),
            ..Default::default()
        };
        assert_eq!(seeds(eval), [3]);
        let train_v3_last = Filter {
            kind: Some(GameKind::Train),
            version: Some(3),
            last: 1,
            ..Default::default()
        };
        assert_eq!(seeds(train_v3_last), [5]);
    }

    #[test]
    fn prints_each_move_with_what_was_seen_thought_and_played() {
        let mut file = file();
        file.games[4].turns[2].invalid = true;
        file.games[4].turns[2].truncated = true;
        let filter = Filter {
            opponent: Some("random".into()),
            last: 1,
            ..Default::default()
        };
        let text = render("run-1", &file, &filter, false, Style::default());
        assert!(
            text.starts_with(
                "run run-1: 1 of 2 matching games [vs random] (5 in the file; oldest first)"
            ),
            "{text}"
        );
        assert!(
            text.contains("=== train · TicTacToe-v0 · seed 5 · v3 vs random · win · "),
            "{text}"
        );
        assert!(
            text.contains("seats    0: policy (learning) | 1: bot random"),
            "{text}"
        );
        assert!(
            text.contains("rewards  0: 1 | 1: -1 · 3 moves · 1.5 s · env-runner-1"),
            "{text}"
        );
        // Both players gave the same reason: printed once.
        assert_eq!(text.matches("reason   Player 0 won.").count(), 1, "{text}");
        assert!(
            text.contains("--- move 1 · player 0 · policy@v3 · 40 prompt + 9 reply tokens\n"),
            "{text}"
        );
        assert!(
            text.contains("   sees │ Rules.\n        │ Yours: \n        │ Free: 0 1 2\n"),
            "{text}"
        );
        assert!(
            text.contains("  reply │ Take the centre. [4]\n   move │ [4]\n"),
            "{text}"
        );
        // The bot's move: who and what, without its observation.
        assert!(
            text.contains("--- move 2 · player 1 · bot random\n   move │ [0]\n"),
            "{text}"
        );
        // The grown transcript shows only what is new, and the flags.
        assert!(
            text.contains(
                "--- move 3 · player 0 · policy@v3 · 40 prompt + 9 reply tokens INVALID TRUNCATED\n   sees │ … (what it saw before, then:)\n        │ Player 1 played [0].\n        │ Yours: 4\n"
            ),
            "{text}"
        );
        let full = render("run-1", &file, &filter, true, Style::default());
        assert!(
            full.contains("   sees │ Rules.\n        │ Theirs: 4\n"),
            "{full}"
        );
        assert!(full.contains("   sees │ Rules.\n        │ Yours: \n        │ Free: 0 1 2\n        │ Player 1 played [0]."), "{full}");

        let eval = Filter {
            kind: Some(GameKind::Eval),
            ..Default::default()
        };
        let text = render("run-1", &file, &eval, false, Style::default());
        assert!(
            text.contains("=== eval (vs-opponent) · TicTacToe-v0 · seed 3 · v2 vs minimax · win"),
            "{text}"
        );
    }

    #[test]
    fn long_text_is_shortened_unless_full() {
        let lines: Vec<String> = (0..40).map(|i| format!("line {i}")).collect();
        let text = lines.join("\n");
        let last = last_lines(&text, 3);
        assert_eq!(
            last,
            "… 37 earlier line(s); --full shows them\nline 37\nline 38\nline 39"
        );
        let both = ends(&text, 2);
        assert_eq!(
            both,
            "line 0\nline 1\n… 36 line(s); --full shows them\nline 38\nline 39"
        );
        let long = "x".repeat(1000);
        assert_eq!(
            shorten(&long).chars().count(),
            400 + " … 600 chars … ".chars().count()
        );
    }

    #[test]
    fn says_where_games_come_from_when_there_are_none() {
        let none = Games {
            missing: true,
            ..Default::default()
        };
        let text = render("r", &none, &Filter::default(), false, Style::default());
        assert!(text.contains("no games.jsonl yet"), "{text}");
        let rotated = Games {
            rotated: true,
            unreadable: 1,
            ..file()
        };
        let text = render("r", &rotated, &Filter::default(), false, Style::default());
        assert!(
            text.contains("games.1.jsonl") && text.contains("1 line(s) did not parse"),
            "{text}"
        );
    }
}
