//! The Qwen2 model, its KV cache, LoRA and PEFT files against
//! `fixtures/tiny-qwen2` (logits, greedy continuations and adapter logits
//! computed by transformers 5.23 and peft 0.21).
//!
//! The fixture folder is found relative to this crate, or at
//! `RELAY_TINY_QWEN2`.

use std::path::PathBuf;

use candle_core::{DType, Device, Tensor};
use relay_llm::{
    token_log_probs, Backend, BatchItem, CausalLm, KvCache, LogitsWanted, LoraAdapter, LoraConfig,
};
use serde_json::Value;

/// Tolerance on logits against transformers (float32 on both sides).
const LOGIT_TOLERANCE: f32 = 1e-4;

fn fixture_dir() -> PathBuf {
    match std::env::var_os("RELAY_TINY_QWEN2") {
        Some(dir) => PathBuf::from(dir),
        None => PathBuf::from(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../../shared/fixtures/tiny-qwen2"
        )),
    }
}

struct Case {
    input_ids: Vec<u32>,
    logits: Vec<Vec<f32>>,
    greedy: Vec<u32>,
    logits_with_adapter: Vec<Vec<f32>>,
}

fn cases() -> Vec<Case> {
    let path = fixture_dir().join("reference.json");
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{}: {e} (set RELAY_TINY_QWEN2)", path.display()));
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

fn model() -> CausalLm {
    CausalLm::load_hf(&fixture_dir()).expect("tiny-qwen2 loads")
}

fn adapter(model: &CausalLm) -> LoraAdapter {
    let adapter = LoraAdapter::load_peft(&fixture_dir().join("adapter"), model.config())
        .expect("adapter loads");
    model.place_adapter(&adapter).expect("adapter placed")
}

/// Runs `check` on the model on each backend: the CPU engine, the candle
/// backend on the CPU (f32) and, in a `cuda` build on a machine with a GPU
/// (`cargo test -p relay-llm --features cuda`), on cuda:0 (f32).
fn for_each_backend(check: impl Fn(&CausalLm)) {
    let mut backends = vec![
        Backend::Engine,
        Backend::Candle {
            device: Device::Cpu,
            dtype: DType::F32,
        },
    ];
    if relay_llm::CUDA_BUILT {
        match Device::new_cuda(0) {
            Ok(device) => backends.push(Backend::Candle {
                device,
                dtype: DType::F32,
            }),
            Err(e) => eprintln!("no CUDA device to test on: {e}"),
        }
    }
    for backend in backends {
        let model = model().to_backend(backend).expect("model placed");
        eprintln!("backend {}", model.backend().describe());
        check(&model);
    }
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

#[test]
fn tiny_qwen2_reference_logits_match_transformers() {
    for_each_backend(|model| {
        for (i, case) in cases().iter().enumerate() {
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

#[test]
fn tiny_qwen2_reference_greedy_with_kv_cache() {
    for_each_backend(|model| {
        for (i, case) in cases().iter().enumerate() {
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
#[test]
fn tiny_qwen2_reference_batched_greedy_with_late_join() {
    for_each_backend(|model| {
        let cases = cases();
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

#[test]
fn tiny_qwen2_reference_adapter_logits() {
    for_each_backend(|model| {
        let adapter = adapter(model);
        for (i, case) in cases().iter().enumerate() {
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
#[test]
fn tiny_qwen2_reference_mixed_adapters_in_one_batch() {
    for_each_backend(|model| {
        let adapter = adapter(model);
        let cases = cases();
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
#[test]
fn tiny_qwen2_reference_training_path_matches_inference_path() {
    for_each_backend(|model| {
        let adapter = adapter(model);
        let cases = cases();
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

fn next_token_loss(model: &CausalLm, adapter: &LoraAdapter) -> Tensor {
    let cases = cases();
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
#[test]
fn tiny_qwen2_reference_every_lora_parameter_gets_a_gradient() {
    for_each_backend(|model| {
        let adapter = adapter(model);
        let loss = next_token_loss(model, &adapter);
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
        let grads = next_token_loss(model, &fresh).backward().unwrap();
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

#[test]
fn tiny_qwen2_reference_peft_round_trip() {
    let model = model();
    let original = adapter(&model);
    let dir = temp_dir("peft-round-trip");
    original.save_peft(&dir, Some("tiny-qwen2")).unwrap();
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
#[test]
fn tiny_qwen2_reference_adapter_is_not_baked_into_the_base() {
    let model = model();
    let adapter = adapter(&model);
    let case = &cases()[2];
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

#[test]
fn tiny_qwen2_reference_forked_cache_continues_like_the_original() {
    for_each_backend(|model| {
        let case = &cases()[1];
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
#[test]
fn tiny_qwen2_reference_step_with_joining_sequence() {
    use relay_llm::{step, FinishReason, Sequence};
    for_each_backend(|model| {
        let cases = cases();
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
#[test]
fn tiny_qwen2_reference_prefill_fork_and_stop_token() {
    use relay_llm::{generate, prefill, FinishReason, Sampler};
    for_each_backend(|model| {
        let case = &cases()[2];
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
#[test]
fn tiny_qwen2_reference_step_uses_the_sequence_adapter() {
    use relay_llm::{step, Sampler, Sequence, StopCondition};
    for_each_backend(|model| {
        let adapter = std::sync::Arc::new(adapter(model));
        let cases = cases();
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
