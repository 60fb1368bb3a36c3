//! Mirrors of `channel/fifo.cuh`: the device-to-host trigger FIFO (see the module above for the layout test).

use super::WaitSite;
use bytemuck::{Pod, Zeroable};

/// One trigger of the device-to-host FIFO (`channel/fifo.cuh`). `meta` packs type, semaphore id, memory
/// ids and the commit parity bit; see [`ProxyTrigger::unpack`].
#[repr(C, align(32))]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct ProxyTrigger {
    /// Offset in the source memory.
    pub src_offset: u64,
    /// Offset in the destination memory (low 63 bits; bit 63 repeats the commit parity).
    pub dst_offset: u64,
    /// Bytes.
    pub size: u64,
    /// Packed fields and commit bit.
    pub meta: u64,
}

/// Trigger type bits (`TriggerType`).
pub mod trigger {
    /// Copy data.
    pub const DATA: u32 = 1;
    /// Signal the peer after the data.
    pub const FLAG: u32 = 2;
    /// Report completion at this position.
    pub const FLUSH: u32 = 4;
}

/// The fields of a trigger's `meta` word.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TriggerMeta {
    /// [`trigger`] bits.
    pub kind: u32,
    /// Proxy semaphore id.
    pub semaphore: u32,
    /// Proxy memory id of the source.
    pub src_mem: u32,
    /// Proxy memory id of the destination.
    pub dst_mem: u32,
    /// Commit parity bit.
    pub parity: u32,
}

impl ProxyTrigger {
    /// Largest semaphore id a trigger can carry.
    pub const MAX_SEMAPHORE: u32 = (1 << 16) - 1;
    /// Largest memory id a trigger can carry.
    pub const MAX_MEMORY: u32 = (1 << 15) - 1;

    /// Decodes `meta` (bit layout in `channel/fifo.cuh`).
    pub fn unpack(meta: u64) -> TriggerMeta {
        TriggerMeta {
            kind: (meta & 7) as u32,
            semaphore: ((meta >> 3) & 0xFFFF) as u32,
            src_mem: ((meta >> 19) & 0x7FFF) as u32,
            dst_mem: ((meta >> 34) & 0x7FFF) as u32,
            parity: (meta >> 63) as u32,
        }
    }

    /// Encodes `meta` the way the device does.
    pub fn pack(m: TriggerMeta) -> u64 {
        (m.kind as u64 & 7)
            | ((m.semaphore as u64 & 0xFFFF) << 3)
            | ((m.src_mem as u64 & 0x7FFF) << 19)
            | ((m.dst_mem as u64 & 0x7FFF) << 34)
            | ((m.parity as u64 & 1) << 63)
    }
}

/// The device side of a proxy's FIFO (`channel/fifo.cuh`).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct FifoHandle {
    /// Host-pinned trigger ring (device address).
    pub triggers: u64,
    /// Claimed positions (device memory).
    pub head: u64,
    /// Consumed positions (host-pinned, device address).
    pub tail: u64,
    /// Pushers' cached tail (device memory).
    pub tail_cache: u64,
    /// Nonzero once the proxy stopped (host-pinned, device address).
    pub stopped: u64,
    /// log2 of the ring size.
    pub size_log2: u32,
    /// Zero.
    pub reserved: u32,
    /// Who waits (pushers on a full ring, flushes).
    pub site: WaitSite,
}
