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
use crate::device_api::{MoeHtArgs, MoeNetArgs, PortChannelHandle, WaitSite};
use crate::error::{Error, Result};
use crate::gpu::cuda::cuda_err;
use crate::gpu::memory::Buffer;
use crate::transport::ipc::RemoteMemory;
use cudarc::driver::{CudaFunction, CudaSlice, CudaStream, DevicePtr, LaunchConfig, PushKernelArg};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// Most ranks of the node-spanning path (`moe_net::kMaxRanks`).
pub const MAX_NET_RANKS: usize = 64;

/// The channel id wait reports of this path carry.
const SITE_CHANNEL: u32 = u32::MAX - 1;

/// The memory and channels both node-spanning MoE paths share: this rank's area (registered with
/// the NIC, mapped by same-node peers), its staging area, PortChannels from the staging area to
/// every peer's area, and the device arrays the kernels find peers, counters and epochs in.
pub(super) struct NetLanding {
    // Dropped first: the proxy thread stops before the memory it moves goes away.
    pub(super) proxy: ProxyService,
    /// The transport's fields of the kernels' arguments (the rest zero).
    pub(super) base: MoeNetArgs,
    pub(super) blocks: u32,
    _channels: PortChannels,
    _area: (
        Arc<Buffer>,
        Arc<RegisteredMemory>,
        Vec<Option<Arc<RemoteMemory>>>,
    ),
    _stage: (Arc<Buffer>, Arc<RegisteredMemory>),
    _device: Vec<CudaSlice<u8>>,
}

impl NetLanding {
    /// Collective. `fill_extra`: u32 counters the path keeps after the per-rank message counts.
    pub(super) fn new(
        comm: &Arc<Communicator>,
        cfg: &MoeConfig,
        fill_extra: usize,
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
        let header = (16 + 8 * cfg.topk).next_multiple_of(16);
        let msg = header + cfg.hidden * 2;
        let row_out = cfg.hidden * 2;
        let section = |bytes: usize| bytes.next_multiple_of(256);
        // The area: messages, counts, partial rows, combine words (collective_args.cuh).
        let off_counts = section(2 * world * cfg.max_tokens * msg);
        let off_part = off_counts + section(2 * world * 8);
        let off_cdone = off_part + section(world * cfg.max_tokens * row_out);
        let area_bytes = off_cdone + section(world * 8);
        // The staging area: messages by token, count words, partial rows for remote sources.
        let stage_counts = section(cfg.max_tokens * msg);
        let stage_part = stage_counts + section(world * 8);
        let stage_bytes = stage_part + section(world * cfg.max_tokens * row_out);
        let area = comm.alloc(area_bytes)?;
        let area_reg = comm.register(&area)?;
        let peers = comm.exchange(&area_reg)?;
        let stage = comm.alloc(stage_bytes)?;
        let stage_reg = comm.register(&stage)?;
        let mut builder = comm.proxy_builder(0)?;
        let channels = comm.port_channels(&mut builder, &stage_reg, &area_reg)?;
        let proxy = builder.start()?;

        let mut peer_area = vec![0u64; world];
        let mut handles = vec![PortChannelHandle::default(); world];
        let mut sites = vec![WaitSite::default(); world];
        for r in 0..world {
            peer_area[r] = if r == rank {
                area.device_ptr()
            } else {
                peers[r].as_ref().map_or(0, |m| m.device_ptr())
            };
            if let Some(c) = channels.to(r) {
                handles[r] = c.device_handle();
            }
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
        let device = vec![
            upload(bytemuck::cast_slice(&peer_area))?, // 0 peer_area
            upload(bytemuck::cast_slice(&handles))?,   // 1 channels
            upload(bytemuck::cast_slice(&sites))?,     // 2 sites
            alloc(2 * world * 4)?,                     // 3 msgs
            alloc((world + fill_extra) * 4)?,          // 4 fill
            alloc(16)?,                                // 5 done
            alloc(32)?,                                // 6 epochs
        ];
        let p = |i: usize| device[i].device_ptr(&stream).0;
        let base = MoeNetArgs {
            hidden: cfg.hidden as u32,
            topk: cfg.topk as u32,
            experts_per_rank: (cfg.num_experts / world) as u32,
            max_tokens: cfg.max_tokens as u32,
            rank: rank as u32,
            world: world as u32,
            msg_bytes: msg as u32,
            header_bytes: header as u32,
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
            msgs: p(3),
            fill: p(4),
            done: p(5),
            epochs: p(6),
            ..Default::default()
        };
        stream
            .synchronize()
            .map_err(cuda_err("cuStreamSynchronize"))?;
        Ok(NetLanding {
            proxy,
            base,
            blocks,
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
}

impl LlNet {
    pub(super) fn new(comm: &Arc<Communicator>, cfg: &MoeConfig) -> Result<LlNet> {
        let world = comm.world_size();
        let local = cfg.num_experts / world.max(1);
        let landing = NetLanding::new(comm, cfg, local * world)?;
        let gpu = comm.gpu().clone();
        let rows = local * world * cfg.max_tokens;
        let stream = gpu.new_stream()?;
        let alloc = |bytes: usize| -> Result<CudaSlice<u8>> {
            stream
                .alloc_zeros::<u8>(bytes.max(16))
                .map_err(cuda_err("cuMemAlloc"))
        };
        let device = vec![
            alloc(rows * cfg.hidden * 2)?,                     // 0 y
            alloc(2 * rows * cfg.hidden * 2)?,                 // 1 recv_x
            alloc(2 * rows * 4)?,                              // 2 recv_src
            alloc(2 * rows * 4)?,                              // 3 recv_weights
            alloc(2 * rows * (cfg.hidden / 128).max(1) * 4)?,  // 4 recv_scales
            alloc(2 * world * cfg.max_tokens * cfg.topk * 4)?, // 5 rec
            alloc(local * world * 4)?,                         // 6 layout
            alloc(local * 4)?,                                 // 7 recv_count
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
        })
    }

    fn launch(&self, stream: &CudaStream, k: usize, args: &MoeNetArgs) -> Result<()> {
        self.landing.proxy_alive()?;
        launch(
            &self.comm,
            &self.kernels[k],
            stream,
            self.landing.blocks,
            512,
            args,
        )
    }

    /// Checks a dispatch's inputs, counts it, and returns its send arguments.
    pub(super) fn prepare_send(
        &self,
        x: u64,
        scales: u64,
        topk_idx: u64,
        topk_weights: u64,
        num_tokens: usize,
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
            ..self.base
        })
    }

    pub(super) fn dispatch_send(&self, stream: &CudaStream, args: &MoeNetArgs) -> Result<()> {
        self.launch(stream, 0, args)
    }

    pub(super) fn dispatch_recv(&self, stream: &CudaStream) -> Result<()> {
        self.launch(stream, 1, &self.base)
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
        self.launch(stream, 2, &self.base)
    }

    pub(super) fn combine_recv(&self, stream: &CudaStream, out: u64) -> Result<()> {
        if out % 16 != 0 {
            return Err(Error::invalid("combine", "out 16-byte aligned"));
        }
        let (topk_idx, num_tokens) = *self.last.lock().unwrap_or_else(|p| p.into_inner());
        let args = MoeNetArgs {
            topk_idx,
            num_tokens,
            out,
            ..self.base
        };
        self.launch(stream, 3, &args)
    }
}

/// The nodes of `ids` (one id per rank), in order of their first rank.
fn nodes_of(ids: &[u64]) -> Vec<Vec<usize>> {
    let mut nodes: Vec<Vec<usize>> = Vec::new();
    for (r, id) in ids.iter().enumerate() {
        match nodes.iter_mut().find(|n| ids[n[0]] == *id) {
            Some(n) => n.push(r),
            None => nodes.push(vec![r]),
        }
    }
    nodes
}

/// The node-spanning path of [`super::moe::MoeDispatcher`] (high throughput), DeepEP's
/// hierarchical scheme: a token crosses the network once per destination node, to the rank of
/// that node with the sender's local index (its rail peer), which forwards it over NVLink with
/// the node's own [`super::moe::MoeDispatcher`] (on a communicator of the node's ranks); the
/// combine sums inside the node first (that dispatcher's combine), then sends one row per
/// (token, node) back over the network, where the token's rank adds the nodes' rows in node
/// order. Kernels: `moe_ht_*` in `cuda/kernels/moe_net.cu`.
pub(super) struct HtNet {
    landing: NetLanding,
    comm: Arc<Communicator>,
    base: MoeNetArgs,
    ht: MoeHtArgs,
    nodes: usize,
    cfg: MoeConfig,
    kernels: [CudaFunction; 5],
    /// topk_idx and token count of the last dispatch (the combine needs them).
    last: Mutex<(u64, u32)>,
    /// The node's NVLink dispatcher and its communicator (dropped after it).
    node: Box<super::moe::MoeDispatcher>,
    _node_comm: Arc<Communicator>,
    _origin: (
        Arc<Buffer>,
        Arc<RegisteredMemory>,
        Vec<Option<Arc<RemoteMemory>>>,
    ),
    _device: Vec<CudaSlice<u8>>,
}

impl HtNet {
    pub(super) fn new(comm: &Arc<Communicator>, cfg: &MoeConfig) -> Result<HtNet> {
        let (world, rank) = (comm.world_size(), comm.rank());
        let nodes = nodes_of(comm.node_ids());
        let size = nodes[0].len();
        if nodes.iter().any(|n| n.len() != size) {
            return Err(Error::invalid(
                "MoeDispatcher",
                format!(
                    "nodes of {:?} ranks: the node-spanning exchange needs nodes of equal size \
                     (a token goes to the rank of the same local index on each node)",
                    nodes.iter().map(Vec::len).collect::<Vec<_>>()
                ),
            ));
        }
        let node = nodes
            .iter()
            .position(|n| n.contains(&rank))
            .expect("every rank is in a node");
        let me = nodes[node]
            .iter()
            .position(|&r| r == rank)
            .expect("found above");
        let mut node_of = vec![0u32; world];
        let mut local_of = vec![0u32; world];
        for (n, ranks) in nodes.iter().enumerate() {
            for (l, &r) in ranks.iter().enumerate() {
                node_of[r] = n as u32;
                local_of[r] = l as u32;
            }
        }
        let rail: Vec<u32> = nodes.iter().map(|n| n[me] as u32).collect();
        let landing = NetLanding::new(comm, cfg, 0)?;
        // The node's own communicator and NVLink dispatcher, fed nodes x max_tokens slots.
        let others: Vec<usize> = (0..world).filter(|r| !nodes[node].contains(r)).collect();
        let node_comm = Arc::new(comm.shrink(&others)?);
        let per_rank = cfg.num_experts / world;
        let slots = nodes.len() * cfg.max_tokens;
        let node_disp = super::moe::MoeDispatcher::new(
            &node_comm,
            MoeConfig {
                num_experts: per_rank * size,
                max_tokens: slots,
                ..cfg.clone()
            },
        )?;
        // Every node rank's slot origins, mapped by the others (the rows' origins after the
        // node dispatch name the forwarder's slot).
        let origin = node_comm.alloc(slots * 8)?;
        let origin_reg = node_comm.register(&origin)?;
        let origin_peers = node_comm.exchange(&origin_reg)?;
        let origin_of: Vec<u64> = (0..size)
            .map(|l| {
                if l == me {
                    Ok(origin.device_ptr())
                } else {
                    origin_peers[l]
                        .as_ref()
                        .map(|m| m.device_ptr())
                        .ok_or_else(|| Error::TransportUnavailable {
                            transport: "CudaIpc",
                            why: format!("rank {l} of this node could not be mapped"),
                        })
                }
            })
            .collect::<Result<_>>()?;
        let gpu = comm.gpu().clone();
        let stream = gpu.new_stream()?;
        let alloc = |bytes: usize| -> Result<CudaSlice<u8>> {
            stream
                .alloc_zeros::<u8>(bytes.max(16))
                .map_err(cuda_err("cuMemAlloc"))
        };
        let upload = |bytes: &[u8]| -> Result<CudaSlice<u8>> {
            stream.clone_htod(bytes).map_err(cuda_err("cuMemcpyHtoD"))
        };
        let max_rows = size * slots;
        let device = vec![
            upload(bytemuck::cast_slice(&rail))?,          // 0 rail
            upload(bytemuck::cast_slice(&node_of))?,       // 1 node_of
            upload(bytemuck::cast_slice(&local_of))?,      // 2 local_of
            alloc(slots * cfg.hidden * 2)?,                // 3 fwd_x
            alloc(slots * (cfg.hidden / 128).max(1) * 4)?, // 4 fwd_scales
            alloc(slots * cfg.topk * 4)?,                  // 5 fwd_idx
            alloc(slots * cfg.topk * 4)?,                  // 6 fwd_w
            alloc(slots * cfg.hidden * 2)?,                // 7 fwd_out
            alloc(nodes.len() * 4)?,                       // 8 net_rows
            upload(bytemuck::cast_slice(&origin_of))?,     // 9 origin_of
            alloc(max_rows * 8)?,                          // 10 recv_src
        ];
        let p = |i: usize| device[i].device_ptr(&stream).0;
        let res = node_disp.results();
        let ht = MoeHtArgs {
            nodes: nodes.len() as u32,
            node: node as u32,
            rail: p(0),
            node_of: p(1),
            local_of: p(2),
            fwd_x: p(3),
            fwd_scales: p(4),
            fwd_idx: p(5),
            fwd_w: p(6),
            fwd_origin: origin.device_ptr(),
            fwd_out: p(7),
            net_rows: p(8),
            node_src: res.recv_src,
            node_num_recv: res.num_recv,
            origin_of: p(9),
            recv_src: p(10),
        };
        stream
            .synchronize()
            .map_err(cuda_err("cuStreamSynchronize"))?;
        let k = |name: &str| gpu.function("moe_net", name);
        let kernels = [
            k("moe_ht_send")?,
            k("moe_ht_gather")?,
            k("moe_ht_remap")?,
            k("moe_ht_combine_send")?,
            k("moe_ht_combine_recv")?,
        ];
        comm.bootstrap().barrier()?;
        Ok(HtNet {
            base: landing.base,
            landing,
            comm: comm.clone(),
            ht,
            nodes: nodes.len(),
            cfg: cfg.clone(),
            kernels,
            last: Mutex::new((0, 0)),
            node: Box::new(node_disp),
            _node_comm: node_comm,
            _origin: (origin, origin_reg, origin_peers),
            _device: device,
        })
    }

    fn launch(&self, stream: &CudaStream, k: usize, grid: u32, a: &MoeNetArgs) -> Result<()> {
        self.landing.proxy_alive()?;
        self.comm.check_health()?;
        let mut b = stream.launch_builder(&self.kernels[k]);
        b.arg(a).arg(&self.ht);
        let cfg = LaunchConfig {
            grid_dim: (grid, 1, 1),
            block_dim: (512, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: both argument structs match the kernel's (layout-tested); every buffer they
        // name lives as long as this exchange; the caller vouches for the per-call inputs.
        self.comm
            .check(unsafe { b.launch(cfg) }.map(|_| ()), "cuLaunchKernel")
    }

    /// Dispatches (see [`super::moe::MoeDispatcher::dispatch`]); `scales` nonzero: e4m3 rows.
    pub(super) fn dispatch(
        &self,
        stream: &CudaStream,
        x: u64,
        scales: u64,
        topk_idx: u64,
        topk_weights: u64,
        num_tokens: usize,
    ) -> Result<()> {
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
        *self.last.lock().unwrap_or_else(|p| p.into_inner()) = (topk_idx, num_tokens as u32);
        let a = MoeNetArgs {
            x,
            scales,
            fp8: u32::from(scales != 0),
            topk_idx,
            topk_weights,
            num_tokens: num_tokens as u32,
            ..self.base
        };
        let blocks = self.landing.blocks;
        self.launch(stream, 0, blocks, &a)?;
        self.launch(stream, 1, blocks, &a)?;
        let slots = self.nodes * max;
        let (fx, fi, fw) = (self.ht.fwd_x, self.ht.fwd_idx, self.ht.fwd_w);
        // SAFETY: the forwarding slots are this exchange's own buffers, sized for `slots` tokens.
        unsafe {
            if scales == 0 {
                self.node.dispatch(stream, fx, fi, fw, slots)?;
            } else {
                self.node
                    .dispatch_fp8(stream, fx, self.ht.fwd_scales, fi, fw, slots)?;
            }
        }
        self.launch(stream, 2, blocks, &a)
    }

    /// Combines (see [`super::moe::MoeDispatcher::combine`]).
    pub(super) fn combine(&self, stream: &CudaStream, y: u64, out: u64) -> Result<()> {
        if out % 16 != 0 {
            return Err(Error::invalid("combine", "out 16-byte aligned"));
        }
        // SAFETY: fwd_out is this exchange's own, sized for every slot; `y` as the caller's
        // contract says.
        unsafe { self.node.combine(stream, y, self.ht.fwd_out) }?;
        let (topk_idx, num_tokens) = *self.last.lock().unwrap_or_else(|p| p.into_inner());
        let a = MoeNetArgs {
            topk_idx,
            num_tokens,
            out,
            ..self.base
        };
        let blocks = self.landing.blocks;
        self.launch(stream, 3, blocks, &a)?;
        self.launch(stream, 4, blocks, &a)
    }

    /// Results of the last dispatch: the node dispatcher's, with every row's origin named.
    pub(super) fn results(&self) -> super::moe::DispatchResults {
        super::moe::DispatchResults {
            recv_src: self.ht.recv_src,
            ..self.node.results()
        }
    }

    pub(super) fn combine_buffer(&self) -> u64 {
        self.node.combine_buffer()
    }

    pub(super) fn config(&self) -> &MoeConfig {
        &self.cfg
    }

    pub(super) fn sms(&self) -> u32 {
        self.landing.blocks
    }

    /// `[nodes]` u32: rows each node's rail peer sent here in the last dispatch.
    pub(super) fn network_rows(&self) -> (u64, usize) {
        (self.ht.net_rows, self.nodes)
    }
}
