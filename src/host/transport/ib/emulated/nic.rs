//! An emulated mlx5 NIC: a host thread that owns, for each queue pair, the send queue, doorbell
//! record, doorbell register and completion queue exactly where a ConnectX would read and write
//! them, executes the work requests it finds there (RDMA write, write with immediate, inline
//! write, read, fetch-add, compare-and-swap, NOP) between registered memory regions, and writes
//! real mlx5 CQEs, error CQEs included. Whoever posts (a GPU kernel, the CPU-assisted doorbell
//! thread, a verbs-style proxy) cannot tell it from a NIC by the bytes it exchanges with it.
//!
//! What it checks, as a NIC would: the doorbell's QPN and index, the doorbell record being at or
//! past the doorbell (a fault is recorded otherwise), each WQE's index, QPN, opcode and size; keys
//! and ranges against the registered regions (local: LOCAL_PROTECTION, remote: REMOTE_ACCESS),
//! 8-byte alignment of atomics (REMOTE_INVALID_REQUEST). After an error the QP is in the error
//! state and every later WQE completes with WR_FLUSH. A write with immediate consumes a receive
//! credit at the responder and writes a RESP_WR_IMM CQE on the responder's receive CQ; with no
//! credit the QP stalls (a real RC QP retries on RNR, forever with `rnr_retry = 7`).
//!
//! Ordering: with [`Delivery::Relaxed`] a write into a region registered as relaxed (data, as
//! opposed to signal words) may become visible after later operations of the QP and after its
//! CQE, in any order among such writes, as PCIe relaxed ordering allows; a READ on the QP first
//! delivers every write the QP had pending (the loopback-READ flush NCCL issues), and a QP idle
//! for a millisecond delivers them too. So a missing flush fails a test instead of passing by
//! luck. Atomics and writes into strictly ordered regions take effect at once.
//!
//! 8-byte atomics operate on host-endian values (ConnectX `atomic_req_8B_endianness_mode` 1); the
//! fetched value lands host-endian.
//!
//! What it cannot show: that a real ConnectX accepts these WQEs (PRM limits beyond the checks
//! above), UAR/BlueFlame write-combining, real PCIe ordering, transport retries, performance.

use crate::error::{Error, Result};
use crate::transport::ib::posting::cq::{self, Cqe, CQE_BYTES};
use crate::transport::ib::posting::wqe::{opcode, CQ_UPDATE, DS, INLINE_SEG, WQEBB};
use std::sync::atomic::{fence, AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// How the emulated NIC reads and writes memory, at addresses as this process sees them.
pub trait Dma: Send + Sync {
    /// Reads `out.len()` bytes at `src`.
    fn read(&self, src: u64, out: &mut [u8]) -> Result<()>;
    /// Writes `data` at `dst`.
    fn write(&self, dst: u64, data: &[u8]) -> Result<()>;
    /// Copies `len` bytes from `src` to `dst` (through a host buffer unless overridden).
    fn copy(&self, dst: u64, src: u64, len: u64) -> Result<()> {
        let mut buf = vec![0u8; len as usize];
        self.read(src, &mut buf)?;
        self.write(dst, &buf)
    }
}

/// Host memory: addresses are pointers of this process.
pub struct HostDma(());

impl HostDma {
    /// # Safety
    /// Every region registered with a NIC using this must be valid host memory of this process,
    /// readable and writable for the NIC's lifetime.
    pub unsafe fn new() -> HostDma {
        HostDma(())
    }
}

impl Dma for HostDma {
    fn read(&self, src: u64, out: &mut [u8]) -> Result<()> {
        // SAFETY: `src..src + len` lies in a registered region (checked by the caller), valid
        // host memory by the contract of `HostDma::new`.
        unsafe { std::ptr::copy(src as *const u8, out.as_mut_ptr(), out.len()) };
        Ok(())
    }
    fn write(&self, dst: u64, data: &[u8]) -> Result<()> {
        // SAFETY: as for read.
        unsafe { std::ptr::copy(data.as_ptr(), dst as *mut u8, data.len()) };
        Ok(())
    }
}

/// Moves nothing: reads give zeros and writes are dropped. For measuring how fast WQEs can be
/// posted and completed when the data movement costs nothing (the posting side's rate).
pub struct NullDma;

impl Dma for NullDma {
    fn read(&self, _src: u64, out: &mut [u8]) -> Result<()> {
        out.fill(0);
        Ok(())
    }
    fn write(&self, _dst: u64, _data: &[u8]) -> Result<()> {
        Ok(())
    }
}

/// When writes into relaxed regions become visible.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Delivery {
    /// Every operation takes effect before the next one and before its CQE.
    Strict,
    /// A write into a relaxed region takes effect after up to `max_delay` later operations of
    /// its QP (drawn from `seed`), at the QP's next READ, or once the QP has been idle 1 ms.
    Relaxed {
        /// The most later operations a write may wait for.
        max_delay: u32,
        /// Seed of the delays.
        seed: u64,
    },
}

/// A registered memory region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Region {
    /// Its key (lkey and rkey alike).
    pub key: u32,
    /// First byte, as work requests name it: the owner's own address (for another rank's
    /// region, that rank's pointer, as a real NIC would be given).
    pub addr: u64,
    /// Bytes.
    pub len: u64,
    /// Strictly ordered (signal words) rather than relaxed (data).
    pub strict: bool,
    /// First byte as this process reaches it (equal to `addr` for its own memory; where a peer's
    /// memory is mapped into this process otherwise).
    pub local: u64,
    /// `IBV_ACCESS_*` flags it was registered with ([`access::ALL`] through [`EmulatedNic::register`]).
    pub access: u32,
}

/// `IBV_ACCESS_*` flags (verbs.h), the verbs boundary's (the emulated NIC checks them).
pub use crate::transport::ib::boundary::provider::access;

/// What a connected queue pair's far end decides, consulted before each of its work requests
/// executes: the verbs provider ([`crate::transport::ib::emulated`]) implements it from both ends'
/// QP state.
pub trait Gate: Send + Sync {
    /// `Ok` to go on, or the mlx5 syndrome and the reason the work request fails with. `op` is
    /// the WQE opcode; `rd_in_flight` counts READs and atomics outstanding at the responder,
    /// this one included (0 for other operations).
    fn admit(&self, op: u8, rd_in_flight: u32) -> std::result::Result<(), (u8, String)>;
    /// READs and atomics the requester keeps outstanding (`max_rd_atomic`).
    fn max_rd_atomic(&self) -> u32;
}

impl Region {
    /// Where this process reaches address `addr` of the region.
    fn at(&self, addr: u64) -> u64 {
        self.local + (addr - self.addr)
    }
}

/// The memory of one queue pair the poster and the NIC share (host memory here; a ConnectX
/// reads the same layout from wherever the driver put it).
#[derive(Debug, Clone)]
pub struct QpRings {
    /// Send queue: `sq_wqebbs` blocks of 64 bytes (a power of two).
    pub sq: *mut u8,
    /// WQEBBs in the send queue.
    pub sq_wqebbs: u64,
    /// The send doorbell record: big-endian 16-bit producer counter in a 32-bit word.
    pub dbr: *const u32,
    /// The doorbell register's 8 bytes: big-endian `next_index << 8`, then big-endian `qpn << 8`.
    pub doorbell: *const u64,
    /// Completion queue: `cq_entries` CQEs of 64 bytes (a power of two), `op_own` starting at
    /// [`cq::EMPTY_OP_OWN`].
    pub cq: *mut u8,
    /// CQEs in the completion queue.
    pub cq_entries: u64,
    /// The CQ's consumer index record (big-endian 24-bit), or null for a CQ that may be
    /// overrun (pollers that only look at the newest CQE).
    pub cq_ci: *const u32,
    /// `None`: `sq` and `dbr` are host pointers the NIC's thread reads directly. `Some(dma)`:
    /// they are device addresses (the send queue and its record in GPU memory, where NVSHMEM's
    /// IBGDA places them through DEVX), which the NIC reads through `dma` as a ConnectX reads
    /// GPU memory over PCIe: the record at each doorbell, then the WQEBBs it covers.
    pub ring_dma: Option<RingDma>,
}

/// How the NIC reads rings in device memory ([`QpRings::ring_dma`]).
#[derive(Clone)]
pub struct RingDma(pub Arc<dyn Dma>);

impl std::fmt::Debug for RingDma {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("RingDma")
    }
}

/// Where a QP's writes with immediate complete.
#[derive(Debug, Clone)]
pub struct Responder {
    /// The responder's receive CQ (layout as [`QpRings::cq`]).
    pub recv_cq: *mut u8,
    /// Its CQEs (a power of two).
    pub recv_cq_entries: u64,
    /// Receive WQEs posted and not yet consumed.
    pub credits: Arc<AtomicU64>,
    /// CQEs written to the receive CQ (shared by every QP that completes there).
    pub completions: Arc<AtomicU64>,
}

// SAFETY: the raw pointers name shared memory the poster and the NIC thread both access with
// volatile loads and stores ordered by fences; `EmulatedNic::add_qp` documents the contract.
unsafe impl Send for QpRings {}
// SAFETY: as above.
unsafe impl Send for Responder {}

struct Pending {
    due: u64,
    dst: u64,
    data: Vec<u8>,
}

struct Qp {
    qpn: u32,
    rings: QpRings,
    responder: Option<Responder>,
    gate: Option<Arc<dyn Gate>>,
    /// READs and atomics executed since the QP last went idle (outstanding at the responder).
    rd_in_flight: u32,
    /// WQEBBs consumed (64-bit).
    ci: u64,
    /// CQEs written.
    cq_pi: u64,
    /// Operations executed (for relaxed delivery).
    ops: u64,
    error: bool,
    stalled: bool,
    pending: Vec<Pending>,
    last_work: Instant,
    rng: u64,
    /// WQEs executed, and CQEs written.
    wqes: u64,
    /// A send queue in device memory ([`QpRings::ring_dma`]): the WQEBBs fetched at the last
    /// doorbells, at their ring offsets.
    shadow: Vec<u8>,
}

struct Shared {
    key_prefix: u32,
    next_key: std::sync::atomic::AtomicU32,
    stop: AtomicBool,
    regions: Mutex<Vec<Region>>,
    qps: Mutex<Vec<Qp>>,
    faults: Mutex<Vec<String>>,
    dma: Box<dyn Dma>,
    delivery: Delivery,
    traffic: Mutex<Traffic>,
}

/// What a NIC has executed as requester, over all its queue pairs: the wire traffic a test can
/// count (how many rows crossed the network, say).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Traffic {
    /// RDMA WRITEs (with or without immediate).
    pub writes: u64,
    /// Bytes those WRITEs carried.
    pub write_bytes: u64,
    /// RDMA READs.
    pub reads: u64,
    /// Atomics (fetch-add, compare-and-swap).
    pub atomics: u64,
}

/// The emulated NIC: one thread serving every queue pair added to it.
pub struct EmulatedNic {
    shared: Arc<Shared>,
    thread: Option<std::thread::JoinHandle<()>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl EmulatedNic {
    /// Starts the NIC's thread.
    pub fn start(dma: Box<dyn Dma>, delivery: Delivery) -> Result<EmulatedNic> {
        Self::start_for_rank(dma, delivery, 0)
    }

    /// Starts the NIC of rank `rank`: its keys carry the rank, so they never collide with the
    /// keys of other ranks' NICs registered here through [`EmulatedNic::register_remote`].
    pub fn start_for_rank(
        dma: Box<dyn Dma>,
        delivery: Delivery,
        rank: usize,
    ) -> Result<EmulatedNic> {
        if rank >= 2047 {
            return Err(Error::invalid(
                "emulated NIC",
                format!("rank {rank}: at most 2047 ranks"),
            ));
        }
        let shared = Arc::new(Shared {
            key_prefix: (rank as u32 + 1) << 20,
            next_key: std::sync::atomic::AtomicU32::new(1),
            stop: AtomicBool::new(false),
            regions: Mutex::new(Vec::new()),
            qps: Mutex::new(Vec::new()),
            faults: Mutex::new(Vec::new()),
            dma,
            delivery,
            traffic: Mutex::new(Traffic::default()),
        });
        let s = shared.clone();
        let thread = std::thread::Builder::new()
            .name("doorbell-emulated-nic".into())
            .spawn(move || serve(&s))
            .map_err(|e| Error::invalid("emulated NIC", format!("cannot start its thread: {e}")))?;
        Ok(EmulatedNic {
            shared,
            thread: Some(thread),
        })
    }

    /// Registers `len` bytes at `addr`; returns its key.
    pub fn register(&self, addr: u64, len: u64, strict: bool) -> Result<u32> {
        if len == 0 || addr.checked_add(len).is_none() {
            return Err(Error::invalid(
                "memory region",
                format!("{len} bytes at {addr:#x}"),
            ));
        }
        let mut regions = lock(&self.shared.regions);
        // Keys are never reused while the NIC lives (a peer may still hold an old one).
        let n = self.shared.next_key.fetch_add(1, Ordering::Relaxed);
        if n >= 0xf_ffff {
            return Err(Error::invalid(
                "memory region",
                "at most 2^20 - 1 registrations per emulated NIC",
            ));
        }
        let key = self.shared.key_prefix | n;
        regions.push(Region {
            key,
            addr,
            len,
            strict,
            local: addr,
            access: access::ALL,
        });
        Ok(key)
    }

    /// Registers `len` bytes at `addr` with `access` (`IBV_ACCESS_*`; relaxed ordering makes it
    /// a relaxed region); returns its key.
    pub fn register_with_access(&self, addr: u64, len: u64, access: u32) -> Result<u32> {
        let key = self.register(addr, len, access & access::RELAXED_ORDERING == 0)?;
        let mut regions = lock(&self.shared.regions);
        if let Some(r) = regions.iter_mut().find(|r| r.key == key) {
            r.access = access;
        }
        Ok(key)
    }

    /// Forgets the region of `key` (its memory may go once this returns).
    pub fn deregister(&self, key: u32) -> bool {
        let mut regions = lock(&self.shared.regions);
        let before = regions.len();
        regions.retain(|r| r.key != key);
        regions.len() != before
    }

    /// Makes another rank's region, registered there with `key` at its address `addr`, reachable
    /// by this NIC's work requests, at `local` in this process (its CUDA IPC mapping).
    pub fn register_remote(
        &self,
        key: u32,
        addr: u64,
        len: u64,
        strict: bool,
        local: u64,
    ) -> Result<()> {
        let mut regions = lock(&self.shared.regions);
        if key & 0xfff0_0000 == self.shared.key_prefix {
            return Err(Error::invalid(
                "memory region",
                format!("key {key:#x} is this NIC's own"),
            ));
        }
        if len == 0 || addr.checked_add(len).is_none() || local.checked_add(len).is_none() {
            return Err(Error::invalid(
                "memory region",
                format!("{len} bytes at {addr:#x}"),
            ));
        }
        // The owner may have registered the key anew: the newest description wins.
        regions.retain(|r| r.key != key);
        regions.push(Region {
            key,
            addr,
            len,
            strict,
            local,
            access: access::ALL,
        });
        Ok(())
    }

    /// [`EmulatedNic::register_remote`] for a region its owner registered with `access`.
    pub fn register_remote_with_access(
        &self,
        key: u32,
        addr: u64,
        len: u64,
        local: u64,
        access: u32,
    ) -> Result<()> {
        self.register_remote(
            key,
            addr,
            len,
            access & access::RELAXED_ORDERING == 0,
            local,
        )?;
        let mut regions = lock(&self.shared.regions);
        if let Some(r) = regions.iter_mut().find(|r| r.key == key) {
            r.access = access;
        }
        Ok(())
    }

    /// Serves a queue pair from now on.
    ///
    /// # Safety
    /// Every pointer in `rings` (and `responder`) must stay valid, aligned and shared (readable
    /// and writable by this thread while the poster writes it) until the QP is removed or the
    /// NIC is dropped.
    pub unsafe fn add_qp(
        &self,
        qpn: u32,
        rings: QpRings,
        responder: Option<Responder>,
    ) -> Result<()> {
        // SAFETY: the caller's contract, passed on.
        unsafe { self.add_gated_qp(qpn, rings, responder, None) }
    }

    /// [`EmulatedNic::add_qp`] for a queue pair whose work requests `gate` admits first (a QP
    /// made through the verbs provider: its state and its far end are checked).
    ///
    /// # Safety
    /// As for [`EmulatedNic::add_qp`].
    pub unsafe fn add_gated_qp(
        &self,
        qpn: u32,
        rings: QpRings,
        responder: Option<Responder>,
        gate: Option<Arc<dyn Gate>>,
    ) -> Result<()> {
        let pow2 = |n: u64| n > 0 && n.is_power_of_two();
        if !pow2(rings.sq_wqebbs) || !pow2(rings.cq_entries) || qpn >> 24 != 0 {
            return Err(Error::invalid(
                "queue pair",
                "send queue and CQ sizes powers of two, QPN below 2^24",
            ));
        }
        if let Some(r) = &responder {
            if !pow2(r.recv_cq_entries) {
                return Err(Error::invalid(
                    "responder",
                    "receive CQ size a power of two",
                ));
            }
        }
        lock(&self.shared.qps).push(Qp {
            qpn,
            rings,
            responder,
            gate,
            rd_in_flight: 0,
            ci: 0,
            cq_pi: 0,
            ops: 0,
            error: false,
            stalled: false,
            pending: Vec::new(),
            last_work: Instant::now(),
            rng: match self.shared.delivery {
                Delivery::Relaxed { seed, .. } => seed,
                Delivery::Strict => 0,
            } ^ (0x9e37_79b9_7f4a_7c15 ^ u64::from(qpn)).wrapping_mul(0xbf58_476d_1ce4_e5b9)
                | 1,
            wqes: 0,
            shadow: Vec::new(),
        });
        Ok(())
    }

    /// Stops serving QP `qpn` (its memory may be freed once this returns). Returns whether it
    /// was served.
    pub fn remove_qp(&self, qpn: u32) -> bool {
        let mut qps = lock(&self.shared.qps);
        let before = qps.len();
        qps.retain(|q| q.qpn != qpn);
        qps.len() != before
    }

    /// Protocol faults seen so far (a doorbell ahead of its record, a malformed doorbell, a CQ
    /// overrun), each naming the QP.
    pub fn faults(&self) -> Vec<String> {
        lock(&self.shared.faults).clone()
    }

    /// The traffic executed so far on every queue pair (counted before each completion is
    /// written, so a poster that saw its completions sees them counted).
    pub fn traffic(&self) -> Traffic {
        *lock(&self.shared.traffic)
    }

    /// WQEs executed on QP `qpn`.
    pub fn executed(&self, qpn: u32) -> u64 {
        lock(&self.shared.qps)
            .iter()
            .find(|q| q.qpn == qpn)
            .map_or(0, |q| q.wqes)
    }

    /// Whether QP `qpn` waits for a receive credit (RNR).
    pub fn stalled(&self, qpn: u32) -> bool {
        lock(&self.shared.qps)
            .iter()
            .any(|q| q.qpn == qpn && q.stalled)
    }
}

impl Drop for EmulatedNic {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn serve(s: &Shared) {
    let mut idle = 0u32;
    while !s.stop.load(Ordering::Relaxed) {
        let mut worked = false;
        {
            // Held for the pass (regions, then QPs: nothing takes them in the other order), so
            // an idle spin does not copy the table; a registration waits for the pass to end.
            let regions = lock(&s.regions);
            let mut qps = lock(&s.qps);
            for qp in qps.iter_mut() {
                worked |= step(s, &regions, qp);
            }
        }
        if worked {
            idle = 0;
        } else {
            idle = idle.saturating_add(1);
            if idle > 1000 {
                std::thread::sleep(Duration::from_micros(20));
            } else {
                std::hint::spin_loop();
            }
        }
    }
}

fn be32_at(b: &[u8], o: usize) -> u32 {
    u32::from_be_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]])
}

fn be64_at(b: &[u8], o: usize) -> u64 {
    u64::from_be_bytes(b[o..o + 8].try_into().expect("8 bytes"))
}

/// Serves what QP `qp` has rung for; returns whether anything happened.
fn step(s: &Shared, regions: &[Region], qp: &mut Qp) -> bool {
    // SAFETY (every raw access below): `add_qp`'s contract; loads are volatile because the
    // poster writes these words concurrently.
    let db = unsafe { std::ptr::read_volatile(qp.rings.doorbell) }.to_ne_bytes();
    let db_idx = ((be32_at(&db, 0) >> 8) & 0xffff) as u16;
    let mut worked = false;
    if db_idx != qp.ci as u16 {
        fence(Ordering::Acquire);
        let db_qpn = be32_at(&db, 4) >> 8;
        if db_qpn != qp.qpn {
            fault(s, qp, format!("doorbell names QPN {db_qpn:#x}"));
            return false;
        }
        let dbr = match read_dbr(qp) {
            Ok(v) => (u32::from_be(v) & 0xffff) as u16,
            Err(e) => {
                fault(s, qp, format!("doorbell record unreadable: {e}"));
                return false;
            }
        };
        let rung = db_idx.wrapping_sub(qp.ci as u16);
        if dbr.wrapping_sub(qp.ci as u16) < rung {
            fault(
                s,
                qp,
                format!("doorbell at index {db_idx} is ahead of its record {dbr}"),
            );
            return false;
        }
        if let Err(e) = fetch_rung(qp, u64::from(dbr.wrapping_sub(qp.ci as u16))) {
            fault(s, qp, format!("send queue unreadable: {e}"));
            return false;
        }
        qp.rd_in_flight = 0;
        while db_idx != qp.ci as u16 {
            match execute(s, regions, qp) {
                Some(n) => {
                    qp.ci += n;
                    worked = true;
                }
                None => break, // stalled (RNR) or faulted
            }
        }
    }
    if worked {
        qp.last_work = Instant::now();
    } else if !qp.pending.is_empty() && qp.last_work.elapsed() > Duration::from_millis(1) {
        deliver(s, qp, u64::MAX);
        worked = true;
    }
    worked
}

/// The send doorbell record's word (big-endian), wherever it lives.
fn read_dbr(qp: &Qp) -> Result<u32> {
    match &qp.rings.ring_dma {
        // SAFETY: add_qp's contract; volatile because the poster writes it concurrently.
        None => Ok(unsafe { std::ptr::read_volatile(qp.rings.dbr) }),
        Some(dma) => {
            let mut b = [0u8; 4];
            dma.0.read(qp.rings.dbr as u64, &mut b)?;
            Ok(u32::from_ne_bytes(b))
        }
    }
}

/// For a send queue in device memory, copies the `n` WQEBBs from the consumer index on (all
/// published: the record covers them) into the shadow the WQEs are read from.
fn fetch_rung(qp: &mut Qp, n: u64) -> Result<()> {
    let Some(dma) = qp.rings.ring_dma.clone() else {
        return Ok(());
    };
    let depth = qp.rings.sq_wqebbs;
    qp.shadow.resize(depth as usize * WQEBB, 0);
    let (first, n) = (qp.ci & (depth - 1), n.min(depth));
    let head = n.min(depth - first);
    let at = first as usize * WQEBB;
    let base = qp.rings.sq as u64;
    dma.0.read(
        base + at as u64,
        &mut qp.shadow[at..at + head as usize * WQEBB],
    )?;
    if n > head {
        dma.0
            .read(base, &mut qp.shadow[..(n - head) as usize * WQEBB])?;
    }
    fence(Ordering::Acquire);
    Ok(())
}

fn fault(s: &Shared, qp: &mut Qp, what: String) {
    let msg = format!("QP {:#x}: {what}", qp.qpn);
    let mut f = lock(&s.faults);
    if f.last() != Some(&msg) {
        tracing::warn!("emulated NIC: {msg}");
        f.push(msg);
    }
}

/// Applies pending writes due by operation count `upto` (all with `u64::MAX`), in a shuffled
/// order.
fn deliver(s: &Shared, qp: &mut Qp, upto: u64) {
    let mut due: Vec<Pending> = Vec::new();
    let mut i = 0;
    while i < qp.pending.len() {
        if qp.pending[i].due <= upto {
            due.push(qp.pending.swap_remove(i));
        } else {
            i += 1;
        }
    }
    while !due.is_empty() {
        let k = (next_rand(&mut qp.rng) % due.len() as u64) as usize;
        let p = due.swap_remove(k);
        if let Err(e) = s.dma.write(p.dst, &p.data) {
            fault(s, qp, format!("delayed write to {:#x} failed: {e}", p.dst));
        }
    }
}

fn next_rand(x: &mut u64) -> u64 {
    *x ^= *x << 13;
    *x ^= *x >> 7;
    *x ^= *x << 17;
    *x
}

/// Finds `[addr, addr + len)` in the region of `key`.
fn covering_region(regions: &[Region], key: u32, addr: u64, len: u64) -> Option<Region> {
    regions
        .iter()
        .find(|r| r.key == key)
        .filter(|r| addr >= r.addr && addr.checked_add(len).is_some_and(|e| e <= r.addr + r.len))
        .copied()
}

/// Executes the WQE at the QP's consumer index; returns the WQEBBs it took, or None when the QP
/// cannot go on now (stalled on RNR, or a malformed WQE was reported).
fn execute(s: &Shared, regions: &[Region], qp: &mut Qp) -> Option<u64> {
    let depth = qp.rings.sq_wqebbs;
    let block = |i: u64| -> [u8; WQEBB] {
        let mut b = [0u8; WQEBB];
        let at = ((qp.ci + i) & (depth - 1)) as usize * WQEBB;
        if qp.rings.ring_dma.is_some() {
            b.copy_from_slice(&qp.shadow[at..at + WQEBB]);
        } else {
            // SAFETY: the slot lies in the send queue (add_qp's contract).
            unsafe { std::ptr::copy(qp.rings.sq.add(at), b.as_mut_ptr(), WQEBB) };
        }
        b
    };
    let first = block(0);
    let ds = usize::from(first[7] & 0x3f);
    let blocks = (ds * DS).div_ceil(WQEBB).max(1) as u64;
    let mut w = first.to_vec();
    for i in 1..blocks.min(depth) {
        w.extend_from_slice(&block(i));
    }
    let op = first[3];
    let idx = u16::from_be_bytes([first[1], first[2]]);
    let qpn = be32_at(&first, 4) >> 8;
    let signaled = first[11] & CQ_UPDATE != 0;
    if qp.error {
        complete(s, qp, op, cq::opcode::REQ_ERR, cq::syndrome::WR_FLUSH, 0);
        return Some(blocks);
    }
    let malformed = if idx != qp.ci as u16 {
        Some(format!("WQE at {} carries index {idx}", qp.ci))
    } else if qpn != qp.qpn {
        Some(format!("WQE at {} names QPN {qpn:#x}", qp.ci))
    } else if ds == 0 || blocks > depth {
        Some(format!("WQE at {} has {ds} DS units", qp.ci))
    } else {
        None
    };
    if let Some(m) = malformed {
        fault(s, qp, m);
        qp.error = true;
        complete(s, qp, op, cq::opcode::REQ_ERR, cq::syndrome::LOCAL_QP_OP, 0);
        return Some(blocks);
    }
    if let Some(gate) = qp.gate.clone() {
        let reads = matches!(
            op,
            opcode::RDMA_READ | opcode::ATOMIC_FA | opcode::ATOMIC_CS
        );
        if reads {
            // The requester keeps at most max_rd_atomic outstanding: past that it waits for
            // the earlier ones, which the emulator has completed.
            qp.rd_in_flight += 1;
            if qp.rd_in_flight > gate.max_rd_atomic().max(1) {
                qp.rd_in_flight = 1;
            }
        }
        if let Err((syndrome, why)) = gate.admit(op, if reads { qp.rd_in_flight } else { 0 }) {
            fault(s, qp, format!("WQE at {}: {why}", qp.ci));
            qp.error = true;
            complete(s, qp, op, cq::opcode::REQ_ERR, syndrome, 0);
            return Some(blocks);
        }
    }
    let result = perform(s, regions, qp, op, &w[..ds * DS]);
    let moved = match result {
        Ok(Some(bytes)) => bytes,
        Ok(None) => return None, // RNR: try again later
        Err(syndrome) => {
            qp.error = true;
            complete(s, qp, op, cq::opcode::REQ_ERR, syndrome, 0);
            return Some(blocks);
        }
    };
    qp.ops += 1;
    qp.wqes += 1;
    {
        let mut t = lock(&s.traffic);
        match op {
            opcode::RDMA_WRITE | opcode::RDMA_WRITE_IMM => {
                t.writes += 1;
                t.write_bytes += u64::from(moved);
            }
            opcode::RDMA_READ => t.reads += 1,
            opcode::ATOMIC_FA | opcode::ATOMIC_CS => t.atomics += 1,
            _ => {}
        }
    }
    if let Delivery::Relaxed { .. } = s.delivery {
        let ops = qp.ops;
        deliver(s, qp, ops);
    }
    if signaled {
        complete(s, qp, op, cq::opcode::REQ, 0, moved);
    }
    Some(blocks)
}

/// Performs one WQE's operation; Ok(Some(bytes)) when done, Ok(None) on RNR, Err(syndrome).
fn perform(
    s: &Shared,
    regions: &[Region],
    qp: &mut Qp,
    op: u8,
    w: &[u8],
) -> std::result::Result<Option<u32>, u8> {
    use cq::syndrome::*;
    let need = |n: usize| {
        if w.len() < n {
            Err(LOCAL_QP_OP)
        } else {
            Ok(())
        }
    };
    let io = |r: Result<()>| r.map_err(|_| LOCAL_PROTECTION);
    // Where this process reaches `[addr, addr + len)` of the region of `key`, or `syndrome`.
    let reach = |key: u32, addr: u64, len: u64, syndrome: u8| {
        covering_region(regions, key, addr, len)
            .map(|r| (r.at(addr), r.strict))
            .ok_or(syndrome)
    };
    // The remote access the operation needs, checked on the region of `rkey` (a ConnectX answers
    // a region registered without it with a remote access error).
    let allowed = |key: u32, flag: u32, syndrome: u8| match regions.iter().find(|r| r.key == key) {
        Some(r) if r.access & flag == 0 => Err(syndrome),
        _ => Ok(()),
    };
    match op {
        opcode::RDMA_WRITE | opcode::RDMA_WRITE_IMM if w.len() >= 3 * DS => {
            allowed(be32_at(w, 24), access::REMOTE_WRITE, REMOTE_ACCESS)?;
        }
        opcode::RDMA_READ if w.len() >= 3 * DS => {
            allowed(be32_at(w, 24), access::REMOTE_READ, REMOTE_ACCESS)?;
            allowed(be32_at(w, 36), access::LOCAL_WRITE, LOCAL_PROTECTION)?;
        }
        opcode::ATOMIC_FA | opcode::ATOMIC_CS if w.len() >= 4 * DS => {
            allowed(be32_at(w, 24), access::REMOTE_ATOMIC, REMOTE_ACCESS)?;
            allowed(be32_at(w, 52), access::LOCAL_WRITE, LOCAL_PROTECTION)?;
        }
        _ => {}
    }
    match op {
        opcode::NOP => Ok(Some(0)),
        opcode::RDMA_WRITE | opcode::RDMA_WRITE_IMM | opcode::RDMA_READ => {
            need(3 * DS)?;
            let (raddr, rkey) = (be64_at(w, 16), be32_at(w, 24));
            let bc = be32_at(w, 32);
            let data: Vec<u8>;
            let len: u64;
            if bc & INLINE_SEG != 0 {
                if op != opcode::RDMA_WRITE {
                    return Err(LOCAL_QP_OP);
                }
                len = u64::from(bc & !INLINE_SEG);
                if 36 + len as usize > w.len() {
                    return Err(LOCAL_LENGTH);
                }
                data = w[36..36 + len as usize].to_vec();
            } else {
                let (lkey, laddr) = (be32_at(w, 36), be64_at(w, 40));
                len = u64::from(bc);
                let (local, _) = reach(lkey, laddr, len, LOCAL_PROTECTION)?;
                let (remote, strict) = reach(rkey, raddr, len, REMOTE_ACCESS)?;
                if op == opcode::RDMA_READ {
                    // A READ follows the QP's earlier writes: deliver them first (the flush).
                    deliver(s, qp, u64::MAX);
                    io(s.dma.copy(local, remote, len))?;
                    return Ok(Some(len as u32));
                }
                let relaxed = matches!(s.delivery, Delivery::Relaxed { .. }) && !strict;
                if op == opcode::RDMA_WRITE && !relaxed {
                    // Delivered now: one copy, no staging.
                    io(s.dma.copy(remote, local, len))?;
                    return Ok(Some(len as u32));
                }
                let mut buf = vec![0u8; len as usize];
                io(s.dma.read(local, &mut buf))?;
                data = buf;
            }
            let (remote, strict) = reach(rkey, raddr, len, REMOTE_ACCESS)?;
            if op == opcode::RDMA_WRITE_IMM {
                let Some(resp) = &qp.responder else {
                    return Err(REMOTE_INVALID_REQUEST);
                };
                if resp
                    .credits
                    .fetch_update(Ordering::AcqRel, Ordering::Acquire, |c| c.checked_sub(1))
                    .is_err()
                {
                    qp.stalled = true;
                    return Ok(None);
                }
                qp.stalled = false;
            }
            match s.delivery {
                Delivery::Relaxed { max_delay, .. } if !strict => {
                    let delay = next_rand(&mut qp.rng) % (u64::from(max_delay) + 1);
                    qp.pending.push(Pending {
                        due: qp.ops + 1 + delay,
                        dst: remote,
                        data,
                    });
                }
                _ => io(s.dma.write(remote, &data))?,
            }
            if op == opcode::RDMA_WRITE_IMM {
                let imm = u32::from_ne_bytes([w[12], w[13], w[14], w[15]]);
                respond(s, qp, len as u32, imm);
            }
            Ok(Some(len as u32))
        }
        opcode::ATOMIC_FA | opcode::ATOMIC_CS => {
            need(4 * DS)?;
            let (raddr, rkey) = (be64_at(w, 16), be32_at(w, 24));
            let (swap_add, compare) = (be64_at(w, 32), be64_at(w, 40));
            let (lkey, laddr) = (be32_at(w, 52), be64_at(w, 56));
            if be32_at(w, 48) != 8 {
                return Err(LOCAL_LENGTH);
            }
            let (local, _) = reach(lkey, laddr, 8, LOCAL_PROTECTION)?;
            if raddr % 8 != 0 {
                return Err(REMOTE_INVALID_REQUEST);
            }
            let (remote, _) = reach(rkey, raddr, 8, REMOTE_ACCESS)?;
            let mut old = [0u8; 8];
            io(s.dma.read(remote, &mut old))?;
            let old_v = u64::from_ne_bytes(old);
            let new_v = if op == opcode::ATOMIC_FA {
                Some(old_v.wrapping_add(swap_add))
            } else if old_v == compare {
                Some(swap_add)
            } else {
                None
            };
            if let Some(v) = new_v {
                io(s.dma.write(remote, &v.to_ne_bytes()))?;
            }
            io(s.dma.write(local, &old))?;
            Ok(Some(8))
        }
        _ => Err(LOCAL_QP_OP),
    }
}

/// Writes a CQE on the QP's send CQ: bytes 0..56 first, then the word holding `op_own`.
fn complete(s: &Shared, qp: &mut Qp, wqe_opcode: u8, opcode: u8, syndrome: u8, bytes: u32) {
    let (cq, entries) = (qp.rings.cq, qp.rings.cq_entries);
    if !qp.rings.cq_ci.is_null() {
        // SAFETY: add_qp's contract.
        let ci =
            u64::from(u32::from_be(unsafe { std::ptr::read_volatile(qp.rings.cq_ci) }) & 0xff_ffff);
        if (qp.cq_pi & 0xff_ffff).wrapping_sub(ci) & 0xff_ffff >= entries {
            fault(
                s,
                qp,
                format!("CQ overrun: {} CQEs written, consumer at {ci}", qp.cq_pi),
            );
        }
    }
    let c = Cqe {
        opcode,
        owner: cq::owner_of(qp.cq_pi, entries),
        wqe_counter: qp.ci as u16,
        qpn: qp.qpn,
        wqe_opcode,
        byte_cnt: bytes,
        imm: 0,
        syndrome,
        vendor_syndrome: if syndrome != 0 { 0x80 | syndrome } else { 0 },
    };
    write_cqe(cq, entries, qp.cq_pi, &c);
    qp.cq_pi += 1;
}

/// A RESP_WR_IMM CQE on the responder's receive CQ.
fn respond(_s: &Shared, qp: &mut Qp, bytes: u32, imm: u32) {
    let Some(r) = qp.responder.as_ref() else {
        return;
    };
    let k = r.completions.fetch_add(1, Ordering::AcqRel);
    let c = Cqe {
        opcode: cq::opcode::RESP_WR_IMM,
        owner: cq::owner_of(k, r.recv_cq_entries),
        wqe_counter: k as u16,
        qpn: qp.qpn,
        wqe_opcode: 0,
        byte_cnt: bytes,
        imm,
        syndrome: 0,
        vendor_syndrome: 0,
    };
    write_cqe(r.recv_cq, r.recv_cq_entries, k, &c);
}

fn write_cqe(cq_base: *mut u8, entries: u64, k: u64, c: &Cqe) {
    let b = c.encode();
    let at = (k & (entries - 1)) as usize * CQE_BYTES;
    // SAFETY: the entry lies in the CQ (add_qp's contract); the last 8 bytes go as one aligned
    // store after a release fence so a poller that sees op_own sees the rest.
    unsafe {
        let p = cq_base.add(at);
        std::ptr::copy(b.as_ptr(), p, 56);
        fence(Ordering::Release);
        let tail = u64::from_ne_bytes(b[56..64].try_into().expect("8 bytes"));
        std::ptr::write_volatile(p.add(56) as *mut u64, tail);
    }
}
