//! `metrics.csv`: the metric reports of `metrics.jsonl` in long format, one
//! row per reported value, for spreadsheets, pandas and gnuplot.
//!
//! ```text
//! time,service,instance,vec_steps,name,value
//! 2025-01-01T12:00:01.250Z,learner,learner-4242-ab12,2048,learner_policy_loss,-0.0123
//! ```
//!
//! - `time`: when the tracker received the report (RFC 3339 UTC, the same
//!   string as the `metrics.jsonl` line);
//! - `vec_steps`: empty when the reporter did not give one;
//! - `name`: the metric's name, with its labels when it has some
//!   (`env_runner_text_win_rate{game=TicTacToe-v0}`, [`relay_proto::MetricValue::key`]);
//! - `value`: a gauge's value, or a counter's increment (as on the wire);
//! - fields holding `,`, `"` or a line break are quoted as RFC 4180 says.
//!
//! The header is written once, when the file is new.

use std::fs::{File, OpenOptions};
use std::io::{BufWriter, Write};
use std::path::Path;

use relay_proto::MetricsReport;

/// The first line of `metrics.csv`.
pub const HEADER: &str = "time,service,instance,vec_steps,name,value";

/// An appending writer of `metrics.csv`.
pub struct MetricsCsv {
    out: BufWriter<File>,
}

impl MetricsCsv {
    /// Opens (or creates, with its header) the file for appending.
    pub fn open(path: &Path) -> std::io::Result<Self> {
        let file = OpenOptions::new().create(true).append(true).open(path)?;
        let mut out = BufWriter::new(file);
        if out.get_ref().metadata()?.len() == 0 {
            writeln!(out, "{HEADER}")?;
        }
        Ok(Self { out })
    }

    /// Appends one row per value of the report.
    pub fn write(&mut self, time: &str, report: &MetricsReport) -> std::io::Result<()> {
        for row in rows(time, report) {
            writeln!(self.out, "{row}")?;
        }
        Ok(())
    }

    pub fn flush(&mut self) -> std::io::Result<()> {
        self.out.flush()
    }
}

/// The CSV rows (without line ends) of one report.
pub fn rows(time: &str, report: &MetricsReport) -> Vec<String> {
    let vec_steps = report.vec_steps.map(|s| s.to_string()).unwrap_or_default();
    report
        .values
        .iter()
        .map(|v| {
            [
                field(time),
                field(&report.service),
                field(&report.instance),
                vec_steps.clone(),
                field(&v.key()),
                v.value.to_string(),
            ]
            .join(",")
        })
        .collect()
}

/// One CSV field, quoted when it must be.
pub fn field(s: &str) -> String {
    if s.contains([',', '"', '\n', '\r']) {
        format!("\"{}\"", s.replace('"', "\"\""))
    } else {
        s.to_string()
    }
}

/// Splits one CSV line into fields (the inverse of [`rows`]; quoted fields
/// may hold commas and doubled quotes, not line breaks).
pub fn split_line(line: &str) -> Vec<String> {
    let mut fields = Vec::new();
    let mut current = String::new();
    let mut quoted = false;
    let mut chars = line.chars().peekable();
    while let Some(c) = chars.next() {
        match (c, quoted) {
            ('"', true) if chars.peek() == Some(&'"') => {
                current.push('"');
                chars.next();
            }
            ('"', true) => quoted = false,
            ('"', false) if current.is_empty() => quoted = true,
            (',', false) => fields.push(std::mem::take(&mut current)),
            (c, _) => current.push(c),
        }
    }
    fields.push(current);
    fields
}

#[cfg(test)]
mod tests {
    use super::*;
    use relay_proto::{MetricKind, MetricValue, SCHEMA_VERSION};

    #[test]
    fn rows_quote_what_needs_quoting_and_split_back() {
        let report = MetricsReport {
            schema: SCHEMA_VERSION,
            service: "env-runner".into(),
            instance: "a,\"b\"".into(),
            vec_steps: None,
            values: vec![MetricValue {
                name: "env_runner_sps".into(),
                kind: MetricKind::Gauge,
                value: 1234.5,
                labels: Default::default(),
            }],
        };
        let rows = rows("2025-01-01T00:00:00.000Z", &report);
        assert_eq!(
            rows,
            ["2025-01-01T00:00:00.000Z,env-runner,\"a,\"\"b\"\"\",,env_runner_sps,1234.5"]
        );
        assert_eq!(
            split_line(&rows[0]),
            [
                "2025-01-01T00:00:00.000Z",
                "env-runner",
                "a,\"b\"",
                "",
                "env_runner_sps",
                "1234.5"
            ]
        );
    }
}
