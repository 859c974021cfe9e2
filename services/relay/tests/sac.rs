//! SAC through the whole stack, against real nats-server and redis-server:
//! every service in process with the shipped preset
//! (`configs/pendulum-sac.yaml`) made tiny (narrow networks, small batches,
//! a budget of a few hundred env steps), then resumed from its last
//! checkpoint. It does not try to solve Pendulum: it checks that the actor
//! is published once per round, the off-policy table fills, training moves
//! the entropy coefficient and the actor, greedy evaluations are reported,
//! and a checkpoint carries every network, the three Adam states and the
//! counters into the resumed run, which trains with two learner replicas.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, Instant};

use futures::StreamExt;
use relay_config::ExperimentConfig;
use relay_kit::{ServiceConfig, Shutdown};
use relay_nn::{Adam, AdamConfig, Sac, SacActor};
use relay_proto::{EvalReport, MetricsReport, RunStatus, RunStatusUpdate, Subjects, WeightsUpdate};
use relay_testkit::{NatsServer, RedisServer, TempDir};

const RUN: &str = "sac-e2e";

/// What one stack run showed on the wire.
#[derive(Default)]
struct Observed {
    versions: Vec<(u64, u64)>,
    evals: Vec<EvalReport>,
    learner: BTreeMap<String, Vec<f64>>,
    finished: Option<String>,
}

fn config(
    nats: &NatsServer,
    redis: &RedisServer,
    runs: &Path,
    extra: &[String],
) -> ExperimentConfig {
    let path = format!(
        "{}/../../configs/pendulum-sac.yaml",
        env!("CARGO_MANIFEST_DIR")
    );
    let text = std::fs::read_to_string(&path).unwrap();
    let mut overrides: Vec<String> = vec![
        format!("run.id={RUN}"),
        format!("run.runs_dir={}", runs.display()),
        format!("connections.nats_url={}", nats.url()),
        format!("connections.redis_url={}", redis.url()),
        "run.stop_when_solved=false".into(),
        "sac.net_arch=[32, 32]".into(),
        "sac.batch_size=32".into(),
        "sac.learning_starts=64".into(),
        "sac.train_freq=8".into(),
        "sac.gradient_steps=4".into(),
        "sac.checkpoint_every=10".into(),
        // gradient_steps x batch_size / train_freq, two fragments of slack.
        "replay.samples_per_insert=16".into(),
        "replay.min_size_to_sample=64".into(),
        "replay.rate_error_buffer=8192".into(),
        "eval.episodes=2".into(),
        "eval.every_versions=5".into(),
        "eval.every_seconds=1".into(),
    ];
    overrides.extend(extra.iter().cloned());
    ExperimentConfig::from_layers(&text, &path, &[], &overrides).unwrap()
}

/// Runs the six services until the learner announces the end of training
/// and an evaluation of a trained version came in (or 50 s pass).
async fn run_stack(nats: &NatsServer, cfg: &ExperimentConfig) -> Observed {
    let (trigger, shutdown) = Shutdown::new();
    let client = async_nats::connect(nats.url()).await.unwrap();
    let subjects = Subjects::new(RUN);
    let mut eval_sub = client.subscribe(subjects.eval()).await.unwrap();
    let mut metric_sub = client.subscribe(subjects.metrics()).await.unwrap();
    let mut weights_sub = client.subscribe(subjects.weights()).await.unwrap();
    let mut status_sub = client.subscribe(subjects.status()).await.unwrap();
    let service = || ServiceConfig::for_test(cfg.clone());
    let mut tasks = vec![
        tokio::spawn(relay_tracker::run(service(), shutdown.clone())),
        tokio::spawn(relay_replay_buffer::run(service(), shutdown.clone())),
        tokio::spawn(relay_inference_server::run(service(), shutdown.clone())),
        tokio::spawn(relay_evaluator::run(service(), shutdown.clone())),
        tokio::spawn(relay_env_runner::run(service(), shutdown.clone())),
    ];
    for _ in 0..cfg.learner.replicas {
        tasks.push(tokio::spawn(relay_learner::run(
            service(),
            shutdown.clone(),
        )));
    }
    let mut seen = Observed::default();
    let deadline = Instant::now() + Duration::from_secs(50);
    while Instant::now() < deadline {
        let trained_eval = seen.evals.iter().any(|e| e.policy_version >= 1);
        if seen.finished.is_some() && trained_eval {
            break;
        }
        tokio::select! {
            Some(m) = eval_sub.next() => {
                seen.evals.push(relay_proto::decode(&m.payload).unwrap());
            }
            Some(m) = metric_sub.next() => {
                if let Ok(r) = relay_proto::decode::<MetricsReport>(&m.payload) {
                    for v in r.values.into_iter().filter(|v| v.name.starts_with("learner_")) {
                        seen.learner.entry(v.name).or_default().push(v.value);
                    }
                }
            }
            Some(m) = weights_sub.next() => {
                let w: WeightsUpdate = relay_proto::decode(&m.payload).unwrap();
                // The actor only: the critics stay in the learner.
                let bytes = w.weights.inline.as_ref().expect("a SAC actor travels inline");
                let tensors = relay_policy::PolicyWeights::from_update(&w, bytes).unwrap().tensors;
                assert!(tensors.iter().all(|t| t.0.starts_with("actor.")), "{:?}",
                    tensors.iter().map(|t| &t.0).collect::<Vec<_>>());
                seen.versions.push((w.version, w.learner_env_steps));
            }
            Some(m) = status_sub.next() => {
                let s: RunStatusUpdate = relay_proto::decode(&m.payload).unwrap();
                if s.service == "learner" && s.status == RunStatus::Stopped {
                    seen.finished = Some(s.detail);
                }
            }
            _ = tokio::time::sleep(Duration::from_millis(200)) => {}
        }
    }
    println!(
        "{} versions (last {:?}), {} evals, finished: {:?}, learner env steps {:?}",
        seen.versions.len(),
        seen.versions.last(),
        seen.evals.len(),
        seen.finished,
        seen.learner.get("learner_env_steps").and_then(|v| v.last())
    );
    trigger.trigger();
    for task in tasks {
        tokio::time::timeout(Duration::from_secs(15), task)
            .await
            .expect("service stops")
            .unwrap()
            .unwrap();
    }
    seen
}

fn finite(seen: &Observed, name: &str) -> Vec<f64> {
    let values = seen
        .learner
        .get(name)
        .unwrap_or_else(|| panic!("{name} not reported: {:?}", seen.learner.keys()))
        .clone();
    assert!(values.iter().all(|v| v.is_finite()), "{name}: {values:?}");
    values
}

/// The checkpoint's networks, Adam steps (actor, critic, ent_coef),
/// `sac.json` and `state.json`.
fn read_checkpoint(
    cfg: &ExperimentConfig,
    dir: &Path,
) -> (
    Sac,
    [u64; 3],
    relay_learner::sac::SacState,
    serde_json::Value,
) {
    let spec = relay_policy::sac_spec_for(cfg).unwrap();
    let mut sac = Sac::new(&spec, 1.0, 99).unwrap();
    sac.load(dir.join("model.safetensors")).unwrap();
    let step = |vars, file: &str| {
        let mut adam = Adam::new(vars, AdamConfig::default()).unwrap();
        adam.load(dir.join(file)).unwrap();
        adam.state().unwrap().step
    };
    let steps = [
        step(sac.actor.vars(), "optimizer.safetensors"),
        step(sac.critic.vars(), "critic_optimizer.safetensors"),
        step(
            vec![sac.log_ent_coef.clone()],
            "ent_coef_optimizer.safetensors",
        ),
    ];
    let state = relay_learner::sac::load_sac_state(dir).unwrap();
    let counters: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("state.json")).unwrap()).unwrap();
    (sac, steps, state, counters)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sac_trains_pendulum_publishes_the_actor_and_resumes_from_a_checkpoint() {
    let nats = NatsServer::start().unwrap();
    let redis = RedisServer::start().unwrap();
    let dir = TempDir::new("sac");
    let runs = dir.path().join("runs");
    // Versions held back: a round's published at most every 500 ms.
    let cfg = config(
        &nats,
        &redis,
        &runs,
        &[
            "run.total_env_steps=256".into(),
            "learner.publish_interval_ms=500".into(),
        ],
    );
    assert_eq!(cfg.algo_name(), "sac");

    // --- a fresh run to its budget -------------------------------------
    let first = run_stack(&nats, &cfg).await;
    let detail = first.finished.clone().expect("the learner finished");
    assert!(detail.contains("budget"), "{detail}");
    // Versions in order, trained ones after learning_starts.
    let versions = &first.versions;
    assert!(versions.len() >= 2, "{versions:?}");
    assert!(versions
        .windows(2)
        .all(|w| w[1].0 > w[0].0 && w[1].1 >= w[0].1));
    if let Some((_, steps)) = versions.iter().find(|(v, _)| *v >= 1) {
        assert!(*steps > cfg.sac.learning_starts, "{versions:?}");
    }
    for name in [
        "learner_policy_loss",
        "learner_value_loss",
        "learner_ent_coef_loss",
        "learner_entropy",
        "learner_q_mean",
        "learner_learning_rate",
    ] {
        finite(&first, name);
    }
    // The table fills: at least learning_starts transitions by the end.
    let size = finite(&first, "learner_replay_size");
    assert!(*size.last().unwrap() >= 64.0, "{size:?}");
    // α is tuned: it starts at 1 and moves every step (down: the initial
    // actor's entropy is above the target -1).
    let alpha = finite(&first, "learner_ent_coef");
    assert!(
        alpha[0] <= 1.0 && alpha.last().unwrap() < &alpha[0],
        "{alpha:?}"
    );
    // Greedy evaluations of trained versions, two episodes each.
    assert!(first.evals.iter().any(|e| e.policy_version >= 1));
    assert!(first
        .evals
        .iter()
        .all(|e| e.returns.len() == 2 && e.mean_return.is_finite()));

    // The final checkpoint: every network, three Adam states, counters.
    let run_dir = runs.join(RUN);
    let last = run_dir.join("checkpoints/last");
    let (sac, steps, state, counters) = read_checkpoint(&cfg, &last);
    // Every round due within the budget ran (at 72, 80, ..., 256), even
    // with the env-runner ahead of the learner.
    assert_eq!(state.rounds, (256 - 72) / 8 + 1, "{state:?}");
    assert_eq!(state.gradient_steps, state.rounds * 4, "{state:?}");
    assert_eq!(state.target_updates, state.gradient_steps, "{state:?}");
    assert_eq!(steps, [state.gradient_steps; 3], "Adam steps");
    assert_eq!(counters["updates"], state.rounds);
    let saved_alpha = sac.ent_coef().unwrap() as f64;
    assert!(saved_alpha < alpha[0], "{saved_alpha} vs {alpha:?}");
    // The actor moved away from its initialisation.
    let spec = relay_policy::sac_spec_for(&cfg).unwrap();
    let init = SacActor::new(&spec, cfg.run.seed).unwrap();
    let obs = [0.3f32, -0.2, 0.5];
    let mut rng = <rand_chacha::ChaCha8Rng as rand::SeedableRng>::seed_from_u64(0);
    let a0 = init.act(&obs, 1, true, &mut rng).unwrap();
    let a1 = sac.actor.act(&obs, 1, true, &mut rng).unwrap();
    assert_ne!(a0, a1);
    assert!(a1[0].abs() <= 2.0, "{a1:?}");
    let saved_version = counters["version"].as_u64().unwrap();
    // Fewer versions than rounds went out, and the last round's always.
    assert!(versions.len() < state.rounds as usize, "{versions:?}");
    assert_eq!(versions.last().unwrap().0, saved_version, "{versions:?}");
    let saved_env_steps = counters["env_steps"].as_u64().unwrap();
    assert!(saved_env_steps >= 256, "{counters}");

    // --- resumed from it, to a larger budget ----------------------------
    let resumed_cfg = config(
        &nats,
        &redis,
        &runs,
        &[
            "run.total_env_steps=384".into(),
            format!("run.resume_from={}", last.display()),
            // Resumed with two learner replicas: both start from the
            // checkpoint rank 0 loaded, hand over at the first view.
            "learner.replicas=2".into(),
        ],
    );
    let second = run_stack(&nats, &resumed_cfg).await;
    assert!(second.finished.is_some(), "the resumed learner finished");
    // Versions continue above every version published before.
    let first_version = second.versions.first().expect("versions published").0;
    assert!(
        first_version > saved_version && first_version > versions.last().unwrap().0,
        "{:?} after {versions:?}",
        second.versions
    );
    // Counters and α continue from the checkpoint.
    let resumed_at = finite(&second, "learner_resumed_at_vec_steps");
    assert_eq!(resumed_at[0], saved_env_steps as f64);
    let alpha2 = finite(&second, "learner_ent_coef");
    assert!(
        (alpha2[0] - saved_alpha).abs() < 0.02 * saved_alpha,
        "resumed at {} but saved {saved_alpha}",
        alpha2[0]
    );
    let (_, steps2, state2, counters2) =
        read_checkpoint(&resumed_cfg, &run_dir.join("checkpoints/last"));
    assert!(state2.rounds > state.rounds, "{state2:?} after {state:?}");
    assert_eq!(steps2, [state2.gradient_steps; 3]);
    // Both replicas trained every round after the resume, in a view of 2.
    let ranks = finite(&second, "learner_replica_rank");
    assert!(ranks.contains(&0.0) && ranks.contains(&1.0), "{ranks:?}");
    assert!(finite(&second, "learner_allreduce_bytes")
        .iter()
        .any(|&b| b > 0.0));
    assert!(counters2["env_steps"].as_u64().unwrap() >= 384);
}
