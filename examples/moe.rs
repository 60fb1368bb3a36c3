//! MoE dispatch/combine benchmark in DeepEP's configurations: prefill (4096 tokens per rank) and
//! decode (128 tokens per rank), hidden 7168, top-8 of 256 experts, bf16. Reports us per call
//! (maximum over ranks, eager and CUDA graph) and GB/s by DeepEP's definition for its normal
//! kernels (rows received by a rank, local ones included, x hidden x 2 bytes, over the time; the
//! same bytes for combine), the mean over ranks of those bytes. Beside it, in the same processes,
//! NCCL moving the same rows with grouped ncclSend/ncclRecv: data movement only, no layout, no
//! packing and no reduction, so a lower bound for a dispatch or combine built on NCCL.
//!
//! ```text
//! cargo run --release --example moe
//! ```

use clap::Parser;
use cudarc::driver::{CudaSlice, DevicePtr};
use doorbell::collectives::moe::{reference_layout, MoeConfig, MoeHighThroughput, MoeLowLatency};
use doorbell::collectives::DataType;
use doorbell::communicator::Communicator;
use doorbell::gpu::cuda::device_count;
use doorbell::job::launch::run_job;
use doorbell::{Error, Result};
use doorbell_bench::harness::{
    cuda, limit_nccl_ctas, measure, print_calls, print_stall_summary, Repeat, Timing, TimingCsv,
};
use doorbell_bench::nccl::Nccl;
use std::sync::Arc;

#[derive(Parser, Debug)]
#[command(
    about = "MoE dispatch/combine (DeepEP's configurations): doorbell vs NCCL moving the same rows"
)]
struct Args {
    /// Ranks to spawn when no launcher started us (default: one per visible GPU).
    #[arg(long)]
    nranks: Option<usize>,
    /// Hidden size.
    #[arg(long, default_value_t = 7168)]
    hidden: usize,
    /// Experts per token.
    #[arg(long, default_value_t = 8)]
    topk: usize,
    /// Experts in the layer.
    #[arg(long, default_value_t = 256)]
    experts: usize,
    /// Token counts per rank to run (comma separated).
    #[arg(long, default_value = "4096,128")]
    tokens: String,
    /// Blocks (SMs) of the send and receive kernels (default: all SMs); NCCL then runs at most
    /// as many CTAs (NCCL_MAX_CTAS).
    #[arg(long)]
    sms: Option<u32>,
    /// Timed iterations per eager measurement.
    #[arg(long, default_value_t = 20)]
    iters: usize,
    /// Dispatch FP8 (e4m3 + one f32 scale per 128 values) instead of bf16; GB/s then counts
    /// hidden + hidden / 32 bytes per row, as DeepEP does.
    #[arg(long)]
    fp8: bool,
    /// Combine from the dispatcher's `combine_buffer()` instead of a separate `y`: with more than
    /// 64 SMs the high-throughput combine pulls from that buffer, and `y` there is not copied in
    /// (as expert kernels writing there would); with fewer it pushes from `y` wherever it is.
    #[arg(long)]
    zero_copy: bool,
    /// Also run the low-latency kernels (per-expert layout) with this many tokens per rank
    /// (0: skip).
    #[arg(long, default_value_t = 128)]
    low_latency_tokens: usize,
    /// Skip NCCL.
    #[arg(long)]
    no_nccl: bool,
    /// Also write every timing as CSV to this file (the examples' columns, for `python -m
    /// doorbell.peers check`): collectives moe_dispatch, moe_combine (high-throughput) and
    /// moe_ll_dispatch, moe_ll_combine, bytes = tokens per rank x hidden x 2, libraries doorbell
    /// and "NCCL rows" (NCCL's all-to-all moving the same rows, listed under both halves).
    #[arg(long)]
    csv: Option<std::path::PathBuf>,
}

fn main() {
    doorbell::init_logging();
    let args = Args::parse();
    if let Some(sms) = args.sms {
        limit_nccl_ctas(sms);
    }
    run_job("moe", args.nranks, device_count, || run(&args))
}

fn hash(a: u64) -> u64 {
    let mut x = a.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    x ^= x >> 29;
    x.wrapping_mul(0xBF58_476D_1CE4_E5B9) ^ (x >> 32)
}

/// Rank `r`'s routing: `topk` distinct experts per token, uniformly spread, weights 1/topk.
fn routing(r: usize, tokens: usize, topk: usize, experts: usize) -> Vec<i32> {
    let mut idx = Vec::with_capacity(tokens * topk);
    for t in 0..tokens {
        let mut picked: Vec<i32> = Vec::with_capacity(topk);
        for k in 0..topk {
            let mut e = hash((r as u64) << 40 | (t * topk + k) as u64) as usize % experts;
            while picked.contains(&(e as i32)) {
                e = (e + 1) % experts;
            }
            picked.push(e as i32);
        }
        idx.extend(picked);
    }
    idx
}

fn run(args: &Args) -> Result<i32> {
    let token_counts: Vec<usize> = args
        .tokens
        .split(',')
        .map(|t| t.trim().parse::<usize>())
        .collect::<std::result::Result<_, _>>()
        .map_err(|_| Error::invalid("--tokens", "expected numbers like 4096,128"))?;
    let max_tokens = token_counts
        .iter()
        .copied()
        .chain([args.low_latency_tokens])
        .max()
        .unwrap_or(0)
        .max(1);
    let comm = Arc::new(Communicator::from_env()?);
    let (rank, world) = (comm.rank(), comm.world_size());
    let lead = rank == 0;
    let moe = MoeHighThroughput::new(
        &comm,
        MoeConfig::new(args.hidden, args.topk, args.experts, max_tokens).with_blocks(args.sms),
    )?;
    let s = comm.gpu().new_stream()?;
    let nccl = if args.no_nccl {
        None
    } else {
        Nccl::new(comm.bootstrap(), comm.gpu()).ok()
    };
    let h = args.hidden;
    let x: CudaSlice<u16> = s.alloc_zeros(max_tokens * h).map_err(cuda("cuMemAlloc"))?;
    let idx: CudaSlice<i32> = s
        .alloc_zeros(max_tokens * args.topk)
        .map_err(cuda("cuMemAlloc"))?;
    let w: CudaSlice<f32> = s
        .alloc_zeros(max_tokens * args.topk)
        .map_err(cuda("cuMemAlloc"))?;
    let scales: CudaSlice<f32> = s
        .alloc_zeros(max_tokens * h.div_ceil(128))
        .map_err(cuda("cuMemAlloc"))?;
    let scp = scales.device_ptr(&s).0;
    let rows = world * max_tokens;
    let y: CudaSlice<u16> = s.alloc_zeros(rows * h).map_err(cuda("cuMemAlloc"))?;
    let out: CudaSlice<u16> = s.alloc_zeros(max_tokens * h).map_err(cuda("cuMemAlloc"))?;
    // NCCL's rows: at most every token to every rank (high-throughput), or every selection of
    // every rank's low-latency batch to one rank.
    let nccl_rows = rows.max(world * args.low_latency_tokens * args.topk);
    let nccl_send: CudaSlice<u16> = s.alloc_zeros(nccl_rows * h).map_err(cuda("cuMemAlloc"))?;
    let nccl_recv: CudaSlice<u16> = s.alloc_zeros(nccl_rows * h).map_err(cuda("cuMemAlloc"))?;
    let (xp, ip, wp, yp, op) = (
        x.device_ptr(&s).0,
        idx.device_ptr(&s).0,
        w.device_ptr(&s).0,
        y.device_ptr(&s).0,
        out.device_ptr(&s).0,
    );
    let (nsp, nrp) = (nccl_send.device_ptr(&s).0, nccl_recv.device_ptr(&s).0);
    if lead {
        println!(
            "# doorbell MoE dispatch/combine (high-throughput kernels, {} dispatch, bf16 combine): {world} ranks, hidden {h}, top-{} of {} experts, {} SMs, combine {}",
            if args.fp8 { "FP8" } else { "bf16" },
            args.topk,
            args.experts,
            moe.sms(),
            if args.zero_copy { "y in combine_buffer()" } else { "y a separate buffer" }
        );
        println!("# us = max over ranks; GB/s = rows received per rank (mean) x bytes per row / us (DeepEP's normal-kernel definition; the combine column counts bf16 rows whatever the dispatch type)");
        println!(
            "{:>7} {:>9} | {:>9} {:>9} {:>8} | {:>9} {:>9} {:>8} | {:>13} {:>8} | {:>7} {:>7}",
            "tokens",
            "rows/rank",
            "disp us",
            "graph us",
            "GB/s",
            "comb us",
            "graph us",
            "GB/s",
            "NCCL rows us",
            "GB/s",
            "x disp",
            "x comb"
        );
    }
    let mut stalls = Vec::new();
    let mut csv = args.csv.as_deref().filter(|_| lead).map(TimingCsv::new);
    for &tokens in &token_counts {
        let mine = routing(rank, tokens, args.topk, args.experts);
        let weights = vec![1.0f32 / args.topk as f32; tokens * args.topk];
        let xs: Vec<u16> = (0..tokens * h).map(|i| 0x3f80 + (i % 64) as u16).collect();
        // SAFETY: each destination holds max_tokens rows.
        unsafe {
            cudarc::driver::result::memcpy_htod_async(xp, &xs, s.cu_stream())
                .map_err(cuda("cuMemcpyHtoD"))?;
            cudarc::driver::result::memcpy_htod_async(ip, &mine, s.cu_stream())
                .map_err(cuda("cuMemcpyHtoD"))?;
            cudarc::driver::result::memcpy_htod_async(wp, &weights, s.cu_stream())
                .map_err(cuda("cuMemcpyHtoD"))?;
        }
        comm.synchronize(&s)?;
        // Rows each rank sends every rank (every rank derives every routing), for the byte
        // counts and NCCL's counts.
        let per_rank = args.experts / world;
        let sent: Vec<Vec<usize>> = (0..world)
            .map(|r| {
                reference_layout(
                    &routing(r, tokens, args.topk, args.experts),
                    args.topk,
                    per_rank,
                    world,
                )
                .iter()
                .map(Vec::len)
                .collect()
            })
            .collect();
        let recv_rows: Vec<usize> = (0..world)
            .map(|r| (0..world).map(|src| sent[src][r]).sum())
            .collect();
        let mean_rows = recv_rows.iter().sum::<usize>() as f64 / world as f64;
        let row_bytes = if args.fp8 {
            h as f64 + (h / 128) as f64 * 4.0
        } else {
            h as f64 * 2.0
        };
        let bytes = mean_rows * row_bytes;
        let repeat = Repeat {
            iters: args.iters,
            warmup: 3,
            no_eager: false,
        };
        // SAFETY (every call below): the inputs hold `tokens` rows, y and out the worst case.
        let dispatch = measure(&comm, &s, bytes as usize, repeat, &|st| unsafe {
            if args.fp8 {
                moe.dispatch_fp8_raw(st, xp, scp, ip, wp, tokens)
            } else {
                moe.dispatch_raw(st, xp, ip, wp, tokens)
            }
        })?;
        let y_at = if args.zero_copy {
            moe.combine_buffer()?
        } else {
            yp
        };
        let combine = measure(&comm, &s, bytes as usize, repeat, &|st| unsafe {
            moe.combine_raw(st, y_at, op)
        })?;
        let theirs = match &nccl {
            Some(n) => {
                let offsets = |c: &[usize]| -> Vec<usize> {
                    c.iter()
                        .scan(0, |a, &v| {
                            let o = *a;
                            *a += v * h;
                            Some(o)
                        })
                        .collect()
                };
                let sc: Vec<usize> = sent[rank].iter().map(|&r| r * h).collect();
                let rc: Vec<usize> = (0..world).map(|src| sent[src][rank] * h).collect();
                let (so, ro) = (
                    offsets(&sent[rank]),
                    offsets(&(0..world).map(|src| sent[src][rank]).collect::<Vec<_>>()),
                );
                Some(measure(&comm, &s, bytes as usize, repeat, &|st| unsafe {
                    n.all_to_all_v(st, nsp, nrp, &sc, &so, &rc, &ro, DataType::Bf16)
                })?)
            }
            None => None,
        };
        if lead {
            let gbs_of =
                |b: f64, t: Option<f64>| t.map_or("-".into(), |t| format!("{:.1}", b / t / 1e3));
            let gbs = |t: Option<f64>| gbs_of(bytes, t);
            let comb_bytes = mean_rows * h as f64 * 2.0;
            let us = |t: Option<f64>| t.map_or("-".into(), |t| format!("{t:.1}"));
            let best = |t: Timing| match (t.eager, t.graph) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            };
            let ratio = |n: Option<Timing>, o: Timing| match (n.and_then(best), best(o)) {
                (Some(a), Some(b)) => format!("{:.2}", a / b),
                _ => "-".into(),
            };
            println!(
                "{:>7} {:>9.0} | {:>9} {:>9} {:>8} | {:>9} {:>9} {:>8} | {:>13} {:>8} | {:>7} {:>7}",
                tokens,
                mean_rows,
                us(dispatch.eager),
                us(dispatch.graph),
                gbs(best(dispatch)),
                us(combine.eager),
                us(combine.graph),
                gbs_of(comb_bytes, best(combine)),
                us(theirs.and_then(best)),
                gbs(theirs.and_then(best)),
                ratio(theirs, dispatch),
                ratio(theirs, combine),
            );
            let mut libraries = vec![("dispatch", dispatch), ("combine", combine)];
            if let Some(t) = theirs {
                libraries.push(("NCCL rows", t));
            }
            print_calls(&format!("{tokens} tokens"), &libraries, &mut stalls);
        }
        if let Some(csv) = &mut csv {
            let key = tokens * h * 2;
            for (half, ours) in [("moe_dispatch", dispatch), ("moe_combine", combine)] {
                csv.row(half, world, "bf16", key, "doorbell", ours)?;
                if let Some(t) = theirs {
                    csv.row(half, world, "bf16", key, "NCCL rows", t)?;
                }
            }
        }
    }
    if lead {
        print_stall_summary(&stalls);
    }
    if args.low_latency_tokens > 0 {
        low_latency(
            args,
            &comm,
            &s,
            nccl.as_ref(),
            (xp, ip, wp, op),
            (nsp, nrp),
            csv.as_mut(),
        )?;
    }
    comm.bootstrap().barrier()?;
    Ok(0)
}

/// The low-latency kernels at a decode batch: us per call (max over ranks) and GB/s by DeepEP's
/// low-latency definition (valid selections x hidden x 2 bytes, bf16 both ways), beside NCCL
/// moving the same rows.
fn low_latency(
    args: &Args,
    comm: &Arc<Communicator>,
    s: &Arc<cudarc::driver::CudaStream>,
    nccl: Option<&Nccl>,
    (xp, ip, wp, op): (u64, u64, u64, u64),
    (nsp, nrp): (u64, u64),
    csv: Option<&mut TimingCsv>,
) -> Result<()> {
    let (rank, world) = (comm.rank(), comm.world_size());
    let (tokens, h, k) = (args.low_latency_tokens, args.hidden, args.topk);
    let ll = MoeLowLatency::new(
        comm,
        MoeConfig::new(h, k, args.experts, tokens).with_blocks(args.sms),
    )?;
    let mine = routing(rank, tokens, k, args.experts);
    let weights = vec![1.0f32 / k as f32; tokens * k];
    let xs: Vec<u16> = (0..tokens * h).map(|i| 0x3f80 + (i % 64) as u16).collect();
    // SAFETY: the main sweep sized these for at least `tokens` rows (max_tokens covers the
    // low-latency batch, see run()).
    unsafe {
        cudarc::driver::result::memcpy_htod_async(xp, &xs, s.cu_stream())
            .map_err(cuda("cuMemcpyHtoD"))?;
        cudarc::driver::result::memcpy_htod_async(ip, &mine, s.cu_stream())
            .map_err(cuda("cuMemcpyHtoD"))?;
        cudarc::driver::result::memcpy_htod_async(wp, &weights, s.cu_stream())
            .map_err(cuda("cuMemcpyHtoD"))?;
    }
    comm.synchronize(s)?;
    let per_rank = args.experts / world;
    // Selections each rank sends each rank.
    let sel: Vec<Vec<usize>> = (0..world)
        .map(|r| {
            let mut v = vec![0usize; world];
            for &e in &routing(r, tokens, k, args.experts) {
                if e >= 0 {
                    v[e as usize / per_rank] += 1;
                }
            }
            v
        })
        .collect();
    let mean_sel = sel.iter().flatten().sum::<usize>() as f64 / world as f64;
    let bytes = mean_sel * h as f64 * 2.0;
    let repeat = Repeat {
        iters: args.iters.max(50),
        warmup: 5,
        no_eager: false,
    };
    // SAFETY (all calls): inputs hold `tokens` rows; out holds `tokens` rows.
    let dispatch = measure(comm, s, bytes as usize, repeat, &|st| unsafe {
        ll.dispatch_raw(st, xp, ip, wp, tokens)
    })?;
    let combine = measure(comm, s, bytes as usize, repeat, &|st| unsafe {
        ll.combine_raw(st, op)
    })?;
    let theirs = match nccl {
        Some(n) => {
            let offsets = |c: &[usize]| -> Vec<usize> {
                c.iter()
                    .scan(0, |a, &v| {
                        let o = *a;
                        *a += v * h;
                        Some(o)
                    })
                    .collect()
            };
            let recv: Vec<usize> = (0..world).map(|src| sel[src][rank]).collect();
            let (sc, rc) = (
                sel[rank].iter().map(|&r| r * h).collect::<Vec<_>>(),
                recv.iter().map(|&r| r * h).collect::<Vec<_>>(),
            );
            let (so, ro) = (offsets(&sel[rank]), offsets(&recv));
            Some(measure(comm, s, bytes as usize, repeat, &|st| unsafe {
                n.all_to_all_v(st, nsp, nrp, &sc, &so, &rc, &ro, DataType::Bf16)
            })?)
        }
        None => None,
    };
    if rank == 0 {
        let best = |t: Timing| match (t.eager, t.graph) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        let us = |t: Option<f64>| t.map_or("-".into(), |t| format!("{t:.1}"));
        let gbs = |t: Option<f64>| t.map_or("-".into(), |t| format!("{:.1}", bytes / t / 1e3));
        println!(
            "# low-latency kernels (per-expert layout, bf16): {tokens} tokens per rank, {mean_sel:.0} selections per rank; GB/s = selections x hidden x 2 B / us (DeepEP's low-latency definition)"
        );
        println!(
            "{:>7} | {:>9} {:>9} {:>8} | {:>9} {:>9} {:>8} | {:>13} {:>8}",
            "tokens",
            "disp us",
            "graph us",
            "GB/s",
            "comb us",
            "graph us",
            "GB/s",
            "NCCL rows us",
            "GB/s"
        );
        println!(
            "{:>7} | {:>9} {:>9} {:>8} | {:>9} {:>9} {:>8} | {:>13} {:>8}",
            tokens,
            us(dispatch.eager),
            us(dispatch.graph),
            gbs(best(dispatch)),
            us(combine.eager),
            us(combine.graph),
            gbs(best(combine)),
            us(theirs.and_then(best)),
            gbs(theirs.and_then(best)),
        );
        let mut found = Vec::new();
        let mut libraries = vec![("dispatch", dispatch), ("combine", combine)];
        if let Some(t) = theirs {
            libraries.push(("NCCL rows", t));
        }
        print_calls(
            &format!("low-latency {tokens} tokens"),
            &libraries,
            &mut found,
        );
        print_stall_summary(&found);
    }
    if let Some(csv) = csv {
        let key = tokens * h * 2;
        for (half, ours) in [("moe_ll_dispatch", dispatch), ("moe_ll_combine", combine)] {
            csv.row(half, world, "bf16", key, "doorbell", ours)?;
            if let Some(t) = theirs {
                csv.row(half, world, "bf16", key, "NCCL rows", t)?;
            }
        }
    }
    Ok(())
}
