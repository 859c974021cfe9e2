//! A step's sums over one view of a group: what a replica's
//! [`BatchShare`] does when it sums (a ring all-reduce among the view's
//! members, each sum tagged with the next step number so that replicas
//! out of step fail instead of mixing sums). Used by [`crate::Replicas`]
//! and by the learners' benchmark, which drives a group by hand.

use std::time::Instant;

use relay_kit::collective::{Group, View};
use relay_nn::{BatchShare, ShareError, StopCheck};

/// What a replica's sums cost.
#[derive(Debug, Default, Clone, Copy)]
pub struct Reduced {
    pub seconds: f64,
    pub bytes: u64,
}

/// What one [`in_group`] call left behind.
#[derive(Debug, Default, Clone)]
pub struct Summed {
    /// The tag the next sum in this view will carry.
    pub next_tag: u64,
    /// Time spent in sums and the bytes summed.
    pub reduced: Reduced,
    /// Why a sum failed: the ring is broken for the rest of the view, and
    /// whatever the step did must be rolled back.
    pub broken: Option<String>,
}

/// Runs `f` as `group`'s member in `view` (which must hold it): its share
/// of every batch, sums as ring all-reduces tagged from `first_tag`, and
/// `stop` as the stop check. Sums block the calling thread on the current
/// tokio runtime (the step runs in `block_in_place` or a blocking task).
/// After a failed sum, later sums fail at once.
pub fn in_group<R>(
    group: &mut Group,
    view: &View,
    first_tag: u64,
    stop: Option<StopCheck<'_>>,
    f: impl FnOnce(&mut BatchShare<'_>) -> R,
) -> (R, Summed) {
    let rank = view
        .rank_of(group.member())
        .expect("a replica sums only in a view that holds it");
    let runtime = tokio::runtime::Handle::current();
    let mut summed = Summed {
        next_tag: first_tag,
        ..Summed::default()
    };
    let result = {
        let mut sum = |data: &mut [f32]| -> Result<(), ShareError> {
            if let Some(broken) = &summed.broken {
                return Err(ShareError::SumFailed(broken.clone()));
            }
            let tag = summed.next_tag;
            summed.next_tag += 1;
            let started = Instant::now();
            let result = runtime.block_on(group.all_reduce_sum(view, tag, data));
            summed.reduced.seconds += started.elapsed().as_secs_f64();
            summed.reduced.bytes += std::mem::size_of_val(data) as u64;
            result.map_err(|e| {
                summed.broken = Some(e.to_string());
                ShareError::SumFailed(e.to_string())
            })
        };
        let mut share = BatchShare {
            rank,
            replicas: view.size(),
            sum: (view.size() > 1).then_some(&mut sum as relay_nn::SumAcross<'_>),
            stop,
        };
        f(&mut share)
    };
    (result, summed)
}
