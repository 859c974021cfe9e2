//! `relay-bench bench-learners` (`just bench-learners`): learner throughput
//! with 1 and with 2 data-parallel replicas of one compute thread each, on
//! the Atari NatureCNN PPO preset (`configs/breakout-ppo.yaml`: a rollout
//! of 1,024 frames of 4 x 84 x 84, 4 epochs of 256-sample minibatches, the
//! 1.69M-parameter CnnPolicy).
//!
//! Each replica is its own process (this binary, started again with
//! `--replica`), with `RAYON_NUM_THREADS=1`, joined through a real
//! nats-server into a [`relay_kit::collective::Group`], and runs the
//! learner's own PPO update (`relay_learner::ppo::update`) with
//! [`relay_learner::replicas::InGroup`]: its share of every minibatch, the
//! gradients summed by the ring all-reduce. Every replica holds the same
//! rollout (drawn from one seed), as rank 0 hands it out in a run. The
//! figure is samples trained per second (rollout length x epochs over the
//! median update time, after one warm-up update), and the speedup is the
//! 2-replica figure over the lone learner's. The replicas' parameters are
//! compared bit for bit at the end, so a fast wrong sum cannot pass.
//! A table, then one JSON line.

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use rand::{Rng, SeedableRng};
use relay::stack::{ExternalInfra, Stack};
use relay_config::ExperimentConfig;
use relay_kit::collective::{Group, GroupConfig, View};
use relay_learner::optimizer::Optimizer;
use relay_learner::replicas::{Alone, GradientSync, InGroup};
use relay_learner::rollout::Rollout;
use relay_nn::{Actions, ActorCritic};

/// `relay-bench bench-learners` flags.
#[derive(Debug, clap::Args)]
pub struct BenchLearnersArgs {
    /// The PPO config whose rollout, minibatch and epochs are trained.
    #[arg(long, default_value = "configs/breakout-ppo.yaml")]
    pub config: PathBuf,
    /// Replica counts, comma-separated (each replica one process of one thread).
    #[arg(long, default_value = "1,2", value_delimiter = ',')]
    pub replicas: Vec<usize>,
    /// Timed updates per replica count (the median is reported), after one warm-up.
    #[arg(long, default_value_t = 3)]
    pub updates: usize,
    /// Where the nats-server keeps its state.
    #[arg(long, default_value = ".relay/bench-learners")]
    pub state_dir: PathBuf,
    /// Internal: run as one replica, `ID,REPLICAS,NATS_URL,GROUP` (the
    /// bench starts these itself).
    #[arg(long, hide = true)]
    pub replica: Option<String>,
}

/// Breakout's actions.
const ACTIONS: usize = 4;
/// The seed of the model and the rollout every replica draws alike.
const SEED: u64 = 7;

/// What one replica process reports (its last line of stdout).
#[derive(Debug, serde::Serialize, serde::Deserialize)]
struct ReplicaReport {
    rank: usize,
    /// Seconds of each timed update.
    seconds: Vec<f64>,
    /// Seconds in all-reduces over the timed updates, and bytes summed.
    allreduce_seconds: f64,
    allreduce_bytes: u64,
    /// SHA-256 of the parameters after the last update.
    digest: String,
}

fn nature_cnn() -> Result<ActorCritic> {
    let spec = crate::bench_cnn_step::nature_cnn_spec(ACTIONS);
    Ok(ActorCritic::new(&spec, SEED)?)
}

/// A rollout of `n` random frames acted by `model`, random advantages.
fn rollout(model: &ActorCritic, n: usize) -> Result<Rollout> {
    let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(SEED);
    let obs_dim = model.spec().obs_dim;
    let obs: Vec<f32> = (0..n * obs_dim)
        .map(|_| r.random_range(0.0f32..255.0).floor())
        .collect();
    // Acting in chunks, as the inference server batches.
    let (mut actions, mut logprobs, mut values) = (Vec::new(), Vec::new(), Vec::new());
    for chunk in obs.chunks(256 * obs_dim) {
        let out = model.act(chunk, chunk.len() / obs_dim, false, &mut r)?;
        let Actions::Discrete(a) = out.actions else {
            bail!("NatureCNN's policy is discrete")
        };
        actions.extend(a.iter().map(|&a| a as u32));
        logprobs.extend(out.logprobs);
        values.extend(out.values);
    }
    let advantages: Vec<f32> = (0..n).map(|_| r.random_range(-1.0..1.0)).collect();
    let returns = advantages.iter().zip(&values).map(|(a, v)| a + v).collect();
    Ok(Rollout {
        obs,
        obs_dim,
        actions_discrete: actions,
        actions_continuous: Vec::new(),
        action_dim: 0,
        old_logprobs: logprobs,
        old_values: values,
        advantages,
        returns,
        len: n,
        vec_steps: n as u64,
        oldest_version: 0,
    })
}

fn load_config(path: &std::path::Path) -> Result<ExperimentConfig> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("config {}", path.display()))?;
    let cfg = ExperimentConfig::from_layers(&text, &path.display().to_string(), &[], &[])?;
    if cfg.run.algo != relay_config::Algo::Ppo {
        bail!("{}: bench-learners trains PPO configs", path.display());
    }
    Ok(cfg)
}

/// One replica process: joins the group, trains `updates + 1` PPO updates
/// with its share of each minibatch, prints its report.
fn run_replica(spec: &str, cfg: &ExperimentConfig, updates: usize) -> Result<()> {
    let parts: Vec<&str> = spec.splitn(4, ',').collect();
    let [id, replicas, nats_url, group_name] = parts[..] else {
        bail!("--replica {spec:?}: ID,REPLICAS,NATS_URL,GROUP");
    };
    let (id, replicas): (usize, usize) = (id.parse()?, replicas.parse()?);
    let model = nature_cnn()?;
    let mut optimizer = Optimizer::for_run(cfg, model.vars())?;
    let batch = rollout(&model, cfg.ppo.rollout_steps)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    // A lone learner trains as one does in a run (no group, no sums).
    let mut joined = if replicas > 1 {
        Some(runtime.block_on(join(nats_url, group_name, id, replicas))?)
    } else {
        None
    };
    let rank = joined
        .as_ref()
        .and_then(|(group, view)| view.rank_of(group.member()))
        .unwrap_or(0);
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(SEED);
    let mut tag = 0;
    let mut seconds = Vec::new();
    let (mut allreduce_seconds, mut allreduce_bytes) = (0.0, 0);
    for update in 0..=updates {
        let started = Instant::now();
        let progress = update as f64 / (updates + 1) as f64;
        let mut train = |sync: &mut dyn GradientSync, rng: &mut rand_chacha::ChaCha8Rng| {
            relay_learner::ppo::update(
                &model,
                &mut optimizer,
                &batch,
                &cfg.ppo,
                progress,
                rng,
                sync,
            )
        };
        let reduced = match joined.as_mut() {
            Some((group, view)) => {
                let mut sync = InGroup::new(group, view.clone(), tag, runtime.handle().clone())?;
                train(&mut sync, &mut rng)?;
                tag = sync.next_tag();
                sync.reduced
            }
            None => {
                train(&mut Alone, &mut rng)?;
                Default::default()
            }
        };
        if update > 0 {
            seconds.push(started.elapsed().as_secs_f64());
            allreduce_seconds += reduced.seconds;
            allreduce_bytes += reduced.bytes;
        }
    }
    let digest = relay_learner::replicas::digest(&model.named_tensors());
    let report = ReplicaReport {
        rank,
        seconds,
        allreduce_seconds,
        allreduce_bytes,
        digest: digest.iter().map(|b| format!("{b:02x}")).collect(),
    };
    println!("{}", serde_json::to_string(&report)?);
    if let Some((group, _)) = joined {
        runtime.block_on(group.leave())?;
    }
    Ok(())
}

/// Joins the group as member `id` and waits for the view of all `replicas`
/// (ranks are the order of joining).
async fn join(nats_url: &str, name: &str, id: usize, replicas: usize) -> Result<(Group, View)> {
    let nats = async_nats::connect(nats_url).await?;
    let config = GroupConfig::new(name, format!("m{id}"), "127.0.0.1:0".parse()?);
    let group = Group::join(&nats, config).await?;
    let view = crate::full_view(&group, replicas, Duration::from_secs(30)).await?;
    Ok((group, view))
}

struct Row {
    replicas: usize,
    /// Median seconds of one update (rank 0's).
    update_seconds: f64,
    samples_per_s: f64,
    allreduce_seconds_per_update: f64,
    allreduce_mb_per_update: f64,
}

pub fn bench_learners(args: BenchLearnersArgs) -> Result<()> {
    let cfg = load_config(&args.config)?;
    if let Some(spec) = &args.replica {
        return run_replica(spec, &cfg, args.updates);
    }
    if args.updates == 0 || args.replicas.contains(&0) {
        bail!("--updates and every --replicas count must be positive");
    }
    std::fs::create_dir_all(&args.state_dir)?;
    let _ = std::fs::remove_dir_all(args.state_dir.join("nats"));
    let stack = Stack::start_infra(
        &args.state_dir,
        "bench-learners",
        &ExternalInfra::default(),
        relay_proto::DEFAULT_MAX_PAYLOAD,
    )?;
    let exe = std::env::current_exe()?;
    let samples_per_update = (cfg.ppo.rollout_steps * cfg.ppo.epochs) as f64;
    let mut rows = Vec::new();
    for &n in &args.replicas {
        let group = format!("bench-learners-{n}-{}", std::process::id());
        let mut children = Vec::new();
        for id in 0..n {
            let child = Command::new(&exe)
                .arg("bench-learners")
                .arg("--config")
                .arg(&args.config)
                .args(["--updates", &args.updates.to_string()])
                .arg("--replica")
                .arg(format!("{id},{n},{},{group}", stack.nats_url))
                .env("RAYON_NUM_THREADS", "1")
                .stdout(Stdio::piped())
                .spawn()
                .context("starting a replica")?;
            children.push(child);
        }
        let mut reports = Vec::new();
        for child in children {
            let out = child.wait_with_output()?;
            let stdout = String::from_utf8_lossy(&out.stdout);
            if !out.status.success() {
                bail!("a replica of {n} failed ({}): {stdout}", out.status);
            }
            let last = stdout.lines().last().unwrap_or_default();
            reports.push(serde_json::from_str::<ReplicaReport>(last)?);
        }
        if reports.iter().any(|r| r.digest != reports[0].digest) {
            bail!("{n} replicas ended with different parameters");
        }
        let lead = reports.iter().find(|r| r.rank == 0).context("no rank 0")?;
        let mut times = lead.seconds.clone();
        times.sort_by(f64::total_cmp);
        let update_seconds = times[times.len() / 2];
        rows.push(Row {
            replicas: n,
            update_seconds,
            samples_per_s: samples_per_update / update_seconds,
            allreduce_seconds_per_update: lead.allreduce_seconds / lead.seconds.len() as f64,
            allreduce_mb_per_update: lead.allreduce_bytes as f64 / 1e6 / lead.seconds.len() as f64,
        });
    }
    drop(stack);

    let cpu = format!("{} ({})", crate::cpu_name(), crate::cpu_simd());
    let base = rows
        .iter()
        .find(|r| r.replicas == 1)
        .map(|r| r.samples_per_s);
    println!(
        "PPO updates of {} (NatureCNN, rollout {} x {} epochs, minibatch {}), each replica a process of 1 thread; {cpu}",
        args.config.display(),
        cfg.ppo.rollout_steps,
        cfg.ppo.epochs,
        cfg.ppo.minibatch_size
    );
    println!("| replicas | update (median) | samples/s | speedup | all-reduce per update | summed per update |");
    println!("|---:|---:|---:|---:|---:|---:|");
    let mut json_rows = Vec::new();
    for r in &rows {
        let speedup = base.map(|b| r.samples_per_s / b);
        println!(
            "| {} | {:.2} s | {:.0} | {} | {:.3} s | {:.0} MB |",
            r.replicas,
            r.update_seconds,
            r.samples_per_s,
            speedup.map_or("-".into(), |s| format!("{s:.2}x")),
            r.allreduce_seconds_per_update,
            r.allreduce_mb_per_update,
        );
        json_rows.push(serde_json::json!({
            "replicas": r.replicas,
            "update_seconds": r.update_seconds,
            "samples_per_s": r.samples_per_s,
            "speedup": speedup,
            "allreduce_seconds_per_update": r.allreduce_seconds_per_update,
            "allreduce_bytes_per_update": r.allreduce_mb_per_update * 1e6,
        }));
    }
    println!(
        "{}",
        serde_json::json!({"bench": "learners", "workload": "ppo-naturecnn", "cpu": cpu, "updates": args.updates, "rows": json_rows})
    );
    Ok(())
}
