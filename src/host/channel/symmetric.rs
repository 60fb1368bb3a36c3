//! Symmetric buffers: a buffer every rank allocated alike, registered with its communicator, and
//! every same-host peer's copy mapped here; what the collectives' scratch areas, receive areas and
//! registered windows are. Built by `Communicator::share` (collective).

use crate::channel::registered::RegisteredMemory;
use crate::device_api::MAX_RANKS;
use crate::error::{Error, Result};
use crate::gpu::memory::Buffer;
use crate::transport::ipc::RemoteMemory;
use std::sync::Arc;

/// One rank's part of a symmetric buffer and its same-host peers' parts as mapped here. Keeps the
/// buffer, its registration and the mappings alive together.
pub struct SymmetricBuffer {
    // The mappings go first, the registration (its exported fd) next, the memory last.
    peers: Vec<Option<Arc<RemoteMemory>>>,
    registered: Arc<RegisteredMemory>,
    buffer: Arc<Buffer>,
    rank: usize,
}

impl SymmetricBuffer {
    /// Assembles one from its parts: `peers[r]` is rank `r`'s copy mapped here (`None` for
    /// `rank` and for ranks on other hosts).
    pub(crate) fn new(
        buffer: Arc<Buffer>,
        registered: Arc<RegisteredMemory>,
        peers: Vec<Option<Arc<RemoteMemory>>>,
        rank: usize,
    ) -> SymmetricBuffer {
        SymmetricBuffer {
            peers,
            registered,
            buffer,
            rank,
        }
    }

    /// This rank's buffer.
    pub fn buffer(&self) -> &Arc<Buffer> {
        &self.buffer
    }
    /// Its registration (what PortChannels and NIC registrations are built on).
    pub fn registered(&self) -> &Arc<RegisteredMemory> {
        &self.registered
    }
    /// This rank's device address of its own part.
    pub fn device_ptr(&self) -> u64 {
        self.buffer.device_ptr()
    }
    /// Bytes of each rank's part.
    pub fn len(&self) -> usize {
        self.buffer.len()
    }
    /// True for an empty buffer (never produced by the communicator).
    pub fn is_empty(&self) -> bool {
        self.buffer.len() == 0
    }
    /// Rank `r`'s part as mapped here (own at this rank); `None` for ranks on other hosts.
    pub fn peer_ptr(&self, r: usize) -> Option<u64> {
        if r == self.rank {
            return Some(self.device_ptr());
        }
        self.peers.get(r)?.as_ref().map(|m| m.device_ptr())
    }

    /// Every rank's part as mapped here, indexed by rank (own at this rank), for kernels that
    /// reach every peer by loads and stores. Fails naming the first rank on another host: `what`
    /// (e.g. "the allreduce") is single-node.
    pub fn bases(&self, what: &str) -> Result<[u64; MAX_RANKS]> {
        let mut bases = [0u64; MAX_RANKS];
        for (r, b) in bases.iter_mut().enumerate().take(self.peers.len()) {
            *b = self
                .peer_ptr(r)
                .ok_or_else(|| Error::TransportUnavailable {
                    transport: "CudaIpc",
                    why: format!("rank {r} is on another host; {what} is single-node"),
                })?;
        }
        Ok(bases)
    }

    /// [`SymmetricBuffer::bases`] moved `offset` bytes in (a sub-area every rank places alike,
    /// e.g. the call check's inbox behind a receive area); the ranks past the world stay 0.
    pub fn bases_at(&self, offset: usize, what: &str) -> Result<[u64; MAX_RANKS]> {
        if offset > self.len() {
            return Err(Error::invalid(
                "symmetric buffer",
                format!("offset {offset} is past its {} bytes", self.len()),
            ));
        }
        let mut bases = self.bases(what)?;
        for b in bases.iter_mut().take(self.peers.len()) {
            *b += offset as u64;
        }
        Ok(bases)
    }
}
