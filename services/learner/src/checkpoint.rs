//! What a classic learner puts into a checkpoint ([`save`]: the model, the
//! optimizer state (`optimizer.safetensors`, [`crate::optimizer::Optimizer`]),
//! the normalisation statistics, and an evaluated version's published
//! weights ([`put_weights`])) and where a learner starts from
//! ([`StartFrom`]). The folder format, its links, pins, pruning and
//! `state.json` are [`relay_runs::checkpoint`]'s, re-exported here.

pub use relay_runs::checkpoint::*;

use std::path::{Path, PathBuf};

use relay_config::ExperimentConfig;
use relay_kit::ServiceError;
use relay_nn::{ActorCritic, VecNormalize};
use relay_policy::PolicyWeights;

use crate::optimizer::Optimizer;

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

/// Writes a checkpoint of a PPO, A2C or REINFORCE learner linked as
/// `links`, prunes old ones and returns its folder. With `evaluated`, the
/// model and normalisation statistics are that published version's
/// ([`put_weights`]) instead of the current ones.
#[allow(clippy::too_many_arguments)]
pub fn save(
    run_dir: &Path,
    model: &ActorCritic,
    optimizer: &Optimizer,
    normalizer: Option<&VecNormalize>,
    state: &CheckpointState,
    config: &ExperimentConfig,
    links: &[&str],
    evaluated: Option<&PolicyWeights>,
) -> Result<PathBuf, CheckpointError> {
    write(
        run_dir,
        state.progress.updates,
        config,
        config.keep_checkpoints(),
        links,
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
            if let Some(update) = evaluated {
                put_weights(tmp, update, config)?;
            }
            write_json(&tmp.join("state.json"), state)
        },
    )
}

/// Puts a published version's weights into checkpoint folder `dir` being
/// written: each of the version's tensors replaces the tensor of the same
/// name in `model.safetensors` (same shape; the bytes as published), and the
/// normalisation statistics it carried replace `vec_normalize.safetensors`
/// (runs that normalise). Every other tensor of the file (a DQN's target,
/// a SAC's critics) stays as written.
pub fn put_weights(
    dir: &Path,
    update: &PolicyWeights,
    config: &ExperimentConfig,
) -> Result<(), CheckpointError> {
    let path = dir.join("model.safetensors");
    let tensors_err = |e: String| CheckpointError::Tensors(format!("{}: {e}", path.display()));
    let (mut tensors, meta) =
        relay_nn::io::read_safetensors(&path).map_err(|e| tensors_err(e.to_string()))?;
    for (name, shape, values) in &update.tensors {
        let Some(slot) = tensors.iter_mut().find(|t| &t.0 == name) else {
            return Err(tensors_err(format!(
                "version {} has tensor {name}, the model has none of that name",
                update.version
            )));
        };
        if &slot.1 != shape {
            return Err(tensors_err(format!(
                "{name}: version {} has shape {shape:?}, the model {:?}",
                update.version, slot.1
            )));
        }
        slot.2.clone_from(values);
    }
    relay_nn::io::write_safetensors(&path, &tensors, meta)
        .map_err(|e| tensors_err(e.to_string()))?;
    let obs_dim = update.normalizer.as_ref().map_or(0, |n| n.obs.mean.len());
    let frozen = relay_policy::frozen_normalizer(
        config,
        obs_dim,
        update.version,
        update.normalizer.as_ref(),
    )
    .map_err(|e| CheckpointError::Tensors(e.to_string()))?;
    if let Some(n) = frozen {
        n.save(dir.join(VEC_NORMALIZE_FILE))
            .map_err(|e| CheckpointError::Tensors(e.to_string()))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn preset(name: &str) -> ExperimentConfig {
        let path = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../configs")
            .join(name);
        let text = std::fs::read_to_string(&path).unwrap();
        ExperimentConfig::from_layers(&text, name, &[], &[]).unwrap()
    }

    #[test]
    fn a_published_actor_replaces_only_its_own_tensors_in_a_sac_checkpoint() {
        let dir = relay_testkit::TempDir::new("put-weights");
        let config = preset("pendulum-sac.yaml");
        let spec = relay_policy::sac_spec_for(&config).unwrap();
        let current = relay_nn::Sac::new(&spec, 1.0, 1).unwrap();
        let evaluated = relay_nn::Sac::new(&spec, 1.0, 2).unwrap();
        current.save(dir.path().join("model.safetensors")).unwrap();
        let update = PolicyWeights::from_tensors(evaluated.actor.named_tensors(), 7, 0);
        put_weights(dir.path(), &update, &config).unwrap();

        let (saved, _) =
            relay_nn::io::read_safetensors(&dir.path().join("model.safetensors")).unwrap();
        let by_name = |tensors: &[relay_nn::NamedTensor], name: &str| {
            tensors.iter().find(|t| t.0 == name).cloned().unwrap()
        };
        let actor = evaluated.actor.named_tensors();
        for t in &actor {
            assert_eq!(
                &by_name(&saved, &t.0),
                t,
                "{} is the evaluated actor's",
                t.0
            );
        }
        let all = current.named_tensors();
        assert_eq!(saved.len(), all.len());
        for t in all.iter().filter(|t| !t.0.starts_with("actor.")) {
            assert_eq!(&by_name(&saved, &t.0), t, "{} stays the current one", t.0);
        }

        // A tensor the model lacks, or of another shape, is refused by name.
        let mut stranger = update.clone();
        stranger.tensors[0].0 = "actor.nope".into();
        let err = put_weights(dir.path(), &stranger, &config)
            .unwrap_err()
            .to_string();
        assert!(err.contains("actor.nope"), "{err}");
        let mut misshapen = update.clone();
        misshapen.tensors[0].1 = vec![1];
        misshapen.tensors[0].2 = vec![0.0];
        let err = put_weights(dir.path(), &misshapen, &config)
            .unwrap_err()
            .to_string();
        assert!(err.contains("shape") && err.contains(&actor[0].0), "{err}");
    }
}
