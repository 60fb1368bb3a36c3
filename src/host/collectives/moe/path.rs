//! The interface each mode's paths implement: [`HighThroughputPath`] (NVLink: `ht_nvlink.rs`,
//! across nodes: `ht_net.rs`) and [`LowLatencyPath`] (`ll_nvlink.rs`, `ll_net.rs`). The public
//! types hold the path their communicator needs, chosen once when they are built; the methods'
//! contracts (and their `# Safety` sections) are the public types' of the same name.

use super::packed::{PackedCombine, PackedOutputs};
use super::shared::{DispatchResults, FusedSend, LowLatencyResults, MoeConfig};
use crate::error::{Error, Result};
use cudarc::driver::CudaStream;

/// One way of running [`super::MoeHighThroughput`].
pub(super) trait HighThroughputPath: Send + Sync {
    /// Whether this is the node-spanning path.
    fn spans_nodes(&self) -> bool;
    fn config(&self) -> &MoeConfig;
    /// SMs the send and receive kernels occupy.
    fn sms(&self) -> u32;
    /// # Safety
    /// As [`super::MoeHighThroughput::dispatch`].
    unsafe fn dispatch(
        &self,
        stream: &CudaStream,
        x: u64,
        topk_idx: u64,
        topk_weights: u64,
        num_tokens: usize,
    ) -> Result<()>;
    /// # Safety
    /// As [`super::MoeHighThroughput::dispatch_fp8`].
    unsafe fn dispatch_fp8(
        &self,
        stream: &CudaStream,
        x: u64,
        scales: u64,
        topk_idx: u64,
        topk_weights: u64,
        num_tokens: usize,
    ) -> Result<()>;
    /// (`scales` already checked: nonzero only for a hidden size that is a multiple of 128, and
    /// 4-byte aligned.)
    ///
    /// # Safety
    /// As [`super::MoeHighThroughput::dispatch_by_rank`].
    unsafe fn dispatch_by_rank(
        &self,
        stream: &CudaStream,
        x: u64,
        scales: u64,
        in_rank: u64,
        tokens_per_expert: u64,
        num_tokens: usize,
    ) -> Result<()>;

    /// `weights`: `(y_weights, out_weights)` to sum as the rows are, or none.
    ///
    /// # Safety
    /// As [`super::MoeHighThroughput::combine_with_weights`].
    unsafe fn combine(
        &self,
        stream: &CudaStream,
        y: u64,
        out: u64,
        weights: Option<(u64, u64)>,
    ) -> Result<()>;
    fn combine_buffer(&self) -> Result<u64>;
    /// See [`super::MoeHighThroughput::set_receive_slot`].
    fn set_receive_slot(&self, slot: usize) -> Result<()> {
        if slot == 0 {
            return Ok(());
        }
        Err(Error::invalid(
            "receive slot",
            "the node-spanning high-throughput path has one receive slot",
        ))
    }
    /// See [`super::MoeHighThroughput::set_worst_rows`].
    fn set_worst_rows(&self, rows: usize) -> Result<()> {
        if rows == 0 {
            return Ok(());
        }
        Err(Error::invalid(
            "worst rows",
            "the node-spanning high-throughput path leaves rows past the received ones as they were",
        ))
    }
    fn results(&self) -> DispatchResults;
    /// Tokens of the last dispatch issued from the host (what a combine writes).
    fn last_tokens(&self) -> usize;
    /// Node-spanning path: see [`super::MoeHighThroughput::network_rows`].
    fn network_rows(&self) -> Option<(u64, usize)> {
        None
    }
    /// Node-spanning path: see [`super::MoeHighThroughput::network_ring_bytes`].
    fn network_ring_bytes(&self) -> Option<(u64, u64)> {
        None
    }
}

/// One way of running [`super::MoeLowLatency`].
pub(super) trait LowLatencyPath: Send + Sync {
    /// Whether this is the node-spanning path.
    fn spans_nodes(&self) -> bool;
    /// The rank mask, if built (`MoeConfig::rank_mask`; NVLink path only).
    fn rank_mask(&self) -> Option<&cudarc::driver::CudaSlice<u32>> {
        None
    }
    /// Writes the peers found dead into the rank mask, on `stream` (no mask: nothing).
    fn mask_dead_peers(&self, _stream: &CudaStream) -> Result<()> {
        Ok(())
    }
    /// Unmasks every rank on `stream`; dead peers are masked again at the next call.
    fn clean_rank_mask(&self, _stream: &CudaStream) -> Result<()> {
        Ok(())
    }
    /// Masks or unmasks `rank` on `stream` (a rank below the world size; checked by the caller).
    fn set_rank_masked(&self, _stream: &CudaStream, _rank: usize, _masked: bool) -> Result<()> {
        Ok(())
    }
    /// # Safety
    /// As [`super::MoeLowLatency::dispatch_send`].
    unsafe fn dispatch_send(
        &self,
        stream: &CudaStream,
        x: u64,
        topk_idx: u64,
        topk_weights: u64,
        num_tokens: usize,
    ) -> Result<()>;
    /// # Safety
    /// As [`super::MoeLowLatency::dispatch_send_fp8`].
    unsafe fn dispatch_send_fp8(
        &self,
        stream: &CudaStream,
        x: u64,
        scales: u64,
        topk_idx: u64,
        topk_weights: u64,
        num_tokens: usize,
    ) -> Result<()>;
    /// # Safety
    /// As [`super::MoeLowLatency::begin_fused_send`].
    unsafe fn begin_fused_send(
        &self,
        topk_idx: u64,
        topk_weights: u64,
        num_tokens: usize,
    ) -> Result<FusedSend>;
    fn dispatch_recv(&self, stream: &CudaStream) -> Result<()>;
    /// # Safety
    /// As [`super::MoeLowLatency::dispatch`].
    unsafe fn dispatch(
        &self,
        stream: &CudaStream,
        x: u64,
        topk_idx: u64,
        topk_weights: u64,
        num_tokens: usize,
    ) -> Result<()>;
    fn results(&self) -> LowLatencyResults;
    fn results_of(&self, n: u64) -> LowLatencyResults;
    /// Tokens of the last dispatch (what a combine writes).
    fn last_tokens(&self) -> usize;
    fn combine_buffer(&self) -> u64;
    fn combine_send(&self, stream: &CudaStream) -> Result<()>;
    /// # Safety
    /// As [`super::MoeLowLatency::combine_recv`].
    unsafe fn combine_recv(&self, stream: &CudaStream, out: u64) -> Result<()>;
    /// # Safety
    /// As [`super::MoeLowLatency::combine`].
    unsafe fn combine(&self, stream: &CudaStream, out: u64) -> Result<()>;
    /// DeepEP's layout: both halves, or with `send_only` the send half (which writes only `out`'s
    /// ticket).
    ///
    /// # Safety
    /// As [`super::MoeLowLatency::dispatch_packed_raw`].
    unsafe fn dispatch_packed(
        &self,
        stream: &CudaStream,
        x: u64,
        topk_idx: u64,
        num_tokens: usize,
        out: &PackedOutputs,
        send_only: bool,
    ) -> Result<()>;
    /// DeepEP's layout: the receive half.
    ///
    /// # Safety
    /// As [`super::MoeLowLatency::dispatch_packed_recv_raw`].
    unsafe fn dispatch_packed_recv(&self, stream: &CudaStream, out: &PackedOutputs) -> Result<()>;
    /// DeepEP's layout: a combine's halves.
    ///
    /// # Safety
    /// As [`super::MoeLowLatency::combine_packed_raw`].
    unsafe fn combine_packed(&self, stream: &CudaStream, call: &PackedCombine) -> Result<()>;
}
