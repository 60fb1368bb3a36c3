//! Queue pairs on a real mlx5 NIC whose rings doorbell's own posters drive: an RC QP made with
//! plain verbs ([`super::rc`]), its send queue, doorbell record, doorbell register (the UAR's
//! BlueFlame page) and completion queue found with `mlx5dv_init_obj` (libmlx5 loaded at run
//! time), then posted to by the same code that posts to the emulated NIC: the CPU poster
//! ([`super::host_qp::HostQp::on_hardware`], the verbs-proxy side) or kernels
//! ([`HwQp::map_for_gpu`]: the rings registered into the GPU, the doorbell register with
//! `CU_MEMHOSTREGISTER_IOMEMORY` for IBGDA, or a host thread ringing for CPU-assisted posting).
//!
//! The send queue and CQ stay in the host memory libmlx5 allocated (the bring-up path of
//! `shared/reference/ibgda.md` 1.1, option 2: no DEVX, slower than GPU-memory rings).
//!
//! **Never run on a NIC**: the machines of this project have none. The struct mirrors are checked
//! against `mlx5dv.h` in CI (`tests/verbs_layout.rs`); `tests/ib_hw.rs` is the hardware test
//! (`docs/rdma.md` gives the command).

use super::gpu_qp::{register, DeviceRings, GpuPoster, Posting, Registrations, SendPtr};
use super::rc::{access, Cq, Device, Endpoint, Pd, Qp, Rts};
use super::verbs::{choose_gid, QpCap, Verbs};
use crate::device_api::{IbQpHandle, WaitSite};
use crate::error::{Error, Result};
use crate::gpu::cuda::Gpu;
use std::ffi::{c_int, c_void};
use std::sync::atomic::{fence, Ordering};
use std::sync::Arc;

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

/// Where a QP's rings are, in this process's address space.
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
    /// The doorbell register (MMIO).
    pub doorbell: *mut u64,
    /// Completion queue: `cq_entries` CQEs of 64 bytes.
    pub cq: *mut u8,
    /// CQEs in the CQ (a power of two).
    pub cq_entries: u64,
    /// CQ consumer-index record.
    pub cq_ci: *mut u32,
}

/// An RC queue pair on a real mlx5 NIC, connected (RTS), with its rings. The QP drops before its
/// CQ (field order).
pub struct HwQp {
    _qp: Qp<Rts>,
    _cq: Cq,
    rings: Rings,
    endpoint: Endpoint,
}

// SAFETY: the rings are libmlx5 memory owned by the QP and CQ held here.
unsafe impl Send for HwQp {}

/// A QP made but not yet connected: its endpoint goes to the peer.
pub struct HwQpInit {
    qp: Qp<super::rc::Init>,
    cq: Cq,
    /// What the peer connects to.
    pub endpoint: Endpoint,
    port: u8,
    gid_index: u8,
    mtu: u32,
}

/// An open mlx5 device and port ready to make queue pairs.
pub struct HwPort {
    mlx5: Mlx5,
    device: Arc<Device>,
    /// The PD queue pairs and registrations use.
    pub pd: Arc<Pd>,
    port: u8,
    lid: u16,
    gid: [u8; 16],
    gid_index: u8,
    mtu: u32,
}

impl HwPort {
    /// Opens `name` (an mlx5 device; `None`: the first with an active port) on its first active
    /// port; `gid_override` as `DOORBELL_IB_GID_INDEX`.
    pub fn open(
        verbs: &Arc<Verbs>,
        name: Option<&str>,
        gid_override: Option<u32>,
    ) -> Result<HwPort> {
        let nics = verbs.devices()?;
        let nic = nics
            .iter()
            .filter(|n| n.is_mlx5())
            .find(|n| name.is_none_or(|want| n.name == want) && n.ports.iter().any(|p| p.active()))
            .ok_or_else(|| Error::TransportUnavailable {
                transport: "ib",
                why: match name {
                    Some(n) => format!("no mlx5 device {n} with an active port"),
                    None => format!(
                        "no mlx5 device with an active port (found: {})",
                        nics.iter()
                            .map(|n| n.name.as_str())
                            .collect::<Vec<_>>()
                            .join(", ")
                    ),
                },
            })?;
        let port = nic
            .ports
            .iter()
            .find(|p| p.active())
            .expect("checked above");
        let gid = choose_gid(port, gid_override)?;
        let mtu = match port.active_mtu {
            4096 => 5,
            2048 => 4,
            1024 => 3,
            512 => 2,
            _ => 1,
        };
        let device = Device::open(verbs, &nic.name)?;
        let pd = device.alloc_pd()?;
        Ok(HwPort {
            mlx5: Mlx5::load()?,
            device,
            pd,
            port: port.num,
            lid: port.lid,
            gid: gid.bytes,
            gid_index: gid.index as u8,
            mtu,
        })
    }

    /// A QP with at least `2^sq_log2` WQEBBs in INIT, remote access for writes, reads and
    /// atomics; connect it with [`HwQpInit::connect`].
    pub fn create_qp(&self, sq_log2: u32) -> Result<HwQpInit> {
        let depth = 1u32 << sq_log2;
        // Every WQEBB may carry a signaled WQE: the CQ is at least as deep as the send queue.
        let cq = self.device.create_cq(depth as i32)?;
        let cap = QpCap {
            max_send_wr: depth / 4,
            max_recv_wr: 1,
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: 64,
        };
        let qp = self.pd.create_rc_qp(&cq, cap)?.init(
            self.port,
            access::LOCAL_WRITE
                | access::REMOTE_WRITE
                | access::REMOTE_READ
                | access::REMOTE_ATOMIC,
        )?;
        let psn = (qp.qpn().wrapping_mul(2_654_435_761)) & 0xff_ffff;
        Ok(HwQpInit {
            endpoint: Endpoint {
                qpn: qp.qpn(),
                psn,
                lid: self.lid,
                gid: self.gid,
            },
            qp,
            cq,
            port: self.port,
            gid_index: self.gid_index,
            mtu: self.mtu,
        })
    }

    /// Connects `init` to `remote` and finds its rings.
    pub fn connect(&self, init: HwQpInit, remote: &Endpoint) -> Result<HwQp> {
        let HwQpInit {
            qp,
            cq,
            endpoint,
            port,
            gid_index,
            mtu,
        } = init;
        let qp = qp.rtr(remote, port, gid_index, mtu)?.rts(endpoint.psn)?;
        let r = dv_rings(&self.mlx5, qp.raw() as *mut c_void, cq.raw(), qp.qpn())?;
        let rings = Rings {
            qpn: r.qpn,
            sq: r.sq,
            sq_wqebbs: r.sq_wqebbs,
            dbr: r.dbr,
            doorbell: r.doorbell,
            cq: r.cq,
            cq_entries: r.cq_entries,
            cq_ci: r.cq_ci,
        };
        Ok(HwQp {
            _qp: qp,
            _cq: cq,
            rings,
            endpoint,
        })
    }

    /// Two QPs of this port connected to each other (loopback through the NIC).
    pub fn loopback_pair(&self, sq_log2: u32) -> Result<(HwQp, HwQp)> {
        let (a, b) = (self.create_qp(sq_log2)?, self.create_qp(sq_log2)?);
        let (ea, eb) = (a.endpoint, b.endpoint);
        Ok((self.connect(a, &eb)?, self.connect(b, &ea)?))
    }
}

/// `mlx5dv_init_obj` on `qp` (a `struct ibv_qp *`, number `qpn`) and `cq`: where their rings
/// are, checked to be what doorbell's posters drive (64-byte WQEBBs and CQEs, powers of two).
pub(crate) fn dv_rings(
    mlx5: &Mlx5,
    qp: *mut c_void,
    cq: *mut c_void,
    qpn: u32,
) -> Result<super::provider::Rings> {
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
    Ok(super::provider::Rings {
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

impl HwQp {
    /// Its rings.
    pub fn rings(&self) -> Rings {
        self.rings
    }

    /// Its endpoint.
    pub fn endpoint(&self) -> Endpoint {
        self.endpoint
    }

    /// Maps the rings into `gpu` for kernels to post (see `IbQpHandle`): the send queue, doorbell
    /// record and CQ registered as mapped host memory; with `ibgda` the doorbell register too
    /// (`CU_MEMHOSTREGISTER_IOMEMORY`, which stock drivers refuse without
    /// `NVreg_RegistryDwords=PeerMappingOverride=1`), else a host thread rings for the kernels.
    pub fn map_for_gpu(self, gpu: &Arc<Gpu>, ibgda: bool, site: WaitSite) -> Result<GpuHwQp> {
        gpu.bind()?;
        let r = self.rings;
        let sq_log2 = r.sq_wqebbs.trailing_zeros();
        let cq_log2 = r.cq_entries.trailing_zeros();
        if !(7..=15).contains(&sq_log2) {
            return Err(Error::invalid(
                "send queue",
                format!("{} WQEBBs: kernels post to 2^7..=2^15", r.sq_wqebbs),
            ));
        }
        let mut regs = Registrations(Vec::new());
        let sq = register(&mut regs, r.sq as u64, r.sq_wqebbs * 64, false)?;
        let dbr = register(&mut regs, r.dbr as u64, 4, false)?;
        let cq = register(&mut regs, r.cq as u64, r.cq_entries * 64, false)?;
        let cq_ci = register(&mut regs, r.cq_ci as u64, 4, false)?;
        let doorbell = if ibgda {
            register(&mut regs, r.doorbell as u64, 8, true).map_err(|e| {
                Error::TransportUnavailable {
                    transport: "ib",
                    why: format!(
                        "the doorbell register cannot be mapped into the GPU ({e}); set \
                     NVreg_RegistryDwords=PeerMappingOverride=1 for the nvidia module, or use \
                     DOORBELL_IB_POSTING=cpu"
                    ),
                }
            })?
        } else {
            0
        };
        let posting = if ibgda {
            Posting::Ibgda
        } else {
            Posting::CpuAssisted
        };
        let (dbr_host, doorbell_host) = (SendPtr(r.dbr as *mut u8), SendPtr(r.doorbell as *mut u8));
        let (poster, handle) = GpuPoster::start(
            gpu,
            DeviceRings {
                sq,
                dbr,
                doorbell,
                cq,
                cq_ci,
                qpn: r.qpn,
                sq_log2,
                cq_log2,
            },
            posting,
            site,
            // SAFETY: the QP's send record and doorbell register, alive until the poster is
            // stopped (GpuHwQp's Drop, before the QP goes).
            move |v| unsafe { (dbr_host.get() as *mut u32).write_volatile(v) },
            move |v| unsafe { (doorbell_host.get() as *mut u64).write_volatile(v) },
        )?;
        Ok(GpuHwQp {
            handle,
            poster,
            _regs: regs,
            _qp: self,
        })
    }
}

/// A hardware QP mapped into a GPU: what kernels take, and the thread that rings for them in
/// CPU-assisted posting. Dropping it stops the thread, unregisters the rings, then closes the QP.
pub struct GpuHwQp {
    handle: IbQpHandle,
    poster: GpuPoster,
    _regs: Registrations,
    _qp: HwQp,
}

impl GpuHwQp {
    /// What kernels take.
    pub fn handle(&self) -> IbQpHandle {
        self.handle
    }
}

impl Drop for GpuHwQp {
    fn drop(&mut self) {
        // The ringing thread first; then (fields, in order) the registrations, then the QP.
        self.poster.stop();
        fence(Ordering::SeqCst);
    }
}
