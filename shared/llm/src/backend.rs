//! [`Backend`]: which code computes a [`crate::CausalLm`]'s inference forward, on
//! which device and in which dtype; [`BackendSpec`] is how a config names
//! one (`llm.backend`, `llm.device`, `llm.dtype`).
//!
//! * [`Backend::Engine`], the default: the tuned CPU engine of
//!   [`crate::infer`] (plain Rust between packed f32 matmuls).
//! * [`Backend::Candle`]: the device-generic forward of [`crate::generic`],
//!   built from candle tensor ops only, so it runs wherever candle does
//!   (the CPU, or an NVIDIA GPU in a build with the `cuda` feature) in f32,
//!   bf16 or f16.
//!
//! Moving a model to a backend ([`crate::CausalLm::to_backend`], in
//! [`crate::generic`]) copies its weights to the device in the dtype;
//! adapters follow with [`Backend::place_adapter`] (trained: f32 factors)
//! or [`Backend::place_frozen_adapter`] (served: factors in the dtype).

use candle_core::{DType, Device};
pub use relay_config::hyper::backend::{
    BackendKind, BackendSpec, DeviceSpec, LlmDtype, SpecError, CUDA_BUILT,
};

use crate::lora::{LoraAdapter, LoraWeights};
use crate::model_error::{ModelError, Result};

/// The candle dtype of a config's dtype.
pub fn candle_dtype(dtype: LlmDtype) -> DType {
    match dtype {
        LlmDtype::F32 => DType::F32,
        LlmDtype::Bf16 => DType::BF16,
        LlmDtype::F16 => DType::F16,
    }
}

/// Opens the device `llm.device` names ([`relay_nn::open_device`], the one
/// place any relay process opens a device: its own stream, the memory pool
/// kept).
pub fn open_device(spec: DeviceSpec) -> Result<Device> {
    relay_nn::open_device(spec).map_err(|e| ModelError::BadInput(format!("llm.device: {e}")))
}

/// Which code computes a model's inference forward (see the module docs).
#[derive(Debug, Clone, Default)]
pub enum Backend {
    #[default]
    Engine,
    Candle {
        device: Device,
        dtype: DType,
    },
}

impl Backend {
    /// The backend a spec names, with its device opened. A CUDA device that cannot be
    /// opened (no driver, no such GPU) is an error that says what was found.
    pub fn open(spec: &BackendSpec) -> Result<Backend> {
        spec.validate()
            .map_err(|e| ModelError::BadInput(e.to_string()))?;
        Ok(match spec.resolved_kind() {
            BackendKind::Auto | BackendKind::Engine => Backend::Engine,
            BackendKind::Candle => Backend::Candle {
                device: open_device(spec.device)?,
                dtype: candle_dtype(spec.dtype),
            },
        })
    }

    /// `adapter` placed where this backend computes: for
    /// [`Backend::Candle`] a copy on the device (its factors stay f32, the
    /// trainable master copy; products run in the backend's dtype), as it
    /// is for the engine. Done once per adapter version, not per forward;
    /// to train on the device, hand the placed adapter's vars to the
    /// optimizer.
    pub fn place_adapter(&self, adapter: &LoraAdapter) -> Result<LoraAdapter> {
        match self {
            Self::Engine => Ok(adapter.clone()),
            Self::Candle { device, .. } => adapter.map_weights(|w| {
                Ok(LoraWeights {
                    a: candle_core::Var::from_tensor(&w.a.to_device(device)?)?,
                    b: candle_core::Var::from_tensor(&w.b.to_device(device)?)?,
                })
            }),
        }
    }

    /// `adapter` placed to be served, not trained: its factors in the
    /// backend's dtype, cast once here rather than at every projection of
    /// every step (a served version never changes). The engine computes in
    /// f32 and takes it as it is.
    pub fn place_frozen_adapter(&self, adapter: &LoraAdapter) -> Result<LoraAdapter> {
        match self {
            Self::Engine => Ok(adapter.clone()),
            Self::Candle { device, dtype } => adapter.map_weights(|w| {
                let place = |t: &candle_core::Tensor| -> Result<candle_core::Var> {
                    Ok(candle_core::Var::from_tensor(
                        &t.to_device(device)?.to_dtype(*dtype)?,
                    )?)
                };
                Ok(LoraWeights {
                    a: place(w.a.as_tensor())?,
                    b: place(w.b.as_tensor())?,
                })
            }),
        }
    }

    /// A short description for logs: `engine (cpu, f32)`, `candle (cuda:0, bf16)`.
    pub fn describe(&self) -> String {
        match self {
            Self::Engine => "engine (cpu, f32)".into(),
            Self::Candle { device, dtype } => {
                let device = match device.location() {
                    candle_core::DeviceLocation::Cpu => "cpu".to_string(),
                    candle_core::DeviceLocation::Cuda { gpu_id } => format!("cuda:{gpu_id}"),
                    candle_core::DeviceLocation::Metal { gpu_id } => format!("metal:{gpu_id}"),
                };
                format!("candle ({device}, {})", dtype.as_str())
            }
        }
    }
}
