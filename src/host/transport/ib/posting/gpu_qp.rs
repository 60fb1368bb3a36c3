//! Queue pairs the GPU posts to: those of the emulated NIC made directly ([`GpuQp`], whose send
//! queue, doorbell record, doorbell word and completion queue sit in pinned host memory mapped
//! into the GPU, where the emulator's thread reads them as a ConnectX would read its own), and any
//! provider's queue pair with its rings registered into the GPU ([`MappedQp`]); the posting state
//! in device memory. Kernels take the [`IbQpHandle`] and call `put`, `atomic_add`, `quiet`
//! (`cuda/include/doorbell/ib/ibgda.cuh`).
//!
//! Two posting modes: [`Posting::Ibgda`], where the GPU writes the doorbell record and rings the
//! doorbell itself, and [`Posting::CpuAssisted`], where the GPU builds and publishes WQEs and
//! the process's ring thread writes the record and rings (the mode for NICs whose doorbell page
//! cannot be mapped into the GPU). The GPU code and the WQE bytes are the same in both.
//!
//! Data moves with [`CudaDma`]: copies on unified addresses, on a stream of its own that waits
//! for no other work, so registered regions may be GPU memory of this process (or a peer's
//! mapped into it) and pinned host memory.

use crate::device_api::{IbQpHandle, WaitSite};
use crate::error::{Error, Result};
use crate::gpu::cuda::{cuda_err, driver_result, Gpu, HostArray};
use crate::transport::ib::emulated::nic::{Dma, EmulatedNic, QpRings, RingDma};
use crate::transport::ib::posting::cq::{CQE_BYTES, EMPTY_OP_OWN};
use crate::transport::ib::posting::wqe::WQEBB;
use cudarc::driver::sys;
use cudarc::driver::{CudaSlice, DevicePtr};
use std::ffi::c_void;
use std::sync::atomic::{fence, Ordering};
use std::sync::Arc;

/// The emulated NIC's memory access: copies between unified addresses of this process, each
/// finished before the call returns, on a non-blocking stream of its own. (Plain `cuMemcpy` runs
/// on the legacy default stream, which waits for every kernel queued on it or on a blocking
/// stream: a kernel there that spins until the NIC completes its work (a flush, a signal's
/// wait) held the NIC, and every queue pair of it, until the wait's budget ran out.)
pub struct CudaDma {
    gpu: Arc<Gpu>,
    stream: std::sync::Mutex<Option<Arc<cudarc::driver::CudaStream>>>,
}

impl CudaDma {
    /// Access through `gpu`'s context (bound on the NIC's thread at each call).
    pub fn new(gpu: &Arc<Gpu>) -> CudaDma {
        crate::gpu::cuda::note_host_cuda_calls("the emulated NIC's copies");
        CudaDma {
            gpu: gpu.clone(),
            stream: std::sync::Mutex::new(None),
        }
    }

    /// Copies `len` bytes from `src` to `dst` (unified addresses) on the NIC's own stream and
    /// waits for them.
    fn copy_now(&self, dst: u64, src: u64, len: usize) -> Result<()> {
        self.gpu.bind()?;
        let stream = {
            let mut slot = self.stream.lock().unwrap_or_else(|p| p.into_inner());
            match slot.as_ref() {
                Some(s) => s.clone(),
                None => {
                    let s = self.gpu.new_stream()?;
                    *slot = Some(s.clone());
                    s
                }
            }
        };
        // SAFETY: the callers pass ranges the NIC checked against registered regions, or live
        // host buffers of that length (unified addressing treats them as host memory); the copy
        // is finished (synchronized) before they are used or dropped.
        unsafe { crate::gpu::cuda::copy_unified_async(&stream, dst, src, len) }?;
        // SAFETY: a live stream of this context.
        driver_result("cuStreamSynchronize", unsafe {
            sys::cuStreamSynchronize(stream.cu_stream())
        })
    }
}

impl Dma for CudaDma {
    fn read(&self, src: u64, out: &mut [u8]) -> Result<()> {
        self.copy_now(out.as_mut_ptr() as u64, src, out.len())
    }
    fn write(&self, dst: u64, data: &[u8]) -> Result<()> {
        self.copy_now(dst, data.as_ptr() as u64, data.len())
    }
    fn copy(&self, dst: u64, src: u64, len: u64) -> Result<()> {
        self.copy_now(dst, src, len as usize)
    }
}

/// Who rings the doorbell.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Posting {
    /// The GPU writes the doorbell record and the doorbell.
    Ibgda,
    /// The GPU publishes its ready index; a host thread writes the record and rings.
    CpuAssisted,
}

/// What kernels need beside a queue pair's rings: the posting state in device memory, and in
/// CPU-assisted posting the host thread that rings for them. Shared by the emulated NIC's queue
/// pairs ([`GpuQp`]) and any provider's ([`MappedQp`]).
pub(crate) struct GpuPoster {
    /// Its entry with the ringer (CPU-assisted posting).
    ringing: Option<u64>,
    _ready: Option<Arc<HostArray<u64>>>,
    _state: CudaSlice<u64>,
    _sizes: CudaSlice<u8>,
}

/// Device addresses of a queue pair's rings, and their sizes.
pub(crate) struct DeviceRings {
    pub sq: u64,
    pub dbr: u64,
    pub doorbell: u64,
    pub cq: u64,
    pub cq_ci: u64,
    pub qpn: u32,
    pub sq_log2: u32,
    pub cq_log2: u32,
    /// The send queue and its record are GPU memory ([`IbQpHandle::RINGS_IN_GPU`]).
    pub in_gpu: bool,
}

impl GpuPoster {
    /// The posting state for `rings`, and the handle kernels take. With CPU-assisted posting a
    /// host thread writes the doorbell record and doorbell through `write_dbr` and
    /// `write_doorbell` (which must stay valid until [`GpuPoster::stop`]).
    pub(crate) fn start(
        gpu: &Arc<Gpu>,
        rings: DeviceRings,
        posting: Posting,
        site: WaitSite,
        write_dbr: impl Fn(u32) + Send + 'static,
        write_doorbell: impl Fn(u64) + Send + 'static,
    ) -> Result<(GpuPoster, IbQpHandle)> {
        let stream = gpu.new_stream()?;
        let state = stream
            .alloc_zeros::<u64>(8)
            .map_err(cuda_err("cuMemAlloc"))?;
        let sizes = stream
            .alloc_zeros::<u8>(1 << rings.sq_log2)
            .map_err(cuda_err("cuMemAlloc"))?;
        stream
            .synchronize()
            .map_err(cuda_err("cuStreamSynchronize"))?;
        let ready = match posting {
            Posting::Ibgda => None,
            Posting::CpuAssisted => Some(Arc::new(HostArray::<u64>::new(gpu, 1)?)),
        };
        let handle = IbQpHandle {
            sq: rings.sq,
            dbr: rings.dbr,
            doorbell: rings.doorbell,
            cq: rings.cq,
            cq_ci: rings.cq_ci,
            state: state.device_ptr(&stream).0,
            sizes: sizes.device_ptr(&stream).0,
            host_ready: ready.as_ref().map_or(0, |h| h.device_ptr()),
            qpn: rings.qpn,
            sq_log2: rings.sq_log2,
            cq_log2: rings.cq_log2,
            flags: if rings.in_gpu {
                IbQpHandle::RINGS_IN_GPU
            } else {
                0
            },
            site,
        };
        let ringing = match &ready {
            None => None,
            Some(ready) => Some(ringer::add(ringer::Entry {
                ready: ready.clone(),
                write_dbr: Box::new(write_dbr),
                write_doorbell: Box::new(write_doorbell),
                qpn: rings.qpn,
                rung: 0,
            })?),
        };
        Ok((
            GpuPoster {
                ringing,
                _ready: ready,
                _state: state,
                _sizes: sizes,
            },
            handle,
        ))
    }

    /// Takes this queue pair off the ringer (if it was on it): once this returns, nothing rings
    /// for it any more. Idempotent.
    pub(crate) fn stop(&mut self) {
        if let Some(id) = self.ringing.take() {
            ringer::remove(id);
        }
    }
}

impl Drop for GpuPoster {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Where a [`GpuQp`]'s send queue and doorbell record live.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RingPlacement {
    /// Pinned host memory mapped into the GPU: where libmlx5 allocates a verbs queue pair's
    /// rings, so what [`MappedQp`] gives kernels on a ConnectX (every WQE store crosses PCIe,
    /// and each batch takes a system-scope fence).
    Host,
    /// GPU memory, which the NIC reads over PCIe (NVSHMEM's default for IBGDA, through DEVX
    /// umem registration, which doorbell does not do on real NICs yet): WQE stores stay in the
    /// GPU and a batch takes a GPU-scope fence. The emulated NIC reads them with `cuMemcpy`.
    Gpu,
}

/// A send queue and its record where a [`RingPlacement`] put them: their device addresses, the
/// addresses the emulated NIC reads (host pointers, or device addresses read through
/// `ring_dma`), and how the CPU-assisted ringer writes the record.
struct PlacedRings {
    sq_dev: u64,
    dbr_dev: u64,
    sq_host: *mut u8,
    dbr_host: *const u32,
    ring_dma: Option<RingDma>,
    write_dbr: Box<dyn Fn(u32) + Send>,
}

/// Device memory that a [`RingPlacement::Gpu`] queue pair's rings live in.
struct GpuRings {
    _sq: CudaSlice<u8>,
    _dbr: CudaSlice<u64>,
}

/// A queue pair of the emulated NIC that kernels post to. Dropping it stops its doorbell thread
/// (CPU-assisted) and removes it from the NIC.
pub struct GpuQp {
    nic: Arc<EmulatedNic>,
    handle: IbQpHandle,
    poster: GpuPoster,
    _sq: Option<HostArray<u8>>,
    _dbr: Option<Arc<HostArray<u32>>>,
    _gpu_rings: Option<GpuRings>,
    _doorbell: Arc<HostArray<u64>>,
    _cq: HostArray<u8>,
    _cq_ci: HostArray<u32>,
}

impl GpuQp {
    /// A QP numbered `qpn` with a send queue of `2^sq_log2` WQEBBs (7..=15) and a CQ as deep,
    /// served by `nic`, posted as `posting` says; device waits report through `site`. Its rings
    /// are pinned host memory ([`RingPlacement::Host`]).
    pub fn new(
        gpu: &Arc<Gpu>,
        nic: &Arc<EmulatedNic>,
        qpn: u32,
        sq_log2: u32,
        posting: Posting,
        site: WaitSite,
    ) -> Result<GpuQp> {
        GpuQp::placed(gpu, nic, qpn, sq_log2, posting, site, RingPlacement::Host)
    }

    /// [`GpuQp::new`] with the send queue and its record where `placement` says (the doorbell
    /// word, the CQ and its record stay in pinned host memory).
    pub fn placed(
        gpu: &Arc<Gpu>,
        nic: &Arc<EmulatedNic>,
        qpn: u32,
        sq_log2: u32,
        posting: Posting,
        site: WaitSite,
        placement: RingPlacement,
    ) -> Result<GpuQp> {
        if !(7..=15).contains(&sq_log2) {
            return Err(Error::invalid(
                "send queue",
                format!("2^{sq_log2} WQEBBs: between 2^7 and 2^15 (16-bit completion counters)"),
            ));
        }
        let depth = 1usize << sq_log2;
        let doorbell = Arc::new(HostArray::<u64>::new(gpu, 1)?);
        let cq = HostArray::<u8>::new(gpu, depth * CQE_BYTES)?;
        for i in 0..depth {
            cq.write(i * CQE_BYTES + 63, EMPTY_OP_OWN);
        }
        let cq_ci = HostArray::<u32>::new(gpu, 1)?;
        let b = doorbell.clone();
        let write_doorbell = move |v| b.write(0, v);
        let (mut host_sq, mut host_dbr, mut gpu_rings) = (None, None, None);
        let placed = match placement {
            RingPlacement::Host => {
                let sq = HostArray::<u8>::new(gpu, depth * WQEBB)?;
                let dbr = Arc::new(HostArray::<u32>::new(gpu, 1)?);
                let d = dbr.clone();
                let out = PlacedRings {
                    sq_dev: sq.device_ptr(),
                    dbr_dev: dbr.device_ptr(),
                    sq_host: sq.host_ptr(),
                    dbr_host: dbr.host_ptr() as *const u32,
                    ring_dma: None,
                    write_dbr: Box::new(move |v| d.write(0, v)),
                };
                host_sq = Some(sq);
                host_dbr = Some(dbr);
                out
            }
            RingPlacement::Gpu => {
                let stream = gpu.new_stream()?;
                let sq = stream
                    .alloc_zeros::<u8>(depth * WQEBB)
                    .map_err(cuda_err("cuMemAlloc"))?;
                let dbr = stream
                    .alloc_zeros::<u64>(1)
                    .map_err(cuda_err("cuMemAlloc"))?;
                stream
                    .synchronize()
                    .map_err(cuda_err("cuStreamSynchronize"))?;
                let (sq_p, dbr_p) = (sq.device_ptr(&stream).0, dbr.device_ptr(&stream).0);
                let dma: Arc<dyn Dma> = Arc::new(CudaDma::new(gpu));
                let writer = dma.clone();
                gpu_rings = Some(GpuRings { _sq: sq, _dbr: dbr });
                PlacedRings {
                    sq_dev: sq_p,
                    dbr_dev: dbr_p,
                    sq_host: sq_p as *mut u8,
                    dbr_host: dbr_p as *const u32,
                    ring_dma: Some(RingDma(dma)),
                    // The ringer's record store: a copy into GPU memory, done before it rings.
                    write_dbr: Box::new(move |v: u32| {
                        if let Err(e) = writer.write(dbr_p, &v.to_ne_bytes()) {
                            tracing::error!("doorbell record of QP {qpn:#x}: {e}");
                        }
                    }),
                }
            }
        };
        let (poster, handle) = GpuPoster::start(
            gpu,
            DeviceRings {
                sq: placed.sq_dev,
                dbr: placed.dbr_dev,
                doorbell: doorbell.device_ptr(),
                cq: cq.device_ptr(),
                cq_ci: cq_ci.device_ptr(),
                qpn,
                sq_log2,
                cq_log2: sq_log2,
                in_gpu: placement == RingPlacement::Gpu,
            },
            posting,
            site,
            placed.write_dbr,
            write_doorbell,
        )?;
        let rings = QpRings {
            sq: placed.sq_host,
            sq_wqebbs: depth as u64,
            dbr: placed.dbr_host,
            doorbell: doorbell.host_ptr(),
            cq: cq.host_ptr(),
            cq_entries: depth as u64,
            cq_ci: cq_ci.host_ptr(),
            ring_dma: placed.ring_dma,
        };
        // SAFETY: the rings are allocations owned by the returned value (pinned host memory, or
        // GPU memory read through `ring_dma`), whose Drop removes the QP from the NIC before
        // they are freed.
        unsafe { nic.add_qp(qpn, rings, None) }?;
        Ok(GpuQp {
            nic: nic.clone(),
            handle,
            poster,
            _sq: host_sq,
            _dbr: host_dbr,
            _gpu_rings: gpu_rings,
            _doorbell: doorbell,
            _cq: cq,
            _cq_ci: cq_ci,
        })
    }

    /// What kernels take.
    pub fn handle(&self) -> IbQpHandle {
        self.handle
    }
}

/// The CPU-assisted doorbell: one host thread per process rings for every queue pair whose
/// kernels post with CPU-assisted posting (a thread per queue pair outnumbers the host's cores at
/// a few dozen queue pairs). For each, whenever the GPU's ready index moves: the doorbell record,
/// then after a fence the doorbell word, as rdma-core's `post_send` writes them. The thread runs
/// while any queue pair is registered and is joined when the last one leaves.
mod ringer {
    use super::*;
    use std::sync::{Mutex, MutexGuard, OnceLock};

    /// One queue pair the ringer serves.
    pub(crate) struct Entry {
        /// The ready index kernels publish (pinned host memory).
        pub ready: Arc<HostArray<u64>>,
        /// Writes the doorbell record (big-endian index).
        pub write_dbr: Box<dyn Fn(u32) + Send>,
        /// Writes the doorbell word.
        pub write_doorbell: Box<dyn Fn(u64) + Send>,
        /// Its QP number.
        pub qpn: u32,
        /// The index rung so far.
        pub rung: u64,
    }

    #[derive(Default)]
    struct State {
        entries: Vec<(u64, Entry)>,
        next_id: u64,
        /// The serving thread and its generation (a thread whose generation is stale exits).
        thread: Option<std::thread::JoinHandle<()>>,
        generation: u64,
    }

    fn state() -> MutexGuard<'static, State> {
        static STATE: OnceLock<Mutex<State>> = OnceLock::new();
        STATE
            .get_or_init(|| Mutex::new(State::default()))
            .lock()
            .unwrap_or_else(|p| p.into_inner())
    }

    /// Serves `e` from now on; returns its id for [`remove`].
    pub(crate) fn add(e: Entry) -> Result<u64> {
        let mut st = state();
        let id = st.next_id;
        st.next_id += 1;
        st.entries.push((id, e));
        if st.thread.is_none() {
            st.generation += 1;
            let generation = st.generation;
            let t = std::thread::Builder::new()
                .name("doorbell-ring".into())
                .spawn(move || serve(generation))
                .map_err(|e| Error::invalid("doorbell thread", format!("cannot start: {e}")));
            match t {
                Ok(t) => st.thread = Some(t),
                Err(e) => {
                    st.entries.retain(|(i, _)| *i != id);
                    return Err(e);
                }
            }
        }
        Ok(id)
    }

    /// Stops serving `id`; with no entry left, stops the thread and waits for it.
    pub(crate) fn remove(id: u64) {
        let thread = {
            let mut st = state();
            st.entries.retain(|(i, _)| *i != id);
            if st.entries.is_empty() {
                st.thread.take()
            } else {
                None
            }
        };
        if let Some(t) = thread {
            let _ = t.join();
        }
    }

    fn ring(e: &mut Entry) -> bool {
        let r = e.ready.read(0);
        if r <= e.rung {
            return false;
        }
        fence(Ordering::Acquire);
        (e.write_dbr)(((r & 0xffff) as u32).to_be());
        fence(Ordering::SeqCst);
        let mut word = [0u8; 8];
        word[0..4].copy_from_slice(&(((r & 0xffff) as u32) << 8).to_be_bytes());
        word[4..8].copy_from_slice(&((e.qpn & 0xff_ffff) << 8).to_be_bytes());
        (e.write_doorbell)(u64::from_ne_bytes(word));
        // Write-combined doorbell pages need their buffers flushed (rdma-core's
        // mmio_flush_writes); harmless for the emulator's host memory.
        fence(Ordering::SeqCst);
        e.rung = r;
        true
    }

    fn serve(generation: u64) {
        let mut idle = 0u32;
        loop {
            let worked = {
                let mut st = state();
                if st.entries.is_empty() || st.generation != generation {
                    return;
                }
                let mut worked = false;
                for (_, e) in st.entries.iter_mut() {
                    worked |= ring(e);
                }
                worked
            };
            if worked {
                idle = 0;
            } else {
                idle = idle.saturating_add(1);
                if idle > 100_000 {
                    std::thread::sleep(std::time::Duration::from_micros(20));
                } else {
                    std::hint::spin_loop();
                }
            }
        }
    }
}

impl Drop for GpuQp {
    fn drop(&mut self) {
        self.poster.stop();
        self.nic.remove_qp(self.handle.qpn);
    }
}

pub(crate) struct SendPtr(pub(crate) *mut u8);
// SAFETY: used only by the ring thread, which the owner stops before the memory goes away.
unsafe impl Send for SendPtr {}

impl SendPtr {
    // A method, so closures capture the whole (Send) wrapper rather than its raw field.
    pub(crate) fn get(&self) -> *mut u8 {
        self.0
    }
}

/// Host pages this process registered with CUDA; unregistered when dropped (also when mapping
/// fails half way).
pub(crate) struct Registrations(pub(crate) Vec<u64>);

impl Drop for Registrations {
    fn drop(&mut self) {
        for &start in &self.0 {
            // SAFETY: registered by `register`, unregistered once.
            unsafe { sys::cuMemHostUnregister(start as *mut c_void) };
        }
    }
}

/// Registers the pages around `[addr, addr + len)` with the current context (IO memory for a
/// device register) and returns the device address of `addr`. Pages registered before (the
/// doorbell records of several queues share pages) are reused.
pub(crate) fn register(regs: &mut Registrations, addr: u64, len: u64, io: bool) -> Result<u64> {
    let page = 4096u64;
    let start = addr & !(page - 1);
    let end = (addr + len).next_multiple_of(page);
    let mut flags = sys::CU_MEMHOSTREGISTER_DEVICEMAP | sys::CU_MEMHOSTREGISTER_PORTABLE;
    if io {
        flags |= sys::CU_MEMHOSTREGISTER_IOMEMORY;
    }
    // SAFETY: the pages are libmlx5's (rings) or the mapped UAR page, alive while the QP is;
    // unregistered by MappedQp's Drop before the QP goes.
    let r =
        unsafe { sys::cuMemHostRegister_v2(start as *mut c_void, (end - start) as usize, flags) };
    match r {
        sys::CUresult::CUDA_SUCCESS => regs.0.push(start),
        sys::CUresult::CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED => {}
        other => driver_result("cuMemHostRegister", other)?,
    }
    let mut dev = 0u64;
    // SAFETY: `addr` lies in registered pages.
    driver_result("cuMemHostGetDevicePointer", unsafe {
        sys::cuMemHostGetDevicePointer_v2(&mut dev, addr as *mut c_void, 0)
    })?;
    Ok(dev)
}

/// A connected queue pair of any mlx5 provider (the emulated NIC or a ConnectX) mapped into a
/// GPU for kernels to post: its send queue, doorbell record and CQ registered as mapped host
/// memory; with [`Posting::Ibgda`] the doorbell register too (as IO memory on a real NIC, which
/// stock drivers refuse without `PeerMappingOverride=1`), else a host thread rings. Dropping it
/// stops that thread, unregisters the rings, then destroys the QP.
pub struct MappedQp {
    handle: IbQpHandle,
    poster: GpuPoster,
    _regs: Registrations,
    _qp: crate::transport::ib::posting::conn::ConnectedQp,
}

impl MappedQp {
    /// Maps `qp`'s rings into `gpu`; device waits report through `site`.
    pub fn new(
        gpu: &Arc<Gpu>,
        qp: crate::transport::ib::posting::conn::ConnectedQp,
        posting: Posting,
        site: WaitSite,
    ) -> Result<MappedQp> {
        gpu.bind()?;
        let r = qp.rings()?;
        let sq_log2 = r.sq_wqebbs.trailing_zeros();
        let cq_log2 = r.cq_entries.trailing_zeros();
        if !(7..=15).contains(&sq_log2) {
            return Err(Error::invalid(
                "send queue",
                format!("{} WQEBBs: kernels post to 2^7..=2^15", r.sq_wqebbs),
            ));
        }
        let mut regs = Registrations(Vec::new());
        let sq = register(&mut regs, r.sq as u64, r.sq_wqebbs * 64, false)?;
        let dbr = register(&mut regs, r.dbr as u64, 4, false)?;
        let cq = register(&mut regs, r.cq as u64, r.cq_entries * 64, false)?;
        let cq_ci = register(&mut regs, r.cq_ci as u64, 4, false)?;
        let doorbell = if posting == Posting::Ibgda {
            register(&mut regs, r.doorbell as u64, 8, r.doorbell_is_mmio).map_err(|e| {
                Error::TransportUnavailable {
                    transport: "ib",
                    why: format!(
                        "the doorbell register cannot be mapped into the GPU ({e}); set \
                         NVreg_RegistryDwords=PeerMappingOverride=1 for the nvidia module, or use \
                         DOORBELL_IB_POSTING=cpu"
                    ),
                }
            })?
        } else {
            0
        };
        let (dbr_host, doorbell_host) = (SendPtr(r.dbr as *mut u8), SendPtr(r.doorbell as *mut u8));
        let (poster, handle) = GpuPoster::start(
            gpu,
            DeviceRings {
                sq,
                dbr,
                doorbell,
                cq,
                cq_ci,
                qpn: r.qpn,
                sq_log2,
                cq_log2,
                in_gpu: false, // libmlx5's rings: host memory
            },
            posting,
            site,
            // SAFETY: the QP's send record and doorbell register, alive until the poster is
            // stopped (MappedQp's Drop, before the QP goes).
            move |v| unsafe { (dbr_host.get() as *mut u32).write_volatile(v) },
            move |v| unsafe { (doorbell_host.get() as *mut u64).write_volatile(v) },
        )?;
        Ok(MappedQp {
            handle,
            poster,
            _regs: regs,
            _qp: qp,
        })
    }

    /// What kernels take.
    pub fn handle(&self) -> IbQpHandle {
        self.handle
    }
}

impl Drop for MappedQp {
    fn drop(&mut self) {
        // The ringing thread first; then (fields, in order) the registrations, then the QP.
        self.poster.stop();
        fence(Ordering::SeqCst);
    }
}
