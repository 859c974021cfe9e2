//! The `threshold` plugin: greedy episodes only once the training return
//! reaches the `level` option, so that early versions cost nothing.

use relay_policy::VersionedPolicy;

use super::{play, Common, EvalContext, EvalOutcome, Evaluator, Options};

/// Deterministic episodes once the training return reaches `level`.
pub struct Threshold {
    common: Common,
    level: f64,
}
impl Threshold {
    pub(super) fn build(mut o: Options) -> Result<Box<dyn Evaluator>, String> {
        let common = o.common()?;
        let level: f64 = o
            .parse("level")?
            .ok_or_else(|| "evaluator threshold: option level is required".to_string())?;
        if !level.is_finite() {
            return Err("evaluator threshold: option level must be finite".into());
        }
        o.finish()?;
        Ok(Box::new(Self { common, level }))
    }
}
impl Evaluator for Threshold {
    fn name(&self) -> &str {
        "threshold"
    }
    fn evaluate(&self, p: &VersionedPolicy, ctx: &EvalContext) -> Result<EvalOutcome, String> {
        match ctx.train_return {
            Some(r) if r >= self.level => {
                let (episodes, seed) = self.common.apply(ctx);
                let eps = play(
                    &p.model,
                    p.normalizer.as_ref(),
                    ctx.envs(episodes, seed)?,
                    seed,
                    true,
                    false,
                )?;
                Ok(EvalOutcome::Returns(eps.iter().map(|e| e.ret).collect()))
            }
            other => Ok(EvalOutcome::Skipped(format!(
                "training return {} below level {}",
                other.map_or("(none yet)".into(), |r| format!("{r:.1}")),
                self.level
            ))),
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::fixtures::{ctx, policy};
    use crate::plugins::{build, EvalOutcome};

    #[test]
    fn threshold_waits_for_the_training_return() {
        let mut c = ctx(&std::env::temp_dir());
        let t = build("threshold", &[("level".into(), "50".into())]).unwrap();
        assert!(matches!(
            t.evaluate(&policy(), &c).unwrap(),
            EvalOutcome::Skipped(_)
        ));
        c.train_return = Some(60.0);
        assert!(matches!(
            t.evaluate(&policy(), &c).unwrap(),
            EvalOutcome::Returns(r) if r.len() == 2
        ));
    }
}
