//! Tests of loading and validating configs.
//!
//! One module per config section they test; the constants below are the
//! base configs they share.

use super::*;
#[allow(unused_imports)]
use crate::hyper::policy::{CnnSpec, TrunkLayout};
use crate::hyper::schedule::Schedule;
#[allow(unused_imports)]
use relay_bridge::EnvSection;
#[allow(unused_imports)]
use std::path::{Path, PathBuf};

const BASE: &str = "run:\n  env_id: CartPole-v1\nppo:\n  rollout_steps: 256\n";

const TEXT: &str = "run:\n  env_id: TicTacToe-v0\n";

mod algos;
mod connections;
mod env;
mod layers;
mod league;
mod llm;
mod normalize;
mod policy;
mod services;
mod text;
