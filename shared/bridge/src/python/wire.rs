//! The protocol between a batch and its Python workers: the requests
//! relay sends, the replies it reads (MessagePack, one frame each way per
//! operation), and the env spec a worker describes.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;

use relay_envs::{ActionSpace, BoxSpace, EnvSpec};
use serde::{Deserialize, Serialize};
use serde_bytes::ByteBuf;

use crate::error::BridgeError;
use crate::section::WrapperConfig;

#[derive(Serialize)]
pub(super) struct InitRequest<'a> {
    pub(super) op: &'static str,
    pub(super) env_id: &'a str,
    pub(super) kwargs: &'a BTreeMap<String, serde_json::Value>,
    pub(super) wrappers: &'a [WrapperConfig],
    pub(super) imports: &'a [String],
    pub(super) python_path: &'a [PathBuf],
    pub(super) entry_point: Option<&'a str>,
    pub(super) num_envs: usize,
    pub(super) seeds: Vec<u64>,
    /// Send the env's action masks when it has them.
    pub(super) action_masks: bool,
    /// `auto`, `gymnasium` or `pettingzoo` (`env.backend`): under `auto`
    /// an id Gymnasium does not know and PettingZoo does is PettingZoo's.
    pub(super) backend: crate::Backend,
    /// PettingZoo games: `auto`, `self_play` or `shared` (`env.multi_agent`).
    pub(super) multi_agent: crate::MultiAgent,
    /// Multi-agent games: end each observation with its seat, one-hot.
    pub(super) seat_feature: bool,
    /// Only the spec is wanted: one env (or one game of a team) is made.
    pub(super) probe: bool,
}

#[derive(Serialize)]
pub(super) struct OpRequest {
    pub(super) op: &'static str,
}

#[derive(Serialize)]
pub(super) struct StepRequest<'a> {
    pub(super) op: &'static str,
    pub(super) actions: &'a serde_bytes::Bytes,
}

#[derive(Serialize)]
pub(super) struct GetAttrRequest<'a> {
    pub(super) op: &'static str,
    pub(super) index: usize,
    pub(super) name: &'a str,
}

#[derive(Deserialize)]
pub(super) struct WireSpec {
    obs_low: ByteBuf,
    obs_high: ByteBuf,
    action: WireAction,
    max_episode_steps: Option<u64>,
    reward_threshold: Option<f64>,
    /// `[C, H, W]` of uint8 image observations, which travel as one byte each.
    #[serde(default)]
    image: Option<[usize; 3]>,
    /// The env's reset info has `action_mask` (and masking is on).
    #[serde(default)]
    action_mask: bool,
    /// A multi-agent game's agents, in seat order.
    #[serde(default)]
    agents: Vec<String>,
    /// A parallel game's agents, each a row, sharing one policy.
    #[serde(default)]
    team: Vec<String>,
}

#[derive(Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
enum WireAction {
    Discrete { n: usize },
    Box { low: ByteBuf, high: ByteBuf },
}

#[derive(Deserialize)]
pub(super) struct ResetReply {
    pub(super) obs: ByteBuf,
    /// Envs with masks: one row of `n_actions` bytes per env.
    #[serde(default)]
    pub(super) masks: Option<ByteBuf>,
    /// Multi-agent games: the seat to move in each env.
    #[serde(default)]
    pub(super) movers: Option<ByteBuf>,
}

#[derive(Deserialize)]
pub(super) struct StepReply {
    pub(super) obs: ByteBuf,
    /// Single-agent envs: one f64 per env.
    #[serde(default)]
    pub(super) rewards: ByteBuf,
    /// Multi-agent games: one f64 per env and seat, and the seat to move.
    #[serde(default)]
    pub(super) seat_rewards: Option<ByteBuf>,
    #[serde(default)]
    pub(super) movers: Option<ByteBuf>,
    pub(super) terminated: ByteBuf,
    pub(super) truncated: ByteBuf,
    #[serde(rename = "final")]
    pub(super) final_obs: HashMap<usize, ByteBuf>,
    pub(super) failed: Vec<(usize, String)>,
    #[serde(default)]
    pub(super) masks: Option<ByteBuf>,
    #[serde(default)]
    pub(super) final_masks: HashMap<usize, ByteBuf>,
}

#[derive(Deserialize)]
pub(super) struct AttrReply {
    pub(super) value: serde_json::Value,
}

/// The spec relay sees (flattened observations) from a worker's description.
pub(super) fn spec_from_wire(env_id: &str, wire: &WireSpec) -> Result<EnvSpec, BridgeError> {
    let low = decode_f32(&wire.obs_low, wire.obs_low.len() / 4, env_id)?;
    let high = decode_f32(&wire.obs_high, wire.obs_high.len() / 4, env_id)?;
    if low.len() != high.len() || low.is_empty() {
        return Err(BridgeError::Protocol {
            env_id: env_id.to_string(),
            detail: format!(
                "observation bounds of {} and {} values",
                low.len(),
                high.len()
            ),
        });
    }
    let action_space = match &wire.action {
        WireAction::Discrete { n } => ActionSpace::Discrete { n: *n },
        WireAction::Box { low, high } => ActionSpace::Box {
            low: decode_f32(low, low.len() / 4, env_id)?,
            high: decode_f32(high, high.len() / 4, env_id)?,
        },
    };
    let action_mask = wire.action_mask && action_space.is_discrete();
    if !wire.agents.is_empty() && !action_space.is_discrete() {
        return Err(BridgeError::UnsupportedSpace {
            env_id: env_id.to_string(),
            message: "relay's self-play takes discrete actions".into(),
        });
    }
    Ok(EnvSpec {
        id: crate::intern(env_id),
        observation_space: BoxSpace { low, high },
        action_space,
        max_episode_steps: wire
            .max_episode_steps
            .map_or(u32::MAX, |m| m.min(u32::MAX as u64) as u32),
        reward_threshold: wire.reward_threshold,
        image: wire.image,
        action_mask,
        agents: wire.agents.clone(),
        team: wire.team.clone(),
    })
}

pub(super) fn decode_f32(
    bytes: &[u8],
    expected: usize,
    env_id: &str,
) -> Result<Vec<f32>, BridgeError> {
    if bytes.len() != expected * 4 {
        return Err(BridgeError::Protocol {
            env_id: env_id.to_string(),
            detail: format!(
                "{} bytes where {expected} f32 values were expected",
                bytes.len()
            ),
        });
    }
    Ok(bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes")))
        .collect())
}
