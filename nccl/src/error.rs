//! Errors as NCCL reports them: a result code, and the last error's text for
//! `ncclGetLastError`.

use crate::abi::{self, NcclResult};
use std::ffi::{c_char, CStr};
use std::sync::Mutex;

/// A failed call: NCCL's code and what went wrong.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShimError {
    pub code: NcclResult,
    pub message: String,
}

impl ShimError {
    pub fn new(code: NcclResult, message: impl Into<String>) -> ShimError {
        ShimError {
            code,
            message: message.into(),
        }
    }

    pub fn invalid_argument(message: impl Into<String>) -> ShimError {
        ShimError::new(abi::INVALID_ARGUMENT, message)
    }

    /// The code NCCL would return for one of doorbell's errors: a dead or silent peer is the
    /// remote side's doing (`ncclRemoteError`), mismatched calls the caller's
    /// (`ncclInvalidUsage`), bad input `ncclInvalidArgument`, no driver or a CUDA failure
    /// `ncclUnhandledCudaError`, the rest `ncclSystemError`.
    pub fn from_doorbell(e: &doorbell::Error) -> ShimError {
        use doorbell::Error as E;
        let code = match e {
            E::PeerFailed { .. } | E::Bootstrap { .. } | E::Timeout { .. } => abi::REMOTE_ERROR,
            E::ArgumentMismatch { .. } => abi::INVALID_USAGE,
            E::InvalidArgument { .. } => abi::INVALID_ARGUMENT,
            E::NoCudaDriver { .. } | E::Cuda { .. } => abi::UNHANDLED_CUDA_ERROR,
            _ => abi::SYSTEM_ERROR,
        };
        ShimError::new(code, e.to_string())
    }
}

/// Bytes kept of the last error's text (longer ones are cut at a character boundary).
const LAST_ERROR_BYTES: usize = 1024;

/// The last error's text, NUL-terminated; `ncclGetLastError` returns a pointer into it, which
/// stays valid (its contents change with the next error).
static LAST_ERROR: Mutex<[u8; LAST_ERROR_BYTES]> = Mutex::new([0; LAST_ERROR_BYTES]);

/// Records `e` as the last error and returns its code.
pub fn record(e: &ShimError) -> NcclResult {
    let mut buf = LAST_ERROR.lock().unwrap_or_else(|p| p.into_inner());
    let mut n = e.message.len().min(LAST_ERROR_BYTES - 1);
    while !e.message.is_char_boundary(n) {
        n -= 1;
    }
    buf[..n].copy_from_slice(&e.message.as_bytes()[..n]);
    buf[n] = 0;
    e.code
}

/// The result of a call that may fail: its code, with a failure recorded as the last error.
pub fn result(r: Result<(), ShimError>) -> NcclResult {
    match r {
        Ok(()) => abi::SUCCESS,
        Err(e) => record(&e),
    }
}

/// Pointer to the last error's text ("" before any).
pub fn last_error() -> *const c_char {
    let buf = LAST_ERROR.lock().unwrap_or_else(|p| p.into_inner());
    buf.as_ptr() as *const c_char
}

/// The last error's text as a Rust string (tests, logs).
pub fn last_error_text() -> String {
    // SAFETY: the buffer is always NUL-terminated (record writes the terminator, the rest is
    // zero) and lives for the program.
    unsafe { CStr::from_ptr(last_error()) }
        .to_string_lossy()
        .into_owned()
}

/// `ncclGetErrorString`: a short description of each code, never NULL.
pub fn describe(code: NcclResult) -> &'static CStr {
    match code {
        abi::SUCCESS => c"no error",
        abi::UNHANDLED_CUDA_ERROR => c"unhandled CUDA error (ncclGetLastError says more)",
        abi::SYSTEM_ERROR => c"system error (ncclGetLastError says more)",
        abi::INTERNAL_ERROR => c"internal error (ncclGetLastError says more)",
        abi::INVALID_ARGUMENT => c"invalid argument (ncclGetLastError says which)",
        abi::INVALID_USAGE => c"invalid usage (ncclGetLastError says how)",
        abi::REMOTE_ERROR => c"a remote rank failed or the network did (ncclGetLastError names it)",
        abi::IN_PROGRESS => c"operation in progress",
        _ => c"unknown result code",
    }
}
