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
use doorbell::collectives::moe::{reference_layout, MoeConfig, MoeHighThroughput};
use doorbell::communicator::Communicator;
use doorbell::transport::ib::emulated::nic::Traffic;
use half::bf16;
use std::sync::Arc;

#[test]
#[ignore = "needs GPU"]
fn gpu_rank() {
    rank_main(|case, comm, stream| match case {
        "exchange" => exchange(comm, stream),
        "low_latency" => low_latency(comm, stream),
        "deep_ep_layout" => deep_ep_layout(comm, stream),
        other => panic!("unknown case {other}"),
    });
}

#[test]
#[ignore = "needs GPU"]
fn dispatch_layout_payloads_and_combine_match_the_cpu() {
    for n in rank_counts() {
        // 16 blocks: the combine pushes; 96 (where the GPU has that many SMs): it pulls.
        run_case("exchange", n, &[]);
        run_case("exchange", n, &[("DOORBELL_TEST_MOE_BLOCKS", "96")]);
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

/// Prints the rows whose origin names no source (rank or token out of range): which token's
/// values and ids they hold, to tell a misplaced row from an empty one.
fn report_strange_origins(
    me: usize,
    what: &str,
    origins: &[(usize, usize)],
    rx: &[bf16],
    ri: &[i32],
    world: usize,
) {
    for (j, &(src, t)) in origins.iter().enumerate() {
        if src >= world || t >= MAX_TOKENS {
            eprintln!(
                "rank {me}, {what}: row {j} names ({}, {t}); values {:?}, ids {:?}",
                src as i64,
                &rx[j * HIDDEN..j * HIDDEN + 4],
                &ri[j * TOPK..(j + 1) * TOPK]
            );
        }
    }
}

fn exchange(comm: &Arc<Communicator>, s: &Arc<CudaStream>) {
    let (me, world) = (comm.rank(), comm.world_size());
    let experts = 8 * world;
    let per_rank = experts / world;
    // The combine's two ways: pushed up to 64 blocks, pulled above (as many as the GPU has).
    let blocks: u32 = std::env::var("DOORBELL_TEST_MOE_BLOCKS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(16);
    let blocks = blocks.min(comm.gpu().sm_count().unwrap());
    // The buffer's tokens per rank (the routing stays within MAX_TOKENS) and the receive ring:
    // DOORBELL_TEST_MOE_BUFFER_TOKENS and DOORBELL_TEST_MOE_NET_CHUNKS ("default": the
    // library's) give the shape doorbell.deep_ep builds across nodes.
    let buffer_tokens: usize = std::env::var("DOORBELL_TEST_MOE_BUFFER_TOKENS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(MAX_TOKENS);
    let mut cfg = MoeConfig::new(HIDDEN, TOPK, experts, buffer_tokens)
        .with_blocks(blocks)
        .with_receive_slots(2);
    // Across nodes: by default a receive ring of one chunk of 32 tokens per source node, so
    // every further chunk waits for its credit (receiver-driven admission under test).
    if std::env::var("DOORBELL_TEST_MOE_NET_CHUNKS").as_deref() != Ok("default") {
        cfg = cfg.with_net_chunks(1);
    }
    let moe = MoeHighThroughput::new(comm, cfg).unwrap();
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
    assert!(
        spans || buffer_tokens == MAX_TOKENS,
        "a larger buffer only across nodes (the one-node checks size rows by MAX_TOKENS)"
    );
    let x: CudaSlice<bf16> = s.alloc_zeros(MAX_TOKENS * HIDDEN).unwrap();
    let idx: CudaSlice<i32> = s.alloc_zeros(MAX_TOKENS * TOPK).unwrap();
    let w: CudaSlice<f32> = s.alloc_zeros(MAX_TOKENS * TOPK).unwrap();
    // Every row a dispatch can leave: world x the buffer's tokens.
    let y: CudaSlice<bf16> = s.alloc_zeros(world * buffer_tokens * HIDDEN).unwrap();
    let mut out: CudaSlice<bf16> = s.alloc_zeros(MAX_TOKENS * HIDDEN).unwrap();
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
    let check_dispatch =
        |res: &doorbell::collectives::moe::DispatchResults, round: u64, what: &str, y_at: u64| {
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
                if got != want {
                    report_strange_origins(me, what, &origins, &rx, &ri, world);
                }
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
                                ids.iter().any(|&e| {
                                    e >= 0 && e as usize / per_rank / node_size == my_node
                                })
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
                // DeepEP's rank_prefix_matrix: [s][r], the rows ranks 0..=s send rank r.
                let got: Vec<i32> = words(&dtoh(res.rank_prefix, world * world * 4), i32s);
                let mut want = vec![0i32; world * world];
                for r in 0..world {
                    let mut sum = 0;
                    for s in 0..world {
                        sum += reference_layout(&all[s].idx, TOPK, per_rank, world)[r].len() as i32;
                        want[s * world + r] = sum;
                    }
                }
                assert_eq!(got, want, "rank {me}, {what}: rank_prefix_matrix");
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
                    // A weight reaches only the rank of its expert (0 elsewhere, as DeepEP's).
                    let w = if local >= 0 { ws[k] } else { 0.0 };
                    assert_eq!(rw[j * TOPK + k], w, "rank {me}, {what}: row {j} weight {k}");
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
    // The combined top-k weights (DeepEP's combined_topk_weights).
    let out_weights: CudaSlice<f32> = s.alloc_zeros(MAX_TOKENS * TOPK).unwrap();
    let owp = out_weights.device_ptr(s).0;
    // A dispatch routed by ranks (DeepEP's is_token_in_rank) and its per-expert counts.
    let in_rank_dev: CudaSlice<u8> = s.alloc_zeros(MAX_TOKENS * world).unwrap();
    let irp = in_rank_dev.device_ptr(s).0;
    let per_expert_dev: CudaSlice<i32> = s.alloc_zeros(experts).unwrap();
    let pep = per_expert_dev.device_ptr(s).0;
    for round in 0..4u64 {
        let mine = upload(round);
        let before = traffic();
        let n = mine.tokens;
        if round == 0 {
            // The typed call: the slices' lengths give the sizes, and wrong ones are refused
            // before anything is sent (no call counted, so the ranks stay in step).
            let bad = moe.dispatch(
                s,
                &x.slice(..n * HIDDEN + 8),
                &idx.slice(..n * TOPK),
                &w.slice(..n * TOPK),
            );
            assert!(
                bad.is_err(),
                "rank {me}: a dispatch whose x and ids disagree"
            );
            moe.dispatch(
                s,
                &x.slice(..n * HIDDEN),
                &idx.slice(..n * TOPK),
                &w.slice(..n * TOPK),
            )
            .unwrap();
        } else {
            // SAFETY: the inputs hold `tokens` rows; y and out are sized for the worst case.
            unsafe { moe.dispatch_raw(s, xp, ip, wp, n) }.unwrap();
        }
        // Round 3 writes the expert outputs straight into the combine buffer (pulled: no copy-in).
        let y_at = if round == 3 {
            moe.combine_buffer().unwrap()
        } else {
            yp
        };
        check_dispatch(&res, round, &format!("round {round}"), y_at);
        check_network(round, before, used_bf16, &format!("round {round}"));
        if round == 0 {
            let short = moe.combine(s, &y.slice(..HIDDEN), &mut out.slice_mut(..n * HIDDEN));
            assert!(
                short.is_err(),
                "rank {me}: a combine whose y cannot hold every row"
            );
            moe.combine(s, &y, &mut out.slice_mut(..n * HIDDEN))
                .unwrap();
        } else {
            // SAFETY: y and out are sized for the worst case.
            unsafe { moe.combine_raw(s, y_at, op) }.unwrap();
        }
        check_combine(round, &format!("round {round}"));
        if round == 2 {
            // Again, summing each row's received weights too: a token's weight k comes back
            // from the rank of its expert (0 elsewhere), so the sum is the weight itself (across
            // nodes summed inside each node, then over the nodes).
            // SAFETY: recv_weights holds the dispatch's rows; out_weights MAX_TOKENS x TOPK.
            unsafe { moe.combine_with_weights_raw(s, y_at, op, res.recv_weights, owp) }.unwrap();
            check_combine(round, "round 2, with weights");
            let got: Vec<f32> = words(&dtoh(owp, mine.tokens * TOPK * 4), |b: &[u8; 4]| {
                f32::from_le_bytes(*b)
            });
            for t in 0..mine.tokens {
                for k in 0..TOPK {
                    let e = mine.idx[t * TOPK + k];
                    let want = if e >= 0 {
                        mine.weights[t * TOPK + k]
                    } else {
                        0.0
                    };
                    assert_eq!(
                        got[t * TOPK + k],
                        want,
                        "rank {me}: combined weight {k} of token {t}"
                    );
                }
            }
        }
        if round == 2 {
            // The same routing given as ranks per token: the same rows, origins, prefix matrix
            // (one node: across nodes there is none) and per-expert counts (from the sources'
            // own counts, across nodes carried to each node with its first chunk), and the
            // combine on top.
            let n = u32::from_le_bytes(dtoh(res.num_recv, 4).try_into().unwrap()) as usize;
            let snapshot = |r: &doorbell::collectives::moe::DispatchResults| {
                (
                    dtoh(r.recv_x, n * HIDDEN * 2),
                    dtoh(r.recv_src, n * 8),
                    if spans {
                        Vec::new()
                    } else {
                        dtoh(r.rank_prefix, world * world * 4)
                    },
                    dtoh(r.expert_counts, per_rank * 4),
                )
            };
            let by_topk = snapshot(&res);
            let in_rank: Vec<u8> = (0..mine.tokens * world)
                .map(|i| {
                    let ids = &mine.idx[(i / world) * TOPK..(i / world + 1) * TOPK];
                    u8::from(
                        ids.iter()
                            .any(|&e| e >= 0 && e as usize / per_rank == i % world),
                    )
                })
                .collect();
            let per_expert: Vec<i32> = (0..experts)
                .map(|e| mine.idx.iter().filter(|&&id| id == e as i32).count() as i32)
                .collect();
            htod(irp, &in_rank);
            htod(pep, bytemuck::cast_slice(&per_expert));
            // SAFETY: in_rank holds tokens x world bytes, per_expert `experts` i32.
            unsafe { moe.dispatch_by_rank_raw(s, xp, 0, irp, pep, mine.tokens) }.unwrap();
            let by_rank = snapshot(&res);
            assert!(
                by_rank.0 == by_topk.0,
                "rank {me}: rows of the dispatch by ranks"
            );
            assert_eq!(
                by_rank.1, by_topk.1,
                "rank {me}: origins of the dispatch by ranks"
            );
            assert_eq!(
                by_rank.2, by_topk.2,
                "rank {me}: prefix matrix of the dispatch by ranks"
            );
            assert_eq!(
                by_rank.3, by_topk.3,
                "rank {me}: expert counts of the dispatch by ranks"
            );
            // SAFETY: as the round's combine.
            unsafe { moe.combine_raw(s, y_at, op) }.unwrap();
            check_combine(round, "round 2, after a dispatch by ranks");
        }
        if round == 1 {
            // A second combine of the same dispatch (its own handshake: a peer may still read
            // this rank's combine buffer), into a cleared output.
            // SAFETY: `op` is `out`'s MAX_TOKENS * HIDDEN bf16.
            check("cuMemsetD16Async", unsafe {
                cudarc::driver::sys::cuMemsetD16Async(op, 0, MAX_TOKENS * HIDDEN, s.cu_stream())
            });
            unsafe { moe.combine_raw(s, y_at, op) }.unwrap();
            check_combine(round, "round 1, combined again");
        }
    }
    if !spans {
        // A second receive slot: a dispatch into it leaves round 3's results in slot 0 as they
        // were, and its combine follows it.
        let n0 = u32::from_le_bytes(dtoh(res.num_recv, 4).try_into().unwrap()) as usize;
        let keep = (
            dtoh(res.recv_x, n0 * HIDDEN * 2),
            dtoh(res.recv_src, n0 * 8),
            dtoh(res.rank_prefix, world * world * 4),
        );
        moe.set_receive_slot(1).unwrap();
        // DeepEP's num_worst_tokens: every row of the slot past the received ones without an
        // expert.
        let worst = world * MAX_TOKENS;
        assert!(
            moe.set_worst_rows(worst + 1).is_err(),
            "rank {me}: more worst rows than the slot holds"
        );
        moe.set_worst_rows(worst).unwrap();
        let mine = upload(4);
        // SAFETY: the inputs hold `tokens` rows; y and out are sized for the worst case.
        unsafe { moe.dispatch_raw(s, xp, ip, wp, mine.tokens) }.unwrap();
        moe.set_worst_rows(0).unwrap();
        let res1 = moe.results();
        assert_ne!(res1.recv_x, res.recv_x, "rank {me}: slot 1's results");
        check_dispatch(&res1, 4, "round 4, receive slot 1", yp);
        let n1 = u32::from_le_bytes(dtoh(res1.num_recv, 4).try_into().unwrap()) as usize;
        let ids: Vec<i32> = words(&dtoh(res1.recv_idx, worst * TOPK * 4), |b: &[u8; 4]| {
            i32::from_le_bytes(*b)
        });
        assert!(
            ids[n1 * TOPK..].iter().all(|&e| e == -1),
            "rank {me}: ids of rows {n1}..{worst} are -1"
        );
        let in_slot0 = (
            dtoh(res.recv_x, n0 * HIDDEN * 2),
            dtoh(res.recv_src, n0 * 8),
            dtoh(res.rank_prefix, world * world * 4),
        );
        assert!(in_slot0 == keep, "rank {me}: slot 0 kept round 3's results");
        // Two-batch overlap: a second dispatch (round 7's routing) into slot 0 before round 4's
        // combine, then both combines, each following its own slot's layout.
        moe.set_receive_slot(0).unwrap();
        upload(7);
        // SAFETY: as above.
        unsafe { moe.dispatch_raw(s, xp, ip, wp, routing(me, 7, experts).tokens) }.unwrap();
        let y2: CudaSlice<bf16> = s.alloc_zeros(world * buffer_tokens * HIDDEN).unwrap();
        let y2p = y2.device_ptr(s).0;
        check_dispatch(&moe.results(), 7, "round 7, receive slot 0", y2p);
        moe.set_receive_slot(1).unwrap();
        // SAFETY: y holds round 4's rows (slot 1), out MAX_TOKENS x HIDDEN.
        unsafe { moe.combine_raw(s, yp, op) }.unwrap();
        check_combine(4, "round 4's combine after round 7's dispatch");
        moe.set_receive_slot(0).unwrap();
        // SAFETY: y2 holds round 7's rows (slot 0).
        unsafe { moe.combine_raw(s, y2p, op) }.unwrap();
        check_combine(7, "round 7's combine after round 4's");
        moe.set_receive_slot(1).unwrap();
        // SAFETY: as the rounds' combines: slot 1's dispatch combined once more.
        unsafe { moe.combine_raw(s, yp, op) }.unwrap();
        check_combine(4, "round 4, combined again");
        assert!(
            moe.set_receive_slot(2).is_err(),
            "rank {me}: a slot past receive_slots"
        );
        moe.set_receive_slot(0).unwrap();
    } else {
        assert!(
            moe.set_receive_slot(1).is_err(),
            "rank {me}: the node-spanning path has one receive slot"
        );
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
        unsafe { moe.dispatch_fp8_raw(s, xp, scp, ip, wp, mine.tokens) }.unwrap();
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
    unsafe { moe.dispatch_raw(s, xp, ip, wp, routing(me, 10, experts).tokens) }.unwrap();
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
        check_dispatch(&res, round, &format!("graph replay {replay}"), yp);
        check_network(round, before, used_bf16, &format!("graph replay {replay}"));
        // SAFETY: as above.
        unsafe { moe.combine_raw(s, yp, op) }.unwrap();
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
/// src/host/transport/ethernet.rs.)
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

/// The node-spanning high-throughput path with the buffer `doorbell.deep_ep` builds across nodes
/// (about 46,000 tokens a rank from `num_nvl_bytes` = 1e8 at hidden 256, 20 blocks, the library's
/// receive ring). Its first run found the adapter's negative origins native: from about 16,000
/// tokens a rank, with one rank per node the node's dispatch read token positions its layout
/// block had not written yet (its wait on the own GPU's count used a site with no time budget,
/// which gave up after 64 polls), and an empty slot overwrote row 0.
/// `DOORBELL_TEST_VARIANTS` keeps variants by name.
#[test]
#[ignore = "needs GPU"]
fn high_throughput_across_nodes_with_the_deep_ep_adapters_buffer() {
    let large = [
        ("DOORBELL_TEST_MOE_BUFFER_TOKENS", "46000"),
        ("DOORBELL_TEST_MOE_BLOCKS", "20"),
        ("DOORBELL_TEST_MOE_NET_CHUNKS", "default"),
        ("DOORBELL_SEPARATE_NODES", "1"),
    ];
    let variants: Vec<(&str, Vec<(&str, &str)>)> = vec![
        (
            "Ib, proxy posting",
            vec![
                ("DOORBELL_IB_EMULATE", "1"),
                ("DOORBELL_IB_POSTING", "proxy"),
            ],
        ),
        (
            "Ethernet, 2 ranks per node",
            vec![("DOORBELL_NODE_SIZE", "2"), ("DOORBELL_IB_DISABLE", "1")],
        ),
    ];
    let keep = keep_variant();
    for (name, extra) in variants.into_iter().filter(|(name, _)| keep(name)) {
        for n in rank_counts() {
            if name.contains("2 ranks per node") && (n % 2 != 0 || n < 4) {
                continue;
            }
            eprintln!("{name}, {n} ranks, the adapter's buffer");
            let env: Vec<(&str, &str)> = large.iter().chain(extra.iter()).copied().collect();
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
    let keep = keep_variant();
    for (name, env) in ll_variants().into_iter().filter(|(name, _)| keep(name)) {
        for n in rank_counts() {
            eprintln!("{name}, {n} ranks");
            run_case("low_latency", n, &env);
        }
    }
}

/// DeepEP's low-latency layout on the node-spanning path, in every variant of
/// [`low_latency_across_nodes_in_every_posting_mode`]: the same checks as on one node (packed
/// rows, FP8 casts and scales, ranges, counts, stats, the combine's weights), with the halves
/// paired across two dispatches in flight and one combine in flight at a time.
#[test]
#[ignore = "needs GPU"]
fn low_latency_in_deep_eps_layout_across_nodes_in_every_posting_mode() {
    let keep = keep_variant();
    for (name, env) in ll_variants().into_iter().filter(|(name, _)| keep(name)) {
        for n in rank_counts() {
            eprintln!("{name}, {n} ranks");
            run_case("deep_ep_layout", n, &env);
        }
    }
}

/// The transports and posting modes the node-spanning low-latency tests run in: the emulated
/// NIC delivering data writes out of order (`DOORBELL_IB_EMULATE_RELAXED`: a count read before
/// its flush fails), ranks as separate nodes and as nodes of two, and the path on one node
/// (`DOORBELL_MOE_NET`).
fn ll_variants() -> Vec<(&'static str, Vec<(&'static str, &'static str)>)> {
    let sep = ("DOORBELL_SEPARATE_NODES", "1");
    let emu = ("DOORBELL_IB_EMULATE", "1");
    let relaxed = ("DOORBELL_IB_EMULATE_RELAXED", "8");
    let pair = ("DOORBELL_NODE_SIZE", "2");
    let posting = |p| ("DOORBELL_IB_POSTING", p);
    vec![
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
    ]
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
        MoeConfig::new(HIDDEN, TOPK, experts, LL_MAX).with_blocks(16),
    )
    .unwrap();
    let env = |k: &str| std::env::var(k).unwrap_or_default();
    let node_size: usize = env("DOORBELL_NODE_SIZE").parse().unwrap_or(1);
    let spans = env("DOORBELL_MOE_NET") == "1"
        || (env("DOORBELL_SEPARATE_NODES") == "1" && world > node_size);
    assert_eq!(ll.spans_nodes(), spans, "rank {me}: the node-spanning path");
    let x: CudaSlice<bf16> = s.alloc_zeros(LL_MAX * HIDDEN).unwrap();
    // One id more: round 3 passes the ids 4 bytes off a 16-byte boundary (ids_at).
    let idx: CudaSlice<i32> = s.alloc_zeros(LL_MAX * TOPK + 1).unwrap();
    let w: CudaSlice<f32> = s.alloc_zeros(LL_MAX * TOPK).unwrap();
    let mut out: CudaSlice<bf16> = s.alloc_zeros(LL_MAX * HIDDEN).unwrap();
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
            unsafe { ll.dispatch_send_raw(s, xp, ids_at(round), wp, mine.tokens) }.unwrap();
            htod(op, &[0u8; 16]);
            ll.dispatch_recv(s).unwrap();
        } else if round == 1 {
            // The typed call: sizes from the slices, the ids copied into the exchange's own
            // memory (the combine reads them), wrong lengths refused before anything is sent.
            let t = mine.tokens;
            let bad = ll.dispatch(
                s,
                &x.slice(..t * HIDDEN),
                &idx.slice(..t * TOPK + 1),
                &w.slice(..t * TOPK),
            );
            assert!(
                bad.is_err(),
                "rank {me}: a dispatch whose ids and weights disagree"
            );
            ll.dispatch(
                s,
                &x.slice(..t * HIDDEN),
                &idx.slice(..t * TOPK),
                &w.slice(..t * TOPK),
            )
            .unwrap();
        } else {
            // SAFETY: as above.
            unsafe { ll.dispatch_raw(s, xp, ids_at(round), wp, mine.tokens) }.unwrap();
        }
        n += 1;
        check(round, n, &format!("round {round}"));
        if round % 2 == 0 {
            ll.combine_send(s).unwrap();
            htod(op, &[0u8; 16]);
            // SAFETY: out holds `tokens` rows.
            unsafe { ll.combine_recv_raw(s, op) }.unwrap();
        } else if round == 1 {
            // Typed: `out` must hold the last dispatch's tokens.
            let t = mine.tokens;
            if t > 0 {
                let short = ll.combine(s, &mut out.slice_mut(..t * HIDDEN - 1));
                assert!(short.is_err(), "rank {me}: a combine into too small an out");
            }
            ll.combine(s, &mut out.slice_mut(..t * HIDDEN)).unwrap();
        } else {
            // SAFETY: out holds `tokens` rows.
            unsafe { ll.combine_raw(s, op) }.unwrap();
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
        unsafe { ll.combine_raw(s, op) }.unwrap();
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
            unsafe { ll.dispatch_send_fp8_raw(s, xp8, scp, ip, wp, mine.tokens) }.unwrap();
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
            unsafe { ll.combine_raw(s, op) }.unwrap();
            check_combine(round, &format!("FP8 round {round}"));
        }
    } else {
        // SAFETY: refused before anything is read.
        let refused = unsafe { ll.dispatch_send_fp8_raw(s, xp, wp, ip, wp, 1) };
        assert!(refused.is_err(), "rank {me}: FP8 on the NVLink path");
    }
    // Graph replays of a captured dispatch (fixed token count), new routing each time; the
    // results alternate halves.
    let round0 = 10u64;
    comm.synchronize(s).unwrap();
    s.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
        .unwrap();
    // SAFETY: as above.
    unsafe { ll.dispatch_raw(s, xp, ip, wp, ll_routing(me, round0, experts).tokens) }.unwrap();
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
        unsafe { ll.combine_raw(s, op) }.unwrap();
        check_combine(round, &format!("graph replay {replay}"));
    }
}

#[test]
#[ignore = "needs GPU"]
fn low_latency_in_deep_eps_layout_packs_casts_and_combines_with_the_combines_weights() {
    for n in rank_counts() {
        run_case("deep_ep_layout", n, &[]);
    }
}

/// A packed dispatch's results with each (expert, source) range's entries (source token, row
/// bytes, `scales(expert, position)`) sorted: what two runs of the same dispatch must agree on
/// (the order inside a range is the senders' race).
#[allow(clippy::too_many_arguments)]
fn canonical(
    counts: &[i32],
    ranges: &[i64],
    srcs: &[i32],
    rows: &[u8],
    row_bytes: usize,
    cap: usize,
    world: usize,
    scales: impl Fn(usize, usize) -> Vec<u8>,
) -> Vec<u8> {
    let mut v: Vec<u8> = counts.iter().flat_map(|c| c.to_le_bytes()).collect();
    v.extend(ranges.iter().flat_map(|r| r.to_le_bytes()));
    for le in 0..counts.len() {
        for from in 0..world {
            let r = ranges[le * world + from];
            let (begin, n) = ((r >> 32) as usize, (r & 0xffff_ffff) as usize);
            let mut entries: Vec<Vec<u8>> = (begin..begin + n)
                .map(|pos| {
                    let at = le * cap + pos;
                    let mut e = srcs[at].to_be_bytes().to_vec();
                    e.extend(&rows[at * row_bytes..(at + 1) * row_bytes]);
                    e.extend(scales(le, pos));
                    e
                })
                .collect();
            entries.sort();
            v.extend(entries.concat());
        }
    }
    v
}

/// An e4m3 byte's value.
fn e4m3(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0 } else { 1.0 };
    let (exp, man) = (((b >> 3) & 0xf) as i32, (b & 7) as f32);
    if exp == 15 && b & 7 == 7 {
        return f32::NAN;
    }
    if exp == 0 {
        return sign * man / 8.0 * 2f32.powi(-6);
    }
    sign * (1.0 + man / 8.0) * 2f32.powi(exp - 7)
}

/// DeepEP's scale for a group of 128 values whose largest magnitude is `amax`.
fn fp8_scale(amax: f32, round: bool) -> f32 {
    let s = amax.max(1e-4) * (1.0f32 / 448.0);
    if !round {
        return s;
    }
    let bits = s.to_bits();
    let e = ((bits >> 23) & 0xff) as i32 - 127 + i32::from(bits & 0x7f_ffff != 0);
    f32::from_bits(((e + 127) as u32) << 23)
}

/// DeepEP's low-latency layout (`MoeConfig::with_deep_ep_layout`): each expert's rows packed from
/// row 0 in source order with their source tokens, ranges and counts, bf16 or cast to e4m3 by the
/// kernel (plain, power-of-two and exponent-byte scales, column-major), stats added up, both
/// halves fused and apart; the combine returns every row and applies the weights given to it
/// (not the dispatch's: none travel). Compared exactly with the CPU (the FP8 rows within e4m3's
/// rounding of exactly computed scales).
fn deep_ep_layout(comm: &Arc<Communicator>, s: &Arc<CudaStream>) {
    use doorbell::collectives::moe::{
        MoeLowLatency, PackedCombineOptions, PackedHandle, PackedOutputs,
    };
    const H: usize = 512;
    let (me, world) = (comm.rank(), comm.world_size());
    let experts = 8 * world;
    let local = experts / world;
    let cap = world * LL_MAX;
    let cfg = MoeConfig::new(H, TOPK, experts, LL_MAX).with_blocks(16);
    let ll = MoeLowLatency::new(comm, cfg.clone().with_deep_ep_layout(true)).unwrap();
    let plain = MoeLowLatency::new(comm, cfg).unwrap();
    let x: CudaSlice<bf16> = s.alloc_zeros(LL_MAX * H).unwrap();
    let idx: CudaSlice<i32> = s.alloc_zeros(LL_MAX * TOPK).unwrap();
    let w: CudaSlice<f32> = s.alloc_zeros(LL_MAX * TOPK).unwrap();
    let out: CudaSlice<bf16> = s.alloc_zeros(LL_MAX * H).unwrap();
    let px: CudaSlice<u8> = s.alloc_zeros(local * cap * H * 2).unwrap();
    let ps: CudaSlice<u8> = s.alloc_zeros(local * (H / 128) * cap * 4).unwrap();
    let src: CudaSlice<i32> = s.alloc_zeros(local * cap).unwrap();
    let range: CudaSlice<i64> = s.alloc_zeros(local * world).unwrap();
    let count: CudaSlice<i32> = s.alloc_zeros(local).unwrap();
    let stats: CudaSlice<i32> = s.alloc_zeros(local).unwrap();
    let y: CudaSlice<bf16> = s.alloc_zeros(local * cap * H).unwrap();
    // A second dispatch in flight (odd rounds): every rank sends no token, into outputs of its
    // own; and the tickets that pair each receive half with its own send.
    let px2: CudaSlice<u8> = s.alloc_zeros(local * cap * H * 2).unwrap();
    let src2: CudaSlice<i32> = s.alloc_zeros(local * cap).unwrap();
    let range2: CudaSlice<i64> = s.alloc_zeros(local * world).unwrap();
    let count2: CudaSlice<i32> = s.alloc_zeros(local).unwrap();
    let tickets: CudaSlice<u64> = s.alloc_zeros(8).unwrap();
    // Round 2 passes its ids as int64 (DeepEP's topk_idx_t), read as they are.
    let idx64: CudaSlice<i64> = s.alloc_zeros(LL_MAX * TOPK).unwrap();
    let p = |v: u64| v;
    let (xp, ip, wp, op) = (
        p(x.device_ptr(s).0),
        p(idx.device_ptr(s).0),
        p(w.device_ptr(s).0),
        p(out.device_ptr(s).0),
    );
    let (pxp, psp, srcp, rangep, countp, statsp, yp) = (
        p(px.device_ptr(s).0),
        p(ps.device_ptr(s).0),
        p(src.device_ptr(s).0),
        p(range.device_ptr(s).0),
        p(count.device_ptr(s).0),
        p(stats.device_ptr(s).0),
        p(y.device_ptr(s).0),
    );
    let htod = |ptr: u64, v: &[u8]| upload_bytes(s, ptr, v);
    let dtoh = |ptr: u64, n: usize| download_bytes(comm, s, ptr, n);
    let tk = p(tickets.device_ptr(s).0);
    let outputs = PackedOutputs::new(pxp, srcp, rangep, countp)
        .with_stats(statsp)
        .with_ticket(tk);
    let empty = PackedOutputs::new(
        p(px2.device_ptr(s).0),
        p(src2.device_ptr(s).0),
        p(range2.device_ptr(s).0),
        p(count2.device_ptr(s).0),
    )
    .with_ticket(tk + 16);
    // Refused before anything is sent (no call word taken, so the calls below still pair up).
    // SAFETY: nothing is launched.
    let e = unsafe { plain.dispatch_packed_raw(s, xp, ip, 0, &outputs) }.unwrap_err();
    assert!(
        e.to_string().contains("with_deep_ep_layout"),
        "rank {me}: {e}"
    );
    let bad = outputs.with_fp8(psp, false, true);
    // SAFETY: as above.
    assert!(unsafe { ll.dispatch_packed_raw(s, xp, ip, 0, &bad) }.is_err());
    let mut stats_want = vec![0i32; local];
    // What rounds 0 and 1 gave (their valid rows, scales and source tokens, counts, ranges, the
    // combine buffer and the combined rows), for the typed calls to match below.
    let mut snaps: Vec<(Vec<u8>, Vec<u16>)> = Vec::new();
    for round in 0..4u64 {
        let (fp8, round_scale, ue8m0) = [
            (false, false, false),
            (true, false, false),
            (true, true, false),
            (true, true, true),
        ][round as usize];
        let mine = ll_routing(me, round, experts);
        let xs: Vec<u16> = (0..mine.tokens * H)
            .map(|i| x_value(me, i / H, i % H).to_bits())
            .collect();
        htod(xp, bytemuck::cast_slice(&xs));
        htod(ip, bytemuck::cast_slice(&mine.idx));
        let o = if fp8 {
            outputs.with_fp8(psp, round_scale, ue8m0)
        } else {
            outputs
        };
        let ids64: Vec<i64> = mine.idx.iter().map(|&e| i64::from(e)).collect();
        let i64p = p(idx64.device_ptr(s).0);
        htod(i64p, bytemuck::cast_slice(&ids64));
        // Even rounds: both halves in one kernel (round 2 with int64 ids); odd rounds: the
        // halves apart, work between.
        if round == 2 {
            let o64 = o.with_i64_ids(true);
            // SAFETY: every buffer is sized for the largest round; the ids are i64.
            unsafe { ll.dispatch_packed_raw(s, xp, i64p, mine.tokens, &o64) }.unwrap();
        } else if round % 2 == 0 {
            // SAFETY: every buffer is sized for the largest round.
            unsafe { ll.dispatch_packed_raw(s, xp, ip, mine.tokens, &o) }.unwrap();
        } else {
            // Two dispatches in flight: the first's receive half must pair with its own send
            // (its ticket: epoch and call-check ordinal), not with the empty one sent after it;
            // round 1 receives in send order, round 3 the other way round.
            // SAFETY: as above.
            unsafe { ll.dispatch_packed_send_raw(s, xp, ip, mine.tokens, &o) }.unwrap();
            if ll.spans_nodes() {
                // Across nodes one dispatch is in flight at a time (a send's staging half is
                // reused two sends later, and only a receive in between proves the NIC read
                // it): a second send is refused by name before it launches, and so is a
                // receive half in bf16 for this FP8 send.
                // SAFETY: as above; a refused call launches nothing.
                let e = unsafe { ll.dispatch_packed_send_raw(s, xp, ip, 0, &empty) }.unwrap_err();
                assert!(
                    e.to_string().contains("one dispatch is in flight"),
                    "rank {me}: {e}"
                );
                // SAFETY: as above; a refused call launches nothing.
                let wrong = unsafe { ll.dispatch_packed_recv_raw(s, &outputs) };
                assert!(
                    matches!(&wrong, Err(doorbell::Error::InvalidArgument { .. })),
                    "rank {me}: bf16 outputs for an FP8 send: {wrong:?}"
                );
                // SAFETY: as above.
                unsafe { ll.dispatch_packed_recv_raw(s, &o) }.unwrap();
            }
        }
        if round % 2 == 1 && !ll.spans_nodes() {
            // SAFETY: as above; no token is read.
            unsafe { ll.dispatch_packed_send_raw(s, xp, ip, 0, &empty) }.unwrap();
            htod(op, &[0u8; 16]);
            // FP8 rows are cast by the send half: a receive half given bf16 outputs for that
            // send is refused before it launches (it would read e4m3 bytes as bf16).
            // SAFETY: as above; a refused call launches nothing.
            let wrong = unsafe { ll.dispatch_packed_recv_raw(s, &outputs) };
            assert!(
                matches!(&wrong, Err(doorbell::Error::InvalidArgument { .. })),
                "rank {me}: bf16 outputs for an FP8 send: {wrong:?}"
            );
            if round == 1 {
                // SAFETY: as above.
                unsafe { ll.dispatch_packed_recv_raw(s, &o) }.unwrap();
                // SAFETY: as above.
                unsafe { ll.dispatch_packed_recv_raw(s, &empty) }.unwrap();
            } else {
                // SAFETY: as above.
                unsafe { ll.dispatch_packed_recv_raw(s, &empty) }.unwrap();
                // SAFETY: as above.
                unsafe { ll.dispatch_packed_recv_raw(s, &o) }.unwrap();
            }
            let none: Vec<i32> = words(
                &dtoh(p(count2.device_ptr(s).0), local * 4),
                |b: &[u8; 4]| i32::from_le_bytes(*b),
            );
            assert_eq!(
                none,
                vec![0; local],
                "rank {me}: the empty dispatch in flight"
            );
        }
        let what = format!("round {round} (fp8 {fp8}, round_scale {round_scale}, ue8m0 {ue8m0})");
        let all: Vec<Routing> = (0..world).map(|r| ll_routing(r, round, experts)).collect();
        let counts: Vec<i32> = words(&dtoh(countp, local * 4), |b: &[u8; 4]| {
            i32::from_le_bytes(*b)
        });
        let ranges: Vec<i64> = words(&dtoh(rangep, local * world * 8), |b: &[u8; 8]| {
            i64::from_le_bytes(*b)
        });
        let srcs: Vec<i32> = words(&dtoh(srcp, local * cap * 4), |b: &[u8; 4]| {
            i32::from_le_bytes(*b)
        });
        let row_bytes = if fp8 { H } else { 2 * H };
        let rows = dtoh(pxp, local * cap * row_bytes);
        let scales = dtoh(psp, local * (H / 128) * cap * 4);
        let scale_of = |le: usize, g: usize, pos: usize| -> f32 {
            if ue8m0 {
                let b = scales[((le * (H / 512) + g / 4) * cap + pos) * 4 + g % 4];
                f32::from_bits(u32::from(b) << 23)
            } else {
                let at = ((le * (H / 128) + g) * cap + pos) * 4;
                f32::from_le_bytes(scales[at..at + 4].try_into().unwrap())
            }
        };
        let mut ys = vec![0u16; local * cap * H];
        for le in 0..local {
            let e = (me * local + le) as i32;
            let mut begin = 0usize;
            for (from, routing) in all.iter().enumerate() {
                let mut want: Vec<i32> = (0..routing.tokens)
                    .filter(|&t| routing.idx[t * TOPK..(t + 1) * TOPK].contains(&e))
                    .map(|t| t as i32)
                    .collect();
                let n = want.len();
                assert_eq!(
                    ranges[le * world + from],
                    ((begin as i64) << 32) | n as i64,
                    "rank {me}, {what}: range of expert {le} from {from}"
                );
                let mut got = Vec::with_capacity(n);
                for i in 0..n {
                    let pos = begin + i;
                    let t = srcs[le * cap + pos] as usize;
                    got.push(t as i32);
                    let row = &rows[(le * cap + pos) * row_bytes..(le * cap + pos + 1) * row_bytes];
                    for g in 0..H / 128 {
                        let amax = (0..128)
                            .map(|j| x_value(from, t, g * 128 + j).to_f32().abs())
                            .fold(0f32, f32::max);
                        let scale = fp8_scale(amax, round_scale);
                        if fp8 {
                            assert_eq!(
                                scale_of(le, g, pos),
                                scale,
                                "rank {me}, {what}: scale {g} of expert {le} row {pos}"
                            );
                        }
                        for j in 0..128 {
                            let h = g * 128 + j;
                            let v = x_value(from, t, h).to_f32();
                            let got_v = if fp8 {
                                e4m3(row[h]) * scale
                            } else {
                                bf16::from_bits(u16::from_le_bytes([row[2 * h], row[2 * h + 1]]))
                                    .to_f32()
                            };
                            let tolerance = if fp8 {
                                v.abs() / 16.0 + scale / 512.0
                            } else {
                                0.0
                            };
                            assert!(
                                (got_v - v).abs() <= tolerance,
                                "rank {me}, {what}: expert {le} row {pos} (source {from} token {t}) \
                                 value {h}: {got_v}, sent {v}"
                            );
                            ys[(le * cap + pos) * H + h] =
                                bf16::from_f32(v * (le as f32 + 1.0)).to_bits();
                        }
                    }
                }
                got.sort_unstable();
                want.sort_unstable();
                assert_eq!(
                    got, want,
                    "rank {me}, {what}: tokens of expert {le} from {from}"
                );
                begin += n;
            }
            assert_eq!(
                counts[le], begin as i32,
                "rank {me}, {what}: rows of expert {le}"
            );
            stats_want[le] += begin as i32;
        }
        htod(yp, bytemuck::cast_slice(&ys));
        // The combine's weights, not the dispatch's (none travelled).
        let cw: Vec<f32> = (0..mine.tokens * TOPK)
            .map(|i| [1.0f32, 0.5, 2.0, 0.25][(i + round as usize) % 4])
            .collect();
        htod(wp, bytemuck::cast_slice(&cw));
        let handle = PackedHandle {
            src_info: srcp,
            layout_range: rangep,
        };
        if round == 2 {
            // SAFETY: as above; the ids are i64.
            unsafe { ll.combine_packed_ids_raw(s, yp, &handle, (i64p, true), wp, mine.tokens, op) }
                .unwrap();
        } else if round % 2 == 0 {
            // SAFETY: as above.
            unsafe { ll.combine_packed_raw(s, yp, &handle, ip, wp, mine.tokens, op) }.unwrap();
        } else if ll.spans_nodes() {
            // Across nodes one combine is in flight at a time: a second send half is refused by
            // name before it launches; the halves run apart.
            let handle2 = PackedHandle {
                src_info: p(src2.device_ptr(s).0),
                layout_range: p(range2.device_ptr(s).0),
            };
            // SAFETY: as above.
            unsafe { ll.combine_packed_send_raw(s, yp, &handle, tk + 32) }.unwrap();
            // SAFETY: as above; a refused call launches nothing.
            let e = unsafe { ll.combine_packed_send_raw(s, yp, &handle2, tk + 48) }.unwrap_err();
            assert!(
                e.to_string().contains("one combine is in flight"),
                "rank {me}: {e}"
            );
            // SAFETY: as above.
            unsafe { ll.combine_packed_recv_raw(s, ip, wp, mine.tokens, op, tk + 32) }.unwrap();
        } else {
            // Two combines in flight (the second of the empty dispatch), received in send order
            // (round 1) or the other way round (round 3).
            let handle2 = PackedHandle {
                src_info: p(src2.device_ptr(s).0),
                layout_range: p(range2.device_ptr(s).0),
            };
            // SAFETY: as above.
            unsafe { ll.combine_packed_send_raw(s, yp, &handle, tk + 32) }.unwrap();
            // SAFETY: as above; the empty dispatch's handle names no row.
            unsafe { ll.combine_packed_send_raw(s, yp, &handle2, tk + 48) }.unwrap();
            // A receive half told log rows for a send that wrote bf16 is refused by name
            // before it launches (it would decode the rows wrongly).
            let log = PackedCombineOptions::new().with_logfmt(true);
            // SAFETY: as above; a refused call launches nothing.
            let e = unsafe {
                ll.combine_packed_recv_with_raw(s, (ip, false), wp, mine.tokens, op, tk + 32, &log)
            }
            .unwrap_err();
            assert!(e.to_string().contains("wrote bf16 rows"), "rank {me}: {e}");
            let mine_first = round == 1;
            if mine_first {
                // SAFETY: as above.
                unsafe { ll.combine_packed_recv_raw(s, ip, wp, mine.tokens, op, tk + 32) }.unwrap();
            }
            // SAFETY: as above; no token is written.
            unsafe { ll.combine_packed_recv_raw(s, ip, wp, 0, op, tk + 48) }.unwrap();
            if !mine_first {
                // SAFETY: as above.
                unsafe { ll.combine_packed_recv_raw(s, ip, wp, mine.tokens, op, tk + 32) }.unwrap();
            }
        }
        let got: Vec<bf16> = words(&dtoh(op, mine.tokens * H * 2), |b: &[u8; 2]| {
            bf16::from_bits(u16::from_le_bytes(*b))
        });
        for t in 0..mine.tokens {
            for h in 0..H {
                let mut acc = 0f32;
                for k in 0..TOPK {
                    let e = mine.idx[t * TOPK + k];
                    if e < 0 {
                        continue;
                    }
                    let row = bf16::from_f32(
                        x_value(me, t, h).to_f32() * ((e as usize % local) as f32 + 1.0),
                    );
                    acc = cw[t * TOPK + k].mul_add(row.to_f32(), acc);
                }
                assert_eq!(
                    got[t * H + h],
                    bf16::from_f32(acc),
                    "rank {me}, {what}: combined token {t} value {h}"
                );
            }
        }
        if round < 2 {
            let scale_bytes = |le: usize, pos: usize| -> Vec<u8> {
                if !fp8 {
                    return Vec::new();
                }
                (0..H / 128)
                    .flat_map(|g| scale_of(le, g, pos).to_le_bytes())
                    .collect()
            };
            snaps.push((
                canonical(
                    &counts,
                    &ranges,
                    &srcs,
                    &rows,
                    row_bytes,
                    cap,
                    world,
                    scale_bytes,
                ),
                got.iter().map(|v| v.to_bits()).collect(),
            ));
        }
    }
    // The typed calls (sizes from the slices, outputs owned by PackedBuffers) on rounds 0 and 1's
    // inputs give what the raw calls gave: the same rows, scales and source tokens in each
    // (expert, source) range (the order inside a range is the senders' race, so compared
    // sorted), the same counts and ranges, and the same combined rows.
    {
        use doorbell::collectives::moe::PackedFormat;
        let formats = [
            PackedFormat::Bf16,
            PackedFormat::Fp8 {
                round_scale: false,
                ue8m0: false,
            },
        ];
        let mut out = out;
        for (round, (want, combined)) in snaps.iter().enumerate() {
            let mut bufs = ll.packed_buffers(s, formats[round]).unwrap();
            let mine = ll_routing(me, round as u64, experts);
            let t = mine.tokens;
            let xs: Vec<u16> = (0..t * H)
                .map(|i| x_value(me, i / H, i % H).to_bits())
                .collect();
            htod(xp, bytemuck::cast_slice(&xs));
            htod(ip, bytemuck::cast_slice(&mine.idx));
            ll.dispatch_packed(
                s,
                &x.slice(..t * H),
                &idx.slice(..t * TOPK),
                &mut bufs,
                None,
            )
            .unwrap();
            let i32s = |b: &[u8; 4]| i32::from_le_bytes(*b);
            let counts: Vec<i32> = words(&dtoh(bufs.count().device_ptr(s).0, local * 4), i32s);
            let fp8 = round == 1;
            let row_bytes = if fp8 { H } else { 2 * H };
            let ranges: Vec<i64> = words(
                &dtoh(bufs.layout_range().device_ptr(s).0, local * world * 8),
                |b: &[u8; 8]| i64::from_le_bytes(*b),
            );
            let srcs: Vec<i32> = words(
                &dtoh(bufs.src_info().device_ptr(s).0, local * cap * 4),
                i32s,
            );
            let rows = dtoh(bufs.x().device_ptr(s).0, local * cap * row_bytes);
            let scales = match bufs.scales() {
                Some(sc) => dtoh(sc.device_ptr(s).0, local * (H / 128) * cap * 4),
                None => Vec::new(),
            };
            let scale_bytes = |le: usize, pos: usize| -> Vec<u8> {
                (0..if fp8 { H / 128 } else { 0 })
                    .flat_map(|g| {
                        let at = ((le * (H / 128) + g) * cap + pos) * 4;
                        scales[at..at + 4].to_vec()
                    })
                    .collect()
            };
            let got = canonical(
                &counts,
                &ranges,
                &srcs,
                &rows,
                row_bytes,
                cap,
                world,
                scale_bytes,
            );
            assert!(
                got == *want,
                "rank {me}: the typed dispatch of round {round} differs from the raw one"
            );
            // The experts' outputs at this dispatch's own places.
            let mut ys = vec![0u16; local * cap * H];
            for le in 0..local {
                for from in 0..world {
                    let r = ranges[le * world + from];
                    let (begin, n) = ((r >> 32) as usize, (r & 0xffff_ffff) as usize);
                    for pos in begin..begin + n {
                        let tok = srcs[le * cap + pos] as usize;
                        for h in 0..H {
                            ys[(le * cap + pos) * H + h] =
                                bf16::from_f32(x_value(from, tok, h).to_f32() * (le as f32 + 1.0))
                                    .to_bits();
                        }
                    }
                }
            }
            htod(yp, bytemuck::cast_slice(&ys));
            let cw: Vec<f32> = (0..t * TOPK)
                .map(|i| [1.0f32, 0.5, 2.0, 0.25][(i + round) % 4])
                .collect();
            htod(wp, bytemuck::cast_slice(&cw));
            let mut o = out.slice_mut(..t * H);
            ll.combine_packed(
                s,
                &y,
                &bufs,
                &idx.slice(..t * TOPK),
                &w.slice(..t * TOPK),
                &mut o,
            )
            .unwrap();
            let back: Vec<u16> = words(&dtoh(op, t * H * 2), |b: &[u8; 2]| u16::from_le_bytes(*b));
            assert!(
                back == *combined,
                "rank {me}: the typed combine of round {round} differs from the raw one"
            );
        }
    }
    let got: Vec<i32> = words(&dtoh(statsp, local * 4), |b: &[u8; 4]| {
        i32::from_le_bytes(*b)
    });
    assert_eq!(
        got, stats_want,
        "rank {me}: the stats, added up over four dispatches"
    );
    comm.bootstrap().barrier().unwrap();
}
