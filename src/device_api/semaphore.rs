//! Mirrors of `channel/semaphore.cuh`: a device-to-device semaphore (see the module above for the layout test).

use super::WaitSite;
use bytemuck::{Pod, Zeroable};

/// A device-to-device semaphore between two ranks (`channel/semaphore.cuh`).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct SemaphoreHandle {
    /// My inbound token (device memory); the peer adds to it.
    pub inbound_token: u64,
    /// My private count of consumed signals (device memory).
    pub expected_inbound: u64,
    /// The peer's inbound token for me, mapped into my address space.
    pub remote_inbound_token: u64,
    /// Who waits on this semaphore.
    pub site: WaitSite,
}

// SAFETY: plain-old-data structs with no padding-dependent invariants; the driver copies them
// byte for byte as kernel arguments.
unsafe impl cudarc::driver::DeviceRepr for SemaphoreHandle {}
