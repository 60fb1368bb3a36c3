//! Which real NCCL the calls doorbell does not run would go to (`docs/nccl-abi-notes.md`):
//! `DOORBELL_NCCL_REAL` when set, else the first `libnccl.so.2` in the search order that is not
//! this library (preloaded, or installed as `libnccl.so.2`, it would otherwise find itself).
//! Loading it and forwarding to it: [`crate::real`].

use crate::error::ShimError;
use std::path::{Path, PathBuf};

/// The file name callers link against.
pub const SONAME: &str = "libnccl.so.2";

/// This library's own file (the object that holds this function), when the loader knows it.
pub fn own_path() -> Option<PathBuf> {
    // SAFETY: Dl_info is plain data (pointers and an integer); all zero is a valid value.
    let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
    // SAFETY: dladdr reads the address of one of our functions and fills `info`.
    let found = unsafe { libc::dladdr(own_path as *const libc::c_void, &mut info) };
    if found == 0 || info.dli_fname.is_null() {
        return None;
    }
    // SAFETY: the loader's NUL-terminated path, valid while the object stays loaded.
    let p = unsafe { std::ffi::CStr::from_ptr(info.dli_fname) };
    Some(PathBuf::from(p.to_string_lossy().into_owned()))
}

/// The folders searched, in order: `LD_LIBRARY_PATH`'s, then the system's.
pub fn search_dirs(ld_library_path: Option<&str>) -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = ld_library_path
        .unwrap_or("")
        .split(':')
        .filter(|d| !d.is_empty())
        .map(PathBuf::from)
        .collect();
    for d in [
        "/usr/lib/x86_64-linux-gnu",
        "/usr/lib64",
        "/usr/local/lib",
        "/usr/lib",
        "/lib",
    ] {
        dirs.push(PathBuf::from(d));
    }
    dirs
}

fn same_file(a: &Path, b: &Path) -> bool {
    match (std::fs::canonicalize(a), std::fs::canonicalize(b)) {
        (Ok(x), Ok(y)) => x == y,
        _ => false,
    }
}

/// The real NCCL: `setting` (`DOORBELL_NCCL_REAL`) when given (it must exist and not be this
/// library), else the first `libnccl.so.2` of `dirs` that is not `me`.
pub fn choose(
    setting: Option<&str>,
    dirs: &[PathBuf],
    me: Option<&Path>,
) -> Result<PathBuf, ShimError> {
    let is_me = |p: &Path| me.is_some_and(|m| same_file(p, m));
    if let Some(s) = setting.filter(|s| !s.is_empty()) {
        let p = PathBuf::from(s);
        if !p.is_file() {
            return Err(ShimError::invalid_argument(format!(
                "DOORBELL_NCCL_REAL={s}: no such file"
            )));
        }
        if is_me(&p) {
            return Err(ShimError::invalid_argument(format!(
                "DOORBELL_NCCL_REAL={s} is this library itself, not a real NCCL"
            )));
        }
        return Ok(p);
    }
    dirs.iter()
        .map(|d| d.join(SONAME))
        .find(|p| p.is_file() && !is_me(p))
        .ok_or_else(|| {
            ShimError::new(
                crate::abi::SYSTEM_ERROR,
                format!(
                    "no real NCCL found ({SONAME} in LD_LIBRARY_PATH or the system's folders, \
                     other than this library); set DOORBELL_NCCL_REAL to its path"
                ),
            )
        })
}

/// [`choose`] with this process's settings.
pub fn real_nccl() -> Result<PathBuf, ShimError> {
    let setting = std::env::var("DOORBELL_NCCL_REAL").ok();
    let ld = std::env::var("LD_LIBRARY_PATH").ok();
    choose(
        setting.as_deref(),
        &search_dirs(ld.as_deref()),
        own_path().as_deref(),
    )
}
