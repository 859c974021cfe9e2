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
