//! Messages of any size on the wire: [`relay_proto::fit`]'s rule for
//! requests, their replies and publishes. A message that may outgrow the
//! NATS server's `max_payload` is encoded, divided until each part fits,
//! and sent part by part; the replies to a divided request are joined.
//!
//! A reply is measured by the server that makes it ([`reply_within`]):
//! one too large is answered with [`REPLY_TOO_LARGE`] instead, and the
//! requester divides that part in two and asks again, so the size of a
//! reply is never guessed from the request either.

use std::time::Duration;

use futures::future::BoxFuture;
use relay_proto::{encode, encode_within, Divisible, Indivisible, Joinable, Part, WireMessage};

use crate::connect::{request_encoded, RequestError};

/// The error code a server answers with when its reply would not fit a
/// message (HTTP's "content too large"): ask for less.
pub const REPLY_TOO_LARGE: u16 = 413;

/// Sends `message` as one request, or as the fewest requests whose parts
/// each fit the server's `max_payload`, all at once; their replies joined
/// in order. A part whose reply does not fit is divided and asked again.
pub async fn request_within<Req, Rep>(
    client: &async_nats::Client,
    subject: &str,
    message: Req,
    timeout: Duration,
) -> Result<Rep, RequestError>
where
    Req: Divisible + Send + 'static,
    Rep: Joinable + Send + 'static,
{
    let parts = encode_within(message, client.max_payload()).map_err(|source| {
        RequestError::Indivisible {
            subject: subject.to_string(),
            source,
        }
    })?;
    if parts.len() == 1 {
        let part = parts.into_iter().next().expect("one part");
        return request_part(client, subject, part, timeout).await;
    }
    let replies = futures::future::try_join_all(
        parts
            .into_iter()
            .map(|part| request_part(client, subject, part, timeout)),
    )
    .await?;
    Ok(Rep::join(replies))
}

/// One part's request; halved and asked again while its reply is too large.
fn request_part<'a, Req, Rep>(
    client: &'a async_nats::Client,
    subject: &'a str,
    part: Part<Req>,
    timeout: Duration,
) -> BoxFuture<'a, Result<Rep, RequestError>>
where
    Req: Divisible + Send + 'static,
    Rep: Joinable + Send + 'static,
{
    Box::pin(async move {
        let Part { message, bytes } = part;
        match request_encoded(client, subject, bytes.into(), timeout).await {
            Err(RequestError::Service {
                subject: answered,
                code,
                status,
            }) if code == REPLY_TOO_LARGE.to_string() => {
                // One unit whose reply does not fit: the server's own words.
                let Ok(halves) = message.divide(2) else {
                    return Err(RequestError::Service {
                        subject: answered,
                        code,
                        status,
                    });
                };
                let mut replies = Vec::with_capacity(halves.len());
                for half in halves {
                    let bytes = encode(&half);
                    let part = Part {
                        message: half,
                        bytes,
                    };
                    replies.push(request_part(client, subject, part, timeout).await?);
                }
                Ok(Rep::join(replies))
            }
            other => other,
        }
    })
}

/// Publishes `message` whole, or divided into parts that each fit; the
/// number of messages sent. A publish that fails for another reason is
/// logged (fire and forget, like every publish).
pub async fn publish_within<M: Divisible>(
    client: &async_nats::Client,
    subject: &str,
    message: M,
) -> Result<usize, Indivisible> {
    let parts = encode_within(message, client.max_payload())?;
    let sent = parts.len();
    for part in parts {
        if let Err(e) = client.publish(subject.to_string(), part.bytes.into()).await {
            tracing::warn!(subject, error = %e, "publish failed");
        }
    }
    Ok(sent)
}

/// A reply as a server sends it: encoded, or [`REPLY_TOO_LARGE`] when it
/// would not fit a message of the server's `max_payload` (the requester
/// divides its request and asks again).
pub fn reply_within<M: WireMessage>(
    reply: &M,
    max_payload: usize,
) -> Result<bytes::Bytes, async_nats::service::error::Error> {
    let bytes = encode(reply);
    if bytes.len() > max_payload {
        return Err(async_nats::service::error::Error {
            status: format!(
                "a reply of {} bytes is more than the {max_payload} bytes a message carries here (max_payload); ask for less",
                bytes.len()
            ),
            code: REPLY_TOO_LARGE as usize,
        });
    }
    Ok(bytes.into())
}
