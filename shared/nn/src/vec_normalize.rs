//! Running normalisation of observations and rewards, as Stable-Baselines3's
//! `VecNormalize`.
//!
//! - [`RunningMeanStd`]: count, mean and (population) variance of a stream
//!   of vectors, updated batch by batch with the parallel-merge formula of
//!   SB3's `update_from_moments` (Chan et al.), so statistics gathered by
//!   several env-runners can be merged ([`RunningMeanStd::combine`]) into
//!   exactly what one process would have seen.
//! - [`VecNormalize`]: observation normalisation
//!   `clip((obs - mean) / sqrt(var + epsilon), ±clip_obs)` and reward
//!   scaling `clip(r / sqrt(var_ret + epsilon), ±clip_reward)`, where
//!   `var_ret` is the running variance of each env's discounted return
//!   `ret = ret * gamma + r` (reset to 0 when the episode ends). Rewards are
//!   scaled, never shifted, as SB3 does. In frozen mode
//!   ([`VecNormalize::set_training`] `false`, for evaluation and for the
//!   inference server) nothing is updated.
//!
//! Statistics are f64 (as SB3's numpy arrays). They travel two ways:
//! serde (exact) and named f32 tensors ([`VecNormalize::named_tensors`],
//! prefixed, e.g. `vec_normalize.obs_rms.mean`) that can sit in the same
//! safetensors file or weight message as the model; the f32 form rounds
//! each statistic to f32 (relative error below 6e-8), which changes a
//! normalised observation by far less than f32 resolution of the model's
//! input needs.
//!
//! # Who calls what
//!
//! An env-runner that owns `num_envs` envs: [`VecNormalize::reset`] on the
//! first observations, then per step [`VecNormalize::step`] with the new
//! observations (after auto-reset), rewards and `dones = terminated ||
//! truncated`, and [`VecNormalize::normalize_obs`] on the final observation
//! of a truncated episode (no statistics update, as SB3 does with
//! `terminal_observation`). Several runners can each accumulate their own
//! statistics and ship them to the learner, which merges them with
//! [`RunningMeanStd::combine`] and publishes the result with the weights.
//!
//! For that, [`VecNormalize::track_delta`] makes a copy also gather the
//! statistics of what it sees since the last [`VecNormalize::take_delta`]
//! (the delta to ship), and [`VecNormalize::sync`] replaces its statistics
//! with newer global ones plus the delta not yet taken.
//!
//! Non-finite observations or rewards are refused with an error (before
//! any statistic changes): one NaN would poison the running mean forever.

use std::collections::HashMap;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::error::{NnError, Result};
use crate::io::{read_safetensors, write_safetensors, NamedTensor};
pub use relay_config::hyper::policy::NormalizeConfig;

/// `format` metadata of files written by [`VecNormalize::save`].
pub const VEC_NORMALIZE_FORMAT: &str = "relay-nn/vec-normalize";

/// Initial count of a fresh [`RunningMeanStd`] (SB3's `epsilon=1e-4`), so
/// the first update does not divide by zero and the prior (mean 0, var 1)
/// has negligible weight.
pub const RUNNING_MEAN_STD_INIT_COUNT: f64 = 1e-4;

/// Running mean and population variance of vectors of `dim` values.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RunningMeanStd {
    /// Mean of each component.
    pub mean: Vec<f64>,
    /// Population variance of each component.
    pub var: Vec<f64>,
    /// Number of vectors seen (plus the initial pseudo-count).
    pub count: f64,
}

impl RunningMeanStd {
    /// Fresh statistics as SB3's `RunningMeanStd(shape=(dim,))`: mean 0,
    /// variance 1, count [`RUNNING_MEAN_STD_INIT_COUNT`].
    pub fn new(dim: usize) -> Self {
        Self {
            mean: vec![0.0; dim],
            var: vec![1.0; dim],
            count: RUNNING_MEAN_STD_INIT_COUNT,
        }
    }

    /// Empty statistics (count 0): the neutral element of [`Self::combine`],
    /// for accumulating a delta to ship elsewhere.
    pub fn empty(dim: usize) -> Self {
        Self {
            mean: vec![0.0; dim],
            var: vec![0.0; dim],
            count: 0.0,
        }
    }

    /// Exact statistics of one batch of rows (`data` is `rows * dim`
    /// values, row-major): mean, population variance, count `rows`.
    pub fn from_batch(data: &[f32], dim: usize) -> Result<Self> {
        let (mean, var, count) = batch_moments(data, dim)?;
        Ok(Self { mean, var, count })
    }

    /// Number of components.
    pub fn dim(&self) -> usize {
        self.mean.len()
    }

    /// Adds a batch of rows (`data` is `rows * dim` values); an empty batch
    /// changes nothing.
    pub fn update(&mut self, data: &[f32]) -> Result<()> {
        let (mean, var, count) = batch_moments(data, self.dim())?;
        self.update_from_moments(&mean, &var, count)
    }

    /// Merges the moments of a batch (SB3's `update_from_moments`):
    ///
    /// ```text
    /// delta = batch_mean - mean,  tot = count + batch_count
    /// mean' = mean + delta * batch_count / tot
    /// var'  = (var * count + batch_var * batch_count + delta^2 * count * batch_count / tot) / tot
    /// ```
    pub fn update_from_moments(
        &mut self,
        batch_mean: &[f64],
        batch_var: &[f64],
        batch_count: f64,
    ) -> Result<()> {
        let d = self.dim();
        if batch_mean.len() != d || batch_var.len() != d {
            return Err(NnError::bad_input(
                "batch moments",
                format!("{d} means and variances"),
                format!("{} and {}", batch_mean.len(), batch_var.len()),
            ));
        }
        if !(batch_count.is_finite() && batch_count >= 0.0) {
            return Err(NnError::bad_input(
                "batch_count",
                "finite and >= 0",
                batch_count,
            ));
        }
        if batch_count == 0.0 {
            return Ok(());
        }
        let tot = self.count + batch_count;
        for i in 0..d {
            let delta = batch_mean[i] - self.mean[i];
            let m_a = self.var[i] * self.count;
            let m_b = batch_var[i] * batch_count;
            let m2 = m_a + m_b + delta * delta * self.count * batch_count / tot;
            self.mean[i] += delta * batch_count / tot;
            self.var[i] = m2 / tot;
        }
        self.count = tot;
        Ok(())
    }

    /// Merges `other` into `self` (SB3's `combine`); the result equals the
    /// statistics of both streams together.
    pub fn combine(&mut self, other: &RunningMeanStd) -> Result<()> {
        self.update_from_moments(&other.mean, &other.var, other.count)
    }

    /// Refuses non-finite means, negative or non-finite variances and counts.
    pub fn check_finite(&self, what: &'static str) -> Result<()> {
        let ok = self.count.is_finite()
            && self.count >= 0.0
            && self.mean.iter().all(|x| x.is_finite())
            && self.var.iter().all(|x| x.is_finite() && *x >= 0.0);
        if ok {
            Ok(())
        } else {
            Err(NnError::bad_input(
                what,
                "finite mean, non-negative finite var and count",
                format!("{self:?}"),
            ))
        }
    }
}

/// Mean, population variance (two-pass, f64) and row count of a batch.
fn batch_moments(data: &[f32], dim: usize) -> Result<(Vec<f64>, Vec<f64>, f64)> {
    if dim == 0 || !data.len().is_multiple_of(dim) {
        return Err(NnError::bad_input(
            "batch",
            format!("a multiple of {dim} values"),
            data.len(),
        ));
    }
    if let Some(i) = data.iter().position(|x| !x.is_finite()) {
        return Err(NnError::bad_input(
            "batch",
            "finite values",
            format!(
                "{} at index {i} (row {}, component {})",
                data[i],
                i / dim,
                i % dim
            ),
        ));
    }
    let rows = data.len() / dim;
    let mut mean = vec![0f64; dim];
    let mut var = vec![0f64; dim];
    if rows == 0 {
        return Ok((mean, var, 0.0));
    }
    for row in data.chunks_exact(dim) {
        for (m, &x) in mean.iter_mut().zip(row) {
            *m += x as f64;
        }
    }
    for m in &mut mean {
        *m /= rows as f64;
    }
    for row in data.chunks_exact(dim) {
        for ((v, &x), m) in var.iter_mut().zip(row).zip(&mean) {
            *v += (x as f64 - m).powi(2);
        }
    }
    for v in &mut var {
        *v /= rows as f64;
    }
    Ok((mean, var, rows as f64))
}

/// Observation and reward normalisation for `num_envs` envs (see module docs).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VecNormalize {
    /// Hyperparameters.
    pub config: NormalizeConfig,
    /// Statistics of the observations.
    pub obs_rms: RunningMeanStd,
    /// Statistics of the discounted returns (one component).
    pub ret_rms: RunningMeanStd,
    /// Each env's running discounted return.
    pub returns: Vec<f64>,
    /// Whether `reset` / `step` update the statistics (false: frozen).
    pub training: bool,
    /// Statistics gathered since the last [`Self::take_delta`], when
    /// tracked ([`Self::track_delta`]); absent otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub delta: Option<NormDelta>,
}

/// What one copy of [`VecNormalize`] saw since it last shipped its
/// statistics: the moments to merge into the global ones.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NormDelta {
    /// Observation statistics (count 0 when nothing was seen).
    pub obs_rms: RunningMeanStd,
    /// Discounted-return statistics (one component).
    pub ret_rms: RunningMeanStd,
}

impl NormDelta {
    /// Nothing seen yet.
    pub fn empty(obs_dim: usize) -> Self {
        Self {
            obs_rms: RunningMeanStd::empty(obs_dim),
            ret_rms: RunningMeanStd::empty(1),
        }
    }
}

impl VecNormalize {
    /// Fresh statistics for observations of `obs_dim` values from
    /// `num_envs` envs, in training mode.
    pub fn new(config: NormalizeConfig, obs_dim: usize, num_envs: usize) -> Result<Self> {
        config.validate()?;
        if obs_dim == 0 {
            return Err(NnError::config("obs_dim", "must be at least 1"));
        }
        Ok(Self {
            config,
            obs_rms: RunningMeanStd::new(obs_dim),
            ret_rms: RunningMeanStd::new(1),
            returns: vec![0.0; num_envs],
            training: true,
            delta: None,
        })
    }

    /// Length of one observation.
    pub fn obs_dim(&self) -> usize {
        self.obs_rms.dim()
    }

    /// Number of envs whose returns are tracked.
    pub fn num_envs(&self) -> usize {
        self.returns.len()
    }

    /// Whether statistics are being updated.
    pub fn training(&self) -> bool {
        self.training
    }

    /// `false` freezes the statistics (evaluation, inference).
    pub fn set_training(&mut self, training: bool) {
        self.training = training;
    }

    /// After the envs' (re)start: zeroes every running return, updates the
    /// observation statistics (when training) and normalises `obs`
    /// (`num_envs * obs_dim` values) in place.
    pub fn reset(&mut self, obs: &mut [f32]) -> Result<()> {
        self.returns.fill(0.0);
        self.observe(obs)
    }

    /// After one step of every env: `obs` (`num_envs * obs_dim`, after
    /// auto-reset), `rewards` and `dones` (`terminated || truncated`),
    /// `num_envs` each. Updates the statistics (when training), normalises
    /// `obs` and scales `rewards` in place, then zeroes the returns of the
    /// envs that are done (SB3's `step_wait`).
    pub fn step(&mut self, obs: &mut [f32], rewards: &mut [f32], dones: &[bool]) -> Result<()> {
        let n = self.num_envs();
        if obs.len() != n * self.obs_dim() {
            return Err(NnError::bad_input(
                "obs",
                format!("{n} x {} values", self.obs_dim()),
                obs.len(),
            ));
        }
        self.check_envs("rewards", rewards.len())?;
        self.check_envs("dones", dones.len())?;
        if let Some(i) = rewards.iter().position(|r| !r.is_finite()) {
            return Err(NnError::bad_input(
                "rewards",
                "finite values",
                format!("{} for env {i}", rewards[i]),
            ));
        }
        self.observe(obs)?;
        if self.training {
            for (ret, &r) in self.returns.iter_mut().zip(rewards.iter()) {
                *ret = *ret * self.config.gamma + r as f64;
            }
            // SB3 updates with the f64 returns; so do we.
            let (mean, var, count) = returns_moments(&self.returns);
            self.ret_rms.update_from_moments(&[mean], &[var], count)?;
            if let Some(delta) = &mut self.delta {
                delta.ret_rms.update_from_moments(&[mean], &[var], count)?;
            }
        }
        self.normalize_rewards(rewards);
        for (ret, &done) in self.returns.iter_mut().zip(dones) {
            if done {
                *ret = 0.0;
            }
        }
        Ok(())
    }

    fn check_envs(&self, what: &'static str, len: usize) -> Result<()> {
        if len != self.num_envs() {
            return Err(NnError::bad_input(
                what,
                format!("{} values (one per env)", self.num_envs()),
                len,
            ));
        }
        Ok(())
    }

    /// Updates the observation statistics with `obs` (any number of rows)
    /// when training and normalising observations, then normalises in place.
    /// Non-finite values are refused (nothing changes).
    pub fn observe(&mut self, obs: &mut [f32]) -> Result<()> {
        let d = self.obs_dim();
        if let Some(i) = obs.iter().position(|x| !x.is_finite()) {
            return Err(NnError::bad_input(
                "obs",
                "finite observations",
                format!(
                    "{} at index {i} (row {}, component {})",
                    obs[i],
                    i / d,
                    i % d
                ),
            ));
        }
        if self.training && self.config.norm_obs {
            let (mean, var, count) = batch_moments(obs, self.obs_dim())?;
            self.obs_rms.update_from_moments(&mean, &var, count)?;
            if let Some(delta) = &mut self.delta {
                delta.obs_rms.update_from_moments(&mean, &var, count)?;
            }
        } else {
            // Checks the width and finiteness.
            batch_moments(obs, self.obs_dim())?;
        }
        self.normalize_obs(obs);
        Ok(())
    }

    /// From now on, also gather what is seen into a delta
    /// ([`Self::take_delta`]); a delta already tracked is kept.
    pub fn track_delta(&mut self) {
        if self.delta.is_none() {
            self.delta = Some(NormDelta::empty(self.obs_dim()));
        }
    }

    /// The statistics gathered since the last call (or since
    /// [`Self::track_delta`]), leaving an empty delta; `None` when no delta
    /// is tracked.
    pub fn take_delta(&mut self) -> Option<NormDelta> {
        let dim = self.obs_dim();
        self.delta
            .as_mut()
            .map(|d| std::mem::replace(d, NormDelta::empty(dim)))
    }

    /// Adopts newer global statistics: `obs_rms` and `ret_rms` become the
    /// given ones merged with the delta not yet taken (so nothing this copy
    /// saw since it last shipped is lost). The running returns are kept.
    /// Statistics of another width or not finite are refused (nothing
    /// changes).
    pub fn sync(&mut self, obs_rms: &RunningMeanStd, ret_rms: &RunningMeanStd) -> Result<()> {
        if obs_rms.dim() != self.obs_dim() || ret_rms.dim() != 1 {
            return Err(NnError::bad_input(
                "statistics",
                format!("{} observation components and 1 return", self.obs_dim()),
                format!("{} and {}", obs_rms.dim(), ret_rms.dim()),
            ));
        }
        obs_rms.check_finite("obs_rms")?;
        ret_rms.check_finite("ret_rms")?;
        let (mut obs, mut ret) = (obs_rms.clone(), ret_rms.clone());
        if let Some(delta) = &self.delta {
            obs.combine(&delta.obs_rms)?;
            ret.combine(&delta.ret_rms)?;
        }
        self.obs_rms = obs;
        self.ret_rms = ret;
        Ok(())
    }

    /// Merges a delta shipped by another copy into these statistics (the
    /// learner's side of [`Self::take_delta`]). A delta of another width or
    /// with non-finite numbers is refused (nothing changes).
    pub fn merge(&mut self, delta: &NormDelta) -> Result<()> {
        if delta.obs_rms.dim() != self.obs_dim() || delta.ret_rms.dim() != 1 {
            return Err(NnError::bad_input(
                "delta",
                format!("{} observation components and 1 return", self.obs_dim()),
                format!("{} and {}", delta.obs_rms.dim(), delta.ret_rms.dim()),
            ));
        }
        delta.obs_rms.check_finite("delta.obs_rms")?;
        delta.ret_rms.check_finite("delta.ret_rms")?;
        self.obs_rms.combine(&delta.obs_rms)?;
        self.ret_rms.combine(&delta.ret_rms)?;
        Ok(())
    }

    /// `clip((obs - mean) / sqrt(var + epsilon), ±clip_obs)` in place, rows
    /// of `obs_dim` values, no statistics update; identity when `norm_obs`
    /// is off. A trailing partial row is left as it is.
    pub fn normalize_obs(&self, obs: &mut [f32]) {
        if !self.config.norm_obs {
            return;
        }
        let c = self.config.clip_obs;
        let inv_std: Vec<f64> = self
            .obs_rms
            .var
            .iter()
            .map(|v| 1.0 / (v + self.config.epsilon).sqrt())
            .collect();
        for row in obs.chunks_exact_mut(self.obs_dim()) {
            for ((x, m), s) in row.iter_mut().zip(&self.obs_rms.mean).zip(&inv_std) {
                *x = ((*x as f64 - m) * s).clamp(-c, c) as f32;
            }
        }
    }

    /// Inverse of [`Self::normalize_obs`] (without the clip), in place.
    pub fn unnormalize_obs(&self, obs: &mut [f32]) {
        if !self.config.norm_obs {
            return;
        }
        for row in obs.chunks_exact_mut(self.obs_dim()) {
            for ((x, m), v) in row
                .iter_mut()
                .zip(&self.obs_rms.mean)
                .zip(&self.obs_rms.var)
            {
                *x = (*x as f64 * (v + self.config.epsilon).sqrt() + m) as f32;
            }
        }
    }

    /// `clip(r / sqrt(var_ret + epsilon), ±clip_reward)` in place, no
    /// statistics update; identity when `norm_reward` is off.
    pub fn normalize_rewards(&self, rewards: &mut [f32]) {
        if !self.config.norm_reward {
            return;
        }
        let c = self.config.clip_reward;
        let scale = 1.0 / (self.ret_rms.var[0] + self.config.epsilon).sqrt();
        for r in rewards {
            *r = (*r as f64 * scale).clamp(-c, c) as f32;
        }
    }

    /// Inverse of [`Self::normalize_rewards`] (without the clip), in place.
    pub fn unnormalize_rewards(&self, rewards: &mut [f32]) {
        if !self.config.norm_reward {
            return;
        }
        let scale = (self.ret_rms.var[0] + self.config.epsilon).sqrt();
        for r in rewards {
            *r = (*r as f64 * scale) as f32;
        }
    }

    /// The statistics as named f32 tensors: `{prefix}obs_rms.mean` /
    /// `.var` (`[obs_dim]`), `{prefix}obs_rms.count` (`[1]`) and the same
    /// three for `ret_rms` (`[1]` each). Use a prefix such as
    /// `"vec_normalize."` to keep them apart from model parameters.
    pub fn named_tensors(&self, prefix: &str) -> Vec<NamedTensor> {
        let f = |v: &[f64]| v.iter().map(|&x| x as f32).collect::<Vec<f32>>();
        let d = self.obs_dim();
        vec![
            (
                format!("{prefix}obs_rms.count"),
                vec![1],
                vec![self.obs_rms.count as f32],
            ),
            (
                format!("{prefix}obs_rms.mean"),
                vec![d],
                f(&self.obs_rms.mean),
            ),
            (
                format!("{prefix}obs_rms.var"),
                vec![d],
                f(&self.obs_rms.var),
            ),
            (
                format!("{prefix}ret_rms.count"),
                vec![1],
                vec![self.ret_rms.count as f32],
            ),
            (
                format!("{prefix}ret_rms.mean"),
                vec![1],
                f(&self.ret_rms.mean),
            ),
            (
                format!("{prefix}ret_rms.var"),
                vec![1],
                f(&self.ret_rms.var),
            ),
        ]
    }

    /// Replaces the statistics from the tensors named `{prefix}...` (as
    /// written by [`Self::named_tensors`]); tensors with other names are
    /// ignored, so a whole checkpoint can be passed. All-or-nothing: a
    /// missing, misshapen or invalid statistic leaves `self` unchanged.
    pub fn load_named_tensors(&mut self, tensors: &[NamedTensor], prefix: &str) -> Result<()> {
        let get = |name: &str, len: usize| -> Result<Vec<f64>> {
            let full = format!("{prefix}{name}");
            let Some((_, shape, data)) = tensors.iter().find(|(n, _, _)| *n == full) else {
                return Err(NnError::MissingParameter {
                    name: full,
                    expected: vec![len],
                });
            };
            if shape.as_slice() != [len] || data.len() != len {
                return Err(NnError::ShapeMismatch {
                    name: full,
                    expected: vec![len],
                    got: shape.clone(),
                    detail: format!("; data has {} values", data.len()),
                });
            }
            Ok(data.iter().map(|&x| x as f64).collect())
        };
        let d = self.obs_dim();
        let obs_rms = RunningMeanStd {
            mean: get("obs_rms.mean", d)?,
            var: get("obs_rms.var", d)?,
            count: get("obs_rms.count", 1)?[0],
        };
        let ret_rms = RunningMeanStd {
            mean: get("ret_rms.mean", 1)?,
            var: get("ret_rms.var", 1)?,
            count: get("ret_rms.count", 1)?[0],
        };
        obs_rms.check_finite("obs_rms")?;
        ret_rms.check_finite("ret_rms")?;
        self.obs_rms = obs_rms;
        self.ret_rms = ret_rms;
        Ok(())
    }

    /// Writes the statistics (named tensors without prefix) to a safetensors
    /// file, with the exact f64 statistics (counts, means, variances) and
    /// the config in the metadata: [`Self::load`] gives back this
    /// normaliser to the bit, so a checkpoint's policy normalises exactly
    /// as the weights version it holds did.
    pub fn save(&self, path: impl AsRef<Path>) -> Result<()> {
        let c = &self.config;
        let meta: HashMap<String, String> = [
            ("format", VEC_NORMALIZE_FORMAT.to_string()),
            ("obs_rms.count", self.obs_rms.count.to_string()),
            ("ret_rms.count", self.ret_rms.count.to_string()),
            ("norm_obs", c.norm_obs.to_string()),
            ("norm_reward", c.norm_reward.to_string()),
            ("clip_obs", c.clip_obs.to_string()),
            ("clip_reward", c.clip_reward.to_string()),
            ("gamma", c.gamma.to_string()),
            ("epsilon", c.epsilon.to_string()),
            ("obs_rms.mean.f64", exact_list(&self.obs_rms.mean)),
            ("obs_rms.var.f64", exact_list(&self.obs_rms.var)),
            ("ret_rms.mean.f64", exact_list(&self.ret_rms.mean)),
            ("ret_rms.var.f64", exact_list(&self.ret_rms.var)),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
        write_safetensors(path.as_ref(), &self.named_tensors(""), meta)
    }

    /// Restores the statistics written by [`Self::save`] (the config is not
    /// restored: it comes from the experiment config; the statistics are
    /// exact, and the f32 tensors' when a file predates the exact ones).
    pub fn load(&mut self, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        let (tensors, meta) = read_safetensors(path)?;
        if meta.get("format").map(String::as_str) != Some(VEC_NORMALIZE_FORMAT) {
            return Err(NnError::Checkpoint {
                path: path.to_path_buf(),
                reason: format!(
                    "format is {:?}, expected `{VEC_NORMALIZE_FORMAT}`",
                    meta.get("format")
                ),
            });
        }
        let mut copy = self.clone();
        copy.load_named_tensors(&tensors, "")?;
        for (key, rms) in [
            ("obs_rms", &mut copy.obs_rms),
            ("ret_rms", &mut copy.ret_rms),
        ] {
            if let Some(c) = meta
                .get(&format!("{key}.count"))
                .and_then(|s| s.parse::<f64>().ok())
            {
                rms.count = c;
            }
            // Files written since the exact statistics were kept: the f64
            // values the f32 tensors round, so a loaded normaliser
            // normalises exactly as the one saved.
            for (field, values) in [("mean", &mut rms.mean), ("var", &mut rms.var)] {
                if let Some(exact) = meta
                    .get(&format!("{key}.{field}.f64"))
                    .and_then(|s| parse_exact_list(s, values.len()))
                {
                    *values = exact;
                }
            }
        }
        *self = copy;
        Ok(())
    }
}

/// f64 values as text that parses back to the same bits (Rust prints the
/// shortest representation that round-trips), comma-separated.
fn exact_list(values: &[f64]) -> String {
    values
        .iter()
        .map(f64::to_string)
        .collect::<Vec<_>>()
        .join(",")
}

/// Reads [`exact_list`]'s text of `len` finite values (`None` otherwise).
fn parse_exact_list(text: &str, len: usize) -> Option<Vec<f64>> {
    let values: Vec<f64> = text
        .split(',')
        .map(|v| v.parse::<f64>().ok().filter(|x| x.is_finite()))
        .collect::<Option<_>>()?;
    (values.len() == len).then_some(values)
}

/// Mean, population variance and count of the per-env returns.
fn returns_moments(returns: &[f64]) -> (f64, f64, f64) {
    let n = returns.len() as f64;
    if returns.is_empty() {
        return (0.0, 0.0, 0.0);
    }
    let mean = returns.iter().sum::<f64>() / n;
    let var = returns.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / n;
    (mean, var, n)
}

#[cfg(test)]
mod tests;
