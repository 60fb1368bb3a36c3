//! Passing file descriptors between the job's processes on one host (`SCM_RIGHTS` over Unix
//! sockets), used to share CUDA VMM allocations exported as POSIX file descriptors.
//!
//! This module owns one server thread per process, the descriptors published through it, and the
//! challenge-response that keeps other processes out. It must never hand a descriptor to a
//! process of another user or one that cannot prove the job secret, never block without a
//! deadline, and never close or reuse a descriptor it does not own.
//!
//! # Protocol
//!
//! Each server listens on a Linux abstract-namespace Unix socket named
//! `doorbell-fd.<hex of SHA-256(secret | "doorbell-fd-name-v1"), 16 bytes>.<rank>`, so processes
//! find it only when they know the secret (the name is visible in `/proc/net/unix`, but reveals
//! only a hash, and knowing it is not enough to be served). Abstract sockets belong to a network
//! namespace: ranks in separate containers must share one to use this.
//!
//! ```text
//! server -> client  (after checking SO_PEERCRED: same effective uid, else closed)
//!                   "DBFDPS01" | nonce[32]
//! client -> server  SHA-256(secret | nonce | "doorbell-fd-v1")[32] | client_rank u64 | id u64
//! server -> client  1u8 with the descriptor attached (SCM_RIGHTS)
//!               or  0u8 | reason_len u32 | reason (UTF-8)
//! ```
//!
//! Integers are little endian. The client checks the server's uid too, so another user squatting
//! on the name cannot feed it descriptors.

use crate::error::{Error, Result};
use crate::job::auth::{auth_digest, ct_eq, hex, random_bytes, NONCE_LEN};
use crate::job::socket::{fmt_duration, wait_readable};
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::fmt;
use std::io::{self, Read, Write};
use std::mem::size_of;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

const HELLO_MAGIC: &[u8; 8] = b"DBFDPS01";
const AUTH_LABEL: &[u8] = b"doorbell-fd-v1";
const NAME_LABEL: &[u8] = b"doorbell-fd-name-v1";
const HELLO_LEN: usize = HELLO_MAGIC.len() + NONCE_LEN;
const REQUEST_LEN: usize = 32 + 8 + 8;
const MAX_REASON_LEN: usize = 4096;
/// Bound on one request's exchange on the server side; a silent client costs one thread this long.
const SERVE_TIMEOUT: Duration = Duration::from_secs(5);
/// How often the accept loop looks at its stop flag (and so how long dropping a server takes).
const ACCEPT_POLL: Duration = Duration::from_millis(100);
/// Requests served at once; later connections are closed unanswered until one ends (a client
/// then fails and retries like any refused fetch).
const MAX_REQUESTS: usize = 64;

/// The abstract socket name (without the leading NUL) of `rank`'s [`FdServer`] in the job with
/// `secret`.
pub fn server_name(secret: &[u8], rank: usize) -> String {
    let mut h = Sha256::new();
    h.update(secret);
    h.update(NAME_LABEL);
    format!("doorbell-fd.{}.{rank}", hex(&h.finalize()[..16]))
}

/// This process's server: hands the descriptors it publishes to authenticated processes of the
/// job. Dropping it stops the server (within about 100 ms) and closes every published descriptor.
pub struct FdServer {
    rank: usize,
    name: String,
    shared: Arc<ServerShared>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

struct ServerShared {
    rank: usize,
    secret: Vec<u8>,
    uid: libc::uid_t,
    published: Mutex<HashMap<u64, OwnedFd>>,
}

impl fmt::Debug for FdServer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let published = self
            .shared
            .published
            .lock()
            .map(|p| p.len())
            .unwrap_or_default();
        f.debug_struct("FdServer")
            .field("rank", &self.rank)
            .field("name", &self.name)
            .field("published", &published)
            .finish()
    }
}

impl FdServer {
    /// Listens on the abstract Unix socket derived from `secret` and `rank` (see the module
    /// documentation) and serves requests from a background thread. Fails when another process
    /// already serves that name: two ranks with the same `rank` in one job.
    pub fn start(secret: &[u8], rank: usize) -> Result<FdServer> {
        if secret.is_empty() {
            return Err(Error::invalid(
                "secret",
                "the job secret is empty; set DOORBELL_JOB_SECRET",
            ));
        }
        let name = server_name(secret, rank);
        let addr = SocketAddr::from_abstract_name(name.as_bytes())
            .map_err(|e| Error::io(format!("naming the fd server socket {name}"), e))?;
        let listener = UnixListener::bind_addr(&addr).map_err(|e| {
            let hint = if e.kind() == io::ErrorKind::AddrInUse {
                " (another process already serves this rank of this job: two ranks with the \
                 same RANK?)"
            } else {
                ""
            };
            Error::io(format!("starting the fd server of rank {rank}{hint}"), e)
        })?;
        listener
            .set_nonblocking(true)
            .map_err(|e| Error::io("configuring the fd server socket", e))?;
        let shared = Arc::new(ServerShared {
            rank,
            secret: secret.to_vec(),
            uid: effective_uid(),
            published: Mutex::new(HashMap::new()),
        });
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let (shared, stop) = (Arc::clone(&shared), Arc::clone(&stop));
            thread::Builder::new()
                .name(format!("doorbell-fd{rank}"))
                .spawn(move || accept_loop(listener, shared, stop))
                .map_err(|e| Error::io("starting the fd server thread", e))?
        };
        Ok(FdServer {
            rank,
            name,
            shared,
            stop,
            thread: Some(thread),
        })
    }

    /// The rank this server serves for.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Makes `fd` available under `id` until [`withdraw`](Self::withdraw) or drop. Each fetch
    /// gets its own duplicate. Fails when `id` is already published.
    pub fn publish(&self, id: u64, fd: OwnedFd) -> Result<()> {
        let mut published = self
            .shared
            .published
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if published.contains_key(&id) {
            return Err(Error::invalid(
                "id",
                format!(
                    "fd id {id} is already published by rank {}; withdraw it first",
                    self.rank
                ),
            ));
        }
        published.insert(id, fd);
        Ok(())
    }

    /// Stops serving `id` and closes this server's descriptor for it (descriptors already
    /// fetched stay valid). Unknown ids are ignored.
    pub fn withdraw(&self, id: u64) {
        self.shared
            .published
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&id);
    }
}

impl Drop for FdServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Accepts until `stop`, a thread per request; then ends the requests still in flight (their
/// sockets shut down) and joins them, so a dropped server leaves no thread behind.
fn accept_loop(listener: UnixListener, shared: Arc<ServerShared>, stop: Arc<AtomicBool>) {
    let mut requests: Vec<(thread::JoinHandle<()>, UnixStream)> = Vec::new();
    while !stop.load(Ordering::Relaxed) {
        requests.retain(|(t, _)| !t.is_finished());
        match wait_readable(listener.as_fd(), ACCEPT_POLL) {
            Ok(true) => {}
            Ok(false) => continue,
            Err(e) => {
                tracing::warn!(rank = shared.rank, "fd server poll failed: {e}");
                thread::sleep(ACCEPT_POLL);
                continue;
            }
        }
        loop {
            match listener.accept() {
                Ok((stream, _)) => {
                    if requests.len() >= MAX_REQUESTS {
                        tracing::warn!(
                            rank = shared.rank,
                            "fd server: {MAX_REQUESTS} requests in flight; closed one unanswered"
                        );
                        continue;
                    }
                    let closer = match stream.try_clone() {
                        Ok(c) => c,
                        Err(e) => {
                            tracing::warn!("fd server: dropped a request: {e}");
                            continue;
                        }
                    };
                    let shared = Arc::clone(&shared);
                    let spawned = thread::Builder::new()
                        .name(format!("doorbell-fd{}-req", shared.rank))
                        .spawn(move || serve(stream, &shared));
                    match spawned {
                        Ok(t) => requests.push((t, closer)),
                        Err(e) => tracing::warn!("fd server: dropped a request: {e}"),
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) => {
                    tracing::warn!(rank = shared.rank, "fd server accept failed: {e}");
                    thread::sleep(ACCEPT_POLL);
                    break;
                }
            }
        }
    }
    for (t, stream) in requests {
        // A request blocked reading its client returns at once.
        let _ = stream.shutdown(std::net::Shutdown::Both);
        let _ = t.join();
    }
}

/// One request: check the peer's uid, challenge it, answer with the descriptor or a reason.
fn serve(mut stream: UnixStream, shared: &ServerShared) {
    let result = (|| -> std::result::Result<(), String> {
        stream
            .set_nonblocking(false)
            .and_then(|()| stream.set_read_timeout(Some(SERVE_TIMEOUT)))
            .and_then(|()| stream.set_write_timeout(Some(SERVE_TIMEOUT)))
            .map_err(|e| format!("configuring the socket: {e}"))?;
        let uid = peer_uid(stream.as_fd()).map_err(|e| format!("reading SO_PEERCRED: {e}"))?;
        if uid != shared.uid {
            return Err(format!(
                "refused a process of uid {uid} (this server runs as uid {})",
                shared.uid
            ));
        }
        let nonce: [u8; NONCE_LEN] = random_bytes().map_err(|e| e.to_string())?;
        let mut hello = [0u8; HELLO_LEN];
        hello[..HELLO_MAGIC.len()].copy_from_slice(HELLO_MAGIC);
        hello[HELLO_MAGIC.len()..].copy_from_slice(&nonce);
        stream
            .write_all(&hello)
            .map_err(|e| format!("sending the challenge: {e}"))?;
        let mut request = [0u8; REQUEST_LEN];
        stream
            .read_exact(&mut request)
            .map_err(|e| format!("no complete request: {e}"))?;
        let (digest, client, id) = decode_request(&request);
        if !ct_eq(&digest, &auth_digest(&shared.secret, &nonce, AUTH_LABEL)) {
            let why = "authentication failed: the client does not know this job's secret";
            let _ = stream.write_all(&encode_refusal(why));
            return Err(why.to_string());
        }
        let fd = shared
            .published
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&id)
            .map(OwnedFd::try_clone);
        match fd {
            Some(Ok(fd)) => send_with_fd(stream.as_fd(), &[1], fd.as_fd())
                .map_err(|e| format!("sending fd id {id} to rank {client}: {e}")),
            Some(Err(e)) => {
                let why = format!("rank {} could not duplicate fd id {id}: {e}", shared.rank);
                let _ = stream.write_all(&encode_refusal(&why));
                Err(why)
            }
            None => {
                let why = format!("rank {} has no fd published under id {id}", shared.rank);
                let _ = stream.write_all(&encode_refusal(&why));
                Ok(())
            }
        }
    })();
    if let Err(why) = result {
        tracing::warn!(rank = shared.rank, "fd server: {why}");
    }
}

/// Connects to `peer_rank`'s [`FdServer`] in the job with `secret`, proves knowledge of the
/// secret, and receives the descriptor published under `id` (close-on-exec). Waits for the server
/// to appear, and for its reply, until `timeout`; errors name the peer and the id.
pub fn fetch_fd(
    secret: &[u8],
    my_rank: usize,
    peer_rank: usize,
    id: u64,
    timeout: Duration,
) -> Result<OwnedFd> {
    let fail = |why: String| Error::Bootstrap {
        me: my_rank,
        rank: Some(peer_rank),
        why: format!("fetching fd id {id}: {why}"),
    };
    let deadline = Instant::now() + timeout;
    let name = server_name(secret, peer_rank);
    let mut backoff = Duration::from_millis(5);
    let mut stream = loop {
        match connect_abstract(name.as_bytes()) {
            Ok(stream) => break stream,
            Err(e) => {
                let now = Instant::now();
                if now >= deadline {
                    return Err(fail(format!(
                        "no fd server answered within {} ({e}); is rank {peer_rank} running on \
                         this host, in this network namespace, with the same job secret?",
                        fmt_duration(timeout)
                    )));
                }
                thread::sleep(backoff.min(deadline - now));
                backoff = (backoff * 2).min(Duration::from_millis(200));
            }
        }
    };
    let wait = deadline
        .saturating_duration_since(Instant::now())
        .max(Duration::from_millis(1));
    stream
        .set_read_timeout(Some(wait))
        .and_then(|()| stream.set_write_timeout(Some(wait)))
        .map_err(|e| fail(format!("configuring the socket: {e}")))?;
    let uid = peer_uid(stream.as_fd()).map_err(|e| fail(format!("reading SO_PEERCRED: {e}")))?;
    if uid != effective_uid() {
        return Err(fail(format!(
            "the socket {name} belongs to uid {uid}, not to this job's user"
        )));
    }
    let io_fail = |what: &str, e: io::Error| {
        let late = matches!(
            e.kind(),
            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
        );
        fail(if late {
            format!("{what}: no reply within {}", fmt_duration(timeout))
        } else {
            format!("{what}: {e}")
        })
    };
    let mut hello = [0u8; HELLO_LEN];
    stream
        .read_exact(&mut hello)
        .map_err(|e| io_fail("reading the challenge", e))?;
    if &hello[..HELLO_MAGIC.len()] != HELLO_MAGIC {
        return Err(fail(format!(
            "{name} is not a doorbell fd server of this version"
        )));
    }
    let digest = auth_digest(secret, &hello[HELLO_MAGIC.len()..], AUTH_LABEL);
    stream
        .write_all(&encode_request(&digest, my_rank as u64, id))
        .map_err(|e| io_fail("sending the request", e))?;
    let mut status = [0u8; 1];
    let (n, mut fds) = recv_with_fds(stream.as_fd(), &mut status)
        .map_err(|e| io_fail("receiving the reply", e))?;
    match (n, status[0], fds.len()) {
        (1, 1, 1) => fds.pop().ok_or_else(|| fail("descriptor vanished".into())),
        (1, 1, count) => Err(fail(format!(
            "the server sent {count} descriptors instead of one"
        ))),
        (1, 0, _) => {
            let mut len = [0u8; 4];
            stream
                .read_exact(&mut len)
                .map_err(|e| io_fail("reading the refusal", e))?;
            let len = (u32::from_le_bytes(len) as usize).min(MAX_REASON_LEN);
            let mut why = vec![0u8; len];
            stream
                .read_exact(&mut why)
                .map_err(|e| io_fail("reading the refusal", e))?;
            Err(fail(format!(
                "rank {peer_rank} refused: {}",
                String::from_utf8_lossy(&why)
            )))
        }
        (0, ..) => Err(fail(
            "the server closed the connection without a reply".into(),
        )),
        (_, other, _) => Err(fail(format!("unknown reply byte {other}"))),
    }
}

fn encode_request(digest: &[u8; 32], client_rank: u64, id: u64) -> [u8; REQUEST_LEN] {
    let mut b = [0u8; REQUEST_LEN];
    b[..32].copy_from_slice(digest);
    b[32..40].copy_from_slice(&client_rank.to_le_bytes());
    b[40..48].copy_from_slice(&id.to_le_bytes());
    b
}

fn decode_request(b: &[u8; REQUEST_LEN]) -> ([u8; 32], u64, u64) {
    let mut digest = [0u8; 32];
    digest.copy_from_slice(&b[..32]);
    let mut client = [0u8; 8];
    client.copy_from_slice(&b[32..40]);
    let mut id = [0u8; 8];
    id.copy_from_slice(&b[40..48]);
    (digest, u64::from_le_bytes(client), u64::from_le_bytes(id))
}

fn encode_refusal(why: &str) -> Vec<u8> {
    let why = &why.as_bytes()[..why.len().min(MAX_REASON_LEN)];
    let mut b = Vec::with_capacity(5 + why.len());
    b.push(0);
    b.extend_from_slice(&(why.len() as u32).to_le_bytes());
    b.extend_from_slice(why);
    b
}

// ---------------------------------------------------------------------------------------------
// The system calls std does not wrap: SO_PEERCRED, sendmsg/recvmsg with SCM_RIGHTS.

/// Connects to the abstract Unix socket `name` without ever blocking: where a blocking connect
/// would wait without bound for room in a full backlog, this fails with `WouldBlock` and the
/// caller retries until its deadline.
fn connect_abstract(name: &[u8]) -> io::Result<UnixStream> {
    // SAFETY: socket() takes no pointers; on success it returns a new descriptor.
    let raw = unsafe {
        libc::socket(
            libc::AF_UNIX,
            libc::SOCK_STREAM | libc::SOCK_CLOEXEC | libc::SOCK_NONBLOCK,
            0,
        )
    };
    if raw < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `raw` is a fresh descriptor that nothing else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(raw) };
    let mut addr = libc::sockaddr_un {
        sun_family: libc::AF_UNIX as libc::sa_family_t,
        sun_path: [0; 108],
    };
    // An abstract name is a NUL followed by the name's bytes (no terminator).
    if name.len() >= addr.sun_path.len() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "abstract socket name too long",
        ));
    }
    for (dst, &src) in addr.sun_path[1..].iter_mut().zip(name) {
        *dst = src as libc::c_char;
    }
    let len = std::mem::offset_of!(libc::sockaddr_un, sun_path) + 1 + name.len();
    // SAFETY: `addr` is a live sockaddr_un and `len` (at most its size, checked above) covers the
    // family, the leading NUL and the name. `fd` is owned here and stays open during the call.
    let rc = unsafe {
        libc::connect(
            fd.as_raw_fd(),
            (&addr as *const libc::sockaddr_un).cast(),
            len as libc::socklen_t,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    let stream = UnixStream::from(fd);
    stream.set_nonblocking(false)?;
    Ok(stream)
}

fn effective_uid() -> libc::uid_t {
    // SAFETY: geteuid takes no arguments, cannot fail and touches no memory of ours.
    unsafe { libc::geteuid() }
}

/// The effective uid of the process at the other end of a connected Unix socket.
fn peer_uid(sock: BorrowedFd<'_>) -> io::Result<libc::uid_t> {
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: `cred` is a live ucred and `len` holds its size, as SO_PEERCRED requires; the kernel
    // writes at most `len` bytes. `sock` is borrowed, so it stays open during the call.
    let rc = unsafe {
        libc::getsockopt(
            sock.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    if len as usize != size_of::<libc::ucred>() {
        return Err(io::Error::other("SO_PEERCRED returned a short ucred"));
    }
    Ok(cred.uid)
}

/// Room for this many descriptors in one control message: more than we ever expect, so that a
/// misbehaving sender's extra descriptors arrive (and are closed) rather than truncate.
const MAX_FDS: usize = 4;

/// Control buffer aligned for `cmsghdr`.
#[repr(C, align(8))]
struct CmsgBuf([u8; 64]);

fn cmsg_space(fds: usize) -> usize {
    // SAFETY: CMSG_SPACE is pure arithmetic on its argument.
    unsafe { libc::CMSG_SPACE((fds * size_of::<libc::c_int>()) as libc::c_uint) as usize }
}

/// Sends `data` with one descriptor attached.
fn send_with_fd(sock: BorrowedFd<'_>, data: &[u8], fd: BorrowedFd<'_>) -> io::Result<()> {
    let mut control = CmsgBuf([0; 64]);
    let space = cmsg_space(1);
    debug_assert!(space <= control.0.len());
    let mut iov = libc::iovec {
        iov_base: data.as_ptr() as *mut libc::c_void,
        iov_len: data.len(),
    };
    // SAFETY: msghdr is plain data; all-zero is a valid empty header.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.0.as_mut_ptr().cast();
    msg.msg_controllen = space as _;
    // SAFETY: msg_control points at `control`, aligned for cmsghdr and at least CMSG_SPACE(one
    // int) long, so the first header and its data fit; sendmsg only reads `data` through the
    // iovec (the kernel never writes to it) and `sock`/`fd` are borrowed, so they stay open.
    let sent = unsafe {
        let cmsg = libc::CMSG_FIRSTHDR(&msg);
        if cmsg.is_null() {
            return Err(io::Error::other("no room for the control message"));
        }
        (*cmsg).cmsg_level = libc::SOL_SOCKET;
        (*cmsg).cmsg_type = libc::SCM_RIGHTS;
        (*cmsg).cmsg_len = libc::CMSG_LEN(size_of::<libc::c_int>() as libc::c_uint) as _;
        std::ptr::write_unaligned(libc::CMSG_DATA(cmsg).cast::<libc::c_int>(), fd.as_raw_fd());
        libc::sendmsg(sock.as_raw_fd(), &msg, libc::MSG_NOSIGNAL)
    };
    if sent < 0 {
        return Err(io::Error::last_os_error());
    }
    if sent as usize != data.len() {
        return Err(io::Error::new(
            io::ErrorKind::WriteZero,
            "short sendmsg with a descriptor",
        ));
    }
    Ok(())
}

/// Receives into `buf` and takes ownership of every descriptor that came with it
/// (close-on-exec). Returns the byte count (0 at end of stream) and the descriptors.
fn recv_with_fds(sock: BorrowedFd<'_>, buf: &mut [u8]) -> io::Result<(usize, Vec<OwnedFd>)> {
    let mut control = CmsgBuf([0; 64]);
    let space = cmsg_space(MAX_FDS);
    debug_assert!(space <= control.0.len());
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    // SAFETY: msghdr is plain data; all-zero is a valid empty header.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.0.as_mut_ptr().cast();
    msg.msg_controllen = space as _;
    // SAFETY: the iovec covers `buf`, which is exclusively borrowed, and msg_control covers
    // `space` bytes of `control`; the kernel writes within those bounds only. `sock` is borrowed.
    let n = unsafe { libc::recvmsg(sock.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    let mut fds = Vec::new();
    // SAFETY: after a successful recvmsg the kernel has filled msg_control with msg_controllen
    // bytes of well-formed cmsghdrs; CMSG_FIRSTHDR/NXTHDR stay within them and return null at the
    // end. Each SCM_RIGHTS payload holds descriptors the kernel just installed in this process,
    // owned by nobody else, so wrapping each in OwnedFd once is sound.
    unsafe {
        let mut cmsg = libc::CMSG_FIRSTHDR(&msg);
        while !cmsg.is_null() {
            if (*cmsg).cmsg_level == libc::SOL_SOCKET && (*cmsg).cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(cmsg).cast::<libc::c_int>();
                let bytes = ((*cmsg).cmsg_len as usize).saturating_sub(libc::CMSG_LEN(0) as usize);
                for i in 0..bytes / size_of::<libc::c_int>() {
                    let raw = std::ptr::read_unaligned(data.add(i));
                    fds.push(OwnedFd::from_raw_fd(raw));
                }
            }
            cmsg = libc::CMSG_NXTHDR(&msg, cmsg);
        }
    }
    if msg.msg_flags & libc::MSG_CTRUNC != 0 {
        // The descriptors that did arrive close when `fds` drops.
        return Err(io::Error::other("descriptors were truncated in transit"));
    }
    Ok((n as usize, fds))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixStream;

    #[test]
    fn names_depend_on_secret_and_rank() {
        let a = server_name(b"one", 0);
        assert_eq!(a, server_name(b"one", 0));
        assert_ne!(a, server_name(b"two", 0));
        assert_ne!(a, server_name(b"one", 1));
        assert!(a.starts_with("doorbell-fd.") && a.ends_with(".0"), "{a}");
        assert!(!a.contains("one"));
    }

    #[test]
    fn request_and_refusal_encoding() {
        let digest = [7u8; 32];
        assert_eq!(
            decode_request(&encode_request(&digest, 3, u64::MAX)),
            (digest, 3, u64::MAX)
        );
        let r = encode_refusal("no");
        assert_eq!(r, [0, 2, 0, 0, 0, b'n', b'o']);
        assert_eq!(
            encode_refusal(&"x".repeat(10_000)).len(),
            5 + MAX_REASON_LEN
        );
    }

    #[test]
    fn descriptors_cross_a_socket_pair() {
        let (a, b) = UnixStream::pair().unwrap();
        let (c, _d) = UnixStream::pair().unwrap();
        send_with_fd(a.as_fd(), &[1], c.as_fd()).unwrap();
        let mut buf = [0u8; 1];
        let (n, fds) = recv_with_fds(b.as_fd(), &mut buf).unwrap();
        assert_eq!((n, buf[0], fds.len()), (1, 1, 1));
        // The received descriptor is close-on-exec and names the same socket.
        // SAFETY: fcntl F_GETFD on a descriptor we own.
        let flags = unsafe { libc::fcntl(fds[0].as_raw_fd(), libc::F_GETFD) };
        assert!(flags & libc::FD_CLOEXEC != 0);
        assert_eq!(peer_uid(fds[0].as_fd()).unwrap(), effective_uid());
        drop(a);
        let (n, fds) = recv_with_fds(b.as_fd(), &mut buf).unwrap();
        assert_eq!((n, fds.len()), (0, 0));
    }
}
