//! The statistics RL papers report for a handful of seeds (rliable's,
//! Agarwal et al. 2021): the interquartile mean (IQM) of per-seed scores
//! and percentile bootstrap confidence intervals, here over the seeds of
//! one task (rliable's stratified bootstrap with one task). Deterministic:
//! the resampling generator is seeded, so a report reads the same twice.

use rand::{Rng, SeedableRng};

/// Bootstrap resamples per interval (rliable: 2,000 to 50,000).
pub const RESAMPLES: usize = 5_000;

/// An aggregate of per-seed scores with its 95 % bootstrap interval.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct Interval {
    pub point: f64,
    pub low: f64,
    pub high: f64,
}

impl Interval {
    /// Whether the two intervals share a point.
    pub fn overlaps(&self, other: &Interval) -> bool {
        self.low <= other.high && other.low <= self.high
    }
}

/// The mean of `scores` (NaN when empty).
pub fn mean(scores: &[f64]) -> f64 {
    scores.iter().sum::<f64>() / scores.len() as f64
}

/// The interquartile mean: the mean of the middle half of the sorted
/// scores, the outer quarters cut with fractional weights where the count
/// is not a multiple of 4 (as `scipy.stats.trim_mean(…, 0.25)` would on
/// the whole-sample cut, extended to fractions so that 3 or 5 seeds still
/// weigh every score they keep). One or two scores: their mean.
pub fn iqm(scores: &[f64]) -> f64 {
    let mut sorted = scores.to_vec();
    sorted.sort_by(f64::total_cmp);
    let n = sorted.len() as f64;
    if sorted.len() <= 2 {
        return mean(&sorted);
    }
    let (cut_low, cut_high) = (0.25 * n, 0.75 * n);
    let mut total = 0.0;
    for (i, x) in sorted.iter().enumerate() {
        // The share of score i's unit interval [i, i + 1) inside the middle half.
        let weight = ((i + 1) as f64).min(cut_high) - (i as f64).max(cut_low);
        if weight > 0.0 {
            total += weight * x;
        }
    }
    total / (cut_high - cut_low)
}

/// `statistic` of `scores` with its 95 % percentile bootstrap interval.
pub fn bootstrap(scores: &[f64], statistic: fn(&[f64]) -> f64, seed: u64) -> Interval {
    let point = statistic(scores);
    if scores.len() < 2 {
        return Interval {
            point,
            low: point,
            high: point,
        };
    }
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut resample = vec![0.0; scores.len()];
    let mut stats: Vec<f64> = (0..RESAMPLES)
        .map(|_| {
            for x in resample.iter_mut() {
                *x = scores[rng.random_range(0..scores.len())];
            }
            statistic(&resample)
        })
        .collect();
    stats.sort_by(f64::total_cmp);
    let at = |q: f64| stats[((q * (RESAMPLES - 1) as f64).round() as usize).min(RESAMPLES - 1)];
    Interval {
        point,
        low: at(0.025),
        high: at(0.975),
    }
}

/// The normalised area under a learning curve: the mean of its points'
/// returns over evaluation points evenly spaced in env steps (CleanRL's
/// and rliable's "average over training").
pub fn area_under(curve: &[(u64, f64)]) -> f64 {
    mean(&curve.iter().map(|p| p.1).collect::<Vec<_>>())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn iqm_keeps_the_middle_half() {
        // Four scores: the middle two.
        assert_eq!(iqm(&[0.0, 1.0, 2.0, 100.0]), 1.5);
        // Eight: the middle four.
        assert_eq!(iqm(&[9.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, -50.0]), 3.5);
        // Five: 1.25 to 3.75, so 0.75 of the 2nd, the 3rd, 0.75 of the 4th.
        let five = iqm(&[1.0, 2.0, 3.0, 4.0, 50.0]);
        assert!((five - (0.75 * 2.0 + 3.0 + 0.75 * 4.0) / 2.5).abs() < 1e-12);
        assert_eq!(iqm(&[7.0]), 7.0);
    }

    #[test]
    fn the_bootstrap_interval_holds_the_point_and_narrows_with_agreement() {
        let spread = bootstrap(&[100.0, 200.0, 300.0, 400.0, 500.0], mean, 1);
        assert!(spread.low < spread.point && spread.point < spread.high);
        assert!(spread.low >= 100.0 && spread.high <= 500.0);
        let tight = bootstrap(&[300.0, 301.0, 299.0, 300.0, 300.0], mean, 1);
        assert!(tight.high - tight.low < 2.0);
        assert!(spread.overlaps(&tight));
        let far = bootstrap(&[900.0, 901.0, 899.0], mean, 1);
        assert!(!far.overlaps(&tight));
        // Same seed, same interval.
        assert_eq!(
            spread,
            bootstrap(&[100.0, 200.0, 300.0, 400.0, 500.0], mean, 1)
        );
    }
}
