//! Registered windows: buffers every rank registered with the allreduce, mapped by every peer,
//! where a call's buffers are used in place (the direct two-shot) instead of staged.

use crate::channel::symmetric::SymmetricBuffer;
use crate::device_api::MAX_RANKS;

/// A buffer every rank registered with [`AllReduce::register_window`], and every rank's copy of
/// it as mapped here.
pub(super) struct Window {
    pub(super) span: Span,
    pub(super) _shared: SymmetricBuffer,
}

/// A window's addresses: its range here and every rank's base as mapped here (own at `rank`; 0
/// where a rank has no mapping).
#[derive(Clone, Copy, Debug)]
pub(super) struct Span {
    pub(super) base: u64,
    pub(super) bytes: u64,
    pub(super) mapped: [u64; MAX_RANKS],
}

/// Where `[p, p + bytes)` lies inside one of `spans`: the span's index, the offset in it and
/// every rank's address of `p` as mapped here.
pub(super) fn locate<'a>(
    spans: impl IntoIterator<Item = &'a Span>,
    p: u64,
    bytes: u64,
) -> Option<(usize, u64, [u64; MAX_RANKS])> {
    let (index, span) = spans.into_iter().enumerate().find(|(_, w)| {
        p >= w.base
            && (p - w.base)
                .checked_add(bytes)
                .is_some_and(|end| end <= w.bytes)
    })?;
    let offset = p - span.base;
    let mut at = [0u64; MAX_RANKS];
    for (a, m) in at.iter_mut().zip(&span.mapped) {
        if *m != 0 {
            *a = m + offset;
        }
    }
    Some((index, offset, at))
}

/// The count field of a direct call's word: the count mixed with the windows and offsets of its
/// buffers, so that ranks whose buffers sit at different places (the kernel would read and write
/// the wrong elements) fail the call check instead of returning a wrong sum. Equal on every rank
/// exactly when the count, the window indices and the offsets are (up to a 2^-32 collision).
pub(super) fn direct_signature(count: u64, input: (usize, u64), output: (usize, u64)) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for v in [count, input.0 as u64, input.1, output.0 as u64, output.1] {
        for b in v.to_le_bytes() {
            h = (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3);
        }
    }
    (h ^ (h >> 32)) & 0xffff_ffff
}

/// Where both buffers of a call lie in windows: every rank's input and output as mapped here.
#[derive(Clone, Copy)]
pub(super) struct Direct {
    pub(super) input: [u64; MAX_RANKS],
    pub(super) output: [u64; MAX_RANKS],
    /// Where the buffers sit: (window index, offset) of the input and of the output.
    pub(super) at: ((usize, u64), (usize, u64)),
}
