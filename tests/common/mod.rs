//! Shared harness of the multi-process GPU tests: each test spawns its ranks as processes of its
//! own test binary, running the binary's `gpu_rank` test with the case in `DOORBELL_GPU_CASE`,
//! as a launcher would (one process per rank; `LOCAL_RANK % GPUs` picks the GPU, so more ranks
//! than GPUs share them). Also the rank- and index-derived payloads (`pattern`, the host twin of
//! the self-test kernels' fill) that let a wrong byte say who sent it.
#![allow(dead_code)] // each test binary uses part of it

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, LaunchConfig, PushKernelArg};
use doorbell::communicator::Communicator;
use doorbell::job::launch::{spawn_ranks, SpawnOptions};
use std::ffi::OsString;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Set by a case that provokes a fault on purpose ([`fault_on_purpose`]): only then may the
/// final barrier fail.
static FAULT_ON_PURPOSE: AtomicBool = AtomicBool::new(false);

/// A case calls this before it provokes a fault (a forced timeout, an error completion, a stopped
/// proxy): the job may then end aborted. Anywhere else a failed final barrier fails the rank.
pub fn fault_on_purpose() {
    FAULT_ON_PURPOSE.store(true, Ordering::Relaxed);
}

/// The variable that tells a spawned rank which case to run.
pub const CASE_VAR: &str = "DOORBELL_GPU_CASE";

/// Rank counts every multi-rank test runs with: `DOORBELL_TEST_RANKS` (e.g. "8") lists them
/// explicitly; otherwise 2, 3 and 4, and `DOORBELL_TEST_MAX_RANKS=8` adds 8 (an 8-GPU machine, or
/// ranks sharing fewer GPUs).
pub fn rank_counts() -> Vec<usize> {
    if let Ok(list) = std::env::var("DOORBELL_TEST_RANKS") {
        let v: Vec<usize> = list
            .split([' ', ','])
            .filter_map(|s| s.trim().parse().ok())
            .filter(|&n| n >= 2)
            .collect();
        if !v.is_empty() {
            return v;
        }
    }
    let max: usize = std::env::var("DOORBELL_TEST_MAX_RANKS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(4);
    [2, 3, 4, 8].into_iter().filter(|&n| n <= max).collect()
}

/// Runs `case` as `nranks` processes and asserts every one succeeded.
pub fn run_case(case: &str, nranks: usize, extra: &[(&str, &str)]) {
    let exe = std::env::current_exe().expect("test binary path");
    let args: Vec<OsString> = [
        "gpu_rank",
        "--exact",
        "--ignored",
        "--nocapture",
        "--test-threads=1",
    ]
    .iter()
    .map(OsString::from)
    .collect();
    let mut extra_env = vec![(CASE_VAR.to_string(), case.to_string())];
    extra_env.extend(extra.iter().map(|(k, v)| (k.to_string(), v.to_string())));
    let exits = spawn_ranks(
        &exe,
        &args,
        &SpawnOptions {
            nranks,
            extra_env,
            timeout: Some(Duration::from_secs(300)),
            grace: Duration::from_secs(20),
        },
    )
    .expect("spawn ranks");
    let failed: Vec<_> = exits.iter().filter(|e| !e.success()).collect();
    assert!(
        failed.is_empty(),
        "case {case} with {nranks} ranks: {failed:?}"
    );
}

/// The case this process should run as a rank, if it was spawned by `run_case`.
pub fn spawned_case() -> Option<String> {
    std::env::var(CASE_VAR).ok()
}

/// The body of every test binary's `gpu_rank` entry: in a spawned rank, opens the communicator
/// and a stream, runs the named case (`run(case, comm, stream)`), and meets the other ranks at a
/// final barrier; outside one, does nothing.
pub fn rank_main(run: impl FnOnce(&str, &Arc<Communicator>, &Arc<CudaStream>)) {
    let Some(case) = spawned_case() else {
        return;
    };
    let comm = Arc::new(Communicator::from_env().expect("communicator"));
    let stream = comm.gpu().new_stream().expect("stream");
    run(&case, &comm, &stream);
    // A case that provoked a fault on purpose (and checked the errors it got on the ranks it
    // concerns) leaves the job aborted: the other ranks may learn of it only in this barrier.
    if let Err(e) = comm.bootstrap().barrier() {
        assert!(
            FAULT_ON_PURPOSE.load(Ordering::Relaxed),
            "rank {}: the final barrier failed, though case {case} provoked no fault: {e}",
            comm.rank()
        );
        let started = std::time::Instant::now();
        let fault = loop {
            match comm.check_health() {
                Err(f) => break f,
                Ok(()) if started.elapsed() > Duration::from_secs(2) => {
                    panic!("final barrier: {e}")
                }
                Ok(()) => std::thread::sleep(Duration::from_millis(5)),
            }
        };
        eprintln!("rank {}: the job ended aborted: {fault}", comm.rank());
    }
}

/// Byte `j` of the message `from` sends to `to` in `round` (twin of `pattern` in selftest.cu).
pub fn pattern(from: u32, to: u32, round: u32, j: u64) -> u8 {
    let h = (j as u32)
        .wrapping_mul(2654435761)
        .wrapping_add(((j >> 32) as u32).wrapping_mul(40503));
    ((h >> 11) ^ (from * 37 + to * 11 + round * 101 + 1)) as u8
}

pub fn launch_cfg(blocks: u32, threads: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    }
}

#[allow(clippy::too_many_arguments)]
pub fn fill(
    comm: &Communicator,
    s: &Arc<CudaStream>,
    ptr: u64,
    off: u64,
    bytes: u64,
    from: u32,
    to: u32,
    round: u32,
) {
    let f = comm.gpu().function("selftest", "selftest_fill").unwrap();
    let mut b = s.launch_builder(&f);
    b.arg(&ptr)
        .arg(&off)
        .arg(&bytes)
        .arg(&from)
        .arg(&to)
        .arg(&round);
    // SAFETY: arguments match selftest_fill's signature; the range lies in the caller's buffer.
    unsafe { b.launch(launch_cfg(128, 256)) }.unwrap();
}

#[allow(clippy::too_many_arguments)]
pub fn count_wrong(
    comm: &Communicator,
    s: &Arc<CudaStream>,
    ptr: u64,
    off: u64,
    bytes: u64,
    from: u32,
    to: u32,
    round: u32,
) -> u64 {
    let f = comm
        .gpu()
        .function("selftest", "selftest_count_wrong")
        .unwrap();
    let wrong: CudaSlice<u64> = s.alloc_zeros(1).unwrap();
    {
        let (wp, _g) = wrong.device_ptr(s);
        let mut b = s.launch_builder(&f);
        b.arg(&ptr)
            .arg(&off)
            .arg(&bytes)
            .arg(&from)
            .arg(&to)
            .arg(&round)
            .arg(&wp);
        // SAFETY: arguments match selftest_count_wrong; `wrong` holds one u64.
        unsafe { b.launch(launch_cfg(128, 256)) }.unwrap();
    }
    comm.synchronize(s).unwrap();
    s.clone_dtoh(&wrong).unwrap()[0]
}

/// What a peer's lateness costs: the median time of `op` on this rank over `reps` calls with
/// every rank on time, and over `reps` calls while the last rank starts each call `late` after
/// the others (a GPU sleep before its call), alternating, each call after a barrier (whose exit
/// skew both medians share). Every rank calls this; only ranks other than the late one measure.
/// `None` where ranks share a GPU (time-sliced, a late rank's sleep and its peers' waits take
/// turns, so nothing about the waits can be measured).
pub fn late_peer_cost(
    comm: &Arc<Communicator>,
    s: &Arc<CudaStream>,
    late: Duration,
    reps: usize,
    op: &dyn Fn() -> doorbell::Result<()>,
) -> Option<(Duration, Duration)> {
    let checker = doorbell::collectives::verify::Verifier::new(comm.gpu()).expect("checker");
    let shared = doorbell::gpu::cuda::device_count().unwrap_or(0) < comm.world_size();
    let last = comm.rank() + 1 == comm.world_size();
    let mut times = [Vec::with_capacity(reps), Vec::with_capacity(reps)];
    for i in 0..2 * reps {
        let delayed = i % 2 == 1;
        comm.synchronize(s).expect("synchronize");
        comm.bootstrap().barrier().expect("barrier");
        if last && delayed {
            checker.delay(s, late).expect("delay");
        }
        let flags = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
        let start = s.record_event(flags).expect("event");
        op().expect("collective");
        let stop = s.record_event(flags).expect("event");
        comm.synchronize(s).expect("synchronize");
        let ms = start.elapsed_ms(&stop).expect("elapsed");
        times[usize::from(delayed)].push(Duration::from_secs_f64(ms as f64 / 1e3));
    }
    if shared || last {
        return None;
    }
    let median = |v: &mut Vec<Duration>| {
        v.sort();
        v[v.len() / 2]
    };
    let [mut on_time, mut delayed] = times;
    Some((median(&mut on_time), median(&mut delayed)))
}

/// Asserts what [`late_peer_cost`] measured: a peer `late` late costs at most `late` plus
/// `slack` more than a call with every rank on time.
pub fn assert_late_peer_cost(
    comm: &Communicator,
    what: &str,
    late: Duration,
    slack: Duration,
    got: Option<(Duration, Duration)>,
) {
    let us = |d: Duration| d.as_secs_f64() * 1e6;
    match got {
        Some((on_time, delayed)) => {
            eprintln!(
                "rank {}: {what}: median {:.1} us on time, {:.1} us with a peer {:.0} us late",
                comm.rank(),
                us(on_time),
                us(delayed),
                us(late)
            );
            assert!(
                delayed < on_time + late + slack,
                "rank {}: {what}: a peer {:.0} us late cost {:.1} us (on time {:.1} us, allowed {:.0} us more)",
                comm.rank(),
                us(late),
                us(delayed),
                us(on_time),
                us(late + slack)
            );
        }
        None if comm.rank() == 0 => {
            eprintln!("{what}: ranks share a GPU here: not measurable (needs a GPU per rank)")
        }
        None => {}
    }
}
