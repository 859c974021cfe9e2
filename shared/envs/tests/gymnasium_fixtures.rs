//! Replays every trajectory recorded from Gymnasium 1.4.0 and checks that
//! the port reproduces it: observations within 1e-5 relative (1e-6 absolute
//! near zero), rewards, `terminated` and `truncated` exactly, plus the spec's
//! time limit and reward threshold.
//!
//! Fixture folder: `$RELAY_GYM_FIXTURES`, default `shared/fixtures/gymnasium`
//! next to the repository (see `shared/fixtures/README.md`).

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use relay_envs::{make, spec, Action, Env};
use serde::Deserialize;

#[derive(Deserialize)]
struct Fixture {
    env_id: String,
    gymnasium_version: String,
    max_episode_steps: u32,
    reward_threshold: Option<f64>,
    trajectories: Vec<Trajectory>,
}

#[derive(Deserialize)]
struct Trajectory {
    initial_state: Vec<f64>,
    initial_obs: Vec<f32>,
    steps: Vec<Step>,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum FixtureAction {
    Discrete(i64),
    Continuous(Vec<f64>),
}

#[derive(Deserialize)]
struct Step {
    action: FixtureAction,
    obs: Vec<f32>,
    reward: f64,
    terminated: bool,
    truncated: bool,
}

fn fixture_dir() -> PathBuf {
    match std::env::var_os("RELAY_GYM_FIXTURES") {
        Some(dir) => PathBuf::from(dir),
        None => PathBuf::from(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../../shared/fixtures/gymnasium"
        )),
    }
}

fn obs_close(got: f32, want: f32) -> bool {
    let (got, want) = (f64::from(got), f64::from(want));
    (got - want).abs() <= (1e-5 * want.abs()).max(1e-6)
}

/// First index where two observations differ beyond tolerance.
fn obs_mismatch(got: &[f32], want: &[f32]) -> Option<String> {
    if got.len() != want.len() {
        return Some(format!("length {} != expected {}", got.len(), want.len()));
    }
    got.iter()
        .zip(want)
        .position(|(g, w)| !obs_close(*g, *w))
        .map(|i| format!("component {i}: got {got:?}, expected {want:?}"))
}

/// Replays one trajectory; returns a description of the first divergence.
fn replay(env: &mut dyn Env, traj: &Trajectory) -> Result<usize, String> {
    env.set_state(&traj.initial_state)
        .map_err(|e| format!("set_state: {e}"))?;
    let mut obs = vec![0.0f32; env.obs_dim()];
    env.observe(&mut obs).map_err(|e| format!("observe: {e}"))?;
    if let Some(m) = obs_mismatch(&obs, &traj.initial_obs) {
        return Err(format!("initial_obs: {m}"));
    }
    for (t, step) in traj.steps.iter().enumerate() {
        // Gymnasium received the (recorded as float64) continuous actions as
        // float32 arrays, the dtype of the action space.
        let as_f32: Vec<f32>;
        let action = match &step.action {
            FixtureAction::Discrete(a) => Action::Discrete(*a),
            FixtureAction::Continuous(a) => {
                as_f32 = a.iter().map(|x| *x as f32).collect();
                Action::Continuous(&as_f32)
            }
        };
        let r = env
            .step(action, &mut obs)
            .map_err(|e| format!("step {t}: step failed: {e}"))?;
        if let Some(m) = obs_mismatch(&obs, &step.obs) {
            return Err(format!("step {t}: obs {m}"));
        }
        if r.reward != step.reward {
            return Err(format!(
                "step {t}: reward {:?} != expected {:?}",
                r.reward, step.reward
            ));
        }
        if r.terminated != step.terminated || r.truncated != step.truncated {
            return Err(format!(
                "step {t}: (terminated, truncated) = ({}, {}), expected ({}, {})",
                r.terminated, r.truncated, step.terminated, step.truncated
            ));
        }
    }
    Ok(traj.steps.len())
}

#[test]
fn gymnasium_fixtures_replay_every_trajectory() {
    let dir = fixture_dir();
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("cannot read fixture folder {}: {e}", dir.display()))
        .filter_map(|entry| entry.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|ext| ext == "json"))
        .collect();
    files.sort();
    assert!(
        !files.is_empty(),
        "no *.json fixtures in {} (set RELAY_GYM_FIXTURES)",
        dir.display()
    );

    let mut failures = String::new();
    let mut replayed_trajectories = 0usize;
    let mut replayed_steps = 0usize;
    for path in &files {
        let name = path.file_name().map_or_else(
            || path.display().to_string(),
            |n| n.to_string_lossy().into_owned(),
        );
        let fixture = load(path);
        let spec = match spec(&fixture.env_id) {
            Ok(s) => s,
            Err(e) => {
                let _ = writeln!(failures, "{name}: {e}");
                continue;
            }
        };
        if spec.max_episode_steps != fixture.max_episode_steps {
            let _ = writeln!(
                failures,
                "{name}: max_episode_steps {} != fixture {}",
                spec.max_episode_steps, fixture.max_episode_steps
            );
        }
        if spec.reward_threshold != fixture.reward_threshold {
            let _ = writeln!(
                failures,
                "{name}: reward_threshold {:?} != fixture {:?}",
                spec.reward_threshold, fixture.reward_threshold
            );
        }
        if fixture.trajectories.is_empty() {
            let _ = writeln!(failures, "{name}: no trajectories");
        }
        let mut env = make(&fixture.env_id).expect("spec() accepted this id");
        for (k, traj) in fixture.trajectories.iter().enumerate() {
            match replay(env.as_mut(), traj) {
                Ok(n) => {
                    replayed_trajectories += 1;
                    replayed_steps += n;
                }
                Err(msg) => {
                    let _ = writeln!(
                        failures,
                        "{name} ({} gymnasium {}): trajectory {k}: {msg}",
                        fixture.env_id, fixture.gymnasium_version
                    );
                }
            }
        }
    }
    assert!(failures.is_empty(), "fixture replay diverged:\n{failures}");
    assert!(replayed_steps > 0, "fixtures contain no steps");
    eprintln!(
        "replayed {replayed_trajectories} trajectories / {replayed_steps} steps from {} files",
        files.len()
    );
}

fn load(path: &Path) -> Fixture {
    let text = std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("cannot parse {}: {e}", path.display()))
}
