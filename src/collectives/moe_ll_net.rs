//! The node-spanning path of [`super::moe::MoeLowLatency`]: the low-latency (decode) dispatch and
//! combine for any mix of same-node peers (NVLink stores into their mapped areas) and peers on
//! other nodes (PortChannel puts: RDMA WRITEs posted by the kernels themselves with IBGDA or
//! CPU-assisted posting, or by the proxy, as the transports chose; or the Ethernet proxies).
//! Protocol: `cuda/include/doorbell/moe_net.cuh`; kernels: `cuda/kernels/moe_net.cu`.
//!
//! Same results and contract as the NVLink path: rows at `[local expert][source rank][i]` in the
//! half the dispatch's epoch picks, the same combine sums (each rank's selections of a token in
//! top-k order, then the ranks' partial rows in rank order), everything counted on the device so
//! a dispatch and a combine can be captured in a CUDA graph. Differences: no call check (a peer
//! that skipped or changed a call is named by the wait budget), a token crosses to each
//! destination rank once with its top-k ids and weights in a header, and the receive half copies
//! it into each selected expert's slot.

use super::moe::{launch, LowLatencyResults, MoeConfig};
use crate::channel::memory_channel::RegisteredMemory;
use crate::channel::port_channel::PortChannels;
use crate::channel::proxy::ProxyService;
use crate::communicator::Communicator;
use crate::device_api::{MoeNetArgs, PortChannelHandle, WaitSite};
use crate::error::{Error, Result};
use crate::gpu::cuda::cuda_err;
use crate::gpu::memory::Buffer;
use crate::gpu::signature::{self, CallChecker, CallKind};
use crate::transport::ipc::RemoteMemory;
use cudarc::driver::{CudaFunction, CudaSlice, CudaStream, DevicePtr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// Stage tasks per group of 32 tokens in `moe_net_send` (`kStageParts` in `moe_net.cu`): each has
/// its own word in `staged`.
const STAGE_PARTS: usize = 8;

/// Most ranks of the node-spanning path (`moe_net::kMaxRanks`).
pub const MAX_NET_RANKS: usize = 64;
/// Words of the call check's inbox in the area (`moe_net.cuh`, kInboxWords): [2][64] slots, then
/// 64 counts of calls announced and 64 of calls checked.
const INBOX_WORDS: usize = 4 * MAX_NET_RANKS;

/// The channel id wait reports of this path carry.
const SITE_CHANNEL: u32 = u32::MAX - 1;

/// The shape of a [`NetLanding`]: what each path keeps in the area and the staging area beside
/// the parts both share (the staged messages by token, the partial rows of the combine).
pub(super) struct LandingShape {
    /// Bytes of the area's message region (at offset 0).
    pub messages: usize,
    /// Bytes of the area's count region (`off_counts`) and of the staging area's
    /// (`stage_counts`): count words, or chunk descriptors.
    pub counts: usize,
    /// u32 counters the path keeps after the per-rank message counts.
    pub fill_extra: usize,
    /// A second set of PortChannels for credit signals (high throughput).
    pub credits: bool,
}

/// The memory and channels both node-spanning MoE paths share: this rank's area (registered with
/// the NIC, mapped by same-node peers), its staging area, PortChannels from the staging area to
/// every peer's area, and the device arrays the kernels find peers, counters and epochs in.
pub(super) struct NetLanding {
    // Dropped first: the proxy thread stops before the memory it moves goes away.
    pub(super) proxy: ProxyService,
    /// The transport's fields of the kernels' arguments (the rest zero).
    pub(super) base: MoeNetArgs,
    pub(super) blocks: u32,
    /// Device address of the credit channels' handles (0 without them).
    pub(super) credits: u64,
    _channels: Vec<PortChannels>,
    _area: (
        Arc<Buffer>,
        Arc<RegisteredMemory>,
        Vec<Option<Arc<RemoteMemory>>>,
    ),
    _stage: (Arc<Buffer>, Arc<RegisteredMemory>),
    _device: Vec<CudaSlice<u8>>,
}

impl NetLanding {
    /// Collective.
    pub(super) fn new(
        comm: &Arc<Communicator>,
        cfg: &MoeConfig,
        shape: LandingShape,
    ) -> Result<Self> {
        let world = comm.world_size();
        let rank = comm.rank();
        if world > MAX_NET_RANKS || cfg.hidden == 0 || cfg.hidden % 8 != 0 {
            return Err(Error::invalid(
                "config",
                format!(
                    "at most {MAX_NET_RANKS} ranks and a hidden size that is a positive multiple \
                     of 8"
                ),
            ));
        }
        if cfg.num_experts == 0
            || cfg.num_experts % world != 0
            || cfg.topk == 0
            || cfg.topk > 32
            || cfg.max_tokens == 0
            || 2 * (cfg.num_experts as u64) * (cfg.max_tokens as u64) >= 1 << 31
        {
            return Err(Error::invalid(
                "config",
                "num_experts a positive multiple of the ranks; topk in 1..=32; max_tokens \
                 positive with 2 x num_experts x max_tokens below 2^31",
            ));
        }
        let gpu = comm.gpu().clone();
        let sms = gpu.sm_count()?;
        let blocks = cfg.blocks.unwrap_or(sms).clamp(1, sms);
        let msg = message_bytes(cfg);
        let row_out = cfg.hidden * 2;
        let section = |bytes: usize| bytes.next_multiple_of(256);
        // The area: messages, counts, partial rows, combine words (collective_args.cuh).
        let off_counts = section(shape.messages);
        let off_part = off_counts + section(shape.counts.max(2 * world * 8));
        let off_cdone = off_part + section(world * cfg.max_tokens * row_out);
        let off_inbox = off_cdone + section(world * 8);
        let area_bytes = off_inbox + section(INBOX_WORDS * 8);
        // The staging area: messages by token (two halves), counts, partial rows for remote
        // sources.
        let stage_counts = section(2 * cfg.max_tokens * msg);
        let stage_part = stage_counts + section(shape.counts.max(2 * world * 8));
        let stage_words = stage_part + section(world * cfg.max_tokens * row_out);
        let stage_bytes = stage_words + section(16);
        let area = comm.alloc(area_bytes)?;
        let area_reg = comm.register(&area)?;
        let peers = comm.exchange(&area_reg)?;
        let stage = comm.alloc(stage_bytes)?;
        let stage_reg = comm.register(&stage)?;
        let mut builder = comm.proxy_builder(0)?;
        let mut channels = vec![comm.port_channels(&mut builder, &stage_reg, &area_reg)?];
        if shape.credits {
            channels.push(comm.port_channels(&mut builder, &stage_reg, &area_reg)?);
        }
        let proxy = builder.start()?;

        let handles_of = |set: &PortChannels| -> Vec<PortChannelHandle> {
            (0..world)
                .map(|r| set.to(r).map(|c| c.device_handle()).unwrap_or_default())
                .collect()
        };
        let mut peer_area = vec![0u64; world];
        let mut sites = vec![WaitSite::default(); world];
        for r in 0..world {
            peer_area[r] = if r == rank {
                area.device_ptr()
            } else {
                peers[r].as_ref().map_or(0, |m| m.device_ptr())
            };
            sites[r] = comm.diagnostics().site(r as i32, SITE_CHANNEL);
        }
        let stream = gpu.new_stream()?;
        let alloc = |bytes: usize| -> Result<CudaSlice<u8>> {
            stream
                .alloc_zeros::<u8>(bytes.max(16))
                .map_err(cuda_err("cuMemAlloc"))
        };
        let upload = |bytes: &[u8]| -> Result<CudaSlice<u8>> {
            stream.clone_htod(bytes).map_err(cuda_err("cuMemcpyHtoD"))
        };
        let mut device = vec![
            upload(bytemuck::cast_slice(&peer_area))?, // 0 peer_area
            upload(bytemuck::cast_slice(&handles_of(&channels[0])))?, // 1 channels
            upload(bytemuck::cast_slice(&sites))?,     // 2 sites
            alloc(2 * world * 4)?,                     // 3 msgs
            alloc((world + shape.fill_extra) * 4)?,    // 4 fill
            alloc(16)?,                                // 5 done
            alloc(32)?,                                // 6 epochs
        ];
        if shape.credits {
            device.push(upload(bytemuck::cast_slice(&handles_of(&channels[1])))?);
            // 7 credits
        }
        let p = |i: usize| device[i].device_ptr(&stream).0;
        let base = MoeNetArgs {
            hidden: cfg.hidden as u32,
            topk: cfg.topk as u32,
            experts_per_rank: (cfg.num_experts / world) as u32,
            max_tokens: cfg.max_tokens as u32,
            rank: rank as u32,
            world: world as u32,
            msg_bytes: msg as u32,
            header_bytes: header_bytes(cfg) as u32,
            area: area.device_ptr(),
            peer_area: p(0),
            channels: p(1),
            sites: p(2),
            stage: stage.device_ptr(),
            off_counts: off_counts as u64,
            off_part: off_part as u64,
            off_cdone: off_cdone as u64,
            stage_counts: stage_counts as u64,
            stage_part: stage_part as u64,
            off_inbox: off_inbox as u64,
            stage_words: stage_words as u64,
            msgs: p(3),
            fill: p(4),
            done: p(5),
            epochs: p(6),
            ..Default::default()
        };
        let credits = if shape.credits { p(7) } else { 0 };
        stream
            .synchronize()
            .map_err(cuda_err("cuStreamSynchronize"))?;
        Ok(NetLanding {
            proxy,
            base,
            blocks,
            credits,
            _channels: channels,
            _area: (area, area_reg, peers),
            _stage: (stage, stage_reg),
            _device: device,
        })
    }

    /// An error if the proxy stopped (the kernels would wait for it in vain).
    pub(super) fn proxy_alive(&self) -> Result<()> {
        match self.proxy.failure() {
            Some(why) => Err(Error::invalid(
                "MoE exchange",
                format!("the proxy stopped: {why}"),
            )),
            None => Ok(()),
        }
    }
}

/// Bytes of a message header: source token, row format, epoch, then top-k ids and weights
/// (`moe_net.cuh`), rounded up to 16.
pub(super) fn header_bytes(cfg: &MoeConfig) -> usize {
    (16 + 8 * cfg.topk).next_multiple_of(16)
}

/// Bytes of a message slot: the header and room for a bf16 row (an e4m3 row and its scales take
/// less).
pub(super) fn message_bytes(cfg: &MoeConfig) -> usize {
    header_bytes(cfg) + cfg.hidden * 2
}

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
            k("moe_net_send")?,
            k("moe_net_recv")?,
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
            calls: super::channel_call_checker(comm)?,
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
        // The send (task-parallel, moe_net_send) runs 256 threads a block: more registers per
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
    pub(super) fn prepare_send(
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

    pub(super) fn dispatch_send(&self, stream: &CudaStream, args: &MoeNetArgs) -> Result<()> {
        self.launch(stream, 0, args)
    }

    pub(super) fn dispatch_recv(&self, stream: &CudaStream) -> Result<()> {
        let call_word = self.words.lock().unwrap_or_else(|p| p.into_inner()).0;
        let args = MoeNetArgs {
            call_word,
            ..self.base
        };
        self.launch(stream, 1, &args)
    }

    pub(super) fn results_of(&self, n: u64) -> LowLatencyResults {
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

    pub(super) fn dispatches(&self) -> u64 {
        self.dispatches.load(Ordering::Relaxed)
    }

    pub(super) fn combine_buffer(&self) -> u64 {
        self.base.y
    }

    pub(super) fn combine_send(&self, stream: &CudaStream) -> Result<()> {
        let args = MoeNetArgs {
            call_word: self.next_word(CallKind::MoeLlCombine, signature::capturing(stream)),
            ..self.base
        };
        self.launch(stream, 2, &args)
    }

    pub(super) fn combine_recv(&self, stream: &CudaStream, out: u64) -> Result<()> {
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
}
