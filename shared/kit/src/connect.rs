//! Connections to NATS and Redis that wait (with backoff) for the server,
//! reconnect on their own, and a request helper that times out instead of
//! hanging and understands NATS micro service error replies.

use std::time::Duration;

use relay_proto::{Rejection, WireMessage};

use crate::Shutdown;
use relay_config::{redact_url, ConnectionsConfig, Secret};

/// Why a connection or request failed. URLs in it are redacted.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    #[error("shutdown requested while connecting to {0}")]
    Shutdown(String),
    #[error("bad Redis URL {url}: {detail}")]
    RedisUrl { url: String, detail: String },
    #[error("NATS at {url} refused this client ({detail}); check connections.nats_user/nats_password (RELAY_NATS_PASSWORD), nats_token (RELAY_NATS_TOKEN) or nats_creds_file")]
    NatsAuth { url: String, detail: String },
    #[error("NATS at {url}: TLS failed ({detail}); check connections.nats_tls_ca/nats_tls_cert/nats_tls_key")]
    NatsTls { url: String, detail: String },
    #[error("Redis at {url} refused this client ({detail}); check connections.redis_password (RELAY_REDIS_PASSWORD) or the password in connections.redis_url")]
    RedisAuth { url: String, detail: String },
    #[error("config field {field}: {detail}")]
    Setting { field: &'static str, detail: String },
}

fn readable(field: &'static str, path: &Option<std::path::PathBuf>) -> Result<(), ConnectError> {
    if let Some(path) = path {
        std::fs::metadata(path).map_err(|e| ConnectError::Setting {
            field,
            detail: format!("cannot read {}: {e}", path.display()),
        })?;
    }
    Ok(())
}

/// The async-nats options for `connections`: credentials (user/password,
/// token or creds file) and TLS (CA, client certificate, required).
pub async fn nats_options(
    connections: &ConnectionsConfig,
) -> Result<async_nats::ConnectOptions, ConnectError> {
    let c = connections;
    readable("connections.nats_creds_file", &c.nats_creds_file)?;
    readable("connections.nats_tls_ca", &c.nats_tls_ca)?;
    readable("connections.nats_tls_cert", &c.nats_tls_cert)?;
    readable("connections.nats_tls_key", &c.nats_tls_key)?;
    let mut options = async_nats::ConnectOptions::new();
    if let Some(path) = &c.nats_creds_file {
        options = options
            .credentials_file(path)
            .await
            .map_err(|e| ConnectError::Setting {
                field: "connections.nats_creds_file",
                detail: format!("{}: {e}", path.display()),
            })?;
    }
    if let (Some(user), Some(password)) = (&c.nats_user, &c.nats_password) {
        options = options.user_and_password(user.clone(), password.expose().to_string());
    }
    if let Some(token) = &c.nats_token {
        options = options.token(token.expose().to_string());
    }
    if let Some(ca) = &c.nats_tls_ca {
        options = options.add_root_certificates(ca.clone());
    }
    if let (Some(cert), Some(key)) = (&c.nats_tls_cert, &c.nats_tls_key) {
        options = options.add_client_certificate(cert.clone(), key.clone());
    }
    if c.nats_tls_required {
        options = options.require_tls(true);
    }
    Ok(options)
}

/// Why a request got no usable reply.
#[derive(Debug, thiserror::Error)]
pub enum RequestError {
    #[error("request on {subject} timed out")]
    Timeout { subject: String },
    #[error("no service listens on {subject}")]
    NoResponders { subject: String },
    #[error("{subject} answered with error {code}: {status}")]
    Service {
        subject: String,
        code: String,
        status: String,
    },
    #[error("reply on {subject} rejected: {source}")]
    BadReply { subject: String, source: Rejection },
    #[error("request on {subject} failed: {detail}")]
    Other { subject: String, detail: String },
    /// The request is larger than the NATS server carries (its
    /// `max_payload`): sending it again cannot help.
    #[error("request on {subject} of {bytes} bytes is larger than the {limit} bytes this NATS server carries (max_payload)")]
    TooLarge {
        subject: String,
        bytes: usize,
        limit: usize,
    },
    /// A request (or, answered with [`crate::fit::REPLY_TOO_LARGE`], its
    /// reply) too large for a message that cannot be divided further.
    #[error("request on {subject}: {source}")]
    Indivisible {
        subject: String,
        source: relay_proto::Indivisible,
    },
}

impl RequestError {
    /// The request, or its reply (answered [`crate::fit::REPLY_TOO_LARGE`]),
    /// is too large for a message and cannot be divided further: sending
    /// it again cannot help.
    pub fn is_too_large(&self) -> bool {
        match self {
            RequestError::TooLarge { .. } | RequestError::Indivisible { .. } => true,
            RequestError::Service { code, .. } => *code == crate::fit::REPLY_TOO_LARGE.to_string(),
            _ => false,
        }
    }

    /// Worth retrying after a pause (the other side may come back).
    pub fn is_transient(&self) -> bool {
        matches!(
            self,
            RequestError::Timeout { .. }
                | RequestError::NoResponders { .. }
                | RequestError::Other { .. }
        )
    }
}

/// Connects to NATS without credentials; see [`connect_nats_with`].
pub async fn connect_nats(
    url: &str,
    name: &str,
    request_timeout: Duration,
    shutdown: &Shutdown,
) -> Result<async_nats::Client, ConnectError> {
    let connections = ConnectionsConfig {
        nats_url: url.to_string(),
        request_timeout_ms: request_timeout.as_millis() as u64,
        ..ConnectionsConfig::default()
    };
    connect_nats_with(&connections, name, shutdown).await
}

/// Connects to NATS with the credentials and TLS settings of `connections`,
/// retrying with backoff until it answers or shutdown fires. A server that
/// refuses the credentials, or a TLS failure, is an error at once (retrying
/// cannot fix it). The client then reconnects by itself forever.
pub async fn connect_nats_with(
    connections: &ConnectionsConfig,
    name: &str,
    shutdown: &Shutdown,
) -> Result<async_nats::Client, ConnectError> {
    let url = connections.nats_url.as_str();
    let shown = redact_url(url);
    let request_timeout = Duration::from_millis(connections.request_timeout_ms);
    let mut backoff = Duration::from_millis(50);
    loop {
        let options = nats_options(connections)
            .await?
            .name(name)
            .connection_timeout(Duration::from_secs(2))
            .request_timeout(Some(request_timeout))
            .max_reconnects(None)
            .reconnect_delay_callback(|attempts| {
                Duration::from_millis((50u64 << attempts.min(5)).min(2000))
            })
            .event_callback(|event| async move {
                tracing::info!(%event, "nats connection event");
            });
        match options.connect(url).await {
            Ok(client) => return Ok(client),
            Err(e) => {
                use async_nats::ConnectErrorKind as K;
                match e.kind() {
                    K::AuthorizationViolation | K::Authentication => {
                        return Err(ConnectError::NatsAuth {
                            url: shown,
                            detail: e.to_string(),
                        })
                    }
                    K::Tls => {
                        return Err(ConnectError::NatsTls {
                            url: shown,
                            detail: e.to_string(),
                        })
                    }
                    _ => {}
                }
                tracing::warn!(url = %shown, error = %e, retry_in_ms = backoff.as_millis() as u64, "waiting for NATS");
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(backoff) => {}
            _ = shutdown.wait() => return Err(ConnectError::Shutdown(shown)),
        }
        backoff = (backoff * 2).min(Duration::from_secs(2));
    }
}

/// The Redis connection info of `url` with `password` applied (when given).
pub fn redis_connection_info(
    url: &str,
    password: Option<&Secret>,
) -> Result<redis::ConnectionInfo, ConnectError> {
    use redis::IntoConnectionInfo;
    let info = url
        .into_connection_info()
        .map_err(|e| ConnectError::RedisUrl {
            url: redact_url(url),
            detail: e.to_string(),
        })?;
    Ok(match password {
        Some(password) => {
            let settings = info
                .redis_settings()
                .clone()
                .set_password(password.expose());
            info.set_redis_settings(settings)
        }
        None => info,
    })
}

/// Connects to Redis without a separate password (the URL may carry one).
pub async fn connect_redis(
    url: &str,
    shutdown: &Shutdown,
) -> Result<redis::aio::ConnectionManager, ConnectError> {
    let connections = ConnectionsConfig {
        redis_url: url.to_string(),
        ..ConnectionsConfig::default()
    };
    connect_redis_with(&connections, shutdown).await
}

/// Connects to Redis at `connections.redis_url` with
/// `connections.redis_password`, retrying with backoff until it answers
/// `PING` (a restarted Redis answers `LOADING` until its dataset is back in
/// memory); the manager reconnects by itself afterwards.
pub async fn connect_redis_with(
    connections: &ConnectionsConfig,
    shutdown: &Shutdown,
) -> Result<redis::aio::ConnectionManager, ConnectError> {
    let shown = redact_url(&connections.redis_url);
    let info = redis_connection_info(&connections.redis_url, connections.redis_password.as_ref())?;
    let client = redis::Client::open(info).map_err(|e| ConnectError::RedisUrl {
        url: shown.clone(),
        detail: e.to_string(),
    })?;
    let mut backoff = Duration::from_millis(50);
    loop {
        let config = redis::aio::ConnectionManagerConfig::new()
            .set_connection_timeout(Some(Duration::from_secs(2)))
            .set_response_timeout(Some(Duration::from_secs(5)))
            .set_number_of_retries(6);
        match client.get_connection_manager_with_config(config).await {
            // A Redis that restarts answers every command with LOADING until
            // its dataset is back in memory: wait for that too, so no
            // service starts its work on errors.
            Ok(mut manager) => match redis::cmd("PING").query_async::<String>(&mut manager).await {
                Ok(_) => return Ok(manager),
                Err(e) => {
                    tracing::warn!(url = %shown, error = %e, retry_in_ms = backoff.as_millis() as u64, "waiting for Redis to load its dataset")
                }
            },
            Err(e) => {
                let detail = e.to_string();
                if e.kind() == redis::ErrorKind::AuthenticationFailed
                    || ["WRONGPASS", "NOAUTH", "NOPERM"]
                        .iter()
                        .any(|code| detail.contains(code))
                {
                    return Err(ConnectError::RedisAuth { url: shown, detail });
                }
                tracing::warn!(url = %shown, error = %e, retry_in_ms = backoff.as_millis() as u64, "waiting for Redis");
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(backoff) => {}
            _ = shutdown.wait() => return Err(ConnectError::Shutdown(shown)),
        }
        backoff = (backoff * 2).min(Duration::from_secs(2));
    }
}

/// Sends a request and decodes its reply, with a timeout.
pub async fn request<Req: WireMessage, Rep: WireMessage>(
    client: &async_nats::Client,
    subject: &str,
    message: &Req,
    timeout: Duration,
) -> Result<Rep, RequestError> {
    let payload = relay_proto::encode(message);
    if payload.len() > client.max_payload() {
        return Err(RequestError::TooLarge {
            subject: subject.to_string(),
            bytes: payload.len(),
            limit: client.max_payload(),
        });
    }
    request_encoded(client, subject, payload.into(), timeout).await
}

/// Sends an encoded request (at most the server's `max_payload`) and
/// decodes its reply, with a timeout.
pub async fn request_encoded<Rep: WireMessage>(
    client: &async_nats::Client,
    subject: &str,
    payload: bytes::Bytes,
    timeout: Duration,
) -> Result<Rep, RequestError> {
    let request = async_nats::Request::new()
        .payload(payload)
        .timeout(Some(timeout));
    let reply = client
        .send_request(subject.to_string(), request)
        .await
        .map_err(|e| {
            use async_nats::RequestErrorKind as K;
            match e.kind() {
                K::TimedOut => RequestError::Timeout {
                    subject: subject.to_string(),
                },
                K::NoResponders => RequestError::NoResponders {
                    subject: subject.to_string(),
                },
                _ => RequestError::Other {
                    subject: subject.to_string(),
                    detail: e.to_string(),
                },
            }
        })?;
    if let Some(headers) = &reply.headers {
        if let Some(status) = headers.get(async_nats::service::NATS_SERVICE_ERROR) {
            let code = headers
                .get(async_nats::service::NATS_SERVICE_ERROR_CODE)
                .map(|c| c.to_string())
                .unwrap_or_default();
            return Err(RequestError::Service {
                subject: subject.to_string(),
                code,
                status: status.to_string(),
            });
        }
    }
    relay_proto::decode(&reply.payload).map_err(|source| RequestError::BadReply {
        subject: subject.to_string(),
        source,
    })
}
