//! What the links have delivered and how they ended: the message queues that reader threads fill
//! and waiters take from, keyed by peer and channel, each peer's fate, and the job's abort.
//!
//! This module owns the one mutex and condvar all of that sits behind, and the loop every reader
//! thread runs. It must never wait past a caller's deadline, never let a gone peer or an abort
//! hide messages that arrived before it, and never write to a link: sending is the parent's.

use super::wire::{decode_abort, Kind, Receiver};
use super::{fmt_ranks, lock};
use crate::error::Error;
use crate::job::socket::fmt_duration;
use std::collections::{HashMap, VecDeque};
use std::io;
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::time::{Duration, Instant};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) enum Chan {
    User(u64),
    Gather(u64),
    /// A shrunk job's rendezvous port, from its new root (tag: the shrink's generation).
    Shrink(u64),
}

pub(super) struct Abort {
    pub(super) from: usize,
    pub(super) blamed: Option<usize>,
    pub(super) why: String,
}

struct Gone {
    /// True when the link ended without a goodbye (crash, exit, reset, protocol error).
    died: bool,
    why: String,
    /// The collective calls the peer's communicator had made, as its goodbye said.
    calls: Option<u64>,
}

/// Why a wait or send failed, and whether the other ranks should hear about it.
pub(super) struct Failure {
    pub(super) blamed: Option<usize>,
    pub(super) why: String,
    /// False when the failure is itself an abort another rank sent.
    pub(super) propagate: bool,
}

impl Failure {
    pub(super) fn peer(peer: usize, why: String) -> Failure {
        Failure {
            blamed: Some(peer),
            why,
            propagate: true,
        }
    }

    pub(super) fn into_error(self, me: usize) -> Error {
        Error::Bootstrap {
            me,
            rank: self.blamed,
            why: self.why,
        }
    }
}

struct State {
    queues: HashMap<(usize, Chan), VecDeque<Vec<u8>>>,
    gone: Vec<Option<Gone>>,
    aborted: Option<Abort>,
    /// When each peer's link last delivered a frame (heartbeats included).
    last_heard: Vec<Instant>,
}

/// The first failure a rank knows of: a peer that died or fell silent, or an abort (its own or
/// one a peer sent), for the communicator's watchdog.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerFailure {
    /// The rank that failed, or was blamed by the rank that aborted (the aborting rank itself
    /// when it blamed nobody).
    pub rank: usize,
    /// What happened, as this rank learnt it.
    pub cause: String,
    /// The rank that sent the abort (this rank's own included); `None` for a peer that died or
    /// fell silent.
    pub from: Option<usize>,
}

pub(super) struct Shared {
    me: usize,
    state: Mutex<State>,
    arrived: Condvar,
}

impl Shared {
    pub(super) fn new(me: usize, world_size: usize) -> Shared {
        Shared {
            me,
            state: Mutex::new(State {
                queues: HashMap::new(),
                gone: (0..world_size).map(|_| None).collect(),
                aborted: None,
                last_heard: vec![Instant::now(); world_size],
            }),
            arrived: Condvar::new(),
        }
    }

    pub(super) fn deliver(&self, peer: usize, chan: Chan, data: Vec<u8>) {
        lock(&self.state)
            .queues
            .entry((peer, chan))
            .or_default()
            .push_back(data);
        self.arrived.notify_all();
    }

    pub(super) fn mark_gone(&self, peer: usize, died: bool, why: String, calls: Option<u64>) {
        let mut st = lock(&self.state);
        if let Some(slot) = st.gone.get_mut(peer) {
            if slot.is_none() {
                *slot = Some(Gone { died, why, calls });
            }
        }
        drop(st);
        self.arrived.notify_all();
    }

    /// Notes that `peer`'s link delivered a frame.
    pub(super) fn heard(&self, peer: usize) {
        if let Some(t) = lock(&self.state).last_heard.get_mut(peer) {
            *t = Instant::now();
        }
    }

    /// Marks every peer silent for longer than `silence` as dead (a frozen process or a cut
    /// network keeps its socket open), then returns the first failure known, if any: an abort
    /// first (it names the root cause), else the lowest dead peer. A peer that said goodbye has
    /// left, not failed.
    pub(super) fn failure(&self, silence: Option<Duration>) -> Option<PeerFailure> {
        let mut st = lock(&self.state);
        if let Some(silence) = silence {
            let now = Instant::now();
            for peer in 0..st.gone.len() {
                if peer == self.me || st.gone[peer].is_some() {
                    continue;
                }
                let quiet = now.saturating_duration_since(st.last_heard[peer]);
                if quiet > silence {
                    st.gone[peer] = Some(Gone {
                        died: true,
                        why: format!(
                            "sent nothing for {} (no heartbeat): the process is frozen or the \
                             network to it is down",
                            fmt_duration(quiet)
                        ),
                        calls: None,
                    });
                    self.arrived.notify_all();
                }
            }
        }
        if let Some(a) = &st.aborted {
            let cause = if a.from == self.me {
                a.why.clone()
            } else {
                format!("rank {} reported: {}", a.from, a.why)
            };
            return Some(PeerFailure {
                rank: a.blamed.unwrap_or(a.from),
                cause,
                from: Some(a.from),
            });
        }
        st.gone.iter().enumerate().find_map(|(peer, g)| match g {
            Some(g) if g.died => Some(PeerFailure {
                rank: peer,
                cause: g.why.clone(),
                from: None,
            }),
            _ => None,
        })
    }

    /// Every peer that died or fell silent (not one that left with a goodbye), with why.
    pub(super) fn died(&self) -> Vec<(usize, String)> {
        lock(&self.state)
            .gone
            .iter()
            .enumerate()
            .filter_map(|(peer, g)| match g {
                Some(g) if g.died => Some((peer, g.why.clone())),
                _ => None,
            })
            .collect()
    }

    /// Waits up to `timeout` for anything to change (a message, a gone peer, an abort).
    pub(super) fn wait_change(&self, timeout: Duration) {
        let st = lock(&self.state);
        let _ = self
            .arrived
            .wait_timeout(st, timeout)
            .unwrap_or_else(PoisonError::into_inner);
    }

    /// The collective calls `peer` had made when it left with a goodbye, if its goodbye said.
    pub(super) fn goodbye_calls(&self, peer: usize) -> Option<u64> {
        lock(&self.state)
            .gone
            .get(peer)
            .and_then(|g| g.as_ref().filter(|g| !g.died).and_then(|g| g.calls))
    }

    /// True once `peer` left with a goodbye (a clean departure, not a failure).
    pub(super) fn said_goodbye(&self, peer: usize) -> bool {
        lock(&self.state)
            .gone
            .get(peer)
            .is_some_and(|g| g.as_ref().is_some_and(|g| !g.died))
    }

    pub(super) fn gone_reason(&self, peer: usize) -> Option<String> {
        lock(&self.state)
            .gone
            .get(peer)
            .and_then(|g| g.as_ref().map(|g| g.why.clone()))
    }

    /// The abort recorded so far, if any: (blamed rank, reason as the aborting rank gave it,
    /// prefixed with who aborted).
    pub(super) fn abort_note(&self) -> Option<(Option<usize>, String)> {
        let st = lock(&self.state);
        st.aborted.as_ref().map(|a| {
            (
                a.blamed,
                format!("rank {} aborted the job: {}", a.from, a.why),
            )
        })
    }

    /// The failure to report when the job was aborted, if it was.
    pub(super) fn recorded_abort(&self) -> Option<Failure> {
        let st = lock(&self.state);
        st.aborted.as_ref().map(|a| self.abort_failure(a))
    }

    pub(super) fn set_aborted(&self, abort: Abort) {
        let mut st = lock(&self.state);
        if st.aborted.is_none() {
            st.aborted = Some(abort);
        }
        drop(st);
        self.arrived.notify_all();
    }

    fn abort_failure(&self, abort: &Abort) -> Failure {
        let why = if abort.from == self.me {
            format!("an earlier collective on this rank failed: {}", abort.why)
        } else {
            format!("rank {} aborted the job: {}", abort.from, abort.why)
        };
        Failure {
            blamed: abort.blamed,
            why,
            propagate: false,
        }
    }

    fn pop(st: &mut State, peer: usize, chan: Chan) -> Option<Vec<u8>> {
        let queue = st.queues.get_mut(&(peer, chan))?;
        let message = queue.pop_front();
        if queue.is_empty() {
            st.queues.remove(&(peer, chan));
        }
        message
    }

    /// Waits for one message; queued messages win over a gone peer or an abort. A shrink's
    /// message is awaited even after an abort (the abort is why the job shrinks).
    pub(super) fn take(
        &self,
        peer: usize,
        chan: Chan,
        deadline: Instant,
        timeout: Duration,
    ) -> std::result::Result<Vec<u8>, Failure> {
        let mut st = lock(&self.state);
        loop {
            if let Some(message) = Self::pop(&mut st, peer, chan) {
                return Ok(message);
            }
            if let (Some(abort), false) = (&st.aborted, matches!(chan, Chan::Shrink(_))) {
                return Err(self.abort_failure(abort));
            }
            if let Some(gone) = st.gone.get(peer).and_then(Option::as_ref) {
                return Err(Failure {
                    blamed: Some(peer),
                    why: gone.why.clone(),
                    propagate: false,
                });
            }
            let now = Instant::now();
            if now >= deadline {
                let what = match chan {
                    Chan::User(tag) => format!("message with tag {tag}"),
                    Chan::Gather(seq) => format!("all_gather contribution #{seq}"),
                    Chan::Shrink(_) => "shrink rendezvous port".to_string(),
                };
                return Err(Failure {
                    blamed: Some(peer),
                    why: format!("sent no {what} within {}", fmt_duration(timeout)),
                    propagate: false,
                });
            }
            st = self
                .arrived
                .wait_timeout(st, deadline - now)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }

    /// Fills every empty slot of `parts` with that rank's contribution to all_gather `seq`.
    pub(super) fn collect(
        &self,
        seq: u64,
        parts: &mut [Option<Vec<u8>>],
        deadline: Instant,
        timeout: Duration,
    ) -> std::result::Result<(), Failure> {
        let mut st = lock(&self.state);
        loop {
            let mut missing = Vec::new();
            for (peer, part) in parts.iter_mut().enumerate() {
                if part.is_none() {
                    *part = Self::pop(&mut st, peer, Chan::Gather(seq));
                    if part.is_none() {
                        missing.push(peer);
                    }
                }
            }
            if missing.is_empty() {
                return Ok(());
            }
            if let Some(abort) = &st.aborted {
                return Err(self.abort_failure(abort));
            }
            // A peer that died is the likelier cause than one that left cleanly (it may have left
            // because of the death), so name the dead one first.
            let gone = |died: bool| {
                missing.iter().find_map(|&p| match &st.gone[p] {
                    Some(g) if g.died == died => Some((p, g.why.clone())),
                    _ => None,
                })
            };
            if let Some((peer, why)) = gone(true).or_else(|| gone(false)) {
                return Err(Failure::peer(peer, why));
            }
            let now = Instant::now();
            if now >= deadline {
                let also = if missing.len() > 1 {
                    format!(" (missing too: ranks {})", fmt_ranks(&missing[1..]))
                } else {
                    String::new()
                };
                return Err(Failure::peer(
                    missing[0],
                    format!(
                        "sent no contribution to all_gather #{seq} within {}{also}",
                        fmt_duration(timeout)
                    ),
                ));
            }
            st = self
                .arrived
                .wait_timeout(st, deadline - now)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }
}

/// A link's reader thread: queues frames until the link ends, then records how it ended.
pub(super) fn read_link(shared: Arc<Shared>, peer: usize, mut stream: Receiver) {
    let mut calls = None;
    let (died, why) = loop {
        let frame = stream.recv();
        if frame.is_ok() {
            shared.heard(peer);
        }
        match frame {
            Ok((Kind::Heartbeat, ..)) => {}
            Ok((Kind::User, tag, data)) => shared.deliver(peer, Chan::User(tag), data),
            Ok((Kind::Gather, seq, data)) => shared.deliver(peer, Chan::Gather(seq), data),
            Ok((Kind::Shrink, generation, data)) => {
                shared.deliver(peer, Chan::Shrink(generation), data)
            }
            Ok((Kind::Abort, _, data)) => {
                let (blamed, why) = decode_abort(&data);
                shared.set_aborted(Abort {
                    from: peer,
                    blamed,
                    why,
                });
            }
            Ok((Kind::Goodbye, _, data)) => {
                // The payload, when there is one, is the collective calls it made (u64 LE).
                calls = <[u8; 8]>::try_from(data.as_slice())
                    .ok()
                    .map(u64::from_le_bytes);
                break (
                    false,
                    "closed its bootstrap (the process finished or dropped it)".to_string(),
                );
            }
            Ok((Kind::Table, ..)) => {
                break (
                    true,
                    "sent an address table after the rendezvous (protocol error)".to_string(),
                )
            }
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => {
                break (
                    true,
                    "connection closed without a goodbye: the process exited or crashed"
                        .to_string(),
                )
            }
            // A process that dies with unread bytes in its socket (a heartbeat, say) resets the
            // connection instead of closing it.
            Err(e) if e.kind() == io::ErrorKind::ConnectionReset => {
                break (
                    true,
                    "connection reset without a goodbye: the process exited or crashed".to_string(),
                )
            }
            Err(e) => break (true, format!("connection failed: {e}")),
        }
    };
    shared.mark_gone(peer, died, why, calls);
}
