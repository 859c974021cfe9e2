//! Checkpoints in the run directory:
//! `checkpoints/<updates, 8 digits>/{model.safetensors, optimizer.safetensors, state.json, config.yaml}`,
//! written into a temporary folder and renamed into place, so a reader never
//! sees half a checkpoint.
//!
//! - `state.json` holds [`CheckpointState`]: the counters ([`Progress`]),
//!   the learner's RNG (ChaCha8 seed, stream and word position, so the
//!   minibatch shuffles after a resume are the ones the run would have
//!   drawn) and the best eval figure so far (see the learner's `evaluated::eval_figure`). The schedules (learning rate,
//!   clip range) are functions of `env_steps / run.total_env_steps`, so the
//!   saved `env_steps` is their position.
//! - `checkpoints/last` links the newest checkpoint of the learner's own
//!   state (periodic, and the final one); `checkpoints/best` the one saved
//!   for the best eval figure so far, and `checkpoints/solved` the one saved
//!   for the evaluation that solved the run (screening and confirmation
//!   passed). Those two hold the weights of the version the evaluator
//!   played, byte for byte (the learner's `evaluated`: the published tensors,
//!   and the normalisation statistics that version carried), and the rest
//!   of the learner's state (optimizer, counters, RNG, other networks) as
//!   it was when the report arrived; `state.json`'s `weights_version` names
//!   the version the weights are. A run that stops because it is solved
//!   (`run.stop_when_solved`) ends with a checkpoint of the solving
//!   version's weights, linked `last` too, so `relay play @last` plays the
//!   confirmed policy.
//! - A checkpoint is never overwritten while a pin or a link other than
//!   those the new one takes holds it: a later checkpoint of the same
//!   update count then takes the next free number.
//! - `checkpoints/pinned.json` (a JSON array of checkpoint numbers, written by
//!   `relay checkpoints pin`) lists checkpoints never removed; otherwise only
//!   the newest `<algo>.keep_checkpoints` (`ppo`, `a2c`, `reinforce` or, for
//!   text runs, `rl`) and the best are kept.
//! - `vec_normalize.safetensors` (runs with a `normalize` section on) holds
//!   the run's observation and return statistics
//!   (relay-nn's `VecNormalize::save`: f32 tensors, exact f64 counts in the
//!   metadata); a resumed learner continues from them.
//! - `optimizer.safetensors` holds the Adam or RMSprop state
//!   (the learner's `Optimizer`), whichever the run's algorithm uses.
//! - Text runs (LoRA adapters, the learner's `text`) write
//!   `adapter/` ([`ADAPTER_DIR`]: `{adapter_config.json, adapter_model.safetensors}`, PEFT),
//!   with a KL term measured against a warm start also `reference/`
//!   ([`REFERENCE_DIR`], the same PEFT layout: the adapter the run started
//!   from, which a resumed run measures against again),
//!   `optimizer.safetensors` (AdamW moments, relay-llm's `AdamW::save`) and
//!   a `state.json` of the learner's `TextCheckpointState` (a [`CheckpointState`] reader sees its `Progress` and `weights_version`) instead of the
//!   model and Adam files.
//! - `checkpoints/published.json` records the highest weights version the
//!   learner has published (written before each publish), so a resumed
//!   learner publishes above it and no subscriber sees the version go back.

//!
//! This module owns the format and its bookkeeping (numbers, links, pins,
//! pruning, `state.json`, `published.json`); the learner fills the tensors.

use std::path::{Path, PathBuf};

use rand_chacha::ChaCha8Rng;
use relay_config::ExperimentConfig;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

/// Counters that a checkpoint carries.
#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize, PartialEq)]
pub struct Progress {
    pub version: u64,
    pub updates: u64,
    pub env_steps: u64,
    pub vec_steps: u64,
    /// Training episodes that ended in the rollouts trained on (0 in
    /// checkpoints written before it was counted).
    #[serde(default)]
    pub episodes: u64,
}

/// The folder of a text run's LoRA adapter inside a checkpoint.
pub const ADAPTER_DIR: &str = "adapter";

/// The folder of a text run's KL reference adapter inside a checkpoint
/// (present only when the reference is a warm start, not the base model).
pub const REFERENCE_DIR: &str = "reference";

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
    /// Best eval figure heard so far (the confirmation's mean when there is
    /// one, less `eval.confirm_z` standard errors) and the version it
    /// evaluated.
    #[serde(default)]
    pub best_eval: Option<(f64, u64)>,
    /// The weights version the model file holds: `progress.version`, or an
    /// earlier version an evaluation played (`best`, `solved`). Absent in
    /// checkpoints written before it was recorded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weights_version: Option<u64>,
}

impl CheckpointState {
    /// The bookkeeping of a learner at this moment, its weights the
    /// current ones (see [`Self::holding`]).
    pub fn of(progress: &Progress, rng: &ChaCha8Rng, best_eval: Option<(f64, u64)>) -> Self {
        Self {
            progress: progress.clone(),
            rng: Some(RngState::capture(rng)),
            best_eval,
            weights_version: Some(progress.version),
        }
    }

    /// The same, for a checkpoint holding version `version`'s weights.
    pub fn holding(self, version: u64) -> Self {
        Self {
            weights_version: Some(version),
            ..self
        }
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

/// Logs the outcome of writing a checkpoint of `version`'s weights linked
/// as `links`: a failed checkpoint is an error in the log, never the end of
/// training.
pub fn log_written(written: Result<PathBuf, CheckpointError>, version: u64, links: &[&str]) {
    match written {
        Ok(path) => {
            tracing::info!(path = %path.display(), version, links = ?links, "checkpoint written")
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
pub(crate) fn set_link(root: &Path, link: &str, name: &str) -> Result<(), CheckpointError> {
    let tmp = root.join(format!(".{link}.tmp"));
    let _ = std::fs::remove_file(&tmp);
    std::os::unix::fs::symlink(name, &tmp).map_err(io(&tmp))?;
    std::fs::rename(&tmp, root.join(link)).map_err(io(root))
}

/// Links a checkpoint can have: `last`, and those of evaluated weights.
pub const LINKS: [&str; 3] = ["last", "best", "solved"];

/// Removes numbered checkpoints beyond the newest `keep`, except pinned ones
/// and the targets of `best`, `solved` and `last`; returns the removed numbers.
pub fn prune(run_dir: &Path, keep: usize) -> Vec<u64> {
    let all = list(run_dir);
    let protected: Vec<u64> = pinned(run_dir)
        .into_iter()
        .chain(LINKS.iter().filter_map(|l| link_target(run_dir, l)))
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

/// Resolves a checkpoint name of a run: `last`, `best`, `solved` or a number.
pub fn resolve(run_dir: &Path, which: &str) -> Result<PathBuf, CheckpointError> {
    // `@best` and `@last` are accepted as well as `best` and `last`.
    let which = which.strip_prefix('@').unwrap_or(which);
    let n = match which {
        link if LINKS.contains(&link) => {
            link_target(run_dir, link).ok_or_else(|| CheckpointError::State {
                path: run_dir.join("checkpoints").join(link),
                detail: format!("the run has no `{link}` checkpoint"),
            })?
        }
        other => other.parse::<u64>().map_err(|_| CheckpointError::State {
            path: run_dir.join("checkpoints"),
            detail: format!(
                "checkpoint {other:?} is neither `best`, `last`, `solved` nor a number"
            ),
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

/// File of a checkpoint holding the normalisation statistics.
pub const VEC_NORMALIZE_FILE: &str = "vec_normalize.safetensors";

/// Writes `value` as pretty JSON.
pub fn write_json(path: &Path, value: &impl Serialize) -> Result<(), CheckpointError> {
    std::fs::write(
        path,
        serde_json::to_vec_pretty(value).expect("state serializes"),
    )
    .map_err(io(path))
}

/// Writes checkpoint number `updates` (or, when that folder is pinned or
/// linked by a link other than `links`, the next number that is not): `fill` writes
/// the learner's files into a temporary folder, then `config.yaml` is added
/// and the folder is renamed into place and linked as each of `links`;
/// numbered checkpoints beyond the newest `keep` are pruned.
pub fn write(
    run_dir: &Path,
    updates: u64,
    config: &ExperimentConfig,
    keep: usize,
    links: &[&str],
    fill: impl FnOnce(&Path) -> Result<(), CheckpointError>,
) -> Result<PathBuf, CheckpointError> {
    let root = run_dir.join("checkpoints");
    std::fs::create_dir_all(&root).map_err(io(&root))?;
    // Never overwrite what another link or a pin holds.
    let held: Vec<u64> = pinned(run_dir)
        .into_iter()
        .chain(
            LINKS
                .iter()
                .filter(|l| !links.contains(l))
                .filter_map(|l| link_target(run_dir, l)),
        )
        .collect();
    let number = (updates..)
        .find(|n| !held.contains(n))
        .expect("a free number");
    let name = format!("{number:08}");
    let tmp = root.join(format!(".{name}.tmp"));
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(&tmp).map_err(io(&tmp))?;
    fill(&tmp)?;
    let config_path = tmp.join("config.yaml");
    std::fs::write(&config_path, config.to_yaml()).map_err(io(&config_path))?;
    let dest = root.join(&name);
    let _ = std::fs::remove_dir_all(&dest);
    std::fs::rename(&tmp, &dest).map_err(io(&dest))?;
    for link in links {
        set_link(&root, link, &name)?;
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
