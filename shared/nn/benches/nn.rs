//! `cargo bench -p relay-nn`: acting and PPO training-step timings for the
//! CartPole-sized policy (obs 4, hidden [64, 64], tanh, 2 actions), a DQN
//! train step (CartPole Q-network, batch 64 and 256) and a SAC train step
//! (Pendulum sizes, hidden [256, 256], batch 256). CNN policies at batch
//! 256: SB3's NatureCNN on 4x84x84 frames (6 actions), IMPALA's ResNet on
//! 4x84x84 (6 actions) and MinAtar's network on 4x10x10 (3 actions), a
//! no-grad forward and a PPO train step each; DQN train steps at batch 32
//! of SB3's DQN `CnnPolicy` (NatureCNN, 6 actions) on 4x84x84 and of
//! MinAtar's network on Seaquest's 10x10x10 (6 actions); with
//! PyTorch's times for the same networks and steps beside them (1 thread,
//! `benches/torch_cnn.py`, run by `RELAY_TORCH_PYTHON`, else the Python of
//! `.relay/sb3` (`bash deploy/install.sh --sb3`), else `python3`, when it
//! has `torch`; reported as missing otherwise).
//!
//! Prints a table, then one line of JSON. Runs with `RAYON_NUM_THREADS=1`
//! unless the variable is already set. Besides relay-nn's own paths it
//! times a "plain candle" baseline built from the same `Var`s with stock
//! candle ops (built-in `tanh`, composed log-softmax and PPO loss), which is
//! what the fused ops and kernels replace.

use std::collections::BTreeMap;
use std::hint::black_box;
use std::time::{Duration, Instant};

use candle_core::{DType, Device, Tensor, Var, D};
use rand::{Rng, SeedableRng};
use relay_nn::{
    clip_grad_norm, ppo_loss, ActorCritic, Adam, AdamConfig, CnnSpec, PolicySpec, PpoInputs,
    PpoLossConfig,
};

/// The CNN policies timed at batch 256, as `(key, label, extractor, actions)`.
fn cnn_cases() -> Vec<(&'static str, &'static str, CnnSpec, usize)> {
    vec![
        (
            "nature_cnn",
            "NatureCNN 4x84x84",
            CnnSpec {
                input: [4, 84, 84],
                ..CnnSpec::default()
            },
            6,
        ),
        (
            "impala_cnn",
            "IMPALA CNN 4x84x84",
            CnnSpec {
                input: [4, 84, 84],
                ..CnnSpec::impala()
            },
            6,
        ),
        (
            "minatar_cnn",
            "MinAtar CNN 4x10x10",
            CnnSpec {
                input: [4, 10, 10],
                ..CnnSpec::minatar()
            },
            3,
        ),
    ]
}

/// The DQN train steps at batch 32, as `(key, label, extractor,
/// actions)`: SB3's DQN `CnnPolicy` (NatureCNN, `hidden: []`) on Atari
/// frames, and relay's MinAtar DQN presets' network on Seaquest's 10x10x10
/// (6 actions), the step a MinAtar DQN run takes once per env step.
fn dqn_cnn_cases() -> Vec<(&'static str, &'static str, CnnSpec, usize)> {
    let [nature, _, minatar] = <[_; 3]>::try_from(cnn_cases()).expect("three CNN cases");
    vec![
        (
            "dqn_nature_cnn",
            "DQN NatureCNN 4x84x84",
            nature.2,
            nature.3,
        ),
        (
            "dqn_minatar_cnn",
            "DQN MinAtar CNN 10x10x10",
            CnnSpec {
                input: [10, 10, 10],
                ..minatar.2
            },
            6,
        ),
    ]
}

/// The DQN train steps' batch (SB3's and the MinAtar paper's).
const DQN_BATCH: usize = 32;

/// The rows PyTorch times, as `(case, JSON key, label)`: [`cnn_cases`]'
/// forward and PPO train step, and the DQN train step.
fn torch_rows() -> Vec<(&'static str, String, String)> {
    let mut rows = Vec::new();
    for (key, label, ..) in cnn_cases() {
        for (what, name) in [
            ("forward", "forward (no grad)"),
            ("train_step", "PPO train step"),
        ] {
            rows.push((
                key,
                format!("{key}_{what}_b256_us"),
                format!("{label} {name} batch 256"),
            ));
        }
    }
    for (key, label, ..) in dqn_cnn_cases() {
        rows.push((
            key,
            format!("{key}_train_step_b{DQN_BATCH}_us"),
            format!("{label} train step batch {DQN_BATCH}"),
        ));
    }
    rows
}

/// PyTorch's times for `cases` of `benches/torch_cnn.py` (JSON keys
/// `torch_<case>_..._us`), or why there are none.
fn torch_times(
    budget: Duration,
    cases: &[&str],
) -> Result<serde_json::Map<String, serde_json::Value>, String> {
    // `bash deploy/install.sh --sb3` puts torch into the project's .relay/sb3.
    let venv = concat!(env!("CARGO_MANIFEST_DIR"), "/../../.relay/sb3/bin/python");
    let python = std::env::var("RELAY_TORCH_PYTHON").unwrap_or_else(|_| {
        if std::path::Path::new(venv).exists() {
            venv
        } else {
            "python3"
        }
        .into()
    });
    let out = std::process::Command::new(&python)
        .args(["-c", include_str!("torch_cnn.py")])
        .arg(budget.as_secs_f64().to_string())
        .arg(cases.join(","))
        .env("OMP_NUM_THREADS", "1")
        .output()
        .map_err(|e| format!("{python}: {e}"))?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        let last = err.lines().last().unwrap_or("").to_string();
        return Err(format!(
            "{python} has no working torch ({last}); run `bash deploy/install.sh --sb3` or set RELAY_TORCH_PYTHON to a Python with torch"
        ));
    }
    let line = String::from_utf8_lossy(&out.stdout);
    serde_json::from_str(line.trim()).map_err(|e| format!("torch_cnn.py printed {line:?}: {e}"))
}

/// Median and minimum time per call of `f` (over batches of calls lasting
/// about 1 ms each), in microseconds, over about `budget`.
fn time_us(budget: Duration, f: &mut dyn FnMut()) -> (f64, f64) {
    for _ in 0..5 {
        f();
    }
    let start = Instant::now();
    f();
    let once = start.elapsed().max(Duration::from_nanos(100));
    // Batches of calls lasting about 1 ms, as many batches as fit the budget.
    let per_batch = ((Duration::from_millis(1).as_nanos() / once.as_nanos()).max(1)) as usize;
    let batches =
        ((budget.as_nanos() / (once.as_nanos() * per_batch as u128)).clamp(5, 1000)) as usize;
    let mut samples: Vec<f64> = (0..batches)
        .map(|_| {
            let t = Instant::now();
            for _ in 0..per_batch {
                f();
            }
            t.elapsed().as_secs_f64() * 1e6 / per_batch as f64
        })
        .collect();
    samples.sort_by(|a, b| a.partial_cmp(b).unwrap());
    (samples[samples.len() / 2], samples[0])
}

/// The same actor-critic, with stock candle ops on the model's own vars.
struct Baseline {
    pi: Vec<(Tensor, Tensor)>,
    vf: Vec<(Tensor, Tensor)>,
}

impl Baseline {
    fn new(model: &ActorCritic) -> Self {
        let vars: BTreeMap<&str, Var> = model
            .parameter_names()
            .into_iter()
            .zip(model.vars())
            .collect();
        let get = |p: &str| {
            (
                vars[format!("{p}.weight").as_str()].as_tensor().clone(),
                vars[format!("{p}.bias").as_str()].as_tensor().clone(),
            )
        };
        Self {
            pi: vec![
                get("mlp_extractor.policy_net.0"),
                get("mlp_extractor.policy_net.2"),
                get("action_net"),
            ],
            vf: vec![
                get("mlp_extractor.value_net.0"),
                get("mlp_extractor.value_net.2"),
                get("value_net"),
            ],
        }
    }

    fn mlp(layers: &[(Tensor, Tensor)], x: &Tensor) -> candle_core::Result<Tensor> {
        let mut h = x.clone();
        for (i, (w, b)) in layers.iter().enumerate() {
            h = h.matmul(&w.t()?)?.broadcast_add(b)?;
            if i + 1 < layers.len() {
                h = h.tanh()?;
            }
        }
        Ok(h)
    }

    fn forward(&self, x: &Tensor) -> candle_core::Result<(Tensor, Tensor)> {
        Ok((Self::mlp(&self.pi, x)?, Self::mlp(&self.vf, x)?.squeeze(1)?))
    }

    /// evaluate + PPO loss (SB3 form) composed from candle ops.
    fn loss(
        &self,
        x: &Tensor,
        actions: &Tensor,
        old_lp: &Tensor,
        adv: &Tensor,
        ret: &Tensor,
    ) -> candle_core::Result<Tensor> {
        let (logits, values) = self.forward(x)?;
        let lsm = candle_nn::ops::log_softmax(&logits, D::Minus1)?;
        let lp = lsm.gather(&actions.unsqueeze(1)?, 1)?.squeeze(1)?;
        let ent = (lsm.exp()? * &lsm)?.sum(1)?.neg()?;
        let ratio = (lp - old_lp)?.exp()?;
        let s1 = (&ratio * adv)?;
        let s2 = (ratio.clamp(0.8f32, 1.2f32)? * adv)?;
        let pl = s1.minimum(&s2)?.mean_all()?.neg()?;
        let vl = (values - ret)?.sqr()?.mean_all()?;
        let el = ent.mean_all()?.neg()?;
        pl + (vl * 0.5)? + (el * 0.0)?
    }
}

fn main() -> relay_nn::Result<()> {
    if std::env::var_os("RAYON_NUM_THREADS").is_none() {
        // Edition 2021: set_var is safe; nothing else runs yet.
        std::env::set_var("RAYON_NUM_THREADS", "1");
    }
    let threads = std::env::var("RAYON_NUM_THREADS").unwrap_or_default();
    let budget = Duration::from_millis(
        std::env::var("BENCH_MS")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(400),
    );
    let spec = PolicySpec::discrete(4, 2);
    let model = ActorCritic::new(&spec, 0)?;
    let base = Baseline::new(&model);
    let mut rng = rand::rngs::StdRng::seed_from_u64(1);
    let mut json: Vec<(String, f64)> = Vec::new();
    let mut rows: Vec<(String, (f64, f64))> = Vec::new();
    // BENCH_FILTER=prefix runs only the cases whose JSON key starts with it.
    let filter = std::env::var("BENCH_FILTER").unwrap_or_default();
    let want = |key: &str| key.starts_with(filter.as_str());
    let mut bench = |key: String, label: String, f: &mut dyn FnMut()| {
        if want(&key) {
            let us = time_us(budget, f);
            rows.push((label, us));
            json.push((key, us.0));
        }
    };

    println!("relay-nn bench: obs 4, hidden [64, 64] tanh, 2 actions, RAYON_NUM_THREADS={threads}");

    for &n in &[1usize, 8, 16, 64, 256, 512] {
        let obs: Vec<f32> = (0..n * 4).map(|_| rng.random_range(-1.0..1.0)).collect();
        let mut r = rand::rngs::StdRng::seed_from_u64(2);
        bench(
            format!("act_b{n}_us"),
            format!("act (sample, logprob, value) batch {n}"),
            &mut || {
                black_box(model.act(black_box(&obs), n, false, &mut r).unwrap());
            },
        );
        let x = Tensor::from_slice(&obs, (n, 4), &Device::Cpu)?;
        bench(
            format!("baseline_forward_b{n}_us"),
            format!("plain candle forward (actor+critic) batch {n}"),
            &mut || {
                let x = Tensor::from_slice(&obs, (n, 4), &Device::Cpu).unwrap();
                let (l, v) = base.forward(&x).unwrap();
                black_box((l.to_vec2::<f32>().unwrap(), v.to_vec1::<f32>().unwrap()));
            },
        );
        let acts = Tensor::zeros(n, DType::U32, &Device::Cpu)?;
        bench(
            format!("evaluate_fwd_b{n}_us"),
            format!("evaluate forward (fused ops, graph) batch {n}"),
            &mut || {
                black_box(model.evaluate(&x, &acts).unwrap());
            },
        );
    }

    for &b in &[256usize, 512] {
        let obs: Vec<f32> = (0..b * 4).map(|_| rng.random_range(-1.0..1.0)).collect();
        let actions: Vec<u32> = (0..b).map(|_| rng.random_range(0..2)).collect();
        let old_lp: Vec<f32> = (0..b)
            .map(|_| -0.69 + rng.random_range(-0.05..0.05))
            .collect();
        let old_v: Vec<f32> = vec![0.0; b];
        let adv: Vec<f32> = (0..b).map(|_| rng.random_range(-1.0..1.0)).collect();
        let ret: Vec<f32> = adv.clone();
        let x = Tensor::from_slice(&obs, (b, 4), &Device::Cpu)?;
        let a = Tensor::from_slice(&actions, b, &Device::Cpu)?;

        // A separate model per variant so Adam updates do not interact.
        let m = ActorCritic::new(&spec, 0)?;
        let mut opt = Adam::new(m.vars(), AdamConfig::default())?;
        let cfg = PpoLossConfig::default();
        let mut phases = [0f64; 5];
        let mut steps = 0u32;
        bench(
            format!("train_step_b{b}_us"),
            format!("PPO train step (evaluate+loss+backward+clip+Adam) batch {b}"),
            &mut || {
                let t0 = Instant::now();
                let (lp, ent, v) = m.evaluate(&x, &a).unwrap();
                let t1 = Instant::now();
                let out = ppo_loss(
                    &cfg,
                    &PpoInputs {
                        logprob: &lp,
                        entropy: &ent,
                        values: &v,
                        old_logprob: &old_lp,
                        old_values: &old_v,
                        advantages: &adv,
                        returns: &ret,
                    },
                )
                .unwrap();
                let t2 = Instant::now();
                let mut grads = out.loss.backward().unwrap();
                let t3 = Instant::now();
                black_box(clip_grad_norm(&mut grads, opt.vars(), 0.5).unwrap());
                let t4 = Instant::now();
                opt.step(&grads).unwrap();
                let t5 = Instant::now();
                for (p, (s, e)) in
                    phases
                        .iter_mut()
                        .zip([(t0, t1), (t1, t2), (t2, t3), (t3, t4), (t4, t5)])
                {
                    *p += (e - s).as_secs_f64() * 1e6;
                }
                steps += 1;
            },
        );
        let names = ["evaluate", "ppo_loss", "backward", "clip", "adam"];
        let breakdown: Vec<String> = names
            .iter()
            .zip(phases)
            .map(|(n, t)| format!("{n} {:.1}", t / steps as f64))
            .collect();
        if steps > 0 {
            println!("  batch {b} phases (mean µs): {}", breakdown.join(", "));
        }

        let m2 = ActorCritic::new(&spec, 0)?;
        let base2 = Baseline::new(&m2);
        let mut opt2 = Adam::new(m2.vars(), AdamConfig::default())?;
        let (old_lp_t, adv_t, ret_t) = (
            Tensor::from_slice(&old_lp, b, &Device::Cpu)?,
            Tensor::from_slice(&relay_nn::normalize(&adv), b, &Device::Cpu)?,
            Tensor::from_slice(&ret, b, &Device::Cpu)?,
        );
        bench(
            format!("baseline_train_step_b{b}_us"),
            format!("plain candle train step (same Adam) batch {b}"),
            &mut || {
                let loss = base2.loss(&x, &a, &old_lp_t, &adv_t, &ret_t).unwrap();
                let mut grads = loss.backward().unwrap();
                black_box(clip_grad_norm(&mut grads, opt2.vars(), 0.5).unwrap());
                opt2.step(&grads).unwrap();
            },
        );
    }

    // DQN: CartPole Q-network (4-64-64-2, ReLU), loss + backward + Adam.
    let qspec = relay_nn::QNetSpec::new(4, 2);
    for &b in &[64usize, 256] {
        let online = relay_nn::QNetwork::new(&qspec, 0)?;
        let target = online.duplicate()?;
        let mut opt = Adam::new(online.vars(), AdamConfig::default())?;
        let obs: Vec<f32> = (0..b * 4).map(|_| rng.random_range(-1.0..1.0)).collect();
        let next_obs: Vec<f32> = (0..b * 4).map(|_| rng.random_range(-1.0..1.0)).collect();
        let actions: Vec<u32> = (0..b).map(|_| rng.random_range(0..2)).collect();
        let returns: Vec<f32> = vec![1.0; b];
        let discounts: Vec<f32> = vec![0.99; b];
        let cfg = relay_nn::DqnLossConfig {
            double_q: true,
            ..Default::default()
        };
        bench(
            format!("dqn_train_step_b{b}_us"),
            format!("DQN train step (double, targets+loss+backward+Adam) batch {b}"),
            &mut || {
                let out = relay_nn::dqn_loss(
                    &cfg,
                    &online,
                    &target,
                    &relay_nn::DqnBatch {
                        obs: &obs,
                        actions: &actions,
                        returns: &returns,
                        next_obs: &next_obs,
                        discounts: &discounts,
                        weights: None,
                        next_masks: None,
                    },
                )
                .unwrap();
                opt.step(&out.loss.backward().unwrap()).unwrap();
            },
        );
    }

    // SAC: Pendulum sizes (obs 3, 1 action, hidden [256, 256], ReLU).
    {
        let b = 256;
        let sspec = relay_nn::SacSpec::new(3, vec![-2.0], vec![2.0]);
        let sac = relay_nn::Sac::new(&sspec, 1.0, 0)?;
        let cfg = relay_nn::SacConfig::default();
        let mut opt = relay_nn::SacOptimizers::new(&sac, &cfg)?;
        let obs: Vec<f32> = (0..b * 3).map(|_| rng.random_range(-1.0..1.0)).collect();
        let next_obs: Vec<f32> = (0..b * 3).map(|_| rng.random_range(-1.0..1.0)).collect();
        let actions: Vec<f32> = (0..b).map(|_| rng.random_range(-2.0..2.0)).collect();
        let returns: Vec<f32> = (0..b).map(|_| rng.random_range(-1.0..0.0)).collect();
        let discounts: Vec<f32> = vec![0.99; b];
        for threads in [1, 2] {
            let pair = relay_nn::Pair::new(threads)?;
            let mut r = rand::rngs::StdRng::seed_from_u64(3);
            bench(
                format!("sac_train_step_b{b}_t{threads}_us"),
                format!(
                    "SAC train step (alpha+critics+actor+Polyak) batch {b}, {threads} thread(s)"
                ),
                &mut || {
                    black_box(
                        relay_nn::sac_train_step(
                            &cfg,
                            &sac,
                            &mut opt,
                            &relay_nn::SacBatch {
                                obs: &obs,
                                actions: &actions,
                                returns: &returns,
                                next_obs: &next_obs,
                                discounts: &discounts,
                            },
                            &mut r,
                            &pair,
                        )
                        .unwrap(),
                    );
                },
            );
        }
        let mut r2 = rand::rngs::StdRng::seed_from_u64(4);
        bench(
            "sac_act_b1_us".into(),
            "SAC actor act (sample) batch 1".into(),
            &mut || {
                black_box(sac.actor.act(&obs[..3], 1, false, &mut r2).unwrap());
            },
        );
    }

    // CNN policies at batch 256: forward (act's graph-free path) and a PPO
    // train step, as the learner runs them.
    for (key, label, cnn, n_actions) in cnn_cases() {
        let b = 256;
        let d = cnn.input_len();
        let mut spec = PolicySpec::discrete(d, n_actions);
        spec.hidden = vec![];
        spec.cnn = Some(cnn);
        let m = ActorCritic::new(&spec, 0)?;
        let obs: Vec<f32> = (0..b * d)
            .map(|_| rng.random_range(0..=255u8) as f32)
            .collect();
        let mut r = rand::rngs::StdRng::seed_from_u64(5);
        bench(
            format!("{key}_forward_b{b}_us"),
            format!("{label} act (no graph) batch {b}"),
            &mut || {
                black_box(m.act(black_box(&obs), b, false, &mut r).unwrap());
            },
        );
        let x = Tensor::from_slice(&obs, (b, d), &Device::Cpu)?;
        let a = Tensor::from_vec(
            (0..b)
                .map(|_| rng.random_range(0..n_actions as u32))
                .collect::<Vec<_>>(),
            b,
            &Device::Cpu,
        )?;
        let old_lp = vec![-1.0f32; b];
        let old_v = vec![0f32; b];
        let adv: Vec<f32> = (0..b).map(|_| rng.random_range(-1.0..1.0)).collect();
        let mut opt = Adam::new(m.vars(), AdamConfig::default())?;
        let cfg = PpoLossConfig::default();
        bench(
            format!("{key}_train_step_b{b}_us"),
            format!("{label} PPO train step batch {b}"),
            &mut || {
                let (lp, ent, v) = m.evaluate(&x, &a).unwrap();
                let out = ppo_loss(
                    &cfg,
                    &PpoInputs {
                        logprob: &lp,
                        entropy: &ent,
                        values: &v,
                        old_logprob: &old_lp,
                        old_values: &old_v,
                        advantages: &adv,
                        returns: &adv,
                    },
                )
                .unwrap();
                let mut grads = out.loss.backward().unwrap();
                black_box(clip_grad_norm(&mut grads, opt.vars(), 0.5).unwrap());
                opt.step(&grads).unwrap();
            },
        );
    }
    // DQN with a CNN and `hidden: []` as the learner runs it: targets,
    // Huber loss, backward, grad-norm clip 10, Adam.
    for (key, label, cnn, n_actions) in dqn_cnn_cases() {
        let b = DQN_BATCH;
        let d = cnn.input_len();
        let qspec = relay_nn::QNetSpec {
            hidden: vec![],
            cnn: Some(cnn),
            ..relay_nn::QNetSpec::new(d, n_actions)
        };
        let online = relay_nn::QNetwork::new(&qspec, 0)?;
        let target = online.duplicate()?;
        let mut opt = Adam::new(online.vars(), AdamConfig::default())?;
        let mut pixels = || -> Vec<f32> {
            (0..b * d)
                .map(|_| rng.random_range(0..=255u8) as f32)
                .collect()
        };
        let (obs, next_obs) = (pixels(), pixels());
        let actions: Vec<u32> = (0..b)
            .map(|_| rng.random_range(0..n_actions as u32))
            .collect();
        let returns: Vec<f32> = (0..b).map(|_| rng.random_range(-1.0..1.0)).collect();
        let discounts: Vec<f32> = vec![0.99; b];
        let cfg = relay_nn::DqnLossConfig::default();
        bench(
            format!("{key}_train_step_b{b}_us"),
            format!("{label} train step batch {b}"),
            &mut || {
                let out = relay_nn::dqn_loss(
                    &cfg,
                    &online,
                    &target,
                    &relay_nn::DqnBatch {
                        obs: &obs,
                        actions: &actions,
                        returns: &returns,
                        next_obs: &next_obs,
                        discounts: &discounts,
                        weights: None,
                        next_masks: None,
                    },
                )
                .unwrap();
                let mut grads = out.loss.backward().unwrap();
                black_box(clip_grad_norm(&mut grads, opt.vars(), 10.0).unwrap());
                opt.step(&grads).unwrap();
            },
        );
    }

    // Added to the table after the last `bench` (which holds `rows` and `json`).
    let mut torch_rows_out: Vec<(String, (f64, f64))> = Vec::new();
    let mut torch_json: Vec<(String, f64)> = Vec::new();
    let wanted = torch_rows()
        .into_iter()
        .filter(|(_, k, _)| want(k) || want(&format!("torch_{k}")))
        .collect::<Vec<_>>();
    let mut cases: Vec<&str> = wanted.iter().map(|(case, ..)| *case).collect();
    cases.dedup();
    if !cases.is_empty() {
        match torch_times(budget, &cases) {
            Ok(times) => {
                let version = times.get("torch").and_then(|v| v.as_str()).unwrap_or("?");
                for (_, key, label) in wanted {
                    let k = format!("torch_{key}");
                    if let Some(us) = times.get(&k).and_then(|v| v.as_f64()) {
                        torch_rows_out.push((format!("PyTorch {version} {label}"), (us, us)));
                        torch_json.push((k, us));
                    }
                }
            }
            Err(why) => println!("PyTorch comparison: not measured: {why}"),
        }
    }

    let n_params = model.num_parameters();
    let mut opt = Adam::new(model.vars(), AdamConfig::default())?;
    let x = Tensor::zeros((64, 4), DType::F32, &Device::Cpu)?;
    let a = Tensor::zeros(64, DType::U32, &Device::Cpu)?;
    let (lp, _, v) = model.evaluate(&x, &a)?;
    let grads = (lp.sum_all()? + v.sum_all()?)?.backward()?;
    bench(
        "adam_step_us".into(),
        format!("Adam step alone ({n_params} parameters)"),
        &mut || opt.step(&grads).unwrap(),
    );

    rows.extend(torch_rows_out);
    json.extend(torch_json);
    println!("{:<72} {:>10} {:>10}", "case", "median µs", "min µs");
    for (label, (median, min)) in &rows {
        println!("{label:<72} {median:>10.2} {min:>10.2}");
    }
    let body: Vec<String> = json
        .iter()
        .map(|(k, v)| format!("\"{k}\":{v:.3}"))
        .collect();
    println!("{{\"threads\":\"{threads}\",{}}}", body.join(","));
    Ok(())
}
