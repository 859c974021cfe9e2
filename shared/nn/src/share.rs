//! A learner replica's part of a train step (issue 46's data-parallel
//! learner): [`BatchShare`] says which contiguous part of each batch is
//! this replica's and how f32 buffers are summed across the replicas. The
//! sum itself (the learner's all-reduce over its group) is the caller's:
//! this crate stays free of networking.
//!
//! It also carries whether the learner is stopping ([`StopCheck`]): the
//! pure crates see the learner through this one value, and a trainer whose
//! call runs for many seconds (an LLM's micro-batches) ends it early
//! rather than hold a stopping learner up.

use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor, Var};

use crate::error::{Result, ShareError};
use crate::optim::Adam;

/// Sums f32 buffers across learner replicas in place; an error says why not.
pub type SumAcross<'a> = &'a mut dyn FnMut(&mut [f32]) -> std::result::Result<(), ShareError>;

/// Whether the learner is stopping: asked between the parts of a long
/// train call, which then ends with its crate's "stopped" error and
/// leaves the rolling back to the caller.
pub type StopCheck<'a> = &'a dyn Fn() -> bool;

/// A learner replica's part of a SAC step ([`sac_train_step_part`]): the
/// `rank`-th of `replicas` contiguous parts of each batch, and how f32
/// buffers are summed across the replicas (the learner's all-reduce; every
/// replica must end with the same bits).
pub struct BatchShare<'a> {
    pub rank: usize,
    pub replicas: usize,
    /// `None`: a learner alone (nothing to sum).
    pub sum: Option<SumAcross<'a>>,
    /// `None`: the call is never stopped part-way.
    pub stop: Option<StopCheck<'a>>,
}

impl BatchShare<'_> {
    /// Whether this is a learner alone.
    pub fn is_alone(&self) -> bool {
        self.sum.is_none()
    }

    /// A learner alone: its part is the whole batch.
    pub fn whole() -> Self {
        Self {
            rank: 0,
            replicas: 1,
            sum: None,
            stop: None,
        }
    }

    /// Whether the learner is stopping (never without a [`Self::stop`]).
    pub fn stopping(&self) -> bool {
        self.stop.is_some_and(|stop| stop())
    }

    /// The rows of this replica's part of a batch of `b` rows: the
    /// `rank`-th of `replicas` contiguous, near-equal parts.
    pub fn rows(&self, b: usize) -> std::ops::Range<usize> {
        self.rank * b / self.replicas..(self.rank + 1) * b / self.replicas
    }

    /// This replica's part of `items` ([`Self::rows`]).
    pub fn part<'i, T>(&self, items: &'i [T]) -> &'i [T] {
        &items[self.rows(items.len())]
    }

    /// Sums `data` across the replicas in place (alone: nothing to do).
    pub fn sum(&mut self, data: &mut [f32]) -> std::result::Result<(), ShareError> {
        match &mut self.sum {
            Some(sum) => sum(data),
            None => Ok(()),
        }
    }

    /// Checks that the replicas' summed shares (the `1.0` each weighted by
    /// its share) cover a whole batch: replicas that hold different
    /// batches fail here rather than train on a mixture.
    pub fn check_covered(covered: f32) -> std::result::Result<(), ShareError> {
        if (covered - 1.0).abs() > 1e-5 {
            return Err(ShareError::Uncovered { covered });
        }
        Ok(())
    }

    /// `grads` (`None`: this part is empty) of `vars`, and `extra`
    /// (statistics weighted as the loss), summed across the replicas: one
    /// buffer, one sum ([`Self::sum_each`]). Alone: `grads` as they are,
    /// `extra` unchanged.
    pub fn sum_gradients(
        &mut self,
        grads: Option<GradStore>,
        vars: &[Var],
        extra: &mut [f32],
    ) -> Result<GradStore> {
        let mut grads = match grads {
            Some(g) => g,
            // A store holding no var's gradient.
            None => Tensor::zeros((), DType::F32, vars[0].device())?.backward()?,
        };
        if self.is_alone() {
            return Ok(grads);
        }
        let mut each: Vec<Option<Tensor>> = vars.iter().map(|v| grads.get(v).cloned()).collect();
        self.sum_each(vars, &mut each, extra)?;
        for (var, grad) in vars.iter().zip(each) {
            match grad {
                Some(g) => grads.insert(var, g),
                None => grads.remove(var),
            };
        }
        Ok(grads)
    }

    /// Sums each of `vars`' gradient (`grads[i]`, `None`: none on this
    /// replica) and `extra` across the replicas in one f32 buffer, one
    /// sum: the one gradient flattener of every trainer (the policies'
    /// optimizers and the LLM's AdamW). A gradient is `Some` afterwards
    /// when any replica had one (the others count as zeros), so every
    /// replica steps the same parameters; it keeps its var's dtype.
    /// Alone: nothing to do.
    pub fn sum_each(
        &mut self,
        vars: &[Var],
        grads: &mut [Option<Tensor>],
        extra: &mut [f32],
    ) -> Result<()> {
        if self.is_alone() {
            return Ok(());
        }
        let sizes: Vec<usize> = vars.iter().map(|v| v.elem_count()).collect();
        let mut flat = Vec::with_capacity(vars.len() + sizes.iter().sum::<usize>() + extra.len());
        flat.extend(grads.iter().map(|g| if g.is_some() { 1f32 } else { 0.0 }));
        for (grad, &n) in grads.iter().zip(&sizes) {
            match grad {
                Some(g) => flat.extend(g.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?),
                None => flat.extend(std::iter::repeat_n(0f32, n)),
            }
        }
        let grads_end = flat.len();
        flat.extend_from_slice(extra);
        self.sum(&mut flat)?;
        extra.copy_from_slice(&flat[grads_end..]);
        let mut at = vars.len();
        for (i, (var, &n)) in vars.iter().zip(&sizes).enumerate() {
            grads[i] = if flat[i] > 0.0 {
                Some(
                    Tensor::from_slice(&flat[at..at + n], var.shape(), var.device())?
                        .to_dtype(var.dtype())?,
                )
            } else {
                None
            };
            at += n;
        }
        Ok(())
    }

    /// `opt`'s step on `grads` (`None`: this part is empty) summed across
    /// the replicas first.
    pub(crate) fn step(&mut self, opt: &mut Adam, grads: Option<GradStore>) -> Result<()> {
        let vars = opt.vars().to_vec();
        let grads = self.sum_gradients(grads, &vars, &mut [])?;
        opt.step(&grads)
    }
}
