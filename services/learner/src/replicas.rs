//! Data-parallel learner replicas (synchronous, as PyTorch's DDP): how a
//! gradient step's sums cross replicas. [`GradientSync`] is the one thing
//! an algorithm's update sees of it: the replica's share of every
//! minibatch and a sum of f32 buffers across the replicas. [`Alone`] is a
//! single learner; [`InGroup`] sums over a [`relay_kit::collective::Group`]
//! (membership and views over NATS, a ring all-reduce over direct TCP).
//!
//! Every replica holds the whole rollout and takes the `rank`-th of `N`
//! contiguous parts of each shuffled minibatch (the shuffle comes from the
//! RNG every replica holds alike), so the global batch is what the config
//! says whatever `N` is. Each part's loss is weighted by its share of the
//! minibatch, so the summed gradients are the whole minibatch's mean
//! gradient; the statistics that steer the update (approx KL for early
//! stopping) are summed the same way, so every replica takes the same
//! decisions, and all apply the same clipped step from the same bits.
//!
//! Every algorithm's update takes a [`GradientSync`]: PPO and A2C (parts of
//! each minibatch or rollout, advantages normalised over all of it first),
//! REINFORCE (the advantages' mean and spread summed first), DQN (parts of
//! each sampled batch, drawn once so prioritized replay keeps its
//! distribution; every row's new priority summed back), SAC (each of its
//! three optimizers summed, the whole batch's noise drawn alike) and the
//! LLM trainers (parts of the micro-batches of `relay_llm::RlTrainer` and
//! `relay_llm::SftTrainer`, through [`with_batch_share`]). The service
//! loops still run one learner ([`Alone`]); the replicas' processes, rank
//! 0's duties (sampling, publishing, checkpoints), the state handed to a
//! joining replica and re-forming after a failure come next (issue 46).
//!
//! The all-reduce waits for the whole backward pass: candle computes every
//! gradient in one `backward()` call, so there is no hook to start
//! reducing a finished bucket while later layers are still computing, as
//! DDP's bucketed reducer does. Gradients are one buffer per step.

use candle_core::backprop::GradStore;
use candle_core::{Tensor, Var};
use relay_kit::collective::{Group, View};

use crate::rollout::UpdateError;

/// How the learner's gradient steps combine across replicas (see the
/// module docs).
pub trait GradientSync: Send {
    /// This replica's rank and the number of replicas.
    fn share(&self) -> (usize, usize);

    /// Sums `data` elementwise across the replicas, in place; every
    /// replica ends with the same bits.
    fn sum(&mut self, data: &mut [f32]) -> Result<(), UpdateError>;
}

/// Runs `f` with `sync` as the pure crates see a replica
/// ([`relay_nn::BatchShare`]: its part of each batch, and the sum).
pub fn with_batch_share<R>(
    sync: &mut dyn GradientSync,
    f: impl FnOnce(&mut relay_nn::BatchShare<'_>) -> R,
) -> R {
    let (rank, replicas) = sync.share();
    let mut sum = |data: &mut [f32]| sync.sum(data).map_err(|e| e.to_string());
    let mut share = relay_nn::BatchShare {
        rank,
        replicas,
        sum: (replicas > 1).then_some(&mut sum as relay_nn::SumAcross<'_>),
    };
    f(&mut share)
}

/// The gradients of `loss` (`None`: an empty share, zeros) with respect to
/// `vars`, and `extra` (statistics the caller weighted as the loss), summed
/// across the replicas with `sync` ([`relay_nn::BatchShare::sum_gradients`]:
/// one buffer, one all-reduce). Alone, just `loss.backward()`.
pub fn summed_gradients(
    loss: Option<&Tensor>,
    vars: &[Var],
    sync: &mut dyn GradientSync,
    extra: &mut [f32],
) -> Result<GradStore, UpdateError> {
    let grads = loss.map(Tensor::backward).transpose()?;
    Ok(with_batch_share(sync, |share| {
        share.sum_gradients(grads, vars, extra)
    })?)
}

/// The `rank`-th of `n` contiguous, near-equal parts of `items`.
pub fn part<T>(items: &[T], share: (usize, usize)) -> &[T] {
    &items[part_range(items.len(), share)]
}

/// The rows of the `rank`-th of `n` contiguous, near-equal parts of `len` rows.
pub fn part_range(len: usize, (rank, n): (usize, usize)) -> std::ops::Range<usize> {
    rank * len / n..(rank + 1) * len / n
}

/// Checks that the replicas' summed shares (the `1.0` each weighted by its
/// share) cover a whole batch: replicas that hold different batches fail
/// here rather than train on a mixture.
pub fn check_covered(covered: f32) -> Result<(), UpdateError> {
    if (covered - 1.0).abs() > 1e-5 {
        return Err(UpdateError::Replicas(format!(
            "the replicas' parts cover {covered} of a batch, not all of it: \
             they hold different batches"
        )));
    }
    Ok(())
}

/// A learner on its own: its share is everything, sums are what it has.
#[derive(Debug, Default, Clone, Copy)]
pub struct Alone;

impl GradientSync for Alone {
    fn share(&self) -> (usize, usize) {
        (0, 1)
    }

    fn sum(&mut self, _data: &mut [f32]) -> Result<(), UpdateError> {
        Ok(())
    }
}

/// A replica of a data-parallel group in one agreed view: sums are ring
/// all-reduces among the view's members, tagged with consecutive step
/// numbers so that replicas out of step fail instead of mixing sums.
pub struct InGroup<'a> {
    group: &'a mut Group,
    view: View,
    rank: usize,
    /// The tag of the next sum.
    next_tag: u64,
    runtime: tokio::runtime::Handle,
}

impl<'a> InGroup<'a> {
    /// The group's replica in `view` (which must hold it); the first sum
    /// is tagged `first_tag`. Sums block the calling thread on `runtime`
    /// (the update runs in `block_in_place`).
    pub fn new(
        group: &'a mut Group,
        view: View,
        first_tag: u64,
        runtime: tokio::runtime::Handle,
    ) -> Result<Self, UpdateError> {
        let rank = view.rank_of(group.member()).ok_or_else(|| {
            UpdateError::Replicas(format!("{} is not in epoch {}", group.member(), view.epoch))
        })?;
        Ok(Self {
            group,
            view,
            rank,
            next_tag: first_tag,
            runtime,
        })
    }

    /// The tag the next sum will carry.
    pub fn next_tag(&self) -> u64 {
        self.next_tag
    }
}

impl GradientSync for InGroup<'_> {
    fn share(&self) -> (usize, usize) {
        (self.rank, self.view.size())
    }

    fn sum(&mut self, data: &mut [f32]) -> Result<(), UpdateError> {
        let tag = self.next_tag;
        self.next_tag += 1;
        self.runtime
            .block_on(self.group.all_reduce_sum(&self.view, tag, data))
            .map_err(|e| UpdateError::Replicas(e.to_string()))
    }
}
