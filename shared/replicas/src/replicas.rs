//! A trainer process's place among its replicas ([`Replicas`]): the group
//! it joined, the view it works in, and the collectives around each step
//! (state hand-over at a new view, the step barrier, a step's sums, the
//! parameter digest, recovery after a failure).

use std::time::Duration;

use relay_kit::collective::{CollectiveError, Group, GroupConfig, View};
use relay_kit::{gauge, Service, ServiceError, Shutdown};
use relay_nn::{BatchShare, StopCheck};
use relay_proto::MetricValue;
use serde::{de::DeserializeOwned, Deserialize, Serialize};

use crate::group_share::{in_group, Reduced};

/// What a replicated loop does after one of its collectives.
pub enum Next<T> {
    /// Go on, with what the collective brought.
    Go(T),
    /// A member failed and the replicas re-formed: the loop's turn starts
    /// again (with the new view's state hand-over).
    Retry,
    /// Shutdown came, or rank 0 stopped training.
    Stop,
}

/// What rank 0 hands out at each step barrier.
#[derive(Serialize, Deserialize)]
enum Handed<T> {
    Step(T),
    Stop,
}

/// What a replica hands the others (state, step), with named fields: a
/// field left out when absent (serde's `skip_serializing_if`, as the wire
/// messages' optional fields are) would shift every later one in
/// MessagePack's array form.
fn pack<T: Serialize>(value: &T) -> Result<Vec<u8>, ServiceError> {
    rmp_serde::to_vec_named(value).map_err(ServiceError::other)
}

/// Every this many updates the replicas check that they hold bit-identical
/// parameters (a digest of them, from rank 0 to the others).
const DIGEST_EVERY: u64 = 10;

/// How long a replica waits for a view after losing a neighbour, or for its
/// first view, before it fails.
const VIEW_WAIT: Duration = Duration::from_secs(60);

/// A learner process's place among its run's replicas: the group it joined
/// (`<run id>-learner`), the view it works in, and the tags of the
/// collectives it has taken part in there. Every member takes the same
/// sequence of collectives in a view, so one counter, reset at each view,
/// tags them all.
pub struct Replicas {
    /// `None`: NATS has no JetStream, so this learner trains alone.
    group: Option<Group>,
    member: String,
    view: View,
    /// The epoch whose state this replica holds (`None`: it must receive it).
    synced: Option<u64>,
    /// The tag of the next collective in `view`.
    tag: u64,
    /// Set when this replica became rank 0 in place of another, until
    /// [`Self::took_over`] reads it.
    takeover: bool,
    /// What the last step's sums cost, and how long this replica waited
    /// for rank 0's step.
    pub last_step: Reduced,
    pub last_wait_seconds: f64,
}

impl Replicas {
    /// Joins the run's learner group (listening on this machine's interface
    /// that reaches NATS, as the direct weights server does) and waits for
    /// a view that holds this learner.
    pub async fn join(service: &Service) -> Result<Self, ServiceError> {
        let cfg = &service.config;
        let mut listen =
            relay_kit::weights::listen_address(&cfg.weights, &cfg.connections.nats_url)
                .map_err(ServiceError::other)?;
        listen.set_port(0);
        let name = format!("{}-learner", cfg.run_id()?);
        let member = format!(
            "{}-{}-{:08x}",
            service.instance,
            std::process::id(),
            rand::random::<u32>()
        );
        if !service.nats.server_info().jetstream {
            // Replicas agree through JetStream; a single learner needs none.
            tracing::warn!("NATS has no JetStream: this learner trains alone (learner replicas need JetStream)");
            return Ok(Self::single(member));
        }
        let mut config = GroupConfig::new(name, member, listen);
        config.advertise = cfg.weights.direct_advertise.clone();
        Self::join_group(&service.nats, config).await
    }

    /// A trainer that works alone, in no group: every collective is a
    /// no-op (one loop serves one trainer and many).
    pub fn single(member: String) -> Self {
        Self {
            group: None,
            view: View {
                epoch: 0,
                members: Vec::new(),
            },
            member,
            synced: Some(0),
            tag: 0,
            takeover: false,
            last_step: Reduced::default(),
            last_wait_seconds: 0.0,
        }
    }

    /// Joins the group `config` names over `nats` (which must have
    /// JetStream) and waits for a view that holds this member: the
    /// learner's replicas, or another trainer's (`relay sft`).
    pub async fn join_group(
        nats: &async_nats::Client,
        config: GroupConfig,
    ) -> Result<Self, ServiceError> {
        let member = config.member.clone();
        let mut group = Group::join(nats, config)
            .await
            .map_err(|e| ServiceError::other(format!("learner replicas: {e}")))?;
        let view = group
            .view_after(None, VIEW_WAIT)
            .await
            .map_err(|e| ServiceError::other(format!("learner replicas: {e}")))?;
        tracing::info!(
            epoch = view.epoch,
            rank = view.rank_of(group.member()),
            replicas = view.size(),
            "joined the learner replicas"
        );
        Ok(Self {
            group: Some(group),
            view,
            member,
            synced: None,
            tag: 0,
            takeover: false,
            last_step: Reduced::default(),
            last_wait_seconds: 0.0,
        })
    }

    /// Waits until the view holds at least `replicas` members (a trainer
    /// told how many to start with), or fails after `within` naming how
    /// many came.
    pub async fn wait_for(
        &mut self,
        replicas: usize,
        within: Duration,
        shutdown: &Shutdown,
    ) -> Result<(), ServiceError> {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            self.follow_view()?;
            let (_, size) = self.share();
            if self.group.is_none() || size >= replicas {
                return Ok(());
            }
            if tokio::time::Instant::now() > deadline || shutdown.is_triggered() {
                return Err(ServiceError::other(format!(
                    "only {size} of {replicas} replicas joined within {within:?}"
                )));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// This replica's rank and the number of replicas in its view.
    pub fn share(&self) -> (usize, usize) {
        (
            self.view.rank_of(&self.member).unwrap_or(0),
            self.view.size().max(1),
        )
    }

    /// Whether this replica is rank 0: it gathers the data, publishes the
    /// weights and writes the checkpoints.
    pub fn leads(&self) -> bool {
        self.share().0 == 0
    }

    /// Whether the replicas work alone (no collective can fail).
    pub fn alone(&self) -> bool {
        self.group.is_none() || self.view.size() == 1
    }

    /// Moves to the newest agreed view, if there is one. Fails when that
    /// view no longer holds this replica: the others went on without it
    /// (it was partitioned or stalled past the lease) and its state is
    /// behind theirs, so it must restart to rejoin. Returns whether this
    /// replica must take part in a state hand-over ([`Self::hand_over`]).
    pub(crate) fn follow_view(&mut self) -> Result<bool, ServiceError> {
        if let Some(newest) = self.group.as_ref().and_then(Group::current_view) {
            if newest.epoch > self.view.epoch {
                if newest.rank_of(&self.member).is_none() {
                    return Err(ServiceError::other(format!(
                        "learner replica {} was dropped from the replicas' view (epoch {}): \
                         it was partitioned or stalled past the lease; restart it to rejoin",
                        self.member, newest.epoch
                    )));
                }
                self.enter(newest);
            }
        }
        Ok(self.synced != Some(self.view.epoch))
    }

    fn enter(&mut self, view: View) {
        let me = &self.member;
        let led = self.view.members.first().is_some_and(|m| m.id == *me);
        let leads = view.members.first().is_some_and(|m| m.id == *me);
        self.takeover |= leads && !led;
        tracing::info!(
            epoch = view.epoch,
            rank = view.rank_of(&self.member),
            replicas = view.size(),
            "learner replicas re-formed"
        );
        self.view = view;
        self.tag = 0;
    }

    /// Whether this replica just became rank 0 in place of another: the
    /// previous rank 0 may have published one version beyond the state
    /// any survivor holds.
    pub(crate) fn took_over(&mut self) -> bool {
        std::mem::take(&mut self.takeover)
    }

    /// Hands rank 0's `state` to every replica of the view (the others'
    /// `state` is replaced): at every new view, so that a joining replica
    /// starts from the live parameters, optimizer state and counters and
    /// survivors of a failed step agree again. The others wait for rank 0
    /// however long it takes to get there (it may be finishing other
    /// work), until the view changes: leases, not a timeout, say whether
    /// it is alive.
    pub(crate) async fn hand_over(&mut self, state: &mut Vec<u8>) -> Result<(), CollectiveError> {
        let tag = self.next_tag();
        if let Some(group) = &mut self.group {
            group.broadcast_awaited(&self.view, tag, 0, state).await?;
        }
        self.synced = Some(self.view.epoch);
        Ok(())
    }

    /// Rank 0 hands its next step (`input`) to the others, who wait for it
    /// (the step barrier) until rank 0 sends or the view changes.
    pub(crate) async fn hand_out(&mut self, input: &mut Vec<u8>) -> Result<(), CollectiveError> {
        let tag = self.next_tag();
        let started = std::time::Instant::now();
        let sent = match &mut self.group {
            Some(group) => group.broadcast_awaited(&self.view, tag, 0, input).await,
            None => Ok(()),
        };
        self.last_wait_seconds = started.elapsed().as_secs_f64();
        sent
    }

    /// Runs one step with this view's [`BatchShare`] (`stop`: whether the
    /// trainer is stopping, asked between the parts of a long step). `Err`
    /// says which sum failed inside it: whatever the step did must be
    /// rolled back and the step redone in the next view.
    pub(crate) fn step<R>(
        &mut self,
        stop: Option<StopCheck<'_>>,
        f: impl FnOnce(&mut BatchShare<'_>) -> R,
    ) -> Result<R, String> {
        let Some(group) = &mut self.group else {
            let mut share = BatchShare {
                stop,
                ..BatchShare::whole()
            };
            return Ok(f(&mut share));
        };
        let (result, summed) = in_group(group, &self.view, self.tag, stop, f);
        self.tag = summed.next_tag;
        self.last_step = summed.reduced;
        match summed.broken {
            Some(broken) => Err(broken),
            None => Ok(result),
        }
    }

    /// At a new view ([`Self::follow_view`]): rank 0 gives `Some` of its
    /// state, which every other replica (giving `None`) receives to
    /// restore.
    pub(crate) async fn share_state<S: Serialize + DeserializeOwned>(
        &mut self,
        shutdown: &Shutdown,
        mine: Option<S>,
    ) -> Result<Next<Option<S>>, ServiceError> {
        let mut bytes = match &mine {
            Some(state) => pack(state)?,
            None => Vec::new(),
        };
        if let Err(e) = self.hand_over(&mut bytes).await {
            tracing::warn!(error = %e, "state hand-over failed; waiting for the next view");
            return self.recovered(shutdown).await;
        }
        if mine.is_some() {
            return Ok(Next::Go(None));
        }
        rmp_serde::from_slice(&bytes)
            .map(|state| Next::Go(Some(state)))
            .map_err(|e| {
                ServiceError::other(format!(
                    "learner replicas: rank 0's state does not decode: {e}"
                ))
            })
    }

    /// The step barrier: rank 0 hands `Some(input)` to the others, who
    /// give `None` and wait for it. When that fails, the replicas re-form
    /// ([`Next::Retry`]) and rank 0's input waits in `held` to be handed
    /// out again in the next view.
    pub(crate) async fn exchange<T: Serialize + DeserializeOwned>(
        &mut self,
        shutdown: &Shutdown,
        input: Option<T>,
        held: &mut Option<T>,
    ) -> Result<Next<T>, ServiceError> {
        if let Some(input) = input {
            if self.alone() {
                return Ok(Next::Go(input));
            }
            let mut bytes = pack(&Handed::Step(&input))?;
            if let Err(e) = self.hand_out(&mut bytes).await {
                tracing::warn!(error = %e, "handing out the step failed; redoing it in the next view");
                *held = Some(input);
                return self.recovered(shutdown).await;
            }
            return Ok(Next::Go(input));
        }
        let mut bytes = Vec::new();
        tokio::select! {
            sent = self.hand_out(&mut bytes) => match sent {
                Ok(()) => {}
                Err(CollectiveError::Superseded { .. }) => return Ok(Next::Retry),
                Err(e) => {
                    tracing::warn!(error = %e, "rank 0's step did not arrive; waiting for the next view");
                    return self.recovered(shutdown).await;
                }
            },
            _ = shutdown.wait() => return Ok(Next::Stop),
        }
        match rmp_serde::from_slice::<Handed<T>>(&bytes) {
            Ok(Handed::Step(input)) => Ok(Next::Go(input)),
            Ok(Handed::Stop) => Ok(Next::Stop),
            Err(e) => Err(ServiceError::other(format!(
                "learner replicas: rank 0's step does not decode: {e}"
            ))),
        }
    }

    /// Rank 0 tells the others that training stopped.
    pub async fn announce_stop(&mut self) {
        if self.alone() {
            return;
        }
        let mut stop = pack(&Handed::<()>::Stop).expect("a stop encodes");
        if let Err(e) = self.hand_out(&mut stop).await {
            tracing::warn!(error = %e, "the other replicas were not told to stop");
        }
    }

    /// After a failure inside a collective: the next view, or a stop.
    pub(crate) async fn recovered<T>(
        &mut self,
        shutdown: &Shutdown,
    ) -> Result<Next<T>, ServiceError> {
        Ok(if self.recover(shutdown).await? {
            Next::Retry
        } else {
            Next::Stop
        })
    }

    /// What a step's report says of the replicas, after `updates` updates.
    pub fn gauges(&self, updates: u64) -> Vec<MetricValue> {
        let (rank, size) = self.share();
        vec![
            gauge("learner_replicas", size as f64),
            gauge("learner_replica_rank", rank as f64),
            gauge("learner_replica_updates", updates as f64),
            gauge("learner_allreduce_seconds", self.last_step.seconds),
            gauge("learner_allreduce_bytes", self.last_step.bytes as f64),
            gauge("learner_barrier_wait_seconds", self.last_wait_seconds),
        ]
    }

    /// Every [`DIGEST_EVERY`] steps, checks that every replica holds rank
    /// 0's `parameters` bit for bit.
    pub async fn check_parameters(
        &mut self,
        step: u64,
        parameters: impl FnOnce() -> Vec<relay_nn::NamedTensor>,
    ) -> Result<(), ServiceError> {
        if self.alone() || !step.is_multiple_of(DIGEST_EVERY) {
            return Ok(());
        }
        self.check_digest(digest(&parameters()), step).await
    }

    /// Checks that every replica holds rank 0's parameters bit for bit
    /// (`digest` of this replica's), after step `step`.
    async fn check_digest(&mut self, digest: [u8; 32], step: u64) -> Result<(), ServiceError> {
        let mut theirs = digest.to_vec();
        let tag = self.next_tag();
        let Some(group) = &mut self.group else {
            return Ok(());
        };
        match group.broadcast(&self.view, tag, 0, &mut theirs).await {
            Ok(()) if theirs == digest => Ok(()),
            Ok(()) => Err(ServiceError::other(format!(
                "learner replica {} diverged from rank 0 after step {step}: its parameters' digest differs",
                self.member
            ))),
            // A broken ring is a failure the next step meets too.
            Err(e) => {
                tracing::warn!(error = %e, "parameter digest not compared");
                Ok(())
            }
        }
    }

    /// After a failed collective: waits for the next view (the failed
    /// member's lease runs out) and marks the state for a hand-over.
    /// Returns `false` when `shutdown` came first: the learner stops.
    pub(crate) async fn recover(&mut self, shutdown: &Shutdown) -> Result<bool, ServiceError> {
        let Some(group) = &mut self.group else {
            return Ok(true);
        };
        let newer = tokio::select! {
            newer = group.view_after(Some(self.view.epoch), VIEW_WAIT) => newer
                .map_err(|e| ServiceError::other(format!("learner replicas: {e}")))?,
            _ = shutdown.wait() => return Ok(false),
        };
        self.enter(newer);
        self.synced = None;
        Ok(true)
    }

    fn next_tag(&mut self) -> u64 {
        self.tag += 1;
        self.tag - 1
    }

    /// Leaves the group at once.
    pub async fn leave(self) {
        let Some(group) = self.group else { return };
        if let Err(e) = group.leave().await {
            tracing::warn!(error = %e, "leaving the learner replicas");
        }
    }
}

/// The digest of parameters `tensors` (name, then bytes), compared across
/// replicas.
pub fn digest(tensors: &[relay_nn::NamedTensor]) -> [u8; 32] {
    use sha2::Digest;
    let mut hash = sha2::Sha256::new();
    for t in tensors {
        hash.update(t.0.as_bytes());
        let bytes: Vec<u8> = t.2.iter().flat_map(|x| x.to_le_bytes()).collect();
        hash.update(&bytes);
    }
    hash.finalize().into()
}

#[cfg(test)]
mod tests {
    use super::*;
    use relay_proto::{Tensor, TransitionBatch};

    #[test]
    fn a_step_with_an_absent_optional_field_before_others_arrives_whole() {
        let rows = Tensor::from_f32(&[2], &[1.0, 0.5]);
        let batch = TransitionBatch {
            schema: relay_proto::SCHEMA_VERSION,
            ids: vec![3, 7],
            obs: Tensor::from_f32(&[2, 1], &[0.1, 0.2]),
            actions: Tensor::from_i64(&[2], &[0, 1]),
            rewards: rows.clone(),
            next_obs: Tensor::from_f32(&[2, 1], &[0.3, 0.4]),
            discounts: rows.clone(),
            terminated: Tensor::from_u8(&[2], &[0, 1]),
            truncated: Tensor::from_u8(&[2], &[0, 0]),
            weights: rows,
            // Absent, with fields after it.
            weight_scale: None,
            size: 9,
            inserted_steps: 12,
            next_masks: Some(Tensor::from_u8(&[2, 2], &[1, 1, 0, 1])),
        };
        let bytes = pack(&Handed::Step(&batch)).unwrap();
        match rmp_serde::from_slice::<Handed<TransitionBatch>>(&bytes).unwrap() {
            Handed::Step(back) => assert_eq!(back, batch),
            Handed::Stop => panic!("a step arrived as a stop"),
        }
    }
}
