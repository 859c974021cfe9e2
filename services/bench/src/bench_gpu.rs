//! `relay bench-gpu` (`just bench-gpu`): SmolLM2-135M-Instruct on each
//! inference backend, in one run: the CPU engine, the candle backend on
//! the CPU (f32), and, in a `cuda` build on a machine with an NVIDIA GPU,
//! the candle backend on `cuda:0` in bf16.
//!
//! For each backend and batch size B: B sequences of a TicTacToe prompt
//! (each a different board) generate `--new-tokens` tokens each through
//! [`relay_llm::step`] (continuous batching, sampling at temperature 1,
//! no stop token), timed from the first prefill to the last token:
//! completion tokens per second. One untimed generate at B = 1 comes first
//! on each backend (as transformers' anchor warms up), so that no timed
//! row pays for loading the GPU's kernel modules or their first JIT
//! compilation; its time is reported apart. Then the LoRA training step (forward and
//! backward of a rank-8 adapter on every projection, `--train-batch` x
//! `--train-len` tokens: the fused CPU ops on the engine, the composed
//! forward with activations recomputed on the candle backend), the longest
//! sequence one step trains at `--longest-batch` (`--longest`, a search that
//! stops at the first failure, out of memory say, or before a length that
//! would overrun `--longest-seconds`), and the load time of one
//! adapter version
//! (PEFT bytes parsed and placed on the backend's device). Without a GPU
//! the run says so and measures the CPU backends. A table, then one JSON
//! line. `--model` measures another model (a Hugging Face folder, e.g. a
//! random-weight one with a real config made where the GPU is), and
//! `--backends` a subset of the backends.

use std::time::Instant;

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device};
use relay_llm::{
    Backend, CausalLm, GgufBase, LoraAdapter, LoraConfig, Sampler, SamplingParams, Sequence,
    StopCondition,
};

/// `relay bench-gpu` flags.
#[derive(Debug, clap::Args)]
pub struct BenchGpuArgs {
    /// Batch sizes (sequences decoded together), comma-separated.
    #[arg(long, default_value = "1,8,32,64", value_delimiter = ',')]
    pub batches: Vec<usize>,
    /// Tokens each sequence generates.
    #[arg(long, default_value_t = 32)]
    pub new_tokens: usize,
    /// Sequences in the training step's batch.
    #[arg(long, default_value_t = 8)]
    pub train_batch: usize,
    /// Tokens of each training sequence (half prompt, half completion).
    #[arg(long, default_value_t = 128)]
    pub train_len: usize,
    /// Sequence lengths to try, in order, for the longest that trains at
    /// `--longest-batch` sequences (one step with activations recomputed;
    /// the first that fails, out of memory say, ends the search). Empty:
    /// no search.
    #[arg(long, value_delimiter = ',')]
    pub longest: Vec<usize>,
    /// Sequences per step of the `--longest` search.
    #[arg(long, default_value_t = 4)]
    pub longest_batch: usize,
    /// Seconds the `--longest` search may take: a length is not tried when
    /// the search has run this long, or would by the end of it, reckoning
    /// four times the last length's time (twice the tokens, and attention
    /// quadratic in them). Unset: no limit. The GPU check sets it, so that
    /// its step's timeout never cuts the run short of its results.
    #[arg(long)]
    pub longest_seconds: Option<f64>,
    /// The model: `smollm2`, a Hugging Face folder (a random-weight one made
    /// on a GPU machine by transformers, say) or a `.gguf` file.
    #[arg(long, default_value = "smollm2")]
    pub model: String,
    /// Backends to measure, of `engine`, `candle-cpu` and `cuda`
    /// (comma-separated; default: all this build and machine have). `cuda`
    /// named where it does not open is an error.
    #[arg(long, value_delimiter = ',')]
    pub backends: Vec<String>,
}

/// The names `--backends` takes, in the order the run measures them.
const BACKEND_NAMES: [&str; 3] = ["engine", "candle-cpu", "cuda"];

/// One backend of the run.
struct Contender {
    /// Its `--backends` name.
    key: &'static str,
    name: String,
    backend: Backend,
}

/// The backends this build and machine have: the CPU ones always, CUDA
/// when built with it and a GPU opens.
fn contenders() -> (Vec<Contender>, String) {
    let mut all = vec![
        Contender {
            key: "engine",
            name: "engine (cpu, f32)".into(),
            backend: Backend::Engine,
        },
        Contender {
            key: "candle-cpu",
            name: "candle (cpu, f32)".into(),
            backend: Backend::Candle {
                device: Device::Cpu,
                dtype: DType::F32,
            },
        },
    ];
    let gpu = if !relay_llm::CUDA_BUILT {
        "no GPU measured: this build has no `cuda` feature (`just build-cuda`)".to_string()
    } else {
        match relay_llm::open_device(relay_llm::DeviceSpec::Cuda(0)) {
            Ok(device) => {
                all.push(Contender {
                    key: "cuda",
                    name: "candle (cuda:0, bf16)".into(),
                    backend: Backend::Candle {
                        device,
                        dtype: DType::BF16,
                    },
                });
                "cuda:0".to_string()
            }
            Err(e) => format!("no GPU measured: cuda:0 does not open ({e})"),
        }
    };
    (all, gpu)
}

/// One backend's measurements.
struct Row {
    name: String,
    /// The untimed first generate (B = 1): module loading and JIT included.
    warm_up_s: f64,
    /// `(batch, tokens/s)` for each `--batches`.
    generate_tps: Vec<(usize, f64)>,
    train_tps: f64,
    load_s: f64,
    /// The longest T trained at `--longest-batch`, and why the next failed.
    longest: (Option<usize>, Option<String>),
}

/// A TicTacToe prompt with board `k` (so sequences differ).
fn prompt(tokenizer: &relay_llm::Tokenizer, k: usize) -> Result<Vec<u32>> {
    let cells: String = (0..9)
        .map(|i| match (k >> i) % 3 {
            0 => " ",
            1 => "X",
            _ => "O",
        })
        .map(|c| format!("[{c}]"))
        .collect();
    let text = format!(
        "You are playing TicTacToe as X. The board, row by row: {cells}. \
         Answer with the cell you play, as [0] to [8]."
    );
    tokenizer
        .encode(&text, false)
        .context("tokenizing the prompt")
}

/// Prompt length where the model has no tokenizer (about a TicTacToe prompt's).
const SYNTHETIC_PROMPT_TOKENS: usize = 48;

/// Prompt `k` of token ids for a model without a tokenizer: distinct for
/// each `k`, spread over the vocabulary.
fn synthetic_prompt(vocab: usize, k: usize) -> Vec<u32> {
    (0..SYNTHETIC_PROMPT_TOKENS)
        .map(|i| ((k * 7919 + i * 104_729 + 1) % vocab.max(1)) as u32)
        .collect()
}

/// Completion tokens per second of `batch` sequences generating `new_tokens` each.
pub(crate) fn generate(model: &CausalLm, prompts: &[Vec<u32>], new_tokens: usize) -> Result<f64> {
    let stop = StopCondition {
        max_new_tokens: new_tokens,
        stop_token_ids: Vec::new(),
    };
    let mut running: Vec<Sequence> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let sampler = Sampler::new(SamplingParams::default(), i as u64)?;
            Sequence::new(model, p.clone(), None, sampler, stop.clone())
        })
        .collect::<relay_llm::model_error::Result<_>>()?;
    let started = Instant::now();
    let mut tokens = 0usize;
    while running.iter().any(|s| !s.is_finished()) {
        let mut refs: Vec<&mut Sequence> =
            running.iter_mut().filter(|s| !s.is_finished()).collect();
        tokens += relay_llm::step(model, &mut refs)?
            .into_iter()
            .flatten()
            .count();
    }
    Ok(tokens as f64 / started.elapsed().as_secs_f64())
}

/// Tokens per second of one LoRA training step (forward and backward,
/// activations recomputed where the backend does that) on `batch`
/// sequences of `time` tokens, half prompt and half completion (the loss
/// on the completion), as an RL or SFT step trains.
fn train_step(model: &CausalLm, adapter: &LoraAdapter, batch: usize, time: usize) -> Result<f64> {
    let vocab = model.config().vocab_size.clamp(1, 20_000);
    let rows: Vec<Vec<u32>> = (0..batch)
        .map(|b| {
            (0..time)
                .map(|i| ((b * time + i) * 7919 % vocab) as u32)
                .collect()
        })
        .collect();
    let half = time / 2;
    let pairs: Vec<(&[u32], &[u32])> = rows.iter().map(|r| r.split_at(half)).collect();
    let tokens = relay_llm::TokenBatch::new(&pairs, model.device())?;
    let adapter = model.place_adapter(adapter)?;
    let run = || -> Result<()> {
        let forward = model.forward_train_for_backward(&tokens, Some(&adapter), true)?;
        let loss = relay_llm::token_log_probs(forward.logits(), &tokens.targets)?
            .mean_all()?
            .neg()?;
        let grads = forward.backward(&loss)?;
        // On a GPU the step is asynchronous: wait for its last gradient.
        if let Some(g) = adapter
            .vars()
            .first()
            .and_then(|v| grads.get(v.as_tensor()))
        {
            g.sum_all()?.to_device(&Device::Cpu)?;
        }
        Ok(())
    };
    run()?; // warm-up
    let started = Instant::now();
    run()?;
    Ok((batch * time) as f64 / started.elapsed().as_secs_f64())
}

/// The longest of `lengths` (tried in order) that one training step at
/// `batch` sequences goes through within `seconds`, and why the next was
/// not tried or did not go through.
fn longest_trained(
    model: &CausalLm,
    adapter: &LoraAdapter,
    batch: usize,
    lengths: &[usize],
    seconds: Option<f64>,
) -> (Option<usize>, Option<String>) {
    let mut longest = None;
    let search = Instant::now();
    let mut last_try_s = 0.0;
    for &time in lengths {
        if let Some(limit) = seconds {
            let spent = search.elapsed().as_secs_f64();
            if spent + 4.0 * last_try_s > limit {
                let why = format!(
                    "T={time}: not tried, the search's {limit:.0} s would run out \
                     ({spent:.1} s spent, the last length took {last_try_s:.1} s)"
                );
                println!("  train B={batch} {why}");
                return (longest, Some(why));
            }
        }
        let started = Instant::now();
        let outcome = train_step(model, adapter, batch, time);
        last_try_s = started.elapsed().as_secs_f64();
        match outcome {
            Ok(tps) => {
                println!("  train B={batch} T={time}: {tps:.1} tokens/s");
                longest = Some(time);
            }
            Err(e) => {
                let why = format!("T={time}: {e:#}");
                println!("  train B={batch} {why}");
                return (longest, Some(why));
            }
        }
    }
    (longest, None)
}

/// Seconds to parse one adapter version from its PEFT bytes and place it.
fn adapter_load(model: &CausalLm, bytes: &relay_llm::PeftBytes) -> Result<f64> {
    let started = Instant::now();
    let adapter =
        LoraAdapter::from_peft_bytes(&bytes.config_json, &bytes.safetensors, model.config())?;
    let placed = model.place_frozen_adapter(&adapter)?;
    // On a GPU the copy is asynchronous: wait for it.
    if let Some(w) = placed.named_vars().first() {
        w.1.as_tensor().to_device(&Device::Cpu)?;
    }
    Ok(started.elapsed().as_secs_f64())
}

/// `relay bench-gpu`.
pub fn bench_gpu(args: BenchGpuArgs) -> Result<()> {
    let (mut contenders, gpu) = contenders();
    if !args.backends.is_empty() {
        for name in &args.backends {
            if !BACKEND_NAMES.contains(&name.as_str()) {
                bail!("--backends: unknown backend {name:?} (one of {BACKEND_NAMES:?})");
            }
            if !contenders.iter().any(|c| c.key == name) {
                bail!("--backends {name}: not available here ({gpu})");
            }
        }
        contenders.retain(|c| args.backends.iter().any(|b| b == c.key));
    }
    println!("relay bench-gpu: {gpu}; model {}", args.model);
    let (base, path) = relay_llm::load_causal_lm(&args.model, GgufBase::Dequantized)
        .with_context(|| format!("--model {}", args.model))?;
    let max_batch = args.batches.iter().copied().max().unwrap_or(1);
    // A random-weight checkpoint has no tokenizer: its prompts are token ids.
    let prompts: Vec<Vec<u32>> = match relay_llm::load_tokenizer(&path) {
        Ok(tokenizer) => (0..max_batch)
            .map(|k| prompt(&tokenizer, k * 7 + 1))
            .collect::<Result<_>>()?,
        Err(e) => {
            println!(
                "relay bench-gpu: no tokenizer ({e}); prompts of {SYNTHETIC_PROMPT_TOKENS} token ids"
            );
            (0..max_batch)
                .map(|k| synthetic_prompt(base.config().vocab_size, k))
                .collect()
        }
    };
    let adapter = LoraAdapter::new(base.config(), LoraConfig::all_projections(8, 16.0), 0)?;
    let bytes = relay_llm::to_peft_bytes(&adapter, None)?;

    let mut rows = Vec::new();
    for contender in &contenders {
        let model = base.clone().to_backend(contender.backend.clone())?;
        model.prepare_inference()?;
        let warm_up = Instant::now();
        generate(&model, &prompts[..1], args.new_tokens)?;
        let warm_up_s = warm_up.elapsed().as_secs_f64();
        println!(
            "  {:<22} warm-up (B=1, untimed) {warm_up_s:.2} s",
            contender.name
        );
        let mut generate_tps = Vec::new();
        for &b in &args.batches {
            let tps = generate(&model, &prompts[..b], args.new_tokens)?;
            println!("  {:<22} B={b:<3} {tps:>9.1} tokens/s", contender.name);
            generate_tps.push((b, tps));
        }
        let train_tps = train_step(&model, &adapter, args.train_batch, args.train_len)?;
        let load_s = adapter_load(&model, &bytes)?;
        let longest = longest_trained(
            &model,
            &adapter,
            args.longest_batch,
            &args.longest,
            args.longest_seconds,
        );
        rows.push(Row {
            name: contender.name.clone(),
            warm_up_s,
            generate_tps,
            train_tps,
            load_s,
            longest,
        });
    }

    println!();
    let header: Vec<String> = args
        .batches
        .iter()
        .map(|b| format!("B={b} tok/s"))
        .collect();
    println!(
        "| backend | {} | LoRA train tok/s (B={} x {}) | adapter load ms | longest T trained at B={} |",
        header.join(" | "),
        args.train_batch,
        args.train_len,
        args.longest_batch
    );
    println!("|---|{}---:|---:|---:|", "---:|".repeat(args.batches.len()));
    for row in &rows {
        let cells: Vec<String> = row
            .generate_tps
            .iter()
            .map(|(_, t)| format!("{t:.1}"))
            .collect();
        let longest = row.longest.0.map_or("-".into(), |t| t.to_string());
        println!(
            "| {} | {} | {:.1} | {:.1} | {longest} |",
            row.name,
            cells.join(" | "),
            row.train_tps,
            row.load_s * 1000.0
        );
    }
    let json = serde_json::json!({
        "model": args.model,
        "gpu": gpu,
        "new_tokens": args.new_tokens,
        "train_batch": args.train_batch,
        "train_len": args.train_len,
        "longest_batch": args.longest_batch,
        "backends": rows.iter().map(|row| serde_json::json!({
            "backend": row.name,
            "warm_up_s": (row.warm_up_s * 100.0).round() / 100.0,
            "generate_tokens_per_s": row.generate_tps.iter().map(|(b, t)| serde_json::json!({"batch": b, "tokens_per_s": (t * 10.0).round() / 10.0})).collect::<Vec<_>>(),
            "lora_train_tokens_per_s": (row.train_tps * 10.0).round() / 10.0,
            "adapter_load_ms": (row.load_s * 10000.0).round() / 10.0,
            "longest_train_len": row.longest.0,
            "longest_stopped_by": row.longest.1,
        })).collect::<Vec<_>>(),
    });
    println!("{json}");
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn synthetic_prompts_differ_and_stay_inside_the_vocabulary() {
        let (a, b) = (
            super::synthetic_prompt(384, 0),
            super::synthetic_prompt(384, 1),
        );
        assert_eq!(a.len(), super::SYNTHETIC_PROMPT_TOKENS);
        assert_ne!(a, b);
        assert!(a.iter().chain(&b).all(|&t| t < 384));
    }

    #[test]
    fn the_cpu_backends_are_always_measured() {
        let (all, gpu) = super::contenders();
        assert!(all.len() >= 2);
        assert!(matches!(all[0].backend, relay_llm::Backend::Engine));
        if !relay_llm::CUDA_BUILT {
            assert!(gpu.contains("no GPU measured") && gpu.contains("just build-cuda"));
        }
    }
}
