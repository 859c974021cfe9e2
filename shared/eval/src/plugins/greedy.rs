//! The `greedy` plugin: episodes with the policy's deterministic actions
//! (arg-max or mean), the default evaluation.

use relay_policy::VersionedPolicy;

use super::{play, Common, EvalContext, EvalOutcome, Evaluator, Options};

/// Deterministic episodes (today's evaluation).
pub struct Greedy(Common);
impl Greedy {
    pub(super) fn build(mut o: Options) -> Result<Box<dyn Evaluator>, String> {
        let c = o.common()?;
        o.finish()?;
        Ok(Box::new(Self(c)))
    }
}
impl Evaluator for Greedy {
    fn name(&self) -> &str {
        "greedy"
    }
    fn evaluate(&self, p: &VersionedPolicy, ctx: &EvalContext) -> Result<EvalOutcome, String> {
        let (episodes, seed) = self.0.apply(ctx);
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
}

#[cfg(test)]
mod tests {
    use crate::fixtures::{ctx, policy};
    use crate::plugins::build;

    #[test]
    fn greedy_is_deterministic() {
        let c = ctx(&std::env::temp_dir());
        let g = build("greedy", &[]).unwrap();
        assert_eq!(
            g.evaluate(&policy(), &c).unwrap(),
            g.evaluate(&policy(), &c).unwrap()
        );
    }
}
