//! `relay-bench bench-cnn-step`: one PPO train step of SB3's Atari
//! `CnnPolicy` (NatureCNN on 4 x 84 x 84 frames, 6 actions, 1.69M
//! parameters) at `--batch` samples, on `--device`, checked against the
//! fused CPU path and timed.
//!
//! The step is what the learner runs per minibatch: `evaluate`, the PPO
//! loss (clipped surrogate, clipped value, entropy), global gradient-norm
//! clipping and an Adam update. Each run draws a fresh model, frames,
//! actions and advantages (the seed is printed, `--seed` repeats it).
//!
//! - check: the first step on the device against the same step on the CPU's
//!   fused path: loss, gradient norm and every parameter after the update,
//!   as relative gaps (the run fails above `--tolerance`);
//! - speed: `--steps` further steps on the device, after one warm-up
//!   step, then steps/s and samples/s (the device is synchronised by the
//!   loss read-back that ends every step).
//!
//! `--device cuda` (a `cuda` build on a GPU), `cpu` (the fused kernels) or
//! `composed-cpu` (the GPU's code path on the CPU: the GPU check's dry run).
//! PyTorch's anchor for the same step is `services/bench/hf/cnn_step_anchor.py`.

use std::time::Instant;

use anyhow::{bail, Context, Result};
use candle_core::{Device, Tensor};
use rand::{Rng, SeedableRng};
use relay_nn::ops::composed_on_cpu;
use relay_nn::{
    clip_grad_norm, ppo_loss, ActorCritic, Adam, AdamConfig, CnnSpec, PolicySpec, PpoInputs,
    PpoLossConfig,
};

/// `relay-bench bench-cnn-step` flags.
#[derive(Debug, clap::Args)]
pub struct BenchCnnStepArgs {
    /// `cuda` (cuda:0), `cpu` or `composed-cpu`.
    #[arg(long, default_value = "cuda")]
    pub device: String,
    /// Samples per step (SB3's Atari PPO minibatch is 256).
    #[arg(long, default_value_t = 256)]
    pub batch: usize,
    /// Timed steps after the checked one and a warm-up.
    #[arg(long, default_value_t = 20)]
    pub steps: usize,
    /// Largest relative gap allowed between the device's step and the CPU's.
    #[arg(long, default_value_t = 1e-3)]
    pub tolerance: f32,
    /// The random draw (default: from the clock).
    #[arg(long)]
    pub seed: Option<u64>,
}

const ACTIONS: usize = 6;

/// SB3's Atari `CnnPolicy`: NatureCNN on 4 stacked 84 x 84 frames, no MLP
/// after it, `actions` discrete actions.
pub fn nature_cnn_spec(actions: usize) -> PolicySpec {
    let mut spec = PolicySpec::discrete(4 * 84 * 84, actions);
    spec.hidden = vec![];
    spec.cnn = Some(CnnSpec {
        input: [4, 84, 84],
        ..CnnSpec::default()
    });
    spec
}

/// A minibatch as the learner builds one.
struct Minibatch {
    obs: Vec<f32>,
    actions: Vec<u32>,
    old_logprob: Vec<f32>,
    old_values: Vec<f32>,
    advantages: Vec<f32>,
    returns: Vec<f32>,
}

fn minibatch(n: usize, seed: u64) -> Minibatch {
    let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let mut uniform = |lo: f32, hi: f32, k: usize| -> Vec<f32> {
        (0..k).map(|_| r.random_range(lo..hi)).collect()
    };
    let obs = uniform(0.0, 255.0, n * 4 * 84 * 84)
        .into_iter()
        .map(f32::floor)
        .collect();
    let old_logprob = uniform(-2.2, -1.4, n);
    let old_values = uniform(-0.5, 0.5, n);
    let advantages = uniform(-1.0, 1.0, n);
    let returns = uniform(-1.0, 1.0, n);
    let actions = uniform(0.0, ACTIONS as f32, n)
        .into_iter()
        .map(|a| a as u32)
        .collect();
    Minibatch {
        obs,
        actions,
        old_logprob,
        old_values,
        advantages,
        returns,
    }
}

/// One learner minibatch step; returns the loss and the pre-clip gradient norm.
fn step(model: &ActorCritic, opt: &mut Adam, b: &Minibatch) -> Result<(f32, f32)> {
    let n = b.actions.len();
    let device = model.device();
    let obs = Tensor::from_slice(&b.obs, (n, model.spec().obs_dim), device)?;
    let actions = Tensor::from_slice(&b.actions, n, device)?;
    let (logprob, entropy, values) = model.evaluate(&obs, &actions)?;
    let loss = ppo_loss(
        &PpoLossConfig {
            ent_coef: 0.01,
            clip_range: 0.1,
            clip_range_vf: Some(0.1),
            ..Default::default()
        },
        &PpoInputs {
            logprob: &logprob,
            entropy: &entropy,
            values: &values,
            old_logprob: &b.old_logprob,
            old_values: &b.old_values,
            advantages: &b.advantages,
            returns: &b.returns,
        },
    )?;
    let mut grads = loss.loss.backward()?;
    let norm = clip_grad_norm(&mut grads, opt.vars(), 0.5)?;
    opt.step(&grads)?;
    Ok((loss.stats.loss, norm))
}

fn largest_gap(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs() / (1.0 + y.abs()))
        .fold(0f32, f32::max)
}

fn parameters(model: &ActorCritic) -> Vec<f32> {
    model
        .named_tensors()
        .into_iter()
        .flat_map(|(_, _, d)| d)
        .collect()
}

pub fn bench_cnn_step(args: BenchCnnStepArgs) -> Result<()> {
    let composed = match args.device.as_str() {
        "composed-cpu" => true,
        "cpu" | "cuda" => false,
        other => bail!("--device {other:?}: give `cuda`, `cpu` or `composed-cpu`"),
    };
    let device = if args.device == "cuda" {
        relay_nn::open_device(relay_nn::DeviceSpec::Cuda(0)).context("--device cuda")?
    } else {
        Device::Cpu
    };
    let seed = args.seed.unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0)
    });
    let spec = nature_cnn_spec(ACTIONS);
    let config = AdamConfig {
        lr: 2.5e-4,
        ..Default::default()
    };
    let batch = minibatch(args.batch, seed);
    let on_path = |f: &mut dyn FnMut() -> Result<(f32, f32)>| {
        if composed {
            composed_on_cpu(f)
        } else {
            f()
        }
    };

    // The reference: the fused CPU path.
    let reference = ActorCritic::new(&spec, seed)?;
    let mut reference_opt = Adam::new(reference.vars(), config)?;
    let (ref_loss, ref_norm) = step(&reference, &mut reference_opt, &batch)?;

    let model = ActorCritic::new(&spec, seed)?.to_device(&device)?;
    let mut opt = if composed {
        composed_on_cpu(|| Adam::new(model.vars(), config))?
    } else {
        Adam::new(model.vars(), config)?
    };
    let (loss, norm) = on_path(&mut || step(&model, &mut opt, &batch))?;
    let loss_gap = largest_gap(&[loss], &[ref_loss]);
    let norm_gap = largest_gap(&[norm], &[ref_norm]);
    let param_gap = largest_gap(&parameters(&model), &parameters(&reference));
    let passed = loss.is_finite()
        && loss_gap <= args.tolerance
        && norm_gap <= args.tolerance
        && param_gap <= args.tolerance;

    // Speed: one warm-up step, then the timed ones.
    on_path(&mut || step(&model, &mut opt, &batch))?;
    let started = Instant::now();
    for _ in 0..args.steps {
        on_path(&mut || step(&model, &mut opt, &batch))?;
    }
    let seconds = started.elapsed().as_secs_f64();
    let steps_per_s = args.steps as f64 / seconds;
    let samples_per_s = steps_per_s * args.batch as f64;

    let cpu = format!("{} ({})", crate::cpu_name(), crate::cpu_simd());
    println!(
        "NatureCNN PPO step (4x84x84, {ACTIONS} actions, {} parameters), batch {}, seed {seed}",
        model.num_parameters(),
        args.batch
    );
    println!("| device | loss gap | grad-norm gap | parameter gap | steps/s | samples/s |");
    println!("|---|---:|---:|---:|---:|---:|");
    println!(
        "| {} | {loss_gap:.1e} | {norm_gap:.1e} | {param_gap:.1e} | {steps_per_s:.2} | {samples_per_s:.0} |",
        args.device
    );
    println!(
        "{}",
        serde_json::json!({
            "bench": "cnn-step",
            "device": args.device,
            "cpu": cpu,
            "batch": args.batch,
            "seed": seed,
            "parameters": model.num_parameters(),
            "loss": loss,
            "reference_loss": ref_loss,
            "loss_gap": loss_gap,
            "grad_norm_gap": norm_gap,
            "parameter_gap": param_gap,
            "tolerance": args.tolerance,
            "check": if passed { "passed" } else { "failed" },
            "steps": args.steps,
            "steps_per_s": steps_per_s,
            "samples_per_s": samples_per_s,
        })
    );
    if !passed {
        bail!(
            "the {} step differs from the CPU's: loss {loss} vs {ref_loss} (gap {loss_gap:.1e}), \
             grad norm gap {norm_gap:.1e}, parameter gap {param_gap:.1e}; tolerance {:.1e}",
            args.device,
            args.tolerance
        );
    }
    Ok(())
}
