//! NCCL as the baseline of doorbell's benchmarks: one communicator over the ranks of a
//! [`Bootstrap`], all-reduce and all-to-all on caller-owned device buffers, and NCCL's symmetric
//! memory windows for its fastest small-message kernels. The examples time these calls side by
//! side with doorbell's own collectives, in the same processes and on the same buffers.
//!
//! What it must never do: be called by doorbell's own collectives, or link NCCL. The library is
//! opened at run time through cudarc, which panics when `libnccl.so` is missing or a symbol is
//! absent, so every path here first asks [`nccl_available`] and looks up each symbol newer than
//! NCCL 2.7 before calling it. A machine without NCCL gets [`Error::TransportUnavailable`], and a
//! benchmark then reports doorbell alone.

use cudarc::driver::CudaStream;
use cudarc::nccl::sys;
use doorbell::collectives::DataType;
use doorbell::gpu::cuda::Gpu;
use doorbell::job::bootstrap::Bootstrap;
use doorbell::{Error, Result};
use std::ffi::{c_char, c_int, c_void, CStr};
use std::sync::{Arc, OnceLock};

/// `NCCL_WIN_COLL_SYMMETRIC` from `nccl.h` (2.27+): every rank registers a buffer of the same
/// size in the same order, so NCCL may address peers' windows at the local offset.
const NCCL_WIN_COLL_SYMMETRIC: c_int = 0x01;

/// Entry points every communicator needs; NCCL has had all of them since 2.7.
const REQUIRED_SYMBOLS: [&str; 10] = [
    "ncclGetVersion",
    "ncclGetErrorString",
    "ncclGetUniqueId",
    "ncclCommInitRank",
    "ncclCommDestroy",
    "ncclAllReduce",
    "ncclGroupStart",
    "ncclGroupEnd",
    "ncclSend",
    "ncclRecv",
];

/// Entry points of symmetric windows: `ncclMemAlloc`/`ncclMemFree` (2.19) and window
/// registration (2.27).
const WINDOW_SYMBOLS: [&str; 4] = [
    "ncclMemAlloc",
    "ncclMemFree",
    "ncclCommWindowRegister",
    "ncclCommWindowDeregister",
];

/// The first NCCL with `ncclBfloat16` (version code of 2.10.0).
const FIRST_BF16_VERSION: i32 = 21000;

/// Tags the first byte of each rank's contribution to the setup all-gather.
const SETUP_OK: u8 = 0;
const SETUP_FAILED: u8 = 1;

fn unavailable(why: impl Into<String>) -> Error {
    Error::TransportUnavailable {
        transport: "NCCL",
        why: why.into(),
    }
}

/// Says whether NCCL can be used in this process, without panicking: `libnccl.so` must load and
/// carry every entry point a communicator needs. Call it before anything else in this module
/// ([`Nccl::new`] does).
pub fn nccl_available() -> Result<()> {
    // SAFETY: only tries to dlopen cudarc's candidate names; no NCCL code runs.
    if !unsafe { sys::is_culib_present() } {
        return Err(unavailable(
            "libnccl.so could not be loaded. cudarc looks for `libnccl.so` (and .so.1, .so.9 to \
             .so.13), not the `libnccl.so.2` that NCCL packages install: put a `libnccl.so` \
             symlink to libnccl.so.2 in a directory on LD_LIBRARY_PATH, or install the NCCL \
             development package (libnccl-dev), which provides it",
        ));
    }
    let missing: Vec<&str> = REQUIRED_SYMBOLS
        .into_iter()
        .filter(|name| !has_symbol(name))
        .collect();
    if !missing.is_empty() {
        return Err(unavailable(format!(
            "the libnccl.so that was loaded lacks {}: it is not NCCL, or an NCCL older than 2.7; \
             install NCCL 2.19 or newer",
            missing.join(", ")
        )));
    }
    Ok(())
}

/// Whether the loaded NCCL exports `name`. Only call after `is_culib_present` said yes.
fn has_symbol(name: &str) -> bool {
    // SAFETY: the library is present (the callers checked), so `culib` loads it instead of
    // panicking; looking a name up runs no NCCL code, and the symbol is never called through the
    // pointer type named here.
    unsafe { sys::culib().get::<*const c_void>(name.as_bytes()).is_ok() }
}

/// `ncclGetLastError` came in NCCL 2.13; error reports use it when it is there.
fn has_last_error() -> bool {
    static HAS: OnceLock<bool> = OnceLock::new();
    *HAS.get_or_init(|| has_symbol("ncclGetLastError"))
}

/// Turns an NCCL result into [`Error::Cuda`] naming the call, with NCCL's description, the
/// numeric code, and NCCL's last error message when it has one.
fn check(call: &'static str, r: sys::ncclResult_t) -> Result<()> {
    if r == sys::ncclResult_t::ncclSuccess {
        return Ok(());
    }
    // SAFETY: ncclGetErrorString takes any result value and returns a static string (or null).
    let text = unsafe { c_text(sys::ncclGetErrorString(r)) };
    let mut code = format!("{text} ({r:?} = {})", r as u32);
    if has_last_error() {
        // SAFETY: `comm` is documented as unused (NULL is allowed); the returned string is
        // NCCL's thread's last error buffer, copied out at once.
        let last = unsafe { c_text(sys::ncclGetLastError(std::ptr::null_mut())) };
        if !last.is_empty() {
            code.push_str(": ");
            code.push_str(&last);
        }
    }
    Err(Error::Cuda { call, code })
}

/// Copies a C string NCCL returned; null reads as empty.
///
/// # Safety
/// `p` is null or points to a NUL-terminated string that stays valid during the call.
unsafe fn c_text(p: *const c_char) -> String {
    if p.is_null() {
        return String::new();
    }
    // SAFETY: non-null and NUL-terminated per the caller's contract.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

/// NCCL's element type for `dtype`.
pub fn nccl_data_type(dtype: DataType) -> sys::ncclDataType_t {
    match dtype {
        DataType::Bf16 => sys::ncclDataType_t::ncclBfloat16,
        DataType::F16 => sys::ncclDataType_t::ncclFloat16,
        DataType::F32 => sys::ncclDataType_t::ncclFloat32,
    }
}

/// Formats an `ncclGetVersion` code: `major*10000 + minor*100 + patch` since 2.9, and
/// `major*1000 + minor*100 + patch` before.
pub fn format_version(code: i32) -> String {
    let (major, rest) = if code >= 10000 {
        (code / 10000, code % 10000)
    } else {
        (code / 1000, code % 1000)
    };
    format!("{major}.{}.{}", rest / 100, rest % 100)
}

/// The version code of the loaded NCCL.
fn library_version() -> Result<i32> {
    let mut code: c_int = 0;
    // SAFETY: `code` outlives the call, which only writes it.
    check("ncclGetVersion", unsafe { sys::ncclGetVersion(&mut code) })?;
    Ok(code)
}

/// NCCL's stream type for a cudarc stream (both are the driver's `CUstream`).
fn nccl_stream(stream: &CudaStream) -> sys::cudaStream_t {
    stream.cu_stream() as sys::cudaStream_t
}

/// One NCCL communicator over all ranks of a [`Bootstrap`], on this rank's GPU.
///
/// Not `Sync`: NCCL forbids using one communicator from two threads at once.
pub struct Nccl {
    comm: sys::ncclComm_t,
    gpu: Arc<Gpu>,
    world_size: usize,
    version: i32,
    /// `ncclAlltoAll` exists (2.28+); older NCCL gets a group of sends and receives.
    native_all_to_all: bool,
}

// SAFETY: an NCCL communicator may be used from any thread, one at a time; `Nccl` is not `Sync`,
// so moving it to another thread keeps every use serialized. The GPU handle is `Send`.
unsafe impl Send for Nccl {}

impl std::fmt::Debug for Nccl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Nccl")
            .field("version", &self.version())
            .field("world_size", &self.world_size)
            .field("gpu", &self.gpu.ordinal())
            .finish_non_exhaustive()
    }
}

impl Nccl {
    /// The examples' baseline: `None` when `skip`, or when NCCL cannot start (rank 0 then says
    /// why on stderr and the run goes on with doorbell only). Collective, as [`Nccl::new`].
    pub fn optional(bootstrap: &Bootstrap, gpu: &Arc<Gpu>, skip: bool) -> Option<Nccl> {
        if skip {
            return None;
        }
        Nccl::new(bootstrap, gpu)
            .map_err(|e| {
                if bootstrap.rank() == 0 {
                    eprintln!("NCCL unavailable, doorbell only: {e}");
                }
            })
            .ok()
    }

    /// Creates the communicator (collective over `bootstrap`). Each rank checks NCCL and binds
    /// `gpu`; rank 0 also makes the unique id. One all-gather then spreads the id, or the first
    /// failure, so that a rank without NCCL makes every rank fail with its reason instead of
    /// leaving the others waiting in `ncclCommInitRank`.
    pub fn new(bootstrap: &Bootstrap, gpu: &Arc<Gpu>) -> Result<Nccl> {
        let rank = bootstrap.rank();
        let world_size = bootstrap.world_size();
        let nranks = c_int::try_from(world_size).map_err(|_| {
            Error::invalid(
                "world size",
                format!("{world_size} ranks overflow NCCL's int"),
            )
        })?;
        let local = Self::prepare(rank == 0, gpu);
        let mut payload = Vec::new();
        match &local {
            Ok((_, id)) => {
                payload.push(SETUP_OK);
                payload.extend(
                    id.iter()
                        .flat_map(|id| id.internal.map(|c| u8::from_ne_bytes(c.to_ne_bytes()))),
                );
            }
            Err(e) => {
                payload.push(SETUP_FAILED);
                let why = match e {
                    Error::TransportUnavailable { why, .. } => why.clone(),
                    other => other.to_string(),
                };
                payload.extend(why.into_bytes());
            }
        }
        let parts = bootstrap.all_gather(&payload)?;
        let (version, _) = local?;
        for (r, part) in parts.iter().enumerate() {
            if part.first() != Some(&SETUP_OK) {
                let why = part
                    .get(1..)
                    .map(String::from_utf8_lossy)
                    .unwrap_or_default();
                return Err(unavailable(format!("rank {r} cannot set up NCCL: {why}")));
            }
        }
        let id = decode_unique_id(&parts[0][1..]).ok_or_else(|| Error::Bootstrap {
            me: rank,
            rank: Some(0),
            why: format!(
                "sent an NCCL unique id of {} bytes, expected {}",
                parts[0].len() - 1,
                std::mem::size_of::<sys::ncclUniqueId>()
            ),
        })?;
        let mut comm: sys::ncclComm_t = std::ptr::null_mut();
        // SAFETY: `comm` outlives the call; `gpu`'s context is current on this thread (bound in
        // `prepare`), which is the device NCCL takes; every rank passes the same id and world
        // size and its own rank, as ncclCommInitRank requires.
        check("ncclCommInitRank", unsafe {
            sys::ncclCommInitRank(&mut comm, nranks, id, rank as c_int)
        })?;
        Ok(Nccl {
            comm,
            gpu: gpu.clone(),
            world_size,
            version,
            native_all_to_all: has_symbol("ncclAlltoAll"),
        })
    }

    /// This rank's part of setup before any peer is involved: NCCL present, GPU bound, version
    /// read, and on rank 0 the unique id.
    fn prepare(make_id: bool, gpu: &Gpu) -> Result<(i32, Option<sys::ncclUniqueId>)> {
        nccl_available()?;
        gpu.bind()?;
        let version = library_version()?;
        if !make_id {
            return Ok((version, None));
        }
        let mut id = sys::ncclUniqueId { internal: [0; 128] };
        // SAFETY: `id` outlives the call, which only writes it.
        check("ncclGetUniqueId", unsafe { sys::ncclGetUniqueId(&mut id) })?;
        Ok((version, Some(id)))
    }

    /// The loaded NCCL's version, e.g. "2.28.9".
    pub fn version(&self) -> String {
        format_version(self.version)
    }

    /// Number of ranks in the communicator.
    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// Whether [`Nccl::all_to_all`] calls NCCL's own `ncclAlltoAll` (2.28+) rather than a group
    /// of `ncclSend`/`ncclRecv`, as nccl-tests does on older NCCL. Benchmarks print this.
    pub fn has_native_all_to_all(&self) -> bool {
        self.native_all_to_all
    }

    /// NCCL's type for `dtype`, refused when the loaded NCCL predates it.
    fn data_type(&self, dtype: DataType) -> Result<sys::ncclDataType_t> {
        if dtype == DataType::Bf16 && self.version < FIRST_BF16_VERSION {
            return Err(Error::invalid(
                "dtype",
                format!("NCCL {} has no bfloat16 (2.10+ does)", self.version()),
            ));
        }
        Ok(nccl_data_type(dtype))
    }

    /// Refuses a stream of another GPU before NCCL would fail on it less clearly.
    fn check_stream(&self, stream: &CudaStream) -> Result<()> {
        if !Arc::ptr_eq(stream.context(), self.gpu.context()) {
            return Err(Error::invalid(
                "stream",
                format!(
                    "the stream is on GPU {}, the NCCL communicator on GPU {}",
                    stream.context().ordinal(),
                    self.gpu.ordinal()
                ),
            ));
        }
        Ok(())
    }

    /// Sums `count` elements of `dtype` over all ranks, enqueued on `stream`: out of place, or in
    /// place when `send == recv`. Collective: every rank calls it with the same count and type.
    ///
    /// # Safety
    /// `send` and `recv` are device addresses on this communicator's GPU, each valid for `count`
    /// elements of `dtype`, and stay allocated (and unused by other work) until `stream` has run
    /// the operation.
    pub unsafe fn all_reduce(
        &self,
        stream: &CudaStream,
        send: u64,
        recv: u64,
        count: usize,
        dtype: DataType,
    ) -> Result<()> {
        self.check_stream(stream)?;
        let dt = self.data_type(dtype)?;
        // SAFETY: the buffers are valid per the caller's contract; the communicator is live and
        // `stream` belongs to its GPU (checked above).
        check("ncclAllReduce", unsafe {
            sys::ncclAllReduce(
                send as *const c_void,
                recv as *mut c_void,
                count,
                dt,
                sys::ncclRedOp_t::ncclSum,
                self.comm,
                nccl_stream(stream),
            )
        })
    }

    /// All-gather, enqueued on `stream`: every rank's `count` elements at `send` land in block
    /// `rank` of every rank's `recv` (`world_size * count` elements). Collective.
    ///
    /// # Safety
    /// `send` holds `count` and `recv` `world_size * count` elements of `dtype` on this
    /// communicator's GPU (`send` may be block `rank` of `recv`), allocated until `stream` has
    /// run the operation.
    pub unsafe fn all_gather(
        &self,
        stream: &CudaStream,
        send: u64,
        recv: u64,
        count: usize,
        dtype: DataType,
    ) -> Result<()> {
        self.check_stream(stream)?;
        let dt = self.data_type(dtype)?;
        // SAFETY: the buffers are valid per the caller's contract; the communicator is live and
        // `stream` belongs to its GPU (checked above).
        check("ncclAllGather", unsafe {
            sys::ncclAllGather(
                send as *const c_void,
                recv as *mut c_void,
                count,
                dt,
                self.comm,
                nccl_stream(stream),
            )
        })
    }

    /// Equal-count all-to-all, enqueued on `stream`: block `r` of `send` (elements
    /// `r*count .. (r+1)*count`) goes to rank `r`, and block `r` of `recv` comes from rank `r`.
    /// Collective: every rank calls it with the same count and type.
    ///
    /// # Safety
    /// `send` and `recv` are distinct, non-overlapping device addresses on this communicator's
    /// GPU, each valid for `world_size * count` elements of `dtype`, and stay allocated (and
    /// unused by other work) until `stream` has run the operation.
    pub unsafe fn all_to_all(
        &self,
        stream: &CudaStream,
        send: u64,
        recv: u64,
        count: usize,
        dtype: DataType,
    ) -> Result<()> {
        self.check_stream(stream)?;
        let dt = self.data_type(dtype)?;
        count
            .checked_mul(dtype.size())
            .filter(|b| b.checked_mul(self.world_size).is_some())
            .ok_or_else(|| {
                Error::invalid("count", format!("{count} elements per rank overflow"))
            })?;
        let s = nccl_stream(stream);
        if self.native_all_to_all {
            // SAFETY: the buffers are valid per the caller's contract; the communicator is live,
            // `stream` belongs to its GPU, and ncclAlltoAll was found in the library.
            return check("ncclAlltoAll", unsafe {
                sys::ncclAlltoAll(
                    send as *const c_void,
                    recv as *mut c_void,
                    count,
                    dt,
                    self.comm,
                    s,
                )
            });
        }
        let counts = vec![count; self.world_size];
        let offsets: Vec<usize> = (0..self.world_size).map(|p| p * count).collect();
        // SAFETY: block p of each buffer lies inside the ranges the caller vouched for.
        unsafe {
            self.all_to_all_v(
                stream, send, recv, &counts, &offsets, &counts, &offsets, dtype,
            )
        }
    }

    /// All-to-all with per-peer counts and offsets (elements of `dtype`), as grouped
    /// `ncclSend`/`ncclRecv`. Collective: what rank p sends me must equal what I expect from p.
    ///
    /// # Safety
    /// Every block the counts and offsets name lies inside `send` / `recv` (device memory of this
    /// GPU, not overlapping), allocated until `stream` has run the operation.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn all_to_all_v(
        &self,
        stream: &CudaStream,
        send: u64,
        recv: u64,
        send_counts: &[usize],
        send_offsets: &[usize],
        recv_counts: &[usize],
        recv_offsets: &[usize],
        dtype: DataType,
    ) -> Result<()> {
        self.check_stream(stream)?;
        let dt = self.data_type(dtype)?;
        let n = self.world_size;
        if [send_counts, send_offsets, recv_counts, recv_offsets]
            .iter()
            .any(|v| v.len() != n)
        {
            return Err(Error::invalid("counts", format!("need {n} of each")));
        }
        let size = dtype.size() as u64;
        let s = nccl_stream(stream);
        // SAFETY: opens a group on this thread; it is closed below on every path.
        check("ncclGroupStart", unsafe { sys::ncclGroupStart() })?;
        let mut posted = Ok(());
        for peer in 0..n {
            // SAFETY: the blocks lie inside the buffers per the caller's contract; `peer` fits
            // in an int (checked in `new`).
            posted = check("ncclSend", unsafe {
                sys::ncclSend(
                    (send + send_offsets[peer] as u64 * size) as *const c_void,
                    send_counts[peer],
                    dt,
                    peer as c_int,
                    self.comm,
                    s,
                )
            })
            .and_then(|()| {
                // SAFETY: as for the send.
                check("ncclRecv", unsafe {
                    sys::ncclRecv(
                        (recv + recv_offsets[peer] as u64 * size) as *mut c_void,
                        recv_counts[peer],
                        dt,
                        peer as c_int,
                        self.comm,
                        s,
                    )
                })
            });
            if posted.is_err() {
                break;
            }
        }
        // SAFETY: closes the group opened above.
        let launched = check("ncclGroupEnd", unsafe { sys::ncclGroupEnd() });
        posted.and(launched)
    }

    /// Allocates `bytes` with `ncclMemAlloc` and registers them as a symmetric window
    /// (`NCCL_WIN_COLL_SYMMETRIC`), which lets NCCL pick its symmetric-memory kernels for
    /// collectives whose buffers lie inside. Collective: every rank asks for the same size, in the
    /// same order, and drops the buffers in the same order.
    ///
    /// Fails with [`Error::TransportUnavailable`] when the loaded NCCL predates windows (2.27),
    /// and with [`Error::Cuda`] naming the call when allocation or registration fails; a
    /// benchmark reports that and goes on with NCCL's default path.
    pub fn symmetric_buffer(&self, bytes: usize) -> Result<SymmetricBuffer<'_>> {
        if bytes == 0 {
            return Err(Error::invalid(
                "bytes",
                "a symmetric window cannot be empty",
            ));
        }
        let missing: Vec<&str> = WINDOW_SYMBOLS
            .into_iter()
            .filter(|name| !has_symbol(name))
            .collect();
        if !missing.is_empty() {
            return Err(Error::TransportUnavailable {
                transport: "NCCL symmetric windows",
                why: format!(
                    "NCCL {} lacks {}: symmetric memory windows need NCCL 2.27 or newer",
                    self.version(),
                    missing.join(", ")
                ),
            });
        }
        self.gpu.bind()?;
        let mut ptr: *mut c_void = std::ptr::null_mut();
        // SAFETY: `ptr` outlives the call and receives a fresh allocation on the current GPU,
        // which is this communicator's (bound above).
        check("ncclMemAlloc", unsafe {
            sys::ncclMemAlloc(&mut ptr, bytes)
        })?;
        let mut window: sys::ncclWindow_t = std::ptr::null_mut();
        // SAFETY: `ptr` is a live ncclMemAlloc allocation of `bytes`; the communicator is live;
        // `window` outlives the call.
        let registered = check("ncclCommWindowRegister", unsafe {
            sys::ncclCommWindowRegister(self.comm, ptr, bytes, &mut window, NCCL_WIN_COLL_SYMMETRIC)
        });
        if let Err(Error::Cuda { call, code }) = registered {
            // SAFETY: `ptr` came from ncclMemAlloc above and nothing else refers to it.
            unsafe { sys::ncclMemFree(ptr) };
            return Err(Error::Cuda {
                call,
                code: format!(
                    "{code} (symmetric windows need NCCL 2.27+ with CUDA VMM, i.e. \
                     NCCL_CUMEM_ENABLE unset or 1, and GPUs that NCCL can reach by NVLink; run \
                     with NCCL_DEBUG=WARN for NCCL's reason)"
                ),
            });
        }
        registered?;
        Ok(SymmetricBuffer {
            nccl: self,
            ptr,
            window,
            bytes,
        })
    }
}

impl Drop for Nccl {
    fn drop(&mut self) {
        // NCCL switches to the communicator's device itself; binding keeps cudarc's view of the
        // thread's context in step with it. Errors cannot be reported from drop.
        let _ = self.gpu.bind();
        // SAFETY: `comm` came from ncclCommInitRank and is destroyed once, here; no symmetric
        // buffer outlives it (they borrow `self`).
        let _ = unsafe { sys::ncclCommDestroy(self.comm) };
    }
}

/// Rebuilds the unique id rank 0 sent; `None` when the length is wrong.
fn decode_unique_id(bytes: &[u8]) -> Option<sys::ncclUniqueId> {
    let mut id = sys::ncclUniqueId { internal: [0; 128] };
    if bytes.len() != id.internal.len() {
        return None;
    }
    for (c, &b) in id.internal.iter_mut().zip(bytes) {
        *c = c_char::from_ne_bytes([b]);
    }
    Some(id)
}

/// Device memory from `ncclMemAlloc`, registered with the communicator as a symmetric window.
/// Dropping it deregisters the window and frees the memory (on every rank, in the same order);
/// it cannot outlive its communicator.
pub struct SymmetricBuffer<'a> {
    nccl: &'a Nccl,
    ptr: *mut c_void,
    window: sys::ncclWindow_t,
    bytes: usize,
}

impl std::fmt::Debug for SymmetricBuffer<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SymmetricBuffer")
            .field("device_ptr", &format_args!("{:#x}", self.device_ptr()))
            .field("bytes", &self.bytes)
            .finish()
    }
}

impl SymmetricBuffer<'_> {
    /// The buffer's device address, to pass to [`Nccl::all_reduce`] or [`Nccl::all_to_all`].
    pub fn device_ptr(&self) -> u64 {
        self.ptr as u64
    }

    /// Size in bytes.
    pub fn len(&self) -> usize {
        self.bytes
    }

    /// Always false: empty windows are refused.
    pub fn is_empty(&self) -> bool {
        self.bytes == 0
    }
}

impl Drop for SymmetricBuffer<'_> {
    fn drop(&mut self) {
        let _ = self.nccl.gpu.bind();
        // SAFETY: `window` was registered on this live communicator (the borrow keeps it alive)
        // and is deregistered once, here; then `ptr`, from ncclMemAlloc, is freed once. Errors
        // cannot be reported from drop.
        unsafe {
            let _ = sys::ncclCommWindowDeregister(self.nccl.comm, self.window);
            let _ = sys::ncclMemFree(self.ptr);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn data_types_map_to_nccl() {
        use sys::ncclDataType_t as T;
        assert_eq!(nccl_data_type(DataType::Bf16), T::ncclBfloat16);
        assert_eq!(nccl_data_type(DataType::F16), T::ncclFloat16);
        assert_eq!(nccl_data_type(DataType::F32), T::ncclFloat32);
        // The numbers nccl.h gives them, in case the bindings drift.
        assert_eq!(T::ncclFloat16 as u32, 6);
        assert_eq!(T::ncclFloat32 as u32, 7);
        assert_eq!(T::ncclBfloat16 as u32, 9);
    }

    #[test]
    fn versions_format_both_encodings() {
        assert_eq!(format_version(22809), "2.28.9");
        assert_eq!(format_version(21903), "2.19.3");
        assert_eq!(format_version(21000), "2.10.0");
        // Before 2.9: major*1000 + minor*100 + patch.
        assert_eq!(format_version(2804), "2.8.4");
    }

    #[test]
    fn unique_id_round_trips_and_rejects_wrong_length() {
        let bytes: Vec<u8> = (0..128).map(|i| (i * 7) as u8).collect();
        let id = decode_unique_id(&bytes).expect("128 bytes decode");
        let back: Vec<u8> = id
            .internal
            .iter()
            .map(|&c| u8::from_ne_bytes(c.to_ne_bytes()))
            .collect();
        assert_eq!(back, bytes);
        assert!(decode_unique_id(&bytes[..127]).is_none());
        assert!(decode_unique_id(&[]).is_none());
    }
}
