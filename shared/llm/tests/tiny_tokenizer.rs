//! The tokenizer `relay model init tiny` writes: it loads as a Hugging Face
//! folder, round-trips the text games' observations exactly, keeps ChatML's
//! special tokens whole, and renders its chat template.
//!
//! Game text comes from the TextArena fixtures: `$RELAY_TEXTARENA_FIXTURES`,
//! default `shared/fixtures/textarena` next to the repository.

use std::path::PathBuf;

use relay_llm::{write_tiny_tokenizer, ChatMessage, Tokenizer, TINY_VOCAB_SIZE};

struct TempDir(PathBuf);

impl TempDir {
    fn new(name: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("relay-llm-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        Self(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn textarena_dir() -> PathBuf {
    match std::env::var_os("RELAY_TEXTARENA_FIXTURES") {
        Some(dir) => PathBuf::from(dir),
        None => {
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../../shared/fixtures/textarena")
        }
    }
}

/// Every observation and action string of the TextArena fixtures.
fn game_texts() -> Vec<String> {
    let dir = textarena_dir();
    let mut texts = Vec::new();
    for name in ["TicTacToe-v0.json", "ConnectFour-v0.json"] {
        let path = dir.join(name);
        let text = std::fs::read_to_string(&path)
            .unwrap_or_else(|e| panic!("{}: {e} (see shared/fixtures/README.md)", path.display()));
        let fixture: serde_json::Value = serde_json::from_str(&text).unwrap();
        for game in fixture["games"].as_array().unwrap() {
            for step in game["steps"].as_array().unwrap() {
                texts.push(step["observation"].as_str().unwrap().to_owned());
                texts.push(step["action"].as_str().unwrap().to_owned());
            }
        }
    }
    assert!(texts.len() > 20, "too few game texts in {}", dir.display());
    texts
}

#[test]
fn tiny_tokenizer_round_trips_game_text() {
    let dir = TempDir::new("tiny-tokenizer-roundtrip");
    let vocab_size = write_tiny_tokenizer(&dir.0).unwrap();
    assert_eq!(vocab_size, TINY_VOCAB_SIZE);
    let tokenizer = Tokenizer::from_hf_dir(&dir.0).unwrap();
    assert_eq!(tokenizer.vocab_size(), vocab_size);

    let texts = game_texts();
    let (mut bytes, mut tokens) = (0usize, 0usize);
    for text in &texts {
        let ids = tokenizer.encode(text, false).unwrap();
        assert!(ids.iter().all(|&id| (id as usize) < vocab_size));
        assert_eq!(tokenizer.decode(&ids, false).unwrap(), *text);
        bytes += text.len();
        tokens += ids.len();
    }
    // The merges were learned on game text: it must take well under a token per
    // byte (boards like ". . X O" cap it near 0.4 under this pre-tokenizer).
    assert!(
        tokens * 2 < bytes,
        "{tokens} tokens for {bytes} bytes of game text: merges do not fit the games"
    );
    // Text outside the games still round-trips, byte by byte if need be.
    let odd = "naïve ✓ 你好\t\r\n  <|im_end|x>";
    let ids = tokenizer.encode(odd, false).unwrap();
    assert_eq!(tokenizer.decode(&ids, false).unwrap(), odd);
}

#[test]
fn tiny_tokenizer_chat_template_renders_chatml() {
    let dir = TempDir::new("tiny-tokenizer-chat");
    write_tiny_tokenizer(&dir.0).unwrap();
    let tokenizer = Tokenizer::from_hf_dir(&dir.0).unwrap();
    let messages = [
        ChatMessage::system("Play well."),
        ChatMessage::user("Available Moves: '[0]', '[4]'"),
    ];
    let prompt = tokenizer.apply_chat_template(&messages, true).unwrap();
    assert_eq!(
        prompt,
        "<|im_start|>system\nPlay well.<|im_end|>\n<|im_start|>user\nAvailable Moves: '[0]', '[4]'<|im_end|>\n<|im_start|>assistant\n"
    );
    let ids = tokenizer.encode(&prompt, false).unwrap();
    let im_start = tokenizer.token_id("<|im_start|>").unwrap();
    let im_end = tokenizer.eos_token_id().unwrap();
    assert_eq!(tokenizer.token(im_end).unwrap(), "<|im_end|>");
    assert_eq!(ids.iter().filter(|&&id| id == im_start).count(), 3);
    assert_eq!(ids.iter().filter(|&&id| id == im_end).count(), 2);
    assert_eq!(tokenizer.decode(&ids, false).unwrap(), prompt);
    assert_eq!(
        tokenizer.decode(&ids, true).unwrap(),
        "system\nPlay well.\nuser\nAvailable Moves: '[0]', '[4]'\nassistant\n"
    );
    assert_eq!(
        tokenizer.pad_token_id(),
        tokenizer.token_id("<|endoftext|>")
    );
    // Moves are three tokens each, the digit in the middle.
    for cell in 0..9 {
        let ids = tokenizer.encode(&format!("[{cell}]"), false).unwrap();
        assert_eq!(ids.len(), 3);
        assert_eq!(
            tokenizer.decode(&ids[1..2], false).unwrap(),
            cell.to_string()
        );
    }
}

#[test]
fn tiny_tokenizer_files_are_deterministic() {
    let first = TempDir::new("tiny-tokenizer-a");
    let second = TempDir::new("tiny-tokenizer-b");
    write_tiny_tokenizer(&first.0).unwrap();
    write_tiny_tokenizer(&second.0).unwrap();
    for name in [
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
    ] {
        let a = std::fs::read(first.0.join(name)).unwrap();
        let b = std::fs::read(second.0.join(name)).unwrap();
        assert!(a == b, "{name} differs between two runs");
    }
}
