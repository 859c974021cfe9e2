//! The first-run walkthrough, `docs/first-run.md`, run as written.
//!
//! Every command of its ```sh blocks runs in order, in a fresh folder that
//! holds only `configs/`, through the real binaries: `target/release/relay`
//! is this build's `relay`, and `just up` its `relay up` (the Justfile's
//! `up` recipe is checked to be exactly that, after installing and building).
//! Blocks marked `terminal-1` keep running in the background; the prose's
//! "Ctrl-C in terminal 1" sends them SIGINT. Each command
//! has a check of what a user would look for; a command this file does not
//! know fails the test, so the walkthrough and its test cannot drift apart.

use std::io::{BufRead, Read, Write};
use std::os::fd::{FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const DOC: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/first-run.md");
const JUSTFILE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../Justfile");
const CONFIGS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../configs");

/// One step of the walkthrough.
#[derive(Debug)]
enum Step {
    /// A command of a ```sh block; `background`: it keeps running in terminal 1.
    Run { background: bool, command: String },
    /// "Ctrl-C in terminal 1", in the prose.
    Interrupt,
}

/// The steps, in order.
fn steps(doc: &str) -> Vec<Step> {
    let mut steps = Vec::new();
    let mut block: Option<bool> = None;
    for line in doc.lines() {
        match (&block, line.trim_end()) {
            (None, fence) if fence.starts_with("```sh") => {
                block = Some(fence.split_whitespace().any(|w| w == "terminal-1"));
            }
            (None, prose) if prose.contains("Ctrl-C in terminal 1") => steps.push(Step::Interrupt),
            (Some(_), "```") => block = None,
            (Some(background), command) if !command.trim().is_empty() => steps.push(Step::Run {
                background: *background,
                command: command.trim().to_string(),
            }),
            _ => {}
        }
    }
    steps
}

/// The command as this test runs it.
fn localize(command: &str) -> String {
    let command = command.replace("target/release/relay ", "relay ");
    match command.strip_prefix("just up") {
        Some(rest) => format!("relay up{rest}"),
        None => command,
    }
}

/// A `relay up` left running, as in terminal 1.
struct Terminal {
    child: Child,
    lines: Arc<Mutex<Vec<String>>>,
    reader: std::thread::JoinHandle<()>,
}

impl Terminal {
    fn start(shell: &Shell, command: &str) -> Self {
        let mut child = shell
            .command(&format!("exec {command}"))
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("start terminal 1");
        let lines = Arc::new(Mutex::new(Vec::new()));
        let out = child.stdout.take().unwrap();
        let sink = lines.clone();
        let reader = std::thread::spawn(move || {
            for line in std::io::BufReader::new(out).lines().map_while(Result::ok) {
                sink.lock().unwrap().push(line);
            }
        });
        Self {
            child,
            lines,
            reader,
        }
    }

    fn text(&self) -> String {
        self.lines.lock().unwrap().join("\n")
    }

    /// Waits until the output satisfies `done`.
    fn wait_for(&mut self, what: &str, seconds: u64, done: impl Fn(&[String]) -> bool) {
        let deadline = Instant::now() + Duration::from_secs(seconds);
        while !done(&self.lines.lock().unwrap()) {
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!(
                    "terminal 1 exited ({status}) before {what}:\n{}",
                    self.text()
                );
            }
            assert!(
                Instant::now() < deadline,
                "no {what} within {seconds} s:\n{}",
                self.text()
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// The Prometheus URL of the first line.
    fn prometheus_url(&self) -> String {
        let text = self.text();
        let url = text
            .lines()
            .find_map(|l| l.split_once("  prometheus ").map(|(_, url)| url))
            .unwrap_or_else(|| panic!("no prometheus URL:\n{text}"));
        assert!(
            url.starts_with("http://"),
            "prometheus not installed:\n{text}"
        );
        url.to_string()
    }

    /// Ctrl-C: the stack stops cleanly.
    fn interrupt(mut self) -> String {
        unsafe {
            libc::kill(self.child.id() as i32, libc::SIGINT);
        }
        let status = self.child.wait().expect("relay up exits");
        // Until the reader has seen the end of the output.
        self.reader.join().unwrap();
        let text = self.lines.lock().unwrap().join("\n");
        assert!(status.success(), "{status}\n{text}");
        assert!(text.contains("relay: stack stopped"), "{text}");
        text
    }
}

/// The second terminal: a fresh folder with `configs/` and `relay` on PATH.
struct Shell {
    dir: PathBuf,
    path: String,
    env: Vec<(String, String)>,
}

impl Shell {
    fn new(dir: &Path) -> Self {
        std::os::unix::fs::symlink(CONFIGS, dir.join("configs")).unwrap();
        let bin = dir.join("bin");
        std::fs::create_dir(&bin).unwrap();
        std::os::unix::fs::symlink(env!("CARGO_BIN_EXE_relay"), bin.join("relay")).unwrap();
        let path = format!(
            "{}:{}",
            bin.display(),
            std::env::var("PATH").unwrap_or_default()
        );
        Self {
            dir: dir.to_path_buf(),
            path,
            env: Vec::new(),
        }
    }

    fn command(&self, command: &str) -> Command {
        let mut c = Command::new("bash");
        c.args(["-c", command])
            .current_dir(&self.dir)
            .env("PATH", &self.path)
            .env("RUST_BACKTRACE", "0")
            .envs(self.env.iter().cloned());
        c
    }

    fn run(&self, command: &str) -> String {
        let Output {
            status,
            stdout,
            stderr,
        } = self.command(command).output().expect("run");
        let out = String::from_utf8_lossy(&stdout).into_owned();
        assert!(
            status.success(),
            "`{command}`: {status}\n{out}\n{}",
            String::from_utf8_lossy(&stderr)
        );
        out
    }

    /// Runs `command` on a pseudo-terminal of 140x40 for `seconds`, then
    /// types `q`; returns everything it drew.
    fn run_in_terminal(&self, command: &str, seconds: u64) -> String {
        let (mut master, mut slave) = (0, 0);
        let size = libc::winsize {
            ws_row: 40,
            ws_col: 140,
            ws_xpixel: 0,
            ws_ypixel: 0,
        };
        let opened = unsafe {
            libc::openpty(
                &mut master,
                &mut slave,
                std::ptr::null_mut(),
                std::ptr::null(),
                &size,
            )
        };
        assert_eq!(opened, 0, "openpty");
        let (master, slave) =
            unsafe { (OwnedFd::from_raw_fd(master), OwnedFd::from_raw_fd(slave)) };
        let mut child = self
            .command(command)
            .stdin(slave.try_clone().unwrap())
            .stdout(slave.try_clone().unwrap())
            .stderr(slave)
            .spawn()
            .expect("start on a terminal");
        let mut reader = std::fs::File::from(master.try_clone().unwrap());
        let screen = Arc::new(Mutex::new(Vec::new()));
        let sink = screen.clone();
        std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            // EIO once the child has closed the terminal.
            while let Ok(n) = reader.read(&mut buf) {
                if n == 0 {
                    break;
                }
                sink.lock().unwrap().extend_from_slice(&buf[..n]);
            }
        });
        std::thread::sleep(Duration::from_secs(seconds));
        std::fs::File::from(master).write_all(b"q").unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        let status = loop {
            if let Some(status) = child.try_wait().unwrap() {
                break status;
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                panic!("`{command}` did not quit on q");
            }
            std::thread::sleep(Duration::from_millis(100));
        };
        let drawn = String::from_utf8_lossy(&screen.lock().unwrap()).into_owned();
        assert!(status.success(), "`{command}`: {status}\n{drawn}");
        drawn
    }
}

fn run_status(dir: &Path) -> String {
    let status = std::fs::read_to_string(dir.join("status.json")).expect("status.json");
    let status: serde_json::Value = serde_json::from_str(&status).unwrap();
    status["status"].as_str().expect("status").to_string()
}

#[test]
fn the_first_run_walkthrough_works_as_written() {
    let justfile = std::fs::read_to_string(JUSTFILE).unwrap();
    assert!(
        justfile.contains("up *ARGS: install\n    cargo build --release --workspace --bins\n    {{release}}/relay up {{ARGS}}\n"),
        "the Justfile's `up` recipe is no longer `relay up` after install and build"
    );
    let doc = std::fs::read_to_string(DOC).unwrap();
    let steps = steps(&doc);
    assert!(steps.len() >= 10, "{steps:#?}");

    let dir = relay_testkit::TempDir::new("walkthrough");
    let mut shell = Shell::new(dir.path());
    let mut terminal: Option<Terminal> = None;
    let mut run_id = String::new();
    for step in &steps {
        let (background, command) = match step {
            Step::Interrupt => {
                let text = terminal
                    .take()
                    .expect("Ctrl-C with nothing running")
                    .interrupt();
                assert!(
                    text.contains(&format!("relay: run {run_id} ended: ")),
                    "{text}"
                );
                continue;
            }
            Step::Run {
                background,
                command,
            } => (*background, command),
        };
        let original = command;
        let command = localize(command);
        let words: Vec<&str> = command.split_whitespace().collect();
        if background {
            assert!(terminal.is_none(), "terminal 1 is busy: `{original}`");
            let mut t = Terminal::start(&shell, &command);
            if command.contains("--resume") {
                // Training goes on past the checkpoint's env steps.
                let past = |lines: &[String]| {
                    let steps: Vec<u64> = lines
                        .iter()
                        .filter(|l| l.starts_with('['))
                        .filter_map(|l| l.split_whitespace().nth(3)?.parse().ok())
                        .collect();
                    steps.len() >= 2 && steps.windows(2).any(|w| w[1] > w[0])
                };
                t.wait_for("progress of the resumed run", 120, past);
                assert!(t.text().contains(&format!("resuming run {run_id}")));
            } else {
                t.wait_for("end of training", 300, |lines| {
                    lines.iter().any(|l| l.contains("the stack stays up"))
                });
                let text = t.text();
                run_id = text
                    .lines()
                    .find_map(|l| l.strip_prefix("relay: run ")?.split_whitespace().next())
                    .expect("run id")
                    .to_string();
                assert!(
                    text.contains(&format!("relay: run {run_id} ended: ")),
                    "{text}"
                );
                assert!(text.contains("look further relay top @last"), "{text}");
            }
            terminal = Some(t);
            continue;
        }
        let run_dir = dir.path().join("runs").join(&run_id);
        match words.as_slice() {
            ["relay", "top", ..] => {
                let drawn = shell.run_in_terminal(&command, 4);
                let status = run_status(&run_dir);
                assert!(drawn.contains(&run_id), "{drawn}");
                assert!(
                    drawn.contains(&status),
                    "status {status} not shown:\n{drawn}"
                );
            }
            ["relay", "plot", ..] => {
                let out = shell.run(&command);
                for plot in ["return.png", "losses.png", "sps.png"] {
                    let path = run_dir.join("plots").join(plot);
                    assert!(out.contains(plot), "{out}");
                    assert!(std::fs::metadata(&path).unwrap().len() > 0, "{path:?}");
                }
            }
            ["relay", "play", ..] => {
                let out = shell.run(&command);
                assert!(out.contains("returns: "), "{out}");
            }
            ["relay", "eval", "checkpoint", ..] => {
                let out = shell.run(&command);
                let json: serde_json::Value =
                    serde_json::from_str(out.lines().last().unwrap()).unwrap();
                assert_eq!(json["run_id"], run_id.as_str(), "{out}");
                assert_eq!(json["episodes"], 100, "{out}");
                assert!(json["mean_return"].as_f64().unwrap() > 0.0, "{out}");
            }
            ["relay", "eval", "use", plugin, ..] => {
                shell.run(&command);
                let evals = run_dir.join("eval.jsonl");
                let tag = format!(r#""evaluator":"{plugin}""#);
                let deadline = Instant::now() + Duration::from_secs(60);
                while !std::fs::read_to_string(&evals)
                    .unwrap_or_default()
                    .contains(&tag)
                {
                    assert!(Instant::now() < deadline, "no {plugin} evaluation in 60 s");
                    std::thread::sleep(Duration::from_millis(500));
                }
            }
            ["relay", "scale", target] => {
                let out = shell.run(&command);
                let (service, copies) = target.split_once('=').unwrap();
                assert!(
                    out.contains(&format!("{service}: {copies} copies")),
                    "{out}"
                );
            }
            [assignment] if assignment.starts_with("PROMETHEUS=") => {
                let url = terminal.as_ref().expect("a stack").prometheus_url();
                shell.env.push(("PROMETHEUS".into(), url));
            }
            ["curl", ..] => {
                // Prometheus scrapes every 2 s; a user would ask again.
                let deadline = Instant::now() + Duration::from_secs(30);
                loop {
                    let out = shell.run(&command);
                    if out.contains(r#""status":"success""#)
                        && out.contains(&format!(r#""run_id":"{run_id}""#))
                        && out.contains(r#""evaluator":"stochastic""#)
                    {
                        break;
                    }
                    assert!(Instant::now() < deadline, "{out}");
                    std::thread::sleep(Duration::from_secs(1));
                }
            }
            ["relay", "runs", "ls", ..] => {
                let out = shell.run(&command);
                assert!(out.contains(&run_id), "{out}");
            }
            _ => panic!(
                "docs/first-run.md runs `{original}`, which tests/walkthrough.rs does not check"
            ),
        }
    }
    assert!(
        terminal.is_none(),
        "the walkthrough leaves terminal 1 running"
    );
}
