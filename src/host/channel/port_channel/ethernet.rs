//! PortChannels over Ethernet: one TCP connection per peer and channel set; the proxy's
//! [`EthernetConnection`] sends what kernels put, and this rank's [`NetReceiver`] applies what the
//! peer sends into my destination and inbound token.

use super::Link;
use crate::channel::proxy::ProxyBuilder;
use crate::channel::registered::RegisteredMemory;
use crate::channel::wiring::Wiring;
use crate::error::{Error, Result};
use crate::transport::ethernet::{self, EthernetConnection, NetReceiver, ReceiveBuffer};
use std::sync::Arc;

/// The sockets to this rank's Ethernet peers, in their rank order, and every rank's destination
/// size (a put's offsets are checked against the peer's).
pub(super) struct EthernetSetup {
    sockets: std::vec::IntoIter<std::net::TcpStream>,
    lens: Vec<Vec<u8>>,
}

impl EthernetSetup {
    /// Trades destination sizes and, when any rank has an Ethernet peer, connects this rank's
    /// `peers` (collective: every rank runs it and every rank learns whether any needs TCP).
    pub(super) fn prepare(
        w: &Wiring,
        dst: &Arc<RegisteredMemory>,
        peers: &[usize],
    ) -> Result<EthernetSetup> {
        let lens = w.bootstrap.all_gather(&(dst.len() as u64).to_le_bytes())?;
        let needs_net = u8::from(!peers.is_empty());
        let any = w
            .bootstrap
            .all_gather(&[needs_net])?
            .iter()
            .any(|b| b.first() == Some(&1));
        let sockets = if any {
            ethernet::connect_peers(w.bootstrap, w.channel, peers)?
        } else {
            Vec::new()
        };
        Ok(EthernetSetup {
            sockets: sockets.into_iter(),
            lens,
        })
    }

    /// The channel to `peer` (the next of the peers `prepare` connected): a sender on the proxy,
    /// a receiver into `dst` and my inbound token for `peer`.
    pub(super) fn link(
        &mut self,
        w: &Wiring,
        proxy: &mut ProxyBuilder,
        dst: &Arc<RegisteredMemory>,
        peer: usize,
    ) -> Result<Link> {
        let socket = self
            .sockets
            .next()
            .ok_or_else(|| Error::invalid("ethernet", "a connection is missing"))?;
        let peer_len = self.lens[peer]
            .as_slice()
            .try_into()
            .map(u64::from_le_bytes)
            .map_err(|_| w.missing(peer, "sent a malformed buffer length"))?;
        // Offsets into the peer's destination: the peer's receiver checks them again.
        let dst_mem = proxy.add_memory(0, peer_len)?;
        let writer = socket
            .try_clone()
            .map_err(|e| Error::io("cloning a socket", e))?;
        let (conn, flush_done) = proxy.add_transport_connection(Box::new(
            EthernetConnection::spawn(w.gpu, writer, proxy.failure_sink(), peer)?,
        ))?;
        let receiver = NetReceiver::spawn(
            w.gpu,
            socket,
            ReceiveBuffer {
                dst: dst.device_ptr(),
                dst_bytes: dst.len() as u64,
                token: w.tokens.inbound(w.base + peer),
            },
            proxy.failure_sink(),
            peer,
        )?;
        // The receiver owns the token: the proxy's signal is a header on the wire.
        let semaphore = proxy.add_semaphore(conn, 0)?;
        Ok(Link {
            dst_mem,
            flush_done,
            semaphore,
            gpu_link: None,
            registrations: Vec::new(),
            receiver: Some(receiver),
            dst: Err(dst.clone()),
        })
    }
}
