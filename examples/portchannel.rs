//! PortChannel between two GPUs: FIFO push-to-proxy round trip, and put bandwidth through the
//! proxy's copy engine next to a host-issued copy-engine peer copy of the same bytes.
//!
//! ```text
//! cargo run --release --example portchannel
//! ```

use clap::Parser;
use cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT;
use cudarc::driver::{CudaStream, LaunchConfig, PushKernelArg};
use doorbell::communicator::Communicator;
use doorbell::job::launch::run_job;
use doorbell::{Error, Result};
use doorbell_bench::harness::cuda;
use std::sync::Arc;

#[derive(Parser, Debug)]
#[command(about = "PortChannel FIFO round trip and copy-engine put bandwidth between two ranks")]
struct Args {
    /// Ranks to spawn when no launcher started us (exactly two).
    #[arg(long, default_value_t = 2)]
    nranks: usize,
    /// FIFO round trips per measurement.
    #[arg(long, default_value_t = 10_000)]
    iters: u32,
    /// Largest put, MiB.
    #[arg(long, default_value_t = 1024)]
    max_mib: usize,
    /// Puts per bandwidth measurement.
    #[arg(long, default_value_t = 10)]
    reps: u32,
    /// Bytes per put trigger, MiB (0: the whole message in one trigger).
    #[arg(long, default_value_t = 0)]
    chunk_mib: usize,
}

fn main() {
    doorbell::init_logging();
    let args = Args::parse();
    run_job(
        "portchannel",
        Some(args.nranks),
        || Ok(2),
        || run(&args).map(|()| 0),
    )
}

fn one() -> LaunchConfig {
    LaunchConfig {
        grid_dim: (1, 1, 1),
        block_dim: (32, 1, 1),
        shared_mem_bytes: 0,
    }
}

fn run(args: &Args) -> Result<()> {
    let comm = Communicator::from_env()?;
    if comm.world_size() != 2 {
        return Err(Error::invalid(
            "--nranks",
            format!(
                "portchannel measures between exactly two ranks, not {}",
                comm.world_size()
            ),
        ));
    }
    let rank = comm.rank();
    let s = comm.gpu().new_stream()?;
    let buf = comm.alloc(args.max_mib << 20)?;
    let reg = comm.register(&buf)?;
    let remote = comm.exchange(&reg)?;
    let mut proxy = comm.proxy_builder(0)?;
    let chans = comm.port_channels(&mut proxy, &reg, &reg)?;
    let proxy = proxy.start()?;
    let result = measure(&comm, &s, args, &chans, &remote, &buf, rank);
    if let Some(f) = proxy.failure() {
        return Err(Error::invalid(
            "proxy",
            format!("{f} (the measurement said: {result:?})"),
        ));
    }
    result?;
    proxy.stop()
}

#[allow(clippy::too_many_arguments)]
fn measure(
    comm: &Communicator,
    s: &Arc<CudaStream>,
    args: &Args,
    chans: &doorbell::channel::port_channel::PortChannels,
    remote: &[Option<Arc<doorbell::transport::ipc::RemoteMemory>>],
    buf: &doorbell::gpu::memory::Buffer,
    rank: usize,
) -> Result<()> {
    let gpu = comm.gpu().clone();
    let max_bytes = args.max_mib << 20;
    let ch = chans
        .to(1 - rank)
        .ok_or_else(|| Error::invalid("channels", "no channel to the other rank"))?
        .device_handle();
    let roundtrip = gpu.function("port", "port_fifo_roundtrip")?;
    let storm = gpu.function("port", "port_signal_storm")?;
    let put = gpu.function("port", "port_put")?;
    let drain = gpu.function("port", "port_drain")?;
    comm.bootstrap().barrier()?;

    // FIFO round trip: rank 0's kernel pushes and waits for its proxy to take each trigger.
    if rank == 0 {
        let mut best = f64::MAX;
        for i in 0..6 {
            let n = if i == 0 { 100 } else { args.iters };
            let t = timed(comm, s, &|st| {
                let mut b = st.launch_builder(&roundtrip);
                b.arg(&ch).arg(&n);
                // SAFETY: matches port_fifo_roundtrip.
                comm.cuda_result(unsafe { b.launch(one()) }.map(|_| ()), "cuLaunchKernel")
            })?;
            if i > 0 {
                best = best.min(t / n as f64);
            }
        }
        println!(
            "# doorbell portchannel: rank 0 on GPU {} -> rank 1, transport {:?}",
            gpu.ordinal(),
            chans.to(1).map(|c| c.transport())
        );
        println!();
        println!("{:>28} {:>10}", "FIFO push -> proxy round trip", "us");
        println!(
            "{:>28} {:>10.3}",
            format!("({} iterations)", args.iters),
            best * 1e6
        );
        // Where the round trip goes, timed on the GPU (%globaltimer).
        let split = gpu.function("port", "port_fifo_roundtrip_split")?;
        for fenced in [1u32, 0] {
            let out: cudarc::driver::CudaSlice<u64> =
                s.alloc_zeros(2).map_err(cuda("cuMemAlloc"))?;
            {
                let (op, _g) = cudarc::driver::DevicePtr::device_ptr(&out, s);
                let mut b = s.launch_builder(&split);
                b.arg(&ch).arg(&args.iters).arg(&fenced).arg(&op);
                // SAFETY: matches port_fifo_roundtrip_split; `out` holds two u64.
                comm.cuda_result(unsafe { b.launch(one()) }.map(|_| ()), "cuLaunchKernel")?;
            }
            comm.synchronize(s)?;
            let v = s.clone_dtoh(&out).map_err(cuda("cuMemcpyDtoH"))?;
            let per = |ns: u64| ns as f64 / 1e3 / args.iters as f64;
            println!(
                "{:>28} {:>10.3}   push {:.3} + wait for the proxy {:.3}",
                if fenced == 1 {
                    "GPU-timed"
                } else {
                    "GPU-timed, push unfenced"
                },
                per(v[0]) + per(v[1]),
                per(v[0]),
                per(v[1]),
            );
        }
    }
    comm.bootstrap().barrier()?;

    // Signal rate: one pushing thread, every trigger a signal the peer counts.
    let signals = 20_000u32;
    comm.bootstrap().barrier()?;
    if rank == 0 {
        let t = timed(comm, s, &|st| {
            let mut b = st.launch_builder(&storm);
            b.arg(&ch).arg(&signals);
            // SAFETY: matches port_signal_storm.
            comm.cuda_result(
                unsafe {
                    b.launch(LaunchConfig {
                        grid_dim: (1, 1, 1),
                        block_dim: (1, 1, 1),
                        shared_mem_bytes: 0,
                    })
                }
                .map(|_| ()),
                "cuLaunchKernel",
            )?;
            let (ack, no) = (1u64, 0u32);
            let mut b = st.launch_builder(&drain);
            b.arg(&ch).arg(&ack).arg(&no);
            // SAFETY: matches port_drain.
            comm.cuda_result(unsafe { b.launch(one()) }.map(|_| ()), "cuLaunchKernel")
        })?;
        println!(
            "{:>28} {:>10.3}",
            "signals through the proxy, us each",
            t * 1e6 / signals as f64
        );
        println!();
        println!(
            "{:>12} {:>6} {:>14} {:>10} {:>16} {:>10} {:>7}",
            "bytes", "reps", "port put (us)", "GB/s", "host CE copy (us)", "GB/s", "ratio"
        );
    } else {
        let (count, ack) = (signals as u64, 1u32);
        let mut b = s.launch_builder(&drain);
        b.arg(&ch).arg(&count).arg(&ack);
        // SAFETY: matches port_drain.
        comm.cuda_result(unsafe { b.launch(one()) }.map(|_| ()), "cuLaunchKernel")?;
        comm.synchronize(s)?;
    }
    comm.bootstrap().barrier()?;

    // The host-issued copy-engine copy needs the peer's buffer mapped (CUDA IPC); over the
    // Ethernet transport there is none to compare with.
    let peer_buf = remote[1 - rank].as_ref().map(|m| m.device_ptr());
    let mut size = 1 << 20;
    while size <= max_bytes {
        let bytes = size as u64;
        let chunk = if args.chunk_mib == 0 {
            bytes
        } else {
            (args.chunk_mib as u64) << 20
        };
        let reps = args.reps.max(1);
        let mut best_port = f64::MAX;
        let mut best_ce = f64::MAX;
        for _ in 0..3 {
            comm.bootstrap().barrier()?;
            if rank == 0 {
                let t = timed(comm, s, &|st| {
                    let zero = 0u64;
                    for _ in 0..reps {
                        let mut b = st.launch_builder(&put);
                        b.arg(&ch).arg(&bytes).arg(&chunk).arg(&zero);
                        // SAFETY: matches port_put; `bytes` fits both buffers.
                        comm.cuda_result(unsafe { b.launch(one()) }.map(|_| ()), "cuLaunchKernel")?;
                    }
                    let (ack, no) = (1u64, 0u32);
                    let mut b = st.launch_builder(&drain);
                    b.arg(&ch).arg(&ack).arg(&no);
                    // SAFETY: matches port_drain.
                    comm.cuda_result(unsafe { b.launch(one()) }.map(|_| ()), "cuLaunchKernel")
                })?;
                best_port = best_port.min(t);
            } else {
                let (count, ack) = (reps as u64, 1u32);
                let mut b = s.launch_builder(&drain);
                b.arg(&ch).arg(&count).arg(&ack);
                // SAFETY: matches port_drain.
                comm.cuda_result(unsafe { b.launch(one()) }.map(|_| ()), "cuLaunchKernel")?;
                comm.synchronize(s)?;
            }
            comm.bootstrap().barrier()?;
            if let (0, Some(peer_buf)) = (rank, peer_buf) {
                let t = timed(comm, s, &|st| {
                    for _ in 0..reps {
                        // SAFETY: both ranges hold `bytes` (the peer's buffer is mapped here).
                        doorbell::gpu::cuda::driver_result("cuMemcpyDtoDAsync", unsafe {
                            cudarc::driver::sys::cuMemcpyDtoDAsync_v2(
                                peer_buf,
                                buf.device_ptr(),
                                size,
                                st.cu_stream(),
                            )
                        })?;
                    }
                    Ok(())
                })?;
                best_ce = best_ce.min(t);
            }
        }
        if rank == 0 {
            let (p, c) = (best_port / reps as f64, best_ce / reps as f64);
            let ce = |v: String| if peer_buf.is_some() { v } else { "-".into() };
            println!(
                "{:>12} {:>6} {:>14.2} {:>10.1} {:>16} {:>10} {:>7}",
                size,
                reps,
                p * 1e6,
                size as f64 / p / 1e9,
                ce(format!("{:.2}", c * 1e6)),
                ce(format!("{:.1}", size as f64 / c / 1e9)),
                ce(format!("{:.3}", c / p))
            );
        }
        size *= 4;
    }
    comm.bootstrap().barrier()?;
    Ok(())
}

/// Seconds for `op` on `s`, between two events.
fn timed(
    comm: &Communicator,
    s: &Arc<CudaStream>,
    op: &dyn Fn(&Arc<CudaStream>) -> Result<()>,
) -> Result<f64> {
    let start = s
        .record_event(Some(CU_EVENT_DEFAULT))
        .map_err(cuda("cuEventRecord"))?;
    op(s)?;
    let stop = s
        .record_event(Some(CU_EVENT_DEFAULT))
        .map_err(cuda("cuEventRecord"))?;
    comm.synchronize(s)?;
    Ok(start
        .elapsed_ms(&stop)
        .map_err(cuda("cuEventElapsedTime"))? as f64
        / 1e3)
}
