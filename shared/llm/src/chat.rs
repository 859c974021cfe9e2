//! Chat templates: the Jinja templates Hugging Face models ship to turn a list of
//! messages into the prompt text the model was trained on.
//!
//! This module owns [`ChatMessage`] and [`ChatTemplate`], rendered with `minijinja`
//! set up the way transformers sets up Jinja2 for `apply_chat_template`:
//! `trim_blocks` and `lstrip_blocks` on, loop controls, Python string and dict
//! methods (`.strip()`, `.startswith()`, `.items()`, ...), the `raise_exception`
//! and `strftime_now` functions, and a `tojson` filter that writes JSON as Python's
//! `json.dumps(ensure_ascii=False)` does. The variables are `messages`,
//! `add_generation_prompt`, `bos_token` and `eos_token`.

use minijinja::value::{Kwargs, Serde, ValueKind};
use minijinja::{Environment, Error, ErrorKind, Value};
use serde::{Deserialize, Serialize};

/// One message of a conversation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    /// Who speaks: `system`, `user` or `assistant`.
    pub role: String,
    /// What they say.
    pub content: String,
}

impl ChatMessage {
    /// A message with any role.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
        }
    }

    /// A `system` message.
    pub fn system(content: impl Into<String>) -> Self {
        Self::new("system", content)
    }

    /// A `user` message.
    pub fn user(content: impl Into<String>) -> Self {
        Self::new("user", content)
    }

    /// An `assistant` message.
    pub fn assistant(content: impl Into<String>) -> Self {
        Self::new("assistant", content)
    }
}

/// A chat template failed to compile or to render.
#[derive(Debug, thiserror::Error)]
#[error("chat template: {0:#}")]
pub struct ChatTemplateError(#[from] Error);

const TEMPLATE_NAME: &str = "chat";

/// A compiled chat template with the special tokens it may refer to.
#[derive(Clone)]
pub struct ChatTemplate {
    source: String,
    env: Environment<'static>,
    bos_token: Option<String>,
    eos_token: Option<String>,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("source", &self.source)
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .finish()
    }
}

impl ChatTemplate {
    /// Compiles `source`; `bos_token` and `eos_token` are the values of the
    /// template's variables of those names (undefined when `None`).
    pub fn new(
        source: impl Into<String>,
        bos_token: Option<String>,
        eos_token: Option<String>,
    ) -> Result<Self, ChatTemplateError> {
        let source = source.into();
        let mut env = Environment::new();
        env.set_syntax(
            minijinja::syntax::SyntaxConfig::builder()
                .trim_blocks(true)
                .lstrip_blocks(true)
                .build()
                .map_err(ChatTemplateError)?,
        );
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", tojson);
        env.add_template_owned(TEMPLATE_NAME, source.clone())?;
        Ok(Self {
            source,
            env,
            bos_token,
            eos_token,
        })
    }

    /// The prompt for `messages`; with `add_generation_prompt`, ending with what
    /// opens the assistant's reply (e.g. `<|im_start|>assistant\n`).
    pub fn render(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, ChatTemplateError> {
        self.render_with(messages, add_generation_prompt, &serde_json::Map::new())
    }

    /// [`ChatTemplate::render`] with extra template variables, as
    /// transformers' `apply_chat_template(..., **kwargs)` passes them:
    /// Qwen3's `enable_thinking`, Llama 3.1's `date_string`. They override
    /// `bos_token` and `eos_token` of the same name. As in transformers,
    /// `tools` and `documents` are defined (as none) unless given.
    pub fn render_with(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        kwargs: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<String, ChatTemplateError> {
        let template = self.env.get_template(TEMPLATE_NAME)?;
        let context = minijinja::context! {
            ..Value::from(Serde(kwargs)),
            ..minijinja::context! {
                messages => Serde(messages),
                add_generation_prompt => add_generation_prompt,
                bos_token => self.bos_token.clone(),
                eos_token => self.eos_token.clone(),
                tools => (),
                documents => (),
            }
        };
        Ok(template.render(context)?)
    }

    /// The template's Jinja source.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// The value of the template's `bos_token`.
    pub fn bos_token(&self) -> Option<&str> {
        self.bos_token.as_deref()
    }

    /// The value of the template's `eos_token`.
    pub fn eos_token(&self) -> Option<&str> {
        self.eos_token.as_deref()
    }
}

/// `raise_exception(message)`: templates call it to refuse a conversation.
fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message))
}

/// `strftime_now(format)`: the current UTC time, for templates that print today's
/// date. Supports `%Y %m %d %e %B %b %H %M %S %%`.
fn strftime_now(format: String) -> Result<String, Error> {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_err(|e| Error::new(ErrorKind::InvalidOperation, e.to_string()))?
        .as_secs() as i64;
    strftime(secs, &format)
}

const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];

fn strftime(unix_secs: i64, format: &str) -> Result<String, Error> {
    let (year, month, day) = civil_from_days(unix_secs.div_euclid(86_400));
    let secs_of_day = unix_secs.rem_euclid(86_400);
    let (hour, minute, second) = (secs_of_day / 3600, secs_of_day / 60 % 60, secs_of_day % 60);
    let month_name = MONTHS[(month - 1) as usize];
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('Y') => out.push_str(&year.to_string()),
            Some('m') => out.push_str(&format!("{month:02}")),
            Some('d') => out.push_str(&format!("{day:02}")),
            Some('e') => out.push_str(&format!("{day:>2}")),
            Some('B') => out.push_str(month_name),
            Some('b') => out.push_str(&month_name[..3]),
            Some('H') => out.push_str(&format!("{hour:02}")),
            Some('M') => out.push_str(&format!("{minute:02}")),
            Some('S') => out.push_str(&format!("{second:02}")),
            Some('%') => out.push('%'),
            other => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    format!(
                        "strftime_now: unsupported directive %{}",
                        other.unwrap_or(' ')
                    ),
                ))
            }
        }
    }
    Ok(out)
}

/// (year, month 1..=12, day 1..=31) of a day count since 1970-01-01
/// (Howard Hinnant's `civil_from_days`).
fn civil_from_days(days: i64) -> (i64, i64, i64) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

/// `tojson(indent=None, sort_keys=False)` as transformers defines it:
/// `json.dumps(value, ensure_ascii=False, indent=indent, sort_keys=sort_keys)`.
/// Unlike minijinja's own filter, it does not escape `<`, `>`, `&` or `'`.
fn tojson(value: &Value, indent: Option<usize>, kwargs: Kwargs) -> Result<Value, Error> {
    let indent: Option<usize> = match indent {
        Some(indent) => Some(indent),
        None => kwargs.get("indent")?,
    };
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    kwargs.assert_all_used()?;
    let style = JsonStyle {
        indent,
        sort_keys: sort_keys.unwrap_or(false),
    };
    let mut out = String::new();
    write_python_json(&mut out, value, style, 0)?;
    Ok(Value::from_safe_string(out))
}

#[derive(Clone, Copy)]
struct JsonStyle {
    indent: Option<usize>,
    sort_keys: bool,
}

/// Writes `value` as Python's `json.dumps(ensure_ascii=False)` does: `", "` and
/// `": "` between items on one line, or newlines and `indent` spaces with `indent`;
/// maps keep their order unless `sort_keys`.
fn write_python_json(
    out: &mut String,
    value: &Value,
    style: JsonStyle,
    depth: usize,
) -> Result<(), Error> {
    let newline = |out: &mut String, depth: usize| {
        if let Some(width) = style.indent {
            out.push('\n');
            out.push_str(&" ".repeat(width * depth));
        }
    };
    let item_separator = if style.indent.is_some() { "," } else { ", " };
    let not_json = || Error::new(ErrorKind::InvalidOperation, "cannot serialize to JSON");
    match value.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
        ValueKind::Number => match value.as_i64() {
            Some(int) => out.push_str(&int.to_string()),
            None => {
                let float = f64::try_from(value.clone())?;
                match serde_json::Number::from_f64(float) {
                    Some(number) => out.push_str(&number.to_string()),
                    // Python writes the non-finite floats as bare words.
                    None if float.is_nan() => out.push_str("NaN"),
                    None if float > 0.0 => out.push_str("Infinity"),
                    None => out.push_str("-Infinity"),
                }
            }
        },
        ValueKind::String => {
            let text = value.as_str().ok_or_else(not_json)?;
            out.push_str(&serde_json::Value::from(text).to_string());
        }
        ValueKind::Map => {
            let mut keys: Vec<Value> = value.try_iter()?.collect();
            if style.sort_keys {
                keys.sort();
            }
            if keys.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            out.push('{');
            for (i, key) in keys.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_separator);
                }
                newline(out, depth + 1);
                let key_text = match key.as_str() {
                    Some(text) => text.to_owned(),
                    None => key.to_string(),
                };
                out.push_str(&serde_json::Value::from(key_text).to_string());
                out.push_str(": ");
                write_python_json(out, &value.get_item(key)?, style, depth + 1)?;
            }
            newline(out, depth);
            out.push('}');
        }
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = value.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_separator);
                }
                newline(out, depth + 1);
                write_python_json(out, item, style, depth + 1)?;
            }
            newline(out, depth);
            out.push(']');
        }
        _ => return Err(not_json()),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn civil_dates_match_known_days() {
        assert_eq!(civil_from_days(0), (1970, 1, 1));
        assert_eq!(civil_from_days(19_723), (2024, 1, 1));
        assert_eq!(civil_from_days(19_782), (2024, 2, 29));
        assert_eq!(
            strftime(1_709_210_096, "%d %b %Y %H:%M:%S %%").unwrap(),
            "29 Feb 2024 12:34:56 %"
        );
        assert!(strftime(0, "%Q").is_err());
    }

    #[test]
    fn tojson_writes_like_python_json_dumps() {
        let template = ChatTemplate::new(
            "{{ messages | tojson }}|{{ {'b': [1, 2], 'a': '<é>'} | tojson(sort_keys=true) }}|{{ [1, {'k': 2}] | tojson(indent=2) }}",
            None,
            None,
        )
        .unwrap();
        let out = template
            .render(&[ChatMessage::user("hi \"x\"")], false)
            .unwrap();
        assert_eq!(
            out,
            "[{\"role\": \"user\", \"content\": \"hi \\\"x\\\"\"}]|{\"a\": \"<é>\", \"b\": [1, 2]}|[\n  1,\n  {\n    \"k\": 2\n  }\n]"
        );
    }

    #[test]
    fn python_methods_loop_controls_and_exceptions_work() {
        let template = ChatTemplate::new(
            "{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}{{ m['content'].strip().upper() }}{% endfor %}{% if not add_generation_prompt %}{{ raise_exception('need a prompt') }}{% endif %}{{ bos_token }}",
            Some("<s>".into()),
            None,
        )
        .unwrap();
        let messages = [
            ChatMessage::system("skip me"),
            ChatMessage::user("  move  "),
        ];
        assert_eq!(template.render(&messages, true).unwrap(), "MOVE<s>");
        let err = template.render(&messages, false).unwrap_err();
        assert!(err.to_string().contains("need a prompt"), "{err}");
    }
}
