//! PortChannels: kernels push put/signal/flush triggers into the proxy's FIFO and the proxy
//! carries them over the peer's transport (copy engines into CUDA IPC mappings, RDMA work
//! requests on a queue pair, or TCP between proxies).
//!
//! `connect` wires one channel set: each peer gets the first transport of [`ROUTES`] that
//! reaches it (the choice and its reason logged), each transport's part of the set-up is one file
//! here (`ipc`, `ib`, `ethernet`: what it registers, exchanges and connects, and the
//! proxy [`crate::transport::Connection`] it adds), and the channels come out in rank order. The
//! communicator hands in its state as a `Wiring`; it decides nothing about transports.

mod ethernet;
mod ib;
mod ipc;

use crate::channel::proxy::{MemoryId, ProxyBuilder, SemaphoreId};
use crate::channel::registered::RegisteredMemory;
use crate::channel::semaphore::TokenPool;
use crate::channel::wiring::Wiring;
use crate::device_api::PortChannelHandle;
use crate::error::Result;
use crate::transport::ethernet::NetReceiver;
use crate::transport::ib::posting::conn::Registration;
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
    pub(crate) _registrations: Vec<Arc<Registration>>,
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
    pub(crate) _qps: Vec<crate::transport::ib::posting::gpu_qp::MappedQp>,
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
    /// RDMA work requests on queue pairs of this rank's NIC (today the emulated mlx5 NIC,
    /// `DOORBELL_IB_EMULATE=1`, ranks of one physical host acting as separate nodes), posted by
    /// the proxy or by the kernels.
    Ib,
}

/// The transports a PortChannel may take, in the order they are tried: the first that reaches a
/// peer carries its channel. A new transport is its [`crate::transport::Connection`] in its
/// folder of `transport/`, its wiring in one file beside `ipc`, `ib` and `ethernet`, an
/// entry here, and an arm in `Wiring::reaches` and in `connect`.
pub const ROUTES: [Transport; 3] = [Transport::CudaIpc, Transport::Ib, Transport::Ethernet];

impl Wiring<'_> {
    /// Whether `t` reaches `peer`, and why (or why not), for the log.
    pub(crate) fn reaches(&self, t: Transport, peer: usize) -> (bool, &'static str) {
        match t {
            Transport::CudaIpc if self.same_host(peer) => (
                true,
                "same host: copy engines into its memory mapped by CUDA IPC",
            ),
            Transport::CudaIpc => (false, "another host (or emulated node)"),
            Transport::Ib => match &self.ib {
                None => (
                    false,
                    "no RDMA NIC for PortChannels (DOORBELL_IB_EMULATE unset)",
                ),
                Some(ib) if ib.peer_pools.get(peer).is_some_and(Option::is_some) => (
                    true,
                    "another node the NIC reaches (its token pool is registered)",
                ),
                Some(_) => (false, "the NIC does not reach it (no token pool of its)"),
            },
            Transport::Ethernet => (true, "another node no faster transport reaches: TCP"),
        }
    }

    /// The transport of the channel to `peer`: the first of [`ROUTES`] that reaches it.
    pub(crate) fn route(&self, peer: usize) -> Transport {
        for t in ROUTES {
            let (yes, why) = self.reaches(t, peer);
            if yes {
                tracing::debug!(
                    "rank {}: PortChannel set {} to rank {peer} takes {t:?}: {why}",
                    self.rank(),
                    self.channel
                );
                return t;
            }
            tracing::trace!("rank {}: not {t:?} to rank {peer}: {why}", self.rank());
        }
        Transport::Ethernet // reaches every peer
    }
}

/// One peer's channel as its transport wired it.
struct Link {
    dst_mem: MemoryId,
    flush_done: u64,
    semaphore: SemaphoreId,
    /// Kernels posting their own RDMA work: the link's device address and what it keeps alive.
    gpu_link: Option<(u64, GpuLink)>,
    registrations: Vec<Arc<Registration>>,
    receiver: Option<NetReceiver>,
    /// The peer's destination mapped here, or my own destination (nothing of the peer's mapped).
    dst: std::result::Result<Arc<RemoteMemory>, Arc<RegisteredMemory>>,
}

/// Builds one PortChannel to every other rank on `proxy` (collective; start the proxy after).
/// For the channel to peer `p`: puts copy from my `src` into `p`'s `dst`, and signals land in
/// `p`'s inbound token after the data. Every rank runs each transport's collective set-up in the
/// same order (CUDA IPC's exchange, the NIC's registrations and queue pairs where this rank has a
/// NIC, the TCP connections where any rank needs them), then wires its peers in rank order.
pub(crate) fn connect(
    w: &Wiring,
    proxy: &mut ProxyBuilder,
    src: &Arc<RegisteredMemory>,
    dst: &Arc<RegisteredMemory>,
) -> Result<PortChannels> {
    let (rank, world) = (w.rank(), w.world());
    let routes: Vec<Option<Transport>> = (0..world)
        .map(|p| (p != rank).then(|| w.route(p)))
        .collect();
    let peers_of =
        |t: Transport| -> Vec<usize> { (0..world).filter(|&p| routes[p] == Some(t)).collect() };
    let mut ipc = ipc::IpcSetup::prepare(w, dst)?;
    let mut ib = ib::IbSetup::prepare(w, src, dst, &peers_of(Transport::Ib))?;
    let mut net = ethernet::EthernetSetup::prepare(w, dst, &peers_of(Transport::Ethernet))?;
    let src_mem = match &ib {
        Some(ib) => ib.register_source(proxy, src)?,
        None => proxy.add_memory(src.device_ptr(), src.len() as u64)?,
    };
    let fifo = proxy.fifo_handle();
    let mut channels = Vec::with_capacity(world.saturating_sub(1));
    for peer in (0..world).filter(|&p| p != rank) {
        let transport = routes[peer].unwrap_or(Transport::Ethernet);
        let link = match transport {
            Transport::CudaIpc => ipc.link(w, proxy, peer)?,
            Transport::Ib => match ib.as_mut() {
                Some(ib) => ib.link(w, proxy, src, dst, peer)?,
                None => return Err(w.missing(peer, "no RDMA set-up for a peer the NIC reaches")),
            },
            Transport::Ethernet => net.link(w, proxy, dst, peer)?,
        };
        let mut f = fifo;
        f.site = w.diagnostics.site(peer as i32, w.channel);
        channels.push(PortChannel {
            peer,
            handle: PortChannelHandle {
                fifo: f,
                inbound_token: w.tokens.inbound(w.base + peer),
                expected_inbound: w.tokens.private(w.base + peer),
                flush_done: link.flush_done,
                semaphore: link.semaphore.0,
                dst_mem: link.dst_mem.0,
                src_mem: src_mem.0,
                reserved: 0,
                ib: link.gpu_link.as_ref().map_or(0, |(p, _)| *p),
            },
            transport,
            _link: link.gpu_link.map(|(_, l)| l),
            _registrations: link.registrations,
            _receiver: link.receiver,
            _src: src.clone(),
            _dst: link.dst,
            _tokens: w.tokens.clone(),
        });
    }
    Ok(PortChannels { channels })
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
