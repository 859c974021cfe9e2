//! The tests of RunningMeanStd and VecNormalize: updates and merges
//! against hand-computed moments, observation and reward normalisation
//! (clipping, episode ends, NaN refused), replicas' deltas, and the
//! tensor, serde and file round trips. In their own file so that the
//! normaliser reads without them.

use super::*;

fn close(a: f64, b: f64, tol: f64) {
    assert!((a - b).abs() <= tol * (1.0 + b.abs()), "{a} vs {b}");
}

#[test]
fn update_matches_hand_computation() {
    // Fresh stats (mean 0, var 1, count 1e-4) updated with rows
    // [1, 2], [3, 6]: batch mean [2, 4], var [1, 4], count 2.
    let mut rms = RunningMeanStd::new(2);
    rms.update(&[1.0, 2.0, 3.0, 6.0]).unwrap();
    let (c0, n) = (1e-4, 2.0);
    let tot = c0 + n;
    for (i, (bm, bv)) in [(2.0, 1.0), (4.0, 4.0)].into_iter().enumerate() {
        let mean = bm * n / tot;
        let var = (c0 + bv * n + bm * bm * c0 * n / tot) / tot;
        close(rms.mean[i], mean, 1e-15);
        close(rms.var[i], var, 1e-15);
    }
    close(rms.count, tot, 1e-15);
    // Empty batch: unchanged. Wrong width: refused.
    let before = rms.clone();
    rms.update(&[]).unwrap();
    assert_eq!(rms, before);
    assert!(rms.update(&[1.0, 2.0, 3.0]).is_err());
}

#[test]
fn merging_halves_equals_the_whole() {
    let data: Vec<f32> = (0..60)
        .map(|i| ((i * 37 % 23) as f32 - 7.5) * 0.3)
        .collect();
    let whole = RunningMeanStd::from_batch(&data, 3).unwrap();
    let mut a = RunningMeanStd::from_batch(&data[..27], 3).unwrap();
    let b = RunningMeanStd::from_batch(&data[27..], 3).unwrap();
    a.combine(&b).unwrap();
    for i in 0..3 {
        close(a.mean[i], whole.mean[i], 1e-12);
        close(a.var[i], whole.var[i], 1e-12);
    }
    assert_eq!(a.count, whole.count);
    // The empty statistics are neutral on either side.
    let mut e = RunningMeanStd::empty(3);
    e.combine(&whole).unwrap();
    assert_eq!(e, whole);
    let mut w = whole.clone();
    w.combine(&RunningMeanStd::empty(3)).unwrap();
    assert_eq!(w, whole);
    // Streaming update equals merging from a fresh start.
    let mut s = RunningMeanStd::new(3);
    s.update(&data[..27]).unwrap();
    s.update(&data[27..]).unwrap();
    let mut t = RunningMeanStd::new(3);
    t.update(&data).unwrap();
    for i in 0..3 {
        close(s.mean[i], t.mean[i], 1e-12);
        close(s.var[i], t.var[i], 1e-12);
    }
}

#[test]
fn observations_normalised_and_clipped() {
    let cfg = NormalizeConfig {
        clip_obs: 1.5,
        ..Default::default()
    };
    let mut vn = VecNormalize::new(cfg, 2, 2).unwrap();
    let mut obs = [0.0f32, 10.0, 2.0, 30.0];
    vn.reset(&mut obs).unwrap();
    // Stats now ~ mean [1, 20], var [1, 100] (plus the 1e-4 prior).
    let (m, v) = (vn.obs_rms.mean.clone(), vn.obs_rms.var.clone());
    let expect = |x: f64, i: usize| ((x - m[i]) / (v[i] + 1e-8).sqrt()).clamp(-1.5, 1.5);
    close(obs[0] as f64, expect(0.0, 0), 1e-6);
    close(obs[1] as f64, expect(10.0, 1), 1e-6);
    close(obs[2] as f64, 1.0, 1e-3);
    close(obs[3] as f64, 1.0, 1e-3);
    // Far outside: clipped.
    let mut far = [100.0f32, -100.0];
    vn.normalize_obs(&mut far);
    assert_eq!(far, [1.5, -1.5]);
    // Round trip through unnormalize (inside the clip).
    let mut x = [1.5f32, 21.0];
    let orig = x;
    vn.normalize_obs(&mut x);
    vn.unnormalize_obs(&mut x);
    close(x[0] as f64, orig[0] as f64, 1e-5);
    close(x[1] as f64, orig[1] as f64, 1e-5);
    // Frozen: no update.
    vn.set_training(false);
    let before = vn.clone();
    let mut obs = [5.0f32, 5.0, 6.0, 6.0];
    vn.step(&mut obs, &mut [1.0, 1.0], &[false, false]).unwrap();
    assert_eq!(vn.obs_rms, before.obs_rms);
    assert_eq!(vn.ret_rms, before.ret_rms);
    assert_eq!(vn.returns, before.returns);
}

#[test]
fn rewards_scaled_by_discounted_return_std() {
    let cfg = NormalizeConfig {
        norm_obs: false,
        gamma: 0.5,
        ..Default::default()
    };
    let mut vn = VecNormalize::new(cfg, 1, 2).unwrap();
    let mut obs = [0.0f32, 0.0];
    vn.reset(&mut obs).unwrap();
    // Step 1: returns [1, 3]; env 1 done.
    let mut r = [1.0f32, 3.0];
    vn.step(&mut obs, &mut r, &[false, true]).unwrap();
    let mut rms = RunningMeanStd::new(1);
    rms.update_from_moments(&[2.0], &[1.0], 2.0).unwrap();
    close(vn.ret_rms.var[0], rms.var[0], 1e-15);
    let s1 = (rms.var[0] + 1e-8).sqrt();
    close(r[0] as f64, 1.0 / s1, 1e-6);
    close(r[1] as f64, 3.0 / s1, 1e-6);
    assert_eq!(vn.returns, vec![1.0, 0.0]);
    // Step 2: returns [0.5 * 1 + 2, 0 + 4] = [2.5, 4].
    let mut r = [2.0f32, 4.0];
    vn.step(&mut obs, &mut r, &[false, false]).unwrap();
    rms.update_from_moments(&[3.25], &[0.5625], 2.0).unwrap();
    close(vn.ret_rms.mean[0], rms.mean[0], 1e-15);
    close(vn.ret_rms.var[0], rms.var[0], 1e-15);
    let s2 = (rms.var[0] + 1e-8).sqrt();
    close(r[0] as f64, 2.0 / s2, 1e-6);
    assert_eq!(vn.returns, vec![2.5, 4.0]);
    // Observations untouched with norm_obs off.
    assert_eq!(obs, [0.0, 0.0]);
    // Scale only, clipped.
    let mut big = [1e6f32, -1e6];
    vn.normalize_rewards(&mut big);
    assert_eq!(big, [10.0, -10.0]);
}

#[test]
fn nan_observations_and_rewards_are_refused_and_change_nothing() {
    let mut vn = VecNormalize::new(NormalizeConfig::default(), 2, 2).unwrap();
    vn.track_delta();
    let mut obs = [0.5f32, 1.0, -0.5, 2.0];
    vn.reset(&mut obs).unwrap();
    let before = vn.clone();
    let mut bad = [0.5f32, f32::NAN, -0.5, 2.0];
    let err = vn
        .step(&mut bad, &mut [1.0, 1.0], &[false, false])
        .unwrap_err();
    let text = err.to_string();
    assert!(
        text.contains("`obs`") && text.contains("finite") && text.contains("NaN"),
        "{text}"
    );
    assert!(text.contains("index 1 (row 0, component 1)"), "{text}");
    assert_eq!(vn, before);
    let mut ok = [0.5f32, 1.0, -0.5, 2.0];
    let err = vn
        .step(&mut ok, &mut [f32::INFINITY, 1.0], &[false, false])
        .unwrap_err();
    assert!(err.to_string().contains("rewards"), "{err}");
    assert_eq!(vn, before);
    // Frozen copies refuse them too (the evaluator never feeds NaN to a model).
    vn.set_training(false);
    assert!(vn.observe(&mut [f32::NAN, 0.0]).is_err());
    // A NaN in shipped statistics is refused by merge and sync.
    let mut delta = NormDelta::empty(2);
    delta.obs_rms.mean[0] = f64::NAN;
    assert!(vn.merge(&delta).is_err());
    assert!(vn.sync(&delta.obs_rms, &RunningMeanStd::new(1)).is_err());
    assert_eq!(vn.obs_rms, before.obs_rms);
}

/// Three envs, gamma 0.9, no observation normalisation. Env 0 is
/// truncated (time limit) at step 2, env 1 terminated at step 1, env 2
/// runs on: both kinds of end reset the running return, as SB3 resets
/// on `done = terminated or truncated`.
#[test]
fn rewards_hand_computed_through_terminated_and_truncated_ends() {
    let cfg = NormalizeConfig {
        norm_obs: false,
        gamma: 0.9,
        clip_reward: 5.0,
        ..Default::default()
    };
    let mut vn = VecNormalize::new(cfg, 1, 3).unwrap();
    vn.reset(&mut [0.0f32; 3]).unwrap();
    let rewards = [[1.0f32, 2.0, 0.5], [1.0, -1.0, 0.5], [2.0, 3.0, 0.5]];
    let terminated = [[false, true, false], [false, false, false], [false; 3]];
    let truncated = [[false, false, false], [true, false, false], [false; 3]];
    // Returns before each step's reset, by hand:
    // step 0: [1, 2, 0.5]             -> env 1 terminated: [1, 0, 0.5]
    // step 1: [0.9+1, 0-1, 0.45+0.5]  = [1.9, -1, 0.95] -> env 0 truncated: [0, -1, 0.95]
    // step 2: [0+2, -0.9+3, 0.855+0.5] = [2, 2.1, 1.355]
    let seen = [[1.0, 2.0, 0.5], [1.9, -1.0, 0.95], [2.0, 2.1, 1.355]];
    let after = [[1.0, 0.0, 0.5], [0.0, -1.0, 0.95], [2.0, 2.1, 1.355]];
    // Population moments of each row, merged from the prior (0, 1, 1e-4).
    let (mut m, mut v, mut c) = (0.0f64, 1.0f64, 1e-4f64);
    let mut first = [0f32; 3];
    for step in 0..3 {
        let row = seen[step];
        let bm = row.iter().sum::<f64>() / 3.0;
        let bv = row.iter().map(|x| (x - bm).powi(2)).sum::<f64>() / 3.0;
        let tot = c + 3.0;
        let d = bm - m;
        v = (v * c + bv * 3.0 + d * d * c * 3.0 / tot) / tot;
        m += d * 3.0 / tot;
        c = tot;

        let dones: Vec<bool> = (0..3)
            .map(|i| terminated[step][i] || truncated[step][i])
            .collect();
        let mut r = rewards[step];
        vn.step(&mut [0.0f32; 3], &mut r, &dones).unwrap();
        if step == 0 {
            first = r;
        }
        for (i, &x) in vn.returns.iter().enumerate() {
            close(x, after[step][i], 1e-12);
        }
        close(vn.ret_rms.mean[0], m, 1e-12);
        close(vn.ret_rms.var[0], v, 1e-12);
        close(vn.ret_rms.count, c, 1e-12);
        let s = (v + 1e-8).sqrt();
        for i in 0..3 {
            let want = (rewards[step][i] as f64 / s).clamp(-5.0, 5.0);
            close(r[i] as f64, want, 1e-6);
        }
    }
    // Step 0 in numbers: the variance of [1, 2, 0.5] (0.3889) over the
    // prior of count 1e-4 gives std 0.6237, so env 1's 2.0 became 3.207.
    assert!((first[1] - 3.207).abs() < 1e-3, "{first:?}");
}

/// Two env-runner copies start from the same global statistics, each
/// gathers a delta, the learner merges both: the result equals one copy
/// having seen all the data.
#[test]
fn deltas_of_two_copies_merge_into_the_statistics_of_all_data() {
    let cfg = NormalizeConfig::default();
    let rows = |k: usize| -> Vec<f32> {
        (0..8)
            .map(|i| ((i * 7 + k * 13) % 11) as f32 * 0.4 - 1.5 + k as f32)
            .collect()
    };
    let mut global = VecNormalize::new(cfg, 2, 0).unwrap();
    let mut one = VecNormalize::new(cfg, 2, 4).unwrap();
    let (mut a, mut b) = (one.clone(), one.clone());
    a.track_delta();
    b.track_delta();
    for k in 0..3 {
        let (mut oa, mut ob) = (rows(k), rows(k + 5));
        let (mut ra, mut rb) = ([1.0f32, 0.5, -1.0, 2.0], [0.0f32, 1.5, 1.0, -0.5]);
        a.step(&mut oa, &mut ra, &[false, k == 1, false, false])
            .unwrap();
        b.step(&mut ob, &mut rb, &[false; 4]).unwrap();
        let mut all = rows(k);
        all.extend(rows(k + 5));
        one.obs_rms.update(&all).unwrap();
    }
    let (da, db) = (a.take_delta().unwrap(), b.take_delta().unwrap());
    assert_eq!(da.obs_rms.count, 12.0);
    assert_eq!(a.take_delta().unwrap(), NormDelta::empty(2));
    global.merge(&da).unwrap();
    global.merge(&db).unwrap();
    close(global.obs_rms.count, one.obs_rms.count, 1e-12);
    for i in 0..2 {
        close(global.obs_rms.mean[i], one.obs_rms.mean[i], 1e-12);
        close(global.obs_rms.var[i], one.obs_rms.var[i], 1e-12);
    }
    close(global.ret_rms.count, 1e-4 + 24.0, 1e-12);
    // A copy syncing to the new global keeps what it saw since.
    let mut o = rows(9);
    a.step(&mut o, &mut [0.0; 4], &[false; 4]).unwrap();
    let pending = a.delta.clone().unwrap();
    a.sync(&global.obs_rms, &global.ret_rms).unwrap();
    let mut want = global.obs_rms.clone();
    want.combine(&pending.obs_rms).unwrap();
    assert_eq!(a.obs_rms, want);
    // Width mismatch: refused.
    assert!(global.merge(&NormDelta::empty(3)).is_err());
}

#[test]
fn named_tensors_serde_and_file_round_trip() {
    let mut vn = VecNormalize::new(NormalizeConfig::default(), 3, 2).unwrap();
    let mut obs = [1.0f32, 2.0, 3.0, -1.0, 0.5, 4.0];
    vn.reset(&mut obs).unwrap();
    let mut obs = [0.0f32, 1.0, 2.0, 3.0, 4.0, 5.0];
    vn.step(&mut obs, &mut [1.0, -0.5], &[false, false])
        .unwrap();
    // serde_json without `float_roundtrip` may be off by one ulp.
    let json = serde_json::to_string(&vn).unwrap();
    let back: VecNormalize = serde_json::from_str(&json).unwrap();
    assert_eq!(back.returns, vn.returns);
    assert_eq!(back.config, vn.config);
    for (a, b) in [(&back.obs_rms, &vn.obs_rms), (&back.ret_rms, &vn.ret_rms)] {
        close(a.count, b.count, 1e-15);
        for i in 0..a.dim() {
            close(a.mean[i], b.mean[i], 1e-15);
            close(a.var[i], b.var[i], 1e-15);
        }
    }

    let tensors = vn.named_tensors("vec_normalize.");
    assert_eq!(tensors.len(), 6);
    assert!(tensors
        .iter()
        .all(|(n, _, _)| n.starts_with("vec_normalize.")));
    let mut other = VecNormalize::new(NormalizeConfig::default(), 3, 2).unwrap();
    let mut with_model = tensors.clone();
    with_model.push(("action_net.bias".into(), vec![2], vec![0.0, 0.0]));
    other
        .load_named_tensors(&with_model, "vec_normalize.")
        .unwrap();
    for i in 0..3 {
        close(other.obs_rms.mean[i], vn.obs_rms.mean[i], 1e-7);
        close(other.obs_rms.var[i], vn.obs_rms.var[i], 1e-7);
    }
    close(other.ret_rms.var[0], vn.ret_rms.var[0], 1e-7);
    // Wrong shape or missing: refused, unchanged.
    let before = other.clone();
    let mut bad = tensors.clone();
    bad[1].1 = vec![2];
    bad[1].2.pop();
    assert!(other.load_named_tensors(&bad, "vec_normalize.").is_err());
    assert!(other
        .load_named_tensors(&tensors[1..], "vec_normalize.")
        .is_err());
    let mut neg = tensors.clone();
    neg[2].2[0] = -1.0;
    assert!(other.load_named_tensors(&neg, "vec_normalize.").is_err());
    assert_eq!(other, before);

    let path = std::env::temp_dir().join(format!(
        "relay-nn-vecnorm-{}.safetensors",
        std::process::id()
    ));
    vn.save(&path).unwrap();
    let mut loaded = VecNormalize::new(NormalizeConfig::default(), 3, 2).unwrap();
    loaded.load(&path).unwrap();
    assert_eq!(loaded.obs_rms.count, vn.obs_rms.count);
    assert_eq!(loaded.ret_rms.count, vn.ret_rms.count);
    // Exact: every statistic comes back to the bit.
    assert_eq!(loaded.obs_rms, vn.obs_rms);
    assert_eq!(loaded.ret_rms, vn.ret_rms);
    std::fs::remove_file(&path).unwrap();
}
