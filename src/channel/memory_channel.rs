//! MemoryChannels: kernels load from and store into a peer's memory mapped here (same host,
//! NVLink or PCIe), and signal through semaphores. Also the memory registered with the
//! communicator that channels point into.

use crate::channel::semaphore::TokenPool;
use crate::device_api::MemoryChannelHandle;
use crate::gpu::fd_passing::FdServer;
use crate::gpu::memory::Buffer;
use crate::transport::ipc::{MemoryDescriptor, RemoteMemory, ShareHandle};
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

/// A MemoryChannel to one peer: the device handle and the mappings it points into.
pub struct MemoryChannel {
    pub(crate) peer: usize,
    pub(crate) handle: MemoryChannelHandle,
    pub(crate) _src: Arc<RegisteredMemory>,
    pub(crate) _dst: Arc<RemoteMemory>,
    pub(crate) _packets: Option<(Arc<RegisteredMemory>, Arc<RemoteMemory>)>,
    pub(crate) _tokens: Arc<TokenPool>,
}

impl MemoryChannel {
    /// The peer's rank.
    pub fn peer(&self) -> usize {
        self.peer
    }
    /// The handle kernels take (by value or in a device array).
    pub fn device_handle(&self) -> MemoryChannelHandle {
        self.handle
    }
}

/// One MemoryChannel per peer, in rank order (this rank skipped).
pub struct MemoryChannels {
    pub(crate) channels: Vec<MemoryChannel>,
}

impl MemoryChannels {
    /// The channels, in peer order.
    pub fn iter(&self) -> impl Iterator<Item = &MemoryChannel> {
        self.channels.iter()
    }
    /// The channel to `peer`.
    pub fn to(&self, peer: usize) -> Option<&MemoryChannel> {
        self.channels.iter().find(|c| c.peer == peer)
    }
    /// The device handles, in peer order.
    pub fn handles(&self) -> Vec<MemoryChannelHandle> {
        self.channels.iter().map(|c| c.handle).collect()
    }
    /// Number of channels (peers).
    pub fn len(&self) -> usize {
        self.channels.len()
    }
    /// True with no peers (a job of one rank).
    pub fn is_empty(&self) -> bool {
        self.channels.is_empty()
    }
}
