//! InfiniBand on the GPU (`#[ignore = "needs GPU"]`; run with `--ignored`): WQEs built by the
//! device API (`doorbell/ib/ibgda.cuh`) equal, byte for byte, those `rdma::wqe` builds on the CPU
//! (which `tests/wqe_golden.rs` checks against rdma-core's `mlx5dv.h`): every opcode, inline
//! payloads of every length class, fence and completion flags, and indices placed so WQEs
//! straddle the ring's end and the 16-bit counter's wrap. GPU threads posting through the emulated
//! NIC in one process (both posting modes, and the posting rate), and between ranks: each rank's
//! kernel writes into its right neighbour's GPU memory and signals it with a fetch-add, the
//! emulated NIC of each rank reaching the neighbour's memory by the address and key that rank
//! registered (as a NIC would), in strict and in relaxed delivery (where the writers must READ
//! before signalling).

mod common;
mod ib_puts;

use bytemuck::{Pod, Zeroable};
use common::{count_wrong, fill, rank_counts, rank_main, run_case};
use cudarc::driver::{DevicePtr, LaunchConfig, PushKernelArg};
use doorbell::gpu::cuda::Gpu;
use doorbell::transport::ib::posting::wqe::{
    opcode, Op, SendQueue, CQ_UPDATE, FENCE, MAX_INLINE, SOLICITED, WQEBB,
};
use ib_puts::device_bytes;

/// Mirror of `WqeCase` in `cuda/kernels/ib.cu`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Pod, Zeroable)]
struct WqeCase {
    opcode: u32,
    fm_ce_se: u32,
    idx: u64,
    qpn: u32,
    rkey: u32,
    raddr: u64,
    laddr: u64,
    lkey: u32,
    len: u32,
    swap_add: u64,
    compare: u64,
    imm: u32,
    inline_len: u32,
    inline_off: u64,
}

const _: () = assert!(
    std::mem::size_of::<WqeCase>() == 80,
    "WqeCase in ib.cu is 80 bytes"
);

const DEPTH_LOG2: u32 = 3; // 8 WQEBBs: inline WQEs of up to 4 WQEBBs straddle the end

/// A WQE as the CPU builds it: the op, its index, QPN and flags.
type CpuCase = (Op, u64, u32, u8);

/// The cases, each as the CPU's Op and the kernel's description, and the inline payloads.
fn cases() -> (Vec<CpuCase>, Vec<WqeCase>, Vec<u8>) {
    let mut ops = Vec::new();
    let mut payloads = Vec::new();
    let idxs = [0u64, 5, 7, 6, 65535, 65534, 65536 + 7, (1 << 40) + 3];
    let flags = [0u8, CQ_UPDATE, CQ_UPDATE | FENCE, SOLICITED | CQ_UPDATE];
    let mut n = 0u64;
    let mut next = || {
        n += 1;
        n
    };
    for (i, &idx) in idxs.iter().enumerate() {
        let fm = flags[i % flags.len()];
        let qpn = 0x00ab_cd00 | i as u32;
        let x = next();
        let (raddr, laddr) = (
            0x7f00_1234_5678_0000 + x * 0x1_0001,
            0x0000_7fff_0000_1000 + x * 8,
        );
        let (rkey, lkey, len) = (
            0x1122_3300 + x as u32,
            0x9988_7700 + x as u32,
            4096 * x as u32 + 3,
        );
        ops.push((
            Op::Write {
                raddr,
                rkey,
                laddr,
                lkey,
                len,
            },
            idx,
            qpn,
            fm,
        ));
        ops.push((
            Op::WriteImm {
                raddr,
                rkey,
                laddr,
                lkey,
                len,
                imm: 0xdead_beef ^ x as u32,
            },
            idx,
            qpn,
            fm,
        ));
        ops.push((
            Op::Read {
                raddr,
                rkey,
                laddr,
                lkey,
                len,
            },
            idx,
            qpn,
            fm,
        ));
        ops.push((
            Op::FetchAdd {
                raddr,
                rkey,
                add: 0x0102_0304_0506_0708 * x,
                result: laddr,
                lkey,
            },
            idx,
            qpn,
            fm,
        ));
        ops.push((
            Op::CompareSwap {
                raddr,
                rkey,
                compare: 0xfeed_f00d_0000_0000 + x,
                swap: !x,
                result: laddr,
                lkey,
            },
            idx,
            qpn,
            fm,
        ));
        ops.push((Op::Nop, idx, qpn, fm));
        for len in [0usize, 1, 12, 13, 28, 29, 44, 45, 100, 173, MAX_INLINE] {
            let payload: Vec<u8> = (0..len).map(|b| (b as u64 * 31 + x) as u8).collect();
            ops.push((
                Op::WriteInline {
                    raddr,
                    rkey,
                    payload,
                },
                idx,
                qpn,
                fm,
            ));
        }
    }
    let descs = ops
        .iter()
        .map(|(op, idx, qpn, fm)| {
            let mut c = WqeCase::zeroed();
            c.idx = *idx;
            c.qpn = *qpn;
            c.fm_ce_se = u32::from(*fm);
            c.inline_off = u64::MAX;
            match op {
                Op::Write {
                    raddr,
                    rkey,
                    laddr,
                    lkey,
                    len,
                }
                | Op::Read {
                    raddr,
                    rkey,
                    laddr,
                    lkey,
                    len,
                } => {
                    c.opcode = u32::from(if matches!(op, Op::Write { .. }) {
                        opcode::RDMA_WRITE
                    } else {
                        opcode::RDMA_READ
                    });
                    (c.raddr, c.rkey, c.laddr, c.lkey, c.len) =
                        (*raddr, *rkey, *laddr, *lkey, *len);
                }
                Op::WriteImm {
                    raddr,
                    rkey,
                    laddr,
                    lkey,
                    len,
                    imm,
                } => {
                    c.opcode = u32::from(opcode::RDMA_WRITE_IMM);
                    (c.raddr, c.rkey, c.laddr, c.lkey, c.len, c.imm) =
                        (*raddr, *rkey, *laddr, *lkey, *len, *imm);
                }
                Op::FetchAdd {
                    raddr,
                    rkey,
                    add,
                    result,
                    lkey,
                } => {
                    c.opcode = u32::from(opcode::ATOMIC_FA);
                    (c.raddr, c.rkey, c.swap_add, c.laddr, c.lkey) =
                        (*raddr, *rkey, *add, *result, *lkey);
                }
                Op::CompareSwap {
                    raddr,
                    rkey,
                    compare,
                    swap,
                    result,
                    lkey,
                } => {
                    c.opcode = u32::from(opcode::ATOMIC_CS);
                    (c.raddr, c.rkey, c.compare, c.swap_add, c.laddr, c.lkey) =
                        (*raddr, *rkey, *compare, *swap, *result, *lkey);
                }
                Op::WriteInline {
                    raddr,
                    rkey,
                    payload,
                } => {
                    c.opcode = u32::from(opcode::RDMA_WRITE);
                    (c.raddr, c.rkey, c.inline_len, c.inline_off) =
                        (*raddr, *rkey, payload.len() as u32, payloads.len() as u64);
                    payloads.extend_from_slice(payload);
                }
                Op::Nop => c.opcode = u32::from(opcode::NOP),
            }
            c
        })
        .collect();
    payloads.push(0);
    (ops, descs, payloads)
}

#[test]
#[ignore = "needs GPU"]
fn gpu_built_wqes_equal_the_cpu_builders() {
    let gpu = Gpu::open(0).expect("GPU 0");
    let s = gpu.new_stream().unwrap();
    let (ops, descs, payloads) = cases();
    let ring = WQEBB << DEPTH_LOG2;
    let d_cases = s
        .clone_htod(bytemuck::cast_slice::<WqeCase, u8>(&descs))
        .unwrap();
    let d_payloads = s.clone_htod(&payloads).unwrap();
    let d_rings = s.alloc_zeros::<u8>(ring * descs.len()).unwrap();
    let f = gpu.function("ib", "ib_test_build_wqes").unwrap();
    let (n, depth) = (descs.len() as u32, DEPTH_LOG2);
    let (pc, pr, pp) = (
        d_cases.device_ptr(&s).0,
        d_rings.device_ptr(&s).0,
        d_payloads.device_ptr(&s).0,
    );
    let mut b = s.launch_builder(&f);
    b.arg(&pc).arg(&n).arg(&pr).arg(&depth).arg(&pp);
    // SAFETY: matches ib_test_build_wqes; buffers sized for n cases.
    unsafe {
        b.launch(LaunchConfig {
            grid_dim: (n.div_ceil(128), 1, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        })
    }
    .unwrap();
    let got = s.clone_dtoh(&d_rings).unwrap();
    for (i, (op, idx, qpn, fm)) in ops.iter().enumerate() {
        let mut want = vec![0u8; ring];
        SendQueue::new(&mut want)
            .unwrap()
            .post(*idx, *qpn, op, *fm)
            .unwrap();
        assert_eq!(
            &got[i * ring..(i + 1) * ring],
            &want[..],
            "case {i}: {op:?} at index {idx}, flags {fm:#x}"
        );
    }
    eprintln!("{} WQEs built on the GPU equal the CPU's", ops.len());
}

/// Many GPU threads post RDMA writes and fetch-adds to one QP of the emulated NIC, in both posting
/// modes: the data arrives, every fetch-add returns a distinct old value, the send queue wraps
/// ten times, and no protocol fault is seen. Also times small puts (the emulator's message rate).
#[test]
#[ignore = "needs GPU"]
fn gpu_posted_writes_and_atomics_through_the_emulated_nic() {
    use doorbell::device_api::WaitSite;
    use doorbell::transport::ib::emulated::nic::{Delivery, EmulatedNic};
    use doorbell::transport::ib::posting::gpu_qp::{CudaDma, GpuQp, Posting, RingPlacement};
    use std::sync::Arc;
    let gpu = Gpu::open(0).expect("GPU 0");
    let s = gpu.new_stream().unwrap();
    let site = WaitSite {
        budget_ns: 20_000_000_000,
        rank: 0,
        peer: -1,
        ..Default::default()
    };
    let cases = [
        (Posting::Ibgda, RingPlacement::Host),
        (Posting::CpuAssisted, RingPlacement::Host),
        (Posting::Ibgda, RingPlacement::Gpu),
        (Posting::CpuAssisted, RingPlacement::Gpu),
    ];
    for (q, (posting, placement)) in cases.into_iter().enumerate() {
        let case = ib_puts::Puts::new(&s);
        let nic =
            Arc::new(EmulatedNic::start(Box::new(CudaDma::new(&gpu)), Delivery::Strict).unwrap());
        // Data regions registered relaxed-capable, the signal and the results strict.
        let (bufs, strict) = (case.buffers(), [false, false, true, true]);
        let keys: [u32; 4] = std::array::from_fn(|i| {
            nic.register(bufs[i].device_ptr(&s).0, bufs[i].len() as u64, strict[i])
                .unwrap()
        });
        let qpn = 0x100 + q as u32;
        let qp = GpuQp::placed(&gpu, &nic, qpn, 7, posting, site, placement).unwrap();
        let what = format!("{posting:?}, rings in {placement:?} memory");
        let took = case.run(&gpu, &s, qp.handle(), keys, &what);
        assert!(nic.faults().is_empty(), "{what}: {:?}", nic.faults());
        let wqes = ib_puts::wqes();
        assert_eq!(nic.executed(qpn), wqes, "{what}");
        eprintln!(
            "{what}: {wqes} WQEs from {} GPU threads through a 128-WQEBB queue in {:.1} ms ({:.0} WQEs/s, emulator included)",
            ib_puts::threads(),
            took.as_secs_f64() * 1e3,
            wqes as f64 / took.as_secs_f64()
        );
        drop(qp);
    }
}

/// What the posting benchmarks through the emulated NIC's null data path share: GPU 0, a stream,
/// `bytes` of device memory to name in work requests, and a wait site with a 20 s budget.
fn null_path_bench(
    bytes: usize,
) -> (
    std::sync::Arc<Gpu>,
    std::sync::Arc<cudarc::driver::CudaStream>,
    cudarc::driver::CudaSlice<u8>,
    doorbell::device_api::WaitSite,
) {
    let gpu = Gpu::open(0).expect("GPU 0");
    let s = gpu.new_stream().unwrap();
    let buf = device_bytes(&s, bytes, |_| 0);
    let site = doorbell::device_api::WaitSite {
        budget_ns: 20_000_000_000,
        rank: 0,
        peer: -1,
        ..Default::default()
    };
    (gpu, s, buf, site)
}

/// How many WQEs per second GPU threads post and complete through one QP when the NIC moves no
/// data (`NullDma`): the GPU side's rate plus the emulator's parsing and CQE writing. Printed, for
/// docs/performance.md; asserts only that every WQE completed.
#[test]
#[ignore = "needs GPU"]
fn gpu_posting_rate_through_the_emulated_nic() {
    use doorbell::transport::ib::emulated::nic::{Delivery, EmulatedNic, NullDma};
    use doorbell::transport::ib::posting::gpu_qp::{GpuQp, Posting};
    use std::sync::Arc;
    let (gpu, s, buf, site) = null_path_bench(8192);
    let base = buf.device_ptr(&s).0;
    let single = gpu.function("ib", "ib_test_rate").unwrap();
    let warp = gpu.function("ib", "ib_test_rate_warp").unwrap();
    for posting in [Posting::Ibgda, Posting::CpuAssisted] {
        for (threads, per_thread, warps) in [
            (1u32, 20_000u32, false),
            (32, 2_000, false),
            (256, 400, false),
            (32, 20_000, true),
            (256, 4_000, true),
        ] {
            let f = if warps { &warp } else { &single };
            let nic = Arc::new(EmulatedNic::start(Box::new(NullDma), Delivery::Strict).unwrap());
            let ks = nic.register(base, 4096, false).unwrap();
            let kd = nic.register(base + 4096, 4096, false).unwrap();
            let qp = GpuQp::new(&gpu, &nic, 0x200, 10, posting, site).unwrap();
            let h = qp.handle();
            let (src, dst) = (base, base + 4096);
            let mut b = s.launch_builder(f);
            b.arg(&h)
                .arg(&src)
                .arg(&ks)
                .arg(&dst)
                .arg(&kd)
                .arg(&per_thread);
            let start = std::time::Instant::now();
            // SAFETY: matches ib_test_rate and ib_test_rate_warp.
            unsafe {
                b.launch(LaunchConfig {
                    grid_dim: (threads.div_ceil(128), 1, 1),
                    block_dim: (threads.min(128), 1, 1),
                    shared_mem_bytes: 0,
                })
            }
            .unwrap();
            s.synchronize().unwrap();
            let took = start.elapsed().as_secs_f64();
            let wqes = u64::from(threads * per_thread);
            assert_eq!(nic.executed(0x200), wqes);
            assert!(nic.faults().is_empty(), "{:?}", nic.faults());
            eprintln!(
                "rate {posting:?}: {threads} threads x {per_thread} 8-byte puts{}: {wqes} WQEs in {:.1} ms = {:.2} M WQEs/s",
                if warps { " (put_warp)" } else { "" },
                took * 1e3,
                wqes as f64 / took / 1e6
            );
        }
    }
}

/// The GPU-side cost of a low-latency MoE dispatch across nodes (issue 16: at most 10 us for
/// 128 tokens x top-8): one warp per remote rank posts its rows as 7408-byte RDMA WRITEs
/// (`put_warp`), a count block, the READ that flushes them and a fetch-add flag (`post_warp`), on
/// a QP of its own, through the emulated NIC's null data path (`NullDma`). Rows per remote rank from `collectives::moe::plan`'s model
/// (`docs/performance.md`: 360 / 592 / 725 rows at 2 / 4 / 8 nodes of 8), rounded up to whole
/// warps. Printed: GPU time from the first warp's start to the last WQE posted, and to the last
/// completion (the emulator's one thread consumes them); asserts every WQE executed.
#[test]
#[ignore = "needs GPU"]
fn gpu_posting_cost_of_a_decode_dispatch_through_the_emulated_nic() {
    use doorbell::device_api::IbQpHandle;
    use doorbell::transport::ib::emulated::nic::{Delivery, EmulatedNic, NullDma};
    use doorbell::transport::ib::posting::gpu_qp::{GpuQp, Posting};
    use std::sync::Arc;
    let (gpu, s, buf, site) = null_path_bench(4096);
    let base = buf.device_ptr(&s).0;
    let f = gpu.function("ib", "ib_test_dispatch_post").unwrap();
    let row_bytes: u32 = 7168 + 56 * 4 + 16;
    for posting in [Posting::Ibgda, Posting::CpuAssisted] {
        for (nodes, model_rows) in [(2u32, 360u32), (4, 592), (8, 725)] {
            let remote = 8 * (nodes - 1);
            let rows = model_rows.div_ceil(remote).next_multiple_of(32);
            // NullDma touches no memory: the regions only need to cover the addresses.
            let nic = Arc::new(EmulatedNic::start(Box::new(NullDma), Delivery::Strict).unwrap());
            let span = u64::from(rows) * u64::from(row_bytes);
            let ks = nic.register(base, span, false).unwrap();
            let kd = nic.register(base + (1 << 40), span, true).unwrap();
            let qps: Vec<GpuQp> = (0..remote)
                .map(|q| GpuQp::new(&gpu, &nic, 0x300 + q, 10, posting, site).unwrap())
                .collect();
            let handles: Vec<IbQpHandle> = qps.iter().map(|q| q.handle()).collect();
            let dev = s
                .clone_htod(bytemuck::cast_slice::<IbQpHandle, u8>(&handles))
                .unwrap();
            let times = s.alloc_zeros::<u64>(3 * remote as usize).unwrap();
            let (src, dst) = (base, base + (1 << 40));
            let (hp, tp) = (dev.device_ptr(&s).0, times.device_ptr(&s).0);
            let count_bytes = 256u32 / nodes.max(1) * 4;
            let mut posted = Vec::new();
            let mut completed = Vec::new();
            for rep in 0..21 {
                let mut b = s.launch_builder(&f);
                b.arg(&hp)
                    .arg(&remote)
                    .arg(&src)
                    .arg(&ks)
                    .arg(&dst)
                    .arg(&kd)
                    .arg(&rows)
                    .arg(&row_bytes)
                    .arg(&count_bytes)
                    .arg(&src)
                    .arg(&ks)
                    .arg(&tp);
                // SAFETY: matches ib_test_dispatch_post; every address lies in a region of the
                // NIC, which moves no data.
                unsafe {
                    b.launch(LaunchConfig {
                        grid_dim: (remote.div_ceil(8), 1, 1),
                        block_dim: (256, 1, 1),
                        shared_mem_bytes: 0,
                    })
                }
                .unwrap();
                s.synchronize().unwrap();
                let t = s.clone_dtoh(&times).unwrap();
                let start = t.chunks(3).map(|c| c[0]).min().unwrap();
                let post = t.chunks(3).map(|c| c[1]).max().unwrap() - start;
                let done = t.chunks(3).map(|c| c[2]).max().unwrap() - start;
                if rep > 0 {
                    posted.push(post as f64 / 1e3);
                    completed.push(done as f64 / 1e3);
                }
            }
            let per_qp = u64::from(rows) + 3; // rows, count block, flushing READ, fetch-add
            for q in 0..remote {
                assert_eq!(nic.executed(0x300 + q), 21 * per_qp);
            }
            assert!(nic.faults().is_empty(), "{:?}", nic.faults());
            posted.sort_by(f64::total_cmp);
            completed.sort_by(f64::total_cmp);
            eprintln!(
                "dispatch posting {posting:?}: {nodes} nodes x 8, {remote} QPs x ({rows} rows + 3) = {} WQEs: \
                 posted in {:.1} us (median of 20; min {:.1}), completed in {:.1} us (min {:.1})",
                u64::from(remote) * per_qp,
                posted[10],
                posted[0],
                completed[10],
                completed[0]
            );
        }
    }
}

/// The rank side of the multi-rank cases (does nothing unless spawned by `run_case`).
#[test]
#[ignore = "needs GPU"]
fn gpu_rank() {
    rank_main(|case, comm, stream| match case {
        "ring" => ring(comm, stream, false),
        "ring_relaxed" => ring(comm, stream, true),
        "error_cqe" => error_cqe(comm, stream, false),
        "error_cqe_warp" => error_cqe(comm, stream, true),
        other => panic!("unknown case {other}"),
    });
}

#[test]
#[ignore = "needs GPU"]
fn gpu_initiated_rdma_between_ranks_over_the_emulated_nic() {
    for n in rank_counts() {
        run_case("ring", n, &[]);
        run_case("ring_relaxed", n, &[]);
    }
}

fn ring(
    comm: &doorbell::communicator::Communicator,
    s: &std::sync::Arc<cudarc::driver::CudaStream>,
    relaxed: bool,
) {
    use doorbell::transport::ib::emulated::nic::{Delivery, EmulatedNic};
    use doorbell::transport::ib::posting::gpu_qp::{CudaDma, GpuQp, Posting};
    use std::sync::Arc;
    let (me, n) = (comm.rank(), comm.world_size());
    let (right, left) = ((me + 1) % n, (me + n - 1) % n);
    let (threads, per_thread, chunk) = (128u32, 4u32, 512u32);
    let bytes = (threads * per_thread * chunk) as usize;
    let gpu = comm.gpu();
    let src = s.alloc_zeros::<u8>(bytes).unwrap();
    let scratch = s.alloc_zeros::<u8>(16 * threads as usize).unwrap();
    let dst = comm.alloc(bytes).unwrap();
    let signal = comm.alloc(4096).unwrap();
    let p = |b: &cudarc::driver::CudaSlice<u8>| b.device_ptr(s).0;
    let delivery = if relaxed {
        Delivery::Relaxed {
            max_delay: 64,
            seed: me as u64 + 1,
        }
    } else {
        Delivery::Strict
    };
    let nic =
        Arc::new(EmulatedNic::start_for_rank(Box::new(CudaDma::new(gpu)), delivery, me).unwrap());
    let ks = nic.register(p(&src), bytes as u64, false).unwrap();
    let kx = nic
        .register(p(&scratch), 16 * u64::from(threads), true)
        .unwrap();
    // What the left neighbour's NIC needs to reach my memory: my keys and my addresses.
    let kd = nic.register(dst.device_ptr(), bytes as u64, false).unwrap();
    let kg = nic.register(signal.device_ptr(), 8, true).unwrap();
    let mine: Vec<u8> = [
        u64::from(kd),
        u64::from(kg),
        dst.device_ptr(),
        signal.device_ptr(),
    ]
    .iter()
    .flat_map(|v| v.to_le_bytes())
    .collect();
    let all = comm.bootstrap().all_gather(&mine).unwrap();
    let word =
        |r: usize, i: usize| u64::from_le_bytes(all[r][8 * i..8 * i + 8].try_into().unwrap());
    let (kd_r, kg_r, dst_r, sig_r) = (
        word(right, 0) as u32,
        word(right, 1) as u32,
        word(right, 2),
        word(right, 3),
    );
    // The neighbour's memory mapped here (CUDA IPC), where this NIC writes it.
    let remote_dst = comm.exchange(&comm.register(&dst).unwrap()).unwrap();
    let remote_sig = comm.exchange(&comm.register(&signal).unwrap()).unwrap();
    if right != me {
        let (rd, rg) = (
            remote_dst[right].as_ref().unwrap(),
            remote_sig[right].as_ref().unwrap(),
        );
        nic.register_remote(kd_r, dst_r, bytes as u64, false, rd.device_ptr())
            .unwrap();
        nic.register_remote(kg_r, sig_r, 8, true, rg.device_ptr())
            .unwrap();
    }
    let posting = if me % 2 == 0 {
        Posting::Ibgda
    } else {
        Posting::CpuAssisted
    };
    let qp = GpuQp::new(
        gpu,
        &nic,
        (me as u32) << 8 | 1,
        8,
        posting,
        comm.diagnostics().site(right as i32, 0),
    )
    .unwrap();
    let h = qp.handle();
    let put = gpu.function("ib", "ib_test_ring").unwrap();
    let wait = gpu.function("ib", "ib_test_wait").unwrap();
    for round in 1..=3u32 {
        fill(
            comm,
            s,
            p(&src),
            0,
            bytes as u64,
            me as u32,
            right as u32,
            round,
        );
        comm.synchronize(s).unwrap();
        comm.bootstrap().barrier().unwrap();
        let (ps, px) = (p(&src), p(&scratch));
        let flush = u32::from(relaxed);
        let mut b = s.launch_builder(&put);
        b.arg(&h)
            .arg(&ps)
            .arg(&ks)
            .arg(&dst_r)
            .arg(&kd_r)
            .arg(&chunk)
            .arg(&per_thread)
            .arg(&sig_r)
            .arg(&kg_r)
            .arg(&px)
            .arg(&kx)
            .arg(&flush);
        // SAFETY: matches ib_test_ring; addresses lie in regions registered with the NIC.
        unsafe {
            b.launch(LaunchConfig {
                grid_dim: (1, 1, 1),
                block_dim: (threads, 1, 1),
                shared_mem_bytes: 0,
            })
        }
        .unwrap();
        let (sg, expected, site) = (
            signal.device_ptr(),
            u64::from(round * threads),
            comm.diagnostics().site(left as i32, 0),
        );
        let mut b = s.launch_builder(&wait);
        b.arg(&sg).arg(&expected).arg(&site);
        // SAFETY: matches ib_test_wait.
        unsafe {
            b.launch(LaunchConfig {
                grid_dim: (1, 1, 1),
                block_dim: (32, 1, 1),
                shared_mem_bytes: 0,
            })
        }
        .unwrap();
        comm.synchronize(s).unwrap();
        let wrong = count_wrong(
            comm,
            s,
            dst.device_ptr(),
            0,
            bytes as u64,
            left as u32,
            me as u32,
            round,
        );
        assert_eq!(
            wrong, 0,
            "rank {me}, round {round} ({posting:?}, relaxed {relaxed}): bytes from rank {left}"
        );
        comm.bootstrap().barrier().unwrap();
    }
    assert!(nic.faults().is_empty(), "rank {me}: {:?}", nic.faults());
    assert_eq!(
        nic.executed(h.qpn),
        3 * u64::from(threads) * (u64::from(per_thread) + 1 + u64::from(relaxed))
    );
    drop(qp);
}

/// A write with a key the NIC does not know: the NIC answers with an error CQE, the GPU poller
/// reports it like a failed wait (rank, the WQE's index, the mlx5 syndrome) and the host call
/// returns `Error::Timeout` with `WaitKind::IbError` instead of hanging.
#[test]
#[ignore = "needs GPU"]
fn an_error_completion_is_reported_not_hung() {
    run_case("error_cqe", 2, &[]);
}

/// The same with whole warps posting (put_warp) more than the send queue holds: lane 0's wait
/// for room meets the error CQE; the warp stays whole (no lane exits before a shuffle), posts
/// nothing more, and the call returns the report. Before, lane 0 exited inside the poll and its
/// warp shuffled from an exited lane.
#[test]
#[ignore = "needs GPU"]
fn an_error_completion_under_warp_posting_is_reported_not_hung() {
    run_case("error_cqe_warp", 2, &[]);
}

fn error_cqe(
    comm: &doorbell::communicator::Communicator,
    s: &std::sync::Arc<cudarc::driver::CudaStream>,
    warp: bool,
) {
    common::fault_on_purpose();
    use doorbell::transport::ib::emulated::nic::{Delivery, EmulatedNic};
    use doorbell::transport::ib::posting::gpu_qp::{CudaDma, GpuQp, Posting};
    use doorbell::{Error, WaitKind};
    use std::sync::Arc;
    if comm.rank() != 0 {
        return;
    }
    let gpu = comm.gpu();
    let (src, dst, res) = (
        s.alloc_zeros::<u8>(4096).unwrap(),
        s.alloc_zeros::<u8>(4096).unwrap(),
        s.alloc_zeros::<u8>(4096).unwrap(),
    );
    let p = |b: &cudarc::driver::CudaSlice<u8>| b.device_ptr(s).0;
    let nic = Arc::new(EmulatedNic::start(Box::new(CudaDma::new(gpu)), Delivery::Strict).unwrap());
    let ks = nic.register(p(&src), 4096, false).unwrap();
    let kd = nic.register(p(&dst), 4096, false).unwrap();
    let kr = nic.register(p(&res), 4096, true).unwrap();
    let qp = GpuQp::new(
        gpu,
        &nic,
        0x77,
        7,
        Posting::Ibgda,
        comm.diagnostics().site(-1, 0),
    )
    .unwrap();
    let h = qp.handle();
    let (ps, pd, pr, bad, chunk, per) = (p(&src), p(&dst), p(&res), kd ^ 0x4000, 64u32, 1u32);
    let f;
    let mut b;
    // 32 lanes x 64 WQEs: four times the 2^7-slot send queue, so lane 0 waits for room.
    let per_lane = 64u32;
    if warp {
        f = gpu.function("ib", "ib_test_rate_warp").unwrap();
        b = s.launch_builder(&f);
        b.arg(&h)
            .arg(&ps)
            .arg(&ks)
            .arg(&pd)
            .arg(&bad)
            .arg(&per_lane);
    } else {
        f = gpu.function("ib", "ib_test_puts").unwrap();
        b = s.launch_builder(&f);
        b.arg(&h)
            .arg(&ps)
            .arg(&ks)
            .arg(&pd)
            .arg(&bad)
            .arg(&chunk)
            .arg(&per)
            .arg(&pr)
            .arg(&kr)
            .arg(&pr)
            .arg(&kr);
    }
    // SAFETY: matches ib_test_puts / ib_test_rate_warp; the bad key is the point (the NIC
    // refuses it).
    unsafe {
        b.launch(LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (32, 1, 1),
            shared_mem_bytes: 0,
        })
    }
    .unwrap();
    let err = comm
        .synchronize(s)
        .expect_err("an error CQE must fail the kernel");
    eprintln!("reported: {err}");
    match err {
        Error::Timeout {
            rank, what, seen, ..
        } => {
            assert_eq!(rank, 0);
            assert_eq!(what, WaitKind::IbError);
            assert_eq!(
                seen,
                u64::from(doorbell::transport::ib::posting::cq::syndrome::REMOTE_ACCESS)
            );
        }
        other => panic!("expected Timeout with IbError, got {other:?}"),
    }
    // The context is gone after the trap: drop without further CUDA work.
    std::mem::forget(qp);
}
