//! Mirrors of `channel/memory_channel.cuh`: a MemoryChannel to one peer (see the module above for the layout test).

use super::SemaphoreHandle;
use bytemuck::{Pod, Zeroable};

/// A MemoryChannel to one peer (`channel/memory_channel.cuh`).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct MemoryChannelHandle {
    /// The signal/wait pair with the peer.
    pub semaphore: SemaphoreHandle,
    /// The peer's buffer, mapped (puts land here).
    pub dst: u64,
    /// My buffer (puts read here, gets land here).
    pub src: u64,
    /// My packet area buffer.
    pub packet_buffer: u64,
    /// The peer's packet area buffer, mapped.
    pub remote_packet_buffer: u64,
    /// Bytes of `dst`.
    pub dst_bytes: u64,
    /// Bytes of `src`.
    pub src_bytes: u64,
    /// Bytes of each packet buffer.
    pub packet_buffer_bytes: u64,
}

// SAFETY: plain-old-data structs with no padding-dependent invariants; the driver copies them
// byte for byte as kernel arguments.
unsafe impl cudarc::driver::DeviceRepr for MemoryChannelHandle {}
