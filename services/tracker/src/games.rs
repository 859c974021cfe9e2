//! The run directory's `games.jsonl`: the tracker is its one writer, of
//! the training games the env-runners publish (`relay.<run>.games`) and
//! the games the evaluators play (`relay.<run>.eval.games`), so that
//! `relay games` finds both in one place, in the order they were heard.
//!
//! What a line holds and which games are written come from
//! [`relay_runs::games`] (shared with the reader); this module owns the
//! file: it is opened on the first game written (runs without text games
//! get none), and kept within `tracker.games_max_bytes` by rotation: once
//! the next game would take `games.jsonl` past half the bound, the file
//! becomes `games.1.jsonl` (replacing the older games there) and a new one
//! begins. The first rotation is logged as a warning, and so is the first
//! game too large to fit half the bound (it is not written).

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::PathBuf;

use relay_config::TrackerConfig;
use relay_proto::{EvalGame, GameRecord};
use relay_runs::games::{sampled, GameLine, FILE, ROTATED};

/// The games file of one run directory.
pub struct GamesFile {
    root: PathBuf,
    file: Option<BufWriter<File>>,
    /// Bytes `games.jsonl` holds, counting what is still buffered.
    size: u64,
    train_rate: f64,
    eval_rate: f64,
    max_bytes: Option<u64>,
    warned_rotation: bool,
    warned_oversized: bool,
}

impl GamesFile {
    pub fn new(root: PathBuf, config: &TrackerConfig) -> Self {
        Self {
            root,
            file: None,
            size: 0,
            train_rate: config.games_train_rate,
            eval_rate: config.games_eval_rate,
            max_bytes: config.games_max_bytes,
            warned_rotation: false,
            warned_oversized: false,
        }
    }

    /// Writes a training game if it is among the `games_train_rate` share.
    pub fn train(&mut self, record: &GameRecord, time: String) -> std::io::Result<()> {
        if !sampled(record, self.train_rate) {
            return Ok(());
        }
        self.write(&GameLine::train(record, time))
    }

    /// Writes an evaluation game if it is among the `games_eval_rate` share.
    pub fn eval(&mut self, game: &EvalGame, time: String) -> std::io::Result<()> {
        if !sampled(&game.game, self.eval_rate) {
            return Ok(());
        }
        self.write(&GameLine::eval(game, time))
    }

    fn write(&mut self, line: &GameLine) -> std::io::Result<()> {
        let mut text = serde_json::to_string(line).map_err(std::io::Error::other)?;
        text.push('\n');
        let bytes = text.len() as u64;
        if self.file.is_none() {
            self.open()?;
        }
        if let Some(max) = self.max_bytes {
            let half = max / 2;
            if bytes > half {
                if !self.warned_oversized {
                    self.warned_oversized = true;
                    tracing::warn!(
                        bytes,
                        max_bytes = max,
                        env_id = %line.env_id,
                        seed = line.seed,
                        "a game is larger than half of tracker.games_max_bytes and is not written to games.jsonl (nor any such game after it)"
                    );
                }
                return Ok(());
            }
            if self.size + bytes > half {
                self.rotate(max)?;
            }
        }
        let file = self.file.as_mut().expect("opened above");
        file.write_all(text.as_bytes())?;
        self.size += bytes;
        Ok(())
    }

    /// Opens `games.jsonl` for appending (a restarted tracker goes on
    /// with the file it left).
    fn open(&mut self) -> std::io::Result<()> {
        let path = self.root.join(FILE);
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)?;
        self.size = file.metadata()?.len();
        self.file = Some(BufWriter::new(file));
        Ok(())
    }

    /// Moves `games.jsonl` to `games.1.jsonl` and starts a new one.
    fn rotate(&mut self, max: u64) -> std::io::Result<()> {
        if let Some(mut file) = self.file.take() {
            file.flush()?;
        }
        let (current, rotated) = (self.root.join(FILE), self.root.join(ROTATED));
        let dropped = rotated.exists();
        std::fs::rename(&current, &rotated)?;
        if !self.warned_rotation {
            self.warned_rotation = true;
            tracing::warn!(
                max_bytes = max,
                older_games_dropped = dropped,
                "games.jsonl reached half of tracker.games_max_bytes: it is now games.1.jsonl and a new games.jsonl begins; from here on each rotation drops the games.1.jsonl before it, keeping the newest games within the bound (logged once)"
            );
        }
        self.open()
    }

    pub fn flush(&mut self) -> std::io::Result<()> {
        match &mut self.file {
            Some(file) => file.flush(),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use relay_proto::{SeatPolicy, SCHEMA_VERSION};

    fn game(seed: u64, action: &str) -> GameRecord {
        GameRecord {
            schema: SCHEMA_VERSION,
            runner_id: "r".into(),
            env_id: "TicTacToe-v0".into(),
            seed,
            seats: vec![SeatPolicy::Bot("random".into())],
            learner_seat: Some(0),
            turns: vec![relay_proto::TextTurn {
                player: 0,
                prompt_tokens: relay_proto::Tensor::from_u32(&[0], &[]),
                completion_tokens: relay_proto::Tensor::from_u32(&[0], &[]),
                logprobs: relay_proto::Tensor::from_f32(&[0], &[]),
                action: action.into(),
                invalid: false,
                adapter: None,
                observation: String::new(),
                completion: String::new(),
                no_answer: false,
                truncated: false,
            }],
            rewards: vec![1.0],
            reasons: vec![String::new()],
            duration_ms: 1,
            finished_unix_ms: seed,
            branch: None,
        }
    }

    #[test]
    fn rotation_keeps_the_newest_games_within_the_bound() {
        let tmp = relay_testkit::TempDir::new("tracker-games-rotation");
        let root = tmp.path().to_path_buf();
        let config = TrackerConfig {
            games_train_rate: 1.0,
            games_max_bytes: Some(4000),
            ..Default::default()
        };
        let mut file = GamesFile::new(root.clone(), &config);
        for seed in 0..40 {
            file.train(&game(seed, "[1]"), "t".into()).unwrap();
        }
        // A game over half the bound is left out.
        file.train(&game(99, &"x".repeat(3000)), "t".into())
            .unwrap();
        file.flush().unwrap();
        let size = |name| std::fs::metadata(root.join(name)).unwrap().len();
        assert!(size(FILE) <= 2000 && size(ROTATED) <= 2000);
        let games = relay_runs::games::read(&root).unwrap();
        assert!(games.rotated);
        let seeds: Vec<u64> = games.games.iter().map(|g| g.seed).collect();
        // The newest games, in order, ending with the last one written.
        assert_eq!(seeds.last(), Some(&39));
        assert!(seeds.windows(2).all(|w| w[1] == w[0] + 1), "{seeds:?}");
        assert!(seeds.len() < 40 && seeds.len() > 5, "{seeds:?}");
        assert!(file.warned_rotation && file.warned_oversized);
    }
}
