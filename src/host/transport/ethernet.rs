//! The Ethernet transport of PortChannels: two ranks with no CUDA IPC between them (other hosts,
//! or ranks told to act as separate nodes with `DOORBELL_SEPARATE_NODES=1`) run the same kernels,
//! and their proxies carry the bytes over TCP.
//!
//! One TCP connection per (channel set, peer), opened while the channels are built:
//! - the **sender** thread (owned by the proxy's connection) takes the proxy's operations in FIFO
//!   order: a put is read out of GPU memory in chunks (device-to-host copies into pinned staging)
//!   and written to the socket; a signal is a header; a flush is reported done when the sender
//!   reaches it, since every earlier put has then been read out of the source (its memory is
//!   reusable, which is what flush promises).
//! - the **receiver** thread (owned by the channel) applies what arrives, in order: data by
//!   host-to-device copies into the registered destination, checked against its size; a signal by
//!   writing the running count into this rank's inbound token with a host-to-device copy issued
//!   after the data copies completed, so a kernel that sees the count sees the data.
//!
//! Wire format, little endian: a 24-byte header `[kind u64][offset u64][size u64]`, kind 1 (data,
//! followed by `size` bytes) or 2 (signal). Offsets and sizes are 64-bit: no truncation at 4 GiB.
//!
//! Failures (a peer gone, a bad offset) stop the proxy with the error, which releases every kernel
//! waiting on it with a report, as everywhere else.
//!
//! The threads make no CUDA allocation and free none: their stream and pinned staging are made
//! when the thread is spawned and freed by its owner's drop, after the join. Freeing pinned memory
//! waits for the GPU, and while it waits other threads' CUDA calls wait too: a receiver that freed
//! its staging on its peer's clean close, while this rank's kernel still waited for a copy of the
//! proxy's, held that copy back until the kernel's budget ran out (`tests/net` at nodes of two:
//! "flush: expected 171, seen 165", the last call's intra-node flush after the network leg).

use super::{Address, Connection, FailureSink, Token};
use crate::error::{Error, Result};
use crate::gpu::cuda::{cuda_err, Gpu, HostArray};
use crate::job::auth::{auth_digest, ct_eq, random_bytes, DIGEST_LEN, NONCE_LEN};
use crate::job::bootstrap::Bootstrap;
use cudarc::driver::CudaStream;
use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::sync::mpsc;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Bytes moved per device-host copy on either side.
const CHUNK: usize = 4 << 20;
const KIND_DATA: u64 = 1;
const KIND_SIGNAL: u64 = 2;
/// The connector's proof: SHA-256(secret | listener's nonce | from u32 | to u32 | channel u32 |
/// this).
const HELLO_LABEL: &[u8] = b"doorbell-ethernet-hello-v2";
/// The listener's proof: SHA-256(secret | connector's nonce | listener's nonce | this).
const ACCEPT_LABEL: &[u8] = b"doorbell-ethernet-accept-v2";
/// What a connector sends after reading the listener's nonce: from u32 | its nonce | its proof.
const HELLO_LEN: usize = 4 + NONCE_LEN + DIGEST_LEN;

fn hello_proof(
    secret: &[u8],
    theirs: &[u8],
    from: usize,
    to: usize,
    channel: u32,
) -> [u8; DIGEST_LEN] {
    let mut m = theirs.to_vec();
    for w in [from as u32, to as u32, channel] {
        m.extend_from_slice(&w.to_le_bytes());
    }
    auth_digest(secret, &m, HELLO_LABEL)
}

fn accept_proof(secret: &[u8], cnonce: &[u8], lnonce: &[u8]) -> [u8; DIGEST_LEN] {
    auth_digest(secret, &[cnonce, lnonce].concat(), ACCEPT_LABEL)
}

/// The connector's half of a channel connection's handshake: reads the listener's fresh nonce,
/// answers it with its rank, a nonce of its own and its proof, and checks the listener's proof
/// (so neither a replayed hello nor a stranger on the address passes).
fn greet(
    s: &mut TcpStream,
    secret: &[u8],
    from: usize,
    to: usize,
    channel: u32,
) -> std::result::Result<(), String> {
    let mut lnonce = [0u8; NONCE_LEN];
    s.read_exact(&mut lnonce)
        .map_err(|e| format!("no challenge: {e}"))?;
    let cnonce: [u8; NONCE_LEN] = random_bytes().map_err(|e| e.to_string())?;
    let mut hello = Vec::with_capacity(HELLO_LEN);
    hello.extend_from_slice(&(from as u32).to_le_bytes());
    hello.extend_from_slice(&cnonce);
    hello.extend_from_slice(&hello_proof(secret, &lnonce, from, to, channel));
    s.write_all(&hello).map_err(|e| format!("greeting: {e}"))?;
    let mut proof = [0u8; DIGEST_LEN];
    s.read_exact(&mut proof)
        .map_err(|e| format!("no answer to the greeting: {e}"))?;
    if !ct_eq(&proof, &accept_proof(secret, &cnonce, &lnonce)) {
        return Err("its listener did not prove the job secret".into());
    }
    Ok(())
}

/// The listener's half: sends a fresh nonce, reads the connector's hello and, when it proves the
/// secret for one of `from` (the ranks that may connect), answers with its own proof and returns
/// that rank.
fn welcome(
    s: &mut TcpStream,
    secret: &[u8],
    me: usize,
    channel: u32,
    from: impl Fn(usize) -> bool,
) -> std::result::Result<usize, String> {
    let lnonce: [u8; NONCE_LEN] = random_bytes().map_err(|e| e.to_string())?;
    s.write_all(&lnonce)
        .map_err(|e| format!("sending the challenge: {e}"))?;
    let mut h = [0u8; HELLO_LEN];
    s.read_exact(&mut h).map_err(|_| "no hello".to_string())?;
    let mut w = [0u8; 4];
    w.copy_from_slice(&h[..4]);
    let who = u32::from_le_bytes(w) as usize;
    let (cnonce, proof) = (&h[4..4 + NONCE_LEN], &h[4 + NONCE_LEN..]);
    if !from(who) || !ct_eq(proof, &hello_proof(secret, &lnonce, who, me, channel)) {
        return Err("bad hello".into());
    }
    s.write_all(&accept_proof(secret, cnonce, &lnonce))
        .map_err(|e| format!("answering rank {who}: {e}"))?;
    Ok(who)
}

/// One operation for a sender, in the proxy's FIFO order.
enum NetOp {
    /// Copy `size` bytes from local device address `src` to the peer's destination at `offset`.
    Data { src: u64, offset: u64, size: u64 },
    /// Add one to the peer's inbound token, after the data before it.
    Signal,
    /// Report position `pos` flushed.
    Flush { pos: u64 },
}

/// A transport thread's CUDA resources: made before the thread starts, freed by its owner after
/// the join (see the module's notes: never made or freed by the thread itself).
struct ThreadCuda {
    stream: Arc<CudaStream>,
    staging: HostArray<u8>,
    /// The receiver's running signal count (unused by senders).
    count: HostArray<u64>,
}

impl ThreadCuda {
    fn new(gpu: &Arc<Gpu>) -> Result<Arc<ThreadCuda>> {
        gpu.bind()?;
        crate::gpu::cuda::note_host_cuda_calls("the Ethernet transport's copies");
        Ok(Arc::new(ThreadCuda {
            stream: gpu.new_stream()?,
            staging: HostArray::new(gpu, CHUNK)?,
            count: HostArray::new(gpu, 1)?,
        }))
    }
}

/// The proxy's side of one Ethernet connection: a queue to its sender thread, which copies each
/// write out of the GPU through a pinned staging buffer onto the socket, sends a signal as a
/// header the peer's receiver turns into one more on its inbound token, and reports a flush once
/// everything before it is on the socket (TCP delivers in order; the receiver applies in order).
pub(crate) struct EthernetConnection {
    tx: Option<mpsc::Sender<NetOp>>,
    thread: Option<JoinHandle<()>>,
    flush_done: Arc<HostArray<u64>>,
    /// Dropped after `thread` is joined (fields drop after `Drop::drop`).
    _cuda: Arc<ThreadCuda>,
}

impl EthernetConnection {
    /// A connection to `peer` over `socket`; the sender thread reports its failure to `sink`.
    pub(crate) fn spawn(
        gpu: &Arc<Gpu>,
        socket: TcpStream,
        sink: FailureSink,
        peer: usize,
    ) -> Result<EthernetConnection> {
        let (tx, rx) = mpsc::channel::<NetOp>();
        let cuda = ThreadCuda::new(gpu)?;
        let flush_done = Arc::new(HostArray::new(gpu, 1)?);
        let (gpu, mine, flushes) = (gpu.clone(), cuda.clone(), flush_done.clone());
        let thread = std::thread::Builder::new()
            .name(format!("doorbell-net-send-{peer}"))
            .spawn(move || {
                if let Err(e) = send_loop(&gpu, &mine, socket, &flushes, rx) {
                    sink.fail(Error::invalid(
                        "ethernet",
                        format!("sending to rank {peer}: {e}"),
                    ));
                }
            })
            .map_err(|e| Error::io("starting an ethernet sender", e))?;
        Ok(EthernetConnection {
            tx: Some(tx),
            thread: Some(thread),
            flush_done,
            _cuda: cuda,
        })
    }

    /// Queues `op`; fails if the sender thread has ended (its error was reported already).
    fn push(&self, op: NetOp) -> Result<()> {
        self.tx
            .as_ref()
            .and_then(|tx| tx.send(op).ok())
            .ok_or_else(|| Error::invalid("ethernet", "the sender thread has stopped"))
    }
}

impl Connection for EthernetConnection {
    fn write(&mut self, src: Address, dst: Address, bytes: u64) -> Result<()> {
        self.push(NetOp::Data {
            src: src.addr,
            offset: dst.addr,
            size: bytes,
        })
    }
    fn signal(&mut self, _token: Token) -> Result<()> {
        // The peer's receiver owns the token; the signal travels in order with the data.
        self.push(NetOp::Signal)
    }
    fn flush(&mut self, pos: u64) -> Result<()> {
        self.push(NetOp::Flush { pos })
    }
    fn progress(&mut self) -> Result<bool> {
        Ok(false) // the sender thread reports flushes itself
    }
    fn flush_word(&self) -> u64 {
        self.flush_done.device_ptr()
    }
}

impl Drop for EthernetConnection {
    fn drop(&mut self) {
        // Closing the queue ends the thread once it has sent what was queued.
        self.tx.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn send_loop(
    gpu: &Arc<Gpu>,
    cuda: &ThreadCuda,
    mut socket: TcpStream,
    flush_done: &HostArray<u64>,
    rx: mpsc::Receiver<NetOp>,
) -> Result<()> {
    gpu.bind()?;
    let (stream, staging) = (&cuda.stream, &cuda.staging);
    let io = |e: std::io::Error| Error::io("writing to the peer", e);
    while let Ok(op) = rx.recv() {
        match op {
            NetOp::Data { src, offset, size } => {
                socket
                    .write_all(&header(KIND_DATA, offset, size))
                    .map_err(io)?;
                let mut done = 0u64;
                while done < size {
                    let n = (size - done).min(CHUNK as u64) as usize;
                    copy_dtoh(stream, staging.host_ptr(), src + done, n)?;
                    // SAFETY: the staging buffer holds CHUNK >= n bytes, just written by the copy
                    // that completed above.
                    let bytes = unsafe { std::slice::from_raw_parts(staging.host_ptr(), n) };
                    socket.write_all(bytes).map_err(io)?;
                    done += n as u64;
                }
            }
            NetOp::Signal => socket.write_all(&header(KIND_SIGNAL, 0, 0)).map_err(io)?,
            NetOp::Flush { pos } => flush_done.write(0, pos + 1),
        }
    }
    Ok(())
}

/// The channel's side of one Ethernet connection: the receiver thread.
pub(crate) struct NetReceiver {
    socket: TcpStream,
    thread: Option<JoinHandle<()>>,
    /// Dropped after `thread` is joined.
    _cuda: Arc<ThreadCuda>,
}

/// Where a receiver puts what arrives.
pub(crate) struct ReceiveBuffer {
    /// The registered destination (device address, bytes).
    pub(crate) dst: u64,
    pub(crate) dst_bytes: u64,
    /// This rank's inbound token of the channel (device address).
    pub(crate) token: u64,
}

impl NetReceiver {
    pub(crate) fn spawn(
        gpu: &Arc<Gpu>,
        socket: TcpStream,
        buffer: ReceiveBuffer,
        sink: FailureSink,
        peer: usize,
    ) -> Result<NetReceiver> {
        let reader = socket
            .try_clone()
            .map_err(|e| Error::io("cloning a socket", e))?;
        let cuda = ThreadCuda::new(gpu)?;
        let (gpu, mine) = (gpu.clone(), cuda.clone());
        let thread = std::thread::Builder::new()
            .name(format!("doorbell-net-recv-{peer}"))
            .spawn(move || {
                if let Err(e) = receive_loop(&gpu, &mine, reader, &buffer) {
                    sink.fail(Error::invalid(
                        "ethernet",
                        format!("receiving from rank {peer}: {e}"),
                    ));
                }
            })
            .map_err(|e| Error::io("starting an ethernet receiver", e))?;
        Ok(NetReceiver {
            socket,
            thread: Some(thread),
            _cuda: cuda,
        })
    }
}

impl Drop for NetReceiver {
    fn drop(&mut self) {
        let _ = self.socket.shutdown(std::net::Shutdown::Both);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn receive_loop(
    gpu: &Arc<Gpu>,
    cuda: &ThreadCuda,
    mut socket: TcpStream,
    at: &ReceiveBuffer,
) -> Result<()> {
    gpu.bind()?;
    let (stream, staging, count) = (&cuda.stream, &cuda.staging, &cuda.count);
    let mut signals = 0u64;
    let io = |e: std::io::Error| Error::io("reading from the peer", e);
    loop {
        let mut h = [0u8; 24];
        // A clean end of stream between messages is the peer closing the channel.
        if !read_full(&mut socket, &mut h).map_err(io)? {
            return Ok(());
        }
        let word =
            |i: usize| u64::from_le_bytes(h[i * 8..i * 8 + 8].try_into().unwrap_or_default());
        let (kind, offset, size) = (word(0), word(1), word(2));
        match kind {
            KIND_DATA => {
                if offset
                    .checked_add(size)
                    .is_none_or(|end| end > at.dst_bytes)
                {
                    return Err(Error::invalid(
                        "ethernet",
                        format!(
                            "a put to [{offset}, +{size}) lies outside the {}-byte destination",
                            at.dst_bytes
                        ),
                    ));
                }
                let mut done = 0u64;
                while done < size {
                    let n = (size - done).min(CHUNK as u64) as usize;
                    // SAFETY: staging holds CHUNK >= n bytes and nothing else uses it now.
                    let buf = unsafe { std::slice::from_raw_parts_mut(staging.host_ptr(), n) };
                    if !read_full(&mut socket, buf).map_err(io)? {
                        return Err(Error::invalid("ethernet", "the peer closed mid-message"));
                    }
                    copy_htod(stream, at.dst + offset + done, staging.host_ptr(), n)?;
                    done += n as u64;
                }
            }
            KIND_SIGNAL => {
                signals += 1;
                count.write(0, signals);
                // Issued after every data copy before it completed (they are synchronous).
                copy_htod(stream, at.token, count.host_ptr() as *const u8, 8)?;
            }
            other => {
                return Err(Error::invalid(
                    "ethernet",
                    format!("unknown message kind {other}"),
                ))
            }
        }
    }
}

/// Reads exactly `buf.len()` bytes; `Ok(false)` on end of stream before the first byte.
fn read_full(socket: &mut TcpStream, buf: &mut [u8]) -> std::io::Result<bool> {
    let mut got = 0;
    while got < buf.len() {
        match socket.read(&mut buf[got..]) {
            Ok(0) if got == 0 => return Ok(false),
            Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(true)
}

fn header(kind: u64, offset: u64, size: u64) -> [u8; 24] {
    let mut h = [0u8; 24];
    h[..8].copy_from_slice(&kind.to_le_bytes());
    h[8..16].copy_from_slice(&offset.to_le_bytes());
    h[16..].copy_from_slice(&size.to_le_bytes());
    h
}

fn copy_dtoh(stream: &CudaStream, dst: *mut u8, src: u64, n: usize) -> Result<()> {
    // SAFETY: `dst` is pinned host memory of at least n bytes; `src` was range-checked by the
    // proxy against registered memory (or vouched for by the collective that named it).
    unsafe { crate::gpu::cuda::copy_to_host_async(stream, dst, src, n) }?;
    stream
        .synchronize()
        .map_err(cuda_err("cuStreamSynchronize"))
}

fn copy_htod(stream: &CudaStream, dst: u64, src: *const u8, n: usize) -> Result<()> {
    // SAFETY: `src` is pinned host memory of at least n bytes; `dst` was checked against the
    // registered destination (or is this rank's own token).
    unsafe { crate::gpu::cuda::copy_from_host_async(stream, dst, src, n) }?;
    stream
        .synchronize()
        .map_err(cuda_err("cuStreamSynchronize"))
}

/// Opens one authenticated TCP connection to every peer in `peers` for channel set `channel`:
/// every rank listens, the lower rank of each pair connects to the higher one's listener, and
/// both prove the job secret against the other's fresh nonce ([`greet`], [`welcome`]). Collective over all ranks (every rank calls it with its own list
/// of network peers, which is symmetric). Returns the sockets in `peers` order.
pub(crate) fn connect_peers(
    bootstrap: &Bootstrap,
    channel: u32,
    peers: &[usize],
) -> Result<Vec<TcpStream>> {
    let rank = bootstrap.rank();
    let ip = bootstrap
        .local_ip()
        .unwrap_or(IpAddr::V4(Ipv4Addr::LOCALHOST));
    let listener = TcpListener::bind(SocketAddr::new(ip, 0))
        .map_err(|e| Error::io("listening for ethernet channels", e))?;
    let me = listener
        .local_addr()
        .map_err(|e| Error::io("listening for ethernet channels", e))?;
    let addrs = bootstrap.all_gather(me.to_string().as_bytes())?;
    let deadline = Instant::now() + bootstrap.timeout();
    let mut sockets: Vec<Option<TcpStream>> = peers.iter().map(|_| None).collect();
    // Connect to the higher ranks.
    for (i, &p) in peers.iter().enumerate().filter(|&(_, &p)| p > rank) {
        let addr: SocketAddr = std::str::from_utf8(&addrs[p])
            .ok()
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| Error::Bootstrap {
                me: rank,
                rank: Some(p),
                why: "sent a malformed ethernet address".into(),
            })?;
        let mut s = TcpStream::connect_timeout(&addr, bootstrap.timeout())
            .map_err(|e| Error::io(format!("connecting to rank {p} at {addr}"), e))?;
        // The higher rank answers once its own greetings are done (the highest has none), so
        // allow the whole deadline.
        let left = deadline.saturating_duration_since(Instant::now());
        s.set_read_timeout(Some(left.max(Duration::from_millis(1))))
            .map_err(|e| Error::io(format!("connecting to rank {p} at {addr}"), e))?;
        greet(&mut s, bootstrap.secret(), rank, p, channel).map_err(|why| Error::Bootstrap {
            me: rank,
            rank: Some(p),
            why: format!("ethernet channel {channel} at {addr}: {why}"),
        })?;
        s.set_read_timeout(None)
            .map_err(|e| Error::io(format!("connecting to rank {p} at {addr}"), e))?;
        sockets[i] = Some(s);
    }
    // Accept the lower ranks, each proving the secret; strangers are dropped.
    let expected = peers.iter().filter(|&&p| p < rank).count();
    let mut accepted = 0;
    listener
        .set_nonblocking(true)
        .map_err(|e| Error::io("listening for ethernet channels", e))?;
    while accepted < expected {
        match listener.accept() {
            Ok((mut s, from)) => {
                s.set_nonblocking(false)
                    .and_then(|()| s.set_read_timeout(Some(Duration::from_secs(5))))
                    .and_then(|()| s.set_write_timeout(Some(Duration::from_secs(5))))
                    .map_err(|e| Error::io("accepting an ethernet channel", e))?;
                let open = |who: usize| {
                    peers
                        .iter()
                        .position(|&p| p == who && p < rank)
                        .is_some_and(|i| sockets[i].is_none())
                };
                match welcome(&mut s, bootstrap.secret(), rank, channel, open) {
                    Ok(who) => {
                        s.set_read_timeout(None)
                            .and_then(|()| s.set_write_timeout(None))
                            .map_err(|e| Error::io("accepting an ethernet channel", e))?;
                        if let Some(i) = peers.iter().position(|&p| p == who) {
                            sockets[i] = Some(s);
                            accepted += 1;
                        }
                    }
                    Err(why) => tracing::warn!("dropped an ethernet connection from {from}: {why}"),
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if Instant::now() > deadline {
                    let missing: Vec<String> = peers
                        .iter()
                        .zip(&sockets)
                        .filter(|(_, s)| s.is_none())
                        .map(|(p, _)| p.to_string())
                        .collect();
                    return Err(Error::Bootstrap {
                        me: rank,
                        rank: None,
                        why: format!(
                            "ethernet channel {channel}: ranks {} never connected",
                            missing.join(", ")
                        ),
                    });
                }
                std::thread::sleep(Duration::from_millis(1));
            }
            Err(e) => return Err(Error::io("accepting an ethernet channel", e)),
        }
    }
    sockets
        .into_iter()
        .map(|s| {
            let s = s.ok_or_else(|| Error::invalid("ethernet", "a connection is missing"))?;
            s.set_nodelay(true)
                .map_err(|e| Error::io("configuring an ethernet channel", e))?;
            Ok(s)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A connected pair of sockets (connector, listener side).
    fn pair() -> (TcpStream, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let a = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (b, _) = l.accept().unwrap();
        for s in [&a, &b] {
            s.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
        }
        (a, b)
    }

    /// Three ranks (threads) open their channel connections at once: every greeting waits for
    /// the higher rank's challenge, and the chain ends at the highest rank, so none deadlocks;
    /// each socket then carries a byte each way.
    #[test]
    fn three_ranks_connect_every_pair() {
        use crate::job::bootstrap::BootstrapConfig;
        let port = crate::job::launch::free_port().unwrap();
        let n = 3;
        std::thread::scope(|s| {
            for rank in 0..n {
                s.spawn(move || {
                    let b = Bootstrap::connect(BootstrapConfig {
                        rank,
                        world_size: n,
                        local_rank: rank,
                        local_world_size: n,
                        master_addr: "127.0.0.1".into(),
                        master_port: port,
                        secret: b"eth-test".to_vec(),
                        timeout: Duration::from_secs(10),
                        heartbeat: Duration::ZERO,
                    })
                    .unwrap();
                    let peers: Vec<usize> = (0..n).filter(|&p| p != rank).collect();
                    let mut socks = connect_peers(&b, 5, &peers).unwrap();
                    for s in &mut socks {
                        s.write_all(&[rank as u8]).unwrap();
                    }
                    for (s, &p) in socks.iter_mut().zip(&peers) {
                        let mut got = [0u8; 1];
                        s.read_exact(&mut got).unwrap();
                        assert_eq!(got[0] as usize, p, "rank {rank}'s socket to {p}");
                    }
                    b.barrier().unwrap();
                });
            }
        });
    }

    #[test]
    fn both_sides_of_a_channel_hello_prove_the_secret_with_fresh_nonces() {
        // The real thing: rank 1 greets rank 3 on channel 7.
        let (mut a, mut b) = pair();
        std::thread::scope(|s| {
            let h = s.spawn(move || welcome(&mut b, b"s3cret", 3, 7, |who| who == 1));
            greet(&mut a, b"s3cret", 1, 3, 7).unwrap();
            assert_eq!(h.join().unwrap(), Ok(1));
        });
        // A hello captured from one connection and replayed on another is refused: the
        // listener's nonce is new every time.
        let (mut a, mut b) = pair();
        let captured = std::thread::scope(|s| {
            let h = s.spawn(move || {
                let lnonce = [1u8; NONCE_LEN];
                b.write_all(&lnonce).unwrap();
                let mut hello = [0u8; HELLO_LEN];
                b.read_exact(&mut hello).unwrap();
                hello
            });
            let _ = greet(&mut a, b"s3cret", 1, 3, 7); // no answer comes: fails, as it should
            h.join().unwrap()
        });
        let (mut a, mut b) = pair();
        std::thread::scope(|s| {
            let h = s.spawn(move || welcome(&mut b, b"s3cret", 3, 7, |_| true));
            let mut lnonce = [0u8; NONCE_LEN];
            a.read_exact(&mut lnonce).unwrap();
            a.write_all(&captured).unwrap();
            assert_eq!(h.join().unwrap(), Err("bad hello".into()));
        });
        // Another secret, another channel, or a rank that may not connect: refused.
        for (secret, channel, allowed) in [
            (&b"other"[..], 7, true),
            (b"s3cret", 8, true),
            (b"s3cret", 7, false),
        ] {
            let (mut a, mut b) = pair();
            std::thread::scope(|s| {
                let h = s.spawn(move || welcome(&mut b, b"s3cret", 3, 7, |_| allowed));
                let _ = greet(&mut a, secret, 1, 3, channel);
                assert_eq!(h.join().unwrap(), Err("bad hello".into()));
            });
        }
        // A listener that does not hold the secret cannot pass: the greeter refuses its answer.
        let (mut a, mut b) = pair();
        std::thread::scope(|s| {
            s.spawn(move || {
                b.write_all(&[2u8; NONCE_LEN]).unwrap();
                let mut hello = [0u8; HELLO_LEN];
                b.read_exact(&mut hello).unwrap();
                b.write_all(&[0u8; DIGEST_LEN]).unwrap();
            });
            let e = greet(&mut a, b"s3cret", 1, 3, 7).unwrap_err();
            assert!(e.contains("did not prove the job secret"), "{e}");
        });
    }

    #[test]
    fn headers_round_trip_through_a_socket_and_eof_is_told_apart() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let mut a = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (mut b, _) = l.accept().unwrap();
        let big = (5u64 << 32) + 7; // past 4 GiB: nothing is truncated
        a.write_all(&header(KIND_DATA, big, big + 1)).unwrap();
        a.write_all(&[1, 2, 3]).unwrap();
        drop(a);
        let mut h = [0u8; 24];
        assert!(read_full(&mut b, &mut h).unwrap());
        let word = |i: usize| u64::from_le_bytes(h[i * 8..i * 8 + 8].try_into().unwrap());
        assert_eq!((word(0), word(1), word(2)), (KIND_DATA, big, big + 1));
        // Three bytes then the end: a short message is an error, not a clean end.
        let mut four = [0u8; 4];
        assert!(read_full(&mut b, &mut four).is_err());
        assert!(!read_full(&mut b, &mut four).unwrap());
    }
}
