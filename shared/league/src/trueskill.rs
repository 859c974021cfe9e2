//! TrueSkill for two-player (1 vs 1) matches, identical to the Python
//! `trueskill` package 0.4.5 with its default (pure Python) backend.
//!
//! This module owns the rating maths: the environment ([`TrueSkill`]), a
//! player's belief ([`Rating`]), rating one match ([`TrueSkill::rate_1vs1`])
//! and the match quality ([`TrueSkill::quality_1vs1`]). It knows nothing of
//! pools or samplers.
//!
//! For two teams of one player each, the package's factor graph converges
//! after one pass (its second pass changes nothing), so the update is the
//! closed form below. What makes the numbers agree to 1e-6 and better is
//! using the package's own approximations: its `erfc` (a Chebyshev fit with
//! ~1.2e-7 relative error, not the libm one), the `cdf` built on it, and its
//! `ppf` (an initial guess refined by two Newton steps on that `erfc`), which
//! sets the draw margin. The package's own failure cases are kept too: a win
//! so unlikely that the variance factor leaves (0, 1), or a draw whose
//! probability underflows, is an error ([`TrueSkillError::Precision`]), where
//! the package raises `FloatingPointError`.

use serde::{Deserialize, Serialize};

/// Default initial mean of a rating (`trueskill.MU`).
pub const DEFAULT_MU: f64 = 25.0;
/// Default initial standard deviation (`trueskill.SIGMA`, `MU / 3`).
pub const DEFAULT_SIGMA: f64 = DEFAULT_MU / 3.0;
/// Default performance noise (`trueskill.BETA`, `SIGMA / 2`).
pub const DEFAULT_BETA: f64 = DEFAULT_SIGMA / 2.0;
/// Default dynamic factor (`trueskill.TAU`, `SIGMA / 100`).
pub const DEFAULT_TAU: f64 = DEFAULT_SIGMA / 100.0;
/// Default draw probability (`trueskill.DRAW_PROBABILITY`).
pub const DEFAULT_DRAW_PROBABILITY: f64 = 0.10;

/// Errors of the rating maths.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum TrueSkillError {
    /// A parameter of the environment is out of its range.
    #[error("trueskill.{field}: {reason}")]
    InvalidParameter {
        /// The field's name.
        field: &'static str,
        /// Why it is rejected.
        reason: String,
    },
    /// A rating given to the maths is not finite or has sigma <= 0.
    #[error("invalid rating (mu {mu}, sigma {sigma}): mu must be finite and sigma finite and > 0")]
    InvalidRating {
        /// The rating's mean.
        mu: f64,
        /// The rating's standard deviation.
        sigma: f64,
    },
    /// The result is too unlikely under the ratings for double precision,
    /// where the Python package raises `FloatingPointError`.
    #[error("cannot rate this result in double precision: {0}")]
    Precision(&'static str),
}

/// A player's skill belief: a normal distribution N(mu, sigma^2).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Rating {
    /// Mean skill.
    pub mu: f64,
    /// Standard deviation of the skill belief (uncertainty).
    pub sigma: f64,
}

impl Rating {
    /// A rating with the given mean and standard deviation.
    pub fn new(mu: f64, sigma: f64) -> Self {
        Self { mu, sigma }
    }

    /// The conservative skill estimate `mu - k * sigma`: with k = 3 the
    /// player is better than this with ~99.9% belief (TrueSkill's
    /// leaderboard "exposure" when mu0 / sigma0 = 3).
    pub fn conservative(&self, k: f64) -> f64 {
        self.mu - k * self.sigma
    }

    fn check(&self) -> Result<(), TrueSkillError> {
        if self.mu.is_finite() && self.sigma.is_finite() && self.sigma > 0.0 {
            Ok(())
        } else {
            Err(TrueSkillError::InvalidRating {
                mu: self.mu,
                sigma: self.sigma,
            })
        }
    }
}

/// The result of a match from the first player's point of view.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    /// The first player won.
    Win,
    /// Nobody won.
    Draw,
    /// The second player won.
    Loss,
}

impl Outcome {
    /// The same result seen from the other player.
    pub fn flipped(self) -> Self {
        match self {
            Outcome::Win => Outcome::Loss,
            Outcome::Draw => Outcome::Draw,
            Outcome::Loss => Outcome::Win,
        }
    }
}

/// A TrueSkill environment: the constants of one game (`trueskill.TrueSkill`).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TrueSkill {
    /// Initial mean of a new rating. Default 25.
    pub mu: f64,
    /// Initial standard deviation of a new rating; also the ceiling when a
    /// new policy version widens its parent's sigma. Default 25/3.
    pub sigma: f64,
    /// Performance noise: a skill gap of `beta` means ~76% chance to win.
    /// Default 25/6 (the package's default, not derived from `sigma`).
    pub beta: f64,
    /// Dynamic factor: added in quadrature to sigma before every match so
    /// ratings keep tracking a changing skill. Default 25/300.
    pub tau: f64,
    /// Probability of a draw between two equal players, in [0, 1).
    /// Default 0.1.
    pub draw_probability: f64,
}

impl Default for TrueSkill {
    fn default() -> Self {
        Self {
            mu: DEFAULT_MU,
            sigma: DEFAULT_SIGMA,
            beta: DEFAULT_BETA,
            tau: DEFAULT_TAU,
            draw_probability: DEFAULT_DRAW_PROBABILITY,
        }
    }
}

impl TrueSkill {
    /// Checks every parameter, naming the first bad one.
    pub fn validate(&self) -> Result<(), TrueSkillError> {
        let bad = |field: &'static str, reason: &str| {
            Err(TrueSkillError::InvalidParameter {
                field,
                reason: reason.to_string(),
            })
        };
        if !self.mu.is_finite() {
            return bad("mu", "must be finite");
        }
        if !(self.sigma.is_finite() && self.sigma > 0.0) {
            return bad("sigma", "must be finite and > 0");
        }
        if !(self.beta.is_finite() && self.beta > 0.0) {
            return bad("beta", "must be finite and > 0");
        }
        if !(self.tau.is_finite() && self.tau >= 0.0) {
            return bad("tau", "must be finite and >= 0");
        }
        if !(0.0..1.0).contains(&self.draw_probability) {
            return bad("draw_probability", "must be in [0, 1)");
        }
        Ok(())
    }

    /// The rating of a player never seen: N(mu, sigma^2) of the environment.
    pub fn new_rating(&self) -> Rating {
        Rating::new(self.mu, self.sigma)
    }

    /// The draw margin of a 1 vs 1 match
    /// (`calc_draw_margin(draw_probability, 2)`).
    pub fn draw_margin(&self) -> f64 {
        ppf((self.draw_probability + 1.0) / 2.0) * 2f64.sqrt() * self.beta
    }

    /// The ratings of `a` and `b` after one match with the given `outcome`
    /// (from `a`'s point of view), as `trueskill.rate_1vs1` computes them
    /// (with the winner passed first, and `drawn=True` for a draw).
    pub fn rate_1vs1(
        &self,
        a: Rating,
        b: Rating,
        outcome: Outcome,
    ) -> Result<(Rating, Rating), TrueSkillError> {
        self.validate()?;
        a.check()?;
        b.check()?;
        // The package sorts the players by rank: the winner first; a draw
        // keeps the given order.
        let (first, second) = match outcome {
            Outcome::Win | Outcome::Draw => (a, b),
            Outcome::Loss => (b, a),
        };
        // Prior plus the dynamic factor, as the package's PriorFactor does.
        let var_first = first.sigma.powi(2) + self.tau.powi(2);
        let var_second = second.sigma.powi(2) + self.tau.powi(2);
        let c_squared = 2.0 * self.beta.powi(2) + var_first + var_second;
        let c = c_squared.sqrt();
        let diff = (first.mu - second.mu) / c;
        let margin = self.draw_margin() / c;
        let (v, w) = match outcome {
            Outcome::Draw => (v_draw(diff, margin), w_draw(diff, margin)?),
            Outcome::Win | Outcome::Loss => (v_win(diff, margin), w_win(diff, margin)?),
        };
        let first_after = Rating::new(
            first.mu + var_first / c * v,
            (var_first * (1.0 - var_first / c_squared * w)).sqrt(),
        );
        let second_after = Rating::new(
            second.mu - var_second / c * v,
            (var_second * (1.0 - var_second / c_squared * w)).sqrt(),
        );
        Ok(match outcome {
            Outcome::Win | Outcome::Draw => (first_after, second_after),
            Outcome::Loss => (second_after, first_after),
        })
    }

    /// The match quality of `a` against `b` (`trueskill.quality_1vs1`): the
    /// probability of a draw relative to the most even match possible, in
    /// (0, 1]; 1 for equal, certain ratings.
    pub fn quality_1vs1(&self, a: Rating, b: Rating) -> f64 {
        let two_beta_squared = 2.0 * self.beta.powi(2);
        let total = two_beta_squared + a.sigma.powi(2) + b.sigma.powi(2);
        let exponent = -0.5 * (a.mu - b.mu).powi(2) / total;
        exponent.exp() * (two_beta_squared / total).sqrt()
    }
}

/// The package's complementary error function (`trueskill.backends.erfc`),
/// a Chebyshev fit (Numerical Recipes' `erfcc`).
fn erfc(x: f64) -> f64 {
    let z = x.abs();
    let t = 1.0 / (1.0 + z / 2.0);
    let r = t
        * (-z * z - 1.26551223
            + t * (1.00002368
                + t * (0.37409196
                    + t * (0.09678418
                        + t * (-0.18628806
                            + t * (0.27886807
                                + t * (-1.13520398
                                    + t * (1.48851587 + t * (-0.82215223 + t * 0.17087277)))))))))
            .exp();
    if x < 0.0 {
        2.0 - r
    } else {
        r
    }
}

/// The standard normal CDF on the package's `erfc`.
fn cdf(x: f64) -> f64 {
    0.5 * erfc(-x / 2f64.sqrt())
}

/// The standard normal density.
fn pdf(x: f64) -> f64 {
    1.0 / (2.0 * std::f64::consts::PI).sqrt() * (-(x * x) / 2.0).exp()
}

/// The package's inverse of its `erfc`: a rational initial guess refined by
/// two Newton steps.
// The package's guess uses 0.70711, not 1/sqrt(2); kept to stay identical.
#[allow(clippy::approx_constant)]
fn erfcinv(y: f64) -> f64 {
    if y >= 2.0 {
        return -100.0;
    }
    if y <= 0.0 {
        return 100.0;
    }
    let zero_point = y < 1.0;
    let y = if zero_point { y } else { 2.0 - y };
    let t = (-2.0 * (y / 2.0).ln()).sqrt();
    let mut x = -0.70711 * ((2.30753 + t * 0.27061) / (1.0 + t * (0.99229 + t * 0.04481)) - t);
    for _ in 0..2 {
        let err = erfc(x) - y;
        x += err / (std::f64::consts::FRAC_2_SQRT_PI * (-(x * x)).exp() - x * err);
    }
    if zero_point {
        x
    } else {
        -x
    }
}

/// The standard normal quantile on the package's `erfcinv`.
fn ppf(p: f64) -> f64 {
    -(2f64.sqrt()) * erfcinv(2.0 * p)
}

/// Mean correction for a decisive result (`TrueSkill.v_win`).
fn v_win(diff: f64, draw_margin: f64) -> f64 {
    let x = diff - draw_margin;
    let denom = cdf(x);
    if denom != 0.0 {
        pdf(x) / denom
    } else {
        -x
    }
}

/// Variance correction for a decisive result (`TrueSkill.w_win`).
fn w_win(diff: f64, draw_margin: f64) -> Result<f64, TrueSkillError> {
    let x = diff - draw_margin;
    let v = v_win(diff, draw_margin);
    let w = v * (v + x);
    if 0.0 < w && w < 1.0 {
        Ok(w)
    } else {
        Err(TrueSkillError::Precision(
            "the winner's rating is far below the loser's",
        ))
    }
}

/// Mean correction for a draw (`TrueSkill.v_draw`).
fn v_draw(diff: f64, draw_margin: f64) -> f64 {
    let abs_diff = diff.abs();
    let (a, b) = (draw_margin - abs_diff, -draw_margin - abs_diff);
    let denom = cdf(a) - cdf(b);
    let numer = pdf(b) - pdf(a);
    let v = if denom != 0.0 { numer / denom } else { a };
    if diff < 0.0 {
        -v
    } else {
        v
    }
}

/// Variance correction for a draw (`TrueSkill.w_draw`).
fn w_draw(diff: f64, draw_margin: f64) -> Result<f64, TrueSkillError> {
    let abs_diff = diff.abs();
    let (a, b) = (draw_margin - abs_diff, -draw_margin - abs_diff);
    let denom = cdf(a) - cdf(b);
    if denom == 0.0 {
        return Err(TrueSkillError::Precision(
            "a draw between these ratings is too unlikely",
        ));
    }
    let v = v_draw(abs_diff, draw_margin);
    Ok(v * v + (a * pdf(a) - b * pdf(b)) / denom)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn erfc_approximation_stays_close_to_the_true_function() {
        // Known values of erfc (Abramowitz & Stegun); the fit's relative
        // error is ~1.2e-7.
        for (x, want) in [
            (0.0, 1.0),
            (0.5, 0.479_500_122_186_953_5),
            (1.0, 0.157_299_207_050_285_13),
            (-1.0, 1.842_700_792_949_715),
            (2.0, 0.004_677_734_981_047_266),
        ] {
            assert!(
                ((erfc(x) - want) / want).abs() < 2e-7,
                "erfc({x}) = {}",
                erfc(x)
            );
        }
    }

    #[test]
    fn ppf_inverts_cdf() {
        for p in [0.01, 0.1, 0.3, 0.5, 0.55, 0.9, 0.999] {
            assert!((cdf(ppf(p)) - p).abs() < 1e-9, "p {p}");
        }
    }

    #[test]
    fn a_win_moves_means_apart_and_shrinks_sigmas() {
        let env = TrueSkill::default();
        let (a, b) = env
            .rate_1vs1(env.new_rating(), env.new_rating(), Outcome::Win)
            .unwrap();
        assert!(a.mu > env.mu && b.mu < env.mu);
        assert!((a.mu - env.mu + (b.mu - env.mu)).abs() < 1e-12);
        assert!(a.sigma < env.sigma && (a.sigma - b.sigma).abs() < 1e-12);
        // Loss is the mirror image of a win.
        let (b2, a2) = env
            .rate_1vs1(env.new_rating(), env.new_rating(), Outcome::Loss)
            .unwrap();
        assert_eq!((a, b), (a2, b2));
    }

    #[test]
    fn an_impossible_upset_is_an_error_not_a_nan() {
        let env = TrueSkill::default();
        let strong = Rating::new(400.0, 1.0);
        let weak = Rating::new(0.0, 1.0);
        let err = env.rate_1vs1(weak, strong, Outcome::Win).unwrap_err();
        assert!(matches!(err, TrueSkillError::Precision(_)), "{err}");
        // As in the package, even the expected result fails at such a gap:
        // its variance factor underflows to 0.
        assert!(env.rate_1vs1(strong, weak, Outcome::Win).is_err());
        // At a large but representable gap the expected win teaches nothing.
        let (strong_after, weak_after) = env
            .rate_1vs1(Rating::new(60.0, 1.0), weak, Outcome::Win)
            .unwrap();
        assert!((strong_after.mu - 60.0).abs() < 1e-6);
        assert!((weak_after.mu - 0.0).abs() < 1e-6);
        // sqrt(1 + tau^2), tau = 25/300.
        assert!((strong_after.sigma - (1.0f64 + DEFAULT_TAU.powi(2)).sqrt()).abs() < 1e-9);
    }

    #[test]
    fn invalid_parameters_name_the_field() {
        let env = TrueSkill {
            draw_probability: 1.0,
            ..TrueSkill::default()
        };
        let err = env.validate().unwrap_err();
        assert!(err.to_string().contains("draw_probability"), "{err}");
        let env = TrueSkill {
            beta: 0.0,
            ..TrueSkill::default()
        };
        assert!(env.validate().unwrap_err().to_string().contains("beta"));
        let err = TrueSkill::default()
            .rate_1vs1(
                Rating::new(25.0, 0.0),
                Rating::new(25.0, 1.0),
                Outcome::Draw,
            )
            .unwrap_err();
        assert!(matches!(err, TrueSkillError::InvalidRating { .. }));
    }

    #[test]
    fn quality_is_one_for_equal_certain_ratings_and_falls_with_the_gap() {
        let env = TrueSkill::default();
        let tiny = Rating::new(25.0, 1e-9);
        assert!((env.quality_1vs1(tiny, tiny) - 1.0).abs() < 1e-12);
        let q_near = env.quality_1vs1(env.new_rating(), Rating::new(27.0, env.sigma));
        let q_far = env.quality_1vs1(env.new_rating(), Rating::new(40.0, env.sigma));
        assert!(q_near > q_far && q_far > 0.0);
    }
}
