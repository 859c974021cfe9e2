//! The ring over direct TCP links between neighbours: all-reduce
//! (reduce-scatter, then all-gather) and broadcast, the links of an epoch
//! and the greeting that opens each (see the parent module's docs).

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;

use super::{CollectiveError, Group, Member, View};

/// First bytes of every connection between members.
const MAGIC: u32 = 0x7265_6c61; // "rela"

/// The ring links of one epoch: to the right neighbour and from the left.
pub(super) struct Links {
    epoch: u64,
    right: TcpStream,
    left: TcpStream,
}

impl Group {
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
pub(super) async fn accept(listener: TcpListener, to: mpsc::Sender<(u64, String, TcpStream)>) {
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
