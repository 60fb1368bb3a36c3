//! The NVLink path of [`super::MoeLowLatency`], every rank on one node: a token's row crosses once
//! per destination rank and the receive half copies it into the other selections' slots as soon
//! as the sender announces it. Kernels and protocol: `cuda/kernels/moe_ll.cu` and
//! `doorbell/coll/moe_ll.cuh`.

use super::path::LowLatencyPath;
use super::shared::{
    launch, launch_unchecked, receive_area_with_inbox, FusedSend, LowLatencyResults, MoeConfig,
};
use crate::channel::semaphore::Semaphores;
use crate::channel::symmetric::SymmetricBuffer;
use crate::collectives::moe::packed::{PackedCombine, PackedOutputs};
use crate::communicator::Communicator;
use crate::device_api::limits::LL_MAX_LOCAL_EXPERTS;
use crate::device_api::{packed, CallCheck, MAX_RANKS};
use crate::error::{Error, Result};
use crate::gpu::cuda::cuda_err;
use crate::gpu::signature::{self, CallChecker, CallKind};
use cudarc::driver::{CudaFunction, CudaSlice, CudaStream, DevicePtr};
use std::sync::Arc;

mod formats;

use formats::{check_combine_format, check_dispatch_format, set_mask_word, SentFormats};

/// The NVLink path of [`super::MoeLowLatency`] (every rank on one node).
pub(super) struct LlNvlink {
    comm: Arc<Communicator>,
    cfg: MoeConfig,
    base: crate::device_api::MoeLlArgs,
    kernels: [CudaFunction; 6],
    dispatches: std::sync::atomic::AtomicU64,
    last: std::sync::Mutex<(u64, u32)>,
    /// Counts calls and makes each call's word (the call check, `coll/call_check.cuh`).
    calls: CallChecker,
    /// The words of the last dispatch and the last combine, for their receive halves.
    last_calls: std::sync::Mutex<(CallCheck, CallCheck)>,
    /// DeepEP's rank mask (`MoeConfig::rank_mask`): `[world]` u32, 1 = masked.
    rank_mask: Option<CudaSlice<u32>>,
    /// The dead peers already written into the mask (one bit each).
    masked_dead: std::sync::atomic::AtomicU64,
    /// DeepEP's layout: the row format of the last packed sends, `(ticket, FP8)`, newest last
    /// (with FP8 the send half casts, so its receive half must read FP8 too).
    packed_sends: std::sync::Mutex<SentFormats>,
    /// DeepEP's layout: whether the last few combines' send halves wrote log rows, by ticket, so
    /// a receive half called apart decodes what was sent.
    combine_sends: std::sync::Mutex<SentFormats>,
    _area: SymmetricBuffer,
    _semaphores: Semaphores,
    _device: Vec<CudaSlice<u8>>,
}

impl LlNvlink {
    /// Allocates the receive areas and combine buffers (mapped by every peer). Collective.
    /// `cfg.max_tokens` is the decode batch per rank (DeepEP recommends under 256).
    pub(super) fn new(comm: &Arc<Communicator>, cfg: MoeConfig) -> Result<LlNvlink> {
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
            || cfg.num_experts / world > LL_MAX_LOCAL_EXPERTS
            || cfg.topk == 0
            || cfg.topk > 32
            || cfg.max_tokens == 0
            || (cfg.max_tokens * cfg.topk) as u64 >= 1 << 31
            || 2 * (cfg.num_experts as u64) * (cfg.max_tokens as u64) >= 1 << 31
            || (cfg.max_tokens as u64) * (cfg.hidden as u64 / 8) >= 1 << 32
        {
            return Err(Error::invalid(
                "config",
                format!(
                    "num_experts a multiple of the ranks with at most {LL_MAX_LOCAL_EXPERTS} per \
                     rank; topk in 1..=32; max_tokens positive and small enough for 32-bit row \
                     indices"
                ),
            ));
        }
        if cfg.rank_mask && !cfg.deep_ep_layout {
            return Err(Error::invalid(
                "config",
                "a rank mask is for DeepEP's layout: add MoeConfig::with_deep_ep_layout(true)",
            ));
        }
        if cfg.deep_ep_layout && cfg.num_experts > 4096 {
            return Err(Error::invalid(
                "config",
                format!(
                    "DeepEP's layout takes at most 4096 experts (asked for {})",
                    cfg.num_experts
                ),
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
        let off_ret = off_sent + section(2 * world * 8);
        // DeepEP's layout: each token's rows come back unweighted, [2][expert][token][hidden].
        let ret_bytes = if cfg.deep_ep_layout {
            2 * cfg.num_experts * cfg.max_tokens * cfg.hidden * 2
        } else {
            0
        };
        let area_bytes = off_ret + section(ret_bytes);
        let (area, area_ptrs, inbox) = receive_area_with_inbox(comm, area_bytes)?;
        let semaphores = comm.semaphores(1)?;
        let stream = gpu.new_stream()?;
        let alloc = |bytes: usize| -> Result<CudaSlice<u8>> {
            stream
                .alloc_zeros::<u8>(bytes.max(16))
                .map_err(cuda_err("cuMemAlloc"))
        };
        // With a rank mask, a dead peer's waits leave it out instead of failing (core/wait.cuh).
        let mut handles = semaphores.handles().to_vec();
        if cfg.rank_mask {
            for h in &mut handles {
                h.site.reserved |= crate::device_api::SITE_TOLERANT;
            }
        }
        let sems_bytes: &[u8] = bytemuck::cast_slice(&handles);
        let sems = stream
            .clone_htod(sems_bytes)
            .map_err(cuda_err("cuMemcpyHtoD"))?;
        let rank_mask = if cfg.rank_mask {
            Some(
                stream
                    .alloc_zeros::<u32>(world)
                    .map_err(cuda_err("cuMemAlloc"))?,
            )
        } else {
            None
        };
        let device = vec![
            alloc((cfg.num_experts + MAX_RANKS) * 4)?, // fill
            alloc(rows * cfg.hidden * 2)?,             // y: the combine buffer
            alloc(16)?,                                // done
            alloc(32)?,                                // epochs, last sends' call ordinals
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
            off_ret: if cfg.deep_ep_layout {
                off_ret as u64
            } else {
                0
            },
            fill: p(0),
            y: p(1),
            done: p(2),
            epochs: p(3),
            layout: p(4),
            recv_count: p(5),
            ready: p(6),
            rank_mask: rank_mask.as_ref().map_or(0, |m| m.device_ptr(&stream).0),
            ..Default::default()
        };
        stream
            .synchronize()
            .map_err(cuda_err("cuStreamSynchronize"))?;
        let k = |name: &str| gpu.function("moe_ll", name);
        let kernels = [
            k("moe_ll_dispatch_send")?,
            k("moe_ll_dispatch_recv")?,
            k("moe_ll_dispatch")?,
            k("moe_ll_combine_send")?,
            k("moe_ll_combine_recv")?,
            k("moe_ll_combine")?,
        ];
        comm.bootstrap().barrier()?;
        if cfg.rank_mask {
            // From here on a peer's death is marked, not an abort: this exchange leaves it out
            // and every other call of the communicator fails naming it (check_health).
            comm.diagnostics().tolerate_peer_loss();
        }
        Ok(LlNvlink {
            comm: comm.clone(),
            cfg,
            base,
            kernels,
            dispatches: std::sync::atomic::AtomicU64::new(0),
            last: std::sync::Mutex::new((0, 0)),
            calls: CallChecker::new(
                inbox,
                comm.settings().call_check,
                comm.bootstrap().call_counter(),
            ),
            last_calls: std::sync::Mutex::new((CallCheck::default(), CallCheck::default())),
            packed_sends: std::sync::Mutex::new(SentFormats::default()),
            combine_sends: std::sync::Mutex::new(SentFormats::default()),
            rank_mask,
            masked_dead: std::sync::atomic::AtomicU64::new(0),
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
        if self.rank_mask.is_none() {
            return launch(&self.comm, &self.kernels[k], stream, grid, threads, args);
        }
        if args.packed == 0 {
            return Err(Error::invalid(
                "MoE low latency with a rank mask",
                "DeepEP's layout calls only (dispatch_packed, combine_packed): doorbell's own \
                 layout cannot leave a masked rank out",
            ));
        }
        // mask_dead made the health check (only an abort stops an exchange with a mask).
        self.mask_dead(stream)?;
        launch_unchecked(&self.comm, &self.kernels[k], stream, grid, threads, args)
    }

    /// Refuses doorbell's own layout's calls on an exchange with a rank mask (they cannot leave
    /// a masked rank out), before the call takes a word or a count.
    fn own_layout(&self, what: &str) -> Result<()> {
        if self.rank_mask.is_some() {
            return Err(Error::invalid(
                what,
                "DeepEP's layout calls only on an exchange with a rank mask (dispatch_packed, \
                 combine_packed): doorbell's own layout cannot leave a masked rank out",
            ));
        }
        Ok(())
    }

    /// Writes the peers the watchdog found dead since the last call into the rank mask, on
    /// `stream` before the next kernel, so every call after leaves them out at once (a call in
    /// flight when a peer dies leaves it out by itself, core/wait.cuh). Errors if the communicator
    /// aborted.
    fn mask_dead(&self, stream: &CudaStream) -> Result<()> {
        use std::sync::atomic::Ordering;
        let dead = self.comm.check_health_tolerant()?;
        let new = dead & !self.masked_dead.load(Ordering::Relaxed);
        if new == 0 {
            return Ok(());
        }
        let Some(mask) = self.rank_mask.as_ref() else {
            return Ok(());
        };
        for peer in (0..self.base.world as usize).filter(|r| new >> r & 1 == 1) {
            set_mask_word(mask, stream, peer, 1)?;
        }
        self.masked_dead.fetch_or(new, Ordering::Relaxed);
        Ok(())
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
        self.own_layout("dispatch")?;
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
            call: self.next_call(CallKind::MoeLlDispatch, 0, Some(stream)),
            ..self.base
        };
        Ok(args)
    }

    /// A dispatch in DeepEP's layout (no weights travel): checks and counts it like
    /// [`LlNvlink::prepare_send`]; the caller sets the call word.
    fn prepare_packed_send(
        &self,
        x: u64,
        topk_idx: u64,
        num_tokens: usize,
    ) -> Result<crate::device_api::MoeLlArgs> {
        if num_tokens > self.cfg.max_tokens
            || x % 16 != 0
            || topk_idx % 4 != 0
            || (num_tokens > 0 && (x == 0 || topk_idx == 0))
        {
            return Err(Error::invalid(
                "dispatch",
                format!(
                    "{num_tokens} tokens (at most {}), x 16-byte and topk_idx 4-byte aligned",
                    self.cfg.max_tokens
                ),
            ));
        }
        *self.last.lock().unwrap_or_else(|p| p.into_inner()) = (topk_idx, num_tokens as u32);
        self.dispatches
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ok(crate::device_api::MoeLlArgs {
            x,
            topk_idx,
            topk_weights: 0,
            num_tokens: num_tokens as u32,
            ..self.base
        })
    }

    /// Prepares a dispatch whose send half runs in the caller's own kernel (fused dispatch):
    /// launches nothing, and returns the arguments
    /// that kernel passes to `doorbell::moe_ll::put_token` (one warp per token) or
    /// `doorbell::moe_ll::put` (one warp per (token, rank)) and `doorbell::moe_ll::finish_send`
    /// (every block once), from `cuda/include/doorbell/coll/moe_ll.cuh`. Every (token, rank) pair of the
    /// `num_tokens` must be put exactly once: the counts go out when the last one is done (a
    /// missing one makes the receivers' bounded waits report). Then call
    /// [`super::MoeLowLatency::dispatch_recv`]. The kernel reads `topk_idx` and `topk_weights`
    /// (see [`super::MoeLowLatency::begin_fused_send`]'s safety contract).
    fn fused_args(
        &self,
        topk_idx: u64,
        topk_weights: u64,
        num_tokens: usize,
    ) -> Result<crate::device_api::MoeLlArgs> {
        self.own_layout("begin_fused_send")?;
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
            call: self.next_call(CallKind::MoeLlDispatch, 0, None),
            ..self.base
        };
        Ok(args)
    }

    /// The next call's word, kept for its receive half.
    /// (`stream`: where the call is issued; `None` for a fused send, whose stream only the
    /// caller's kernel knows, taken as not captured.)
    /// (`variant` 1: DeepEP's layout, so a rank that mixes the layouts is named.)
    fn next_call(&self, kind: CallKind, variant: u32, stream: Option<&CudaStream>) -> CallCheck {
        let graph = stream.is_some_and(signature::capturing);
        let call = self.calls.next(kind, 0, variant, 0, 0, graph);
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

    /// Records a packed dispatch's row format under its ticket (the last few sends).
    fn note_packed_send(&self, out: &PackedOutputs) {
        let mut sends = self.packed_sends.lock().unwrap_or_else(|p| p.into_inner());
        sends.note(out.ticket, out.scales != 0);
    }

    /// A receive half must read the rows in the format its send half wrote them: FP8 rows are
    /// cast by the send, so bf16 outputs for an FP8 send (or the reverse) would read garbage.
    /// The send is the one of `out.ticket`, else the last one.
    fn check_packed_format(&self, out: &PackedOutputs) -> Result<()> {
        let sends = self.packed_sends.lock().unwrap_or_else(|p| p.into_inner());
        check_dispatch_format(sends.find(out.ticket), out.scales != 0)
    }

    /// The combine's arguments for the last dispatch, writing `out`.
    fn combine_args(&self, out: u64) -> Result<crate::device_api::MoeLlArgs> {
        self.own_layout("combine")?;
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
}

impl LlNvlink {
    /// DeepEP's layout was built (`MoeConfig::with_deep_ep_layout`).
    fn packed_built(&self) -> Result<()> {
        if self.cfg.deep_ep_layout {
            Ok(())
        } else {
            Err(Error::invalid(
                "DeepEP's low-latency layout",
                "build the MoeLowLatency with MoeConfig::with_deep_ep_layout(true)",
            ))
        }
    }

    /// `args` with a packed dispatch's outputs, checked.
    fn with_outputs(
        &self,
        args: crate::device_api::MoeLlArgs,
        out: &PackedOutputs,
    ) -> Result<crate::device_api::MoeLlArgs> {
        let bits = out.bits(self.cfg.hidden)?;
        Ok(crate::device_api::MoeLlArgs {
            packed_x: out.x,
            packed_scales: out.scales,
            packed_src: out.src_info,
            packed_range: out.layout_range,
            packed_count: out.count,
            packed_stats: out.stats,
            packed: bits,
            ticket: out.ticket,
            wait_cycles: out.wait_cycles,
            ..args
        })
    }
}

impl LowLatencyPath for LlNvlink {
    fn spans_nodes(&self) -> bool {
        false
    }

    fn rank_mask(&self) -> Option<&CudaSlice<u32>> {
        self.rank_mask.as_ref()
    }

    fn mask_dead_peers(&self, stream: &CudaStream) -> Result<()> {
        self.mask_dead(stream)
    }

    fn set_rank_masked(&self, stream: &CudaStream, rank: usize, masked: bool) -> Result<()> {
        let Some(mask) = self.rank_mask.as_ref() else {
            return Ok(());
        };
        set_mask_word(mask, stream, rank, u32::from(masked))?;
        if !masked {
            // A dead peer unmasked by hand is masked again at the next call.
            self.masked_dead
                .fetch_and(!(1u64 << rank), std::sync::atomic::Ordering::Relaxed);
        }
        Ok(())
    }

    fn clean_rank_mask(&self, stream: &CudaStream) -> Result<()> {
        let Some(mask) = self.rank_mask.as_ref() else {
            return Ok(());
        };
        let (p, _g) = mask.device_ptr(stream);
        // SAFETY: the mask holds `world` u32, written on `stream`.
        unsafe {
            cudarc::driver::result::memset_d8_async(
                p,
                0,
                4 * self.base.world as usize,
                stream.cu_stream(),
            )
        }
        .map_err(cuda_err("cuMemsetD8Async"))?;
        self.masked_dead
            .store(0, std::sync::atomic::Ordering::Relaxed);
        Ok(())
    }

    fn last_tokens(&self) -> usize {
        self.last.lock().unwrap_or_else(|p| p.into_inner()).1 as usize
    }

    /// The send half of a dispatch: rows leave for their experts' ranks; returns once queued.
    /// Call [`super::MoeLowLatency::dispatch_recv`] (on this or another stream ordered after it) before
    /// reading the results.
    ///
    /// # Safety
    /// `x` holds `num_tokens * hidden` bf16 (16-byte aligned), `topk_idx` `num_tokens * topk`
    /// i32 (-1 or below `num_experts`, a token's experts distinct) and `topk_weights` as many
    /// f32 (the weights the combine applies), device memory of this GPU valid until the work on
    /// `stream` completes; `topk_idx` also until the matching combine has run.
    unsafe fn dispatch_send(
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

    unsafe fn dispatch_send_fp8(
        &self,
        _stream: &CudaStream,
        _x: u64,
        _scales: u64,
        _topk_idx: u64,
        _topk_weights: u64,
        _num_tokens: usize,
    ) -> Result<()> {
        Err(Error::invalid(
            "dispatch_send_fp8",
            "FP8 rows take the node-spanning path: on one node set DOORBELL_MOE_NET=1",
        ))
    }

    unsafe fn begin_fused_send(
        &self,
        topk_idx: u64,
        topk_weights: u64,
        num_tokens: usize,
    ) -> Result<FusedSend> {
        self.fused_args(topk_idx, topk_weights, num_tokens)
            .map(FusedSend::Nvlink)
    }

    /// The receive half: waits until every rank's rows of this dispatch have arrived, copies
    /// each row that crossed once into the slots of its token's other selections here, and
    /// writes the per-(expert, source) and per-expert counts.
    fn dispatch_recv(&self, stream: &CudaStream) -> Result<()> {
        self.own_layout("dispatch_recv")?;
        let args = crate::device_api::MoeLlArgs {
            call: self.last_call().0,
            ..self.base
        };
        self.launch(stream, 1, self.base.blocks, 512, &args)
    }

    /// Both halves, in one kernel.
    ///
    /// # Safety
    /// As for [`super::MoeLowLatency::dispatch_send`].
    unsafe fn dispatch(
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
    /// [`super::MoeLowLatency::results_of`] with the number of dispatches executed so far.
    fn results(&self) -> LowLatencyResults {
        self.results_of(self.dispatches.load(std::sync::atomic::Ordering::Relaxed))
    }

    /// Where the `n`-th dispatch (counting from 1, replays included) left its results.
    fn results_of(&self, n: u64) -> LowLatencyResults {
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
    fn combine_buffer(&self) -> u64 {
        self.base.y
    }

    /// The send half of a combine (after the expert kernels filled the combine buffer, on the
    /// same stream or one ordered after them): for each token that sent rows here, the sum of
    /// its selections' weight x output goes back to its rank; then every peer is signalled.
    fn combine_send(&self, stream: &CudaStream) -> Result<()> {
        self.own_layout("combine_send")?;
        let args = crate::device_api::MoeLlArgs {
            call: self.next_call(CallKind::MoeLlCombine, 0, Some(stream)),
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
    unsafe fn combine_recv(&self, stream: &CudaStream, out: u64) -> Result<()> {
        let args = crate::device_api::MoeLlArgs {
            call: self.last_call().1,
            ..self.combine_args(out)?
        };
        self.launch(stream, 4, self.base.blocks, 512, &args)
    }

    /// Both halves, in one kernel.
    ///
    /// # Safety
    /// As for [`super::MoeLowLatency::combine_recv`].
    unsafe fn combine(&self, stream: &CudaStream, out: u64) -> Result<()> {
        let args = crate::device_api::MoeLlArgs {
            call: self.next_call(CallKind::MoeLlCombine, 0, Some(stream)),
            ..self.combine_args(out)?
        };
        self.launch(stream, 5, self.base.blocks, 512, &args)
    }

    /// DeepEP's layout: the send half (the same kernel as doorbell's, without weights; it leaves
    /// its epoch in `out`'s ticket), or both halves in one kernel (every warp sends, then every
    /// block packs).
    unsafe fn dispatch_packed(
        &self,
        stream: &CudaStream,
        x: u64,
        topk_idx: u64,
        num_tokens: usize,
        out: &PackedOutputs,
        send_only: bool,
    ) -> Result<()> {
        self.packed_built()?;
        let o = self.with_outputs(self.base, out)?;
        if out.ids_i64 && topk_idx % 8 != 0 {
            return Err(Error::invalid("dispatch", "int64 topk_idx 8-byte aligned"));
        }
        // Checked before the call word is taken: a refused call takes none.
        let send = self.prepare_packed_send(x, topk_idx, num_tokens)?;
        let call = self.next_call(CallKind::MoeLlDispatch, 1, Some(stream));
        self.note_packed_send(out);
        if send_only {
            let args = crate::device_api::MoeLlArgs {
                call,
                ticket: out.ticket,
                // The send casts FP8 rows (FP8, ROUND) and reads int64 ids (IDS64); PACKED tells
                // `launch` this is DeepEP's layout. The outputs stay with the receive half.
                packed: o.packed & (packed::PACKED | packed::FP8 | packed::ROUND | packed::IDS64),
                ..send
            };
            return self.launch(stream, 0, self.base.blocks, 512, &args);
        }
        let args = crate::device_api::MoeLlArgs {
            x: send.x,
            topk_idx: send.topk_idx,
            topk_weights: 0,
            num_tokens: send.num_tokens,
            call,
            ..o
        };
        self.launch(stream, 2, self.base.blocks, 512, &args)
    }

    /// DeepEP's layout: the receive half, into `out`.
    unsafe fn dispatch_packed_recv(&self, stream: &CudaStream, out: &PackedOutputs) -> Result<()> {
        self.packed_built()?;
        self.check_packed_format(out)?;
        let args = crate::device_api::MoeLlArgs {
            call: self.last_call().0,
            ..self.with_outputs(self.base, out)?
        };
        // (with_outputs carries the ticket: the epoch of this output's own send.)
        self.launch(stream, 1, self.base.blocks, 512, &args)
    }

    /// DeepEP's layout: a combine's send half, receive half, or both in one kernel.
    unsafe fn combine_packed(&self, stream: &CudaStream, call: &PackedCombine) -> Result<()> {
        self.packed_built()?;
        let options = call.options;
        if call.ticket % 8 != 0 || options.wait_cycles % 8 != 0 {
            return Err(Error::invalid(
                "combine",
                "the ticket and wait_cycles 8-byte aligned",
            ));
        }
        let mut args = crate::device_api::MoeLlArgs {
            packed: packed::PACKED
                | if call.ids_i64 { packed::IDS64 } else { 0 }
                | if options.logfmt { packed::LOGFMT } else { 0 },
            ticket: call.ticket,
            wait_cycles: options.wait_cycles,
            ..self.base
        };
        // The call word carries the row format: a rank decoding log rows another sent as bf16
        // (or the reverse) is named at once.
        let variant = if options.logfmt { 3 } else { 1 };
        if let Some((y, h)) = call.checked_send()? {
            args.y = y;
            args.packed_src = h.src_info;
            args.packed_range = h.layout_range;
        }
        if let Some((topk_idx, topk_weights, num_tokens, out)) =
            call.checked_recv(self.cfg.max_tokens)?
        {
            args.topk_idx = topk_idx;
            args.topk_weights = topk_weights;
            args.num_tokens = num_tokens as u32;
            args.out = out;
        }
        let mut sends = self.combine_sends.lock().unwrap_or_else(|p| p.into_inner());
        match (call.send.is_some(), call.recv.is_some()) {
            (true, true) => {
                args.call = self.next_call(CallKind::MoeLlCombine, variant, Some(stream));
                sends.note(call.ticket, options.logfmt);
                self.launch(stream, 5, self.base.blocks, 512, &args)
            }
            (true, false) => {
                args.call = self.next_call(CallKind::MoeLlCombine, variant, Some(stream));
                sends.note(call.ticket, options.logfmt);
                self.launch(stream, 3, self.base.blocks, 512, &args)
            }
            (false, true) => {
                check_combine_format(sends.find(call.ticket), options.logfmt)?;
                drop(sends);
                args.call = self.last_call().1;
                self.launch(stream, 4, self.base.blocks, 512, &args)
            }
            (false, false) => Ok(()),
        }
    }
}
