//! Mirrors of `ib/ibgda.cuh`: a queue pair the GPU posts to (see the module above for the layout test).

use super::WaitSite;
use bytemuck::{Pod, Zeroable};

/// A queue pair the GPU posts to (`ib/ibgda.cuh`).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct IbQpHandle {
    /// Send queue ring (device address).
    pub sq: u64,
    /// Send doorbell record (device address).
    pub dbr: u64,
    /// Doorbell register, or the emulated NIC's doorbell word (device address).
    pub doorbell: u64,
    /// Completion queue (device address).
    pub cq: u64,
    /// The CQ's consumer index record (device address).
    pub cq_ci: u64,
    /// Posting state, 8 words of device memory.
    pub state: u64,
    /// WQEBBs of the WQE starting at each send-queue slot (device memory).
    pub sizes: u64,
    /// CPU-assisted posting: where the GPU publishes the ready index (host-pinned); 0 for IBGDA.
    pub host_ready: u64,
    /// Queue pair number.
    pub qpn: u32,
    /// log2 of the send queue's WQEBBs.
    pub sq_log2: u32,
    /// log2 of the CQ's entries.
    pub cq_log2: u32,
    /// [`IbQpHandle::RINGS_IN_GPU`] when the send queue and its record are GPU memory (then a
    /// GPU-scope fence orders a batch's WQEs before it is published; host-memory rings take a
    /// system-scope one), else zero.
    pub flags: u32,
    /// Who waits (posters on a full queue, quiet).
    pub site: WaitSite,
}

impl IbQpHandle {
    /// `flags` bit: the send queue and doorbell record are GPU memory (`kRingsInGpu`).
    pub const RINGS_IN_GPU: u32 = 1;
}

// SAFETY: plain-old-data structs with no padding-dependent invariants; the driver copies them
// byte for byte as kernel arguments.
unsafe impl cudarc::driver::DeviceRepr for IbQpHandle {}
