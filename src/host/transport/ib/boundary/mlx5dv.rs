//! The rings of a real mlx5 NIC's queue pairs, for doorbell's own posters: the send queue,
//! doorbell record, doorbell register (the UAR's BlueFlame page) and completion queue of a QP
//! made through rdma-core ([`crate::transport::ib::boundary::rdma_core`]), found with
//! `mlx5dv_init_obj` (libmlx5 loaded at run time) and then posted to by the same code that posts
//! to the emulated NIC: the proxy's mlx5 poster
//! ([`crate::transport::ib::posting::poster::HostPoster`]) or kernels
//! ([`crate::transport::ib::posting::gpu_qp::MappedQp`]: the rings registered into the GPU, the
//! doorbell register with `CU_MEMHOSTREGISTER_IOMEMORY` for IBGDA, or a host thread ringing for
//! CPU-assisted posting).
//!
//! The send queue and CQ stay in the host memory libmlx5 allocated: plain verbs and
//! `mlx5dv_init_obj`, no DEVX (NVSHMEM's and DOCA's IBGDA create their rings in GPU memory through
//! DEVX instead, which is faster and needs the PRM layouts).
//!
//! **Never run on a NIC**: the machines of this project have none. The structs are bindgen's of
//! `mlx5dv.h` ([`super::sys`]), also checked against the header in CI (`tests/verbs_layout.rs`);
//! `tests/ib_hw.rs` is the hardware test (`docs/rdma.md` gives the command).

use super::sys;
use crate::error::{Error, Result};
use std::ffi::{c_int, c_void};

/// `struct mlx5dv_qp` (mlx5dv.h; generated).
pub type DvQp = sys::mlx5dv_qp;

/// `struct mlx5dv_cq` (mlx5dv.h; generated).
pub type DvCq = sys::mlx5dv_cq;

/// `struct mlx5dv_obj` (mlx5dv.h; generated): (in, out) pointer pairs for QP, CQ, SRQ, RWQ, DM,
/// AH, PD.
pub type DvObj = sys::mlx5dv_obj;

/// `MLX5DV_OBJ_QP`.
pub const OBJ_QP: u64 = sys::MLX5DV_OBJ_QP as u64;
/// `MLX5DV_OBJ_CQ`.
pub const OBJ_CQ: u64 = sys::MLX5DV_OBJ_CQ as u64;

type InitObj = unsafe extern "C" fn(*mut DvObj, u64) -> c_int;

/// libmlx5's direct-verbs entry point, loaded at run time.
pub struct Mlx5 {
    lib: *mut c_void,
    init_obj: InitObj,
}

// SAFETY: a library handle and a thread-safe function pointer.
unsafe impl Send for Mlx5 {}
// SAFETY: as above.
unsafe impl Sync for Mlx5 {}

impl Mlx5 {
    /// Loads `libmlx5.so.1`.
    pub fn load() -> Result<Mlx5> {
        // SAFETY: dlopen of rdma-core's mlx5 provider library by name.
        let lib = unsafe { libc::dlopen(c"libmlx5.so.1".as_ptr(), libc::RTLD_NOW) };
        if lib.is_null() {
            return Err(Error::TransportUnavailable {
                transport: "ib",
                why: "cannot load libmlx5.so.1: install rdma-core's mlx5 provider \
                      (Debian/Ubuntu: apt install ibverbs-providers)"
                    .into(),
            });
        }
        // SAFETY: a live handle and a C string.
        let sym = unsafe { libc::dlsym(lib, c"mlx5dv_init_obj".as_ptr()) };
        if sym.is_null() {
            // SAFETY: opened above, closed once.
            unsafe { libc::dlclose(lib) };
            return Err(Error::TransportUnavailable {
                transport: "ib",
                why: "libmlx5.so.1 lacks mlx5dv_init_obj".into(),
            });
        }
        Ok(Mlx5 {
            lib,
            // SAFETY: the symbol has this signature in mlx5dv.h.
            init_obj: unsafe { std::mem::transmute::<*mut c_void, InitObj>(sym) },
        })
    }
}

impl Drop for Mlx5 {
    fn drop(&mut self) {
        // SAFETY: opened by load, closed once.
        unsafe { libc::dlclose(self.lib) };
    }
}

/// `mlx5dv_init_obj` on `qp` (number `qpn`) and `cq`: where their rings are, checked to be what
/// doorbell's posters drive (64-byte WQEBBs and CQEs, powers of two).
pub(crate) fn dv_rings(
    mlx5: &Mlx5,
    qp: *mut sys::ibv_qp,
    cq: *mut sys::ibv_cq,
    qpn: u32,
) -> Result<crate::transport::ib::boundary::provider::Rings> {
    let mut dv_qp = DvQp::default();
    let mut dv_cq = DvCq::default();
    // The other (in, out) pairs stay null: only the QP and CQ are asked for.
    let mut obj = DvObj::default();
    obj.qp.in_ = qp;
    obj.qp.out = &mut dv_qp;
    obj.cq.in_ = cq;
    obj.cq.out = &mut dv_cq;
    // SAFETY: live QP and CQ of an mlx5 context; the outputs point at whole `mlx5dv_qp` and
    // `mlx5dv_cq` structs.
    let r = unsafe { (mlx5.init_obj)(&mut obj, OBJ_QP | OBJ_CQ) };
    if r != 0 {
        return Err(Error::TransportUnavailable {
            transport: "ib",
            why: format!(
                "mlx5dv_init_obj failed ({}): not an mlx5 device?",
                std::io::Error::from_raw_os_error(r.abs())
            ),
        });
    }
    if dv_qp.sq.stride != 64 || !dv_qp.sq.wqe_cnt.is_power_of_two() || dv_qp.bf.reg.is_null() {
        return Err(Error::TransportUnavailable {
            transport: "ib",
            why: format!(
                "unexpected send queue: stride {}, {} WQEBBs, doorbell register {:?}",
                dv_qp.sq.stride, dv_qp.sq.wqe_cnt, dv_qp.bf.reg
            ),
        });
    }
    if dv_cq.cqe_size != 64 || !dv_cq.cqe_cnt.is_power_of_two() {
        return Err(Error::TransportUnavailable {
            transport: "ib",
            why: format!(
                "CQEs of {} bytes ({} of them): doorbell polls 64-byte CQEs (unset MLX5_CQE_SIZE)",
                dv_cq.cqe_size, dv_cq.cqe_cnt
            ),
        });
    }
    Ok(crate::transport::ib::boundary::provider::Rings {
        qpn,
        sq: dv_qp.sq.buf as *mut u8,
        sq_wqebbs: u64::from(dv_qp.sq.wqe_cnt),
        // SAFETY: dbrec is the QP's [receive, send] record pair.
        dbr: unsafe { dv_qp.dbrec.add(1) },
        doorbell: dv_qp.bf.reg as *mut u64,
        cq: dv_cq.buf as *mut u8,
        cq_entries: u64::from(dv_cq.cqe_cnt),
        cq_ci: dv_cq.dbrec,
        doorbell_is_mmio: true,
    })
}
