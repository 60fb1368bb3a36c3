//! A queue pair the CPU posts to, on the emulated NIC or a real mlx5 NIC: the poster side of the
//! proxy mode (a proxy thread turns PortChannel triggers into work requests). WQEs are built by
//! [`crate::transport::ib::posting::wqe`], the doorbell record and doorbell written as rdma-core's
//! `post_send` writes them, completions consumed with mlx5's ownership rule. One thread uses it at
//! a time.

use crate::error::{Error, Result};
use crate::transport::ib::boundary::provider::Rings;
use crate::transport::ib::emulated::nic::{EmulatedNic, QpRings};
use crate::transport::ib::posting::cq::{self, Cqe, CQE_BYTES, EMPTY_OP_OWN};
use crate::transport::ib::posting::wqe::{doorbell_record, wqebbs, Op, CQ_UPDATE, WQEBB};
use std::sync::atomic::{fence, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Host memory the NIC thread reads and writes while this side does too (accessed volatile).
struct Shared(Box<[u64]>);

impl Shared {
    fn new(bytes: usize) -> Shared {
        Shared(vec![0u64; bytes.div_ceil(8).max(1)].into_boxed_slice())
    }
    fn ptr(&self) -> *mut u8 {
        self.0.as_ptr() as *mut u8
    }
}

/// Who serves a [`HostQp`]'s rings.
enum Backing {
    /// The emulated NIC, reading buffers this value owns.
    Emulated {
        nic: Arc<EmulatedNic>,
        _buffers: [Shared; 5],
    },
    /// A queue pair of a verbs provider, which owns the rings and outlives this value.
    Provider,
}

/// A CPU-posted queue pair, served by an [`EmulatedNic`] ([`HostQp::new`]) or a real mlx5 NIC
/// or the rings of any provider's queue pair ([`HostQp::on_rings`]); the posting code is the same.
pub struct HostQp {
    backing: Backing,
    qpn: u32,
    depth: u64,
    cq_depth: u64,
    sq: *mut u8,
    dbr: *mut u32,
    doorbell: *mut u64,
    cq: *mut u8,
    cq_ci: *mut u32,
    /// WQEBBs posted.
    pi: u64,
    /// WQEBBs rung.
    rung: u64,
    /// CQEs consumed.
    polled: u64,
    /// WQEBBs known complete.
    completed: u64,
    /// WQEBBs of the signaled WQE starting at each slot.
    sizes: Vec<u8>,
}

// SAFETY: the rings are owned by the backing and only accessed through volatile operations by
// this side and the NIC.
unsafe impl Send for HostQp {}

impl HostQp {
    /// A QP numbered `qpn` with `2^sq_log2` WQEBBs (7..=15) and a CQ as deep, on `nic`.
    pub fn new(nic: &Arc<EmulatedNic>, qpn: u32, sq_log2: u32) -> Result<HostQp> {
        if !(7..=15).contains(&sq_log2) {
            return Err(Error::invalid(
                "send queue",
                format!("2^{sq_log2} WQEBBs: between 2^7 and 2^15"),
            ));
        }
        let depth = 1u64 << sq_log2;
        let buffers = [
            Shared::new(depth as usize * WQEBB),
            Shared::new(8),
            Shared::new(8),
            Shared::new(depth as usize * CQE_BYTES),
            Shared::new(8),
        ];
        let rings = QpRings {
            sq: buffers[0].ptr(),
            sq_wqebbs: depth,
            dbr: buffers[1].ptr() as *const u32,
            doorbell: buffers[2].ptr() as *const u64,
            cq: buffers[3].ptr(),
            cq_entries: depth,
            cq_ci: buffers[4].ptr() as *const u32,
            ring_dma: None,
        };
        for i in 0..depth as usize {
            // SAFETY: inside the CQ, before the NIC knows it.
            unsafe {
                rings
                    .cq
                    .add(i * CQE_BYTES + 63)
                    .write_volatile(EMPTY_OP_OWN)
            };
        }
        // SAFETY: the buffers live in the returned value, whose Drop removes the QP first.
        unsafe { nic.add_qp(qpn, rings.clone(), None) }?;
        Ok(HostQp::with(
            Backing::Emulated {
                nic: nic.clone(),
                _buffers: buffers,
            },
            Rings {
                qpn,
                sq: rings.sq,
                sq_wqebbs: depth,
                dbr: rings.dbr as *mut u32,
                doorbell: rings.doorbell as *mut u64,
                doorbell_is_mmio: false,
                cq: rings.cq,
                cq_entries: depth,
                cq_ci: rings.cq_ci as *mut u32,
            },
        ))
    }

    /// Posts to the rings of a provider's queue pair (see
    /// [`crate::transport::ib::boundary::provider::Provider::rings`]).
    ///
    /// # Safety
    /// The rings stay valid while this value lives, and nothing else posts to them.
    pub unsafe fn on_rings(r: &crate::transport::ib::boundary::provider::Rings) -> HostQp {
        HostQp::with(Backing::Provider, *r)
    }

    fn with(backing: Backing, r: Rings) -> HostQp {
        HostQp {
            backing,
            qpn: r.qpn,
            depth: r.sq_wqebbs,
            cq_depth: r.cq_entries,
            sq: r.sq,
            dbr: r.dbr,
            doorbell: r.doorbell,
            cq: r.cq,
            cq_ci: r.cq_ci,
            pi: 0,
            rung: 0,
            polled: 0,
            completed: 0,
            sizes: vec![0; r.sq_wqebbs as usize],
        }
    }

    /// Its QP number.
    pub fn qpn(&self) -> u32 {
        self.qpn
    }

    /// WQEBBs posted so far (the index the next WQE starts at).
    pub fn posted(&self) -> u64 {
        self.pi
    }

    /// WQEBBs known complete.
    pub fn completed(&self) -> u64 {
        self.completed
    }

    /// Writes `op` (not yet rung), waiting up to `timeout` for room; returns its index. A
    /// signaled WQE completes every WQE before it when its CQE arrives.
    pub fn post(&mut self, op: &Op, signaled: bool, timeout: Duration) -> Result<u64> {
        let w = op.encode(
            self.pi as u16,
            self.qpn,
            if signaled { CQ_UPDATE } else { 0 },
        )?;
        let n = wqebbs(w.len());
        if self.pi + n > self.completed + self.depth {
            // Room comes from completions: everything posted must be rung to complete.
            self.ring();
            let start = Instant::now();
            while self.pi + n > self.completed + self.depth {
                self.poll()?;
                if start.elapsed() > timeout {
                    return Err(Error::invalid(
                        "queue pair",
                        format!(
                            "QP {:#x}: no room in {timeout:?} (the NIC completes nothing)",
                            self.qpn
                        ),
                    ));
                }
                std::thread::yield_now();
            }
        }
        let at = self.pi;
        for (i, block) in w.chunks(WQEBB).enumerate() {
            let slot = ((at + i as u64) & (self.depth - 1)) as usize * WQEBB;
            // SAFETY: the slot lies in the send queue; the NIC reads it only after the doorbell.
            unsafe { std::ptr::copy(block.as_ptr(), self.sq.add(slot), block.len()) };
        }
        if signaled {
            self.sizes[(at & (self.depth - 1)) as usize] = n as u8;
        }
        self.pi += n;
        Ok(at)
    }

    /// The doorbell record, then the doorbell, for everything posted.
    pub fn ring(&mut self) {
        if self.rung == self.pi {
            return;
        }
        fence(Ordering::Release);
        // SAFETY: aligned words of this QP's record and doorbell.
        unsafe {
            std::ptr::write_volatile(self.dbr as *mut [u8; 4], doorbell_record(self.pi));
            fence(Ordering::SeqCst);
            let mut db = [0u8; 8];
            db[0..4].copy_from_slice(&(((self.pi & 0xffff) as u32) << 8).to_be_bytes());
            db[4..8].copy_from_slice(&(self.qpn << 8).to_be_bytes());
            std::ptr::write_volatile(self.doorbell, u64::from_ne_bytes(db));
        }
        // A real doorbell page is write-combined: flush it (rdma-core's mmio_flush_writes).
        fence(Ordering::SeqCst);
        self.rung = self.pi;
    }

    /// Consumes the CQEs that arrived; returns the WQEBBs known complete. An error CQE is an
    /// error naming the WQE and the mlx5 syndrome.
    pub fn poll(&mut self) -> Result<u64> {
        let mut failed = None;
        self.poll_each(|start, c| {
            if c.is_error() && failed.is_none() {
                failed = Some((start, *c));
            }
            !c.is_error()
        });
        if let Some((start, c)) = failed {
            return Err(Error::TransportUnavailable {
                transport: "ib",
                why: format!(
                    "QP {:#x}: work request at index {start} (opcode {:#x}) failed with mlx5 syndrome {:#x}",
                    self.qpn, c.wqe_opcode, c.syndrome
                ),
            });
        }
        Ok(self.completed)
    }

    /// Consumes the CQEs that arrived, calling `f(index of the completed WQE, CQE)` for each
    /// (errors included) until it returns false; returns the WQEBBs known complete.
    pub fn poll_each(&mut self, mut f: impl FnMut(u64, &Cqe) -> bool) -> u64 {
        loop {
            let at = (self.polled & (self.cq_depth - 1)) as usize * CQE_BYTES;
            // SAFETY: an aligned word inside the CQ; the NIC writes it last.
            let tail = unsafe { std::ptr::read_volatile(self.cq.add(at + 56) as *const u64) }
                .to_ne_bytes();
            if !cq::is_ready(tail[7], self.polled, self.cq_depth) {
                break;
            }
            fence(Ordering::Acquire);
            let mut b = [0u8; CQE_BYTES];
            // SAFETY: inside the CQ; complete once op_own says so.
            unsafe { std::ptr::copy(self.cq.add(at), b.as_mut_ptr(), 56) };
            b[56..].copy_from_slice(&tail);
            let c = Cqe::decode(&b);
            self.polled += 1;
            // SAFETY: the CQ's consumer-index record.
            unsafe {
                std::ptr::write_volatile(self.cq_ci, ((self.polled & 0xff_ffff) as u32).to_be())
            };
            let start =
                self.completed + u64::from(c.wqe_counter.wrapping_sub(self.completed as u16));
            if c.is_error() {
                f(start, &c);
                return self.completed;
            }
            self.completed = start + u64::from(self.sizes[(start & (self.depth - 1)) as usize]);
            if !f(start, &c) {
                break;
            }
        }
        self.completed
    }
}

impl Drop for HostQp {
    fn drop(&mut self) {
        if let Backing::Emulated { nic, .. } = &self.backing {
            nic.remove_qp(self.qpn);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::ib::emulated::nic::{Delivery, HostDma};

    #[test]
    fn posts_wraps_and_reports_errors() {
        let (src, dst) = (Shared::new(4096), Shared::new(4096));
        // SAFETY: in bounds; before the NIC exists.
        unsafe { std::ptr::write_bytes(src.ptr(), 7, 4096) };
        let (sp, dp) = (src.ptr() as u64, dst.ptr() as u64);
        // SAFETY: both buffers outlive the NIC (declared before it).
        let nic = Arc::new(
            EmulatedNic::start(Box::new(unsafe { HostDma::new() }), Delivery::Strict).unwrap(),
        );
        let ks = nic.register(sp, 4096, false).unwrap();
        let kd = nic.register(dp, 4096, false).unwrap();
        let mut qp = HostQp::new(&nic, 5, 7).unwrap();
        let t = Duration::from_secs(10);
        // 1000 unsignaled writes, one signaled every 64: the queue (128 WQEBBs) wraps 7 times.
        for i in 0..1000u64 {
            let op = Op::Write {
                raddr: dp + (i % 64) * 64,
                rkey: kd,
                laddr: sp,
                lkey: ks,
                len: 64,
            };
            qp.post(&op, i % 64 == 63, t).unwrap();
        }
        let last = qp.post(&Op::Nop, true, t).unwrap();
        qp.ring();
        let start = Instant::now();
        while qp.poll().unwrap() <= last {
            assert!(start.elapsed() < t, "no completion");
        }
        assert_eq!(qp.completed(), qp.posted());
        // SAFETY: the NIC has finished writing (its completions are in).
        assert!(
            unsafe { std::ptr::read_volatile(dst.ptr() as *const [u8; 4096]) }
                .iter()
                .all(|&b| b == 7)
        );
        qp.post(
            &Op::Write {
                raddr: 1,
                rkey: kd,
                laddr: sp,
                lkey: ks,
                len: 8,
            },
            true,
            t,
        )
        .unwrap();
        qp.ring();
        let start = Instant::now();
        let err = loop {
            match qp.poll() {
                Err(e) => break e,
                Ok(_) => assert!(start.elapsed() < t, "no error completion"),
            }
        };
        assert!(err.to_string().contains("syndrome 0x13"), "{err}");
    }
}
