//! The decoder's tests on a small random model: device and host drawing
//! alike, constrained completions and answers after a thought, prefix
//! caches. In their own file so that the decoder reads without them.

use super::*;
use crate::sampling::policy_logprob;

/// A random model small enough for unit tests, written to a fresh folder.
fn random_model(label: &str) -> CausalLm {
    let dir =
        std::env::temp_dir().join(format!("relay-llm-generate-{label}-{}", std::process::id()));
    let vocab = crate::TinyVocab {
        size: 64,
        bos_token_id: None,
        eos_token_id: Some(2),
        pad_token_id: Some(0),
    };
    let shape = crate::TinyShape {
        hidden_size: 32,
        intermediate_size: 64,
        num_hidden_layers: 2,
        max_position_embeddings: 64,
        ..crate::TinyShape::default()
    };
    crate::init::tiny_with_shape(&dir, 3, &vocab, &shape).unwrap();
    let model = CausalLm::load_hf(&dir).unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
    model
}

fn token_sequences(texts: &[&str], ids: Vec<Vec<u32>>) -> Arc<TokenSequences> {
    let texts = texts.iter().map(|t| t.to_string()).collect();
    Arc::new(TokenSequences::from_sequences(texts, ids).unwrap())
}

/// Opener 30, moves [5 6] and [7], closer 31.
fn thought_answer() -> AnswerAfterThought {
    AnswerAfterThought {
        after_opener: token_sequences(&["a}", "b}"], vec![vec![5, 6, 31], vec![7, 31]]),
        whole: token_sequences(&["{a}", "{b}"], vec![vec![30, 5, 6, 31], vec![30, 7, 31]]),
    }
}

/// Drawing on the logits' device (what a GPU does) and on the host give
/// the same generations, token for token, for every kind of sequence
/// decoded side by side: greedy, temperature, top-k and top-p, a
/// constraint, and a free thought with a constrained answer (whose end
/// token is drawn again from the same row).
#[test]
fn device_and_host_sampling_generate_alike() {
    let model = random_model("device-sampling");
    let answer = thought_answer();
    let allowed = token_sequences(&["x", "y"], vec![vec![40, 41], vec![42]]);
    let params = |temperature, top_k, top_p| SamplingParams {
        temperature,
        top_k,
        top_p,
    };
    let build = |seed: u64| -> Vec<Sequence> {
        let stop = |n| StopCondition {
            max_new_tokens: n,
            stop_token_ids: (10..20).collect(),
        };
        let seq = |p: SamplingParams, k: u64, n| {
            let sampler = Sampler::new(p, seed * 10 + k).unwrap();
            Sequence::new(&model, vec![1, 3 + k as u32, 4], None, sampler, stop(n)).unwrap()
        };
        vec![
            seq(params(0.0, 0, 1.0), 0, 12),
            seq(params(1.0, 0, 1.0), 1, 12),
            seq(params(0.7, 5, 0.9), 2, 12),
            seq(params(1.0, 0, 1.0), 3, 4)
                .with_constraint(allowed.clone())
                .unwrap(),
            seq(params(1.0, 0, 1.0), 4, 4)
                .with_answer_after_thought(answer.clone())
                .unwrap(),
        ]
    };
    let run = |sample: Sampling, seed| {
        let mut seqs = build(seed);
        while seqs.iter().any(|s| !s.is_finished()) {
            let mut refs: Vec<&mut Sequence> = seqs.iter_mut().collect();
            step_sampling(&model, &mut refs, sample).unwrap();
        }
        seqs.iter()
            .map(|s| {
                (
                    s.tokens().to_vec(),
                    s.logprobs().to_vec(),
                    s.finish_reason(),
                )
            })
            .collect::<Vec<_>>()
    };
    for seed in 0..10 {
        let host = run(sample_on_host, seed);
        let device = run(sample_on_device, seed);
        for (k, (h, d)) in host.iter().zip(&device).enumerate() {
            assert_eq!(h.0, d.0, "seed {seed}, sequence {k}: tokens");
            assert_eq!(h.2, d.2, "seed {seed}, sequence {k}: finish");
            for (a, b) in h.1.iter().zip(&d.1) {
                assert!(
                    (a - b).abs() < 1e-4,
                    "seed {seed}, sequence {k}: {a} vs {b}"
                );
            }
        }
    }
}

#[test]
fn an_answer_after_a_thought_is_constrained_alone_and_takes_the_end_token_s_place() {
    let model = random_model("thought");
    let answer = thought_answer();
    // Many end tokens, so that thoughts end both ways.
    let stop = StopCondition {
        max_new_tokens: 4,
        stop_token_ids: (10..30).collect(),
    };
    let (mut ended_early, mut used_up) = (0, 0);
    for seed in 0..40 {
        let sampler = Sampler::new(SamplingParams::default(), seed).unwrap();
        let mut seq = Sequence::new(&model, vec![1, 20, 3], None, sampler, stop.clone())
            .unwrap()
            .with_answer_after_thought(answer.clone())
            .unwrap();
        generate(&model, &mut seq).unwrap();
        let Some(FinishReason::Allowed(i)) = seq.finish_reason() else {
            panic!("seed {seed}: finished with {:?}", seq.finish_reason());
        };
        let start = seq.answer_start().expect("the answer started");
        let (thought, answer_tokens) = seq.tokens().split_at(start);
        assert_eq!(answer_tokens, answer.whole.sequences()[i].as_slice());
        assert!(thought.len() <= 4);
        // The end token that stopped the thought is not in it.
        assert!(thought.iter().all(|t| !(10..30).contains(t)), "{thought:?}");
        if thought.len() < 4 {
            ended_early += 1;
        } else {
            used_up += 1;
        }
        assert!(seq.logprobs().iter().all(|l| l.is_finite() && *l <= 0.0));
    }
    assert!(ended_early > 0 && used_up > 0, "{ended_early} / {used_up}");

    // The caller saw the opener after the first token.
    let sampler = Sampler::new(SamplingParams::default(), 7).unwrap();
    let mut seq = Sequence::new(&model, vec![1, 20, 3], None, sampler, stop)
        .unwrap()
        .with_answer_after_thought(answer.clone())
        .unwrap();
    step(&model, &mut [&mut seq]).unwrap();
    assert!(
        seq.thinking(),
        "seed 7's first token does not end the thought"
    );
    assert!(seq.begin_answer());
    assert!(!seq.begin_answer(), "one answer");
    generate(&model, &mut seq).unwrap();
    let Some(FinishReason::Allowed(i)) = seq.finish_reason() else {
        panic!("finished with {:?}", seq.finish_reason());
    };
    assert_eq!(seq.answer_start(), Some(1));
    assert_eq!(
        &seq.tokens()[1..],
        answer.after_opener.sequences()[i].as_slice()
    );
}

#[test]
fn constrained_sequences_spell_an_allowed_completion_with_policy_logprobs() {
    let model = random_model("constraint");
    let texts = ["a", "b", "c", "d"].map(String::from).to_vec();
    let sequences = vec![vec![5, 6, 7], vec![5, 8], vec![9], vec![9, 10, 11]];
    let allowed = Arc::new(TokenSequences::from_sequences(texts, sequences.clone()).unwrap());
    let stop = StopCondition {
        max_new_tokens: 8,
        stop_token_ids: vec![2],
    };
    let prompt = vec![1u32, 20, 30, 40];
    let mut seen = std::collections::BTreeSet::new();
    for seed in 0..40 {
        let params = SamplingParams {
            temperature: if seed % 4 == 0 { 0.0 } else { 1.5 },
            ..SamplingParams::default()
        };
        let mut seq = Sequence::new(
            &model,
            prompt.clone(),
            None,
            Sampler::new(params, seed).unwrap(),
            stop.clone(),
        )
        .unwrap()
        .with_constraint(allowed.clone())
        .unwrap();
        generate(&model, &mut seq).unwrap();
        let Some(FinishReason::Allowed(i)) = seq.finish_reason() else {
            panic!("seed {seed}: finished with {:?}", seq.finish_reason());
        };
        let tokens = seq.tokens().to_vec();
        // The completion is sequence i, or (for the prefix "c" of "d")
        // sequence i followed by the stop token.
        let body = tokens.strip_suffix(&[2]).unwrap_or(&tokens);
        assert_eq!(body, &sequences[i][..], "seed {seed}");
        if body.len() < tokens.len() {
            assert_eq!(i, 2, "only \"c\" is a prefix of another sequence");
        }
        seen.insert(tokens.clone());
        // Log-probs are those of the unconstrained policy.
        let mut cache = model.new_cache();
        let fed: Vec<u32> = prompt
            .iter()
            .chain(&tokens[..tokens.len() - 1])
            .copied()
            .collect();
        let logits: Vec<Vec<f32>> = model
            .forward_one(&fed, &mut cache, None)
            .unwrap()
            .to_vec2()
            .unwrap();
        for (k, (&token, &lp)) in tokens.iter().zip(seq.logprobs()).enumerate() {
            let row = &logits[prompt.len() - 1 + k];
            let want = policy_logprob(row, token as usize);
            assert!(
                (lp - want).abs() < 1e-4,
                "seed {seed} token {k}: {lp} vs {want}"
            );
        }
    }
    assert!(
        seen.len() >= 3,
        "sampling explores the allowed set: {seen:?}"
    );
}

#[test]
fn a_sequence_from_a_cached_prefix_continues_like_a_full_prefill() {
    let model = random_model("prefix");
    let stop = StopCondition {
        max_new_tokens: 6,
        stop_token_ids: vec![],
    };
    let first: Vec<u32> = (0..30).map(|i| (i * 7 + 3) % 60 + 3).collect();
    let mut second = first[..24].to_vec();
    second.extend([9, 10, 11, 12]);
    let run = |prompt: &[u32], cache: Option<KvCache>| {
        let mut seq = match cache {
            Some(cache) => Sequence::with_cached_prefix(
                &model,
                prompt.to_vec(),
                cache,
                None,
                Sampler::greedy(),
                stop.clone(),
            )
            .unwrap(),
            None => Sequence::new(
                &model,
                prompt.to_vec(),
                None,
                Sampler::greedy(),
                stop.clone(),
            )
            .unwrap(),
        };
        generate(&model, &mut seq).unwrap();
        seq
    };
    let mut prefixes = crate::PrefixCache::new(4, 8);
    let full_first = run(&first, None);
    prefixes.insert(None, &first, full_first.cache());
    assert_eq!(prefixes.len(), 1);
    // Shares 24 tokens with the first prompt.
    let cached = prefixes.lookup(None, &second).expect("a shared prefix");
    assert_eq!(cached.len(), 24);
    let resumed = run(&second, Some(cached));
    let full_second = run(&second, None);
    assert_eq!(resumed.tokens(), full_second.tokens());
    for (a, b) in resumed.logprobs().iter().zip(full_second.logprobs()) {
        assert!((a - b).abs() < 1e-4, "{a} vs {b}");
    }
    // The same prompt again: all but its last token come from the cache.
    let again = prefixes.lookup(None, &first).unwrap();
    assert_eq!(again.len(), first.len() - 1);
    assert_eq!(run(&first, Some(again)).tokens(), full_first.tokens());
    // Too short a match, or another adapter: nothing.
    assert!(prefixes.lookup(None, &[first[0], 50, 51]).is_none());
    let adapter = Arc::new(
        crate::LoraAdapter::new(
            model.config(),
            crate::LoraConfig::all_projections(2, 4.0),
            1,
        )
        .unwrap(),
    );
    assert!(prefixes.lookup(Some(&adapter), &first).is_none());
}
