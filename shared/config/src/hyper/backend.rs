//! How a config names the language model's backend (`llm.backend`,
//! `llm.device`, `llm.dtype`): [`BackendSpec`] and its parts, with the
//! checks that need no GPU. relay-llm opens the backend from it.

use serde::{Deserialize, Serialize};

/// Whether this build has the `cuda` feature (CUDA devices can be opened).
pub const CUDA_BUILT: bool = cfg!(feature = "cuda");

/// Which forward a model runs, as a config names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BackendKind {
    /// The engine for f32 on the CPU, the candle backend for anything else
    /// (so `llm.device: cuda` alone is enough).
    #[default]
    Auto,
    /// The tuned CPU engine (f32 on the CPU only).
    Engine,
    /// candle tensor ops on `device` in `dtype`.
    Candle,
}

/// The dtype of the candle backend's weights and activations.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LlmDtype {
    #[default]
    F32,
    Bf16,
    F16,
}

impl std::str::FromStr for BackendKind {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s.trim() {
            "auto" => Ok(Self::Auto),
            "engine" => Ok(Self::Engine),
            "candle" => Ok(Self::Candle),
            other => Err(format!(
                "{other:?} is not a backend: give `auto`, `engine` or `candle`"
            )),
        }
    }
}

impl std::str::FromStr for LlmDtype {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s.trim() {
            "f32" => Ok(Self::F32),
            "bf16" => Ok(Self::Bf16),
            "f16" => Ok(Self::F16),
            other => Err(format!(
                "{other:?} is not a dtype: give `f32`, `bf16` or `f16`"
            )),
        }
    }
}

/// Where the candle backend computes: `cpu`, `cuda` (device 0) or `cuda:N`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DeviceSpec {
    #[default]
    Cpu,
    Cuda(usize),
}

impl std::str::FromStr for DeviceSpec {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s.trim() {
            "cpu" => Ok(Self::Cpu),
            "cuda" => Ok(Self::Cuda(0)),
            other => other
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .map(Self::Cuda)
                .ok_or_else(|| {
                    format!("{other:?} is not a device: give `cpu`, `cuda` or `cuda:N`")
                }),
        }
    }
}

impl std::fmt::Display for DeviceSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Cpu => write!(f, "cpu"),
            Self::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

impl Serialize for DeviceSpec {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for DeviceSpec {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        String::deserialize(d)?
            .parse()
            .map_err(serde::de::Error::custom)
    }
}

/// A [`BackendSpec`] that cannot work: the config field and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {detail}")]
pub struct SpecError {
    pub field: &'static str,
    pub detail: String,
}

/// What a config asks for: `llm.backend`, `llm.device`, `llm.dtype`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct BackendSpec {
    pub kind: BackendKind,
    pub device: DeviceSpec,
    pub dtype: LlmDtype,
}

impl BackendSpec {
    /// The backend `auto` stands for: the engine for f32 on the CPU, the
    /// candle backend otherwise.
    pub fn resolved_kind(&self) -> BackendKind {
        match self.kind {
            BackendKind::Auto if self.device == DeviceSpec::Cpu && self.dtype == LlmDtype::F32 => {
                BackendKind::Engine
            }
            BackendKind::Auto => BackendKind::Candle,
            explicit => explicit,
        }
    }

    /// Checks what can be checked without touching a GPU: the engine runs
    /// only f32 on the CPU, and CUDA needs a build with the `cuda` feature.
    /// Errors name the config field.
    pub fn validate(&self) -> std::result::Result<(), SpecError> {
        let error = |field, detail: String| Err(SpecError { field, detail });
        if self.kind == BackendKind::Engine {
            if self.device != DeviceSpec::Cpu {
                return error(
                    "llm.device",
                    format!(
                        "{} needs `llm.backend: candle` (the tuned engine runs on the CPU only)",
                        self.device
                    ),
                );
            }
            if self.dtype != LlmDtype::F32 {
                return error(
                    "llm.dtype",
                    "the tuned engine computes in f32; bf16 and f16 need `llm.backend: candle`"
                        .into(),
                );
            }
        }
        if matches!(self.device, DeviceSpec::Cuda(_)) && !CUDA_BUILT {
            return error(
                "llm.device",
                format!(
                    "{} needs a build with the `cuda` feature \
                     (`cargo build --release --features cuda`, or `just build-cuda`); this one has none",
                    self.device
                ),
            );
        }
        Ok(())
    }
}
