//! Mirrors of `channel/port_channel.cuh`: a PortChannel to one peer (see the module above for the layout test).

use super::{FifoHandle, IbQpHandle};
use bytemuck::{Pod, Zeroable};

/// A PortChannel to one peer (`channel/port_channel.cuh`).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct PortChannelHandle {
    /// The proxy's FIFO.
    pub fifo: FifoHandle,
    /// My inbound token (device memory); the peer's proxy writes it.
    pub inbound_token: u64,
    /// Signals consumed (device memory, private).
    pub expected_inbound: u64,
    /// Completed positions (host-pinned, device address).
    pub flush_done: u64,
    /// Proxy semaphore id.
    pub semaphore: u32,
    /// Proxy memory id of the peer's buffer.
    pub dst_mem: u32,
    /// Proxy memory id of my buffer.
    pub src_mem: u32,
    /// Zero.
    pub reserved: u32,
    /// Device address of an [`IbPortLink`] when kernels post RDMA work themselves; 0 otherwise.
    pub ib: u64,
}

/// A PortChannel's RDMA link for kernels that post their own work requests (`channel/port_channel.cuh`).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct IbPortLink {
    /// The queue pair.
    pub qp: IbQpHandle,
    /// My source memory's first byte.
    pub src: u64,
    /// The peer's destination's first byte, at the peer's address.
    pub dst: u64,
    /// The peer's inbound token for me, at the peer's address.
    pub token: u64,
    /// 16 bytes of my device memory the NIC writes.
    pub scratch: u64,
    /// Key of `src`.
    pub src_key: u32,
    /// Key of `dst` (the peer's).
    pub dst_key: u32,
    /// Key of the peer's token memory.
    pub token_key: u32,
    /// Key of `scratch`.
    pub scratch_key: u32,
    /// Queue pairs a put is striped over: `qp` and the first `stripes - 1` of `more`.
    pub stripes: u32,
    /// Unused.
    pub reserved: u32,
    /// The other queue pairs to the same peer.
    pub more: [IbQpHandle; 3],
}

// SAFETY: plain-old-data structs with no padding-dependent invariants; the driver copies them
// byte for byte as kernel arguments.
unsafe impl cudarc::driver::DeviceRepr for PortChannelHandle {}
