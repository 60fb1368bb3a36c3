//! The fault suite: every fault ends, on every surviving rank, in an error that names the rank and
//! the cause, promptly, with nothing left running.
//!
//! CPU tests (CI) cover the bootstrap side: a killed peer, a frozen peer (heartbeats), an abort
//! relayed with its cause, a job shrunk to its survivors. GPU tests (`#[ignore = "needs GPU"]`)
//! run ranks as processes (several may share one GPU): `kill -9` of a rank in the middle of an
//! allreduce, an all-to-all, a MoE dispatch (low-latency and high-throughput) and a PortChannel
//! transfer, at every rank count of `DOORBELL_TEST_RANKS` (2, 3, 4); a rank stuck in host code;
//! ranks that make different calls (alltoallv pairs whose counts disagree, device counts out of
//! range among them); `Communicator::abort` from another thread while a kernel
//! waits; a shrink after a failure followed by correct allreduces. Each surviving rank prints
//! `fault-to-error: <case> <n> ranks rank <r>: <ms> ms (<error>)`, the numbers in docs/faults.md.

mod common;

use common::rank_counts;
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
use doorbell::collectives::allreduce::{Algorithm, AllReduce, AllReduceOptions};
use doorbell::collectives::alltoall::{AllToAll, AllToAllOptions, Counts};
use doorbell::collectives::DataType;
use doorbell::communicator::Communicator;
use doorbell::job::bootstrap::{Bootstrap, BootstrapConfig};
use doorbell::job::launch::{free_port, spawn_ranks, SpawnOptions};
use doorbell::Error;
use std::ffi::OsString;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

// ------------------------------------------------------------------------------------------------
// CPU: the bootstrap side.

fn config(rank: usize, world_size: usize, port: u16, heartbeat: Duration) -> BootstrapConfig {
    BootstrapConfig {
        rank,
        world_size,
        local_rank: rank,
        local_world_size: world_size,
        master_addr: "127.0.0.1".into(),
        master_port: port,
        secret: format!("fault-secret-{port}").into_bytes(),
        timeout: Duration::from_secs(20),
        heartbeat,
    }
}

fn threads<T: Send>(n: usize, body: impl Fn(Bootstrap) -> T + Sync) -> Vec<T> {
    let port = free_port().unwrap();
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..n)
            .map(|r| {
                let body = &body;
                s.spawn(move || {
                    body(Bootstrap::connect(config(r, n, port, Duration::from_secs(5))).unwrap())
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// Polls `health` until it reports a failure, at most `limit`.
fn wait_health(
    b: &Bootstrap,
    limit: Duration,
) -> (doorbell::job::bootstrap::PeerFailure, Duration) {
    let t0 = Instant::now();
    loop {
        if let Some(f) = b.health() {
            return (f, t0.elapsed());
        }
        assert!(t0.elapsed() < limit, "no failure seen within {limit:?}");
        b.wait_for_change(Duration::from_millis(10));
    }
}

#[test]
fn an_abort_reaches_every_rank_with_its_cause() {
    threads(3, |b| {
        // A rank still in this barrier when rank 1 aborts fails it, which is fine: the abort is
        // what is tested. The pause only makes that rare.
        let _ = b.barrier();
        std::thread::sleep(Duration::from_millis(300));
        if b.rank() == 1 {
            b.abort(Some(1), "boom on rank 1");
        }
        let (f, waited) = wait_health(&b, Duration::from_secs(2));
        assert_eq!(f.rank, 1, "{f:?}");
        // Told by rank 1 itself, or relayed by the other rank when its news came first (CI saw
        // rank 2's relay reach rank 0 before rank 1's own message); either names rank 1 and its
        // cause.
        match f.from {
            Some(1) => {}
            Some(r) if r != b.rank() => {
                assert!(f.cause.starts_with(&format!("rank {r} reported")), "{f:?}")
            }
            _ => panic!("rank {}: told by {:?}: {f:?}", b.rank(), f.from),
        }
        assert!(f.cause.contains("boom on rank 1"), "{f:?}");
        assert!(waited < Duration::from_secs(1), "{waited:?}");
    });
}

/// A rank's goodbye says how many collective calls it made, so a peer that made more learns at
/// once which calls wait in vain (the watchdog's rule: `left_early`).
#[test]
fn a_goodbye_carries_the_calls_made() {
    threads(2, |b| {
        b.barrier().unwrap();
        if b.rank() == 0 {
            b.call_counter()
                .store(3, std::sync::atomic::Ordering::Relaxed);
            return;
        }
        let t0 = Instant::now();
        while !b.said_goodbye(0) {
            assert!(
                t0.elapsed() < Duration::from_secs(5),
                "no goodbye from rank 0"
            );
            b.wait_for_change(Duration::from_millis(10));
        }
        assert_eq!(b.goodbye_calls(0), Some(3));
        assert!(b.health().is_none(), "a goodbye is no failure");
    });
}

#[test]
fn a_shrunk_job_gathers_among_the_survivors() {
    let port = free_port().unwrap();
    let results: Vec<Option<Vec<Vec<u8>>>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..4)
            .map(|r| {
                s.spawn(move || {
                    let b = Bootstrap::connect(config(r, 4, port, Duration::from_secs(5))).unwrap();
                    // A rank still in this barrier when rank 2 goes fails it, which is fine (the
                    // shrink is what is tested); the pause only makes that rare.
                    let _ = b.barrier();
                    std::thread::sleep(Duration::from_millis(300));
                    if r == 2 {
                        // Leaves; the others abort (as a watchdog would) and shrink without it.
                        drop(b);
                        return None;
                    }
                    if r == 0 {
                        b.abort(Some(2), "rank 2 is gone");
                    }
                    let _ = wait_health(&b, Duration::from_secs(5));
                    let small = b.shrink(&[2], (0, 1)).unwrap();
                    assert_eq!(small.world_size(), 3);
                    assert_eq!(small.rank(), [0, 1, 0, 2][r]);
                    let all = small.all_gather(&[r as u8; 3]).unwrap();
                    small.barrier().unwrap();
                    Some(all)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (r, all) in results.iter().enumerate() {
        if r == 2 {
            continue;
        }
        assert_eq!(
            all.as_ref().unwrap(),
            &vec![vec![0u8; 3], vec![1u8; 3], vec![3u8; 3]],
            "rank {r}"
        );
    }
}

#[test]
fn shrinking_with_oneself_listed_as_failed_is_refused() {
    threads(2, |b| {
        let e = b.shrink(&[b.rank()], (0, 1)).unwrap_err();
        assert!(e.to_string().contains("failed list"), "{e}");
        b.barrier().unwrap();
    });
}

const SCENARIO: &str = "DOORBELL_FAULT_SCENARIO";

/// Runs `scenario` as `n` processes of this test binary; returns their exits.
fn spawn(
    scenario: &str,
    n: usize,
    extra: &[(&str, String)],
) -> Vec<doorbell::job::launch::RankExit> {
    let exe = std::env::current_exe().unwrap();
    let (test, ignored) = if scenario.starts_with("gpu_") {
        ("gpu_rank", true)
    } else {
        ("cpu_rank", false)
    };
    let mut args: Vec<OsString> = vec![test.into(), "--exact".into(), "--nocapture".into()];
    if ignored {
        args.push("--ignored".into());
    }
    let mut extra_env = vec![(SCENARIO.to_string(), scenario.to_string())];
    extra_env.extend(extra.iter().map(|(k, v)| (k.to_string(), v.clone())));
    spawn_ranks(
        &exe,
        &args,
        &SpawnOptions {
            nranks: n,
            extra_env,
            timeout: Some(Duration::from_secs(120)),
            grace: Duration::from_secs(30),
        },
    )
    .unwrap()
}

fn now_ns() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_nanos()
}

/// The rank side of the CPU process scenarios.
#[test]
fn cpu_rank() {
    let Ok(case) = std::env::var(SCENARIO) else {
        return;
    };
    let cfg = BootstrapConfig::from_env().unwrap();
    let me = cfg.rank;
    let b = Bootstrap::connect(cfg).unwrap();
    let pids = b.all_gather(&std::process::id().to_le_bytes()).unwrap();
    match case.as_str() {
        "killed" => {
            if me == b.world_size() - 1 {
                // kill -9 of itself: no goodbye, no destructor.
                unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
            }
            let (f, waited) = wait_health(&b, Duration::from_secs(5));
            eprintln!("rank {me}: {f:?} after {waited:?}");
            assert_eq!((f.rank, f.from), (b.world_size() - 1, None), "{f:?}");
            assert!(f.cause.contains("without a goodbye"), "{f:?}");
            assert!(waited < Duration::from_secs(1), "{waited:?}");
        }
        "frozen" => {
            if me == 1 {
                // Alive but frozen: its socket stays open, its heartbeats stop.
                unsafe { libc::kill(libc::getpid(), libc::SIGSTOP) };
                return;
            }
            let (f, waited) = wait_health(&b, Duration::from_secs(10));
            eprintln!("rank {me}: {f:?} after {waited:?}");
            assert_eq!(f.rank, 1, "{f:?}");
            assert!(f.cause.contains("no heartbeat"), "{f:?}");
            // DOORBELL_HEARTBEAT_TIMEOUT_MS=1500 below.
            assert!(
                waited >= Duration::from_millis(1000) && waited < Duration::from_secs(4),
                "{waited:?}"
            );
            if me == 0 {
                // Every survivor names it by its silence first; then rank 0 ends it.
                std::thread::sleep(Duration::from_secs(1));
                let pid = i32::from_le_bytes(pids[1].as_slice().try_into().unwrap());
                unsafe { libc::kill(pid, libc::SIGKILL) };
            }
        }
        other => panic!("unknown scenario {other}"),
    }
}

#[test]
fn a_killed_peer_is_named_at_once() {
    for n in [2, 3, 4] {
        let exits = spawn("killed", n, &[]);
        for e in &exits {
            assert_eq!(e.success(), e.rank != n - 1, "{n} ranks: {e}");
        }
    }
}

#[test]
fn a_frozen_peer_is_named_after_the_heartbeat_timeout() {
    let exits = spawn(
        "frozen",
        3,
        &[("DOORBELL_HEARTBEAT_TIMEOUT_MS", "1500".into())],
    );
    for e in &exits {
        assert_eq!(e.success(), e.rank != 1, "{e}");
    }
}

// ------------------------------------------------------------------------------------------------
// GPU: collectives of processes sharing GPUs.

/// Where the victim writes when it killed itself (nanoseconds since the epoch), for the survivors'
/// fault-to-error times.
const STAMP: &str = "DOORBELL_FAULT_STAMP";

fn stamp_path() -> std::path::PathBuf {
    std::env::var_os(STAMP).unwrap().into()
}

fn record_fault() {
    std::fs::write(stamp_path(), now_ns().to_string()).unwrap();
}

/// A file that rank `rank` writes once its GPU is open (the `kill_setup` case waits for them).
fn ready_path(rank: usize) -> std::path::PathBuf {
    let mut p = stamp_path().into_os_string();
    p.push(format!(".ready{rank}"));
    p.into()
}

fn since_fault() -> Duration {
    let t0: u128 = std::fs::read_to_string(stamp_path())
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .expect("the fault's time stamp");
    Duration::from_nanos(now_ns().saturating_sub(t0) as u64)
}

fn gpu_case(
    scenario: &str,
    n: usize,
    extra: &[(&str, String)],
) -> Vec<doorbell::job::launch::RankExit> {
    let dir = std::env::temp_dir().join(format!(
        "doorbell-fault-{}-{scenario}-{n}",
        std::process::id()
    ));
    let mut env: Vec<(&str, String)> = vec![(STAMP, dir.to_string_lossy().into_owned())];
    env.extend(extra.iter().cloned());
    let t0 = Instant::now();
    let exits = spawn(&format!("gpu_{scenario}"), n, &env);
    eprintln!(
        "case {scenario} with {n} ranks: all exited after {:?}",
        t0.elapsed()
    );
    for r in 0..n {
        let mut ready = dir.clone().into_os_string();
        ready.push(format!(".ready{r}"));
        let _ = std::fs::remove_file(ready);
    }
    let _ = std::fs::remove_file(dir);
    exits
}

/// Every rank but `victim` succeeded; `victim` (if any) was killed by a signal.
fn assert_exits(scenario: &str, exits: &[doorbell::job::launch::RankExit], victim: Option<usize>) {
    for e in exits {
        if Some(e.rank) == victim {
            assert!(!e.success(), "{scenario}: the victim survived: {e}");
        } else {
            assert!(e.success(), "{scenario}: {e}");
        }
    }
}

/// A mismatch case's check, where rank 0 made the odd call: prints the fault-to-error line and
/// asserts that `e` is `ArgumentMismatch` with rank 0 on one side (the ranks that check rank 0
/// name it; the others get the finding relayed, naming the pair that made it) within the
/// budget (DOORBELL_WAIT_TIMEOUT_MS=1500) and two seconds.
fn expect_mismatch_with_rank_0(scenario: &str, n: usize, me: usize, e: &Error, t0: Instant) {
    let waited = t0.elapsed();
    eprintln!(
        "fault-to-error: {scenario} {n} ranks rank {me}: {} ms after the call ({e})",
        waited.as_millis()
    );
    match e {
        Error::ArgumentMismatch { rank, peer, .. } => {
            assert!(*rank == 0 || *peer == 0, "{e}")
        }
        other => panic!("expected ArgumentMismatch, got {other}"),
    }
    assert!(waited < Duration::from_millis(1500 + 2000), "{waited:?}");
}

/// Rank 0's side of the abort cases: aborts `comm` from another thread 300 ms from now (the fault's
/// time recorded for the other ranks' timings); join the handle after the call returns.
fn abort_soon(comm: &Arc<Communicator>) -> std::thread::JoinHandle<()> {
    let c2 = comm.clone();
    std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(300));
        record_fault();
        c2.abort();
    })
}

/// Rank 0's side of an abort case: the error its call returned names its own abort.
fn expect_own_abort(scenario: &str, n: usize, e: &Error) {
    eprintln!("abort, marked outputs: {scenario} {n} ranks: {e}");
    assert!(
        matches!(e, Error::PeerFailed { rank: 0, cause, .. } if cause.contains("Communicator::abort")),
        "{e}"
    );
}

/// Asserts that every one of the `len` bf16 at device address `at` is NaN: marked as cut short.
///
/// # Safety
/// `at` must hold `len` bf16 of this context.
unsafe fn assert_marked_bf16(s: &Arc<CudaStream>, at: u64, len: usize, scenario: &str, what: &str) {
    s.synchronize().unwrap();
    let mut v = vec![0u16; len];
    // SAFETY: the caller's.
    unsafe { cudarc::driver::result::memcpy_dtoh_async(&mut v, at, s.cu_stream()) }.unwrap();
    s.synchronize().unwrap();
    let unmarked = v
        .iter()
        .filter(|&&b| !half::bf16::from_bits(b).is_nan())
        .count();
    assert_eq!(
        unmarked, 0,
        "{scenario}: {unmarked} values of {what} that are not NaN"
    );
}

/// The other ranks' side: polls the communicator's health until rank 0's abort arrives (at most
/// 10 s) and returns the error it reports.
fn rank_0s_abort(comm: &Communicator) -> Error {
    let t0 = Instant::now();
    loop {
        if let Err(e) = comm.check_health() {
            return e;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "rank 0's abort never came"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Threads of this process that doorbell started and that are still running.
fn doorbell_threads() -> Vec<String> {
    let mut names = Vec::new();
    if let Ok(tasks) = std::fs::read_dir("/proc/self/task") {
        for t in tasks.flatten() {
            if let Ok(name) = std::fs::read_to_string(t.path().join("comm")) {
                if name.starts_with("doorbell") {
                    names.push(name.trim().to_string());
                }
            }
        }
    }
    names
}

/// One collective step of a kill scenario: launches round `round`; with `sync`, also waits for it.
type Step<'a> = Box<dyn FnMut(u64, bool) -> doorbell::Result<()> + 'a>;

const KILL_ROUND: u64 = 5;

/// The survivors' side of a kill: run rounds until one fails, then check the error names the
/// victim, came promptly, and left the GPU usable. The victim launches round KILL_ROUND and dies.
fn kill_mid(comm: &Arc<Communicator>, s: &Arc<CudaStream>, what: &str, mut step: Step) {
    let (me, n) = (comm.rank(), comm.world_size());
    let victim = n - 1;
    let t0 = Instant::now();
    for round in 0.. {
        if me == victim && round == KILL_ROUND {
            step(round, false).unwrap();
            std::thread::sleep(Duration::from_millis(20));
            record_fault();
            // kill -9 of itself, with its kernel in flight: no goodbye, no destructor.
            unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
        }
        match step(round, true) {
            Ok(()) => {
                assert!(
                    t0.elapsed() < Duration::from_secs(60),
                    "{what}: no error after {round} rounds"
                );
                continue;
            }
            Err(e) => {
                let waited = since_fault();
                eprintln!(
                    "fault-to-error: {what} {n} ranks rank {me}: {} ms ({e})",
                    waited.as_millis()
                );
                match &e {
                    Error::PeerFailed { rank, .. } => assert_eq!(*rank, victim, "{e}"),
                    other => {
                        panic!("{what}: expected PeerFailed naming rank {victim}, got {other}")
                    }
                }
                assert!(waited < Duration::from_secs(2), "{what}: {waited:?}");
                // The victim dies in round KILL_ROUND; a survivor may still be finishing the
                // round before (the victim finished it once the survivor's data had arrived).
                assert!(
                    round + 1 >= KILL_ROUND,
                    "{what}: failed in round {round}: {e}"
                );
                break;
            }
        }
    }
    // The context is still usable (nothing trapped), unless ranks share the GPU through MPS,
    // where the dead client's faults reach the others.
    if std::env::var("DOORBELL_TEST_MPS").as_deref() != Ok("1") {
        let fresh = comm.gpu().new_stream().unwrap();
        let v: CudaSlice<u32> = fresh.alloc_zeros(1024).unwrap();
        assert_eq!(fresh.clone_dtoh(&v).unwrap(), vec![0u32; 1024]);
    }
    let _ = s;
}

/// `bytes`, or 64 KiB when ranks share the GPU through MPS: there the large-message kernels of
/// several ranks (each sized to fill the GPU, and waiting on the others' blocks) cannot all be
/// resident at once, so they wait on blocks that never run until the budget names the wait; the
/// small-message kernels fit beside each other.
fn message_bytes(bytes: usize) -> usize {
    if std::env::var("DOORBELL_TEST_MPS").as_deref() == Ok("1") {
        bytes.min(64 << 10)
    } else {
        bytes
    }
}

/// A MoE layer of `tokens` tokens per rank (hidden 256, top-4 of 4 experts per rank, 8 blocks)
/// and its inputs on `s`: the config, then x (bf16 rows), FP8 scales, top-k ids, weights and the
/// combine output, as device addresses (the slices are kept alive by the returned vector).
fn moe_inputs(
    s: &Arc<CudaStream>,
    world: usize,
    tokens: usize,
) -> (
    doorbell::collectives::moe::MoeConfig,
    [u64; 5],
    Vec<CudaSlice<u8>>,
) {
    let (hidden, topk, experts) = (256usize, 4usize, 4 * world);
    let cfg =
        doorbell::collectives::moe::MoeConfig::new(hidden, topk, experts, tokens).with_blocks(8);
    let ids: Vec<i32> = (0..tokens * topk)
        .map(|i| ((i / topk + (i % topk) * 3) % experts) as i32)
        .collect();
    let bufs: Vec<CudaSlice<u8>> = vec![
        s.alloc_zeros(tokens * hidden * 2).unwrap(),
        s.alloc_zeros(tokens * hidden / 128 * 4).unwrap(),
        s.clone_htod(bytemuck::cast_slice::<i32, u8>(&ids)).unwrap(),
        s.clone_htod(bytemuck::cast_slice::<f32, u8>(&vec![
            1.0f32;
            tokens * topk
        ]))
        .unwrap(),
        s.alloc_zeros(tokens * hidden * 2).unwrap(),
    ];
    let mut ptrs = [0u64; 5];
    for (p, b) in ptrs.iter_mut().zip(&bufs) {
        *p = b.device_ptr(s).0;
    }
    (cfg, ptrs, bufs)
}

fn allreduce_of(comm: &Arc<Communicator>) -> AllReduce {
    AllReduce::new(comm, AllReduceOptions::default()).unwrap()
}

#[test]
#[ignore = "needs GPU"]
fn gpu_rank() {
    let Ok(scenario) = std::env::var(SCENARIO) else {
        return;
    };
    let scenario = scenario.trim_start_matches("gpu_").to_string();
    if scenario == "kill_setup" {
        // The last rank dies while the others build their communicators: they fail naming it.
        let cfg = BootstrapConfig::from_env().unwrap();
        let (me, n, local) = (cfg.rank, cfg.world_size, cfg.local_rank);
        if me == n - 1 {
            // Waits until the others have their GPUs open, joins the job, then dies while they
            // build their communicators and wait for its handles. Opening a GPU (cuInit and the
            // primary context: 1.2-4.4 s on 4 x H100 with 4-16 processes starting at once) is a
            // driver call nothing can cut short, so a death during it is seen when it returns;
            // what this case times is the setup's own wait on a dead peer.
            let deadline = Instant::now() + Duration::from_secs(120);
            while (0..n - 1).any(|r| !ready_path(r).exists()) {
                assert!(
                    Instant::now() < deadline,
                    "the other ranks never opened their GPUs"
                );
                std::thread::sleep(Duration::from_millis(5));
            }
            let _joined = Bootstrap::connect(cfg).unwrap();
            std::thread::sleep(Duration::from_millis(300));
            record_fault();
            unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
        }
        // The communicator below retains the same primary context: its own open is then quick.
        let _gpu =
            doorbell::gpu::cuda::Gpu::open(local % doorbell::gpu::cuda::device_count().unwrap())
                .unwrap();
        std::fs::write(ready_path(me), "").unwrap();
        let e = match Communicator::from_env() {
            Ok(_) => panic!("rank {me}: a communicator was built without rank {}", n - 1),
            Err(e) => e,
        };
        let waited = since_fault();
        eprintln!(
            "fault-to-error: setup {n} ranks rank {me}: {} ms ({e})",
            waited.as_millis()
        );
        assert!(
            matches!(&e, Error::Bootstrap { rank: Some(r), .. } if *r == n - 1),
            "{e}"
        );
        assert!(waited < Duration::from_secs(2), "{waited:?}");
        return;
    }
    // The files the process holds before the communicator, its GPU context open (kept here, so
    // the driver's own files are counted in).
    let local = BootstrapConfig::from_env().unwrap().local_rank;
    let _gpu = doorbell::gpu::cuda::Gpu::open(local % doorbell::gpu::cuda::device_count().unwrap())
        .unwrap();
    let files = || -> Vec<String> {
        std::fs::read_dir("/proc/self/fd")
            .unwrap()
            .flatten()
            .map(|e| {
                let target = std::fs::read_link(e.path()).unwrap_or_default();
                format!(
                    "{} -> {}",
                    e.file_name().to_string_lossy(),
                    target.display()
                )
            })
            .collect()
    };
    let fds0 = files();
    let comm = Arc::new(Communicator::from_env().expect("communicator"));
    gpu_scenario(&scenario, comm);
    // Nothing of doorbell's is left once everything is dropped: no thread (watchdog, heartbeat,
    // bootstrap readers, fd server, proxies), no file (sockets, exported memory).
    // A joined thread stays listed in /proc/self/task for a moment after pthread_join returns
    // (the kernel wakes the joiner when the thread clears its tid, and unlists it later in its
    // exit): poll for up to 2 s; a thread that is really left stays listed.
    let deadline = Instant::now() + Duration::from_secs(2);
    let mut left = doorbell_threads();
    while !left.is_empty() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
        left = doorbell_threads();
    }
    assert!(left.is_empty(), "{scenario}: threads left: {left:?}");
    let fds1 = files();
    eprintln!(
        "left after the drop: {scenario}: {} files open, {} before the communicator",
        fds1.len(),
        fds0.len()
    );
    // (The listing's own directory handle is not the process's.)
    let new: Vec<&String> = fds1
        .iter()
        .filter(|f| !fds0.contains(f) && !f.contains("/fd"))
        .collect();
    assert!(new.is_empty(), "{scenario}: files left open: {new:?}");
}

fn gpu_scenario(scenario: &str, comm: Arc<Communicator>) {
    let s = comm.gpu().new_stream().unwrap();
    let (me, n) = (comm.rank(), comm.world_size());
    match scenario {
        "kill_allreduce" | "kill_allreduce_tolerant" => {
            // _tolerant: the same kill, on a communicator that tolerates peer loss (a MoE
            // low-latency exchange with a rank mask exists): the dead rank is marked instead of
            // aborting the communicator, and a collective without masks must still fail at once
            // naming it (its waits for the dead peer end the communicator; later calls fail in
            // check_health).
            let tolerant = scenario == "kill_allreduce_tolerant";
            let (cfg, _ptrs, _bufs) = moe_inputs(&s, n, 32);
            let _ll = tolerant.then(|| {
                doorbell::collectives::moe::MoeLowLatency::new(
                    &comm,
                    cfg.with_deep_ep_layout(true).with_rank_mask(true),
                )
                .unwrap()
            });
            assert_eq!(
                comm.diagnostics().tolerates_peer_loss(),
                tolerant,
                "rank {me}: a rank mask makes the communicator tolerate peer loss"
            );
            let ar = allreduce_of(&comm);
            // 4 MiB of f32, as in the issue's report; under MPS 64 KiB (see `message_bytes`).
            let mut buf: CudaSlice<f32> = s.alloc_zeros(message_bytes(4 << 20) / 4).unwrap();
            kill_mid(
                &comm,
                &s,
                if tolerant {
                    "allreduce with peer loss tolerated"
                } else {
                    "allreduce"
                },
                Box::new(|_, sync| {
                    ar.run_in_place(&s, &mut buf)?;
                    if sync {
                        comm.synchronize(&s)?;
                    }
                    Ok(())
                }),
            );
            if tolerant {
                // The death was marked as tolerated (not only aborted as without a mask).
                assert_ne!(
                    comm.diagnostics().dead_peers() & (1 << (n - 1)),
                    0,
                    "rank {me}: the dead rank's bit"
                );
            }
        }
        "kill_alltoall" => {
            let a2a = AllToAll::new(&comm, AllToAllOptions::default()).unwrap();
            let inp: CudaSlice<u8> = s.alloc_zeros(n * message_bytes(1 << 20)).unwrap();
            let mut out: CudaSlice<u8> = s.alloc_zeros(n * message_bytes(1 << 20)).unwrap();
            kill_mid(
                &comm,
                &s,
                "alltoall",
                Box::new(|_, sync| {
                    a2a.run(&s, &inp, &mut out)?;
                    if sync {
                        comm.synchronize(&s)?;
                    }
                    Ok(())
                }),
            );
        }
        "kill_moe_ll" | "kill_moe_ht" => {
            use doorbell::collectives::moe::{MoeHighThroughput, MoeLowLatency};
            let tokens = 64;
            let (cfg, [xp, _, ip, wp, op], _bufs) = moe_inputs(&s, n, tokens);
            if scenario == "kill_moe_ll" {
                let ll = MoeLowLatency::new(&comm, cfg).unwrap();
                kill_mid(
                    &comm,
                    &s,
                    "moe-ll-dispatch",
                    Box::new(|_, sync| {
                        // SAFETY: the buffers hold `tokens` rows of the configured shape.
                        unsafe { ll.dispatch_raw(&s, xp, ip, wp, tokens) }?;
                        if sync {
                            comm.synchronize(&s)?;
                            // SAFETY: as above.
                            unsafe { ll.combine_raw(&s, op) }?;
                            comm.synchronize(&s)?;
                        }
                        Ok(())
                    }),
                );
            } else {
                let ht = MoeHighThroughput::new(&comm, cfg).unwrap();
                kill_mid(
                    &comm,
                    &s,
                    "moe-ht-dispatch",
                    Box::new(|_, sync| {
                        // SAFETY: the buffers hold `tokens` rows of the configured shape.
                        unsafe { ht.dispatch_raw(&s, xp, ip, wp, tokens) }?;
                        if sync {
                            comm.synchronize(&s)?;
                        }
                        Ok(())
                    }),
                );
            }
        }
        "kill_port" => {
            let net = doorbell::collectives::net::NetCollectives::new(&comm, n << 20).unwrap();
            kill_mid(
                &comm,
                &s,
                "portchannel-alltoall",
                Box::new(|_, sync| {
                    net.alltoall(&s, 1 << 20)?;
                    if sync {
                        comm.synchronize(&s)?;
                    }
                    Ok(())
                }),
            );
        }
        "stuck" => {
            // The last rank is alive but stuck in host code: the others' waits give up after
            // their budget (DOORBELL_WAIT_TIMEOUT_MS) and name it; it hears of that on its next
            // call.
            let ar = allreduce_of(&comm);
            let mut buf: CudaSlice<f32> = s.alloc_zeros(4096).unwrap();
            ar.run_in_place(&s, &mut buf).unwrap();
            comm.synchronize(&s).unwrap();
            comm.bootstrap().barrier().unwrap();
            let t0 = Instant::now();
            if me == n - 1 {
                std::thread::sleep(Duration::from_secs(4));
                let e = ar.run_in_place(&s, &mut buf).unwrap_err();
                eprintln!("fault-to-error: stuck {n} ranks rank {me} (the stuck one, on its next call): {e}");
                assert!(
                    matches!(e, Error::PeerFailed { rank, .. } if rank == n - 1),
                    "{e}"
                );
            } else {
                let e = ar
                    .run_in_place(&s, &mut buf)
                    .and_then(|()| comm.synchronize(&s))
                    .unwrap_err();
                let waited = t0.elapsed();
                eprintln!("fault-to-error: stuck {n} ranks rank {me}: {} ms after the call, budget 1500 ms ({e})", waited.as_millis());
                let names = match &e {
                    Error::Timeout { peer, .. } => *peer as usize,
                    Error::PeerFailed { rank, .. } => *rank,
                    other => panic!("expected a timeout or peer failure, got {other}"),
                };
                assert_eq!(names, n - 1, "{e}");
                assert!(waited < Duration::from_millis(1500 + 2000), "{waited:?}");
            }
        }
        "abort" | "abort_pipelined" | "abort_direct" | "abort_alltoall" => {
            // Rank 0 aborts from another thread while its kernel waits for ranks that never
            // come; every rank names rank 0. Rank 0's output comes back marked (NaN) on every
            // path: LL packets (abort: 16 KiB), the pipeline (16 MiB on plain buffers), the
            // two-shot on registered windows (16 MiB), the all-to-all's tiles (1 MiB blocks).
            let elems = if scenario == "abort" { 4096 } else { 4 << 20 };
            let forced = |algorithm| {
                AllReduce::new(
                    &comm,
                    AllReduceOptions {
                        algorithm: Some(algorithm),
                        ..Default::default()
                    },
                )
                .unwrap()
            };
            let ar = match scenario {
                "abort_pipelined" => forced(Algorithm::Pipelined),
                "abort_direct" => forced(Algorithm::TwoShotDirect),
                _ => allreduce_of(&comm),
            };
            let win = comm.alloc(elems * 4).unwrap();
            if scenario == "abort_direct" {
                ar.register_window(&win).unwrap();
            }
            let a2a = AllToAll::new(&comm, AllToAllOptions::default()).unwrap();
            let block = 1usize << 20;
            let a2a_in: CudaSlice<u8> = s.alloc_zeros(n * block).unwrap();
            let mut a2a_out: CudaSlice<u8> = s.alloc_zeros(n * block).unwrap();
            let mut buf: CudaSlice<f32> = s.alloc_zeros(elems).unwrap();
            comm.bootstrap().barrier().unwrap();
            if me == 0 && scenario != "abort" {
                let aborter = abort_soon(&comm);
                let e = match scenario {
                    "abort_alltoall" => a2a.run(&s, &a2a_in, &mut a2a_out),
                    // SAFETY: the window holds `elems` f32.
                    "abort_direct" => unsafe {
                        ar.run_raw(&s, win.device_ptr(), win.device_ptr(), elems, DataType::F32)
                    },
                    _ => ar.run_in_place(&s, &mut buf),
                }
                .and_then(|()| comm.synchronize(&s))
                .unwrap_err();
                aborter.join().unwrap();
                eprintln!("abort, marked outputs: {scenario} {n} ranks: {e}");
                assert!(
                    matches!(&e, Error::PeerFailed { rank: 0, cause, .. } if cause.contains("Communicator::abort")),
                    "{e}"
                );
                // Every element the peers were to provide is NaN (all ones), none left as the
                // zeros it started from. (The all-to-all's own block is this rank's own input.)
                s.synchronize().unwrap();
                let floats: Vec<f32> = match scenario {
                    "abort_alltoall" => s
                        .clone_dtoh(&a2a_out)
                        .unwrap()
                        .chunks_exact(4)
                        .enumerate()
                        .filter(|(i, _)| i * 4 / block != me)
                        .map(|(_, b)| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                        .collect(),
                    "abort_direct" => {
                        let mut v = vec![0f32; elems];
                        // SAFETY: the window holds `elems` f32.
                        unsafe {
                            cudarc::driver::result::memcpy_dtoh_async(
                                &mut v,
                                win.device_ptr(),
                                s.cu_stream(),
                            )
                        }
                        .unwrap();
                        s.synchronize().unwrap();
                        v
                    }
                    _ => s.clone_dtoh(&buf).unwrap(),
                };
                let unmarked = floats.iter().filter(|v| !v.is_nan()).count();
                assert_eq!(
                    unmarked, 0,
                    "{scenario}: elements of a call cut short that are not NaN"
                );
            } else if me == 0 {
                let aborter = abort_soon(&comm);
                let e = ar
                    .run_in_place(&s, &mut buf)
                    .and_then(|()| comm.synchronize(&s))
                    .unwrap_err();
                aborter.join().unwrap();
                let waited = since_fault();
                eprintln!(
                    "fault-to-error: abort {n} ranks rank {me}: {} ms ({e})",
                    waited.as_millis()
                );
                assert!(
                    matches!(&e, Error::PeerFailed { rank: 0, cause, .. } if cause.contains("Communicator::abort")),
                    "{e}"
                );
                assert!(waited < Duration::from_secs(2), "{waited:?}");
                // 16 KiB goes by LL packets: every element waited for a peer that never sent, so
                // every element is marked (NaN), not left as the zeros it started from.
                let got = s.clone_dtoh(&buf).unwrap();
                let unmarked = got.iter().filter(|v| !v.is_nan()).count();
                assert_eq!(unmarked, 0, "elements of a call cut short that are not NaN");
            } else {
                let e = rank_0s_abort(&comm);
                let waited = since_fault();
                eprintln!(
                    "fault-to-error: abort {n} ranks rank {me}: {} ms ({e})",
                    waited.as_millis()
                );
                assert!(matches!(&e, Error::PeerFailed { rank: 0, .. }), "{e}");
                assert!(waited < Duration::from_secs(2), "{waited:?}");
            }
        }
        "mismatch_count"
        | "mismatch_dtype"
        | "mismatch_algorithm"
        | "mismatch_alltoall"
        | "mismatch_window_offsets" => {
            let t0 = Instant::now();
            let e = match scenario {
                "mismatch_alltoall" => {
                    let a2a = AllToAll::new(&comm, AllToAllOptions::default()).unwrap();
                    let per = if me == 0 { 512 } else { 1024 };
                    let inp: CudaSlice<u8> = s.alloc_zeros(n * per).unwrap();
                    let mut out: CudaSlice<u8> = s.alloc_zeros(n * per).unwrap();
                    a2a.run(&s, &inp, &mut out)
                        .and_then(|()| comm.synchronize(&s))
                        .unwrap_err()
                }
                "mismatch_window_offsets" => {
                    // The same count on registered windows, rank 0's buffer 4 KiB further in:
                    // the direct two-shot would sum the wrong elements; the call check names it.
                    let ar = allreduce_of(&comm);
                    let win = comm.alloc((16 << 20) + 4096).unwrap();
                    ar.register_window(&win).unwrap();
                    let p = win.device_ptr() + if me == 0 { 4096 } else { 0 };
                    // SAFETY: 8 MiB of bf16 from p lie inside the window.
                    unsafe { ar.run_raw(&s, p, p, 4 << 20, DataType::Bf16) }
                        .and_then(|()| comm.synchronize(&s))
                        .unwrap_err()
                }
                "mismatch_dtype" if me == 0 => {
                    let ar = allreduce_of(&comm);
                    let mut buf: CudaSlice<half::bf16> = s.alloc_zeros(2048).unwrap();
                    ar.run_in_place(&s, &mut buf)
                        .and_then(|()| comm.synchronize(&s))
                        .unwrap_err()
                }
                _ => {
                    let ar = allreduce_of(&comm);
                    let count = match (scenario, me) {
                        ("mismatch_count", 0) => 1024,
                        ("mismatch_algorithm", 0) => 8 << 20,
                        _ => 2048,
                    };
                    let mut buf: CudaSlice<f32> = s.alloc_zeros(count).unwrap();
                    ar.run_in_place(&s, &mut buf)
                        .and_then(|()| comm.synchronize(&s))
                        .unwrap_err()
                }
            };
            let waited = t0.elapsed();
            eprintln!(
                "fault-to-error: {scenario} {n} ranks rank {me}: {} ms after the call ({e})",
                waited.as_millis()
            );
            match &e {
                Error::ArgumentMismatch { peer, .. } => {
                    assert!(me == 0 || *peer == 0, "{e}")
                }
                other => panic!("expected ArgumentMismatch, got {other}"),
            }
            // DOORBELL_WAIT_TIMEOUT_MS=1500 below: calls whose waits cross wait that long.
            assert!(waited < Duration::from_millis(1500 + 2000), "{waited:?}");
        }
        "mismatch_allgather" => {
            // The copy-engine ring all-gather: the word rides its ready put; rank 0 gathers
            // shards of half the others' size.
            use doorbell::collectives::allgather::{AllGatherOptions, PortAllGather};
            let ag = PortAllGather::new(&comm, 1 << 20, AllGatherOptions::default()).unwrap();
            let bytes = if me == 0 { 1024 } else { 2048 };
            let t0 = Instant::now();
            // SAFETY: my slot of the gather buffer holds `bytes`.
            let e = unsafe { ag.run_raw(&s, ag.my_shard(bytes), bytes) }
                .and_then(|()| comm.synchronize(&s))
                .unwrap_err();
            // Each rank checks its right neighbour: rank 0 and the last rank see it; the others
            // get it relayed, naming rank 0 on one side.
            expect_mismatch_with_rank_0(scenario, n, me, &e, t0);
        }
        "mismatch_net_alltoall" | "mismatch_net_allreduce" => {
            // Ranks as separate nodes (or nodes of two): every byte through PortChannels, where
            // the call word rides the ready handshake (cuda/kernels/net.cu). Rank 0 calls with
            // half the size of the others.
            use doorbell::collectives::net::NetCollectives;
            let nc = NetCollectives::new(&comm, 1 << 20).unwrap();
            let t0 = Instant::now();
            let e = if scenario == "mismatch_net_alltoall" {
                nc.alltoall(&s, if me == 0 { 512 } else { 1024 })
            } else {
                let count = if me == 0 { 1024 } else { 2048 };
                // SAFETY: the send buffer holds 1 MiB, more than `count` f32.
                unsafe { nc.allreduce(&s, DataType::F32, count, nc.send_buffer()) }
            }
            .and_then(|()| comm.synchronize(&s))
            .unwrap_err();
            // Between nodes of two, a rank whose peers all made its call learns of the mismatch
            // from the rank that saw it (relayed): the error names rank 0 on one side or the other.
            expect_mismatch_with_rank_0(scenario, n, me, &e, t0);
        }
        "abort_moe_ll" | "abort_moe_ht" => {
            // Every rank dispatches; then rank 0 alone combines and aborts from another thread
            // while the combine waits for peers that never send: its output comes back marked
            // (every bf16 NaN), not the sums of the buffers' old rows.
            use doorbell::collectives::moe::{MoeHighThroughput, MoeLowLatency};
            let tokens = 32;
            let (cfg, [xp, _sp, ip, wp, op], _bufs) = moe_inputs(&s, n, tokens);
            let hidden = cfg.hidden;
            let (ll, ht) = if scenario == "abort_moe_ll" {
                (Some(MoeLowLatency::new(&comm, cfg).unwrap()), None)
            } else {
                (None, Some(MoeHighThroughput::new(&comm, cfg).unwrap()))
            };
            // SAFETY (every call below): the buffers hold `tokens` rows of the configured shape.
            match (&ll, &ht) {
                (Some(ll), _) => unsafe { ll.dispatch_raw(&s, xp, ip, wp, tokens) }.unwrap(),
                (_, Some(ht)) => unsafe { ht.dispatch_raw(&s, xp, ip, wp, tokens) }.unwrap(),
                _ => unreachable!(),
            }
            comm.synchronize(&s).unwrap();
            comm.bootstrap().barrier().unwrap();
            if me == 0 {
                let aborter = abort_soon(&comm);
                let e = match (&ll, &ht) {
                    (Some(ll), _) => unsafe { ll.combine_raw(&s, op) },
                    (_, Some(ht)) => unsafe {
                        ht.combine_raw(&s, ht.combine_buffer().unwrap(), op)
                    },
                    _ => unreachable!(),
                }
                .and_then(|()| comm.synchronize(&s))
                .unwrap_err();
                aborter.join().unwrap();
                expect_own_abort(scenario, n, &e);
                // SAFETY: `op` holds `tokens` rows of `hidden` bf16.
                unsafe {
                    assert_marked_bf16(&s, op, tokens * hidden, scenario, "a combine cut short")
                };
            } else {
                let e = rank_0s_abort(&comm);
                assert!(matches!(&e, Error::PeerFailed { rank: 0, .. }), "{e}");
            }
        }
        "abort_moe_ll_dispatch" | "abort_moe_ht_dispatch" => {
            // Rank 0 alone dispatches and aborts from another thread while the dispatch waits
            // for counts that never come: its counts come back marked (-1, or negative per
            // expert on the high-throughput path) and every row slot all ones (NaN in bf16).
            use doorbell::collectives::moe::{MoeHighThroughput, MoeLowLatency};
            let tokens = 32;
            let (cfg, [xp, _sp, ip, wp, _op], _bufs) = moe_inputs(&s, n, tokens);
            let (hidden, local) = (cfg.hidden, cfg.num_experts / n);
            let (ll, ht) = if scenario == "abort_moe_ll_dispatch" {
                (Some(MoeLowLatency::new(&comm, cfg).unwrap()), None)
            } else {
                (None, Some(MoeHighThroughput::new(&comm, cfg).unwrap()))
            };
            comm.bootstrap().barrier().unwrap();
            if me == 0 {
                let aborter = abort_soon(&comm);
                // SAFETY: the buffers hold `tokens` rows of the configured shape.
                let e = match (&ll, &ht) {
                    (Some(ll), _) => unsafe { ll.dispatch_raw(&s, xp, ip, wp, tokens) },
                    (_, Some(ht)) => unsafe { ht.dispatch_raw(&s, xp, ip, wp, tokens) },
                    _ => unreachable!(),
                }
                .and_then(|()| comm.synchronize(&s))
                .unwrap_err();
                aborter.join().unwrap();
                expect_own_abort(scenario, n, &e);
                let read_u32 = |at: u64, len: usize| {
                    let mut v = vec![0u32; len];
                    // SAFETY: `at` holds `len` u32 of the dispatcher's results.
                    unsafe { cudarc::driver::result::memcpy_dtoh_async(&mut v, at, s.cu_stream()) }
                        .unwrap();
                    s.synchronize().unwrap();
                    v
                };
                let (rows_at, rows) = match (&ll, &ht) {
                    (Some(ll), _) => {
                        let r = ll.results();
                        let counts = read_u32(r.recv_count, local);
                        assert!(
                            counts.iter().all(|&c| c == u32::MAX),
                            "{scenario}: counts {counts:?}"
                        );
                        (r.recv_x, local * n * tokens)
                    }
                    (_, Some(ht)) => {
                        let r = ht.results();
                        let num = read_u32(r.num_recv, 1);
                        assert_eq!(num, [u32::MAX], "{scenario}: num_recv");
                        let counts = read_u32(r.expert_counts, local);
                        assert!(
                            counts.iter().all(|&c| c & 0x8000_0000 != 0),
                            "{scenario}: expert counts {counts:?}"
                        );
                        (r.recv_x, r.max_rows)
                    }
                    _ => unreachable!(),
                };
                // SAFETY: the results hold `rows` row slots of `hidden` bf16.
                unsafe {
                    assert_marked_bf16(
                        &s,
                        rows_at,
                        rows * hidden,
                        scenario,
                        "a dispatch cut short's rows",
                    )
                };
            } else {
                let e = rank_0s_abort(&comm);
                assert!(matches!(&e, Error::PeerFailed { rank: 0, .. }), "{e}");
            }
        }
        "abort_moe_ll_packed_dispatch" => {
            // DeepEP's layout: rank 0 alone dispatches FP8 rows and aborts from another thread
            // while the receive half waits for counts that never come: every expert's count
            // comes back -1, every packed row and every scale all ones (NaN in e4m3 and f32).
            use doorbell::collectives::moe::{MoeLowLatency, PackedOutputs};
            let tokens = 32;
            let (cfg, [xp, _sp, ip, _wp, _op], _bufs) = moe_inputs(&s, n, tokens);
            let (hidden, local, cap) = (cfg.hidden, cfg.num_experts / n, n * tokens);
            let ll = MoeLowLatency::new(&comm, cfg.with_deep_ep_layout(true)).unwrap();
            let rows: CudaSlice<u8> = s.alloc_zeros(local * cap * hidden).unwrap();
            let scales: CudaSlice<u8> = s.alloc_zeros(local * hidden / 128 * cap * 4).unwrap();
            let src: CudaSlice<i32> = s.alloc_zeros(local * cap).unwrap();
            let range: CudaSlice<i64> = s.alloc_zeros(local * n).unwrap();
            let count: CudaSlice<i32> = s.alloc_zeros(local).unwrap();
            let out = PackedOutputs::new(
                rows.device_ptr(&s).0,
                src.device_ptr(&s).0,
                range.device_ptr(&s).0,
                count.device_ptr(&s).0,
            )
            .with_fp8(scales.device_ptr(&s).0, false, false);
            comm.bootstrap().barrier().unwrap();
            if me == 0 {
                let aborter = abort_soon(&comm);
                // SAFETY: the inputs hold `tokens` rows of the configured shape, the outputs
                // their documented sizes for it.
                let e = unsafe { ll.dispatch_packed_raw(&s, xp, ip, tokens, &out) }
                    .and_then(|()| comm.synchronize(&s))
                    .unwrap_err();
                aborter.join().unwrap();
                expect_own_abort(scenario, n, &e);
                let counts = s.clone_dtoh(&count).unwrap();
                assert!(
                    counts.iter().all(|&c| c == -1),
                    "{scenario}: counts {counts:?}"
                );
                for (what, bytes) in [
                    ("rows", s.clone_dtoh(&rows).unwrap()),
                    ("scales", s.clone_dtoh(&scales).unwrap()),
                ] {
                    let unmarked = bytes.iter().filter(|&&b| b != 0xff).count();
                    assert_eq!(
                        unmarked,
                        0,
                        "{scenario}: {unmarked} of {} bytes of the {what} not marked",
                        bytes.len()
                    );
                }
            } else {
                let e = rank_0s_abort(&comm);
                assert!(matches!(&e, Error::PeerFailed { rank: 0, .. }), "{e}");
            }
        }
        "mismatch_moe_ll" | "mismatch_moe_ht" => {
            use doorbell::collectives::moe::{MoeHighThroughput, MoeLowLatency};
            let tokens = 32;
            let (cfg, [xp, sp, ip, wp, op], _bufs) = moe_inputs(&s, n, tokens);
            let t0;
            // SAFETY (every call below): the buffers hold `tokens` rows of the configured shape.
            let e = if scenario == "mismatch_moe_ll" {
                // Rank 0 dispatches twice; the others dispatch, then combine.
                let ll = MoeLowLatency::new(&comm, cfg).unwrap();
                let first = unsafe { ll.dispatch_raw(&s, xp, ip, wp, tokens) }
                    .and_then(|()| comm.synchronize(&s));
                t0 = Instant::now();
                match first {
                    // A rank that is still in the first call when the others have found the
                    // second call's mismatch learns of it there (4 ranks sharing one GPU).
                    Err(e) => e,
                    Ok(()) => if me == 0 {
                        unsafe { ll.dispatch_raw(&s, xp, ip, wp, tokens) }
                    } else {
                        unsafe { ll.combine_raw(&s, op) }
                    }
                    .and_then(|()| comm.synchronize(&s))
                    .unwrap_err(),
                }
            } else {
                // Rank 0 dispatches FP8 rows; the others bf16.
                let ht = MoeHighThroughput::new(&comm, cfg).unwrap();
                t0 = Instant::now();
                if me == 0 {
                    unsafe { ht.dispatch_fp8_raw(&s, xp, sp, ip, wp, tokens) }
                } else {
                    unsafe { ht.dispatch_raw(&s, xp, ip, wp, tokens) }
                }
                .and_then(|()| comm.synchronize(&s))
                .unwrap_err()
            };
            // Rank 0 and the ranks that check it name each other; a rank that learns of it
            // relayed (3+ ranks) names the pair that found it, rank 0 on one side.
            expect_mismatch_with_rank_0(scenario, n, me, &e, t0);
        }
        "mismatch_moe_shape" => {
            // Rank 0 builds a high-throughput buffer of hidden 256, the others 512: every rank
            // is told at construction, with both shapes.
            use doorbell::collectives::moe::{MoeConfig, MoeHighThroughput};
            let cfg = MoeConfig::new(if me == 0 { 256 } else { 512 }, 4, 4 * n, 32).with_blocks(8);
            let t0 = Instant::now();
            let e = MoeHighThroughput::new(&comm, cfg)
                .err()
                .expect("shapes differ");
            let waited = t0.elapsed();
            eprintln!(
                "fault-to-error: {scenario} {n} ranks rank {me}: {} ms ({e})",
                waited.as_millis()
            );
            match &e {
                Error::ArgumentMismatch {
                    mine, peer, theirs, ..
                } => {
                    assert!(me == 0 || *peer == 0, "{e}");
                    let (a, b) = if me == 0 {
                        ("hidden 256", "hidden 512")
                    } else {
                        ("hidden 512", "hidden 256")
                    };
                    assert!(mine.contains(a) && theirs.contains(b), "{e}");
                }
                other => panic!("expected ArgumentMismatch, got {other}"),
            }
            assert!(waited < Duration::from_secs(2), "{waited:?}");
        }
        "mismatch_alltoallv_counts" | "mismatch_alltoallv_protocols" => {
            // Rank 0 sends rank 1 more than rank 1 expects (f32 elements): 512 against 256 (both
            // LL-sized), or 256 Ki against 256 (tiles against packets). Every other pair sends
            // 4 elements. Ranks 0 and 1 each name the pair with all four counts; the others
            // learn it from them.
            let (sent, expected) = if scenario == "mismatch_alltoallv_counts" {
                (512, 256)
            } else {
                (256 << 10, 256)
            };
            let send: Vec<usize> = (0..n)
                .map(|p| if (me, p) == (0, 1) { sent } else { 4 })
                .collect();
            let recv: Vec<usize> = (0..n)
                .map(|p| if (p, me) == (0, 1) { expected } else { 4 })
                .collect();
            let c = Counts::packed(send, recv);
            let a2a = AllToAll::new(&comm, AllToAllOptions::default()).unwrap();
            let inp: CudaSlice<f32> = s.alloc_zeros(sent + 4 * n).unwrap();
            let mut out: CudaSlice<f32> = s.alloc_zeros(sent + 4 * n).unwrap();
            let t0 = Instant::now();
            let e = match a2a
                .run_v(&s, &inp, &mut out, &c)
                .and_then(|()| comm.synchronize(&s))
            {
                Err(e) => e,
                // A rank outside the pair had every block right (its call is a result); it
                // learns of the pair at once after.
                Ok(()) if me >= 2 => loop {
                    if let Err(e) = comm.check_health() {
                        break e;
                    }
                    assert!(
                        t0.elapsed() < Duration::from_secs(2),
                        "rank {me}: never told"
                    );
                    std::thread::sleep(Duration::from_millis(1));
                },
                Ok(()) => panic!("rank {me}: the call of the mismatched pair returned Ok"),
            };
            let waited = t0.elapsed();
            eprintln!(
                "fault-to-error: {scenario} {n} ranks rank {me}: {} ms after the call ({e})",
                waited.as_millis()
            );
            let Error::ArgumentMismatch {
                rank,
                mine,
                peer,
                theirs,
            } = &e
            else {
                panic!("expected ArgumentMismatch, got {e}")
            };
            assert!(*rank <= 1 && *peer <= 1 && rank != peer, "{e}");
            let text = format!("{mine} / {theirs}");
            let (sb, eb) = (
                format!("{} bytes", 4 * sent),
                format!("{} bytes", 4 * expected),
            );
            assert!(text.contains(&sb) && text.contains(&eb), "{e}");
            assert!(waited < Duration::from_secs(2), "{waited:?}");
        }
        "bad_alltoallv_counts" => {
            // Rank 0's device counts put the block from rank 1 past the end of its output: its
            // kernel refuses before writing anything; every other rank fails naming rank 0.
            let a2a = AllToAll::new(&comm, AllToAllOptions::default()).unwrap();
            let block = 1024usize;
            let bytes = n * block;
            let inp: CudaSlice<u8> = s.alloc_zeros(bytes).unwrap();
            let out: CudaSlice<u8> = s.clone_htod(&vec![0xabu8; bytes]).unwrap();
            let mut host: Vec<u64> = Vec::new();
            for row in 0..4 {
                host.extend((0..n).map(|p| match row {
                    0 | 2 => block as u64,
                    _ => (p * block) as u64,
                }));
            }
            if me == 0 {
                host[3 * n + 1] = (bytes - block / 2) as u64;
            }
            let counts = s.clone_htod(&host).unwrap();
            let t0 = Instant::now();
            // SAFETY: buffers of `bytes` each and a (4, n) count array, alive until the sync;
            // the kernel checks the ranges (rank 0's bad one is the point).
            let e = unsafe {
                a2a.run_v_raw(
                    &s,
                    inp.device_ptr(&s).0,
                    bytes,
                    out.device_ptr(&s).0,
                    bytes,
                    counts.device_ptr(&s).0,
                )
            }
            .and_then(|()| comm.synchronize(&s))
            .unwrap_err();
            let waited = t0.elapsed();
            eprintln!(
                "fault-to-error: {scenario} {n} ranks rank {me}: {} ms after the call ({e})",
                waited.as_millis()
            );
            let text = e.to_string();
            if me == 0 {
                assert!(matches!(e, Error::InvalidArgument { .. }), "{e}");
                assert!(
                    text.contains("the block from rank 1")
                        && text.contains(&format!("{bytes} bytes")),
                    "{e}"
                );
                let got = s.clone_dtoh(&out).unwrap();
                assert!(
                    got.iter().all(|&b| b == 0xab),
                    "rank 0's output was written"
                );
            } else {
                assert!(matches!(e, Error::PeerFailed { rank: 0, .. }), "{e}");
                assert!(text.contains("alltoallv counts"), "{e}");
            }
            assert!(waited < Duration::from_secs(2), "{waited:?}");
        }
        "skipped_call" => {
            // Rank 0 makes 4 allreduces, the others 5, all with the default 30 s budget: rank 0
            // returns Ok and leaves; the others are told at once, with both call counts.
            let ar = allreduce_of(&comm);
            let mut buf: CudaSlice<f32> = s.alloc_zeros(1 << 16).unwrap();
            for _ in 0..4 {
                ar.run_in_place(&s, &mut buf).unwrap();
            }
            comm.synchronize(&s).unwrap();
            if me == 0 {
                drop(ar);
                return;
            }
            let t0 = Instant::now();
            let e = ar
                .run_in_place(&s, &mut buf)
                .and_then(|()| comm.synchronize(&s))
                .unwrap_err();
            let waited = t0.elapsed();
            eprintln!(
                "fault-to-error: {scenario} {n} ranks rank {me}: {} ms ({e})",
                waited.as_millis()
            );
            let text = e.to_string();
            assert!(matches!(&e, Error::PeerFailed { rank: 0, .. }), "{e}");
            assert!(
                text.contains(&format!("after 4 collective calls, while rank {me} made 5")),
                "{e}"
            );
            assert!(waited < Duration::from_secs(2), "{waited:?}");
        }
        "busy_stream" => {
            // Work of someone else's on the stream outlasts the bound (two budgets of 1 s):
            // synchronize returns a Timeout naming this rank and the stream, not a hang.
            use cudarc::driver::{LaunchConfig, PushKernelArg};
            let ptx = cudarc::nvrtc::compile_ptx(
                r#"extern "C" __global__ void busy(unsigned long long ns) {
                    unsigned long long t0, t;
                    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
                    do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < ns);
                }"#,
            )
            .unwrap();
            let module = comm.gpu().context().load_module(ptx).unwrap();
            let busy = module.load_function("busy").unwrap();
            let ns: u64 = 5_000_000_000;
            let mut b = s.launch_builder(&busy);
            b.arg(&ns);
            let one = LaunchConfig {
                grid_dim: (1, 1, 1),
                block_dim: (1, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: the kernel takes one u64 and touches no memory.
            unsafe { b.launch(one) }.unwrap();
            let t0 = Instant::now();
            let e = comm.synchronize(&s).unwrap_err();
            let waited = t0.elapsed();
            eprintln!(
                "fault-to-error: {scenario} {n} ranks rank {me}: {} ms ({e})",
                waited.as_millis()
            );
            assert!(
                matches!(&e, Error::Timeout { rank, what: doorbell::error::WaitKind::Stream, .. }
                    if *rank == me as i32),
                "{e}"
            );
            assert!(
                waited >= Duration::from_millis(1900) && waited < Duration::from_millis(3500),
                "{waited:?}"
            );
            // The kernel ends by itself; the communicator is still healthy.
            s.synchronize().unwrap();
            comm.check_health().unwrap();
            comm.bootstrap().barrier().unwrap();
        }
        "shrink" => {
            let ar = allreduce_of(&comm);
            let mut buf: CudaSlice<f32> = s.alloc_zeros(1 << 16).unwrap();
            kill_mid(
                &comm,
                &s,
                "allreduce-then-shrink",
                Box::new(|_, sync| {
                    ar.run_in_place(&s, &mut buf)?;
                    if sync {
                        comm.synchronize(&s)?;
                    }
                    Ok(())
                }),
            );
            let small = Arc::new(comm.shrink(&[n - 1]).unwrap());
            drop(ar);
            drop(comm);
            let (me2, n2) = (small.rank(), small.world_size());
            assert_eq!((me2, n2), (me, n - 1));
            let s2 = small.gpu().new_stream().unwrap();
            let ar2 = allreduce_of(&small);
            let counts = [
                1000usize,
                message_bytes(1 << 20) / 4,
                message_bytes(12 << 20) / 4,
            ];
            for (round, count) in (1u32..).zip(counts) {
                let host: Vec<f32> = (0..count)
                    .map(|i| ((i % 7) as u32 * (me2 as u32 + 1) + round) as f32)
                    .collect();
                let mut dev = s2.clone_htod(&host).unwrap();
                ar2.run_in_place(&s2, &mut dev).unwrap();
                small.synchronize(&s2).unwrap();
                let got = s2.clone_dtoh(&dev).unwrap();
                for (i, g) in got.iter().enumerate() {
                    let want: u32 = (0..n2 as u32)
                        .map(|r| (i % 7) as u32 * (r + 1) + round)
                        .sum();
                    assert_eq!(*g, want as f32, "shrunk allreduce of {count}: element {i}");
                }
            }
            eprintln!("rank {me}: shrunk to rank {me2} of {n2}; allreduces correct");
            small.bootstrap().barrier().unwrap();
            drop(ar2);
            drop(small);
        }
        other => panic!("unknown scenario {other}"),
    }
}

fn kill_scenario(name: &str) {
    for n in rank_counts() {
        let exits = gpu_case(name, n, &[]);
        assert_exits(name, &exits, Some(n - 1));
    }
}

#[test]
#[ignore = "needs GPU"]
fn kill_during_setup() {
    kill_scenario("kill_setup");
}

#[test]
#[ignore = "needs GPU"]
fn kill_mid_allreduce() {
    kill_scenario("kill_allreduce");
}

/// A kill mid-allreduce where a MoE low-latency exchange with a rank mask made the communicator
/// tolerate peer loss: the allreduce still ends in PeerFailed naming the dead rank, promptly.
#[test]
#[ignore = "needs GPU"]
fn kill_mid_allreduce_while_peer_loss_is_tolerated() {
    kill_scenario("kill_allreduce_tolerant");
}

#[test]
#[ignore = "needs GPU"]
fn kill_mid_alltoall() {
    kill_scenario("kill_alltoall");
}

#[test]
#[ignore = "needs GPU"]
fn kill_mid_moe_low_latency_dispatch() {
    kill_scenario("kill_moe_ll");
}

#[test]
#[ignore = "needs GPU"]
fn kill_mid_moe_high_throughput_dispatch() {
    kill_scenario("kill_moe_ht");
}

#[test]
#[ignore = "needs GPU"]
fn kill_mid_port_channel_transfer() {
    kill_scenario("kill_port");
}

#[test]
#[ignore = "needs GPU"]
fn a_rank_stuck_in_host_code_is_named_after_the_budget() {
    for n in rank_counts() {
        let exits = gpu_case("stuck", n, &[("DOORBELL_WAIT_TIMEOUT_MS", "1500".into())]);
        assert_exits("stuck", &exits, None);
    }
}

#[test]
#[ignore = "needs GPU"]
fn a_rank_that_skips_a_call_is_named_with_both_counts() {
    for n in rank_counts() {
        let exits = gpu_case("skipped_call", n, &[]);
        assert_exits("skipped_call", &exits, None);
    }
}

#[test]
#[ignore = "needs GPU"]
fn synchronize_gives_up_on_a_stream_that_never_finishes() {
    for n in rank_counts() {
        let exits = gpu_case(
            "busy_stream",
            n,
            &[("DOORBELL_WAIT_TIMEOUT_MS", "1000".into())],
        );
        assert_exits("busy_stream", &exits, None);
    }
}

#[test]
#[ignore = "needs GPU"]
fn abort_from_another_thread_while_a_kernel_waits() {
    for n in rank_counts() {
        let exits = gpu_case("abort", n, &[]);
        assert_exits("abort", &exits, None);
    }
}

/// The same abort on the tile paths and the MoE combines: the pipelined and the direct two-shot
/// allreduce, the all-to-all's tiles, the low-latency and the high-throughput combine leave rank
/// 0's output marked (every element NaN), not stale.
#[test]
#[ignore = "needs GPU"]
fn an_abort_leaves_the_tile_paths_and_combines_outputs_marked() {
    for scenario in [
        "abort_pipelined",
        "abort_direct",
        "abort_alltoall",
        "abort_moe_ll",
        "abort_moe_ht",
        "abort_moe_ll_dispatch",
        "abort_moe_ht_dispatch",
        "abort_moe_ll_packed_dispatch",
    ] {
        for n in rank_counts() {
            let exits = gpu_case(scenario, n, &[]);
            assert_exits(scenario, &exits, None);
        }
    }
}

/// Across nodes the high-throughput dispatch's exchange between nodes gives up first, and the
/// node's own dispatch (its own communicator) then runs over what had arrived; its results come
/// back marked all the same (`moe_ht_remap`): ranks as separate nodes on the emulated NIC.
#[test]
#[ignore = "needs GPU"]
fn an_abort_across_nodes_leaves_the_high_throughput_dispatch_marked() {
    for n in rank_counts() {
        let env = [
            ("DOORBELL_SEPARATE_NODES", "1".to_string()),
            ("DOORBELL_IB_EMULATE", "1".into()),
        ];
        let exits = gpu_case("abort_moe_ht_dispatch", n, &env);
        assert_exits("abort_moe_ht_dispatch across nodes", &exits, None);
    }
}

#[test]
#[ignore = "needs GPU"]
fn mismatched_calls_are_named_on_every_rank() {
    for scenario in [
        "mismatch_count",
        "mismatch_dtype",
        "mismatch_algorithm",
        "mismatch_alltoall",
        "mismatch_window_offsets",
        "mismatch_moe_ll",
        "mismatch_moe_ht",
        "mismatch_moe_shape",
        "mismatch_alltoallv_counts",
        "mismatch_alltoallv_protocols",
        "bad_alltoallv_counts",
        "mismatch_allgather",
    ] {
        for n in rank_counts() {
            let exits = gpu_case(scenario, n, &[("DOORBELL_WAIT_TIMEOUT_MS", "1500".into())]);
            assert_exits(scenario, &exits, None);
        }
    }
}

/// The collectives across nodes (`collectives::net`) check their calls too: over Ethernet between
/// separate nodes, and between nodes of two (the hierarchical allreduce) at even rank counts.
#[test]
#[ignore = "needs GPU"]
fn mismatched_calls_across_nodes_are_named_on_every_rank() {
    for scenario in ["mismatch_net_alltoall", "mismatch_net_allreduce"] {
        for n in rank_counts() {
            let mut env = vec![
                ("DOORBELL_WAIT_TIMEOUT_MS", "1500".to_string()),
                ("DOORBELL_SEPARATE_NODES", "1".into()),
                ("DOORBELL_IB_DISABLE", "1".into()),
            ];
            let exits = gpu_case(scenario, n, &env);
            assert_exits(scenario, &exits, None);
            if n % 2 == 0 && n > 2 {
                env.push(("DOORBELL_NODE_SIZE", "2".into()));
                let exits = gpu_case(scenario, n, &env);
                assert_exits(scenario, &exits, None);
            }
        }
    }
}

/// MoE across nodes checks its calls too (coll/moe_net.cuh: the inbox reached over the channels):
/// low-latency, rank 0 dispatching twice while the others dispatch and combine; high-throughput,
/// rank 0 dispatching FP8 rows while the others send bf16; over Ethernet and the emulated NIC with
/// the GPU posting, ranks as separate nodes and as nodes of two (even rank counts from 4).
#[test]
#[ignore = "needs GPU"]
fn mismatched_moe_calls_across_nodes_are_named_on_every_rank() {
    let variants: [&[(&str, &str)]; 3] = [
        &[("DOORBELL_IB_DISABLE", "1")],
        &[
            ("DOORBELL_IB_EMULATE", "1"),
            ("DOORBELL_IB_POSTING", "ibgda"),
        ],
        &[("DOORBELL_IB_DISABLE", "1"), ("DOORBELL_NODE_SIZE", "2")],
    ];
    for variant in variants {
        for n in rank_counts() {
            if variant.iter().any(|(k, _)| *k == "DOORBELL_NODE_SIZE") && (n % 2 != 0 || n < 4) {
                continue;
            }
            let mut env = vec![
                ("DOORBELL_WAIT_TIMEOUT_MS", "1500".to_string()),
                ("DOORBELL_SEPARATE_NODES", "1".into()),
            ];
            env.extend(variant.iter().map(|&(k, v)| (k, v.to_string())));
            for scenario in ["mismatch_moe_ll", "mismatch_moe_ht"] {
                let exits = gpu_case(scenario, n, &env);
                assert_exits(scenario, &exits, None);
            }
        }
    }
}

#[test]
#[ignore = "needs GPU"]
fn shrink_after_a_failure_then_correct_allreduces() {
    for n in rank_counts() {
        let exits = gpu_case("shrink", n, &[]);
        assert_exits("shrink", &exits, Some(n - 1));
    }
}
