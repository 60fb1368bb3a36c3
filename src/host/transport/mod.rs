//! How bytes reach a peer, one module per transport: CUDA IPC between processes of one host
//! ([`ipc`]: the peer's VMM allocation or `cudaMalloc` memory mapped here), Ethernet between
//! proxies over TCP ([`ethernet`]), and InfiniBand/RoCE ([`ib`]: verbs loaded at run time, queue
//! pairs, mlx5 WQE and CQE encoding, the emulated NIC, the choice of NIC and posting mode).
//! Channels sit above and pick one per peer; nothing here knows about channels.
//!
//! Each transport offers the proxy one [`Connection`] type: the proxy decodes a trigger, checks
//! its ranges against its memory table and hands the connection resolved addresses; how the
//! bytes, the signal and the flush travel is the connection's business alone.

pub mod ethernet;
pub mod ib;
pub mod ipc;

use crate::error::{Error, Result};
use crate::gpu::cuda::HostArray;
use std::sync::{Arc, Mutex};

/// An address a connection reads or writes, resolved by the proxy from a registered memory and
/// an offset it checked: a device address of this process (CUDA IPC; an InfiniBand source), the
/// peer's own address (an InfiniBand destination), or an offset into the peer's buffer (Ethernet,
/// whose receiver checks it again). `key` is the memory's key with the RDMA NIC, where it has one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Address {
    /// The address (or offset) itself.
    pub addr: u64,
    /// The memory's key with the RDMA NIC (lkey for a source, rkey for a destination).
    pub key: Option<u32>,
}

/// The peer's inbound token a signal increments, and the count it reaches with this signal
/// (a connection that writes the count instead of adding one uses it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Token {
    /// Where the token is: mapped into this process (CUDA IPC) or at the peer's own address.
    pub at: Address,
    /// This semaphore's signals so far, this one included.
    pub count: u64,
}

/// One proxy's link to one peer over one transport. The proxy calls it in FIFO order from its
/// one thread: writes, signals that land after the writes before them, flushes. No call may block on the peer (a slow link
/// must not hold triggers of other channels); what cannot be done now waits in the connection
/// and moves on in [`Connection::progress`].
pub trait Connection: Send {
    /// Queues a copy of `bytes` from `src` (this process) to `dst` (the peer).
    fn write(&mut self, src: Address, dst: Address, bytes: u64) -> Result<()>;
    /// Queues a signal: `token` grows by one once the writes queued before it have landed.
    fn signal(&mut self, token: Token) -> Result<()>;
    /// Queues a flush: the flush word becomes `pos + 1` once everything queued before it is done
    /// with this rank's memory (the sources of the writes before it may be reused).
    fn flush(&mut self, pos: u64) -> Result<()>;
    /// Moves queued work on (completions, deferred signals, finished flushes). True if anything
    /// moved.
    fn progress(&mut self) -> Result<bool>;
    /// The device address of the flush word kernels wait on.
    fn flush_word(&self) -> u64;
}

/// How a transport's own threads (Ethernet's sender and receiver) report a failure: the proxy's
/// failure slot and its stop word, which every kernel waiting on the proxy watches.
#[derive(Clone)]
pub struct FailureSink {
    pub(crate) failure: Arc<Mutex<Option<Error>>>,
    pub(crate) stopped: Arc<HostArray<u32>>,
}

impl FailureSink {
    /// Records `e` (the first failure wins) and stops the proxy.
    pub fn fail(&self, e: Error) {
        tracing::error!("a transport stopped the proxy: {e}");
        let mut slot = self.failure.lock().unwrap_or_else(|p| p.into_inner());
        if slot.is_none() {
            *slot = Some(e);
        }
        self.stopped.write(0, 1);
    }
}
