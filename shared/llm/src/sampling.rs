//! Drawing a token from one row of logits on the host: [`SamplingParams`]
//! (greedy, temperature, top-k, top-p), the seeded [`Sampler`] that holds
//! them with its own random stream, and [`Sampled`], the drawn token with
//! its two log-probabilities (the policy's, and that of the distribution
//! actually drawn from; see [`crate::generate`](mod@crate::generate)).
//!
//! Its own module because both the batched decoder ([`crate::generate`](mod@crate::generate))
//! and the device sampler (`device_sample`, which draws on the logits'
//! device the same way and falls back to `sample_masked` on the host)
//! build on it: the imports run from them to here, never between them.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::model_error::{ModelError, Result};

/// How to pick the next token from the logits.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// Divides the logits before sampling; `0` means greedy (argmax).
    pub temperature: f32,
    /// Keep only the `top_k` most likely tokens; `0` keeps all.
    pub top_k: usize,
    /// Keep the smallest set of most likely tokens whose probability
    /// (after temperature and top-k) reaches `top_p`; `1` keeps all.
    pub top_p: f32,
}

impl Default for SamplingParams {
    /// Plain sampling from the policy: temperature 1, no truncation.
    fn default() -> Self {
        Self {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
        }
    }
}

impl SamplingParams {
    /// Always the most likely token.
    pub fn greedy() -> Self {
        Self {
            temperature: 0.0,
            ..Self::default()
        }
    }

    /// Checks the ranges.
    pub fn validate(&self) -> Result<()> {
        if !(self.temperature >= 0.0 && self.temperature.is_finite()) {
            return Err(ModelError::config(
                "temperature",
                format!("{} is not a finite value >= 0", self.temperature),
            ));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(ModelError::config(
                "top_p",
                format!("{} is not in (0, 1]", self.top_p),
            ));
        }
        Ok(())
    }
}

/// A sampled token and its log-probabilities (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sampled {
    /// The token.
    pub token: u32,
    /// Log-probability under the policy at temperature 1, full vocabulary.
    pub logprob: f32,
    /// Log-probability under the distribution actually sampled from.
    pub sampling_logprob: f32,
}

/// Draws tokens from logits with its own seeded random stream.
#[derive(Debug, Clone)]
pub struct Sampler {
    params: SamplingParams,
    rng: ChaCha8Rng,
}

/// `log_softmax(logits)[token]` in f64.
pub(crate) fn policy_logprob(logits: &[f32], token: usize) -> f32 {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let sum: f64 = logits.iter().map(|&x| (x as f64 - max).exp()).sum();
    (logits[token] as f64 - max - sum.ln()) as f32
}

impl Sampler {
    /// A sampler with these parameters; the same seed draws the same
    /// tokens from the same logits.
    pub fn new(params: SamplingParams, seed: u64) -> Result<Self> {
        params.validate()?;
        Ok(Self {
            params,
            rng: ChaCha8Rng::seed_from_u64(seed),
        })
    }

    /// A greedy sampler (no randomness).
    pub fn greedy() -> Self {
        Self {
            params: SamplingParams::greedy(),
            rng: ChaCha8Rng::seed_from_u64(0),
        }
    }

    /// The sampler's parameters.
    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Picks a token from one position's logits (`vocab` values; `-inf`
    /// masks a token out, NaN is an error).
    pub fn sample(&mut self, logits: &[f32]) -> Result<Sampled> {
        let rng = &mut self.rng;
        sample_masked(&self.params, logits, None, || rng.random())
    }

    /// The next number of the stream, uniform in [0, 1): what one
    /// non-greedy draw takes.
    pub(crate) fn next_uniform(&mut self) -> f64 {
        self.rng.random::<f64>()
    }
}

/// One draw from a row of `logits` (`-inf` masks a token out, NaN is an
/// error), only among `allowed` if given, taking `uniform()` (a number in
/// [0, 1)) unless greedy: [`Sampler::sample`] and [`Sampler::sample_among`]
/// with the sampler's stream, the device sampler's host fallback with the
/// number it already took. `logprob` is the policy's over the unmasked
/// row.
pub(crate) fn sample_masked(
    params: &SamplingParams,
    logits: &[f32],
    allowed: Option<&[u32]>,
    uniform: impl FnOnce() -> f64,
) -> Result<Sampled> {
    if logits.is_empty() {
        return Err(ModelError::BadInput("no logits to sample from".into()));
    }
    if let Some(bad) = allowed
        .into_iter()
        .flatten()
        .find(|&&t| t as usize >= logits.len())
    {
        return Err(ModelError::BadInput(format!(
            "allowed token {bad} is outside the vocabulary of {}",
            logits.len()
        )));
    }
    if logits.iter().any(|x| x.is_nan() || *x == f32::INFINITY) {
        return Err(ModelError::BadInput("logits hold NaN or +inf".into()));
    }
    let masked;
    let row = match allowed {
        None => logits,
        Some(allowed) => {
            let mut m = vec![f32::NEG_INFINITY; logits.len()];
            for &t in allowed {
                m[t as usize] = logits[t as usize];
            }
            masked = m;
            &masked
        }
    };
    let best = row
        .iter()
        .enumerate()
        .fold(0, |best, (i, &x)| if x > row[best] { i } else { best });
    if row[best] == f32::NEG_INFINITY {
        return Err(ModelError::BadInput("every token is masked out".into()));
    }
    let (token, sampling_logprob) = if params.temperature == 0.0 {
        (best, 0.0)
    } else {
        draw(params, row, best, uniform())
    };
    Ok(Sampled {
        token: token as u32,
        logprob: policy_logprob(logits, token),
        sampling_logprob,
    })
}

/// The token where `uniform` falls in the cumulative weights of `logits`
/// after temperature, top-k and top-p (`best`: the row's best token;
/// `params.temperature > 0`), and its log-probability under them.
fn draw(params: &SamplingParams, logits: &[f32], best: usize, uniform: f64) -> (usize, f32) {
    let inv_t = 1.0 / params.temperature as f64;
    let max = logits[best] as f64;
    // Candidates in decreasing order only when truncating; else all in place.
    let truncating = (params.top_k > 0 && params.top_k < logits.len()) || params.top_p < 1.0;
    let mut candidates: Vec<(usize, f64)> = logits
        .iter()
        .enumerate()
        .filter(|(_, &x)| x > f32::NEG_INFINITY)
        .map(|(i, &x)| (i, ((x as f64 - max) * inv_t).exp()))
        .collect();
    if truncating {
        let by_weight =
            |a: &(usize, f64), b: &(usize, f64)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
        if params.top_k > 0 && params.top_k < candidates.len() {
            candidates.select_nth_unstable_by(params.top_k - 1, by_weight);
            candidates.truncate(params.top_k);
        }
        candidates.sort_by(by_weight);
        if params.top_p < 1.0 {
            let total: f64 = candidates.iter().map(|c| c.1).sum();
            let mut mass = 0.0;
            let mut keep = candidates.len();
            for (i, c) in candidates.iter().enumerate() {
                mass += c.1 / total;
                if mass >= params.top_p as f64 {
                    keep = i + 1;
                    break;
                }
            }
            candidates.truncate(keep);
        }
        // The draw walks the kept tokens in id order, as it does the whole
        // vocabulary (and as the device's scan does).
        candidates.sort_unstable_by_key(|c| c.0);
    }
    let total: f64 = candidates.iter().map(|c| c.1).sum();
    let mut target = uniform * total;
    let mut chosen = candidates[candidates.len() - 1];
    for &c in &candidates {
        if target < c.1 {
            chosen = c;
            break;
        }
        target -= c.1;
    }
    (chosen.0, (chosen.1 / total).ln() as f32)
}

impl Sampler {
    /// Like [`Sampler::sample`], but only among `allowed` token ids (every
    /// other token is masked out). `logprob` stays the policy's over the
    /// unmasked `logits`; `sampling_logprob` is that of the masked
    /// distribution sampled from.
    pub fn sample_among(&mut self, logits: &[f32], allowed: &[u32]) -> Result<Sampled> {
        let rng = &mut self.rng;
        sample_masked(&self.params, logits, Some(allowed), || rng.random())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn softmax(logits: &[f32], t: f64) -> Vec<f64> {
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
        let w: Vec<f64> = logits
            .iter()
            .map(|&x| ((x as f64 - max) / t).exp())
            .collect();
        let sum: f64 = w.iter().sum();
        w.iter().map(|x| x / sum).collect()
    }

    #[test]
    fn greedy_picks_the_first_maximum() {
        let mut s = Sampler::greedy();
        let out = s.sample(&[0.5, 2.0, 2.0, -1.0]).unwrap();
        assert_eq!(out.token, 1);
        assert_eq!(out.sampling_logprob, 0.0);
        let want = softmax(&[0.5, 2.0, 2.0, -1.0], 1.0)[1].ln() as f32;
        assert!((out.logprob - want).abs() < 1e-6);
    }

    #[test]
    fn same_seed_same_tokens_and_frequencies_follow_the_distribution() {
        let logits = [1.0f32, 0.0, -1.0, f32::NEG_INFINITY];
        let draw = |seed| {
            let mut s = Sampler::new(SamplingParams::default(), seed).unwrap();
            (0..20_000)
                .map(|_| s.sample(&logits).unwrap())
                .collect::<Vec<_>>()
        };
        let a = draw(5);
        assert_eq!(a, draw(5));
        assert_ne!(a, draw(6));
        let p = softmax(&logits, 1.0);
        for token in 0..4 {
            let freq = a.iter().filter(|s| s.token == token).count() as f64 / a.len() as f64;
            assert!(
                (freq - p[token as usize]).abs() < 0.01,
                "token {token}: {freq} vs {}",
                p[token as usize]
            );
        }
        for s in &a {
            // No truncation, temperature 1: both log-probs are the policy's.
            assert!((s.logprob - (p[s.token as usize].ln() as f32)).abs() < 1e-5);
            assert!((s.sampling_logprob - s.logprob).abs() < 1e-5);
        }
    }

    #[test]
    fn temperature_top_k_and_top_p_shape_the_sampling_distribution() {
        let logits = [2.0f32, 1.5, 1.0, 0.0, -3.0];
        let p1 = softmax(&logits, 1.0);
        // Temperature 0.5, top-k 2: only tokens 0 and 1, renormalised.
        let params = SamplingParams {
            temperature: 0.5,
            top_k: 2,
            top_p: 1.0,
        };
        let mut s = Sampler::new(params, 1).unwrap();
        let pt = softmax(&logits[..2], 0.5);
        for _ in 0..2000 {
            let out = s.sample(&logits).unwrap();
            assert!(out.token < 2);
            assert!((out.sampling_logprob - pt[out.token as usize].ln() as f32).abs() < 1e-5);
            assert!((out.logprob - p1[out.token as usize].ln() as f32).abs() < 1e-5);
        }
        // top-p 0.5 at temperature 1: token 0 alone has 0.42 < 0.5, so 0 and 1.
        let params = SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 0.5,
        };
        let mut s = Sampler::new(params, 2).unwrap();
        let seen: std::collections::BTreeSet<u32> = (0..2000)
            .map(|_| s.sample(&logits).unwrap().token)
            .collect();
        assert!(p1[0] < 0.5 && p1[0] + p1[1] >= 0.5);
        assert_eq!(seen.into_iter().collect::<Vec<_>>(), vec![0, 1]);
        // top-k 1 is greedy.
        let params = SamplingParams {
            temperature: 3.0,
            top_k: 1,
            top_p: 1.0,
        };
        let out = Sampler::new(params, 3).unwrap().sample(&logits).unwrap();
        assert_eq!((out.token, out.sampling_logprob), (0, 0.0));
    }

    #[test]
    fn a_constraint_masks_but_keeps_policy_logprobs() {
        let logits = [3.0f32, 1.0, 0.0, -1.0];
        let mut s = Sampler::new(SamplingParams::default(), 9).unwrap();
        let p = softmax(&logits, 1.0);
        for _ in 0..200 {
            let out = s.sample_among(&logits, &[2, 3]).unwrap();
            assert!(out.token == 2 || out.token == 3);
            assert!((out.logprob - p[out.token as usize].ln() as f32).abs() < 1e-5);
            let masked = softmax(&logits[2..], 1.0)[out.token as usize - 2].ln() as f32;
            assert!((out.sampling_logprob - masked).abs() < 1e-5);
        }
        assert_eq!(
            Sampler::greedy()
                .sample_among(&logits, &[1, 3])
                .unwrap()
                .token,
            1
        );
        assert!(s.sample_among(&logits, &[]).is_err());
        assert!(s.sample_among(&logits, &[4]).is_err());
    }

    #[test]
    fn bad_inputs_are_errors() {
        let mut s = Sampler::new(SamplingParams::default(), 0).unwrap();
        assert!(s.sample(&[]).is_err());
        assert!(s.sample(&[0.0, f32::NAN]).is_err());
        assert!(s.sample(&[f32::NEG_INFINITY; 3]).is_err());
        let bad = SamplingParams {
            top_p: 0.0,
            ..SamplingParams::default()
        };
        assert!(Sampler::new(bad, 0).is_err());
        let bad = SamplingParams {
            temperature: -1.0,
            ..SamplingParams::default()
        };
        assert!(Sampler::new(bad, 0).is_err());
    }
}
