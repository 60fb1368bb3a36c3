//! A collective beside a bf16 GEMM: what communication leaves for compute. Every rank runs a
//! cuBLAS GEMM (n x n x n, bf16 in, f32 accumulation) in a loop on one stream while a collective
//! (allreduce or all-to-all of `--bytes`) runs in a loop on another, first each alone, then both
//! at once; for doorbell at each SM budget (`--sms`) and for NCCL (its default, or at most
//! `--nccl-ctas` CTAs). Reported, max over ranks: the collective's time and busbw alone and beside
//! the GEMM, the GEMM's TFLOPS alone and beside the collective, and the GEMM's slowdown.
//!
//! The GEMM loop is sized to last as long as the collective loop alone, so the two overlap for
//! the whole measurement. cuBLAS is loaded at run time: libcublas.so.13 must be on the loader's
//! path (e.g. `LD_LIBRARY_PATH=/usr/local/cuda/lib64`).
//!
//! ```text
//! cargo run --release --example overlap -- --collective allreduce --bytes 256M --sms 4,8,16,32,all
//! ```

use clap::Parser;
use cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT;
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
use doorbell::collectives::allreduce::{AllReduce, AllReduceOptions};
use doorbell::collectives::alltoall::{AllToAll, AllToAllOptions};
use doorbell::collectives::DataType;
use doorbell::communicator::Communicator;
use doorbell::gpu::cuda::device_count;
use doorbell::job::launch::run_job;
use doorbell::{Error, Result};
use doorbell_bench::gemm::Gemm;
use doorbell_bench::harness::{
    alltoall_lanes, cuda, human, limit_nccl_ctas, max_over_ranks, parse_size,
};
use doorbell_bench::nccl::Nccl;
use std::sync::Arc;

#[derive(Parser, Debug)]
#[command(
    about = "A collective beside a cuBLAS bf16 GEMM: the GEMM's slowdown and the collective's busbw"
)]
struct Args {
    /// Ranks to spawn when no launcher started us (default: one per visible GPU).
    #[arg(long)]
    nranks: Option<usize>,
    /// The collective: allreduce (bf16 sum) or alltoall.
    #[arg(long, default_value = "allreduce")]
    collective: String,
    /// Bytes per call (allreduce: the buffer; all-to-all: what each rank sends in total).
    #[arg(long, default_value = "256M")]
    bytes: String,
    /// doorbell's SM budgets, comma separated ("all": the library's default grid).
    #[arg(long, default_value = "4,8,16,32,all")]
    sms: String,
    /// The GEMM's n (m = n = k).
    #[arg(long, default_value_t = 8192)]
    gemm: usize,
    /// Collective calls per measurement.
    #[arg(long, default_value_t = 20)]
    iters: usize,
    /// Run NCCL with at most this many CTAs (NCCL_MAX_CTAS; default: NCCL's own choice).
    #[arg(long)]
    nccl_ctas: Option<u32>,
    /// Skip NCCL.
    #[arg(long)]
    no_nccl: bool,
}

fn main() {
    doorbell::init_logging();
    let args = Args::parse();
    if let Err(e) = budgets(&args).and(is_allreduce(&args)) {
        eprintln!("overlap: {e}");
        std::process::exit(2);
    }
    if let Some(n) = args.nccl_ctas {
        limit_nccl_ctas(n);
    }
    run_job("overlap", args.nranks, device_count, || run(&args))
}

/// `--sms` as budgets (None: the library's default grid).
fn budgets(args: &Args) -> Result<Vec<Option<u32>>> {
    args.sms
        .split(',')
        .map(|t| match t.trim() {
            "all" => Ok(None),
            t => t
                .parse::<u32>()
                .ok()
                .filter(|&n| n > 0)
                .map(Some)
                .ok_or_else(|| {
                    Error::invalid("sms", format!("{t:?}: a positive count or \"all\""))
                }),
        })
        .collect()
}

/// `--collective`: true for allreduce, false for all-to-all.
fn is_allreduce(args: &Args) -> Result<bool> {
    match args.collective.as_str() {
        "allreduce" => Ok(true),
        "alltoall" => Ok(false),
        other => Err(Error::invalid(
            "collective",
            format!("{other:?}: allreduce or alltoall"),
        )),
    }
}

/// One call of a collective on a stream.
type Op<'a> = dyn Fn(&Arc<CudaStream>) -> Result<()> + 'a;

/// One collective to run beside the GEMM.
struct Peer<'a> {
    name: String,
    sms: String,
    op: Box<Op<'a>>,
}

/// Times of one peer, us per call (max over ranks).
struct Row {
    name: String,
    sms: String,
    alone: f64,
    beside: f64,
    gemm_beside: f64,
}

fn run(args: &Args) -> Result<i32> {
    let bytes = parse_size(&args.bytes)?;
    let budgets = budgets(args)?;
    let allreduce = is_allreduce(args)?;
    if args.iters == 0 {
        return Err(Error::invalid("iters", "at least 1"));
    }
    let comm = Arc::new(Communicator::from_env()?);
    let (rank, world) = (comm.rank(), comm.world_size());
    let lead = rank == 0;
    let dtype = DataType::Bf16;
    let unit = world * dtype.size();
    let bytes = (bytes / unit).max(1) * unit;
    let s = comm.gpu().new_stream()?;
    let g = comm.gpu().new_stream()?;
    let mut gemm = Gemm::new(&g, args.gemm)?;
    let input: CudaSlice<u8> = s.alloc_zeros(bytes).map_err(cuda("cuMemAlloc"))?;
    let output: CudaSlice<u8> = s.alloc_zeros(bytes).map_err(cuda("cuMemAlloc"))?;
    let (in_ptr, out_ptr) = (input.device_ptr(&s).0, output.device_ptr(&s).0);
    let nccl = Nccl::optional(comm.bootstrap(), comm.gpu(), args.no_nccl);

    // The collectives: doorbell at each budget, then NCCL.
    let mut allreduces = Vec::new();
    let mut alltoalls = Vec::new();
    for &budget in &budgets {
        if allreduce {
            let d = AllReduceOptions::default();
            allreduces.push((
                budget,
                AllReduce::new(
                    &comm,
                    AllReduceOptions {
                        max_lanes: budget.unwrap_or(d.max_lanes),
                        ll_blocks: budget.map_or(d.ll_blocks, |n| n.min(d.ll_blocks)),
                        ..d
                    },
                )?,
            ));
        } else {
            let d = AllToAllOptions::default();
            let split = budget.map(|n| alltoall_lanes(n, world as u32 - 1));
            alltoalls.push((
                budget,
                AllToAll::new(
                    &comm,
                    AllToAllOptions {
                        lanes: split.map(|b| b.0).or(d.lanes),
                        own_lanes: split.map(|b| b.1).or(d.own_lanes),
                        ll_blocks: budget.map_or(d.ll_blocks, |n| n.clamp(1, d.ll_blocks)),
                        ..d
                    },
                )?,
            ));
        }
    }
    let label = |b: Option<u32>| b.map_or("all".to_string(), |n| n.to_string());
    let count = bytes / dtype.size();
    let mut peers: Vec<Peer> = Vec::new();
    // SAFETY (every op below): both buffers hold `bytes`, on this rank's GPU, for the whole run.
    for (b, ar) in &allreduces {
        peers.push(Peer {
            name: "doorbell".into(),
            sms: label(*b),
            op: Box::new(move |st| unsafe { ar.run_raw(st, in_ptr, out_ptr, count, dtype) }),
        });
    }
    for (b, a2a) in &alltoalls {
        peers.push(Peer {
            name: "doorbell".into(),
            sms: label(*b),
            op: Box::new(move |st| unsafe { a2a.run_raw(st, in_ptr, out_ptr, bytes / world) }),
        });
    }
    if let Some(n) = &nccl {
        let ctas = args
            .nccl_ctas
            .map_or("NCCL's".to_string(), |c| format!("<= {c} CTAs"));
        peers.push(Peer {
            name: format!("NCCL {}", n.version()),
            sms: ctas,
            op: if allreduce {
                Box::new(move |st| unsafe { n.all_reduce(st, in_ptr, out_ptr, count, dtype) })
            } else {
                Box::new(move |st| unsafe {
                    n.all_to_all(st, in_ptr, out_ptr, count / world, dtype)
                })
            },
        });
    }

    // us per call of each stream's loop, run together (max over ranks).
    let together =
        |coll: Option<&Op>, calls: usize, gemms: usize, gemm: &mut Gemm| -> Result<(f64, f64)> {
            comm.synchronize(&s)?;
            g.synchronize().map_err(cuda("cuStreamSynchronize"))?;
            comm.bootstrap().barrier()?;
            let event = |st: &Arc<CudaStream>| {
                st.record_event(Some(CU_EVENT_DEFAULT))
                    .map_err(cuda("cuEventRecord"))
            };
            let (s0, g0) = (event(&s)?, event(&g)?);
            for i in 0..calls.max(gemms) {
                if let Some(op) = coll {
                    if i < calls {
                        op(&s)?;
                    }
                }
                if i < gemms {
                    gemm.run()?;
                }
            }
            let (s1, g1) = (event(&s)?, event(&g)?);
            comm.synchronize(&s)?;
            g.synchronize().map_err(cuda("cuStreamSynchronize"))?;
            let us = |a: &cudarc::driver::CudaEvent, b: &cudarc::driver::CudaEvent, n: usize| {
                a.elapsed_ms(b)
                    .map(|ms| ms as f64 * 1e3 / n.max(1) as f64)
                    .map_err(cuda("cuEventElapsedTime"))
            };
            let c = if coll.is_some() {
                us(&s0, &s1, calls)?
            } else {
                0.0
            };
            let k = if gemms > 0 { us(&g0, &g1, gemms)? } else { 0.0 };
            Ok((max_over_ranks(&comm, c)?, max_over_ranks(&comm, k)?))
        };

    // Warm-up, then the GEMM alone.
    for _ in 0..3 {
        gemm.run()?;
    }
    for p in &peers {
        for _ in 0..3 {
            (p.op)(&s)?;
        }
    }
    let gemm_iters = 20;
    let (_, gemm_alone) = together(None, 0, gemm_iters, &mut gemm)?;
    let flops = gemm.flops();
    let tflops = |us: f64| flops / (us * 1e-6) / 1e12;
    let gemm_tflops = tflops(gemm_alone);
    let busbw = |us: f64| {
        let factor = if allreduce {
            2.0 * (world as f64 - 1.0) / world as f64
        } else {
            (world as f64 - 1.0) / world as f64
        };
        factor * bytes as f64 / (us * 1e-6) / 1e9
    };
    let mut rows = Vec::new();
    for p in &peers {
        let (alone, _) = together(Some(&*p.op), args.iters, 0, &mut gemm)?;
        // As many GEMMs as last the collective loop alone, so they overlap throughout.
        let gemms = ((alone * args.iters as f64 / gemm_alone).round() as usize).max(1);
        let (beside, gemm_beside) = together(Some(&*p.op), args.iters, gemms, &mut gemm)?;
        rows.push(Row {
            name: p.name.clone(),
            sms: p.sms.clone(),
            alone,
            beside,
            gemm_beside,
        });
    }
    if lead {
        println!(
            "# {} of {} beside a {n} x {n} x {n} bf16 cuBLAS GEMM: {world} ranks, {} GPU(s) visible, NVLS {}",
            args.collective,
            human(bytes),
            device_count().unwrap_or(0),
            std::env::var("NCCL_NVLS_ENABLE")
                .map_or("default".into(), |v| format!("NCCL_NVLS_ENABLE={v}")),
            n = args.gemm,
        );
        println!(
            "# GEMM alone: {gemm_alone:.1} us, {gemm_tflops:.1} TFLOPS; times in us per call, max over ranks; eager"
        );
        println!(
            "| library | SMs | alone (us) | busbw alone (GB/s) | beside GEMM (us) | busbw beside (GB/s) | GEMM beside (TFLOPS) | GEMM slowdown |"
        );
        println!("|---|---|---:|---:|---:|---:|---:|---:|");
        for r in &rows {
            println!(
                "| {} | {} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {:+.1}% |",
                r.name,
                r.sms,
                r.alone,
                busbw(r.alone),
                r.beside,
                busbw(r.beside),
                tflops(r.gemm_beside),
                (r.gemm_beside / gemm_alone - 1.0) * 100.0
            );
        }
    }
    Ok(0)
}
