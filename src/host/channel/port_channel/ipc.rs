//! PortChannels over CUDA IPC: the peer's destination and token pool are mapped into this
//! process, and the proxy's `CopyEngineConnection` ([`ProxyBuilder::add_connection`]) copies into them with the copy engines.

use super::Link;
use crate::channel::proxy::{ConnectionId, ProxyBuilder};
use crate::channel::registered::RegisteredMemory;
use crate::channel::wiring::Wiring;
use crate::error::Result;
use crate::transport::ipc::{CopyEngineConnection, RemoteMemory};
use std::sync::Arc;

/// Every same-host peer's destination, mapped here.
pub(super) struct IpcSetup {
    dsts: Vec<Option<Arc<RemoteMemory>>>,
}

impl IpcSetup {
    /// Maps every same-host peer's `dst` (collective: every rank runs it).
    pub(super) fn prepare(w: &Wiring, dst: &Arc<RegisteredMemory>) -> Result<IpcSetup> {
        Ok(IpcSetup {
            dsts: w.peers.exchange(dst)?,
        })
    }

    /// The channel to `peer`: its mapped destination, a copy-engine connection, and its inbound
    /// token for this rank mapped through its token pool.
    pub(super) fn link(
        &mut self,
        w: &Wiring,
        proxy: &mut ProxyBuilder,
        peer: usize,
    ) -> Result<Link> {
        let remote = self.dsts[peer]
            .clone()
            .ok_or_else(|| w.missing(peer, "its memory could not be mapped"))?;
        let token = w.semaphore(w.base, peer)?.remote_inbound_token;
        let dst_mem = proxy.add_memory(remote.device_ptr(), remote.len() as u64)?;
        let (conn, flush_done) = proxy.add_connection()?;
        let semaphore = proxy.add_semaphore(conn, token)?;
        Ok(Link {
            dst_mem,
            flush_done,
            semaphore,
            gpu_link: None,
            registrations: Vec::new(),
            receiver: None,
            dst: Ok(remote),
        })
    }
}

impl ProxyBuilder {
    /// A copy-engine connection to a peer on this host, whose memory is mapped here by CUDA IPC
    /// (what every connection of a proxy was before transports had connections of their own).
    /// Returns its id and the device address of its flush word.
    pub fn add_connection(&mut self) -> Result<(ConnectionId, u64)> {
        let conn = CopyEngineConnection::new(self.gpu())?;
        self.add_transport_connection(Box::new(conn))
    }
}
