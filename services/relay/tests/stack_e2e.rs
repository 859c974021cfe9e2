//! End to end: `relay up` starts real nats-server, redis-server (and
//! prometheus) and all six services as separate processes, trains CartPole
//! on a tiny budget, and stops everything cleanly.

use std::process::Command;

fn read(path: &std::path::Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

#[test]
fn six_services_train_over_nats_and_redis() {
    let dir = relay_testkit::TempDir::new("e2e");
    let runs = dir.path().join("runs");
    let run_id = "e2e-cartpole";
    let config = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../configs/cartpole-ppo.yaml"
    );
    let output = Command::new(env!("CARGO_BIN_EXE_relay"))
        .args([
            "up",
            "--until-solved",
            "--quiet",
            "--config",
            config,
            "--run-id",
            run_id,
        ])
        .arg("--state-dir")
        .arg(dir.path().join("state"))
        .args(["--set", &format!("run.runs_dir={}", runs.display())])
        .args([
            "--set",
            "run.total_env_steps=3072",
            "--set",
            "eval.every_versions=4",
            "--set",
            "eval.episodes=4",
        ])
        .output()
        .expect("run relay up");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "relay up failed\nstdout:\n{stdout}\nstderr:\n{stderr}"
    );
    assert!(stdout.contains("learner finished"), "{stdout}");
    // The summary, once, after the stop (the tracker drew the plots then).
    assert_eq!(stdout.matches("ended:").count(), 1, "{stdout}");
    for part in [
        "relay: run e2e-cartpole ended: ",
        "best eval",
        "plots/return.png",
        "relay top @last",
        "relay play @last",
    ] {
        assert!(stdout.contains(part), "{part:?} missing:\n{stdout}");
    }

    let run_dir = runs.join(run_id);
    // The tracker wrote the run directory.
    assert!(read(&run_dir.join("config.yaml")).contains("CartPole-v1"));
    let metrics = read(&run_dir.join("metrics.jsonl"));
    // Rollouts flowed and the learner updated: 3072 env steps is 12 updates of 256.
    let max_of = |name: &str| -> f64 {
        metrics
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter_map(|v| v["values"][name].as_f64())
            .fold(f64::NAN, f64::max)
    };
    assert!(
        max_of("learner_updates") >= 12.0,
        "learner_updates {} in metrics.jsonl\nstdout:\n{stdout}\nstderr:\n{stderr}\nmetrics.jsonl ends:\n{}",
        max_of("learner_updates"),
        metrics.lines().rev().take(5).collect::<Vec<_>>().join("\n")
    );
    assert!(max_of("learner_env_steps") >= 3072.0);
    // Weights reached the inference server and the env-runner acted with them.
    assert!(
        max_of("inference_weights_version") >= 1.0,
        "inference server never served a new version"
    );
    assert!(max_of("env_runner_policy_version") >= 1.0);
    assert!(max_of("replay_inserted_steps_total") > 0.0 || metrics.contains("replay_size_steps"));
    // Episodes, evals, a status, logs of every service, a checkpoint.
    assert!(!read(&run_dir.join("episodes.jsonl")).is_empty());
    assert!(read(&run_dir.join("eval.jsonl")).contains("\"evaluator\":\"greedy\""));
    assert!(
        read(&run_dir.join("status.json")).contains("\"stopped\"")
            || read(&run_dir.join("status.json")).contains("\"solved\"")
    );
    // The tracker's own first lines precede its subscription to the logs subject.
    for service in [
        "replay-buffer",
        "inference-server",
        "evaluator",
        "env-runner",
        "learner",
    ] {
        let log = read(&run_dir.join("logs").join(format!("{service}.log")));
        assert!(
            log.contains("started"),
            "{service} log lacks its start line:\n{log}"
        );
    }
    assert!(read(&run_dir.join("logs/tracker.log")).contains("run status"));
    assert!(read(&run_dir.join("logs/learner.log")).contains("training finished"));
    assert!(run_dir.join("checkpoints/last/model.safetensors").is_file());
    assert!(run_dir
        .join("checkpoints/last/optimizer.safetensors")
        .is_file());
    // `relay top` on the finished run, with no stack running: what the
    // run directory holds (status, evaluations, the learner's last metrics).
    let mut top = relay::top::TopState::new(run_id);
    let loaded = top.load_run_dir(&run_dir, std::time::Instant::now());
    assert!(loaded > 10, "{loaded} records");
    let mut terminal =
        ratatui::Terminal::new(ratatui::backend::TestBackend::new(120, 40)).expect("test terminal");
    terminal.draw(|f| relay::top::draw(f, &top)).expect("draw");
    let buffer = terminal.backend().buffer();
    let screen: Vec<String> = buffer
        .content
        .chunks(usize::from(buffer.area.width))
        .map(|row| row.iter().map(|c| c.symbol()).collect())
        .collect();
    let screen = screen.join("\n");
    let status = read(&run_dir.join("status.json"));
    let expected = if status.contains("\"solved\"") {
        "solved"
    } else {
        "stopped"
    };
    assert!(screen.contains(expected), "{expected}:\n{screen}");
    assert!(!screen.contains("no evaluation yet"), "{screen}");
    assert!(!screen.contains("waiting for the learner"), "{screen}");
    assert!(top.last_eval().is_some() && top.env_steps() >= Some(3072));

    // Every service stopped on SIGTERM (none had to be killed).
    assert!(
        !stdout.contains("did not stop") && !stderr.contains("did not stop"),
        "{stdout}\n{stderr}"
    );
}

/// Without `--until-solved` the stack stays up when training ends: the
/// summary is printed once, with the plots the tracker drew when the
/// learner finished, the progress lines stop, and Ctrl-C stops the stack.
#[test]
fn a_finished_run_says_so_once_and_the_progress_lines_stop() {
    use std::io::BufRead;
    use std::sync::mpsc;
    use std::time::{Duration, Instant};

    let dir = relay_testkit::TempDir::new("e2e-summary");
    let runs = dir.path().join("runs");
    let config = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../configs/cartpole-ppo.yaml"
    );
    let mut child = Command::new(env!("CARGO_BIN_EXE_relay"))
        .args(["up", "--config", config, "--run-id", "e2e-summary"])
        .arg("--state-dir")
        .arg(dir.path().join("state"))
        .args(["--set", &format!("run.runs_dir={}", runs.display())])
        .args([
            "--set",
            "run.total_env_steps=2048",
            "--set",
            "eval.every_versions=4",
            "--set",
            "eval.episodes=4",
            "--set",
            "eval.threshold=100000",
        ])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("run relay up");
    let (tx, rx) = mpsc::channel::<(Instant, String)>();
    let stdout = child.stdout.take().unwrap();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stdout)
            .lines()
            .map_while(Result::ok)
        {
            let _ = tx.send((Instant::now(), line));
        }
    });
    let mut lines: Vec<(Instant, String)> = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(180);
    let over = loop {
        match rx.recv_timeout(Duration::from_secs(1)) {
            Ok((at, line)) => {
                let done = line.contains("the stack stays up");
                lines.push((at, line));
                if done {
                    break at;
                }
            }
            Err(_) if Instant::now() < deadline => {}
            Err(_) => {
                let _ = child.kill();
                panic!("no end of training within 180 s:\n{lines:#?}");
            }
        }
    };
    // Three quiet seconds: no progress line after the summary.
    std::thread::sleep(Duration::from_secs(3));
    lines.extend(rx.try_iter());
    let text: Vec<&str> = lines.iter().map(|(_, l)| l.as_str()).collect();
    let text = text.join("\n");
    assert!(
        lines
            .iter()
            .all(|(at, l)| *at <= over || !l.starts_with('[')),
        "progress lines after the summary:\n{text}"
    );
    assert!(text.contains("train_return"), "{text}");
    assert!(!text.contains("NaN"), "{text}");
    assert_eq!(text.matches("ended:").count(), 1, "{text}");
    assert!(
        text.contains("relay: run e2e-summary ended: stopped: budget of 2048"),
        "{text}"
    );
    // The tracker drew the plots when the learner finished.
    assert!(text.contains("e2e-summary/plots/return.png"), "{text}");
    assert!(runs.join("e2e-summary/plots/return.png").is_file());

    // Ctrl-C stops the stack.
    unsafe {
        libc::kill(child.id() as i32, libc::SIGINT);
    }
    let status = child.wait().expect("relay up exits");
    assert!(status.success(), "{status}");
    // Until the reader has seen the end of the output.
    while let Ok(line) = rx.recv_timeout(Duration::from_secs(5)) {
        lines.push(line);
    }
    assert!(
        lines
            .iter()
            .any(|(_, l)| l.contains("relay: stack stopped")),
        "{lines:#?}"
    );
    // The training return reached metrics.jsonl and metrics.csv from the
    // tracker itself, whatever the env-runners' report period.
    let metrics = std::fs::read_to_string(runs.join("e2e-summary/metrics.jsonl")).unwrap();
    assert!(
        metrics
            .lines()
            .any(|l| l.contains(r#""service":"tracker""#) && l.contains("episode_return_mean")),
        "{metrics}"
    );
    let csv = std::fs::read_to_string(runs.join("e2e-summary/metrics.csv")).unwrap();
    assert!(csv.contains(",tracker,") && csv.contains("episode_return_mean"));
}
