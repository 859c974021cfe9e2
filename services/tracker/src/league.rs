//! The league's pool on the tracker's `/metrics`: every few seconds the
//! pool of the run (`relay:<run>:league` in Redis, see
//! [`relay_kit::league`]) is read and each member's TrueSkill rating and
//! games are exported by player (`v12` for a policy version, the name of a
//! fixed opponent). Members evicted from the pool lose their series.
//!
//! Metrics: `relay_league_rating_mu{player}`,
//! `relay_league_rating_sigma{player}`,
//! `relay_league_games_total{player,outcome}` (games the player won, drew
//! and lost against any other member).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use prometheus::{GaugeVec, IntCounterVec, Opts, Registry};
use relay_config::ExperimentConfig;
use relay_kit::league::LeagueStore;
use relay_kit::Shutdown;
use relay_league::Pool;

/// How often the pool is read.
const POLL: Duration = Duration::from_secs(2);

/// The exported series of the pool.
pub struct LeagueExport {
    mu: GaugeVec,
    sigma: GaugeVec,
    games: IntCounterVec,
    /// Games last exported per (player, outcome), to add only the increase.
    exported_games: BTreeMap<(String, &'static str), u64>,
    players: BTreeSet<String>,
}

impl LeagueExport {
    pub fn register(registry: &Registry) -> Self {
        let mu = GaugeVec::new(
            Opts::new(
                "relay_league_rating_mu",
                "TrueSkill mean rating of each league member.",
            ),
            &["player"],
        )
        .unwrap();
        let sigma = GaugeVec::new(
            Opts::new(
                "relay_league_rating_sigma",
                "TrueSkill rating uncertainty of each league member.",
            ),
            &["player"],
        )
        .unwrap();
        let games = IntCounterVec::new(
            Opts::new(
                "relay_league_games_total",
                "League games of each member against any other, by the member's outcome.",
            ),
            &["player", "outcome"],
        )
        .unwrap();
        relay_kit::metrics::register(registry, &mu);
        relay_kit::metrics::register(registry, &sigma);
        relay_kit::metrics::register(registry, &games);
        Self {
            mu,
            sigma,
            games,
            exported_games: BTreeMap::new(),
            players: BTreeSet::new(),
        }
    }

    /// Exports `pool` as it is now.
    pub fn update(&mut self, pool: &Pool) {
        let members: Vec<_> = pool.members().collect();
        let now: BTreeSet<String> = members.iter().map(|m| m.id().to_string()).collect();
        for gone in self.players.difference(&now) {
            let _ = self.mu.remove_label_values(&[gone]);
            let _ = self.sigma.remove_label_values(&[gone]);
            for outcome in ["win", "draw", "loss"] {
                let _ = self.games.remove_label_values(&[gone, outcome]);
                self.exported_games.remove(&(gone.clone(), outcome));
            }
        }
        for member in &members {
            let id = member.id();
            let player = id.to_string();
            self.mu.with_label_values(&[&player]).set(member.rating.mu);
            self.sigma
                .with_label_values(&[&player])
                .set(member.rating.sigma);
            let (mut wins, mut draws, mut losses) = (0, 0, 0);
            for other in &members {
                let record = pool.record(&id, &other.id());
                wins += record.wins;
                draws += record.draws;
                losses += record.losses;
            }
            for (outcome, total) in [("win", wins), ("draw", draws), ("loss", losses)] {
                let before = self
                    .exported_games
                    .entry((player.clone(), outcome))
                    .or_insert(0);
                // A counter only grows; pair records only grow while both stay.
                if total > *before {
                    self.games
                        .with_label_values(&[&player, outcome])
                        .inc_by(total - *before);
                    *before = total;
                } else {
                    self.games.with_label_values(&[&player, outcome]);
                }
            }
        }
        self.players = now;
    }
}

/// Reads the run's pool every [`POLL`] until shutdown and exports it. Waits
/// for Redis in the background; a pool that cannot be read is logged once
/// per change of the error and the last export stays.
pub async fn follow(cfg: Arc<ExperimentConfig>, registry: Registry, shutdown: Shutdown) {
    let Ok(run_id) = cfg.run_id() else { return };
    let redis = match relay_kit::connect_redis_with(&cfg.connections, &shutdown).await {
        Ok(redis) => redis,
        Err(e) => {
            tracing::warn!(error = %e, "league ratings are not exported: no Redis");
            return;
        }
    };
    let store = LeagueStore::new(redis, run_id);
    let mut export = LeagueExport::register(&registry);
    let mut last_error = None;
    let mut tick = tokio::time::interval(POLL);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = shutdown.wait() => return,
        }
        match store.load().await {
            Ok(Some(pool)) => {
                export.update(&pool);
                last_error = None;
            }
            Ok(None) => {}
            Err(e) => {
                let text = e.to_string();
                if last_error.as_ref() != Some(&text) {
                    tracing::warn!(error = %text, "reading the league pool failed");
                    last_error = Some(text);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use relay_league::{MemberId, Outcome, PolicyVersion, PoolConfig};

    fn exported(registry: &Registry) -> String {
        use prometheus::Encoder;
        let mut out = Vec::new();
        prometheus::TextEncoder::new()
            .encode(&registry.gather(), &mut out)
            .unwrap();
        String::from_utf8(out).unwrap()
    }

    fn version(version: u64) -> PolicyVersion {
        PolicyVersion {
            version,
            parent: version.checked_sub(1).filter(|&p| p > 0),
            weights_ref: String::new(),
        }
    }

    #[test]
    fn ratings_and_games_follow_the_pool_and_evicted_members_disappear() {
        let registry = Registry::new();
        let mut export = LeagueExport::register(&registry);
        let mut pool = Pool::new(PoolConfig {
            keep_latest: 2,
            keep_best: 0,
            keep_first: false,
            ..Default::default()
        })
        .unwrap();
        pool.add_version(version(1)).unwrap();
        pool.add_version(version(2)).unwrap();
        for _ in 0..3 {
            pool.record_result(&MemberId::Version(2), &MemberId::Version(1), Outcome::Win)
                .unwrap();
        }
        export.update(&pool);
        export.update(&pool);
        let text = exported(&registry);
        assert!(
            text.contains(r#"relay_league_games_total{outcome="win",player="v2"} 3"#),
            "{text}"
        );
        assert!(
            text.contains(r#"relay_league_games_total{outcome="loss",player="v1"} 3"#),
            "{text}"
        );
        let mu = |player: &str| pool.get(&player.parse().unwrap()).unwrap().rating.mu;
        assert!(mu("v2") > mu("v1"));
        assert!(text.contains(&format!(
            r#"relay_league_rating_mu{{player="v2"}} {}"#,
            mu("v2")
        )));

        // v3 joins; keep_latest 2 evicts v1, whose series go.
        pool.add_version(version(3)).unwrap();
        export.update(&pool);
        let text = exported(&registry);
        assert!(!text.contains(r#"player="v1""#), "{text}");
        assert!(
            text.contains(r#"relay_league_rating_sigma{player="v3"}"#),
            "{text}"
        );
    }
}
