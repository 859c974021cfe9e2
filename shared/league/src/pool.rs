//! The league's model pool: who is in the league, how good each is, and who
//! has played whom.
//!
//! This module owns the pool's state and every change to it: admitting a
//! published policy version (inheriting its parent's rating with a widened
//! sigma), adding or removing fixed opponents, pinning, recording a match
//! result (TrueSkill update plus win/draw/loss counts per pair), and keeping
//! the pool bounded. It does not choose opponents ([`crate::sampler`] does)
//! and does not store itself: [`Pool`] is plain serde state that the
//! services keep where they like (Redis as JSON or MessagePack).
//!
//! Bounding: after every change that can grow the pool, policy versions are
//! kept only if they are among the newest [`PoolConfig::keep_latest`], or
//! pinned, or among the [`PoolConfig::keep_best`] best by the conservative
//! score `mu - k * sigma` with `k` = [`PoolConfig::conservative_k`]
//! (default 3: the version is better than that with ~99.9% belief, so a
//! version lucky in a few games does not displace a proven one). Fixed
//! opponents are never evicted. Evicted members are returned so the caller
//! can drop their weights, and their pair records are dropped with them.

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::trueskill::{Outcome, Rating, TrueSkill, TrueSkillError};

/// Errors of pool operations.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum PoolError {
    /// A configuration field is out of range.
    #[error("pool config {field}: {reason}")]
    InvalidConfig {
        /// The field's path, e.g. `keep_latest` or `trueskill.beta`.
        field: String,
        /// Why it is rejected.
        reason: String,
    },
    /// The version is already in the pool.
    #[error("policy version {0} is already in the pool")]
    DuplicateVersion(u64),
    /// A fixed opponent of that name is already in the pool.
    #[error("fixed opponent {0:?} is already in the pool")]
    DuplicateFixed(String),
    /// A fixed opponent's name is unusable.
    #[error("invalid fixed opponent name {name:?}: {reason}")]
    InvalidFixedName {
        /// The rejected name.
        name: String,
        /// Why it is rejected.
        reason: &'static str,
    },
    /// The member is not (or no longer) in the pool.
    #[error("{0} is not in the pool")]
    UnknownMember(MemberId),
    /// A stored pool does not hold together.
    #[error("inconsistent pool state: {0}")]
    Inconsistent(String),
}

/// Names a pool member. As a string (serde, map keys, logs, configs) a
/// policy version is `v<number>` (`v12`) and a fixed opponent is its name
/// (`minimax`), which therefore may not look like a version.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(into = "String", try_from = "String")]
pub enum MemberId {
    /// A published policy version.
    Version(u64),
    /// A fixed opponent, by name.
    Fixed(String),
}

impl MemberId {
    /// The policy version, if this names one.
    pub fn version(&self) -> Option<u64> {
        match self {
            MemberId::Version(version) => Some(*version),
            MemberId::Fixed(_) => None,
        }
    }
}

impl fmt::Display for MemberId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MemberId::Version(version) => write!(f, "v{version}"),
            MemberId::Fixed(name) => f.write_str(name),
        }
    }
}

/// Parses `v<digits>` as a version number.
fn parse_version(text: &str) -> Option<u64> {
    let digits = text.strip_prefix('v')?;
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

fn check_fixed_name(name: &str) -> Result<(), PoolError> {
    let reason = if name.is_empty() {
        Some("empty")
    } else if name.trim() != name {
        Some("leading or trailing whitespace")
    } else if name
        .strip_prefix('v')
        .is_some_and(|rest| !rest.is_empty() && rest.bytes().all(|b| b.is_ascii_digit()))
    {
        Some("`v<digits>` names a policy version")
    } else {
        None
    };
    match reason {
        Some(reason) => Err(PoolError::InvalidFixedName {
            name: name.to_string(),
            reason,
        }),
        None => Ok(()),
    }
}

impl FromStr for MemberId {
    type Err = PoolError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        if let Some(version) = parse_version(text) {
            return Ok(MemberId::Version(version));
        }
        check_fixed_name(text)?;
        Ok(MemberId::Fixed(text.to_string()))
    }
}

impl From<MemberId> for String {
    fn from(id: MemberId) -> Self {
        id.to_string()
    }
}

impl TryFrom<String> for MemberId {
    type Error = PoolError;

    fn try_from(text: String) -> Result<Self, Self::Error> {
        text.parse()
    }
}

/// A published policy version.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PolicyVersion {
    /// The version number the learner published it under.
    pub version: u64,
    /// The version it was trained from, if any; its rating is inherited.
    pub parent: Option<u64>,
    /// Where its weights or adapter are (object-store key, path, ...);
    /// opaque to the league.
    pub weights_ref: String,
}

/// What a fixed opponent plays with.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FixedKind {
    /// Uniformly random legal moves.
    Random,
    /// Game-tree search.
    Minimax {
        /// Search depth in plies; `None` searches to the end of the game.
        depth: Option<u32>,
    },
    /// A saved model checkpoint.
    Checkpoint {
        /// Where the checkpoint is; opaque to the league.
        path: String,
    },
    /// A LoRA adapter on the shared base model.
    Adapter {
        /// Where the adapter is; opaque to the league.
        path: String,
    },
}

/// An opponent outside the training lineage, never evicted.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FixedOpponent {
    /// Unique name, also its [`MemberId`]; must not look like `v<digits>`.
    pub name: String,
    /// What it plays with.
    pub kind: FixedKind,
}

/// What a pool member is.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MemberKind {
    /// A version of the policy being trained.
    Policy(PolicyVersion),
    /// A fixed opponent.
    Fixed(FixedOpponent),
}

/// A pool member with its rating.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Member {
    /// What the member is.
    pub kind: MemberKind,
    /// Its current TrueSkill rating.
    pub rating: Rating,
    /// Pinned versions are never evicted (fixed opponents never are anyway).
    pub pinned: bool,
}

impl Member {
    /// The member's id.
    pub fn id(&self) -> MemberId {
        match &self.kind {
            MemberKind::Policy(policy) => MemberId::Version(policy.version),
            MemberKind::Fixed(fixed) => MemberId::Fixed(fixed.name.clone()),
        }
    }

    /// The policy version, if the member is one.
    pub fn version(&self) -> Option<u64> {
        match &self.kind {
            MemberKind::Policy(policy) => Some(policy.version),
            MemberKind::Fixed(_) => None,
        }
    }
}

/// Results of one member against another, from the first one's view.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct WinDrawLoss {
    /// Games the first member won.
    pub wins: u64,
    /// Games drawn.
    pub draws: u64,
    /// Games the first member lost.
    pub losses: u64,
}

impl WinDrawLoss {
    /// All games played.
    pub fn games(&self) -> u64 {
        self.wins + self.draws + self.losses
    }

    /// The same record from the other member's view.
    pub fn flipped(&self) -> Self {
        Self {
            wins: self.losses,
            draws: self.draws,
            losses: self.wins,
        }
    }

    fn add(&mut self, outcome: Outcome) {
        match outcome {
            Outcome::Win => self.wins += 1,
            Outcome::Draw => self.draws += 1,
            Outcome::Loss => self.losses += 1,
        }
    }
}

/// How the pool rates and bounds itself.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PoolConfig {
    /// The TrueSkill environment every rating lives in.
    pub trueskill: TrueSkill,
    /// Newest policy versions always kept (>= 1, so the current version is
    /// never evicted). Default 10.
    pub keep_latest: usize,
    /// Best policy versions by the conservative score kept in addition
    /// (0 keeps none beyond the newest and the pinned). Default 3.
    pub keep_best: usize,
    /// `k` in the conservative score `mu - k * sigma` that ranks members for
    /// `keep_best` and the leaderboard (>= 0). Default 3.
    pub conservative_k: f64,
    /// The uncertainty one version adds to its parent's rating, added in
    /// quadrature like TrueSkill's per-game `tau`: a new version starts at
    /// `sqrt(parent sigma^2 + sigma_widen^2)`, capped at `trueskill.sigma`
    /// (>= 0). A learner publishes a version per update, each a small
    /// step from its parent, so this is small: with a large value every
    /// version forgets its lineage's games and its rating is only its own
    /// few games. Default 0.5.
    pub sigma_widen: f64,
    /// Published versions join the pool every this many (the first version
    /// always; >= 1). The games of the versions in between count for the
    /// newest version in the pool, the head of the lineage: a version
    /// joins with its parent's rating once the parent's games are in,
    /// where a version per learner update would inherit before most of
    /// its parent's games had finished, and only the quick ones (often
    /// lost by a refused move) would reach the lineage. Default 10.
    pub admit_every: u64,
    /// Pins the first policy version admitted, so it is never evicted:
    /// the starting point every later version is rated against. Default
    /// true.
    pub keep_first: bool,
}

impl Default for PoolConfig {
    fn default() -> Self {
        Self {
            trueskill: TrueSkill::default(),
            keep_latest: 10,
            keep_best: 3,
            conservative_k: 3.0,
            sigma_widen: 0.5,
            admit_every: 10,
            keep_first: true,
        }
    }
}

impl PoolConfig {
    /// Checks every field, naming the first bad one.
    pub fn validate(&self) -> Result<(), PoolError> {
        let bad = |field: &str, reason: &str| {
            Err(PoolError::InvalidConfig {
                field: field.to_string(),
                reason: reason.to_string(),
            })
        };
        if let Err(TrueSkillError::InvalidParameter { field, reason }) = self.trueskill.validate() {
            return bad(&format!("trueskill.{field}"), &reason);
        }
        if self.keep_latest == 0 {
            return bad("keep_latest", "must be >= 1");
        }
        if self.admit_every == 0 {
            return bad("admit_every", "must be >= 1");
        }
        if !(self.conservative_k.is_finite() && self.conservative_k >= 0.0) {
            return bad("conservative_k", "must be finite and >= 0");
        }
        if !(self.sigma_widen.is_finite() && self.sigma_widen >= 0.0) {
            return bad("sigma_widen", "must be finite and >= 0");
        }
        Ok(())
    }
}

/// What [`Pool::record_result`] did.
#[derive(Debug, Clone, PartialEq)]
pub struct RatedMatch {
    /// Rating of the first member before the match.
    pub a_before: Rating,
    /// Rating of the first member after the match.
    pub a_after: Rating,
    /// Rating of the second member before the match.
    pub b_before: Rating,
    /// Rating of the second member after the match.
    pub b_after: Rating,
    /// Why the ratings were left unchanged although the game was counted:
    /// a result too extreme for double precision (the Python package raises
    /// there too). `None` when rated, and for a member against itself, which
    /// is counted but never rated (nobody gains on themselves).
    pub rating_error: Option<TrueSkillError>,
}

/// The league's members, their ratings and their head-to-head records.
///
/// Serde: deserializing checks that the state holds together (valid config,
/// member keys match their ids, records name only members), so a corrupt
/// stored pool is an error rather than a panic later.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(try_from = "PoolState")]
pub struct Pool {
    config: PoolConfig,
    members: BTreeMap<MemberId, Member>,
    /// `records[x][y]` with `x <= y`, from `x`'s view; pairs without games
    /// are absent.
    records: BTreeMap<MemberId, BTreeMap<MemberId, WinDrawLoss>>,
}

/// The unchecked serde form of [`Pool`].
#[derive(Deserialize)]
struct PoolState {
    config: PoolConfig,
    members: BTreeMap<MemberId, Member>,
    records: BTreeMap<MemberId, BTreeMap<MemberId, WinDrawLoss>>,
}

impl TryFrom<PoolState> for Pool {
    type Error = PoolError;

    fn try_from(state: PoolState) -> Result<Self, Self::Error> {
        state.config.validate()?;
        for (id, member) in &state.members {
            if member.id() != *id {
                return Err(PoolError::Inconsistent(format!(
                    "member stored under {id} is {}",
                    member.id()
                )));
            }
            if !(member.rating.mu.is_finite()
                && member.rating.sigma.is_finite()
                && member.rating.sigma > 0.0)
            {
                return Err(PoolError::Inconsistent(format!(
                    "{id} has an invalid rating {:?}",
                    member.rating
                )));
            }
        }
        for (x, row) in &state.records {
            for y in row.keys() {
                if x > y || !state.members.contains_key(x) || !state.members.contains_key(y) {
                    return Err(PoolError::Inconsistent(format!(
                        "record {x} vs {y} is out of order or names an unknown member"
                    )));
                }
            }
        }
        Ok(Self {
            config: state.config,
            members: state.members,
            records: state.records,
        })
    }
}

impl Pool {
    /// An empty pool.
    pub fn new(config: PoolConfig) -> Result<Self, PoolError> {
        config.validate()?;
        Ok(Self {
            config,
            members: BTreeMap::new(),
            records: BTreeMap::new(),
        })
    }

    /// The configuration.
    pub fn config(&self) -> &PoolConfig {
        &self.config
    }

    /// Replaces the configuration and applies the new bounds; returns the
    /// members evicted. Existing ratings are kept as they are.
    pub fn set_config(&mut self, config: PoolConfig) -> Result<Vec<Member>, PoolError> {
        config.validate()?;
        self.config = config;
        Ok(self.enforce_bounds())
    }

    /// Number of members (versions and fixed opponents).
    pub fn len(&self) -> usize {
        self.members.len()
    }

    /// Whether the pool has no member.
    pub fn is_empty(&self) -> bool {
        self.members.is_empty()
    }

    /// A member by id.
    pub fn get(&self, id: &MemberId) -> Option<&Member> {
        self.members.get(id)
    }

    /// Every member: policy versions oldest first, then fixed opponents by
    /// name.
    pub fn members(&self) -> impl Iterator<Item = &Member> {
        self.members.values()
    }

    /// The policy versions in the pool, oldest first.
    pub fn versions(&self) -> impl DoubleEndedIterator<Item = u64> + '_ {
        self.members.keys().filter_map(MemberId::version)
    }

    /// Whether published `version` joins the pool: the first version, then
    /// every [`PoolConfig::admit_every`]-th.
    pub fn admits(&self, version: u64) -> bool {
        self.current_version().is_none() || version.is_multiple_of(self.config.admit_every)
    }

    /// The member a game of the learning adapter's `version` is rated as:
    /// the version itself when it is in the pool; the newest version in
    /// the pool when `version` came after it and does not join
    /// ([`Pool::admits`]); `None` when it left the pool, is older than
    /// the newest, or must join first.
    pub fn rated_as(&self, version: u64) -> Option<MemberId> {
        let id = MemberId::Version(version);
        if self.members.contains_key(&id) {
            return Some(id);
        }
        let newest = self.current_version()?;
        (newest < version && !self.admits(version)).then_some(MemberId::Version(newest))
    }

    /// The current (newest) policy version, if any.
    pub fn current_version(&self) -> Option<u64> {
        self.versions().next_back()
    }

    /// The current (newest) policy version's member, if any.
    pub fn current(&self) -> Option<&Member> {
        self.current_version()
            .and_then(|version| self.members.get(&MemberId::Version(version)))
    }

    /// The conservative score `mu - conservative_k * sigma` of a member.
    pub fn conservative_score(&self, member: &Member) -> f64 {
        member.rating.conservative(self.config.conservative_k)
    }

    /// Every member with its conservative score, best first (ties: newer
    /// version first, then by id).
    pub fn leaderboard(&self) -> Vec<(&Member, f64)> {
        let mut board: Vec<(&Member, f64)> = self
            .members
            .values()
            .map(|member| (member, self.conservative_score(member)))
            .collect();
        board.sort_by(|(a, score_a), (b, score_b)| {
            score_b
                .total_cmp(score_a)
                .then_with(|| b.version().cmp(&a.version()))
                .then_with(|| a.id().cmp(&b.id()))
        });
        board
    }

    /// The 1 vs 1 match quality of two members, if both are in the pool.
    pub fn quality(&self, a: &MemberId, b: &MemberId) -> Option<f64> {
        let (a, b) = (self.members.get(a)?, self.members.get(b)?);
        Some(self.config.trueskill.quality_1vs1(a.rating, b.rating))
    }

    /// `a`'s record against `b` (zero if they never played).
    pub fn record(&self, a: &MemberId, b: &MemberId) -> WinDrawLoss {
        let (low, high, flip) = if a <= b { (a, b, false) } else { (b, a, true) };
        let record = self
            .records
            .get(low)
            .and_then(|row| row.get(high))
            .copied()
            .unwrap_or_default();
        if flip {
            record.flipped()
        } else {
            record
        }
    }

    /// Games played between `a` and `b`.
    pub fn games_between(&self, a: &MemberId, b: &MemberId) -> u64 {
        self.record(a, b).games()
    }

    /// Admits a published policy version and applies the bounds; returns the
    /// members evicted (possibly the new version itself, if it is older than
    /// the newest `keep_latest` and neither pinned nor among the best).
    ///
    /// Its rating: the parent's mu with sigma `min(sqrt(parent sigma^2 +
    /// sigma_widen^2), trueskill.sigma)` when the parent is in the pool,
    /// else the environment's prior. The first version admitted is pinned
    /// when [`PoolConfig::keep_first`] is set.
    pub fn add_version(&mut self, policy: PolicyVersion) -> Result<Vec<Member>, PoolError> {
        let id = MemberId::Version(policy.version);
        if self.members.contains_key(&id) {
            return Err(PoolError::DuplicateVersion(policy.version));
        }
        let env = self.config.trueskill;
        let rating = match policy
            .parent
            .and_then(|parent| self.members.get(&MemberId::Version(parent)))
        {
            Some(parent) => Rating::new(
                parent.rating.mu,
                parent
                    .rating
                    .sigma
                    .hypot(self.config.sigma_widen)
                    .min(env.sigma),
            ),
            None => env.new_rating(),
        };
        let first = self.versions().next().is_none();
        self.members.insert(
            id,
            Member {
                kind: MemberKind::Policy(policy),
                rating,
                pinned: first && self.config.keep_first,
            },
        );
        Ok(self.enforce_bounds())
    }

    /// Adds a fixed opponent at the environment's prior rating.
    pub fn add_fixed(&mut self, opponent: FixedOpponent) -> Result<(), PoolError> {
        check_fixed_name(&opponent.name)?;
        let id = MemberId::Fixed(opponent.name.clone());
        if self.members.contains_key(&id) {
            return Err(PoolError::DuplicateFixed(opponent.name));
        }
        let rating = self.config.trueskill.new_rating();
        self.members.insert(
            id,
            Member {
                kind: MemberKind::Fixed(opponent),
                rating,
                pinned: false,
            },
        );
        Ok(())
    }

    /// Removes a fixed opponent (and its records); returns it.
    pub fn remove_fixed(&mut self, name: &str) -> Result<Member, PoolError> {
        let id = MemberId::Fixed(name.to_string());
        let member = self
            .members
            .remove(&id)
            .ok_or_else(|| PoolError::UnknownMember(id.clone()))?;
        self.drop_records(&id);
        Ok(member)
    }

    /// Pins a policy version so it is never evicted.
    pub fn pin(&mut self, version: u64) -> Result<(), PoolError> {
        self.version_mut(version)?.pinned = true;
        Ok(())
    }

    /// Unpins a policy version and applies the bounds; returns the members
    /// evicted (possibly that version).
    pub fn unpin(&mut self, version: u64) -> Result<Vec<Member>, PoolError> {
        self.version_mut(version)?.pinned = false;
        Ok(self.enforce_bounds())
    }

    fn version_mut(&mut self, version: u64) -> Result<&mut Member, PoolError> {
        let id = MemberId::Version(version);
        self.members
            .get_mut(&id)
            .ok_or(PoolError::UnknownMember(id))
    }

    /// Records a game of `a` against `b` with `outcome` from `a`'s view:
    /// counts it and updates both TrueSkill ratings. Unknown members (e.g.
    /// evicted while the game was played) are an error and change nothing.
    /// See [`RatedMatch::rating_error`] for games counted but not rated.
    pub fn record_result(
        &mut self,
        a: &MemberId,
        b: &MemberId,
        outcome: Outcome,
    ) -> Result<RatedMatch, PoolError> {
        let a_before = self
            .members
            .get(a)
            .ok_or_else(|| PoolError::UnknownMember(a.clone()))?
            .rating;
        let b_before = self
            .members
            .get(b)
            .ok_or_else(|| PoolError::UnknownMember(b.clone()))?
            .rating;
        let (low, high, low_outcome) = if a <= b {
            (a, b, outcome)
        } else {
            (b, a, outcome.flipped())
        };
        self.records
            .entry(low.clone())
            .or_default()
            .entry(high.clone())
            .or_default()
            .add(low_outcome);
        let mut rated = RatedMatch {
            a_before,
            a_after: a_before,
            b_before,
            b_after: b_before,
            rating_error: None,
        };
        if a == b {
            return Ok(rated);
        }
        match self.config.trueskill.rate_1vs1(a_before, b_before, outcome) {
            Ok((a_after, b_after)) => {
                rated.a_after = a_after;
                rated.b_after = b_after;
                // Both ids were checked above.
                if let Some(member) = self.members.get_mut(a) {
                    member.rating = a_after;
                }
                if let Some(member) = self.members.get_mut(b) {
                    member.rating = b_after;
                }
            }
            Err(error) => rated.rating_error = Some(error),
        }
        Ok(rated)
    }

    /// Evicts the policy versions outside the bounds; returns them, oldest
    /// first.
    fn enforce_bounds(&mut self) -> Vec<Member> {
        let mut versions: Vec<&Member> = self
            .members
            .values()
            .filter(|member| member.version().is_some())
            .collect();
        // Newest first.
        versions.sort_by_key(|member| std::cmp::Reverse(member.version()));
        let mut keep: Vec<u64> = versions
            .iter()
            .take(self.config.keep_latest)
            .chain(versions.iter().filter(|member| member.pinned))
            .filter_map(|member| member.version())
            .collect();
        let mut by_score = versions.clone();
        // Stable sort: equal scores keep newest first.
        by_score.sort_by(|a, b| {
            self.conservative_score(b)
                .total_cmp(&self.conservative_score(a))
        });
        keep.extend(
            by_score
                .iter()
                .take(self.config.keep_best)
                .filter_map(|member| member.version()),
        );
        let evict: Vec<MemberId> = versions
            .iter()
            .filter_map(|member| member.version())
            .filter(|version| !keep.contains(version))
            .map(MemberId::Version)
            .collect();
        let mut evicted = Vec::with_capacity(evict.len());
        for id in evict.iter().rev() {
            if let Some(member) = self.members.remove(id) {
                evicted.push(member);
            }
            self.drop_records(id);
        }
        evicted
    }

    fn drop_records(&mut self, id: &MemberId) {
        self.records.remove(id);
        self.records.retain(|_, row| {
            row.remove(id);
            !row.is_empty()
        });
    }
}
