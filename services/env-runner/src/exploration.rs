//! gSDE's held noise on the env side (`policy.use_sde`): each env's
//! exploration-matrix seed, drawn anew at the start of each fragment and
//! every `policy.sde_sample_freq` steps, and sent with each act request.
//! The inference servers keep nothing between requests, so the seed is
//! what holds an env's noise from step to step, whichever server acts it.

use rand::{Rng, SeedableRng};
use relay_config::PolicyConfig;

/// Each env's exploration seed (see the module docs).
pub(crate) struct ExplorationSeeds {
    seeds: Vec<u64>,
    /// `policy.sde_sample_freq`: a new seed every this many steps (0 or
    /// less: only at each fragment's start).
    sample_freq: i64,
    rng: rand::rngs::StdRng,
}

impl ExplorationSeeds {
    /// The seeds of `n` envs, drawn from `seed`; `None` unless the policy
    /// uses gSDE.
    pub(crate) fn new(policy: &PolicyConfig, n: usize, seed: u64) -> Option<Self> {
        policy.use_sde.then(|| Self {
            seeds: vec![0; n],
            sample_freq: policy.sde_sample_freq,
            rng: rand::rngs::StdRng::seed_from_u64(seed),
        })
    }

    /// The seeds to act the fragment's step `step` (from 0) with, drawn
    /// anew where one is due.
    pub(crate) fn for_step(&mut self, step: usize) -> &[u64] {
        let due = step == 0 || (self.sample_freq > 0 && step as i64 % self.sample_freq == 0);
        if due {
            for seed in &mut self.seeds {
                *seed = self.rng.random();
            }
        }
        &self.seeds
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seeds_are_held_for_sample_freq_steps_and_renewed_each_fragment() {
        let mut config = PolicyConfig::default();
        assert!(ExplorationSeeds::new(&config, 2, 1).is_none());
        config.use_sde = true;
        config.sde_sample_freq = 4;
        let mut seeds = ExplorationSeeds::new(&config, 2, 1).unwrap();
        let first = seeds.for_step(0).to_vec();
        assert_ne!(first[0], first[1], "each env its own matrix");
        for step in 1..4 {
            assert_eq!(seeds.for_step(step), first);
        }
        let fifth = seeds.for_step(4).to_vec();
        assert_ne!(fifth, first);
        config.sde_sample_freq = -1;
        let mut once = ExplorationSeeds::new(&config, 2, 1).unwrap();
        let held = once.for_step(0).to_vec();
        for step in 1..200 {
            assert_eq!(once.for_step(step), held);
        }
        assert_ne!(once.for_step(0), held, "a new fragment, new noise");
    }
}
