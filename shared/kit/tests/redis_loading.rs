//! A service connecting to a Redis that is still loading its dataset (just
//! restarted) waits until it is loaded, against a real redis-server: every
//! command answers `LOADING` until then, and services used to start their
//! work on those errors.

use relay_config::ConnectionsConfig;
use relay_kit::connect::connect_redis_with;
use relay_kit::Shutdown;
use relay_testkit::RedisServer;

/// Enough keys that loading them back takes about a second.
const KEYS: usize = 1_000_000;

#[tokio::test]
async fn connecting_waits_until_a_restarted_redis_has_loaded_its_data() {
    let mut redis = RedisServer::start_persistent().unwrap();
    let (_trigger, shutdown) = Shutdown::new();
    let connections = ConnectionsConfig {
        redis_url: redis.url(),
        ..ConnectionsConfig::default()
    };
    let mut manager = connect_redis_with(&connections, &shutdown).await.unwrap();
    for chunk in (0..KEYS).collect::<Vec<_>>().chunks(50_000) {
        let mut pipe = redis::pipe();
        for i in chunk {
            pipe.cmd("SET").arg(format!("key:{i}")).arg("v").ignore();
        }
        pipe.query_async::<()>(&mut manager).await.unwrap();
    }
    drop(manager);

    redis.restart_persistent().unwrap();
    let mut manager = connect_redis_with(&connections, &shutdown).await.unwrap();
    // The first command after connecting finds the data, not LOADING.
    let size: usize = redis::cmd("DBSIZE")
        .query_async(&mut manager)
        .await
        .expect("no LOADING error once connected");
    assert_eq!(size, KEYS);
}
