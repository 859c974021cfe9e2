//! `relay bench-learning`: does each classic learner reach its goal within
//! its budget? For every entry of [`GOALS`] (an algorithm's preset in
//! `configs/`, a goal on the mean evaluation return and a budget of env
//! steps) and every seed, one full-stack run (`relay up --until-solved`
//! with `eval.threshold` set to the goal and `run.total_env_steps` to the
//! budget): solved or not (a version's screening mean reached the goal and
//! so did its confirmation on fresh episodes), env steps and wall time at
//! the confirmation (or the end), the first screening pass beside them,
//! the best evaluation, and the run's `best` checkpoint re-evaluated
//! offline over 1,000 fresh episodes. A goal is reached only when the run
//! was solved and that re-evaluation meets the goal too. A preset that
//! does not exist yet is reported as missing, not skipped silently. Prints
//! a table and a JSON line.

use std::io::BufRead;
use std::path::{Path, PathBuf};

use anyhow::{bail, Result};
use serde_json::json;

use crate::bench_solve::{reevaluate, reevaluate_best_against, REEVAL_EPISODES};
use relay::{up, FirstPass, UpArgs};

/// One learning goal.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Goal {
    /// Short name in the table.
    pub name: &'static str,
    /// The preset under `configs/`.
    pub config: &'static str,
    /// Mean evaluation return to reach.
    pub target: Target,
    /// Env steps or time allowed.
    pub budget: Budget,
    /// The anchor library's training timed beside relay's runs, if any.
    pub anchor: Option<Anchor>,
    /// Config overrides on top of the preset (`--set` syntax): a variant
    /// of a preset measured beside it.
    pub sets: &'static [&'static str],
    /// A multi-agent game trained by self-play (its preset's evaluator is
    /// `vs-opponent`): what else its runs report.
    pub versus: Option<Versus>,
    /// Trained to the end of the budget, never stopped as solved, and
    /// judged by the last checkpoint re-evaluated on fresh episodes: the
    /// model at the budget, what a comparison with the anchor at equal env
    /// steps needs.
    pub to_the_end: bool,
}

/// What a self-play goal reports besides the goal's opponents (its
/// preset's `vs-opponent` options), whose weakest matchup (opponent and
/// seat) must reach the target on the fresh games of the re-evaluation.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Versus {
    /// Opponents the best checkpoint also plays on the same fresh games,
    /// reported every time and not part of the goal (the moonshot).
    pub also: &'static [&'static str],
    /// The league's ratings, read from the stack's Redis during the run:
    /// the goal also needs the newest version that played rated above the
    /// first with no overlap of mu +/- 2 sigma.
    pub newest_above_first: bool,
}

/// A script under `services/bench/sb3/` that trains the goal's env with
/// Stable-Baselines3 (or sb3-contrib), run once after relay's seeds on the
/// same machine. Its last line is JSON with `env_steps_per_s`, and where
/// it trains to the goal, `runs`: per seed `seed`, `solved`, `env_steps`
/// and `wall_s`, reported beside relay's.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Anchor {
    pub script: &'static str,
    /// The script's arguments; `{seeds}` stands for the bench's seeds,
    /// comma separated.
    pub args: &'static [&'static str],
}

/// What a goal's mean evaluation return must reach.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Target {
    /// This return.
    Return(f64),
    /// This many times the uniformly random policy's mean return, measured
    /// at the start of each run over [`RANDOM_EPISODES`] episodes.
    TimesRandom(f64),
}

/// What a goal's run may spend.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Budget {
    /// Env steps (the preset's `run.total_env_steps` is replaced).
    EnvSteps(u64),
    /// Minutes of wall time of the whole stack on this machine (the
    /// preset's `run.total_env_steps` stays).
    Minutes(u64),
}

impl std::fmt::Display for Budget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Budget::EnvSteps(n) => write!(f, "{n} env steps"),
            Budget::Minutes(m) => write!(f, "{m} min"),
        }
    }
}

impl std::fmt::Display for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Target::Return(r) => write!(f, "{r}"),
            Target::TimesRandom(k) => write!(f, "{k}x random"),
        }
    }
}

/// Episodes of the random policy behind a [`Target::TimesRandom`].
pub const RANDOM_EPISODES: usize = 100;

/// The goals of issue "more learners for classic control" (rl-zoo's
/// reported results as reference: PPO Acrobot -73.5 at 1M steps, PPO
/// CartPole 500 at 100k).
pub const GOALS: &[Goal] = &[
    Goal {
        name: "PPO Acrobot-v1",
        config: "acrobot-ppo.yaml",
        target: Target::Return(-80.0),
        budget: Budget::EnvSteps(500_000),
        anchor: None,
        sets: &[],
        versus: None,
        to_the_end: false,
    },
    Goal {
        name: "DQN CartPole-v1",
        config: "cartpole-dqn.yaml",
        target: Target::Return(475.0),
        budget: Budget::EnvSteps(100_000),
        anchor: None,
        sets: &[],
        versus: None,
        to_the_end: false,
    },
    Goal {
        name: "DQN MountainCar-v0",
        config: "mountaincar-dqn.yaml",
        target: Target::Return(-110.0),
        budget: Budget::EnvSteps(300_000),
        anchor: None,
        sets: &[],
        versus: None,
        to_the_end: false,
    },
    Goal {
        name: "SAC Pendulum-v1",
        config: "pendulum-sac.yaml",
        target: Target::Return(-200.0),
        budget: Budget::EnvSteps(30_000),
        anchor: None,
        sets: &[],
        versus: None,
        to_the_end: false,
    },
    Goal {
        name: "A2C CartPole-v1",
        config: "cartpole-a2c.yaml",
        target: Target::Return(475.0),
        budget: Budget::EnvSteps(500_000),
        anchor: None,
        sets: &[],
        versus: None,
        to_the_end: false,
    },
    // PPO shaped for throughput (issue 25's 100k env steps/s through the
    // stack): it must still learn.
    Goal {
        name: "PPO CartPole-v1 (throughput preset)",
        config: "cartpole-ppo-throughput.yaml",
        target: Target::Return(475.0),
        budget: Budget::EnvSteps(2_000_000),
        anchor: None,
        sets: &[],
        versus: None,
        to_the_end: false,
    },
    // Through the env bridge (Gymnasium in Python workers): rl-zoo's PPO
    // reaches about 250 at 1M steps on LunarLander.
    Goal {
        name: "PPO LunarLander-v3",
        config: "lunarlander-ppo.yaml",
        target: Target::Return(200.0),
        budget: Budget::EnvSteps(1_000_000),
        anchor: None,
        sets: &[],
        versus: None,
        to_the_end: false,
    },
    // Gymnasium 1.4 retired Taxi-v3 for Taxi-v4 (the same task). Taxi's
    // info["action_mask"] is on by default; the same preset without it
    // beside it: env steps to the goal of each.
    Goal {
        name: "PPO Taxi-v4",
        config: "taxi-ppo.yaml",
        target: Target::Return(7.5),
        budget: Budget::EnvSteps(1_000_000),
        anchor: None,
        sets: &[],
        versus: None,
        to_the_end: false,
    },
    Goal {
        name: "PPO Taxi-v4 without its action mask",
        config: "taxi-ppo.yaml",
        target: Target::Return(7.5),
        budget: Budget::EnvSteps(1_000_000),
        anchor: None,
        sets: &["env.action_masks=false"],
        versus: None,
        to_the_end: false,
    },
    // A CNN policy on images through the bridge: 10x the random policy's
    // return within 20 minutes on the machine that runs the bench.
    Goal {
        name: "PPO CNN MinAtar/Breakout-v1",
        config: "minatar-breakout-ppo.yaml",
        target: Target::TimesRandom(10.0),
        budget: Budget::Minutes(20),
        anchor: None,
        sets: &[],
        versus: None,
        to_the_end: false,
    },
    // Atari through the whole stack with rl-zoo's preprocessing and PPO
    // hyperparameters: 10x the random policy's return within 30 minutes,
    // env steps/s beside Stable-Baselines3's PPO CnnPolicy (1 torch thread).
    Goal {
        name: "PPO ALE/Breakout-v5",
        config: "breakout-ppo.yaml",
        target: Target::TimesRandom(10.0),
        budget: Budget::Minutes(30),
        anchor: Some(Anchor {
            script: "ppo_atari.py",
            args: &["--seconds", "300", "--seed", "1"],
        }),
        sets: &[],
        versus: None,
        to_the_end: false,
    },
    // Self-play with the league on PettingZoo's games (issue 47): the
    // solving version against the random-legal bot from both seats (its
    // wins, and for TicTacToe its non-losses), re-evaluated on fresh games.
    Goal {
        name: "PPO self-play connect_four_v3",
        config: "connect-four-ppo-league.yaml",
        target: Target::Return(0.9),
        budget: Budget::Minutes(30),
        anchor: None,
        sets: &[],
        // Beside it, the depth-4 search bot, a much stronger opponent.
        versus: Some(Versus {
            also: &["connect_four_bot"],
            newest_above_first: true,
        }),
        to_the_end: false,
    },
    Goal {
        name: "PPO self-play tictactoe_v3",
        config: "tictactoe-ppo-league.yaml",
        target: Target::Return(0.95),
        budget: Budget::EnvSteps(1_000_000),
        anchor: None,
        sets: &[],
        // The moonshot, reported every time: never losing to perfect play.
        versus: Some(Versus {
            also: &["minimax"],
            newest_above_first: false,
        }),
        to_the_end: false,
    },
    // Memory (issue 48): recurrent PPO on envs whose velocities are hidden
    // (rl-zoo's MaskVelocityWrapper), timed to the goal beside sb3-contrib's
    // RecurrentPPO with rl-zoo's hyperparameters on the same seeds, and the
    // same presets without the LSTM, to show that memory is what solves them.
    Goal {
        name: "Recurrent PPO CartPoleNoVel-v1",
        config: "cartpole-novel-ppo-lstm.yaml",
        target: Target::Return(475.0),
        budget: Budget::EnvSteps(200_000),
        anchor: Some(Anchor {
            script: "recurrent_ppo_novel.py",
            args: &["--env", "CartPoleNoVel-v1", "--seeds", "{seeds}"],
        }),
        sets: &[],
        versus: None,
        to_the_end: false,
    },
    Goal {
        name: "Feed-forward PPO CartPoleNoVel-v1",
        config: "cartpole-novel-ppo-lstm.yaml",
        target: Target::Return(475.0),
        budget: Budget::EnvSteps(200_000),
        anchor: None,
        sets: &["policy.recurrent=null"],
        versus: None,
        to_the_end: false,
    },
    Goal {
        name: "Recurrent PPO PendulumNoVel-v1",
        config: "pendulum-novel-ppo-lstm.yaml",
        target: Target::Return(-300.0),
        budget: Budget::EnvSteps(300_000),
        anchor: Some(Anchor {
            script: "recurrent_ppo_novel.py",
            args: &["--env", "PendulumNoVel-v1", "--seeds", "{seeds}"],
        }),
        sets: &[],
        versus: None,
        to_the_end: false,
    },
    Goal {
        name: "Feed-forward PPO PendulumNoVel-v1",
        config: "pendulum-novel-ppo-lstm.yaml",
        target: Target::Return(-300.0),
        budget: Budget::EnvSteps(300_000),
        anchor: None,
        sets: &["policy.recurrent=null"],
        versus: None,
        to_the_end: false,
    },
    // Cooperative parallel games with one policy shared by all agents
    // (issue 73): PettingZoo's Pistonball (discrete) as the PettingZoo
    // documentation's own SB3 + SuperSuit recipe trains it, at its budget
    // and hyperparameters, beside that recipe on the same seeds: both
    // learning curves (the team's return of greedy games after each
    // rollout) at equal agent steps. Runs to the end of the budget.
    Goal {
        name: "PPO pistonball_v6 (one policy shared by 20 pistons)",
        config: "pistonball-ppo.yaml",
        target: Target::Return(PISTONBALL_TEAM_RETURN),
        budget: Budget::EnvSteps(81_920),
        anchor: Some(Anchor {
            script: "ppo_pistonball.py",
            args: &["--seeds", "{seeds}", "--steps", "81920"],
        }),
        sets: &[],
        versus: None,
        to_the_end: true,
    },
];

/// The team return of greedy Pistonball games the pistonball goal asks of
/// the last version: what the SB3 + SuperSuit recipe's last policy reached
/// at the same budget in `bench-learning`, 75.3 (seed 1) and 69.0 (seed
/// 2) over 50 games, their mean rounded down (docs/benchmarks.md; a
/// 50-game mean has a standard error of about 30).
pub const PISTONBALL_TEAM_RETURN: f64 = 72.0;

/// The Python with Stable-Baselines3 and torch: `RELAY_TORCH_PYTHON`, else
/// `.relay/sb3` (made by `bash deploy/install.sh --sb3`), else `python3`.
pub fn torch_python() -> String {
    std::env::var("RELAY_TORCH_PYTHON").unwrap_or_else(|_| {
        let venv = Path::new(".relay/sb3/bin/python");
        if venv.exists() {
            venv.display().to_string()
        } else {
            "python3".into()
        }
    })
}

/// Runs `anchor` for `seeds` and returns its last JSON line, or why there
/// is none.
fn run_anchor(anchor: &Anchor, seeds: &[u64]) -> Result<serde_json::Value, String> {
    let seeds = seeds
        .iter()
        .map(u64::to_string)
        .collect::<Vec<_>>()
        .join(",");
    let args: Vec<String> = anchor
        .args
        .iter()
        .map(|a| a.replace("{seeds}", &seeds))
        .collect();
    run_anchor_script(anchor.script, &args)
}

/// Runs `script` of `services/bench/sb3/` with `args` in the anchor's
/// Python ([`torch_python`], one thread) and returns its last line, JSON
/// with `env_steps_per_s`, or why there is none.
pub(crate) fn run_anchor_script(
    script: &str,
    args: &[String],
) -> Result<serde_json::Value, String> {
    let python = torch_python();
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("sb3")
        .join(script);
    println!("== anchor: {python} {} {}", path.display(), args.join(" "));
    let out = std::process::Command::new(&python)
        .arg(&path)
        .args(args)
        .env("OMP_NUM_THREADS", "1")
        .output()
        .map_err(|e| format!("{python}: {e}"))?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    for line in stdout.lines() {
        println!("   {line}");
    }
    let last = stdout.lines().last().unwrap_or_default();
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        return Err(format!(
            "{script} failed ({}); `bash deploy/install.sh --sb3` installs Stable-Baselines3 and sb3-contrib into .relay/sb3",
            err.lines().last().unwrap_or_default()
        ));
    }
    serde_json::from_str::<serde_json::Value>(last)
        .ok()
        .filter(|v| v["env_steps_per_s"].is_number())
        .ok_or_else(|| format!("{script} printed no env_steps_per_s: {last}"))
}

/// Flags of `relay bench-learning` (besides those of `relay up`, whose
/// `--config` is ignored: each goal has its preset).
#[derive(Debug, Clone, clap::Args)]
pub struct BenchLearningArgs {
    /// Seeds per goal: `first_seed`, `first_seed + 1`, ...
    #[arg(long, default_value_t = 3)]
    pub seeds: u64,
    /// The first seed (so that seeds of one goal can be run apart, e.g.
    /// `--first-seed 3 --seeds 1`).
    #[arg(long, default_value_t = 1)]
    pub first_seed: u64,
    /// Only the goals whose name contains this (case-insensitive), e.g. `dqn`.
    #[arg(long)]
    pub only: Option<String>,
    /// Folder of the presets.
    #[arg(long, default_value = "configs")]
    pub configs: PathBuf,
}

/// How one run of one goal went.
#[derive(Debug, Clone, PartialEq)]
struct Attempt {
    seed: u64,
    /// The mean return to reach (for [`Target::TimesRandom`], from this run's
    /// random-policy measurement).
    threshold: f64,
    /// The random policy's mean return ([`Target::TimesRandom`] only).
    random_return: Option<f64>,
    /// `(minutes since the start, learner env steps, mean return)` of every evaluation.
    curve: Vec<(f64, u64, f64)>,
    /// Screening and confirmation passed.
    solved: bool,
    /// Solved, and the best checkpoint's re-evaluation meets the goal.
    reached: bool,
    env_steps: u64,
    wall_s: f64,
    first_pass: Option<FirstPass>,
    best_eval: Option<f64>,
    /// The best checkpoint's figure over fresh episodes: its mean return,
    /// or for a self-play goal its weakest matchup's mean.
    reevaluated: Option<f64>,
    /// Self-play goals: the re-evaluation's results per opponent and seat,
    /// the goal's opponents then [`Versus::also`]'s.
    matchups: Vec<relay_proto::Matchup>,
    /// Self-play goals: the league's ratings, the first version against
    /// the newest that played (see `bench_league::first_vs_latest`).
    ratings: serde_json::Value,
}

/// The best mean return in a run's `eval.jsonl`.
fn best_eval(path: &Path) -> Option<f64> {
    eval_curve(path, None)
        .into_iter()
        .map(|(_, _, r)| r)
        .reduce(f64::max)
}

/// `(minutes since start, learner env steps, mean return)` of each line of
/// a run's `eval.jsonl` (minutes 0 without `start`).
fn eval_curve(path: &Path, start: Option<chrono::DateTime<chrono::Utc>>) -> Vec<(f64, u64, f64)> {
    let Ok(file) = std::fs::File::open(path) else {
        return Vec::new();
    };
    std::io::BufReader::new(file)
        .lines()
        .map_while(Result::ok)
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(&l).ok())
        .filter_map(|v| {
            let minutes = match (start, v["time"].as_str()) {
                (Some(start), Some(t)) => {
                    chrono::DateTime::parse_from_rfc3339(t).ok().map(|t| {
                        (t.with_timezone(&chrono::Utc) - start).num_milliseconds() as f64 / 60_000.0
                    })?
                }
                _ => 0.0,
            };
            Some((
                minutes,
                v["learner_env_steps"].as_u64().unwrap_or(0),
                v["mean_return"].as_f64()?,
            ))
        })
        .collect()
}

/// Mean return of the uniformly random policy over `episodes` episodes of
/// the config's env (made as the services make it), seeded by `seed`.
pub fn random_policy_return(
    config: &relay_config::ExperimentConfig,
    episodes: usize,
    seed: u64,
) -> Result<f64> {
    use rand::{Rng, SeedableRng};
    use relay_envs::{ActionSpace, VecActions};
    let n = 8;
    let mut envs = relay_bridge::VecEnvs::new(&config.run.env_id, &config.env, n, seed)?;
    let space = envs.spec().action_space.clone();
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    envs.reset()?;
    let mut returns = Vec::with_capacity(episodes);
    while returns.len() < episodes {
        let step = match &space {
            ActionSpace::Discrete { n: k } => {
                let a: Vec<i64> = (0..n).map(|_| rng.random_range(0..*k as i64)).collect();
                envs.step(VecActions::Discrete(&a))
            }
            ActionSpace::Box { low, high } => {
                let a: Vec<f32> = (0..n)
                    .flat_map(|_| low.iter().zip(high).collect::<Vec<_>>())
                    .map(|(l, h)| rng.random_range(*l..=*h))
                    .collect();
                envs.step(VecActions::Continuous(&a))
            }
        };
        match step {
            Ok(step) => returns.extend(step.finished.iter().map(|e| e.episode_return)),
            // A faulted env loses its episode, as in training.
            Err(relay_bridge::BridgeError::Faulted { .. }) => {}
            Err(e) => return Err(e.into()),
        }
    }
    returns.truncate(episodes);
    Ok(returns.iter().sum::<f64>() / returns.len() as f64)
}

/// The goals `only` selects (all without it).
fn selected(only: Option<&str>) -> Vec<Goal> {
    let only = only.map(str::to_lowercase);
    GOALS
        .iter()
        .filter(|g| {
            only.as_ref()
                .is_none_or(|o| g.name.to_lowercase().contains(o.as_str()))
        })
        .copied()
        .collect()
}

/// `relay bench-learning`.
pub fn bench_learning(base: UpArgs, args: BenchLearningArgs) -> Result<()> {
    if args.seeds == 0 {
        bail!("--seeds must be at least 1");
    }
    let goals = selected(args.only.as_deref());
    if goals.is_empty() {
        bail!(
            "--only {:?} matches no goal; goals: {}",
            args.only.unwrap_or_default(),
            GOALS.iter().map(|g| g.name).collect::<Vec<_>>().join(", ")
        );
    }
    let stamp = chrono::Local::now().format("%Y%m%d-%H%M%S");
    // Per goal: its runs and the anchor's report (`Some(None)`: an anchor
    // that could not be measured), or `None` for a missing preset.
    #[allow(clippy::type_complexity)]
    let mut results: Vec<(
        Goal,
        Option<(Vec<Attempt>, Option<Option<serde_json::Value>>)>,
    )> = Vec::new();
    for goal in goals {
        let config = args.configs.join(goal.config);
        if !config.exists() {
            println!(
                "== {}: {} does not exist; not measured",
                goal.name,
                config.display()
            );
            results.push((goal, None));
            continue;
        }
        let mut attempts = Vec::new();
        for seed in args.first_seed..args.first_seed + args.seeds {
            let mut run = base.clone();
            run.config = config.clone();
            run.until_solved = true;
            run.quiet = true;
            run.overrides.push(format!("run.seed={seed}"));
            let (threshold, random_return) = match goal.target {
                Target::Return(r) => (r, None),
                Target::TimesRandom(k) => {
                    let preset = relay_config::ExperimentConfig::load(&run.config, &run.overrides)?;
                    let random = random_policy_return(&preset, RANDOM_EPISODES, seed)?;
                    println!("== {}: the random policy's mean return over {RANDOM_EPISODES} episodes: {random:.3}", goal.name);
                    (k * random, Some(random))
                }
            };
            println!(
                "== {} seed {seed}: mean eval >= {threshold} within {}",
                goal.name, goal.budget
            );
            match goal.budget {
                Budget::EnvSteps(steps) => {
                    run.overrides.push(format!("run.total_env_steps={steps}"))
                }
                Budget::Minutes(m) => run.for_seconds = Some(m * 60),
            }
            run.overrides.extend(if goal.to_the_end {
                // Never solved: the run trains to its budget.
                [
                    "eval.threshold=1e12".to_string(),
                    "run.stop_when_solved=false".to_string(),
                ]
            } else {
                [
                    format!("eval.threshold={threshold}"),
                    "run.stop_when_solved=true".to_string(),
                ]
            });
            // The goal's own settings last: they may change the bench's.
            run.overrides
                .extend(goal.sets.iter().map(|s| s.to_string()));
            let loaded = relay_config::ExperimentConfig::load(&run.config, &run.overrides)?;
            // A variant's overrides name its runs apart from the preset's.
            let variant: String = goal
                .sets
                .iter()
                .flat_map(|s| std::iter::once('-').chain(s.chars()))
                .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
                .collect();
            let run_id = format!(
                "bench-learning-{}{variant}-s{seed}-{stamp}",
                goal.config.trim_end_matches(".yaml"),
            );
            run.run_id = Some(run_id.clone());
            let started = chrono::Utc::now();
            let ratings = goal
                .versus
                .filter(|v| v.newest_above_first)
                .map(|_| crate::bench_league::RatingsFollower::start(&run.state_dir, &run_id));
            let outcome = up(run)?;
            let ratings = ratings.map_or(serde_json::Value::Null, |r| r.finish());
            let judged = if goal.to_the_end { "last" } else { "best" };
            let reevaluated = reevaluate(&loaded, &run_id, judged);
            let also = goal.versus.map_or(&[][..], |v| v.also);
            let also_played = (!also.is_empty())
                .then(|| reevaluate_best_against(&loaded, &run_id, &also.join(",")))
                .flatten();
            let eval_log = loaded.run.runs_dir.join(&run_id).join("eval.jsonl");
            let figure = reevaluated
                .as_ref()
                .map(|r| r.weakest_matchup_mean.unwrap_or(r.mean_return));
            let ratings_met = !goal.versus.is_some_and(|v| v.newest_above_first)
                || ratings["latest_above_first"] == true;
            let attempt = Attempt {
                seed,
                threshold,
                random_return,
                curve: eval_curve(&eval_log, Some(started)),
                solved: outcome.solved,
                reached: (outcome.solved || goal.to_the_end)
                    && figure.is_some_and(|f| f >= threshold)
                    && ratings_met,
                env_steps: outcome.env_steps,
                wall_s: outcome.wall_s,
                first_pass: outcome.first_pass,
                best_eval: best_eval(&eval_log),
                reevaluated: figure,
                matchups: reevaluated
                    .into_iter()
                    .chain(also_played)
                    .flat_map(|r| r.matchups)
                    .collect(),
                ratings,
            };
            println!(
                "   {} at {} env steps, {:.1}s (first screening pass: {}); best eval {}; {judged} checkpoint over {} fresh episodes {}: goal {}",
                if attempt.solved { "solved" } else { "not solved" },
                attempt.env_steps,
                attempt.wall_s,
                attempt.first_pass.map_or("none".into(), |f| format!("{} env steps, {:.1}s", f.env_steps, f.wall_s)),
                attempt.best_eval.map_or("-".into(), relay::summary::figure),
                crate::bench_solve::reeval_episodes(&loaded),
                attempt.reevaluated.map_or("-".into(), relay::summary::figure),
                if attempt.reached { "reached" } else { "not reached" },
            );
            for m in &attempt.matchups {
                println!(
                    "   best checkpoint vs {} from seat {}: W/D/L {}/{}/{} ({:.1} % won, {:.1} % not lost)",
                    m.opponent,
                    m.seat,
                    m.wins,
                    m.draws,
                    m.losses,
                    100.0 * m.wins as f64 / m.games.max(1) as f64,
                    100.0 * (m.wins + m.draws) as f64 / m.games.max(1) as f64,
                );
            }
            if random_return.is_some() || goal.versus.is_some() || goal.anchor.is_some() {
                let points: Vec<String> = attempt
                    .curve
                    .iter()
                    .map(|(m, steps, r)| format!("{m:.1} min / {steps} steps: {r:.2}"))
                    .collect();
                println!("   evaluation curve: {}", points.join("; "));
            }
            attempts.push(attempt);
        }
        let anchor = goal.anchor.map(|anchor| {
            let seeds: Vec<u64> = (args.first_seed..args.first_seed + args.seeds).collect();
            let measured = run_anchor(&anchor, &seeds);
            if let Err(why) = &measured {
                println!("   anchor not measured: {why}");
            }
            measured.ok()
        });
        results.push((goal, Some((attempts, anchor))));
    }

    println!();
    // A goal run to the end is judged by its last checkpoint (an anchor's
    // row: its last policy's evaluation), a team game's episodes count
    // its agents'.
    println!("| goal | threshold | budget | seed | solved (confirmed) | env_steps | wall_s | first pass: env_steps | first pass: wall_s | best eval | best (to the end: last) re-evaluated ({REEVAL_EPISODES} fresh) | reached |");
    println!("|---|---:|---:|---:|:---:|---:|---:|---:|---:|---:|---:|:---:|");
    let mut json_goals = Vec::new();
    for (goal, attempts) in &results {
        match attempts {
            None => {
                println!(
                    "| {} | {} | {} | - | missing preset | - | - | - | - | - | - | - |",
                    goal.name, goal.target, goal.budget
                );
                json_goals
                    .push(json!({"goal": goal.name, "config": goal.config, "measured": false}));
            }
            Some((attempts, anchor)) => {
                for a in attempts {
                    let fmt = |v: Option<f64>| v.map_or("-".to_string(), relay::summary::figure);
                    println!(
                        "| {} | {} | {} | {} | {} | {} | {:.1} | {} | {} | {} | {} | {} |",
                        goal.name,
                        match goal.target {
                            Target::Return(r) => r.to_string(),
                            Target::TimesRandom(k) => format!(
                                "{:.2} ({k}x random {:.3})",
                                a.threshold,
                                a.random_return.unwrap_or(f64::NAN)
                            ),
                        },
                        goal.budget,
                        a.seed,
                        if a.solved { "yes" } else { "no" },
                        a.env_steps,
                        a.wall_s,
                        a.first_pass.map_or("-".into(), |f| f.env_steps.to_string()),
                        fmt(a.first_pass.map(|f| f.wall_s)),
                        fmt(a.best_eval),
                        fmt(a.reevaluated),
                        if a.reached { "yes" } else { "no" },
                    );
                }
                // Over the whole runs, start-up and evaluation included.
                let relay_sps = attempts.iter().map(|a| a.env_steps as f64).sum::<f64>()
                    / attempts.iter().map(|a| a.wall_s).sum::<f64>().max(1e-9);
                let anchor_sps = anchor
                    .as_ref()
                    .and_then(|a| a.as_ref()?["env_steps_per_s"].as_f64());
                json_goals.push(json!({
                    "goal": goal.name,
                    "config": goal.config,
                    "measured": true,
                    "reached": attempts.iter().filter(|a| a.reached).count(),
                    "solved": attempts.iter().filter(|a| a.solved).count(),
                    "seeds": attempts.len(),
                    "env_steps": attempts.iter().map(|a| a.env_steps).collect::<Vec<_>>(),
                    "wall_s": attempts.iter().map(|a| (a.wall_s * 10.0).round() / 10.0).collect::<Vec<_>>(),
                    "first_pass_env_steps": attempts.iter().map(|a| a.first_pass.map(|f| f.env_steps)).collect::<Vec<_>>(),
                    "first_pass_wall_s": attempts.iter().map(|a| a.first_pass.map(|f| (f.wall_s * 10.0).round() / 10.0)).collect::<Vec<_>>(),
                    "best_eval": attempts.iter().map(|a| a.best_eval).collect::<Vec<_>>(),
                    "best_reevaluated": attempts.iter().map(|a| a.reevaluated.map(|r| (r * 10.0).round() / 10.0)).collect::<Vec<_>>(),
                    "threshold": attempts.iter().map(|a| a.threshold).collect::<Vec<_>>(),
                    "random_return": attempts.iter().map(|a| a.random_return).collect::<Vec<_>>(),
                    "curve": attempts.iter().map(|a| a.curve.iter().map(|(m, s, r)| json!([(m * 10.0).round() / 10.0, s, r])).collect::<Vec<_>>()).collect::<Vec<_>>(),
                    "matchups": attempts.iter().map(|a| a.matchups.iter().map(|m| json!({"opponent": m.opponent, "seat": m.seat, "games": m.games, "wins": m.wins, "draws": m.draws, "losses": m.losses})).collect::<Vec<_>>()).collect::<Vec<_>>(),
                    "ratings": attempts.iter().map(|a| a.ratings.clone()).collect::<Vec<_>>(),
                    "env_steps_per_s": relay_sps,
                    "anchor_env_steps_per_s": anchor_sps,
                    "anchor_runs": anchor.as_ref().and_then(|a| a.as_ref()).map(|a| a["runs"].clone()),
                }));
                if let Some(anchor) = anchor {
                    let runs = anchor.as_ref().and_then(|a| a["runs"].as_array());
                    for run in runs.into_iter().flatten() {
                        println!(
                            "| {} ({}) | {} | {} | {} | {} | {} | {} | - | - | {} | {} | - |",
                            goal.name,
                            anchor
                                .as_ref()
                                .map_or("-", |a| a["algo"].as_str().unwrap_or("anchor")),
                            goal.target,
                            goal.budget,
                            run["seed"],
                            if run["solved"].as_bool() == Some(true) {
                                "yes"
                            } else {
                                "no"
                            },
                            run["env_steps"],
                            run["wall_s"],
                            anchor_figure(run, "best_eval"),
                            anchor_figure(run, "last_return"),
                        );
                    }
                    println!(
                        "| {} env steps/s | relay {relay_sps:.1} | anchor {} | ratio {} |",
                        goal.name,
                        anchor_sps.map_or("-".into(), |a| format!("{a:.1}")),
                        anchor_sps.map_or("-".into(), |a| format!("{:.2}x", relay_sps / a)),
                    );
                }
            }
        }
    }
    println!(
        "{}",
        json!({"seeds": args.seeds, "first_seed": args.first_seed, "goals": json_goals})
    );
    Ok(())
}

/// An anchor run's figure `key` for the table, `-` where it has none.
fn anchor_figure(run: &serde_json::Value, key: &str) -> String {
    run[key].as_f64().map_or("-".into(), relay::summary::figure)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn goals_select_by_name_and_every_existing_preset_loads_with_its_goal() {
        assert_eq!(selected(None).len(), GOALS.len());
        let dqn: Vec<&str> = selected(Some("DQN")).iter().map(|g| g.name).collect();
        assert_eq!(dqn, vec!["DQN CartPole-v1", "DQN MountainCar-v0"]);
        assert!(selected(Some("alphago")).is_empty());
        let configs = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../configs");
        for goal in GOALS {
            if let Some(anchor) = goal.anchor {
                let script = Path::new(env!("CARGO_MANIFEST_DIR"))
                    .join("sb3")
                    .join(anchor.script);
                assert!(script.exists(), "{}", script.display());
            }
            let path = configs.join(goal.config);
            if !path.exists() {
                continue;
            }
            let threshold = match goal.target {
                Target::Return(r) => r,
                Target::TimesRandom(k) => k * 0.5,
            };
            let mut overrides: Vec<String> = goal.sets.iter().map(|s| s.to_string()).collect();
            overrides.push(format!("eval.threshold={threshold}"));
            if let Budget::EnvSteps(steps) = goal.budget {
                overrides.push(format!("run.total_env_steps={steps}"));
            }
            let config = relay_config::ExperimentConfig::load(&path, &overrides)
                .unwrap_or_else(|e| panic!("{}: {e}", goal.config));
            assert_eq!(config.solved_threshold(), Some(threshold));
        }
    }

    #[test]
    fn the_best_evaluation_is_read_from_eval_jsonl() {
        let dir = relay_testkit::TempDir::new("bench-learning");
        let path = dir.path().join("eval.jsonl");
        std::fs::write(
            &path,
            "{\"mean_return\": -300.0}\n{\"mean_return\": -95.5}\nnot json\n{\"mean_return\": -120.0}\n",
        )
        .unwrap();
        assert_eq!(best_eval(&path), Some(-95.5));
        assert_eq!(best_eval(&dir.path().join("missing.jsonl")), None);
    }
}
