//! MemoryChannels: kernels load from and store into a peer's memory mapped here (same host,
//! NVLink or PCIe), and signal through semaphores.

pub use crate::channel::registered::RegisteredMemory;
use crate::channel::semaphore::TokenPool;
use crate::channel::wiring::Wiring;
use crate::device_api::MemoryChannelHandle;
use crate::error::{Error, Result};
use crate::job::topology::Topology;
use crate::transport::ipc::RemoteMemory;
use std::sync::Arc;

/// A MemoryChannel to one peer: the device handle and the mappings it points into.
pub struct MemoryChannel {
    pub(crate) peer: usize,
    pub(crate) handle: MemoryChannelHandle,
    pub(crate) _src: Arc<RegisteredMemory>,
    pub(crate) _dst: Arc<RemoteMemory>,
    pub(crate) _packets: Option<(Arc<RegisteredMemory>, Arc<RemoteMemory>)>,
    pub(crate) _tokens: Arc<TokenPool>,
}

impl MemoryChannel {
    /// The peer's rank.
    pub fn peer(&self) -> usize {
        self.peer
    }
    /// The handle kernels take (by value or in a device array).
    pub fn device_handle(&self) -> MemoryChannelHandle {
        self.handle
    }
}

/// One MemoryChannel per peer, in rank order (this rank skipped).
pub struct MemoryChannels {
    pub(crate) channels: Vec<MemoryChannel>,
}

impl MemoryChannels {
    /// The channels, in peer order.
    pub fn iter(&self) -> impl Iterator<Item = &MemoryChannel> {
        self.channels.iter()
    }
    /// The channel to `peer`.
    pub fn to(&self, peer: usize) -> Option<&MemoryChannel> {
        self.channels.iter().find(|c| c.peer == peer)
    }
    /// The device handles, in peer order.
    pub fn handles(&self) -> Vec<MemoryChannelHandle> {
        self.channels.iter().map(|c| c.handle).collect()
    }
    /// Number of channels (peers).
    pub fn len(&self) -> usize {
        self.channels.len()
    }
    /// True with no peers (a job of one rank).
    pub fn is_empty(&self) -> bool {
        self.channels.is_empty()
    }
}

/// MemoryChannels need every rank on this host: the error naming the first that is not.
pub(crate) fn refuse_other_hosts(topology: &Topology) -> Result<()> {
    match (0..topology.world()).find(|&p| !topology.same_node(p)) {
        Some(p) => Err(Error::TransportUnavailable {
            transport: "CudaIpc",
            why: format!(
                "rank {p} runs on another host; MemoryChannels need GPUs that can map each \
                 other's memory (NVLink or PCIe peer access on one host)"
            ),
        }),
        None => Ok(()),
    }
}

/// Builds one MemoryChannel to every other rank (collective; every rank on this host): see
/// `Communicator::memory_channels`.
pub(crate) fn connect(
    w: &Wiring,
    src: &Arc<RegisteredMemory>,
    dst: &Arc<RegisteredMemory>,
    packets: Option<&Arc<RegisteredMemory>>,
) -> Result<MemoryChannels> {
    let (rank, world) = (w.rank(), w.world());
    let dsts = w.peers.exchange(dst)?;
    let pkts = match packets {
        Some(p) => Some(w.peers.exchange(p)?),
        None => None,
    };
    let mut channels = Vec::with_capacity(world.saturating_sub(1));
    for peer in (0..world).filter(|&p| p != rank) {
        let missing = || Error::Bootstrap {
            me: rank,
            rank: Some(peer),
            why: "its memory could not be mapped".into(),
        };
        let remote_dst = dsts[peer].clone().ok_or_else(missing)?;
        let packets = match (&pkts, packets) {
            (Some(all), Some(local)) => {
                Some((local.clone(), all[peer].clone().ok_or_else(missing)?))
            }
            _ => None,
        };
        let handle = MemoryChannelHandle {
            semaphore: w.semaphore(w.base, peer)?,
            dst: remote_dst.device_ptr(),
            src: src.device_ptr(),
            packet_buffer: packets.as_ref().map_or(0, |(l, _)| l.device_ptr()),
            remote_packet_buffer: packets.as_ref().map_or(0, |(_, r)| r.device_ptr()),
            dst_bytes: remote_dst.len() as u64,
            src_bytes: src.len() as u64,
            packet_buffer_bytes: packets
                .as_ref()
                .map_or(0, |(l, r)| l.len().min(r.len()) as u64),
        };
        channels.push(MemoryChannel {
            peer,
            handle,
            _src: src.clone(),
            _dst: remote_dst,
            _packets: packets,
            _tokens: w.tokens.clone(),
        });
    }
    Ok(MemoryChannels { channels })
}
