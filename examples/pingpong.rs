//! MemoryChannel between two GPUs: signal+wait round-trip latency and put bandwidth.
//!
//! Started without a launcher it spawns its two ranks itself (GPUs 0 and 1, or both on GPU 0
//! when only one is visible); under torchrun/srun/mpirun it runs as the rank it was given.
//!
//! ```text
//! cargo run --release --example pingpong
//! ```

use clap::Parser;
use cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT;
use cudarc::driver::{CudaFunction, CudaStream, LaunchConfig, PushKernelArg};
use doorbell::communicator::Communicator;
use doorbell::device_api::MemoryChannelHandle;
use doorbell::job::launch::run_job;
use doorbell::{Error, Result};
use doorbell_bench::harness::cuda;
use std::sync::Arc;

#[derive(Parser, Debug)]
#[command(about = "MemoryChannel signal/wait round trip and put bandwidth between two ranks")]
struct Args {
    /// Ranks to spawn when no launcher started us (the benchmark needs exactly two).
    #[arg(long, default_value_t = 2)]
    nranks: usize,
    /// Round trips per latency measurement.
    #[arg(long, default_value_t = 20_000)]
    iters: u32,
    /// Largest put, in MiB.
    #[arg(long, default_value_t = 1024)]
    max_mib: usize,
    /// Puts per bandwidth measurement.
    #[arg(long, default_value_t = 20)]
    reps: u32,
    /// Blocks for the put kernel (0: two per SM).
    #[arg(long, default_value_t = 0)]
    blocks: u32,
    /// Threads per block for the put kernel.
    #[arg(long, default_value_t = 1024)]
    threads: u32,
    /// Also measure puts through the TMA bulk-copy unit with this many blocks (0: skip; sm_90+).
    #[arg(long, default_value_t = 0)]
    bulk_blocks: u32,
    /// Chunk per bulk copy, KiB (two chunks of shared memory per block).
    #[arg(long, default_value_t = 16)]
    bulk_chunk_kib: u32,
}

fn main() {
    doorbell::init_logging();
    let args = Args::parse();
    run_job(
        "pingpong",
        Some(args.nranks),
        || Ok(2),
        || run(&args).map(|()| 0),
    )
}

struct Kernels {
    latency: CudaFunction,
    put: CudaFunction,
    put_bulk: CudaFunction,
    drain: CudaFunction,
}

/// How the puts of a bandwidth round are issued.
#[derive(Clone, Copy)]
enum PutKind {
    /// SM stores: blocks x threads.
    Threads { blocks: u32, threads: u32 },
    /// TMA bulk copies: one issuing thread per block, chunk bytes per copy.
    Bulk { blocks: u32, chunk: u32 },
}

impl PutKind {
    fn blocks(self) -> u32 {
        match self {
            PutKind::Threads { blocks, .. } | PutKind::Bulk { blocks, .. } => blocks,
        }
    }
}

fn cfg(blocks: u32, threads: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    }
}

fn run(args: &Args) -> Result<()> {
    let comm = Communicator::from_env()?;
    if comm.world_size() != 2 {
        return Err(Error::invalid(
            "--nranks",
            format!(
                "pingpong measures between exactly two ranks, not {}",
                comm.world_size()
            ),
        ));
    }
    let rank = comm.rank();
    let gpu = comm.gpu().clone();
    let stream = gpu.new_stream()?;
    let k = Kernels {
        latency: gpu.function("pingpong", "pingpong_latency")?,
        put: gpu.function("pingpong", "pingpong_put")?,
        put_bulk: gpu.function("pingpong", "pingpong_put_bulk")?,
        drain: gpu.function("pingpong", "pingpong_drain")?,
    };
    let max_bytes = args.max_mib << 20;
    let buf = comm.alloc(max_bytes)?;
    let reg = comm.register(&buf)?;
    let chans = comm.memory_channels(&reg, &reg, None)?;
    let sms = gpu
        .context()
        .attribute(
            cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
        )
        .map_err(|e| Error::Cuda {
            call: "cuDeviceGetAttribute",
            code: e.to_string(),
        })? as u32;
    let blocks = if args.blocks == 0 {
        2 * sms
    } else {
        args.blocks
    };
    let ch = chans
        .to(1 - rank)
        .ok_or_else(|| Error::invalid("channels", "no channel to the other rank"))?
        .device_handle();
    let gpus = comm
        .bootstrap()
        .all_gather(&(gpu.ordinal() as u32).to_le_bytes())?;
    let gpu_of = |r: usize| {
        gpus.get(r)
            .and_then(|b| b.as_slice().try_into().ok())
            .map_or(u32::MAX, u32::from_le_bytes)
    };
    if rank == 0 {
        println!(
            "# doorbell pingpong: rank 0 on GPU {} <-> rank 1 on GPU {}{}, {sms} SMs, put with {blocks} x {} threads",
            gpu_of(0),
            gpu_of(1),
            if gpu_of(0) == gpu_of(1) { " (one GPU: not an NVLink measurement)" } else { "" },
            args.threads
        );
    }
    comm.bootstrap().barrier()?;

    // Latency: one kernel of `iters` round trips; best of 5 (warm-up first).
    latency_round(&comm, &stream, &k, ch, 200)?;
    let mut best = f64::MAX;
    for _ in 0..5 {
        best = best.min(latency_round(&comm, &stream, &k, ch, args.iters)?);
    }
    if rank == 0 {
        println!();
        println!("{:>28} {:>10}", "signal+wait round trip", "us");
        println!(
            "{:>28} {:>10.3}",
            format!("({} iterations)", args.iters),
            best * 1e6
        );
        println!();
        println!(
            "{:>12} {:>8} {:>12} {:>10}",
            "bytes", "reps", "time(us)", "GB/s"
        );
    }

    let mut kinds = vec![(
        "SM stores".to_string(),
        PutKind::Threads {
            blocks,
            threads: args.threads,
        },
    )];
    if args.bulk_blocks > 0 {
        let chunk = args.bulk_chunk_kib.clamp(1, 96) << 10;
        kinds.push((
            format!(
                "TMA bulk copies, {} blocks x {} KiB chunks",
                args.bulk_blocks, args.bulk_chunk_kib
            ),
            PutKind::Bulk {
                blocks: args.bulk_blocks,
                chunk,
            },
        ));
    }
    for (label, kind) in kinds {
        if rank == 0 {
            println!();
            println!("# put through {label}");
            println!(
                "{:>12} {:>8} {:>12} {:>10}",
                "bytes", "reps", "time(us)", "GB/s"
            );
        }
        let mut size = 1 << 20;
        while size <= max_bytes {
            let reps = args.reps.max(1);
            bandwidth_round(&comm, &stream, &k, ch, size, 2, kind)?;
            let mut best = f64::MAX;
            for _ in 0..3 {
                best = best.min(bandwidth_round(&comm, &stream, &k, ch, size, reps, kind)?);
            }
            if rank == 0 {
                let per = best / reps as f64;
                println!(
                    "{:>12} {:>8} {:>12.2} {:>10.1}",
                    size,
                    reps,
                    per * 1e6,
                    size as f64 / per / 1e9
                );
            }
            size *= 4;
        }
    }
    Ok(())
}

/// Seconds per round trip, measured by rank 0 around one kernel of `iters` round trips.
fn latency_round(
    comm: &Communicator,
    stream: &Arc<CudaStream>,
    k: &Kernels,
    ch: MemoryChannelHandle,
    iters: u32,
) -> Result<f64> {
    comm.bootstrap().barrier()?;
    let initiator = (comm.rank() == 0) as u32;
    let start = stream
        .record_event(Some(CU_EVENT_DEFAULT))
        .map_err(cuda("cuEventRecord"))?;
    let mut b = stream.launch_builder(&k.latency);
    b.arg(&ch).arg(&iters).arg(&initiator);
    // SAFETY: matches pingpong_latency's signature.
    comm.cuda_result(unsafe { b.launch(cfg(1, 32)) }, "cuLaunchKernel")?;
    let stop = stream
        .record_event(Some(CU_EVENT_DEFAULT))
        .map_err(cuda("cuEventRecord"))?;
    comm.synchronize(stream)?;
    let ms = start
        .elapsed_ms(&stop)
        .map_err(cuda("cuEventElapsedTime"))?;
    Ok(ms as f64 / 1e3 / iters as f64)
}

/// Seconds for `reps` puts of `bytes` from rank 0 to rank 1, until rank 1 acknowledged that all
/// of them arrived.
#[allow(clippy::too_many_arguments)]
fn bandwidth_round(
    comm: &Communicator,
    stream: &Arc<CudaStream>,
    k: &Kernels,
    ch: MemoryChannelHandle,
    bytes: usize,
    reps: u32,
    kind: PutKind,
) -> Result<f64> {
    comm.bootstrap().barrier()?;
    let bytes = bytes as u64;
    if comm.rank() == 0 {
        let start = stream
            .record_event(Some(CU_EVENT_DEFAULT))
            .map_err(cuda("cuEventRecord"))?;
        for _ in 0..reps {
            match kind {
                PutKind::Threads { blocks, threads } => {
                    let mut b = stream.launch_builder(&k.put);
                    b.arg(&ch).arg(&bytes);
                    // SAFETY: matches pingpong_put; `bytes` fits both buffers.
                    comm.cuda_result(unsafe { b.launch(cfg(blocks, threads)) }, "cuLaunchKernel")?;
                }
                PutKind::Bulk { blocks, chunk } => {
                    let mut b = stream.launch_builder(&k.put_bulk);
                    b.arg(&ch).arg(&bytes).arg(&chunk);
                    let mut c = cfg(blocks, 32);
                    c.shared_mem_bytes = 2 * chunk + 16;
                    if c.shared_mem_bytes > 48 << 10 {
                        k.put_bulk
                            .set_attribute(
                                cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                c.shared_mem_bytes as i32,
                            )
                            .map_err(cuda("cuFuncSetAttribute"))?;
                    }
                    // SAFETY: matches pingpong_put_bulk; `bytes` fits both buffers (16-byte
                    // multiples), shared memory sized as the kernel expects.
                    comm.cuda_result(unsafe { b.launch(c) }, "cuLaunchKernel")?;
                }
            }
        }
        // Wait for rank 1's acknowledgement that every block's data arrived.
        let (one, no_ack) = (1u64, 0u32);
        let mut b = stream.launch_builder(&k.drain);
        b.arg(&ch).arg(&one).arg(&no_ack);
        // SAFETY: matches pingpong_drain.
        comm.cuda_result(unsafe { b.launch(cfg(1, 32)) }, "cuLaunchKernel")?;
        let stop = stream
            .record_event(Some(CU_EVENT_DEFAULT))
            .map_err(cuda("cuEventRecord"))?;
        comm.synchronize(stream)?;
        let ms = start
            .elapsed_ms(&stop)
            .map_err(cuda("cuEventElapsedTime"))?;
        Ok(ms as f64 / 1e3)
    } else {
        let (count, ack) = (reps as u64 * kind.blocks() as u64, 1u32);
        let mut b = stream.launch_builder(&k.drain);
        b.arg(&ch).arg(&count).arg(&ack);
        // SAFETY: matches pingpong_drain.
        comm.cuda_result(unsafe { b.launch(cfg(1, 32)) }, "cuLaunchKernel")?;
        comm.synchronize(stream)?;
        Ok(0.0)
    }
}
