//! The communicator: one per rank. It ties the bootstrap to this rank's GPU and owns what the
//! rank shares with its peers: the fd server that hands out exported memory, the token pool that
//! semaphores live in, and the wait diagnostics every device wait reports to.
//!
//! Calls that build channels are collective: every rank of the job calls them in the same order
//! with matching arguments. The communicator checks what it can (token-pool positions travel
//! with each exchange) and fails with a message naming the odd rank instead of wiring
//! mismatched channels.

mod fabric;
mod renamed;
pub mod watchdog;

use fabric::IbFabric;

use crate::channel::memory_channel::{MemoryChannels, RegisteredMemory};
use crate::channel::port_channel::PortChannels;
use crate::channel::proxy::{ProxyBuilder, DEFAULT_FIFO_SIZE};
use crate::channel::semaphore::{Semaphores, TokenPool, FIRST_TOKEN_SLOT, TOKEN_SLOTS};
use crate::channel::symmetric::SymmetricBuffer;
use crate::channel::wiring::{IbWiring, MappedPeers, PeerMemory, Wiring};
use crate::device_api::SemaphoreHandle;
use crate::error::{Error, Result};
use crate::gpu::cuda::{device_count, Gpu};
use crate::gpu::fd_passing::{fetch_fd, FdServer};
use crate::gpu::memory::{host_id, Buffer};
use crate::gpu::wait::WaitDiagnostics;
use crate::job::bootstrap::{Bootstrap, BootstrapConfig};
use crate::job::config::Settings;
use crate::job::topology::Topology;
use crate::transport::ipc::{ipc_handle_for, MemoryDescriptor, RemoteMemory, ShareHandle};
use cudarc::driver::CudaStream;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// One rank's view of the job: bootstrap, GPU, and the shared state channels are built from.
///
/// # Faults
/// Each communicator runs a watchdog thread ([`crate::communicator::watchdog`]): when a peer dies, falls
/// silent, or relays a failure, or when [`abort`](Self::abort) is called, every device wait of
/// this communicator leaves (no trap: the CUDA context stays usable), and every later call
/// returns [`Error::PeerFailed`] naming the rank and the cause (or the device's own report:
/// [`Error::Timeout`], [`Error::ArgumentMismatch`]). An aborted communicator stays aborted: drop
/// it, and build a new one among the survivors with [`shrink`](Self::shrink).
pub struct Communicator {
    // Dropped first: the watchdog reads the bootstrap and the diagnostics.
    _watchdog: Option<crate::communicator::watchdog::Watchdog>,
    bootstrap: Arc<Bootstrap>,
    device: usize,
    gpu: Arc<Gpu>,
    fd_server: Arc<FdServer>,
    /// The job's shape (every rank's node).
    topology: Topology,
    // Before the token pool: its registration with the NIC goes first.
    ib: Option<IbFabric>,
    tokens: Arc<TokenPool>,
    diagnostics: Arc<WaitDiagnostics>,
    next_export: AtomicU64,
    next_channel: AtomicU32,
    /// The library's settings, parsed once when the communicator was made (collectives and
    /// channels built on it read them here, not from the environment again).
    settings: Settings,
}

impl Communicator {
    /// Joins the job described by the launcher's environment and opens GPU
    /// `LOCAL_RANK % visible GPUs` (several ranks may share a GPU for functional runs).
    pub fn from_env() -> Result<Self> {
        let bootstrap = Bootstrap::connect(BootstrapConfig::from_env()?)?;
        let device = bootstrap.local_rank() % device_count()?;
        Self::new(bootstrap, device)
    }

    /// Builds the communicator over `bootstrap` on GPU `device`. Collective.
    pub fn new(bootstrap: Bootstrap, device: usize) -> Result<Self> {
        let settings = Settings::from_env()?;
        let gpu = Gpu::open(device)?;
        let rank = bootstrap.rank();
        let world = bootstrap.world_size();
        let fd_server = Arc::new(FdServer::start(bootstrap.secret(), rank)?);

        let physical_hosts: Vec<u64> = bootstrap
            .all_gather(&host_id().to_le_bytes())?
            .iter()
            .map(|b| b.as_slice().try_into().map(u64::from_le_bytes).unwrap_or(0))
            .collect();
        // With DOORBELL_SEPARATE_NODES every emulated node (DOORBELL_NODE_SIZE consecutive
        // ranks, default 1) reports a host of its own.
        let my_host = if settings.separate_nodes {
            let node = (rank / settings.node_size) as u64;
            host_id() ^ (node + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15)
        } else {
            host_id()
        };
        let node_ids: Vec<u64> = bootstrap
            .all_gather(&my_host.to_le_bytes())?
            .iter()
            .enumerate()
            .map(|(r, b)| {
                b.as_slice()
                    .try_into()
                    .map(u64::from_le_bytes)
                    .map_err(|_| Error::Bootstrap {
                        me: rank,
                        rank: Some(r),
                        why: "sent a malformed host id".into(),
                    })
            })
            .collect::<Result<_>>()?;
        let topology = Topology::new(rank, node_ids);

        // The token pool, mapped by every peer on this host.
        let pool = Buffer::alloc(&gpu, 2 * TOKEN_SLOTS * 8)?;
        let export_id = 0;
        fd_server.publish(export_id, pool.export_fd()?)?;
        let desc = MemoryDescriptor {
            owner_rank: rank as u32,
            host_id: topology.node_ids()[rank],
            bytes: pool.len() as u64,
            handle: ShareHandle::PosixFd {
                export_id,
                alloc_bytes: pool.len() as u64,
                granularity: crate::gpu::memory::granularity(&gpu)? as u64,
            },
        };
        let mut comm_peers = Vec::with_capacity(world);
        // Emulated RDMA between ranks of one physical host that act as separate nodes: their
        // pools are mapped too, for this rank's emulated NIC to reach.
        let emulate = settings.ib_emulate;
        let mut ib_mapped: Vec<(usize, RemoteMemory)> = Vec::new();
        let descs = bootstrap.all_gather(&desc.to_bytes())?;
        for (r, bytes) in descs.iter().enumerate() {
            let same_node = r != rank && topology.same_node(r);
            let same_machine = r != rank && physical_hosts[r] == physical_hosts[rank];
            if !(same_node || (emulate && same_machine)) {
                comm_peers.push(None);
                continue;
            }
            let d = MemoryDescriptor::from_peer(bytes, rank, r)?;
            let fd = fetch_fd(bootstrap.secret(), rank, r, export_id, bootstrap.timeout())?;
            let mapped = RemoteMemory::import(&gpu, &d, Some(fd))?;
            if same_node {
                comm_peers.push(Some(mapped));
            } else {
                comm_peers.push(None);
                ib_mapped.push((r, mapped));
            }
        }
        // Everyone has mapped everyone's pool before anyone withdraws it.
        bootstrap.barrier()?;
        fd_server.withdraw(export_id);

        let ib = IbFabric::for_job(&settings, &bootstrap, &gpu, &pool, &topology, ib_mapped)?;
        let claim = pool.device_ptr() + (TOKEN_SLOTS * 8) as u64;
        let diagnostics = Arc::new(WaitDiagnostics::new(
            &gpu,
            claim,
            settings.wait_timeout,
            rank,
        )?);
        let local = crate::communicator::watchdog::visible_peers(&bootstrap)?;
        let bootstrap = Arc::new(bootstrap);
        let watchdog = crate::communicator::watchdog::Watchdog::start(
            Arc::clone(&bootstrap),
            Arc::clone(&diagnostics),
            local,
        )?;
        let tokens = Arc::new(TokenPool {
            local: pool,
            peers: comm_peers,
            next: Mutex::new(FIRST_TOKEN_SLOT),
        });
        Ok(Communicator {
            _watchdog: Some(watchdog),
            bootstrap,
            device,
            gpu,
            fd_server,
            topology,
            tokens,
            diagnostics,
            next_export: AtomicU64::new(1),
            next_channel: AtomicU32::new(0),
            ib,
            settings,
        })
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.bootstrap.rank()
    }

    /// Ranks in the job.
    pub fn world_size(&self) -> usize {
        self.bootstrap.world_size()
    }

    /// The bootstrap, for the caller's own out-of-band exchanges.
    pub fn bootstrap(&self) -> &Bootstrap {
        &self.bootstrap
    }

    /// The library's settings (`DOORBELL_*`), as parsed when the communicator was made.
    pub fn settings(&self) -> &Settings {
        &self.settings
    }

    /// This rank's GPU.
    pub fn gpu(&self) -> &Arc<Gpu> {
        &self.gpu
    }

    /// The wait diagnostics of this communicator.
    pub fn diagnostics(&self) -> &WaitDiagnostics {
        &self.diagnostics
    }

    /// Aborts the job from this rank, like `ncclCommAbort`: every device wait of this
    /// communicator leaves at once (kernels run on to their ends without waiting; results are
    /// garbage), every later call here returns [`Error::PeerFailed`] naming this rank, and every
    /// other rank is told, so their waits leave too and their calls name this rank. Any thread
    /// may call it, also while another thread waits in a doorbell call. Then drop the
    /// communicator (or [`shrink`](Self::shrink) it).
    pub fn abort(&self) {
        let me = self.rank();
        let why = "aborted by the user (Communicator::abort)";
        self.diagnostics.abort(crate::gpu::wait::Fault {
            rank: me,
            cause: why.into(),
        });
        self.bootstrap.abort(Some(me), why);
    }

    /// `Err` if this communicator aborted or a device wait of it failed: the error that names
    /// the rank and the cause. Every collective checks it before launching; costs a read of host
    /// memory.
    pub fn check_health(&self) -> Result<()> {
        if !self.diagnostics.aborted() {
            // A peer that died while peer loss is tolerated fails every call but the ones that
            // can leave it out (`check_health_tolerant`).
            if self.diagnostics.dead_peers() == 0 {
                return Ok(());
            }
            return match self.diagnostics.first_dead() {
                None => Ok(()),
                Some(f) => Err(self.named(Error::PeerFailed {
                    me: self.rank(),
                    rank: f.rank,
                    cause: f.cause,
                })),
            };
        }
        Err(
            self.named(self.diagnostics.error().unwrap_or(Error::PeerFailed {
                me: self.rank(),
                rank: self.rank(),
                cause: "the communicator aborted".into(),
            })),
        )
    }

    /// [`check_health`](Self::check_health) for calls that can leave dead peers out (MoE low
    /// latency with a rank mask): `Err` only if the communicator aborted; else the peers marked
    /// dead, one bit each.
    pub(crate) fn check_health_tolerant(&self) -> Result<u64> {
        if self.diagnostics.aborted() {
            self.check_health()?;
        }
        Ok(self.diagnostics.dead_peers())
    }

    /// `e`, with a device wait that ran out on a peer that had left cleanly named as that.
    fn named(&self, e: Error) -> Error {
        left_cleanly(e, self.rank(), |p| self.bootstrap.said_goodbye(p))
    }

    /// Builds a new communicator of the ranks not in `failed`, renumbered in order (collective
    /// among the survivors; the failed ranks take no part), on the same GPU, like NCCL's
    /// `ncclCommShrink`. Call it after a fault (this communicator may be aborted), then drop this
    /// one; channels and collectives are built anew on the result.
    pub fn shrink(&self, failed: &[usize]) -> Result<Communicator> {
        let me = self.rank();
        let survivors: Vec<usize> = (0..self.world_size())
            .filter(|r| !failed.contains(r))
            .collect();
        let local: Vec<usize> = survivors
            .iter()
            .copied()
            .filter(|&r| self.same_host(r))
            .collect();
        let local_rank = local.iter().position(|&r| r == me).unwrap_or(0);
        let bootstrap = self.bootstrap.shrink(failed, (local_rank, local.len()))?;
        Communicator::new(bootstrap, self.device)
    }

    /// With `DOORBELL_IB_EMULATE=1`: what this rank's emulated NIC has executed as requester so
    /// far (every queue pair: the proxy's and the kernels'), for tests that count what crossed
    /// the network. `None` with a real NIC or none.
    pub fn emulated_nic_traffic(&self) -> Option<crate::transport::ib::emulated::nic::Traffic> {
        self.ib
            .as_ref()
            .and_then(|ib| ib.emulated.as_ref())
            .map(|nic| nic.traffic())
    }

    /// The job's shape: every rank's node, this rank's team and rail peers.
    pub fn topology(&self) -> &Topology {
        &self.topology
    }

    /// The node (host, or emulated node with `DOORBELL_SEPARATE_NODES`) of every rank, as
    /// opaque ids: ranks with equal ids share a node ([`Topology::node_ids`]).
    pub fn node_ids(&self) -> &[u64] {
        self.topology.node_ids()
    }

    /// True if some rank runs on another node than this one (its host id differs; with
    /// `DOORBELL_SEPARATE_NODES`, an emulated node): the collectives then take their
    /// node-spanning paths ([`Topology::spans_nodes`]).
    pub fn spans_nodes(&self) -> bool {
        self.topology.spans_nodes()
    }

    /// True if `peer` runs on this host (so CUDA IPC can reach its memory;
    /// [`Topology::same_node`]).
    pub fn same_host(&self, peer: usize) -> bool {
        self.topology.same_node(peer)
    }

    /// Allocates `bytes` of shareable GPU memory (VMM, zero-filled).
    pub fn alloc(&self, bytes: usize) -> Result<Arc<Buffer>> {
        Ok(Arc::new(Buffer::alloc(&self.gpu, bytes)?))
    }

    /// Registers a doorbell buffer so peers can map it.
    pub fn register(&self, buffer: &Arc<Buffer>) -> Result<Arc<RegisteredMemory>> {
        let export_id = self.next_export.fetch_add(1, Ordering::Relaxed);
        self.fd_server.publish(export_id, buffer.export_fd()?)?;
        let granularity = crate::gpu::memory::granularity(&self.gpu)? as u64;
        Ok(Arc::new(RegisteredMemory {
            descriptor: MemoryDescriptor {
                owner_rank: self.rank() as u32,
                host_id: self.topology.node_ids()[self.rank()],
                bytes: buffer.len() as u64,
                handle: ShareHandle::PosixFd {
                    export_id,
                    alloc_bytes: buffer.len() as u64,
                    granularity,
                },
            },
            ptr: buffer.device_ptr(),
            bytes: buffer.len(),
            _buffer: Some(buffer.clone()),
            server: self.fd_server.clone(),
        }))
    }

    /// Allocates `bytes` on every rank and maps every same-host peer's copy here (collective):
    /// a [`SymmetricBuffer`].
    pub fn alloc_symmetric(&self, bytes: usize) -> Result<SymmetricBuffer> {
        self.share(&self.alloc(bytes)?)
    }

    /// Registers `buffer` and maps every same-host peer's counterpart here (collective: each rank
    /// passes its own, filled as it must be before any peer may touch it: every peer has mapped
    /// before any rank returns).
    pub fn share(&self, buffer: &Arc<Buffer>) -> Result<SymmetricBuffer> {
        let registered = self.register(buffer)?;
        let peers = self.exchange(&registered)?;
        Ok(SymmetricBuffer::new(
            buffer.clone(),
            registered,
            peers,
            self.rank(),
        ))
    }

    /// Registers memory the caller allocated with cudarc or `cudaMalloc` (shared with a legacy
    /// CUDA IPC handle).
    ///
    /// # Safety
    /// `[ptr, ptr + bytes)` must be device memory of this rank's GPU that stays allocated for as
    /// long as the registration, and every channel or mapping built from it, is in use.
    pub unsafe fn register_external(
        &self,
        ptr: u64,
        bytes: usize,
    ) -> Result<Arc<RegisteredMemory>> {
        if bytes == 0 {
            return Err(Error::invalid("bytes", "cannot register an empty range"));
        }
        let (handle, offset) = ipc_handle_for(&self.gpu, ptr, bytes)?;
        Ok(Arc::new(RegisteredMemory {
            descriptor: MemoryDescriptor {
                owner_rank: self.rank() as u32,
                host_id: self.topology.node_ids()[self.rank()],
                bytes: bytes as u64,
                handle: ShareHandle::CudaIpc { handle, offset },
            },
            ptr,
            bytes,
            _buffer: None,
            server: self.fd_server.clone(),
        }))
    }

    /// Maps every same-host peer's counterpart of `mem` (collective: each rank passes its own).
    /// Index = rank; `None` for this rank and for ranks on other hosts.
    pub fn exchange(&self, mem: &RegisteredMemory) -> Result<Vec<Option<Arc<RemoteMemory>>>> {
        PeerMemory::exchange(self, mem)
    }

    /// Takes `world_size` token slots on every rank and checks that every rank took the same
    /// ones (ranks that build channels in different orders are caught here).
    fn take_tokens(&self, sets: usize) -> Result<usize> {
        let rank = self.rank();
        let n = sets
            .checked_mul(self.world_size())
            .ok_or_else(|| Error::invalid("sets", format!("{sets} sets overflow")))?;
        let base = self.tokens.take(n)?;
        let mine = ((base as u64) << 32 | sets as u64).to_le_bytes();
        let all = self.bootstrap.all_gather(&mine)?;
        for (r, b) in all.iter().enumerate() {
            if b.as_slice() != mine {
                return Err(Error::invalid(
                    "channels",
                    format!(
                        "rank {r} is at a different point in its channel setup than rank {rank}: \
                         every rank must build the same channels and semaphores in the same order"
                    ),
                ));
            }
        }
        Ok(base)
    }

    /// Builds `sets` semaphores to every same-host peer (collective).
    pub fn semaphores(&self, sets: usize) -> Result<Semaphores> {
        let world = self.world_size();
        let base = self.take_tokens(sets)?;
        let w = self.wiring(base);
        let mut handles = vec![SemaphoreHandle::default(); sets * world];
        for set in 0..sets {
            for peer in 0..world {
                handles[set * world + peer] = if peer == self.rank() {
                    // No semaphore to myself, but a wait site: kernels wait on their own GPU's
                    // counts through it (with one rank there is no other), and a site without
                    // a budget would give up after its first polls and let them run on.
                    SemaphoreHandle {
                        site: self.diagnostics.site(peer as i32, w.channel),
                        ..SemaphoreHandle::default()
                    }
                } else {
                    w.semaphore(base + set * world, peer)?
                };
            }
        }
        Ok(Semaphores {
            handles,
            world,
            _tokens: self.tokens.clone(),
        })
    }

    /// Builds one MemoryChannel to every other rank (collective). For the channel to peer `p`:
    /// puts read my `src` and land in `p`'s `dst`; gets do the reverse; put_packets land in `p`'s
    /// `packets` and my `packets` receives theirs. Every rank must be on this host.
    pub fn memory_channels(
        &self,
        src: &Arc<RegisteredMemory>,
        dst: &Arc<RegisteredMemory>,
        packets: Option<&Arc<RegisteredMemory>>,
    ) -> Result<MemoryChannels> {
        crate::channel::memory_channel::refuse_other_hosts(&self.topology)?;
        let base = self.take_tokens(1)?;
        let w = self.wiring(base);
        crate::channel::memory_channel::connect(&w, src, dst, packets)
    }

    /// The state a channel set from token slot `base` is wired from (numbers the set).
    fn wiring(&self, base: usize) -> Wiring<'_> {
        Wiring {
            bootstrap: &self.bootstrap,
            gpu: &self.gpu,
            tokens: &self.tokens,
            diagnostics: &self.diagnostics,
            topology: &self.topology,
            base,
            channel: self.next_channel.fetch_add(1, Ordering::Relaxed),
            ib: self.ib.as_ref().map(|ib| IbWiring {
                dev: &ib.dev,
                posting: ib.posting,
                peer_pools: &ib.peer_pools,
                qps_per_peer: self.settings.ib_qps_per_peer.max(1) as usize,
            }),
            peers: self,
        }
    }

    /// A proxy for this rank's GPU with a FIFO of `fifo_size` triggers (0: the default), to add
    /// PortChannels to and then start.
    pub fn proxy_builder(&self, fifo_size: usize) -> Result<ProxyBuilder> {
        let size = if fifo_size == 0 {
            DEFAULT_FIFO_SIZE
        } else {
            fifo_size
        };
        Ok(
            ProxyBuilder::new(&self.gpu, size, self.diagnostics.site(-1, u32::MAX))?
                .placement(self.settings.proxy_cpu),
        )
    }

    /// Builds one PortChannel to every other rank on `proxy` (collective; start the proxy after).
    /// For the channel to peer `p`: puts copy from my `src` into `p`'s `dst`, and signals land in
    /// `p`'s inbound token after the data. Each peer gets the first transport of
    /// [`crate::channel::port_channel::ROUTES`] that reaches it: same-host peers copy engines
    /// into `p`'s memory mapped by CUDA IPC; peers on other nodes (every peer, with
    /// `DOORBELL_SEPARATE_NODES=1`) RDMA work requests on this rank's NIC where it reaches them
    /// (`DOORBELL_IB_EMULATE=1`: the emulated NIC, [`crate::channel::port_channel::Transport::Ib`]), else the proxies over TCP
    /// ([`crate::transport::ethernet`]).
    pub fn port_channels(
        &self,
        proxy: &mut ProxyBuilder,
        src: &Arc<RegisteredMemory>,
        dst: &Arc<RegisteredMemory>,
    ) -> Result<PortChannels> {
        let base = self.take_tokens(1)?;
        let wiring = self.wiring(base);
        crate::channel::port_channel::connect(&wiring, proxy, src, dst)
    }

    /// Waits for `stream`; a device wait that gave up becomes [`Error::Timeout`], a fault of the
    /// job [`Error::PeerFailed`], a call check that failed [`Error::ArgumentMismatch`].
    ///
    /// Bounded: doorbell's own device waits give up within the wait budget
    /// (`DOORBELL_WAIT_TIMEOUT_MS`), and after an abort every later one at once, so a stream
    /// whose work is still running [`SYNC_BUDGET_FACTOR`] budgets on (a kernel of someone
    /// else's that never ends, a host function that blocks) returns [`Error::Timeout`] naming
    /// this rank and the stream instead of hanging; a failure the job already knows is returned
    /// in its place.
    pub fn synchronize(&self, stream: &CudaStream) -> Result<()> {
        let limit = self.diagnostics.budget().saturating_mul(SYNC_BUDGET_FACTOR);
        match self.gpu.wait_stream(stream, limit) {
            Ok(true) => self.diagnostics.healthy().map_err(|e| self.named(e)),
            Ok(false) => Err(
                self.named(self.diagnostics.error().unwrap_or(Error::Timeout {
                    rank: self.rank() as i32,
                    peer: -1,
                    what: crate::error::WaitKind::Stream,
                    channel: u32::MAX,
                    expected: u64::MAX,
                    seen: u64::MAX,
                    waited_ms: limit.as_millis().min(u128::from(u64::MAX)) as u64,
                    block: u32::MAX,
                    thread: u32::MAX,
                })),
            ),
            Err(e) => Err(self.named(self.diagnostics.explain(e))),
        }
    }

    /// A cudarc result as this communicator's: a failure becomes [`Error::Cuda`] naming `call`,
    /// or the device timeout or peer fault that caused it where there was one, and names this rank.
    pub fn cuda_result<T>(
        &self,
        r: std::result::Result<T, cudarc::driver::DriverError>,
        call: &'static str,
    ) -> Result<T> {
        r.map_err(|e| {
            self.named(self.diagnostics.explain(Error::Cuda {
                call,
                code: e.to_string(),
            }))
        })
    }
}

/// Channels map same-host peers' memory through the communicator's fd server and bootstrap.
impl PeerMemory for Communicator {
    fn exchange(&self, mem: &RegisteredMemory) -> Result<MappedPeers> {
        let all = self.bootstrap.all_gather(&mem.descriptor.to_bytes())?;
        let mut out = Vec::with_capacity(all.len());
        for (r, bytes) in all.iter().enumerate() {
            if r == self.rank() || !self.same_host(r) {
                out.push(None);
                continue;
            }
            out.push(Some(Arc::new(PeerMemory::import(self, r, bytes)?)));
        }
        // Every peer has fetched and mapped before any rank returns: a rank that drops its
        // registration right after this call must not withdraw an fd a slower peer still needs.
        self.bootstrap.barrier()?;
        Ok(out)
    }

    fn import(&self, peer: usize, bytes: &[u8]) -> Result<RemoteMemory> {
        let d = MemoryDescriptor::from_peer(bytes, self.rank(), peer)?;
        let fd = match d.handle {
            ShareHandle::PosixFd { export_id, .. } => Some(fetch_fd(
                self.bootstrap.secret(),
                self.rank(),
                peer,
                export_id,
                self.bootstrap.timeout(),
            )?),
            ShareHandle::CudaIpc { .. } => None,
        };
        RemoteMemory::import(&self.gpu, &d, fd)
    }
}

/// [`Communicator::synchronize`] gives a stream this many device-wait budgets to finish.
pub const SYNC_BUDGET_FACTOR: u32 = 2;

/// A device wait that ran out on a peer that had already left the communicator cleanly (it
/// dropped it or exited, saying goodbye) is that peer's departure, not a slow peer: the error
/// names it as such (a rank that made fewer calls than the others ends so).
fn left_cleanly(e: Error, me: usize, said_goodbye: impl Fn(usize) -> bool) -> Error {
    match &e {
        Error::Timeout { peer, .. } if *peer >= 0 && said_goodbye(*peer as usize) => {
            Error::PeerFailed {
                me,
                rank: *peer as usize,
                cause: format!(
                    "it left the communicator cleanly (dropped it or exited) while rank {me} \
                     still waited for it: did it make fewer calls? ({e})"
                ),
            }
        }
        _ => e,
    }
}

impl Drop for Communicator {
    fn drop(&mut self) {
        // A rank that unwinds from a panic tells the others now, instead of leaving them to
        // their wait budgets.
        if std::thread::panicking() {
            let me = self.rank();
            self.bootstrap
                .abort(Some(me), &format!("rank {me} panicked"));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::WaitKind;

    #[test]
    fn a_wait_on_a_peer_that_left_cleanly_names_the_departure() {
        let timeout = |peer| Error::Timeout {
            rank: 0,
            peer,
            what: WaitKind::Semaphore,
            channel: 2,
            expected: 5,
            seen: 4,
            waited_ms: 30_000,
            block: 0,
            thread: 0,
        };
        match left_cleanly(timeout(1), 0, |p| p == 1) {
            Error::PeerFailed { me, rank, cause } => {
                assert_eq!((me, rank), (0, 1));
                assert!(cause.contains("left the communicator cleanly"), "{cause}");
                assert!(
                    cause.contains("from peer 1 on channel 2: expected 5, saw 4"),
                    "{cause}"
                );
            }
            other => panic!("{other}"),
        }
        // A peer still there, a wait on no single peer, and other errors are kept as they are.
        assert!(matches!(
            left_cleanly(timeout(1), 0, |_| false),
            Error::Timeout { .. }
        ));
        assert!(matches!(
            left_cleanly(timeout(-1), 0, |_| true),
            Error::Timeout { .. }
        ));
        let e = Error::invalid("x", "y");
        assert_eq!(
            left_cleanly(e, 0, |_| true).to_string(),
            Error::invalid("x", "y").to_string()
        );
    }
}
