//! The out-of-band control plane: rank 0's rendezvous, a full TCP mesh between the job's ranks,
//! and the small host messages exchanged around GPU work (handles, addresses, barriers).
//!
//! This module owns the bootstrap sockets, the threads that read them, and the per-job secret
//! handshake that keeps other processes out. It must never block without a deadline, never let a
//! stranger's connection disturb the job, and never carry bulk or GPU data: it is a control plane.
//!
//! # Protocol
//!
//! Every TCP connection starts with the same handshake, the listener speaking first:
//!
//! ```text
//! listener  -> connector  hello:   "DBBOOT03" | nonce[32]                       (40 bytes)
//! connector -> listener   answer:  SHA-256(secret | nonce | "doorbell-bootstrap-v3")[32]
//!                                  | rank u64 | world_size u64 | listen_port u16
//!                                  | cnonce[32]                                   (82 bytes)
//! listener  -> connector  verdict: accept u8 | blamed_rank u64 | listener_remaining_ms u64
//!                                  | len u32 | payload[len]
//! ```
//!
//! All integers are little endian; `blamed_rank` is `u64::MAX` for none. A reject's payload is
//! its reason (UTF-8); an accept's is the listener's proof, SHA-256(secret | cnonce | nonce |
//! "doorbell-bootstrap-v3-listener") (32 bytes), which the connector checks before it trusts
//! anything the listener sends (rank 0's address table included): both sides prove the secret.
//! A listener handles each handshake in its own thread with a short read timeout, so a silent or
//! garbled connection only costs that thread, never the job.
//!
//! Rendezvous: rank 0 listens on `MASTER_ADDR:MASTER_PORT`; every other rank first opens its own
//! listener on an ephemeral port, then connects to rank 0 and reports that port in its answer.
//! When all ranks have joined, rank 0 sends each an address table (one `ip:port` line per rank,
//! the ip being the one rank 0 saw the connection come from). If the deadline passes first, rank
//! 0 sends every joined rank an abort naming the missing ranks instead. Then, for each pair
//! `0 < i < j`, rank `j` connects to rank `i`'s listener; the rendezvous connections serve as the
//! mesh links to rank 0. `connect` ends with a barrier, so it succeeds everywhere or fails.
//!
//! After the handshake every link carries frames:
//!
//! ```text
//! kind u32 | reserved u32 (0) | tag u64 | len u64 | payload[len] | mac[16]
//! ```
//!
//! `mac` is the first 16 bytes of HMAC-SHA-256(key, sender_rank u64 | frame_number u64 | header |
//! payload), where `key` = HMAC-SHA-256(secret, "doorbell-bootstrap-v3-frames" | nonce | cnonce)
//! belongs to this connection alone and `frame_number` counts the sender's frames on it from 0:
//! a frame altered, replayed, reordered, cut out or reflected on the way fails its check, and the
//! link counts as dead (the job fails naming the peer) instead of delivering it.
//!
//! `kind` separates user messages (tag = the user's tag) from all_gather contributions (tag = a
//! per-Bootstrap sequence number, so consecutive collectives never mix), the address table,
//! aborts (payload `blamed_rank u64 | reason`) and the goodbye a rank sends when it drops its
//! Bootstrap. One reader thread per link queues frames by `(peer, kind, tag)`; waiters take from
//! those queues under one mutex and condvar. A link that ends without a goodbye marks the peer
//! dead; waits on a dead peer fail at once, after any messages it sent before dying are taken.
//!
//! # Layout
//!
//! This file holds the public API. `rendezvous` runs rank 0's rendezvous and builds the mesh,
//! `handshake` authenticates each connection (with the digest from `job::auth`), `wire` encodes
//! and decodes everything sent, and `queues` holds what the reader threads deliver until a waiter
//! takes it.

mod config;
mod handshake;
mod queues;
mod rendezvous;
mod wire;

use crate::error::{Error, Result};
pub use config::BootstrapConfig;
pub use queues::PeerFailure;
use queues::{read_link, Abort, Chan, Failure, Shared};
pub use rendezvous::route_source;
use rendezvous::{listen_all, rendezvous_member, rendezvous_root, rendezvous_root_on};
use std::fmt;
use std::net::Shutdown;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};
use wire::{encode_abort, Conn, Kind, Sender};

/// Bound on writing a goodbye or an abort to a peer that may not be reading.
const FAREWELL_WRITE_TIMEOUT: Duration = Duration::from_secs(1);
/// Floor of a send's deadline: a send blocks only while the peer's socket buffer is full, and
/// giving up part way through a frame breaks the link, so a tiny timeout set for polling `recv`
/// must not apply to sends.
const MIN_WRITE_TIMEOUT: Duration = Duration::from_secs(1);

/// A connected job: one authenticated TCP link to every other rank.
///
/// All methods take `&self` and may be called from several threads. Collectives
/// ([`all_gather`](Self::all_gather), [`barrier`](Self::barrier)) must be called in the same order
/// on every rank; two threads running collectives concurrently on one rank have no defined order.
/// Received messages are queued without bound until taken.
pub struct Bootstrap {
    rank: usize,
    world_size: usize,
    local_rank: usize,
    local_world_size: usize,
    secret: Vec<u8>,
    timeout_ns: AtomicU64,
    next_gather: AtomicU64,
    shared: Arc<Shared>,
    /// Indexed by peer rank; `None` at this rank's own index.
    links: Vec<Option<Link>>,
    /// Silence after which a peer counts as failed (zero: never).
    heartbeat: Duration,
    heartbeat_thread: Option<Heartbeat>,
    /// Shrinks made from this job so far (each gets its own secret and port message).
    shrinks: AtomicU64,
    /// Collective calls this rank's communicator made (counted by its call checks); the goodbye
    /// carries the number, so a peer still waiting on calls past it can be told at once.
    calls: Arc<AtomicU64>,
}

/// The thread that sends heartbeats, and how to stop it.
struct Heartbeat {
    stop: Arc<(Mutex<bool>, std::sync::Condvar)>,
    thread: JoinHandle<()>,
}

struct Link {
    writer: Arc<Mutex<Sender>>,
    reader: Option<JoinHandle<()>>,
}

impl fmt::Debug for Bootstrap {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Bootstrap")
            .field("rank", &self.rank)
            .field("world_size", &self.world_size)
            .field("local_rank", &self.local_rank)
            .field("local_world_size", &self.local_world_size)
            .field("timeout", &self.timeout())
            .finish_non_exhaustive()
    }
}

impl Bootstrap {
    /// Joins the job described by `cfg`: rendezvous through rank 0, then the full mesh, then a
    /// barrier. Returns only when every rank is connected to every other, or fails naming the rank
    /// that did not come, was rejected, or died.
    pub fn connect(cfg: BootstrapConfig) -> Result<Bootstrap> {
        cfg.validate()?;
        let links = if cfg.world_size == 1 {
            vec![None]
        } else if cfg.rank == 0 {
            rendezvous_root(&cfg)?
        } else {
            rendezvous_member(&cfg)?
        };
        let bootstrap = Bootstrap::start(cfg, links)?;
        bootstrap.barrier()?;
        tracing::debug!(
            rank = bootstrap.rank,
            world_size = bootstrap.world_size,
            "bootstrap connected"
        );
        Ok(bootstrap)
    }

    /// Wraps the mesh links and starts one reader thread per link (and the heartbeat thread).
    fn start(cfg: BootstrapConfig, streams: Vec<Option<Conn>>) -> Result<Bootstrap> {
        let me = cfg.rank;
        let shared = Arc::new(Shared::new(me, cfg.world_size));
        let mut readers = Vec::with_capacity(streams.len());
        let mut links = Vec::with_capacity(streams.len());
        for stream in streams {
            match stream {
                None => {
                    readers.push(None);
                    links.push(None);
                }
                Some(stream) => {
                    let setup = stream
                        .set_read_timeout(None)
                        .and_then(|()| stream.set_nodelay(true))
                        .and_then(|()| stream.split());
                    let (writer, reader) =
                        setup.map_err(|e| Error::io("preparing a bootstrap link", e))?;
                    readers.push(Some(reader));
                    links.push(Some(Link {
                        writer: Arc::new(Mutex::new(writer)),
                        reader: None,
                    }));
                }
            }
        }
        let mut bootstrap = Bootstrap {
            rank: me,
            world_size: cfg.world_size,
            local_rank: cfg.local_rank,
            local_world_size: cfg.local_world_size,
            secret: cfg.secret,
            timeout_ns: AtomicU64::new(duration_ns(cfg.timeout)),
            next_gather: AtomicU64::new(0),
            shared,
            links,
            heartbeat: cfg.heartbeat,
            heartbeat_thread: None,
            shrinks: AtomicU64::new(0),
            calls: Arc::new(AtomicU64::new(0)),
        };
        // On error the partly built Bootstrap drops here: goodbyes, shutdowns, joins.
        for (peer, reader) in readers.into_iter().enumerate() {
            let Some(reader) = reader else { continue };
            let shared = Arc::clone(&bootstrap.shared);
            let handle = thread::Builder::new()
                .name(format!("doorbell-bs{me}-r{peer}"))
                .spawn(move || read_link(shared, peer, reader))
                .map_err(|e| Error::io("starting a bootstrap reader thread", e))?;
            if let Some(link) = bootstrap.links[peer].as_mut() {
                link.reader = Some(handle);
            }
        }
        if !cfg.heartbeat.is_zero() && cfg.world_size > 1 {
            bootstrap.heartbeat_thread = Some(bootstrap.start_heartbeat(cfg.heartbeat / 10)?);
        }
        Ok(bootstrap)
    }

    /// Sends a heartbeat on every link every `every` until stopped, so that a peer can tell a
    /// frozen rank (or a cut network) from a busy one. Each link's writer is shared with the
    /// callers' sends through its mutex.
    fn start_heartbeat(&self, every: Duration) -> Result<Heartbeat> {
        let stop = Arc::new((Mutex::new(false), std::sync::Condvar::new()));
        let writers: Vec<(usize, Arc<Mutex<Sender>>)> = self
            .links
            .iter()
            .enumerate()
            .filter_map(|(p, l)| l.as_ref().map(|l| (p, Arc::clone(&l.writer))))
            .collect();
        let shared = Arc::clone(&self.shared);
        let stop2 = Arc::clone(&stop);
        let every = every.max(Duration::from_millis(10));
        let thread = thread::Builder::new()
            .name(format!("doorbell-bs{}-hb", self.rank))
            .spawn(move || {
                let (flag, cv) = &*stop2;
                let mut stopped = lock(flag);
                while !*stopped {
                    drop(stopped);
                    for (peer, writer) in &writers {
                        if shared.gone_reason(*peer).is_some() {
                            continue;
                        }
                        // Under the link's writer lock, like every frame: frames never
                        // interleave.
                        let mut stream = lock(writer);
                        let sent = stream
                            .set_write_timeout(Some(FAREWELL_WRITE_TIMEOUT))
                            .and_then(|()| stream.send(Kind::Heartbeat, 0, &[]));
                        if let Err(e) = sent {
                            // A partly written frame would corrupt the link: close it for good.
                            let _ = stream.shutdown(Shutdown::Both);
                            shared.mark_gone(
                                *peer,
                                true,
                                format!("sending to it failed: {e}"),
                                None,
                            );
                        }
                    }
                    stopped = lock(flag);
                    if *stopped {
                        break;
                    }
                    stopped = cv
                        .wait_timeout(stopped, every)
                        .unwrap_or_else(PoisonError::into_inner)
                        .0;
                }
            })
            .map_err(|e| Error::io("starting the bootstrap heartbeat thread", e))?;
        Ok(Heartbeat { stop, thread })
    }

    /// The first failure this rank knows of, if any: a peer whose connection closed without a
    /// goodbye, a peer silent for longer than the heartbeat timeout (marked dead by this call),
    /// or an abort (this rank's own, or one a peer sent with its cause). Cheap; the
    /// communicator's watchdog calls it in a loop.
    pub fn health(&self) -> Option<PeerFailure> {
        let silence = (!self.heartbeat.is_zero()).then_some(self.heartbeat);
        self.shared.failure(silence)
    }

    /// Every peer that died or fell silent so far (not those that left with a goodbye), with
    /// what happened; [`health`](Self::health) names only the first failure.
    pub fn dead_peers(&self) -> Vec<(usize, String)> {
        self.shared.died()
    }

    /// Builds a new job of the ranks not in `failed`, renumbered in order (collective among the
    /// survivors; the failed ranks take no part). The lowest survivor becomes rank 0 of the new
    /// job: it listens on an ephemeral port and tells the others over this job's links, which
    /// still work after an abort. `local` is this rank's (local_rank, local_world_size) among the
    /// survivors. The new job has its own secret (this one's, the generation and the survivors).
    pub fn shrink(&self, failed: &[usize], local: (usize, usize)) -> Result<Bootstrap> {
        let survivors: Vec<usize> = (0..self.world_size)
            .filter(|r| !failed.contains(r))
            .collect();
        let Some(new_rank) = survivors.iter().position(|&r| r == self.rank) else {
            return Err(Error::invalid(
                "failed",
                format!("this rank ({}) is in the failed list", self.rank),
            ));
        };
        let generation = self.shrinks.fetch_add(1, Ordering::Relaxed);
        let mut secret = self.secret.clone();
        secret.extend_from_slice(format!("/shrink{generation}/{survivors:?}").as_bytes());
        let root = survivors[0];
        let mut cfg = BootstrapConfig {
            rank: new_rank,
            world_size: survivors.len(),
            local_rank: local.0,
            local_world_size: local.1.max(local.0 + 1),
            master_addr: String::new(),
            master_port: 0,
            secret,
            timeout: self.timeout(),
            heartbeat: self.heartbeat,
        };
        if survivors.len() == 1 {
            cfg.master_addr = "127.0.0.1".into();
            return Bootstrap::connect(cfg);
        }
        if self.rank == root {
            // On the address the survivors reach this rank at (the local end of its link to
            // the first of them), not every interface, unless DOORBELL_BOOTSTRAP_LISTEN_ALL=1.
            let ip = match survivors[1..].iter().find_map(|&p| {
                let link = self.links.get(p)?.as_ref()?;
                lock(&link.writer).local_addr().ok()
            }) {
                Some(a) if !listen_all()? => a.ip(),
                _ => std::net::IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED),
            };
            let listener = std::net::TcpListener::bind((ip, 0))
                .map_err(|e| Error::io("opening the shrunk job's rendezvous listener", e))?;
            let port = listener
                .local_addr()
                .map_err(|e| Error::io("reading the shrunk job's rendezvous port", e))?
                .port();
            for &peer in &survivors[1..] {
                let Some(link) = self.links.get(peer).and_then(Option::as_ref) else {
                    continue;
                };
                let mut stream = lock(&link.writer);
                let sent = stream
                    .set_write_timeout(Some(self.timeout().max(MIN_WRITE_TIMEOUT)))
                    .and_then(|()| stream.send(Kind::Shrink, generation, &port.to_le_bytes()));
                if let Err(e) = sent {
                    return Err(Error::Bootstrap {
                        me: self.rank,
                        rank: Some(peer),
                        why: format!("could not send the shrunk job's port: {e}"),
                    });
                }
            }
            cfg.master_addr = "127.0.0.1".into();
            let links = rendezvous_root_on(&cfg, listener)?;
            let bootstrap = Bootstrap::start(cfg, links)?;
            bootstrap.barrier()?;
            return Ok(bootstrap);
        }
        let timeout = self.timeout();
        let port = self
            .shared
            .take(
                root,
                Chan::Shrink(generation),
                Instant::now() + timeout,
                timeout,
            )
            .map_err(|f| f.into_error(self.rank))?;
        let port: [u8; 2] = port.as_slice().try_into().map_err(|_| Error::Bootstrap {
            me: self.rank,
            rank: Some(root),
            why: "sent a malformed shrink port".into(),
        })?;
        let root_ip = self
            .links
            .get(root)
            .and_then(Option::as_ref)
            .and_then(|l| lock(&l.writer).peer_addr().ok())
            .map(|a| a.ip())
            .ok_or_else(|| Error::Bootstrap {
                me: self.rank,
                rank: Some(root),
                why: "its address is unknown".into(),
            })?;
        cfg.master_addr = root_ip.to_string();
        cfg.master_port = u16::from_le_bytes(port);
        Bootstrap::connect(cfg)
    }

    /// Marks `peer` dead for `why` (a failure found outside the bootstrap, such as its process
    /// seen exiting), unless it already left; later waits on it fail, and [`health`](Self::health)
    /// reports it.
    pub fn mark_failed(&self, peer: usize, why: String) {
        if peer != self.rank && peer < self.world_size {
            self.shared.mark_gone(peer, true, why, None);
        }
    }

    /// The counter of collective calls this rank made (each collective object's call check
    /// counts into it); sent with the goodbye.
    pub fn call_counter(&self) -> Arc<AtomicU64> {
        self.calls.clone()
    }

    /// The collective calls `peer` had made when it left with a goodbye (`None`: it has not
    /// left cleanly, or its goodbye did not say).
    pub fn goodbye_calls(&self, peer: usize) -> Option<u64> {
        self.shared.goodbye_calls(peer)
    }

    /// True once `peer` left the job with a goodbye (dropped its bootstrap cleanly).
    pub fn said_goodbye(&self, peer: usize) -> bool {
        self.shared.said_goodbye(peer)
    }

    /// Blocks until a message arrives, a peer goes, or the job aborts, or `timeout` passes.
    pub fn wait_for_change(&self, timeout: Duration) {
        self.shared.wait_change(timeout);
    }

    /// Records that this rank failed or gave up, blaming `blamed` (if any) for `why`, and tells
    /// every reachable peer at once, so their waits and watchdogs learn the cause now instead of
    /// at their deadlines. Later collectives of this bootstrap fail with the same cause.
    pub fn abort(&self, blamed: Option<usize>, why: &str) {
        self.abort_job(blamed, why);
    }

    /// This process's global rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of ranks in the job.
    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// This process's rank among the ranks on its host.
    pub fn local_rank(&self) -> usize {
        self.local_rank
    }

    /// Number of ranks on this host.
    pub fn local_world_size(&self) -> usize {
        self.local_world_size
    }

    /// The per-job secret; other modules derive names and proofs from it.
    pub fn secret(&self) -> &[u8] {
        &self.secret
    }

    /// The deadline applied to each wait from now on.
    pub fn timeout(&self) -> Duration {
        Duration::from_nanos(self.timeout_ns.load(Ordering::Relaxed))
    }

    /// Changes the deadline of later waits (and of waits that have not started yet).
    pub fn set_timeout(&self, t: Duration) {
        self.timeout_ns.store(duration_ns(t), Ordering::Relaxed);
    }

    /// Gives every rank's `data`, indexed by rank (this rank's own included). Fails naming a rank
    /// that died or did not contribute within the timeout; the failure is also sent to the other
    /// ranks, so their pending and later waits fail promptly with the same cause.
    pub fn all_gather(&self, data: &[u8]) -> Result<Vec<Vec<u8>>> {
        let seq = self.next_gather.fetch_add(1, Ordering::Relaxed);
        let timeout = self.timeout();
        let deadline = Instant::now() + timeout;
        for peer in self.peers() {
            if let Err(failure) = self.send_frame(peer, Kind::Gather, seq, data) {
                if failure.propagate {
                    self.abort_job(failure.blamed, &failure.why);
                }
                return Err(failure.into_error(self.rank));
            }
        }
        let mut parts: Vec<Option<Vec<u8>>> = vec![None; self.world_size];
        parts[self.rank] = Some(data.to_vec());
        if let Err(failure) = self.shared.collect(seq, &mut parts, deadline, timeout) {
            if failure.propagate {
                self.abort_job(failure.blamed, &failure.why);
            }
            return Err(failure.into_error(self.rank));
        }
        Ok(parts.into_iter().map(Option::unwrap_or_default).collect())
    }

    /// Returns when every rank has called `barrier` (an all_gather of nothing).
    pub fn barrier(&self) -> Result<()> {
        self.all_gather(&[]).map(drop)
    }

    /// The local IP address of this rank's bootstrap links: where peers reached it, so where they
    /// can reach other listeners of this process (the Ethernet transport's). `None` for a
    /// single-rank job.
    pub fn local_ip(&self) -> Option<std::net::IpAddr> {
        self.links.iter().flatten().find_map(|l| {
            l.writer
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .local_addr()
                .ok()
                .map(|a| a.ip())
        })
    }

    /// Sends `data` to `peer` under `tag`. Messages for one `(peer, tag)` arrive in order. Returns
    /// once the bytes are with the kernel; fails naming `peer` when it is gone, or when its socket
    /// stays full for the timeout (at least 1 s), which also closes the link.
    pub fn send(&self, peer: usize, tag: u64, data: &[u8]) -> Result<()> {
        self.check_peer(peer)?;
        if peer == self.rank {
            self.shared.deliver(peer, Chan::User(tag), data.to_vec());
            return Ok(());
        }
        self.send_frame(peer, Kind::User, tag, data)
            .map_err(|f| f.into_error(self.rank))
    }

    /// Takes the oldest message `peer` sent under `tag`, waiting up to the timeout. Fails at once
    /// when none is queued and `peer` is gone or the job was aborted.
    pub fn recv(&self, peer: usize, tag: u64) -> Result<Vec<u8>> {
        self.check_peer(peer)?;
        let timeout = self.timeout();
        self.shared
            .take(peer, Chan::User(tag), Instant::now() + timeout, timeout)
            .map_err(|f| f.into_error(self.rank))
    }

    fn check_peer(&self, peer: usize) -> Result<()> {
        if peer >= self.world_size {
            return Err(Error::invalid(
                "peer",
                format!("rank {peer} is not below world size {}", self.world_size),
            ));
        }
        Ok(())
    }

    fn peers(&self) -> impl Iterator<Item = usize> + '_ {
        (0..self.world_size).filter(move |&p| p != self.rank)
    }

    fn send_frame(
        &self,
        peer: usize,
        kind: Kind,
        tag: u64,
        data: &[u8],
    ) -> std::result::Result<(), Failure> {
        if let Some(why) = self.shared.gone_reason(peer) {
            // A peer that left after the job was aborted left because of the abort: report the
            // abort's culprit, not the peer.
            return Err(self
                .shared
                .recorded_abort()
                .unwrap_or_else(|| Failure::peer(peer, why)));
        }
        let Some(link) = self.links.get(peer).and_then(Option::as_ref) else {
            return Err(Failure::peer(peer, "no link to this rank".into()));
        };
        let mut stream = lock(&link.writer);
        let written = stream
            .set_write_timeout(Some(self.timeout().max(MIN_WRITE_TIMEOUT)))
            .and_then(|()| stream.send(kind, tag, data));
        if let Err(e) = written {
            // A partly written frame would corrupt the link: close it for good.
            let _ = stream.shutdown(Shutdown::Both);
            drop(stream);
            let why = format!("sending to it failed: {e}");
            self.shared.mark_gone(peer, true, why.clone(), None);
            return Err(Failure::peer(peer, why));
        }
        Ok(())
    }

    /// Records that this rank gave up on a collective and tells every reachable peer, so that
    /// their waits fail now, naming the same culprit, instead of at their deadlines.
    fn abort_job(&self, blamed: Option<usize>, why: &str) {
        self.shared.set_aborted(Abort {
            from: self.rank,
            blamed,
            why: why.to_string(),
        });
        let payload = encode_abort(blamed, why);
        for peer in self.peers() {
            if self.shared.gone_reason(peer).is_some() {
                continue;
            }
            if let Some(link) = self.links.get(peer).and_then(Option::as_ref) {
                let mut stream = lock(&link.writer);
                let _ = stream.set_write_timeout(Some(FAREWELL_WRITE_TIMEOUT));
                let _ = stream.send(Kind::Abort, 0, &payload);
            }
        }
    }
}

impl Drop for Bootstrap {
    fn drop(&mut self) {
        if let Some(hb) = self.heartbeat_thread.take() {
            *lock(&hb.stop.0) = true;
            hb.stop.1.notify_all();
            let _ = hb.thread.join();
        }
        // A rank that leaves a job that was aborted passes the abort on instead of a goodbye, so
        // a peer that notices this rank's departure before the original abort still blames the
        // rank the job failed on, not this one.
        let relay = self
            .shared
            .abort_note()
            .map(|(blamed, why)| encode_abort(blamed, &why));
        for (peer, link) in self.links.iter().enumerate() {
            let Some(link) = link else { continue };
            let mut stream = lock(&link.writer);
            if self.shared.gone_reason(peer).is_none() {
                let _ = stream.set_write_timeout(Some(FAREWELL_WRITE_TIMEOUT));
                let _ = match &relay {
                    Some(payload) => stream.send(Kind::Abort, 0, payload),
                    None => stream.send(
                        Kind::Goodbye,
                        0,
                        &self.calls.load(Ordering::Relaxed).to_le_bytes(),
                    ),
                };
            }
            // Wakes this link's reader thread, which is blocked in read.
            let _ = stream.shutdown(Shutdown::Both);
        }
        for link in self.links.iter_mut().flatten() {
            if let Some(handle) = link.reader.take() {
                let _ = handle.join();
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Small helpers the submodules share.

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // No code path panics while holding these locks; if one ever did, the data is still usable.
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Sorted ranks with runs folded: [0, 1, 2, 5] -> "0-2, 5".
fn fmt_ranks(ranks: &[usize]) -> String {
    let mut out: Vec<String> = Vec::new();
    let mut i = 0;
    while i < ranks.len() {
        let mut j = i;
        while j + 1 < ranks.len() && ranks[j + 1] == ranks[j] + 1 {
            j += 1;
        }
        out.push(if j > i {
            format!("{}-{}", ranks[i], ranks[j])
        } else {
            ranks[i].to_string()
        });
        i = j + 1;
    }
    out.join(", ")
}

fn duration_ns(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rank_lists_fold_runs() {
        assert_eq!(fmt_ranks(&[0, 1, 2, 5, 7, 8]), "0-2, 5, 7-8");
        assert_eq!(fmt_ranks(&[]), "");
    }

    #[test]
    fn config_debug_hides_the_secret() {
        let shown = format!(
            "{:?}",
            BootstrapConfig {
                rank: 0,
                world_size: 1,
                local_rank: 0,
                local_world_size: 1,
                master_addr: "h".into(),
                master_port: 1,
                secret: b"s3cret".to_vec(),
                timeout: Duration::from_secs(1),
                heartbeat: Duration::ZERO,
            }
        );
        assert!(
            !shown.contains("s3cret") && shown.contains("6 bytes"),
            "{shown}"
        );
    }

    #[test]
    fn timeouts_past_a_year_are_refused_not_panics() {
        let cfg = |timeout: Duration, heartbeat: Duration| BootstrapConfig {
            rank: 0,
            world_size: 1,
            local_rank: 0,
            local_world_size: 1,
            master_addr: "127.0.0.1".into(),
            master_port: 1,
            secret: b"s".to_vec(),
            timeout,
            heartbeat,
        };
        let year = crate::job::config::MAX_TIMEOUT;
        assert!(cfg(year, year).validate().is_ok());
        for (c, what) in [
            (cfg(Duration::MAX, Duration::ZERO), "timeout"),
            (cfg(Duration::from_secs(1), Duration::MAX), "heartbeat"),
        ] {
            let e = Bootstrap::connect(c).expect_err("refused").to_string();
            assert!(e.contains(what) && e.contains("longer than a year"), "{e}");
        }
    }
}
