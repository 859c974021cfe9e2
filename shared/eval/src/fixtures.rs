//! Test fixtures shared by the plugins' and the players' tests: untrained
//! policies and a CartPole evaluation context.

use relay_bridge::{Cancel, EnvSection};
use relay_nn::{ActorCritic, PolicySpec};
use relay_policy::VersionedPolicy;

use crate::plugins::EvalContext;

/// Version 3 of an untrained CartPole policy.
pub(crate) fn policy() -> VersionedPolicy {
    untrained(3, 4, 2)
}

/// Version `version` of an untrained policy of `obs_dim` observation
/// values and `actions` discrete actions.
pub(crate) fn untrained(version: u64, obs_dim: usize, actions: usize) -> VersionedPolicy {
    VersionedPolicy {
        version,
        learner_env_steps: 0,
        model: relay_policy::PolicyModel::ActorCritic(
            ActorCritic::new(&PolicySpec::discrete(obs_dim, actions), 1).unwrap(),
        ),
        normalizer: None,
    }
}

/// A CartPole context: 2 episodes from seed 5, writing under `dir`.
pub(crate) fn ctx(dir: &std::path::Path) -> EvalContext {
    EvalContext {
        env_id: "CartPole-v1".into(),
        episodes: 2,
        seed: 5,
        run_dir: dir.to_path_buf(),
        train_return: None,
        confirming: false,
        env: EnvSection::default(),
        cancel: Cancel::default(),
    }
}
