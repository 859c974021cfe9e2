//! [`PyVecEnv`]: a batch of Gymnasium envs stepped by Python workers, with
//! the semantics of relay's built-in [`relay_envs::VecEnv`].
//!
//! - `terminated` and `truncated` come from the env as it reports them; an
//!   ended episode is reset in the same step (Stable-Baselines3's autoreset)
//!   and its last observation is kept ([`VecStep::final_obs`]) for
//!   bootstrapping, so episodes never mix.
//! - Env `i` is seeded once, at its first reset, with the low 32 bits of
//!   [`relay_envs::sub_seed`]`(seed, i)` (the built-in envs use all 64); a
//!   restarted worker's envs get seeds of a new generation, so a restart
//!   does not replay episodes.
//! - The batch is split among `env.workers` processes; one step is one round
//!   trip to each, all of them in flight together.
//! - Faults: a Python exception in one env's `step` resets that env; a worker
//!   that ends or does not answer within `env.step_timeout_s` is killed and
//!   started again. Either way the step returns [`BridgeError::Faulted`]
//!   naming the envs whose episode was dropped, and stepping goes on.
//! - Stopping: every wait (start, reset, step, restart) ends within tens of
//!   milliseconds of the batch's [`Cancel`] being set, with
//!   [`BridgeError::Cancelled`]; the owner then drops the batch, which kills
//!   its workers. A service that stops never waits out a 60 s step timeout
//!   or a 120 s start.

mod wire;
mod workers;

use std::ops::Range;
use std::time::Duration;

use relay_envs::{check_actions, EnvSpec, FinishedEpisode, VecActions, VecStep};

use crate::error::{BridgeError, Fault, FaultKind};
use crate::section::EnvSection;
use crate::worker::{Cancel, Failure};
use wire::{
    decode_f32, spec_from_wire, AttrReply, GetAttrRequest, InitRequest, OpRequest, ResetReply,
    StepReply, StepRequest, WireSpec,
};
use workers::{Launcher, Slot};

pub(crate) use workers::{failure_error, start_error};

/// `num_envs` copies of a Gymnasium env stepped by Python workers.
pub struct PyVecEnv {
    launcher: Launcher,
    spec: EnvSpec,
    obs_dim: usize,
    slots: Vec<Slot>,
    buf: VecStep,
    returns: Vec<f64>,
    lengths: Vec<u32>,
    /// Multi-agent games: each seat's return so far, `[num_envs * seats]`.
    seat_returns: Vec<f64>,
    has_reset: bool,
    restarts: u64,
    action_bytes: Vec<u8>,
}

impl std::fmt::Debug for PyVecEnv {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PyVecEnv")
            .field("env_id", &self.launcher.env_id)
            .field("num_envs", &self.returns.len())
            .field("workers", &self.slots.len())
            .finish_non_exhaustive()
    }
}

impl PyVecEnv {
    /// Starts the workers and makes `num_envs` copies of `env_id` (not reset
    /// yet); fails with an error naming the missing package, the unknown id
    /// or the space relay cannot take.
    pub fn new(
        env_id: &str,
        section: &EnvSection,
        num_envs: usize,
        seed: u64,
    ) -> Result<PyVecEnv, BridgeError> {
        Self::cancellable(env_id, section, num_envs, seed, &Cancel::default())
    }

    /// [`PyVecEnv::new`], whose waits (this start included) `cancel` cuts
    /// short with [`BridgeError::Cancelled`].
    pub fn cancellable(
        env_id: &str,
        section: &EnvSection,
        num_envs: usize,
        seed: u64,
        cancel: &Cancel,
    ) -> Result<PyVecEnv, BridgeError> {
        if num_envs == 0 {
            return Err(relay_envs::EnvError::NoEnvs.into());
        }
        let launcher = Launcher {
            env_id: env_id.to_string(),
            section: section.clone(),
            python: section.interpreter(),
            seed,
            cancel: cancel.clone(),
        };
        // The envs are shared out among the workers in whole units: a
        // parallel game's agents (its rows) go to one worker together.
        let unit = if section.workers > 1
            && num_envs > 1
            && matches!(
                section.backend,
                crate::Backend::Auto | crate::Backend::Pettingzoo
            ) {
            crate::cancellable_spec(env_id, section, cancel)?
                .team
                .len()
                .max(1)
        } else {
            1
        };
        let units = num_envs.div_ceil(unit);
        let workers = section.workers.clamp(1, units);
        // Every worker imports and makes in parallel.
        let mut started = Vec::with_capacity(workers);
        for w in 0..workers {
            let range = (w * units / workers * unit).min(num_envs)
                ..((w + 1) * units / workers * unit).min(num_envs);
            let mut worker = launcher.spawn()?;
            worker
                .send(&launcher.init_request(&range, 0))
                .map_err(|f| launcher.start_error(f, &range))?;
            started.push((worker, range));
        }
        let mut slots = Vec::with_capacity(workers);
        let mut first = None;
        for (mut worker, range) in started {
            let wire: WireSpec = worker
                .recv(launcher.start_timeout())
                .map_err(|f| launcher.start_error(f, &range))?;
            first.get_or_insert(wire);
            slots.push(Slot {
                worker,
                envs: range,
                generation: 0,
            });
        }
        let wire = first.expect("at least one worker");
        let spec = spec_from_wire(env_id, &wire)?;
        let obs_dim = spec.obs_dim();
        let mut buf = VecStep::new(num_envs, obs_dim);
        if let (true, Some(n)) = (spec.action_mask, spec.action_space.n()) {
            buf = buf.with_masks(n);
        }
        let seats = spec.agents.len();
        if seats > 0 {
            buf = buf.with_seats(seats);
        }
        Ok(PyVecEnv {
            launcher,
            spec,
            obs_dim,
            slots,
            buf,
            returns: vec![0.0; num_envs],
            lengths: vec![0; num_envs],
            seat_returns: vec![0.0; num_envs * seats],
            has_reset: false,
            restarts: 0,
            action_bytes: Vec::new(),
        })
    }

    /// The spec of `env_id` under `section` as one worker reports it,
    /// having made one env (or one game of a team of agents); the worker
    /// is then stopped.
    pub(crate) fn probe(
        env_id: &str,
        section: &EnvSection,
        cancel: &Cancel,
    ) -> Result<EnvSpec, BridgeError> {
        let launcher = Launcher {
            env_id: env_id.to_string(),
            section: section.clone(),
            python: section.interpreter(),
            seed: 0,
            cancel: cancel.clone(),
        };
        let range = 0..1;
        let mut worker = launcher.spawn()?;
        let request = InitRequest {
            probe: true,
            ..launcher.init_request(&range, 0)
        };
        worker
            .send(&request)
            .map_err(|f| launcher.start_error(f, &range))?;
        let wire: WireSpec = worker
            .recv(launcher.start_timeout())
            .map_err(|f| launcher.start_error(f, &range))?;
        spec_from_wire(env_id, &wire)
    }

    /// The env's spec as relay sees it (flattened observations).
    pub fn spec(&self) -> &EnvSpec {
        &self.spec
    }

    /// Number of envs.
    pub fn num_envs(&self) -> usize {
        self.returns.len()
    }

    /// Flattened observation width.
    pub fn obs_dim(&self) -> usize {
        self.obs_dim
    }

    /// Current observations, `[num_envs * obs_dim]`.
    pub fn obs(&self) -> &[f32] {
        &self.buf.obs
    }

    /// Action masks of the current observations, for an env with masks.
    pub fn masks(&self) -> Option<&[u8]> {
        self.buf.masks()
    }

    /// Multi-agent games: the seat to move in each env (whose observation
    /// and mask are that env's rows).
    pub fn movers(&self) -> Option<&[u32]> {
        self.buf.movers()
    }

    /// Workers restarted since the batch was made.
    pub fn restarts(&self) -> u64 {
        self.restarts
    }

    /// Resets every env and returns the first observations.
    pub fn reset(&mut self) -> Result<&[f32], BridgeError> {
        let timeout = self.launcher.start_timeout();
        for slot in &mut self.slots {
            slot.worker
                .send(&OpRequest { op: "reset" })
                .map_err(|f| failure_error(&self.launcher.env_id, f))?;
        }
        for i in 0..self.slots.len() {
            let reply: ResetReply = self.slots[i]
                .worker
                .recv(timeout)
                .map_err(|f| failure_error(&self.launcher.env_id, f))?;
            let range = self.slots[i].envs.clone();
            self.write_obs(&range, &reply.obs)?;
            self.write_masks(&range, reply.masks.as_ref().map(|m| &m[..]))?;
            self.write_movers(&range, reply.movers.as_ref().map(|m| &m[..]))?;
        }
        self.returns.fill(0.0);
        self.seat_returns.fill(0.0);
        self.lengths.fill(0);
        self.buf.clear_outcomes();
        self.has_reset = true;
        Ok(&self.buf.obs)
    }

    /// Steps every env (one round trip per worker). On
    /// [`BridgeError::Faulted`] the faulted envs were reset and the step's
    /// transitions must be discarded; stepping may go on.
    pub fn step(&mut self, actions: VecActions<'_>) -> Result<&VecStep, BridgeError> {
        if !self.has_reset {
            return Err(relay_envs::EnvError::NotReset {
                env_id: self.spec.id,
            }
            .into());
        }
        let n = self.num_envs();
        check_actions(&self.spec, n, actions)?;
        self.action_bytes.clear();
        let width = match actions {
            VecActions::Discrete(a) => {
                self.action_bytes
                    .extend(a.iter().flat_map(|v| v.to_le_bytes()));
                8
            }
            VecActions::Continuous(a) => {
                self.action_bytes
                    .extend(a.iter().flat_map(|v| v.to_le_bytes()));
                4 * self.spec.action_space.dim()
            }
        };
        let step_timeout = Duration::from_secs_f64(self.launcher.section.step_timeout_s);
        let mut outcomes: Vec<Result<StepReply, Failure>> = Vec::with_capacity(self.slots.len());
        let mut sent = Vec::with_capacity(self.slots.len());
        for slot in &mut self.slots {
            let bytes = &self.action_bytes[slot.envs.start * width..slot.envs.end * width];
            sent.push(slot.worker.send(&StepRequest {
                op: "step",
                actions: serde_bytes::Bytes::new(bytes),
            }));
        }
        for (slot, sent) in self.slots.iter_mut().zip(sent) {
            outcomes.push(sent.and_then(|()| slot.worker.recv(step_timeout)));
        }

        self.buf.finished.clear();
        let mut faults = Vec::new();
        for (s, outcome) in outcomes.into_iter().enumerate() {
            let range = self.slots[s].envs.clone();
            let reply = match outcome.and_then(|r| self.check_reply(&range, r)) {
                Ok(reply) => reply,
                // The owner stops: no restart, the batch goes with it.
                Err(Failure::Cancelled) => {
                    return Err(failure_error(&self.launcher.env_id, Failure::Cancelled))
                }
                Err(failure) => {
                    faults.push(self.restart(s, failure)?);
                    continue;
                }
            };
            let failed: Vec<usize> = reply.failed.iter().map(|(i, _)| range.start + i).collect();
            for (i, traceback) in reply.failed {
                faults.push(Fault {
                    kind: FaultKind::Raised,
                    envs: vec![range.start + i],
                    detail: traceback,
                });
            }
            self.write_obs(&range, &reply.obs)?;
            self.write_masks(&range, reply.masks.as_ref().map(|m| &m[..]))?;
            self.write_movers(&range, reply.movers.as_ref().map(|m| &m[..]))?;
            let seats = self.spec.agents.len();
            let f64_at = |bytes: &[u8], j: usize| {
                f64::from_le_bytes(bytes[j * 8..j * 8 + 8].try_into().unwrap())
            };
            for (k, i) in range.clone().enumerate() {
                if failed.contains(&i) {
                    self.drop_episode(i);
                    continue;
                }
                // Multi-agent games: every seat's rewards; the env's own
                // reward and return are seat 0's.
                let reward = match &reply.seat_rewards {
                    Some(seat_rewards) => {
                        let (_, rewards, _, _) = self.buf.seats_mut();
                        for s in 0..seats {
                            let r = f64_at(seat_rewards, k * seats + s);
                            rewards[i * seats + s] = r;
                            self.seat_returns[i * seats + s] += r;
                        }
                        f64_at(seat_rewards, k * seats)
                    }
                    None => f64_at(&reply.rewards, k),
                };
                let terminated = reply.terminated[k] != 0;
                let truncated = reply.truncated[k] != 0;
                self.buf.rewards[i] = reward;
                self.buf.terminated[i] = terminated;
                self.buf.truncated[i] = truncated;
                self.returns[i] += reward;
                self.lengths[i] = self.lengths[i].saturating_add(1);
                if terminated || truncated {
                    let last = reply
                        .final_obs
                        .get(&k)
                        .ok_or_else(|| BridgeError::Protocol {
                            env_id: self.launcher.env_id.clone(),
                            detail: format!("env {k} ended without a final observation"),
                        })?;
                    let last = self.decode_obs(last, self.obs_dim * seats.max(1))?;
                    self.buf.set_final_obs(i, &last[..self.obs_dim]);
                    if seats > 0 {
                        let d = self.obs_dim;
                        let (_, _, returns, final_seat_obs) = self.buf.seats_mut();
                        returns[i * seats..(i + 1) * seats]
                            .copy_from_slice(&self.seat_returns[i * seats..(i + 1) * seats]);
                        final_seat_obs[i * seats * d..(i + 1) * seats * d].copy_from_slice(&last);
                        self.seat_returns[i * seats..(i + 1) * seats].fill(0.0);
                    }
                    // A finished game's last states are not acted in: no
                    // final masks for multi-agent games.
                    if let (Some(width), 0) = (self.mask_width(), seats) {
                        let mask = reply
                            .final_masks
                            .get(&k)
                            .filter(|m| m.len() == width)
                            .ok_or_else(|| BridgeError::Protocol {
                                env_id: self.launcher.env_id.clone(),
                                detail: format!("env {k} ended without a final action mask"),
                            })?;
                        self.buf.set_final_mask(i, mask);
                    }
                    self.buf.finished.push(FinishedEpisode {
                        env_index: i,
                        episode_return: self.returns[i],
                        length: self.lengths[i],
                        terminated,
                        truncated,
                    });
                    self.returns[i] = 0.0;
                    self.lengths[i] = 0;
                }
            }
        }
        if faults.is_empty() {
            Ok(&self.buf)
        } else {
            Err(BridgeError::Faulted { faults })
        }
    }

    /// An attribute of env `index`'s unwrapped env, as JSON (Gymnasium's
    /// `VectorEnv.get_attr` for one env; NumPy arrays become lists).
    pub fn get_attr(&mut self, index: usize, name: &str) -> Result<serde_json::Value, BridgeError> {
        let timeout = Duration::from_secs_f64(self.launcher.section.step_timeout_s);
        let slot = self
            .slots
            .iter_mut()
            .find(|s| s.envs.contains(&index))
            .ok_or(relay_envs::EnvError::ActionCount {
                expected: self.returns.len(),
                got: index + 1,
            })?;
        let request = GetAttrRequest {
            op: "get_attr",
            index: index - slot.envs.start,
            name,
        };
        let reply: AttrReply = slot
            .worker
            .call(&request, timeout)
            .map_err(|f| failure_error(&self.launcher.env_id, f))?;
        Ok(reply.value)
    }

    fn drop_episode(&mut self, i: usize) {
        self.buf.rewards[i] = 0.0;
        self.buf.terminated[i] = false;
        self.buf.truncated[i] = false;
        self.returns[i] = 0.0;
        self.lengths[i] = 0;
        let seats = self.spec.agents.len();
        self.seat_returns[i * seats..(i + 1) * seats].fill(0.0);
        let (_, rewards, _, _) = self.buf.seats_mut();
        rewards[i * seats..(i + 1) * seats].fill(0.0);
    }

    /// The seats to move in envs `range` (multi-agent games).
    fn write_movers(
        &mut self,
        range: &Range<usize>,
        bytes: Option<&[u8]>,
    ) -> Result<(), BridgeError> {
        let seats = self.spec.agents.len();
        if seats == 0 {
            return Ok(());
        }
        match bytes {
            Some(bytes)
                if bytes.len() == range.len() && bytes.iter().all(|&b| (b as usize) < seats) =>
            {
                let (movers, _, _, _) = self.buf.seats_mut();
                for (m, &b) in movers[range.clone()].iter_mut().zip(bytes) {
                    *m = u32::from(b);
                }
                Ok(())
            }
            other => Err(BridgeError::Protocol {
                env_id: self.launcher.env_id.clone(),
                detail: format!(
                    "movers of envs {}..{}: one seat below {seats} per env expected, got {:?}",
                    range.start,
                    range.end,
                    other.map(<[u8]>::len)
                ),
            }),
        }
    }

    fn check_reply(&self, range: &Range<usize>, reply: StepReply) -> Result<StepReply, Failure> {
        let k = range.len();
        let sizes = [
            (
                "obs",
                reply.obs.len(),
                k * self.obs_dim * self.obs_value_bytes(),
            ),
            match &reply.seat_rewards {
                Some(r) => ("seat_rewards", r.len(), k * 8 * self.spec.agents.len()),
                None => ("rewards", reply.rewards.len(), k * 8),
            },
            ("terminated", reply.terminated.len(), k),
            ("truncated", reply.truncated.len(), k),
        ];
        for (name, got, expected) in sizes {
            if got != expected {
                return Err(Failure::BadReply(format!(
                    "{name} has {got} bytes, expected {expected}"
                )));
            }
        }
        if let Some((i, _)) = reply.failed.iter().find(|(i, _)| *i >= k) {
            return Err(Failure::BadReply(format!("failed env {i} of {k}")));
        }
        Ok(reply)
    }

    /// Bytes per observation value on the pipe: images travel as uint8.
    fn obs_value_bytes(&self) -> usize {
        if self.spec.image.is_some() {
            1
        } else {
            4
        }
    }

    fn decode_obs(&self, bytes: &[u8], expected: usize) -> Result<Vec<f32>, BridgeError> {
        if self.spec.image.is_none() {
            return decode_f32(bytes, expected, &self.launcher.env_id);
        }
        if bytes.len() != expected {
            return Err(BridgeError::Protocol {
                env_id: self.launcher.env_id.clone(),
                detail: format!(
                    "{} bytes where {expected} pixels were expected",
                    bytes.len()
                ),
            });
        }
        Ok(bytes.iter().map(|&b| f32::from(b)).collect())
    }

    /// Actions per mask row, for an env with masks.
    fn mask_width(&self) -> Option<usize> {
        self.spec
            .action_mask
            .then(|| self.spec.action_space.n())
            .flatten()
    }

    /// The masks of envs `range` from a reply (the worker has checked that
    /// each allows an action).
    fn write_masks(
        &mut self,
        range: &Range<usize>,
        bytes: Option<&[u8]>,
    ) -> Result<(), BridgeError> {
        let Some(width) = self.mask_width() else {
            return Ok(());
        };
        let expected = range.len() * width;
        match bytes {
            Some(bytes) if bytes.len() == expected && bytes.iter().all(|&b| b <= 1) => {
                self.buf.masks_mut(range.clone()).copy_from_slice(bytes);
                Ok(())
            }
            other => Err(BridgeError::Protocol {
                env_id: self.launcher.env_id.clone(),
                detail: format!(
                    "action masks of envs {}..{}: {} bytes of 0/1 expected, got {:?} bytes",
                    range.start,
                    range.end,
                    expected,
                    other.map(<[u8]>::len)
                ),
            }),
        }
    }

    fn write_obs(&mut self, range: &Range<usize>, bytes: &[u8]) -> Result<(), BridgeError> {
        let d = self.obs_dim;
        let obs = self.decode_obs(bytes, range.len() * d)?;
        // The worker replaces a non-finite observation by a reset; one that
        // is still not finite comes from the reset itself: the env is broken.
        if let Some(j) = obs.iter().position(|x| !x.is_finite()) {
            return Err(BridgeError::Worker {
                env_id: self.launcher.env_id.clone(),
                message: format!(
                    "env {} returned a non-finite first observation after reset ({} at component {})",
                    range.start + j / d,
                    obs[j],
                    j % d
                ),
                traceback: String::new(),
            });
        }
        self.buf.obs[range.start * d..range.end * d].copy_from_slice(&obs);
        Ok(())
    }
}
