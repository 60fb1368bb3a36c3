//! rdma-core loaded at run time (`dlopen("libibverbs.so.1")`, never linked), so a doorbell binary
//! starts on machines without it and says what is missing: device discovery (devices, firmware,
//! vendor ids, ports with their state, link layer (InfiniBand or Ethernet = RoCE), MTU and GID
//! tables), GID selection, and the resource calls [`Fns`] that the rdma-core provider makes.
//!
//! The verbs structs are bindgen's ([`super::sys`], generated from `infiniband/verbs.h`), named
//! here for doorbell; the symbols are typed with them. Three are written by hand because the
//! header puts a `union ibv_gid` inside them ([`GlobalRoute`], and so [`AhAttr`] and [`QpAttr`]):
//! bindgen's union would make every caller that sets or reads a GID use `unsafe` and would lose
//! `Debug`/`PartialEq`; here the GID is its 16 bytes. They are pinned to bindgen's layout by a
//! unit test below and to the header by `tests/verbs_layout.rs`.

use super::sys;
use super::sys::{ibv_context, ibv_cq, ibv_device, ibv_pd};
use crate::error::{Error, Result};
use std::ffi::{c_char, c_int, c_void, CStr};
use std::net::Ipv4Addr;

/// `struct ibv_device_attr` (verbs.h; generated).
pub type DeviceAttr = sys::ibv_device_attr;

/// `struct ibv_port_attr` (verbs.h; generated; the exported `ibv_query_port` fills the same
/// prefix).
pub type PortAttr = sys::ibv_port_attr;

/// `struct ibv_gid_entry` (verbs.h; generated).
pub type GidEntry = sys::ibv_gid_entry;

/// `struct ibv_qp_cap` (verbs.h; generated).
pub type QpCap = sys::ibv_qp_cap;

/// `struct ibv_qp_init_attr` (verbs.h; generated).
pub type QpInitAttr = sys::ibv_qp_init_attr;

/// `struct ibv_global_route` (verbs.h), by hand: `dgid` is `union ibv_gid` there, its 16 bytes
/// here. Aligned to 8 like the union (it holds two u64s), which makes `ibv_ah_attr` and
/// `ibv_qp_attr` 8-aligned too.
#[repr(C, align(8))]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[allow(missing_docs)]
pub struct GlobalRoute {
    pub dgid: [u8; 16],
    pub flow_label: u32,
    pub sgid_index: u8,
    pub hop_limit: u8,
    pub traffic_class: u8,
}

/// `struct ibv_ah_attr` (verbs.h), by hand because it holds a [`GlobalRoute`].
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[allow(missing_docs)]
pub struct AhAttr {
    pub grh: GlobalRoute,
    pub dlid: u16,
    pub sl: u8,
    pub src_path_bits: u8,
    pub static_rate: u8,
    pub is_global: u8,
    pub port_num: u8,
}

/// `struct ibv_qp_attr` (verbs.h), by hand because it holds two [`AhAttr`]s.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[allow(missing_docs)]
pub struct QpAttr {
    pub qp_state: sys::ibv_qp_state,
    pub cur_qp_state: sys::ibv_qp_state,
    pub path_mtu: sys::ibv_mtu,
    pub path_mig_state: sys::ibv_mig_state,
    pub qkey: u32,
    pub rq_psn: u32,
    pub sq_psn: u32,
    pub dest_qp_num: u32,
    pub qp_access_flags: u32,
    pub cap: QpCap,
    pub ah_attr: AhAttr,
    pub alt_ah_attr: AhAttr,
    pub pkey_index: u16,
    pub alt_pkey_index: u16,
    pub en_sqd_async_notify: u8,
    pub sq_draining: u8,
    pub max_rd_atomic: u8,
    pub max_dest_rd_atomic: u8,
    pub min_rnr_timer: u8,
    pub port_num: u8,
    pub timeout: u8,
    pub retry_cnt: u8,
    pub rnr_retry: u8,
    pub alt_port_num: u8,
    pub alt_timeout: u8,
    pub rate_limit: u32,
}

/// `struct ibv_mr` (verbs.h; generated): what is read from a registration.
pub type MrRaw = sys::ibv_mr;

/// `struct ibv_qp` (verbs.h; generated).
pub type QpRaw = sys::ibv_qp;

/// A port's link layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LinkLayer {
    /// InfiniBand.
    Infiniband,
    /// Ethernet (RoCE).
    Ethernet,
    /// Not reported.
    Unspecified,
}

/// What a GID addresses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GidType {
    /// InfiniBand.
    Ib,
    /// RoCE v1 (Ethernet frames, not routable).
    RoceV1,
    /// RoCE v2 (UDP/IP, routable).
    RoceV2,
}

/// One GID table entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Gid {
    /// Its index in the port's table.
    pub index: u32,
    /// The 16 bytes.
    pub bytes: [u8; 16],
    /// Its type.
    pub kind: GidType,
}

impl Gid {
    /// The IPv4 address of an IPv4-mapped GID (`::ffff:a.b.c.d`).
    pub fn ipv4(&self) -> Option<Ipv4Addr> {
        let b = &self.bytes;
        (b[..10].iter().all(|&x| x == 0) && b[10] == 0xff && b[11] == 0xff)
            .then(|| Ipv4Addr::new(b[12], b[13], b[14], b[15]))
    }

    /// Whether the entry is empty (all zero).
    pub fn is_zero(&self) -> bool {
        self.bytes.iter().all(|&x| x == 0)
    }
}

/// One port of a NIC.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Port {
    /// Port number (from 1).
    pub num: u8,
    /// `IBV_PORT_*` state (`IBV_PORT_ACTIVE` = 4).
    pub state: u32,
    /// Link layer.
    pub link_layer: LinkLayer,
    /// Active MTU in bytes.
    pub active_mtu: u32,
    /// Its LID (InfiniBand; 0 on RoCE).
    pub lid: u16,
    /// Its non-empty GIDs.
    pub gids: Vec<Gid>,
}

impl Port {
    /// Whether the port is up.
    pub fn active(&self) -> bool {
        self.state == sys::IBV_PORT_ACTIVE || self.state == sys::IBV_PORT_ACTIVE_DEFER
    }
}

/// One RDMA device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Nic {
    /// Device name (`mlx5_0`).
    pub name: String,
    /// Firmware version.
    pub firmware: String,
    /// PCI vendor id (0x02c9 and 0x15b3 are Mellanox/NVIDIA).
    pub vendor_id: u32,
    /// PCI device id.
    pub vendor_part_id: u32,
    /// Its ports.
    pub ports: Vec<Port>,
}

impl Nic {
    /// Whether the mlx5 provider drives it (the one whose WQEs a GPU can build).
    pub fn is_mlx5(&self) -> bool {
        self.name.starts_with("mlx5") || self.vendor_id == 0x15b3 || self.vendor_id == 0x02c9
    }
}

/// The GID a connection on `port` uses: `override_index` if given (it must exist), else for
/// InfiniBand index 0, for RoCE the first RoCE v2 GID with an IPv4-mapped address, then any
/// RoCE v2 GID, then any GID (as NCCL picks).
pub fn choose_gid(port: &Port, override_index: Option<u32>) -> Result<Gid> {
    if let Some(i) = override_index {
        return port
            .gids
            .iter()
            .find(|g| g.index == i)
            .copied()
            .ok_or_else(|| {
                Error::invalid(
                    "DOORBELL_IB_GID_INDEX",
                    format!("port {} has no GID at index {i}", port.num),
                )
            });
    }
    let v2 = |g: &&Gid| g.kind == GidType::RoceV2;
    let pick = match port.link_layer {
        LinkLayer::Infiniband => port.gids.iter().find(|g| g.index == 0),
        _ => port
            .gids
            .iter()
            .filter(v2)
            .find(|g| g.ipv4().is_some())
            .or_else(|| port.gids.iter().find(v2)),
    };
    pick.or_else(|| port.gids.first())
        .copied()
        .ok_or_else(|| Error::TransportUnavailable {
            transport: "ib",
            why: format!(
                "port {} has no GID (is the link up and addressed?)",
                port.num
            ),
        })
}

type GetDeviceList = unsafe extern "C" fn(*mut c_int) -> *mut *mut ibv_device;
type FreeDeviceList = unsafe extern "C" fn(*mut *mut ibv_device);
type GetDeviceName = unsafe extern "C" fn(*mut ibv_device) -> *const c_char;
type OpenDevice = unsafe extern "C" fn(*mut ibv_device) -> *mut ibv_context;
type CloseDevice = unsafe extern "C" fn(*mut ibv_context) -> c_int;
type QueryDevice = unsafe extern "C" fn(*mut ibv_context, *mut DeviceAttr) -> c_int;
type QueryPort = unsafe extern "C" fn(*mut ibv_context, u8, *mut PortAttr) -> c_int;
type QueryGidEx =
    unsafe extern "C" fn(*mut ibv_context, u32, u32, *mut GidEntry, u32, usize) -> c_int;
type AllocPd = unsafe extern "C" fn(*mut ibv_context) -> *mut ibv_pd;
type DeallocPd = unsafe extern "C" fn(*mut ibv_pd) -> c_int;
type RegMr = unsafe extern "C" fn(*mut ibv_pd, *mut c_void, usize, c_int) -> *mut MrRaw;
type RegDmabufMr = unsafe extern "C" fn(*mut ibv_pd, u64, usize, u64, c_int, c_int) -> *mut MrRaw;
type DeregMr = unsafe extern "C" fn(*mut MrRaw) -> c_int;
/// `ibv_create_cq(context, cqe, cq_context, channel, comp_vector)`; doorbell passes no completion
/// channel, so that argument stays untyped.
type CreateCq =
    unsafe extern "C" fn(*mut ibv_context, c_int, *mut c_void, *mut c_void, c_int) -> *mut ibv_cq;
type DestroyCq = unsafe extern "C" fn(*mut ibv_cq) -> c_int;
type CreateQp = unsafe extern "C" fn(*mut ibv_pd, *mut QpInitAttr) -> *mut QpRaw;
type DestroyQp = unsafe extern "C" fn(*mut QpRaw) -> c_int;
/// `ibv_modify_qp`, with the hand-written [`QpAttr`] (laid out as `struct ibv_qp_attr`).
type ModifyQp = unsafe extern "C" fn(*mut QpRaw, *mut QpAttr, c_int) -> c_int;

/// The verbs calls the rdma-core provider ([`crate::transport::ib::boundary::rdma_core`]) makes,
/// resolved at load.
#[allow(missing_docs)]
pub struct Fns {
    pub close_device: CloseDevice,
    pub alloc_pd: AllocPd,
    pub dealloc_pd: DeallocPd,
    pub reg_mr: RegMr,
    /// Absent before rdma-core v34.
    pub reg_dmabuf_mr: Option<RegDmabufMr>,
    pub dereg_mr: DeregMr,
    pub create_cq: CreateCq,
    pub destroy_cq: DestroyCq,
    pub create_qp: CreateQp,
    pub destroy_qp: DestroyQp,
    pub modify_qp: ModifyQp,
}

/// libibverbs, loaded.
pub struct Verbs {
    lib: *mut c_void,
    get_device_list: GetDeviceList,
    free_device_list: FreeDeviceList,
    get_device_name: GetDeviceName,
    open_device: OpenDevice,
    close_device: CloseDevice,
    query_device: QueryDevice,
    query_port: QueryPort,
    query_gid_ex: QueryGidEx,
    fns: Fns,
}

// SAFETY: the library handle and function pointers may be used from any thread (rdma-core's
// verbs are thread-safe).
unsafe impl Send for Verbs {}
// SAFETY: as above.
unsafe impl Sync for Verbs {}

fn dl_error() -> String {
    // SAFETY: dlerror returns a thread-local C string or null.
    let e = unsafe { libc::dlerror() };
    if e.is_null() {
        "unknown error".into()
    } else {
        // SAFETY: non-null C string from dlerror.
        unsafe { CStr::from_ptr(e) }.to_string_lossy().into_owned()
    }
}

impl Verbs {
    /// Loads `libibverbs.so.1`.
    pub fn load() -> Result<Verbs> {
        // SAFETY: dlopen of a library by name; its initializers are rdma-core's.
        let lib = unsafe {
            libc::dlopen(
                c"libibverbs.so.1".as_ptr(),
                libc::RTLD_NOW | libc::RTLD_LOCAL,
            )
        };
        if lib.is_null() {
            return Err(Error::TransportUnavailable {
                transport: "ib",
                why: format!(
                    "cannot load libibverbs.so.1 ({}): install rdma-core's libraries \
                     (Debian/Ubuntu: apt install libibverbs1 ibverbs-providers)",
                    dl_error()
                ),
            });
        }
        let sym = |name: &CStr| -> Result<*mut c_void> {
            // SAFETY: `lib` is a live handle; `name` a C string.
            let p = unsafe { libc::dlsym(lib, name.as_ptr()) };
            if p.is_null() {
                Err(Error::TransportUnavailable {
                    transport: "ib",
                    why: format!(
                        "libibverbs.so.1 lacks {} ({}): rdma-core too old",
                        name.to_string_lossy(),
                        dl_error()
                    ),
                })
            } else {
                Ok(p)
            }
        };
        use std::mem::transmute;
        // SAFETY (each transmute): the symbol has exactly this C signature in rdma-core's
        // verbs.h, typed with bindgen's structs of that header (and the hand-written QpAttr,
        // pinned to its layout).
        let v = unsafe {
            Verbs {
                lib,
                get_device_list: transmute::<*mut c_void, GetDeviceList>(sym(
                    c"ibv_get_device_list",
                )?),
                free_device_list: transmute::<*mut c_void, FreeDeviceList>(sym(
                    c"ibv_free_device_list",
                )?),
                get_device_name: transmute::<*mut c_void, GetDeviceName>(sym(
                    c"ibv_get_device_name",
                )?),
                open_device: transmute::<*mut c_void, OpenDevice>(sym(c"ibv_open_device")?),
                close_device: transmute::<*mut c_void, CloseDevice>(sym(c"ibv_close_device")?),
                query_device: transmute::<*mut c_void, QueryDevice>(sym(c"ibv_query_device")?),
                query_port: transmute::<*mut c_void, QueryPort>(sym(c"ibv_query_port")?),
                query_gid_ex: transmute::<*mut c_void, QueryGidEx>(sym(c"_ibv_query_gid_ex")?),
                fns: Fns {
                    close_device: transmute::<*mut c_void, CloseDevice>(sym(c"ibv_close_device")?),
                    alloc_pd: transmute::<*mut c_void, AllocPd>(sym(c"ibv_alloc_pd")?),
                    dealloc_pd: transmute::<*mut c_void, DeallocPd>(sym(c"ibv_dealloc_pd")?),
                    reg_mr: transmute::<*mut c_void, RegMr>(sym(c"ibv_reg_mr")?),
                    reg_dmabuf_mr: sym(c"ibv_reg_dmabuf_mr")
                        .ok()
                        .map(|p| transmute::<*mut c_void, RegDmabufMr>(p)),
                    dereg_mr: transmute::<*mut c_void, DeregMr>(sym(c"ibv_dereg_mr")?),
                    create_cq: transmute::<*mut c_void, CreateCq>(sym(c"ibv_create_cq")?),
                    destroy_cq: transmute::<*mut c_void, DestroyCq>(sym(c"ibv_destroy_cq")?),
                    create_qp: transmute::<*mut c_void, CreateQp>(sym(c"ibv_create_qp")?),
                    destroy_qp: transmute::<*mut c_void, DestroyQp>(sym(c"ibv_destroy_qp")?),
                    modify_qp: transmute::<*mut c_void, ModifyQp>(sym(c"ibv_modify_qp")?),
                },
            }
        };
        Ok(v)
    }

    /// The resource calls.
    pub fn fns(&self) -> &Fns {
        &self.fns
    }

    /// Opens the device called `name`; the caller closes it with `fns().close_device`.
    pub fn open_by_name(&self, name: &str) -> Result<*mut ibv_context> {
        let mut n: c_int = 0;
        // SAFETY: rdma-core allocates the list; freed below.
        let list = unsafe { (self.get_device_list)(&mut n) };
        if list.is_null() {
            return Err(Error::TransportUnavailable {
                transport: "ib",
                why: format!(
                    "cannot open RDMA device {name:?}: ibv_get_device_list found none ({})",
                    std::io::Error::last_os_error()
                ),
            });
        }
        let mut found = std::ptr::null_mut();
        for i in 0..n.max(0) as usize {
            // SAFETY: `list` holds `n` device pointers, each with a name.
            let dev = unsafe { *list.add(i) };
            // SAFETY: as above.
            let dev_name = unsafe { CStr::from_ptr((self.get_device_name)(dev)) };
            if dev_name.to_bytes() == name.as_bytes() {
                // SAFETY: a device of the list.
                found = unsafe { (self.open_device)(dev) };
                break;
            }
        }
        // SAFETY: the list from ibv_get_device_list, freed once (opened contexts stay valid).
        unsafe { (self.free_device_list)(list) };
        if found.is_null() {
            return Err(Error::TransportUnavailable {
                transport: "ib",
                why: format!("no RDMA device {name:?} could be opened (see doorbell-info)"),
            });
        }
        Ok(found)
    }

    /// Every RDMA device with its ports and GIDs. Devices that cannot be opened or queried are
    /// skipped with a warning.
    pub fn devices(&self) -> Result<Vec<Nic>> {
        let mut n: c_int = 0;
        // SAFETY: rdma-core allocates the list; freed below.
        let list = unsafe { (self.get_device_list)(&mut n) };
        if list.is_null() {
            let e = std::io::Error::last_os_error();
            let why = if e.raw_os_error() == Some(libc::ENOSYS) {
                "no RDMA devices: this kernel has no RDMA support (ibv_get_device_list: ENOSYS)"
                    .to_string()
            } else {
                format!("ibv_get_device_list failed ({e}): is the RDMA kernel stack (ib_uverbs) loaded?")
            };
            return Err(Error::TransportUnavailable {
                transport: "ib",
                why,
            });
        }
        let mut nics = Vec::new();
        for i in 0..n.max(0) as usize {
            // SAFETY: `list` holds `n` device pointers.
            let dev = unsafe { *list.add(i) };
            match self.describe(dev) {
                Ok(nic) => nics.push(nic),
                Err(e) => tracing::warn!("RDMA device {i}: {e}"),
            }
        }
        // SAFETY: the list from ibv_get_device_list, freed once.
        unsafe { (self.free_device_list)(list) };
        Ok(nics)
    }

    fn describe(&self, dev: *mut ibv_device) -> Result<Nic> {
        // SAFETY: `dev` from the device list.
        let name = unsafe { CStr::from_ptr((self.get_device_name)(dev)) }
            .to_string_lossy()
            .into_owned();
        let unavailable = |what: &str| Error::TransportUnavailable {
            transport: "ib",
            why: format!(
                "{name}: {what} failed ({})",
                std::io::Error::last_os_error()
            ),
        };
        // SAFETY: `dev` from the device list; the context is closed below.
        let ctx = unsafe { (self.open_device)(dev) };
        if ctx.is_null() {
            return Err(unavailable("ibv_open_device"));
        }
        let result = (|| {
            let mut attr = DeviceAttr::default();
            // SAFETY: `ctx` is open; `attr` is a full ibv_device_attr.
            if unsafe { (self.query_device)(ctx, &mut attr) } != 0 {
                return Err(unavailable("ibv_query_device"));
            }
            let firmware = CStr::from_bytes_until_nul(&attr.fw_ver.map(|c| c as u8))
                .map(|c| c.to_string_lossy().into_owned())
                .unwrap_or_default();
            let mut ports = Vec::new();
            for num in 1..=attr.phys_port_cnt {
                let mut p = PortAttr::default();
                // SAFETY: `ctx` is open; `p` is at least the compat layout.
                if unsafe { (self.query_port)(ctx, num, &mut p) } != 0 {
                    return Err(unavailable("ibv_query_port"));
                }
                let mut gids = Vec::new();
                for index in 0..p.gid_tbl_len.max(0) as u32 {
                    let mut e = GidEntry::default();
                    // SAFETY: `ctx` open; `e` is a full ibv_gid_entry of the size passed.
                    let r = unsafe {
                        (self.query_gid_ex)(
                            ctx,
                            u32::from(num),
                            index,
                            &mut e,
                            0,
                            std::mem::size_of::<GidEntry>(),
                        )
                    };
                    if r != 0 {
                        continue; // empty or unreadable entry
                    }
                    let kind = match e.gid_type {
                        sys::IBV_GID_TYPE_ROCE_V1 => GidType::RoceV1,
                        sys::IBV_GID_TYPE_ROCE_V2 => GidType::RoceV2,
                        _ => GidType::Ib,
                    };
                    let g = Gid {
                        index,
                        // SAFETY: `raw` spans the whole union and any 16 bytes are a valid [u8; 16].
                        bytes: unsafe { e.gid.raw },
                        kind,
                    };
                    if !g.is_zero() {
                        gids.push(g);
                    }
                }
                ports.push(Port {
                    num,
                    state: p.state,
                    link_layer: match u32::from(p.link_layer) {
                        sys::IBV_LINK_LAYER_INFINIBAND => LinkLayer::Infiniband,
                        sys::IBV_LINK_LAYER_ETHERNET => LinkLayer::Ethernet,
                        _ => LinkLayer::Unspecified,
                    },
                    active_mtu: 128 << p.active_mtu.min(5),
                    lid: p.lid,
                    gids,
                });
            }
            Ok(Nic {
                name: name.clone(),
                firmware,
                vendor_id: attr.vendor_id,
                vendor_part_id: attr.vendor_part_id,
                ports,
            })
        })();
        // SAFETY: closing the context opened above, once.
        unsafe { (self.close_device)(ctx) };
        result
    }
}

impl Drop for Verbs {
    fn drop(&mut self) {
        // SAFETY: the handle from dlopen, closed once; nothing of the library outlives self.
        unsafe { libc::dlclose(self.lib) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::ib::boundary::assert_same_layout;

    /// The hand-written mirrors against bindgen's structs of the same header.
    #[test]
    fn hand_written_mirrors_lay_out_as_bindgen_does() {
        assert_same_layout!(GlobalRoute, sys::ibv_global_route, [
            dgid => dgid, flow_label => flow_label, sgid_index => sgid_index,
            hop_limit => hop_limit, traffic_class => traffic_class,
        ]);
        assert_same_layout!(AhAttr, sys::ibv_ah_attr, [
            grh => grh, dlid => dlid, sl => sl, src_path_bits => src_path_bits,
            static_rate => static_rate, is_global => is_global, port_num => port_num,
        ]);
        assert_same_layout!(QpAttr, sys::ibv_qp_attr, [
            qp_state => qp_state, cur_qp_state => cur_qp_state, path_mtu => path_mtu,
            path_mig_state => path_mig_state, qkey => qkey, rq_psn => rq_psn, sq_psn => sq_psn,
            dest_qp_num => dest_qp_num, qp_access_flags => qp_access_flags, cap => cap,
            ah_attr => ah_attr, alt_ah_attr => alt_ah_attr, pkey_index => pkey_index,
            alt_pkey_index => alt_pkey_index, en_sqd_async_notify => en_sqd_async_notify,
            sq_draining => sq_draining, max_rd_atomic => max_rd_atomic,
            max_dest_rd_atomic => max_dest_rd_atomic, min_rnr_timer => min_rnr_timer,
            port_num => port_num, timeout => timeout, retry_cnt => retry_cnt,
            rnr_retry => rnr_retry, alt_port_num => alt_port_num, alt_timeout => alt_timeout,
            rate_limit => rate_limit,
        ]);
    }

    fn gid(index: u32, kind: GidType, tail: [u8; 6]) -> Gid {
        let mut bytes = [0u8; 16];
        bytes[10..].copy_from_slice(&tail);
        Gid { index, bytes, kind }
    }

    #[test]
    fn roce_prefers_v2_with_ipv4() {
        let port = Port {
            num: 1,
            state: 4,
            link_layer: LinkLayer::Ethernet,
            active_mtu: 4096,
            lid: 0,
            gids: vec![
                Gid {
                    index: 0,
                    bytes: [0xfe, 0x80, 0, 0, 0, 0, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8],
                    kind: GidType::RoceV1,
                },
                Gid {
                    index: 1,
                    bytes: [0xfe, 0x80, 0, 0, 0, 0, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8],
                    kind: GidType::RoceV2,
                },
                gid(2, GidType::RoceV1, [0xff, 0xff, 10, 0, 0, 7]),
                gid(3, GidType::RoceV2, [0xff, 0xff, 10, 0, 0, 7]),
            ],
        };
        let g = choose_gid(&port, None).unwrap();
        assert_eq!((g.index, g.ipv4()), (3, Some(Ipv4Addr::new(10, 0, 0, 7))));
        assert_eq!(choose_gid(&port, Some(1)).unwrap().index, 1);
        assert!(choose_gid(&port, Some(9)).is_err());
        let ib = Port {
            link_layer: LinkLayer::Infiniband,
            ..port.clone()
        };
        assert_eq!(choose_gid(&ib, None).unwrap().index, 0);
        let empty = Port {
            gids: vec![],
            ..port
        };
        assert!(matches!(
            choose_gid(&empty, None),
            Err(Error::TransportUnavailable { .. })
        ));
    }
}
