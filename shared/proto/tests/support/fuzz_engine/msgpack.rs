//! Byte-level payloads: arbitrary MessagePack shaped like the protocol's
//! fields, byte mutations, and tensor corruptions.

use super::*;

/// Every field name of the protocol, for MessagePack-shaped garbage.
pub const KEYS: &[&str] = &[
    "schema",
    "adapter",
    "prompt",
    "sampling",
    "allowed",
    "temperature",
    "top_p",
    "top_k",
    "max_tokens",
    "stop",
    "seed",
    "prompt_tokens",
    "completion_tokens",
    "text",
    "finish",
    "payload",
    "Inline",
    "ObjectStore",
    "config_json",
    "safetensors",
    "bucket",
    "key",
    "Text",
    "Chat",
    "Tokens",
    "role",
    "content",
    "seats",
    "turns",
    "player",
    "action",
    "invalid",
    "reasons",
    "duration_ms",
    "branch",
    "group",
    "index",
    "size",
    "obs",
    "deterministic",
    "policy_version",
    "actions",
    "logprobs",
    "values",
    "runner_id",
    "env_id",
    "num_steps",
    "num_envs",
    "rewards",
    "terminated",
    "truncated",
    "next_obs",
    "final_obs",
    "accepted",
    "retry_after_ms",
    "buffered_steps",
    "reason",
    "min_policy_version",
    "max_steps",
    "fragments",
    "dropped_stale",
    "version",
    "learner_env_steps",
    "tensors",
    "name",
    "tensor",
    "dtype",
    "shape",
    "data",
    "episodes",
    "episode_return",
    "length",
    "service",
    "instance",
    "vec_steps",
    "kind",
    "value",
    "evaluator",
    "returns",
    "mean_return",
    "std_return",
    "threshold",
    "solved",
    "status",
    "detail",
    "alert",
    "metric",
    "active",
    "message",
    "options",
    "copies",
    "instances",
    "started",
    "stopped",
    "exit_code",
    "error",
    "lines",
    "f32",
    "i64",
    "u8",
    "gauge",
    "counter",
    "running",
    "failed",
    "matchups",
    "opponent",
    "seat",
    "games",
    "seats",
    "turns",
    "learner_seat",
    "player",
    "prompt_tokens",
    "completion_tokens",
    "action",
    "invalid",
    "adapter",
    "reasons",
    "duration_ms",
    "u32",
];

pub fn mp_str(out: &mut Vec<u8>, s: &str) {
    let b = s.as_bytes();
    if b.len() < 32 {
        out.push(0xa0 | b.len() as u8);
    } else {
        out.push(0xd9);
        out.push(b.len().min(255) as u8);
    }
    out.extend_from_slice(&b[..b.len().min(255)]);
}

/// A random MessagePack value, now and then with a length that lies.
pub fn mp_value(rng: &mut Rng, out: &mut Vec<u8>, depth: usize) {
    let composite = depth < 4;
    match rng.below(if composite { 14 } else { 11 }) {
        0 => out.push(rng.pick(&[0xc0, 0xc2, 0xc3])),
        1 => out.push(rng.below(128) as u8),
        2 => {
            out.push(0xcd);
            out.extend_from_slice(&(rng.pick(&[1u16, 0, 2, u16::MAX])).to_be_bytes());
        }
        3 => {
            out.push(rng.pick(&[0xce, 0xcf, 0xd3]));
            let n = if out.last() == Some(&0xce) { 4 } else { 8 };
            out.extend_from_slice(&rng.u64().to_be_bytes()[..n]);
        }
        4 => {
            out.push(0xca);
            let v = if rng.bool() {
                rng.non_finite_f32()
            } else {
                rng.f32()
            };
            out.extend_from_slice(&v.to_be_bytes());
        }
        5 => {
            out.push(0xcb);
            out.extend_from_slice(&rng.f64().to_be_bytes());
        }
        6 | 7 => {
            let key = rng.pick(KEYS);
            mp_str(out, key);
        }
        8 => {
            let s = rng.text(40);
            mp_str(out, &s);
        }
        9 => {
            // bin8 with a plausible tensor-sized payload.
            let len = rng.pick(&[0, 1, 4, 8, 12, 16, 24, 32, 33]);
            out.push(0xc4);
            out.push(len as u8);
            out.extend(rng.bytes(len));
        }
        10 => {
            // A container or bin header declaring far more than follows.
            out.push(rng.pick(&[0xc6, 0xdb, 0xdd, 0xdf]));
            out.extend_from_slice(&(rng.u64() as u32).to_be_bytes());
            let n = rng.range(0, 8);
            out.extend(rng.bytes(n));
        }
        11 | 12 => {
            let n = rng.range(0, 5);
            out.push(0x80 | n as u8);
            for i in 0..n {
                if i == 0 && rng.bool() {
                    mp_str(out, "schema");
                    out.push(1);
                    continue;
                }
                mp_str(out, rng.pick(KEYS));
                mp_value(rng, out, depth + 1);
            }
        }
        _ => {
            let n = rng.range(0, 5);
            out.push(0x90 | n as u8);
            for _ in 0..n {
                mp_value(rng, out, depth + 1);
            }
        }
    }
}

/// Arbitrary bytes: uniform noise, or MessagePack-shaped noise.
pub fn arbitrary(rng: &mut Rng) -> Vec<u8> {
    match rng.below(4) {
        0 => {
            let len = rng.range(0, 256);
            rng.bytes(len)
        }
        1 => {
            // Deep nesting under a field name nobody reads.
            let depth = rng.pick(&[10, 100, 1000, 2000, 100_000]);
            let mut out = vec![0x82, 0xa6];
            out.extend_from_slice(b"schema");
            out.push(1);
            mp_str(&mut out, "zz");
            out.extend(std::iter::repeat_n(rng.pick(&[0x91u8, 0x81]), depth));
            out.push(0xc0);
            out
        }
        _ => {
            let mut out = Vec::new();
            let depth = if rng.bool() { 3 } else { 0 };
            mp_value(rng, &mut out, depth);
            out
        }
    }
}

pub const INTERESTING: &[u8] = &[
    0x00, 0x01, 0x7f, 0x80, 0x8f, 0x90, 0x9f, 0xa0, 0xbf, 0xc0, 0xc1, 0xc2, 0xc3, 0xc4, 0xc6, 0xca,
    0xcb, 0xcc, 0xcf, 0xd3, 0xd9, 0xdb, 0xdc, 0xdd, 0xde, 0xdf, 0xe0, 0xff,
];

/// One to three byte-level edits of `bytes`.
pub fn mutate_bytes(rng: &mut Rng, bytes: &mut Vec<u8>, other: &[u8]) {
    for _ in 0..rng.range(1, 3) {
        let len = bytes.len();
        match rng.below(8) {
            0 | 1 if len > 0 => {
                let i = rng.below(len);
                bytes[i] ^= 1 << rng.below(8);
            }
            2 if len > 0 => {
                let i = rng.below(len);
                bytes[i] = rng.pick(INTERESTING);
            }
            3 => bytes.truncate(rng.range(0, len)),
            4 => {
                let i = rng.range(0, len);
                let n = rng.range(1, 16);
                let ins = if rng.bool() {
                    rng.bytes(n)
                } else {
                    vec![rng.pick(INTERESTING); n]
                };
                bytes.splice(i..i, ins);
            }
            5 if len > 0 => {
                let i = rng.below(len);
                let j = rng.range(i, len.min(i + 16));
                bytes.drain(i..j);
            }
            6 if len > 0 => {
                let i = rng.below(len);
                let j = rng.range(i, len.min(i + 32));
                let chunk = bytes[i..j].to_vec();
                let at = rng.range(0, len);
                bytes.splice(at..at, chunk);
            }
            _ => {
                // Splice: our head, another valid encoding's tail.
                let i = rng.range(0, len);
                let j = rng.range(0, other.len());
                bytes.truncate(i);
                bytes.extend_from_slice(&other[j..]);
            }
        }
    }
}

/// One value-level mutation of a tensor.
pub fn mutate_tensor(rng: &mut Rng, t: &mut Tensor) -> Expect {
    match rng.below(8) {
        0 | 1 if t.dtype == DType::F32 && t.data.len() >= 4 => {
            let i = rng.below(t.data.len() / 4);
            let v = rng.non_finite_f32();
            t.data[i * 4..i * 4 + 4].copy_from_slice(&v.to_le_bytes());
            Expect::Reject(&["non_finite", "invalid"])
        }
        2 => {
            if t.data.is_empty() || rng.bool() {
                t.data.push(rng.u64() as u8);
            } else {
                t.data.pop();
            }
            Expect::Reject(&["shape", "invalid"])
        }
        3 if !t.shape.is_empty() => {
            let i = rng.below(t.shape.len());
            t.shape[i] = match rng.below(4) {
                0 => t.shape[i].wrapping_add(1),
                1 => t.shape[i].wrapping_sub(1),
                2 => u32::MAX,
                _ => rng.u64() as u32,
            };
            Expect::Any
        }
        4 => {
            if t.shape.is_empty() || rng.bool() {
                let at = rng.range(0, t.shape.len());
                t.shape.insert(at, rng.range(0, 3) as u32);
            } else {
                t.shape.remove(rng.below(t.shape.len()));
            }
            Expect::Any
        }
        5 => {
            // Dimensions whose product overflows usize and wraps to 0 or to
            // the byte count: only an overflow-checked length catches them.
            t.shape = match rng.below(3) {
                0 => vec![1 << 16; 4],
                1 => vec![1 << 16, 1 << 16, 1 << 16, 1 << 16, 3],
                _ => vec![u32::MAX; rng.range(2, 5)],
            };
            if rng.bool() {
                t.data.clear();
            }
            Expect::Any
        }
        6 => {
            t.dtype = rng.pick(&[DType::F32, DType::I64, DType::U8]);
            Expect::Any
        }
        _ => {
            // Reinterpret the same bytes under another shape.
            let elems = t.data.len() / t.dtype.size().max(1);
            t.shape = vec![elems as u32];
            Expect::Any
        }
    }
}
