//! The communicator's watchdog: one thread per communicator that turns what the bootstrap learns
//! about peers into the communicator's abort word, and tells the peers about this rank's own
//! device failures.
//!
//! It sets the abort word (through [`WaitDiagnostics::abort`]) when the bootstrap reports a peer
//! whose connection closed without a goodbye, a peer silent past the heartbeat timeout, or an abort
//! a peer sent (a relayed failure, or that peer's `Communicator::abort`). It relays, once, this
//! rank's own device report (a wait that gave up, an error completion, a stopped proxy, a call
//! mismatch) as a bootstrap abort naming the rank it blames, so the other ranks' waits leave and
//! their calls name the cause, within milliseconds instead of at their own budgets. A stopped
//! proxy under a kernel usually follows from a peer's failure (its transport closed): that report
//! is held back for `CONSEQUENCE_HOLD` and dropped when a peer's failure arrives meanwhile.
//!
//! Peers on this host are also watched through `/proc`: a process that is killed starts exiting at
//! once, but its sockets close only at the end of its exit, after the driver has torn down its GPU
//! context (measured: up to 1.9 s for a rank killed in the middle of a kernel on a shared GPU). A
//! peer seen exiting that has not said goodbye 100 ms later has failed.
//!
//! It never touches the GPU (no CUDA call: it cannot disturb a stream capture) and never blocks
//! for longer than one poll period.

use crate::error::{Error, Result};
use crate::gpu::wait::{is_consequence, Fault, WaitDiagnostics};
use crate::job::bootstrap::Bootstrap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

/// How often the watchdog looks at the device report and at same-host peers' processes (the
/// bootstrap wakes it at once for peers' messages and closed links).
const POLL: Duration = Duration::from_millis(10);
/// How long a same-host peer may be seen exiting before its goodbye arrives (a clean exit says
/// goodbye before its process starts exiting; this covers the reader thread's delay).
const GOODBYE_GRACE: Duration = Duration::from_millis(100);
/// How long this rank holds back a device report that only follows from another failure (its
/// proxy stopped because a peer's transport closed): the peer that found the cause relays it
/// within milliseconds, and a consequence relayed first would be what every rank names.
const CONSEQUENCE_HOLD: Duration = Duration::from_millis(500);

/// A process on this host: its pid and its start time (clock ticks after boot, field 22 of
/// `/proc/PID/stat`), which tell a reused pid apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProcessId {
    /// The pid, in this process's pid namespace.
    pub pid: u32,
    /// Its start time.
    pub start: u64,
}

impl ProcessId {
    /// This process, if `/proc` can tell.
    pub fn current() -> Option<ProcessId> {
        let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
        let (_, _, start) = parse_stat(&stat)?;
        Some(ProcessId {
            pid: std::process::id(),
            start,
        })
    }

    /// This process's pid namespace and boot: two processes whose keys are equal can see each
    /// other's pids.
    pub fn namespace_key() -> Option<String> {
        let ns = std::fs::read_link("/proc/self/ns/pid").ok()?;
        let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").ok()?;
        Some(format!("{}|{}", ns.display(), boot.trim()))
    }

    /// Why this process is going, if it is: gone, a zombie, exiting, or a new process on its pid.
    fn going(&self) -> Option<String> {
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{}/stat", self.pid)) else {
            return Some(format!("its process (pid {}) is gone", self.pid));
        };
        let (state, flags, start) = parse_stat(&stat)?;
        if start != self.start {
            return Some(format!("its process (pid {}) is gone", self.pid));
        }
        // PF_EXITING: set at the start of the kernel's exit path (a SIGKILL sets it at once).
        if matches!(state, 'Z' | 'X' | 'x') || flags & 0x4 != 0 {
            return Some(format!(
                "its process (pid {}) is exiting without a goodbye: killed or crashed",
                self.pid
            ));
        }
        None
    }
}

/// (state, flags, start time) from a `/proc/PID/stat` line; the command name may hold spaces
/// and parentheses, so fields are counted from the last ')'.
fn parse_stat(stat: &str) -> Option<(char, u64, u64)> {
    let rest = &stat[stat.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // rest starts at field 3 (state); flags is field 9, start time field 22.
    let state = fields.first()?.chars().next()?;
    let flags = fields.get(6)?.parse().ok()?;
    let start = fields.get(19)?.parse().ok()?;
    Some((state, flags, start))
}

/// A running watchdog; dropping it stops the thread.
pub(crate) struct Watchdog {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Watchdog {
    /// `local`: the peers whose processes this one can see (same host and pid namespace).
    pub(crate) fn start(
        bootstrap: Arc<Bootstrap>,
        diagnostics: Arc<WaitDiagnostics>,
        local: Vec<(usize, ProcessId)>,
    ) -> crate::Result<Watchdog> {
        let stop = Arc::new(AtomicBool::new(false));
        let stop2 = stop.clone();
        let me = bootstrap.rank();
        let thread = std::thread::Builder::new()
            .name(format!("doorbell-wd{me}"))
            .spawn(move || watch(&bootstrap, &diagnostics, &local, &stop2))
            .map_err(|e| Error::io("starting the communicator's watchdog thread", e))?;
        Ok(Watchdog {
            stop,
            thread: Some(thread),
        })
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn watch(
    bootstrap: &Bootstrap,
    diagnostics: &WaitDiagnostics,
    local: &[(usize, ProcessId)],
    stop: &AtomicBool,
) {
    let me = bootstrap.rank();
    let mut relayed = false;
    let mut held = None;
    let mut going_since: Vec<Option<std::time::Instant>> = vec![None; local.len()];
    while !stop.load(Ordering::Relaxed) {
        relay_own(bootstrap, diagnostics, &mut relayed, &mut held, false);
        for ((rank, process), since) in local.iter().zip(going_since.iter_mut()) {
            if bootstrap.said_goodbye(*rank) {
                continue;
            }
            match process.going() {
                None => *since = None,
                Some(why) => {
                    let t0 = *since.get_or_insert_with(std::time::Instant::now);
                    if t0.elapsed() >= GOODBYE_GRACE {
                        bootstrap.mark_failed(*rank, why);
                    }
                }
            }
        }
        // A peer that left cleanly after fewer collective calls than this rank made: the calls
        // past its count wait for it in vain; end them now instead of at their budget.
        let made = bootstrap.call_counter().load(Ordering::Relaxed);
        for peer in (0..bootstrap.world_size()).filter(|&p| p != me) {
            if let Some(cause) = left_early(me, made, bootstrap.goodbye_calls(peer)) {
                // While peer loss is tolerated, a peer gone early is left out like a dead one.
                if diagnostics.tolerates_peer_loss() {
                    if diagnostics.mark_dead(Fault { rank: peer, cause }) {
                        tracing::warn!("rank {me}: rank {peer} left early; left out by masks");
                    }
                } else if diagnostics.abort(Fault { rank: peer, cause }) {
                    tracing::error!("rank {me}: rank {peer} left the communicator early");
                }
            }
        }
        // A peer's failure (or this rank's own bootstrap abort): abort the device waits. While
        // peer loss is tolerated (a MoE low-latency exchange with a rank mask), a peer that died
        // or fell silent is marked instead: the exchange leaves it out, every other wait for it
        // still fails the communicator (core/wait.cuh).
        if let Some(f) = bootstrap.health() {
            let own_relay = relayed && f.from == Some(me);
            if f.from.is_none() && diagnostics.tolerates_peer_loss() {
                for (peer, cause) in bootstrap.dead_peers() {
                    if diagnostics.mark_dead(Fault {
                        rank: peer,
                        cause: cause.clone(),
                    }) {
                        tracing::warn!(
                            "rank {me}: rank {peer} failed ({cause}); left out by masks"
                        );
                    }
                }
            } else if !own_relay
                && diagnostics.abort(Fault {
                    rank: f.rank,
                    cause: f.cause.clone(),
                })
            {
                tracing::error!("rank {me}: rank {} failed: {}", f.rank, f.cause);
            }
        }
        bootstrap.wait_for_change(POLL);
    }
    // The communicator is going: a failure its rank returned a moment ago (before the last poll)
    // must still reach the others, or they would take this rank's departure for a clean goodbye.
    relay_own(bootstrap, diagnostics, &mut relayed, &mut held, true);
}

/// Why a peer that left cleanly after `theirs` collective calls fails this rank, which made
/// `made`: only when it made fewer (a peer that finished its calls and left is no failure).
fn left_early(me: usize, made: u64, theirs: Option<u64>) -> Option<String> {
    let theirs = theirs?;
    (theirs < made).then(|| {
        format!(
            "it left the communicator cleanly (dropped it or exited) after {theirs} collective \
             calls, while rank {me} made {made}: rank {me}'s calls past {theirs} wait for it in vain"
        )
    })
}

/// Relays this rank's own device failure once, blaming the rank it names. A consequence (see
/// [`CONSEQUENCE_HOLD`]) waits until the hold has passed and no peer's failure has arrived, unless
/// `now` (the communicator is going).
fn relay_own(
    bootstrap: &Bootstrap,
    diagnostics: &WaitDiagnostics,
    relayed: &mut bool,
    held: &mut Option<std::time::Instant>,
    now: bool,
) {
    if *relayed || !diagnostics.aborted() {
        return;
    }
    let me = bootstrap.rank();
    let own = diagnostics
        .mismatch()
        .or_else(|| diagnostics.timeout())
        .map(|e| (blamed(&e, me), e));
    if let Some((rank, e)) = own {
        if !now && is_consequence(&e) {
            if bootstrap.health().is_some() {
                // The cause came from a peer: every rank has it; this report adds nothing.
                *relayed = true;
                return;
            }
            if held.get_or_insert_with(std::time::Instant::now).elapsed() < CONSEQUENCE_HOLD {
                return;
            }
        }
        tracing::error!("rank {me}: {e}; telling the other ranks");
        bootstrap.abort(Some(rank), &e.to_string());
        *relayed = true;
    }
}

/// The rank a device report blames: the peer it waited for or found making another call, else
/// this rank.
fn blamed(e: &Error, me: usize) -> usize {
    match e {
        Error::Timeout { peer, .. } if *peer >= 0 => *peer as usize,
        Error::ArgumentMismatch { peer, .. } => *peer,
        _ => me,
    }
}

/// The peers whose processes this one can see (same pid namespace on the same boot), with their
/// process ids, for the watchdog to notice a killed peer before its sockets close (collective:
/// every rank trades its id).
pub(crate) fn visible_peers(bootstrap: &Bootstrap) -> Result<Vec<(usize, ProcessId)>> {
    let rank = bootstrap.rank();
    let me = ProcessId::current();
    let key = ProcessId::namespace_key().unwrap_or_default();
    let mut ident = me.map_or(vec![0u8; 12], |p| {
        let mut v = p.pid.to_le_bytes().to_vec();
        v.extend_from_slice(&p.start.to_le_bytes());
        v
    });
    ident.extend_from_slice(key.as_bytes());
    let idents = bootstrap.all_gather(&ident)?;
    Ok(idents
        .iter()
        .enumerate()
        .filter(|(r, b)| {
            *r != rank && me.is_some() && !key.is_empty() && b.get(12..) == Some(key.as_bytes())
        })
        .filter_map(|(r, b)| {
            Some((
                r,
                ProcessId {
                    pid: u32::from_le_bytes(b.get(0..4)?.try_into().ok()?),
                    start: u64::from_le_bytes(b.get(4..12)?.try_into().ok()?),
                },
            ))
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_peer_that_left_after_fewer_calls_fails_this_rank_with_both_counts() {
        let why = left_early(1, 5, Some(4)).unwrap();
        assert!(
            why.contains("after 4 collective calls, while rank 1 made 5"),
            "{why}"
        );
        assert_eq!(left_early(1, 4, Some(4)), None);
        assert_eq!(left_early(1, 3, Some(4)), None);
        assert_eq!(left_early(1, 9, None), None);
    }

    #[test]
    fn stat_lines_parse_even_with_odd_command_names() {
        let line =
            "4242 (a (b) c) S 1 4242 4242 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 3 0 987654 1000 10";
        assert_eq!(parse_stat(line), Some(('S', 4194560, 987654)));
        assert_eq!(parse_stat("garbage"), None);
    }

    #[test]
    fn a_live_process_is_not_going_and_a_killed_one_is() {
        let me = ProcessId::current().expect("/proc");
        assert_eq!(me.going(), None);
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let stat = std::fs::read_to_string(format!("/proc/{}/stat", child.id())).unwrap();
        let start = parse_stat(&stat).unwrap().2;
        let peer = ProcessId {
            pid: child.id(),
            start,
        };
        assert_eq!(peer.going(), None);
        child.kill().unwrap();
        let _ = child.wait();
        let why = peer.going().expect("a reaped child is gone");
        assert!(why.contains("is gone"), "{why}");
        let reused = ProcessId {
            pid: me.pid,
            start: me.start + 1,
        };
        assert!(reused.going().is_some());
    }
}
