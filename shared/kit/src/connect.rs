//! Connections to NATS and Redis that wait (with backoff) for the server,
//! reconnect on their own, and a request helper that times out instead of
//! hanging and understands NATS micro service error replies.

use std::time::Duration;

use relay_proto::{Rejection, WireMessage};

use crate::Shutdown;

/// Why a connection or request failed.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    #[error("shutdown requested while connecting to {0}")]
    Shutdown(String),
    #[error("bad Redis URL {url}: {detail}")]
    RedisUrl { url: String, detail: String },
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
}

impl RequestError {
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

/// Connects to NATS, retrying with backoff until it answers or shutdown fires.
/// The client then reconnects by itself forever.
pub async fn connect_nats(
    url: &str,
    name: &str,
    request_timeout: Duration,
    shutdown: &Shutdown,
) -> Result<async_nats::Client, ConnectError> {
    let mut backoff = Duration::from_millis(50);
    loop {
        let options = async_nats::ConnectOptions::new()
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
                tracing::warn!(url, error = %e, retry_in_ms = backoff.as_millis() as u64, "waiting for NATS");
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(backoff) => {}
            _ = shutdown.wait() => return Err(ConnectError::Shutdown(url.to_string())),
        }
        backoff = (backoff * 2).min(Duration::from_secs(2));
    }
}

/// Connects to Redis, retrying with backoff; the manager reconnects by itself afterwards.
pub async fn connect_redis(
    url: &str,
    shutdown: &Shutdown,
) -> Result<redis::aio::ConnectionManager, ConnectError> {
    let client = redis::Client::open(url).map_err(|e| ConnectError::RedisUrl {
        url: url.to_string(),
        detail: e.to_string(),
    })?;
    let mut backoff = Duration::from_millis(50);
    loop {
        let config = redis::aio::ConnectionManagerConfig::new()
            .set_connection_timeout(Some(Duration::from_secs(2)))
            .set_response_timeout(Some(Duration::from_secs(5)))
            .set_number_of_retries(6);
        match client.get_connection_manager_with_config(config).await {
            Ok(manager) => return Ok(manager),
            Err(e) => {
                tracing::warn!(url, error = %e, retry_in_ms = backoff.as_millis() as u64, "waiting for Redis");
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(backoff) => {}
            _ = shutdown.wait() => return Err(ConnectError::Shutdown(url.to_string())),
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
    let request = async_nats::Request::new()
        .payload(payload.into())
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
