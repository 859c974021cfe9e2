//! A2C (Stable-Baselines3's `A2C`), top to bottom: one fragment of
//! `n_steps` vector steps in, one gradient step out.
//!
//! 1. [`crate::rollout::prepare`] with `gae_lambda` (1.0: n-step returns):
//!    values from the current critic; a fragment's tail bootstraps from the
//!    critic's value of `next_obs`, a time-limit truncation from the value of
//!    the episode's final observation, a termination from nothing.
//! 2. [`update`]: one gradient step on the whole rollout:
//!    `-mean(A log π) - ent_coef * mean(H) + vf_coef * mean((R - V)^2)`
//!    ([`relay_nn::a2c_loss`]; advantages optionally normalised), global
//!    gradient-norm clip, RMSprop (or Adam). Learning rate and entropy
//!    coefficient follow their schedules over training progress.
//!
//! With learner replicas (`relay_replicas`) each takes its part of the
//! rollout's rows (advantages normalised over all of them first), weights
//! its loss by its share, and the gradients and statistics are summed
//! across replicas before the step.
//!
//! Hyperparameters are the fields of [`relay_config::A2cConfig`], each
//! documented there.

use relay_config::A2cConfig;
use relay_nn::{a2c_loss, A2cInputs, A2cLossConfig, ActorCritic};
use relay_proto::gauge;
use relay_proto::MetricValue;

use crate::optimizer::Optimizer;
use crate::rollout::{Rollout, UpdateError};
use relay_nn::BatchShare;

/// What one update did.
#[derive(Debug, Clone, Default)]
pub struct UpdateStats {
    pub policy_loss: f64,
    pub value_loss: f64,
    pub entropy: f64,
    pub total_loss: f64,
    /// Global gradient norm before clipping.
    pub grad_norm: f64,
    /// Of the critic's values against the returns, before the step.
    pub explained_variance: f64,
    pub learning_rate: f64,
    pub ent_coef: f64,
}

impl UpdateStats {
    /// The learner metrics of this update (those PPO reports that apply).
    pub fn metrics(&self) -> Vec<MetricValue> {
        vec![
            gauge("learner_policy_loss", self.policy_loss),
            gauge("learner_value_loss", self.value_loss),
            gauge("learner_entropy", self.entropy),
            gauge("learner_total_loss", self.total_loss),
            gauge("learner_explained_variance", self.explained_variance),
            gauge("learner_grad_norm", self.grad_norm),
            gauge("learner_learning_rate", self.learning_rate),
            gauge("learner_ent_coef", self.ent_coef),
        ]
    }
}

/// One gradient step on a prepared rollout at training progress `progress`
/// (`env_steps / budget`), this replica's part of its rows as `sync` says.
pub fn update(
    model: &ActorCritic,
    optimizer: &mut Optimizer,
    rollout: &Rollout,
    cfg: &A2cConfig,
    progress: f64,
    sync: &mut BatchShare<'_>,
) -> Result<UpdateStats, UpdateError> {
    let learning_rate = cfg.learning_rate.value(progress);
    let ent_coef = cfg.ent_coef.value(progress);
    optimizer.set_lr(learning_rate);
    // Every row, or for a recurrent policy every sequence.
    let all: Vec<usize> = (0..rollout.units()).collect();
    let advantages = if cfg.normalize_advantage {
        relay_nn::normalize(&rollout.advantages)
    } else {
        rollout.advantages.clone()
    };
    let share = (sync.rank, sync.replicas);
    let units = sync.part(&all);
    let rows = rollout.rows_of(units);
    let weight = rows.len() as f64 / rollout.len.max(1) as f64;
    // Weighted by this part's share: summed, the whole rollout's means.
    let mut summed = [0f32; 4];
    let loss = if rows.is_empty() {
        None
    } else {
        let (logprob, entropy, values) = rollout.evaluate(model, units, &rows)?;
        let returns: Vec<f32> = rows.iter().map(|&j| rollout.returns[j]).collect();
        let advantages: Vec<f32> = rows.iter().map(|&j| advantages[j]).collect();
        let loss = a2c_loss(
            &A2cLossConfig {
                ent_coef,
                vf_coef: cfg.vf_coef,
                normalize_advantage: false,
            },
            &A2cInputs {
                logprob: &logprob,
                entropy: &entropy,
                values: &values,
                advantages: &advantages,
                returns: &returns,
            },
        )?;
        let s = loss.stats;
        summed =
            [s.policy_loss, s.value_loss, s.entropy, s.loss].map(|x| (x as f64 * weight) as f32);
        Some(if share.1 == 1 {
            loss.loss
        } else {
            (loss.loss * weight)?
        })
    };
    let grad_norm =
        optimizer.minimise_shared(loss.as_ref(), Some(cfg.max_grad_norm), sync, &mut summed)?;
    let [policy_loss, value_loss, entropy, total_loss] = summed.map(f64::from);
    Ok(UpdateStats {
        policy_loss,
        value_loss,
        entropy,
        total_loss,
        grad_norm,
        explained_variance: relay_nn::explained_variance(&rollout.old_values, &rollout.returns)
            as f64,
        learning_rate,
        ent_coef,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rollout::{prepare, test_fragment, TestSteps};
    use relay_config::ExperimentConfig;
    use relay_nn::{PolicySpec, Schedule};

    fn obs(len: usize, phase: f32) -> Vec<f32> {
        (0..len).map(|i| (i as f32 * 0.37 + phase).sin()).collect()
    }

    /// With SB3's `gae_lambda = 1` the targets are n-step returns: the
    /// fragment's tail bootstraps from V(next_obs), a truncation from
    /// V(final_obs), a termination from nothing. T = 3, N = 2: env 0 is
    /// truncated at t = 0, env 1 terminates at t = 1.
    #[test]
    fn targets_are_n_step_returns_through_truncation_not_termination() {
        let model = ActorCritic::new(&PolicySpec::discrete(4, 2), 3).unwrap();
        let (o, next, fin) = (obs(24, 0.0), obs(8, 1.0), obs(4, 2.0));
        let r = [1.0f32, 0.5, 2.0, -1.0, 3.0, 0.25];
        let fragment = test_fragment(
            "r",
            0,
            3,
            2,
            TestSteps {
                obs: &o,
                actions: &[0, 1, 1, 0, 0, 1],
                rewards: &r,
                terminated: &[false, false, false, true, false, false],
                truncated: &[true, false, false, false, false, false],
                next_obs: &next,
                final_obs: &fin,
            },
        );
        let g = 0.9f32;
        let rollout = prepare(&model, &[fragment], g as f64, 1.0).unwrap();
        let tail = model.values(&next, 2).unwrap();
        let v_final = model.values(&fin, 1).unwrap()[0];
        let env0_2 = r[4] + g * tail[0];
        let env0_1 = r[2] + g * env0_2;
        let env0_0 = r[0] + g * v_final;
        let env1_2 = r[5] + g * tail[1];
        let env1_1 = r[3];
        let env1_0 = r[1] + g * env1_1;
        let want = [env0_0, env1_0, env0_1, env1_1, env0_2, env1_2];
        for (got, want) in rollout.returns.iter().zip(want) {
            assert!(
                (got - want).abs() < 1e-5,
                "{:?} vs {want:?}",
                rollout.returns
            );
        }
    }

    /// A contextual bandit: action 0 pays 1, action 1 pays 0, every step
    /// ends its episode. A2C's updates (RMSprop, SB3 defaults) must make
    /// action 0 likely and fit the critic to the mean payoff.
    #[test]
    fn updates_make_the_paying_action_likely_and_fit_the_critic() {
        let cfg = ExperimentConfig::from_layers(
            "run:\n  env_id: CartPole-v1\n  algo: a2c\nenv_runner:\n  fragment_steps: 5\n",
            "t",
            &[],
            &[],
        )
        .unwrap();
        let model = ActorCritic::new(&PolicySpec::discrete(4, 2), 5).unwrap();
        let mut optimizer = Optimizer::for_run(&cfg, model.vars()).unwrap();
        assert!(matches!(optimizer, Optimizer::RmsProp(_)));
        let probe = candle_core::Tensor::from_vec(obs(64, 9.0), (16, 4), &candle_core::Device::Cpu)
            .unwrap();
        let p_pay = |model: &ActorCritic| -> f32 {
            let zeros =
                candle_core::Tensor::zeros(16, candle_core::DType::U32, &candle_core::Device::Cpu)
                    .unwrap();
            let (lp, _, _) = model.evaluate(&probe, &zeros).unwrap();
            lp.exp()
                .unwrap()
                .mean_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap()
        };
        let before = p_pay(&model);
        assert!((before - 0.5).abs() < 0.1, "{before}");
        let (t, n) = (5, 8);
        let mut last = UpdateStats::default();
        for k in 0..150 {
            let actions: Vec<i64> = (0..t * n).map(|j| ((j + k) % 2) as i64).collect();
            let rewards: Vec<f32> = actions.iter().map(|&a| (a == 0) as u8 as f32).collect();
            let fragment = test_fragment(
                "r",
                0,
                t,
                n,
                TestSteps {
                    obs: &obs(t * n * 4, k as f32),
                    actions: &actions,
                    rewards: &rewards,
                    terminated: &vec![true; t * n],
                    truncated: &vec![false; t * n],
                    next_obs: &obs(n * 4, -(k as f32)),
                    final_obs: &[],
                },
            );
            let rollout = prepare(&model, &[fragment], cfg.a2c.gamma, cfg.a2c.gae_lambda).unwrap();
            last = update(
                &model,
                &mut optimizer,
                &rollout,
                &cfg.a2c,
                k as f64 / 150.0,
                &mut relay_nn::BatchShare::whole(),
            )
            .unwrap();
        }
        let after = p_pay(&model);
        assert!(after > 0.9, "P(paying action) {before} -> {after}");
        // Half the rollout pays 1, half 0: the critic's best fit is 0.5
        // everywhere, a squared error of 0.25.
        assert!(last.value_loss < 0.3, "value loss {}", last.value_loss);
        assert_eq!(optimizer.step_count(), 150);
        assert_eq!(last.learning_rate, 7e-4);
    }

    #[test]
    fn the_learning_rate_and_entropy_coefficient_follow_their_schedules() {
        let mut cfg = ExperimentConfig::from_layers(
            "run:\n  env_id: CartPole-v1\n  algo: a2c\nenv_runner:\n  fragment_steps: 5\n",
            "t",
            &[],
            &[],
        )
        .unwrap();
        cfg.a2c.learning_rate = Schedule::linear(1e-3, 0.0);
        cfg.a2c.ent_coef = Schedule::cosine(0.02, 0.0);
        let model = ActorCritic::new(&PolicySpec::discrete(4, 2), 5).unwrap();
        let mut optimizer = Optimizer::for_run(&cfg, model.vars()).unwrap();
        let fragment = test_fragment(
            "r",
            0,
            1,
            2,
            TestSteps {
                obs: &obs(8, 0.0),
                actions: &[0, 1],
                rewards: &[1.0, 0.0],
                terminated: &[false, false],
                truncated: &[false, false],
                next_obs: &obs(8, 1.0),
                final_obs: &[],
            },
        );
        let rollout = prepare(&model, &[fragment], 0.99, 1.0).unwrap();
        let stats = update(
            &model,
            &mut optimizer,
            &rollout,
            &cfg.a2c,
            0.5,
            &mut relay_nn::BatchShare::whole(),
        )
        .unwrap();
        assert!((stats.learning_rate - 5e-4).abs() < 1e-12);
        assert!((stats.ent_coef - 0.01).abs() < 1e-12);
        let names: Vec<String> = stats.metrics().into_iter().map(|m| m.name).collect();
        for name in [
            "learner_policy_loss",
            "learner_explained_variance",
            "learner_ent_coef",
        ] {
            assert!(names.iter().any(|n| n == name), "{names:?}");
        }
    }
}
