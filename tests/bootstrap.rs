//! Bootstrap tests on real sockets. Quick cases run every rank as a thread of this process; the
//! cases about processes (a rank that never comes, one that dies, a stranger on the port) run each
//! rank as a process of this same test binary, started with `launch::spawn_ranks` and running
//! `child_entry` with the case in `DOORBELL_TEST_SCENARIO`.

use doorbell::job::bootstrap::{Bootstrap, BootstrapConfig};
use doorbell::job::launch::{free_port, spawn_ranks, SpawnOptions};
use doorbell::Error;
use std::ffi::OsString;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

const SCENARIO: &str = "DOORBELL_TEST_SCENARIO";

fn config(rank: usize, world_size: usize, port: u16, timeout: Duration) -> BootstrapConfig {
    BootstrapConfig {
        rank,
        world_size,
        local_rank: rank,
        local_world_size: world_size,
        master_addr: "127.0.0.1".into(),
        master_port: port,
        secret: format!("test-secret-{port}").into_bytes(),
        timeout,
        heartbeat: Duration::from_secs(5),
    }
}

/// Runs `body` on `configs.len()` threads, one per config, each with its `connect` result.
fn threads<T: Send>(
    configs: Vec<BootstrapConfig>,
    body: impl Fn(doorbell::Result<Bootstrap>) -> T + Sync,
) -> Vec<T> {
    std::thread::scope(|s| {
        let handles: Vec<_> = configs
            .into_iter()
            .map(|cfg| {
                let body = &body;
                s.spawn(move || body(Bootstrap::connect(cfg)))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

fn world(n: usize, timeout: Duration) -> Vec<BootstrapConfig> {
    let port = free_port().unwrap();
    (0..n).map(|r| config(r, n, port, timeout)).collect()
}

fn blamed(e: &Error) -> Option<usize> {
    match e {
        Error::Bootstrap { rank, .. } => *rank,
        _ => None,
    }
}

fn pattern(rank: usize, round: usize, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i.wrapping_mul(31) ^ rank.wrapping_mul(7) ^ round) as u8)
        .collect()
}

fn note(from: usize, to: usize, tag: u64, i: usize) -> Vec<u8> {
    format!("{from}->{to} tag {tag} #{i}").into_bytes()
}

/// Everything a healthy job does: all_gathers in a row, barriers, tagged point-to-point messages
/// received in another order than sent, messages to itself, and multi-MiB payloads.
fn exercise(b: &Bootstrap) {
    let (me, n) = (b.rank(), b.world_size());
    for round in 0..3 {
        let all = b
            .all_gather(&pattern(me, round, 10 * (me + 1) + round))
            .unwrap();
        assert_eq!(all.len(), n);
        for (r, part) in all.iter().enumerate() {
            assert_eq!(
                part,
                &pattern(r, round, 10 * (r + 1) + round),
                "round {round}"
            );
        }
    }
    b.barrier().unwrap();
    let tags = [1u64, 7, u64::MAX];
    for i in 0..5 {
        for tag in tags {
            for peer in 0..n {
                b.send(peer, tag, &note(me, peer, tag, i)).unwrap();
            }
        }
    }
    for tag in tags.iter().rev() {
        for peer in (0..n).rev() {
            for i in 0..5 {
                assert_eq!(b.recv(peer, *tag).unwrap(), note(peer, me, *tag, i));
            }
        }
    }
    let next = (me + 1) % n;
    let prev = (me + n - 1) % n;
    b.send(next, 99, &pattern(me, 99, 3 << 20)).unwrap();
    assert_eq!(b.recv(prev, 99).unwrap(), pattern(prev, 99, 3 << 20));
    let all = b.all_gather(&pattern(me, 5, 2 << 20)).unwrap();
    for (r, part) in all.iter().enumerate() {
        assert!(
            part == &pattern(r, 5, 2 << 20),
            "2 MiB from rank {r} differs"
        );
    }
    b.barrier().unwrap();
}

#[test]
fn bootstrap_is_send_and_sync() {
    fn check<T: Send + Sync>() {}
    check::<Bootstrap>();
}

#[test]
fn four_threads_gather_and_message() {
    let t0 = Instant::now();
    threads(world(4, Duration::from_secs(10)), |b| exercise(&b.unwrap()));
    eprintln!("4 ranks exercised in {:?}", t0.elapsed());
}

#[test]
fn eight_threads_with_a_late_rank_zero() {
    let configs = world(8, Duration::from_secs(10));
    std::thread::scope(|s| {
        for cfg in configs {
            s.spawn(move || {
                if cfg.rank == 0 {
                    // The others start first and retry until rank 0 listens.
                    std::thread::sleep(Duration::from_millis(500));
                }
                let b = Bootstrap::connect(cfg).unwrap();
                let all = b.all_gather(&[b.rank() as u8; 3]).unwrap();
                assert_eq!(all, (0..8u8).map(|r| vec![r; 3]).collect::<Vec<_>>());
                b.barrier().unwrap();
            });
        }
    });
}

#[test]
fn many_threads_share_one_bootstrap() {
    threads(world(2, Duration::from_secs(10)), |b| {
        let b = b.unwrap();
        let peer = 1 - b.rank();
        std::thread::scope(|s| {
            for tag in 0..4u64 {
                let b = &b;
                s.spawn(move || {
                    for i in 0..100u32 {
                        b.send(peer, tag, &i.to_le_bytes()).unwrap();
                    }
                    for i in 0..100u32 {
                        assert_eq!(b.recv(peer, tag).unwrap(), i.to_le_bytes());
                    }
                });
            }
        });
        b.barrier().unwrap();
    });
}

#[test]
fn one_rank_needs_no_network() {
    let mut cfg = config(0, 1, 0, Duration::from_secs(1));
    cfg.master_addr = "nowhere.invalid".into();
    let b = Bootstrap::connect(cfg).unwrap();
    assert_eq!(b.all_gather(b"x").unwrap(), vec![b"x".to_vec()]);
    b.barrier().unwrap();
    b.send(0, 3, b"self").unwrap();
    assert_eq!(b.recv(0, 3).unwrap(), b"self");
}

#[test]
fn invalid_arguments() {
    let e = Bootstrap::connect(config(2, 2, 1, Duration::from_secs(1))).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument { .. }), "{e}");
    let mut cfg = config(0, 1, 1, Duration::from_secs(1));
    cfg.secret.clear();
    assert!(Bootstrap::connect(cfg).is_err());
    let b = Bootstrap::connect(config(0, 1, 0, Duration::from_secs(1))).unwrap();
    let e = b.send(1, 0, b"").unwrap_err();
    assert!(e.to_string().contains("rank 1"), "{e}");
    assert!(b.recv(5, 0).is_err());
}

#[test]
fn recv_times_out_naming_peer_and_tag() {
    threads(world(2, Duration::from_secs(10)), |b| {
        let b = b.unwrap();
        if b.rank() == 0 {
            b.set_timeout(Duration::from_millis(300));
            let t0 = Instant::now();
            let e = b.recv(1, 42).unwrap_err();
            let waited = t0.elapsed();
            assert!(waited >= Duration::from_millis(300), "{waited:?}");
            assert!(waited < Duration::from_secs(3), "{waited:?}");
            assert_eq!(blamed(&e), Some(1));
            assert!(e.to_string().contains("tag 42"), "{e}");
            b.set_timeout(Duration::from_secs(10));
        }
        b.barrier().unwrap();
    });
}

#[test]
fn dropped_peer_fails_waits_promptly_after_its_last_messages() {
    threads(world(2, Duration::from_secs(20)), |b| {
        let b = b.unwrap();
        if b.rank() == 1 {
            b.send(0, 9, b"last words").unwrap();
            let t0 = Instant::now();
            drop(b);
            assert!(
                t0.elapsed() < Duration::from_secs(2),
                "drop took {:?}",
                t0.elapsed()
            );
            return;
        }
        assert_eq!(b.recv(1, 9).unwrap(), b"last words");
        let t0 = Instant::now();
        let e = b.recv(1, 9).unwrap_err();
        assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
        assert_eq!(blamed(&e), Some(1), "{e}");
        assert!(e.to_string().contains("closed its bootstrap"), "{e}");
        let e = b.barrier().unwrap_err();
        assert_eq!(blamed(&e), Some(1), "{e}");
        assert!(b.send(1, 0, b"x").is_err());
    });
}

#[test]
fn rank_zero_never_comes() {
    let port = free_port().unwrap();
    let t0 = Instant::now();
    let e = Bootstrap::connect(config(1, 2, port, Duration::from_secs(1))).unwrap_err();
    let waited = t0.elapsed();
    assert!(
        waited >= Duration::from_secs(1) && waited < Duration::from_secs(4),
        "{waited:?}"
    );
    assert_eq!(blamed(&e), Some(0), "{e}");
    assert!(e.to_string().contains(&format!("127.0.0.1:{port}")), "{e}");
}

#[test]
fn wrong_world_size_is_a_clear_error() {
    let mut configs = world(2, Duration::from_secs(2));
    configs[1].world_size = 3;
    let errors = threads(configs, |b| b.unwrap_err());
    assert!(
        errors[1].to_string().contains("WORLD_SIZE=3"),
        "{}",
        errors[1]
    );
    assert_eq!(blamed(&errors[0]), Some(1), "{}", errors[0]);
    assert!(
        errors[0].to_string().contains("did not join"),
        "{}",
        errors[0]
    );
}

#[test]
fn duplicate_rank_is_rejected() {
    let mut configs = world(3, Duration::from_secs(2));
    configs[2].rank = 1;
    let results = threads(configs, |b| b.map(drop));
    let text: Vec<String> = results
        .iter()
        .map(|r| r.as_ref().map_or_else(|e| e.to_string(), |()| "ok".into()))
        .collect();
    assert!(
        text.iter().any(|t| t.contains("same rank")),
        "one rank-1 process should be told it is a duplicate: {text:?}"
    );
    // Rank 2 never came: rank 0 and the accepted rank 1 both blame it.
    let blames: Vec<_> = results
        .iter()
        .filter_map(|r| r.as_ref().err().and_then(blamed))
        .collect();
    assert_eq!(blames, vec![2, 2], "{text:?}");
}

// ---------------------------------------------------------------------------------------------
// Multi-process cases.

fn secs(s: u64) -> Duration {
    Duration::from_secs(s)
}

fn spawn_case(case: &str, nranks: usize, timeout_s: u64, extra: &[(&str, String)]) {
    let exe = std::env::current_exe().unwrap();
    let args: Vec<OsString> = [
        "child_entry",
        "--exact",
        "--nocapture",
        "--test-threads=1",
        "-q",
    ]
    .iter()
    .map(OsString::from)
    .collect();
    let mut extra_env = vec![
        (SCENARIO.to_string(), case.to_string()),
        ("DOORBELL_BOOTSTRAP_TIMEOUT_S".into(), timeout_s.to_string()),
    ];
    extra_env.extend(extra.iter().map(|(k, v)| (k.to_string(), v.clone())));
    let t0 = Instant::now();
    let exits = spawn_ranks(
        &exe,
        &args,
        &SpawnOptions {
            nranks,
            extra_env,
            timeout: Some(secs(60)),
            grace: secs(5),
        },
    )
    .unwrap();
    let failed: Vec<String> = exits
        .iter()
        .filter(|e| !e.success())
        .map(ToString::to_string)
        .collect();
    assert!(failed.is_empty(), "case {case}: {failed:?}");
    eprintln!("case {case}: {nranks} processes done in {:?}", t0.elapsed());
}

/// The rank side of the multi-process cases; does nothing unless `DOORBELL_TEST_SCENARIO` is set.
#[test]
fn child_entry() {
    let Ok(case) = std::env::var(SCENARIO) else {
        return;
    };
    let cfg = BootstrapConfig::from_env().unwrap();
    let (rank, timeout) = (cfg.rank, cfg.timeout);
    match case.as_str() {
        "exercise" => exercise(&Bootstrap::connect(cfg).unwrap()),
        "missing" => {
            let t0 = Instant::now();
            let e = Bootstrap::connect(cfg).unwrap_err();
            let waited = t0.elapsed();
            eprintln!("rank {rank} failed as expected after {waited:?}: {e}");
            assert_eq!(blamed(&e), Some(3), "{e}");
            assert!(e.to_string().contains("rank 3"), "{e}");
            assert!(waited < timeout + secs(3), "{waited:?}");
        }
        "dies" => {
            let b = Bootstrap::connect(cfg).unwrap();
            let t0 = Instant::now();
            let first = b.barrier();
            if rank == 2 {
                // Die without a goodbye, as a crash would.
                std::process::exit(0);
            }
            // Rank 2 leaves as soon as its own first barrier completes; a rank still waiting in
            // that barrier for a third rank's contribution may hear of the death first, so the
            // failure may come in either barrier, but it must blame rank 2 and come promptly.
            let e = match first {
                Err(e) => e,
                Ok(()) => b.barrier().unwrap_err(),
            };
            let waited = t0.elapsed();
            eprintln!("rank {rank} failed as expected after {waited:?}: {e}");
            assert_eq!(blamed(&e), Some(2), "{e}");
            assert!(
                waited < secs(3),
                "not prompt: {waited:?} (timeout {timeout:?})"
            );
        }
        "stranger" => {
            // Shows the warnings about dropped strangers in the relayed output.
            let _ = tracing_subscriber::fmt()
                .with_writer(std::io::stderr)
                .with_env_filter("warn")
                .try_init();
            if rank == 2 {
                // Leaves the test's stranger time to knock while rank 0 still listens.
                std::thread::sleep(secs(2));
            }
            let b = Bootstrap::connect(cfg).unwrap();
            let all = b.all_gather(&pattern(rank, 1, 100 + rank)).unwrap();
            for (r, part) in all.iter().enumerate() {
                assert_eq!(part, &pattern(r, 1, 100 + r));
            }
            b.barrier().unwrap();
        }
        other => panic!("unknown scenario {other}"),
    }
}

#[test]
fn processes_gather_and_message() {
    spawn_case("exercise", 4, 20, &[]);
}

#[test]
fn processes_missing_rank_is_named() {
    // Three processes of a four-rank job: rank 3 never comes.
    spawn_case(
        "missing",
        3,
        3,
        &[("WORLD_SIZE", "4".into()), ("LOCAL_WORLD_SIZE", "4".into())],
    );
}

#[test]
fn processes_dead_rank_fails_the_next_barrier_promptly() {
    spawn_case("dies", 4, 20, &[]);
}

#[test]
fn processes_strangers_do_not_disturb_the_job() {
    let port = free_port().unwrap();
    std::thread::scope(|s| {
        let job = s.spawn(|| spawn_case("stranger", 3, 5, &[("MASTER_PORT", port.to_string())]));
        let knock = || {
            let until = Instant::now() + secs(10);
            loop {
                match TcpStream::connect(("127.0.0.1", port)) {
                    Ok(c) => {
                        c.set_read_timeout(Some(secs(10))).unwrap();
                        return c;
                    }
                    Err(e) if Instant::now() < until => {
                        let _ = e;
                        std::thread::sleep(Duration::from_millis(10));
                    }
                    Err(e) => panic!("rank 0 never listened on {port}: {e}"),
                }
            }
        };
        let mut silent = knock();
        let mut wrong = knock();
        let mut garbage = knock();

        let mut hello = [0u8; 40];
        wrong.read_exact(&mut hello).unwrap();
        assert_eq!(&hello[..8], b"DBBOOT03");
        let mut answer = vec![0x5au8; 32];
        answer.extend_from_slice(&1u64.to_le_bytes());
        answer.extend_from_slice(&3u64.to_le_bytes());
        answer.extend_from_slice(&1u16.to_le_bytes());
        answer.extend_from_slice(&[0x33u8; 32]); // the stranger's own nonce
        wrong.write_all(&answer).unwrap();
        let mut verdict = Vec::new();
        wrong.read_to_end(&mut verdict).unwrap();
        assert_eq!(verdict.first(), Some(&0), "a wrong secret must be rejected");
        assert!(String::from_utf8_lossy(&verdict).contains("authentication failed"));

        garbage
            .write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n0123456789012345678901234567890")
            .unwrap();
        assert_closed(&mut garbage);

        job.join().unwrap();
        // The silent stranger is closed at the handshake timeout or when rank 0 exits.
        assert_closed(&mut silent);
    });
}

/// Reads until the other end closes (an orderly close or a reset); a timeout fails the test.
fn assert_closed(c: &mut TcpStream) {
    let mut rest = Vec::new();
    if let Err(e) = c.read_to_end(&mut rest) {
        assert_eq!(
            e.kind(),
            std::io::ErrorKind::ConnectionReset,
            "the stranger's connection should be closed: {e}"
        );
    }
}

/// This host's address on its route towards a documentation address (no packet is sent), when
/// it has one other than loopback.
fn non_loopback_ip() -> Option<std::net::IpAddr> {
    let sock = std::net::UdpSocket::bind("0.0.0.0:0").ok()?;
    sock.connect("192.0.2.1:9").ok()?;
    let ip = sock.local_addr().ok()?.ip();
    (!ip.is_loopback() && !ip.is_unspecified()).then_some(ip)
}

/// With MASTER_ADDR=127.0.0.1 the bootstrap's listeners are on 127.0.0.1 only: while rank 0
/// waits for rank 1, its port answers on loopback and refuses on this host's other address.
#[test]
fn a_listener_for_loopback_is_not_reachable_from_other_interfaces() {
    let port = free_port().unwrap();
    let cfg = config(0, 2, port, Duration::from_secs(3));
    std::thread::scope(|s| {
        let root = s.spawn(move || Bootstrap::connect(cfg));
        let started = Instant::now();
        let mut on_loopback = false;
        while started.elapsed() < Duration::from_secs(2) && !on_loopback {
            on_loopback = TcpStream::connect(("127.0.0.1", port)).is_ok();
            std::thread::sleep(Duration::from_millis(20));
        }
        assert!(on_loopback, "rank 0 never listened on 127.0.0.1:{port}");
        match non_loopback_ip() {
            Some(ip) => {
                let e = TcpStream::connect_timeout(&(ip, port).into(), Duration::from_secs(1))
                    .expect_err("rank 0's listener answered on a non-loopback address");
                assert_eq!(e.kind(), std::io::ErrorKind::ConnectionRefused, "{ip}: {e}");
            }
            None => eprintln!("no non-loopback address here: only the loopback half checked"),
        }
        // Rank 1 never comes: rank 0 gives up at its deadline, naming it.
        let e = root
            .join()
            .unwrap()
            .expect_err("a world of 2 with one rank");
        assert_eq!(blamed(&e), Some(1), "{e}");
    });
}

/// Handshake threads of rank 0's listener now (threads are named `doorbell-bs0-hs`).
fn handshake_threads() -> usize {
    std::fs::read_dir("/proc/self/task")
        .map(|d| {
            d.filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
                .filter(|c| c.trim() == "doorbell-bs0-hs")
                .count()
        })
        .unwrap_or(0)
}

/// A flood of silent connections costs rank 0 at most 256 handshake threads (the listener's cap,
/// `handshake::MAX_HANDSHAKES`): the rest are closed unanswered, and once the strangers go a
/// rank still joins.
#[test]
fn a_flood_of_strangers_is_capped_and_the_job_still_forms() {
    const CAP: usize = 256;
    let port = free_port().unwrap();
    let cfg = world(2, Duration::from_secs(20));
    let (root_cfg, member_cfg) = {
        let mut it = cfg.into_iter().map(|mut c| {
            c.master_port = port;
            c.secret = b"flood".to_vec();
            c
        });
        (it.next().unwrap(), it.next().unwrap())
    };
    std::thread::scope(|s| {
        let root = s.spawn(move || Bootstrap::connect(root_cfg));
        let started = Instant::now();
        let mut strangers = Vec::new();
        while strangers.len() < CAP + 60 && started.elapsed() < Duration::from_secs(5) {
            match TcpStream::connect(("127.0.0.1", port)) {
                Ok(c) => strangers.push(c),
                Err(_) => std::thread::sleep(Duration::from_millis(10)),
            }
        }
        assert_eq!(
            strangers.len(),
            CAP + 60,
            "could not open the strangers' connections"
        );
        // Each stranger either got a challenge or was closed unanswered.
        let (mut challenged, mut closed) = (0, 0);
        for c in &mut strangers {
            c.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
            let mut hello = [0u8; 40];
            match c.read_exact(&mut hello) {
                Ok(()) => challenged += 1,
                Err(_) => closed += 1,
            }
        }
        assert!(challenged <= CAP, "{challenged} handshakes at once");
        assert!(closed >= 60, "only {closed} connections turned away");
        assert!(
            handshake_threads() <= CAP,
            "{} handshake threads",
            handshake_threads()
        );
        drop(strangers);
        let member = Bootstrap::connect(member_cfg);
        assert!(member.is_ok(), "{:?}", member.err());
        assert!(root.join().unwrap().is_ok());
    });
}

/// An on-path attacker who alters one byte of a frame after the handshake (here a proxy between
/// rank 1 and rank 0 flipping a bit of the first frame's header) cannot slip it in: the frame
/// fails its MAC and the job fails, naming the link, instead of acting on the altered frame.
#[test]
fn a_frame_altered_on_the_way_fails_the_job() {
    let (port0, proxy_port) = (free_port().unwrap(), free_port().unwrap());
    let timeout = Duration::from_secs(5);
    let mut cfg0 = config(0, 2, port0, timeout);
    let mut cfg1 = config(1, 2, proxy_port, timeout);
    cfg1.secret = cfg0.secret.clone();
    cfg0.heartbeat = Duration::ZERO;
    cfg1.heartbeat = Duration::ZERO;
    let proxy = std::net::TcpListener::bind(("127.0.0.1", proxy_port)).unwrap();
    std::thread::scope(|s| {
        s.spawn(move || {
            let (from1, _) = proxy.accept().unwrap();
            let to0 = loop {
                match TcpStream::connect(("127.0.0.1", port0)) {
                    Ok(c) => break c,
                    Err(_) => std::thread::sleep(Duration::from_millis(10)),
                }
            };
            let pump = |mut r: TcpStream, mut w: TcpStream, flip_at: Option<usize>| {
                let mut seen = 0usize;
                let mut buf = [0u8; 4096];
                while let Ok(n) = r.read(&mut buf) {
                    if n == 0 {
                        break;
                    }
                    if let Some(at) = flip_at.filter(|&at| at >= seen && at < seen + n) {
                        buf[at - seen] ^= 1;
                    }
                    seen += n;
                    if w.write_all(&buf[..n]).is_err() {
                        break;
                    }
                }
                let _ = w.shutdown(std::net::Shutdown::Both);
            };
            let (r1, w1) = (from1.try_clone().unwrap(), from1);
            let (r0, w0) = (to0.try_clone().unwrap(), to0);
            // Rank 1's answer is 82 bytes; byte 8 of the frame after it is its header's tag.
            std::thread::scope(|p| {
                p.spawn(|| pump(r1, w0, Some(82 + 8)));
                p.spawn(|| pump(r0, w1, None));
            });
        });
        let r1 = s.spawn(move || Bootstrap::connect(cfg1).map(|_| ()));
        let e0 = Bootstrap::connect(cfg0).expect_err("rank 0 accepted an altered frame");
        let _ = r1.join();
        let text = e0.to_string();
        assert!(text.contains("failed authentication"), "{text}");
    });
}
