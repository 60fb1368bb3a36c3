//! What every MoE path shares: the layer's shape ([`MoeConfig`]) and its agreement across ranks,
//! where each mode leaves its results ([`DispatchResults`], [`LowLatencyResults`]), launching a
//! kernel with its argument struct, and the landing areas the NVLink paths map.

use crate::channel::memory_channel::RegisteredMemory;
use crate::communicator::Communicator;
use crate::device_api::MAX_RANKS;
use crate::error::{Error, Result};
use crate::gpu::memory::Buffer;
use crate::gpu::signature;
use crate::transport::ipc::RemoteMemory;
use cudarc::driver::{CudaFunction, CudaStream, DeviceRepr, LaunchConfig, PushKernelArg};
use std::sync::Arc;

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

/// Where a low-latency dispatch in DeepEP's layout writes ([`super::MoeLowLatency::dispatch_packed_raw`];
/// device addresses of this GPU, `cap = world x max_tokens` rows per local expert), and how.
/// Built with [`PackedOutputs::new`] and the `with_` setters.
#[derive(Debug, Clone, Copy, Default)]
#[non_exhaustive]
pub struct PackedOutputs {
    /// `[local experts][cap][hidden]`: bf16 rows, or e4m3 bytes when `scales` is set; each
    /// expert's rows packed from row 0, source rank 0's first.
    pub x: u64,
    /// 0: bf16 rows. Else the rows are cast to e4m3 per 128 values (DeepEP's cast) and their
    /// scales go here, column-major per expert as DeepEP's: f32 `[local experts][hidden / 128]
    /// [cap]`, or with `ue8m0` i32 `[local experts][hidden / 512][cap]`, four exponent bytes each.
    pub scales: u64,
    /// FP8: scales rounded up to powers of two.
    pub round_scale: bool,
    /// FP8: scales as exponent bytes (needs `round_scale` and a hidden size a multiple of 512).
    pub ue8m0: bool,
    /// `[local experts][cap]` i32: each row's source token (DeepEP's `src_info`).
    pub src_info: u64,
    /// `[local experts][world]` i64: `begin << 32 | rows` of each source (DeepEP's `layout_range`).
    pub layout_range: u64,
    /// `[local experts]` i32: rows per expert; -1 after a dispatch an abort cut short (its rows
    /// and scales are then all ones: NaN).
    pub count: u64,
    /// `[local experts]` i32 the counts are added to (DeepEP's
    /// `cumulative_local_expert_recv_stats`), or 0.
    pub stats: u64,
    /// The dispatch's `topk_idx` holds int64 ids (DeepEP's `topk_idx_t`; 8-byte aligned) instead
    /// of i32: read as such, no conversion needed (an id outside -1..experts selects nothing).
    pub ids_i64: bool,
    /// `[world]` i64 (8-byte aligned) the receive half adds to, for each source rank, the SM
    /// cycles (`clock64`) it waited for that rank's counts, once per local expert (DeepEP's
    /// `dispatch_wait_recv_cost_stats`: a rank slow to send shows as a large entry), or 0.
    /// On one node only (refused by name across nodes).
    pub wait_cycles: u64,
    /// Two u64 of device memory (8-byte aligned) where the send half leaves its epoch and its
    /// call-check ordinal for the receive half, so that the receive half still pairs with its own
    /// send when another send came between them (two dispatches in flight, as DeepEP allows; their
    /// receive halves in either order); 0: the receive half pairs with the last send.
    pub ticket: u64,
}

impl PackedOutputs {
    /// bf16 rows into `x`, with `src_info`, `layout_range` and `count` (see the fields).
    pub fn new(x: u64, src_info: u64, layout_range: u64, count: u64) -> PackedOutputs {
        PackedOutputs {
            x,
            src_info,
            layout_range,
            count,
            ..Default::default()
        }
    }

    /// e4m3 rows with their scales at `scales` (see [`PackedOutputs::scales`]).
    pub fn with_fp8(mut self, scales: u64, round_scale: bool, ue8m0: bool) -> PackedOutputs {
        self.scales = scales;
        self.round_scale = round_scale;
        self.ue8m0 = ue8m0;
        self
    }

    /// Counts added to `stats` too (see [`PackedOutputs::stats`]).
    pub fn with_stats(mut self, stats: u64) -> PackedOutputs {
        self.stats = stats;
        self
    }

    /// The send half's ticket (see [`PackedOutputs::ticket`]).
    pub fn with_ticket(mut self, ticket: u64) -> PackedOutputs {
        self.ticket = ticket;
        self
    }

    /// The receive half's waits added up per source (see [`PackedOutputs::wait_cycles`]).
    pub fn with_wait_cycles(mut self, wait_cycles: u64) -> PackedOutputs {
        self.wait_cycles = wait_cycles;
        self
    }

    /// The dispatch's ids are int64 (see [`PackedOutputs::ids_i64`]).
    pub fn with_i64_ids(mut self, on: bool) -> PackedOutputs {
        self.ids_i64 = on;
        self
    }

    /// Checks the outputs for rows of `hidden` values (alignment, given arrays, a row format
    /// the hidden size allows) and returns their `packed` bits (`device_api::packed`).
    pub(super) fn bits(&self, hidden: usize) -> Result<u32> {
        use crate::device_api::packed;
        let fp8 = self.scales != 0;
        let aligned = self.x % 16 == 0
            && self.x != 0
            && self.src_info % 4 == 0
            && self.src_info != 0
            && self.layout_range % 8 == 0
            && self.layout_range != 0
            && self.count % 4 == 0
            && self.count != 0
            && self.stats % 4 == 0
            && self.ticket % 8 == 0
            && self.wait_cycles % 8 == 0
            && self.scales % 4 == 0;
        if !aligned {
            return Err(Error::invalid(
                "packed outputs",
                "x 16-byte aligned, src_info, count, stats and scales 4-byte, layout_range, \
                 ticket and wait_cycles 8-byte; x, src_info, layout_range and count given",
            ));
        }
        if (self.round_scale || self.ue8m0) && !fp8 {
            return Err(Error::invalid(
                "packed outputs",
                "round_scale and ue8m0 are for FP8 rows (give scales)",
            ));
        }
        if fp8 && hidden % 128 != 0 {
            return Err(Error::invalid(
                "packed outputs",
                format!("FP8 rows need a hidden size a multiple of 128 (it is {hidden})"),
            ));
        }
        if self.ue8m0 && (!self.round_scale || hidden % 512 != 0) {
            return Err(Error::invalid(
                "packed outputs",
                format!(
                    "ue8m0 scales need round_scale and a hidden size a multiple of 512 (it is \
                     {hidden})"
                ),
            ));
        }
        let mut bits = packed::PACKED;
        if fp8 {
            bits |= packed::FP8;
        }
        if self.round_scale {
            bits |= packed::ROUND;
        }
        if self.ue8m0 {
            bits |= packed::UE8M0;
        }
        if self.ids_i64 {
            bits |= packed::IDS64;
        }
        Ok(bits)
    }
}

/// The row format of a dispatch in DeepEP's layout ([`super::MoeLowLatency::packed_buffers`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PackedFormat {
    /// bf16 rows.
    Bf16,
    /// e4m3 rows cast by the kernel, one scale per 128 values (see [`PackedOutputs::scales`]).
    Fp8 {
        /// Scales rounded up to powers of two.
        round_scale: bool,
        /// Scales as exponent bytes (needs `round_scale`).
        ue8m0: bool,
    },
}

/// The outputs of a dispatch in DeepEP's layout, owned and sized for the exchange they came from
/// ([`super::MoeLowLatency::packed_buffers`]): what the typed
/// [`super::MoeLowLatency::dispatch_packed`] writes and [`super::MoeLowLatency::combine_packed`]
/// reads as the handle. Read through the getters (layouts as [`PackedOutputs`]'s, `cap = world
/// x max_tokens` rows per local expert); the fields stay private so that the sizes the calls
/// rely on cannot change.
#[derive(Debug)]
pub struct PackedBuffers {
    pub(super) x: cudarc::driver::CudaSlice<u8>,
    pub(super) scales: Option<cudarc::driver::CudaSlice<u8>>,
    pub(super) src_info: cudarc::driver::CudaSlice<i32>,
    pub(super) layout_range: cudarc::driver::CudaSlice<i64>,
    pub(super) count: cudarc::driver::CudaSlice<i32>,
    pub(super) ticket: cudarc::driver::CudaSlice<u64>,
    pub(super) format: PackedFormat,
}

impl PackedBuffers {
    /// `[local experts][cap][hidden]` bf16 rows or e4m3 bytes.
    pub fn x(&self) -> &cudarc::driver::CudaSlice<u8> {
        &self.x
    }
    /// FP8: the scales (see [`PackedOutputs::scales`]).
    pub fn scales(&self) -> Option<&cudarc::driver::CudaSlice<u8>> {
        self.scales.as_ref()
    }
    /// `[local experts][cap]` each row's source token.
    pub fn src_info(&self) -> &cudarc::driver::CudaSlice<i32> {
        &self.src_info
    }
    /// `[local experts][world]` `begin << 32 | rows` of each source.
    pub fn layout_range(&self) -> &cudarc::driver::CudaSlice<i64> {
        &self.layout_range
    }
    /// `[local experts]` rows per expert (-1 after a dispatch an abort cut short).
    pub fn count(&self) -> &cudarc::driver::CudaSlice<i32> {
        &self.count
    }
    /// The row format.
    pub fn format(&self) -> PackedFormat {
        self.format
    }
}

/// What a combine in DeepEP's layout reads of its dispatch (DeepEP's handle): the
/// [`PackedOutputs::src_info`] and [`PackedOutputs::layout_range`] that dispatch wrote.
#[derive(Debug, Clone, Copy, Default)]
pub struct PackedHandle {
    /// `[local experts][world x max_tokens]` i32.
    pub src_info: u64,
    /// `[local experts][world]` i64.
    pub layout_range: u64,
}

/// The halves of a combine in DeepEP's layout ([`super::MoeLowLatency::combine_packed_raw`] and
/// its halves): what the send half reads, what the receive half reads and writes, and the
/// ticket that pairs them (0: none).
#[derive(Debug, Clone, Copy)]
pub(super) struct PackedCombine {
    pub ticket: u64,
    /// The receive half's `topk_idx` holds int64 ids.
    pub ids_i64: bool,
    /// `[local experts][world x max_tokens][hidden]` bf16 expert outputs and their handle.
    pub send: Option<(u64, PackedHandle)>,
    /// `(topk_idx, topk_weights, num_tokens, out)`.
    pub recv: Option<(u64, u64, usize, u64)>,
    /// What else the call does (wait statistics, log rows).
    pub options: PackedCombineOptions,
}

/// What a DeepEP-layout combine does beyond moving and summing its rows (see
/// [`super::MoeLowLatency::combine_packed_with_raw`]). Built with [`PackedCombineOptions::new`]
/// and the `with_` setters; the default is neither.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct PackedCombineOptions {
    /// `[world]` i64 (8-byte aligned) the receive half adds to, for each source rank, the SM
    /// cycles (`clock64`) it waited for that rank's rows (DeepEP's
    /// `combine_wait_recv_cost_stats`: a rank slow to return its rows shows as a large entry),
    /// or 0. One node only (refused by name across nodes).
    pub wait_cycles: u64,
    /// The rows go back in doorbell's 10-bit log format (DeepEP's `use_logfmt`, a format of
    /// doorbell's own: each 128 values in 176 bytes instead of 256, magnitudes to within
    /// 2^(step / 2) - 1 relative, `step` the group's log2 range / 510; values more than 16
    /// octaves below a group's largest go as zero; a group with a NaN or an infinity as NaN).
    /// Every rank must agree (the call check names a mix across ranks), and so must a combine's
    /// two halves when called apart: a receive half given the other format than its send half
    /// wrote (found by ticket among the last eight sends) is refused (`InvalidArgument`) before
    /// it launches. One node only (refused by name across nodes).
    pub logfmt: bool,
}

impl PackedCombineOptions {
    /// Neither wait statistics nor log rows.
    pub fn new() -> PackedCombineOptions {
        PackedCombineOptions::default()
    }

    /// Adds the receive's waits to `wait_cycles` (see the field).
    pub fn with_wait_cycles(mut self, wait_cycles: u64) -> PackedCombineOptions {
        self.wait_cycles = wait_cycles;
        self
    }

    /// Log rows on or off (see the field).
    pub fn with_logfmt(mut self, on: bool) -> PackedCombineOptions {
        self.logfmt = on;
        self
    }
}

impl PackedCombine {
    /// Checks the send half's arguments (both paths read `x` and the handle's arrays): `x`
    /// 16-byte aligned, `src_info` 4-byte and `layout_range` 8-byte, all given.
    pub(super) fn checked_send(&self) -> Result<Option<(u64, PackedHandle)>> {
        match self.send {
            Some((y, h))
                if y % 16 != 0
                    || y == 0
                    || h.src_info % 4 != 0
                    || h.src_info == 0
                    || h.layout_range % 8 != 0
                    || h.layout_range == 0 =>
            {
                Err(Error::invalid(
                    "combine",
                    "x 16-byte aligned, the handle's src_info 4-byte and layout_range 8-byte",
                ))
            }
            send => Ok(send),
        }
    }

    /// Checks the receive half's arguments against a buffer of `max_tokens` tokens a rank:
    /// `topk_idx` aligned to its id width, `topk_weights` 4-byte, `out` 16-byte, each given
    /// when there are tokens.
    pub(super) fn checked_recv(&self, max_tokens: usize) -> Result<Option<(u64, u64, usize, u64)>> {
        let Some((topk_idx, topk_weights, num_tokens, out)) = self.recv else {
            return Ok(None);
        };
        let id_align = if self.ids_i64 { 8 } else { 4 };
        if num_tokens > max_tokens
            || topk_idx % id_align != 0
            || topk_weights % 4 != 0
            || out % 16 != 0
            || (num_tokens > 0 && (topk_idx == 0 || topk_weights == 0 || out == 0))
        {
            return Err(Error::invalid(
                "combine",
                format!(
                    "{num_tokens} tokens (at most {max_tokens}), topk_idx {id_align}-byte, \
                     topk_weights 4-byte and out 16-byte aligned"
                ),
            ));
        }
        Ok(self.recv)
    }
}

/// What the kernel of a fused dispatch receives ([`super::MoeLowLatency::begin_fused_send`]): the
/// arguments of `doorbell::moe_ll::put_token` (NVLink path) or `doorbell::moe_net::put_token`
/// (node-spanning path), from `cuda/include/doorbell/`.
#[derive(Debug, Clone, Copy)]
pub enum FusedSend {
    /// For `moe_ll::put` / `put_token` / `finish_send` (`moe.cuh`).
    Nvlink(crate::device_api::MoeLlArgs),
    /// For `moe_net::put_token` / `finish_send` (`moe_net.cuh`).
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

/// A landing area every peer maps: the buffer, its registration, the peers' mappings.
pub(super) type Landing = (
    Arc<Buffer>,
    Arc<RegisteredMemory>,
    Vec<Option<Arc<RemoteMemory>>>,
);

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
    comm.check(unsafe { b.launch(cfg) }.map(|_| ()), "cuLaunchKernel")
}

/// A landing area of `bytes` followed by the call check's inbox ([`signature::INBOX_BYTES`]):
/// returns the area, every rank's copy as mapped here, and every rank's inbox.
pub(super) fn landing_with_inbox(
    comm: &Communicator,
    bytes: usize,
) -> Result<(Landing, [u64; MAX_RANKS], [u64; MAX_RANKS])> {
    let (area, ptrs) = landing(comm, bytes + signature::INBOX_BYTES)?;
    let mut inbox = [0u64; MAX_RANKS];
    for (i, p) in inbox.iter_mut().zip(&ptrs).take(comm.world_size()) {
        *i = p + bytes as u64;
    }
    Ok((area, ptrs, inbox))
}

/// Allocates `bytes` that every rank maps (collective) and returns them with every rank's copy as
/// mapped here (own at `rank`). Fails for ranks of other hosts: the NVLink paths are single-node.
pub(super) fn landing(comm: &Communicator, bytes: usize) -> Result<(Landing, [u64; MAX_RANKS])> {
    let buf = comm.alloc(bytes)?;
    let reg = comm.register(&buf)?;
    let peers = comm.exchange(&reg)?;
    let ptrs =
        crate::collectives::mapped_bases(comm, buf.device_ptr(), &peers, "the MoE exchange")?;
    Ok(((buf, reg, peers), ptrs))
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
    fn packed_combine_halves_refuse_misaligned_or_missing_arrays() {
        let handle = PackedHandle {
            src_info: 0x1000,
            layout_range: 0x2000,
        };
        let call = |send, recv, ids_i64| PackedCombine {
            ticket: 0,
            ids_i64,
            send,
            recv,
            options: PackedCombineOptions::new(),
        };
        // Good halves pass through unchanged; absent halves are None.
        let good = call(
            Some((0x4000, handle)),
            Some((0x5000, 0x6000, 128, 0x7000)),
            true,
        );
        assert!(matches!(good.checked_send(), Ok(Some((0x4000, _)))));
        assert_eq!(
            good.checked_recv(128).unwrap(),
            Some((0x5000, 0x6000, 128, 0x7000))
        );
        assert!(call(None, None, false).checked_send().unwrap().is_none());
        assert!(call(None, None, false).checked_recv(1).unwrap().is_none());
        // Send half: x 16-byte, src_info 4-byte, layout_range 8-byte, all given.
        for (y, src_info, layout_range) in [
            (0x4008, 0x1000, 0x2000),
            (0, 0x1000, 0x2000),
            (0x4000, 0x1002, 0x2000),
            (0x4000, 0x1000, 0x2004),
            (0x4000, 0x1000, 0),
        ] {
            let h = PackedHandle {
                src_info,
                layout_range,
            };
            let e = call(Some((y, h)), None, false)
                .checked_send()
                .unwrap_err()
                .to_string();
            assert!(e.contains("x 16-byte aligned"), "{e}");
        }
        // Receive half: too many tokens, int64 ids 4-byte aligned, weights, out, missing arrays.
        let recv = |idx, w, n, out, i64| call(None, Some((idx, w, n, out)), i64).checked_recv(128);
        let e = recv(0x5000, 0x6000, 129, 0x7000, false)
            .unwrap_err()
            .to_string();
        assert!(e.contains("129 tokens (at most 128)"), "{e}");
        let e = recv(0x5004, 0x6000, 1, 0x7000, true)
            .unwrap_err()
            .to_string();
        assert!(e.contains("topk_idx 8-byte"), "{e}");
        assert!(recv(0x5004, 0x6000, 1, 0x7000, false).is_ok());
        assert!(recv(0x5000, 0x6002, 1, 0x7000, false).is_err());
        assert!(recv(0x5000, 0x6000, 1, 0x7008, false).is_err());
        assert!(recv(0, 0x6000, 1, 0x7000, false).is_err());
        assert!(recv(0, 0, 0, 0, false).is_ok(), "no tokens need no arrays");
    }

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

    #[test]
    fn packed_outputs_are_checked_before_any_launch_and_give_their_bits() {
        use crate::device_api::packed;
        let ok = PackedOutputs::new(0x1000, 0x2000, 0x3000, 0x4000);
        assert_eq!(ok.bits(512).unwrap(), packed::PACKED);
        let fp8 = ok.with_fp8(0x5000, true, true).with_i64_ids(true);
        assert_eq!(
            fp8.bits(512).unwrap(),
            packed::PACKED | packed::FP8 | packed::ROUND | packed::UE8M0 | packed::IDS64
        );
        // Each refusal names what is wrong.
        let e = |o: PackedOutputs, hidden| o.bits(hidden).unwrap_err().to_string();
        assert!(e(PackedOutputs::new(0x1008, 0x2000, 0x3000, 0x4000), 512).contains("16-byte"));
        assert!(e(PackedOutputs::new(0x1000, 0, 0x3000, 0x4000), 512).contains("given"));
        assert!(e(ok.with_ticket(0x6004), 512).contains("ticket and wait_cycles 8-byte"));
        assert!(e(ok.with_wait_cycles(0x7004), 512).contains("ticket and wait_cycles 8-byte"));
        assert_eq!(
            ok.with_wait_cycles(0x7000).bits(512).unwrap(),
            packed::PACKED
        );
        let mut no_scales = ok;
        no_scales.round_scale = true;
        assert!(e(no_scales, 512).contains("for FP8 rows"));
        assert!(e(ok.with_fp8(0x5000, false, false), 200).contains("multiple of 128"));
        assert!(e(ok.with_fp8(0x5000, false, true), 512).contains("need round_scale"));
        assert!(e(ok.with_fp8(0x5000, true, true), 384).contains("multiple of 512"));
    }
}
