//! Allreduce benchmark: doorbell beside NCCL (default and symmetric-registered buffers) in the
//! same process layout and the same run, with nccl-tests columns, CUDA-graph and eager timing,
//! the maximum over ranks, and the speedup over the faster NCCL mode.
//!
//! Started without a launcher it spawns one rank per visible GPU (`--nranks N` overrides; ranks
//! may share a GPU for functional runs); under torchrun/srun/mpirun it runs as the given rank.
//!
//! ```text
//! cargo run --release --example allreduce -- --check --plot allreduce.png
//! ```

use clap::Parser;
use cudarc::driver::{CudaSlice, DevicePtr};
use doorbell::collectives::allreduce::{Algorithm, AllReduce, AllReduceOptions};
use doorbell::collectives::verify::Verifier;
use doorbell::collectives::DataType;
use doorbell::communicator::Communicator;
use doorbell::gpu::cuda::device_count;
use doorbell::job::launch::run_job;
use doorbell::{Error, Result};
use doorbell_bench::harness::{
    cuda, human, limit_nccl_ctas, measure, parse_size, print_calls, print_stall_summary,
    sum_over_ranks, sweep, Repeat, Timing, TimingCsv,
};
use doorbell_bench::nccl::Nccl;
use doorbell_bench::plot::{Chart, Panel, Series};
use std::io::Write;
use std::sync::Arc;

#[derive(Parser, Debug)]
#[command(about = "Allreduce (sum): doorbell vs NCCL, nccl-tests columns, graph and eager timing")]
struct Args {
    /// Ranks to spawn when no launcher started us (default: one per visible GPU).
    #[arg(long)]
    nranks: Option<usize>,
    /// Element type: bf16, f16 or f32.
    #[arg(long, default_value = "bf16")]
    dtype: String,
    /// Smallest message (bytes; K, M, G suffixes).
    #[arg(long, default_value = "8")]
    min_bytes: String,
    /// Largest message.
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
    /// Validate every size with rank- and index-derived inputs; exit non-zero on a wrong element.
    #[arg(long)]
    check: bool,
    /// Sum in place (output = input) instead of out of place.
    #[arg(long)]
    inplace: bool,
    /// Doorbell's buffers are registered windows (`AllReduce::register_window`, as torch's
    /// symmetric memory and NCCL's symmetric column): calls above 4 MiB (2 ranks) run the two-shot straight
    /// between them, nothing staged.
    #[arg(long)]
    windows: bool,
    /// Force a doorbell algorithm (oneshot-ll8, oneshot-ll16, twoshot-ll8, twoshot-ll16,
    /// twoshot-sentinel, pipelined, twoshot-direct: the last needs --windows).
    #[arg(long)]
    algo: Option<String>,
    /// Pipeline lanes (blocks), at most one per SM (default: the library's).
    #[arg(long)]
    lanes: Option<u32>,
    /// Largest pipeline tile shard in KiB (default: what the scratch budget allows).
    #[arg(long)]
    tile_kib: Option<usize>,
    /// Threads per block of the pipelined kernel (default: the library's).
    #[arg(long)]
    threads: Option<u32>,
    /// Blocks of every LL launch (default: the library's).
    #[arg(long)]
    ll_blocks: Option<u32>,
    /// Bytes of one sender's slot of the sentinel two-shot, in MiB (its largest message is the
    /// rank count x this; default: the library's).
    #[arg(long)]
    sentinel_slot_mib: Option<usize>,
    /// SM budget: every doorbell kernel runs at most this many blocks (pipeline lanes and LL
    /// blocks, unless --lanes / --ll-blocks say otherwise) and NCCL at most this many CTAs
    /// (NCCL_MAX_CTAS) in the same run.
    #[arg(long)]
    sms: Option<u32>,
    /// Skip NCCL.
    #[arg(long)]
    no_nccl: bool,
    /// Skip eager timing (graph only).
    #[arg(long)]
    no_eager: bool,
    /// Draw latency and busbw against size for both libraries into this PNG.
    #[arg(long)]
    plot: Option<std::path::PathBuf>,
    /// Also write the table as Markdown to this file.
    #[arg(long)]
    markdown: Option<std::path::PathBuf>,
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
    run_job("allreduce", args.nranks, device_count, || run(&args))
}

struct Row {
    bytes: usize,
    count: usize,
    doorbell: Timing,
    algo: &'static str,
    wrong: u64,
    nccl: Timing,
    nccl_symm: Timing,
    nccl_wrong: Option<u64>,
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
    let rank = comm.rank();
    let world = comm.world_size();
    let lead = rank == 0;
    let algorithm = args
        .algo
        .as_deref()
        .map(str::parse::<Algorithm>)
        .transpose()?;
    let defaults = AllReduceOptions::default();
    let ar = AllReduce::new(
        &comm,
        AllReduceOptions {
            algorithm,
            max_lanes: args.lanes.or(args.sms).unwrap_or(defaults.max_lanes),
            max_tile_bytes: args.tile_kib.map(|k| k << 10).or(defaults.max_tile_bytes),
            pipeline_threads: args.threads.unwrap_or(defaults.pipeline_threads),
            ll_blocks: args.ll_blocks.or(args.sms).unwrap_or(defaults.ll_blocks),
            sentinel_slot_bytes: args
                .sentinel_slot_mib
                .map_or(defaults.sentinel_slot_bytes, |m| m << 20),
            ..defaults
        },
    )?;
    let checker = Verifier::new(comm.gpu())?;
    let s = comm.gpu().new_stream()?;
    let nccl = Nccl::optional(comm.bootstrap(), comm.gpu(), args.no_nccl);
    let symm = match &nccl {
        Some(n) => match (n.symmetric_buffer(max_bytes), n.symmetric_buffer(max_bytes)) {
            (Ok(a), Ok(b)) => Some((a, b)),
            (Err(e), _) | (_, Err(e)) => {
                if lead {
                    eprintln!("NCCL symmetric buffers unavailable, default NCCL only: {e}");
                }
                None
            }
        },
        None => None,
    };
    let input: CudaSlice<u8> = s.alloc_zeros(max_bytes).map_err(cuda("cuMemAlloc"))?;
    let output: CudaSlice<u8> = s.alloc_zeros(max_bytes).map_err(cuda("cuMemAlloc"))?;
    // With --windows, doorbell's buffers are registered windows instead (every peer maps them).
    let windows = if args.windows {
        let (a, b) = (comm.alloc(max_bytes)?, comm.alloc(max_bytes)?);
        a.fill(0, max_bytes, 0)?;
        b.fill(0, max_bytes, 0)?;
        ar.register_window(&a)?;
        ar.register_window(&b)?;
        Some((a, b))
    } else {
        None
    };
    let (in_ptr, out_ptr) = match &windows {
        Some((a, b)) => (a.device_ptr(), b.device_ptr()),
        None => (input.device_ptr(&s).0, output.device_ptr(&s).0),
    };
    let out_ptr = if args.inplace { in_ptr } else { out_ptr };

    if lead {
        println!(
            "# doorbell allreduce: {world} ranks, {} GPU(s) visible, {}, {}{}, NVLS {}, SMs {}",
            device_count().unwrap_or(0),
            dtype.name(),
            if args.inplace {
                "in place"
            } else {
                "out of place"
            },
            if args.windows {
                ", doorbell on registered windows"
            } else {
                ""
            },
            std::env::var("NCCL_NVLS_ENABLE")
                .map_or("default".into(), |v| format!("NCCL_NVLS_ENABLE={v}")),
            args.sms.map_or("all".into(), |n| format!(
                "at most {n} (doorbell blocks, NCCL_MAX_CTAS={n})"
            ))
        );
        if let Some(n) = &nccl {
            println!(
                "# NCCL {} loaded at run time; speedup = faster NCCL mode / doorbell",
                n.version()
            );
        }
        println!("# times in us, max over ranks; busbw in GB/s = 2(n-1)/n * size / time");
    }

    // Warm-up (clocks, caches, lazily created driver state) before the first measured row.
    for _ in 0..200 {
        // SAFETY: both buffers hold max_bytes >= 8 bytes.
        unsafe { ar.run_raw(&s, in_ptr, out_ptr, 8 / dtype.size(), dtype)? };
        if let Some(n) = &nccl {
            // SAFETY: as above.
            unsafe { n.all_reduce(&s, in_ptr, out_ptr, 8 / dtype.size(), dtype)? };
        }
    }
    comm.synchronize(&s)?;

    let sizes = sweep(min_bytes, max_bytes, args.factor);
    let repeat = Repeat {
        iters: args.iters,
        warmup: args.warmup,
        no_eager: args.no_eager,
    };
    let mut rows = Vec::new();
    let mut csv = args.csv.as_deref().filter(|_| lead).map(TimingCsv::new);
    let mut failed = false;
    let mut stalls = Vec::new();
    for (idx, &bytes) in sizes.iter().enumerate() {
        let count = (bytes / dtype.size()).max(1);
        let bytes = count * dtype.size();
        if lead {
            eprintln!(
                "progress: size {}/{} ({})",
                idx + 1,
                sizes.len(),
                human(bytes)
            );
        }
        let seed = idx as u32 + 1;
        let plan = if args.windows {
            ar.plan_registered(count, dtype)?
        } else {
            ar.plan(count, dtype)?
        };
        // Correctness first (also the warm-up for this size).
        let mut wrong = 0;
        if args.check {
            // SAFETY: both buffers hold max_bytes >= bytes.
            unsafe {
                checker.fill(&s, in_ptr, count, dtype, rank as u32, seed)?;
                ar.run_raw(&s, in_ptr, out_ptr, count, dtype)?;
                wrong = checker.count_wrong(&s, out_ptr, count, dtype, world as u32, seed)?;
            }
            wrong = sum_over_ranks(&comm, wrong)?;
            failed |= wrong > 0;
        }
        // SAFETY: as above; in place the input is refilled only by the check.
        let doorbell = measure(&comm, &s, bytes, repeat, &|st| unsafe {
            ar.run_raw(st, in_ptr, out_ptr, count, dtype)
        })?;
        let (mut nccl_t, mut symm_t, mut nccl_wrong) = (Timing::default(), Timing::default(), None);
        if let Some(n) = &nccl {
            if args.check {
                // SAFETY: as above.
                let w = unsafe {
                    checker.fill(&s, in_ptr, count, dtype, rank as u32, seed)?;
                    n.all_reduce(&s, in_ptr, out_ptr, count, dtype)?;
                    checker.count_wrong(&s, out_ptr, count, dtype, world as u32, seed)?
                };
                nccl_wrong = Some(sum_over_ranks(&comm, w)?);
            }
            // SAFETY: as above.
            nccl_t = measure(&comm, &s, bytes, repeat, &|st| unsafe {
                n.all_reduce(st, in_ptr, out_ptr, count, dtype)
            })?;
            if let Some((si, so)) = &symm {
                let (sin, sout) = (
                    si.device_ptr(),
                    if args.inplace {
                        si.device_ptr()
                    } else {
                        so.device_ptr()
                    },
                );
                // SAFETY: the symmetric buffers hold max_bytes each.
                symm_t = measure(&comm, &s, bytes, repeat, &|st| unsafe {
                    n.all_reduce(st, sin, sout, count, dtype)
                })?;
            }
        }
        if let Some(csv) = &mut csv {
            for (library, t) in [
                ("doorbell", doorbell),
                ("NCCL", nccl_t),
                ("NCCL symm", symm_t),
            ] {
                if library == "doorbell" || nccl.is_some() {
                    csv.row("allreduce", world, dtype.name(), bytes, library, t)?;
                }
            }
        }
        rows.push(Row {
            bytes,
            count,
            doorbell,
            algo: plan.algorithm.name(),
            wrong,
            nccl: nccl_t,
            nccl_symm: symm_t,
            nccl_wrong,
        });
        if lead {
            let r = rows.last().expect("just pushed");
            print_row(r, world, dtype, idx == 0);
            let mut libraries = vec![("doorbell", r.doorbell)];
            if nccl.is_some() {
                libraries.push(("NCCL", r.nccl));
                if symm.is_some() {
                    libraries.push(("NCCL symm", r.nccl_symm));
                }
            }
            print_calls(&human(bytes), &libraries, &mut stalls);
        }
    }
    if lead {
        summarize(&rows, world);
        print_stall_summary(&stalls);
        if let Some(path) = &args.markdown {
            write_markdown(path, &rows, world, dtype)?;
        }
        if let Some(path) = &args.plot {
            plot(path, &rows, world, dtype)?;
            println!("# plot written to {}", path.display());
        }
    }
    comm.bootstrap().barrier()?;
    if failed {
        if lead {
            eprintln!("allreduce: wrong results (see #wrong)");
        }
        return Ok(2);
    }
    Ok(0)
}

fn busbw(bytes: usize, world: usize, us: Option<f64>) -> Option<f64> {
    us.map(|t| bytes as f64 / t / 1e3 * 2.0 * (world as f64 - 1.0) / world as f64)
}

fn fmt_opt(v: Option<f64>, prec: usize) -> String {
    v.map_or("-".into(), |x| format!("{x:.prec$}"))
}

fn best(a: Option<f64>, b: Option<f64>) -> Option<f64> {
    match (a, b) {
        (Some(x), Some(y)) => Some(x.min(y)),
        (x, None) => x,
        (None, y) => y,
    }
}

fn speedup(nccl: Option<f64>, ours: Option<f64>) -> Option<f64> {
    Some(nccl? / ours?)
}

fn print_row(r: &Row, world: usize, dtype: DataType, header: bool) {
    if header {
        println!(
            "#{:>11} {:>11} {:>8} {:>5} | {:>12} | {:>8} {:>7} {:>8} {:>7} {:>6} | {:>8} {:>7} {:>8} {:>7} | {:>8} {:>8} | {:>7} {:>7}",
            "size", "count", "type", "redop", "algorithm",
            "graph", "busbw", "eager", "busbw", "#wrong",
            "graph", "busbw", "eager", "busbw",
            "graph", "eager",
            "x graph", "x eager"
        );
        println!(
            "#{:>11} {:>11} {:>8} {:>5} | {:>12} | {:^39} | {:^33} | {:^17} | {:^15}",
            "(B)",
            "(elements)",
            "",
            "",
            "doorbell",
            "doorbell (us, GB/s)",
            "NCCL default (us, GB/s)",
            "NCCL symmetric",
            "speedup"
        );
    }
    let nccl_best_g = best(r.nccl.graph, r.nccl_symm.graph);
    let nccl_best_e = best(r.nccl.eager, r.nccl_symm.eager);
    println!(
        "{:>12} {:>11} {:>8} {:>5} | {:>12} | {:>8} {:>7} {:>8} {:>7} {:>6} | {:>8} {:>7} {:>8} {:>7} | {:>8} {:>8} | {:>7} {:>7}",
        r.bytes,
        r.count,
        dtype.name(),
        "sum",
        r.algo,
        fmt_opt(r.doorbell.graph, 2),
        fmt_opt(busbw(r.bytes, world, r.doorbell.graph), 1),
        fmt_opt(r.doorbell.eager, 2),
        fmt_opt(busbw(r.bytes, world, r.doorbell.eager), 1),
        r.wrong,
        fmt_opt(r.nccl.graph, 2),
        fmt_opt(busbw(r.bytes, world, r.nccl.graph), 1),
        fmt_opt(r.nccl.eager, 2),
        fmt_opt(busbw(r.bytes, world, r.nccl.eager), 1),
        fmt_opt(r.nccl_symm.graph, 2),
        fmt_opt(r.nccl_symm.eager, 2),
        fmt_opt(speedup(nccl_best_g, r.doorbell.graph), 2),
        fmt_opt(speedup(nccl_best_e, r.doorbell.eager), 2),
    );
    let _ = std::io::stdout().flush();
}

fn summarize(rows: &[Row], world: usize) {
    let mut slower = Vec::new();
    for r in rows {
        for (mode, ours, theirs) in [
            (
                "graph",
                r.doorbell.graph,
                best(r.nccl.graph, r.nccl_symm.graph),
            ),
            (
                "eager",
                r.doorbell.eager,
                best(r.nccl.eager, r.nccl_symm.eager),
            ),
        ] {
            if let (Some(o), Some(t)) = (ours, theirs) {
                if o > t {
                    slower.push(format!(
                        "{} {mode} ({:.2} vs {:.2} us)",
                        human(r.bytes),
                        o,
                        t
                    ));
                }
            }
        }
    }
    let wrong: u64 = rows.iter().map(|r| r.wrong).sum();
    let nccl_wrong: u64 = rows.iter().filter_map(|r| r.nccl_wrong).sum();
    println!(
        "# {world} ranks: {} sizes, doorbell #wrong total {wrong}, NCCL #wrong total {nccl_wrong}",
        rows.len()
    );
    if slower.is_empty() {
        println!("# doorbell was faster than the faster NCCL mode at every measured size");
    } else {
        println!("# doorbell slower than NCCL at: {}", slower.join(", "));
    }
}

fn write_markdown(
    path: &std::path::Path,
    rows: &[Row],
    world: usize,
    dtype: DataType,
) -> Result<()> {
    let mut t = String::from(
        "| size | algorithm | doorbell graph us | busbw | NCCL graph us | NCCL symm graph us | speedup graph | doorbell eager us | NCCL eager us | NCCL symm eager us | speedup eager | #wrong |\n\
         |---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n"
    );
    for r in rows {
        t.push_str(&format!(
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |\n",
            human(r.bytes),
            r.algo,
            fmt_opt(r.doorbell.graph, 2),
            fmt_opt(busbw(r.bytes, world, r.doorbell.graph), 1),
            fmt_opt(r.nccl.graph, 2),
            fmt_opt(r.nccl_symm.graph, 2),
            fmt_opt(
                speedup(best(r.nccl.graph, r.nccl_symm.graph), r.doorbell.graph),
                2
            ),
            fmt_opt(r.doorbell.eager, 2),
            fmt_opt(r.nccl.eager, 2),
            fmt_opt(r.nccl_symm.eager, 2),
            fmt_opt(
                speedup(best(r.nccl.eager, r.nccl_symm.eager), r.doorbell.eager),
                2
            ),
            r.wrong
        ));
    }
    let _ = dtype;
    std::fs::write(path, t).map_err(|e| Error::io(format!("writing {}", path.display()), e))
}

fn plot(path: &std::path::Path, rows: &[Row], world: usize, dtype: DataType) -> Result<()> {
    let series = |label: &str, pick: &dyn Fn(&Row) -> Option<f64>| Series {
        label: label.to_string(),
        points: rows
            .iter()
            .filter_map(|r| pick(r).map(|v| (r.bytes as f64, v)))
            .collect(),
    };
    let chart = Chart {
        title: format!(
            "allreduce (sum), {world} ranks, {}: CUDA graph and eager",
            dtype.name()
        ),
        x_label: "message size (bytes)".into(),
        panels: vec![
            Panel {
                title: "latency".into(),
                y_label: "us".into(),
                log_y: true,
                series: vec![
                    series("doorbell graph", &|r| r.doorbell.graph),
                    series("NCCL graph", &|r| r.nccl.graph),
                    series("NCCL symm graph", &|r| r.nccl_symm.graph),
                    series("doorbell eager", &|r| r.doorbell.eager),
                    series("NCCL eager", &|r| r.nccl.eager),
                    series("NCCL symm eager", &|r| r.nccl_symm.eager),
                ],
            },
            Panel {
                title: "bus bandwidth".into(),
                y_label: "GB/s".into(),
                log_y: false,
                series: vec![
                    series("doorbell graph", &|r| {
                        busbw(r.bytes, world, r.doorbell.graph)
                    }),
                    series("NCCL graph", &|r| busbw(r.bytes, world, r.nccl.graph)),
                    series("NCCL symm graph", &|r| {
                        busbw(r.bytes, world, r.nccl_symm.graph)
                    }),
                ],
            },
        ],
    };
    chart.render_png(path)
}
