//! SAC's gradient step: its hyperparameters ([`SacConfig`]), a batch of
//! transitions ([`SacBatch`]), the three Adams ([`SacOptimizers`]), the
//! losses ([`sac_ent_coef_loss`], [`sac_targets`], [`sac_critic_loss`],
//! [`sac_actor_loss`]) and the step that chains them in SB3's order
//! ([`sac_train_step`], [`sac_train_step_part`] for a learner replica's
//! share), with its [`SacStats`].
//!
//! Its own file because training is a separate idea from the networks
//! ([`super`]: spec, actor, twin critic, their acting and checkpoints),
//! which the inference side uses without it; re-exported there.

use std::sync::Arc;

use candle_core::{Device, Tensor, Var};
use rand::Rng;
use rand_distr::StandardNormal;
use serde::{Deserialize, Serialize};

use super::{ActorSample, Sac, SacSpec, TwinCritic};
use crate::error::{NnError, Result};
use crate::ops::{precomputed_loss, with_f32};
use crate::optim::{Adam, AdamConfig};
use crate::par::Pair;
use crate::share::BatchShare;

/// Hyperparameters of a SAC gradient step. Defaults are SB3's.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SacConfig {
    /// Polyak coefficient of the target critics. Default `0.005`.
    pub tau: f32,
    /// Tune `α` towards `target_entropy` (SB3 `ent_coef="auto"`). When
    /// `false`, `α` stays at the network's initial value. Default `true`.
    pub auto_entropy: bool,
    /// Entropy target; `None` is `-action_dim` (SB3 `"auto"`). Default `None`.
    pub target_entropy: Option<f32>,
    /// Learning rate of actor, critics and `log α` (Adam). Default `3e-4`.
    pub lr: f64,
    /// Polyak-update the target critics at the end of the step. SB3 does it
    /// every `target_update_interval` gradient steps; the caller, which
    /// counts them, sets this. Default `true` (every step, SB3's default).
    pub update_target: bool,
}

impl Default for SacConfig {
    fn default() -> Self {
        Self {
            tau: 0.005,
            auto_entropy: true,
            target_entropy: None,
            lr: 3e-4,
            update_target: true,
        }
    }
}

impl SacConfig {
    /// Checks ranges; the error names the field.
    pub fn validate(&self) -> Result<()> {
        if !(0.0..=1.0).contains(&self.tau) {
            return Err(NnError::config(
                "tau",
                format!("must be in [0, 1], got {}", self.tau),
            ));
        }
        if let Some(t) = self.target_entropy {
            if !t.is_finite() {
                return Err(NnError::config("target_entropy", "must be finite"));
            }
        }
        if !(self.lr.is_finite() && self.lr >= 0.0) {
            return Err(NnError::config(
                "lr",
                format!("must be >= 0, got {}", self.lr),
            ));
        }
        Ok(())
    }

    /// The entropy target for `action_dim` dimensions.
    pub fn target_entropy_for(&self, action_dim: usize) -> f32 {
        self.target_entropy.unwrap_or(-(action_dim as f32))
    }
}

/// One minibatch of `B` transitions for SAC (same conventions as [`crate::DqnBatch`]).
#[derive(Debug, Clone, Copy)]
pub struct SacBatch<'a> {
    /// `s_t`, `B * obs_dim` values.
    pub obs: &'a [f32],
    /// Actions taken, **env units**, `B * action_dim` values.
    pub actions: &'a [f32],
    /// n-step reward sums `R_t` (1-step: `r_t`).
    pub returns: &'a [f32],
    /// `s_{t+k}`, `B * obs_dim` values.
    pub next_obs: &'a [f32],
    /// `γ^k`, 0 after a termination (1-step: `γ (1 - terminated)`).
    pub discounts: &'a [f32],
}

/// The three Adam optimizers of SAC.
#[derive(Debug)]
pub struct SacOptimizers {
    /// Over the actor's vars.
    pub actor: Adam,
    /// Over both critics' vars.
    pub critic: Adam,
    /// Over `log α` (unused when entropy tuning is off).
    pub ent_coef: Adam,
}

impl SacOptimizers {
    /// Adam (PyTorch defaults but `lr = config.lr`, eps `1e-8`, as SB3) for each part.
    pub fn new(sac: &Sac, config: &SacConfig) -> Result<Self> {
        let cfg = AdamConfig {
            lr: config.lr,
            eps: 1e-8,
            ..AdamConfig::default()
        };
        Ok(Self {
            actor: Adam::new(sac.actor.vars(), cfg)?,
            critic: Adam::new(sac.critic.vars(), cfg)?,
            ent_coef: Adam::new(vec![sac.log_ent_coef.clone()], cfg)?,
        })
    }

    /// Sets the learning rate of all three (for a schedule).
    pub fn set_lr(&mut self, lr: f64) {
        self.actor.set_lr(lr);
        self.critic.set_lr(lr);
        self.ent_coef.set_lr(lr);
    }
}

/// Diagnostics of one [`sac_train_step`].
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct SacStats {
    /// Critic loss `0.5 Σ_i mean((Q_i - y)^2)`.
    pub critic_loss: f32,
    /// Actor loss `mean(α log π - min Q)`.
    pub actor_loss: f32,
    /// Entropy-coefficient loss (0 when not tuned).
    pub ent_coef_loss: f32,
    /// `α` used in this step (before its update).
    pub ent_coef: f32,
    /// Mean `log π(a|s)` of the fresh actions.
    pub logprob_mean: f32,
    /// Mean `Q_0(s, a)` of the replayed actions.
    pub q_mean: f32,
    /// Mean critic target.
    pub target_mean: f32,
}

/// `-log α * mean(log π + target_entropy)` (SB3's `ent_coef_loss`, with the
/// log-probs detached); returns the differentiable loss and its value.
pub fn sac_ent_coef_loss(
    log_ent_coef: &Var,
    logprob: &[f32],
    target_entropy: f32,
) -> Result<(Tensor, f32)> {
    let n = logprob.len().max(1) as f32;
    let m = logprob.iter().map(|lp| lp + target_entropy).sum::<f32>() / n;
    let loss = (log_ent_coef.as_tensor().sum_all()? * (-m as f64))?;
    let value = loss.to_scalar::<f32>()?;
    Ok((loss, value))
}

/// Critic targets `R + γ^k (min_i Q'_i(s', a') - α log π(a'|s'))` for
/// `next`, a fresh sample for the next states ([`SacActor::sample`](super::SacActor::sample) on
/// `batch.next_obs`); no graph. The two target critics run side by side on
/// `pair`.
pub fn sac_targets(
    sac: &Sac,
    batch: &SacBatch<'_>,
    next: &ActorSample,
    ent_coef: f32,
    pair: &Pair,
) -> Result<Vec<f32>> {
    let (d, a) = (sac.spec.obs_dim, sac.spec.action_dim());
    let b = batch.returns.len();
    let next_actions: Vec<f32> = with_f32(&next.actions, "sac_targets", |x| x.to_vec())?;
    let next_logprob: Vec<f32> = with_f32(&next.logprob, "sac_targets", |x| x.to_vec())?;
    if next_logprob.len() != b || batch.next_obs.len() != b * d {
        return Err(NnError::bad_input(
            "next",
            format!("a sample for {b} next states"),
            format!(
                "{} samples, {} next_obs values",
                next_logprob.len(),
                batch.next_obs.len()
            ),
        ));
    }
    let mut x = Vec::with_capacity(b * (d + a));
    for (o, act) in batch
        .next_obs
        .chunks_exact(d)
        .zip(next_actions.chunks_exact(a))
    {
        x.extend_from_slice(o);
        x.extend_from_slice(act);
    }
    let target = &sac.critic_target;
    let (q0, q1) = pair.join(|| target.q_host(0, &x, b), || target.q_host(1, &x, b));
    let (q0, q1) = (q0?, q1?);
    Ok((0..b)
        .map(|i| {
            let soft_v = q0[i].min(q1[i]) - ent_coef * next_logprob[i];
            batch.returns[i] + batch.discounts[i] * soft_v
        })
        .collect())
}

/// Checks a batch's lengths against the spec; returns `B`.
fn check_batch(spec: &SacSpec, batch: &SacBatch<'_>) -> Result<usize> {
    let (d, a) = (spec.obs_dim, spec.action_dim());
    let b = batch.returns.len();
    for (what, len, want) in [
        ("obs", batch.obs.len(), b * d),
        ("actions", batch.actions.len(), b * a),
        ("next_obs", batch.next_obs.len(), b * d),
        ("discounts", batch.discounts.len(), b),
    ] {
        if len != want {
            return Err(NnError::bad_input(
                what,
                format!("{want} values for {b} samples"),
                len,
            ));
        }
    }
    if b == 0 {
        return Err(NnError::bad_input(
            "returns",
            "a non-empty minibatch",
            "0 values",
        ));
    }
    Ok(b)
}

/// Critic `i`'s half of the critic loss `0.5 Σ_i mean((Q_i - y)^2)`: `0.5
/// mean((Q_i - y)^2)` on the replayed (env-unit) actions, differentiable in
/// critic `i`'s vars. Returns the loss, its value and `mean Q_i`.
pub fn sac_critic_loss(
    sac: &Sac,
    i: usize,
    batch: &SacBatch<'_>,
    targets: &[f32],
) -> Result<(Tensor, f32, f32)> {
    let b = check_batch(&sac.spec, batch)?;
    if targets.len() != b {
        return Err(NnError::bad_input(
            "targets",
            format!("{b} values"),
            targets.len(),
        ));
    }
    let (d, a) = (sac.spec.obs_dim, sac.spec.action_dim());
    let obs = Tensor::from_slice(batch.obs, (b, d), &Device::Cpu)?;
    let mut acts = batch.actions.to_vec();
    sac.actor.to_squashed(&mut acts);
    let acts = Tensor::from_vec(acts, (b, a), &Device::Cpu)?;
    let q = sac
        .critic
        .q_graph(i, &sac.critic.input(&obs, &acts)?, false)?;
    let qv: Vec<f32> = with_f32(&q, "sac_critic_loss", |x| x.to_vec())?;
    let mut grad = vec![0f32; b];
    let mut loss = 0f64;
    for ((g, q), y) in grad.iter_mut().zip(&qv).zip(targets) {
        let e = q - y;
        loss += 0.5 * (e as f64) * (e as f64) / b as f64;
        *g = e / b as f32;
    }
    let q_mean = qv.iter().sum::<f32>() / b as f32;
    let t = precomputed_loss(&q, loss as f32, grad)?;
    Ok((t, loss as f32, q_mean))
}

/// The actor loss `L_π = mean(α log π(a|s) - min_i Q_i(s, a))` of a fresh
/// sample ([`SacActor::sample`](super::SacActor::sample) on `obs: [B, obs_dim]`), differentiable in
/// the actor's vars only; returns the loss and its value.
///
/// The critics are held constant and enter only through each row's
/// `G = ∂L_π/∂a = -(1/B) ∂Q_m/∂a` (`m` the row's smaller critic; a tie
/// splits it, as autograd through `min` does), computed for both critics
/// side by side on `pair`. The returned graph is `mean(α log π) + Σ G ⊙ a`
/// with `G` constant: the same gradient with respect to the actor.
pub fn sac_actor_loss(
    critic: &TwinCritic,
    obs: &Tensor,
    sample: &ActorSample,
    ent_coef: f32,
    pair: &Pair,
) -> Result<(Tensor, f32)> {
    let actions: Vec<f32> = with_f32(&sample.actions, "sac_actor_loss", |x| x.to_vec())?;
    let logprob: Vec<f32> = with_f32(&sample.logprob, "sac_actor_loss", |x| x.to_vec())?;
    let b = logprob.len().max(1);
    let a = actions.len() / b;
    let (c0, c1) = pair.join(
        || critic.q_and_action_grad(0, obs, &actions),
        || critic.q_and_action_grad(1, obs, &actions),
    );
    let ((q0, g0), (q1, g1)) = (c0?, c1?);
    let mut grad = vec![0f32; actions.len()];
    let mut min_q_sum = 0f64;
    for r in 0..b {
        let (w0, w1) = match q0[r].partial_cmp(&q1[r]) {
            Some(std::cmp::Ordering::Less) => (1.0, 0.0),
            Some(std::cmp::Ordering::Greater) => (0.0, 1.0),
            _ => (0.5, 0.5),
        };
        min_q_sum += q0[r].min(q1[r]) as f64;
        for j in r * a..(r + 1) * a {
            grad[j] = -(w0 * g0[j] + w1 * g1[j]) / b as f32;
        }
    }
    let logprob_mean = logprob.iter().map(|&x| x as f64).sum::<f64>() / b as f64;
    let value = (ent_coef as f64 * logprob_mean - min_q_sum / b as f64) as f32;
    let entropy_term = (sample.logprob.mean_all()? * ent_coef as f64)?;
    let critic_term = precomputed_loss(&sample.actions, 0.0, grad)?;
    Ok(((entropy_term + critic_term)?, value))
}

/// One SAC gradient step on a minibatch, in SB3's order (see the module
/// docs): entropy coefficient, critics, actor, target critics. The twin
/// critics' halves of each stage (and the two samples of the actor) run
/// side by side on `pair`; the result does not depend on its threads.
pub fn sac_train_step(
    config: &SacConfig,
    sac: &Sac,
    opt: &mut SacOptimizers,
    batch: &SacBatch<'_>,
    rng: &mut impl Rng,
    pair: &Pair,
) -> Result<SacStats> {
    sac_train_step_part(config, sac, opt, batch, rng, pair, &mut BatchShare::whole())
}

/// [`sac_train_step`] on this replica's part of `batch` (`share`): every
/// replica draws the whole batch's noise from its RNG (they hold the same
/// one) and takes its rows; each loss is weighted by the part's share and
/// each optimizer's gradients are summed across replicas before its step,
/// so every replica steps alike. The statistics are the whole batch's.
pub fn sac_train_step_part(
    config: &SacConfig,
    sac: &Sac,
    opt: &mut SacOptimizers,
    batch: &SacBatch<'_>,
    rng: &mut impl Rng,
    pair: &Pair,
    share: &mut BatchShare<'_>,
) -> Result<SacStats> {
    config.validate()?;
    let whole = check_batch(&sac.spec, batch)?;
    let (d, a) = (sac.spec.obs_dim, sac.spec.action_dim());
    // Both samples' noise for the whole batch, in SB3's order: current
    // states, then next states; this part's rows of each.
    let mut noise = || -> Vec<f32> { (0..whole * a).map(|_| rng.sample(StandardNormal)).collect() };
    let (noise_now, noise_next) = (noise(), noise());
    let rows = share.rows(whole);
    let b = rows.len();
    let weight = b as f64 / whole.max(1) as f64;
    let part = SacBatch {
        obs: &batch.obs[rows.start * d..rows.end * d],
        actions: &batch.actions[rows.start * a..rows.end * a],
        returns: &batch.returns[rows.clone()],
        next_obs: &batch.next_obs[rows.start * d..rows.end * d],
        discounts: &batch.discounts[rows.clone()],
    };
    let alone = share.replicas == 1;
    let weighted =
        |loss: Tensor| -> Result<Tensor> { Ok(if alone { loss } else { (loss * weight)? }) };
    let ent_coef = sac.ent_coef()?;
    // The weighted statistics, summed at the end: critic loss, actor loss,
    // entropy coefficient loss, log-prob, Q, target, the share itself.
    let mut stats = [0f64; 7];
    if b == 0 {
        if config.auto_entropy {
            share.step(&mut opt.ent_coef, None)?;
        }
        share.step(&mut opt.critic, None)?;
        share.step(&mut opt.actor, None)?;
    } else {
        let obs = Tensor::from_slice(part.obs, (b, d), &Device::Cpu)?;
        let next_obs = Tensor::from_slice(part.next_obs, (b, d), &Device::Cpu)?;
        let noise_now: Arc<[f32]> = noise_now[rows.start * a..rows.end * a].into();
        let noise_next: Arc<[f32]> = noise_next[rows.start * a..rows.end * a].into();

        // 1. Fresh actions for the current states (graph kept for the actor
        //    loss) and, beside them, for the next states (the critic targets').
        let (sample, next) = pair.join(
            || sac.actor.sample_noise(&obs, noise_now),
            || sac.actor.sample_noise(&next_obs, noise_next),
        );
        let (sample, next) = (sample?, next?);
        let logprob: Vec<f32> = with_f32(&sample.logprob, "sac_train_step", |x| x.to_vec())?;

        // 2. Entropy coefficient: use the current α, then update log α.
        if config.auto_entropy {
            let target = config.target_entropy_for(sac.spec.action_dim());
            let (loss, value) = sac_ent_coef_loss(&sac.log_ent_coef, &logprob, target)?;
            let grads = weighted(loss)?.backward()?;
            share.step(&mut opt.ent_coef, Some(grads))?;
            stats[2] = value as f64;
        }

        // 3. Critics towards the soft targets, each critic's loss and
        //    backward on its own thread, one Adam step over both.
        let targets = sac_targets(sac, &part, &next, ent_coef, pair)?;
        let half = |i: usize| -> Result<_> {
            let (loss, value, q_mean) = sac_critic_loss(sac, i, &part, &targets)?;
            Ok((weighted(loss)?.backward()?, value, q_mean))
        };
        let (c0, c1) = pair.join(|| half(0), || half(1));
        let ((mut grads, value0, q_mean), (grads1, value1, _)) = (c0?, c1?);
        grads.extend(grads1)?;
        share.step(&mut opt.critic, Some(grads))?;

        // 4. Actor against the updated critics.
        let (actor_loss, actor_value) = sac_actor_loss(&sac.critic, &obs, &sample, ent_coef, pair)?;
        share.step(&mut opt.actor, Some(weighted(actor_loss)?.backward()?))?;

        stats[0] = (value0 + value1) as f64;
        stats[1] = actor_value as f64;
        stats[3] = logprob.iter().map(|&x| x as f64).sum::<f64>() / b as f64;
        stats[4] = q_mean as f64;
        stats[5] = targets.iter().map(|&x| x as f64).sum::<f64>() / b as f64;
        stats[6] = 1.0;
    }
    let mut summed = stats.map(|x| (x * weight) as f32);
    share.sum(&mut summed)?;
    BatchShare::check_covered(summed[6])?;

    // 5. Target critics.
    if config.update_target {
        sac.critic_target.soft_update(&sac.critic, config.tau)?;
    }

    Ok(SacStats {
        critic_loss: summed[0],
        actor_loss: summed[1],
        ent_coef_loss: summed[2],
        ent_coef,
        logprob_mean: summed[3],
        q_mean: summed[4],
        target_mean: summed[5],
    })
}
