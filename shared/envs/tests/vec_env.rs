//! Tests of the vectorized env: auto-reset, final observations, episode
//! statistics, determinism, validation.

use relay_envs::{make, EnvError, VecActions, VecEnv};

#[test]
fn auto_reset_keeps_final_obs_and_counts_return_and_length() {
    let n = 3;
    let mut envs = VecEnv::new("CartPole-v1", n, 11).expect("vec env");
    assert_eq!(
        (envs.num_envs(), envs.obs_dim(), envs.action_dim()),
        (3, 4, 1)
    );
    let first = envs.reset().expect("reset").to_vec();
    assert_eq!(first.len(), n * 4);
    assert!(first.iter().all(|v| v.abs() < 0.05));

    let mut returns = vec![0.0f64; n];
    let mut lengths = vec![0u32; n];
    let mut episodes = 0;
    // Always pushing right ends every episode in a dozen steps or so.
    for _ in 0..200 {
        let step = envs
            .step(VecActions::Discrete(&[1; 3]))
            .expect("step")
            .clone();
        assert_eq!(step.num_envs(), n);
        let mut finished = step.finished.iter();
        for i in 0..n {
            returns[i] += step.rewards[i];
            lengths[i] += 1;
            assert_eq!(step.done(i), step.terminated[i] || step.truncated[i]);
            if step.done(i) {
                let ep = finished.next().expect("a finished entry per done env");
                assert_eq!(ep.env_index, i);
                assert_eq!(ep.length, lengths[i]);
                assert_eq!(ep.episode_return, returns[i]);
                assert_eq!(
                    (ep.terminated, ep.truncated),
                    (step.terminated[i], step.truncated[i])
                );
                assert!(ep.terminated && !ep.truncated);
                let fin = step.final_obs(i).expect("final obs of a done env");
                assert!(fin[0].abs() > 2.4 || fin[2].abs() > 0.20943952, "{fin:?}");
                // The returned obs already belongs to the next episode...
                assert!(
                    step.obs(i).iter().all(|v| v.abs() < 0.05),
                    "{:?}",
                    step.obs(i)
                );
                // ...and matches the sub-env's fresh state.
                let state = envs.env(i).expect("index").state();
                let cast: Vec<f32> = state.iter().map(|v| *v as f32).collect();
                assert_eq!(step.obs(i), cast.as_slice());
                returns[i] = 0.0;
                lengths[i] = 0;
                episodes += 1;
            } else {
                assert!(step.final_obs(i).is_none());
                assert_eq!(step.rewards[i], 1.0);
            }
        }
        assert!(finished.next().is_none());
    }
    assert!(episodes >= 3 * 200 / 30, "only {episodes} episodes");
}

#[test]
fn pendulum_vec_env_truncates_every_env_at_200() {
    let n = 4;
    let mut envs = VecEnv::new("Pendulum-v1", n, 5).expect("vec env");
    envs.reset().expect("reset");
    let actions: Vec<f32> = (0..n).map(|i| i as f32 - 1.5).collect();
    let mut sums = vec![0.0f64; n];
    for t in 1..=200u32 {
        let step = envs
            .step(VecActions::Continuous(&actions))
            .expect("step")
            .clone();
        for (s, r) in sums.iter_mut().zip(&step.rewards) {
            *s += r;
        }
        assert!(step.terminated.iter().all(|d| !d));
        if t < 200 {
            assert!(step.finished.is_empty() && step.truncated.iter().all(|d| !d));
        } else {
            assert!(step.truncated.iter().all(|d| *d));
            assert_eq!(step.finished.len(), n);
            for (i, ep) in step.finished.iter().enumerate() {
                assert_eq!(ep.env_index, i);
                assert_eq!(ep.length, 200);
                assert!(ep.truncated && !ep.terminated);
                assert_eq!(ep.episode_return, sums[i]);
                let fin = step.final_obs(i).expect("final obs");
                assert_ne!(fin, step.obs(i), "auto-reset replaced the obs");
                assert_eq!(envs.env(i).expect("index").elapsed_steps(), 0);
            }
        }
    }
    // Statistics restart with the new episodes.
    let step = envs
        .step(VecActions::Continuous(&actions))
        .expect("step")
        .clone();
    assert!(step.finished.is_empty());
    assert!(step.final_obs(0).is_none());
}

#[test]
fn final_obs_equals_a_standalone_replay() {
    // Drive sub-env 0 and a standalone env from the same start state with
    // the same actions; the final obs of the vec env must be the standalone
    // env's last observation.
    let mut envs = VecEnv::new("MountainCar-v0", 2, 1).expect("vec env");
    envs.reset().expect("reset");
    let mut single = make("MountainCar-v0").expect("known");
    single
        .set_state(&envs.env(0).expect("index").state())
        .expect("state");
    let mut obs = [0.0f32; 2];
    for t in 1..=200 {
        let a = [(t % 3) as i64, 0];
        let r = single
            .step(relay_envs::Action::Discrete(a[0]), &mut obs)
            .expect("step");
        let step = envs.step(VecActions::Discrete(&a)).expect("step");
        assert_eq!(step.rewards[0], r.reward);
        assert_eq!(step.truncated[0], r.truncated);
        if t < 200 {
            assert_eq!(step.obs(0), obs);
        } else {
            assert_eq!(step.final_obs(0).expect("done"), obs);
            assert_eq!(step.finished[0].episode_return, -200.0);
        }
    }
}

#[test]
fn same_seed_is_deterministic_and_sub_envs_differ() {
    let run = |seed: u64| {
        let mut envs = VecEnv::new("Acrobot-v1", 3, seed).expect("vec env");
        let mut trace = envs.reset().expect("reset").to_vec();
        for t in 0..600i64 {
            let actions = [t % 3, (t / 7) % 3, 2];
            let step = envs.step(VecActions::Discrete(&actions)).expect("step");
            trace.extend_from_slice(&step.obs);
            trace.extend(step.rewards.iter().map(|r| *r as f32));
            for ep in &step.finished {
                trace.push(ep.length as f32);
            }
        }
        trace
    };
    let a = run(123);
    assert_eq!(a, run(123));
    assert_ne!(a, run(124));
    // Independent RNG streams per sub-env.
    assert_ne!(a[0..6], a[6..12]);
    assert_ne!(a[6..12], a[12..18]);
}

#[test]
fn reset_is_required_and_continues_rng_streams() {
    let mut envs = VecEnv::new("CartPole-v1", 2, 0).expect("vec env");
    assert_eq!(
        envs.step(VecActions::Discrete(&[0, 0])).unwrap_err(),
        EnvError::NotReset {
            env_id: "CartPole-v1"
        }
    );
    let first = envs.reset().expect("reset").to_vec();
    let second = envs.reset().expect("reset").to_vec();
    assert_ne!(first, second);
    assert_eq!(envs.obs(), second.as_slice());
}

#[test]
fn invalid_vec_actions_are_rejected_before_any_env_steps() {
    let mut envs = VecEnv::new("CartPole-v1", 3, 2).expect("vec env");
    envs.reset().expect("reset");
    let before: Vec<Vec<f64>> = (0..3)
        .map(|i| envs.env(i).expect("index").state())
        .collect();

    assert_eq!(
        envs.step(VecActions::Discrete(&[0, 1])).unwrap_err(),
        EnvError::ActionCount {
            expected: 3,
            got: 2
        }
    );
    let err = envs.step(VecActions::Discrete(&[0, 1, 7])).unwrap_err();
    assert_eq!(
        err,
        EnvError::SubEnv {
            index: 2,
            source: Box::new(EnvError::ActionOutOfRange { action: 7, n: 2 })
        }
    );
    assert!(err.to_string().contains("sub-environment 2"), "{err}");
    assert!(matches!(
        envs.step(VecActions::Continuous(&[0.0, 0.0, 0.0])),
        Err(EnvError::WrongActionKind { .. })
    ));
    for (i, state) in before.iter().enumerate() {
        let env = envs.env(i).expect("index");
        assert_eq!(&env.state(), state);
        assert_eq!(env.elapsed_steps(), 0);
    }

    let mut pend = VecEnv::new("Pendulum-v1", 2, 2).expect("vec env");
    pend.reset().expect("reset");
    assert_eq!(
        pend.step(VecActions::Continuous(&[0.0])).unwrap_err(),
        EnvError::ActionCount {
            expected: 2,
            got: 1
        }
    );
    assert!(matches!(
        pend.step(VecActions::Continuous(&[0.0, f32::NAN])),
        Err(EnvError::SubEnv { index: 1, .. })
    ));
    assert!(matches!(
        pend.step(VecActions::Discrete(&[0, 0])),
        Err(EnvError::WrongActionKind {
            expected: "continuous",
            got: "discrete",
            ..
        })
    ));
}

#[test]
fn construction_errors() {
    assert_eq!(
        VecEnv::new("CartPole-v1", 0, 0).unwrap_err(),
        EnvError::NoEnvs
    );
    assert!(matches!(
        VecEnv::new("Nope-v0", 2, 0),
        Err(EnvError::UnknownEnv { .. })
    ));
}

#[test]
fn vec_env_and_envs_are_send() {
    fn assert_send<T: Send>() {}
    assert_send::<VecEnv>();
    assert_send::<Box<dyn relay_envs::Env>>();
    assert_send::<relay_envs::VecStep>();
}
