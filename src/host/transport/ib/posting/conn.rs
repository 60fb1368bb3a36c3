//! Connected RC queue pairs between ranks, made only through the verbs boundary
//! ([`crate::transport::ib::boundary::provider::Provider`]): a device opened on one port with its
//! protection domain and GID ([`IbDevice`]), registrations that deregister on drop
//! ([`Registration`]), queue pairs that destroy themselves ([`QueuePair`]), and the exchange that
//! connects every pair of ranks over the bootstrap ([`connect_peers`]): each rank makes its QPs,
//! all ranks trade endpoints (QPN, PSN, LID, GID, MTU), then every QP goes RESET -> INIT -> RTR ->
//! RTS towards its peer's.

use crate::error::{Error, Result};
use crate::job::bootstrap::Bootstrap;
use crate::transport::ib::boundary::provider::{
    access, mask, mtu_code, Cq, Memory, MrKeys, Pd, Provider, QpId, QpState, RcParams, Rings,
    SendWr, WorkCompletion,
};
use crate::transport::ib::boundary::verbs::{
    choose_gid, AhAttr, Gid, LinkLayer, Port, QpAttr, QpCap,
};
use std::sync::Arc;

/// What a peer needs to connect to one QP: exchanged over the bootstrap.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Endpoint {
    /// QP number.
    pub qpn: u32,
    /// First packet sequence number it sends.
    pub psn: u32,
    /// LID (InfiniBand; 0 on RoCE).
    pub lid: u16,
    /// GID (RoCE, or routed InfiniBand).
    pub gid: [u8; 16],
    /// The path MTU it can take (`enum ibv_mtu`).
    pub mtu: u32,
}

impl Endpoint {
    /// Encoded size.
    pub const BYTES: usize = 30;

    /// Little-endian fields.
    pub fn to_bytes(&self) -> [u8; Self::BYTES] {
        let mut b = [0u8; Self::BYTES];
        b[0..4].copy_from_slice(&self.qpn.to_le_bytes());
        b[4..8].copy_from_slice(&self.psn.to_le_bytes());
        b[8..10].copy_from_slice(&self.lid.to_le_bytes());
        b[10..26].copy_from_slice(&self.gid);
        b[26..30].copy_from_slice(&self.mtu.to_le_bytes());
        b
    }

    /// Reads what [`Endpoint::to_bytes`] wrote.
    pub fn from_bytes(b: &[u8]) -> Result<Endpoint> {
        if b.len() != Self::BYTES {
            return Err(Error::invalid(
                "endpoint",
                format!("{} bytes, expected {}", b.len(), Self::BYTES),
            ));
        }
        let u32_at = |o: usize| u32::from_le_bytes(b[o..o + 4].try_into().expect("4 bytes"));
        Ok(Endpoint {
            qpn: u32_at(0) & 0xff_ffff,
            psn: u32_at(4) & 0xff_ffff,
            lid: u16::from_le_bytes([b[8], b[9]]),
            gid: b[10..26].try_into().expect("16 bytes"),
            mtu: u32_at(26),
        })
    }
}

/// One port of a NIC, opened: its protection domain, GID and the attributes its RC queue pairs
/// get. Deallocates the PD on drop (after every registration and QP made from it).
pub struct IbDevice {
    provider: Arc<dyn Provider>,
    pd: Pd,
    port: Port,
    gid: Gid,
    params: RcParams,
}

impl std::fmt::Debug for IbDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IbDevice")
            .field("device", &self.provider.device_name())
            .field("port", &self.port.num)
            .field("gid_index", &self.gid.index)
            .finish()
    }
}

impl IbDevice {
    /// Opens `port` of `provider` (it must be active), choosing its GID as
    /// [`choose_gid`] does (`gid_override`: `DOORBELL_IB_GID_INDEX`).
    pub fn open(
        provider: Arc<dyn Provider>,
        port: u8,
        gid_override: Option<u32>,
    ) -> Result<Arc<IbDevice>> {
        let info = provider.query_port(port)?;
        if !info.active() {
            return Err(Error::TransportUnavailable {
                transport: "ib",
                why: format!(
                    "{} port {port} is not active (state {})",
                    provider.device_name(),
                    info.state
                ),
            });
        }
        let gid = choose_gid(&info, gid_override)?;
        let pd = provider.alloc_pd()?;
        let params = RcParams {
            port,
            access: access::LOCAL_WRITE
                | access::REMOTE_WRITE
                | access::REMOTE_READ
                | access::REMOTE_ATOMIC,
            mtu: mtu_code(info.active_mtu).max(1),
            gid_index: gid.index as u8,
            max_dest_rd_atomic: 16,
            max_rd_atomic: 16,
        };
        Ok(Arc::new(IbDevice {
            provider,
            pd,
            port: info,
            gid,
            params,
        }))
    }

    /// The provider behind it.
    pub fn provider(&self) -> &Arc<dyn Provider> {
        &self.provider
    }

    /// The port as queried.
    pub fn port(&self) -> &Port {
        &self.port
    }

    /// The GID its queue pairs use.
    pub fn gid(&self) -> &Gid {
        &self.gid
    }

    /// Registers `[addr, addr + len)` with `access` (`IBV_ACCESS_*`).
    ///
    /// # Safety
    /// The memory (of `memory`'s kind) stays allocated while the registration lives.
    pub unsafe fn register(
        self: &Arc<Self>,
        addr: u64,
        len: usize,
        access: u32,
        memory: Memory<'_>,
    ) -> Result<Registration> {
        // SAFETY: the caller's contract.
        let keys = unsafe { self.provider.reg_mr(self.pd, addr, len, access, memory) }?;
        Ok(Registration {
            dev: self.clone(),
            keys,
            addr,
            len: len as u64,
        })
    }

    /// A queue pair in RESET, with a send queue for `max_send_wr` work requests and a CQ of its
    /// own as deep.
    pub fn create_qp(self: &Arc<Self>, max_send_wr: u32) -> Result<QueuePair> {
        let cq = self.provider.create_cq(max_send_wr.max(1) * 4)?;
        let cap = QpCap {
            max_send_wr,
            max_recv_wr: 1,
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: 64,
        };
        let qp = match self.provider.create_qp(self.pd, cq, cap) {
            Ok(q) => q,
            Err(e) => {
                self.provider.destroy_cq(cq);
                return Err(e);
            }
        };
        // PSNs differ per QP (a stale packet of an earlier QP is not taken for a new one's).
        let psn = qp.qpn.wrapping_mul(2_654_435_761) & 0xff_ffff;
        Ok(QueuePair {
            dev: self.clone(),
            cq,
            qp,
            psn,
        })
    }

    /// This port's endpoint for a QP numbered `qpn` sending from `psn`.
    fn endpoint(&self, qpn: u32, psn: u32) -> Endpoint {
        Endpoint {
            qpn,
            psn,
            lid: if self.port.link_layer == LinkLayer::Infiniband {
                self.port.lid
            } else {
                0
            },
            gid: self.gid.bytes,
            mtu: self.params.mtu,
        }
    }
}

impl Drop for IbDevice {
    fn drop(&mut self) {
        self.provider.dealloc_pd(self.pd);
    }
}

/// A registered region; deregistered on drop.
pub struct Registration {
    dev: Arc<IbDevice>,
    keys: MrKeys,
    addr: u64,
    len: u64,
}

impl Registration {
    /// Local key.
    pub fn lkey(&self) -> u32 {
        self.keys.lkey
    }
    /// Remote key.
    pub fn rkey(&self) -> u32 {
        self.keys.rkey
    }
    /// First byte.
    pub fn addr(&self) -> u64 {
        self.addr
    }
    /// Bytes.
    pub fn len(&self) -> u64 {
        self.len
    }
    /// Whether it covers no bytes (never: registrations are not empty).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// What a peer puts in its work requests: (address, rkey, length), 20 bytes.
    pub fn remote_bytes(&self) -> [u8; 20] {
        let mut b = [0u8; 20];
        b[0..8].copy_from_slice(&self.addr.to_le_bytes());
        b[8..12].copy_from_slice(&self.keys.rkey.to_le_bytes());
        b[12..20].copy_from_slice(&self.len.to_le_bytes());
        b
    }
}

/// A peer's region as its owner described it ([`Registration::remote_bytes`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RemoteRegion {
    /// First byte, at the owner's address.
    pub addr: u64,
    /// Remote key.
    pub rkey: u32,
    /// Bytes.
    pub len: u64,
}

impl RemoteRegion {
    /// Reads [`Registration::remote_bytes`].
    pub fn from_bytes(b: &[u8]) -> Result<RemoteRegion> {
        if b.len() != 20 {
            return Err(Error::invalid(
                "remote region",
                format!("{} bytes, expected 20", b.len()),
            ));
        }
        Ok(RemoteRegion {
            addr: u64::from_le_bytes(b[0..8].try_into().expect("8 bytes")),
            rkey: u32::from_le_bytes(b[8..12].try_into().expect("4 bytes")),
            len: u64::from_le_bytes(b[12..20].try_into().expect("8 bytes")),
        })
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        self.dev.provider.dereg_mr(self.keys);
    }
}

/// An RC queue pair and its CQ, in RESET: it has an endpoint to send to its peer and can only be
/// connected ([`QueuePair::connect`] takes it RESET -> INIT -> RTR -> RTS and gives a
/// [`ConnectedQp`], the only type work can be posted on). Destroyed on drop.
pub struct QueuePair {
    dev: Arc<IbDevice>,
    cq: Cq,
    qp: QpId,
    psn: u32,
}

impl std::fmt::Debug for QueuePair {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "QueuePair({:#x})", self.qp.qpn)
    }
}

impl QueuePair {
    /// Its QP number.
    pub fn qpn(&self) -> u32 {
        self.qp.qpn
    }

    /// The provider's handle (for calls this type does not wrap).
    pub fn id(&self) -> QpId {
        self.qp
    }

    /// What the peer connects to.
    pub fn endpoint(&self) -> Endpoint {
        self.dev.endpoint(self.qp.qpn, self.psn)
    }

    /// RESET -> INIT -> RTR -> RTS towards `remote` (a failed step destroys the QP).
    pub fn connect(self, remote: &Endpoint) -> Result<ConnectedQp> {
        let steps = rc_transitions(&self.dev.params, self.psn, remote);
        for (attr, mask) in &steps {
            self.dev.provider.modify_qp(self.qp, attr, *mask)?;
        }
        Ok(ConnectedQp(self))
    }

    /// For a QP taken to RTS with [`Provider::modify_qp`] directly (tests of the transitions and
    /// of what a NIC refuses): the caller vouches for its state; posting to a QP that is not in
    /// RTS fails at the NIC.
    pub fn assume_connected(self) -> ConnectedQp {
        ConnectedQp(self)
    }
}

/// A queue pair in RTS, connected to its peer's: what posters take.
#[derive(Debug)]
pub struct ConnectedQp(QueuePair);

impl ConnectedQp {
    /// Its QP number.
    pub fn qpn(&self) -> u32 {
        self.0.qp.qpn
    }

    /// The provider's handle.
    pub fn id(&self) -> QpId {
        self.0.qp
    }

    /// Its endpoint (as sent to the peer).
    pub fn endpoint(&self) -> Endpoint {
        self.0.endpoint()
    }

    /// Its mlx5 rings, for doorbell's own posters (valid while this value lives).
    pub fn rings(&self) -> Result<Rings> {
        self.0.dev.provider.rings(self.0.qp, self.0.cq)
    }

    /// `ibv_post_send`.
    pub fn post_send(&self, wrs: &[SendWr]) -> Result<()> {
        self.0.dev.provider.post_send(self.0.qp, wrs)
    }

    /// `ibv_poll_cq`: appends up to `max` completions.
    pub fn poll_cq(&self, max: usize, out: &mut Vec<WorkCompletion>) -> Result<usize> {
        self.0.dev.provider.poll_cq(self.0.cq, max, out)
    }

    /// The device it was made on.
    pub fn device(&self) -> &Arc<IbDevice> {
        &self.0.dev
    }
}

impl Drop for QueuePair {
    fn drop(&mut self) {
        self.dev.provider.destroy_qp(self.qp);
        self.dev.provider.destroy_cq(self.cq);
    }
}

/// Makes `per_peer` queue pairs to each rank in `peers` on `dev`, trades endpoints with every
/// rank over `bootstrap` (collective: every rank calls it, with its own peer list, which must be
/// symmetric), and connects them: `result[i]` holds the QPs to `peers[i]`, in RTS. QP `k` of
/// this rank to `p` connects to QP `k` of `p` to this rank.
pub fn connect_peers(
    bootstrap: &Bootstrap,
    dev: &Arc<IbDevice>,
    peers: &[usize],
    per_peer: usize,
    max_send_wr: u32,
) -> Result<Vec<Vec<ConnectedQp>>> {
    let world = bootstrap.world_size();
    let me = bootstrap.rank();
    let mut qps: Vec<Vec<QueuePair>> = Vec::with_capacity(peers.len());
    // Table: for each rank, `per_peer` endpoints (zeros where it is not a peer).
    let mut table = vec![0u8; world * per_peer * Endpoint::BYTES];
    for &p in peers {
        if p >= world || p == me {
            return Err(Error::invalid(
                "peers",
                format!("rank {p} in a job of {world} (this is rank {me})"),
            ));
        }
        let mut mine = Vec::with_capacity(per_peer);
        for k in 0..per_peer {
            let qp = dev.create_qp(max_send_wr)?;
            let at = (p * per_peer + k) * Endpoint::BYTES;
            table[at..at + Endpoint::BYTES].copy_from_slice(&qp.endpoint().to_bytes());
            mine.push(qp);
        }
        qps.push(mine);
    }
    let all = bootstrap.all_gather(&table)?;
    let mut done = Vec::with_capacity(peers.len());
    for (i, &p) in peers.iter().enumerate() {
        let theirs = all
            .get(p)
            .filter(|t| t.len() == table.len())
            .ok_or_else(|| Error::Bootstrap {
                me,
                rank: Some(p),
                why: "sent a malformed endpoint table".into(),
            })?;
        let mine = std::mem::take(&mut qps[i]);
        let mut connected = Vec::with_capacity(mine.len());
        for (k, qp) in mine.into_iter().enumerate() {
            let at = (me * per_peer + k) * Endpoint::BYTES;
            let remote = Endpoint::from_bytes(&theirs[at..at + Endpoint::BYTES])?;
            if remote.qpn == 0 {
                return Err(Error::Bootstrap {
                    me,
                    rank: Some(p),
                    why: format!("made no queue pair {k} for this rank (peer lists differ)"),
                });
            }
            let qpn = qp.qpn();
            connected.push(
                qp.connect(&remote)
                    .map_err(|e| Error::TransportUnavailable {
                        transport: "ib",
                        why: format!(
                            "rank {me}: connecting QP {qpn:#x} to rank {p}'s QP {:#x}: {e}",
                            remote.qpn
                        ),
                    })?,
            );
        }
        done.push(connected);
    }
    Ok(done)
}

/// Trades one region per rank (`mine`, or nothing) over `bootstrap`: entry `r` is rank `r`'s.
pub fn exchange_regions(
    bootstrap: &Bootstrap,
    mine: Option<&Registration>,
) -> Result<Vec<Option<RemoteRegion>>> {
    let bytes = mine.map_or([0u8; 20], |r| r.remote_bytes());
    bootstrap
        .all_gather(&bytes)?
        .iter()
        .enumerate()
        .map(|(r, b)| {
            let region = RemoteRegion::from_bytes(b).map_err(|_| Error::Bootstrap {
                me: bootstrap.rank(),
                rank: Some(r),
                why: "sent a malformed region".into(),
            })?;
            Ok((region.len != 0).then_some(region))
        })
        .collect()
}

/// The attribute sets of RESET -> INIT, INIT -> RTR and RTR -> RTS of an RC QP connected to
/// `remote`, as [`Provider::modify_qp`] takes them (attributes, mask).
pub fn rc_transitions(p: &RcParams, my_psn: u32, remote: &Endpoint) -> [(QpAttr, u32); 3] {
    let init = QpAttr {
        qp_state: QpState::Init as u32,
        port_num: p.port,
        qp_access_flags: p.access,
        ..Default::default()
    };
    let mut ah = AhAttr {
        dlid: remote.lid,
        port_num: p.port,
        ..Default::default()
    };
    if remote.lid == 0 {
        ah.is_global = 1;
        ah.grh.dgid = remote.gid;
        ah.grh.sgid_index = p.gid_index;
        ah.grh.hop_limit = 255;
    }
    let rtr = QpAttr {
        qp_state: QpState::Rtr as u32,
        path_mtu: p.mtu.min(remote.mtu),
        dest_qp_num: remote.qpn,
        rq_psn: remote.psn,
        max_dest_rd_atomic: p.max_dest_rd_atomic,
        min_rnr_timer: 12,
        ah_attr: ah,
        ..Default::default()
    };
    let rts = QpAttr {
        qp_state: QpState::Rts as u32,
        sq_psn: my_psn & 0xff_ffff,
        timeout: 14,
        retry_cnt: 7,
        rnr_retry: 7,
        max_rd_atomic: p.max_rd_atomic,
        ..Default::default()
    };
    [
        (init, mask::TO_INIT),
        (rtr, mask::TO_RTR),
        (rts, mask::TO_RTS),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_round_trip() {
        let e = Endpoint {
            qpn: 0x12_3456,
            psn: 0xab_cdef,
            lid: 7,
            gid: [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16],
            mtu: 5,
        };
        assert_eq!(Endpoint::from_bytes(&e.to_bytes()).unwrap(), e);
        assert!(Endpoint::from_bytes(&[0; 29]).is_err());
    }
}
