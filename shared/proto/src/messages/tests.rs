//! Tests of the messages' wire form and checks.

use serde::{Deserialize, Serialize};

use super::*;
use crate::{decode, encode, WeightsBlob, SCHEMA_VERSION};

#[test]
fn metric_labels_are_optional_on_the_wire_and_checked() {
    // A value without labels encodes as before (no `labels` key), and
    // an older writer's value (no `labels` key) decodes with none.
    #[derive(Serialize)]
    struct OldValue {
        name: String,
        kind: MetricKind,
        value: f64,
    }
    #[derive(Serialize)]
    struct OldReport {
        schema: u16,
        service: String,
        instance: String,
        vec_steps: Option<u64>,
        values: Vec<OldValue>,
    }
    let old = rmp_serde::to_vec_named(&OldReport {
        schema: SCHEMA_VERSION,
        service: "env-runner".into(),
        instance: "e1".into(),
        vec_steps: None,
        values: vec![OldValue {
            name: "games_total".into(),
            kind: MetricKind::Counter,
            value: 2.0,
        }],
    })
    .unwrap();
    let report: MetricsReport = decode(&old).unwrap();
    assert!(report.values[0].labels.is_empty());
    assert_eq!(encode(&report), old);
    assert_eq!(report.values[0].key(), "games_total");

    let mut labelled = report.clone();
    labelled.values[0] = labelled.values[0]
        .clone()
        .with_label("game", "KuhnPoker-v0");
    let back: MetricsReport = decode(&encode(&labelled)).unwrap();
    assert_eq!(back, labelled);
    assert_eq!(back.values[0].key(), "games_total{game=KuhnPoker-v0}");

    for (key, value, needle) in [
        ("opponent", "random", "unknown label \"opponent\""),
        ("game", "", "bad game label"),
        ("game", "Tic Tac", "bad game label"),
    ] {
        let mut bad = report.clone();
        bad.values[0].labels.insert(key.into(), value.into());
        let err = decode::<MetricsReport>(&encode(&bad)).unwrap_err();
        assert!(err.to_string().contains(needle), "{err}");
        assert_eq!(err.reason(), "invalid");
    }
}

pub(crate) fn fragment(t: usize, n: usize, d: usize) -> RolloutFragment {
    let mut truncated = vec![false; t * n];
    truncated[n] = true;
    RolloutFragment {
        schema: SCHEMA_VERSION,
        runner_id: "r0".into(),
        env_id: "CartPole-v1".into(),
        policy_version: 3,
        num_steps: t as u32,
        num_envs: n as u32,
        obs: Tensor::from_f32(&[t, n, d], &vec![0.5; t * n * d]),
        actions: Tensor::from_i64(&[t, n], &vec![1; t * n]),
        logprobs: Tensor::from_f32(&[t, n], &vec![-0.7; t * n]),
        values: Tensor::from_f32(&[t, n], &vec![0.0; t * n]),
        rewards: Tensor::from_f32(&[t, n], &vec![1.0; t * n]),
        terminated: Tensor::from_bool(&[t, n], &vec![false; t * n]),
        truncated: Tensor::from_bool(&[t, n], &truncated),
        next_obs: Tensor::from_f32(&[n, d], &vec![0.1; n * d]),
        final_obs: Tensor::from_f32(&[1, d], &vec![0.2; d]),
        norm_rewards: None,
        norm_delta: None,
        masks: None,
        frames: None,
        initial_state: None,
    }
}

fn stats(d: usize) -> NormStats {
    NormStats {
        obs: Moments {
            count: 12.0,
            mean: vec![0.25; d],
            var: vec![2.0; d],
        },
        ret: Moments {
            count: 12.0,
            mean: vec![1.5],
            var: vec![0.5],
        },
    }
}

/// The normalisation fields are additive (schema version unchanged): a
/// fragment without them is what older env-runners send and decodes to
/// `None`; a reader that predates them ignores them.
#[test]
fn normalisation_fields_round_trip_and_stay_optional() {
    let plain = fragment(4, 2, 3);
    let bytes = encode(&plain);
    assert!(!bytes.windows(10).any(|w| w == b"norm_delta"));
    let back: RolloutFragment = decode(&bytes).unwrap();
    assert_eq!(back.norm_delta, None);
    let mut f = fragment(4, 2, 3);
    f.norm_rewards = Some(Tensor::from_f32(&[4, 2], &[0.5; 8]));
    f.norm_delta = Some(stats(3));
    let back: RolloutFragment = decode(&encode(&f)).unwrap();
    assert_eq!(back, f);
    #[derive(Deserialize)]
    struct OlderReader {
        schema: u16,
        rewards: Tensor,
    }
    let old: OlderReader = rmp_serde::from_slice(&encode(&f)).unwrap();
    assert_eq!(
        (old.schema, old.rewards),
        (SCHEMA_VERSION, f.rewards.clone())
    );

    let weights = WeightsUpdate {
        schema: SCHEMA_VERSION,
        version: 2,
        learner_env_steps: 10,
        weights: WeightsBlob::inline(vec![1, 2, 3]),
        normalizer: Some(stats(4)),
        published_unix_ms: 0,
    };
    assert_eq!(decode::<WeightsUpdate>(&encode(&weights)).unwrap(), weights);
}

#[test]
fn bad_normalisation_fields_are_rejected_by_name() {
    let mut f = fragment(4, 2, 3);
    f.norm_delta = Some(stats(2));
    let err = decode::<RolloutFragment>(&encode(&f)).unwrap_err();
    assert_eq!(err.reason(), "invalid");
    assert!(
        err.to_string().contains("norm_delta") && err.to_string().contains("components"),
        "{err}"
    );
    let mut bad = stats(3);
    bad.obs.mean[1] = f64::NAN;
    f.norm_delta = Some(bad);
    let err = decode::<RolloutFragment>(&encode(&f)).unwrap_err();
    assert!(err.to_string().contains("finite"), "{err}");
    f.norm_delta = None;
    f.norm_rewards = Some(Tensor::from_f32(
        &[4, 2],
        &[0.5, f32::NAN, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0],
    ));
    let err = decode::<RolloutFragment>(&encode(&f)).unwrap_err();
    assert_eq!(err.reason(), "non_finite");
    assert!(err.to_string().contains("norm_rewards"), "{err}");
    f.norm_rewards = Some(Tensor::from_f32(&[2, 2], &[0.5; 4]));
    let err = decode::<RolloutFragment>(&encode(&f)).unwrap_err();
    assert_eq!(err.reason(), "shape");
    let mut bad = stats(3);
    bad.ret.var[0] = -1.0;
    let weights = WeightsUpdate {
        schema: SCHEMA_VERSION,
        version: 2,
        learner_env_steps: 10,
        weights: WeightsBlob::inline(vec![1, 2, 3]),
        normalizer: Some(bad),
        published_unix_ms: 0,
    };
    let err = decode::<WeightsUpdate>(&encode(&weights)).unwrap_err();
    assert!(
        err.to_string().contains("WeightsUpdate.normalizer"),
        "{err}"
    );
}

/// Masks are additive like the normalisation fields; a mask must be
/// 0/1 bytes of one width everywhere, allow an action in every row,
/// and allow the action taken.
#[test]
fn action_masks_round_trip_and_bad_ones_are_named() {
    let plain = fragment(2, 2, 3);
    assert!(!encode(&plain).windows(5).any(|w| w == b"masks"));
    let mut f = plain.clone();
    // 3 actions; every fragment action is 1.
    f.masks = Some(FragmentMasks {
        obs: Tensor::from_u8(&[2, 2, 3], &[0, 1, 0, 1, 1, 1, 0, 1, 1, 0, 1, 0]),
        next_obs: Tensor::from_u8(&[2, 3], &[1, 0, 0, 0, 0, 1]),
        final_obs: Tensor::from_u8(&[1, 3], &[1, 1, 0]),
    });
    let back: RolloutFragment = decode(&encode(&f)).unwrap();
    assert_eq!(back, f);
    let reject = |edit: &dyn Fn(&mut FragmentMasks)| {
        let mut bad = f.clone();
        edit(bad.masks.as_mut().unwrap());
        decode::<RolloutFragment>(&encode(&bad))
            .unwrap_err()
            .to_string()
    };
    let e = reject(&|m| m.obs.data[3..6].copy_from_slice(&[0, 0, 0]));
    assert!(
        e.contains("masks.obs") && e.contains("row 1 allows no action"),
        "{e}"
    );
    let e = reject(&|m| m.obs.data[0..2].copy_from_slice(&[1, 0]));
    assert!(
        e.contains("action 1 at step 0 of env 0 is not legal under its mask"),
        "{e}"
    );
    let e = reject(&|m| m.next_obs = Tensor::from_u8(&[2, 2], &[1; 4]));
    assert!(e.contains("masks.next_obs"), "{e}");
    let e = reject(&|m| m.final_obs.data[2] = 2);
    assert!(
        e.contains("masks.final_obs") && e.contains("not 0 or 1"),
        "{e}"
    );

    let obs = Tensor::from_f32(&[2, 2], &[0.0; 4]);
    let good = ActRequest::new(obs.clone(), false)
        .with_masks(Some(Tensor::from_u8(&[2, 3], &[1, 0, 0, 0, 1, 1])));
    assert_eq!(decode::<ActRequest>(&encode(&good)).unwrap(), good);
    let empty = ActRequest::new(obs.clone(), false)
        .with_masks(Some(Tensor::from_u8(&[2, 3], &[1, 0, 0, 0, 0, 0])));
    let e = decode::<ActRequest>(&encode(&empty))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("ActRequest.masks") && e.contains("row 1 allows no action"),
        "{e}"
    );
    let short =
        ActRequest::new(obs.clone(), false).with_masks(Some(Tensor::from_u8(&[1, 3], &[1; 3])));
    assert!(decode::<ActRequest>(&encode(&short)).is_err());

    // gSDE seeds: one a row, and divided with the rows.
    let seeded = ActRequest::new(obs.clone(), false).with_noise_seeds(Some(vec![7, u64::MAX]));
    assert_eq!(decode::<ActRequest>(&encode(&seeded)).unwrap(), seeded);
    let parts = crate::fit::Divisible::divide(seeded, 2).unwrap();
    assert_eq!(parts[0].noise_seeds, Some(vec![7]));
    assert_eq!(parts[1].noise_seeds, Some(vec![u64::MAX]));
    let one_seed = ActRequest::new(obs, false).with_noise_seeds(Some(vec![7]));
    let e = decode::<ActRequest>(&encode(&one_seed))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("noise_seeds") && e.contains("1 seeds for 2 rows"),
        "{e}"
    );
}

#[test]
fn fragment_round_trips() {
    let f = fragment(4, 2, 3);
    let back: RolloutFragment = decode(&encode(&f)).unwrap();
    assert_eq!(back, f);
}

#[test]
fn rejects_wrong_schema_version() {
    let mut f = fragment(2, 2, 3);
    f.schema = SCHEMA_VERSION + 1;
    let err = decode::<RolloutFragment>(&encode(&f)).unwrap_err();
    assert_eq!(err.reason(), "schema_version");
}

#[test]
fn rejects_garbage_and_oversized_payloads() {
    assert_eq!(
        decode::<ActRequest>(b"\x01\x02garbage")
            .unwrap_err()
            .reason(),
        "decode"
    );
    let big = vec![0u8; crate::MAX_MESSAGE_BYTES + 1];
    assert_eq!(
        decode::<ActRequest>(&big).unwrap_err().reason(),
        "oversized"
    );
}

#[test]
fn rejects_bad_shapes_and_nan() {
    let mut f = fragment(2, 2, 3);
    f.rewards = Tensor::from_f32(&[2, 2], &[1.0, f32::NAN, 1.0, 1.0]);
    assert_eq!(
        decode::<RolloutFragment>(&encode(&f)).unwrap_err().reason(),
        "non_finite"
    );
    let mut f = fragment(2, 2, 3);
    f.final_obs = Tensor::from_f32(&[0, 3], &[]);
    assert_eq!(
        decode::<RolloutFragment>(&encode(&f)).unwrap_err().reason(),
        "shape"
    );
    let req = ActRequest::new(Tensor::from_f32(&[1, 2], &[f32::INFINITY, 0.0]), false);
    assert_eq!(
        decode::<ActRequest>(&encode(&req)).unwrap_err().reason(),
        "non_finite"
    );
}

#[test]
fn image_observations_travel_as_bytes() {
    let (t, n, d) = (2, 2, 6);
    let pixels: Vec<f32> = (0..t * n * d).map(|i| (i * 20 % 256) as f32).collect();
    let mut f = fragment(t, n, d);
    f.truncated = Tensor::from_bool(&[t, n], &[false; 4]);
    f.obs = Tensor::observations(&[t, n, d], &pixels, true);
    f.next_obs = Tensor::observations(&[n, d], &pixels[..n * d], true);
    f.final_obs = Tensor::observations(&[0, d], &[], true);
    let back = decode::<RolloutFragment>(&encode(&f)).unwrap();
    assert_eq!(back.obs.dtype, DType::U8);
    assert_eq!(back.obs.data.len(), t * n * d, "one byte per value");
    assert_eq!(back.obs.observations_to_f32().unwrap(), pixels);
    // Bootstrap observations of another dtype than `obs` are refused.
    f.next_obs = Tensor::from_f32(&[n, d], &pixels[..n * d]);
    let err = decode::<RolloutFragment>(&encode(&f)).unwrap_err();
    assert!(err.to_string().contains("next_obs"), "{err}");
    let req = ActRequest::new(Tensor::observations(&[1, 2], &[0.0, 255.0], true), false);
    assert_eq!(decode::<ActRequest>(&encode(&req)).unwrap(), req);
    let req = ActRequest::new(Tensor::from_i64(&[1, 2], &[0, 1]), false);
    let err = decode::<ActRequest>(&encode(&req)).unwrap_err().to_string();
    assert!(err.contains("obs") && err.contains("I64"), "{err}");
}

#[test]
fn scale_request_is_validated() {
    let req = |service: &str, copies| ScaleRequest {
        schema: SCHEMA_VERSION,
        service: service.into(),
        copies,
    };
    let ok = req("env-runner", 3);
    assert_eq!(decode::<ScaleRequest>(&encode(&ok)).unwrap(), ok);
    assert!(decode::<ScaleRequest>(&encode(&req("env-runner", 0))).is_ok());
    for bad in [
        req("", 1),
        req("env.runner", 1),
        req("env-runner", MAX_COPIES + 1),
    ] {
        assert_eq!(
            decode::<ScaleRequest>(&encode(&bad)).unwrap_err().reason(),
            "invalid"
        );
    }
}

proptest::proptest! {
    #[test]
    fn decoding_arbitrary_bytes_never_panics(bytes in proptest::collection::vec(proptest::num::u8::ANY, 0..512)) {
        let _ = decode::<RolloutFragment>(&bytes);
        let _ = decode::<ActRequest>(&bytes);
        let _ = decode::<WeightsUpdate>(&bytes);
        let _ = decode::<MetricsReport>(&bytes);
    }
}
