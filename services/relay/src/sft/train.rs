//! One training as a replica runs it ([`TrainingSession::train`]): the
//! examples' order per epoch, each optimizer step's share through the
//! replica driver (`relay_replicas`, as the learner's replicas), and each
//! epoch's figures.

use std::time::Instant;

use anyhow::{bail, Result};
use rand::seq::SliceRandom;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use relay_llm::sft::{SftExample, SftStats, SftTrainer};
use relay_llm::{CausalLm, LoraAdapter};
use relay_replicas::{Next, Replicated, Turn, Undo};
use serde::{Deserialize, Serialize};

use super::args::SftArgs;
use super::team::Team;

/// One epoch's figures.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EpochReport {
    pub epoch: usize,
    pub steps: usize,
    pub train_loss: f64,
    pub train_token_accuracy: f64,
    pub holdout_loss: Option<f64>,
    pub holdout_token_accuracy: Option<f64>,
    pub seconds: f64,
}

fn mean_stats(stats: &[SftStats]) -> (f64, f64) {
    let tokens: usize = stats.iter().map(|s| s.tokens).sum::<usize>().max(1);
    let loss = stats.iter().map(|s| s.loss * s.tokens as f64).sum::<f64>() / tokens as f64;
    let accuracy = stats
        .iter()
        .map(|s| s.token_accuracy * s.tokens as f64)
        .sum::<f64>()
        / tokens as f64;
    (loss, accuracy)
}

/// What one training's replicas share and what each holds alike.
pub(super) struct TrainingSession<'a> {
    pub(super) model: &'a CausalLm,
    pub(super) adapter: Option<&'a LoraAdapter>,
    /// The weights that train (the adapter's factors, or every weight).
    pub(super) trainable: &'a [(String, candle_core::Var)],
    pub(super) examples: &'a [SftExample],
    pub(super) holdout: &'a [SftExample],
    pub(super) epochs: usize,
    pub(super) seed: u64,
    /// [`training_identity`]: replicas of one training hold the same.
    pub(super) identity: [u8; 32],
}

/// A digest of what makes one training: the examples and held-out
/// examples, and the flags that order and step them. A replica whose
/// digest differs from rank 0's (other data, flags or seed, or another
/// training sharing the group's name) stops with that reason instead of
/// mixing its gradients in.
pub(super) fn training_identity(
    args: &SftArgs,
    examples: &[SftExample],
    holdout: &[SftExample],
) -> Result<[u8; 32]> {
    use sha2::Digest;
    let flags = (
        &args.model,
        args.full,
        args.rank,
        args.alpha,
        args.epochs,
        args.batch_size,
        args.minibatch_size,
        args.lr,
        args.seed,
    );
    let mut hash = sha2::Sha256::new();
    hash.update(serde_json::to_vec(&(flags, examples, holdout))?);
    Ok(hash.finalize().into())
}

/// Where a training stands: with the trainable weights and the optimizer,
/// what rank 0 hands to every replica of a new view, so that a replica
/// that joins (or survives a failed step) goes on from the same step.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub(super) struct SftProgress {
    /// The epoch under way (from 0) and its next step.
    epoch: usize,
    step: usize,
    /// Optimizer steps taken, over all epochs.
    steps: u64,
    /// The statistics of this epoch's steps so far.
    epoch_stats: Vec<SftStats>,
    /// The finished epochs.
    pub(super) epochs: Vec<EpochReport>,
    /// Sequences shortened to fit in the last finished epoch.
    pub(super) truncated: usize,
}

/// Rank 0's state at a new view.
#[derive(Serialize, Deserialize)]
struct SftReplicaState {
    /// Rank 0's [`TrainingSession::identity`].
    identity: [u8; 32],
    trainable: Vec<relay_nn::NamedTensor>,
    /// AdamW's moments and step count ([`relay_llm::AdamW::state_bytes`]).
    optimizer: Vec<u8>,
    progress: SftProgress,
}

/// One replica's training as the replica driver runs it: rank 0 hands out
/// positions (epoch, step), each replica trains its share of that step's
/// batch.
struct SftTraining<'s, 'a> {
    session: &'s TrainingSession<'a>,
    trainer: &'s mut SftTrainer,
    progress: SftProgress,
    /// The epoch whose order of the examples is at hand, and that order.
    ordered: Option<(usize, Vec<SftExample>)>,
}

impl Replicated for SftTraining<'_, '_> {
    type State = SftReplicaState;
    type Step = (usize, usize);
    type Output = SftStats;
    type Error = anyhow::Error;
    const STOPS_PART_WAY: bool = false;
    // One optimizer step of one batch, applied after its last sum: a
    // failed step leaves only accumulated gradients (and `--full` would
    // copy the whole model per step).
    const UNDO: Undo = Undo::Discard;

    fn capture(&self) -> Result<SftReplicaState, String> {
        let trainable = relay_llm::sft::var_values(self.session.trainable);
        Ok(SftReplicaState {
            identity: self.session.identity,
            trainable: trainable.map_err(|e| e.to_string())?,
            optimizer: self
                .trainer
                .optimizer()
                .state_bytes()
                .map_err(|e| e.to_string())?,
            progress: self.progress.clone(),
        })
    }

    fn restore(&mut self, state: SftReplicaState) -> Result<(), String> {
        if state.identity != self.session.identity {
            return Err(
                "this replica's training differs from rank 0's (its examples, or \
                 --model, --full, --rank, --alpha, --epochs, --batch-size, \
                 --minibatch-size, --lr or --seed): give every replica the same \
                 data and flags, or another --group"
                    .into(),
            );
        }
        relay_llm::sft::set_var_values(self.session.trainable, &state.trainable)
            .map_err(|e| format!("weights: {e}"))?;
        let optimizer = self.trainer.optimizer_mut();
        optimizer
            .restore_bytes(&state.optimizer, "rank 0's optimizer state")
            .map_err(|e| e.to_string())?;
        self.progress = state.progress;
        Ok(())
    }

    fn discard(&mut self) {
        // Gradients a failed step accumulated are not carried over.
        self.trainer.optimizer_mut().zero_grad();
    }

    fn describe(&(epoch, step): &(usize, usize)) -> String {
        format!("epoch {} step {step}", epoch + 1)
    }

    fn is_next(&self, _: &(usize, usize)) -> bool {
        // Rank 0 hands out where its state is, which every replica holds
        // after the hand-over: a replica elsewhere fails in `run`.
        true
    }

    fn run(
        &mut self,
        &(epoch, step): &(usize, usize),
        share: &mut relay_nn::BatchShare<'_>,
    ) -> Result<SftStats> {
        if (epoch, step) != (self.progress.epoch, self.progress.step) {
            bail!(
                "replica at epoch {} step {} while rank 0 hands out epoch {} step {step}",
                self.progress.epoch + 1,
                self.progress.step,
                epoch + 1
            );
        }
        let session = self.session;
        if self.ordered.as_ref().is_none_or(|(e, _)| *e != epoch) {
            self.ordered = Some((epoch, epoch_order(session.examples, session.seed, epoch)));
        }
        let examples = &self.ordered.as_ref().expect("ordered above").1;
        let batch_size = self.trainer.config().batch.batch_size;
        let batch = &examples[step * batch_size..((step + 1) * batch_size).min(examples.len())];
        Ok(self
            .trainer
            .train_step_part(session.model, session.adapter, batch, share)?)
    }

    fn stopped(_: &anyhow::Error) -> bool {
        false
    }
}

impl TrainingSession<'_> {
    /// Trains every epoch, one optimizer step per `--batch-size` examples
    /// in each epoch's order, as one replica of `team`: at each new view
    /// rank 0's state goes to all; rank 0 hands out each step (the
    /// barrier), every replica computes its share and the sums, and a step
    /// a failed replica interrupted is dropped (the accumulated gradients
    /// cleared) and redone from the state rank 0 hands over in the next
    /// view, so no step is applied twice or lost. Rank 0 prints each
    /// epoch's row. `None`: this replica was told to stop (rank 0 ends
    /// the training).
    pub(super) fn train(
        &self,
        team: &mut Team,
        trainer: &mut SftTrainer,
    ) -> Result<Option<SftProgress>> {
        let steps_per_epoch = self
            .examples
            .len()
            .div_ceil(trainer.config().batch.batch_size);
        let mut work = SftTraining {
            session: self,
            trainer,
            progress: SftProgress::default(),
            ordered: None,
        };
        // When the epoch under way started here (its time in the report).
        let (mut epoch_started, mut timed_epoch) = (Instant::now(), None);
        // The replicas' number in the last view (`None` before the first).
        let mut members = None;
        let replicas = &mut team.replicas;
        let shutdown = &team.shutdown;
        let _entered = team.runtime.enter();
        loop {
            match team
                .runtime
                .block_on(replicas.sync_view(&mut work, shutdown))?
            {
                Next::Go(true) => {
                    let now = replicas.share().1;
                    if let Some(before) = members.filter(|_| replicas.leads()) {
                        println!(
                            "replicas: {before} -> {now} at epoch {} step {}",
                            work.progress.epoch + 1,
                            work.progress.step
                        );
                    }
                    members = Some(now);
                }
                Next::Go(false) => {}
                Next::Retry => continue,
                Next::Stop => bail!("relay sft: stopped"),
            }
            let leads = replicas.leads();
            if leads && work.progress.epoch == self.epochs {
                team.runtime.block_on(replicas.announce_stop());
                return Ok(Some(work.progress));
            }
            if timed_epoch != Some(work.progress.epoch) {
                (epoch_started, timed_epoch) = (Instant::now(), Some(work.progress.epoch));
            }
            let position = leads.then_some((work.progress.epoch, work.progress.step));
            let stats = match team
                .runtime
                .block_on(replicas.run_step(&mut work, position, &mut None, shutdown))?
            {
                Turn::Done { output, .. } => output,
                Turn::Failed {
                    step: (epoch, step),
                    error,
                } => return Err(error.context(format!("epoch {} step {step}", epoch + 1))),
                Turn::Again => continue,
                Turn::Stop if leads => bail!("relay sft: stopped"),
                Turn::Stop => return Ok(None),
            };
            let progress = &mut work.progress;
            progress.epoch_stats.push(stats);
            progress.step += 1;
            progress.steps += 1;
            let steps = progress.steps;
            team.runtime.block_on(replicas.check_parameters(steps, || {
                relay_llm::sft::var_values(self.trainable).expect("trainable weights read back")
            }))?;
            let progress = &mut work.progress;
            if progress.step == steps_per_epoch {
                let stats = std::mem::take(&mut progress.epoch_stats);
                let epoch = progress.epoch;
                let report =
                    self.epoch_report(work.trainer, epoch, &stats, epoch_started, leads)?;
                let progress = &mut work.progress;
                progress.epochs.push(report);
                progress.truncated = stats.iter().map(|s| s.truncated).sum();
                progress.epoch += 1;
                progress.step = 0;
            }
        }
    }

    /// The figures of epoch `epoch` (from 0), held-out loss included; rank
    /// 0 (`print`) prints them as a row.
    fn epoch_report(
        &self,
        trainer: &mut SftTrainer,
        epoch: usize,
        stats: &[SftStats],
        started: Instant,
        print: bool,
    ) -> Result<EpochReport> {
        let (train_loss, train_token_accuracy) = mean_stats(stats);
        let held = if self.holdout.is_empty() {
            None
        } else {
            Some(trainer.evaluate(self.model, self.adapter, self.holdout)?)
        };
        let report = EpochReport {
            epoch: epoch + 1,
            steps: stats.len(),
            train_loss,
            train_token_accuracy,
            holdout_loss: held.map(|s| s.loss),
            holdout_token_accuracy: held.map(|s| s.token_accuracy),
            seconds: started.elapsed().as_secs_f64(),
        };
        if print {
            let optional =
                |v: Option<f64>| v.map(|v| format!("{v:.4}")).unwrap_or_else(|| "-".into());
            println!(
                "{:>5} {:>6} {:>11.4} {:>10.4} {:>13} {:>12} {:>8.1}",
                report.epoch,
                report.steps,
                report.train_loss,
                report.train_token_accuracy,
                optional(report.holdout_loss),
                optional(report.holdout_token_accuracy),
                report.seconds
            );
        }
        Ok(report)
    }
}

/// Epoch `epoch`'s order of `examples`: a function of the seed and the
/// epoch alone, so that every replica, one that joins late included,
/// trains the same batches.
fn epoch_order(examples: &[SftExample], seed: u64, epoch: usize) -> Vec<SftExample> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    rng.set_stream(epoch as u64 + 1);
    let mut order = examples.to_vec();
    order.shuffle(&mut rng);
    order
}
