//! The batch's worker processes: how they are started, how a faulted one
//! is replaced (`PyVecEnv::restart`, seeds of a new generation), and the
//! errors of a worker that did not start or failed outside a step.

use std::ops::Range;
use std::path::PathBuf;
use std::time::Duration;

use relay_envs::sub_seed;

use super::wire::{InitRequest, OpRequest, ResetReply, WireSpec};
use super::PyVecEnv;
use crate::error::{BridgeError, Fault, FaultKind};
use crate::section::EnvSection;
use crate::worker::{Cancel, Failure, Worker};

/// One worker and the envs (indices in the batch) it steps.
pub(super) struct Slot {
    pub(super) worker: Worker,
    pub(super) envs: Range<usize>,
    pub(super) generation: u64,
}

/// How the batch's workers are started (again, after a fault).
pub(super) struct Launcher {
    pub(super) env_id: String,
    pub(super) section: EnvSection,
    pub(super) python: PathBuf,
    pub(super) seed: u64,
    /// Cuts every worker's waits short (the owner stops).
    pub(super) cancel: Cancel,
}

impl PyVecEnv {
    /// Replaces slot `s`'s worker with a new one whose envs are reset.
    pub(super) fn restart(&mut self, s: usize, failure: Failure) -> Result<Fault, BridgeError> {
        let (kind, detail) = match failure {
            Failure::Hung { after } => (FaultKind::Hung, format!("no answer within {after:?}")),
            Failure::Exited { stderr } => (FaultKind::Crashed, stderr),
            Failure::Replied(e) => (
                FaultKind::Crashed,
                format!("{}\n{}", e.message, e.traceback),
            ),
            Failure::BadReply(detail) => (FaultKind::Crashed, format!("bad reply: {detail}")),
            Failure::Cancelled => return Err(failure_error(&self.launcher.env_id, failure)),
        };
        let range = self.slots[s].envs.clone();
        let generation = self.slots[s].generation + 1;
        tracing::warn!(env_id = %self.launcher.env_id, worker = %worker_label(&range), kind = kind.as_str(), "restarting a Python env worker: {detail}");
        let launcher = &self.launcher;
        let mut worker = launcher.spawn()?;
        let timeout = launcher.start_timeout();
        worker
            .call::<_, WireSpec>(&launcher.init_request(&range, generation), timeout)
            .map_err(|f| launcher.start_error(f, &range))?;
        let reply: ResetReply = worker
            .call(&OpRequest { op: "reset" }, timeout)
            .map_err(|f| failure_error(&self.launcher.env_id, f))?;
        // The old worker is killed as it drops.
        self.slots[s] = Slot {
            worker,
            envs: range.clone(),
            generation,
        };
        self.restarts += 1;
        self.write_obs(&range, &reply.obs)?;
        self.write_masks(&range, reply.masks.as_ref().map(|m| &m[..]))?;
        self.write_movers(&range, reply.movers.as_ref().map(|m| &m[..]))?;
        for i in range.clone() {
            self.drop_episode(i);
        }
        Ok(Fault {
            kind,
            envs: range.collect(),
            detail,
        })
    }
}

impl Launcher {
    pub(super) fn spawn(&self) -> Result<Worker, BridgeError> {
        if self.cancel.is_cancelled() {
            return Err(failure_error(&self.env_id, Failure::Cancelled));
        }
        Worker::spawn(&self.python, &self.env_id)
            .map(|worker| worker.cancelled_by(&self.cancel))
            .map_err(|source| BridgeError::NoPython {
                python: self.python.display().to_string(),
                source,
            })
    }

    pub(super) fn init_request<'a>(
        &'a self,
        range: &Range<usize>,
        generation: u64,
    ) -> InitRequest<'a> {
        let seed = self.seed ^ generation.wrapping_mul(0xD1B5_4A32_D192_ED03);
        InitRequest {
            op: "init",
            env_id: &self.env_id,
            kwargs: &self.section.kwargs,
            wrappers: &self.section.wrappers,
            imports: &self.section.imports,
            python_path: &self.section.python_path,
            entry_point: self.section.entry_point.as_deref(),
            num_envs: range.len(),
            // 32 bits: NumPy's legacy `RandomState` (MinAtar, many users'
            // envs) refuses larger seeds.
            seeds: range
                .clone()
                .map(|i| sub_seed(seed, i) & u64::from(u32::MAX))
                .collect(),
            action_masks: self.section.action_masks,
            backend: self.section.backend,
            multi_agent: self.section.multi_agent,
            seat_feature: self.section.seat_feature,
            probe: false,
        }
    }

    pub(super) fn start_timeout(&self) -> Duration {
        Duration::from_secs_f64(self.section.start_timeout_s)
    }

    /// The error of a worker that did not start.
    pub(super) fn start_error(&self, failure: Failure, range: &Range<usize>) -> BridgeError {
        start_error(&self.env_id, &self.python, &worker_label(range), failure)
    }
}

/// The error of a worker (labelled `label` in the logs) that did not start
/// `env_id` under `python`.
pub(crate) fn start_error(
    env_id: &str,
    python: &std::path::Path,
    label: &str,
    failure: Failure,
) -> BridgeError {
    let python = python.display().to_string();
    match failure {
        Failure::Replied(e) => match e.error.as_str() {
            "missing_package" => BridgeError::MissingPackage {
                package: e.package.unwrap_or_default(),
                message: e.message,
                python,
            },
            "unknown_env" => BridgeError::UnknownEnv {
                env_id: env_id.to_string(),
                message: e.message,
            },
            "unsupported_space" => BridgeError::UnsupportedSpace {
                env_id: env_id.to_string(),
                message: e.message,
            },
            _ => BridgeError::Worker {
                env_id: env_id.to_string(),
                message: e.message,
                traceback: e.traceback,
            },
        },
        // The worker writes this line and exits when msgpack or numpy is missing.
        Failure::Exited { stderr } => match stderr
            .split("missing Python package '")
            .nth(1)
            .and_then(|rest| rest.split('\'').next())
        {
            Some(package) => BridgeError::MissingPackage {
                package: package.to_string(),
                message: "the env worker needs it".into(),
                python,
            },
            None => BridgeError::Worker {
                env_id: env_id.to_string(),
                message: format!("worker of {label} ended while starting"),
                traceback: stderr,
            },
        },
        other => failure_error(env_id, other),
    }
}

fn worker_label(range: &Range<usize>) -> String {
    format!("envs {}..{}", range.start, range.end)
}

/// The error of a request that failed outside a step.
pub(crate) fn failure_error(env_id: &str, failure: Failure) -> BridgeError {
    match failure {
        Failure::Hung { after } => BridgeError::Hung {
            env_id: env_id.to_string(),
            after,
        },
        Failure::Exited { stderr } => BridgeError::Worker {
            env_id: env_id.to_string(),
            message: "the worker ended".into(),
            traceback: stderr,
        },
        Failure::Replied(e) => BridgeError::Worker {
            env_id: env_id.to_string(),
            message: e.message,
            traceback: e.traceback,
        },
        Failure::BadReply(detail) => BridgeError::Protocol {
            env_id: env_id.to_string(),
            detail,
        },
        Failure::Cancelled => BridgeError::Cancelled {
            env_id: env_id.to_string(),
        },
    }
}
