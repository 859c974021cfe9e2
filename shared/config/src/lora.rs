//! The `lora` section: the LoRA adapter a text run trains.

use serde::{Deserialize, Serialize};

use crate::check::{invalid, positive, ConfigError};

/// The LoRA adapter the learner trains in text runs (PEFT's `LoraConfig`
/// fields); ignored for classic-control envs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LoraSection {
    /// Rank `r` of the update.
    pub rank: usize,
    /// `lora_alpha`: the update is scaled by `alpha / rank` (or
    /// `alpha / sqrt(rank)` with `use_rslora`).
    pub alpha: f64,
    /// `lora_dropout`, saved in the adapter config (training here applies
    /// none), in `[0, 1)`.
    pub dropout: f64,
    /// Projections adapted in every layer: any of `q_proj`, `k_proj`,
    /// `v_proj`, `o_proj`, `gate_proj`, `up_proj`, `down_proj`.
    pub target_modules: Vec<String>,
    /// Rank-stabilised scaling `alpha / sqrt(rank)`.
    pub use_rslora: bool,
    /// Seed of the initial `A` factors (`B` starts at zero, so version 0
    /// plays exactly as the base model).
    pub seed: u64,
}

impl Default for LoraSection {
    fn default() -> Self {
        Self {
            rank: 8,
            alpha: 16.0,
            dropout: 0.0,
            target_modules: crate::hyper::lora::LoraTarget::ALL
                .iter()
                .map(|t| t.module_name().to_string())
                .collect(),
            use_rslora: false,
            seed: 0,
        }
    }
}

impl LoraSection {
    /// The adapter's hyperparameters.
    pub fn lora_config(&self) -> Result<crate::hyper::lora::LoraConfig, ConfigError> {
        let mut targets = Vec::with_capacity(self.target_modules.len());
        for name in &self.target_modules {
            let target =
                crate::hyper::lora::LoraTarget::from_module_name(name).ok_or_else(|| {
                    invalid(
                        "lora.target_modules",
                        format!(
                            "unknown module {name:?}; known: {}",
                            crate::hyper::lora::LoraTarget::ALL
                                .map(|t| t.module_name())
                                .join(", ")
                        ),
                    )
                })?;
            if !targets.contains(&target) {
                targets.push(target);
            }
        }
        let config = crate::hyper::lora::LoraConfig {
            rank: self.rank,
            alpha: self.alpha,
            dropout: self.dropout,
            targets,
            use_rslora: self.use_rslora,
        };
        config
            .validate()
            .map_err(|e| invalid("lora", e.to_string()))?;
        Ok(config)
    }

    pub(crate) fn validate(&self) -> Result<(), ConfigError> {
        positive("lora.rank", self.rank)?;
        if !self.alpha.is_finite() {
            return Err(invalid("lora.alpha", "must be finite"));
        }
        if !(0.0..1.0).contains(&self.dropout) {
            return Err(invalid("lora.dropout", "must be in [0, 1)"));
        }
        if self.target_modules.is_empty() {
            return Err(invalid("lora.target_modules", "needs at least one module"));
        }
        self.lora_config().map(|_| ())
    }
}
