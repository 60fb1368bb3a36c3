//! Rank 0's rendezvous and the full mesh after it: rank 0 collects every rank's listener address
//! and sends each the table (or an abort naming the missing ranks); then every other rank dials the
//! ranks below it and accepts the ranks above it.
//!
//! This module owns the rendezvous deadline, the choice of listen addresses and the decision of
//! who is missing. It must never return a partial mesh: it returns one link to every other rank,
//! or fails naming a rank that did not come, and rank 0 first tells the ranks that did join why.

use super::handshake::{dial, AcceptCtx, Acceptor, Ident, Joined};
use super::wire::{decode_abort, decode_table, encode_abort, encode_table, Conn, Kind};
use super::{fmt_ranks, BootstrapConfig, FAREWELL_WRITE_TIMEOUT};
use crate::error::{Error, Result};
use crate::job::config::Settings;
use crate::job::socket::fmt_duration;
use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, ToSocketAddrs, UdpSocket};
use std::time::{Duration, Instant};

/// Extra time a rank waits for rank 0's verdict beyond rank 0's own deadline.
const ABORT_MARGIN: Duration = Duration::from_secs(1);

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

/// Whether bootstrap listeners bind every interface (`DOORBELL_BOOTSTRAP_LISTEN_ALL`) instead of
/// the one address the job reaches this rank at.
pub(super) fn listen_all() -> Result<bool> {
    Ok(Settings::from_env()?.bootstrap_listen_all)
}

/// `MASTER_ADDR`'s addresses of the family the job uses (empty when it does not resolve).
fn master_ips(cfg: &BootstrapConfig, v6: bool) -> Vec<IpAddr> {
    let bare = cfg
        .master_addr
        .trim_start_matches('[')
        .trim_end_matches(']');
    (bare, cfg.master_port)
        .to_socket_addrs()
        .map(|a| a.map(|a| a.ip()).filter(|ip| ip.is_ipv6() == v6).collect())
        .unwrap_or_default()
}

/// This host's address on its route to `ip` (the kernel answers for an unconnected UDP socket;
/// no packet is sent), or None where there is no route.
pub fn route_source(ip: IpAddr) -> Option<IpAddr> {
    let sock = UdpSocket::bind(SocketAddr::new(unspecified(ip.is_ipv6()), 0)).ok()?;
    sock.connect(SocketAddr::new(ip, 9)).ok()?;
    Some(sock.local_addr().ok()?.ip())
}

/// Where a rank other than 0 listens: its address on the route to rank 0, which is also the
/// address its connection to rank 0 comes from and so the one rank 0 tells the others; every
/// interface only with `DOORBELL_BOOTSTRAP_LISTEN_ALL=1` or when no route is known.
fn member_listen_ip(cfg: &BootstrapConfig, v6: bool) -> Result<IpAddr> {
    if listen_all()? {
        return Ok(unspecified(v6));
    }
    Ok(master_ips(cfg, v6)
        .into_iter()
        .find_map(route_source)
        .unwrap_or(unspecified(v6)))
}

/// Rank 0's listener: on `MASTER_ADDR`'s own address (with MASTER_ADDR=127.0.0.1 nothing off
/// this host can connect), else, when that address is not one of this host's (NAT, a proxy), on
/// every interface with a warning; on every interface with `DOORBELL_BOOTSTRAP_LISTEN_ALL=1`.
fn root_listener(cfg: &BootstrapConfig, v6: bool) -> Result<TcpListener> {
    let cannot = |addr: SocketAddr, e: io::Error| Error::Bootstrap {
        me: 0,
        rank: None,
        why: format!(
            "cannot listen on {addr} ({}): {e}; set MASTER_PORT to a free port",
            master_shown(cfg)
        ),
    };
    let every = SocketAddr::new(unspecified(v6), cfg.master_port);
    if !listen_all()? {
        for ip in master_ips(cfg, v6) {
            let addr = SocketAddr::new(ip, cfg.master_port);
            // std sets SO_REUSEADDR on Unix listeners, so a previous job's TIME_WAIT does not
            // block us.
            match TcpListener::bind(addr) {
                Ok(l) => return Ok(l),
                Err(e) if e.kind() == io::ErrorKind::AddrNotAvailable => continue,
                Err(e) => return Err(cannot(addr, e)),
            }
        }
        tracing::warn!(
            master = %master_shown(cfg),
            "MASTER_ADDR is not an address of this host: rank 0 listens on every interface \
             (set DOORBELL_BOOTSTRAP_LISTEN_ALL=1 to say so and silence this)"
        );
    }
    TcpListener::bind(every).map_err(|e| cannot(every, e))
}

/// Rank 0: waits for every rank, then sends each the address table (or an abort).
pub(super) fn rendezvous_root(cfg: &BootstrapConfig) -> Result<Vec<Option<Conn>>> {
    let v6 = wants_ipv6(&cfg.master_addr, cfg.master_port);
    rendezvous_root_on(cfg, root_listener(cfg, v6)?)
}

/// Rank 0's rendezvous on a listener already bound (a shrunk job's new root binds an ephemeral
/// port first and tells the others which).
pub(super) fn rendezvous_root_on(
    cfg: &BootstrapConfig,
    listener: TcpListener,
) -> Result<Vec<Option<Conn>>> {
    let n = cfg.world_size;
    let deadline = Instant::now() + cfg.timeout;
    let bind_addr = listener
        .local_addr()
        .map_err(|e| Error::io("reading the rendezvous listener's address", e))?;
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
            let _ = j.stream.send(Kind::Abort, 0, &payload);
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
    let mut links: Vec<Option<Conn>> = joined.into_iter().map(|j| j.map(|j| j.stream)).collect();
    for rank in 1..n {
        let Some(stream) = links[rank].as_mut() else {
            continue;
        };
        let sent = stream
            .set_write_timeout(Some(cfg.timeout))
            .and_then(|()| stream.send(Kind::Table, 0, &payload));
        if let Err(e) = sent {
            let why = format!("lost before it received the address table: {e}");
            let payload = encode_abort(Some(rank), &why);
            for other in links.iter_mut().flatten() {
                let _ = other.set_write_timeout(Some(FAREWELL_WRITE_TIMEOUT));
                let _ = other.send(Kind::Abort, 0, &payload);
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
pub(super) fn rendezvous_member(cfg: &BootstrapConfig) -> Result<Vec<Option<Conn>>> {
    let (me, n) = (cfg.rank, cfg.world_size);
    let deadline = Instant::now() + cfg.timeout;
    let v6 = wants_ipv6(&cfg.master_addr, cfg.master_port);
    let listener = TcpListener::bind(SocketAddr::new(member_listen_ip(cfg, v6)?, 0))
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
    let mut links: Vec<Option<Conn>> = (0..n).map(|_| None).collect();
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
fn read_table(root: &mut Conn, cfg: &BootstrapConfig, until: Instant) -> Result<Vec<SocketAddr>> {
    let me = cfg.rank;
    let fail = |rank: Option<usize>, why: String| Error::Bootstrap { me, rank, why };
    let wait = until
        .saturating_duration_since(Instant::now())
        .max(Duration::from_millis(1));
    root.set_read_timeout(Some(wait))
        .map_err(|e| Error::io("configuring the link to rank 0", e))?;
    match root.recv() {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn listeners_follow_the_address_family_of_rank_0() {
        assert!(wants_ipv6("::1", 1));
        assert!(wants_ipv6("[::1]", 1));
        assert!(!wants_ipv6("127.0.0.1", 1));
    }
}
