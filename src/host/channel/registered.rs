//! Memory registered with the communicator, which channels point into: a descriptor peers can
//! map, and what keeps the memory alive (and its exported fd served) while it is registered.

use crate::gpu::fd_passing::FdServer;
use crate::gpu::memory::Buffer;
use crate::transport::ipc::{MemoryDescriptor, ShareHandle};
use std::sync::Arc;

/// Memory registered with the communicator: a descriptor peers can map, and what keeps the
/// memory alive while it is registered.
pub struct RegisteredMemory {
    pub(crate) descriptor: MemoryDescriptor,
    pub(crate) ptr: u64,
    pub(crate) bytes: usize,
    pub(crate) _buffer: Option<Arc<Buffer>>,
    pub(crate) server: Arc<FdServer>,
}

impl std::fmt::Debug for RegisteredMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RegisteredMemory")
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .field("bytes", &self.bytes)
            .field("descriptor", &self.descriptor)
            .finish()
    }
}

impl RegisteredMemory {
    /// What a peer needs to map this memory.
    pub fn descriptor(&self) -> &MemoryDescriptor {
        &self.descriptor
    }
    /// Device address in this process.
    pub fn device_ptr(&self) -> u64 {
        self.ptr
    }
    /// Registered bytes.
    pub fn len(&self) -> usize {
        self.bytes
    }
    /// True for an empty registration (never produced by the communicator).
    pub fn is_empty(&self) -> bool {
        self.bytes == 0
    }
}

impl Drop for RegisteredMemory {
    fn drop(&mut self) {
        if let ShareHandle::PosixFd { export_id, .. } = self.descriptor.handle {
            self.server.withdraw(export_id);
        }
    }
}
