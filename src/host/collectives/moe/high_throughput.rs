//! MoE expert dispatch and combine, high-throughput layout: each token goes to every destination
//! rank once, however many of that rank's experts it selected (DeepEP's "normal" semantics).
//!
//! - [`MoeHighThroughput::dispatch_raw`] takes `x [T, H]` bf16, `topk_idx [T, K]` i32 (-1: no
//!   expert) and `topk_weights [T, K]` f32, and leaves in device memory this rank's received rows
//!   in source-rank order: `recv_x [N, H]`, `recv_idx [N, K]` (the expert ids rebased to this
//!   rank's local ids, -1 for experts elsewhere), `recv_weights [N, K]`, `recv_src [N, 2]` (source
//!   rank, source token), `num_recv` (N) and `expert_counts [E_local]`: the counts never leave the
//!   device, so the whole exchange is CUDA-graph capturable. Buffers are sized for the worst case
//!   (`max_tokens` per rank from every rank) once, in [`MoeHighThroughput::new`].
//! - [`MoeHighThroughput::combine_raw`] takes `y [N, H]` bf16, row `i` being what this rank's experts
//!   made of received row `i`, already weighted and summed over this rank's experts of that token
//!   (an expert GEMM's epilogue multiplies by `recv_weights`), and returns `out [T, H]`: for each
//!   token, the sum over the ranks it went to, so `out[t] = sum_k w[t,k] expert_k(x[t])`. Sums
//!   run in f32 in rank order (deterministic).
//! - [`MoeHighThroughput::dispatch_fp8_raw`] moves e4m3 rows with one f32 scale per 128 values instead
//!   (the caller casts, as with DeepEP's normal kernels); combine stays bf16.
//!
//! Paths: `ht_nvlink.rs` (one node), `ht_net.rs` (across nodes).

use super::ht_net::HtNet;
use super::ht_nvlink::HtNvlink;
use super::path::HighThroughputPath;
use super::shared::{agree_shape, DispatchResults, MoeConfig};
use crate::communicator::Communicator;
use crate::error::{Error, Result};
use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut};
use std::sync::Arc;

/// Dispatch/combine state of one communicator. Build it once (collective); call dispatch then
/// combine, in the same order on every rank.
///
/// When the communicator spans nodes (of equal size), the node-spanning path runs instead
/// (DeepEP's hierarchical scheme, `ht_net.rs`): a token crosses the network once per
/// destination node, to the rank of the same local index there, which forwards it inside its
/// node with this NVLink exchange; the combine sums inside the node first and sends one row per
/// (token, node) back. Same results, except that rows arrive grouped by forwarding rank (then
/// by source node and token), not in source-rank order (`recv_src` names each row's origin), and
/// the combine adds the ranks' outputs in rank order inside each node, then the nodes' sums in
/// node order.
pub struct MoeHighThroughput {
    path: Box<dyn HighThroughputPath>,
}

impl MoeHighThroughput {
    /// Allocates the area areas (mapped by every same-node peer; on the node-spanning path
    /// also registered with the NIC), outputs and semaphores. Collective.
    pub fn new(comm: &Arc<Communicator>, cfg: MoeConfig) -> Result<MoeHighThroughput> {
        let spans = comm.spans_nodes();
        agree_shape(comm, "high-throughput", spans, &cfg)?;
        let path: Box<dyn HighThroughputPath> = if spans {
            Box::new(HtNet::new(comm, &cfg)?)
        } else {
            Box::new(HtNvlink::new(comm, cfg)?)
        };
        Ok(MoeHighThroughput { path })
    }

    /// Whether the node-spanning path runs.
    pub fn spans_nodes(&self) -> bool {
        self.path.spans_nodes()
    }

    /// Node-spanning path: the device address of `[nodes]` u32, the rows each node's rank of
    /// this rank's local index sent here over the network in the last dispatch (each token at
    /// most once), and the node count.
    pub fn network_rows(&self) -> Option<(u64, usize)> {
        self.path.network_rows()
    }

    /// Node-spanning path: bytes of this rank's network receive rings (every source node's),
    /// and what rings sized for the worst case (`max_tokens` tokens from every node) would take.
    pub fn network_ring_bytes(&self) -> Option<(u64, u64)> {
        self.path.network_ring_bytes()
    }

    /// Dispatches `num_tokens` tokens (see the module documentation).
    ///
    /// # Safety
    /// `x` holds `num_tokens * hidden` bf16 (16-byte aligned), `topk_idx` and `topk_weights`
    /// `num_tokens * topk` i32 / f32, device memory of this GPU valid until the work on `stream`
    /// completes; every id is -1 or below `num_experts`.
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

    /// Dispatches FP8 tokens (see the NVLink path's contract, the same on both paths): `x` holds
    /// e4m3 bytes `[num_tokens, hidden]` and `scales` one f32 per 128 values; rows arrive as
    /// bytes in `recv_x` and the scales in [`DispatchResults::recv_scales`]. Combine stays bf16.
    ///
    /// # Safety
    /// `x` holds `num_tokens * hidden` bytes (16-byte aligned), `scales` `num_tokens * hidden /
    /// 128` f32, the top-k arrays as for [`MoeHighThroughput::dispatch_raw`]; all valid until the work on
    /// `stream` completes.
    pub unsafe fn dispatch_fp8_raw(
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
                .dispatch_fp8(stream, x, scales, topk_idx, topk_weights, num_tokens)
        }
    }

    /// Dispatches `num_tokens` rows routed by ranks instead of experts (DeepEP's dispatch by
    /// `is_token_in_rank`): `in_rank [num_tokens, world]` bool says which ranks each token goes to
    /// (each once); rows arrive as from [`MoeHighThroughput::dispatch_raw`], with no ids or weights
    /// (`recv_idx`, `recv_weights` are not written). `tokens_per_expert [num_experts]` i32, this
    /// rank's rows per expert, is summed over the sources into each rank's `expert_counts` (0: the
    /// counts are left 0). `scales` nonzero: `x` holds e4m3 rows with their scales, as for
    /// [`MoeHighThroughput::dispatch_fp8_raw`] (a rank with no tokens in an FP8 call passes any
    /// nonzero 4-byte aligned value: nothing is read, and the call stays FP8 on every rank; its
    /// `in_rank` may be 0). Across nodes a token crosses once per node holding one of its ranks,
    /// and the counts of each node's experts travel with the first chunk to that node.
    ///
    /// # Safety
    /// `x` (and `scales`) as for [`MoeHighThroughput::dispatch_raw`] (or `dispatch_fp8_raw`), `in_rank`
    /// `num_tokens * world` bytes, `tokens_per_expert` `num_experts` i32 or 0; all valid until the
    /// work on `stream` completes.
    pub unsafe fn dispatch_by_rank_raw(
        &self,
        stream: &CudaStream,
        x: u64,
        scales: u64,
        in_rank: u64,
        tokens_per_expert: u64,
        num_tokens: usize,
    ) -> Result<()> {
        // Both paths take FP8 rows only in whole groups of 128 with aligned scales.
        let hidden = self.path.config().hidden;
        if scales != 0 && (hidden % 128 != 0 || scales % 4 != 0) {
            return Err(crate::error::Error::invalid(
                "scales",
                "FP8 rows: a hidden size that is a multiple of 128 and 4-byte aligned scales",
            ));
        }
        // SAFETY: as documented.
        unsafe {
            self.path
                .dispatch_by_rank(stream, x, scales, in_rank, tokens_per_expert, num_tokens)
        }
    }

    /// Combines `y` (one row per received row of the dispatch in the current receive slot: the
    /// last one unless [`MoeHighThroughput::set_receive_slot`] pointed back) into `out
    /// [num_tokens, H]` (see the module documentation).
    ///
    /// # Safety
    /// `y` holds at least `num_recv * hidden` bf16 and `out` `num_tokens * hidden` bf16 of that
    /// dispatch (both 16-byte aligned), device memory of this GPU valid until the work on
    /// `stream` completes.
    pub unsafe fn combine_raw(&self, stream: &CudaStream, y: u64, out: u64) -> Result<()> {
        // SAFETY: as documented.
        unsafe { self.path.combine(stream, y, out, None) }
    }

    /// [`MoeHighThroughput::combine_raw`], and the rows' top-k weights summed the same way:
    /// `out_weights [num_tokens, topk]` f32 gets, for each token, the sum over the ranks it went
    /// to of that rank's `y_weights` row (DeepEP's `combined_topk_weights`; f32 in rank order on
    /// one node; across nodes summed inside each node in rank order, then over the nodes in
    /// node order).
    ///
    /// # Safety
    /// As for [`MoeHighThroughput::combine_raw`]; `y_weights` holds `num_recv * topk` f32 and
    /// `out_weights` `num_tokens * topk` f32 (both 4-byte aligned), valid until the work on
    /// `stream` completes.
    pub unsafe fn combine_with_weights_raw(
        &self,
        stream: &CudaStream,
        y: u64,
        out: u64,
        y_weights: u64,
        out_weights: u64,
    ) -> Result<()> {
        if y_weights == 0 || out_weights == 0 || y_weights % 4 != 0 || out_weights % 4 != 0 {
            return Err(crate::error::Error::invalid(
                "combine weights",
                "y_weights and out_weights: 4-byte aligned device addresses",
            ));
        }
        // SAFETY: as documented.
        unsafe {
            self.path
                .combine(stream, y, out, Some((y_weights, out_weights)))
        }
    }

    /// Dispatches the tokens of `x` (`[tokens, hidden]` bf16; see the module documentation).
    /// The slices' lengths give the sizes: `topk_idx` and `topk_weights` hold `tokens x topk`
    /// values. Ids outside `-1..num_experts` are dropped on the NVLink path and refused on the
    /// node-spanning one (a named error), so no id can make the kernels write out of bounds.
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
        let (xp, _x) = x.device_ptr(stream);
        let (ip, _i) = topk_idx.device_ptr(stream);
        let (wp, _w) = topk_weights.device_ptr(stream);
        // SAFETY: live cudarc allocations of this context whose lengths were checked above; their
        // guards order the stream's work before any reuse.
        unsafe { self.dispatch_raw(stream, xp, ip, wp, tokens) }
    }

    /// [`MoeHighThroughput::dispatch`] with FP8 rows: `x` holds e4m3 bytes `[tokens, hidden]`,
    /// `scales` `[tokens, hidden / 128]` f32.
    pub fn dispatch_fp8<X, S, I, W>(
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
        let hidden = self.config().hidden;
        let tokens = self.tokens_of(x.len(), topk_idx.len(), topk_weights.len())?;
        if hidden % 128 != 0 || scales.len() != tokens * (hidden / 128) {
            return Err(Error::invalid(
                "scales",
                format!(
                    "{} scales for {tokens} tokens of hidden {hidden}: one per 128 values",
                    scales.len()
                ),
            ));
        }
        let (xp, _x) = x.device_ptr(stream);
        let (sp, _s) = scales.device_ptr(stream);
        let (ip, _i) = topk_idx.device_ptr(stream);
        let (wp, _w) = topk_weights.device_ptr(stream);
        // SAFETY: as in `dispatch`.
        unsafe { self.dispatch_fp8_raw(stream, xp, sp, ip, wp, tokens) }
    }

    /// Combines `y` into `out` (see the module documentation): `y` spans every row a dispatch
    /// can leave here (`world x max_tokens` rows of `hidden` bf16, [`DispatchResults::max_rows`]),
    /// so that whatever the device's row count the kernels stay inside it; `out` holds at least
    /// the last dispatch's tokens.
    pub fn combine<Y, O>(&self, stream: &CudaStream, y: &Y, out: &mut O) -> Result<()>
    where
        Y: DevicePtr<half::bf16>,
        O: DevicePtrMut<half::bf16>,
    {
        self.check_combine(y.len(), out.len())?;
        let (yp, _y) = y.device_ptr(stream);
        let (op, _o) = out.device_ptr_mut(stream);
        // SAFETY: live cudarc allocations sized above; distinct borrows, so they do not alias.
        unsafe { self.combine_raw(stream, yp, op) }
    }

    /// [`MoeHighThroughput::combine`], and each row's top-k weights summed the same way (see
    /// [`MoeHighThroughput::combine_with_weights_raw`]): `y_weights` spans every row as `y`
    /// does (`max_rows x topk` f32), `out_weights` at least the last dispatch's tokens.
    pub fn combine_with_weights<Y, O, V, U>(
        &self,
        stream: &CudaStream,
        y: &Y,
        out: &mut O,
        y_weights: &V,
        out_weights: &mut U,
    ) -> Result<()>
    where
        Y: DevicePtr<half::bf16>,
        O: DevicePtrMut<half::bf16>,
        V: DevicePtr<f32>,
        U: DevicePtrMut<f32>,
    {
        self.check_combine(y.len(), out.len())?;
        let topk = self.config().topk;
        let rows = self.results().max_rows;
        let tokens = self.path.last_tokens();
        if y_weights.len() < rows * topk || out_weights.len() < tokens * topk {
            return Err(Error::invalid(
                "combine weights",
                format!(
                    "y_weights of {} and out_weights of {} f32; at least {rows} x {topk} and \
                     {tokens} x {topk}",
                    y_weights.len(),
                    out_weights.len()
                ),
            ));
        }
        let (yp, _y) = y.device_ptr(stream);
        let (op, _o) = out.device_ptr_mut(stream);
        let (vp, _v) = y_weights.device_ptr(stream);
        let (up, _u) = out_weights.device_ptr_mut(stream);
        // SAFETY: live cudarc allocations sized above; distinct borrows.
        unsafe { self.combine_with_weights_raw(stream, yp, op, vp, up) }
    }

    /// Tokens of a dispatch from its slices' lengths (`x`: one element per value, bf16 or e4m3
    /// bytes).
    fn tokens_of(&self, x: usize, idx: usize, weights: usize) -> Result<usize> {
        let cfg = self.config();
        if cfg.hidden == 0 || x % cfg.hidden != 0 {
            return Err(Error::invalid(
                "x",
                format!("{x} values: a multiple of hidden {}", cfg.hidden),
            ));
        }
        let tokens = x / cfg.hidden;
        if idx != tokens * cfg.topk || weights != idx {
            return Err(Error::invalid(
                "topk_idx, topk_weights",
                format!(
                    "{idx} ids and {weights} weights for {tokens} tokens of top-{}: {} each",
                    cfg.topk,
                    tokens * cfg.topk
                ),
            ));
        }
        Ok(tokens)
    }

    /// `y` spans every row a dispatch can leave, `out` the last dispatch's tokens.
    fn check_combine(&self, y: usize, out: usize) -> Result<()> {
        let hidden = self.config().hidden;
        let rows = self.results().max_rows;
        let tokens = self.path.last_tokens();
        if y < rows * hidden || out < tokens * hidden {
            return Err(Error::invalid(
                "combine",
                format!(
                    "y of {y} and out of {out} values; at least {rows} x {hidden} (every row a \
                     dispatch can leave) and {tokens} x {hidden} (the last dispatch's tokens)"
                ),
            ));
        }
        Ok(())
    }

    /// Room for the expert outputs (`[world * max_tokens, hidden]` bf16, rows aligned with
    /// `recv_x`). With more than 64 blocks the combine pulls: this is the combine area peers read,
    /// and a `y` written here (after the dispatch) is not copied in. With 64 or fewer it pushes
    /// rows straight from `y` wherever it is, and this is a buffer of its own, allocated on first
    /// use (passing it saves nothing over any other).
    pub fn combine_buffer(&self) -> Result<u64> {
        self.path.combine_buffer()
    }

    /// The receive slot the next dispatches land in (`0..MoeConfig::receive_slots`), and whose
    /// addresses [`MoeHighThroughput::results`] gives: results in the other slots stay as their
    /// dispatches left them. The caller keeps a slot's readers stream-ordered before the
    /// dispatch it hands the slot to (as for any buffer reused across calls). A combine follows
    /// the dispatch of the current slot (the slot keeps its layout), so two batches may be
    /// dispatched before either is combined (two-batch overlap): point the slot back at a
    /// dispatch before combining it, in the same order on every rank. Node-spanning path: slot
    /// 0 only.
    pub fn set_receive_slot(&self, slot: usize) -> Result<()> {
        self.path.set_receive_slot(slot)
    }

    /// Makes the next dispatches set the top-k ids of the rows past the received ones, up to
    /// `rows`, to -1 (0: leave them), so a caller that reads a fixed number of rows without
    /// waiting for the count (DeepEP's `num_worst_tokens`) sees them as empty. At most `world x
    /// max_tokens`; dispatches routed by ranks carry no ids and leave them. Node-spanning path:
    /// 0 only.
    pub fn set_worst_rows(&self, rows: usize) -> Result<()> {
        self.path.set_worst_rows(rows)
    }

    /// Device addresses of the results in the current receive slot (the last dispatch's unless
    /// [`MoeHighThroughput::set_receive_slot`] moved; read them after the stream's work finished).
    pub fn results(&self) -> DispatchResults {
        self.path.results()
    }

    /// The configuration.
    pub fn config(&self) -> &MoeConfig {
        self.path.config()
    }

    /// SMs the send and receive kernels occupy.
    pub fn sms(&self) -> u32 {
        self.path.sms()
    }
}
