//! Data-parallel groups against a real nats-server: members agree on one
//! view with ranks in joining order, the ring all-reduce sums exactly and
//! leaves every member with the same bits (3 members, small and large
//! buffers, uneven chunks), a broadcast reaches every member, a member
//! that stops refreshing is gone within
//! its lease and the others re-form without it, a neighbour that dies
//! inside an all-reduce ends it within its lease, not a hang, and one that
//! arrives late (a slower step) is waited for.

use std::time::Duration;

use relay_kit::collective::{Group, GroupConfig, View};
use relay_testkit::NatsServer;

fn config(group: &str, member: &str) -> GroupConfig {
    let mut c = GroupConfig::new(group, member, "127.0.0.1:0".parse().unwrap());
    c.lease = Duration::from_millis(1500);
    c.settle = Duration::from_millis(200);
    c.io_timeout = Duration::from_secs(3);
    c
}

async fn join(nats: &async_nats::Client, group: &str, member: &str) -> Group {
    Group::join(nats, config(group, member)).await.unwrap()
}

/// Waits until every group's newest view has exactly `size` members (and
/// all agree on it).
async fn agreed_view(groups: &mut [Group], size: usize) -> View {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    loop {
        let views: Vec<Option<View>> = groups.iter().map(Group::current_view).collect();
        if let Some(Some(first)) = views.first() {
            if first.size() == size && views.iter().all(|v| v.as_ref() == Some(first)) {
                return first.clone();
            }
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no agreed view of {size}: {views:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Member `rank`'s contribution: values whose sum in any order differs in
/// the last bits, so bit-identical results mean one order was used.
fn contribution(rank: usize, len: usize) -> Vec<f32> {
    (0..len)
        .map(|i| ((i * 7919 + rank * 104_729) % 1000) as f32 / 997.0 + rank as f32 * 1e-3)
        .collect()
}

async fn reduce_all(groups: &mut [Group], view: &View, tag: u64, len: usize) -> Vec<Vec<f32>> {
    let futures = groups.iter_mut().map(|g| {
        let view = view.clone();
        async move {
            let rank = view.rank_of(g.member()).unwrap();
            let mut data = contribution(rank, len);
            g.all_reduce_sum(&view, tag, &mut data).await.map(|()| data)
        }
    });
    futures::future::join_all(futures)
        .await
        .into_iter()
        .map(Result::unwrap)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn members_agree_and_the_ring_sums_bit_identically() {
    let server = NatsServer::start().unwrap();
    let nats = async_nats::connect(server.url()).await.unwrap();
    let mut groups = Vec::new();
    for id in ["a", "b", "c"] {
        groups.push(join(&nats, "run1-learner", id).await);
        // Distinct join times: ranks follow joining order.
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let view = agreed_view(&mut groups, 3).await;
    let ids: Vec<&str> = view.members.iter().map(|m| m.id.as_str()).collect();
    assert_eq!(ids, ["a", "b", "c"], "ranks in joining order");

    // Lengths that do not split evenly in three, and one of 4 MB.
    for (tag, len) in [(1u64, 1usize), (2, 2), (3, 1001), (4, 1_000_000)] {
        let results = reduce_all(&mut groups, &view, tag, len).await;
        for r in &results[1..] {
            assert!(
                r.iter()
                    .zip(&results[0])
                    .all(|(x, y)| x.to_bits() == y.to_bits()),
                "length {len}: members differ"
            );
        }
        for (i, got) in results[0].iter().enumerate().step_by(len / 97 + 1) {
            let want: f64 = (0..3).map(|r| contribution(r, len)[i] as f64).sum();
            assert!(
                (*got as f64 - want).abs() < 1e-5 * want.abs().max(1.0),
                "length {len}, index {i}: {got} vs {want}"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_broadcast_reaches_every_member_between_reductions() {
    let server = NatsServer::start().unwrap();
    let nats = async_nats::connect(server.url()).await.unwrap();
    let mut groups = Vec::new();
    for id in ["a", "b", "c"] {
        groups.push(join(&nats, "run4-learner", id).await);
    }
    let view = agreed_view(&mut groups, 3).await;
    // Pieces of 1 MiB and a remainder; from a root that is not rank 0.
    let sent: Vec<u8> = (0..3_000_017u32).map(|i| (i % 251) as u8).collect();
    for (tag, root) in [(1u64, 1usize), (2, 0)] {
        let futures = groups.iter_mut().map(|g| {
            let (view, sent) = (view.clone(), sent.clone());
            async move {
                let mut data = if view.rank_of(g.member()) == Some(root) {
                    sent
                } else {
                    vec![7u8; 3]
                };
                g.broadcast(&view, tag, root, &mut data)
                    .await
                    .map(|()| data)
            }
        });
        for got in futures::future::join_all(futures).await {
            assert!(
                got.unwrap() == sent,
                "root {root}: a member got other bytes"
            );
        }
        // The links stay in step for the reductions that follow.
        let results = reduce_all(&mut groups, &view, 10 + tag, 999).await;
        assert_eq!(results[0], results[2]);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_member_that_stops_is_gone_within_its_lease_and_one_that_joins_is_added() {
    let server = NatsServer::start().unwrap();
    let nats = async_nats::connect(server.url()).await.unwrap();
    let mut groups = vec![
        join(&nats, "run2-learner", "a").await,
        join(&nats, "run2-learner", "b").await,
        join(&nats, "run2-learner", "c").await,
    ];
    let three = agreed_view(&mut groups, 3).await;
    // `b` stops (as a killed process does: no leave, no more refreshes).
    let gone = groups.remove(1);
    let stopped = tokio::time::Instant::now();
    drop(gone);
    let two = agreed_view(&mut groups, 2).await;
    let noticed = stopped.elapsed();
    assert!(two.epoch > three.epoch);
    assert!(two.rank_of("b").is_none());
    assert!(
        noticed < Duration::from_secs(6),
        "a stopped member is noticed within about a lease (1.5 s): {noticed:?}"
    );
    let results = reduce_all(&mut groups, &two, 7, 1000).await;
    assert_eq!(results[0], results[1]);
    // A new member joins the running group.
    groups.push(join(&nats, "run2-learner", "d").await);
    let again = agreed_view(&mut groups, 3).await;
    assert!(again.epoch > two.epoch);
    assert_eq!(again.rank_of("d"), Some(2), "the newest member ranks last");
    let results = reduce_all(&mut groups, &again, 8, 1000).await;
    assert_eq!(results[0], results[2]);
    // Leaving says so at once.
    let left = groups.pop().unwrap();
    left.leave().await.unwrap();
    let after = agreed_view(&mut groups, 2).await;
    assert!(after.epoch > again.epoch);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_neighbour_that_dies_mid_reduce_is_an_error_naming_it() {
    let server = NatsServer::start().unwrap();
    let nats = async_nats::connect(server.url()).await.unwrap();
    let mut groups = vec![
        join(&nats, "run3-learner", "a").await,
        join(&nats, "run3-learner", "b").await,
    ];
    let view = agreed_view(&mut groups, 2).await;
    let mut b = groups.pop().unwrap();
    let mut a = groups.pop().unwrap();
    // `a` reduces; `b` never does and is then dropped.
    let started = tokio::time::Instant::now();
    let reduce = tokio::spawn(async move {
        let mut data = vec![1.0f32; 1000];
        a.all_reduce_sum(&view, 1, &mut data).await
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    b.all_reduce_sum(
        &View {
            epoch: 0,
            members: vec![],
        },
        1,
        &mut [],
    )
    .await
    .unwrap_err();
    drop(b);
    // A broken link names the neighbour; one that never linked ends the
    // wait when its lease runs out and the view moves on without it.
    let err = reduce.await.unwrap().unwrap_err().to_string();
    assert!(
        err.contains("neighbour b") || err.contains("superseded while waiting for rank 1"),
        "{err}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "fails within the lease (1.5 s) and the settling, not the arrival timeout"
    );
}

/// A member that reaches the all-reduce long after the others (a slower
/// step: more than the I/O timeout, 3 s here) is waited for while it holds
/// its lease, and the sum is right.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_member_that_arrives_late_is_waited_for() {
    let server = NatsServer::start().unwrap();
    let nats = async_nats::connect(server.url()).await.unwrap();
    let mut groups = vec![
        join(&nats, "run4-learner", "a").await,
        join(&nats, "run4-learner", "b").await,
        join(&nats, "run4-learner", "c").await,
    ];
    let view = agreed_view(&mut groups, 3).await;
    let mut tasks = Vec::new();
    for (rank, mut group) in groups.into_iter().enumerate() {
        let view = view.clone();
        tasks.push(tokio::spawn(async move {
            if rank == 1 {
                tokio::time::sleep(Duration::from_secs(5)).await;
            }
            let mut data = vec![rank as f32 + 1.0; 1000];
            group
                .all_reduce_sum(&view, 1, &mut data)
                .await
                .map(|()| data)
        }));
    }
    for task in tasks {
        let data = task.await.unwrap().expect("the late member is waited for");
        assert!(data.iter().all(|&x| x == 6.0));
    }
}
