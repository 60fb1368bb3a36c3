//! `ncclConfig_t` as `ncclCommInitRankConfig` reads it: only the `size` bytes the caller's
//! headers declared, the magic checked, the fields doorbell acts on taken, the rest accepted.

use crate::abi::{NcclConfig, CONFIG_MAGIC, CONFIG_UNDEF_INT};
use crate::error::ShimError;
use std::ffi::{c_int, CStr};

/// What a communicator takes from its config.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CommConfig {
    /// Calls return only once their work is queued (`blocking` 1, the default); with 0 they may
    /// return `ncclInProgress`, which doorbell never needs to (queuing is synchronous).
    pub blocking: bool,
    /// SM bounds for doorbell's kernels (`minCTAs`/`maxCTAs`), when given.
    pub min_ctas: Option<u32>,
    pub max_ctas: Option<u32>,
    /// `splitShare`: split communicators may share resources with their parent.
    pub split_share: bool,
    /// `commName`, for messages.
    pub name: Option<String>,
}

impl Default for CommConfig {
    fn default() -> Self {
        CommConfig {
            blocking: true,
            min_ctas: None,
            max_ctas: None,
            split_share: false,
            name: None,
        }
    }
}

fn set(v: c_int) -> Option<c_int> {
    (v != CONFIG_UNDEF_INT).then_some(v)
}

/// Reads `config` (NULL: every default). `NCCL_COMM_BLOCKING` (0 or 1) overrides `blocking`, as
/// in NCCL.
///
/// # Safety
/// `config` is NULL or points to at least `min(config.size, size_of::<NcclConfig>())` readable
/// bytes of an `ncclConfig_t`, whose `commName`, when set, is a NUL-terminated string.
pub unsafe fn parse(config: *const NcclConfig) -> Result<CommConfig, ShimError> {
    let mut out = CommConfig::default();
    if !config.is_null() {
        // The caller's `size` first (its headers may be older or newer than 2.28's): only that
        // many bytes are its.
        // SAFETY: the first field is readable in any version of the struct.
        let size = unsafe { std::ptr::addr_of!((*config).size).read_unaligned() };
        if size < 16 {
            return Err(ShimError::invalid_argument(format!(
                "ncclConfig_t of {size} bytes: not a config (use NCCL_CONFIG_INITIALIZER)"
            )));
        }
        let mut c = NcclConfig::initializer();
        let n = size.min(std::mem::size_of::<NcclConfig>());
        // SAFETY: `n` bytes of the caller's struct are readable (the contract); `c` has room.
        unsafe {
            std::ptr::copy_nonoverlapping(
                config as *const u8,
                &mut c as *mut NcclConfig as *mut u8,
                n,
            )
        };
        if c.magic != CONFIG_MAGIC {
            return Err(ShimError::invalid_argument(format!(
                "ncclConfig_t magic {:#x}, not {CONFIG_MAGIC:#x} (use NCCL_CONFIG_INITIALIZER)",
                c.magic
            )));
        }
        if let Some(b) = set(c.blocking) {
            if b != 0 && b != 1 {
                return Err(ShimError::invalid_argument(format!(
                    "ncclConfig_t blocking {b}: 0 or 1"
                )));
            }
            out.blocking = b == 1;
        }
        let ctas = |what: &str, v: c_int| -> Result<Option<u32>, ShimError> {
            match set(v) {
                None => Ok(None),
                Some(v) if v > 0 => Ok(Some(v as u32)),
                Some(v) => Err(ShimError::invalid_argument(format!(
                    "ncclConfig_t {what} {v}: at least 1"
                ))),
            }
        };
        out.min_ctas = ctas("minCTAs", c.min_ctas)?;
        out.max_ctas = ctas("maxCTAs", c.max_ctas)?;
        if let (Some(lo), Some(hi)) = (out.min_ctas, out.max_ctas) {
            if lo > hi {
                return Err(ShimError::invalid_argument(format!(
                    "ncclConfig_t minCTAs {lo} above maxCTAs {hi}"
                )));
            }
        }
        out.split_share = set(c.split_share).is_some_and(|v| v != 0);
        if !c.comm_name.is_null() {
            // SAFETY: a set commName is a C string (the contract).
            out.name = Some(
                unsafe { CStr::from_ptr(c.comm_name) }
                    .to_string_lossy()
                    .into_owned(),
            );
        }
    }
    if let Ok(v) = std::env::var("NCCL_COMM_BLOCKING") {
        match v.trim() {
            "0" => out.blocking = false,
            "1" => out.blocking = true,
            other => {
                return Err(ShimError::invalid_argument(format!(
                    "NCCL_COMM_BLOCKING={other:?}: 0 or 1"
                )))
            }
        }
    }
    Ok(out)
}
