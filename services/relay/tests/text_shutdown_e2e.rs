//! A text learner stops within its promise in the middle of an update, end
//! to end: `relay up` on TicTacToe GRPO (configs/tictactoe-grpo.yaml) with
//! a random Qwen2 large enough that an update takes seconds (8 blocks,
//! hidden 256: a SmolLM2 update takes tens), stopped by Ctrl-C a quarter
//! into the learner's second update. The learner ends within 2 s of
//! Ctrl-C (its SIGTERM comes first in the stack's order), nobody is
//! killed, the update is rolled back: the final checkpoint holds the first
//! update, its adapter and AdamW state byte for byte as they were written
//! after it. The same with two learner replicas: whichever stops first
//! leaves the group, the other's step fails there (its sum's neighbour
//! gone) and is rolled back too, neither waiting for the other.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use relay_llm::{init, TinyShape, TinyVocab, Tokenizer};
use relay_testkit::{stack_record, Supervisor};

/// The promise of every service: stopped within 2 s of its SIGTERM.
const PROMISE: Duration = Duration::from_secs(2);

/// The tiny tokenizer and a random Qwen2 of 8 blocks, hidden 256 (6.4 M
/// parameters besides the embeddings): a micro-batch of 8 moves takes
/// seconds on two CPU cores, one block of it a tenth of that.
fn write_model(out: &Path) {
    std::fs::create_dir_all(out).unwrap();
    let size = relay_llm::write_tiny_tokenizer(out).unwrap();
    let tokenizer = Tokenizer::from_hf_dir(out).unwrap();
    let vocab = TinyVocab {
        size,
        bos_token_id: tokenizer.bos_token_id(),
        eos_token_id: tokenizer.eos_token_id(),
        pad_token_id: tokenizer.special_tokens().pad.as_ref().map(|t| t.id),
    };
    let shape = TinyShape {
        hidden_size: 256,
        intermediate_size: 768,
        num_hidden_layers: 8,
        num_attention_heads: 4,
        num_key_value_heads: 2,
        ..TinyShape::default()
    };
    init::tiny_with_shape(out, 0, &vocab, &shape).unwrap();
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_default()
}

/// One stack at a time: two on two cores would make one's updates slower
/// than the other's, and an update timed under the other stack's load a
/// poor guide to the next one's middle.
static ONE_STACK: std::sync::Mutex<()> = std::sync::Mutex::new(());

#[test]
fn a_text_learner_stops_within_its_promise_in_the_middle_of_an_update() {
    stops_in_the_middle_of_an_update(1);
}

/// Two replicas, each stopped in the middle of the same step: neither
/// waits for the other.
#[test]
fn text_learner_replicas_stop_within_their_promise_in_the_middle_of_an_update() {
    stops_in_the_middle_of_an_update(2);
}

/// `relay up --learners learners`, Ctrl-C a quarter into the second update.
fn stops_in_the_middle_of_an_update(learners: usize) {
    let _one_stack = ONE_STACK.lock().unwrap_or_else(|e| e.into_inner());
    let dir = relay_testkit::TempDir::new("text-shutdown-e2e");
    let model = dir.path().join("model");
    write_model(&model);
    let config = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../configs/tictactoe-grpo.yaml"
    );
    let state = dir.path().join("state");
    let runs = dir.path().join("runs");
    let output = dir.path().join("relay-up.log");
    let log = std::fs::File::create(&output).unwrap();
    let sets = [
        format!("run.runs_dir={}", runs.display()),
        format!("llm.model={}", model.display()),
        // Two micro-batches of 8 moves, three epochs: an update of
        // seconds, a checkpoint after each.
        "rl.batch_size=16".into(),
        "rl.epochs=3".into(),
        "rl.checkpoint_every=1".into(),
        "text.games_in_flight=4".into(),
    ];
    let mut command = Command::new(env!("CARGO_BIN_EXE_relay"));
    command
        .args(["up", "--quiet", "--run-id", "e2e-text-shutdown", "--config"])
        .arg(config)
        .arg("--state-dir")
        .arg(&state)
        // The learner logs each update's start at debug.
        .env("RUST_LOG", "info,relay_learner=debug")
        // Games are what the update needs: no evaluation to share the
        // cores with.
        .args(["--without", "evaluator"])
        .args(["--learners", &learners.to_string()]);
    for set in &sets {
        command.args(["--set", set]);
    }
    let mut up = Supervisor(
        command
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("start relay up"),
    );
    let learner_log = state.join("logs/learner-0.log");
    let checkpoints = runs.join("e2e-text-shutdown/checkpoints");

    // Until the learner is inside its second update (the first one's
    // checkpoint written before it began).
    let deadline = Instant::now() + Duration::from_secs(300);
    let pids: BTreeMap<String, u32> = loop {
        assert!(
            matches!(up.0.try_wait(), Ok(None)),
            "relay up ended early:\n{}",
            read(&output)
        );
        assert!(
            Instant::now() < deadline,
            "the second update never began:\n{}\nlearner:\n{}",
            read(&output),
            read(&learner_log)
        );
        std::thread::sleep(Duration::from_millis(20));
        if !read(&learner_log).contains("update starts step=1 ") {
            continue;
        }
        let record = stack_record(&state).expect("the stack is recorded");
        break record["processes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| {
                (
                    p["name"].as_str().unwrap().to_string(),
                    p["pid"].as_u64().unwrap() as u32,
                )
            })
            .collect();
    };
    let first = checkpoints.join("00000001");
    let files = ["adapter/adapter_model.safetensors", "optimizer.safetensors"];
    let written: Vec<Vec<u8>> = files
        .iter()
        .map(|f| std::fs::read(first.join(f)).unwrap())
        .collect();
    // A quarter into the update (in its first or second epoch, if it takes
    // as long as the first one: the first also pays for warming up, so the
    // second may be shorter).
    let first_update: f64 = read(&learner_log)
        .lines()
        .find(|l| l.contains(" update version=1 "))
        .and_then(|l| l.split("seconds=").nth(1)?.trim().parse().ok())
        .unwrap_or_else(|| {
            panic!(
                "the first update's time is not logged:\n{}",
                read(&learner_log)
            )
        });
    std::thread::sleep(Duration::from_secs_f64(first_update / 4.0));

    // Ctrl-C, and each process's end, from then.
    let all: Vec<u32> = pids.values().copied().collect();
    let by_pid = up.interrupt_and_time(&all, &output);
    let ended_at: BTreeMap<&str, Duration> = pids
        .iter()
        .map(|(name, pid)| (name.as_str(), by_pid[pid]))
        .collect();
    let status = up.0.wait().unwrap();
    let text = read(&output);
    assert!(status.success(), "relay up: {status}\n{text}");
    assert!(
        !text.contains("did not stop within") && !text.contains("killing"),
        "{text}"
    );
    let report: Vec<String> = ended_at
        .iter()
        .map(|(name, at)| format!("{name} {:.2}s", at.as_secs_f64()))
        .collect();
    eprintln!("ended after Ctrl-C: {report:?}");
    for (name, &at) in &ended_at {
        if name.starts_with("learner-") {
            assert!(at < PROMISE, "{name}: {at:?}; {report:?}");
        }
    }

    // The update was cut short and rolled back, by the stop or (a replica)
    // by the other replica's leaving first: the final checkpoint holds the
    // first update, as written after it.
    let rolled_back = |replica: usize| -> Vec<String> {
        read(&state.join(format!("logs/learner-{replica}.log")))
            .lines()
            .filter(|l| {
                l.contains("update stopped part-way and rolled back")
                    || l.contains("a replica failed inside the step; rolling back")
            })
            .map(str::to_string)
            .collect()
    };
    eprintln!("the first update took {first_update:.2} s");
    for replica in 0..learners {
        let lines = rolled_back(replica);
        eprintln!("learner-{replica}: {lines:?}");
        assert!(
            lines.iter().any(|l| l.contains("step=1"))
                && (learners > 1 || lines[0].contains("update stopped part-way")),
            "learner-{replica}:\n{}",
            read(&state.join(format!("logs/learner-{replica}.log")))
        );
    }
    let last = std::fs::canonicalize(checkpoints.join("last")).unwrap();
    assert_eq!(last, std::fs::canonicalize(&first).unwrap());
    let saved: serde_json::Value = serde_json::from_str(&read(&last.join("state.json"))).unwrap();
    assert_eq!(saved["updates"], 1, "{saved}");
    for (file, bytes) in files.iter().zip(&written) {
        assert!(
            std::fs::read(last.join(file)).unwrap() == *bytes,
            "{file} differs from the first update's"
        );
    }
}
