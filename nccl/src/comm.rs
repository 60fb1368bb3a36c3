//! The communicator behind `ncclComm_t`: doorbell's [`Communicator`] on the GPU that was
//! current when the rank initialized, built through the unique id's rendezvous
//! ([`crate::id`]).

use crate::abi::{self, NcclResult};
use crate::config::CommConfig;
use crate::error::ShimError;
use crate::id::{self, UniqueId};
use crate::real::{self, RealComm};
use doorbell::collectives::allreduce::{AllReduce, AllReduceOptions};
use doorbell::collectives::alltoall::{AllToAll, AllToAllOptions};
use doorbell::collectives::elementwise::Elementwise;
use doorbell::communicator::Communicator;
use doorbell::job::bootstrap::Bootstrap;
use std::collections::HashSet;
use std::ffi::c_int;
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::{Arc, OnceLock, RwLock};

/// doorbell's communicator and the collectives built on it with the communicator (so that a
/// call only queues work).
pub struct Built {
    pub comm: Arc<Communicator>,
    pub all_reduce: AllReduce,
    pub all_to_all: AllToAll,
    /// The average's scaling and the maximum's and minimum's reduction of gathered inputs.
    pub elementwise: Elementwise,
}

/// What an `ncclComm_t` points to. Inside a group the handle exists before its communicator:
/// `inner` is set when the group ends.
pub struct Comm {
    pub rank: usize,
    pub nranks: usize,
    pub device: usize,
    pub config: CommConfig,
    inner: OnceLock<Built>,
    /// The real NCCL's communicator beside doorbell's (`crate::real`), or why there is none.
    real: OnceLock<Result<RealComm, String>>,
    /// A communicator of the real NCCL only (a split or a shrink): every call is forwarded.
    pub forward_only: bool,
    /// The communicator's asynchronous error (`ncclCommGetAsyncError`): an init that failed
    /// after its call returned (inside a group), or a fault doorbell found.
    async_error: AtomicI32,
}

impl Comm {
    /// doorbell's communicator, or why there is none.
    pub fn communicator(&self) -> Result<&Arc<Communicator>, ShimError> {
        self.built().map(|b| &b.comm)
    }

    /// The communicator and its allreduce.
    pub fn all_reduce(&self) -> Result<(&Communicator, &AllReduce), ShimError> {
        self.built().map(|b| (&*b.comm, &b.all_reduce))
    }

    /// The communicator and its elementwise kernels.
    pub fn elementwise(&self) -> Result<(&Communicator, &Elementwise), ShimError> {
        self.built().map(|b| (&*b.comm, &b.elementwise))
    }

    /// The communicator and its all-to-all.
    pub fn all_to_all(&self) -> Result<(&Communicator, &AllToAll), ShimError> {
        self.built().map(|b| (&*b.comm, &b.all_to_all))
    }

    /// The real NCCL's communicator, or why `call` cannot be forwarded.
    pub fn real(&self, call: &str) -> Result<RealComm, ShimError> {
        match self.real.get() {
            Some(Ok(c)) => Ok(*c),
            Some(Err(why)) => Err(ShimError::new(
                abi::INVALID_USAGE,
                format!("{call}: doorbell does not run this, and {why}"),
            )),
            None => Err(ShimError::new(
                abi::INVALID_USAGE,
                format!(
                    "{call}: rank {} of {}: the communicator is not initialized (its group has \
                     not ended)",
                    self.rank, self.nranks
                ),
            )),
        }
    }

    /// A communicator of the real NCCL only (`ncclCommSplit`, `ncclCommShrink`).
    pub fn forward_only(real: RealComm, rank: usize, nranks: usize, device: usize) -> Comm {
        let c = Comm {
            rank,
            nranks,
            device,
            config: CommConfig::default(),
            inner: OnceLock::new(),
            real: OnceLock::new(),
            forward_only: true,
            async_error: AtomicI32::new(abi::SUCCESS),
        };
        let _ = c.real.set(Ok(real));
        c
    }

    /// The real communicator's own end (`ncclCommDestroy` or `ncclCommAbort`), when there is one.
    pub fn end_real(&self, abort: bool) -> Result<(), ShimError> {
        type F = unsafe extern "C" fn(*mut std::ffi::c_void) -> NcclResult;
        let Some(Ok(c)) = self.real.get() else {
            return Ok(());
        };
        let name = if abort {
            "ncclCommAbort"
        } else {
            "ncclCommDestroy"
        };
        // SAFETY: ncclCommDestroy/ncclCommAbort(ncclComm_t) with this communicator's handle.
        let f = unsafe { real::function::<F>(name)? };
        // SAFETY: as above.
        real::check(name, real::within(|| unsafe { f(c.0) }))
    }

    /// A call's failure as NCCL reports it; a failed peer or a mismatch also becomes the
    /// communicator's asynchronous error (PyTorch's watchdog polls it).
    pub fn failed(&self, e: &doorbell::Error) -> ShimError {
        let s = ShimError::from_doorbell(e);
        if matches!(s.code, abi::REMOTE_ERROR | abi::INVALID_USAGE) {
            let _ = self.async_error.compare_exchange(
                abi::SUCCESS,
                s.code,
                Ordering::AcqRel,
                Ordering::Acquire,
            );
        }
        s
    }

    fn built(&self) -> Result<&Built, ShimError> {
        self.inner.get().ok_or_else(|| {
            ShimError::new(
                abi::INVALID_USAGE,
                format!(
                    "rank {} of {}: the communicator is not initialized (its init failed, or \
                     its group has not ended)",
                    self.rank, self.nranks
                ),
            )
        })
    }

    /// `ncclCommGetAsyncError`: an init's failure, else doorbell's health (a dead or mismatched
    /// peer, a stopped proxy), else success. A communicator whose group has not ended is in
    /// progress.
    pub fn async_error(&self) -> NcclResult {
        let e = self.async_error.load(Ordering::Acquire);
        if e != abi::SUCCESS {
            return e;
        }
        if let Some(Ok(c)) = self.real.get() {
            type F = unsafe extern "C" fn(*mut std::ffi::c_void, *mut NcclResult) -> NcclResult;
            let mut e = abi::SUCCESS;
            // SAFETY: ncclCommGetAsyncError(ncclComm_t, ncclResult_t*) with a writable result.
            if let Ok(f) = unsafe { real::function::<F>("ncclCommGetAsyncError") } {
                if real::within(|| unsafe { f(c.0, &mut e) }) == abi::SUCCESS && e != abi::SUCCESS {
                    return e;
                }
            }
            if self.forward_only {
                return abi::SUCCESS;
            }
        }
        match self.inner.get() {
            None => abi::IN_PROGRESS,
            Some(b) => match b.comm.check_health() {
                Ok(()) => abi::SUCCESS,
                Err(e) => {
                    let code = crate::error::record(&ShimError::from_doorbell(&e));
                    self.async_error.store(code, Ordering::Release);
                    code
                }
            },
        }
    }

    /// `ncclCommAbort`: ends doorbell's work on every rank's side (peers learn of it).
    pub fn abort(&self) {
        if let Some(b) = self.inner.get() {
            b.comm.abort();
        }
    }
}

/// The handles this library gave out and that are alive.
fn live() -> &'static RwLock<HashSet<usize>> {
    static LIVE: OnceLock<RwLock<HashSet<usize>>> = OnceLock::new();
    LIVE.get_or_init(Default::default)
}

/// Gives `c` out as an `ncclComm_t` (known as ours until [`retire`]).
pub fn publish(c: Arc<Comm>) -> *const Comm {
    let p = Arc::into_raw(c);
    live()
        .write()
        .unwrap_or_else(|e| e.into_inner())
        .insert(p as usize);
    p
}

/// A handle given back (`ncclCommDestroy`, `ncclCommAbort`).
pub fn retire(p: *const Comm) {
    live()
        .write()
        .unwrap_or_else(|e| e.into_inner())
        .remove(&(p as usize));
}

/// Whether `p` is a communicator of the real NCCL rather than one of ours: the real NCCL calling
/// its own API, which ours interposes when this library is preloaded in its place. Such calls go
/// to the real function as they are.
pub fn is_foreign(p: *const Comm) -> bool {
    !p.is_null()
        && real::loaded()
        && !live()
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .contains(&(p as usize))
}

/// The CUDA device current on this thread (NCCL binds a communicator to it): the device of the
/// current context, or 0 when there is none (as `cudaGetDevice` says before any).
pub fn current_device() -> Result<usize, ShimError> {
    use cudarc::driver::sys;
    let no_driver = |why: String| ShimError::new(abi::UNHANDLED_CUDA_ERROR, why);
    // SAFETY: only probes whether libcuda can be loaded (cudarc panics on a call without it).
    if !unsafe { sys::is_culib_present() } {
        return Err(no_driver(
            "libcuda.so could not be loaded: no NVIDIA driver here, or not on the library path"
                .into(),
        ));
    }
    // SAFETY: cuInit takes a flags word; the others write into locals that outlive the calls.
    unsafe {
        let r = sys::cuInit(0);
        if r != sys::CUresult::CUDA_SUCCESS {
            return Err(no_driver(format!("cuInit: {r:?}")));
        }
        let mut ctx = std::ptr::null_mut();
        let r = sys::cuCtxGetCurrent(&mut ctx);
        if r != sys::CUresult::CUDA_SUCCESS || ctx.is_null() {
            return Ok(0);
        }
        let mut dev = 0;
        let r = sys::cuCtxGetDevice(&mut dev);
        if r != sys::CUresult::CUDA_SUCCESS {
            return Err(no_driver(format!("cuCtxGetDevice: {r:?}")));
        }
        Ok(dev as usize)
    }
}

/// This GPU as no other GPU anywhere is named: the host's name and the device's PCI address
/// (the ordinal where the driver does not say).
fn gpu_name(device: usize) -> String {
    use cudarc::driver::sys;
    let mut host = [0u8; 256];
    // SAFETY: gethostname writes at most len bytes into the buffer.
    let h = unsafe { libc::gethostname(host.as_mut_ptr().cast(), host.len() - 1) };
    let host = if h == 0 {
        let end = host.iter().position(|&b| b == 0).unwrap_or(host.len());
        String::from_utf8_lossy(&host[..end]).into_owned()
    } else {
        "?".into()
    };
    let mut bus = [0i8; 32];
    let mut dev = 0;
    // SAFETY: the driver was loaded and initialized (this rank's communicator exists); both calls
    // write into locals of the sizes given.
    let pci = unsafe {
        sys::cuDeviceGet(&mut dev, device as i32) == sys::CUresult::CUDA_SUCCESS
            && sys::cuDeviceGetPCIBusId(bus.as_mut_ptr(), bus.len() as i32, dev)
                == sys::CUresult::CUDA_SUCCESS
    };
    let gpu = if pci {
        // SAFETY: the driver wrote a NUL-terminated string.
        unsafe { std::ffi::CStr::from_ptr(bus.as_ptr()) }
            .to_string_lossy()
            .into_owned()
    } else {
        format!("device {device}")
    };
    format!("{host}/{gpu}")
}

/// Joins rank `rank` of `nranks` on `uid` and builds its communicator on `device`: the
/// rendezvous, doorbell's bootstrap, the communicator, its allreduce and all-to-all, and the real
/// NCCL's communicator beside it (collective).
fn build(
    uid: &UniqueId,
    rank: usize,
    nranks: usize,
    device: usize,
) -> Result<(Built, Result<RealComm, String>), ShimError> {
    let doorbell_err = |e: doorbell::Error| ShimError::from_doorbell(&e);
    let cfg = id::rendezvous(uid, rank, nranks, None)?;
    let boot = Bootstrap::connect(cfg).map_err(doorbell_err)?;
    let comm = Arc::new(Communicator::new(boot, device).map_err(doorbell_err)?);
    let all_reduce = AllReduce::new(&comm, AllReduceOptions::default()).map_err(doorbell_err)?;
    let all_to_all = AllToAll::new(&comm, AllToAllOptions::default()).map_err(doorbell_err)?;
    let elementwise = Elementwise::new(comm.gpu()).map_err(doorbell_err)?;
    let real = if real::enabled() {
        // The real NCCL binds its communicator to the thread's current GPU.
        comm.gpu().bind().map_err(doorbell_err)?;
        real::init_comm(comm.bootstrap(), rank, nranks, &gpu_name(device))?
    } else {
        Err("forwarding to a real NCCL is off (DOORBELL_NCCL_FORWARD=0)".to_string())
    };
    Ok((
        Built {
            comm,
            all_reduce,
            all_to_all,
            elementwise,
        },
        real,
    ))
}

/// `ncclCommInitRank[Config]` with the device already chosen: returns the handle at once, its
/// communicator built now, or, inside a group, when the group ends (its failure then in the
/// group's result and the communicator's asynchronous error).
pub fn init_rank(
    id: &abi::NcclUniqueId,
    rank: c_int,
    nranks: c_int,
    config: CommConfig,
    device: usize,
) -> Result<Arc<Comm>, ShimError> {
    if nranks < 1 || rank < 0 || rank >= nranks {
        return Err(ShimError::invalid_argument(format!(
            "ncclCommInitRank: rank {rank} of {nranks} ranks (0 <= rank < nranks, nranks >= 1)"
        )));
    }
    let uid = UniqueId::decode(id)?;
    let (rank, nranks) = (rank as usize, nranks as usize);
    let comm = Arc::new(Comm {
        rank,
        nranks,
        device,
        config,
        inner: OnceLock::new(),
        real: OnceLock::new(),
        forward_only: false,
        async_error: AtomicI32::new(abi::SUCCESS),
    });
    let run = {
        let comm = comm.clone();
        move || match build(&uid, rank, nranks, device) {
            Ok((b, r)) => {
                let _ = comm.inner.set(b);
                let _ = comm.real.set(r);
                Ok(())
            }
            Err(e) => {
                comm.async_error.store(e.code, Ordering::Release);
                Err(e)
            }
        }
    };
    if crate::group::inside() {
        crate::group::hold_init(Box::new(run));
    } else {
        run()?;
    }
    Ok(comm)
}
