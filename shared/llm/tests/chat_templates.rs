//! The Hub's chat templates of Qwen3 (with `enable_thinking`) and Llama
//! 3.1 rendered as transformers' `apply_chat_template` renders them:
//! `tests/data/chat_templates/expected.json` holds transformers' output
//! for each case (written by `render_with_transformers.py` there).

use std::path::PathBuf;

use relay_llm::{ChatMessage, ChatTemplate};
use serde_json::Value;

fn data_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/chat_templates")
}

#[test]
fn qwen3_and_llama3_templates_render_as_transformers_does() {
    let expected: Value =
        serde_json::from_str(&std::fs::read_to_string(data_dir().join("expected.json")).unwrap())
            .unwrap();
    let templates = expected["templates"].as_object().unwrap();
    assert_eq!(templates.len(), 2);
    let mut checked = 0;
    for (file, cases) in templates {
        let source = std::fs::read_to_string(data_dir().join(file)).unwrap();
        let template = ChatTemplate::new(source, None, None).unwrap();
        for case in cases.as_array().unwrap() {
            let name = case["name"].as_str().unwrap();
            let messages: Vec<ChatMessage> =
                serde_json::from_value(case["messages"].clone()).unwrap();
            let kwargs = case["kwargs"].as_object().unwrap();
            let add_generation_prompt = case["add_generation_prompt"].as_bool().unwrap();
            let got = template
                .render_with(&messages, add_generation_prompt, kwargs)
                .unwrap_or_else(|e| panic!("{file}, {name}: {e}"));
            assert_eq!(got, case["text"].as_str().unwrap(), "{file}, {name}");
            checked += 1;
        }
    }
    assert_eq!(checked, 8);
}

/// A tokenizer renders every prompt with its `chat_template_kwargs` (as
/// the inference server sets them from `llm.chat_template_kwargs`).
#[test]
fn tokenizer_renders_with_its_template_kwargs() {
    let expected: Value =
        serde_json::from_str(&std::fs::read_to_string(data_dir().join("expected.json")).unwrap())
            .unwrap();
    let case = expected["templates"]["qwen3.jinja"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == "thinking off")
        .unwrap();
    let mut tokenizer =
        relay_llm::Tokenizer::from_hf_dir(relay_testkit::llm_fixture("tiny-qwen2")).unwrap();
    let source = std::fs::read_to_string(data_dir().join("qwen3.jinja")).unwrap();
    tokenizer.set_chat_template(Some(ChatTemplate::new(source, None, None).unwrap()));
    let messages: Vec<ChatMessage> = serde_json::from_value(case["messages"].clone()).unwrap();
    let thinking = tokenizer.apply_chat_template(&messages, true).unwrap();
    assert!(thinking.ends_with("<|im_start|>assistant\n"), "{thinking}");
    tokenizer.set_chat_template_kwargs(case["kwargs"].as_object().unwrap().clone());
    let direct = tokenizer.apply_chat_template(&messages, true).unwrap();
    assert_eq!(direct, case["text"].as_str().unwrap());
    assert!(direct.ends_with("<think>\n\n</think>\n\n"));
}
