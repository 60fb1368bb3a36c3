//! The communicator's watchdog: one thread per communicator that turns what the bootstrap learns
//! about peers into the communicator's abort word, and tells the peers about this rank's own
//! device failures.
//!
//! It sets the abort word (through [`WaitDiagnostics::abort`]) when the bootstrap reports a peer
//! whose connection closed without a goodbye, a peer silent past the heartbeat timeout, or an abort
//! a peer sent (a relayed failure, or that peer's `Communicator::abort`). It relays, once, this
//! rank's own device report (a wait that gave up, an error completion, a stopped proxy, a call
//! mismatch) as a bootstrap abort naming the rank it blames, so the other ranks' waits leave and
//! their calls name the cause, within milliseconds instead of at their own budgets.
//!
//! It never touches the GPU (no CUDA call: it cannot disturb a stream capture) and never blocks
//! for longer than one poll period.

use crate::error::Error;
use crate::host::bootstrap::Bootstrap;
use crate::host::wait::{Fault, WaitDiagnostics};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

/// How often the watchdog looks at the device report (the bootstrap wakes it at once for peers).
const POLL: Duration = Duration::from_millis(10);

/// A running watchdog; dropping it stops the thread.
pub(crate) struct Watchdog {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Watchdog {
    pub(crate) fn start(
        bootstrap: Arc<Bootstrap>,
        diagnostics: Arc<WaitDiagnostics>,
    ) -> crate::Result<Watchdog> {
        let stop = Arc::new(AtomicBool::new(false));
        let stop2 = stop.clone();
        let me = bootstrap.rank();
        let thread = std::thread::Builder::new()
            .name(format!("doorbell-wd{me}"))
            .spawn(move || watch(&bootstrap, &diagnostics, &stop2))
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

fn watch(bootstrap: &Bootstrap, diagnostics: &WaitDiagnostics, stop: &AtomicBool) {
    let me = bootstrap.rank();
    let mut relayed = false;
    while !stop.load(Ordering::Relaxed) {
        relay_own(bootstrap, diagnostics, &mut relayed);
        // A peer's failure (or this rank's own bootstrap abort): abort the device waits.
        if let Some(f) = bootstrap.health() {
            let own_relay = relayed && f.from == Some(me);
            if !own_relay
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
    relay_own(bootstrap, diagnostics, &mut relayed);
}

/// Relays this rank's own device failure once, blaming the rank it names.
fn relay_own(bootstrap: &Bootstrap, diagnostics: &WaitDiagnostics, relayed: &mut bool) {
    if *relayed || !diagnostics.aborted() {
        return;
    }
    let me = bootstrap.rank();
    let own = diagnostics
        .mismatch()
        .or_else(|| diagnostics.timeout())
        .map(|e| (blamed(&e, me), e));
    if let Some((rank, e)) = own {
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
