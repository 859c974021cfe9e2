//! `relay bench-generate` (`just bench-generate`): throughput and latency
//! of the inference server's `generate` endpoint.
//!
//! Starts its own nats-server, then for each model an inference server
//! (the release binary beside this one) with `llm.max_sequences` set to
//! the largest batch, and for each batch size B runs B concurrent
//! requesters, each sending at least `--rounds` TicTacToe chat prompts (a
//! different board per request; more until `--min-seconds` have passed)
//! with `max_tokens` completion tokens and no stop
//! condition but EOS. Completion tokens per second is all completion
//! tokens over the wall time of the whole batch run; latencies are per
//! request; `prefilled` is the prompt tokens per request that were
//! prefilled rather than copied from the prefix cache (from the server's
//! `/metrics`); `cpu ms/token` is the server process's CPU time (user +
//! system, Linux `/proc`) per completion token, which other processes on
//! a shared machine disturb far less than wall time. Prints a table and,
//! last, one JSON line.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use relay_proto::{ChatMessage, GenerateReply, GenerateRequest, Prompt, SamplingParams, Subjects};

use relay::stack::{free_port, metric_value, scrape, sibling_binary, which};

/// `relay bench-generate` flags.
#[derive(Debug, clap::Args)]
pub struct BenchGenerateArgs {
    /// Models to serve, comma-separated: `tiny` (written by `relay model
    /// init tiny` into a temporary folder), `smollm2`, a model folder or a
    /// `.gguf` file.
    #[arg(long, default_value = "tiny,smollm2", value_delimiter = ',')]
    pub models: Vec<String>,
    /// Concurrent requesters, comma-separated.
    #[arg(long, default_value = "1,8,32", value_delimiter = ',')]
    pub batches: Vec<usize>,
    /// Requests each requester sends at least, one after another.
    #[arg(long, default_value_t = 2)]
    pub rounds: usize,
    /// Requesters keep sending (after `--rounds`) until this many seconds
    /// have passed, so a fast model is measured over a long enough window.
    #[arg(long, default_value_t = 5.0)]
    pub min_seconds: f64,
    /// Completion tokens per request (`max_tokens`).
    #[arg(long, default_value_t = 16)]
    pub max_tokens: u32,
    /// Compute threads of the inference server (`llm.threads`).
    #[arg(long, default_value_t = 2)]
    pub threads: usize,
    /// How a GGUF model's weights are held (`llm.gguf_base`).
    #[arg(long, default_value = "dequantized")]
    pub gguf_base: String,
}

/// One (model, batch) measurement.
#[derive(Debug, Clone, serde::Serialize)]
struct Row {
    model: String,
    batch: usize,
    requests: usize,
    completion_tokens: u64,
    prompt_tokens_mean: f64,
    seconds: f64,
    tokens_per_second: f64,
    p50_latency_s: f64,
    p95_latency_s: f64,
    /// Prompt tokens per admitted request that were prefilled (not from
    /// the prefix cache); NaN if the server's metrics were unreadable.
    prefilled_per_request: f64,
    /// Server CPU milliseconds per completion token (NaN off Linux).
    server_cpu_ms_per_token: f64,
}

/// `relay_llm_prompt_tokens_total` and `relay_llm_prompt_tokens_cached_total`
/// from the inference server's `/metrics` on `port`.
fn prompt_token_counters(port: u16) -> Option<(f64, f64)> {
    let text = scrape(([127, 0, 0, 1], port).into())?;
    Some((
        metric_value(&text, "relay_llm_prompt_tokens_total")?,
        metric_value(&text, "relay_llm_prompt_tokens_cached_total")?,
    ))
}

struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        // SAFETY: signalling our own child process by its pid.
        unsafe {
            libc::kill(self.0.id() as i32, libc::SIGTERM);
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.0.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A TicTacToe observation as TextArena words it, for board `index`.
fn tic_tac_toe_prompt(index: usize) -> Prompt {
    let mut cells: Vec<String> = (0..9).map(|i| i.to_string()).collect();
    // A few marks placed by a simple pseudo-random walk over the index.
    let mut state = index as u64 * 0x9E37_79B9 + 17;
    for turn in 0..(index % 5) {
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let cell = (state >> 33) as usize % 9;
        cells[cell] = if turn % 2 == 0 { "X" } else { "O" }.into();
    }
    let free: Vec<String> = cells
        .iter()
        .filter(|c| c.parse::<u32>().is_ok())
        .map(|c| format!("'[{c}]'"))
        .collect();
    let row = |r: usize| {
        format!(
            " {} | {} | {} ",
            cells[3 * r],
            cells[3 * r + 1],
            cells[3 * r + 2]
        )
    };
    let content = format!(
        "[GAME] You are Player 0 in Tic Tac Toe.\nYour goal is to win three in a row (horizontally, vertically, or diagonally) on the board.\nOn your turn, you should select the square number (0-8) you want to put your mark in next.\nFor example, '[4]' places your mark in the center cell of the board.\n\nAs Player 0, you will be 'O', while your opponent is 'X'.\n\n[GAME] Current Board:\n\n{}\n---+---+---\n{}\n---+---+---\n{}\n\nAvailable Moves: {}",
        row(0),
        row(1),
        row(2),
        free.join(", ")
    );
    Prompt::Chat(vec![ChatMessage {
        role: "user".into(),
        content,
    }])
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = ((p / 100.0) * (sorted.len() - 1) as f64).round() as usize;
    sorted[rank.min(sorted.len() - 1)]
}

async fn one_batch(
    client: &async_nats::Client,
    subject: &str,
    label: &str,
    batch: usize,
    args: &BenchGenerateArgs,
) -> Result<Row> {
    let started = Instant::now();
    let tasks: Vec<_> = (0..batch)
        .map(|requester| {
            let (client, subject) = (client.clone(), subject.to_string());
            let (rounds, max_tokens) = (args.rounds, args.max_tokens);
            let min_time = Duration::from_secs_f64(args.min_seconds);
            tokio::spawn(async move {
                let mut out = Vec::new();
                let mut round = 0;
                while round < rounds || started.elapsed() < min_time {
                    round += 1;
                    let request = GenerateRequest::new(
                        None,
                        tic_tac_toe_prompt(requester * 7919 + round),
                        SamplingParams {
                            temperature: 1.0,
                            max_tokens,
                            seed: Some((requester * 1000 + round) as u64),
                            ..SamplingParams::default()
                        },
                    );
                    let sent = Instant::now();
                    let reply: GenerateReply =
                        relay_kit::request(&client, &subject, &request, Duration::from_secs(1800))
                            .await?;
                    out.push((
                        sent.elapsed().as_secs_f64(),
                        reply.completion_tokens.numel() as u64,
                        reply.prompt_tokens.numel() as u64,
                    ));
                }
                Ok::<_, relay_kit::RequestError>(out)
            })
        })
        .collect();
    let mut results = Vec::new();
    for task in tasks {
        results.extend(task.await.context("requester task")??);
    }
    let seconds = started.elapsed().as_secs_f64();
    let mut latencies: Vec<f64> = results.iter().map(|r| r.0).collect();
    latencies.sort_by(f64::total_cmp);
    let completion_tokens: u64 = results.iter().map(|r| r.1).sum();
    let prompt_tokens: u64 = results.iter().map(|r| r.2).sum();
    Ok(Row {
        model: label.to_string(),
        batch,
        requests: results.len(),
        completion_tokens,
        prompt_tokens_mean: prompt_tokens as f64 / results.len().max(1) as f64,
        seconds,
        tokens_per_second: completion_tokens as f64 / seconds,
        p50_latency_s: percentile(&latencies, 50.0),
        p95_latency_s: percentile(&latencies, 95.0),
        prefilled_per_request: f64::NAN,
        server_cpu_ms_per_token: f64::NAN,
    })
}

fn write_config(
    dir: &Path,
    model: &str,
    nats_url: &str,
    args: &BenchGenerateArgs,
) -> Result<PathBuf> {
    let max_batch = args.batches.iter().copied().max().unwrap_or(1);
    let path = dir.join(format!("bench-generate-{}.yaml", sanitize(model)));
    let text = format!(
        "run:\n  env_id: TicTacToe-v0\nconnections:\n  nats_url: {nats_url}\nllm:\n  model: {model:?}\n  gguf_base: {}\n  max_sequences: {max_batch}\n  threads: {}\n",
        args.gguf_base, args.threads
    );
    std::fs::write(&path, text)?;
    Ok(path)
}

fn sanitize(s: &str) -> String {
    s.chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect()
}

/// Runs the benchmark (see the module docs).
pub fn bench_generate(args: BenchGenerateArgs) -> Result<()> {
    if args.batches.is_empty() || args.batches.contains(&0) || args.rounds == 0 {
        bail!("--batches must list positive sizes and --rounds be positive");
    }
    let dir = std::env::temp_dir().join(format!("relay-bench-generate-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let nats_bin = which("nats-server")
        .context("nats-server is not installed; run `bash deploy/install.sh`")?;
    let port = free_port()?;
    let nats = Killed(
        Command::new(nats_bin)
            .args(["-a", "127.0.0.1", "-p", &port.to_string(), "-js", "-sd"])
            .arg(dir.join("nats"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("starting nats-server")?,
    );
    let nats_url = format!("nats://127.0.0.1:{port}");
    let deadline = Instant::now() + Duration::from_secs(30);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        if Instant::now() > deadline {
            bail!("nats-server did not listen on port {port} within 30 s");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let server_bin = sibling_binary("relay-inference-server")?;
    let mut rows = Vec::new();
    for model in &args.models {
        let (label, model_arg) = if model == "tiny" {
            let out = dir.join("tiny");
            relay::model::init_tiny(&out, 0)?;
            ("tiny".to_string(), out.display().to_string())
        } else {
            (model.clone(), model.clone())
        };
        let config = write_config(&dir, &model_arg, &nats_url, &args)?;
        let run_id = format!("bench-generate-{}", sanitize(&label));
        let log = std::fs::File::create(dir.join(format!("{}.log", sanitize(&label))))?;
        let metrics_port = free_port()?;
        let server = Killed(
            Command::new(&server_bin)
                .arg("--config")
                .arg(&config)
                .args(["--run-id", &run_id])
                .args(["--metrics-addr", &format!("127.0.0.1:{metrics_port}")])
                .stdout(Stdio::null())
                .stderr(log)
                .spawn()
                .context("starting relay-inference-server")?,
        );
        let subject = Subjects::new(&run_id).generate();
        let server_pid = server.0.id();
        let result = runtime.block_on(async {
            let client = async_nats::connect(&nats_url).await?;
            // Until the model is loaded and answers; one warm-up request.
            let deadline = Instant::now() + Duration::from_secs(300);
            loop {
                let probe = GenerateRequest::new(
                    None,
                    tic_tac_toe_prompt(0),
                    SamplingParams {
                        max_tokens: 2,
                        ..SamplingParams::default()
                    },
                );
                match relay_kit::request::<_, GenerateReply>(
                    &client,
                    &subject,
                    &probe,
                    Duration::from_secs(120),
                )
                .await
                {
                    Ok(_) => break,
                    Err(e) if Instant::now() > deadline => {
                        bail!(
                            "the inference server did not serve {label}: {e} (log in {})",
                            dir.display()
                        )
                    }
                    Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
                }
            }
            let mut rows = Vec::new();
            for &batch in &args.batches {
                let before = prompt_token_counters(metrics_port);
                let cpu_before = crate::cpu_seconds(server_pid);
                let mut row = one_batch(&client, &subject, &label, batch, &args).await?;
                if let (Some(a), Some(b)) = (cpu_before, crate::cpu_seconds(server_pid)) {
                    row.server_cpu_ms_per_token =
                        (b - a) * 1e3 / row.completion_tokens.max(1) as f64;
                }
                if let (Some(a), Some(b)) = (before, prompt_token_counters(metrics_port)) {
                    let prefilled = (b.0 - a.0) - (b.1 - a.1);
                    row.prefilled_per_request = prefilled / row.requests.max(1) as f64;
                }
                eprintln!(
                    "{label} batch {batch}: {:.1} tokens/s, p50 {:.2} s, p95 {:.2} s, {:.0} prompt tokens prefilled per request, {:.2} server CPU ms per token",
                    row.tokens_per_second, row.p50_latency_s, row.p95_latency_s, row.prefilled_per_request, row.server_cpu_ms_per_token
                );
                rows.push(row);
            }
            Ok::<_, anyhow::Error>(rows)
        });
        drop(server);
        rows.extend(result?);
    }
    drop(nats);
    println!(
        "{:<10} {:>5} {:>8} {:>10} {:>11} {:>10} {:>9} {:>10} {:>8} {:>8} {:>13}",
        "model",
        "batch",
        "requests",
        "tokens",
        "prompt_len",
        "prefilled",
        "seconds",
        "tokens/s",
        "p50 s",
        "p95 s",
        "cpu ms/token"
    );
    for r in &rows {
        println!(
            "{:<10} {:>5} {:>8} {:>10} {:>11.0} {:>10.0} {:>9.2} {:>10.1} {:>8.2} {:>8.2} {:>13.2}",
            r.model,
            r.batch,
            r.requests,
            r.completion_tokens,
            r.prompt_tokens_mean,
            r.prefilled_per_request,
            r.seconds,
            r.tokens_per_second,
            r.p50_latency_s,
            r.p95_latency_s,
            r.server_cpu_ms_per_token
        );
    }
    let mut speedups = serde_json::Map::new();
    for model in rows
        .iter()
        .map(|r| r.model.clone())
        .collect::<std::collections::BTreeSet<_>>()
    {
        let of = |b: usize| {
            rows.iter()
                .find(|r| r.model == model && r.batch == b)
                .map(|r| r.tokens_per_second)
        };
        let (lo, hi) = (args.batches.iter().min(), args.batches.iter().max());
        if let (Some(Some(a)), Some(Some(b))) = (lo.map(|&b| of(b)), hi.map(|&b| of(b))) {
            speedups.insert(model, serde_json::json!(b / a));
        }
    }
    println!(
        "{}",
        serde_json::json!({
            "bench": "generate",
            "threads": args.threads,
            "max_tokens": args.max_tokens,
            "rounds": args.rounds,
            "rows": rows,
            "speedup_largest_over_smallest_batch": speedups,
        })
    );
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}
