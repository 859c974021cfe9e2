//! gSDE's held noise through the distributed stack, against a real
//! nats-server: an env-runner steps Pendulum-v1 with a `policy.use_sde`
//! policy whose exploration matrix is drawn once a fragment, and two
//! inference servers share its act requests. Every fragment is sent to a
//! stand-in replay buffer and checked against the model in one process:
//!
//! - the learner's distribution: the log-probability the env-runner
//!   recorded is the one `evaluate` gives the action;
//! - the noise is held: within a fragment, each env's noise
//!   (`action - mean`) is `z_t · w` for one vector `w` (its exploration
//!   matrix times `exp(log_std)`), `z_t` the actor's hidden layer, whichever
//!   server acted the step; envs and fragments get their own `w`.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use relay_config::ExperimentConfig;
use relay_kit::{ServiceConfig, Shutdown};
use relay_nn::{Actions, ActorCritic};
use relay_testkit::NatsServer;
use support::{spawn_stand_in_learner, spawn_stand_in_replay};

mod support;

const RUN: &str = "gsde";
const ENVS: usize = 2;
const STEPS: usize = 12;
const HIDDEN: usize = 3;

/// The actor's hidden layer `tanh(W x + b)` of each row of `obs`.
fn latent(model: &ActorCritic, obs: &[f32]) -> Vec<[f64; HIDDEN]> {
    let tensors = model.named_tensors();
    let get = |name: &str| {
        tensors
            .iter()
            .find(|(n, _, _)| n == name)
            .map(|(_, _, v)| v.clone())
            .unwrap()
    };
    let (w, b) = (
        get("mlp_extractor.policy_net.0.weight"),
        get("mlp_extractor.policy_net.0.bias"),
    );
    obs.chunks(3)
        .map(|x| {
            std::array::from_fn(|i| {
                let pre: f32 = b[i] + (0..3).map(|k| w[i * 3 + k] * x[k]).sum::<f32>();
                f64::from(pre.tanh())
            })
        })
        .collect()
}

/// The least-squares `w` of `noise_t = z_t · w` and its largest residual.
fn fit(z: &[[f64; HIDDEN]], noise: &[f64]) -> ([f64; HIDDEN], f64) {
    let mut a = [[0f64; HIDDEN + 1]; HIDDEN];
    for (zt, &e) in z.iter().zip(noise) {
        for i in 0..HIDDEN {
            for j in 0..HIDDEN {
                a[i][j] += zt[i] * zt[j];
            }
            a[i][HIDDEN] += zt[i] * e;
        }
    }
    // Gauss-Jordan on the normal equations (positive definite here).
    for c in 0..HIDDEN {
        let p = a[c][c];
        for v in a[c].iter_mut() {
            *v /= p;
        }
        for r in 0..HIDDEN {
            if r != c {
                let f = a[r][c];
                let pivot = a[c];
                for (v, pv) in a[r].iter_mut().zip(pivot) {
                    *v -= f * pv;
                }
            }
        }
    }
    let w: [f64; HIDDEN] = std::array::from_fn(|i| a[i][HIDDEN]);
    let residual = z
        .iter()
        .zip(noise)
        .map(|(zt, &e)| (e - zt.iter().zip(&w).map(|(a, b)| a * b).sum::<f64>()).abs())
        .fold(0.0, f64::max);
    (w, residual)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_env_keeps_its_exploration_matrix_across_servers_for_a_fragment() {
    let nats = NatsServer::start().unwrap();
    let yaml = format!(
        "run:\n  id: {RUN}\n  env_id: Pendulum-v1\n  seed: 5\nconnections:\n  nats_url: {}\n  request_timeout_ms: 1000\npolicy:\n  hidden: [{HIDDEN}]\n  use_sde: true\n  sde_sample_freq: -1\nenv_runner:\n  num_envs: {ENVS}\n  fragment_steps: {STEPS}\n",
        nats.url()
    );
    let experiment = ExperimentConfig::from_layers(&yaml, "test", &[], &[]).unwrap();
    let model = ActorCritic::new(&relay_policy::spec_for(&experiment).unwrap(), 3).unwrap();
    let client = async_nats::connect(nats.url()).await.unwrap();
    spawn_stand_in_learner(client.clone(), RUN, &model);
    let stored = Arc::new(Mutex::new(Vec::new()));
    spawn_stand_in_replay(client.clone(), RUN, stored.clone());

    let (stop, shutdown) = Shutdown::new();
    let mut services: Vec<_> = (0..2)
        .map(|_| {
            tokio::spawn(relay_inference_server::run(
                ServiceConfig::for_test(experiment.clone()),
                shutdown.clone(),
            ))
        })
        .collect();
    services.push(tokio::spawn(relay_env_runner::run(
        ServiceConfig::for_test(experiment.clone()),
        shutdown.clone(),
    )));
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while stored.lock().unwrap().len() < 4 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "no 4 fragments in 60 s"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    stop.trigger();
    for service in services {
        service.await.unwrap().unwrap();
    }

    let device = candle_core::Device::Cpu;
    let mut rng = <rand::rngs::StdRng as rand::SeedableRng>::seed_from_u64(0);
    let mut matrices: Vec<[f64; HIDDEN]> = Vec::new();
    for (k, fragment) in stored.lock().unwrap().iter().enumerate() {
        let rows = STEPS * ENVS;
        let obs = fragment.obs.to_f32().unwrap();
        let actions = fragment.actions.to_f32().unwrap();
        let x = candle_core::Tensor::from_vec(obs.clone(), (rows, 3), &device).unwrap();
        let a = candle_core::Tensor::from_vec(actions.clone(), (rows, 1), &device).unwrap();
        let (logprobs, _, _) = model.evaluate(&x, &a).unwrap();
        let recorded = fragment.logprobs.to_f32().unwrap();
        for (row, (got, acted)) in logprobs
            .to_vec1::<f32>()
            .unwrap()
            .iter()
            .zip(&recorded)
            .enumerate()
        {
            assert!(
                (got - acted).abs() < 1e-4 * (1.0 + acted.abs()),
                "fragment {k} row {row}: learner's logprob {got}, acted with {acted}"
            );
        }
        let Actions::Continuous(means) = model.act(&obs, rows, true, &mut rng).unwrap().actions
        else {
            panic!("continuous actions")
        };
        let z = latent(&model, &obs);
        for env in 0..ENVS {
            let steps: Vec<usize> = (0..STEPS).map(|t| t * ENVS + env).collect();
            let noise: Vec<f64> = steps
                .iter()
                .map(|&r| f64::from(actions[r] - means[r]))
                .collect();
            let zs: Vec<[f64; HIDDEN]> = steps.iter().map(|&r| z[r]).collect();
            let (w, residual) = fit(&zs, &noise);
            let scale = noise.iter().map(|e| e.abs()).fold(0.0, f64::max);
            assert!(scale > 1e-2, "fragment {k} env {env}: no noise ({noise:?})");
            assert!(
                residual < 1e-3 * (1.0 + scale),
                "fragment {k} env {env}: the noise is not one matrix's over the fragment \
                 (residual {residual}, noise {noise:?})"
            );
            matrices.push(w);
        }
    }
    for (i, a) in matrices.iter().enumerate() {
        for b in &matrices[..i] {
            let differ = a.iter().zip(b).any(|(x, y)| (x - y).abs() > 1e-3);
            assert!(
                differ,
                "two env-fragments share an exploration matrix: {a:?}"
            );
        }
    }
}
