//! Evaluating policies, shared by the evaluator service and the command
//! line (`relay eval checkpoint`, `relay play`, `relay eval use`):
//!
//! - [`plugins`]: the [`plugins::Evaluator`] trait, the registry of named
//!   plugins and their options, and [`plugins::play`], which plays
//!   episodes of a policy on vectorized envs.
//! - [`evaluate`], [`mean_std`]: the greedy return of a model, and the
//!   statistics every eval report gives.

pub mod plugins;

use relay_nn::ActorCritic;

/// Plays `episodes` episodes with the policy's deterministic actions,
/// on raw observations (no normalisation); returns each episode's return
/// (the `greedy` plugin without statistics). `env_id` is made as the
/// default `env` section makes it.
pub fn evaluate(
    model: &ActorCritic,
    env_id: &str,
    episodes: usize,
    seed: u64,
) -> Result<Vec<f64>, String> {
    Ok(plugins::play(
        model,
        None,
        plugins::eval_envs(env_id, &Default::default(), episodes, seed)?,
        seed,
        true,
        false,
    )?
    .into_iter()
    .map(|e| e.ret)
    .collect())
}

/// Mean and population standard deviation, as every eval report gives them.
pub fn mean_std(values: &[f64]) -> (f64, f64) {
    let mean = values.iter().sum::<f64>() / values.len() as f64;
    let var = values.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / values.len() as f64;
    (mean, var.sqrt())
}
