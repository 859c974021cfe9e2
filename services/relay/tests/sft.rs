//! `relay sft` through the binary, on the tiny Qwen2 fixture: a LoRA
//! adapter from bot games (written in PEFT's format, the examples saved),
//! then the whole model from that JSONL file; and bad flags refused.

use std::path::Path;
use std::process::Command;

use relay_llm::{LoraAdapter, ModelConfig};

fn tiny_qwen2() -> String {
    relay_testkit::llm_fixture("tiny-qwen2")
        .to_string_lossy()
        .into_owned()
}

fn relay_sft(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_relay"))
        .arg("sft")
        .args(args)
        .output()
        .expect("run relay sft")
}

fn summary(out: &Path) -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(out.join("sft.json")).expect("sft.json")).unwrap()
}

#[test]
fn sft_trains_an_adapter_from_bot_games_then_a_whole_model_from_jsonl() {
    let tmp = relay_testkit::TempDir::new("sft");
    let model = tiny_qwen2();
    let out = tmp.path().join("lora");
    let data = tmp.path().join("games.jsonl");
    let output = relay_sft(&[
        "--model",
        &model,
        "--out",
        out.to_str().unwrap(),
        "--games",
        "4",
        "--bots",
        "minimax,random",
        "--write-data",
        data.to_str().unwrap(),
        "--epochs",
        "3",
        "--batch-size",
        "8",
        "--minibatch-size",
        "4",
        "--lr",
        "0.01",
        "--eval-games",
        "1",
    ]);
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    // The last line is the summary as JSON, as sft.json holds it.
    let last: serde_json::Value =
        serde_json::from_str(stdout.lines().last().unwrap()).expect("JSON last line");
    let written = summary(&out);
    assert_eq!(last, written);
    let epochs = written["epochs"].as_array().unwrap();
    assert_eq!(epochs.len(), 3);
    let loss = |e: &serde_json::Value| e["train_loss"].as_f64().unwrap();
    assert!(
        loss(&epochs[2]) < loss(&epochs[0]),
        "the loss did not fall: {epochs:?}"
    );
    // Both seats against each evaluation opponent, before and after.
    for when in ["before", "after"] {
        let results = written[when].as_array().unwrap();
        assert_eq!(results.len(), 2, "{when}: {results:?}");
        for r in results {
            assert_eq!(r["games"], 2, "{r}");
            assert!(r["moves"].as_u64().unwrap() >= 2, "{r}");
        }
    }
    // Every move of the 4 games is one example; the adapter loads in PEFT's format.
    let lines = std::fs::read_to_string(&data).unwrap();
    let pairs: Vec<serde_json::Value> = lines
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert!(pairs.len() >= 4 * 5, "{} examples", pairs.len());
    assert!(pairs
        .iter()
        .all(|p| p["prompt"].is_string() && p["completion"].as_str().unwrap().starts_with('[')));
    assert_eq!(
        written["examples"].as_u64().unwrap() + written["holdout_examples"].as_u64().unwrap(),
        pairs.len() as u64
    );
    let config = ModelConfig::from_hf_file(&Path::new(&model).join("config.json")).unwrap();
    LoraAdapter::load_peft(&out.join("adapter"), &config).expect("the adapter loads back");

    // The whole model, from the JSONL file: a Hugging Face folder that serves.
    let full = tmp.path().join("full");
    let output = relay_sft(&[
        "--model",
        &model,
        "--out",
        full.to_str().unwrap(),
        "--full",
        "--data",
        data.to_str().unwrap(),
        "--epochs",
        "1",
        "--batch-size",
        "8",
        "--eval-games",
        "0",
    ]);
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert_eq!(summary(&full)["trained"], "model");
    let loaded = relay_llm::load_model(
        full.join("model").to_str().unwrap(),
        relay_config::GgufBaseName::Dequantized,
    )
    .expect("the trained model loads as llm.model");
    assert_eq!(loaded.model.config().hidden_size, config.hidden_size);
}

/// `--answer boxed`: the bots' moves become `\boxed{N}` targets (their
/// alternatives too), as a run with `text.answer: boxed` reads them.
#[test]
fn sft_writes_the_bots_moves_in_the_answer_format() {
    let tmp = relay_testkit::TempDir::new("sft-answer");
    let model = tiny_qwen2();
    let out = tmp.path().join("boxed");
    let data = tmp.path().join("boxed.jsonl");
    let output = relay_sft(&[
        "--model",
        &model,
        "--out",
        out.to_str().unwrap(),
        "--games",
        "2",
        "--bots",
        "random,random",
        "--answer",
        "boxed",
        "--write-data",
        data.to_str().unwrap(),
        "--epochs",
        "1",
        "--eval-games",
        "1",
    ]);
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let boxed = |m: &serde_json::Value| {
        let m = m.as_str().unwrap();
        m.strip_prefix("\\boxed{")
            .and_then(|m| m.strip_suffix('}'))
            .is_some_and(|cell| cell.parse::<u8>().is_ok_and(|c| c < 9))
    };
    let lines = std::fs::read_to_string(&data).unwrap();
    assert!(lines.lines().count() >= 2 * 5);
    for line in lines.lines() {
        let pair: serde_json::Value = serde_json::from_str(line).unwrap();
        assert!(boxed(&pair["completion"]), "{pair}");
        let alternatives = pair["alternatives"].as_array().unwrap();
        assert!(
            !alternatives.is_empty() && alternatives.iter().all(boxed),
            "{pair}"
        );
    }
    assert_eq!(summary(&out)["after"].as_array().unwrap().len(), 2);
}

#[test]
fn sft_refuses_bad_flags_with_clear_errors() {
    let tmp = relay_testkit::TempDir::new("sft-bad");
    let out = tmp.path().join("out");
    for (args, wanted) in [
        (vec!["--env", "CartPole-v1"], "not a text game"),
        (vec!["--bots", "random"], "2 seats, got 1 bots"),
        (vec!["--bots", "random,chess_engine"], "--bots"),
        (vec!["--holdout", "1.5"], "--holdout"),
        (vec!["--answer", "json"], "unknown answer format"),
        (vec!["--dtype", "f8"], "not a dtype"),
        (
            vec!["--backend", "candle", "--dtype", "bf16", "--full"],
            "full fine-tuning trains f32",
        ),
        (vec!["--backend", "engine", "--dtype", "bf16"], "llm.dtype"),
    ] {
        let model = tiny_qwen2();
        let mut all = vec!["--model", model.as_str(), "--out", out.to_str().unwrap()];
        all.extend(args.iter().copied());
        let output = relay_sft(&all);
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(!output.status.success(), "{args:?} was accepted");
        assert!(stderr.contains(wanted), "{args:?}: {stderr}");
    }
}

/// LoRA SFT on the candle backend (the composed training forward, as on a
/// GPU; here on the CPU): the loss falls and the adapter is written.
#[test]
fn sft_trains_an_adapter_on_the_candle_backend() {
    let tmp = relay_testkit::TempDir::new("sft-candle");
    let model = tiny_qwen2();
    let out = tmp.path().join("lora");
    let output = relay_sft(&[
        "--model",
        &model,
        "--out",
        out.to_str().unwrap(),
        "--backend",
        "candle",
        "--games",
        "4",
        "--epochs",
        "3",
        "--batch-size",
        "8",
        "--minibatch-size",
        "4",
        "--lr",
        "0.01",
        "--eval-games",
        "1",
    ]);
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let written = summary(&out);
    let epochs = written["epochs"].as_array().unwrap();
    let loss = |e: &serde_json::Value| e["train_loss"].as_f64().unwrap();
    assert!(
        loss(&epochs[2]) < loss(&epochs[0]),
        "the loss did not fall: {epochs:?}"
    );
    assert!(out.join("adapter/adapter_model.safetensors").is_file());
}

/// The training every replica test runs: long enough (66 steps) for a
/// replica to be killed and another to join while it trains.
const REPLICATED: &[&str] = &[
    "--games",
    "12",
    "--epochs",
    "6",
    "--batch-size",
    "8",
    "--minibatch-size",
    "2",
    "--lr",
    "0.01",
    "--seed",
    "3",
    "--eval-games",
    "0",
];

/// An adapter's tensors by name.
fn adapter_tensors(out: &Path) -> std::collections::HashMap<String, candle_core::Tensor> {
    candle_core::safetensors::load(
        out.join("adapter/adapter_model.safetensors"),
        &candle_core::Device::Cpu,
    )
    .expect("the adapter's safetensors")
}

/// max |a - b| / (1 + |b|) over every tensor of two adapters.
fn adapter_gap(a: &Path, b: &Path) -> f32 {
    let (a, b) = (adapter_tensors(a), adapter_tensors(b));
    assert_eq!(a.len(), b.len());
    let mut gap = 0f32;
    for (name, x) in &a {
        let x = x.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let y = b[name].flatten_all().unwrap().to_vec1::<f32>().unwrap();
        for (x, y) in x.iter().zip(&y) {
            gap = gap.max((x - y).abs() / (1.0 + y.abs()));
        }
    }
    gap
}

/// `relay sft --replicas 2` (the nats-server and the second replica
/// started by the command itself) ends where one process does: the same
/// losses and an adapter within 1e-4. Not bit-equal: the replicas add the
/// micro-batches' gradients in another order (each its part, then the
/// parts), and AdamW carries the last bits forward; 66 steps here end
/// about 1e-6 apart, while one lost or doubled step at learning rate 0.01
/// moves every factor by about 1e-2.
///
/// Then 3 replicas started by hand on one NATS (as on three machines): one
/// that is not rank 0 is killed after the first epoch, the other two
/// re-form and go on, a fourth joins, takes rank 0's state and trains with
/// them, and the adapter still ends within 1e-4 of the lone process's: no
/// step was lost or applied twice.
#[test]
fn sft_replicas_train_as_one_process_does_and_survive_a_kill_and_a_join() {
    let tmp = relay_testkit::TempDir::new("sft-replicas");
    let model = tiny_qwen2();
    let run = |out: &Path, extra: &[&str]| {
        let mut args = vec!["--model", model.as_str(), "--out", out.to_str().unwrap()];
        args.extend_from_slice(REPLICATED);
        args.extend_from_slice(extra);
        let output = relay_sft(&args);
        let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
        assert!(
            output.status.success(),
            "{extra:?}: {stdout}\n{}",
            String::from_utf8_lossy(&output.stderr)
        );
        stdout
    };
    let lone = tmp.path().join("lone");
    run(&lone, &[]);
    let two = tmp.path().join("two");
    let stdout = run(&two, &["--replicas", "2"]);
    assert!(stdout.contains("as 2 data-parallel replicas"), "{stdout}");
    let losses = |out: &Path| -> Vec<f64> {
        summary(out)["epochs"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| e["train_loss"].as_f64().unwrap())
            .collect()
    };
    let (alone, replicated) = (losses(&lone), losses(&two));
    assert_eq!(alone.len(), 6);
    for (a, r) in alone.iter().zip(&replicated) {
        assert!(
            (a - r).abs() < 1e-4 * (1.0 + a.abs()),
            "{alone:?} {replicated:?}"
        );
    }
    let gap = adapter_gap(&two, &lone);
    assert!(gap < 1e-4, "2 replicas end {gap:e} from one process");

    // Three by hand, one killed, one joining.
    let nats = relay_testkit::NatsServer::start().expect("nats-server");
    let url = nats.url();
    let elastic = tmp.path().join("elastic");
    let start = |log: &str| {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_relay"));
        cmd.args(["sft", "--model", &model, "--out", elastic.to_str().unwrap()])
            .args(REPLICATED)
            .args(["--nats", &url, "--group", "elastic", "--replicas", "3"])
            .stdout(std::fs::File::create(tmp.path().join(format!("{log}.out"))).unwrap())
            .stderr(std::fs::File::create(tmp.path().join(format!("{log}.err"))).unwrap());
        cmd.spawn().expect("start a replica")
    };
    let read = |log: &str| std::fs::read_to_string(tmp.path().join(log)).unwrap_or_default();
    let mut replicas: Vec<_> = ["a", "b", "c"]
        .iter()
        .map(|log| (*log, start(log)))
        .collect();
    // Rank 0 prints; the others print nothing.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(240);
    let leader = loop {
        if let Some((log, _)) = replicas
            .iter()
            .find(|(log, _)| read(&format!("{log}.out")).contains("\n    1 "))
        {
            break *log;
        }
        assert!(std::time::Instant::now() < deadline, "no first epoch");
        std::thread::sleep(std::time::Duration::from_millis(50));
    };
    let victim = replicas.iter().position(|(log, _)| *log != leader).unwrap();
    let (_, mut killed) = replicas.remove(victim);
    killed.kill().unwrap();
    killed.wait().unwrap();
    let wait_for = |line: &str| loop {
        if read(&format!("{leader}.out")).contains(line) {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "no {line:?}");
        std::thread::sleep(std::time::Duration::from_millis(50));
    };
    wait_for("replicas: 3 -> 2 at epoch");
    replicas.push(("d", start("d")));
    wait_for("replicas: 2 -> 3 at epoch");
    for (log, mut child) in replicas {
        let status = child.wait().unwrap();
        assert!(
            status.success(),
            "replica {log}: {status}\n{}\n{}",
            read(&format!("{log}.out")),
            read(&format!("{log}.err"))
        );
    }
    let printed = read(&format!("{leader}.out"));
    assert_eq!(losses(&elastic).len(), 6, "{printed}");
    let gap = adapter_gap(&elastic, &lone);
    assert!(
        gap < 1e-4,
        "the elastic replicas end {gap:e} from one process\n{printed}"
    );
}

/// A replica whose training differs from rank 0's (here another `--seed`,
/// as a second training sharing the group's name would) stops with that
/// reason instead of mixing its gradients in; rank 0 goes on alone.
#[test]
fn sft_replicas_of_another_training_are_refused() {
    let tmp = relay_testkit::TempDir::new("sft-replicas-mixed");
    let model = tiny_qwen2();
    let nats = relay_testkit::NatsServer::start().expect("nats-server");
    let url = nats.url();
    let start = |seed: &str| {
        Command::new(env!("CARGO_BIN_EXE_relay"))
            .args(["sft", "--model", &model, "--out"])
            .arg(tmp.path().join(seed))
            .args(["--games", "2", "--epochs", "1", "--eval-games", "0"])
            .args(["--seed", seed, "--nats", &url, "--replicas", "2"])
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("start a replica")
    };
    let (first, second) = (start("1"), start("2"));
    let outputs = [
        first.wait_with_output().unwrap(),
        second.wait_with_output().unwrap(),
    ];
    let refused = outputs
        .iter()
        .filter(|o| {
            !o.status.success()
                && String::from_utf8_lossy(&o.stderr).contains("differs from rank 0's")
        })
        .count();
    let finished = outputs.iter().filter(|o| o.status.success()).count();
    let show = || {
        outputs
            .iter()
            .map(|o| String::from_utf8_lossy(&o.stderr).into_owned())
            .collect::<Vec<_>>()
            .join("\n---\n")
    };
    assert_eq!((refused, finished), (1, 1), "{}", show());
}
