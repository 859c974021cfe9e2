//! API-level tests of single environments: registry, specs, errors, reset
//! distributions, time limits.

use rand::rngs::StdRng;
use rand::SeedableRng;
use relay_envs::{make, spec, Action, ActionSpace, Env, EnvError, ENV_IDS};

fn reset(env: &mut dyn Env, seed: u64) -> Vec<f32> {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut obs = vec![0.0; env.obs_dim()];
    env.reset(&mut rng, &mut obs).expect("reset");
    obs
}

#[test]
fn unknown_id_error_names_the_id_and_lists_known_ids() {
    let err = make("CartPole-v0").err().expect("unknown id must fail");
    let msg = err.to_string();
    assert!(msg.contains("\"CartPole-v0\""), "{msg}");
    for id in ENV_IDS {
        assert!(msg.contains(id), "{msg} does not list {id}");
    }
    assert_eq!(
        err,
        EnvError::UnknownEnv {
            id: "CartPole-v0".into(),
            known: ENV_IDS.to_vec(),
        }
    );
    assert!(matches!(
        spec("cartpole-v1"),
        Err(EnvError::UnknownEnv { .. })
    ));
}

#[test]
fn specs_match_gymnasium_registration() {
    let expected: [(&str, usize, ActionSpace, u32, Option<f64>); 6] = [
        (
            "CartPole-v1",
            4,
            ActionSpace::Discrete { n: 2 },
            500,
            Some(475.0),
        ),
        (
            "Acrobot-v1",
            6,
            ActionSpace::Discrete { n: 3 },
            500,
            Some(-100.0),
        ),
        (
            "MountainCar-v0",
            2,
            ActionSpace::Discrete { n: 3 },
            200,
            Some(-110.0),
        ),
        (
            "Pendulum-v1",
            3,
            ActionSpace::Box {
                low: vec![-2.0],
                high: vec![2.0],
            },
            200,
            None,
        ),
        // rl-zoo's MaskVelocityWrapper: the same spaces, velocities zeroed.
        (
            "CartPoleNoVel-v1",
            4,
            ActionSpace::Discrete { n: 2 },
            500,
            Some(475.0),
        ),
        (
            "PendulumNoVel-v1",
            3,
            ActionSpace::Box {
                low: vec![-2.0],
                high: vec![2.0],
            },
            200,
            None,
        ),
    ];
    assert_eq!(ENV_IDS.len(), expected.len());
    for (id, obs_dim, action_space, max_steps, threshold) in expected {
        let s = spec(id).expect("known id");
        assert_eq!(s.id, id);
        assert_eq!(s.obs_dim(), obs_dim, "{id}");
        assert_eq!(s.observation_space.high.len(), obs_dim, "{id}");
        assert_eq!(s.action_space, action_space, "{id}");
        assert_eq!(s.max_episode_steps, max_steps, "{id}");
        assert_eq!(s.reward_threshold, threshold, "{id}");
        let env = make(id).expect("known id");
        assert_eq!(env.spec(), &s);
    }
    let cp = spec("CartPole-v1").expect("known");
    assert_eq!(
        cp.observation_space.high,
        [4.8, f32::MAX, 0.41887903, f32::MAX]
    );
    assert_eq!(
        cp.observation_space.low,
        [-4.8, -f32::MAX, -0.41887903, -f32::MAX]
    );
    let ac = spec("Acrobot-v1").expect("known");
    assert_eq!(
        ac.observation_space.high,
        [1.0, 1.0, 1.0, 1.0, 12.566371, 28.274334]
    );
    let mc = spec("MountainCar-v0").expect("known");
    assert_eq!(mc.observation_space.low, [-1.2, -0.07]);
    assert_eq!(mc.observation_space.high, [0.6, 0.07]);
    let pe = spec("Pendulum-v1").expect("known");
    assert_eq!(pe.observation_space.high, [1.0, 1.0, 8.0]);
    assert!(pe.action_space.dim() == 1 && !pe.action_space.is_discrete());
}

#[test]
fn discrete_action_out_of_range_is_rejected_without_stepping() {
    let mut env = make("CartPole-v1").expect("known");
    reset(env.as_mut(), 1);
    let before = env.state();
    let mut obs = [0.0; 4];
    for bad in [2, -1, i64::MAX, i64::MIN] {
        let err = env.step(Action::Discrete(bad), &mut obs).unwrap_err();
        assert_eq!(err, EnvError::ActionOutOfRange { action: bad, n: 2 });
        let msg = err.to_string();
        assert!(
            msg.contains(&bad.to_string()) && msg.contains("Discrete(2)"),
            "{msg}"
        );
    }
    assert_eq!(env.state(), before);
    assert_eq!(env.elapsed_steps(), 0);
    assert!(env.step(Action::Discrete(1), &mut obs).is_ok());

    let mut acrobot = make("Acrobot-v1").expect("known");
    reset(acrobot.as_mut(), 1);
    let mut obs = [0.0; 6];
    assert_eq!(
        acrobot.step(Action::Discrete(3), &mut obs),
        Err(EnvError::ActionOutOfRange { action: 3, n: 3 })
    );
}

#[test]
fn wrong_action_kind_dimension_and_non_finite_are_rejected() {
    let mut cp = make("CartPole-v1").expect("known");
    reset(cp.as_mut(), 2);
    let mut obs = [0.0; 4];
    assert!(matches!(
        cp.step(Action::Continuous(&[1.0]), &mut obs),
        Err(EnvError::WrongActionKind {
            expected: "discrete",
            got: "continuous",
            ..
        })
    ));

    let mut pe = make("Pendulum-v1").expect("known");
    reset(pe.as_mut(), 2);
    let before = pe.state();
    let mut obs = [0.0; 3];
    assert!(matches!(
        pe.step(Action::Discrete(0), &mut obs),
        Err(EnvError::WrongActionKind {
            expected: "continuous",
            got: "discrete",
            ..
        })
    ));
    assert!(matches!(
        pe.step(Action::Continuous(&[0.5, 0.5]), &mut obs),
        Err(EnvError::ActionDim {
            expected: 1,
            got: 2,
            ..
        })
    ));
    assert!(matches!(
        pe.step(Action::Continuous(&[]), &mut obs),
        Err(EnvError::ActionDim { got: 0, .. })
    ));
    for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
        assert!(matches!(
            pe.step(Action::Continuous(&[bad]), &mut obs),
            Err(EnvError::NonFiniteAction { index: 0, .. })
        ));
    }
    assert_eq!(pe.state(), before);
    // Out-of-bounds but finite torques are clipped, as in Gymnasium.
    let mut a = pe.clone_state_env();
    let mut b = pe.clone_state_env();
    let ra = a
        .step(Action::Continuous(&[5.0]), &mut obs)
        .expect("clipped");
    let rb = b
        .step(Action::Continuous(&[2.0]), &mut obs)
        .expect("in range");
    assert_eq!(ra, rb);
    assert_eq!(a.state(), b.state());
}

/// Helper: a fresh env of the same kind with the same state.
trait CloneStateEnv {
    fn clone_state_env(&self) -> Box<dyn Env>;
}

impl CloneStateEnv for Box<dyn Env> {
    fn clone_state_env(&self) -> Box<dyn Env> {
        let mut env = make(self.spec().id).expect("known");
        env.set_state(&self.state()).expect("same layout");
        env
    }
}

#[test]
fn state_length_obs_length_and_order_are_checked() {
    for id in ENV_IDS {
        let mut env = make(id).expect("known");
        let n = env.state().len();
        let mut obs = vec![0.0; env.obs_dim()];
        let action = if env.spec().action_space.is_discrete() {
            Action::Discrete(0)
        } else {
            Action::Continuous(&[0.0])
        };
        assert_eq!(
            env.step(action, &mut obs),
            Err(EnvError::NotReset { env_id: id })
        );
        assert_eq!(
            env.observe(&mut obs),
            Err(EnvError::NotReset { env_id: id })
        );
        let err = env.set_state(&vec![0.0; n + 1]).unwrap_err();
        assert_eq!(
            err,
            EnvError::StateLength {
                env_id: id,
                expected: n,
                got: n + 1
            }
        );
        env.set_state(&vec![0.0; n]).expect("right length");
        let mut short = vec![0.0; env.obs_dim() - 1];
        assert_eq!(
            env.step(action, &mut short),
            Err(EnvError::ObsLength {
                expected: env.obs_dim(),
                got: env.obs_dim() - 1
            })
        );
        let mut rng = StdRng::seed_from_u64(0);
        assert!(matches!(
            env.reset(&mut rng, &mut short),
            Err(EnvError::ObsLength { .. })
        ));
        assert!(env.step(action, &mut obs).is_ok(), "{id}");
    }
}

#[test]
fn reset_draws_follow_gymnasium_distributions() {
    let mut rng = StdRng::seed_from_u64(42);
    let mut envs: Vec<Box<dyn Env>> = ENV_IDS.iter().map(|id| make(id).expect("known")).collect();
    let mut seen_negative = vec![false; ENV_IDS.len()];
    for _ in 0..2000 {
        for (k, env) in envs.iter_mut().enumerate() {
            let mut obs = vec![0.0; env.obs_dim()];
            env.reset(&mut rng, &mut obs).expect("reset");
            let s = env.state();
            assert_eq!(env.elapsed_steps(), 0);
            seen_negative[k] |= s[0] < 0.0;
            match env.spec().id {
                "CartPole-v1" => {
                    assert!(s.iter().all(|v| (-0.05..0.05).contains(v)), "{s:?}");
                    let cast: Vec<f32> = s.iter().map(|v| *v as f32).collect();
                    assert_eq!(obs, cast);
                }
                "Acrobot-v1" => {
                    assert!(s.iter().all(|v| (-0.1..=0.1).contains(v)), "{s:?}");
                    // Gymnasium rounds the reset draw to float32.
                    assert!(s.iter().all(|v| f64::from(*v as f32) == *v), "{s:?}");
                    assert_eq!(obs[0], s[0].cos() as f32);
                    assert_eq!(obs[5], s[3] as f32);
                }
                "MountainCar-v0" => {
                    assert!((-0.6..-0.4).contains(&s[0]) && s[1] == 0.0, "{s:?}");
                }
                "Pendulum-v1" => {
                    assert!((-std::f64::consts::PI..std::f64::consts::PI).contains(&s[0]));
                    assert!((-1.0..1.0).contains(&s[1]), "{s:?}");
                    assert!(env.spec().observation_space.contains(&obs));
                }
                // The wrapped env's draw, velocities zeroed (rl-zoo's
                // MaskVelocityWrapper).
                "CartPoleNoVel-v1" => {
                    assert!(s.iter().all(|v| (-0.05..0.05).contains(v)), "{s:?}");
                    assert_eq!(obs, [s[0] as f32, 0.0, s[2] as f32, 0.0]);
                }
                "PendulumNoVel-v1" => {
                    assert!((-1.0..1.0).contains(&s[1]), "{s:?}");
                    assert_eq!(obs[2], 0.0);
                    assert_eq!(obs[0], s[0].cos() as f32);
                }
                other => panic!("untested env {other}"),
            }
        }
    }
    assert!(seen_negative.iter().all(|b| *b));
}

#[test]
fn pendulum_truncates_at_200_steps_and_never_terminates() {
    let mut env = make("Pendulum-v1").expect("known");
    let mut obs = reset(env.as_mut(), 3);
    for t in 1..=200u32 {
        let r = env
            .step(Action::Continuous(&[1.0]), &mut obs)
            .expect("step");
        assert!(!r.terminated, "step {t}");
        assert_eq!(r.truncated, t == 200, "step {t}");
        assert_eq!(r.done(), t == 200);
        assert_eq!(env.elapsed_steps(), t);
        assert!(r.reward <= 0.0 && r.reward >= -16.2736044);
    }
    // Like Gymnasium's TimeLimit, stepping on keeps reporting truncation.
    let r = env
        .step(Action::Continuous(&[0.0]), &mut obs)
        .expect("step");
    assert!(r.truncated && !r.terminated);
    // set_state restarts the counter.
    env.set_state(&[0.0, 0.0]).expect("state");
    let r = env
        .step(Action::Continuous(&[0.0]), &mut obs)
        .expect("step");
    assert!(!r.truncated);
    assert_eq!(r.reward, 0.0);
    assert_eq!(env.elapsed_steps(), 1);
}

#[test]
fn mountain_car_time_limit_is_truncation_not_termination() {
    let mut env = make("MountainCar-v0").expect("known");
    let mut obs = reset(env.as_mut(), 4);
    for t in 1..=200u32 {
        let r = env.step(Action::Discrete(1), &mut obs).expect("step");
        assert_eq!(r.reward, -1.0);
        assert!(!r.terminated, "doing nothing never reaches the goal");
        assert_eq!(r.truncated, t == 200);
    }
}

#[test]
fn mountain_car_terminates_at_goal_and_stops_at_left_wall() {
    let mut env = make("MountainCar-v0").expect("known");
    let mut obs = [0.0; 2];
    env.set_state(&[0.49, 0.02]).expect("state");
    let r = env.step(Action::Discrete(2), &mut obs).expect("step");
    assert!(r.terminated && !r.truncated);
    assert_eq!(r.reward, -1.0);

    env.set_state(&[-1.19, -0.05]).expect("state");
    env.step(Action::Discrete(0), &mut obs).expect("step");
    assert_eq!(env.state(), vec![-1.2, 0.0]);
}

#[test]
fn cartpole_terminates_and_rewards_zero_after_termination() {
    let mut env = make("CartPole-v1").expect("known");
    let mut obs = reset(env.as_mut(), 5);
    let mut steps = 0;
    let last = loop {
        let r = env.step(Action::Discrete(1), &mut obs).expect("step");
        steps += 1;
        if r.done() {
            break r;
        }
        assert_eq!(r.reward, 1.0);
    };
    assert!(last.terminated && !last.truncated, "{last:?}");
    assert_eq!(last.reward, 1.0, "the terminating step is rewarded");
    assert!(steps < 100);
    assert!(obs[0].abs() > 2.4 || obs[2].abs() > 0.20943952);
    let r = env.step(Action::Discrete(1), &mut obs).expect("step");
    assert!(r.terminated);
    assert_eq!(r.reward, 0.0, "Gymnasium gives 0 after termination");
    // A reset clears steps_beyond_terminated.
    reset(env.as_mut(), 6);
    let r = env.step(Action::Discrete(0), &mut obs).expect("step");
    assert_eq!(r.reward, 1.0);
}

#[test]
fn acrobot_terminates_with_zero_reward_when_tip_is_high() {
    let mut env = make("Acrobot-v1").expect("known");
    let mut obs = [0.0; 6];
    // Pointing straight up: -cos(pi) - cos(0 + pi) = 2 > 1.
    env.set_state(&[std::f64::consts::PI - 0.01, 0.0, 0.0, 0.0])
        .expect("state");
    let r = env.step(Action::Discrete(1), &mut obs).expect("step");
    assert!(r.terminated && !r.truncated);
    assert_eq!(r.reward, 0.0);
    let s = env.state();
    assert!(s[0].abs() <= std::f64::consts::PI && s[1].abs() <= std::f64::consts::PI);
    // Hanging down: not terminal, reward -1.
    env.set_state(&[0.0; 4]).expect("state");
    let r = env.step(Action::Discrete(2), &mut obs).expect("step");
    assert!(!r.terminated);
    assert_eq!(r.reward, -1.0);
}

#[test]
fn same_seed_same_trajectory() {
    for id in ENV_IDS {
        let run = |seed: u64| {
            let mut env = make(id).expect("known");
            let mut out = reset(env.as_mut(), seed);
            let mut obs = vec![0.0; env.obs_dim()];
            for t in 0..50i64 {
                let action = if env.spec().action_space.is_discrete() {
                    Action::Discrete(t % 2)
                } else {
                    Action::Continuous(&[0.5])
                };
                let r = env.step(action, &mut obs).expect("step");
                out.extend_from_slice(&obs);
                out.push(r.reward as f32);
            }
            out
        };
        assert_eq!(run(9), run(9), "{id}");
        assert_ne!(run(9), run(10), "{id}");
    }
}
