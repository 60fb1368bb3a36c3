//! What the C ABI adds to doorbell's own allreduce (issue 28: at most 1 us a call at 8 B to
//! 64 KiB, graph and eager): each rank makes an `ncclComm_t` through `ncclCommInitRank` beside
//! doorbell's communicator and times, at each size, `ncclAllReduce` (bf16 sum, the ABI's path to
//! doorbell's kernel) and doorbell's `AllReduce::run_raw` on the same buffers, in one run:
//! - host: the time to issue one call (n calls queued back to back, then one synchronize;
//!   the ABI's own work is host work: argument checks, the handle, the stream);
//! - eager and graph: the harness's GPU times per call (launches queued behind a hold; a graph of
//!   captured calls replayed), max over ranks.
//!
//! After an untimed pass over every size, each size is timed in three rounds with the two paths
//! in alternating order, and the median of each column is reported.
//!
//! Forwarding is off (`DOORBELL_NCCL_FORWARD=0`): only doorbell's path is timed.
//!
//!     cargo run --release -p doorbell-nccl --example nccl_overhead -- --nranks 2

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
use doorbell::collectives::allreduce::{AllReduce, AllReduceOptions};
use doorbell::collectives::DataType;
use doorbell::communicator::Communicator;
use doorbell::job::launch::run_job;
use doorbell::{Error, Result};
use doorbell_bench::harness::{max_over_ranks, measure, Repeat};
use doorbell_nccl::abi::{self, NcclUniqueId};
use doorbell_nccl::{ncclAllReduce, ncclCommDestroy, ncclCommInitRank, ncclGetUniqueId, NcclComm};
use std::ffi::c_void;
use std::sync::Arc;
use std::time::Instant;

fn main() {
    doorbell::init_logging();
    let nranks = std::env::args()
        .skip_while(|a| a != "--nranks")
        .nth(1)
        .and_then(|v| v.parse().ok());
    run_job("nccl_overhead", nranks, || Ok(2), || run().map(|()| 0))
}

/// Rounds per size (the median is reported).
const ROUNDS: usize = 3;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn abi(r: abi::NcclResult, what: &str) -> Result<()> {
    if r == abi::SUCCESS {
        return Ok(());
    }
    // SAFETY: ncclGetLastError returns a NUL-terminated string it keeps.
    let why =
        unsafe { std::ffi::CStr::from_ptr(doorbell_nccl::ncclGetLastError(std::ptr::null_mut())) };
    Err(Error::invalid(
        what,
        format!("code {r}: {}", why.to_string_lossy()),
    ))
}

fn run() -> Result<()> {
    std::env::set_var("DOORBELL_NCCL_FORWARD", "0");
    let comm = Arc::new(Communicator::from_env()?);
    let (rank, world) = (comm.rank(), comm.world_size());
    comm.gpu().bind()?;
    // The ABI's communicator: rank 0's unique id to every rank over doorbell's bootstrap.
    let mut id = NcclUniqueId::from_bytes(&[0; abi::UNIQUE_ID_BYTES]);
    if rank == 0 {
        // SAFETY: a writable id.
        abi(unsafe { ncclGetUniqueId(&mut id) }, "ncclGetUniqueId")?;
    }
    let ids = comm.bootstrap().all_gather(&id.bytes())?;
    let id = NcclUniqueId::from_bytes(ids[0].as_slice().try_into().expect("128 bytes"));
    let mut h: NcclComm = std::ptr::null();
    // SAFETY: a writable handle; the id by value.
    abi(
        unsafe { ncclCommInitRank(&mut h, world as i32, id, rank as i32) },
        "ncclCommInitRank",
    )?;
    let own = AllReduce::new(&comm, AllReduceOptions::default())?;
    let s: Arc<CudaStream> = comm.gpu().new_stream()?;
    let most = 64 << 10;
    let send: CudaSlice<u8> = s
        .alloc_zeros(most)
        .map_err(doorbell_bench::harness::cuda("cuMemAlloc"))?;
    let recv: CudaSlice<u8> = s
        .alloc_zeros(most)
        .map_err(doorbell_bench::harness::cuda("cuMemAlloc"))?;
    let (sp, rp) = (send.device_ptr(&s).0, recv.device_ptr(&s).0);
    let repeat = Repeat {
        iters: 200,
        warmup: 20,
        no_eager: false,
    };
    if rank == 0 {
        println!("# doorbell allreduce (bf16 sum) through ncclAllReduce vs its own call, {world} ranks; us per call, max over ranks");
        println!("#     bytes |  host own   host abi   +abi |  eager own  eager abi   +abi |  graph own  graph abi   +abi");
    }
    let mut worst = 0.0f64;
    let sizes = [8usize, 64, 512, 4096, 32768, 65536];
    // A pass over every size first, untimed: the first calls of a size pay for lazy setup.
    for &bytes in &sizes {
        for _ in 0..50 {
            // SAFETY: as in the timed calls below.
            unsafe { own.run_raw(&s, sp, rp, bytes / 2, DataType::Bf16) }?;
            // SAFETY: as above; the handle is live.
            abi(
                unsafe {
                    ncclAllReduce(
                        sp as *const c_void,
                        rp as *mut c_void,
                        bytes / 2,
                        9,
                        0,
                        h,
                        s.cu_stream() as *mut c_void,
                    )
                },
                "ncclAllReduce",
            )?;
        }
    }
    comm.synchronize(&s)?;
    for bytes in sizes {
        let count = bytes / 2;
        let own_call = |st: &Arc<CudaStream>| -> Result<()> {
            // SAFETY: both buffers hold `most` bytes on this GPU and outlive the stream's work.
            unsafe { own.run_raw(st, sp, rp, count, DataType::Bf16) }
        };
        let abi_call = |st: &Arc<CudaStream>| -> Result<()> {
            // SAFETY: as above; the handle is live.
            let r = unsafe {
                ncclAllReduce(
                    sp as *const c_void,
                    rp as *mut c_void,
                    count,
                    9,
                    0,
                    h,
                    st.cu_stream() as *mut c_void,
                )
            };
            abi(r, "ncclAllReduce")
        };
        // Host time to issue one call: n calls back to back (no hold: the host's pace), twice each
        // in alternation, the better of two.
        let host = |f: &dyn Fn(&Arc<CudaStream>) -> Result<()>| -> Result<f64> {
            let n = 2000;
            let mut best = f64::MAX;
            for _ in 0..2 {
                comm.synchronize(&s)?;
                comm.bootstrap().barrier()?;
                let t = Instant::now();
                for _ in 0..n {
                    f(&s)?;
                }
                best = best.min(t.elapsed().as_secs_f64() * 1e6 / n as f64);
                comm.synchronize(&s)?;
            }
            max_over_ranks(&comm, best)
        };
        // Three rounds, the two paths in alternating order; the median of each column (one
        // slow moment of the machine moved a single 8 B eager mean by 1.4 us in an early run).
        let mut cols: [Vec<f64>; 6] = Default::default();
        for round in 0..ROUNDS {
            let order: [bool; 2] = if round % 2 == 0 {
                [false, true]
            } else {
                [true, false]
            };
            for through_abi in order {
                let f: &dyn Fn(&Arc<CudaStream>) -> Result<()> =
                    if through_abi { &abi_call } else { &own_call };
                let t = measure(&comm, &s, bytes, repeat, f)?;
                let k = usize::from(through_abi);
                cols[k].push(host(f)?);
                cols[2 + k].push(t.eager.unwrap_or(f64::NAN));
                cols[4 + k].push(t.graph.unwrap_or(f64::NAN));
            }
        }
        let [ho, ha, eo, ea, go, ga] = cols.map(median);
        worst = worst.max(ha - ho).max(ea - eo).max(ga - go);
        if rank == 0 {
            println!(
                "{bytes:>11} | {ho:>9.2} {ha:>9.2} {:>+6.2} | {eo:>9.2} {ea:>9.2} {:>+6.2} | {go:>9.2} {ga:>9.2} {:>+6.2}",
                ha - ho,
                ea - eo,
                ga - go
            );
        }
    }
    if rank == 0 {
        println!(
            "# largest difference: {worst:+.2} us ({})",
            if worst <= 1.0 {
                "within 1 us"
            } else {
                "OVER 1 us"
            }
        );
    }
    // SAFETY: the live handle, given back.
    abi(unsafe { ncclCommDestroy(h) }, "ncclCommDestroy")?;
    Ok(())
}
