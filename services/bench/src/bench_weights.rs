//! `relay-bench bench-weights` (`just bench-weights`): how long a new
//! weights version takes from its publishing to being served, and how many
//! bytes per second that moves, for 1, 2 and 4 inference servers.
//!
//! Three payloads, each through the path its versions take in a run:
//!
//! - **classic**: a classic policy (`--classic-config`, CartPole PPO by
//!   default) published the way the learner publishes
//!   ([`relay_kit::weights::WeightsPublisher`]: inline up to
//!   `weights.inline_max_bytes`, else from the publisher's direct transfer
//!   server; then the stamped `WeightsUpdate` on `relay.<run>.weights`, the
//!   announcement on `weights.announce` and the newest answered on
//!   `weights.latest`), to the inference servers and one evaluator;
//! - **classic-`N`mb** (`classic-1mb`, `classic-10mb`, `classic-100mb`):
//!   the same policy widened (two hidden layers as wide as it takes) to
//!   about `N` MB of f32 parameters, the same way;
//! - **lora**: a LoRA adapter over `--model` (SmolLM2-135M by default, the
//!   `lora` section's defaults: rank 8 on every projection) published with
//!   the learner's own code ([`relay_kit::weights::publish_adapter`]):
//!   inline when small, else from the publisher's direct transfer server,
//!   then announced on `relay.<run>.adapters`;
//! - **full**: a full model of `--full-params` f32 parameters (SmolLM2-135M's
//!   134,515,008 by default) offered on the publisher's
//!   [`relay_kit::direct::DirectServer`] and fetched by each reader over
//!   its own TCP connection, the path a full-weight version takes;
//! - **full-store**: the same bytes through the JetStream object store
//!   (upload in 1 MiB chunks, then each reader's download), the path of
//!   what must outlive its publisher, for comparison.
//!
//!   relay's text runs publish adapters only, so no inference server loads
//!   full weights yet: both full payloads time the transport alone
//!   (publishing, announcement on NATS, each reader's copy in memory), with
//!   one NATS connection per simulated server.
//!
//! Classic and LoRA versions are served by real `relay-inference-server`
//! processes (classic ones also by a real `relay-evaluator`, which fetches
//! each version it evaluates: here every one, one episode each), and their
//! times are the services' own `relay_weights_transfer_seconds` (from the
//! publisher's stamp to the version held ready: fetched, parsed and built
//! or placed on the model); the stamps are whole milliseconds, so each
//! follower's mean over the versions is what is reported. A version is
//! published once every follower holds the one before and the evaluator
//! has evaluated it, so versions never queue. Prints a table and, last,
//! one JSON line.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use futures::StreamExt;
use relay::stack::{metric_value, scrape, ExternalInfra, Stack};
use relay_proto::{encode, Subjects, WeightsAnnouncement, WeightsRequest, WeightsUpdate};
use serde::Serialize;
use tokio::io::AsyncReadExt;

/// `relay-bench bench-weights` flags.
#[derive(Debug, Clone, clap::Args)]
pub struct BenchWeightsArgs {
    /// Inference-server counts to measure.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4")]
    pub servers: Vec<usize>,
    /// Payloads to measure: classic, classic-<N>mb (a classic policy of
    /// about N MB), lora, full, full-store.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "classic,classic-1mb,classic-10mb,classic-100mb,lora,full,full-store"
    )]
    pub payloads: Vec<String>,
    /// Versions published per classic or LoRA measurement.
    #[arg(long, default_value_t = 20)]
    pub versions: u64,
    /// Versions published per measurement of a sized classic policy
    /// (`classic-<N>mb`).
    #[arg(long, default_value_t = 5)]
    pub sized_versions: u64,
    /// Milliseconds between two classic or LoRA versions.
    #[arg(long, default_value_t = 200)]
    pub interval_ms: u64,
    /// Versions of the full model per measurement.
    #[arg(long, default_value_t = 3)]
    pub full_versions: u64,
    /// Parameters (f32) of the full-model payload.
    #[arg(long, default_value_t = 134_515_008)]
    pub full_params: u64,
    /// Config of the classic policy.
    #[arg(long, default_value = "configs/cartpole-ppo.yaml")]
    pub classic_config: PathBuf,
    /// Base model of the LoRA payload (`llm.model`: `smollm2`, `tiny`, a
    /// folder or a `.gguf`).
    #[arg(long, default_value = "smollm2")]
    pub model: String,
    /// Folder for the benchmark's NATS state and the servers' logs.
    #[arg(long, default_value = ".relay/bench-weights")]
    pub state_dir: PathBuf,
}

/// One (payload, server count) measurement.
#[derive(Debug, Clone, Serialize)]
struct Row {
    payload: String,
    servers: usize,
    bytes: u64,
    versions: u64,
    /// Mean publish-to-ready time over every (server, version).
    mean_ms: f64,
    /// Until every server held a version: the slowest server's mean
    /// (classic, LoRA) or the mean over versions of the slowest server
    /// (full).
    all_ready_ms: f64,
    /// Bytes delivered to all servers per second of `all_ready_ms`.
    mb_per_s: f64,
    /// Full model through the object store: the mean time of the upload,
    /// the first part of `mean_ms`.
    upload_ms: Option<f64>,
    /// Classic policies: the evaluator's mean publish-to-held time (it is
    /// not in `mean_ms` or `all_ready_ms`, which are the servers').
    evaluator_ms: Option<f64>,
}

impl Row {
    fn new(
        payload: &str,
        servers: usize,
        bytes: u64,
        versions: u64,
        mean_ms: f64,
        all_ready_ms: f64,
    ) -> Self {
        Self {
            payload: payload.into(),
            servers,
            bytes,
            versions,
            mean_ms,
            all_ready_ms,
            mb_per_s: bytes as f64 * servers as f64 / 1e6 / (all_ready_ms / 1e3).max(1e-9),
            upload_ms: None,
            evaluator_ms: None,
        }
    }
}

/// One payload's bytes, made once and published for every server count.
enum Payload {
    /// The classic policy whose versions are published, and the config
    /// overrides that give the followers its shape.
    Classic {
        model: Box<relay_nn::ActorCritic>,
        overrides: Vec<String>,
    },
    /// The adapter's PEFT files, and the servers' config (its base model).
    Lora {
        files: relay_llm::PeftBytes,
        config: PathBuf,
    },
    /// The full model's bytes, and whether they travel through the object
    /// store.
    Full(bytes::Bytes, FullPath),
}

/// `N` of a `classic-<N>mb` payload name.
fn classic_megabytes(name: &str) -> Result<f64> {
    name.strip_prefix("classic-")
        .and_then(|n| n.strip_suffix("mb"))
        .and_then(|n| n.parse::<f64>().ok())
        .filter(|mb| *mb > 0.0)
        .with_context(|| format!("payload {name:?}: expected classic-<N>mb, e.g. classic-10mb"))
}

impl Payload {
    fn classic(args: &BenchWeightsArgs, overrides: Vec<String>) -> Result<Self> {
        let config = relay_config::ExperimentConfig::load(&args.classic_config, &overrides)?;
        Ok(Self::Classic {
            model: Box::new(relay_nn::ActorCritic::new(
                &relay_policy::spec_for(&config)?,
                0,
            )?),
            overrides,
        })
    }

    fn prepare(name: &str, args: &BenchWeightsArgs) -> Result<Self> {
        Ok(match name {
            "classic" => Self::classic(args, Vec::new())?,
            _ if name.starts_with("classic-") => {
                let mb = classic_megabytes(name)?;
                // Actor and critic of two hidden layers of `width`: about
                // 2 * width^2 parameters of 4 bytes.
                let width = ((mb * 1e6 / 8.0).sqrt().round() as usize).max(1);
                Self::classic(args, vec![format!("policy.hidden=[{width}, {width}]")])?
            }
            "lora" => {
                let model = if args.model == "tiny" {
                    let out = args.state_dir.join("tiny");
                    relay::model::init_tiny(&out, 0)?;
                    out.display().to_string()
                } else {
                    args.model.clone()
                };
                let (base, _) = relay_llm::load_causal_lm(&model, relay_llm::GgufBase::Dequantized)
                    .with_context(|| {
                        format!("base model {model} (run `bash deploy/install.sh`)")
                    })?;
                let lora = relay_config::LoraSection::default().lora_config()?;
                let adapter = relay_llm::LoraAdapter::new(base.config(), lora, 0)?;
                let files = relay_llm::to_peft_bytes(&adapter, Some(&model))?;
                let config = args.state_dir.join("bench-weights-lora.yaml");
                std::fs::write(
                    &config,
                    format!(
                        "run:\n  env_id: TicTacToe-v0\nllm:\n  model: {model:?}\n  threads: 1\n"
                    ),
                )?;
                Self::Lora { files, config }
            }
            _ => {
                let bytes = args.full_params as usize * 4;
                let path = if name == "full" {
                    FullPath::Direct
                } else {
                    FullPath::ObjectStore
                };
                Self::Full((0..bytes).map(|i| (i * 31 % 251) as u8).collect(), path)
            }
        })
    }
}

/// Runs the benchmark (see the module docs).
pub fn bench_weights(args: BenchWeightsArgs) -> Result<()> {
    if args.servers.is_empty() || args.servers.contains(&0) || args.versions == 0 {
        bail!("--servers must list positive counts and --versions be positive");
    }
    for p in &args.payloads {
        if p.starts_with("classic-") {
            classic_megabytes(p)?;
        } else if !["classic", "lora", "full", "full-store"].contains(&p.as_str()) {
            bail!("unknown payload {p:?} in --payloads (known: classic, classic-<N>mb, lora, full, full-store)");
        }
    }
    std::fs::create_dir_all(&args.state_dir)?;
    let _ = std::fs::remove_dir_all(args.state_dir.join("nats"));
    let mut stack = Stack::start_infra(
        &args.state_dir,
        "bench-weights",
        &ExternalInfra::default(),
        relay_proto::DEFAULT_MAX_PAYLOAD,
    )?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let client = runtime.block_on(async_nats::connect(&stack.nats_url))?;
    let mut rows = Vec::new();
    for name in &args.payloads {
        let payload = Payload::prepare(name, &args)?;
        for &servers in &args.servers {
            let row = match &payload {
                Payload::Classic { model, overrides } => classic(
                    &mut stack, &runtime, &client, servers, &args, name, model, overrides,
                )?,
                Payload::Lora { files, config } => {
                    lora(&mut stack, &runtime, &client, servers, &args, files, config)?
                }
                Payload::Full(bytes, path) => runtime.block_on(full(
                    &stack.nats_url,
                    &client,
                    servers,
                    &args,
                    bytes,
                    *path,
                ))?,
            };
            eprintln!(
                "{} x{}: {:.2} MB, mean {:.1} ms, all ready {:.1} ms, {:.0} MB/s{}",
                row.payload,
                row.servers,
                row.bytes as f64 / 1e6,
                row.mean_ms,
                row.all_ready_ms,
                row.mb_per_s,
                row.evaluator_ms
                    .map_or(String::new(), |e| format!(", evaluator {e:.1} ms"))
            );
            rows.push(row);
        }
    }
    drop(client);
    stack.stop(Duration::from_secs(10));

    println!();
    println!("| payload | servers | MB | versions | mean publish-to-serving ms | all servers ready ms | MB/s | of which upload ms | evaluator ms |");
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|");
    let or_dash =
        |v: Option<f64>, digits: usize| v.map_or("-".to_string(), |v| format!("{v:.digits$}"));
    for r in &rows {
        println!(
            "| {} | {} | {:.3} | {} | {:.1} | {:.1} | {:.0} | {} | {} |",
            r.payload,
            r.servers,
            r.bytes as f64 / 1e6,
            r.versions,
            r.mean_ms,
            r.all_ready_ms,
            r.mb_per_s,
            or_dash(r.upload_ms, 0),
            or_dash(r.evaluator_ms, 1),
        );
    }
    let full_4 = rows
        .iter()
        .find(|r| r.payload == "full" && r.servers == 4)
        .map(|r| r.all_ready_ms / 1e3);
    println!(
        "{}",
        serde_json::json!({
            "bench": "weights",
            "rows": rows,
            "full_4_servers_all_ready_s": full_4,
            "target_full_4_servers_s": 2.0,
        })
    );
    Ok(())
}

/// Starts `servers` inference servers of run `run_id` on `config` with
/// `overrides` (and an evaluator with `evaluator` set) and waits until they
/// answer `/healthz`.
fn start_servers(
    stack: &mut Stack,
    run_id: &str,
    config: &std::path::Path,
    overrides: &[String],
    servers: usize,
    evaluator: bool,
) -> Result<()> {
    stack.run_id = run_id.to_string();
    for _ in 0..servers {
        stack.spawn_service("inference-server", config, overrides)?;
    }
    if evaluator {
        // Every version evaluated, one episode each: it fetches each one.
        let overrides: Vec<String> = overrides
            .iter()
            .cloned()
            .chain(["eval.every_versions=1".into(), "eval.episodes=1".into()])
            .collect();
        stack.spawn_service("evaluator", config, &overrides)?;
    }
    stack
        .wait_healthy(Duration::from_secs(300))
        .with_context(|| {
            format!(
                "inference servers of {run_id} (logs in {})",
                stack.state_dir.join("logs").display()
            )
        })
}

/// Stops the inference servers (and the evaluator) `start_servers` started.
fn stop_servers(stack: &mut Stack, servers: usize) -> Result<()> {
    let evaluators = stack.take_copies("evaluator", 1)?;
    for mut p in stack
        .take_copies("inference-server", servers)?
        .into_iter()
        .chain(evaluators)
    {
        let _ = p.child.wait();
    }
    Ok(())
}

/// One follower's `relay_weights_transfer_seconds`: `(count, sum)`.
#[derive(Debug, Clone, Copy, Default)]
struct Transfers {
    count: f64,
    sum: f64,
}

/// The transfer counters of every service of the stack, by instance name.
fn transfer_counters(stack: &Stack) -> Vec<(String, Transfers)> {
    stack
        .services
        .iter()
        .filter_map(|p| Some((p.name.clone(), p.metrics_addr?)))
        .map(|(name, addr)| {
            let text = scrape(addr).unwrap_or_default();
            let transfers = Transfers {
                count: metric_value(&text, "relay_weights_transfer_seconds_count").unwrap_or(0.0),
                sum: metric_value(&text, "relay_weights_transfer_seconds_sum").unwrap_or(0.0),
            };
            (name, transfers)
        })
        .collect()
}

/// Waits until every follower timed `n` transfers more than `before`.
async fn taken(stack: &Stack, before: &[Transfers], n: u64, what: &str) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let after = transfer_counters(stack);
        let behind: Vec<&str> = after
            .iter()
            .zip(before)
            .filter(|((_, a), b)| a.count - b.count < n as f64)
            .map(|((name, _), _)| name.as_str())
            .collect();
        if behind.is_empty() {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("{behind:?} did not take {what} within 120 s");
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Waits for the evaluator's report of version `v` (or a later one).
async fn evaluated(evaluations: &mut async_nats::Subscriber, v: u64) -> Result<()> {
    loop {
        let report = tokio::time::timeout(Duration::from_secs(120), evaluations.next())
            .await
            .with_context(|| format!("no evaluation of version {v} within 120 s"))?
            .context("evaluations subscription ended")?;
        let report: relay_proto::EvalReport = relay_proto::decode(&report.payload)?;
        if report.policy_version >= v {
            return Ok(());
        }
    }
}

/// What [`measure`] found: over the inference servers, the mean of every
/// transfer and the slowest server's mean; the evaluator's mean, if one
/// runs; in ms.
struct Measured {
    mean_ms: f64,
    worst_ms: f64,
    evaluator_ms: Option<f64>,
}

/// Publishes `versions` versions with `publish(v)`, each once every
/// follower timed the one before (and `evaluations`, when given, reported
/// its evaluation), `interval_ms` apart, and returns the followers' means.
async fn measure<F, Fut>(
    stack: &Stack,
    args: &BenchWeightsArgs,
    versions: u64,
    mut evaluations: Option<&mut async_nats::Subscriber>,
    mut publish: F,
) -> Result<Measured>
where
    F: FnMut(u64) -> Fut,
    Fut: std::future::Future<Output = Result<()>>,
{
    // Version 0, taken at start, is not timed: its stamp is from before
    // the followers started.
    let none = vec![Transfers::default(); stack.services.len()];
    taken(stack, &none, 1, "version 0").await?;
    if let Some(evaluations) = evaluations.as_deref_mut() {
        evaluated(evaluations, 0).await?;
    }
    let before = transfer_counters(stack);
    let before: Vec<Transfers> = before.into_iter().map(|(_, t)| t).collect();
    for v in 1..=versions {
        publish(v).await?;
        taken(stack, &before, v, &format!("version {v} of {versions}")).await?;
        if let Some(evaluations) = evaluations.as_deref_mut() {
            // The evaluator plays the version before it asks for the next.
            evaluated(evaluations, v).await?;
        }
        tokio::time::sleep(Duration::from_millis(args.interval_ms)).await;
    }
    let after = transfer_counters(stack);
    let means = after.iter().zip(&before).map(|((name, a), b)| {
        (
            relay::stack::service_of(name).to_string(),
            (a.sum - b.sum) / (a.count - b.count) * 1e3,
        )
    });
    let (servers, evaluator): (Vec<_>, Vec<_>) =
        means.partition(|(service, _)| service == "inference-server");
    let servers: Vec<f64> = servers.into_iter().map(|(_, ms)| ms).collect();
    Ok(Measured {
        mean_ms: servers.iter().sum::<f64>() / servers.len() as f64,
        worst_ms: servers.iter().copied().fold(0.0, f64::max),
        evaluator_ms: evaluator.first().map(|(_, ms)| *ms),
    })
}

/// Classic policy versions as the learner publishes them (see the module
/// docs), to `servers` inference servers and an evaluator.
#[allow(clippy::too_many_arguments)]
fn classic(
    stack: &mut Stack,
    runtime: &tokio::runtime::Runtime,
    client: &async_nats::Client,
    servers: usize,
    args: &BenchWeightsArgs,
    name: &str,
    model: &relay_nn::ActorCritic,
    overrides: &[String],
) -> Result<Row> {
    let run_id = format!("bench-weights-{name}-{servers}");
    let subjects = Subjects::new(&run_id);
    let config = relay_config::ExperimentConfig::load(&args.classic_config, overrides)?;
    let publisher = runtime.block_on(relay_kit::weights::WeightsPublisher::start(
        client,
        &config.weights,
        &stack.nats_url,
    ))?;
    let bucket = format!("relay-{run_id}-weights");
    // As the learner: answer `weights.latest` with the newest version.
    let newest = std::sync::Arc::new(std::sync::RwLock::new(bytes::Bytes::new()));
    let publish = |v: u64| {
        let weights = relay_policy::PolicyWeights::of(model, v, 0);
        let safetensors = bytes::Bytes::from(weights.to_safetensors());
        let (client, publisher, bucket, newest) =
            (client.clone(), &publisher, bucket.clone(), newest.clone());
        let subjects = subjects.clone();
        async move {
            let published_unix_ms = relay_proto::unix_ms();
            let key = format!("weights/v{v}");
            let blob = publisher
                .publish(
                    safetensors,
                    relay_kit::weights::Outgoing {
                        key: &key,
                        bucket: &bucket,
                        keep_in_store: false,
                    },
                )
                .await?;
            let update = encode(&WeightsUpdate {
                published_unix_ms,
                ..weights.update(blob)
            });
            *newest.write().expect("weights lock") = update.clone().into();
            client.publish(subjects.weights(), update.into()).await?;
            let announcement = WeightsAnnouncement {
                schema: relay_proto::SCHEMA_VERSION,
                version: v,
                learner_env_steps: 0,
            };
            client
                .publish(subjects.weights_announce(), encode(&announcement).into())
                .await?;
            anyhow::Ok(())
        }
    };
    runtime.block_on(publish(0))?;
    let mut latest = runtime.block_on(client.subscribe(subjects.weights_latest()))?;
    let answering = {
        let (client, newest) = (client.clone(), newest.clone());
        runtime.spawn(async move {
            while let Some(m) = latest.next().await {
                if relay_proto::decode::<WeightsRequest>(&m.payload).is_ok() {
                    if let Some(reply) = m.reply {
                        let answer = newest.read().expect("weights lock").clone();
                        let _ = client.publish(reply, answer).await;
                    }
                }
            }
        })
    };
    let mut evaluations = runtime.block_on(client.subscribe(subjects.eval()))?;
    start_servers(
        stack,
        &run_id,
        &args.classic_config,
        overrides,
        servers,
        true,
    )?;
    let versions = if name == "classic" {
        args.versions
    } else {
        args.sized_versions
    };
    let bytes = relay_policy::PolicyWeights::of(model, 0, 0)
        .to_safetensors()
        .len() as u64;
    let measured = runtime.block_on(measure(
        stack,
        args,
        versions,
        Some(&mut evaluations),
        publish,
    ));
    answering.abort();
    stop_servers(stack, servers)?;
    let measured = measured?;
    Ok(Row {
        evaluator_ms: measured.evaluator_ms,
        ..Row::new(
            name,
            servers,
            bytes,
            versions,
            measured.mean_ms,
            measured.worst_ms,
        )
    })
}

/// LoRA adapter versions as the learner publishes them.
fn lora(
    stack: &mut Stack,
    runtime: &tokio::runtime::Runtime,
    client: &async_nats::Client,
    servers: usize,
    args: &BenchWeightsArgs,
    files: &relay_llm::PeftBytes,
    config: &std::path::Path,
) -> Result<Row> {
    let run_id = format!("bench-weights-lora-{servers}");
    let publisher = runtime.block_on(relay_kit::weights::WeightsPublisher::start(
        client,
        &relay_config::WeightsSection::default(),
        &stack.nats_url,
    ))?;
    let subjects = Subjects::new(&run_id);
    // As the learner: version 0 before the servers start, and the newest
    // version answered on `adapters.latest` (a server that starts after a
    // version was published asks there).
    let newest = std::sync::Arc::new(std::sync::RwLock::new(bytes::Bytes::new()));
    let publish = |v: u64| {
        let (client, subject, run_id, files, publisher, newest) = (
            client.clone(),
            subjects.adapters(),
            run_id.clone(),
            files.clone(),
            &publisher,
            newest.clone(),
        );
        async move {
            let version = relay_kit::weights::AdapterVersion {
                name: relay_policy::text::LEARNING_ADAPTER,
                version: v,
                learner_env_steps: 0,
                config_json: &files.config_json,
                safetensors: files.safetensors.clone().into(),
                keep_in_store: false,
            };
            let update = relay_kit::weights::publish_adapter(publisher, &run_id, version).await?;
            let update: bytes::Bytes = encode(&update).into();
            *newest.write().expect("adapter lock") = update.clone();
            client.publish(subject, update).await?;
            anyhow::Ok(())
        }
    };
    runtime.block_on(publish(0))?;
    let mut latest = runtime.block_on(client.subscribe(subjects.adapters_latest()))?;
    let answering = {
        let (client, newest) = (client.clone(), newest.clone());
        runtime.spawn(async move {
            while let Some(m) = latest.next().await {
                if let Some(reply) = m.reply {
                    let answer = newest.read().expect("adapter lock").clone();
                    let _ = client.publish(reply, answer).await;
                }
            }
        })
    };
    start_servers(stack, &run_id, config, &[], servers, false)?;
    let measured = runtime.block_on(measure(stack, args, args.versions, None, publish));
    answering.abort();
    stop_servers(stack, servers)?;
    let measured = measured?;
    Ok(Row::new(
        "lora",
        servers,
        files.len() as u64,
        args.versions,
        measured.mean_ms,
        measured.worst_ms,
    ))
}

/// Which way the full model travels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum FullPath {
    /// From the publisher's [`relay_kit::direct::DirectServer`].
    Direct,
    /// Through the JetStream object store.
    ObjectStore,
}

/// A new full-model version announced to the readers.
#[derive(Debug, Serialize, serde::Deserialize)]
struct FullNotice {
    /// The direct server's `host:port` ([`FullPath::Direct`]).
    addr: Option<String>,
    key: String,
}

/// A full model's bytes to `servers` readers, each on its own NATS
/// connection, along `path` (see the module docs).
async fn full(
    nats_url: &str,
    client: &async_nats::Client,
    servers: usize,
    args: &BenchWeightsArgs,
    payload: &bytes::Bytes,
    path: FullPath,
) -> Result<Row> {
    let bytes = payload.len();
    let jetstream = async_nats::jetstream::new(client.clone());
    let bucket = format!("relay-bench-weights-full-{servers}");
    /// Where the publisher puts each version.
    enum Publisher {
        Direct(relay_kit::direct::DirectServer),
        Store(Box<async_nats::jetstream::object_store::ObjectStore>),
    }
    let publisher = match path {
        FullPath::ObjectStore => Publisher::Store(Box::new(
            jetstream
                .create_object_store(async_nats::jetstream::object_store::Config {
                    bucket: bucket.clone(),
                    ..Default::default()
                })
                .await
                .map_err(|e| anyhow::anyhow!("object store bucket {bucket}: {e}"))?,
        )),
        FullPath::Direct => Publisher::Direct(
            relay_kit::direct::DirectServer::bind(([127, 0, 0, 1], 0).into(), None, 1).await?,
        ),
    };
    let notices = format!("relay.{bucket}.versions");
    let (done_tx, mut done_rx) = tokio::sync::mpsc::unbounded_channel::<Result<(usize, Instant)>>();
    let mut readers = Vec::new();
    for _ in 0..servers {
        let reader = async_nats::connect(nats_url).await?;
        let mut versions = reader.subscribe(notices.clone()).await?;
        // The subscription reaches the server before the first notice.
        reader.flush().await?;
        let store = match path {
            FullPath::ObjectStore => Some(
                async_nats::jetstream::new(reader.clone())
                    .get_object_store(&bucket)
                    .await
                    .map_err(|e| anyhow::anyhow!("object store bucket {bucket}: {e}"))?,
            ),
            FullPath::Direct => None,
        };
        let done = done_tx.clone();
        readers.push(tokio::spawn(async move {
            let _connection = reader;
            while let Some(notice) = versions.next().await {
                let fetched = async {
                    let notice: FullNotice = serde_json::from_slice(&notice.payload)?;
                    let key = notice.key;
                    let held = match (&store, notice.addr) {
                        (_, Some(addr)) => {
                            relay_kit::direct::fetch(
                                &addr,
                                &key,
                                bytes as u64,
                                Duration::from_secs(300),
                            )
                            .await?
                        }
                        (Some(store), None) => {
                            let mut object = store
                                .get(&key)
                                .await
                                .map_err(|e| anyhow::anyhow!("{key}: {e}"))?;
                            let mut held = Vec::with_capacity(bytes);
                            object.read_to_end(&mut held).await?;
                            held
                        }
                        (None, None) => bail!("a notice without an address"),
                    };
                    Ok::<_, anyhow::Error>(held.len())
                }
                .await;
                let _ = done.send(fetched.map(|n| (n, Instant::now())));
            }
        }));
    }
    client.flush().await?;
    let (mut all, mut slowest, mut uploads) = (Vec::new(), Vec::new(), Vec::new());
    for v in 1..=args.full_versions {
        let key = format!("policy/v{v}");
        let published = Instant::now();
        let addr = match &publisher {
            Publisher::Direct(server) => {
                server.offer(&key, payload.clone());
                Some(server.addr().to_string())
            }
            Publisher::Store(store) => {
                relay_kit::weights::put_object(client, store, &key, payload)
                    .await
                    .map_err(|e| anyhow::anyhow!("uploading {key}: {e}"))?;
                uploads.push(published.elapsed().as_secs_f64() * 1e3);
                None
            }
        };
        let notice = FullNotice {
            addr,
            key: key.clone(),
        };
        client
            .publish(notices.clone(), serde_json::to_vec(&notice)?.into())
            .await?;
        let mut latest = 0.0f64;
        for _ in 0..servers {
            let (n, at) = tokio::time::timeout(Duration::from_secs(300), done_rx.recv())
                .await
                .context("a reader did not finish within 300 s")?
                .context("readers stopped")??;
            if n != bytes {
                bail!("a reader got {n} of {bytes} bytes");
            }
            let ms = (at - published).as_secs_f64() * 1e3;
            all.push(ms);
            latest = latest.max(ms);
        }
        slowest.push(latest);
        if let Publisher::Store(store) = &publisher {
            store
                .delete(&key)
                .await
                .map_err(|e| anyhow::anyhow!("deleting {key}: {e}"))?;
        }
    }
    for r in readers {
        r.abort();
    }
    if let Publisher::Store(_) = publisher {
        let _ = jetstream.delete_object_store(&bucket).await;
    }
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len().max(1) as f64;
    let mut row = Row::new(
        match path {
            FullPath::Direct => "full",
            FullPath::ObjectStore => "full-store",
        },
        servers,
        bytes as u64,
        args.full_versions,
        mean(&all),
        mean(&slowest),
    );
    row.upload_ms = (!uploads.is_empty()).then(|| mean(&uploads));
    Ok(row)
}
