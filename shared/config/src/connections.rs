//! The `connections` section: NATS and Redis URLs and credentials, and
//! how secrets stay out of logs and saved configs ([`Secret`], [`redact_url`]).

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::check::{invalid, ConfigError};

/// A credential (password, token) read from the config or the environment.
///
/// It never shows itself: `Debug`, `Display` and `Serialize` print `***`, so
/// the resolved config that the tracker writes into the run directory and
/// the learner into each checkpoint, and every log line, hold no secret.
/// Reading a written config back therefore gives `***`: supply secrets again
/// through the environment (`RELAY_NATS_PASSWORD`, ...). [`Secret::expose`]
/// is the one way to the value.
#[derive(Clone, PartialEq, Eq, Deserialize)]
#[serde(transparent)]
pub struct Secret(String);

impl Secret {
    /// What every redacted value prints as.
    pub const REDACTED: &'static str = "***";

    pub fn new(value: impl Into<String>) -> Self {
        Self(value.into())
    }

    /// The secret itself, for the one place that hands it to a client.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(Self::REDACTED)
    }
}

impl std::fmt::Display for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(Self::REDACTED)
    }
}

impl Serialize for Secret {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(Self::REDACTED)
    }
}

/// A URL (or a comma-separated list of them) with the password of any
/// `user:password@` part replaced by `***`, and a lone `token@` too; for logs
/// and written configs.
pub fn redact_url(url: &str) -> String {
    url.split(',')
        .map(|one| {
            let Some((scheme, rest)) = one.split_once("://") else {
                return one.to_string();
            };
            let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
            let (authority, tail) = rest.split_at(authority_end);
            let Some((userinfo, host)) = authority.rsplit_once('@') else {
                return one.to_string();
            };
            let userinfo = match userinfo.split_once(':') {
                Some((user, _)) => format!("{user}:{}", Secret::REDACTED),
                None => Secret::REDACTED.to_string(),
            };
            format!("{scheme}://{userinfo}@{host}{tail}")
        })
        .collect::<Vec<_>>()
        .join(",")
}

pub(crate) fn serialize_redacted_url<S: serde::Serializer>(
    url: &str,
    s: S,
) -> Result<S::Ok, S::Error> {
    s.serialize_str(&redact_url(url))
}

/// Where NATS and Redis are, and how to authenticate to them.
///
/// Secrets may sit in the file, but are better given by the environment:
/// `RELAY_NATS_PASSWORD`, `RELAY_NATS_TOKEN`, `RELAY_REDIS_PASSWORD`, or any
/// field as `RELAY__CONNECTIONS__<FIELD>` (e.g. `RELAY__CONNECTIONS__NATS_USER`).
/// Passwords and tokens are [`Secret`]s and URLs are redacted wherever the
/// config is printed or written.
#[derive(Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ConnectionsConfig {
    /// NATS server URL(s), comma-separated.
    #[serde(serialize_with = "serialize_redacted_url")]
    pub nats_url: String,
    /// NATS user name (user/password authentication); needs `nats_password`.
    pub nats_user: Option<String>,
    /// NATS password of `nats_user` (env: `RELAY_NATS_PASSWORD`).
    pub nats_password: Option<Secret>,
    /// NATS authentication token, instead of a user (env: `RELAY_NATS_TOKEN`).
    pub nats_token: Option<Secret>,
    /// NATS credentials file (JWT and nkey seed, as `nsc` writes it), instead
    /// of a user or a token.
    pub nats_creds_file: Option<PathBuf>,
    /// PEM file of the CA(s) that signed the NATS server's certificate
    /// (implies TLS).
    pub nats_tls_ca: Option<PathBuf>,
    /// PEM client certificate for mutual TLS; needs `nats_tls_key`.
    pub nats_tls_cert: Option<PathBuf>,
    /// PEM private key of `nats_tls_cert`.
    pub nats_tls_key: Option<PathBuf>,
    /// Refuse to talk to NATS without TLS.
    pub nats_tls_required: bool,
    /// Redis URL (used by the replay-buffer only); may carry a password
    /// (`redis://:password@host:6379` or `redis://user:password@host:6379`).
    #[serde(serialize_with = "serialize_redacted_url")]
    pub redis_url: String,
    /// Redis password (`requirepass`/ACL), when the URL carries none
    /// (env: `RELAY_REDIS_PASSWORD`).
    pub redis_password: Option<Secret>,
    /// Time after which a request over NATS is retried.
    pub request_timeout_ms: u64,
}

impl Default for ConnectionsConfig {
    fn default() -> Self {
        Self {
            nats_url: "nats://127.0.0.1:4222".into(),
            nats_user: None,
            nats_password: None,
            nats_token: None,
            nats_creds_file: None,
            nats_tls_ca: None,
            nats_tls_cert: None,
            nats_tls_key: None,
            nats_tls_required: false,
            redis_url: "redis://127.0.0.1:6379".into(),
            redis_password: None,
            request_timeout_ms: 2000,
        }
    }
}

impl std::fmt::Debug for ConnectionsConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConnectionsConfig")
            .field("nats_url", &redact_url(&self.nats_url))
            .field("nats_user", &self.nats_user)
            .field("nats_password", &self.nats_password)
            .field("nats_token", &self.nats_token)
            .field("nats_creds_file", &self.nats_creds_file)
            .field("nats_tls_ca", &self.nats_tls_ca)
            .field("nats_tls_cert", &self.nats_tls_cert)
            .field("nats_tls_key", &self.nats_tls_key)
            .field("nats_tls_required", &self.nats_tls_required)
            .field("redis_url", &redact_url(&self.redis_url))
            .field("redis_password", &self.redis_password)
            .field("request_timeout_ms", &self.request_timeout_ms)
            .finish()
    }
}

impl ConnectionsConfig {
    /// Checks that the credentials given make one complete NATS
    /// authentication method and one Redis password.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let empty = |field: &str, v: Option<&str>| match v {
            Some("") => Err(invalid(field, "must not be empty when set")),
            _ => Ok(()),
        };
        fn path_str(p: &Option<PathBuf>) -> Option<&str> {
            p.as_ref().map(|p| p.to_str().unwrap_or("?"))
        }
        empty("connections.nats_user", self.nats_user.as_deref())?;
        empty(
            "connections.nats_password",
            self.nats_password.as_ref().map(Secret::expose),
        )?;
        empty(
            "connections.nats_token",
            self.nats_token.as_ref().map(Secret::expose),
        )?;
        empty(
            "connections.redis_password",
            self.redis_password.as_ref().map(Secret::expose),
        )?;
        empty(
            "connections.nats_creds_file",
            path_str(&self.nats_creds_file),
        )?;
        empty("connections.nats_tls_ca", path_str(&self.nats_tls_ca))?;
        empty("connections.nats_tls_cert", path_str(&self.nats_tls_cert))?;
        empty("connections.nats_tls_key", path_str(&self.nats_tls_key))?;
        if self.nats_url.trim().is_empty() {
            return Err(invalid("connections.nats_url", "must not be empty"));
        }
        match (&self.nats_user, &self.nats_password) {
            (Some(_), None) => {
                return Err(invalid(
                    "connections.nats_password",
                    "connections.nats_user is set but no password is (set RELAY_NATS_PASSWORD)",
                ))
            }
            (None, Some(_)) => {
                return Err(invalid(
                    "connections.nats_user",
                    "connections.nats_password is set but no user is",
                ))
            }
            _ => {}
        }
        let methods = [
            self.nats_user.is_some().then_some("nats_user"),
            self.nats_token.is_some().then_some("nats_token"),
            self.nats_creds_file.is_some().then_some("nats_creds_file"),
        ];
        let methods: Vec<&str> = methods.into_iter().flatten().collect();
        if methods.len() > 1 {
            return Err(invalid(
                &format!("connections.{}", methods[1]),
                format!(
                    "NATS takes one authentication method; {} are set",
                    methods.join(" and ")
                ),
            ));
        }
        match (&self.nats_tls_cert, &self.nats_tls_key) {
            (Some(_), None) => {
                return Err(invalid(
                    "connections.nats_tls_key",
                    "connections.nats_tls_cert is set but its key is not",
                ))
            }
            (None, Some(_)) => {
                return Err(invalid(
                    "connections.nats_tls_cert",
                    "connections.nats_tls_key is set but no certificate is",
                ))
            }
            _ => {}
        }
        if self.redis_password.is_some() && url_has_password(&self.redis_url) {
            return Err(invalid(
                "connections.redis_password",
                "connections.redis_url already carries a password; give it once",
            ));
        }
        Ok(())
    }
}

pub(crate) fn url_has_password(url: &str) -> bool {
    redact_url(url) != url
}

/// Conventional environment variables for secrets, beside `RELAY__*`.
pub const SECRET_ENV_VARS: [(&str, &str); 3] = [
    ("RELAY_NATS_PASSWORD", "connections.nats_password"),
    ("RELAY_NATS_TOKEN", "connections.nats_token"),
    ("RELAY_REDIS_PASSWORD", "connections.redis_password"),
];
