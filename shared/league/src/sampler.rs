//! Opponent sampling: whom the current policy version plays next, and who
//! moves first.
//!
//! This module owns the sampler configuration ([`SamplerConfig`], a serde
//! enum tagged by `kind`), its validation, and the draw itself
//! ([`OpponentSampler::sample`]), which returns a [`Matchup`] to record with
//! the game. It reads the [`Pool`] and never changes it.
//!
//! "Current" is always the pool's newest policy version. The pool-wide
//! samplers (`uniform`, `match_quality`, `least_played`) choose among every
//! other member; when there is none they fall back to mirror play and say so
//! in [`Matchup::fallback_to_mirror`]. A pool without any policy version is
//! an error ([`SampleError::NoCurrentVersion`]). Every draw uses only the
//! given RNG and the pool's ordered maps, so a seed fixes the sequence.
//!
//! Example (a config file's `sampler` section, YAML):
//!
//! ```
//! # use relay_league::{OpponentSampler, SamplerConfig};
//! let yaml = r#"
//! kind: mixture
//! components:
//!   - { weight: 0.5, sampler: { kind: mirror } }
//!   - { weight: 0.3, sampler: { kind: match_quality, temperature: 0.5 } }
//!   - { weight: 0.2, sampler: { kind: fixed, opponents: [ { opponent: minimax, weight: 1 } ] } }
//! "#;
//! let config: SamplerConfig = serde_yaml::from_str(yaml).unwrap();
//! let sampler = OpponentSampler::new(config).unwrap();
//! # assert!(matches!(sampler.config(), SamplerConfig::Mixture { components } if components.len() == 3));
//! ```

use rand::Rng;
use serde::{Deserialize, Serialize};

use crate::pool::{Member, MemberId, Pool};

/// How to choose the current version's next opponent.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum SamplerConfig {
    /// The current version plays itself. The default.
    #[default]
    Mirror,
    /// A weighted choice among listed members (usually fixed opponents);
    /// listed members missing from the pool are skipped, and it is an error
    /// if none is there.
    Fixed {
        /// The members to choose from, each with its relative weight.
        opponents: Vec<WeightedOpponent>,
        /// The chance that the current version moves first against them
        /// (in `(0, 1)`); unset, a fair coin as for every other rule. A
        /// seat that loses more to a fixed bot (the second player's, in
        /// TicTacToe) can be given more of its games.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        moves_first: Option<f64>,
    },
    /// The version `k` versions back: the newest version in the pool whose
    /// number is at most `current - k`, or the oldest version in the pool if
    /// none is that old.
    Lagged {
        /// How many versions back (0 is mirror play).
        k: u64,
    },
    /// Uniform over the pool's other members.
    Uniform {
        /// Whether fixed opponents are candidates, or only past versions.
        /// Default true.
        #[serde(default = "default_true")]
        include_fixed: bool,
    },
    /// Weighted by the TrueSkill 1 vs 1 match quality q against the current
    /// version: weight `max(q, floor) ^ (1 / temperature)`, so even matches
    /// are played most.
    MatchQuality {
        /// Sharpness: 1 is proportional to quality, below 1 favours the most
        /// even matches more, above 1 flattens toward uniform (> 0).
        /// Default 1.
        #[serde(default = "default_one")]
        temperature: f64,
        /// Quality floor in [0, 1], applied before the temperature, so
        /// lopsided matches keep some chance. Default 0.
        #[serde(default)]
        floor: f64,
        /// Whether fixed opponents are candidates, or only past versions.
        /// Default true.
        #[serde(default = "default_true")]
        include_fixed: bool,
    },
    /// The member with the fewest games against the current version; ties
    /// broken uniformly at random.
    LeastPlayed {
        /// Whether fixed opponents are candidates, or only past versions.
        /// Default true.
        #[serde(default = "default_true")]
        include_fixed: bool,
    },
    /// First choose a component by weight, then let it choose.
    Mixture {
        /// The samplers to mix, each with its relative weight.
        components: Vec<MixtureComponent>,
    },
}

fn default_true() -> bool {
    true
}

fn default_one() -> f64 {
    1.0
}

/// A candidate of the `fixed` sampler.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WeightedOpponent {
    /// The member: a fixed opponent's name or `v<number>`.
    pub opponent: MemberId,
    /// Relative weight (finite, > 0).
    pub weight: f64,
}

/// A component of the `mixture` sampler.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MixtureComponent {
    /// Relative weight (finite, > 0).
    pub weight: f64,
    /// The sampler used when this component is chosen.
    pub sampler: SamplerConfig,
}

/// Which rule chose an opponent (for recording and metric labels).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SamplerKind {
    /// `mirror`.
    Mirror,
    /// `fixed`.
    Fixed,
    /// `lagged`.
    Lagged,
    /// `uniform`.
    Uniform,
    /// `match_quality`.
    MatchQuality,
    /// `least_played`.
    LeastPlayed,
}

impl SamplerKind {
    /// The config name of the rule.
    pub fn as_str(self) -> &'static str {
        match self {
            SamplerKind::Mirror => "mirror",
            SamplerKind::Fixed => "fixed",
            SamplerKind::Lagged => "lagged",
            SamplerKind::Uniform => "uniform",
            SamplerKind::MatchQuality => "match_quality",
            SamplerKind::LeastPlayed => "least_played",
        }
    }
}

/// A sampler configuration that does not make sense.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("sampler config {path}: {reason}")]
pub struct SamplerConfigError {
    /// Where in the config, e.g. `components[1].sampler.temperature`.
    pub path: String,
    /// Why it is rejected.
    pub reason: String,
}

/// Why no opponent could be drawn.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SampleError {
    /// The pool holds no policy version, so there is no current player.
    #[error("the pool has no policy version to train")]
    NoCurrentVersion,
    /// None of the `fixed` sampler's members is in the pool.
    #[error("none of the fixed sampler's opponents is in the pool: {}", list_ids(.0))]
    NoListedOpponentInPool(Vec<MemberId>),
}

fn list_ids(ids: &[MemberId]) -> String {
    ids.iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}

/// One drawn game: the current version, its opponent, the seating, and how
/// the opponent was chosen.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Matchup {
    /// The current policy version (the one being trained).
    pub current: u64,
    /// Its opponent (the current version itself in mirror play).
    pub opponent: MemberId,
    /// Whether the current version takes seat 0 and moves first.
    pub current_moves_first: bool,
    /// The rule that chose the opponent (for a mixture, the chosen
    /// component's rule).
    pub sampler: SamplerKind,
    /// The rule had no candidate and mirror play was used instead.
    pub fallback_to_mirror: bool,
}

impl Matchup {
    /// The current version's id.
    pub fn current_id(&self) -> MemberId {
        MemberId::Version(self.current)
    }

    /// The players by seat: seat 0 moves first.
    pub fn seats(&self) -> [MemberId; 2] {
        if self.current_moves_first {
            [self.current_id(), self.opponent.clone()]
        } else {
            [self.opponent.clone(), self.current_id()]
        }
    }
}

/// A validated sampler configuration, ready to draw.
#[derive(Debug, Clone, PartialEq)]
pub struct OpponentSampler {
    config: SamplerConfig,
}

impl OpponentSampler {
    /// Validates the configuration.
    pub fn new(config: SamplerConfig) -> Result<Self, SamplerConfigError> {
        validate(&config, "")?;
        Ok(Self { config })
    }

    /// The configuration.
    pub fn config(&self) -> &SamplerConfig {
        &self.config
    }

    /// Draws the current version's next opponent and the seating (a coin
    /// from the same RNG, drawn after the opponent: fair unless the rule
    /// that chose the opponent says `moves_first`).
    pub fn sample<R: Rng + ?Sized>(
        &self,
        pool: &Pool,
        rng: &mut R,
    ) -> Result<Matchup, SampleError> {
        let current = pool
            .current_version()
            .ok_or(SampleError::NoCurrentVersion)?;
        let choice = choose(&self.config, pool, current, rng)?;
        let current_moves_first = rng.random_bool(choice.moves_first.unwrap_or(0.5));
        Ok(Matchup {
            current,
            opponent: choice.opponent,
            current_moves_first,
            sampler: choice.sampler,
            fallback_to_mirror: choice.fallback_to_mirror,
        })
    }
}

fn join(path: &str, field: &str) -> String {
    if path.is_empty() {
        field.to_string()
    } else {
        format!("{path}.{field}")
    }
}

fn check_weight(weight: f64, path: String) -> Result<(), SamplerConfigError> {
    if weight.is_finite() && weight > 0.0 {
        Ok(())
    } else {
        Err(SamplerConfigError {
            path,
            reason: format!("weight {weight} must be finite and > 0"),
        })
    }
}

fn validate(config: &SamplerConfig, path: &str) -> Result<(), SamplerConfigError> {
    match config {
        SamplerConfig::Mirror
        | SamplerConfig::Lagged { .. }
        | SamplerConfig::Uniform { .. }
        | SamplerConfig::LeastPlayed { .. } => Ok(()),
        SamplerConfig::Fixed {
            opponents,
            moves_first,
        } => {
            if let Some(share) = moves_first {
                if !(share.is_finite() && *share > 0.0 && *share < 1.0) {
                    return Err(SamplerConfigError {
                        path: join(path, "moves_first"),
                        reason: format!("{share} must be in (0, 1)"),
                    });
                }
            }
            if opponents.is_empty() {
                return Err(SamplerConfigError {
                    path: join(path, "opponents"),
                    reason: "must list at least one opponent".into(),
                });
            }
            for (index, entry) in opponents.iter().enumerate() {
                check_weight(
                    entry.weight,
                    join(path, &format!("opponents[{index}].weight")),
                )?;
            }
            Ok(())
        }
        SamplerConfig::MatchQuality {
            temperature, floor, ..
        } => {
            if !(temperature.is_finite() && *temperature > 0.0) {
                return Err(SamplerConfigError {
                    path: join(path, "temperature"),
                    reason: format!("{temperature} must be finite and > 0"),
                });
            }
            if !(0.0..=1.0).contains(floor) {
                return Err(SamplerConfigError {
                    path: join(path, "floor"),
                    reason: format!("{floor} must be in [0, 1]"),
                });
            }
            Ok(())
        }
        SamplerConfig::Mixture { components } => {
            if components.is_empty() {
                return Err(SamplerConfigError {
                    path: join(path, "components"),
                    reason: "must list at least one component".into(),
                });
            }
            for (index, component) in components.iter().enumerate() {
                let here = join(path, &format!("components[{index}]"));
                check_weight(component.weight, join(&here, "weight"))?;
                validate(&component.sampler, &join(&here, "sampler"))?;
            }
            Ok(())
        }
    }
}

struct Choice {
    opponent: MemberId,
    sampler: SamplerKind,
    fallback_to_mirror: bool,
    /// The chance the current version moves first (`None`: a fair coin).
    moves_first: Option<f64>,
}

fn chosen(opponent: MemberId, sampler: SamplerKind) -> Choice {
    Choice {
        opponent,
        sampler,
        fallback_to_mirror: false,
        moves_first: None,
    }
}

fn mirror_fallback(current: u64, sampler: SamplerKind) -> Choice {
    Choice {
        opponent: MemberId::Version(current),
        sampler,
        fallback_to_mirror: true,
        moves_first: None,
    }
}

/// An index drawn with probability proportional to `weights` (all finite,
/// >= 0, positive sum).
fn weighted_index<R: Rng + ?Sized>(weights: &[f64], rng: &mut R) -> usize {
    let total: f64 = weights.iter().sum();
    let mut remaining = rng.random::<f64>() * total;
    for (index, weight) in weights.iter().enumerate() {
        if remaining < *weight {
            return index;
        }
        remaining -= weight;
    }
    // Rounding left a sliver past the end: the last positive weight.
    weights.iter().rposition(|w| *w > 0.0).unwrap_or(0)
}

/// The members other than the current version.
fn others(pool: &Pool, current: u64, include_fixed: bool) -> Vec<&Member> {
    pool.members()
        .filter(|member| match member.version() {
            Some(version) => version != current,
            None => include_fixed,
        })
        .collect()
}

fn choose<R: Rng + ?Sized>(
    config: &SamplerConfig,
    pool: &Pool,
    current: u64,
    rng: &mut R,
) -> Result<Choice, SampleError> {
    let current_id = MemberId::Version(current);
    match config {
        SamplerConfig::Mirror => Ok(chosen(current_id, SamplerKind::Mirror)),
        SamplerConfig::Fixed {
            opponents,
            moves_first,
        } => {
            let present: Vec<&WeightedOpponent> = opponents
                .iter()
                .filter(|entry| pool.get(&entry.opponent).is_some())
                .collect();
            if present.is_empty() {
                return Err(SampleError::NoListedOpponentInPool(
                    opponents
                        .iter()
                        .map(|entry| entry.opponent.clone())
                        .collect(),
                ));
            }
            let weights: Vec<f64> = present.iter().map(|entry| entry.weight).collect();
            let index = weighted_index(&weights, rng);
            Ok(Choice {
                moves_first: *moves_first,
                ..chosen(present[index].opponent.clone(), SamplerKind::Fixed)
            })
        }
        SamplerConfig::Lagged { k } => {
            let target = current.saturating_sub(*k);
            let version = pool
                .versions()
                .rev()
                .find(|version| *version <= target)
                .or_else(|| pool.versions().next())
                .unwrap_or(current);
            if version == current && *k > 0 {
                Ok(mirror_fallback(current, SamplerKind::Lagged))
            } else {
                Ok(chosen(MemberId::Version(version), SamplerKind::Lagged))
            }
        }
        SamplerConfig::Uniform { include_fixed } => {
            let candidates = others(pool, current, *include_fixed);
            if candidates.is_empty() {
                return Ok(mirror_fallback(current, SamplerKind::Uniform));
            }
            let index = rng.random_range(0..candidates.len());
            Ok(chosen(candidates[index].id(), SamplerKind::Uniform))
        }
        SamplerConfig::MatchQuality {
            temperature,
            floor,
            include_fixed,
        } => {
            let candidates = others(pool, current, *include_fixed);
            if candidates.is_empty() {
                return Ok(mirror_fallback(current, SamplerKind::MatchQuality));
            }
            let env = pool.config().trueskill;
            let current_rating = pool
                .get(&current_id)
                .map(|member| member.rating)
                .unwrap_or_else(|| env.new_rating());
            let weights: Vec<f64> = candidates
                .iter()
                .map(|member| {
                    let quality = env.quality_1vs1(current_rating, member.rating);
                    quality.max(*floor).powf(1.0 / temperature)
                })
                .collect();
            let total: f64 = weights.iter().sum();
            // With no floor and a very low temperature every weight can
            // underflow to 0: then every candidate is equally (un)suitable.
            let index = if total > 0.0 && total.is_finite() {
                weighted_index(&weights, rng)
            } else {
                rng.random_range(0..candidates.len())
            };
            Ok(chosen(candidates[index].id(), SamplerKind::MatchQuality))
        }
        SamplerConfig::LeastPlayed { include_fixed } => {
            let candidates = others(pool, current, *include_fixed);
            let games: Vec<u64> = candidates
                .iter()
                .map(|member| pool.games_between(&current_id, &member.id()))
                .collect();
            let Some(fewest) = games.iter().min().copied() else {
                return Ok(mirror_fallback(current, SamplerKind::LeastPlayed));
            };
            let tied: Vec<&Member> = candidates
                .iter()
                .zip(&games)
                .filter(|(_, played)| **played == fewest)
                .map(|(member, _)| *member)
                .collect();
            let index = rng.random_range(0..tied.len());
            Ok(chosen(tied[index].id(), SamplerKind::LeastPlayed))
        }
        SamplerConfig::Mixture { components } => {
            let weights: Vec<f64> = components
                .iter()
                .map(|component| component.weight)
                .collect();
            let index = weighted_index(&weights, rng);
            choose(&components[index].sampler, pool, current, rng)
        }
    }
}
