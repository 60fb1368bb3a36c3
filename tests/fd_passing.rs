//! Descriptor passing between processes. The publishing side is this test process; the fetching
//! side is either this process or a child process of this same test binary (`child_entry` with
//! `DOORBELL_FD_TEST` set), which reads the bytes behind the descriptor it received.

use doorbell::gpu::fd_passing::{fetch_fd, server_name, FdServer};
use doorbell::Error;
use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::{FromRawFd, OwnedFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::fs::FileExt;
use std::os::unix::net::{SocketAddr, UnixStream};
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

const CASE: &str = "DOORBELL_FD_TEST";
const TIMEOUT: Duration = Duration::from_secs(5);

/// A secret no other test (or test run) shares, so servers never collide.
fn secret() -> Vec<u8> {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    format!(
        "fd-test-{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    )
    .into_bytes()
}

/// An anonymous memory file holding `bytes`.
fn memfd_with(bytes: &[u8]) -> OwnedFd {
    // SAFETY: memfd_create with a NUL-terminated name; on success it returns a new descriptor
    // that nothing else owns.
    let raw = unsafe { libc::memfd_create(c"doorbell-test".as_ptr(), libc::MFD_CLOEXEC) };
    assert!(
        raw >= 0,
        "memfd_create: {}",
        std::io::Error::last_os_error()
    );
    // SAFETY: `raw` is a fresh descriptor owned by nobody else.
    let fd = unsafe { OwnedFd::from_raw_fd(raw) };
    let mut file = File::from(fd);
    file.write_all(bytes).unwrap();
    file.into()
}

fn read_all(fd: OwnedFd) -> Vec<u8> {
    let file = File::from(fd);
    let len = file.metadata().unwrap().len() as usize;
    let mut buf = vec![0u8; len];
    file.read_exact_at(&mut buf, 0).unwrap();
    buf
}

fn blamed(e: &Error) -> Option<usize> {
    match e {
        Error::Bootstrap { rank, .. } => *rank,
        _ => None,
    }
}

/// The fetching process; does nothing unless `DOORBELL_FD_TEST` is set.
#[test]
fn child_entry() {
    let Ok(case) = std::env::var(CASE) else {
        return;
    };
    assert_eq!(case, "fetch");
    let secret = std::env::var("FD_SECRET").unwrap().into_bytes();
    let id: u64 = std::env::var("FD_ID").unwrap().parse().unwrap();
    let want = std::env::var("FD_BYTES").unwrap().into_bytes();
    let fd = fetch_fd(&secret, 1, 0, id, TIMEOUT).unwrap();
    assert_eq!(read_all(fd), want);
    let e = fetch_fd(&secret, 1, 0, id + 1, TIMEOUT).unwrap_err();
    assert!(e.to_string().contains(&format!("id {}", id + 1)), "{e}");
}

#[test]
fn another_process_fetches_a_published_descriptor() {
    let secret = secret();
    let server = FdServer::start(&secret, 0).unwrap();
    let bytes = "exported by rank 0 of this test";
    server.publish(17, memfd_with(bytes.as_bytes())).unwrap();
    let t0 = Instant::now();
    let status = Command::new(std::env::current_exe().unwrap())
        .args([
            "child_entry",
            "--exact",
            "--nocapture",
            "--test-threads=1",
            "-q",
        ])
        .env(CASE, "fetch")
        .env("FD_SECRET", String::from_utf8(secret).unwrap())
        .env("FD_ID", "17")
        .env("FD_BYTES", bytes)
        .status()
        .unwrap();
    assert!(status.success(), "child: {status}");
    eprintln!("cross-process fetch took {:?}", t0.elapsed());
}

#[test]
fn fetch_in_process_and_withdraw() {
    let secret = secret();
    let server = FdServer::start(&secret, 3).unwrap();
    assert_eq!(server.rank(), 3);
    server.publish(1, memfd_with(b"one")).unwrap();
    let e = server.publish(1, memfd_with(b"again")).unwrap_err();
    assert!(e.to_string().contains("already published"), "{e}");
    let fetched = fetch_fd(&secret, 0, 3, 1, TIMEOUT).unwrap();
    server.withdraw(1);
    server.withdraw(1);
    // What was fetched stays valid after withdraw; the id is gone.
    assert_eq!(read_all(fetched), b"one");
    let e = fetch_fd(&secret, 0, 3, 1, TIMEOUT).unwrap_err();
    assert_eq!(blamed(&e), Some(3));
    assert!(e.to_string().contains("no fd published under id 1"), "{e}");
}

#[test]
fn unknown_id_is_an_error_naming_it() {
    let secret = secret();
    let _server = FdServer::start(&secret, 0).unwrap();
    let t0 = Instant::now();
    let e = fetch_fd(&secret, 1, 0, 0xdead_beef, TIMEOUT).unwrap_err();
    assert!(
        t0.elapsed() < Duration::from_secs(2),
        "an error reply, not a timeout"
    );
    let text = e.to_string();
    assert!(text.contains(&0xdead_beef_u64.to_string()), "{text}");
    assert!(text.contains("rank 0"), "{text}");
}

#[test]
fn a_wrong_secret_finds_no_server_and_a_wrong_answer_is_refused() {
    let secret = secret();
    let server = FdServer::start(&secret, 0).unwrap();
    server.publish(5, memfd_with(b"private")).unwrap();
    // A process with another secret derives another name: nothing answers there.
    let t0 = Instant::now();
    let e = fetch_fd(b"not the secret", 1, 0, 5, Duration::from_millis(300)).unwrap_err();
    assert!(t0.elapsed() < Duration::from_secs(2));
    assert!(e.to_string().contains("no fd server answered"), "{e}");
    // One that learned the name (e.g. from /proc/net/unix) still cannot answer the challenge.
    let name = server_name(&secret, 0);
    let addr = SocketAddr::from_abstract_name(name.as_bytes()).unwrap();
    let mut c = UnixStream::connect_addr(&addr).unwrap();
    c.set_read_timeout(Some(TIMEOUT)).unwrap();
    let mut hello = [0u8; 40];
    c.read_exact(&mut hello).unwrap();
    assert_eq!(&hello[..8], b"DBFDPS01");
    let mut request = vec![0u8; 32];
    request.extend_from_slice(&1u64.to_le_bytes());
    request.extend_from_slice(&5u64.to_le_bytes());
    c.write_all(&request).unwrap();
    let mut reply = Vec::new();
    c.read_to_end(&mut reply).unwrap();
    assert_eq!(reply.first(), Some(&0), "refused");
    assert!(String::from_utf8_lossy(&reply).contains("authentication failed"));
    // A silent client does not block other requests.
    let _silent = UnixStream::connect_addr(&addr).unwrap();
    assert_eq!(
        read_all(fetch_fd(&secret, 1, 0, 5, TIMEOUT).unwrap()),
        b"private"
    );
}

#[test]
fn one_server_per_rank_and_drop_frees_the_name() {
    let secret = secret();
    let server = FdServer::start(&secret, 2).unwrap();
    let e = FdServer::start(&secret, 2).unwrap_err();
    assert!(e.to_string().contains("same RANK"), "{e}");
    let other_rank = FdServer::start(&secret, 3).unwrap();
    let t0 = Instant::now();
    drop(server);
    drop(other_rank);
    assert!(t0.elapsed() < Duration::from_secs(1), "{:?}", t0.elapsed());
    let _again = FdServer::start(&secret, 2).unwrap();
}

#[test]
fn fetch_waits_for_a_late_server() {
    let secret = secret();
    std::thread::scope(|s| {
        let late = s.spawn(|| {
            std::thread::sleep(Duration::from_millis(300));
            let server = FdServer::start(&secret, 0).unwrap();
            server.publish(9, memfd_with(b"late")).unwrap();
            std::thread::sleep(Duration::from_secs(2));
        });
        assert_eq!(
            read_all(fetch_fd(&secret, 1, 0, 9, TIMEOUT).unwrap()),
            b"late"
        );
        late.join().unwrap();
    });
}

/// Names of this process's threads.
fn threads() -> Vec<String> {
    let mut names = Vec::new();
    for t in std::fs::read_dir("/proc/self/task").unwrap().flatten() {
        if let Ok(name) = std::fs::read_to_string(t.path().join("comm")) {
            names.push(name.trim().to_string());
        }
    }
    names
}

/// A dropped server ends the requests it is still serving: a client that connected and never
/// sent its request holds a request thread (up to the 5 s read timeout); the drop shuts its socket
/// down and joins it, so no thread of the server outlives it.
#[test]
fn drop_ends_the_requests_in_flight() {
    let secret = secret();
    // A rank no other test uses: thread names say the rank ("doorbell-fd41", "doorbell-fd41-r").
    let server = FdServer::start(&secret, 41).unwrap();
    let addr = SocketAddr::from_abstract_name(server_name(&secret, 41).as_bytes()).unwrap();
    let mut silent = UnixStream::connect_addr(&addr).unwrap();
    // The challenge's first byte: the request thread is serving this connection now.
    let mut first = [0u8; 1];
    silent.read_exact(&mut first).unwrap();
    let listed = || threads().iter().any(|n| n.starts_with("doorbell-fd41"));
    assert!(listed(), "no thread of the server: {:?}", threads());
    let t0 = Instant::now();
    drop(server);
    assert!(t0.elapsed() < Duration::from_secs(1), "{:?}", t0.elapsed());
    // A joined thread may stay listed for a moment while its exit finishes; not for seconds.
    let deadline = Instant::now() + Duration::from_secs(2);
    while listed() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(!listed(), "threads left after the drop: {:?}", threads());
    // The client sees the end of the stream, not a descriptor.
    let mut rest = Vec::new();
    let _ = silent.read_to_end(&mut rest);
}
