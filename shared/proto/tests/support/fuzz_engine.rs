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

// ---------------------------------------------------------------- generator

/// SplitMix64: small, fast, and the same sequence everywhere for a seed.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }

    pub fn u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (`n > 0`).
    pub fn below(&mut self, n: usize) -> usize {
        (self.u64() % n as u64) as usize
    }

    /// Uniform in `lo..=hi`.
    pub fn range(&mut self, lo: usize, hi: usize) -> usize {
        lo + self.below(hi - lo + 1)
    }

    pub fn chance(&mut self, p: f64) -> bool {
        (self.u64() >> 11) as f64 / (1u64 << 53) as f64 <= p
    }

    pub fn pick<T: Copy>(&mut self, items: &[T]) -> T {
        items[self.below(items.len())]
    }

    pub fn bool(&mut self) -> bool {
        self.u64() & 1 == 1
    }

    /// A finite f32, now and then an edge value.
    pub fn f32(&mut self) -> f32 {
        if self.chance(0.05) {
            return self.pick(&[
                0.0,
                -0.0,
                f32::MAX,
                f32::MIN,
                f32::MIN_POSITIVE,
                1e-45,
                -1e-45,
                1.0,
                -1.0,
            ]);
        }
        ((self.u64() >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 20.0
    }

    /// A finite f64, now and then an edge value.
    pub fn f64(&mut self) -> f64 {
        if self.chance(0.05) {
            return self.pick(&[
                0.0,
                -0.0,
                f64::MAX,
                f64::MIN,
                f64::MIN_POSITIVE,
                5e-324,
                500.0,
            ]);
        }
        ((self.u64() >> 11) as f64 / (1u64 << 53) as f64 - 0.5) * 1000.0
    }

    pub fn non_finite_f32(&mut self) -> f32 {
        self.pick(&[f32::NAN, -f32::NAN, f32::INFINITY, f32::NEG_INFINITY])
    }

    pub fn u64_any(&mut self) -> u64 {
        match self.below(4) {
            0 => self.below(10) as u64,
            1 => self.pick(&[0, 1, u32::MAX as u64, u64::MAX, u64::MAX - 1]),
            _ => self.u64() >> self.below(64),
        }
    }

    pub fn bytes(&mut self, len: usize) -> Vec<u8> {
        (0..len).map(|_| self.u64() as u8).collect()
    }

    /// Any string: ASCII, controls, multi-byte characters.
    pub fn text(&mut self, max: usize) -> String {
        const CHARS: &[char] = &[
            'a', 'z', 'A', 'Q', '0', '9', '_', '-', '.', ' ', '\n', '\t', '\0', '"', '\\', '{',
            'é', 'ß', '€', '日', '🦀', '\u{7f}', '\u{feff}',
        ];
        let len = self.range(0, max);
        (0..len).map(|_| self.pick(CHARS)).collect()
    }

    /// `1..=max` characters from `alphabet`.
    pub fn ident(&mut self, alphabet: &[u8], max: usize) -> String {
        let len = self.range(1, max);
        (0..len).map(|_| self.pick(alphabet) as char).collect()
    }
}

const LOWER_DIGIT_DASH: &[u8] = b"abcdefghijklmnopqrstuvwxyz0123456789-";
const NAME: &[u8] = b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_";
const SERVICE: &[u8] = b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-";

fn f32_tensor(rng: &mut Rng, shape: &[usize]) -> Tensor {
    let n: usize = shape.iter().product();
    let values: Vec<f32> = (0..n).map(|_| rng.f32()).collect();
    Tensor::from_f32(shape, &values)
}

fn actions_tensor(rng: &mut Rng, lead: &[usize]) -> Tensor {
    if rng.bool() {
        let n: usize = lead.iter().product();
        let values: Vec<i64> = (0..n)
            .map(|_| {
                if rng.chance(0.1) {
                    rng.u64() as i64
                } else {
                    rng.below(6) as i64
                }
            })
            .collect();
        Tensor::from_i64(lead, &values)
    } else {
        let mut shape = lead.to_vec();
        shape.push(rng.range(0, 3));
        f32_tensor(rng, &shape)
    }
}

fn fragment(rng: &mut Rng) -> RolloutFragment {
    let (t, n, d) = (rng.range(1, 6), rng.range(1, 4), rng.range(0, 5));
    let flag = |rng: &mut Rng| -> u8 {
        match rng.below(10) {
            0..=6 => 0,
            7 | 8 => 1,
            _ => rng.range(2, 255) as u8,
        }
    };
    let terminated: Vec<u8> = (0..t * n).map(|_| flag(rng)).collect();
    let truncated: Vec<u8> = (0..t * n).map(|_| flag(rng)).collect();
    let k = terminated
        .iter()
        .zip(&truncated)
        .filter(|(&a, &b)| b != 0 && a == 0)
        .count();
    let u8_tensor = |data: Vec<u8>| Tensor {
        dtype: DType::U8,
        shape: vec![t as u32, n as u32],
        data,
    };
    RolloutFragment {
        schema: SCHEMA_VERSION,
        runner_id: rng.text(12),
        env_id: rng.ident(SERVICE, 16),
        policy_version: rng.u64_any(),
        num_steps: t as u32,
        num_envs: n as u32,
        obs: f32_tensor(rng, &[t, n, d]),
        actions: actions_tensor(rng, &[t, n]),
        logprobs: f32_tensor(rng, &[t, n]),
        values: f32_tensor(rng, &[t, n]),
        rewards: f32_tensor(rng, &[t, n]),
        terminated: u8_tensor(terminated),
        truncated: u8_tensor(truncated),
        next_obs: f32_tensor(rng, &[n, d]),
        final_obs: f32_tensor(rng, &[k, d]),
        norm_rewards: None,
        norm_delta: None,
    }
}

/// Breaks one rule of a fragment's validation; the result must be refused.
fn corrupt_fragment(f: &mut RolloutFragment, rng: &mut Rng) {
    match rng.below(6) {
        0 => f.num_steps += 1,
        1 => f.num_envs = 0,
        2 => f.env_id.clear(),
        3 => {
            // Change the number of steps to bootstrap, so final_obs is off by one.
            let i = rng.below(f.truncated.data.len());
            if f.truncated.data[i] != 0 && f.terminated.data[i] == 0 {
                f.truncated.data[i] = 0;
            } else {
                f.truncated.data[i] = 1;
                f.terminated.data[i] = 0;
            }
        }
        4 => f.actions.dtype = DType::U8,
        _ => {
            let d = f.obs.shape[2] as usize;
            f.next_obs = f32_tensor(rng, &[f.num_envs as usize + 1, d]);
        }
    }
}

/// A message type under test: how to make a well-formed one, and where its
/// tensors are.
pub trait Subject: WireMessage + Clone + PartialEq + Debug {
    fn generate(rng: &mut Rng) -> Self;
    fn set_schema(&mut self, schema: u16);
    fn tensors(&self) -> Vec<&Tensor> {
        Vec::new()
    }
    fn tensors_mut(&mut self) -> Vec<&mut Tensor> {
        Vec::new()
    }
    /// Breaks one type-specific rule so that `decode` must refuse the
    /// message with reason `shape`, `non_finite` or `invalid`; false when
    /// the type has no such rule.
    fn corrupt(&mut self, _rng: &mut Rng) -> bool {
        false
    }
}

macro_rules! schema_setter {
    () => {
        fn set_schema(&mut self, schema: u16) {
            self.schema = schema;
        }
    };
}

impl Subject for ActRequest {
    fn generate(rng: &mut Rng) -> Self {
        let n = if rng.chance(0.05) {
            rng.range(1, 256)
        } else {
            rng.range(1, 8)
        };
        let d = rng.range(0, 8);
        ActRequest::new(f32_tensor(rng, &[n, d]), rng.bool())
    }
    schema_setter!();
    fn tensors(&self) -> Vec<&Tensor> {
        vec![&self.obs]
    }
    fn tensors_mut(&mut self) -> Vec<&mut Tensor> {
        vec![&mut self.obs]
    }
    fn corrupt(&mut self, rng: &mut Rng) -> bool {
        let d = rng.range(0, 8);
        self.obs = f32_tensor(rng, &[0, d]);
        true
    }
}

impl Subject for ActReply {
    fn generate(rng: &mut Rng) -> Self {
        let n = rng.range(0, 8);
        ActReply {
            schema: SCHEMA_VERSION,
            policy_version: rng.u64_any(),
            actions: actions_tensor(rng, &[n]),
            logprobs: f32_tensor(rng, &[n]),
            values: f32_tensor(rng, &[n]),
        }
    }
    schema_setter!();
    fn tensors(&self) -> Vec<&Tensor> {
        vec![&self.actions, &self.logprobs, &self.values]
    }
    fn tensors_mut(&mut self) -> Vec<&mut Tensor> {
        vec![&mut self.actions, &mut self.logprobs, &mut self.values]
    }
    fn corrupt(&mut self, rng: &mut Rng) -> bool {
        let n = self.logprobs.shape[0] as usize;
        match rng.below(3) {
            0 => self.values = f32_tensor(rng, &[n + 1]),
            1 => self.actions = actions_tensor(rng, &[n + 1]),
            _ => self.actions.dtype = DType::U8,
        }
        true
    }
}

impl Subject for RolloutFragment {
    fn generate(rng: &mut Rng) -> Self {
        fragment(rng)
    }
    schema_setter!();
    fn tensors(&self) -> Vec<&Tensor> {
        vec![
            &self.obs,
            &self.actions,
            &self.logprobs,
            &self.values,
            &self.rewards,
            &self.terminated,
            &self.truncated,
            &self.next_obs,
            &self.final_obs,
        ]
    }
    fn tensors_mut(&mut self) -> Vec<&mut Tensor> {
        vec![
            &mut self.obs,
            &mut self.actions,
            &mut self.logprobs,
            &mut self.values,
            &mut self.rewards,
            &mut self.terminated,
            &mut self.truncated,
            &mut self.next_obs,
            &mut self.final_obs,
        ]
    }
    fn corrupt(&mut self, rng: &mut Rng) -> bool {
        corrupt_fragment(self, rng);
        true
    }
}

impl Subject for InsertAck {
    fn generate(rng: &mut Rng) -> Self {
        InsertAck {
            schema: SCHEMA_VERSION,
            accepted: rng.bool(),
            retry_after_ms: rng.u64() as u32 >> rng.below(32),
            buffered_steps: rng.u64_any(),
            reason: rng.pick(&["", "full", "stale"]).into(),
        }
    }
    schema_setter!();
}

impl Subject for SampleRequest {
    fn generate(rng: &mut Rng) -> Self {
        SampleRequest {
            schema: SCHEMA_VERSION,
            min_policy_version: rng.u64_any(),
            max_steps: rng.u64() as u32 >> rng.below(32),
        }
    }
    schema_setter!();
}

impl Subject for SampleReply {
    fn generate(rng: &mut Rng) -> Self {
        SampleReply {
            schema: SCHEMA_VERSION,
            fragments: (0..rng.range(0, 3)).map(|_| fragment(rng)).collect(),
            dropped_stale: rng.u64_any(),
        }
    }
    schema_setter!();
    fn tensors(&self) -> Vec<&Tensor> {
        self.fragments.iter().flat_map(|f| f.tensors()).collect()
    }
    fn tensors_mut(&mut self) -> Vec<&mut Tensor> {
        self.fragments
            .iter_mut()
            .flat_map(|f| f.tensors_mut())
            .collect()
    }
    fn corrupt(&mut self, rng: &mut Rng) -> bool {
        if self.fragments.is_empty() {
            self.fragments.push(fragment(rng));
        }
        let i = rng.below(self.fragments.len());
        corrupt_fragment(&mut self.fragments[i], rng);
        true
    }
}

impl Subject for WeightsUpdate {
    fn generate(rng: &mut Rng) -> Self {
        let tensors = (0..rng.range(0, 4))
            .map(|i| {
                let shape: Vec<usize> = (0..rng.range(0, 3)).map(|_| rng.range(0, 5)).collect();
                NamedTensor {
                    name: format!("layer{i}.{}", rng.ident(NAME, 8)),
                    tensor: f32_tensor(rng, &shape),
                }
            })
            .collect();
        WeightsUpdate {
            schema: SCHEMA_VERSION,
            version: rng.u64_any(),
            learner_env_steps: rng.u64_any(),
            tensors,
            normalizer: None,
            published_unix_ms: rng.u64_any(),
        }
    }
    schema_setter!();
    fn tensors(&self) -> Vec<&Tensor> {
        self.tensors.iter().map(|t| &t.tensor).collect()
    }
    fn tensors_mut(&mut self) -> Vec<&mut Tensor> {
        self.tensors.iter_mut().map(|t| &mut t.tensor).collect()
    }
    fn corrupt(&mut self, rng: &mut Rng) -> bool {
        // A weights tensor that is not f32.
        let values: Vec<i64> = (0..rng.range(0, 4)).map(|i| i as i64).collect();
        self.tensors.push(NamedTensor {
            name: "bad".into(),
            tensor: Tensor::from_i64(&[values.len()], &values),
        });
        true
    }
}

impl Subject for WeightsRequest {
    fn generate(_rng: &mut Rng) -> Self {
        WeightsRequest {
            schema: SCHEMA_VERSION,
        }
    }
    schema_setter!();
}

impl Subject for EpisodeReport {
    fn generate(rng: &mut Rng) -> Self {
        EpisodeReport {
            schema: SCHEMA_VERSION,
            runner_id: rng.text(12),
            env_id: rng.ident(SERVICE, 16),
            policy_version: rng.u64_any(),
            episodes: (0..rng.range(0, 8))
                .map(|_| EpisodeSummary {
                    episode_return: rng.f64(),
                    length: rng.u64() as u32 >> rng.below(32),
                    terminated: rng.bool(),
                })
                .collect(),
        }
    }
    schema_setter!();
    fn corrupt(&mut self, rng: &mut Rng) -> bool {
        if self.episodes.is_empty() {
            self.episodes.push(EpisodeSummary {
                episode_return: 1.0,
                length: 1,
                terminated: true,
            });
        }
        let i = rng.below(self.episodes.len());
        self.episodes[i].episode_return = rng.pick(&[f64::NAN, f64::INFINITY, f64::NEG_INFINITY]);
        true
    }
}

impl Subject for MetricsReport {
    fn generate(rng: &mut Rng) -> Self {
        MetricsReport {
            schema: SCHEMA_VERSION,
            service: rng.ident(SERVICE, 16),
            instance: rng.text(16),
            vec_steps: rng.bool().then(|| rng.u64_any()),
            values: (0..rng.range(0, 8))
                .map(|_| MetricValue {
                    name: rng.ident(NAME, 24),
                    kind: rng.pick(&[MetricKind::Gauge, MetricKind::Counter]),
                    value: rng.f64(),
                    labels: Default::default(),
                })
                .collect(),
        }
    }
    schema_setter!();
    fn corrupt(&mut self, rng: &mut Rng) -> bool {
        let bad = rng
            .pick(&["", "a.b", "a-b", "relay value", "é", "x\n"])
            .to_string();
        self.values.push(MetricValue {
            name: bad,
            kind: MetricKind::Gauge,
            value: 1.0,
            labels: Default::default(),
        });
        let last = self.values.len() - 1;
        let i = rng.below(self.values.len());
        self.values.swap(i, last);
        true
    }
}

impl Subject for EvalReport {
    fn generate(rng: &mut Rng) -> Self {
        EvalReport {
            schema: SCHEMA_VERSION,
            evaluator: rng.ident(LOWER_DIGIT_DASH, 12),
            instance: rng.text(16),
            env_id: rng.ident(SERVICE, 16),
            policy_version: rng.u64_any(),
            learner_env_steps: rng.u64_any(),
            returns: (0..rng.range(0, 20)).map(|_| rng.f64()).collect(),
            mean_return: rng.f64(),
            std_return: rng.f64(),
            threshold: rng.f64(),
            solved: rng.bool(),
            matchups: (0..rng.range(0, 4)).map(|_| matchup(rng)).collect(),
            confirmation: rng.bool().then(|| {
                let returns: Vec<f64> = (0..rng.range(1, 20)).map(|_| rng.f64()).collect();
                Confirmation {
                    episodes: returns.len() as u32,
                    seed: rng.u64_any(),
                    returns,
                    mean_return: rng.f64(),
                    std_return: rng.f64(),
                    passed: rng.bool(),
                }
            }),
        }
    }
    schema_setter!();
    fn corrupt(&mut self, rng: &mut Rng) -> bool {
        if let Some(c) = self.confirmation.as_mut() {
            if rng.bool() {
                c.episodes += 1 + rng.below(3) as u32;
                return true;
            }
        }
        let mut bad = matchup(rng);
        match rng.below(3) {
            0 => bad.opponent.clear(),
            1 => bad.games += 1 + rng.below(3) as u32,
            _ => bad.invalid_moves = bad.moves + 1 + rng.below(5) as u32,
        }
        let at = rng.range(0, self.matchups.len());
        self.matchups.insert(at, bad);
        true
    }
}

fn matchup(rng: &mut Rng) -> Matchup {
    let (wins, draws, losses) = (
        rng.below(20) as u32,
        rng.below(20) as u32,
        rng.below(20) as u32,
    );
    let moves = rng.below(200) as u32;
    Matchup {
        opponent: rng.ident(LOWER_DIGIT_DASH, 16),
        seat: rng.below(2) as u8,
        game: String::new(),
        games: wins + draws + losses,
        wins,
        draws,
        losses,
        abandoned: rng.below(5) as u32,
        moves,
        invalid_moves: rng.range(0, moves as usize) as u32,
    }
}

fn u32_tensor(rng: &mut Rng, n: usize) -> Tensor {
    let values: Vec<u32> = (0..n)
        .map(|_| {
            if rng.chance(0.1) {
                rng.u64() as u32
            } else {
                rng.below(50_000) as u32
            }
        })
        .collect();
    Tensor::from_u32(&[n], &values)
}

/// Log-probs: finite and <= 0 (a sampled token always has mass).
fn logprob_tensor(rng: &mut Rng, n: usize) -> Tensor {
    let values: Vec<f32> = (0..n).map(|_| -rng.f32().abs()).collect();
    Tensor::from_f32(&[n], &values)
}

fn seat_policy(rng: &mut Rng) -> SeatPolicy {
    match rng.below(3) {
        0 => SeatPolicy::Model(None),
        1 => SeatPolicy::Model(Some(AdapterRef {
            name: rng.ident(NAME, 12),
            version: rng.bool().then(|| rng.u64_any()),
        })),
        _ => SeatPolicy::Bot(rng.ident(LOWER_DIGIT_DASH, 16)),
    }
}

impl Subject for GameRecord {
    fn generate(rng: &mut Rng) -> Self {
        let players = rng.range(1, 3);
        let turns: Vec<TextTurn> = (0..rng.range(0, 8))
            .map(|_| {
                let model = rng.bool();
                let (p, c) = if model {
                    (rng.range(1, 64), rng.range(0, 8))
                } else {
                    (0, 0)
                };
                TextTurn {
                    player: rng.below(players) as u8,
                    prompt_tokens: u32_tensor(rng, p),
                    completion_tokens: u32_tensor(rng, c),
                    logprobs: logprob_tensor(rng, c),
                    action: rng.text(12),
                    invalid: rng.chance(0.2),
                    adapter: (model && rng.bool()).then(|| AdapterRef {
                        name: rng.ident(NAME, 12),
                        version: rng.bool().then(|| rng.u64_any()),
                    }),
                }
            })
            .collect();
        let (turns_len, turns_empty) = (turns.len(), turns.is_empty());
        GameRecord {
            schema: SCHEMA_VERSION,
            runner_id: rng.text(12),
            env_id: rng.ident(SERVICE, 16),
            seed: rng.u64_any(),
            seats: (0..players).map(|_| seat_policy(rng)).collect(),
            learner_seat: rng.bool().then(|| rng.below(players) as u8),
            turns,
            rewards: (0..players).map(|_| rng.f64()).collect(),
            reasons: (0..players).map(|_| rng.text(20)).collect(),
            duration_ms: rng.u64_any(),
            finished_unix_ms: rng.u64_any(),
            branch: (!turns_empty && rng.bool()).then(|| {
                let size = 2 + rng.below(6) as u32;
                relay_proto::Branch {
                    group: rng.u64_any(),
                    turn: rng.below(turns_len) as u32,
                    index: rng.below(size as usize) as u32,
                    size,
                }
            }),
        }
    }
    schema_setter!();
    // Token ids only: log-probs may hold -inf, which the engine's generic
    // tensor mutations (and its all-finite invariant) treat as invalid;
    // `corrupt` breaks the log-prob rules instead.
    fn tensors(&self) -> Vec<&Tensor> {
        self.turns
            .iter()
            .flat_map(|t| [&t.prompt_tokens, &t.completion_tokens])
            .collect()
    }
    fn tensors_mut(&mut self) -> Vec<&mut Tensor> {
        self.turns
            .iter_mut()
            .flat_map(|t| [&mut t.prompt_tokens, &mut t.completion_tokens])
            .collect()
    }
    fn corrupt(&mut self, rng: &mut Rng) -> bool {
        let n = self.seats.len();
        let with_tokens = self
            .turns
            .iter()
            .position(|t| t.completion_tokens.numel() > 0);
        match rng.below(8) {
            0 => self.seats.clear(),
            1 => self.rewards.push(rng.f64()),
            2 => self.rewards[rng.below(n)] = f64::NAN,
            3 => self.learner_seat = Some(n as u8 + rng.below(3) as u8),
            4 => self.env_id.clear(),
            5 if with_tokens.is_some() => {
                let turn = &mut self.turns[with_tokens.unwrap()];
                let c = turn.completion_tokens.numel();
                let mut values = turn.logprobs.to_f32().unwrap();
                values[rng.below(c)] = rng.pick(&[f32::NAN, f32::INFINITY, 0.5]);
                turn.logprobs = Tensor::from_f32(&[c], &values);
            }
            6 if with_tokens.is_some() => {
                let turn = &mut self.turns[with_tokens.unwrap()];
                let c = turn.completion_tokens.numel();
                turn.logprobs = logprob_tensor(rng, c + 1);
            }
            _ => {
                let player = n as u8 + rng.below(3) as u8;
                self.turns.push(TextTurn {
                    player,
                    prompt_tokens: u32_tensor(rng, 1),
                    completion_tokens: u32_tensor(rng, 0),
                    logprobs: logprob_tensor(rng, 0),
                    action: String::new(),
                    invalid: false,
                    adapter: None,
                });
            }
        }
        true
    }
}

impl Subject for EvalControl {
    fn generate(rng: &mut Rng) -> Self {
        EvalControl {
            schema: SCHEMA_VERSION,
            evaluator: rng.ident(LOWER_DIGIT_DASH, 64),
            options: (0..rng.range(0, 4))
                .map(|_| (rng.ident(NAME, 12), rng.text(12)))
                .collect(),
        }
    }
    schema_setter!();
    fn corrupt(&mut self, rng: &mut Rng) -> bool {
        self.evaluator = if rng.bool() {
            String::new()
        } else {
            rng.ident(NAME, 32) + &"x".repeat(65)
        };
        true
    }
}

impl Subject for EvalStarted {
    fn generate(rng: &mut Rng) -> Self {
        EvalStarted {
            schema: SCHEMA_VERSION,
            evaluator: rng.ident(LOWER_DIGIT_DASH, 12),
            instance: rng.text(16),
            policy_version: rng.u64_any(),
        }
    }
    schema_setter!();
}

impl Subject for RunStatusUpdate {
    fn generate(rng: &mut Rng) -> Self {
        RunStatusUpdate {
            schema: SCHEMA_VERSION,
            status: rng.pick(&[
                RunStatus::Running,
                RunStatus::Solved,
                RunStatus::Stopped,
                RunStatus::Failed,
            ]),
            service: rng.ident(SERVICE, 16),
            policy_version: rng.u64_any(),
            detail: rng.text(40),
        }
    }
    schema_setter!();
}

impl Subject for AlertEvent {
    fn generate(rng: &mut Rng) -> Self {
        AlertEvent {
            schema: SCHEMA_VERSION,
            alert: rng.ident(NAME, 24),
            metric: rng.ident(NAME, 24),
            active: rng.bool(),
            value: rng.f64(),
            vec_steps: rng.bool().then(|| rng.u64_any()),
            message: rng.text(40),
        }
    }
    schema_setter!();
}

impl Subject for ScaleRequest {
    fn generate(rng: &mut Rng) -> Self {
        ScaleRequest {
            schema: SCHEMA_VERSION,
            service: rng.ident(LOWER_DIGIT_DASH, 64),
            copies: rng.range(0, MAX_COPIES as usize) as u32,
        }
    }
    schema_setter!();
    fn corrupt(&mut self, rng: &mut Rng) -> bool {
        match rng.below(3) {
            0 => self.copies = MAX_COPIES + 1 + (rng.u64() as u32 >> rng.range(1, 31)),
            1 => {
                self.service = rng
                    .pick(&["", "Env-runner", "env.runner", "env_runner"])
                    .into()
            }
            _ => self.service = "a".repeat(65),
        }
        true
    }
}

impl Subject for ScaleReply {
    fn generate(rng: &mut Rng) -> Self {
        let names = |rng: &mut Rng| (0..rng.range(0, 4)).map(|_| rng.text(16)).collect();
        ScaleReply {
            schema: SCHEMA_VERSION,
            service: rng.ident(LOWER_DIGIT_DASH, 16),
            copies: rng.u64() as u32 >> rng.below(32),
            instances: names(rng),
            started: names(rng),
            stopped: (0..rng.range(0, 3))
                .map(|_| StoppedCopy {
                    instance: rng.text(16),
                    exit_code: rng.bool().then(|| rng.u64() as i32),
                })
                .collect(),
            error: rng.bool().then(|| rng.text(30)),
        }
    }
    schema_setter!();
}

impl Subject for LogBatch {
    fn generate(rng: &mut Rng) -> Self {
        LogBatch {
            schema: SCHEMA_VERSION,
            service: rng.ident(SERVICE, 16),
            instance: rng.text(16),
            lines: (0..rng.range(0, 6)).map(|_| rng.text(60)).collect(),
        }
    }
    schema_setter!();
    fn corrupt(&mut self, rng: &mut Rng) -> bool {
        self.service = rng
            .pick(&["", "env runner", "env.runner", "é", "a/b"])
            .into();
        true
    }
}

fn adapter_ref(rng: &mut Rng) -> AdapterRef {
    AdapterRef {
        name: rng.ident(NAME, 16),
        version: rng.bool().then(|| rng.u64_any()),
    }
}

impl Subject for GenerateRequest {
    fn generate(rng: &mut Rng) -> Self {
        let prompt = match rng.below(3) {
            0 => Prompt::Text(rng.text(80)),
            1 => Prompt::Chat(
                (0..rng.range(1, 4))
                    .map(|_| ChatMessage {
                        role: rng.pick(&["system", "user", "assistant"]).into(),
                        content: rng.text(60),
                    })
                    .collect(),
            ),
            _ => {
                let n = rng.range(1, 64);
                Prompt::Tokens(u32_tensor(rng, n))
            }
        };
        let sampling = SamplingParams {
            temperature: rng.f32().abs(),
            top_p: rng.range(1, 100) as f32 / 100.0,
            top_k: rng.u64() as u32 >> rng.range(1, 31),
            max_tokens: rng.range(1, MAX_GENERATE_TOKENS as usize) as u32,
            stop: (0..rng.range(0, 3)).map(|_| rng.ident(NAME, 8)).collect(),
            seed: rng.bool().then(|| rng.u64_any()),
        };
        let mut request =
            GenerateRequest::new(rng.bool().then(|| adapter_ref(rng)), prompt, sampling);
        request.allowed = (0..rng.range(0, 5)).map(|_| rng.ident(NAME, 6)).collect();
        request
    }
    schema_setter!();
    fn tensors(&self) -> Vec<&Tensor> {
        match &self.prompt {
            Prompt::Tokens(t) => vec![t],
            _ => Vec::new(),
        }
    }
    fn tensors_mut(&mut self) -> Vec<&mut Tensor> {
        match &mut self.prompt {
            Prompt::Tokens(t) => vec![t],
            _ => Vec::new(),
        }
    }
    fn corrupt(&mut self, rng: &mut Rng) -> bool {
        match rng.below(8) {
            0 => self.sampling.temperature = -1.0 - rng.f32().abs(),
            1 => self.sampling.top_p = rng.pick(&[0.0, 1.5, f32::NAN, -0.5]),
            2 => self.sampling.max_tokens = rng.pick(&[0, MAX_GENERATE_TOKENS + 1, u32::MAX]),
            3 => self.sampling.stop.push(String::new()),
            4 => self.allowed.push(String::new()),
            5 => {
                self.adapter = Some(AdapterRef {
                    name: String::new(),
                    version: None,
                })
            }
            6 => self.prompt = Prompt::Chat(Vec::new()),
            _ => self.prompt = Prompt::Tokens(Tensor::from_u32(&[0], &[])),
        }
        true
    }
}

impl Subject for GenerateReply {
    fn generate(rng: &mut Rng) -> Self {
        let p = rng.range(0, 64);
        let c = rng.range(0, 32);
        GenerateReply {
            schema: SCHEMA_VERSION,
            adapter: rng.bool().then(|| adapter_ref(rng)),
            prompt_tokens: u32_tensor(rng, p),
            completion_tokens: u32_tensor(rng, c),
            logprobs: logprob_tensor(rng, c),
            text: rng.text(40),
            finish: rng.pick(&[
                FinishReason::Eos,
                FinishReason::Stop,
                FinishReason::Length,
                FinishReason::Allowed,
            ]),
        }
    }
    schema_setter!();
    fn tensors(&self) -> Vec<&Tensor> {
        vec![&self.prompt_tokens, &self.completion_tokens, &self.logprobs]
    }
    fn tensors_mut(&mut self) -> Vec<&mut Tensor> {
        vec![
            &mut self.prompt_tokens,
            &mut self.completion_tokens,
            &mut self.logprobs,
        ]
    }
    fn corrupt(&mut self, rng: &mut Rng) -> bool {
        let c = self.completion_tokens.numel();
        match rng.below(3) {
            0 => self.logprobs = logprob_tensor(rng, c + 1),
            1 => self.completion_tokens.dtype = DType::F32,
            _ => {
                let mut values = self.logprobs.to_f32().unwrap();
                values.push(0.5 + rng.f32().abs());
                self.logprobs = Tensor::from_f32(&[c + 1], &values);
                self.completion_tokens = u32_tensor(rng, c + 1);
            }
        }
        true
    }
}

impl Subject for GameSampleRequest {
    fn generate(rng: &mut Rng) -> Self {
        GameSampleRequest {
            schema: SCHEMA_VERSION,
            min_policy_version: rng.u64_any(),
            max_turns: (rng.u64() as u32 >> rng.below(32)).max(1),
        }
    }
    schema_setter!();
    fn corrupt(&mut self, _rng: &mut Rng) -> bool {
        self.max_turns = 0;
        true
    }
}

impl Subject for GameSampleReply {
    fn generate(rng: &mut Rng) -> Self {
        GameSampleReply {
            schema: SCHEMA_VERSION,
            games: (0..rng.range(0, 3))
                .map(|_| GameRecord::generate(rng))
                .collect(),
            dropped_stale: rng.u64_any(),
        }
    }
    schema_setter!();
    fn tensors(&self) -> Vec<&Tensor> {
        self.games.iter().flat_map(|g| g.tensors()).collect()
    }
    fn tensors_mut(&mut self) -> Vec<&mut Tensor> {
        self.games
            .iter_mut()
            .flat_map(|g| g.tensors_mut())
            .collect()
    }
    fn corrupt(&mut self, rng: &mut Rng) -> bool {
        if self.games.is_empty() {
            self.games.push(GameRecord::generate(rng));
        }
        let i = rng.below(self.games.len());
        self.games[i].corrupt(rng)
    }
}

impl Subject for AdapterRequest {
    fn generate(rng: &mut Rng) -> Self {
        AdapterRequest {
            schema: SCHEMA_VERSION,
            name: rng.ident(NAME, 16),
        }
    }
    schema_setter!();
    fn corrupt(&mut self, _rng: &mut Rng) -> bool {
        self.name.clear();
        true
    }
}

impl Subject for AdapterUpdate {
    fn generate(rng: &mut Rng) -> Self {
        let payload = if rng.bool() {
            let n = rng.range(1, 256);
            AdapterPayload::Inline {
                config_json: format!("{{\"r\": {}}}", rng.range(1, 64)),
                safetensors: rng.bytes(n),
            }
        } else {
            AdapterPayload::ObjectStore {
                bucket: rng.ident(SERVICE, 16),
                key: rng.ident(NAME, 24),
            }
        };
        AdapterUpdate {
            schema: SCHEMA_VERSION,
            name: rng.ident(NAME, 16),
            version: rng.u64_any(),
            learner_env_steps: rng.u64_any(),
            payload,
        }
    }
    schema_setter!();
    fn corrupt(&mut self, rng: &mut Rng) -> bool {
        match rng.below(3) {
            0 => self.name.clear(),
            1 => {
                self.payload = AdapterPayload::Inline {
                    config_json: String::new(),
                    safetensors: rng.bytes(4),
                }
            }
            _ => {
                self.payload = AdapterPayload::ObjectStore {
                    bucket: String::new(),
                    key: "k".into(),
                }
            }
        }
        true
    }
}

// ---------------------------------------------------------- MessagePack bits

/// Every field name of the protocol, for MessagePack-shaped garbage.
const KEYS: &[&str] = &[
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

fn mp_str(out: &mut Vec<u8>, s: &str) {
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
fn mp_value(rng: &mut Rng, out: &mut Vec<u8>, depth: usize) {
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
fn arbitrary(rng: &mut Rng) -> Vec<u8> {
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

const INTERESTING: &[u8] = &[
    0x00, 0x01, 0x7f, 0x80, 0x8f, 0x90, 0x9f, 0xa0, 0xbf, 0xc0, 0xc1, 0xc2, 0xc3, 0xc4, 0xc6, 0xca,
    0xcb, 0xcc, 0xcf, 0xd3, 0xd9, 0xdb, 0xdc, 0xdd, 0xde, 0xdf, 0xe0, 0xff,
];

/// One to three byte-level edits of `bytes`.
fn mutate_bytes(rng: &mut Rng, bytes: &mut Vec<u8>, other: &[u8]) {
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
fn mutate_tensor(rng: &mut Rng, t: &mut Tensor) -> Expect {
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
    // Reused for payloads at and over the limit: noise, with a valid
    // encoding written at its head when needed.
    let mut big = rng.bytes(MAX_MESSAGE_BYTES + 4096);
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
    ("GameSampleRequest", fuzz::<GameSampleRequest>),
    ("GameSampleReply", fuzz::<GameSampleReply>),
    ("AdapterRequest", fuzz::<AdapterRequest>),
];

/// The `KIND`s declared with `wire_message!` in `messages.rs` and with
/// `const KIND` in `llm.rs`.
pub fn declared_kinds() -> Vec<String> {
    let messages = include_str!("../../src/messages.rs")
        .lines()
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
