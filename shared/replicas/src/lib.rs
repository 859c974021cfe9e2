//! Data-parallel trainer replicas (synchronous, as PyTorch's DDP): the
//! one driver of the learner's loops and of `relay sft --replicas`.
//! [`relay_nn::BatchShare`] is the one thing a trainer's step sees of it:
//! the replica's share of every minibatch, a sum of f32 buffers across
//! the replicas, and whether the trainer is stopping (a long step ends
//! early and the driver rolls it back). Alone, the share is the whole
//! batch; in a group, sums are ring all-reduces over a
//! [`relay_kit::collective::Group`] (membership and views over NATS, the
//! ring over direct TCP).
//!
//! | module | owns |
//! |---|---|
//! | [`driver`] | [`Replicated`] (what a trainer gives: its state, its step, its share of a step) and the loop's control flow, once: [`Replicas::sync_view`], [`Replicas::run_step`] |
//! | [`replicas`] | [`Replicas`]: a process's place in the group (join, views, state hand-over, step barrier, recovery, parameter digest) |
//! | [`group_share`] | [`in_group`]: a step's sums over one view, as a [`relay_nn::BatchShare`] |
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
//! Every algorithm's update takes a [`relay_nn::BatchShare`]: PPO and A2C (parts of
//! each minibatch or rollout, advantages normalised over all of it first),
//! REINFORCE (the advantages' mean and spread summed first), DQN (parts of
//! each sampled batch, drawn once so prioritized replay keeps its
//! distribution; every row's new priority summed back, so rank 0 sends the
//! whole batch's), SAC (each of its three optimizers summed, the whole
//! batch's noise drawn alike) and the
//! LLM trainers (parts of the micro-batches of `relay_llm::RlTrainer` and
//! `relay_llm::SftTrainer`).
//!
//! [`Replicas`] is a trainer process's side of it, the same sequence in
//! the on-policy loop (PPO, A2C, REINFORCE), the off-policy loop (DQN,
//! SAC), the text loop (LoRA GRPO, RLOO, PPO on tokens) and `relay sft`,
//! written once in [`driver`]: each joins
//! the run's group at start; at every new view rank 0's state goes to
//! every member ([`Replicas::share_state`]), so a joining replica starts
//! from the live parameters, optimizer state and counters; rank 0 gathers
//! each step's data (a rollout, a round's minibatches drawn once from the
//! replay buffer so that prioritized replay keeps its sampling
//! distribution, or a batch of games' examples) and hands it to the
//! others ([`Replicas::exchange`], the step barrier); all run the step
//! ([`Replicas::run_step`]), and a step a failure interrupted is rolled
//! back from the snapshot taken before it and redone in the next view. Rank 0
//! alone talks to the replay buffer, publishes versions and writes
//! checkpoints.
//!
//! Why this transport: membership, views and the barrier need agreement,
//! which JetStream's Raft already gives (a home-made consensus would be a
//! second one to trust); the gradients need bandwidth, which a ring over
//! direct TCP gives without passing through nats-server. PyTorch DDP on
//! CPUs uses gloo, whose default all-reduce is a ring (and halving-doubling)
//! over TCP with a rendezvous store (TCPStore, etcd) for membership;
//! Horovod used MPI or gloo rings with NCCL between GPUs, and elastic
//! Horovod re-forms after a failure and resumes from the last committed
//! state, as [`Replicas::recover`] does from the snapshot taken before each
//! step. Between GPUs NCCL's ring (cudarc's `nccl` feature) would replace
//! the TCP ring; it is not built yet, so CUDA replicas sum through the
//! host.
//!
//! The all-reduce waits for the whole backward pass: candle computes every
//! gradient in one `backward()` call, so there is no hook to start
//! reducing a finished bucket while later layers are still computing, as
//! DDP's bucketed reducer does. Gradients are one buffer per step.

pub mod driver;
pub mod group_share;
pub mod replicas;

pub use driver::{Replicated, Turn, Undo};
pub use group_share::{in_group, Reduced, Summed};
pub use replicas::{digest, Next, Replicas};
