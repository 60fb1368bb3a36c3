//! `#[repr(C)]` mirrors of the device handles in `cuda/include/doorbell/`.
//!
//! Each struct here is byte-identical to the C++ struct of the same name: the layout test below
//! compares every size and field offset with what the C++ compiler produced for the headers (a
//! table build.rs generates by running `cuda/probe/layout_probe.cpp`). Handles are plain `Pod`
//! data: the host fills them and passes them to kernels by value or in device arrays. Raw device
//! addresses are `u64`, as the driver API has them.

use bytemuck::{Pod, Zeroable};

pub mod limits;

/// Where a device wait that gives up writes who waited for what (`wait.cuh`). Lives in host-mapped
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

/// `WaitSite::reserved` bit (`kSiteTolerant` in `wait.cuh`): a wait whose caller leaves its peer
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

/// A device-to-device semaphore between two ranks (`semaphore.cuh`).
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

/// A MemoryChannel to one peer (`memory_channel.cuh`).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct MemoryChannelHandle {
    /// The signal/wait pair with the peer.
    pub semaphore: SemaphoreHandle,
    /// The peer's buffer, mapped (puts land here).
    pub dst: u64,
    /// My buffer (puts read here, gets land here).
    pub src: u64,
    /// My packet landing buffer.
    pub packet_buffer: u64,
    /// The peer's packet landing buffer, mapped.
    pub remote_packet_buffer: u64,
    /// Bytes of `dst`.
    pub dst_bytes: u64,
    /// Bytes of `src`.
    pub src_bytes: u64,
    /// Bytes of each packet buffer.
    pub packet_buffer_bytes: u64,
}

/// One trigger of the device-to-host FIFO (`fifo.cuh`). `meta` packs type, semaphore id, memory
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

    /// Decodes `meta` (bit layout in `fifo.cuh`).
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

/// A queue pair the GPU posts to (`ibgda.cuh`).
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

/// The device side of a proxy's FIFO (`fifo.cuh`).
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

/// A PortChannel to one peer (`port_channel.cuh`).
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

/// A PortChannel's RDMA link for kernels that post their own work requests (`port_channel.cuh`).
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

/// Most ranks a single-node collective kernel handles (`kMaxRanks`).
pub const MAX_RANKS: usize = 8;

/// A call's word and every rank's call-check inbox (`call_check.cuh`); a zero word runs the
/// kernel unchecked.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct CallCheck {
    /// This call's word (see [`crate::gpu::signature`]).
    pub word: u64,
    /// Every rank's inbox ([`crate::gpu::signature::INBOX_BYTES`]), mapped here (own at `rank`).
    pub inbox: [u64; MAX_RANKS],
}

/// Launch arguments of the allreduce kernels (`collective_args.cuh`).
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

/// Launch arguments of the two-shot on registered windows (`collective_args.cuh`).
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

/// Launch arguments of the all-to-all kernel (`collective_args.cuh`).
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

/// Launch arguments of the MoE dispatch/combine kernels (`collective_args.cuh`; field meanings
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

/// Launch arguments of the low-latency MoE kernels (`collective_args.cuh`; field meanings there).
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

/// `MoeLlArgs::packed` bits (`collective_args.cuh`): DeepEP's low-latency layout; e4m3 rows;
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

/// Launch arguments of the node-spanning MoE kernels (`collective_args.cuh`, `moe_net.cuh`; field
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

/// The high-throughput node-spanning MoE kernels' own arguments (`collective_args.cuh`).
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

/// What a chunk of the high-throughput network stream holds (`collective_args.cuh`), written
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

/// Per-block state of the sentinel two-shot (`collective_args.cuh`).
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

// SAFETY: plain-old-data structs with no padding-dependent invariants; the driver copies them
// byte for byte as kernel arguments.
unsafe impl cudarc::driver::DeviceRepr for MemoryChannelHandle {}
// SAFETY: as above.
unsafe impl cudarc::driver::DeviceRepr for SemaphoreHandle {}
// SAFETY: as above.
unsafe impl cudarc::driver::DeviceRepr for AllReduceArgs {}
// SAFETY: as above.
unsafe impl cudarc::driver::DeviceRepr for AllReduceDirectArgs {}
// SAFETY: as above.
unsafe impl cudarc::driver::DeviceRepr for AllToAllArgs {}
// SAFETY: as above.
unsafe impl cudarc::driver::DeviceRepr for MoeArgs {}
// SAFETY: as above.
unsafe impl cudarc::driver::DeviceRepr for MoeLlArgs {}
// SAFETY: as above.
unsafe impl cudarc::driver::DeviceRepr for MoeNetArgs {}
// SAFETY: as above.
unsafe impl cudarc::driver::DeviceRepr for MoeHtArgs {}
// SAFETY: as above.
unsafe impl cudarc::driver::DeviceRepr for PortChannelHandle {}
// SAFETY: as above.
unsafe impl cudarc::driver::DeviceRepr for IbQpHandle {}
// SAFETY: as above.
unsafe impl cudarc::driver::DeviceRepr for WaitSite {}

#[cfg(test)]
mod layout {
    use super::*;
    use std::collections::BTreeMap;
    use std::mem::{align_of, offset_of, size_of};

    include!(concat!(env!("OUT_DIR"), "/cuda_layout.rs"));

    /// Fields as (name, offset, size).
    type Fields = Vec<(&'static str, usize, usize)>;

    /// (struct, size, align, fields) as Rust lays them out.
    fn rust_layout() -> Vec<(&'static str, usize, usize, Fields)> {
        macro_rules! field_size {
            ($t:ty, $f:ident) => {{
                let probe: $t = <$t>::zeroed();
                std::mem::size_of_val(&probe.$f)
            }};
        }
        macro_rules! layout {
            ($name:literal, $t:ty, [$($f:ident),* $(,)?]) => {
                ($name, size_of::<$t>(), align_of::<$t>(),
                 vec![$((stringify!($f), offset_of!($t, $f), field_size!($t, $f))),*])
            };
        }
        vec![
            layout!(
                "WaitReport",
                WaitReport,
                [
                    valid,
                    what,
                    rank,
                    peer,
                    channel,
                    block,
                    thread,
                    reserved,
                    expected,
                    seen,
                    waited_ns,
                    abort,
                    mismatch_peer,
                    mismatch_mine,
                    mismatch_theirs,
                    mismatch_valid,
                    mismatch_counts,
                    mismatch_mine_send,
                    mismatch_mine_recv,
                    mismatch_theirs_send,
                    mismatch_theirs_recv,
                    dead_peers
                ]
            ),
            layout!(
                "WaitSite",
                WaitSite,
                [report, claim, budget_ns, rank, peer, channel, reserved]
            ),
            layout!(
                "SemaphoreHandle",
                SemaphoreHandle,
                [inbound_token, expected_inbound, remote_inbound_token, site]
            ),
            layout!(
                "MemoryChannelHandle",
                MemoryChannelHandle,
                [
                    semaphore,
                    dst,
                    src,
                    packet_buffer,
                    remote_packet_buffer,
                    dst_bytes,
                    src_bytes,
                    packet_buffer_bytes
                ]
            ),
            layout!(
                "AllReduceArgs",
                AllReduceArgs,
                [
                    input,
                    output,
                    count,
                    scratch,
                    rs_sems,
                    ag_sems,
                    epochs,
                    ll_offset,
                    ll_half_bytes,
                    ll_slot_bytes,
                    pipe_offset,
                    pipe_lane_bytes,
                    tile_elems,
                    lamport_offset,
                    lamport_buf_bytes,
                    lamport_slot_bytes,
                    lamport_state,
                    rank,
                    world,
                    site,
                    call
                ]
            ),
            layout!(
                "AllReduceDirectArgs",
                AllReduceDirectArgs,
                [base, peer_input, peer_output]
            ),
            layout!("CallCheck", CallCheck, [word, inbox]),
            layout!(
                "AllToAllArgs",
                AllToAllArgs,
                [
                    input,
                    output,
                    counts,
                    equal_bytes,
                    scratch,
                    data,
                    credit,
                    tile,
                    rank,
                    world,
                    lanes,
                    depth,
                    send_threads,
                    reserved,
                    ll_offset,
                    ll_slot_bytes,
                    epochs,
                    call,
                    input_bytes,
                    output_bytes,
                    pair_ll_max,
                    pair_epochs
                ]
            ),
            layout!(
                "MoeArgs",
                MoeArgs,
                [
                    x,
                    scales,
                    topk_idx,
                    topk_weights,
                    y,
                    out,
                    num_tokens,
                    hidden,
                    topk,
                    experts_per_rank,
                    max_tokens,
                    rank,
                    world,
                    blocks,
                    land,
                    comb_buf,
                    off_idx,
                    off_weights,
                    off_src,
                    off_matrix,
                    off_scales,
                    pos,
                    num_recv,
                    expert_counts,
                    calls,
                    sems,
                    rank_prefix,
                    y_weights,
                    out_weights,
                    off_comb_weights,
                    in_rank,
                    tokens_per_expert,
                    off_expert_in,
                    off_slots,
                    slot_bytes,
                    slot,
                    fill_rows,
                    call
                ]
            ),
            layout!(
                "MoeLlArgs",
                MoeLlArgs,
                [
                    x,
                    topk_idx,
                    topk_weights,
                    out,
                    num_tokens,
                    hidden,
                    topk,
                    experts_per_rank,
                    max_tokens,
                    rank,
                    world,
                    blocks,
                    area,
                    off_src,
                    off_counts,
                    off_from,
                    off_weight,
                    off_rec,
                    off_part,
                    off_queue,
                    off_sent,
                    y,
                    fill,
                    done,
                    epochs,
                    layout,
                    recv_count,
                    ready,
                    call,
                    packed_x,
                    packed_scales,
                    packed_src,
                    packed_range,
                    packed_count,
                    packed_stats,
                    off_ret,
                    packed,
                    packed_pad,
                    ticket,
                    rank_mask,
                    wait_cycles
                ]
            ),
            layout!(
                "MoeNetArgs",
                MoeNetArgs,
                [
                    x,
                    scales,
                    topk_idx,
                    topk_weights,
                    out,
                    num_tokens,
                    fp8,
                    hidden,
                    topk,
                    experts_per_rank,
                    max_tokens,
                    rank,
                    world,
                    msg_bytes,
                    header_bytes,
                    area,
                    peer_area,
                    channels,
                    sites,
                    stage,
                    off_counts,
                    off_part,
                    off_cdone,
                    stage_counts,
                    stage_part,
                    y,
                    recv_x,
                    recv_src,
                    recv_weights,
                    recv_scales,
                    rec,
                    msgs,
                    fill,
                    done,
                    epochs,
                    layout,
                    recv_count,
                    list,
                    probe,
                    arrived,
                    staged,
                    call_word,
                    off_inbox,
                    stage_words,
                    packed_x,
                    packed_scales,
                    packed_src,
                    packed_range,
                    packed_count,
                    packed_stats,
                    ticket,
                    in_x,
                    in_ids,
                    packed,
                    back,
                ]
            ),
            layout!(
                "MoeHtArgs",
                MoeHtArgs,
                [
                    nodes,
                    node,
                    rail,
                    node_of,
                    local_of,
                    fwd_x,
                    fwd_scales,
                    fwd_idx,
                    fwd_w,
                    fwd_origin,
                    fwd_out,
                    net_rows,
                    node_src,
                    node_num_recv,
                    origin_of,
                    recv_src,
                    chunks,
                    weights,
                    off_ring,
                    off_desc,
                    stage_desc,
                    credits,
                    sent_chunks,
                    recv_chunks,
                    list,
                    node_counts,
                    node_rows,
                    node_max_rows,
                    fwd_wout,
                    w_out,
                    off_part_w,
                    stage_part_w,
                    in_rank,
                    fwd_in_rank,
                    tokens_per_expert,
                    fwd_tpe,
                    tok_nodes,
                    desc_bytes,
                    by_rank,
                ]
            ),
            layout!("HtChunkDesc", HtChunkDesc, [epoch, messages, last]),
            layout!("LamportState", LamportState, [call, reserved, prev_count]),
            layout!(
                "ProxyTrigger",
                ProxyTrigger,
                [src_offset, dst_offset, size, meta]
            ),
            layout!(
                "IbQpHandle",
                IbQpHandle,
                [
                    sq, dbr, doorbell, cq, cq_ci, state, sizes, host_ready, qpn, sq_log2, cq_log2,
                    flags, site
                ]
            ),
            layout!(
                "FifoHandle",
                FifoHandle,
                [triggers, head, tail, tail_cache, stopped, size_log2, reserved, site]
            ),
            layout!(
                "PortChannelHandle",
                PortChannelHandle,
                [
                    fifo,
                    inbound_token,
                    expected_inbound,
                    flush_done,
                    semaphore,
                    dst_mem,
                    src_mem,
                    reserved,
                    ib
                ]
            ),
            layout!(
                "IbPortLink",
                IbPortLink,
                [
                    qp,
                    src,
                    dst,
                    token,
                    scratch,
                    src_key,
                    dst_key,
                    token_key,
                    scratch_key,
                    stripes,
                    reserved,
                    more
                ]
            ),
            layout!("LL16Packet", Ll16Packet, [data1, flag1, data2, flag2]),
            layout!("LL8Packet", Ll8Packet, [data, flag]),
        ]
    }

    #[test]
    fn trigger_meta_round_trips() {
        let m = TriggerMeta {
            kind: trigger::DATA | trigger::FLAG,
            semaphore: ProxyTrigger::MAX_SEMAPHORE,
            src_mem: 7,
            dst_mem: ProxyTrigger::MAX_MEMORY,
            parity: 1,
        };
        assert_eq!(ProxyTrigger::unpack(ProxyTrigger::pack(m)), m);
        assert_eq!(ProxyTrigger::pack(m) >> 63, 1);
    }

    #[test]
    fn every_mirror_matches_the_cuda_layout() {
        let mut cuda: BTreeMap<&str, (usize, usize, Fields)> = BTreeMap::new();
        for &(kind, name, field, a, b) in CUDA_LAYOUT {
            let e = cuda.entry(name).or_insert((0, 0, Vec::new()));
            if kind == "struct" {
                (e.0, e.1) = (a, b);
            } else {
                e.2.push((field, a, b));
            }
        }
        let rust = rust_layout();
        let rust_names: Vec<&str> = rust.iter().map(|r| r.0).collect();
        let cuda_names: Vec<&str> = cuda.keys().copied().collect();
        let mut sorted = rust_names.clone();
        sorted.sort();
        assert_eq!(
            sorted, cuda_names,
            "structs mirrored in Rust vs probed in C++"
        );
        for (name, size, align, fields) in rust {
            let (csize, calign, cfields) = &cuda[name];
            assert_eq!(
                (size, align),
                (*csize, *calign),
                "{name}: (size, align) Rust vs C++"
            );
            assert_eq!(
                &fields, cfields,
                "{name}: fields (name, offset, size) Rust vs C++"
            );
            // The listed fields must tile the struct: a field added on one side but not listed
            // would leave a hole of at least its size.
            let mut end = 0;
            for &(f, off, sz) in &fields {
                assert!(
                    off >= end && off - end < 8,
                    "{name}.{f}: unlisted bytes before it"
                );
                end = off + sz;
            }
            assert!(
                size - end < align.max(8),
                "{name}: unlisted bytes at the end"
            );
        }
    }

    /// Every constant and enum code the probe prints has its Rust twin listed here, equal; and
    /// every twin listed was printed (a constant renamed or dropped on one side fails too).
    #[test]
    fn shared_constants_and_codes_match_the_headers() {
        use crate::WaitKind;
        let twins: Vec<(&str, u64)> = vec![
            ("kMaxRanks", MAX_RANKS as u64),
            (
                "kInboxWords",
                (crate::gpu::signature::INBOX_BYTES / 8) as u64,
            ),
            ("kPipeDepth", limits::PIPE_DEPTH as u64),
            ("kHtMaxLocalExperts", limits::HT_MAX_LOCAL_EXPERTS as u64),
            ("kLlMaxPairs", limits::LL_MAX_PAIRS as u64),
            ("kHtChunk", crate::collectives::moe::plan::HT_CHUNK as u64),
            ("moe_net::kMaxRanks", limits::MAX_NET_RANKS as u64),
            ("moe_net::kStageParts", limits::NET_STAGE_PARTS as u64),
            ("moe_net::kMaxPackPairs", limits::NET_MAX_PACK_PAIRS as u64),
            ("kTriggerData", trigger::DATA as u64),
            ("kTriggerFlag", trigger::FLAG as u64),
            ("kTriggerFlush", trigger::FLUSH as u64),
        ];
        // The device writes these codes; the host decodes them with WaitKind::from_code.
        let waits = [
            ("kWaitSemaphore", WaitKind::Semaphore),
            ("kWaitPacket", WaitKind::Packet),
            ("kWaitFifoSlot", WaitKind::FifoSlot),
            ("kWaitFlush", WaitKind::Flush),
            ("kWaitProxyStopped", WaitKind::ProxyStopped),
            ("kWaitBadTrigger", WaitKind::BadTrigger),
            ("kWaitBadInput", WaitKind::BadInput),
            ("kWaitIbProgress", WaitKind::IbProgress),
            ("kWaitIbError", WaitKind::IbError),
            ("kWaitArgMismatch", WaitKind::ArgumentMismatch),
            ("kWaitBadCounts", WaitKind::BadCounts),
        ];
        for &(name, value) in CUDA_CONSTS {
            if let Some(&(_, kind)) = waits.iter().find(|(n, _)| *n == name) {
                assert_eq!(WaitKind::from_code(value as u32), kind, "{name} = {value}");
                continue;
            }
            let Some(&(_, rust)) = twins.iter().find(|(n, _)| *n == name) else {
                panic!("{name} (= {value}): printed by the probe, but no Rust twin is listed");
            };
            assert_eq!(rust, value, "{name}: Rust's twin against the header's");
        }
        for name in twins.iter().map(|t| t.0).chain(waits.iter().map(|w| w.0)) {
            assert!(
                CUDA_CONSTS.iter().any(|(n, _)| *n == name),
                "{name}: listed here, not printed by cuda/probe/layout_probe.cpp"
            );
        }
    }
}
