//! `init::tiny` writes a Qwen2 checkpoint that the loader reads back, the
//! same for the same seed, and small enough to train with LoRA on a CPU.

use std::path::PathBuf;

use candle_core::{Device, Tensor};
use candle_nn::Optimizer;
use relay_llm::{init, token_log_probs, CausalLm, LoraAdapter, LoraConfig, TinyVocab};

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("relay-llm-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

fn vocab() -> TinyVocab {
    TinyVocab {
        size: 300,
        bos_token_id: None,
        eos_token_id: Some(2),
        pad_token_id: Some(0),
    }
}

#[test]
fn tiny_model_loads_and_is_reproducible() {
    let (a, b, c) = (temp_dir("tiny-a"), temp_dir("tiny-b"), temp_dir("tiny-c"));
    let config = init::tiny(&a, 11, &vocab()).unwrap();
    init::tiny(&b, 11, &vocab()).unwrap();
    init::tiny(&c, 12, &vocab()).unwrap();
    let bytes = |d: &PathBuf| std::fs::read(d.join("model.safetensors")).unwrap();
    assert_eq!(bytes(&a), bytes(&b));
    assert_ne!(bytes(&a), bytes(&c));
    for file in ["config.json", "generation_config.json", "model.safetensors"] {
        assert!(a.join(file).is_file(), "{file}");
    }
    let model = CausalLm::load_hf(&a).unwrap();
    assert_eq!(model.config(), &config);
    assert_eq!(config.vocab_size, 300);
    assert_eq!(config.eos_token_ids, vec![2]);
    let mut cache = model.new_cache();
    let logits = model.forward_one(&[5, 6, 7], &mut cache, None).unwrap();
    assert_eq!(logits.dims(), [3, 300]);
    let generation: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(a.join("generation_config.json")).unwrap())
            .unwrap();
    assert_eq!(generation["eos_token_id"], 2);
    assert!(init::tiny(
        &a,
        1,
        &TinyVocab {
            eos_token_id: Some(300),
            ..vocab()
        }
    )
    .is_err());
    for d in [a, b, c] {
        std::fs::remove_dir_all(d).unwrap();
    }
}

/// A few AdamW steps on one sequence through the training path lower its
/// loss: gradients reach the adapter and point the right way.
#[test]
fn lora_training_on_tiny_model_lowers_the_loss() {
    let dir = temp_dir("tiny-train");
    init::tiny(&dir, 3, &vocab()).unwrap();
    let model = CausalLm::load_hf(&dir).unwrap();
    let adapter = LoraAdapter::new(model.config(), LoraConfig::all_projections(4, 8.0), 0).unwrap();
    let mut opt = candle_nn::AdamW::new(
        adapter.vars(),
        candle_nn::ParamsAdamW {
            lr: 1e-2,
            weight_decay: 0.0,
            ..Default::default()
        },
    )
    .unwrap();
    let seq: Vec<u32> = (0..24).map(|i| (i * 37 % 290) as u32 + 3).collect();
    let ids = Tensor::new(&seq[..23], &Device::Cpu)
        .unwrap()
        .unsqueeze(0)
        .unwrap();
    let targets = Tensor::new(&seq[1..], &Device::Cpu)
        .unwrap()
        .unsqueeze(0)
        .unwrap();
    let loss = |adapter: &LoraAdapter| -> Tensor {
        let logits = model.forward_train(&ids, Some(adapter)).unwrap();
        token_log_probs(&logits, &targets)
            .unwrap()
            .mean_all()
            .unwrap()
            .neg()
            .unwrap()
    };
    let first: f32 = loss(&adapter).to_scalar().unwrap();
    for _ in 0..15 {
        opt.backward_step(&loss(&adapter)).unwrap();
    }
    let last: f32 = loss(&adapter).to_scalar().unwrap();
    assert!(last < first - 0.5, "loss {first} -> {last}");
    std::fs::remove_dir_all(dir).unwrap();
}
