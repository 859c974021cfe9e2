//! The env bridge against the real Gymnasium in the project's Python
//! environment (`just install` makes it): agreement with the built-in
//! CartPole, spaces, errors that name the problem, and faults that are
//! survived.

use relay_bridge::{BridgeError, EnvSection, FaultKind, PyVecEnv, VecEnvs};
use relay_envs::{Env, VecActions};
use std::path::Path;

fn gymnasium() -> EnvSection {
    EnvSection {
        backend: relay_bridge::Backend::Gymnasium,
        ..EnvSection::default()
    }
}

/// A module of test envs in a fresh folder, on the workers' `sys.path`.
fn user_envs(dir: &Path) -> EnvSection {
    std::fs::write(
        dir.join("relay_test_envs.py"),
        r#"
import os, time
import numpy as np
import gymnasium as gym
from gymnasium import spaces

class Faulty(gym.Env):
    """Episodes of 10 steps. With a `marker` path, the first env (of every
    worker) to reach step `fail_at` creates the file and does `mode`."""
    def __init__(self, mode="raise", fail_at=3, marker=None):
        self.observation_space = spaces.Dict({
            "position": spaces.Box(-1.0, 1.0, (2,), np.float32),
            "room": spaces.Discrete(3),
        })
        self.action_space = spaces.Discrete(2)
        self.mode, self.fail_at, self.marker = mode, fail_at, marker
    def _obs(self):
        return {"position": np.array([0.5, -0.5], np.float32), "room": self.t % 3}
    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return self._obs(), {}
    def step(self, action):
        self.t += 1
        if self.t == self.fail_at and self.marker and not os.path.exists(self.marker):
            try:
                os.close(os.open(self.marker, os.O_CREAT | os.O_EXCL))
            except FileExistsError:
                pass
            else:
                if self.mode == "raise":
                    raise ValueError("the test env broke on purpose")
                if self.mode == "crash":
                    os._exit(7)
                if self.mode == "hang":
                    time.sleep(600)
                if self.mode == "nan":
                    obs = self._obs()
                    obs["position"][1] = np.nan
                    return obs, 1.0, False, False, {}
        return self._obs(), 1.0, self.t >= 10, False, {}

class Masked(gym.Env):
    """Episodes of 4 steps; at step t only action t % 3 is legal, and with
    `empty_at` the mask at that step allows nothing."""
    observation_space = spaces.Box(0.0, 10.0, (1,), np.float32)
    action_space = spaces.Discrete(3)
    def __init__(self, empty_at=None):
        self.empty_at = empty_at
    def _info(self):
        mask = np.zeros(3, np.int8)
        if self.t != self.empty_at:
            mask[self.t % 3] = 1
        return {"action_mask": mask}
    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return np.array([0.0], np.float32), self._info()
    def step(self, action):
        assert self.t == self.empty_at or action == self.t % 3, f"illegal action {action} at step {self.t}"
        self.t += 1
        return np.array([self.t], np.float32), 1.0, self.t >= 4, False, self._info()

class Texty(gym.Env):
    observation_space = spaces.Text(8)
    action_space = spaces.Discrete(2)
"#,
    )
    .unwrap();
    EnvSection {
        python_path: vec![dir.to_path_buf()],
        entry_point: Some("relay_test_envs:Faulty".into()),
        ..gymnasium()
    }
}

#[test]
fn cartpole_through_the_bridge_agrees_with_the_builtin_one_from_the_same_states() {
    let n = 4;
    let mut bridge = PyVecEnv::new("CartPole-v1", &gymnasium(), n, 11).unwrap();
    assert_eq!(bridge.spec().obs_dim(), 4);
    assert_eq!(bridge.spec().max_episode_steps, 500);
    assert_eq!(bridge.spec().reward_threshold, Some(475.0));
    // Gymnasium 1.4's Box turns float32's largest value into infinity.
    let finite =
        |v: &[f32]| -> Vec<f32> { v.iter().map(|x| x.clamp(f32::MIN, f32::MAX)).collect() };
    let builtin_space = relay_envs::spec("CartPole-v1").unwrap().observation_space;
    assert_eq!(
        finite(&bridge.spec().observation_space.low),
        builtin_space.low
    );
    assert_eq!(
        finite(&bridge.spec().observation_space.high),
        builtin_space.high
    );
    bridge.reset().unwrap();
    let mut builtin: Vec<_> = (0..n)
        .map(|_| relay_envs::make("CartPole-v1").unwrap())
        .collect();
    let sync = |bridge: &mut PyVecEnv, env: &mut Box<dyn Env>, i: usize| {
        let state: Vec<f64> = serde_json::from_value(bridge.get_attr(i, "state").unwrap()).unwrap();
        env.set_state(&state).unwrap();
        let mut obs = [0f32; 4];
        env.observe(&mut obs).unwrap();
        assert_eq!(
            &obs[..],
            &bridge.obs()[i * 4..(i + 1) * 4],
            "env {i} after sync"
        );
    };
    for (i, env) in builtin.iter_mut().enumerate() {
        sync(&mut bridge, env, i);
    }
    let mut episodes = 0;
    for t in 0..400u64 {
        let actions: Vec<i64> = (0..n as u64)
            .map(|i| ((t * 7 + i * 3) / 5 % 2) as i64)
            .collect();
        let step = bridge.step(VecActions::Discrete(&actions)).unwrap().clone();
        for i in 0..n {
            let mut obs = [0f32; 4];
            let r = builtin[i]
                .step(relay_envs::Action::Discrete(actions[i]), &mut obs)
                .unwrap();
            assert_eq!(r.reward, step.rewards[i], "reward, env {i} step {t}");
            assert_eq!(
                r.terminated, step.terminated[i],
                "terminated, env {i} step {t}"
            );
            assert_eq!(
                r.truncated, step.truncated[i],
                "truncated, env {i} step {t}"
            );
            if step.done(i) {
                assert_eq!(
                    &obs[..],
                    step.final_obs(i).unwrap(),
                    "final obs, env {i} step {t}"
                );
                episodes += 1;
                sync(&mut bridge, &mut builtin[i], i);
            } else {
                assert_eq!(&obs[..], step.obs(i), "obs, env {i} step {t}");
            }
        }
    }
    assert!(episodes > 10, "only {episodes} episodes ended");
}

#[test]
fn autoreset_keeps_episodes_apart_and_seeds_reproduce() {
    let run = |seed| {
        let mut envs = VecEnvs::new("CartPole-v1", &gymnasium(), 3, seed).unwrap();
        let mut trace = envs.reset().unwrap().to_vec();
        let mut finished = Vec::new();
        for _ in 0..60 {
            let step = envs.step(VecActions::Discrete(&[1, 1, 0])).unwrap();
            trace.extend_from_slice(&step.obs);
            finished.extend(
                step.finished
                    .iter()
                    .map(|e| (e.env_index, e.length, e.episode_return)),
            );
        }
        (trace, finished)
    };
    let (a, finished) = run(5);
    assert_eq!(a, run(5).0, "the same seed replays the same episodes");
    assert_ne!(a, run(6).0, "another seed plays other episodes");
    // Pushing one way ends CartPole within ~10-30 steps; each episode's length
    // and return agree (reward 1 per step): nothing of the next one leaked in.
    assert!(!finished.is_empty());
    for (_, length, ret) in finished {
        assert_eq!(ret, length as f64);
    }
}

#[test]
fn discrete_and_dict_observations_are_flattened_and_other_spaces_are_refused() {
    let taxi = relay_bridge::spec("Taxi-v4", &EnvSection::default()).unwrap();
    assert_eq!(taxi.obs_dim(), 500, "Discrete(500) is one-hot");
    assert_eq!(
        taxi.action_space,
        relay_envs::ActionSpace::Discrete { n: 6 }
    );
    let mut envs = VecEnvs::new("Taxi-v4", &EnvSection::default(), 2, 1).unwrap();
    let obs = envs.reset().unwrap();
    for row in obs.chunks(500) {
        assert_eq!(row.iter().sum::<f32>(), 1.0);
        assert!(row.iter().all(|&x| x == 0.0 || x == 1.0));
    }

    let dir = tempdir();
    let section = user_envs(&dir);
    let mut envs = VecEnvs::new("RelayFaulty-v0", &section, 1, 0).unwrap();
    assert_eq!(
        envs.obs_dim(),
        2 + 3,
        "Dict(Box(2), Discrete(3)) flattens to 5"
    );
    assert_eq!(envs.reset().unwrap(), &[0.5, -0.5, 1.0, 0.0, 0.0]);

    let texty = EnvSection {
        entry_point: Some("relay_test_envs:Texty".into()),
        ..section
    };
    let err = relay_bridge::spec("RelayTexty-v0", &texty).unwrap_err();
    assert!(matches!(err, BridgeError::UnsupportedSpace { .. }), "{err}");
    assert!(err.to_string().contains("Text("), "{err}");
}

#[test]
fn action_masks_come_from_the_info_with_each_observation_and_can_be_turned_off() {
    let taxi = relay_bridge::spec("Taxi-v4", &EnvSection::default()).unwrap();
    assert!(taxi.action_mask, "Taxi's reset info has action_mask");
    let mut envs = VecEnvs::new("Taxi-v4", &EnvSection::default(), 2, 1).unwrap();
    envs.reset().unwrap();
    let masks = envs.masks().expect("masks on by default").to_vec();
    assert_eq!(masks.len(), 2 * 6);
    // Taxi's first state (seed 1 or any): pickup and dropoff are illegal
    // away from the passenger, and some move is legal.
    for row in masks.chunks(6) {
        assert!(
            row.iter().all(|&b| b <= 1) && row[..4].contains(&1),
            "{row:?}"
        );
    }
    let off = EnvSection {
        action_masks: false,
        ..EnvSection::default()
    };
    assert!(!relay_bridge::spec("Taxi-v4", &off).unwrap().action_mask);
    let mut plain = VecEnvs::new("Taxi-v4", &off, 2, 1).unwrap();
    plain.reset().unwrap();
    assert!(plain.masks().is_none());

    let dir = tempdir();
    let section = EnvSection {
        entry_point: Some("relay_test_envs:Masked".into()),
        ..user_envs(&dir)
    };
    let mut envs = VecEnvs::new("RelayMasked-v0", &section, 2, 0).unwrap();
    assert!(envs.spec().action_mask);
    envs.reset().unwrap();
    assert_eq!(envs.masks().unwrap(), &[1, 0, 0, 1, 0, 0]);
    for t in 1..=4i64 {
        // The legal action of step t - 1; the env asserts it got it.
        let a = (t - 1) % 3;
        let step = envs.step(VecActions::Discrete(&[a, a])).unwrap();
        if t < 4 {
            let legal = (t % 3) as usize;
            let want: Vec<u8> = (0..6).map(|j| u8::from(j % 3 == legal)).collect();
            assert_eq!(step.masks().unwrap(), &want[..], "step {t}");
        } else {
            // The episode ended: its final state's mask (step 4: action 1),
            // and the new episode's first.
            assert_eq!(step.final_mask(0).unwrap(), &[0, 1, 0]);
            assert_eq!(step.masks().unwrap(), &[1, 0, 0, 1, 0, 0]);
        }
    }

    // A mask that allows nothing is the env's fault, named with its step.
    let mut section = section;
    section.kwargs.insert("empty_at".into(), 2.into());
    let mut envs = VecEnvs::new("RelayMasked-v0", &section, 1, 0).unwrap();
    envs.reset().unwrap();
    envs.step(VecActions::Discrete(&[0])).unwrap();
    let err = envs.step(VecActions::Discrete(&[1])).unwrap_err();
    let BridgeError::Faulted { faults } = &err else {
        panic!("expected a fault, got {err}")
    };
    assert!(
        faults[0]
            .detail
            .contains("RelayMasked-v0: the action mask at episode step 2 allows no action"),
        "{err}"
    );
    // The env was reset and stepping goes on.
    assert_eq!(envs.masks().unwrap(), &[1, 0, 0]);
    envs.step(VecActions::Discrete(&[0])).unwrap();
}

fn pettingzoo() -> EnvSection {
    EnvSection {
        backend: relay_bridge::Backend::Pettingzoo,
        ..EnvSection::default()
    }
}

/// PettingZoo's turn-taking as `env.agent_iter()` / `env.last()` /
/// `env.step()` play it: the agent to move, its observation and mask,
/// every agent's rewards, and the next game in the same step.
#[test]
fn pettingzoo_games_take_turns_with_masks_and_every_agents_rewards() {
    let spec = relay_bridge::spec("tictactoe_v3", &pettingzoo()).unwrap();
    assert_eq!(spec.agents, ["player_1", "player_2"]);
    assert_eq!(spec.obs_dim(), 18, "a 3x3x2 board");
    assert_eq!(
        spec.action_space,
        relay_envs::ActionSpace::Discrete { n: 9 }
    );
    assert!(spec.action_mask);
    let mut envs = VecEnvs::new("tictactoe_v3", &pettingzoo(), 2, 3).unwrap();
    envs.reset().unwrap();
    // Each env plays its first legal square: player_1 takes 0, 2, 4, 6 and
    // wins on the diagonal at the 7th move.
    for t in 0..7usize {
        let masks = envs.masks().unwrap().to_vec();
        let actions: Vec<i64> = masks
            .chunks(9)
            .map(|m| m.iter().position(|&b| b == 1).unwrap() as i64)
            .collect();
        assert_eq!(actions, [t as i64; 2], "the first free square is {t}");
        let step = envs.step(VecActions::Discrete(&actions)).unwrap();
        if t < 6 {
            assert_eq!(step.movers().unwrap(), &[(t as u32 + 1) % 2; 2]);
            assert!(!step.done(0) && !step.done(1));
            assert_eq!(step.seat_rewards(0), &[0.0, 0.0]);
        } else {
            assert!(step.terminated[0] && step.terminated[1] && !step.truncated[0]);
            assert_eq!(step.seat_rewards(0), &[1.0, -1.0]);
            assert_eq!(step.seat_returns(1).unwrap(), &[1.0, -1.0]);
            assert_eq!(step.finished.len(), 2);
            // player_2's last view: its own 3 marks, player_1's 4.
            let last = step.final_seat_obs(0, 1).unwrap();
            let mine: f32 = last.iter().step_by(2).sum();
            let theirs: f32 = last.iter().skip(1).step_by(2).sum();
            assert_eq!((mine, theirs), (3.0, 4.0));
            // The next game, player_1 to move on an empty board.
            assert_eq!(step.movers().unwrap(), &[0, 0]);
            assert_eq!(step.masks().unwrap(), &[1; 18]);
        }
    }

    // A parallel game (rock paper scissors), turned into turns by
    // PettingZoo's parallel_to_aec; its rewards come once both have moved.
    let rps = EnvSection {
        entry_point: Some("pettingzoo.classic.rps_v2:parallel_env".into()),
        ..pettingzoo()
    };
    let mut envs = VecEnvs::new("rps_v2", &rps, 1, 0).unwrap();
    assert_eq!(envs.spec().agents, ["player_0", "player_1"]);
    assert!(envs.masks().is_none() && !envs.spec().action_mask);
    envs.reset().unwrap();
    let step = envs.step(VecActions::Discrete(&[0])).unwrap();
    assert_eq!(step.movers().unwrap(), &[1]);
    // Paper covers rock.
    let step = envs.step(VecActions::Discrete(&[1])).unwrap();
    assert_eq!(step.seat_rewards(0), &[-1.0, 1.0]);

    let err = relay_bridge::spec("connect_four_v2", &pettingzoo()).unwrap_err();
    assert!(
        err.to_string().contains("no game 'connect_four_v2'")
            && err.to_string().contains("connect_four_v3"),
        "{err}"
    );
    let err = relay_bridge::spec("tictactoe_v3", &gymnasium()).unwrap_err();
    assert!(
        err.to_string().contains("set env.backend: pettingzoo"),
        "{err}"
    );
}

/// `env.seat_feature`: every observation of a multi-agent game ends with
/// its seat, one-hot: the mover's, and each seat's in the final views.
#[test]
fn the_seat_feature_ends_each_observation_with_its_seat() {
    let section = EnvSection {
        seat_feature: true,
        ..pettingzoo()
    };
    let spec = relay_bridge::spec("tictactoe_v3", &section).unwrap();
    assert_eq!(spec.obs_dim(), 20, "a 3x3x2 board and 2 seats");
    assert_eq!(&spec.observation_space.high[18..], &[1.0, 1.0]);
    let mut envs = VecEnvs::new("tictactoe_v3", &section, 1, 3).unwrap();
    let obs = envs.reset().unwrap().to_vec();
    assert_eq!(&obs[18..], &[1.0, 0.0], "player_1 moves first");
    let step = envs.step(VecActions::Discrete(&[4])).unwrap();
    assert_eq!(&step.obs[18..], &[0.0, 1.0]);
    // player_2 sees player_1's mark on cell 4 in its second plane.
    assert_eq!((step.obs[8], step.obs[9]), (0.0, 1.0));
    // The first free squares to the end (a draw on the 9th move).
    let mut step_obs = step.obs.clone();
    let mut ended = false;
    for _ in 1..9 {
        let free = (0..9)
            .find(|&k| step_obs[2 * k] + step_obs[2 * k + 1] == 0.0)
            .unwrap();
        let step = envs.step(VecActions::Discrete(&[free as i64])).unwrap();
        step_obs = step.obs.clone();
        if step.done(0) {
            for seat in 0..2 {
                let last = step.final_seat_obs(0, seat).unwrap();
                assert_eq!(last[18 + seat], 1.0);
                assert_eq!(last[18 + 1 - seat], 0.0);
            }
            ended = true;
        }
    }
    assert!(ended, "the game ended within 9 moves");
    let err = EnvSection {
        seat_feature: true,
        ..gymnasium()
    }
    .validate("CartPole-v1")
    .unwrap_err();
    assert_eq!(err.0, "env.seat_feature");
}

#[test]
fn image_observations_are_bytes_channels_first() {
    // MinAtar: a (10, 10, 4) bool image becomes [4, 10, 10] of 0/255 pixels.
    let mut envs = VecEnvs::new("MinAtar/Breakout-v1", &gymnasium(), 2, 3).unwrap();
    assert_eq!(envs.spec().image, Some([4, 10, 10]));
    assert_eq!(envs.obs_dim(), 400);
    let obs = envs.reset().unwrap().to_vec();
    assert!(obs.iter().all(|&x| x == 0.0 || x == 255.0));
    for row in obs.chunks(400) {
        // Channel 0 is the paddle, which lives on the bottom row (y = 9):
        // only a channels-first layout puts it at 90..100 of the row.
        let paddle = &row[..100];
        assert_eq!(paddle.iter().filter(|&&x| x > 0.0).count(), 1);
        assert!(paddle[90..].iter().any(|&x| x > 0.0), "{paddle:?}");
    }
    let step = envs.step(VecActions::Discrete(&[1, 2])).unwrap();
    assert!(step.obs.iter().all(|&x| x == 0.0 || x == 255.0));

    // Atari with the rl-zoo preprocessing from config: 4 stacked 84x84 frames.
    let mut section = gymnasium();
    section
        .kwargs
        .insert("frameskip".into(), serde_json::json!(1));
    section.wrappers = serde_json::from_value(serde_json::json!([
        {"name": "AtariPreprocessing", "kwargs": {"frame_skip": 4, "terminal_on_life_loss": true}},
        {"name": "FrameStackObservation", "kwargs": {"stack_size": 4}},
    ]))
    .unwrap();
    let mut envs = VecEnvs::new("ALE/Pong-v5", &section, 1, 0).unwrap();
    assert_eq!(envs.spec().image, Some([4, 84, 84]));
    envs.reset().unwrap();
    let step = envs.step(VecActions::Discrete(&[0])).unwrap();
    assert_eq!(step.obs.len(), 4 * 84 * 84);
    assert!(step
        .obs
        .iter()
        .all(|&x| x.fract() == 0.0 && (0.0..=255.0).contains(&x)));
    assert!(step.obs.iter().any(|&x| x > 0.0));
}

#[test]
fn unknown_ids_and_missing_packages_are_named() {
    let err = relay_bridge::spec("NoSuchEnv-v0", &EnvSection::default()).unwrap_err();
    assert!(matches!(err, BridgeError::UnknownEnv { .. }), "{err}");
    assert!(err.to_string().contains("NoSuchEnv"), "{err}");

    let section = EnvSection {
        imports: vec!["relay_no_such_package".into()],
        ..EnvSection::default()
    };
    let err = relay_bridge::spec("LunarLander-v3", &section).unwrap_err();
    assert!(matches!(err, BridgeError::MissingPackage { .. }), "{err}");
    let text = err.to_string();
    assert!(
        text.contains("relay_no_such_package") && text.contains("just install"),
        "{text}"
    );

    let section = EnvSection {
        python: Some("/nonexistent/python".into()),
        ..gymnasium()
    };
    let err = relay_bridge::spec("CartPole-v1", &section).unwrap_err();
    assert!(matches!(err, BridgeError::NoPython { .. }), "{err}");
}

/// Steps 3 envs of `RelayFaulty-v0`, one worker each, of which one
/// misbehaves (`mode`) at its third step, and checks that the fault is
/// reported for that env alone, the batch goes on, and every episode after
/// it is whole.
fn survives(mode: &str, kind: FaultKind, timeout_s: f64) {
    let dir = tempdir();
    let mut section = user_envs(&dir);
    section.workers = 3;
    section.step_timeout_s = timeout_s;
    section.kwargs.insert("mode".into(), mode.into());
    let marker = dir.join("failed").display().to_string();
    section.kwargs.insert("marker".into(), marker.into());
    let mut envs = PyVecEnv::new("RelayFaulty-v0", &section, 3, 0).unwrap();
    envs.reset().unwrap();
    envs.step(VecActions::Discrete(&[0; 3])).unwrap();
    envs.step(VecActions::Discrete(&[0; 3])).unwrap();
    let err = envs.step(VecActions::Discrete(&[0; 3])).unwrap_err();
    assert!(err.is_recoverable(), "{err}");
    let BridgeError::Faulted { faults } = &err else {
        panic!("expected a fault, got {err}")
    };
    assert_eq!(faults.len(), 1, "{err}");
    assert_eq!(faults[0].kind, kind, "{err}");
    assert_eq!(faults[0].envs.len(), 1, "{err}");
    match mode {
        "raise" => {
            assert!(
                faults[0].detail.contains("the test env broke on purpose"),
                "{err}"
            );
            assert!(faults[0].detail.contains("Traceback"), "{err}");
        }
        "nan" => assert!(
            faults[0]
                .detail
                .contains("non-finite observation component 1 = nan"),
            "{err}"
        ),
        _ => {}
    }
    assert_eq!(envs.restarts(), kind.restarted() as u64);
    let faulted = faults[0].envs[0];
    // The others go on with their episodes (10 steps, the faulted step
    // included); the faulted env starts a new one of 10 steps.
    let mut finished = Vec::new();
    for _ in 0..10 {
        let step = envs.step(VecActions::Discrete(&[1; 3])).unwrap();
        finished.extend(
            step.finished
                .iter()
                .map(|e| (e.env_index, e.length, e.episode_return)),
        );
    }
    finished.sort_by_key(|e| e.0);
    assert_eq!(finished.len(), 3, "{finished:?}");
    for (i, length, ret) in finished {
        assert_eq!((length, ret), (10, 10.0), "env {i} (faulted: {faulted})");
    }
}

#[test]
fn a_python_exception_in_step_drops_the_episode_with_its_traceback() {
    survives("raise", FaultKind::Raised, 30.0);
}

#[test]
fn a_non_finite_observation_drops_the_episode_and_names_the_value() {
    survives("nan", FaultKind::Raised, 30.0);
}

#[test]
fn a_crashed_worker_is_restarted() {
    survives("crash", FaultKind::Crashed, 30.0);
}

#[test]
fn a_hung_worker_is_killed_and_restarted() {
    survives("hang", FaultKind::Hung, 2.0);
}

fn tempdir() -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "relay-bridge-test-{}-{:?}",
        std::process::id(),
        std::thread::current().id()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}
