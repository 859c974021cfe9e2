//! `relay-bench bench-learners` (`just bench-learners`): learner throughput
//! with 1 and with 2 data-parallel replicas of one compute thread each, on
//! learner-bound workloads:
//! - `ppo-naturecnn`: the Atari NatureCNN PPO preset
//!   (`configs/breakout-ppo.yaml`: a rollout of 1,024 frames of 4 x 84 x
//!   84, 4 epochs of 256-sample minibatches, the 1.69M-parameter
//!   CnnPolicy), one update per step;
//! - `sac`: the Pendulum SAC preset (`configs/pendulum-sac.yaml`: actor
//!   and twin critics of [256, 256], batch 256) at 8 gradient steps per
//!   env step, one round of 8 gradient steps per step;
//! - `grpo-smollm2`: the TicTacToe GRPO preset (`configs/tictactoe-grpo.yaml`:
//!   Dr. GRPO, a batch of 32 sequences in micro-batches of 8, rank-8 LoRA
//!   on every projection) over SmolLM2-135M-Instruct (`llm.model:
//!   smollm2`, installed by `deploy/install.sh`), on sequences of a
//!   64-token prompt and an 8-token move, one update per step.
//!
//! Each replica is its own process (this binary, started again with
//! `--replica`), with `RAYON_NUM_THREADS=1`, joined through a real
//! nats-server into a [`relay_kit::collective::Group`], and runs the
//! learner's own update (`relay_algo::ppo::update`,
//! `relay_algo::sac::gradient_step`) with
//! [`relay_replicas::in_group`]: its share of every minibatch, the
//! gradients summed by the ring all-reduce. Every replica holds the same
//! data (drawn from one seed), as rank 0 hands it out in a run. The
//! figure is samples trained per second (samples per step over the median
//! step time, after one warm-up step), and the speedup is the 2-replica
//! figure over the lone learner's. Beside it stands the machine's own
//! ceiling: as many lone learners started at once, with nothing summed
//! (the lone step time over the slowest copy's, times their number, since
//! replicas in lockstep go at the slowest one's pace). Cores that share
//! caches, memory bandwidth or a host's other tenants keep it under N, and
//! no all-reduce can beat it.
//!
//! The replicas' parameters are compared bit for bit at the end, and with
//! the lone learner's: the gap, max |a - b| / (1 + |b|) over every
//! parameter, is printed, and above 1e-2 the bench fails. It is not zero:
//! the replicas add the same numbers in another order (two halves, then
//! the halves together), and the optimizer carries the last-bit
//! differences forward. So a fast wrong sum cannot pass, and the bench is
//! also the process-level equivalence check of the replicas (its test runs
//! it on small networks for 20 steps). A table, then one JSON line.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use rand::{Rng, SeedableRng};
use relay::stack::{ExternalInfra, Stack};
use relay_algo::optimizer::Optimizer;
use relay_algo::rollout::Rollout;
use relay_config::ExperimentConfig;
use relay_kit::collective::{Group, GroupConfig, View};
use relay_nn::BatchShare;
use relay_nn::{Actions, ActorCritic};
use relay_proto::TransitionBatch;

/// `relay-bench bench-learners` flags.
#[derive(Debug, clap::Args)]
pub struct BenchLearnersArgs {
    /// The workloads, comma-separated.
    #[arg(long, value_enum, default_values_t = [Workload::PpoNaturecnn, Workload::Sac, Workload::GrpoSmollm2], value_delimiter = ',')]
    pub workloads: Vec<Workload>,
    /// The folder of the presets.
    #[arg(long, default_value = "configs")]
    pub configs_dir: PathBuf,
    /// Config overrides (`section.field=value`) for every workload's preset.
    #[arg(long = "set")]
    pub overrides: Vec<String>,
    /// Replica counts, comma-separated (each replica one process of one thread).
    #[arg(long, default_value = "1,2", value_delimiter = ',')]
    pub replicas: Vec<usize>,
    /// Timed steps per replica count (the median is reported), after one warm-up.
    #[arg(long, default_value_t = 3)]
    pub updates: usize,
    /// Where the nats-server keeps its state.
    #[arg(long, default_value = ".relay/bench-learners")]
    pub state_dir: PathBuf,
    /// Internal: run as one replica, `ID,REPLICAS,NATS_URL,GROUP,WORKLOAD,PARAMS_OUT`
    /// (the bench starts these itself).
    #[arg(long, hide = true)]
    pub replica: Option<String>,
}

/// A learner-bound workload (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Workload {
    /// PPO on the Atari NatureCNN preset.
    PpoNaturecnn,
    /// SAC on the Pendulum preset at 8 gradient steps per env step.
    Sac,
    /// LoRA GRPO on SmolLM2-135M with the TicTacToe preset.
    GrpoSmollm2,
}

impl Workload {
    fn name(self) -> &'static str {
        match self {
            Self::PpoNaturecnn => "ppo-naturecnn",
            Self::Sac => "sac",
            Self::GrpoSmollm2 => "grpo-smollm2",
        }
    }

    /// The preset, with the workload's own settings and `overrides`.
    fn config(self, dir: &Path, overrides: &[String]) -> Result<ExperimentConfig> {
        let (file, own): (&str, &[&str]) = match self {
            Self::PpoNaturecnn => ("breakout-ppo.yaml", &[]),
            Self::Sac => ("pendulum-sac.yaml", &["sac.gradient_steps=8"]),
            Self::GrpoSmollm2 => ("tictactoe-grpo.yaml", &["llm.model=smollm2"]),
        };
        let path = dir.join(file);
        let text =
            std::fs::read_to_string(&path).with_context(|| format!("config {}", path.display()))?;
        let mut layers: Vec<String> = own.iter().map(|s| s.to_string()).collect();
        layers.extend(overrides.iter().cloned());
        Ok(ExperimentConfig::from_layers(
            &text,
            &path.display().to_string(),
            &[],
            &layers,
        )?)
    }

    /// What one step trains, for the table's heading.
    fn describe(self, cfg: &ExperimentConfig) -> String {
        match self {
            Self::PpoNaturecnn => format!(
                "PPO updates (NatureCNN, rollout {} x {} epochs, minibatch {})",
                cfg.ppo.rollout_steps, cfg.ppo.epochs, cfg.ppo.minibatch_size
            ),
            Self::Sac => format!(
                "SAC rounds ({:?} networks on {}, {} gradient steps of batch {})",
                cfg.sac.net_arch, cfg.run.env_id, cfg.sac.gradient_steps, cfg.sac.batch_size
            ),
            Self::GrpoSmollm2 => format!(
                "LoRA {} updates ({}, {} sequences of {PROMPT_TOKENS} + {MOVE_TOKENS} tokens in micro-batches of {}, {} epoch(s), LoRA rank {})",
                cfg.rl.preset,
                cfg.llm.model.as_deref().unwrap_or("?"),
                cfg.rl.batch_size,
                cfg.rl.minibatch_size,
                cfg.rl.epochs,
                cfg.lora.rank
            ),
        }
    }

    /// Samples trained in one step.
    fn samples_per_step(self, cfg: &ExperimentConfig) -> f64 {
        match self {
            Self::PpoNaturecnn => (cfg.ppo.rollout_steps * cfg.ppo.epochs) as f64,
            Self::Sac => (cfg.sac.gradient_steps * cfg.sac.batch_size) as f64,
            Self::GrpoSmollm2 => (cfg.rl.batch_size * cfg.rl.epochs) as f64,
        }
    }
}

/// Breakout's actions.
const ACTIONS: usize = 4;
/// The seed of the models and the data every replica draws alike.
const SEED: u64 = 7;
/// The LLM workload's sequences: a prompt about as long as TicTacToe's
/// compact board, and a move of `text.max_turn_tokens`.
const PROMPT_TOKENS: usize = 64;
const MOVE_TOKENS: usize = 8;
/// The largest gap to the lone learner's parameters the bench accepts.
/// Adam moves a parameter by about its learning rate whatever the
/// gradient's size, so where a gradient is near zero the last-bit
/// differences of the sums can flip a step's sign: the gap grows by up to
/// twice the learning rate a step (NatureCNN PPO: 7.7e-4 after 64 steps at
/// 2.5e-4), while different batches or a lost share move every parameter.
const MAX_GAP: f32 = 1e-2;

/// What one replica process reports (its last line of stdout).
#[derive(Debug, serde::Serialize, serde::Deserialize)]
struct ReplicaReport {
    rank: usize,
    /// Seconds of each timed step.
    seconds: Vec<f64>,
    /// Seconds in all-reduces over the timed steps, and bytes summed.
    allreduce_seconds: f64,
    allreduce_bytes: u64,
    /// SHA-256 of the parameters after the last step.
    digest: String,
}

/// A replica's model, optimizer and data (one per bench process: the
/// variants' sizes do not matter).
#[allow(clippy::large_enum_variant)]
enum Trainer {
    Ppo {
        model: ActorCritic,
        optimizer: Optimizer,
        rollout: Rollout,
        cfg: relay_config::PpoConfig,
    },
    Sac {
        sac: relay_nn::Sac,
        optimizers: relay_nn::SacOptimizers,
        step: relay_nn::SacConfig,
        target_update_interval: u64,
        batches: Vec<TransitionBatch>,
    },
    Grpo {
        model: Box<relay_llm::CausalLm>,
        adapter: relay_llm::LoraAdapter,
        trainer: Box<relay_llm::RlTrainer>,
        examples: Vec<relay_llm::TokenExample>,
        epochs: usize,
    },
}

impl Trainer {
    fn new(workload: Workload, cfg: &ExperimentConfig) -> Result<Self> {
        if workload == Workload::PpoNaturecnn && cfg.run.algo != relay_config::Algo::Ppo {
            bail!("the ppo-naturecnn workload trains PPO");
        }
        Ok(match workload {
            Workload::PpoNaturecnn => {
                let spec = crate::bench_cnn_step::nature_cnn_spec(ACTIONS);
                let model = ActorCritic::new(&spec, SEED)?;
                let optimizer = Optimizer::for_run(cfg, model.vars())?;
                let rollout = rollout(&model, cfg.ppo.rollout_steps)?;
                Self::Ppo {
                    model,
                    optimizer,
                    rollout,
                    cfg: cfg.ppo.clone(),
                }
            }
            Workload::Sac => {
                let s = &cfg.sac;
                let spec = relay_policy::sac_spec_for(cfg).map_err(anyhow::Error::msg)?;
                let step =
                    relay_algo::sac::step_config(s, spec.action_dim(), s.learning_rate.value(0.0))?;
                let sac = relay_nn::Sac::new(&spec, relay_algo::sac::initial_ent_coef(s)?, SEED)?;
                let optimizers = relay_nn::SacOptimizers::new(&sac, &step)?;
                let batches = (0..s.gradient_steps)
                    .map(|i| transitions(&spec, s.batch_size, SEED + i as u64))
                    .collect();
                Self::Sac {
                    sac,
                    optimizers,
                    step,
                    target_update_interval: s.target_update_interval,
                    batches,
                }
            }
            Workload::GrpoSmollm2 => {
                let spec = cfg.llm.model.as_deref().context("llm.model")?;
                let backend = relay_llm::Backend::open(&cfg.llm.backend_spec())?;
                let (model, _) =
                    relay_llm::load_causal_lm_on(spec, relay_llm::GgufBase::Dequantized, &backend)?;
                let lora = cfg.lora.lora_config()?;
                let adapter = relay_llm::LoraAdapter::new(model.config(), lora, cfg.lora.seed)?;
                let adapter = model.place_adapter(&adapter)?;
                let train = cfg.rl.train_config(cfg.text.max_turn_tokens as usize)?;
                let trainer = relay_llm::RlTrainer::new(train, &adapter)?;
                let vocab = model.config().vocab_size as u32;
                let examples = token_examples(cfg.rl.batch_size, vocab);
                Self::Grpo {
                    model: Box::new(model),
                    adapter,
                    trainer: Box::new(trainer),
                    examples,
                    epochs: cfg.rl.epochs,
                }
            }
        })
    }

    /// One step (a PPO update, or a SAC round) at `progress` of the run.
    fn step(
        &mut self,
        progress: f64,
        rng: &mut rand_chacha::ChaCha8Rng,
        sync: &mut BatchShare<'_>,
    ) -> Result<()> {
        match self {
            Self::Ppo {
                model,
                optimizer,
                rollout,
                cfg,
            } => {
                relay_algo::ppo::update(model, optimizer, rollout, cfg, progress, rng, sync)?;
            }
            Self::Sac {
                sac,
                optimizers,
                step,
                target_update_interval,
                batches,
            } => {
                for (i, batch) in batches.iter().enumerate() {
                    step.update_target = (i as u64).is_multiple_of(*target_update_interval);
                    relay_algo::sac::gradient_step(
                        step,
                        sac,
                        optimizers,
                        batch,
                        rng,
                        &relay_nn::Pair::sequential(),
                        sync,
                    )?;
                }
            }
            Self::Grpo {
                model,
                adapter,
                trainer,
                examples,
                epochs,
            } => {
                trainer.train_epochs_part(model, adapter, examples, *epochs, sync)?;
            }
        }
        Ok(())
    }

    fn parameters(&self) -> Vec<relay_nn::NamedTensor> {
        match self {
            Self::Ppo { model, .. } => model.named_tensors(),
            Self::Sac { sac, .. } => sac.named_tensors(),
            Self::Grpo { adapter, .. } => adapter
                .named_values()
                .expect("an adapter's factors read back"),
        }
    }
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
        masks: Vec::new(),
        mask_width: 0,
        len: n,
        vec_steps: n as u64,
        oldest_version: 0,
        sequences: None,
    })
}

/// `n` sequences of [`PROMPT_TOKENS`] + [`MOVE_TOKENS`] tokens below
/// `vocab`, in groups of 4 with rewards 0, 1 or 2 (GRPO's advantages are
/// the rewards against their group's).
fn token_examples(n: usize, vocab: u32) -> Vec<relay_llm::TokenExample> {
    let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(SEED);
    (0..n)
        .map(|i| relay_llm::TokenExample {
            prompt: (0..PROMPT_TOKENS)
                .map(|_| r.random_range(3..vocab))
                .collect(),
            completion: (0..MOVE_TOKENS).map(|_| r.random_range(3..vocab)).collect(),
            behaviour_logprobs: vec![-6.0; MOVE_TOKENS],
            reward: (i % 3) as f64,
            group: (i / 4) as u64,
            stratum: 0,
        })
        .collect()
}

/// `b` random transitions of the env `spec` describes (actions within its
/// bounds, one in five terminal), drawn from `seed`.
fn transitions(spec: &relay_nn::SacSpec, b: usize, seed: u64) -> TransitionBatch {
    use relay_proto::Tensor as Wire;
    let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let (d, a) = (spec.obs_dim, spec.action_dim());
    let mut uniform =
        |k: usize| -> Vec<f32> { (0..k).map(|_| r.random_range(-1.0..1.0)).collect() };
    let (obs, next, rewards) = (uniform(b * d), uniform(b * d), uniform(b));
    let actions: Vec<f32> = uniform(b * a)
        .iter()
        .enumerate()
        .map(|(i, u)| {
            let (lo, hi) = (spec.low[i % a], spec.high[i % a]);
            lo + (u + 1.0) / 2.0 * (hi - lo)
        })
        .collect();
    let discounts: Vec<f32> = (0..b)
        .map(|i| if i % 5 == 0 { 0.0 } else { 0.99 })
        .collect();
    TransitionBatch {
        schema: relay_proto::SCHEMA_VERSION,
        ids: (0..b as u64).collect(),
        obs: Wire::from_f32(&[b, d], &obs),
        actions: Wire::from_f32(&[b, a], &actions),
        rewards: Wire::from_f32(&[b], &rewards),
        next_obs: Wire::from_f32(&[b, d], &next),
        discounts: Wire::from_f32(&[b], &discounts),
        terminated: Wire::from_bool(&[b], &vec![false; b]),
        truncated: Wire::from_bool(&[b], &vec![false; b]),
        weights: Wire::from_f32(&[b], &vec![1.0; b]),
        weight_scale: None,
        size: b as u64,
        inserted_steps: b as u64,
        next_masks: None,
    }
}

/// One replica process: joins the group, trains `updates + 1` steps with
/// its share of each minibatch, writes its parameters to `PARAMS_OUT`
/// (MessagePack) and prints its report.
fn run_replica(spec: &str, args: &BenchLearnersArgs) -> Result<()> {
    let parts: Vec<&str> = spec.splitn(6, ',').collect();
    let [id, replicas, nats_url, group_name, workload, params_out] = parts[..] else {
        bail!("--replica {spec:?}: ID,REPLICAS,NATS_URL,GROUP,WORKLOAD,PARAMS_OUT");
    };
    let (id, replicas): (usize, usize) = (id.parse()?, replicas.parse()?);
    let workload = <Workload as clap::ValueEnum>::from_str(workload, false)
        .map_err(|e| anyhow::anyhow!("--replica workload: {e}"))?;
    let cfg = workload.config(&args.configs_dir, &args.overrides)?;
    let updates = args.updates;
    let mut trainer = Trainer::new(workload, &cfg)?;
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
        let reduced = match joined.as_mut() {
            Some((group, view)) => {
                let _entered = runtime.enter();
                let (stepped, summed) = relay_replicas::in_group(group, view, tag, None, |share| {
                    trainer.step(progress, &mut rng, share)
                });
                stepped?;
                if let Some(broken) = summed.broken {
                    bail!("a replica failed inside the step: {broken}");
                }
                tag = summed.next_tag;
                summed.reduced
            }
            None => {
                trainer.step(progress, &mut rng, &mut BatchShare::whole())?;
                Default::default()
            }
        };
        if update > 0 {
            seconds.push(started.elapsed().as_secs_f64());
            allreduce_seconds += reduced.seconds;
            allreduce_bytes += reduced.bytes;
        }
    }
    let parameters = trainer.parameters();
    let digest = relay_replicas::digest(&parameters);
    if rank == 0 {
        std::fs::write(params_out, rmp_serde::to_vec(&parameters)?)?;
    }
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
    /// Median seconds of one step (rank 0's).
    step_seconds: f64,
    samples_per_s: f64,
    /// The speedup the machine allows this many learners: as many lone
    /// learners run at once, the lone learner's step over the slowest
    /// one's, times their number (none for 1, or without a lone row).
    ceiling: Option<f64>,
    allreduce_seconds_per_step: f64,
    allreduce_mb_per_step: f64,
    /// The gap to the lone learner's parameters (none without one).
    gap: Option<f32>,
}

pub fn bench_learners(args: BenchLearnersArgs) -> Result<()> {
    if let Some(spec) = &args.replica {
        return run_replica(spec, &args);
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
    let cpu = format!("{} ({})", crate::cpu_name(), crate::cpu_simd());
    let mut json_workloads = Vec::new();
    for &workload in &args.workloads {
        let cfg = workload.config(&args.configs_dir, &args.overrides)?;
        let rows = bench_workload(&args, workload, &cfg, &stack.nats_url)?;
        let base = rows
            .iter()
            .find(|r| r.replicas == 1)
            .map(|r| r.samples_per_s);
        println!(
            "{} {}, each replica a process of 1 thread; {cpu}",
            workload.name(),
            workload.describe(&cfg),
        );
        println!("| replicas | step (median) | samples/s | speedup | ceiling (as many lone learners at once) | all-reduce per step | summed per step | gap to 1 learner |");
        println!("|---:|---:|---:|---:|---:|---:|---:|---:|");
        let mut json_rows = Vec::new();
        for r in &rows {
            let speedup = base.map(|b| r.samples_per_s / b);
            println!(
                "| {} | {:.3} s | {:.0} | {} | {} | {:.4} s | {:.2} MB | {} |",
                r.replicas,
                r.step_seconds,
                r.samples_per_s,
                speedup.map_or("-".into(), |s| format!("{s:.2}x")),
                r.ceiling.map_or("-".into(), |s| format!("{s:.2}x")),
                r.allreduce_seconds_per_step,
                r.allreduce_mb_per_step,
                r.gap.map_or("-".into(), |g| format!("{g:.1e}")),
            );
            json_rows.push(serde_json::json!({
                "replicas": r.replicas,
                "step_seconds": r.step_seconds,
                "samples_per_s": r.samples_per_s,
                "speedup": speedup,
                "ceiling": r.ceiling,
                "allreduce_seconds_per_step": r.allreduce_seconds_per_step,
                "allreduce_bytes_per_step": r.allreduce_mb_per_step * 1e6,
                "gap": r.gap,
            }));
        }
        println!();
        json_workloads.push(serde_json::json!({"workload": workload.name(), "rows": json_rows}));
    }
    drop(stack);
    println!(
        "{}",
        serde_json::json!({"bench": "learners", "cpu": cpu, "updates": args.updates, "workloads": json_workloads})
    );
    Ok(())
}

/// Runs `workload` with each replica count: the rows of its table.
fn bench_workload(
    args: &BenchLearnersArgs,
    workload: Workload,
    cfg: &ExperimentConfig,
    nats_url: &str,
) -> Result<Vec<Row>> {
    let samples_per_step = workload.samples_per_step(cfg);
    let mut alone: Option<Vec<relay_nn::NamedTensor>> = None;
    let mut rows = Vec::new();
    for &n in &args.replicas {
        let group = format!(
            "bench-learners-{}-{n}-{}",
            workload.name(),
            std::process::id()
        );
        let params_out = args.state_dir.join(format!("{group}.params"));
        let reports = run_processes(args, workload, nats_url, &group, n, n)?;
        if reports.iter().any(|r| r.digest != reports[0].digest) {
            bail!(
                "{}: {n} replicas ended with different parameters",
                workload.name()
            );
        }
        let parameters: Vec<relay_nn::NamedTensor> =
            rmp_serde::from_slice(&std::fs::read(&params_out)?)?;
        let _ = std::fs::remove_file(&params_out);
        let gap = match &alone {
            Some(alone) if n > 1 => Some(gap(&parameters, alone)?),
            _ => None,
        };
        if let Some(gap) = gap.filter(|&g| g.is_nan() || g > MAX_GAP) {
            bail!(
                "{}: {n} replicas ended {gap:e} from the lone learner's parameters (at most {MAX_GAP:e} is the order of the sums)",
                workload.name()
            );
        }
        if n == 1 {
            alone = Some(parameters);
        }
        let lead = reports.iter().find(|r| r.rank == 0).context("no rank 0")?;
        let step_seconds = median(&lead.seconds);
        // The machine's own ceiling: as many lone learners at once, with
        // nothing summed. Replicas in lockstep go at the slowest one's pace.
        let lone_step = rows
            .iter()
            .find(|r: &&Row| r.replicas == 1)
            .map(|r| r.step_seconds);
        let ceiling = match lone_step {
            Some(lone_step) if n > 1 => {
                let copies =
                    run_processes(args, workload, nats_url, &format!("{group}-lone"), n, 1)?;
                let slowest = copies
                    .iter()
                    .map(|r| median(&r.seconds))
                    .fold(0.0, f64::max);
                Some(n as f64 * lone_step / slowest)
            }
            _ => None,
        };
        rows.push(Row {
            replicas: n,
            step_seconds,
            samples_per_s: samples_per_step / step_seconds,
            ceiling,
            allreduce_seconds_per_step: lead.allreduce_seconds / lead.seconds.len() as f64,
            allreduce_mb_per_step: lead.allreduce_bytes as f64 / 1e6 / lead.seconds.len() as f64,
            gap,
        });
    }
    Ok(rows)
}

/// The median of `values`.
fn median(values: &[f64]) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    sorted[sorted.len() / 2]
}

/// Runs `processes` bench processes of `workload` at once, in groups of
/// `replicas` (1: each a lone learner), and returns their reports; rank
/// 0 of each group writes its parameters to `<group>[-<copy>].params`.
fn run_processes(
    args: &BenchLearnersArgs,
    workload: Workload,
    nats_url: &str,
    group: &str,
    processes: usize,
    replicas: usize,
) -> Result<Vec<ReplicaReport>> {
    let exe = std::env::current_exe()?;
    let mut children = Vec::new();
    for id in 0..processes {
        let name = if replicas == processes {
            group.to_string()
        } else {
            format!("{group}-{id}")
        };
        let params_out = args.state_dir.join(format!("{name}.params"));
        let child = Command::new(&exe)
            .arg("bench-learners")
            .arg("--configs-dir")
            .arg(&args.configs_dir)
            .args(args.overrides.iter().flat_map(|o| ["--set", o]))
            .args(["--updates", &args.updates.to_string()])
            .arg("--replica")
            .arg(format!(
                "{id},{replicas},{nats_url},{name},{},{}",
                workload.name(),
                params_out.display()
            ))
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
            bail!(
                "{}: a process of {processes} failed ({}): {stdout}",
                workload.name(),
                out.status
            );
        }
        let last = stdout.lines().last().unwrap_or_default();
        reports.push(serde_json::from_str::<ReplicaReport>(last)?);
    }
    if replicas != processes {
        for id in 0..processes {
            let _ = std::fs::remove_file(args.state_dir.join(format!("{group}-{id}.params")));
        }
    }
    Ok(reports)
}

/// max |a - b| / (1 + |b|) over every parameter of `a` against `b`.
fn gap(a: &[relay_nn::NamedTensor], b: &[relay_nn::NamedTensor]) -> Result<f32> {
    if a.len() != b.len() || a.iter().zip(b).any(|(x, y)| x.0 != y.0 || x.1 != y.1) {
        bail!("the replicas' parameters are not the lone learner's tensors");
    }
    Ok(a.iter()
        .zip(b)
        .flat_map(|(x, y)| x.2.iter().zip(&y.2))
        .map(|(x, y)| (x - y).abs() / (1.0 + y.abs()))
        .fold(0f32, f32::max))
}
