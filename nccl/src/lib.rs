//! `libdoorbell_nccl.so`: NCCL's C ABI on doorbell, for callers that reach a communication
//! library only through NCCL's (PyTorch's "nccl" backend, vLLM's and SGLang's pynccl,
//! nccl-tests). Issue 28; under construction: what it exports today is listed below, and
//! `docs/nccl-abi-notes.md` says what the whole ABI needs.
//!
//! Exported so far (each tested on the CPU):
//! - `ncclGetVersion`: NCCL 2.28.9's code (22809), the ABI these declarations follow.
//! - `ncclGetErrorString`, `ncclGetLastError`: a description of each result code, and the last
//!   failure's text (doorbell's message where doorbell failed).
//! - `ncclGetUniqueId`: an id whose maker serves the rendezvous of the ranks that initialize
//!   with it ([`id`]); [`id::rendezvous`] turns it into doorbell's bootstrap settings for
//!   `ncclCommInitRank`, which is not exported yet.
//!
//! [`config::parse`] reads `ncclConfig_t` as `ncclCommInitRankConfig` will.

pub mod abi;
pub mod config;
pub mod error;
pub mod id;

use abi::{NcclResult, NcclUniqueId};
use std::ffi::{c_char, c_int, c_void};

/// `ncclGetVersion(int* version)`.
///
/// # Safety
/// `version` is NULL or points to a writable int.
#[no_mangle]
pub unsafe extern "C" fn ncclGetVersion(version: *mut c_int) -> NcclResult {
    if version.is_null() {
        return error::record(&error::ShimError::invalid_argument(
            "ncclGetVersion: version is NULL",
        ));
    }
    let (x, y, z) = abi::VERSION;
    // SAFETY: non-NULL, writable (the contract).
    unsafe { version.write(abi::version_code(x, y, z)) };
    abi::SUCCESS
}

/// `ncclGetErrorString(ncclResult_t)`: never NULL.
#[no_mangle]
pub extern "C" fn ncclGetErrorString(result: NcclResult) -> *const c_char {
    error::describe(result).as_ptr()
}

/// `ncclGetLastError(ncclComm_t)`: the last failure's text, of any communicator ("" before
/// any); `comm` may be NULL.
#[no_mangle]
pub extern "C" fn ncclGetLastError(_comm: *mut c_void) -> *const c_char {
    error::last_error()
}

/// `ncclGetUniqueId(ncclUniqueId* uniqueId)`: starts the id's rendezvous server in this process.
///
/// # Safety
/// `unique_id` is NULL or points to 128 writable bytes.
#[no_mangle]
pub unsafe extern "C" fn ncclGetUniqueId(unique_id: *mut NcclUniqueId) -> NcclResult {
    if unique_id.is_null() {
        return error::record(&error::ShimError::invalid_argument(
            "ncclGetUniqueId: uniqueId is NULL",
        ));
    }
    match id::create() {
        Ok(id) => {
            // SAFETY: non-NULL, 128 writable bytes (the contract).
            unsafe { unique_id.write(id.encode()) };
            abi::SUCCESS
        }
        Err(e) => error::record(&e),
    }
}

#[cfg(test)]
mod tests;
