//! `relay-bench bench-weights` (`just bench-weights`): how long a new
//! weights version takes from its publishing to being served, and how many
//! bytes per second that moves, for 1, 2 and 4 inference servers.
//!
//! Three payloads, each through the path its versions take in a run:
//!
//! - **classic**: a classic policy (`--classic-config`, CartPole PPO by
//!   default) as a `WeightsUpdate` on `relay.<run>.weights`, published the
//!   way the learner publishes (stamped, then one NATS message);
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
//! processes, and their times are the servers' own
//! `relay_weights_transfer_seconds` (from the publisher's stamp to the
//! version held ready: decoded and built, or fetched, parsed and placed on
//! the model); the stamps are whole milliseconds, so each server's mean
//! over `--versions` versions is what is reported. Prints a table and,
//! last, one JSON line.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use futures::StreamExt;
use relay::stack::{metric_value, scrape, ExternalInfra, Stack};
use relay_proto::{encode, Subjects, WeightsRequest, WeightsUpdate};
use serde::Serialize;
use tokio::io::AsyncReadExt;

/// `relay-bench bench-weights` flags.
#[derive(Debug, Clone, clap::Args)]
pub struct BenchWeightsArgs {
    /// Inference-server counts to measure.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4")]
    pub servers: Vec<usize>,
    /// Payloads to measure: classic, lora, full, full-store.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "classic,lora,full,full-store"
    )]
    pub payloads: Vec<String>,
    /// Versions published per classic or LoRA measurement.
    #[arg(long, default_value_t = 20)]
    pub versions: u64,
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
        }
    }
}

/// One payload's bytes, made once and published for every server count.
enum Payload {
    /// The classic policy whose versions are published.
    Classic(Box<relay_nn::ActorCritic>),
    /// The adapter's PEFT files, and the servers' config (its base model).
    Lora {
        files: relay_llm::PeftBytes,
        config: PathBuf,
    },
    /// The full model's bytes, and whether they travel through the object
    /// store.
    Full(bytes::Bytes, FullPath),
}

impl Payload {
    fn prepare(name: &str, args: &BenchWeightsArgs) -> Result<Self> {
        Ok(match name {
            "classic" => {
                let config = relay_config::ExperimentConfig::load(&args.classic_config, &[])?;
                Self::Classic(Box::new(relay_nn::ActorCritic::new(
                    &relay_policy::spec_for(&config)?,
                    0,
                )?))
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
        if !["classic", "lora", "full", "full-store"].contains(&p.as_str()) {
            bail!("unknown payload {p:?} in --payloads (known: classic, lora, full, full-store)");
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
                Payload::Classic(model) => {
                    classic(&mut stack, &runtime, &client, servers, &args, model)?
                }
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
                "{} x{}: {:.2} MB, mean {:.1} ms, all ready {:.1} ms, {:.0} MB/s",
                row.payload,
                row.servers,
                row.bytes as f64 / 1e6,
                row.mean_ms,
                row.all_ready_ms,
                row.mb_per_s
            );
            rows.push(row);
        }
    }
    drop(client);
    stack.stop(Duration::from_secs(10));

    println!();
    println!("| payload | servers | MB | versions | mean publish-to-serving ms | all servers ready ms | MB/s | of which upload ms |");
    println!("|---|---:|---:|---:|---:|---:|---:|---:|");
    for r in &rows {
        println!(
            "| {} | {} | {:.3} | {} | {:.1} | {:.1} | {:.0} | {} |",
            r.payload,
            r.servers,
            r.bytes as f64 / 1e6,
            r.versions,
            r.mean_ms,
            r.all_ready_ms,
            r.mb_per_s,
            r.upload_ms.map_or("-".to_string(), |u| format!("{u:.0}"))
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

/// Starts `servers` inference servers of run `run_id` on `config` and
/// waits until they answer `/healthz`.
fn start_servers(
    stack: &mut Stack,
    run_id: &str,
    config: &std::path::Path,
    servers: usize,
) -> Result<()> {
    stack.run_id = run_id.to_string();
    for _ in 0..servers {
        stack.spawn_service("inference-server", config, &[])?;
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

/// Stops the inference servers `start_servers` started.
fn stop_servers(stack: &mut Stack, servers: usize) -> Result<()> {
    for mut p in stack.take_copies("inference-server", servers)? {
        let _ = p.child.wait();
    }
    Ok(())
}

/// `(count, sum)` of `relay_weights_transfer_seconds` on each server.
fn transfer_counters(stack: &Stack) -> Vec<(f64, f64)> {
    stack
        .services
        .iter()
        .filter_map(|p| p.metrics_addr)
        .map(|addr| {
            let text = scrape(addr).unwrap_or_default();
            (
                metric_value(&text, "relay_weights_transfer_seconds_count").unwrap_or(0.0),
                metric_value(&text, "relay_weights_transfer_seconds_sum").unwrap_or(0.0),
            )
        })
        .collect()
}

/// Publishes `versions` versions with `publish(v)` every `interval_ms`,
/// waits until every server timed all of them, and returns the mean over
/// every transfer and the slowest server's mean, in ms.
async fn measure<F, Fut>(
    stack: &Stack,
    args: &BenchWeightsArgs,
    mut publish: F,
) -> Result<(f64, f64)>
where
    F: FnMut(u64) -> Fut,
    Fut: std::future::Future<Output = Result<()>>,
{
    let before = transfer_counters(stack);
    for v in 1..=args.versions {
        publish(v).await?;
        tokio::time::sleep(Duration::from_millis(args.interval_ms)).await;
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let after = transfer_counters(stack);
        let done = after
            .iter()
            .zip(&before)
            .all(|(a, b)| a.0 - b.0 >= args.versions as f64);
        if done {
            let means: Vec<f64> = after
                .iter()
                .zip(&before)
                .map(|(a, b)| (a.1 - b.1) / (a.0 - b.0) * 1e3)
                .collect();
            let mean = means.iter().sum::<f64>() / means.len() as f64;
            let worst = means.iter().copied().fold(0.0, f64::max);
            return Ok((mean, worst));
        }
        if Instant::now() > deadline {
            let got: Vec<f64> = after.iter().zip(&before).map(|(a, b)| a.0 - b.0).collect();
            bail!(
                "servers timed {got:?} of {} versions within 60 s",
                args.versions
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Classic policy versions through `relay.<run>.weights`.
fn classic(
    stack: &mut Stack,
    runtime: &tokio::runtime::Runtime,
    client: &async_nats::Client,
    servers: usize,
    args: &BenchWeightsArgs,
    model: &relay_nn::ActorCritic,
) -> Result<Row> {
    let run_id = format!("bench-weights-classic-{servers}");
    let subjects = Subjects::new(&run_id);
    // As the learner: answer `weights.latest` with version 0, and publish
    // through the weights transport.
    let config = relay_config::ExperimentConfig::load(&args.classic_config, &[])?;
    let publisher = runtime.block_on(relay_kit::weights::WeightsPublisher::start(
        client,
        &config.weights,
        &stack.nats_url,
    ))?;
    let bucket = format!("relay-{run_id}-weights");
    let first = encode(&relay_policy::PolicyWeights::of(model, 0, 0).inline_update());
    let mut latest = runtime.block_on(client.subscribe(subjects.weights_latest()))?;
    let answering = {
        let client = client.clone();
        runtime.spawn(async move {
            while let Some(m) = latest.next().await {
                if relay_proto::decode::<WeightsRequest>(&m.payload).is_ok() {
                    if let Some(reply) = m.reply {
                        let _ = client.publish(reply, first.clone().into()).await;
                    }
                }
            }
        })
    };
    start_servers(stack, &run_id, &args.classic_config, servers)?;
    let mut bytes = 0;
    let measured = runtime.block_on(measure(stack, args, |v| {
        let weights = relay_policy::PolicyWeights::of(model, v, 0);
        let (client, subject, publisher, bucket) = (
            client.clone(),
            subjects.weights(),
            &publisher,
            bucket.clone(),
        );
        let safetensors = bytes::Bytes::from(weights.to_safetensors());
        bytes = safetensors.len() as u64;
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
            let update = WeightsUpdate {
                published_unix_ms,
                ..weights.update(blob)
            };
            client.publish(subject, encode(&update).into()).await?;
            Ok(())
        }
    }));
    answering.abort();
    stop_servers(stack, servers)?;
    let (mean, worst) = measured?;
    Ok(Row::new(
        "classic",
        servers,
        bytes,
        args.versions,
        mean,
        worst,
    ))
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
    start_servers(stack, &run_id, config, servers)?;
    let publisher = runtime.block_on(relay_kit::weights::WeightsPublisher::start(
        client,
        &relay_config::WeightsSection::default(),
        &stack.nats_url,
    ))?;
    let subjects = Subjects::new(&run_id);
    let measured = runtime.block_on(measure(stack, args, |v| {
        let (client, subject, run_id, files, publisher) = (
            client.clone(),
            subjects.adapters(),
            run_id.clone(),
            files.clone(),
            &publisher,
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
            client.publish(subject, encode(&update).into()).await?;
            Ok(())
        }
    }));
    stop_servers(stack, servers)?;
    let (mean, worst) = measured?;
    Ok(Row::new(
        "lora",
        servers,
        files.len() as u64,
        args.versions,
        mean,
        worst,
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
