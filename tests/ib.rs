//! InfiniBand on the GPU (`#[ignore = "needs GPU"]`; run with `--ignored`): WQEs built by the
//! device API (`doorbell/ibgda.cuh`) equal, byte for byte, those `rdma::wqe` builds on the CPU
//! (which `tests/wqe_golden.rs` checks against rdma-core's `mlx5dv.h`): every opcode, inline
//! payloads of every length class, fence and completion flags, and indices placed so WQEs
//! straddle the ring's end and the 16-bit counter's wrap.

use bytemuck::{Pod, Zeroable};
use cudarc::driver::{DevicePtr, LaunchConfig, PushKernelArg};
use doorbell::host::cuda::Gpu;
use doorbell::rdma::wqe::{opcode, Op, SendQueue, CQ_UPDATE, FENCE, MAX_INLINE, SOLICITED, WQEBB};

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

/// Device memory of `n` bytes holding `fill(i)` at byte i.
fn device_bytes(
    s: &std::sync::Arc<cudarc::driver::CudaStream>,
    n: usize,
    fill: impl Fn(usize) -> u8,
) -> cudarc::driver::CudaSlice<u8> {
    let v: Vec<u8> = (0..n).map(fill).collect();
    s.clone_htod(&v).unwrap()
}

/// Many GPU threads post RDMA writes and fetch-adds to one QP of the emulated NIC, in both posting
/// modes: the data arrives, every fetch-add returns a distinct old value, the send queue wraps
/// ten times, and no protocol fault is seen. Also times small puts (the emulator's message rate).
#[test]
#[ignore = "needs GPU"]
fn gpu_posted_writes_and_atomics_through_the_emulated_nic() {
    use doorbell::device_api::WaitSite;
    use doorbell::rdma::emulator::{Delivery, EmulatedNic};
    use doorbell::rdma::gpu_qp::{CudaDma, GpuQp, Posting};
    use std::sync::Arc;
    let gpu = Gpu::open(0).expect("GPU 0");
    let s = gpu.new_stream().unwrap();
    let (blocks, threads, per_thread, chunk) = (4u32, 64u32, 4u32, 1024u32);
    let n_threads = (blocks * threads) as usize;
    let bytes = n_threads * (per_thread * chunk) as usize;
    let src = device_bytes(&s, bytes, |i| (i * 13 % 251) as u8);
    let site = WaitSite {
        budget_ns: 20_000_000_000,
        rank: 0,
        peer: -1,
        ..Default::default()
    };
    let f = gpu.function("ib", "ib_test_puts").unwrap();
    for (q, posting) in [Posting::Ibgda, Posting::CpuAssisted]
        .into_iter()
        .enumerate()
    {
        let dst = device_bytes(&s, bytes, |_| 0);
        let signal = device_bytes(&s, 8, |_| 0);
        let result = device_bytes(&s, 8 * n_threads, |_| 0xff);
        let p = |b: &cudarc::driver::CudaSlice<u8>| b.device_ptr(&s).0;
        let nic =
            Arc::new(EmulatedNic::start(Box::new(CudaDma::new(&gpu)), Delivery::Strict).unwrap());
        let ks = nic.register(p(&src), bytes as u64, false).unwrap();
        let kd = nic.register(p(&dst), bytes as u64, false).unwrap();
        let kg = nic.register(p(&signal), 8, true).unwrap();
        let kr = nic
            .register(p(&result), 8 * n_threads as u64, true)
            .unwrap();
        let qpn = 0x100 + q as u32;
        let qp = GpuQp::new(&gpu, &nic, qpn, 7, posting, site).unwrap();
        let h = qp.handle();
        let (ps, pd, pg, pr) = (p(&src), p(&dst), p(&signal), p(&result));
        let mut b = s.launch_builder(&f);
        b.arg(&h)
            .arg(&ps)
            .arg(&ks)
            .arg(&pd)
            .arg(&kd)
            .arg(&chunk)
            .arg(&per_thread)
            .arg(&pg)
            .arg(&kg)
            .arg(&pr)
            .arg(&kr);
        let start = std::time::Instant::now();
        // SAFETY: matches ib_test_puts; every address is inside a registered buffer.
        unsafe {
            b.launch(LaunchConfig {
                grid_dim: (blocks, 1, 1),
                block_dim: (threads, 1, 1),
                shared_mem_bytes: 0,
            })
        }
        .unwrap();
        s.synchronize().unwrap();
        let took = start.elapsed();
        assert_eq!(
            s.clone_dtoh(&dst).unwrap(),
            s.clone_dtoh(&src).unwrap(),
            "{posting:?}: data"
        );
        let sig = u64::from_ne_bytes(s.clone_dtoh(&signal).unwrap()[..8].try_into().unwrap());
        assert_eq!(sig, n_threads as u64, "{posting:?}: signal");
        let mut olds: Vec<u64> = s
            .clone_dtoh(&result)
            .unwrap()
            .chunks(8)
            .map(|c| u64::from_ne_bytes(c.try_into().unwrap()))
            .collect();
        olds.sort_unstable();
        assert_eq!(
            olds,
            (0..n_threads as u64).collect::<Vec<_>>(),
            "{posting:?}: fetch-add results"
        );
        assert!(nic.faults().is_empty(), "{posting:?}: {:?}", nic.faults());
        let wqes = u64::from(blocks * threads * (per_thread + 1));
        assert_eq!(nic.executed(qpn), wqes);
        eprintln!(
            "{posting:?}: {wqes} WQEs from {n_threads} GPU threads through a 128-WQEBB queue in {:.1} ms ({:.0} WQEs/s, emulator included)",
            took.as_secs_f64() * 1e3,
            wqes as f64 / took.as_secs_f64()
        );
        drop(qp);
    }
}

/// How many WQEs per second GPU threads post and complete through one QP when the NIC moves no
/// data (`NullDma`): the GPU side's rate plus the emulator's parsing and CQE writing. Printed, for
/// docs/performance.md; asserts only that every WQE completed.
#[test]
#[ignore = "needs GPU"]
fn gpu_posting_rate_through_the_emulated_nic() {
    use doorbell::device_api::WaitSite;
    use doorbell::rdma::emulator::{Delivery, EmulatedNic, NullDma};
    use doorbell::rdma::gpu_qp::{GpuQp, Posting};
    use std::sync::Arc;
    let gpu = Gpu::open(0).expect("GPU 0");
    let s = gpu.new_stream().unwrap();
    let buf = device_bytes(&s, 8192, |_| 0);
    let base = buf.device_ptr(&s).0;
    let site = WaitSite {
        budget_ns: 20_000_000_000,
        rank: 0,
        peer: -1,
        ..Default::default()
    };
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
