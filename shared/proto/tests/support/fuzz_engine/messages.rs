//! Per message type: random well-formed values and the value-level
//! corruptions each type must refuse ([`Subject`]).

use super::*;

pub const LOWER_DIGIT_DASH: &[u8] = b"abcdefghijklmnopqrstuvwxyz0123456789-";
pub const NAME: &[u8] = b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_";
pub const SERVICE: &[u8] = b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-";

pub fn f32_tensor(rng: &mut Rng, shape: &[usize]) -> Tensor {
    let n: usize = shape.iter().product();
    let values: Vec<f32> = (0..n).map(|_| rng.f32()).collect();
    Tensor::from_f32(shape, &values)
}

pub fn actions_tensor(rng: &mut Rng, lead: &[usize]) -> Tensor {
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

pub fn fragment(rng: &mut Rng) -> RolloutFragment {
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
    let mut f = RolloutFragment {
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
        masks: None,
        frames: None,
        initial_state: None,
    };
    if rng.below(3) == 0 {
        // Image observations stored once: planes and indices into them.
        let (count, plane, planes) = (rng.range(1, 6), rng.range(1, 5), rng.range(1, 4));
        let pixels = rng.bytes(count * plane);
        f.frames = Some(Tensor::from_u8(&[count, plane], &pixels));
        let mut indices = |rows: usize| {
            let values: Vec<u32> = (0..rows * planes)
                .map(|_| rng.below(count) as u32)
                .collect();
            values
        };
        let obs = indices(t * n);
        f.obs = Tensor::from_u32(&[t, n, planes], &obs);
        let next = indices(n);
        f.next_obs = Tensor::from_u32(&[n, planes], &next);
        let finals = indices(k);
        f.final_obs = Tensor::from_u32(&[k, planes], &finals);
    }
    f
}

/// Breaks one rule of a fragment's validation; the result must be refused.
pub fn corrupt_fragment(f: &mut RolloutFragment, rng: &mut Rng) {
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
        _ => match &f.frames {
            // A frame index past the frames.
            Some(frames) => {
                let mut obs = f.obs.to_u32().unwrap();
                let i = rng.below(obs.len());
                obs[i] = frames.shape[0] + rng.below(3) as u32;
                f.obs = Tensor::from_u32(&f.obs.shape_usize(), &obs);
            }
            None => {
                let d = f.obs.shape[2] as usize;
                f.next_obs = f32_tensor(rng, &[f.num_envs as usize + 1, d]);
            }
        },
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
            state: None,
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

/// A weights blob: inline bytes, or a direct and/or object store location.
fn blob(rng: &mut Rng) -> WeightsBlob {
    let len = rng.range(1, 256);
    let bytes = rng.bytes(len);
    let mut blob = WeightsBlob::inline(bytes);
    if rng.bool() {
        blob.inline = None;
        if rng.bool() {
            blob.direct = Some(DirectLocation {
                addr: {
                    let (host, port) = (rng.range(1, 254), rng.range(1, 65535));
                    format!("10.0.0.{host}:{port}")
                },
                key: rng.ident(NAME, 24),
            });
        }
        if blob.direct.is_none() || rng.bool() {
            blob.store = Some(StoreLocation {
                bucket: rng.ident(SERVICE, 16),
                key: rng.ident(NAME, 24),
            });
        }
    }
    blob
}

/// A blob a receiver must refuse.
fn corrupt_blob(blob: &mut WeightsBlob, rng: &mut Rng) {
    match rng.below(4) {
        0 => blob.sha256.truncate(rng.below(32)),
        1 => blob.size = 0,
        2 => {
            blob.inline = None;
            blob.direct = None;
            blob.store = None;
        }
        _ => {
            blob.inline = Some(rng.bytes(blob.size as usize + 1));
        }
    }
}

impl Subject for WeightsUpdate {
    fn generate(rng: &mut Rng) -> Self {
        WeightsUpdate {
            schema: SCHEMA_VERSION,
            version: rng.u64_any(),
            learner_env_steps: rng.u64_any(),
            weights: blob(rng),
            normalizer: None,
            published_unix_ms: rng.u64_any(),
        }
    }
    schema_setter!();
    fn corrupt(&mut self, rng: &mut Rng) -> bool {
        corrupt_blob(&mut self.weights, rng);
        true
    }
}

impl Subject for WeightsAnnouncement {
    fn generate(rng: &mut Rng) -> Self {
        WeightsAnnouncement {
            schema: SCHEMA_VERSION,
            version: rng.u64_any(),
            learner_env_steps: rng.u64_any(),
        }
    }
    schema_setter!();
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
                    ..Default::default()
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
                ..Default::default()
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

pub fn matchup(rng: &mut Rng) -> Matchup {
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

pub fn u32_tensor(rng: &mut Rng, n: usize) -> Tensor {
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
pub fn logprob_tensor(rng: &mut Rng, n: usize) -> Tensor {
    let values: Vec<f32> = (0..n).map(|_| -rng.f32().abs()).collect();
    Tensor::from_f32(&[n], &values)
}

pub fn seat_policy(rng: &mut Rng) -> SeatPolicy {
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
                    observation: rng.text(40),
                    completion: if model { rng.text(40) } else { String::new() },
                    no_answer: model && rng.chance(0.2),
                    truncated: model && rng.chance(0.2),
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
                    observation: String::new(),
                    completion: String::new(),
                    no_answer: false,
                    truncated: false,
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

pub fn adapter_ref(rng: &mut Rng) -> AdapterRef {
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
        if !request.allowed.is_empty() && rng.bool() {
            request.answer_frame = Some(AnswerFrame {
                opener: rng.pick(&["\\boxed{", ""]).to_string(),
                closer: rng.pick(&["}", ""]).to_string(),
            });
        }
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
        match rng.below(9) {
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
            7 => {
                self.allowed.clear();
                self.answer_frame = Some(AnswerFrame {
                    opener: "\\boxed{".into(),
                    closer: "}".into(),
                });
            }
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
            answer_start: rng.bool().then(|| rng.range(0, c + 1) as u32),
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

impl Subject for EvalGame {
    fn generate(rng: &mut Rng) -> Self {
        EvalGame {
            schema: SCHEMA_VERSION,
            evaluator: rng.ident(LOWER_DIGIT_DASH, 12),
            instance: rng.text(16),
            policy_version: rng.u64_any(),
            opponent: rng.ident(SERVICE, 16),
            confirmation: rng.bool(),
            game: GameRecord::generate(rng),
        }
    }
    schema_setter!();
    fn tensors(&self) -> Vec<&Tensor> {
        self.game.tensors()
    }
    fn tensors_mut(&mut self) -> Vec<&mut Tensor> {
        self.game.tensors_mut()
    }
    fn corrupt(&mut self, rng: &mut Rng) -> bool {
        match rng.below(4) {
            0 => self.evaluator.clear(),
            1 => self.opponent.clear(),
            _ => return self.game.corrupt(rng),
        }
        true
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
        AdapterUpdate {
            schema: SCHEMA_VERSION,
            name: rng.ident(NAME, 16),
            version: rng.u64_any(),
            learner_env_steps: rng.u64_any(),
            config_json: format!("{{\"r\": {}}}", rng.range(1, 64)),
            weights: blob(rng),
            published_unix_ms: rng.u64_any(),
        }
    }
    schema_setter!();
    fn corrupt(&mut self, rng: &mut Rng) -> bool {
        match rng.below(3) {
            0 => self.name.clear(),
            1 => self.config_json.clear(),
            _ => corrupt_blob(&mut self.weights, rng),
        }
        true
    }
}
