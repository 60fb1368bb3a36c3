//! Timing shared by the benchmark examples: eager and CUDA-graph timing of one operation, the
//! maximum over ranks, and byte-count parsing and printing.

use cudarc::driver::sys::{
    CUevent_flags::CU_EVENT_DEFAULT, CUgraphInstantiate_flags, CUstreamCaptureMode,
};
use cudarc::driver::{CudaEvent, CudaStream, DevicePtr};
use doorbell::collectives::verify::Verifier;
use doorbell::communicator::Communicator;
use doorbell::{Error, Result};
use std::sync::Arc;

/// How much to time.
#[derive(Debug, Clone, Copy)]
pub struct Repeat {
    /// Timed iterations per eager measurement (0: by size: 200 to 1 MiB, 100 to 16 MiB, 40 to 64
    /// MiB, 10 above; enough that one host hiccup does not move an eager time by more than a few
    /// percent).
    pub iters: usize,
    /// Untimed operations before each measurement.
    pub warmup: usize,
    /// Skip eager timing.
    pub no_eager: bool,
}

/// One library's timings at one size: us per operation, the maximum over ranks; `None` where
/// not measured. Build it with `Timing { graph, ..Timing::default() }` (fields may be added).
#[derive(Debug, Clone, Copy, Default)]
#[non_exhaustive]
pub struct Timing {
    /// Operations captured in a CUDA graph and replayed.
    pub graph: Option<f64>,
    /// Back-to-back launches.
    pub eager: Option<f64>,
    /// Single calls inside a graph (an event between every two captured calls).
    pub graph_calls: Option<Spread>,
    /// Single eager calls (an event between every two launches).
    pub eager_calls: Option<Spread>,
}

/// A call slower than this many times its size's median is a stall.
pub const STALL_FACTOR: f64 = 5.0;

/// How single calls of one size spread, in us: a mean cannot tell one 10 ms stall from a slow
/// kernel. Percentiles by nearest rank; over ranks, each field is the largest any rank saw.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Spread {
    /// Median call.
    pub p50: f64,
    /// 99th percentile.
    pub p99: f64,
    /// Slowest call.
    pub max: f64,
    /// Calls timed.
    pub calls: usize,
    /// Calls slower than [`STALL_FACTOR`] x the median.
    pub stalls: usize,
}

impl Spread {
    /// The spread of `us` (per-call times); `None` when empty.
    pub fn of(mut us: Vec<f64>) -> Option<Spread> {
        if us.is_empty() {
            return None;
        }
        us.sort_by(f64::total_cmp);
        let rank = |q: f64| us[((q * us.len() as f64).ceil() as usize).clamp(1, us.len()) - 1];
        let p50 = rank(0.50);
        Some(Spread {
            p50,
            p99: rank(0.99),
            max: us[us.len() - 1],
            calls: us.len(),
            stalls: us.iter().filter(|&&t| t > STALL_FACTOR * p50).count(),
        })
    }

    /// `p50/p99/max`, with the stall count when there are stalls.
    pub fn text(&self) -> String {
        let mut t = format!("{:.2}/{:.2}/{:.2}", self.p50, self.p99, self.max);
        if self.stalls > 0 {
            t.push_str(&format!(" STALL x{}", self.stalls));
        }
        t
    }
}

/// The per-call columns of one row: for each library, graph and eager `p50/p99/max` (us), each
/// followed by `STALL xN` where N calls took more than [`STALL_FACTOR`] x the median.
pub fn call_columns(libraries: &[(&str, Timing)]) -> String {
    let one = |s: Option<Spread>| s.map_or("-".into(), |s| s.text());
    libraries
        .iter()
        .map(|(name, t)| format!("{name}: g {} e {}", one(t.graph_calls), one(t.eager_calls)))
        .collect::<Vec<_>>()
        .join(" | ")
}

/// The stalls of `libraries` at one size, as `library mode (N calls, max M us, median P us)`.
pub fn stalls(libraries: &[(&str, Timing)]) -> Vec<String> {
    let mut found = Vec::new();
    for (name, t) in libraries {
        for (mode, s) in [("graph", t.graph_calls), ("eager", t.eager_calls)] {
            if let Some(s) = s.filter(|s| s.stalls > 0) {
                found.push(format!(
                    "{name} {mode} ({} of {} calls > {STALL_FACTOR} x median {:.2} us, max {:.2} us)",
                    s.stalls, s.calls, s.p50, s.max
                ));
            }
        }
    }
    found
}

/// Prints one row's per-call line (`#   calls ...`, see [`call_columns`]) and adds the row's
/// stalls, prefixed with `what` (a size or a phase), to `found`.
pub fn print_calls(what: &str, libraries: &[(&str, Timing)], found: &mut Vec<String>) {
    println!(
        "#   calls (us, p50/p99/max) {what}: {}",
        call_columns(libraries)
    );
    found.extend(
        stalls(libraries)
            .into_iter()
            .map(|s| format!("{what}: {s}")),
    );
}

/// doorbell's timing and, where it ran, NCCL's: the libraries of a row for [`print_calls`].
pub fn ours_and_nccl(ours: Timing, nccl: Option<Timing>) -> Vec<(&'static str, Timing)> {
    std::iter::once(("doorbell", ours))
        .chain(nccl.map(|t| ("NCCL", t)))
        .collect()
}

/// The sweep's last line about stalls: `# stalls: none` or `# STALLS: ...` (one per library, mode
/// and size).
pub fn print_stall_summary(found: &[String]) {
    if found.is_empty() {
        println!("# stalls: none (no call above {STALL_FACTOR} x its size's median)");
    } else {
        println!("# STALLS: {}", found.join("; "));
    }
}

/// Times `op` eagerly (back-to-back launches between two events) and in a CUDA graph (k
/// operations captured once, replayed; k = 20 up to 1 MiB, 5 above), every rank starting after a
/// barrier, the launches queued behind a hold kernel so host jitter stays out (a timing whose hold
/// ran out on some rank before its host had queued everything is taken again, up to
/// `HOLD_TRIES` times); returns the maximum over ranks. `bytes` picks the iteration counts.
///
/// Then single calls, so that a stall cannot hide in a mean: the same number of eager launches
/// with an event between every two, and one graph of k x r captured calls with a clock kernel
/// (`Verifier::stamp`, the GPU's global timer) between every two, replayed once untimed, then
/// timed. The first call of each sequence is left out of the spread: it starts right after a host
/// barrier and absorbs the ranks' skew in leaving it, which is the harness's, not the library's.
/// Both clocks add their own cost to every call (an event record eagerly, a one-thread kernel in
/// the graph, about half a microsecond): compare a spread's p99 and max with its own p50.
pub fn measure(
    comm: &Communicator,
    s: &Arc<CudaStream>,
    bytes: usize,
    repeat: Repeat,
    op: &dyn Fn(&Arc<CudaStream>) -> Result<()>,
) -> Result<Timing> {
    let big = bytes > (1 << 20);
    let iters = if repeat.iters > 0 {
        repeat.iters
    } else if bytes <= 1 << 20 {
        200
    } else if bytes <= 16 << 20 {
        100
    } else if bytes <= 64 << 20 {
        40
    } else {
        10
    };
    // Eager launches and graph replays queue behind a hold (one GPU thread sleeping longer than
    // the host takes to enqueue them all), so the host's scheduling jitter (a thread descheduled
    // for 60-450 us now and then, seen in every library's eager columns alike; once a 33 us gap
    // between two graph replays at 32 MiB) stays out of the means and the single calls; the GPU
    // then runs what is queued back to back, as in a training step whose host runs ahead.
    let clock = Verifier::new(comm.gpu())?;
    let hold = std::time::Duration::from_micros(2000 + 20 * iters as u64);
    // A timing whose hold ran out on some rank before its host had queued everything measured
    // that host's pace for a while (on 2 x H100, 20 of 199 single calls once took 85 us against
    // a median of 7.2): it is taken again, up to HOLD_TRIES times.
    let time = |f: &dyn Fn() -> Result<()>, n: usize| -> Result<f64> {
        let mut attempt = 1;
        loop {
            comm.synchronize(s)?;
            comm.bootstrap().barrier()?;
            clock.delay(s, hold)?;
            let start = s
                .record_event(Some(CU_EVENT_DEFAULT))
                .map_err(cuda("cuEventRecord"))?;
            f()?;
            let stop = s
                .record_event(Some(CU_EVENT_DEFAULT))
                .map_err(cuda("cuEventRecord"))?;
            let held = held_everywhere(comm, &start)?;
            comm.synchronize(s)?;
            if held || attempt == HOLD_TRIES {
                let ms = start
                    .elapsed_ms(&stop)
                    .map_err(cuda("cuEventElapsedTime"))?;
                return Ok(ms as f64 * 1e3 / n as f64);
            }
            attempt += 1;
        }
    };
    for _ in 0..repeat.warmup {
        op(s)?;
    }
    let (eager, eager_calls) = if repeat.no_eager {
        (None, None)
    } else {
        let mean = time(
            &|| {
                for _ in 0..iters {
                    op(s)?;
                }
                Ok(())
            },
            iters,
        )?;
        let marks = events(s, iters + 1)?;
        for attempt in 1..=HOLD_TRIES {
            comm.synchronize(s)?;
            comm.bootstrap().barrier()?;
            clock.delay(s, hold)?;
            for (i, mark) in marks.iter().enumerate() {
                record(mark, s)?;
                if i < iters {
                    op(s)?;
                }
            }
            let held = held_everywhere(comm, &marks[0])?;
            comm.synchronize(s)?;
            if held || attempt == HOLD_TRIES {
                break;
            }
        }
        (Some(mean), Spread::of(intervals(&marks)?))
    };
    let (k, r) = if big {
        (5, (iters / 5).max(2))
    } else {
        (20, 20)
    };
    comm.synchronize(s)?;
    s.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
        .map_err(cuda("cuStreamBeginCapture"))?;
    let captured: Result<()> = (0..k).try_for_each(|_| op(s));
    let graph = s
        .end_capture(CUgraphInstantiate_flags(0))
        .map_err(cuda("cuStreamEndCapture"))?;
    captured?;
    let graph = graph.ok_or_else(|| Error::invalid("graph", "capture produced no graph"))?;
    graph.launch().map_err(cuda("cuGraphLaunch"))?;
    let g = time(
        &|| {
            for _ in 0..r {
                // A replay runs no doorbell host code: ask the communicator between replays, so
                // a fault stops the loop instead of queueing replays that cannot succeed.
                comm.check_health()?;
                graph.launch().map_err(cuda("cuGraphLaunch"))?;
            }
            Ok(())
        },
        k * r,
    )?;
    drop(graph);
    // Single calls in a graph: k x r calls with a clock kernel before each and after the last.
    let n = k * r;
    let stamps = s.alloc_zeros::<u64>(n + 1).map_err(cuda("cuMemAlloc"))?;
    // Taken before the capture (cudarc orders a slice's pointer after the slice's last use).
    let at = stamps.device_ptr(s).0;
    comm.synchronize(s)?;
    s.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
        .map_err(cuda("cuStreamBeginCapture"))?;
    let captured: Result<()> = (0..=n).try_for_each(|i| {
        // SAFETY: `stamps` holds n + 1 u64s and outlives every replay below.
        unsafe { clock.stamp(s, at + 8 * i as u64)? };
        if i < n {
            op(s)?;
        }
        Ok(())
    });
    let calls_graph = s
        .end_capture(CUgraphInstantiate_flags(0))
        .map_err(cuda("cuStreamEndCapture"))?;
    captured?;
    let calls_graph =
        calls_graph.ok_or_else(|| Error::invalid("graph", "capture produced no graph"))?;
    calls_graph.launch().map_err(cuda("cuGraphLaunch"))?;
    comm.synchronize(s)?;
    comm.bootstrap().barrier()?;
    calls_graph.launch().map_err(cuda("cuGraphLaunch"))?;
    comm.synchronize(s)?;
    let ns = s.clone_dtoh(&stamps).map_err(cuda("cuMemcpyDtoH"))?;
    let graph_calls = Spread::of(
        ns.windows(2)
            .skip(1)
            .map(|w| w[1].saturating_sub(w[0]) as f64 / 1e3)
            .collect(),
    );
    Ok(Timing {
        graph: Some(max_over_ranks(comm, g)?),
        eager: match eager {
            Some(e) => Some(max_over_ranks(comm, e)?),
            None => None,
        },
        graph_calls: spread_over_ranks(comm, graph_calls)?,
        eager_calls: match eager_calls {
            Some(c) => spread_over_ranks(comm, Some(c))?,
            None => None,
        },
    })
}

/// How many times [`measure`] takes a timing whose hold ran out before the host had queued it.
const HOLD_TRIES: usize = 3;

/// Whether, on every rank, the hold in front of a timing was still running when the host had
/// queued the whole timing (`first`: the event recorded right after the hold, not yet reached).
/// Otherwise the GPU waited for some host inside the timing. Collective (one bootstrap exchange).
fn held_everywhere(comm: &Communicator, first: &CudaEvent) -> Result<bool> {
    let mine = !first.try_is_complete().map_err(cuda("cuEventQuery"))?;
    let all = comm.bootstrap().all_gather(&[u8::from(mine)])?;
    Ok(all.iter().all(|b| b.first() == Some(&1)))
}

/// `n` timing events.
fn events(s: &Arc<CudaStream>, n: usize) -> Result<Vec<CudaEvent>> {
    (0..n)
        .map(|_| {
            s.context()
                .new_event(Some(CU_EVENT_DEFAULT))
                .map_err(cuda("cuEventCreate"))
        })
        .collect()
}

/// Records `e` on `s`.
fn record(e: &CudaEvent, s: &Arc<CudaStream>) -> Result<()> {
    e.record(s).map_err(cuda("cuEventRecord"))
}

/// The times between consecutive events, in us, leaving out the first (see [`measure`]).
fn intervals(marks: &[CudaEvent]) -> Result<Vec<f64>> {
    marks
        .windows(2)
        .skip(1)
        .map(|w| {
            w[0].elapsed_ms(&w[1])
                .map(|ms| ms as f64 * 1e3)
                .map_err(cuda("cuEventElapsedTime"))
        })
        .collect()
}

/// Each field of `s` at its largest over ranks, stalls summed (collective; every rank passes
/// `Some` or every rank `None`).
pub fn spread_over_ranks(comm: &Communicator, s: Option<Spread>) -> Result<Option<Spread>> {
    let Some(s) = s else { return Ok(None) };
    let mut mine = Vec::with_capacity(40);
    for v in [s.p50, s.p99, s.max, s.calls as f64, s.stalls as f64] {
        mine.extend_from_slice(&v.to_le_bytes());
    }
    let all = comm.bootstrap().all_gather(&mine)?;
    let mut out = Spread::default();
    for b in &all {
        let f: Vec<f64> = b
            .chunks_exact(8)
            .filter_map(|c| c.try_into().ok().map(f64::from_le_bytes))
            .collect();
        if let [p50, p99, max, calls, stalls] = f[..] {
            out.p50 = out.p50.max(p50);
            out.p99 = out.p99.max(p99);
            out.max = out.max.max(max);
            out.calls = out.calls.max(calls as usize);
            out.stalls += stalls as usize;
        }
    }
    Ok(Some(out))
}

/// The largest `v` over all ranks (collective).
pub fn max_over_ranks(comm: &Communicator, v: f64) -> Result<f64> {
    let all = comm.bootstrap().all_gather(&v.to_le_bytes())?;
    Ok(all
        .iter()
        .filter_map(|b| b.as_slice().try_into().ok().map(f64::from_le_bytes))
        .fold(0.0, f64::max))
}

/// The sum of `v` over all ranks (collective).
pub fn sum_over_ranks(comm: &Communicator, v: u64) -> Result<u64> {
    let all = comm.bootstrap().all_gather(&v.to_le_bytes())?;
    Ok(all
        .iter()
        .filter_map(|b| b.as_slice().try_into().ok().map(u64::from_le_bytes))
        .sum())
}

/// Parses a byte count: `8`, `64K`, `1M`, `1GiB`.
pub fn parse_size(s: &str) -> Result<usize> {
    let t = s.trim().to_ascii_uppercase();
    let t = t.trim_end_matches("IB").trim_end_matches('B');
    let (num, mult) = match t.chars().last() {
        Some('K') => (&t[..t.len() - 1], 1usize << 10),
        Some('M') => (&t[..t.len() - 1], 1 << 20),
        Some('G') => (&t[..t.len() - 1], 1 << 30),
        _ => (t, 1),
    };
    num.parse::<usize>()
        .ok()
        .and_then(|n| n.checked_mul(mult))
        .filter(|&n| n > 0)
        .ok_or_else(|| {
            Error::invalid(
                "size",
                format!("{s:?}: expected a byte count like 8, 64K, 1G"),
            )
        })
}

/// A byte count as nccl-tests prints it in our tables: `8`, `64K`, `1G`.
pub fn human(bytes: usize) -> String {
    match bytes {
        b if b >= 1 << 30 && b % (1 << 30) == 0 => format!("{}G", b >> 30),
        b if b >= 1 << 20 && b % (1 << 20) == 0 => format!("{}M", b >> 20),
        b if b >= 1 << 10 && b % (1 << 10) == 0 => format!("{}K", b >> 10),
        b => format!("{b}"),
    }
}

/// The sizes of a sweep: `min`, `min * factor`, ... up to `max`.
pub fn sweep(min: usize, max: usize, factor: usize) -> Vec<usize> {
    let mut v = Vec::new();
    let mut b = min;
    while b <= max {
        v.push(b);
        match b.checked_mul(factor.max(2)) {
            Some(n) => b = n,
            None => break,
        }
    }
    v
}

/// An SM budget for NCCL beside doorbell (`--sms N`): at most `sms` CTAs per NCCL kernel
/// (`NCCL_MAX_CTAS`, and `NCCL_MIN_CTAS` lowered to it where set higher), as NCCL reads them when
/// a communicator starts. Call from `main` before any thread or rank starts: ranks the example
/// spawns inherit the variables.
pub fn limit_nccl_ctas(sms: u32) {
    let sms = sms.max(1);
    // Before any other thread exists (see above), so nothing reads the environment meanwhile.
    std::env::set_var("NCCL_MAX_CTAS", sms.to_string());
    let min = std::env::var("NCCL_MIN_CTAS")
        .ok()
        .and_then(|v| v.trim().parse::<u32>().ok());
    if min.is_some_and(|m| m > sms) {
        std::env::set_var("NCCL_MIN_CTAS", sms.to_string());
    }
}

/// An all-to-all's blocks within an SM budget of `sms` among `peers` other ranks: (blocks per
/// peer, blocks copying the rank's own block), each at least 1 and together at most `sms` when
/// `sms >= peers + 1`. The own copy gets what a peer gets, at most 4 (the library's default).
pub fn alltoall_lanes(sms: u32, peers: u32) -> (u32, u32) {
    let shares = peers + 1;
    let own = (sms / shares).clamp(1, 4);
    let lanes = (sms.saturating_sub(own) / peers.max(1)).max(1);
    (lanes, own)
}

/// Timings as CSV, for a driver that merges them with other libraries' measured in another
/// process (`python -m doorbell.peers`): a header, then one line per size and library,
/// `collective,ranks,dtype,bytes,library,graph_us,eager_us`, then the single calls' spread per
/// mode (`graph_p50,graph_p99,graph_max,graph_stalls,eager_p50,...`, see [`Spread`]); empty where
/// not measured. The file is rewritten after every line, so a run cut short keeps what it
/// measured.
pub struct TimingCsv {
    path: std::path::PathBuf,
    text: String,
}

impl TimingCsv {
    /// The header line.
    pub const HEADER: &'static str = "collective,ranks,dtype,bytes,library,graph_us,eager_us,\
         graph_p50,graph_p99,graph_max,graph_stalls,eager_p50,eager_p99,eager_max,eager_stalls";

    /// A CSV for `path` (nothing is written until the first row).
    pub fn new(path: &std::path::Path) -> Self {
        TimingCsv {
            path: path.to_path_buf(),
            text: format!("{}\n", Self::HEADER),
        }
    }

    /// Adds `library`'s timing of one size and rewrites the file.
    pub fn row(
        &mut self,
        collective: &str,
        ranks: usize,
        dtype: &str,
        bytes: usize,
        library: &str,
        t: Timing,
    ) -> Result<()> {
        let us = |v: Option<f64>| v.map_or(String::new(), |x| format!("{x:.3}"));
        let spread = |s: Option<Spread>| match s {
            Some(s) => format!("{:.3},{:.3},{:.3},{}", s.p50, s.p99, s.max, s.stalls),
            None => ",,,".into(),
        };
        self.text.push_str(&format!(
            "{collective},{ranks},{dtype},{bytes},{library},{},{},{},{}\n",
            us(t.graph),
            us(t.eager),
            spread(t.graph_calls),
            spread(t.eager_calls),
        ));
        std::fs::write(&self.path, &self.text)
            .map_err(|e| Error::io(format!("writing {}", self.path.display()), e))
    }

    /// What the file holds (or will hold).
    pub fn text(&self) -> &str {
        &self.text
    }
}

/// Maps a CUDA driver error to doorbell's, naming the driver call (for `map_err`).
pub fn cuda(call: &'static str) -> impl Fn(cudarc::driver::DriverError) -> Error {
    move |e| Error::Cuda {
        call,
        code: e.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timing_csv_writes_a_line_per_library_and_size() {
        let path = std::env::temp_dir().join(format!("doorbell-csv-{}.csv", std::process::id()));
        let mut csv = TimingCsv::new(&path);
        let t = Timing {
            graph: Some(12.5),
            graph_calls: Spread::of(vec![12.0, 13.0, 80.0]),
            ..Timing::default()
        };
        csv.row("allreduce", 4, "bf16", 1024, "doorbell", t)
            .unwrap();
        csv.row("allreduce", 4, "bf16", 1024, "NCCL", Timing::default())
            .unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        std::fs::remove_file(&path).unwrap();
        assert_eq!(
            text,
            "collective,ranks,dtype,bytes,library,graph_us,eager_us,graph_p50,graph_p99,graph_max,\
             graph_stalls,eager_p50,eager_p99,eager_max,eager_stalls\n\
             allreduce,4,bf16,1024,doorbell,12.500,,13.000,80.000,80.000,1,,,,\n\
             allreduce,4,bf16,1024,NCCL,,,,,,,,,,\n"
        );
        assert_eq!(csv.text(), text);
    }

    #[test]
    fn a_call_above_five_medians_is_a_stall() {
        let mut calls = vec![3.0; 98];
        calls.extend([14.0, 900.0]);
        let s = Spread::of(calls).unwrap();
        assert_eq!(
            (s.p50, s.p99, s.max, s.calls, s.stalls),
            (3.0, 14.0, 900.0, 100, 1)
        );
        assert_eq!(s.text(), "3.00/14.00/900.00 STALL x1");
        let steady = Spread::of(vec![5.0, 5.5, 6.0]).unwrap();
        assert_eq!(steady.stalls, 0);
        assert!(Spread::of(Vec::new()).is_none());
        let t = Timing {
            eager_calls: Some(s),
            graph_calls: Some(steady),
            ..Timing::default()
        };
        let found = stalls(&[("doorbell", t)]);
        assert_eq!(found.len(), 1);
        assert!(
            found[0].starts_with("doorbell eager (1 of 100 calls"),
            "{found:?}"
        );
        assert_eq!(
            call_columns(&[("doorbell", t)]),
            "doorbell: g 5.50/6.00/6.00 e 3.00/14.00/900.00 STALL x1"
        );
    }

    #[test]
    fn alltoall_lanes_stay_within_the_budget() {
        assert_eq!(alltoall_lanes(16, 3), (4, 4));
        assert_eq!(alltoall_lanes(8, 3), (2, 2));
        assert_eq!(alltoall_lanes(4, 3), (1, 1));
        assert_eq!(alltoall_lanes(132, 3), (42, 4));
        assert_eq!(alltoall_lanes(32, 1), (28, 4));
        for sms in [2u32, 4, 8, 16, 24, 32, 132] {
            for peers in 1..8u32 {
                let (lanes, own) = alltoall_lanes(sms, peers);
                assert!(lanes >= 1 && own >= 1);
                if sms > peers {
                    assert!(lanes * peers + own <= sms, "{sms} SMs, {peers} peers");
                }
            }
        }
    }

    #[test]
    fn sizes_parse_and_print() {
        assert_eq!(parse_size("8").unwrap(), 8);
        assert_eq!(parse_size("64K").unwrap(), 64 << 10);
        assert_eq!(parse_size("1GiB").unwrap(), 1 << 30);
        assert!(parse_size("0").is_err());
        assert!(parse_size("lots").is_err());
        assert_eq!(human(64 << 10), "64K");
        assert_eq!(human(1 << 30), "1G");
        assert_eq!(human(1000), "1000");
        assert_eq!(sweep(8, 64, 2), vec![8, 16, 32, 64]);
    }
}
