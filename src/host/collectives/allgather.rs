//! All-gather moved entirely by copy engines through PortChannels: one GPU thread per rank pushes
//! triggers and the proxy's copy engines carry every byte, so the collective occupies a single
//! SM (one block of one warp) and leaves the rest of the GPU to compute.
//!
//! The gathered data lives in a buffer the collective owns and every peer has mapped (the copy
//! engines write into peers' memory directly): [`PortAllGather::output`] holds `world` shards,
//! rank k's at `k * shard_bytes`. A call takes this rank's shard from any device address (copied
//! into place on the stream first unless it already is there) and is stream-ordered and
//! CUDA-graph capturable: the kernel keeps every count in device memory and each call consumes
//! exactly the signals it causes.
//!
//! Algorithm and protocol: `cuda/kernels/allgather.cu` (a ring, because copy engines sending to
//! every peer at once lose half their rate).

use crate::channel::memory_channel::RegisteredMemory;
use crate::channel::port_channel::PortChannels;
use crate::channel::proxy::ProxyService;
use crate::communicator::Communicator;
use crate::device_api::PortChannelHandle;
use crate::error::{Error, Result};
use crate::gpu::cuda::cuda_err;
use crate::gpu::memory::Buffer;
use crate::gpu::signature::{self, CallChecker, CallKind};
use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{
    CudaEvent, CudaFunction, CudaStream, DevicePtr, DeviceRepr, LaunchConfig, PushKernelArg,
};
use std::sync::Arc;

/// Knobs of a [`PortAllGather`].
#[derive(Debug, Clone)]
pub struct AllGatherOptions {
    /// Bytes per copy-engine transfer: shards larger than this move in pieces, so the next hop of
    /// the ring starts before the whole shard has arrived. Each piece costs a trigger and a
    /// copy launch (about 2.6 us of engine time measured), so pieces stay large.
    pub piece_bytes: usize,
    /// Triggers the proxy FIFO holds (0: the default).
    pub fifo_size: usize,
}

impl Default for AllGatherOptions {
    fn default() -> Self {
        AllGatherOptions {
            piece_bytes: 32 << 20,
            fifo_size: 0,
        }
    }
}

/// A copy-engine all-gather over the ranks of one node. Collective to build and to call.
pub struct PortAllGather {
    // Dropped first: the proxy thread stops before the memory it copies goes away.
    proxy: ProxyService,
    comm: Arc<Communicator>,
    opts: AllGatherOptions,
    max_shard: usize,
    right: PortChannelHandle,
    left: PortChannelHandle,
    kernel: CudaFunction,
    /// Proxy memory whose offsets are device addresses: the kernel's first hop reads the
    /// caller's input through it.
    input_mem: u32,
    /// Copies the input into this rank's slot while the kernel runs (fork/join by events).
    side: Arc<CudaStream>,
    fork: CudaEvent,
    join: CudaEvent,
    _channels: PortChannels,
    _registered: Arc<RegisteredMemory>,
    buffer: Arc<Buffer>,
    /// Offsets in the buffer of my call word's slot and of every rank's (after the shards).
    word_off: u64,
    slots_off: u64,
    calls: CallChecker,
}

impl PortAllGather {
    /// Allocates and registers room for `world` shards of up to `max_shard_bytes`, builds the
    /// PortChannels to the ring neighbours and starts this GPU's proxy. Collective.
    pub fn new(
        comm: &Arc<Communicator>,
        max_shard_bytes: usize,
        opts: AllGatherOptions,
    ) -> Result<PortAllGather> {
        if max_shard_bytes == 0 {
            return Err(Error::invalid("max_shard_bytes", "must be positive"));
        }
        if opts.piece_bytes == 0 {
            return Err(Error::invalid("piece_bytes", "must be positive"));
        }
        let world = comm.world_size();
        let rank = comm.rank();
        let total = max_shard_bytes.checked_mul(world).ok_or_else(|| {
            Error::invalid(
                "max_shard_bytes",
                format!("{max_shard_bytes} x {world} ranks overflows"),
            )
        })?;
        // The call words after the shards: my slot, then one per rank.
        let word_off = total.next_multiple_of(256);
        let slots_off = word_off + 256;
        let buffer = comm.alloc(slots_off + (8 * world).next_multiple_of(256))?;
        // No inboxes: the words travel over the channels.
        let calls = super::channel_call_checker(comm)?;
        let registered = comm.register(&buffer)?;
        let mut builder = comm.proxy_builder(opts.fifo_size)?;
        let channels = comm.port_channels(&mut builder, &registered, &registered)?;
        let input_mem = builder.add_address_space()?.0;
        let proxy = builder.start()?;
        let side = comm.gpu().new_stream()?;
        let event = || {
            comm.gpu()
                .context()
                .new_event(Some(CUevent_flags::CU_EVENT_DISABLE_TIMING))
                .map_err(cuda_err("cuEventCreate"))
        };
        let (fork, join) = (event()?, event()?);
        let kernel = comm.gpu().function("allgather", "allgather_ring_port")?;
        let handle = |peer: usize| -> Result<PortChannelHandle> {
            Ok(channels
                .to(peer)
                .ok_or_else(|| Error::invalid("allgather", format!("no channel to rank {peer}")))?
                .device_handle())
        };
        let (right, left) = if world > 1 {
            (
                handle((rank + 1) % world)?,
                handle((rank + world - 1) % world)?,
            )
        } else {
            (PortChannelHandle::default(), PortChannelHandle::default())
        };
        // Every peer has mapped this buffer before anyone's copy engine writes into it.
        comm.bootstrap().barrier()?;
        Ok(PortAllGather {
            proxy,
            comm: comm.clone(),
            opts,
            max_shard: max_shard_bytes,
            right,
            left,
            kernel,
            input_mem,
            side,
            fork,
            join,
            _channels: channels,
            _registered: registered,
            buffer,
            word_off: word_off as u64,
            slots_off: slots_off as u64,
            calls,
        })
    }

    /// Device address of the gathered data: `world` shards, rank k's at `k * shard_bytes` for
    /// the `shard_bytes` of the last call. Read it after the call's work on the stream finished,
    /// and before the next call.
    pub fn output(&self) -> u64 {
        self.buffer.device_ptr()
    }

    /// Device address where this rank's shard goes: pass it as `input` to skip the copy-in.
    pub fn my_shard(&self, shard_bytes: usize) -> u64 {
        self.output() + (self.comm.rank() * shard_bytes) as u64
    }

    /// Largest shard a call takes.
    pub fn max_shard_bytes(&self) -> usize {
        self.max_shard
    }

    /// SMs a call occupies: one block of one warp, whatever the size.
    pub fn sms(&self) -> u32 {
        1
    }

    /// Gathers `shard_bytes` from `input` on every rank into [`PortAllGather::output`], on
    /// `stream`.
    ///
    /// # Safety
    /// `input` is device memory of this rank's GPU holding `shard_bytes`, valid until the work on
    /// `stream` completes (or equals [`PortAllGather::my_shard`]).
    pub unsafe fn run_raw(
        &self,
        stream: &CudaStream,
        input: u64,
        shard_bytes: usize,
    ) -> Result<()> {
        self.comm.check_health()?;
        if shard_bytes == 0 || shard_bytes > self.max_shard {
            return Err(Error::invalid(
                "shard_bytes",
                format!(
                    "{shard_bytes}: must be in 1..={} (the size this all-gather was built for)",
                    self.max_shard
                ),
            ));
        }
        if let Some(why) = self.proxy.failure() {
            return Err(Error::invalid(
                "allgather",
                format!("the proxy stopped: {why}"),
            ));
        }
        let word = self
            .calls
            .next(
                CallKind::AllGather,
                signature::BYTES,
                0,
                0,
                shard_bytes as u64,
                signature::capturing(stream),
            )
            .word;
        let mine = self.my_shard(shard_bytes);
        let world = self.comm.world_size();
        let copy_in = |s: &CudaStream| -> Result<()> {
            self.comm.gpu().bind()?;
            // SAFETY: the caller vouches for `input`; `mine` lies inside our buffer
            // (rank * shard_bytes + shard_bytes <= world * max_shard).
            unsafe { crate::gpu::cuda::copy_async(s, mine, input, shard_bytes) }
        };
        if world == 1 {
            return if input != mine {
                copy_in(stream)
            } else {
                Ok(())
            };
        }
        // The copy into my slot runs beside the kernel (whose first hop reads `input` itself):
        // fork to the side stream, join after the launch. Both are captured into graphs.
        let forked = input != mine;
        if forked {
            self.fork
                .record(stream)
                .map_err(cuda_err("cuEventRecord"))?;
            self.side
                .wait(&self.fork)
                .map_err(cuda_err("cuStreamWaitEvent"))?;
            copy_in(&self.side)?;
            self.join
                .record(&self.side)
                .map_err(cuda_err("cuEventRecord"))?;
        }
        let (rank, world) = (self.comm.rank() as u32, world as u32);
        let (shard, piece) = (shard_bytes as u64, self.opts.piece_bytes as u64);
        let words = self.output() + self.word_off;
        let mut b = stream.launch_builder(&self.kernel);
        b.arg(&self.right)
            .arg(&self.left)
            .arg(&rank)
            .arg(&world)
            .arg(&shard)
            .arg(&piece)
            .arg(&self.input_mem)
            .arg(&input)
            .arg(&word)
            .arg(&words)
            .arg(&self.word_off)
            .arg(&self.slots_off);
        let cfg = LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (32, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: the arguments match allgather_ring_port; the channels, buffer and proxy live as
        // long as `self`; `input` holds the shard until the kernel's final flush.
        let launched = self
            .comm
            .cuda_result(unsafe { b.launch(cfg) }.map(|_| ()), "cuLaunchKernel");
        if forked {
            stream
                .wait(&self.join)
                .map_err(cuda_err("cuStreamWaitEvent"))?;
        }
        launched
    }

    /// Gathers `input` (this rank's shard) from every rank into [`PortAllGather::output`].
    pub fn run<T: DeviceRepr, I: DevicePtr<T>>(
        &self,
        stream: &CudaStream,
        input: &I,
    ) -> Result<()> {
        let bytes = input.num_bytes();
        let (p, _g) = input.device_ptr(stream);
        // SAFETY: a live cudarc allocation of `bytes` on this context.
        unsafe { self.run_raw(stream, p, bytes) }
    }
}
