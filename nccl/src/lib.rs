//! `libdoorbell_nccl.so`: NCCL's C ABI on doorbell, for callers that reach a communication
//! library only through NCCL's (PyTorch's "nccl" backend, vLLM's and SGLang's pynccl,
//! nccl-tests). Issue 28; under construction: what it exports today is listed below, and
//! `docs/nccl-abi-notes.md` says what the whole ABI needs.
//!
//! Exported so far (tested on the CPU up to where a GPU is needed):
//! - `ncclGetVersion`: NCCL 2.28.9's code (22809), the ABI these declarations follow.
//! - `ncclGetErrorString`, `ncclGetLastError`: a description of each result code, and the last
//!   failure's text (doorbell's message where doorbell failed).
//! - `ncclGetUniqueId`: an id whose maker serves the rendezvous of the ranks that initialize
//!   with it ([`id`]).
//! - `ncclCommInitRank`, `ncclCommInitRankConfig` ([`config::parse`] reads `ncclConfig_t`),
//!   `ncclCommInitAll` (one process, several GPUs):
//!   the rendezvous, doorbell's bootstrap, then doorbell's communicator on the thread's current
//!   GPU ([`comm`]); inside a group, at its end, side by side ([`group`]).
//! - `ncclCommDestroy`, `ncclCommAbort`, `ncclCommCount`, `ncclCommCuDevice`,
//!   `ncclCommUserRank`, `ncclCommGetAsyncError`, `ncclGroupStart`, `ncclGroupEnd`.
//!
//! - `ncclAllReduce` (sum and average of bf16, f16, f32; maximum and minimum too where no real
//!   NCCL runs them) and `ncclAlltoAll` on doorbell's kernels ([`colls`]); other types and ops go
//!   to the real NCCL (without one they fail with `ncclInvalidUsage` naming them).
//! - `ncclSend`/`ncclRecv` in a group that form an all-to-all(v), as PyTorch's
//!   `all_to_all_single` makes ([`p2p`]): one doorbell all-to-all(v) at the group's end.
//!
//! - Everything else PyTorch 2.11 imports is forwarded to a real NCCL ([`real`],
//!   [`forwarded`]): each communicator has a real twin made with it, and the calls doorbell does
//!   not run go there (other collectives, types and ops, registration, windows, memory, splits,
//!   sends and receives of other patterns or outside a group).

pub mod abi;
pub mod colls;
pub mod comm;
pub mod config;
pub mod error;
pub mod forward;
pub mod forwarded;
pub mod group;
pub mod id;
pub mod moved;
pub mod p2p;
pub mod real;

use abi::{NcclConfig, NcclResult, NcclUniqueId};
use comm::Comm;
use error::ShimError;
use std::ffi::{c_char, c_int, c_void};
use std::sync::Arc;

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

/// A call that carries one of the real NCCL's own handles ([`comm::is_foreign`]: the real NCCL
/// calling its own API, which these exports interpose when preloaded) goes to its function as it
/// is.
macro_rules! foreign {
    ($comm:expr, $name:literal, fn($($ty:ty),*), ($($arg:expr),*)) => {
        if comm::is_foreign($comm) {
            type F = unsafe extern "C" fn($($ty),*) -> NcclResult;
            // SAFETY: the real NCCL's prototype for its own call, with the arguments it passed.
            return unsafe { forwarded::pass_through::<F>($name, |f| f($($arg),*)) };
        }
    };
}

/// `ncclComm_t`: an `Arc<Comm>` handed out raw.
pub type NcclComm = *const Comm;

/// The communicator behind a handle, or an invalid-argument error naming the call.
///
/// # Safety
/// `comm` is NULL or a handle this library returned and that was not destroyed.
unsafe fn handle<'a>(comm: NcclComm, call: &str) -> Result<&'a Comm, ShimError> {
    // SAFETY: a live handle points to a live Comm (the contract).
    unsafe { comm.as_ref() }
        .ok_or_else(|| ShimError::invalid_argument(format!("{call}: comm is NULL")))
}

/// Writes `v` through `out`, or an invalid-argument error naming the call and the argument.
///
/// # Safety
/// `out` is NULL or writable.
unsafe fn put<T>(out: *mut T, v: T, call: &str, what: &str) -> Result<(), ShimError> {
    if out.is_null() {
        return Err(ShimError::invalid_argument(format!(
            "{call}: {what} is NULL"
        )));
    }
    // SAFETY: non-NULL and writable (the contract).
    unsafe { out.write(v) };
    Ok(())
}

/// # Safety
/// `out` is NULL or writable; `config` as [`config::parse`] requires.
unsafe fn init(
    out: *mut NcclComm,
    nranks: c_int,
    id: &NcclUniqueId,
    rank: c_int,
    config: *const NcclConfig,
    call: &str,
) -> NcclResult {
    let r = (|| {
        if out.is_null() {
            return Err(ShimError::invalid_argument(format!("{call}: comm is NULL")));
        }
        // SAFETY: as this function's contract says.
        let cfg = unsafe { config::parse(config) }?;
        id::UniqueId::decode(id)?; // a foreign or damaged id is refused before anything else
        let device = comm::current_device()?;
        let c = comm::init_rank(id, rank, nranks, cfg, device)?;
        // SAFETY: non-NULL, writable (the contract).
        unsafe { out.write(comm::publish(c)) };
        Ok(())
    })();
    error::result(r)
}

/// `ncclCommInitRank(ncclComm_t* comm, int nranks, ncclUniqueId commId, int rank)`.
///
/// # Safety
/// `comm` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn ncclCommInitRank(
    comm: *mut NcclComm,
    nranks: c_int,
    comm_id: NcclUniqueId,
    rank: c_int,
) -> NcclResult {
    // SAFETY: forwarded contract; a NULL config is every default.
    unsafe {
        init(
            comm,
            nranks,
            &comm_id,
            rank,
            std::ptr::null(),
            "ncclCommInitRank",
        )
    }
}

/// `ncclCommInitRankConfig(ncclComm_t* comm, int nranks, ncclUniqueId commId, int rank,
/// ncclConfig_t* config)`.
///
/// # Safety
/// `comm` is NULL or writable; `config` is NULL or an `ncclConfig_t` of its stated size.
#[no_mangle]
pub unsafe extern "C" fn ncclCommInitRankConfig(
    comm: *mut NcclComm,
    nranks: c_int,
    comm_id: NcclUniqueId,
    rank: c_int,
    config: *const NcclConfig,
) -> NcclResult {
    // SAFETY: forwarded contract.
    unsafe {
        init(
            comm,
            nranks,
            &comm_id,
            rank,
            config,
            "ncclCommInitRankConfig",
        )
    }
}

/// `ncclCommInitAll(ncclComm_t* comms, int ndev, const int* devlist)`: one process's
/// communicator over `ndev` GPUs (`devlist`, or 0..ndev), rank `i` on `devlist[i]`, its ranks
/// initialized side by side. On failure no handle is left in `comms`.
///
/// # Safety
/// `comms` is NULL or has room for `ndev` handles; `devlist` is NULL or holds `ndev` ints.
#[no_mangle]
pub unsafe extern "C" fn ncclCommInitAll(
    comms: *mut NcclComm,
    ndev: c_int,
    devlist: *const c_int,
) -> NcclResult {
    let r = (|| {
        if comms.is_null() || ndev < 1 {
            return Err(ShimError::invalid_argument(format!(
                "ncclCommInitAll: comms {} and ndev {ndev} (at least 1)",
                if comms.is_null() { "NULL" } else { "given" }
            )));
        }
        let n = ndev as usize;
        let devices: Vec<usize> = if devlist.is_null() {
            (0..n).collect()
        } else {
            // SAFETY: `devlist` holds `ndev` ints (the contract).
            let d = unsafe { std::slice::from_raw_parts(devlist, n) };
            if let Some(bad) = d.iter().find(|&&x| x < 0) {
                return Err(ShimError::invalid_argument(format!(
                    "ncclCommInitAll: device {bad}"
                )));
            }
            d.iter().map(|&x| x as usize).collect()
        };
        let id = id::create()?.encode();
        group::start();
        let made: Result<Vec<Arc<Comm>>, ShimError> = devices
            .iter()
            .enumerate()
            .map(|(rank, &dev)| {
                comm::init_rank(&id, rank as c_int, ndev, config::CommConfig::default(), dev)
            })
            .collect();
        let (ended, _) = group::end();
        let made = made?;
        ended?;
        for (i, c) in made.into_iter().enumerate() {
            // SAFETY: `comms` has room for `ndev` handles (the contract).
            unsafe { comms.add(i).write(comm::publish(c)) };
        }
        Ok(())
    })();
    error::result(r)
}

/// `ncclCommDestroy(ncclComm_t comm)`: releases this rank's handle.
///
/// # Safety
/// `comm` is NULL or a live handle, not used again.
#[no_mangle]
pub unsafe extern "C" fn ncclCommDestroy(comm: NcclComm) -> NcclResult {
    foreign!(comm, "ncclCommDestroy", fn(*const c_void), (comm.cast()));
    if comm.is_null() {
        return error::record(&ShimError::invalid_argument(
            "ncclCommDestroy: comm is NULL",
        ));
    }
    comm::retire(comm);
    // SAFETY: a live handle from Arc::into_raw, given up by the caller.
    let c = unsafe { Arc::from_raw(comm) };
    let r = c.end_real(false);
    real::log_counts("ncclCommDestroy");
    drop(c);
    error::result(r)
}

/// `ncclCommAbort(ncclComm_t comm)`: stops doorbell's work (every peer learns of it), then
/// releases the handle.
///
/// # Safety
/// `comm` is NULL or a live handle, not used again.
#[no_mangle]
pub unsafe extern "C" fn ncclCommAbort(comm: NcclComm) -> NcclResult {
    foreign!(comm, "ncclCommAbort", fn(*const c_void), (comm.cast()));
    if comm.is_null() {
        return error::record(&ShimError::invalid_argument("ncclCommAbort: comm is NULL"));
    }
    comm::retire(comm);
    // SAFETY: a live handle from Arc::into_raw, given up by the caller.
    let c = unsafe { Arc::from_raw(comm) };
    c.abort();
    let r = c.end_real(true);
    real::log_counts("ncclCommAbort");
    error::result(r)
}

/// One of a communicator's numbers through `out` (`ncclCommCount`, `ncclCommCuDevice`,
/// `ncclCommUserRank`); for a handle of the real NCCL's own, its function's answer.
///
/// # Safety
/// `comm` is NULL, a live handle or one of the real NCCL's; `out` NULL or writable.
unsafe fn query(
    comm: NcclComm,
    out: *mut c_int,
    name: &'static str,
    what: &str,
    value: impl FnOnce(&Comm) -> usize,
) -> NcclResult {
    if comm::is_foreign(comm) {
        type F = unsafe extern "C" fn(*const c_void, *mut c_int) -> NcclResult;
        // SAFETY: the real NCCL's prototype for its own call, with the arguments it passed.
        return unsafe { forwarded::pass_through::<F>(name, |f| f(comm.cast(), out)) };
    }
    // SAFETY: the contract.
    error::result(unsafe {
        handle(comm, name).and_then(|c| put(out, value(c) as c_int, name, what))
    })
}

/// `ncclCommCount(const ncclComm_t comm, int* count)`.
///
/// # Safety
/// `comm` is NULL or a live handle; `count` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn ncclCommCount(comm: NcclComm, count: *mut c_int) -> NcclResult {
    // SAFETY: the contract.
    unsafe { query(comm, count, "ncclCommCount", "count", |c| c.nranks) }
}

/// `ncclCommCuDevice(const ncclComm_t comm, int* device)`.
///
/// # Safety
/// `comm` is NULL or a live handle; `device` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn ncclCommCuDevice(comm: NcclComm, device: *mut c_int) -> NcclResult {
    // SAFETY: the contract.
    unsafe { query(comm, device, "ncclCommCuDevice", "device", |c| c.device) }
}

/// `ncclCommUserRank(const ncclComm_t comm, int* rank)`.
///
/// # Safety
/// `comm` is NULL or a live handle; `rank` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn ncclCommUserRank(comm: NcclComm, rank: *mut c_int) -> NcclResult {
    // SAFETY: the contract.
    unsafe { query(comm, rank, "ncclCommUserRank", "rank", |c| c.rank) }
}

/// `ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t* asyncError)`.
///
/// # Safety
/// `comm` is NULL or a live handle; `async_error` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn ncclCommGetAsyncError(
    comm: NcclComm,
    async_error: *mut NcclResult,
) -> NcclResult {
    foreign!(
        comm,
        "ncclCommGetAsyncError",
        fn(*const c_void, *mut NcclResult),
        (comm.cast(), async_error)
    );
    // SAFETY: the contract.
    error::result(unsafe {
        handle(comm, "ncclCommGetAsyncError").and_then(|c| {
            put(
                async_error,
                c.async_error(),
                "ncclCommGetAsyncError",
                "asyncError",
            )
        })
    })
}

/// `ncclAllReduce(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype,
/// ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream)`.
///
/// # Safety
/// `comm` is NULL or a live handle; the buffers and stream as NCCL requires.
#[no_mangle]
pub unsafe extern "C" fn ncclAllReduce(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
    datatype: c_int,
    op: c_int,
    comm: NcclComm,
    stream: *mut c_void,
) -> NcclResult {
    // SAFETY: the contract.
    foreign!(
        comm,
        "ncclAllReduce",
        fn(*const c_void, *mut c_void, usize, c_int, c_int, *const c_void, *mut c_void),
        (sendbuff, recvbuff, count, datatype, op, comm.cast(), stream)
    );
    error::result(unsafe { handle(comm, "ncclAllReduce") }.and_then(|c| {
        let native = colls::all_reduce_native(datatype, op);
        if c.forward_only || !native {
            let rc = match c.real("ncclAllReduce") {
                Ok(rc) => Some(rc),
                // No real NCCL: doorbell's maximum or minimum by gathering, where it has one.
                Err(_) if colls::all_reduce_doorbell(datatype, op) => None,
                // Not doorbell's, and no real NCCL to run it: why not, with what was asked.
                Err(e) if !native && colls::bytes_of("ncclAllReduce", count, datatype).is_ok() => {
                    return Err(ShimError::new(
                        e.code,
                        format!(
                            "ncclAllReduce of {} ({}): {}",
                            colls::type_name(datatype),
                            colls::op_name(op),
                            e.message
                        ),
                    ));
                }
                Err(_) => None,
            };
            if let Some(rc) = rc {
                type F = unsafe extern "C" fn(
                    *const c_void,
                    *mut c_void,
                    usize,
                    c_int,
                    c_int,
                    *mut c_void,
                    *mut c_void,
                ) -> NcclResult;
                // SAFETY: NCCL's contract for the caller's arguments; F is the 2.28 prototype.
                return unsafe {
                    forwarded::forward::<F>("ncclAllReduce", |f| {
                        f(sendbuff, recvbuff, count, datatype, op, rc.0, stream)
                    })
                };
            }
        }
        real::count(true);
        colls::all_reduce(
            c,
            sendbuff as u64,
            recvbuff as u64,
            count,
            datatype,
            op,
            stream as u64,
        )
    }))
}

/// `ncclAlltoAll(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype,
/// ncclComm_t comm, cudaStream_t stream)`: `count` elements to and from each rank.
///
/// # Safety
/// `comm` is NULL or a live handle; the buffers and stream as NCCL requires.
#[no_mangle]
pub unsafe extern "C" fn ncclAlltoAll(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
    datatype: c_int,
    comm: NcclComm,
    stream: *mut c_void,
) -> NcclResult {
    // SAFETY: the contract.
    foreign!(
        comm,
        "ncclAlltoAll",
        fn(*const c_void, *mut c_void, usize, c_int, *const c_void, *mut c_void),
        (sendbuff, recvbuff, count, datatype, comm.cast(), stream)
    );
    error::result(unsafe { handle(comm, "ncclAlltoAll") }.and_then(|c| {
        if c.forward_only {
            let rc = c.real("ncclAlltoAll")?;
            type F = unsafe extern "C" fn(
                *const c_void,
                *mut c_void,
                usize,
                c_int,
                *mut c_void,
                *mut c_void,
            ) -> NcclResult;
            // SAFETY: NCCL's contract for the caller's arguments; F is the 2.28 prototype.
            return unsafe {
                forwarded::forward::<F>("ncclAlltoAll", |f| {
                    f(sendbuff, recvbuff, count, datatype, rc.0, stream)
                })
            };
        }
        real::count(true);
        colls::all_to_all(
            c,
            sendbuff as u64,
            recvbuff as u64,
            count,
            datatype,
            stream as u64,
        )
    }))
}

/// A new owner of the communicator behind a live handle.
///
/// # Safety
/// `comm` is a live handle (from `Arc::into_raw`).
unsafe fn shared(comm: &Comm) -> Arc<Comm> {
    let p = comm as *const Comm;
    // SAFETY: `p` came from Arc::into_raw and is alive (the contract): one more owner.
    unsafe {
        Arc::increment_strong_count(p);
        Arc::from_raw(p)
    }
}

/// `ncclSend` and `ncclRecv`: the handle's communicator, then [`colls::p2p`].
///
/// # Safety
/// `comm` is NULL or a live handle.
#[allow(clippy::too_many_arguments)]
unsafe fn p2p_call(
    call: &str,
    send: bool,
    buf: u64,
    count: usize,
    datatype: c_int,
    peer: c_int,
    comm: NcclComm,
    stream: *mut c_void,
) -> NcclResult {
    if comm::is_foreign(comm) {
        type F = unsafe extern "C" fn(
            u64,
            usize,
            c_int,
            c_int,
            *const c_void,
            *mut c_void,
        ) -> NcclResult;
        let name = if send { "ncclSend" } else { "ncclRecv" };
        // SAFETY: the real NCCL's prototype (the buffer as an address), its own arguments.
        return unsafe {
            forwarded::pass_through::<F>(name, |f| {
                f(buf, count, datatype, peer, comm.cast(), stream)
            })
        };
    }
    // SAFETY: the contract.
    error::result(unsafe { handle(comm, call) }.and_then(|c| {
        if c.forward_only || !group::inside() {
            // Not doorbell's to run: a communicator of the real NCCL only, or a send or receive
            // outside a group (NCCL runs it at once).
            if let Ok(rc) = c.real(call) {
                let op = p2p::P2pOp {
                    send,
                    peer: peer.max(0) as usize,
                    ptr: buf,
                    bytes: 0,
                    stream: stream as u64,
                };
                return forwarded_p2p(rc, &op, count, datatype);
            }
        }
        // SAFETY: `c` is behind a live handle.
        colls::p2p(
            unsafe { shared(c) },
            send,
            buf,
            count,
            datatype,
            peer,
            stream as u64,
        )
    }))
}

/// `ncclSend(const void* sendbuff, size_t count, ncclDataType_t datatype, int peer, ncclComm_t
/// comm, cudaStream_t stream)`: inside a group, held until its end (see [`p2p`]).
///
/// # Safety
/// `comm` is NULL or a live handle; the buffer and stream as NCCL requires.
#[no_mangle]
pub unsafe extern "C" fn ncclSend(
    sendbuff: *const c_void,
    count: usize,
    datatype: c_int,
    peer: c_int,
    comm: NcclComm,
    stream: *mut c_void,
) -> NcclResult {
    // SAFETY: forwarded contract.
    unsafe {
        p2p_call(
            "ncclSend",
            true,
            sendbuff as u64,
            count,
            datatype,
            peer,
            comm,
            stream,
        )
    }
}

/// `ncclRecv(void* recvbuff, size_t count, ncclDataType_t datatype, int peer, ncclComm_t comm,
/// cudaStream_t stream)`: inside a group, held until its end (see [`p2p`]).
///
/// # Safety
/// `comm` is NULL or a live handle; the buffer and stream as NCCL requires.
#[no_mangle]
pub unsafe extern "C" fn ncclRecv(
    recvbuff: *mut c_void,
    count: usize,
    datatype: c_int,
    peer: c_int,
    comm: NcclComm,
    stream: *mut c_void,
) -> NcclResult {
    // SAFETY: forwarded contract.
    unsafe {
        p2p_call(
            "ncclRecv",
            false,
            recvbuff as u64,
            count,
            datatype,
            peer,
            comm,
            stream,
        )
    }
}

/// A send or receive run by the real NCCL on `rc` (`count` elements of `datatype`).
pub(crate) fn forwarded_p2p(
    rc: real::RealComm,
    op: &p2p::P2pOp,
    count: usize,
    datatype: c_int,
) -> Result<(), ShimError> {
    type F = unsafe extern "C" fn(
        *mut c_void,
        usize,
        c_int,
        c_int,
        *mut c_void,
        *mut c_void,
    ) -> NcclResult;
    let name = if op.send { "ncclSend" } else { "ncclRecv" };
    // SAFETY: ncclSend/ncclRecv(buf, count, datatype, peer, comm, stream) with the caller's
    // arguments (NCCL's contract); F is the 2.28 prototype.
    unsafe {
        forwarded::forward::<F>(name, |f| {
            f(
                op.ptr as *mut c_void,
                count,
                datatype,
                op.peer as c_int,
                rc.0,
                op.stream as *mut c_void,
            )
        })
    }
}

/// `ncclGroupStart()`. With a real NCCL loaded its group starts too, so the calls forwarded
/// inside run as its group.
#[no_mangle]
pub extern "C" fn ncclGroupStart() -> NcclResult {
    if real::inside() {
        // The real NCCL's own group: its function as it is.
        type F = unsafe extern "C" fn() -> NcclResult;
        // SAFETY: ncclGroupStart(void).
        return unsafe { forwarded::pass_through::<F>("ncclGroupStart", |f| f()) };
    }
    let real = real::loaded();
    if real {
        type F = unsafe extern "C" fn() -> NcclResult;
        // SAFETY: ncclGroupStart(void). (Not counted as a forwarded call.)
        let r = unsafe { real::function::<F>("ncclGroupStart") }
            .and_then(|f| real::check("ncclGroupStart", real::within(|| unsafe { f() })));
        if let Err(e) = r {
            return error::record(&e);
        }
    }
    group::start_with(real);
    abi::SUCCESS
}

/// `ncclGroupEnd()`: at the outermost end, what the group held runs (sends and receives doorbell
/// does not run go to the real NCCL, still inside its group); then the real NCCL's group ends.
#[no_mangle]
pub extern "C" fn ncclGroupEnd() -> NcclResult {
    if real::inside() {
        type F = unsafe extern "C" fn() -> NcclResult;
        // SAFETY: ncclGroupEnd(void), the real NCCL's own.
        return unsafe { forwarded::pass_through::<F>("ncclGroupEnd", |f| f()) };
    }
    let (ours, real_started) = group::end();
    let theirs = if real_started {
        type F = unsafe extern "C" fn() -> NcclResult;
        // SAFETY: ncclGroupEnd(void), paired with the ncclGroupStart forwarded above.
        unsafe { real::function::<F>("ncclGroupEnd") }
            .and_then(|f| real::check("ncclGroupEnd", real::within(|| unsafe { f() })))
    } else {
        Ok(())
    };
    error::result(ours.and(theirs))
}

#[cfg(test)]
mod tests;
