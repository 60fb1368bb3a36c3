//! The node-spanning path of [`super::MoeLowLatency`]: the low-latency (decode) dispatch and
//! combine for any mix of same-node peers (NVLink stores into their mapped areas) and peers on
//! other nodes (PortChannel puts: RDMA WRITEs posted by the kernels themselves with IBGDA or
//! CPU-assisted posting, or by the proxy, as the transports chose; or the Ethernet proxies).
//! Protocol: `cuda/include/doorbell/moe_net.cuh`; kernels: `cuda/kernels/moe_net.cu`.
//!
//! Same results and contract as the NVLink path: rows at `[local expert][source rank][i]` in the
//! half the dispatch's epoch picks, the same combine sums (each rank's selections of a token in
//! top-k order, then the ranks' partial rows in rank order), everything counted on the device so
//! a dispatch and a combine can be captured in a CUDA graph, every call checked against the peers'
//! (the call words ride the channels into each peer's inbox). Differences: a token crosses to each
//! destination rank once with its top-k ids and weights in a header, and the receive half copies
//! it into each selected expert's slot. The area and channels: `net_area.rs`.

use super::net_area::{message_bytes, LandingShape, NetLanding};
use super::path::LowLatencyPath;
use super::shared::{launch, FusedSend, LowLatencyResults, MoeConfig};
use crate::communicator::Communicator;
use crate::device_api::MoeNetArgs;
use crate::error::{Error, Result};
use crate::gpu::cuda::cuda_err;
use crate::gpu::signature::{self, CallChecker, CallKind};
use cudarc::driver::{CudaFunction, CudaSlice, CudaStream, DevicePtr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// Stage tasks per group of 32 tokens in `moe_net_dispatch_send` (`kStageParts` in `moe_net.cu`): each has
/// its own word in `staged`.
const STAGE_PARTS: usize = 8;

/// Node-spanning low-latency MoE state. Collective to build and to call.
pub(super) struct LlNet {
    landing: NetLanding,
    comm: Arc<Communicator>,
    base: MoeNetArgs,
    kernels: [CudaFunction; 4],
    dispatches: AtomicU64,
    /// topk_idx and token count of the last dispatch (the combine needs them).
    last: Mutex<(u64, u32)>,
    rows: u64,
    _device: Vec<CudaSlice<u8>>,
    /// The call check (`moe_net.cuh`): every dispatch and combine counts one call; the words of
    /// the last dispatch and the last combine, for their receive halves.
    calls: CallChecker,
    words: Mutex<(u64, u64)>,
}

impl LlNet {
    pub(super) fn new(comm: &Arc<Communicator>, cfg: &MoeConfig) -> Result<LlNet> {
        let world = comm.world_size();
        let local = cfg.num_experts / world.max(1);
        let landing = NetLanding::new(
            comm,
            cfg,
            LandingShape {
                messages: 2 * world * cfg.max_tokens * message_bytes(cfg),
                counts: 2 * world * 8,
                fill_extra: local * world,
                credits: false,
            },
        )?;
        let gpu = comm.gpu().clone();
        let rows = local * world * cfg.max_tokens;
        let stream = gpu.new_stream()?;
        let alloc = |bytes: usize| -> Result<CudaSlice<u8>> {
            stream
                .alloc_zeros::<u8>(bytes.max(16))
                .map_err(cuda_err("cuMemAlloc"))
        };
        let device = vec![
            alloc(rows * cfg.hidden * 2)?,                         // 0 y
            alloc(2 * rows * cfg.hidden * 2)?,                     // 1 recv_x
            alloc(2 * rows * 4)?,                                  // 2 recv_src
            alloc(2 * rows * 4)?,                                  // 3 recv_weights
            alloc(2 * rows * (cfg.hidden / 128).max(1) * 4)?,      // 4 recv_scales
            alloc(2 * world * cfg.max_tokens * cfg.topk * 4)?,     // 5 rec
            alloc(local * world * 4)?,                             // 6 layout
            alloc(local * 4)?,                                     // 7 recv_count
            alloc(world * cfg.max_tokens * 4)?,                    // 8 list
            alloc(world * 4)?,                                     // 9 arrived
            alloc(cfg.max_tokens.div_ceil(32) * STAGE_PARTS * 8)?, // 10 staged
        ];
        let p = |i: usize| device[i].device_ptr(&stream).0;
        let base = MoeNetArgs {
            y: p(0),
            recv_x: p(1),
            recv_src: p(2),
            recv_weights: p(3),
            recv_scales: p(4),
            rec: p(5),
            layout: p(6),
            recv_count: p(7),
            list: p(8),
            arrived: p(9),
            staged: p(10),
            ..landing.base
        };
        stream
            .synchronize()
            .map_err(cuda_err("cuStreamSynchronize"))?;
        let k = |name: &str| gpu.function("moe_net", name);
        let kernels = [
            k("moe_net_dispatch_send")?,
            k("moe_net_dispatch_recv")?,
            k("moe_net_combine_send")?,
            k("moe_net_combine_recv")?,
        ];
        comm.bootstrap().barrier()?;
        Ok(LlNet {
            landing,
            comm: comm.clone(),
            base,
            kernels,
            dispatches: AtomicU64::new(0),
            last: Mutex::new((0, 0)),
            rows: rows as u64,
            _device: device,
            // The words travel to each peer\'s inbox in its area, not mapped ones.
            calls: crate::collectives::channel_call_checker(comm)?,
            words: Mutex::new((0, 0)),
        })
    }

    /// The next call's word (counts the call), kept for its receive half.
    fn next_word(&self, kind: CallKind, graph: bool) -> u64 {
        let word = self.calls.next(kind, 0, 0, 0, 0, graph).word;
        let mut w = self.words.lock().unwrap_or_else(|p| p.into_inner());
        if kind == CallKind::MoeLlDispatch {
            w.0 = word;
        } else {
            w.1 = word;
        }
        word
    }

    fn launch(&self, stream: &CudaStream, k: usize, args: &MoeNetArgs) -> Result<()> {
        self.landing.proxy_alive()?;
        // The send (task-parallel, moe_net_dispatch_send) runs 256 threads a block: more registers per
        // thread for its posting paths; the others 512.
        let threads = if k == 0 { 256 } else { 512 };
        launch(
            &self.comm,
            &self.kernels[k],
            stream,
            self.landing.blocks,
            threads,
            args,
        )
    }

    /// Checks a dispatch's inputs, counts it, and returns its send arguments (`graph`: the
    /// send is being captured; false for a fused send, whose stream only the caller knows).
    fn prepare_send(
        &self,
        x: u64,
        scales: u64,
        topk_idx: u64,
        topk_weights: u64,
        num_tokens: usize,
        graph: bool,
    ) -> Result<MoeNetArgs> {
        let max = self.base.max_tokens as usize;
        if num_tokens > max || x % 16 != 0 || topk_idx % 4 != 0 || topk_weights % 4 != 0 {
            return Err(Error::invalid(
                "dispatch",
                format!(
                    "{num_tokens} tokens (at most {max}), x 16-byte, topk_idx and topk_weights \
                     4-byte aligned"
                ),
            ));
        }
        if scales != 0 && (self.base.hidden % 128 != 0 || scales % 4 != 0) {
            return Err(Error::invalid(
                "dispatch",
                format!(
                    "FP8 rows need a hidden size that is a multiple of 128 (it is {}) and \
                     4-byte aligned scales",
                    self.base.hidden
                ),
            ));
        }
        *self.last.lock().unwrap_or_else(|p| p.into_inner()) = (topk_idx, num_tokens as u32);
        self.dispatches.fetch_add(1, Ordering::Relaxed);
        Ok(MoeNetArgs {
            x,
            scales,
            fp8: u32::from(scales != 0),
            topk_idx,
            topk_weights,
            num_tokens: num_tokens as u32,
            call_word: self.next_word(CallKind::MoeLlDispatch, graph),
            ..self.base
        })
    }

    /// Launches the send half with prepared arguments.
    fn send(&self, stream: &CudaStream, args: &MoeNetArgs) -> Result<()> {
        self.launch(stream, 0, args)
    }

    /// Dispatches issued from the host so far.
    fn dispatches(&self) -> u64 {
        self.dispatches.load(Ordering::Relaxed)
    }
}

impl LowLatencyPath for LlNet {
    fn spans_nodes(&self) -> bool {
        true
    }

    fn last_tokens(&self) -> usize {
        self.last.lock().unwrap_or_else(|p| p.into_inner()).1 as usize
    }

    unsafe fn dispatch_send(
        &self,
        stream: &CudaStream,
        x: u64,
        topk_idx: u64,
        topk_weights: u64,
        num_tokens: usize,
    ) -> Result<()> {
        let graph = signature::capturing(stream);
        let args = self.prepare_send(x, 0, topk_idx, topk_weights, num_tokens, graph)?;
        self.send(stream, &args)
    }

    unsafe fn dispatch_send_fp8(
        &self,
        stream: &CudaStream,
        x: u64,
        scales: u64,
        topk_idx: u64,
        topk_weights: u64,
        num_tokens: usize,
    ) -> Result<()> {
        if scales == 0 {
            return Err(Error::invalid("scales", "a device address is needed"));
        }
        let graph = signature::capturing(stream);
        let args = self.prepare_send(x, scales, topk_idx, topk_weights, num_tokens, graph)?;
        self.send(stream, &args)
    }

    unsafe fn begin_fused_send(
        &self,
        topk_idx: u64,
        topk_weights: u64,
        num_tokens: usize,
    ) -> Result<FusedSend> {
        self.prepare_send(0, 0, topk_idx, topk_weights, num_tokens, false)
            .map(FusedSend::Net)
    }

    fn dispatch_recv(&self, stream: &CudaStream) -> Result<()> {
        let call_word = self.words.lock().unwrap_or_else(|p| p.into_inner()).0;
        let args = MoeNetArgs {
            call_word,
            ..self.base
        };
        self.launch(stream, 1, &args)
    }

    unsafe fn dispatch(
        &self,
        stream: &CudaStream,
        x: u64,
        topk_idx: u64,
        topk_weights: u64,
        num_tokens: usize,
    ) -> Result<()> {
        let graph = signature::capturing(stream);
        let args = self.prepare_send(x, 0, topk_idx, topk_weights, num_tokens, graph)?;
        self.send(stream, &args)?;
        self.dispatch_recv(stream)
    }

    fn results(&self) -> LowLatencyResults {
        self.results_of(self.dispatches())
    }

    fn results_of(&self, n: u64) -> LowLatencyResults {
        let half = n & 1;
        let b = &self.base;
        LowLatencyResults {
            recv_x: b.recv_x + half * self.rows * b.hidden as u64 * 2,
            recv_src: b.recv_src + half * self.rows * 4,
            recv_weights: b.recv_weights + half * self.rows * 4,
            recv_scales: b.recv_scales + half * self.rows * (b.hidden as u64 / 128).max(1) * 4,
            layout: b.layout,
            recv_count: b.recv_count,
        }
    }

    fn combine_buffer(&self) -> u64 {
        self.base.y
    }

    fn combine_send(&self, stream: &CudaStream) -> Result<()> {
        let args = MoeNetArgs {
            call_word: self.next_word(CallKind::MoeLlCombine, signature::capturing(stream)),
            ..self.base
        };
        self.launch(stream, 2, &args)
    }

    unsafe fn combine_recv(&self, stream: &CudaStream, out: u64) -> Result<()> {
        if out % 16 != 0 {
            return Err(Error::invalid("combine", "out 16-byte aligned"));
        }
        let (topk_idx, num_tokens) = *self.last.lock().unwrap_or_else(|p| p.into_inner());
        let call_word = self.words.lock().unwrap_or_else(|p| p.into_inner()).1;
        let args = MoeNetArgs {
            topk_idx,
            num_tokens,
            out,
            call_word,
            ..self.base
        };
        self.launch(stream, 3, &args)
    }

    unsafe fn combine(&self, stream: &CudaStream, out: u64) -> Result<()> {
        self.combine_send(stream)?;
        // SAFETY: as the trait's contract says.
        unsafe { self.combine_recv(stream, out) }
    }
}
