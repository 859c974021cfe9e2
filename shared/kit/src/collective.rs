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

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::Duration;

use async_nats::jetstream::kv::{self, Operation, Store};
use futures::StreamExt;
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};

/// First bytes of every connection between members.
const MAGIC: u32 = 0x7265_6c61; // "rela"

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

/// The ring links of one epoch: to the right neighbour and from the left.
struct Links {
    epoch: u64,
    right: TcpStream,
    left: TcpStream,
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

    /// Sums `data` elementwise across the members of `view`, in place; every
    /// member must call it with the same view, `tag` (the step) and length.
    /// Every member ends with the same bits.
    pub async fn all_reduce_sum(
        &mut self,
        view: &View,
        tag: u64,
        data: &mut [f32],
    ) -> Result<(), CollectiveError> {
        let rank = self.rank_in(view)?;
        if view.size() == 1 {
            return Ok(());
        }
        let result = self.ring(view, rank, tag, data).await;
        if result.is_err() {
            // A broken ring is rebuilt for the next call.
            self.links = None;
        }
        result
    }

    /// Sends `data` from the member of rank `root` to every other member of
    /// `view` (whose `data` is replaced), passed along the ring in pieces
    /// of 1 MiB so that every link carries it once. Every member must call
    /// it with the same view, `tag` and root.
    pub async fn broadcast(
        &mut self,
        view: &View,
        tag: u64,
        root: usize,
        data: &mut Vec<u8>,
    ) -> Result<(), CollectiveError> {
        self.broadcast_in(view, tag, root, data, false).await
    }

    /// [`Self::broadcast`] for a root that sends when it is ready (rank 0
    /// handing out a step's batch after gathering it): the other members
    /// wait for its first bytes however long that takes, until a view
    /// newer than `view` is agreed ([`CollectiveError::Superseded`]: a
    /// member left or joined). The bytes themselves move under the usual
    /// I/O timeout.
    pub async fn broadcast_awaited(
        &mut self,
        view: &View,
        tag: u64,
        root: usize,
        data: &mut Vec<u8>,
    ) -> Result<(), CollectiveError> {
        self.broadcast_in(view, tag, root, data, true).await
    }

    async fn broadcast_in(
        &mut self,
        view: &View,
        tag: u64,
        root: usize,
        data: &mut Vec<u8>,
        patient: bool,
    ) -> Result<(), CollectiveError> {
        let rank = self.rank_in(view)?;
        if view.size() == 1 {
            return Ok(());
        }
        let result = self.pass_along(view, rank, tag, root, data, patient).await;
        if result.is_err() {
            self.links = None;
        }
        result
    }

    fn rank_in(&self, view: &View) -> Result<usize, CollectiveError> {
        view.rank_of(&self.config.member)
            .ok_or_else(|| CollectiveError::NotAMember {
                group: self.config.name.clone(),
                epoch: view.epoch,
                member: self.config.member.clone(),
            })
    }

    fn peer_error(&self, view: &View, tag: u64, peer: &Member, detail: String) -> CollectiveError {
        peer_error(&self.config.name, view, tag, peer, detail)
    }

    /// The ring links of `view`'s epoch, made on first use.
    async fn links(
        &mut self,
        view: &View,
        rank: usize,
        tag: u64,
    ) -> Result<&mut Links, CollectiveError> {
        let n = view.size();
        if self.links.as_ref().is_none_or(|l| l.epoch != view.epoch) {
            self.links = None;
            let timeout = self.config.io_timeout;
            let right = &view.members[(rank + 1) % n];
            let left = &view.members[(rank + n - 1) % n];
            let right_stream = connect(&right.addr, view.epoch, &self.config.member, timeout)
                .await
                .map_err(|e| {
                    self.peer_error(view, tag, right, format!("cannot be reached: {e}"))
                })?;
            // The left neighbour connects when it reaches its first
            // collective of the epoch: waited for as it is to arrive.
            let mut views = self.view_rx.clone();
            let epoch = view.epoch;
            let arrival = self.config.arrival_timeout;
            let linked = tokio::select! {
                linked = self.left_link(epoch, &left.id, arrival) => linked,
                _ = views.wait_for(|v| v.as_ref().is_some_and(|v| v.epoch > epoch)) => {
                    return Err(CollectiveError::Superseded {
                        group: self.config.name.clone(),
                        epoch,
                        root: (rank + n - 1) % n,
                    });
                }
            };
            let left_stream = linked.map_err(|detail| self.peer_error(view, tag, left, detail))?;
            self.links = Some(Links {
                epoch: view.epoch,
                right: right_stream,
                left: left_stream,
            });
        }
        Ok(self.links.as_mut().expect("set above"))
    }

    async fn pass_along(
        &mut self,
        view: &View,
        rank: usize,
        tag: u64,
        root: usize,
        data: &mut Vec<u8>,
        patient: bool,
    ) -> Result<(), CollectiveError> {
        const PIECE: usize = 1 << 20;
        let n = view.size();
        let left = view.members[(rank + n - 1) % n].clone();
        let timeout = self.config.io_timeout;
        let sends = (rank + 1) % n != root;
        let receives = rank != root;
        let mut views = self.view_rx.clone();
        let group = self.config.name.clone();
        let links = self.links(view, rank, tag).await?;
        let mut head = [0u8; 16];
        if receives && patient {
            let epoch = view.epoch;
            tokio::select! {
                read = links.left.read_exact(&mut head) => {
                    if let Err(e) = read {
                        return Err(peer_error(&group, view, tag, &left, format!("failed: {e}")));
                    }
                }
                _ = views.wait_for(|v| v.as_ref().is_some_and(|v| v.epoch > epoch)) => {
                    return Err(CollectiveError::Superseded { group, epoch, root });
                }
            }
        }
        let moved = tokio::time::timeout(timeout, async {
            if !receives {
                let mut head = Vec::with_capacity(16);
                head.extend_from_slice(&tag.to_be_bytes());
                head.extend_from_slice(&(data.len() as u64).to_be_bytes());
                links.right.write_all(&head).await?;
                return links.right.write_all(data).await;
            }
            if !patient {
                links.left.read_exact(&mut head).await?;
            }
            let their_tag = u64::from_be_bytes(head[..8].try_into().expect("8 bytes"));
            let len = u64::from_be_bytes(head[8..].try_into().expect("8 bytes")) as usize;
            if their_tag != tag {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::InvalidData,
                    format!("is broadcasting step {their_tag}, this member expects step {tag}"),
                ));
            }
            data.clear();
            data.resize(len, 0);
            if sends {
                links.right.write_all(&head).await?;
            }
            // Each piece is forwarded as it arrives.
            let mut at = 0;
            while at < len {
                let end = (at + PIECE).min(len);
                links.left.read_exact(&mut data[at..end]).await?;
                if sends {
                    links.right.write_all(&data[at..end]).await?;
                }
                at = end;
            }
            Ok(())
        })
        .await;
        match moved {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(self.peer_error(view, tag, &left, format!("failed: {e}"))),
            Err(_) => Err(self.peer_error(view, tag, &left, format!("was silent for {timeout:?}"))),
        }
    }

    async fn ring(
        &mut self,
        view: &View,
        rank: usize,
        tag: u64,
        data: &mut [f32],
    ) -> Result<(), CollectiveError> {
        let n = view.size();
        let left_rank = (rank + n - 1) % n;
        let left = &view.members[left_rank];
        let timeout = self.config.io_timeout;
        let arrival = self.config.arrival_timeout;
        let group = self.config.name.clone();
        let mut views = self.view_rx.clone();
        let peer_error = |peer: &Member, detail| peer_error(&group, view, tag, peer, detail);
        let links = self.links(view, rank, tag).await?;

        // Every member says what it is reducing, and the words go round
        // the ring (n - 1 hops): once they are back, every member has
        // arrived, and the data rounds below wait on transfers alone. The
        // wait for a slower member to arrive lasts while the view stands
        // (its lease says it is alive), up to `arrival_timeout`.
        let header = [tag, data.len() as u64];
        let mut passing = header;
        for _ in 0..n - 1 {
            let mut got = [0u8; 16];
            let out: Vec<u8> = passing.iter().flat_map(|x| x.to_be_bytes()).collect();
            let epoch = view.epoch;
            let exchanged = tokio::select! {
                exchanged = tokio::time::timeout(arrival, async {
                    tokio::try_join!(links.right.write_all(&out), links.left.read_exact(&mut got))
                }) => exchanged,
                _ = views.wait_for(|v| v.as_ref().is_some_and(|v| v.epoch > epoch)) => {
                    return Err(CollectiveError::Superseded {
                        group: group.clone(),
                        epoch,
                        root: left_rank,
                    });
                }
            };
            match exchanged {
                Ok(Ok(_)) => {}
                Ok(Err(e)) => return Err(peer_error(left, format!("failed: {e}"))),
                Err(_) => {
                    return Err(peer_error(
                        left,
                        format!("did not arrive within {arrival:?}"),
                    ))
                }
            }
            let theirs: [u64; 2] = std::array::from_fn(|i| {
                u64::from_be_bytes(got[8 * i..8 * i + 8].try_into().expect("8 bytes"))
            });
            if theirs != header {
                return Err(peer_error(
                    left,
                    format!(
                        "passes on step {} of {} values, this member step {tag} of {}",
                        theirs[0],
                        theirs[1],
                        data.len()
                    ),
                ));
            }
            passing = theirs;
        }

        let len = data.len();
        let chunk = |i: usize| -> std::ops::Range<usize> { (i * len / n)..((i + 1) * len / n) };
        let mut recv: Vec<f32> = Vec::new();
        // Reduce-scatter: after round k, chunk (rank - k - 1) holds k + 2 terms.
        for phase in [Phase::ReduceScatter, Phase::AllGather] {
            for k in 0..n - 1 {
                let (send, take) = match phase {
                    Phase::ReduceScatter => ((rank + n - k) % n, (rank + 2 * n - k - 1) % n),
                    Phase::AllGather => ((rank + 1 + n - k) % n, (rank + n - k) % n),
                };
                let out = wire_bytes(&data[chunk(send)]);
                recv.resize(chunk(take).len(), 0.0);
                let moved = tokio::time::timeout(timeout, async {
                    tokio::try_join!(
                        links.right.write_all(&out),
                        links.left.read_exact(bytemuck::cast_slice_mut(&mut recv))
                    )
                })
                .await;
                match moved {
                    Ok(Ok(_)) => {}
                    Ok(Err(e)) => return Err(peer_error(left, format!("failed: {e}"))),
                    Err(_) => return Err(peer_error(left, format!("was silent for {timeout:?}"))),
                }
                from_wire(&mut recv);
                let target = &mut data[chunk(take)];
                match phase {
                    Phase::ReduceScatter => {
                        for (x, v) in target.iter_mut().zip(&recv) {
                            *x += v;
                        }
                    }
                    Phase::AllGather => target.copy_from_slice(&recv),
                }
            }
        }
        Ok(())
    }

    /// The connection from the left neighbour `left` for `epoch`, as the
    /// accept task handed it over.
    async fn left_link(
        &mut self,
        epoch: u64,
        left: &str,
        timeout: Duration,
    ) -> Result<TcpStream, String> {
        self.early.retain(|(e, _, _)| *e >= epoch);
        if let Some(i) = self
            .early
            .iter()
            .position(|(e, from, _)| *e == epoch && from == left)
        {
            return Ok(self.early.swap_remove(i).2);
        }
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let next = tokio::time::timeout_at(deadline, self.incoming.recv()).await;
            match next {
                Ok(Some((e, from, stream))) if e == epoch && from == left => return Ok(stream),
                Ok(Some((e, from, stream))) if e > epoch => self.early.push((e, from, stream)),
                Ok(Some(_)) => {} // an older epoch's, or a stranger's
                Ok(None) => return Err("group closed".into()),
                Err(_) => return Err(format!("did not connect within {timeout:?}")),
            }
        }
    }
}

/// A neighbour's failure inside a collective of `view` on step `tag`.
fn peer_error(
    group: &str,
    view: &View,
    tag: u64,
    peer: &Member,
    detail: String,
) -> CollectiveError {
    CollectiveError::Peer {
        group: group.to_string(),
        epoch: view.epoch,
        tag,
        peer: peer.id.clone(),
        detail,
    }
}

#[derive(Clone, Copy)]
enum Phase {
    ReduceScatter,
    AllGather,
}

/// `xs` as the wire carries them, little-endian: the values' own bytes on
/// a little-endian host (no copy), converted on a big-endian one.
fn wire_bytes(xs: &[f32]) -> std::borrow::Cow<'_, [u8]> {
    if cfg!(target_endian = "little") {
        std::borrow::Cow::Borrowed(bytemuck::cast_slice(xs))
    } else {
        std::borrow::Cow::Owned(xs.iter().flat_map(|x| x.to_le_bytes()).collect())
    }
}

/// Values read from the wire as native bytes, made native f32s (nothing to
/// do on a little-endian host).
fn from_wire(xs: &mut [f32]) {
    if cfg!(target_endian = "big") {
        for x in xs {
            *x = f32::from_bits(u32::from_le(x.to_bits()));
        }
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

/// Connects to a neighbour's listener and says who is calling, for which epoch.
async fn connect(
    addr: &str,
    epoch: u64,
    me: &str,
    timeout: Duration,
) -> std::io::Result<TcpStream> {
    let mut stream = tokio::time::timeout(timeout, TcpStream::connect(addr))
        .await
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::TimedOut, "connect timed out"))??;
    stream.set_nodelay(true)?;
    let id = me.as_bytes();
    let mut hello = Vec::with_capacity(4 + 8 + 2 + id.len());
    hello.extend_from_slice(&MAGIC.to_be_bytes());
    hello.extend_from_slice(&epoch.to_be_bytes());
    hello.extend_from_slice(&(id.len() as u16).to_be_bytes());
    hello.extend_from_slice(id);
    stream.write_all(&hello).await?;
    Ok(stream)
}

/// Accepts neighbours: reads each one's greeting and hands the connection on.
async fn accept(listener: TcpListener, to: mpsc::Sender<(u64, String, TcpStream)>) {
    loop {
        let Ok((mut stream, _)) = listener.accept().await else {
            continue;
        };
        let to = to.clone();
        tokio::spawn(async move {
            let greeting = tokio::time::timeout(Duration::from_secs(10), async {
                let mut head = [0u8; 14];
                stream.read_exact(&mut head).await?;
                if u32::from_be_bytes(head[..4].try_into().expect("4 bytes")) != MAGIC {
                    return Err(std::io::Error::new(
                        std::io::ErrorKind::InvalidData,
                        "not a group member",
                    ));
                }
                let epoch = u64::from_be_bytes(head[4..12].try_into().expect("8 bytes"));
                let len = u16::from_be_bytes(head[12..14].try_into().expect("2 bytes")) as usize;
                let mut id = vec![0u8; len];
                stream.read_exact(&mut id).await?;
                stream.set_nodelay(true)?;
                Ok((epoch, String::from_utf8_lossy(&id).into_owned()))
            })
            .await;
            if let Ok(Ok((epoch, id))) = greeting {
                let _ = to.send((epoch, id, stream)).await;
            }
        });
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
