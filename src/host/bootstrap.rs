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
//! listener  -> connector  hello:   "DBBOOT01" | nonce[32]                       (40 bytes)
//! connector -> listener   answer:  SHA-256(secret | nonce | "doorbell-bootstrap-v1")[32]
//!                                  | rank u64 | world_size u64 | listen_port u16  (50 bytes)
//! listener  -> connector  verdict: accept u8 | blamed_rank u64 | listener_remaining_ms u64
//!                                  | reason_len u32 | reason (UTF-8)
//! ```
//!
//! All integers are little endian; `blamed_rank` is `u64::MAX` for none. A listener handles each
//! handshake in its own thread with a short read timeout, so a silent or garbled connection only
//! costs that thread, never the job.
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
//! kind u32 | reserved u32 (0) | tag u64 | len u64 | payload[len]
//! ```
//!
//! `kind` separates user messages (tag = the user's tag) from all_gather contributions (tag = a
//! per-Bootstrap sequence number, so consecutive collectives never mix), the address table,
//! aborts (payload `blamed_rank u64 | reason`) and the goodbye a rank sends when it drops its
//! Bootstrap. One reader thread per link queues frames by `(peer, kind, tag)`; waiters take from
//! those queues under one mutex and condvar. A link that ends without a goodbye marks the peer
//! dead; waits on a dead peer fail at once, after any messages it sent before dying are taken.

use crate::config::{LaunchEnv, Settings};
use crate::error::{Error, Result};
use sha2::{Digest, Sha256};
use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::io::{self, Read, Write};
use std::net::{
    IpAddr, Ipv4Addr, Ipv6Addr, Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs,
};
use std::ops::Range;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

const HELLO_MAGIC: &[u8; 8] = b"DBBOOT01";
const AUTH_LABEL: &[u8] = b"doorbell-bootstrap-v1";
const NONCE_LEN: usize = 32;
const DIGEST_LEN: usize = 32;
const HELLO_LEN: usize = HELLO_MAGIC.len() + NONCE_LEN;
const ANSWER_LEN: usize = DIGEST_LEN + 8 + 8 + 2;
const VERDICT_HEAD_LEN: usize = 1 + 8 + 8 + 4;
const MAX_REASON_LEN: usize = 4096;
const HEADER_LEN: usize = 24;
/// Frames up to this size are copied behind their header and written with one call.
const SMALL_FRAME: usize = 64 * 1024;
/// Cap on a listener's wait for one connector's answer: strangers cost at most this.
const HANDSHAKE_TIMEOUT_CAP: Duration = Duration::from_secs(5);
/// How often an accept loop looks at its stop flag.
const ACCEPT_POLL: Duration = Duration::from_millis(20);
/// Extra time a rank waits for rank 0's verdict beyond rank 0's own deadline.
const ABORT_MARGIN: Duration = Duration::from_secs(1);
/// Bound on writing a goodbye or an abort to a peer that may not be reading.
const FAREWELL_WRITE_TIMEOUT: Duration = Duration::from_secs(1);
/// Floor of a send's deadline: a send blocks only while the peer's socket buffer is full, and
/// giving up part way through a frame breaks the link, so a tiny timeout set for polling `recv`
/// must not apply to sends.
const MIN_WRITE_TIMEOUT: Duration = Duration::from_secs(1);
const NO_RANK: u64 = u64::MAX;

/// Where this rank sits in the job and how to reach rank 0.
#[derive(Clone, PartialEq, Eq)]
pub struct BootstrapConfig {
    /// Global rank of this process.
    pub rank: usize,
    /// Number of ranks in the job.
    pub world_size: usize,
    /// Rank among the processes on this host.
    pub local_rank: usize,
    /// Number of processes on this host.
    pub local_world_size: usize,
    /// Host name or IP where rank 0 listens.
    pub master_addr: String,
    /// Port where rank 0 listens.
    pub master_port: u16,
    /// Per-job secret every rank shares; connections that cannot prove it are dropped.
    pub secret: Vec<u8>,
    /// Deadline of every bootstrap wait.
    pub timeout: Duration,
}

impl fmt::Debug for BootstrapConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BootstrapConfig")
            .field("rank", &self.rank)
            .field("world_size", &self.world_size)
            .field("local_rank", &self.local_rank)
            .field("local_world_size", &self.local_world_size)
            .field("master_addr", &self.master_addr)
            .field("master_port", &self.master_port)
            .field("secret", &format_args!("<{} bytes>", self.secret.len()))
            .field("timeout", &self.timeout)
            .finish()
    }
}

impl BootstrapConfig {
    /// Reads the launcher's variables ([`LaunchEnv::from_env`]) and the bootstrap timeout
    /// ([`Settings::from_env`]). Fails when no launcher variables are set.
    pub fn from_env() -> Result<Self> {
        let env = LaunchEnv::from_env()?.ok_or_else(|| {
            Error::invalid(
                "RANK/WORLD_SIZE",
                "no launcher variables are set: start the program with torchrun, srun, mpirun, \
                 or doorbell's launch::rank_or_spawn",
            )
        })?;
        let settings = Settings::from_env()?;
        Ok(Self::from_launch(&env, &settings))
    }

    /// Builds the configuration from already parsed launcher variables and settings.
    pub fn from_launch(env: &LaunchEnv, settings: &Settings) -> Self {
        BootstrapConfig {
            rank: env.rank,
            world_size: env.world_size,
            local_rank: env.local_rank,
            local_world_size: env.local_world_size,
            master_addr: env.master_addr.clone(),
            master_port: env.master_port,
            secret: env.secret.clone(),
            timeout: settings.bootstrap_timeout,
        }
    }

    fn validate(&self) -> Result<()> {
        if self.world_size == 0 || self.rank >= self.world_size {
            return Err(Error::invalid(
                "rank",
                format!(
                    "rank {} is not below world size {}",
                    self.rank, self.world_size
                ),
            ));
        }
        if self.local_world_size == 0 || self.local_rank >= self.local_world_size {
            return Err(Error::invalid(
                "local_rank",
                format!(
                    "local rank {} is not below local world size {}",
                    self.local_rank, self.local_world_size
                ),
            ));
        }
        if self.secret.is_empty() {
            return Err(Error::invalid(
                "secret",
                "the job secret is empty; set DOORBELL_JOB_SECRET",
            ));
        }
        if self.timeout.is_zero() {
            return Err(Error::invalid(
                "timeout",
                "a zero bootstrap timeout fails every wait; set DOORBELL_BOOTSTRAP_TIMEOUT_S",
            ));
        }
        Ok(())
    }
}

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
}

struct Link {
    writer: Mutex<TcpStream>,
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

    /// Wraps the mesh links and starts one reader thread per link.
    fn start(cfg: BootstrapConfig, streams: Vec<Option<TcpStream>>) -> Result<Bootstrap> {
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
                        .and_then(|()| stream.try_clone());
                    let reader = setup.map_err(|e| Error::io("preparing a bootstrap link", e))?;
                    readers.push(Some(reader));
                    links.push(Some(Link {
                        writer: Mutex::new(stream),
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
        Ok(bootstrap)
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
                self.abort_job(failure.blamed, &failure.why);
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
            return Err(Failure::peer(peer, why));
        }
        let Some(link) = self.links.get(peer).and_then(Option::as_ref) else {
            return Err(Failure::peer(peer, "no link to this rank".into()));
        };
        let mut stream = lock(&link.writer);
        let written = stream
            .set_write_timeout(Some(self.timeout().max(MIN_WRITE_TIMEOUT)))
            .and_then(|()| write_frame(&mut *stream, kind, tag, data));
        if let Err(e) = written {
            // A partly written frame would corrupt the link: close it for good.
            let _ = stream.shutdown(Shutdown::Both);
            drop(stream);
            let why = format!("sending to it failed: {e}");
            self.shared.mark_gone(peer, true, why.clone());
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
                let _ = write_frame(&mut *stream, Kind::Abort, 0, &payload);
            }
        }
    }
}

impl Drop for Bootstrap {
    fn drop(&mut self) {
        for (peer, link) in self.links.iter().enumerate() {
            let Some(link) = link else { continue };
            let stream = lock(&link.writer);
            if self.shared.gone_reason(peer).is_none() {
                let _ = stream.set_write_timeout(Some(FAREWELL_WRITE_TIMEOUT));
                let _ = write_frame(&mut &*stream, Kind::Goodbye, 0, &[]);
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
// Queues shared between reader threads and waiters.

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Chan {
    User(u64),
    Gather(u64),
}

struct Abort {
    from: usize,
    blamed: Option<usize>,
    why: String,
}

struct Gone {
    /// True when the link ended without a goodbye (crash, exit, reset, protocol error).
    died: bool,
    why: String,
}

/// Why a wait or send failed, and whether the other ranks should hear about it.
struct Failure {
    blamed: Option<usize>,
    why: String,
    /// False when the failure is itself an abort another rank sent.
    propagate: bool,
}

impl Failure {
    fn peer(peer: usize, why: String) -> Failure {
        Failure {
            blamed: Some(peer),
            why,
            propagate: true,
        }
    }

    fn into_error(self, me: usize) -> Error {
        Error::Bootstrap {
            me,
            rank: self.blamed,
            why: self.why,
        }
    }
}

struct State {
    queues: HashMap<(usize, Chan), VecDeque<Vec<u8>>>,
    gone: Vec<Option<Gone>>,
    aborted: Option<Abort>,
}

struct Shared {
    me: usize,
    state: Mutex<State>,
    arrived: Condvar,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // No code path panics while holding these locks; if one ever did, the data is still usable.
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Shared {
    fn new(me: usize, world_size: usize) -> Shared {
        Shared {
            me,
            state: Mutex::new(State {
                queues: HashMap::new(),
                gone: (0..world_size).map(|_| None).collect(),
                aborted: None,
            }),
            arrived: Condvar::new(),
        }
    }

    fn deliver(&self, peer: usize, chan: Chan, data: Vec<u8>) {
        lock(&self.state)
            .queues
            .entry((peer, chan))
            .or_default()
            .push_back(data);
        self.arrived.notify_all();
    }

    fn mark_gone(&self, peer: usize, died: bool, why: String) {
        let mut st = lock(&self.state);
        if let Some(slot) = st.gone.get_mut(peer) {
            if slot.is_none() {
                *slot = Some(Gone { died, why });
            }
        }
        drop(st);
        self.arrived.notify_all();
    }

    fn gone_reason(&self, peer: usize) -> Option<String> {
        lock(&self.state)
            .gone
            .get(peer)
            .and_then(|g| g.as_ref().map(|g| g.why.clone()))
    }

    fn set_aborted(&self, abort: Abort) {
        let mut st = lock(&self.state);
        if st.aborted.is_none() {
            st.aborted = Some(abort);
        }
        drop(st);
        self.arrived.notify_all();
    }

    fn abort_failure(&self, abort: &Abort) -> Failure {
        let why = if abort.from == self.me {
            format!("an earlier collective on this rank failed: {}", abort.why)
        } else {
            format!("rank {} aborted the job: {}", abort.from, abort.why)
        };
        Failure {
            blamed: abort.blamed,
            why,
            propagate: false,
        }
    }

    fn pop(st: &mut State, peer: usize, chan: Chan) -> Option<Vec<u8>> {
        let queue = st.queues.get_mut(&(peer, chan))?;
        let message = queue.pop_front();
        if queue.is_empty() {
            st.queues.remove(&(peer, chan));
        }
        message
    }

    /// Waits for one message; queued messages win over a gone peer or an abort.
    fn take(
        &self,
        peer: usize,
        chan: Chan,
        deadline: Instant,
        timeout: Duration,
    ) -> std::result::Result<Vec<u8>, Failure> {
        let mut st = lock(&self.state);
        loop {
            if let Some(message) = Self::pop(&mut st, peer, chan) {
                return Ok(message);
            }
            if let Some(abort) = &st.aborted {
                return Err(self.abort_failure(abort));
            }
            if let Some(gone) = st.gone.get(peer).and_then(Option::as_ref) {
                return Err(Failure {
                    blamed: Some(peer),
                    why: gone.why.clone(),
                    propagate: false,
                });
            }
            let now = Instant::now();
            if now >= deadline {
                let what = match chan {
                    Chan::User(tag) => format!("message with tag {tag}"),
                    Chan::Gather(seq) => format!("all_gather contribution #{seq}"),
                };
                return Err(Failure {
                    blamed: Some(peer),
                    why: format!("sent no {what} within {}", fmt_duration(timeout)),
                    propagate: false,
                });
            }
            st = self
                .arrived
                .wait_timeout(st, deadline - now)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }

    /// Fills every empty slot of `parts` with that rank's contribution to all_gather `seq`.
    fn collect(
        &self,
        seq: u64,
        parts: &mut [Option<Vec<u8>>],
        deadline: Instant,
        timeout: Duration,
    ) -> std::result::Result<(), Failure> {
        let mut st = lock(&self.state);
        loop {
            let mut missing = Vec::new();
            for (peer, part) in parts.iter_mut().enumerate() {
                if part.is_none() {
                    *part = Self::pop(&mut st, peer, Chan::Gather(seq));
                    if part.is_none() {
                        missing.push(peer);
                    }
                }
            }
            if missing.is_empty() {
                return Ok(());
            }
            if let Some(abort) = &st.aborted {
                return Err(self.abort_failure(abort));
            }
            // A peer that died is the likelier cause than one that left cleanly (it may have left
            // because of the death), so name the dead one first.
            let gone = |died: bool| {
                missing.iter().find_map(|&p| match &st.gone[p] {
                    Some(g) if g.died == died => Some((p, g.why.clone())),
                    _ => None,
                })
            };
            if let Some((peer, why)) = gone(true).or_else(|| gone(false)) {
                return Err(Failure::peer(peer, why));
            }
            let now = Instant::now();
            if now >= deadline {
                let also = if missing.len() > 1 {
                    format!(" (missing too: ranks {})", fmt_ranks(&missing[1..]))
                } else {
                    String::new()
                };
                return Err(Failure::peer(
                    missing[0],
                    format!(
                        "sent no contribution to all_gather #{seq} within {}{also}",
                        fmt_duration(timeout)
                    ),
                ));
            }
            st = self
                .arrived
                .wait_timeout(st, deadline - now)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }
}

/// A link's reader thread: queues frames until the link ends, then records how it ended.
fn read_link(shared: Arc<Shared>, peer: usize, mut stream: TcpStream) {
    let (died, why) = loop {
        match read_frame(&mut stream) {
            Ok((Kind::User, tag, data)) => shared.deliver(peer, Chan::User(tag), data),
            Ok((Kind::Gather, seq, data)) => shared.deliver(peer, Chan::Gather(seq), data),
            Ok((Kind::Abort, _, data)) => {
                let (blamed, why) = decode_abort(&data);
                shared.set_aborted(Abort {
                    from: peer,
                    blamed,
                    why,
                });
            }
            Ok((Kind::Goodbye, ..)) => {
                break (
                    false,
                    "closed its bootstrap (the process finished or dropped it)".to_string(),
                )
            }
            Ok((Kind::Table, ..)) => {
                break (
                    true,
                    "sent an address table after the rendezvous (protocol error)".to_string(),
                )
            }
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => {
                break (
                    true,
                    "connection closed without a goodbye: the process exited or crashed"
                        .to_string(),
                )
            }
            Err(e) => break (true, format!("connection failed: {e}")),
        }
    };
    shared.mark_gone(peer, died, why);
}

// ---------------------------------------------------------------------------------------------
// Rendezvous and mesh.

/// What a connector says about itself in the handshake.
struct Ident<'a> {
    me: usize,
    world_size: usize,
    secret: &'a [u8],
    listen_port: u16,
}

/// An authenticated incoming connection.
struct Joined {
    rank: usize,
    stream: TcpStream,
    /// Where the connector's own listener is: the ip its connection came from, its port.
    listen_addr: SocketAddr,
}

struct AcceptState {
    claimed: Vec<bool>,
    /// Once set, every later handshake is rejected with this blame and reason.
    closed: Option<(Option<usize>, String)>,
}

struct AcceptCtx {
    me: usize,
    world_size: usize,
    secret: Vec<u8>,
    handshake_timeout: Duration,
    accept_from: Range<usize>,
    /// This listener's own deadline, told to connectors so they wait for its verdict long enough.
    deadline: Instant,
    state: Mutex<AcceptState>,
}

impl AcceptCtx {
    fn new(cfg: &BootstrapConfig, accept_from: Range<usize>, deadline: Instant) -> AcceptCtx {
        AcceptCtx {
            me: cfg.rank,
            world_size: cfg.world_size,
            secret: cfg.secret.clone(),
            handshake_timeout: cfg.timeout.min(HANDSHAKE_TIMEOUT_CAP),
            accept_from,
            deadline,
            state: Mutex::new(AcceptState {
                claimed: vec![false; cfg.world_size],
                closed: None,
            }),
        }
    }

    /// Checks an answer against the nonce this listener sent. Returns the connector's rank, or the
    /// blame and reason to reject it with.
    fn judge(
        &self,
        answer: &Answer,
        nonce: &[u8; NONCE_LEN],
    ) -> std::result::Result<usize, (Option<usize>, String)> {
        if !ct_eq(
            &answer.digest,
            &auth_digest(&self.secret, nonce, AUTH_LABEL),
        ) {
            return Err((
                None,
                "authentication failed: wrong job secret, or not a doorbell rank".to_string(),
            ));
        }
        if answer.world_size != self.world_size as u64 {
            return Err((
                None,
                format!(
                    "world size mismatch: the connecting rank has WORLD_SIZE={}, rank {} has {}",
                    answer.world_size, self.me, self.world_size
                ),
            ));
        }
        let rank = usize::try_from(answer.rank).unwrap_or(usize::MAX);
        if !self.accept_from.contains(&rank) {
            return Err((
                None,
                format!(
                    "rank {} may not connect to rank {}'s listener (expected ranks {}..{})",
                    answer.rank, self.me, self.accept_from.start, self.accept_from.end
                ),
            ));
        }
        Ok(rank)
    }
}

/// Accepts connections in a background thread and authenticates each in its own thread.
struct Acceptor {
    ctx: Arc<AcceptCtx>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
    joined: mpsc::Receiver<Joined>,
}

impl Acceptor {
    fn start(listener: TcpListener, ctx: AcceptCtx) -> Result<Acceptor> {
        listener
            .set_nonblocking(true)
            .map_err(|e| Error::io("configuring the bootstrap listener", e))?;
        let ctx = Arc::new(ctx);
        let stop = Arc::new(AtomicBool::new(false));
        let (tx, joined) = mpsc::channel();
        let thread = {
            let (ctx, stop) = (Arc::clone(&ctx), Arc::clone(&stop));
            thread::Builder::new()
                .name(format!("doorbell-bs{}-accept", ctx.me))
                .spawn(move || accept_loop(listener, ctx, stop, tx))
                .map_err(|e| Error::io("starting the bootstrap accept thread", e))?
        };
        Ok(Acceptor {
            ctx,
            stop,
            thread: Some(thread),
            joined,
        })
    }

    fn next(&self, deadline: Instant) -> Option<Joined> {
        let wait = deadline.checked_duration_since(Instant::now())?;
        self.joined.recv_timeout(wait).ok()
    }

    /// Rejects every later handshake; returns the connections that were accepted before.
    fn close(&self, blamed: Option<usize>, why: String) -> Vec<Joined> {
        lock(&self.ctx.state).closed = Some((blamed, why));
        // Handshake threads claim, reply and queue under the state lock, so after setting
        // `closed` every accepted connection is already queued.
        self.joined.try_iter().collect()
    }

    fn stop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

impl Drop for Acceptor {
    fn drop(&mut self) {
        self.stop();
    }
}

fn accept_loop(
    listener: TcpListener,
    ctx: Arc<AcceptCtx>,
    stop: Arc<AtomicBool>,
    tx: mpsc::Sender<Joined>,
) {
    while !stop.load(Ordering::Relaxed) {
        match wait_readable(listener.as_fd(), ACCEPT_POLL) {
            Ok(true) => {}
            Ok(false) => continue,
            Err(e) => {
                tracing::warn!(rank = ctx.me, "bootstrap listener poll failed: {e}");
                thread::sleep(ACCEPT_POLL);
                continue;
            }
        }
        loop {
            match listener.accept() {
                Ok((stream, from)) => {
                    let (ctx, tx) = (Arc::clone(&ctx), tx.clone());
                    let spawned = thread::Builder::new()
                        .name(format!("doorbell-bs{}-hs", ctx.me))
                        .spawn(move || serve_handshake(stream, from, &ctx, &tx));
                    if let Err(e) = spawned {
                        tracing::warn!("bootstrap: dropped a connection from {from}: {e}");
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) => {
                    // Out of descriptors or similar: back off, keep the listener.
                    tracing::warn!(rank = ctx.me, "bootstrap accept failed: {e}");
                    thread::sleep(ACCEPT_POLL);
                    break;
                }
            }
        }
    }
}

/// The listener's half of the handshake for one connection.
fn serve_handshake(
    mut stream: TcpStream,
    from: SocketAddr,
    ctx: &AcceptCtx,
    tx: &mpsc::Sender<Joined>,
) {
    let me = ctx.me;
    let result = (|| -> std::result::Result<(), String> {
        stream
            .set_nonblocking(false)
            .and_then(|()| stream.set_read_timeout(Some(ctx.handshake_timeout)))
            .and_then(|()| stream.set_write_timeout(Some(ctx.handshake_timeout)))
            .and_then(|()| stream.set_nodelay(true))
            .map_err(|e| format!("configuring the socket: {e}"))?;
        let nonce: [u8; NONCE_LEN] = random_bytes().map_err(|e| e.to_string())?;
        let mut hello = [0u8; HELLO_LEN];
        hello[..HELLO_MAGIC.len()].copy_from_slice(HELLO_MAGIC);
        hello[HELLO_MAGIC.len()..].copy_from_slice(&nonce);
        stream
            .write_all(&hello)
            .map_err(|e| format!("sending the challenge: {e}"))?;
        let mut buf = [0u8; ANSWER_LEN];
        stream.read_exact(&mut buf).map_err(|e| {
            format!(
                "no complete answer within {}: {e}",
                fmt_duration(ctx.handshake_timeout)
            )
        })?;
        let answer = decode_answer(&buf);
        let remaining = ctx.deadline.saturating_duration_since(Instant::now());
        let mut state = lock(&ctx.state);
        let verdict = match ctx.judge(&answer, &nonce) {
            Err(reject) => Err(reject),
            Ok(_) if state.closed.is_some() => Err(state.closed.clone().unwrap_or_default()),
            Ok(rank) if state.claimed[rank] => Err((
                None,
                format!(
                    "rank {rank} is already connected: two processes have the same rank \
                     (check RANK)"
                ),
            )),
            Ok(rank) => Ok(rank),
        };
        match verdict {
            Err((blamed, why)) => {
                drop(state);
                let _ = stream.write_all(&encode_verdict(&Verdict::Reject {
                    blamed,
                    why: why.as_str(),
                }));
                Err(why)
            }
            Ok(rank) => {
                stream
                    .write_all(&encode_verdict(&Verdict::Accept { remaining }))
                    .map_err(|e| format!("sending the accept to rank {rank}: {e}"))?;
                state.claimed[rank] = true;
                let listen_addr = SocketAddr::new(from.ip().to_canonical(), answer.listen_port);
                // The receiver is gone only once this listener gave up; then the stream closes.
                let _ = tx.send(Joined {
                    rank,
                    stream,
                    listen_addr,
                });
                Ok(())
            }
        }
    })();
    if let Err(why) = result {
        tracing::warn!(
            rank = me,
            "bootstrap: dropped a connection from {from}: {why}"
        );
    }
}

/// Why one attempt to reach a listener failed.
enum DialFail {
    /// Nothing answered yet, or the link broke: try again until the deadline.
    Retry(String),
    /// The listener answered and said no, or is not a doorbell bootstrap.
    Final(Error),
}

/// Connects to `peer`'s listener and authenticates, retrying with backoff until `deadline`.
/// Returns the stream and how long the listener said it would still wait.
fn dial(
    ident: &Ident<'_>,
    peer: usize,
    shown: &str,
    resolve: &dyn Fn() -> io::Result<Vec<SocketAddr>>,
    deadline: Instant,
) -> Result<(TcpStream, Duration)> {
    let mut backoff = Duration::from_millis(10);
    let mut last = String::from("no attempt finished");
    loop {
        match resolve() {
            Err(e) => last = format!("cannot resolve {shown}: {e}"),
            Ok(addrs) if addrs.is_empty() => last = format!("{shown} resolves to nothing"),
            Ok(addrs) => {
                for addr in addrs {
                    match dial_once(ident, peer, shown, addr, deadline) {
                        Ok(done) => return Ok(done),
                        Err(DialFail::Final(e)) => return Err(e),
                        Err(DialFail::Retry(why)) => last = why,
                    }
                }
            }
        }
        let now = Instant::now();
        if now >= deadline {
            return Err(Error::Bootstrap {
                me: ident.me,
                rank: Some(peer),
                why: format!(
                    "could not reach it at {shown} before the deadline: {last} (is rank {peer} \
                     running{})",
                    if peer == 0 {
                        ", and are MASTER_ADDR/MASTER_PORT right?"
                    } else {
                        "?"
                    }
                ),
            });
        }
        thread::sleep(backoff.min(deadline - now));
        backoff = (backoff * 2).min(Duration::from_millis(500));
    }
}

fn dial_once(
    ident: &Ident<'_>,
    peer: usize,
    shown: &str,
    addr: SocketAddr,
    deadline: Instant,
) -> std::result::Result<(TcpStream, Duration), DialFail> {
    let remaining = deadline.saturating_duration_since(Instant::now());
    let io_wait = remaining
        .min(HANDSHAKE_TIMEOUT_CAP)
        .max(Duration::from_millis(1));
    let retry = |what: &str, e: io::Error| DialFail::Retry(format!("{what} {addr}: {e}"));
    let mut stream =
        TcpStream::connect_timeout(&addr, io_wait).map_err(|e| retry("connecting to", e))?;
    stream
        .set_read_timeout(Some(io_wait))
        .and_then(|()| stream.set_write_timeout(Some(io_wait)))
        .and_then(|()| stream.set_nodelay(true))
        .map_err(|e| retry("configuring the socket to", e))?;
    let mut hello = [0u8; HELLO_LEN];
    stream
        .read_exact(&mut hello)
        .map_err(|e| retry("reading the challenge from", e))?;
    if &hello[..HELLO_MAGIC.len()] != HELLO_MAGIC {
        return Err(DialFail::Final(Error::Bootstrap {
            me: ident.me,
            rank: Some(peer),
            why: format!(
                "{shown} is not a doorbell bootstrap listener of this version (is another \
                 program using the port?)"
            ),
        }));
    }
    let answer = Answer {
        digest: auth_digest(ident.secret, &hello[HELLO_MAGIC.len()..], AUTH_LABEL),
        rank: ident.me as u64,
        world_size: ident.world_size as u64,
        listen_port: ident.listen_port,
    };
    stream
        .write_all(&encode_answer(&answer))
        .map_err(|e| retry("answering", e))?;
    match read_verdict(&mut stream) {
        Ok(Verdict::Accept { remaining }) => Ok((stream, remaining)),
        Ok(Verdict::Reject { blamed, why }) => Err(DialFail::Final(Error::Bootstrap {
            me: ident.me,
            rank: blamed,
            why: format!("rank {peer} at {shown} rejected this rank: {why}"),
        })),
        Err(e) => Err(retry("reading the verdict from", e)),
    }
}

fn unspecified(v6: bool) -> IpAddr {
    if v6 {
        IpAddr::V6(Ipv6Addr::UNSPECIFIED)
    } else {
        IpAddr::V4(Ipv4Addr::UNSPECIFIED)
    }
}

/// True when rank 0 can only be reached over IPv6; listeners then bind `[::]`.
fn wants_ipv6(addr: &str, port: u16) -> bool {
    let bare = addr.trim_start_matches('[').trim_end_matches(']');
    if let Ok(ip) = bare.parse::<IpAddr>() {
        return ip.is_ipv6();
    }
    match (bare, port).to_socket_addrs() {
        Ok(addrs) => {
            let addrs: Vec<_> = addrs.collect();
            !addrs.is_empty() && addrs.iter().all(SocketAddr::is_ipv6)
        }
        Err(_) => false,
    }
}

fn master_shown(cfg: &BootstrapConfig) -> String {
    format!("{}:{}", cfg.master_addr, cfg.master_port)
}

/// Rank 0: waits for every rank, then sends each the address table (or an abort).
fn rendezvous_root(cfg: &BootstrapConfig) -> Result<Vec<Option<TcpStream>>> {
    let n = cfg.world_size;
    let deadline = Instant::now() + cfg.timeout;
    let v6 = wants_ipv6(&cfg.master_addr, cfg.master_port);
    let bind_addr = SocketAddr::new(unspecified(v6), cfg.master_port);
    // std sets SO_REUSEADDR on Unix listeners, so a previous job's TIME_WAIT does not block us.
    let listener = TcpListener::bind(bind_addr).map_err(|e| Error::Bootstrap {
        me: 0,
        rank: None,
        why: format!(
            "cannot listen on {bind_addr} ({}): {e}; set MASTER_PORT to a free port",
            master_shown(cfg)
        ),
    })?;
    let mut acceptor = Acceptor::start(listener, AcceptCtx::new(cfg, 1..n, deadline))?;
    let mut joined: Vec<Option<Joined>> = (0..n).map(|_| None).collect();
    let mut count = 1;
    while count < n {
        let Some(j) = acceptor.next(deadline) else {
            break;
        };
        let rank = j.rank;
        if joined[rank].replace(j).is_none() {
            count += 1;
        }
    }
    let missing_of = |joined: &[Option<Joined>]| -> Vec<usize> {
        (1..n).filter(|&r| joined[r].is_none()).collect()
    };
    let describe = |joined: &[Option<Joined>]| -> (Vec<usize>, String) {
        let missing = missing_of(joined);
        let present: Vec<usize> = (0..n).filter(|&r| r == 0 || joined[r].is_some()).collect();
        let who = if missing.len() == 1 {
            format!("rank {}", missing[0])
        } else {
            format!("ranks {}", fmt_ranks(&missing))
        };
        let why = format!(
            "{who} did not join within {} (ranks joined: {})",
            fmt_duration(cfg.timeout),
            fmt_ranks(&present)
        );
        (missing, why)
    };
    let (missing, why) = describe(&joined);
    let late = if missing.is_empty() {
        acceptor.close(None, "the rendezvous is already complete".to_string())
    } else {
        acceptor.close(missing.first().copied(), why)
    };
    acceptor.stop();
    for j in late {
        let rank = j.rank;
        joined[rank] = Some(j);
    }
    let (missing, why) = describe(&joined);
    if let Some(&first) = missing.first() {
        let payload = encode_abort(Some(first), &why);
        for j in joined.iter_mut().flatten() {
            let _ = j.stream.set_write_timeout(Some(FAREWELL_WRITE_TIMEOUT));
            let _ = write_frame(&mut j.stream, Kind::Abort, 0, &payload);
        }
        return Err(Error::Bootstrap {
            me: 0,
            rank: Some(first),
            why,
        });
    }
    let mut table = vec![bind_addr; n];
    for j in joined.iter().flatten() {
        table[j.rank] = j.listen_addr;
    }
    let payload = encode_table(&table);
    let mut links: Vec<Option<TcpStream>> =
        joined.into_iter().map(|j| j.map(|j| j.stream)).collect();
    for rank in 1..n {
        let Some(stream) = links[rank].as_mut() else {
            continue;
        };
        let sent = stream
            .set_write_timeout(Some(cfg.timeout))
            .and_then(|()| write_frame(stream, Kind::Table, 0, &payload));
        if let Err(e) = sent {
            let why = format!("lost before it received the address table: {e}");
            let payload = encode_abort(Some(rank), &why);
            for other in links.iter_mut().flatten() {
                let _ = other.set_write_timeout(Some(FAREWELL_WRITE_TIMEOUT));
                let _ = write_frame(other, Kind::Abort, 0, &payload);
            }
            return Err(Error::Bootstrap {
                me: 0,
                rank: Some(rank),
                why,
            });
        }
    }
    Ok(links)
}

/// Ranks 1..n: join through rank 0, then connect to every lower rank and accept every higher one.
fn rendezvous_member(cfg: &BootstrapConfig) -> Result<Vec<Option<TcpStream>>> {
    let (me, n) = (cfg.rank, cfg.world_size);
    let deadline = Instant::now() + cfg.timeout;
    let v6 = wants_ipv6(&cfg.master_addr, cfg.master_port);
    let listener = TcpListener::bind(SocketAddr::new(unspecified(v6), 0))
        .map_err(|e| Error::io("opening this rank's bootstrap listener", e))?;
    let listen_port = listener
        .local_addr()
        .map_err(|e| Error::io("reading this rank's bootstrap listener address", e))?
        .port();
    let mut acceptor = Acceptor::start(listener, AcceptCtx::new(cfg, me + 1..n, deadline))?;
    let ident = Ident {
        me,
        world_size: n,
        secret: &cfg.secret,
        listen_port,
    };
    let shown = master_shown(cfg);
    let resolve = || -> io::Result<Vec<SocketAddr>> {
        let bare = cfg
            .master_addr
            .trim_start_matches('[')
            .trim_end_matches(']');
        Ok((bare, cfg.master_port).to_socket_addrs()?.collect())
    };
    let (mut root, root_remaining) = dial(&ident, 0, &shown, &resolve, deadline)?;
    // Rank 0 decides who is missing; wait for its word a little past its own deadline.
    let until = deadline.max(Instant::now() + root_remaining) + ABORT_MARGIN;
    let table = read_table(&mut root, cfg, until)?;

    let deadline = Instant::now() + cfg.timeout;
    let mut links: Vec<Option<TcpStream>> = (0..n).map(|_| None).collect();
    links[0] = Some(root);
    for (peer, &addr) in table.iter().enumerate().take(me).skip(1) {
        let resolve = move || -> io::Result<Vec<SocketAddr>> { Ok(vec![addr]) };
        let (stream, _) = dial(&ident, peer, &addr.to_string(), &resolve, deadline)?;
        links[peer] = Some(stream);
    }
    let mut waiting = n - me - 1;
    while waiting > 0 {
        let Some(j) = acceptor.next(deadline) else {
            break;
        };
        let rank = j.rank;
        if links[rank].replace(j.stream).is_none() {
            waiting -= 1;
        }
    }
    let missing: Vec<usize> = (me + 1..n).filter(|&r| links[r].is_none()).collect();
    let why = format!(
        "did not open its mesh connection to this rank within {} (did it die after the \
         rendezvous?)",
        fmt_duration(cfg.timeout)
    );
    for j in acceptor.close(missing.first().copied(), why.clone()) {
        let rank = j.rank;
        links[rank] = Some(j.stream);
    }
    acceptor.stop();
    if let Some(first) = (me + 1..n).find(|&r| links[r].is_none()) {
        return Err(Error::Bootstrap {
            me,
            rank: Some(first),
            why,
        });
    }
    Ok(links)
}

/// Reads rank 0's address table, or its abort, before `until`.
fn read_table(
    root: &mut TcpStream,
    cfg: &BootstrapConfig,
    until: Instant,
) -> Result<Vec<SocketAddr>> {
    let me = cfg.rank;
    let fail = |rank: Option<usize>, why: String| Error::Bootstrap { me, rank, why };
    let wait = until
        .saturating_duration_since(Instant::now())
        .max(Duration::from_millis(1));
    root.set_read_timeout(Some(wait))
        .map_err(|e| Error::io("configuring the link to rank 0", e))?;
    match read_frame(root) {
        Ok((Kind::Table, _, payload)) => decode_table(&payload, cfg.world_size).map_err(|why| {
            fail(
                Some(0),
                format!("rank 0 sent a malformed address table: {why}"),
            )
        }),
        Ok((Kind::Abort, _, payload)) => {
            let (blamed, why) = decode_abort(&payload);
            Err(fail(blamed, format!("rank 0 aborted the bootstrap: {why}")))
        }
        Ok((kind, ..)) => Err(fail(
            Some(0),
            format!("rank 0 sent {kind:?} instead of the address table (protocol error)"),
        )),
        Err(e)
            if matches!(
                e.kind(),
                io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
            ) =>
        {
            Err(fail(
                Some(0),
                format!(
                    "sent no address table within {} (is rank 0 stuck?)",
                    fmt_duration(wait)
                ),
            ))
        }
        Err(e) => Err(fail(
            Some(0),
            format!("connection lost before the address table arrived: {e}"),
        )),
    }
}

// ---------------------------------------------------------------------------------------------
// Wire formats.

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    User = 1,
    Gather = 2,
    Table = 3,
    Abort = 4,
    Goodbye = 5,
}

impl Kind {
    fn from_u32(v: u32) -> Option<Kind> {
        Some(match v {
            1 => Kind::User,
            2 => Kind::Gather,
            3 => Kind::Table,
            4 => Kind::Abort,
            5 => Kind::Goodbye,
            _ => return None,
        })
    }
}

fn encode_header(kind: Kind, tag: u64, len: u64) -> [u8; HEADER_LEN] {
    let mut h = [0u8; HEADER_LEN];
    h[0..4].copy_from_slice(&(kind as u32).to_le_bytes());
    h[8..16].copy_from_slice(&tag.to_le_bytes());
    h[16..24].copy_from_slice(&len.to_le_bytes());
    h
}

fn decode_header(h: &[u8; HEADER_LEN]) -> io::Result<(Kind, u64, u64)> {
    let word = |r: Range<usize>| {
        let mut b = [0u8; 8];
        b[..r.len()].copy_from_slice(&h[r]);
        u64::from_le_bytes(b)
    };
    let raw_kind = word(0..4) as u32;
    let kind = Kind::from_u32(raw_kind).ok_or_else(|| {
        io::Error::new(
            io::ErrorKind::InvalidData,
            format!("unknown frame kind {raw_kind}"),
        )
    })?;
    if word(4..8) != 0 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "nonzero reserved header field",
        ));
    }
    Ok((kind, word(8..16), word(16..24)))
}

fn write_frame(w: &mut impl Write, kind: Kind, tag: u64, payload: &[u8]) -> io::Result<()> {
    let header = encode_header(kind, tag, payload.len() as u64);
    if payload.len() <= SMALL_FRAME {
        let mut buf = Vec::with_capacity(HEADER_LEN + payload.len());
        buf.extend_from_slice(&header);
        buf.extend_from_slice(payload);
        w.write_all(&buf)
    } else {
        w.write_all(&header)?;
        w.write_all(payload)
    }
}

fn read_frame(r: &mut impl Read) -> io::Result<(Kind, u64, Vec<u8>)> {
    let mut header = [0u8; HEADER_LEN];
    r.read_exact(&mut header)?;
    let (kind, tag, len) = decode_header(&header)?;
    // Grow as bytes arrive rather than trusting `len` for one allocation.
    let mut payload = Vec::with_capacity(len.min(SMALL_FRAME as u64) as usize);
    r.take(len).read_to_end(&mut payload)?;
    if payload.len() as u64 != len {
        return Err(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            format!("frame ended after {} of {len} payload bytes", payload.len()),
        ));
    }
    Ok((kind, tag, payload))
}

fn encode_abort(blamed: Option<usize>, why: &str) -> Vec<u8> {
    let mut p = blamed.map_or(NO_RANK, |r| r as u64).to_le_bytes().to_vec();
    p.extend_from_slice(why.as_bytes());
    p
}

fn decode_abort(p: &[u8]) -> (Option<usize>, String) {
    if p.len() < 8 {
        return (None, "malformed abort message".to_string());
    }
    let mut b = [0u8; 8];
    b.copy_from_slice(&p[..8]);
    (
        rank_of(u64::from_le_bytes(b)),
        String::from_utf8_lossy(&p[8..]).into_owned(),
    )
}

fn rank_of(v: u64) -> Option<usize> {
    if v == NO_RANK {
        None
    } else {
        usize::try_from(v).ok()
    }
}

fn encode_table(table: &[SocketAddr]) -> Vec<u8> {
    let mut text = String::new();
    for addr in table {
        text.push_str(&addr.to_string());
        text.push('\n');
    }
    text.into_bytes()
}

fn decode_table(p: &[u8], world_size: usize) -> std::result::Result<Vec<SocketAddr>, String> {
    let text = std::str::from_utf8(p).map_err(|e| format!("not UTF-8: {e}"))?;
    let table = text
        .lines()
        .map(|l| {
            l.parse::<SocketAddr>()
                .map_err(|e| format!("bad address {l:?}: {e}"))
        })
        .collect::<std::result::Result<Vec<_>, _>>()?;
    if table.len() != world_size {
        return Err(format!("{} entries for {world_size} ranks", table.len()));
    }
    Ok(table)
}

struct Answer {
    digest: [u8; DIGEST_LEN],
    rank: u64,
    world_size: u64,
    listen_port: u16,
}

fn encode_answer(a: &Answer) -> [u8; ANSWER_LEN] {
    let mut b = [0u8; ANSWER_LEN];
    b[..32].copy_from_slice(&a.digest);
    b[32..40].copy_from_slice(&a.rank.to_le_bytes());
    b[40..48].copy_from_slice(&a.world_size.to_le_bytes());
    b[48..50].copy_from_slice(&a.listen_port.to_le_bytes());
    b
}

fn decode_answer(b: &[u8; ANSWER_LEN]) -> Answer {
    let mut digest = [0u8; DIGEST_LEN];
    digest.copy_from_slice(&b[..32]);
    let u64_at = |i: usize| {
        let mut w = [0u8; 8];
        w.copy_from_slice(&b[i..i + 8]);
        u64::from_le_bytes(w)
    };
    Answer {
        digest,
        rank: u64_at(32),
        world_size: u64_at(40),
        listen_port: u16::from_le_bytes([b[48], b[49]]),
    }
}

#[derive(Debug, PartialEq, Eq)]
enum Verdict<S> {
    Accept { remaining: Duration },
    Reject { blamed: Option<usize>, why: S },
}

fn encode_verdict(v: &Verdict<&str>) -> Vec<u8> {
    let (accept, blamed, remaining, why) = match v {
        Verdict::Accept { remaining } => (1u8, None, *remaining, ""),
        Verdict::Reject { blamed, why } => (0u8, *blamed, Duration::ZERO, *why),
    };
    let why = &why.as_bytes()[..why.len().min(MAX_REASON_LEN)];
    let mut b = Vec::with_capacity(VERDICT_HEAD_LEN + why.len());
    b.push(accept);
    b.extend_from_slice(&blamed.map_or(NO_RANK, |r| r as u64).to_le_bytes());
    let ms = u64::try_from(remaining.as_millis()).unwrap_or(u64::MAX);
    b.extend_from_slice(&ms.to_le_bytes());
    b.extend_from_slice(&(why.len() as u32).to_le_bytes());
    b.extend_from_slice(why);
    b
}

fn read_verdict(r: &mut impl Read) -> io::Result<Verdict<String>> {
    let mut h = [0u8; VERDICT_HEAD_LEN];
    r.read_exact(&mut h)?;
    let u64_at = |i: usize| {
        let mut w = [0u8; 8];
        w.copy_from_slice(&h[i..i + 8]);
        u64::from_le_bytes(w)
    };
    let len = u32::from_le_bytes([h[17], h[18], h[19], h[20]]) as usize;
    if len > MAX_REASON_LEN {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("verdict reason of {len} bytes"),
        ));
    }
    let mut why = vec![0u8; len];
    r.read_exact(&mut why)?;
    match h[0] {
        1 => Ok(Verdict::Accept {
            remaining: Duration::from_millis(u64_at(9)),
        }),
        0 => Ok(Verdict::Reject {
            blamed: rank_of(u64_at(1)),
            why: String::from_utf8_lossy(&why).into_owned(),
        }),
        other => Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("verdict byte {other}"),
        )),
    }
}

// ---------------------------------------------------------------------------------------------
// Small helpers shared with the other host modules.

/// SHA-256(secret | nonce | label): proves knowledge of the job secret for one challenge.
pub(crate) fn auth_digest(secret: &[u8], nonce: &[u8], label: &[u8]) -> [u8; DIGEST_LEN] {
    let mut h = Sha256::new();
    h.update(secret);
    h.update(nonce);
    h.update(label);
    h.finalize().into()
}

/// Compares two byte strings in time that depends only on their lengths.
pub(crate) fn ct_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// `N` bytes from the kernel's random source.
pub(crate) fn random_bytes<const N: usize>() -> Result<[u8; N]> {
    let mut b = [0u8; N];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut b))
        .map_err(|e| Error::io("reading /dev/urandom", e))?;
    Ok(b)
}

/// Lowercase hex of `bytes`.
pub(crate) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Waits up to `timeout` for `fd` to become readable (for a listener: a pending connection).
/// An interrupted wait counts as "not yet".
pub(crate) fn wait_readable(fd: BorrowedFd<'_>, timeout: Duration) -> io::Result<bool> {
    let mut pfd = libc::pollfd {
        fd: fd.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    let ms = libc::c_int::try_from(timeout.as_millis()).unwrap_or(libc::c_int::MAX);
    // SAFETY: `pfd` is a valid, exclusively borrowed pollfd for the whole call and nfds is 1;
    // `fd` is borrowed, so it stays open until poll returns.
    let rc = unsafe { libc::poll(&mut pfd, 1, ms) };
    if rc < 0 {
        let e = io::Error::last_os_error();
        if e.kind() == io::ErrorKind::Interrupted {
            return Ok(false);
        }
        return Err(e);
    }
    Ok(rc > 0)
}

/// "250 ms", "10 s", "2.5 s".
pub(crate) fn fmt_duration(d: Duration) -> String {
    if d < Duration::from_secs(1) {
        format!("{} ms", d.as_millis())
    } else if d.subsec_millis() == 0 {
        format!("{} s", d.as_secs())
    } else {
        format!("{:.1} s", d.as_secs_f64())
    }
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
    fn frames_round_trip() {
        let mut wire = Vec::new();
        write_frame(&mut wire, Kind::User, 7, b"hello").unwrap();
        let big = vec![0xabu8; SMALL_FRAME + 5];
        write_frame(&mut wire, Kind::Gather, u64::MAX, &big).unwrap();
        write_frame(&mut wire, Kind::Goodbye, 0, &[]).unwrap();
        let mut r = &wire[..];
        assert_eq!(
            read_frame(&mut r).unwrap(),
            (Kind::User, 7, b"hello".to_vec())
        );
        assert_eq!(read_frame(&mut r).unwrap(), (Kind::Gather, u64::MAX, big));
        assert_eq!(read_frame(&mut r).unwrap(), (Kind::Goodbye, 0, vec![]));
        let e = read_frame(&mut r).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::UnexpectedEof);
    }

    #[test]
    fn malformed_frames_are_errors_not_allocations() {
        let mut h = encode_header(Kind::User, 1, 10);
        h[0] = 99;
        let e = read_frame(&mut &h[..]).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidData, "{e}");
        let mut h = encode_header(Kind::User, 1, 10);
        h[5] = 1;
        assert!(read_frame(&mut &h[..]).is_err());
        // A huge announced length with a short body ends in EOF, not an allocation failure.
        let mut wire = encode_header(Kind::User, 1, u64::MAX / 2).to_vec();
        wire.extend_from_slice(b"short");
        let e = read_frame(&mut &wire[..]).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::UnexpectedEof, "{e}");
    }

    #[test]
    fn abort_and_table_payloads_round_trip() {
        assert_eq!(
            decode_abort(&encode_abort(Some(3), "rank 3 did not join")),
            (Some(3), "rank 3 did not join".to_string())
        );
        assert_eq!(
            decode_abort(&encode_abort(None, "x")),
            (None, "x".to_string())
        );
        assert_eq!(decode_abort(b"abc").0, None);
        let table: Vec<SocketAddr> = vec![
            "0.0.0.0:29500".parse().unwrap(),
            "10.1.2.3:40000".parse().unwrap(),
            "[fe80::1]:41000".parse().unwrap(),
        ];
        assert_eq!(decode_table(&encode_table(&table), 3).unwrap(), table);
        assert!(decode_table(&encode_table(&table), 4).is_err());
        assert!(decode_table(b"not an address\n", 1).is_err());
        assert!(decode_table(&[0xff, 0xfe], 1).is_err());
    }

    #[test]
    fn verdicts_round_trip() {
        let accept = encode_verdict(&Verdict::Accept {
            remaining: Duration::from_millis(1234),
        });
        assert_eq!(
            read_verdict(&mut &accept[..]).unwrap(),
            Verdict::Accept {
                remaining: Duration::from_millis(1234)
            }
        );
        let reject = encode_verdict(&Verdict::Reject {
            blamed: Some(5),
            why: "no",
        });
        assert_eq!(
            read_verdict(&mut &reject[..]).unwrap(),
            Verdict::Reject {
                blamed: Some(5),
                why: "no".to_string()
            }
        );
        let long = "x".repeat(MAX_REASON_LEN * 2);
        let capped = encode_verdict(&Verdict::Reject {
            blamed: None,
            why: &long,
        });
        assert_eq!(capped.len(), VERDICT_HEAD_LEN + MAX_REASON_LEN);
        let mut bad = reject.clone();
        bad[0] = 7;
        assert!(read_verdict(&mut &bad[..]).is_err());
    }

    fn ctx(me: usize, world_size: usize, from: Range<usize>) -> AcceptCtx {
        let cfg = BootstrapConfig {
            rank: me,
            world_size,
            local_rank: 0,
            local_world_size: 1,
            master_addr: "127.0.0.1".into(),
            master_port: 1,
            secret: b"s3cret".to_vec(),
            timeout: Duration::from_secs(1),
        };
        AcceptCtx::new(&cfg, from, Instant::now())
    }

    #[test]
    fn handshake_judges_secret_world_size_and_rank() {
        let ctx = ctx(0, 4, 1..4);
        let nonce = [9u8; NONCE_LEN];
        let good = |rank, world_size| Answer {
            digest: auth_digest(b"s3cret", &nonce, AUTH_LABEL),
            rank,
            world_size,
            listen_port: 5,
        };
        let round = |a: &Answer| decode_answer(&encode_answer(a));
        assert_eq!(ctx.judge(&round(&good(2, 4)), &nonce), Ok(2));
        let wrong_secret = Answer {
            digest: auth_digest(b"other", &nonce, AUTH_LABEL),
            ..good(2, 4)
        };
        let (_, why) = ctx.judge(&wrong_secret, &nonce).unwrap_err();
        assert!(why.contains("authentication"), "{why}");
        // The digest is bound to this nonce: a replayed answer fails.
        let (_, why) = ctx.judge(&good(2, 4), &[8u8; NONCE_LEN]).unwrap_err();
        assert!(why.contains("authentication"), "{why}");
        let (_, why) = ctx.judge(&good(2, 5), &nonce).unwrap_err();
        assert!(why.contains("WORLD_SIZE=5"), "{why}");
        for rank in [0, 4, u64::MAX] {
            assert!(ctx.judge(&good(rank, 4), &nonce).is_err());
        }
        let mesh = self::ctx(2, 4, 3..4);
        assert!(mesh.judge(&good(1, 4), &nonce).is_err());
        assert_eq!(mesh.judge(&good(3, 4), &nonce), Ok(3));
    }

    #[test]
    fn helpers() {
        assert!(ct_eq(b"abc", b"abc"));
        assert!(!ct_eq(b"abc", b"abd"));
        assert!(!ct_eq(b"abc", b"ab"));
        assert_eq!(fmt_ranks(&[0, 1, 2, 5, 7, 8]), "0-2, 5, 7-8");
        assert_eq!(fmt_ranks(&[]), "");
        assert_eq!(fmt_duration(Duration::from_millis(250)), "250 ms");
        assert_eq!(fmt_duration(Duration::from_secs(10)), "10 s");
        assert_eq!(fmt_duration(Duration::from_millis(2500)), "2.5 s");
        assert_eq!(hex(&[0, 0xab, 0x10]), "00ab10");
        let a: [u8; 32] = random_bytes().unwrap();
        let b: [u8; 32] = random_bytes().unwrap();
        assert_ne!(a, b);
        assert!(wants_ipv6("::1", 1));
        assert!(wants_ipv6("[::1]", 1));
        assert!(!wants_ipv6("127.0.0.1", 1));
    }

    #[test]
    fn config_debug_hides_the_secret() {
        let cfg = ctx(0, 1, 0..0);
        let shown = format!(
            "{:?}",
            BootstrapConfig {
                rank: cfg.me,
                world_size: 1,
                local_rank: 0,
                local_world_size: 1,
                master_addr: "h".into(),
                master_port: 1,
                secret: b"s3cret".to_vec(),
                timeout: Duration::from_secs(1),
            }
        );
        assert!(
            !shown.contains("s3cret") && shown.contains("6 bytes"),
            "{shown}"
        );
    }
}
