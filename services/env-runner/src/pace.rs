//! On-policy pacing (`env_runner.pace`, off by default, on in the Atari
//! preset): in a PPO or A2C run an env-runner does not begin a fragment
//! while the replay buffer already holds a whole rollout for the learner;
//! it waits for the learner's next version.
//!
//! The learner trains each version on one rollout of data at most
//! `replay.max_policy_lag` versions old. An env-runner faster than the
//! learner would otherwise go on acting while the learner trains: its
//! fragments queue behind the waiting rollout, turn stale and are dropped,
//! and on a machine the learner shares the CPU they took is the learner's
//! (a 2-core Breakout run dropped 40 % of its env steps). Paced, it acts
//! one rollout while the learner trains on the one before, then waits.
//!
//! The runner knows what the buffer holds from the acks of its inserts
//! (plus the insert still in flight). A pause ends when the learner
//! announces a version other than the one the runner last acted with
//! (newer: the learner takes the waiting rollout right after publishing
//! it; older: the learner restarted from a checkpoint). The runner
//! then asks again for actions (briefly) until the inference server serves
//! that version, since a fragment begun with the old one would turn stale
//! before it is trained on. A pause also ends after
//! `env_runner.pace_timeout_s`: a learner that needs more data without a
//! newer version (a rollout it had to drop, a restart from an older
//! checkpoint) gets it. Pauses fall on fragment boundaries only.

use std::time::{Duration, Instant};

use relay_kit::Shutdown;
use tokio::sync::watch;

/// How long a resumed runner asks again for actions from an older version
/// than the one announced, waiting for the inference server to load it.
const RESUME_WAIT: Duration = Duration::from_secs(2);

/// Pause between two such asks.
pub(crate) const RETRY_ACT_AFTER: Duration = Duration::from_millis(1);

/// One env-runner's pacing state.
pub(crate) struct Pacer {
    /// Env steps of one rollout: what the learner takes per version.
    rollout: u64,
    timeout: Duration,
    /// The version the learner last announced.
    announced: watch::Receiver<Option<u64>>,
    /// Set when a pause ended on an announcement: until that version
    /// serves (or the deadline), act replies of older ones are asked again.
    resume: Option<(u64, Instant)>,
}

impl Pacer {
    pub(crate) fn new(
        rollout: u64,
        timeout: Duration,
        announced: watch::Receiver<Option<u64>>,
    ) -> Self {
        Self {
            rollout,
            timeout,
            announced,
            resume: None,
        }
    }

    /// Before a fragment begins, with `held` env steps in the buffer for
    /// the learner (as far as this runner knows) and `acted` the version of
    /// its last actions: while a whole rollout waits there, waits for the
    /// learner to announce another version (or the timeout). Whether it
    /// waited (the held count is then out of date: the learner took the
    /// rollout), `None` on shutdown.
    pub(crate) async fn before_fragment(
        &mut self,
        held: u64,
        acted: u64,
        shutdown: &Shutdown,
    ) -> Option<bool> {
        // Asking again after a pause: no second pause.
        if held < self.rollout || self.resume.is_some() {
            return Some(false);
        }
        let announced = &mut self.announced;
        let newer = async {
            loop {
                if let Some(v) = *announced.borrow_and_update() {
                    if v != acted {
                        return Some(v);
                    }
                }
                announced.changed().await.ok()?;
            }
        };
        let waited = tokio::select! {
            waited = tokio::time::timeout(self.timeout, newer) => waited,
            _ = shutdown.wait() => return None,
        };
        match waited {
            Ok(Some(version)) => self.resume = Some((version, Instant::now() + RESUME_WAIT)),
            // Timed out, or no announcements any more: act on.
            Ok(None) | Err(_) => tracing::debug!(
                held,
                acted,
                "no newer version within env_runner.pace_timeout_s; acting on"
            ),
        }
        Some(true)
    }

    /// After a pause: whether an act reply from `version` should be asked
    /// again, the inference server not serving the announced version yet.
    pub(crate) fn ask_again(&mut self, version: u64) -> bool {
        let Some((target, until)) = self.resume else {
            return false;
        };
        if version >= target || Instant::now() >= until {
            self.resume = None;
            return false;
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pacer(rollout: u64, timeout_ms: u64) -> (Pacer, watch::Sender<Option<u64>>) {
        let (tx, rx) = watch::channel(None);
        (
            Pacer::new(rollout, Duration::from_millis(timeout_ms), rx),
            tx,
        )
    }

    #[tokio::test]
    async fn a_runner_waits_while_a_rollout_is_held_until_a_newer_version() {
        let (_trigger, shutdown) = Shutdown::new();
        let (mut p, tx) = pacer(512, 60_000);
        tx.send_replace(Some(3));
        // Half a rollout held: no wait.
        assert_eq!(p.before_fragment(256, 3, &shutdown).await, Some(false));
        assert!(!p.ask_again(3));
        let announce = async {
            tokio::time::sleep(Duration::from_millis(50)).await;
            tx.send_replace(Some(4));
        };
        let started = Instant::now();
        let (waited, ()) = tokio::join!(p.before_fragment(512, 3, &shutdown), announce);
        assert_eq!(waited, Some(true));
        assert!(started.elapsed() >= Duration::from_millis(50));
        // The inference server still answers with version 3: ask again
        // until it serves version 4.
        assert!(p.ask_again(3));
        // Asking again starts no second pause.
        assert_eq!(p.before_fragment(512, 3, &shutdown).await, Some(false));
        assert!(p.ask_again(3));
        assert!(!p.ask_again(4));
        assert!(!p.ask_again(3));
    }

    #[tokio::test]
    async fn a_version_announced_before_the_pause_ends_it_at_once() {
        let (_trigger, shutdown) = Shutdown::new();
        let (mut p, tx) = pacer(512, 60_000);
        tx.send_replace(Some(8));
        let started = Instant::now();
        assert_eq!(p.before_fragment(1024, 7, &shutdown).await, Some(true));
        assert!(started.elapsed() < Duration::from_secs(1));
        assert!(p.ask_again(7));
        assert!(!p.ask_again(8));
    }

    #[tokio::test]
    async fn a_restarted_learner_announcing_an_older_version_ends_a_pause() {
        let (_trigger, shutdown) = Shutdown::new();
        let (mut p, tx) = pacer(512, 60_000);
        tx.send_replace(Some(9));
        let restart = async {
            tokio::time::sleep(Duration::from_millis(20)).await;
            tx.send_replace(Some(6));
        };
        let (waited, ()) = tokio::join!(p.before_fragment(512, 9, &shutdown), restart);
        assert_eq!(waited, Some(true));
        assert!(!p.ask_again(9));
    }

    #[tokio::test]
    async fn a_pause_ends_after_the_timeout() {
        let (_trigger, shutdown) = Shutdown::new();
        let (mut p, tx) = pacer(256, 30);
        tx.send_replace(Some(7));
        let started = Instant::now();
        assert_eq!(p.before_fragment(256, 7, &shutdown).await, Some(true));
        assert!(started.elapsed() >= Duration::from_millis(30));
        // Acting on the same version: nothing to ask again for.
        assert!(!p.ask_again(7));
    }

    #[tokio::test]
    async fn shutdown_ends_a_pause() {
        let (trigger, shutdown) = Shutdown::new();
        let (mut p, _tx) = pacer(256, 60_000);
        trigger.trigger();
        assert_eq!(p.before_fragment(256, 1, &shutdown).await, None);
    }
}
