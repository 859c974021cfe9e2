//! One Python worker process and its pipe protocol.
//!
//! The worker is `python -c <relay_env_worker.py>` (the script is compiled
//! into the binary, so nothing has to be found on disk). Requests go to its
//! stdin and replies come from its stdout, each a 4-byte little-endian
//! length and a MessagePack map. Replies are read with `poll`, so that a wait
//! can time out (a hung worker) and be cut short by the owner's [`Cancel`]
//! (a service that stops must not wait out a step or a start); a thread
//! forwards the worker's stderr to the logs and keeps its last lines for the
//! error that reports a crash. Dropping a [`Worker`] kills the process.

use std::collections::VecDeque;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::fd::AsRawFd;
use std::path::Path;
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

/// The worker program.
pub const WORKER_SOURCE: &str = include_str!("../python/relay_env_worker.py");

/// Lines of stderr kept for crash reports.
const STDERR_TAIL: usize = 30;

/// Longest a wait for a reply goes without looking at its [`Cancel`]: how
/// late a cancelled wait may notice (a reply that arrives ends the wait at
/// once, whatever this is).
const CANCEL_CHECK: Duration = Duration::from_millis(20);

/// A request to stop waiting on Python workers, shared by the owner (a
/// service's shutdown sets it) and the envs whose waits it cuts short. A
/// wait that sees it set returns [`crate::BridgeError::Cancelled`] within
/// tens of milliseconds, whatever `env.step_timeout_s` or
/// `env.start_timeout_s` say; the batch is then unusable (its workers may
/// still be busy) and is dropped, which kills them. Cloning shares it; the
/// default is never cancelled unless [`Cancel::cancel`] is called.
#[derive(Debug, Clone, Default)]
pub struct Cancel(Arc<AtomicBool>);

impl Cancel {
    pub fn new() -> Self {
        Self::default()
    }

    /// Cuts short every wait of the envs that share this (now and later).
    pub fn cancel(&self) {
        self.0.store(true, Ordering::Relaxed);
    }

    pub fn is_cancelled(&self) -> bool {
        self.0.load(Ordering::Relaxed)
    }
}

/// Why a request got no usable reply.
#[derive(Debug)]
pub(crate) enum Failure {
    /// The process ended (or its pipes broke); what it left on stderr.
    Exited { stderr: String },
    /// No reply within the timeout.
    Hung { after: Duration },
    /// The worker answered with an error.
    Replied(ErrorReply),
    /// A reply that does not decode.
    BadReply(String),
    /// The owner cancelled the wait ([`Cancel`]).
    Cancelled,
}

/// An `{"error": ...}` reply.
#[derive(Debug, Clone)]
pub(crate) struct ErrorReply {
    pub error: String,
    pub message: String,
    pub traceback: String,
    pub package: Option<String>,
}

/// `{"ok": T}` or the fields of an [`ErrorReply`] (not flattened: serde
/// would buffer every reply to find out which).
#[derive(Deserialize)]
struct Reply<T> {
    ok: Option<T>,
    error: Option<String>,
    #[serde(default)]
    message: String,
    #[serde(default)]
    traceback: String,
    #[serde(default)]
    package: Option<String>,
}

/// A running worker process.
pub(crate) struct Worker {
    child: Child,
    stdin: ChildStdin,
    stdout: ChildStdout,
    /// Bytes read from stdout not yet returned as a reply.
    inbox: Vec<u8>,
    chunk: Vec<u8>,
    stderr_tail: Arc<Mutex<VecDeque<String>>>,
    frame: Vec<u8>,
    cancel: Cancel,
}

impl Worker {
    /// Starts `python` on the worker program; `label` names it in the logs.
    pub fn spawn(python: &Path, label: &str) -> std::io::Result<Worker> {
        let mut child = Command::new(python)
            .arg("-u")
            .arg("-c")
            .arg(WORKER_SOURCE)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()?;
        let stdin = child.stdin.take().expect("piped");
        let stdout = child.stdout.take().expect("piped");
        let stderr = child.stderr.take().expect("piped");
        let stderr_tail = Arc::new(Mutex::new(VecDeque::with_capacity(STDERR_TAIL)));
        let tail = stderr_tail.clone();
        let label = label.to_string();
        std::thread::Builder::new()
            .name(format!("py-{label}-err"))
            .spawn(move || {
                for line in BufReader::new(stderr).lines() {
                    let Ok(line) = line else { return };
                    tracing::info!(target: "relay_bridge::python", worker = %label, "{line}");
                    let mut tail = tail.lock().expect("stderr tail");
                    if tail.len() == STDERR_TAIL {
                        tail.pop_front();
                    }
                    tail.push_back(line);
                }
            })?;
        Ok(Worker {
            child,
            stdin,
            stdout,
            inbox: Vec::new(),
            chunk: vec![0; 1 << 16],
            stderr_tail,
            frame: Vec::new(),
            cancel: Cancel::default(),
        })
    }

    /// Lets `cancel` cut this worker's waits short.
    pub fn cancelled_by(mut self, cancel: &Cancel) -> Worker {
        self.cancel = cancel.clone();
        self
    }

    /// Sends one request.
    pub fn send<T: Serialize>(&mut self, request: &T) -> Result<(), Failure> {
        self.frame.clear();
        self.frame.extend_from_slice(&[0; 4]);
        rmp_serde::encode::write_named(&mut self.frame, request)
            .map_err(|e| Failure::BadReply(format!("cannot encode the request: {e}")))?;
        let len = (self.frame.len() - 4) as u32;
        self.frame[..4].copy_from_slice(&len.to_le_bytes());
        if self
            .stdin
            .write_all(&self.frame)
            .and_then(|()| self.stdin.flush())
            .is_err()
        {
            return Err(self.exited());
        }
        Ok(())
    }

    /// Waits up to `timeout` for the reply to the last request, or until
    /// its [`Cancel`] is set. Read here with `poll`, not by a reader thread:
    /// a thread hop per step costs more than the pipe itself on a busy
    /// machine.
    pub fn recv<R: DeserializeOwned>(&mut self, timeout: Duration) -> Result<R, Failure> {
        let deadline = Instant::now() + timeout;
        let len = loop {
            if let Some(len) = complete_frame(&self.inbox) {
                break len;
            }
            if self.cancel.is_cancelled() {
                return Err(Failure::Cancelled);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(Failure::Hung { after: timeout });
            }
            let left = left.min(CANCEL_CHECK);
            let mut fd = libc::pollfd {
                fd: self.stdout.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            let ms = left.as_millis().clamp(1, i32::MAX as u128) as i32;
            // SAFETY: one valid pollfd for the duration of the call.
            let ready = unsafe { libc::poll(&mut fd, 1, ms) };
            if ready < 0 {
                if std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(self.exited());
            }
            if ready == 0 {
                continue;
            }
            match self.stdout.read(&mut self.chunk) {
                Ok(0) | Err(_) => return Err(self.exited()),
                Ok(n) => self.inbox.extend_from_slice(&self.chunk[..n]),
            }
        };
        let reply: Result<Reply<R>, _> = rmp_serde::from_slice(&self.inbox[4..4 + len]);
        self.inbox.drain(..4 + len);
        let reply = reply.map_err(|e| Failure::BadReply(e.to_string()))?;
        match (reply.ok, reply.error) {
            (Some(ok), _) => Ok(ok),
            (None, Some(error)) => Err(Failure::Replied(ErrorReply {
                error,
                message: reply.message,
                traceback: reply.traceback,
                package: reply.package,
            })),
            (None, None) => Err(Failure::BadReply("neither ok nor error".into())),
        }
    }

    /// One request and its reply.
    pub fn call<T: Serialize, R: DeserializeOwned>(
        &mut self,
        request: &T,
        timeout: Duration,
    ) -> Result<R, Failure> {
        self.send(request)?;
        self.recv(timeout)
    }

    fn exited(&mut self) -> Failure {
        // The stderr thread may still be reading the last lines.
        let _ = self.child.kill();
        let status = self.child.wait().ok();
        std::thread::sleep(Duration::from_millis(20));
        let tail = self.stderr_tail.lock().expect("stderr tail");
        let mut stderr = tail.iter().cloned().collect::<Vec<_>>().join("\n");
        if let Some(status) = status {
            stderr = format!("exited with {status}\n{stderr}");
        }
        Failure::Exited { stderr }
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The body length of the first frame in `inbox`, once all of it is there.
fn complete_frame(inbox: &[u8]) -> Option<usize> {
    let header: [u8; 4] = inbox.get(..4)?.try_into().expect("4 bytes");
    let len = u32::from_le_bytes(header) as usize;
    (inbox.len() >= 4 + len).then_some(len)
}
