//! A recurrent policy's state through the distributed stack, against a
//! real nats-server and real inference servers: an env-runner steps
//! CartPoleNoVel-v1 with an LSTM policy, keeps each env's state, and sends
//! fragments to a stand-in replay buffer (two runners share the server, so
//! its batches mix their rows); halfway through, the inference
//! server is stopped and another one started (mid-episode for most envs).
//!
//! Every fragment must be reproduced exactly by the learner's computation
//! in one process: the same weights, unrolled from the fragment's
//! `initial_state` over its steps with the state zeroed at each episode
//! start, give the log-probability and value the env-runner recorded for
//! every step. A state handed to the wrong env, not reset at an episode's
//! end, or lost at the restart changes them.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use relay_config::ExperimentConfig;
use relay_kit::{ServiceConfig, Shutdown};
use relay_nn::ActorCritic;
use relay_proto::RolloutFragment;
use relay_testkit::NatsServer;
use support::{spawn_stand_in_learner, spawn_stand_in_replay};

mod support;

const RUN: &str = "recurrent";
const ENVS: usize = 4;
const STEPS: usize = 16;

async fn wait_for_fragments(stored: &Mutex<Vec<RolloutFragment>>, n: usize) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while stored.lock().unwrap().len() < n {
        assert!(
            tokio::time::Instant::now() < deadline,
            "only {} fragments in 60 s",
            stored.lock().unwrap().len()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The learner's view of `fragment`: log-probabilities and values of its
/// actions, replayed from its initial state.
fn replay(model: &ActorCritic, fragment: &RolloutFragment) -> (Vec<f32>, Vec<f32>) {
    let (t, n) = (fragment.num_steps as usize, fragment.num_envs as usize);
    let device = candle_core::Device::Cpu;
    let obs = fragment.obs.to_f32().unwrap();
    let obs = candle_core::Tensor::from_vec(obs, (t * n, 4), &device).unwrap();
    let actions: Vec<u32> = fragment
        .actions
        .to_i64()
        .unwrap()
        .into_iter()
        .map(|a| a as u32)
        .collect();
    let actions = candle_core::Tensor::from_vec(actions, t * n, &device).unwrap();
    let initial = fragment
        .initial_state
        .as_ref()
        .expect("a recurrent fragment carries its initial state");
    let width = model.state_width();
    let initial =
        candle_core::Tensor::from_vec(initial.to_f32().unwrap(), (n, width), &device).unwrap();
    let ended: Vec<bool> = fragment
        .terminated
        .to_bool()
        .unwrap()
        .iter()
        .zip(fragment.truncated.to_bool().unwrap())
        .map(|(&term, trunc)| term || trunc)
        .collect();
    let starts: Vec<bool> = (0..t * n).map(|row| row >= n && ended[row - n]).collect();
    let (logprobs, _, values) = model
        .evaluate_sequences(&obs, t, &starts, &initial, &actions, None)
        .unwrap();
    (logprobs.to_vec1().unwrap(), values.to_vec1().unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_fragment_replays_from_its_state_across_resets_and_a_server_restart() {
    let nats = NatsServer::start().unwrap();
    let yaml = format!(
        "run:\n  id: {RUN}\n  env_id: CartPoleNoVel-v1\n  seed: 9\nconnections:\n  nats_url: {}\n  request_timeout_ms: 1000\npolicy:\n  hidden: [16]\n  recurrent: {{cell: lstm, hidden: 8, layers: 1}}\nenv_runner:\n  num_envs: {ENVS}\n  fragment_steps: {STEPS}\n",
        nats.url()
    );
    let experiment = ExperimentConfig::from_layers(&yaml, "test", &[], &[]).unwrap();
    let model = ActorCritic::new(&relay_policy::spec_for(&experiment).unwrap(), 3).unwrap();
    assert_eq!(
        model.state_width(),
        2 * 2 * 8,
        "LSTM h and c, actor and critic"
    );
    let client = async_nats::connect(nats.url()).await.unwrap();
    spawn_stand_in_learner(client.clone(), RUN, &model);
    let stored = Arc::new(Mutex::new(Vec::new()));
    spawn_stand_in_replay(client.clone(), RUN, stored.clone());

    let serve = || {
        let (trigger, shutdown) = Shutdown::new();
        let server = tokio::spawn(relay_inference_server::run(
            ServiceConfig::for_test(experiment.clone()),
            shutdown,
        ));
        (trigger, server)
    };
    let (stop_first, first) = serve();
    let (stop_runner, runner_shutdown) = Shutdown::new();
    // Two runners: the server batches their requests together, and each
    // row's state must come back to the env it belongs to.
    let runners: Vec<_> = (0..2)
        .map(|_| {
            tokio::spawn(relay_env_runner::run(
                ServiceConfig::for_test(experiment.clone()),
                runner_shutdown.clone(),
            ))
        })
        .collect();

    wait_for_fragments(&stored, 6).await;
    stop_first.trigger();
    first.await.unwrap().unwrap();
    // The runner waits for a server (its requests go unanswered meanwhile).
    tokio::time::sleep(Duration::from_millis(300)).await;
    let before_restart = stored.lock().unwrap().len();
    let (stop_second, second) = serve();
    wait_for_fragments(&stored, before_restart + 8).await;
    stop_runner.trigger();
    for runner in runners {
        runner.await.unwrap().unwrap();
    }
    stop_second.trigger();
    second.await.unwrap().unwrap();

    let fragments = stored.lock().unwrap().clone();
    let mut episode_ends = 0;
    let mut mid_episode_starts = 0;
    for (k, fragment) in fragments.iter().enumerate() {
        assert_eq!(fragment.num_steps as usize, STEPS);
        let (logprobs, values) = replay(&model, fragment);
        let recorded_logprobs = fragment.logprobs.to_f32().unwrap();
        let recorded_values = fragment.values.to_f32().unwrap();
        for row in 0..logprobs.len() {
            assert!(
                (logprobs[row] - recorded_logprobs[row]).abs() < 1e-4
                    && (values[row] - recorded_values[row]).abs() < 1e-4,
                "fragment {k}, step {}, env {}: replayed logprob {} value {}, acted with {} and {}",
                row / ENVS,
                row % ENVS,
                logprobs[row],
                values[row],
                recorded_logprobs[row],
                recorded_values[row]
            );
        }
        episode_ends += fragment
            .terminated
            .to_bool()
            .unwrap()
            .iter()
            .filter(|&&e| e)
            .count();
        let initial = fragment.initial_state.as_ref().unwrap().to_f32().unwrap();
        mid_episode_starts += initial
            .chunks(model.state_width())
            .filter(|s| s.iter().any(|&v| v != 0.0))
            .count();
    }
    // The check covered resets inside fragments and fragments that begin
    // mid-episode (a non-zero initial state).
    assert!(episode_ends >= 4, "only {episode_ends} episodes ended");
    assert!(
        mid_episode_starts >= 4,
        "only {mid_episode_starts} fragments began mid-episode"
    );
}
