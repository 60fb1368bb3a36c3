//! The NVLink path of [`super::MoeHighThroughput`], every rank on one node: each token goes to
//! every destination rank once, however many of that rank's experts it selected, by stores into
//! the peers' mapped receive areas. Kernels and protocol: `cuda/kernels/moe.cu`.

use super::path::HighThroughputPath;
use super::shared::{
    launch, receive_area, receive_area_with_inbox, DispatchResults, MoeConfig, Route,
};
use crate::channel::semaphore::Semaphores;
use crate::channel::symmetric::SymmetricBuffer;
use crate::communicator::Communicator;
use crate::device_api::limits::HT_MAX_LOCAL_EXPERTS;
use crate::device_api::{MoeArgs, MAX_RANKS};
use crate::error::{Error, Result};
use crate::gpu::cuda::cuda_err;
use crate::gpu::signature::{self, CallChecker, CallKind};
use cudarc::driver::{CudaFunction, CudaSlice, CudaStream, DevicePtr};
use std::sync::Arc;

/// Grids of more blocks than this pull in the combine, others push (`kPushBlocks` in moe.cu).
const PUSH_BLOCKS: u32 = 64;

/// Call-count slots of the high-throughput kernels (`kDispatchCalls` .. `kSentBlocks` in moe.cu):
/// four per-block sets of 256, then two GPU-wide counts.
const HT_CALL_SLOTS: usize = 1026;

/// The NVLink path of [`super::MoeHighThroughput`] (every rank on one node).
pub(super) struct HtNvlink {
    comm: Arc<Communicator>,
    cfg: MoeConfig,
    base: MoeArgs,
    blocks: u32,
    /// Tokens of the dispatch in each receive slot (what its combine writes).
    tokens: Vec<std::sync::atomic::AtomicU32>,
    /// The receive slot of the next dispatch (and of the last one's results).
    slot: std::sync::atomic::AtomicU32,
    slots: usize,
    /// Where a slot's rank prefix matrix and token positions lie in it.
    off_prefix: u64,
    off_pos: u64,
    /// Rows whose ids the next dispatches set to -1 past the received ones (0: none).
    fill_rows: std::sync::atomic::AtomicU32,
    /// Counts calls and makes each call's word (the call check, `coll/call_check.cuh`).
    calls: CallChecker,
    kernels: [CudaFunction; 2],
    /// [`HighThroughputPath::combine_buffer`]'s rows, allocated on first use.
    y_rows: std::sync::OnceLock<CudaSlice<u8>>,
    _recv: SymmetricBuffer,
    _comb: SymmetricBuffer,
    _semaphores: Semaphores,
    _device: Vec<CudaSlice<u8>>,
}

impl HtNvlink {
    /// Allocates the receive areas (mapped by every peer), outputs and semaphores. Collective.
    pub(super) fn new(comm: &Arc<Communicator>, cfg: MoeConfig) -> Result<HtNvlink> {
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
        if cfg.num_experts == 0
            || cfg.num_experts % world != 0
            || cfg.num_experts / world > HT_MAX_LOCAL_EXPERTS
        {
            return Err(Error::invalid(
                "num_experts",
                format!(
                    "{}: must be a positive multiple of {world} ranks, at most {HT_MAX_LOCAL_EXPERTS} per rank",
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
        // Receive slots (rows, ids, weights, sources, scales), then what every call shares.
        let off_idx = section(rows * cfg.hidden * 2);
        let off_weights = off_idx + section(rows * cfg.topk * 4);
        let off_src = off_weights + section(rows * cfg.topk * 4);
        let off_scales = off_src + section(rows * 8);
        let off_prefix = off_scales + section(rows * (cfg.hidden / 128) * 4);
        // The dispatch's positions of this rank's tokens at each rank, read by its combine.
        let off_pos = off_prefix + section(world * world * 4);
        let slot_bytes = off_pos + section(cfg.max_tokens * world * 4);
        let slots = cfg.receive_slots.max(1);
        // Two count matrices of u64 words, for calls of alternating parity (moe.cu).
        let off_matrix = slots * slot_bytes;
        // Rows per expert by source, for dispatches routed without top-k (both call parities).
        let off_expert_in = off_matrix + section(2 * world * world * 8);
        // Every rank's receive slot of the call, both parities.
        let off_slots = off_expert_in + section(2 * world * (cfg.num_experts / world) * 8);
        let land_bytes = off_slots + section(2 * world * 8);
        let (recv, land_ptrs, inbox) = receive_area_with_inbox(comm, land_bytes)?;
        // The combine area: `world x max_tokens` rows, then their top-k weights (a combine with
        // weights): aligned with recv_x for a pulling combine, a slot per (holding rank, position
        // of the token in its rows to that rank) for a pushing one (moe.cu).
        let off_comb_weights = section(rows * cfg.hidden * 2);
        let (comb, comb_ptrs) = receive_area(comm, off_comb_weights + rows * cfg.topk * 4)?;
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
            // num_recv, then expert_counts right behind it: one copy reads both (the DeepEP
            // API's host read of a dispatch's counts, python/py/doorbell/deep_ep).
            alloc(4 + cfg.num_experts / world * 4)?,
            alloc(HT_CALL_SLOTS * 8)?, // call counts per kernel and block (moe.cu)
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
            off_comb_weights: off_comb_weights as u64,
            off_expert_in: off_expert_in as u64,
            off_slots: off_slots as u64,
            slot_bytes: slot_bytes as u64,
            num_recv: p(0),
            expert_counts: p(0) + 4,
            calls: p(1),
            sems: p(2),
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
            tokens: (0..slots)
                .map(|_| std::sync::atomic::AtomicU32::new(0))
                .collect(),
            slot: std::sync::atomic::AtomicU32::new(0),
            slots,
            off_prefix: off_prefix as u64,
            off_pos: off_pos as u64,
            fill_rows: std::sync::atomic::AtomicU32::new(0),
            calls: CallChecker::new(
                inbox,
                comm.settings().call_check,
                comm.bootstrap().call_counter(),
            ),
            kernels,
            y_rows: std::sync::OnceLock::new(),
            _recv: recv,
            _comb: comb,
            _semaphores: semaphores,
            _device: device,
        })
    }

    /// Where receive slot `slot` keeps its dispatch's token positions and rank prefix matrix.
    fn layout(&self, slot: u32) -> (u64, u64) {
        let base = self.base.land[self.comm.rank()] + u64::from(slot) * self.base.slot_bytes;
        (base + self.off_pos, base + self.off_prefix)
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

    /// A dispatch routed by `route` (top-k ids and weights, or ranks per token).
    unsafe fn dispatch_with(
        &self,
        stream: &CudaStream,
        x: u64,
        scales: u64,
        fp8: bool,
        route: Route,
        num_tokens: usize,
    ) -> Result<()> {
        // A non-null in_rank is what tells the kernel the call routes by ranks; a rank with no
        // tokens may hold an empty (null) one, and no token reads it: stand in this exchange's
        // own address. Likewise for an FP8 call's scales (non-null: FP8 rows, which the
        // receive half needs to know even on a rank that sends none).
        let stand_in = self.base.num_recv;
        let by_ranks = matches!(route, Route::Ranks { .. });
        let (topk_idx, topk_weights, in_rank, tokens_per_expert) = match route {
            Route::TopK { idx, weights } => (idx, weights, 0, 0),
            Route::Ranks {
                in_rank,
                tokens_per_expert,
            } => {
                if (in_rank == 0 && num_tokens > 0) || tokens_per_expert % 4 != 0 {
                    return Err(Error::invalid(
                        "routing",
                        "in_rank a device address, tokens_per_expert 4-byte aligned (or 0)",
                    ));
                }
                let in_rank = if in_rank == 0 { stand_in } else { in_rank };
                (0, 0, in_rank, tokens_per_expert)
            }
        };
        if fp8 && scales == 0 && num_tokens > 0 {
            return Err(Error::invalid("scales", "FP8 rows need their scales"));
        }
        let scales = if fp8 && scales == 0 { stand_in } else { scales };
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
        let slot = self.slot.load(std::sync::atomic::Ordering::Relaxed);
        self.tokens[slot as usize].store(num_tokens as u32, std::sync::atomic::Ordering::Relaxed);
        // Token counts differ by rank; the word names the call and its element type.
        let dtype = if fp8 { signature::E4M3 } else { 0 };
        // The mode tells a dispatch by top-k (0) from one by ranks with per-expert counts (1) and
        // one by ranks without (2): they exchange different counts, so a mix is named as a
        // mismatch rather than waited out.
        let mode = match (by_ranks, tokens_per_expert != 0) {
            (false, _) => 0,
            (true, true) => 1,
            (true, false) => 2,
        };
        let (pos, rank_prefix) = self.layout(slot);
        let args = MoeArgs {
            x,
            scales,
            slot,
            fill_rows: self.fill_rows.load(std::sync::atomic::Ordering::Relaxed),
            pos,
            rank_prefix,
            topk_idx,
            topk_weights,
            in_rank,
            tokens_per_expert,
            num_tokens: num_tokens as u32,
            call: self.calls.next(
                CallKind::MoeDispatch,
                dtype,
                mode,
                0,
                0,
                signature::capturing(stream),
            ),
            ..self.base
        };
        self.launch(stream, 0, self.blocks, 512, &args)
    }
}

impl HighThroughputPath for HtNvlink {
    fn spans_nodes(&self) -> bool {
        false
    }

    fn last_tokens(&self) -> usize {
        let slot = self.slot.load(std::sync::atomic::Ordering::Relaxed) as usize;
        self.tokens[slot].load(std::sync::atomic::Ordering::Relaxed) as usize
    }

    unsafe fn dispatch_by_rank(
        &self,
        stream: &CudaStream,
        x: u64,
        scales: u64,
        in_rank: u64,
        tokens_per_expert: u64,
        num_tokens: usize,
    ) -> Result<()> {
        // SAFETY: as the trait's contract says (the scales checked by the caller).
        unsafe {
            self.dispatch_with(
                stream,
                x,
                scales,
                scales != 0,
                Route::Ranks {
                    in_rank,
                    tokens_per_expert,
                },
                num_tokens,
            )
        }
    }

    /// The configuration.
    fn config(&self) -> &MoeConfig {
        &self.cfg
    }

    /// SMs the send and receive kernels occupy.
    fn sms(&self) -> u32 {
        self.blocks
    }

    /// Dispatches `num_tokens` tokens (see the module documentation).
    ///
    /// # Safety
    /// `x` holds `num_tokens * hidden` bf16 (16-byte aligned), `topk_idx` and `topk_weights`
    /// `num_tokens * topk` i32 / f32, device memory of this GPU valid until the work on `stream`
    /// completes; every id is -1 or below `num_experts`.
    unsafe fn dispatch(
        &self,
        stream: &CudaStream,
        x: u64,
        topk_idx: u64,
        topk_weights: u64,
        num_tokens: usize,
    ) -> Result<()> {
        // SAFETY: as documented; the caller vouches for the buffers.
        unsafe {
            self.dispatch_with(
                stream,
                x,
                0,
                false,
                Route::TopK {
                    idx: topk_idx,
                    weights: topk_weights,
                },
                num_tokens,
            )
        }
    }

    /// Dispatches FP8 tokens: `x` holds e4m3 bytes `[num_tokens, hidden]` and `scales` one f32
    /// per 128 values (`[num_tokens, hidden / 128]`), cast by the caller (DeepEP's normal-mode
    /// convention). The rows arrive as bytes in `recv_x` (`[N, hidden]` e4m3) and the scales in
    /// [`DispatchResults::recv_scales`]; everything else as for [`super::MoeHighThroughput::dispatch`]. Half
    /// the bytes of bf16 cross NVLink. Combine stays bf16.
    ///
    /// # Safety
    /// `x` holds `num_tokens * hidden` bytes (16-byte aligned), `scales` `num_tokens * hidden /
    /// 128` f32, the top-k arrays as for [`super::MoeHighThroughput::dispatch`]; all valid until the work on
    /// `stream` completes.
    unsafe fn dispatch_fp8(
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
        if scales % 4 != 0 {
            return Err(Error::invalid(
                "scales",
                "must be a 4-byte aligned device address",
            ));
        }
        // SAFETY: as documented; the caller vouches for the buffers.
        unsafe {
            self.dispatch_with(
                stream,
                x,
                scales,
                true,
                Route::TopK {
                    idx: topk_idx,
                    weights: topk_weights,
                },
                num_tokens,
            )
        }
    }

    /// Combines `y` (one row per received row of the dispatch in the current receive slot) into
    /// `out [num_tokens, H]` (see the module documentation).
    ///
    /// # Safety
    /// `y` holds at least `num_recv * hidden` bf16 and `out` `num_tokens * hidden` bf16 of that
    /// dispatch (both 16-byte aligned), device memory of this GPU valid until the work on
    /// `stream` completes.
    unsafe fn combine(
        &self,
        stream: &CudaStream,
        y: u64,
        out: u64,
        weights: Option<(u64, u64)>,
    ) -> Result<()> {
        if y % 16 != 0 || out % 16 != 0 {
            return Err(Error::invalid(
                "buffers",
                "y and out must be 16-byte aligned",
            ));
        }
        let (y_weights, out_weights) = weights.unwrap_or((0, 0));
        let slot = self.slot.load(std::sync::atomic::Ordering::Relaxed);
        let (pos, rank_prefix) = self.layout(slot);
        let args = MoeArgs {
            y,
            out,
            y_weights,
            out_weights,
            pos,
            rank_prefix,
            num_tokens: self.tokens[slot as usize].load(std::sync::atomic::Ordering::Relaxed),
            // Variant 1: the rows' weights ride along; a rank that gives none while others do
            // would read their stale weights, so a mix is named as a mismatch.
            call: self.calls.next(
                CallKind::MoeCombine,
                0,
                u32::from(weights.is_some()),
                0,
                0,
                signature::capturing(stream),
            ),
            ..self.base
        };
        self.launch(stream, 1, self.blocks, 512, &args)
    }

    /// Room for `y` (`[world * max_tokens, hidden]` bf16, rows aligned with `recv_x`). A pulling
    /// combine (more than 64 blocks) reads peers' rows from this rank's combine area, so this is
    /// that area and a `y` written there is not copied in (write it only after a dispatch: a
    /// peer may read it until then); a pushing one stores them from `y` wherever it is, so this
    /// is a buffer of its own, allocated on first use.
    fn combine_buffer(&self) -> Result<u64> {
        if self.blocks > PUSH_BLOCKS {
            return Ok(self.base.comb_buf[self.comm.rank()]);
        }
        if let Some(b) = self.y_rows.get() {
            return Ok(b.device_ptr(b.stream()).0);
        }
        let rows = self.comm.world_size() * self.cfg.max_tokens;
        let stream = self.comm.gpu().new_stream()?;
        let b = stream
            .alloc_zeros::<u8>(rows * self.cfg.hidden * 2)
            .map_err(cuda_err("cuMemAlloc"))?;
        stream
            .synchronize()
            .map_err(cuda_err("cuStreamSynchronize"))?;
        let b = self.y_rows.get_or_init(|| b);
        Ok(b.device_ptr(b.stream()).0)
    }

    /// Device addresses of the last dispatch's results: recv_x, recv_idx, recv_weights, recv_src,
    /// num_recv, expert_counts (read them after the stream's work finished).
    fn set_receive_slot(&self, slot: usize) -> Result<()> {
        if slot >= self.slots {
            return Err(Error::invalid(
                "receive slot",
                format!(
                    "{slot}: this exchange has {} (MoeConfig::receive_slots)",
                    self.slots
                ),
            ));
        }
        self.slot
            .store(slot as u32, std::sync::atomic::Ordering::Relaxed);
        Ok(())
    }

    fn set_worst_rows(&self, rows: usize) -> Result<()> {
        let most = self.comm.world_size() * self.cfg.max_tokens;
        if rows > most {
            return Err(Error::invalid(
                "worst rows",
                format!("{rows}: at most world x max_tokens = {most}"),
            ));
        }
        self.fill_rows
            .store(rows as u32, std::sync::atomic::Ordering::Relaxed);
        Ok(())
    }

    fn results(&self) -> DispatchResults {
        let slot = self.slot.load(std::sync::atomic::Ordering::Relaxed) as u64;
        let land = self.base.land[self.comm.rank()] + slot * self.base.slot_bytes;
        DispatchResults {
            recv_x: land,
            recv_idx: land + self.base.off_idx,
            recv_weights: land + self.base.off_weights,
            recv_src: land + self.base.off_src,
            recv_scales: land + self.base.off_scales,
            num_recv: self.base.num_recv,
            expert_counts: self.base.expert_counts,
            rank_prefix: land + self.off_prefix,
            max_rows: self.comm.world_size() * self.cfg.max_tokens,
            slot_bytes: self.base.slot_bytes as usize,
        }
    }
}
