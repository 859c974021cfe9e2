//! Task parallelism inside one train step: [`Pair`] runs two independent
//! halves of it (SAC's twin critics) side by side.
//!
//! Why not candle's own threads: its gemm splits each 256 x 256 matmul
//! across the rayon pool, and at these sizes the split costs about what it
//! saves (`just bench-nn`: a SAC step 6.26 → 5.93 ms on 2 threads). Whole
//! critics on separate threads share nothing until their results meet.

use crate::error::{NnError, Result};

/// Runs two closures side by side (one on the caller's thread, one on a
/// helper thread of its own), or one after the other when built for one
/// thread. Either way the results are the same: the halves share no state.
#[derive(Debug)]
pub struct Pair {
    helper: Option<rayon::ThreadPool>,
}

impl Pair {
    /// Two-way parallel for `threads >= 2`, in turn for 0 or 1.
    pub fn new(threads: usize) -> Result<Self> {
        if threads < 2 {
            return Ok(Self::sequential());
        }
        let helper = rayon::ThreadPoolBuilder::new()
            .num_threads(1)
            .thread_name(|_| "relay-nn-pair".into())
            .build()
            .map_err(|e| {
                NnError::config("threads", format!("cannot start a helper thread: {e}"))
            })?;
        Ok(Self {
            helper: Some(helper),
        })
    }

    /// Runs both halves on the caller's thread, `a` first.
    pub fn sequential() -> Self {
        Self { helper: None }
    }

    /// Threads the halves run on (1 or 2).
    pub fn threads(&self) -> usize {
        1 + usize::from(self.helper.is_some())
    }

    /// `(a(), b())`, with `b` on the helper thread while `a` runs here.
    pub fn join<RA, RB>(&self, a: impl FnOnce() -> RA, b: impl FnOnce() -> RB + Send) -> (RA, RB)
    where
        RB: Send,
    {
        match &self.helper {
            None => {
                let ra = a();
                (ra, b())
            }
            Some(pool) => {
                let mut rb = None;
                let ra = pool.in_place_scope(|scope| {
                    scope.spawn(|_| rb = Some(b()));
                    a()
                });
                (ra, rb.expect("the scope waits for its spawned half"))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_halves_run_and_keep_their_order() {
        for threads in [1, 2] {
            let pair = Pair::new(threads).unwrap();
            assert_eq!(pair.threads(), threads);
            let here = std::thread::current().id();
            let (a, (b, b_thread)) = pair.join(|| 1 + 1, || ("b", std::thread::current().id()));
            assert_eq!((a, b), (2, "b"));
            assert_eq!(b_thread == here, threads == 1);
        }
    }
}
