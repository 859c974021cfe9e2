//! A [`Tokenizer`] from a GGUF file's metadata, as transformers' own GGUF loader
//! builds it (`GGUFTokenizerSkeleton` + `GGUFGPTConverter`).
//!
//! A GGUF file ships no `tokenizer.json`: llama.cpp stores the vocabulary, merges,
//! token types, special token ids, the pre-tokenizer's name and the chat template as
//! `tokenizer.*` metadata. This module owns turning that metadata into the same
//! `tokenizers` pipeline transformers assembles:
//! - model: BPE over the vocabulary (tokens outside GPT-2's byte-level alphabet
//!   respelled through it) and the merges, no unknown token, no byte fallback;
//! - pre-tokenizer: `ByteLevel` (GPT-2's split), or, where `tokenizer.ggml.pre`
//!   names a tokenizer whose split differs (Llama 3, Qwen2, ...), that split's
//!   regex in front of a `ByteLevel` that no longer splits;
//! - added tokens: every control token (`token_type` 3) as a special token;
//! - bos / eos / unk / pad: the tokens at the stated ids;
//! - the chat template from `tokenizer.chat_template`.
//!
//! Only byte-level BPE files (`tokenizer.ggml.model = "gpt2"`: Llama 3, Qwen2,
//! SmolLM2, ...) are supported; sentencepiece files are refused with an error.

use std::collections::HashMap;
use std::path::Path;

use candle_core::quantized::gguf_file::{Content, Value};
use serde_json::json;

use crate::chat::ChatTemplate;
use crate::tokenizer::{
    byte_to_char_table, SpecialToken, SpecialTokens, Tokenizer, TokenizerError,
};

/// llama.cpp's token type for control (special) tokens.
const TOKEN_TYPE_CONTROL: i64 = 3;

const LLAMA3_SPLIT: &str = concat!(
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}",
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
);
const QWEN2_SPLIT: &str = concat!(
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}",
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
);
const QWEN35_SPLIT: &str = concat!(
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}",
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
);
const TEKKEN_SPLIT: &str = concat!(
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+",
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*",
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
);
const GPT4O_SPLIT: &str = concat!(
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
);

/// The split regex of a `tokenizer.ggml.pre` name whose split differs from GPT-2's
/// (the names are llama.cpp's, the table transformers'); `None` means GPT-2's split,
/// which `ByteLevel` applies by itself. Names unknown here (e.g. SmolLM2's "smollm")
/// get GPT-2's split, as in transformers.
pub fn pre_tokenizer_split(pre: &str) -> Option<&'static str> {
    Some(match pre {
        "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "falcon-h1" | "pixtral" | "midm-2.0"
        | "lfm2" | "jina-v5-nano" | "dbrx" | "smaug-bpe" => LLAMA3_SPLIT,
        "tekken" => TEKKEN_SPLIT,
        "qwen2" | "deepseek-r1-qwen" | "kormo" | "f2llmv2" | "megrez" => QWEN2_SPLIT,
        "qwen35" => QWEN35_SPLIT,
        "gpt-4o" | "llama4" | "kanana2" | "talkie" | "minimax-m2" => GPT4O_SPLIT,
        _ => return None,
    })
}

impl Tokenizer {
    /// Reads a GGUF file's metadata (not its tensors) and builds its tokenizer.
    pub fn from_gguf(path: impl AsRef<Path>) -> Result<Self, TokenizerError> {
        let path = path.as_ref();
        let mut file = std::fs::File::open(path).map_err(|e| TokenizerError::io(path, e))?;
        let content = Content::read(&mut file)
            .map_err(|e| TokenizerError::Gguf(format!("{}: {e}", path.display())))?;
        Self::from_gguf_metadata(&content.metadata)
    }

    /// Builds the tokenizer a GGUF file's metadata describes (see the module docs).
    pub fn from_gguf_metadata(metadata: &HashMap<String, Value>) -> Result<Self, TokenizerError> {
        let meta = Metadata(metadata);
        let model = meta.string("tokenizer.ggml.model")?;
        if model != "gpt2" {
            return Err(TokenizerError::UnsupportedGgufTokenizer(model.to_owned()));
        }
        let tokens = meta.strings("tokenizer.ggml.tokens")?;
        let merges = meta.strings("tokenizer.ggml.merges")?;
        let token_types = match metadata.get("tokenizer.ggml.token_type") {
            Some(_) => meta.ints("tokenizer.ggml.token_type")?,
            None => Vec::new(),
        };
        let pre = meta.optional_string("tokenizer.ggml.pre")?;
        let add_prefix_space = meta
            .optional_bool("tokenizer.ggml.add_space_prefix")?
            .unwrap_or(false);

        let json = tokenizer_json(&tokens, &merges, &token_types, pre, add_prefix_space)?;
        let inner = tokenizers::Tokenizer::from_bytes(json.to_string().as_bytes())
            .map_err(TokenizerError::tokenizers)?;

        let special_at = |key: &str| -> Result<Option<SpecialToken>, TokenizerError> {
            let Some(id) = meta.optional_id(key)? else {
                return Ok(None);
            };
            let content = tokens.get(id as usize).ok_or_else(|| {
                TokenizerError::Gguf(format!("{key} = {id} is past the {} tokens", tokens.len()))
            })?;
            // The id the pipeline gives the token's text: the stated one unless a
            // respelled duplicate took the text.
            let id = inner.token_to_id(content).unwrap_or(id);
            Ok(Some(SpecialToken {
                content: (*content).to_owned(),
                id,
            }))
        };
        let special = SpecialTokens {
            bos: special_at("tokenizer.ggml.bos_token_id")?,
            eos: special_at("tokenizer.ggml.eos_token_id")?,
            pad: special_at("tokenizer.ggml.padding_token_id")?,
            unk: special_at("tokenizer.ggml.unknown_token_id")?,
        };
        let chat_template = meta
            .optional_string("tokenizer.chat_template")?
            .map(|source| {
                ChatTemplate::new(
                    source,
                    special.bos.as_ref().map(|t| t.content.clone()),
                    special.eos.as_ref().map(|t| t.content.clone()),
                )
            })
            .transpose()?;
        Ok(Tokenizer::new(inner, special, chat_template))
    }
}

/// The `tokenizer.json` of a byte-level BPE GGUF tokenizer, as transformers'
/// `GGUFGPTConverter` assembles it.
fn tokenizer_json(
    tokens: &[&str],
    merges: &[&str],
    token_types: &[i64],
    pre: Option<&str>,
    add_prefix_space: bool,
) -> Result<serde_json::Value, TokenizerError> {
    let table = byte_to_char_table();
    let in_alphabet = |token: &str| token.chars().all(|c| table.contains(&c));

    // Keyed the way the merges spell tokens; a later duplicate wins, as in a
    // Python dict comprehension.
    let mut vocab = serde_json::Map::with_capacity(tokens.len());
    for (id, token) in tokens.iter().enumerate() {
        let key = if in_alphabet(token) {
            (*token).to_owned()
        } else {
            token.bytes().map(|b| table[b as usize]).collect()
        };
        vocab.insert(key, json!(id));
    }

    let merges = merges
        .iter()
        .map(|merge| {
            let parts: Vec<&str> = merge.split(' ').collect();
            match parts.as_slice() {
                [left, right] => Ok(json!([left, right])),
                _ => Err(TokenizerError::Gguf(format!(
                    "merge {merge:?} is not two tokens separated by one space"
                ))),
            }
        })
        .collect::<Result<Vec<_>, _>>()?;

    // Control tokens become special added tokens, unless respelled: a token outside
    // the alphabet is a byte sequence llama.cpp mislabelled.
    let added_tokens: Vec<serde_json::Value> = tokens
        .iter()
        .zip(token_types)
        .enumerate()
        .filter(|(_, (token, &kind))| kind == TOKEN_TYPE_CONTROL && in_alphabet(token))
        .map(|(id, (token, _))| {
            json!({
                "id": id,
                "content": token,
                "single_word": false,
                "lstrip": false,
                "rstrip": false,
                "normalized": false,
                "special": true,
            })
        })
        .collect();

    let byte_level = |use_regex: bool| {
        json!({
            "type": "ByteLevel",
            "add_prefix_space": add_prefix_space,
            "trim_offsets": true,
            "use_regex": use_regex,
        })
    };
    let pre_tokenizer = match pre.and_then(pre_tokenizer_split) {
        None => byte_level(true),
        Some(split) => json!({
            "type": "Sequence",
            "pretokenizers": [
                {
                    "type": "Split",
                    "pattern": { "Regex": split },
                    "behavior": "Isolated",
                    "invert": false,
                },
                // transformers builds this one with add_prefix_space=False.
                { "type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false },
            ],
        }),
    };

    Ok(json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added_tokens,
        "normalizer": null,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": { "type": "ByteLevel", "add_prefix_space": true, "trim_offsets": false, "use_regex": true },
        "decoder": { "type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true },
        "model": {
            "type": "BPE",
            "dropout": null,
            "unk_token": null,
            "continuing_subword_prefix": "",
            "end_of_word_suffix": "",
            "fuse_unk": false,
            "byte_fallback": false,
            "ignore_merges": false,
            "vocab": vocab,
            "merges": merges,
        },
    }))
}

/// Typed access to GGUF metadata, with errors that name the key.
struct Metadata<'a>(&'a HashMap<String, Value>);

impl<'a> Metadata<'a> {
    fn get(&self, key: &str) -> Result<&'a Value, TokenizerError> {
        self.0
            .get(key)
            .ok_or_else(|| TokenizerError::Gguf(format!("metadata has no {key}")))
    }

    fn wrong(key: &str, expected: &str, value: &Value) -> TokenizerError {
        TokenizerError::Gguf(format!(
            "{key} is {:?}, expected {expected}",
            value.value_type()
        ))
    }

    fn string(&self, key: &str) -> Result<&'a str, TokenizerError> {
        match self.get(key)? {
            Value::String(s) => Ok(s),
            other => Err(Self::wrong(key, "a string", other)),
        }
    }

    fn optional_string(&self, key: &str) -> Result<Option<&'a str>, TokenizerError> {
        match self.0.get(key) {
            None => Ok(None),
            Some(_) => self.string(key).map(Some),
        }
    }

    fn optional_bool(&self, key: &str) -> Result<Option<bool>, TokenizerError> {
        match self.0.get(key) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(other) => Err(Self::wrong(key, "a bool", other)),
        }
    }

    fn optional_id(&self, key: &str) -> Result<Option<u32>, TokenizerError> {
        match self.0.get(key) {
            None => Ok(None),
            Some(value) => integer(value)
                .and_then(|v| u32::try_from(v).ok())
                .map(Some)
                .ok_or_else(|| Self::wrong(key, "a token id", value)),
        }
    }

    fn strings(&self, key: &str) -> Result<Vec<&'a str>, TokenizerError> {
        match self.get(key)? {
            Value::Array(items) => items
                .iter()
                .map(|item| match item {
                    Value::String(s) => Ok(s.as_str()),
                    other => Err(Self::wrong(key, "an array of strings", other)),
                })
                .collect(),
            other => Err(Self::wrong(key, "an array of strings", other)),
        }
    }

    fn ints(&self, key: &str) -> Result<Vec<i64>, TokenizerError> {
        match self.get(key)? {
            Value::Array(items) => items
                .iter()
                .map(|item| {
                    integer(item).ok_or_else(|| Self::wrong(key, "an array of integers", item))
                })
                .collect(),
            other => Err(Self::wrong(key, "an array of integers", other)),
        }
    }
}

fn integer(value: &Value) -> Option<i64> {
    Some(match value {
        Value::U8(v) => (*v).into(),
        Value::I8(v) => (*v).into(),
        Value::U16(v) => (*v).into(),
        Value::I16(v) => (*v).into(),
        Value::U32(v) => (*v).into(),
        Value::I32(v) => (*v).into(),
        Value::U64(v) => i64::try_from(*v).ok()?,
        Value::I64(v) => *v,
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn metadata(pre: Option<&str>) -> HashMap<String, Value> {
        let strings = |items: &[&str]| {
            Value::Array(items.iter().map(|s| Value::String((*s).into())).collect())
        };
        let mut m = HashMap::new();
        m.insert("tokenizer.ggml.model".into(), Value::String("gpt2".into()));
        // Bytes, the merged "ab" and "(a", a token written raw ("ő" is outside the
        // byte-level alphabet: the merges spell its bytes C5 91 "Åĳ"), and two
        // control tokens.
        m.insert(
            "tokenizer.ggml.tokens".into(),
            strings(&["<eos>", "a", "b", "(", "ab", "(a", "ő", "<ctl>", "Å", "ĳ"]),
        );
        m.insert(
            "tokenizer.ggml.merges".into(),
            strings(&["a b", "( a", "Å ĳ"]),
        );
        m.insert(
            "tokenizer.ggml.token_type".into(),
            Value::Array(
                [3, 1, 1, 1, 1, 1, 3, 3, 1, 1]
                    .iter()
                    .map(|&t| Value::I32(t))
                    .collect(),
            ),
        );
        m.insert("tokenizer.ggml.eos_token_id".into(), Value::U32(0));
        m.insert(
            "tokenizer.chat_template".into(),
            Value::String(
                "{% for m in messages %}{{ m.content }}{{ eos_token }}{% endfor %}".into(),
            ),
        );
        if let Some(pre) = pre {
            m.insert("tokenizer.ggml.pre".into(), Value::String(pre.into()));
        }
        m
    }

    #[test]
    fn builds_bpe_with_control_tokens_and_respelled_vocab() {
        let tok = Tokenizer::from_gguf_metadata(&metadata(None)).unwrap();
        assert_eq!(tok.vocab_size(), 10);
        assert_eq!(tok.encode("ab<ctl>", false).unwrap(), vec![4, 7]);
        // "ő" is found through its respelling, and is not special though typed control.
        assert_eq!(tok.encode("ő", false).unwrap(), vec![6]);
        assert_eq!(tok.token_bytes(6).unwrap(), "ő".as_bytes());
        assert!(!tok.is_special(6));
        assert!(tok.is_special(7));
        assert_eq!(tok.eos_token_id(), Some(0));
        assert_eq!(tok.decode(&[4, 7, 0], true).unwrap(), "ab");
        assert_eq!(
            tok.apply_chat_template(&[crate::ChatMessage::user("hi")], false)
                .unwrap(),
            "hi<eos>"
        );
    }

    #[test]
    fn pre_tokenizer_name_chooses_the_split() {
        // GPT-2's split cuts "(a" into "(" and "a", so BPE never merges them;
        // Llama 3's `[^\r\n\p{L}\p{N}]?\p{L}+` keeps them in one chunk.
        let gpt2 = Tokenizer::from_gguf_metadata(&metadata(None)).unwrap();
        let llama3 = Tokenizer::from_gguf_metadata(&metadata(Some("llama-bpe"))).unwrap();
        assert_eq!(gpt2.encode("(a", false).unwrap(), vec![3, 1]);
        assert_eq!(llama3.encode("(a", false).unwrap(), vec![5]);
        assert_eq!(pre_tokenizer_split("smollm"), None);
        assert_eq!(pre_tokenizer_split("qwen2"), Some(QWEN2_SPLIT));
    }

    #[test]
    fn refuses_sentencepiece_files() {
        let mut m = metadata(None);
        m.insert("tokenizer.ggml.model".into(), Value::String("llama".into()));
        assert!(matches!(
            Tokenizer::from_gguf_metadata(&m),
            Err(TokenizerError::UnsupportedGgufTokenizer(kind)) if kind == "llama"
        ));
    }
}
