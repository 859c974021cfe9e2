//! A weights version's parameters as services hold them
//! ([`PolicyWeights`]): made from a model, turned into the safetensors
//! bytes of a [`WeightsUpdate`] and back (checked), fetched wherever the
//! message says they are, and loaded into a model ([`load_weights`]).

use std::time::Duration;

use relay_kit::Service;
use relay_nn::ActorCritic;
use relay_proto::{NormStats, Rejection, WeightsUpdate, SCHEMA_VERSION};

/// A weights version's parameters and what comes with them, as the
/// learner keeps them and followers build models from them.
#[derive(Debug, Clone, PartialEq)]
pub struct PolicyWeights {
    pub version: u64,
    /// Env steps the learner had consumed when it made this version.
    pub learner_env_steps: u64,
    /// Every parameter of the model (any model's: actor-critic, Q-network,
    /// SAC actor), by name.
    pub tensors: Vec<relay_nn::NamedTensor>,
    /// The run's normalisation statistics as of this version (runs with a
    /// `normalize` section on).
    pub normalizer: Option<NormStats>,
}

/// Why a version's parameters cannot be had: not fetched, or not what a
/// policy's parameters must be.
#[derive(Debug, thiserror::Error)]
pub enum WeightsError {
    #[error("weights version {version}: {source}")]
    Fetch {
        version: u64,
        source: relay_kit::weights::TransportError,
    },
    #[error(transparent)]
    Rejected(#[from] Rejection),
}

impl PolicyWeights {
    /// Every parameter of `model` at `version` (without normalisation
    /// statistics: set `normalizer` for runs that normalise).
    pub fn of(model: &ActorCritic, version: u64, learner_env_steps: u64) -> Self {
        Self::from_tensors(model.named_tensors(), version, learner_env_steps)
    }

    /// Named tensors (any model's) at `version`.
    pub fn from_tensors(
        tensors: Vec<relay_nn::NamedTensor>,
        version: u64,
        learner_env_steps: u64,
    ) -> Self {
        Self {
            version,
            learner_env_steps,
            tensors,
            normalizer: None,
        }
    }

    /// The parameters as the bytes of a safetensors file (what travels).
    pub fn to_safetensors(&self) -> Vec<u8> {
        relay_nn::to_safetensors(&self.tensors, Default::default())
            .expect("a model's parameters fill their shapes")
    }

    /// The version a message describes, with its parameters read from
    /// `bytes` (the message's blob, fetched): rejected when they are not
    /// a safetensors file of finite f32 tensors.
    pub fn from_update(update: &WeightsUpdate, bytes: &[u8]) -> Result<Self, Rejection> {
        let invalid = |detail: String| Rejection::Invalid {
            kind: "WeightsUpdate",
            field: "weights",
            detail,
        };
        let (tensors, _) = relay_nn::from_safetensors(bytes).map_err(|e| invalid(e.to_string()))?;
        for (name, _, values) in &tensors {
            if let Some(index) = values.iter().position(|v| !v.is_finite()) {
                return Err(Rejection::Tensor {
                    kind: "WeightsUpdate",
                    field: format!("weights[{name}]").into(),
                    source: relay_proto::TensorError::NonFinite { index },
                });
            }
        }
        Ok(Self {
            version: update.version,
            learner_env_steps: update.learner_env_steps,
            tensors,
            normalizer: update.normalizer.clone(),
        })
    }

    /// The message of this version with its parameters inline, however
    /// large (tests; a publisher sends larger ones through
    /// `relay_kit::weights`).
    pub fn inline_update(&self) -> WeightsUpdate {
        self.update(relay_proto::WeightsBlob::inline(self.to_safetensors()))
    }

    /// The message of this version, its parameters where `weights` says.
    pub fn update(&self, weights: relay_proto::WeightsBlob) -> WeightsUpdate {
        WeightsUpdate {
            schema: SCHEMA_VERSION,
            version: self.version,
            learner_env_steps: self.learner_env_steps,
            weights,
            normalizer: self.normalizer.clone(),
            published_unix_ms: 0,
        }
    }

    /// The version a message describes, its parameters fetched (inline,
    /// from the publisher, or from the object store) and checked.
    pub async fn fetch(service: &Service, update: &WeightsUpdate) -> Result<Self, WeightsError> {
        let timeout = Duration::from_millis(service.config.weights.fetch_timeout_ms);
        let bytes = relay_kit::weights::fetch(&service.nats, &update.weights, timeout)
            .await
            .map_err(|source| WeightsError::Fetch {
                version: update.version,
                source,
            })?;
        Ok(Self::from_update(update, &bytes)?)
    }
}

/// Loads `weights` into `model`; on any mismatch the model is unchanged.
pub fn load_weights(model: &mut ActorCritic, weights: &PolicyWeights) -> Result<(), Rejection> {
    model
        .load_named_tensors(&weights.tensors)
        .map_err(|e| Rejection::Invalid {
            kind: "WeightsUpdate",
            field: "weights",
            detail: e.to_string(),
        })
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use relay_nn::PolicySpec;

    /// Version 7 of an untrained CartPole policy (100 env steps), with
    /// `normalizer`'s statistics.
    pub(crate) fn weights(normalizer: Option<NormStats>) -> PolicyWeights {
        let model = ActorCritic::new(&PolicySpec::discrete(4, 2), 1).unwrap();
        let mut w = PolicyWeights::of(&model, 7, 100);
        w.normalizer = normalizer;
        w
    }

    #[test]
    fn a_version_travels_as_safetensors_and_refuses_what_is_not_finite() {
        let w = weights(None);
        let update = w.inline_update();
        let bytes = update.weights.inline.clone().unwrap();
        assert_eq!(PolicyWeights::from_update(&update, &bytes).unwrap(), w);
        let mut bad = w.clone();
        bad.tensors[0].2[1] = f32::NAN;
        let err = PolicyWeights::from_update(&update, &bad.to_safetensors()).unwrap_err();
        assert_eq!(err.reason(), "non_finite", "{err}");
        let err = PolicyWeights::from_update(&update, b"not safetensors").unwrap_err();
        assert!(err.to_string().contains("WeightsUpdate.weights"), "{err}");
    }
}
