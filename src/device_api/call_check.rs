//! Mirrors of `coll/call_check.cuh`: the collective call check (see the module above for the layout test).

use bytemuck::{Pod, Zeroable};

/// Most ranks a single-node collective kernel handles (`kMaxRanks`).
pub const MAX_RANKS: usize = 8;

/// Words of one rank's call-check inbox (`kInboxWords`): four slots per rank, the counts of
/// calls announced to and checked against each rank, and two parities of pair byte counts (two
/// words per rank); [`crate::gpu::signature::INBOX_BYTES`] is its size in bytes.
pub const INBOX_WORDS: usize = 10 * MAX_RANKS;

/// A call's word and every rank's call-check inbox (`coll/call_check.cuh`); a zero word runs the
/// kernel unchecked.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct CallCheck {
    /// This call's word (see [`crate::gpu::signature`]).
    pub word: u64,
    /// Every rank's inbox ([`crate::gpu::signature::INBOX_BYTES`]), mapped here (own at `rank`).
    pub inbox: [u64; MAX_RANKS],
}
