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
//! **Never run on a NIC**: the machines of this project have none. The struct mirrors are checked
//! against `mlx5dv.h` in CI (`tests/verbs_layout.rs`); `tests/ib_hw.rs` is the hardware test
//! (`docs/rdma.md` gives the command).

use crate::error::{Error, Result};
use std::ffi::{c_int, c_void};

/// `struct mlx5dv_qp` (mlx5dv.h).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
#[allow(missing_docs)]
pub struct DvQp {
    pub dbrec: *mut u32,
    pub sq_buf: *mut c_void,
    pub sq_wqe_cnt: u32,
    pub sq_stride: u32,
    pub rq_buf: *mut c_void,
    pub rq_wqe_cnt: u32,
    pub rq_stride: u32,
    pub bf_reg: *mut c_void,
    pub bf_size: u32,
    pub comp_mask: u64,
    pub uar_mmap_offset: i64,
    pub tirn: u32,
    pub tisn: u32,
    pub rqn: u32,
    pub sqn: u32,
    pub tir_icm_addr: u64,
}

/// `struct mlx5dv_cq` (mlx5dv.h).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
#[allow(missing_docs)]
pub struct DvCq {
    pub buf: *mut c_void,
    pub dbrec: *mut u32,
    pub cqe_cnt: u32,
    pub cqe_size: u32,
    pub cq_uar: *mut c_void,
    pub cqn: u32,
    pub comp_mask: u64,
}

/// `struct mlx5dv_obj` (mlx5dv.h): (in, out) pointer pairs for QP, CQ, SRQ, RWQ, DM, AH, PD.
#[repr(C)]
#[allow(missing_docs)]
pub struct DvObj {
    pub qp_in: *mut c_void,
    pub qp_out: *mut DvQp,
    pub cq_in: *mut c_void,
    pub cq_out: *mut DvCq,
    pub others: [[*mut c_void; 2]; 5],
}

/// `MLX5DV_OBJ_QP`.
pub const OBJ_QP: u64 = 1;
/// `MLX5DV_OBJ_CQ`.
pub const OBJ_CQ: u64 = 2;

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

/// `mlx5dv_init_obj` on `qp` (a `struct ibv_qp *`, number `qpn`) and `cq`: where their rings
/// are, checked to be what doorbell's posters drive (64-byte WQEBBs and CQEs, powers of two).
pub(crate) fn dv_rings(
    mlx5: &Mlx5,
    qp: *mut c_void,
    cq: *mut c_void,
    qpn: u32,
) -> Result<crate::transport::ib::boundary::provider::Rings> {
    let mut dv_qp: DvQp = unsafe_zeroed();
    let mut dv_cq: DvCq = unsafe_zeroed();
    let mut obj = DvObj {
        qp_in: qp,
        qp_out: &mut dv_qp,
        cq_in: cq,
        cq_out: &mut dv_cq,
        others: [[std::ptr::null_mut(); 2]; 5],
    };
    // SAFETY: live QP and CQ of an mlx5 context; outputs point at full mirrors.
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
    if dv_qp.sq_stride != 64 || !dv_qp.sq_wqe_cnt.is_power_of_two() || dv_qp.bf_reg.is_null() {
        return Err(Error::TransportUnavailable {
            transport: "ib",
            why: format!(
                "unexpected send queue: stride {}, {} WQEBBs, doorbell register {:?}",
                dv_qp.sq_stride, dv_qp.sq_wqe_cnt, dv_qp.bf_reg
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
        sq: dv_qp.sq_buf as *mut u8,
        sq_wqebbs: u64::from(dv_qp.sq_wqe_cnt),
        // SAFETY: dbrec is the QP's [receive, send] record pair.
        dbr: unsafe { dv_qp.dbrec.add(1) },
        doorbell: dv_qp.bf_reg as *mut u64,
        cq: dv_cq.buf as *mut u8,
        cq_entries: u64::from(dv_cq.cqe_cnt),
        cq_ci: dv_cq.dbrec,
        doorbell_is_mmio: true,
    })
}

fn unsafe_zeroed<T: Copy>() -> T {
    // SAFETY: only used for the plain-data mirrors above (pointers and integers; all-zero is
    // a valid value of each).
    unsafe { std::mem::zeroed() }
}
