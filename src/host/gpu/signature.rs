//! Call words: the 64 bits every collective call tells its peers about itself, so that ranks
//! making different calls are named on the device instead of returning wrong results or timing
//! out (protocol in `cuda/include/doorbell/coll/call_check.cuh`).
//!
//! This module owns the word's layout and its description in errors; it must stay free of any
//! collective's logic (collectives hand it codes, it hands back words and text).
//!
//! Layout (bit ranges, low first):
//!
//! ```text
//! 0..16   call index, modulo 2^16 (counts calls of one collective object)
//! 16..20  collective (CallKind)
//! 20..24  element type code (DataType::code; 15 for bytes)
//! 24..28  variant: the algorithm (allreduce) or mode
//! 28..30  operation (0: sum)
//! 30..62  count (elements or bytes), saturated at 2^32 - 1
//! 62      1: issued while the stream was being captured into a CUDA graph
//! 63      1: a written word (a zeroed inbox slot reads as "nothing yet")
//! ```
//!
//! The call index and the graph bit form the call's key: a peer's word is compared only once it
//! has this call's key. Replays of a captured graph reuse the indices they were captured with, so
//! without the graph bit an eager call could meet a replayed word of the same index (once every
//! 65536 calls) and take it for a different call.

use crate::device_api::{CallCheck, INBOX_WORDS, MAX_RANKS};

/// Which collective a call word belongs to. Non-exhaustive: kinds are added as collectives gain
/// the call check (the net collectives, the all-gather).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
#[non_exhaustive]
pub enum CallKind {
    /// `collectives::allreduce`.
    AllReduce = 1,
    /// `collectives::alltoall`, equal blocks.
    AllToAll = 2,
    /// `collectives::alltoall`, variable blocks.
    AllToAllV = 3,
    /// MoE high-throughput dispatch.
    MoeDispatch = 4,
    /// MoE high-throughput combine.
    MoeCombine = 5,
    /// MoE low-latency dispatch.
    MoeLlDispatch = 6,
    /// MoE low-latency combine.
    MoeLlCombine = 7,
    /// `collectives::net` all-to-all (every byte through PortChannels).
    NetAllToAll = 8,
    /// `collectives::net` allreduce; mode 1: one phase of the hierarchical one.
    NetAllReduce = 9,
    /// `collectives::allgather` (the copy-engine ring over PortChannels).
    AllGather = 10,
}

impl CallKind {
    fn name(code: u64) -> &'static str {
        match code {
            1 => "allreduce",
            2 => "alltoall",
            3 => "alltoallv",
            4 => "MoE dispatch",
            5 => "MoE combine",
            6 => "MoE low-latency dispatch",
            7 => "MoE low-latency combine",
            8 => "net alltoall",
            9 => "net allreduce",
            10 => "allgather",
            _ => "an unknown collective",
        }
    }
}

/// The element type code for collectives that move bytes.
pub const BYTES: u32 = 15;
/// The element type code of FP8 (e4m3) rows.
pub const E4M3: u32 = 3;

/// Allreduce algorithm names by code (`Algorithm::ALL` order; a test in `collectives::allreduce`
/// keeps the two in step).
pub const ALLREDUCE_VARIANTS: [&str; 7] = [
    "oneshot-ll8",
    "oneshot-ll16",
    "twoshot-ll8",
    "twoshot-ll16",
    "twoshot-sentinel",
    "pipelined",
    "twoshot-direct",
];

const COUNT_BITS: u32 = 32;

/// The fields of one call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Call {
    /// Calls of this collective object before this one (the word keeps it modulo 2^16).
    pub index: u64,
    /// The collective.
    pub kind: CallKind,
    /// Element type code (`DataType::code`, or [`BYTES`]).
    pub dtype: u32,
    /// Algorithm or mode code.
    pub variant: u32,
    /// Operation code (0: sum).
    pub op: u32,
    /// Elements or bytes.
    pub count: u64,
    /// Issued while the stream was being captured into a CUDA graph.
    pub graph: bool,
}

impl Call {
    /// The word that travels.
    pub fn word(&self) -> u64 {
        (self.index & 0xffff)
            | (self.kind as u64) << 16
            | u64::from(self.dtype & 15) << 20
            | u64::from(self.variant & 15) << 24
            | u64::from(self.op & 3) << 28
            | self.count.min((1 << COUNT_BITS) - 1) << 30
            | u64::from(self.graph) << 62
            | 1 << 63
    }
}

/// What a call word says, for errors: "call #5: allreduce of 1048576 x f32 (sum, pipelined)".
pub fn describe(word: u64) -> String {
    if word >> 63 == 0 {
        return "no call".into();
    }
    let index = word & 0xffff;
    let kind = (word >> 16) & 15;
    let dtype = match (word >> 20) & 15 {
        0 => "bf16",
        1 => "f16",
        2 => "f32",
        3 => "e4m3",
        15 => "bytes",
        _ => "an unknown type",
    };
    let variant = ((word >> 24) & 15) as usize;
    let count = (word >> 30) & ((1 << COUNT_BITS) - 1);
    let direct = kind == CallKind::AllReduce as u64
        && ALLREDUCE_VARIANTS.get(variant) == Some(&"twoshot-direct");
    let mut text = if direct {
        // The count field holds the count mixed with where the buffers sit in the windows.
        format!(
            "call #{index} (mod 65536): {} of {dtype} on windows (count and buffer offsets \
             signature {count:#010x})",
            CallKind::name(kind)
        )
    } else if kind == CallKind::AllToAllV as u64 {
        // Blocks differ by pair: the counts travel beside the word (`coll/call_check.cuh`).
        format!("call #{index} (mod 65536): alltoallv")
    } else {
        format!(
            "call #{index} (mod 65536): {} of {count} x {dtype}",
            CallKind::name(kind)
        )
    };
    if kind == CallKind::AllReduce as u64 {
        let op = if (word >> 28) & 3 == 0 { "sum" } else { "?" };
        let algo = ALLREDUCE_VARIANTS.get(variant).copied().unwrap_or("?");
        text.push_str(&format!(" ({op}, {algo})"));
    } else if variant != 0 {
        text.push_str(&format!(" (mode {variant})"));
    }
    if (word >> 62) & 1 == 1 {
        text.push_str(" in a CUDA graph");
    }
    text
}

/// Bytes of one rank's inbox (`kInboxWords` in `coll/call_check.cuh`): `[4][MAX_RANKS]` slots its
/// peers write, then its own counts of calls announced to and checked against each peer,
/// `MAX_RANKS` words each, then `[2 parities][MAX_RANKS][2]` pair byte counts (alltoallv). The
/// slot a call uses is picked by that count on the device, not by the call index: a CUDA graph
/// replays the indices it captured. Four slots, not two: MoE low latency may have two calls in
/// flight (sends before receive halves), and a peer then runs up to three calls ahead of a check.
pub const INBOX_BYTES: usize = INBOX_WORDS * 8;

/// The call check of one collective object: every rank's inbox (mapped here) and the count of
/// calls made so far.
#[derive(Debug)]
pub struct CallChecker {
    inbox: [u64; MAX_RANKS],
    calls: std::sync::atomic::AtomicU64,
    enabled: bool,
    /// The communicator's count of collective calls (all objects), which its goodbye carries.
    made: std::sync::Arc<std::sync::atomic::AtomicU64>,
}

impl CallChecker {
    /// `inbox[r]`: rank `r`'s inbox as mapped here (zeroed memory of [`INBOX_BYTES`]). With
    /// `enabled` false (`DOORBELL_CALL_CHECK=0`) every word is 0: kernels skip the check. Every
    /// call also counts into `made` (`Bootstrap::call_counter`, counted either way).
    pub fn new(
        inbox: [u64; MAX_RANKS],
        enabled: bool,
        made: std::sync::Arc<std::sync::atomic::AtomicU64>,
    ) -> Self {
        CallChecker {
            inbox,
            calls: std::sync::atomic::AtomicU64::new(0),
            enabled,
            made,
        }
    }

    /// Whether calls are checked (`DOORBELL_CALL_CHECK` not 0).
    pub fn enabled(&self) -> bool {
        self.enabled
    }

    /// Calls made so far.
    pub fn calls(&self) -> u64 {
        self.calls.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The launch argument of the next call (counts it): every rank must make the same calls in
    /// the same order, and the kernel checks that they did.
    pub fn next(
        &self,
        kind: CallKind,
        dtype: u32,
        variant: u32,
        op: u32,
        count: u64,
        graph: bool,
    ) -> CallCheck {
        let index = self
            .calls
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.made.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let word = Call {
            index,
            kind,
            dtype,
            variant,
            op,
            count,
            graph,
        }
        .word();
        CallCheck {
            word: if self.enabled { word } else { 0 },
            inbox: self.inbox,
        }
    }
}

/// Whether `stream` is being captured into a CUDA graph (its calls' words say so).
/// One driver call, without re-binding the context: the caller is about to launch on `stream`
/// from this thread, so its context is current (if it is not, the call fails and the word says
/// "not captured", which only weakens the check for that call).
pub fn capturing(stream: &cudarc::driver::CudaStream) -> bool {
    // SAFETY: `stream` is a live stream; cuStreamIsCapturing only reads its state.
    let status = unsafe { cudarc::driver::result::stream::is_capturing(stream.cu_stream()) };
    matches!(
        status,
        Ok(cudarc::driver::sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_ACTIVE)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn words_keep_their_fields_and_describe_them() {
        let call = Call {
            index: 65536 + 5,
            kind: CallKind::AllReduce,
            dtype: 2,
            variant: 5,
            op: 0,
            count: 1 << 20,
            graph: false,
        };
        let w = call.word();
        assert_eq!(w & 0xffff, 5);
        assert_eq!(w >> 63, 1);
        assert_eq!(
            describe(w),
            "call #5 (mod 65536): allreduce of 1048576 x f32 (sum, pipelined)"
        );
        let other = Call {
            count: 1 << 19,
            ..call
        };
        assert_ne!(other.word(), w);
        assert_eq!(describe(0), "no call");
        // Counts beyond 32 bits saturate instead of spilling into the graph and valid bits.
        let huge = Call {
            count: u64::MAX,
            ..call
        }
        .word();
        assert_eq!(huge >> 62, 2);
        assert_eq!((huge >> 16) & 15, CallKind::AllReduce as u64);
    }

    #[test]
    fn alltoallv_words_leave_the_counts_to_the_pair() {
        let w = Call {
            index: 7,
            kind: CallKind::AllToAllV,
            dtype: BYTES,
            variant: 0,
            op: 0,
            count: 0,
            graph: true,
        }
        .word();
        assert_eq!(
            describe(w),
            "call #7 (mod 65536): alltoallv in a CUDA graph"
        );
    }

    #[test]
    fn direct_words_describe_a_signature_not_a_count() {
        let w = Call {
            index: 3,
            kind: CallKind::AllReduce,
            dtype: 0,
            variant: 6,
            op: 0,
            count: 0xdead_beef,
            graph: false,
        }
        .word();
        assert_eq!(
            describe(w),
            "call #3 (mod 65536): allreduce of bf16 on windows (count and buffer offsets \
             signature 0xdeadbeef) (sum, twoshot-direct)"
        );
    }

    #[test]
    fn each_call_gets_the_next_index() {
        let c = CallChecker::new([0; MAX_RANKS], true, Default::default());
        let a = c.next(CallKind::AllToAll, BYTES, 0, 0, 64, false);
        let b = c.next(CallKind::AllToAll, BYTES, 0, 0, 64, true);
        assert_eq!(a.word & 0xffff, 0);
        assert_eq!(b.word & 0xffff, 1);
        assert!(describe(b.word).contains("alltoall of 64 x bytes"));
        assert!(describe(b.word).ends_with("in a CUDA graph"));
        assert_eq!((b.word >> 62) & 1, 1);
        let off = CallChecker::new([0; MAX_RANKS], false, Default::default());
        assert_eq!(off.next(CallKind::AllToAll, BYTES, 0, 0, 64, false).word, 0);
    }
}
