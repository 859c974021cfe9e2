//! Learning curves from a synthetic run directory: the data read from the
//! JSONL files, and valid PNG files written to `plots/`.

use std::io::Write;
use std::path::Path;

use relay_runs::plots::{draw_run, Curves};
use relay_testkit::TempDir;
use serde_json::json;

/// Writes a plausible run: 2 env-runner copies (8 envs each), a learner
/// updating every 256 vec steps, an eval every 4 versions, episode batches.
pub fn synthetic_run(dir: &Path, updates: u64) {
    std::fs::create_dir_all(dir).unwrap();
    let mut metrics = std::fs::File::create(dir.join("metrics.jsonl")).unwrap();
    let mut evals = std::fs::File::create(dir.join("eval.jsonl")).unwrap();
    let mut episodes = std::fs::File::create(dir.join("episodes.jsonl")).unwrap();
    let time = "2025-01-01T00:00:00.000Z";
    let mut runner_vec = [0u64; 2];
    for v in 1..=updates {
        for (i, steps) in runner_vec.iter_mut().enumerate() {
            *steps += 128;
            let ret = 20.0 + 400.0 * (v as f64 / updates as f64) + i as f64 * 5.0;
            writeln!(
                metrics,
                "{}",
                json!({"time": time, "service": "env-runner", "instance": format!("env-runner-{i}"), "vec_steps": *steps,
                       "values": {"env_steps_total": 1024.0, "vec_steps_total": 128.0, "env_runner_policy_version": (v - 1) as f64, "env_runner_sps": 3000.0 + 100.0 * i as f64 + (v % 5) as f64 * 50.0,
                                  "env_runner_episode_return_mean": ret}})
            )
            .unwrap();
            writeln!(
                episodes,
                "{}",
                json!({"time": time, "runner": format!("env-runner-{i}"), "env_id": "CartPole-v1", "policy_version": v - 1,
                       "episodes": [{"return": ret, "length": ret as u64, "terminated": true}]})
            )
            .unwrap();
        }
        let vec_steps = v * 256;
        let progress = v as f64 / updates as f64;
        writeln!(
            metrics,
            "{}",
            json!({"time": time, "service": "learner", "instance": "learner-1", "vec_steps": vec_steps,
                   "values": {"learner_policy_version": v as f64, "learner_env_steps": (vec_steps * 8) as f64,
                              "learner_vec_steps": vec_steps as f64, "learner_sps": 5000.0 + 1000.0 * progress,
                              "learner_policy_loss": -0.02 * (1.0 - progress) + 0.003 * ((v % 3) as f64),
                              "learner_value_loss": 40.0 * (1.0 - progress).powi(2) + 1.0,
                              "learner_entropy": 0.69 - 0.4 * progress}})
        )
        .unwrap();
        if v % 4 == 0 {
            let mean = 30.0 + 470.0 * progress.powi(2);
            writeln!(
                evals,
                "{}",
                json!({"time": time, "evaluator": "greedy", "instance": "evaluator-1", "policy_version": v,
                       "learner_env_steps": vec_steps * 8, "mean_return": mean, "std_return": 20.0 * (1.0 - progress) + 1.0,
                       "returns": [mean], "threshold": 475.0, "solved": mean >= 475.0})
            )
            .unwrap();
        }
    }
    // A torn last line, as a killed writer leaves it.
    write!(metrics, "{{\"time\": \"2025-01-01T00:00:00.000Z\", \"serv").unwrap();
}

/// Checks the PNG signature, the IHDR size, and that the file is not trivially small.
fn assert_png(path: &Path, size: (u32, u32)) {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    assert_eq!(
        &bytes[..8],
        b"\x89PNG\r\n\x1a\n",
        "{} is not a PNG",
        path.display()
    );
    assert_eq!(&bytes[12..16], b"IHDR");
    let width = u32::from_be_bytes(bytes[16..20].try_into().unwrap());
    let height = u32::from_be_bytes(bytes[20..24].try_into().unwrap());
    assert_eq!((width, height), size, "{}", path.display());
    assert!(
        bytes.len() > 8_000,
        "{} is only {} bytes",
        path.display(),
        bytes.len()
    );
}

#[test]
fn curves_read_from_the_run_files() {
    let tmp = TempDir::new("curves");
    synthetic_run(tmp.path(), 40);
    let c = Curves::load(tmp.path());
    // One training series per env-runner copy, at the learner's vec steps of
    // the version each acted with (version 0 at 0).
    assert_eq!(c.train_return.len(), 2);
    assert_eq!(c.train_return[0].points.len(), 40);
    assert_eq!(c.train_return[0].points[0].0, 0.0);
    assert_eq!(c.train_return[1].points[1].0, 256.0);
    assert_eq!(c.train_return[1].points.last().unwrap().0, 39.0 * 256.0);
    // Evals sit at the learner's vec steps of their weights version.
    let (name, evals) = &c.eval_return[0];
    assert_eq!(name, "greedy");
    assert_eq!(evals.len(), 10);
    assert_eq!(evals[0].x, 4.0 * 256.0);
    assert_eq!(c.threshold, Some(475.0));
    assert_eq!(c.policy_loss.len(), 40);
    assert_eq!(c.value_loss.len(), 40);
    assert_eq!(c.entropy.len(), 40);
    assert_eq!(c.entropy[0].0, 256.0);
    let labels: Vec<&str> = c.sps.iter().map(|s| s.label.as_str()).collect();
    assert_eq!(
        labels,
        [
            "env_runner_sps (env-runner-0)",
            "env_runner_sps (env-runner-1)",
            "learner_sps"
        ]
    );
}

#[test]
fn training_return_falls_back_to_episodes_jsonl() {
    let tmp = TempDir::new("curves-episodes");
    synthetic_run(tmp.path(), 12);
    // Drop the env-runner means from metrics.jsonl (as with tracker.write_metrics off
    // for them): the run's rolling mean over episodes.jsonl takes their place.
    let metrics = std::fs::read_to_string(tmp.path().join("metrics.jsonl")).unwrap();
    let kept: String = metrics
        .lines()
        .filter(|l| !l.contains("env_runner_episode_return_mean"))
        .map(|l| format!("{l}\n"))
        .collect();
    std::fs::write(tmp.path().join("metrics.jsonl"), kept).unwrap();
    let c = Curves::load(tmp.path());
    assert_eq!(c.train_return.len(), 1);
    let points = &c.train_return[0].points;
    assert_eq!(points.len(), 24);
    // Episodes acted by version 0 sit at 0; by version v at the learner's vec steps of v.
    assert_eq!(points[0].0, 0.0);
    assert_eq!(points.last().unwrap().0, 11.0 * 256.0);
}

#[test]
fn plots_are_written_as_png_files() {
    let tmp = TempDir::new("plots");
    let run = tmp.path().join("run-1");
    synthetic_run(&run, 60);
    let paths = draw_run(&run).unwrap();
    let names: Vec<_> = paths
        .iter()
        .map(|p| p.file_name().unwrap().to_str().unwrap())
        .collect();
    assert_eq!(names, ["return.png", "losses.png", "sps.png"]);
    assert_png(&run.join("plots/return.png"), (1000, 600));
    assert_png(&run.join("plots/losses.png"), (1000, 900));
    assert_png(&run.join("plots/sps.png"), (1000, 600));
    // No temporary file is left behind.
    let left: Vec<_> = std::fs::read_dir(run.join("plots"))
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(left.len(), 3, "{left:?}");
    // Drawing again replaces them.
    draw_run(&run).unwrap();
    assert_png(&run.join("plots/sps.png"), (1000, 600));
    if let Ok(keep) = std::env::var("RELAY_KEEP_PLOTS") {
        for p in &paths {
            std::fs::copy(p, Path::new(&keep).join(p.file_name().unwrap())).unwrap();
        }
    }
}

#[test]
fn an_empty_run_still_gets_its_plots() {
    let tmp = TempDir::new("plots-empty");
    let paths = draw_run(tmp.path()).unwrap();
    assert_eq!(paths.len(), 3);
    for p in paths {
        let bytes = std::fs::read(&p).unwrap();
        assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n");
    }
    assert!(draw_run(&tmp.path().join("missing")).is_err());
}
