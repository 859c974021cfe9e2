//! A learner replica's part of a train step (issue 46's data-parallel
//! learner): [`BatchShare`] says which contiguous part of each batch is
//! this replica's and how f32 buffers are summed across the replicas. The
//! sum itself (the learner's all-reduce over its group) is the caller's:
//! this crate stays free of networking.

use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor};

use crate::error::{NnError, Result};
use crate::optim::Adam;

/// Sums f32 buffers across learner replicas in place; an error says why not.
pub type SumAcross<'a> = &'a mut dyn FnMut(&mut [f32]) -> std::result::Result<(), String>;

/// A learner replica's part of a SAC step ([`sac_train_step_part`]): the
/// `rank`-th of `replicas` contiguous parts of each batch, and how f32
/// buffers are summed across the replicas (the learner's all-reduce; every
/// replica must end with the same bits).
pub struct BatchShare<'a> {
    pub rank: usize,
    pub replicas: usize,
    /// `None`: a learner alone (nothing to sum).
    pub sum: Option<SumAcross<'a>>,
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
        }
    }

    /// The rows of this replica's part of a batch of `b` rows.
    pub fn rows(&self, b: usize) -> std::ops::Range<usize> {
        self.rank * b / self.replicas..(self.rank + 1) * b / self.replicas
    }

    /// Sums `data` across the replicas in place (alone: nothing to do).
    pub fn sum(&mut self, data: &mut [f32]) -> Result<()> {
        match &mut self.sum {
            Some(sum) => sum(data).map_err(NnError::Replicas),
            None => Ok(()),
        }
    }

    /// `opt`'s step on `loss`'s gradients (`None`: this part is empty),
    /// summed across the replicas first; alone, just the step.
    pub(crate) fn step(&mut self, opt: &mut Adam, loss: Option<GradStore>) -> Result<()> {
        if self.sum.is_none() {
            return match loss {
                Some(grads) => opt.step(&grads),
                None => Ok(()),
            };
        }
        let vars = opt.vars().to_vec();
        let mut grads = match loss {
            Some(g) => g,
            None => Tensor::zeros((), DType::F32, vars[0].device())?.backward()?,
        };
        let mut flat = Vec::with_capacity(vars.iter().map(|v| v.elem_count()).sum::<usize>());
        for var in &vars {
            match grads.get(var) {
                Some(g) => flat.extend(g.flatten_all()?.to_vec1::<f32>()?),
                None => flat.extend(std::iter::repeat_n(0f32, var.elem_count())),
            }
        }
        self.sum(&mut flat)?;
        let mut at = 0;
        for var in &vars {
            let len = var.elem_count();
            grads.insert(
                var,
                Tensor::from_slice(&flat[at..at + len], var.shape(), var.device())?,
            );
            at += len;
        }
        opt.step(&grads)
    }
}
