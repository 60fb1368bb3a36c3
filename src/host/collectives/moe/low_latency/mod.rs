//! MoE dispatch and combine for decode (low latency): see [`MoeLowLatency`]. Paths:
//! `ll_nvlink.rs` (one node), `ll_net.rs` (across nodes, or on one node with
//! `DOORBELL_MOE_NET=1`).

use super::ll_net::LlNet;
use super::ll_nvlink::LlNvlink;
use super::path::LowLatencyPath;
use super::shared::{agree_shape, FusedSend, LowLatencyResults, MoeConfig};
use crate::communicator::Communicator;
use crate::error::{Error, Result};
use crate::gpu::cuda::cuda_err;
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

mod packed;

/// MoE dispatch and combine for decode (low latency), DeepEP's low-latency semantics: fixed
/// worst-case buffers sized from `max_tokens` per rank, a per-expert layout with one row per
/// selected (token, expert), counts only on the device, no count exchange before rows move,
/// CUDA-graph capturable, and send and receive halves callable separately so other work overlaps
/// the transfer. Kernels and protocol: `cuda/kernels/moe_ll.cu` and `doorbell/coll/moe_ll.cuh`.
///
/// Over NVLink a token's row crosses once per destination rank, however many of that rank's
/// experts it selected, and the receive half copies it into the other selections' slots as soon
/// as the sender announces it (in [`MoeLowLatency::dispatch_raw`], half of each block's warps copy
/// while the other half send); the
/// combine sums each rank's selections of a token there (weight x output, f32 in top-k order,
/// rounded to bf16) and sends that one partial sum back, where the token's rank adds the partial
/// sums in rank order (f32, rounded to bf16).
///
/// After a dispatch, rows sit at `[local expert][source rank][i]` for `i < layout[expert][source]`
/// (see [`LowLatencyResults`]), in the half of the receive area the dispatch's epoch picks: two
/// results may be alive at once. Expert kernels write their outputs for those rows at the same
/// places of [`MoeLowLatency::combine_buffer`]; [`MoeLowLatency::combine_raw`] then returns, for each
/// token, the sum over its experts of weight x output, with the weights given to the dispatch.
/// A token's experts must be distinct (a kernel reports an expert given more rows from one rank
/// than `max_tokens`).
///
/// When the communicator spans nodes (or with `DOORBELL_MOE_NET=1`), the node-spanning path runs
/// instead (`ll_net.rs`, `cuda/include/doorbell/coll/moe_net.cuh`): a token's row goes to each rank
/// holding one of its experts once, by NVLink stores inside the node and PortChannel puts (RDMA
/// WRITEs in any posting mode) to other nodes, and the receive half copies it into each selected
/// expert's slot; same layouts, same combine sums, and FP8 rows
/// ([`MoeLowLatency::dispatch_send_fp8_raw`]).
pub struct MoeLowLatency {
    path: Box<dyn LowLatencyPath>,
    cfg: MoeConfig,
    /// The typed calls' copies of `topk_idx` (the combine reads a dispatch's ids; two dispatches
    /// may be alive at once, so two copies, taken in turn), and the typed dispatches so far.
    ids: [CudaSlice<i32>; 2],
    typed: AtomicU64,
    world: usize,
}

impl MoeLowLatency {
    /// Allocates the receive areas and combine buffers (mapped by every same-node peer, and on
    /// the node-spanning path registered with the NIC). Collective. `cfg.max_tokens` is the
    /// decode batch per rank (DeepEP recommends under 256).
    pub fn new(comm: &Arc<Communicator>, cfg: MoeConfig) -> Result<MoeLowLatency> {
        let net = comm.spans_nodes() || comm.settings().moe_net;
        agree_shape(comm, "low-latency", net, &cfg)?;
        if net && cfg.rank_mask {
            // Checked on every rank alike (the shape agreed above carries the flag).
            return Err(Error::invalid(
                "config",
                "a rank mask (DeepEP's enable_shrink) is built on one node only for now; across \
                 nodes it is not yet",
            ));
        }
        let path: Box<dyn LowLatencyPath> = if net {
            Box::new(LlNet::new(comm, &cfg)?)
        } else {
            Box::new(LlNvlink::new(comm, cfg.clone())?)
        };
        let stream = comm.gpu().new_stream()?;
        let n = (cfg.max_tokens * cfg.topk).max(1);
        let alloc = || stream.alloc_zeros::<i32>(n).map_err(cuda_err("cuMemAlloc"));
        let ids = [alloc()?, alloc()?];
        stream
            .synchronize()
            .map_err(cuda_err("cuStreamSynchronize"))?;
        Ok(MoeLowLatency {
            path,
            cfg,
            ids,
            typed: AtomicU64::new(0),
            world: comm.world_size(),
        })
    }

    /// The send half of a dispatch on typed buffers (see [`MoeLowLatency::dispatch_send_raw`]):
    /// `x [tokens, hidden]` bf16, `topk_idx` and `topk_weights` `tokens x topk`, the sizes from
    /// the slices' lengths (refused before anything is sent when they disagree). `topk_idx` is
    /// copied into the exchange's own memory, so the combine reads it whatever the caller does
    /// with the slice afterwards; ids outside `-1..num_experts` are dropped (NVLink) or refused
    /// with a named error (across nodes), so no id can make a kernel write out of bounds.
    pub fn dispatch_send<X, I, W>(
        &self,
        stream: &CudaStream,
        x: &X,
        topk_idx: &I,
        topk_weights: &W,
    ) -> Result<()>
    where
        X: DevicePtr<half::bf16>,
        I: DevicePtr<i32>,
        W: DevicePtr<f32>,
    {
        let tokens = self.tokens_of(x.len(), topk_idx.len(), topk_weights.len())?;
        let ids = self.copy_ids(stream, topk_idx)?;
        let (xp, _x) = x.device_ptr(stream);
        let (wp, _w) = topk_weights.device_ptr(stream);
        // SAFETY: live cudarc allocations whose lengths were checked; the ids are this
        // exchange's copy, alive as long as it is.
        unsafe { self.dispatch_send_raw(stream, xp, ids, wp, tokens) }
    }

    /// Both halves of a dispatch on typed buffers (see [`MoeLowLatency::dispatch_send`]).
    pub fn dispatch<X, I, W>(
        &self,
        stream: &CudaStream,
        x: &X,
        topk_idx: &I,
        topk_weights: &W,
    ) -> Result<()>
    where
        X: DevicePtr<half::bf16>,
        I: DevicePtr<i32>,
        W: DevicePtr<f32>,
    {
        let tokens = self.tokens_of(x.len(), topk_idx.len(), topk_weights.len())?;
        let ids = self.copy_ids(stream, topk_idx)?;
        let (xp, _x) = x.device_ptr(stream);
        let (wp, _w) = topk_weights.device_ptr(stream);
        // SAFETY: as in `dispatch_send`.
        unsafe { self.dispatch_raw(stream, xp, ids, wp, tokens) }
    }

    /// The send half of an FP8 dispatch on typed buffers (see
    /// [`MoeLowLatency::dispatch_send_fp8_raw`]): `x` e4m3 bytes `[tokens, hidden]`, `scales`
    /// `[tokens, hidden / 128]` f32.
    pub fn dispatch_send_fp8<X, S, I, W>(
        &self,
        stream: &CudaStream,
        x: &X,
        scales: &S,
        topk_idx: &I,
        topk_weights: &W,
    ) -> Result<()>
    where
        X: DevicePtr<u8>,
        S: DevicePtr<f32>,
        I: DevicePtr<i32>,
        W: DevicePtr<f32>,
    {
        let tokens = self.tokens_of(x.len(), topk_idx.len(), topk_weights.len())?;
        let hidden = self.cfg.hidden;
        if hidden % 128 != 0 || scales.len() != tokens * (hidden / 128) {
            return Err(Error::invalid(
                "scales",
                format!(
                    "{} scales for {tokens} tokens of hidden {hidden}: one per 128 values",
                    scales.len()
                ),
            ));
        }
        let ids = self.copy_ids(stream, topk_idx)?;
        let (xp, _x) = x.device_ptr(stream);
        let (sp, _s) = scales.device_ptr(stream);
        let (wp, _w) = topk_weights.device_ptr(stream);
        // SAFETY: as in `dispatch_send`.
        unsafe { self.dispatch_send_fp8_raw(stream, xp, sp, ids, wp, tokens) }
    }

    /// The receive half of a combine into a typed `out` of at least the last dispatch's tokens
    /// (see [`MoeLowLatency::combine_recv_raw`]).
    pub fn combine_recv<O: DevicePtrMut<half::bf16>>(
        &self,
        stream: &CudaStream,
        out: &mut O,
    ) -> Result<()> {
        self.check_out(out.len())?;
        let (op, _o) = out.device_ptr_mut(stream);
        // SAFETY: a live cudarc allocation of at least the last dispatch's rows.
        unsafe { self.combine_recv_raw(stream, op) }
    }

    /// Both halves of a combine into a typed `out` (see [`MoeLowLatency::combine_recv`]).
    pub fn combine<O: DevicePtrMut<half::bf16>>(
        &self,
        stream: &CudaStream,
        out: &mut O,
    ) -> Result<()> {
        self.check_out(out.len())?;
        let (op, _o) = out.device_ptr_mut(stream);
        // SAFETY: as in `combine_recv`.
        unsafe { self.combine_raw(stream, op) }
    }

    /// Tokens of a dispatch from its slices' lengths.
    pub(super) fn tokens_of(&self, x: usize, idx: usize, weights: usize) -> Result<usize> {
        let cfg = &self.cfg;
        if cfg.hidden == 0 || x % cfg.hidden != 0 {
            return Err(Error::invalid(
                "x",
                format!("{x} values: a multiple of hidden {}", cfg.hidden),
            ));
        }
        let tokens = x / cfg.hidden;
        if idx != tokens * cfg.topk || weights != idx || tokens > cfg.max_tokens {
            return Err(Error::invalid(
                "topk_idx, topk_weights",
                format!(
                    "{idx} ids and {weights} weights for {tokens} tokens of top-{} (at most {} \
                     tokens): {} each",
                    cfg.topk,
                    cfg.max_tokens,
                    tokens * cfg.topk
                ),
            ));
        }
        Ok(tokens)
    }

    /// Copies `topk_idx` into the next of the exchange's two id buffers (on `stream`, before the
    /// dispatch) and returns its address.
    fn copy_ids<I: DevicePtr<i32>>(&self, stream: &CudaStream, topk_idx: &I) -> Result<u64> {
        let slot = (self.typed.fetch_add(1, Ordering::Relaxed) & 1) as usize;
        let (dst, _d) = self.ids[slot].device_ptr(stream);
        let (src, _s) = topk_idx.device_ptr(stream);
        let bytes = topk_idx.len() * std::mem::size_of::<i32>();
        if bytes > 0 {
            // SAFETY: both are live device allocations of this context; `dst` holds
            // max_tokens x topk i32, at least `bytes` (checked by `tokens_of`).
            unsafe {
                cudarc::driver::result::memcpy_dtod_async(dst, src, bytes, stream.cu_stream())
            }
            .map_err(cuda_err("cuMemcpyDtoDAsync"))?;
        }
        Ok(dst)
    }

    /// `out` holds at least the last dispatch's tokens.
    fn check_out(&self, out: usize) -> Result<()> {
        let need = self.path.last_tokens() * self.cfg.hidden;
        if out < need {
            return Err(Error::invalid(
                "out",
                format!("{out} values; the last dispatch's tokens need {need}"),
            ));
        }
        Ok(())
    }

    /// Whether the node-spanning path runs (NVLink stores to same-node ranks, the network to
    /// the others).
    pub fn spans_nodes(&self) -> bool {
        self.path.spans_nodes()
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
    pub unsafe fn dispatch_send_raw(
        &self,
        stream: &CudaStream,
        x: u64,
        topk_idx: u64,
        topk_weights: u64,
        num_tokens: usize,
    ) -> Result<()> {
        // SAFETY: as documented.
        unsafe {
            self.path
                .dispatch_send(stream, x, topk_idx, topk_weights, num_tokens)
        }
    }

    /// The send half of an FP8 dispatch (node-spanning path): `x` holds e4m3 bytes `[num_tokens,
    /// hidden]` and `scales` one f32 per 128 values (`[num_tokens, hidden / 128]`), cast by the
    /// caller as for [`super::MoeHighThroughput::dispatch_fp8`]. Rows arrive as
    /// e4m3 bytes in [`LowLatencyResults::recv_x`] (`hidden` bytes each) with their scales in
    /// [`LowLatencyResults::recv_scales`]; half the bytes of bf16 cross the wire. The combine
    /// stays bf16.
    ///
    /// # Safety
    /// `x` holds `num_tokens * hidden` bytes (16-byte aligned), `scales` `num_tokens * hidden /
    /// 128` f32, the top-k arrays as for [`MoeLowLatency::dispatch_send_raw`]; all valid until the
    /// work on `stream` completes.
    pub unsafe fn dispatch_send_fp8_raw(
        &self,
        stream: &CudaStream,
        x: u64,
        scales: u64,
        topk_idx: u64,
        topk_weights: u64,
        num_tokens: usize,
    ) -> Result<()> {
        // SAFETY: as documented.
        unsafe {
            self.path
                .dispatch_send_fp8(stream, x, scales, topk_idx, topk_weights, num_tokens)
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
    /// `topk_idx` and `topk_weights` as for [`MoeLowLatency::dispatch_send_raw`].
    pub unsafe fn begin_fused_send(
        &self,
        topk_idx: u64,
        topk_weights: u64,
        num_tokens: usize,
    ) -> Result<FusedSend> {
        // SAFETY: as documented.
        unsafe {
            self.path
                .begin_fused_send(topk_idx, topk_weights, num_tokens)
        }
    }

    /// The receive half: waits until every rank's rows of this dispatch have arrived, puts each
    /// row into the slots of its token's selections here, and writes the per-(expert, source)
    /// and per-expert counts.
    pub fn dispatch_recv(&self, stream: &CudaStream) -> Result<()> {
        self.path.dispatch_recv(stream)
    }

    /// Both halves (one kernel on the NVLink path, two launches on the node-spanning path).
    ///
    /// # Safety
    /// As for [`MoeLowLatency::dispatch_send_raw`].
    pub unsafe fn dispatch_raw(
        &self,
        stream: &CudaStream,
        x: u64,
        topk_idx: u64,
        topk_weights: u64,
        num_tokens: usize,
    ) -> Result<()> {
        // SAFETY: as documented.
        unsafe {
            self.path
                .dispatch(stream, x, topk_idx, topk_weights, num_tokens)
        }
    }

    /// Where the last dispatch issued from the host left its results (the half its epoch
    /// picked). Replays of a captured dispatch alternate halves too: use
    /// [`MoeLowLatency::results_of`] with the number of dispatches executed so far.
    pub fn results(&self) -> LowLatencyResults {
        self.path.results()
    }

    /// Where the `n`-th dispatch (counting from 1, replays included) left its results.
    pub fn results_of(&self, n: u64) -> LowLatencyResults {
        self.path.results_of(n)
    }

    /// This rank's combine buffer: `[local expert][source rank][max_tokens][hidden]` bf16, the
    /// receive layout; expert kernels write each row's output at its row's place.
    pub fn combine_buffer(&self) -> u64 {
        self.path.combine_buffer()
    }

    /// The rank mask (built with [`MoeConfig::with_rank_mask`]): `[world]` u32, 1 where a rank
    /// is masked; read it after the calls on a stream ordered after them (DeepEP's
    /// `low_latency_query_mask_buffer`). `None` without one.
    pub fn rank_mask(&self) -> Option<&CudaSlice<u32>> {
        self.path.rank_mask()
    }

    /// Masks `rank` (or unmasks it), on `stream`, for the calls issued after on it (DeepEP's
    /// `low_latency_update_mask_buffer`): a masked rank is sent nothing, waited for by no one,
    /// and its experts add nothing to a combine. Every live rank should mask the same ranks; a
    /// masked rank should make no calls of this object (its peers no longer expect them).
    pub fn set_rank_masked(&self, stream: &CudaStream, rank: usize, masked: bool) -> Result<()> {
        if self.path.rank_mask().is_none() {
            return Err(Error::invalid(
                "set_rank_masked",
                "build the MoeLowLatency with MoeConfig::with_rank_mask(true)",
            ));
        }
        if rank >= self.world {
            return Err(Error::invalid(
                "set_rank_masked",
                format!("a rank below {} (got {rank})", self.world),
            ));
        }
        self.path.set_rank_masked(stream, rank, masked)
    }

    /// Writes the peers found dead since the last call into the rank mask, on `stream` (each
    /// call does this before its kernel; a query of the mask after a call in which a peer died
    /// needs it first: that call left the peer out without writing the mask). With a rank mask
    /// the communicator tolerates peer loss: a dead peer is left out by this exchange, and every
    /// other call of the communicator fails naming it. Nothing without a mask.
    pub fn mask_dead_peers(&self, stream: &CudaStream) -> Result<()> {
        self.path.mask_dead_peers(stream)
    }

    /// Unmasks every rank, on `stream` (DeepEP's `low_latency_clean_mask_buffer`).
    /// A peer still dead is masked again at the next call.
    pub fn clean_rank_mask(&self, stream: &CudaStream) -> Result<()> {
        if self.path.rank_mask().is_none() {
            return Err(Error::invalid(
                "clean_rank_mask",
                "build the MoeLowLatency with MoeConfig::with_rank_mask(true)",
            ));
        }
        self.path.clean_rank_mask(stream)
    }

    /// The send half of a combine (after the expert kernels filled the combine buffer, on the
    /// same stream or one ordered after them): for each token that sent rows here, the sum of
    /// its selections' weight x output goes back to its rank; then every peer is signalled.
    pub fn combine_send(&self, stream: &CudaStream) -> Result<()> {
        self.path.combine_send(stream)
    }

    /// The receive half (on the stream of the send half, or one ordered after it): waits for
    /// every peer's partial sums, then writes `out [num_tokens, hidden]`: for each token of the
    /// last dispatch, the sum over its experts of weight x output.
    ///
    /// # Safety
    /// `out` holds `num_tokens * hidden` bf16 (16-byte aligned) of the last dispatch, device
    /// memory of this GPU valid until `stream` has run it.
    pub unsafe fn combine_recv_raw(&self, stream: &CudaStream, out: u64) -> Result<()> {
        // SAFETY: as documented.
        unsafe { self.path.combine_recv(stream, out) }
    }

    /// Both halves (one kernel on the NVLink path, two launches on the node-spanning path).
    ///
    /// # Safety
    /// As for [`MoeLowLatency::combine_recv_raw`].
    pub unsafe fn combine_raw(&self, stream: &CudaStream, out: u64) -> Result<()> {
        // SAFETY: as documented.
        unsafe { self.path.combine(stream, out) }
    }
}
