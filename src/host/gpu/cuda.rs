//! CUDA through cudarc: opening a GPU without panicking when the driver or the GPU is missing,
//! checking raw driver calls, loading doorbell's embedded kernels, and host-mapped pinned memory.
//!
//! This module owns every "is there a driver" decision: cudarc panics when libcuda cannot be
//! loaded, so nothing else in the crate may touch the driver before [`Gpu::open`] (or
//! [`device_count`]) has said yes.

use crate::error::{Error, Result};
use bytemuck::Pod;
use cudarc::driver::{sys, CudaContext, CudaFunction, CudaModule, CudaStream, DriverError};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

mod embedded {
    include!(concat!(env!("OUT_DIR"), "/kernels.rs"));
}

/// Turns a raw driver result into [`Error::Cuda`] naming the call.
pub fn driver_result(call: &'static str, r: sys::CUresult) -> Result<()> {
    match r {
        sys::CUresult::CUDA_SUCCESS => Ok(()),
        other => Err(Error::Cuda {
            call,
            code: DriverError(other).to_string(),
        }),
    }
}

/// The name before [`driver_result`] ("check" now means only the call check).
#[doc(hidden)]
#[deprecated(note = "renamed to `driver_result`")]
pub fn check(call: &'static str, r: sys::CUresult) -> Result<()> {
    driver_result(call, r)
}

/// Queues a copy of `bytes` from `src` to `dst`, device addresses of this context (peers'
/// memory mapped here included), on `stream`.
///
/// # Safety
/// Both ranges must hold `bytes` and stay valid until the stream's work is done.
pub unsafe fn copy_async(stream: &CudaStream, dst: u64, src: u64, bytes: usize) -> Result<()> {
    // SAFETY: the caller vouches for the ranges; the stream is live.
    driver_result("cuMemcpyDtoDAsync", unsafe {
        sys::cuMemcpyDtoDAsync_v2(dst, src, bytes, stream.cu_stream())
    })
}

/// Queues a copy of `bytes` from `src` to `dst`, any unified addresses (device memory, pinned or
/// pageable host memory), on `stream`; the driver tells which is which.
///
/// # Safety
/// Both ranges must hold `bytes` and stay valid until the stream's work is done.
pub unsafe fn copy_unified_async(
    stream: &CudaStream,
    dst: u64,
    src: u64,
    bytes: usize,
) -> Result<()> {
    // SAFETY: the caller vouches for the ranges; the stream is live.
    driver_result("cuMemcpyAsync", unsafe {
        sys::cuMemcpyAsync(dst, src, bytes, stream.cu_stream())
    })
}

/// Queues a copy of `bytes` from device address `src` to host memory at `dst` on `stream`.
///
/// # Safety
/// `dst` must be host memory of `bytes` (pinned for the copy to be asynchronous), `src` device
/// memory of this context of `bytes`, both valid until the stream's work is done.
pub unsafe fn copy_to_host_async(
    stream: &CudaStream,
    dst: *mut u8,
    src: u64,
    bytes: usize,
) -> Result<()> {
    // SAFETY: the caller vouches for the ranges.
    driver_result("cuMemcpyDtoHAsync", unsafe {
        sys::cuMemcpyDtoHAsync_v2(dst.cast(), src, bytes, stream.cu_stream())
    })
}

/// Queues a copy of `bytes` from host memory at `src` to device address `dst` on `stream`.
///
/// # Safety
/// As for [`copy_to_host_async`], the other way.
pub unsafe fn copy_from_host_async(
    stream: &CudaStream,
    dst: u64,
    src: *const u8,
    bytes: usize,
) -> Result<()> {
    // SAFETY: the caller vouches for the ranges.
    driver_result("cuMemcpyHtoDAsync", unsafe {
        sys::cuMemcpyHtoDAsync_v2(dst, src.cast(), bytes, stream.cu_stream())
    })
}

/// Queues a store of `value` into the u32 at device address `at` on `stream`.
///
/// # Safety
/// `at` must be 4-byte aligned device memory of this context, valid until the store ran.
pub unsafe fn store_u32_async(stream: &CudaStream, at: u64, value: u32) -> Result<()> {
    // SAFETY: the caller vouches for the word.
    driver_result("cuMemsetD32Async", unsafe {
        sys::cuMemsetD32Async(at, value, 1, stream.cu_stream())
    })
}

/// Queues a write of `value` into the u64 at device address `at` on `stream`, ordered after the
/// stream's earlier work with the default memory barrier (a peer that sees the value sees the
/// copies queued before it). Measured on H200: under heavy load from other kernels such a
/// barriered write can take about a millisecond; the no-barrier flag was refused at run time.
///
/// # Safety
/// `at` must be 8-byte aligned device memory mapped in this context (a peer's included), valid
/// until the write ran.
pub unsafe fn write_u64_after_async(stream: &CudaStream, at: u64, value: u64) -> Result<()> {
    // SAFETY: the caller vouches for the word.
    driver_result("cuStreamWriteValue64", unsafe {
        sys::cuStreamWriteValue64_v2(
            stream.cu_stream(),
            at,
            value,
            sys::CUstreamWriteValue_flags::CU_STREAM_WRITE_VALUE_DEFAULT as u32,
        )
    })
}

/// Launches `f` on `stream` with `params` (a pointer to each argument, in order), as cudarc's
/// `LaunchArgs::launch` does; with `overlap` the launch carries the programmatic-serialization
/// attribute, so the GPU may schedule the kernel while the one before it in the stream finishes
/// (programmatic dependent launch, as NCCL launches its symmetric kernels on sm_90). Only for
/// kernels that begin with `wait_previous_grid()` (cuda/include/doorbell/core/common.cuh), and only
/// where [`Gpu::overlapping_launch`] says so.
///
/// # Safety
/// `params` must match `f`'s parameters in number, order and layout, each pointer valid for the
/// duration of the call; what the kernel touches must stay valid until it has run.
pub unsafe fn launch(
    stream: &CudaStream,
    f: &CudaFunction,
    cfg: cudarc::driver::LaunchConfig,
    params: &mut [*mut std::ffi::c_void],
    overlap: bool,
) -> std::result::Result<(), DriverError> {
    stream.context().bind_to_thread()?;
    // SAFETY: zero is a valid bit pattern for this plain C struct (id 0 = ignored).
    let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
    attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
    attr.value.programmaticStreamSerializationAllowed = 1;
    let config = sys::CUlaunchConfig {
        gridDimX: cfg.grid_dim.0,
        gridDimY: cfg.grid_dim.1,
        gridDimZ: cfg.grid_dim.2,
        blockDimX: cfg.block_dim.0,
        blockDimY: cfg.block_dim.1,
        blockDimZ: cfg.block_dim.2,
        sharedMemBytes: cfg.shared_mem_bytes,
        hStream: stream.cu_stream(),
        attrs: &mut attr,
        numAttrs: u32::from(overlap),
    };
    // SAFETY: the caller vouches for `params`; `config` and `attr` live through the call.
    unsafe {
        sys::cuLaunchKernelEx(
            &config,
            f.cu_function(),
            params.as_mut_ptr(),
            std::ptr::null_mut(),
        )
    }
    .result()
}

/// Maps a cudarc error to [`Error::Cuda`] naming the operation.
pub(crate) fn cuda_err(call: &'static str) -> impl FnOnce(DriverError) -> Error {
    move |e| Error::Cuda {
        call,
        code: e.to_string(),
    }
}

/// Loads libcuda (if it exists) and initializes the driver. Never panics.
fn init_driver() -> Result<()> {
    // SAFETY: only probes whether the library can be loaded; no driver call is made.
    if !unsafe { sys::is_culib_present() } {
        return Err(Error::NoCudaDriver {
            why: "libcuda.so could not be loaded: no NVIDIA driver is installed here, or it is \
                  not on the library path"
                .into(),
        });
    }
    // SAFETY: cuInit takes a flags word and has no other preconditions.
    match unsafe { sys::cuInit(0) } {
        sys::CUresult::CUDA_SUCCESS => Ok(()),
        sys::CUresult::CUDA_ERROR_NO_DEVICE => Err(Error::NoCudaDriver {
            why: "the CUDA driver is installed but sees no GPU (CUDA_ERROR_NO_DEVICE); check \
                  CUDA_VISIBLE_DEVICES"
                .into(),
        }),
        other => Err(Error::NoCudaDriver {
            why: format!("cuInit failed: {}", DriverError(other)),
        }),
    }
}

/// Number of GPUs this process can see. Errors with [`Error::NoCudaDriver`] when there is no
/// driver or no GPU.
pub fn device_count() -> Result<usize> {
    init_driver()?;
    let mut n = 0;
    // SAFETY: the driver is initialized; `n` outlives the call.
    driver_result("cuDeviceGetCount", unsafe { sys::cuDeviceGetCount(&mut n) })?;
    if n <= 0 {
        return Err(Error::NoCudaDriver {
            why: "the CUDA driver reports no GPU".into(),
        });
    }
    Ok(n as usize)
}

/// Whether this process loads CUDA modules lazily (`CUDA_MODULE_LOADING=LAZY`, the driver's and
/// PyTorch's default): a kernel's first launch then loads its module, and loading synchronizes
/// the context, which waits for every running kernel, doorbell's waiting ones included. Asked
/// once; false when the driver cannot say.
pub fn loads_lazily() -> bool {
    static LAZY: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *LAZY.get_or_init(|| {
        if init_driver().is_err() {
            return false;
        }
        let mut mode = sys::CUmoduleLoadingMode::CU_MODULE_EAGER_LOADING;
        // SAFETY: the driver is initialized; `mode` outlives the call.
        let r = unsafe { sys::cuModuleGetLoadingMode(&mut mode) };
        r == sys::CUresult::CUDA_SUCCESS && mode == sys::CUmoduleLoadingMode::CU_MODULE_LAZY_LOADING
    })
}

/// Records that host threads of this process make CUDA calls that kernels' waits depend on
/// (`what`: whose calls), when modules load lazily: a module loaded while doorbell's kernels wait
/// then holds those calls back until the waits give up, so every timeout's text names the cause
/// and the remedy (see [`crate::error::lazy_loading_hint`]).
pub fn note_host_cuda_calls(what: &'static str) {
    if loads_lazily() {
        crate::error::note_lazy_loading(what);
    }
}

/// One GPU of this process: its cudarc context (the device's primary context) and doorbell's
/// kernels, loaded once on first use.
pub struct Gpu {
    ctx: Arc<CudaContext>,
    modules: Mutex<HashMap<&'static str, Arc<CudaModule>>>,
    /// `DOORBELL_KERNEL_DIR`: fatbins that replace built-in modules (kernel development).
    kernel_dir: Option<std::path::PathBuf>,
}

impl std::fmt::Debug for Gpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gpu")
            .field("ordinal", &self.ctx.ordinal())
            .finish()
    }
}

impl Gpu {
    /// Opens GPU `ordinal`. [`Error::NoCudaDriver`] if there is no driver or GPU,
    /// [`Error::InvalidArgument`] if `ordinal` is not below the number of visible GPUs.
    pub fn open(ordinal: usize) -> Result<Arc<Gpu>> {
        let count = device_count()?;
        if ordinal >= count {
            return Err(Error::invalid(
                "device",
                format!("GPU {ordinal} requested but this process sees {count}"),
            ));
        }
        let kernel_dir = crate::job::config::Settings::from_env()?.kernel_dir;
        let ctx = CudaContext::new(ordinal).map_err(cuda_err("cuDevicePrimaryCtxRetain"))?;
        Ok(Arc::new(Gpu {
            ctx,
            modules: Mutex::new(HashMap::new()),
            kernel_dir,
        }))
    }

    /// The cudarc context; streams and buffers of the caller's own come from it.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The device ordinal.
    pub fn ordinal(&self) -> usize {
        self.ctx.ordinal()
    }

    /// Number of SMs (streaming multiprocessors).
    pub fn sm_count(&self) -> Result<u32> {
        Ok(self
            .ctx
            .attribute(
                cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
            )
            .map_err(cuda_err("cuDeviceGetAttribute"))? as u32)
    }

    /// The PCI address as sysfs names it (`0000:1b:00.0`).
    pub fn pci_bus_id(&self) -> Result<String> {
        use cudarc::driver::sys::CUdevice_attribute as A;
        let get = |a| {
            self.ctx
                .attribute(a)
                .map_err(cuda_err("cuDeviceGetAttribute"))
        };
        Ok(format!(
            "{:04x}:{:02x}:{:02x}.0",
            get(A::CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID)?,
            get(A::CU_DEVICE_ATTRIBUTE_PCI_BUS_ID)?,
            get(A::CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID)?
        ))
    }

    /// Whether kernels may be launched to overlap the kernel before them in their stream
    /// (programmatic dependent launch: compute capability 9.0 and later).
    pub fn overlapping_launch(&self) -> Result<bool> {
        let major = self
            .ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)
            .map_err(cuda_err("cuDeviceGetAttribute"))?;
        Ok(major >= 9)
    }

    /// Makes this GPU's context current on the calling thread (needed before raw driver calls).
    pub fn bind(&self) -> Result<()> {
        self.ctx
            .bind_to_thread()
            .map_err(cuda_err("cuCtxSetCurrent"))
    }

    /// Waits until `stream`'s work is done (`Ok(true)`) or `limit` has passed (`Ok(false)`),
    /// polling `cuStreamQuery`, yielding between polls for the first 10 ms (as a spinning
    /// `cuStreamSynchronize` would, so a step's synchronize returns as soon), then sleeping
    /// 100 us between polls (a long wait returns at most that late).
    pub fn wait_stream(&self, stream: &CudaStream, limit: Duration) -> Result<bool> {
        use cudarc::driver::sys::CUresult;
        self.bind()?;
        let start = Instant::now();
        loop {
            // SAFETY: `stream` is a live stream of this context, current on this thread.
            match unsafe { cudarc::driver::sys::cuStreamQuery(stream.cu_stream()) } {
                CUresult::CUDA_SUCCESS => return Ok(true),
                CUresult::CUDA_ERROR_NOT_READY => {}
                e => return Err(cuda_err("cuStreamQuery")(cudarc::driver::DriverError(e))),
            }
            let waited = start.elapsed();
            if waited >= limit {
                return Ok(false);
            }
            if waited < Duration::from_millis(10) {
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_micros(100));
            }
        }
    }

    /// A new stream on this GPU.
    pub fn new_stream(&self) -> Result<Arc<CudaStream>> {
        self.ctx.new_stream().map_err(cuda_err("cuStreamCreate"))
    }

    /// Kernel `name` from doorbell's module built from `cuda/kernels/<module>.cu`.
    pub fn function(&self, module: &str, name: &str) -> Result<CudaFunction> {
        let stem_name = module;
        let module = {
            let mut loaded = self.modules.lock().unwrap_or_else(|p| p.into_inner());
            let Some(&(stem, image)) = embedded::KERNEL_MODULES.iter().find(|(s, _)| *s == module)
            else {
                return Err(Error::invalid(
                    "kernel module",
                    format!("no cuda/kernels/{module}.cu was built into doorbell"),
                ));
            };
            match loaded.get(stem) {
                Some(m) => m.clone(),
                None => {
                    let replaced = self
                        .kernel_dir
                        .as_ref()
                        .map(|d| d.join(format!("{stem}.fatbin")))
                        .filter(|p| p.is_file());
                    let image = match replaced {
                        Some(path) => {
                            tracing::warn!(
                                "DOORBELL_KERNEL_DIR: kernels of {stem}.cu from {}, not the built-in ones",
                                path.display()
                            );
                            std::fs::read(&path)
                                .map_err(|e| Error::io(format!("reading {}", path.display()), e))?
                        }
                        None => image.to_vec(),
                    };
                    let m = self
                        .ctx
                        .load_module(cudarc::nvrtc::Ptx::from_binary(image))
                        .map_err(cuda_err("cuModuleLoadData"))?;
                    loaded.insert(stem, m.clone());
                    m
                }
            }
        };
        module.load_function(name).map_err(|e| Error::Cuda {
            call: "cuModuleGetFunction",
            code: format!("{name} in {stem_name}.cu: {e}"),
        })
    }
}

/// Names of the kernel modules built into this library.
pub fn kernel_modules() -> impl Iterator<Item = (&'static str, usize)> {
    embedded::KERNEL_MODULES.iter().map(|(s, b)| (*s, b.len()))
}

/// `len` values of `T` in pinned host memory the GPU can read and write (cuMemHostAlloc with
/// DEVICEMAP), zero-filled. Accessed with volatile reads and writes, so the host sees device
/// writes while kernels run (and after one trapped).
pub struct HostArray<T: Pod> {
    gpu: Arc<Gpu>,
    host: *mut T,
    device: u64,
    len: usize,
}

// SAFETY: pinned host memory owned by this value; all access is volatile reads/writes of Pod
// data, safe from any thread.
unsafe impl<T: Pod> Send for HostArray<T> {}
// SAFETY: as above.
unsafe impl<T: Pod> Sync for HostArray<T> {}

impl<T: Pod> HostArray<T> {
    /// Allocates `len` zeroed values mapped into `gpu`'s address space.
    pub fn new(gpu: &Arc<Gpu>, len: usize) -> Result<Self> {
        if len == 0 {
            return Err(Error::invalid("len", "empty host array"));
        }
        gpu.bind()?;
        let bytes = std::mem::size_of::<T>()
            .checked_mul(len)
            .ok_or_else(|| Error::invalid("len", "overflow"))?;
        let mut host: *mut std::ffi::c_void = std::ptr::null_mut();
        // SAFETY: `host` receives a fresh allocation of `bytes`; the context is current.
        driver_result("cuMemHostAlloc", unsafe {
            sys::cuMemHostAlloc(
                &mut host,
                bytes,
                sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE,
            )
        })?;
        // SAFETY: the allocation is `bytes` long; zero bytes are a valid T (Pod).
        unsafe { std::ptr::write_bytes(host as *mut u8, 0, bytes) };
        let mut device = 0;
        // SAFETY: `host` came from cuMemHostAlloc with DEVICEMAP.
        let r = driver_result("cuMemHostGetDevicePointer", unsafe {
            sys::cuMemHostGetDevicePointer_v2(&mut device, host, 0)
        });
        if let Err(e) = r {
            // SAFETY: freeing the allocation made above, never used since.
            unsafe { sys::cuMemFreeHost(host) };
            return Err(e);
        }
        Ok(HostArray {
            gpu: gpu.clone(),
            host: host as *mut T,
            device,
            len,
        })
    }

    /// Device address of element 0.
    pub fn device_ptr(&self) -> u64 {
        self.device
    }

    /// The host address of the first element (for bulk copies by the driver or the kernel's
    /// socket calls; element access goes through [`HostArray::read`] / [`HostArray::write`]).
    pub(crate) fn host_ptr(&self) -> *mut T {
        self.host
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Never true.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// Element `i` (volatile). Panics if `i` is out of range (a caller bug, not input).
    pub fn read(&self, i: usize) -> T {
        assert!(i < self.len);
        // SAFETY: in range of a live allocation of aligned Ts.
        unsafe { std::ptr::read_volatile(self.host.add(i)) }
    }

    /// Overwrites element `i` (volatile). Panics if `i` is out of range (a caller bug).
    pub fn write(&self, i: usize, v: T) {
        assert!(i < self.len);
        // SAFETY: as in `read`.
        unsafe { std::ptr::write_volatile(self.host.add(i), v) }
    }

    /// The `word`-th u64 of element `i` (volatile), for protocols that must read one word of a
    /// struct before the others. Panics if out of range.
    pub fn read_field(&self, i: usize, word: usize) -> u64 {
        assert!(i < self.len && (word + 1) * 8 <= std::mem::size_of::<T>());
        // SAFETY: in range; T's alignment is at least 8 for every struct read this way (checked
        // by the layout tests), so the word is aligned.
        unsafe { std::ptr::read_volatile((self.host.add(i) as *const u64).add(word)) }
    }
}

impl<T: Pod> Drop for HostArray<T> {
    fn drop(&mut self) {
        let _ = self.gpu.bind();
        // SAFETY: `host` came from cuMemHostAlloc and is freed once, here.
        unsafe { sys::cuMemFreeHost(self.host as *mut std::ffi::c_void) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernels_are_embedded_fatbins() {
        let mods: Vec<_> = kernel_modules().collect();
        assert!(mods.iter().any(|(s, _)| *s == "selftest"), "{mods:?}");
        for (stem, image) in embedded::KERNEL_MODULES {
            // A fatbin starts with the fatbin magic 0xBA55ED50 (little endian).
            assert_eq!(&image[..4], &[0x50, 0xed, 0x55, 0xba], "{stem}");
        }
    }

    #[test]
    fn no_driver_is_an_error_not_a_panic() {
        // SAFETY: probe only.
        if unsafe { sys::is_culib_present() } {
            return; // a machine with a driver: covered by the GPU suite
        }
        match Gpu::open(0) {
            Err(Error::NoCudaDriver { why }) => assert!(why.contains("libcuda"), "{why}"),
            other => panic!("expected NoCudaDriver, got {other:?}"),
        }
        assert!(matches!(device_count(), Err(Error::NoCudaDriver { .. })));
    }
}
