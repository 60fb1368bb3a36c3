//! All-gather benchmark: doorbell's copy-engine all-gather ([`PortAllGather`], driven only through
//! PortChannels, one SM) beside NCCL's all-gather in the same processes and run, with
//! nccl-tests columns (size = gathered bytes per rank), CUDA-graph and eager timing, the maximum
//! over ranks, the speedup over NCCL and the SMs each call occupies.
//!
//! ```text
//! cargo run --release --example allgather -- --check
//! ```

use clap::Parser;
use cudarc::driver::{CudaSlice, DevicePtr};
use doorbell::collectives::allgather::{AllGatherOptions, PortAllGather};
use doorbell::collectives::DataType;
use doorbell::communicator::Communicator;
use doorbell::gpu::cuda::device_count;
use doorbell::job::launch::run_job;
use doorbell::{Error, Result};
use doorbell_bench::harness::{
    cuda, human, measure, ours_and_nccl, parse_size, print_calls, print_stall_summary,
    sum_over_ranks, sweep, Repeat,
};
use doorbell_bench::nccl::Nccl;
use std::sync::Arc;

#[derive(Parser, Debug)]
#[command(about = "All-gather: doorbell's copy-engine ring (PortChannels only) vs NCCL")]
struct Args {
    /// Ranks to spawn when no launcher started us (default: one per visible GPU).
    #[arg(long)]
    nranks: Option<usize>,
    /// Smallest gathered size (bytes per rank after the gather; K, M, G suffixes).
    #[arg(long, default_value = "1M")]
    min_bytes: String,
    /// Largest gathered size.
    #[arg(long, default_value = "1G")]
    max_bytes: String,
    /// Size multiplier between rows.
    #[arg(long, default_value_t = 2)]
    factor: usize,
    /// Timed iterations per eager measurement (0: by size).
    #[arg(long, default_value_t = 0)]
    iters: usize,
    /// Warm-up iterations before each measurement.
    #[arg(long, default_value_t = 3)]
    warmup: usize,
    /// Bytes per copy-engine transfer (K, M, G suffixes; default: the library's).
    #[arg(long)]
    piece: Option<String>,
    /// Validate every size (rank- and index-derived shards); exit non-zero on a wrong byte.
    #[arg(long)]
    check: bool,
    /// Skip NCCL.
    #[arg(long)]
    no_nccl: bool,
    /// Skip eager timing (graph only).
    #[arg(long)]
    no_eager: bool,
}

fn main() {
    doorbell::init_logging();
    let args = Args::parse();
    run_job("allgather", args.nranks, device_count, || run(&args))
}

/// The shard word `i` of rank `r` (never zero, so a missed copy shows).
fn word(r: usize, i: usize) -> u32 {
    ((r as u32 + 1) << 24) ^ (i as u32).wrapping_mul(2_654_435_761) | 1
}

fn run(args: &Args) -> Result<i32> {
    let min_bytes = parse_size(&args.min_bytes)?;
    let max_bytes = parse_size(&args.max_bytes)?;
    if args.factor < 2 || min_bytes > max_bytes {
        return Err(Error::invalid(
            "sizes",
            "need --factor >= 2 and --min-bytes <= --max-bytes",
        ));
    }
    let comm = Arc::new(Communicator::from_env()?);
    let (rank, world) = (comm.rank(), comm.world_size());
    let lead = rank == 0;
    let unit = 4 * world; // whole u32 words per shard
    let max_shard = (max_bytes / unit).max(1) * 4;
    let defaults = AllGatherOptions::default();
    let ag = PortAllGather::new(
        &comm,
        max_shard,
        AllGatherOptions {
            piece_bytes: match &args.piece {
                Some(p) => parse_size(p)?,
                None => defaults.piece_bytes,
            },
            ..defaults
        },
    )?;
    let s = comm.gpu().new_stream()?;
    let nccl = Nccl::optional(comm.bootstrap(), comm.gpu(), args.no_nccl);
    let input: CudaSlice<u8> = s.alloc_zeros(max_shard).map_err(cuda("cuMemAlloc"))?;
    let output: CudaSlice<u8> = s
        .alloc_zeros(max_shard * world)
        .map_err(cuda("cuMemAlloc"))?;
    let (in_ptr, out_ptr) = (input.device_ptr(&s).0, output.device_ptr(&s).0);
    if lead {
        println!(
            "# doorbell all-gather (copy engines through PortChannels, {} SM per call): {world} ranks, {} GPU(s) visible, NVLS {}",
            ag.sms(),
            device_count().unwrap_or(0),
            std::env::var("NCCL_NVLS_ENABLE")
                .map_or("default".into(), |v| format!("NCCL_NVLS_ENABLE={v}"))
        );
        if let Some(n) = &nccl {
            println!(
                "# NCCL {} loaded at run time; speedup = NCCL time / doorbell time",
                n.version()
            );
        }
        println!("# size = gathered bytes per rank; times in us, max over ranks; busbw = (n-1)/n * size / time");
        println!(
            "{:>8} {:>11} | {:>10} {:>8} {:>8} {:>10} {:>4} {:>6} | {:>10} {:>8} {:>10} {:>6} | {:>7} {:>7}",
            "size", "count(u8)", "graph us", "algbw", "busbw", "eager us", "SMs", "#wrong",
            "graph us", "busbw", "eager us", "#wrong", "x graph", "x eager"
        );
    }
    let repeat = Repeat {
        iters: args.iters,
        warmup: args.warmup,
        no_eager: args.no_eager,
    };
    let mut failed = false;
    let mut stalls = Vec::new();
    let sizes: Vec<usize> = sweep(min_bytes, max_bytes, args.factor)
        .into_iter()
        .map(|b| (b / unit).max(1) * unit)
        .collect();
    for (idx, &bytes) in sizes.iter().enumerate() {
        let shard = bytes / world;
        if lead {
            eprintln!(
                "progress: size {}/{} ({})",
                idx + 1,
                sizes.len(),
                human(bytes)
            );
        }
        let mut wrong = 0u64;
        let mut nccl_wrong = None;
        if args.check {
            let mine: Vec<u32> = (0..shard / 4).map(|i| word(rank, i)).collect();
            // SAFETY: `input` holds max_shard >= shard bytes.
            unsafe {
                cudarc::driver::result::memcpy_htod_async(in_ptr, &mine, s.cu_stream())
                    .map_err(cuda("cuMemcpyHtoD"))?;
            }
            let verify = |ptr: u64| -> Result<u64> {
                // A kernel that gave up is reported here, naming what it waited for.
                comm.synchronize(&s)?;
                let mut got = vec![0u32; bytes / 4];
                // SAFETY: `ptr` holds `bytes` (our buffer or the NCCL output).
                unsafe {
                    cudarc::driver::result::memcpy_dtoh_async(&mut got, ptr, s.cu_stream())
                        .map_err(cuda("cuMemcpyDtoH"))?;
                }
                comm.synchronize(&s)?;
                Ok(got
                    .iter()
                    .enumerate()
                    .filter(|&(j, &v)| v != word(j / (shard / 4), j % (shard / 4)))
                    .count() as u64)
            };
            // SAFETY: `input` holds the shard.
            unsafe { ag.run_raw(&s, in_ptr, shard)? };
            wrong = sum_over_ranks(&comm, verify(ag.output())?)?;
            failed |= wrong > 0;
            if let Some(n) = &nccl {
                // SAFETY: `output` holds world * max_shard bytes; the shard is whole bf16 words.
                unsafe { n.all_gather(&s, in_ptr, out_ptr, shard / 2, DataType::Bf16)? };
                nccl_wrong = Some(sum_over_ranks(&comm, verify(out_ptr)?)?);
                failed |= nccl_wrong != Some(0);
            }
        }
        // SAFETY: as above.
        let ours = measure(&comm, &s, bytes, repeat, &|st| unsafe {
            ag.run_raw(st, in_ptr, shard)
        })?;
        let theirs = match &nccl {
            // SAFETY: as above.
            Some(n) => Some(measure(&comm, &s, bytes, repeat, &|st| unsafe {
                n.all_gather(st, in_ptr, out_ptr, shard / 2, DataType::Bf16)
            })?),
            None => None,
        };
        if lead {
            let bw = |us: Option<f64>, f: f64| {
                us.map_or("-".into(), |t| format!("{:.1}", bytes as f64 * f / t / 1e3))
            };
            let f = (world as f64 - 1.0) / world as f64;
            let us = |v: Option<f64>| v.map_or("-".into(), |t| format!("{t:.2}"));
            let ratio = |a: Option<f64>, b: Option<f64>| match (a, b) {
                (Some(a), Some(b)) => format!("{:.2}", a / b),
                _ => "-".into(),
            };
            let t = theirs.unwrap_or_default();
            println!(
                "{:>8} {:>11} | {:>10} {:>8} {:>8} {:>10} {:>4} {:>6} | {:>10} {:>8} {:>10} {:>6} | {:>7} {:>7}",
                human(bytes),
                bytes,
                us(ours.graph),
                bw(ours.graph, 1.0),
                bw(ours.graph, f),
                us(ours.eager),
                ag.sms(),
                if args.check { wrong.to_string() } else { "-".into() },
                us(t.graph),
                bw(t.graph, f),
                us(t.eager),
                nccl_wrong.map_or("-".into(), |w| w.to_string()),
                ratio(t.graph, ours.graph),
                ratio(t.eager, ours.eager),
            );
            print_calls(&human(bytes), &ours_and_nccl(ours, theirs), &mut stalls);
        }
    }
    if lead {
        print_stall_summary(&stalls);
    }
    comm.bootstrap().barrier()?;
    if failed {
        if lead {
            eprintln!("allgather: wrong results (see #wrong)");
        }
        return Ok(2);
    }
    Ok(0)
}
