//! Mirrors of `core/wait.cuh`: where a device wait that gives up reports, and how it waits (see the module above for the layout test).

use bytemuck::{Pod, Zeroable};

/// Where a device wait that gives up writes who waited for what (`core/wait.cuh`). Lives in host-mapped
/// pinned memory; the host trusts the other fields only once `valid` is 1.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct WaitReport {
    /// 1 once every other field is written.
    pub valid: u32,
    /// `WaitKindCode` (see [`crate::WaitKind::from_code`]).
    pub what: u32,
    /// The waiting rank.
    pub rank: i32,
    /// The rank it waited for, or -1.
    pub peer: i32,
    /// Channel or semaphore id.
    pub channel: u32,
    /// Linear block index of the waiter.
    pub block: u32,
    /// Linear thread index of the waiter in its block.
    pub thread: u32,
    /// Zero.
    pub reserved: u32,
    /// The value it waited for.
    pub expected: u64,
    /// The last value it saw.
    pub seen: u64,
    /// Nanoseconds it waited.
    pub waited_ns: u64,
    /// Nonzero once the communicator aborted: every device wait leaves.
    pub abort: u32,
    /// The first peer found making another collective call.
    pub mismatch_peer: i32,
    /// This rank's call word.
    pub mismatch_mine: u64,
    /// That peer's call word.
    pub mismatch_theirs: u64,
    /// 1 once the mismatch fields are written.
    pub mismatch_valid: u32,
    /// 1: the call words agree, the pair's byte counts below do not (alltoallv).
    pub mismatch_counts: u32,
    /// Bytes this rank sends that peer.
    pub mismatch_mine_send: u64,
    /// Bytes this rank expects from that peer.
    pub mismatch_mine_recv: u64,
    /// Bytes that peer sends this rank.
    pub mismatch_theirs_send: u64,
    /// Bytes that peer expects from this rank.
    pub mismatch_theirs_recv: u64,
    /// Bit p: peer p died and this communicator tolerates it (set by the host's watchdog).
    pub dead_peers: u64,
}

/// `WaitSite::reserved` bit (`kSiteTolerant` in `core/wait.cuh`): a wait whose caller leaves its peer
/// out when that peer died (MoE low latency with a rank mask) instead of failing the communicator.
pub const SITE_TOLERANT: u32 = 1;

/// Who is waiting, copied into every handle that can wait.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct WaitSite {
    /// Device address of the process's [`WaitReport`] (host-mapped).
    pub report: u64,
    /// Device address of the process's claim word (device memory).
    pub claim: u64,
    /// Budget of one wait, nanoseconds.
    pub budget_ns: u64,
    /// The waiting rank.
    pub rank: i32,
    /// The rank waited for, or -1.
    pub peer: i32,
    /// Channel or semaphore id.
    pub channel: u32,
    /// [`SITE_TOLERANT`] or zero.
    pub reserved: u32,
}

// SAFETY: plain-old-data structs with no padding-dependent invariants; the driver copies them
// byte for byte as kernel arguments.
unsafe impl cudarc::driver::DeviceRepr for WaitSite {}
