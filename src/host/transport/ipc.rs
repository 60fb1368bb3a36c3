//! CUDA IPC between processes of one host: a peer's memory mapped into this process. Doorbell's
//! own VMM allocations ([`crate::gpu::memory::Buffer`]) travel as POSIX fds handed over the job's
//! Unix socket ([`crate::gpu::fd_passing`]) and are mapped with `cuMemImportFromShareableHandle`;
//! memory a user already has (cudarc / `cudaMalloc`) travels as a legacy CUDA IPC handle.
//! [`MemoryDescriptor`] is what crosses between ranks: plain bytes, no pointers that mean
//! anything outside the owner. Every mapping is released by `Drop`, on error paths too.
//!
//! `CopyEngineConnection` is the proxy's link over such a mapping (copy-engine copies).
//!
//! This module never decides which peers share a host; the communicator does.

use super::{Address, Connection, Token};
use crate::error::{Error, Result};
use crate::gpu::cuda::{cuda_err, driver_result, Gpu, HostArray};
use crate::gpu::memory::{Mapping, PhysicalHandle};
use cudarc::driver::{sys, CudaEvent, CudaStream};
use std::collections::VecDeque;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::Arc;

/// How a peer's memory reaches this process.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ShareHandle {
    /// A VMM allocation; its fd is fetched from the owner's fd server under `export_id`.
    PosixFd {
        /// The owner's id for the exported fd.
        export_id: u64,
        /// Bytes of the whole allocation (a granularity multiple).
        alloc_bytes: u64,
        /// The owner's granularity, which the importer's reservation must respect.
        granularity: u64,
    },
    /// A `cudaMalloc`/cudarc allocation shared with a legacy CUDA IPC handle.
    CudaIpc {
        /// The opaque 64-byte handle of the allocation's base.
        handle: [u8; 64],
        /// Offset of the registered range from the allocation's base.
        offset: u64,
    },
}

/// A serializable description of registered memory: what a peer needs to map it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemoryDescriptor {
    /// The rank that owns the memory.
    pub owner_rank: u32,
    /// The owner's [`crate::gpu::memory::host_id`].
    pub host_id: u64,
    /// Registered bytes.
    pub bytes: u64,
    /// How to map it.
    pub handle: ShareHandle,
}

const DESCRIPTOR_MAGIC: &[u8; 4] = b"DBMD";
const DESCRIPTOR_VERSION: u16 = 1;

impl MemoryDescriptor {
    /// Encodes the descriptor (little endian, versioned).
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(112);
        v.extend_from_slice(DESCRIPTOR_MAGIC);
        v.extend_from_slice(&DESCRIPTOR_VERSION.to_le_bytes());
        v.extend_from_slice(&self.owner_rank.to_le_bytes());
        v.extend_from_slice(&self.host_id.to_le_bytes());
        v.extend_from_slice(&self.bytes.to_le_bytes());
        match &self.handle {
            ShareHandle::PosixFd {
                export_id,
                alloc_bytes,
                granularity,
            } => {
                v.push(1);
                v.extend_from_slice(&export_id.to_le_bytes());
                v.extend_from_slice(&alloc_bytes.to_le_bytes());
                v.extend_from_slice(&granularity.to_le_bytes());
            }
            ShareHandle::CudaIpc { handle, offset } => {
                v.push(2);
                v.extend_from_slice(handle);
                v.extend_from_slice(&offset.to_le_bytes());
            }
        }
        v
    }

    /// Decodes the descriptor rank `peer` sent rank `me`: what [`MemoryDescriptor::to_bytes`]
    /// wrote, of `peer`'s own memory; anything else is an error naming `peer`.
    pub fn from_peer(b: &[u8], me: usize, peer: usize) -> Result<Self> {
        let d = MemoryDescriptor::from_bytes(b).map_err(|e| Error::Bootstrap {
            me,
            rank: Some(peer),
            why: format!("sent a bad memory descriptor: {e}"),
        })?;
        if d.owner_rank as usize != peer {
            return Err(Error::Bootstrap {
                me,
                rank: Some(peer),
                why: format!("sent a descriptor of rank {}'s memory", d.owner_rank),
            });
        }
        Ok(d)
    }

    /// Decodes what [`MemoryDescriptor::to_bytes`] wrote; anything else is an error.
    pub fn from_bytes(b: &[u8]) -> Result<Self> {
        let bad = |why: &str| Error::invalid("memory descriptor", why.to_string());
        let mut r = Reader { b, at: 0 };
        if r.take(4).ok_or_else(|| bad("truncated"))? != DESCRIPTOR_MAGIC {
            return Err(bad("not a doorbell memory descriptor (bad magic)"));
        }
        let version = u16::from_le_bytes(r.array().ok_or_else(|| bad("truncated"))?);
        if version != DESCRIPTOR_VERSION {
            return Err(bad(&format!(
                "version {version}, this build reads {DESCRIPTOR_VERSION}: mixed doorbell versions in one job"
            )));
        }
        let owner_rank = r.u32().ok_or_else(|| bad("truncated"))?;
        let host_id = r.u64().ok_or_else(|| bad("truncated"))?;
        let bytes = r.u64().ok_or_else(|| bad("truncated"))?;
        let handle = match r.take(1).ok_or_else(|| bad("truncated"))?[0] {
            1 => ShareHandle::PosixFd {
                export_id: r.u64().ok_or_else(|| bad("truncated"))?,
                alloc_bytes: r.u64().ok_or_else(|| bad("truncated"))?,
                granularity: r.u64().ok_or_else(|| bad("truncated"))?,
            },
            2 => ShareHandle::CudaIpc {
                handle: r.array().ok_or_else(|| bad("truncated"))?,
                offset: r.u64().ok_or_else(|| bad("truncated"))?,
            },
            t => return Err(bad(&format!("unknown handle kind {t}"))),
        };
        if r.at != b.len() {
            return Err(bad("trailing bytes"));
        }
        if let ShareHandle::PosixFd {
            alloc_bytes,
            granularity,
            ..
        } = handle
        {
            if bytes > alloc_bytes || granularity == 0 || alloc_bytes % granularity != 0 {
                return Err(bad("inconsistent sizes"));
            }
        }
        Ok(MemoryDescriptor {
            owner_rank,
            host_id,
            bytes,
            handle,
        })
    }
}

struct Reader<'a> {
    b: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        let s = self.b.get(self.at..self.at.checked_add(n)?)?;
        self.at += n;
        Some(s)
    }
    fn array<const N: usize>(&mut self) -> Option<[u8; N]> {
        self.take(N)?.try_into().ok()
    }
    fn u32(&mut self) -> Option<u32> {
        self.array().map(u32::from_le_bytes)
    }
    fn u64(&mut self) -> Option<u64> {
        self.array().map(u64::from_le_bytes)
    }
}

enum RemoteKind {
    Vmm(#[allow(dead_code)] Mapping),
    LegacyIpc { base: u64 },
}

/// A peer's memory mapped into this process. Unmapped on drop.
pub struct RemoteMemory {
    gpu: Arc<Gpu>,
    kind: RemoteKind,
    ptr: u64,
    bytes: usize,
    owner_rank: u32,
}

impl std::fmt::Debug for RemoteMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteMemory")
            .field("owner_rank", &self.owner_rank)
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .field("bytes", &self.bytes)
            .finish()
    }
}

impl RemoteMemory {
    /// Maps the memory `desc` describes. `fd` must be the owner's exported fd for a
    /// [`ShareHandle::PosixFd`] descriptor (fetched by the caller) and `None` otherwise.
    pub fn import(gpu: &Arc<Gpu>, desc: &MemoryDescriptor, fd: Option<OwnedFd>) -> Result<Self> {
        gpu.bind()?;
        match (&desc.handle, fd) {
            (
                ShareHandle::PosixFd {
                    alloc_bytes,
                    granularity,
                    ..
                },
                Some(fd),
            ) => {
                let mut raw = 0;
                // SAFETY: for POSIX fds the "OS handle" argument is the fd value itself; the
                // driver dups what it needs, and `fd` is closed when it drops below.
                driver_result("cuMemImportFromShareableHandle", unsafe {
                    sys::cuMemImportFromShareableHandle(
                        &mut raw,
                        fd.as_raw_fd() as usize as *mut std::ffi::c_void,
                        sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                    )
                })?;
                let mapping = Mapping::map(
                    gpu,
                    PhysicalHandle(raw),
                    *alloc_bytes as usize,
                    *granularity as usize,
                )?;
                let ptr = mapping.ptr;
                Ok(RemoteMemory {
                    gpu: gpu.clone(),
                    kind: RemoteKind::Vmm(mapping),
                    ptr,
                    bytes: desc.bytes as usize,
                    owner_rank: desc.owner_rank,
                })
            }
            (ShareHandle::CudaIpc { handle, offset }, None) => {
                // SAFETY: CUipcMemHandle is 64 opaque bytes.
                let h: sys::CUipcMemHandle = unsafe { std::mem::transmute(*handle) };
                let mut base = 0;
                // SAFETY: opening a handle another process exported; `base` outlives the call.
                driver_result("cuIpcOpenMemHandle", unsafe {
                    sys::cuIpcOpenMemHandle_v2(
                        &mut base,
                        h,
                        sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
                    )
                })?;
                Ok(RemoteMemory {
                    gpu: gpu.clone(),
                    kind: RemoteKind::LegacyIpc { base },
                    ptr: base + offset,
                    bytes: desc.bytes as usize,
                    owner_rank: desc.owner_rank,
                })
            }
            _ => Err(Error::invalid(
                "fd",
                "a VMM descriptor needs the owner's fd, a CUDA IPC descriptor none",
            )),
        }
    }

    /// Device address of the first registered byte, in this process.
    pub fn device_ptr(&self) -> u64 {
        self.ptr
    }

    /// Registered bytes.
    pub fn len(&self) -> usize {
        self.bytes
    }

    /// True for a zero-byte registration.
    pub fn is_empty(&self) -> bool {
        self.bytes == 0
    }

    /// The rank that owns it.
    pub fn owner_rank(&self) -> u32 {
        self.owner_rank
    }
}

impl Drop for RemoteMemory {
    fn drop(&mut self) {
        let _ = self.gpu.bind();
        if let RemoteKind::LegacyIpc { base } = self.kind {
            // SAFETY: `base` came from cuIpcOpenMemHandle and is closed once.
            unsafe { sys::cuIpcCloseMemHandle(base) };
        }
        // A VMM mapping unmaps itself when `kind` drops.
    }
}

/// Legacy CUDA IPC export of memory the user allocated (cudarc `CudaSlice`, `cudaMalloc`): the
/// handle of the allocation containing `ptr` and `ptr`'s offset in it.
pub fn ipc_handle_for(gpu: &Gpu, ptr: u64, bytes: usize) -> Result<([u8; 64], u64)> {
    gpu.bind()?;
    let mut capable: libc::c_int = 0;
    // SAFETY: the attribute is an int; `capable` outlives the call.
    driver_result("cuPointerGetAttribute", unsafe {
        sys::cuPointerGetAttribute(
            &mut capable as *mut libc::c_int as *mut std::ffi::c_void,
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE,
            ptr,
        )
    })?;
    if capable == 0 {
        return Err(Error::invalid(
            "memory",
            format!(
                "{ptr:#x} cannot be shared with legacy CUDA IPC: it comes from a stream-ordered \
                 pool (cuMemAllocAsync, which cudarc uses for CudaSlice) or a VMM allocation; \
                 allocate shared buffers with Communicator::alloc, or with cuMemAlloc/cudaMalloc"
            ),
        ));
    }
    let (mut base, mut size) = (0u64, 0usize);
    // SAFETY: querying the allocation that contains `ptr`; outputs outlive the call.
    driver_result("cuMemGetAddressRange", unsafe {
        sys::cuMemGetAddressRange_v2(&mut base, &mut size, ptr)
    })?;
    let offset = ptr - base;
    if offset as usize + bytes > size {
        return Err(Error::invalid(
            "bytes",
            format!("{bytes} bytes at offset {offset} run past the allocation of {size} bytes"),
        ));
    }
    // SAFETY: CUipcMemHandle is plain data.
    let mut h: sys::CUipcMemHandle = unsafe { std::mem::zeroed() };
    // SAFETY: `base` is the start of a device allocation of this context.
    driver_result("cuIpcGetMemHandle", unsafe {
        sys::cuIpcGetMemHandle(&mut h, base)
    })
    .map_err(|e| match e {
        Error::Cuda { call, code } => Error::Cuda {
            call,
            code: format!(
                "{code} (legacy CUDA IPC works for cudaMalloc memory only; allocate with \
                 Communicator::alloc for VMM memory)"
            ),
        },
        other => other,
    })?;
    // SAFETY: CUipcMemHandle is 64 opaque bytes.
    Ok((
        unsafe { std::mem::transmute::<sys::CUipcMemHandle, [u8; 64]>(h) },
        offset,
    ))
}

/// The proxy's side of a CUDA IPC link: copy-engine transfers on a stream of its own into the
/// peer's memory mapped here. A write is a `cuMemcpyAsync` between device addresses; a signal
/// writes the semaphore's running count into the peer's inbound token, queued on the same stream
/// so it lands after the data; a flush records an event and is reported once the event has
/// completed (polled in [`Connection::progress`], so a slow stream never blocks the proxy).
pub(crate) struct CopyEngineConnection {
    gpu: Arc<Gpu>,
    stream: Arc<CudaStream>,
    flush_done: HostArray<u64>,
    /// Data or signals queued since the last flush.
    dirty: bool,
    /// Flushes waiting for their event: (position, event).
    pending: VecDeque<(u64, CudaEvent)>,
    spare_events: Vec<CudaEvent>,
}

impl CopyEngineConnection {
    /// A connection whose copies run on `gpu`'s copy engines.
    pub(crate) fn new(gpu: &Arc<Gpu>) -> Result<CopyEngineConnection> {
        crate::gpu::cuda::note_host_cuda_calls(
            "the proxy's copy-engine transfers between GPUs of one host",
        );
        Ok(CopyEngineConnection {
            gpu: gpu.clone(),
            stream: gpu.new_stream()?,
            flush_done: HostArray::new(gpu, 1)?,
            dirty: false,
            pending: VecDeque::new(),
            spare_events: Vec::new(),
        })
    }
}

impl Connection for CopyEngineConnection {
    fn write(&mut self, src: Address, dst: Address, bytes: u64) -> Result<()> {
        if bytes == 0 {
            return Ok(());
        }
        // SAFETY: the proxy checked both ranges against memory registered in this context.
        unsafe { crate::gpu::cuda::copy_async(&self.stream, dst.addr, src.addr, bytes as usize) }?;
        self.dirty = true;
        Ok(())
    }

    fn signal(&mut self, token: Token) -> Result<()> {
        // SAFETY: the token is the peer's inbound token mapped in this context; the write is
        // queued after this connection's copies.
        unsafe {
            crate::gpu::cuda::write_u64_after_async(&self.stream, token.at.addr, token.count)
        }?;
        self.dirty = true;
        Ok(())
    }

    fn flush(&mut self, pos: u64) -> Result<()> {
        if !self.dirty && self.pending.is_empty() {
            self.flush_done.write(0, pos + 1);
            return Ok(());
        }
        let ev = match self.spare_events.pop() {
            Some(e) => e,
            None => self
                .gpu
                .context()
                .new_event(None)
                .map_err(cuda_err("cuEventCreate"))?,
        };
        ev.record(&self.stream).map_err(cuda_err("cuEventRecord"))?;
        self.pending.push_back((pos, ev));
        self.dirty = false;
        Ok(())
    }

    fn progress(&mut self) -> Result<bool> {
        let mut any = false;
        while let Some((pos, ev)) = self.pending.front() {
            if !ev.try_is_complete().map_err(cuda_err("cuEventQuery"))? {
                break;
            }
            self.flush_done.write(0, pos + 1);
            if let Some((_, ev)) = self.pending.pop_front() {
                self.spare_events.push(ev);
            }
            any = true;
        }
        Ok(any)
    }

    fn flush_word(&self) -> u64 {
        self.flush_done.device_ptr()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_peer_may_describe_only_its_own_memory() {
        let d = MemoryDescriptor {
            owner_rank: 2,
            host_id: 7,
            bytes: 4096,
            handle: ShareHandle::PosixFd {
                export_id: 1,
                alloc_bytes: 2 << 20,
                granularity: 2 << 20,
            },
        };
        let b = d.to_bytes();
        assert_eq!(MemoryDescriptor::from_peer(&b, 0, 2).unwrap(), d);
        let e = MemoryDescriptor::from_peer(&b, 0, 1)
            .unwrap_err()
            .to_string();
        assert!(e.contains("rank 2's memory"), "{e}");
        let e = MemoryDescriptor::from_peer(&b[..5], 0, 2)
            .unwrap_err()
            .to_string();
        assert!(e.contains("bad memory descriptor"), "{e}");
    }

    #[test]
    fn descriptors_round_trip() {
        let mut handle = [0u8; 64];
        handle
            .iter_mut()
            .enumerate()
            .for_each(|(i, b)| *b = i as u8);
        for d in [
            MemoryDescriptor {
                owner_rank: 3,
                host_id: 0xdead_beef_0123,
                bytes: 5 << 20,
                handle: ShareHandle::PosixFd {
                    export_id: 42,
                    alloc_bytes: 6 << 20,
                    granularity: 2 << 20,
                },
            },
            MemoryDescriptor {
                owner_rank: 0,
                host_id: 1,
                bytes: 17,
                handle: ShareHandle::CudaIpc {
                    handle,
                    offset: 4096,
                },
            },
        ] {
            let b = d.to_bytes();
            assert_eq!(MemoryDescriptor::from_bytes(&b).unwrap(), d);
            // Every truncation is an error, never a panic.
            for n in 0..b.len() {
                assert!(MemoryDescriptor::from_bytes(&b[..n]).is_err(), "prefix {n}");
            }
            let mut long = b.clone();
            long.push(0);
            assert!(MemoryDescriptor::from_bytes(&long).is_err());
        }
    }

    #[test]
    fn descriptors_reject_garbage() {
        let d = MemoryDescriptor {
            owner_rank: 1,
            host_id: 2,
            bytes: 4 << 20,
            handle: ShareHandle::PosixFd {
                export_id: 1,
                alloc_bytes: 4 << 20,
                granularity: 2 << 20,
            },
        };
        let good = d.to_bytes();
        let mut b = good.clone();
        b[0] = b'X';
        assert!(MemoryDescriptor::from_bytes(&b)
            .unwrap_err()
            .to_string()
            .contains("magic"));
        let mut b = good.clone();
        b[4] = 9;
        assert!(MemoryDescriptor::from_bytes(&b)
            .unwrap_err()
            .to_string()
            .contains("version"));
        let mut b = good.clone();
        b[26] = 7;
        assert!(MemoryDescriptor::from_bytes(&b)
            .unwrap_err()
            .to_string()
            .contains("kind"));
        // More registered bytes than the allocation holds.
        let mut bad = d.clone();
        bad.bytes = 8 << 20;
        assert!(MemoryDescriptor::from_bytes(&bad.to_bytes()).is_err());
    }
}
