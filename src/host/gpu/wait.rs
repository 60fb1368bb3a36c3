//! Host side of bounded device waits and of the abort word (see `cuda/include/doorbell/core/wait.cuh`
//! for the protocol).
//!
//! Each communicator has one [`WaitDiagnostics`]: the host-mapped [`WaitReport`] that the first
//! giving-up waiter fills (and the first call-check mismatch), the device-memory claim word that
//! elects them, the abort word every device wait polls, the budget every wait gets, and the first
//! failure of another rank this rank learnt of. Handles that can wait carry a [`WaitSite`] built
//! here. [`WaitDiagnostics::error`] turns what is known into the one error a host call returns.
//!
//! This module never talks to peers: the communicator's watchdog feeds it faults and relays what
//! it reports.

use crate::device_api::{WaitReport, WaitSite};
use crate::error::{Error, Result, WaitKind};
use crate::gpu::cuda::{Gpu, HostArray};
use crate::gpu::signature::describe;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A failure of another rank (or of this one, when it aborted), as this rank learnt it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fault {
    /// The rank that failed, aborted, or was blamed.
    pub rank: usize,
    /// What happened.
    pub cause: String,
}

/// The communicator's wait report, abort word and budget.
pub struct WaitDiagnostics {
    report: HostArray<WaitReport>,
    claim: u64,
    budget: Duration,
    rank: i32,
    fault: Mutex<Option<Fault>>,
    /// Peers found dead while the communicator tolerates peer loss, with what happened to each.
    dead: Mutex<Vec<Fault>>,
    /// Whether a dead peer is marked (`mark_dead`) instead of aborting the communicator.
    tolerant: std::sync::atomic::AtomicBool,
}

/// Bits of the report's abort word (`kAbortAll`, `kAbortPeerDead` in `core/wait.cuh`): every device
/// wait leaves; some peer is marked in `dead_peers` (the GPU reads that word only then).
const ABORT_ALL: u32 = 1;
const ABORT_PEER_DEAD: u32 = 2;

/// How long a failed CUDA call waits for the watchdog to learn why, before it is returned as it
/// is: a peer's death can fail this rank's kernel (MPS) a moment before its socket closes.
const EXPLAIN_GRACE: Duration = Duration::from_millis(1500);

impl WaitDiagnostics {
    /// `claim` is the device address of 16 zeroed, 8-byte-aligned bytes of device memory that
    /// nothing else uses: the claim word and the abort gate after it (`core/wait.cuh`).
    pub(crate) fn new(gpu: &Arc<Gpu>, claim: u64, budget: Duration, rank: usize) -> Result<Self> {
        Ok(WaitDiagnostics {
            report: HostArray::new(gpu, 1)?,
            claim,
            budget,
            rank: rank as i32,
            fault: Mutex::new(None),
            dead: Mutex::new(Vec::new()),
            tolerant: std::sync::atomic::AtomicBool::new(false),
        })
    }

    /// The wait site for a handle of `channel` that waits for `peer` (-1: no single peer).
    pub fn site(&self, peer: i32, channel: u32) -> WaitSite {
        WaitSite {
            report: self.report.device_ptr(),
            claim: self.claim,
            budget_ns: self.budget.as_nanos().min(u64::MAX as u128) as u64,
            rank: self.rank,
            peer,
            channel,
            reserved: 0,
        }
    }

    /// The budget of one device wait.
    pub fn budget(&self) -> Duration {
        self.budget
    }

    /// Reads one u32 field of the report with a volatile load (the GPU writes it concurrently).
    fn field(&self, pick: impl Fn(*mut WaitReport) -> *mut u32) -> u32 {
        // SAFETY: the report is one live, pinned WaitReport; the field pointer stays inside it
        // and is 4-byte aligned (repr(C), layout-tested).
        unsafe { std::ptr::read_volatile(pick(self.report.host_ptr())) }
    }

    /// Whether the abort word is set (by this host or by a device giver-up).
    pub fn aborted(&self) -> bool {
        self.field(|r| unsafe { std::ptr::addr_of_mut!((*r).abort) }) & ABORT_ALL != 0
    }

    /// Records `fault` as the reason this communicator stops (the first one recorded wins) and
    /// sets the abort word, so every device wait leaves. Returns true for the first fault.
    pub fn abort(&self, fault: Fault) -> bool {
        let first = {
            let mut f = self.fault.lock().unwrap_or_else(|p| p.into_inner());
            let first = f.is_none();
            if first {
                *f = Some(fault);
            }
            first
        };
        // A locked OR (the GPU may write the word too), which the GPU reads with an acquire load.
        self.abort_word()
            .fetch_or(ABORT_ALL, std::sync::atomic::Ordering::SeqCst);
        std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
        first
    }

    /// Records that peer `fault.rank` died while the communicator tolerates peer loss: its bit in
    /// the report's `dead_peers` (the device's tolerant waits leave it out, every other wait for
    /// it fails the communicator) instead of the abort word; the fault is also kept as the cause
    /// a later abort names. Returns true the first time for that peer. Peers past 63 cannot be
    /// marked: the communicator aborts for them as for any failure.
    pub fn mark_dead(&self, fault: Fault) -> bool {
        if fault.rank >= 64 {
            return self.abort(fault);
        }
        let mut dead = self.dead.lock().unwrap_or_else(|p| p.into_inner());
        if dead.iter().any(|f| f.rank == fault.rank) {
            return false;
        }
        // Not kept as `fault`: the communicator goes on. `known` names the first dead peer only
        // once something aborts it (a wait that could not leave the peer out).
        // SAFETY: the report is one live, pinned WaitReport; the field pointer stays inside it and
        // is 8-byte aligned (repr(C), layout-tested). Writers of dead_peers hold `dead`'s lock;
        // the GPU only reads it (acquire).
        unsafe {
            let word = std::ptr::addr_of_mut!((*self.report.host_ptr()).dead_peers);
            std::ptr::write_volatile(word, std::ptr::read_volatile(word) | (1u64 << fault.rank));
        }
        // Then the abort word's bit that tells the GPU to read dead_peers at all, with a locked
        // OR: the GPU may set bit 0 at any moment, and a plain read-modify-write could undo it.
        std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
        self.abort_word()
            .fetch_or(ABORT_PEER_DEAD, std::sync::atomic::Ordering::SeqCst);
        dead.push(fault);
        true
    }

    /// From now on a peer's death is marked ([`mark_dead`](Self::mark_dead)) instead of aborting
    /// the communicator (set by an exchange that can leave dead peers out: MoE low latency with
    /// a rank mask).
    pub fn tolerate_peer_loss(&self) {
        self.tolerant
            .store(true, std::sync::atomic::Ordering::SeqCst);
    }

    /// Whether peer loss is tolerated (see [`tolerate_peer_loss`](Self::tolerate_peer_loss)).
    pub fn tolerates_peer_loss(&self) -> bool {
        self.tolerant.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// The peers marked dead ([`mark_dead`](Self::mark_dead)), one bit each.
    pub fn dead_peers(&self) -> u64 {
        // SAFETY: as in `field`; an aligned 8-byte volatile read of host memory.
        unsafe { std::ptr::read_volatile(std::ptr::addr_of!((*self.report.host_ptr()).dead_peers)) }
    }

    /// The first peer marked dead, with its cause.
    pub fn first_dead(&self) -> Option<Fault> {
        self.dead
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .first()
            .cloned()
    }

    /// The report's abort word, as an atomic the host and the GPU both write.
    fn abort_word(&self) -> &std::sync::atomic::AtomicU32 {
        // SAFETY: the report is one live, pinned (host-mapped) WaitReport that lives as long as
        // `self`; the field is 4-byte aligned (repr(C), layout-tested); every host access to it
        // goes through this atomic or a volatile read, and the GPU's are 4-byte atomic stores.
        unsafe {
            std::sync::atomic::AtomicU32::from_ptr(std::ptr::addr_of_mut!(
                (*self.report.host_ptr()).abort
            ))
        }
    }

    /// The fault recorded so far, if any.
    pub fn fault(&self) -> Option<Fault> {
        self.fault.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// The device's own report, if a wait of this communicator gave up: the timeout (or error
    /// completion, proxy stop, bad input) it recorded.
    pub fn timeout(&self) -> Option<Error> {
        let r = self.report.read(0);
        if r.valid != 1 {
            return None;
        }
        if WaitKind::from_code(r.what) == WaitKind::BadCounts {
            return Some(bad_counts(r.rank, r.channel, r.expected, r.seen));
        }
        Some(Error::Timeout {
            rank: r.rank,
            peer: r.peer,
            what: WaitKind::from_code(r.what),
            channel: r.channel,
            expected: r.expected,
            seen: r.seen,
            waited_ms: r.waited_ns / 1_000_000,
            block: r.block,
            thread: r.thread,
        })
    }

    /// The call-check mismatch the device found, if any.
    pub fn mismatch(&self) -> Option<Error> {
        let r = self.report.read(0);
        if r.mismatch_valid != 1 {
            return None;
        }
        let (rank, peer) = (self.rank.max(0) as usize, r.mismatch_peer.max(0) as usize);
        if r.mismatch_counts == 1 {
            let pair = |word, to, send, recv| {
                format!(
                    "{}, sending {send} bytes to rank {to} and expecting {recv} bytes from it",
                    describe(word)
                )
            };
            return Some(Error::ArgumentMismatch {
                rank,
                mine: pair(
                    r.mismatch_mine,
                    peer,
                    r.mismatch_mine_send,
                    r.mismatch_mine_recv,
                ),
                peer,
                theirs: pair(
                    r.mismatch_theirs,
                    rank,
                    r.mismatch_theirs_send,
                    r.mismatch_theirs_recv,
                ),
            });
        }
        Some(Error::ArgumentMismatch {
            rank,
            mine: describe(r.mismatch_mine),
            peer,
            theirs: describe(r.mismatch_theirs),
        })
    }

    /// The error a host call should return, if this communicator failed: a call-check mismatch
    /// first (the root cause wherever it appears), then another rank's failure, then this rank's
    /// own device report. A report that is only a consequence (this rank's proxy stopped under a
    /// kernel because a peer's connection went away) waits up to `EXPLAIN_GRACE` for the cause
    /// that normally follows within milliseconds: a peer that found a mismatch aborts, its
    /// transport closes before its relayed mismatch arrives here.
    pub fn error(&self) -> Option<Error> {
        let until = Instant::now() + EXPLAIN_GRACE;
        loop {
            let e = self.known()?;
            if !is_consequence(&e) || Instant::now() >= until {
                return Some(e);
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// What [`error`](Self::error) returns, as known at this instant.
    fn known(&self) -> Option<Error> {
        if let Some(e) = self.mismatch() {
            return Some(e);
        }
        if let Some(f) = self.fault() {
            // A peer relays a mismatch it found as text; it is still a mismatch here (this rank
            // may not have reached the call yet).
            if let Some(e) = parse_mismatch(&f.cause) {
                return Some(e);
            }
            return Some(Error::PeerFailed {
                me: self.rank.max(0) as usize,
                rank: f.rank,
                cause: f.cause,
            });
        }
        if let Some(e) = self.timeout() {
            return Some(e);
        }
        // Aborted by a wait that could not leave a dead peer out (tolerated peer loss): that
        // peer is the cause.
        if self.aborted() {
            if let Some(f) = self.first_dead() {
                return Some(Error::PeerFailed {
                    me: self.rank.max(0) as usize,
                    rank: f.rank,
                    cause: f.cause,
                });
            }
        }
        None
    }

    /// The error to report for a failed CUDA call: what [`error`](Self::error) knows, waiting a
    /// moment for the watchdog to learn of a peer's failure if nothing is known yet (the failure
    /// then says what CUDA reported too); the call's own error otherwise.
    pub fn explain(&self, e: Error) -> Error {
        // Only a kernel that failed can have been failed by a peer: other errors (a bad launch
        // argument, out of memory) are returned at once.
        let grace = if kernel_failed(&e) {
            EXPLAIN_GRACE
        } else {
            Duration::ZERO
        };
        let until = Instant::now() + grace;
        loop {
            if let Some(known) = self.error() {
                return match known {
                    Error::PeerFailed { me, rank, cause } => Error::PeerFailed {
                        me,
                        rank,
                        cause: format!("{cause} (CUDA then reported: {e})"),
                    },
                    other => other,
                };
            }
            if Instant::now() >= until {
                return e;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// `Err` if this communicator failed (see [`error`](Self::error)), else `Ok`.
    pub fn healthy(&self) -> Result<()> {
        match self.error() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

/// Whether `e` is a device report that follows from another failure rather than naming one: the
/// proxy service stopped while a kernel waited on it (a peer's transport closed under it).
pub(crate) fn is_consequence(e: &Error) -> bool {
    matches!(
        e,
        Error::Timeout {
            what: WaitKind::ProxyStopped,
            ..
        }
    )
}

/// Whether `e` says a kernel failed on the device (the errors a dead peer can cause: its memory
/// gone under MPS, a context torn down), as opposed to a call refused on the host.
fn kernel_failed(e: &Error) -> bool {
    let Error::Cuda { code, .. } = e else {
        return false;
    };
    [
        "LAUNCH_FAILED",
        "ILLEGAL_ADDRESS",
        "ILLEGAL_INSTRUCTION",
        "MISALIGNED_ADDRESS",
        "HARDWARE_STACK_ERROR",
        "LAUNCH_TIMEOUT",
        "ECC_UNCORRECTABLE",
        "CONTEXT_IS_DESTROYED",
        "MPS_",
    ]
    .iter()
    .any(|k| code.contains(k))
}

/// The error for an alltoallv whose device counts the kernel refused (`kWaitBadCounts`):
/// `channel` is `side << 8 | rank` (0: a send block, 1: a receive block, 2: the own block's two
/// counts), `limit` the buffer's bytes (side 2: the receive count), `end` the range's end (the
/// send count).
fn bad_counts(rank: i32, channel: u32, limit: u64, end: u64) -> Error {
    let p = channel & 0xff;
    let why = match channel >> 8 {
        0 => format!(
            "rank {rank}: the block for rank {p} ends at byte {end}, past the input's {limit} bytes"
        ),
        1 => format!(
            "rank {rank}: the block from rank {p} ends at byte {end}, past the output's {limit} \
             bytes"
        ),
        _ => format!(
            "rank {rank}: its own block is {end} bytes sent but {limit} bytes received (the two \
             must be equal)"
        ),
    };
    Error::invalid(
        "alltoallv counts",
        format!("{why}; refused on the device before anything was written"),
    )
}

/// The [`Error::ArgumentMismatch`] a relayed cause quotes, if it quotes one (the error's own
/// display text: "argument mismatch: rank R made ..., while rank P made ...").
pub fn parse_mismatch(cause: &str) -> Option<Error> {
    let rest = &cause[cause.find("argument mismatch: rank ")? + "argument mismatch: rank ".len()..];
    let (rank, rest) = rest.split_once(" made ")?;
    let (mine, rest) = rest.split_once(", while rank ")?;
    let (peer, theirs) = rest.split_once(" made ")?;
    Some(Error::ArgumentMismatch {
        rank: rank.parse().ok()?,
        mine: mine.to_string(),
        peer: peer.parse().ok()?,
        theirs: theirs.to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refused_alltoallv_counts_say_which_block_and_both_sizes() {
        let send = bad_counts(2, 1, 4096, 8192).to_string();
        assert!(
            send.contains("rank 2: the block for rank 1 ends at byte 8192, past the input's 4096"),
            "{send}"
        );
        let recv = bad_counts(0, 1 << 8 | 3, 100, 101).to_string();
        assert!(
            recv.contains("rank 0: the block from rank 3 ends at byte 101, past the output's 100"),
            "{recv}"
        );
        let own = bad_counts(1, 2 << 8 | 1, 64, 32).to_string();
        assert!(own.contains("32 bytes sent but 64 bytes received"), "{own}");
        assert!(own.contains("before anything was written"), "{own}");
    }

    #[test]
    fn a_relayed_mismatch_is_a_mismatch_again() {
        let e = Error::ArgumentMismatch {
            rank: 0,
            mine: "call #3 (mod 65536): allreduce of 1024 x f32 (sum, oneshot-ll16)".into(),
            peer: 2,
            theirs: "call #3 (mod 65536): allreduce of 2048 x f32 (sum, oneshot-ll16)".into(),
        };
        let relayed = format!("rank 0 reported: {e}");
        let back = parse_mismatch(&relayed).unwrap();
        assert_eq!(back.to_string(), e.to_string());
        assert!(parse_mismatch("rank 1 reported: timeout on rank 1").is_none());
    }

    #[test]
    fn only_failed_kernels_wait_for_the_watchdog() {
        let cuda = |code: &str| Error::Cuda {
            call: "cuStreamSynchronize",
            code: code.into(),
        };
        assert!(kernel_failed(&cuda(
            "DriverError(CUDA_ERROR_LAUNCH_FAILED, \"unspecified launch failure\")"
        )));
        assert!(kernel_failed(&cuda(
            "DriverError(CUDA_ERROR_ILLEGAL_ADDRESS, \"...\")"
        )));
        assert!(!kernel_failed(&cuda(
            "DriverError(CUDA_ERROR_INVALID_VALUE, \"...\")"
        )));
        assert!(!kernel_failed(&cuda(
            "DriverError(CUDA_ERROR_OUT_OF_MEMORY, \"...\")"
        )));
        assert!(!kernel_failed(&Error::invalid("x", "y")));
    }
}
