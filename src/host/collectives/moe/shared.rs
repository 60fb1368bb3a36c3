//! What every MoE path shares: the layer's shape ([`MoeConfig`]) and its agreement across ranks,
//! where each mode leaves its results ([`DispatchResults`], [`LowLatencyResults`]), launching a
//! kernel with its argument struct, and the receive areas the NVLink paths map. DeepEP's
//! low-latency layout, which both low-latency paths write, is in [`super::packed`].

use crate::channel::symmetric::SymmetricBuffer;
use crate::communicator::Communicator;
use crate::device_api::MAX_RANKS;
use crate::error::Result;
use crate::gpu::signature;
use cudarc::driver::{CudaFunction, CudaStream, DeviceRepr, LaunchConfig, PushKernelArg};

/// Shape of one MoE layer's exchange; the same on every rank. Built with [`MoeConfig::new`] and
/// the `with_` setters, so that later fields do not break callers:
///
/// ```
/// use doorbell::collectives::moe::MoeConfig;
/// let cfg = MoeConfig::new(7168, 8, 256, 128).with_blocks(24);
/// assert_eq!((cfg.hidden, cfg.blocks, cfg.net_chunks), (7168, Some(24), None));
/// ```
#[derive(Debug, Clone, Default)]
#[non_exhaustive]
pub struct MoeConfig {
    /// Hidden size (a multiple of 8: rows move in 16-byte words).
    pub hidden: usize,
    /// Experts each token selects.
    pub topk: usize,
    /// Experts in the layer (a multiple of the rank count; expert `e` lives on rank
    /// `e / (num_experts / world)`).
    pub num_experts: usize,
    /// Most tokens a rank dispatches per call (buffers are sized for all of them reaching one
    /// rank from every rank).
    pub max_tokens: usize,
    /// Blocks of the dispatch and combine kernels (the SMs they occupy; at least the rank count,
    /// at most the SMs and 256); default: all SMs.
    pub blocks: Option<u32>,
    /// High-throughput mode across nodes: the receive ring for each source node holds this many
    /// chunks of 32 tokens (receiver-driven admission: a sender writes a chunk only when the
    /// receiver granted its slot, so the ring may be far smaller than `max_tokens`); default 8.
    /// Unused inside one node and by the low-latency mode.
    pub net_chunks: Option<usize>,
    /// Low-latency mode on one node: also build DeepEP's layout
    /// ([`super::MoeLowLatency::dispatch_packed_raw`], [`super::MoeLowLatency::combine_packed_raw`]):
    /// each expert's rows packed from row 0 in source order, FP8 rows cast by the kernel, and a
    /// combine that returns every row unweighted to its token's rank, which applies the weights
    /// given to the combine. Costs `2 x num_experts x max_tokens x hidden x 2` bytes more per
    /// rank (the returned rows); at most 4096 experts. Default off.
    pub deep_ep_layout: bool,
    /// Low-latency mode in DeepEP's layout: a rank mask (DeepEP's `enable_shrink`), `[world]`
    /// u32 on the device, read by every call: a masked rank is sent nothing, waited for by no
    /// one, and its experts add nothing to a combine
    /// ([`super::MoeLowLatency::set_rank_masked`], [`super::MoeLowLatency::clean_rank_mask`],
    /// [`super::MoeLowLatency::rank_mask`]). Needs [`MoeConfig::deep_ep_layout`]. Default off.
    pub rank_mask: bool,
    /// High-throughput mode on one node: receive slots, each room for one dispatch's results
    /// (`world x max_tokens` rows with their ids, weights, sources and scales) and layout. A
    /// dispatch lands in the slot chosen by [`super::MoeHighThroughput::set_receive_slot`], so
    /// results of earlier dispatches in the other slots stay valid (DeepEP's API hands them out
    /// as tensors) and can still be combined. Default (0 or 1): one slot, overwritten by each
    /// dispatch.
    pub receive_slots: usize,
}

impl MoeConfig {
    /// A layer of `num_experts` experts, each token selecting `topk`, rows of `hidden` values,
    /// at most `max_tokens` tokens a rank per call; the kernels on every SM.
    pub fn new(hidden: usize, topk: usize, num_experts: usize, max_tokens: usize) -> MoeConfig {
        MoeConfig {
            hidden,
            topk,
            num_experts,
            max_tokens,
            ..Default::default()
        }
    }

    /// The kernels' blocks (see [`MoeConfig::blocks`]; `None`: every SM).
    pub fn with_blocks(mut self, blocks: impl Into<Option<u32>>) -> MoeConfig {
        self.blocks = blocks.into();
        self
    }

    /// The receive ring's chunks per source node (see [`MoeConfig::net_chunks`]; `None`: the
    /// default).
    pub fn with_net_chunks(mut self, chunks: impl Into<Option<usize>>) -> MoeConfig {
        self.net_chunks = chunks.into();
        self
    }

    /// DeepEP's low-latency layout besides doorbell's (see [`MoeConfig::deep_ep_layout`]).
    pub fn with_deep_ep_layout(mut self, on: bool) -> MoeConfig {
        self.deep_ep_layout = on;
        self
    }

    /// A rank mask (see [`MoeConfig::rank_mask`]).
    pub fn with_rank_mask(mut self, on: bool) -> MoeConfig {
        self.rank_mask = on;
        self
    }

    /// Receive slots of the high-throughput mode (see [`MoeConfig::receive_slots`]).
    pub fn with_receive_slots(mut self, slots: usize) -> MoeConfig {
        self.receive_slots = slots;
        self
    }
}

/// Where a dispatch leaves its results (device addresses owned by the [`super::MoeHighThroughput`], valid
/// until its next dispatch).
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub struct DispatchResults {
    /// `[N, hidden]` bf16 rows (e4m3 bytes after an FP8 dispatch), in source-rank order.
    pub recv_x: u64,
    /// `[N, topk]` i32: local expert ids, -1 for experts on other ranks.
    pub recv_idx: u64,
    /// `[N, topk]` f32 router weights, 0 where `recv_idx` is -1 (the expert is elsewhere).
    pub recv_weights: u64,
    /// `[N, 2]` i32: source rank and source token of each row.
    pub recv_src: u64,
    /// After [`super::MoeHighThroughput::dispatch_fp8`]: `[N, hidden / 128]` f32 scales.
    pub recv_scales: u64,
    /// One u32: N; `u32::MAX` (-1 as i32) after a dispatch that an abort cut short (every row
    /// slot is then all ones: NaN in bf16 and e4m3).
    pub num_recv: u64,
    /// `[experts per rank]` u32: rows per local expert; the top bit set (negative as i32) after a
    /// dispatch that an abort cut short. On one node right behind `num_recv` (`num_recv + 4`), so
    /// one copy reads both.
    pub expert_counts: u64,
    /// `[world, world]` i32 in the receive slot, DeepEP's `rank_prefix_matrix`: entry `[s][r]` the rows ranks 0..=s
    /// send rank r, so rank s's rows here end at `[s][rank]` (-1 everywhere after a dispatch an
    /// abort cut short); NVLink path only (0 across nodes, where rows are grouped by forwarding
    /// rank).
    pub rank_prefix: u64,
    /// Room for rows (world x max_tokens).
    pub max_rows: usize,
    /// Bytes of the receive slot these results are in, from `recv_x` (the other results lie
    /// inside it).
    pub slot_bytes: usize,
}

/// Where a low-latency dispatch leaves its results (device addresses; valid until the dispatch
/// after next).
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub struct LowLatencyResults {
    /// `[local expert][source rank][max_tokens][hidden]` bf16 rows (e4m3 bytes after
    /// [`super::MoeLowLatency::dispatch_send_fp8`]).
    pub recv_x: u64,
    /// `[local expert][source rank][max_tokens]` i32: the source token of each row.
    pub recv_src: u64,
    /// `[local expert][source rank][max_tokens]` f32: the weight of each row's selection.
    pub recv_weights: u64,
    /// After [`super::MoeLowLatency::dispatch_send_fp8`]: `[local expert][source rank][max_tokens]
    /// [hidden / 128]` f32 scales of the rows (0 on the NVLink path, which has no FP8 rows).
    pub recv_scales: u64,
    /// `[local expert][source rank]` u32: rows from each source.
    pub layout: u64,
    /// `[local expert]` u32: rows per local expert; `u32::MAX` (-1 as i32) in every entry after
    /// a dispatch that an abort cut short (the layout is then all 0 and, inside a node, every row
    /// of the half all ones: NaN in bf16).
    pub recv_count: u64,
}

/// What the kernel of a fused dispatch receives ([`super::MoeLowLatency::begin_fused_send`]): the
/// arguments of `doorbell::moe_ll::put_token` (NVLink path) or `doorbell::moe_net::put_token`
/// (node-spanning path), from `cuda/include/doorbell/`.
#[derive(Debug, Clone, Copy)]
pub enum FusedSend {
    /// For `moe_ll::put` / `put_token` / `finish_send` (`coll/moe_ll.cuh`).
    Nvlink(crate::device_api::MoeLlArgs),
    /// For `moe_net::put_token` / `finish_send` (`coll/moe_net.cuh`).
    Net(crate::device_api::MoeNetArgs),
}

/// How a high-throughput dispatch's tokens find their ranks: by their top-k experts (ids and
/// weights travel with the rows), or by a `[num_tokens, world]` bool of destination ranks
/// (DeepEP's dispatch by `is_token_in_rank`; `tokens_per_expert` `[experts]` i32, this rank's
/// rows per expert, summed over the sources into the receivers' expert counts, or 0).
#[derive(Debug, Clone, Copy)]
pub(super) enum Route {
    TopK {
        idx: u64,
        weights: u64,
    },
    Ranks {
        in_rank: u64,
        tokens_per_expert: u64,
    },
}

/// Launches one of the MoE kernels with its argument struct (MoeArgs, MoeLlArgs or MoeNetArgs, each
/// layout-tested against the kernels') and reports a trapped wait as the timeout it was.
pub(super) fn launch<A: DeviceRepr>(
    comm: &Communicator,
    f: &CudaFunction,
    stream: &CudaStream,
    grid: u32,
    threads: u32,
    args: &A,
) -> Result<()> {
    comm.check_health()?;
    launch_unchecked(comm, f, stream, grid, threads, args)
}

/// [`launch`] without its health check, for a caller that made its own (MoE low latency with a
/// rank mask: `Communicator::check_health_tolerant`).
pub(super) fn launch_unchecked<A: DeviceRepr>(
    comm: &Communicator,
    f: &CudaFunction,
    stream: &CudaStream,
    grid: u32,
    threads: u32,
    args: &A,
) -> Result<()> {
    let mut b = stream.launch_builder(f);
    b.arg(args);
    let cfg = LaunchConfig {
        grid_dim: (grid, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: the argument struct matches the kernel's (layout-tested); every buffer it names
    // lives as long as the dispatcher that calls this; its caller vouches for per-call inputs.
    comm.cuda_result(unsafe { b.launch(cfg) }.map(|_| ()), "cuLaunchKernel")
}

/// A receive area of `bytes` followed by the call check's inbox ([`signature::INBOX_BYTES`]):
/// returns the area, every rank's copy as mapped here, and every rank's inbox.
pub(super) fn receive_area_with_inbox(
    comm: &Communicator,
    bytes: usize,
) -> Result<(SymmetricBuffer, [u64; MAX_RANKS], [u64; MAX_RANKS])> {
    let (area, ptrs) = receive_area(comm, bytes + signature::INBOX_BYTES)?;
    let inbox = area.bases_at(bytes, "the MoE exchange")?;
    Ok((area, ptrs, inbox))
}

/// Allocates `bytes` that every rank maps (collective) and returns them with every rank's copy as
/// mapped here (own at `rank`). Fails for ranks of other hosts: the NVLink paths are single-node.
pub(super) fn receive_area(
    comm: &Communicator,
    bytes: usize,
) -> Result<(SymmetricBuffer, [u64; MAX_RANKS])> {
    let area = comm.alloc_symmetric(bytes)?;
    let ptrs = area.bases("the MoE exchange")?;
    Ok((area, ptrs))
}

/// The expected dispatch layout, computed on the CPU (for tests): for each destination rank, the
/// tokens it receives from this rank in order, and this rank's count per destination.
pub fn reference_layout(
    topk_idx: &[i32],
    topk: usize,
    experts_per_rank: usize,
    world: usize,
) -> Vec<Vec<usize>> {
    let mut per_rank = vec![Vec::new(); world];
    for (t, ids) in topk_idx.chunks(topk).enumerate() {
        for (r, dest) in per_rank.iter_mut().enumerate() {
            if ids
                .iter()
                .any(|&e| e >= 0 && e as usize / experts_per_rank == r)
            {
                dest.push(t);
            }
        }
    }
    per_rank
}

/// This rank's MoE buffer as its peers must see it too: mode, path and every size the kernels'
/// waits and layouts depend on (the blocks resolved against this GPU's SMs: their signal counts
/// are per block).
pub(super) fn shape_text(mode: &str, net: bool, cfg: &MoeConfig, sms: u32) -> String {
    // net_chunks sizes only the high-throughput node-spanning path's rings.
    let chunks = match cfg.net_chunks {
        Some(c) if net && mode == "high-throughput" => format!(", net_chunks {c}"),
        _ => String::new(),
    };
    let blocks = cfg
        .blocks
        .map_or(format!("all SMs ({sms})"), |b| b.to_string());
    let layout = match (cfg.deep_ep_layout, cfg.rank_mask) {
        (true, false) if mode == "low-latency" => ", DeepEP's layout",
        (true, true) if mode == "low-latency" => ", DeepEP's layout, a rank mask",
        _ => "",
    };
    format!(
        "a {mode} MoE buffer ({} path, hidden {}, top-{} of {} experts, max_tokens {}, blocks \
         {blocks}{chunks}{layout})",
        if net { "node-spanning" } else { "NVLink" },
        cfg.hidden,
        cfg.topk,
        cfg.num_experts,
        cfg.max_tokens,
    )
}

/// Every rank builds the same MoE buffer (collective): a rank whose shape differs is named on
/// every rank with both shapes, at once, instead of kernels waiting out their budget on counts
/// and rows that never match.
pub(super) fn agree_shape(
    comm: &Communicator,
    mode: &str,
    net: bool,
    cfg: &MoeConfig,
) -> Result<()> {
    crate::collectives::agree(comm, shape_text(mode, net, cfg, comm.gpu().sm_count()?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_shape_that_differs_is_named_with_both_shapes() {
        let cfg = |hidden| MoeConfig {
            hidden,
            topk: 8,
            num_experts: 256,
            max_tokens: 128,
            ..Default::default()
        };
        let a = shape_text("high-throughput", false, &cfg(1024), 132);
        let b = shape_text("high-throughput", false, &cfg(2048), 132);
        assert_eq!(
            a,
            "a high-throughput MoE buffer (NVLink path, hidden 1024, top-8 of 256 experts, \
             max_tokens 128, blocks all SMs (132))"
        );
        let shapes = vec![
            a.clone().into_bytes(),
            b.clone().into_bytes(),
            a.clone().into_bytes(),
        ];
        for me in [0, 2] {
            let e = crate::collectives::shape_mismatch(me, &shapes)
                .unwrap()
                .to_string();
            assert_eq!(
                e,
                format!("argument mismatch: rank {me} made {a}, while rank 1 made {b}")
            );
        }
        let e = crate::collectives::shape_mismatch(1, &shapes)
            .unwrap()
            .to_string();
        assert!(
            e.contains("rank 1 made a high-throughput MoE buffer (NVLink path, hidden 2048"),
            "{e}"
        );
        assert!(e.contains("rank 0 made"), "{e}");
        assert!(
            crate::collectives::shape_mismatch(0, &[a.clone().into_bytes(), a.into_bytes()])
                .is_none()
        );
        // The mode, the path and a GPU with other SMs differ too.
        assert_ne!(
            shape_text("low-latency", false, &cfg(1024), 132),
            shape_text("high-throughput", false, &cfg(1024), 132)
        );
        assert_ne!(
            shape_text("low-latency", true, &cfg(1024), 132),
            shape_text("low-latency", false, &cfg(1024), 132)
        );
        assert_ne!(
            shape_text("low-latency", false, &cfg(1024), 114),
            shape_text("low-latency", false, &cfg(1024), 132)
        );
    }

    #[test]
    fn reference_layout_dedups_per_rank_and_skips_minus_one() {
        // 2 ranks x 2 experts; token 0 picks experts 0 and 1 (both rank 0), token 1 picks 3 and
        // -1, token 2 nothing.
        let idx = [0, 1, 3, -1, -1, -1];
        let l = reference_layout(&idx, 2, 2, 2);
        assert_eq!(l, vec![vec![0], vec![1]]);
    }
}
