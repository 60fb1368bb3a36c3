//! The rdma-core provider: [`Provider`] on a real NIC, every call going to `libibverbs.so.1`
//! (and `mlx5dv_init_obj` in `libmlx5.so.1` for [`Provider::rings`]), both loaded at run time.
//! `ibv_post_send` and `ibv_poll_cq` are inline functions in `verbs.h` that call through the
//! context's ops table (`ctx->ops.post_send`, `ctx->ops.poll_cq`); so does this, at the offsets
//! of bindgen's `ibv_context` ([`super::sys`]), which `tests/verbs_layout.rs` also checks against
//! the header.
//!
//! **Never run on a NIC**: the machines of this project have none. What is checked: the struct
//! mirrors and ops offsets against `verbs.h`, and that opening fails with a reason where there
//! is no device.
//!
//! `struct ibv_sge` and `struct ibv_wc` are bindgen's; `struct ibv_send_wr` is written by hand
//! ([`SendWrRaw`]): its `wr` member is a union of `rdma`, `atomic` and `ud` (and `imm_data` shares
//! a union too), which bindgen renders as nested unions and anonymous `__bindgen_*` members that
//! every work request would fill with `unsafe`; flattened here, pinned to bindgen's layout by a
//! unit test below and to the header by `tests/verbs_layout.rs`.

use crate::error::{Error, Result};
use crate::transport::ib::boundary::mlx5dv::{dv_rings, Mlx5};
use crate::transport::ib::boundary::provider::{
    Cq, Memory, MrKeys, Pd, Provider, QpId, Rings, SendWr, WorkCompletion,
};
use crate::transport::ib::boundary::sys;
use crate::transport::ib::boundary::verbs::{MrRaw, Port, QpAttr, QpCap, QpInitAttr, QpRaw, Verbs};
use crate::transport::ib::posting::wqe::Op;
use std::ffi::{c_int, c_void};
use std::sync::Arc;
use sys::{
    IBV_SEND_INLINE, IBV_SEND_SIGNALED, IBV_WR_ATOMIC_CMP_AND_SWP, IBV_WR_ATOMIC_FETCH_AND_ADD,
    IBV_WR_RDMA_READ, IBV_WR_RDMA_WRITE, IBV_WR_RDMA_WRITE_WITH_IMM,
};

/// `struct ibv_sge` (verbs.h; generated).
pub type Sge = sys::ibv_sge;

/// `struct ibv_send_wr` (128 bytes), by hand, with `wr.rdma` / `wr.atomic` flattened: `remote_addr` at
/// 40, then the RDMA rkey or the atomic's compare-add at 48, the swap at 56, the atomic's rkey
/// at 64.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
#[allow(missing_docs)]
pub struct SendWrRaw {
    pub wr_id: u64,
    pub next: *mut SendWrRaw,
    pub sg_list: *mut Sge,
    pub num_sge: c_int,
    pub opcode: u32,
    pub send_flags: u32,
    pub imm_data: u32,
    pub remote_addr: u64,
    pub rkey_or_compare_add: u64,
    pub swap: u64,
    pub atomic_rkey: u32,
    pub tail: [u32; 15],
}

/// `struct ibv_wc` (48 bytes; verbs.h; generated; doorbell reads no member of its union).
pub type WcRaw = sys::ibv_wc;

/// Byte offsets in `struct ibv_context` of `ops.poll_cq` and `ops.post_send`.
pub const CTX_POLL_CQ: usize = std::mem::offset_of!(sys::ibv_context, ops.poll_cq);
/// See [`CTX_POLL_CQ`].
pub const CTX_POST_SEND: usize = std::mem::offset_of!(sys::ibv_context, ops.post_send);

type PostSend = unsafe extern "C" fn(*mut QpRaw, *mut SendWrRaw, *mut *mut SendWrRaw) -> c_int;
type PollCq = unsafe extern "C" fn(*mut sys::ibv_cq, c_int, *mut WcRaw) -> c_int;

/// One opened RDMA device behind the verbs calls.
pub struct RdmaCore {
    verbs: Arc<Verbs>,
    mlx5: Option<Mlx5>,
    name: String,
    ctx: *mut sys::ibv_context,
}

// SAFETY: rdma-core's verbs are thread-safe; the context lives until Drop.
unsafe impl Send for RdmaCore {}
// SAFETY: as above.
unsafe impl Sync for RdmaCore {}

fn failed(call: &str, name: &str, e: impl std::fmt::Display) -> Error {
    Error::TransportUnavailable {
        transport: "ib",
        why: format!("{call} on {name} failed ({e})"),
    }
}

fn errno() -> std::io::Error {
    std::io::Error::last_os_error()
}

impl RdmaCore {
    /// Opens device `name` (libmlx5 too where it is an mlx5 device).
    pub fn open(verbs: Arc<Verbs>, name: &str) -> Result<RdmaCore> {
        let ctx = verbs.open_by_name(name)?;
        let mlx5 = if name.starts_with("mlx5") {
            Mlx5::load().ok()
        } else {
            None
        };
        Ok(RdmaCore {
            verbs,
            mlx5,
            name: name.to_string(),
            ctx,
        })
    }

    /// Opens the NIC port nearest the GPU with PCI bus id `gpu_bus_id` (`hca`: a
    /// `DOORBELL_IB_HCA` filter), with the choice and its reason.
    pub fn open_nearest(
        gpu_bus_id: &str,
        hca: Option<&str>,
    ) -> Result<(RdmaCore, crate::transport::ib::topology::NicChoice)> {
        use crate::transport::ib::topology::{choose_nic, NicCandidate};
        let verbs = Arc::new(Verbs::load()?);
        let nics = verbs.devices()?;
        let candidates: Vec<NicCandidate> = nics
            .iter()
            .flat_map(|n| {
                n.ports.iter().map(move |p| NicCandidate {
                    name: n.name.clone(),
                    port: p.num,
                    active: p.active(),
                })
            })
            .collect();
        if candidates.is_empty() {
            return Err(Error::TransportUnavailable {
                transport: "ib",
                why: "no RDMA NIC on this host".into(),
            });
        }
        let choice = choose_nic(std::path::Path::new("/sys"), gpu_bus_id, &candidates, hca)?;
        Ok((RdmaCore::open(verbs, &choice.name)?, choice))
    }

    fn op_at<T: Copy>(&self, ctx: *mut sys::ibv_context, offset: usize) -> T {
        // SAFETY: `ctx` is a live `struct ibv_context`; `offset` names a function pointer of its
        // ops table (offsets checked against verbs.h in tests/verbs_layout.rs).
        unsafe { *(ctx.cast::<u8>().add(offset) as *const T) }
    }
}

impl Drop for RdmaCore {
    fn drop(&mut self) {
        // SAFETY: opened by `open`, closed once, after every object made from it (the provider
        // is held by every owner of those objects).
        unsafe { (self.verbs.fns().close_device)(self.ctx) };
    }
}

fn encode(wr: &SendWr, sge: &mut Sge) -> Result<SendWrRaw> {
    let mut raw = SendWrRaw {
        wr_id: wr.wr_id,
        next: std::ptr::null_mut(),
        sg_list: sge,
        num_sge: 1,
        opcode: 0,
        send_flags: if wr.signaled { IBV_SEND_SIGNALED } else { 0 },
        imm_data: 0,
        remote_addr: 0,
        rkey_or_compare_add: 0,
        swap: 0,
        atomic_rkey: 0,
        tail: [0; 15],
    };
    match &wr.op {
        Op::Write {
            raddr,
            rkey,
            laddr,
            lkey,
            len,
        }
        | Op::Read {
            raddr,
            rkey,
            laddr,
            lkey,
            len,
        } => {
            *sge = Sge {
                addr: *laddr,
                length: *len,
                lkey: *lkey,
            };
            raw.opcode = if matches!(wr.op, Op::Read { .. }) {
                IBV_WR_RDMA_READ
            } else {
                IBV_WR_RDMA_WRITE
            };
            raw.remote_addr = *raddr;
            raw.rkey_or_compare_add = u64::from(*rkey);
        }
        Op::WriteImm {
            raddr,
            rkey,
            laddr,
            lkey,
            len,
            imm,
        } => {
            *sge = Sge {
                addr: *laddr,
                length: *len,
                lkey: *lkey,
            };
            raw.opcode = IBV_WR_RDMA_WRITE_WITH_IMM;
            raw.imm_data = *imm;
            raw.remote_addr = *raddr;
            raw.rkey_or_compare_add = u64::from(*rkey);
        }
        Op::WriteInline {
            raddr,
            rkey,
            payload,
        } => {
            // The payload is copied into the WQE during the call.
            *sge = Sge {
                addr: payload.as_ptr() as u64,
                length: payload.len() as u32,
                lkey: 0,
            };
            raw.opcode = IBV_WR_RDMA_WRITE;
            raw.send_flags |= IBV_SEND_INLINE;
            raw.remote_addr = *raddr;
            raw.rkey_or_compare_add = u64::from(*rkey);
        }
        Op::FetchAdd {
            raddr,
            rkey,
            add,
            result,
            lkey,
        } => {
            *sge = Sge {
                addr: *result,
                length: 8,
                lkey: *lkey,
            };
            raw.opcode = IBV_WR_ATOMIC_FETCH_AND_ADD;
            raw.remote_addr = *raddr;
            raw.rkey_or_compare_add = *add;
            raw.atomic_rkey = *rkey;
        }
        Op::CompareSwap {
            raddr,
            rkey,
            compare,
            swap,
            result,
            lkey,
        } => {
            *sge = Sge {
                addr: *result,
                length: 8,
                lkey: *lkey,
            };
            raw.opcode = IBV_WR_ATOMIC_CMP_AND_SWP;
            raw.remote_addr = *raddr;
            raw.rkey_or_compare_add = *compare;
            raw.swap = *swap;
            raw.atomic_rkey = *rkey;
        }
        other => {
            return Err(Error::invalid(
                "work request",
                format!("{other:?} has no ibv_post_send form here"),
            ))
        }
    }
    Ok(raw)
}

impl Provider for RdmaCore {
    fn device_name(&self) -> &str {
        &self.name
    }

    fn is_emulated(&self) -> bool {
        false
    }

    fn is_mlx5(&self) -> bool {
        self.mlx5.is_some()
    }

    fn query_port(&self, port: u8) -> Result<Port> {
        self.verbs
            .devices()?
            .into_iter()
            .find(|n| n.name == self.name)
            .and_then(|n| n.ports.into_iter().find(|p| p.num == port))
            .ok_or_else(|| failed("ibv_query_port", &self.name, format!("no port {port}")))
    }

    fn alloc_pd(&self) -> Result<Pd> {
        // SAFETY: a live context.
        let pd = unsafe { (self.verbs.fns().alloc_pd)(self.ctx) };
        if pd.is_null() {
            return Err(failed("ibv_alloc_pd", &self.name, errno()));
        }
        Ok(Pd(pd as u64))
    }

    fn dealloc_pd(&self, pd: Pd) {
        // SAFETY: allocated by alloc_pd, released once by its owner.
        unsafe { (self.verbs.fns().dealloc_pd)(pd.0 as *mut sys::ibv_pd) };
    }

    unsafe fn reg_mr(
        &self,
        pd: Pd,
        addr: u64,
        len: usize,
        access: u32,
        memory: Memory<'_>,
    ) -> Result<MrKeys> {
        let fns = self.verbs.fns();
        let pd_ptr = pd.0 as *mut sys::ibv_pd;
        let mut why_dmabuf = String::new();
        if let Memory::Gpu(gpu) = memory {
            gpu.bind()?;
            let page = 1u64 << 16;
            let start = addr & !(page - 1);
            let end = (addr + len as u64).next_multiple_of(page);
            let mut fd: i32 = -1;
            // SAFETY: the range covers the caller's allocation (rounded to 64 KiB); `fd`
            // receives a dma-buf descriptor owned here.
            let r = unsafe {
                cudarc::driver::sys::cuMemGetHandleForAddressRange(
                    &mut fd as *mut i32 as *mut c_void,
                    start,
                    (end - start) as usize,
                    cudarc::driver::sys::CUmemRangeHandleType::CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD,
                    0,
                )
            };
            why_dmabuf = format!("cuMemGetHandleForAddressRange: {r:?}");
            if r == cudarc::driver::sys::CUresult::CUDA_SUCCESS && fd >= 0 {
                if let Some(reg) = fns.reg_dmabuf_mr {
                    // SAFETY: `fd` is a dma-buf of the range; offset and iova name the bytes.
                    let mr = unsafe { reg(pd_ptr, addr - start, len, addr, fd, access as c_int) };
                    // SAFETY: our descriptor; the MR holds its own reference.
                    unsafe { libc::close(fd) };
                    if !mr.is_null() {
                        // SAFETY: a live MR from rdma-core.
                        let m = unsafe { &*mr };
                        return Ok(MrKeys {
                            handle: mr as u64,
                            lkey: m.lkey,
                            rkey: m.rkey,
                        });
                    }
                    why_dmabuf = format!("ibv_reg_dmabuf_mr failed ({})", errno());
                } else {
                    // SAFETY: as above.
                    unsafe { libc::close(fd) };
                    why_dmabuf = "libibverbs has no ibv_reg_dmabuf_mr (rdma-core < v34)".into();
                }
            }
        }
        // SAFETY: the caller vouches for the range (host memory, or device memory that
        // nvidia-peermem resolves).
        let mr: *mut MrRaw =
            unsafe { (fns.reg_mr)(pd_ptr, addr as *mut c_void, len, access as c_int) };
        if mr.is_null() {
            let hint = if why_dmabuf.is_empty() {
                String::new()
            } else {
                format!(
                    "; GPU memory by dma-buf: {why_dmabuf}; use the open nvidia kernel module \
                     (dma-buf) or `modprobe nvidia_peermem`"
                )
            };
            return Err(failed(
                "ibv_reg_mr",
                &self.name,
                format!("{}{hint}", errno()),
            ));
        }
        // SAFETY: a live MR from rdma-core.
        let m = unsafe { &*mr };
        Ok(MrKeys {
            handle: mr as u64,
            lkey: m.lkey,
            rkey: m.rkey,
        })
    }

    fn dereg_mr(&self, mr: MrKeys) {
        // SAFETY: registered by reg_mr, deregistered once by its owner.
        unsafe { (self.verbs.fns().dereg_mr)(mr.handle as *mut MrRaw) };
    }

    fn create_cq(&self, entries: u32) -> Result<Cq> {
        // SAFETY: a live context; no channel, no completion vector.
        let cq = unsafe {
            (self.verbs.fns().create_cq)(
                self.ctx,
                entries as c_int,
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                0,
            )
        };
        if cq.is_null() {
            return Err(failed("ibv_create_cq", &self.name, errno()));
        }
        Ok(Cq(cq as u64))
    }

    fn destroy_cq(&self, cq: Cq) {
        // SAFETY: created by create_cq, destroyed once after its QPs.
        unsafe { (self.verbs.fns().destroy_cq)(cq.0 as *mut sys::ibv_cq) };
    }

    fn create_qp(&self, pd: Pd, cq: Cq, cap: QpCap) -> Result<QpId> {
        let mut attr = QpInitAttr {
            send_cq: cq.0 as *mut sys::ibv_cq,
            recv_cq: cq.0 as *mut sys::ibv_cq,
            cap,
            qp_type: sys::IBV_QPT_RC,
            ..Default::default()
        };
        // SAFETY: a live PD and CQ; `attr` is a full ibv_qp_init_attr.
        let qp = unsafe { (self.verbs.fns().create_qp)(pd.0 as *mut sys::ibv_pd, &mut attr) };
        if qp.is_null() {
            return Err(failed("ibv_create_qp", &self.name, errno()));
        }
        Ok(QpId {
            handle: qp as u64,
            // SAFETY: a live QP.
            qpn: unsafe { (*qp).qp_num },
        })
    }

    fn modify_qp(&self, qp: QpId, attr: &QpAttr, mask: u32) -> Result<()> {
        let mut a = *attr;
        // SAFETY: a live QP; `a` is a full ibv_qp_attr.
        let r =
            unsafe { (self.verbs.fns().modify_qp)(qp.handle as *mut QpRaw, &mut a, mask as c_int) };
        if r != 0 {
            return Err(failed(
                "ibv_modify_qp",
                &self.name,
                format!(
                    "QP {:#x} to state {}: {}",
                    qp.qpn,
                    attr.qp_state,
                    std::io::Error::from_raw_os_error(r)
                ),
            ));
        }
        Ok(())
    }

    fn destroy_qp(&self, qp: QpId) {
        // SAFETY: created by create_qp, destroyed once.
        unsafe { (self.verbs.fns().destroy_qp)(qp.handle as *mut QpRaw) };
    }

    fn rings(&self, qp: QpId, cq: Cq) -> Result<Rings> {
        let mlx5 = self
            .mlx5
            .as_ref()
            .ok_or_else(|| Error::TransportUnavailable {
                transport: "ib",
                why: format!(
                    "{} is not an mlx5 device (or libmlx5.so.1 is missing): its queues take only \
                 ibv_post_send (DOORBELL_IB_POSTING=verbs)",
                    self.name
                ),
            })?;
        dv_rings(
            mlx5,
            qp.handle as *mut QpRaw,
            cq.0 as *mut sys::ibv_cq,
            qp.qpn,
        )
    }

    fn post_send(&self, qp: QpId, wrs: &[SendWr]) -> Result<()> {
        if wrs.is_empty() {
            return Ok(());
        }
        let mut sges = vec![Sge::default(); wrs.len()];
        let mut raws = Vec::with_capacity(wrs.len());
        for (wr, sge) in wrs.iter().zip(sges.iter_mut()) {
            raws.push(encode(wr, sge)?);
        }
        let n = raws.len();
        for i in 0..n - 1 {
            let next: *mut SendWrRaw = &mut raws[i + 1];
            raws[i].next = next;
        }
        let qp_ptr = qp.handle as *mut QpRaw;
        // SAFETY: a live QP; its first field is its context.
        let ctx = unsafe { (*qp_ptr).context };
        let post: PostSend = self.op_at(ctx, CTX_POST_SEND);
        let mut bad: *mut SendWrRaw = std::ptr::null_mut();
        // SAFETY: a chain of `n` work requests with their SGEs, alive for the call.
        let r = unsafe { post(qp_ptr, raws.as_mut_ptr(), &mut bad) };
        if r != 0 {
            let at = if bad.is_null() {
                0
            } else {
                // SAFETY: `bad` points into `raws`.
                unsafe { bad.offset_from(raws.as_ptr()) }
            };
            return Err(failed(
                "ibv_post_send",
                &self.name,
                format!(
                    "QP {:#x}, work request {at} of {n}: {}",
                    qp.qpn,
                    std::io::Error::from_raw_os_error(r)
                ),
            ));
        }
        Ok(())
    }

    fn poll_cq(&self, cq: Cq, max: usize, out: &mut Vec<WorkCompletion>) -> Result<usize> {
        let cq_ptr = cq.0 as *mut sys::ibv_cq;
        // SAFETY: a live CQ; its first field is its context.
        let ctx = unsafe { *(cq_ptr as *const *mut sys::ibv_context) };
        let poll: PollCq = self.op_at(ctx, CTX_POLL_CQ);
        let mut wcs = [WcRaw::default(); 32];
        let room = max.clamp(1, wcs.len());
        // SAFETY: room for `room` completions.
        let n = unsafe { poll(cq_ptr, room as c_int, wcs.as_mut_ptr()) };
        if n < 0 {
            return Err(failed("ibv_poll_cq", &self.name, errno()));
        }
        for w in &wcs[..n as usize] {
            out.push(WorkCompletion {
                wr_id: w.wr_id,
                status: w.status,
                qpn: w.qp_num,
                byte_len: w.byte_len,
                vendor_err: w.vendor_err,
            });
        }
        Ok(n as usize)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::ib::boundary::assert_same_layout;

    /// The flattened `ibv_send_wr` against bindgen's, union members by their paths.
    #[test]
    fn send_wr_lays_out_as_bindgen_does() {
        assert_same_layout!(SendWrRaw, sys::ibv_send_wr, [
            wr_id => wr_id, next => next, sg_list => sg_list, num_sge => num_sge,
            opcode => opcode, send_flags => send_flags, imm_data => __bindgen_anon_1.imm_data,
            remote_addr => wr.rdma.remote_addr, rkey_or_compare_add => wr.atomic.compare_add,
            swap => wr.atomic.swap, atomic_rkey => wr.atomic.rkey,
        ]);
        assert_eq!(
            std::mem::offset_of!(SendWrRaw, rkey_or_compare_add),
            std::mem::offset_of!(sys::ibv_send_wr, wr.rdma.rkey),
            "the RDMA rkey shares its offset with the atomic's compare-add"
        );
    }
}
