//! Acting without a graph: [`ActorCritic::act`], [`ActorCritic::act_masked`],
//! [`ActorCritic::act_recurrent`], [`ActorCritic::values`] and
//! [`ActorCritic::values_recurrent`] read the `Var`s in place and run the
//! dense kernels (or, off the CPU, the training graph's heads without a
//! backward), then sample, score and value the actions on the host.
//!
//! The inference half of the model's two forward paths (module docs of
//! [`super`]); the training half, [`ActorCritic::evaluate`] and its
//! variants, stays beside the parameters it builds its graph from.

use std::borrow::Cow;

use candle_core::{DType, Tensor};
use rand::Rng;
use rand_distr::StandardNormal;

use super::{continuous_masks, ActOutput, Actions, ActorCritic, TrunkLayout, HOST_CHUNK_FLOATS};
use crate::error::{NnError, Result};
use crate::gsde;
use crate::layers::{dense_host, mlp_host, trunk_host, HOST_KERNEL_MAX_BATCH};
use crate::ops::{self, check_masks, masked_argmax, HALF_LN_2PI};
use crate::spec::ActionKind;

/// How [`ActorCritic::act_step`] picks each row's action.
#[derive(Clone, Copy)]
enum Draw<'a> {
    /// The distribution's mode (arg-max, or the mean).
    Mode,
    /// A sample from the `rng` (gSDE: a fresh exploration matrix per row).
    Sample,
    /// A sample with gSDE's held noise: each row's exploration matrix is
    /// the one its seed stands for ([`gsde::exploration_matrix`]).
    Seeded(&'a [u64]),
}

impl Draw<'_> {
    fn of(deterministic: bool) -> Self {
        if deterministic {
            Self::Mode
        } else {
            Self::Sample
        }
    }
}

/// The heads of `n` rows on the host: the policy head `[n, head]` (empty
/// when only values were asked for), the values `[n]`, and the actor's
/// latent `[n, latent]` where gSDE reads it (else empty).
struct HostHeads {
    head: Vec<f32>,
    values: Vec<f32>,
    latent: Vec<f32>,
}

impl ActorCritic {
    fn check_obs(&self, obs: &[f32], n: usize) -> Result<()> {
        if obs.len() != n * self.spec.obs_dim {
            return Err(NnError::bad_input(
                "obs",
                format!(
                    "{n} x {} = {} values",
                    self.spec.obs_dim,
                    n * self.spec.obs_dim
                ),
                format!("{} values", obs.len()),
            ));
        }
        Ok(())
    }

    /// Policy-head output (logits or means), `[n, head]`, and values `[n]`, no graph.
    ///
    /// Large batches run in chunks whose activations stay at or below
    /// [`HOST_CHUNK_FLOATS`] floats: with glibc's default malloc, blocks of
    /// 128 KiB and more are mmapped (or trimmed back to the OS) and freshly
    /// page-faulted on every call, which made a 512-row `act` 1.8x slower.
    fn infer(&self, obs: &[f32], n: usize, actor: bool) -> Result<HostHeads> {
        if !ops::fused_on(self.device()) {
            return self.infer_on_device(obs, n);
        }
        let features;
        let obs = match &self.cnn {
            Some(cnn) => {
                features = cnn.host(obs, n)?;
                &features[..]
            }
            None => obs,
        };
        let (act, d) = (self.spec.activation, self.spec.features_dim());
        let widest = self
            .spec
            .hidden
            .iter()
            .copied()
            .chain([d])
            .max()
            .unwrap_or(d);
        let chunk_rows = (HOST_CHUNK_FLOATS / widest).max(HOST_KERNEL_MAX_BATCH + 1);
        let head_w = self.spec.action.head_width();
        let mut head = Vec::with_capacity(if actor { n * head_w } else { 0 });
        let mut values = Vec::with_capacity(n);
        let mut latent = Vec::new();
        for chunk in obs.chunks(chunk_rows * d) {
            let rows = chunk.len() / d;
            if self.layout == TrunkLayout::Shared {
                let (h, width) = trunk_host(&self.policy_net, act, chunk, rows, d)?;
                if actor {
                    head.extend(dense_host(
                        &self.action_net,
                        Cow::Borrowed(&h),
                        rows,
                        width,
                        None,
                    )?);
                    if self.spec.use_sde {
                        latent.extend_from_slice(&h);
                    }
                }
                values.extend(dense_host(&self.value_head, h, rows, width, None)?);
                continue;
            }
            if actor {
                let (h, z) = self.actor_host(chunk, rows, d)?;
                head.extend(h);
                latent.extend(z);
            }
            values.extend(mlp_host(
                &self.value_net,
                &self.value_head,
                act,
                chunk,
                rows,
                d,
            )?);
        }
        Ok(HostHeads {
            head,
            values,
            latent,
        })
    }

    /// The actor's head on `n` rows of `x` (`in_dim` values each) through
    /// its own hidden layers, and their output where gSDE reads it (else
    /// empty).
    fn actor_host(&self, x: &[f32], n: usize, in_dim: usize) -> Result<(Vec<f32>, Vec<f32>)> {
        let act = self.spec.activation;
        if !self.spec.use_sde {
            let head = mlp_host(&self.policy_net, &self.action_net, act, x, n, in_dim)?;
            return Ok((head, Vec::new()));
        }
        let (h, width) = trunk_host(&self.policy_net, act, x, n, in_dim)?;
        let latent = h.into_owned();
        let head = dense_host(&self.action_net, Cow::Borrowed(&latent), n, width, None)?;
        Ok((head, latent))
    }

    /// The graph's heads read back to the host.
    fn heads_to_host(&self, heads: super::Heads) -> Result<HostHeads> {
        let host = |t: Tensor| -> Result<Vec<f32>> { Ok(t.detach().flatten_all()?.to_vec1()?) };
        Ok(HostHeads {
            head: host(heads.policy)?,
            values: host(heads.value)?,
            latent: if self.spec.use_sde {
                host(heads.latent)?
            } else {
                Vec::new()
            },
        })
    }

    /// [`Self::infer`] off the fused path: the graph forward on the
    /// parameters' device, one upload of the observations and one read-back
    /// of the head and the values.
    fn infer_on_device(&self, obs: &[f32], n: usize) -> Result<HostHeads> {
        let x = Tensor::from_slice(obs, (n, self.spec.obs_dim), self.device())?;
        self.heads_to_host(self.heads_graph(&x)?)
    }

    /// Chooses actions for `n` observations (`obs` is `n * obs_dim` values,
    /// row-major) and returns them with their log-probabilities and the
    /// critic's values. No gradient graph is built.
    ///
    /// Discrete: samples the categorical over the logits by inverse CDF with
    /// one `rng` draw per observation; `deterministic` takes the arg-max
    /// (first on ties). Continuous: `mean + exp(log_std) * N(0, 1)` (one
    /// standard normal draw per dimension), or with gSDE `mean + z (S ∘ E)`
    /// with a fresh exploration matrix `E` per row ([`crate::gsde`];
    /// [`Self::act_explore`] holds it); `deterministic` returns the mean.
    /// Continuous actions are **not** clipped to the bounds (see module docs).
    ///
    /// [`Self::act_masked`] with no masks.
    pub fn act(
        &self,
        obs: &[f32],
        n: usize,
        deterministic: bool,
        rng: &mut impl Rng,
    ) -> Result<ActOutput> {
        self.act_masked(obs, n, None, deterministic, rng)
    }

    /// [`Self::act`] restricted to the legal actions of each observation:
    /// `masks` is `n * n_actions` bytes row-major, 1 legal, 0 illegal
    /// (checked as [`check_masks`]: a row with no legal action is an error
    /// naming the row).
    ///
    /// Sampling draws from the categorical over the legal actions and the
    /// returned log-probability is that of this masked distribution (the
    /// one [`Self::evaluate_masked`] scores, where [`ops::mask_logits`]
    /// replaces the illegal logits by [`ops::MASKED_LOGIT`]). An illegal
    /// action is never chosen: neither sampled nor taken by
    /// `deterministic`'s arg-max, which is the first legal maximum, decided
    /// by the mask even where legal logits tie with the masked value. Same
    /// `rng` draws as [`Self::act`]. `Some` masks for a continuous policy
    /// are an error.
    pub fn act_masked(
        &self,
        obs: &[f32],
        n: usize,
        masks: Option<&[u8]>,
        deterministic: bool,
        rng: &mut impl Rng,
    ) -> Result<ActOutput> {
        self.check_feed_forward("act")?;
        self.act_step(obs, n, None, masks, Draw::of(deterministic), rng)
    }

    /// [`Self::act_masked`] of a recurrent policy: `state` holds each row's
    /// recurrent state ([`Self::state_width`] values a row; zeros at an
    /// episode's start) and is advanced past this step in place. On a
    /// feed-forward policy `state` must be empty and this is
    /// [`Self::act_masked`].
    pub fn act_recurrent(
        &self,
        obs: &[f32],
        n: usize,
        state: &mut [f32],
        masks: Option<&[u8]>,
        deterministic: bool,
        rng: &mut impl Rng,
    ) -> Result<ActOutput> {
        self.check_state(state, n)?;
        let state = (self.cores.is_some()).then_some(state);
        self.act_step(obs, n, state, masks, Draw::of(deterministic), rng)
    }

    /// [`Self::act_recurrent`], sampling with gSDE's held noise
    /// ([`crate::gsde`]): row `r`'s exploration matrix is the one
    /// `noise_seeds[r]` stands for, so an env that sends the same seed
    /// for several steps keeps its noise, whichever server acts it. A
    /// policy without `use_sde` ignores the seeds and samples as
    /// [`Self::act_recurrent`] does.
    pub fn act_explore(
        &self,
        obs: &[f32],
        n: usize,
        state: &mut [f32],
        masks: Option<&[u8]>,
        noise_seeds: &[u64],
        rng: &mut impl Rng,
    ) -> Result<ActOutput> {
        if noise_seeds.len() != n {
            return Err(NnError::bad_input(
                "noise_seeds",
                format!("{n} seeds, one a row"),
                format!("{} seeds", noise_seeds.len()),
            ));
        }
        self.check_state(state, n)?;
        let state = (self.cores.is_some()).then_some(state);
        self.act_step(obs, n, state, masks, Draw::Seeded(noise_seeds), rng)
    }

    /// `state` holds `n` rows of [`Self::state_width`] finite values.
    fn check_state(&self, state: &[f32], n: usize) -> Result<()> {
        let width = self.state_width();
        if state.len() != n * width {
            return Err(NnError::bad_input(
                "state",
                format!("{n} x {width} = {} values", n * width),
                format!("{} values", state.len()),
            ));
        }
        if let Some(bad) = state.iter().find(|v| !v.is_finite()) {
            return Err(NnError::bad_input("state", "finite values", bad));
        }
        Ok(())
    }

    /// Acting on `n` rows, advancing `state` for a recurrent policy.
    fn act_step(
        &self,
        obs: &[f32],
        n: usize,
        state: Option<&mut [f32]>,
        masks: Option<&[u8]>,
        draw: Draw<'_>,
        rng: &mut impl Rng,
    ) -> Result<ActOutput> {
        self.check_obs(obs, n)?;
        self.check_host_masks(masks, n)?;
        let HostHeads {
            head,
            values,
            latent,
        } = match state {
            Some(state) => self.infer_recurrent(obs, n, state)?,
            None => self.infer(obs, n, true)?,
        };
        let deterministic = matches!(draw, Draw::Mode);
        let mut logprobs = Vec::with_capacity(n);
        let actions = match &self.spec.action {
            ActionKind::Discrete { n: k } => {
                let k = *k;
                let mut lsm = vec![0f32; k];
                let mut actions = Vec::with_capacity(n);
                for (r, row) in head.chunks_exact(k).enumerate() {
                    let mask = masks.map(|m| &m[r * k..(r + 1) * k]);
                    ops::masked_log_softmax_row(row, mask, &mut lsm);
                    let a = if deterministic {
                        masked_argmax(&lsm, mask)
                    } else {
                        sample_categorical(&lsm, mask, rng.random::<f32>())
                    };
                    actions.push(a as i64);
                    logprobs.push(lsm[a]);
                }
                Actions::Discrete(actions)
            }
            ActionKind::Continuous { dim, .. } if self.spec.use_sde => {
                let (dim, l) = (*dim, self.spec.sde_latent_dim());
                let std: Vec<f32> = self.log_std_values()?.iter().map(|s| s.exp()).collect();
                let mut actions = Vec::with_capacity(n * dim);
                for (r, (mean, z)) in head
                    .chunks_exact(dim)
                    .zip(latent.chunks_exact(l))
                    .enumerate()
                {
                    let eps: Option<Vec<f32>> = match draw {
                        Draw::Mode => None,
                        Draw::Sample => Some(
                            (0..l * dim)
                                .map(|_| rng.sample::<f32, _>(StandardNormal))
                                .collect(),
                        ),
                        Draw::Seeded(seeds) => Some(gsde::exploration_matrix(seeds[r], l, dim)),
                    };
                    logprobs.push(gsde::act_row(mean, z, &std, eps.as_deref(), &mut actions));
                }
                Actions::Continuous(actions)
            }
            ActionKind::Continuous { dim, .. } => {
                let dim = *dim;
                let log_std = self.log_std_values()?;
                let std: Vec<f32> = log_std.iter().map(|s| s.exp()).collect();
                let norm: f32 = log_std.iter().sum::<f32>() + HALF_LN_2PI * dim as f32;
                let mut actions = Vec::with_capacity(n * dim);
                for mean in head.chunks_exact(dim) {
                    let mut q = 0f32;
                    for (&m, &s) in mean.iter().zip(&std) {
                        let eps: f32 = if deterministic {
                            0.0
                        } else {
                            rng.sample(StandardNormal)
                        };
                        actions.push(m + s * eps);
                        q += eps * eps;
                    }
                    logprobs.push(-0.5 * q - norm);
                }
                Actions::Continuous(actions)
            }
        };
        Ok(ActOutput {
            actions,
            logprobs,
            values,
        })
    }

    /// Checks `n` rows of host masks against the action space: none, or
    /// [`check_masks`] for a discrete policy; masks for a continuous one are
    /// an error.
    fn check_host_masks(&self, masks: Option<&[u8]>, n: usize) -> Result<()> {
        let Some(masks) = masks else { return Ok(()) };
        match self.spec.action {
            ActionKind::Discrete { n: k } => check_masks(masks, n, k),
            ActionKind::Continuous { .. } => Err(continuous_masks(masks.len())),
        }
    }

    /// Critic values `V(s)` of `n` observations (`n * obs_dim` values), no graph.
    pub fn values(&self, obs: &[f32], n: usize) -> Result<Vec<f32>> {
        self.check_feed_forward("values")?;
        self.check_obs(obs, n)?;
        Ok(self.infer(obs, n, false)?.values)
    }

    /// [`Self::values`] of a recurrent policy, advancing `state` (as
    /// [`Self::act_recurrent`]).
    pub fn values_recurrent(&self, obs: &[f32], n: usize, state: &mut [f32]) -> Result<Vec<f32>> {
        if self.cores.is_none() {
            return self.values(obs, n);
        }
        self.check_obs(obs, n)?;
        self.check_state(state, n)?;
        Ok(self.infer_recurrent(obs, n, state)?.values)
    }

    /// One step of a recurrent policy on `n` rows without a graph: head and
    /// values, `state` advanced in place.
    fn infer_recurrent(&self, obs: &[f32], n: usize, state: &mut [f32]) -> Result<HostHeads> {
        let cores = self.cores.as_ref().expect("a recurrent policy");
        if !ops::fused_on(self.device()) {
            let x = Tensor::from_slice(obs, (n, self.spec.obs_dim), self.device())?;
            let keep = Tensor::ones((1, n, 1), DType::F32, self.device())?;
            let initial = Tensor::from_slice(state, (n, cores.state_width()), self.device())?;
            let (heads, last) = self.heads_sequence_graph(&x, 1, n, &keep, &initial)?;
            state.copy_from_slice(&last.detach().flatten_all()?.to_vec1::<f32>()?);
            return self.heads_to_host(heads);
        }
        let features;
        let x = match &self.cnn {
            Some(cnn) => {
                features = cnn.host(obs, n)?;
                &features[..]
            }
            None => obs,
        };
        let (d, sw) = (self.spec.features_dim(), cores.state_width());
        let hidden = cores.actor.hidden();
        let actor_in = cores.actor.step_host(x, n, d, state, sw, 0)?;
        let act = self.spec.activation;
        match &cores.critic {
            Some(critic) => {
                let critic_in = critic.step_host(x, n, d, state, sw, cores.actor.state_width())?;
                let (head, latent) = self.actor_host(&actor_in, n, hidden)?;
                Ok(HostHeads {
                    head,
                    values: mlp_host(
                        &self.value_net,
                        &self.value_head,
                        act,
                        &critic_in,
                        n,
                        hidden,
                    )?,
                    latent,
                })
            }
            None => {
                let (h, width) = trunk_host(&self.policy_net, act, &actor_in, n, hidden)?;
                Ok(HostHeads {
                    head: dense_host(&self.action_net, Cow::Borrowed(&h), n, width, None)?,
                    latent: if self.spec.use_sde {
                        h.to_vec()
                    } else {
                        Vec::new()
                    },
                    values: dense_host(&self.value_head, h, n, width, None)?,
                })
            }
        }
    }

    fn log_std_values(&self) -> Result<Vec<f32>> {
        let v = self
            .log_std
            .as_ref()
            .ok_or_else(|| candle_core::Error::Msg("discrete policy has no log_std".into()))?;
        Ok(v.as_tensor().flatten_all()?.to_vec1()?)
    }
}

/// Inverse CDF: the first index whose cumulative probability exceeds `u`
/// (`u` uniform in `[0, 1)`); rounding slack goes to the last action with
/// non-zero probability. With a `mask`, illegal actions are skipped (their
/// probability counts as 0 whatever `log_probs` says), so one is never
/// returned when the row has a legal action.
fn sample_categorical(log_probs: &[f32], mask: Option<&[u8]>, u: f32) -> usize {
    let legal = |i: usize| mask.is_none_or(|m| m[i] != 0);
    let mut cum = 0f32;
    let mut last = (0..log_probs.len()).find(|&i| legal(i)).unwrap_or(0);
    for (i, &lp) in log_probs.iter().enumerate() {
        if !legal(i) {
            continue;
        }
        let p = lp.exp();
        if p > 0.0 {
            last = i;
        }
        cum += p;
        if u < cum {
            return i;
        }
    }
    last
}
