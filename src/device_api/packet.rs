//! Mirrors of `core/packet.cuh`: LL packets (see the module above for the layout test).

use bytemuck::{Pod, Zeroable};

/// An LL16 packet: 8 payload bytes and two copies of the flag.
#[repr(C, align(16))]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct Ll16Packet {
    /// Payload bytes 0..4.
    pub data1: u32,
    /// Flag.
    pub flag1: u32,
    /// Payload bytes 4..8.
    pub data2: u32,
    /// Flag again.
    pub flag2: u32,
}

/// An LL8 packet: 4 payload bytes and a flag.
#[repr(C, align(8))]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct Ll8Packet {
    /// Payload.
    pub data: u32,
    /// Flag.
    pub flag: u32,
}

/// Payload bytes an LL packet type carries.
pub trait LlPacket: Pod {
    /// Payload bytes per packet.
    const PAYLOAD: usize;
    /// Packets needed for `bytes` of payload.
    fn packets_for(bytes: usize) -> usize {
        bytes.div_ceil(Self::PAYLOAD)
    }
}

impl LlPacket for Ll16Packet {
    const PAYLOAD: usize = 8;
}

impl LlPacket for Ll8Packet {
    const PAYLOAD: usize = 4;
}
