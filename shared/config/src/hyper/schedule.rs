//! Hyperparameter schedules: a value as a function of training progress.
//!
//! A [`Schedule`] is plain data (serde) for an experiment config; the
//! learner evaluates it with [`Schedule::value`] at progress
//! `p = steps_done / total_steps` in `[0, 1]` (0 at the start of training,
//! 1 at the end) and passes the result on, e.g. to relay-nn's `Adam::set_lr`,
//! as the PPO clip range or as DQN's exploration epsilon. SB3 passes
//! `progress_remaining = 1 - p` to its schedules instead; the shapes here
//! are written in `p`.
//!
//! # Timeline
//!
//! ```text
//! p:  0 ──── warmup.fraction ──── begin ─────────────────────── 1
//!     warmup.start ↗ first        first (held)    shape(q), q: 0 → 1
//! ```
//!
//! - The shape (constant, linear, cosine, exponential, piecewise linear)
//!   runs over `[begin, 1]` with local progress
//!   `q = (p - begin) / (1 - begin)`, where
//!   `begin = max(offset, warmup.fraction)`.
//! - Before `begin` the value is the shape's first value `shape(0)`, except
//!   during the warmup `[0, warmup.fraction)`, where it rises (or falls)
//!   linearly from `warmup.start` to `shape(0)`.
//!
//! So `{kind: cosine, start: 1e-3, end: 0, warmup: {fraction: 0.1, start: 0}}`
//! is the usual "linear warmup over the first 10%, then cosine decay to 0";
//! `{kind: linear, start: 1.0, end: 0.05, offset: 0.0}` with no warmup is
//! SB3's DQN exploration schedule once `end` is reached at
//! `exploration_fraction` (use `piecewise_linear` with points
//! `[[0, 1.0], [0.1, 0.05]]` for exactly that).
//!
//! # Config form
//!
//! A bare number is a constant; otherwise a map with `kind`:
//!
//! ```yaml
//! lr: 3.0e-4
//! clip_range: {kind: linear, start: 0.2, end: 0.0}
//! ent_coef: {kind: exponential, start: 0.01, end: 0.0001, offset: 0.5}
//! epsilon: {kind: piecewise_linear, points: [[0.0, 1.0], [0.1, 0.05]]}
//! ```

use std::fmt;

use serde::de::{self, MapAccess, Visitor};
use serde::{Deserialize, Deserializer, Serialize};

use crate::check::FieldError;

type Result<T> = std::result::Result<T, FieldError>;

/// The curve a [`Schedule`] follows over its local progress `q` in `[0, 1]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum Shape {
    /// The same value throughout.
    Constant {
        /// The value.
        value: f64,
    },
    /// `start + (end - start) q`.
    Linear {
        /// Value at `q = 0`.
        start: f64,
        /// Value at `q = 1`.
        end: f64,
    },
    /// `end + (start - end) (1 + cos(π q)) / 2` (half a cosine, as
    /// `torch.optim.lr_scheduler.CosineAnnealingLR`).
    Cosine {
        /// Value at `q = 0`.
        start: f64,
        /// Value at `q = 1`.
        end: f64,
    },
    /// Geometric interpolation `start (end / start)^q`: a constant rate of
    /// decay (or growth) per unit of progress. `start` and `end` must be
    /// non-zero and of the same sign.
    Exponential {
        /// Value at `q = 0`.
        start: f64,
        /// Value at `q = 1`.
        end: f64,
    },
    /// Straight lines between `(q, value)` points (strictly increasing `q`,
    /// at least one point); the first value before the first point, the
    /// last value after the last.
    PiecewiseLinear {
        /// The `(q, value)` points, `q` in `[0, 1]`.
        points: Vec<(f64, f64)>,
    },
}

/// A linear ramp at the start of training towards the shape's first value.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Warmup {
    /// Fraction of total progress the ramp lasts, in `[0, 1)`.
    pub fraction: f64,
    /// Value at `p = 0`. Default `0.0`.
    #[serde(default)]
    pub start: f64,
}

/// A hyperparameter as a function of training progress (see the module docs).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Schedule {
    /// The curve.
    #[serde(flatten)]
    pub shape: Shape,
    /// Optional linear warmup at the start.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub warmup: Option<Warmup>,
    /// Progress at which the shape starts, in `[0, 1)`; before it (and after
    /// any warmup) the shape's first value is held. Default `0.0`.
    #[serde(default)]
    pub offset: f64,
}

impl Shape {
    /// The curve at local progress `q` (clamped to `[0, 1]`).
    pub fn value(&self, q: f64) -> f64 {
        let q = q.clamp(0.0, 1.0);
        match self {
            Shape::Constant { value } => *value,
            Shape::Linear { start, end } => start + (end - start) * q,
            Shape::Cosine { start, end } => {
                end + (start - end) * 0.5 * (1.0 + (std::f64::consts::PI * q).cos())
            }
            Shape::Exponential { start, end } => start * (end / start).powf(q),
            Shape::PiecewiseLinear { points } => {
                let (first, last) = (points[0], points[points.len() - 1]);
                if q <= first.0 {
                    return first.1;
                }
                if q >= last.0 {
                    return last.1;
                }
                let i = points.partition_point(|&(x, _)| x <= q);
                let ((x0, y0), (x1, y1)) = (points[i - 1], points[i]);
                y0 + (y1 - y0) * (q - x0) / (x1 - x0)
            }
        }
    }

    fn validate(&self) -> Result<()> {
        let finite = |field: &'static str, x: f64| {
            if x.is_finite() {
                Ok(())
            } else {
                Err(FieldError::new(field, format!("must be finite, got {x}")))
            }
        };
        match self {
            Shape::Constant { value } => finite("value", *value),
            Shape::Linear { start, end } | Shape::Cosine { start, end } => {
                finite("start", *start)?;
                finite("end", *end)
            }
            Shape::Exponential { start, end } => {
                finite("start", *start)?;
                finite("end", *end)?;
                if *start == 0.0 || *end == 0.0 || start.signum() != end.signum() {
                    return Err(FieldError::new(
                        "end",
                        format!(
                            "exponential needs non-zero start and end of the same sign, got {start} and {end}"
                        ),
                    ));
                }
                Ok(())
            }
            Shape::PiecewiseLinear { points } => {
                if points.is_empty() {
                    return Err(FieldError::new("points", "needs at least one point"));
                }
                for (i, &(q, v)) in points.iter().enumerate() {
                    if !(0.0..=1.0).contains(&q) || !v.is_finite() {
                        return Err(FieldError::new(
                            "points",
                            format!(
                                "point {i} ({q}, {v}): need progress in [0, 1] and a finite value"
                            ),
                        ));
                    }
                    if i > 0 && q <= points[i - 1].0 {
                        return Err(FieldError::new(
                            "points",
                            format!(
                                "point {i}: progress {q} must be greater than the previous one"
                            ),
                        ));
                    }
                }
                Ok(())
            }
        }
    }
}

impl Schedule {
    /// A constant.
    pub fn constant(value: f64) -> Self {
        Self::from(Shape::Constant { value })
    }

    /// Linear from `start` (p = 0) to `end` (p = 1).
    pub fn linear(start: f64, end: f64) -> Self {
        Self::from(Shape::Linear { start, end })
    }

    /// Half-cosine from `start` to `end`.
    pub fn cosine(start: f64, end: f64) -> Self {
        Self::from(Shape::Cosine { start, end })
    }

    /// Geometric from `start` to `end`.
    pub fn exponential(start: f64, end: f64) -> Self {
        Self::from(Shape::Exponential { start, end })
    }

    /// Straight lines between `(progress, value)` points.
    pub fn piecewise_linear(points: Vec<(f64, f64)>) -> Self {
        Self::from(Shape::PiecewiseLinear { points })
    }

    /// Adds a linear warmup from `start` over the first `fraction` of progress.
    pub fn with_warmup(mut self, fraction: f64, start: f64) -> Self {
        self.warmup = Some(Warmup { fraction, start });
        self
    }

    /// Starts the shape at progress `offset` (holding its first value before).
    pub fn with_offset(mut self, offset: f64) -> Self {
        self.offset = offset;
        self
    }

    /// Checks every field; the error names the field.
    pub fn validate(&self) -> Result<()> {
        self.shape.validate()?;
        if !(0.0..1.0).contains(&self.offset) {
            return Err(FieldError::new(
                "offset",
                format!("must be in [0, 1), got {}", self.offset),
            ));
        }
        if let Some(w) = &self.warmup {
            if !(0.0..1.0).contains(&w.fraction) {
                return Err(FieldError::new(
                    "warmup.fraction",
                    format!("must be in [0, 1), got {}", w.fraction),
                ));
            }
            if !w.start.is_finite() {
                return Err(FieldError::new("warmup.start", "must be finite"));
            }
        }
        Ok(())
    }

    /// Progress at which the shape itself starts.
    fn begin(&self) -> f64 {
        self.offset
            .max(self.warmup.map(|w| w.fraction).unwrap_or(0.0))
    }

    /// The value at training progress `progress` (clamped to `[0, 1]`).
    /// Call [`Self::validate`] once first (an invalid schedule gives
    /// meaningless values, e.g. NaN, but never panics).
    pub fn value(&self, progress: f64) -> f64 {
        let p = if progress.is_nan() {
            0.0
        } else {
            progress.clamp(0.0, 1.0)
        };
        if let Some(w) = self.warmup {
            if p < w.fraction {
                let first = self.shape.value(0.0);
                return w.start + (first - w.start) * p / w.fraction;
            }
        }
        let begin = self.begin();
        if p <= begin {
            return self.shape.value(0.0);
        }
        self.shape.value((p - begin) / (1.0 - begin))
    }
}

impl From<Shape> for Schedule {
    fn from(shape: Shape) -> Self {
        Self {
            shape,
            warmup: None,
            offset: 0.0,
        }
    }
}

impl From<f64> for Schedule {
    fn from(value: f64) -> Self {
        Self::constant(value)
    }
}

/// The derived form of [`Schedule`] (a map), wrapped so a bare number is
/// also accepted. `flatten` rules out `deny_unknown_fields` here, but every
/// key that is not `warmup` or `offset` goes to [`Shape`], which denies
/// unknown ones, so typos are still caught.
#[derive(Deserialize)]
struct ScheduleMap {
    #[serde(flatten)]
    shape: Shape,
    #[serde(default)]
    warmup: Option<Warmup>,
    #[serde(default)]
    offset: f64,
}

impl<'de> Deserialize<'de> for Schedule {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Schedule;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a number or a schedule map with `kind`")
            }

            fn visit_f64<E: de::Error>(self, v: f64) -> std::result::Result<Schedule, E> {
                Ok(Schedule::constant(v))
            }

            fn visit_i64<E: de::Error>(self, v: i64) -> std::result::Result<Schedule, E> {
                Ok(Schedule::constant(v as f64))
            }

            fn visit_u64<E: de::Error>(self, v: u64) -> std::result::Result<Schedule, E> {
                Ok(Schedule::constant(v as f64))
            }

            fn visit_map<A: MapAccess<'de>>(
                self,
                map: A,
            ) -> std::result::Result<Schedule, A::Error> {
                let m = ScheduleMap::deserialize(de::value::MapAccessDeserializer::new(map))?;
                Ok(Schedule {
                    shape: m.shape,
                    warmup: m.warmup,
                    offset: m.offset,
                })
            }
        }
        d.deserialize_any(V)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f64, b: f64) {
        assert!((a - b).abs() < 1e-12, "{a} vs {b}");
    }

    #[test]
    fn shapes_at_chosen_points() {
        let c = Schedule::constant(0.3);
        for p in [0.0, 0.5, 1.0] {
            close(c.value(p), 0.3);
        }
        let l = Schedule::linear(1.0, 0.0);
        close(l.value(0.0), 1.0);
        close(l.value(0.25), 0.75);
        close(l.value(1.0), 0.0);
        close(l.value(2.0), 0.0); // clamped
        close(l.value(-1.0), 1.0);
        let cos = Schedule::cosine(1.0, 0.0);
        close(cos.value(0.0), 1.0);
        close(cos.value(0.5), 0.5);
        close(
            cos.value(0.25),
            0.5 * (1.0 + std::f64::consts::FRAC_1_SQRT_2),
        );
        close(cos.value(1.0), 0.0);
        let e = Schedule::exponential(1e-2, 1e-4);
        close(e.value(0.0), 1e-2);
        close(e.value(0.5), 1e-3);
        close(e.value(1.0), 1e-4);
        let pw = Schedule::piecewise_linear(vec![(0.1, 1.0), (0.5, 0.2), (1.0, 0.0)]);
        close(pw.value(0.0), 1.0);
        close(pw.value(0.1), 1.0);
        close(pw.value(0.3), 0.6);
        close(pw.value(0.5), 0.2);
        close(pw.value(0.75), 0.1);
        close(pw.value(1.0), 0.0);
    }

    #[test]
    fn warmup_and_offset() {
        // Warmup 0 -> 1 over 10%, then cosine 1 -> 0 over [0.1, 1].
        let s = Schedule::cosine(1.0, 0.0).with_warmup(0.1, 0.0);
        close(s.value(0.0), 0.0);
        close(s.value(0.05), 0.5);
        close(s.value(0.1), 1.0);
        close(s.value(0.55), 0.5);
        close(s.value(1.0), 0.0);
        // Offset: hold 1.0 until 0.5, then linear to 0.
        let o = Schedule::linear(1.0, 0.0).with_offset(0.5);
        close(o.value(0.25), 1.0);
        close(o.value(0.5), 1.0);
        close(o.value(0.75), 0.5);
        close(o.value(1.0), 0.0);
        // Warmup shorter than the offset: ramp, hold, then the shape.
        let wo = Schedule::linear(2.0, 0.0)
            .with_warmup(0.2, 1.0)
            .with_offset(0.6);
        close(wo.value(0.1), 1.5);
        close(wo.value(0.4), 2.0);
        close(wo.value(0.8), 1.0);
        // Warmup of a piecewise shape ramps to its first value.
        let pw = Schedule::piecewise_linear(vec![(0.0, 4.0), (1.0, 0.0)]).with_warmup(0.5, 0.0);
        close(pw.value(0.25), 2.0);
        close(pw.value(0.75), 2.0);
    }

    #[test]
    fn config_forms_and_validation() {
        let s: Schedule = serde_json::from_str("0.001").unwrap();
        assert_eq!(s, Schedule::constant(0.001));
        let s: Schedule = serde_json::from_str("3").unwrap();
        assert_eq!(s, Schedule::constant(3.0));
        let json = r#"{"kind": "cosine", "start": 1.0, "end": 0.1,
                       "warmup": {"fraction": 0.1}, "offset": 0.2}"#;
        let s: Schedule = serde_json::from_str(json).unwrap();
        assert_eq!(
            s,
            Schedule::cosine(1.0, 0.1)
                .with_warmup(0.1, 0.0)
                .with_offset(0.2)
        );
        let back: Schedule = serde_json::from_str(&serde_json::to_string(&s).unwrap()).unwrap();
        assert_eq!(back, s);
        let pw: Schedule = serde_json::from_str(
            r#"{"kind": "piecewise_linear", "points": [[0.0, 1.0], [0.1, 0.05]]}"#,
        )
        .unwrap();
        close(pw.value(0.05), 0.525);
        // A typo is refused, as is an unknown kind.
        assert!(
            serde_json::from_str::<Schedule>(r#"{"kind": "linear", "start": 1, "edn": 0}"#)
                .is_err()
        );
        assert!(serde_json::from_str::<Schedule>(r#"{"kind": "step", "value": 1}"#).is_err());
        // Validation names the field.
        let bad = [
            (Schedule::exponential(1.0, 0.0), "end"),
            (Schedule::exponential(-1.0, 1.0), "end"),
            (Schedule::piecewise_linear(vec![]), "points"),
            (
                Schedule::piecewise_linear(vec![(0.5, 1.0), (0.5, 2.0)]),
                "points",
            ),
            (Schedule::linear(f64::NAN, 0.0), "start"),
            (Schedule::constant(1.0).with_offset(1.0), "offset"),
            (
                Schedule::constant(1.0).with_warmup(1.5, 0.0),
                "warmup.fraction",
            ),
        ];
        for (s, field) in bad {
            let err = s.validate().unwrap_err().to_string();
            assert!(err.contains(&format!("`{field}`")), "{err}");
        }
        Schedule::cosine(1.0, 0.0)
            .with_warmup(0.1, 0.0)
            .validate()
            .unwrap();
    }
}
