//! Messages of any size: each kind that may outgrow a NATS message goes
//! whole at and just under the limit, is divided just over it into parts
//! that each fit and validate, and the parts hold exactly what the whole
//! held.

use relay_proto::{
    decode, encode, encode_within, ActReply, ActRequest, Divisible, EpisodeReport, EpisodeSummary,
    FragmentMasks, GameRecord, Joinable, Moments, NormStats, ObsField, RolloutFragment, Tensor,
    TransitionBatch, TransitionSampleRequest, WireMessage, ENVELOPE_BYTES, SCHEMA_VERSION,
};

/// Encodes `message` at a limit exactly its size, one byte over and one
/// byte under: whole, whole, then divided. Returns the divided parts.
fn at_around_and_over<M: Divisible + Clone + std::fmt::Debug + PartialEq>(message: &M) -> Vec<M> {
    let bytes = encode(message).len();
    let fits = bytes + ENVELOPE_BYTES;
    for max_payload in [fits, fits + 1] {
        let parts = encode_within(message.clone(), max_payload).unwrap();
        assert_eq!(
            parts.len(),
            1,
            "{} of {bytes} bytes at {max_payload}",
            M::KIND
        );
        assert_eq!(&parts[0].message, message);
        assert_eq!(parts[0].bytes, encode(message));
    }
    let parts = encode_within(message.clone(), fits - 1).unwrap();
    assert!(
        parts.len() >= 2,
        "{} one byte over the limit went whole",
        M::KIND
    );
    for part in &parts {
        assert!(part.bytes.len() <= fits - 1 - ENVELOPE_BYTES);
        let decoded: M = decode(&part.bytes).expect("every part is a valid message");
        assert_eq!(decoded, part.message);
    }
    parts.into_iter().map(|p| p.message).collect()
}

/// The id of env `e`'s step `t`, written into every per-step field so that
/// a part's contents can be traced back.
fn id(t: usize, e: usize) -> f32 {
    (t * 100 + e) as f32
}

struct Shape {
    steps: usize,
    envs: usize,
    obs_dim: usize,
    masks: bool,
    state: bool,
    frames: bool,
}

/// A fragment whose observation of env `e` at step `t` is all `id(t, e)`
/// (mod 256 for frames), truncated (not terminated) wherever `(t + e) % 3
/// == 0`, terminated where `(t + e) % 5 == 0`.
fn fragment(s: &Shape) -> RolloutFragment {
    let (t, n, d) = (s.steps, s.envs, s.obs_dim);
    let ids: Vec<f32> = (0..t).flat_map(|t| (0..n).map(move |e| id(t, e))).collect();
    let truncated: Vec<bool> = (0..t * n).map(|i| (i / n + i % n) % 3 == 0).collect();
    let terminated: Vec<bool> = (0..t * n).map(|i| (i / n + i % n) % 5 == 0).collect();
    let bootstraps: Vec<usize> = (0..t * n)
        .filter(|&i| truncated[i] && !terminated[i])
        .collect();
    // The final observation of a truncated step is 0.5 more than its id.
    let final_ids: Vec<f32> = bootstraps.iter().map(|&i| ids[i] + 0.5).collect();
    let next_ids: Vec<f32> = (0..n).map(|e| id(t, e)).collect();
    let rows = |ids: &[f32]| -> Vec<f32> { ids.iter().flat_map(|&v| vec![v; d]).collect() };
    let (obs, next_obs, final_obs, frames) = if s.frames {
        // One plane per observation, d pixels each: plane k holds pixel
        // value k % 256 (ids of 0.5 more become a plane of their own).
        let mut planes: Vec<u8> = Vec::new();
        let mut index = |v: f32| {
            planes.extend(std::iter::repeat_n((v * 2.0) as u32 as u8, d));
            (planes.len() / d - 1) as u32
        };
        let obs: Vec<u32> = ids.iter().map(|&v| index(v)).collect();
        let next: Vec<u32> = next_ids.iter().map(|&v| index(v)).collect();
        let fin: Vec<u32> = final_ids.iter().map(|&v| index(v)).collect();
        let count = planes.len() / d;
        (
            Tensor::from_u32(&[t, n, 1], &obs),
            Tensor::from_u32(&[n, 1], &next),
            Tensor::from_u32(&[fin.len(), 1], &fin),
            Some(Tensor::from_u8(&[count, d], &planes)),
        )
    } else {
        (
            Tensor::from_f32(&[t, n, d], &rows(&ids)),
            Tensor::from_f32(&[n, d], &rows(&next_ids)),
            Tensor::from_f32(&[final_ids.len(), d], &rows(&final_ids)),
            None,
        )
    };
    let width = 3;
    // Action (id mod 3) is always legal, and so is action 0.
    let mask_of = |v: f32| -> Vec<u8> {
        let a = (v as usize) % width;
        (0..width).map(|k| u8::from(k == a || k == 0)).collect()
    };
    RolloutFragment {
        schema: SCHEMA_VERSION,
        runner_id: "runner".into(),
        env_id: "Test-v0".into(),
        policy_version: 7,
        num_steps: t as u32,
        num_envs: n as u32,
        obs,
        actions: Tensor::from_i64(
            &[t, n],
            &ids.iter()
                .map(|&v| (v as i64) % width as i64)
                .collect::<Vec<_>>(),
        ),
        logprobs: Tensor::from_f32(&[t, n], &ids),
        values: Tensor::from_f32(&[t, n], &ids),
        rewards: Tensor::from_f32(&[t, n], &ids),
        terminated: Tensor::from_bool(&[t, n], &terminated),
        truncated: Tensor::from_bool(&[t, n], &truncated),
        next_obs,
        final_obs,
        frames,
        norm_rewards: Some(Tensor::from_f32(&[t, n], &ids)),
        norm_delta: Some(NormStats {
            obs: Moments {
                count: 1.0,
                mean: vec![0.0; d],
                var: vec![1.0; d],
            },
            ret: Moments {
                count: 1.0,
                mean: vec![0.0],
                var: vec![1.0],
            },
        }),
        masks: s.masks.then(|| FragmentMasks {
            obs: Tensor::from_u8(
                &[t, n, width],
                &ids.iter().flat_map(|&v| mask_of(v)).collect::<Vec<_>>(),
            ),
            next_obs: Tensor::from_u8(
                &[n, width],
                &next_ids
                    .iter()
                    .flat_map(|&v| mask_of(v))
                    .collect::<Vec<_>>(),
            ),
            final_obs: Tensor::from_u8(
                &[final_ids.len(), width],
                &vec![1; final_ids.len() * width],
            ),
        }),
        initial_state: s.state.then(|| {
            Tensor::from_f32(
                &[n, 2],
                &(0..n)
                    .flat_map(|e| [e as f32, -(e as f32)])
                    .collect::<Vec<_>>(),
            )
        }),
    }
}

/// Checks that `parts` hold each step of `whole` exactly once, with its
/// own observation, next observation (the step after's, or the whole's
/// next), final observation and masks.
fn same_steps(whole: &RolloutFragment, parts: &[RolloutFragment]) {
    let (t, n) = (whole.num_steps as usize, whole.num_envs as usize);
    let mut seen = vec![0u32; t * n];
    for part in parts {
        assert_eq!(part.policy_version, whole.policy_version);
        let (pt, pn) = (part.num_steps as usize, part.num_envs as usize);
        let d = part.obs_dim();
        let rewards = part.rewards.to_f32().unwrap();
        let obs = part.observations(ObsField::Obs).unwrap();
        let next = part.observations(ObsField::Next).unwrap();
        let fin = part.observations(ObsField::Final).unwrap();
        let scale = |v: f32| {
            if whole.frames.is_some() {
                ((v * 2.0) as u32 as u8) as f32
            } else {
                v
            }
        };
        let (term, trunc) = (
            part.terminated.to_bool().unwrap(),
            part.truncated.to_bool().unwrap(),
        );
        let mut k = 0;
        for i in 0..pt * pn {
            let own = rewards[i];
            let (step, env) = (own as usize / 100, own as usize % 100);
            seen[step * n + env] += 1;
            assert_eq!(obs[i * d], scale(own));
            assert_eq!(
                part.norm_rewards.as_ref().unwrap().to_f32().unwrap()[i],
                own
            );
            if trunc[i] && !term[i] {
                assert_eq!(
                    fin[k * d],
                    scale(own + 0.5),
                    "final observation of step {step} of env {env}"
                );
                k += 1;
            }
            if i / pn == pt - 1 {
                assert_eq!(
                    next[(i % pn) * d],
                    scale(id(step + 1, env)),
                    "next observation after step {step} of env {env}"
                );
            }
        }
        assert_eq!(k, part.bootstrap_count());
        if let Some(masks) = &part.masks {
            let actions = part.actions.to_i64().unwrap();
            for (i, a) in actions.iter().enumerate() {
                assert_eq!(masks.obs.data[i * 3 + *a as usize], 1);
            }
        }
        if let Some(state) = &part.initial_state {
            let first_env = rewards[0] as usize % 100;
            assert_eq!(state.to_f32().unwrap()[0], first_env as f32);
        }
    }
    assert!(
        seen.iter().all(|&c| c == 1),
        "every step in exactly one part: {seen:?}"
    );
    assert_eq!(
        parts.iter().filter(|p| p.norm_delta.is_some()).count(),
        usize::from(whole.norm_delta.is_some()),
        "the statistics go once"
    );
}

#[test]
fn fragments_divide_by_envs_then_steps_and_keep_every_step_once() {
    for (name, shape) in [
        (
            "flat, masked",
            Shape {
                steps: 6,
                envs: 5,
                obs_dim: 400,
                masks: true,
                state: false,
                frames: false,
            },
        ),
        (
            "frames",
            Shape {
                steps: 6,
                envs: 5,
                obs_dim: 1024,
                masks: false,
                state: false,
                frames: true,
            },
        ),
        (
            "recurrent",
            Shape {
                steps: 6,
                envs: 5,
                obs_dim: 400,
                masks: false,
                state: true,
                frames: false,
            },
        ),
        (
            "one env",
            Shape {
                steps: 9,
                envs: 1,
                obs_dim: 400,
                masks: true,
                state: false,
                frames: false,
            },
        ),
    ] {
        let whole = fragment(&shape);
        whole.validate().unwrap_or_else(|e| panic!("{name}: {e}"));
        let parts = at_around_and_over(&whole);
        same_steps(&whole, &parts);
        // Far over: down to single env steps where it must (without the
        // statistics, which alone would not fit a third).
        let whole = RolloutFragment {
            norm_delta: None,
            ..whole
        };
        let third = encode(&whole).len() / 3 + ENVELOPE_BYTES;
        let parts: Vec<RolloutFragment> = encode_within(whole.clone(), third)
            .unwrap()
            .into_iter()
            .map(|p| p.message)
            .collect();
        assert!(parts.len() >= 3, "{name}");
        same_steps(&whole, &parts);
        if shape.state {
            assert!(
                parts.iter().all(|p| p.num_steps as usize == shape.steps),
                "{name}: whole sequences"
            );
        }
    }
}

#[test]
fn a_step_too_large_alone_is_named_with_the_size_it_needs() {
    // One env step of 100k values.
    let whole = fragment(&Shape {
        steps: 1,
        envs: 1,
        obs_dim: 100_000,
        masks: false,
        state: false,
        frames: false,
    });
    let err = encode_within(whole, 256 * 1024).unwrap_err();
    assert_eq!((err.kind, err.unit), ("RolloutFragment", "env step"));
    assert!(err.needed >= err.bytes + ENVELOPE_BYTES && err.needed.is_multiple_of(1 << 20));
    let advice = format!("raise the server's max_payload to at least {}", err.needed);
    assert!(err.to_string().contains(&advice), "{err}");
    // A recurrent policy's fragment of one env is not cut by steps.
    let recurrent = fragment(&Shape {
        steps: 4,
        envs: 1,
        obs_dim: 40_000,
        masks: false,
        state: true,
        frames: false,
    });
    assert!(encode_within(recurrent, 256 * 1024).is_err());
}

#[test]
fn act_requests_divide_by_rows_and_their_replies_join_in_order() {
    let n = 9;
    let request = ActRequest::new(
        Tensor::from_f32(&[n, 30], &(0..n * 30).map(|v| v as f32).collect::<Vec<_>>()),
        false,
    )
    .with_masks(Some(Tensor::from_u8(&[n, 2], &vec![1; n * 2])))
    .with_state(Some(Tensor::from_f32(&[n, 4], &vec![0.5; n * 4])))
    .at_version(Some(3));
    let parts = at_around_and_over(&request);
    let rows: Vec<f32> = parts.iter().flat_map(|p| p.obs.to_f32().unwrap()).collect();
    assert_eq!(rows, request.obs.to_f32().unwrap());
    assert!(parts
        .iter()
        .all(|p| p.policy_version == Some(3) && p.masks.is_some() && p.state.is_some()));
    // Each part answered by its own rows: joined, the replies are the whole's.
    let replies: Vec<ActReply> = parts
        .iter()
        .enumerate()
        .map(|(k, p)| {
            let m = p.obs.shape[0] as usize;
            let first = p.obs.to_f32().unwrap()[0] as i64 / 30;
            ActReply {
                schema: SCHEMA_VERSION,
                policy_version: 5 + k as u64,
                actions: Tensor::from_i64(&[m], &(first..first + m as i64).collect::<Vec<_>>()),
                logprobs: Tensor::from_f32(&[m], &vec![-1.0; m]),
                values: Tensor::from_f32(&[m], &vec![0.0; m]),
                state: Some(Tensor::from_f32(&[m, 4], &vec![1.0; m * 4])),
            }
        })
        .collect();
    let joined = ActReply::join(replies);
    assert_eq!(
        joined.actions.to_i64().unwrap(),
        (0..n as i64).collect::<Vec<_>>()
    );
    assert_eq!(
        joined.policy_version, 5,
        "acted by the oldest version among the parts"
    );
    assert_eq!(joined.state.unwrap().shape, vec![n as u32, 4]);
    joined.actions.check_len().unwrap();
}

#[test]
fn episode_reports_divide_by_episodes() {
    let report = EpisodeReport {
        schema: SCHEMA_VERSION,
        runner_id: "r".into(),
        env_id: "CartPole-v1".into(),
        policy_version: 2,
        episodes: (0..50)
            .map(|i| EpisodeSummary {
                episode_return: i as f64,
                length: i,
                ..Default::default()
            })
            .collect(),
    };
    let parts = at_around_and_over(&report);
    let episodes: Vec<EpisodeSummary> = parts.into_iter().flat_map(|p| p.episodes).collect();
    assert_eq!(episodes, report.episodes);
}

#[test]
fn sample_requests_divide_and_their_batches_join_on_one_weight_scale() {
    let request = TransitionSampleRequest {
        schema: SCHEMA_VERSION,
        batch_size: 64,
        beta: 0.4,
    };
    // A sample request is tiny: divided only at a limit below its size.
    let parts = request.clone().divide(3).unwrap();
    assert_eq!(
        parts.iter().map(|p| p.batch_size).collect::<Vec<_>>(),
        [22, 21, 21]
    );
    // Two parts of one prioritized draw: raw weights 2, 4 and 1, 8.
    let batch = |ids: [u64; 2], raw: [f64; 2]| {
        let scale = raw[0].max(raw[1]);
        TransitionBatch {
            schema: SCHEMA_VERSION,
            ids: ids.to_vec(),
            obs: Tensor::from_f32(&[2, 1], &[ids[0] as f32, ids[1] as f32]),
            actions: Tensor::from_i64(&[2], &[0, 1]),
            rewards: Tensor::from_f32(&[2], &[1.0, 1.0]),
            next_obs: Tensor::from_f32(&[2, 1], &[0.0, 0.0]),
            discounts: Tensor::from_f32(&[2], &[0.99, 0.0]),
            terminated: Tensor::from_u8(&[2], &[0, 1]),
            truncated: Tensor::from_u8(&[2], &[0, 0]),
            weights: Tensor::from_f32(&[2], &[(raw[0] / scale) as f32, (raw[1] / scale) as f32]),
            weight_scale: Some(scale),
            size: 100,
            inserted_steps: 200,
            next_masks: None,
        }
    };
    let joined = TransitionBatch::join(vec![batch([1, 2], [2.0, 4.0]), batch([3, 4], [1.0, 8.0])]);
    assert_eq!(joined.ids, [1, 2, 3, 4]);
    assert_eq!(joined.weights.to_f32().unwrap(), [0.25, 0.5, 0.125, 1.0]);
    assert_eq!(joined.weight_scale, Some(8.0));
    joined.validate().unwrap();
}

#[test]
fn a_game_is_one_unit() {
    let game = GameRecord {
        schema: SCHEMA_VERSION,
        runner_id: "r".into(),
        env_id: "TicTacToe-v0".into(),
        seed: 1,
        seats: Vec::new(),
        learner_seat: None,
        turns: Vec::new(),
        rewards: vec![1.0, -1.0],
        reasons: vec!["x".repeat(5000)],
        duration_ms: 1,
        finished_unix_ms: 1,
        branch: None,
    };
    let bytes = encode(&game).len();
    assert_eq!(
        encode_within(game.clone(), bytes + ENVELOPE_BYTES)
            .unwrap()
            .len(),
        1
    );
    let err = encode_within(game, bytes + ENVELOPE_BYTES - 1).unwrap_err();
    assert_eq!(err.unit, "game");
    assert_eq!(err.bytes, bytes);
}
