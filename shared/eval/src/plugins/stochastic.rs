//! The `stochastic` plugin: episodes with actions sampled from the
//! policy's distribution (how `relay eval checkpoint` judges a checkpoint
//! the way a run that sampled judged its versions).

use relay_policy::VersionedPolicy;

use super::{play, Common, EvalContext, EvalOutcome, Evaluator, Options};

/// Episodes with sampled actions.
pub struct Stochastic(Common);
impl Stochastic {
    pub(super) fn build(mut o: Options) -> Result<Box<dyn Evaluator>, String> {
        let c = o.common()?;
        o.finish()?;
        Ok(Box::new(Self(c)))
    }
}
impl Evaluator for Stochastic {
    fn name(&self) -> &str {
        "stochastic"
    }
    fn samples_actions(&self) -> bool {
        true
    }
    fn evaluate(&self, p: &VersionedPolicy, ctx: &EvalContext) -> Result<EvalOutcome, String> {
        let (episodes, seed) = self.0.apply(ctx);
        let eps = play(
            &p.model,
            p.normalizer.as_ref(),
            ctx.envs(episodes, seed)?,
            seed,
            false,
            false,
        )?;
        Ok(EvalOutcome::Returns(eps.iter().map(|e| e.ret).collect()))
    }
}
