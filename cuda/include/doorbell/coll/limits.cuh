// doorbell device API, coll tier: the sizes and limits of doorbell's collectives and MoE paths
// that their kernels share with the host code. Each has a twin in Rust (src/device_api/limits.rs)
// that sizes an allocation or checks an argument against it; the layout probe
// (cuda/probe/layout_probe.cpp) prints them, and the layout test in src/device_api holds every
// twin equal, so neither side can change alone. It sits in coll/, not detail/, because the
// node-spanning MoE calls (coll/moe_net.cuh) are sized by moe_net::kMaxRanks; the rest serve only
// doorbell's own kernels.
#pragma once

#include <stdint.h>

namespace doorbell {

// Slots per lane in the pipelined allreduce's ring (cuda/kernels/allreduce.cu; Rust:
// collectives::allreduce::PIPE_DEPTH, which sizes the ring).
constexpr uint32_t kPipeDepth = 3;

// Local experts a rank may hold on the high-throughput path: its per-expert histograms live in
// shared memory (cuda/kernels/moe.cu; Rust: moe::ht_nvlink::MAX_LOCAL_EXPERTS, checked when the
// buffers are made).
constexpr uint32_t kHtMaxLocalExperts = 2048;

// (local expert, source rank) pairs the low-latency receive half counts in shared memory
// (cuda/kernels/moe_ll.cu; Rust: moe::ll_nvlink checks at most LL_MAX_LOCAL_EXPERTS a rank and
// MAX_RANKS ranks, whose product this is).
constexpr uint32_t kLlMaxPairs = 8192;

namespace moe_net {

// Ranks the node-spanning MoE paths address (Rust: moe::net_area::MAX_NET_RANKS, checked when
// the buffers are made).
constexpr uint32_t kMaxRanks = 64;

// A stage task of the node-spanning low-latency send builds kStageTokens messages, kStageSplit
// warps each (blocks of 256 threads); a group of a warp's 32 tokens takes kStageParts tasks, each
// announcing itself in its own word (cuda/kernels/moe_net.cu; Rust: moe::ll_net::STAGE_PARTS
// sizes those words).
constexpr uint32_t kStageTokens = 4, kStageSplit = 2, kStageParts = 32 / kStageTokens;

// (local expert, source rank) pairs a packed receive across nodes (DeepEP's layout) keeps in
// shared memory, two words each (cuda/kernels/moe_net.cu; Rust: NET_MAX_PACK_PAIRS, checked when
// the buffers are made).
constexpr uint32_t kMaxPackPairs = 4096;

}  // namespace moe_net
}  // namespace doorbell
