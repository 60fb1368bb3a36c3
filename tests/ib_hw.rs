//! The hardware path, on a real ConnectX NIC (`#[ignore = "needs a ConnectX NIC and a GPU"]`):
//! two RC queue pairs of one port connected to each other (loopback through the NIC), GPU memory
//! registered by dma-buf or nvidia-peermem, and doorbell's own posters driving the queues that
//! libmlx5 made: the CPU poster (RDMA WRITE, READ, fetch-add, and a bad key that must come back as
//! an error completion), then GPU threads posting with the GPU ringing the doorbell (IBGDA) and
//! with a host thread ringing (CPU-assisted).
//!
//! **Never run here** (no machine of this project has a NIC). The command, on a machine with a
//! ConnectX NIC, the nvidia driver and rdma-core (`docs/rdma.md`):
//!
//! ```text
//! cargo test --release --test ib_hw -- --ignored --test-threads=1
//! ```
//!
//! `DOORBELL_IB_DEVICE=mlx5_1` picks the device (default: the first mlx5 device with an active
//! port), `DOORBELL_IB_GID_INDEX` the GID (RoCE). Without a NIC every test fails saying why.

mod ib_puts;

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
use doorbell::device_api::WaitSite;
use doorbell::gpu::cuda::Gpu;
use doorbell::transport::ib::host_qp::HostQp;
use doorbell::transport::ib::hw::HwPort;
use doorbell::transport::ib::rc::{access, Mr};
use doorbell::transport::ib::verbs::Verbs;
use doorbell::transport::ib::wqe::Op;
use ib_puts::device_bytes;
use std::sync::Arc;
use std::time::{Duration, Instant};

fn port() -> HwPort {
    let verbs = Arc::new(Verbs::load().unwrap_or_else(|e| panic!("{e}")));
    let name = std::env::var("DOORBELL_IB_DEVICE").ok();
    let gid = std::env::var("DOORBELL_IB_GID_INDEX")
        .ok()
        .map(|s| s.parse().expect("DOORBELL_IB_GID_INDEX: a number"));
    HwPort::open(&verbs, name.as_deref(), gid).unwrap_or_else(|e| panic!("{e}"))
}

const ALL: u32 =
    access::LOCAL_WRITE | access::REMOTE_WRITE | access::REMOTE_READ | access::REMOTE_ATOMIC;

fn register(port: &HwPort, gpu: &Gpu, s: &Arc<CudaStream>, b: &CudaSlice<u8>) -> Mr {
    let (ptr, len) = (b.device_ptr(s).0, b.len());
    // SAFETY: the buffer outlives the registration (each test drops MRs first).
    unsafe { port.pd.register_gpu(gpu, ptr, len, ALL) }.unwrap_or_else(|e| panic!("{e}"))
}

fn wait_for(qp: &mut HostQp, index: u64) -> Result<(), String> {
    qp.ring();
    let start = Instant::now();
    loop {
        match qp.poll() {
            Ok(done) if done > index => return Ok(()),
            Ok(_) if start.elapsed() > Duration::from_secs(10) => {
                return Err(format!("no completion for WQE {index} in 10 s"))
            }
            Ok(_) => std::thread::yield_now(),
            Err(e) => return Err(e.to_string()),
        }
    }
}

/// The CPU poster (the proxy's) on a real QP: a 1 MiB WRITE between GPU buffers, a READ back,
/// a fetch-add whose old value lands in GPU memory, then a WRITE with a wrong remote key, which
/// the NIC must complete with an error (syndrome 0x13, remote access).
#[test]
#[ignore = "needs a ConnectX NIC and a GPU"]
fn cpu_posted_write_read_atomic_and_error_on_a_real_nic() {
    let port = port();
    let gpu = Gpu::open(0).expect("GPU 0");
    let s = gpu.new_stream().unwrap();
    let n = 1 << 20;
    let src = device_bytes(&s, n, |i| (i * 7 % 253) as u8);
    let dst = device_bytes(&s, n, |_| 0);
    let back = device_bytes(&s, n, |_| 0);
    let word = device_bytes(&s, 16, |_| 0);
    let (ms, md, mb, mw) = (
        register(&port, &gpu, &s, &src),
        register(&port, &gpu, &s, &dst),
        register(&port, &gpu, &s, &back),
        register(&port, &gpu, &s, &word),
    );
    let p = |b: &CudaSlice<u8>| b.device_ptr(&s).0;
    let (a, _b) = port.loopback_pair(8).unwrap();
    let mut qp = HostQp::on_hardware(a);
    let t = Duration::from_secs(10);
    let w = qp
        .post(
            &Op::Write {
                raddr: p(&dst),
                rkey: md.rkey(),
                laddr: p(&src),
                lkey: ms.lkey(),
                len: n as u32,
            },
            true,
            t,
        )
        .unwrap();
    wait_for(&mut qp, w).unwrap();
    assert_eq!(
        s.clone_dtoh(&dst).unwrap(),
        s.clone_dtoh(&src).unwrap(),
        "WRITE"
    );
    let r = qp
        .post(
            &Op::Read {
                raddr: p(&dst),
                rkey: md.rkey(),
                laddr: p(&back),
                lkey: mb.lkey(),
                len: n as u32,
            },
            true,
            t,
        )
        .unwrap();
    wait_for(&mut qp, r).unwrap();
    assert_eq!(
        s.clone_dtoh(&back).unwrap(),
        s.clone_dtoh(&src).unwrap(),
        "READ"
    );
    for k in 0..3u64 {
        let f = qp
            .post(
                &Op::FetchAdd {
                    raddr: p(&word),
                    rkey: mw.rkey(),
                    add: 5,
                    result: p(&word) + 8,
                    lkey: mw.lkey(),
                },
                true,
                t,
            )
            .unwrap();
        wait_for(&mut qp, f).unwrap();
        let got = s.clone_dtoh(&word).unwrap();
        let (now, old) = (
            u64::from_ne_bytes(got[..8].try_into().unwrap()),
            u64::from_ne_bytes(got[8..].try_into().unwrap()),
        );
        assert_eq!((now, old), (5 * (k + 1), 5 * k), "fetch-add {k}");
    }
    let bad = qp
        .post(
            &Op::Write {
                raddr: p(&dst),
                rkey: md.rkey() ^ 0x5a5a00,
                laddr: p(&src),
                lkey: ms.lkey(),
                len: 64,
            },
            true,
            t,
        )
        .unwrap();
    let err = wait_for(&mut qp, bad).expect_err("a WRITE with a wrong key completed");
    assert!(err.contains("syndrome 0x13"), "{err}");
    drop(qp);
    drop((ms, md, mb, mw));
}

fn gpu_posted(ibgda: bool) {
    let port = port();
    let gpu = Gpu::open(0).expect("GPU 0");
    let s = gpu.new_stream().unwrap();
    let case = ib_puts::Puts::new(&s);
    let mrs = case.buffers().map(|b| register(&port, &gpu, &s, b));
    let site = WaitSite {
        budget_ns: 20_000_000_000,
        rank: 0,
        peer: -1,
        ..Default::default()
    };
    let (a, _b) = port.loopback_pair(9).unwrap();
    let qp = a
        .map_for_gpu(&gpu, ibgda, site)
        .unwrap_or_else(|e| panic!("{e}"));
    // On mlx5 the lkey and rkey of one registration are equal.
    let keys = mrs.each_ref().map(|m| m.rkey());
    case.run(
        &gpu,
        &s,
        qp.handle(),
        keys,
        if ibgda { "IBGDA" } else { "CPU-assisted" },
    );
    drop(qp);
    drop(mrs);
}

/// GPU threads post WRITEs and fetch-adds to a real QP and ring its doorbell themselves (IBGDA):
/// needs the doorbell page mapped into the GPU (the test fails saying so where the driver refuses).
#[test]
#[ignore = "needs a ConnectX NIC and a GPU"]
fn gpu_posted_ibgda_on_a_real_nic() {
    gpu_posted(true);
}

/// The same with a host thread ringing the doorbell for the kernels (CPU-assisted).
#[test]
#[ignore = "needs a ConnectX NIC and a GPU"]
fn gpu_posted_cpu_assisted_on_a_real_nic() {
    gpu_posted(false);
}
