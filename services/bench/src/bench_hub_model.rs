//! `relay bench-hub-model` (`just bench-hub-model`): a checkpoint of a
//! real model's size, as the Hugging Face Hub holds it, loaded and run on
//! the CPU.
//!
//! Set-up: unless the folder exists, transformers writes a random-weight
//! model of `--config` (by default Qwen3-1.7B-Base's exact config.json,
//! `services/bench/hf/qwen3-1.7b-base.json`) in bf16 safetensors shards
//! with `model.safetensors.index.json` (`services/bench/hf/random_checkpoint.py`
//! in the PyTorch venv that `bash deploy/install.sh --transformers` makes;
//! nothing is downloaded). Then, in this process: the load time of
//! [`CausalLm::load_hf`] and the resident memory after it, packing the
//! engine's weights as the inference server does
//! ([`CausalLm::keep_packed_only`]: the f32 copies are released) and
//! memory after that, and
//! generation tokens/s at each `--batches` size: B sequences of
//! `--prompt-tokens` token ids (a random checkpoint has no tokenizer)
//! generating `--new-tokens` each, timed from the first prefill to the
//! last token. A table, then one JSON line.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use relay_llm::{Backend, CausalLm};

/// `relay bench-hub-model` flags.
#[derive(Debug, clap::Args)]
pub struct BenchHubModelArgs {
    /// The config.json whose random checkpoint the set-up writes.
    #[arg(long, default_value = "services/bench/hf/qwen3-1.7b-base.json")]
    pub config: PathBuf,
    /// The model folder: written by the set-up when it has no config.json.
    #[arg(long, default_value = ".relay/models/qwen3-1.7b-base-random")]
    pub dir: PathBuf,
    /// Batch sizes (sequences decoded together), comma-separated.
    #[arg(long, default_value = "1,8", value_delimiter = ',')]
    pub batches: Vec<usize>,
    /// Prompt length of each sequence, in tokens.
    #[arg(long, default_value_t = 64)]
    pub prompt_tokens: usize,
    /// Tokens each sequence generates.
    #[arg(long, default_value_t = 16)]
    pub new_tokens: usize,
}

/// Resident and peak resident memory of this process, in GiB (Linux).
fn memory_gib() -> (f64, f64) {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|kb| kb.parse::<f64>().ok())
            .map_or(f64::NAN, |kb| kb / (1024.0 * 1024.0))
    };
    (field("VmRSS:"), field("VmHWM:"))
}

/// Writes the random checkpoint with transformers; returns its JSON report.
fn write_checkpoint(config: &Path, dir: &Path) -> Result<serde_json::Value> {
    let python = crate::bench_learning::torch_python();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("hf/random_checkpoint.py");
    println!(
        "== set-up: {python} {} --config {} --out {}",
        script.display(),
        config.display(),
        dir.display()
    );
    let out = Command::new(&python)
        .arg(&script)
        .arg("--config")
        .arg(config)
        .arg("--out")
        .arg(dir)
        .output()
        .with_context(|| format!("running {python}"))?;
    if !out.status.success() {
        bail!(
            "writing the checkpoint failed (run `bash deploy/install.sh --transformers`): {}",
            String::from_utf8_lossy(&out.stderr)
                .lines()
                .last()
                .unwrap_or("")
        );
    }
    let stdout = String::from_utf8_lossy(&out.stdout);
    let line = stdout.lines().last().unwrap_or("{}");
    serde_json::from_str(line).with_context(|| format!("the set-up's report: {line}"))
}

/// The folder's safetensors files and their total size in GB.
fn checkpoint_files(dir: &Path) -> Result<(usize, f64)> {
    let mut files = 0;
    let mut bytes = 0u64;
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        if entry.path().extension().is_some_and(|e| e == "safetensors") {
            files += 1;
            bytes += entry.metadata()?.len();
        }
    }
    Ok((files, bytes as f64 / 1e9))
}

pub fn bench_hub_model(args: BenchHubModelArgs) -> Result<()> {
    let setup = if args.dir.join("config.json").exists() {
        println!("== checkpoint {} (already written)", args.dir.display());
        serde_json::Value::Null
    } else {
        write_checkpoint(&args.config, &args.dir)?
    };
    let (files, gb) = checkpoint_files(&args.dir)?;
    let cpu = crate::cpu_name();
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    println!("== {files} safetensors files, {gb:.2} GB; CPU {cpu}, {threads} threads");

    let started = Instant::now();
    let mut model = CausalLm::load_hf(&args.dir)
        .with_context(|| format!("loading {}", args.dir.display()))?
        .to_backend(Backend::Engine)?;
    let load_s = started.elapsed().as_secs_f64();
    let (rss_loaded, _) = memory_gib();
    let cfg = model.config().clone();
    println!(
        "== loaded {:?} ({} layers, hidden {}, head_dim {}, vocab {}) in {load_s:.1} s; resident {rss_loaded:.2} GiB",
        cfg.architecture, cfg.num_hidden_layers, cfg.hidden_size, cfg.head_dim, cfg.vocab_size
    );

    let vocab = cfg.vocab_size as u64;
    let prompt = |k: usize| -> Vec<u32> {
        (0..args.prompt_tokens)
            .map(|i| ((i as u64 * 7919 + k as u64 * 104_729) % vocab) as u32)
            .collect()
    };
    // Packed as the inference server packs them: the f32 copies released.
    let started = Instant::now();
    model.keep_packed_only()?;
    let pack_s = started.elapsed().as_secs_f64();
    let (rss_ready, _) = memory_gib();
    println!("== packed for the engine in {pack_s:.1} s; resident {rss_ready:.2} GiB");

    let mut rows = Vec::new();
    for &batch in &args.batches {
        let prompts: Vec<Vec<u32>> = (0..batch).map(prompt).collect();
        let tokens_per_s = crate::bench_gpu::generate(&model, &prompts, args.new_tokens)?;
        println!("   B = {batch}: {tokens_per_s:.2} generated tokens/s");
        rows.push((batch, tokens_per_s));
    }
    let (rss_end, peak) = memory_gib();

    println!();
    println!("| checkpoint | files | GB | load s | resident after load GiB | packing s | resident GiB | peak GiB | {} |",
        rows.iter().map(|(b, _)| format!("tokens/s B={b}")).collect::<Vec<_>>().join(" | "));
    println!(
        "|---|---:|---:|---:|---:|---:|---:|---:|{}",
        "---:|".repeat(rows.len())
    );
    println!(
        "| {} | {files} | {gb:.2} | {load_s:.1} | {rss_loaded:.2} | {pack_s:.1} | {rss_end:.2} | {peak:.2} | {} |",
        args.dir.display(),
        rows.iter()
            .map(|(_, t)| format!("{t:.2}"))
            .collect::<Vec<_>>()
            .join(" | ")
    );
    let json = serde_json::json!({
        "bench": "hub-model",
        "checkpoint": args.dir.display().to_string(),
        "config": args.config.display().to_string(),
        "architecture": cfg.architecture.model_type(),
        "setup": setup,
        "files": files,
        "gb": gb,
        "cpu": cpu,
        "threads": threads,
        "backend": "engine (cpu, f32)",
        "load_s": load_s,
        "resident_after_load_gib": rss_loaded,
        "packing_s": pack_s,
        "resident_gib": rss_end,
        "peak_resident_gib": peak,
        "prompt_tokens": args.prompt_tokens,
        "new_tokens": args.new_tokens,
        "generation_tokens_per_s": rows
            .iter()
            .map(|(b, t)| serde_json::json!({"batch": b, "tokens_per_s": t}))
            .collect::<Vec<_>>(),
    });
    println!("{json}");
    Ok(())
}
