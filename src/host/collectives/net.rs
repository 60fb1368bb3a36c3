//! All-to-all and allreduce between ranks of different nodes, every byte through PortChannels:
//! copy engines between ranks of one node, the proxies over TCP (Ethernet), or RDMA over the Ib
//! transport in any posting mode (today the emulated NIC, `DOORBELL_IB_EMULATE=1`). Built for
//! correctness first, not tuned:
//! - all-to-all: direct, block p to rank p over the transport that reaches p;
//! - allreduce, when every node holds one rank: direct, the whole input to every rank, each
//!   summing the `world` copies in rank order (identical bits everywhere);
//! - allreduce, when the ranks form several nodes of equal size (more than one rank each):
//!   hierarchical, so only a `1 / ranks per node` shard of the data crosses between nodes per
//!   rank (reduce-scatter inside the node, allreduce of each shard with the ranks of the same
//!   local index on the other nodes, all-gather inside the node; see `allreduce_hier`).
//!
//! The NVLink collectives (`allreduce`, `alltoall`) are the ones to use inside a node.
//!
//! The data lives in buffers the collective owns: [`NetCollectives::send_buffer`] and
//! [`NetCollectives::recv_buffer`] (`world` slots; slot r holds what rank r sent in an
//! all-to-all). Calls are stream-ordered and CUDA-graph capturable (every count stays in device
//! memory and each call consumes exactly the signals it causes). The hierarchical allreduce uses
//! the send buffer as scratch. Kernels: `cuda/kernels/net.cu`.
//!
//! Every call is checked like the NVLink collectives' (`DOORBELL_CALL_CHECK`): its word travels
//! with the ready handshake to each peer (a word slot after `max_bytes` in the send buffer, one
//! per rank after the slots in the receive buffer), and a rank whose call differs is named on
//! both sides with both calls (`Error::ArgumentMismatch`).

use super::DataType;
use crate::channel::memory_channel::RegisteredMemory;
use crate::channel::port_channel::{PortChannels, Transport};
use crate::channel::proxy::ProxyService;
use crate::communicator::Communicator;
use crate::device_api::PortChannelHandle;
use crate::error::{Error, Result};
use crate::gpu::cuda::cuda_err;
use crate::gpu::memory::Buffer;
use crate::gpu::signature::{self, CallChecker, CallKind};
use cudarc::driver::{
    CudaFunction, CudaSlice, CudaStream, DevicePtr, DeviceRepr, LaunchConfig, PushKernelArg,
};
use std::sync::Arc;

/// `NetWord` of `cuda/kernels/net.cu`: a call's word and where the words live.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct NetWord {
    word: u64,
    mine: u64,
    mine_off: u64,
    slots_off: u64,
    slots: u64,
}

// SAFETY: plain integers, the layout of the kernel's struct (five 64-bit fields).
unsafe impl DeviceRepr for NetWord {}

/// Direct all-to-all and allreduce over PortChannels. Collective to build and to call.
pub struct NetCollectives {
    // Dropped first: the proxy thread stops before the memory it moves goes away.
    proxy: ProxyService,
    comm: Arc<Communicator>,
    max_bytes: usize,
    /// The channel handles in device memory, and their address (taken once: asking the slice
    /// per call would tie each launch to the stream that made it, which graph capture refuses).
    _handles: CudaSlice<PortChannelHandle>,
    handles_ptr: u64,
    exchange: CudaFunction,
    reduce_f32: CudaFunction,
    reduce_bf16: CudaFunction,
    /// Set when ranks form several nodes of equal size, more than one rank each.
    hier: Option<Hierarchy>,
    channels: PortChannels,
    _send_reg: Arc<RegisteredMemory>,
    _recv_reg: Arc<RegisteredMemory>,
    send: Arc<Buffer>,
    recv: Arc<Buffer>,
    /// Offsets of my word slot in the send buffer and of the word slots in the receive buffer
    /// (the data regions end there).
    word_off: u64,
    slots_off: u64,
    calls: CallChecker,
}

/// Where this rank sits among equal nodes, and the kernels of the hierarchical allreduce.
struct Hierarchy {
    /// Ranks per node.
    local: usize,
    /// Nodes.
    nodes: usize,
    /// My index in my node, and my node's index.
    me: usize,
    node: usize,
    /// Device arrays: channel indices of my node's other ranks then of my rail peers (same
    /// local index on the other nodes), and their keys (local index, node index).
    _peers: CudaSlice<u32>,
    _keys: CudaSlice<u32>,
    peers_ptr: u64,
    keys_ptr: u64,
    phase: CudaFunction,
    sum_f32: CudaFunction,
    sum_bf16: CudaFunction,
    gather: CudaFunction,
}

impl NetCollectives {
    /// Buffers for up to `max_bytes` per rank and call (the all-to-all's whole send buffer, the
    /// allreduce's input), PortChannels to every rank, and this GPU's proxy. Collective.
    pub fn new(comm: &Arc<Communicator>, max_bytes: usize) -> Result<NetCollectives> {
        let world = comm.world_size();
        if max_bytes == 0 || world > 1024 {
            return Err(Error::invalid(
                "net collectives",
                "max_bytes positive, at most 1024 ranks",
            ));
        }
        let nodes = comm.topology().nodes();
        let local = nodes[0].len();
        let hierarchical = nodes.len() > 1 && local > 1 && nodes.iter().all(|n| n.len() == local);
        // The hierarchical allreduce's regions: 2 x local + nodes + 1 shards (see allreduce).
        let hier_bytes = (2 * local + nodes.len() + 1)
            .saturating_mul(max_bytes.div_ceil(local).next_multiple_of(256) + 256);
        let recv_bytes = max_bytes
            .checked_mul(world)
            .ok_or_else(|| Error::invalid("max_bytes", "times the ranks overflows"))?
            .max(if hierarchical { hier_bytes } else { 0 });
        // The call words after the data: mine in the send buffer, every rank's in the receive.
        let word_off = max_bytes.next_multiple_of(256);
        let slots_off = recv_bytes.next_multiple_of(256);
        let send = comm.alloc(word_off + 256)?;
        let recv = comm.alloc(slots_off + (8 * world).next_multiple_of(256))?;
        // No inboxes: the words travel over the channels.
        let calls = super::channel_call_checker(comm)?;
        let send_reg = comm.register(&send)?;
        let recv_reg = comm.register(&recv)?;
        let mut builder = comm.proxy_builder(0)?;
        let channels = comm.port_channels(&mut builder, &send_reg, &recv_reg)?;
        let proxy = builder.start()?;
        let stream = comm.gpu().new_stream()?;
        let handles = stream
            .clone_htod(&channels.handles())
            .map_err(cuda_err("cuMemcpyHtoD"))?;
        stream
            .synchronize()
            .map_err(cuda_err("cuStreamSynchronize"))?;
        let handles_ptr = handles.device_ptr(&stream).0;
        let f = |name: &str| comm.gpu().function("net", name);
        let rank = comm.rank();
        let hier = if hierarchical {
            let topology = comm.topology();
            let (node, me) = (topology.node(rank), topology.local(rank));
            let channel = |p: usize| (if p < rank { p } else { p - 1 }) as u32;
            let mut peers = Vec::new();
            let mut keys = Vec::new();
            // The team (keyed by local index), then the rail peers (keyed by node): nodes of equal
            // size here, so every other node has one.
            for &p in topology.team().iter().filter(|&&p| p != rank) {
                peers.push(channel(p));
                keys.push(topology.local(p) as u32);
            }
            for p in topology.rail_peers() {
                peers.push(channel(p));
                keys.push(topology.node(p) as u32);
            }
            let up = |v: &[u32]| stream.clone_htod(v).map_err(cuda_err("cuMemcpyHtoD"));
            let (dp, dk) = (up(&peers)?, up(&keys)?);
            stream
                .synchronize()
                .map_err(cuda_err("cuStreamSynchronize"))?;
            let (peers_ptr, keys_ptr) = (dp.device_ptr(&stream).0, dk.device_ptr(&stream).0);
            Some(Hierarchy {
                local,
                nodes: nodes.len(),
                me,
                node,
                peers_ptr,
                keys_ptr,
                _peers: dp,
                _keys: dk,
                phase: f("net_phase")?,
                sum_f32: f("net_sum_slots_f32")?,
                sum_bf16: f("net_sum_slots_bf16")?,
                gather: f("net_gather")?,
            })
        } else {
            None
        };
        Ok(NetCollectives {
            hier,
            proxy,
            comm: comm.clone(),
            max_bytes,
            _handles: handles,
            handles_ptr,
            exchange: f("net_exchange")?,
            reduce_f32: f("net_reduce_f32")?,
            reduce_bf16: f("net_reduce_bf16")?,
            channels,
            _send_reg: send_reg,
            _recv_reg: recv_reg,
            send,
            recv,
            word_off: word_off as u64,
            slots_off: slots_off as u64,
            calls,
        })
    }

    /// This rank's send buffer (device address, `max_bytes`).
    pub fn send_buffer(&self) -> u64 {
        self.send.device_ptr()
    }

    /// This rank's receive buffer (device address, `world` slots of up to `max_bytes`).
    pub fn recv_buffer(&self) -> u64 {
        self.recv.device_ptr()
    }

    /// The transport to `peer`.
    pub fn transport(&self, peer: usize) -> Option<Transport> {
        self.channels.to(peer).map(|c| c.transport())
    }

    /// Whether the allreduce is hierarchical: the ranks form several nodes of equal size, more
    /// than one rank each (then reduce-scatter inside the node, allreduce of each shard between
    /// nodes, all-gather inside the node).
    pub fn hierarchical(&self) -> bool {
        self.hier.is_some()
    }

    /// The next call's word and where the words live (counts the call).
    fn next_word(
        &self,
        stream: &CudaStream,
        kind: CallKind,
        dtype: u32,
        mode: u32,
        count: u64,
    ) -> NetWord {
        let graph = signature::capturing(stream);
        let c = self.calls.next(kind, dtype, mode, 0, count, graph);
        NetWord {
            word: c.word,
            mine: self.send_buffer() + self.word_off,
            mine_off: self.word_off,
            slots_off: self.slots_off,
            slots: self.recv_buffer() + self.slots_off,
        }
    }

    /// An error if this collective's proxy stopped (its kernels would wait for it in vain).
    fn proxy_alive(&self) -> Result<()> {
        self.comm.check_health()?;
        match self.proxy.failure() {
            Some(why) => Err(Error::invalid(
                "net collective",
                format!("the proxy stopped: {why}"),
            )),
            None => Ok(()),
        }
    }

    fn launch_exchange(
        &self,
        stream: &CudaStream,
        bytes: u64,
        src_stride: u64,
        w: NetWord,
    ) -> Result<()> {
        self.proxy_alive()?;
        let (world, rank) = (self.comm.world_size() as u32, self.comm.rank() as u32);
        let (h, s, r) = (self.handles_ptr, self.send_buffer(), self.recv_buffer());
        let mut b = stream.launch_builder(&self.exchange);
        b.arg(&h)
            .arg(&world)
            .arg(&rank)
            .arg(&bytes)
            .arg(&src_stride)
            .arg(&s)
            .arg(&r)
            .arg(&w);
        let threads = world.next_multiple_of(32).clamp(32, 1024);
        // SAFETY: matches net_exchange; `bytes` per slot and the source ranges were checked
        // against the buffers by the callers.
        unsafe {
            b.launch(LaunchConfig {
                grid_dim: (1, 1, 1),
                block_dim: (threads, 1, 1),
                shared_mem_bytes: 0,
            })
        }
        .map_err(cuda_err("cuLaunchKernel"))?;
        Ok(())
    }

    /// All-to-all of `block_bytes` per pair: block p of the send buffer (at `p * block_bytes`)
    /// lands in slot `rank` of rank p's receive buffer (at `rank * block_bytes`).
    pub fn alltoall(&self, stream: &CudaStream, block_bytes: usize) -> Result<()> {
        let world = self.comm.world_size();
        if block_bytes == 0 || block_bytes.saturating_mul(world) > self.max_bytes {
            return Err(Error::invalid(
                "block_bytes",
                format!(
                    "{block_bytes} x {world} ranks must be in 1..={} bytes",
                    self.max_bytes
                ),
            ));
        }
        let w = self.next_word(
            stream,
            CallKind::NetAllToAll,
            signature::BYTES,
            0,
            block_bytes as u64,
        );
        self.launch_exchange(stream, block_bytes as u64, block_bytes as u64, w)
    }

    /// Allreduce (sum) of `count` elements of `dtype` (bf16 or f32) from the send buffer into
    /// `out` (device memory of `count` elements; may be the send buffer).
    ///
    /// # Safety
    /// `out` holds `count` elements of `dtype`, valid until the work on `stream` completes.
    pub unsafe fn allreduce(
        &self,
        stream: &CudaStream,
        dtype: DataType,
        count: usize,
        out: u64,
    ) -> Result<()> {
        let bytes = count.saturating_mul(dtype.size());
        if count == 0 || bytes > self.max_bytes {
            return Err(Error::invalid(
                "count",
                format!("{count} elements must be in 1..={} bytes", self.max_bytes),
            ));
        }
        let f = match dtype {
            DataType::F32 => &self.reduce_f32,
            DataType::Bf16 => &self.reduce_bf16,
            DataType::F16 => {
                return Err(Error::invalid(
                    "dtype",
                    "f16 is not supported here (bf16, f32)",
                ))
            }
        };
        let w = self.next_word(
            stream,
            CallKind::NetAllReduce,
            dtype.code(),
            u32::from(self.hier.is_some()),
            count as u64,
        );
        if let Some(h) = &self.hier {
            // SAFETY: the caller's contract, passed on.
            return unsafe { self.allreduce_hier(h, stream, dtype, count, out, w) };
        }
        self.launch_exchange(stream, bytes as u64, 0, w)?;
        let (world, n, r) = (
            self.comm.world_size() as u32,
            count as u64,
            self.recv_buffer(),
        );
        let mut b = stream.launch_builder(f);
        b.arg(&r).arg(&out).arg(&world).arg(&n);
        let blocks = (count as u64).div_ceil(256).clamp(1, 1024) as u32;
        // SAFETY: matches net_reduce_*; the receive buffer holds `world` slots of `count`
        // elements; the caller vouches for `out`.
        unsafe {
            b.launch(LaunchConfig {
                grid_dim: (blocks, 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            })
        }
        .map_err(cuda_err("cuLaunchKernel"))?;
        Ok(())
    }

    /// Launches `b` with a thread per element of `n` (256 per block, at most 1024 blocks).
    fn launch_1d(b: &mut cudarc::driver::LaunchArgs, n: u64) -> Result<()> {
        let blocks = n.div_ceil(256).clamp(1, 1024) as u32;
        // SAFETY: each caller pushed the arguments its kernel takes, with ranges it checked.
        unsafe {
            b.launch(LaunchConfig {
                grid_dim: (blocks, 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            })
        }
        .map_err(cuda_err("cuLaunchKernel"))?;
        Ok(())
    }

    /// One exchange phase of the hierarchical allreduce with the `n` peers from entry `first` of
    /// the peer list (see `net_phase`).
    #[allow(clippy::too_many_arguments)]
    fn phase(
        &self,
        h: &Hierarchy,
        stream: &CudaStream,
        first: usize,
        n: usize,
        dst_off: u64,
        src_step: u64,
        bytes: u64,
        shard: u64,
        total: u64,
        w: NetWord,
    ) -> Result<()> {
        self.proxy_alive()?;
        let rank = self.comm.rank() as u32;
        let (peers, keys) = (
            h.peers_ptr + 4 * first as u64,
            h.keys_ptr + 4 * first as u64,
        );
        let (n, per_peer) = (n as u32, u32::from(src_step != 0));
        let mut b = stream.launch_builder(&h.phase);
        b.arg(&self.handles_ptr)
            .arg(&peers)
            .arg(&keys)
            .arg(&n)
            .arg(&dst_off)
            .arg(&src_step)
            .arg(&bytes)
            .arg(&per_peer)
            .arg(&shard)
            .arg(&total)
            .arg(&rank)
            .arg(&w);
        // SAFETY: matches net_phase; every offset and length lies in the buffers (allreduce_hier
        // sized them against max_bytes).
        unsafe {
            b.launch(LaunchConfig {
                grid_dim: (1, 1, 1),
                block_dim: (n.next_multiple_of(32).clamp(32, 1024), 1, 1),
                shared_mem_bytes: 0,
            })
        }
        .map_err(cuda_err("cuLaunchKernel"))?;
        Ok(())
    }

    /// The hierarchical allreduce. With L ranks per node and N nodes, shard j of the input is
    /// `ceil(count / L)` elements (the last one shorter); regions of the receive buffer, each
    /// `stride` bytes: A[L] (the node's copies of my shard), B[N] (the nodes' partial sums of my
    /// shard), C (its total), D[L] (the node's totals of every shard).
    /// 1. Inside the node: shard j of my input to rank j's A[me]; sum A (mine from my input)
    ///    into B[my node] and the head of my send buffer (the input is sent by then).
    /// 2. Between nodes, with the ranks of my local index: my partial to their B[my node]; sum B
    ///    in node order into C and the head of my send buffer.
    /// 3. Inside the node: my total to every rank's D[me]; `out` = D in order (mine from C).
    ///
    /// Every rank that computes a shard sums the same values in the same order, so every rank
    /// ends with the same bits. The send buffer's contents are scratch afterwards.
    ///
    /// # Safety
    /// As [`NetCollectives::allreduce`].
    unsafe fn allreduce_hier(
        &self,
        h: &Hierarchy,
        stream: &CudaStream,
        dtype: DataType,
        count: usize,
        out: u64,
        w: NetWord,
    ) -> Result<()> {
        let es = dtype.size() as u64;
        let (l, n) = (h.local as u64, h.nodes as u64);
        let shard_elems = (count as u64).div_ceil(l);
        let shard = shard_elems * es;
        let stride = shard.next_multiple_of(256);
        let total = count as u64 * es;
        let start = (h.me as u64 * shard).min(total);
        let mine = (total - start).min(shard);
        let (a, bb, c, d) = (0, l * stride, (l + n) * stride, (l + n + 1) * stride);
        if d + l * stride > self.slots_off {
            return Err(Error::invalid(
                "count",
                format!("{count} elements do not fit the hierarchical allreduce's regions"),
            ));
        }
        let sum = match dtype {
            DataType::F32 => &h.sum_f32,
            _ => &h.sum_bf16,
        };
        let (send, recv) = (self.send_buffer(), self.recv_buffer());
        let (stride_elems, mine_elems) = (stride / es, mine / es);
        let (me, node) = (h.me as u64, h.node as u64);
        // My shard summed over `nslots` slots of `stride` bytes from `base` (slot `own_slot`
        // read at `own` instead) into the head of my send buffer and `dst2`.
        let sum_into = |base: u64, nslots: u32, own_slot: u32, own: u64, dst2: u64| -> Result<()> {
            let mut b = stream.launch_builder(sum);
            b.arg(&base)
                .arg(&stride_elems)
                .arg(&nslots)
                .arg(&own_slot)
                .arg(&own)
                .arg(&mine_elems)
                .arg(&send)
                .arg(&dst2);
            Self::launch_1d(&mut b, mine_elems)
        };
        // 1: reduce-scatter inside the node.
        self.phase(
            h,
            stream,
            0,
            h.local - 1,
            a + me * stride,
            shard,
            0,
            shard,
            total,
            w,
        )?;
        sum_into(
            recv + a,
            h.local as u32,
            h.me as u32,
            send + start,
            recv + bb + node * stride,
        )?;
        // 2: allreduce of my shard between nodes.
        self.phase(
            h,
            stream,
            h.local - 1,
            h.nodes - 1,
            bb + node * stride,
            0,
            mine,
            shard,
            total,
            w,
        )?;
        sum_into(recv + bb, h.nodes as u32, u32::MAX, 0, recv + c)?;
        // 3: all-gather inside the node.
        self.phase(
            h,
            stream,
            0,
            h.local - 1,
            d + me * stride,
            0,
            mine,
            shard,
            total,
            w,
        )?;
        let (slots, nslots, own_slot, own) = (recv + d, h.local as u32, h.me as u32, recv + c);
        let mut b = stream.launch_builder(&h.gather);
        b.arg(&slots)
            .arg(&stride)
            .arg(&nslots)
            .arg(&own_slot)
            .arg(&own)
            .arg(&shard)
            .arg(&total)
            .arg(&out);
        Self::launch_1d(&mut b, total)
    }
}
