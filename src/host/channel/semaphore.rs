//! Semaphores: monotonic 64-bit tokens in each rank's token pool, one VMM buffer that every
//! same-host peer maps (and the NIC reaches for peers on other nodes). A signal adds to the
//! peer's inbound token; a wait compares this rank's own inbound token with a private expected
//! counter.

use crate::device_api::SemaphoreHandle;
use crate::error::{Error, Result};
use crate::gpu::memory::Buffer;
use crate::transport::ipc::RemoteMemory;
use std::sync::{Arc, Mutex};

/// Tokens in one token pool. Each set of channels takes `world_size` of them.
pub(crate) const TOKEN_SLOTS: usize = 64 * 1024;
/// Slots 0 and 1 of the private half hold the wait diagnostics' claim word and abort gate
/// (`core/wait.cuh`).
pub(crate) const FIRST_TOKEN_SLOT: usize = 2;

/// Semaphore tokens of one rank, in one VMM buffer that every same-host peer maps:
/// `[inbound tokens: TOKEN_SLOTS x u64][private expected counters: TOKEN_SLOTS x u64]`.
/// Peers add to inbound tokens; the private half is touched by this rank only. Nothing is ever
/// reset (tokens are monotonic), so slots are handed out once, bump-style.
pub(crate) struct TokenPool {
    pub(crate) local: Buffer,
    pub(crate) peers: Vec<Option<RemoteMemory>>,
    pub(crate) next: Mutex<usize>,
}

impl TokenPool {
    pub(crate) fn inbound(&self, slot: usize) -> u64 {
        self.local.device_ptr() + (slot * 8) as u64
    }
    pub(crate) fn private(&self, slot: usize) -> u64 {
        self.local.device_ptr() + ((TOKEN_SLOTS + slot) * 8) as u64
    }
    pub(crate) fn remote_inbound(&self, peer: usize, slot: usize) -> Option<u64> {
        self.peers[peer]
            .as_ref()
            .map(|m| m.device_ptr() + (slot * 8) as u64)
    }
    pub(crate) fn take(&self, n: usize) -> Result<usize> {
        let mut next = self.next.lock().unwrap_or_else(|p| p.into_inner());
        if *next + n > TOKEN_SLOTS {
            return Err(Error::invalid(
                "channels",
                format!("token pool exhausted ({TOKEN_SLOTS} semaphores per communicator)"),
            ));
        }
        let base = *next;
        *next += n;
        Ok(base)
    }
}

/// Semaphores to every peer, in `sets` independent sets (collective kernels give each block its
/// own set). `handle(set, peer)`; the entry for this rank has no semaphore (its tokens are zero:
/// never signal or wait on it), only a wait site for waits on this GPU's own counts.
pub struct Semaphores {
    pub(crate) handles: Vec<SemaphoreHandle>,
    pub(crate) world: usize,
    pub(crate) _tokens: Arc<TokenPool>,
}

impl Semaphores {
    /// The handles, `[set * world + peer]`, ready to upload as one device array.
    pub fn handles(&self) -> &[SemaphoreHandle] {
        &self.handles
    }
    /// The handle of `set` to `peer`.
    pub fn handle(&self, set: usize, peer: usize) -> Option<SemaphoreHandle> {
        self.handles.get(set * self.world + peer).copied()
    }
    /// Number of sets.
    pub fn sets(&self) -> usize {
        self.handles.len() / self.world.max(1)
    }
}
