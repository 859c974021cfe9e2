//! Answer formats: how the move is read from a model's reply.
//!
//! A model playing a text game may think in free text before it answers;
//! the game must then get the answer, not the thought (a `[3]` mentioned
//! while reasoning is not a move). [`AnswerFormat`] names where the answer
//! is, as UnstableBaselines and SPIRAL read it: the last `\boxed{...}`, the
//! last `[...]`, or a run's own pattern; [`AnswerReader`] reads it. `raw`
//! keeps TextArena's own behaviour: the whole reply goes to the game, which
//! finds the move in it.
//!
//! The frame of an answer ([`AnswerReader::frame`]) is what constrained
//! decoding needs to apply the constraint to the answer only: the text
//! that opens it and the text that closes it around the move.

use serde::{Deserialize, Serialize};

/// Where a reply's answer is (`text.answer`): in config a name (`raw`,
/// `boxed`, `last_bracket`) or `{regex: <pattern>}`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "FormatText", into = "FormatText")]
pub enum AnswerFormat {
    /// The whole reply is the move: the game reads it (TextArena's games
    /// find `[4]` anywhere in it). It counts as answered when it holds a
    /// bracketed move.
    #[default]
    Raw,
    /// The content of the last `\boxed{...}`, put in brackets unless it has
    /// one (`\boxed{4}` is `[4]`, `\boxed{[Bet]}` is `[Bet]`), as
    /// UnstableBaselines and SPIRAL read their models' answers.
    Boxed,
    /// The last `[...]` of the reply, brackets included.
    LastBracket,
    /// The last match of this regular expression (Rust `regex` syntax):
    /// its first capture group if it has one, else the whole match.
    Regex(String),
}

/// [`AnswerFormat`] as config text spells it.
#[derive(Serialize, Deserialize)]
#[serde(untagged)]
enum FormatText {
    Name(String),
    Pattern { regex: String },
}

impl TryFrom<FormatText> for AnswerFormat {
    type Error = String;
    fn try_from(text: FormatText) -> Result<Self, String> {
        match text {
            FormatText::Pattern { regex } => Ok(AnswerFormat::Regex(regex)),
            FormatText::Name(name) => match name.as_str() {
                "raw" => Ok(AnswerFormat::Raw),
                "boxed" => Ok(AnswerFormat::Boxed),
                "last_bracket" => Ok(AnswerFormat::LastBracket),
                other => Err(format!(
                    "unknown answer format {other:?} (raw, boxed, last_bracket, or {{regex: <pattern>}})"
                )),
            },
        }
    }
}

/// A named format (`raw`, `boxed`, `last_bracket`), as a command-line flag
/// spells it.
impl std::str::FromStr for AnswerFormat {
    type Err = String;
    fn from_str(name: &str) -> Result<Self, String> {
        FormatText::Name(name.to_string()).try_into()
    }
}

impl From<AnswerFormat> for FormatText {
    fn from(format: AnswerFormat) -> Self {
        match format {
            AnswerFormat::Raw => FormatText::Name("raw".into()),
            AnswerFormat::Boxed => FormatText::Name("boxed".into()),
            AnswerFormat::LastBracket => FormatText::Name("last_bracket".into()),
            AnswerFormat::Regex(regex) => FormatText::Pattern { regex },
        }
    }
}

impl AnswerFormat {
    /// `action` (a move as the game takes it, e.g. `[4]`) written as a
    /// reply this format reads back as `action`, for supervised targets:
    /// `\boxed{4}` under `boxed` (a one-word bracketed move loses its
    /// brackets, as those models write it), the move itself under `raw` and
    /// `last_bracket`. `None` under `regex`: a pattern says how to read an
    /// answer, not how to write one.
    pub fn write(&self, action: &str) -> Option<String> {
        match self {
            AnswerFormat::Raw | AnswerFormat::LastBracket => Some(action.to_string()),
            AnswerFormat::Boxed => {
                let inner = action
                    .strip_prefix('[')
                    .and_then(|a| a.strip_suffix(']'))
                    .filter(|inner| !inner.contains(['[', ']']) && !inner.trim().is_empty())
                    .unwrap_or(action);
                Some(format!("{BOXED_OPENER}{inner}}}"))
            }
            AnswerFormat::Regex(_) => None,
        }
    }
}

/// The text around a constrained answer: `opener`, the move, `closer`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frame {
    pub opener: &'static str,
    pub closer: &'static str,
}

/// What a reply holds, read by an [`AnswerReader`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Answer {
    /// What the game gets: the answer, the whole reply under `raw`, or an
    /// empty move when no answer was found (the game refuses it).
    pub action: String,
    /// Whether the format found an answer.
    pub found: bool,
}

/// Reads answers in one [`AnswerFormat`] (its pattern compiled once).
#[derive(Debug, Clone)]
pub struct AnswerReader {
    format: AnswerFormat,
    regex: Option<regex::Regex>,
}

impl PartialEq for AnswerReader {
    fn eq(&self, other: &Self) -> bool {
        self.format == other.format
    }
}

impl AnswerReader {
    /// A reader of `format`; fails on a regex that does not compile.
    pub fn new(format: &AnswerFormat) -> Result<Self, String> {
        let regex = match format {
            AnswerFormat::Regex(pattern) => Some(
                regex::Regex::new(pattern)
                    .map_err(|e| format!("the answer pattern {pattern:?} does not compile: {e}"))?,
            ),
            _ => None,
        };
        Ok(Self {
            format: format.clone(),
            regex,
        })
    }

    /// The format read.
    pub fn format(&self) -> &AnswerFormat {
        &self.format
    }

    /// Reads `reply`'s answer.
    pub fn read(&self, reply: &str) -> Answer {
        let answer = match &self.format {
            AnswerFormat::Raw => {
                return Answer {
                    action: reply.to_string(),
                    found: holds_bracketed_move(reply),
                }
            }
            AnswerFormat::Boxed => last_boxed(reply).map(|inner| {
                let inner = inner.trim();
                if inner.contains('[') {
                    inner.to_string()
                } else {
                    format!("[{inner}]")
                }
            }),
            AnswerFormat::LastBracket => last_bracketed(reply).map(str::to_string),
            AnswerFormat::Regex(_) => {
                let regex = self.regex.as_ref().expect("compiled in new");
                regex.captures_iter(reply).last().map(|c| {
                    c.get(1)
                        .or_else(|| c.get(0))
                        .map_or("", |m| m.as_str())
                        .to_string()
                })
            }
        };
        match answer {
            Some(action) if !action.trim().is_empty() && action.trim() != "[]" => Answer {
                action,
                found: true,
            },
            _ => Answer {
                action: String::new(),
                found: false,
            },
        }
    }

    /// The frame of a constrained answer: `None` under `raw` (the whole
    /// reply is the move, constrained from its first token) and `regex`
    /// (an arbitrary pattern has no frame to decode).
    pub fn frame(&self) -> Option<Frame> {
        match self.format {
            AnswerFormat::Boxed => Some(Frame {
                opener: BOXED_OPENER,
                closer: "}",
            }),
            AnswerFormat::LastBracket => Some(Frame {
                opener: "",
                closer: "",
            }),
            AnswerFormat::Raw | AnswerFormat::Regex(_) => None,
        }
    }
}

const BOXED_OPENER: &str = "\\boxed{";

/// The content of the last `\boxed{...}`, braces balanced inside it
/// (`\boxed{\text{4}}` is `\text{4}`); an unclosed last one is skipped.
fn last_boxed(reply: &str) -> Option<&str> {
    let mut found = None;
    let mut from = 0;
    while let Some(at) = reply[from..].find(BOXED_OPENER) {
        let start = from + at + BOXED_OPENER.len();
        let mut depth = 1usize;
        for (i, c) in reply[start..].char_indices() {
            match c {
                '{' => depth += 1,
                '}' => {
                    depth -= 1;
                    if depth == 0 {
                        found = Some(&reply[start..start + i]);
                        break;
                    }
                }
                _ => {}
            }
        }
        from = start;
    }
    found
}

/// The last `[...]` (without nested brackets) with something inside.
fn last_bracketed(reply: &str) -> Option<&str> {
    let close = reply.rfind(']')?;
    let open = reply[..close].rfind('[')?;
    (close > open + 1).then(|| &reply[open..=close])
}

/// Whether `reply` holds a bracketed move (`[...]` with something inside),
/// the form every game asks for.
pub fn holds_bracketed_move(reply: &str) -> bool {
    reply
        .find('[')
        .and_then(|open| reply[open + 1..].find(']'))
        .is_some_and(|len| len > 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(format: AnswerFormat, reply: &str) -> Answer {
        AnswerReader::new(&format).unwrap().read(reply)
    }

    #[test]
    fn a_written_answer_reads_back_as_the_move() {
        for format in [
            AnswerFormat::Raw,
            AnswerFormat::Boxed,
            AnswerFormat::LastBracket,
        ] {
            for action in ["[4]", "[Bet]", "[a2 a4]", "[Pass]"] {
                let reply = format.write(action).unwrap();
                let answer = read(format.clone(), &reply);
                assert_eq!(
                    (answer.action.as_str(), answer.found),
                    (action, true),
                    "{format:?} wrote {reply:?}"
                );
            }
        }
        assert_eq!(AnswerFormat::Boxed.write("[4]").unwrap(), "\\boxed{4}");
        assert_eq!(AnswerFormat::Regex("Move: (.*)".into()).write("[4]"), None);
    }

    #[test]
    fn boxed_reads_the_last_box_and_brackets_a_bare_move() {
        let a = read(
            AnswerFormat::Boxed,
            "[3] is taken, so \\boxed{5}? No: \\boxed{4}",
        );
        assert_eq!((a.action.as_str(), a.found), ("[4]", true));
        let a = read(AnswerFormat::Boxed, "I bet. \\boxed{[Bet]}");
        assert_eq!(a.action, "[Bet]");
        let a = read(AnswerFormat::Boxed, "\\boxed{\\text{4}}");
        assert_eq!(a.action, "[\\text{4}]");
        for missing in ["I play [4]", "\\boxed{}", "\\boxed{4", "\\boxed{ }"] {
            let a = read(AnswerFormat::Boxed, missing);
            assert_eq!((a.action.as_str(), a.found), ("", false), "{missing:?}");
        }
        // An unclosed last box leaves the earlier closed one.
        assert_eq!(
            read(AnswerFormat::Boxed, "\\boxed{2} then \\boxed{7").action,
            "[2]"
        );
    }

    #[test]
    fn last_bracket_reads_the_last_bracketed_move() {
        let a = read(
            AnswerFormat::LastBracket,
            "Not [3], it is taken. I play [4].",
        );
        assert_eq!((a.action.as_str(), a.found), ("[4]", true));
        for missing in ["I play 4", "[]", "4]", "[4"] {
            assert!(
                !read(AnswerFormat::LastBracket, missing).found,
                "{missing:?}"
            );
        }
    }

    #[test]
    fn regex_reads_its_last_match_and_first_group() {
        let format = AnswerFormat::Regex(r"Move: (\[\d\])".into());
        let a = read(format.clone(), "Move: [1]\nOn second thought, Move: [2]");
        assert_eq!((a.action.as_str(), a.found), ("[2]", true));
        assert!(!read(format, "I play [2]").found);
        let whole = AnswerFormat::Regex(r"\[\d\]".into());
        assert_eq!(read(whole, "[1] or [2]").action, "[2]");
        let err = AnswerReader::new(&AnswerFormat::Regex("(".into())).unwrap_err();
        assert!(err.contains("does not compile"), "{err}");
    }

    #[test]
    fn raw_passes_the_whole_reply_and_finds_a_bracketed_move() {
        let a = read(AnswerFormat::Raw, "I play [4]");
        assert_eq!((a.action.as_str(), a.found), ("I play [4]", true));
        let a = read(AnswerFormat::Raw, "four");
        assert_eq!((a.action.as_str(), a.found), ("four", false));
        assert!(holds_bracketed_move("[col 3]"));
        for missing in ["[]", "4", "] ["] {
            assert!(!holds_bracketed_move(missing), "{missing:?}");
        }
    }

    #[test]
    fn formats_parse_from_config_text() {
        let parse = |y: &str| serde_json::from_str::<AnswerFormat>(y).unwrap();
        assert_eq!(parse("\"boxed\""), AnswerFormat::Boxed);
        assert_eq!(parse("\"last_bracket\""), AnswerFormat::LastBracket);
        assert_eq!(
            parse(r#"{"regex": "Move: (.*)"}"#),
            AnswerFormat::Regex("Move: (.*)".into())
        );
        let err = serde_json::from_str::<AnswerFormat>("\"boxes\"").unwrap_err();
        assert!(err.to_string().contains("unknown answer format"), "{err}");
        for format in [AnswerFormat::Boxed, AnswerFormat::Regex("x".into())] {
            let text = serde_json::to_string(&format).unwrap();
            assert_eq!(serde_json::from_str::<AnswerFormat>(&text).unwrap(), format);
        }
    }
}
