//! Shipping fragments to the replay buffer: one insert in flight while the
//! next fragment is collected, retried through backpressure and the rate
//! limiter, and the episodes of each period published beside it.

use std::time::Duration;

use prometheus::{IntCounter, IntCounterVec};
use relay_kit::{RequestError, Service};
use relay_proto::{EpisodeReport, EpisodeSummary, InsertAck, RolloutFragment, SCHEMA_VERSION};

use crate::Metrics;

/// The inserts of a runner's fragments: at most one in flight while the
/// next fragment is collected.
#[derive(Default)]
pub(crate) struct Inserts {
    /// The insert in flight.
    pub(crate) pending: Option<tokio::task::JoinHandle<()>>,
    /// Fragments refused as bad in a row.
    pub(crate) rejected_in_a_row: std::sync::Arc<std::sync::atomic::AtomicU32>,
    /// Env steps the replay buffer held at the last ack.
    pub(crate) buffered: std::sync::Arc<std::sync::atomic::AtomicU64>,
}

impl Inserts {
    /// Ships one collection period: waits for the insert in flight (the
    /// backpressure), starts inserting `fragment`, and publishes the
    /// `episodes` finished since the last period.
    pub(crate) async fn ship(
        &mut self,
        service: &Service,
        metrics: &Metrics,
        fragment: RolloutFragment,
        env_id: &str,
        policy_version: u64,
        episodes: &mut Vec<EpisodeSummary>,
    ) {
        if let Some(previous) = self.pending.take() {
            let _ = previous.await;
        }
        self.pending = Some(tokio::spawn(insert_all_with_retry(
            service.clone(),
            fragment,
            metrics.fragments.clone(),
            metrics.backpressure_waits.clone(),
            self.rejected_in_a_row.clone(),
            self.buffered.clone(),
        )));
        if !episodes.is_empty() {
            let report = EpisodeReport {
                schema: SCHEMA_VERSION,
                runner_id: service.instance.clone(),
                env_id: env_id.to_string(),
                policy_version,
                episodes: std::mem::take(episodes),
            };
            // Logged when it cannot be sent; the episodes are only reported.
            let _ = service
                .publish_within(service.subjects.episodes(), report)
                .await;
        }
    }

    /// Waits up to `at_most` for the insert in flight (the backpressure);
    /// whether none is in flight now. A runner that a full buffer holds
    /// back (once the learner has stopped taking data, for as long as the
    /// stack stays up) reports between two waits, so its step rate falls to
    /// zero instead of the last one standing.
    pub(crate) async fn settled_within(&mut self, at_most: Duration) -> bool {
        let Some(pending) = self.pending.as_mut() else {
            return true;
        };
        let settled = tokio::time::timeout(at_most, pending).await.is_ok();
        if settled {
            self.pending = None;
        }
        settled
    }

    /// Waits a little for the insert in flight, at shutdown: half the
    /// service's 2 s promise. The replay-buffer is stopped beside it, so an
    /// insert not answered by then (its request left waiting on a buffer
    /// that exited, or retrying one that is full) would not be.
    pub(crate) async fn finish(&mut self) {
        if let Some(previous) = self.pending.take() {
            let _ = tokio::time::timeout(Duration::from_secs(1), previous).await;
        }
    }
}

/// Longest wait between two inserts the rate limiter refused. When a
/// refused fragment fits, the table still holds the limiter's slack less
/// one fragment for the learner, far more than this at the presets' rates.
const RATE_WAIT_CAP: Duration = Duration::from_millis(16);

/// Fragments in a row the replay buffer refused as bad, after which the
/// env-runner fails: what it sends cannot be stored.
const REJECTED_FRAGMENTS_TO_FAIL: u32 = 3;

/// Sends the fragment of one collection period, divided into parts that
/// fit NATS messages (`relay_proto::fit`), in turn ([`insert_with_retry`]);
/// fails the service once [`REJECTED_FRAGMENTS_TO_FAIL`] in a row were
/// refused as bad, or at once when one env step alone does not fit.
async fn insert_all_with_retry(
    service: Service,
    fragment: RolloutFragment,
    outcomes: IntCounterVec,
    waits: IntCounter,
    rejected_in_a_row: std::sync::Arc<std::sync::atomic::AtomicU32>,
    buffered: std::sync::Arc<std::sync::atomic::AtomicU64>,
) {
    use std::sync::atomic::Ordering;
    let parts = match relay_proto::encode_within(fragment, service.max_message_bytes()) {
        Ok(parts) => parts,
        Err(e) => {
            outcomes.with_label_values(&["rejected"]).inc();
            service
                .fail(format!("a rollout fragment cannot be sent: {e}"))
                .await;
            return;
        }
    };
    for part in parts {
        match insert_with_retry(&service, part, &outcomes, &waits, &buffered).await {
            Err(reason) => {
                if rejected_in_a_row.fetch_add(1, Ordering::Relaxed) + 1
                    >= REJECTED_FRAGMENTS_TO_FAIL
                {
                    service
                        .fail(format!(
                            "{REJECTED_FRAGMENTS_TO_FAIL} fragments in a row could not be stored; the last: {reason}"
                        ))
                        .await;
                }
            }
            Ok(()) => rejected_in_a_row.store(0, Ordering::Relaxed),
        }
    }
}

/// Sends a fragment (encoded to fit a message) to the replay buffer,
/// retrying while it is full or absent; an error says why the fragment can
/// never be stored (the buffer rejected it as bad).
async fn insert_with_retry(
    service: &Service,
    fragment: relay_proto::Part<RolloutFragment>,
    outcomes: &IntCounterVec,
    waits: &IntCounter,
    buffered: &std::sync::atomic::AtomicU64,
) -> Result<(), String> {
    let subject = service.subjects.replay_insert();
    let timeout = service.request_timeout();
    let payload = bytes::Bytes::from(fragment.bytes);
    let mut backoff = Duration::from_millis(5);
    let mut rate_refusals = 0u32;
    loop {
        let acked = relay_kit::connect::request_encoded::<InsertAck>(
            &service.nats,
            &subject,
            payload.clone(),
            timeout,
        )
        .await
        .inspect(|ack| buffered.store(ack.buffered_steps, std::sync::atomic::Ordering::Relaxed));
        match acked {
            Ok(ack) if ack.accepted => {
                outcomes.with_label_values(&["stored"]).inc();
                return Ok(());
            }
            // Backpressure: the buffer is full or the rate limiter holds inserts back.
            Ok(ack) if ack.reason == "full" || ack.reason == "rate" => {
                waits.inc();
                backoff = Duration::from_millis(ack.retry_after_ms.max(1) as u64);
                if ack.reason == "rate" {
                    // The insert fits once the learner has sampled enough,
                    // which takes longer the further ahead this runner is:
                    // the wait doubles with each refusal in a row (up to a
                    // cap), so a runner held back asks a few times, not
                    // every millisecond, each time with its whole fragment.
                    backoff =
                        (backoff * 2u32.pow(rate_refusals.min(8))).min(RATE_WAIT_CAP.max(backoff));
                    rate_refusals += 1;
                }
            }
            Ok(ack) => {
                tracing::debug!(reason = %ack.reason, version = fragment.message.policy_version, "fragment dropped by the replay buffer");
                outcomes
                    .with_label_values(&[if ack.reason == "stale" {
                        "stale"
                    } else {
                        "refused"
                    }])
                    .inc();
                return Ok(());
            }
            Err(RequestError::Service { code, status, .. }) if code == "400" => {
                // The fragment itself is bad: retrying cannot help.
                tracing::warn!(%status, "replay buffer rejected a fragment");
                outcomes.with_label_values(&["rejected"]).inc();
                return Err(format!("the replay buffer rejected it: {status}"));
            }
            Err(e) => {
                tracing::debug!(error = %e, "insert failed; retrying");
                backoff = (backoff * 2).min(Duration::from_secs(1));
            }
        }
        if service.shutdown.is_triggered() {
            return Ok(());
        }
        tokio::time::sleep(backoff).await;
    }
}
