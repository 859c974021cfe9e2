//! The fused training forward ([`CausalLm::forward_train`], built from
//! `train_ops`' custom ops with hand-written backwards) against the
//! composition of candle's basic ops it replaced
//! ([`CausalLm::forward_train_composed`]): the same logits, and the same
//! gradients for every LoRA factor and, in full fine-tuning, for every
//! weight of the model.

use std::path::PathBuf;

use candle_core::backprop::GradStore;
use candle_core::{Device, Tensor, Var};
use rand::SeedableRng;
use rand_distr::{Distribution, Normal};
use relay_llm::sft::{load_hf_trainable, named_vars};
use relay_llm::{init, CausalLm, LoraAdapter, LoraConfig, TinyShape, TinyVocab, TokenBatch};

struct TempDir(PathBuf);

impl TempDir {
    fn new(name: &str) -> Self {
        let dir = std::env::temp_dir().join(format!(
            "relay-llm-train-forward-{name}-{}",
            std::process::id()
        ));
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

const VOCAB: usize = 61;

/// A small random Qwen2 (biases on q/k/v, grouped-query attention, tied
/// embeddings) with weights large enough that every path matters.
fn model_dir(name: &str) -> TempDir {
    let dir = TempDir::new(name);
    let vocab = TinyVocab {
        size: VOCAB,
        bos_token_id: None,
        eos_token_id: Some(2),
        pad_token_id: Some(0),
    };
    let shape = TinyShape {
        hidden_size: 32,
        intermediate_size: 48,
        num_hidden_layers: 2,
        num_attention_heads: 4,
        num_key_value_heads: 2,
        max_position_embeddings: 64,
        initializer_range: 0.2,
        ..TinyShape::default()
    };
    init::tiny_with_shape(&dir.0, 3, &vocab, &shape).unwrap();
    dir
}

fn randn(shape: &[usize], std: f32, seed: u64) -> Tensor {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let normal = Normal::new(0f32, std).unwrap();
    let n: usize = shape.iter().product();
    let data: Vec<f32> = (0..n).map(|_| normal.sample(&mut rng)).collect();
    Tensor::from_vec(data, shape, &Device::Cpu).unwrap()
}

/// Three right-padded rows of 9, 5 and 7 tokens.
fn input_ids() -> Tensor {
    let lens = [9usize, 5, 7];
    let time = 9;
    let mut ids = vec![0u32; lens.len() * time];
    for (row, &len) in lens.iter().enumerate() {
        for t in 0..len {
            ids[row * time + t] = ((row * 17 + t * 29 + 3) % VOCAB) as u32;
        }
    }
    Tensor::from_vec(ids, (lens.len(), time), &Device::Cpu).unwrap()
}

/// `Σ logits ⊙ R` for a fixed random `R`: every logit carries gradient.
fn probe_loss(logits: &Tensor) -> Tensor {
    let r = randn(logits.dims(), 1.0, 11);
    (logits * r).unwrap().sum_all().unwrap()
}

fn max_abs(t: &Tensor) -> f32 {
    t.abs()
        .unwrap()
        .flatten_all()
        .unwrap()
        .max(0)
        .unwrap()
        .to_scalar()
        .unwrap()
}

fn max_abs_diff(a: &Tensor, b: &Tensor) -> f32 {
    max_abs(&(a - b).unwrap())
}

/// Every var has a gradient in both stores, non-zero, and the two agree
/// within `1e-3` of the larger gradient's scale.
fn assert_same_grads(vars: &[(String, Var)], fused: &GradStore, composed: &GradStore) {
    for (name, var) in vars {
        let f = fused
            .get(var.as_tensor())
            .unwrap_or_else(|| panic!("{name}: no fused gradient"));
        let c = composed
            .get(var.as_tensor())
            .unwrap_or_else(|| panic!("{name}: no composed gradient"));
        let scale = max_abs(c);
        assert!(scale > 0.0, "{name}: zero gradient");
        let diff = max_abs_diff(f, c);
        assert!(
            diff <= 1e-3 * scale,
            "{name}: gradients differ by {diff} (scale {scale})"
        );
    }
}

#[test]
fn fused_training_forward_matches_the_composed_one_with_lora() {
    let dir = model_dir("lora");
    let model = CausalLm::load_hf(&dir.0).unwrap();
    let adapter = LoraAdapter::new(model.config(), LoraConfig::all_projections(4, 8.0), 5).unwrap();
    // Non-zero B, so A gets a gradient and the adapter changes the logits.
    for (i, (_, v)) in adapter.named_vars().iter().enumerate() {
        v.set(&randn(v.dims(), 0.1, 100 + i as u64)).unwrap();
    }
    let ids = input_ids();
    let fused = model.forward_train(&ids, Some(&adapter)).unwrap();
    let composed = model.forward_train_composed(&ids, Some(&adapter)).unwrap();
    let scale = max_abs(&composed);
    assert!(max_abs_diff(&fused, &composed) <= 1e-4 * scale.max(1.0));
    let base = model.forward_train(&ids, None).unwrap();
    assert!(
        max_abs_diff(&fused, &base) > 1e-3,
        "the adapter changes the logits"
    );

    let vars = adapter.named_vars();
    let g_fused = probe_loss(&fused).backward().unwrap();
    let g_composed = probe_loss(&composed).backward().unwrap();
    assert_same_grads(&vars, &g_fused, &g_composed);
}

#[test]
fn fused_training_forward_matches_the_composed_one_in_full_fine_tuning() {
    let dir = model_dir("full");
    let (model, varmap) = load_hf_trainable(&dir.0).unwrap();
    let vars = named_vars(&varmap);
    let ids = input_ids();
    let fused = model.forward_train(&ids, None).unwrap();
    let composed = model.forward_train_composed(&ids, None).unwrap();
    let scale = max_abs(&composed);
    assert!(max_abs_diff(&fused, &composed) <= 1e-4 * scale.max(1.0));
    let g_fused = probe_loss(&fused).backward().unwrap();
    let g_composed = probe_loss(&composed).backward().unwrap();
    // Embeddings, norms, projections and biases of every layer.
    assert!(vars.len() > 20, "{} vars", vars.len());
    assert_same_grads(&vars, &g_fused, &g_composed);
}

#[test]
fn logits_at_positions_are_those_rows_of_the_full_logits() {
    let dir = model_dir("at");
    let model = CausalLm::load_hf(&dir.0).unwrap();
    let ids = input_ids();
    let (batch, time) = ids.dims2().unwrap();
    let all = model
        .forward_train(&ids, None)
        .unwrap()
        .reshape((batch * time, VOCAB))
        .unwrap();
    let positions = Tensor::new(&[3u32, 0, 26, 10, 3], &Device::Cpu).unwrap();
    let at = model.forward_train_at(&ids, None, &positions).unwrap();
    let want = all.index_select(&positions, 0).unwrap();
    assert!(max_abs_diff(&at, &want) <= 1e-5 * max_abs(&want).max(1.0));
    let outside = Tensor::new(&[27u32], &Device::Cpu).unwrap();
    assert!(model.forward_train_at(&ids, None, &outside).is_err());
}

/// Rows that open with the same 6 prompt tokens, then differ: prompts of
/// 11, 9 and 10 tokens, completions of 3, 1 and 2.
fn shared_prefix_rows() -> Vec<(Vec<u32>, Vec<u32>)> {
    let opening = [5u32, 9, 14, 3, 27, 40];
    [(3usize, 3usize), (1, 1), (2, 2)]
        .iter()
        .enumerate()
        .map(|(row, &(own, completion))| {
            let token = |i: usize| ((row * 13 + i * 7 + 1) % VOCAB) as u32;
            let mut prompt = opening.to_vec();
            // The first own token differs in every row.
            prompt.push(50 + row as u32);
            prompt.extend((0..own + 1).map(token));
            (prompt, (10..10 + completion).map(token).collect())
        })
        .collect()
}

#[test]
fn a_micro_batch_runs_its_shared_prefix_once_with_the_padded_blocks_logits_and_gradients() {
    let rows = shared_prefix_rows();
    let pairs: Vec<(&[u32], &[u32])> = rows
        .iter()
        .map(|(p, c)| (p.as_slice(), c.as_slice()))
        .collect();
    let batch = TokenBatch::new(&pairs, &Device::Cpu).unwrap();
    let packed = &batch.packed;
    assert_eq!(packed.prefix_len, 6);
    // Each row's input (prompt and completion less its last token) after
    // the prefix: 11 + 3 - 1 - 6, 9 + 1 - 1 - 6, 10 + 2 - 1 - 6.
    assert_eq!(packed.suffix_lens, [7, 3, 5]);
    assert_eq!(packed.input_ids.len(), 6 + 7 + 3 + 5);

    // LoRA, with non-zero B.
    let dir = model_dir("packed");
    let model = CausalLm::load_hf(&dir.0).unwrap();
    let adapter = LoraAdapter::new(model.config(), LoraConfig::all_projections(4, 8.0), 5).unwrap();
    for (i, (_, v)) in adapter.named_vars().iter().enumerate() {
        v.set(&randn(v.dims(), 0.1, 200 + i as u64)).unwrap();
    }
    let packed_logits = model.forward_train_batch(&batch, Some(&adapter)).unwrap();
    let padded = model
        .forward_train_at(&batch.input_ids, Some(&adapter), &batch.positions)
        .unwrap();
    assert_eq!(packed_logits.dims(), [batch.num_tokens(), VOCAB]);
    assert!(max_abs_diff(&packed_logits, &padded) <= 1e-5 * max_abs(&padded).max(1.0));
    let vars = adapter.named_vars();
    let g_packed = probe_loss(&packed_logits).backward().unwrap();
    let g_padded = probe_loss(&padded).backward().unwrap();
    assert_same_grads(&vars, &g_packed, &g_padded);

    // Full fine-tuning: the embeddings and every weight of the prefix's
    // rows get the sum of the rows' gradients.
    let (model, varmap) = load_hf_trainable(&dir.0).unwrap();
    let vars = named_vars(&varmap);
    let packed_logits = model.forward_train_batch(&batch, None).unwrap();
    let padded = model
        .forward_train_at(&batch.input_ids, None, &batch.positions)
        .unwrap();
    assert!(max_abs_diff(&packed_logits, &padded) <= 1e-5 * max_abs(&padded).max(1.0));
    let g_packed = probe_loss(&packed_logits).backward().unwrap();
    let g_padded = probe_loss(&padded).backward().unwrap();
    assert_same_grads(&vars, &g_packed, &g_padded);
}

/// A stop check that says "stop" from its `after`-th look on, counting
/// its looks.
struct StopAfter {
    looked: std::cell::Cell<usize>,
    after: usize,
}

impl StopAfter {
    fn new(after: usize) -> Self {
        Self {
            looked: std::cell::Cell::new(0),
            after,
        }
    }

    fn stopping(&self) -> bool {
        let looked = self.looked.get();
        self.looked.set(looked + 1);
        looked >= self.after
    }
}

/// The CPU engine's backward goes block by block (so that a stop is seen
/// between two blocks): the gradients are those of one backward of the
/// whole graph, bit for bit with LoRA; in full fine-tuning the tied
/// embedding's two gradients (the head's and the lookup's) add up in
/// another order, within 1e-6 of each other. A stop check is asked
/// before each block of the forward and of the backward, and ends either
/// with `ModelError::Stopped`.
#[test]
fn the_block_by_block_backward_gives_the_whole_graphs_gradients_and_stops_between_blocks() {
    let rows = shared_prefix_rows();
    let pairs: Vec<(&[u32], &[u32])> = rows
        .iter()
        .map(|(p, c)| (p.as_slice(), c.as_slice()))
        .collect();
    let batch = TokenBatch::new(&pairs, &Device::Cpu).unwrap();
    let dir = model_dir("segmented");
    // The largest gap between two stores' gradients, relative to each
    // var's largest gradient.
    let gap = |vars: &[(String, Var)], a: &GradStore, b: &GradStore| {
        let mut worst = 0f32;
        for (name, var) in vars {
            let (a, b) = (a.get(var.as_tensor()), b.get(var.as_tensor()));
            let (a, b) = (a.expect(name), b.expect(name));
            worst = worst.max(max_abs_diff(a, b) / max_abs(b).max(1e-30));
        }
        worst
    };
    let model = CausalLm::load_hf(&dir.0).unwrap();
    let adapter = LoraAdapter::new(model.config(), LoraConfig::all_projections(4, 8.0), 5).unwrap();
    for (i, (_, v)) in adapter.named_vars().iter().enumerate() {
        v.set(&randn(v.dims(), 0.1, 300 + i as u64)).unwrap();
    }
    let vars = adapter.named_vars();
    let forward = model
        .forward_train_for_backward(&batch, Some(&adapter), false)
        .unwrap();
    assert!(matches!(forward, relay_llm::TrainForward::Segmented(_)));
    let whole = model.forward_train_batch(&batch, Some(&adapter)).unwrap();
    assert_eq!(
        max_abs_diff(forward.logits(), &whole),
        0.0,
        "the same forward"
    );
    let loss = probe_loss(forward.logits());
    let segmented = forward.backward(&loss).unwrap();
    let whole = probe_loss(&whole).backward().unwrap();
    assert_eq!(gap(&vars, &segmented, &whole), 0.0, "LoRA: bit for bit");

    // Two blocks: two looks in the forward, two in the backward.
    let layers = model.config().num_hidden_layers;
    assert_eq!(layers, 2);
    let never = StopAfter::new(usize::MAX);
    let check = || never.stopping();
    let forward = model
        .forward_train_for_backward_until(&batch, Some(&adapter), false, Some(&check))
        .unwrap();
    let loss = probe_loss(forward.logits());
    forward.backward(&loss).unwrap();
    assert_eq!(never.looked.get(), 2 * layers, "one look before each block");
    for after in 0..2 * layers {
        let stop = StopAfter::new(after);
        let check = || stop.stopping();
        let result = model
            .forward_train_for_backward_until(&batch, Some(&adapter), false, Some(&check))
            .and_then(|forward| {
                let loss = probe_loss(forward.logits());
                forward.backward(&loss)
            });
        assert!(
            matches!(result, Err(relay_llm::ModelError::Stopped)),
            "stopped at look {after}: {:?}",
            result.err()
        );
        assert_eq!(stop.looked.get(), after + 1, "no look after the stop");
    }
    let stop = StopAfter::new(1);
    let check = || stop.stopping();
    assert!(matches!(
        model.forward_train_batch_until(&batch, Some(&adapter), Some(&check)),
        Err(relay_llm::ModelError::Stopped)
    ));

    let (model, varmap) = load_hf_trainable(&dir.0).unwrap();
    let vars = named_vars(&varmap);
    let forward = model
        .forward_train_for_backward(&batch, None, false)
        .unwrap();
    let whole = model.forward_train_batch(&batch, None).unwrap();
    let loss = probe_loss(forward.logits());
    let segmented = forward.backward(&loss).unwrap();
    let whole = probe_loss(&whole).backward().unwrap();
    let worst = gap(&vars, &segmented, &whole);
    assert!(worst <= 1e-6, "full fine-tuning: {worst:e}");
}
