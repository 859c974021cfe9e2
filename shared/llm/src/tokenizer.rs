//! Text ⇄ token ids for the LLM policies: a Hugging Face `tokenizers` pipeline plus
//! what transformers keeps beside it (special tokens, the chat template).
//!
//! This module owns:
//! - [`Tokenizer`]: loaded from a Hugging Face folder ([`Tokenizer::from_hf_dir`]) or
//!   from a GGUF file's metadata ([`Tokenizer::from_gguf`], in `gguf_tokenizer`);
//!   encode, decode, special token ids, vocabulary and token strings, chat rendering.
//! - [`IncrementalDecoder`]: the text of a growing completion, token by token, so a
//!   server can check stop strings as tokens arrive without re-decoding everything.
//! - [`TokenSequences`]: the token sequences that spell a set of texts (a game's
//!   legal moves), and which next tokens keep a partial completion on one of them.
//!
//! Legal moves are matched on token sequences, not on text: a move's sequence is
//! [`Tokenizer::encode`] of its text with `add_special_tokens = false`, which is how
//! the text is tokenized right after the chat template's generation prompt (it ends
//! in a newline, and every pre-tokenizer used here starts a new chunk after one).
//! Constrained decoding lets the model emit only tokens that continue one of those
//! sequences; a completion that spells a move with other tokens is never produced.

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use crate::chat::{ChatMessage, ChatTemplate, ChatTemplateError};

/// What can go wrong loading or using a tokenizer.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    /// A file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// A JSON file (tokenizer.json, tokenizer_config.json) is not what it should be.
    #[error("{path}: {message}")]
    InvalidFile {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        message: String,
    },
    /// The `tokenizers` library refused (building, encoding or decoding).
    #[error("tokenizers: {0}")]
    Tokenizers(String),
    /// A GGUF file could not be read, or its metadata lacks or mistypes a key.
    #[error("GGUF: {0}")]
    Gguf(String),
    /// A GGUF file states a tokenizer kind this crate does not build.
    #[error("GGUF tokenizer model {0:?} is not supported (only \"gpt2\", byte-level BPE)")]
    UnsupportedGgufTokenizer(String),
    /// A special token named in the config is not in the vocabulary.
    #[error("special token {0:?} is not in the vocabulary")]
    UnknownSpecialToken(String),
    /// The tokenizer has no chat template.
    #[error("this tokenizer has no chat template")]
    NoChatTemplate,
    /// The chat template failed to compile or render.
    #[error(transparent)]
    ChatTemplate(#[from] ChatTemplateError),
}

impl TokenizerError {
    pub(crate) fn tokenizers(err: impl std::fmt::Display) -> Self {
        Self::Tokenizers(err.to_string())
    }

    pub(crate) fn io(path: &Path, source: std::io::Error) -> Self {
        Self::Io {
            path: path.to_path_buf(),
            source,
        }
    }

    pub(crate) fn invalid(path: &Path, message: impl Into<String>) -> Self {
        Self::InvalidFile {
            path: path.to_path_buf(),
            message: message.into(),
        }
    }
}

/// A special token: its text and its id.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SpecialToken {
    /// The token's text, e.g. `<|im_end|>`.
    pub content: String,
    /// Its id in the vocabulary.
    pub id: u32,
}

/// The roles transformers gives special tokens (`bos_token`, `eos_token`, ...).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SpecialTokens {
    /// Beginning of sequence, if the model has one.
    pub bos: Option<SpecialToken>,
    /// End of sequence: generation stops when the model emits it.
    pub eos: Option<SpecialToken>,
    /// Padding, if the model has one.
    pub pad: Option<SpecialToken>,
    /// Unknown token, if the model has one.
    pub unk: Option<SpecialToken>,
}

/// A tokenizer with its special tokens and (optionally) its chat template.
#[derive(Clone)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    special: SpecialTokens,
    chat_template: Option<ChatTemplate>,
    /// Extra variables of every rendering (`enable_thinking`, ...).
    chat_template_kwargs: serde_json::Map<String, serde_json::Value>,
    /// Whether the decoder is GPT-2's byte-level one, so token strings map to bytes
    /// through the byte-to-unicode table.
    byte_level: bool,
    /// Added tokens' ids, and whether each is special.
    added: HashMap<u32, bool>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.vocab_size())
            .field("special", &self.special)
            .field("has_chat_template", &self.chat_template.is_some())
            .finish()
    }
}

/// The name of the file holding the tokenizer pipeline in a Hugging Face folder.
pub const TOKENIZER_JSON: &str = "tokenizer.json";
/// The name of the file holding special tokens and (older) the chat template.
pub const TOKENIZER_CONFIG_JSON: &str = "tokenizer_config.json";
/// The name of the file holding the chat template (transformers ≥ 4.43 writes it).
pub const CHAT_TEMPLATE_JINJA: &str = "chat_template.jinja";

impl Tokenizer {
    /// Assembles a tokenizer from its parts. `special` must name tokens of `inner`.
    pub fn new(
        inner: tokenizers::Tokenizer,
        special: SpecialTokens,
        chat_template: Option<ChatTemplate>,
    ) -> Self {
        let byte_level = matches!(
            inner.get_decoder(),
            Some(tokenizers::DecoderWrapper::ByteLevel(_))
        );
        let added = inner
            .get_added_tokens_decoder()
            .into_iter()
            .map(|(id, token)| (id, token.special))
            .collect();
        Self {
            inner,
            special,
            chat_template,
            chat_template_kwargs: Default::default(),
            byte_level,
            added,
        }
    }

    /// Loads `tokenizer.json` from a Hugging Face model folder, with the special
    /// tokens of `tokenizer_config.json` (if present) and the chat template of
    /// `chat_template.jinja` or, failing that, `tokenizer_config.json`'s
    /// `chat_template` (as transformers does).
    pub fn from_hf_dir(dir: impl AsRef<Path>) -> Result<Self, TokenizerError> {
        let dir = dir.as_ref();
        let tokenizer_path = dir.join(TOKENIZER_JSON);
        let inner = tokenizers::Tokenizer::from_file(&tokenizer_path)
            .map_err(|e| TokenizerError::invalid(&tokenizer_path, e.to_string()))?;

        let config_path = dir.join(TOKENIZER_CONFIG_JSON);
        let config = if config_path.exists() {
            let text = std::fs::read_to_string(&config_path)
                .map_err(|e| TokenizerError::io(&config_path, e))?;
            let value: serde_json::Value = serde_json::from_str(&text)
                .map_err(|e| TokenizerError::invalid(&config_path, e.to_string()))?;
            if !value.is_object() {
                return Err(TokenizerError::invalid(&config_path, "not a JSON object"));
            }
            value
        } else {
            serde_json::Value::Object(Default::default())
        };

        let lookup = |key: &str| -> Result<Option<SpecialToken>, TokenizerError> {
            match config.get(key).map(special_token_content) {
                None | Some(None) => Ok(None),
                Some(Some(content)) => {
                    let id = inner
                        .token_to_id(&content)
                        .ok_or_else(|| TokenizerError::UnknownSpecialToken(content.clone()))?;
                    Ok(Some(SpecialToken { content, id }))
                }
            }
        };
        let special = SpecialTokens {
            bos: lookup("bos_token")?,
            eos: lookup("eos_token")?,
            pad: lookup("pad_token")?,
            unk: lookup("unk_token")?,
        };

        let jinja_path = dir.join(CHAT_TEMPLATE_JINJA);
        let template_source = if jinja_path.exists() {
            Some(
                std::fs::read_to_string(&jinja_path)
                    .map_err(|e| TokenizerError::io(&jinja_path, e))?,
            )
        } else {
            config_chat_template(&config)
                .map_err(|message| TokenizerError::invalid(&config_path, message))?
        };
        let chat_template = template_source
            .map(|source| {
                ChatTemplate::new(
                    source,
                    special.bos.as_ref().map(|t| t.content.clone()),
                    special.eos.as_ref().map(|t| t.content.clone()),
                )
            })
            .transpose()?;
        Ok(Self::new(inner, special, chat_template))
    }

    /// Token ids of `text`. With `add_special_tokens`, the post-processor adds what
    /// the model's pipeline adds (e.g. a BOS token); chat prompts already hold their
    /// special tokens as text, so encode them with `false`, as transformers'
    /// `apply_chat_template` does. Special tokens written in `text` are always
    /// recognised as single tokens.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, TokenizerError> {
        let encoding = self
            .inner
            .encode_fast(text, add_special_tokens)
            .map_err(TokenizerError::tokenizers)?;
        Ok(encoding.get_ids().to_vec())
    }

    /// The text of `ids`; `skip_special_tokens` leaves out special tokens
    /// (`<|im_end|>`, ...). Bytes that do not form valid UTF-8 become U+FFFD.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String, TokenizerError> {
        self.inner
            .decode(ids, skip_special_tokens)
            .map_err(TokenizerError::tokenizers)
    }

    /// Renders `messages` with the chat template, ending with the assistant's
    /// generation prompt when `add_generation_prompt`, with the variables
    /// of [`Tokenizer::set_chat_template_kwargs`].
    pub fn apply_chat_template(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, TokenizerError> {
        let template = self
            .chat_template
            .as_ref()
            .ok_or(TokenizerError::NoChatTemplate)?;
        Ok(template.render_with(messages, add_generation_prompt, &self.chat_template_kwargs)?)
    }

    /// Extra variables for every rendering of the chat template, as
    /// transformers' `apply_chat_template(**kwargs)` and vLLM's
    /// `chat_template_kwargs` pass them (Qwen3's `enable_thinking`).
    pub fn set_chat_template_kwargs(&mut self, kwargs: serde_json::Map<String, serde_json::Value>) {
        self.chat_template_kwargs = kwargs;
    }

    /// The rendered chat prompt's ids (no special tokens added beyond the template's).
    pub fn encode_chat(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<Vec<u32>, TokenizerError> {
        let prompt = self.apply_chat_template(messages, add_generation_prompt)?;
        self.encode(&prompt, false)
    }

    /// The chat template, if the model has one.
    pub fn chat_template(&self) -> Option<&ChatTemplate> {
        self.chat_template.as_ref()
    }

    /// Replaces the chat template (e.g. one given in a config file).
    pub fn set_chat_template(&mut self, template: Option<ChatTemplate>) {
        self.chat_template = template;
    }

    /// The special tokens by role.
    pub fn special_tokens(&self) -> &SpecialTokens {
        &self.special
    }

    /// The end-of-sequence id: generation stops when the model emits it.
    pub fn eos_token_id(&self) -> Option<u32> {
        self.special.eos.as_ref().map(|t| t.id)
    }

    /// The beginning-of-sequence id.
    pub fn bos_token_id(&self) -> Option<u32> {
        self.special.bos.as_ref().map(|t| t.id)
    }

    /// The padding id, falling back to the EOS id (as generation does) when the
    /// model names no padding token.
    pub fn pad_token_id(&self) -> Option<u32> {
        self.special
            .pad
            .as_ref()
            .or(self.special.eos.as_ref())
            .map(|t| t.id)
    }

    /// Number of token ids, added tokens included: ids are `0..vocab_size()`.
    /// The model's embedding may be larger (padded); never smaller.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// The token's string as the vocabulary spells it (for byte-level BPE, in GPT-2's
    /// byte-to-unicode alphabet: `Ġ[` is " ["); `None` for an id out of range.
    pub fn token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// The id of a token spelled as the vocabulary spells it.
    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// Whether `id` is an added special token (`<|im_start|>`, ...).
    pub fn is_special(&self, id: u32) -> bool {
        self.added.get(&id).copied().unwrap_or(false)
    }

    /// The bytes the token contributes to decoded text: for byte-level BPE the
    /// token's bytes (possibly part of a UTF-8 character), for added tokens their
    /// content, otherwise the token decoded alone. `None` for an id out of range.
    pub fn token_bytes(&self, id: u32) -> Option<Vec<u8>> {
        let token = self.inner.id_to_token(id)?;
        if self.added.contains_key(&id) {
            return Some(token.into_bytes());
        }
        if self.byte_level {
            if let Some(bytes) = byte_level_decode(&token) {
                return Some(bytes);
            }
        }
        self.inner.decode(&[id], false).ok().map(String::into_bytes)
    }

    /// The underlying `tokenizers` pipeline.
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }

    /// Writes the pipeline as `tokenizer.json` (e.g. one built from a GGUF file).
    pub fn save_tokenizer_json(&self, path: impl AsRef<Path>) -> Result<(), TokenizerError> {
        self.inner
            .save(path.as_ref(), false)
            .map_err(TokenizerError::tokenizers)
    }
}

/// A special token entry of `tokenizer_config.json`: a string, or an AddedToken
/// object with a `content` field; `null` means none.
fn special_token_content(value: &serde_json::Value) -> Option<String> {
    match value {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Object(map) => map
            .get("content")
            .and_then(|c| c.as_str())
            .map(str::to_owned),
        _ => None,
    }
}

/// `chat_template` of `tokenizer_config.json`: a string, or a list of
/// `{name, template}` of which transformers uses the one named `default`.
fn config_chat_template(config: &serde_json::Value) -> Result<Option<String>, String> {
    match config.get("chat_template") {
        None | Some(serde_json::Value::Null) => Ok(None),
        Some(serde_json::Value::String(s)) => Ok(Some(s.clone())),
        Some(serde_json::Value::Array(named)) => {
            let default = named
                .iter()
                .find(|entry| entry.get("name").and_then(|n| n.as_str()) == Some("default"));
            match default {
                Some(entry) => entry
                    .get("template")
                    .and_then(|t| t.as_str())
                    .map(|t| Some(t.to_owned()))
                    .ok_or_else(|| "chat_template entry \"default\" has no template".to_owned()),
                None => Err("chat_template list has no entry named \"default\"".to_owned()),
            }
        }
        Some(_) => Err("chat_template is neither a string nor a list".to_owned()),
    }
}

/// GPT-2's byte-to-unicode table: byte `b` is spelled `BYTE_TO_CHAR[b]` in a
/// byte-level vocabulary (printable bytes as themselves, the rest shifted past 255).
pub(crate) fn byte_to_char_table() -> [char; 256] {
    let mut table = ['\0'; 256];
    let mut shifted = 0u32;
    for b in 0..=255u8 {
        let printable =
            (b'!'..=b'~').contains(&b) || (0xA1..=0xAC).contains(&b) || (0xAE..=0xFF).contains(&b);
        table[b as usize] = if printable {
            char::from(b)
        } else {
            let c = char::from_u32(256 + shifted).expect("valid code point");
            shifted += 1;
            c
        };
    }
    table
}

/// The bytes a byte-level token spells; `None` if a character is outside the alphabet.
fn byte_level_decode(token: &str) -> Option<Vec<u8>> {
    static CHAR_TO_BYTE: OnceLock<HashMap<char, u8>> = OnceLock::new();
    let char_to_byte = CHAR_TO_BYTE.get_or_init(|| {
        byte_to_char_table()
            .iter()
            .enumerate()
            .map(|(b, &c)| (c, b as u8))
            .collect()
    });
    token
        .chars()
        .map(|c| char_to_byte.get(&c).copied())
        .collect()
}

/// Decodes a growing completion token by token.
///
/// Owns no reference to the tokenizer, so it can live in a request's state; pass
/// the same tokenizer to every call. Text is released only once its bytes form
/// whole UTF-8 characters (a byte-level token may hold half of one), and decoding
/// looks back a few tokens so decoders that depend on context (leading spaces)
/// give the same text as decoding the whole completion at once.
#[derive(Debug, Clone, Default)]
pub struct IncrementalDecoder {
    ids: Vec<u32>,
    /// Start of the look-back window.
    prefix_offset: usize,
    /// End of the tokens whose text has been released.
    read_offset: usize,
    text: String,
    skip_special_tokens: bool,
}

impl IncrementalDecoder {
    /// A decoder for a new completion; `skip_special_tokens` leaves special tokens
    /// (e.g. the EOS token) out of the text.
    pub fn new(skip_special_tokens: bool) -> Self {
        Self {
            skip_special_tokens,
            ..Self::default()
        }
    }

    /// Appends `id` and returns the text it completes (often empty while a UTF-8
    /// character is split across tokens).
    pub fn push(&mut self, tokenizer: &Tokenizer, id: u32) -> Result<String, TokenizerError> {
        self.ids.push(id);
        let prefix = tokenizer.decode(
            &self.ids[self.prefix_offset..self.read_offset],
            self.skip_special_tokens,
        )?;
        let full = tokenizer.decode(&self.ids[self.prefix_offset..], self.skip_special_tokens)?;
        if full.len() > prefix.len() && !full.ends_with('\u{FFFD}') {
            if let Some(new_text) = full.strip_prefix(prefix.as_str()) {
                let new_text = new_text.to_owned();
                self.prefix_offset = self.read_offset;
                self.read_offset = self.ids.len();
                self.text.push_str(&new_text);
                return Ok(new_text);
            }
        }
        Ok(String::new())
    }

    /// Releases text held back at the end (an incomplete UTF-8 character becomes
    /// U+FFFD) and returns it. Call when the completion ends.
    pub fn finish(&mut self, tokenizer: &Tokenizer) -> Result<String, TokenizerError> {
        if self.read_offset == self.ids.len() {
            return Ok(String::new());
        }
        let prefix = tokenizer.decode(
            &self.ids[self.prefix_offset..self.read_offset],
            self.skip_special_tokens,
        )?;
        let full = tokenizer.decode(&self.ids[self.prefix_offset..], self.skip_special_tokens)?;
        let rest = full
            .strip_prefix(prefix.as_str())
            .map(str::to_owned)
            .unwrap_or(full);
        self.prefix_offset = self.read_offset;
        self.read_offset = self.ids.len();
        self.text.push_str(&rest);
        Ok(rest)
    }

    /// The text released so far.
    pub fn text(&self) -> &str {
        &self.text
    }

    /// The ids pushed so far.
    pub fn ids(&self) -> &[u32] {
        &self.ids
    }
}

/// The token sequences that spell a set of texts (e.g. a game's legal moves, as the
/// model should answer them), for constrained decoding.
///
/// Each text is encoded alone without special tokens (see the module docs for why
/// that is the sequence the model emits after the generation prompt). Texts whose
/// sequences are equal collapse onto the first.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenSequences {
    texts: Vec<String>,
    sequences: Vec<Vec<u32>>,
}

impl TokenSequences {
    /// Encodes every text.
    pub fn new<S: AsRef<str>>(tokenizer: &Tokenizer, texts: &[S]) -> Result<Self, TokenizerError> {
        let mut out = Self {
            texts: Vec::with_capacity(texts.len()),
            sequences: Vec::with_capacity(texts.len()),
        };
        for text in texts {
            let ids = tokenizer.encode(text.as_ref(), false)?;
            out.texts.push(text.as_ref().to_owned());
            out.sequences.push(ids);
        }
        Ok(out)
    }

    /// Token sequences given directly (e.g. a request that sends token
    /// ids), each with its text; `texts` and `sequences` pair up by index.
    pub fn from_sequences(texts: Vec<String>, sequences: Vec<Vec<u32>>) -> Option<Self> {
        (texts.len() == sequences.len()).then_some(Self { texts, sequences })
    }

    /// The texts, in the order given.
    pub fn texts(&self) -> &[String] {
        &self.texts
    }

    /// The token sequence of each text, in the order given.
    pub fn sequences(&self) -> &[Vec<u32>] {
        &self.sequences
    }

    /// The tokens that may follow `generated` so that it stays a prefix of some
    /// sequence, sorted and without repeats. Empty when `generated` has left every
    /// sequence or completed the only ones it could still follow.
    pub fn allowed_next(&self, generated: &[u32]) -> Vec<u32> {
        let next: BTreeSet<u32> = self
            .sequences
            .iter()
            .filter(|seq| seq.len() > generated.len() && seq.starts_with(generated))
            .map(|seq| seq[generated.len()])
            .collect();
        next.into_iter().collect()
    }

    /// The index of the first text whose sequence is exactly `generated`.
    pub fn completed(&self, generated: &[u32]) -> Option<usize> {
        self.sequences.iter().position(|seq| seq == generated)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn tokenizer_can_be_shared_across_threads() {
        fn shareable<T: Send + Sync + Clone + 'static>() {}
        shareable::<Tokenizer>();
        shareable::<IncrementalDecoder>();
        shareable::<TokenSequences>();
    }

    #[test]
    fn special_tokens_read_as_strings_or_added_token_objects() {
        assert_eq!(special_token_content(&json!("<s>")), Some("<s>".to_owned()));
        assert_eq!(
            special_token_content(
                &json!({"content": "</s>", "special": true, "__type": "AddedToken"})
            ),
            Some("</s>".to_owned())
        );
        assert_eq!(special_token_content(&json!(null)), None);
    }

    #[test]
    fn config_chat_template_is_a_string_or_the_default_of_a_list() {
        assert_eq!(config_chat_template(&json!({})), Ok(None));
        assert_eq!(
            config_chat_template(&json!({"chat_template": "x"})),
            Ok(Some("x".to_owned()))
        );
        let named = json!({"chat_template": [
            {"name": "tool_use", "template": "t"},
            {"name": "default", "template": "d"},
        ]});
        assert_eq!(config_chat_template(&named), Ok(Some("d".to_owned())));
        assert!(config_chat_template(
            &json!({"chat_template": [{"name": "rag", "template": "r"}]})
        )
        .is_err());
        assert!(config_chat_template(&json!({"chat_template": 3})).is_err());
    }

    #[test]
    fn byte_table_is_gpt2s() {
        let table = byte_to_char_table();
        assert_eq!(table[b' ' as usize], 'Ġ');
        assert_eq!(table[b'\n' as usize], 'Ċ');
        assert_eq!(table[b'A' as usize], 'A');
        let distinct: std::collections::HashSet<char> = table.iter().copied().collect();
        assert_eq!(distinct.len(), 256);
        assert_eq!(byte_level_decode("ĠĊA"), Some(b" \nA".to_vec()));
        assert_eq!(byte_level_decode("€"), None);
    }
}
