//! The `generate` endpoint against a real nats-server, serving the
//! `tiny-qwen2` fixture (a Hugging Face Qwen2 folder with a PEFT adapter and
//! transformers' greedy continuations in `reference.json`).
//!
//! The fixture folder is `tiny-qwen2` under `$RELAY_LLM_FIXTURES` (default
//! `shared/fixtures` beside the repository).

use std::path::PathBuf;
use std::time::{Duration, Instant};

use relay_config::ExperimentConfig;
use relay_kit::{RequestError, ServiceConfig, Shutdown, ShutdownTrigger};
use relay_proto::{
    AdapterRef, AdapterUpdate, AnswerFrame, ChatMessage, FinishReason, GenerateReply,
    GenerateRequest, Prompt, SamplingParams, Subjects, Tensor, SCHEMA_VERSION,
};
use relay_testkit::NatsServer;

const TIMEOUT: Duration = Duration::from_secs(60);
/// `max_position_embeddings` of the tiny fixture model.
const TINY_CONTEXT: usize = 512;

fn fixture_dir() -> PathBuf {
    relay_testkit::llm_fixture("tiny-qwen2")
}

struct Case {
    input_ids: Vec<u32>,
    greedy: Vec<u32>,
}

fn cases() -> Vec<Case> {
    let path = fixture_dir().join("reference.json");
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{}: {e} (set RELAY_LLM_FIXTURES)", path.display()));
    let value: serde_json::Value = serde_json::from_str(&text).unwrap();
    let ids = |v: &serde_json::Value| -> Vec<u32> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as u32)
            .collect()
    };
    value["cases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| Case {
            input_ids: ids(&c["input_ids"]),
            greedy: ids(&c["greedy"]),
        })
        .collect()
}

/// The overrides of each inference backend: the CPU engine, and the
/// candle backend (on the CPU here; a GPU in a `cuda` build).
const BACKENDS: [&[&str]; 2] = [&[], &["llm.backend=candle"]];

/// A nats-server and one inference server serving the fixture (with its
/// adapter as `fixture`, version 0) for a TicTacToe run.
struct Served {
    _nats: NatsServer,
    client: async_nats::Client,
    subjects: Subjects,
    trigger: ShutdownTrigger,
    server: tokio::task::JoinHandle<Result<(), relay_kit::ServiceError>>,
    metrics_addr: std::net::SocketAddr,
}

async fn serve(run_id: &str, extra: &[&str]) -> Served {
    let nats = NatsServer::start().unwrap();
    let text = format!(
        "run:\n  id: {run_id}\n  env_id: TicTacToe-v0\nconnections:\n  nats_url: {}\n  request_timeout_ms: 2000\nllm:\n  model: {}\n  max_sequences: 8\n  adapters:\n    fixture: {}\n",
        nats.url(),
        fixture_dir().display(),
        fixture_dir().join("adapter").display(),
    );
    let overrides: Vec<String> = extra.iter().map(|s| s.to_string()).collect();
    let experiment = ExperimentConfig::from_layers(&text, "test", &[], &overrides).unwrap();
    let (trigger, shutdown) = Shutdown::new();
    let mut config = ServiceConfig::for_test(experiment);
    // Port 0 and the bound address read back: a port found free a moment
    // earlier can be taken by then by a test running beside this one.
    let addr_file = std::env::temp_dir().join(format!(
        "relay-generate-{run_id}-{}.addr",
        std::process::id()
    ));
    let _ = std::fs::remove_file(&addr_file);
    config.metrics_addr = ([127, 0, 0, 1], 0).into();
    config.addr_file = Some(addr_file.clone());
    let server = tokio::spawn(relay_inference_server::run(config, shutdown));
    let deadline = Instant::now() + TIMEOUT;
    let metrics_addr = loop {
        if let Some(addr) = std::fs::read_to_string(&addr_file)
            .ok()
            .and_then(|text| text.trim().parse().ok())
        {
            break addr;
        }
        if server.is_finished() {
            panic!("the server stopped: {:?}", server.await);
        }
        assert!(
            Instant::now() < deadline,
            "the server bound no metrics address"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let _ = std::fs::remove_file(&addr_file);
    let client = async_nats::connect(nats.url()).await.unwrap();
    let served = Served {
        _nats: nats,
        client,
        subjects: Subjects::new(run_id),
        trigger,
        server,
        metrics_addr,
    };
    // Until the endpoint answers.
    let deadline = Instant::now() + TIMEOUT;
    loop {
        let probe = tokens_request(&[1, 2, 3], None, 1);
        match served.generate(&probe).await {
            Ok(_) => break,
            Err(RequestError::NoResponders { .. }) | Err(RequestError::Timeout { .. })
                if Instant::now() < deadline && !served.server.is_finished() =>
            {
                tokio::time::sleep(Duration::from_millis(50)).await
            }
            Err(e) if served.server.is_finished() => {
                panic!("server did not come up ({e}): {:?}", served.server.await)
            }
            Err(e) => panic!("server did not come up: {e}"),
        }
    }
    served
}

impl Served {
    async fn generate(&self, request: &GenerateRequest) -> Result<GenerateReply, RequestError> {
        relay_kit::request(&self.client, &self.subjects.generate(), request, TIMEOUT).await
    }

    async fn stop(self) {
        self.trigger.trigger();
        tokio::time::timeout(Duration::from_secs(20), self.server)
            .await
            .expect("server stops")
            .unwrap()
            .unwrap();
    }
}

fn tokens_request(ids: &[u32], adapter: Option<AdapterRef>, max_tokens: u32) -> GenerateRequest {
    GenerateRequest::new(
        adapter,
        Prompt::Tokens(Tensor::from_u32(&[ids.len()], ids)),
        SamplingParams {
            temperature: 0.0,
            max_tokens,
            ..SamplingParams::default()
        },
    )
}

fn fixture_adapter(version: Option<u64>) -> Option<AdapterRef> {
    Some(AdapterRef {
        name: "fixture".into(),
        version,
    })
}

fn completion(reply: &GenerateReply) -> Vec<u32> {
    reply.completion_tokens.to_u32().unwrap()
}

fn logprobs(reply: &GenerateReply) -> Vec<f32> {
    reply.logprobs.to_f32().unwrap()
}

fn tic_tac_toe_prompt() -> Prompt {
    Prompt::Chat(vec![ChatMessage {
        role: "user".into(),
        content: "[GAME] You are Player 0 in Tic Tac Toe.\n 0 | 1 | X \n---+---+---\n 3 | 4 | 5 \n---+---+---\n 6 | O | 8 \nAvailable Moves: '[0]', '[1]', '[3]', '[4]', '[5]', '[6]', '[8]'".into(),
    }])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn greedy_matches_the_reference_and_continuous_batching_is_exact() {
    for backend in BACKENDS {
        let served = serve(&format!("gen-exact-{}", backend.len()), backend).await;
        let cases = cases();
        for (i, case) in cases.iter().enumerate() {
            let reply = served
                .generate(&tokens_request(
                    &case.input_ids,
                    None,
                    case.greedy.len() as u32,
                ))
                .await
                .unwrap();
            assert_eq!(completion(&reply), case.greedy, "case {i}");
            assert_eq!(reply.prompt_tokens.to_u32().unwrap(), case.input_ids);
            assert_eq!(reply.finish, FinishReason::Length);
            assert_eq!(reply.adapter, None);
            let lp = logprobs(&reply);
            assert_eq!(lp.len(), case.greedy.len());
            assert!(lp.iter().all(|&v| v.is_finite() && v <= 0.0), "{lp:?}");
        }

        // Every mix of prompt, adapter and sampling, each alone, then all at
        // once (plus the same again, so sequences share steps with copies of
        // themselves): the results must not depend on the company.
        let mut requests = Vec::new();
        for case in &cases {
            for adapter in [None, fixture_adapter(None)] {
                for seed in [None, Some(7u64), Some(8)] {
                    let mut request = tokens_request(&case.input_ids, adapter.clone(), 10);
                    if let Some(seed) = seed {
                        request.sampling.temperature = 1.0;
                        request.sampling.seed = Some(seed);
                    }
                    requests.push(request);
                }
            }
        }
        let mut alone = Vec::new();
        for request in &requests {
            alone.push(served.generate(request).await.unwrap());
        }
        // The adapter changes the greedy completion of at least one case and is
        // reported with the version used.
        assert!(
            (0..cases.len()).any(|c| completion(&alone[6 * c]) != completion(&alone[6 * c + 3]))
        );
        assert_eq!(alone[3].adapter, fixture_adapter(Some(0)));

        let all = futures::future::join_all(
            requests
                .iter()
                .chain(&requests)
                .map(|request| served.generate(request)),
        )
        .await;
        for (i, reply) in all.into_iter().enumerate() {
            let reply = reply.unwrap();
            let want = &alone[i % requests.len()];
            assert_eq!(completion(&reply), completion(want), "request {i}");
            assert_eq!(reply.finish, want.finish, "request {i}");
            assert_eq!(reply.text, want.text, "request {i}");
            assert_eq!(reply.adapter, want.adapter, "request {i}");
            for (a, b) in logprobs(&reply).iter().zip(logprobs(want)) {
                assert!((a - b).abs() < 1e-4, "request {i}: {a} vs {b}");
            }
        }
        served.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_arriving_while_others_decode_is_served_at_once() {
    let served = serve("gen-join", &[]).await;
    // A prompt whose greedy completion fills the model's context without EOS
    // (the longer the others decode, the less this test depends on timing).
    let cases = cases();
    let mut long = None;
    for case in &cases {
        let max_tokens = (TINY_CONTEXT - case.input_ids.len() - 1) as u32;
        let reply = served
            .generate(&tokens_request(&case.input_ids, None, max_tokens))
            .await
            .unwrap();
        if reply.finish == FinishReason::Length {
            long = Some((case.input_ids.clone(), max_tokens));
            break;
        }
    }
    let (long, long_tokens) =
        long.expect("some fixture prompt decodes to the end of the context without EOS");
    let runners: Vec<_> = (0..3)
        .map(|_| {
            let (client, subject, request) = (
                served.client.clone(),
                served.subjects.generate(),
                tokens_request(&long, None, long_tokens),
            );
            tokio::spawn(async move {
                let reply: GenerateReply = relay_kit::request(&client, &subject, &request, TIMEOUT)
                    .await
                    .unwrap();
                reply
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(20)).await;
    let short = served
        .generate(&tokens_request(&cases[0].input_ids, None, 2))
        .await
        .unwrap();
    assert_eq!(completion(&short), cases[0].greedy[..2]);
    assert!(
        runners.iter().all(|r| !r.is_finished()),
        "the short request waited for the long ones"
    );
    for runner in runners {
        let reply = runner.await.unwrap();
        assert_eq!(completion(&reply).len(), long_tokens as usize);
    }
    served.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_strings_and_max_tokens_end_completions() {
    let served = serve("gen-stop", &[]).await;
    let case = &cases()[0];
    let full = served
        .generate(&tokens_request(&case.input_ids, None, 12))
        .await
        .unwrap();
    assert_eq!(completion(&full).len(), 12);
    let short = served
        .generate(&tokens_request(&case.input_ids, None, 5))
        .await
        .unwrap();
    assert_eq!(completion(&short), case.greedy[..5]);
    assert_eq!(short.finish, FinishReason::Length);

    // A stop string taken from the middle of the full completion's text.
    let chars: Vec<(usize, char)> = full.text.char_indices().collect();
    assert!(
        chars.len() >= 6,
        "completion text too short: {:?}",
        full.text
    );
    let (start, end) = (chars[3].0, chars[5].0);
    let stop = full.text[start..end].to_string();
    let mut request = tokens_request(&case.input_ids, None, 12);
    request.sampling.stop = vec!["never appears \u{1F600}".into(), stop.clone()];
    let stopped = served.generate(&request).await.unwrap();
    assert_eq!(stopped.finish, FinishReason::Stop, "{stopped:?}");
    let first = full.text.find(&stop).unwrap();
    assert_eq!(stopped.text, full.text[..first + stop.len()]);
    let n = completion(&stopped).len();
    assert!(n < 12, "stopped after {n} tokens");
    assert_eq!(completion(&stopped), completion(&full)[..n]);
    served.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn constrained_decoding_returns_an_allowed_string() {
    for backend in BACKENDS {
        let served = serve(&format!("gen-allowed-{}", backend.len()), backend).await;
        let moves: Vec<String> = [0, 1, 3, 4, 5, 6, 8]
            .iter()
            .map(|m| format!("[{m}]"))
            .collect();
        let mut seen = std::collections::BTreeSet::new();
        let mut requests = Vec::new();
        for seed in 0..24u64 {
            let mut request = GenerateRequest::new(
                if seed % 2 == 0 {
                    None
                } else {
                    fixture_adapter(None)
                },
                tic_tac_toe_prompt(),
                SamplingParams {
                    temperature: if seed % 6 == 0 { 0.0 } else { 1.5 },
                    max_tokens: 1,
                    seed: Some(seed),
                    ..SamplingParams::default()
                },
            );
            request.allowed = moves.clone();
            // One string that is a prefix of another, in some requests.
            if seed % 3 == 0 {
                request.allowed.push("[4] and more".into());
            }
            requests.push(request);
        }
        let replies = futures::future::join_all(requests.iter().map(|r| served.generate(r))).await;
        for (request, reply) in requests.iter().zip(replies) {
            let reply = reply.unwrap();
            assert_eq!(reply.finish, FinishReason::Allowed, "{reply:?}");
            assert!(request.allowed.contains(&reply.text), "{:?}", reply.text);
            let lp = logprobs(&reply);
            assert_eq!(lp.len(), completion(&reply).len());
            assert!(lp.iter().all(|v| v.is_finite() && *v <= 0.0));
            seen.insert(reply.text);
        }
        assert!(seen.len() >= 3, "sampling explores the moves: {seen:?}");
        served.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_after_a_free_thought_is_constrained_alone() {
    let served = serve("gen-thought", &[]).await;
    let moves: Vec<String> = ["[0]", "[4]", "[8]"].map(String::from).to_vec();
    let request = |temperature: f32, seed: u64, opener: &str, closer: &str| {
        let mut request = GenerateRequest::new(
            None,
            tic_tac_toe_prompt(),
            SamplingParams {
                temperature,
                max_tokens: 6,
                seed: Some(seed),
                ..SamplingParams::default()
            },
        );
        request.allowed = moves.clone();
        request.answer_frame = Some(AnswerFrame {
            opener: opener.into(),
            closer: closer.into(),
        });
        request
    };
    // The thought ends by itself or at its 6 tokens; the whole answer
    // (opener, move, closer) is decoded there.
    for seed in 0..8 {
        let reply = served
            .generate(&request(1.5, seed, "\\boxed{", "}"))
            .await
            .unwrap();
        assert_eq!(reply.finish, FinishReason::Allowed, "{reply:?}");
        let start = reply.answer_start.expect("an answer start") as usize;
        assert!(start <= 6, "{start}");
        assert!(
            moves
                .iter()
                .any(|m| reply.text.ends_with(&format!("\\boxed{{{m}}}"))),
            "{:?}",
            reply.text
        );
        let n = completion(&reply).len();
        assert!(n > start && logprobs(&reply).len() == n);
    }
    // A model that writes the opener itself: greedy writes its first two
    // tokens' text, so take that as the opener; the answer follows it.
    let mut free = request(0.0, 0, "", "");
    free.allowed.clear();
    free.answer_frame = None;
    free.sampling.max_tokens = 2;
    let free = served.generate(&free).await.unwrap();
    let opener = free.text.clone();
    let reply = served
        .generate(&request(0.0, 0, &opener, "}"))
        .await
        .unwrap();
    assert_eq!(reply.finish, FinishReason::Allowed, "{reply:?}");
    assert!(reply.text.starts_with(&opener), "{:?}", reply.text);
    let answer = &reply.text[opener.len()..];
    assert!(
        moves.iter().any(|m| answer == format!("{m}}}")),
        "{:?}",
        reply.text
    );
    assert_eq!(reply.answer_start, Some(2));
    assert_eq!(completion(&reply)[..2], completion(&free)[..]);
    served.stop().await;
}

fn fixture_adapter_files() -> (String, Vec<u8>) {
    let dir = fixture_dir().join("adapter");
    (
        std::fs::read_to_string(dir.join("adapter_config.json")).unwrap(),
        std::fs::read(dir.join("adapter_model.safetensors")).unwrap(),
    )
}

/// Retries until the adapter version is known (updates arrive asynchronously).
async fn generate_when_known(served: &Served, request: &GenerateRequest) -> GenerateReply {
    let deadline = Instant::now() + TIMEOUT;
    loop {
        match served.generate(request).await {
            Ok(reply) => return reply,
            Err(RequestError::Service { code, .. })
                if code == "404" && Instant::now() < deadline =>
            {
                tokio::time::sleep(Duration::from_millis(50)).await
            }
            Err(e) => panic!("{e}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn adapters_published_inline_and_through_the_object_store_are_served() {
    // One adapter loaded at a time: every switch evicts and reloads.
    for backend in BACKENDS {
        let overrides: Vec<&str> = ["llm.max_adapters=1"]
            .iter()
            .chain(backend)
            .copied()
            .collect();
        let served = serve(&format!("gen-adapters-{}", backend.len()), &overrides).await;
        let case = &cases()[1];
        let want = served
            .generate(&tokens_request(
                &case.input_ids,
                fixture_adapter(Some(0)),
                8,
            ))
            .await
            .unwrap();
        let base = served
            .generate(&tokens_request(&case.input_ids, None, 8))
            .await
            .unwrap();
        let (config_json, safetensors) = fixture_adapter_files();

        // Inline, as version 3 of `policy`.
        let update = AdapterUpdate {
            schema: SCHEMA_VERSION,
            name: "policy".into(),
            version: 3,
            learner_env_steps: 100,
            config_json: config_json.clone(),
            weights: relay_proto::WeightsBlob::inline(safetensors.clone()),
            published_unix_ms: relay_proto::unix_ms(),
        };
        served
            .client
            .publish(
                served.subjects.adapters(),
                relay_proto::encode(&update).into(),
            )
            .await
            .unwrap();
        let policy = |version| {
            Some(AdapterRef {
                name: "policy".into(),
                version,
            })
        };
        let v3 = generate_when_known(
            &served,
            &tokens_request(&case.input_ids, policy(Some(3)), 8),
        )
        .await;
        assert_eq!(v3.adapter, policy(Some(3)));
        assert_eq!(completion(&v3), completion(&want));

        // Through the JetStream object store, as version 4.
        let jetstream = async_nats::jetstream::new(served.client.clone());
        let store = jetstream
            .create_object_store(async_nats::jetstream::object_store::Config {
                bucket: "relay-adapters".into(),
                ..Default::default()
            })
            .await
            .unwrap();
        store
            .put(
                "gen-adapters/policy/4/adapter_model.safetensors",
                &mut safetensors.as_slice(),
            )
            .await
            .unwrap();
        let remote = relay_proto::WeightsBlob {
            inline: None,
            ..relay_proto::WeightsBlob::inline(safetensors.clone())
        };
        let update = AdapterUpdate {
            schema: SCHEMA_VERSION,
            name: "policy".into(),
            version: 4,
            learner_env_steps: 200,
            config_json: config_json.clone(),
            weights: relay_proto::WeightsBlob {
                store: Some(relay_proto::StoreLocation {
                    bucket: "relay-adapters".into(),
                    key: "gen-adapters/policy/4/adapter_model.safetensors".into(),
                }),
                ..remote.clone()
            },
            published_unix_ms: relay_proto::unix_ms(),
        };
        served
            .client
            .publish(
                served.subjects.adapters(),
                relay_proto::encode(&update).into(),
            )
            .await
            .unwrap();
        let v4 = generate_when_known(
            &served,
            &tokens_request(&case.input_ids, policy(Some(4)), 8),
        )
        .await;
        assert_eq!(v4.adapter, policy(Some(4)));
        assert_eq!(completion(&v4), completion(&want));

        // From the publisher's direct transfer server, as version 5.
        let direct = relay_kit::direct::DirectServer::bind(([127, 0, 0, 1], 0).into(), None, 1)
            .await
            .unwrap();
        direct.offer("policy/v5", safetensors.clone().into());
        let update = AdapterUpdate {
            version: 5,
            weights: relay_proto::WeightsBlob {
                direct: Some(relay_proto::DirectLocation {
                    addr: direct.addr().into(),
                    key: "policy/v5".into(),
                }),
                ..remote
            },
            ..update
        };
        served
            .client
            .publish(
                served.subjects.adapters(),
                relay_proto::encode(&update).into(),
            )
            .await
            .unwrap();
        let v5 = generate_when_known(
            &served,
            &tokens_request(&case.input_ids, policy(Some(5)), 8),
        )
        .await;
        assert_eq!(v5.adapter, policy(Some(5)));
        assert_eq!(completion(&v5), completion(&want));
        // Every published version's transfer is timed, and its bytes
        // counted (version 4's fetched from the store, 5's from the
        // publisher).
        let (_, text) = relay_testkit::http_get(served.metrics_addr, "/metrics").unwrap();
        let metric = |name: &str| -> f64 {
            text.lines()
                .find(|l| l.starts_with(name))
                .and_then(|l| l.rsplit(' ').next())
                .map_or(0.0, |v| v.parse().unwrap())
        };
        assert_eq!(
            metric("relay_weights_transfer_seconds_count"),
            3.0,
            "{text}"
        );
        let files = (config_json.len() + safetensors.len()) as f64;
        assert!(metric("relay_weights_received_bytes_total") > 3.0 * files);
        // No version: the newest.
        let newest = served
            .generate(&tokens_request(&case.input_ids, policy(None), 8))
            .await
            .unwrap();
        assert_eq!(newest.adapter, policy(Some(5)));
        // Back to version 3 (evicted since), the base, and the fixture: all
        // reload and give what they gave.
        for (adapter, expect) in [
            (policy(Some(3)), &want),
            (None, &base),
            (fixture_adapter(None), &want),
        ] {
            let reply = served
                .generate(&tokens_request(&case.input_ids, adapter, 8))
                .await
                .unwrap();
            assert_eq!(completion(&reply), completion(expect));
        }
        assert_ne!(
            completion(&base),
            completion(&want),
            "the adapter changes the completion"
        );
        served.stop().await;
    }
}

/// Keeps the fixture adapter in run `run`'s league bucket as
/// `policy/v<version>`, as the learner of a league run keeps each version:
/// its weights, then its message naming them.
async fn store_version(
    client: &async_nats::Client,
    store: &async_nats::jetstream::object_store::ObjectStore,
    run: &str,
    version: u64,
) {
    let (config_json, safetensors) = fixture_adapter_files();
    let key = relay_kit::league::weights_object("policy", version);
    store
        .put(key.as_str(), &mut safetensors.as_slice())
        .await
        .unwrap();
    let update = AdapterUpdate {
        schema: SCHEMA_VERSION,
        name: "policy".into(),
        version,
        learner_env_steps: 0,
        config_json,
        weights: relay_proto::WeightsBlob {
            inline: None,
            store: Some(relay_proto::StoreLocation {
                bucket: relay_kit::league::versions_bucket(run),
                key,
            }),
            ..relay_proto::WeightsBlob::inline(safetensors)
        },
        published_unix_ms: 0,
    };
    relay_kit::league::store_update(client, run, "policy", &update)
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn versions_never_announced_are_served_from_the_run_bucket() {
    // One adapter loaded at a time: switching evicts, and the stored
    // version has to be fetched again.
    let run = "gen-stored";
    let served = serve(run, &["llm.max_adapters=1"]).await;
    let case = &cases()[1];
    let want = served
        .generate(&tokens_request(
            &case.input_ids,
            fixture_adapter(Some(0)),
            8,
        ))
        .await
        .unwrap();
    let policy = |version| {
        Some(AdapterRef {
            name: "policy".into(),
            version: Some(version),
        })
    };
    let expect_404 = |result: Result<GenerateReply, RequestError>, words: &[&str]| match result {
        Err(RequestError::Service { code, status, .. }) => {
            assert_eq!(code, "404", "{status}");
            for w in words {
                assert!(status.contains(w), "{status:?} lacks {w:?}");
            }
        }
        other => panic!("expected 404, got {other:?}"),
    };
    // No bucket yet: unknown.
    expect_404(
        served
            .generate(&tokens_request(&case.input_ids, policy(7), 8))
            .await,
        &["policy"],
    );
    let jetstream = async_nats::jetstream::new(served.client.clone());
    let store = jetstream
        .create_object_store(async_nats::jetstream::object_store::Config {
            bucket: relay_kit::league::versions_bucket(run),
            ..Default::default()
        })
        .await
        .unwrap();
    store_version(&served.client, &store, run, 7).await;
    // Never announced on `adapters`, yet served, and again after the LRU
    // dropped it for the fixture.
    for adapter in [policy(7), fixture_adapter(None), policy(7)] {
        let reply = served
            .generate(&tokens_request(&case.input_ids, adapter.clone(), 8))
            .await
            .unwrap();
        assert_eq!(completion(&reply), completion(&want));
        if adapter.as_ref().unwrap().name == "policy" {
            assert_eq!(reply.adapter, policy(7));
        }
    }
    // A version the bucket does not hold.
    expect_404(
        served
            .generate(&tokens_request(&case.input_ids, policy(8), 8))
            .await,
        &["policy"],
    );
    // Deleted from the bucket (evicted from the league): once the LRU has
    // dropped it, it is gone.
    for object in [
        relay_kit::league::update_object("policy", 7),
        relay_kit::league::weights_object("policy", 7),
    ] {
        store.delete(object).await.unwrap();
    }
    served
        .generate(&tokens_request(&case.input_ids, fixture_adapter(None), 8))
        .await
        .unwrap();
    expect_404(
        served
            .generate(&tokens_request(&case.input_ids, policy(7), 8))
            .await,
        &["policy"],
    );
    served.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_get_errors_and_the_service_keeps_serving() {
    let served = serve("gen-bad", &[]).await;
    let ids = cases()[2].input_ids.clone();
    let expect_error =
        |result: Result<GenerateReply, RequestError>, code: &str, words: &[&str]| match result {
            Err(RequestError::Service {
                code: got, status, ..
            }) => {
                assert_eq!(got, code, "{status}");
                for w in words {
                    assert!(status.contains(w), "{status:?} lacks {w:?}");
                }
            }
            other => panic!("expected a {code} service error, got {other:?}"),
        };
    let unknown = Some(AdapterRef {
        name: "nobody".into(),
        version: None,
    });
    expect_error(
        served.generate(&tokens_request(&ids, unknown, 4)).await,
        "404",
        &["unknown adapter", "nobody", "fixture"],
    );
    expect_error(
        served
            .generate(&tokens_request(&ids, fixture_adapter(Some(9)), 4))
            .await,
        "404",
        &["no version 9"],
    );
    // Not MessagePack at all.
    let garbage = served
        .client
        .request(served.subjects.generate(), vec![0xc1, 0x00, 0xff].into())
        .await
        .unwrap();
    let headers = garbage.headers.expect("an error reply has headers");
    assert_eq!(
        headers
            .get(async_nats::service::NATS_SERVICE_ERROR_CODE)
            .unwrap()
            .as_str(),
        "400"
    );
    let mut zero = tokens_request(&ids, None, 4);
    zero.sampling.max_tokens = 0;
    expect_error(
        served.generate(&zero).await,
        "400",
        &["sampling.max_tokens"],
    );
    expect_error(
        served
            .generate(&tokens_request(&[5, 100_000], None, 4))
            .await,
        "400",
        &["prompt", "100000", "vocabulary"],
    );
    let too_long = vec![5u32; 600];
    expect_error(
        served.generate(&tokens_request(&too_long, None, 4)).await,
        "400",
        &["context"],
    );
    let mut text = tokens_request(&ids, None, 4);
    text.prompt = Prompt::Chat(Vec::new());
    expect_error(served.generate(&text).await, "400", &["prompt"]);
    // Still serving.
    let reply = served
        .generate(&tokens_request(&cases()[2].input_ids, None, 3))
        .await
        .unwrap();
    assert_eq!(completion(&reply), cases()[2].greedy[..3]);
    served.stop().await;
}

/// The first fixture case whose greedy completion runs without EOS until
/// `spare` positions of the context are left, and that completion's
/// `max_tokens`.
async fn long_case<'a>(served: &Served, cases: &'a [Case], spare: usize) -> (&'a Case, u32) {
    for case in cases {
        let max_tokens = (TINY_CONTEXT - case.input_ids.len() - spare) as u32;
        let reply = served
            .generate(&tokens_request(&case.input_ids, None, max_tokens))
            .await
            .unwrap();
        if reply.finish == FinishReason::Length {
            return (case, max_tokens);
        }
    }
    panic!("no fixture prompt decodes to the end of the context without EOS")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_beyond_the_queue_bound_are_refused_at_once() {
    // One running sequence, one waiting: the rest must be refused.
    let served = serve("gen-queue", &["llm.max_sequences=1", "llm.max_queue=1"]).await;
    let cases = cases();
    // A prompt whose greedy completion fills the context without EOS, so
    // the first requests are still decoding when the others arrive.
    let (case, max_tokens) = long_case(&served, &cases, 1).await;
    let prompt = case.input_ids.clone();
    let started = Instant::now();
    let requesters: Vec<_> = (0..8)
        .map(|_| {
            let (client, subject, request) = (
                served.client.clone(),
                served.subjects.generate(),
                tokens_request(&prompt, None, max_tokens),
            );
            tokio::spawn(async move {
                let result: Result<GenerateReply, RequestError> =
                    relay_kit::request(&client, &subject, &request, TIMEOUT).await;
                (result, started.elapsed())
            })
        })
        .collect();
    let mut served_at = Vec::new();
    let mut refused_at = Vec::new();
    for requester in requesters {
        match requester.await.unwrap() {
            (Ok(reply), at) => {
                // Whatever waited is served in full and correctly.
                assert_eq!(completion(&reply)[..case.greedy.len()], case.greedy[..]);
                served_at.push(at);
            }
            (Err(RequestError::Service { code, status, .. }), at) => {
                assert_eq!(code, "503", "{status}");
                assert_eq!(status, "queue full (1 waiting)");
                refused_at.push(at);
            }
            (Err(other), _) => panic!("unexpected error: {other}"),
        }
    }
    assert!(!served_at.is_empty(), "the first request is served");
    assert!(
        !refused_at.is_empty(),
        "8 requests at once with room for 1 running and 1 waiting: some are refused"
    );
    // Refusals come at once, not after waiting for a place.
    let last_served = served_at.iter().max().unwrap();
    assert!(
        refused_at.iter().all(|at| at < last_served),
        "refused at {refused_at:?}, served at {served_at:?}"
    );
    // The server keeps serving once the queue has room again.
    let after = served
        .generate(&tokens_request(&prompt, None, 2))
        .await
        .unwrap();
    assert_eq!(completion(&after), case.greedy[..2]);
    served.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopping_server_answers_what_it_cannot_finish_and_stops_within_its_promise() {
    // One sequence at a time and a long queue of completions to the end of
    // the context: far more decoding than the stop's grace leaves.
    let served = serve("gen-stop", &["llm.max_sequences=1", "llm.max_queue=64"]).await;
    let cases = cases();
    let (case, max_tokens) = long_case(&served, &cases, 1).await;
    let requesters: Vec<_> = (0..32)
        .map(|_| {
            let (client, subject, request) = (
                served.client.clone(),
                served.subjects.generate(),
                tokens_request(&case.input_ids, None, max_tokens),
            );
            tokio::spawn(async move {
                relay_kit::request::<_, GenerateReply>(&client, &subject, &request, TIMEOUT).await
            })
        })
        .collect();
    // Stopped while the queue is decoded, once the first is answered.
    while !requesters.iter().any(|r| r.is_finished()) {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let Served {
        trigger, server, ..
    } = served;
    let stopped = Instant::now();
    trigger.trigger();
    server.await.unwrap().unwrap();
    let took = stopped.elapsed();
    // The promise of every service: stopped within 2 s of being asked.
    assert!(took < Duration::from_secs(2), "stopped after {took:?}");
    let (mut finished, mut refused) = (0, 0);
    for requester in requesters {
        match requester.await.unwrap() {
            Ok(reply) => {
                assert_eq!(completion(&reply)[..case.greedy.len()], case.greedy[..]);
                finished += 1;
            }
            Err(RequestError::Service { code, status, .. }) => {
                assert_eq!(code, "503", "{status}");
                assert_eq!(status, "the inference server is stopping");
                refused += 1;
            }
            Err(other) => panic!("unanswered: {other}"),
        }
    }
    assert!(
        finished >= 1 && refused >= 1,
        "{finished} finished, {refused} refused"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prompts_sharing_a_prefix_arriving_together_decode_as_if_alone() {
    // Six prompts: one long shared prefix, each its own short ending.
    let cases = cases();
    let prompts: Vec<Vec<u32>> = (0..6)
        .map(|i| {
            let mut p = cases[0].input_ids.clone();
            p.extend_from_slice(&cases[1].input_ids[i..i + 3]);
            p
        })
        .collect();
    // Reference: one at a time, no prefix cache at all.
    let alone = serve("gen-share-alone", &["llm.prefix_cache=0"]).await;
    let mut want = Vec::new();
    for p in &prompts {
        want.push(alone.generate(&tokens_request(p, None, 8)).await.unwrap());
    }
    alone.stop().await;
    // Together: admitted in the same turns, sharing the prefix's cache.
    let served = serve("gen-share", &[]).await;
    for round in 0..2 {
        let requesters: Vec<_> = prompts
            .iter()
            .map(|p| {
                let (client, subject, request) = (
                    served.client.clone(),
                    served.subjects.generate(),
                    tokens_request(p, None, 8),
                );
                tokio::spawn(async move {
                    let reply: GenerateReply =
                        relay_kit::request(&client, &subject, &request, TIMEOUT)
                            .await
                            .unwrap();
                    reply
                })
            })
            .collect();
        for (i, (requester, want)) in requesters.into_iter().zip(&want).enumerate() {
            let got = requester.await.unwrap();
            assert_eq!(
                completion(&got),
                completion(want),
                "round {round} prompt {i}"
            );
            // Batch-invariant kernels: the same numbers, not just close ones.
            assert_eq!(logprobs(&got), logprobs(want), "round {round} prompt {i}");
        }
    }
    served.stop().await;
}

/// With `llm.kv_cache_mib` bounding the candle backend's KV pool, requests
/// are admitted by memory: twelve that may each fill the context, with
/// room in the pool for three, all get their full greedy completion (none
/// fails for want of a block), never more than three (of 32 places)
/// decode at once, and the pool's bytes stay under the bound.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_are_admitted_by_kv_memory() {
    // tiny-qwen2 in f32: a block of 16 positions is 8 KiB (2 layers, keys
    // and values of 2 heads x 16), so 1 MiB holds 128; a request up to the
    // 512-token context promises 33.
    let served = serve(
        "gen-kv-memory",
        &[
            "llm.backend=candle",
            "llm.kv_cache_mib=1",
            "llm.max_sequences=32",
            "llm.prefix_cache=0",
        ],
    )
    .await;
    let cases = cases();
    // A prompt whose greedy completion runs to the end of the context, so
    // that the requests decode side by side.
    let (case, max_tokens) = long_case(&served, &cases, 0).await;
    let requesters: Vec<_> = (0..12)
        .map(|_| {
            let (client, subject, request) = (
                served.client.clone(),
                served.subjects.generate(),
                tokens_request(&case.input_ids, None, max_tokens),
            );
            tokio::spawn(async move {
                let reply: Result<GenerateReply, RequestError> =
                    relay_kit::request(&client, &subject, &request, TIMEOUT * 4).await;
                reply
            })
        })
        .collect();
    for requester in requesters {
        let reply = requester.await.unwrap().expect("every request is served");
        let got = completion(&reply);
        let n = case.greedy.len().min(got.len());
        assert_eq!(got[..n], case.greedy[..n]);
    }
    let (_, text) = relay_testkit::http_get(served.metrics_addr, "/metrics").unwrap();
    let value = |name: &str, label: &str| -> f64 {
        text.lines()
            .find(|l| l.starts_with(name) && l.contains(label))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("{name} {label} in {text}"))
    };
    let steps = value("relay_llm_sequences_per_step_count", "");
    let at_most_two = value("relay_llm_sequences_per_step_bucket", "le=\"2\"");
    let at_most_four = value("relay_llm_sequences_per_step_bucket", "le=\"4\"");
    let sequences = value("relay_llm_sequences_per_step_sum", "");
    assert_eq!(
        at_most_four, steps,
        "a step decoded more than the pool admits"
    );
    assert!(at_most_two < steps, "the pool admits three at once");
    // Sum over steps of at most 3 each, and more than 2 on some.
    assert!(sequences <= 3.0 * steps);
    assert!(value("relay_llm_kv_cache_bytes", "") <= (1 << 20) as f64);
    served.stop().await;
}
