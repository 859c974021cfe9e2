//! The tokenizer of `relay model init tiny`: a small byte-level BPE vocabulary
//! for the text games, written as a Hugging Face folder's tokenizer files.
//!
//! This module owns [`write_tiny_tokenizer`] and the sample text its merges are
//! learned from. The vocabulary is, by id:
//! - 0..3: the special tokens `<|endoftext|>` (padding), `<|im_start|>` and
//!   `<|im_end|>` (end of a turn, the EOS token), as in Qwen2's ChatML;
//! - 3..259: every byte, so any text encodes and decodes back exactly;
//! - then merges learned from game text built here (TicTacToe, ConnectFour and
//!   Kuhn Poker observations in TextArena's style, ChatML role names, moves)
//!   until the vocabulary has [`TINY_VOCAB_SIZE`] tokens.
//!
//! Learning is deterministic (ties broken by the pair's spelling), so every run
//! writes the same files. The pre-tokenizer is Qwen2's: digits one by one and
//! brackets apart from them, so a move like `[4]` is always the tokens `[`, `4`,
//! `]` and every cell number is one token.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use serde_json::json;
use tokenizers::{OffsetReferential, OffsetType, PreTokenizedString, PreTokenizer};

use crate::tokenizer::{byte_to_char_table, Tokenizer, TokenizerError, CHAT_TEMPLATE_JINJA};
use crate::tokenizer::{TOKENIZER_CONFIG_JSON, TOKENIZER_JSON};

/// Vocabulary size [`write_tiny_tokenizer`] aims for: specials, bytes and merges.
pub const TINY_VOCAB_SIZE: usize = 512;

/// The special tokens, in id order.
pub const TINY_SPECIAL_TOKENS: [&str; 3] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];

/// The ChatML chat template written beside the tokenizer.
pub const CHATML_TEMPLATE: &str = "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";

/// Qwen2's split: words with one leading non-letter, digits one by one,
/// punctuation runs, newlines, spaces.
const QWEN2_SPLIT: &str = concat!(
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}",
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
);

/// Writes `tokenizer.json`, `tokenizer_config.json` and `chat_template.jinja` into
/// `out_dir` (created if missing) and returns the vocabulary size, which the
/// model's embedding must match. The folder then loads with
/// [`Tokenizer::from_hf_dir`] (and with transformers).
pub fn write_tiny_tokenizer(out_dir: impl AsRef<Path>) -> Result<usize, TokenizerError> {
    let out_dir = out_dir.as_ref();
    std::fs::create_dir_all(out_dir).map_err(|e| TokenizerError::io(out_dir, e))?;

    let tokenizer_json = tiny_tokenizer_json(&sample_game_text())?;
    let config = json!({
        "add_bos_token": false,
        "added_tokens_decoder": TINY_SPECIAL_TOKENS.iter().enumerate().map(|(id, token)| {
            (id.to_string(), json!({
                "content": token,
                "lstrip": false,
                "normalized": false,
                "rstrip": false,
                "single_word": false,
                "special": true,
            }))
        }).collect::<serde_json::Map<_, _>>(),
        "bos_token": null,
        "clean_up_tokenization_spaces": false,
        "eos_token": TINY_SPECIAL_TOKENS[2],
        "model_max_length": 4096,
        "pad_token": TINY_SPECIAL_TOKENS[0],
        "tokenizer_class": "Qwen2Tokenizer",
    });
    let write = |name: &str, contents: String| {
        let path = out_dir.join(name);
        std::fs::write(&path, contents).map_err(|e| TokenizerError::io(&path, e))
    };
    write(TOKENIZER_JSON, pretty(&tokenizer_json))?;
    write(TOKENIZER_CONFIG_JSON, pretty(&config))?;
    write(CHAT_TEMPLATE_JINJA, CHATML_TEMPLATE.to_owned())?;

    // Loading back checks the files and gives the size the model must use.
    Ok(Tokenizer::from_hf_dir(out_dir)?.vocab_size())
}

fn pretty(value: &serde_json::Value) -> String {
    let mut text = serde_json::to_string_pretty(value).expect("JSON values serialize");
    text.push('\n');
    text
}

/// The tokenizer pipeline with merges learned from `corpus`.
fn tiny_tokenizer_json(corpus: &str) -> Result<serde_json::Value, TokenizerError> {
    let table = byte_to_char_table();
    let mut vocab: Vec<String> = TINY_SPECIAL_TOKENS
        .iter()
        .map(|s| (*s).to_owned())
        .collect();
    vocab.extend(table.iter().map(char::to_string));

    let chunks = pre_tokenize(corpus)?;
    let merges = learn_merges(&chunks, &mut vocab, TINY_VOCAB_SIZE);
    Ok(pipeline_json(&vocab, &merges))
}

fn pipeline_json(vocab: &[String], merges: &[(String, String)]) -> serde_json::Value {
    let added_tokens: Vec<_> = TINY_SPECIAL_TOKENS
        .iter()
        .enumerate()
        .map(|(id, token)| {
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
    let vocab: serde_json::Map<_, _> = vocab
        .iter()
        .enumerate()
        .map(|(id, token)| (token.clone(), json!(id)))
        .collect();
    let merges: Vec<_> = merges.iter().map(|(a, b)| json!([a, b])).collect();
    json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added_tokens,
        "normalizer": null,
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                { "type": "Split", "pattern": { "Regex": QWEN2_SPLIT }, "behavior": "Isolated", "invert": false },
                { "type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false },
            ],
        },
        "post_processor": { "type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false },
        "decoder": { "type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false },
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
    })
}

/// The corpus cut into pre-tokenizer chunks (in the byte-level alphabet), using
/// the same pre-tokenizer the written tokenizer uses.
fn pre_tokenize(corpus: &str) -> Result<Vec<String>, TokenizerError> {
    let bare = tokenizers::Tokenizer::from_bytes(pipeline_json(&[], &[]).to_string())
        .map_err(TokenizerError::tokenizers)?;
    let pre_tokenizer = bare
        .get_pre_tokenizer()
        .ok_or_else(|| TokenizerError::Tokenizers("no pre-tokenizer".into()))?;
    let mut pieces = PreTokenizedString::from(corpus);
    pre_tokenizer
        .pre_tokenize(&mut pieces)
        .map_err(TokenizerError::tokenizers)?;
    Ok(pieces
        .get_splits(OffsetReferential::Original, OffsetType::None)
        .into_iter()
        .map(|(chunk, _, _)| chunk.to_owned())
        .collect())
}

/// Byte-pair merges learned from `chunks` until `vocab` has `target` tokens or no
/// pair occurs twice: each step merges the most frequent adjacent pair (ties: the
/// smallest pair by spelling). Returns the merges in rank order.
fn learn_merges(
    chunks: &[String],
    vocab: &mut Vec<String>,
    target: usize,
) -> Vec<(String, String)> {
    let mut counts: BTreeMap<&str, usize> = BTreeMap::new();
    for chunk in chunks {
        *counts.entry(chunk.as_str()).or_default() += 1;
    }
    let mut words: Vec<(Vec<String>, usize)> = counts
        .into_iter()
        .map(|(chunk, count)| (chunk.chars().map(String::from).collect(), count))
        .collect();
    let mut known: HashMap<String, ()> = vocab.iter().map(|t| (t.clone(), ())).collect();
    let mut merges = Vec::new();

    while vocab.len() < target {
        let mut pairs: BTreeMap<(&str, &str), usize> = BTreeMap::new();
        for (symbols, count) in &words {
            for pair in symbols.windows(2) {
                *pairs
                    .entry((pair[0].as_str(), pair[1].as_str()))
                    .or_default() += count;
            }
        }
        // The first maximum in spelling order.
        let Some(((left, right), best)) = pairs.into_iter().fold(
            None,
            |best: Option<((&str, &str), usize)>, (pair, count)| match best {
                Some((_, best_count)) if best_count >= count => best,
                _ => Some((pair, count)),
            },
        ) else {
            break;
        };
        if best < 2 {
            break;
        }
        let (left, right) = (left.to_owned(), right.to_owned());
        let merged = format!("{left}{right}");
        for (symbols, _) in &mut words {
            let mut i = 0;
            while i + 1 < symbols.len() {
                if symbols[i] == left && symbols[i + 1] == right {
                    symbols[i] = merged.clone();
                    symbols.remove(i + 1);
                }
                i += 1;
            }
        }
        if known.insert(merged.clone(), ()).is_none() {
            vocab.push(merged);
        }
        merges.push((left, right));
    }
    merges
}

/// A small deterministic generator for the sample games (no `rand` stream to keep
/// stable across versions).
struct SplitMix64(u64);

impl SplitMix64 {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// Game transcripts in TextArena's style: the text the merges are learned from.
pub(crate) fn sample_game_text() -> String {
    let mut rng = SplitMix64(0x7e1a_u64);
    let mut text = String::new();
    for game in 0..6 {
        text.push_str(&tic_tac_toe_game(game % 2, &mut rng));
        text.push_str(&connect_four_game(game % 2, &mut rng));
        text.push_str(&kuhn_poker_game(game % 2, &mut rng));
    }
    text
}

fn chat_turn(observation: &str, reply: &str) -> String {
    format!("system\nYou are a competitive game player.\nuser\n{observation}\nassistant\n{reply}\n")
}

fn tic_tac_toe_board(cells: &[Option<char>; 9]) -> String {
    let cell = |i: usize| cells[i].map_or_else(|| i.to_string(), |c| c.to_string());
    let row = |r: usize| {
        format!(
            " {} | {} | {} ",
            cell(3 * r),
            cell(3 * r + 1),
            cell(3 * r + 2)
        )
    };
    format!(
        "{}\n---+---+---\n{}\n---+---+---\n{}",
        row(0),
        row(1),
        row(2)
    )
}

fn tic_tac_toe_game(player: usize, rng: &mut SplitMix64) -> String {
    let (mine, theirs) = if player == 0 { ('O', 'X') } else { ('X', 'O') };
    let mut log = format!(
        "\n[GAME] You are Player {player} in Tic Tac Toe.\n\
         Your goal is to win three in a row (horizontally, vertically, or diagonally) on the board.\n\
         On your turn, you should select the square number (0-8) you want to put your mark in next.\n\
         For example, '[4]' places your mark in the center cell of the board.\n\n\
         As Player {player}, you will be '{mine}', while your opponent is '{theirs}'.\n"
    );
    let mut cells = [None; 9];
    let mut out = String::new();
    for turn in 0..9 {
        let free: Vec<usize> = (0..9).filter(|&i| cells[i].is_none()).collect();
        let moves: Vec<String> = free.iter().map(|i| format!("'[{i}]'")).collect();
        log.push_str(&format!(
            "\n[GAME] Current Board:\n\n{}\n\nAvailable Moves: {}",
            tic_tac_toe_board(&cells),
            moves.join(", ")
        ));
        let cell = free[rng.below(free.len())];
        let actor = (player + turn) % 2;
        let symbol = if actor == player { mine } else { theirs };
        if actor == player {
            out.push_str(&chat_turn(&log, &format!("[{cell}]")));
        }
        cells[cell] = Some(symbol);
        log.push_str(&format!(
            "\n[Player {actor}] [{cell}]\n[GAME] Player {actor} placed their symbol ({symbol}) in cell {cell}."
        ));
        if turn == 5 {
            break;
        }
    }
    out
}

fn connect_four_game(player: usize, rng: &mut SplitMix64) -> String {
    let (mine, theirs) = if player == 0 { ('X', 'O') } else { ('O', 'X') };
    let mut log = format!(
        "\n[GAME] You are Player {player} in Connect Four.\nYour disc symbol: {mine}.\n\
         The game board has 6 rows and 7 columns.\n\
         Players take turns dropping their disc into one of the columns (0 to 6).\n\
         The first to connect (their own) four discs vertically, horizontally, or diagonally wins.\n\
         On your turn, enter the column number in squared brackets to make your move.\n\
         For example: '[col 4]' or '[col 1]'."
    );
    let mut heights = [0usize; 7];
    let mut board = [['.'; 7]; 6];
    let mut out = String::new();
    for turn in 0..8 {
        let rows: Vec<String> = board
            .iter()
            .map(|row| {
                row.iter()
                    .map(char::to_string)
                    .collect::<Vec<_>>()
                    .join(" ")
            })
            .collect();
        log.push_str(&format!(
            "\n[GAME] Board state:\n0 1 2 3 4 5 6\n-------------\n{}",
            rows.join("\n")
        ));
        let column = rng.below(7);
        let actor = (player + turn) % 2;
        let symbol = if actor == player { mine } else { theirs };
        let action = if turn % 3 == 0 {
            format!("[col {column}]")
        } else {
            format!("[{column}]")
        };
        if actor == player {
            out.push_str(&chat_turn(&log, &action));
        }
        if heights[column] < 6 {
            board[5 - heights[column]][column] = symbol;
            heights[column] += 1;
        }
        log.push_str(&format!(
            "\n[Player {actor}] {action}\n[GAME] Player {actor} dropped their disk ({symbol}) into column {column}."
        ));
    }
    out
}

fn kuhn_poker_game(player: usize, rng: &mut SplitMix64) -> String {
    let cards = ['J', 'Q', 'K'];
    let mut log = format!(
        "\n[GAME] You are Player {player} in a 5 round game of Kuhn Poker.\nGame Rules:\n\
         - Kuhn Poker uses a 3-card deck with J, Q, K (J lowest, K highest)\n\
         - Each player antes 1 chip and receives 1 card each round\n\
         - Game continues for 5 rounds\n\
         - The player with the most chips after all rounds wins\n\n\
         Action Rules:\n\
         - '[check]': Pass without betting (only if no bet is on the table)\n\
         - '[bet]': Add 1 chip to the pot (only if no bet is on the table)\n\
         - '[call]': Match an opponent's bet by adding 1 chip to the pot\n\
         - '[fold]': Surrender your hand and let your opponent win the pot\n"
    );
    let mut out = String::new();
    for round in 1..=5 {
        let card = cards[rng.below(3)];
        log.push_str(&format!(
            "\n[GAME] Starting round {round} out of 5 rounds.\nYour card is: {card}\n\
             Your available actions are: '[check]', '[bet]'"
        ));
        let action = ["[check]", "[bet]"][rng.below(2)];
        out.push_str(&chat_turn(&log, action));
        let reply = if action == "[bet]" {
            ["[call]", "[fold]"][rng.below(2)]
        } else {
            ["[check]", "[bet]"][rng.below(2)]
        };
        log.push_str(&format!(
            "\n[Player {player}] {action}\n[Player {}] {reply}\n[GAME] Player {} wins the pot of {} chips.",
            1 - player,
            rng.below(2),
            2 + rng.below(2)
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merges_are_learned_most_frequent_first() {
        let chunks: Vec<String> = ["abab", "ab", "cd"]
            .iter()
            .map(|s| (*s).to_owned())
            .collect();
        let mut vocab: Vec<String> = ["a", "b", "c", "d"]
            .iter()
            .map(|s| (*s).to_owned())
            .collect();
        let merges = learn_merges(&chunks, &mut vocab, 10);
        // "a b" occurs 3 times, then "ab ab" once: learning stops below 2.
        assert_eq!(merges, vec![("a".to_owned(), "b".to_owned())]);
        assert_eq!(vocab.last().unwrap(), "ab");
        let mut capped = vec!["a".to_owned(), "b".to_owned()];
        assert!(learn_merges(&chunks, &mut capped, 2).is_empty());
    }

    #[test]
    fn sample_text_is_deterministic_and_covers_the_games() {
        let text = sample_game_text();
        assert_eq!(text, sample_game_text());
        for needle in [
            "Tic Tac Toe",
            "Connect Four",
            "Kuhn Poker",
            "[col ",
            "---+---+---",
            "assistant\n[",
        ] {
            assert!(text.contains(needle), "{needle}");
        }
    }
}
