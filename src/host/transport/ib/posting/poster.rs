//! How a host thread (the proxy) posts to a connected queue pair, in either of the two host
//! posting modes: building mlx5 WQEs itself on the QP's rings ([`HostPoster::Mlx5`], mlx5 NICs
//! and the emulated one), or handing work requests to the provider's `ibv_post_send` and
//! reaping `ibv_poll_cq` ([`HostPoster::Verbs`], any NIC rdma-core drives: EFA, Broadcom, Intel
//! and other RoCE NICs): post, ring, and positions that complete in order. `IbConnection` is
//! the proxy's link to a peer over one or more such queue pairs.

use crate::error::{Error, Result};
use crate::gpu::cuda::{Gpu, HostArray};
use crate::transport::ib::boundary::provider::{wc_status, SendWr, WorkCompletion};
use crate::transport::ib::posting::conn::ConnectedQp;
use crate::transport::ib::posting::host_qp::HostQp;
use crate::transport::ib::posting::wqe::Op;
use crate::transport::{Address, Connection, Token};
use cudarc::driver::{CudaSlice, DevicePtr};
use std::collections::VecDeque;
use std::sync::Arc;
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

/// How long a post waits for room in a send queue before the proxy gives up with an error.
const PATIENCE: Duration = Duration::from_secs(30);

/// A put of this many bytes or more is cut into one contiguous part per queue pair.
const STRIPE_FROM: u64 = 1 << 20;

/// A data segment carries less than 2 GiB: larger parts go as 1 GiB writes.
const PIECE: u64 = 1 << 30;

/// The proxy's link to a peer over connected queue pairs: a write becomes RDMA WRITEs, a signal an
/// 8-byte READ of the peer's token (the flush that makes the writes before it visible) then a
/// fetch-add of 1 on it, a flush the position reported once every WQE before it completed.
///
/// With several queue pairs (`DOORBELL_IB_QPS_PER_PEER`), a write of 1 MiB or more is cut into one
/// contiguous part (4 KiB multiples) per QP; a signal goes on the first QP once every other QP has
/// completed what it was given before the signal (RC QPs order only their own work): until then
/// it waits in `deferred`, and the proxy goes on with other triggers.
pub(crate) struct IbConnection {
    qps: Vec<HostPoster>,
    /// 16 bytes of device memory the NIC may write (READ and fetch-add results), and its key.
    scratch: u64,
    scratch_key: u32,
    _scratch: CudaSlice<u8>,
    flush_done: HostArray<u64>,
    /// Flushes waiting for the QPs: (position, what each QP must complete; `None` while signals
    /// before it are still deferred).
    pending: VecDeque<(u64, Option<Vec<u64>>)>,
    /// Signals waiting for the other QPs: (token, what each QP must complete first).
    deferred: VecDeque<(Token, Vec<u64>)>,
}

impl IbConnection {
    /// A connection over `qps` (at least one); `scratch` is 16 bytes of device memory registered
    /// with the QPs' NIC under `scratch_key`.
    pub(crate) fn new(
        gpu: &Arc<Gpu>,
        qps: Vec<HostPoster>,
        scratch: CudaSlice<u8>,
        scratch_key: u32,
    ) -> Result<IbConnection> {
        if qps.is_empty() {
            return Err(Error::invalid("ib", "a connection needs a queue pair"));
        }
        let addr = scratch.device_ptr(scratch.stream()).0;
        Ok(IbConnection {
            qps,
            scratch: addr,
            scratch_key,
            _scratch: scratch,
            flush_done: HostArray::new(gpu, 1)?,
            pending: VecDeque::new(),
            deferred: VecDeque::new(),
        })
    }

    /// Posts, in order, the deferred signals whose earlier writes completed on every other QP:
    /// each as a READ of the peer's token on QP 0 (the flush of QP 0's writes before it) then a
    /// fetch-add of 1. True if any was posted.
    fn post_ready_signals(&mut self) -> Result<bool> {
        let mut any = false;
        while let Some((token, ends)) = self.deferred.front() {
            let ready = self
                .qps
                .iter()
                .zip(ends)
                .skip(1)
                .all(|(q, &end)| q.completed() >= end);
            if !ready {
                break;
            }
            let (raddr, rkey) = (token.at.addr, Self::key(token.at, "token")?);
            let qp = &mut self.qps[0];
            qp.post(
                &Op::Read {
                    raddr,
                    rkey,
                    laddr: self.scratch,
                    lkey: self.scratch_key,
                    len: 8,
                },
                true,
                PATIENCE,
            )?;
            qp.post(
                &Op::FetchAdd {
                    raddr,
                    rkey,
                    add: 1,
                    result: self.scratch + 8,
                    lkey: self.scratch_key,
                },
                true,
                PATIENCE,
            )?;
            qp.ring()?;
            self.deferred.pop_front();
            any = true;
        }
        Ok(any)
    }

    /// A flush covers what was posted when it arrived, deferred signals included: it gets its
    /// marks (each QP's posting position) once the signals before it are posted.
    fn mark_flushes(&mut self) {
        if !self.deferred.is_empty() {
            return;
        }
        for (_, ends) in self.pending.iter_mut() {
            if ends.is_none() {
                *ends = Some(self.qps.iter().map(|q| q.posted()).collect());
            }
        }
    }

    fn key(a: Address, what: &str) -> Result<u32> {
        a.key.ok_or_else(|| {
            Error::invalid(
                "trigger",
                format!("the {what} memory is not registered with the RDMA NIC"),
            )
        })
    }
}

impl Connection for IbConnection {
    fn write(&mut self, src: Address, dst: Address, bytes: u64) -> Result<()> {
        let (lkey, rkey) = (Self::key(src, "source")?, Self::key(dst, "destination")?);
        let stripes = self.qps.len() as u64;
        let parts = if bytes >= STRIPE_FROM { stripes } else { 1 };
        let part = bytes.div_ceil(parts).next_multiple_of(4096);
        for q in 0..parts {
            let (start, end) = ((q * part).min(bytes), ((q + 1) * part).min(bytes));
            let mut off = start;
            while off < end {
                let len = (end - off).min(PIECE);
                let op = Op::Write {
                    raddr: dst.addr + off,
                    rkey,
                    laddr: src.addr + off,
                    lkey,
                    len: len as u32,
                };
                self.qps[q as usize].post(&op, true, PATIENCE)?;
                off += len;
            }
        }
        // The completions are the proxy's next `progress` call's job: a write only posts.
        for qp in self.qps.iter_mut() {
            qp.ring()?;
        }
        Ok(())
    }

    /// Posts the signal at once where no other QP holds earlier writes (one QP: always), else
    /// defers it to `progress`; polls no completion queue.
    fn signal(&mut self, token: Token) -> Result<()> {
        Self::key(token.at, "token")?;
        let ends: Vec<u64> = self.qps.iter().map(|q| q.posted()).collect();
        self.deferred.push_back((token, ends));
        self.post_ready_signals()?;
        self.mark_flushes();
        Ok(())
    }

    /// Queues the flush with what it waits for; `progress` reports it once that completed.
    fn flush(&mut self, pos: u64) -> Result<()> {
        self.pending.push_back((pos, None));
        self.mark_flushes();
        Ok(())
    }

    /// Polls the QPs; posts the deferred signals whose earlier writes completed on every other
    /// QP, in order; fixes what the flushes behind them wait for; reports completed flushes.
    fn progress(&mut self) -> Result<bool> {
        let mut any = false;
        for qp in self.qps.iter_mut() {
            if qp.completed() < qp.posted() {
                let before = qp.completed();
                any |= qp.poll()? != before;
            }
        }
        any |= self.post_ready_signals()?;
        self.mark_flushes();
        while let Some((pos, Some(ends))) = self.pending.front() {
            if self
                .qps
                .iter()
                .zip(ends)
                .any(|(q, &end)| q.completed() < end)
            {
                break;
            }
            self.flush_done.write(0, pos + 1);
            self.pending.pop_front();
            any = true;
        }
        Ok(any)
    }

    fn flush_word(&self) -> u64 {
        self.flush_done.device_ptr()
    }
}
