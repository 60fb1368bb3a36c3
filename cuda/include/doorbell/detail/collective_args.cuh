// doorbell device API, detail tier: launch arguments of doorbell's own collective kernels
// (allreduce, all-to-all, the high-throughput MoE paths), and the words those kernels share with
// their host code. Only doorbell's kernels (cuda/kernels/*.cu) and the layout probe include this;
// a kernel of yours has no use for it. The host fills each struct once per call and the kernel
// only reads it. They live in a header (not next to the kernels) so their Rust mirrors in
// src/device_api/collective_args.rs are layout-checked like every other handle. The low-latency
// MoE arguments, which fused kernels of yours take too, are in coll/moe_args.cuh.
#pragma once

#include "../channel/semaphore.cuh"
#include "../coll/call_check.cuh"

namespace doorbell {

// Per-block state of the sentinel ("Lamport") two-shot: which of the three buffers the next call
// uses, and how many elements the previous call had (this block clears what it consumed then).
struct LamportState {
  uint32_t call;        // calls so far, modulo 3
  uint32_t reserved;
  uint64_t prev_count;  // elements of the previous call
};
DOORBELL_CHECK_SIZE(LamportState, 16);

// Arguments of every allreduce kernel (cuda/kernels/allreduce.cu).
struct AllReduceArgs {
  const void* input;
  void* output;
  uint64_t count;                // elements
  char* scratch[kMaxRanks];      // every rank's scratch, mapped here (own at [rank])
  const SemaphoreHandle* rs_sems;  // pipeline "reduce-scatter part arrived", [lane * world + peer]
  const SemaphoreHandle* ag_sems;  // pipeline "reduced shard arrived", [lane * world + peer]
  uint32_t* epochs;              // LL: one epoch per block of the (fixed) LL grid
  uint64_t ll_offset;            // LL region offset in every scratch
  uint64_t ll_half_bytes;        // bytes of one LL half
  uint64_t ll_slot_bytes;        // bytes of one sender's slot in an LL area
  uint64_t pipe_offset;          // pipeline region offset
  uint64_t pipe_lane_bytes;      // bytes per lane
  uint64_t tile_elems;           // pipeline: elements per shard of a tile
  uint64_t lamport_offset;       // sentinel two-shot region offset in every scratch
  uint64_t lamport_buf_bytes;    // bytes of one of its three buffers
  uint64_t lamport_slot_bytes;   // bytes of one sender's slot in a buffer's RS or AG area
  LamportState* lamport_state;   // one per block of the (fixed) LL grid
  uint32_t rank;
  uint32_t world;
  WaitSite site;                 // for LL waits (peer filled in per wait)
  CallCheck call;                // this call's word and every rank's inbox (coll/call_check.cuh)
};
DOORBELL_CHECK_SIZE(AllReduceArgs, 312);

// Arguments of the two-shot on registered windows (cuda/kernels/allreduce.cu): the common ones,
// and every rank's input and output as mapped here (own at [rank]).
struct AllReduceDirectArgs {
  AllReduceArgs base;
  const void* peer_input[kMaxRanks];
  void* peer_output[kMaxRanks];
};
DOORBELL_CHECK_SIZE(AllReduceDirectArgs, 440);

// Launch arguments of the all-to-all kernel (cuda/kernels/alltoall.cu).
struct AllToAllArgs {
  const char* input;
  char* output;
  const uint64_t* counts;  // device [4][world] bytes: send counts, send offsets, recv counts, recv offsets; or null
  uint64_t equal_bytes;    // with counts == null: block p is [p * equal_bytes, +equal_bytes) on both sides
  char* scratch[kMaxRanks];       // every rank's scratch, mapped here (own at [rank])
  const SemaphoreHandle* data;    // [lane][world]: "a tile arrived" (p -> me)
  const SemaphoreHandle* credit;  // [lane][world]: "a slot is free again" (me -> p)
  uint64_t tile;                  // bytes per tile (a multiple of 16)
  uint32_t rank;
  uint32_t world;
  uint32_t lanes;   // blocks per peer
  uint32_t depth;   // slots per (source, lane) ring
  uint32_t send_threads;  // threads of a tile block that send (the rest receive), a multiple of 32
  uint32_t reserved;
  // LL16 path for tiny blocks: [2 halves][source][ll_slot_bytes] of packets at ll_offset in every
  // scratch; one epoch per block of the fixed LL grid.
  uint64_t ll_offset;
  uint64_t ll_slot_bytes;
  uint32_t* epochs;
  CallCheck call;  // this call's word and every rank's inbox (coll/call_check.cuh)
  // alltoallv only: the buffers' sizes (device counts naming a range outside them are refused),
  // the largest pair block that goes as LL16 packets (0: none; needs the call check), and those
  // packets' epochs, [2 (send, receive)][world][lanes].
  uint64_t input_bytes;
  uint64_t output_bytes;
  uint64_t pair_ll_max;
  uint32_t* pair_epochs;
};
DOORBELL_CHECK_SIZE(AllToAllArgs, 272);

// Launch arguments of the MoE dispatch/combine kernels (cuda/kernels/moe.cu); one struct for all
// of them, most fields fixed per dispatcher, the inputs per call.
struct MoeArgs {
  // Per call.
  const uint16_t* x;           // [num_tokens, hidden] bf16, or e4m3 bytes [num_tokens, hidden] with scales
  const float* scales;         // FP8 dispatch: [num_tokens, hidden / 128] f32; null for bf16
  const int32_t* topk_idx;     // [num_tokens, topk], -1 = no expert
  const float* topk_weights;   // [num_tokens, topk]
  const uint16_t* y;           // combine input: [num_recv, hidden] bf16, aligned with recv_x
  uint16_t* out;               // combine output: [num_tokens, hidden] bf16
  uint32_t num_tokens;
  // Fixed.
  uint32_t hidden;
  uint32_t topk;
  uint32_t experts_per_rank;
  uint32_t max_tokens;         // per rank
  uint32_t rank;
  uint32_t world;
  uint32_t blocks;             // grid of the send / finish kernels (signals per call per peer)
  // Every rank's dispatch results, mapped here; senders write rows straight into them. Receive
  // slots of slot_bytes each from 0 (the receiver picks one per call): recv_x [world *
  // max_tokens, hidden] bf16 (or e4m3 bytes) at 0, recv_idx [.., topk] i32 at off_idx,
  // recv_weights [.., topk] f32 at off_weights, recv_src [.., 2] i32 at off_src, the FP8 scales
  // [.., hidden / 128] f32 at off_scales; after the slots, the count matrices [2][world][world]
  // u64 at off_matrix (row s: what rank s sends to each rank, words of count | dispatch number
  // << 32, by call parity; cuda/kernels/moe.cu), and the slot tables [2][world] u64 at off_slots.
  char* land[kMaxRanks];
  char* comb_buf[kMaxRanks];   // every rank's combine area: [world][max_tokens] rows [hidden] bf16, pushed by their holders
  uint64_t off_idx;
  uint64_t off_weights;
  uint64_t off_src;
  uint64_t off_matrix;
  uint64_t off_scales;
  int32_t* pos;                // per call, in the receive slot: [max_tokens][world], position of token t among those sent to r, or -1
  uint32_t* num_recv;          // mine: rows received
  uint32_t* expert_counts;     // mine: [experts_per_rank]
  uint64_t* calls;             // mine: call counts per kernel and block (cuda/kernels/moe.cu)
  const SemaphoreHandle* sems; // [3][world]: dispatch rows in, repeated combine may start, combine rows pushed
  int32_t* rank_prefix;        // per call, in my receive slot: [world][world] i32, DeepEP's rank_prefix_matrix:
                               //   [s][r] = rows ranks 0..=s send rank r (-1 everywhere after a cut dispatch)
  const float* y_weights;      // combine, per call: [num_recv, topk] f32 summed like y's rows, or null
  float* out_weights;          // combine, per call: [num_tokens, topk] f32 (with y_weights)
  uint64_t off_comb_weights;   // in every combine area: the pushed rows' y_weights [world][max_tokens][topk] f32
  // Routing without top-k (in_rank non-null: the mode; DeepEP's dispatch by is_token_in_rank), per call:
  const uint8_t* in_rank;            // [num_tokens, world] bool: token t goes to rank r
  const int32_t* tokens_per_expert;  // [experts] i32, this rank's rows per expert (summed over the
                                     //   sources into each rank's expert_counts), or null: no counts
  uint64_t off_expert_in;      // in every landing area: [2][world][experts_per_rank] u64 words, count |
                               //   dispatch number << 32, of tokens_per_expert by source (call parity)
  uint64_t off_slots;          // in every landing area: the slot tables (above)
  uint64_t slot_bytes;         // one receive slot's bytes
  uint32_t slot;               // per call: my receive slot
  uint32_t fill_rows;          // per call: top-k ids of rows [num_recv, fill_rows) of the slot set to -1 (DeepEP's num_worst_tokens)
  CallCheck call;              // this call's word and every rank's inbox (coll/call_check.cuh)
};
DOORBELL_CHECK_SIZE(MoeArgs, 440);

// The high-throughput node-spanning MoE exchange's own arguments (cuda/kernels/moe_net.cu, beside
// MoeNetArgs): a token crosses the network once per destination node, to the rank of that node
// with this rank's local index (its rail peer), which forwards it inside its node with the NVLink
// MoE dispatch. Forwarded tokens sit in slots [node][token]: node n's slots hold what node n's rail
// peer sent here (and this node's slots this rank's own tokens).
struct MoeHtArgs {
  uint32_t nodes;
  uint32_t node;                  // mine
  const uint32_t* rail;           // [nodes] the rank of each node with my local index (mine: me)
  const uint32_t* node_of;        // [world] each rank's node
  const uint32_t* local_of;       // [world] each rank's index in its node
  uint8_t* fwd_x;                 // [nodes * max_tokens] rows (bf16, or e4m3 bytes)
  float* fwd_scales;              // [nodes * max_tokens][hidden / 128] (fp8)
  int32_t* fwd_idx;               // [nodes * max_tokens][topk] expert ids within my node, -1 elsewhere
  float* fwd_w;                   // [nodes * max_tokens][topk]
  int32_t* fwd_origin;            // [nodes * max_tokens][2] (rank, token); rank -1: empty this call
  const uint16_t* fwd_out;        // [nodes * max_tokens][hidden] bf16: my node's combine of each slot
  uint32_t* net_rows;             // [nodes] rows each node's rail peer sent here, last dispatch
  const int32_t* node_src;        // the node dispatch's recv_src [rows][2] (node rank, slot)
  uint32_t* node_num_recv;        // the node dispatch's row count
  const uint64_t* origin_of;      // [ranks of my node] each one's fwd_origin, mapped here
  int32_t* recv_src;              // [rows][2] the rows' origin (rank, token)
  // The network stream with receiver-driven admission (moe_net.cu, "High throughput"): each
  // source node's messages land in a ring of `chunks` chunks of kHtChunk messages here; a sender
  // writes a chunk only after the receiver granted its slot (a credit signal per chunk consumed).
  uint32_t chunks;                // ring chunks per source node
  uint32_t weights;               // combine: 1 when the rows' top-k weights travel (w_out given)
  uint64_t off_ring;              // area: [nodes][chunks][kHtChunk][msg_bytes] messages
  uint64_t off_desc;              // area: [nodes][chunks] HtChunkDesc, written after each chunk
  uint64_t stage_desc;            // staging: [nodes][chunks] HtChunkDesc, their sources
  const void* credits;            // [world] PortChannelHandle: the credit channels (signals only)
  uint64_t* sent_chunks;          // mine: [nodes] chunks sent to each node so far (all calls)
  uint64_t* recv_chunks;          // mine: [nodes] chunks received from each node so far
  uint32_t* list;                 // mine: [nodes][max_tokens] tokens sent to each node, this call
  // The node dispatch's results, marked by moe_ht_remap when the exchange between nodes gave up
  // (the node's own dispatch then ran over what arrived, and would not mark them itself).
  uint32_t* node_counts;          // the node dispatch's per-expert counts
  uint8_t* node_rows;             // the node dispatch's row slots
  uint64_t node_max_rows;         // how many
  // The combine's top-k weights (DeepEP's combined_topk_weights), with `weights`: the node's
  // combine sums each slot's weights into fwd_wout, combine_send sends them beside the slot's
  // row into the origin's partial weights, combine_recv adds the nodes' in node order.
  float* fwd_wout;                // [nodes * max_tokens][topk] f32
  float* w_out;                   // this call's [num_tokens][topk] f32 output
  uint64_t off_part_w;            // area: [world * max_tokens][topk] f32 partial weights
  uint64_t stage_part_w;          // staging: the same, for network peers
  // A dispatch routed by ranks (DeepEP's without top-k; `by_rank` 1): a token goes to the nodes
  // of the ranks in its `in_rank` row; its message carries that row as a 64-bit rank mask (in the
  // first id's and the first weight's words), which fills the slot's `fwd_in_rank` row for the
  // node's own dispatch by ranks. With `tokens_per_expert` each source's counts of the node's
  // experts travel in its first chunk's descriptor (`desc_bytes` a descriptor: HtChunkDesc, then
  // [node experts] int32) and are summed into `fwd_tpe`, the node dispatch's per-expert counts.
  const uint8_t* in_rank;         // this dispatch's [num_tokens][world] bool, by ranks
  uint8_t* fwd_in_rank;           // [nodes * max_tokens][ranks of a node] the slots' routing
  const int32_t* tokens_per_expert;  // this rank's [experts] rows per expert, or null
  int32_t* fwd_tpe;               // [experts of a node]: mine and my rail peers' counts
  uint64_t* tok_nodes;            // [max_tokens] the nodes each token of the last dispatch went to
  uint32_t desc_bytes;            // bytes of a chunk descriptor slot (area and staging)
  uint32_t by_rank;               // 1: this dispatch routes by ranks
};
DOORBELL_CHECK_SIZE(MoeHtArgs, 288);

// Messages per chunk of the high-throughput network stream (one warp posts a chunk).
constexpr uint32_t kHtChunk = 32;

// A MoE dispatch that an abort cut short marks its counts so they cannot pass for counts: the
// rows received (`num_recv`) and the low-latency per-expert counts (`recv_count`) read
// kCutCount (-1 as int32); the high-throughput per-expert counts (`expert_counts`, summed by
// every block) get kCutBit (negative as int32, whatever the blocks add). Inside a node the
// rows are stored all ones too (NaN in bf16 and in e4m3).
constexpr uint32_t kCutCount = 0xffffffffu;
constexpr uint32_t kCutBit = 0x80000000u;

// What a chunk of the high-throughput stream holds, written behind its messages.
struct HtChunkDesc {
  uint64_t epoch;     // the dispatch it belongs to
  uint32_t messages;  // 0..kHtChunk
  uint32_t last;      // 1: the source's last chunk of this dispatch
};
DOORBELL_CHECK_SIZE(HtChunkDesc, 16);

}  // namespace doorbell
