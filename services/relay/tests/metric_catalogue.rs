//! The metric catalogue (`configs/metrics.yaml`) and the services agree:
//! every metric any service registers or reports is catalogued, and every
//! catalogued metric is emitted by some service during a short real run (a
//! CartPole run, and beside it a TicTacToe run (two epochs per update) of an env-runner, a
//! `vs-opponent` evaluator, a replay buffer and a learner training the
//! LoRA adapter over the tiny-qwen2 fixture, with a stand-in for the
//! inference servers' `generate` endpoint, and a DQN CartPole run and a SAC
//! Pendulum run, each of a replay buffer, an inference server, an
//! env-runner and a learner, and a PettingZoo TicTacToe self-play run with
//! the league, of the same four services).

use std::time::{Duration, Instant};

use futures::StreamExt;
use relay_config::ExperimentConfig;
use relay_kit::metrics::{emitted, Catalogue};
use relay_kit::{ServiceConfig, Shutdown};
use relay_proto::{
    decode, encode, FinishReason, GenerateReply, GenerateRequest, Prompt, Subjects, Tensor,
    SCHEMA_VERSION,
};
use relay_testkit::{NatsServer, RedisServer, TempDir};

/// A stand-in for the inference servers' `generate` endpoint (written
/// elsewhere): answers each request on the real NATS with the first move of
/// the prompt's "Available Moves" line and made-up tokens.
fn spawn_stand_in_generate(client: async_nats::Client, run_id: &str) {
    let subject = Subjects::new(run_id).generate();
    tokio::spawn(async move {
        let mut requests = client.queue_subscribe(subject, "q".into()).await.unwrap();
        while let Some(message) = requests.next().await {
            let Ok(request) = decode::<GenerateRequest>(&message.payload) else {
                continue;
            };
            let Prompt::Chat(turns) = &request.prompt else {
                continue;
            };
            let text = turns
                .last()
                .and_then(|t| {
                    t.content
                        .lines()
                        .rev()
                        .find_map(|l| l.strip_prefix("Available Moves: "))
                })
                .and_then(|moves| moves.split(", ").next())
                .unwrap_or("[0]")
                .trim_matches('\'')
                .to_string();
            let c = text.len();
            let reply = GenerateReply {
                schema: SCHEMA_VERSION,
                adapter: request.adapter.clone(),
                prompt_tokens: Tensor::from_u32(&[1], &[1]),
                completion_tokens: Tensor::from_u32(&[c], &vec![2; c]),
                logprobs: Tensor::from_f32(&[c], &vec![-1.0; c]),
                text,
                finish: FinishReason::Stop,
                answer_start: None,
            };
            if let Some(to) = message.reply {
                let _ = client.publish(to, encode(&reply).into()).await;
            }
        }
    });
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metric_catalogue_matches_what_services_emit() {
    let nats = NatsServer::start().unwrap();
    let redis = RedisServer::start().unwrap();
    let dir = TempDir::new("catalogue");
    let text = format!(
        "run:\n  id: catalogue\n  env_id: CartPole-v1\n  runs_dir: {}\n  total_env_steps: 100000\nconnections:\n  nats_url: {}\n  redis_url: {}\nreplay:\n  capacity_steps: 1024\nppo:\n  rollout_steps: 256\n  minibatch_size: 256\n  epochs: 2\neval:\n  every_versions: 1\n  episodes: 2\n  threshold: 100000\n",
        dir.path().display(),
        nats.url(),
        redis.url()
    );
    let experiment = ExperimentConfig::from_layers(&text, "test", &[], &[]).unwrap();
    let text_run = format!(
        "run:\n  id: catalogue-text\n  env_id: TicTacToe-v0\n  runs_dir: {}\nconnections:\n  nats_url: {}\n  redis_url: {}\neval:\n  evaluator: vs-opponent\n  options: {{games: 2}}\ntext:\n  opponents: {{random: 1, minimax: 1}}\n  games_in_flight: 2\nllm:\n  model: {}\nrl:\n  batch_size: 4\n  minibatch_size: 4\n  epochs: 2\n",
        dir.path().display(),
        nats.url(),
        redis.url(),
        relay_testkit::llm_fixture("tiny-qwen2").display(),
    );
    let text_experiment = ExperimentConfig::from_layers(&text_run, "test", &[], &[]).unwrap();
    spawn_stand_in_generate(
        async_nats::connect(nats.url()).await.unwrap(),
        "catalogue-text",
    );
    let (trigger, shutdown) = Shutdown::new();
    // A league pool with one game recorded, for the tracker's league series.
    let store = relay_kit::league::LeagueStore::new(
        relay_kit::connect_redis(&redis.url(), &shutdown)
            .await
            .unwrap(),
        "catalogue",
    );
    let random = relay_league::FixedOpponent {
        name: "random".into(),
        kind: relay_league::FixedKind::Random,
    };
    store
        .update(Default::default(), &[random], |pool| {
            pool.add_version(relay_league::PolicyVersion {
                version: 1,
                parent: None,
                weights_ref: "v1".into(),
            })?;
            pool.record_result(
                &relay_league::MemberId::Version(1),
                &relay_league::MemberId::Fixed("random".into()),
                relay_league::Outcome::Win,
            )
        })
        .await
        .unwrap();
    // A DQN run beside them, for the off-policy table's and DQN's series.
    let dqn_run = format!(
        "run:\n  id: catalogue-dqn\n  env_id: CartPole-v1\n  algo: dqn\n  runs_dir: {}\n  total_env_steps: 100000\nconnections:\n  nats_url: {}\n  redis_url: {}\nenv_runner:\n  num_envs: 2\n  fragment_steps: 8\ndqn:\n  learning_starts: 64\n  train_freq: 32\n  gradient_steps: 2\n  batch_size: 16\n  buffer_size: 1000\n  prioritized: true\n",
        dir.path().display(),
        nats.url(),
        redis.url()
    );
    let dqn_experiment = ExperimentConfig::from_layers(&dqn_run, "test", &[], &[]).unwrap();
    // And a SAC run, for SAC's series.
    let sac_run = format!(
        "run:\n  id: catalogue-sac\n  env_id: Pendulum-v1\n  algo: sac\n  runs_dir: {}\n  total_env_steps: 100000\nconnections:\n  nats_url: {}\n  redis_url: {}\nenv_runner:\n  num_envs: 2\n  fragment_steps: 8\nsac:\n  learning_starts: 32\n  train_freq: 16\n  batch_size: 16\n  net_arch: [16]\n",
        dir.path().display(),
        nats.url(),
        redis.url()
    );
    let sac_experiment = ExperimentConfig::from_layers(&sac_run, "test", &[], &[]).unwrap();
    // And PettingZoo TicTacToe by self-play with the league, for the
    // self-play series and the past versions the inference server builds.
    let selfplay_run = format!(
        "run:\n  id: catalogue-selfplay\n  env_id: tictactoe_v3\n  runs_dir: {}\n  total_env_steps: 100000\nconnections:\n  nats_url: {}\n  redis_url: {}\nenv:\n  backend: pettingzoo\nenv_runner:\n  num_envs: 2\n  fragment_steps: 8\nppo:\n  rollout_steps: 32\n  minibatch_size: 16\nselfplay:\n  opponents: {{league: 1, random: 1}}\nleague:\n  pool: {{admit_every: 1}}\n",
        dir.path().display(),
        nats.url(),
        redis.url()
    );
    let selfplay_experiment =
        ExperimentConfig::from_layers(&selfplay_run, "test", &[], &[]).unwrap();
    let config = || ServiceConfig::for_test(experiment.clone());
    let text_config = || ServiceConfig::for_test(text_experiment.clone());
    let dqn_config = || ServiceConfig::for_test(dqn_experiment.clone());
    let sac_config = || ServiceConfig::for_test(sac_experiment.clone());
    let selfplay_config = || ServiceConfig::for_test(selfplay_experiment.clone());
    let tasks = vec![
        tokio::spawn(relay_tracker::run(config(), shutdown.clone())),
        tokio::spawn(relay_replay_buffer::run(config(), shutdown.clone())),
        tokio::spawn(relay_inference_server::run(config(), shutdown.clone())),
        tokio::spawn(relay_evaluator::run(config(), shutdown.clone())),
        tokio::spawn(relay_env_runner::run(config(), shutdown.clone())),
        tokio::spawn(relay_learner::run(config(), shutdown.clone())),
        tokio::spawn(relay_env_runner::run(text_config(), shutdown.clone())),
        tokio::spawn(relay_evaluator::run(text_config(), shutdown.clone())),
        // Text runs' replay buffer and learner (the LoRA trainer) on the
        // stand-in's games.
        tokio::spawn(relay_replay_buffer::run(text_config(), shutdown.clone())),
        tokio::spawn(relay_learner::run(text_config(), shutdown.clone())),
        tokio::spawn(relay_replay_buffer::run(dqn_config(), shutdown.clone())),
        tokio::spawn(relay_inference_server::run(dqn_config(), shutdown.clone())),
        tokio::spawn(relay_env_runner::run(dqn_config(), shutdown.clone())),
        tokio::spawn(relay_learner::run(dqn_config(), shutdown.clone())),
        tokio::spawn(relay_replay_buffer::run(sac_config(), shutdown.clone())),
        tokio::spawn(relay_inference_server::run(sac_config(), shutdown.clone())),
        tokio::spawn(relay_env_runner::run(sac_config(), shutdown.clone())),
        tokio::spawn(relay_learner::run(sac_config(), shutdown.clone())),
        tokio::spawn(relay_replay_buffer::run(
            selfplay_config(),
            shutdown.clone(),
        )),
        tokio::spawn(relay_inference_server::run(
            selfplay_config(),
            shutdown.clone(),
        )),
        tokio::spawn(relay_env_runner::run(selfplay_config(), shutdown.clone())),
        tokio::spawn(relay_learner::run(selfplay_config(), shutdown.clone())),
    ];
    // Until every catalogued metric has shown up (reports come each second,
    // the learner's after its first update), or a deadline.
    let catalogue: Vec<String> = Catalogue::get().names().map(String::from).collect();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let seen = emitted();
        if catalogue.iter().all(|n| seen.contains(n)) || Instant::now() > deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let seen = emitted();
    let missing: Vec<&String> = catalogue.iter().filter(|n| !seen.contains(*n)).collect();
    let uncatalogued: Vec<&String> = seen
        .iter()
        .filter(|n| Catalogue::get().spec(n).is_none())
        .collect();
    trigger.trigger();
    for task in tasks {
        tokio::time::timeout(Duration::from_secs(15), task)
            .await
            .expect("service stops")
            .unwrap()
            .unwrap();
    }
    assert!(
        uncatalogued.is_empty(),
        "emitted but not in configs/metrics.yaml: {uncatalogued:?}"
    );
    assert!(
        missing.is_empty(),
        "in configs/metrics.yaml but never emitted: {missing:?}"
    );
}
