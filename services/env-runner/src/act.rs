//! Asking the inference servers for actions: the act request (divided to
//! fit NATS messages), its retries, and the checks of each reply.

use std::time::{Duration, Instant};

use relay_envs::ActionSpace;
use relay_kit::{RequestError, Service};
use relay_proto::{ActReply, ActRequest, DType, Tensor};

use crate::Metrics;

/// Checks an act reply against the request size and the action space.
fn check_reply(
    reply: &ActReply,
    n: usize,
    space: &ActionSpace,
    masks: Option<&[u8]>,
    state: Option<&[f32]>,
) -> Result<(), String> {
    // A recurrent policy's reply carries each row's next state, as wide as
    // the one sent.
    if let Some(sent) = state {
        let width = sent.len() / n;
        let next = reply.state.as_ref().ok_or_else(|| {
            "no recurrent state in the reply (the inference server serves a feed-forward policy?)"
                .to_string()
        })?;
        next.expect(DType::F32, &[Some(n), Some(width)])
            .map_err(|e| format!("state: {e}"))?;
    }
    match space {
        ActionSpace::Discrete { n: actions } => {
            reply
                .actions
                .expect(DType::I64, &[Some(n)])
                .map_err(|e| e.to_string())?;
            let values = reply.actions.to_i64().map_err(|e| e.to_string())?;
            if let Some(a) = values.iter().find(|&&a| a < 0 || a as usize >= *actions) {
                return Err(format!("action {a} outside Discrete({actions})"));
            }
            if let Some(masks) = masks {
                let illegal = values
                    .iter()
                    .zip(masks.chunks_exact(*actions))
                    .position(|(&a, mask)| mask[a as usize] == 0);
                if let Some(i) = illegal {
                    return Err(format!(
                        "action {} for env {i} is illegal under its action mask",
                        values[i]
                    ));
                }
            }
        }
        ActionSpace::Box { low, .. } => {
            reply
                .actions
                .expect(DType::F32, &[Some(n), Some(low.len())])
                .map_err(|e| e.to_string())?;
        }
    }
    Ok(())
}

/// Observations to act on: `n` rows of `obs_dim` values (uint8 pixels
/// when `pixels`), with their legal actions `masks`.
#[derive(Clone, Copy)]
pub(crate) struct ActRows<'a> {
    pub obs: &'a [f32],
    pub masks: Option<&'a [u8]>,
    pub n: usize,
    pub obs_dim: usize,
    pub pixels: bool,
    /// A past version to act with (a league opponent); `None`: the newest.
    pub version: Option<u64>,
    /// Recurrent policies: each row's state, `n` rows of equal width.
    pub state: Option<&'a [f32]>,
    /// gSDE policies: each row's exploration seed (`crate::exploration`).
    pub noise_seeds: Option<&'a [u64]>,
}

/// Asks for actions for `rows` ([`act`]), retrying while no inference
/// server (or no weights) is there and rejecting bad replies; `None` once
/// the service stops (or fails: a request can never fit a message). Rows
/// for a past version that no server holds (404) are acted by the newest
/// version instead, which the reply's `policy_version` shows.
pub(crate) async fn act_until_answered(
    service: &Service,
    metrics: &Metrics,
    subject: &str,
    mut rows: ActRows<'_>,
    space: &ActionSpace,
) -> Option<ActReply> {
    let timeout = service.request_timeout();
    let mut backoff = Duration::from_millis(10);
    loop {
        let sent = Instant::now();
        match act(service, subject, rows, timeout).await {
            Err(RequestError::Service { code, .. }) if code == "404" && rows.version.is_some() => {
                rows.version = None;
                continue;
            }
            Ok(reply) => match check_reply(&reply, rows.n, space, rows.masks, rows.state) {
                Ok(()) => {
                    metrics.act_latency.observe(sent.elapsed().as_secs_f64());
                    return Some(reply);
                }
                Err(detail) => service.intake.reject(
                    "act.reply",
                    &relay_proto::Rejection::Invalid {
                        kind: "ActReply",
                        field: "actions",
                        detail,
                    },
                ),
            },
            Err(RequestError::BadReply { source, .. }) => {
                service.intake.reject("act.reply", &source)
            }
            // A request, or the reply to one row, that no message carries.
            Err(e) if e.is_too_large() => {
                service.fail(format!("cannot ask for actions: {e}")).await;
                return None;
            }
            Err(e) => tracing::debug!(error = %e, "act request failed; retrying"),
        }
        tokio::select! {
            _ = tokio::time::sleep(backoff) => {}
            _ = service.shutdown.wait() => return None,
        }
        backoff = (backoff * 2).min(Duration::from_secs(1));
    }
}

/// Actions for `rows`: one act request, divided into as many as it takes
/// to fit NATS messages (`relay_kit::fit`), answered as one reply acted by
/// the oldest version among them.
async fn act(
    service: &Service,
    subject: &str,
    rows: ActRows<'_>,
    timeout: Duration,
) -> Result<ActReply, RequestError> {
    let ActRows {
        obs,
        masks,
        n,
        obs_dim,
        pixels,
        version,
        state,
        noise_seeds,
    } = rows;
    let request = ActRequest::new(Tensor::observations(&[n, obs_dim], obs, pixels), false)
        .with_masks(masks.map(|m| Tensor::from_u8(&[n, m.len() / n], m)))
        .with_state(state.map(|s| Tensor::from_f32(&[n, s.len() / n], s)))
        .with_noise_seeds(noise_seeds.map(<[u64]>::to_vec))
        .at_version(version);
    relay_kit::request_within(&service.nats, subject, request, timeout).await
}
