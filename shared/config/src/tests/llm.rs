//! The `llm` section.

use super::*;

#[test]
fn llm_section_is_validated_by_field() {
    let c = ExperimentConfig::from_layers(
        BASE,
        "t",
        &[],
        &[
            "llm.model=smollm2".into(),
            "llm.gguf_base=quantized".into(),
            "llm.adapters.opponent=adapters/opp".into(),
            "llm.chat_template_kwargs.enable_thinking=false".into(),
        ],
    )
    .unwrap();
    assert_eq!(
        c.llm.chat_template_kwargs["enable_thinking"],
        serde_json::Value::Bool(false)
    );
    assert_eq!(c.llm.gguf_base, GgufBaseName::Quantized);
    assert!(c.serves_llm() && !c.is_text_game());
    assert_eq!(c.llm.adapters["opponent"], PathBuf::from("adapters/opp"));
    let cases = [
        ("llm.max_sequences=0", "llm.max_sequences"),
        ("llm.max_queue=0", "llm.max_queue"),
        ("llm.max_adapters=0", "llm.max_adapters"),
        ("llm.threads=0", "llm.threads"),
        ("llm.model=''", "llm.model"),
        ("llm.gguf_base=q8", "gguf_base"),
        ("llm.adapters.x=''", "llm.adapters.x"),
        ("llm.max_sequence=3", "max_sequence"),
        ("llm.device=cuda", "llm.device"),
        ("llm.device=gpu0", "cuda:N"),
        ("llm.dtype=f8", "dtype"),
        ("llm.backend=vllm", "backend"),
    ];
    for (set, field) in cases {
        let err = ExperimentConfig::from_layers(BASE, "t", &[], &[set.into()])
            .unwrap_err()
            .to_string();
        assert!(err.contains(field), "{set}: {err}");
    }
    let text =
        ExperimentConfig::from_layers(BASE, "t", &[], &["run.env_id=TicTacToe-v0".into()]).unwrap();
    assert!(text.is_text_game() && text.serves_llm());
    let candle = ExperimentConfig::from_layers(
        BASE,
        "t",
        &[],
        &["llm.backend=candle".into(), "llm.dtype=bf16".into()],
    )
    .unwrap();
    assert_eq!(
        candle.llm.backend_spec().dtype,
        crate::hyper::backend::LlmDtype::Bf16
    );
    // `auto` (the default) takes the candle backend for bf16; the engine refuses it.
    let auto = ExperimentConfig::from_layers(BASE, "t", &[], &["llm.dtype=bf16".into()]).unwrap();
    assert_eq!(
        auto.llm.backend_spec().resolved_kind(),
        crate::hyper::backend::BackendKind::Candle
    );
    let err = ExperimentConfig::from_layers(
        BASE,
        "t",
        &[],
        &["llm.backend=engine".into(), "llm.dtype=bf16".into()],
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("llm.dtype"), "{err}");
    // CUDA without the feature: the field, and how to build with it.
    if !crate::hyper::backend::CUDA_BUILT {
        let err = ExperimentConfig::from_layers(
            BASE,
            "t",
            &[],
            &["llm.backend=candle".into(), "llm.device=cuda:0".into()],
        )
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("llm.device") && err.contains("just build-cuda"),
            "{err}"
        );
    }
}
