//! Error type of the crate.
//!
//! [`BridgeError`] says what went wrong at the Python edge in words a user
//! can act on: the package to install and the command that installs it, the
//! env id Gymnasium does not know, the space relay cannot take. A
//! [`BridgeError::Faulted`] step is recoverable: the batch is consistent
//! again and only the transitions of that step are lost.

use std::time::Duration;

use relay_envs::EnvError;
use thiserror::Error;

/// The command that installs the Python side.
pub const INSTALL_HINT: &str = "`just install` (deploy/install.sh) installs it into .relay/python";

/// Everything that can go wrong at the Python edge.
#[derive(Debug, Error)]
pub enum BridgeError {
    /// A built-in env refused (bad action, unknown id).
    #[error(transparent)]
    Env(#[from] EnvError),

    /// The Python interpreter could not be started.
    #[error("cannot start the Python interpreter {python}: {source}; {INSTALL_HINT}")]
    NoPython {
        python: String,
        source: std::io::Error,
    },

    /// A Python package the env needs is not installed.
    #[error("Python package {package:?} is missing ({message}); {INSTALL_HINT}, or `{python} -m pip install {package}` for a package of your own")]
    MissingPackage {
        package: String,
        message: String,
        python: String,
    },

    /// Gymnasium does not know the env id (or its version is deprecated).
    #[error("unknown environment {env_id:?}: {message} (relay has built in: {} (classic control), {} (text games))", relay_envs::ENV_IDS.join(", "), relay_envs::TEXT_GAME_IDS.join(", "))]
    UnknownEnv { env_id: String, message: String },

    /// A space relay cannot take, named.
    #[error("{env_id}: {message}")]
    UnsupportedSpace { env_id: String, message: String },

    /// Python raised outside one env's `step`, or the worker ended.
    #[error(
        "Python env worker for {env_id}: {message}{}",
        traceback_suffix(traceback)
    )]
    Worker {
        env_id: String,
        message: String,
        traceback: String,
    },

    /// The worker did not answer in time.
    #[error("Python env worker for {env_id} did not answer within {after:?}")]
    Hung { env_id: String, after: Duration },

    /// A step in which some envs faulted (a Python exception in `step`, a
    /// worker that crashed or hung and was restarted). Every faulted env was
    /// reset and its episode dropped; the batch's observations are current,
    /// so stepping may go on. The step's transitions must be discarded.
    #[error("{} env fault(s) in one step: {}", faults.len(), faults.iter().map(|f| f.to_string()).collect::<Vec<_>>().join("; "))]
    Faulted { faults: Vec<Fault> },

    /// A reply that does not follow the protocol.
    #[error("Python env worker for {env_id} sent a bad reply: {detail}")]
    Protocol { env_id: String, detail: String },

    /// The owner stopped waiting ([`crate::Cancel`]): it is stopping. The
    /// batch is unusable; dropping it kills its workers.
    #[error("stopped waiting for the Python env workers of {env_id} (their owner is stopping)")]
    Cancelled { env_id: String },
}

impl BridgeError {
    /// Whether stepping may go on after this error (see [`BridgeError::Faulted`]).
    pub fn is_recoverable(&self) -> bool {
        matches!(self, BridgeError::Faulted { .. })
    }
}

fn traceback_suffix(traceback: &str) -> String {
    if traceback.is_empty() {
        String::new()
    } else {
        format!("\n{}", traceback.trim_end())
    }
}

/// What happened to the envs of one fault.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultKind {
    /// A Python exception inside one env's `step`; the worker lives on.
    Raised,
    /// The worker process ended; it was restarted.
    Crashed,
    /// The worker did not answer within `env.step_timeout_s`; it was killed
    /// and restarted.
    Hung,
}

impl FaultKind {
    /// Every kind (to show each at zero in metrics).
    pub const ALL: [FaultKind; 3] = [FaultKind::Raised, FaultKind::Crashed, FaultKind::Hung];

    /// Label of the fault in metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            FaultKind::Raised => "raised",
            FaultKind::Crashed => "crashed",
            FaultKind::Hung => "hung",
        }
    }

    /// Whether the worker was restarted.
    pub fn restarted(self) -> bool {
        !matches!(self, FaultKind::Raised)
    }
}

/// One fault of a step: which envs lost their episode and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fault {
    pub kind: FaultKind,
    /// Indices (in the batch) of the envs whose episode was dropped.
    pub envs: Vec<usize>,
    /// The traceback, or what the worker left on stderr before it ended.
    pub detail: String,
}

impl std::fmt::Display for Fault {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let what = match self.kind {
            FaultKind::Raised => "raised in step",
            FaultKind::Crashed => "worker crashed and was restarted",
            FaultKind::Hung => "worker hung and was restarted",
        };
        write!(f, "envs {:?} {what}", self.envs)?;
        if !self.detail.is_empty() {
            write!(f, ":\n{}", self.detail.trim_end())?;
        }
        Ok(())
    }
}
