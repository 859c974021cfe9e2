//! REINFORCE (Williams 1992), top to bottom: whole episodes in, one
//! gradient step out.
//!
//! 1. [`Episodes::absorb`]: env-runners cut each env's stream into
//!    fragments; the learner puts every env column's steps back together,
//!    keyed by runner and column. A fragment continues a column when its
//!    first observation is the previous fragment's `next_obs` for that
//!    column; otherwise (a fragment was lost or dropped as stale) the steps
//!    held for the column are discarded, since their episode's end is gone.
//!    An episode that ends (terminated or truncated) moves to the batch.
//! 2. [`Episodes::prune`] after each update: steps acted by versions older
//!    than the learner's floor (`version - replay.max_policy_lag`) leave
//!    the front of held and finished episodes. The returns of the steps
//!    that stay are still exact, as returns only look forward.
//! 3. [`update`] once `batch_episodes` episodes have ended: Monte-Carlo
//!    returns `G_t = r_t + γ G_{t+1}` over each episode
//!    ([`relay_nn::discounted_returns`]); the last step of an episode cut by
//!    a time limit bootstraps from the critic's value of its final
//!    observation (with `baseline: value`; from 0 without a trained critic),
//!    a terminated one from nothing. Then one gradient step of
//!    [`relay_nn::reinforce_loss`] on every step of the batch:
//!    `-mean((G - b) log π) - ent_coef * mean(H) + vf_coef * mean((G - V)^2)`
//!    with `b = V` (detached) or `b = 0`, optional gradient-norm clip, Adam.
//!
//! Hyperparameters are the fields of [`relay_config::ReinforceConfig`],
//! each documented there. Episodes held when the learner stops are not
//! checkpointed: a resumed learner starts assembling afresh.

use std::collections::HashMap;

use candle_core::Tensor;
use relay_config::{Baseline, ReinforceConfig};
use relay_nn::{discounted_returns, reinforce_loss, ActorCritic, ReinforceInputs};
use relay_proto::gauge;
use relay_proto::{MetricValue, RolloutFragment};

use crate::optimizer::Optimizer;
use crate::rollout::{Decoded, UpdateError};
use relay_nn::BatchShare;

/// How an episode ended.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub enum End {
    /// A terminal state: nothing follows.
    Terminated,
    /// Cut by a time limit; holds the final observation to bootstrap from.
    Truncated(Vec<f32>),
}

/// Consecutive steps of one env: an episode in progress, or a finished one
/// (`end` set). Per-step arrays of equal length (`obs` is `len * obs_dim`).
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Episode {
    pub obs: Vec<f32>,
    /// Discrete actions (empty for continuous policies).
    pub actions_discrete: Vec<u32>,
    /// Continuous actions, `len * action_dim` (empty for discrete policies).
    pub actions_continuous: Vec<f32>,
    pub rewards: Vec<f32>,
    /// Policy version that acted each step.
    pub versions: Vec<u64>,
    pub end: Option<End>,
    /// Envs with action masks: `len * n_actions`, 1 = legal; empty for
    /// envs without.
    #[serde(default)]
    pub masks: Vec<u8>,
}

impl Episode {
    /// Steps held.
    pub fn len(&self) -> usize {
        self.rewards.len()
    }

    /// Whether it holds no step.
    pub fn is_empty(&self) -> bool {
        self.rewards.is_empty()
    }

    /// Drops the first `k` steps.
    fn drop_front(&mut self, k: usize, obs_dim: usize, action_dim: usize) {
        self.obs.drain(..k * obs_dim);
        if action_dim == 0 {
            self.actions_discrete.drain(..k);
        } else {
            self.actions_continuous.drain(..k * action_dim);
        }
        self.rewards.drain(..k);
        self.versions.drain(..k);
        if !self.masks.is_empty() {
            let w = self.masks.len() / (self.rewards.len() + k);
            self.masks.drain(..k * w);
        }
    }

    /// Records the mask of the step just pushed (`None`: every action
    /// legal, stored only once the episode holds masks).
    fn push_mask(&mut self, mask: Option<&[u8]>) {
        match mask {
            Some(m) => {
                if self.masks.is_empty() {
                    self.masks.resize((self.len() - 1) * m.len(), 1);
                }
                self.masks.extend_from_slice(m);
            }
            None if !self.masks.is_empty() => {
                let w = self.masks.len() / (self.len() - 1);
                self.masks.resize(self.masks.len() + w, 1);
            }
            None => {}
        }
    }
}

/// The steps of one env column of one runner since its episode began (or
/// since the last gap), with the observation its next fragment must start from.
#[derive(Debug, Default)]
struct Track {
    episode: Episode,
    expect_obs: Vec<f32>,
}

/// Assembles whole episodes from fragments (see the module docs).
#[derive(Debug)]
pub struct Episodes {
    obs_dim: usize,
    action_dim: usize,
    tracks: HashMap<(String, usize), Track>,
    finished: Vec<Episode>,
    /// Steps discarded so far: behind a gap, or acted by too old a version.
    pub discarded_steps: u64,
}

impl Episodes {
    /// An empty assembler for a policy of `obs_dim` inputs and `action_dim`
    /// continuous outputs (0: discrete).
    pub fn new(obs_dim: usize, action_dim: usize) -> Self {
        Self {
            obs_dim,
            action_dim,
            tracks: HashMap::new(),
            finished: Vec::new(),
            discarded_steps: 0,
        }
    }

    /// Finished episodes waiting for an update.
    pub fn finished(&self) -> usize {
        self.finished.len()
    }

    /// Takes the finished episodes.
    pub fn take_finished(&mut self) -> Vec<Episode> {
        std::mem::take(&mut self.finished)
    }

    /// Adds a fragment's steps to its env columns; each episode that ends
    /// in it moves to the finished ones.
    pub fn absorb(&mut self, f: &RolloutFragment) -> Result<(), UpdateError> {
        let (d, a) = (self.obs_dim, self.action_dim);
        let data = Decoded::new(f, d, a)?;
        let n = data.n;
        for i in 0..n {
            let track = self.tracks.entry((f.runner_id.clone(), i)).or_default();
            if !track.episode.is_empty() && track.expect_obs[..] != data.obs[i * d..(i + 1) * d] {
                self.discarded_steps += track.episode.len() as u64;
                track.episode = Episode::default();
            }
        }
        let mut final_obs = data.final_obs.chunks(d.max(1));
        for t in 0..data.t_len {
            for i in 0..n {
                let row = t * n + i;
                let track = self
                    .tracks
                    .get_mut(&(f.runner_id.clone(), i))
                    .expect("track made above");
                let ep = &mut track.episode;
                ep.obs.extend_from_slice(&data.obs[row * d..(row + 1) * d]);
                if a == 0 {
                    ep.actions_discrete.push(data.actions_discrete[row]);
                } else {
                    ep.actions_continuous
                        .extend_from_slice(&data.actions_continuous[row * a..(row + 1) * a]);
                }
                ep.rewards.push(data.rewards[row]);
                ep.versions.push(f.policy_version);
                ep.push_mask(data.masks.as_ref().map(|m| {
                    let w = m.len() / (data.t_len * n);
                    &m[row * w..(row + 1) * w]
                }));
                // Gymnasium sets `truncated` on a terminal step reached at
                // the time limit too: termination wins (no bootstrap).
                let end = if data.terminated[row] {
                    Some(End::Terminated)
                } else if data.truncated[row] {
                    Some(End::Truncated(
                        final_obs
                            .next()
                            .expect("the wire checks one final observation per truncation")
                            .to_vec(),
                    ))
                } else {
                    None
                };
                if let Some(end) = end {
                    let mut done = std::mem::take(ep);
                    done.end = Some(end);
                    self.finished.push(done);
                }
            }
        }
        for i in 0..n {
            let track = self
                .tracks
                .get_mut(&(f.runner_id.clone(), i))
                .expect("track made above");
            track.expect_obs = data.next_obs[i * d..(i + 1) * d].to_vec();
        }
        Ok(())
    }

    /// Drops the steps acted by versions below `min_version` from the front
    /// of every held and finished episode, and forgets columns left empty
    /// (e.g. of an env-runner that stopped).
    pub fn prune(&mut self, min_version: u64) {
        let (d, a) = (self.obs_dim, self.action_dim);
        let mut discarded = 0u64;
        let mut prune = |ep: &mut Episode| {
            let k = ep
                .versions
                .partition_point(|&v| relay_proto::is_stale(v, min_version));
            if k > 0 {
                discarded += k as u64;
                ep.drop_front(k, d, a);
            }
        };
        for track in self.tracks.values_mut() {
            prune(&mut track.episode);
        }
        for ep in &mut self.finished {
            prune(ep);
        }
        self.finished.retain(|ep| !ep.is_empty());
        self.tracks.retain(|_, t| !t.episode.is_empty());
        self.discarded_steps += discarded;
    }
}

/// What one update did.
#[derive(Debug, Clone, Default)]
pub struct UpdateStats {
    pub policy_loss: f64,
    pub value_loss: f64,
    pub entropy: f64,
    pub total_loss: f64,
    /// Global gradient norm before clipping.
    pub grad_norm: f64,
    /// Of the critic's values against the returns, before the step (with a
    /// value baseline only).
    pub explained_variance: Option<f64>,
    pub learning_rate: f64,
    pub ent_coef: f64,
    /// Steps trained on.
    pub steps: usize,
    /// Oldest policy version that acted in them.
    pub oldest_version: u64,
}

impl UpdateStats {
    /// The learner metrics of this update (those PPO reports that apply).
    pub fn metrics(&self) -> Vec<MetricValue> {
        let mut out = vec![
            gauge("learner_policy_loss", self.policy_loss),
            gauge("learner_value_loss", self.value_loss),
            gauge("learner_entropy", self.entropy),
            gauge("learner_total_loss", self.total_loss),
            gauge("learner_grad_norm", self.grad_norm),
            gauge("learner_learning_rate", self.learning_rate),
            gauge("learner_ent_coef", self.ent_coef),
        ];
        if let Some(ev) = self.explained_variance {
            out.push(gauge("learner_explained_variance", ev));
        }
        out
    }
}

/// Discounted returns of every step of `episodes`, concatenated; a
/// truncated episode's last step bootstraps from `bootstrap(final_obs)`.
pub fn episode_returns(
    episodes: &[Episode],
    gamma: f64,
    mut bootstrap: impl FnMut(&[f32]) -> Result<f32, UpdateError>,
) -> Result<Vec<f32>, UpdateError> {
    let mut out = Vec::with_capacity(episodes.iter().map(Episode::len).sum());
    for ep in episodes {
        let len = ep.len();
        let mut next_values = vec![0f32; len];
        let mut terminated = vec![false; len];
        let mut ends = vec![false; len];
        match &ep.end {
            Some(End::Terminated) => terminated[len - 1] = true,
            Some(End::Truncated(final_obs)) => next_values[len - 1] = bootstrap(final_obs)?,
            None => {}
        }
        ends[len - 1] = true;
        out.extend(discounted_returns(
            &ep.rewards,
            &next_values,
            &terminated,
            &ends,
            gamma as f32,
        )?);
    }
    Ok(out)
}

/// One gradient step on finished `episodes` at training progress `progress`
/// (`env_steps / budget`), this replica's part of their steps as `sync`
/// says (`relay_replicas`): with normalised advantages, their mean and
/// spread over all steps are summed across replicas first.
pub fn update(
    model: &ActorCritic,
    optimizer: &mut Optimizer,
    episodes: &[Episode],
    cfg: &ReinforceConfig,
    progress: f64,
    sync: &mut BatchShare<'_>,
) -> Result<UpdateStats, UpdateError> {
    let learning_rate = cfg.learning_rate.value(progress);
    let ent_coef = cfg.ent_coef.value(progress);
    optimizer.set_lr(learning_rate);
    let baseline = cfg.baseline == Baseline::Value;
    let returns = episode_returns(episodes, cfg.gamma, |final_obs| {
        Ok(if baseline {
            model.values(final_obs, 1)?[0]
        } else {
            0.0
        })
    })?;
    let spec = model.spec();
    let (d, len) = (spec.obs_dim, returns.len());
    let share = (sync.rank, sync.replicas);
    let rows = sync.rows(len);
    let weight = rows.len() as f64 / len.max(1) as f64;
    let obs: Vec<f32> = episodes
        .iter()
        .flat_map(|e| e.obs.iter().copied())
        .skip(rows.start * d)
        .take(rows.len() * d)
        .collect();
    let device = model.device();
    let obs = Tensor::from_vec(obs, (rows.len(), d), device)?;
    let actions = match &spec.action {
        relay_nn::ActionKind::Discrete { .. } => {
            let a: Vec<u32> = episodes
                .iter()
                .flat_map(|e| e.actions_discrete.iter().copied())
                .skip(rows.start)
                .take(rows.len())
                .collect();
            Tensor::from_vec(a, rows.len(), device)?
        }
        relay_nn::ActionKind::Continuous { dim, .. } => {
            let a: Vec<f32> = episodes
                .iter()
                .flat_map(|e| e.actions_continuous.iter().copied())
                .skip(rows.start * dim)
                .take(rows.len() * dim)
                .collect();
            Tensor::from_vec(a, (rows.len(), *dim), device)?
        }
    };
    // Episodes with action masks (those without allow every action).
    let masks = match &spec.action {
        relay_nn::ActionKind::Discrete { n } if episodes.iter().any(|e| !e.masks.is_empty()) => {
            let m: Vec<u8> = episodes
                .iter()
                .flat_map(|e| {
                    let ones = e.masks.is_empty().then(|| vec![1u8; e.len() * n]);
                    ones.unwrap_or_else(|| e.masks.clone())
                })
                .skip(rows.start * n)
                .take(rows.len() * n)
                .collect();
            Some(Tensor::from_vec(m, (rows.len(), *n), device)?)
        }
        _ => None,
    };
    let returns = &returns[rows.clone()];
    let evaluated = if rows.is_empty() {
        None
    } else {
        Some(model.evaluate_masked(&obs, &actions, masks.as_ref())?)
    };
    let values: Vec<f32> = match &evaluated {
        Some((_, _, v)) if baseline => v.to_vec1()?,
        _ => vec![0.0; rows.len()],
    };
    // Sums over this part (a replica's; alone, all steps): returns, their
    // squares, residuals G - V and their squares, for the advantages' and
    // explained variance's statistics over all steps.
    let moments =
        |xs: &mut dyn Iterator<Item = f64>| xs.fold([0f64; 2], |[s, q], x| [s + x, q + x * x]);
    let [g_sum, g_sq] = moments(&mut returns.iter().map(|&g| g as f64));
    let [r_sum, r_sq] = moments(&mut returns.iter().zip(&values).map(|(&g, &v)| (g - v) as f64));
    let mut totals = [g_sum, g_sq, r_sum, r_sq];
    if share.1 > 1 {
        let mut part = totals.map(|x| x as f32);
        sync.sum(&mut part)?;
        totals = part.map(f64::from);
    }
    let n = len as f64;
    let [g_sum, g_sq, r_sum, r_sq] = totals;
    let population_var = |sum: f64, sq: f64| (sq / n - (sum / n).powi(2)).max(0.0);
    let explained_variance = baseline.then(|| {
        if share.1 == 1 {
            return relay_nn::explained_variance(&values, returns) as f64;
        }
        let var_g = population_var(g_sum, g_sq);
        if var_g == 0.0 {
            f64::NAN
        } else {
            1.0 - population_var(r_sum, r_sq) / var_g
        }
    });
    // Alone, the loss normalises over its own batch (which is all steps).
    let advantage_stats = (share.1 > 1 && len > 1).then(|| {
        let (sum, sq) = if baseline {
            (r_sum, r_sq)
        } else {
            (g_sum, g_sq)
        };
        let mean = sum / n;
        let unbiased = ((sq - n * mean * mean) / (n - 1.0)).max(0.0);
        (mean, unbiased.sqrt())
    });
    let mut summed = [0f32; 5];
    let loss = match &evaluated {
        None => None,
        Some((logprob, entropy, values)) => {
            let loss = reinforce_loss(
                &relay_nn::ReinforceConfig {
                    baseline,
                    ent_coef,
                    vf_coef: cfg.vf_coef,
                    normalize_advantage: cfg.normalize_advantage,
                },
                &ReinforceInputs {
                    logprob,
                    entropy,
                    values: Some(values),
                    returns,
                    advantage_stats,
                },
            )?;
            let s = loss.stats;
            summed = [s.policy_loss, s.value_loss, s.entropy, s.loss, 1.0]
                .map(|x| (x as f64 * weight) as f32);
            Some(if share.1 == 1 {
                loss.loss
            } else {
                (loss.loss * weight)?
            })
        }
    };
    let grad_norm =
        optimizer.minimise_shared(loss.as_ref(), cfg.max_grad_norm, sync, &mut summed)?;
    BatchShare::check_covered(summed[4])?;
    let [policy_loss, value_loss, entropy, total_loss, _] = summed.map(f64::from);
    Ok(UpdateStats {
        policy_loss,
        value_loss,
        entropy,
        total_loss,
        grad_norm,
        explained_variance,
        learning_rate,
        ent_coef,
        steps: len,
        oldest_version: episodes
            .iter()
            .filter_map(|e| e.versions.first().copied())
            .min()
            .unwrap_or(0),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rollout::{test_fragment, TestSteps};
    use relay_config::ExperimentConfig;
    use relay_nn::PolicySpec;

    /// Observations that say which (step, env, fragment) they belong to.
    fn obs_rows(rows: &[(usize, usize, usize)]) -> Vec<f32> {
        rows.iter()
            .flat_map(|&(t, i, k)| [t as f32, i as f32, k as f32, 0.5])
            .collect()
    }

    fn grid(t: usize, n: usize, k: usize) -> Vec<f32> {
        let rows: Vec<_> = (0..t)
            .flat_map(|t| (0..n).map(move |i| (t, i, k)))
            .collect();
        obs_rows(&rows)
    }

    /// Two fragments of 3 steps x 2 envs from one runner. Env 0 terminates
    /// at t = 1 of the first and runs on; env 1 is truncated at t = 0 of the
    /// second. The second fragment starts where the first left off
    /// (`obs[0] == next_obs`), so env 1's episode spans both.
    fn two_fragments(continuous: bool) -> (RolloutFragment, RolloutFragment) {
        let next_first = grid(1, 2, 1); // == the second fragment's first row
        let first = test_fragment(
            "r",
            4,
            3,
            2,
            TestSteps {
                obs: &grid(3, 2, 0),
                actions: &[0, 1, 1, 0, 0, 1],
                rewards: &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0],
                terminated: &[false, false, true, false, false, false],
                truncated: &[false, false, false, false, false, false],
                next_obs: &next_first,
                final_obs: &[],
            },
        );
        let mut second_obs = grid(3, 2, 1);
        if !continuous {
            second_obs[4] = 99.0; // env 1's first observation
        }
        let second = test_fragment(
            "r",
            5,
            3,
            2,
            TestSteps {
                obs: &second_obs,
                actions: &[1, 0, 0, 1, 1, 0],
                rewards: &[7.0, 8.0, 9.0, 10.0, 11.0, 12.0],
                terminated: &[false, false, false, false, false, false],
                truncated: &[false, true, false, false, false, false],
                next_obs: &grid(1, 2, 2),
                final_obs: &[42.0, 42.0, 42.0, 42.0],
            },
        );
        (first, second)
    }

    #[test]
    fn episodes_are_put_back_together_across_fragments() {
        let (first, second) = two_fragments(true);
        let mut episodes = Episodes::new(4, 0);
        episodes.absorb(&first).unwrap();
        // Env 0's first episode ended at t = 1; env 1 still runs.
        assert_eq!(episodes.finished(), 1);
        episodes.absorb(&second).unwrap();
        let done = episodes.take_finished();
        assert_eq!(done.len(), 2);
        assert_eq!(done[0].rewards, vec![1.0, 3.0]);
        assert_eq!(done[0].actions_discrete, vec![0, 1]);
        assert_eq!(done[0].end, Some(End::Terminated));
        assert_eq!(done[0].obs, obs_rows(&[(0, 0, 0), (1, 0, 0)]));
        // Env 1: three steps of the first fragment, one of the second.
        assert_eq!(done[1].rewards, vec![2.0, 4.0, 6.0, 8.0]);
        assert_eq!(done[1].versions, vec![4, 4, 4, 5]);
        assert_eq!(done[1].end, Some(End::Truncated(vec![42.0; 4])));
        assert_eq!(episodes.discarded_steps, 0);
        // Still running: env 0 (t = 2 of the first, all of the second) and
        // env 1 (t = 1, 2 of the second).
        assert_eq!(episodes.tracks[&("r".to_string(), 0)].episode.len(), 4);
        assert_eq!(episodes.tracks[&("r".to_string(), 1)].episode.len(), 2);
    }

    #[test]
    fn a_gap_in_a_column_discards_its_unfinished_episode() {
        let (first, second) = two_fragments(false);
        let mut episodes = Episodes::new(4, 0);
        episodes.absorb(&first).unwrap();
        episodes.absorb(&second).unwrap();
        let done = episodes.take_finished();
        // Env 1's three steps before the gap are gone; its episode is the
        // one step after it.
        assert_eq!(episodes.discarded_steps, 3);
        assert_eq!(done[1].rewards, vec![8.0]);
        assert_eq!(done[1].end, Some(End::Truncated(vec![42.0; 4])));
        // Env 0 continued without a gap.
        assert_eq!(episodes.tracks[&("r".to_string(), 0)].episode.len(), 4);
    }

    #[test]
    fn pruning_drops_old_steps_from_the_front_and_forgets_empty_columns() {
        let (first, second) = two_fragments(true);
        let mut episodes = Episodes::new(4, 0);
        episodes.absorb(&first).unwrap();
        episodes.absorb(&second).unwrap();
        episodes.prune(5);
        let done = episodes.take_finished();
        // Env 0's finished episode was all version 4: gone. Env 1's keeps
        // its version-5 step.
        assert_eq!(done.len(), 1);
        assert_eq!(done[0].rewards, vec![8.0]);
        assert_eq!(done[0].versions, vec![5]);
        assert_eq!(episodes.tracks[&("r".to_string(), 0)].episode.len(), 3);
        assert_eq!(episodes.discarded_steps, 2 + 3 + 1);
        episodes.prune(6);
        assert!(episodes.tracks.is_empty());
    }

    #[test]
    fn returns_bootstrap_a_time_limit_but_not_a_termination() {
        let ep = |rewards: Vec<f32>, end| Episode {
            versions: vec![0; rewards.len()],
            rewards,
            end: Some(end),
            ..Default::default()
        };
        let episodes = [
            ep(vec![1.0, 2.0, 3.0], End::Terminated),
            ep(vec![1.0, 1.0], End::Truncated(vec![0.0; 4])),
        ];
        let returns = episode_returns(&episodes, 0.5, |_| Ok(10.0)).unwrap();
        let want = [
            1.0 + 0.5 * (2.0 + 0.5 * 3.0),
            2.0 + 0.5 * 3.0,
            3.0,
            1.0 + 0.5 * (1.0 + 0.5 * 10.0),
            1.0 + 0.5 * 10.0,
        ];
        assert_eq!(returns, want);
    }

    /// A one-step bandit: action 0 pays 1, action 1 pays 0. REINFORCE's
    /// updates must make action 0 likely, with a value baseline and without.
    #[test]
    fn updates_make_the_paying_action_likely() {
        for baseline in ["value", "none"] {
            let cfg = ExperimentConfig::from_layers(
                "run:\n  env_id: CartPole-v1\n  algo: reinforce\n",
                "t",
                &[],
                &[
                    format!("reinforce.baseline={baseline}"),
                    "reinforce.learning_rate=0.003".into(),
                ],
            )
            .unwrap();
            let model = ActorCritic::new(&PolicySpec::discrete(4, 2), 9).unwrap();
            let mut optimizer = Optimizer::for_run(&cfg, model.vars()).unwrap();
            let probe = Tensor::from_vec(
                (0..64)
                    .map(|i| (i as f32 * 0.37 + 9.0).sin())
                    .collect::<Vec<f32>>(),
                (16, 4),
                &candle_core::Device::Cpu,
            )
            .unwrap();
            let p_pay = |model: &ActorCritic| -> f32 {
                let zeros =
                    Tensor::zeros(16, candle_core::DType::U32, &candle_core::Device::Cpu).unwrap();
                let (lp, _, _) = model.evaluate(&probe, &zeros).unwrap();
                lp.exp()
                    .unwrap()
                    .mean_all()
                    .unwrap()
                    .to_scalar::<f32>()
                    .unwrap()
            };
            let before = p_pay(&model);
            let mut stats = UpdateStats::default();
            for k in 0..100 {
                let episodes: Vec<Episode> = (0..16)
                    .map(|j| {
                        let action = ((j + k) % 2) as u32;
                        Episode {
                            obs: (0..4)
                                .map(|f| ((j * 4 + f + k) as f32 * 0.61).sin())
                                .collect(),
                            actions_discrete: vec![action],
                            rewards: vec![(action == 0) as u8 as f32],
                            versions: vec![0],
                            end: Some(End::Terminated),
                            ..Default::default()
                        }
                    })
                    .collect();
                stats = update(
                    &model,
                    &mut optimizer,
                    &episodes,
                    &cfg.reinforce,
                    0.0,
                    &mut relay_nn::BatchShare::whole(),
                )
                .unwrap();
            }
            let after = p_pay(&model);
            assert!(
                after > 0.9,
                "{baseline}: P(paying action) {before} -> {after}"
            );
            assert_eq!(stats.steps, 16);
            assert_eq!(stats.explained_variance.is_some(), baseline == "value");
        }
    }
}
