//! The one way every follower keeps up with the learner's versions, of any
//! kind: subscribe to the published versions, ask the learner for its
//! newest one (`*.latest`) until the follower holds a version (taking any
//! version published meanwhile), then take each one published.
//! [`VersionFeed`] is that loop, generic over the kind ([`Followed`]:
//! classic weights on `weights` / `weights.latest`, LoRA adapters on
//! `adapters` / `adapters.latest`); what a version becomes is the caller's:
//! the classic [`crate::Follower`] fetches and builds it, the
//! [`crate::AdapterFollower`] keeps its number, the inference server's
//! adapter store loads it.
//!
//! Before its first version the learner answers `*.latest` with a 503
//! service error ("no version published yet"); the feed takes that, like
//! a learner that does not answer yet, as "not yet", and asks again after
//! its backoff: [`FIRST_RETRY`], doubling up to [`MAX_RETRY`].

use std::marker::PhantomData;
use std::time::Duration;

use futures::{FutureExt, StreamExt};
use relay_kit::weights::VersionMessage;
use relay_kit::{RequestError, Service, ServiceError};
use relay_proto::{AdapterUpdate, Subjects, WeightsUpdate, WireMessage};
use tokio::time::Instant;

/// The first pause before asking `*.latest` again.
pub const FIRST_RETRY: Duration = Duration::from_millis(20);
/// The longest pause between two asks of `*.latest` (the pause doubles
/// from [`FIRST_RETRY`]).
pub const MAX_RETRY: Duration = Duration::from_millis(500);

/// A kind of version followers follow: its message and its subjects.
pub trait Followed: VersionMessage {
    /// The published versions' subject, as the intake names it.
    const PUBLISHED: &'static str;
    /// The newest version's request subject, as the intake names it.
    const LATEST: &'static str;
    fn published_subject(subjects: &Subjects) -> String;
    fn latest_subject(subjects: &Subjects) -> String;
}

impl Followed for WeightsUpdate {
    const PUBLISHED: &'static str = "weights";
    const LATEST: &'static str = "weights.latest";
    fn published_subject(subjects: &Subjects) -> String {
        subjects.weights()
    }
    fn latest_subject(subjects: &Subjects) -> String {
        subjects.weights_latest()
    }
}

impl Followed for AdapterUpdate {
    const PUBLISHED: &'static str = "adapters";
    const LATEST: &'static str = "adapters.latest";
    fn published_subject(subjects: &Subjects) -> String {
        subjects.adapters()
    }
    fn latest_subject(subjects: &Subjects) -> String {
        subjects.adapters_latest()
    }
}

/// A version the feed heard of.
#[derive(Debug)]
pub enum Heard<U> {
    /// The learner's answer on `*.latest`.
    Latest(U),
    /// A published version; `bytes`: its message's size.
    Published { update: U, bytes: usize },
}

impl<U: Followed> Heard<U> {
    /// The subject it came on, as the intake names it (for rejections).
    pub fn subject(&self) -> &'static str {
        match self {
            Heard::Latest(_) => U::LATEST,
            Heard::Published { .. } => U::PUBLISHED,
        }
    }

    pub fn update(&self) -> &U {
        match self {
            Heard::Latest(update) | Heard::Published { update, .. } => update,
        }
    }

    pub fn into_update(self) -> U {
        match self {
            Heard::Latest(update) | Heard::Published { update, .. } => update,
        }
    }
}

/// The versions of kind `U` as a follower hears them (see the module
/// docs).
pub struct VersionFeed<U> {
    service: Service,
    published: async_nats::Subscriber,
    /// The encoded request on `*.latest`; `None`: the published ones only.
    ask: Option<Vec<u8>>,
    /// Of the versions published while the caller took the last one, only
    /// the newest is handed on.
    newest_only: bool,
    backoff: Duration,
    next_ask: Instant,
    kind: PhantomData<fn() -> U>,
}

impl<U: Followed> VersionFeed<U> {
    /// Subscribes to the published versions now (none published after
    /// this returns is missed). With `ask`, the feed asks `*.latest` with
    /// it while the caller holds no version. With `newest_only`, of the
    /// versions queued while the caller took the last one only the newest
    /// is handed on (every message is still checked: a bad one is
    /// counted); without, each one is.
    pub async fn subscribe<Q: WireMessage>(
        service: &Service,
        ask: Option<&Q>,
        newest_only: bool,
    ) -> Result<Self, ServiceError> {
        let published = service
            .nats
            .subscribe(U::published_subject(&service.subjects))
            .await
            .map_err(ServiceError::nats)?;
        Ok(Self {
            service: service.clone(),
            published,
            ask: ask.map(|ask| relay_proto::encode(ask)),
            newest_only,
            backoff: FIRST_RETRY,
            next_ask: Instant::now(),
            kind: PhantomData,
        })
    }

    /// The next version to take; `None` at shutdown. While the caller
    /// holds no version (`holding` false) and the feed asks, that is the
    /// learner's answer on `*.latest` or, while it waits to ask again, a
    /// version published meanwhile; else the next version published.
    pub async fn next(&mut self, holding: bool) -> Option<Heard<U>> {
        if self.service.shutdown.is_triggered() {
            return None;
        }
        if !holding && self.ask.is_some() {
            return self.ask_or_hear().await;
        }
        loop {
            let first = tokio::select! {
                m = self.published.next() => m?,
                _ = self.service.shutdown.wait() => return None,
            };
            let mut newest: Option<(U, usize)> = None;
            let mut message = Some(first);
            while let Some(m) = message {
                if let Some(update) = self.decode(&m.payload) {
                    if newest
                        .as_ref()
                        .is_none_or(|(n, _)| update.version() > n.version())
                    {
                        newest = Some((update, m.payload.len()));
                    }
                }
                if !self.newest_only && newest.is_some() {
                    break;
                }
                message = self.published.next().now_or_never().flatten();
            }
            if let Some((update, bytes)) = newest {
                return Some(Heard::Published { update, bytes });
            }
        }
    }

    /// Asks `*.latest` when its time has come, else waits for it or for a
    /// published version.
    async fn ask_or_hear(&mut self) -> Option<Heard<U>> {
        let ask = self.ask.clone().expect("the feed asks");
        let subject = U::latest_subject(&self.service.subjects);
        loop {
            if Instant::now() >= self.next_ask {
                let answer = relay_kit::connect::request_encoded::<U>(
                    &self.service.nats,
                    &subject,
                    ask.clone().into(),
                    self.service.request_timeout(),
                )
                .await;
                self.next_ask = Instant::now() + self.backoff;
                self.backoff = (self.backoff * 2).min(MAX_RETRY);
                match answer {
                    Ok(update) => return Some(Heard::Latest(update)),
                    Err(RequestError::Service { code, status, .. }) if code == "503" => {
                        tracing::debug!(subject, status, "no version yet")
                    }
                    Err(e) => tracing::debug!(error = %e, "no version yet"),
                }
            }
            tokio::select! {
                _ = tokio::time::sleep_until(self.next_ask) => {}
                m = self.published.next() => {
                    let m = m?;
                    // A published version came first: take it.
                    if let Some(update) = self.decode(&m.payload) {
                        return Some(Heard::Published { update, bytes: m.payload.len() });
                    }
                }
                _ = self.service.shutdown.wait() => return None,
            }
        }
    }

    fn decode(&self, payload: &[u8]) -> Option<U> {
        self.service.intake.decode::<U>(U::PUBLISHED, payload).ok()
    }
}
