//! The verbs boundary: everything doorbell asks of an RDMA NIC, as one interface with two
//! providers. [`crate::transport::ib::boundary::rdma_core::RdmaCore`] calls rdma-core
//! (`libibverbs.so.1` and `libmlx5.so.1`, loaded at run time);
//! [`crate::transport::ib::emulated::Emulated`] answers the same calls with the emulated mlx5 NIC
//! and refuses what a ConnectX would refuse. The communicator and the proxy reach a NIC only
//! through this trait, so `DOORBELL_IB_EMULATE=1` runs exactly the calls a ConnectX would receive.
//!
//! Objects are named by plain handles ([`Pd`], [`Cq`], [`QpId`], [`MrKeys`]); whoever creates
//! one destroys it ([`Provider::destroy_qp`] and friends). [`crate::transport::ib::posting::conn`]
//! wraps them in owners.

use crate::error::Result;
use crate::gpu::cuda::Gpu;
use crate::transport::ib::boundary::sys;
use crate::transport::ib::boundary::verbs::{Port, QpAttr, QpCap};
use crate::transport::ib::posting::wqe::Op;

/// `IBV_ACCESS_*` flags (verbs.h, through [`sys`]): what a registration lets the NIC and the peers
/// do (the emulated NIC checks them as a ConnectX does).
pub mod access {
    use super::sys;
    /// The NIC may write the region for local work (a READ's or atomic's destination).
    pub const LOCAL_WRITE: u32 = sys::IBV_ACCESS_LOCAL_WRITE;
    /// Peers may RDMA WRITE into it.
    pub const REMOTE_WRITE: u32 = sys::IBV_ACCESS_REMOTE_WRITE;
    /// Peers may RDMA READ from it.
    pub const REMOTE_READ: u32 = sys::IBV_ACCESS_REMOTE_READ;
    /// Peers may run atomics on it.
    pub const REMOTE_ATOMIC: u32 = sys::IBV_ACCESS_REMOTE_ATOMIC;
    /// Writes into it may be delivered out of order (PCIe relaxed ordering).
    pub const RELAXED_ORDERING: u32 = sys::IBV_ACCESS_RELAXED_ORDERING;
    /// Everything but relaxed ordering.
    pub const ALL: u32 = LOCAL_WRITE | REMOTE_WRITE | REMOTE_READ | REMOTE_ATOMIC;
}

/// `IBV_QP_*` attribute mask bits (verbs.h, through [`sys`]) for [`Provider::modify_qp`].
pub mod mask {
    #![allow(missing_docs)]
    use super::sys;
    pub const STATE: u32 = sys::IBV_QP_STATE;
    pub const ACCESS_FLAGS: u32 = sys::IBV_QP_ACCESS_FLAGS;
    pub const PKEY_INDEX: u32 = sys::IBV_QP_PKEY_INDEX;
    pub const PORT: u32 = sys::IBV_QP_PORT;
    pub const AV: u32 = sys::IBV_QP_AV;
    pub const PATH_MTU: u32 = sys::IBV_QP_PATH_MTU;
    pub const TIMEOUT: u32 = sys::IBV_QP_TIMEOUT;
    pub const RETRY_CNT: u32 = sys::IBV_QP_RETRY_CNT;
    pub const RNR_RETRY: u32 = sys::IBV_QP_RNR_RETRY;
    pub const RQ_PSN: u32 = sys::IBV_QP_RQ_PSN;
    pub const MAX_QP_RD_ATOMIC: u32 = sys::IBV_QP_MAX_QP_RD_ATOMIC;
    pub const MIN_RNR_TIMER: u32 = sys::IBV_QP_MIN_RNR_TIMER;
    pub const SQ_PSN: u32 = sys::IBV_QP_SQ_PSN;
    pub const MAX_DEST_RD_ATOMIC: u32 = sys::IBV_QP_MAX_DEST_RD_ATOMIC;
    pub const DEST_QPN: u32 = sys::IBV_QP_DEST_QPN;

    /// What RESET -> INIT needs (IB spec 11.2.4.2, as rdma-core's providers enforce).
    pub const TO_INIT: u32 = STATE | PKEY_INDEX | PORT | ACCESS_FLAGS;
    /// What INIT -> RTR needs on an RC QP.
    pub const TO_RTR: u32 =
        STATE | AV | PATH_MTU | DEST_QPN | RQ_PSN | MAX_DEST_RD_ATOMIC | MIN_RNR_TIMER;
    /// What RTR -> RTS needs on an RC QP.
    pub const TO_RTS: u32 = STATE | TIMEOUT | RETRY_CNT | RNR_RETRY | SQ_PSN | MAX_QP_RD_ATOMIC;

    /// The names of the bits of `m`, for messages.
    pub fn names(m: u32) -> Vec<&'static str> {
        const ALL: [(u32, &str); 15] = [
            (STATE, "IBV_QP_STATE"),
            (ACCESS_FLAGS, "IBV_QP_ACCESS_FLAGS"),
            (PKEY_INDEX, "IBV_QP_PKEY_INDEX"),
            (PORT, "IBV_QP_PORT"),
            (AV, "IBV_QP_AV"),
            (PATH_MTU, "IBV_QP_PATH_MTU"),
            (TIMEOUT, "IBV_QP_TIMEOUT"),
            (RETRY_CNT, "IBV_QP_RETRY_CNT"),
            (RNR_RETRY, "IBV_QP_RNR_RETRY"),
            (RQ_PSN, "IBV_QP_RQ_PSN"),
            (MAX_QP_RD_ATOMIC, "IBV_QP_MAX_QP_RD_ATOMIC"),
            (MIN_RNR_TIMER, "IBV_QP_MIN_RNR_TIMER"),
            (SQ_PSN, "IBV_QP_SQ_PSN"),
            (MAX_DEST_RD_ATOMIC, "IBV_QP_MAX_DEST_RD_ATOMIC"),
            (DEST_QPN, "IBV_QP_DEST_QPN"),
        ];
        ALL.iter()
            .filter(|(b, _)| m & b != 0)
            .map(|(_, n)| *n)
            .collect()
    }
}

/// `enum ibv_qp_state` (values from [`sys`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum QpState {
    /// Just created.
    Reset = sys::IBV_QPS_RESET,
    /// Bound to a port, receives may be posted.
    Init = sys::IBV_QPS_INIT,
    /// Ready to receive: bound to its far end.
    Rtr = sys::IBV_QPS_RTR,
    /// Ready to send.
    Rts = sys::IBV_QPS_RTS,
    /// Send queue drained.
    Sqd = sys::IBV_QPS_SQD,
    /// Send queue error.
    Sqe = sys::IBV_QPS_SQE,
    /// Error: every work request is flushed.
    Err = sys::IBV_QPS_ERR,
}

impl QpState {
    /// From `ibv_qp_attr::qp_state`.
    pub fn from_raw(v: u32) -> Option<QpState> {
        Some(match v {
            sys::IBV_QPS_RESET => QpState::Reset,
            sys::IBV_QPS_INIT => QpState::Init,
            sys::IBV_QPS_RTR => QpState::Rtr,
            sys::IBV_QPS_RTS => QpState::Rts,
            sys::IBV_QPS_SQD => QpState::Sqd,
            sys::IBV_QPS_SQE => QpState::Sqe,
            sys::IBV_QPS_ERR => QpState::Err,
            _ => return None,
        })
    }
}

/// `enum ibv_mtu` (1 = 256 .. 5 = 4096) in bytes.
pub fn mtu_bytes(code: u32) -> u32 {
    match code {
        sys::IBV_MTU_256..=sys::IBV_MTU_4096 => 128 << code,
        _ => 0,
    }
}

/// Bytes to `enum ibv_mtu` (0 when not a valid MTU).
pub fn mtu_code(bytes: u32) -> u32 {
    (sys::IBV_MTU_256..=sys::IBV_MTU_4096)
        .find(|&c| mtu_bytes(c) == bytes)
        .unwrap_or(0)
}

/// A protection domain.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pd(pub u64);

/// A completion queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cq(pub u64);

/// A queue pair: the provider's handle and its QP number.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpId {
    /// The provider's handle.
    pub handle: u64,
    /// QP number (24 bits).
    pub qpn: u32,
}

/// A memory registration: the provider's handle and its keys.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MrKeys {
    /// The provider's handle.
    pub handle: u64,
    /// Local key.
    pub lkey: u32,
    /// Remote key (what peers put in their work requests).
    pub rkey: u32,
}

/// What is being registered.
#[derive(Clone, Copy)]
pub enum Memory<'a> {
    /// Host memory of this process.
    Host,
    /// Device memory of `gpu` (rdma-core: dma-buf first, nvidia-peermem second).
    Gpu(&'a Gpu),
}

/// Where a QP's mlx5 rings are, in this process's address space (`mlx5dv_init_obj`).
#[derive(Debug, Clone, Copy)]
pub struct Rings {
    /// QP number.
    pub qpn: u32,
    /// Send queue: `sq_wqebbs` WQEBBs of 64 bytes.
    pub sq: *mut u8,
    /// WQEBBs in the send queue (a power of two).
    pub sq_wqebbs: u64,
    /// Send doorbell record (big-endian producer index).
    pub dbr: *mut u32,
    /// The doorbell register (MMIO on a NIC; host memory on the emulator).
    pub doorbell: *mut u64,
    /// Whether `doorbell` is device MMIO (registered with `CU_MEMHOSTREGISTER_IOMEMORY`).
    pub doorbell_is_mmio: bool,
    /// Completion queue: `cq_entries` CQEs of 64 bytes.
    pub cq: *mut u8,
    /// CQEs in the CQ (a power of two).
    pub cq_entries: u64,
    /// CQ consumer-index record.
    pub cq_ci: *mut u32,
}

// SAFETY: plain addresses of memory owned by the provider's QP and CQ; whoever dereferences them
// does so while those live.
unsafe impl Send for Rings {}
// SAFETY: as above.
unsafe impl Sync for Rings {}

/// One work request for [`Provider::post_send`] (`struct ibv_send_wr` with one SGE).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SendWr {
    /// Returned in its completion.
    pub wr_id: u64,
    /// The operation, with its addresses and keys.
    pub op: Op,
    /// Whether it completes with a CQE (`IBV_SEND_SIGNALED`).
    pub signaled: bool,
}

/// `enum ibv_wc_status` values doorbell names (from [`sys`]).
pub mod wc_status {
    #![allow(missing_docs)]
    use super::sys;
    pub const SUCCESS: u32 = sys::IBV_WC_SUCCESS;
    pub const LOC_LEN_ERR: u32 = sys::IBV_WC_LOC_LEN_ERR;
    pub const LOC_QP_OP_ERR: u32 = sys::IBV_WC_LOC_QP_OP_ERR;
    pub const LOC_PROT_ERR: u32 = sys::IBV_WC_LOC_PROT_ERR;
    pub const WR_FLUSH_ERR: u32 = sys::IBV_WC_WR_FLUSH_ERR;
    pub const REM_INV_REQ_ERR: u32 = sys::IBV_WC_REM_INV_REQ_ERR;
    pub const REM_ACCESS_ERR: u32 = sys::IBV_WC_REM_ACCESS_ERR;
    pub const RETRY_EXC_ERR: u32 = sys::IBV_WC_RETRY_EXC_ERR;
    pub const GENERAL_ERR: u32 = sys::IBV_WC_GENERAL_ERR;

    /// A name for messages.
    pub fn name(s: u32) -> &'static str {
        match s {
            SUCCESS => "success",
            LOC_LEN_ERR => "local length error",
            LOC_QP_OP_ERR => "local QP operation error",
            LOC_PROT_ERR => "local protection error",
            WR_FLUSH_ERR => "flushed (the QP was in error)",
            REM_INV_REQ_ERR => "remote invalid request",
            REM_ACCESS_ERR => "remote access error",
            RETRY_EXC_ERR => "transport retry counter exceeded",
            _ => "error",
        }
    }

    /// The status an mlx5 error syndrome becomes (as libmlx5 maps them).
    pub fn from_mlx5(syndrome: u8) -> u32 {
        match syndrome {
            0x01 => LOC_LEN_ERR,
            0x02 => LOC_QP_OP_ERR,
            0x04 => LOC_PROT_ERR,
            0x05 => WR_FLUSH_ERR,
            0x12 => REM_INV_REQ_ERR,
            0x13 => REM_ACCESS_ERR,
            0x15 => RETRY_EXC_ERR,
            _ => GENERAL_ERR,
        }
    }
}

/// One completion from [`Provider::poll_cq`] (`struct ibv_wc`, the fields doorbell reads).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WorkCompletion {
    /// The work request's `wr_id`.
    pub wr_id: u64,
    /// `IBV_WC_*` status ([`wc_status`]).
    pub status: u32,
    /// The QP it completed on.
    pub qpn: u32,
    /// Bytes moved.
    pub byte_len: u32,
    /// The vendor's error code (mlx5 syndrome) on errors.
    pub vendor_err: u32,
}

/// The attributes of a connected RC queue pair's transitions, as doorbell sets them; the
/// endpoint of the far end fills the RTR part.
#[derive(Debug, Clone, Copy)]
pub struct RcParams {
    /// The local port.
    pub port: u8,
    /// Remote access granted to the far end (`IBV_ACCESS_*`).
    pub access: u32,
    /// Path MTU (`enum ibv_mtu`).
    pub mtu: u32,
    /// Local GID index (RoCE, or routed InfiniBand).
    pub gid_index: u8,
    /// READs and atomics accepted from the far end at once.
    pub max_dest_rd_atomic: u8,
    /// READs and atomics kept outstanding towards the far end.
    pub max_rd_atomic: u8,
}

/// Everything doorbell asks of an RDMA NIC. Implemented by rdma-core
/// ([`crate::transport::ib::boundary::rdma_core`]) and by the emulated NIC
/// ([`crate::transport::ib::emulated`]); errors name the call and the reason.
pub trait Provider: Send + Sync {
    /// The device's name (`mlx5_0`; `emulated_mlx5_<n>`).
    fn device_name(&self) -> &str;
    /// Whether this is the emulated NIC.
    fn is_emulated(&self) -> bool;
    /// Whether kernels can drive its queues with mlx5 WQEs ([`Provider::rings`] works).
    fn is_mlx5(&self) -> bool;
    /// `ibv_query_port` + `ibv_query_gid`: state, link layer, MTU, LID and GIDs of `port`.
    fn query_port(&self, port: u8) -> Result<Port>;
    /// `ibv_alloc_pd`.
    fn alloc_pd(&self) -> Result<Pd>;
    /// `ibv_dealloc_pd`.
    fn dealloc_pd(&self, pd: Pd);
    /// `ibv_reg_mr` (host memory, or GPU memory through nvidia-peermem) or
    /// `ibv_reg_dmabuf_mr` (GPU memory) with `access` (`IBV_ACCESS_*`).
    ///
    /// # Safety
    /// `[addr, addr + len)` is memory of this process (of `memory`'s kind) that stays allocated
    /// until [`Provider::dereg_mr`].
    unsafe fn reg_mr(
        &self,
        pd: Pd,
        addr: u64,
        len: usize,
        access: u32,
        memory: Memory<'_>,
    ) -> Result<MrKeys>;
    /// `ibv_dereg_mr`.
    fn dereg_mr(&self, mr: MrKeys);
    /// `ibv_create_cq` with at least `entries` CQEs.
    fn create_cq(&self, entries: u32) -> Result<Cq>;
    /// `ibv_destroy_cq`.
    fn destroy_cq(&self, cq: Cq);
    /// `ibv_create_qp`: an RC queue pair in RESET completing on `cq`.
    fn create_qp(&self, pd: Pd, cq: Cq, cap: QpCap) -> Result<QpId>;
    /// `ibv_modify_qp` with the attributes `mask` names (see [`mask`]).
    fn modify_qp(&self, qp: QpId, attr: &QpAttr, mask: u32) -> Result<()>;
    /// `ibv_destroy_qp`.
    fn destroy_qp(&self, qp: QpId);
    /// `mlx5dv_init_obj`: the send queue, doorbell record, doorbell register and CQ of `qp`
    /// (completing on `cq`), for doorbell's own posters (the proxy's mlx5 poster, kernels).
    fn rings(&self, qp: QpId, cq: Cq) -> Result<Rings>;
    /// `ibv_post_send` of `wrs`, in order.
    fn post_send(&self, qp: QpId, wrs: &[SendWr]) -> Result<()>;
    /// `ibv_poll_cq`: appends up to `max` completions to `out`; returns how many.
    fn poll_cq(&self, cq: Cq, max: usize, out: &mut Vec<WorkCompletion>) -> Result<usize>;
    /// The emulated wire: makes a peer's region (`rkey`, at the peer's `addr`) reachable at
    /// `local` in this process. A NIC reaches the peer over the network and needs nothing, so
    /// rdma-core's provider does nothing; the emulated NIC reaches it through `local`, the
    /// region's CUDA IPC mapping.
    fn attach_remote(&self, _rkey: u32, _addr: u64, _len: u64, _local: u64) -> Result<()> {
        Ok(())
    }
    /// What went wrong on the NIC beyond error completions, each naming the QP (the emulated
    /// NIC's protocol faults and the reasons of the errors it completed; rdma-core: none).
    fn faults(&self) -> Vec<String> {
        Vec::new()
    }
}

/// A GID in the usual text form, for messages.
pub fn gid_text(g: &[u8; 16]) -> String {
    std::net::Ipv6Addr::from(*g).to_string()
}
