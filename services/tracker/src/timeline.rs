//! One step axis per run. A learner resumed from a checkpoint redoes the
//! updates made after that checkpoint, so its first reports carry
//! `vec_steps` the run directory already holds. When that happens the
//! lines of the abandoned timeline (every metric line whose `vec_steps` is
//! above the checkpoint's) are purged from `metrics.jsonl` and
//! `metrics.csv`, as TensorBoard's `purge_step` does: every curve then
//! continues from the checkpoint's step with no gap and no overlap.
//!
//! Only learner reports move the axis, and of a run's learner replicas
//! only rank 0's (the others report `learner_replica_rank` above 0 and do
//! not say whether they resumed); lines without `vec_steps` are never
//! purged. A report at the highest step so far is not a rewind by itself:
//! an off-policy learner makes several updates between two inserts of the
//! env-runners and reports each at the same `vec_steps`. A learner resumed
//! from a checkpoint says so in every report (`learner_resumed_at_vec_steps`),
//! and a resume not seen before rewinds the axis even at that step.

use std::fs::File;
use std::io::{BufRead, BufReader, BufWriter, Write};
use std::path::Path;

use relay_proto::MetricsReport;

use crate::csv;

/// The service whose reports define the step axis.
const LEARNER: &str = "learner";
/// The learner's report of the checkpoint it resumed from (0: a fresh start).
const RESUMED_AT: &str = "learner_resumed_at_vec_steps";
/// A learner replica's rank: only rank 0 (or a lone learner) moves the axis.
const REPLICA_RANK: &str = "learner_replica_rank";

/// Watches learner reports for a rewound step axis.
#[derive(Debug, Default)]
pub struct Timeline {
    /// The highest learner `vec_steps` written so far.
    learner_max: Option<u64>,
    /// The checkpoint step the latest learner report said it resumed from
    /// (`None`: a fresh start).
    resumed_at: Option<u64>,
}

impl Timeline {
    /// Starts from what `metrics.jsonl` already holds (a tracker restarted
    /// mid-run must still see a later rewind).
    pub fn scan(metrics_jsonl: &Path) -> std::io::Result<Self> {
        let mut timeline = Self::default();
        let file = match File::open(metrics_jsonl) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(timeline),
            Err(e) => return Err(e),
        };
        for line in BufReader::new(file).lines() {
            let line = line?;
            let Ok(value) = serde_json::from_str::<serde_json::Value>(&line) else {
                continue; // a torn last line of a killed tracker
            };
            let follower = value["values"][REPLICA_RANK]
                .as_f64()
                .is_some_and(|r| r > 0.0);
            if value["service"] == LEARNER && !follower {
                if let Some(v) = value["vec_steps"].as_u64() {
                    timeline.learner_max = Some(timeline.learner_max.map_or(v, |m| m.max(v)));
                    timeline.resumed_at = resumed_at(value["values"][RESUMED_AT].as_f64(), v);
                }
            }
        }
        Ok(timeline)
    }

    /// Takes a report before it is written. Returns `Some(step)` when it
    /// rewinds the axis: lines above `step` belong to the abandoned timeline.
    pub fn on_report(&mut self, report: &MetricsReport) -> Option<u64> {
        let follower = report
            .values
            .iter()
            .any(|m| m.name == REPLICA_RANK && m.value > 0.0);
        if report.service != LEARNER || follower {
            return None;
        }
        let v = report.vec_steps?;
        let resumed = resumed_at(
            report
                .values
                .iter()
                .find(|m| m.name == RESUMED_AT)
                .map(|m| m.value),
            v,
        );
        let new_resume = resumed.is_some() && resumed != self.resumed_at;
        self.resumed_at = resumed;
        let rewound = self
            .learner_max
            .is_some_and(|max| v < max || (v == max && new_resume));
        self.learner_max = Some(if rewound {
            v
        } else {
            self.learner_max.map_or(v, |m| m.max(v))
        });
        if !rewound {
            return None;
        }
        Some(resumed.unwrap_or(v - 1))
    }
}

/// The checkpoint step a learner report at `vec_steps` says it resumed
/// from: a positive value below the report's own step, else none.
fn resumed_at(value: Option<f64>, vec_steps: u64) -> Option<u64> {
    value
        .filter(|r| r.is_finite() && *r > 0.0 && (*r as u64) < vec_steps)
        .map(|r| r as u64)
}

/// Removes every line of `metrics.jsonl` and row of `metrics.csv` whose
/// `vec_steps` is above `above` (each file rewritten beside itself, then
/// renamed over). Returns the number of `metrics.jsonl` lines removed.
pub fn purge(metrics_jsonl: &Path, metrics_csv: &Path, above: u64) -> std::io::Result<usize> {
    let removed = rewrite(
        metrics_jsonl,
        |line| {
            serde_json::from_str::<serde_json::Value>(line)
                .ok()
                .and_then(|v| v["vec_steps"].as_u64())
        },
        above,
    )?;
    rewrite(
        metrics_csv,
        |line| csv::split_line(line).get(3).and_then(|s| s.parse().ok()),
        above,
    )?;
    Ok(removed)
}

/// Keeps the lines whose step (as `step_of` reads it) is unknown or at most `above`.
fn rewrite(
    path: &Path,
    step_of: impl Fn(&str) -> Option<u64>,
    above: u64,
) -> std::io::Result<usize> {
    let tmp = path.with_extension("purge.tmp");
    let mut out = BufWriter::new(File::create(&tmp)?);
    let mut removed = 0;
    for line in BufReader::new(File::open(path)?).lines() {
        let line = line?;
        if step_of(&line).is_some_and(|s| s > above) {
            removed += 1;
        } else {
            writeln!(out, "{line}")?;
        }
    }
    out.into_inner().map_err(|e| e.into_error())?.sync_all()?;
    std::fs::rename(&tmp, path)?;
    Ok(removed)
}

#[cfg(test)]
mod tests {
    use super::*;
    use relay_proto::{MetricKind, MetricValue, SCHEMA_VERSION};

    fn report(service: &str, vec_steps: u64, resumed_at: f64) -> MetricsReport {
        MetricsReport {
            schema: SCHEMA_VERSION,
            service: service.into(),
            instance: format!("{service}-1"),
            vec_steps: Some(vec_steps),
            values: vec![MetricValue {
                name: RESUMED_AT.into(),
                kind: MetricKind::Gauge,
                value: resumed_at,
                labels: Default::default(),
            }],
        }
    }

    #[test]
    fn a_resumed_learner_rewinds_to_its_checkpoint_once() {
        let mut t = Timeline::default();
        for v in [64, 128, 192, 256] {
            assert_eq!(t.on_report(&report("learner", v, 0.0)), None);
        }
        // Other services never move the axis.
        assert_eq!(t.on_report(&report("env-runner", 64, 0.0)), None);
        // Resumed from the checkpoint at 128: its first update is 192.
        assert_eq!(t.on_report(&report("learner", 192, 128.0)), Some(128));
        assert_eq!(t.on_report(&report("learner", 256, 128.0)), None);
        assert_eq!(t.on_report(&report("learner", 320, 128.0)), None);
        // Without the resume value the report's own step is kept.
        assert_eq!(t.on_report(&report("learner", 256, 0.0)), Some(255));
    }

    #[test]
    fn learner_replicas_beside_rank_0_do_not_move_the_axis() {
        let mut t = Timeline::default();
        let follower = |v| {
            let mut r = report("learner", v, 0.0);
            r.values.retain(|m| m.name != RESUMED_AT);
            r.values.push(MetricValue {
                name: REPLICA_RANK.into(),
                kind: MetricKind::Gauge,
                value: 1.0,
                labels: Default::default(),
            });
            r
        };
        // Rank 0 resumed at 128; its replica reports alongside, at its step
        // or one behind, and says nothing of the resume.
        assert_eq!(t.on_report(&report("learner", 192, 128.0)), None);
        for v in [192, 256, 192] {
            assert_eq!(t.on_report(&follower(v)), None);
            assert_eq!(t.on_report(&report("learner", 256, 128.0)), None);
        }
    }

    #[test]
    fn updates_reported_at_the_same_step_are_not_a_rewind() {
        // An off-policy learner trains several rounds per insert.
        let mut t = Timeline::default();
        for v in [16, 16, 16, 32, 32] {
            assert_eq!(t.on_report(&report("learner", v, 0.0)), None);
        }
        // A resume not seen before is a rewind even at the highest step ...
        assert_eq!(t.on_report(&report("learner", 32, 16.0)), Some(16));
        // ... once: the resumed learner's next reports at that step are not.
        assert_eq!(t.on_report(&report("learner", 32, 16.0)), None);
        assert_eq!(t.on_report(&report("learner", 48, 16.0)), None);
    }

    #[test]
    fn a_restarted_tracker_knows_the_resume_it_already_wrote() {
        let dir = std::env::temp_dir().join(format!("relay-timeline-scan-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let jsonl = dir.join("metrics.jsonl");
        let line = |v: u64, r: f64| {
            serde_json::json!({"service": "learner", "vec_steps": v, "values": {RESUMED_AT: r}})
                .to_string()
        };
        std::fs::write(&jsonl, format!("{}\n{}\n", line(64, 0.0), line(96, 32.0))).unwrap();
        let mut t = Timeline::scan(&jsonl).unwrap();
        assert_eq!(t.on_report(&report("learner", 96, 32.0)), None);
        assert_eq!(t.on_report(&report("learner", 96, 48.0)), Some(48));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn purge_keeps_one_timeline_in_both_files() {
        let dir = std::env::temp_dir().join(format!("relay-timeline-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (jsonl, csv_path) = (dir.join("metrics.jsonl"), dir.join("metrics.csv"));
        let mut j = String::new();
        let mut c = format!("{}\n", csv::HEADER);
        for (service, v) in [
            ("learner", 64),
            ("env-runner", 64),
            ("learner", 128),
            ("learner", 192),
        ] {
            let r = report(service, v, 0.0);
            j.push_str(&format!(
                "{}\n",
                serde_json::json!({"time": "t", "service": service, "vec_steps": v, "values": {}})
            ));
            for row in csv::rows("t", &r) {
                c.push_str(&format!("{row}\n"));
            }
        }
        j.push_str("{\"service\":\"tracker\",\"vec_steps\":null}\n");
        std::fs::write(&jsonl, j).unwrap();
        std::fs::write(&csv_path, c).unwrap();
        assert_eq!(Timeline::scan(&jsonl).unwrap().learner_max, Some(192));

        assert_eq!(purge(&jsonl, &csv_path, 64).unwrap(), 2);
        let kept = std::fs::read_to_string(&jsonl).unwrap();
        assert_eq!(kept.lines().count(), 3, "{kept}");
        assert!(!kept.contains("\"vec_steps\":128") && !kept.contains("\"vec_steps\":192"));
        let rows = std::fs::read_to_string(&csv_path).unwrap();
        assert_eq!(rows.lines().next(), Some(csv::HEADER));
        assert_eq!(rows.lines().count(), 3, "{rows}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
