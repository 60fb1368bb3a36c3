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

const _: () = assert!(std::mem::size_of::<WqeCase>() == 80, "WqeCase in ib.cu is 80 bytes");

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
