//! LoRA adapters: low-rank updates `W x + scaling * B (A x)` on any of the
//! seven projections of every block, kept apart from the base model.
//!
//! An adapter is its own object ([`LoraAdapter`]) holding trainable
//! `A`/`B` as candle [`Var`]s; the base model's weights are plain tensors
//! and never receive gradients. A forward takes the adapter to apply (or
//! none) as an argument, so one loaded base serves any number of adapters,
//! even several in one batch. Files use PEFT's format ([`crate::peft`]).

use std::collections::HashMap;

use candle_core::{DType, Device, Tensor, Var};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::config::ModelConfig;
use crate::model_error::{ModelError, Result};

pub use relay_config::hyper::lora::{LoraConfig, LoraTarget};

/// `(in_features, out_features)` of this projection in a model.
pub fn target_dims(target: LoraTarget, config: &ModelConfig) -> (usize, usize) {
    let hidden = config.hidden_size;
    let q = config.num_attention_heads * config.head_dim;
    let kv = config.num_key_value_heads * config.head_dim;
    let inter = config.intermediate_size;
    match target {
        LoraTarget::QProj => (hidden, q),
        LoraTarget::KProj | LoraTarget::VProj => (hidden, kv),
        LoraTarget::OProj => (q, hidden),
        LoraTarget::GateProj | LoraTarget::UpProj => (hidden, inter),
        LoraTarget::DownProj => (inter, hidden),
    }
}

/// The two factors of one adapted projection.
#[derive(Debug, Clone)]
pub struct LoraWeights {
    /// `lora_A`, shape `(rank, in_features)`.
    pub a: Var,
    /// `lora_B`, shape `(out_features, rank)`.
    pub b: Var,
}

/// One LoRA adapter for every block of one model shape.
#[derive(Debug, Clone)]
pub struct LoraAdapter {
    config: LoraConfig,
    scaling: f64,
    /// Per layer, per [`LoraTarget::index`].
    layers: Vec<[Option<LoraWeights>; 7]>,
}

/// PEFT's tensor name for one factor (`"A"` or `"B"`) of one projection.
pub fn peft_tensor_name(layer: usize, target: LoraTarget, factor: char) -> String {
    format!(
        "base_model.model.model.layers.{layer}.{}.{}.lora_{factor}.weight",
        target.parent(),
        target.module_name()
    )
}

impl LoraAdapter {
    /// A fresh adapter initialised as PEFT does: `A` Kaiming-uniform
    /// (bound `1/sqrt(in_features)`), `B` zero, so the adapted model starts
    /// equal to the base. (With `B = 0` only `B` gets a gradient on the
    /// first step; `A` follows once `B` moves.)
    pub fn new(model: &ModelConfig, config: LoraConfig, seed: u64) -> Result<Self> {
        config.validate()?;
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let mut layers = Vec::with_capacity(model.num_hidden_layers);
        for _ in 0..model.num_hidden_layers {
            let mut sites: [Option<LoraWeights>; 7] = Default::default();
            for target in LoraTarget::ALL {
                if !config.targets.contains(&target) {
                    continue;
                }
                let (fan_in, fan_out) = crate::lora::target_dims(target, model);
                let bound = 1.0 / (fan_in as f32).sqrt();
                let a: Vec<f32> = (0..config.rank * fan_in)
                    .map(|_| rng.random_range(-bound..bound))
                    .collect();
                let a = Tensor::from_vec(a, (config.rank, fan_in), &Device::Cpu)?;
                let b = Tensor::zeros((fan_out, config.rank), DType::F32, &Device::Cpu)?;
                sites[target as usize] = Some(LoraWeights {
                    a: Var::from_tensor(&a)?,
                    b: Var::from_tensor(&b)?,
                });
            }
            layers.push(sites);
        }
        Ok(Self {
            scaling: config.scaling(),
            config,
            layers,
        })
    }

    /// Builds an adapter from tensors named as PEFT names them
    /// ([`peft_tensor_name`]); every target of every layer must be present
    /// with the shape the model implies, and nothing else.
    pub fn from_named_tensors(
        model: &ModelConfig,
        config: LoraConfig,
        mut tensors: HashMap<String, Tensor>,
    ) -> Result<Self> {
        config.validate()?;
        let mut layers = Vec::with_capacity(model.num_hidden_layers);
        for layer in 0..model.num_hidden_layers {
            let mut sites: [Option<LoraWeights>; 7] = Default::default();
            for target in LoraTarget::ALL {
                if !config.targets.contains(&target) {
                    continue;
                }
                let (fan_in, fan_out) = crate::lora::target_dims(target, model);
                let mut take = |factor: char, shape: (usize, usize)| -> Result<Var> {
                    let name = peft_tensor_name(layer, target, factor);
                    let t = tensors
                        .remove(&name)
                        .ok_or_else(|| ModelError::config(&name, "missing from the adapter"))?;
                    if t.dims() != [shape.0, shape.1] {
                        return Err(ModelError::config(
                            &name,
                            format!("expected shape {shape:?}, got {:?}", t.dims()),
                        ));
                    }
                    Ok(Var::from_tensor(&t.to_dtype(DType::F32)?)?)
                };
                let a = take('A', (config.rank, fan_in))?;
                let b = take('B', (fan_out, config.rank))?;
                sites[target as usize] = Some(LoraWeights { a, b });
            }
            layers.push(sites);
        }
        if let Some(name) = tensors.keys().min() {
            return Err(ModelError::config(
                name,
                format!(
                    "unexpected tensor in the adapter ({} unexpected in all)",
                    tensors.len()
                ),
            ));
        }
        Ok(Self {
            scaling: config.scaling(),
            config,
            layers,
        })
    }

    /// The adapter's hyperparameters.
    pub fn config(&self) -> &LoraConfig {
        &self.config
    }

    /// The factor applied to `B (A x)`.
    pub fn scaling(&self) -> f64 {
        self.scaling
    }

    /// Number of layers the adapter covers.
    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }

    /// The factors of one projection, if it is adapted.
    pub fn weights(&self, layer: usize, target: LoraTarget) -> Option<&LoraWeights> {
        self.layers.get(layer)?[target as usize].as_ref()
    }

    /// The factors' current values (PEFT name, shape, f32 data) in
    /// [`Self::named_vars`]' order: what replicas compare and checkpoints
    /// hold.
    pub fn named_values(&self) -> Result<Vec<relay_nn::NamedTensor>> {
        Ok(crate::vars::var_values(&self.named_vars())?)
    }

    /// Every trainable factor with its PEFT name, layer by layer, `A`
    /// before `B`: hand the vars to an optimizer.
    pub fn named_vars(&self) -> Vec<(String, Var)> {
        let mut out = Vec::new();
        for (layer, sites) in self.layers.iter().enumerate() {
            for target in LoraTarget::ALL {
                if let Some(w) = &sites[target as usize] {
                    out.push((peft_tensor_name(layer, target, 'A'), w.a.clone()));
                    out.push((peft_tensor_name(layer, target, 'B'), w.b.clone()));
                }
            }
        }
        out
    }

    /// Every trainable factor (see [`LoraAdapter::named_vars`]).
    pub fn vars(&self) -> Vec<Var> {
        self.named_vars().into_iter().map(|(_, v)| v).collect()
    }

    /// A deep copy whose vars are independent of this adapter's (e.g. a
    /// frozen snapshot to serve while training continues).
    pub fn deep_copy(&self) -> Result<Self> {
        self.map_weights(|w| {
            Ok(LoraWeights {
                a: Var::from_tensor(&w.a.as_tensor().copy()?)?,
                b: Var::from_tensor(&w.b.as_tensor().copy()?)?,
            })
        })
    }

    /// The same adapter with every pair of factors replaced by `f`'s.
    pub(crate) fn map_weights(
        &self,
        f: impl Fn(&LoraWeights) -> Result<LoraWeights>,
    ) -> Result<Self> {
        let layers = self
            .layers
            .iter()
            .map(|sites| {
                let mut copy: [Option<LoraWeights>; 7] = Default::default();
                for (slot, w) in copy.iter_mut().zip(sites) {
                    if let Some(w) = w {
                        *slot = Some(f(w)?);
                    }
                }
                Ok(copy)
            })
            .collect::<Result<_>>()?;
        Ok(Self {
            config: self.config.clone(),
            scaling: self.scaling,
            layers,
        })
    }

    /// Checks that the adapter fits a model of this shape.
    pub fn check_fits(&self, model: &ModelConfig) -> Result<()> {
        if self.layers.len() != model.num_hidden_layers {
            return Err(ModelError::BadInput(format!(
                "adapter has {} layers, model has {}",
                self.layers.len(),
                model.num_hidden_layers
            )));
        }
        for sites in &self.layers {
            for target in LoraTarget::ALL {
                if let Some(w) = &sites[target as usize] {
                    let (fan_in, fan_out) = crate::lora::target_dims(target, model);
                    if w.a.dims() != [self.config.rank, fan_in]
                        || w.b.dims() != [fan_out, self.config.rank]
                    {
                        return Err(ModelError::BadInput(format!(
                            "adapter {} has A {:?} and B {:?}; the model needs ({}, {fan_in}) and ({fan_out}, {})",
                            target.module_name(),
                            w.a.dims(),
                            w.b.dims(),
                            self.config.rank,
                            self.config.rank
                        )));
                    }
                }
            }
        }
        Ok(())
    }

    /// `scaling * B (A x)` for `x` of shape `(rows, in_features)`, or `None`
    /// when this projection is not adapted.
    pub(crate) fn delta(
        &self,
        layer: usize,
        target: LoraTarget,
        x: &Tensor,
    ) -> Result<Option<Tensor>> {
        let Some(w) = self.weights(layer, target) else {
            return Ok(None);
        };
        // Products in the input's dtype. A trained adapter's factors are f32
        // and cast here; a served one is already in that dtype
        // (`Backend::place_frozen_adapter`), and the cast is then free.
        let (a, b) = (
            w.a.as_tensor().to_dtype(x.dtype())?,
            w.b.as_tensor().to_dtype(x.dtype())?,
        );
        let low = x.matmul(&a.t()?)?;
        let up = low.matmul(&b.t()?)?;
        Ok(Some(up.affine(self.scaling, 0.0)?))
    }
}
