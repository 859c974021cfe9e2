//! The candle backend beside the CPU engine: what the reference tests
//! (which run on both) do not cover — lower precisions, the prefix cache
//! with device caches, caches of the wrong backend, and the config checks.

use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use relay_llm::{
    Backend, BackendKind, BackendSpec, CausalLm, DeviceSpec, LlmDtype, LoraAdapter, LoraConfig,
    PrefixCache,
};

fn tiny_qwen2() -> CausalLm {
    CausalLm::load_hf(&relay_testkit::llm_fixture("tiny-qwen2")).expect("tiny-qwen2 loads")
}

fn candle(dtype: DType) -> Backend {
    Backend::Candle {
        device: Device::Cpu,
        dtype,
    }
}

fn prompt() -> Vec<u32> {
    (0..40).map(|i| (i * 37 + 11) % 200).collect()
}

fn logits(model: &CausalLm, tokens: &[u32], adapter: Option<&LoraAdapter>) -> Vec<Vec<f32>> {
    let mut cache = model.new_cache();
    model
        .forward_one(tokens, &mut cache, adapter)
        .unwrap()
        .to_vec2()
        .unwrap()
}

fn max_gap(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    a.iter()
        .flatten()
        .zip(b.iter().flatten())
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// An adapter whose B is not zero, so it changes the logits.
fn nonzero_adapter(model: &CausalLm, seed: u64) -> LoraAdapter {
    let adapter =
        LoraAdapter::new(model.config(), LoraConfig::all_projections(4, 8.0), seed).unwrap();
    // Deterministic values in [-0.05, 0.05] (PEFT starts B at zero).
    for (k, var) in adapter.vars().into_iter().enumerate() {
        let t = var.as_tensor();
        let n = t.elem_count();
        let values: Vec<f32> = (0..n)
            .map(|i| 0.05 * ((i as f32) * 0.7 + (seed + k as u64) as f32).sin())
            .collect();
        let noise = Tensor::from_vec(values, t.shape(), &Device::Cpu).unwrap();
        var.set(&(t + noise).unwrap()).unwrap();
    }
    adapter
}

/// bf16 and f16 stay close to f32: the same greedy token at every
/// position where f32's best token leads clearly, and small logit gaps.
#[test]
fn candle_backend_bf16_and_f16_stay_close_to_f32() {
    let engine = tiny_qwen2();
    let adapter = nonzero_adapter(&engine, 5);
    let tokens = prompt();
    let want = logits(&engine, &tokens, Some(&adapter));
    let scale = want.iter().flatten().fold(0f32, |m, x| m.max(x.abs()));
    // Relative to the largest logit: bf16 keeps 8 bits of mantissa, f16 11.
    for (dtype, relative) in [(DType::BF16, 0.05), (DType::F16, 0.01)] {
        let tolerance = relative * scale;
        let model = tiny_qwen2().to_backend(candle(dtype)).unwrap();
        let placed = model.place_adapter(&adapter).unwrap();
        let got = logits(&model, &tokens, Some(&placed));
        let gap = max_gap(&got, &want);
        eprintln!("{dtype:?}: max |logit gap| {gap} (largest |logit| {scale})");
        assert!(gap < tolerance, "{dtype:?}: max |logit gap| {gap}");
        for (row_got, row_want) in got.iter().zip(&want) {
            let mut sorted = row_want.clone();
            sorted.sort_by(|a, b| b.total_cmp(a));
            if sorted[0] - sorted[1] > 2.0 * tolerance {
                let best = |r: &[f32]| (0..r.len()).max_by(|&i, &j| r[i].total_cmp(&r[j]));
                assert_eq!(best(row_got), best(row_want), "{dtype:?}");
            }
        }
    }
}

/// Two adapters and the base in one batch, on device caches continued
/// from the prefix cache, give each sequence the engine's logits.
#[test]
fn candle_backend_prefix_cache_and_mixed_adapters_match_the_engine() {
    let engine = tiny_qwen2();
    let model = tiny_qwen2().to_backend(candle(DType::F32)).unwrap();
    let adapters = [nonzero_adapter(&engine, 1), nonzero_adapter(&engine, 2)];
    let placed: Vec<Arc<LoraAdapter>> = adapters
        .iter()
        .map(|a| Arc::new(model.place_adapter(a).unwrap()))
        .collect();
    let tokens = prompt();
    let (shared, rest) = tokens.split_at(30);
    let mut prefixes = PrefixCache::new(4, 16);
    for adapter in &placed {
        let mut cache = model.new_cache();
        model
            .forward_one(shared, &mut cache, Some(adapter))
            .unwrap();
        prefixes.insert(Some(adapter), shared, &cache);
    }
    let mut caches: Vec<_> = placed
        .iter()
        .map(|a| prefixes.lookup(Some(a), &tokens).expect("prefix held"))
        .collect();
    assert!(caches.iter().all(|c| c.len() == 30));
    assert!(caches[0].allocated_bytes() > 0);
    let mut base_cache = model.new_cache();
    let [first, second] = caches.as_mut_slice() else {
        unreachable!("two adapters")
    };
    let mut items = vec![
        relay_llm::BatchItem {
            tokens: rest,
            cache: first,
            adapter: Some(&placed[0]),
        },
        relay_llm::BatchItem {
            tokens: &tokens,
            cache: &mut base_cache,
            adapter: None,
        },
        relay_llm::BatchItem {
            tokens: rest,
            cache: second,
            adapter: Some(&placed[1]),
        },
    ];
    let got: Vec<Vec<f32>> = model
        .forward_batch(&mut items, relay_llm::LogitsWanted::Last)
        .unwrap()
        .to_vec2()
        .unwrap();
    let last = |a: Option<&LoraAdapter>| logits(&engine, &tokens, a).pop().unwrap();
    let want = [
        last(Some(&adapters[0])),
        last(None),
        last(Some(&adapters[1])),
    ];
    let gap = max_gap(&got, &want);
    assert!(gap < 1e-4, "max |logit gap| {gap}");
}

/// Logits of the last token of `tokens` from the CPU engine, fed alone.
fn engine_last(engine: &CausalLm, tokens: &[u32]) -> Vec<f32> {
    logits(engine, tokens, None).pop().unwrap()
}

/// One-token decodes of sequences of many lengths (across block
/// boundaries), in a batch also holding a prefill, in any order, each get
/// the logits they get alone: the batched attention's padding and
/// gathering mix no sequence's keys into another's.
#[test]
fn a_paged_step_of_many_lengths_equals_each_sequence_alone() {
    let engine = tiny_qwen2();
    let model = tiny_qwen2().to_backend(candle(DType::F32)).unwrap();
    let all = prompt();
    let lengths = [1, 5, 16, 17, 33, 40];
    let mut histories: Vec<Vec<u32>> = lengths.iter().map(|&n| all[..n].to_vec()).collect();
    let mut caches: Vec<_> = histories
        .iter()
        .map(|h| {
            let mut cache = model.new_cache();
            model.forward_one(&h[..h.len() - 1], &mut cache, None).ok();
            cache
        })
        .collect();
    // The one-token history fed nothing yet: its first step feeds it.
    let mut fresh = model.new_cache();
    let late_prompt: Vec<u32> = all[3..30].to_vec();
    for step in 0..3u32 {
        // Fed in a shuffled order, the late prompt in the middle.
        let order = [4, 0, 5, 2, 1, 3];
        let mut slots: Vec<Option<&mut relay_llm::KvCache>> = caches.iter_mut().map(Some).collect();
        let fed: Vec<Vec<u32>> = histories
            .iter()
            .zip(&lengths)
            .map(|(h, &n)| {
                if step == 0 && n == 1 {
                    h.clone()
                } else {
                    vec![*h.last().unwrap()]
                }
            })
            .collect();
        let mut late = (step == 0).then_some(&mut fresh);
        let mut items = Vec::new();
        for (k, &i) in order.iter().enumerate() {
            if k == 3 {
                if let Some(cache) = late.take() {
                    items.push(relay_llm::BatchItem {
                        tokens: &late_prompt,
                        cache,
                        adapter: None,
                    });
                }
            }
            items.push(relay_llm::BatchItem {
                tokens: &fed[i],
                cache: slots[i].take().unwrap(),
                adapter: None,
            });
        }
        let got: Vec<Vec<f32>> = model
            .forward_batch(&mut items, relay_llm::LogitsWanted::Last)
            .unwrap()
            .to_vec2()
            .unwrap();
        drop(items);
        let mut row = 0;
        for (k, &i) in order.iter().enumerate() {
            if k == 3 && step == 0 {
                let gap = max_gap(&got[row..=row], &[engine_last(&engine, &late_prompt)]);
                assert!(gap < 1e-4, "the prefill beside the decodes: gap {gap}");
                row += 1;
            }
            let gap = max_gap(&got[row..=row], &[engine_last(&engine, &histories[i])]);
            assert!(
                gap < 1e-4,
                "step {step}, length {}: gap {gap}",
                histories[i].len()
            );
            row += 1;
        }
        for h in &mut histories {
            h.push((step * 31 + h.len() as u32) % 200);
        }
    }
    assert_eq!(caches[5].len(), 42);
}

/// A fork shares its parent's blocks; where either writes into a shared
/// block it gets a copy first, so both continue as if alone, and dropping
/// them gives every block back.
#[test]
fn forks_share_blocks_and_copy_on_write() {
    let engine = tiny_qwen2();
    let model = tiny_qwen2().to_backend(candle(DType::F32)).unwrap();
    let pool = model
        .kv_pool()
        .expect("the candle backend pages its caches");
    let tokens = prompt();
    let mut parent = model.new_cache();
    model.forward_one(&tokens, &mut parent, None).unwrap();
    // 40 positions: blocks of 16, 16 and 8.
    assert_eq!(pool.usage().used_blocks, 3);
    let mut child = parent.fork_prefix(20).unwrap();
    let mut twin = parent.fork().unwrap();
    assert_eq!(pool.usage().used_blocks, 3, "forks copy nothing");
    assert_eq!(child.allocated_bytes(), 2 * pool.block_bytes());
    // The child writes into the second block (shared): it is copied.
    let child_tokens: Vec<u32> = (0..10).map(|i| 150 + i).collect();
    let got = model.forward_one(&child_tokens, &mut child, None).unwrap();
    assert_eq!(pool.usage().used_blocks, 4);
    let mut history = tokens[..20].to_vec();
    history.extend(&child_tokens);
    let last = got.to_vec2::<f32>().unwrap().pop().unwrap();
    assert!(max_gap(&[last], &[engine_last(&engine, &history)]) < 1e-4);
    // Parent and twin both continue from the third block (shared by them).
    for (cache, token) in [(&mut parent, 7u32), (&mut twin, 9)] {
        let got = model.forward_one(&[token], cache, None).unwrap();
        let mut history = tokens.clone();
        history.push(token);
        let last = got.to_vec2::<f32>().unwrap().pop().unwrap();
        assert!(max_gap(&[last], &[engine_last(&engine, &history)]) < 1e-4);
    }
    assert_eq!(pool.usage().used_blocks, 5);
    drop((parent, child, twin));
    assert_eq!(pool.usage().used_blocks, 0);
}

/// A pool bounded to a few blocks refuses a sequence past the bound with
/// an error that names the setting; the sequence that refused advances
/// nothing, the others keep their keys and values, and once blocks are
/// given back the refused one goes through.
#[test]
fn a_full_pool_refuses_by_name_and_loses_nothing() {
    let engine = tiny_qwen2();
    let model = tiny_qwen2().to_backend(candle(DType::F32)).unwrap();
    let pool = model.kv_pool().unwrap();
    pool.set_limit_bytes(Some(4 * pool.block_bytes()));
    assert_eq!(pool.usage().free_blocks(), Some(4));
    let tokens = prompt();
    let mut first = model.new_cache();
    model.forward_one(&tokens, &mut first, None).unwrap();
    let mut second = model.new_cache();
    let err = model.forward_one(&tokens, &mut second, None).unwrap_err();
    assert!(
        matches!(err, relay_llm::ModelError::KvCacheFull { .. }),
        "{err}"
    );
    assert!(err.to_string().contains("llm.kv_cache_mib"), "{err}");
    assert!(second.is_empty());
    // The first still decodes right.
    let got = model.forward_one(&[5], &mut first, None).unwrap();
    let mut history = tokens.clone();
    history.push(5);
    let last = got.to_vec2::<f32>().unwrap().pop().unwrap();
    assert!(max_gap(&[last], &[engine_last(&engine, &history)]) < 1e-4);
    drop(first);
    second.truncate(0);
    model.forward_one(&tokens, &mut second, None).unwrap();
    assert_eq!(second.len(), tokens.len());
}

/// A cache of one backend handed to a model on the other is refused, by
/// name, and advances nothing.
#[test]
fn candle_backend_refuses_a_cache_of_the_other_backend() {
    let engine = tiny_qwen2();
    let model = tiny_qwen2().to_backend(candle(DType::F32)).unwrap();
    let mut host = engine.new_cache();
    let err = model.forward_one(&[1, 2, 3], &mut host, None).unwrap_err();
    assert!(err.to_string().contains("another backend"), "{err}");
    assert!(host.is_empty());
    let mut device = model.new_cache();
    let err = engine
        .forward_one(&[1, 2, 3], &mut device, None)
        .unwrap_err();
    assert!(err.to_string().contains("another backend"), "{err}");
}

/// What config checks say: the engine is f32 on the CPU only, and CUDA
/// needs the `cuda` feature (named with the command that builds it).
#[test]
fn candle_backend_spec_errors_name_the_field() {
    let spec = |kind, device, dtype| BackendSpec {
        kind,
        device,
        dtype,
    };
    let err = spec(BackendKind::Engine, DeviceSpec::Cuda(0), LlmDtype::F32)
        .validate()
        .unwrap_err();
    assert_eq!(err.field, "llm.device");
    assert!(err.detail.contains("llm.backend: candle"), "{err}");
    let err = spec(BackendKind::Engine, DeviceSpec::Cpu, LlmDtype::Bf16)
        .validate()
        .unwrap_err();
    assert_eq!(err.field, "llm.dtype");
    assert!(spec(BackendKind::Candle, DeviceSpec::Cpu, LlmDtype::Bf16)
        .validate()
        .is_ok());
    let cuda = spec(BackendKind::Candle, DeviceSpec::Cuda(1), LlmDtype::Bf16);
    if relay_llm::CUDA_BUILT {
        // Built with CUDA: opening a missing GPU says what was found.
        if let Err(e) = relay_llm::Backend::open(&cuda) {
            assert!(e.to_string().contains("llm.device: cuda:1"), "{e}");
        }
    } else {
        let err = cuda.validate().unwrap_err().to_string();
        assert!(
            err.contains("llm.device: cuda:1") && err.contains("just build-cuda"),
            "{err}"
        );
    }
    // `auto`: the engine for f32 on the CPU, the candle backend otherwise.
    let auto = |device, dtype| spec(BackendKind::Auto, device, dtype).resolved_kind();
    assert_eq!(auto(DeviceSpec::Cpu, LlmDtype::F32), BackendKind::Engine);
    assert_eq!(auto(DeviceSpec::Cpu, LlmDtype::Bf16), BackendKind::Candle);
    assert_eq!(
        auto(DeviceSpec::Cuda(0), LlmDtype::F32),
        BackendKind::Candle
    );
    assert_eq!("cuda".parse::<DeviceSpec>(), Ok(DeviceSpec::Cuda(0)));
    assert_eq!("cuda:3".parse::<DeviceSpec>(), Ok(DeviceSpec::Cuda(3)));
    assert!("gpu".parse::<DeviceSpec>().unwrap_err().contains("cpu"));
}

/// Loading straight onto the backend (`load_hf_on`: the files' tensors
/// converted to the dtype on the device, the norms read in f32) computes
/// exactly what loading for the engine and then placing does.
#[test]
fn loading_onto_a_backend_equals_placing_after_loading() {
    for fixture in ["tiny-qwen2", "tiny-qwen3", "tiny-llama3"] {
        let dir = relay_testkit::llm_fixture(fixture);
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            let direct = CausalLm::load_hf_on(&dir, &candle(dtype)).unwrap();
            let placed = CausalLm::load_hf(&dir)
                .unwrap()
                .to_backend(candle(dtype))
                .unwrap();
            assert_eq!(
                logits(&direct, &prompt(), None),
                logits(&placed, &prompt(), None),
                "{fixture} in {dtype:?}"
            );
        }
    }
}

/// Gradients of a loss through `forward`, by var, as host vectors.
fn gradients(
    forward: relay_llm::TrainForward<'_>,
    vars: &[(String, candle_core::Var)],
    seed: u64,
) -> Vec<(String, Vec<f32>)> {
    // A loss that reads every logit with its own weight.
    let logits = forward.logits().clone();
    let n = logits.elem_count();
    let weights: Vec<f32> = (0..n)
        .map(|i| ((i as u64 * 2654435761 + seed) % 1000) as f32 / 1000.0 - 0.5)
        .collect();
    let weights = Tensor::from_vec(weights, logits.shape(), logits.device()).unwrap();
    let loss = (logits * weights).unwrap().sum_all().unwrap();
    let grads = forward.backward(&loss).unwrap();
    vars.iter()
        .map(|(name, var)| {
            let g = grads
                .get(var.as_tensor())
                .unwrap_or_else(|| panic!("{name} gets a gradient"));
            (name.clone(), g.flatten_all().unwrap().to_vec1().unwrap())
        })
        .collect()
}

/// Recomputing each block's activations in the backward pass (activation
/// checkpointing) gives the gradients of the plain backward: for a LoRA
/// adapter on each reference architecture, and for every weight of a
/// fully trained model (embedding, norms, projections, head).
#[test]
fn recomputed_activations_give_the_plain_gradients() {
    let rows: Vec<(Vec<u32>, Vec<u32>)> = vec![
        ((0..20).map(|i| (i * 7 + 3) % 300).collect(), vec![5, 9, 11]),
        ((0..9).map(|i| (i * 13 + 1) % 300).collect(), vec![17, 2]),
    ];
    let pairs: Vec<(&[u32], &[u32])> = rows
        .iter()
        .map(|(p, c)| (p.as_slice(), c.as_slice()))
        .collect();
    let batch = relay_llm::TokenBatch::new(&pairs, &Device::Cpu).unwrap();
    let compare =
        |what: &str, plain: Vec<(String, Vec<f32>)>, recomputed: Vec<(String, Vec<f32>)>| {
            for ((name, a), (_, b)) in plain.iter().zip(&recomputed) {
                let scale = a.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-6);
                let gap = a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
                assert!(gap <= 1e-5 * scale, "{what} {name}: gap {gap} of {scale}");
            }
        };
    for fixture in ["tiny-qwen2", "tiny-qwen3", "tiny-llama3"] {
        let model = CausalLm::load_hf(&relay_testkit::llm_fixture(fixture))
            .unwrap()
            .to_backend(candle(DType::F32))
            .unwrap();
        let adapter = model.place_adapter(&nonzero_adapter(&model, 3)).unwrap();
        let vars = adapter.named_vars();
        let run = |recompute| {
            let forward = model
                .forward_train_for_backward(&batch, Some(&adapter), recompute)
                .unwrap();
            gradients(forward, &vars, 7)
        };
        assert!(matches!(
            model
                .forward_train_for_backward(&batch, Some(&adapter), true)
                .unwrap(),
            relay_llm::TrainForward::Recomputed(_)
        ));
        compare(fixture, run(false), run(true));
    }
    let (model, varmap) = relay_llm::sft::load_hf_trainable_on(
        &relay_testkit::llm_fixture("tiny-qwen2"),
        &candle(DType::F32),
    )
    .unwrap();
    let vars = relay_llm::sft::named_vars(&varmap);
    let run = |recompute| {
        let forward = model
            .forward_train_for_backward(&batch, None, recompute)
            .unwrap();
        gradients(forward, &vars, 11)
    };
    compare("full fine-tuning", run(false), run(true));
}
