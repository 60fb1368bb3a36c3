//! All-to-all on GPUs (`#[ignore = "needs GPU"]`; run with `--ignored`), at every rank count:
//! equal blocks of awkward sizes (1 byte, odd, one past a tile, several ring wraps with small
//! tiles and a shallow ring; the tiny ones through the LL16 kernel, also as 100 graph replays),
//! `alltoallv` with uneven, zero and misaligned blocks (a rank that sends nothing), 100 replays of
//! a captured graph whose device counts change between replays, and pairs that straddle the LL
//! limit in every combination (eager and replayed).
//! Every byte names its source, its destination and the round, so a misrouted block shows.

mod common;

use common::{assert_late_peer_cost, late_peer_cost, rank_counts, rank_main, run_case};
use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
use doorbell::collectives::alltoall::{AllToAll, AllToAllOptions, Counts};
use doorbell::collectives::verify::Verifier;
use doorbell::communicator::Communicator;
use std::sync::Arc;

#[test]
#[ignore = "needs GPU"]
fn gpu_rank() {
    rank_main(|case, comm, stream| match case {
        "equal" => equal(comm, stream),
        "uneven" => uneven(comm, stream),
        "mixed" => mixed(comm, stream),
        "late_peer" => late_peer(comm, stream),
        other => panic!("unknown case {other}"),
    });
}

#[test]
#[ignore = "needs GPU"]
fn equal_blocks_of_awkward_sizes() {
    for n in rank_counts() {
        run_case("equal", n, &[]);
    }
}

#[test]
#[ignore = "needs GPU"]
fn uneven_zero_and_misaligned_blocks_and_graph_replays() {
    for n in rank_counts() {
        run_case("uneven", n, &[]);
    }
}

/// alltoallv whose pairs straddle the LL limit in every combination: the issue-26 case first
/// (rank 0's own block 1 MiB, every other block 1 KiB: ranks once picked different kernels from
/// their own largest block and refused the call), then rounds in which each pair's two
/// directions are empty, LL-sized or tile-sized in all nine combinations, eager and as graph
/// replays whose device counts move pairs between the two protocols.
#[test]
#[ignore = "needs GPU"]
fn alltoallv_mixing_packet_and_tile_pairs() {
    for n in rank_counts() {
        run_case("mixed", n, &[]);
    }
}

const TILE: usize = 4 << 10;

/// A rank that starts late costs its peers its lateness and no more (needs a GPU per rank).
#[test]
#[ignore = "needs GPU"]
fn a_late_peer_costs_only_its_lateness() {
    for n in rank_counts() {
        run_case("late_peer", n, &[]);
    }
}

/// As tests/allreduce's case: the last rank starts every call 300 us late, at a size that takes
/// the LL16 kernel and one that takes the tile kernel; the others' calls may take at most 300 +
/// 60 us more than with every rank on time (before the abort gate: 422 and 517 us).
fn late_peer(comm: &Arc<Communicator>, s: &Arc<CudaStream>) {
    let a2a = AllToAll::new(comm, AllToAllOptions::default()).unwrap();
    let world = comm.world_size();
    let late = std::time::Duration::from_micros(300);
    let slack = std::time::Duration::from_micros(60);
    let cap = 16usize << 20;
    let input = s.alloc_zeros::<u8>(cap).unwrap();
    let output = s.alloc_zeros::<u8>(cap).unwrap();
    let (i, o) = (input.device_ptr(s).0, output.device_ptr(s).0);
    for block in [32usize << 10, cap / world] {
        // SAFETY: both buffers hold world x block <= cap bytes.
        let op = || unsafe { a2a.run_raw(s, i, o, block) };
        let got = late_peer_cost(comm, s, late, 20, &op);
        assert_late_peer_cost(comm, &format!("blocks of {block} B"), late, slack, got);
    }
}

fn small_rings(comm: &Arc<Communicator>) -> AllToAll {
    AllToAll::new(
        comm,
        AllToAllOptions {
            lanes: Some(2),
            tile_bytes: TILE,
            depth: 2,
            ..Default::default()
        },
    )
    .expect("all-to-all")
}

/// Fills my input per `c` (bytes), runs `op`, checks every received block; panics naming the
/// first wrong one.
#[allow(clippy::too_many_arguments)]
fn exchange(
    comm: &Arc<Communicator>,
    s: &Arc<CudaStream>,
    checker: &Verifier,
    input: u64,
    output: u64,
    c: &Counts,
    round: u32,
    what: &str,
    op: &mut dyn FnMut(),
) {
    let me = comm.rank() as u32;
    for p in 0..comm.world_size() {
        // SAFETY: the block lies inside the input (the callers size it so).
        unsafe {
            checker
                .fill_route(
                    s,
                    input + c.send_offsets[p] as u64,
                    c.send_counts[p],
                    me,
                    p as u32,
                    round,
                )
                .unwrap()
        };
    }
    op();
    comm.synchronize(s).unwrap();
    for p in 0..comm.world_size() {
        // SAFETY: as above.
        let wrong = unsafe {
            checker
                .count_wrong_route(
                    s,
                    output + c.recv_offsets[p] as u64,
                    c.recv_counts[p],
                    p as u32,
                    me,
                    round,
                )
                .unwrap()
        };
        assert_eq!(
            wrong, 0,
            "rank {me}: block from rank {p}, {what}, round {round}"
        );
    }
}

fn equal(comm: &Arc<Communicator>, s: &Arc<CudaStream>) {
    let world = comm.world_size();
    let checker = Verifier::new(comm.gpu()).unwrap();
    let max_blk = 5 * TILE + 3;
    let input: CudaSlice<u8> = s.alloc_zeros(world * max_blk).unwrap();
    let output: CudaSlice<u8> = s.alloc_zeros(world * max_blk).unwrap();
    let (i, o) = (input.device_ptr(s).0, output.device_ptr(s).0);
    for (a2a, name) in [
        (small_rings(comm), "4 KiB tiles, 2 lanes, depth 2"),
        (
            AllToAll::new(comm, AllToAllOptions::default()).unwrap(),
            "defaults",
        ),
    ] {
        let mut round = 0;
        for blk in [1, 7, TILE - 1, TILE + 1, 5 * TILE + 3] {
            round += 1;
            let c = Counts::packed(vec![blk; world], vec![blk; world]);
            exchange(
                comm,
                s,
                &checker,
                i,
                o,
                &c,
                round,
                &format!("{blk}-byte blocks, {name}"),
                &mut || {
                    // SAFETY: both buffers hold world * blk bytes.
                    unsafe { a2a.run_raw(s, i, o, blk) }.unwrap()
                },
            );
        }
    }
    // Tiny blocks take the LL16 kernel; 100 replays of a captured call, new data each time.
    let a2a = AllToAll::new(comm, AllToAllOptions::default()).unwrap();
    let blk = 7;
    comm.synchronize(s).unwrap();
    s.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
        .unwrap();
    // SAFETY: both buffers hold world * blk bytes.
    unsafe { a2a.run_raw(s, i, o, blk) }.unwrap();
    let graph = s
        .end_capture(CUgraphInstantiate_flags(0))
        .unwrap()
        .expect("a graph");
    for replay in 0..100u32 {
        let c = Counts::packed(vec![blk; world], vec![blk; world]);
        exchange(
            comm,
            s,
            &checker,
            i,
            o,
            &c,
            1000 + replay,
            "LL graph replay",
            &mut || graph.launch().unwrap(),
        );
    }
}

/// Writes `c` (bytes) into the device array a captured `run_v_raw` reads, stream-ordered.
fn upload_counts(s: &Arc<CudaStream>, dev: &CudaSlice<u64>, c: &Counts) {
    let v: Vec<u64> = [
        &c.send_counts,
        &c.send_offsets,
        &c.recv_counts,
        &c.recv_offsets,
    ]
    .iter()
    .flat_map(|x| x.iter().map(|&n| n as u64))
    .collect();
    assert_eq!(v.len(), dev.len(), "4 x world counts");
    // SAFETY: `dev` holds v.len() u64; pageable copies are staged before returning.
    unsafe { cudarc::driver::result::memcpy_htod_async(dev.device_ptr(s).0, &v, s.cu_stream()) }
        .unwrap();
}

/// Rank r sends (r + 2p + 1) * 1000 + p bytes to p, except that rank 1 sends nothing; blocks
/// start at odd offsets with gaps.
fn uneven_counts(world: usize, me: usize, round: usize) -> Counts {
    let bytes = |from: usize, to: usize| {
        if from == 1 {
            0
        } else {
            (from + 2 * to + 1 + round % 3) * 1000 + to
        }
    };
    let layout = |sizes: Vec<usize>| -> (Vec<usize>, Vec<usize>) {
        let mut at = 3;
        let offsets = sizes
            .iter()
            .map(|&n| {
                let o = at;
                at += n + 5;
                o
            })
            .collect();
        (sizes, offsets)
    };
    let (send_counts, send_offsets) = layout((0..world).map(|p| bytes(me, p)).collect());
    let (recv_counts, recv_offsets) = layout((0..world).map(|p| bytes(p, me)).collect());
    Counts {
        send_counts,
        send_offsets,
        recv_counts,
        recv_offsets,
    }
}

fn uneven(comm: &Arc<Communicator>, s: &Arc<CudaStream>) {
    let (me, world) = (comm.rank(), comm.world_size());
    let checker = Verifier::new(comm.gpu()).unwrap();
    let cap = 64 * 1000 * world;
    let input: CudaSlice<u8> = s.alloc_zeros(cap).unwrap();
    let mut output: CudaSlice<u8> = s.alloc_zeros(cap).unwrap();
    let (i, o) = (input.device_ptr(s).0, output.device_ptr(s).0);
    let a2a = small_rings(comm);
    for round in 0..3 {
        let c = uneven_counts(world, me, round);
        exchange(
            comm,
            s,
            &checker,
            i,
            o,
            &c,
            round as u32 + 1,
            "alltoallv",
            &mut || a2a.run_v(s, &input, &mut output, &c).unwrap(),
        );
    }
    // A captured graph reading its counts from device memory; the counts change between replays.
    let counts_dev: CudaSlice<u64> = s.alloc_zeros(4 * world).unwrap();
    let cptr = counts_dev.device_ptr(s).0;
    comm.synchronize(s).unwrap();
    s.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
        .unwrap();
    // SAFETY: every range the counts name lies inside the buffers (checked by uneven_counts'
    // sizes against `cap`).
    unsafe { a2a.run_v_raw(s, i, cap, o, cap, cptr) }.unwrap();
    let graph = s
        .end_capture(CUgraphInstantiate_flags(0))
        .unwrap()
        .expect("a graph");
    for replay in 0..100u32 {
        let c = uneven_counts(world, me, replay as usize);
        upload_counts(s, &counts_dev, &c);
        exchange(
            comm,
            s,
            &checker,
            i,
            o,
            &c,
            100 + replay,
            "graph replay",
            &mut || graph.launch().unwrap(),
        );
    }
}

/// Bytes `from` sends `to` in round `round` of the mixed case (see
/// `alltoallv_mixing_packet_and_tile_pairs`); `ll` is the LL limit.
fn mixed_bytes(from: usize, to: usize, round: usize, ll: usize) -> usize {
    if round == 0 {
        return if from == 0 && to == 0 { 1 << 20 } else { 1024 };
    }
    // Over rounds 1..=9 the classes of (0, 1) and (1, 0) meet in all nine combinations.
    match (3 * from + 5 * to + round + (round / 3) * from) % 3 {
        0 => 0,
        1 => 1000 + 8 * from + to,
        _ => ll + 4096 + 16 * from + to + 1,
    }
}

fn mixed(comm: &Arc<Communicator>, s: &Arc<CudaStream>) {
    let (me, world) = (comm.rank(), comm.world_size());
    let checker = Verifier::new(comm.gpu()).unwrap();
    let ll = AllToAllOptions::default_ll_max(world);
    let cap = world * ((1 << 20).max(ll + 8192) + 8);
    let input: CudaSlice<u8> = s.alloc_zeros(cap).unwrap();
    let mut output: CudaSlice<u8> = s.alloc_zeros(cap).unwrap();
    let (i, o) = (input.device_ptr(s).0, output.device_ptr(s).0);
    let a2a = AllToAll::new(comm, AllToAllOptions::default()).unwrap();
    let counts = |round: usize| {
        Counts::packed(
            (0..world).map(|p| mixed_bytes(me, p, round, ll)).collect(),
            (0..world).map(|p| mixed_bytes(p, me, round, ll)).collect(),
        )
    };
    for round in 0..10 {
        let c = counts(round);
        exchange(
            comm,
            s,
            &checker,
            i,
            o,
            &c,
            round as u32 + 1,
            "mixed alltoallv",
            &mut || a2a.run_v(s, &input, &mut output, &c).unwrap(),
        );
    }
    let counts_dev: CudaSlice<u64> = s.alloc_zeros(4 * world).unwrap();
    let cptr = counts_dev.device_ptr(s).0;
    comm.synchronize(s).unwrap();
    s.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
        .unwrap();
    // SAFETY: buffers of `cap` bytes; the kernel checks every range against them.
    unsafe { a2a.run_v_raw(s, i, cap, o, cap, cptr) }.unwrap();
    let graph = s
        .end_capture(CUgraphInstantiate_flags(0))
        .unwrap()
        .expect("a graph");
    for replay in 0..30usize {
        let c = counts(replay % 10);
        upload_counts(s, &counts_dev, &c);
        exchange(
            comm,
            s,
            &checker,
            i,
            o,
            &c,
            200 + replay as u32,
            "mixed alltoallv graph replay",
            &mut || graph.launch().unwrap(),
        );
    }
}
