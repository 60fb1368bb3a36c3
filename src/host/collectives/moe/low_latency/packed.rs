//! The low-latency MoE calls in DeepEP's own layout (`doorbell.deep_ep`'s `low_latency_*`):
//! packed outputs (one row per received token and local expert, FP8 or bf16, with their
//! scales), the source info and layout range, and the combines that read them back.

use super::MoeLowLatency;
use crate::collectives::moe::packed::{
    PackedBuffers, PackedCombine, PackedCombineOptions, PackedFormat, PackedHandle, PackedOutputs,
};
use crate::error::{Error, Result};
use crate::gpu::cuda::cuda_err;
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
use std::sync::Arc;

impl MoeLowLatency {
    /// Outputs for [`MoeLowLatency::dispatch_packed`] in `format`, sized for this exchange (two
    /// may be alive at once, as with DeepEP: allocate two and take them in turn).
    pub fn packed_buffers(
        &self,
        stream: &Arc<CudaStream>,
        format: PackedFormat,
    ) -> Result<PackedBuffers> {
        let cfg = &self.cfg;
        let local = self.local_experts();
        let ranks = self.world();
        let cap = ranks * cfg.max_tokens;
        let (row_bytes, scale_bytes) = self.packed_bytes(format);
        let alloc_u8 = |n: usize| {
            stream
                .alloc_zeros::<u8>(n.max(1))
                .map_err(cuda_err("cuMemAlloc"))
        };
        Ok(PackedBuffers {
            x: alloc_u8(local * cap * row_bytes)?,
            scales: match format {
                PackedFormat::Bf16 => None,
                PackedFormat::Fp8 { .. } => Some(alloc_u8(local * cap * scale_bytes)?),
            },
            src_info: stream
                .alloc_zeros::<i32>((local * cap).max(1))
                .map_err(cuda_err("cuMemAlloc"))?,
            layout_range: stream
                .alloc_zeros::<i64>((local * ranks).max(1))
                .map_err(cuda_err("cuMemAlloc"))?,
            count: stream
                .alloc_zeros::<i32>(local.max(1))
                .map_err(cuda_err("cuMemAlloc"))?,
            ticket: stream
                .alloc_zeros::<u64>(2)
                .map_err(cuda_err("cuMemAlloc"))?,
            format,
        })
    }

    /// DeepEP's low-latency dispatch on typed buffers (see [`MoeLowLatency::dispatch_packed_raw`]):
    /// `x [tokens, hidden]` bf16, `topk_idx [tokens, topk]` (sizes from the slices' lengths),
    /// results in `out` (from [`MoeLowLatency::packed_buffers`]), the counts added to `stats`
    /// (`[local experts]`) when given. Ids outside `0..num_experts` select nothing.
    pub fn dispatch_packed<X, I>(
        &self,
        stream: &CudaStream,
        x: &X,
        topk_idx: &I,
        out: &mut PackedBuffers,
        stats: Option<&mut CudaSlice<i32>>,
    ) -> Result<()>
    where
        X: DevicePtr<half::bf16>,
        I: DevicePtr<i32>,
    {
        let tokens = self.tokens_of(x.len(), topk_idx.len(), topk_idx.len())?;
        self.check_outputs(out, stats.as_deref())?;
        let format = out.format;
        let (xp, _x) = x.device_ptr(stream);
        let (ip, _i) = topk_idx.device_ptr(stream);
        let (op, _o) = out.x.device_ptr_mut(stream);
        let (sp, _s) = out.src_info.device_ptr_mut(stream);
        let (rp, _r) = out.layout_range.device_ptr_mut(stream);
        let (cp, _c) = out.count.device_ptr_mut(stream);
        let (tp, _t) = out.ticket.device_ptr_mut(stream);
        let mut o = PackedOutputs::new(op, sp, rp, cp).with_ticket(tp);
        let _scales = match (format, out.scales.as_mut()) {
            (PackedFormat::Fp8 { round_scale, ue8m0 }, Some(scales)) => {
                let (p, g) = scales.device_ptr_mut(stream);
                o = o.with_fp8(p, round_scale, ue8m0);
                Some(g)
            }
            _ => None,
        };
        let _stats = stats.map(|s| {
            let (p, g) = s.device_ptr_mut(stream);
            o = o.with_stats(p);
            g
        });
        // SAFETY: live cudarc allocations; `out` was sized for this exchange and its format,
        // `stats` checked; the kernels bound every id and count they read.
        unsafe { self.dispatch_packed_raw(stream, xp, ip, tokens, &o) }
    }

    /// DeepEP's low-latency combine on typed buffers (see [`MoeLowLatency::combine_packed_raw`]):
    /// `y [local experts][world x max_tokens][hidden]` bf16 (the experts' outputs at the rows'
    /// places of `handle`, the dispatch's [`PackedBuffers`]), `topk_idx` and `topk_weights`
    /// `[tokens, topk]`, `out [tokens, hidden]` bf16.
    pub fn combine_packed<Y, I, W, O>(
        &self,
        stream: &CudaStream,
        y: &Y,
        handle: &PackedBuffers,
        topk_idx: &I,
        topk_weights: &W,
        out: &mut O,
    ) -> Result<()>
    where
        Y: DevicePtr<half::bf16>,
        I: DevicePtr<i32>,
        W: DevicePtr<f32>,
        O: DevicePtrMut<half::bf16>,
    {
        let cfg = &self.cfg;
        let rows = self.local_experts() * self.world() * cfg.max_tokens * cfg.hidden;
        if y.len() != rows
            || handle.src_info.len()
                != (self.local_experts() * self.world() * cfg.max_tokens).max(1)
            || handle.layout_range.len() != (self.local_experts() * self.world()).max(1)
        {
            return Err(Error::invalid(
                "y, handle",
                format!(
                    "y of {} values and a handle of this exchange: {rows} values (local experts x \
                     world x max_tokens x hidden)",
                    y.len()
                ),
            ));
        }
        let tokens = topk_idx.len() / cfg.topk.max(1);
        if topk_idx.len() != tokens * cfg.topk
            || topk_weights.len() != topk_idx.len()
            || out.len() < tokens * cfg.hidden
        {
            return Err(Error::invalid(
                "topk_idx, topk_weights, out",
                format!(
                    "{} ids, {} weights and {} outputs: top-{} per token, as many weights, hidden {} \
                     outputs per token",
                    topk_idx.len(),
                    topk_weights.len(),
                    out.len(),
                    cfg.topk,
                    cfg.hidden
                ),
            ));
        }
        let (yp, _y) = y.device_ptr(stream);
        let (sp, _s) = handle.src_info.device_ptr(stream);
        let (rp, _r) = handle.layout_range.device_ptr(stream);
        let (ip, _i) = topk_idx.device_ptr(stream);
        let (wp, _w) = topk_weights.device_ptr(stream);
        let (op, _o) = out.device_ptr_mut(stream);
        let h = PackedHandle {
            src_info: sp,
            layout_range: rp,
        };
        // SAFETY: live cudarc allocations of the sizes checked above; the kernels bound the
        // handle's tokens and ranges and every id.
        unsafe { self.combine_packed_raw(stream, yp, &h, ip, wp, tokens, op) }
    }

    /// Checks that `out` and `stats` belong to this exchange.
    fn check_outputs(&self, out: &PackedBuffers, stats: Option<&CudaSlice<i32>>) -> Result<()> {
        let local = self.local_experts();
        let cfg = &self.cfg;
        let cap = self.world() * cfg.max_tokens;
        let (row_bytes, scale_bytes) = self.packed_bytes(out.format);
        let scales_fit = match (&out.scales, out.format) {
            (None, PackedFormat::Bf16) => true,
            (Some(s), PackedFormat::Fp8 { .. }) => s.len() == (local * cap * scale_bytes).max(1),
            _ => false,
        };
        if out.count.len() != local.max(1)
            || out.layout_range.len() != (local * self.world()).max(1)
            || out.x.len() != (local * cap * row_bytes).max(1)
            || out.src_info.len() != (local * cap).max(1)
            || !scales_fit
        {
            return Err(Error::invalid(
                "out",
                "PackedBuffers of this exchange (MoeLowLatency::packed_buffers)",
            ));
        }
        match stats {
            Some(s) if s.len() != local => Err(Error::invalid(
                "stats",
                format!("{} counters; one per local expert ({local})", s.len()),
            )),
            _ => Ok(()),
        }
    }

    /// Bytes of one packed row and of its scales in `format`.
    fn packed_bytes(&self, format: PackedFormat) -> (usize, usize) {
        let hidden = self.cfg.hidden;
        match format {
            PackedFormat::Bf16 => (2 * hidden, 0),
            PackedFormat::Fp8 { ue8m0: true, .. } => (hidden, hidden / 512 * 4),
            PackedFormat::Fp8 { .. } => (hidden, hidden / 128 * 4),
        }
    }

    fn local_experts(&self) -> usize {
        self.cfg.num_experts / self.world().max(1)
    }

    fn world(&self) -> usize {
        self.world
    }

    /// DeepEP's low-latency dispatch (built with [`crate::collectives::moe::MoeConfig::with_deep_ep_layout`]), both
    /// halves: `x [num_tokens, hidden]` bf16 goes to the ranks of its `topk_idx [num_tokens,
    /// topk]` i32 experts (-1: none), and `out` receives this rank's rows packed per local
    /// expert, source rank 0's first, with their source tokens, ranges and counts (see
    /// [`PackedOutputs`]), cast to e4m3 when `out` asks. No weights travel: the combine takes
    /// them. On one node one kernel; across nodes (or with `DOORBELL_MOE_NET`) a prep kernel
    /// (ids, the FP8 cast once per token, so e4m3 crosses), the node-spanning send and
    /// receive, and a pack kernel; there one dispatch and one combine are in flight at a time
    /// (a send's staging half is reused two sends later, and only a receive in between proves
    /// the NIC read it), and a combine takes the handle of one of the last two dispatches
    /// received (each refused by name otherwise).
    ///
    /// # Safety
    /// `x` holds `num_tokens * hidden` bf16 (16-byte aligned), `topk_idx` `num_tokens * topk`
    /// i32 (i64 with [`PackedOutputs::with_i64_ids`]; a token's experts distinct), `out`'s arrays
    /// their documented sizes; device memory of this GPU valid until the work on `stream`
    /// completes.
    pub unsafe fn dispatch_packed_raw(
        &self,
        stream: &CudaStream,
        x: u64,
        topk_idx: u64,
        num_tokens: usize,
        out: &PackedOutputs,
    ) -> Result<()> {
        // SAFETY: as documented.
        unsafe {
            self.path
                .dispatch_packed(stream, x, topk_idx, num_tokens, out, false)
        }
    }

    /// The send half of [`MoeLowLatency::dispatch_packed_raw`] (DeepEP's `return_recv_hook`):
    /// rows leave; [`MoeLowLatency::dispatch_packed_recv_raw`] with the same `out` later writes
    /// the outputs. The send reads `out`'s row format (with FP8 scales it casts each row once,
    /// rounding the scales with `round_scale`, and e4m3 crosses) and writes only `out`'s ticket
    /// (give one when another dispatch may be sent before this one's receive half runs: two may
    /// be in flight).
    ///
    /// # Safety
    /// `x` and `topk_idx` as for [`MoeLowLatency::dispatch_packed_raw`]; `out.ticket` 0 or two
    /// u64 of device memory valid until the receive half has run.
    pub unsafe fn dispatch_packed_send_raw(
        &self,
        stream: &CudaStream,
        x: u64,
        topk_idx: u64,
        num_tokens: usize,
        out: &PackedOutputs,
    ) -> Result<()> {
        // SAFETY: as documented.
        unsafe {
            self.path
                .dispatch_packed(stream, x, topk_idx, num_tokens, out, true)
        }
    }

    /// The receive half of [`MoeLowLatency::dispatch_packed_raw`]: waits for every rank's rows of
    /// the send that `out`'s ticket names (without one, the last send) and writes `out`. Refused
    /// (`InvalidArgument`, nothing launched) when `out`'s row format (FP8 or bf16) is not the one
    /// that send was given.
    ///
    /// # Safety
    /// `out`'s arrays their documented sizes, valid until `stream` has run it.
    pub unsafe fn dispatch_packed_recv_raw(
        &self,
        stream: &CudaStream,
        out: &PackedOutputs,
    ) -> Result<()> {
        // SAFETY: as documented.
        unsafe { self.path.dispatch_packed_recv(stream, out) }
    }

    /// DeepEP's low-latency combine, both halves in one kernel: every row of the dispatch that
    /// `handle` names, read from `y [local experts][world x max_tokens][hidden]` bf16 (the
    /// experts' outputs at their rows' places), goes back to its token's rank; then `out
    /// [num_tokens, hidden]` bf16 gets, for each token, the sum over its top-k of
    /// `topk_weights x` the row its expert returned (f32 in top-k order; ids of -1 add nothing).
    /// `topk_idx` and `topk_weights` (i32 and f32, `num_tokens x topk`) are the dispatch's ids and
    /// the weights to apply.
    ///
    /// # Safety
    /// All device memory of this GPU of the sizes above (`handle` as the dispatch wrote it),
    /// valid until the work on `stream` completes.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn combine_packed_raw(
        &self,
        stream: &CudaStream,
        y: u64,
        handle: &PackedHandle,
        topk_idx: u64,
        topk_weights: u64,
        num_tokens: usize,
        out: u64,
    ) -> Result<()> {
        // SAFETY: as documented.
        unsafe {
            self.combine_packed_ids_raw(
                stream,
                y,
                handle,
                (topk_idx, false),
                topk_weights,
                num_tokens,
                out,
            )
        }
    }

    /// [`MoeLowLatency::combine_packed_raw`] with `topk_idx` given as `(address, int64)`: with
    /// `int64` true the ids are DeepEP's int64 (8-byte aligned), read as such.
    ///
    /// # Safety
    /// As for [`MoeLowLatency::combine_packed_raw`] (int64 ids: `num_tokens x topk` i64).
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn combine_packed_ids_raw(
        &self,
        stream: &CudaStream,
        y: u64,
        handle: &PackedHandle,
        topk_idx: (u64, bool),
        topk_weights: u64,
        num_tokens: usize,
        out: u64,
    ) -> Result<()> {
        // SAFETY: as documented (no options).
        unsafe {
            self.combine_packed_with_raw(
                stream,
                y,
                handle,
                topk_idx,
                topk_weights,
                num_tokens,
                out,
                &PackedCombineOptions::new(),
            )
        }
    }

    /// [`MoeLowLatency::combine_packed_ids_raw`] with `options`: wait statistics and log rows
    /// (see [`PackedCombineOptions`]).
    ///
    /// # Safety
    /// As for [`MoeLowLatency::combine_packed_ids_raw`]; `options.wait_cycles` 0 or `[world]`
    /// i64 valid until the work on `stream` completes.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn combine_packed_with_raw(
        &self,
        stream: &CudaStream,
        y: u64,
        handle: &PackedHandle,
        topk_idx: (u64, bool),
        topk_weights: u64,
        num_tokens: usize,
        out: u64,
        options: &PackedCombineOptions,
    ) -> Result<()> {
        let (topk_idx, ids_i64) = topk_idx;
        let recv = (topk_idx, topk_weights, num_tokens, out);
        // SAFETY: as documented.
        unsafe { self.combine_call(stream, 0, ids_i64, Some((y, *handle)), Some(recv), options) }
    }

    /// [`MoeLowLatency::combine_packed_send_raw`] with `options` (its `logfmt` must be the
    /// receive half's).
    ///
    /// # Safety
    /// As for [`MoeLowLatency::combine_packed_send_raw`].
    pub unsafe fn combine_packed_send_with_raw(
        &self,
        stream: &CudaStream,
        y: u64,
        handle: &PackedHandle,
        ticket: u64,
        options: &PackedCombineOptions,
    ) -> Result<()> {
        // SAFETY: as documented.
        unsafe { self.combine_call(stream, ticket, false, Some((y, *handle)), None, options) }
    }

    /// [`MoeLowLatency::combine_packed_recv_ids_raw`] with `options` (its `logfmt` must be the
    /// send half's).
    ///
    /// # Safety
    /// As for [`MoeLowLatency::combine_packed_recv_ids_raw`]; `options.wait_cycles` as for
    /// [`MoeLowLatency::combine_packed_with_raw`].
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn combine_packed_recv_with_raw(
        &self,
        stream: &CudaStream,
        topk_idx: (u64, bool),
        topk_weights: u64,
        num_tokens: usize,
        out: u64,
        ticket: u64,
        options: &PackedCombineOptions,
    ) -> Result<()> {
        let (topk_idx, ids_i64) = topk_idx;
        let recv = (topk_idx, topk_weights, num_tokens, out);
        // SAFETY: as documented.
        unsafe { self.combine_call(stream, ticket, ids_i64, None, Some(recv), options) }
    }

    /// Runs a packed combine's halves (`send`: `y` and its handle; `recv`: `(topk_idx,
    /// topk_weights, num_tokens, out)`) on this exchange's path.
    ///
    /// # Safety
    /// As for the `combine_packed_*_raw` calls that build it.
    unsafe fn combine_call(
        &self,
        stream: &CudaStream,
        ticket: u64,
        ids_i64: bool,
        send: Option<(u64, PackedHandle)>,
        recv: Option<(u64, u64, usize, u64)>,
        options: &PackedCombineOptions,
    ) -> Result<()> {
        let call = PackedCombine {
            ticket,
            ids_i64,
            send,
            recv,
            options: *options,
        };
        // SAFETY: as the caller vouches.
        unsafe { self.path.combine_packed(stream, &call) }
    }

    /// The send half of [`MoeLowLatency::combine_packed_raw`]; it leaves its call and its
    /// call-check ordinal in `ticket` (two u64 of device memory, or 0) for
    /// [`MoeLowLatency::combine_packed_recv_raw`], which then pairs with this send even when
    /// another combine was sent in between (their receive halves in either order).
    ///
    /// # Safety
    /// `y` and `handle` as for [`MoeLowLatency::combine_packed_raw`]; `ticket` 0 or valid until
    /// the receive half has run.
    pub unsafe fn combine_packed_send_raw(
        &self,
        stream: &CudaStream,
        y: u64,
        handle: &PackedHandle,
        ticket: u64,
    ) -> Result<()> {
        // SAFETY: as documented (no options).
        unsafe {
            self.combine_packed_send_with_raw(
                stream,
                y,
                handle,
                ticket,
                &PackedCombineOptions::new(),
            )
        }
    }

    /// The receive half of [`MoeLowLatency::combine_packed_raw`] (after its send half, whose
    /// `ticket` it takes: 0 pairs it with the last send).
    ///
    /// # Safety
    /// `topk_idx`, `topk_weights` and `out` as for [`MoeLowLatency::combine_packed_raw`].
    pub unsafe fn combine_packed_recv_raw(
        &self,
        stream: &CudaStream,
        topk_idx: u64,
        topk_weights: u64,
        num_tokens: usize,
        out: u64,
        ticket: u64,
    ) -> Result<()> {
        // SAFETY: as documented.
        unsafe {
            self.combine_packed_recv_ids_raw(
                stream,
                (topk_idx, false),
                topk_weights,
                num_tokens,
                out,
                ticket,
            )
        }
    }

    /// [`MoeLowLatency::combine_packed_recv_raw`] with `topk_idx` as `(address, int64)` (see
    /// [`MoeLowLatency::combine_packed_ids_raw`]).
    ///
    /// # Safety
    /// As for [`MoeLowLatency::combine_packed_recv_raw`].
    pub unsafe fn combine_packed_recv_ids_raw(
        &self,
        stream: &CudaStream,
        topk_idx: (u64, bool),
        topk_weights: u64,
        num_tokens: usize,
        out: u64,
        ticket: u64,
    ) -> Result<()> {
        // SAFETY: as documented (no options).
        unsafe {
            self.combine_packed_recv_with_raw(
                stream,
                topk_idx,
                topk_weights,
                num_tokens,
                out,
                ticket,
                &PackedCombineOptions::new(),
            )
        }
    }
}
