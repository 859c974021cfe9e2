//! Evaluator plugins: one [`Evaluator`] trait, a [`registry`] of named
//! factories, and the plugins `greedy`, `stochastic`, `threshold` and
//! `record`. A plugin is chosen by `eval.evaluator` and `eval.options`, and
//! switched at run time by an `EvalControl` message (`relay eval use`).
//!
//! Options every plugin takes: `episodes` (default `eval.episodes`) and
//! `seed` (default `eval.seed`). Plugin options:
//!
//! | plugin | actions | options | writes |
//! |---|---|---|---|
//! | `greedy` | deterministic (arg-max / mean) | — | — |
//! | `stochastic` | sampled from the policy | — | — |
//! | `threshold` | deterministic, only once the training return (mean of the last 100 training episodes) reaches `level` | `level` (required) | — |
//! | `record` | deterministic | — | `runs/<id>/recordings/v<version>.jsonl`: one JSON line per episode with `obs`, `actions`, `rewards`, `terminated`, `truncated`, `return` |
//!
//! An unknown plugin name or option is an error naming it.

use std::io::Write;
use std::path::PathBuf;

use rand::SeedableRng;
use relay_envs::{ActionSpace, VecActions, VecEnv};
use relay_nn::{Actions, ActorCritic};
use relay_policy::VersionedPolicy;

/// What a plugin knows about the run when it evaluates.
#[derive(Debug, Clone)]
pub struct EvalContext {
    pub env_id: String,
    /// `eval.episodes`, unless the plugin's `episodes` option says otherwise.
    pub episodes: usize,
    /// `eval.seed`, unless the plugin's `seed` option says otherwise.
    pub seed: u64,
    /// `runs/<run-id>`.
    pub run_dir: PathBuf,
    /// Mean return of the latest training episodes (up to 100), if any arrived.
    pub train_return: Option<f64>,
}

/// The result of one evaluation.
#[derive(Debug, Clone, PartialEq)]
pub enum EvalOutcome {
    /// Episodes played: their returns (published as an `EvalReport`).
    Returns(Vec<f64>),
    /// Nothing played (and nothing published), with the reason.
    Skipped(String),
}

/// An evaluator plugin.
pub trait Evaluator: Send + Sync {
    /// The registry name, reported as `EvalReport::evaluator`.
    fn name(&self) -> &str;
    /// Evaluates one policy version (runs on a blocking thread).
    fn evaluate(&self, policy: &VersionedPolicy, ctx: &EvalContext) -> Result<EvalOutcome, String>;
}

/// Builds a plugin from its options.
pub type Factory = fn(Options) -> Result<Box<dyn Evaluator>, String>;

/// Every plugin by name.
pub fn registry() -> Vec<(&'static str, Factory)> {
    vec![
        ("greedy", Greedy::build as Factory),
        ("stochastic", Stochastic::build),
        ("threshold", Threshold::build),
        ("record", Record::build),
    ]
}

/// Builds plugin `name` with `options`; errors name the plugin or option.
pub fn build(name: &str, options: &[(String, String)]) -> Result<Box<dyn Evaluator>, String> {
    let registry = registry();
    let Some((_, factory)) = registry.iter().find(|(n, _)| *n == name) else {
        let known: Vec<&str> = registry.iter().map(|(n, _)| *n).collect();
        return Err(format!("unknown evaluator {name:?}; known: {known:?}"));
    };
    factory(Options::new(name, options))
}

/// Plugin options: each plugin takes what it knows, then [`Options::finish`]
/// refuses the rest.
pub struct Options {
    plugin: String,
    pairs: Vec<(String, String)>,
}

impl Options {
    pub fn new(plugin: &str, pairs: &[(String, String)]) -> Self {
        Self {
            plugin: plugin.to_string(),
            pairs: pairs.to_vec(),
        }
    }

    fn take(&mut self, key: &str) -> Option<String> {
        let i = self.pairs.iter().position(|(k, _)| k == key)?;
        Some(self.pairs.remove(i).1)
    }

    fn parse<T: std::str::FromStr>(&mut self, key: &str) -> Result<Option<T>, String>
    where
        T::Err: std::fmt::Display,
    {
        self.take(key)
            .map(|v| {
                v.trim()
                    .parse::<T>()
                    .map_err(|e| format!("evaluator {}: option {key}={v:?}: {e}", self.plugin))
            })
            .transpose()
    }

    /// The options every plugin takes.
    fn common(&mut self) -> Result<Common, String> {
        let episodes: Option<usize> = self.parse("episodes")?;
        if episodes == Some(0) {
            return Err(format!(
                "evaluator {}: option episodes must be positive",
                self.plugin
            ));
        }
        Ok(Common {
            episodes,
            seed: self.parse("seed")?,
        })
    }

    fn finish(self) -> Result<(), String> {
        match self.pairs.first() {
            None => Ok(()),
            Some((k, _)) => Err(format!(
                "evaluator {}: unknown option {k:?} (known: episodes, seed{})",
                self.plugin,
                if self.plugin == "threshold" {
                    ", level"
                } else {
                    ""
                }
            )),
        }
    }
}

#[derive(Debug, Clone, Copy, Default)]
struct Common {
    episodes: Option<usize>,
    seed: Option<u64>,
}

impl Common {
    fn apply(&self, ctx: &EvalContext) -> (usize, u64) {
        (
            self.episodes.unwrap_or(ctx.episodes),
            self.seed.unwrap_or(ctx.seed),
        )
    }
}

/// Deterministic episodes (today's evaluation).
pub struct Greedy(Common);
impl Greedy {
    fn build(mut o: Options) -> Result<Box<dyn Evaluator>, String> {
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
        let eps = play(&p.model, &ctx.env_id, episodes, seed, true, false)?;
        Ok(EvalOutcome::Returns(eps.iter().map(|e| e.ret).collect()))
    }
}

/// Episodes with sampled actions.
pub struct Stochastic(Common);
impl Stochastic {
    fn build(mut o: Options) -> Result<Box<dyn Evaluator>, String> {
        let c = o.common()?;
        o.finish()?;
        Ok(Box::new(Self(c)))
    }
}
impl Evaluator for Stochastic {
    fn name(&self) -> &str {
        "stochastic"
    }
    fn evaluate(&self, p: &VersionedPolicy, ctx: &EvalContext) -> Result<EvalOutcome, String> {
        let (episodes, seed) = self.0.apply(ctx);
        let eps = play(&p.model, &ctx.env_id, episodes, seed, false, false)?;
        Ok(EvalOutcome::Returns(eps.iter().map(|e| e.ret).collect()))
    }
}

/// Deterministic episodes once the training return reaches `level`.
pub struct Threshold {
    common: Common,
    level: f64,
}
impl Threshold {
    fn build(mut o: Options) -> Result<Box<dyn Evaluator>, String> {
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
                let eps = play(&p.model, &ctx.env_id, episodes, seed, true, false)?;
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

/// Deterministic episodes, each written as a trajectory.
pub struct Record(Common);
impl Record {
    fn build(mut o: Options) -> Result<Box<dyn Evaluator>, String> {
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
        let eps = play(&p.model, &ctx.env_id, episodes, seed, true, true)?;
        let dir = ctx.run_dir.join("recordings");
        std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        let path = dir.join(format!("v{}.jsonl", p.version));
        let tmp = dir.join(format!(".v{}.jsonl.tmp", p.version));
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

/// One episode's steps: observation before each step, action (a list of
/// numbers: one for discrete spaces), reward, terminated, truncated.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Trajectory {
    pub obs: Vec<Vec<f32>>,
    pub actions: Vec<Vec<f64>>,
    pub rewards: Vec<f64>,
    pub terminated: Vec<bool>,
    pub truncated: Vec<bool>,
}

/// A played episode.
#[derive(Debug, Clone, PartialEq)]
pub struct Episode {
    pub ret: f64,
    pub trajectory: Option<Trajectory>,
}

/// Plays one episode per sub-env of a vectorized env (each to its end) with
/// deterministic or sampled actions, recording trajectories if asked.
pub fn play(
    model: &ActorCritic,
    env_id: &str,
    episodes: usize,
    seed: u64,
    deterministic: bool,
    record: bool,
) -> Result<Vec<Episode>, String> {
    let mut envs = VecEnv::new(env_id, episodes, seed).map_err(|e| e.to_string())?;
    let spec = envs.spec().clone();
    let obs_dim = envs.obs_dim();
    let mut obs = envs.reset().map_err(|e| e.to_string())?.to_vec();
    let mut returns: Vec<Option<f64>> = vec![None; episodes];
    let mut trajectories: Vec<Trajectory> = vec![Trajectory::default(); episodes];
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let mut clipped = Vec::new();
    while returns.iter().any(Option::is_none) {
        let out = model
            .act(&obs, obs.len() / obs_dim, deterministic, &mut rng)
            .map_err(|e| e.to_string())?;
        let action_rows: Vec<Vec<f64>> = match &out.actions {
            Actions::Discrete(a) => a.iter().map(|&a| vec![a as f64]).collect(),
            Actions::Continuous(a) => a
                .chunks(a.len() / episodes)
                .map(|c| c.iter().map(|&v| v as f64).collect())
                .collect(),
        };
        let step = match (&out.actions, &spec.action_space) {
            (Actions::Discrete(a), _) => envs.step(VecActions::Discrete(a)),
            (Actions::Continuous(a), ActionSpace::Box { low, high }) => {
                clipped.clear();
                clipped.extend(
                    a.iter()
                        .enumerate()
                        .map(|(i, v)| v.clamp(low[i % low.len()], high[i % low.len()])),
                );
                envs.step(VecActions::Continuous(&clipped))
            }
            (Actions::Continuous(_), ActionSpace::Discrete { .. }) => {
                return Err("continuous actions for a discrete env".into())
            }
        }
        .map_err(|e| e.to_string())?;
        if record {
            for (i, t) in trajectories.iter_mut().enumerate() {
                if returns[i].is_some() {
                    continue;
                }
                t.obs.push(obs[i * obs_dim..(i + 1) * obs_dim].to_vec());
                t.actions.push(action_rows[i].clone());
                t.rewards.push(step.rewards[i]);
                t.terminated.push(step.terminated[i]);
                t.truncated.push(step.truncated[i]);
            }
        }
        for e in &step.finished {
            returns[e.env_index].get_or_insert(e.episode_return);
        }
        obs.copy_from_slice(&step.obs);
    }
    Ok(returns
        .into_iter()
        .zip(trajectories)
        .map(|(r, t)| Episode {
            ret: r.expect("every episode finished"),
            trajectory: record.then_some(t),
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use relay_nn::PolicySpec;

    fn policy() -> VersionedPolicy {
        VersionedPolicy {
            version: 3,
            learner_env_steps: 0,
            model: ActorCritic::new(&PolicySpec::discrete(4, 2), 1).unwrap(),
        }
    }

    fn ctx(dir: &std::path::Path) -> EvalContext {
        EvalContext {
            env_id: "CartPole-v1".into(),
            episodes: 2,
            seed: 5,
            run_dir: dir.to_path_buf(),
            train_return: None,
        }
    }

    #[test]
    fn registry_builds_each_plugin_and_refuses_unknown_names_and_options() {
        for (name, _) in registry() {
            let opts: Vec<(String, String)> = if name == "threshold" {
                vec![("level".into(), "10".into())]
            } else {
                vec![]
            };
            assert_eq!(build(name, &opts).unwrap().name(), name);
        }
        let err = build("nope", &[]).err().unwrap();
        assert!(err.contains("nope") && err.contains("greedy"), "{err}");
        let err = build("greedy", &[("colour".into(), "red".into())])
            .err()
            .unwrap();
        assert!(err.contains("colour"), "{err}");
        let err = build("threshold", &[]).err().unwrap();
        assert!(err.contains("level"), "{err}");
        let err = build("greedy", &[("episodes".into(), "x".into())])
            .err()
            .unwrap();
        assert!(err.contains("episodes"), "{err}");
    }

    #[test]
    fn threshold_waits_for_the_training_return_and_record_writes_trajectories() {
        let dir = std::env::temp_dir().join(format!("relay-eval-plugins-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let mut c = ctx(&dir);
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
        // Greedy is deterministic; stochastic samples.
        let g = build("greedy", &[]).unwrap();
        assert_eq!(
            g.evaluate(&policy(), &c).unwrap(),
            g.evaluate(&policy(), &c).unwrap()
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}
