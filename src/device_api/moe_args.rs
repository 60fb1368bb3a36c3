//! Mirrors of `coll/moe_args.cuh`: the arguments of the two low-latency MoE exchanges, which
//! doorbell's MoE kernels and fused kernels of the user's both take (see the module above for the
//! layout test).

use super::{CallCheck, MAX_RANKS};
use bytemuck::{Pod, Zeroable};

/// Launch arguments of the low-latency MoE kernels (`coll/moe_args.cuh`; field meanings there).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Pod, Zeroable)]
#[allow(missing_docs)]
pub struct MoeLlArgs {
    pub x: u64,
    pub topk_idx: u64,
    pub topk_weights: u64,
    pub out: u64,
    pub num_tokens: u32,
    pub hidden: u32,
    pub topk: u32,
    pub experts_per_rank: u32,
    pub max_tokens: u32,
    pub rank: u32,
    pub world: u32,
    pub blocks: u32,
    pub area: [u64; MAX_RANKS],
    pub off_src: u64,
    pub off_counts: u64,
    pub off_from: u64,
    pub off_weight: u64,
    pub off_rec: u64,
    pub off_part: u64,
    pub off_queue: u64,
    pub off_sent: u64,
    pub y: u64,
    pub fill: u64,
    pub done: u64,
    pub epochs: u64,
    pub layout: u64,
    pub recv_count: u64,
    pub ready: u64,
    /// The call check.
    pub call: CallCheck,
    pub packed_x: u64,
    pub packed_scales: u64,
    pub packed_src: u64,
    pub packed_range: u64,
    pub packed_count: u64,
    pub packed_stats: u64,
    pub off_ret: u64,
    pub packed: u32,
    pub packed_pad: u32,
    pub ticket: u64,
    pub rank_mask: u64,
    pub wait_cycles: u64,
}

/// `MoeLlArgs::packed` bits (`coll/moe_args.cuh`): DeepEP's low-latency layout; e4m3 rows;
/// scales rounded up to powers of two; scales as exponent bytes.
pub mod packed {
    /// DeepEP's layout.
    pub const PACKED: u32 = 1;
    /// e4m3 rows, one scale per 128 values.
    pub const FP8: u32 = 2;
    /// Scales rounded up to powers of two.
    pub const ROUND: u32 = 4;
    /// Scales stored as their exponent bytes, four per i32.
    pub const UE8M0: u32 = 8;
    /// `topk_idx` holds int64 ids.
    pub const IDS64: u32 = 16;
    /// A packed combine's rows go back as 10-bit log rows (one node).
    pub const LOGFMT: u32 = 32;
}

/// Launch arguments of the node-spanning MoE kernels (`coll/moe_args.cuh`, `coll/moe_net.cuh`; field
/// meanings there). Fused-dispatch kernels receive it from `MoeLowLatency::begin_fused_send`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Pod, Zeroable)]
#[allow(missing_docs)]
pub struct MoeNetArgs {
    pub x: u64,
    pub scales: u64,
    pub topk_idx: u64,
    pub topk_weights: u64,
    pub out: u64,
    pub num_tokens: u32,
    pub fp8: u32,
    pub hidden: u32,
    pub topk: u32,
    pub experts_per_rank: u32,
    pub max_tokens: u32,
    pub rank: u32,
    pub world: u32,
    pub msg_bytes: u32,
    pub header_bytes: u32,
    pub area: u64,
    pub peer_area: u64,
    pub channels: u64,
    pub sites: u64,
    pub stage: u64,
    pub off_counts: u64,
    pub off_part: u64,
    pub off_cdone: u64,
    pub stage_counts: u64,
    pub stage_part: u64,
    pub y: u64,
    pub recv_x: u64,
    pub recv_src: u64,
    pub recv_weights: u64,
    pub recv_scales: u64,
    pub rec: u64,
    pub msgs: u64,
    pub fill: u64,
    pub done: u64,
    pub epochs: u64,
    pub layout: u64,
    pub recv_count: u64,
    pub list: u64,
    pub probe: u64,
    pub arrived: u64,
    pub staged: u64,
    pub call_word: u64,
    pub off_inbox: u64,
    pub stage_words: u64,
    pub packed_x: u64,
    pub packed_scales: u64,
    pub packed_src: u64,
    pub packed_range: u64,
    pub packed_count: u64,
    pub packed_stats: u64,
    pub ticket: u64,
    pub in_x: u64,
    pub in_ids: u64,
    pub packed: u32,
    pub back: u32,
}

// SAFETY: plain-old-data structs with no padding-dependent invariants; the driver copies them
// byte for byte as kernel arguments.
unsafe impl cudarc::driver::DeviceRepr for MoeLlArgs {}
// SAFETY: as above.
unsafe impl cudarc::driver::DeviceRepr for MoeNetArgs {}
