//! The decoder fuzzer shared by `benches/fuzz.rs` (100,000 cases per message
//! type, `just bench-fuzz`) and `tests/fuzz.rs` (a few thousand per type on
//! every `cargo test`).
//!
//! Every case is a payload handed to `relay_proto::decode::<T>`, drawn from a
//! seeded generator (so a failure is reproducible from the seed): (a)
//! arbitrary bytes, raw or shaped like MessagePack with the protocol's field
//! names; (b) valid encodings of random well-formed messages (must decode to
//! the input); (c) mutations: of the value (wrong schema version, NaN/Inf in
//! a float tensor, wrong byte length, wrong shape or dtype, a broken
//! type-specific rule) and of the bytes (bit flips, truncation, insertion,
//! deletion, duplication, splices, interesting bytes); (d) payloads over
//! `MAX_MESSAGE_BYTES` and exactly at it.
//!
//! This file runs the cases and checks them; [`rng`] draws, [`messages`]
//! makes each type's values and corruptions, [`msgpack`] makes and mutates
//! bytes.
//!
//! A panic is caught and counted. Every accepted message must pass its own
//! `validate()`, carry `SCHEMA_VERSION`, hold tensors whose byte length
//! matches dtype and shape (computed without overflow) and only finite f32,
//! and re-encode to a payload that decodes to the same value.

#![allow(dead_code)]

use std::cell::Cell;
use std::collections::BTreeMap;
use std::fmt::Debug;
use std::panic::{self, AssertUnwindSafe};
use std::sync::{Mutex, Once};

use relay_proto::*;

/// The rejection labels of `relay_messages_rejected_total`, in table order.
pub const REASONS: [&str; 6] = [
    "oversized",
    "decode",
    "schema_version",
    "shape",
    "non_finite",
    "invalid",
];

#[path = "fuzz_engine/messages.rs"]
mod messages;
#[path = "fuzz_engine/msgpack.rs"]
mod msgpack;
#[path = "fuzz_engine/rng.rs"]
mod rng;

pub use messages::*;
pub use msgpack::*;
pub use rng::*;

// ------------------------------------------------------------------ checking

/// What a case's outcome must be.
pub enum Expect {
    /// Anything but a panic or a broken invariant.
    Any,
    /// Refused, with one of these reasons.
    Reject(&'static [&'static str]),
}

/// Counts for one message type.
#[derive(Debug, Default, Clone)]
pub struct Report {
    pub kind: &'static str,
    pub cases: u64,
    pub accepted: u64,
    pub rejected: BTreeMap<&'static str, u64>,
    pub panics: u64,
    pub failures: u64,
    /// Cases per generator class: arbitrary, valid, mutated, oversized.
    pub classes: [u64; 4],
    /// The first few panics and invariant failures, for the log.
    pub examples: Vec<String>,
}

impl Report {
    fn note(&mut self, what: String) {
        if self.examples.len() < 8 {
            self.examples.push(what);
        }
    }

    pub fn rejected_total(&self) -> u64 {
        self.rejected.values().sum()
    }
}

thread_local! {
    static IN_FUZZ: Cell<bool> = const { Cell::new(false) };
}
static LAST_PANIC: Mutex<Option<String>> = Mutex::new(None);
static HOOK: Once = Once::new();

/// Runs `f`, turning a panic into `Err(message with location)`. The panic
/// hook stays quiet for these panics only.
fn guarded<R>(f: impl FnOnce() -> R) -> Result<R, String> {
    HOOK.call_once(|| {
        let previous = panic::take_hook();
        panic::set_hook(Box::new(move |info| {
            if IN_FUZZ.with(Cell::get) {
                *LAST_PANIC.lock().unwrap_or_else(|e| e.into_inner()) = Some(info.to_string());
            } else {
                previous(info);
            }
        }));
    });
    IN_FUZZ.with(|c| c.set(true));
    let result = panic::catch_unwind(AssertUnwindSafe(f));
    IN_FUZZ.with(|c| c.set(false));
    result.map_err(|_| {
        LAST_PANIC
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
            .unwrap_or_else(|| "panic".into())
    })
}

fn hex_head(bytes: &[u8]) -> String {
    let head: String = bytes.iter().take(48).map(|b| format!("{b:02x}")).collect();
    format!(
        "{} bytes: {head}{}",
        bytes.len(),
        if bytes.len() > 48 { "…" } else { "" }
    )
}

/// Byte length a tensor needs, computed without any chance of overflow.
fn needed_bytes(t: &Tensor) -> u128 {
    t.shape
        .iter()
        .try_fold(t.dtype.size() as u128, |acc, &d| acc.checked_mul(d as u128))
        .unwrap_or(u128::MAX)
}

/// What must hold for every message `decode` accepted.
fn accepted_invariants<T: Subject>(m: &T, payload_len: usize) -> Result<(), String> {
    if payload_len > MAX_MESSAGE_BYTES {
        return Err(format!("accepted {payload_len} bytes, over the limit"));
    }
    if m.schema() != SCHEMA_VERSION {
        return Err(format!("accepted schema version {}", m.schema()));
    }
    m.validate()
        .map_err(|r| format!("accepted, but its own validate() says: {r}"))?;
    for t in m.tensors() {
        if needed_bytes(t) != t.data.len() as u128 {
            return Err(format!(
                "accepted a {:?} tensor of shape {:?} holding {} bytes",
                t.dtype,
                t.shape,
                t.data.len()
            ));
        }
        if t.dtype == DType::F32
            && t.data
                .chunks_exact(4)
                .any(|c| !f32::from_le_bytes([c[0], c[1], c[2], c[3]]).is_finite())
        {
            return Err(format!("accepted a non-finite f32 in shape {:?}", t.shape));
        }
    }
    let again = encode(m);
    if again.len() > MAX_MESSAGE_BYTES {
        return Ok(()); // re-encoding with field names outgrew the limit
    }
    let back = decode::<T>(&again).map_err(|r| format!("re-encoded message is refused: {r}"))?;
    if encode(&back) != again {
        return Err("re-encoded message decodes to different bytes".into());
    }
    #[allow(clippy::eq_op)]
    let reflexive = m == m; // false only with a NaN in an f64 field
    if reflexive && &back != m {
        return Err("re-encoded message decodes to another value".into());
    }
    Ok(())
}

/// Decodes one payload and checks the outcome.
fn check<T: Subject>(report: &mut Report, class: &str, payload: &[u8], expect: Expect) {
    report.cases += 1;
    let outcome = match guarded(|| decode::<T>(payload)) {
        Ok(outcome) => outcome,
        Err(panic) => {
            report.panics += 1;
            report.note(format!(
                "{class}: decode panicked: {panic}; {}",
                hex_head(payload)
            ));
            return;
        }
    };
    let failure = match outcome {
        Ok(m) => {
            report.accepted += 1;
            match guarded(|| accepted_invariants(&m, payload.len())) {
                Err(panic) => {
                    report.panics += 1;
                    report.note(format!("{class}: re-encode/decode panicked: {panic}"));
                    None
                }
                Ok(Err(why)) => Some(why),
                Ok(Ok(())) => match expect {
                    Expect::Reject(reasons) => Some(format!("accepted, expected {reasons:?}")),
                    Expect::Any => None,
                },
            }
        }
        Err(rejection) => {
            let reason = rejection.reason();
            *report.rejected.entry(reason).or_default() += 1;
            if !REASONS.contains(&reason) {
                Some(format!("unknown rejection reason {reason}"))
            } else if (payload.len() > MAX_MESSAGE_BYTES) != (reason == "oversized") {
                Some(format!("{} bytes refused as {reason}", payload.len()))
            } else {
                match expect {
                    Expect::Reject(reasons) if !reasons.contains(&reason) => Some(format!(
                        "refused as {reason} ({rejection}), expected {reasons:?}"
                    )),
                    _ => None,
                }
            }
        }
    };
    if let Some(why) = failure {
        report.failures += 1;
        report.note(format!("{class}: {why}; {}", hex_head(payload)));
    }
}

/// Runs `cases` cases against `decode::<T>`, from `seed`.
pub fn fuzz<T: Subject>(seed: u64, cases: u64) -> Report {
    let mut rng = Rng::new(seed ^ fxhash(T::KIND));
    let mut report = Report {
        kind: T::KIND,
        ..Report::default()
    };
    // Reused for payloads at and over the limit: noise (1 MiB of it, tiled:
    // drawing 64 MiB a byte at a time takes seconds per type), with a valid
    // encoding written at its head when needed.
    let mut big = rng.bytes(1 << 20).repeat((MAX_MESSAGE_BYTES >> 20) + 1);
    let mut other = encode(&T::generate(&mut rng));
    while report.cases < cases {
        let class = rng.below(100);
        if class < 20 {
            report.classes[0] += 1;
            let payload = arbitrary(&mut rng);
            check::<T>(&mut report, "arbitrary", &payload, Expect::Any);
            continue;
        }
        let mut message = T::generate(&mut rng);
        if class < 40 {
            // (b) A valid encoding must decode to exactly the input.
            report.classes[1] += 1;
            let payload = encode(&message);
            report.cases += 1;
            match guarded(|| decode::<T>(&payload)) {
                Err(panic) => {
                    report.panics += 1;
                    report.note(format!("valid: decode panicked: {panic}"));
                }
                Ok(Err(r)) => {
                    *report.rejected.entry(r.reason()).or_default() += 1;
                    report.failures += 1;
                    report.note(format!("valid: refused ({r}): {message:?}"));
                }
                Ok(Ok(back)) => {
                    report.accepted += 1;
                    if back != message {
                        report.failures += 1;
                        report.note(format!("valid: round trip changed {message:?}"));
                    } else if let Ok(Err(why)) | Err(why) =
                        guarded(|| accepted_invariants(&back, payload.len()))
                    {
                        report.failures += 1;
                        report.note(format!("valid: {why}"));
                    }
                }
            }
            other = payload;
            continue;
        }
        if class < 95 {
            report.classes[2] += 1;
            if class < 70 {
                // (c) Value-level: the encoder writes what we broke.
                let (what, expect) = match rng.below(10) {
                    0 | 1 => {
                        let s = loop {
                            let s = rng.u64() as u16 >> rng.below(16);
                            if s != SCHEMA_VERSION {
                                break s;
                            }
                        };
                        message.set_schema(s);
                        ("schema", Expect::Reject(&["schema_version"]))
                    }
                    2..=4 if message.corrupt(&mut rng) => {
                        ("rule", Expect::Reject(&["shape", "non_finite", "invalid"]))
                    }
                    _ => {
                        let mut tensors = message.tensors_mut();
                        if tensors.is_empty() {
                            drop(tensors);
                            let s = rng.u64() as u16;
                            message.set_schema(s);
                            let expect = if s == SCHEMA_VERSION {
                                Expect::Any
                            } else {
                                Expect::Reject(&["schema_version"])
                            };
                            ("schema", expect)
                        } else {
                            let i = rng.below(tensors.len());
                            ("tensor", mutate_tensor(&mut rng, tensors[i]))
                        }
                    }
                };
                let payload = encode(&message);
                check::<T>(&mut report, what, &payload, expect);
            } else {
                // (c) Byte-level mutations of a valid encoding.
                let mut payload = encode(&message);
                mutate_bytes(&mut rng, &mut payload, &other);
                check::<T>(&mut report, "bytes", &payload, Expect::Any);
            }
            continue;
        }
        // (d) Over the limit (and exactly at it).
        report.classes[3] += 1;
        let head = encode(&message);
        big[..head.len()].copy_from_slice(&head);
        let len = match rng.below(4) {
            0 => MAX_MESSAGE_BYTES,
            1 => MAX_MESSAGE_BYTES + 1,
            _ => rng.range(MAX_MESSAGE_BYTES + 1, big.len()),
        };
        let expect = if len > MAX_MESSAGE_BYTES {
            Expect::Reject(&["oversized"])
        } else {
            Expect::Any
        };
        check::<T>(&mut report, "oversized", &big[..len], expect);
        let noise = rng.bytes(head.len());
        big[..head.len()].copy_from_slice(&noise);
    }
    report
}

fn fxhash(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
    })
}

/// One fuzz run per message type.
pub type Runner = fn(u64, u64) -> Report;

/// Every wire message type of `messages.rs`, by `KIND`.
pub const SUBJECTS: &[(&str, Runner)] = &[
    ("ActRequest", fuzz::<ActRequest>),
    ("ActReply", fuzz::<ActReply>),
    ("RolloutFragment", fuzz::<RolloutFragment>),
    ("InsertAck", fuzz::<InsertAck>),
    ("SampleRequest", fuzz::<SampleRequest>),
    ("SampleReply", fuzz::<SampleReply>),
    ("WeightsUpdate", fuzz::<WeightsUpdate>),
    ("WeightsAnnouncement", fuzz::<WeightsAnnouncement>),
    ("WeightsRequest", fuzz::<WeightsRequest>),
    ("EpisodeReport", fuzz::<EpisodeReport>),
    ("MetricsReport", fuzz::<MetricsReport>),
    ("EvalReport", fuzz::<EvalReport>),
    ("EvalControl", fuzz::<EvalControl>),
    ("EvalStarted", fuzz::<EvalStarted>),
    ("RunStatusUpdate", fuzz::<RunStatusUpdate>),
    ("AlertEvent", fuzz::<AlertEvent>),
    ("ScaleRequest", fuzz::<ScaleRequest>),
    ("ScaleReply", fuzz::<ScaleReply>),
    ("LogBatch", fuzz::<LogBatch>),
    ("GenerateRequest", fuzz::<GenerateRequest>),
    ("GenerateReply", fuzz::<GenerateReply>),
    ("AdapterUpdate", fuzz::<AdapterUpdate>),
    ("GameRecord", fuzz::<GameRecord>),
    ("EvalGame", fuzz::<EvalGame>),
    ("GameSampleRequest", fuzz::<GameSampleRequest>),
    ("GameSampleReply", fuzz::<GameSampleReply>),
    ("AdapterRequest", fuzz::<AdapterRequest>),
];

/// The `KIND`s declared with `wire_message!` in `messages.rs` and its
/// modules (`src/messages/*.rs`) and with `const KIND` in `llm.rs`.
pub fn declared_kinds() -> Vec<String> {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src/messages");
    let mut sources = vec![include_str!("../../src/messages.rs").to_string()];
    let mut modules: Vec<_> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|entry| entry.expect("a readable entry").path())
        .filter(|path| path.extension().is_some_and(|ext| ext == "rs"))
        .collect();
    modules.sort();
    for path in modules {
        let text =
            std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        sources.push(text);
    }
    let messages = sources
        .iter()
        .flat_map(|text| text.lines())
        .filter_map(|l| l.trim().strip_prefix("wire_message!("));
    let llm = include_str!("../../src/llm.rs")
        .lines()
        .filter_map(|l| l.trim().strip_prefix("const KIND: &'static str ="));
    messages
        .chain(llm)
        .filter_map(|rest| rest.split('"').nth(1))
        .filter(|kind| !kind.is_empty())
        .map(str::to_string)
        .collect()
}

/// The table: one row per type, then the totals.
pub fn table(reports: &[Report]) -> String {
    let mut out = format!(
        "{:<16} {:>8} {:>8} {:>9} {:>7} {:>8} {:>7} {:>7} {:>7} {:>7} {:>6} {:>9}\n",
        "message",
        "cases",
        "accepted",
        "oversized",
        "decode",
        "schema_v",
        "shape",
        "non_fin",
        "invalid",
        "rejected",
        "panics",
        "invariant"
    );
    let mut total = Report {
        kind: "total",
        ..Report::default()
    };
    for r in reports {
        total.cases += r.cases;
        total.accepted += r.accepted;
        total.panics += r.panics;
        total.failures += r.failures;
        for (k, v) in &r.rejected {
            *total.rejected.entry(k).or_default() += v;
        }
    }
    for r in reports.iter().chain([&total]) {
        let n = |reason: &str| r.rejected.get(reason).copied().unwrap_or(0);
        out += &format!(
            "{:<16} {:>8} {:>8} {:>9} {:>7} {:>8} {:>7} {:>7} {:>7} {:>7} {:>6} {:>9}\n",
            r.kind,
            r.cases,
            r.accepted,
            n("oversized"),
            n("decode"),
            n("schema_version"),
            n("shape"),
            n("non_finite"),
            n("invalid"),
            r.rejected_total(),
            r.panics,
            r.failures
        );
    }
    out
}

/// One JSON line with every count.
pub fn json(reports: &[Report], seed: u64, cases: u64, seconds: f64) -> String {
    let rows: Vec<String> = reports
        .iter()
        .map(|r| {
            let rejected: Vec<String> = REASONS
                .iter()
                .map(|k| format!("\"{k}\":{}", r.rejected.get(k).copied().unwrap_or(0)))
                .collect();
            format!(
                "{{\"message\":\"{}\",\"cases\":{},\"accepted\":{},\"rejected\":{{{}}},\"panics\":{},\"invariant_failures\":{}}}",
                r.kind,
                r.cases,
                r.accepted,
                rejected.join(","),
                r.panics,
                r.failures
            )
        })
        .collect();
    let sum = |f: fn(&Report) -> u64| reports.iter().map(f).sum::<u64>();
    format!(
        "{{\"bench\":\"fuzz\",\"seed\":{seed},\"cases_per_type\":{cases},\"types\":{},\"total_cases\":{},\"accepted\":{},\"panics\":{},\"invariant_failures\":{},\"seconds\":{seconds:.2},\"messages\":[{}]}}",
        reports.len(),
        sum(|r| r.cases),
        sum(|r| r.accepted),
        sum(|r| r.panics),
        sum(|r| r.failures),
        rows.join(",")
    )
}
