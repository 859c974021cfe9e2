//! SFT: the JSONL reader, chat rendering as the inference server prompts,
//! and training a LoRA adapter or the whole tiny model (written by
//! `init::tiny_with_shape` with the tokenizer of `write_tiny_tokenizer`)
//! until greedy decoding reproduces the trained moves.

use std::path::PathBuf;

use candle_core::{Device, Tensor};
use relay_llm::sft::{
    chat_pair, encode_record, load_hf_trainable_on, load_sft_jsonl, named_vars, next_token_targets,
    read_sft_jsonl, save_hf_trainable, sft_loss,
};
use relay_llm::{
    init, write_tiny_tokenizer, AdamWConfig, BatchConfig, CausalLm, ChatMessage, LoraAdapter,
    LoraConfig, SftConfig, SftExample, SftFormat, SftRecord, SftTrainer, TinyShape, TinyVocab,
    TokenBatch, Tokenizer, TrainError, Truncation,
};

struct TempDir(PathBuf);

impl TempDir {
    fn new(name: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("relay-llm-sft-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        Self(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The tiny tokenizer and a small random Qwen2 model sized to it, its
/// matrices drawn with standard deviation `init_std`.
fn tiny_model_dir_with_init(name: &str, init_std: f64) -> (TempDir, Tokenizer) {
    let dir = TempDir::new(name);
    let vocab_size = write_tiny_tokenizer(&dir.0).unwrap();
    let tokenizer = Tokenizer::from_hf_dir(&dir.0).unwrap();
    let vocab = TinyVocab {
        size: vocab_size,
        bos_token_id: None,
        eos_token_id: tokenizer.eos_token_id(),
        pad_token_id: Some(0),
    };
    let shape = TinyShape {
        hidden_size: 64,
        intermediate_size: 128,
        num_hidden_layers: 2,
        num_attention_heads: 4,
        num_key_value_heads: 2,
        max_position_embeddings: 256,
        initializer_range: init_std,
        ..TinyShape::default()
    };
    init::tiny_with_shape(&dir.0, 9, &vocab, &shape).unwrap();
    (dir, tokenizer)
}

/// [`tiny_model_dir_with_init`] with Hugging Face's default 0.02.
fn tiny_model_dir(name: &str) -> (TempDir, Tokenizer) {
    tiny_model_dir_with_init(name, 0.02)
}

const PAIRS: [(&str, &str); 4] = [
    ("You are X. The board is empty. Your move.", "[4]"),
    ("You are O. X took the centre. Your move.", "[0]"),
    ("You are X. O holds a corner. Your move.", "[8]"),
    ("You are O. Two in a row for X on top. Block!", "[2]"),
];

fn pairs(tokenizer: &Tokenizer) -> Vec<SftExample> {
    PAIRS
        .iter()
        .map(|(obs, act)| chat_pair(tokenizer, None, obs, act).unwrap())
        .collect()
}

/// Greedy decoding through the inference path (fused kernels, KV cache).
fn greedy(
    model: &CausalLm,
    adapter: Option<&LoraAdapter>,
    prompt: &[u32],
    eos: u32,
    max: usize,
) -> Vec<u32> {
    let mut cache = model.new_cache();
    let mut out = Vec::new();
    let mut logits = model.forward_one(prompt, &mut cache, adapter).unwrap();
    for _ in 0..max {
        let last = logits.get(logits.dim(0).unwrap() - 1).unwrap();
        let token = last.argmax(0).unwrap().to_scalar::<u32>().unwrap();
        out.push(token);
        if token == eos {
            break;
        }
        logits = model.forward_one(&[token], &mut cache, adapter).unwrap();
    }
    out
}

fn sft_config(lr: f64) -> SftConfig {
    SftConfig {
        batch: BatchConfig {
            batch_size: 4,
            minibatch_size: 2,
            max_seq_len: 128,
            truncation: Truncation::CutPromptStart,
            recompute_activations: true,
        },
        optimizer: AdamWConfig {
            lr,
            ..Default::default()
        },
        aggregation: Default::default(),
    }
}

#[test]
fn chat_pairs_render_as_the_server_prompts() {
    let (_dir, tokenizer) = tiny_model_dir("render");
    let eos = tokenizer.eos_token_id().unwrap();
    let example = chat_pair(&tokenizer, None, "Board: empty", "[4]").unwrap();
    assert_eq!(
        example.prompt,
        tokenizer
            .encode_chat(&[ChatMessage::user("Board: empty")], true)
            .unwrap()
    );
    assert_eq!(example.completion, {
        let mut c = tokenizer.encode("[4]", false).unwrap();
        c.push(eos);
        c
    });
    // Prompt and completion spell the whole conversation up to the
    // assistant's end-of-turn token.
    let all: Vec<u32> = example
        .prompt
        .iter()
        .chain(&example.completion)
        .copied()
        .collect();
    let full = tokenizer
        .apply_chat_template(
            &[
                ChatMessage::user("Board: empty"),
                ChatMessage::assistant("[4]"),
            ],
            false,
        )
        .unwrap();
    assert_eq!(
        tokenizer.decode(&all, false).unwrap(),
        full.trim_end_matches('\n')
    );

    // A conversation record with a system prompt renders like a pair with it.
    let record = SftRecord::Messages {
        messages: vec![
            ChatMessage::system("Play well."),
            ChatMessage::user("Board: empty"),
            ChatMessage::assistant("[4]"),
        ],
    };
    let from_messages = encode_record(&tokenizer, &SftFormat::default(), &record).unwrap();
    let with_system = chat_pair(&tokenizer, Some("Play well."), "Board: empty", "[4]").unwrap();
    assert_eq!(from_messages, with_system);
    let pair = SftRecord::Pair {
        prompt: "Board: empty".into(),
        completion: "[4]".into(),
        alternatives: Vec::new(),
    };
    let format = SftFormat::Chat {
        system_prompt: Some("Play well.".into()),
    };
    assert_eq!(
        encode_record(&tokenizer, &format, &pair).unwrap(),
        with_system
    );
    let raw = encode_record(&tokenizer, &SftFormat::Raw { append_eos: false }, &pair).unwrap();
    assert_eq!(raw.prompt, tokenizer.encode("Board: empty", false).unwrap());
    assert_eq!(raw.completion, tokenizer.encode("[4]", false).unwrap());
    // The last message must be the assistant's.
    let bad = SftRecord::Messages {
        messages: vec![ChatMessage::user("hi")],
    };
    assert!(encode_record(&tokenizer, &SftFormat::default(), &bad).is_err());
}

#[test]
fn jsonl_reader_takes_pairs_and_conversations_and_names_bad_lines() {
    let (dir, tokenizer) = tiny_model_dir("jsonl");
    let path = dir.0.join("data.jsonl");
    std::fs::write(
        &path,
        concat!(
            r#"{"prompt": "Board: empty", "completion": "[4]"}"#,
            "\n\n",
            r#"{"messages": [{"role": "user", "content": "Board: X in 4"}, {"role": "assistant", "content": "[0]"}]}"#,
            "\n"
        ),
    )
    .unwrap();
    let records = read_sft_jsonl(&path).unwrap();
    assert_eq!(
        records,
        vec![
            SftRecord::Pair {
                prompt: "Board: empty".into(),
                completion: "[4]".into(),
                alternatives: Vec::new(),
            },
            SftRecord::Messages {
                messages: vec![
                    ChatMessage::user("Board: X in 4"),
                    ChatMessage::assistant("[0]")
                ]
            }
        ]
    );
    let examples = load_sft_jsonl(&path, &tokenizer, &SftFormat::default()).unwrap();
    assert_eq!(
        examples,
        vec![
            chat_pair(&tokenizer, None, "Board: empty", "[4]").unwrap(),
            chat_pair(&tokenizer, None, "Board: X in 4", "[0]").unwrap(),
        ]
    );

    std::fs::write(
        &path,
        "{\"prompt\": \"a\", \"completion\": \"b\"}\n{\"prompt\": \"a\"}\n",
    )
    .unwrap();
    match read_sft_jsonl(&path) {
        Err(TrainError::Jsonl { line, .. }) => assert_eq!(line, 2),
        other => panic!("expected a JSONL error on line 2, got {other:?}"),
    }
}

#[test]
fn lora_sft_lowers_the_loss_and_greedy_decoding_reproduces_the_moves() {
    // LoRA cannot change the (tied) embedding or the final norm, so the
    // logits stay within about |embedding row| · sqrt(hidden): ±1.3 at
    // the default std 0.02 and hidden 64, too flat to fit 4 moves out of
    // 512 tokens. A std of 0.1 gives the head the range a trained model has.
    let (dir, tokenizer) = tiny_model_dir_with_init("lora", 0.1);
    // On the CPU engine (fused training ops) and on the candle backend
    // (the composed forward every device has).
    let candle = relay_llm::Backend::Candle {
        device: candle_core::Device::Cpu,
        dtype: candle_core::DType::F32,
    };
    for backend in [relay_llm::Backend::Engine, candle] {
        let model = CausalLm::load_hf(&dir.0)
            .unwrap()
            .to_backend(backend)
            .unwrap();
        let eos = tokenizer.eos_token_id().unwrap();
        let adapter =
            LoraAdapter::new(model.config(), LoraConfig::all_projections(8, 16.0), 0).unwrap();
        let adapter = model.place_adapter(&adapter).unwrap();
        let data = pairs(&tokenizer);
        let mut trainer = SftTrainer::new(sft_config(1e-2), adapter.named_vars()).unwrap();
        let before = trainer.evaluate(&model, Some(&adapter), &data).unwrap();
        assert_eq!(
            before.tokens,
            data.iter().map(|e| e.completion.len()).sum::<usize>()
        );
        let mut last = before;
        for _ in 0..40 {
            last = trainer.train_epoch(&model, Some(&adapter), &data).unwrap()[0];
        }
        let after = trainer.evaluate(&model, Some(&adapter), &data).unwrap();
        assert!(
            after.loss < 0.25 * before.loss,
            "loss {} -> {}",
            before.loss,
            after.loss
        );
        assert_eq!(after.token_accuracy, 1.0);
        assert!(last.grad_norm > 0.0);
        for e in &data {
            assert_eq!(
                greedy(&model, Some(&adapter), &e.prompt, eos, 8),
                e.completion,
                "{:?}",
                tokenizer.decode(&e.prompt, false)
            );
        }
        // The base model (no adapter) did not change.
        let base = trainer.evaluate(&model, None, &data).unwrap();
        assert_eq!(base.loss, before.loss);
    }
}

#[test]
fn full_model_sft_trains_every_weight_and_saves() {
    let (dir, tokenizer) = tiny_model_dir("full");
    let eos = tokenizer.eos_token_id().unwrap();
    // On the CPU engine and, with the vars on its device, the candle backend.
    let candle = relay_llm::Backend::Candle {
        device: Device::Cpu,
        dtype: candle_core::DType::F32,
    };
    for backend in [relay_llm::Backend::Engine, candle] {
        let (model, varmap) = load_hf_trainable_on(&dir.0, &backend).unwrap();
        // Same weights as the frozen loader.
        let frozen = CausalLm::load_hf(&dir.0)
            .unwrap()
            .to_backend(backend)
            .unwrap();
        let data = pairs(&tokenizer);
        let ids = Tensor::new(&data[0].prompt[..], &Device::Cpu)
            .unwrap()
            .unsqueeze(0)
            .unwrap();
        let diff = (model.forward_train(&ids, None).unwrap()
            - frozen.forward_train(&ids, None).unwrap())
        .unwrap()
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap();
        assert_eq!(diff, 0.0);

        let params = named_vars(&varmap);
        // Embedding, 2 × (7 projections + 3 biases + 2 norms), final norm; the head is tied.
        assert_eq!(params.len(), 1 + 2 * 12 + 1);
        let mut trainer = SftTrainer::new(sft_config(3e-3), params).unwrap();
        trainer.accumulate_gradients(&model, None, &data).unwrap();
        for (name, grad) in trainer.optimizer().accumulated_grads() {
            let grad = grad.unwrap_or_else(|| panic!("{name}: no gradient"));
            let norm = grad
                .sqr()
                .unwrap()
                .sum_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap();
            assert!(norm > 0.0, "{name}: zero gradient");
        }
        trainer.optimizer_mut().zero_grad();

        let before = trainer.evaluate(&model, None, &data).unwrap();
        for _ in 0..40 {
            trainer.train_epoch(&model, None, &data).unwrap();
        }
        let after = trainer.evaluate(&model, None, &data).unwrap();
        assert!(
            after.loss < 0.1 * before.loss,
            "loss {} -> {}",
            before.loss,
            after.loss
        );
        for e in &data {
            assert_eq!(greedy(&model, None, &e.prompt, eos, 8), e.completion);
        }

        // Saved and loaded back by the ordinary loader: the same predictions.
        let out = TempDir::new("full-saved");
        save_hf_trainable(&varmap, model.config(), &out.0).unwrap();
        let reloaded = CausalLm::load_hf(&out.0).unwrap();
        for e in &data {
            assert_eq!(greedy(&reloaded, None, &e.prompt, eos, 8), e.completion);
        }
    }
}

#[test]
fn sft_truncation_and_batch_limits() {
    let (dir, tokenizer) = tiny_model_dir("limits");
    let model = CausalLm::load_hf(&dir.0).unwrap();
    let adapter = LoraAdapter::new(model.config(), LoraConfig::all_projections(4, 8.0), 0).unwrap();
    let data = pairs(&tokenizer);
    let mut config = sft_config(1e-3);
    let shortest = data
        .iter()
        .map(|e| e.prompt.len() + e.completion.len())
        .min()
        .unwrap();
    config.batch.max_seq_len = shortest;
    let mut trainer = SftTrainer::new(config.clone(), adapter.named_vars()).unwrap();
    let stats = trainer.train_step(&model, Some(&adapter), &data).unwrap();
    let longer = data
        .iter()
        .filter(|e| e.prompt.len() + e.completion.len() > shortest)
        .count();
    let cut: usize = data
        .iter()
        .map(|e| (e.prompt.len() + e.completion.len()).saturating_sub(shortest))
        .sum();
    assert!(longer > 0);
    assert_eq!(stats.truncated, longer);
    assert_eq!(stats.tokens_cut, cut);
    assert_eq!(stats.dropped, 0);
    assert_eq!(stats.mean_seq_len, shortest as f64);

    let mut five = data.clone();
    five.push(data[0].clone());
    assert!(trainer.train_step(&model, Some(&adapter), &five).is_err());
    config.batch.max_seq_len = 1;
    assert!(SftTrainer::new(config, adapter.named_vars()).is_err());
}

#[test]
fn next_token_targets_follow_the_alternatives_along_the_completion() {
    let completion = [1, 5, 9];
    let alternatives = vec![vec![1, 5, 9], vec![1, 6, 9], vec![1, 6, 8], vec![2, 7]];
    assert_eq!(
        next_token_targets(&completion, &alternatives),
        vec![
            vec![(1, 0.75), (2, 0.25)],
            vec![(5, 1.0 / 3.0), (6, 2.0 / 3.0)],
            vec![(9, 1.0)],
        ]
    );
    let hard = vec![vec![(1, 1.0)], vec![(5, 1.0)], vec![(9, 1.0)]];
    assert_eq!(next_token_targets(&completion, &[]), hard);
    // No alternative continues the prefix: the completion's own token.
    assert_eq!(
        next_token_targets(&completion, &[vec![2, 7]])[1],
        vec![(5, 1.0)]
    );
}

#[test]
fn soft_target_loss_and_gradient_are_the_cross_entropy_against_the_distribution() {
    let device = Device::Cpu;
    let rows: Vec<(&[u32], &[u32])> = vec![(&[3, 4], &[1, 2]), (&[5], &[3])];
    let batch = TokenBatch::new(&rows, &device).unwrap();
    let raw = [
        [0.5f32, -1.0, 2.0, 0.0],
        [1.0, 0.9, 0.0, -2.0],
        [0.0, 0.3, -0.7, 1.2],
    ];
    let logits = candle_core::Var::new(&raw, &device).unwrap();
    let w = [0.5f32, 0.25, 0.25];
    let weights = Tensor::new(&w, &device).unwrap();
    let targets = vec![vec![(1, 1.0)], vec![(0, 0.5), (2, 0.5)], vec![(3, 1.0)]];
    let (loss, value, correct) = sft_loss(logits.as_tensor(), &batch, &weights, &targets).unwrap();

    let softmax = |r: &[f32; 4]| -> Vec<f64> {
        let z: f64 = r.iter().map(|&x| (x as f64).exp()).sum();
        r.iter().map(|&x| (x as f64).exp() / z).collect()
    };
    let mut expected = 0.0;
    let mut expected_grad = Vec::new();
    for ((r, q), &wi) in raw.iter().zip(&targets).zip(&w) {
        let p = softmax(r);
        let mut dense = [0.0f64; 4];
        for &(t, qt) in q {
            dense[t as usize] = qt as f64;
            expected -= wi as f64 * qt as f64 * p[t as usize].ln();
        }
        expected_grad.extend((0..4).map(|v| wi as f64 * (p[v] - dense[v])));
    }
    assert!((value - expected).abs() < 1e-5, "{value} vs {expected}");
    // Greedy picks: 2 (target 1: miss), 0 (in the support), 3 (hit).
    assert_eq!(correct, 2);
    let grads = loss.backward().unwrap();
    let grad: Vec<f32> = grads
        .get(logits.as_tensor())
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap();
    for (g, e) in grad.iter().zip(&expected_grad) {
        assert!(
            (*g as f64 - e).abs() < 1e-5,
            "{grad:?} vs {expected_grad:?}"
        );
    }
}

#[test]
fn pair_alternatives_render_like_the_completion_and_include_it() {
    let (_dir, tokenizer) = tiny_model_dir("alternatives");
    let pair = SftRecord::Pair {
        prompt: "Board: empty".into(),
        completion: "[4]".into(),
        alternatives: vec!["[0]".into(), "[8]".into()],
    };
    let example = encode_record(&tokenizer, &SftFormat::default(), &pair).unwrap();
    let move_tokens = |m: &str| {
        chat_pair(&tokenizer, None, "Board: empty", m)
            .unwrap()
            .completion
    };
    assert_eq!(
        example.alternatives,
        vec![move_tokens("[0]"), move_tokens("[8]"), move_tokens("[4]")]
    );
    // The JSONL field is optional and round-trips.
    let line = serde_json::to_string(&pair).unwrap();
    assert!(line.contains("alternatives"));
    let back: SftRecord = serde_json::from_str(&line).unwrap();
    assert_eq!(back, pair);
}
