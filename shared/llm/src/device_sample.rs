//! Sampling where the logits are (the candle backend): [`sample_rows`]
//! draws one token for each row of a `(rows, vocab)` f32 logits tensor on
//! its device, and only five floats a row cross to the host (the token,
//! its two log-probabilities, a bad-value count and the best masked
//! logit) instead of the whole vocabulary.
//!
//! It is the draw of [`crate::Sampler::sample`] and
//! [`crate::Sampler::sample_among`]: the same parameters, the same
//! uniform number from the sequence's own stream (one per non-greedy
//! draw), and the token is where that number falls in the cumulative
//! weights. So on the same logits the two pick the same token, except:
//! * the device sums weights in f32 (the host in f64), so a draw within
//!   float rounding of a boundary may pick the neighbouring token;
//! * top-k keeps every token tied with the k-th (the host keeps exactly
//!   k, ties broken by id), and top-k and top-p ignore tokens whose
//!   weight is under e^-60 of the best one's (no probability mass to
//!   speak of).
//!
//! Built from candle ops only (no custom kernel), each over the whole
//! batch at once:
//! * the policy's log-probability: log-softmax at temperature 1 over the
//!   unmasked row;
//! * constraints: the allowed tokens scattered into a mask;
//! * top-k and top-p: a threshold on each row's log-weights found by
//!   bisection (40 halvings of [-60, 0], a count or a mass per halving).
//!   candle's CUDA sort sorts a row in shared memory, which a vocabulary
//!   of 150k does not fit;
//! * the draw: a scan of the weights in two levels (sums of chunks of 1024
//!   tokens, then the tokens of the chunk the number falls in), each a
//!   matmul with a triangular matrix of ones.
//!
//! A drawn token of no weight (the f32 scan ran past the last one) is
//! drawn again on the host from that row alone, with the same number.

use candle_core::{DType, Device, Tensor, D};

use crate::model_error::{ModelError, Result};
use crate::sampling::{sample_masked, Sampled, SamplingParams};

/// Tokens per chunk of the two-level scan.
const CHUNK: usize = 1024;
/// Log-weight (relative to the best token) below which top-k and top-p do
/// not look.
const LOG_WEIGHT_FLOOR: f64 = -60.0;
/// Halvings of the bisection for a top-k or top-p threshold.
const HALVINGS: usize = 40;

/// One row's draw.
#[derive(Debug, Clone)]
pub(crate) struct RowDraw {
    pub params: SamplingParams,
    /// The sequence's next uniform number in [0, 1) (unused when greedy).
    pub uniform: f64,
    /// Only these tokens may be drawn.
    pub allowed: Option<Vec<u32>>,
}

/// Draws one token per row of `logits` `(rows.len(), vocab)` on their
/// device (see the module docs).
pub(crate) fn sample_rows(logits: &Tensor, rows: &[RowDraw]) -> Result<Vec<Sampled>> {
    let (n, vocab) = logits.dims2()?;
    if n != rows.len() {
        return Err(ModelError::BadInput(format!(
            "{} draws for {n} rows of logits",
            rows.len()
        )));
    }
    if vocab == 0 {
        return Err(ModelError::BadInput("no logits to sample from".into()));
    }
    for allowed in rows.iter().filter_map(|r| r.allowed.as_ref()) {
        if let Some(bad) = allowed.iter().find(|&&t| t as usize >= vocab) {
            return Err(ModelError::BadInput(format!(
                "allowed token {bad} is outside the vocabulary of {vocab}"
            )));
        }
    }
    let device = logits.device();
    let column = |values: Vec<f32>| Tensor::from_vec(values, (n, 1), device);
    let logits = logits.to_dtype(DType::F32)?.contiguous()?;
    // NaN and +inf count per row.
    let bad = (logits.ne(&logits)?.to_dtype(DType::F32)?
        + logits.eq(f32::INFINITY)?.to_dtype(DType::F32)?)?
    .sum_keepdim(1)?;
    // The policy: log-softmax at temperature 1, unmasked.
    let max = logits.max_keepdim(1)?;
    let log_total = (logits.broadcast_sub(&max)?.exp()?.sum_keepdim(1)?.log()? + &max)?;
    let neg_inf = Tensor::full(f32::NEG_INFINITY, (n, vocab), device)?;
    let masked = constrain(&logits, rows, &neg_inf)?;
    let masked_max = masked.max_keepdim(1)?;
    let best = masked.argmax_keepdim(1)?.to_dtype(DType::F32)?;
    // Log-weights after temperature: 0 at the best token, -inf masked.
    let inv_t = column(
        rows.iter()
            .map(|r| match r.params.temperature {
                t if t > 0.0 => 1.0 / t,
                _ => 1.0,
            })
            .collect(),
    )?;
    let mut log_w = masked.broadcast_sub(&masked_max)?.broadcast_mul(&inv_t)?;
    if rows
        .iter()
        .any(|r| r.params.top_k > 0 && r.params.top_k < vocab)
    {
        let k = column(
            rows.iter()
                .map(|r| match r.params.top_k {
                    0 => vocab as f32,
                    k => k.min(vocab) as f32,
                })
                .collect(),
        )?;
        // The highest threshold keeping at least k tokens.
        let threshold = bisect(n, device, |mid| {
            Ok(log_w
                .broadcast_ge(mid)?
                .to_dtype(DType::F32)?
                .sum_keepdim(1)?
                .ge(&k)?)
        })?;
        log_w = log_w
            .broadcast_ge(&threshold)?
            .where_cond(&log_w, &neg_inf)?;
    }
    if rows.iter().any(|r| r.params.top_p < 1.0) {
        let w = log_w.exp()?;
        // Rows without top-p ask for more than the whole mass: never
        // reached, so their threshold stays at the floor.
        let share = column(
            rows.iter()
                .map(|r| {
                    if r.params.top_p < 1.0 {
                        r.params.top_p
                    } else {
                        2.0
                    }
                })
                .collect(),
        )?;
        let wanted = w.sum_keepdim(1)?.mul(&share)?;
        // The highest threshold keeping at least top_p of the mass.
        let threshold = bisect(n, device, |mid| {
            let kept = log_w.broadcast_ge(mid)?.to_dtype(DType::F32)?;
            Ok((w.mul(&kept)?.sum_keepdim(1)?).ge(&wanted)?)
        })?;
        log_w = log_w
            .broadcast_ge(&threshold)?
            .where_cond(&log_w, &neg_inf)?;
    }
    let weights = log_w.exp()?;
    let uniforms = column(rows.iter().map(|r| r.uniform as f32).collect())?;
    let (drawn, total) = scan_draw(&weights, &uniforms)?;
    let greedy = column(
        rows.iter()
            .map(|r| (r.params.temperature == 0.0) as u8 as f32)
            .collect(),
    )?
    .ne(0f32)?;
    let token = greedy.where_cond(&best, &drawn)?;
    let token_ids = token.to_dtype(DType::U32)?;
    let logprob = (logits.gather(&token_ids, 1)? - &log_total)?;
    let sampling_logprob = greedy.where_cond(
        &Tensor::zeros((n, 1), DType::F32, device)?,
        &weights.gather(&token_ids, 1)?.div(&total)?.log()?,
    )?;
    let out: Vec<Vec<f32>> =
        Tensor::cat(&[&token, &logprob, &sampling_logprob, &bad, &masked_max], 1)?.to_vec2()?;
    out.into_iter()
        .zip(rows)
        .enumerate()
        .map(|(i, (row, draw_of))| {
            let [token, logprob, sampling_logprob, bad, masked_max] = row[..] else {
                unreachable!("five columns")
            };
            if bad > 0.0 {
                return Err(ModelError::BadInput("logits hold NaN or +inf".into()));
            }
            if masked_max == f32::NEG_INFINITY {
                return Err(ModelError::BadInput("every token is masked out".into()));
            }
            if sampling_logprob == f32::NEG_INFINITY {
                return redraw_on_host(&logits, i, draw_of);
            }
            Ok(Sampled {
                token: token as u32,
                logprob,
                sampling_logprob,
            })
        })
        .collect()
}

/// `logits` with every token outside a constrained row's allowed ones set
/// to -inf.
fn constrain(logits: &Tensor, rows: &[RowDraw], neg_inf: &Tensor) -> Result<Tensor> {
    if rows.iter().all(|r| r.allowed.is_none()) {
        return Ok(logits.clone());
    }
    let (n, vocab) = logits.dims2()?;
    let device = logits.device();
    let mut kept = Vec::new();
    let mut free = Vec::with_capacity(n);
    for (i, r) in rows.iter().enumerate() {
        free.push(r.allowed.is_none() as u8 as f32);
        for &t in r.allowed.iter().flatten() {
            kept.push((i * vocab + t as usize) as u32);
        }
    }
    let keep = Tensor::zeros(n * vocab, DType::F32, device)?;
    if !kept.is_empty() {
        let m = kept.len();
        keep.scatter_set(
            &Tensor::from_vec(kept, m, device)?,
            &Tensor::ones(m, DType::F32, device)?,
            0,
        )?;
    }
    let keep = keep
        .reshape((n, vocab))?
        .broadcast_maximum(&Tensor::from_vec(free, (n, 1), device)?)?
        .ne(0f32)?;
    Ok(keep.where_cond(logits, neg_inf)?)
}

/// The highest per-row threshold in [LOG_WEIGHT_FLOOR, 0] at which
/// `reaches` (a `(rows, 1)` u8 of the rows where a threshold `mid` still
/// keeps enough) holds, to 60 / 2^40.
fn bisect(
    n: usize,
    device: &Device,
    reaches: impl Fn(&Tensor) -> Result<Tensor>,
) -> Result<Tensor> {
    let mut lo = Tensor::full(LOG_WEIGHT_FLOOR as f32, (n, 1), device)?;
    let mut hi = Tensor::zeros((n, 1), DType::F32, device)?;
    for _ in 0..HALVINGS {
        let mid = ((&lo + &hi)? * 0.5)?;
        let ok = reaches(&mid)?;
        lo = ok.where_cond(&mid, &lo)?;
        hi = ok.where_cond(&hi, &mid)?;
    }
    Ok(lo)
}

/// Upper-triangular ones `(size, size)`, diagonal included: a row times
/// it is the row's inclusive running sum.
fn running_sum_matrix(size: usize, device: &Device) -> Result<Tensor> {
    let i = Tensor::arange(0u32, size as u32, device)?;
    Ok(i.unsqueeze(1)?
        .broadcast_le(&i.unsqueeze(0)?)?
        .to_dtype(DType::F32)?)
}

/// The token of each row where `uniforms * total` falls in the row's
/// cumulative `weights` `(rows, vocab)` (f32, as a token id), and the
/// row's total weight, both `(rows, 1)`.
fn scan_draw(weights: &Tensor, uniforms: &Tensor) -> Result<(Tensor, Tensor)> {
    let (n, vocab) = weights.dims2()?;
    let device = weights.device();
    let chunks = vocab.div_ceil(CHUNK);
    let padded = if chunks * CHUNK > vocab {
        Tensor::cat(
            &[
                weights,
                &Tensor::zeros((n, chunks * CHUNK - vocab), DType::F32, device)?,
            ],
            1,
        )?
    } else {
        weights.clone()
    };
    let by_chunk = padded.reshape((n, chunks, CHUNK))?;
    let chunk_sums = by_chunk.sum(D::Minus1)?;
    let cumulative = chunk_sums.matmul(&running_sum_matrix(chunks, device)?)?;
    let total = cumulative.narrow(1, chunks - 1, 1)?;
    let target = (uniforms * &total)?;
    // The first chunk whose running sum passes the target.
    let chunk = cumulative
        .broadcast_le(&target)?
        .to_dtype(DType::F32)?
        .sum_keepdim(1)?
        .minimum((chunks - 1) as f32)?;
    let chunk_ids = chunk.to_dtype(DType::U32)?;
    let before = (cumulative.gather(&chunk_ids, 1)? - chunk_sums.gather(&chunk_ids, 1)?)?;
    let row_of_chunk = (Tensor::arange(0u32, n as u32, device)?
        .to_dtype(DType::F32)?
        .unsqueeze(1)?
        * chunks as f64
        + &chunk)?
        .squeeze(1)?
        .to_dtype(DType::U32)?;
    let within = by_chunk
        .reshape((n * chunks, CHUNK))?
        .index_select(&row_of_chunk, 0)?
        .matmul(&running_sum_matrix(CHUNK, device)?)?
        .broadcast_add(&before)?;
    let offset = within
        .broadcast_le(&target)?
        .to_dtype(DType::F32)?
        .sum_keepdim(1)?
        .minimum((CHUNK - 1) as f32)?;
    let token = ((chunk * CHUNK as f64)? + offset)?.minimum((vocab - 1) as f32)?;
    Ok((token, total))
}

/// Row `i` drawn on the host with the same number (see the module docs).
fn redraw_on_host(logits: &Tensor, i: usize, row: &RowDraw) -> Result<Sampled> {
    let values: Vec<f32> = logits.get(i)?.to_vec1()?;
    sample_masked(&row.params, &values, row.allowed.as_deref(), || row.uniform)
}

#[cfg(test)]
mod tests {
    use rand::{Rng, SeedableRng};

    use super::*;
    use crate::sampling::Sampler;

    /// Rows of distinct random logits (no ties, so top-k means the same
    /// on both sides), spread like a language model's.
    fn random_logits(rows: usize, vocab: usize, seed: u64) -> Vec<Vec<f32>> {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        (0..rows)
            .map(|_| {
                (0..vocab)
                    .map(|_| rng.random::<f32>() * 12.0 - 6.0)
                    .collect()
            })
            .collect()
    }

    fn params(temperature: f32, top_k: usize, top_p: f32) -> SamplingParams {
        SamplingParams {
            temperature,
            top_k,
            top_p,
        }
    }

    /// On the same logits and numbers, the device's draws are the host
    /// sampler's: the same tokens, and log-probabilities equal to float
    /// precision, for every kind of draw side by side in one batch, with a
    /// vocabulary inside one chunk and one over several.
    #[test]
    fn device_draws_are_the_host_sampler_s() {
        let kinds = [
            (params(0.0, 0, 1.0), None),
            (params(1.0, 0, 1.0), None),
            (params(0.7, 0, 1.0), None),
            (params(1.0, 5, 1.0), None),
            (params(1.0, 0, 0.9), None),
            (params(0.8, 40, 0.5), None),
            (params(1.0, 0, 1.0), Some(vec![3u32, 17, 101, 250])),
            (params(0.0, 0, 1.0), Some(vec![9u32, 200])),
            (params(1.2, 2, 1.0), Some(vec![1u32, 2, 3, 4, 5])),
        ];
        for vocab in [384, 3000] {
            let mut mismatches = 0;
            for round in 0..20u64 {
                let logits = random_logits(kinds.len(), vocab, round + vocab as u64);
                let mut hosts: Vec<Sampler> = kinds
                    .iter()
                    .enumerate()
                    .map(|(i, (p, _))| Sampler::new(p.clone(), round * 100 + i as u64).unwrap())
                    .collect();
                let mut devices = hosts.clone();
                let rows: Vec<RowDraw> = kinds
                    .iter()
                    .zip(&mut devices)
                    .map(|((p, allowed), sampler)| RowDraw {
                        params: p.clone(),
                        uniform: if p.temperature > 0.0 {
                            sampler.next_uniform()
                        } else {
                            0.0
                        },
                        allowed: allowed.clone(),
                    })
                    .collect();
                let flat: Vec<f32> = logits.iter().flatten().copied().collect();
                let tensor = Tensor::from_vec(flat, (kinds.len(), vocab), &Device::Cpu).unwrap();
                let got = sample_rows(&tensor, &rows).unwrap();
                for (((row, (_, allowed)), host), got) in
                    logits.iter().zip(&kinds).zip(&mut hosts).zip(got)
                {
                    let want = match allowed {
                        Some(allowed) => host.sample_among(row, allowed).unwrap(),
                        None => host.sample(row).unwrap(),
                    };
                    if want.token != got.token {
                        mismatches += 1;
                        continue;
                    }
                    assert!(
                        (want.logprob - got.logprob).abs() < 1e-4,
                        "{want:?} {got:?}"
                    );
                    assert!(
                        (want.sampling_logprob - got.sampling_logprob).abs() < 1e-3,
                        "{want:?} {got:?}"
                    );
                }
            }
            // f32 against f64 sums: a boundary case at most, not a habit.
            assert!(
                mismatches <= 1,
                "vocab {vocab}: {mismatches} of 180 draws differ"
            );
        }
    }

    /// Draws at temperature 1 follow the softmax: frequencies over many
    /// numbers match the probabilities.
    #[test]
    fn device_draws_follow_the_distribution() {
        let logits = [2.0f32, 1.0, 0.0, -1.0, 0.5, 1.5];
        let total: f64 = logits.iter().map(|&x| (x as f64).exp()).sum();
        let n = 6000;
        let rows: Vec<RowDraw> = (0..n)
            .map(|i| RowDraw {
                params: params(1.0, 0, 1.0),
                uniform: (i as f64 + 0.5) / n as f64,
                allowed: None,
            })
            .collect();
        let tensor = Tensor::from_vec(logits.repeat(n), (n, logits.len()), &Device::Cpu).unwrap();
        let got = sample_rows(&tensor, &rows).unwrap();
        for (token, &x) in logits.iter().enumerate() {
            let share = got.iter().filter(|s| s.token as usize == token).count() as f64 / n as f64;
            let p = (x as f64).exp() / total;
            assert!((share - p).abs() < 1e-3, "token {token}: {share} vs {p}");
        }
    }

    /// NaN or +inf logits, a row with nothing allowed and an allowed token
    /// outside the vocabulary are errors that say so.
    #[test]
    fn bad_rows_are_errors() {
        let draw = |allowed: Option<Vec<u32>>| RowDraw {
            params: params(1.0, 0, 1.0),
            uniform: 0.5,
            allowed,
        };
        let row = |values: Vec<f32>| Tensor::from_vec(values, (1, 3), &Device::Cpu).unwrap();
        let err = |t: &Tensor, d: RowDraw| sample_rows(t, &[d]).unwrap_err().to_string();
        assert!(err(&row(vec![0.0, f32::NAN, 1.0]), draw(None)).contains("NaN"));
        assert!(err(&row(vec![0.0, f32::INFINITY, 1.0]), draw(None)).contains("+inf"));
        let masked = row(vec![f32::NEG_INFINITY, 0.0, 1.0]);
        assert!(err(&masked, draw(Some(vec![0]))).contains("masked out"));
        assert!(err(&masked, draw(Some(vec![7]))).contains("outside the vocabulary"));
    }
}
