//! TextArena games through the env bridge: any id of TextArena's registry
//! (`ta.make(id)` with the id's own wrappers) behind relay's [`TextGame`]
//! trait, so the env-runner, the evaluator, the bots, the league and the
//! CLI play them as they play the built-in games.
//!
//! # How a game runs
//! All TextArena games of one env config in a process share one Python
//! worker (the program of [`crate::WORKER_SOURCE`], `text_*` ops): a text
//! game waits on a language model for every move, so a pipe round trip per
//! move (~0.1 ms) is nothing beside it, and one interpreter serves every
//! game in flight. Each [`PyTextGame`] is a numbered game in that worker
//! and a mirror of its state on the Rust side: after `reset` and each
//! `step` the worker sends the new messages of every player, whose turn it
//! is, the outcome, `game_info`, the legal moves it found, and what the
//! id's own observation wrapper shows the player to move. So every read
//! ([`TextGame::observation_as`], [`TextGame::legal_moves`], ...) is local,
//! and only `reset`, `step`, `clone_box` and drop reach Python.
//!
//! # Observations
//! [`ObservationView::Full`] is what TextArena's `get_observation()`
//! returns for the player to move under the id's registered wrappers
//! (`LLMObservationWrapper`'s transcript for the default ids; a `-train`
//! id's own wrapper otherwise), byte for byte. For any other player, or
//! once the game is over, it is the transcript rendered as
//! `LLMObservationWrapper` renders it. `first_last` and `compact` render
//! the player's messages as for relay's games ([`Transcript`]).
//!
//! # Legal moves
//! TextArena has no API for them. The worker takes the bracketed tokens
//! after the newest "Available Moves:" / "Valid moves:" / "available
//! actions are:" heading sent to the player to move (TicTacToe, SimpleTak,
//! Kuhn Poker and most board and card games list them). A game that lists
//! none has no legal moves here: constrained decoding is then off for it,
//! and the random bot refuses it by name.
//!
//! # Randomness
//! TextArena seeds Python's global `random` in `reset`; the worker keeps
//! each game's own `random` state between its steps, so games interleaved
//! in one worker replay exactly from their seeds (what branched games rely
//! on).
//!
//! # Faults
//! An exception in a game's `step` loses that game
//! ([`EnvError::External`] with the traceback, which also goes to the log);
//! the worker lives on. A worker that ends, or does not answer within
//! `env.step_timeout_s`, is killed; every game it held is lost and the next
//! game starts a new worker ([`worker_restarts`] counts them).

use std::any::Any;
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use relay_envs::text::Transcript;
use relay_envs::{EnvError, ObservationView, PlayerInfo, StepOutcome, TextGame};
use serde::{Deserialize, Serialize};

use crate::error::BridgeError;
use crate::python::{failure_error, start_error};
use crate::section::EnvSection;
use crate::worker::{Failure, Worker};

/// The text game `env_id` as `section` chooses it: relay's built-in game,
/// or TextArena's through a Python worker. A new game is reset with seed 0,
/// as relay's games are.
///
/// # Errors
/// The built-in registry's [`EnvError::UnknownEnv`]; for TextArena games,
/// what starting the worker found (missing package, unknown id, a game that
/// takes none of the player counts tried).
pub fn make_text_game(
    env_id: &str,
    section: &EnvSection,
) -> Result<Box<dyn TextGame>, BridgeError> {
    if !section.text_uses_python() {
        return Ok(relay_envs::make_text_game(env_id)?);
    }
    let worker = shared_worker(env_id, section)?;
    Ok(Box::new(PyTextGame::new(worker, 0)))
}

/// TextArena workers restarted in this process (crashed or hung).
pub fn worker_restarts() -> u64 {
    RESTARTS.load(Ordering::Relaxed)
}

static RESTARTS: AtomicU64 = AtomicU64::new(0);

/// The worker of `env_id` under `section`, started (and the id checked) on
/// first use.
fn shared_worker(env_id: &str, section: &EnvSection) -> Result<Arc<TextWorker>, BridgeError> {
    static WORKERS: OnceLock<Mutex<HashMap<String, Arc<TextWorker>>>> = OnceLock::new();
    let key = crate::cache_key(env_id, section);
    let mut workers = WORKERS
        .get_or_init(Default::default)
        .lock()
        .expect("text workers");
    if let Some(worker) = workers.get(&key) {
        return Ok(worker.clone());
    }
    let worker = TextWorker {
        env_id: crate::intern(env_id),
        section: section.clone(),
        python: section.interpreter(),
        process: Mutex::new(Process::default()),
    };
    {
        let mut process = worker.process.lock().expect("text worker");
        process.num_players = process.start(&worker)?;
    }
    let worker = Arc::new(worker);
    workers.insert(key, worker.clone());
    Ok(worker)
}

/// One Python worker serving every TextArena game of one env config.
struct TextWorker {
    env_id: &'static str,
    section: EnvSection,
    python: PathBuf,
    process: Mutex<Process>,
}

/// The worker process, and how many times it was started.
#[derive(Default)]
struct Process {
    worker: Option<Worker>,
    /// Bumped each time a worker starts: games of an older generation are lost.
    generation: u64,
    num_players: usize,
}

#[derive(Serialize)]
struct TextInit<'a> {
    op: &'static str,
    env_id: &'a str,
    kwargs: &'a std::collections::BTreeMap<String, serde_json::Value>,
    imports: &'a [String],
    python_path: &'a [PathBuf],
    num_players: Option<usize>,
}

#[derive(Deserialize)]
struct InitReply {
    num_players: usize,
}

/// A request about one game.
#[derive(Serialize)]
struct GameRequest<'a> {
    op: &'static str,
    game: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    seed: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    action: Option<&'a str>,
}

#[derive(Deserialize)]
struct Made {
    game: u64,
    #[serde(default)]
    snapshot: Option<Snapshot>,
}

/// A game's state as the worker reports it after `reset` and each `step`.
#[derive(Debug, Clone, Deserialize)]
struct Snapshot {
    /// Who submitted the action (none after a reset).
    mover: Option<usize>,
    invalid_move: bool,
    current_player: usize,
    done: bool,
    turn: u32,
    rewards: Option<Vec<f64>>,
    info: Vec<PlayerInfo>,
    /// `[player, sender, message]` sent since the last snapshot.
    messages: Vec<(usize, String, String)>,
    /// The id's own observation of the player to move (while running).
    wrapped: Option<String>,
    legal: Vec<String>,
    state_key: String,
}

impl Process {
    /// Starts a worker and makes the game once (`text_init`): the number of
    /// players it takes.
    fn start(&mut self, owner: &TextWorker) -> Result<usize, BridgeError> {
        let label = "text games";
        let mut worker =
            Worker::spawn(&owner.python, owner.env_id).map_err(|source| BridgeError::NoPython {
                python: owner.python.display().to_string(),
                source,
            })?;
        let init = TextInit {
            op: "text_init",
            env_id: owner.env_id,
            kwargs: &owner.section.kwargs,
            imports: &owner.section.imports,
            python_path: &owner.section.python_path,
            num_players: owner.section.num_players,
        };
        let timeout = Duration::from_secs_f64(owner.section.start_timeout_s);
        let reply: InitReply = worker
            .call(&init, timeout)
            .map_err(|f| start_error(owner.env_id, &owner.python, label, f))?;
        self.worker = Some(worker);
        self.generation += 1;
        Ok(reply.num_players)
    }
}

impl TextWorker {
    /// One request; `generation` is the game's (`None` for a new game). A
    /// worker that ended or hung is dropped (killed), and the next new game
    /// starts another.
    fn call<R: serde::de::DeserializeOwned>(
        &self,
        request: &GameRequest<'_>,
        generation: Option<u64>,
    ) -> Result<(R, u64), String> {
        let mut process = self.process.lock().expect("text worker");
        if process.worker.is_none() {
            if generation.is_some() {
                return Err("its Python worker was restarted; the game is lost".into());
            }
            process.start(self).map_err(|e| e.to_string())?;
            RESTARTS.fetch_add(1, Ordering::Relaxed);
        }
        if generation.is_some_and(|g| g != process.generation) {
            return Err("its Python worker was restarted; the game is lost".into());
        }
        let timeout = Duration::from_secs_f64(self.section.step_timeout_s);
        let worker = process.worker.as_mut().expect("started");
        match worker.call::<_, R>(request, timeout) {
            Ok(reply) => Ok((reply, process.generation)),
            Err(Failure::Replied(e)) => {
                tracing::warn!(
                    env_id = self.env_id,
                    "TextArena game raised in {}: {}\n{}",
                    request.op,
                    e.message,
                    e.traceback
                );
                Err(format!(
                    "{} raised {}\n{}",
                    request.op,
                    e.message,
                    e.traceback.trim_end()
                ))
            }
            Err(failure) => {
                process.worker = None;
                let error = failure_error(self.env_id, failure);
                tracing::warn!(env_id = self.env_id, "TextArena worker lost: {error}");
                Err(error.to_string())
            }
        }
    }

    fn num_players(&self) -> usize {
        self.process.lock().expect("text worker").num_players
    }
}

/// The state of one game as the Rust side sees it.
#[derive(Debug, Clone)]
struct Mirror {
    current_player: usize,
    done: bool,
    turn: u32,
    rewards: Option<Vec<f64>>,
    info: Vec<PlayerInfo>,
    transcripts: Vec<Transcript>,
    wrapped: Option<String>,
    legal: Vec<String>,
    state_key: String,
}

impl Mirror {
    fn new(num_players: usize) -> Self {
        Self {
            current_player: 0,
            done: false,
            turn: 0,
            rewards: None,
            info: (0..num_players)
                .map(|p| PlayerInfo {
                    role: format!("Player {p}"),
                    invalid_move: false,
                    turn_count: 0,
                    reason: None,
                })
                .collect(),
            transcripts: vec![Transcript::default(); num_players],
            wrapped: None,
            legal: Vec::new(),
            state_key: String::new(),
        }
    }

    fn apply(&mut self, snapshot: Snapshot) {
        for (player, sender, message) in &snapshot.messages {
            if let Some(transcript) = self.transcripts.get_mut(*player) {
                transcript.push(sender, message);
            }
        }
        self.current_player = snapshot.current_player;
        self.done = snapshot.done;
        self.turn = snapshot.turn;
        self.rewards = snapshot.rewards;
        self.info = snapshot.info;
        self.wrapped = snapshot.wrapped;
        self.legal = snapshot.legal;
        self.state_key = snapshot.state_key;
    }
}

/// A TextArena game in a Python worker (see the module docs).
pub struct PyTextGame {
    worker: Arc<TextWorker>,
    /// The game's number in the worker and the worker's generation.
    handle: Option<(u64, u64)>,
    mirror: Mirror,
    /// Why the game can no longer be played (its worker failed).
    failure: Option<String>,
}

impl std::fmt::Debug for PyTextGame {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PyTextGame")
            .field("env_id", &self.worker.env_id)
            .field("handle", &self.handle)
            .field("failure", &self.failure)
            .finish_non_exhaustive()
    }
}

impl PyTextGame {
    fn new(worker: Arc<TextWorker>, seed: u64) -> Self {
        let mut game = Self {
            mirror: Mirror::new(worker.num_players()),
            worker,
            handle: None,
            failure: None,
        };
        game.reset(seed);
        game
    }

    fn external(&self, message: impl Into<String>) -> EnvError {
        EnvError::External {
            id: self.worker.env_id.to_string(),
            message: message.into(),
        }
    }

    fn close(&mut self) {
        if let Some((game, generation)) = self.handle.take() {
            let request = GameRequest {
                op: "text_close",
                game,
                seed: None,
                action: None,
            };
            let _ = self
                .worker
                .call::<serde::de::IgnoredAny>(&request, Some(generation));
        }
    }
}

impl Drop for PyTextGame {
    fn drop(&mut self) {
        self.close();
    }
}

impl TextGame for PyTextGame {
    fn id(&self) -> &'static str {
        self.worker.env_id
    }

    fn num_players(&self) -> usize {
        self.mirror.transcripts.len()
    }

    fn reset(&mut self, seed: u64) {
        self.mirror = Mirror::new(self.num_players());
        self.failure = None;
        let reply = match self.handle {
            Some((game, generation)) => {
                let request = GameRequest {
                    op: "text_reset",
                    game,
                    seed: Some(seed),
                    action: None,
                };
                self.worker
                    .call::<Snapshot>(&request, Some(generation))
                    .map(|(snapshot, _)| (snapshot, game, generation))
            }
            None => Err(String::new()),
        };
        let reply = reply.or_else(|_| {
            self.handle = None;
            let request = GameRequest {
                op: "text_make",
                game: 0,
                seed: Some(seed),
                action: None,
            };
            self.worker
                .call::<Made>(&request, None)
                .and_then(|(made, generation)| match made.snapshot {
                    Some(snapshot) => Ok((snapshot, made.game, generation)),
                    None => Err("text_make sent no snapshot".into()),
                })
        });
        match reply {
            Ok((snapshot, game, generation)) => {
                self.handle = Some((game, generation));
                self.mirror.apply(snapshot);
            }
            Err(message) => self.failure = Some(message),
        }
    }

    fn current_player(&self) -> usize {
        self.mirror.current_player
    }

    fn is_done(&self) -> bool {
        self.mirror.done
    }

    fn observation_as(&self, player: usize, view: ObservationView) -> String {
        let transcript = &self.mirror.transcripts[player];
        match (&self.mirror.wrapped, view) {
            (Some(wrapped), ObservationView::Full) if player == self.mirror.current_player => {
                wrapped.clone()
            }
            _ => transcript.render(view),
        }
    }

    fn legal_moves(&self) -> Vec<String> {
        if self.mirror.done {
            Vec::new()
        } else {
            self.mirror.legal.clone()
        }
    }

    fn step(&mut self, action: &str) -> Result<StepOutcome, EnvError> {
        if let Some(failure) = &self.failure {
            return Err(self.external(failure.clone()));
        }
        if self.mirror.done {
            return Err(EnvError::GameOver {
                id: self.worker.env_id,
            });
        }
        let (game, generation) = self.handle.expect("a running game has a handle");
        let request = GameRequest {
            op: "text_step",
            game,
            seed: None,
            action: Some(action),
        };
        match self.worker.call::<Snapshot>(&request, Some(generation)) {
            Ok((snapshot, _)) => {
                let outcome = StepOutcome {
                    player: snapshot.mover.unwrap_or(self.mirror.current_player),
                    invalid_move: snapshot.invalid_move,
                    done: snapshot.done,
                };
                self.mirror.apply(snapshot);
                Ok(outcome)
            }
            Err(message) => {
                self.failure = Some(message.clone());
                Err(self.external(message))
            }
        }
    }

    fn rewards(&self) -> Option<Vec<f64>> {
        self.mirror.rewards.clone()
    }

    fn game_info(&self) -> Vec<PlayerInfo> {
        self.mirror.info.clone()
    }

    fn turn(&self) -> u32 {
        self.mirror.turn
    }

    fn state_key(&self) -> String {
        self.mirror.state_key.clone()
    }

    fn clone_box(&self) -> Box<dyn TextGame> {
        let mut copy = PyTextGame {
            worker: self.worker.clone(),
            handle: None,
            mirror: self.mirror.clone(),
            failure: self.failure.clone(),
        };
        if let (Some((game, generation)), None) = (self.handle, &self.failure) {
            let request = GameRequest {
                op: "text_clone",
                game,
                seed: None,
                action: None,
            };
            match self.worker.call::<Made>(&request, Some(generation)) {
                Ok((made, generation)) => copy.handle = Some((made.game, generation)),
                Err(message) => copy.failure = Some(message),
            }
        }
        Box::new(copy)
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}
