//! Mirrors of `detail/collective_args.cuh`: launch arguments of doorbell's own kernels (see the module above for the layout test).

use super::{CallCheck, WaitSite, MAX_RANKS};
use bytemuck::{Pod, Zeroable};

/// Launch arguments of the allreduce kernels (`detail/collective_args.cuh`).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct AllReduceArgs {
    /// My input.
    pub input: u64,
    /// My output (may equal `input`).
    pub output: u64,
    /// Elements.
    pub count: u64,
    /// Every rank's scratch as mapped here (own at `rank`; unused entries 0).
    pub scratch: [u64; MAX_RANKS],
    /// Pipeline "reduce-scatter part arrived" semaphores, `[lane * world + peer]`.
    pub rs_sems: u64,
    /// Pipeline "reduced shard arrived" semaphores, `[lane * world + peer]`.
    pub ag_sems: u64,
    /// LL epochs, one per block of the fixed LL grid.
    pub epochs: u64,
    /// LL region offset.
    pub ll_offset: u64,
    /// Bytes of one LL half.
    pub ll_half_bytes: u64,
    /// Bytes of one sender's LL slot.
    pub ll_slot_bytes: u64,
    /// Pipeline region offset.
    pub pipe_offset: u64,
    /// Pipeline bytes per lane.
    pub pipe_lane_bytes: u64,
    /// Pipeline elements per shard of a tile.
    pub tile_elems: u64,
    /// Sentinel two-shot region offset.
    pub lamport_offset: u64,
    /// Bytes of one of its three buffers.
    pub lamport_buf_bytes: u64,
    /// Bytes of one sender's slot in a buffer's RS or AG area.
    pub lamport_slot_bytes: u64,
    /// Per-block [`LamportState`] array (device).
    pub lamport_state: u64,
    /// My rank.
    pub rank: u32,
    /// Ranks.
    pub world: u32,
    /// Wait site for LL waits.
    pub site: WaitSite,
    /// The call check.
    pub call: CallCheck,
}

/// Launch arguments of the two-shot on registered windows (`detail/collective_args.cuh`).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct AllReduceDirectArgs {
    /// The common arguments.
    pub base: AllReduceArgs,
    /// Every rank's input as mapped here (own at `rank`; unused entries 0).
    pub peer_input: [u64; MAX_RANKS],
    /// Every rank's output as mapped here.
    pub peer_output: [u64; MAX_RANKS],
}

/// Launch arguments of the all-to-all kernel (`detail/collective_args.cuh`).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct AllToAllArgs {
    /// My input.
    pub input: u64,
    /// My output.
    pub output: u64,
    /// Device array `[4][world]` of bytes (send counts, send offsets, recv counts, recv
    /// offsets), or 0 for equal blocks.
    pub counts: u64,
    /// Bytes of every block when `counts` is 0.
    pub equal_bytes: u64,
    /// Every rank's scratch as mapped here (own at `rank`).
    pub scratch: [u64; MAX_RANKS],
    /// "A tile arrived" semaphores, `[lane * world + peer]`.
    pub data: u64,
    /// "A slot is free again" semaphores, `[lane * world + peer]`.
    pub credit: u64,
    /// Bytes per tile.
    pub tile: u64,
    /// My rank.
    pub rank: u32,
    /// Ranks.
    pub world: u32,
    /// Blocks per peer.
    pub lanes: u32,
    /// Slots per (source, lane) ring.
    pub depth: u32,
    /// Threads of a tile block that send (the rest receive).
    pub send_threads: u32,
    /// Zero.
    pub reserved: u32,
    /// Offset of the LL16 area (`[2 halves][source][ll_slot_bytes]`) in every scratch.
    pub ll_offset: u64,
    /// Bytes of packets per source and half.
    pub ll_slot_bytes: u64,
    /// Per-block epochs of the LL grid (device).
    pub epochs: u64,
    /// The call check.
    pub call: CallCheck,
    /// alltoallv: bytes of `input` (device counts naming a range outside it are refused).
    pub input_bytes: u64,
    /// alltoallv: bytes of `output`.
    pub output_bytes: u64,
    /// alltoallv: a pair's block of at most this many bytes goes as LL16 packets (0: never).
    pub pair_ll_max: u64,
    /// alltoallv: epochs of those packets, `[2 (send, receive)][world][lanes]` u32 (device).
    pub pair_epochs: u64,
}

/// Launch arguments of the MoE dispatch/combine kernels (`detail/collective_args.cuh`; field meanings
/// there). Device addresses as u64.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Pod, Zeroable)]
#[allow(missing_docs)]
pub struct MoeArgs {
    pub x: u64,
    pub scales: u64,
    pub topk_idx: u64,
    pub topk_weights: u64,
    pub y: u64,
    pub out: u64,
    pub num_tokens: u32,
    pub hidden: u32,
    pub topk: u32,
    pub experts_per_rank: u32,
    pub max_tokens: u32,
    pub rank: u32,
    pub world: u32,
    pub blocks: u32,
    pub land: [u64; MAX_RANKS],
    pub comb_buf: [u64; MAX_RANKS],
    pub off_idx: u64,
    pub off_weights: u64,
    pub off_src: u64,
    pub off_matrix: u64,
    pub off_scales: u64,
    pub pos: u64,
    pub num_recv: u64,
    pub expert_counts: u64,
    pub calls: u64,
    pub sems: u64,
    pub rank_prefix: u64,
    pub y_weights: u64,
    pub out_weights: u64,
    pub off_comb_weights: u64,
    pub in_rank: u64,
    pub tokens_per_expert: u64,
    pub off_expert_in: u64,
    pub off_slots: u64,
    pub slot_bytes: u64,
    pub slot: u32,
    pub fill_rows: u32,
    /// The call check.
    pub call: CallCheck,
}

/// The high-throughput node-spanning MoE kernels' own arguments (`detail/collective_args.cuh`).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Pod, Zeroable)]
#[allow(missing_docs)]
pub struct MoeHtArgs {
    pub nodes: u32,
    pub node: u32,
    pub rail: u64,
    pub node_of: u64,
    pub local_of: u64,
    pub fwd_x: u64,
    pub fwd_scales: u64,
    pub fwd_idx: u64,
    pub fwd_w: u64,
    pub fwd_origin: u64,
    pub fwd_out: u64,
    pub net_rows: u64,
    pub node_src: u64,
    pub node_num_recv: u64,
    pub origin_of: u64,
    pub recv_src: u64,
    pub chunks: u32,
    /// Combine: 1 when the rows' top-k weights travel (`w_out` given).
    pub weights: u32,
    pub off_ring: u64,
    pub off_desc: u64,
    pub stage_desc: u64,
    pub credits: u64,
    pub sent_chunks: u64,
    pub recv_chunks: u64,
    pub list: u64,
    pub node_counts: u64,
    pub node_rows: u64,
    pub node_max_rows: u64,
    /// `[nodes * max_tokens][topk]` f32: the node's combine of each slot's top-k weights.
    pub fwd_wout: u64,
    /// This combine's `[num_tokens][topk]` f32 output (DeepEP's `combined_topk_weights`).
    pub w_out: u64,
    /// Area offset of the partial weights, `[world * max_tokens][topk]` f32.
    pub off_part_w: u64,
    /// Staging offset of the same, for network peers.
    pub stage_part_w: u64,
    /// A dispatch by ranks: this dispatch's `[num_tokens][world]` bool.
    pub in_rank: u64,
    /// `[nodes * max_tokens][ranks of a node]` bool: the forwarding slots' routing.
    pub fwd_in_rank: u64,
    /// This rank's `[num_experts]` i32 rows per expert, or 0.
    pub tokens_per_expert: u64,
    /// `[experts of a node]` i32: this rank's and its rail peers' counts of the node's experts.
    pub fwd_tpe: u64,
    /// `[max_tokens]` u64: the nodes each token of the last dispatch went to (bit per node).
    pub tok_nodes: u64,
    /// Bytes of a chunk descriptor slot: [`HtChunkDesc`], then `[experts of a node]` i32.
    pub desc_bytes: u32,
    /// 1: this dispatch routes by ranks.
    pub by_rank: u32,
}

/// What a chunk of the high-throughput network stream holds (`detail/collective_args.cuh`), written
/// behind its messages.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct HtChunkDesc {
    /// The dispatch it belongs to.
    pub epoch: u64,
    /// Messages in the chunk (0..=32).
    pub messages: u32,
    /// 1: the source's last chunk of this dispatch.
    pub last: u32,
}

/// Per-block state of the sentinel two-shot (`detail/collective_args.cuh`).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct LamportState {
    /// Calls so far, modulo 3.
    pub call: u32,
    /// Zero.
    pub reserved: u32,
    /// Elements of the previous call.
    pub prev_count: u64,
}

// SAFETY: plain-old-data structs with no padding-dependent invariants; the driver copies them
// byte for byte as kernel arguments.
unsafe impl cudarc::driver::DeviceRepr for AllReduceArgs {}
// SAFETY: as above.
unsafe impl cudarc::driver::DeviceRepr for AllReduceDirectArgs {}
// SAFETY: as above.
unsafe impl cudarc::driver::DeviceRepr for AllToAllArgs {}
// SAFETY: as above.
unsafe impl cudarc::driver::DeviceRepr for MoeArgs {}
// SAFETY: as above.
unsafe impl cudarc::driver::DeviceRepr for MoeHtArgs {}
