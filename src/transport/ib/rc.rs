//! Verbs resources on a real NIC: protection domain, memory registration (GPU memory by dma-buf
//! first, nvidia-peermem as the fallback, with diagnostics that say what to install or set),
//! completion queue, and RC queue pairs whose RESET -> INIT -> RTR -> RTS transitions are a
//! typestate (a QP can only be moved forward, and only in order), with the endpoint that ranks
//! exchange over the bootstrap.
//!
//! **Never run on a NIC**: the machines of this project have none. What is checked: the struct
//! mirrors against `infiniband/verbs.h` (`tests/verbs_layout.rs`), the endpoint encoding, and that
//! every call fails with a reason where there is no device.

use super::verbs::{QpAttr, QpCap, QpInitAttr, Verbs};
use crate::error::{Error, Result};
use crate::gpu::cuda::Gpu;
use std::ffi::{c_void, CString};
use std::marker::PhantomData;
use std::sync::Arc;

/// Access flags (`IBV_ACCESS_*`).
pub mod access {
    /// The NIC may write local memory (receive, READ results, atomics' results).
    pub const LOCAL_WRITE: u32 = 1;
    /// Peers may RDMA WRITE it.
    pub const REMOTE_WRITE: u32 = 1 << 1;
    /// Peers may RDMA READ it.
    pub const REMOTE_READ: u32 = 1 << 2;
    /// Peers may run atomics on it.
    pub const REMOTE_ATOMIC: u32 = 1 << 3;
    /// PCIe relaxed ordering for data (never for signal words).
    pub const RELAXED_ORDERING: u32 = 1 << 20;
}

fn unavailable(what: &str, why: String) -> Error {
    Error::TransportUnavailable {
        transport: "ib",
        why: format!("{what}: {why}"),
    }
}

fn last_os() -> String {
    std::io::Error::last_os_error().to_string()
}

/// An open RDMA device.
pub struct Device {
    verbs: Arc<Verbs>,
    ctx: *mut c_void,
    name: String,
}

// SAFETY: verbs contexts may be used from any thread.
unsafe impl Send for Device {}
// SAFETY: as above.
unsafe impl Sync for Device {}

impl Device {
    /// Opens the device called `name` (as `doorbell-info` lists them).
    pub fn open(verbs: &Arc<Verbs>, name: &str) -> Result<Arc<Device>> {
        let ctx = verbs.open_by_name(name)?;
        Ok(Arc::new(Device {
            verbs: verbs.clone(),
            ctx,
            name: name.to_string(),
        }))
    }

    /// A protection domain.
    pub fn alloc_pd(self: &Arc<Self>) -> Result<Arc<Pd>> {
        // SAFETY: an open context.
        let pd = unsafe { (self.verbs.fns().alloc_pd)(self.ctx) };
        if pd.is_null() {
            return Err(unavailable(
                &self.name,
                format!("ibv_alloc_pd failed ({})", last_os()),
            ));
        }
        Ok(Arc::new(Pd {
            dev: self.clone(),
            pd,
        }))
    }

    /// A completion queue of at least `entries` CQEs.
    pub fn create_cq(self: &Arc<Self>, entries: i32) -> Result<Cq> {
        // SAFETY: an open context; no channel, no completion vector.
        let cq = unsafe {
            (self.verbs.fns().create_cq)(
                self.ctx,
                entries,
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                0,
            )
        };
        if cq.is_null() {
            return Err(unavailable(
                &self.name,
                format!("ibv_create_cq({entries}) failed ({})", last_os()),
            ));
        }
        Ok(Cq {
            dev: self.clone(),
            cq,
        })
    }
}

impl Drop for Device {
    fn drop(&mut self) {
        // SAFETY: opened by us, closed once; every child holds an Arc to this device.
        unsafe { (self.verbs.fns().close_device)(self.ctx) };
    }
}

/// A protection domain.
pub struct Pd {
    dev: Arc<Device>,
    pd: *mut c_void,
}

// SAFETY: as for Device.
unsafe impl Send for Pd {}
// SAFETY: as above.
unsafe impl Sync for Pd {}

impl Drop for Pd {
    fn drop(&mut self) {
        // SAFETY: allocated by us, freed once after every MR and QP (they hold Arcs).
        unsafe { (self.dev.verbs.fns().dealloc_pd)(self.pd) };
    }
}

/// A registered memory region.
pub struct Mr {
    pd: Arc<Pd>,
    mr: *mut super::verbs::MrRaw,
    /// How it was registered (for logs and `doorbell-info`).
    pub how: &'static str,
}

// SAFETY: as for Device.
unsafe impl Send for Mr {}
// SAFETY: as above.
unsafe impl Sync for Mr {}

impl Mr {
    /// The local key.
    pub fn lkey(&self) -> u32 {
        // SAFETY: a live MR from rdma-core.
        unsafe { (*self.mr).lkey }
    }
    /// The remote key.
    pub fn rkey(&self) -> u32 {
        // SAFETY: as above.
        unsafe { (*self.mr).rkey }
    }
}

impl Drop for Mr {
    fn drop(&mut self) {
        // SAFETY: registered by us, deregistered once.
        unsafe { (self.pd.dev.verbs.fns().dereg_mr)(self.mr) };
    }
}

impl Pd {
    /// Registers host memory.
    ///
    /// # Safety
    /// `[addr, addr + len)` is memory of this process that stays mapped until the MR drops.
    pub unsafe fn register_host(
        self: &Arc<Self>,
        addr: u64,
        len: usize,
        access: u32,
    ) -> Result<Mr> {
        // SAFETY: the caller vouches for the range.
        let mr = unsafe {
            (self.dev.verbs.fns().reg_mr)(self.pd, addr as *mut c_void, len, access as i32)
        };
        if mr.is_null() {
            return Err(unavailable(
                &self.dev.name,
                format!("ibv_reg_mr of host memory failed ({})", last_os()),
            ));
        }
        Ok(Mr {
            pd: self.clone(),
            mr,
            how: "host memory",
        })
    }

    /// Registers GPU memory: by dma-buf (`cuMemGetHandleForAddressRange` + `ibv_reg_dmabuf_mr`)
    /// first, else through nvidia-peermem (`ibv_reg_mr` on the device address); the error says
    /// what to install or set when neither works.
    ///
    /// # Safety
    /// `[addr, addr + len)` is device memory of `gpu` that stays allocated until the MR drops.
    pub unsafe fn register_gpu(
        self: &Arc<Self>,
        gpu: &Gpu,
        addr: u64,
        len: usize,
        access: u32,
    ) -> Result<Mr> {
        gpu.bind()?;
        let page = 1u64 << 16;
        let start = addr & !(page - 1);
        let end = (addr + len as u64).next_multiple_of(page);
        let mut fd: i32 = -1;
        // SAFETY: the range covers the caller's allocation (rounded to 64 KiB); `fd` receives a
        // dma-buf file descriptor owned by us.
        let r = unsafe {
            cudarc::driver::sys::cuMemGetHandleForAddressRange(
                &mut fd as *mut i32 as *mut c_void,
                start,
                (end - start) as usize,
                cudarc::driver::sys::CUmemRangeHandleType::CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD,
                0,
            )
        };
        let mut dmabuf_why = format!("cuMemGetHandleForAddressRange: {r:?}");
        if r == cudarc::driver::sys::CUresult::CUDA_SUCCESS && fd >= 0 {
            if let Some(reg) = self.dev.verbs.fns().reg_dmabuf_mr {
                // SAFETY: `fd` is a dma-buf of the range; offset and iova name the caller's bytes.
                let mr = unsafe { reg(self.pd, addr - start, len, addr, fd, access as i32) };
                // SAFETY: our descriptor; the MR keeps its own reference.
                unsafe { libc::close(fd) };
                if !mr.is_null() {
                    return Ok(Mr {
                        pd: self.clone(),
                        mr,
                        how: "dma-buf",
                    });
                }
                dmabuf_why = format!("ibv_reg_dmabuf_mr failed ({})", last_os());
            } else {
                // SAFETY: as above.
                unsafe { libc::close(fd) };
                dmabuf_why =
                    "libibverbs has no ibv_reg_dmabuf_mr (rdma-core older than v34)".into();
            }
        }
        // SAFETY: the caller vouches for the range; nvidia-peermem resolves device addresses.
        let mr = unsafe {
            (self.dev.verbs.fns().reg_mr)(self.pd, addr as *mut c_void, len, access as i32)
        };
        if !mr.is_null() {
            return Ok(Mr {
                pd: self.clone(),
                mr,
                how: "nvidia-peermem",
            });
        }
        Err(unavailable(
            &self.dev.name,
            format!(
                "GPU memory cannot be registered: dma-buf: {dmabuf_why}; nvidia-peermem: ibv_reg_mr \
                 failed ({}). Use the open nvidia kernel module (dma-buf) or `modprobe nvidia_peermem`",
                last_os()
            ),
        ))
    }

    /// An RC queue pair in RESET, completing on `cq` (send and receive).
    pub fn create_rc_qp(self: &Arc<Self>, cq: &Cq, cap: QpCap) -> Result<Qp<Reset>> {
        let mut attr = QpInitAttr {
            send_cq: cq.cq,
            recv_cq: cq.cq,
            cap,
            qp_type: 2, // IBV_QPT_RC
            ..Default::default()
        };
        // SAFETY: a live PD and CQ; `attr` is a full ibv_qp_init_attr.
        let qp = unsafe { (self.dev.verbs.fns().create_qp)(self.pd, &mut attr) };
        if qp.is_null() {
            return Err(unavailable(
                &self.dev.name,
                format!("ibv_create_qp failed ({})", last_os()),
            ));
        }
        Ok(Qp {
            pd: self.clone(),
            qp,
            _state: PhantomData,
        })
    }
}

/// A completion queue.
pub struct Cq {
    dev: Arc<Device>,
    cq: *mut c_void,
}

// SAFETY: as for Device.
unsafe impl Send for Cq {}

impl Cq {
    /// The `struct ibv_cq *`.
    pub(crate) fn raw(&self) -> *mut c_void {
        self.cq
    }
}

impl Drop for Cq {
    fn drop(&mut self) {
        // SAFETY: created by us, destroyed once (QPs on it must be gone: they borrow it only at
        // creation, so the owner drops QPs first).
        unsafe { (self.dev.verbs.fns().destroy_cq)(self.cq) };
    }
}

/// QP states, as types.
pub struct Reset;
/// Initialized: port and access flags set; receives may be posted.
pub struct Init;
/// Ready to receive: bound to the remote endpoint.
pub struct Rtr;
/// Ready to send.
pub struct Rts;

/// An RC queue pair in state `S`.
pub struct Qp<S> {
    pd: Arc<Pd>,
    qp: *mut super::verbs::QpRaw,
    _state: PhantomData<S>,
}

// SAFETY: as for Device.
unsafe impl<S> Send for Qp<S> {}

/// What a peer needs to connect to a QP: exchanged over the bootstrap.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Endpoint {
    /// QP number.
    pub qpn: u32,
    /// First packet sequence number it sends.
    pub psn: u32,
    /// LID (InfiniBand; 0 on RoCE).
    pub lid: u16,
    /// GID (RoCE, or routed InfiniBand).
    pub gid: [u8; 16],
}

impl Endpoint {
    /// 26 bytes, little-endian fields.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(26);
        b.extend_from_slice(&self.qpn.to_le_bytes());
        b.extend_from_slice(&self.psn.to_le_bytes());
        b.extend_from_slice(&self.lid.to_le_bytes());
        b.extend_from_slice(&self.gid);
        b
    }

    /// Reads what [`Endpoint::to_bytes`] wrote.
    pub fn from_bytes(b: &[u8]) -> Result<Endpoint> {
        if b.len() != 26 {
            return Err(Error::invalid(
                "endpoint",
                format!("{} bytes, expected 26", b.len()),
            ));
        }
        let u32_at = |o: usize| u32::from_le_bytes(b[o..o + 4].try_into().expect("4 bytes"));
        Ok(Endpoint {
            qpn: u32_at(0),
            psn: u32_at(4) & 0xff_ffff,
            lid: u16::from_le_bytes([b[8], b[9]]),
            gid: b[10..26].try_into().expect("16 bytes"),
        })
    }
}

impl<S> Qp<S> {
    /// The `struct ibv_qp *`.
    pub(crate) fn raw(&self) -> *mut super::verbs::QpRaw {
        self.qp
    }

    /// Its QP number.
    pub fn qpn(&self) -> u32 {
        // SAFETY: a live QP from rdma-core.
        unsafe { (*self.qp).qp_num }
    }

    fn modify<T>(self, attr: &mut QpAttr, mask: i32, what: &str) -> Result<Qp<T>> {
        // SAFETY: a live QP; `attr` is a full ibv_qp_attr.
        let r = unsafe { (self.pd.dev.verbs.fns().modify_qp)(self.qp, attr, mask) };
        if r != 0 {
            return Err(unavailable(
                &self.pd.dev.name,
                format!(
                    "ibv_modify_qp to {what} failed ({})",
                    std::io::Error::from_raw_os_error(r)
                ),
            ));
        }
        let next = Qp {
            pd: self.pd.clone(),
            qp: self.qp,
            _state: PhantomData,
        };
        std::mem::forget(self);
        Ok(next)
    }
}

impl<S> Drop for Qp<S> {
    fn drop(&mut self) {
        // SAFETY: created by us, destroyed once (a state change moves it without dropping).
        unsafe { (self.pd.dev.verbs.fns().destroy_qp)(self.qp) };
    }
}

const QP_STATE: i32 = 1;
const QP_ACCESS_FLAGS: i32 = 1 << 3;
const QP_PKEY_INDEX: i32 = 1 << 4;
const QP_PORT: i32 = 1 << 5;
const QP_AV: i32 = 1 << 7;
const QP_PATH_MTU: i32 = 1 << 8;
const QP_TIMEOUT: i32 = 1 << 9;
const QP_RETRY_CNT: i32 = 1 << 10;
const QP_RNR_RETRY: i32 = 1 << 11;
const QP_RQ_PSN: i32 = 1 << 12;
const QP_MAX_QP_RD_ATOMIC: i32 = 1 << 13;
const QP_MIN_RNR_TIMER: i32 = 1 << 15;
const QP_SQ_PSN: i32 = 1 << 16;
const QP_MAX_DEST_RD_ATOMIC: i32 = 1 << 17;
const QP_DEST_QPN: i32 = 1 << 20;

impl Qp<Reset> {
    /// RESET -> INIT on `port` with remote `access` (`access::*`).
    pub fn init(self, port: u8, access: u32) -> Result<Qp<Init>> {
        let mut a = QpAttr {
            qp_state: 1, // IBV_QPS_INIT
            port_num: port,
            qp_access_flags: access,
            ..Default::default()
        };
        self.modify(
            &mut a,
            QP_STATE | QP_PKEY_INDEX | QP_PORT | QP_ACCESS_FLAGS,
            "INIT",
        )
    }
}

impl Qp<Init> {
    /// INIT -> RTR, bound to `remote`: through `port`, with our GID `gid_index` (RoCE, or when
    /// `remote.lid` is 0) and path MTU `mtu` (`IBV_MTU_*`: 3 = 1024, 5 = 4096).
    pub fn rtr(self, remote: &Endpoint, port: u8, gid_index: u8, mtu: u32) -> Result<Qp<Rtr>> {
        let mut a = QpAttr {
            qp_state: 2, // IBV_QPS_RTR
            path_mtu: mtu,
            dest_qp_num: remote.qpn,
            rq_psn: remote.psn,
            max_dest_rd_atomic: 16,
            min_rnr_timer: 12,
            ..Default::default()
        };
        a.ah_attr.dlid = remote.lid;
        a.ah_attr.port_num = port;
        if remote.lid == 0 {
            a.ah_attr.is_global = 1;
            a.ah_attr.grh.dgid = remote.gid;
            a.ah_attr.grh.sgid_index = gid_index;
            a.ah_attr.grh.hop_limit = 255;
        }
        self.modify(
            &mut a,
            QP_STATE
                | QP_AV
                | QP_PATH_MTU
                | QP_DEST_QPN
                | QP_RQ_PSN
                | QP_MAX_DEST_RD_ATOMIC
                | QP_MIN_RNR_TIMER,
            "RTR",
        )
    }
}

impl Qp<Rtr> {
    /// RTR -> RTS, sending from `psn`.
    pub fn rts(self, psn: u32) -> Result<Qp<Rts>> {
        let mut a = QpAttr {
            qp_state: 3, // IBV_QPS_RTS
            sq_psn: psn & 0xff_ffff,
            timeout: 14,
            retry_cnt: 7,
            rnr_retry: 7,
            max_rd_atomic: 16,
            ..Default::default()
        };
        self.modify(
            &mut a,
            QP_STATE | QP_TIMEOUT | QP_RETRY_CNT | QP_RNR_RETRY | QP_SQ_PSN | QP_MAX_QP_RD_ATOMIC,
            "RTS",
        )
    }
}

/// Opens `name` on the loaded verbs library, for callers that only have a name.
pub fn open(name: &str) -> Result<Arc<Device>> {
    let verbs = Arc::new(Verbs::load()?);
    let _ = CString::new(name).map_err(|_| Error::invalid("device", "a name without NUL bytes"))?;
    Device::open(&verbs, name)
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
        };
        assert_eq!(Endpoint::from_bytes(&e.to_bytes()).unwrap(), e);
        assert!(Endpoint::from_bytes(&[0; 25]).is_err());
    }

    #[test]
    fn opening_a_missing_device_says_why() {
        match open("mlx5_does_not_exist") {
            Err(Error::TransportUnavailable { why, .. }) => assert!(!why.is_empty()),
            Err(e) => panic!("unexpected {e}"),
            Ok(_) => panic!("a device that does not exist opened"),
        }
    }
}
