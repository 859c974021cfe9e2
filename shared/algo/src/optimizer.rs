//! The optimizer of a classic-control run and the gradient step every
//! algorithm ends with: Adam (PPO, REINFORCE, A2C with `use_rms_prop:
//! false`) or RMSprop (A2C), saved to and restored from a checkpoint's
//! `optimizer.safetensors` (each file names its format, so loading an Adam
//! state into RMSprop is an error, not garbage).

use std::path::Path;

use candle_core::{backprop::GradStore, Tensor, Var};
use relay_config::{Algo, ExperimentConfig};
use relay_nn::{clip_grad_norm, Adam, AdamConfig, NnError, RmsProp, RmsPropConfig};

use crate::rollout::UpdateError;
use relay_nn::BatchShare;

/// Adam or RMSprop over the model's vars.
#[derive(Debug)]
pub enum Optimizer {
    Adam(Adam),
    RmsProp(RmsProp),
}

/// An [`Optimizer`]'s resumable state, held in memory (a replica's
/// rollback point and what it hands to a new view's members).
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub enum OptimizerState {
    Adam(relay_nn::AdamState),
    RmsProp(relay_nn::RmsPropState),
}

impl Optimizer {
    /// The optimizer `run.algo` calls for, at its initial learning rate.
    pub fn for_run(cfg: &ExperimentConfig, vars: Vec<Var>) -> Result<Self, NnError> {
        let adam = |lr: f64, eps: f64| -> Result<Self, NnError> {
            Ok(Self::Adam(Adam::new(
                vars.clone(),
                AdamConfig {
                    lr,
                    eps,
                    ..AdamConfig::default()
                },
            )?))
        };
        match cfg.run.algo {
            Algo::A2c if cfg.a2c.use_rms_prop => Ok(Self::RmsProp(RmsProp::new(
                vars,
                RmsPropConfig {
                    lr: cfg.a2c.learning_rate.value(0.0),
                    alpha: cfg.a2c.rms_prop_alpha,
                    eps: cfg.a2c.rms_prop_eps,
                    ..RmsPropConfig::default()
                },
            )?)),
            Algo::A2c => adam(cfg.a2c.learning_rate.value(0.0), cfg.a2c.adam_eps),
            Algo::Reinforce => adam(
                cfg.reinforce.learning_rate.value(0.0),
                cfg.reinforce.adam_eps,
            ),
            Algo::Ppo | Algo::Dqn | Algo::Sac => adam(
                cfg.ppo.learning_rate_schedule().value(0.0),
                cfg.ppo.adam_eps,
            ),
        }
    }

    /// Sets the learning rate for the next steps (schedules).
    pub fn set_lr(&mut self, lr: f64) {
        match self {
            Self::Adam(o) => o.set_lr(lr),
            Self::RmsProp(o) => o.set_lr(lr),
        }
    }

    /// The vars being optimised.
    pub fn vars(&self) -> &[Var] {
        match self {
            Self::Adam(o) => o.vars(),
            Self::RmsProp(o) => o.vars(),
        }
    }

    /// Steps taken so far.
    pub fn step_count(&self) -> u64 {
        match self {
            Self::Adam(o) => o.step_count(),
            Self::RmsProp(o) => o.step_count(),
        }
    }

    /// One step with `grads`.
    pub fn step(&mut self, grads: &GradStore) -> Result<(), NnError> {
        match self {
            Self::Adam(o) => o.step(grads),
            Self::RmsProp(o) => o.step(grads),
        }
    }

    /// Backpropagates `loss`, clips the global gradient norm to `max_norm`
    /// (none: no clipping) and steps; returns the norm before clipping. A
    /// non-finite norm skips the step, so one bad batch cannot turn every
    /// weight into NaN.
    pub fn minimise(&mut self, loss: &Tensor, max_norm: Option<f64>) -> Result<f64, NnError> {
        let mut grads = loss.backward()?;
        let norm = clip_grad_norm(
            &mut grads,
            self.vars(),
            max_norm.map_or(f32::INFINITY, |m| m as f32),
        )?;
        if norm.is_finite() {
            self.step(&grads)?;
        } else {
            tracing::warn!(norm, "non-finite gradient norm; step skipped");
        }
        Ok(norm as f64)
    }

    /// [`Self::minimise`] for one replica's share of a minibatch
    /// (`relay_replicas`): backpropagates `loss` (`None`: an empty share,
    /// zero gradients), sums the gradients and `extra` (statistics the
    /// caller weighted as the loss) across the replicas with `sync`, then
    /// clips and steps, the same on every replica. Alone, it is exactly
    /// [`Self::minimise`] and `extra` stays as it is.
    pub fn minimise_shared(
        &mut self,
        loss: Option<&Tensor>,
        max_norm: Option<f64>,
        sync: &mut BatchShare<'_>,
        extra: &mut [f32],
    ) -> Result<f64, UpdateError> {
        if sync.replicas == 1 {
            let loss = loss.expect("a lone learner's share is the whole minibatch");
            return Ok(self.minimise(loss, max_norm)?);
        }
        let vars = self.vars().to_vec();
        let mut grads =
            sync.sum_gradients(loss.map(Tensor::backward).transpose()?, &vars, extra)?;
        let norm = clip_grad_norm(
            &mut grads,
            &vars,
            max_norm.map_or(f32::INFINITY, |m| m as f32),
        )?;
        if norm.is_finite() {
            self.step(&grads)?;
        } else {
            tracing::warn!(
                norm,
                "non-finite gradient norm; step skipped on every replica"
            );
        }
        Ok(norm as f64)
    }

    fn name(&self) -> &'static str {
        match self {
            Self::Adam(_) => "Adam",
            Self::RmsProp(_) => "RMSprop",
        }
    }

    /// A copy of the resumable state.
    pub fn state(&self) -> Result<OptimizerState, NnError> {
        Ok(match self {
            Self::Adam(o) => OptimizerState::Adam(o.state()?),
            Self::RmsProp(o) => OptimizerState::RmsProp(o.state()?),
        })
    }

    /// Restores a state [`Self::state`] took from an optimizer of the same
    /// kind over vars of the same shapes (all-or-nothing).
    pub fn set_state(&mut self, state: OptimizerState) -> Result<(), NnError> {
        match (self, state) {
            (Self::Adam(o), OptimizerState::Adam(s)) => o.set_state(s),
            (Self::RmsProp(o), OptimizerState::RmsProp(s)) => o.set_state(s),
            (o, _) => Err(NnError::BadInput {
                what: "optimizer state",
                expected: format!("{} state", o.name()),
                got: "another optimizer's state".into(),
            }),
        }
    }

    /// Writes the state to a safetensors file.
    pub fn save(&self, path: impl AsRef<Path>) -> Result<(), NnError> {
        match self {
            Self::Adam(o) => o.save(path),
            Self::RmsProp(o) => o.save(path),
        }
    }

    /// Restores the state written by [`Self::save`] (all-or-nothing).
    pub fn load(&mut self, path: impl AsRef<Path>) -> Result<(), NnError> {
        match self {
            Self::Adam(o) => o.load(path),
            Self::RmsProp(o) => o.load(path),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use relay_nn::{ActorCritic, PolicySpec};

    fn config(algo: &str, sets: &[&str]) -> ExperimentConfig {
        let mut all = vec![
            format!("run.algo={algo}"),
            "env_runner.fragment_steps=5".into(),
        ];
        all.extend(sets.iter().map(|s| s.to_string()));
        ExperimentConfig::from_layers("run:\n  env_id: CartPole-v1\n", "t", &[], &all).unwrap()
    }

    #[test]
    fn each_algorithm_gets_its_optimizer() {
        let model = ActorCritic::new(&PolicySpec::discrete(4, 2), 1).unwrap();
        let kind = |cfg: &ExperimentConfig| match Optimizer::for_run(cfg, model.vars()).unwrap() {
            Optimizer::Adam(a) => ("adam", a.lr(), a.config().eps),
            Optimizer::RmsProp(r) => ("rmsprop", r.lr(), r.config().eps),
        };
        assert_eq!(kind(&config("a2c", &[])), ("rmsprop", 7e-4, 1e-5));
        assert_eq!(
            kind(&config("a2c", &["a2c.use_rms_prop=false"])),
            ("adam", 7e-4, 1e-5)
        );
        assert_eq!(kind(&config("reinforce", &[])), ("adam", 1e-3, 1e-8));
        assert_eq!(
            kind(&config(
                "ppo",
                &["ppo.learning_rate=0.001", "ppo.lr_schedule=linear"]
            )),
            ("adam", 1e-3, 1e-5)
        );
    }

    /// A checkpoint's optimizer state comes back exactly, and an Adam state
    /// is refused by RMSprop rather than misread.
    #[test]
    fn state_survives_a_checkpoint_and_formats_do_not_mix() {
        let dir = std::env::temp_dir().join(format!("relay-opt-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let model = ActorCritic::new(&PolicySpec::discrete(4, 2), 1).unwrap();
        let a2c = config("a2c", &[]);
        let mut optimizer = Optimizer::for_run(&a2c, model.vars()).unwrap();
        let obs = Tensor::from_vec(
            vec![0.1f32, -0.2, 0.3, 0.05],
            (1, 4),
            &candle_core::Device::Cpu,
        )
        .unwrap();
        let actions = Tensor::new(&[1u32], &candle_core::Device::Cpu).unwrap();
        for _ in 0..3 {
            let (lp, _, v) = model.evaluate(&obs, &actions).unwrap();
            let loss = (lp.sum_all().unwrap() + v.sum_all().unwrap()).unwrap();
            let norm = optimizer.minimise(&loss, Some(0.5)).unwrap();
            assert!(norm > 0.0);
        }
        let path = dir.join("optimizer.safetensors");
        optimizer.save(&path).unwrap();
        let fresh_model = ActorCritic::new(&PolicySpec::discrete(4, 2), 2).unwrap();
        let mut restored = Optimizer::for_run(&a2c, fresh_model.vars()).unwrap();
        restored.load(&path).unwrap();
        match (&optimizer, &restored) {
            (Optimizer::RmsProp(a), Optimizer::RmsProp(b)) => {
                assert_eq!(a.state().unwrap(), b.state().unwrap())
            }
            _ => unreachable!("A2C uses RMSprop"),
        }
        assert_eq!(restored.step_count(), 3);
        let mut adam = Optimizer::for_run(&config("ppo", &[]), fresh_model.vars()).unwrap();
        let err = adam.load(&path).unwrap_err().to_string();
        assert!(err.contains("rmsprop"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
