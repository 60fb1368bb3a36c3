//! The emulated provider: the verbs calls of [`crate::transport::ib::boundary::provider::Provider`]
//! answered by the emulated mlx5 NIC ([`crate::transport::ib::emulated::nic`]), refusing what a
//! ConnectX refuses:
//!
//! - `ibv_modify_qp` out of order (RESET -> INIT -> RTR -> RTS; any state -> RESET or ERR), or
//!   without the attributes the transition needs (the error lists the missing `IBV_QP_*`), a path
//!   MTU above the port's, no GRH on a RoCE port, a GID index past the table, more outstanding
//!   READs/atomics than the device allows (16);
//! - `ibv_post_send` on a QP that is not in RTS;
//! - work requests towards a far end that is not connected back to this QP, or whose GID or path
//!   MTU does not match this end's view: they fail with "transport retry counter exceeded", as a
//!   ConnectX whose packets go unanswered does;
//! - a WRITE, READ or atomic on a region registered without `IBV_ACCESS_REMOTE_WRITE`, `_READ` or
//!   `_ATOMIC` (or towards a QP that did not grant it at INIT): remote access error;
//! - more READs/atomics outstanding than the responder's `max_dest_rd_atomic`: remote invalid
//!   request.
//!
//! Both ends of a connection are often in different processes (ranks), so what one end needs to
//! know of the other travels through the *fabric*: a directory of small records (one per QP and
//! per registered region) that every emulated NIC of the job on this host reads and writes. A NIC
//! reaches a peer's memory through that memory's CUDA IPC mapping ([`Provider::attach_remote`]).

mod fabric;
pub mod nic;

pub use fabric::Fabric;
use fabric::{EmuGate, QpConf};

use crate::error::{Error, Result};
use crate::transport::ib::boundary::provider::{
    mask, mtu_bytes, Cq, Memory, MrKeys, Pd, Provider, QpId, QpState, Rings, SendWr, WorkCompletion,
};
use crate::transport::ib::boundary::verbs::{Gid, GidType, LinkLayer, Port, QpAttr, QpCap};
use crate::transport::ib::emulated::nic::{access, EmulatedNic, QpRings};
use crate::transport::ib::posting::cq::{CQE_BYTES, EMPTY_OP_OWN};
use crate::transport::ib::posting::host_qp::HostQp;
use crate::transport::ib::posting::wqe::WQEBB;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

/// Most READs/atomics a QP may have outstanding, as ConnectX devices report
/// (`max_qp_rd_atom` / `max_qp_init_rd_atom`).
pub const MAX_RD_ATOMIC: u8 = 16;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn refused(call: &str, why: impl std::fmt::Display) -> Error {
    Error::TransportUnavailable {
        transport: "ib",
        why: format!("{call} refused by the emulated NIC: {why}"),
    }
}

/// Zeroed, page-aligned host memory (so the rings can be registered into a GPU like a real
/// NIC's), freed on drop.
struct PageBuf {
    ptr: *mut u8,
    layout: std::alloc::Layout,
}

// SAFETY: owned memory, accessed through raw pointers by the poster and the NIC thread with
// volatile operations and fences.
unsafe impl Send for PageBuf {}
// SAFETY: as above.
unsafe impl Sync for PageBuf {}

impl PageBuf {
    fn new(bytes: usize) -> PageBuf {
        let layout = std::alloc::Layout::from_size_align(bytes.next_multiple_of(4096), 4096)
            .expect("page-aligned layout");
        // SAFETY: a non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        if ptr.is_null() {
            std::alloc::handle_alloc_error(layout);
        }
        PageBuf { ptr, layout }
    }
}

impl Drop for PageBuf {
    fn drop(&mut self) {
        // SAFETY: allocated by `new` with this layout, freed once.
        unsafe { std::alloc::dealloc(self.ptr, self.layout) };
    }
}

struct EmuCq {
    entries: u64,
    ring: PageBuf,
    ci: PageBuf,
    /// The QP completing here (the emulated NIC gives each QP a CQ of its own).
    qp: Option<u64>,
}

impl EmuQp {
    /// Its rings, completing on `cq`.
    fn rings(&self, cq: &EmuCq) -> Rings {
        Rings {
            qpn: self.id.qpn,
            sq: self.sq.ptr,
            sq_wqebbs: self.sq_wqebbs,
            dbr: self.dbr.ptr as *mut u32,
            doorbell: self.doorbell.ptr as *mut u64,
            doorbell_is_mmio: false,
            cq: cq.ring.ptr,
            cq_entries: cq.entries,
            cq_ci: cq.ci.ptr as *mut u32,
        }
    }
}

struct EmuQp {
    id: QpId,
    cq: u64,
    sq: PageBuf,
    dbr: PageBuf,
    doorbell: PageBuf,
    sq_wqebbs: u64,
    conf: Arc<Mutex<QpConf>>,
    /// The `ibv_post_send` poster, made on first use, and the `wr_id` of each signaled WQE by its
    /// index.
    poster: Option<HostQp>,
    wr_ids: HashMap<u64, u64>,
    /// Whether `rings` handed the queue to another poster.
    rings_taken: bool,
}

#[derive(Default)]
struct Objects {
    next: u64,
    /// The low 12 bits of the last QP number handed out.
    last_qpn: u32,
    pds: Vec<u64>,
    cqs: HashMap<u64, EmuCq>,
    qps: HashMap<u64, EmuQp>,
    mrs: Vec<u32>,
}

/// What the emulated port looks like.
#[derive(Debug, Clone, Copy)]
pub struct PortConfig {
    /// Active MTU in bytes (256 .. 4096).
    pub mtu: u32,
    /// RoCE (Ethernet) or InfiniBand.
    pub link_layer: LinkLayer,
}

impl Default for PortConfig {
    fn default() -> Self {
        PortConfig {
            mtu: 4096,
            link_layer: LinkLayer::Ethernet,
        }
    }
}

/// An emulated mlx5 NIC behind the verbs calls.
pub struct Emulated {
    name: String,
    id: u32,
    nic: Arc<EmulatedNic>,
    fabric: Fabric,
    port: Port,
    objects: Mutex<Objects>,
}

impl Emulated {
    /// The NIC numbered `id` (1..4096, unique in the job: the rank plus one) on `fabric`, over
    /// `nic` (which moves the bytes).
    pub fn new(
        nic: Arc<EmulatedNic>,
        id: u32,
        fabric: Fabric,
        config: PortConfig,
    ) -> Result<Emulated> {
        if !(1..4096).contains(&id) {
            return Err(Error::invalid(
                "emulated NIC",
                format!("id {id}: 1 to 4095 (at most 4095 ranks)"),
            ));
        }
        if crate::transport::ib::boundary::provider::mtu_code(config.mtu) == 0 {
            return Err(Error::invalid(
                "emulated NIC",
                format!("MTU {}: 256, 512, 1024, 2048 or 4096", config.mtu),
            ));
        }
        // GIDs as a RoCE port has them: a link-local v1 entry, then the v2 entry of an IPv4
        // address (10.<id>), which GID selection prefers; InfiniBand: the subnet prefix entry.
        let link_local = {
            let mut g = [0u8; 16];
            g[0] = 0xfe;
            g[1] = 0x80;
            g[14..].copy_from_slice(&(id as u16).to_be_bytes());
            g
        };
        let gids = match config.link_layer {
            LinkLayer::Infiniband => vec![Gid {
                index: 0,
                bytes: link_local,
                kind: GidType::Ib,
            }],
            _ => {
                let mut v4 = [0u8; 16];
                v4[10] = 0xff;
                v4[11] = 0xff;
                v4[12] = 10;
                v4[13] = (id >> 8) as u8;
                v4[14] = id as u8;
                v4[15] = 1;
                vec![
                    Gid {
                        index: 0,
                        bytes: link_local,
                        kind: GidType::RoceV1,
                    },
                    Gid {
                        index: 1,
                        bytes: v4,
                        kind: GidType::RoceV2,
                    },
                ]
            }
        };
        let port = Port {
            num: 1,
            state: 4,
            link_layer: config.link_layer,
            active_mtu: config.mtu,
            lid: if config.link_layer == LinkLayer::Infiniband {
                id as u16
            } else {
                0
            },
            gids,
        };
        Ok(Emulated {
            name: format!("emulated_mlx5_{id}"),
            id,
            nic,
            fabric,
            port,
            objects: Mutex::new(Objects {
                next: 1,
                ..Default::default()
            }),
        })
    }

    /// The NIC that moves the bytes (for its counters and faults).
    pub fn nic(&self) -> &Arc<EmulatedNic> {
        &self.nic
    }

    fn gid_at(&self, index: u8) -> Option<[u8; 16]> {
        self.port
            .gids
            .iter()
            .find(|g| g.index == u32::from(index))
            .map(|g| g.bytes)
    }

    /// Checks one `ibv_modify_qp` the way a ConnectX does; returns the new configuration.
    fn transition(&self, conf: &QpConf, a: &QpAttr, m: u32) -> Result<QpConf> {
        let call = "ibv_modify_qp";
        if m & mask::STATE == 0 {
            return Err(refused(call, "IBV_QP_STATE is missing"));
        }
        let to = QpState::from_raw(a.qp_state)
            .ok_or_else(|| refused(call, format!("no QP state {}", a.qp_state)))?;
        let mut next = *conf;
        next.state = to;
        let need = match (conf.state, to) {
            (_, QpState::Reset) => return Ok(QpConf::reset(conf.qpn)),
            (_, QpState::Err) => return Ok(next),
            (QpState::Reset, QpState::Init) => mask::TO_INIT,
            (QpState::Init, QpState::Rtr) => mask::TO_RTR,
            (QpState::Rtr, QpState::Rts) => mask::TO_RTS,
            (from, to) => {
                return Err(refused(
                    call,
                    format!(
                        "QP {:#x}: {from:?} -> {to:?} is not a transition of an RC QP \
                         (RESET -> INIT -> RTR -> RTS)",
                        conf.qpn
                    ),
                ))
            }
        };
        let missing = need & !m;
        if missing != 0 {
            return Err(refused(
                call,
                format!(
                    "QP {:#x}: {:?} -> {to:?} needs {}",
                    conf.qpn,
                    conf.state,
                    mask::names(missing).join(", ")
                ),
            ));
        }
        match to {
            QpState::Init => {
                if a.port_num != self.port.num {
                    return Err(refused(
                        call,
                        format!("port {} does not exist (the NIC has port 1)", a.port_num),
                    ));
                }
                next.access = a.qp_access_flags;
            }
            QpState::Rtr => {
                let port_mtu =
                    crate::transport::ib::boundary::provider::mtu_code(self.port.active_mtu);
                if a.path_mtu == 0 || a.path_mtu > port_mtu {
                    return Err(refused(
                        call,
                        format!(
                            "path MTU {} above the port's active MTU {}",
                            mtu_bytes(a.path_mtu),
                            self.port.active_mtu
                        ),
                    ));
                }
                if a.max_dest_rd_atomic > MAX_RD_ATOMIC {
                    return Err(refused(
                        call,
                        format!(
                            "max_dest_rd_atomic {} above the device's {MAX_RD_ATOMIC}",
                            a.max_dest_rd_atomic
                        ),
                    ));
                }
                let gid = if self.port.link_layer == LinkLayer::Ethernet || a.ah_attr.is_global != 0
                {
                    if a.ah_attr.is_global == 0 {
                        return Err(refused(
                            call,
                            "a RoCE port needs a GRH (ah_attr.is_global = 1 with the peer's GID)",
                        ));
                    }
                    self.gid_at(a.ah_attr.grh.sgid_index).ok_or_else(|| {
                        refused(
                            call,
                            format!(
                                "source GID index {} is past the port's table",
                                a.ah_attr.grh.sgid_index
                            ),
                        )
                    })?
                } else {
                    // InfiniBand without GRH: the LID addresses the port; the GID stands for it.
                    self.gid_at(0).unwrap_or_default()
                };
                next.gid = gid;
                next.dest_qpn = a.dest_qp_num;
                next.dgid = if a.ah_attr.is_global != 0 {
                    a.ah_attr.grh.dgid
                } else {
                    let mut g = self.gid_at(0).unwrap_or_default();
                    g[14..].copy_from_slice(&a.ah_attr.dlid.to_be_bytes());
                    g
                };
                next.mtu = a.path_mtu;
                next.max_dest_rd_atomic = a.max_dest_rd_atomic;
            }
            QpState::Rts => {
                if a.max_rd_atomic > MAX_RD_ATOMIC {
                    return Err(refused(
                        call,
                        format!(
                            "max_rd_atomic {} above the device's {MAX_RD_ATOMIC}",
                            a.max_rd_atomic
                        ),
                    ));
                }
                next.max_rd_atomic = a.max_rd_atomic;
            }
            _ => {}
        }
        Ok(next)
    }
}

impl Provider for Emulated {
    fn device_name(&self) -> &str {
        &self.name
    }

    fn is_emulated(&self) -> bool {
        true
    }

    fn is_mlx5(&self) -> bool {
        true
    }

    fn query_port(&self, port: u8) -> Result<Port> {
        if port != self.port.num {
            return Err(refused(
                "ibv_query_port",
                format!("port {port} does not exist"),
            ));
        }
        Ok(self.port.clone())
    }

    fn alloc_pd(&self) -> Result<Pd> {
        let mut o = lock(&self.objects);
        let h = o.next;
        o.next += 1;
        o.pds.push(h);
        Ok(Pd(h))
    }

    fn dealloc_pd(&self, pd: Pd) {
        lock(&self.objects).pds.retain(|&p| p != pd.0);
    }

    unsafe fn reg_mr(
        &self,
        pd: Pd,
        addr: u64,
        len: usize,
        access: u32,
        _memory: Memory<'_>,
    ) -> Result<MrKeys> {
        if !lock(&self.objects).pds.contains(&pd.0) {
            return Err(refused(
                "ibv_reg_mr",
                format!("no protection domain {}", pd.0),
            ));
        }
        if access & (access::REMOTE_WRITE | access::REMOTE_ATOMIC) != 0
            && access & access::LOCAL_WRITE == 0
        {
            // verbs.h: remote write or atomic access requires local write.
            return Err(refused(
                "ibv_reg_mr",
                "IBV_ACCESS_REMOTE_WRITE or _ATOMIC without IBV_ACCESS_LOCAL_WRITE",
            ));
        }
        let key = self.nic.register_with_access(addr, len as u64, access)?;
        self.fabric.write(
            &format!("mr-{key}"),
            &[
                ("addr", addr.to_string()),
                ("len", len.to_string()),
                ("access", access.to_string()),
            ],
        )?;
        lock(&self.objects).mrs.push(key);
        Ok(MrKeys {
            handle: u64::from(key),
            lkey: key,
            rkey: key,
        })
    }

    fn dereg_mr(&self, mr: MrKeys) {
        let mut o = lock(&self.objects);
        if let Some(i) = o.mrs.iter().position(|&k| k == mr.lkey) {
            o.mrs.swap_remove(i);
            self.nic.deregister(mr.lkey);
            self.fabric.remove(&format!("mr-{}", mr.lkey));
        }
    }

    fn create_cq(&self, entries: u32) -> Result<Cq> {
        let n = u64::from(entries.max(1))
            .next_power_of_two()
            .clamp(128, 1 << 16);
        let ring = PageBuf::new(n as usize * CQE_BYTES);
        for i in 0..n as usize {
            // SAFETY: inside the ring, before anyone else knows it.
            unsafe { ring.ptr.add(i * CQE_BYTES + 63).write(EMPTY_OP_OWN) };
        }
        let mut o = lock(&self.objects);
        let h = o.next;
        o.next += 1;
        o.cqs.insert(
            h,
            EmuCq {
                entries: n,
                ring,
                ci: PageBuf::new(8),
                qp: None,
            },
        );
        Ok(Cq(h))
    }

    fn destroy_cq(&self, cq: Cq) {
        let mut o = lock(&self.objects);
        if o.cqs.get(&cq.0).is_some_and(|c| c.qp.is_none()) {
            o.cqs.remove(&cq.0);
        }
    }

    fn create_qp(&self, pd: Pd, cq: Cq, cap: QpCap) -> Result<QpId> {
        let mut o = lock(&self.objects);
        if !o.pds.contains(&pd.0) {
            return Err(refused(
                "ibv_create_qp",
                format!("no protection domain {}", pd.0),
            ));
        }
        let h = o.next;
        let n = o.qps.len() as u32;
        if n >= 0xfff {
            return Err(refused(
                "ibv_create_qp",
                "at most 4095 QPs per emulated NIC",
            ));
        }
        let (cq_entries, cq_ring, cq_ci) = match o.cqs.get_mut(&cq.0) {
            None => return Err(refused("ibv_create_qp", format!("no CQ {}", cq.0))),
            Some(c) if c.qp.is_some() => {
                return Err(refused(
                    "ibv_create_qp",
                    "the emulated NIC gives each QP a CQ of its own",
                ))
            }
            Some(c) => {
                c.qp = Some(h);
                (c.entries, c.ring.ptr, c.ci.ptr as *const u32)
            }
        };
        o.next += 1;
        // A WQE takes up to 4 WQEBBs (inline data); at most the CQ's depth signaled.
        let sq_wqebbs = (u64::from(cap.max_send_wr.max(1)) * 4)
            .next_power_of_two()
            .clamp(128, 1 << 15);
        // QP numbers: this NIC's id above 12 bits of a counter, skipping numbers still in use
        // (at most 4095 live, checked above).
        let mut low = o.last_qpn;
        let qpn = loop {
            low = low % 0xfff + 1;
            let qpn = self.id << 12 | low;
            if !o.qps.values().any(|q| q.id.qpn == qpn) {
                break qpn;
            }
        };
        o.last_qpn = low;
        let (sq, dbr, doorbell) = (
            PageBuf::new(sq_wqebbs as usize * WQEBB),
            PageBuf::new(8),
            PageBuf::new(8),
        );
        let rings = QpRings {
            sq: sq.ptr,
            sq_wqebbs,
            dbr: dbr.ptr as *const u32,
            doorbell: doorbell.ptr as *const u64,
            cq: cq_ring,
            cq_entries,
            cq_ci,
            ring_dma: None,
        };
        let conf = Arc::new(Mutex::new(QpConf::reset(qpn)));
        let gate = Arc::new(EmuGate {
            conf: conf.clone(),
            fabric: self.fabric.clone(),
            peer: Mutex::new(None),
        });
        // SAFETY: the rings are owned by the EmuQp/EmuCq kept in `objects` until destroy_qp,
        // which removes the QP from the NIC first.
        unsafe { self.nic.add_gated_qp(qpn, rings, None, Some(gate)) }?;
        let id = QpId { handle: h, qpn };
        self.fabric
            .write(&format!("qp-{qpn}"), &lock(&conf).fields())?;
        o.qps.insert(
            h,
            EmuQp {
                id,
                cq: cq.0,
                sq,
                dbr,
                doorbell,
                sq_wqebbs,
                conf,
                poster: None,
                wr_ids: HashMap::new(),
                rings_taken: false,
            },
        );
        Ok(id)
    }

    fn modify_qp(&self, qp: QpId, attr: &QpAttr, m: u32) -> Result<()> {
        let o = lock(&self.objects);
        let q = o
            .qps
            .get(&qp.handle)
            .ok_or_else(|| refused("ibv_modify_qp", format!("no QP {:#x}", qp.qpn)))?;
        let current = *lock(&q.conf);
        let next = self.transition(&current, attr, m)?;
        *lock(&q.conf) = next;
        self.fabric.write(&format!("qp-{}", qp.qpn), &next.fields())
    }

    fn destroy_qp(&self, qp: QpId) {
        let mut o = lock(&self.objects);
        if let Some(q) = o.qps.remove(&qp.handle) {
            self.nic.remove_qp(q.id.qpn);
            self.fabric.remove(&format!("qp-{}", q.id.qpn));
            if let Some(c) = o.cqs.get_mut(&q.cq) {
                c.qp = None;
            }
        }
    }

    fn rings(&self, qp: QpId, cq: Cq) -> Result<Rings> {
        let mut o = lock(&self.objects);
        let o = &mut *o;
        let c = o
            .cqs
            .get(&cq.0)
            .filter(|c| c.qp == Some(qp.handle))
            .ok_or_else(|| {
                refused(
                    "mlx5dv_init_obj",
                    format!("CQ {} is not QP {:#x}'s", cq.0, qp.qpn),
                )
            })?;
        let q = o
            .qps
            .get_mut(&qp.handle)
            .ok_or_else(|| refused("mlx5dv_init_obj", format!("no QP {:#x}", qp.qpn)))?;
        if q.poster.is_some() {
            return Err(refused(
                "mlx5dv_init_obj",
                format!("QP {:#x} is already posted to with ibv_post_send", qp.qpn),
            ));
        }
        q.rings_taken = true;
        Ok(q.rings(c))
    }

    fn post_send(&self, qp: QpId, wrs: &[SendWr]) -> Result<()> {
        let mut o = lock(&self.objects);
        let o = &mut *o;
        let q = o
            .qps
            .get_mut(&qp.handle)
            .ok_or_else(|| refused("ibv_post_send", format!("no QP {:#x}", qp.qpn)))?;
        let state = lock(&q.conf).state;
        if state != QpState::Rts {
            return Err(refused(
                "ibv_post_send",
                format!("QP {:#x} is in {state:?}, not RTS (EINVAL)", qp.qpn),
            ));
        }
        if q.rings_taken {
            return Err(refused(
                "ibv_post_send",
                format!("QP {:#x}'s rings were handed to another poster", qp.qpn),
            ));
        }
        if q.poster.is_none() {
            let c = o
                .cqs
                .get(&q.cq)
                .ok_or_else(|| refused("ibv_post_send", "the QP's CQ is gone"))?;
            let rings = q.rings(c);
            // SAFETY: the rings live in this EmuQp/EmuCq, which outlive the poster (dropped with
            // the EmuQp); only this poster writes them (rings() refuses once it exists).
            q.poster = Some(unsafe { HostQp::on_rings(&rings) });
        }
        let poster = q.poster.as_mut().expect("made above");
        for wr in wrs {
            if poster.posted() + 4 > poster.completed() + q.sq_wqebbs {
                poster.ring();
                return Err(Error::TransportUnavailable {
                    transport: "ib",
                    why: format!(
                        "ibv_post_send: QP {:#x}'s send queue is full (ENOMEM): poll its CQ",
                        qp.qpn
                    ),
                });
            }
            // ENOMEM on a full send queue, as libmlx5 answers (no waiting here).
            let at = poster.post(&wr.op, wr.signaled, Duration::ZERO)?;
            if wr.signaled {
                q.wr_ids.insert(at, wr.wr_id);
            }
        }
        poster.ring();
        Ok(())
    }

    fn poll_cq(&self, cq: Cq, max: usize, out: &mut Vec<WorkCompletion>) -> Result<usize> {
        let mut o = lock(&self.objects);
        let Some(h) = o.cqs.get(&cq.0).and_then(|c| c.qp) else {
            return Ok(0);
        };
        let Some(q) = o.qps.get_mut(&h) else {
            return Ok(0);
        };
        let Some(poster) = q.poster.as_mut() else {
            return Ok(0);
        };
        let qpn = q.id.qpn;
        let wr_ids = &mut q.wr_ids;
        let mut n = 0;
        poster.poll_each(|start, c| {
            let wr_id = wr_ids.remove(&start).unwrap_or(u64::MAX);
            out.push(WorkCompletion {
                wr_id,
                status: if c.is_error() {
                    crate::transport::ib::boundary::provider::wc_status::from_mlx5(c.syndrome)
                } else {
                    crate::transport::ib::boundary::provider::wc_status::SUCCESS
                },
                qpn,
                byte_len: c.byte_cnt,
                vendor_err: u32::from(c.vendor_syndrome),
            });
            n += 1;
            n < max
        });
        Ok(n)
    }

    fn faults(&self) -> Vec<String> {
        self.nic.faults()
    }

    fn attach_remote(&self, rkey: u32, addr: u64, len: u64, local: u64) -> Result<()> {
        if lock(&self.objects).mrs.contains(&rkey) {
            return Ok(()); // this NIC's own region (loopback)
        }
        let rec = self.fabric.read(&format!("mr-{rkey}")).ok_or_else(|| {
            Error::invalid(
                "emulated fabric",
                format!("no region with rkey {rkey:#x} is registered on this host"),
            )
        })?;
        let access = rec
            .get("access")
            .and_then(|v| v.parse::<u32>().ok())
            .unwrap_or(0);
        self.nic
            .register_remote_with_access(rkey, addr, len, local, access)
    }
}

impl Drop for Emulated {
    fn drop(&mut self) {
        let o = lock(&self.objects);
        for q in o.qps.values() {
            self.nic.remove_qp(q.id.qpn);
            self.fabric.remove(&format!("qp-{}", q.id.qpn));
        }
        for k in &o.mrs {
            self.fabric.remove(&format!("mr-{k}"));
        }
    }
}
