//! Checkpoints in the run directory:
//! `checkpoints/<updates, 8 digits>/{model.safetensors, optimizer.safetensors, state.json, config.yaml}`,
//! written into a temporary folder and renamed into place, so a reader never
//! sees half a checkpoint.
//!
//! - `state.json` holds [`CheckpointState`]: the counters ([`Progress`]),
//!   the learner's RNG (ChaCha8 seed, stream and word position, so the
//!   minibatch shuffles after a resume are the ones the run would have
//!   drawn) and the best eval mean so far. The schedules (learning rate,
//!   clip range) are functions of `env_steps / run.total_env_steps`, so the
//!   saved `env_steps` is their position.
//! - `checkpoints/last` links the newest checkpoint written, `checkpoints/best`
//!   the one written when the best eval mean so far arrived.
//! - `checkpoints/pinned.json` (a JSON array of checkpoint numbers, written by
//!   `relay checkpoints pin`) lists checkpoints never removed; otherwise only
//!   the newest `<algo>.keep_checkpoints` (`ppo`, `a2c`, `reinforce` or, for
//!   text runs, `rl`) and the best are kept.
//! - `vec_normalize.safetensors` (runs with a `normalize` section on) holds
//!   the run's observation and return statistics
//!   ([`relay_nn::VecNormalize::save`]: f32 tensors, exact f64 counts in the
//!   metadata); a resumed learner continues from them.
//! - `optimizer.safetensors` holds the Adam or RMSprop state
//!   ([`crate::optimizer::Optimizer`]), whichever the run's algorithm uses.
//! - Text runs (LoRA adapters, [`crate::text`]) write
//!   `adapter/{adapter_config.json, adapter_model.safetensors}` (PEFT),
//!   `optimizer.safetensors` (AdamW moments, [`relay_llm::AdamW::save`]) and
//!   a `state.json` of [`crate::text::TextCheckpointState`] instead of the
//!   model and Adam files.
//! - `checkpoints/published.json` records the highest weights version the
//!   learner has published (written before each publish), so a resumed
//!   learner publishes above it and no subscriber sees the version go back.

use std::path::{Path, PathBuf};

use relay_kit::{ExperimentConfig, ServiceError};
use relay_nn::{ActorCritic, VecNormalize};

use rand_chacha::ChaCha8Rng;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::optimizer::Optimizer;
use crate::Progress;

/// The learner's RNG as saved: ChaCha8 seed (hex), stream and word position.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RngState {
    pub seed: String,
    pub stream: u64,
    /// A u128, as a decimal string (JSON numbers stop at 2^53 in many readers).
    pub word_pos: String,
}

impl RngState {
    /// Captures a generator's position.
    pub fn capture(rng: &ChaCha8Rng) -> Self {
        Self {
            seed: rng.get_seed().iter().map(|b| format!("{b:02x}")).collect(),
            stream: rng.get_stream(),
            word_pos: rng.get_word_pos().to_string(),
        }
    }

    /// Rebuilds the generator at the saved position.
    pub fn restore(&self) -> Result<ChaCha8Rng, String> {
        use rand::SeedableRng;
        if self.seed.len() != 64 {
            return Err(format!(
                "rng seed has {} hex digits, expected 64",
                self.seed.len()
            ));
        }
        let mut seed = [0u8; 32];
        for (i, b) in seed.iter_mut().enumerate() {
            *b = u8::from_str_radix(&self.seed[2 * i..2 * i + 2], 16)
                .map_err(|e| format!("rng seed: {e}"))?;
        }
        let word_pos: u128 = self
            .word_pos
            .parse()
            .map_err(|e| format!("rng word_pos: {e}"))?;
        let mut rng = ChaCha8Rng::from_seed(seed);
        rng.set_stream(self.stream);
        rng.set_word_pos(word_pos);
        Ok(rng)
    }
}

/// Everything of the learner's state that is not a tensor (`state.json`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CheckpointState {
    #[serde(flatten)]
    pub progress: Progress,
    /// Absent in checkpoints written before the RNG was saved.
    #[serde(default)]
    pub rng: Option<RngState>,
    /// Best eval mean heard so far (and the version it evaluated).
    #[serde(default)]
    pub best_eval: Option<(f64, u64)>,
}

impl CheckpointState {
    /// The bookkeeping of a learner at this moment.
    pub fn of(progress: &Progress, rng: &ChaCha8Rng, best_eval: Option<(f64, u64)>) -> Self {
        Self {
            progress: progress.clone(),
            rng: Some(RngState::capture(rng)),
            best_eval,
        }
    }
}

/// Where a learner starts: a checkpoint of its own run to continue
/// (`run.resume_from`: weights, optimizer and bookkeeping) or another run's
/// checkpoint to start from (`run.init_from`: weights, and the optimizer
/// unless `run.reset_optimizer`).
#[derive(Debug, Clone)]
pub struct StartFrom {
    /// The checkpoint folder.
    pub dir: PathBuf,
    /// Continuing this run (`run.resume_from`), not a new one.
    pub resume: bool,
}

impl StartFrom {
    /// The run's starting checkpoint, if it names one.
    pub fn of(config: &ExperimentConfig) -> Option<Self> {
        match (&config.run.resume_from, &config.run.init_from) {
            (Some(dir), _) => Some(Self {
                dir: dir.clone(),
                resume: true,
            }),
            (None, Some(dir)) => Some(Self {
                dir: dir.clone(),
                resume: false,
            }),
            (None, None) => None,
        }
    }

    /// A startup failure naming the config field and the folder.
    pub fn error(&self, e: impl std::fmt::Display) -> ServiceError {
        let field = if self.resume {
            "run.resume_from"
        } else {
            "run.init_from"
        };
        ServiceError::other(format!("{field} {}: {e}", self.dir.display()))
    }
}

/// The version a resumed learner publishes first: past its checkpoint's
/// (`saved`) and past every version the run already published, so no
/// subscriber sees the version go back.
pub fn next_version(saved: u64, run_dir: &Path) -> u64 {
    saved.max(published_version(run_dir)) + 1
}

/// The bookkeeping a resumed learner continues with.
#[derive(Debug, Clone)]
pub struct Restored {
    /// The counters, at the [`next_version`].
    pub progress: Progress,
    /// The RNG where the checkpoint left it.
    pub rng: ChaCha8Rng,
    /// The best eval mean heard (and the version it evaluated).
    pub best_eval: Option<(f64, u64)>,
}

/// Reads the bookkeeping of checkpoint folder `dir` of the run in
/// `run_dir` ([`Restored`]; `rng` is kept when the checkpoint predates
/// saved RNGs).
pub fn restore(dir: &Path, run_dir: &Path, rng: ChaCha8Rng) -> Result<Restored, CheckpointError> {
    let saved = load_state(dir)?;
    let rng = match &saved.rng {
        Some(state) => state.restore().map_err(|detail| CheckpointError::State {
            path: dir.join("state.json"),
            detail,
        })?,
        None => rng,
    };
    let mut progress = saved.progress;
    progress.version = next_version(progress.version, run_dir);
    Ok(Restored {
        progress,
        rng,
        best_eval: saved.best_eval,
    })
}

/// Logs the outcome of writing a checkpoint: a failed checkpoint is an
/// error in the log, never the end of training.
pub fn log_written(written: Result<PathBuf, CheckpointError>, version: u64, best: bool) {
    match written {
        Ok(path) => {
            tracing::info!(path = %path.display(), version, best, "checkpoint written")
        }
        Err(e) => tracing::error!(error = %e, "checkpoint failed"),
    }
}

/// Checkpoint numbers in `checkpoints/`, ascending.
pub fn list(run_dir: &Path) -> Vec<u64> {
    let mut out: Vec<u64> = std::fs::read_dir(run_dir.join("checkpoints"))
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| e.path().is_dir() && !e.path().is_symlink())
        .filter_map(|e| e.file_name().to_str().and_then(|n| n.parse().ok()))
        .collect();
    out.sort_unstable();
    out
}

/// The folder of checkpoint `n`.
pub fn folder(run_dir: &Path, n: u64) -> PathBuf {
    run_dir.join("checkpoints").join(format!("{n:08}"))
}

/// The checkpoint a link (`last`, `best`) points to.
pub fn link_target(run_dir: &Path, link: &str) -> Option<u64> {
    std::fs::read_link(run_dir.join("checkpoints").join(link))
        .ok()?
        .to_str()?
        .parse()
        .ok()
}

/// Pinned checkpoint numbers (`checkpoints/pinned.json`).
pub fn pinned(run_dir: &Path) -> Vec<u64> {
    std::fs::read_to_string(run_dir.join("checkpoints").join("pinned.json"))
        .ok()
        .and_then(|t| serde_json::from_str(&t).ok())
        .unwrap_or_default()
}

/// Adds `n` to `checkpoints/pinned.json` (written by rename).
pub fn pin(run_dir: &Path, n: u64) -> Result<(), CheckpointError> {
    let root = run_dir.join("checkpoints");
    let mut list = pinned(run_dir);
    if !list.contains(&n) {
        list.push(n);
        list.sort_unstable();
    }
    let tmp = root.join(".pinned.json.tmp");
    std::fs::write(&tmp, serde_json::to_vec(&list).expect("list serializes")).map_err(io(&tmp))?;
    std::fs::rename(&tmp, root.join("pinned.json")).map_err(io(&root))
}

/// Points `checkpoints/<link>` at checkpoint folder `name` (atomically).
fn set_link(root: &Path, link: &str, name: &str) -> Result<(), CheckpointError> {
    let tmp = root.join(format!(".{link}.tmp"));
    let _ = std::fs::remove_file(&tmp);
    std::os::unix::fs::symlink(name, &tmp).map_err(io(&tmp))?;
    std::fs::rename(&tmp, root.join(link)).map_err(io(root))
}

/// Removes numbered checkpoints beyond the newest `keep`, except pinned ones
/// and the targets of `best` and `last`; returns the removed numbers.
pub fn prune(run_dir: &Path, keep: usize) -> Vec<u64> {
    let all = list(run_dir);
    let protected: Vec<u64> = pinned(run_dir)
        .into_iter()
        .chain(link_target(run_dir, "best"))
        .chain(link_target(run_dir, "last"))
        .collect();
    let cut = all.len().saturating_sub(keep);
    let mut removed = Vec::new();
    for &n in &all[..cut] {
        if !protected.contains(&n) && std::fs::remove_dir_all(folder(run_dir, n)).is_ok() {
            removed.push(n);
        }
    }
    removed
}

/// Resolves a checkpoint name of a run: `last`, `best` or a number.
pub fn resolve(run_dir: &Path, which: &str) -> Result<PathBuf, CheckpointError> {
    // `@best` and `@last` are accepted as well as `best` and `last`.
    let which = which.strip_prefix('@').unwrap_or(which);
    let n = match which {
        "last" | "best" => link_target(run_dir, which).ok_or_else(|| CheckpointError::State {
            path: run_dir.join("checkpoints").join(which),
            detail: format!("the run has no `{which}` checkpoint"),
        })?,
        other => other.parse::<u64>().map_err(|_| CheckpointError::State {
            path: run_dir.join("checkpoints"),
            detail: format!("checkpoint {other:?} is neither `best`, `last` nor a number"),
        })?,
    };
    let dir = folder(run_dir, n);
    if !dir.join("state.json").is_file() {
        return Err(CheckpointError::State {
            path: dir,
            detail: "no such checkpoint (see `relay checkpoints ls`)".into(),
        });
    }
    Ok(dir)
}

/// Highest weights version published by this run's learners (0 if none recorded).
pub fn published_version(run_dir: &Path) -> u64 {
    std::fs::read_to_string(run_dir.join("checkpoints").join("published.json"))
        .ok()
        .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
        .and_then(|v| v["version"].as_u64())
        .unwrap_or(0)
}

/// Records that version `version` is about to be published.
pub fn record_published(run_dir: &Path, version: u64) -> Result<(), CheckpointError> {
    let root = run_dir.join("checkpoints");
    std::fs::create_dir_all(&root).map_err(io(&root))?;
    let tmp = root.join(".published.json.tmp");
    std::fs::write(&tmp, format!("{{\"version\":{version}}}")).map_err(io(&tmp))?;
    std::fs::rename(&tmp, root.join("published.json")).map_err(io(&root))
}

/// Why a checkpoint could not be written or read.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error("checkpoint I/O at {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("checkpoint tensors: {0}")]
    Tensors(String),
    #[error("checkpoint state {path}: {detail}")]
    State { path: PathBuf, detail: String },
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> CheckpointError + '_ {
    move |source| CheckpointError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Writes a checkpoint, links it as `last` (and `best` when `best`), prunes
/// old ones and returns its folder.
pub fn save(
    run_dir: &Path,
    model: &ActorCritic,
    optimizer: &Optimizer,
    normalizer: Option<&VecNormalize>,
    state: &CheckpointState,
    config: &ExperimentConfig,
    best: bool,
) -> Result<PathBuf, CheckpointError> {
    write(
        run_dir,
        state.progress.updates,
        config,
        config.keep_checkpoints(),
        best,
        |tmp| {
            model
                .save(tmp.join("model.safetensors"))
                .map_err(|e| CheckpointError::Tensors(e.to_string()))?;
            optimizer
                .save(tmp.join("optimizer.safetensors"))
                .map_err(|e| CheckpointError::Tensors(e.to_string()))?;
            if let Some(n) = normalizer {
                n.save(tmp.join(VEC_NORMALIZE_FILE))
                    .map_err(|e| CheckpointError::Tensors(e.to_string()))?;
            }
            write_json(&tmp.join("state.json"), state)
        },
    )
}

/// File of a checkpoint holding the normalisation statistics.
pub const VEC_NORMALIZE_FILE: &str = "vec_normalize.safetensors";

/// Restores `normalizer`'s statistics from checkpoint folder `dir`.
pub fn load_normalizer(dir: &Path, normalizer: &mut VecNormalize) -> Result<(), CheckpointError> {
    let path = dir.join(VEC_NORMALIZE_FILE);
    if !path.is_file() {
        return Err(CheckpointError::State {
            path,
            detail: "missing: the run normalises (`normalize` section) but this checkpoint holds no statistics".into(),
        });
    }
    normalizer
        .load(&path)
        .map_err(|e| CheckpointError::Tensors(e.to_string()))
}

/// Writes `value` as pretty JSON.
pub fn write_json(path: &Path, value: &impl Serialize) -> Result<(), CheckpointError> {
    std::fs::write(
        path,
        serde_json::to_vec_pretty(value).expect("state serializes"),
    )
    .map_err(io(path))
}

/// Writes checkpoint number `updates`: `fill` writes the learner's files
/// into a temporary folder, then `config.yaml` is added and the folder is
/// renamed into place and linked as `last` (and `best`); numbered
/// checkpoints beyond the newest `keep` are pruned.
pub fn write(
    run_dir: &Path,
    updates: u64,
    config: &ExperimentConfig,
    keep: usize,
    best: bool,
    fill: impl FnOnce(&Path) -> Result<(), CheckpointError>,
) -> Result<PathBuf, CheckpointError> {
    let root = run_dir.join("checkpoints");
    std::fs::create_dir_all(&root).map_err(io(&root))?;
    let name = format!("{updates:08}");
    let tmp = root.join(format!(".{name}.tmp"));
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(&tmp).map_err(io(&tmp))?;
    fill(&tmp)?;
    let config_path = tmp.join("config.yaml");
    std::fs::write(&config_path, config.to_yaml()).map_err(io(&config_path))?;
    let dest = root.join(&name);
    let _ = std::fs::remove_dir_all(&dest);
    std::fs::rename(&tmp, &dest).map_err(io(&dest))?;
    set_link(&root, "last", &name)?;
    if best {
        set_link(&root, "best", &name)?;
    }
    prune(run_dir, keep);
    Ok(dest)
}

/// Reads a JSON file of a checkpoint.
pub fn read_json<T: DeserializeOwned>(path: &Path) -> Result<T, CheckpointError> {
    let text = std::fs::read_to_string(path).map_err(io(path))?;
    serde_json::from_str(&text).map_err(|e| CheckpointError::State {
        path: path.to_path_buf(),
        detail: e.to_string(),
    })
}

/// Reads a checkpoint folder's `state.json`.
pub fn load_state(dir: &Path) -> Result<CheckpointState, CheckpointError> {
    read_json(&dir.join("state.json"))
}

/// Reads a checkpoint folder's counters.
pub fn load_progress(dir: &Path) -> Result<Progress, CheckpointError> {
    read_json(&dir.join("state.json"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{RngCore, SeedableRng};

    #[test]
    fn a_restored_learner_continues_its_rng_and_publishes_past_every_version() {
        let run_dir = std::env::temp_dir().join(format!("relay-restore-{}", std::process::id()));
        let dir = run_dir.join("checkpoints").join("00000003");
        std::fs::create_dir_all(&dir).unwrap();
        let mut rng = ChaCha8Rng::seed_from_u64(7);
        rng.next_u64();
        let progress = Progress {
            version: 5,
            updates: 3,
            env_steps: 300,
            vec_steps: 75,
            episodes: 2,
        };
        let saved = CheckpointState::of(&progress, &rng, Some((1.5, 4)));
        write_json(&dir.join("state.json"), &saved).unwrap();
        // Versions up to 9 went out after the checkpoint was written.
        record_published(&run_dir, 9).unwrap();

        let restored = restore(&dir, &run_dir, ChaCha8Rng::seed_from_u64(0)).unwrap();
        assert_eq!(restored.progress.version, 10);
        assert_eq!(restored.progress.env_steps, 300);
        assert_eq!(restored.best_eval, Some((1.5, 4)));
        assert_eq!(restored.rng.clone().next_u64(), rng.next_u64());

        // A checkpoint from before RNGs were saved keeps the fresh RNG.
        let old = CheckpointState { rng: None, ..saved };
        write_json(&dir.join("state.json"), &old).unwrap();
        let fresh = ChaCha8Rng::seed_from_u64(11);
        let restored = restore(&dir, &run_dir, fresh.clone()).unwrap();
        assert_eq!(restored.rng, fresh);

        // A broken state file names itself.
        std::fs::write(dir.join("state.json"), "{").unwrap();
        let err = restore(&dir, &run_dir, fresh).unwrap_err().to_string();
        assert!(err.contains("state.json"), "{err}");
        std::fs::remove_dir_all(&run_dir).unwrap();
    }
}
