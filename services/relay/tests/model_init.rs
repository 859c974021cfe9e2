//! `relay model init tiny` writes a model folder that an inference server
//! serves end to end: chat prompts through its chat template, free and
//! constrained completions over NATS.

use std::process::Command;
use std::time::{Duration, Instant};

use relay_config::ExperimentConfig;
use relay_kit::{RequestError, ServiceConfig, Shutdown};
use relay_proto::{
    ChatMessage, FinishReason, GenerateReply, GenerateRequest, Prompt, SamplingParams, Subjects,
};
use relay_testkit::{NatsServer, TempDir};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tiny_model_from_relay_model_init_is_served() {
    let dir = TempDir::new("model-init");
    let out = dir.path().join("tiny");
    let status = Command::new(env!("CARGO_BIN_EXE_relay"))
        .args(["model", "init", "tiny", "--seed", "3", "--out"])
        .arg(&out)
        .status()
        .unwrap();
    assert!(status.success());
    for file in ["config.json", "model.safetensors", "tokenizer.json"] {
        assert!(out.join(file).is_file(), "{file} missing");
    }

    let nats = NatsServer::start().unwrap();
    let text = format!(
        "run:\n  id: model-init\n  env_id: TicTacToe-v0\nconnections:\n  nats_url: {}\nllm:\n  model: {}\n",
        nats.url(),
        out.display()
    );
    let experiment = ExperimentConfig::from_layers(&text, "test", &[], &[]).unwrap();
    let (trigger, shutdown) = Shutdown::new();
    let server = tokio::spawn(relay_inference_server::run(
        ServiceConfig::for_test(experiment),
        shutdown,
    ));
    let client = async_nats::connect(nats.url()).await.unwrap();
    let subject = Subjects::new("model-init").generate();
    let prompt = Prompt::Chat(vec![ChatMessage {
        role: "user".into(),
        content: "[GAME] Tic Tac Toe. Available Moves: '[0]', '[4]', '[8]'".into(),
    }]);
    let free = GenerateRequest::new(
        None,
        prompt.clone(),
        SamplingParams {
            max_tokens: 8,
            seed: Some(1),
            ..SamplingParams::default()
        },
    );
    let deadline = Instant::now() + Duration::from_secs(60);
    let reply: GenerateReply = loop {
        match relay_kit::request(&client, &subject, &free, Duration::from_secs(30)).await {
            Ok(reply) => break reply,
            Err(RequestError::NoResponders { .. }) if Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(50)).await
            }
            Err(e) => panic!("{e}"),
        }
    };
    let n = reply.completion_tokens.numel();
    assert!((1..=8).contains(&n), "{n} tokens");
    assert!(matches!(
        reply.finish,
        FinishReason::Length | FinishReason::Eos
    ));
    // The prompt went through the ChatML template.
    let prompt_ids = reply.prompt_tokens.to_u32().unwrap();
    assert!(prompt_ids.len() > 10);

    let mut constrained = free.clone();
    constrained.allowed = vec!["[0]".into(), "[4]".into(), "[8]".into()];
    let reply: GenerateReply =
        relay_kit::request(&client, &subject, &constrained, Duration::from_secs(30))
            .await
            .unwrap();
    assert_eq!(reply.finish, FinishReason::Allowed);
    assert!(
        constrained.allowed.contains(&reply.text),
        "{:?}",
        reply.text
    );

    trigger.trigger();
    tokio::time::timeout(Duration::from_secs(20), server)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
}
