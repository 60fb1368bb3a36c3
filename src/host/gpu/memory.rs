//! GPU memory that other processes of the job can map.
//!
//! [`Buffer`] is doorbell's own allocation: CUDA VMM (`cuMemCreate` with a POSIX-fd handle,
//! rounded up to the allocation granularity, mapped with `cuMemMap`/`cuMemSetAccess`). Its fd is
//! exported and handed to peers on the same host over the job's Unix socket
//! ([`crate::gpu::fd_passing`]); they map it with `transport::ipc::RemoteMemory::import`. Every
//! mapping is released by `Drop`, on error paths too: each constructor builds an RAII guard per
//! step before taking the next one.

use crate::error::{Error, Result};
use crate::gpu::cuda::{driver_result, Gpu};
use cudarc::driver::sys;
use std::os::fd::{FromRawFd, OwnedFd};
use std::sync::Arc;

/// Identifies this host (hostname and boot id): ranks with equal ids can share GPU memory.
pub fn host_id() -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    let mut name = [0u8; 256];
    // SAFETY: gethostname writes at most `len` bytes into the buffer.
    unsafe { libc::gethostname(name.as_mut_ptr() as *mut libc::c_char, name.len()) };
    name.hash(&mut h);
    std::fs::read("/proc/sys/kernel/random/boot_id")
        .unwrap_or_default()
        .hash(&mut h);
    h.finish()
}

fn allocation_prop(ordinal: usize) -> sys::CUmemAllocationProp {
    // SAFETY: the struct is plain data; all-zero is its documented "unset" state.
    let mut prop: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
    prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.requestedHandleTypes =
        sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    prop.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = ordinal as i32;
    prop
}

pub(crate) fn access_desc(ordinal: usize) -> sys::CUmemAccessDesc {
    // SAFETY: plain data, zero is a valid starting state.
    let mut d: sys::CUmemAccessDesc = unsafe { std::mem::zeroed() };
    d.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
    d.location.id = ordinal as i32;
    d.flags = sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    d
}

/// The allocation granularity (bytes) doorbell rounds VMM buffers up to on `gpu`.
pub fn granularity(gpu: &Gpu) -> Result<usize> {
    gpu.bind()?;
    let prop = allocation_prop(gpu.ordinal());
    let mut g = 0usize;
    // SAFETY: `prop` is a valid allocation description; `g` outlives the call.
    driver_result("cuMemGetAllocationGranularity", unsafe {
        sys::cuMemGetAllocationGranularity(
            &mut g,
            &prop,
            sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_RECOMMENDED,
        )
    })?;
    Ok(g.max(1))
}

/// A physical allocation handle, released on drop.
pub(crate) struct PhysicalHandle(pub(crate) sys::CUmemGenericAllocationHandle);

impl Drop for PhysicalHandle {
    fn drop(&mut self) {
        // SAFETY: the handle came from cuMemCreate/cuMemImportFromShareableHandle; released once.
        unsafe { sys::cuMemRelease(self.0) };
    }
}

/// A reserved virtual address range, freed on drop.
struct Reservation {
    ptr: u64,
    bytes: usize,
}

impl Drop for Reservation {
    fn drop(&mut self) {
        // SAFETY: the range came from cuMemAddressReserve; nothing is mapped in it any more
        // (Mapping drops first).
        unsafe { sys::cuMemAddressFree(self.ptr, self.bytes) };
    }
}

/// A physical allocation mapped into a reservation, unmapped on drop.
pub(crate) struct Mapping {
    // Field order is drop order: unmap, then free the range, then release the handle.
    pub(crate) ptr: u64,
    bytes: usize,
    _range: Reservation,
    _handle: PhysicalHandle,
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: [ptr, ptr+bytes) was mapped by cuMemMap; unmapped once, before the range is freed.
        unsafe { sys::cuMemUnmap(self.ptr, self.bytes) };
    }
}

impl Mapping {
    /// Maps `handle` (of `bytes`, a granularity multiple) and grants `gpu` read/write access.
    pub(crate) fn map(
        gpu: &Gpu,
        handle: PhysicalHandle,
        bytes: usize,
        granularity: usize,
    ) -> Result<Mapping> {
        let mut ptr = 0u64;
        // SAFETY: reserving fresh address space; `ptr` outlives the call.
        driver_result("cuMemAddressReserve", unsafe {
            sys::cuMemAddressReserve(&mut ptr, bytes, granularity, 0, 0)
        })?;
        let range = Reservation { ptr, bytes };
        // SAFETY: the range is reserved and `bytes` long; the handle covers `bytes`.
        driver_result("cuMemMap", unsafe {
            sys::cuMemMap(ptr, bytes, 0, handle.0, 0)
        })?;
        let mapping = Mapping {
            ptr,
            bytes,
            _range: range,
            _handle: handle,
        };
        let desc = access_desc(gpu.ordinal());
        // SAFETY: the range is mapped; `desc` names this process's GPU.
        driver_result("cuMemSetAccess", unsafe {
            sys::cuMemSetAccess(ptr, bytes, &desc, 1)
        })
        .map_err(|e| match e {
            Error::Cuda { call, code } => Error::Cuda {
                call,
                code: format!(
                    "{code} (GPU {} cannot map this memory: peer access between these GPUs is \
                     not supported)",
                    gpu.ordinal()
                ),
            },
            other => other,
        })?;
        Ok(mapping)
    }
}

/// GPU memory doorbell allocated with the CUDA VMM API, shareable with the job's other processes
/// on this host. Freed on drop.
pub struct Buffer {
    gpu: Arc<Gpu>,
    mapping: Mapping,
    bytes: usize,
}

impl std::fmt::Debug for Buffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Buffer")
            .field("gpu", &self.gpu.ordinal())
            .field("ptr", &format_args!("{:#x}", self.mapping.ptr))
            .field("bytes", &self.bytes)
            .finish()
    }
}

impl Buffer {
    /// Allocates at least `bytes` (rounded up to the granularity) on `gpu`, zero-filled.
    pub fn alloc(gpu: &Arc<Gpu>, bytes: usize) -> Result<Buffer> {
        if bytes == 0 {
            return Err(Error::invalid("bytes", "cannot allocate an empty buffer"));
        }
        let g = granularity(gpu)?;
        let rounded = bytes
            .checked_next_multiple_of(g)
            .ok_or_else(|| Error::invalid("bytes", format!("{bytes} bytes overflows")))?;
        let prop = allocation_prop(gpu.ordinal());
        let mut raw = 0;
        // SAFETY: `prop` describes a pinned device allocation; `raw` outlives the call.
        driver_result("cuMemCreate", unsafe {
            sys::cuMemCreate(&mut raw, rounded, &prop, 0)
        })
        .map_err(|e| match e {
            Error::Cuda { call, code } => Error::Cuda {
                call,
                code: format!(
                    "{code} (allocating {rounded} bytes on GPU {})",
                    gpu.ordinal()
                ),
            },
            other => other,
        })?;
        let mapping = Mapping::map(gpu, PhysicalHandle(raw), rounded, g)?;
        // SAFETY: the mapping is `rounded` bytes of this GPU's memory, current context bound.
        driver_result("cuMemsetD8", unsafe {
            sys::cuMemsetD8_v2(mapping.ptr, 0, rounded)
        })?;
        Ok(Buffer {
            gpu: gpu.clone(),
            mapping,
            bytes: rounded,
        })
    }

    /// Device address of the first byte.
    pub fn device_ptr(&self) -> u64 {
        self.mapping.ptr
    }

    /// Size in bytes (a granularity multiple, at least what was asked for).
    pub fn len(&self) -> usize {
        self.bytes
    }

    /// Never true: buffers are not empty.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// The GPU holding it.
    pub fn gpu(&self) -> &Arc<Gpu> {
        &self.gpu
    }

    /// Exports the allocation as a POSIX fd another process can import.
    pub fn export_fd(&self) -> Result<OwnedFd> {
        self.gpu.bind()?;
        let mut fd: libc::c_int = -1;
        // SAFETY: for POSIX_FILE_DESCRIPTOR the output is an int; the handle is live.
        driver_result("cuMemExportToShareableHandle", unsafe {
            sys::cuMemExportToShareableHandle(
                &mut fd as *mut libc::c_int as *mut std::ffi::c_void,
                self.mapping._handle.0,
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                0,
            )
        })?;
        // SAFETY: the driver returned a fresh fd that we now own.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }

    /// Copies `data` into the buffer at `offset`. Synchronous with the whole device: it waits
    /// for all work queued on the GPU before and after the copy (for setup and tests, not hot
    /// paths).
    pub fn write(&self, offset: usize, data: &[u8]) -> Result<()> {
        self.check_range(offset, data.len())?;
        self.device_synchronize()?;
        // SAFETY: the range was checked to lie inside the mapping.
        driver_result("cuMemcpyHtoD", unsafe {
            sys::cuMemcpyHtoD_v2(
                self.mapping.ptr + offset as u64,
                data.as_ptr() as *const std::ffi::c_void,
                data.len(),
            )
        })?;
        self.device_synchronize()
    }

    /// Copies `out.len()` bytes at `offset` out of the buffer, after all work queued on the GPU.
    pub fn read(&self, offset: usize, out: &mut [u8]) -> Result<()> {
        self.check_range(offset, out.len())?;
        self.device_synchronize()?;
        // SAFETY: as in `write`.
        driver_result("cuMemcpyDtoH", unsafe {
            sys::cuMemcpyDtoH_v2(
                out.as_mut_ptr() as *mut std::ffi::c_void,
                self.mapping.ptr + offset as u64,
                out.len(),
            )
        })
    }

    /// Sets `len` bytes at `offset` to `value`, synchronous with the whole device like `write`.
    pub fn fill(&self, offset: usize, len: usize, value: u8) -> Result<()> {
        self.check_range(offset, len)?;
        self.device_synchronize()?;
        // SAFETY: as in `write`.
        driver_result("cuMemsetD8", unsafe {
            sys::cuMemsetD8_v2(self.mapping.ptr + offset as u64, value, len)
        })?;
        self.device_synchronize()
    }

    fn device_synchronize(&self) -> Result<()> {
        self.gpu.bind()?;
        // SAFETY: no arguments; the context is current.
        driver_result("cuCtxSynchronize", unsafe { sys::cuCtxSynchronize() })
    }

    fn check_range(&self, offset: usize, len: usize) -> Result<()> {
        match offset.checked_add(len) {
            Some(end) if end <= self.bytes => Ok(()),
            _ => Err(Error::invalid(
                "range",
                format!(
                    "[{offset}, +{len}) is outside a buffer of {} bytes",
                    self.bytes
                ),
            )),
        }
    }
}
