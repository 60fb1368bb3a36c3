// doorbell device API, coll tier: the argument structs of the two low-latency MoE exchanges,
// MoeLlArgs (one node, NVLink: coll/moe_ll.cuh) and MoeNetArgs (any mix of nodes:
// coll/moe_net.cuh).
//
// Who fills them: the host (`MoeLowLatency` in Rust, `begin_fused_send`), once per call; a
// kernel only reads them. They are the launch arguments of doorbell's own MoE kernels
// (cuda/kernels/moe_ll.cu, moe_net.cu) and, unchanged, the argument a fused kernel of yours takes
// and passes to moe_ll::put_token / moe_net::put_token: that is why they sit in this tier and not
// in detail/ with the other kernels' arguments. Their Rust mirrors (src/device_api/moe_args.rs) are
// pinned by the layout probe. What each area holds and who writes it is described at each struct.
#pragma once

#include "../channel/semaphore.cuh"
#include "../core/wait.cuh"
#include "call_check.cuh"

namespace doorbell {

// Launch arguments of the low-latency MoE kernels (cuda/kernels/moe_ll.cu) and of the fused calls
// of coll/moe_ll.cuh.
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

// Launch arguments of the node-spanning MoE kernels (cuda/kernels/moe_net.cu, coll/moe_net.cuh):
// the low-latency exchange for any mix of same-node peers (NVLink stores) and peers on other
// nodes (PortChannel puts: RDMA WRITEs the GPU or the proxy posts).
//
// A message is one token for one destination rank: a header (source token, 1 if the row is e4m3,
// the dispatch epoch, then its top-k expert ids and weights; coll/moe_net.cuh) and the payload
// (hidden bf16, or hidden e4m3 bytes then hidden / 128 f32 scales). The sender builds it once per
// token in its staging area and sends it to every rank holding one of the token's experts; the
// receiver copies its payload into the slot of each of its experts the token selected.
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
// The high-throughput path (MoeHtArgs, detail/collective_args.cuh) uses the same area with its own
// message region: rings of `chunks` chunks of kHtChunk messages per source node at off_ring, chunk
// descriptors at off_desc; its staging holds one half of messages by token and the descriptors at
// stage_desc; its partial sums at off_part are [2][source][max_tokens][hidden], half = the combine
// call's parity (a peer one combine ahead writes the other half).
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
  // The call check across nodes (coll/moe_net.cuh, "call check"): this call's word (0: unchecked, as
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

}  // namespace doorbell
