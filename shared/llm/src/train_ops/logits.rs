//! Ops on logit rows: target log-probabilities and entropy, without
//! materialising the log-softmax.

use super::*;

/// Per row of logits: `(max, log Σ exp(z − max))`.
pub(crate) fn log_sum_exp(row: &[f32]) -> f32 {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f32 = row.iter().map(|z| (z - max).exp()).sum();
    max + sum.ln()
}

/// `log softmax(z)[target]` per row.
pub(crate) struct TargetLogProb {
    pub(crate) targets: Arc<Vec<u32>>,
}

impl CustomOp1 for TargetLogProb {
    fn name(&self) -> &'static str {
        "train-target-log-prob"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let z = contiguous(s, l, "target_log_probs")?;
        let (rows, vocab) = l.shape().dims2()?;
        if self.targets.len() != rows {
            bail!("{} targets for {rows} logit rows", self.targets.len());
        }
        if let Some(bad) = self.targets.iter().find(|&&t| t as usize >= vocab) {
            bail!("target {bad} outside a vocabulary of {vocab}");
        }
        let out: Vec<f32> = z
            .par_chunks(vocab)
            .zip(self.targets.par_iter())
            .map(|(row, &t)| row[t as usize] - log_sum_exp(row))
            .collect();
        Ok((CpuStorage::F32(out), rows.into()))
    }

    fn bwd(&self, arg: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let (rows, vocab) = arg.dims2()?;
        let dz = with_slice(arg, |z| {
            with_slice(grad, |g| {
                let mut dz = vec![0f32; rows * vocab];
                dz.par_chunks_mut(vocab)
                    .zip(z.par_chunks(vocab))
                    .zip(g.par_iter().zip(self.targets.par_iter()))
                    .for_each(|((dz, z), (&g, &t))| {
                        let lse = log_sum_exp(z);
                        for (d, z) in dz.iter_mut().zip(z) {
                            *d = -g * (z - lse).exp();
                        }
                        dz[t as usize] += g;
                    });
                dz
            })
        })??;
        Ok(Some(Tensor::from_vec(dz, (rows, vocab), &Device::Cpu)?))
    }
}

/// `log softmax(logits)[i, targets[i]]` for logits `(rows, vocab)` and
/// `targets` `(rows,)`: `(rows,)`, differentiable in the logits.
pub(crate) fn target_log_probs(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    if !fused_here(logits) {
        // Elsewhere (a GPU, another dtype): log-softmax and gather composed.
        let log_probs = candle_nn::ops::log_softmax(&logits.to_dtype(DType::F32)?, 1)?;
        let targets = targets.to_dtype(DType::U32)?.unsqueeze(1)?.contiguous()?;
        return log_probs.gather(&targets, 1)?.squeeze(1);
    }
    let targets = targets
        .to_dtype(candle_core::DType::U32)?
        .to_vec1::<u32>()?;
    logits.contiguous()?.apply_op1(TargetLogProb {
        targets: Arc::new(targets),
    })
}

/// `−Σ_v p_v log p_v` per row.
pub(crate) struct Entropy;

impl CustomOp1 for Entropy {
    fn name(&self) -> &'static str {
        "train-entropy"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let z = contiguous(s, l, "entropy")?;
        let (rows, vocab) = l.shape().dims2()?;
        let out: Vec<f32> = z
            .par_chunks(vocab)
            .map(|row| {
                let lse = log_sum_exp(row);
                -row.iter()
                    .map(|z| {
                        let log_p = z - lse;
                        log_p.exp() * log_p
                    })
                    .sum::<f32>()
            })
            .collect();
        Ok((CpuStorage::F32(out), rows.into()))
    }

    fn bwd(&self, arg: &Tensor, res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let (rows, vocab) = arg.dims2()?;
        // dH/dz_j = −p_j (log p_j + H).
        let dz = with_slice(arg, |z| {
            with_slice(res, |h| {
                with_slice(grad, |g| {
                    let mut dz = vec![0f32; rows * vocab];
                    dz.par_chunks_mut(vocab)
                        .zip(z.par_chunks(vocab))
                        .zip(g.par_iter().zip(h.par_iter()))
                        .for_each(|((dz, z), (&g, &h))| {
                            let lse = log_sum_exp(z);
                            for (d, z) in dz.iter_mut().zip(z) {
                                let log_p = z - lse;
                                *d = -g * log_p.exp() * (log_p + h);
                            }
                        });
                    dz
                })
            })
        })???;
        Ok(Some(Tensor::from_vec(dz, (rows, vocab), &Device::Cpu)?))
    }
}

/// Entropy of the softmax of each row of `logits` `(rows, vocab)`:
/// `(rows,)`, differentiable.
pub(crate) fn entropy(logits: &Tensor) -> Result<Tensor> {
    if !fused_here(logits) {
        let log_probs = candle_nn::ops::log_softmax(&logits.to_dtype(DType::F32)?, 1)?;
        return (log_probs.exp()? * &log_probs)?.sum(1)?.neg();
    }
    logits.contiguous()?.apply_op1(Entropy)
}

/// Whether the fused CPU ops take `t` (f32 on the CPU); the candle
/// backend's tensors elsewhere get the compositions of candle ops.
pub(crate) fn fused_here(t: &Tensor) -> bool {
    t.device().is_cpu() && t.dtype() == DType::F32
}
