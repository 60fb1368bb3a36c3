//! Allreduce on GPUs (`#[ignore = "needs GPU"]`; run with `--ignored`): every algorithm x data
//! type x rank count x awkward size (1 element, not a multiple of 16 bytes, one past a tile or
//! shard boundary) x in/out of place, eager and as 100 CUDA-graph replays; a pressure mode that
//! repeats random sizes and compares result hashes across ranks and across runs; graphs of
//! several calls; and the argument-agreement check.

mod common;

use common::{assert_late_peer_cost, late_peer_cost, rank_counts, rank_main, run_case};
use cudarc::driver::sys::CUstreamCaptureMode;
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
use doorbell::collectives::allreduce::{Algorithm, AllReduce, AllReduceOptions};
use doorbell::collectives::verify::Verifier;
use doorbell::collectives::DataType;
use doorbell::communicator::Communicator;
use doorbell::Error;
use std::sync::Arc;

#[test]
#[ignore = "needs GPU"]
fn gpu_rank() {
    rank_main(|case, comm, stream| match case {
        c if c.starts_with("matrix:") => {
            let name = &c["matrix:".len()..];
            let (index, algo) = Algorithm::ALL
                .iter()
                .enumerate()
                .find(|(_, a)| a.name() == name)
                .unwrap_or_else(|| panic!("unknown algorithm {name}"));
            matrix(comm, stream, *algo, index as u32)
        }
        "pressure" => pressure(comm, stream),
        "graph_of_three" => graph_of_three(comm, stream),
        "disagree" => disagree(comm, stream),
        "late_peer" => late_peer(comm, stream),
        "windows" => windows(comm, stream),
        "window_sizes_differ" => window_sizes_differ(comm, stream),
        other => panic!("unknown case {other}"),
    });
}

#[test]
#[ignore = "needs GPU"]
fn every_algorithm_dtype_size_and_placement() {
    // One job per algorithm: at 3-4 ranks sharing one GPU the whole matrix outlasted the
    // harness's 300 s per job. `DOORBELL_TEST_ALGORITHMS` (names, e.g. "pipelined
    // twoshot-direct") keeps to some, so that GPUs can share the matrix out.
    let only = std::env::var("DOORBELL_TEST_ALGORITHMS").unwrap_or_default();
    let only: Vec<&str> = only.split([' ', ',']).filter(|s| !s.is_empty()).collect();
    for name in &only {
        assert!(
            Algorithm::ALL.iter().any(|a| a.name() == *name),
            "DOORBELL_TEST_ALGORITHMS: unknown algorithm {name}"
        );
    }
    for n in rank_counts() {
        for algo in Algorithm::ALL {
            if only.is_empty() || only.contains(&algo.name()) {
                run_case(&format!("matrix:{}", algo.name()), n, &[]);
            }
        }
    }
}

/// The two-shot straight between registered windows: forced and by default, awkward sizes, in
/// and out of place, at an offset inside the windows, eager and replayed, interleaved with
/// staged calls that share its semaphores.
#[test]
#[ignore = "needs GPU"]
fn registered_windows_reduce_in_place_and_out() {
    for n in rank_counts() {
        run_case("windows", n, &[]);
    }
}

/// Windows of different sizes on different ranks are refused on every rank, naming them.
#[test]
#[ignore = "needs GPU"]
fn windows_of_different_sizes_are_refused() {
    for n in rank_counts() {
        run_case("window_sizes_differ", n, &[]);
    }
}

#[test]
#[ignore = "needs GPU"]
fn pressure_random_sizes_same_hash_everywhere() {
    for n in rank_counts() {
        run_case("pressure", n, &[]);
    }
}

#[test]
#[ignore = "needs GPU"]
fn graphs_of_an_odd_number_of_calls_replay() {
    for n in rank_counts() {
        run_case(
            "graph_of_three",
            n,
            &[("DOORBELL_WAIT_TIMEOUT_MS", "10000")],
        );
    }
}

/// A rank that starts late costs its peers its lateness and no more. Needs a GPU per rank (ranks
/// sharing one GPU take turns, so nothing is measured there and the case says so).
#[test]
#[ignore = "needs GPU"]
fn a_late_peer_costs_only_its_lateness() {
    for n in rank_counts() {
        run_case("late_peer", n, &[]);
    }
}

#[test]
#[ignore = "needs GPU"]
fn argument_check_names_the_odd_rank() {
    run_case("disagree", 3, &[("DOORBELL_HOST_CALL_CHECK", "1")]);
}

struct Bufs {
    input: CudaSlice<u8>,
    output: CudaSlice<u8>,
}

fn ptr(s: &Arc<CudaStream>, b: &CudaSlice<u8>, offset: usize) -> u64 {
    b.device_ptr(s).0 + offset as u64
}

/// Sizes (elements) that stress the edges of `algo` on this communicator.
fn sizes(ar: &AllReduce, algo: Algorithm, dtype: DataType) -> Vec<usize> {
    let world = ar.communicator().world_size();
    let max = ar.max_bytes(algo).min(24 << 20) / dtype.size();
    // Odd sizes, and 16-byte multiples (the sentinel two-shot takes only those).
    let mut v = vec![1, 2, 7, 8, 1024, 4097, 8192 * world + 1, 65536];
    if algo == Algorithm::Pipelined {
        // One past a tile, one past a shard, one past the last full round of lanes.
        for probe in [1 << 16, 3 << 20, 11 << 20] {
            let plan = ar.plan(probe, dtype).unwrap();
            let ke = plan.tile_elems as usize;
            v.push(ke * world + 1);
            v.push(ke + 1);
            v.push(ke * world * plan.blocks as usize + 1);
        }
    } else {
        v.push(max);
        v.push(max - 1);
    }
    v.retain(|&n| n >= 1 && n <= max);
    v.sort();
    v.dedup();
    v
}

fn matrix(comm: &Arc<Communicator>, s: &Arc<CudaStream>, algo: Algorithm, index: u32) {
    let rank = comm.rank() as u32;
    let world = comm.world_size() as u32;
    let checker = Verifier::new(comm.gpu()).unwrap();
    let cap = 24 << 20;
    // Room for a misaligned start (offset by one element) too.
    let bufs = Bufs {
        input: s.alloc_zeros::<u8>(cap + 64).unwrap(),
        output: s.alloc_zeros::<u8>(cap + 64).unwrap(),
    };
    // Seeds apart per algorithm, as when the matrix ran in one job.
    let mut seed = index * 100_000;
    {
        let ar = AllReduce::new(
            comm,
            AllReduceOptions {
                algorithm: Some(algo),
                ..Default::default()
            },
        )
        .unwrap();
        let call = Call {
            comm,
            ar: &ar,
            checker: &checker,
        };
        for dtype in DataType::ALL {
            for count in sizes(&ar, algo, dtype) {
                for in_place in [false, true] {
                    for misaligned in [false, true] {
                        if misaligned && count > 100_000 {
                            continue; // the scalar path is slow; small sizes cover it
                        }
                        seed += 1;
                        let off = if misaligned { dtype.size() } else { 0 };
                        let inp = ptr(s, &bufs.input, off);
                        let out = if in_place {
                            inp
                        } else {
                            ptr(s, &bufs.output, off)
                        };
                        let what = format!(
                            "{} {} x {} {} {}",
                            algo.name(),
                            count,
                            dtype.name(),
                            if in_place { "in place" } else { "out of place" },
                            if misaligned { "misaligned" } else { "aligned" }
                        );
                        // Eager.
                        // SAFETY: the ranges lie inside `bufs`, which outlive the stream work.
                        unsafe {
                            checker.fill(s, inp, count, dtype, rank, seed).unwrap();
                            ar.run_raw(s, inp, out, count, dtype).unwrap();
                            // A wait that gave up ends the kernel without a CUDA error: ask
                            // the communicator before trusting the result.
                            comm.synchronize(s).unwrap();
                            let wrong = checker
                                .count_wrong(s, out, count, dtype, world, seed)
                                .unwrap();
                            assert_eq!(wrong, 0, "rank {rank}: {what}: {wrong} wrong (eager)");
                        }
                        // 100 graph replays of [fill, allreduce]; checked every 25.
                        // SAFETY: as above.
                        unsafe { call.replayed(s, inp, out, count, dtype, seed, 100, 25, &what) };
                    }
                }
            }
        }
        comm.bootstrap().barrier().unwrap();
    }
}

/// Random sizes with random (order-sensitive) values: every rank must hold the same result, and
/// a second run of the same sequence must give the same hashes. Ranks agreeing is not being
/// right (every rank can be wrong the same way), so each (size, type) then also runs on the
/// checker's patterned values, whose sum is known, and must be exact.
fn pressure(comm: &Arc<Communicator>, s: &Arc<CudaStream>) {
    let rank = comm.rank() as u32;
    let checker = Verifier::new(comm.gpu()).unwrap();
    let ar = AllReduce::new(comm, AllReduceOptions::default()).unwrap();
    let cap = 48 << 20;
    let input = s.alloc_zeros::<u8>(cap).unwrap();
    let output = s.alloc_zeros::<u8>(cap).unwrap();
    let mut runs: Vec<Vec<u64>> = Vec::new();
    for _run in 0..2 {
        let mut rng = 0x9E37_79B9_7F4A_7C15u64;
        let mut hashes = Vec::new();
        for iter in 0..60u32 {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            let dtype = DataType::ALL[(rng % 3) as usize];
            // Log-uniform sizes from 1 element to the buffer.
            let max_log = ((cap / dtype.size()) as f64).log2();
            let count = (2f64.powf((rng >> 8) as f64 / (1u64 << 56) as f64 * max_log) as usize)
                .clamp(1, cap / dtype.size());
            let (i, o) = (ptr(s, &input, 0), ptr(s, &output, 0));
            // SAFETY: ranges inside the buffers.
            let h = unsafe {
                checker.fill_random(s, i, count, dtype, rank, iter).unwrap();
                ar.run_raw(s, i, o, count, dtype).unwrap();
                comm.synchronize(s).unwrap();
                checker.hash(s, o, count, dtype).unwrap()
            };
            let all = comm.bootstrap().all_gather(&h.to_le_bytes()).unwrap();
            for (r, b) in all.iter().enumerate() {
                assert_eq!(
                    b.as_slice(),
                    h.to_le_bytes(),
                    "iteration {iter}: {count} x {} ({}): rank {r}'s result differs from rank {rank}'s",
                    dtype.name(),
                    ar.plan(count, dtype).unwrap().algorithm.name()
                );
            }
            hashes.push(h);
            // SAFETY: as above.
            let wrong = unsafe {
                checker.fill(s, i, count, dtype, rank, iter).unwrap();
                ar.run_raw(s, i, o, count, dtype).unwrap();
                checker
                    .count_wrong(s, o, count, dtype, comm.world_size() as u32, iter)
                    .unwrap()
            };
            assert_eq!(
                wrong,
                0,
                "iteration {iter}: {count} x {} ({}): {wrong} wrong on rank {rank}",
                dtype.name(),
                ar.plan(count, dtype).unwrap().algorithm.name()
            );
        }
        runs.push(hashes);
    }
    assert_eq!(
        runs[0], runs[1],
        "the same sequence gave different results on its second run"
    );
}

/// The last rank starts every call 300 us late; on every other rank such a call may take at most
/// 300 + 60 us more than one with every rank on time, at sizes that take each algorithm. Before
/// the abort gate (core/wait.cuh) every waiting thread read the host's abort word after 33 us: 32768
/// PCIe reads in flight that took 0.1-1.4 ms to drain, so a wait that outlived 33 us ended that
/// much after its data came (on 2 x H100 this case measured 454 us at 32 KiB before the gate,
/// 354 us after, with the skew of leaving a barrier in both).
fn late_peer(comm: &Arc<Communicator>, s: &Arc<CudaStream>) {
    let ar = AllReduce::new(comm, AllReduceOptions::default()).unwrap();
    let dtype = DataType::Bf16;
    let late = std::time::Duration::from_micros(300);
    let slack = std::time::Duration::from_micros(60);
    let cap = 32 << 20;
    let bufs = Bufs {
        input: s.alloc_zeros::<u8>(cap).unwrap(),
        output: s.alloc_zeros::<u8>(cap).unwrap(),
    };
    let (i, o) = (ptr(s, &bufs.input, 0), ptr(s, &bufs.output, 0));
    for bytes in [32usize << 10, 256 << 10, 2 << 20, 32 << 20] {
        let count = bytes / dtype.size();
        let algo = ar.plan(count, dtype).unwrap().algorithm.name();
        // SAFETY: both buffers hold `cap` >= bytes.
        let op = || unsafe { ar.run_raw(s, i, o, count, dtype) };
        let got = late_peer_cost(comm, s, late, 20, &op);
        assert_late_peer_cost(comm, &format!("{bytes} B ({algo})"), late, slack, got);
    }
}

/// Three calls of one allreduce object in one CUDA graph (a small, a medium and a large size, so
/// LL, two-shot and pipelined kernels as the sizes pick them), the graph replayed 60 times. With
/// an odd number of calls per graph, each replay's first call follows the previous replay's last
/// one, whose captured call index has the same parity: the call check once picked its inbox half
/// by that parity, so a rank one call ahead overwrote the word its peer was about to check and
/// both waited until the budget (examples/allreduce hung at its first size above 1 MiB, whose
/// graphs hold 5 calls).
fn graph_of_three(comm: &Arc<Communicator>, s: &Arc<CudaStream>) {
    let rank = comm.rank() as u32;
    let world = comm.world_size() as u32;
    let checker = Verifier::new(comm.gpu()).unwrap();
    let ar = AllReduce::new(comm, AllReduceOptions::default()).unwrap();
    let dtype = DataType::Bf16;
    let counts = [4096usize, 1 << 20, 8 << 20];
    let bufs: Vec<Bufs> = counts
        .iter()
        .map(|&n| Bufs {
            input: s.alloc_zeros::<u8>(n * dtype.size()).unwrap(),
            output: s.alloc_zeros::<u8>(n * dtype.size()).unwrap(),
        })
        .collect();
    let seed = |i: usize| 7000 + i as u32;
    // The pointers before the capture: cudarc's device_ptr makes the stream wait for the
    // buffer's last use, which inside a capture is a dependency on uncaptured work.
    let ptrs: Vec<(u64, u64)> = bufs
        .iter()
        .map(|b| (ptr(s, &b.input, 0), ptr(s, &b.output, 0)))
        .collect();
    comm.synchronize(s).unwrap();
    s.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
        .unwrap();
    for (i, (&count, &(inp, out))) in counts.iter().zip(&ptrs).enumerate() {
        // SAFETY: each buffer holds `count` elements and outlives the graph's replays.
        unsafe {
            checker.fill(s, inp, count, dtype, rank, seed(i)).unwrap();
            ar.run_raw(s, inp, out, count, dtype).unwrap();
        }
    }
    let graph = s
        .end_capture(cudarc::driver::sys::CUgraphInstantiate_flags(0))
        .unwrap()
        .expect("captured graph");
    for replay in 1..=60 {
        graph.launch().unwrap();
        if replay % 20 == 0 {
            comm.synchronize(s).unwrap();
            for (i, (&count, &(_, out))) in counts.iter().zip(&ptrs).enumerate() {
                // SAFETY: as above.
                let wrong =
                    unsafe { checker.count_wrong(s, out, count, dtype, world, seed(i)) }.unwrap();
                let algo = ar.plan(count, dtype).unwrap().algorithm.name();
                assert_eq!(
                    wrong, 0,
                    "rank {rank}: {count} x bf16 ({algo}), call {i} of 3: {wrong} wrong after {replay} replays"
                );
            }
        }
    }
    comm.synchronize(s).unwrap();
}

/// With DOORBELL_HOST_CALL_CHECK=1, rank 1 calls with a different count: every rank gets an error naming
/// rank 1 instead of hanging.
fn disagree(comm: &Arc<Communicator>, s: &Arc<CudaStream>) {
    let ar = AllReduce::new(comm, AllReduceOptions::default()).unwrap();
    let buf = s.alloc_zeros::<f32>(4096).unwrap();
    let p = buf.device_ptr(s).0;
    // A matching call first.
    // SAFETY: 4096 floats.
    unsafe { ar.run_raw(s, p, p, 1000, DataType::F32) }.unwrap();
    let count = if comm.rank() == 1 { 999 } else { 1000 };
    // SAFETY: as above.
    let err = unsafe { ar.run_raw(s, p, p, count, DataType::F32) }.expect_err("ranks disagree");
    match &err {
        Error::InvalidArgument { why, .. } => {
            assert!(why.contains("rank 1 (call #1: 999 x float"), "{why}");
            assert!(!why.contains("rank 0 ("), "{why}");
        }
        other => panic!("expected InvalidArgument, got {other:?}"),
    }
    eprintln!("rank {} reported: {err}", comm.rank());
    comm.synchronize(s).unwrap();
}

fn windows(comm: &Arc<Communicator>, s: &Arc<CudaStream>) {
    let rank = comm.rank() as u32;
    let world = comm.world_size() as u32;
    let checker = Verifier::new(comm.gpu()).unwrap();
    let cap = 24 << 20;
    let win_in = comm.alloc(cap + 4096).unwrap();
    let win_out = comm.alloc(cap + 4096).unwrap();
    let plain = s.alloc_zeros::<u8>(cap).unwrap();
    let mut seed = 100u32;
    for forced in [Some(Algorithm::TwoShotDirect), None] {
        let ar = AllReduce::new(
            comm,
            AllReduceOptions {
                algorithm: forced,
                ..Default::default()
            },
        )
        .unwrap();
        ar.register_window(&win_in).unwrap();
        ar.register_window(&win_out).unwrap();
        // The staged kernels share the direct one's semaphores: a pipelined call on plain
        // buffers between direct calls checks that every call leaves them balanced.
        let staged = AllReduce::new(comm, AllReduceOptions::default()).unwrap();
        let call = Call {
            comm,
            ar: &ar,
            checker: &checker,
        };
        for dtype in DataType::ALL {
            for count in [
                1usize,
                2,
                7,
                8,
                1024,
                4097,
                65536 + 3,
                (1 << 20) + 5,
                3 << 20,
                cap / dtype.size(),
            ] {
                for in_place in [false, true] {
                    for offset in [0u64, 4096] {
                        if count * dtype.size() + offset as usize > cap + 4096 {
                            continue;
                        }
                        seed += 1;
                        let inp = win_in.device_ptr() + offset;
                        let out = if in_place {
                            inp
                        } else {
                            win_out.device_ptr() + offset
                        };
                        let plan = ar.plan_registered(count, dtype).unwrap();
                        if forced.is_some() {
                            assert_eq!(plan.algorithm, Algorithm::TwoShotDirect);
                        }
                        let what = format!(
                            "{} {count} x {} {} at +{offset}",
                            plan.algorithm.name(),
                            dtype.name(),
                            if in_place { "in place" } else { "out of place" }
                        );
                        // SAFETY: every range lies inside its window (or `plain`), which outlive
                        // the stream's work.
                        unsafe {
                            checker.fill(s, inp, count, dtype, rank, seed).unwrap();
                            ar.run_raw(s, inp, out, count, dtype).unwrap();
                            comm.synchronize(s).unwrap();
                            let wrong = checker
                                .count_wrong(s, out, count, dtype, world, seed)
                                .unwrap();
                            assert_eq!(wrong, 0, "rank {rank}: {what}: {wrong} wrong (eager)");
                            let p = plain.device_ptr(s).0;
                            let n = count.min(cap / dtype.size());
                            checker.fill(s, p, n, dtype, rank, seed).unwrap();
                            staged.run_raw(s, p, p, n, dtype).unwrap();
                            comm.synchronize(s).unwrap();
                            let wrong = checker.count_wrong(s, p, n, dtype, world, seed).unwrap();
                            assert_eq!(wrong, 0, "rank {rank}: staged after {what}: {wrong} wrong");
                        }
                        if count > (1 << 20) && dtype != DataType::Bf16 {
                            continue; // replays of the large sizes: bf16 covers them
                        }
                        // SAFETY: as above.
                        unsafe { call.replayed(s, inp, out, count, dtype, seed, 20, 10, &what) };
                    }
                }
            }
        }
        comm.bootstrap().barrier().unwrap();
    }
}

fn window_sizes_differ(comm: &Arc<Communicator>, _s: &Arc<CudaStream>) {
    let ar = AllReduce::new(comm, AllReduceOptions::default()).unwrap();
    // Multiples of the allocation granularity (2 MiB), which allocations are rounded up to.
    let bytes = if comm.rank() == 1 { 8 << 20 } else { 4 << 20 };
    let buf = comm.alloc(bytes).unwrap();
    let e = ar.register_window(&buf).unwrap_err().to_string();
    assert!(
        e.contains("rank 1 registered 8388608 bytes"),
        "rank {}: {e}",
        comm.rank()
    );
    // The table stays usable: a window every rank sizes alike registers.
    let same = comm.alloc(4 << 20).unwrap();
    ar.register_window(&same).unwrap();
}

/// One test call's fixed parts, for [`Call::replayed`].
struct Call<'a> {
    comm: &'a Communicator,
    ar: &'a AllReduce,
    checker: &'a Verifier,
}

impl Call<'_> {
    /// Captures [fill, allreduce] in a CUDA graph, replays it `replays` times and checks the
    /// result after every `every`-th replay; before each checked replay the output is overwritten
    /// with 0xff bytes (NaN in every float type), so a replay that did nothing cannot pass on an
    /// earlier replay's result (in place the graph's fill rewrites the input first). The stream
    /// is synchronized before the capture and after the last replay.
    ///
    /// # Safety
    /// `inp` and `out` hold `count` elements of `dtype` and outlive the stream's work.
    #[allow(clippy::too_many_arguments)]
    unsafe fn replayed(
        &self,
        s: &Arc<CudaStream>,
        inp: u64,
        out: u64,
        count: usize,
        dtype: DataType,
        seed: u32,
        replays: usize,
        every: usize,
        what: &str,
    ) {
        let Call { comm, ar, checker } = *self;
        let (rank, world) = (comm.rank() as u32, comm.world_size() as u32);
        comm.synchronize(s).unwrap();
        s.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
            .unwrap();
        // SAFETY: the caller's ranges.
        unsafe {
            checker.fill(s, inp, count, dtype, rank, seed).unwrap();
            ar.run_raw(s, inp, out, count, dtype).unwrap();
        }
        let graph = s
            .end_capture(cudarc::driver::sys::CUgraphInstantiate_flags(0))
            .unwrap()
            .expect("captured graph");
        for replay in 1..=replays {
            let checked = replay % every == 0;
            if checked {
                // SAFETY: `out` holds `count` elements of `dtype` (the caller's range).
                unsafe {
                    cudarc::driver::result::memset_d8_async(
                        out,
                        0xff,
                        count * dtype.size(),
                        s.cu_stream(),
                    )
                }
                .unwrap();
            }
            graph.launch().unwrap();
            if checked {
                // SAFETY: as above.
                let wrong =
                    unsafe { checker.count_wrong(s, out, count, dtype, world, seed) }.unwrap();
                assert_eq!(
                    wrong, 0,
                    "rank {rank}: {what}: {wrong} wrong after {replay} replays"
                );
            }
        }
        comm.synchronize(s).unwrap();
    }
}
