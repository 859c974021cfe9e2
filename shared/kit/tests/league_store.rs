//! The league pool in a real redis-server: created on first use with the
//! fixed opponents, changed by concurrent writers without a lost update,
//! kept by a new store (a restarted service), and a corrupt document
//! reported by key.

use relay_kit::league::{LeagueError, LeagueStore};
use relay_kit::{connect_redis, Shutdown};
use relay_league::{FixedKind, FixedOpponent, MemberId, Outcome, PolicyVersion, PoolConfig};
use relay_testkit::RedisServer;

fn fixed() -> Vec<FixedOpponent> {
    vec![FixedOpponent {
        name: "random".into(),
        kind: FixedKind::Random,
    }]
}

fn version(version: u64) -> PolicyVersion {
    PolicyVersion {
        version,
        parent: version.checked_sub(1).filter(|&p| p > 0),
        weights_ref: format!("policy/{version}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_writers_lose_no_result_and_the_pool_survives_restarts() {
    let server = RedisServer::start().unwrap();
    let (_trigger, shutdown) = Shutdown::new();
    let redis = connect_redis(&server.url(), &shutdown).await.unwrap();
    let store = LeagueStore::new(redis.clone(), "league-test");
    assert!(store.load().await.unwrap().is_none());

    let config = PoolConfig::default();
    store
        .update(config, &fixed(), |pool| {
            pool.add_version(version(1)).map(|_| ())
        })
        .await
        .unwrap();

    // Four writers (as four env-runner copies) record 25 games each at once.
    let writers: Vec<_> = (0..4)
        .map(|_| {
            let store = store.clone();
            tokio::spawn(async move {
                for _ in 0..25 {
                    store
                        .update(config, &fixed(), |pool| {
                            pool.record_result(
                                &MemberId::Version(1),
                                &MemberId::Fixed("random".into()),
                                Outcome::Win,
                            )
                        })
                        .await
                        .unwrap();
                }
            })
        })
        .collect();
    for writer in writers {
        writer.await.unwrap();
    }

    // A store opened afresh (a restarted service) sees every game.
    let reopened = LeagueStore::new(
        connect_redis(&server.url(), &shutdown).await.unwrap(),
        "league-test",
    );
    let pool = reopened.load().await.unwrap().expect("the pool is stored");
    let record = pool.record(&MemberId::Version(1), &MemberId::Fixed("random".into()));
    assert_eq!(record.wins, 100, "{record:?}");
    assert_eq!(record.games(), 100);
    let v1 = pool.get(&MemberId::Version(1)).unwrap();
    let random = pool.get(&MemberId::Fixed("random".into())).unwrap();
    assert!(v1.rating.mu > random.rating.mu, "{v1:?} vs {random:?}");

    // A version joining inherits its parent's rating.
    let (_, pool) = reopened
        .update(config, &fixed(), |pool| {
            pool.add_version(version(2)).map(|_| ())
        })
        .await
        .unwrap();
    assert_eq!(
        pool.get(&MemberId::Version(2)).unwrap().rating.mu,
        v1.rating.mu
    );

    // Rules of the pool surface as errors, and nothing is written.
    let err = reopened
        .update(config, &fixed(), |pool| {
            pool.add_version(version(2)).map(|_| ())
        })
        .await
        .unwrap_err();
    assert!(matches!(err, LeagueError::Pool(_)), "{err}");
    assert!(reopened
        .load()
        .await
        .unwrap()
        .unwrap()
        .get(&MemberId::Version(2))
        .is_some());

    // A document that does not parse is named, not overwritten.
    let mut raw = redis.clone();
    let _: () = redis::cmd("SET")
        .arg("relay:broken:league")
        .arg("{not json")
        .query_async(&mut raw)
        .await
        .unwrap();
    let broken = LeagueStore::new(redis, "broken");
    let err = broken.load().await.unwrap_err();
    assert!(err.to_string().contains("relay:broken:league"), "{err}");
    assert!(broken.update(config, &fixed(), |_| Ok(())).await.is_err());
}
