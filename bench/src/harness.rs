//! Timing shared by the benchmark examples: eager and CUDA-graph timing of one operation, the
//! maximum over ranks, and byte-count parsing and printing.

use cudarc::driver::sys::{
    CUevent_flags::CU_EVENT_DEFAULT, CUgraphInstantiate_flags, CUstreamCaptureMode,
};
use cudarc::driver::CudaStream;
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
/// not measured.
#[derive(Debug, Clone, Copy, Default)]
pub struct Timing {
    /// Operations captured in a CUDA graph and replayed.
    pub graph: Option<f64>,
    /// Back-to-back launches.
    pub eager: Option<f64>,
}

/// Times `op` eagerly (back-to-back launches between two events) and in a CUDA graph (k
/// operations captured once, replayed; k = 20 up to 1 MiB, 5 above), every rank starting after a
/// barrier; returns the maximum over ranks. `bytes` picks the iteration counts.
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
    let time = |f: &dyn Fn() -> Result<()>, n: usize| -> Result<f64> {
        comm.synchronize(s)?;
        comm.bootstrap().barrier()?;
        let start = s
            .record_event(Some(CU_EVENT_DEFAULT))
            .map_err(cuda("cuEventRecord"))?;
        f()?;
        let stop = s
            .record_event(Some(CU_EVENT_DEFAULT))
            .map_err(cuda("cuEventRecord"))?;
        comm.synchronize(s)?;
        let ms = start
            .elapsed_ms(&stop)
            .map_err(cuda("cuEventElapsedTime"))?;
        Ok(ms as f64 * 1e3 / n as f64)
    };
    for _ in 0..repeat.warmup {
        op(s)?;
    }
    let eager = if repeat.no_eager {
        None
    } else {
        Some(time(
            &|| {
                for _ in 0..iters {
                    op(s)?;
                }
                Ok(())
            },
            iters,
        )?)
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
    Ok(Timing {
        graph: Some(max_over_ranks(comm, g)?),
        eager: match eager {
            Some(e) => Some(max_over_ranks(comm, e)?),
            None => None,
        },
    })
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
/// `collective,ranks,dtype,bytes,library,graph_us,eager_us` (empty where not measured). The file
/// is rewritten after every line, so a run cut short keeps what it measured.
pub struct TimingCsv {
    path: std::path::PathBuf,
    text: String,
}

impl TimingCsv {
    /// The header line.
    pub const HEADER: &'static str = "collective,ranks,dtype,bytes,library,graph_us,eager_us";

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
        self.text.push_str(&format!(
            "{collective},{ranks},{dtype},{bytes},{library},{},{}\n",
            us(t.graph),
            us(t.eager)
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
            eager: None,
        };
        csv.row("allreduce", 4, "bf16", 1024, "doorbell", t)
            .unwrap();
        csv.row("allreduce", 4, "bf16", 1024, "NCCL", Timing::default())
            .unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        std::fs::remove_file(&path).unwrap();
        assert_eq!(
            text,
            "collective,ranks,dtype,bytes,library,graph_us,eager_us\n\
             allreduce,4,bf16,1024,doorbell,12.500,\n\
             allreduce,4,bf16,1024,NCCL,,\n"
        );
        assert_eq!(csv.text(), text);
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
