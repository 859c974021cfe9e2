//! Observation and reward normalisation (`normalize:`) through the whole
//! stack, against real nats-server and redis-server: the shipped presets
//! `configs/mountaincar-ppo.yaml` and `configs/pendulum-ppo.yaml` (rl-zoo's
//! `normalize: true`; Pendulum with smaller updates) with the services in
//! process.
//!
//! Checked: every weights version carries the run's statistics, whose
//! counts grow as the env-runner's deltas are merged (observations and
//! returns in step: every env step adds one of each, plus the env-runner's
//! first observations); each evaluation is exactly what the version's
//! weights and statistics, frozen, give on the evaluator's seeds, in raw
//! returns (on Pendulum, whose continuous actions follow every change of
//! the input, the same weights with other statistics give other returns,
//! so the match is not an accident); the last checkpoint holds statistics
//! at least as far along as the last version; a learner resumed from it
//! publishes them again.

use std::time::{Duration, Instant};

use futures::StreamExt;
use relay_config::ExperimentConfig;
use relay_kit::{ServiceConfig, Shutdown};
use relay_nn::{ActorCritic, VecNormalize};
use relay_proto::{EvalReport, Subjects, WeightsUpdate};
use relay_testkit::{NatsServer, RedisServer, TempDir};

const INIT_COUNT: f64 = 1e-4;

fn preset(
    file: &str,
    run_id: &str,
    dir: &TempDir,
    nats: &NatsServer,
    redis: &RedisServer,
    extra: &[&str],
) -> ExperimentConfig {
    let path = format!("{}/../../configs/{file}", env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(&path).unwrap();
    let mut overrides = vec![
        format!("run.id={run_id}"),
        format!("run.runs_dir={}", dir.path().join("runs").display()),
        format!("connections.nats_url={}", nats.url()),
        format!("connections.redis_url={}", redis.url()),
        "eval.episodes=3".into(),
        "eval.every_versions=2".into(),
        "ppo.checkpoint_every=2".into(),
    ];
    overrides.extend(extra.iter().map(|s| s.to_string()));
    ExperimentConfig::from_layers(&text, &path, &[], &overrides).unwrap()
}

/// The model and frozen normaliser of a weights version, as the evaluator builds them.
fn policy_of(cfg: &ExperimentConfig, update: &WeightsUpdate) -> (ActorCritic, VecNormalize) {
    let spec = relay_policy::spec_for(cfg).unwrap();
    let mut model = ActorCritic::with_layout(&spec, cfg.policy.trunk, cfg.run.seed).unwrap();
    let weights = relay_policy::PolicyWeights::from_update(
        update,
        update
            .weights
            .inline
            .as_ref()
            .expect("the preset's policy travels inline"),
    )
    .unwrap();
    relay_policy::load_weights(&mut model, &weights).unwrap();
    let normalizer = relay_policy::frozen_normalizer(
        cfg,
        spec.obs_dim,
        update.version,
        update.normalizer.as_ref(),
    )
    .unwrap()
    .expect("the preset normalises");
    (model, normalizer)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mountaincar_normalised_run_ships_merges_checkpoints_and_freezes_its_statistics() {
    let nats = NatsServer::start().unwrap();
    let redis = RedisServer::start().unwrap();
    let dir = TempDir::new("normalize-mc");
    let run_id = "normalize-mountaincar";
    let cfg = preset("mountaincar-ppo.yaml", run_id, &dir, &nats, &redis, &[]);
    let stats = normalised_run(&cfg, &nats, &dir, 6, false).await;
    // MountainCar positions lie in [-1.2, 0.6], speeds in [-0.07, 0.07].
    assert!((-1.2..0.6).contains(&stats.obs.mean[0]), "{stats:?}");
    assert!(stats.obs.var[1] < 0.07 * 0.07, "{stats:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pendulum_normalised_run_evaluates_with_exactly_its_versions_statistics() {
    let nats = NatsServer::start().unwrap();
    let redis = RedisServer::start().unwrap();
    let dir = TempDir::new("normalize-pendulum");
    let run_id = "normalize-pendulum";
    let cfg = preset(
        "pendulum-ppo.yaml",
        run_id,
        &dir,
        &nats,
        &redis,
        &[
            "ppo.rollout_steps=1024",
            "ppo.epochs=2",
            "ppo.minibatch_size=256",
        ],
    );
    let stats = normalised_run(&cfg, &nats, &dir, 4, true).await;
    // cos and sin of the angle lie in [-1, 1].
    assert!(
        stats.obs.mean[0].abs() <= 1.0 && stats.obs.var[1] <= 1.0,
        "{stats:?}"
    );
}

/// Trains `cfg` until `min_versions` versions were published and a version
/// of at least 2 was evaluated, checks what the module docs say, and returns the
/// statistics of the last version seen. `sensitive`: the env's returns
/// change with any change of the normalised input (continuous actions).
async fn normalised_run(
    cfg: &ExperimentConfig,
    nats: &NatsServer,
    dir: &TempDir,
    min_versions: usize,
    sensitive: bool,
) -> relay_proto::NormStats {
    let run_id = cfg.run_id().unwrap().to_string();
    let obs_dim = relay_policy::spec_for(cfg).unwrap().obs_dim;
    let norm = cfg.normalizer().expect("the preset normalises");
    assert!(norm.norm_obs && norm.norm_reward);
    assert_eq!(norm.gamma, cfg.ppo.gamma);

    let client = async_nats::connect(nats.url()).await.unwrap();
    let subjects = Subjects::new(&run_id);
    let mut weights_sub = client.subscribe(subjects.weights()).await.unwrap();
    let mut eval_sub = client.subscribe(subjects.eval()).await.unwrap();
    client.flush().await.unwrap();

    let (trigger, shutdown) = Shutdown::new();
    let config = || ServiceConfig::for_test(cfg.clone());
    let tasks = vec![
        tokio::spawn(relay_replay_buffer::run(config(), shutdown.clone())),
        tokio::spawn(relay_inference_server::run(config(), shutdown.clone())),
        tokio::spawn(relay_evaluator::run(config(), shutdown.clone())),
        tokio::spawn(relay_env_runner::run(config(), shutdown.clone())),
        tokio::spawn(relay_learner::run(config(), shutdown.clone())),
    ];

    let mut versions: Vec<WeightsUpdate> = Vec::new();
    let mut evals: Vec<EvalReport> = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(50);
    while Instant::now() < deadline {
        if versions.len() >= min_versions && evals.iter().any(|e| e.policy_version >= 2) {
            break;
        }
        tokio::select! {
            Some(m) = weights_sub.next() => {
                versions.push(relay_proto::decode(&m.payload).unwrap());
            }
            Some(m) = eval_sub.next() => {
                evals.push(relay_proto::decode(&m.payload).unwrap());
            }
            _ = tokio::time::sleep(Duration::from_millis(200)) => {}
        }
    }
    trigger.trigger();
    for task in tasks {
        tokio::time::timeout(Duration::from_secs(15), task)
            .await
            .expect("service stops")
            .unwrap()
            .unwrap();
    }
    assert!(
        versions.len() >= min_versions,
        "only {} versions",
        versions.len()
    );

    // Every version carries the statistics; the counts grow with training.
    let counts: Vec<(u64, u64, f64, f64)> = versions
        .iter()
        .map(|w| {
            let s = w
                .normalizer
                .as_ref()
                .expect("statistics with every version");
            assert_eq!(s.obs.mean.len(), obs_dim);
            (w.version, w.learner_env_steps, s.obs.count, s.ret.count)
        })
        .collect();
    println!("(version, env steps trained, obs count, return count): {counts:?}");
    for pair in counts.windows(2) {
        assert!(pair[1].2 >= pair[0].2, "obs count went back: {pair:?}");
    }
    let (first, last) = (counts[0], *counts.last().unwrap());
    assert!(
        last.2 > first.2 + 3.0 * cfg.ppo.rollout_steps as f64,
        "{first:?} -> {last:?}"
    );
    let num_envs = cfg.env_runner.num_envs as f64;
    for &(version, trained, obs, ret) in &counts[1..] {
        // Everything trained on was merged (stale fragments are merged too).
        assert!(
            obs - INIT_COUNT >= trained as f64,
            "v{version}: {obs} < {trained}"
        );
        // Each env step adds one observation and one return; the env-runner's
        // first observations (one per env) have no return.
        assert!(
            ((obs - INIT_COUNT) - (ret - INIT_COUNT) - num_envs).abs() < 1e-6,
            "v{version}: obs count {obs}, return count {ret}"
        );
    }
    let stats = versions.last().unwrap().normalizer.clone().unwrap();

    // Each evaluation is the version's policy with its statistics frozen, in raw returns.
    let evaluated: Vec<&EvalReport> = evals.iter().filter(|e| e.policy_version >= 1).collect();
    assert!(
        !evaluated.is_empty(),
        "no evaluation of a trained version: {evals:?}"
    );
    for report in evaluated {
        let update = versions
            .iter()
            .find(|w| w.version == report.policy_version)
            .expect("the evaluated version was published");
        let (model, normalizer) = policy_of(cfg, update);
        let before = normalizer.clone();
        let episodes = relay_evaluator::plugins::play(
            &model,
            Some(&normalizer),
            relay_evaluator::plugins::eval_envs(
                &cfg.run.env_id,
                &cfg.env,
                cfg.eval.episodes,
                cfg.eval.seed,
            )
            .unwrap(),
            cfg.eval.seed,
            true,
            false,
        )
        .unwrap();
        assert_eq!(normalizer, before);
        let returns: Vec<f64> = episodes.iter().map(|e| e.ret).collect();
        assert_eq!(returns, report.returns, "v{}", report.policy_version);
        if sensitive {
            // The same weights with the first version's statistics play otherwise.
            let (_, prior) = policy_of(cfg, &versions[0]);
            let other = relay_evaluator::plugins::play(
                &model,
                Some(&prior),
                relay_evaluator::plugins::eval_envs(
                    &cfg.run.env_id,
                    &cfg.env,
                    cfg.eval.episodes,
                    cfg.eval.seed,
                )
                .unwrap(),
                cfg.eval.seed,
                true,
                false,
            )
            .unwrap();
            let other: Vec<f64> = other.iter().map(|e| e.ret).collect();
            assert_ne!(other, report.returns, "v{}", report.policy_version);
        }
        // Raw returns: the env's own (MountainCar: -1 a step, at most 200
        // steps; Pendulum: between -16.3 x 200 and 0).
        for r in &report.returns {
            if cfg.run.env_id == "MountainCar-v0" {
                assert!(r.fract() == 0.0 && (-200.0..=-1.0).contains(r), "{r}");
            } else {
                assert!((-16.3 * 200.0..=0.0).contains(r), "{r}");
            }
        }
    }

    // The last checkpoint holds the statistics, at least as far along as the last version.
    let last_dir = dir
        .path()
        .join("runs")
        .join(&run_id)
        .join("checkpoints/last");
    let mut saved = VecNormalize::new(norm, obs_dim, 0).unwrap();
    saved
        .load(last_dir.join("vec_normalize.safetensors"))
        .expect("statistics in the checkpoint");
    assert!(
        saved.obs_rms.count >= last.2,
        "{} < {}",
        saved.obs_rms.count,
        last.2
    );
    assert!(
        ((saved.obs_rms.count - saved.ret_rms.count) - num_envs).abs() < 1e-6,
        "{saved:?}"
    );

    // A learner resumed from that checkpoint publishes the same statistics
    // (its first version is one above any version published).
    let published =
        relay_learner::checkpoint::published_version(&dir.path().join("runs").join(&run_id));
    assert!(published >= last.0);
    let mut resumed_cfg = cfg.clone();
    resumed_cfg.run.resume_from = Some(last_dir.canonicalize().unwrap());
    let (trigger, shutdown) = Shutdown::new();
    let learner = tokio::spawn(relay_learner::run(
        ServiceConfig::for_test(resumed_cfg.clone()),
        shutdown.clone(),
    ));
    let resumed: WeightsUpdate = tokio::time::timeout(Duration::from_secs(20), async {
        loop {
            let m = weights_sub.next().await.expect("subscription open");
            let w: WeightsUpdate = relay_proto::decode(&m.payload).unwrap();
            if w.version > published {
                break w;
            }
        }
    })
    .await
    .expect("the resumed learner publishes");
    trigger.trigger();
    tokio::time::timeout(Duration::from_secs(15), learner)
        .await
        .expect("learner stops")
        .unwrap()
        .unwrap();
    let (_, restored) = policy_of(&resumed_cfg, &resumed);
    assert_eq!(restored.obs_rms.count, saved.obs_rms.count);
    assert_eq!(restored.ret_rms.count, saved.ret_rms.count);
    assert_eq!(restored.obs_rms.mean, saved.obs_rms.mean);
    assert_eq!(restored.obs_rms.var, saved.obs_rms.var);
    assert_eq!(restored.ret_rms.var, saved.ret_rms.var);
    stats
}
