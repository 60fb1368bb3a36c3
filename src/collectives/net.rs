//! All-to-all and allreduce between ranks of different nodes, every byte through PortChannels:
//! copy engines between ranks of one host, the proxies over TCP (Ethernet), or RDMA over the Ib
//! transport in any posting mode (today the emulated NIC, `DOORBELL_IB_EMULATE=1`). Direct
//! algorithms, for correctness first: an all-to-all sends block p to rank p; the allreduce sends
//! the whole input to every rank and each sums the `world` copies in rank order (identical bits
//! everywhere). Neither is tuned (the allreduce moves `world - 1` times its input per rank); the
//! NVLink collectives (`allreduce`, `alltoall`) are the ones to use inside a node.
//!
//! The data lives in buffers the collective owns: [`NetCollectives::send_buffer`] and
//! [`NetCollectives::recv_buffer`] (`world` slots; slot r holds what rank r sent). Calls are
//! stream-ordered and CUDA-graph capturable (every count stays in device memory and each call
//! consumes exactly the signals it causes). Kernels: `cuda/kernels/net.cu`.

use super::DataType;
use crate::device_api::PortChannelHandle;
use crate::error::{Error, Result};
use crate::host::communicator::{Communicator, PortChannels, RegisteredMemory, Transport};
use crate::host::cuda::cuda_err;
use crate::host::memory::Buffer;
use crate::host::proxy::ProxyService;
use cudarc::driver::{CudaFunction, CudaSlice, CudaStream, DevicePtr, LaunchConfig, PushKernelArg};
use std::sync::Arc;

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
    channels: PortChannels,
    _send_reg: Arc<RegisteredMemory>,
    _recv_reg: Arc<RegisteredMemory>,
    send: Arc<Buffer>,
    recv: Arc<Buffer>,
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
        let recv_bytes = max_bytes
            .checked_mul(world)
            .ok_or_else(|| Error::invalid("max_bytes", "times the ranks overflows"))?;
        let send = comm.alloc(max_bytes)?;
        let recv = comm.alloc(recv_bytes)?;
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
        Ok(NetCollectives {
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

    fn launch_exchange(&self, stream: &CudaStream, bytes: u64, src_stride: u64) -> Result<()> {
        if let Some(why) = self.proxy.failure() {
            return Err(Error::invalid(
                "net collective",
                format!("the proxy stopped: {why}"),
            ));
        }
        let (world, rank) = (self.comm.world_size() as u32, self.comm.rank() as u32);
        let (h, s, r) = (self.handles_ptr, self.send_buffer(), self.recv_buffer());
        let mut b = stream.launch_builder(&self.exchange);
        b.arg(&h)
            .arg(&world)
            .arg(&rank)
            .arg(&bytes)
            .arg(&src_stride)
            .arg(&s)
            .arg(&r);
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
        self.launch_exchange(stream, block_bytes as u64, block_bytes as u64)
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
        self.launch_exchange(stream, bytes as u64, 0)?;
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
}
