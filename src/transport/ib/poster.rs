//! How a host thread (the proxy) posts to a connected queue pair, in either of the two host
//! posting modes: building mlx5 WQEs itself on the QP's rings ([`HostPoster::Mlx5`], mlx5 NICs
//! and the emulated one), or handing work requests to the provider's `ibv_post_send` and
//! reaping `ibv_poll_cq` ([`HostPoster::Verbs`], any NIC rdma-core drives: EFA, Broadcom, Intel
//! and other RoCE NICs). The proxy sees one interface: post, ring, and positions that complete in
//! order.

use super::conn::ConnectedQp;
use super::host_qp::HostQp;
use super::provider::{wc_status, SendWr, WorkCompletion};
use super::wqe::Op;
use crate::error::{Error, Result};
use std::time::{Duration, Instant};

/// A host-side poster of one connected queue pair.
pub enum HostPoster {
    /// mlx5 WQEs written by this thread on the QP's rings (dropped before the QP).
    Mlx5 {
        /// The poster.
        poster: HostQp,
        /// The QP whose rings it writes.
        qp: ConnectedQp,
    },
    /// `ibv_post_send` / `ibv_poll_cq`.
    Verbs(VerbsPoster),
}

/// Work requests batched until [`HostPoster::ring`], completions counted in posting order.
pub struct VerbsPoster {
    qp: ConnectedQp,
    batch: Vec<SendWr>,
    /// Work requests handed to the provider, and known complete.
    posted: u64,
    completed: u64,
    /// At most this many outstanding (the send queue's work requests).
    depth: u64,
    wcs: Vec<WorkCompletion>,
}

impl HostPoster {
    /// mlx5 WQEs on `qp`'s rings.
    pub fn mlx5(qp: ConnectedQp) -> Result<HostPoster> {
        let rings = qp.rings()?;
        // SAFETY: the rings belong to `qp`, kept in the same value and dropped after the poster;
        // nothing else posts to them.
        let poster = unsafe { HostQp::on_rings(&rings) };
        Ok(HostPoster::Mlx5 { poster, qp })
    }

    /// `ibv_post_send` on `qp`, at most `depth` work requests outstanding.
    pub fn verbs(qp: ConnectedQp, depth: u32) -> HostPoster {
        HostPoster::Verbs(VerbsPoster {
            qp,
            batch: Vec::new(),
            posted: 0,
            completed: 0,
            depth: u64::from(depth.max(1)),
            wcs: Vec::new(),
        })
    }

    /// The QP number.
    pub fn qpn(&self) -> u32 {
        match self {
            HostPoster::Mlx5 { qp, .. } => qp.qpn(),
            HostPoster::Verbs(v) => v.qp.qpn(),
        }
    }

    /// Queues `op` (not yet rung), waiting up to `patience` for room. Every op the proxy posts
    /// is signaled with the mlx5 poster when `signaled`; the verbs poster signals every one (its
    /// positions count work requests).
    pub fn post(&mut self, op: &Op, signaled: bool, patience: Duration) -> Result<()> {
        match self {
            HostPoster::Mlx5 { poster, .. } => poster.post(op, signaled, patience).map(|_| ()),
            HostPoster::Verbs(v) => {
                let start = Instant::now();
                while v.posted + v.batch.len() as u64 + 1 > v.completed + v.depth {
                    v.flush_batch()?;
                    v.reap()?;
                    if start.elapsed() > patience {
                        return Err(Error::invalid(
                            "queue pair",
                            format!(
                                "QP {:#x}: no room in {patience:?} (the NIC completes nothing)",
                                v.qp.qpn()
                            ),
                        ));
                    }
                    std::thread::yield_now();
                }
                let wr_id = v.posted + v.batch.len() as u64;
                v.batch.push(SendWr {
                    wr_id,
                    op: op.clone(),
                    signaled: true,
                });
                Ok(())
            }
        }
    }

    /// Hands everything queued to the NIC.
    pub fn ring(&mut self) -> Result<()> {
        match self {
            HostPoster::Mlx5 { poster, .. } => {
                poster.ring();
                Ok(())
            }
            HostPoster::Verbs(v) => v.flush_batch(),
        }
    }

    /// The position after everything posted (WQEBBs or work requests).
    pub fn posted(&self) -> u64 {
        match self {
            HostPoster::Mlx5 { poster, .. } => poster.posted(),
            HostPoster::Verbs(v) => v.posted + v.batch.len() as u64,
        }
    }

    /// The position before which everything completed.
    pub fn completed(&self) -> u64 {
        match self {
            HostPoster::Mlx5 { poster, .. } => poster.completed(),
            HostPoster::Verbs(v) => v.completed,
        }
    }

    /// Consumes completions; returns [`HostPoster::completed`]. An error completion is an error
    /// naming the QP, the work request and the status.
    pub fn poll(&mut self) -> Result<u64> {
        match self {
            HostPoster::Mlx5 { poster, .. } => poster.poll(),
            HostPoster::Verbs(v) => {
                v.reap()?;
                Ok(v.completed)
            }
        }
    }
}

impl VerbsPoster {
    fn flush_batch(&mut self) -> Result<()> {
        if self.batch.is_empty() {
            return Ok(());
        }
        self.qp.post_send(&self.batch)?;
        self.posted += self.batch.len() as u64;
        self.batch.clear();
        Ok(())
    }

    fn reap(&mut self) -> Result<()> {
        self.wcs.clear();
        let n = self.qp.poll_cq(64, &mut self.wcs)?;
        for wc in &self.wcs[..n] {
            if wc.status != wc_status::SUCCESS {
                return Err(Error::TransportUnavailable {
                    transport: "ib",
                    why: format!(
                        "QP {:#x}: work request {} failed: {} (status {}, vendor error {:#x})",
                        wc.qpn,
                        wc.wr_id,
                        wc_status::name(wc.status),
                        wc.status,
                        wc.vendor_err
                    ),
                });
            }
            // Completions arrive in posting order on an RC QP.
            self.completed = self.completed.max(wc.wr_id + 1);
        }
        Ok(())
    }
}
