//! Image observations stored once in the off-policy table, against a real
//! redis-server: a fragment's frames go in as one string, its transitions
//! hold plane indices, a sample gives back the pixels of both
//! observations, and the frames go once every transition of theirs was
//! evicted.

use relay_config::OffPolicyTable;
use relay_kit::Shutdown;
use relay_proto::{RolloutFragment, Tensor, SCHEMA_VERSION};
use relay_replay_buffer::offpolicy::{Table, TableInserted};
use relay_testkit::RedisServer;

/// Pixels of a plane: 2x2, all `frame`.
const PLANE: usize = 4;

/// A stack of 4 frames (oldest first), as pixels.
fn stack(frames: [u8; 4]) -> Vec<u8> {
    frames.iter().flat_map(|&f| [f; PLANE]).collect()
}

/// `t` steps of one env whose frame stacks shift one frame a step, frame
/// numbers from `first`: observation `i` is frames `first + i .. first +
/// i + 4`, stored once each, as the env-runner stores them.
fn fragment(t: usize, first: u8) -> RolloutFragment {
    let frames: Vec<u8> = (0..t + 4).flat_map(|i| [first + i as u8; PLANE]).collect();
    let obs: Vec<u32> = (0..t as u32).flat_map(|i| i..i + 4).collect();
    RolloutFragment {
        schema: SCHEMA_VERSION,
        runner_id: "test".into(),
        env_id: "ALE/Breakout-v5".into(),
        policy_version: 0,
        num_steps: t as u32,
        num_envs: 1,
        obs: Tensor::from_u32(&[t, 1, 4], &obs),
        actions: Tensor::from_i64(&[t, 1], &vec![2; t]),
        logprobs: Tensor::from_f32(&[t, 1], &vec![0.0; t]),
        values: Tensor::from_f32(&[t, 1], &vec![0.0; t]),
        rewards: Tensor::from_f32(
            &[t, 1],
            &(0..t).map(|i| first as f32 + i as f32).collect::<Vec<_>>(),
        ),
        terminated: Tensor::from_bool(&[t, 1], &vec![false; t]),
        truncated: Tensor::from_bool(&[t, 1], &vec![false; t]),
        next_obs: Tensor::from_u32(
            &[1, 4],
            &[t as u32, t as u32 + 1, t as u32 + 2, t as u32 + 3],
        ),
        final_obs: Tensor::from_u32(&[0, 4], &[]),
        norm_rewards: None,
        norm_delta: None,
        masks: None,
        frames: Some(Tensor::from_u8(&[t + 4, PLANE], &frames)),
        initial_state: None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frames_are_stored_once_sampled_as_pixels_and_dropped_with_their_transitions() {
    let server = RedisServer::start().unwrap();
    let (_trigger, shutdown) = Shutdown::new();
    let redis = relay_kit::connect_redis(&server.url(), &shutdown)
        .await
        .unwrap();
    let table = OffPolicyTable {
        capacity: 6,
        n_steps: 1,
        gamma: 0.99,
        prioritized: false,
        alpha: 0.6,
    };
    let store = Table::new(redis.clone(), "frames", table, None);
    // Frames 10.. then 20.., then 30..: 4 transitions each.
    for first in [10, 20] {
        let stored = store.insert(&fragment(4, first)).await.unwrap();
        assert!(matches!(stored, TableInserted::Stored { .. }), "{stored:?}");
    }
    // Held: ids 2..8 (capacity 6). Sample every slot once.
    let uniforms: Vec<f64> = (0..6).map(|i| (i as f64 + 0.5) / 6.0).collect();
    let sample = store.sample(6, 1.0, &uniforms).await.unwrap();
    assert_eq!(sample.corrupt, 0);
    let batch = sample.batch;
    assert_eq!(batch.obs.dtype, relay_proto::DType::U8);
    assert_eq!(batch.obs.shape, vec![6, 4 * PLANE as u32]);
    let obs = batch.obs.observations_to_f32().unwrap();
    let next = batch.next_obs.observations_to_f32().unwrap();
    let rewards = batch.rewards.to_f32().unwrap();
    for (i, &id) in batch.ids.iter().enumerate() {
        // Transition `id`: step `id % 4` of the fragment of frames 10 or 20,
        // named by its reward.
        let first = if id < 4 { 10 } else { 20 };
        let step = (id % 4) as u8;
        assert_eq!(
            rewards[i],
            (first + step) as f32,
            "row {i} is transition {id}"
        );
        let f = first + step;
        let row = |v: &[f32]| {
            v[i * 4 * PLANE..(i + 1) * 4 * PLANE]
                .iter()
                .map(|&x| x as u8)
                .collect::<Vec<_>>()
        };
        assert_eq!(row(&obs), stack([f, f + 1, f + 2, f + 3]), "obs of {id}");
        assert_eq!(
            row(&next),
            stack([f + 1, f + 2, f + 3, f + 4]),
            "next obs of {id}"
        );
    }

    // The fragment of frames 30 evicts ids 4..8's elders: every transition
    // of the first insert is gone, and its frames with them.
    let mut conn = redis.clone();
    let key = |first: u64| format!("relay:frames:offpolicy:frames:{first}");
    let exists = async |conn: &mut redis::aio::ConnectionManager, k: String| -> bool {
        redis::cmd("EXISTS")
            .arg(k)
            .query_async::<u64>(conn)
            .await
            .unwrap()
            == 1
    };
    assert!(exists(&mut conn, key(0)).await);
    store.insert(&fragment(4, 30)).await.unwrap();
    assert!(
        !exists(&mut conn, key(0)).await,
        "frames of evicted transitions stay"
    );
    assert!(exists(&mut conn, key(4)).await && exists(&mut conn, key(8)).await);
    // Each insert's 8 frames of 4 pixels, once.
    let bytes: u64 = redis::cmd("STRLEN")
        .arg(key(8))
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(bytes, 8 * PLANE as u64);
}
