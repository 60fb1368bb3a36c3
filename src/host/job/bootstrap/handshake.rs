//! Authenticated connection setup, both halves: a listener that accepts in the background and
//! challenges each connection in a thread of its own, and a connector that dials, proves the job
//! secret and learns the listener's verdict, retrying until its deadline. Both sides prove the
//! secret: the connector answers the listener's nonce, and the listener's accept answers the
//! connector's, so a stranger on the port (one that took MASTER_PORT first) cannot pass for rank
//! 0 and hand out an address table.
//!
//! This module owns the accept thread, the per-connection handshake threads and the rules a
//! listener judges answers by (secret, world size, which ranks may connect, one connection per
//! rank). It must never let a stranger's connection cost more than one thread for a few seconds
//! (`HANDSHAKE_TIMEOUT_CAP`), never hand on a connection that has not proved the secret, and never
//! carry frames: a handshake ends with the stream handed to the caller, sealed with the frame key
//! both nonces and the secret give (`wire::frame_key`).

use super::wire::{
    decode_answer, encode_answer, encode_verdict, frame_key, read_verdict, Answer, Conn, Verdict,
    ANSWER_LEN,
};
use super::{lock, BootstrapConfig};
use crate::error::{Error, Result};
use crate::job::auth::{auth_digest, ct_eq, random_bytes, DIGEST_LEN, NONCE_LEN};
use crate::job::socket::{fmt_duration, wait_readable};
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::ops::Range;
use std::os::fd::AsFd;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

const HELLO_MAGIC: &[u8; 8] = b"DBBOOT03";
/// The connector's proof: SHA-256(secret | listener's nonce | this).
const AUTH_LABEL: &[u8] = b"doorbell-bootstrap-v3";
/// The listener's proof, in its accept: SHA-256(secret | connector's nonce | listener's nonce |
/// this). Both nonces, so it is worth nothing for another connection; its own label, so a
/// connector's proof cannot be reflected back as one.
const LISTENER_LABEL: &[u8] = b"doorbell-bootstrap-v3-listener";
const HELLO_LEN: usize = HELLO_MAGIC.len() + NONCE_LEN;
/// Cap on a listener's wait for one connector's answer: strangers cost at most this.
const HANDSHAKE_TIMEOUT_CAP: Duration = Duration::from_secs(5);
/// How often an accept loop looks at its stop flag.
const ACCEPT_POLL: Duration = Duration::from_millis(20);
/// Most handshakes one listener serves at once (a thread each); connections beyond it are closed
/// unanswered, so a flood of strangers costs at most this many threads for
/// `HANDSHAKE_TIMEOUT_CAP` each. A job's ranks arrive well below it (every rank connects once to
/// rank 0 and to each lower rank), and one turned away retries until its deadline.
pub(super) const MAX_HANDSHAKES: usize = 256;

/// The listener's proof for an accept (see [`LISTENER_LABEL`]).
fn listener_proof(secret: &[u8], theirs: &[u8; NONCE_LEN], mine: &[u8]) -> [u8; DIGEST_LEN] {
    let mut nonces = [0u8; 2 * NONCE_LEN];
    nonces[..NONCE_LEN].copy_from_slice(theirs);
    nonces[NONCE_LEN..].copy_from_slice(mine);
    auth_digest(secret, &nonces, LISTENER_LABEL)
}

/// What a connector says about itself in the handshake.
pub(super) struct Ident<'a> {
    pub(super) me: usize,
    pub(super) world_size: usize,
    pub(super) secret: &'a [u8],
    pub(super) listen_port: u16,
}

/// An authenticated incoming connection.
pub(super) struct Joined {
    pub(super) rank: usize,
    /// The connection, its frames sealed with the key both nonces gave.
    pub(super) stream: Conn,
    /// Where the connector's own listener is: the ip its connection came from, its port.
    pub(super) listen_addr: SocketAddr,
}

struct AcceptState {
    claimed: Vec<bool>,
    /// Once set, every later handshake is rejected with this blame and reason.
    closed: Option<(Option<usize>, String)>,
}

pub(super) struct AcceptCtx {
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
    pub(super) fn new(
        cfg: &BootstrapConfig,
        accept_from: Range<usize>,
        deadline: Instant,
    ) -> AcceptCtx {
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
pub(super) struct Acceptor {
    ctx: Arc<AcceptCtx>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
    joined: mpsc::Receiver<Joined>,
}

impl Acceptor {
    pub(super) fn start(listener: TcpListener, ctx: AcceptCtx) -> Result<Acceptor> {
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

    pub(super) fn next(&self, deadline: Instant) -> Option<Joined> {
        let wait = deadline.checked_duration_since(Instant::now())?;
        self.joined.recv_timeout(wait).ok()
    }

    /// Rejects every later handshake; returns the connections that were accepted before.
    pub(super) fn close(&self, blamed: Option<usize>, why: String) -> Vec<Joined> {
        lock(&self.ctx.state).closed = Some((blamed, why));
        // Handshake threads claim, reply and queue under the state lock, so after setting
        // `closed` every accepted connection is already queued.
        self.joined.try_iter().collect()
    }

    pub(super) fn stop(&mut self) {
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
    /// Counts a handshake thread out however it ends.
    struct InFlight(Arc<AtomicUsize>);
    impl Drop for InFlight {
        fn drop(&mut self) {
            self.0.fetch_sub(1, Ordering::Relaxed);
        }
    }
    let in_flight = Arc::new(AtomicUsize::new(0));
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
                    if in_flight.load(Ordering::Relaxed) >= MAX_HANDSHAKES {
                        tracing::warn!(
                            rank = ctx.me,
                            "bootstrap: closed a connection from {from} unanswered: \
                             {MAX_HANDSHAKES} handshakes already in progress"
                        );
                        continue;
                    }
                    in_flight.fetch_add(1, Ordering::Relaxed);
                    let slot = InFlight(Arc::clone(&in_flight));
                    let (ctx, tx) = (Arc::clone(&ctx), tx.clone());
                    let spawned = thread::Builder::new()
                        .name(format!("doorbell-bs{}-hs", ctx.me))
                        .spawn(move || {
                            let _slot = slot;
                            serve_handshake(stream, from, &ctx, &tx)
                        });
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
                let proof = listener_proof(&ctx.secret, &answer.nonce, &nonce);
                stream
                    .write_all(&encode_verdict(&Verdict::Accept { remaining, proof }))
                    .map_err(|e| format!("sending the accept to rank {rank}: {e}"))?;
                state.claimed[rank] = true;
                let listen_addr = SocketAddr::new(from.ip().to_canonical(), answer.listen_port);
                // The receiver is gone only once this listener gave up; then the stream closes.
                let key = frame_key(&ctx.secret, &answer.nonce, &nonce);
                let _ = tx.send(Joined {
                    rank,
                    stream: Conn::new(stream, key, me, rank),
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
pub(super) fn dial(
    ident: &Ident<'_>,
    peer: usize,
    shown: &str,
    resolve: &dyn Fn() -> io::Result<Vec<SocketAddr>>,
    deadline: Instant,
) -> Result<(Conn, Duration)> {
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
) -> std::result::Result<(Conn, Duration), DialFail> {
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
    let theirs = &hello[HELLO_MAGIC.len()..];
    let nonce: [u8; NONCE_LEN] = random_bytes().map_err(DialFail::Final)?;
    let answer = Answer {
        digest: auth_digest(ident.secret, theirs, AUTH_LABEL),
        rank: ident.me as u64,
        world_size: ident.world_size as u64,
        listen_port: ident.listen_port,
        nonce,
    };
    stream
        .write_all(&encode_answer(&answer))
        .map_err(|e| retry("answering", e))?;
    match read_verdict(&mut stream) {
        Ok(Verdict::Accept { remaining, proof })
            if ct_eq(&proof, &listener_proof(ident.secret, &nonce, theirs)) =>
        {
            let key = frame_key(ident.secret, &nonce, theirs);
            Ok((Conn::new(stream, key, ident.me, peer), remaining))
        }
        Ok(Verdict::Accept { .. }) => Err(DialFail::Final(Error::Bootstrap {
            me: ident.me,
            rank: Some(peer),
            why: format!(
                "{shown} accepted this rank without proving the job secret: it is not rank \
                 {peer} of this job (another program on the port, or a job with another secret)"
            ),
        })),
        Ok(Verdict::Reject { blamed, why }) => Err(DialFail::Final(Error::Bootstrap {
            me: ident.me,
            rank: blamed,
            why: format!("rank {peer} at {shown} rejected this rank: {why}"),
        })),
        Err(e) => Err(retry("reading the verdict from", e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
            heartbeat: Duration::ZERO,
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
            nonce: [3u8; NONCE_LEN],
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

    /// A listener that speaks the protocol and accepts, with `proof` computing its proof from
    /// the connector's nonce and its own; returns the error the connector got, if any.
    fn dial_impostor(
        proof: impl Fn(&[u8; NONCE_LEN], &[u8]) -> [u8; DIGEST_LEN] + Sync,
    ) -> Option<String> {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        thread::scope(|s| {
            s.spawn(|| {
                let (mut stream, _) = listener.accept().unwrap();
                let mine = [5u8; NONCE_LEN];
                let mut hello = HELLO_MAGIC.to_vec();
                hello.extend_from_slice(&mine);
                stream.write_all(&hello).unwrap();
                let mut buf = [0u8; ANSWER_LEN];
                stream.read_exact(&mut buf).unwrap();
                let answer = decode_answer(&buf);
                let verdict = Verdict::Accept {
                    remaining: Duration::from_secs(1),
                    proof: proof(&answer.nonce, &mine),
                };
                let _ = stream.write_all(&encode_verdict(&verdict));
            });
            let ident = Ident {
                me: 1,
                world_size: 2,
                secret: b"s3cret",
                listen_port: 7,
            };
            let resolve = move || -> io::Result<Vec<SocketAddr>> { Ok(vec![addr]) };
            let deadline = Instant::now() + Duration::from_secs(2);
            dial(&ident, 0, "rank 0", &resolve, deadline)
                .err()
                .map(|e| e.to_string())
        })
    }

    #[test]
    fn a_listener_must_prove_the_secret_too() {
        // The real thing: the secret, this connection's two nonces.
        assert_eq!(
            dial_impostor(|theirs, mine| listener_proof(b"s3cret", theirs, mine)),
            None
        );
        // A stranger on the port, without the secret.
        let e = dial_impostor(|theirs, mine| listener_proof(b"guess", theirs, mine)).unwrap();
        assert!(e.contains("without proving the job secret"), "{e}");
        // A proof made for another connection (another connector nonce), replayed.
        let e =
            dial_impostor(|_, mine| listener_proof(b"s3cret", &[1u8; NONCE_LEN], mine)).unwrap();
        assert!(e.contains("without proving the job secret"), "{e}");
        // The connector's own proof reflected back.
        let e = dial_impostor(|_, mine| auth_digest(b"s3cret", mine, AUTH_LABEL)).unwrap();
        assert!(e.contains("without proving the job secret"), "{e}");
    }
}
