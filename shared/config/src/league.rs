//! The `league` section: self-play against past versions: the pool, its
//! rating and the opponent sampler, and the fixed opponents it rates against.

use relay_bridge::EnvSection;
use serde::{Deserialize, Serialize};

use crate::check::{invalid, ConfigError};
use crate::selfplay::SelfPlaySection;
use crate::text::{bot_plays, valid_adapter_name, TextConfig, BOT_NAMES};

/// The key of `text.opponents` whose weight is the share of training games
/// played against an opponent drawn from the league pool.
pub const LEAGUE_OPPONENT: &str = "league";

/// The self-play league of a text run ([`relay_league`]): the pool of the
/// learning adapter's published versions and fixed bots, rated by
/// TrueSkill from the games the env-runners play, and the sampler that
/// draws the opponent of each `league` game (`text.opponents.league`).
///
/// The pool lives in Redis (`relay:<run>:league`, [`crate::league`]); it is
/// created from `pool` and the fixed members when the run first needs it
/// and keeps its own settings afterwards (a resumed run keeps its ratings).
/// With the league on (`text.opponents.league` > 0) the learner admits
/// every version it publishes (inheriting the parent's rating) and stores
/// it in the run's object store bucket, so inference servers can serve any
/// version still in the pool.
///
/// Example (YAML):
///
/// ```yaml
/// text:
///   opponents: {league: 1, random: 0, minimax: 0}
/// league:
///   pool: {keep_latest: 8, keep_best: 2}
///   sampler:
///     kind: mixture
///     components:
///       - {weight: 0.4, sampler: {kind: mirror}}
///       - {weight: 0.3, sampler: {kind: lagged, k: 2}}
///       - {weight: 0.3, sampler: {kind: match_quality, temperature: 0.5}}
/// ```
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LeagueSection {
    /// How the pool rates and bounds itself (`relay_league::PoolConfig`):
    /// `trueskill` {`mu`, `sigma`, `beta`, `tau`, `draw_probability`} (the
    /// rating environment, defaults as the Python `trueskill` package),
    /// `keep_latest` (newest versions always kept, default 10),
    /// `keep_best` (best versions by `mu - conservative_k * sigma` kept
    /// besides, default 3), `conservative_k` (default 3), `sigma_widen`
    /// (the uncertainty a version adds to its parent's rating, in
    /// quadrature, default 0.5), `admit_every` (every this many published
    /// versions join; the games of those in between count for the newest
    /// pool version; default 10), `keep_first` (the first version stays as
    /// the reference, default true). Versions outside these bounds are
    /// evicted, and their stored adapters deleted.
    pub pool: relay_league::PoolConfig,
    /// Who the current version plays in a `league` game
    /// (`relay_league::SamplerConfig`, tagged by `kind`): `mirror` (itself;
    /// the default), `fixed` {`opponents`: [{`opponent`, `weight`}]} (named
    /// members: a bot or `v<N>`), `lagged` {`k`} (the version k back),
    /// `uniform` {`include_fixed`}, `match_quality` {`temperature`,
    /// `floor`, `include_fixed`} (TrueSkill match quality, even matches
    /// most), `least_played` {`include_fixed`}, or `mixture`
    /// {`components`: [{`weight`, `sampler`}]}. Who moves first is a fair
    /// coin each game.
    pub sampler: relay_league::SamplerConfig,
    /// Fixed members of the pool besides the bots and adapters named in
    /// `text.opponents`: bots (`random`, `minimax`, `connect_four_bot`;
    /// each must play the run's game) or `adapter:<name>` (a LoRA adapter
    /// the inference servers hold, e.g. from `llm.adapters`: a saved
    /// policy to beat); in games on observations (`selfplay.opponents`)
    /// `random`, `minimax`, `connect_four_bot` or `checkpoint:<folder>`
    /// (a saved checkpoint of a run on the same game). Samplers can draw
    /// them without the env-runners also playing them directly.
    pub fixed: Vec<String>,
    /// Which league games branch (`text.branches > 1`): unset, every one;
    /// a list of fixed members (`random`, `minimax`, `adapter:<name>`),
    /// only the games against them. Branching the games against a fixed
    /// bot gives each position the learner lost from a baseline of its own
    /// against the same opponent, as `bench-tictactoe` trains; in mirror
    /// games and those against past versions the opponent moves after the
    /// branched move differ with each continuation too.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub branch_against: Option<Vec<String>>,
}

impl LeagueSection {
    /// Checks every field against the run's game and who plays it: the
    /// `text` section in text games, `selfplay` in games on observations
    /// (whose fixed members are the bots of [`relay_envs::SEAT_BOT_NAMES`]
    /// and `checkpoint:<folder>`; which of them play
    /// the game is checked once it is made).
    pub(crate) fn validate(
        &self,
        text: &TextConfig,
        selfplay: &SelfPlaySection,
        env_id: &str,
        env: &EnvSection,
    ) -> Result<(), ConfigError> {
        let text_game = env.is_text_game(env_id);
        if let Err(e) = self.pool.validate() {
            return Err(match e {
                relay_league::PoolError::InvalidConfig { field, reason } => {
                    invalid(&format!("league.pool.{field}"), reason)
                }
                other => invalid("league.pool", other.to_string()),
            });
        }
        relay_league::OpponentSampler::new(self.sampler.clone()).map_err(|e| {
            let field = if e.path.is_empty() {
                "league.sampler".to_string()
            } else {
                format!("league.sampler.{}", e.path)
            };
            invalid(&field, e.reason)
        })?;
        for (index, name) in self.fixed.iter().enumerate() {
            let field = format!("league.fixed[{index}]");
            if !text_game {
                crate::selfplay::check_seat_opponent_name(&field, name)?;
                continue;
            }
            if let Some(adapter) = name.strip_prefix("adapter:") {
                if !valid_adapter_name(adapter) {
                    return Err(invalid(
                        &field,
                        format!("adapter name {adapter:?} must be 1 to 64 ASCII letters, digits, '-', '_' or '.'"),
                    ));
                }
                continue;
            }
            if !BOT_NAMES.contains(&name.as_str()) {
                return Err(invalid(
                    &field,
                    format!(
                        "unknown bot {name:?}; known: {}, or adapter:<name>",
                        BOT_NAMES.join(", ")
                    ),
                ));
            }
            if !bot_plays(name, env_id, env) {
                return Err(invalid(
                    &field,
                    format!("bot {name} does not play {env_id}"),
                ));
            }
        }
        let members: Vec<String> = league_fixed_names(text, selfplay, self, text_game);
        for (index, name) in self.branch_against.iter().flatten().enumerate() {
            if !members.contains(name) {
                return Err(not_a_member(
                    &format!("league.branch_against[{index}]"),
                    name,
                    &members,
                ));
            }
        }
        check_sampler_members(&self.sampler, "league.sampler", &members)
    }
}

/// The fixed members of the pool, without repeats: in text games the bots
/// and `adapter:<name>` entries of `text.opponents`, in games on
/// observations the bots and checkpoints of `selfplay.opponents`; then
/// `league.fixed`.
pub(crate) fn league_fixed_names(
    text: &TextConfig,
    selfplay: &SelfPlaySection,
    league: &LeagueSection,
    text_game: bool,
) -> Vec<String> {
    let own: Vec<&str> = if text_game {
        text.opponent_bots()
            .chain(
                text.opponents
                    .keys()
                    .map(String::as_str)
                    .filter(|name| name.starts_with("adapter:")),
            )
            .collect()
    } else {
        selfplay.bots().collect()
    };
    let mut names: Vec<String> = Vec::new();
    for name in own
        .into_iter()
        .chain(league.fixed.iter().map(String::as_str))
    {
        if !names.iter().any(|n| n == name) {
            names.push(name.to_string());
        }
    }
    names
}

/// `field` names `name`, which the pool does not hold as a fixed member.
fn not_a_member(field: &str, name: &str, members: &[String]) -> ConfigError {
    invalid(
        field,
        format!(
            "{name:?} is not a fixed member of the pool (the bots and adapters of text.opponents or selfplay.opponents, and league.fixed: {})",
            if members.is_empty() { "none".to_string() } else { members.join(", ") }
        ),
    )
}

/// A `fixed` sampler may name only fixed members the pool will hold (or
/// policy versions, which come and go).
pub(crate) fn check_sampler_members(
    sampler: &relay_league::SamplerConfig,
    path: &str,
    members: &[String],
) -> Result<(), ConfigError> {
    use relay_league::{MemberId, SamplerConfig};
    match sampler {
        SamplerConfig::Fixed { opponents, .. } => {
            for (index, entry) in opponents.iter().enumerate() {
                if let MemberId::Fixed(name) = &entry.opponent {
                    if !members.contains(name) {
                        return Err(not_a_member(
                            &format!("{path}.opponents[{index}].opponent"),
                            name,
                            members,
                        ));
                    }
                }
            }
            Ok(())
        }
        SamplerConfig::Mixture { components } => {
            for (index, component) in components.iter().enumerate() {
                check_sampler_members(
                    &component.sampler,
                    &format!("{path}.components[{index}].sampler"),
                    members,
                )?;
            }
            Ok(())
        }
        _ => Ok(()),
    }
}

/// The league member a fixed opponent is: `adapter:<name>` the LoRA
/// adapter the inference servers hold under that name (`llm.adapters`),
/// `minimax` a search to the end, `connect_four_bot` one to
/// `text.connect_four_depth`, any other bot random moves.
pub fn fixed_opponent(name: &str, text: &TextConfig) -> relay_league::FixedOpponent {
    use relay_league::FixedKind;
    let kind = match name {
        "minimax" => FixedKind::Minimax { depth: None },
        "connect_four_bot" => FixedKind::Minimax {
            depth: Some(text.connect_four_depth),
        },
        other => match (
            other.strip_prefix("adapter:"),
            crate::selfplay::checkpoint_opponent(other),
        ) {
            (Some(adapter), _) => FixedKind::Adapter {
                path: adapter.to_string(),
            },
            (_, Some(folder)) => FixedKind::Checkpoint {
                path: folder.to_string(),
            },
            _ => FixedKind::Random,
        },
    };
    relay_league::FixedOpponent {
        name: name.to_string(),
        kind,
    }
}
