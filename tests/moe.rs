//! MoE dispatch/combine on GPUs (`#[ignore = "needs GPU"]`; run with `--ignored`), in the style of
//! DeepEP's tests: every rank derives every rank's routing from (rank, round), so the expected
//! layout is computed on the CPU and compared exactly; payloads are derived from (source rank,
//! token) so every received row names its origin; the combined output is compared bit for bit
//! with the CPU's (same bf16 roundings, same f32 summation order). Rounds cover uneven token
//! counts, a rank with no tokens, -1 entries, every token to one expert, expert outputs written
//! straight into the combine buffer, FP8 rows with their scales, then 100 replays of a captured
//! graph with new routing each time.

mod common;

use common::{rank_counts, rank_main, run_case};
use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, PushKernelArg};
use doorbell::collectives::moe::{reference_layout, MoeConfig, MoeDispatcher};
use doorbell::communicator::Communicator;
use doorbell::transport::ib::emulator::Traffic;
use half::bf16;
use std::sync::Arc;

#[test]
#[ignore = "needs GPU"]
fn gpu_rank() {
    rank_main(|case, comm, stream| match case {
        "exchange" => exchange(comm, stream),
        "low_latency" => low_latency(comm, stream),
        other => panic!("unknown case {other}"),
    });
}

#[test]
#[ignore = "needs GPU"]
fn dispatch_layout_payloads_and_combine_match_the_cpu() {
    for n in rank_counts() {
        run_case("exchange", n, &[]);
    }
}

const HIDDEN: usize = 256;
const TOPK: usize = 4;
const MAX_TOKENS: usize = 300;

struct Routing {
    tokens: usize,
    idx: Vec<i32>,
    weights: Vec<f32>,
}

fn check(what: &str, r: cudarc::driver::sys::CUresult) {
    assert_eq!(r, cudarc::driver::sys::CUresult::CUDA_SUCCESS, "{what}");
}

fn hash(a: u64) -> u64 {
    let mut x = a.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    x ^= x >> 29;
    x.wrapping_mul(0xBF58_476D_1CE4_E5B9) ^ (x >> 32)
}

/// Rank `r`'s routing in `round`: uneven token counts, rank 1 with none in round 1, -1 entries,
/// every token to expert 3 in round 2, distinct random experts otherwise.
fn routing(r: usize, round: u64, experts: usize) -> Routing {
    // Across emulated nodes every row is a work request the emulated NIC copies with the
    // driver, between time slices of the ranks sharing the GPU: fewer tokens keep it quick.
    let cap = if std::env::var("DOORBELL_SEPARATE_NODES").as_deref() == Ok("1") {
        48
    } else {
        MAX_TOKENS
    };
    let tokens = if round == 1 && r == 1 {
        0
    } else {
        ((100 + 37 * r + 11 * round as usize) % (MAX_TOKENS + 1)).min(cap)
    };
    routing_of(r, round, experts, tokens)
}

/// `tokens` tokens of rank `r`'s routing in `round` (see [`routing`]).
fn routing_of(r: usize, round: u64, experts: usize, tokens: usize) -> Routing {
    let mut idx = Vec::with_capacity(tokens * TOPK);
    let mut weights = Vec::with_capacity(tokens * TOPK);
    for t in 0..tokens {
        let mut picked: Vec<i32> = Vec::new();
        for k in 0..TOPK {
            let h = hash((r as u64) << 40 | round << 20 | (t * TOPK + k) as u64);
            let e = if round == 2 {
                if k == 0 {
                    3
                } else {
                    -1
                }
            } else if h % 5 == 0 {
                -1
            } else {
                let mut e = (h >> 8) as usize % experts;
                while picked.contains(&(e as i32)) {
                    e = (e + 1) % experts;
                }
                e as i32
            };
            if e >= 0 {
                picked.push(e);
            }
            idx.push(e);
            weights.push([0.5f32, 0.25, 0.125, 1.0][(h >> 3) as usize % 4]);
        }
    }
    Routing {
        tokens,
        idx,
        weights,
    }
}

/// Copies `v` to device address `ptr` on `s` (every destination in these tests is sized for the
/// largest upload), after the stream's earlier work: a copy from pageable memory takes the
/// driver's staging buffer, which the emulated NIC's relaxed delivery needs too, so it must not
/// wait for kernels that wait for that NIC.
fn upload_bytes(s: &CudaStream, ptr: u64, v: &[u8]) {
    s.synchronize().unwrap();
    if !v.is_empty() {
        // SAFETY: the destination holds at least `v.len()` bytes (see above).
        unsafe { cudarc::driver::result::memcpy_htod_async(ptr, v, s.cu_stream()) }.unwrap();
    }
}

/// Copies `n` bytes at device address `ptr` back, after the stream's earlier work.
fn download_bytes(comm: &Communicator, s: &CudaStream, ptr: u64, n: usize) -> Vec<u8> {
    // Synchronize first: a failed wait is then reported with its fields, and the pageable copy
    // below never holds the driver's staging buffer while kernels wait for the emulated NIC
    // (see upload_bytes).
    comm.synchronize(s).unwrap();
    let mut v = vec![0u8; n];
    if n > 0 {
        // SAFETY: `ptr` holds at least n bytes (results are sized for the worst case).
        unsafe { cudarc::driver::result::memcpy_dtoh_async(&mut v, ptr, s.cu_stream()) }.unwrap();
    }
    comm.synchronize(s).unwrap();
    v
}

/// Decodes little-endian values of `N` bytes.
fn words<T, const N: usize>(bytes: &[u8], f: impl Fn(&[u8; N]) -> T) -> Vec<T> {
    bytes
        .chunks_exact(N)
        .map(|c| f(c.try_into().expect("N bytes")))
        .collect()
}

fn x_value(r: usize, t: usize, h: usize) -> bf16 {
    bf16::from_f32(((r * 31 + t * 7 + h) % 64) as f32 - 32.0)
}

/// What rank `r`'s experts make of token `t`'s row: x times the sum of w_k (local id + 1) over
/// the token's experts on `r`, rounded to bf16.
fn expert_factor(ids: &[i32], w: &[f32], r: usize, per_rank: usize) -> f32 {
    ids.iter()
        .zip(w)
        .filter(|(&e, _)| e >= 0 && e as usize / per_rank == r)
        .map(|(&e, &w)| w * ((e as usize % per_rank) as f32 + 1.0))
        .sum()
}

fn exchange(comm: &Arc<Communicator>, s: &Arc<CudaStream>) {
    let (me, world) = (comm.rank(), comm.world_size());
    let experts = 8 * world;
    let per_rank = experts / world;
    let moe = MoeDispatcher::new(
        comm,
        MoeConfig {
            hidden: HIDDEN,
            topk: TOPK,
            num_experts: experts,
            max_tokens: MAX_TOKENS,
            blocks: Some(16),
            // Across nodes: a receive ring of one chunk of 32 tokens per source node, so every
            // further chunk waits for its credit (receiver-driven admission under test).
            net_chunks: Some(1),
        },
    )
    .unwrap();
    let res = moe.results();
    // Ranks as nodes of `node_size` (DOORBELL_SEPARATE_NODES): the node-spanning path, whose rows
    // arrive grouped by forwarding rank and whose combine sums inside each node first.
    let env = |k: &str| std::env::var(k).unwrap_or_default();
    let node_size: usize = if env("DOORBELL_SEPARATE_NODES") == "1" {
        env("DOORBELL_NODE_SIZE").parse().unwrap_or(1)
    } else {
        world
    };
    let spans = node_size < world;
    assert_eq!(
        moe.spans_nodes(),
        spans,
        "rank {me}: the node-spanning path"
    );
    let x: CudaSlice<bf16> = s.alloc_zeros(MAX_TOKENS * HIDDEN).unwrap();
    let idx: CudaSlice<i32> = s.alloc_zeros(MAX_TOKENS * TOPK).unwrap();
    let w: CudaSlice<f32> = s.alloc_zeros(MAX_TOKENS * TOPK).unwrap();
    let y: CudaSlice<bf16> = s.alloc_zeros(world * MAX_TOKENS * HIDDEN).unwrap();
    let out: CudaSlice<bf16> = s.alloc_zeros(MAX_TOKENS * HIDDEN).unwrap();
    let (xp, ip, wp, yp, op) = (
        x.device_ptr(s).0,
        idx.device_ptr(s).0,
        w.device_ptr(s).0,
        y.device_ptr(s).0,
        out.device_ptr(s).0,
    );
    let htod = |ptr: u64, v: &[u8]| upload_bytes(s, ptr, v);
    let dtoh = |ptr: u64, n: usize| download_bytes(comm, s, ptr, n);
    let upload = |round: u64| -> Routing {
        let mine = routing(me, round, experts);
        let xs: Vec<u16> = (0..mine.tokens * HIDDEN)
            .map(|i| x_value(me, i / HIDDEN, i % HIDDEN).to_bits())
            .collect();
        htod(xp, bytemuck::cast_slice(&xs));
        htod(ip, bytemuck::cast_slice(&mine.idx));
        htod(wp, bytemuck::cast_slice(&mine.weights));
        mine
    };
    // Checks the dispatch results of `round`, then computes y on the host and uploads it.
    let check_dispatch = |round: u64, what: &str, y_at: u64| {
        let all: Vec<Routing> = (0..world).map(|r| routing(r, round, experts)).collect();
        let n = u32::from_le_bytes(dtoh(res.num_recv, 4).try_into().unwrap()) as usize;
        let expected: Vec<(usize, usize)> = (0..world)
            .flat_map(|src| {
                reference_layout(&all[src].idx, TOPK, per_rank, world)[me]
                    .iter()
                    .map(move |&t| (src, t))
                    .collect::<Vec<_>>()
            })
            .collect();
        assert_eq!(n, expected.len(), "rank {me}, {what}: rows received");
        let i32s = |b: &[u8; 4]| i32::from_le_bytes(*b);
        let rx: Vec<bf16> = words(&dtoh(res.recv_x, n * HIDDEN * 2), |b: &[u8; 2]| {
            bf16::from_bits(u16::from_le_bytes(*b))
        });
        let ri: Vec<i32> = words(&dtoh(res.recv_idx, n * TOPK * 4), i32s);
        let rw: Vec<f32> = words(&dtoh(res.recv_weights, n * TOPK * 4), |b: &[u8; 4]| {
            f32::from_le_bytes(*b)
        });
        let rs: Vec<i32> = words(&dtoh(res.recv_src, n * 8), i32s);
        let counts: Vec<u32> = words(&dtoh(res.expert_counts, per_rank * 4), |b: &[u8; 4]| {
            u32::from_le_bytes(*b)
        });
        let mut want_counts = vec![0u32; per_rank];
        let mut ys = vec![0u16; n * HIDDEN];
        // The rows' origins: in source-rank order over NVLink; any order (each once) across nodes.
        let origins: Vec<(usize, usize)> = (0..n)
            .map(|j| (rs[2 * j] as usize, rs[2 * j + 1] as usize))
            .collect();
        if spans {
            let (mut got, mut want) = (origins.clone(), expected.clone());
            got.sort_unstable();
            want.sort_unstable();
            assert_eq!(got, want, "rank {me}, {what}: rows' origins");
            // Each token crossed the network once to this node, from its rail peer.
            let (rows_at, nodes) = moe.network_rows().expect("node-spanning");
            let net: Vec<u32> = words(&dtoh(rows_at, nodes * 4), |b: &[u8; 4]| {
                u32::from_le_bytes(*b)
            });
            let my_node = me / node_size;
            for (m, &got) in net.iter().enumerate() {
                let peer = m * node_size + me % node_size;
                let want = if m == my_node {
                    0
                } else {
                    all[peer]
                        .idx
                        .chunks(TOPK)
                        .filter(|ids| {
                            ids.iter()
                                .any(|&e| e >= 0 && e as usize / per_rank / node_size == my_node)
                        })
                        .count() as u32
                };
                assert_eq!(
                    got, want,
                    "rank {me}, {what}: rows from node {m} over the network"
                );
            }
        } else {
            assert_eq!(origins, expected, "rank {me}, {what}: rows' origins");
        }
        for (j, &(src, t)) in origins.iter().enumerate() {
            for h in 0..HIDDEN {
                assert_eq!(
                    rx[j * HIDDEN + h],
                    x_value(src, t, h),
                    "rank {me}, {what}: row {j} ({src}, {t}) value {h}"
                );
            }
            let ids = &all[src].idx[t * TOPK..(t + 1) * TOPK];
            let ws = &all[src].weights[t * TOPK..(t + 1) * TOPK];
            for k in 0..TOPK {
                let e = ids[k];
                let local = if e >= 0 && e as usize / per_rank == me {
                    e % per_rank as i32
                } else {
                    -1
                };
                assert_eq!(
                    ri[j * TOPK + k],
                    local,
                    "rank {me}, {what}: row {j} expert {k}"
                );
                assert_eq!(
                    rw[j * TOPK + k],
                    ws[k],
                    "rank {me}, {what}: row {j} weight {k}"
                );
                if local >= 0 {
                    want_counts[local as usize] += 1;
                }
            }
            let f = expert_factor(ids, ws, me, per_rank);
            for h in 0..HIDDEN {
                ys[j * HIDDEN + h] = bf16::from_f32(rx[j * HIDDEN + h].to_f32() * f).to_bits();
            }
        }
        assert_eq!(
            counts, want_counts,
            "rank {me}, {what}: rows per local expert"
        );
        htod(y_at, bytemuck::cast_slice(&ys));
    };
    // The network leg as this rank's emulated NIC counted it (Ib variants): each of this rank's
    // tokens crosses to each other node holding one of its experts exactly once (a WRITE of
    // `used` bytes), plus a 16-byte chunk descriptor per chunk of 32 (at least one per node) and,
    // unless DOORBELL_CALL_CHECK=0, the call check's 8-byte word to the node's rail peer.
    let traffic = || comm.emulated_nic_traffic();
    let call_check = std::env::var("DOORBELL_CALL_CHECK").map_or(true, |v| v != "0");
    let check_network = |round: u64, before: Option<Traffic>, used: u64, what: &str| {
        // One node (all ranks on it, e.g. 2 ranks as a node of two): no network leg.
        let (Some(b), Some(a), true) = (before, traffic(), spans) else {
            return;
        };
        let mine = routing(me, round, experts);
        let (mut rows, mut chunks, mut words) = (0u64, 0u64, 0u64);
        for n in (0..world / node_size).filter(|&n| n != me / node_size) {
            // The call check's word to node n's rail peer: one 8-byte WRITE ahead of the chunks.
            words += u64::from(call_check);
            let m = mine
                .idx
                .chunks(TOPK)
                .filter(|ids| {
                    ids.iter()
                        .any(|&e| e >= 0 && e as usize / per_rank / node_size == n)
                })
                .count() as u64;
            rows += m;
            chunks += m.div_ceil(32).max(1);
        }
        assert_eq!(
            (a.writes - b.writes, a.write_bytes - b.write_bytes),
            (rows + chunks + words, rows * used + chunks * 16 + words * 8),
            "rank {me}, {what}: WRITEs and bytes the NIC executed ({rows} rows, {chunks} chunks, \
             {words} call words)"
        );
    };
    // Message bytes on the wire: the header (token, format, epoch, top-k ids and weights: 48
    // bytes at top-4), then the row (and the FP8 scales), in 16-byte units.
    let (used_bf16, used_fp8) = (
        48 + 2 * HIDDEN as u64,
        (48 + HIDDEN as u64 + 8).next_multiple_of(16),
    );
    let check_combine = |round: u64, what: &str| {
        let mine = routing(me, round, experts);
        let got: Vec<bf16> = words(&dtoh(op, mine.tokens * HIDDEN * 2), |b: &[u8; 2]| {
            bf16::from_bits(u16::from_le_bytes([b[0], b[1]]))
        });
        for t in 0..mine.tokens {
            let ids = &mine.idx[t * TOPK..(t + 1) * TOPK];
            let ws = &mine.weights[t * TOPK..(t + 1) * TOPK];
            for h in 0..HIDDEN {
                // Ranks in rank order inside each node (f32, rounded to bf16 per node), then the
                // nodes in node order; one node: the plain rank-order sum.
                let mut acc = 0f32;
                for node in 0..world.div_ceil(node_size) {
                    let mut sum = 0f32;
                    let mut any = false;
                    for r in node * node_size..((node + 1) * node_size).min(world) {
                        if ids.iter().any(|&e| e >= 0 && e as usize / per_rank == r) {
                            any = true;
                            sum += bf16::from_f32(
                                x_value(me, t, h).to_f32() * expert_factor(ids, ws, r, per_rank),
                            )
                            .to_f32();
                        }
                    }
                    if any {
                        acc += if spans {
                            bf16::from_f32(sum).to_f32()
                        } else {
                            sum
                        };
                    }
                }
                assert_eq!(
                    got[t * HIDDEN + h],
                    bf16::from_f32(acc),
                    "rank {me}, {what}: token {t} value {h}"
                );
            }
        }
    };
    for round in 0..4u64 {
        let mine = upload(round);
        let before = traffic();
        // SAFETY: the inputs hold `tokens` rows; y and out are sized for the worst case.
        unsafe { moe.dispatch(s, xp, ip, wp, mine.tokens) }.unwrap();
        // Round 3 writes the expert outputs straight into the combine buffer (no copy-in).
        let y_at = if round == 3 { moe.combine_buffer() } else { yp };
        check_dispatch(round, &format!("round {round}"), y_at);
        check_network(round, before, used_bf16, &format!("round {round}"));
        unsafe { moe.combine(s, y_at, op) }.unwrap();
        check_combine(round, &format!("round {round}"));
        if round == 1 {
            // A second combine of the same dispatch (its own handshake: a peer may still read
            // this rank's combine buffer), into a cleared output.
            // SAFETY: `op` is `out`'s MAX_TOKENS * HIDDEN bf16.
            check("cuMemsetD16Async", unsafe {
                cudarc::driver::sys::cuMemsetD16Async(op, 0, MAX_TOKENS * HIDDEN, s.cu_stream())
            });
            unsafe { moe.combine(s, y_at, op) }.unwrap();
            check_combine(round, "round 1, combined again");
        }
    }
    // FP8 dispatch: e4m3 bytes and one scale per 128 values, derived from (source, token), must
    // arrive byte for byte in the same layout; then a bf16 combine on top of it.
    let scales_dev: CudaSlice<f32> = s.alloc_zeros(MAX_TOKENS * HIDDEN / 128).unwrap();
    let scp = scales_dev.device_ptr(s).0;
    let per_row = HIDDEN / 128;
    let fp8_byte = |r: usize, t: usize, h: usize| ((r * 31 + t * 7 + h * 3) & 0xff) as u8;
    let scale = |r: usize, t: usize, q: usize| (r * 1000 + t * 2 + q) as f32;
    for round in [5u64, 6] {
        let mine = upload(round);
        let xb: Vec<u8> = (0..mine.tokens * HIDDEN)
            .map(|i| fp8_byte(me, i / HIDDEN, i % HIDDEN))
            .collect();
        let sc: Vec<f32> = (0..mine.tokens * per_row)
            .map(|i| scale(me, i / per_row, i % per_row))
            .collect();
        htod(xp, &xb);
        htod(scp, bytemuck::cast_slice(&sc));
        let before = traffic();
        // SAFETY: the inputs hold `tokens` rows.
        unsafe { moe.dispatch_fp8(s, xp, scp, ip, wp, mine.tokens) }.unwrap();
        let all: Vec<Routing> = (0..world).map(|r| routing(r, round, experts)).collect();
        let expected: Vec<(usize, usize)> = (0..world)
            .flat_map(|src| {
                reference_layout(&all[src].idx, TOPK, per_rank, world)[me]
                    .iter()
                    .map(move |&t| (src, t))
                    .collect::<Vec<_>>()
            })
            .collect();
        let n = u32::from_le_bytes(dtoh(res.num_recv, 4).try_into().unwrap()) as usize;
        assert_eq!(n, expected.len(), "rank {me}, FP8 round {round}: rows");
        let rx = dtoh(res.recv_x, n * HIDDEN);
        let rsc: Vec<f32> = words(&dtoh(res.recv_scales, n * per_row * 4), |b: &[u8; 4]| {
            f32::from_le_bytes(*b)
        });
        let rs: Vec<i32> = words(&dtoh(res.recv_src, n * 8), |b: &[u8; 4]| {
            i32::from_le_bytes(*b)
        });
        let mut origins: Vec<(usize, usize)> = (0..n)
            .map(|j| (rs[2 * j] as usize, rs[2 * j + 1] as usize))
            .collect();
        if !spans {
            assert_eq!(
                origins, expected,
                "rank {me}, FP8 round {round}: rows' origins"
            );
        }
        for (j, &(src, t)) in origins.iter().enumerate() {
            for h in 0..HIDDEN {
                assert_eq!(
                    rx[j * HIDDEN + h],
                    fp8_byte(src, t, h),
                    "rank {me}, FP8 row {j} byte {h}"
                );
            }
            for q in 0..per_row {
                assert_eq!(
                    rsc[j * per_row + q],
                    scale(src, t, q),
                    "rank {me}, FP8 row {j} scale {q}"
                );
            }
        }
        origins.sort_unstable();
        let mut want = expected.clone();
        want.sort_unstable();
        assert_eq!(origins, want, "rank {me}, FP8 round {round}: rows' origins");
        check_network(round, before, used_fp8, &format!("FP8 round {round}"));
    }
    // Graph: dispatch captured once (fixed token count), replayed with new routing each time;
    // combine eagerly after each replay.
    comm.synchronize(s).unwrap();
    s.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
        .unwrap();
    // SAFETY: as above.
    unsafe { moe.dispatch(s, xp, ip, wp, routing(me, 10, experts).tokens) }.unwrap();
    let graph = s
        .end_capture(CUgraphInstantiate_flags(0))
        .unwrap()
        .expect("a graph");
    for replay in 0..if spans { 10 } else { 100u64 } {
        // Same token count as captured (round 10's), new routing: rounds 10 + 301 k keep it.
        let round = 10 + (replay + 1) * (MAX_TOKENS as u64 + 1);
        let mine = upload(round);
        assert_eq!(mine.tokens, routing(me, 10, experts).tokens);
        let before = traffic();
        graph.launch().unwrap();
        check_dispatch(round, &format!("graph replay {replay}"), yp);
        check_network(round, before, used_bf16, &format!("graph replay {replay}"));
        // SAFETY: as above.
        unsafe { moe.combine(s, yp, op) }.unwrap();
        check_combine(round, &format!("graph replay {replay}"));
    }
}

#[test]
#[ignore = "needs GPU"]
fn low_latency_layout_payloads_combine_and_graph_replays() {
    for n in rank_counts() {
        run_case("low_latency", n, &[]);
    }
}

/// Which variants of the across-nodes tests run: all by default; `DOORBELL_TEST_VARIANTS=IBGDA,proxy`
/// keeps those whose names contain one of the words. (Ethernet between nodes of two was left out
/// until the transport threads stopped freeing pinned memory while kernels waited on the proxy:
/// src/transport/ethernet.rs.)
fn keep_variant() -> impl Fn(&str) -> bool {
    let only = std::env::var("DOORBELL_TEST_VARIANTS").unwrap_or_default();
    move |name: &str| only.is_empty() || only.split(',').any(|w| name.contains(w.trim()))
}

/// The node-spanning high-throughput path (DeepEP's hierarchical scheme) over every posting mode,
/// relaxed delivery on, ranks as separate nodes and as nodes of two.
#[test]
#[ignore = "needs GPU"]
fn high_throughput_across_nodes_in_every_posting_mode() {
    let sep = ("DOORBELL_SEPARATE_NODES", "1");
    let emu = ("DOORBELL_IB_EMULATE", "1");
    let relaxed = ("DOORBELL_IB_EMULATE_RELAXED", "8");
    let pair = ("DOORBELL_NODE_SIZE", "2");
    let posting = |p| ("DOORBELL_IB_POSTING", p);
    let variants: Vec<(&str, Vec<(&str, &str)>)> = vec![
        (
            "Ib, proxy posting",
            vec![sep, emu, relaxed, posting("proxy")],
        ),
        ("Ib, IBGDA", vec![sep, emu, relaxed, posting("ibgda")]),
        ("Ib, CPU-assisted", vec![sep, emu, relaxed, posting("cpu")]),
        (
            "Ib, ibv_post_send",
            vec![sep, emu, relaxed, posting("verbs")],
        ),
        (
            "Ib, proxy posting, 2 ranks per node",
            vec![sep, emu, relaxed, pair, posting("proxy")],
        ),
        (
            "Ib, IBGDA, 2 ranks per node",
            vec![sep, emu, relaxed, pair, posting("ibgda")],
        ),
        (
            "Ib, CPU-assisted, 2 ranks per node",
            vec![sep, emu, relaxed, pair, posting("cpu")],
        ),
        (
            "Ethernet, 2 ranks per node",
            vec![sep, pair, ("DOORBELL_IB_DISABLE", "1")],
        ),
    ];
    let keep = keep_variant();
    for (name, env) in variants.into_iter().filter(|(name, _)| keep(name)) {
        for n in rank_counts() {
            // Nodes of two need an even number of ranks (every node the same size).
            if name.contains("2 ranks per node") && n % 2 != 0 {
                continue;
            }
            eprintln!("{name}, {n} ranks");
            run_case("exchange", n, &env);
        }
    }
}

/// The node-spanning low-latency path (`DOORBELL_MOE_NET`, or ranks on several nodes) over every
/// transport and posting mode, the emulated NIC delivering data writes out of order
/// (`DOORBELL_IB_EMULATE_RELAXED`: a count read before its flush fails), with ranks as separate
/// nodes and as nodes of two. `DOORBELL_TEST_VARIANTS=IBGDA,proxy` keeps the variants whose names
/// contain one of the words.
#[test]
#[ignore = "needs GPU"]
fn low_latency_across_nodes_in_every_posting_mode() {
    let sep = ("DOORBELL_SEPARATE_NODES", "1");
    let emu = ("DOORBELL_IB_EMULATE", "1");
    let relaxed = ("DOORBELL_IB_EMULATE_RELAXED", "8");
    let pair = ("DOORBELL_NODE_SIZE", "2");
    let posting = |p| ("DOORBELL_IB_POSTING", p);
    let variants: Vec<(&str, Vec<(&str, &str)>)> = vec![
        ("NVLink only", vec![("DOORBELL_MOE_NET", "1")]),
        (
            "Ib, proxy posting",
            vec![sep, emu, relaxed, posting("proxy")],
        ),
        ("Ib, IBGDA", vec![sep, emu, relaxed, posting("ibgda")]),
        ("Ib, CPU-assisted", vec![sep, emu, relaxed, posting("cpu")]),
        (
            "Ib, ibv_post_send",
            vec![sep, emu, relaxed, posting("verbs")],
        ),
        (
            "Ib, proxy posting, 2 ranks per node",
            vec![sep, emu, relaxed, pair, posting("proxy")],
        ),
        (
            "Ib, IBGDA, 2 ranks per node",
            vec![sep, emu, relaxed, pair, posting("ibgda")],
        ),
        (
            "Ib, CPU-assisted, 2 ranks per node",
            vec![sep, emu, relaxed, pair, posting("cpu")],
        ),
        (
            "Ethernet, 2 ranks per node",
            vec![sep, pair, ("DOORBELL_IB_DISABLE", "1")],
        ),
    ];
    let keep = keep_variant();
    for (name, env) in variants.into_iter().filter(|(name, _)| keep(name)) {
        for n in rank_counts() {
            eprintln!("{name}, {n} ranks");
            run_case("low_latency", n, &env);
        }
    }
}

const LL_MAX: usize = 160;
/// Token counts repeat with this period in rounds (graph replays keep the captured count).
const LL_PERIOD: usize = 65;

/// Rank `r`'s decode batch in `round`: uneven sizes, none for rank 1 in round 1, and in round 2
/// more than 128 tokens on rank 0 (the send lists its tokens in memory beyond four groups of 32).
fn ll_routing(r: usize, round: u64, experts: usize) -> Routing {
    let tokens = if round == 1 && r == 1 {
        0
    } else if round == 2 && r == 0 {
        150
    } else {
        (20 + 7 * r + round as usize) % LL_PERIOD
    };
    routing_of(r, round + 50, experts, tokens)
}

fn low_latency(comm: &Arc<Communicator>, s: &Arc<CudaStream>) {
    use doorbell::collectives::moe::{FusedSend, MoeLowLatency};
    let (me, world) = (comm.rank(), comm.world_size());
    let experts = 8 * world;
    let local = experts / world;
    let ll = MoeLowLatency::new(
        comm,
        MoeConfig {
            hidden: HIDDEN,
            topk: TOPK,
            num_experts: experts,
            max_tokens: LL_MAX,
            blocks: Some(16),
            ..Default::default()
        },
    )
    .unwrap();
    let env = |k: &str| std::env::var(k).unwrap_or_default();
    let node_size: usize = env("DOORBELL_NODE_SIZE").parse().unwrap_or(1);
    let spans = env("DOORBELL_MOE_NET") == "1"
        || (env("DOORBELL_SEPARATE_NODES") == "1" && world > node_size);
    assert_eq!(ll.spans_nodes(), spans, "rank {me}: the node-spanning path");
    let x: CudaSlice<u16> = s.alloc_zeros(LL_MAX * HIDDEN).unwrap();
    // One id more: round 3 passes the ids 4 bytes off a 16-byte boundary (ids_at).
    let idx: CudaSlice<i32> = s.alloc_zeros(LL_MAX * TOPK + 1).unwrap();
    let w: CudaSlice<f32> = s.alloc_zeros(LL_MAX * TOPK).unwrap();
    let out: CudaSlice<u16> = s.alloc_zeros(LL_MAX * HIDDEN).unwrap();
    let (xp, ip, wp, op) = (
        x.device_ptr(s).0,
        idx.device_ptr(s).0,
        w.device_ptr(s).0,
        out.device_ptr(s).0,
    );
    // Where round `round`'s top-k ids go: in round 3, 4 bytes past a 16-byte boundary (the
    // node-spanning send then reads them an id at a time instead of 16 bytes at a time).
    let ids_at = |round: u64| if round == 3 { ip + 4 } else { ip };
    let htod = |ptr: u64, v: &[u8]| upload_bytes(s, ptr, v);
    let dtoh = |ptr: u64, n: usize| download_bytes(comm, s, ptr, n);
    let upload = |round: u64| -> Routing {
        let mine = ll_routing(me, round, experts);
        let xs: Vec<u16> = (0..mine.tokens * HIDDEN)
            .map(|i| x_value(me, i / HIDDEN, i % HIDDEN).to_bits())
            .collect();
        htod(xp, bytemuck::cast_slice(&xs));
        htod(ids_at(round), bytemuck::cast_slice(&mine.idx));
        htod(wp, bytemuck::cast_slice(&mine.weights));
        mine
    };
    let u32s = |b: &[u8; 4]| u32::from_le_bytes(*b);
    // Checks a dispatch's results, fills the combine buffer with each row times (local id + 1).
    let check = |round: u64, n: u64, what: &str| {
        let res = ll.results_of(n);
        let all: Vec<Routing> = (0..world).map(|r| ll_routing(r, round, experts)).collect();
        let layout: Vec<u32> = words(&dtoh(res.layout, local * world * 4), u32s);
        let counts: Vec<u32> = words(&dtoh(res.recv_count, local * 4), u32s);
        let slots = local * world * LL_MAX;
        let rx: Vec<bf16> = words(&dtoh(res.recv_x, slots * HIDDEN * 2), |b: &[u8; 2]| {
            bf16::from_bits(u16::from_le_bytes(*b))
        });
        let rs: Vec<i32> = words(&dtoh(res.recv_src, slots * 4), |b: &[u8; 4]| {
            i32::from_le_bytes(*b)
        });
        let rw: Vec<f32> = words(&dtoh(res.recv_weights, slots * 4), |b: &[u8; 4]| {
            f32::from_le_bytes(*b)
        });
        let mut ys = vec![0u16; slots * HIDDEN];
        for le in 0..local {
            let e = (me * local + le) as i32;
            let mut total = 0;
            for src in 0..world {
                let mut want: Vec<i32> = (0..all[src].tokens)
                    .flat_map(|t| {
                        let ids = &all[src].idx[t * TOPK..(t + 1) * TOPK];
                        ids.iter().filter(move |&&x| x == e).map(move |_| t as i32)
                    })
                    .collect();
                let n = layout[le * world + src] as usize;
                assert_eq!(
                    n,
                    want.len(),
                    "rank {me}, {what}: rows of expert {le} from {src}"
                );
                total += n as u32;
                let base = (le * world + src) * LL_MAX;
                let mut got: Vec<i32> = rs[base..base + n].to_vec();
                for i in 0..n {
                    let t = rs[base + i] as usize;
                    let k = (0..TOPK)
                        .find(|&k| all[src].idx[t * TOPK + k] == e)
                        .expect("a row of a token that selected this expert");
                    assert_eq!(
                        rw[base + i],
                        all[src].weights[t * TOPK + k],
                        "rank {me}, {what}: weight of expert {le} source {src} row {i}"
                    );
                    for h in 0..HIDDEN {
                        let v = rx[(base + i) * HIDDEN + h];
                        assert_eq!(
                            v,
                            x_value(src, t, h),
                            "rank {me}, {what}: expert {le} source {src} row {i}"
                        );
                        ys[(base + i) * HIDDEN + h] =
                            bf16::from_f32(v.to_f32() * (le as f32 + 1.0)).to_bits();
                    }
                }
                got.sort_unstable();
                want.sort_unstable();
                assert_eq!(
                    got, want,
                    "rank {me}, {what}: tokens of expert {le} from {src}"
                );
            }
            assert_eq!(counts[le], total, "rank {me}, {what}: rows of expert {le}");
        }
        htod(ll.combine_buffer(), bytemuck::cast_slice(&ys));
    };
    let check_combine = |round: u64, what: &str| {
        let mine = ll_routing(me, round, experts);
        let got: Vec<bf16> = words(&dtoh(op, mine.tokens * HIDDEN * 2), |b: &[u8; 2]| {
            bf16::from_bits(u16::from_le_bytes(*b))
        });
        // Each rank sums its selections of a token (f32, top-k order) and rounds to bf16; the
        // token's rank adds those partial sums in rank order.
        for t in 0..mine.tokens {
            for h in 0..HIDDEN {
                let mut acc = 0f32;
                for r in 0..world {
                    let mut partial = None;
                    for k in 0..TOPK {
                        let e = mine.idx[t * TOPK + k];
                        if e < 0 || e as usize / local != r {
                            continue;
                        }
                        let y = bf16::from_f32(
                            x_value(me, t, h).to_f32() * ((e as usize % local) as f32 + 1.0),
                        );
                        partial = Some(
                            mine.weights[t * TOPK + k].mul_add(y.to_f32(), partial.unwrap_or(0.0)),
                        );
                    }
                    if let Some(p) = partial {
                        acc += bf16::from_f32(p).to_f32();
                    }
                }
                assert_eq!(
                    got[t * HIDDEN + h],
                    bf16::from_f32(acc),
                    "rank {me}, {what}: token {t} value {h}"
                );
            }
        }
    };
    let mut n = 0u64;
    for round in 0..4u64 {
        let mine = upload(round);
        // Even rounds: the halves apart, with other work between them; odd rounds: the kernels
        // that do both.
        if round % 2 == 0 {
            // SAFETY: the inputs hold `tokens` rows.
            unsafe { ll.dispatch_send(s, xp, ids_at(round), wp, mine.tokens) }.unwrap();
            htod(op, &[0u8; 16]);
            ll.dispatch_recv(s).unwrap();
        } else {
            // SAFETY: as above.
            unsafe { ll.dispatch(s, xp, ids_at(round), wp, mine.tokens) }.unwrap();
        }
        n += 1;
        check(round, n, &format!("round {round}"));
        if round % 2 == 0 {
            ll.combine_send(s).unwrap();
            htod(op, &[0u8; 16]);
            // SAFETY: out holds `tokens` rows.
            unsafe { ll.combine_recv(s, op) }.unwrap();
        } else {
            // SAFETY: out holds `tokens` rows.
            unsafe { ll.combine(s, op) }.unwrap();
        }
        check_combine(round, &format!("round {round}"));
    }
    // Fused dispatch: a kernel of the test's own makes each row in shared memory and sends it
    // with the device API (moe_ll::put_token or moe_net::put_token, then finish_send).
    let fused = |name: &str| {
        comm.gpu()
            .function(name, &format!("{name}_test_fused_send"))
            .unwrap()
    };
    let (fused_ll, fused_net) = (fused("moe_ll"), fused("moe_net"));
    for round in 4..6u64 {
        let mine = upload(round);
        // SAFETY: topk_idx holds `tokens` rows.
        let args = unsafe { ll.begin_fused_send(ip, wp, mine.tokens) }.unwrap();
        let mut b;
        match &args {
            FusedSend::Nvlink(a) => {
                b = s.launch_builder(&fused_ll);
                b.arg(a);
            }
            FusedSend::Net(a) => {
                b = s.launch_builder(&fused_net);
                b.arg(a);
            }
        }
        let cfg = cudarc::driver::LaunchConfig {
            grid_dim: (8, 1, 1),
            block_dim: (512, 1, 1),
            shared_mem_bytes: 16 * HIDDEN as u32 * 2,
        };
        // SAFETY: matches moe_ll_test_fused_send; 16 warps x one row of shared memory each.
        unsafe { b.launch(cfg) }.unwrap();
        ll.dispatch_recv(s).unwrap();
        n += 1;
        check(round, n, &format!("fused round {round}"));
        // SAFETY: out holds `tokens` rows.
        unsafe { ll.combine(s, op) }.unwrap();
        check_combine(round, &format!("fused round {round}"));
    }
    // FP8 rows (node-spanning path): e4m3 bytes and their scales arrive at every selected
    // expert's slot as sent (the NVLink path refuses them).
    if ll.spans_nodes() {
        let xs8: CudaSlice<u8> = s.alloc_zeros(LL_MAX * HIDDEN).unwrap();
        let sc: CudaSlice<f32> = s.alloc_zeros(LL_MAX * HIDDEN / 128).unwrap();
        let (xp8, scp) = (xs8.device_ptr(s).0, sc.device_ptr(s).0);
        let byte = |r: usize, t: usize, h: usize| ((r * 131 + t * 17 + h * 3) % 251) as u8;
        let scale = |r: usize, t: usize, c: usize| (r * 1000 + t * 10 + c) as f32 + 0.5;
        for round in 6..8u64 {
            let mine = upload(round);
            let b: Vec<u8> = (0..mine.tokens * HIDDEN)
                .map(|i| byte(me, i / HIDDEN, i % HIDDEN))
                .collect();
            let c: Vec<f32> = (0..mine.tokens * HIDDEN / 128)
                .map(|i| scale(me, i / (HIDDEN / 128), i % (HIDDEN / 128)))
                .collect();
            htod(xp8, &b);
            htod(scp, bytemuck::cast_slice(&c));
            // SAFETY: the inputs hold `tokens` rows.
            unsafe { ll.dispatch_send_fp8(s, xp8, scp, ip, wp, mine.tokens) }.unwrap();
            ll.dispatch_recv(s).unwrap();
            n += 1;
            let res = ll.results_of(n);
            let all: Vec<Routing> = (0..world).map(|r| ll_routing(r, round, experts)).collect();
            let layout: Vec<u32> = words(&dtoh(res.layout, local * world * 4), u32s);
            let slots = local * world * LL_MAX;
            let rx = dtoh(res.recv_x, slots * HIDDEN);
            let rs: Vec<i32> = words(&dtoh(res.recv_src, slots * 4), |b: &[u8; 4]| {
                i32::from_le_bytes(*b)
            });
            let rsc: Vec<f32> = words(
                &dtoh(res.recv_scales, slots * HIDDEN / 128 * 4),
                |b: &[u8; 4]| f32::from_le_bytes(*b),
            );
            for le in 0..local {
                let e = (me * local + le) as i32;
                for src in 0..world {
                    let want = (0..all[src].tokens)
                        .filter(|&t| all[src].idx[t * TOPK..(t + 1) * TOPK].contains(&e))
                        .count();
                    let rows = layout[le * world + src] as usize;
                    assert_eq!(
                        rows, want,
                        "rank {me}, FP8 round {round}: rows of {le} from {src}"
                    );
                    let base = (le * world + src) * LL_MAX;
                    for i in 0..rows {
                        let t = rs[base + i] as usize;
                        for h in 0..HIDDEN {
                            assert_eq!(
                                rx[(base + i) * HIDDEN + h],
                                byte(src, t, h),
                                "rank {me}, FP8 round {round}: expert {le} source {src} row {i}"
                            );
                        }
                        for c in 0..HIDDEN / 128 {
                            assert_eq!(
                                rsc[(base + i) * (HIDDEN / 128) + c],
                                scale(src, t, c),
                                "rank {me}, FP8 round {round}: scale {c} of expert {le} source {src} row {i}"
                            );
                        }
                    }
                }
            }
            // The combine of an FP8 dispatch is bf16 as ever: outputs written at the rows' places.
            let mut ys = vec![0u16; slots * HIDDEN];
            for le in 0..local {
                for src in 0..world {
                    let base = (le * world + src) * LL_MAX;
                    for i in 0..layout[le * world + src] as usize {
                        let t = rs[base + i] as usize;
                        for h in 0..HIDDEN {
                            ys[(base + i) * HIDDEN + h] =
                                bf16::from_f32(x_value(src, t, h).to_f32() * (le as f32 + 1.0))
                                    .to_bits();
                        }
                    }
                }
            }
            htod(ll.combine_buffer(), bytemuck::cast_slice(&ys));
            // SAFETY: out holds `tokens` rows.
            unsafe { ll.combine(s, op) }.unwrap();
            check_combine(round, &format!("FP8 round {round}"));
        }
    } else {
        // SAFETY: refused before anything is read.
        let refused = unsafe { ll.dispatch_send_fp8(s, xp, wp, ip, wp, 1) };
        assert!(refused.is_err(), "rank {me}: FP8 on the NVLink path");
    }
    // Graph replays of a captured dispatch (fixed token count), new routing each time; the
    // results alternate halves.
    let round0 = 10u64;
    comm.synchronize(s).unwrap();
    s.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
        .unwrap();
    // SAFETY: as above.
    unsafe { ll.dispatch(s, xp, ip, wp, ll_routing(me, round0, experts).tokens) }.unwrap();
    let graph = s
        .end_capture(CUgraphInstantiate_flags(0))
        .unwrap()
        .expect("a graph");
    for replay in 0..20u64 {
        // Rounds 10 + 65 k keep every rank's token count.
        let round = round0 + replay * LL_PERIOD as u64;
        upload(round);
        graph.launch().unwrap();
        n += 1;
        check(round, n, &format!("graph replay {replay}"));
        // SAFETY: as above.
        unsafe { ll.combine(s, op) }.unwrap();
        check_combine(round, &format!("graph replay {replay}"));
    }
}
