//! The node-spanning path of [`super::MoeHighThroughput`], DeepEP's
//! hierarchical scheme: a token crosses the network once per destination node, to the rank of
//! that node with the sender's local index (its rail peer), which forwards it over NVLink with the
//! node's own NVLink path (`ht_nvlink.rs`, on a communicator of the node's ranks); the combine
//! sums inside the node first (that dispatcher's combine), then sends one row per (token, node)
//! back over the network, where the token's rank adds the nodes' rows in node order (and, asked,
//! the top-k weights, which travel beside the rows). A dispatch by ranks (DeepEP's without top-k)
//! sends a token to the nodes of its ranks, with its rank mask in the message and each source's
//! counts of a node's experts in its first chunk's descriptor, for the node's dispatch by ranks.
//!
//! The network leg is a stream with receiver-driven admission: each rank's ring for a source node
//! holds [`MoeConfig::net_chunks`] chunks of 32 messages, and a sender writes a chunk only once
//! the receiver has granted its slot (a credit signal per chunk consumed), so the buffers are far
//! smaller than the worst case (`max_tokens` per source) and an incast of every node onto one rank
//! never overruns them. Protocol and kernels: `moe_ht_*` in `cuda/kernels/moe_net.cu`; the same
//! protocol on the CPU: [`super::plan::ChunkStream`].

use super::ht_nvlink::HtNvlink;
use super::net_area::{message_bytes, NetReceiveArea, ReceiveAreaShape};
use super::path::HighThroughputPath;
use super::plan::{NodeMap, HT_CHUNK};
use super::shared::{agree_shape, DispatchResults, MoeConfig, Route};
use crate::channel::symmetric::SymmetricBuffer;
use crate::communicator::Communicator;
use crate::device_api::{HtChunkDesc, MoeHtArgs, MoeNetArgs};
use crate::error::{Error, Result};
use crate::gpu::cuda::cuda_err;
use crate::gpu::signature::{self, CallChecker, CallKind};
use cudarc::driver::{CudaFunction, CudaSlice, CudaStream, DevicePtr, LaunchConfig, PushKernelArg};
use std::sync::{Arc, Mutex};

/// Ring chunks per source node unless [`MoeConfig::net_chunks`] says otherwise.
pub(super) const DEFAULT_NET_CHUNKS: usize = 8;

/// Node-spanning high-throughput MoE state. Collective to build and to call.
pub(super) struct HtNet {
    area: NetReceiveArea,
    comm: Arc<Communicator>,
    base: MoeNetArgs,
    ht: MoeHtArgs,
    nodes: usize,
    cfg: MoeConfig,
    kernels: [CudaFunction; 5],
    /// topk_idx and token count of the last dispatch (the combine needs them).
    last: Mutex<(u64, u32)>,
    /// The node's NVLink dispatcher and its communicator (dropped after it).
    node: Box<HtNvlink>,
    _node_comm: Arc<Communicator>,
    _origin: SymmetricBuffer,
    _device: Vec<CudaSlice<u8>>,
    /// The call check across nodes (`coll/moe_net.cuh`): a dispatch is checked with the rail peers
    /// (and by the node's own dispatcher inside the node), a combine with every peer.
    calls: CallChecker,
}

impl HtNet {
    pub(super) fn new(comm: &Arc<Communicator>, cfg: &MoeConfig) -> Result<HtNet> {
        let (world, rank) = (comm.world_size(), comm.rank());
        // Every node the same size: a token goes to the rank of the same local index on each.
        let map = NodeMap::new(comm.node_ids())?;
        let (nodes, size) = (map.nodes(), map.ranks_per_node());
        let (node, me) = (map.node(rank), map.local(rank));
        let chunks = cfg.net_chunks.unwrap_or(DEFAULT_NET_CHUNKS);
        if chunks == 0 || chunks > 1 << 20 {
            return Err(Error::invalid(
                "net_chunks",
                format!("{chunks}: the receive ring needs 1..=2^20 chunks of {HT_CHUNK} tokens"),
            ));
        }
        let node_of: Vec<u32> = (0..world).map(|r| map.node(r) as u32).collect();
        let local_of: Vec<u32> = (0..world).map(|r| map.local(r) as u32).collect();
        let rail: Vec<u32> = (0..nodes)
            .map(|n| map.rank(n, me).map(|r| r as u32))
            .collect::<Option<_>>()
            .ok_or_else(|| Error::invalid("nodes", "a node without a rank of my local index"))?;
        let msg = message_bytes(cfg);
        // A chunk descriptor, then (a dispatch by ranks) the source's counts of the node's experts.
        let node_experts = cfg.num_experts / world * size;
        let desc_bytes =
            (std::mem::size_of::<HtChunkDesc>() + 4 * node_experts).next_multiple_of(16);
        let area = NetReceiveArea::new(
            comm,
            cfg,
            ReceiveAreaShape {
                messages: nodes * chunks * HT_CHUNK * msg,
                counts: nodes * chunks * desc_bytes,
                fill_extra: 0,
                credits: true,
                // Two halves, by the combine's parity (moe_ht_combine_send).
                part_rows: 2 * world * cfg.max_tokens,
                stage_part_rows: world * cfg.max_tokens,
                part_weights: cfg.topk,
            },
        )?;
        // The node's own communicator and NVLink dispatcher, fed nodes x max_tokens slots.
        let others: Vec<usize> = (0..world).filter(|&r| map.node(r) != node).collect();
        let node_comm = Arc::new(comm.shrink(&others)?);
        let per_rank = cfg.num_experts / world;
        let slots = nodes * cfg.max_tokens;
        let node_cfg = MoeConfig {
            num_experts: per_rank * size,
            max_tokens: slots,
            receive_slots: 1,
            ..cfg.clone()
        };
        agree_shape(&node_comm, "high-throughput", false, &node_cfg)?;
        let node_disp = HtNvlink::new(&node_comm, node_cfg)?;
        // Every node rank's slot origins, mapped by the others (the rows' origins after the
        // node dispatch name the forwarder's slot).
        let origin = node_comm.alloc_symmetric(slots * 8)?;
        let origin_of: Vec<u64> = (0..size)
            .map(|l| {
                origin
                    .peer_ptr(l)
                    .ok_or_else(|| Error::TransportUnavailable {
                        transport: "CudaIpc",
                        why: format!("rank {l} of this node could not be mapped"),
                    })
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
            alloc(nodes * 4)?,                             // 8 net_rows
            upload(bytemuck::cast_slice(&origin_of))?,     // 9 origin_of
            alloc(max_rows * 8)?,                          // 10 recv_src
            alloc(nodes * 8)?,                             // 11 sent_chunks
            alloc(nodes * 8)?,                             // 12 recv_chunks
            alloc(nodes * cfg.max_tokens * 4)?,            // 13 list
            alloc(slots * cfg.topk * 4)?,                  // 14 fwd_wout
            alloc(slots * size)?,                          // 15 fwd_in_rank
            alloc(node_experts * 4)?,                      // 16 fwd_tpe
            alloc(cfg.max_tokens * 8)?,                    // 17 tok_nodes
        ];
        let p = |i: usize| device[i].device_ptr(&stream).0;
        let res = node_disp.results();
        let base = area.base;
        let ht = MoeHtArgs {
            nodes: nodes as u32,
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
            chunks: chunks as u32,
            weights: 0,
            off_ring: 0,
            off_desc: base.off_counts,
            stage_desc: base.stage_counts,
            credits: area.credits,
            sent_chunks: p(11),
            recv_chunks: p(12),
            list: p(13),
            node_counts: res.expert_counts,
            node_rows: res.recv_x,
            node_max_rows: res.max_rows as u64,
            fwd_wout: p(14),
            w_out: 0,
            off_part_w: area.off_part_w,
            stage_part_w: area.stage_part_w,
            in_rank: 0,
            fwd_in_rank: p(15),
            tokens_per_expert: 0,
            fwd_tpe: p(16),
            tok_nodes: p(17),
            desc_bytes: desc_bytes as u32,
            by_rank: 0,
        };
        stream
            .synchronize()
            .map_err(cuda_err("cuStreamSynchronize"))?;
        let k = |name: &str| gpu.function("moe_net", name);
        let kernels = [
            k("moe_ht_stage")?,
            k("moe_ht_exchange")?,
            k("moe_ht_remap")?,
            k("moe_ht_combine_send")?,
            k("moe_ht_combine_recv")?,
        ];
        comm.bootstrap().barrier()?;
        Ok(HtNet {
            base,
            area,
            comm: comm.clone(),
            ht,
            nodes,
            cfg: cfg.clone(),
            kernels,
            last: Mutex::new((0, 0)),
            node: Box::new(node_disp),
            _node_comm: node_comm,
            _origin: origin,
            _device: device,
            // The words travel to each peer\'s inbox in its area, not mapped ones.
            calls: crate::collectives::channel_call_checker(comm)?,
        })
    }

    /// Launches kernel `k` with this call's arguments, once the proxy and the communicator are
    /// known to be alive.
    fn launch_with(
        &self,
        stream: &CudaStream,
        k: usize,
        grid: u32,
        a: &MoeNetArgs,
        ht: &MoeHtArgs,
    ) -> Result<()> {
        self.area.proxy_alive()?;
        self.comm.check_health()?;
        self.launch_local(stream, k, grid, a, ht)
    }

    /// Launches kernel `k` without asking the communicator's health first: for the remap, which
    /// touches this GPU's memory only and marks the results when the exchange failed.
    fn launch_local(
        &self,
        stream: &CudaStream,
        k: usize,
        grid: u32,
        a: &MoeNetArgs,
        ht: &MoeHtArgs,
    ) -> Result<()> {
        let mut b = stream.launch_builder(&self.kernels[k]);
        b.arg(a).arg(ht);
        let cfg = LaunchConfig {
            grid_dim: (grid, 1, 1),
            block_dim: (512, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: both argument structs match the kernel's (layout-tested); every buffer they
        // name lives as long as this exchange; the caller vouches for the per-call inputs.
        self.comm
            .cuda_result(unsafe { b.launch(cfg) }.map(|_| ()), "cuLaunchKernel")
    }

    /// Blocks of the exchange kernel: a sending block per 16 nodes, then a receiving block per
    /// node (`moe_ht_exchange`).
    fn exchange_blocks(&self) -> u32 {
        (self.nodes.div_ceil(16) + self.nodes) as u32
    }

    /// Dispatches (see [`super::MoeHighThroughput::dispatch`] and `dispatch_by_rank`); `scales`
    /// nonzero: e4m3 rows.
    fn dispatch_rows(
        &self,
        stream: &CudaStream,
        x: u64,
        scales: u64,
        route: Route,
        num_tokens: usize,
    ) -> Result<()> {
        let max = self.base.max_tokens as usize;
        let (topk_idx, topk_weights, ht) = match route {
            Route::TopK { idx, weights } => (idx, weights, self.ht),
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
                let ht = MoeHtArgs {
                    in_rank,
                    tokens_per_expert,
                    by_rank: 1,
                    ..self.ht
                };
                (0, 0, ht)
            }
        };
        // The mode tells a dispatch by top-k (0) from one by ranks with per-expert counts (1) and
        // one by ranks without (2), as the node's own dispatch does: a mix is named at once.
        let mode = match (ht.by_rank != 0, ht.tokens_per_expert != 0) {
            (false, _) => 0,
            (true, true) => 1,
            (true, false) => 2,
        };
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
            // The word carries the row format, as the node dispatcher's does: at one rank per
            // node the rail peers are the only ranks that check it.
            call_word: self
                .calls
                .next(
                    CallKind::MoeDispatch,
                    if scales == 0 { 0 } else { signature::E4M3 },
                    mode,
                    0,
                    0,
                    signature::capturing(stream),
                )
                .word,
            ..self.base
        };
        self.launch_with(stream, 0, self.area.blocks, &a, &ht)?;
        self.launch_with(stream, 1, self.exchange_blocks(), &a, &ht)?;
        let slots = self.nodes * max;
        let (fx, fi, fw) = (ht.fwd_x, ht.fwd_idx, ht.fwd_w);
        let fs = if scales == 0 { 0 } else { ht.fwd_scales };
        // SAFETY: the forwarding slots are this exchange's own buffers, sized for `slots` tokens.
        let node = unsafe {
            if ht.by_rank != 0 {
                let tpe = if ht.tokens_per_expert == 0 {
                    0
                } else {
                    ht.fwd_tpe
                };
                self.node
                    .dispatch_by_rank(stream, fx, fs, ht.fwd_in_rank, tpe, slots)
            } else if scales == 0 {
                self.node.dispatch(stream, fx, fi, fw, slots)
            } else {
                self.node.dispatch_fp8(stream, fx, fs, fi, fw, slots)
            }
        };
        // The remap runs even when the exchange failed by now: it then marks the results the
        // node's dispatch left (moe_ht_remap), so they never pass for a whole dispatch.
        let remap = self.launch_local(stream, 2, self.area.blocks, &a, &ht);
        node.and(remap)
    }
}

impl HighThroughputPath for HtNet {
    fn spans_nodes(&self) -> bool {
        true
    }

    fn last_tokens(&self) -> usize {
        self.last.lock().unwrap_or_else(|p| p.into_inner()).1 as usize
    }

    fn config(&self) -> &MoeConfig {
        &self.cfg
    }

    fn sms(&self) -> u32 {
        self.area.blocks
    }

    unsafe fn dispatch(
        &self,
        stream: &CudaStream,
        x: u64,
        topk_idx: u64,
        topk_weights: u64,
        num_tokens: usize,
    ) -> Result<()> {
        let route = Route::TopK {
            idx: topk_idx,
            weights: topk_weights,
        };
        self.dispatch_rows(stream, x, 0, route, num_tokens)
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
        let route = Route::Ranks {
            in_rank,
            tokens_per_expert,
        };
        self.dispatch_rows(stream, x, scales, route, num_tokens)
    }

    unsafe fn dispatch_fp8(
        &self,
        stream: &CudaStream,
        x: u64,
        scales: u64,
        topk_idx: u64,
        topk_weights: u64,
        num_tokens: usize,
    ) -> Result<()> {
        if self.cfg.hidden % 128 != 0 || scales == 0 || scales % 4 != 0 {
            return Err(Error::invalid(
                "dispatch_fp8",
                "a hidden size that is a multiple of 128 and 4-byte aligned scales",
            ));
        }
        let route = Route::TopK {
            idx: topk_idx,
            weights: topk_weights,
        };
        self.dispatch_rows(stream, x, scales, route, num_tokens)
    }

    /// Combines (see [`super::MoeHighThroughput::combine`]).
    unsafe fn combine(
        &self,
        stream: &CudaStream,
        y: u64,
        out: u64,
        weights: Option<(u64, u64)>,
    ) -> Result<()> {
        if out % 16 != 0 {
            return Err(Error::invalid("combine", "out 16-byte aligned"));
        }
        // With weights the node's combine sums each slot's weights too, and they travel back
        // beside the slot's row (moe_ht_combine_send / _recv).
        let ht = MoeHtArgs {
            weights: u32::from(weights.is_some()),
            w_out: weights.map_or(0, |(_, w_out)| w_out),
            ..self.ht
        };
        let node_weights = weights.map(|(y_weights, _)| (y_weights, self.ht.fwd_wout));
        // SAFETY: fwd_out and fwd_wout are this exchange's own, sized for every slot; `y` and
        // the weights as the caller's contract says.
        unsafe { self.node.combine(stream, y, self.ht.fwd_out, node_weights) }?;
        let (topk_idx, num_tokens) = *self.last.lock().unwrap_or_else(|p| p.into_inner());
        let a = MoeNetArgs {
            topk_idx,
            num_tokens,
            out,
            call_word: self
                .calls
                .next(
                    CallKind::MoeCombine,
                    0,
                    // Variant 1: the weights travel too (a mix across ranks is named).
                    ht.weights,
                    0,
                    0,
                    signature::capturing(stream),
                )
                .word,
            ..self.base
        };
        let blocks = self.area.blocks;
        self.launch_with(stream, 3, blocks, &a, &ht)?;
        self.launch_with(stream, 4, blocks, &a, &ht)
    }

    fn combine_buffer(&self) -> Result<u64> {
        self.node.combine_buffer()
    }

    /// Results of the last dispatch: the node dispatcher's, with every row's origin named.
    fn results(&self) -> DispatchResults {
        DispatchResults {
            recv_src: self.ht.recv_src,
            // Rows are grouped by forwarding rank, not by source: no prefix matrix of sources.
            rank_prefix: 0,
            ..self.node.results()
        }
    }

    /// `[nodes]` u32: rows each node's rail peer sent here in the last dispatch.
    fn network_rows(&self) -> Option<(u64, usize)> {
        Some((self.ht.net_rows, self.nodes))
    }

    /// Bytes of this rank's receive rings (every source node's), and what rings of the worst
    /// case (`max_tokens` messages per source node) would take.
    fn network_ring_bytes(&self) -> Option<(u64, u64)> {
        let msg = u64::from(self.base.msg_bytes);
        let nodes = self.nodes as u64;
        Some((
            nodes * u64::from(self.ht.chunks) * HT_CHUNK as u64 * msg,
            nodes * u64::from(self.base.max_tokens) * msg,
        ))
    }
}
