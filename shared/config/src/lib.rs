//! Experiment configuration: the schema of `configs/*.yaml`, layered loading
//! (file, then `RELAY__SECTION__FIELD` environment variables, then
//! `--set section.field=value` flags) and validation with errors that name
//! the field.
//!
//! Every service reads the same file and uses its own section, so one file
//! describes a whole run. Unknown fields are errors (a typo must not be
//! silently ignored).
//!
//! One module a section: each owns its types, defaults and checks;
//! [`experiment`] holds the whole config, its loading and the checks that
//! span sections.

pub mod a2c;
pub mod check;
pub mod connections;
pub mod dqn;
pub mod eval;
pub mod experiment;
pub mod hyper;
pub mod league;
pub mod llm;
pub mod lora;
pub mod normalize;
pub mod policy;
pub mod ppo;
pub mod reinforce;
pub mod replay_ratio;
pub mod rl;
pub mod run;
pub mod sac;
pub mod schedule;
pub mod selfplay;
pub mod services;
pub mod text;
pub mod weights;

pub use a2c::*;
pub use check::*;
pub use connections::*;
pub use dqn::*;
pub use eval::*;
pub use experiment::*;
pub use league::*;
pub use llm::*;
pub use lora::*;
pub use normalize::*;
pub use policy::*;
pub use ppo::*;
pub use reinforce::*;
pub use replay_ratio::*;
pub use rl::*;
pub use run::*;
pub use sac::*;
pub use schedule::*;
pub use selfplay::*;
pub use services::*;
pub use text::*;
pub use weights::*;

#[cfg(test)]
mod tests;
#[cfg(test)]
mod text_training_tests;
