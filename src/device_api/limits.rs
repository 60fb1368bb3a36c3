//! Mirrors `cuda/include/doorbell/coll/limits.cuh`: the sizes and limits doorbell's kernels share with
//! its host code. The layout test holds each equal to the header's (the layout probe prints them),
//! so neither side can change alone.

/// Slots per lane in the pipelined allreduce's ring (`kPipeDepth`); sizes the ring.
pub const PIPE_DEPTH: usize = 3;

/// Local experts a rank may hold on the high-throughput path (`kHtMaxLocalExperts`): the
/// dispatch keeps a histogram of them in shared memory.
pub const HT_MAX_LOCAL_EXPERTS: usize = 2048;

/// (local expert, source rank) pairs the low-latency receive half counts in shared memory
/// (`kLlMaxPairs`).
pub const LL_MAX_PAIRS: usize = 8192;

/// Local experts a rank may hold on the low-latency NVLink path: the pairs over the most ranks
/// ([`super::MAX_RANKS`]).
pub const LL_MAX_LOCAL_EXPERTS: usize = LL_MAX_PAIRS / super::MAX_RANKS;

/// Messages per chunk of the high-throughput network stream (`kHtChunk`, `detail/collective_args.cuh`):
/// one warp posts a chunk.
pub const HT_CHUNK: usize = 32;

/// Ranks the node-spanning MoE paths address (`moe_net::kMaxRanks`).
pub const MAX_NET_RANKS: usize = 64;

/// (local expert, source rank) pairs of DeepEP's layout across nodes (`moe_net::kMaxPackPairs`):
/// the pack kernel keeps each pair's range in shared memory.
pub const NET_MAX_PACK_PAIRS: usize = 4096;

/// Stage tasks per group of 32 tokens in the node-spanning low-latency send
/// (`moe_net::kStageParts`), each with its own word in the staging area.
pub const NET_STAGE_PARTS: usize = 8;
