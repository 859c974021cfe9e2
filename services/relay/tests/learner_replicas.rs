//! Learner replicas as processes of a real `relay up` stack: `--learners 2`
//! gives two replicas of one run, `relay scale learner=3` adds a third that
//! takes the live state, rank 0 killed mid-run is noticed and the other
//! two go on training (the supervisor keeps the run) to the goal (CartPole
//! at 495, a confirmed solve of a version trained after the kill), a
//! replica joins again and the run continues with 3, and the final
//! checkpoint holds the step count the live replicas reached. The same for
//! DQN's off-policy loop (prioritized replay): rank 0 of 2 killed, the
//! survivor takes over drawing, priorities and publishing, a new replica
//! joins, and the checkpoint's rounds are the live replicas'.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use futures::StreamExt;
use relay_testkit::{stack_record, Supervisor};

fn pid_of(state: &Path, name: &str) -> Option<u32> {
    stack_record(state)?["processes"]
        .as_array()?
        .iter()
        .find(|p| p["name"] == name)
        .and_then(|p| p["pid"].as_u64())
        .map(|p| p as u32)
}

/// The newest value of each learner metric, per instance.
#[derive(Default)]
struct Learners(BTreeMap<String, BTreeMap<String, f64>>);

impl Learners {
    fn get(&self, instance: &str, metric: &str) -> Option<f64> {
        self.0.get(instance)?.get(metric).copied()
    }
}

/// Reads the run's metric reports into `seen` until `done` holds (true)
/// or `within` passes (false).
async fn until(
    metrics: &mut async_nats::Subscriber,
    seen: &mut Learners,
    within: Duration,
    done: impl Fn(&Learners) -> bool,
) -> bool {
    let deadline = tokio::time::Instant::now() + within;
    while !done(seen) {
        match tokio::time::timeout_at(deadline, metrics.next()).await {
            Ok(Some(m)) => {
                if let Ok(r) = relay_proto::decode::<relay_proto::MetricsReport>(&m.payload) {
                    if r.instance.starts_with("learner-") {
                        let values = seen.0.entry(r.instance).or_default();
                        for v in r.values {
                            values.insert(v.name, v.value);
                        }
                    }
                }
            }
            _ => return false,
        }
    }
    true
}

/// `relay scale learner=<n>`, which must start `new` (the next instance name).
fn scale_learners(state: &Path, n: usize, new: &str) {
    let output = Command::new(env!("CARGO_BIN_EXE_relay"))
        .args(["scale", &format!("learner={n}"), "--state-dir"])
        .arg(state)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&output.stdout).to_string()
        + &String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success() && text.contains(&format!("started {new}")),
        "{text}"
    );
}

/// `relay up --learners 2` of `config` (under `configs/`) with `sets`, its
/// output in `<dir>/relay-up.log`, its state in `<dir>/state`.
fn relay_up(dir: &Path, config: &str, run_id: &str, sets: &[&str]) -> Supervisor {
    let config = format!("{}/../../configs/{config}", env!("CARGO_MANIFEST_DIR"));
    let log = std::fs::File::create(dir.join("relay-up.log")).unwrap();
    let mut command = Command::new(env!("CARGO_BIN_EXE_relay"));
    command
        .args(["up", "--quiet", "--config", &config, "--run-id", run_id])
        .args(["--learners", "2"])
        .arg("--state-dir")
        .arg(dir.join("state"))
        .args([
            "--set",
            &format!("run.runs_dir={}", dir.join("runs").display()),
        ]);
    for set in sets {
        command.args(["--set", set]);
    }
    Supervisor(
        command
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("start relay up"),
    )
}

#[test]
fn learner_replicas_scale_survive_a_kill_and_checkpoint_the_shared_step() {
    let dir = relay_testkit::TempDir::new("learner-replicas");
    let state = dir.path().join("state");
    let run_id = "replicas-cartpole";
    let mut up = relay_up(
        dir.path(),
        "cartpole-ppo.yaml",
        run_id,
        &[
            "run.total_env_steps=2000000",
            // Solved later than the preset (after the kill below), and
            // training on once solved, until the test stops it.
            "eval.threshold=495",
            "ppo.learning_rate=0.0003",
            "run.stop_when_solved=false",
        ],
    );
    let up_log = || std::fs::read_to_string(dir.path().join("relay-up.log")).unwrap_or_default();
    let learner_log = |name: &str| {
        std::fs::read_to_string(state.join("logs").join(format!("{name}.log"))).unwrap_or_default()
    };

    let deadline = Instant::now() + Duration::from_secs(120);
    while pid_of(&state, "learner-1").is_none() {
        assert!(
            up.0.try_wait().unwrap().is_none(),
            "relay up exited:\n{}",
            up_log()
        );
        assert!(Instant::now() < deadline, "no stack.json:\n{}", up_log());
        std::thread::sleep(Duration::from_millis(100));
    }
    let nats_url = stack_record(&state).unwrap()["nats_url"]
        .as_str()
        .unwrap()
        .to_string();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let client = runtime.block_on(async_nats::connect(&nats_url)).unwrap();
    let mut metrics = runtime
        .block_on(client.subscribe(format!("relay.{run_id}.metrics")))
        .unwrap();
    let mut seen = Learners::default();
    let mut evals = runtime
        .block_on(client.subscribe(format!("relay.{run_id}.eval")))
        .unwrap();

    // Two replicas train together: both report a view of 2, and rank 0
    // (the first to join) publishes updates.
    let in_view = |s: &Learners, names: &[&str], n: f64| {
        names
            .iter()
            .all(|i| s.get(i, "learner_replicas") == Some(n))
    };
    let leader = |s: &Learners, names: &[&str]| {
        names
            .iter()
            .find(|i| s.get(i, "learner_replica_rank") == Some(0.0))
            .map(|i| i.to_string())
    };
    let updates_of = |s: &Learners, i: &str| s.get(i, "learner_updates").unwrap_or(0.0);
    assert!(
        runtime.block_on(until(
            &mut metrics,
            &mut seen,
            Duration::from_secs(120),
            |s| in_view(s, &["learner-0", "learner-1"], 2.0)
                && leader(s, &["learner-0", "learner-1"]).is_some_and(|l| updates_of(s, &l) >= 3.0)
        )),
        "no two replicas training:\n{}\nlearner-1:\n{}",
        up_log(),
        learner_log("learner-1")
    );
    let first_leader = leader(&seen, &["learner-0", "learner-1"]).unwrap();
    let follower = if first_leader == "learner-0" {
        "learner-1"
    } else {
        "learner-0"
    };
    assert_eq!(seen.get(follower, "learner_replica_rank"), Some(1.0));
    assert!(seen.get(follower, "learner_allreduce_bytes").unwrap() > 0.0);

    // A third joins while the run trains and takes the live state.
    scale_learners(&state, 3, "learner-2");
    assert!(
        runtime.block_on(until(
            &mut metrics,
            &mut seen,
            Duration::from_secs(60),
            |s| in_view(s, &["learner-0", "learner-1", "learner-2"], 3.0)
                && s.get("learner-2", "learner_replica_updates")
                    == s.get(&first_leader, "learner_updates")
                && updates_of(s, &first_leader) >= 1.0
        )),
        "no view of 3:\n{}\nlearner-2:\n{}",
        up_log(),
        learner_log("learner-2")
    );

    // Kill rank 0 mid-run: the other two re-form, the oldest survivor takes
    // over publishing and checkpoints, and training goes on.
    relay_testkit::signal(pid_of(&state, &first_leader).unwrap(), libc::SIGKILL);
    let killed_at = updates_of(&seen, &first_leader);
    let killed_version = seen
        .get(&first_leader, "learner_policy_version")
        .unwrap_or(killed_at);
    seen.0.remove(&first_leader);
    let survivors = [follower, "learner-2"];
    assert!(
        runtime.block_on(until(
            &mut metrics,
            &mut seen,
            Duration::from_secs(60),
            |s| in_view(s, &survivors, 2.0)
                && leader(s, &survivors).is_some_and(|l| updates_of(s, &l) >= killed_at + 5.0)
        )),
        "the survivors did not go on:\n{}\n{follower}:\n{}",
        up_log(),
        learner_log(follower)
    );
    let new_leader = leader(&seen, &survivors).unwrap();
    assert_eq!(new_leader, follower, "the oldest survivor leads");
    assert!(
        up.0.try_wait().unwrap().is_none(),
        "the supervisor stopped the run:\n{}",
        up_log()
    );
    assert!(
        up_log().contains(&format!("learner replica {first_leader} exited")),
        "{}",
        up_log()
    );

    // The two go on to the goal: a confirmed solve of a version they trained.
    let solved = runtime.block_on(async {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(240);
        loop {
            match tokio::time::timeout_at(deadline, evals.next()).await {
                Ok(Some(m)) => {
                    if let Ok(r) = relay_proto::decode::<relay_proto::EvalReport>(&m.payload) {
                        if r.solved {
                            return Some(r);
                        }
                    }
                }
                _ => return None,
            }
        }
    });
    let solved = solved.unwrap_or_else(|| panic!("two replicas did not solve:\n{}", up_log()));
    assert!(
        solved.policy_version as f64 > killed_version,
        "solved at version {} before rank 0 was killed (version {killed_version}): {solved:?}",
        solved.policy_version
    );

    eprintln!(
        "learner_replicas: rank 0 killed at version {killed_version}; solved (confirmed) at version {} with 2 replicas, eval mean {:.1}",
        solved.policy_version, solved.mean_return
    );

    // A replica joins again: the run continues with 3.
    scale_learners(&state, 3, "learner-3");
    let three = [follower, "learner-2", "learner-3"];
    let rejoined_at = updates_of(&seen, &new_leader);
    assert!(
        runtime.block_on(until(
            &mut metrics,
            &mut seen,
            Duration::from_secs(60),
            |s| in_view(s, &three, 3.0)
                && s.get("learner-3", "learner_replica_updates")
                    == s.get(&new_leader, "learner_updates")
                && updates_of(s, &new_leader) >= rejoined_at + 3.0
        )),
        "no view of 3 after the rejoin:\n{}\nlearner-3:\n{}",
        up_log(),
        learner_log("learner-3")
    );

    // Stop: the final checkpoint holds the step the replicas reached.
    up.interrupt();
    // The last reports rank 0 sent before it stopped.
    runtime.block_on(until(
        &mut metrics,
        &mut seen,
        Duration::from_secs(5),
        |_| false,
    ));
    let deadline = Instant::now() + Duration::from_secs(90);
    let status = loop {
        if let Some(status) = up.0.try_wait().unwrap() {
            break status;
        }
        assert!(
            Instant::now() < deadline,
            "relay up did not stop:\n{}",
            up_log()
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(
        status.success(),
        "relay up exited with {status}:\n{}",
        up_log()
    );
    let last = dir
        .path()
        .join("runs")
        .join(run_id)
        .join("checkpoints/last");
    let saved: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(last.join("state.json")).unwrap()).unwrap();
    let updates = saved["updates"].as_f64().unwrap();
    assert_eq!(
        Some(updates),
        seen.get(&new_leader, "learner_updates"),
        "the checkpoint's step is not rank 0's last: {saved}"
    );
    // Every step completes on all replicas before the next begins.
    assert_eq!(
        Some(updates),
        seen.get("learner-2", "learner_replica_updates"),
        "the live follower's step is not the checkpoint's"
    );
}

#[test]
fn dqn_replicas_survive_a_kill_and_a_new_replica_takes_the_live_state() {
    let dir = relay_testkit::TempDir::new("dqn-replicas");
    let state = dir.path().join("state");
    let run_id = "replicas-dqn";
    let mut up = relay_up(
        dir.path(),
        "cartpole-dqn.yaml",
        run_id,
        &["run.total_env_steps=2000000", "run.stop_when_solved=false"],
    );
    let up_log = || std::fs::read_to_string(dir.path().join("relay-up.log")).unwrap_or_default();
    let learner_log = |name: &str| {
        std::fs::read_to_string(state.join("logs").join(format!("{name}.log"))).unwrap_or_default()
    };
    let deadline = Instant::now() + Duration::from_secs(120);
    while pid_of(&state, "learner-1").is_none() {
        assert!(
            up.0.try_wait().unwrap().is_none(),
            "relay up exited:\n{}",
            up_log()
        );
        assert!(Instant::now() < deadline, "no stack.json:\n{}", up_log());
        std::thread::sleep(Duration::from_millis(100));
    }
    let nats_url = stack_record(&state).unwrap()["nats_url"]
        .as_str()
        .unwrap()
        .to_string();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let client = runtime.block_on(async_nats::connect(&nats_url)).unwrap();
    let mut metrics = runtime
        .block_on(client.subscribe(format!("relay.{run_id}.metrics")))
        .unwrap();
    let mut seen = Learners::default();
    let rank_0 = |s: &Learners, names: &[&str]| {
        names
            .iter()
            .find(|i| {
                s.get(i, "learner_replica_rank") == Some(0.0)
                    && s.get(i, "learner_replicas") == Some(names.len() as f64)
            })
            .map(|i| i.to_string())
    };
    let rounds_of = |s: &Learners, i: &str| s.get(i, "learner_updates").unwrap_or(0.0);

    // Two replicas train DQN's rounds together.
    let pair = ["learner-0", "learner-1"];
    assert!(
        runtime.block_on(until(
            &mut metrics,
            &mut seen,
            Duration::from_secs(120),
            |s| rank_0(s, &pair).is_some_and(|l| rounds_of(s, &l) >= 3.0)
                && pair
                    .iter()
                    .all(|i| s.get(i, "learner_replicas") == Some(2.0))
        )),
        "no two DQN replicas training:\n{}\nlearner-1:\n{}",
        up_log(),
        learner_log("learner-1")
    );
    let first = rank_0(&seen, &pair).unwrap();
    let survivor = if first == "learner-0" {
        "learner-1"
    } else {
        "learner-0"
    };
    assert!(seen.get(survivor, "learner_allreduce_bytes").unwrap() > 0.0);

    // Rank 0 killed: the survivor takes over the draws, the priorities
    // and the versions, alone.
    relay_testkit::signal(pid_of(&state, &first).unwrap(), libc::SIGKILL);
    let killed_at = rounds_of(&seen, &first);
    let killed_version = seen.get(&first, "learner_policy_version").unwrap();
    seen.0.remove(&first);
    assert!(
        runtime.block_on(until(
            &mut metrics,
            &mut seen,
            Duration::from_secs(60),
            |s| rank_0(s, &[survivor]).is_some()
                && rounds_of(s, survivor) >= killed_at + 3.0
                && s.get(survivor, "learner_policy_version") > Some(killed_version)
        )),
        "the survivor did not take over:\n{}\n{survivor}:\n{}",
        up_log(),
        learner_log(survivor)
    );
    assert!(seen.get(survivor, "learner_stale_priorities").is_some());

    // A new replica joins and takes the live state: the run goes on with 2.
    scale_learners(&state, 2, "learner-2");
    let joined_at = rounds_of(&seen, survivor);
    let pair = [survivor, "learner-2"];
    assert!(
        runtime.block_on(until(
            &mut metrics,
            &mut seen,
            Duration::from_secs(60),
            |s| rank_0(s, &pair).as_deref() == Some(survivor)
                && s.get("learner-2", "learner_replicas") == Some(2.0)
                && s.get("learner-2", "learner_replica_updates")
                    == s.get(survivor, "learner_updates")
                && rounds_of(s, survivor) >= joined_at + 3.0
        )),
        "no view of 2 after the join:\n{}\nlearner-2:\n{}",
        up_log(),
        learner_log("learner-2")
    );

    // Stop: the checkpoint's rounds are the live replicas'.
    up.interrupt();
    runtime.block_on(until(
        &mut metrics,
        &mut seen,
        Duration::from_secs(5),
        |_| false,
    ));
    let deadline = Instant::now() + Duration::from_secs(90);
    let status = loop {
        if let Some(status) = up.0.try_wait().unwrap() {
            break status;
        }
        assert!(
            Instant::now() < deadline,
            "relay up did not stop:\n{}",
            up_log()
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(
        status.success(),
        "relay up exited with {status}:\n{}",
        up_log()
    );
    let last = dir
        .path()
        .join("runs")
        .join(run_id)
        .join("checkpoints/last");
    let read = |file: &str| -> serde_json::Value {
        serde_json::from_str(&std::fs::read_to_string(last.join(file)).unwrap()).unwrap()
    };
    let updates = read("state.json")["updates"].as_f64().unwrap();
    assert_eq!(Some(updates), seen.get(survivor, "learner_updates"));
    assert_eq!(
        Some(updates),
        seen.get("learner-2", "learner_replica_updates")
    );
    assert_eq!(read("dqn.json")["rounds"].as_f64(), Some(updates));
    eprintln!(
        "dqn replicas: rank 0 killed at round {killed_at}; {updates} rounds at the stop, {survivor} leading"
    );
}
