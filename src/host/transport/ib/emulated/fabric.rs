//! The emulated fabric: what one end of an emulated connection needs to know of the other, when
//! both ends are often in different processes (ranks): a directory of small `key=value` records,
//! one per QP (`qp-<qpn>`, [`QpConf`]) and per registered region (`mr-<rkey>`), that every
//! emulated NIC of the job on this host reads and writes; and the check each work request passes
//! against the far end's record before the NIC executes it ([`EmuGate`]).

use super::lock;
use crate::error::{Error, Result};
use crate::transport::ib::boundary::provider::{gid_text, mtu_bytes, QpState};
use crate::transport::ib::emulated::nic::{access, Gate};
use crate::transport::ib::posting::cq;
use crate::transport::ib::posting::wqe::opcode;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

/// The records the job's emulated NICs on this host share: `qp-<qpn>` and `mr-<rkey>` files of
/// `key=value` lines in one directory per job.
#[derive(Debug, Clone)]
pub struct Fabric {
    dir: PathBuf,
}

impl Fabric {
    /// The fabric of the job tagged `tag` (the same on every rank: derived from the job's secret).
    pub fn for_job(tag: &str) -> Result<Fabric> {
        let root = std::env::temp_dir();
        Fabric::sweep(&root, std::time::Duration::from_secs(24 * 3600));
        let dir = root.join(format!("doorbell-emulated-fabric-{tag}"));
        std::fs::create_dir_all(&dir).map_err(|e| Error::io("creating the emulated fabric", e))?;
        Ok(Fabric { dir })
    }

    /// Removes the fabrics under `root` that nothing has written for `age` (left by jobs that
    /// were killed before their NICs could remove their records). Best effort.
    pub fn sweep(root: &std::path::Path, age: std::time::Duration) {
        let Ok(entries) = std::fs::read_dir(root) else {
            return;
        };
        for e in entries.flatten() {
            let name = e.file_name();
            if !name
                .to_string_lossy()
                .starts_with("doorbell-emulated-fabric-")
            {
                continue;
            }
            let path = e.path();
            let newest = std::fs::read_dir(&path)
                .into_iter()
                .flatten()
                .flatten()
                .chain(std::iter::once(e))
                .filter_map(|f| f.metadata().ok()?.modified().ok())
                .max();
            if newest.is_some_and(|t| t.elapsed().is_ok_and(|d| d > age)) {
                let _ = std::fs::remove_dir_all(&path);
            }
        }
    }

    pub(super) fn write(&self, name: &str, fields: &[(&str, String)]) -> Result<()> {
        let text: String = fields.iter().map(|(k, v)| format!("{k}={v}\n")).collect();
        let tmp = self.dir.join(format!(".{name}.{}", std::process::id()));
        std::fs::write(&tmp, text).map_err(|e| Error::io("writing the emulated fabric", e))?;
        std::fs::rename(&tmp, self.dir.join(name))
            .map_err(|e| Error::io("writing the emulated fabric", e))
    }

    pub(super) fn read(&self, name: &str) -> Option<BTreeMap<String, String>> {
        let text = std::fs::read_to_string(self.dir.join(name)).ok()?;
        Some(
            text.lines()
                .filter_map(|l| l.split_once('='))
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        )
    }

    pub(super) fn remove(&self, name: &str) {
        let _ = std::fs::remove_file(self.dir.join(name));
        // The last NIC of the job takes the directory with it.
        let _ = std::fs::remove_dir(&self.dir);
    }
}

/// What one end of a connection has set, as the fabric records it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct QpConf {
    pub(super) qpn: u32,
    pub(super) state: QpState,
    pub(super) access: u32,
    /// This end's GID (the port's entry at the RTR's source GID index).
    pub(super) gid: [u8; 16],
    pub(super) dest_qpn: u32,
    pub(super) dgid: [u8; 16],
    pub(super) mtu: u32,
    pub(super) max_dest_rd_atomic: u8,
    pub(super) max_rd_atomic: u8,
}

impl QpConf {
    /// A QP in RESET: nothing set.
    pub(super) fn reset(qpn: u32) -> QpConf {
        QpConf {
            qpn,
            state: QpState::Reset,
            access: 0,
            gid: [0; 16],
            dest_qpn: 0,
            dgid: [0; 16],
            mtu: 0,
            max_dest_rd_atomic: 0,
            max_rd_atomic: 0,
        }
    }

    pub(super) fn fields(&self) -> Vec<(&'static str, String)> {
        vec![
            ("qpn", self.qpn.to_string()),
            ("state", (self.state as u32).to_string()),
            ("access", self.access.to_string()),
            ("gid", hex(&self.gid)),
            ("dest_qpn", self.dest_qpn.to_string()),
            ("dgid", hex(&self.dgid)),
            ("mtu", self.mtu.to_string()),
            ("max_dest_rd_atomic", self.max_dest_rd_atomic.to_string()),
            ("max_rd_atomic", self.max_rd_atomic.to_string()),
        ]
    }

    pub(super) fn parse(m: &BTreeMap<String, String>) -> Option<QpConf> {
        let n = |k: &str| m.get(k)?.parse::<u64>().ok();
        Some(QpConf {
            qpn: n("qpn")? as u32,
            state: QpState::from_raw(n("state")? as u32)?,
            access: n("access")? as u32,
            gid: unhex(m.get("gid")?)?,
            dest_qpn: n("dest_qpn")? as u32,
            dgid: unhex(m.get("dgid")?)?,
            mtu: n("mtu")? as u32,
            max_dest_rd_atomic: n("max_dest_rd_atomic")? as u8,
            max_rd_atomic: n("max_rd_atomic")? as u8,
        })
    }
}

fn hex(b: &[u8; 16]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex(s: &str) -> Option<[u8; 16]> {
    let mut out = [0u8; 16];
    if s.len() != 32 {
        return None;
    }
    for (i, o) in out.iter_mut().enumerate() {
        *o = u8::from_str_radix(s.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(out)
}

/// The far end as seen by one QP's work requests.
pub(super) struct EmuGate {
    pub(super) conf: Arc<Mutex<QpConf>>,
    pub(super) fabric: Fabric,
    /// The far end's record once it matched (it does not change while connected).
    pub(super) peer: Mutex<Option<QpConf>>,
}

impl Gate for EmuGate {
    fn admit(&self, op: u8, rd_in_flight: u32) -> std::result::Result<(), (u8, String)> {
        use cq::syndrome::*;
        let me = *lock(&self.conf);
        if me.state != QpState::Rts {
            return Err((LOCAL_QP_OP, format!("the QP is in {:?}, not RTS", me.state)));
        }
        let peer = {
            let mut cached = lock(&self.peer);
            match *cached {
                Some(p) => p,
                None => {
                    let p = self
                        .fabric
                        .read(&format!("qp-{}", me.dest_qpn))
                        .and_then(|m| QpConf::parse(&m));
                    let why = match p {
                        None => Some(format!("no QP {:#x} answers", me.dest_qpn)),
                        Some(p) if !matches!(p.state, QpState::Rtr | QpState::Rts) => Some(
                            format!("QP {:#x} is in {:?}, not RTR or RTS", p.qpn, p.state),
                        ),
                        Some(p) if p.dest_qpn != me.qpn => Some(format!(
                            "QP {:#x} is connected to QP {:#x}, not to this one",
                            p.qpn, p.dest_qpn
                        )),
                        Some(p) if p.gid != me.dgid => Some(format!(
                            "QP {:#x} has GID {}, this QP sends to GID {}",
                            p.qpn,
                            gid_text(&p.gid),
                            gid_text(&me.dgid)
                        )),
                        Some(p) if p.dgid != me.gid => Some(format!(
                            "QP {:#x} sends to GID {}, this QP has GID {}",
                            p.qpn,
                            gid_text(&p.dgid),
                            gid_text(&me.gid)
                        )),
                        Some(p) if p.mtu != me.mtu => Some(format!(
                            "path MTU {} here, {} at QP {:#x}",
                            mtu_bytes(me.mtu),
                            mtu_bytes(p.mtu),
                            p.qpn
                        )),
                        Some(_) => None,
                    };
                    if let Some(why) = why {
                        return Err((TRANSPORT_RETRY_EXCEEDED, why));
                    }
                    let p = p.expect("checked above");
                    *cached = Some(p);
                    p
                }
            }
        };
        let (flag, what) = match op {
            opcode::RDMA_WRITE | opcode::RDMA_WRITE_IMM => (access::REMOTE_WRITE, "WRITE"),
            opcode::RDMA_READ => (access::REMOTE_READ, "READ"),
            opcode::ATOMIC_FA | opcode::ATOMIC_CS => (access::REMOTE_ATOMIC, "atomic"),
            _ => (0, ""),
        };
        if flag != 0 && peer.access & flag == 0 {
            return Err((
                REMOTE_ACCESS,
                format!(
                    "QP {:#x} did not grant remote {what} access at INIT (access flags {:#x})",
                    peer.qpn, peer.access
                ),
            ));
        }
        if rd_in_flight > u32::from(peer.max_dest_rd_atomic) {
            return Err((
                REMOTE_INVALID_REQUEST,
                format!(
                    "{rd_in_flight} READs/atomics outstanding at QP {:#x}, which accepts {} \
                     (max_dest_rd_atomic); this QP allows {} (max_rd_atomic)",
                    peer.qpn, peer.max_dest_rd_atomic, me.max_rd_atomic
                ),
            ));
        }
        Ok(())
    }

    fn max_rd_atomic(&self) -> u32 {
        u32::from(lock(&self.conf).max_rd_atomic)
    }
}
