//! The block `relay up` prints once when a run ends: how it ended, its
//! env steps, wall time and best evaluation, where its results are, and
//! the commands that look further (`relay games` when the run wrote text games). After it, no more progress lines.

use std::path::{Path, PathBuf};

use relay_proto::EvalReport;

/// The best evaluation of a run so far: by its confirmation's mean when
/// it was confirmed, else by its screening mean (the learner's rule for
/// the `best` checkpoint).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BestEval {
    pub version: u64,
    pub screening: f64,
    pub confirmed: Option<f64>,
}

impl BestEval {
    fn figure(&self) -> f64 {
        self.confirmed.unwrap_or(self.screening)
    }

    /// `best` after `report`.
    pub fn update(best: Option<Self>, report: &EvalReport) -> Option<Self> {
        Self::update_with(
            best,
            Self {
                version: report.policy_version,
                screening: report.mean_return,
                confirmed: report.confirmation.as_ref().map(|c| c.mean_return),
            },
        )
    }

    fn update_with(best: Option<Self>, new: Self) -> Option<Self> {
        if !new.figure().is_finite() {
            return best;
        }
        match best {
            Some(b) if b.figure() >= new.figure() => Some(b),
            _ => Some(new),
        }
    }
}

/// What the summary tells.
#[derive(Debug, Clone)]
pub struct RunEnd<'a> {
    pub run_id: &'a str,
    /// How the run ended, one line (`solved: ...`, `budget spent: ...`).
    pub how: String,
    /// Env steps trained on in all (past the solving evaluation when the
    /// run went on training), and the seconds that took.
    pub env_steps: u64,
    pub wall_s: f64,
    pub best: Option<BestEval>,
    pub run_dir: PathBuf,
    pub prometheus_url: Option<&'a str>,
    pub grafana_url: Option<&'a str>,
}

/// The plots of `run_dir` that exist.
fn plots(run_dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(run_dir.join("plots"))
        .into_iter()
        .flatten()
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".png"))
        .collect();
    names.sort();
    names
}

/// An evaluation figure as the console prints it: one decimal for
/// returns, three for figures under 10 in size (rates such as a share of
/// games won, where 0.95 and 0.9 differ).
pub fn figure(x: f64) -> String {
    if x.abs() < 10.0 {
        format!("{x:.3}")
    } else {
        format!("{x:.1}")
    }
}

impl RunEnd<'_> {
    /// The block, without a trailing newline.
    pub fn render(&self) -> String {
        let dir = self.run_dir.display();
        let best = self
            .best
            .map_or("none (no evaluation finished)".to_string(), |b| {
                format!(
                    "{} at version {}{}",
                    figure(b.screening),
                    b.version,
                    b.confirmed.map_or(String::new(), |c| format!(
                        " (confirmed {} on fresh episodes)",
                        figure(c)
                    ))
                )
            });
        let plots = plots(&self.run_dir);
        let plots = if plots.is_empty() {
            "none yet (the tracker draws them when the run ends)".to_string()
        } else {
            plots
                .iter()
                .map(|p| format!("{dir}/plots/{p}"))
                .collect::<Vec<_>>()
                .join(", ")
        };
        let mut look = vec![
            "relay top @last".to_string(),
            "relay play @last".to_string(),
            "relay eval checkpoint @last".to_string(),
        ];
        // Text runs: the games the tracker wrote, as text.
        if self.run_dir.join(relay_runs::games::FILE).exists() {
            look.insert(2, "relay games @last".to_string());
        }
        if let Some(url) = self.prometheus_url {
            look.push(format!(
                "Prometheus {url}/graph?g0.expr=relay_eval_return_mean%7Brun_id%3D%22{}%22%7D",
                self.run_id
            ));
        }
        if let Some(url) = self.grafana_url {
            look.push(format!("Grafana {url}"));
        }
        [
            format!("relay: run {} ended: {}", self.run_id, self.how),
            format!(
                "  env steps    {} in {:.1} s",
                self.env_steps, self.wall_s
            ),
            format!("  best eval    {best}"),
            format!("  run dir      {dir} (status.json, eval.jsonl, episodes.jsonl, metrics.jsonl, checkpoints/)"),
            format!("  plots        {plots}"),
            format!("  look further {}", look.join("  |  ")),
        ]
        .join("\n")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn eval(version: u64, screening: f64, confirmed: Option<f64>) -> BestEval {
        BestEval {
            version,
            screening,
            confirmed,
        }
    }

    #[test]
    fn the_best_eval_is_judged_by_its_confirmation() {
        let mut best = BestEval::update_with(None, eval(1, 480.0, None));
        // Screened at 495 but confirmed at 470: 480 stays best.
        best = BestEval::update_with(best, eval(2, 495.0, Some(470.0)));
        assert_eq!(best.unwrap().version, 1);
        best = BestEval::update_with(best, eval(3, 490.0, Some(485.0)));
        assert_eq!(best.unwrap().version, 3);
        best = BestEval::update_with(best, eval(4, f64::NAN, None));
        assert_eq!(best.unwrap().version, 3);
    }

    #[test]
    fn the_block_names_the_outcome_the_run_dir_and_what_to_run() {
        let dir = std::env::temp_dir().join(format!("relay-summary-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("plots")).unwrap();
        std::fs::write(dir.join("plots/return.png"), b"").unwrap();
        std::fs::write(dir.join("games.jsonl"), b"").unwrap();
        let text = RunEnd {
            run_id: "r1",
            how: "solved: eval 500.0".into(),
            env_steps: 3840,
            wall_s: 0.3,
            best: Some(BestEval {
                version: 15,
                screening: 500.0,
                confirmed: Some(498.0),
            }),
            run_dir: dir.clone(),
            prometheus_url: Some("http://127.0.0.1:9090"),
            grafana_url: None,
        }
        .render();
        for part in [
            "run r1 ended: solved: eval 500.0",
            "3840 in 0.3 s",
            "500.0 at version 15 (confirmed 498.0",
            "plots/return.png",
            "relay top @last",
            "relay play @last",
            "relay games @last",
            "http://127.0.0.1:9090/graph",
        ] {
            assert!(text.contains(part), "{part:?} missing from\n{text}");
        }
        std::fs::remove_dir_all(dir).unwrap();
    }
}
