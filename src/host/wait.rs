//! Host side of bounded device waits (see `cuda/include/doorbell/wait.cuh` for the protocol).
//!
//! Each process has one [`WaitDiagnostics`]: the host-mapped [`WaitReport`] the first giving-up
//! waiter fills, the device-memory claim word that elects it, and the budget every wait gets.
//! Handles that can wait carry a [`WaitSite`] built here. When a CUDA call fails after a device
//! wait gave up (the waiter traps, so the launch fails), [`WaitDiagnostics::explain`] turns the
//! failure into [`Error::Timeout`] with the waiter's fields.

use crate::device_api::{WaitReport, WaitSite};
use crate::error::{Error, Result, WaitKind};
use crate::host::cuda::{Gpu, HostArray};
use std::sync::Arc;
use std::time::Duration;

/// The process's wait report and budget.
pub struct WaitDiagnostics {
    report: HostArray<WaitReport>,
    claim: u64,
    budget: Duration,
    rank: i32,
}

impl WaitDiagnostics {
    /// `claim` is the device address of a zeroed u32 in device memory that nothing else uses.
    pub(crate) fn new(gpu: &Arc<Gpu>, claim: u64, budget: Duration, rank: usize) -> Result<Self> {
        Ok(WaitDiagnostics {
            report: HostArray::new(gpu, 1)?,
            claim,
            budget,
            rank: rank as i32,
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

    /// The recorded device timeout, if a wait of this process gave up.
    pub fn timeout(&self) -> Option<Error> {
        let r = self.report.read(0);
        if r.valid != 1 {
            return None;
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

    /// The error to report for a failed CUDA call: the device timeout when a wait gave up
    /// (that is why the call failed), the call's own error otherwise.
    pub fn explain(&self, e: Error) -> Error {
        self.timeout().unwrap_or(e)
    }

    /// `Err(timeout)` if a wait gave up, else `Ok`.
    pub fn check(&self) -> Result<()> {
        match self.timeout() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}
