// doorbell device API: launch arguments of doorbell's own collective kernels. They live in a header
// (not next to the kernels) so their Rust mirrors in src/device_api/ are layout-checked like every
// other handle.
#pragma once

#include "call_check.cuh"
#include "limits.cuh"
#include "semaphore.cuh"

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
  CallCheck call;                // this call's word and every rank's inbox (call_check.cuh)
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
  CallCheck call;  // this call's word and every rank's inbox (call_check.cuh)
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
  CallCheck call;              // this call's word and every rank's inbox (call_check.cuh)
};
DOORBELL_CHECK_SIZE(MoeArgs, 440);

// Launch arguments of the low-latency MoE kernels (cuda/kernels/moe_ll.cu).
struct MoeLlArgs {
  // Per call.
  const uint16_t* x;            // [num_tokens, hidden] bf16 (dispatch)
  const int32_t* topk_idx;      // [num_tokens, topk], -1 = no expert
  const float* topk_weights;    // [num_tokens, topk] (dispatch: carried to the experts' ranks)
  uint16_t* out;                // combine output [num_tokens, hidden] bf16
  uint32_t num_tokens;
  // Fixed.
  uint32_t hidden;
  uint32_t topk;
  uint32_t experts_per_rank;
  uint32_t max_tokens;          // per rank
  uint32_t rank;
  uint32_t world;
  uint32_t blocks;              // grid of the send and combine kernels
  // Every rank's receive area, mapped here. Rows are numbered over both halves:
  // row = ((half * local experts + le) * world + source) * max_tokens + i. Sections:
  //   0           [rows][hidden] bf16 the received rows
  //   off_src     [rows] i32 the source token of each row
  //   off_counts  [2][local expert][source] u64 (epoch << 32 | rows)
  //   off_from    [rows] i32: -n on the row that carries the data of a (source, token) pair with
  //               n selections on this rank, else the row to copy the data from
  //   off_weight  [rows] f32 the selection's weight
  //   off_rec     [rows][topk] i32 on a carrying row: the rows of its pair's selections, top-k order
  //   off_part    [2][source][max_tokens][hidden] bf16: the partial sums the combine sends back
  //   off_queue   [2][source][max_tokens] u64 (epoch << 32 | carrier row): the carrier rows each
  //               source announced, in the order they were written
  //   off_sent    [2][source] u64 (epoch << 32 | carrier rows the source sent here this epoch)
  char* area[kMaxRanks];
  uint64_t off_src;
  uint64_t off_counts;
  uint64_t off_from;
  uint64_t off_weight;
  uint64_t off_rec;
  uint64_t off_part;
  uint64_t off_queue;
  uint64_t off_sent;
  const uint16_t* y;            // mine: combine buffer [local expert][source][max_tokens][hidden]
  uint32_t* fill;               // mine: [num experts + kMaxRanks] rows sent per expert, then carrier
                                //   rows sent per rank, this call
  uint32_t* done;               // mine: [4] blocks finished: dispatch send, combine send; (token,
                                //   rank) items the dispatch send finished; zero
  uint64_t* epochs;             // mine: [4] dispatch epoch, combine calls, then the call-check
                                //   ordinals of the last dispatch send and the last combine send
  uint32_t* layout;             // mine: [local expert][source] rows received
  uint32_t* recv_count;         // mine: [local expert] rows received
  const SemaphoreHandle* ready; // [world]: "my partial sums for you are written"
  CallCheck call;               // this call's word and every rank's inbox (call_check.cuh)
  // DeepEP's low-latency layout (`packed` != 0; MoeConfig::with_deep_ep_layout). Per call; cap =
  // world * max_tokens rows per local expert, each expert's rows packed from row 0, source 0's
  // first, then source 1's, ...
  uint8_t* packed_x;            // dispatch: [local expert][cap] rows of hidden bf16, or (kPackedFp8)
                                //   hidden e4m3 bytes
  void* packed_scales;          // dispatch, kPackedFp8: f32 [local expert][hidden / 128][cap], or
                                //   (kPackedUe8m0) i32 [local expert][hidden / 512][cap] holding four
                                //   exponent bytes (group 4j + b in byte b): column-major, as DeepEP's
  int32_t* packed_src;          // [local expert][cap]: each row's source token (DeepEP's src_info)
  int64_t* packed_range;        // [local expert][world]: begin << 32 | rows from each source
  int32_t* packed_count;        // dispatch: [local expert] rows; -1 after a dispatch an abort cut short
  int32_t* packed_stats;        // dispatch: [local expert] rows added to it (null: none)
  uint64_t off_ret;             // area section: [2][expert][max_tokens][hidden] bf16, the combine's rows
                                //   returned unweighted to each token's rank, half = combine call & 1
  uint32_t packed;              // kPacked | kPackedFp8 | kPackedRound | kPackedUe8m0 | kIds64, or 0
  uint32_t packed_pad;
  uint64_t* ticket;             // per call, or null: [2] words; the send half stores its dispatch
                                //   epoch (combine call) and its call-check ordinal here and the
                                //   receive half reads them, so a receive half still pairs with its
                                //   own send when another send came between them (two results in
                                //   flight, as DeepEP allows); null: the receive half takes the
                                //   last send's
  const uint32_t* rank_mask;    // [world], or null: 1 = the rank is masked (DeepEP's enable_shrink,
                                //   low_latency_update_mask_buffer): nothing goes to it, nothing is
                                //   waited for from it, its experts add nothing to a combine; read
                                //   at each call (set between calls, on the stream)
  int64_t* wait_cycles;         // [world], or null: a receive half (DeepEP's layout) adds here, for
                                //   each source rank, the SM cycles (clock64) it waited for that
                                //   rank's counts (dispatch, per local expert) or its rows (combine)
                                //   from its start: DeepEP's dispatch/combine_wait_recv_cost_stats
};
DOORBELL_CHECK_SIZE(MoeLlArgs, 408);

// MoeLlArgs::packed bits: DeepEP's layout; e4m3 rows cast per 128 values by the receive half
// (scale amax / 448, amax at least 1e-4); scales rounded up to powers of two; scales stored as
// exponent bytes.
constexpr uint32_t kPacked = 1, kPackedFp8 = 2, kPackedRound = 4, kPackedUe8m0 = 8;
// MoeLlArgs::packed bit: topk_idx holds int64 ids (DeepEP's topk_idx_t), read as such (an id
// outside -1..experts selects nothing), so callers with int64 ids need no conversion kernel.
constexpr uint32_t kIds64 = 16;
// MoeLlArgs::packed bit (a packed combine, one node): the rows go back in doorbell's 10-bit log
// format (moe_ll.cu, "Log rows"), 176 of each 128 values' 256 bytes (DeepEP's use_logfmt).
constexpr uint32_t kPackedLogFmt = 32;

// Launch arguments of the node-spanning MoE kernels (cuda/kernels/moe_net.cu, doorbell/moe_net.cuh):
// the low-latency exchange for any mix of same-node peers (NVLink stores) and peers on other
// nodes (PortChannel puts: RDMA WRITEs the GPU or the proxy posts).
//
// A message is one token for one destination rank: a header (source token, 1 if the row is e4m3,
// the dispatch epoch, then its top-k expert ids and weights; moe_net.cuh) and the payload (hidden bf16, or hidden e4m3 bytes then hidden / 128 f32
// scales). The sender builds it once per token in its staging area and sends it to every rank
// holding one of the token's experts; the receiver copies its payload into the slot of each of
// its experts the token selected.
//
// Every rank's area (registered with the NIC, mapped by same-node peers):
//   0           [2][source][max_tokens][msg_bytes] messages, half = dispatch epoch & 1
//   off_counts  [2][source] u64 (epoch << 32 | messages): the source's count for that half
//   off_part    [source][max_tokens][hidden] bf16: the combine's partial sums, by my token
//   off_cdone   [source] u64: the combine call whose partial sums a same-node source has written
// Every rank's staging area (the PortChannels' source):
//   0             [2][max_tokens][msg_bytes] the messages by token, half = dispatch epoch & 1 (a
//                 half is rebuilt two calls later, when every peer has seen this call's counts:
//                 the send never waits for its network completions)
//   stage_counts  [2][world] u64 the count words sent over the network, by half
//   stage_part    [source][max_tokens][hidden] bf16 partial sums for sources on other nodes
// The high-throughput path (MoeHtArgs) uses the same area with its own message region: rings of
// `chunks` chunks of kHtChunk messages per source node at off_ring, chunk descriptors at
// off_desc; its staging holds one half of messages by token and the descriptors at stage_desc;
// its partial sums at off_part are [2][source][max_tokens][hidden], half = the combine call's
// parity (a peer one combine ahead writes the other half).
struct MoeNetArgs {
  // Per call.
  const uint8_t* x;             // [num_tokens] rows: hidden bf16, or hidden e4m3 bytes (fp8)
  const float* scales;          // fp8: [num_tokens, hidden / 128] f32; else null
  const int32_t* topk_idx;      // [num_tokens, topk], -1 = no expert
  const float* topk_weights;    // [num_tokens, topk]
  uint16_t* out;                // combine output [num_tokens, hidden] bf16
  uint32_t num_tokens;
  uint32_t fp8;                 // 1: rows are e4m3 bytes with scales
  // Fixed.
  uint32_t hidden;
  uint32_t topk;
  uint32_t experts_per_rank;
  uint32_t max_tokens;          // per rank
  uint32_t rank;
  uint32_t world;
  uint32_t msg_bytes;           // a message slot (16-byte multiple)
  uint32_t header_bytes;        // its header (16-byte multiple)
  char* area;                   // mine
  const uint64_t* peer_area;    // [world] every rank's area as mapped here (mine too); 0: network only
  const void* channels;         // [world] PortChannelHandle, by rank (mine unused): my staging -> its area
  const WaitSite* sites;        // [world] where waits for each rank report
  char* stage;                  // mine: the staging area
  uint64_t off_counts;
  uint64_t off_part;
  uint64_t off_cdone;
  uint64_t stage_counts;
  uint64_t stage_part;
  const uint16_t* y;            // mine: combine buffer [local expert][source][max_tokens][hidden]
  uint8_t* recv_x;              // mine: [2 halves of rows x hidden * 2 bytes]: [local expert][source]
                                //   [max_tokens] rows of hidden bf16 (or hidden e4m3) from each half's start
  int32_t* recv_src;            // mine: [2][local expert][source][max_tokens] source token
  float* recv_weights;          // mine: [2][local expert][source][max_tokens] selection weight
  float* recv_scales;           // mine: [2][local expert][source][max_tokens][hidden / 128] (fp8)
  int32_t* rec;                 // mine: [2][source][max_tokens][topk] each message's rows here, -1 none
  uint32_t* msgs;               // mine: [2][source] messages received
  uint32_t* fill;               // mine: [world] messages sent per rank, then [local expert][source]
                                //   rows received, this call
  uint32_t* done;               // mine: [4] blocks finished: dispatch send, dispatch receive,
                                //   combine send; zero
  uint64_t* epochs;             // mine: [6] dispatch epoch, combine calls, dispatch and combine
                                //   receive "counts are in" words, then (DeepEP's layout) the
                                //   epochs of the last two receives, newest first
  uint32_t* layout;             // mine: [local expert][source] rows received
  uint32_t* recv_count;         // mine: [local expert] rows received
  uint32_t* list;               // mine: [world][max_tokens] the token of each message to a peer on
                                //   another node, this call (message j goes to the peer's slot j)
  uint64_t* probe;              // optional [8] global timer (ns): first block's start (min), last
                                //   doorbell of the send (max), send's end (max); moe_net_dispatch_send only:
                                //   last stage task's end, last network task done listing its
                                //   tokens, last one done writing its batch, last one past the
                                //   staging (its gate) (max), first network task's start (min);
                                //   null: off
  uint32_t* arrived;            // mine: [world] (token group, rank) tasks of moe_net_dispatch_send done, this call
  uint64_t* staged;             // mine: [ceil(max_tokens / 32) * 8] the dispatch epoch each stage task
                                //   of moe_net_dispatch_send (8 per token group) last staged
  // The call check across nodes (moe_net.cuh, "call check"): this call's word (0: unchecked, as
  // every high-throughput call), the inbox's offset in the area, and the offset in the staging
  // area of the four words network peers' inboxes are written from (by the call's count, n & 3).
  uint64_t call_word;
  uint64_t off_inbox;
  uint64_t stage_words;
  // DeepEP's low-latency layout across nodes (moe_net.cu: moe_net_packed_prep, moe_net_pack,
  // moe_net_combine_send_packed, moe_net_combine_recv_packed). The packed outputs as MoeLlArgs's
  // (same meanings), then:
  uint8_t* packed_x;
  void* packed_scales;
  int32_t* packed_src;
  int64_t* packed_range;        // dispatch: written; combine send: the handle's, read
  int32_t* packed_count;
  int32_t* packed_stats;
  uint64_t* ticket;             // null, or [2]: the send leaves its epoch in [0] for its receive half
  const uint16_t* in_x;         // prep: the caller's bf16 rows [num_tokens, hidden]
  const void* in_ids;           // prep and combine receive: the caller's top-k ids (i32, or i64 with kIds64)
  uint32_t packed;              // kPacked | kPackedFp8 | kPackedRound | kPackedUe8m0 | kIds64, or 0
  uint32_t back;                // combine send: whose rows, 0 the last packed receive, 1 the one before
};
DOORBELL_CHECK_SIZE(MoeNetArgs, 392);

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
