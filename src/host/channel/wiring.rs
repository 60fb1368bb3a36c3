//! What the communicator hands the channel layer to wire channels: the job's facts and the parts
//! of its state the channels and their transports set up from. The communicator builds one per
//! channel set; the channel modules decide what to do with it.

use crate::channel::registered::RegisteredMemory;
use crate::channel::semaphore::TokenPool;
use crate::device_api::SemaphoreHandle;
use crate::error::{Error, Result};
use crate::gpu::cuda::Gpu;
use crate::gpu::wait::WaitDiagnostics;
use crate::job::bootstrap::Bootstrap;
use crate::job::topology::Topology;
use crate::transport::ib::posting::conn::IbDevice;
use crate::transport::ib::posting::select::PostingMode;
use crate::transport::ipc::RemoteMemory;
use std::sync::Arc;

/// One channel set's view of the job.
pub(crate) struct Wiring<'a> {
    pub(crate) bootstrap: &'a Bootstrap,
    pub(crate) gpu: &'a Arc<Gpu>,
    pub(crate) tokens: &'a Arc<TokenPool>,
    pub(crate) diagnostics: &'a WaitDiagnostics,
    /// The job's shape (every rank's node).
    pub(crate) topology: &'a Topology,
    /// The channel set's first token slot (every rank took the same) and its number.
    pub(crate) base: usize,
    pub(crate) channel: u32,
    /// This rank's RDMA NIC, when it has one for PortChannels.
    pub(crate) ib: Option<IbWiring<'a>>,
    /// Maps peers' memory into this process (the communicator's fd server and bootstrap).
    pub(crate) peers: &'a dyn PeerMemory,
}

/// Every same-host peer's counterpart of a memory mapped here, by rank (`None`: this rank and
/// ranks on other hosts).
pub(crate) type MappedPeers = Vec<Option<Arc<RemoteMemory>>>;

/// How channels map same-host peers' memory (CUDA IPC): implemented by the communicator.
pub(crate) trait PeerMemory {
    /// Maps every same-host peer's counterpart of `mem` (collective: each rank passes its own).
    fn exchange(&self, mem: &RegisteredMemory) -> Result<MappedPeers>;
    /// Maps one same-host peer's memory from the descriptor bytes it published.
    fn import(&self, peer: usize, descriptor: &[u8]) -> Result<RemoteMemory>;
}

/// This rank's NIC as PortChannels use it.
pub(crate) struct IbWiring<'a> {
    pub(crate) dev: &'a Arc<IbDevice>,
    pub(crate) posting: PostingMode,
    /// Peers on another node the NIC reaches: their token pool's address and rkey.
    pub(crate) peer_pools: &'a [Option<(u64, u32)>],
    /// Queue pairs per peer for whoever posts (`DOORBELL_IB_QPS_PER_PEER`).
    pub(crate) qps_per_peer: usize,
}

impl Wiring<'_> {
    pub(crate) fn rank(&self) -> usize {
        self.bootstrap.rank()
    }
    pub(crate) fn world(&self) -> usize {
        self.bootstrap.world_size()
    }
    /// Whether `peer` runs on this host (CUDA IPC reaches its memory).
    pub(crate) fn same_host(&self, peer: usize) -> bool {
        self.topology.same_node(peer)
    }

    /// An error naming `peer` as the cause of a failed set-up.
    pub(crate) fn missing(&self, peer: usize, why: &str) -> Error {
        Error::Bootstrap {
            me: self.rank(),
            rank: Some(peer),
            why: why.into(),
        }
    }

    /// The semaphore to same-host `peer` in the token slots from `base` (one per rank): my inbound
    /// token and expected count for it, and its inbound token for me mapped through its pool.
    pub(crate) fn semaphore(&self, base: usize, peer: usize) -> Result<SemaphoreHandle> {
        let remote = self
            .tokens
            .remote_inbound(peer, base + self.rank())
            .ok_or_else(|| Error::TransportUnavailable {
                transport: "CudaIpc",
                why: format!("rank {peer} is not on this host; its semaphores cannot be mapped"),
            })?;
        Ok(SemaphoreHandle {
            inbound_token: self.tokens.inbound(base + peer),
            expected_inbound: self.tokens.private(base + peer),
            remote_inbound_token: remote,
            site: self.diagnostics.site(peer as i32, self.channel),
        })
    }
}
