//! Normalisation statistics (`normalize:`) between the normaliser and the
//! wire: as they travel with fragments ([`delta_stats`], [`stats_delta`])
//! and weights versions ([`norm_stats`], [`stats_rms`]), the frozen
//! normaliser a version prescribes ([`frozen_normalizer`]), and a
//! checkpoint's statistics ([`load_normalizer`]).

use relay_config::ExperimentConfig;
use relay_nn::{NormDelta, RunningMeanStd, VecNormalize};
use relay_proto::{Moments, NormStats, Rejection};

fn moments(rms: &RunningMeanStd) -> Moments {
    Moments {
        count: rms.count,
        mean: rms.mean.clone(),
        var: rms.var.clone(),
    }
}

fn rms(m: &Moments) -> RunningMeanStd {
    RunningMeanStd {
        mean: m.mean.clone(),
        var: m.var.clone(),
        count: m.count,
    }
}

/// A normaliser's statistics as they travel with a weights version.
pub fn norm_stats(normalizer: &VecNormalize) -> NormStats {
    NormStats {
        obs: moments(&normalizer.obs_rms),
        ret: moments(&normalizer.ret_rms),
    }
}

/// An env-runner's delta as it travels with a fragment.
pub fn delta_stats(delta: &NormDelta) -> NormStats {
    NormStats {
        obs: moments(&delta.obs_rms),
        ret: moments(&delta.ret_rms),
    }
}

/// A fragment's delta (checked by the wire) as the learner merges it.
pub fn stats_delta(stats: &NormStats) -> NormDelta {
    NormDelta {
        obs_rms: rms(&stats.obs),
        ret_rms: rms(&stats.ret),
    }
}

/// The observation and return statistics of a weights message.
pub fn stats_rms(stats: &NormStats) -> (RunningMeanStd, RunningMeanStd) {
    (rms(&stats.obs), rms(&stats.ret))
}

/// The normaliser a weights version prescribes for a run, frozen (never
/// updated): `None` when the run's `normalize` section is off (statistics
/// a version may carry are then ignored). A normalising run's version
/// without statistics, or with statistics of another width, is rejected.
pub fn frozen_normalizer(
    config: &ExperimentConfig,
    obs_dim: usize,
    version: u64,
    stats: Option<&NormStats>,
) -> Result<Option<VecNormalize>, Rejection> {
    let Some(norm) = config.normalizer() else {
        return Ok(None);
    };
    let invalid = |detail: String| Rejection::Invalid {
        kind: "WeightsUpdate",
        field: "normalizer",
        detail,
    };
    let stats = stats.ok_or_else(|| {
        invalid(format!(
            "version {version} carries no normalisation statistics, but this run normalises (`normalize` section)"
        ))
    })?;
    let mut n = VecNormalize::new(norm, obs_dim, 0).map_err(|e| invalid(e.to_string()))?;
    let (obs, ret) = stats_rms(stats);
    n.sync(&obs, &ret).map_err(|e| invalid(e.to_string()))?;
    n.set_training(false);
    Ok(Some(n))
}

/// Restores `normalizer`'s statistics from checkpoint folder `dir`.
pub fn load_normalizer(
    dir: &std::path::Path,
    normalizer: &mut VecNormalize,
) -> Result<(), relay_runs::checkpoint::CheckpointError> {
    let path = dir.join(relay_runs::checkpoint::VEC_NORMALIZE_FILE);
    if !path.is_file() {
        return Err(relay_runs::checkpoint::CheckpointError::State {
            path,
            detail: "missing: the run normalises (`normalize` section) but this checkpoint holds no statistics".into(),
        });
    }
    normalizer
        .load(&path)
        .map_err(|e| relay_runs::checkpoint::CheckpointError::Tensors(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::weights::tests::weights;
    use crate::PolicyWeights;

    fn config(sets: &[&str]) -> ExperimentConfig {
        let overrides: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
        ExperimentConfig::from_layers("run:\n  env_id: CartPole-v1\n", "t", &[], &overrides)
            .unwrap()
    }

    /// [`frozen_normalizer`] of a version.
    fn frozen(
        config: &ExperimentConfig,
        obs_dim: usize,
        w: &PolicyWeights,
    ) -> Result<Option<VecNormalize>, Rejection> {
        frozen_normalizer(config, obs_dim, w.version, w.normalizer.as_ref())
    }

    #[test]
    fn a_version_prescribes_its_statistics_frozen_or_is_rejected_without_them() {
        let mut source = VecNormalize::new(relay_nn::NormalizeConfig::default(), 4, 2).unwrap();
        let mut obs = [0.5f32, 1.0, -0.5, 2.0, 0.1, 0.2, 0.3, 0.4];
        source.reset(&mut obs).unwrap();
        let stats = norm_stats(&source);

        // Off: no normaliser, whatever the version carries.
        let off = config(&[]);
        assert!(frozen(&off, 4, &weights(Some(stats.clone())))
            .unwrap()
            .is_none());

        let on = config(&["normalize.obs=true"]);
        let n = frozen(&on, 4, &weights(Some(stats.clone())))
            .unwrap()
            .unwrap();
        assert!(!n.training());
        assert_eq!((n.obs_rms.clone(), n.ret_rms.clone()), stats_rms(&stats));
        let err = frozen(&on, 4, &weights(None)).unwrap_err();
        assert!(
            err.to_string().contains("WeightsUpdate.normalizer")
                && err.to_string().contains("version 7"),
            "{err}"
        );
        let err = frozen(&on, 3, &weights(Some(stats))).unwrap_err();
        assert!(err.to_string().contains("normalizer"), "{err}");

        // Deltas survive the trip through the wire form.
        let mut delta = NormDelta::empty(4);
        delta.obs_rms.update(&obs).unwrap();
        assert_eq!(stats_delta(&delta_stats(&delta)), delta);
    }
}
