//! The LoRA adapter's hyperparameters: which projections it adapts
//! ([`LoraTarget`]), its rank, alpha, dropout and scaling ([`LoraConfig`]).

use crate::check::FieldError;

/// A projection LoRA can adapt, named as in Hugging Face checkpoints.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum LoraTarget {
    /// `self_attn.q_proj`
    QProj,
    /// `self_attn.k_proj`
    KProj,
    /// `self_attn.v_proj`
    VProj,
    /// `self_attn.o_proj`
    OProj,
    /// `mlp.gate_proj`
    GateProj,
    /// `mlp.up_proj`
    UpProj,
    /// `mlp.down_proj`
    DownProj,
}

impl LoraTarget {
    /// Every projection, in block order.
    pub const ALL: [LoraTarget; 7] = [
        Self::QProj,
        Self::KProj,
        Self::VProj,
        Self::OProj,
        Self::GateProj,
        Self::UpProj,
        Self::DownProj,
    ];

    /// The module's own name (`"q_proj"`), as in PEFT's `target_modules`.
    pub fn module_name(self) -> &'static str {
        match self {
            Self::QProj => "q_proj",
            Self::KProj => "k_proj",
            Self::VProj => "v_proj",
            Self::OProj => "o_proj",
            Self::GateProj => "gate_proj",
            Self::UpProj => "up_proj",
            Self::DownProj => "down_proj",
        }
    }

    /// The block sub-module holding it (`"self_attn"` or `"mlp"`).
    pub fn parent(self) -> &'static str {
        match self {
            Self::QProj | Self::KProj | Self::VProj | Self::OProj => "self_attn",
            Self::GateProj | Self::UpProj | Self::DownProj => "mlp",
        }
    }

    /// Parses a module name (`"q_proj"`).
    pub fn from_module_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|t| t.module_name() == name)
    }
}

/// Hyperparameters of a LoRA adapter (PEFT's `LoraConfig` subset).
#[derive(Debug, Clone, PartialEq)]
pub struct LoraConfig {
    /// Rank `r` of the update (rows of `A`, columns of `B`).
    pub rank: usize,
    /// `lora_alpha`: the update is scaled by `alpha / rank`
    /// (or `alpha / sqrt(rank)` with `use_rslora`).
    pub alpha: f64,
    /// `lora_dropout`: dropout on the adapter's input during training in
    /// PEFT. Stored and saved; this crate does not apply it (its training
    /// forward is deterministic), and inference never does.
    pub dropout: f64,
    /// Projections that get an adapter, in every layer.
    pub targets: Vec<LoraTarget>,
    /// Rank-stabilised scaling `alpha / sqrt(rank)` (PEFT's `use_rslora`).
    pub use_rslora: bool,
}

impl LoraConfig {
    /// Rank `rank`, `alpha`, no dropout, on all seven projections.
    pub fn all_projections(rank: usize, alpha: f64) -> Self {
        Self {
            rank,
            alpha,
            dropout: 0.0,
            targets: LoraTarget::ALL.to_vec(),
            use_rslora: false,
        }
    }

    /// The factor applied to `B (A x)`.
    pub fn scaling(&self) -> f64 {
        if self.use_rslora {
            self.alpha / (self.rank as f64).sqrt()
        } else {
            self.alpha / self.rank as f64
        }
    }

    /// Checks rank, alpha and targets.
    pub fn validate(&self) -> Result<(), FieldError> {
        if self.rank == 0 {
            return Err(FieldError::new("r", "must be positive"));
        }
        if !self.alpha.is_finite() {
            return Err(FieldError::new("lora_alpha", "must be finite"));
        }
        if !(0.0..1.0).contains(&self.dropout) {
            return Err(FieldError::new("lora_dropout", "must be in [0, 1)"));
        }
        if self.targets.is_empty() {
            return Err(FieldError::new("target_modules", "is empty"));
        }
        Ok(())
    }
}
