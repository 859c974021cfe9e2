//! replay-buffer: owns the run's rollout data in Redis.
//!
//! For PPO it is an on-policy FIFO (`relay:<run>:fifo`, a Redis list of
//! encoded [`RolloutFragment`]s) bounded by `replay.capacity_steps`: an
//! insert that would overflow it is refused with a retry delay, which is the
//! backpressure that slows env-runners down. Fragments acted by a policy
//! more than `replay.max_policy_lag` versions behind the learner are dropped
//! and counted, at insert and at sample time. Any number of copies serve the
//! same run: the insert is one Lua script, so capacity holds across copies.
//! The learner is the single consumer.
//!
//! Keys (all under `relay:<run>:`): `fifo` (list), `fifo:steps` (env steps
//! held), `min_version` (oldest policy version the learner accepts),
//! `stats` (hash of running totals).
//!
//! Text runs (`run.env_id` a text game) keep whole games instead
//! ([`games`]): consumed from `relay.<run>.games`, sampled on
//! `relay.<run>.replay.games.sample`; games of every game of the run
//! (`text.games`, multi-game runs) are stored, others refused.
//!
//! Off-policy runs (`run.algo: dqn` or `sac`) keep transitions instead
//! ([`offpolicy`]): fragments inserted on `replay.insert` become n-step
//! transitions in a FIFO-evicting table, sampled (uniformly or by
//! priority) on `relay.<run>.replay.transitions.sample`, with priorities
//! set on `relay.<run>.replay.priorities`.

pub mod games;
pub mod offpolicy;

use futures::StreamExt;
use prometheus::{IntCounter, IntCounterVec, IntGauge, Opts};
use rand::{Rng, SeedableRng};
use redis::AsyncCommands;
use relay_kit::{counter, gauge, Service, ServiceConfig, ServiceError, Shutdown};
use relay_proto::{
    GameRecord, GameSampleReply, GameSampleRequest, InsertAck, PriorityAck, PriorityUpdate,
    RolloutFragment, SampleReply, SampleRequest, TransitionSampleRequest, MAX_TRANSITION_SAMPLE,
    SCHEMA_VERSION,
};

use games::{GameInserted, GameStore};
use offpolicy::{Table, TableInserted};

/// Bytes of a `SampleReply` besides its fragments (schema, counts, the
/// array header), with room to spare.
const SAMPLE_REPLY_OVERHEAD: usize = 1024;
/// Redis key names of one run.
#[derive(Clone)]
pub struct Keys {
    pub fifo: String,
    pub steps: String,
    pub min_version: String,
    pub stats: String,
}

impl Keys {
    pub fn new(run_id: &str) -> Self {
        let base = format!("relay:{run_id}");
        Self {
            fifo: format!("{base}:fifo"),
            steps: format!("{base}:fifo:steps"),
            min_version: format!("{base}:min_version"),
            stats: format!("{base}:stats"),
        }
    }
}

/// Appends a fragment unless it is stale, would overflow the capacity, or the
/// rate limiter holds inserts back.
/// KEYS: fifo, steps, min_version, stats. ARGV: payload, steps, capacity,
/// version, samples-per-insert ratio ('' without limiter), max diff,
/// '1' to only check (the payload then empty), and the limiter's
/// min_size_to_sample: below it inserts are never held back (sampling
/// waits for them: holding them back too would stop the run).
/// Returns {status, held}: status 1 stored, 2 room (checked only), 0 full,
/// -1 stale, -2 rate.
const INSERT_SCRIPT: &str = r#"
local held = tonumber(redis.call('GET', KEYS[2]) or '0')
local min_version = tonumber(redis.call('GET', KEYS[3]) or '0')
if tonumber(ARGV[4]) < min_version then
  redis.call('HINCRBY', KEYS[4], 'dropped_stale_fragments', 1)
  return {-1, held}
end
if held + tonumber(ARGV[2]) > tonumber(ARGV[3]) then
  redis.call('HINCRBY', KEYS[4], 'refused_full', 1)
  return {0, held}
end
if ARGV[5] ~= '' then
  local ratio = tonumber(ARGV[5])
  local inserted = tonumber(redis.call('HGET', KEYS[4], 'inserted_steps') or '0')
  local taken = tonumber(redis.call('HGET', KEYS[4], 'taken_steps') or '0')
  if inserted >= tonumber(ARGV[8]) and (inserted + tonumber(ARGV[2])) * ratio - taken > tonumber(ARGV[6]) then
    redis.call('HINCRBY', KEYS[4], 'refused_rate', 1)
    return {-2, held}
  end
end
if ARGV[7] == '1' then
  return {2, held}
end
redis.call('RPUSH', KEYS[1], ARGV[1])
redis.call('HINCRBY', KEYS[4], 'inserted_steps', ARGV[2])
return {1, redis.call('INCRBY', KEYS[2], ARGV[2])}
"#;

/// Zeroes the held-steps counter when the FIFO is empty (KEYS: fifo,
/// steps). A sample pops and then decrements in separate commands: a Redis
/// killed between them (its append-only file keeping the pops but not the
/// decrement) leaves the counter above what the list holds, and inserts
/// would be refused as full for good. An empty list proves the count is 0.
const EMPTY_SCRIPT: &str = r#"
if redis.call('LLEN', KEYS[1]) == 0 then
  redis.call('SET', KEYS[2], 0)
end
return 0
"#;

struct Metrics {
    size_steps: IntGauge,
    inserted_steps: IntCounter,
    sampled_steps: IntCounter,
    dropped: IntCounterVec,
    refused_full: IntCounter,
    refused_rate: IntCounter,
    size_games: IntGauge,
    games_inserted: IntCounter,
    games_sampled: IntCounter,
    games_dropped: IntCounterVec,
    evicted_transitions: IntCounter,
    priority_updates: IntCounterVec,
}

impl Metrics {
    fn register(registry: &prometheus::Registry) -> Self {
        let size_steps = IntGauge::new(
            "relay_replay_size_steps",
            "Env steps held in the on-policy FIFO.",
        )
        .unwrap();
        let inserted_steps =
            IntCounter::new("relay_replay_inserted_steps_total", "Env steps stored.").unwrap();
        let sampled_steps = IntCounter::new(
            "relay_replay_sampled_steps_total",
            "Env steps handed to the learner.",
        )
        .unwrap();
        let dropped = IntCounterVec::new(
            Opts::new(
                "relay_replay_dropped_fragments_total",
                "Fragments dropped, by reason.",
            ),
            &["reason"],
        )
        .unwrap();
        let refused_full = IntCounter::new(
            "relay_replay_refused_full_total",
            "Inserts refused because the buffer was full (backpressure).",
        )
        .unwrap();
        relay_kit::metrics::register(registry, &size_steps);
        relay_kit::metrics::register(registry, &inserted_steps);
        relay_kit::metrics::register(registry, &sampled_steps);
        relay_kit::metrics::register(registry, &dropped);
        let refused_rate = IntCounter::new(
            "relay_replay_refused_rate_total",
            "Inserts held back by the sample-to-insert rate limiter.",
        )
        .unwrap();
        relay_kit::metrics::register(registry, &refused_full);
        relay_kit::metrics::register(registry, &refused_rate);
        let size_games = IntGauge::new(
            "relay_replay_size_games",
            "Text games held for the learner (text runs).",
        )
        .unwrap();
        let games_inserted = IntCounter::new(
            "relay_replay_games_inserted_total",
            "Text games stored (text runs).",
        )
        .unwrap();
        let games_sampled = IntCounter::new(
            "relay_replay_games_sampled_total",
            "Text games handed to the learner (text runs).",
        )
        .unwrap();
        let games_dropped = IntCounterVec::new(
            Opts::new(
                "relay_replay_games_dropped_total",
                "Text games dropped, by reason (stale: older than the learner's version floor; too_old: ended more than replay.max_age_s ago; evicted, no_learning_turns, too_big, oversized, undecodable).",
            ),
            &["reason"],
        )
        .unwrap();
        relay_kit::metrics::register(registry, &size_games);
        relay_kit::metrics::register(registry, &games_inserted);
        relay_kit::metrics::register(registry, &games_sampled);
        relay_kit::metrics::register(registry, &games_dropped);
        let evicted_transitions = IntCounter::new(
            "relay_replay_evicted_transitions_total",
            "Transitions evicted from the off-policy table (oldest first) to make room (off-policy runs).",
        )
        .unwrap();
        let priority_updates = IntCounterVec::new(
            Opts::new(
                "relay_replay_priority_updates_total",
                "Priorities received for the off-policy table, by outcome (updated, evicted: the transition left the table after it was sampled).",
            ),
            &["outcome"],
        )
        .unwrap();
        relay_kit::metrics::register(registry, &evicted_transitions);
        relay_kit::metrics::register(registry, &priority_updates);
        Self {
            evicted_transitions,
            priority_updates,
            size_games,
            games_inserted,
            games_sampled,
            games_dropped,
            size_steps,
            inserted_steps,
            sampled_steps,
            dropped,
            refused_full,
            refused_rate,
        }
    }
}

/// The replay buffer of one run, over a Redis connection.
#[derive(Clone)]
pub struct Fifo {
    redis: redis::aio::ConnectionManager,
    keys: Keys,
    capacity_steps: u64,
    max_policy_lag: u64,
    rate_limit: Option<RateLimit>,
    insert: redis::Script,
    empty: redis::Script,
}

/// Outcome of an insert.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Inserted {
    Stored {
        held: u64,
    },
    Full {
        held: u64,
    },
    Stale {
        held: u64,
    },
    /// The rate limiter holds inserts back until the learner samples.
    RateLimited {
        held: u64,
    },
}

/// Reverb-style `SampleToInsertRatio` over env steps, as the config
/// resolves it ([`relay_config::ExperimentConfig::rate_limit`]). The
/// learner samples whole fragments, so a sample may overshoot its
/// allowance by one fragment.
pub use relay_config::RateLimit;

/// What a sample took out of the FIFO.
pub struct Sampled {
    pub fragments: Vec<RolloutFragment>,
    pub dropped_stale: u64,
    pub undecodable: u64,
}

impl Fifo {
    pub fn new(
        redis: redis::aio::ConnectionManager,
        run_id: &str,
        capacity_steps: u64,
        max_policy_lag: u64,
        rate_limit: Option<RateLimit>,
    ) -> Self {
        Self {
            redis,
            keys: Keys::new(run_id),
            capacity_steps,
            max_policy_lag,
            rate_limit,
            insert: redis::Script::new(INSERT_SCRIPT),
            empty: redis::Script::new(EMPTY_SCRIPT),
        }
    }

    /// Stores `fragment` (encoded as `payload`) unless it is stale, the
    /// FIFO is full or the rate limiter holds it back. The checks run first
    /// without the payload: a refused insert (an env-runner retries until
    /// the learner makes room) must not copy megabytes of frames into Redis
    /// each time (a Breakout fragment's 2 MB took Redis about 10 ms).
    pub async fn insert(
        &self,
        fragment: &RolloutFragment,
        payload: &[u8],
    ) -> redis::RedisResult<Inserted> {
        match self.insert_script(fragment, &[], true).await? {
            (2, _) => {}
            refused => return Ok(Self::inserted(refused)),
        }
        Ok(Self::inserted(
            self.insert_script(fragment, payload, false).await?,
        ))
    }

    /// One call of [`INSERT_SCRIPT`]: `(status, held)`.
    async fn insert_script(
        &self,
        fragment: &RolloutFragment,
        payload: &[u8],
        check_only: bool,
    ) -> redis::RedisResult<(i64, u64)> {
        let mut redis = self.redis.clone();
        self.insert
            .key(&self.keys.fifo)
            .key(&self.keys.steps)
            .key(&self.keys.min_version)
            .key(&self.keys.stats)
            .arg(payload)
            .arg(fragment.env_steps())
            .arg(self.capacity_steps)
            .arg(fragment.policy_version)
            .arg(
                self.rate_limit
                    .map_or(String::new(), |r| r.samples_per_insert.to_string()),
            )
            .arg(
                self.rate_limit
                    .map_or(String::new(), |r| r.max_diff().to_string()),
            )
            .arg(if check_only { "1" } else { "0" })
            .arg(self.rate_limit.map_or(0, |r| r.min_size_to_sample))
            .invoke_async(&mut redis)
            .await
    }

    fn inserted((status, held): (i64, u64)) -> Inserted {
        match status {
            1 => Inserted::Stored { held },
            0 => Inserted::Full { held },
            -2 => Inserted::RateLimited { held },
            _ => Inserted::Stale { held },
        }
    }

    /// Pops fragments from the head until `max_steps` env steps are gathered,
    /// the FIFO is empty or one more would not fit in a reply message of
    /// `max_reply_bytes` (the NATS server's `max_payload`), dropping those
    /// older than `min_policy_version`.
    pub async fn sample(
        &self,
        min_policy_version: u64,
        max_steps: u64,
        max_reply_bytes: usize,
    ) -> redis::RedisResult<Sampled> {
        let mut redis = self.redis.clone();
        // Inserts refuse anything older than this from now on.
        let _: () = redis
            .set(&self.keys.min_version, min_policy_version)
            .await?;
        let mut out = Sampled {
            fragments: Vec::new(),
            dropped_stale: 0,
            undecodable: 0,
        };
        let mut max_steps = max_steps;
        if let Some(limit) = self.rate_limit {
            let (inserted, taken): (Option<u64>, Option<u64>) = redis::cmd("HMGET")
                .arg(&self.keys.stats)
                .arg("inserted_steps")
                .arg("taken_steps")
                .query_async(&mut redis)
                .await?;
            let (inserted, taken) = (inserted.unwrap_or(0), taken.unwrap_or(0));
            let allowance =
                inserted as f64 * limit.samples_per_insert - taken as f64 - limit.min_diff();
            if inserted < limit.min_size_to_sample || allowance < 1.0 {
                return Ok(out);
            }
            max_steps = max_steps.min(allowance as u64);
        }
        let mut gathered = 0u64;
        let mut popped_steps = 0u64;
        let mut reply_bytes = 0usize;
        let mut emptied = false;
        while gathered < max_steps {
            let item: Option<Vec<u8>> = redis.lpop(&self.keys.fifo, None).await?;
            let Some(item) = item else {
                emptied = true;
                break;
            };
            // The reply is one NATS message: a fragment that would outgrow it
            // goes back to the head for the next sample (wide observations
            // make few fragments fill a message).
            if !out.fragments.is_empty()
                && reply_bytes + item.len() + SAMPLE_REPLY_OVERHEAD > max_reply_bytes
            {
                let _: () = redis.lpush(&self.keys.fifo, item).await?;
                break;
            }
            reply_bytes += item.len();
            match relay_proto::decode::<RolloutFragment>(&item) {
                Ok(fragment) => {
                    popped_steps += fragment.env_steps();
                    if relay_proto::is_stale(fragment.policy_version, min_policy_version) {
                        out.dropped_stale += 1;
                    } else {
                        gathered += fragment.env_steps();
                        out.fragments.push(fragment);
                    }
                }
                // Only validated fragments are stored; this means the data
                // was written by another schema version. Drop and count.
                Err(_) => out.undecodable += 1,
            }
        }
        if popped_steps > 0 {
            let _: i64 = redis.decr(&self.keys.steps, popped_steps).await?;
            let _: i64 = redis
                .hincr(&self.keys.stats, "taken_steps", popped_steps)
                .await?;
        }
        if emptied {
            let _: i64 = self
                .empty
                .key(&self.keys.fifo)
                .key(&self.keys.steps)
                .invoke_async(&mut redis)
                .await?;
        }
        if out.dropped_stale > 0 {
            let _: i64 = redis
                .hincr(
                    &self.keys.stats,
                    "dropped_stale_fragments",
                    out.dropped_stale,
                )
                .await?;
        }
        if gathered > 0 {
            let _: i64 = redis
                .hincr(&self.keys.stats, "sampled_steps", gathered)
                .await?;
        }
        Ok(out)
    }

    /// Env steps currently held.
    pub async fn held_steps(&self) -> redis::RedisResult<u64> {
        let mut redis = self.redis.clone();
        let held: Option<u64> = redis.get(&self.keys.steps).await?;
        Ok(held.unwrap_or(0))
    }

    pub fn max_policy_lag(&self) -> u64 {
        self.max_policy_lag
    }
}

/// Runs the replay-buffer until shutdown.
pub async fn run(config: ServiceConfig, shutdown: Shutdown) -> Result<(), ServiceError> {
    let service = Service::start("replay-buffer", config, shutdown.clone()).await?;
    // From here on the service stops on the caller's signal or its own failure.
    let shutdown = service.shutdown.clone();
    let cfg = service.config.clone();
    let redis = relay_kit::connect_redis_with(&cfg.connections, &shutdown).await?;
    let rate_limit = cfg.rate_limit();
    let game_store = GameStore::new(
        redis.clone(),
        cfg.run_id()?,
        cfg.replay.capacity_steps,
        cfg.replay.max_age_s,
    );
    let table = cfg.off_policy_table().map(|t| {
        Table::new(
            redis.clone(),
            cfg.run_id().expect("checked above"),
            t,
            rate_limit,
        )
    });
    // What a fragment of this run looks like (the table checks inserts against it).
    let env_spec = match cfg.is_text_game() {
        true => None,
        false => cfg
            .env_spec()
            .inspect_err(|e| {
                tracing::warn!(error = %e, "no env spec: fragments are stored unchecked against it")
            })
            .ok(),
    };
    // Text runs: the games stored (`text.games`, else `run.env_id`).
    let run_games: Vec<String> = cfg
        .text
        .game_weights(&cfg.run.env_id)
        .into_iter()
        .map(|(game, _)| game)
        .collect();
    let text_run = cfg.is_text_game();
    let fifo = Fifo::new(
        redis,
        cfg.run_id()?,
        cfg.replay.capacity_steps,
        cfg.replay.max_policy_lag,
        rate_limit,
    );
    let metrics = Metrics::register(&service.registry);
    let micro = service.micro().await?;
    let mut inserts = micro
        .endpoint(service.subjects.replay_insert())
        .await
        .map_err(ServiceError::nats)?;
    let mut samples = micro
        .endpoint(service.subjects.replay_sample())
        .await
        .map_err(ServiceError::nats)?;
    // Text runs: games in (queue group: copies share them), batches of games out.
    let mut game_stream = if text_run {
        Some(
            service
                .nats
                .queue_subscribe(service.subjects.games(), "replay-buffer".into())
                .await
                .map_err(ServiceError::nats)?,
        )
    } else {
        None
    };
    let mut transition_samples = match &table {
        Some(_) => Some(
            micro
                .endpoint(service.subjects.replay_transitions_sample())
                .await
                .map_err(ServiceError::nats)?,
        ),
        None => None,
    };
    let mut priority_updates = match &table {
        Some(_) => Some(
            micro
                .endpoint(service.subjects.replay_priorities())
                .await
                .map_err(ServiceError::nats)?,
        ),
        None => None,
    };
    let mut uniforms =
        rand::rngs::StdRng::seed_from_u64(cfg.run.seed ^ u64::from(std::process::id()));
    let mut game_samples = if text_run {
        Some(
            micro
                .endpoint(service.subjects.replay_games_sample())
                .await
                .map_err(ServiceError::nats)?,
        )
    } else {
        None
    };
    service.health.set_ready(true);
    let retry_after_ms = cfg.replay.retry_after_ms;
    let (mut reported_games_in, mut reported_games_out) = (0u64, 0u64);
    let mut report = tokio::time::interval(std::time::Duration::from_secs(1));
    let (mut reported_in, mut reported_out) = (0u64, 0u64);
    loop {
        tokio::select! {
            _ = shutdown.wait() => break,
            Some(request) = inserts.next() => {
                let fragment: RolloutFragment = match service.intake.decode("replay.insert", &request.message.payload) {
                    Ok(f) => f,
                    Err(rejection) => {
                        let _ = request.respond(Err(async_nats::service::error::Error { status: rejection.to_string(), code: 400 })).await;
                        continue;
                    }
                };
                if let Some(table) = &table {
                    let ack = match insert_transitions(table, &fragment, &cfg.run.env_id, env_spec.as_ref()).await {
                        Ok(TableInserted::Stored { size, evicted }) => {
                            metrics.inserted_steps.inc_by(fragment.env_steps());
                            metrics.size_steps.set(size as i64);
                            metrics.evicted_transitions.inc_by(evicted);
                            InsertAck { schema: SCHEMA_VERSION, accepted: true, retry_after_ms: 0, buffered_steps: size, reason: String::new() }
                        }
                        Ok(TableInserted::RateLimited { size }) => {
                            metrics.refused_rate.inc();
                            InsertAck { schema: SCHEMA_VERSION, accepted: false, retry_after_ms, buffered_steps: size, reason: "rate".into() }
                        }
                        Err(offpolicy::TableError::BadInput { field, detail }) => {
                            let rejection = relay_proto::Rejection::Invalid { kind: "RolloutFragment", field, detail };
                            service.intake.reject("replay.insert", &rejection);
                            let _ = request.respond(Err(async_nats::service::error::Error { status: rejection.to_string(), code: 400 })).await;
                            continue;
                        }
                        Err(e) => {
                            tracing::warn!(error = %e, "off-policy insert failed");
                            let _ = request.respond(Err(async_nats::service::error::Error { status: e.to_string(), code: 503 })).await;
                            continue;
                        }
                    };
                    let _ = request.respond(Ok(relay_proto::encode(&ack).into())).await;
                    continue;
                }
                let ack = match fifo.insert(&fragment, &request.message.payload).await {
                    Ok(Inserted::Stored { held }) => {
                        metrics.inserted_steps.inc_by(fragment.env_steps());
                        metrics.size_steps.set(held as i64);
                        InsertAck { schema: SCHEMA_VERSION, accepted: true, retry_after_ms: 0, buffered_steps: held, reason: String::new() }
                    }
                    Ok(Inserted::Full { held }) => {
                        metrics.refused_full.inc();
                        metrics.size_steps.set(held as i64);
                        InsertAck { schema: SCHEMA_VERSION, accepted: false, retry_after_ms, buffered_steps: held, reason: "full".into() }
                    }
                    Ok(Inserted::RateLimited { held }) => {
                        metrics.refused_rate.inc();
                        InsertAck { schema: SCHEMA_VERSION, accepted: false, retry_after_ms, buffered_steps: held, reason: "rate".into() }
                    }
                    Ok(Inserted::Stale { held }) => {
                        metrics.dropped.with_label_values(&["stale"]).inc();
                        InsertAck { schema: SCHEMA_VERSION, accepted: false, retry_after_ms: 0, buffered_steps: held, reason: "stale".into() }
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "redis insert failed");
                        let _ = request.respond(Err(async_nats::service::error::Error { status: format!("redis: {e}"), code: 503 })).await;
                        continue;
                    }
                };
                let _ = request.respond(Ok(relay_proto::encode(&ack).into())).await;
            }
            Some(request) = samples.next() => {
                let ask: SampleRequest = match service.intake.decode("replay.sample", &request.message.payload) {
                    Ok(a) => a,
                    Err(rejection) => {
                        let _ = request.respond(Err(async_nats::service::error::Error { status: rejection.to_string(), code: 400 })).await;
                        continue;
                    }
                };
                if table.is_some() {
                    let detail = format!("this run's replay table is off-policy (run.algo {}): sample transitions on replay.transitions.sample", cfg.run.algo);
                    let _ = request.respond(Err(async_nats::service::error::Error { status: detail, code: 400 })).await;
                    continue;
                }
                match fifo.sample(ask.min_policy_version, ask.max_steps as u64, service.max_message_bytes()).await {
                    Ok(sampled) => {
                        let steps: u64 = sampled.fragments.iter().map(RolloutFragment::env_steps).sum();
                        metrics.sampled_steps.inc_by(steps);
                        metrics.dropped.with_label_values(&["stale"]).inc_by(sampled.dropped_stale);
                        metrics.dropped.with_label_values(&["undecodable"]).inc_by(sampled.undecodable);
                        let reply = SampleReply { schema: SCHEMA_VERSION, fragments: sampled.fragments, dropped_stale: sampled.dropped_stale };
                        let _ = request.respond(Ok(relay_proto::encode(&reply).into())).await;
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "redis sample failed");
                        let _ = request.respond(Err(async_nats::service::error::Error { status: format!("redis: {e}"), code: 503 })).await;
                    }
                }
            }
            Some(request) = next_of(&mut transition_samples) => {
                let Some(table) = &table else { continue };
                let ask: TransitionSampleRequest = match service.intake.decode("replay.transitions.sample", &request.message.payload) {
                    Ok(a) => a,
                    Err(rejection) => {
                        let _ = request.respond(Err(async_nats::service::error::Error { status: rejection.to_string(), code: 400 })).await;
                        continue;
                    }
                };
                if ask.batch_size > MAX_TRANSITION_SAMPLE {
                    let rejection = relay_proto::Rejection::Invalid {
                        kind: "TransitionSampleRequest",
                        field: "batch_size",
                        detail: format!("{} is above the limit of {MAX_TRANSITION_SAMPLE} transitions per sample", ask.batch_size),
                    };
                    service.intake.reject("replay.transitions.sample", &rejection);
                    let _ = request.respond(Err(async_nats::service::error::Error { status: rejection.to_string(), code: 400 })).await;
                    continue;
                }
                let draws: Vec<f64> = (0..ask.batch_size).map(|_| uniforms.random::<f64>()).collect();
                match table.sample(ask.batch_size as usize, ask.beta, &draws).await {
                    Ok(sampled) => {
                        metrics.sampled_steps.inc_by(sampled.batch.ids.len() as u64);
                        metrics.size_steps.set(sampled.batch.size as i64);
                        metrics.dropped.with_label_values(&["undecodable"]).inc_by(sampled.corrupt);
                        // Said, not dropped: the learner asks for fewer rows at a time.
                        let answer = relay_kit::reply_within(&sampled.batch, service.max_message_bytes());
                        let _ = request.respond(answer).await;
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "off-policy sample failed");
                        let _ = request.respond(Err(async_nats::service::error::Error { status: e.to_string(), code: 503 })).await;
                    }
                }
            }
            Some(request) = next_of(&mut priority_updates) => {
                let Some(table) = &table else { continue };
                let update: PriorityUpdate = match service.intake.decode("replay.priorities", &request.message.payload) {
                    Ok(u) => u,
                    Err(rejection) => {
                        let _ = request.respond(Err(async_nats::service::error::Error { status: rejection.to_string(), code: 400 })).await;
                        continue;
                    }
                };
                let priorities = update.priorities.to_f32().expect("validated on decode");
                match table.update_priorities(&update.ids, &priorities).await {
                    Ok((updated, evicted)) => {
                        metrics.priority_updates.with_label_values(&["updated"]).inc_by(updated);
                        metrics.priority_updates.with_label_values(&["evicted"]).inc_by(evicted);
                        let ack = PriorityAck { schema: SCHEMA_VERSION, updated: updated as u32, evicted: evicted as u32 };
                        let _ = request.respond(Ok(relay_proto::encode(&ack).into())).await;
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "priority update failed");
                        let _ = request.respond(Err(async_nats::service::error::Error { status: e.to_string(), code: 503 })).await;
                    }
                }
            }
            Some(message) = next_of(&mut game_stream) => {
                let Ok(game) = service.intake.decode::<GameRecord>("games", &message.payload) else {
                    continue;
                };
                if !run_games.contains(&game.env_id) {
                    service.intake.reject("games", &relay_proto::Rejection::Invalid {
                        kind: "GameRecord",
                        field: "env_id",
                        detail: format!("game of {} from {}, this run plays {}", game.env_id, game.runner_id, run_games.join(", ")),
                    });
                    continue;
                }
                match game_store.insert(&game, &message.payload).await {
                    Ok(GameInserted::Stored { held_turns, evicted }) => {
                        metrics.games_inserted.inc();
                        metrics.size_steps.set(held_turns as i64);
                        metrics.games_dropped.with_label_values(&["evicted"]).inc_by(evicted);
                    }
                    Ok(GameInserted::Stale) => metrics.games_dropped.with_label_values(&["stale"]).inc(),
                    Ok(GameInserted::TooBig) => metrics.games_dropped.with_label_values(&["too_big"]).inc(),
                    Ok(GameInserted::NoLearningTurns) => metrics.games_dropped.with_label_values(&["no_learning_turns"]).inc(),
                    Err(e) => tracing::warn!(error = %e, "redis game insert failed; game lost"),
                }
            }
            Some(request) = next_of(&mut game_samples) => {
                let ask: GameSampleRequest = match service.intake.decode("replay.games.sample", &request.message.payload) {
                    Ok(a) => a,
                    Err(rejection) => {
                        let _ = request.respond(Err(async_nats::service::error::Error { status: rejection.to_string(), code: 400 })).await;
                        continue;
                    }
                };
                match game_store.sample(ask.min_policy_version, ask.max_turns as u64, service.max_message_bytes()).await {
                    Ok(sampled) => {
                        metrics.games_sampled.inc_by(sampled.games.len() as u64);
                        let turns: u64 = sampled.games.iter().map(games::learning_turn_count).sum();
                        metrics.sampled_steps.inc_by(turns);
                        for (reason, n) in [("stale", sampled.dropped_stale), ("too_old", sampled.dropped_old), ("undecodable", sampled.undecodable), ("oversized", sampled.oversized)] {
                            metrics.games_dropped.with_label_values(&[reason]).inc_by(n);
                        }
                        // Stale by either bound, as the learner counts it.
                        let dropped_stale = sampled.dropped_stale + sampled.dropped_old;
                        let reply = GameSampleReply { schema: SCHEMA_VERSION, games: sampled.games, dropped_stale };
                        let _ = request.respond(Ok(relay_proto::encode(&reply).into())).await;
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "redis game sample failed");
                        let _ = request.respond(Err(async_nats::service::error::Error { status: format!("redis: {e}"), code: 503 })).await;
                    }
                }
            }
            _ = report.tick() => {
                if text_run {
                    if let (Ok(turns), Ok(games)) = (game_store.held_turns().await, game_store.held_games().await) {
                        metrics.size_steps.set(turns as i64);
                        metrics.size_games.set(games as i64);
                    }
                    let (inserted, sampled) = (metrics.games_inserted.get(), metrics.games_sampled.get());
                    service.report(None, vec![
                        gauge("replay_size_steps", metrics.size_steps.get() as f64),
                        gauge("replay_size_games", metrics.size_games.get() as f64),
                        counter("replay_games_inserted_total", (inserted - reported_games_in) as f64),
                        counter("replay_games_sampled_total", (sampled - reported_games_out) as f64),
                    ]).await;
                    (reported_games_in, reported_games_out) = (inserted, sampled);
                    continue;
                }
                if let Some(table) = &table {
                    if let Ok(size) = table.size().await {
                        metrics.size_steps.set(size as i64);
                    }
                } else if let Ok(held) = fifo.held_steps().await {
                    metrics.size_steps.set(held as i64);
                }
                let (inserted, sampled) = (metrics.inserted_steps.get(), metrics.sampled_steps.get());
                service.report(None, vec![
                    gauge("replay_size_steps", metrics.size_steps.get() as f64),
                    counter("replay_inserted_steps_total", (inserted - reported_in) as f64),
                    counter("replay_sampled_steps_total", (sampled - reported_out) as f64),
                ]).await;
                (reported_in, reported_out) = (inserted, sampled);
            }
        }
    }
    let _ = micro.stop().await;
    service.finish().await
}

/// Inserts a fragment into the off-policy table after checking that it
/// belongs to this run (env id, observation size, action kind).
async fn insert_transitions(
    table: &Table,
    fragment: &RolloutFragment,
    env_id: &str,
    spec: Option<&relay_envs::EnvSpec>,
) -> Result<TableInserted, offpolicy::TableError> {
    let bad =
        |field: &'static str, detail: String| offpolicy::TableError::BadInput { field, detail };
    if fragment.env_id != env_id {
        return Err(bad(
            "env_id",
            format!(
                "fragment from {} is for {}, this run trains {env_id}",
                fragment.runner_id, fragment.env_id
            ),
        ));
    }
    if let Some(spec) = spec {
        let d = spec.observation_space.dim();
        if fragment.obs_dim() != d {
            return Err(bad(
                "obs",
                format!(
                    "observations have {} features, {env_id} has {d}",
                    fragment.obs_dim()
                ),
            ));
        }
        let discrete = matches!(spec.action_space, relay_envs::ActionSpace::Discrete { .. });
        if discrete != (fragment.actions.dtype == relay_proto::DType::I64) {
            return Err(bad(
                "actions",
                format!(
                    "dtype {:?} does not match the action space of {env_id}",
                    fragment.actions.dtype
                ),
            ));
        }
    }
    table.insert(fragment).await
}

/// The next item of an optional stream; pending forever without one (so a
/// `select!` branch over it never fires).
async fn next_of<S: futures::Stream + Unpin>(stream: &mut Option<S>) -> Option<S::Item> {
    match stream {
        Some(s) => s.next().await,
        None => std::future::pending().await,
    }
}
