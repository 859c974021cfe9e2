//! Messages of any size, by one rule: a message that may outgrow what the
//! NATS server carries (its `max_payload`) is measured when it is sent, by
//! encoding it, and one that is too large is divided into parts, each a
//! whole message of the same kind that a receiver takes like any other,
//! until every part fits ([`encode_within`]).
//!
//! What a message divides along is its own business ([`Divisible`]): a
//! rollout fragment its envs, then its steps; an act request its rows; a
//! sample request its transitions; an episode report its episodes. The
//! replies to the parts of a divided request are put back together
//! ([`Joinable`]) in the parts' order. A message that holds one indivisible
//! unit (one step of one env, one text game) and is still too large is an
//! [`Indivisible`] error naming its size and the limit: nothing is dropped
//! without a word.
//!
//! Why measure rather than estimate: a size worked out from the config
//! leaves out whatever a message carries beyond what the estimate thought
//! of (an action mask of thousands of actions, a recurrent state, a
//! frame table that did not deduplicate), and a server run by someone else
//! may carry less than relay's own. The config's estimate still picks the
//! `max_payload` of relay's own nats-server, so that most messages go
//! whole; nothing depends on it being right.
//!
//! Every part is measured against the limit less [`ENVELOPE_BYTES`], so
//! that a stored part can travel on inside another message (fragments
//! inside a `SampleReply`) and a reply can carry headers.

use std::ops::Range;

use crate::codec::{encode, WireMessage};

/// Room left in every part for the message that may carry it onward and
/// for NATS headers.
pub const ENVELOPE_BYTES: usize = 16 * 1024;

/// The most bytes one part may take on a server carrying `max_payload`.
pub fn part_limit(max_payload: usize) -> usize {
    max_payload.saturating_sub(ENVELOPE_BYTES)
}

/// A message that can be cut into smaller whole messages of its kind.
pub trait Divisible: WireMessage + Sized {
    /// What the message cannot be cut below (`"env step"`, `"row"`), for
    /// [`Indivisible`]'s message.
    const UNIT: &'static str;

    /// The message cut into at most `parts` (at least 2) whole messages of
    /// its kind, in order, that together hold what it held; `Err(self)`
    /// when it holds a single unit.
    fn divide(self, parts: usize) -> Result<Vec<Self>, Self>;
}

/// A reply to a request that may have been divided: the replies to the
/// parts, in order, make the reply to the whole.
pub trait Joinable: WireMessage + Sized {
    /// The reply to the whole request. `parts` is not empty.
    fn join(parts: Vec<Self>) -> Self;
}

/// A message too large for one NATS message that holds a single unit.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("one {unit} of a {kind} takes {bytes} bytes, more than the {limit} bytes a message carries here (the NATS server's max_payload of {max_payload} less {ENVELOPE_BYTES} for its envelope): raise the server's max_payload to at least {needed}")]
pub struct Indivisible {
    pub kind: &'static str,
    pub unit: &'static str,
    pub bytes: usize,
    pub limit: usize,
    pub max_payload: usize,
    /// The `max_payload` it would take, rounded up to a whole MiB.
    pub needed: usize,
}

/// A message of a divided whole with its encoding.
#[derive(Debug, Clone)]
pub struct Part<M> {
    pub message: M,
    pub bytes: Vec<u8>,
}

/// `message` encoded whole when it fits a server carrying `max_payload`,
/// else divided until every part fits ([`part_limit`]), in order.
pub fn encode_within<M: Divisible>(
    message: M,
    max_payload: usize,
) -> Result<Vec<Part<M>>, Indivisible> {
    let mut parts = Vec::new();
    encode_into(message, max_payload, &mut parts)?;
    Ok(parts)
}

fn encode_into<M: Divisible>(
    message: M,
    max_payload: usize,
    out: &mut Vec<Part<M>>,
) -> Result<(), Indivisible> {
    let limit = part_limit(max_payload);
    let bytes = encode(&message);
    if bytes.len() <= limit {
        out.push(Part { message, bytes });
        return Ok(());
    }
    // As many parts as the size says, and a sixteenth more: the parts'
    // own headers, and units that do not all take the same bytes.
    let wanted = (bytes.len() + bytes.len() / 16)
        .div_ceil(limit.max(1))
        .max(2);
    match message.divide(wanted) {
        Ok(pieces) => pieces
            .into_iter()
            .try_for_each(|piece| encode_into(piece, max_payload, out)),
        Err(_) => {
            const MIB: usize = 1 << 20;
            Err(Indivisible {
                kind: M::KIND,
                unit: M::UNIT,
                bytes: bytes.len(),
                limit,
                max_payload,
                needed: (bytes.len() + ENVELOPE_BYTES).div_ceil(MIB) * MIB,
            })
        }
    }
}

/// `n` units shared out into `parts` contiguous ranges (at most `n`),
/// their sizes differing by at most one.
pub fn shares(n: usize, parts: usize) -> Vec<Range<usize>> {
    let parts = parts.clamp(1, n.max(1));
    let (each, extra) = (n / parts, n % parts);
    let mut start = 0;
    (0..parts)
        .map(|p| {
            let len = each + usize::from(p < extra);
            let range = start..start + len;
            start += len;
            range
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shares_cover_every_unit_once_in_order() {
        assert_eq!(shares(10, 3), vec![0..4, 4..7, 7..10]);
        assert_eq!(shares(2, 5), vec![0..1, 1..2]);
        assert_eq!(shares(7, 1), vec![0..7]);
    }
}
