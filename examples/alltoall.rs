//! All-to-all benchmark: doorbell beside NCCL in the same processes and run, in the allreduce
//! example's format: nccl-tests columns (size = bytes each rank sends in total, count = elements
//! per peer), CUDA-graph and eager timing, the maximum over ranks, and the speedup.
//!
//! ```text
//! cargo run --release --example alltoall -- --check
//! ```

use clap::Parser;
use cudarc::driver::{CudaSlice, DevicePtr};
use doorbell::collectives::alltoall::{AllToAll, AllToAllOptions};
use doorbell::collectives::verify::Verifier;
use doorbell::collectives::DataType;
use doorbell::communicator::Communicator;
use doorbell::gpu::cuda::device_count;
use doorbell::job::launch::run_job;
use doorbell::{Error, Result};
use doorbell_bench::harness::{
    alltoall_lanes, cuda, human, limit_nccl_ctas, measure, ours_and_nccl, parse_size, print_calls,
    print_stall_summary, sum_over_ranks, sweep, Repeat, TimingCsv,
};
use doorbell_bench::nccl::Nccl;
use std::sync::Arc;

#[derive(Parser, Debug)]
#[command(about = "All-to-all: doorbell vs NCCL, nccl-tests columns, graph and eager timing")]
struct Args {
    /// Ranks to spawn when no launcher started us (default: one per visible GPU).
    #[arg(long)]
    nranks: Option<usize>,
    /// Element type: bf16, f16 or f32 (the all-to-all moves bytes; the type sets the count).
    #[arg(long, default_value = "bf16")]
    dtype: String,
    /// Smallest size (bytes each rank sends in total; K, M, G suffixes).
    #[arg(long, default_value = "1K")]
    min_bytes: String,
    /// Largest size.
    #[arg(long, default_value = "1G")]
    max_bytes: String,
    /// Size multiplier between rows.
    #[arg(long, default_value_t = 2)]
    factor: usize,
    /// Timed iterations per eager measurement (0: by size).
    #[arg(long, default_value_t = 0)]
    iters: usize,
    /// Warm-up iterations before each measurement.
    #[arg(long, default_value_t = 5)]
    warmup: usize,
    /// Validate every size (each block names its source and destination); exit non-zero on a
    /// wrong byte.
    #[arg(long)]
    check: bool,
    /// Blocks per peer (default: the library's).
    #[arg(long)]
    lanes: Option<u32>,
    /// Blocks copying the rank's own block (default: the library's).
    #[arg(long)]
    own_lanes: Option<u32>,
    /// Threads of each block that send, the rest receiving (default: the library's).
    #[arg(long)]
    send_threads: Option<u32>,
    /// Tile bytes (K, M suffixes; default: the library's).
    #[arg(long)]
    tile: Option<String>,
    /// Slots per ring (default: the library's).
    #[arg(long)]
    depth: Option<u32>,
    /// Largest block per peer (bytes; K suffix) sent as LL16 packets (default: the library's;
    /// 0 turns them off).
    #[arg(long)]
    ll_max: Option<String>,
    /// SM budget: the copy kernels run at most this many blocks (split between the peers and
    /// the own block unless --lanes / --own-lanes say otherwise, and as many LL blocks at most)
    /// and NCCL at most this many CTAs (NCCL_MAX_CTAS) in the same run.
    #[arg(long)]
    sms: Option<u32>,
    /// Skip NCCL.
    #[arg(long)]
    no_nccl: bool,
    /// Skip eager timing (graph only).
    #[arg(long)]
    no_eager: bool,
    /// Also write every library's timings as CSV to this file (for `python -m doorbell.peers`,
    /// which adds the PyTorch peers measured in another run).
    #[arg(long)]
    csv: Option<std::path::PathBuf>,
}

fn main() {
    doorbell::init_logging();
    let args = Args::parse();
    if let Some(sms) = args.sms {
        limit_nccl_ctas(sms);
    }
    run_job("alltoall", args.nranks, device_count, || run(&args))
}

fn run(args: &Args) -> Result<i32> {
    let dtype: DataType = args.dtype.parse()?;
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
    let d = AllToAllOptions::default();
    let budget = args
        .sms
        .map(|n| alltoall_lanes(n, (world as u32).saturating_sub(1)));
    let a2a = AllToAll::new(
        &comm,
        AllToAllOptions {
            lanes: args.lanes.or(budget.map(|b| b.0)).or(d.lanes),
            own_lanes: args.own_lanes.or(budget.map(|b| b.1)).or(d.own_lanes),
            ll_blocks: args.sms.map_or(d.ll_blocks, |n| n.clamp(1, d.ll_blocks)),
            send_threads: args.send_threads.or(d.send_threads),
            tile_bytes: match &args.tile {
                Some(t) => parse_size(t)?,
                None => d.tile_bytes,
            },
            depth: args.depth.unwrap_or(d.depth),
            ll_max_bytes: match &args.ll_max {
                Some(t) if t.trim() == "0" => Some(0),
                Some(t) => Some(parse_size(t)?),
                None => d.ll_max_bytes,
            },
            ..d
        },
    )?;
    let checker = Verifier::new(comm.gpu())?;
    let s = comm.gpu().new_stream()?;
    let nccl = Nccl::optional(comm.bootstrap(), comm.gpu(), args.no_nccl);
    let unit = world * dtype.size();
    let cap = (max_bytes / unit).max(1) * unit;
    let input: CudaSlice<u8> = s.alloc_zeros(cap).map_err(cuda("cuMemAlloc"))?;
    let output: CudaSlice<u8> = s.alloc_zeros(cap).map_err(cuda("cuMemAlloc"))?;
    let (in_ptr, out_ptr) = (input.device_ptr(&s).0, output.device_ptr(&s).0);
    if lead {
        println!(
            "# doorbell all-to-all: {world} ranks, {} GPU(s) visible, {}, {} lanes per peer ({} SMs), NVLS {}, NCCL CTAs {}",
            device_count().unwrap_or(0),
            dtype.name(),
            a2a.lanes(),
            a2a.sms(),
            std::env::var("NCCL_NVLS_ENABLE")
                .map_or("default".into(), |v| format!("NCCL_NVLS_ENABLE={v}")),
            std::env::var("NCCL_MAX_CTAS").map_or("default".into(), |v| format!("at most {v}"))
        );
        if let Some(n) = &nccl {
            println!(
                "# NCCL {} loaded at run time ({}); speedup = NCCL time / doorbell time",
                n.version(),
                if n.has_native_all_to_all() {
                    "ncclAlltoAll"
                } else {
                    "grouped ncclSend/ncclRecv"
                }
            );
        }
        println!("# size = bytes each rank sends in total; times in us, max over ranks; busbw = (n-1)/n * size / time");
        println!(
            "{:>10} {:>11} {:>8} | {:>9} {:>7} {:>7} {:>9} {:>6} | {:>9} {:>7} {:>9} {:>6} | {:>7} {:>7}",
            "size", "count", "type", "graph us", "algbw", "busbw", "eager us", "#wrong", "graph us",
            "busbw", "eager us", "#wrong", "x graph", "x eager"
        );
    }
    let repeat = Repeat {
        iters: args.iters,
        warmup: args.warmup,
        no_eager: args.no_eager,
    };
    let sizes: Vec<usize> = sweep(min_bytes, max_bytes, args.factor)
        .into_iter()
        .map(|b| (b / unit).max(1) * unit)
        .collect();
    let mut failed = false;
    let mut stalls = Vec::new();
    let mut csv = args.csv.as_deref().filter(|_| lead).map(TimingCsv::new);
    for (idx, &bytes) in sizes.iter().enumerate() {
        let blk = bytes / world;
        let count = blk / dtype.size();
        if lead {
            eprintln!(
                "progress: size {}/{} ({})",
                idx + 1,
                sizes.len(),
                human(bytes)
            );
        }
        let round = idx as u32 + 1;
        let check = |op: &dyn Fn() -> Result<()>| -> Result<u64> {
            for p in 0..world {
                // SAFETY: block p of the input lies inside it.
                unsafe {
                    checker.fill_route(
                        &s,
                        in_ptr + (p * blk) as u64,
                        blk,
                        rank as u32,
                        p as u32,
                        round,
                    )?
                };
            }
            op()?;
            comm.synchronize(&s)?;
            let mut wrong = 0;
            for p in 0..world {
                // SAFETY: block p of the output lies inside it.
                wrong += unsafe {
                    checker.count_wrong_route(
                        &s,
                        out_ptr + (p * blk) as u64,
                        blk,
                        p as u32,
                        rank as u32,
                        round,
                    )?
                };
            }
            sum_over_ranks(&comm, wrong)
        };
        // SAFETY (all calls below): both buffers hold `cap >= bytes`.
        let ours_op =
            |st: &Arc<cudarc::driver::CudaStream>| unsafe { a2a.run_raw(st, in_ptr, out_ptr, blk) };
        let wrong = if args.check {
            Some(check(&|| ours_op(&s))?)
        } else {
            None
        };
        let ours = measure(&comm, &s, bytes, repeat, &ours_op)?;
        let (theirs, nccl_wrong) = match &nccl {
            Some(n) => {
                let op = |st: &Arc<cudarc::driver::CudaStream>| unsafe {
                    n.all_to_all(st, in_ptr, out_ptr, count, dtype)
                };
                let w = if args.check {
                    Some(check(&|| op(&s))?)
                } else {
                    None
                };
                (Some(measure(&comm, &s, bytes, repeat, &op)?), w)
            }
            None => (None, None),
        };
        failed |= wrong.unwrap_or(0) > 0 || nccl_wrong.unwrap_or(0) > 0;
        if let Some(csv) = &mut csv {
            csv.row("alltoall", world, dtype.name(), bytes, "doorbell", ours)?;
            if let Some(t) = theirs {
                csv.row("alltoall", world, dtype.name(), bytes, "NCCL", t)?;
            }
        }
        if lead {
            let f = (world as f64 - 1.0) / world as f64;
            let bw = |us: Option<f64>, f: f64| {
                us.map_or("-".into(), |t| format!("{:.1}", bytes as f64 * f / t / 1e3))
            };
            let us = |v: Option<f64>| v.map_or("-".into(), |t| format!("{t:.2}"));
            let w = |v: Option<u64>| v.map_or("-".into(), |w| w.to_string());
            let ratio = |a: Option<f64>, b: Option<f64>| match (a, b) {
                (Some(a), Some(b)) => format!("{:.2}", a / b),
                _ => "-".into(),
            };
            let t = theirs.unwrap_or_default();
            println!(
                "{:>10} {:>11} {:>8} | {:>9} {:>7} {:>7} {:>9} {:>6} | {:>9} {:>7} {:>9} {:>6} | {:>7} {:>7}",
                bytes,
                count,
                dtype.name(),
                us(ours.graph),
                bw(ours.graph, 1.0),
                bw(ours.graph, f),
                us(ours.eager),
                w(wrong),
                us(t.graph),
                bw(t.graph, f),
                us(t.eager),
                w(nccl_wrong),
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
            eprintln!("alltoall: wrong results (see #wrong)");
        }
        return Ok(2);
    }
    Ok(0)
}
