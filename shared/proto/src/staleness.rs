//! The policy-lag rule, in one place: every service that keeps or drops
//! on-policy data by the version of the policy that acted it (the
//! learner asking for and absorbing data, the replay buffer storing and
//! sampling it) computes the oldest fresh version with [`PolicyLag`] and
//! asks [`is_stale`]. The replay buffer's Lua insert scripts compare the
//! same way (`version < floor`) against the floor the learner last sent.

/// How far behind the learner on-policy data may be.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PolicyLag {
    /// `replay.max_policy_lag`: versions data may trail the learner by.
    pub max_lag: u64,
    /// The learner's first version in this process (a resumed run's):
    /// data of its earlier versions was acted before the restart, by
    /// weights this process never published, and is never fresh.
    pub floor: u64,
}

impl PolicyLag {
    /// The oldest version whose data is fresh while the learner is at
    /// `learner_version` (what the learner sends as `min_policy_version`).
    pub fn oldest_fresh(&self, learner_version: u64) -> u64 {
        learner_version.saturating_sub(self.max_lag).max(self.floor)
    }
}

/// Whether data acted by `version` is stale when `oldest_fresh` is the
/// oldest fresh version ([`PolicyLag::oldest_fresh`]).
pub fn is_stale(version: u64, oldest_fresh: u64) -> bool {
    version < oldest_fresh
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_policy_lag_rule() {
        let lag = PolicyLag {
            max_lag: 2,
            floor: 0,
        };
        assert_eq!(lag.oldest_fresh(0), 0);
        assert_eq!(lag.oldest_fresh(1), 0);
        assert_eq!(lag.oldest_fresh(10), 8);
        assert!(is_stale(7, lag.oldest_fresh(10)));
        assert!(!is_stale(8, lag.oldest_fresh(10)));
        assert!(!is_stale(10, lag.oldest_fresh(10)));
        // A resumed learner at version 50: nothing before 50 is fresh.
        let resumed = PolicyLag {
            max_lag: 2,
            floor: 50,
        };
        assert_eq!(resumed.oldest_fresh(50), 50);
        assert_eq!(resumed.oldest_fresh(51), 50);
        assert_eq!(resumed.oldest_fresh(60), 58);
        assert!(is_stale(49, resumed.oldest_fresh(51)));
        // Lag 0: only the current version's data.
        let strict = PolicyLag {
            max_lag: 0,
            floor: 0,
        };
        assert!(is_stale(4, strict.oldest_fresh(5)));
        assert!(!is_stale(5, strict.oldest_fresh(5)));
    }
}
