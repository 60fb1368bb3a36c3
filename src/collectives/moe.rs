//! MoE expert dispatch and combine over NVLink, high-throughput layout: each token goes to every
//! destination rank once, however many of that rank's experts it selected (DeepEP's "normal"
//! semantics). Kernels and protocol: `cuda/kernels/moe.cu`.
//!
//! - [`MoeDispatcher::dispatch`] takes `x [T, H]` bf16, `topk_idx [T, K]` i32 (-1: no expert)
//!   and `topk_weights [T, K]` f32, and leaves in device memory this rank's received rows in
//!   source-rank order: `recv_x [N, H]`, `recv_idx [N, K]` (the expert ids rebased to this rank's
//!   local ids, -1 for experts elsewhere), `recv_weights [N, K]`, `recv_src [N, 2]` (source rank,
//!   source token), `num_recv` (N) and `expert_counts [E_local]`: the counts never leave the
//!   device, so the whole exchange is CUDA-graph capturable. Buffers are sized for the worst case
//!   (`max_tokens` per rank from every rank) once, in [`MoeDispatcher::new`].
//! - [`MoeDispatcher::combine`] takes `y [N, H]` bf16, row `i` being what this rank's experts made
//!   of received row `i`, already weighted and summed over this rank's experts of that token (an
//!   expert GEMM's epilogue multiplies by `recv_weights`), and returns `out [T, H]`: for each
//!   token, the sum over the ranks it went to, so `out[t] = sum_k w[t,k] expert_k(x[t])`. Sums run
//!   in f32 in rank order (deterministic).
//!
//! - [`MoeDispatcher::dispatch_fp8`] moves e4m3 rows with one f32 scale per 128 values instead
//!   (the caller casts, as with DeepEP's normal kernels); combine stays bf16.
//!
//! Not yet: the low-latency (decode) layout with per-expert buffers and separate send/receive
//! halves, device-side entry points for fused kernels.

use crate::channel::memory_channel::RegisteredMemory;
use crate::channel::semaphore::Semaphores;
use crate::communicator::Communicator;
use crate::device_api::{CallCheck, MoeArgs, MAX_RANKS};
use crate::error::{Error, Result};
use crate::gpu::cuda::cuda_err;
use crate::gpu::memory::Buffer;
use crate::gpu::signature::{self, CallChecker, CallKind};
use crate::job::config::Settings;
use crate::transport::ipc::RemoteMemory;
use cudarc::driver::{
    CudaFunction, CudaSlice, CudaStream, DevicePtr, DeviceRepr, LaunchConfig, PushKernelArg,
};
use std::sync::Arc;

/// Shape of one MoE layer's exchange; the same on every rank.
#[derive(Debug, Clone, Default)]
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
}

/// Dispatch/combine state of one communicator. Build it once (collective); call dispatch then
/// combine, in the same order on every rank.
///
/// When the communicator spans nodes (of equal size), the node-spanning path runs instead
/// (DeepEP's hierarchical scheme, `moe_ll_net`): a token crosses the network once per
/// destination node, to the rank of the same local index there, which forwards it inside its
/// node with this NVLink exchange; the combine sums inside the node first and sends one row per
/// (token, node) back. Same results, except that rows arrive grouped by forwarding rank (then
/// by source node and token), not in source-rank order (`recv_src` names each row's origin), and
/// the combine adds the ranks' outputs in rank order inside each node, then the nodes' sums in
/// node order.
pub struct MoeDispatcher {
    path: HtPath,
}

enum HtPath {
    Nvlink(Box<HtNvlink>),
    Net(Box<super::moe_ht_net::HtNet>),
}

impl MoeDispatcher {
    /// Allocates the landing areas (mapped by every same-node peer; on the node-spanning path
    /// also registered with the NIC), outputs and semaphores. Collective.
    pub fn new(comm: &Arc<Communicator>, cfg: MoeConfig) -> Result<MoeDispatcher> {
        let ids = comm.node_ids();
        let spans = ids.iter().any(|id| *id != ids[comm.rank()]);
        agree_shape(comm, "high-throughput", spans, &cfg)?;
        let path = if spans {
            HtPath::Net(Box::new(super::moe_ht_net::HtNet::new(comm, &cfg)?))
        } else {
            HtPath::Nvlink(Box::new(HtNvlink::new(comm, cfg)?))
        };
        Ok(MoeDispatcher { path })
    }

    /// Whether the node-spanning path runs.
    pub fn spans_nodes(&self) -> bool {
        matches!(self.path, HtPath::Net(_))
    }

    /// Node-spanning path: the device address of `[nodes]` u32, the rows each node's rank of
    /// this rank's local index sent here over the network in the last dispatch (each token at
    /// most once), and the node count.
    pub fn network_rows(&self) -> Option<(u64, usize)> {
        match &self.path {
            HtPath::Nvlink(_) => None,
            HtPath::Net(p) => Some(p.network_rows()),
        }
    }

    /// Node-spanning path: bytes of this rank's network receive rings (every source node's),
    /// and what rings sized for the worst case (`max_tokens` tokens from every node) would take.
    pub fn network_ring_bytes(&self) -> Option<(u64, u64)> {
        match &self.path {
            HtPath::Nvlink(_) => None,
            HtPath::Net(p) => Some(p.ring_bytes()),
        }
    }

    /// Dispatches `num_tokens` tokens (see the module documentation).
    ///
    /// # Safety
    /// `x` holds `num_tokens * hidden` bf16 (16-byte aligned), `topk_idx` and `topk_weights`
    /// `num_tokens * topk` i32 / f32, device memory of this GPU valid until the work on `stream`
    /// completes; every id is -1 or below `num_experts`.
    pub unsafe fn dispatch(
        &self,
        stream: &CudaStream,
        x: u64,
        topk_idx: u64,
        topk_weights: u64,
        num_tokens: usize,
    ) -> Result<()> {
        match &self.path {
            // SAFETY: as documented.
            HtPath::Nvlink(p) => unsafe {
                p.dispatch(stream, x, topk_idx, topk_weights, num_tokens)
            },
            HtPath::Net(p) => p.dispatch(stream, x, 0, topk_idx, topk_weights, num_tokens),
        }
    }

    /// Dispatches FP8 tokens (see [`HtNvlink`]'s contract, the same on both paths): `x` holds
    /// e4m3 bytes `[num_tokens, hidden]` and `scales` one f32 per 128 values; rows arrive as
    /// bytes in `recv_x` and the scales in [`DispatchResults::recv_scales`]. Combine stays bf16.
    ///
    /// # Safety
    /// `x` holds `num_tokens * hidden` bytes (16-byte aligned), `scales` `num_tokens * hidden /
    /// 128` f32, the top-k arrays as for [`MoeDispatcher::dispatch`]; all valid until the work on
    /// `stream` completes.
    pub unsafe fn dispatch_fp8(
        &self,
        stream: &CudaStream,
        x: u64,
        scales: u64,
        topk_idx: u64,
        topk_weights: u64,
        num_tokens: usize,
    ) -> Result<()> {
        match &self.path {
            // SAFETY: as documented.
            HtPath::Nvlink(p) => unsafe {
                p.dispatch_fp8(stream, x, scales, topk_idx, topk_weights, num_tokens)
            },
            HtPath::Net(p) => {
                if self.config().hidden % 128 != 0 || scales == 0 || scales % 4 != 0 {
                    return Err(Error::invalid(
                        "dispatch_fp8",
                        "a hidden size that is a multiple of 128 and 4-byte aligned scales",
                    ));
                }
                p.dispatch(stream, x, scales, topk_idx, topk_weights, num_tokens)
            }
        }
    }

    /// Combines `y` (one row per received row of the last dispatch) into `out [num_tokens, H]`
    /// (see the module documentation).
    ///
    /// # Safety
    /// `y` holds at least `num_recv * hidden` bf16 and `out` `num_tokens * hidden` bf16 of the
    /// last dispatch (both 16-byte aligned), device memory of this GPU valid until the work on
    /// `stream` completes (or `y` is [`MoeDispatcher::combine_buffer`]).
    pub unsafe fn combine(&self, stream: &CudaStream, y: u64, out: u64) -> Result<()> {
        match &self.path {
            // SAFETY: as documented.
            HtPath::Nvlink(p) => unsafe { p.combine(stream, y, out) },
            HtPath::Net(p) => p.combine(stream, y, out),
        }
    }

    /// This rank's combine buffer (rows aligned with `recv_x`); see [`HtNvlink`]'s contract.
    pub fn combine_buffer(&self) -> u64 {
        match &self.path {
            HtPath::Nvlink(p) => p.combine_buffer(),
            HtPath::Net(p) => p.combine_buffer(),
        }
    }

    /// Device addresses of the last dispatch's results (read them after the stream's work
    /// finished).
    pub fn results(&self) -> DispatchResults {
        match &self.path {
            HtPath::Nvlink(p) => p.results(),
            HtPath::Net(p) => p.results(),
        }
    }

    /// The configuration.
    pub fn config(&self) -> &MoeConfig {
        match &self.path {
            HtPath::Nvlink(p) => p.config(),
            HtPath::Net(p) => p.config(),
        }
    }

    /// SMs the send and receive kernels occupy.
    pub fn sms(&self) -> u32 {
        match &self.path {
            HtPath::Nvlink(p) => p.sms(),
            HtPath::Net(p) => p.sms(),
        }
    }
}

/// The NVLink path of [`MoeDispatcher`] (every rank on one node).
struct HtNvlink {
    comm: Arc<Communicator>,
    cfg: MoeConfig,
    base: MoeArgs,
    blocks: u32,
    last_tokens: std::sync::atomic::AtomicU32,
    /// Counts calls and makes each call's word (the call check, `call_check.cuh`).
    calls: CallChecker,
    kernels: [CudaFunction; 2],
    _recv: (
        Arc<Buffer>,
        Arc<RegisteredMemory>,
        Vec<Option<Arc<RemoteMemory>>>,
    ),
    _comb: (
        Arc<Buffer>,
        Arc<RegisteredMemory>,
        Vec<Option<Arc<RemoteMemory>>>,
    ),
    _semaphores: Semaphores,
    _device: Vec<CudaSlice<u8>>,
}

/// A landing area every peer maps: the buffer, its registration, the peers' mappings.
type Landing = (
    Arc<Buffer>,
    Arc<RegisteredMemory>,
    Vec<Option<Arc<RemoteMemory>>>,
);

/// Allocates `bytes` that every rank maps (collective) and returns them with every rank's copy as
/// mapped here (own at `rank`). Fails for ranks of other hosts: the MoE paths are single-node.
/// Launches one of the MoE kernels with its argument struct (MoeArgs or MoeLlArgs, both
/// layout-tested against the kernels') and reports a trapped wait as the timeout it was.
/// Call-count slots of the high-throughput kernels (`kDispatchCalls` .. `kSentBlocks` in moe.cu):
/// four per-block sets of 256, then two GPU-wide counts.
const HT_CALL_SLOTS: usize = 1026;

pub(super) fn launch<A: DeviceRepr>(
    comm: &Communicator,
    f: &CudaFunction,
    stream: &CudaStream,
    grid: u32,
    threads: u32,
    args: &A,
) -> Result<()> {
    comm.check_health()?;
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
fn landing_with_inbox(
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

fn landing(comm: &Communicator, bytes: usize) -> Result<(Landing, [u64; MAX_RANKS])> {
    let buf = comm.alloc(bytes)?;
    let reg = comm.register(&buf)?;
    let peers = comm.exchange(&reg)?;
    let ptrs = super::mapped_bases(comm, buf.device_ptr(), &peers, "the MoE exchange")?;
    Ok(((buf, reg, peers), ptrs))
}

impl HtNvlink {
    /// Allocates the landing areas (mapped by every peer), outputs and semaphores. Collective.
    pub fn new(comm: &Arc<Communicator>, cfg: MoeConfig) -> Result<HtNvlink> {
        let world = comm.world_size();
        let rank = comm.rank();
        if world > MAX_RANKS {
            return Err(Error::invalid(
                "world size",
                format!("{world} ranks: at most {MAX_RANKS} on one node"),
            ));
        }
        if cfg.hidden == 0 || cfg.hidden % 8 != 0 {
            return Err(Error::invalid("hidden", "must be a positive multiple of 8"));
        }
        if cfg.topk == 0 || cfg.topk > 32 {
            return Err(Error::invalid("topk", "must be in 1..=32"));
        }
        if cfg.num_experts == 0 || cfg.num_experts % world != 0 || cfg.num_experts / world > 2048 {
            return Err(Error::invalid(
                "num_experts",
                format!(
                    "{}: must be a positive multiple of {world} ranks, at most 2048 per rank",
                    cfg.num_experts
                ),
            ));
        }
        if cfg.max_tokens == 0
            || cfg.max_tokens > i32::MAX as usize / world
            || (cfg.max_tokens as u64) * (cfg.hidden as u64 / 8) >= 1 << 32
        {
            return Err(Error::invalid(
                "max_tokens",
                "must be positive, with max_tokens x world below 2^31 and max_tokens x hidden / 8 \
                 below 2^32",
            ));
        }
        let gpu = comm.gpu().clone();
        let sms = gpu.sm_count()?;
        let blocks = cfg.blocks.unwrap_or(sms);
        if blocks < world as u32 || blocks > sms || blocks > 256 {
            return Err(Error::invalid(
                "blocks",
                format!(
                    "{blocks}: must be in {world}..={} (every block must be resident at once; \
                     the first {world} lay out one destination rank each)",
                    sms.min(256)
                ),
            ));
        }
        let rows = world * cfg.max_tokens;
        let section = |bytes: usize| bytes.next_multiple_of(256);
        let off_idx = section(rows * cfg.hidden * 2);
        let off_weights = off_idx + section(rows * cfg.topk * 4);
        let off_src = off_weights + section(rows * cfg.topk * 4);
        let off_matrix = off_src + section(rows * 8);
        // Two count matrices of u64 words, for calls of alternating parity (moe.cu).
        let off_scales = off_matrix + section(2 * world * world * 8);
        let land_bytes = off_scales + section(rows * (cfg.hidden / 128) * 4);
        let (recv, land_ptrs, inbox) = landing_with_inbox(comm, land_bytes)?;
        let (comb, comb_ptrs) = landing(comm, rows * cfg.hidden * 2)?;
        let semaphores = comm.semaphores(3)?;
        let stream = gpu.new_stream()?;
        let alloc = |bytes: usize| -> Result<CudaSlice<u8>> {
            stream
                .alloc_zeros::<u8>(bytes.max(16))
                .map_err(cuda_err("cuMemAlloc"))
        };
        let sems_bytes: &[u8] = bytemuck::cast_slice(semaphores.handles());
        let sems = stream
            .clone_htod(sems_bytes)
            .map_err(cuda_err("cuMemcpyHtoD"))?;
        let device = vec![
            alloc(cfg.max_tokens * world * 4)?,  // pos
            alloc(4)?,                           // num_recv
            alloc(cfg.num_experts / world * 4)?, // expert_counts
            alloc(HT_CALL_SLOTS * 8)?,           // call counts per kernel and block (moe.cu)
            sems,
        ];
        let p = |i: usize| device[i].device_ptr(&stream).0;
        let base = MoeArgs {
            hidden: cfg.hidden as u32,
            topk: cfg.topk as u32,
            experts_per_rank: (cfg.num_experts / world) as u32,
            max_tokens: cfg.max_tokens as u32,
            rank: rank as u32,
            world: world as u32,
            blocks,
            land: land_ptrs,
            comb_buf: comb_ptrs,
            off_idx: off_idx as u64,
            off_weights: off_weights as u64,
            off_src: off_src as u64,
            off_matrix: off_matrix as u64,
            off_scales: off_scales as u64,
            pos: p(0),
            num_recv: p(1),
            expert_counts: p(2),
            calls: p(3),
            sems: p(4),
            ..Default::default()
        };
        stream
            .synchronize()
            .map_err(cuda_err("cuStreamSynchronize"))?;
        let k = |name: &str| gpu.function("moe", name);
        let kernels = [k("moe_dispatch")?, k("moe_combine")?];
        comm.bootstrap().barrier()?;
        Ok(HtNvlink {
            comm: comm.clone(),
            cfg,
            base,
            blocks,
            last_tokens: std::sync::atomic::AtomicU32::new(0),
            calls: CallChecker::new(
                inbox,
                Settings::from_env()?.call_check,
                comm.bootstrap().call_counter(),
            ),
            kernels,
            _recv: recv,
            _comb: comb,
            _semaphores: semaphores,
            _device: device,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &MoeConfig {
        &self.cfg
    }

    /// SMs the send and receive kernels occupy.
    pub fn sms(&self) -> u32 {
        self.blocks
    }

    fn launch(
        &self,
        stream: &CudaStream,
        k: usize,
        grid: u32,
        threads: u32,
        args: &MoeArgs,
    ) -> Result<()> {
        launch(&self.comm, &self.kernels[k], stream, grid, threads, args)
    }

    /// Dispatches `num_tokens` tokens (see the module documentation).
    ///
    /// # Safety
    /// `x` holds `num_tokens * hidden` bf16 (16-byte aligned), `topk_idx` and `topk_weights`
    /// `num_tokens * topk` i32 / f32, device memory of this GPU valid until the work on `stream`
    /// completes; every id is -1 or below `num_experts`.
    pub unsafe fn dispatch(
        &self,
        stream: &CudaStream,
        x: u64,
        topk_idx: u64,
        topk_weights: u64,
        num_tokens: usize,
    ) -> Result<()> {
        // SAFETY: as documented; the caller vouches for the buffers.
        unsafe { self.dispatch_with(stream, x, 0, topk_idx, topk_weights, num_tokens) }
    }

    unsafe fn dispatch_with(
        &self,
        stream: &CudaStream,
        x: u64,
        scales: u64,
        topk_idx: u64,
        topk_weights: u64,
        num_tokens: usize,
    ) -> Result<()> {
        if num_tokens > self.cfg.max_tokens {
            return Err(Error::invalid(
                "num_tokens",
                format!("{num_tokens} exceeds max_tokens {}", self.cfg.max_tokens),
            ));
        }
        if x % 16 != 0 || topk_idx % 4 != 0 || topk_weights % 4 != 0 {
            return Err(Error::invalid(
                "buffers",
                "x must be 16-byte aligned, the top-k arrays 4-byte",
            ));
        }
        self.last_tokens
            .store(num_tokens as u32, std::sync::atomic::Ordering::Relaxed);
        // Token counts differ by rank; the word names the call and its element type.
        let dtype = if scales == 0 { 0 } else { signature::E4M3 };
        let args = MoeArgs {
            x,
            scales,
            topk_idx,
            topk_weights,
            num_tokens: num_tokens as u32,
            call: self.calls.next(
                CallKind::MoeDispatch,
                dtype,
                0,
                0,
                0,
                signature::capturing(stream),
            ),
            ..self.base
        };
        self.launch(stream, 0, self.blocks, 512, &args)
    }

    /// Dispatches FP8 tokens: `x` holds e4m3 bytes `[num_tokens, hidden]` and `scales` one f32
    /// per 128 values (`[num_tokens, hidden / 128]`), cast by the caller (DeepEP's normal-mode
    /// convention). The rows arrive as bytes in `recv_x` (`[N, hidden]` e4m3) and the scales in
    /// [`DispatchResults::recv_scales`]; everything else as for [`MoeDispatcher::dispatch`]. Half
    /// the bytes of bf16 cross NVLink. Combine stays bf16.
    ///
    /// # Safety
    /// `x` holds `num_tokens * hidden` bytes (16-byte aligned), `scales` `num_tokens * hidden /
    /// 128` f32, the top-k arrays as for [`MoeDispatcher::dispatch`]; all valid until the work on
    /// `stream` completes.
    pub unsafe fn dispatch_fp8(
        &self,
        stream: &CudaStream,
        x: u64,
        scales: u64,
        topk_idx: u64,
        topk_weights: u64,
        num_tokens: usize,
    ) -> Result<()> {
        if self.cfg.hidden % 128 != 0 {
            return Err(Error::invalid(
                "hidden",
                format!(
                    "{}: FP8 dispatch needs a multiple of 128 (one scale per 128 values)",
                    self.cfg.hidden
                ),
            ));
        }
        if scales == 0 || scales % 4 != 0 {
            return Err(Error::invalid(
                "scales",
                "must be a 4-byte aligned device address",
            ));
        }
        // SAFETY: as documented; the caller vouches for the buffers.
        unsafe { self.dispatch_with(stream, x, scales, topk_idx, topk_weights, num_tokens) }
    }

    /// Combines `y` (one row per received row of the last dispatch) into `out [num_tokens, H]`
    /// (see the module documentation).
    ///
    /// # Safety
    /// `y` holds at least `num_recv * hidden` bf16 and `out` `num_tokens * hidden` bf16 of the
    /// last dispatch (both 16-byte aligned), device memory of this GPU valid until the work on
    /// `stream` completes (or `y` is [`MoeDispatcher::combine_buffer`]).
    pub unsafe fn combine(&self, stream: &CudaStream, y: u64, out: u64) -> Result<()> {
        if y % 16 != 0 || out % 16 != 0 {
            return Err(Error::invalid(
                "buffers",
                "y and out must be 16-byte aligned",
            ));
        }
        let args = MoeArgs {
            y,
            out,
            num_tokens: self.last_tokens.load(std::sync::atomic::Ordering::Relaxed),
            call: self.calls.next(
                CallKind::MoeCombine,
                0,
                0,
                0,
                0,
                signature::capturing(stream),
            ),
            ..self.base
        };
        self.launch(stream, 1, self.blocks, 512, &args)
    }

    /// This rank's combine buffer (`[world * max_tokens, hidden]` bf16, rows aligned with
    /// `recv_x`), mapped by every peer. Expert kernels may write their outputs here directly and
    /// pass it as `y` to [`MoeDispatcher::combine`], which then skips copying them in; write it
    /// only after a dispatch (a peer may still be reading it until then).
    pub fn combine_buffer(&self) -> u64 {
        self.base.comb_buf[self.comm.rank()]
    }

    /// Device addresses of the last dispatch's results: recv_x, recv_idx, recv_weights, recv_src,
    /// num_recv, expert_counts (read them after the stream's work finished).
    pub fn results(&self) -> DispatchResults {
        let land = self.base.land[self.comm.rank()];
        DispatchResults {
            recv_x: land,
            recv_idx: land + self.base.off_idx,
            recv_weights: land + self.base.off_weights,
            recv_src: land + self.base.off_src,
            recv_scales: land + self.base.off_scales,
            num_recv: self.base.num_recv,
            expert_counts: self.base.expert_counts,
            max_rows: self.comm.world_size() * self.cfg.max_tokens,
        }
    }
}

/// Where a dispatch leaves its results (device addresses owned by the [`MoeDispatcher`], valid
/// until its next dispatch).
#[derive(Debug, Clone, Copy)]
pub struct DispatchResults {
    /// `[N, hidden]` bf16 rows (e4m3 bytes after an FP8 dispatch), in source-rank order.
    pub recv_x: u64,
    /// `[N, topk]` i32: local expert ids, -1 for experts on other ranks.
    pub recv_idx: u64,
    /// `[N, topk]` f32 router weights.
    pub recv_weights: u64,
    /// `[N, 2]` i32: source rank and source token of each row.
    pub recv_src: u64,
    /// After [`MoeDispatcher::dispatch_fp8`]: `[N, hidden / 128]` f32 scales.
    pub recv_scales: u64,
    /// One u32: N; `u32::MAX` (-1 as i32) after a dispatch that an abort cut short (every row
    /// slot is then all ones: NaN in bf16 and e4m3).
    pub num_recv: u64,
    /// `[experts per rank]` u32: rows per local expert; the top bit set (negative as i32) after a
    /// dispatch that an abort cut short.
    pub expert_counts: u64,
    /// Room for rows (world x max_tokens).
    pub max_rows: usize,
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
fn shape_text(mode: &str, net: bool, cfg: &MoeConfig, sms: u32) -> String {
    // net_chunks sizes only the high-throughput node-spanning path's rings.
    let chunks = match cfg.net_chunks {
        Some(c) if net && mode == "high-throughput" => format!(", net_chunks {c}"),
        _ => String::new(),
    };
    let blocks = cfg
        .blocks
        .map_or(format!("all SMs ({sms})"), |b| b.to_string());
    format!(
        "a {mode} MoE buffer ({} path, hidden {}, top-{} of {} experts, max_tokens {}, blocks \
         {blocks}{chunks})",
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
fn agree_shape(comm: &Communicator, mode: &str, net: bool, cfg: &MoeConfig) -> Result<()> {
    super::agree(comm, shape_text(mode, net, cfg, comm.gpu().sm_count()?))
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

/// MoE dispatch and combine for decode (low latency), DeepEP's low-latency semantics: fixed
/// worst-case buffers sized from `max_tokens` per rank, a per-expert layout with one row per
/// selected (token, expert), counts only on the device, no count exchange before rows move,
/// CUDA-graph capturable, and send and receive halves callable separately so other work overlaps
/// the transfer. Kernels and protocol: `cuda/kernels/moe_ll.cu` and `doorbell/moe.cuh`.
///
/// Over NVLink a token's row crosses once per destination rank, however many of that rank's
/// experts it selected, and the receive half copies it into the other selections' slots as soon
/// as the sender announces it (in [`MoeLowLatency::dispatch`], half of each block's warps copy
/// while the other half send); the
/// combine sums each rank's selections of a token there (weight x output, f32 in top-k order,
/// rounded to bf16) and sends that one partial sum back, where the token's rank adds the partial
/// sums in rank order (f32, rounded to bf16).
///
/// After a dispatch, rows sit at `[local expert][source rank][i]` for `i < layout[expert][source]`
/// (see [`LowLatencyResults`]), in the half of the receive area the dispatch's epoch picks: two
/// results may be alive at once. Expert kernels write their outputs for those rows at the same
/// places of [`MoeLowLatency::combine_buffer`]; [`MoeLowLatency::combine`] then returns, for each
/// token, the sum over its experts of weight x output, with the weights given to the dispatch.
/// A token's experts must be distinct (a kernel reports an expert given more rows from one rank
/// than `max_tokens`).
///
/// When the communicator spans nodes (or with `DOORBELL_MOE_NET=1`), the node-spanning path runs
/// instead (`moe_ll_net`, `cuda/include/doorbell/moe_net.cuh`): a token's row goes to each rank
/// holding one of its experts once, by NVLink stores inside the node and PortChannel puts (RDMA
/// WRITEs in any posting mode) to other nodes, and the receive half copies it into each selected
/// expert's slot; same layouts, same combine sums, and FP8 rows
/// ([`MoeLowLatency::dispatch_send_fp8`]).
pub struct MoeLowLatency {
    path: LlPath,
}

enum LlPath {
    Nvlink(Box<LlNvlink>),
    Net(Box<super::moe_ll_net::LlNet>),
}

/// What the kernel of a fused dispatch receives ([`MoeLowLatency::begin_fused_send`]): the
/// arguments of `doorbell::moe_ll::put_token` (NVLink path) or `doorbell::moe_net::put_token`
/// (node-spanning path), from `cuda/include/doorbell/`.
#[derive(Debug, Clone, Copy)]
pub enum FusedSend {
    /// For `moe_ll::put` / `put_token` / `finish_send` (`moe.cuh`).
    Nvlink(crate::device_api::MoeLlArgs),
    /// For `moe_net::put_token` / `finish_send` (`moe_net.cuh`).
    Net(crate::device_api::MoeNetArgs),
}

impl MoeLowLatency {
    /// Allocates the receive areas and combine buffers (mapped by every same-node peer, and on
    /// the node-spanning path registered with the NIC). Collective. `cfg.max_tokens` is the
    /// decode batch per rank (DeepEP recommends under 256).
    pub fn new(comm: &Arc<Communicator>, cfg: MoeConfig) -> Result<MoeLowLatency> {
        let ids = comm.node_ids();
        let spans = ids.iter().any(|id| *id != ids[comm.rank()]);
        let net = spans || Settings::from_env()?.moe_net;
        agree_shape(comm, "low-latency", net, &cfg)?;
        let path = if net {
            LlPath::Net(Box::new(super::moe_ll_net::LlNet::new(comm, &cfg)?))
        } else {
            LlPath::Nvlink(Box::new(LlNvlink::new(comm, cfg)?))
        };
        Ok(MoeLowLatency { path })
    }

    /// Whether the node-spanning path runs (NVLink stores to same-node ranks, the network to
    /// the others).
    pub fn spans_nodes(&self) -> bool {
        matches!(self.path, LlPath::Net(_))
    }

    /// The send half of a dispatch: rows leave for their experts' ranks; returns once queued.
    /// Call [`MoeLowLatency::dispatch_recv`] (on this or another stream ordered after it) before
    /// reading the results. No SM is held between the halves.
    ///
    /// # Safety
    /// `x` holds `num_tokens * hidden` bf16 (16-byte aligned), `topk_idx` `num_tokens * topk`
    /// i32 (-1 or below `num_experts`, a token's experts distinct) and `topk_weights` as many
    /// f32 (the weights the combine applies), device memory of this GPU valid until the work on
    /// `stream` completes; `topk_idx` also until the matching combine has run.
    pub unsafe fn dispatch_send(
        &self,
        stream: &CudaStream,
        x: u64,
        topk_idx: u64,
        topk_weights: u64,
        num_tokens: usize,
    ) -> Result<()> {
        match &self.path {
            // SAFETY: as documented; the caller vouches for the buffers.
            LlPath::Nvlink(p) => unsafe {
                p.dispatch_send(stream, x, topk_idx, topk_weights, num_tokens)
            },
            LlPath::Net(p) => {
                let graph = signature::capturing(stream);
                let args = p.prepare_send(x, 0, topk_idx, topk_weights, num_tokens, graph)?;
                p.dispatch_send(stream, &args)
            }
        }
    }

    /// The send half of an FP8 dispatch (node-spanning path): `x` holds e4m3 bytes `[num_tokens,
    /// hidden]` and `scales` one f32 per 128 values (`[num_tokens, hidden / 128]`), cast by the
    /// caller as for [`crate::collectives::moe::MoeDispatcher::dispatch_fp8`]. Rows arrive as
    /// e4m3 bytes in [`LowLatencyResults::recv_x`] (`hidden` bytes each) with their scales in
    /// [`LowLatencyResults::recv_scales`]; half the bytes of bf16 cross the wire. The combine
    /// stays bf16.
    ///
    /// # Safety
    /// `x` holds `num_tokens * hidden` bytes (16-byte aligned), `scales` `num_tokens * hidden /
    /// 128` f32, the top-k arrays as for [`MoeLowLatency::dispatch_send`]; all valid until the
    /// work on `stream` completes.
    pub unsafe fn dispatch_send_fp8(
        &self,
        stream: &CudaStream,
        x: u64,
        scales: u64,
        topk_idx: u64,
        topk_weights: u64,
        num_tokens: usize,
    ) -> Result<()> {
        match &self.path {
            LlPath::Nvlink(_) => Err(Error::invalid(
                "dispatch_send_fp8",
                "FP8 rows take the node-spanning path: on one node set DOORBELL_MOE_NET=1",
            )),
            LlPath::Net(p) => {
                if scales == 0 {
                    return Err(Error::invalid("scales", "a device address is needed"));
                }
                let graph = signature::capturing(stream);
                let args = p.prepare_send(x, scales, topk_idx, topk_weights, num_tokens, graph)?;
                p.dispatch_send(stream, &args)
            }
        }
    }

    /// Prepares a dispatch whose send half runs in the caller's own kernel (fused dispatch):
    /// launches nothing, and returns that kernel's arguments (see [`FusedSend`] and the headers'
    /// top comments). Every token (NVLink path: every (token, rank) pair) of the `num_tokens`
    /// must be put exactly once, and every block of the kernel must call `finish_send` once
    /// after its puts: the counts go out when the last one is done (a missing one makes the
    /// receivers' bounded waits report). Then call [`MoeLowLatency::dispatch_recv`].
    ///
    /// # Safety
    /// `topk_idx` and `topk_weights` as for [`MoeLowLatency::dispatch_send`].
    pub unsafe fn begin_fused_send(
        &self,
        topk_idx: u64,
        topk_weights: u64,
        num_tokens: usize,
    ) -> Result<FusedSend> {
        match &self.path {
            // SAFETY: as documented.
            LlPath::Nvlink(p) => unsafe { p.begin_fused_send(topk_idx, topk_weights, num_tokens) }
                .map(FusedSend::Nvlink),
            LlPath::Net(p) => p
                .prepare_send(0, 0, topk_idx, topk_weights, num_tokens, false)
                .map(FusedSend::Net),
        }
    }

    /// The receive half: waits until every rank's rows of this dispatch have arrived, puts each
    /// row into the slots of its token's selections here, and writes the per-(expert, source)
    /// and per-expert counts.
    pub fn dispatch_recv(&self, stream: &CudaStream) -> Result<()> {
        match &self.path {
            LlPath::Nvlink(p) => p.dispatch_recv(stream),
            LlPath::Net(p) => p.dispatch_recv(stream),
        }
    }

    /// Both halves (one kernel on the NVLink path, two launches on the node-spanning path).
    ///
    /// # Safety
    /// As for [`MoeLowLatency::dispatch_send`].
    pub unsafe fn dispatch(
        &self,
        stream: &CudaStream,
        x: u64,
        topk_idx: u64,
        topk_weights: u64,
        num_tokens: usize,
    ) -> Result<()> {
        match &self.path {
            // SAFETY: as documented.
            LlPath::Nvlink(p) => unsafe {
                p.dispatch(stream, x, topk_idx, topk_weights, num_tokens)
            },
            LlPath::Net(p) => {
                let graph = signature::capturing(stream);
                let args = p.prepare_send(x, 0, topk_idx, topk_weights, num_tokens, graph)?;
                p.dispatch_send(stream, &args)?;
                p.dispatch_recv(stream)
            }
        }
    }

    /// Where the last dispatch issued from the host left its results (the half its epoch
    /// picked). Replays of a captured dispatch alternate halves too: use
    /// [`MoeLowLatency::results_of`] with the number of dispatches executed so far.
    pub fn results(&self) -> LowLatencyResults {
        match &self.path {
            LlPath::Nvlink(p) => p.results(),
            LlPath::Net(p) => p.results_of(p.dispatches()),
        }
    }

    /// Where the `n`-th dispatch (counting from 1, replays included) left its results.
    pub fn results_of(&self, n: u64) -> LowLatencyResults {
        match &self.path {
            LlPath::Nvlink(p) => p.results_of(n),
            LlPath::Net(p) => p.results_of(n),
        }
    }

    /// This rank's combine buffer: `[local expert][source rank][max_tokens][hidden]` bf16, the
    /// receive layout; expert kernels write each row's output at its row's place.
    pub fn combine_buffer(&self) -> u64 {
        match &self.path {
            LlPath::Nvlink(p) => p.combine_buffer(),
            LlPath::Net(p) => p.combine_buffer(),
        }
    }

    /// The send half of a combine (after the expert kernels filled the combine buffer, on the
    /// same stream or one ordered after them): for each token that sent rows here, the sum of
    /// its selections' weight x output goes back to its rank; then every peer is signalled.
    pub fn combine_send(&self, stream: &CudaStream) -> Result<()> {
        match &self.path {
            LlPath::Nvlink(p) => p.combine_send(stream),
            LlPath::Net(p) => p.combine_send(stream),
        }
    }

    /// The receive half (on the stream of the send half, or one ordered after it): waits for
    /// every peer's partial sums, then writes `out [num_tokens, hidden]`: for each token of the
    /// last dispatch, the sum over its experts of weight x output.
    ///
    /// # Safety
    /// `out` holds `num_tokens * hidden` bf16 (16-byte aligned) of the last dispatch, device
    /// memory of this GPU valid until `stream` has run it.
    pub unsafe fn combine_recv(&self, stream: &CudaStream, out: u64) -> Result<()> {
        match &self.path {
            // SAFETY: as documented.
            LlPath::Nvlink(p) => unsafe { p.combine_recv(stream, out) },
            LlPath::Net(p) => p.combine_recv(stream, out),
        }
    }

    /// Both halves (one kernel on the NVLink path, two launches on the node-spanning path).
    ///
    /// # Safety
    /// As for [`MoeLowLatency::combine_recv`].
    pub unsafe fn combine(&self, stream: &CudaStream, out: u64) -> Result<()> {
        match &self.path {
            // SAFETY: as documented.
            LlPath::Nvlink(p) => unsafe { p.combine(stream, out) },
            LlPath::Net(p) => {
                p.combine_send(stream)?;
                p.combine_recv(stream, out)
            }
        }
    }
}

/// The NVLink path of [`MoeLowLatency`] (every rank on one node).
struct LlNvlink {
    comm: Arc<Communicator>,
    cfg: MoeConfig,
    base: crate::device_api::MoeLlArgs,
    kernels: [CudaFunction; 6],
    dispatches: std::sync::atomic::AtomicU64,
    last: std::sync::Mutex<(u64, u32)>,
    /// Counts calls and makes each call's word (the call check, `call_check.cuh`).
    calls: CallChecker,
    /// The words of the last dispatch and the last combine, for their receive halves.
    last_calls: std::sync::Mutex<(CallCheck, CallCheck)>,
    _area: Landing,
    _semaphores: Semaphores,
    _device: Vec<CudaSlice<u8>>,
}

/// Where a low-latency dispatch leaves its results (device addresses; valid until the dispatch
/// after next).
#[derive(Debug, Clone, Copy)]
pub struct LowLatencyResults {
    /// `[local expert][source rank][max_tokens][hidden]` bf16 rows (e4m3 bytes after
    /// [`MoeLowLatency::dispatch_send_fp8`]).
    pub recv_x: u64,
    /// `[local expert][source rank][max_tokens]` i32: the source token of each row.
    pub recv_src: u64,
    /// `[local expert][source rank][max_tokens]` f32: the weight of each row's selection.
    pub recv_weights: u64,
    /// After [`MoeLowLatency::dispatch_send_fp8`]: `[local expert][source rank][max_tokens]
    /// [hidden / 128]` f32 scales of the rows (0 on the NVLink path, which has no FP8 rows).
    pub recv_scales: u64,
    /// `[local expert][source rank]` u32: rows from each source.
    pub layout: u64,
    /// `[local expert]` u32: rows per local expert; `u32::MAX` (-1 as i32) in every entry after
    /// a dispatch that an abort cut short (the layout is then all 0 and, inside a node, every row
    /// of the half all ones: NaN in bf16).
    pub recv_count: u64,
}

impl LlNvlink {
    /// Allocates the receive areas and combine buffers (mapped by every peer). Collective.
    /// `cfg.max_tokens` is the decode batch per rank (DeepEP recommends under 256).
    pub fn new(comm: &Arc<Communicator>, cfg: MoeConfig) -> Result<LlNvlink> {
        let world = comm.world_size();
        let rank = comm.rank();
        if world > MAX_RANKS || cfg.hidden == 0 || cfg.hidden % 8 != 0 {
            return Err(Error::invalid(
                "config",
                format!(
                    "at most {MAX_RANKS} ranks and a hidden size that is a positive multiple of 8"
                ),
            ));
        }
        if cfg.num_experts == 0
            || cfg.num_experts % world != 0
            || cfg.num_experts / world > 1024
            || cfg.topk == 0
            || cfg.topk > 32
            || cfg.max_tokens == 0
            || (cfg.max_tokens * cfg.topk) as u64 >= 1 << 31
            || 2 * (cfg.num_experts as u64) * (cfg.max_tokens as u64) >= 1 << 31
            || (cfg.max_tokens as u64) * (cfg.hidden as u64 / 8) >= 1 << 32
        {
            return Err(Error::invalid(
                "config",
                "num_experts a multiple of the ranks with at most 1024 per rank; topk in 1..=32; \
                 max_tokens positive and small enough for 32-bit row indices",
            ));
        }
        let gpu = comm.gpu().clone();
        let sms = gpu.sm_count()?;
        let blocks = cfg.blocks.unwrap_or(sms).clamp(1, sms);
        let local = cfg.num_experts / world;
        let rows = local * world * cfg.max_tokens;
        let section = |bytes: usize| bytes.next_multiple_of(256);
        let off_src = section(2 * rows * cfg.hidden * 2);
        let off_counts = off_src + section(2 * rows * 4);
        let off_from = off_counts + section(2 * local * world * 8);
        let off_weight = off_from + section(2 * rows * 4);
        let off_rec = off_weight + section(2 * rows * 4);
        let off_part = off_rec + section(2 * rows * cfg.topk * 4);
        let off_queue = off_part + section(2 * world * cfg.max_tokens * cfg.hidden * 2);
        let off_sent = off_queue + section(2 * world * cfg.max_tokens * 8);
        let area_bytes = off_sent + section(2 * world * 8);
        let (area, area_ptrs, inbox) = landing_with_inbox(comm, area_bytes)?;
        let semaphores = comm.semaphores(1)?;
        let stream = gpu.new_stream()?;
        let alloc = |bytes: usize| -> Result<CudaSlice<u8>> {
            stream
                .alloc_zeros::<u8>(bytes.max(16))
                .map_err(cuda_err("cuMemAlloc"))
        };
        let sems_bytes: &[u8] = bytemuck::cast_slice(semaphores.handles());
        let sems = stream
            .clone_htod(sems_bytes)
            .map_err(cuda_err("cuMemcpyHtoD"))?;
        let device = vec![
            alloc((cfg.num_experts + MAX_RANKS) * 4)?, // fill
            alloc(rows * cfg.hidden * 2)?,             // y: the combine buffer
            alloc(16)?,                                // done
            alloc(16)?,                                // epochs
            alloc(local * world * 4)?,                 // layout
            alloc(local * 4)?,                         // recv_count
            sems,
        ];
        let p = |i: usize| device[i].device_ptr(&stream).0;
        let base = crate::device_api::MoeLlArgs {
            hidden: cfg.hidden as u32,
            topk: cfg.topk as u32,
            experts_per_rank: local as u32,
            max_tokens: cfg.max_tokens as u32,
            rank: rank as u32,
            world: world as u32,
            blocks,
            area: area_ptrs,
            off_src: off_src as u64,
            off_counts: off_counts as u64,
            off_from: off_from as u64,
            off_weight: off_weight as u64,
            off_rec: off_rec as u64,
            off_part: off_part as u64,
            off_queue: off_queue as u64,
            off_sent: off_sent as u64,
            fill: p(0),
            y: p(1),
            done: p(2),
            epochs: p(3),
            layout: p(4),
            recv_count: p(5),
            ready: p(6),
            ..Default::default()
        };
        stream
            .synchronize()
            .map_err(cuda_err("cuStreamSynchronize"))?;
        let k = |name: &str| gpu.function("moe_ll", name);
        let kernels = [
            k("moe_ll_send")?,
            k("moe_ll_recv")?,
            k("moe_ll_dispatch")?,
            k("moe_ll_combine_send")?,
            k("moe_ll_combine_recv")?,
            k("moe_ll_combine")?,
        ];
        comm.bootstrap().barrier()?;
        Ok(LlNvlink {
            comm: comm.clone(),
            cfg,
            base,
            kernels,
            dispatches: std::sync::atomic::AtomicU64::new(0),
            last: std::sync::Mutex::new((0, 0)),
            calls: CallChecker::new(
                inbox,
                Settings::from_env()?.call_check,
                comm.bootstrap().call_counter(),
            ),
            last_calls: std::sync::Mutex::new((CallCheck::default(), CallCheck::default())),
            _area: area,
            _semaphores: semaphores,
            _device: device,
        })
    }

    fn launch(
        &self,
        stream: &CudaStream,
        k: usize,
        grid: u32,
        threads: u32,
        args: &crate::device_api::MoeLlArgs,
    ) -> Result<()> {
        launch(&self.comm, &self.kernels[k], stream, grid, threads, args)
    }

    /// The send half of a dispatch: rows leave for their experts' ranks; returns once queued.
    /// Call [`MoeLowLatency::dispatch_recv`] (on this or another stream ordered after it) before
    /// reading the results.
    ///
    /// # Safety
    /// `x` holds `num_tokens * hidden` bf16 (16-byte aligned), `topk_idx` `num_tokens * topk`
    /// i32 (-1 or below `num_experts`, a token's experts distinct) and `topk_weights` as many
    /// f32 (the weights the combine applies), device memory of this GPU valid until the work on
    /// `stream` completes; `topk_idx` also until the matching combine has run.
    pub unsafe fn dispatch_send(
        &self,
        stream: &CudaStream,
        x: u64,
        topk_idx: u64,
        topk_weights: u64,
        num_tokens: usize,
    ) -> Result<()> {
        let args = self.prepare_send(stream, x, topk_idx, topk_weights, num_tokens)?;
        self.launch(stream, 0, self.base.blocks, 512, &args)
    }

    /// Checks a dispatch's inputs, counts it, and returns its send arguments (the send kernels
    /// run on every block: a warp per (token, rank) item, items dealt round-robin over blocks).
    fn prepare_send(
        &self,
        stream: &CudaStream,
        x: u64,
        topk_idx: u64,
        topk_weights: u64,
        num_tokens: usize,
    ) -> Result<crate::device_api::MoeLlArgs> {
        if num_tokens > self.cfg.max_tokens
            || x % 16 != 0
            || topk_idx % 4 != 0
            || topk_weights % 4 != 0
        {
            return Err(Error::invalid(
                "dispatch",
                format!(
                    "{num_tokens} tokens (at most {}), x 16-byte, topk_idx and topk_weights \
                     4-byte aligned",
                    self.cfg.max_tokens
                ),
            ));
        }
        *self.last.lock().unwrap_or_else(|p| p.into_inner()) = (topk_idx, num_tokens as u32);
        self.dispatches
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let args = crate::device_api::MoeLlArgs {
            x,
            topk_idx,
            topk_weights,
            num_tokens: num_tokens as u32,
            call: self.next_call(CallKind::MoeLlDispatch, Some(stream)),
            ..self.base
        };
        Ok(args)
    }

    /// Prepares a dispatch whose send half runs in the caller's own kernel (fused dispatch):
    /// launches nothing, and returns the arguments
    /// that kernel passes to `doorbell::moe_ll::put_token` (one warp per token) or
    /// `doorbell::moe_ll::put` (one warp per (token, rank)) and `doorbell::moe_ll::finish_send`
    /// (every block once), from `cuda/include/doorbell/moe.cuh`. Every (token, rank) pair of the
    /// `num_tokens` must be put exactly once: the counts go out when the last one is done (a
    /// missing one makes the receivers' bounded waits report). Then call
    /// [`MoeLowLatency::dispatch_recv`].
    ///
    /// # Safety
    /// `topk_idx` and `topk_weights` as for [`MoeLowLatency::dispatch_send`].
    pub unsafe fn begin_fused_send(
        &self,
        topk_idx: u64,
        topk_weights: u64,
        num_tokens: usize,
    ) -> Result<crate::device_api::MoeLlArgs> {
        if num_tokens > self.cfg.max_tokens || topk_idx % 4 != 0 || topk_weights % 4 != 0 {
            return Err(Error::invalid(
                "dispatch",
                format!(
                    "{num_tokens} tokens (at most {}), topk_idx and topk_weights 4-byte aligned",
                    self.cfg.max_tokens
                ),
            ));
        }
        *self.last.lock().unwrap_or_else(|p| p.into_inner()) = (topk_idx, num_tokens as u32);
        self.dispatches
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let args = crate::device_api::MoeLlArgs {
            topk_idx,
            topk_weights,
            num_tokens: num_tokens as u32,
            call: self.next_call(CallKind::MoeLlDispatch, None),
            ..self.base
        };
        Ok(args)
    }

    /// The receive half: waits until every rank's rows of this dispatch have arrived, copies
    /// each row that crossed once into the slots of its token's other selections here, and
    /// writes the per-(expert, source) and per-expert counts.
    pub fn dispatch_recv(&self, stream: &CudaStream) -> Result<()> {
        let args = crate::device_api::MoeLlArgs {
            call: self.last_call().0,
            ..self.base
        };
        self.launch(stream, 1, self.base.blocks, 512, &args)
    }

    /// The next call's word, kept for its receive half.
    /// (`stream`: where the call is issued; `None` for a fused send, whose stream only the
    /// caller's kernel knows, taken as not captured.)
    fn next_call(&self, kind: CallKind, stream: Option<&CudaStream>) -> CallCheck {
        let graph = stream.is_some_and(signature::capturing);
        let call = self.calls.next(kind, 0, 0, 0, 0, graph);
        let mut last = self.last_calls.lock().unwrap_or_else(|p| p.into_inner());
        if kind == CallKind::MoeLlDispatch {
            last.0 = call;
        } else {
            last.1 = call;
        }
        call
    }

    /// The words of the last dispatch and the last combine.
    fn last_call(&self) -> (CallCheck, CallCheck) {
        *self.last_calls.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Both halves, in one kernel.
    ///
    /// # Safety
    /// As for [`MoeLowLatency::dispatch_send`].
    pub unsafe fn dispatch(
        &self,
        stream: &CudaStream,
        x: u64,
        topk_idx: u64,
        topk_weights: u64,
        num_tokens: usize,
    ) -> Result<()> {
        let args = self.prepare_send(stream, x, topk_idx, topk_weights, num_tokens)?;
        self.launch(stream, 2, self.base.blocks, 512, &args)
    }

    /// Where the last dispatch issued from the host left its results (the half its epoch
    /// picked). Replays of a captured dispatch alternate halves too: use
    /// [`MoeLowLatency::results_of`] with the number of dispatches executed so far.
    pub fn results(&self) -> LowLatencyResults {
        self.results_of(self.dispatches.load(std::sync::atomic::Ordering::Relaxed))
    }

    /// Where the `n`-th dispatch (counting from 1, replays included) left its results.
    pub fn results_of(&self, n: u64) -> LowLatencyResults {
        let half = n & 1;
        let rows = (self.base.experts_per_rank * self.base.world * self.base.max_tokens) as u64;
        let area = self.base.area[self.comm.rank()];
        LowLatencyResults {
            recv_x: area + half * rows * self.base.hidden as u64 * 2,
            recv_src: area + self.base.off_src + half * rows * 4,
            recv_weights: area + self.base.off_weight + half * rows * 4,
            recv_scales: 0,
            layout: self.base.layout,
            recv_count: self.base.recv_count,
        }
    }

    /// This rank's combine buffer: `[local expert][source rank][max_tokens][hidden]` bf16, the
    /// receive layout; expert kernels write each row's output at its row's place.
    pub fn combine_buffer(&self) -> u64 {
        self.base.y
    }

    /// The send half of a combine (after the expert kernels filled the combine buffer, on the
    /// same stream or one ordered after them): for each token that sent rows here, the sum of
    /// its selections' weight x output goes back to its rank; then every peer is signalled.
    pub fn combine_send(&self, stream: &CudaStream) -> Result<()> {
        let args = crate::device_api::MoeLlArgs {
            call: self.next_call(CallKind::MoeLlCombine, Some(stream)),
            ..self.base
        };
        self.launch(stream, 3, self.base.blocks, 512, &args)
    }

    /// The receive half (on the stream of the send half, or one ordered after it): waits for
    /// every peer's partial sums, then writes `out [num_tokens, hidden]`: for each token of the
    /// last dispatch, the sum over its experts of weight x output.
    ///
    /// # Safety
    /// `out` holds `num_tokens * hidden` bf16 (16-byte aligned) of the last dispatch, device
    /// memory of this GPU valid until `stream` has run it.
    pub unsafe fn combine_recv(&self, stream: &CudaStream, out: u64) -> Result<()> {
        let args = crate::device_api::MoeLlArgs {
            call: self.last_call().1,
            ..self.combine_args(out)?
        };
        self.launch(stream, 4, self.base.blocks, 512, &args)
    }

    /// The combine's arguments for the last dispatch, writing `out`.
    fn combine_args(&self, out: u64) -> Result<crate::device_api::MoeLlArgs> {
        if out % 16 != 0 {
            return Err(Error::invalid("combine", "out 16-byte aligned"));
        }
        let (topk_idx, num_tokens) = *self.last.lock().unwrap_or_else(|p| p.into_inner());
        Ok(crate::device_api::MoeLlArgs {
            topk_idx,
            out,
            num_tokens,
            ..self.base
        })
    }

    /// Both halves, in one kernel.
    ///
    /// # Safety
    /// As for [`MoeLowLatency::combine_recv`].
    pub unsafe fn combine(&self, stream: &CudaStream, out: u64) -> Result<()> {
        let args = crate::device_api::MoeLlArgs {
            call: self.next_call(CallKind::MoeLlCombine, Some(stream)),
            ..self.combine_args(out)?
        };
        self.launch(stream, 5, self.base.blocks, 512, &args)
    }
}
