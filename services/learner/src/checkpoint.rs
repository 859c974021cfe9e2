//! Checkpoints in the run directory:
//! `checkpoints/<updates, 8 digits>/{model.safetensors, optimizer.safetensors, state.json, config.yaml}`,
//! written into a temporary folder and renamed into place, so a reader never
//! sees half a checkpoint; `checkpoints/last` links to the newest.

use std::path::{Path, PathBuf};

use relay_kit::ExperimentConfig;
use relay_nn::{ActorCritic, Adam};

use crate::Progress;

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

/// Writes a checkpoint and returns its folder.
pub fn save(
    run_dir: &Path,
    model: &ActorCritic,
    adam: &Adam,
    progress: &Progress,
    config: &ExperimentConfig,
) -> Result<PathBuf, CheckpointError> {
    let root = run_dir.join("checkpoints");
    std::fs::create_dir_all(&root).map_err(io(&root))?;
    let name = format!("{:08}", progress.updates);
    let tmp = root.join(format!(".{name}.tmp"));
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(&tmp).map_err(io(&tmp))?;
    model
        .save(tmp.join("model.safetensors"))
        .map_err(|e| CheckpointError::Tensors(e.to_string()))?;
    adam.save(tmp.join("optimizer.safetensors"))
        .map_err(|e| CheckpointError::Tensors(e.to_string()))?;
    let state = tmp.join("state.json");
    std::fs::write(
        &state,
        serde_json::to_vec_pretty(progress).expect("progress serializes"),
    )
    .map_err(io(&state))?;
    let config_path = tmp.join("config.yaml");
    std::fs::write(&config_path, config.to_yaml()).map_err(io(&config_path))?;
    let dest = root.join(&name);
    let _ = std::fs::remove_dir_all(&dest);
    std::fs::rename(&tmp, &dest).map_err(io(&dest))?;
    let link_tmp = root.join(".last.tmp");
    let _ = std::fs::remove_file(&link_tmp);
    std::os::unix::fs::symlink(&name, &link_tmp).map_err(io(&link_tmp))?;
    std::fs::rename(&link_tmp, root.join("last")).map_err(io(&root))?;
    Ok(dest)
}

/// Reads a checkpoint folder's counters.
pub fn load_progress(dir: &Path) -> Result<Progress, CheckpointError> {
    let path = dir.join("state.json");
    let text = std::fs::read_to_string(&path).map_err(io(&path))?;
    serde_json::from_str(&text).map_err(|e| CheckpointError::State {
        path,
        detail: e.to_string(),
    })
}
