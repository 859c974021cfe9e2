//! Shorthands for schedules that SB3 configs write beside a value
//! (`lr_schedule: linear`).

use crate::hyper::schedule::{Schedule, Shape};
use serde::{Deserialize, Serialize};

/// The older, one-word spelling of a schedule, kept so configs written
/// before schedules could be given in place still load: `linear` turns the
/// field's constant value `v` into `{kind: linear, start: v, end: 0}`
/// (SB3's `linear_schedule`). A field written as a schedule map already
/// says how it changes; combining it with `linear` is an error.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ScheduleShorthand {
    /// The field's schedule as written.
    #[default]
    Constant,
    /// The field's constant value falls linearly to zero at the end of the budget.
    Linear,
}

impl ScheduleShorthand {
    /// The schedule `written` after applying the shorthand.
    pub fn apply(self, written: &Schedule) -> Schedule {
        match (self, &written.shape) {
            (ScheduleShorthand::Linear, Shape::Constant { value }) => Schedule {
                shape: Shape::Linear {
                    start: *value,
                    end: 0.0,
                },
                ..written.clone()
            },
            _ => written.clone(),
        }
    }
}
