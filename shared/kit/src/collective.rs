//! Data-parallel groups: replicas of one service (the learner) that take
//! each step together. A [`Group`] knows who is in it, which [`View`] (an
//! epoch and its ordered members) a step runs in, and sums f32 buffers
//! across the view's members ([`Group::all_reduce_sum`]).
//!
//! - **Membership** is a JetStream key-value bucket with one key per
//!   member, rewritten every third of a lease. The bucket's entries age
//!   out after one lease and the server then writes a delete marker
//!   (`limit_markers`), so a member that stops (killed, partitioned) is
//!   gone for every watcher within about a lease, without anyone polling.
//! - **The view** is one key of a second bucket that never expires. A
//!   member that sees the live members differ from the view proposes the
//!   next epoch by compare-and-set on that key's revision. JetStream's
//!   Raft log orders the proposals and exactly one wins; nothing here is a
//!   consensus of its own. Ranks are the order of joining (the oldest
//!   member is rank 0), so rank 0 moves only when rank 0 leaves.
//! - **All-reduce** is a ring over direct TCP connections between
//!   neighbours: a reduce-scatter then an all-gather in `N - 1` rounds
//!   each, so every member sends and receives `2 (N - 1) / N` of the
//!   buffer whatever `N` is (Baidu's ring all-reduce, as Horovod, gloo's
//!   ring and NCCL's ring use). Each chunk's sum is computed once, in ring
//!   order, and then copied, so every member ends with bit-identical
//!   values. The bytes go member to member, not through nats-server: a
//!   ring over NATS would carry every byte twice through one server, as
//!   the direct weights transfer ([`crate::direct`]) avoids for the same
//!   reason.
//!
//! A failure inside an all-reduce (a neighbour gone, a stalled socket past
//! `io_timeout` while data moves, a neighbour in another epoch or on
//! another step, the view superseded) is an error, never a hang or a wrong
//! sum; the caller waits for the next view ([`Group::view_after`]) and
//! redoes the step in it. Waiting for the others to *arrive* is not a
//! failure: a slower replica's step (a large model's micro-batches, uneven
//! sequence lengths) may take minutes longer than another's, so the ring
//! first passes every member's header round (once back, all have arrived)
//! and waits for it while the view stands: a member that dies or is
//! partitioned loses its lease and ends the wait with a new view, as DDP's
//! process groups wait up to their timeout (30 minutes) rather than a
//! transfer timeout.

mod ring;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::Duration;

use async_nats::jetstream::kv::{self, Operation, Store};
use futures::StreamExt;
use serde::{Deserialize, Serialize};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};

use ring::{accept, Links};

/// What can go wrong in a group.
#[derive(Debug, thiserror::Error)]
pub enum CollectiveError {
    #[error("group {group}: JetStream key-value: {detail}")]
    Store { group: String, detail: String },
    #[error("group {group}: {0}", group = .1)]
    Io(std::io::Error, String),
    #[error("group {group}: the listen address {addr} is unspecified: give the host other members reach it at")]
    NoAdvertisedHost { group: String, addr: SocketAddr },
    #[error("group {group}: epoch {epoch}: {member} is not in the view")]
    NotAMember {
        group: String,
        epoch: u64,
        member: String,
    },
    #[error("group {group}: epoch {epoch}, step {tag}: neighbour {peer} {detail}")]
    Peer {
        group: String,
        epoch: u64,
        tag: u64,
        peer: String,
        detail: String,
    },
    #[error("group {group}: no view holding {member} within {waited:?}")]
    NoView {
        group: String,
        member: String,
        waited: Duration,
    },
    #[error("group {group}: closed")]
    Closed { group: String },
    #[error("group {group}: epoch {epoch} was superseded while waiting for rank {root}")]
    Superseded {
        group: String,
        epoch: u64,
        root: usize,
    },
}

/// How a member joins and behaves.
#[derive(Debug, Clone)]
pub struct GroupConfig {
    /// The group's name, unique per run and service (for example
    /// `<run id>-learner`); letters, digits, `-` and `_`.
    pub name: String,
    /// This member's id, unique in the group (host, pid and a random part).
    pub member: String,
    /// Where this member accepts its left neighbour (port 0: any free port).
    pub listen: SocketAddr,
    /// The host other members connect to, needed when `listen` is an
    /// unspecified address such as `0.0.0.0`.
    pub advertise: Option<String>,
    /// A member that has not refreshed its key for this long is gone.
    pub lease: Duration,
    /// How long the live members must stay unchanged before a new view is
    /// proposed, so that members joining together land in one epoch.
    pub settle: Duration,
    /// A neighbour silent this long while data moves has failed.
    pub io_timeout: Duration,
    /// How long a member waits for the others to reach an all-reduce (a
    /// slower member's step, or rank 0's gathering, can take minutes on a
    /// large model). While they hold their leases the wait goes on: a dead
    /// or partitioned member ends it with a new view, not a timeout. This
    /// is the backstop for a member alive but stuck, as PyTorch's process
    /// groups' 30-minute timeout.
    pub arrival_timeout: Duration,
}

impl GroupConfig {
    /// Defaults: a 3 s lease, 300 ms settling, a 10 s I/O timeout, 30
    /// minutes to arrive.
    pub fn new(name: impl Into<String>, member: impl Into<String>, listen: SocketAddr) -> Self {
        Self {
            name: name.into(),
            member: member.into(),
            listen,
            advertise: None,
            lease: Duration::from_secs(3),
            settle: Duration::from_millis(300),
            io_timeout: Duration::from_secs(10),
            arrival_timeout: Duration::from_secs(30 * 60),
        }
    }
}

/// One member as the membership bucket holds it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Member {
    pub id: String,
    /// `host:port` of its all-reduce listener.
    pub addr: String,
    /// When it joined (ms since the Unix epoch): ranks follow it.
    pub joined_ms: u64,
}

/// An epoch of the group: its members in rank order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct View {
    pub epoch: u64,
    pub members: Vec<Member>,
}

impl View {
    /// The rank of member `id`, if it is in this view.
    pub fn rank_of(&self, id: &str) -> Option<usize> {
        self.members.iter().position(|m| m.id == id)
    }

    /// Number of members.
    pub fn size(&self) -> usize {
        self.members.len()
    }
}

/// A member of a group (see the module docs). Dropping it stops its
/// refreshes, so the others see it leave within a lease; [`Self::leave`]
/// tells them at once.
pub struct Group {
    config: GroupConfig,
    addr: String,
    members: Store,
    view_rx: watch::Receiver<Option<View>>,
    incoming: mpsc::Receiver<(u64, String, TcpStream)>,
    /// Connections that arrived for a later epoch than the one asked for.
    early: Vec<(u64, String, TcpStream)>,
    links: Option<Links>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Drop for Group {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// Bucket names allow letters, digits, `-` and `_`.
fn bucket_name(group: &str, part: &str) -> String {
    let clean: String = group
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
                c
            } else {
                '_'
            }
        })
        .collect();
    format!("relay-group-{clean}-{part}")
}

/// Keys allow letters, digits and `-/_=.`.
fn member_key(id: &str) -> String {
    let clean: String = id
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || "-/_=.".contains(c) {
                c
            } else {
                '_'
            }
        })
        .collect();
    format!("member.{clean}")
}

const VIEW_KEY: &str = "view";

impl Group {
    /// Joins the group: starts listening, registers this member, and keeps
    /// its key fresh and the view current in background tasks. Returns at
    /// once; [`Self::view_after`] waits for a view that holds this member.
    pub async fn join(
        nats: &async_nats::Client,
        config: GroupConfig,
    ) -> Result<Self, CollectiveError> {
        let group = config.name.clone();
        let store_error = |detail: String| CollectiveError::Store {
            group: group.clone(),
            detail,
        };
        let listener = TcpListener::bind(config.listen)
            .await
            .map_err(|e| CollectiveError::Io(e, group.clone()))?;
        let local = listener
            .local_addr()
            .map_err(|e| CollectiveError::Io(e, group.clone()))?;
        let host = match &config.advertise {
            Some(h) => h.clone(),
            None if local.ip().is_unspecified() => {
                return Err(CollectiveError::NoAdvertisedHost {
                    group: group.clone(),
                    addr: local,
                })
            }
            None => local.ip().to_string(),
        };
        let addr = format!("{host}:{}", local.port());

        let js = async_nats::jetstream::new(nats.clone());
        let members = open_bucket(
            &js,
            kv::Config {
                bucket: bucket_name(&config.name, "members"),
                history: 1,
                max_age: config.lease,
                storage: async_nats::jetstream::stream::StorageType::Memory,
                limit_markers: Some(config.lease),
                ..Default::default()
            },
        )
        .await
        .map_err(&store_error)?;
        let views = open_bucket(
            &js,
            kv::Config {
                bucket: bucket_name(&config.name, "view"),
                history: 1,
                storage: async_nats::jetstream::stream::StorageType::Memory,
                ..Default::default()
            },
        )
        .await
        .map_err(&store_error)?;

        let me = Member {
            id: config.member.clone(),
            addr: addr.clone(),
            joined_ms: now_ms(),
        };
        let record = bytes::Bytes::from(serde_json::to_vec(&me).expect("a member serialises"));
        let key = member_key(&me.id);
        members
            .put(&key, record.clone())
            .await
            .map_err(|e| store_error(e.to_string()))?;

        let (view_tx, view_rx) = watch::channel(None);
        let (incoming_tx, incoming) = mpsc::channel(16);
        let mut tasks = Vec::new();
        // Refresh this member's key.
        {
            let members = members.clone();
            let every = config.lease / 3;
            tasks.push(tokio::spawn(async move {
                loop {
                    tokio::time::sleep(every).await;
                    if let Err(e) = members.put(&key, record.clone()).await {
                        tracing::warn!(error = %e, "group member refresh failed");
                    }
                }
            }));
        }
        tasks.push(tokio::spawn(keep_view(
            members.clone(),
            views,
            view_tx,
            config.settle,
        )));
        tasks.push(tokio::spawn(accept(listener, incoming_tx)));
        Ok(Self {
            config,
            addr,
            members,
            view_rx,
            incoming,
            early: Vec::new(),
            links: None,
            tasks,
        })
    }

    /// This member's id.
    pub fn member(&self) -> &str {
        &self.config.member
    }

    /// Where this member accepts its left neighbour.
    pub fn addr(&self) -> &str {
        &self.addr
    }

    /// The newest agreed view, if any.
    pub fn current_view(&self) -> Option<View> {
        self.view_rx.borrow().clone()
    }

    /// Waits (up to `timeout`) for an agreed view newer than epoch `after`
    /// (`None`: any) that holds this member.
    pub async fn view_after(
        &mut self,
        after: Option<u64>,
        timeout: Duration,
    ) -> Result<View, CollectiveError> {
        let me = self.config.member.clone();
        let wanted = |v: &Option<View>| {
            v.as_ref()
                .is_some_and(|v| after.is_none_or(|a| v.epoch > a) && v.rank_of(&me).is_some())
        };
        let waited = tokio::time::timeout(timeout, self.view_rx.wait_for(wanted)).await;
        match waited {
            Ok(Ok(v)) => Ok(v.clone().expect("wanted checks it is there")),
            Ok(Err(_)) => Err(CollectiveError::Closed {
                group: self.config.name.clone(),
            }),
            Err(_) => Err(CollectiveError::NoView {
                group: self.config.name.clone(),
                member: me,
                waited: timeout,
            }),
        }
    }

    /// Leaves at once (deletes this member's key) rather than by lease.
    pub async fn leave(self) -> Result<(), CollectiveError> {
        self.members
            .delete(member_key(&self.config.member))
            .await
            .map_err(|e| CollectiveError::Store {
                group: self.config.name.clone(),
                detail: e.to_string(),
            })
    }
}

/// The bucket, created if it is not there yet.
async fn open_bucket(
    js: &async_nats::jetstream::Context,
    config: kv::Config,
) -> Result<Store, String> {
    if let Ok(store) = js.get_key_value(&config.bucket).await {
        return Ok(store);
    }
    let bucket = config.bucket.clone();
    match js.create_key_value(config).await {
        Ok(store) => Ok(store),
        // Another member created it first.
        Err(created) => js
            .get_key_value(&bucket)
            .await
            .map_err(|_| format!("bucket {bucket}: {created}")),
    }
}

/// Keeps `view_tx` at the agreed view, and proposes the next one whenever
/// the live members have differed from it for `settle`.
async fn keep_view(
    members: Store,
    views: Store,
    view_tx: watch::Sender<Option<View>>,
    settle: Duration,
) {
    let (Ok(mut member_updates), Ok(mut view_updates)) = (
        members.watch_with_history(">").await,
        views.watch_with_history(VIEW_KEY).await,
    ) else {
        tracing::error!("group: cannot watch the membership buckets");
        return;
    };
    let mut live: BTreeMap<String, Member> = BTreeMap::new();
    let mut agreed: Option<(View, u64)> = None;
    let mut deadline: Option<tokio::time::Instant> = Some(tokio::time::Instant::now() + settle);
    loop {
        let sleep = async {
            match deadline {
                Some(d) => tokio::time::sleep_until(d).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            Some(Ok(entry)) = member_updates.next() => {
                match entry.operation {
                    Operation::Put => {
                        if let Ok(m) = serde_json::from_slice::<Member>(&entry.value) {
                            if live.get(&entry.key) != Some(&m) {
                                live.insert(entry.key, m);
                                deadline = Some(tokio::time::Instant::now() + settle);
                            }
                        }
                    }
                    Operation::Delete | Operation::Purge => {
                        if live.remove(&entry.key).is_some() {
                            deadline = Some(tokio::time::Instant::now() + settle);
                        }
                    }
                }
            }
            Some(Ok(entry)) = view_updates.next() => {
                if let (Operation::Put, Ok(view)) =
                    (entry.operation, serde_json::from_slice::<View>(&entry.value))
                {
                    if agreed.as_ref().is_none_or(|(v, _)| view.epoch > v.epoch) {
                        view_tx.send_replace(Some(view.clone()));
                        agreed = Some((view, entry.revision));
                        deadline = Some(tokio::time::Instant::now() + settle);
                    }
                }
            }
            () = sleep => {
                deadline = None;
                let mut ordered: Vec<Member> = live.values().cloned().collect();
                ordered.sort_by(|a, b| (a.joined_ms, &a.id).cmp(&(b.joined_ms, &b.id)));
                if ordered.is_empty() || agreed.as_ref().is_some_and(|(v, _)| v.members == ordered) {
                    continue;
                }
                let next = View {
                    epoch: agreed.as_ref().map_or(1, |(v, _)| v.epoch + 1),
                    members: ordered,
                };
                let value = bytes::Bytes::from(serde_json::to_vec(&next).expect("a view serialises"));
                // One proposal per epoch wins; the others learn it from the watch.
                let proposed = match &agreed {
                    None => views.create(VIEW_KEY, value).await.map(|_| ()).map_err(|e| e.to_string()),
                    Some((_, revision)) => views
                        .update(VIEW_KEY, value, *revision)
                        .await
                        .map(|_| ())
                        .map_err(|e| e.to_string()),
                };
                if let Err(e) = proposed {
                    tracing::debug!(error = %e, epoch = next.epoch, "group: another proposal won");
                    // Look again after the winner arrives.
                    deadline = Some(tokio::time::Instant::now() + settle);
                }
            }
            else => return,
        }
    }
}
