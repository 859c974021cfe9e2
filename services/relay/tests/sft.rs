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
