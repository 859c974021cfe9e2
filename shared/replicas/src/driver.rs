//! The replicated training loop's control flow, written once for every
//! trainer (the learner's on-policy, off-policy and text loops, and
//! `relay sft`): a trainer says what its state and its step are
//! ([`Replicated`]), and its loop calls two methods of [`Replicas`] each
//! turn:
//!
//! 1. [`Replicas::sync_view`]: at a new view rank 0's state goes to every
//!    replica (a joining one starts from the live parameters, optimizer
//!    state and counters; survivors of a failed step agree again).
//! 2. [`Replicas::run_step`]: rank 0 hands its step to the others (the
//!    step barrier), every replica runs its share of it from a snapshot,
//!    and a step that a failed replica or a stop interrupted is rolled
//!    back (and, after a failure, redone in the next view).
//!
//! What happens between the two (gathering data, publishing a version,
//! reporting, checkpoints) is the trainer's own, and only rank 0 does it.

use std::time::Instant;

use relay_kit::{ServiceError, Shutdown};
use relay_nn::BatchShare;
use serde::{de::DeserializeOwned, Serialize};

use crate::replicas::{Next, Replicas};

/// A trainer the replicas drive: its state, its step, and how it runs its
/// share of one.
pub trait Replicated {
    /// Everything a replica needs to go on where rank 0 is (parameters,
    /// optimizer moments, counters, RNG), and the rollback point of a
    /// step.
    type State: Serialize + DeserializeOwned;
    /// One step as rank 0 hands it to the others.
    type Step: Serialize + DeserializeOwned;
    /// What a step gives back.
    type Output;
    /// Why a step failed on its data.
    type Error: std::fmt::Display;

    /// Whether a step ends part-way when the trainer is stopping (its
    /// [`BatchShare`] then carries the stop check, and the step is undone
    /// as [`Self::UNDO`] says).
    const STOPS_PART_WAY: bool;

    /// How a step that did not finish (a replica failed in it, a stop cut
    /// it short, its data failed it) is undone.
    const UNDO: Undo;

    /// This replica's state.
    fn capture(&self) -> Result<Self::State, String>;

    /// Puts `state` (rank 0's, or a snapshot) back.
    fn restore(&mut self, state: Self::State) -> Result<(), String>;

    /// This replica became rank 0 in place of another, which may have
    /// published one version past the state any survivor holds.
    fn took_over(&mut self) {}

    /// `step` as the logs name it (the update's or round's number).
    fn describe(step: &Self::Step) -> String;

    /// Whether `step` is this replica's next: after a hand-over rank 0's
    /// state may already be past a step handed out before it, which is
    /// then not redone.
    fn is_next(&self, step: &Self::Step) -> bool;

    /// Runs this replica's share of `step`.
    fn run(
        &mut self,
        step: &Self::Step,
        share: &mut BatchShare<'_>,
    ) -> Result<Self::Output, Self::Error>;

    /// Whether `error` says the step stopped part-way (the trainer is
    /// stopping).
    fn stopped(error: &Self::Error) -> bool;

    /// Drops what an unfinished step accumulated ([`Undo::Discard`]).
    fn discard(&mut self) {}
}

/// How a trainer's unfinished step is undone.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Undo {
    /// From a snapshot taken before every step: the step applies parts of
    /// itself as it goes (epochs, minibatches).
    Snapshot,
    /// From a snapshot taken before every step of replicas only: alone,
    /// nothing interrupts a step, and one its data fails fails the
    /// trainer.
    SnapshotInGroup,
    /// By [`Replicated::discard`]: the step applies nothing before its
    /// last sum, so only what it accumulated goes (no copy of the weights
    /// per step, which for a whole model would cost more than the step).
    Discard,
}

/// How a turn of [`Replicas::run_step`] ended.
pub enum Turn<W: Replicated> {
    /// The step ran on every replica.
    Done { step: W::Step, output: W::Output },
    /// The step failed on its data and was undone (as
    /// [`Replicated::UNDO`] says; alone with [`Undo::SnapshotInGroup`] it
    /// is not): the trainer drops it or fails.
    Failed { step: W::Step, error: W::Error },
    /// No step this turn: the replicas re-formed, or rank 0's state was
    /// already past the step. The loop starts its turn again.
    Again,
    /// Shutdown came, rank 0 stopped training, or a stop cut the step
    /// short (it was rolled back).
    Stop,
}

impl Replicas {
    /// Moves to the newest view and, at a new one, hands rank 0's state
    /// to every replica. `Go(true)`: a new view was entered and its state
    /// is in `work`.
    pub async fn sync_view<W: Replicated>(
        &mut self,
        work: &mut W,
        shutdown: &Shutdown,
    ) -> Result<Next<bool>, ServiceError> {
        if !self.follow_view()? {
            return Ok(Next::Go(false));
        }
        if self.took_over() {
            work.took_over();
        }
        let mine = self
            .leads()
            .then(|| work.capture())
            .transpose()
            .map_err(ServiceError::other)?;
        Ok(match self.share_state(shutdown, mine).await? {
            Next::Go(Some(state)) => {
                work.restore(state)
                    .map_err(|e| ServiceError::other(format!("replicas: rank 0's state: {e}")))?;
                Next::Go(true)
            }
            Next::Go(None) => Next::Go(true),
            Next::Retry => Next::Retry,
            Next::Stop => Next::Stop,
        })
    }

    /// One step: rank 0 gives `Some(step)` (a step a failure interrupted
    /// waits in `held`, to be handed out again in the next view), the
    /// others `None` and wait for it; every replica then runs its share
    /// from a snapshot it rolls back to when a replica failed inside the
    /// step (then redone in the next view), a stop cut it short, or its
    /// data failed it.
    pub async fn run_step<W: Replicated>(
        &mut self,
        work: &mut W,
        step: Option<W::Step>,
        held: &mut Option<W::Step>,
        shutdown: &Shutdown,
    ) -> Result<Turn<W>, ServiceError> {
        let step = match self.exchange(shutdown, step, held).await? {
            Next::Go(step) => step,
            Next::Retry => return Ok(Turn::Again),
            Next::Stop => return Ok(Turn::Stop),
        };
        if !work.is_next(&step) {
            return Ok(Turn::Again);
        }
        // A copy of the parameters and the optimizer's moments, small
        // beside the step's own work.
        let snapshot = match W::UNDO {
            Undo::Snapshot => true,
            Undo::SnapshotInGroup => !self.alone(),
            Undo::Discard => false,
        }
        .then(|| work.capture())
        .transpose()
        .map_err(ServiceError::other)?;
        let started = Instant::now();
        let result = {
            // Not held across an await: the future stays `Send`.
            let stopping = || shutdown.is_triggered();
            let stop = W::STOPS_PART_WAY.then_some(&stopping as relay_nn::StopCheck<'_>);
            tokio::task::block_in_place(|| self.step(stop, |share| work.run(&step, share)))
        };
        let roll_back = |work: &mut W, snapshot: Option<W::State>| match snapshot {
            Some(state) => work.restore(state).map_err(ServiceError::other),
            None => {
                work.discard();
                Ok(())
            }
        };
        match result {
            Ok(Ok(output)) => Ok(Turn::Done { step, output }),
            Ok(Err(error)) if W::stopped(&error) => {
                // The final checkpoint holds the last whole step.
                roll_back(work, snapshot)?;
                tracing::info!(
                    step = %W::describe(&step),
                    seconds = started.elapsed().as_secs_f64(),
                    "update stopped part-way and rolled back"
                );
                Ok(Turn::Stop)
            }
            Ok(Err(error)) => {
                roll_back(work, snapshot)?;
                Ok(Turn::Failed { step, error })
            }
            Err(broken) => {
                tracing::warn!(error = %broken, step = %W::describe(&step), "a replica failed inside the step; rolling back and redoing it in the next view");
                roll_back(work, snapshot)?;
                *held = Some(step);
                Ok(if self.recover(shutdown).await? {
                    Turn::Again
                } else {
                    Turn::Stop
                })
            }
        }
    }
}
