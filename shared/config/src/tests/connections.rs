//! The `connections` section: secrets that never print, redacted URLs,
//! incomplete credentials.

use super::*;

#[test]
fn secrets_never_print_or_serialise() {
    let c = ExperimentConfig::from_layers(
        BASE,
        "t",
        &[
            ("connections.nats_password".into(), "hunter2-nats".into()),
            ("connections.redis_password".into(), "12345".into()),
        ],
        &[
            "connections.nats_user=learner".into(),
            "connections.nats_url=nats://a:pw-in-url@h1:4222,nats://h2:4222".into(),
        ],
    )
    .unwrap();
    assert_eq!(
        c.connections.nats_password.as_ref().unwrap().expose(),
        "hunter2-nats"
    );
    // A numeric-looking secret stays a string.
    assert_eq!(
        c.connections.redis_password.as_ref().unwrap().expose(),
        "12345"
    );
    let yaml = c.to_yaml();
    let debug = format!("{c:?}");
    let json = serde_json::to_string(&c).unwrap();
    for text in [&yaml, &debug, &json] {
        for secret in ["hunter2-nats", "12345", "pw-in-url"] {
            assert!(!text.contains(secret), "{secret} leaked in {text}");
        }
        assert!(text.contains("***"), "{text}");
    }
    assert!(
        yaml.contains("nats://a:***@h1:4222,nats://h2:4222"),
        "{yaml}"
    );
    assert!(yaml.contains("nats_user: learner"), "{yaml}");

    let token = ExperimentConfig::from_layers(
        BASE,
        "t",
        &[("connections.nats_token".into(), "s3cr3t-token".into())],
        &["connections.redis_url=redis://:redispw@r:6379/0".into()],
    )
    .unwrap();
    let text = format!("{token:?}\n{}", token.to_yaml());
    assert!(
        !text.contains("s3cr3t-token") && !text.contains("redispw"),
        "{text}"
    );
    assert!(text.contains("redis://:***@r:6379/0"), "{text}");
}

#[test]
fn redacts_urls() {
    assert_eq!(redact_url("nats://127.0.0.1:4222"), "nats://127.0.0.1:4222");
    assert_eq!(redact_url("nats://u:p@h:1"), "nats://u:***@h:1");
    assert_eq!(redact_url("nats://tok@h:1"), "nats://***@h:1");
    assert_eq!(
        redact_url("redis://u:p@ss@h:6379/0?x=a@b"),
        "redis://u:***@h:6379/0?x=a@b"
    );
}

#[test]
fn incomplete_credentials_name_the_field() {
    let cases = [
        (vec!["connections.nats_user=u"], "connections.nats_password"),
        (vec!["connections.nats_password=p"], "connections.nats_user"),
        (
            vec![
                "connections.nats_user=u",
                "connections.nats_password=p",
                "connections.nats_token=t",
            ],
            "connections.nats_token",
        ),
        (
            vec!["connections.nats_tls_cert=c.pem"],
            "connections.nats_tls_key",
        ),
        (
            vec!["connections.nats_tls_key=k.pem"],
            "connections.nats_tls_cert",
        ),
        (vec!["connections.nats_token="], "connections.nats_token"),
        (
            vec![
                "connections.redis_url=redis://:a@h:1",
                "connections.redis_password=b",
            ],
            "connections.redis_password",
        ),
    ];
    for (sets, field) in cases {
        let sets: Vec<String> = sets.into_iter().map(String::from).collect();
        let err = ExperimentConfig::from_layers(BASE, "t", &[], &sets)
            .unwrap_err()
            .to_string();
        assert!(err.contains(field), "{sets:?}: {err}");
    }
}
