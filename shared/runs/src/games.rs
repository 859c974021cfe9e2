//! `games.jsonl`: the text games of a run as people read them, one JSON
//! object a line. The tracker writes it (a sample of the training games,
//! `tracker.games_train_rate`, and the evaluation games,
//! `tracker.games_eval_rate`, within `tracker.games_max_bytes`) and
//! `relay games` reads it; both take the line format, the choice of games
//! and the reading from here, so the writer and the reader cannot drift.
//!
//! A line holds a game's text only (no token ids or log-probs, only how
//! many tokens each prompt and completion had): every turn's observation
//! (what the player saw), the model's whole completion (thought and
//! answer), the action the game got and its flags, and the game's seats,
//! versions, opponent, rewards and reasons.
//!
//! Once the bound is reached the tracker renames `games.jsonl` to
//! [`ROTATED`] and starts a new one; [`read`] reads both, oldest first.

use std::io::BufRead;
use std::path::{Path, PathBuf};

use relay_proto::{AdapterRef, Branch, EvalGame, GameRecord, SeatPolicy, TextTurn};
use serde::{Deserialize, Serialize};

/// The file in the run directory.
pub const FILE: &str = "games.jsonl";
/// Where the older games go when `games.jsonl` reaches half the bound.
pub const ROTATED: &str = "games.1.jsonl";

/// Training or evaluation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum GameKind {
    /// An env-runner's training game (`relay.<run>.games`).
    Train,
    /// A game an evaluator played (`relay.<run>.eval.games`).
    Eval,
}

impl GameKind {
    pub fn label(self) -> &'static str {
        match self {
            GameKind::Train => "train",
            GameKind::Eval => "eval",
        }
    }
}

/// Who sat in a seat: `{"model": {"name": "policy", "version": 3}}`,
/// `{"model": null}` (the base model), `{"bot": "random"}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SeatLine {
    Model(Option<AdapterRef>),
    Bot(String),
}

impl From<&SeatPolicy> for SeatLine {
    fn from(seat: &SeatPolicy) -> Self {
        match seat {
            SeatPolicy::Model(adapter) => SeatLine::Model(adapter.clone()),
            SeatPolicy::Bot(name) => SeatLine::Bot(name.clone()),
        }
    }
}

impl std::fmt::Display for SeatLine {
    /// `policy@v3`, `policy` (the newest version), `base`, `bot random`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SeatLine::Model(None) => f.write_str("base"),
            SeatLine::Model(Some(AdapterRef {
                name,
                version: Some(v),
            })) => write!(f, "{name}@v{v}"),
            SeatLine::Model(Some(AdapterRef {
                name,
                version: None,
            })) => f.write_str(name),
            SeatLine::Bot(name) => write!(f, "bot {name}"),
        }
    }
}

/// One move.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TurnLine {
    pub player: u8,
    /// The adapter that generated the move, with the version the inference
    /// server reported (absent: a bot, or the base model).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub adapter: Option<AdapterRef>,
    /// What the player saw (the prompt's user turn).
    pub observation: String,
    /// The model's whole reply, thought and answer (empty for bots).
    pub completion: String,
    /// What the game got.
    pub action: String,
    /// The game refused the move.
    pub invalid: bool,
    /// The run's answer format found no answer in the completion.
    pub no_answer: bool,
    /// The reply reached the token limit before its answer.
    pub truncated: bool,
    /// Tokens of the prompt as the model saw it (0 for bots).
    pub prompt_tokens: usize,
    /// Tokens of the completion (0 for bots).
    pub completion_tokens: usize,
}

impl From<&TextTurn> for TurnLine {
    fn from(t: &TextTurn) -> Self {
        Self {
            player: t.player,
            adapter: t.adapter.clone(),
            observation: t.observation.clone(),
            completion: t.completion.clone(),
            action: t.action.clone(),
            invalid: t.invalid,
            no_answer: t.no_answer,
            truncated: t.truncated,
            prompt_tokens: t.prompt_tokens.numel(),
            completion_tokens: t.completion_tokens.numel(),
        }
    }
}

/// One line of `games.jsonl`: one game.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GameLine {
    /// When the tracker wrote it (RFC 3339, UTC).
    pub time: String,
    pub kind: GameKind,
    /// Eval games: the plugin that played it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub evaluator: Option<String>,
    /// Eval games: one of a confirmation's games (else the screening's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub confirmation: Option<bool>,
    /// The learning seat's opponent ([`opponent_label`]; eval games: the
    /// plugin's name for it).
    pub opponent: String,
    pub env_id: String,
    /// The game's reset seed.
    pub seed: u64,
    /// The env-runner (or evaluator) copy that played it.
    pub runner: String,
    /// The learning adapter's version: the oldest among the learning
    /// seats' moves ([`GameRecord::learning_version`]); eval games without
    /// such moves: the evaluated version. Absent when none is known.
    pub version: Option<u64>,
    /// Seat `i` is player `i` (player 0 moves first).
    pub seats: Vec<SeatLine>,
    /// The learning seat (absent when no seat learns).
    pub learner_seat: Option<u8>,
    /// Final reward of each player.
    pub rewards: Vec<f64>,
    /// The game's reason for its outcome, per player.
    pub reasons: Vec<String>,
    pub duration_ms: u64,
    /// When the game ended (Unix ms on the player's clock; 0: unknown).
    pub finished_unix_ms: u64,
    /// A continuation of a branched position (`text.branches`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub branch: Option<Branch>,
    pub turns: Vec<TurnLine>,
}

impl GameLine {
    /// A training game as heard on `relay.<run>.games`.
    pub fn train(record: &GameRecord, time: String) -> Self {
        Self::new(record, time, GameKind::Train, opponent_label(record))
    }

    /// An evaluation game as heard on `relay.<run>.eval.games`.
    pub fn eval(game: &EvalGame, time: String) -> Self {
        let mut line = Self::new(&game.game, time, GameKind::Eval, game.opponent.clone());
        line.evaluator = Some(game.evaluator.clone());
        line.confirmation = Some(game.confirmation);
        line.version = line.version.or(Some(game.policy_version));
        line
    }

    fn new(record: &GameRecord, time: String, kind: GameKind, opponent: String) -> Self {
        Self {
            time,
            kind,
            evaluator: None,
            confirmation: None,
            opponent,
            env_id: record.env_id.clone(),
            seed: record.seed,
            runner: record.runner_id.clone(),
            version: record.learning_version(),
            seats: record.seats.iter().map(SeatLine::from).collect(),
            learner_seat: record.learner_seat,
            rewards: record.rewards.clone(),
            reasons: record.reasons.clone(),
            duration_ms: record.duration_ms,
            finished_unix_ms: record.finished_unix_ms,
            branch: record.branch,
            turns: record.turns.iter().map(TurnLine::from).collect(),
        }
    }

    /// Whether the opponent is a past version of the learning adapter
    /// (`v<N>`, as the league names them).
    pub fn against_past_version(&self) -> bool {
        self.opponent
            .strip_prefix('v')
            .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
    }
}

/// The learning seat's opponent in the names `text.opponents` and the
/// league use: `self` (the same policy: mirror play), `base`, a bot's
/// name, `adapter:<name>`, `v<N>` (a past version of the learning
/// adapter, pinned); `none` in a single-player game or when no seat learns.
/// With several opponents, their names joined by `,`.
pub fn opponent_label(record: &GameRecord) -> String {
    let Some(learner) = record.learner_seat else {
        return "none".into();
    };
    let own = &record.seats[learner as usize];
    let mut labels: Vec<String> = Vec::new();
    for (seat, policy) in record.seats.iter().enumerate() {
        if seat == learner as usize {
            continue;
        }
        let label = match (policy, own) {
            _ if policy == own => "self".to_string(),
            (SeatPolicy::Bot(name), _) => name.clone(),
            (SeatPolicy::Model(None), _) => "base".to_string(),
            // The learning adapter pinned at another version: a past self.
            (
                SeatPolicy::Model(Some(AdapterRef {
                    name,
                    version: Some(v),
                })),
                SeatPolicy::Model(Some(learning)),
            ) if *name == learning.name => format!("v{v}"),
            (SeatPolicy::Model(Some(adapter)), _) => format!("adapter:{}", adapter.name),
        };
        if !labels.contains(&label) {
            labels.push(label);
        }
    }
    if labels.is_empty() {
        "none".into()
    } else {
        labels.join(",")
    }
}

/// Whether a game is among the `rate` share written: decided by a hash of
/// the game (its player, env, seed, end time and branch), so every tracker
/// (a restarted one, or two watching one run) picks the same games, and
/// the choice is independent of the order games arrive in.
pub fn sampled(record: &GameRecord, rate: f64) -> bool {
    if rate >= 1.0 {
        return true;
    }
    if rate.is_nan() || rate <= 0.0 {
        return false;
    }
    let mut key = Vec::with_capacity(record.runner_id.len() + record.env_id.len() + 40);
    key.extend_from_slice(record.runner_id.as_bytes());
    key.push(0);
    key.extend_from_slice(record.env_id.as_bytes());
    key.push(0);
    key.extend_from_slice(&record.seed.to_le_bytes());
    key.extend_from_slice(&record.finished_unix_ms.to_le_bytes());
    if let Some(b) = record.branch {
        key.extend_from_slice(&b.group.to_le_bytes());
        key.extend_from_slice(&b.index.to_le_bytes());
    }
    // The top 53 bits as a fraction in [0, 1).
    let fraction = (stable_hash(&key) >> 11) as f64 / (1u64 << 53) as f64;
    fraction < rate
}

/// FNV-1a, then SplitMix64's finalizer to spread nearby keys: the same
/// value on every platform and Rust release (std's hashers promise neither).
fn stable_hash(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        h ^= b as u64;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h ^= h >> 30;
    h = h.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    h ^= h >> 27;
    h = h.wrapping_mul(0x94d0_49bb_1331_11eb);
    h ^ (h >> 31)
}

/// Why a run's games could not be read.
#[derive(Debug, thiserror::Error)]
pub enum GamesError {
    #[error("reading {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// What [`read`] found.
#[derive(Debug, Default)]
pub struct Games {
    /// Every game, in the order written (oldest first).
    pub games: Vec<GameLine>,
    /// [`ROTATED`] exists: the games reached `tracker.games_max_bytes`, and
    /// games older than its first may have been dropped.
    pub rotated: bool,
    /// Lines that did not parse (a line being written as the file was
    /// read, or a file damaged), skipped.
    pub unreadable: usize,
    /// Neither file exists.
    pub missing: bool,
}

/// Reads a run directory's games: [`ROTATED`] (if any), then [`FILE`].
pub fn read(run_dir: &Path) -> Result<Games, GamesError> {
    let mut out = Games::default();
    let mut found = 0;
    for name in [ROTATED, FILE] {
        let path = run_dir.join(name);
        let file = match std::fs::File::open(&path) {
            Ok(file) => file,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(source) => return Err(GamesError::Io { path, source }),
        };
        found += 1;
        out.rotated |= name == ROTATED;
        for line in std::io::BufReader::new(file).lines() {
            let line = line.map_err(|source| GamesError::Io {
                path: path.clone(),
                source,
            })?;
            if line.trim().is_empty() {
                continue;
            }
            match serde_json::from_str::<GameLine>(&line) {
                Ok(game) => out.games.push(game),
                Err(_) => out.unreadable += 1,
            }
        }
    }
    out.missing = found == 0;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use relay_proto::{Tensor, SCHEMA_VERSION};

    fn model(version: Option<u64>) -> SeatPolicy {
        SeatPolicy::Model(Some(AdapterRef {
            name: "policy".into(),
            version,
        }))
    }

    fn record(seats: Vec<SeatPolicy>, learner_seat: Option<u8>, seed: u64) -> GameRecord {
        let n = seats.len();
        GameRecord {
            schema: SCHEMA_VERSION,
            runner_id: "env-runner-1".into(),
            env_id: "TicTacToe-v0".into(),
            seed,
            seats,
            learner_seat,
            turns: vec![TextTurn {
                player: 0,
                prompt_tokens: Tensor::from_u32(&[3], &[1, 2, 3]),
                completion_tokens: Tensor::from_u32(&[2], &[4, 5]),
                logprobs: Tensor::from_f32(&[2], &[-0.5, -0.25]),
                action: "[4]".into(),
                invalid: false,
                adapter: Some(AdapterRef {
                    name: "policy".into(),
                    version: Some(7),
                }),
                observation: "board".into(),
                completion: "center. [4]".into(),
                no_answer: false,
                truncated: true,
            }],
            rewards: vec![0.0; n],
            reasons: vec![String::new(); n],
            duration_ms: 12,
            finished_unix_ms: 1_700_000_000_000 + seed,
            branch: None,
        }
    }

    #[test]
    fn opponents_are_named_as_the_config_and_the_league_name_them() {
        let label = |seats, learner| opponent_label(&record(seats, learner, 0));
        assert_eq!(
            label(vec![model(None), SeatPolicy::Bot("random".into())], Some(0)),
            "random"
        );
        assert_eq!(label(vec![model(None), model(None)], Some(1)), "self");
        assert_eq!(label(vec![model(Some(3)), model(None)], Some(1)), "v3");
        assert_eq!(
            label(vec![SeatPolicy::Model(None), model(None)], Some(1)),
            "base"
        );
        let other = SeatPolicy::Model(Some(AdapterRef {
            name: "sft".into(),
            version: Some(1),
        }));
        assert_eq!(label(vec![model(None), other], Some(0)), "adapter:sft");
        assert_eq!(label(vec![model(None)], Some(0)), "none");
        assert_eq!(label(vec![model(None), model(None)], None), "none");
    }

    #[test]
    fn a_line_keeps_the_text_and_counts_the_tokens() {
        let game = record(
            vec![model(None), SeatPolicy::Bot("random".into())],
            Some(0),
            5,
        );
        let line = GameLine::train(&game, "t".into());
        let json = serde_json::to_value(&line).unwrap();
        assert_eq!(json["kind"], "train");
        assert_eq!(json["opponent"], "random");
        assert_eq!(json["version"], 7);
        assert_eq!(json["seats"][0]["model"]["name"], "policy");
        assert_eq!(json["seats"][1]["bot"], "random");
        let turn = &json["turns"][0];
        assert_eq!(turn["completion"], "center. [4]");
        assert_eq!(turn["prompt_tokens"], 3);
        assert_eq!(turn["completion_tokens"], 2);
        assert_eq!(turn["truncated"], true);
        assert!(json.get("evaluator").is_none(), "{json}");
        assert!(!json.to_string().contains("logprobs"), "{json}");
        let back: GameLine = serde_json::from_value(json).unwrap();
        assert_eq!(back, line);

        let eval = GameLine::eval(
            &EvalGame {
                schema: SCHEMA_VERSION,
                evaluator: "vs-opponent".into(),
                instance: "ev".into(),
                policy_version: 7,
                opponent: "minimax".into(),
                confirmation: true,
                game,
            },
            "t".into(),
        );
        assert_eq!(eval.kind, GameKind::Eval);
        assert_eq!(eval.opponent, "minimax");
        assert_eq!(eval.evaluator.as_deref(), Some("vs-opponent"));
        assert_eq!(eval.confirmation, Some(true));
    }

    #[test]
    fn sampling_is_deterministic_and_near_the_rate() {
        let games: Vec<GameRecord> = (0..4000)
            .map(|seed| record(vec![model(None)], Some(0), seed))
            .collect();
        let kept = |rate| games.iter().filter(|g| sampled(g, rate)).count();
        assert_eq!(kept(0.0), 0);
        assert_eq!(kept(1.0), 4000);
        let tenth = kept(0.1);
        assert!((320..=480).contains(&tenth), "{tenth}");
        assert_eq!(kept(0.1), tenth);
        // A game kept at one rate is kept at every larger rate.
        assert!(games.iter().all(|g| !sampled(g, 0.1) || sampled(g, 0.5)));
    }

    #[test]
    fn reads_the_rotated_file_first_and_skips_broken_lines() {
        let tmp = relay_testkit::TempDir::new("games-read");
        let dir = tmp.path();
        assert!(read(dir).unwrap().missing);
        let line = |seed| {
            serde_json::to_string(&GameLine::train(
                &record(vec![model(None)], Some(0), seed),
                "t".into(),
            ))
            .unwrap()
        };
        std::fs::write(dir.join(ROTATED), format!("{}\n{}\n", line(1), line(2))).unwrap();
        std::fs::write(dir.join(FILE), format!("{}\n{{\"kind\": \"tr", line(3))).unwrap();
        let games = read(dir).unwrap();
        assert!(games.rotated && !games.missing);
        assert_eq!(games.unreadable, 1);
        let seeds: Vec<u64> = games.games.iter().map(|g| g.seed).collect();
        assert_eq!(seeds, [1, 2, 3]);
    }
}
