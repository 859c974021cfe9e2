//! Evaluating policies, shared by the evaluator service and the command
//! line (`relay eval checkpoint`, `relay play`, `relay eval use`):
//!
//! - [`plugins`]: the [`plugins::Evaluator`] trait, the registry of named
//!   plugins and their options (`plugins/mod.rs`), and one file per plugin
//!   (`plugins/greedy.rs`, `stochastic.rs`, `threshold.rs`, `record.rs`,
//!   `vs_opponent.rs`);
//! - [`play`]: the episode players, [`play::play`] and
//!   [`play::play_against`] on the envs of [`play::eval_envs`], which the
//!   plugins and the command line share (also re-exported as
//!   `plugins::play`, `plugins::eval_envs`, ...);
//! - [`evaluate`], [`mean_std`]: the greedy return of a model, and the
//!   statistics every eval report gives.

#[cfg(test)]
mod fixtures;
pub mod play;
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
    Ok(play::play(
        model,
        None,
        play::eval_envs(env_id, &Default::default(), episodes, seed)?,
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

/// The weakest matchup (opponent and seat) of a `vs-opponent` evaluation
/// of a game on observations: the mean, standard deviation and games of
/// the matchup whose mean less `z` standard errors is lowest (`returns[i]`
/// was played in matchup `matchup_of[i]`). Such a run is judged by it, so
/// that a policy is solved only when it beats every opponent from every
/// seat; `None` without games.
pub fn weakest_matchup(returns: &[f64], matchup_of: &[usize], z: f64) -> Option<(f64, f64, usize)> {
    let matchups = matchup_of.iter().max()? + 1;
    (0..matchups)
        .filter_map(|k| {
            let scores: Vec<f64> = returns
                .iter()
                .zip(matchup_of)
                .filter(|(_, &m)| m == k)
                .map(|(&r, _)| r)
                .collect();
            if scores.is_empty() {
                return None;
            }
            let (mean, std) = mean_std(&scores);
            Some((mean, std, scores.len()))
        })
        .min_by(|a, b| {
            let bound = |(mean, std, n): &(f64, f64, usize)| {
                relay_proto::mean_less_standard_errors(*mean, *std, *n, z)
            };
            bound(a).total_cmp(&bound(b))
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_weakest_matchup_is_the_lowest_bound() {
        // Matchup 0: 1, 1, 1, 1 (mean 1); matchup 1: 1, 0, 1, 0 (mean 0.5).
        let returns = [1.0, 1.0, 1.0, 0.0, 1.0, 1.0, 1.0, 0.0];
        let of = [0, 1, 0, 1, 0, 1, 0, 1];
        let (mean, std, n) = weakest_matchup(&returns, &of, 0.0).unwrap();
        assert_eq!((mean, std, n), (0.5, 0.5, 4));
        // With z = 2 the bound is 0.5 - 2 * 0.5 / 2 = 0.
        let (mean, std, n) = weakest_matchup(&returns, &of, 2.0).unwrap();
        assert_eq!(
            relay_proto::mean_less_standard_errors(mean, std, n, 2.0),
            0.0
        );
        assert_eq!(weakest_matchup(&[], &[], 0.0), None);
    }
}
