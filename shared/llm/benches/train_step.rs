//! `cargo bench -p relay-llm --bench train_step`: one RL train step of a
//! LoRA adapter (r 8, all projections) on the default `init::tiny` model,
//! 16 sequences of 200 tokens (170 prompt, 30 completion), and its parts:
//! the training forward, the reference forward (KL), loss, backward and
//! the AdamW step. Printed as a table (median of a few runs).
//!
//! Threads: rayon's pool, sized by `RAYON_NUM_THREADS` (printed), and
//! candle's elementwise pool, sized by `CANDLE_NUM_THREADS` (see below).
//!
//! It also runs SFT steps on the same model: 32 examples of 150-250
//! tokens per step in micro-batches of 8 (`relay sft`'s defaults), full
//! fine-tuning (every weight a var) and LoRA r 8. `TRAIN_STEP_CASES=rl,
//! sft,parts,prefix` picks cases. Each row gives the median wall time and the
//! median CPU time of the process (all threads): on a shared machine the
//! wall time swings with the load, the CPU time much less.
//!
//! Measured here (`RAYON_NUM_THREADS=2`, 2 cores shared with other
//! builds at load 3-8; old = the composed candle-op training path,
//! new = `train_ops`; one interleaved round, ms wall / ms CPU):
//!
//! | case | old | new | old, `CANDLE_NUM_THREADS=1` | new, `CANDLE_NUM_THREADS=1` |
//! |---|---|---|---|---|
//! | RL step REINFORCE, minibatch 16 | 2226 / 1910 | 823 / 670 | 1896 / 1100 | 861 / 470 |
//! | RL step GRPO (+ reference), minibatch 16 | 3024 / 2500 | 1168 / 750 | 2001 / 1310 | 1308 / 580 |
//! | RL step GRPO (+ reference), minibatch 4 | 4064 / 3610 | 940 / 900 | 1264 / 960 | 796 / 530 |
//! | SFT step, full fine-tuning | 6803 / 5030 | 1831 / 1540 | 1412 / 1420 | 1650 / 1010 |
//! | SFT step, LoRA r 8 | 4185 / 4380 | 1828 / 1360 | 1554 / 1470 | 1743 / 920 |
//! | 16-sequence forward + loss + backward | 2875 / 2370 | 1063 / 740 | 2893 / 1180 | 980 / 510 |
//! | forward, no adapter | 359 / 350 | 214 / 140 | 284 / 200 | 230 / 160 |
//!
//! Two causes, measured apart:
//! - candle 0.11's elementwise ops over 64 K elements run on its own
//!   barrier pool (`CANDLE_NUM_THREADS`, default all cores), whose caller
//!   spins until every pool thread has checked in; on an oversubscribed
//!   machine each op then waits for a descheduled thread. The old path
//!   had hundreds of such ops per micro-batch (`BarrierGuard::drop` was
//!   the top symbol under `perf`); the new one has only the gradient sums
//!   of candle's backward loop. `CANDLE_NUM_THREADS=1` turns the pool off
//!   (gemm and the fused ops still use rayon's threads).
//! - Work: the old backward computed gradients of frozen weights and of
//!   the constant mask, and a five-op softmax over `(batch, heads, time,
//!   time)`; the new ops compute only needed gradients, keep attention
//!   per head in cache, and compute the LM head only at completion
//!   positions. With the pool off, a step takes 1.4-2.3x less CPU;
//!   `perf` then shows gemm's microkernel at ~57% of the time.
//!
//! The `prefix` case is one micro-batch of a text game's moves, shaped as
//! `bench-smollm2`'s: 8 sequences whose prompts share their first 60
//! tokens (system prompt, chat header, rules), then 41 of their own (the
//! board) and 4 completion tokens; forward, loss and backward through the
//! padded block (`forward_train_at`), with the prefix once
//! (`forward_train_batch`), and with the backward block by block, a stop
//! check asked before each block (`forward_train_for_backward_until`, what
//! the trainers run), with the longest stretch between two looks: how
//! long a stopping learner waits at most. `TRAIN_STEP_MODEL=smollm2` (or
//! any model spec `relay` takes) runs it on that model instead of
//! `init::tiny`.
//!
//! The remaining fresh-page faults (`perf record -e page-faults`) come
//! from candle's backward loop: each gradient sum allocates a zero
//! tensor and an output (`GradStore::or_insert` + `Tensor::add`).

use std::time::{Duration, Instant};

use candle_core::{Device, Tensor};
use relay_llm::rl::{rl_loss, RlMicroBatch, RlRow};
use relay_llm::sft::{load_hf_trainable, named_vars};
use relay_llm::{
    init, AdamWConfig, Aggregation, BatchConfig, BatchTotals, CausalLm, LoraAdapter, LoraConfig,
    ObjectiveConfig, RlTrainConfig, RlTrainer, SftConfig, SftExample, SftTrainer, TinyVocab,
    TokenExample, Truncation,
};

const SEQUENCES: usize = 16;
const PROMPT: usize = 170;
const COMPLETION: usize = 30;
/// SFT: examples per optimizer step and per backward pass (`relay sft`'s defaults).
const SFT_BATCH: usize = 32;
const SFT_MINIBATCH: usize = 8;

/// CPU time of the whole process so far (user + system, all threads;
/// Linux `/proc/self/stat`, in clock ticks of 10 ms): with other
/// processes sharing the cores, wall time says how long a step waited,
/// CPU time how much work (and spinning) it took.
fn process_cpu() -> Duration {
    let Ok(stat) = std::fs::read_to_string("/proc/self/stat") else {
        return Duration::ZERO;
    };
    // Fields after the parenthesised command name; utime and stime are
    // the 14th and 15th fields of the line.
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| {
        fields
            .get(i)
            .and_then(|f| f.parse::<u64>().ok())
            .unwrap_or(0)
    };
    Duration::from_millis((ticks(11) + ticks(12)) * 10)
}

/// Median wall time and median CPU time of `runs` calls after a warm-up.
fn median(runs: usize, f: &mut dyn FnMut()) -> (Duration, Duration) {
    f();
    let (mut wall, mut cpu): (Vec<Duration>, Vec<Duration>) = (0..runs)
        .map(|_| {
            let (t, c) = (Instant::now(), process_cpu());
            f();
            (t.elapsed(), process_cpu().saturating_sub(c))
        })
        .unzip();
    wall.sort();
    cpu.sort();
    (wall[wall.len() / 2], cpu[cpu.len() / 2])
}

/// Whether to run the cases named `name` (`rl`, `sft`, `parts`, `prefix`):
/// `TRAIN_STEP_CASES=sft,parts` runs only those (e.g. under `perf`).
fn enabled(name: &str) -> bool {
    std::env::var("TRAIN_STEP_CASES")
        .map(|cases| cases.split(',').any(|c| c.trim() == name))
        .unwrap_or(true)
}

fn row(label: &str, (wall, cpu): (Duration, Duration)) {
    println!(
        "{label:<66} {:>9.1} ms wall {:>9.0} ms CPU",
        wall.as_secs_f64() * 1e3,
        cpu.as_secs_f64() * 1e3
    );
}

/// The examples as one micro-batch's rows, each with advantage 0.5.
fn rl_rows(data: &[TokenExample]) -> Vec<RlRow<'_>> {
    data.iter()
        .map(|e| RlRow {
            learner_logprobs: None,
            prompt: &e.prompt,
            completion: &e.completion,
            behaviour_logprobs: &e.behaviour_logprobs,
            advantage: 0.5,
        })
        .collect()
}

fn examples(vocab: u32) -> Vec<TokenExample> {
    (0..SEQUENCES)
        .map(|i| TokenExample {
            prompt: (0..PROMPT)
                .map(|t| ((i * 131 + t * 7919) as u32) % (vocab - 3) + 3)
                .collect(),
            completion: (0..COMPLETION)
                .map(|t| ((i * 17 + t * 31) as u32) % (vocab - 3) + 3)
                .collect(),
            behaviour_logprobs: vec![-6.0; COMPLETION],
            reward: (i % 3) as f64,
            group: (i / 4) as u64,
            stratum: 0,
        })
        .collect()
}

/// 32 (prompt, move) pairs of 150 to 250 tokens: prompts of 140 to 230
/// tokens, completions of 4 to 20.
fn sft_examples(vocab: u32) -> Vec<SftExample> {
    (0..SFT_BATCH)
        .map(|i| SftExample {
            prompt: (0..140 + (i * 37) % 91)
                .map(|t| ((i * 131 + t * 7919) as u32) % (vocab - 3) + 3)
                .collect(),
            completion: (0..4 + (i * 7) % 17)
                .map(|t| ((i * 17 + t * 31) as u32) % (vocab - 3) + 3)
                .collect(),
            alternatives: Vec::new(),
        })
        .collect()
}

fn sft_config() -> SftConfig {
    SftConfig {
        batch: BatchConfig {
            batch_size: SFT_BATCH,
            minibatch_size: SFT_MINIBATCH,
            max_seq_len: 512,
            truncation: Truncation::CutPromptStart,
            recompute_activations: true,
        },
        optimizer: AdamWConfig {
            lr: 1e-6,
            ..Default::default()
        },
        aggregation: Default::default(),
    }
}

fn main() {
    println!(
        "RAYON_NUM_THREADS={}",
        std::env::var("RAYON_NUM_THREADS").unwrap_or_else(|_| "(unset)".into())
    );
    let dir = std::env::temp_dir().join(format!("relay-llm-train-bench-{}", std::process::id()));
    let vocab = TinyVocab {
        size: 512,
        bos_token_id: None,
        eos_token_id: Some(2),
        pad_token_id: Some(0),
    };
    init::tiny(&dir, 0, &vocab).unwrap();
    let model = CausalLm::load_hf(&dir).unwrap();
    let adapter =
        LoraAdapter::new(model.config(), LoraConfig::all_projections(8, 16.0), 0).unwrap();
    // Non-zero B, as after the first step.
    for (_, v) in adapter.named_vars() {
        v.set(&Tensor::randn(0f32, 0.02, v.shape(), &Device::Cpu).unwrap())
            .unwrap();
    }
    let data = examples(vocab.size as u32);
    println!(
        "init::tiny default shape, LoRA r 8 on all projections, {SEQUENCES} sequences x {} tokens ({PROMPT} prompt + {COMPLETION} completion)",
        PROMPT + COMPLETION
    );

    let config = |objective: ObjectiveConfig, minibatch_size: usize| RlTrainConfig {
        objective,
        batch: BatchConfig {
            batch_size: SEQUENCES,
            minibatch_size,
            max_seq_len: 512,
            truncation: Truncation::CutPromptStart,
            recompute_activations: true,
        },
        optimizer: AdamWConfig {
            lr: 1e-6,
            ..Default::default()
        },
    };
    let rl_cases = if enabled("rl") {
        vec![
            (
                "REINFORCE (no reference forward)",
                ObjectiveConfig::reinforce(),
            ),
            (
                "GRPO (k3 KL loss: + reference forward)",
                ObjectiveConfig::grpo(),
            ),
        ]
    } else {
        Vec::new()
    };
    for (label, objective) in rl_cases {
        for minibatch in [16, 4] {
            let mut trainer =
                RlTrainer::new(config(objective.clone(), minibatch), &adapter).unwrap();
            let t = median(5, &mut || {
                trainer.train_step(&model, &adapter, &data).unwrap();
            });
            row(&format!("train step, {label}, minibatch {minibatch}"), t);
        }
    }

    // SFT on the same model: every weight (a VarMap), then a LoRA adapter.
    let sft_data = sft_examples(vocab.size as u32);
    let tokens: usize = sft_data
        .iter()
        .map(|e| e.prompt.len() + e.completion.len())
        .sum();
    println!(
        "SFT: {SFT_BATCH} examples ({tokens} tokens, 150-250 each) per step, minibatch {SFT_MINIBATCH}"
    );
    if enabled("sft") {
        let (full, varmap) = load_hf_trainable(&dir).unwrap();
        let mut trainer = SftTrainer::new(sft_config(), named_vars(&varmap)).unwrap();
        let t = median(3, &mut || {
            trainer.train_step(&full, None, &sft_data).unwrap();
        });
        row("SFT step, full fine-tuning (every weight trains)", t);
        let mut trainer = SftTrainer::new(sft_config(), adapter.named_vars()).unwrap();
        let t = median(3, &mut || {
            trainer
                .train_step(&model, Some(&adapter), &sft_data)
                .unwrap();
        });
        row("SFT step, LoRA r 8 (base frozen)", t);
    }

    if enabled("prefix") {
        shared_prefix(&model, &adapter);
    }
    if !enabled("parts") {
        let _ = std::fs::remove_dir_all(&dir);
        return;
    }
    // Parts of one 16-sequence micro-batch.
    let rows = rl_rows(&data);
    let totals = BatchTotals {
        sequences: SEQUENCES,
        tokens: SEQUENCES * COMPLETION,
    };
    let batch = RlMicroBatch::new(&rows, &Aggregation::TokenMean, totals, &Device::Cpu).unwrap();
    let objective = ObjectiveConfig::ppo();
    row(
        "  build the micro-batch tensors",
        median(5, &mut || {
            RlMicroBatch::new(&rows, &Aggregation::TokenMean, totals, &Device::Cpu).unwrap();
        }),
    );
    row(
        "  forward_train, no adapter (the reference)",
        median(5, &mut || {
            model.forward_train(&batch.tokens.input_ids, None).unwrap();
        }),
    );
    row(
        "  forward_train with adapter",
        median(5, &mut || {
            model
                .forward_train(&batch.tokens.input_ids, Some(&adapter))
                .unwrap();
        }),
    );
    let logits = model
        .forward_train(&batch.tokens.input_ids, Some(&adapter))
        .unwrap();
    row(
        "  PPO loss on the logits (select, log-softmax, entropy)",
        median(5, &mut || {
            rl_loss(&objective, &logits, None, &batch).unwrap();
        }),
    );
    row(
        "  forward with adapter + loss + backward",
        median(5, &mut || {
            let logits = model
                .forward_train(&batch.tokens.input_ids, Some(&adapter))
                .unwrap();
            let out = rl_loss(&objective, &logits, None, &batch).unwrap();
            out.loss.backward().unwrap();
        }),
    );
    let mut optimizer =
        relay_llm::AdamW::new(adapter.named_vars(), AdamWConfig::default()).unwrap();
    let logits = model
        .forward_train(&batch.tokens.input_ids, Some(&adapter))
        .unwrap();
    let grads = rl_loss(&objective, &logits, None, &batch)
        .unwrap()
        .loss
        .backward()
        .unwrap();
    row(
        "  AdamW: accumulate + clip + step",
        median(5, &mut || {
            optimizer.accumulate(&grads).unwrap();
            optimizer.step().unwrap();
        }),
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// The `prefix` case (module docs).
fn shared_prefix(tiny: &CausalLm, tiny_adapter: &LoraAdapter) {
    const MOVES: usize = 8;
    const SHARED: usize = 60;
    const OWN: usize = 41;
    const MOVE_TOKENS: usize = 4;
    let loaded = std::env::var("TRAIN_STEP_MODEL").ok().map(|spec| {
        let (model, path) =
            relay_llm::load::load_causal_lm(&spec, relay_llm::GgufBase::Dequantized).unwrap();
        let adapter =
            LoraAdapter::new(model.config(), LoraConfig::all_projections(8, 16.0), 0).unwrap();
        for (_, v) in adapter.named_vars() {
            v.set(&Tensor::randn(0f32, 0.02, v.shape(), &Device::Cpu).unwrap())
                .unwrap();
        }
        (model, adapter, path.display().to_string())
    });
    let (model, adapter, name) = match &loaded {
        Some((m, a, name)) => (m, a, name.clone()),
        None => (tiny, tiny_adapter, "init::tiny".to_string()),
    };
    let vocab = model.config().vocab_size as u32;
    let token = |i: usize| (i as u32 * 7919) % (vocab - 3) + 3;
    let data: Vec<TokenExample> = (0..MOVES)
        .map(|m| TokenExample {
            prompt: (0..SHARED)
                .map(token)
                .chain((0..OWN).map(|t| token(1000 + m * 97 + t)))
                .collect(),
            completion: (0..MOVE_TOKENS).map(|t| token(5000 + m * 13 + t)).collect(),
            behaviour_logprobs: vec![-1.0; MOVE_TOKENS],
            reward: 0.0,
            group: 0,
            stratum: 0,
        })
        .collect();
    let rows = rl_rows(&data);
    let totals = BatchTotals {
        sequences: MOVES,
        tokens: MOVES * MOVE_TOKENS,
    };
    let batch = RlMicroBatch::new(&rows, &Aggregation::TokenMean, totals, &Device::Cpu).unwrap();
    println!(
        "{name}, LoRA r 8: {MOVES} moves of {} tokens ({SHARED} shared, {OWN} own, {MOVE_TOKENS} completion): {} padded tokens, {} with the prefix once",
        SHARED + OWN + MOVE_TOKENS,
        batch.tokens.input_ids.elem_count(),
        batch.tokens.packed.input_ids.len()
    );
    let objective = ObjectiveConfig::dr_grpo(16);
    let padded = median(5, &mut || {
        let logits = model
            .forward_train_at(
                &batch.tokens.input_ids,
                Some(adapter),
                &batch.tokens.positions,
            )
            .unwrap();
        let out = rl_loss(&objective, &logits, None, &batch).unwrap();
        out.loss.backward().unwrap();
    });
    row("  forward + loss + backward, padded block", padded);
    let packed = median(5, &mut || {
        let logits = model
            .forward_train_batch(&batch.tokens, Some(adapter))
            .unwrap();
        let out = rl_loss(&objective, &logits, None, &batch).unwrap();
        out.loss.backward().unwrap();
    });
    row("  forward + loss + backward, shared prefix once", packed);
    println!(
        "  padded / shared prefix: {:.2}x wall, {:.2}x CPU",
        padded.0.as_secs_f64() / packed.0.as_secs_f64(),
        padded.1.as_secs_f64() / packed.1.as_secs_f64()
    );
    // The trainers' path: the backward block by block, a stop check asked
    // before each block; the longest stretch between two looks (or from
    // the start or to the end) bounds how long a stopping learner waits.
    let looks = std::cell::RefCell::new(Vec::<Instant>::new());
    let look = || {
        looks.borrow_mut().push(Instant::now());
        false
    };
    let mut longest = Duration::ZERO;
    let by_block = median(5, &mut || {
        looks.borrow_mut().clear();
        let started = Instant::now();
        let forward = model
            .forward_train_for_backward_until(&batch.tokens, Some(adapter), false, Some(&look))
            .unwrap();
        let out = rl_loss(&objective, forward.logits(), None, &batch).unwrap();
        forward.backward(&out.loss).unwrap();
        let mut times = vec![started];
        times.extend(looks.borrow().iter().copied());
        times.push(Instant::now());
        for pair in times.windows(2) {
            longest = longest.max(pair[1] - pair[0]);
        }
    });
    row(
        "  forward + loss + backward, block by block (the trainers')",
        by_block,
    );
    println!(
        "  longest stretch between two stop looks: {:.1} ms",
        longest.as_secs_f64() * 1e3
    );
}
