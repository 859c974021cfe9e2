//! Recurrent cores of the actor-critic (`policy.recurrent`): stacks of LSTM
//! or GRU cells between the features (the observation, or a CNN's
//! features) and the MLP trunks, as sb3-contrib's `RecurrentPPO` places
//! its LSTMs.
//!
//! # Parameters
//!
//! PyTorch's `nn.LSTM` / `nn.GRU` layout and names, so that sb3-contrib's
//! `lstm_actor` / `lstm_critic` load as they are: for layer `k` of core
//! `{cell}_{actor|critic}`, `weight_ih_l{k}` `[G H, in]`, `weight_hh_l{k}`
//! `[G H, H]`, `bias_ih_l{k}` and `bias_hh_l{k}` `[G H]`, the `G` gate
//! blocks in PyTorch's order (LSTM: i, f, g, o; GRU: r, z, n), all drawn
//! uniform in `±1/sqrt(H)` as PyTorch draws them. A shared trunk has one
//! core, `{cell}_actor`, for both heads (sb3-contrib's `shared_lstm`).
//!
//! # State
//!
//! An env's state is one row of [`Core::state_width`] values per core, the
//! actor's first: per layer `h`, then (LSTM) `c`. Zeros start an episode.
//! The same cell runs on two paths:
//!
//! - [`Core::step_host`]: one step of `n` rows without a graph (acting),
//!   the projections on the dense layers' host path (`layers`);
//! - [`Core::unroll`]: `T` steps of `B` sequences as a differentiable graph
//!   (training: backpropagation through time over a fragment), the state
//!   zeroed before every step that starts an episode, from each sequence's
//!   state at its first step.
//!
//! LSTM: `i, f, o = σ(·)`, `g = tanh(·)` of `x W_ih^T + b_ih + h W_hh^T +
//! b_hh`; `c' = f c + i g`, `h' = o tanh(c')`. GRU: `r, z = σ(·)` of the
//! same sums, `n = tanh(x W_in^T + b_in + r (h W_hn^T + b_hn))`,
//! `h' = (1 - z) n + z h`.

use std::borrow::Cow;

use candle_core::{Device, IndexOp, Tensor, Var};

use crate::error::Result;
use crate::init::Init;
use crate::layers::{dense_host, Dense};
use crate::ops;
pub use relay_config::hyper::policy::{CellKind, RecurrentSpec};

/// One cell's parameters (PyTorch layout).
#[derive(Clone)]
struct Cell {
    ih: Dense,
    hh: Dense,
}

/// A stack of cells: an actor's or a critic's core.
#[derive(Clone)]
pub(crate) struct Core {
    kind: CellKind,
    hidden: usize,
    cells: Vec<Cell>,
}

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

impl Core {
    /// A core of `spec` reading `input` values, its parameters registered
    /// in `params` as `{name}.weight_ih_l{k}`, ...
    pub(crate) fn new(
        name: &str,
        spec: &RecurrentSpec,
        input: usize,
        init: &mut Init<'_>,
        params: &mut Vec<(String, Var)>,
        device: &Device,
    ) -> Result<Self> {
        let (h, g) = (spec.hidden, spec.cell.gates());
        let mut tensor = |suffix: &str, shape: &[usize], init: &mut Init<'_>| -> Result<Var> {
            let values = init.uniform_fan_in(shape.iter().product(), h);
            let var = Var::from_vec(values, shape, device)?;
            params.push((format!("{name}.{suffix}"), var.clone()));
            Ok(var)
        };
        let mut cells = Vec::with_capacity(spec.layers);
        for k in 0..spec.layers {
            let inp = if k == 0 { input } else { h };
            let w_ih = tensor(&format!("weight_ih_l{k}"), &[g * h, inp], init)?;
            let w_hh = tensor(&format!("weight_hh_l{k}"), &[g * h, h], init)?;
            let b_ih = tensor(&format!("bias_ih_l{k}"), &[g * h], init)?;
            let b_hh = tensor(&format!("bias_hh_l{k}"), &[g * h], init)?;
            cells.push(Cell {
                ih: Dense { w: w_ih, b: b_ih },
                hh: Dense { w: w_hh, b: b_hh },
            });
        }
        Ok(Self {
            kind: spec.cell,
            hidden: h,
            cells,
        })
    }

    /// State values per row: `layers * (2 | 1) * hidden`.
    pub(crate) fn state_width(&self) -> usize {
        self.cells.len() * self.kind.state_vectors() * self.hidden
    }

    /// Width of its output (the last layer's `h`).
    pub(crate) fn hidden(&self) -> usize {
        self.hidden
    }

    /// One step of `n` rows `x` (`n * in_dim` values) without a graph:
    /// updates this core's part of `state` (rows of `row_width` values, the
    /// core's `state_width` of them from `offset`) in place and returns the
    /// last layer's `h`.
    pub(crate) fn step_host(
        &self,
        x: &[f32],
        n: usize,
        in_dim: usize,
        state: &mut [f32],
        row_width: usize,
        offset: usize,
    ) -> Result<Vec<f32>> {
        let (h, sw) = (self.hidden, row_width);
        let per_layer = self.kind.state_vectors() * h;
        let mut input: Cow<'_, [f32]> = Cow::Borrowed(x);
        let mut width = in_dim;
        for (k, cell) in self.cells.iter().enumerate() {
            let h_prev: Vec<f32> = (0..n)
                .flat_map(|r| {
                    let at = r * sw + offset + k * per_layer;
                    state[at..at + h].iter().copied()
                })
                .collect();
            let gx = dense_host(&cell.ih, input, n, width, None)?;
            let gh = dense_host(&cell.hh, Cow::Owned(h_prev), n, h, None)?;
            let g = self.kind.gates() * h;
            let mut out = vec![0f32; n * h];
            for r in 0..n {
                let (gx, gh) = (&gx[r * g..(r + 1) * g], &gh[r * g..(r + 1) * g]);
                let at = r * sw + offset + k * per_layer;
                let row = &mut state[at..at + per_layer];
                match self.kind {
                    CellKind::Lstm => {
                        let (hs, cs) = row.split_at_mut(h);
                        for j in 0..h {
                            let gate = |b: usize| gx[b * h + j] + gh[b * h + j];
                            let (i, f) = (sigmoid(gate(0)), sigmoid(gate(1)));
                            let (c_in, o) = (gate(2).tanh(), sigmoid(gate(3)));
                            let c = f * cs[j] + i * c_in;
                            cs[j] = c;
                            hs[j] = o * c.tanh();
                        }
                        out[r * h..(r + 1) * h].copy_from_slice(hs);
                    }
                    CellKind::Gru => {
                        for j in 0..h {
                            let rg = sigmoid(gx[j] + gh[j]);
                            let z = sigmoid(gx[h + j] + gh[h + j]);
                            let nn = (gx[2 * h + j] + rg * gh[2 * h + j]).tanh();
                            row[j] = (1.0 - z) * nn + z * row[j];
                        }
                        out[r * h..(r + 1) * h].copy_from_slice(&row[..h]);
                    }
                }
            }
            input = Cow::Owned(out);
            width = h;
        }
        Ok(input.into_owned())
    }

    /// `T` steps of `B` sequences as a differentiable graph: `x` is `[T B,
    /// in]` time-major (row `t B + b` is sequence `b`'s step `t`), `keep`
    /// `[T, B, 1]` (0 where step `t` starts an episode: the state is zeroed
    /// before it), `initial` `[B, state_width]` (the sequences' states at
    /// their first step, no gradient). Returns the last layer's `h` of every
    /// step, `[T B, H]`, in `x`'s order, and the state after the last step
    /// `[B, state_width]`.
    pub(crate) fn unroll(
        &self,
        x: &Tensor,
        t_len: usize,
        b: usize,
        keep: &Tensor,
        initial: &Tensor,
    ) -> Result<(Tensor, Tensor)> {
        let h = self.hidden;
        let per_layer = self.kind.state_vectors() * h;
        // Each step's input as its own tensor: a step's slice of one
        // tensor of all steps would cost a zero-padded copy of the whole
        // tensor in the backward pass (candle's gradient of `narrow`), so
        // slicing `T` steps would cost O(T^2). Observations carry no
        // gradient, so their slices cost nothing backward (a CNN's features
        // do: that case pays the padded copies); a layer above the first
        // reads the step outputs of the one below as they are.
        let mut inputs: Vec<Tensor> = (0..t_len)
            .map(|t| x.narrow(0, t * b, b))
            .collect::<candle_core::Result<_>>()?;
        let mut finals = Vec::with_capacity(self.cells.len() * self.kind.state_vectors());
        for (k, cell) in self.cells.iter().enumerate() {
            let base = k * per_layer;
            let mut hs = initial.narrow(1, base, h)?;
            let mut cs = match self.kind {
                CellKind::Lstm => Some(initial.narrow(1, base + h, h)?),
                CellKind::Gru => None,
            };
            let mut outs = Vec::with_capacity(t_len);
            for (t, input) in inputs.iter().enumerate() {
                let keep_t = keep.i(t)?;
                hs = hs.broadcast_mul(&keep_t)?;
                cs = cs.map(|c| c.broadcast_mul(&keep_t)).transpose()?;
                let gx_t = ops::linear(input, cell.ih.w.as_tensor(), cell.ih.b.as_tensor(), None)?;
                let gh = ops::linear(&hs, cell.hh.w.as_tensor(), cell.hh.b.as_tensor(), None)?;
                let block = |g: &Tensor, i: usize| g.narrow(1, i * h, h);
                match self.kind {
                    CellKind::Lstm => {
                        let gates = (gx_t + gh)?;
                        let i = candle_nn::ops::sigmoid(&block(&gates, 0)?)?;
                        let f = candle_nn::ops::sigmoid(&block(&gates, 1)?)?;
                        let g = block(&gates, 2)?.tanh()?;
                        let o = candle_nn::ops::sigmoid(&block(&gates, 3)?)?;
                        let c = ((f * cs.as_ref().expect("an LSTM has c"))? + (i * g)?)?;
                        hs = (o * c.tanh()?)?;
                        cs = Some(c);
                    }
                    CellKind::Gru => {
                        let r = candle_nn::ops::sigmoid(&(block(&gx_t, 0)? + block(&gh, 0)?)?)?;
                        let z = candle_nn::ops::sigmoid(&(block(&gx_t, 1)? + block(&gh, 1)?)?)?;
                        let n = (block(&gx_t, 2)? + (r * block(&gh, 2)?)?)?.tanh()?;
                        hs = ((z.affine(-1.0, 1.0)? * n)? + (z * &hs)?)?;
                    }
                }
                outs.push(hs.clone());
            }
            finals.push(hs);
            finals.extend(cs);
            inputs = outs;
        }
        let input = Tensor::stack(&inputs, 0)?.reshape((t_len * b, h))?;
        Ok((input, Tensor::cat(&finals, 1)?))
    }
}
