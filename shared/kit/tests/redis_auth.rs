//! Redis AUTH from config against a real redis-server that requires a password.

use relay_config::{ConnectionsConfig, Secret};
use relay_kit::connect::{connect_redis_with, ConnectError};
use relay_kit::Shutdown;
use relay_testkit::RedisServer;

#[tokio::test]
async fn redis_password_from_config_is_used_and_never_shown() {
    let redis = RedisServer::start_with_args(&["--requirepass", "s3cret-pw"]).unwrap();
    let (_trigger, shutdown) = Shutdown::new();

    let mut connections = ConnectionsConfig {
        redis_url: redis.url(),
        ..ConnectionsConfig::default()
    };
    connections.redis_password = Some(Secret::new("s3cret-pw"));
    let mut manager = connect_redis_with(&connections, &shutdown)
        .await
        .expect("connects with the password");
    let pong: String = redis::cmd("PING").query_async(&mut manager).await.unwrap();
    assert_eq!(pong, "PONG");

    // A password in the URL works too.
    let with_url = ConnectionsConfig {
        redis_url: format!("redis://:s3cret-pw@127.0.0.1:{}", redis.0.port),
        ..ConnectionsConfig::default()
    };
    let mut manager = connect_redis_with(&with_url, &shutdown)
        .await
        .expect("connects with the URL's password");
    let pong: String = redis::cmd("PING").query_async(&mut manager).await.unwrap();
    assert_eq!(pong, "PONG");

    // A wrong password fails at once with a clear error that does not show it.
    connections.redis_password = Some(Secret::new("wrong-pw"));
    let err = connect_redis_with(&connections, &shutdown)
        .await
        .expect_err("refused");
    assert!(matches!(err, ConnectError::RedisAuth { .. }), "{err}");
    let text = err.to_string();
    assert!(
        !text.contains("wrong-pw") && !text.contains("s3cret-pw"),
        "{text}"
    );
}
