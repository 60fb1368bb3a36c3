//! PortChannels over CUDA IPC: the peer's destination and token pool are mapped into this
//! process, and the proxy's [`CopyEngineConnection`] copies into them with the copy engines.

use super::Link;
use crate::channel::proxy::ProxyBuilder;
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
        let (conn, flush_done) =
            proxy.add_connection(Box::new(CopyEngineConnection::new(w.gpu)?))?;
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
