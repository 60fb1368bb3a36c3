//! The one error type of the crate. Each variant says what went wrong and, where there is one,
//! what the user can change. Library code returns these; it never panics on bad input, missing
//! hardware or misbehaving peers.

use std::fmt;

/// Result alias used throughout doorbell.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What a device-side wait was waiting for when it gave up. Non-exhaustive: kinds are added as
/// new checks report (match with a `_` arm).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum WaitKind {
    /// A semaphore token to reach an expected value (a peer's `signal`).
    Semaphore,
    /// An LL packet's flag to match the expected epoch.
    Packet,
    /// A FIFO slot to become free (the proxy is behind).
    FifoSlot,
    /// A proxy flush position.
    Flush,
    /// The proxy service stopped while a kernel depended on it.
    ProxyStopped,
    /// A trigger field out of range (reported like a wait).
    BadTrigger,
    /// A kernel input out of range, such as more rows for one expert from one rank than its
    /// receive area holds (reported like a wait).
    BadInput,
    /// A queue pair's progress: send-queue room, in-order publishing, completions from the NIC.
    IbProgress,
    /// An error completion from the NIC (reported like a wait): 'expected' is the WQE's index,
    /// 'seen' the mlx5 syndrome.
    IbError,
    /// A peer made a different collective call (reported like a wait): 'expected' is this
    /// rank's call word, 'seen' the peer's (see [`crate::gpu::signature`]).
    ArgumentMismatch,
    /// An alltoallv byte range outside its buffer, refused before anything was written (reported
    /// like a wait): the channel says which (`side << 8 | rank`), 'expected' is the buffer's size,
    /// 'seen' the range's end.
    BadCounts,
    /// Not a device wait: `Communicator::synchronize` waited for a stream whose work did not
    /// finish within its bound.
    Stream,
    /// A kind this build does not know (a newer header wrote it).
    Other(u32),
}

impl WaitKind {
    /// Decodes the numeric code the device writes (see `cuda/include/doorbell/core/wait.cuh`).
    pub fn from_code(code: u32) -> Self {
        match code {
            1 => WaitKind::Semaphore,
            2 => WaitKind::Packet,
            3 => WaitKind::FifoSlot,
            4 => WaitKind::Flush,
            5 => WaitKind::ProxyStopped,
            6 => WaitKind::BadTrigger,
            7 => WaitKind::BadInput,
            8 => WaitKind::IbProgress,
            9 => WaitKind::IbError,
            10 => WaitKind::ArgumentMismatch,
            11 => WaitKind::BadCounts,
            c => WaitKind::Other(c),
        }
    }
}

impl fmt::Display for WaitKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            WaitKind::Semaphore => write!(f, "semaphore token"),
            WaitKind::Packet => write!(f, "LL packet flag"),
            WaitKind::FifoSlot => write!(f, "free FIFO slot"),
            WaitKind::Flush => write!(f, "proxy flush"),
            WaitKind::ProxyStopped => write!(f, "proxy service (it stopped)"),
            WaitKind::BadTrigger => {
                write!(f, "a valid trigger (memory or semaphore id out of range)")
            }
            WaitKind::BadInput => write!(
                f,
                "valid kernel input (a count or index out of range: 'expected' is the limit, 'seen' the value)"
            ),
            WaitKind::IbProgress => write!(f, "queue pair progress (send-queue room or completions)"),
            WaitKind::IbError => write!(
                f,
                "a successful completion (the NIC reported an error: 'expected' is the WQE index, 'seen' the mlx5 syndrome)"
            ),
            WaitKind::ArgumentMismatch => write!(f, "the same collective call (a peer made another)"),
            WaitKind::BadCounts => write!(f, "alltoallv counts inside the buffers"),
            WaitKind::Stream => write!(
                f,
                "the stream's work to finish (doorbell's own device waits give up within their \
                 budget: other work on the stream is still running)"
            ),
            WaitKind::Other(c) => write!(f, "wait kind {c}"),
        }
    }
}

/// Every way a doorbell call can fail.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// libcuda could not be loaded, or the driver reports no usable GPU.
    #[error("no CUDA driver: {why}")]
    NoCudaDriver {
        /// What was looked for and not found.
        why: String,
    },
    /// A CUDA driver call failed.
    #[error("CUDA call {call} failed: {code}")]
    Cuda {
        /// The driver entry point (or operation) that failed.
        call: &'static str,
        /// The driver's error name and description.
        code: String,
    },
    /// The out-of-band bootstrap failed; `rank` names the rank at fault when it is known.
    #[error("bootstrap (rank {me}): {}{why}", rank.map(|r| format!("rank {r}: ")).unwrap_or_default())]
    Bootstrap {
        /// The rank reporting the error.
        me: usize,
        /// The rank that did not come, died, or misbehaved, when known.
        rank: Option<usize>,
        /// What happened.
        why: String,
    },
    /// A bounded wait ran out of time: on the host (bootstrap, proxy) or on the device (a kernel's
    /// spin loop recorded who waited for what and gave up).
    #[error("{}", self.timeout_text())]
    Timeout {
        /// The rank that waited.
        rank: i32,
        /// The peer it waited for (-1 when not tied to one peer).
        peer: i32,
        /// What it waited for.
        what: WaitKind,
        /// The channel (or semaphore) id; `u32::MAX`: none.
        channel: u32,
        /// The value it waited to see (`u32::MAX` or `u64::MAX`: none recorded).
        expected: u64,
        /// The last value it saw (the same sentinels).
        seen: u64,
        /// How long it waited.
        waited_ms: u64,
        /// The CUDA block that gave up first.
        block: u32,
        /// The thread in that block.
        thread: u32,
    },
    /// Another rank of the job failed, and this rank's communicator aborted because of it: the
    /// rank died (its bootstrap connection closed without a goodbye), stopped sending heartbeats,
    /// relayed a failure of its own (a device wait that gave up, an error completion, a proxy
    /// that stopped), or called [`crate::communicator::Communicator::abort`]. `rank` may be
    /// this rank (it aborted). The communicator is unusable: drop it, and build a new one among
    /// the survivors ([`crate::communicator::Communicator::shrink`]).
    #[error("rank {me}: rank {rank} failed: {cause}")]
    PeerFailed {
        /// The rank reporting the error.
        me: usize,
        /// The rank that failed (or aborted, or was blamed by the rank that relayed the failure).
        rank: usize,
        /// What happened, as this rank learnt it (a relayed report is quoted whole).
        cause: String,
    },
    /// Ranks made different collective calls (count, data type, operation, algorithm or call
    /// index differ), detected on the device by comparing the call words every call carries.
    /// Every rank of the call reports it; the communicator is unusable afterwards.
    #[error("argument mismatch: rank {rank} made {mine}, while rank {peer} made {theirs}")]
    ArgumentMismatch {
        /// This rank.
        rank: usize,
        /// This rank's call.
        mine: String,
        /// A rank whose call differs.
        peer: usize,
        /// That rank's call.
        theirs: String,
    },
    /// A transport cannot be used here; `why` says what to install or set.
    #[error("transport {transport} unavailable: {why}")]
    TransportUnavailable {
        /// The transport's name.
        transport: &'static str,
        /// Why, and what to do about it.
        why: String,
    },
    /// The caller passed something that cannot work.
    #[error("invalid argument {what}: {why}")]
    InvalidArgument {
        /// The argument or setting.
        what: String,
        /// Why it is wrong.
        why: String,
    },
    /// An operating-system call failed.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
}

impl Error {
    /// Builds [`Error::InvalidArgument`].
    pub fn invalid(what: impl Into<String>, why: impl Into<String>) -> Self {
        Error::InvalidArgument {
            what: what.into(),
            why: why.into(),
        }
    }

    /// Builds [`Error::Io`] from an `io::Error` and a description of what was being done.
    pub fn io(what: impl Into<String>, source: std::io::Error) -> Self {
        Error::Io {
            what: what.into(),
            source,
        }
    }
}

impl From<cudarc::driver::DriverError> for Error {
    fn from(e: cudarc::driver::DriverError) -> Self {
        Error::Cuda {
            call: "cudarc",
            code: e.to_string(),
        }
    }
}

/// Whose CUDA calls on host threads kernels' waits depend on in this process, set when modules
/// load lazily (see [`crate::gpu::cuda::note_host_cuda_calls`]); the first one noted is named.
static LAZY_LOADING: std::sync::OnceLock<&'static str> = std::sync::OnceLock::new();

/// Notes that `what` (host threads' CUDA calls that device waits depend on) runs in a process that
/// loads CUDA modules lazily; warns once.
pub(crate) fn note_lazy_loading(what: &'static str) {
    if LAZY_LOADING.set(what).is_ok() {
        tracing::warn!("{}", lazy_loading_text(what));
    }
}

/// The cause and remedy a timeout names when `note_lazy_loading` was called in this process:
/// a kernel launched for the first time loads its module, loading synchronizes the context,
/// which waits for doorbell's waiting kernels, and the host threads' CUDA calls those kernels
/// wait for are held behind it until the waits give up.
pub fn lazy_loading_hint() -> Option<String> {
    LAZY_LOADING.get().map(|what| lazy_loading_text(what))
}

fn lazy_loading_text(what: &str) -> String {
    format!(
        "this process loads CUDA modules lazily (CUDA_MODULE_LOADING=LAZY, PyTorch's default) and \
         {what} run as CUDA calls on host threads: a kernel launched for the first time while \
         doorbell's kernels wait for them loads its module, which waits for every running \
         kernel, and holds those calls back until the waits give up; set \
         CUDA_MODULE_LOADING=EAGER before CUDA starts"
    )
}

/// Whether a device report's field holds a "none" sentinel rather than a value.
fn unset(v: u64) -> bool {
    v == u64::MAX || v == u64::from(u32::MAX)
}

impl Error {
    /// [`Error::Timeout`]'s text: fields that hold a sentinel (no peer, no channel, no value, no
    /// block) are left out instead of printed as numbers like 4294967295.
    fn timeout_text(&self) -> String {
        let mut t = self.timeout_facts();
        if let Some(hint) = lazy_loading_hint() {
            t += &format!(" (likely cause: {hint})");
        }
        t
    }

    /// [`Error::Timeout`]'s facts, without the lazy-loading hint.
    fn timeout_facts(&self) -> String {
        let Error::Timeout {
            rank,
            peer,
            what,
            channel,
            expected,
            seen,
            waited_ms,
            block,
            thread,
        } = self
        else {
            return String::new();
        };
        let mut t = format!("timeout on rank {rank} waiting for {what}");
        if *peer >= 0 {
            t += &format!(" from peer {peer}");
        }
        if *channel != u32::MAX {
            t += &format!(" on channel {channel}");
        }
        let value = |v: u64| {
            if unset(v) {
                "nothing".to_string()
            } else {
                v.to_string()
            }
        };
        if !(unset(*expected) && unset(*seen)) {
            t += &format!(": expected {}, saw {}", value(*expected), value(*seen));
        }
        t += &format!(" after {waited_ms} ms");
        if *block != u32::MAX {
            t += &format!(" (block {block}, thread {thread})");
        }
        t
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_lazy_loading_hint_names_whose_calls_and_the_remedy() {
        let t = lazy_loading_text("the emulated NIC's copies");
        assert!(t.contains("CUDA_MODULE_LOADING=LAZY"), "{t}");
        assert!(
            t.contains("the emulated NIC's copies run as CUDA calls"),
            "{t}"
        );
        assert!(
            t.ends_with("set CUDA_MODULE_LOADING=EAGER before CUDA starts"),
            "{t}"
        );
    }

    #[test]
    fn timeouts_print_no_sentinels() {
        let t = |peer, channel, expected, seen, block| {
            Error::Timeout {
                rank: 1,
                peer,
                what: WaitKind::Semaphore,
                channel,
                expected,
                seen,
                waited_ms: 30_000,
                block,
                thread: 7,
            }
            .to_string()
        };
        assert_eq!(
            t(0, 3, 12, 11, 2),
            "timeout on rank 1 waiting for semaphore token from peer 0 on channel 3: expected 12, \
             saw 11 after 30000 ms (block 2, thread 7)"
        );
        let bare = t(
            -1,
            u32::MAX,
            u64::from(u32::MAX),
            u64::from(u32::MAX),
            u32::MAX,
        );
        assert_eq!(
            bare,
            "timeout on rank 1 waiting for semaphore token after 30000 ms"
        );
        assert!(t(0, 3, 5, u64::MAX, 0).contains("expected 5, saw nothing"));
    }
}
