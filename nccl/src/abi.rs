//! NCCL's C types and constants as its 2.28 headers declare them (the values, not the header's
//! text): result codes, data types, reduction ops, the unique id and the communicator config.
//! Enums cross the ABI as C ints (callers may pass any value; a Rust enum may not hold one it
//! does not list).

use std::ffi::{c_char, c_int, c_uint};

/// `ncclResult_t`.
pub type NcclResult = c_int;
pub const SUCCESS: NcclResult = 0;
pub const UNHANDLED_CUDA_ERROR: NcclResult = 1;
pub const SYSTEM_ERROR: NcclResult = 2;
pub const INTERNAL_ERROR: NcclResult = 3;
pub const INVALID_ARGUMENT: NcclResult = 4;
pub const INVALID_USAGE: NcclResult = 5;
pub const REMOTE_ERROR: NcclResult = 6;
pub const IN_PROGRESS: NcclResult = 7;

/// The NCCL release whose ABI this library offers.
pub const VERSION: (c_int, c_int, c_int) = (2, 28, 9);

/// `NCCL_VERSION(x, y, z)`: the code `ncclGetVersion` reports (two digits of minor version from
/// 2.9 on, one before).
pub const fn version_code(x: c_int, y: c_int, z: c_int) -> c_int {
    if x <= 2 && y <= 8 {
        x * 1000 + y * 100 + z
    } else {
        x * 10000 + y * 100 + z
    }
}

/// `ncclDataType_t` values.
pub mod dtype {
    use std::ffi::c_int;
    pub const INT8: c_int = 0;
    pub const UINT8: c_int = 1;
    pub const INT32: c_int = 2;
    pub const UINT32: c_int = 3;
    pub const INT64: c_int = 4;
    pub const UINT64: c_int = 5;
    pub const FLOAT16: c_int = 6;
    pub const FLOAT32: c_int = 7;
    pub const FLOAT64: c_int = 8;
    pub const BFLOAT16: c_int = 9;
    pub const FLOAT8_E4M3: c_int = 10;
    pub const FLOAT8_E5M2: c_int = 11;
    /// `ncclNumTypes`.
    pub const COUNT: c_int = 12;

    /// Bytes of one element, None for a value that is no NCCL type.
    pub fn size(t: c_int) -> Option<usize> {
        match t {
            INT8 | UINT8 | FLOAT8_E4M3 | FLOAT8_E5M2 => Some(1),
            FLOAT16 | BFLOAT16 => Some(2),
            INT32 | UINT32 | FLOAT32 => Some(4),
            INT64 | UINT64 | FLOAT64 => Some(8),
            _ => None,
        }
    }
}

/// `ncclRedOp_t` values; ops made by `ncclRedOpCreatePreMulSum` are numbered from `COUNT` on.
pub mod op {
    use std::ffi::c_int;
    pub const SUM: c_int = 0;
    pub const PROD: c_int = 1;
    pub const MAX: c_int = 2;
    pub const MIN: c_int = 3;
    pub const AVG: c_int = 4;
    /// `ncclNumOps`.
    pub const COUNT: c_int = 5;
}

/// Bytes of `ncclUniqueId` (`NCCL_UNIQUE_ID_BYTES`).
pub const UNIQUE_ID_BYTES: usize = 128;

/// `ncclUniqueId`: opaque bytes, passed by value to `ncclCommInitRank`.
#[repr(C)]
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct NcclUniqueId {
    pub internal: [c_char; UNIQUE_ID_BYTES],
}

impl NcclUniqueId {
    pub fn from_bytes(b: &[u8; UNIQUE_ID_BYTES]) -> NcclUniqueId {
        NcclUniqueId {
            internal: b.map(|x| x as c_char),
        }
    }

    pub fn bytes(&self) -> [u8; UNIQUE_ID_BYTES] {
        self.internal.map(|x| x as u8)
    }
}

/// `NCCL_CONFIG_UNDEF_INT`: a field the caller left to the library.
pub const CONFIG_UNDEF_INT: c_int = c_int::MIN;
/// `ncclConfig_t::magic`.
pub const CONFIG_MAGIC: c_uint = 0xcafe_beef;

/// `ncclConfig_t` of NCCL 2.28 (`ncclConfig_v22800`). Callers built against other headers pass
/// their own `size`: only that many bytes are read.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct NcclConfig {
    pub size: usize,
    pub magic: c_uint,
    pub version: c_uint,
    pub blocking: c_int,
    pub cga_cluster_size: c_int,
    pub min_ctas: c_int,
    pub max_ctas: c_int,
    pub net_name: *const c_char,
    pub split_share: c_int,
    pub traffic_class: c_int,
    pub comm_name: *const c_char,
    pub collnet_enable: c_int,
    pub cta_policy: c_int,
    pub shrink_share: c_int,
    pub nvls_ctas: c_int,
    pub n_channels_per_net_peer: c_int,
    pub nvlink_centric_sched: c_int,
}

const _: () = assert!(std::mem::size_of::<NcclConfig>() == 80);
const _: () = assert!(std::mem::size_of::<NcclUniqueId>() == UNIQUE_ID_BYTES);

impl NcclConfig {
    /// What `NCCL_CONFIG_INITIALIZER` makes: every field left to the library.
    pub fn initializer() -> NcclConfig {
        let u = CONFIG_UNDEF_INT;
        NcclConfig {
            size: std::mem::size_of::<NcclConfig>(),
            magic: CONFIG_MAGIC,
            version: version_code(VERSION.0, VERSION.1, VERSION.2) as c_uint,
            blocking: u,
            cga_cluster_size: u,
            min_ctas: u,
            max_ctas: u,
            net_name: std::ptr::null(),
            split_share: u,
            traffic_class: u,
            comm_name: std::ptr::null(),
            collnet_enable: u,
            cta_policy: u,
            shrink_share: u,
            nvls_ctas: u,
            n_channels_per_net_peer: u,
            nvlink_centric_sched: u,
        }
    }
}
