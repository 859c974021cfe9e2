//! Where a base model comes from: the one loader of `llm.model` values
//! (`smollm2`, a `.gguf` file, a Hugging Face folder), shared by every
//! process that needs the run's base model (the learner here; the
//! inference server and `relay play` load the same way).

use std::path::{Path, PathBuf};

use relay_config::GgufBaseName;

use crate::{find_smollm2_gguf, Backend, CausalLm, FindGgufError, GgufBase, Tokenizer};

/// Why a model spec could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error(transparent)]
    Find(#[from] FindGgufError),
    #[error("{path}: {detail}")]
    Load { path: PathBuf, detail: String },
}

/// What a model spec (`smollm2`, a `.gguf` path or a folder) names on disk.
pub fn resolve_model_path(spec: &str) -> Result<PathBuf, LoadError> {
    if spec == "smollm2" {
        Ok(find_smollm2_gguf()?)
    } else {
        Ok(PathBuf::from(spec))
    }
}

fn is_gguf(path: &Path) -> bool {
    path.extension().is_some_and(|e| e == "gguf")
}

/// Loads the weights a spec names. A `.gguf` file is held as `gguf_base`
/// says (training needs [`GgufBase::Dequantized`]: no gradient crosses a
/// quantized projection); a folder must hold `config.json`. For the
/// engine; [`load_causal_lm_on`] for another backend.
pub fn load_causal_lm(spec: &str, gguf_base: GgufBase) -> Result<(CausalLm, PathBuf), LoadError> {
    load_causal_lm_on(spec, gguf_base, &Backend::Engine)
}

/// [`load_causal_lm`] onto `backend`: a Hugging Face folder's tensors go
/// from the file to the device as stored ([`CausalLm::load_hf_on`]); a
/// GGUF file's are read on the host (its quantized blocks are
/// dequantized there) and then placed.
pub fn load_causal_lm_on(
    spec: &str,
    gguf_base: GgufBase,
    backend: &Backend,
) -> Result<(CausalLm, PathBuf), LoadError> {
    let path = resolve_model_path(spec)?;
    let fail = |detail: String| LoadError::Load {
        path: path.clone(),
        detail,
    };
    let model = if is_gguf(&path) {
        CausalLm::load_gguf(&path, gguf_base)
            .and_then(|m| m.to_backend(backend.clone()))
            .map_err(|e| fail(e.to_string()))?
    } else if path.join("config.json").is_file() {
        CausalLm::load_hf_on(&path, backend).map_err(|e| fail(e.to_string()))?
    } else {
        return Err(fail(
            "neither a .gguf file nor a folder with config.json (give a Hugging Face folder, e.g. from `relay model init tiny`, a .gguf file, or `smollm2`)".into(),
        ));
    };
    Ok((model, path))
}

/// Loads the tokenizer beside the weights of a resolved model path.
pub fn load_tokenizer(path: &Path) -> Result<Tokenizer, LoadError> {
    let result = if is_gguf(path) {
        Tokenizer::from_gguf(path)
    } else {
        Tokenizer::from_hf_dir(path)
    };
    result.map_err(|e| LoadError::Load {
        path: path.to_path_buf(),
        detail: e.to_string(),
    })
}

/// A loaded base model and its tokenizer.
pub struct LoadedModel {
    pub model: CausalLm,
    pub tokenizer: Tokenizer,
    /// What `llm.model` resolved to.
    pub path: PathBuf,
}

impl From<GgufBaseName> for GgufBase {
    fn from(name: GgufBaseName) -> Self {
        match name {
            GgufBaseName::Quantized => GgufBase::Quantized,
            GgufBaseName::Dequantized => GgufBase::Dequantized,
        }
    }
}

/// Loads `llm.model` (`smollm2`, a `.gguf` file, or a Hugging Face folder)
/// with its tokenizer, as every process does, for the engine.
pub fn load_model(model: &str, gguf_base: GgufBaseName) -> Result<LoadedModel, LoadError> {
    load_model_on(model, gguf_base, &Backend::Engine)
}

/// [`load_model`] onto `backend` ([`load_causal_lm_on`]).
pub fn load_model_on(
    model: &str,
    gguf_base: GgufBaseName,
    backend: &Backend,
) -> Result<LoadedModel, LoadError> {
    let (model, path) = load_causal_lm_on(model, gguf_base.into(), backend)?;
    let tokenizer = load_tokenizer(&path)?;
    Ok(LoadedModel {
        model,
        tokenizer,
        path,
    })
}
