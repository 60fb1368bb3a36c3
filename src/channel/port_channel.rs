//! PortChannels: kernels push put/signal/flush triggers into the proxy's FIFO and the proxy
//! carries them over the peer's transport (copy engines into CUDA IPC mappings, TCP between
//! proxies, or RDMA work requests on a queue pair).

use crate::channel::memory_channel::RegisteredMemory;
use crate::channel::semaphore::TokenPool;
use crate::device_api::PortChannelHandle;
use crate::transport::ethernet::NetReceiver;
use crate::transport::ipc::RemoteMemory;
use std::sync::Arc;

/// A PortChannel to one peer: the device handle and what its proxy entries point into.
pub struct PortChannel {
    pub(crate) peer: usize,
    pub(crate) handle: PortChannelHandle,
    pub(crate) transport: Transport,
    // Kernels posting their own RDMA work (DOORBELL_IB_POSTING=ibgda|cpu): dropped before the
    // memories it names.
    pub(crate) _link: Option<GpuLink>,
    /// RDMA registrations its work requests name (Ib): dropped after the queue pairs above.
    pub(crate) _registrations: Vec<Arc<crate::transport::ib::conn::Registration>>,
    // Dropped first: the receiver writes into the destination and the token pool.
    pub(crate) _receiver: Option<NetReceiver>,
    pub(crate) _src: Arc<RegisteredMemory>,
    /// The peer's destination mapped here (CUDA IPC), or my own destination (Ethernet: my
    /// receiver writes what the peer puts into it).
    pub(crate) _dst: Result<Arc<RemoteMemory>, Arc<RegisteredMemory>>,
    pub(crate) _tokens: Arc<TokenPool>,
}

/// What a PortChannel whose kernels post RDMA work keeps alive: its queue pair, the link kernels
/// read, the scratch words the NIC writes.
pub(crate) struct GpuLink {
    pub(crate) _qps: Vec<crate::transport::ib::gpu_qp::MappedQp>,
    pub(crate) _link: cudarc::driver::CudaSlice<u8>,
    pub(crate) _scratch: cudarc::driver::CudaSlice<u8>,
}

/// How a channel's bytes travel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transport {
    /// Copy engines into the peer's memory mapped by CUDA IPC (same host).
    CudaIpc,
    /// The proxies over TCP (another host, or `DOORBELL_SEPARATE_NODES=1`).
    Ethernet,
    /// RDMA work requests posted by the proxy to this rank's emulated mlx5 NIC
    /// (`DOORBELL_IB_EMULATE=1`, ranks of one physical host acting as separate nodes).
    Ib,
}

impl PortChannel {
    /// The peer's rank.
    pub fn peer(&self) -> usize {
        self.peer
    }
    /// The handle kernels take.
    pub fn device_handle(&self) -> PortChannelHandle {
        self.handle
    }
    /// How its bytes travel.
    pub fn transport(&self) -> Transport {
        self.transport
    }
}

/// One PortChannel per peer, in rank order (this rank skipped).
pub struct PortChannels {
    pub(crate) channels: Vec<PortChannel>,
}

impl PortChannels {
    /// The channel to `peer`.
    pub fn to(&self, peer: usize) -> Option<&PortChannel> {
        self.channels.iter().find(|c| c.peer == peer)
    }
    /// The device handles, in peer order.
    pub fn handles(&self) -> Vec<PortChannelHandle> {
        self.channels.iter().map(|c| c.handle).collect()
    }
    /// Number of channels.
    pub fn len(&self) -> usize {
        self.channels.len()
    }
    /// True with no peers.
    pub fn is_empty(&self) -> bool {
        self.channels.is_empty()
    }
}
