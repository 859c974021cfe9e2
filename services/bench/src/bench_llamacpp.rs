//! `relay bench-llamacpp` (`just bench-llamacpp`): relay's CPU engine
//! against llama.cpp on the same SmolLM2-135M-Instruct GGUF file and the
//! same number of threads, side by side in one run.
//!
//! - relay: the file loaded as the inference server loads it
//!   ([`relay_llm::load_causal_lm`] with [`GgufBase::Dequantized`], the
//!   default engine backend, weights packed before timing), decoding
//!   through [`relay_llm::step`] with greedy sampling; rayon's pool (and
//!   candle's, through `RAYON_NUM_THREADS`) sized to `--threads`.
//! - llama.cpp: PyPI's `llama-cpp-python` in its own venv
//!   (`.relay/llama-cpp`, made by `bash deploy/install.sh --llama-cpp`, or
//!   `RELAY_LLAMA_CPP_PYTHON`), driven by `services/bench/llamacpp/bench.py`
//!   with `n_threads` = `n_threads_batch` = `--threads` and `n_batch` 512;
//!   it works on the file's Q4_1 blocks as they are (8-bit activations).
//!
//! Both get the same `--prompt-tokens` token ids (a text tokenized by
//! relay's tokenizer, cut to length; the script reports whether
//! llama.cpp's own tokenizer gives the same ids for that text). One round
//! on each side: a fresh sequence (llama.cpp: its KV cache cleared), the
//! prompt fed in one forward and the first token picked (prompt
//! tokens/s), then `--new-tokens` greedy decode steps at batch 1, each one
//! token (generation tokens/s). Rounds alternate between the two after a
//! warm-up round each; medians are reported. A table (with the ratio
//! relay / llama.cpp) and one JSON line. Where llama.cpp is not installed,
//! its column says so and relay is still measured.

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use relay_llm::{CausalLm, GgufBase, Sampler, SamplingParams, Sequence, StopCondition};

/// `relay bench-llamacpp` flags.
#[derive(Debug, clap::Args)]
pub struct BenchLlamaCppArgs {
    /// Compute threads of both engines (default: every core).
    #[arg(long)]
    pub threads: Option<usize>,
    /// Prompt length in tokens.
    #[arg(long, default_value_t = 200)]
    pub prompt_tokens: usize,
    /// Tokens generated after the prompt, one decode step each (batch 1).
    #[arg(long, default_value_t = 128)]
    pub new_tokens: usize,
    /// Timed rounds on each side (after one warm-up round each); medians are reported.
    #[arg(long, default_value_t = 5)]
    pub rounds: usize,
}

/// The text the prompt's token ids are cut from (long enough for any
/// `--prompt-tokens` up to a few thousand: it is repeated as needed).
const PROMPT_TEXT: &str = "You are playing TicTacToe as X against O on a three by three board. \
The cells are numbered from 0 in the top left corner to 8 in the bottom right corner, row by row. \
On each turn, read the board, think about which cell wins the game or stops your opponent from \
winning, and answer with the number of the cell you play in square brackets, for example [4]. \
A move into an occupied cell is illegal and loses the game at once. ";

/// One round's timings on one side.
#[derive(Debug, Clone, Copy)]
struct Round {
    prompt_s: f64,
    gen_s: f64,
}

/// The median of `v` (`NaN` when empty).
fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// How many leading tokens `a` and `b` share.
fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// Sizes rayon's global pool (relay's engine) and candle's (which reads
/// `RAYON_NUM_THREADS`) to `threads`; fails if the pool already runs
/// with another size.
fn set_threads(threads: usize) -> Result<()> {
    std::env::set_var("RAYON_NUM_THREADS", threads.to_string());
    let _ = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build_global();
    let running = rayon::current_num_threads();
    if running != threads {
        bail!("rayon's pool already runs {running} threads, not {threads}");
    }
    Ok(())
}

/// One round of relay's engine: a fresh sequence, its prompt fed in one
/// step (which picks the first token), then `new_tokens` decode steps.
/// Returns the timings and the greedy tokens.
fn relay_round(model: &CausalLm, prompt: &[u32], new_tokens: usize) -> Result<(Round, Vec<u32>)> {
    let stop = StopCondition {
        max_new_tokens: new_tokens + 1,
        stop_token_ids: Vec::new(),
    };
    let sampler = Sampler::new(SamplingParams::greedy(), 0)?;
    let mut seq = Sequence::new(model, prompt.to_vec(), None, sampler, stop)?;
    let started = Instant::now();
    relay_llm::step(model, &mut [&mut seq])?;
    let prompt_s = started.elapsed().as_secs_f64();
    let started = Instant::now();
    for _ in 0..new_tokens {
        relay_llm::step(model, &mut [&mut seq])?;
    }
    let gen_s = started.elapsed().as_secs_f64();
    if seq.tokens().len() != new_tokens + 1 {
        bail!(
            "relay generated {} tokens, not {}",
            seq.tokens().len(),
            new_tokens + 1
        );
    }
    Ok((Round { prompt_s, gen_s }, seq.tokens().to_vec()))
}

/// The interpreter of llama-cpp-python, if there is one.
fn llama_cpp_python() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("RELAY_LLAMA_CPP_PYTHON") {
        return Some(PathBuf::from(p));
    }
    let local = PathBuf::from(".relay/llama-cpp/bin/python");
    local.is_file().then_some(local)
}

/// llama.cpp in a Python process that runs one round per request.
struct LlamaCpp {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
    /// What the script reported on start (version, system info, tokenizer check).
    info: serde_json::Value,
}

impl LlamaCpp {
    fn start(
        python: &Path,
        gguf: &Path,
        threads: usize,
        prompt: &[u32],
        text: &str,
        new_tokens: usize,
    ) -> Result<Self> {
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("llamacpp/bench.py");
        let mut child = Command::new(python)
            .arg(&script)
            .arg("--model")
            .arg(gguf)
            .args(["--threads", &threads.to_string()])
            .args(["--n-ctx", &(prompt.len() + new_tokens + 16).to_string()])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .with_context(|| format!("running {}", python.display()))?;
        let stdin = child.stdin.take().context("the script's stdin")?;
        let stdout = BufReader::new(child.stdout.take().context("the script's stdout")?);
        let mut this = Self {
            child,
            stdin,
            stdout,
            info: serde_json::Value::Null,
        };
        this.info = this.ask(&serde_json::json!({
            "prompt": prompt,
            "text": text,
            "new_tokens": new_tokens,
        }))?;
        Ok(this)
    }

    /// Sends one JSON line and reads the JSON line the script answers.
    fn ask(&mut self, request: &serde_json::Value) -> Result<serde_json::Value> {
        writeln!(self.stdin, "{request}")?;
        self.stdin.flush()?;
        let mut line = String::new();
        if self.stdout.read_line(&mut line)? == 0 {
            let status = self.child.wait()?;
            bail!("the llama.cpp script ended ({status}); its errors are above");
        }
        serde_json::from_str(line.trim()).with_context(|| format!("the script said: {line}"))
    }

    /// One round: timings and the greedy tokens.
    fn round(&mut self) -> Result<(Round, Vec<u32>)> {
        let answer = self.ask(&serde_json::json!({"round": true}))?;
        let seconds = |key: &str| {
            answer[key]
                .as_f64()
                .with_context(|| format!("no {key} in {answer}"))
        };
        let round = Round {
            prompt_s: seconds("prompt_s")?,
            gen_s: seconds("gen_s")?,
        };
        let tokens = answer["tokens"]
            .as_array()
            .context("no tokens")?
            .iter()
            .map(|t| t.as_u64().map(|t| t as u32).context("a token id"))
            .collect::<Result<Vec<u32>>>()?;
        Ok((round, tokens))
    }
}

impl Drop for LlamaCpp {
    fn drop(&mut self) {
        // The script holds nothing that needs a clean exit.
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Medians of the rounds: (prompt tokens/s, generation tokens/s).
fn rates(rounds: &[Round], prompt_tokens: usize, new_tokens: usize) -> (f64, f64) {
    (
        median(
            rounds
                .iter()
                .map(|r| prompt_tokens as f64 / r.prompt_s)
                .collect(),
        ),
        median(rounds.iter().map(|r| new_tokens as f64 / r.gen_s).collect()),
    )
}

fn cell(v: Option<f64>) -> String {
    v.map_or_else(|| "-".into(), |v| format!("{v:.1}"))
}

/// `relay bench-llamacpp`.
pub fn bench_llamacpp(args: BenchLlamaCppArgs) -> Result<()> {
    let threads = args
        .threads
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    if threads == 0 || args.prompt_tokens == 0 || args.new_tokens == 0 || args.rounds == 0 {
        bail!("--threads, --prompt-tokens, --new-tokens and --rounds must be at least 1");
    }
    set_threads(threads)?;
    let cpu = crate::cpu_name();
    let simd = crate::cpu_simd();
    let thread_s = if threads == 1 { "thread" } else { "threads" };
    println!("relay bench-llamacpp: CPU {cpu} ({simd}), {threads} {thread_s}");

    let (model, gguf) = relay_llm::load_causal_lm("smollm2", GgufBase::Dequantized)
        .context("SmolLM2-135M-Instruct (run `bash deploy/install.sh`)")?;
    let tokenizer = relay_llm::load_tokenizer(&gguf)?;
    model.prepare_inference()?;
    println!("== {}", gguf.display());

    let mut repeats = 1;
    let prompt = loop {
        let ids = tokenizer
            .encode(&PROMPT_TEXT.repeat(repeats), false)
            .context("tokenizing the prompt")?;
        if ids.len() >= args.prompt_tokens {
            break ids[..args.prompt_tokens].to_vec();
        }
        repeats *= 2;
    };
    let text = tokenizer.decode(&prompt, false)?;

    let mut llama = match llama_cpp_python() {
        None => Err("not installed (bash deploy/install.sh --llama-cpp)".to_string()),
        Some(python) => LlamaCpp::start(&python, &gguf, threads, &prompt, &text, args.new_tokens)
            .map_err(|e| format!("{e:#}")),
    };
    match &llama {
        Ok(l) => println!("== llama.cpp: {}", l.info),
        Err(e) => println!("== llama.cpp: {e}; its column is missing"),
    }

    let mut relay_rounds = Vec::new();
    let mut llama_rounds = Vec::new();
    let (mut relay_tokens, mut llama_tokens) = (Vec::new(), Vec::new());
    let round_rates = |r: &Round| {
        format!(
            "{:>8.1} prompt tok/s {:>7.1} gen tok/s",
            args.prompt_tokens as f64 / r.prompt_s,
            args.new_tokens as f64 / r.gen_s
        )
    };
    for round in 0..=args.rounds {
        let label = if round == 0 {
            "warm-up".to_string()
        } else {
            format!("round {round}")
        };
        let (r, tokens) = relay_round(&model, &prompt, args.new_tokens)?;
        print!("   {label:<8} relay {}", round_rates(&r));
        relay_tokens = tokens;
        if round > 0 {
            relay_rounds.push(r);
        }
        if let Ok(l) = &mut llama {
            match l.round() {
                Ok((r, tokens)) => {
                    print!(" | llama.cpp {}", round_rates(&r));
                    llama_tokens = tokens;
                    if round > 0 {
                        llama_rounds.push(r);
                    }
                }
                Err(e) => llama = Err(format!("{e:#}")),
            }
        }
        println!();
    }
    if let Err(e) = &llama {
        println!("== llama.cpp: {e}");
    }
    let llama_info = llama.as_ref().map(|l| l.info.clone()).ok();
    drop(llama);

    let (relay_prompt, relay_gen) = rates(&relay_rounds, args.prompt_tokens, args.new_tokens);
    let llama_rates = (!llama_rounds.is_empty())
        .then(|| rates(&llama_rounds, args.prompt_tokens, args.new_tokens));
    let agree = (!llama_tokens.is_empty()).then(|| common_prefix(&relay_tokens, &llama_tokens));
    let version = llama_info
        .as_ref()
        .and_then(|i| i["version"].as_str())
        .unwrap_or("?")
        .to_string();

    println!();
    println!(
        "CPU {cpu} ({simd}), {threads} {thread_s}; medians of {} rounds",
        args.rounds
    );
    println!(
        "| SmolLM2-135M-Instruct Q4_1 GGUF | relay engine (f32, dequantized) | llama.cpp (llama-cpp-python {version}, Q4_1) | relay / llama.cpp |"
    );
    println!("|---|---:|---:|---:|");
    let rows = [
        (
            format!("prompt tok/s ({} tokens)", args.prompt_tokens),
            relay_prompt,
            llama_rates.map(|r| r.0),
        ),
        (
            format!("generation tok/s (B = 1, {} tokens)", args.new_tokens),
            relay_gen,
            llama_rates.map(|r| r.1),
        ),
    ];
    for (name, relay, llama) in &rows {
        let ratio = llama.map(|l| relay / l);
        println!(
            "| {name} | {relay:.1} | {} | {} |",
            cell(*llama),
            ratio.map_or_else(|| "-".into(), |r| format!("{r:.2}"))
        );
    }
    if let Some(agree) = agree {
        println!(
            "greedy tokens: the two engines agree on the first {agree} of {}",
            args.new_tokens + 1
        );
    }
    let round_json = |rounds: &[Round]| {
        rounds
            .iter()
            .map(|r| serde_json::json!({"prompt_s": r.prompt_s, "gen_s": r.gen_s}))
            .collect::<Vec<_>>()
    };
    let json = serde_json::json!({
        "bench": "llamacpp",
        "model": gguf.file_name().map(|name| name.to_string_lossy().into_owned()),
        "cpu": cpu,
        "simd": simd,
        "threads": threads,
        "prompt_tokens": args.prompt_tokens,
        "new_tokens": args.new_tokens,
        "rounds": args.rounds,
        "relay": {
            "engine": "engine (cpu, f32, GGUF dequantized)",
            "prompt_tokens_per_s": relay_prompt,
            "gen_tokens_per_s": relay_gen,
            "rounds": round_json(&relay_rounds),
        },
        "llama_cpp": llama_rates.map(|(p, g)| serde_json::json!({
            "info": llama_info,
            "prompt_tokens_per_s": p,
            "gen_tokens_per_s": g,
            "rounds": round_json(&llama_rounds),
        })),
        "relay_over_llama_cpp": llama_rates.map(|(p, g)| serde_json::json!({
            "prompt": relay_prompt / p,
            "gen": relay_gen / g,
        })),
        "greedy_tokens_agreeing": agree,
    });
    println!("{json}");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn medians_and_prefixes() {
        assert_eq!(median(vec![3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(vec![4.0, 1.0, 2.0, 3.0]), 2.5);
        assert!(median(Vec::new()).is_nan());
        assert_eq!(common_prefix(&[1, 2, 3], &[1, 2, 4, 5]), 2);
        assert_eq!(common_prefix(&[], &[1]), 0);
    }

    #[test]
    fn rates_are_tokens_over_median_seconds() {
        let rounds = [
            Round {
                prompt_s: 1.0,
                gen_s: 2.0,
            },
            Round {
                prompt_s: 2.0,
                gen_s: 4.0,
            },
            Round {
                prompt_s: 4.0,
                gen_s: 8.0,
            },
        ];
        assert_eq!(rates(&rounds, 200, 64), (100.0, 16.0));
    }

    #[test]
    fn the_script_is_where_the_bench_runs_it() {
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("llamacpp/bench.py");
        assert!(script.is_file(), "{}", script.display());
    }
}
