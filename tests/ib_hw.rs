//! The hardware path, on a real ConnectX NIC (`#[ignore = "needs a ConnectX NIC and a GPU"]`),
//! through the verbs boundary exactly as the communicator uses it (the rdma-core provider,
//! `conn::IbDevice`, `QueuePair`): two RC queue pairs of one port connected to each other
//! (loopback through the NIC), GPU memory registered by dma-buf or nvidia-peermem, and doorbell's
//! posters driving them: the proxy's two host posters (mlx5 WQEs on the rings libmlx5 made, and
//! `ibv_post_send`; RDMA WRITE, READ, fetch-add, and a bad key that must come back as an error
//! completion), then GPU threads posting with the GPU ringing the doorbell (IBGDA) and with a
//! host thread ringing (CPU-assisted).
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
use doorbell::transport::ib::boundary::provider::{access, Memory, Provider};
use doorbell::transport::ib::boundary::rdma_core::RdmaCore;
use doorbell::transport::ib::boundary::verbs::Verbs;
use doorbell::transport::ib::posting::conn::{ConnectedQp, IbDevice, Registration};
use doorbell::transport::ib::posting::gpu_qp::{MappedQp, Posting};
use doorbell::transport::ib::posting::poster::HostPoster;
use doorbell::transport::ib::posting::wqe::Op;
use ib_puts::device_bytes;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The device of `DOORBELL_IB_DEVICE`, else the first mlx5 device with an active port, opened
/// through the rdma-core provider on its first active port.
fn device() -> Arc<IbDevice> {
    let verbs = Arc::new(Verbs::load().unwrap_or_else(|e| panic!("{e}")));
    let nics = verbs.devices().unwrap_or_else(|e| panic!("{e}"));
    let want = std::env::var("DOORBELL_IB_DEVICE").ok();
    let nic = nics
        .iter()
        .filter(|n| n.is_mlx5())
        .find(|n| want.as_deref().is_none_or(|w| n.name == w) && n.ports.iter().any(|p| p.active()))
        .unwrap_or_else(|| {
            panic!("no mlx5 device with an active port (DOORBELL_IB_DEVICE={want:?})")
        });
    let port = nic
        .ports
        .iter()
        .find(|p| p.active())
        .expect("an active port")
        .num;
    let gid = std::env::var("DOORBELL_IB_GID_INDEX")
        .ok()
        .map(|s| s.parse().expect("DOORBELL_IB_GID_INDEX: a number"));
    let provider: Arc<dyn Provider> =
        Arc::new(RdmaCore::open(verbs.clone(), &nic.name).unwrap_or_else(|e| panic!("{e}")));
    IbDevice::open(provider, port, gid).unwrap_or_else(|e| panic!("{e}"))
}

const ALL: u32 =
    access::LOCAL_WRITE | access::REMOTE_WRITE | access::REMOTE_READ | access::REMOTE_ATOMIC;

fn register(
    dev: &Arc<IbDevice>,
    gpu: &Gpu,
    s: &Arc<CudaStream>,
    b: &CudaSlice<u8>,
) -> Registration {
    let (ptr, len) = (b.device_ptr(s).0, b.len());
    // SAFETY: the buffer outlives the registration (each test drops registrations first).
    unsafe { dev.register(ptr, len, ALL, Memory::Gpu(gpu)) }.unwrap_or_else(|e| panic!("{e}"))
}

/// Two QPs of `dev` connected to each other (loopback through the NIC).
fn loopback(dev: &Arc<IbDevice>, max_send_wr: u32) -> (ConnectedQp, ConnectedQp) {
    let (a, b) = (
        dev.create_qp(max_send_wr).unwrap_or_else(|e| panic!("{e}")),
        dev.create_qp(max_send_wr).unwrap_or_else(|e| panic!("{e}")),
    );
    let (ea, eb) = (a.endpoint(), b.endpoint());
    (
        a.connect(&eb).unwrap_or_else(|e| panic!("{e}")),
        b.connect(&ea).unwrap_or_else(|e| panic!("{e}")),
    )
}

/// Posts `op` and waits for its completion.
fn run(qp: &mut HostPoster, op: &Op) -> Result<(), String> {
    let at = qp.posted();
    qp.post(op, true, Duration::from_secs(10))
        .map_err(|e| e.to_string())?;
    qp.ring().map_err(|e| e.to_string())?;
    let start = Instant::now();
    loop {
        match qp.poll() {
            Ok(done) if done > at => return Ok(()),
            Ok(_) if start.elapsed() > Duration::from_secs(10) => {
                return Err(format!("no completion for position {at} in 10 s"))
            }
            Ok(_) => std::thread::yield_now(),
            Err(e) => return Err(e.to_string()),
        }
    }
}

/// A host poster on a real QP: a 1 MiB WRITE between GPU buffers, a READ back, fetch-adds whose
/// old values land in GPU memory, then a WRITE with a wrong remote key, which the NIC must
/// complete with a remote access error.
fn host_posted(verbs: bool) {
    let dev = device();
    let gpu = Gpu::open(0).expect("GPU 0");
    let s = gpu.new_stream().unwrap();
    let n = 1 << 20;
    let src = device_bytes(&s, n, |i| (i * 7 % 253) as u8);
    let dst = device_bytes(&s, n, |_| 0);
    let back = device_bytes(&s, n, |_| 0);
    let word = device_bytes(&s, 16, |_| 0);
    let (ms, md, mb, mw) = (
        register(&dev, &gpu, &s, &src),
        register(&dev, &gpu, &s, &dst),
        register(&dev, &gpu, &s, &back),
        register(&dev, &gpu, &s, &word),
    );
    let p = |b: &CudaSlice<u8>| b.device_ptr(&s).0;
    let (a, _b) = loopback(&dev, 64);
    let mut qp = if verbs {
        HostPoster::verbs(a, 64)
    } else {
        HostPoster::mlx5(a).unwrap_or_else(|e| panic!("{e}"))
    };
    run(
        &mut qp,
        &Op::Write {
            raddr: p(&dst),
            rkey: md.rkey(),
            laddr: p(&src),
            lkey: ms.lkey(),
            len: n as u32,
        },
    )
    .unwrap();
    assert_eq!(
        s.clone_dtoh(&dst).unwrap(),
        s.clone_dtoh(&src).unwrap(),
        "WRITE"
    );
    run(
        &mut qp,
        &Op::Read {
            raddr: p(&dst),
            rkey: md.rkey(),
            laddr: p(&back),
            lkey: mb.lkey(),
            len: n as u32,
        },
    )
    .unwrap();
    assert_eq!(
        s.clone_dtoh(&back).unwrap(),
        s.clone_dtoh(&src).unwrap(),
        "READ"
    );
    for k in 0..3u64 {
        run(
            &mut qp,
            &Op::FetchAdd {
                raddr: p(&word),
                rkey: mw.rkey(),
                add: 5,
                result: p(&word) + 8,
                lkey: mw.lkey(),
            },
        )
        .unwrap();
        let got = s.clone_dtoh(&word).unwrap();
        let (now, old) = (
            u64::from_ne_bytes(got[..8].try_into().unwrap()),
            u64::from_ne_bytes(got[8..].try_into().unwrap()),
        );
        assert_eq!((now, old), (5 * (k + 1), 5 * k), "fetch-add {k}");
    }
    let err = run(
        &mut qp,
        &Op::Write {
            raddr: p(&dst),
            rkey: md.rkey() ^ 0x5a5a00,
            laddr: p(&src),
            lkey: ms.lkey(),
            len: 64,
        },
    )
    .expect_err("a WRITE with a wrong key completed");
    assert!(
        err.contains("syndrome 0x13") || err.contains("remote access error"),
        "{err}"
    );
    drop(qp);
    drop((ms, md, mb, mw));
}

/// The proxy's mlx5 poster on a real QP.
#[test]
#[ignore = "needs a ConnectX NIC and a GPU"]
fn cpu_posted_write_read_atomic_and_error_on_a_real_nic() {
    host_posted(false);
}

/// The proxy's `ibv_post_send` poster on a real QP.
#[test]
#[ignore = "needs a ConnectX NIC and a GPU"]
fn ibv_post_send_write_read_atomic_and_error_on_a_real_nic() {
    host_posted(true);
}

fn gpu_posted(posting: Posting) {
    let dev = device();
    let gpu = Gpu::open(0).expect("GPU 0");
    let s = gpu.new_stream().unwrap();
    let case = ib_puts::Puts::new(&s);
    let mrs = case.buffers().map(|b| register(&dev, &gpu, &s, b));
    let site = WaitSite {
        budget_ns: 20_000_000_000,
        rank: 0,
        peer: -1,
        ..Default::default()
    };
    let (a, _b) = loopback(&dev, 128);
    let qp = MappedQp::new(&gpu, a, posting, site).unwrap_or_else(|e| panic!("{e}"));
    // On mlx5 the lkey and rkey of one registration are equal.
    let keys = mrs.each_ref().map(|m| m.rkey());
    case.run(
        &gpu,
        &s,
        qp.handle(),
        keys,
        if posting == Posting::Ibgda {
            "IBGDA"
        } else {
            "CPU-assisted"
        },
    );
    drop(qp);
    drop(mrs);
}

/// GPU threads post WRITEs and fetch-adds to a real QP and ring its doorbell themselves (IBGDA):
/// needs the doorbell page mapped into the GPU (the test fails saying so where the driver refuses).
#[test]
#[ignore = "needs a ConnectX NIC and a GPU"]
fn gpu_posted_ibgda_on_a_real_nic() {
    gpu_posted(Posting::Ibgda);
}

/// The same with a host thread ringing the doorbell for the kernels (CPU-assisted).
#[test]
#[ignore = "needs a ConnectX NIC and a GPU"]
fn gpu_posted_cpu_assisted_on_a_real_nic() {
    gpu_posted(Posting::CpuAssisted);
}
