//! The run registry: `<runs_dir>/runs.json`, one record per run, newest first.
//!
//! ```json
//! [
//!   {"id": "CartPole-v1-ppo-20250101-120000", "time": "2025-01-01T12:00:00.000Z",
//!    "config_id": "cartpole-ppo", "env_id": "CartPole-v1", "algo": "ppo", "seed": 1,
//!    "status": "solved", "detail": "eval mean 500.0 >= 475.0",
//!    "updated": "2025-01-01T12:03:10.512Z"}
//! ]
//! ```
//!
//! - `time` is the run's start (RFC 3339, UTC), `updated` its last change;
//!   the array is sorted by `time`, newest first (ties: id, descending).
//! - `config_id` is the config file's stem by the `configs/` naming
//!   convention `<env>-<algo>` (`CartPole-v1` + `ppo` → `cartpole-ppo`): the
//!   tracker only sees the resolved config, not its file name.
//! - `status` is `running`, `stopped`, `failed` or `solved` and never goes
//!   down: `running < stopped < failed < solved` (the evaluator's `solved`
//!   wins over the learner's later `stopped`). A tracker that starts again
//!   with the same run id sets it back to `running`.
//!
//! Every change is one read-modify-write under an exclusive `flock` on
//! `runs.json.lock`, written to a temporary file and renamed over
//! `runs.json`, so trackers of several runs (on one machine, or several
//! sharing a local runs folder) can share one runs folder and readers never
//! see half a file. A registry that does not parse is never overwritten
//! blindly: readers get [`RegistryError::Corrupt`], and a tracker (or
//! `relay runs repair`) first keeps it as `runs.json.bak` (`runs.json.N.bak`
//! when that exists) and rebuilds the registry from the run directories
//! (`config.yaml`, `status.json`).

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use relay_config::ExperimentConfig;
use relay_proto::{RunStatus, RunStatusUpdate};
use serde::{Deserialize, Serialize};

/// The registry file inside the runs folder.
pub const REGISTRY_FILE: &str = "runs.json";
/// The file whose `flock` serializes writers.
pub const LOCK_FILE: &str = "runs.json.lock";
/// How long a writer waits for the lock before giving up.
pub const LOCK_TIMEOUT: Duration = Duration::from_secs(10);

/// One run in the registry.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunRecord {
    /// The run id (`runs/<id>/`).
    pub id: String,
    /// Start of the run, RFC 3339 UTC.
    pub time: String,
    /// Config file stem by the `<env>-<algo>` convention, e.g. `cartpole-ppo`.
    pub config_id: String,
    pub env_id: String,
    pub algo: String,
    /// Base seed of the run.
    #[serde(default)]
    pub seed: Option<u64>,
    pub status: RunStatus,
    /// Why the status last changed (from the `RunStatusUpdate`), if known.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub detail: String,
    /// Last change of this record, RFC 3339 UTC.
    pub updated: String,
}

impl RunRecord {
    /// A `running` record for a run of this config, started now.
    pub fn new(config: &ExperimentConfig, id: &str) -> Self {
        let time = now();
        Self {
            id: id.to_string(),
            config_id: config_id(&config.run.env_id, config.algo_name()),
            env_id: config.run.env_id.clone(),
            algo: config.algo_name().to_string(),
            seed: Some(config.run.seed),
            status: RunStatus::Running,
            detail: String::new(),
            updated: time.clone(),
            time,
        }
    }
}

/// Why the registry could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "{} is not a valid run registry ({detail}); it was left untouched: `relay runs repair` keeps it as a .bak file and rebuilds it from the run directories",
        path.display()
    )]
    Corrupt { path: PathBuf, detail: String },
    #[error("{} is still locked by another process after {}s", path.display(), timeout.as_secs())]
    LockTimeout { path: PathBuf, timeout: Duration },
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> RegistryError + '_ {
    move |source| RegistryError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// The current time as the registry writes it (RFC 3339, UTC, milliseconds).
pub fn now() -> String {
    chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Millis, true)
}

/// The config file stem by the `configs/` convention `<env>-<algo>`: the env
/// id lower-cased without its `-vN` version suffix, then the algorithm
/// (`CartPole-v1`, `ppo` → `cartpole-ppo`).
pub fn config_id(env_id: &str, algo: &str) -> String {
    let env = env_id.to_ascii_lowercase();
    let base = match env.rsplit_once("-v") {
        Some((base, version))
            if !version.is_empty() && version.chars().all(|c| c.is_ascii_digit()) =>
        {
            base.to_string()
        }
        _ => env,
    };
    format!("{base}-{}", algo.to_ascii_lowercase())
}

fn rank(status: RunStatus) -> u8 {
    match status {
        RunStatus::Running => 0,
        RunStatus::Stopped => 1,
        RunStatus::Failed => 2,
        RunStatus::Solved => 3,
    }
}

/// The status after `update` arrives at a run in `current`: it never goes
/// down (`running < stopped < failed < solved`), so a `solved` is kept when
/// a `stopped` follows it.
pub fn next_status(current: RunStatus, update: RunStatus) -> RunStatus {
    if rank(update) > rank(current) {
        update
    } else {
        current
    }
}

/// Sorts records newest first (by start time, then id).
pub fn sort_newest_first(records: &mut [RunRecord]) {
    let key = |r: &RunRecord| {
        chrono::DateTime::parse_from_rfc3339(&r.time)
            .map(|t| t.timestamp_millis())
            .unwrap_or(i64::MIN)
    };
    records.sort_by(|a, b| key(b).cmp(&key(a)).then_with(|| b.id.cmp(&a.id)));
}

/// `runs.json` of one runs folder.
#[derive(Debug, Clone)]
pub struct RunRegistry {
    runs_dir: PathBuf,
}

/// What [`RunRegistry::repair`] did.
#[derive(Debug, Clone, PartialEq)]
pub struct Repair {
    /// Where the unreadable registry was kept; `None` when it was readable.
    pub backup: Option<PathBuf>,
    /// Records in the registry afterwards.
    pub runs: usize,
}

/// An exclusive `flock` on the lock file, released on drop (and by the
/// kernel if the process dies).
struct Lock(File);

impl Lock {
    fn acquire(path: &Path, timeout: Duration) -> Result<Self, RegistryError> {
        let file = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(path)
            .map_err(io(path))?;
        let deadline = Instant::now() + timeout;
        let mut wait = Duration::from_millis(1);
        loop {
            // SAFETY: flock on a descriptor this function owns.
            let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
            if rc == 0 {
                return Ok(Lock(file));
            }
            let err = std::io::Error::last_os_error();
            match err.raw_os_error() {
                Some(libc::EWOULDBLOCK) | Some(libc::EINTR) => {}
                _ => return Err(io(path)(err)),
            }
            if Instant::now() >= deadline {
                return Err(RegistryError::LockTimeout {
                    path: path.to_path_buf(),
                    timeout,
                });
            }
            std::thread::sleep(wait);
            wait = (wait * 2).min(Duration::from_millis(50));
        }
    }
}

impl Drop for Lock {
    fn drop(&mut self) {
        // SAFETY: unlocking the descriptor this value owns.
        unsafe { libc::flock(self.0.as_raw_fd(), libc::LOCK_UN) };
    }
}

impl RunRegistry {
    pub fn new(runs_dir: impl Into<PathBuf>) -> Self {
        Self {
            runs_dir: runs_dir.into(),
        }
    }

    /// The runs folder.
    pub fn runs_dir(&self) -> &Path {
        &self.runs_dir
    }

    /// `<runs_dir>/runs.json`.
    pub fn path(&self) -> PathBuf {
        self.runs_dir.join(REGISTRY_FILE)
    }

    /// Every record, newest first; none when there is no registry yet.
    /// Needs no lock: the file is only ever replaced whole.
    pub fn load(&self) -> Result<Vec<RunRecord>, RegistryError> {
        let path = self.path();
        let text = match std::fs::read_to_string(&path) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(io(&path)(e)),
        };
        parse(&path, &text)
    }

    /// The newest run, if any.
    pub fn newest(&self) -> Result<Option<RunRecord>, RegistryError> {
        Ok(self.load()?.into_iter().next())
    }

    /// The record of a run, if registered.
    pub fn get(&self, id: &str) -> Result<Option<RunRecord>, RegistryError> {
        Ok(self.load()?.into_iter().find(|r| r.id == id))
    }

    /// Applies `change` to the records under the lock and writes them back
    /// (sorted newest first) atomically. A corrupt registry is an error and
    /// stays as it is.
    pub fn update<R>(
        &self,
        change: impl FnOnce(&mut Vec<RunRecord>) -> R,
    ) -> Result<R, RegistryError> {
        self.locked_update(false, change).map(|(r, _)| r)
    }

    /// Like [`update`](Self::update), but a corrupt registry is first kept
    /// as a `.bak` file and rebuilt from the run directories; the backup
    /// path is returned when that happened.
    pub fn update_or_repair<R>(
        &self,
        change: impl FnOnce(&mut Vec<RunRecord>) -> R,
    ) -> Result<(R, Option<PathBuf>), RegistryError> {
        self.locked_update(true, change)
    }

    /// Rebuilds an unreadable registry from the run directories, keeping the
    /// old file as a `.bak`; a readable one is left as it is.
    pub fn repair(&self) -> Result<Repair, RegistryError> {
        let (runs, backup) = self.locked_update(true, |records| records.len())?;
        Ok(Repair { backup, runs })
    }

    /// Inserts a record, or replaces the one with its id (keeping that one's
    /// start time). Returns the stored record.
    pub fn upsert(&self, record: RunRecord) -> Result<RunRecord, RegistryError> {
        self.update(|records| upsert(records, record))
    }

    /// Applies a status update to a registered run (see [`next_status`]);
    /// returns the resulting record, `None` when the run is not registered.
    pub fn set_status(
        &self,
        id: &str,
        status: RunStatus,
        detail: &str,
    ) -> Result<Option<RunRecord>, RegistryError> {
        self.update(|records| {
            let record = records.iter_mut().find(|r| r.id == id)?;
            apply(record, status, detail);
            Some(record.clone())
        })
    }

    fn locked_update<R>(
        &self,
        repair: bool,
        change: impl FnOnce(&mut Vec<RunRecord>) -> R,
    ) -> Result<(R, Option<PathBuf>), RegistryError> {
        std::fs::create_dir_all(&self.runs_dir).map_err(io(&self.runs_dir))?;
        let _lock = Lock::acquire(&self.runs_dir.join(LOCK_FILE), LOCK_TIMEOUT)?;
        let path = self.path();
        let (mut records, backup) = match self.load() {
            Ok(records) => (records, None),
            Err(RegistryError::Corrupt { .. }) if repair => {
                let backup = free_backup_path(&path);
                std::fs::copy(&path, &backup).map_err(io(&backup))?;
                (self.scan_run_dirs()?, Some(backup))
            }
            Err(e) => return Err(e),
        };
        let result = change(&mut records);
        sort_newest_first(&mut records);
        write_atomic(&path, &records)?;
        Ok((result, backup))
    }

    /// Records rebuilt from the run directories: every `<runs_dir>/<id>/`
    /// with a `config.yaml`, its status from `status.json` (`stopped` when
    /// there is none), its start time from `config.yaml`'s modification time.
    pub fn scan_run_dirs(&self) -> Result<Vec<RunRecord>, RegistryError> {
        let entries = std::fs::read_dir(&self.runs_dir).map_err(io(&self.runs_dir))?;
        let mut records = Vec::new();
        for entry in entries.flatten() {
            let dir = entry.path();
            let Some(id) = dir.file_name().and_then(|n| n.to_str()).map(str::to_string) else {
                continue;
            };
            let config_path = dir.join("config.yaml");
            let Ok(text) = std::fs::read_to_string(&config_path) else {
                continue;
            };
            let Ok(config) = serde_yaml::from_str::<serde_yaml::Value>(&text) else {
                continue;
            };
            let run = &config["run"];
            let env_id = run["env_id"].as_str().unwrap_or("?").to_string();
            let algo = run["algo"].as_str().unwrap_or("ppo").to_string();
            let mtime = |p: &Path| {
                std::fs::metadata(p)
                    .and_then(|m| m.modified())
                    .map(|t| {
                        chrono::DateTime::<chrono::Utc>::from(t)
                            .to_rfc3339_opts(chrono::SecondsFormat::Millis, true)
                    })
                    .ok()
            };
            let time = mtime(&config_path).unwrap_or_else(now);
            let status_path = dir.join("status.json");
            let status_json = std::fs::read(&status_path)
                .ok()
                .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok());
            let status = status_json
                .as_ref()
                .and_then(|s| serde_json::from_value::<RunStatus>(s["status"].clone()).ok())
                .unwrap_or(RunStatus::Stopped);
            let detail = status_json
                .as_ref()
                .and_then(|s| s["detail"].as_str())
                .unwrap_or_default()
                .to_string();
            records.push(RunRecord {
                config_id: config_id(&env_id, &algo),
                env_id,
                algo,
                seed: run["seed"].as_u64(),
                status,
                detail,
                updated: mtime(&status_path).unwrap_or_else(|| time.clone()),
                time,
                id,
            });
        }
        sort_newest_first(&mut records);
        Ok(records)
    }
}

fn parse(path: &Path, text: &str) -> Result<Vec<RunRecord>, RegistryError> {
    let mut records: Vec<RunRecord> =
        serde_json::from_str(text).map_err(|e| RegistryError::Corrupt {
            path: path.to_path_buf(),
            detail: e.to_string(),
        })?;
    sort_newest_first(&mut records);
    Ok(records)
}

fn upsert(records: &mut Vec<RunRecord>, mut record: RunRecord) -> RunRecord {
    match records.iter_mut().find(|r| r.id == record.id) {
        Some(existing) => {
            record.time = existing.time.clone();
            *existing = record.clone();
        }
        None => records.push(record.clone()),
    }
    record
}

fn apply(record: &mut RunRecord, status: RunStatus, detail: &str) {
    let next = next_status(record.status, status);
    if next != record.status {
        record.status = next;
        record.detail = detail.to_string();
    }
    record.updated = now();
}

fn free_backup_path(path: &Path) -> PathBuf {
    let name = path
        .file_name()
        .and_then(|n| n.to_str())
        .unwrap_or(REGISTRY_FILE);
    let stem = name.strip_suffix(".json").unwrap_or(name);
    let first = path.with_file_name(format!("{name}.bak"));
    if !first.exists() {
        return first;
    }
    (1..)
        .map(|n| path.with_file_name(format!("{stem}.json.{n}.bak")))
        .find(|p| !p.exists())
        .expect("some backup name is free")
}

fn write_atomic(path: &Path, records: &[RunRecord]) -> Result<(), RegistryError> {
    let tmp = path.with_file_name(format!("{REGISTRY_FILE}.tmp.{}", std::process::id()));
    let mut text = serde_json::to_vec_pretty(records).expect("records serialize");
    text.push(b'\n');
    let mut file = File::create(&tmp).map_err(io(&tmp))?;
    file.write_all(&text).map_err(io(&tmp))?;
    file.sync_all().map_err(io(&tmp))?;
    drop(file);
    std::fs::rename(&tmp, path).map_err(io(path))
}

/// The tracker's view of its own run in the registry: registered as
/// `running` on start, updated on each status, `stopped` at shutdown if
/// still `running`. The tracker's in-memory record is the truth for its run:
/// each write puts it back whole, so a run lost from a rebuilt registry
/// reappears. Failures are logged, never fatal: the run goes on.
pub struct RunRecorder {
    registry: RunRegistry,
    record: RunRecord,
}

impl RunRecorder {
    /// Registers the run as `running`.
    pub fn start(config: &ExperimentConfig, id: &str) -> Self {
        let mut recorder = Self {
            registry: RunRegistry::new(config.run.runs_dir.clone()),
            record: RunRecord::new(config, id),
        };
        recorder.write();
        recorder
    }

    /// The run's record as last written.
    pub fn record(&self) -> &RunRecord {
        &self.record
    }

    /// Applies a `RunStatusUpdate`.
    pub fn status(&mut self, update: &RunStatusUpdate) {
        let before = self.record.status;
        apply(&mut self.record, update.status, &update.detail);
        if self.record.status != before {
            self.write();
        }
    }

    /// At shutdown: a run still `running` is `stopped`.
    pub fn finish(&mut self) {
        if self.record.status == RunStatus::Running {
            apply(
                &mut self.record,
                RunStatus::Stopped,
                "tracker stopped while the run was running",
            );
        }
        self.write();
    }

    fn write(&mut self) {
        let record = self.record.clone();
        match self
            .registry
            .update_or_repair(|records| upsert(records, record))
        {
            Ok((stored, backup)) => {
                if let Some(backup) = backup {
                    tracing::warn!(registry = %self.registry.path().display(), backup = %backup.display(),
                        "the run registry did not parse: kept it as a backup and rebuilt it from the run directories");
                }
                self.record = stored;
            }
            Err(e) => tracing::error!(error = %e, "cannot update the run registry"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_ids_follow_the_configs_folder() {
        assert_eq!(config_id("CartPole-v1", "ppo"), "cartpole-ppo");
        assert_eq!(config_id("MountainCar-v0", "ppo"), "mountaincar-ppo");
        assert_eq!(config_id("Pendulum-v1", "ppo"), "pendulum-ppo");
        assert_eq!(config_id("Custom-vx", "ppo"), "custom-vx-ppo");
    }

    #[test]
    fn status_never_goes_down() {
        use RunStatus::*;
        assert_eq!(next_status(Running, Stopped), Stopped);
        assert_eq!(next_status(Running, Solved), Solved);
        assert_eq!(next_status(Solved, Stopped), Solved);
        assert_eq!(next_status(Solved, Failed), Solved);
        assert_eq!(next_status(Stopped, Solved), Solved);
        assert_eq!(next_status(Stopped, Running), Stopped);
        assert_eq!(next_status(Stopped, Failed), Failed);
    }

    #[test]
    fn backup_names_do_not_collide() {
        let dir = std::env::temp_dir().join(format!("relay-reg-bak-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join(REGISTRY_FILE);
        assert_eq!(free_backup_path(&path), dir.join("runs.json.bak"));
        std::fs::write(dir.join("runs.json.bak"), "x").unwrap();
        assert_eq!(free_backup_path(&path), dir.join("runs.json.1.bak"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
