//! Move parsing with the semantics of Python's `re` and `int()`.
//!
//! TextArena parses moves with `re` patterns on `str`, where `\d` is any
//! Unicode decimal digit (category Nd, e.g. `٤` or `４`), `\s` is Python's
//! whitespace (including the ASCII separators `\x1c`..`\x1f`, which Rust's
//! `char::is_whitespace` lacks), and `int()` turns any such digit string
//! into a number of unlimited size. This module owns hand-written matchers
//! for the few patterns the games use, equivalent to the Python ones (each
//! function names its pattern), so no regex engine is needed.

/// First code point of every run of ten Unicode decimal digits (category
/// Nd, Unicode 15.0 as in Python 3.12 / 3.13): each run is `0..=9` in order.
const DECIMAL_DIGIT_ZEROS: &[u32] = &[
    0x30, 0x660, 0x6F0, 0x7C0, 0x966, 0x9E6, 0xA66, 0xAE6, 0xB66, 0xBE6, 0xC66, 0xCE6, 0xD66,
    0xDE6, 0xE50, 0xED0, 0xF20, 0x1040, 0x1090, 0x17E0, 0x1810, 0x1946, 0x19D0, 0x1A80, 0x1A90,
    0x1B50, 0x1BB0, 0x1C40, 0x1C50, 0xA620, 0xA8D0, 0xA900, 0xA9D0, 0xA9F0, 0xAA50, 0xABF0, 0xFF10,
    0x104A0, 0x10D30, 0x11066, 0x110F0, 0x11136, 0x111D0, 0x112F0, 0x11450, 0x114D0, 0x11650,
    0x116C0, 0x11730, 0x118E0, 0x11950, 0x11C50, 0x11D50, 0x11DA0, 0x11F50, 0x16A60, 0x16AC0,
    0x16B50, 0x1D7CE, 0x1D7D8, 0x1D7E2, 0x1D7EC, 0x1D7F6, 0x1E140, 0x1E2F0, 0x1E4F0, 0x1E950,
    0x1FBF0,
];

/// Python's `\d`: the value of a Unicode decimal digit.
pub(crate) fn decimal_digit(c: char) -> Option<u8> {
    let code = u32::from(c);
    // The table is sorted: find the last run starting at or before `code`.
    let idx = DECIMAL_DIGIT_ZEROS.partition_point(|&zero| zero <= code);
    let zero = *DECIMAL_DIGIT_ZEROS.get(idx.checked_sub(1)?)?;
    let value = code - zero;
    (value < 10).then_some(value as u8)
}

/// Python's `\s` (and `str.isspace`).
pub(crate) fn is_space(c: char) -> bool {
    c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c)
}

/// A non-negative integer as Python's `int()` reads a `\d+` match and `str()`
/// prints it back: ASCII digits without leading zeros (`"007"` is 7,
/// `"٤٢"` is 42), of any length.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct PyInt(String);

impl PyInt {
    fn from_digits(digits: &[u8]) -> Self {
        let first = digits.iter().position(|&d| d != 0).unwrap_or(digits.len());
        let text: String = if first == digits.len() {
            "0".to_string()
        } else {
            digits[first..]
                .iter()
                .map(|d| char::from(b'0' + d))
                .collect()
        };
        Self(text)
    }

    /// The value, if it fits in a `usize`.
    pub(crate) fn value(&self) -> Option<usize> {
        self.0.parse().ok()
    }
}

impl std::fmt::Display for PyInt {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// Matches `\d+` at the start of `chars`: the digits and their count.
fn digits_at(chars: &[char]) -> (Vec<u8>, usize) {
    let digits: Vec<u8> = chars.iter().map_while(|&c| decimal_digit(c)).collect();
    let n = digits.len();
    (digits, n)
}

/// Python's case-insensitive comparison of a character with an ASCII
/// letter under `re.IGNORECASE` (the Kelvin sign `K` equals `k`).
fn eq_ignore_case(c: char, lower_ascii: char) -> bool {
    c.to_ascii_lowercase() == lower_ascii || (lower_ascii == 'k' && c == '\u{212A}')
}

/// Whether `chars` starts with `word` (ASCII lowercase) ignoring case.
fn starts_with_ignore_case(chars: &[char], word: &str) -> bool {
    chars.len() >= word.len() && word.chars().zip(chars).all(|(w, &c)| eq_ignore_case(c, w))
}

/// `re.search(r"\[\s*(\d+)\s*\]", text)` (TicTacToe): group 1 of the
/// leftmost match.
pub(crate) fn bracketed_number_with_spaces(text: &str) -> Option<PyInt> {
    let chars: Vec<char> = text.chars().collect();
    (0..chars.len()).find_map(|start| {
        if chars[start] != '[' {
            return None;
        }
        let mut i = start + 1;
        while i < chars.len() && is_space(chars[i]) {
            i += 1;
        }
        let (digits, n) = digits_at(&chars[i..]);
        if n == 0 {
            return None;
        }
        i += n;
        while i < chars.len() && is_space(chars[i]) {
            i += 1;
        }
        (chars.get(i) == Some(&']')).then(|| PyInt::from_digits(&digits))
    })
}

/// `re.search(r"\[(\d+)\]", text)` (GuessTheNumber): group 1 of the
/// leftmost match.
pub(crate) fn bracketed_number(text: &str) -> Option<PyInt> {
    let chars: Vec<char> = text.chars().collect();
    (0..chars.len()).find_map(|start| {
        if chars[start] != '[' {
            return None;
        }
        let (digits, n) = digits_at(&chars[start + 1..]);
        (n > 0 && chars.get(start + 1 + n) == Some(&']')).then(|| PyInt::from_digits(&digits))
    })
}

/// `re.compile(r'.*\[(?:col\s*)?(\d+)\].*', re.IGNORECASE).search(text)`
/// (ConnectFour). `.` stops at `\n`, so the match lies on the first line
/// that has one, and the greedy `.*` makes it the *rightmost* `[` of that
/// line at which `\[(?:col\s*)?(\d+)\]` matches.
pub(crate) fn connect_four_column(text: &str) -> Option<PyInt> {
    text.split('\n').find_map(|line| {
        let chars: Vec<char> = line.chars().collect();
        (0..chars.len()).rev().find_map(|start| {
            if chars[start] != '[' {
                return None;
            }
            let mut i = start + 1;
            if starts_with_ignore_case(&chars[i..], "col") {
                i += 3;
                while i < chars.len() && is_space(chars[i]) {
                    i += 1;
                }
            }
            let (digits, n) = digits_at(&chars[i..]);
            (n > 0 && chars.get(i + n) == Some(&']')).then(|| PyInt::from_digits(&digits))
        })
    })
}

/// `re.compile(r"\[(Check|Bet|Fold|Call)\]", re.IGNORECASE).search(text)`
/// followed by `.lower()` (KuhnPoker): the leftmost move word, lowercase.
pub(crate) fn kuhn_move(text: &str) -> Option<&'static str> {
    const WORDS: [&str; 4] = ["check", "bet", "fold", "call"];
    let chars: Vec<char> = text.chars().collect();
    (0..chars.len()).find_map(|start| {
        if chars[start] != '[' {
            return None;
        }
        let rest = &chars[start + 1..];
        WORDS
            .into_iter()
            .find(|word| starts_with_ignore_case(rest, word) && rest.get(word.len()) == Some(&']'))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn num(s: &str) -> Option<String> {
        bracketed_number_with_spaces(s).map(|n| n.to_string())
    }

    #[test]
    fn unicode_digits_follow_python() {
        assert_eq!(decimal_digit('7'), Some(7));
        assert_eq!(decimal_digit('\u{664}'), Some(4)); // ARABIC-INDIC DIGIT FOUR
        assert_eq!(decimal_digit('\u{FF19}'), Some(9)); // FULLWIDTH DIGIT NINE
        assert_eq!(decimal_digit('\u{1D7CE}'), Some(0)); // MATHEMATICAL BOLD DIGIT ZERO
        assert_eq!(decimal_digit('\u{B2}'), None); // SUPERSCRIPT TWO is No, not Nd
        assert_eq!(decimal_digit('a'), None);
        assert_eq!(decimal_digit('/'), None);
        assert_eq!(decimal_digit(':'), None);
        assert!(is_space('\u{1f}') && is_space('\u{3000}') && is_space('\n'));
        assert!(!is_space('\u{200B}'));
    }

    #[test]
    fn tic_tac_toe_pattern() {
        assert_eq!(num("[4]").as_deref(), Some("4"));
        assert_eq!(num("I play [ 007 ] then [3]").as_deref(), Some("7"));
        assert_eq!(num("[\n12\t]").as_deref(), Some("12"));
        assert_eq!(num("[-1]"), None);
        assert_eq!(num("[x] [4"), None);
        assert_eq!(num("[[5]").as_deref(), Some("5"));
        assert_eq!(num("[\u{664}]").as_deref(), Some("4"));
        assert_eq!(
            num("[000000000000000000000000000000009]").as_deref(),
            Some("9")
        );
        let big = bracketed_number_with_spaces("[123456789012345678901234567890]").unwrap();
        assert_eq!(big.to_string(), "123456789012345678901234567890");
        assert_eq!(big.value(), None);
    }

    #[test]
    fn guess_pattern_allows_no_spaces() {
        assert_eq!(bracketed_number("[ 5]"), None);
        assert_eq!(
            bracketed_number("[a] [05]")
                .map(|n| n.to_string())
                .as_deref(),
            Some("5")
        );
    }

    #[test]
    fn connect_four_pattern_takes_the_rightmost_match_of_the_first_matching_line() {
        let col = |s: &str| connect_four_column(s).map(|n| n.to_string());
        assert_eq!(col("[col 3]").as_deref(), Some("3"));
        assert_eq!(col("[COL\t2]").as_deref(), Some("2"));
        assert_eq!(col("[1] or [col 5] ok").as_deref(), Some("5"));
        assert_eq!(col("none here\n[2]\n[4]").as_deref(), Some("2"));
        assert_eq!(col("[col -1]"), None);
        assert_eq!(col("[col x]"), None);
        assert_eq!(col("[column 3]"), None);
        assert_eq!(col("[col 7]").as_deref(), Some("7"));
    }

    #[test]
    fn kuhn_pattern_is_case_insensitive() {
        assert_eq!(kuhn_move("I [BET]"), Some("bet"));
        assert_eq!(kuhn_move("[Chec\u{212A}]"), Some("check"));
        assert_eq!(kuhn_move("[raise] [call]"), Some("call"));
        assert_eq!(kuhn_move("[ fold]"), None);
    }
}
