//! `ncclGetUniqueId` and the rendezvous behind `ncclCommInitRank`.
//!
//! NCCL's unique id is 128 opaque bytes that one rank makes and the caller hands to every rank
//! out of band; the ranks then find each other through it. doorbell's bootstrap needs rank 0's
//! address and port, every rank's place on its host, and a job secret, none of which the id's
//! maker knows (it need not become rank 0, and the number of ranks comes only with the init
//! calls). So the maker runs a small rendezvous server, as NCCL's bootstrap root does: the id
//! carries its address and a fresh secret; each initializing rank registers there (rank, rank
//! count, host name, and for rank 0 the port it will listen on) and, once all have, learns rank
//! 0's address and port and its local rank and count. Then doorbell's own bootstrap connects,
//! proving the secret as usual.
//!
//! The id's bytes: `[0, 8)` a magic ("dbnccl" and a layout version), `[8, 10)` the server's
//! port (big-endian), `[10]` its address family (4 or 6), `[12, 28)` its address, `[28, 60)`
//! the secret, the rest zero. The registration proves knowledge of the secret with a hash of it
//! (a listener of the network could replay that to the server and spoil a rendezvous, not join
//! the job: the bootstrap's handshake needs the secret itself).

use crate::abi::{NcclUniqueId, UNIQUE_ID_BYTES};
use crate::error::ShimError;
use doorbell::job::bootstrap::{route_source, BootstrapConfig};
use sha2::{Digest, Sha256};
use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

const MAGIC: [u8; 8] = *b"dbnccl\x00\x01";
const SECRET_BYTES: usize = 32;
/// Longest host name a registration carries.
const MAX_HOST: usize = 255;

/// A parsed unique id: where the rendezvous server listens, and the job's secret.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UniqueId {
    pub server: SocketAddr,
    pub secret: [u8; SECRET_BYTES],
}

impl UniqueId {
    pub fn encode(&self) -> NcclUniqueId {
        let mut b = [0u8; UNIQUE_ID_BYTES];
        b[..8].copy_from_slice(&MAGIC);
        b[8..10].copy_from_slice(&self.server.port().to_be_bytes());
        match self.server.ip() {
            IpAddr::V4(ip) => {
                b[10] = 4;
                b[12..16].copy_from_slice(&ip.octets());
            }
            IpAddr::V6(ip) => {
                b[10] = 6;
                b[12..28].copy_from_slice(&ip.octets());
            }
        }
        b[28..28 + SECRET_BYTES].copy_from_slice(&self.secret);
        NcclUniqueId::from_bytes(&b)
    }

    pub fn decode(id: &NcclUniqueId) -> Result<UniqueId, ShimError> {
        let b = id.bytes();
        if b[..8] != MAGIC {
            return Err(ShimError::invalid_argument(
                "ncclUniqueId: not one this library's ncclGetUniqueId made (a real NCCL's, or \
                 bytes that were not passed on whole)",
            ));
        }
        let port = u16::from_be_bytes([b[8], b[9]]);
        let ip = match b[10] {
            4 => IpAddr::V4(Ipv4Addr::new(b[12], b[13], b[14], b[15])),
            6 => IpAddr::V6(Ipv6Addr::from(<[u8; 16]>::try_from(&b[12..28]).unwrap())),
            f => {
                return Err(ShimError::invalid_argument(format!(
                    "ncclUniqueId: address family {f}, not 4 or 6 (a damaged id)"
                )))
            }
        };
        let mut secret = [0u8; SECRET_BYTES];
        secret.copy_from_slice(&b[28..28 + SECRET_BYTES]);
        Ok(UniqueId {
            server: SocketAddr::new(ip, port),
            secret,
        })
    }

    /// What a registration sends to prove the secret.
    fn token(&self) -> [u8; 32] {
        let mut h = Sha256::new();
        h.update(b"doorbell-nccl rendezvous\0");
        h.update(self.secret);
        h.finalize().into()
    }
}

fn random_secret() -> Result<[u8; SECRET_BYTES], ShimError> {
    let mut s = [0u8; SECRET_BYTES];
    let mut got = 0;
    while got < s.len() {
        // SAFETY: writes at most the slice's remaining length into it.
        let n = unsafe { libc::getrandom(s[got..].as_mut_ptr().cast(), s.len() - got, 0) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(ShimError::new(
                crate::abi::SYSTEM_ERROR,
                format!("getrandom: {e}"),
            ));
        }
        got += n as usize;
    }
    Ok(s)
}

/// The address this host is reached at: `DOORBELL_NCCL_ADDR` when set (an IP), else its
/// address on the route to the outside (the kernel picks it; no packet is sent), else loopback.
fn host_address() -> Result<IpAddr, ShimError> {
    if let Ok(v) = std::env::var("DOORBELL_NCCL_ADDR") {
        return v.trim().parse::<IpAddr>().map_err(|e| {
            ShimError::invalid_argument(format!(
                "DOORBELL_NCCL_ADDR={v:?}: not an IP address ({e})"
            ))
        });
    }
    Ok(route_source(IpAddr::V4(Ipv4Addr::new(192, 0, 2, 1)))
        .filter(|a| !a.is_unspecified())
        .unwrap_or(IpAddr::V4(Ipv4Addr::LOCALHOST)))
}

/// The rendezvous' deadline: doorbell's bootstrap timeout (`DOORBELL_BOOTSTRAP_TIMEOUT_S`).
fn timeout() -> Result<Duration, ShimError> {
    doorbell::job::config::Settings::from_env()
        .map(|s| s.bootstrap_timeout)
        .map_err(|e| ShimError::from_doorbell(&e))
}

/// `ncclGetUniqueId`: starts this id's rendezvous server (a thread that serves one
/// communicator's ranks, then ends; or gives up after the bootstrap timeout) and returns the id.
pub fn create() -> Result<UniqueId, ShimError> {
    let listener = TcpListener::bind((host_address()?, 0)).map_err(|e| {
        ShimError::new(
            crate::abi::SYSTEM_ERROR,
            format!("rendezvous listener: {e}"),
        )
    })?;
    let server = listener.local_addr().map_err(|e| {
        ShimError::new(
            crate::abi::SYSTEM_ERROR,
            format!("rendezvous listener: {e}"),
        )
    })?;
    let id = UniqueId {
        server,
        secret: random_secret()?,
    };
    let (token, deadline) = (id.token(), Instant::now() + timeout()?);
    std::thread::Builder::new()
        .name("doorbell-nccl-rendezvous".into())
        .spawn(move || serve(listener, token, deadline))
        .map_err(|e| ShimError::new(crate::abi::SYSTEM_ERROR, format!("rendezvous thread: {e}")))?;
    Ok(id)
}

/// What one rank registered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RegInfo {
    pub rank: u32,
    pub nranks: u32,
    pub host: String,
    /// Rank 0's bootstrap address and port (empty and 0 for the others).
    pub addr: String,
    pub port: u16,
}

/// A registration and the connection its answer goes back on.
struct Registration {
    info: RegInfo,
    stream: TcpStream,
}

fn read_exact_by(s: &mut TcpStream, buf: &mut [u8], deadline: Instant) -> std::io::Result<()> {
    let left = deadline
        .saturating_duration_since(Instant::now())
        .max(Duration::from_millis(1));
    s.set_read_timeout(Some(left))?;
    s.read_exact(buf)
}

fn read_string(s: &mut TcpStream, deadline: Instant) -> std::io::Result<String> {
    let mut len = [0u8; 2];
    read_exact_by(s, &mut len, deadline)?;
    let n = u16::from_le_bytes(len) as usize;
    if n > MAX_HOST + 64 {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            "string too long",
        ));
    }
    let mut b = vec![0u8; n];
    read_exact_by(s, &mut b, deadline)?;
    String::from_utf8(b)
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::InvalidData, "not UTF-8"))
}

fn put_string(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u16).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

/// Reads a registration; None for a connection that does not prove the secret or speaks
/// something else (dropped).
fn read_registration(
    mut s: TcpStream,
    token: &[u8; 32],
    deadline: Instant,
) -> Option<Registration> {
    let mut t = [0u8; 32];
    read_exact_by(&mut s, &mut t, deadline).ok()?;
    if &t != token {
        return None;
    }
    let mut w = [0u8; 8];
    read_exact_by(&mut s, &mut w, deadline).ok()?;
    let host = read_string(&mut s, deadline).ok()?;
    let addr = read_string(&mut s, deadline).ok()?;
    let mut p = [0u8; 2];
    read_exact_by(&mut s, &mut p, deadline).ok()?;
    Some(Registration {
        info: RegInfo {
            rank: u32::from_le_bytes(w[..4].try_into().unwrap()),
            nranks: u32::from_le_bytes(w[4..].try_into().unwrap()),
            host,
            addr,
            port: u16::from_le_bytes(p),
        },
        stream: s,
    })
}

/// Each registration's answer, once every rank of the communicator registered: (local rank,
/// ranks on its host, rank 0's address and port); or why there is none.
pub fn answers(regs: &[RegInfo]) -> Result<Vec<(u32, u32, String, u16)>, String> {
    let n = regs.first().map_or(0, |r| r.nranks);
    if let Some(r) = regs.iter().find(|r| r.nranks != n) {
        return Err(format!(
            "rank {} says {} ranks, another {n}",
            r.rank, r.nranks
        ));
    }
    let mut seen = vec![false; n as usize];
    for r in regs {
        if r.rank >= n {
            return Err(format!("rank {} of {n} ranks", r.rank));
        }
        if std::mem::replace(&mut seen[r.rank as usize], true) {
            return Err(format!("rank {} registered twice with this id", r.rank));
        }
    }
    if regs.len() != n as usize {
        return Err(format!("{} of {n} ranks registered", regs.len()));
    }
    let root = regs
        .iter()
        .find(|r| r.rank == 0)
        .expect("every rank registered, once");
    Ok(regs
        .iter()
        .map(|r| {
            let same: Vec<u32> = regs
                .iter()
                .filter(|q| q.host == r.host)
                .map(|q| q.rank)
                .collect();
            let local = same.iter().filter(|&&q| q < r.rank).count() as u32;
            (local, same.len() as u32, root.addr.clone(), root.port)
        })
        .collect())
}

fn reply(s: &mut TcpStream, answer: Result<&(u32, u32, String, u16), &str>) {
    let mut out = Vec::new();
    match answer {
        Ok((local, count, addr, port)) => {
            out.push(0);
            out.extend_from_slice(&local.to_le_bytes());
            out.extend_from_slice(&count.to_le_bytes());
            put_string(&mut out, addr);
            out.extend_from_slice(&port.to_le_bytes());
        }
        Err(msg) => {
            out.push(1);
            put_string(&mut out, &msg[..msg.len().min(1024)]);
        }
    }
    let _ = s.write_all(&out);
}

/// The rendezvous server: registrations until every rank of the communicator is in, then the
/// answers; at the deadline, an error to whoever registered.
fn serve(listener: TcpListener, token: [u8; 32], deadline: Instant) {
    let _ = listener.set_nonblocking(true);
    let mut regs: Vec<Registration> = Vec::new();
    loop {
        let n = regs.first().map_or(0, |r| r.info.nranks as usize);
        // Every rank in, or a registration that no set of ranks can complete.
        if n > 0 && (regs.len() >= n || regs.iter().any(|r| r.info.nranks as usize != n)) {
            break;
        }
        if Instant::now() >= deadline {
            let msg = format!(
                "rendezvous: {} of {n} ranks arrived before the bootstrap timeout \
                 (DOORBELL_BOOTSTRAP_TIMEOUT_S)",
                regs.len()
            );
            for r in &mut regs {
                reply(&mut r.stream, Err(&msg));
            }
            return;
        }
        match listener.accept() {
            Ok((s, _)) => {
                let _ = s.set_nonblocking(false);
                // A registration comes right after the connection: a peer that sends nothing
                // holds the server for at most a few seconds.
                let by = deadline.min(Instant::now() + Duration::from_secs(5));
                if let Some(r) = read_registration(s, &token, by) {
                    regs.push(r);
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(2))
            }
            Err(_) => std::thread::sleep(Duration::from_millis(10)),
        }
    }
    let infos: Vec<RegInfo> = regs.iter().map(|r| r.info.clone()).collect();
    match answers(&infos) {
        Ok(a) => {
            for (r, ans) in regs.iter_mut().zip(&a) {
                reply(&mut r.stream, Ok(ans));
            }
        }
        Err(msg) => {
            let msg = format!("rendezvous: {msg}");
            for r in &mut regs {
                reply(&mut r.stream, Err(&msg));
            }
        }
    }
}

fn host_name() -> String {
    let mut name = [0u8; 256];
    // SAFETY: gethostname writes at most `len` bytes into the buffer.
    unsafe { libc::gethostname(name.as_mut_ptr() as *mut libc::c_char, name.len() - 1) };
    let n = name.iter().position(|&b| b == 0).unwrap_or(0).min(MAX_HOST);
    String::from_utf8_lossy(&name[..n]).into_owned()
}

/// This host's address on its route to `ip` (loopback to loopback).
fn route_to(ip: IpAddr) -> IpAddr {
    route_source(ip)
        .filter(|a| !a.is_unspecified())
        .unwrap_or(ip)
}

/// The rendezvous of rank `rank` of `nranks` on `id` (in `ncclCommInitRank`): registers with the
/// id's server and returns doorbell's bootstrap settings for this rank. With `host` the host
/// name registered (tests place threads on different "hosts"; None: this one's).
pub fn rendezvous(
    id: &UniqueId,
    rank: usize,
    nranks: usize,
    host: Option<&str>,
) -> Result<BootstrapConfig, ShimError> {
    if nranks == 0 || rank >= nranks || nranks > u32::MAX as usize {
        return Err(ShimError::invalid_argument(format!(
            "rank {rank} of {nranks} ranks: 0 <= rank < nranks"
        )));
    }
    let settings =
        doorbell::job::config::Settings::from_env().map_err(|e| ShimError::from_doorbell(&e))?;
    let deadline = Instant::now() + settings.bootstrap_timeout;
    let remote = |what: String| ShimError::new(crate::abi::REMOTE_ERROR, what);
    // Rank 0 will listen for the bootstrap on its address toward the server.
    let (addr, port) = if rank == 0 {
        let port = doorbell::job::launch::free_port().map_err(|e| ShimError::from_doorbell(&e))?;
        (route_to(id.server.ip()).to_string(), port)
    } else {
        (String::new(), 0)
    };
    let mut s = loop {
        match TcpStream::connect_timeout(&id.server, Duration::from_secs(1)) {
            Ok(s) => break s,
            Err(e) if Instant::now() >= deadline => {
                return Err(remote(format!(
                    "rendezvous at {} (the maker of the ncclUniqueId): {e}",
                    id.server
                )))
            }
            Err(_) => std::thread::sleep(Duration::from_millis(20)),
        }
    };
    let mut msg = Vec::new();
    msg.extend_from_slice(&id.token());
    msg.extend_from_slice(&(rank as u32).to_le_bytes());
    msg.extend_from_slice(&(nranks as u32).to_le_bytes());
    let me = host.map_or_else(host_name, str::to_owned);
    put_string(&mut msg, &me[..me.len().min(MAX_HOST)]);
    put_string(&mut msg, &addr);
    msg.extend_from_slice(&port.to_le_bytes());
    s.write_all(&msg)
        .map_err(|e| remote(format!("rendezvous at {}: {e}", id.server)))?;
    let io = |e: std::io::Error| {
        remote(format!(
            "rendezvous at {}: no answer ({e}); are all {nranks} ranks initializing with this id?",
            id.server
        ))
    };
    let mut status = [0u8; 1];
    read_exact_by(&mut s, &mut status, deadline).map_err(io)?;
    if status[0] != 0 {
        let why = read_string(&mut s, deadline).map_err(io)?;
        return Err(ShimError::new(crate::abi::INVALID_USAGE, why));
    }
    let mut w = [0u8; 8];
    read_exact_by(&mut s, &mut w, deadline).map_err(io)?;
    let master_addr = read_string(&mut s, deadline).map_err(io)?;
    let mut p = [0u8; 2];
    read_exact_by(&mut s, &mut p, deadline).map_err(io)?;
    Ok(BootstrapConfig {
        rank,
        world_size: nranks,
        local_rank: u32::from_le_bytes(w[..4].try_into().unwrap()) as usize,
        local_world_size: u32::from_le_bytes(w[4..].try_into().unwrap()) as usize,
        master_addr,
        master_port: u16::from_le_bytes(p),
        secret: id.secret.to_vec(),
        timeout: settings.bootstrap_timeout,
        heartbeat: settings.heartbeat_timeout,
    })
}
