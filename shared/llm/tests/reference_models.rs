//! The model, its KV cache, LoRA and PEFT files against transformers'
//! reference data, for each architecture: `tiny-qwen2` (Qwen2),
//! `tiny-qwen3` (Qwen3: per-head q/k norms, explicit head_dim) and
//! `tiny-llama3` (Llama 3.1: llama3 RoPE scaling, untied head), each with
//! logits at every position, greedy continuations and a PEFT adapter's
//! logits computed by transformers and peft.
//!
//! The same checks run on every fixture (the `reference_suite!` modules,
//! so `cargo test -- qwen3` or `-- llama3` selects one architecture) and
//! on both backends, and again on a copy of each fixture whose config.json
//! holds the same settings in the other form transformers writes (4's
//! top-level `rope_theta`/`rope_scaling` or 5's `rope_parameters`; the
//! `*_other_config_form` modules): the checks take config.json's values
//! from the library's loader only, and this keeps them from relying on one
//! form. The fixture folders are found under `$RELAY_LLM_FIXTURES`
//! (default `shared/fixtures` beside the repository), so the suite can be
//! pointed at other models of the same layout, in either form.
//!
//! Beyond the fixture as written: the same weights as the Hub holds them
//! (sharded, bf16, transformers 4's config), as llama.cpp's converter
//! writes them into GGUF, and refused when `config.json` names another
//! architecture. `$RELAY_LLM_GGUF` may name a folder of `<fixture>.gguf`
//! files made by llama.cpp's converter itself; the GGUF check then loads
//! those instead of writing its own.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use candle_core::{DType, Device, Tensor};
use relay_llm::{
    token_log_probs, Backend, BatchItem, CausalLm, KvCache, LogitsWanted, LoraAdapter, LoraConfig,
    ModelConfig, RopeScaling,
};
use serde_json::Value;

mod common;
use common::completion_logprobs;

/// Tolerance on logits against transformers (float32 on both sides).
const LOGIT_TOLERANCE: f32 = 1e-4;

/// The fixture a check runs on: `name` (its folder under
/// `$RELAY_LLM_FIXTURES`, and the key of its measured tolerances) and the
/// folder the check reads, either that one or a copy whose config.json
/// holds the same settings in the other form transformers writes
/// ([`ConfigForm`]). Every check runs on both, so neither a check nor a
/// helper of one can read only the form the fixtures happen to be in.
struct Fixture {
    name: &'static str,
    dir: PathBuf,
    /// Names the check's temporary folders apart from the other form's run
    /// of the same check, which may run at the same time.
    label: String,
    /// The copy in the other form, removed when the check ends.
    copy: Option<PathBuf>,
}

impl Fixture {
    fn as_written(name: &'static str) -> Self {
        Self {
            name,
            dir: relay_testkit::llm_fixture(name),
            label: name.to_owned(),
            copy: None,
        }
    }

    /// A copy of the fixture with its config.json in the form it is not
    /// written in ([`config_in_form`]).
    fn in_other_config_form(name: &'static str) -> Self {
        static COPIES: AtomicUsize = AtomicUsize::new(0);
        let original = relay_testkit::llm_fixture(name);
        let config = read_config(&original);
        let form = ConfigForm::of(&config).other();
        let copy = temp_dir(&format!(
            "{name}-{form:?}-config-{}",
            COPIES.fetch_add(1, Ordering::Relaxed)
        ));
        copy_folder(&original, &copy);
        // The copied file keeps the fixture's read-only mode.
        std::fs::remove_file(copy.join("config.json")).unwrap();
        let rewritten = config_in_form(&config, form);
        std::fs::write(
            copy.join("config.json"),
            serde_json::to_string_pretty(&rewritten).unwrap(),
        )
        .unwrap();
        Self {
            name,
            dir: copy.clone(),
            label: format!("{name}-{form:?}-config"),
            copy: Some(copy),
        }
    }

    fn dir(&self) -> &Path {
        &self.dir
    }
}

impl Drop for Fixture {
    fn drop(&mut self) {
        if let Some(copy) = &self.copy {
            let _ = std::fs::remove_dir_all(copy);
        }
    }
}

impl std::fmt::Display for Fixture {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.label)
    }
}

fn copy_folder(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let target = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            copy_folder(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), &target).unwrap();
        }
    }
}

struct Case {
    input_ids: Vec<u32>,
    logits: Vec<Vec<f32>>,
    greedy: Vec<u32>,
    logits_with_adapter: Vec<Vec<f32>>,
}

fn cases(fixture: &Fixture) -> Vec<Case> {
    let path = fixture.dir().join("reference.json");
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{}: {e} (set RELAY_LLM_FIXTURES)", path.display()));
    let value: Value = serde_json::from_str(&text).expect("reference.json parses");
    let ids = |v: &Value| -> Vec<u32> {
        v.as_array()
            .expect("id list")
            .iter()
            .map(|x| x.as_u64().expect("id") as u32)
            .collect()
    };
    let matrix = |v: &Value| -> Vec<Vec<f32>> {
        v.as_array()
            .expect("rows")
            .iter()
            .map(|row| {
                row.as_array()
                    .expect("row")
                    .iter()
                    .map(|x| x.as_f64().expect("logit") as f32)
                    .collect()
            })
            .collect()
    };
    let cases: Vec<Case> = value["cases"]
        .as_array()
        .expect("cases")
        .iter()
        .map(|c| Case {
            input_ids: ids(&c["input_ids"]),
            logits: matrix(&c["logits"]),
            greedy: ids(&c["greedy"]),
            logits_with_adapter: matrix(&c["logits_with_adapter"]),
        })
        .collect();
    assert!(!cases.is_empty());
    cases
}

fn model(fixture: &Fixture) -> CausalLm {
    CausalLm::load_hf(fixture.dir()).unwrap_or_else(|e| panic!("{fixture} loads: {e}"))
}

fn adapter(fixture: &Fixture, model: &CausalLm) -> LoraAdapter {
    let adapter = LoraAdapter::load_peft(&fixture.dir().join("adapter"), model.config())
        .expect("adapter loads");
    model.place_adapter(&adapter).expect("adapter placed")
}

/// Runs `check` on the model on each backend: the CPU engine, and the
/// candle backend in f32 ([`candle_backends`]).
fn for_each_backend(fixture: &Fixture, check: impl Fn(&CausalLm)) {
    let backends = std::iter::once(Backend::Engine).chain(candle_backends(DType::F32));
    for backend in backends {
        let model = model(fixture).to_backend(backend).expect("model placed");
        eprintln!("backend {}", model.backend().describe());
        check(&model);
        synchronize(&model);
    }
}

/// The candle backend in `dtype` on the CPU and, in a `cuda` build on a
/// machine with a GPU (`cargo test -p relay-llm --features cuda`), on
/// cuda:0, its memory pool poisoned first ([`poison`]).
fn candle_backends(dtype: DType) -> Vec<Backend> {
    let mut backends = vec![Backend::Candle {
        device: Device::Cpu,
        dtype,
    }];
    if relay_llm::CUDA_BUILT {
        match relay_llm::open_device(relay_llm::DeviceSpec::Cuda(0)) {
            Ok(device) => {
                poison(&device);
                backends.push(Backend::Candle { device, dtype });
            }
            Err(e) => eprintln!("no CUDA device to test on: {e}"),
        }
    }
    backends
}

/// Fills 1 GiB of the device's memory pool with NaN and frees it: the
/// pool keeps freed memory ([`relay_llm::open_device`]), so the buffers
/// the checks' kernels get come from it, and an output a kernel fails to
/// write reads as NaN, which every comparison refuses, rather than as
/// zeros or a previous run's values.
fn poison(device: &Device) {
    if device.is_cpu() {
        return;
    }
    let nan = Tensor::full(f32::NAN, 1 << 28, device).expect("poison allocated");
    drop(nan);
    device.synchronize().expect("poisoned");
}

/// Waits for the device's queued work, so that an asynchronous CUDA error
/// fails the check that caused it.
fn synchronize(model: &CausalLm) {
    model
        .device()
        .synchronize()
        .unwrap_or_else(|e| panic!("{}: {e}", model.backend().describe()));
}

/// Largest |a - b| over all positions, with the position where it occurs.
fn max_diff(got: &Tensor, want: &[Vec<f32>]) -> (f32, usize) {
    let got: Vec<Vec<f32>> = got.to_vec2().expect("2-D logits");
    assert_eq!(got.len(), want.len(), "positions");
    let mut worst = (0.0f32, 0);
    for (pos, (g, w)) in got.iter().zip(want).enumerate() {
        assert_eq!(g.len(), w.len(), "vocab");
        for (a, b) in g.iter().zip(w) {
            let d = (a - b).abs();
            assert!(d.is_finite(), "non-finite logit at position {pos}");
            if d > worst.0 {
                worst = (d, pos);
            }
        }
    }
    worst
}

fn argmax(row: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in row.iter().enumerate() {
        if x > row[best] {
            best = i;
        }
    }
    best as u32
}

fn last_row(logits: &Tensor) -> Vec<f32> {
    let n = logits.dim(0).unwrap();
    logits.get(n - 1).unwrap().to_vec1().unwrap()
}

/// Pads `rows` on the right with token 0 into a `(batch, time)` u32 tensor.
fn right_padded(rows: &[&[u32]]) -> Tensor {
    let time = rows.iter().map(|r| r.len()).max().unwrap();
    let mut flat = Vec::with_capacity(rows.len() * time);
    for r in rows {
        flat.extend_from_slice(r);
        flat.extend(std::iter::repeat_n(0, time - r.len()));
    }
    Tensor::from_vec(flat, (rows.len(), time), &Device::Cpu).unwrap()
}

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("relay-llm-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

fn logits_match_transformers(fixture: &Fixture) {
    for_each_backend(fixture, |model| {
        for (i, case) in cases(fixture).iter().enumerate() {
            let mut cache = model.new_cache();
            let logits = model
                .forward_one(&case.input_ids, &mut cache, None)
                .unwrap();
            let (diff, pos) = max_diff(&logits, &case.logits);
            assert!(
                diff < LOGIT_TOLERANCE,
                "case {i}: max |diff| {diff} at position {pos}"
            );
            assert_eq!(cache.len(), case.input_ids.len());
        }
    });
}

fn greedy_with_kv_cache(fixture: &Fixture) {
    for_each_backend(fixture, |model| {
        for (i, case) in cases(fixture).iter().enumerate() {
            let mut cache = model.new_cache();
            let mut next = argmax(&last_row(
                &model
                    .forward_one(&case.input_ids, &mut cache, None)
                    .unwrap(),
            ));
            let mut generated = vec![next];
            while generated.len() < case.greedy.len() {
                let logits = model.forward_one(&[next], &mut cache, None).unwrap();
                next = argmax(&last_row(&logits));
                generated.push(next);
            }
            assert_eq!(generated, case.greedy, "case {i}");
            assert_eq!(cache.len(), case.input_ids.len() + case.greedy.len() - 1);
        }
    });
}

/// All cases decoded in one ragged batch; the last case joins after the
/// others have decoded three tokens, its prompt prefilled in the same
/// forward as their decode steps.
fn batched_greedy_with_late_join(fixture: &Fixture) {
    for_each_backend(fixture, |model| {
        let cases = cases(fixture);
        let late = cases.len() - 1;
        let join_at = 3;
        let mut caches: Vec<KvCache> = cases.iter().map(|_| model.new_cache()).collect();
        let mut generated: Vec<Vec<u32>> = vec![Vec::new(); cases.len()];
        let mut step = 0;
        while generated
            .iter()
            .zip(&cases)
            .any(|(g, c)| g.len() < c.greedy.len())
        {
            let mut feeds: Vec<(usize, Vec<u32>)> = Vec::new();
            for (i, case) in cases.iter().enumerate() {
                if (i == late && step < join_at) || generated[i].len() == case.greedy.len() {
                    continue;
                }
                let tokens = match generated[i].last() {
                    None => case.input_ids.clone(),
                    Some(&t) => vec![t],
                };
                feeds.push((i, tokens));
            }
            let mut items: Vec<BatchItem> = Vec::new();
            let mut cache_refs: Vec<Option<&mut KvCache>> = caches.iter_mut().map(Some).collect();
            for (i, tokens) in &feeds {
                items.push(BatchItem {
                    tokens,
                    cache: cache_refs[*i].take().unwrap(),
                    adapter: None,
                });
            }
            let logits = model.forward_batch(&mut items, LogitsWanted::Last).unwrap();
            assert_eq!(logits.dims(), [feeds.len(), model.config().vocab_size]);
            let rows: Vec<Vec<f32>> = logits.to_vec2().unwrap();
            for ((i, _), row) in feeds.iter().zip(&rows) {
                generated[*i].push(argmax(row));
            }
            step += 1;
        }
        for (i, case) in cases.iter().enumerate() {
            assert_eq!(generated[i], case.greedy, "case {i}");
        }
    });
}

fn adapter_logits(fixture: &Fixture) {
    for_each_backend(fixture, |model| {
        let adapter = adapter(fixture, model);
        for (i, case) in cases(fixture).iter().enumerate() {
            let mut cache = model.new_cache();
            let logits = model
                .forward_one(&case.input_ids, &mut cache, Some(&adapter))
                .unwrap();
            let (diff, pos) = max_diff(&logits, &case.logits_with_adapter);
            assert!(
                diff < LOGIT_TOLERANCE,
                "case {i}: max |diff| {diff} at position {pos}"
            );
        }
    });
}

/// One batch mixing the adapter and the base model: each sequence gets
/// its own logits, as if it ran alone.
fn mixed_adapters_in_one_batch(fixture: &Fixture) {
    for_each_backend(fixture, |model| {
        let adapter = adapter(fixture, model);
        let cases = cases(fixture);
        let mut caches: Vec<KvCache> = cases.iter().map(|_| model.new_cache()).collect();
        let mut items: Vec<BatchItem> = cases
            .iter()
            .zip(caches.iter_mut())
            .enumerate()
            .map(|(i, (case, cache))| BatchItem {
                tokens: &case.input_ids,
                cache,
                adapter: (i % 2 == 0).then_some(&adapter),
            })
            .collect();
        let logits = model.forward_batch(&mut items, LogitsWanted::All).unwrap();
        let mut start = 0;
        for (i, case) in cases.iter().enumerate() {
            let n = case.input_ids.len();
            let want = if i % 2 == 0 {
                &case.logits_with_adapter
            } else {
                &case.logits
            };
            let (diff, pos) = max_diff(&logits.narrow(0, start, n).unwrap(), want);
            assert!(
                diff < LOGIT_TOLERANCE,
                "case {i}: max |diff| {diff} at position {pos}"
            );
            start += n;
        }
    });
}

/// The differentiable path on a right-padded batch gives the reference
/// logits at every real position, with and without the adapter.
fn training_path_matches_inference_path(fixture: &Fixture) {
    for_each_backend(fixture, |model| {
        let adapter = adapter(fixture, model);
        let cases = cases(fixture);
        let rows: Vec<&[u32]> = cases.iter().map(|c| c.input_ids.as_slice()).collect();
        let ids = right_padded(&rows);
        for with_adapter in [false, true] {
            let logits = model
                .forward_train(&ids, with_adapter.then_some(&adapter))
                .unwrap();
            for (i, case) in cases.iter().enumerate() {
                let n = case.input_ids.len();
                let got = logits.get(i).unwrap().narrow(0, 0, n).unwrap();
                let want = if with_adapter {
                    &case.logits_with_adapter
                } else {
                    &case.logits
                };
                let (diff, pos) = max_diff(&got, want);
                assert!(
                    diff < LOGIT_TOLERANCE,
                    "adapter {with_adapter}, case {i}: max |diff| {diff} at position {pos}"
                );
                // And against the inference path directly.
                let mut cache = model.new_cache();
                let inference = model
                    .forward_one(
                        &case.input_ids,
                        &mut cache,
                        with_adapter.then_some(&adapter),
                    )
                    .unwrap();
                let gap = (got - inference).unwrap().abs().unwrap().max_all().unwrap();
                assert!(gap.to_scalar::<f32>().unwrap() < 1e-4);
            }
        }
    });
}

fn next_token_loss(fixture: &Fixture, model: &CausalLm, adapter: &LoraAdapter) -> Tensor {
    let cases = cases(fixture);
    let rows: Vec<&[u32]> = cases.iter().map(|c| c.input_ids.as_slice()).collect();
    let ids = right_padded(&rows);
    let time = ids.dim(1).unwrap();
    let logits = model
        .forward_train(&ids.narrow(1, 0, time - 1).unwrap(), Some(adapter))
        .unwrap();
    let targets = ids.narrow(1, 1, time - 1).unwrap();
    token_log_probs(&logits, &targets)
        .unwrap()
        .mean_all()
        .unwrap()
        .neg()
        .unwrap()
}

/// candle's fused ops have no backward, so a forward that used one would
/// cut the graph silently. Every LoRA factor of every layer must get a
/// non-zero gradient from a loss on the logits, on either backend (the
/// candle backend trains through the composed forward).
fn every_lora_parameter_gets_a_gradient(fixture: &Fixture) {
    for_each_backend(fixture, |model| {
        let adapter = adapter(fixture, model);
        let loss = next_token_loss(fixture, model, &adapter);
        let grads = loss.backward().unwrap();
        let named = adapter.named_vars();
        assert_eq!(named.len(), 2 * 7 * model.config().num_hidden_layers);
        for (name, var) in &named {
            let grad = grads
                .get(var.as_tensor())
                .unwrap_or_else(|| panic!("{name}: no gradient"));
            let norm: f32 = grad.sqr().unwrap().sum_all().unwrap().to_scalar().unwrap();
            assert!(
                norm > 0.0 && norm.is_finite(),
                "{name}: gradient norm {norm}"
            );
        }

        // A fresh PEFT-style adapter has B = 0, so only B moves on the first step.
        let fresh =
            LoraAdapter::new(model.config(), LoraConfig::all_projections(4, 8.0), 7).unwrap();
        let fresh = model.place_adapter(&fresh).unwrap();
        let grads = next_token_loss(fixture, model, &fresh).backward().unwrap();
        for (name, var) in fresh.named_vars() {
            let norm: f32 = grads
                .get(var.as_tensor())
                .map(|g| g.sqr().unwrap().sum_all().unwrap().to_scalar().unwrap())
                .unwrap_or(0.0);
            if name.contains("lora_B") {
                assert!(norm > 0.0, "{name}: gradient norm {norm}");
            } else {
                assert_eq!(norm, 0.0, "{name}: A cannot move while B is zero");
            }
        }
    });
}

fn peft_round_trip(fixture: &Fixture) {
    let model = model(fixture);
    let original = adapter(fixture, &model);
    let dir = temp_dir(&format!("{fixture}-peft-round-trip"));
    original.save_peft(&dir, Some(fixture.name)).unwrap();
    let loaded = LoraAdapter::load_peft(&dir, model.config()).unwrap();
    assert_eq!(loaded.config(), original.config());
    assert_eq!(loaded.scaling(), 2.0);
    let (a, b) = (original.named_vars(), loaded.named_vars());
    assert_eq!(a.len(), b.len());
    for ((name_a, var_a), (name_b, var_b)) in a.iter().zip(&b) {
        assert_eq!(name_a, name_b);
        let a: Vec<f32> = var_a.as_tensor().flatten_all().unwrap().to_vec1().unwrap();
        let b: Vec<f32> = var_b.as_tensor().flatten_all().unwrap().to_vec1().unwrap();
        assert_eq!(a, b, "{name_a}");
    }
    // The saved config is PEFT's: the fields PEFT reads are there.
    let saved: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("adapter_config.json")).unwrap())
            .unwrap();
    assert_eq!(saved["peft_type"], "LORA");
    assert_eq!(saved["r"], 4);
    assert_eq!(saved["lora_alpha"], 8.0);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A trained adapter changes the logits; an adapter shared by reference
/// leaves the base model and other sequences untouched.
fn adapter_is_not_baked_into_the_base(fixture: &Fixture) {
    let model = model(fixture);
    let adapter = adapter(fixture, &model);
    let case = &cases(fixture)[2];
    let mut cache = model.new_cache();
    let _ = model
        .forward_one(&case.input_ids, &mut cache, Some(&adapter))
        .unwrap();
    let mut cache = model.new_cache();
    let base = model
        .forward_one(&case.input_ids, &mut cache, None)
        .unwrap();
    let (diff, _) = max_diff(&base, &case.logits);
    assert!(diff < LOGIT_TOLERANCE);
    assert_eq!(base.dtype(), DType::F32);
}

fn forked_cache_continues_like_the_original(fixture: &Fixture) {
    for_each_backend(fixture, |model| {
        let case = &cases(fixture)[1];
        let (prompt, rest) = case.input_ids.split_at(20);
        let mut cache = model.new_cache();
        model.forward_one(prompt, &mut cache, None).unwrap();
        let mut fork = cache.fork().unwrap();
        let a = model.forward_one(rest, &mut cache, None).unwrap();
        let b = model.forward_one(rest, &mut fork, None).unwrap();
        let want: Vec<Vec<f32>> = case.logits[20..].to_vec();
        assert!(max_diff(&a, &want).0 < LOGIT_TOLERANCE);
        assert!(max_diff(&b, &want).0 < LOGIT_TOLERANCE);
        // Truncate and refeed: same logits again.
        cache.truncate(20);
        let c = model.forward_one(rest, &mut cache, None).unwrap();
        assert!(max_diff(&c, &want).0 < LOGIT_TOLERANCE);
    });
}

fn greedy_sequence(model: &CausalLm, case: &Case) -> relay_llm::Sequence {
    relay_llm::Sequence::new(
        model,
        case.input_ids.clone(),
        None,
        relay_llm::Sampler::greedy(),
        relay_llm::StopCondition {
            max_new_tokens: case.greedy.len(),
            stop_token_ids: Vec::new(),
        },
    )
    .unwrap()
}

/// `generate::step` over a running batch that a sequence joins mid-decode
/// reproduces every greedy continuation; finished sequences report `None`.
fn step_with_joining_sequence(fixture: &Fixture) {
    use relay_llm::{step, FinishReason, Sequence};
    for_each_backend(fixture, |model| {
        let cases = cases(fixture);
        let mut running: Vec<Sequence> = vec![
            greedy_sequence(model, &cases[0]),
            greedy_sequence(model, &cases[1]),
        ];
        for _ in 0..5 {
            let mut refs: Vec<&mut Sequence> = running.iter_mut().collect();
            let out = step(model, &mut refs).unwrap();
            assert!(out.iter().all(|o| o.is_some()));
        }
        running.push(greedy_sequence(model, &cases[2]));
        while running.iter().any(|s| !s.is_finished()) {
            let mut refs: Vec<&mut Sequence> = running.iter_mut().collect();
            let out = step(model, &mut refs).unwrap();
            for (seq, o) in running.iter().zip(&out) {
                if let Some(o) = o {
                    assert_eq!(seq.tokens().last(), Some(&o.sampled.token));
                }
            }
        }
        for (seq, case) in running.iter().zip(&cases) {
            assert_eq!(seq.tokens(), case.greedy.as_slice());
            assert_eq!(seq.finish_reason(), Some(FinishReason::Length));
            assert!(seq.logprobs().iter().all(|&lp| lp <= 0.0 && lp.is_finite()));
            assert!(seq.sampling_logprobs().iter().all(|&lp| lp == 0.0));
        }
    });
}

/// A prompt prefilled once and forked gives each fork the same
/// continuation as an unforked run; a stop token ends a sequence.
fn prefill_fork_and_stop_token(fixture: &Fixture) {
    use relay_llm::{generate, prefill, FinishReason, Sampler};
    for_each_backend(fixture, |model| {
        let case = &cases(fixture)[2];
        let mut parent = greedy_sequence(model, case);
        prefill(model, &mut [&mut parent]).unwrap();
        assert_eq!(parent.cache().len(), case.input_ids.len() - 1);
        let mut forks: Vec<_> = (0..2)
            .map(|_| parent.fork(Sampler::greedy()).unwrap())
            .collect();
        for fork in &mut forks {
            generate(model, fork).unwrap();
            assert_eq!(fork.tokens(), case.greedy.as_slice());
        }
        let stop_at = case.greedy[4];
        let mut seq = relay_llm::Sequence::new(
            model,
            case.input_ids.clone(),
            None,
            Sampler::greedy(),
            relay_llm::StopCondition {
                max_new_tokens: 100,
                stop_token_ids: vec![stop_at],
            },
        )
        .unwrap();
        generate(model, &mut seq).unwrap();
        let first = case.greedy.iter().position(|&t| t == stop_at).unwrap();
        assert_eq!(seq.tokens(), &case.greedy[..=first]);
        assert_eq!(seq.finish_reason(), Some(FinishReason::Stop(stop_at)));
    });
}

/// With an adapter on the sequence, step samples from the adapted model:
/// its first greedy token is the argmax of `logits_with_adapter`.
fn step_uses_the_sequence_adapter(fixture: &Fixture) {
    use relay_llm::{step, Sampler, Sequence, StopCondition};
    for_each_backend(fixture, |model| {
        let adapter = std::sync::Arc::new(adapter(fixture, model));
        let cases = cases(fixture);
        let mut seqs: Vec<Sequence> = cases
            .iter()
            .enumerate()
            .map(|(i, c)| {
                Sequence::new(
                    model,
                    c.input_ids.clone(),
                    (i != 1).then(|| adapter.clone()),
                    Sampler::greedy(),
                    StopCondition {
                        max_new_tokens: 1,
                        stop_token_ids: vec![],
                    },
                )
                .unwrap()
            })
            .collect();
        let mut refs: Vec<&mut Sequence> = seqs.iter_mut().collect();
        let out = step(model, &mut refs).unwrap();
        for (i, (o, c)) in out.iter().zip(&cases).enumerate() {
            let want = if i != 1 {
                &c.logits_with_adapter
            } else {
                &c.logits
            };
            assert_eq!(
                o.unwrap().sampled.token,
                argmax(want.last().unwrap()),
                "case {i}"
            );
        }
    });
}

/// Full fine-tuning: every weight of the model (Qwen3's q/k norms
/// included) is a var that gets a gradient from a loss on the logits, on
/// both backends, and the saved folder loads back to the same logits.
fn full_fine_tuning_reaches_every_weight(fixture: &Fixture) {
    let candle = Backend::Candle {
        device: Device::Cpu,
        dtype: DType::F32,
    };
    let cases = cases(fixture);
    let case = &cases[2];
    let ids = Tensor::new(&case.input_ids[..], &Device::Cpu)
        .unwrap()
        .unsqueeze(0)
        .unwrap();
    for backend in [Backend::Engine, candle] {
        let (model, varmap) =
            relay_llm::sft::load_hf_trainable_on(fixture.dir(), &backend).unwrap();
        let logits = model.forward_train(&ids, None).unwrap().squeeze(0).unwrap();
        let (diff, pos) = max_diff(&logits, &case.logits);
        assert!(diff < LOGIT_TOLERANCE, "|diff| {diff} at {pos}");
        let time = ids.dim(1).unwrap();
        let logits = model
            .forward_train(&ids.narrow(1, 0, time - 1).unwrap(), None)
            .unwrap();
        let loss = token_log_probs(&logits, &ids.narrow(1, 1, time - 1).unwrap())
            .unwrap()
            .mean_all()
            .unwrap()
            .neg()
            .unwrap();
        let grads = loss.backward().unwrap();
        let vars = relay_llm::sft::named_vars(&varmap);
        if model.config().architecture.has_qk_norm() {
            assert!(vars.iter().any(|(n, _)| n.ends_with("q_norm.weight")));
        }
        for (var_name, var) in &vars {
            let norm: f32 = grads
                .get(var.as_tensor())
                .unwrap_or_else(|| panic!("{var_name}: no gradient"))
                .sqr()
                .unwrap()
                .sum_all()
                .unwrap()
                .to_scalar()
                .unwrap();
            assert!(norm > 0.0 && norm.is_finite(), "{var_name}: {norm}");
        }
        let saved = temp_dir(&format!("{fixture}-full-saved"));
        relay_llm::sft::save_hf_trainable(&varmap, model.config(), &saved).unwrap();
        let reloaded = CausalLm::load_hf(&saved).unwrap();
        assert_eq!(reloaded.config(), model.config());
        let mut cache = reloaded.new_cache();
        let logits = reloaded
            .forward_one(&case.input_ids, &mut cache, None)
            .unwrap();
        assert!(max_diff(&logits, &case.logits).0 < LOGIT_TOLERANCE);
        std::fs::remove_dir_all(&saved).unwrap();
    }
}

/// The fixture's tensors, f32, by name.
fn fixture_tensors(fixture: &Fixture) -> Vec<(String, Tensor)> {
    let path = fixture.dir().join("model.safetensors");
    let mut tensors: Vec<(String, Tensor)> = candle_core::safetensors::load(&path, &Device::Cpu)
        .unwrap()
        .into_iter()
        .collect();
    tensors.sort_by(|a, b| a.0.cmp(&b.0));
    tensors
}

/// config.json of a model folder, as written.
fn read_config(dir: &Path) -> Value {
    let path = dir.join("config.json");
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{}: {e} (set RELAY_LLM_FIXTURES)", path.display()));
    serde_json::from_str(&text).expect("config.json parses")
}

fn fixture_config(fixture: &Fixture) -> Value {
    read_config(fixture.dir())
}

/// The fixture's config as the library's loader reads it: the one parser
/// of config.json the checks use.
fn fixture_model_config(fixture: &Fixture) -> ModelConfig {
    ModelConfig::from_hf_file(fixture.dir())
        .unwrap_or_else(|e| panic!("{fixture}: config.json loads: {e}"))
}

/// The two forms transformers writes the rotary settings of config.json
/// in; the loader reads both ([`ModelConfig::from_hf_json`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ConfigForm {
    /// Version 4 (what the Hub's Qwen3 and Llama 3 repositories hold):
    /// top-level `rope_theta` and `rope_scaling`.
    Transformers4,
    /// Version 5: one `rope_parameters` object.
    Transformers5,
}

impl ConfigForm {
    fn of(config: &Value) -> Self {
        match config.get("rope_parameters") {
            Some(p) if !p.is_null() => Self::Transformers5,
            _ => Self::Transformers4,
        }
    }

    fn other(self) -> Self {
        match self {
            Self::Transformers4 => Self::Transformers5,
            Self::Transformers5 => Self::Transformers4,
        }
    }
}

/// `config` with its rotary settings rewritten in `form`, every other
/// field as it was. The values come from the loader's own reading of
/// `config` (its transformers 4 output, [`ModelConfig::to_hf_json`]), so
/// the test holds no second parser of either form; the loader must read
/// the result as it read `config`.
fn config_in_form(config: &Value, form: ConfigForm) -> Value {
    let parsed = ModelConfig::from_hf_json(config).expect("config.json loads");
    let written = parsed.to_hf_json().expect("config writes back");
    let (theta, scaling) = (
        written["rope_theta"].clone(),
        written["rope_scaling"].clone(),
    );
    let mut rewritten = config.clone();
    let fields = rewritten.as_object_mut().expect("config.json is an object");
    for stale in ["rope_parameters", "rope_theta", "rope_scaling"] {
        fields.remove(stale);
    }
    match form {
        ConfigForm::Transformers4 => {
            fields.insert("rope_theta".into(), theta);
            fields.insert("rope_scaling".into(), scaling);
        }
        ConfigForm::Transformers5 => {
            let mut parameters = match scaling {
                Value::Null => serde_json::json!({"rope_type": "default"}),
                scaling => scaling,
            };
            parameters["rope_theta"] = theta;
            fields.insert("rope_parameters".into(), parameters);
        }
    }
    assert_eq!(ConfigForm::of(&rewritten), form);
    assert_eq!(
        ModelConfig::from_hf_json(&rewritten).expect("rewritten config.json loads"),
        parsed,
        "the loader reads the config in {form:?}'s form as it was"
    );
    rewritten
}

/// Writes `tensors` in `dtype` as a Hub-style sharded folder (two shards
/// and `model.safetensors.index.json`) with `config`.
fn write_sharded(dir: &Path, tensors: &[(String, Tensor)], dtype: DType, config: &Value) {
    std::fs::create_dir_all(dir).unwrap();
    let half = tensors.len() / 2;
    let mut weight_map = serde_json::Map::new();
    for (shard, part) in [&tensors[..half], &tensors[half..]].iter().enumerate() {
        let file = format!("model-{:05}-of-00002.safetensors", shard + 1);
        let converted: Vec<(String, Tensor)> = part
            .iter()
            .map(|(n, t)| (n.clone(), t.to_dtype(dtype).unwrap()))
            .collect();
        for (n, _) in &converted {
            weight_map.insert(n.clone(), Value::String(file.clone()));
        }
        candle_core::safetensors::save(
            &converted
                .into_iter()
                .collect::<std::collections::HashMap<_, _>>(),
            dir.join(&file),
        )
        .unwrap();
    }
    let index = serde_json::json!({"metadata": {"total_size": 0}, "weight_map": weight_map});
    std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()).unwrap();
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
}

/// The fixture as the Hub holds such a model: sharded, transformers 4's
/// config. In f32 it gives the reference logits (with its config in
/// either form); in bf16 exactly the logits of its weights rounded to bf16
/// and stored as f32, and the full fine-tuning loader reads it too.
fn hub_layout_loads_the_same(fixture: &Fixture) {
    let tensors = fixture_tensors(fixture);
    let written = fixture_config(fixture);
    let config = config_in_form(&written, ConfigForm::Transformers4);
    let case = &cases(fixture)[0];
    let logits = |model: &CausalLm| {
        let mut cache = model.new_cache();
        model
            .forward_one(&case.input_ids, &mut cache, None)
            .unwrap()
    };

    for form in [ConfigForm::Transformers4, ConfigForm::Transformers5] {
        let f32_dir = temp_dir(&format!("{fixture}-hub-f32-{form:?}"));
        write_sharded(
            &f32_dir,
            &tensors,
            DType::F32,
            &config_in_form(&written, form),
        );
        let (diff, pos) = max_diff(&logits(&CausalLm::load_hf(&f32_dir).unwrap()), &case.logits);
        assert!(
            diff < LOGIT_TOLERANCE,
            "sharded f32, {form:?}'s config: |diff| {diff} at {pos}"
        );
        std::fs::remove_dir_all(f32_dir).unwrap();
    }

    let bf16_dir = temp_dir(&format!("{fixture}-hub-bf16"));
    write_sharded(&bf16_dir, &tensors, DType::BF16, &config);
    let rounded: Vec<(String, Tensor)> = tensors
        .iter()
        .map(|(n, t)| {
            let t = t
                .to_dtype(DType::BF16)
                .unwrap()
                .to_dtype(DType::F32)
                .unwrap();
            (n.clone(), t)
        })
        .collect();
    let rounded_dir = temp_dir(&format!("{fixture}-hub-rounded"));
    write_sharded(&rounded_dir, &rounded, DType::F32, &config);
    let bf16 = logits(&CausalLm::load_hf(&bf16_dir).unwrap());
    let want: Vec<Vec<f32>> = logits(&CausalLm::load_hf(&rounded_dir).unwrap())
        .to_vec2()
        .unwrap();
    assert_eq!(max_diff(&bf16, &want).0, 0.0, "bf16 weights read exactly");
    // bf16 rounding moves these random-weight logits by about 2.5 % of
    // their range: a sanity bound, the exact check is the one above.
    let (diff, _) = max_diff(&bf16, &case.logits);
    let scale = case
        .logits
        .iter()
        .flatten()
        .fold(0f32, |m, x| m.max(x.abs()));
    assert!(
        diff < 0.05 * scale,
        "bf16 weights stay near the f32 logits: {diff} of {scale}"
    );

    let (trainable, vars) = relay_llm::sft::load_hf_trainable(&bf16_dir).unwrap();
    assert_eq!(vars.all_vars().len(), tensors.len());
    assert_eq!(max_diff(&logits(&trainable), &want).0, 0.0);
    for dir in [bf16_dir, rounded_dir] {
        std::fs::remove_dir_all(dir).unwrap();
    }
}

/// The fixture's config.json renamed to each other architecture: loading
/// fails, naming a weight that is missing or one the model would ignore
/// (Qwen3 read as Llama would run without its q/k norms).
fn other_architecture_is_refused(fixture: &Fixture) {
    // As written (renamed only), whichever form its rotary settings are in.
    let config = fixture_config(fixture);
    let own = fixture_model_config(fixture).architecture.model_type();
    for other in ["qwen2", "qwen3", "llama"] {
        if other == own {
            continue;
        }
        let dir = temp_dir(&format!("{fixture}-as-{other}"));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::copy(
            fixture.dir().join("model.safetensors"),
            dir.join("model.safetensors"),
        )
        .unwrap();
        let mut renamed = config.clone();
        renamed["model_type"] = Value::String(other.into());
        std::fs::write(dir.join("config.json"), renamed.to_string()).unwrap();
        let err = CausalLm::load_hf(&dir)
            .err()
            .unwrap_or_else(|| panic!("{fixture} loaded as {other}"))
            .to_string();
        assert!(
            err.contains("does not use") || err.contains("cannot find"),
            "{fixture} as {other}: {err}"
        );
        if own == "qwen3" && other == "llama" {
            assert!(err.contains("q_norm") || err.contains("k_norm"), "{err}");
        }
        let err = relay_llm::sft::load_hf_trainable(&dir)
            .err()
            .unwrap()
            .to_string();
        assert!(!err.is_empty());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

/// llama.cpp's interleaved-RoPE row order of a Llama q or k weight
/// (`permute` in its converter): Hugging Face row `s · head_dim / 2 + i`
/// of each head becomes row `2 i + s`.
fn llama_cpp_permute(w: &Tensor, heads: usize) -> Tensor {
    let (rows, cols) = w.dims2().unwrap();
    w.reshape((heads, 2, rows / heads / 2, cols))
        .unwrap()
        .transpose(1, 2)
        .unwrap()
        .contiguous()
        .unwrap()
        .reshape((rows, cols))
        .unwrap()
}

/// The fixture converted to GGUF as llama.cpp's `convert_hf_to_gguf.py`
/// writes it (tensor names, metadata keys, Llama's permuted q/k rows, Llama
/// 3's scaling as `rope_freqs.weight`), in f32.
fn write_gguf_like_llama_cpp(fixture: &Fixture, path: &Path) {
    use candle_core::quantized::{gguf_file, GgmlDType, QTensor};
    let config = fixture_model_config(fixture);
    let arch = config.architecture.model_type();
    let u32_of = |n: usize| gguf_file::Value::U32(n as u32);
    let (heads, kv_heads, head_dim) = (
        config.num_attention_heads,
        config.num_key_value_heads,
        config.head_dim,
    );
    let theta = config.rope_theta;
    let eos = *config.eos_token_ids.first().expect("an eos token");
    let meta: Vec<(String, gguf_file::Value)> = vec![
        (
            "general.architecture".into(),
            gguf_file::Value::String(arch.into()),
        ),
        (
            format!("{arch}.context_length"),
            u32_of(config.max_position_embeddings),
        ),
        (
            format!("{arch}.embedding_length"),
            u32_of(config.hidden_size),
        ),
        (
            format!("{arch}.block_count"),
            u32_of(config.num_hidden_layers),
        ),
        (
            format!("{arch}.feed_forward_length"),
            u32_of(config.intermediate_size),
        ),
        (format!("{arch}.attention.head_count"), u32_of(heads)),
        (format!("{arch}.attention.head_count_kv"), u32_of(kv_heads)),
        (format!("{arch}.attention.key_length"), u32_of(head_dim)),
        (format!("{arch}.attention.value_length"), u32_of(head_dim)),
        (format!("{arch}.rope.dimension_count"), u32_of(head_dim)),
        (
            format!("{arch}.rope.freq_base"),
            gguf_file::Value::F32(theta),
        ),
        (
            format!("{arch}.attention.layer_norm_rms_epsilon"),
            gguf_file::Value::F32(config.rms_norm_eps as f32),
        ),
        (
            "tokenizer.ggml.eos_token_id".into(),
            gguf_file::Value::U32(eos),
        ),
    ];
    let mut tensors: Vec<(String, Tensor)> = Vec::new();
    for (hf, t) in fixture_tensors(fixture) {
        let gguf = hf
            .replace("model.embed_tokens", "token_embd")
            .replace("model.norm", "output_norm")
            .replace("lm_head", "output")
            .replace("model.layers.", "blk.")
            .replace(".self_attn.q_proj", ".attn_q")
            .replace(".self_attn.k_proj", ".attn_k")
            .replace(".self_attn.v_proj", ".attn_v")
            .replace(".self_attn.o_proj", ".attn_output")
            .replace(".self_attn.q_norm", ".attn_q_norm")
            .replace(".self_attn.k_norm", ".attn_k_norm")
            .replace(".input_layernorm", ".attn_norm")
            .replace(".post_attention_layernorm", ".ffn_norm")
            .replace(".mlp.gate_proj", ".ffn_gate")
            .replace(".mlp.up_proj", ".ffn_up")
            .replace(".mlp.down_proj", ".ffn_down");
        let t = match (
            arch,
            gguf.ends_with("attn_q.weight"),
            gguf.ends_with("attn_k.weight"),
        ) {
            ("llama", true, _) => llama_cpp_permute(&t, heads),
            ("llama", _, true) => llama_cpp_permute(&t, kv_heads),
            _ => t,
        };
        tensors.push((gguf, t));
    }
    if let Some(RopeScaling::Llama3 {
        factor,
        low_freq_factor: low,
        high_freq_factor: high,
        original_max_position_embeddings,
    }) = config.rope_scaling
    {
        let original = original_max_position_embeddings as f32;
        let divisors: Vec<f32> = (0..head_dim / 2)
            .map(|i| {
                let freq = 1.0 / theta.powf((2 * i) as f32 / head_dim as f32);
                let wavelen = 2.0 * std::f32::consts::PI / freq;
                if wavelen < original / high {
                    1.0
                } else if wavelen > original / low {
                    factor
                } else {
                    let smooth = (original / wavelen - low) / (high - low);
                    1.0 / ((1.0 - smooth) / factor + smooth)
                }
            })
            .collect();
        let n = divisors.len();
        tensors.push((
            "rope_freqs.weight".into(),
            Tensor::from_vec(divisors, n, &Device::Cpu).unwrap(),
        ));
    }
    let qtensors: Vec<(String, QTensor)> = tensors
        .iter()
        .map(|(n, t)| (n.clone(), QTensor::quantize(t, GgmlDType::F32).unwrap()))
        .collect();
    let meta_refs: Vec<(&str, &gguf_file::Value)> =
        meta.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let tensor_refs: Vec<(&str, &QTensor)> =
        qtensors.iter().map(|(n, t)| (n.as_str(), t)).collect();
    let mut file = std::fs::File::create(path).unwrap();
    gguf_file::write(&mut file, &meta_refs, &tensor_refs).unwrap();
}

/// The GGUF conversion loads to the reference logits, with and without
/// the PEFT adapter (trained on the Hugging Face layout), on either way of
/// holding a GGUF base that keeps float-exact logits.
fn gguf_logits_match_transformers(fixture: &Fixture) {
    use relay_llm::GgufBase;
    let dir = temp_dir(&format!("{fixture}-gguf"));
    std::fs::create_dir_all(&dir).unwrap();
    let path = match std::env::var_os("RELAY_LLM_GGUF") {
        Some(folder) => PathBuf::from(folder).join(format!("{}.gguf", fixture.name)),
        None => {
            let path = dir.join("model.gguf");
            write_gguf_like_llama_cpp(fixture, &path);
            path
        }
    };
    for base in [GgufBase::Dequantized, GgufBase::Quantized] {
        let model = CausalLm::load_gguf(&path, base).unwrap();
        let adapter = adapter(fixture, &model);
        for (i, case) in cases(fixture).iter().enumerate() {
            for (with_adapter, want) in [(false, &case.logits), (true, &case.logits_with_adapter)] {
                let mut cache = model.new_cache();
                let logits = model
                    .forward_one(
                        &case.input_ids,
                        &mut cache,
                        with_adapter.then_some(&adapter),
                    )
                    .unwrap();
                let (diff, pos) = max_diff(&logits, want);
                assert!(
                    diff < LOGIT_TOLERANCE,
                    "{base:?}, adapter {with_adapter}, case {i}: |diff| {diff} at {pos}"
                );
            }
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The engine with only its packed weights (as the inference server holds
/// a dense base) gives the same logits, with and without the adapter; the
/// paths that need the f32 weights refuse it by name.
fn packed_only_engine_matches_transformers(fixture: &Fixture) {
    let mut model = model(fixture).to_backend(Backend::Engine).unwrap();
    let adapter = adapter(fixture, &model);
    model.keep_packed_only().unwrap();
    assert!(!model.is_quantized() && !model.supports_training());
    for (i, case) in cases(fixture).iter().enumerate() {
        for (with, want) in [
            (None, &case.logits),
            (Some(&adapter), &case.logits_with_adapter),
        ] {
            let mut cache = model.new_cache();
            let logits = model
                .forward_one(&case.input_ids, &mut cache, with)
                .unwrap();
            let (diff, pos) = max_diff(&logits, want);
            assert!(
                diff < LOGIT_TOLERANCE,
                "case {i}: max |diff| {diff} at position {pos}"
            );
        }
    }
    let ids = Tensor::new(&[[1u32, 2, 3]], &Device::Cpu).unwrap();
    let err = model.forward_train(&ids, None).unwrap_err().to_string();
    assert!(err.contains("released"), "{err}");
    let candle = Backend::Candle {
        device: Device::Cpu,
        dtype: DType::F32,
    };
    let err = model.clone().to_backend(candle).unwrap_err().to_string();
    assert!(err.contains("released"), "{err}");
}

/// transformers' own half-precision logits against its f32 ones on each
/// fixture, as the largest relative L2 gap of a case's logits matrix (‖half
/// − f32‖ / ‖f32‖) with and without the adapter: `(fixture, bf16, f16)`,
/// measured by `services/bench/hf/half_precision_gaps.py` (transformers
/// 5.24, PyTorch 2.15, CPU). The logits of these random-weight models move
/// with the weights' rounding whatever computes them (bf16's 8-bit mantissa
/// alone moves them about 2.5 %, see [`hub_layout_loads_the_same`]), so the
/// bound on relay's is transformers' own, with [`HALF_MARGIN`].
const TRANSFORMERS_HALF_GAPS: [(&str, f64, f64); 3] = [
    ("tiny-qwen2", 2.97e-2, 4.31e-3),
    ("tiny-qwen3", 3.12e-2, 4.03e-3),
    ("tiny-llama3", 5.47e-2, 6.77e-3),
];

/// How much above transformers' gap relay's may be. Measured on the CPU,
/// relay's is below it everywhere but tiny-qwen2 in bf16 (3.01e-2 against
/// 2.97e-2): weights, matmul inputs and outputs and the KV cache are in the
/// dtype; the residual stream, norms, RoPE and the attention softmax stay
/// f32.
const HALF_MARGIN: f64 = 1.15;

/// The bound on relay's `dtype` logits of fixture `name` ([`TRANSFORMERS_HALF_GAPS`]).
fn half_tolerance(name: &str, dtype: DType) -> f64 {
    let (_, bf16, f16) = TRANSFORMERS_HALF_GAPS
        .iter()
        .find(|(fixture, ..)| *fixture == name)
        .unwrap_or_else(|| panic!("no transformers gap measured for {name}"));
    HALF_MARGIN
        * match dtype {
            DType::BF16 => *bf16,
            DType::F16 => *f16,
            other => panic!("{other:?} is not a half precision"),
        }
}

/// The candle backend in bf16 and f16, on the CPU and on cuda:0: logits
/// of the inference path and of the training path, without and with the
/// adapter (served: factors cast once to the dtype,
/// `place_frozen_adapter`; trained: f32 factors), within
/// [`half_tolerance`] of transformers' f32 logits: no further from them
/// than transformers' own logits in the dtype are.
fn half_precision_logits_match_transformers(fixture: &Fixture) {
    for dtype in [DType::BF16, DType::F16] {
        let tolerance = half_tolerance(fixture.name, dtype);
        for backend in candle_backends(dtype) {
            // Straight from the files to the device in the dtype.
            let model = CausalLm::load_hf_on(fixture.dir(), &backend).expect("model loads");
            let what = model.backend().describe();
            let served = LoraAdapter::load_peft(&fixture.dir().join("adapter"), model.config())
                .and_then(|a| model.place_frozen_adapter(&a))
                .expect("adapter placed");
            for (factor, var) in served.named_vars() {
                assert_eq!(
                    var.dtype(),
                    dtype,
                    "{factor}: a served factor is in {dtype:?}"
                );
            }
            let trained = adapter(fixture, &model);
            let mut worst = 0f64;
            for (i, case) in cases(fixture).iter().enumerate() {
                let ids = right_padded(&[case.input_ids.as_slice()]);
                for (path, adapter, want) in [
                    ("inference", None, &case.logits),
                    ("inference", Some(&served), &case.logits_with_adapter),
                    ("training", None, &case.logits),
                    ("training", Some(&trained), &case.logits_with_adapter),
                ] {
                    let logits = if path == "inference" {
                        let mut cache = model.new_cache();
                        model.forward_one(&case.input_ids, &mut cache, adapter)
                    } else {
                        model
                            .forward_train(&ids, adapter)
                            .and_then(|l| Ok(l.squeeze(0)?))
                    }
                    .unwrap();
                    max_diff(&logits, want); // finite, and the right shape
                    let got: Vec<f32> = logits.flatten_all().unwrap().to_vec1().unwrap();
                    let want: Vec<f32> = want.iter().flatten().copied().collect();
                    let gap = relative_gap(&got, &want);
                    worst = worst.max(gap);
                    assert!(
                        gap <= tolerance,
                        "{what}: {path} path, case {i}, adapter {}: relative gap {gap:.2e} > {tolerance}",
                        adapter.is_some()
                    );
                }
            }
            eprintln!("{what}: logits relative gap {worst:.2e}");
            eprintln!(
                "{what}: logits gap over transformers' own {:.2}",
                worst / (tolerance / HALF_MARGIN)
            );
            synchronize(&model);
        }
    }
}

/// The seed of the training checks' random batches: `RELAY_CHECK_SEED`
/// repeats one; by default a new one each run (printed), so that the
/// checks see fresh inputs every time.
fn check_seed() -> u64 {
    let seed = std::env::var("RELAY_CHECK_SEED")
        .ok()
        .map(|s| s.parse().expect("RELAY_CHECK_SEED is a number"))
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64
        });
    eprintln!("RELAY_CHECK_SEED={seed}");
    seed
}

/// What one RL update and one SFT step did, on the host.
struct Steps {
    rl_loss: f64,
    /// Every factor's gradient before the RL step, concatenated.
    rl_grads: Vec<f32>,
    /// Every factor's change made by the RL step, concatenated.
    rl_update: Vec<f32>,
    sft_loss: f64,
    sft_grads: Vec<f32>,
}

fn flat_host(tensors: impl Iterator<Item = Tensor>) -> Vec<f32> {
    tensors
        .flat_map(|t| {
            t.to_dtype(DType::F32)
                .and_then(|t| t.flatten_all())
                .and_then(|t| t.to_vec1::<f32>())
                .expect("to the host")
        })
        .collect()
}

/// Every parameter's accumulated gradient, concatenated; each must have one.
fn accumulated_grads(optimizer: &relay_llm::AdamW) -> Vec<f32> {
    flat_host(
        optimizer
            .accumulated_grads()
            .map(|(name, g)| g.unwrap_or_else(|| panic!("{name}: no gradient")).clone()),
    )
}

fn factors(adapter: &LoraAdapter) -> Vec<f32> {
    flat_host(
        adapter
            .named_vars()
            .into_iter()
            .map(|(_, v)| v.as_tensor().clone()),
    )
}

/// A REINFORCE update (2 prompts, 4 completions each, rewards in [0.5, 1.5)) and an SFT
/// step (4 examples) of the fixture's adapter, from random tokens of
/// `seed`: the behaviour log-probs are `reference`'s (the CPU engine's).
fn train_steps(model: &CausalLm, start: &LoraAdapter, reference: &CausalLm, seed: u64) -> Steps {
    use rand::{Rng, SeedableRng};
    use relay_llm::{RlTrainConfig, SftConfig, SftExample, SftTrainer, TokenExample};
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let vocab = model.config().vocab_size as u32;
    let mut tokens =
        |n: usize| -> Vec<u32> { (0..n).map(|_| rng.random_range(0..vocab)).collect() };
    let mut shapes = rand_chacha::ChaCha8Rng::seed_from_u64(seed ^ 1);
    let mut examples = Vec::new();
    let mut sft = Vec::new();
    for group in 0..2u64 {
        let prompt = tokens(shapes.random_range(3..12));
        for _ in 0..4 {
            let completion = tokens(shapes.random_range(2..9));
            let behaviour_logprobs =
                completion_logprobs(reference, Some(start), &prompt, &completion);
            examples.push(TokenExample {
                prompt: prompt.clone(),
                completion,
                behaviour_logprobs,
                reward: shapes.random_range(0.5..1.5),
                group,
                stratum: 0,
            });
        }
        for _ in 0..2 {
            sft.push(SftExample {
                prompt: prompt.clone(),
                completion: tokens(shapes.random_range(2..9)),
                alternatives: Vec::new(),
            });
        }
    }
    let batch = relay_llm::BatchConfig {
        batch_size: 8,
        minibatch_size: 4,
        max_seq_len: 64,
        truncation: relay_llm::Truncation::CutPromptStart,
        recompute_activations: true,
    };
    let optimizer = relay_llm::AdamWConfig {
        lr: 1e-3,
        ..Default::default()
    };

    let adapter = model.place_adapter(&start.deep_copy().unwrap()).unwrap();
    let config = RlTrainConfig {
        // Advantage = reward, no baseline: with one, the gradient is the
        // difference of near-equal sums, whose relative error in bf16
        // measures cancellation, not the device's arithmetic (advantage
        // estimators are host code, checked in tests/rl.rs).
        objective: relay_llm::ObjectiveConfig {
            advantage: relay_llm::AdvantageEstimator::Reinforce {
                baseline: relay_llm::Baseline::None,
            },
            ..relay_llm::ObjectiveConfig::reinforce()
        },
        batch: batch.clone(),
        optimizer: optimizer.clone(),
    };
    let mut trainer = relay_llm::RlTrainer::new(config, &adapter).unwrap();
    let rl = trainer
        .accumulate_gradients(model, &adapter, &examples)
        .unwrap();
    let rl_grads = accumulated_grads(trainer.optimizer());
    let before = factors(&adapter);
    trainer.apply_gradients().unwrap();
    let rl_update = factors(&adapter)
        .iter()
        .zip(&before)
        .map(|(a, b)| a - b)
        .collect();

    let adapter = model.place_adapter(&start.deep_copy().unwrap()).unwrap();
    let config = SftConfig {
        batch: relay_llm::BatchConfig {
            batch_size: 4,
            ..batch
        },
        optimizer,
        aggregation: Default::default(),
    };
    let mut trainer = SftTrainer::new(config, adapter.named_vars()).unwrap();
    let stats = trainer
        .accumulate_gradients(model, Some(&adapter), &sft)
        .unwrap();
    let sft_grads = accumulated_grads(trainer.optimizer());
    synchronize(model);
    Steps {
        rl_loss: rl.loss,
        rl_grads,
        rl_update,
        sft_loss: stats.loss,
        sft_grads,
    }
}

/// ‖got − want‖ / ‖want‖.
fn relative_gap(got: &[f32], want: &[f32]) -> f64 {
    assert_eq!(got.len(), want.len());
    let diff: f64 = got
        .iter()
        .zip(want)
        .map(|(a, b)| f64::from(a - b).powi(2))
        .sum();
    let norm: f64 = want.iter().map(|b| f64::from(*b).powi(2)).sum();
    assert!(diff.is_finite(), "a non-finite value");
    (diff / norm.max(f64::MIN_POSITIVE)).sqrt()
}

/// Tolerances of [`training_steps_match_the_cpu_engine`] by dtype: the
/// losses' relative difference, the gradients' relative gap, and the
/// step's (AdamW's first step is about `lr · sign(g)`, so an element whose
/// gradient is near zero may step the other way). Set from measurement
/// over 40 seeds on the CPU, with a margin (largest seen: f32 1e-5 for
/// the gradients, 4.5e-3 for the step; f16 5e-2 and 0.15; bf16 0.28 and
/// 0.41, its losses 6e-3): f16 and bf16 run the same code, so f16 (11
/// bits) is the tight check of the half-precision path, and bf16 (8 bits,
/// its backward through bf16 matmuls) the check that its kernels compute
/// the right thing at all: a missing term, a zero or a wrong sign gives a
/// gap of 1 or more.
const TRAINING_TOLERANCES: [(DType, f64, f64, f64); 3] = [
    (DType::F32, 1e-4, 1e-3, 2e-2),
    (DType::F16, 1e-2, 0.1, 0.3),
    (DType::BF16, 2e-2, 0.5, 0.8),
];

/// One RL update and one SFT step of the fixture's adapter on fresh random
/// batches ([`check_seed`]), on the candle backend in f32, f16 and bf16
/// (CPU, and cuda:0 where there is one), against the CPU engine's (the
/// fused training ops, f32): the losses, every factor's gradient (as one
/// vector) and the RL step's change of the factors, within
/// [`TRAINING_TOLERANCES`].
fn training_steps_match_the_cpu_engine(fixture: &Fixture) {
    let seed = check_seed();
    let engine = model(fixture);
    let start = adapter(fixture, &engine);
    let want = train_steps(&engine, &start, &engine, seed);
    assert!(want.rl_grads.iter().any(|g| *g != 0.0) && want.sft_grads.iter().any(|g| *g != 0.0));
    let backends = TRAINING_TOLERANCES
        .into_iter()
        .flat_map(|(dtype, loss, grad, step)| {
            candle_backends(dtype)
                .into_iter()
                .map(move |b| (b, loss, grad, step))
        });
    for (backend, loss_tolerance, tolerance, update_tolerance) in backends {
        let model = model(fixture).to_backend(backend).expect("model placed");
        let what = model.backend().describe();
        eprintln!("backend {what}");
        let got = train_steps(&model, &start, &engine, seed);
        for (part, got, want) in [
            ("RL loss", got.rl_loss, want.rl_loss),
            ("SFT loss", got.sft_loss, want.sft_loss),
        ] {
            let gap = (got - want).abs() / want.abs().max(1e-3);
            eprintln!("{what}: {part} relative difference {gap:.2e}");
            assert!(
                gap <= loss_tolerance,
                "{what}, seed {seed}: {part} {got} != {want}"
            );
        }
        for (part, got, want, tolerance) in [
            ("RL gradient", &got.rl_grads, &want.rl_grads, tolerance),
            ("SFT gradient", &got.sft_grads, &want.sft_grads, tolerance),
            ("RL step", &got.rl_update, &want.rl_update, update_tolerance),
        ] {
            let gap = relative_gap(got, want);
            eprintln!("{what}: {part} relative gap {gap:.2e}");
            assert!(
                gap <= tolerance,
                "{what}, seed {seed}: {part} relative gap {gap:.2e} > {tolerance}"
            );
        }
    }
}

/// One module per fixture and config form, each running every check
/// above, so that a test's name says its architecture (`cargo test --
/// qwen3`): `*_reference` on the fixture as written, `*_other_config_form`
/// on a copy with config.json in the other form transformers writes
/// ([`Fixture::in_other_config_form`]).
macro_rules! reference_suite {
    ($module:ident, $fixture:expr, [$($check:ident),* $(,)?]) => {
        mod $module {
            $(
                #[test]
                fn $check() {
                    super::$check(&$fixture)
                }
            )*
        }
    };
}

macro_rules! every_reference_check {
    ($module:ident, $fixture:expr) => {
        reference_suite!(
            $module,
            $fixture,
            [
                logits_match_transformers,
                greedy_with_kv_cache,
                batched_greedy_with_late_join,
                adapter_logits,
                mixed_adapters_in_one_batch,
                training_path_matches_inference_path,
                every_lora_parameter_gets_a_gradient,
                peft_round_trip,
                adapter_is_not_baked_into_the_base,
                forked_cache_continues_like_the_original,
                step_with_joining_sequence,
                prefill_fork_and_stop_token,
                step_uses_the_sequence_adapter,
                full_fine_tuning_reaches_every_weight,
                hub_layout_loads_the_same,
                other_architecture_is_refused,
                gguf_logits_match_transformers,
                packed_only_engine_matches_transformers,
                half_precision_logits_match_transformers,
                training_steps_match_the_cpu_engine,
            ]
        );
    };
}

every_reference_check!(
    tiny_qwen2_reference,
    super::Fixture::as_written("tiny-qwen2")
);
every_reference_check!(
    tiny_qwen3_reference,
    super::Fixture::as_written("tiny-qwen3")
);
every_reference_check!(
    tiny_llama3_reference,
    super::Fixture::as_written("tiny-llama3")
);
every_reference_check!(
    tiny_qwen2_other_config_form,
    super::Fixture::in_other_config_form("tiny-qwen2")
);
every_reference_check!(
    tiny_qwen3_other_config_form,
    super::Fixture::in_other_config_form("tiny-qwen3")
);
every_reference_check!(
    tiny_llama3_other_config_form,
    super::Fixture::in_other_config_form("tiny-llama3")
);
