//! The `record` plugin: greedy episodes, each written as a trajectory to
//! `runs/<id>/recordings/v<version>.jsonl` (one JSON line per episode).

use std::io::Write;

use relay_policy::VersionedPolicy;

use super::{play, Common, EvalContext, EvalOutcome, Evaluator, Options};

/// Deterministic episodes, each written as a trajectory.
pub struct Record(Common);
impl Record {
    pub(super) fn build(mut o: Options) -> Result<Box<dyn Evaluator>, String> {
        let c = o.common()?;
        o.finish()?;
        Ok(Box::new(Self(c)))
    }
}
impl Evaluator for Record {
    fn name(&self) -> &str {
        "record"
    }
    fn evaluate(&self, p: &VersionedPolicy, ctx: &EvalContext) -> Result<EvalOutcome, String> {
        let (episodes, seed) = self.0.apply(ctx);
        let eps = play(
            &p.model,
            p.normalizer.as_ref(),
            ctx.envs(episodes, seed)?,
            seed,
            true,
            true,
        )?;
        let dir = ctx.run_dir.join("recordings");
        std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        let name = format!(
            "v{}{}.jsonl",
            p.version,
            if ctx.confirming { ".confirmation" } else { "" }
        );
        let path = dir.join(&name);
        let tmp = dir.join(format!(".{name}.tmp"));
        let mut out = std::io::BufWriter::new(
            std::fs::File::create(&tmp).map_err(|e| format!("{}: {e}", tmp.display()))?,
        );
        for (i, e) in eps.iter().enumerate() {
            let t = e.trajectory.as_ref().expect("recorded");
            let line = serde_json::json!({
                "policy_version": p.version,
                "episode": i,
                "return": e.ret,
                "obs": t.obs,
                "actions": t.actions,
                "rewards": t.rewards,
                "terminated": t.terminated,
                "truncated": t.truncated,
            });
            writeln!(out, "{line}").map_err(|e| format!("{}: {e}", tmp.display()))?;
        }
        out.flush().map_err(|e| format!("{}: {e}", tmp.display()))?;
        drop(out);
        std::fs::rename(&tmp, &path).map_err(|e| format!("{}: {e}", path.display()))?;
        Ok(EvalOutcome::Returns(eps.iter().map(|e| e.ret).collect()))
    }
}

#[cfg(test)]
mod tests {
    use crate::fixtures::{ctx, policy};
    use crate::plugins::{build, EvalOutcome};

    #[test]
    fn record_writes_trajectories() {
        let dir = std::env::temp_dir().join(format!("relay-eval-record-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let c = ctx(&dir);
        let r = build("record", &[]).unwrap();
        let EvalOutcome::Returns(returns) = r.evaluate(&policy(), &c).unwrap() else {
            panic!("record skipped")
        };
        let text = std::fs::read_to_string(dir.join("recordings/v3.jsonl")).unwrap();
        let lines: Vec<serde_json::Value> = text
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(lines.len(), 2);
        for (line, ret) in lines.iter().zip(&returns) {
            let rewards = line["rewards"].as_array().unwrap();
            assert_eq!(line["obs"].as_array().unwrap().len(), rewards.len());
            assert_eq!(line["actions"].as_array().unwrap().len(), rewards.len());
            let sum: f64 = rewards.iter().map(|r| r.as_f64().unwrap()).sum();
            assert!((sum - ret).abs() < 1e-9);
            let ends = line["terminated"].as_array().unwrap();
            assert!(ends.last().unwrap().as_bool().unwrap());
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}
