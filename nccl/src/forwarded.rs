//! The exports doorbell answers by forwarding to the real NCCL ([`crate::real`]) with the
//! communicator's real twin: the collectives doorbell does not run itself (all-gather,
//! reduce-scatter and broadcast, which doorbell runs where there is no real twin, see
//! [`crate::moved`]; reduce, gather, scatter), registration and windows, reduction ops, the device
//! communicator, memory, split and shrink (communicators of the real NCCL only), finalize and the
//! group simulation. The prototypes are NCCL 2.28's (`nccl.h`); every one of these is among the
//! symbols PyTorch 2.11's `libtorch_cuda.so` imports.

use crate::abi::{self, NcclConfig, NcclResult, NcclUniqueId};
use crate::comm::Comm;
use crate::error::{self, ShimError};
use crate::real::{self, RealComm};
use crate::NcclComm;
use std::ffi::{c_int, c_void};
use std::sync::Arc;

type Ptr = *mut c_void;
type CPtr = *const c_void;

/// The handle's communicator (None for one of the real NCCL's own, [`Comm`]'s `is_foreign`) and
/// the real communicator the call goes to, or why `call` cannot go there.
///
/// # Safety
/// `comm` is NULL, a live handle of this library or one of the real NCCL's.
unsafe fn twin<'a>(comm: NcclComm, call: &str) -> Result<(Option<&'a Comm>, RealComm), ShimError> {
    if crate::comm::is_foreign(comm) {
        return Ok((None, RealComm(comm as *mut c_void)));
    }
    // SAFETY: the caller's contract.
    let c = unsafe { comm.as_ref() }
        .ok_or_else(|| ShimError::invalid_argument(format!("{call}: comm is NULL")))?;
    Ok((Some(c), c.real(call)?))
}

/// Calls the real `name` of C type `F` through `call_it`, counting it and turning its result
/// into ours.
///
/// # Safety
/// `F` is `name`'s C type in NCCL 2.28; `call_it` passes arguments valid for it.
pub unsafe fn forward<F: Copy>(
    name: &'static str,
    call_it: impl FnOnce(F) -> NcclResult,
) -> Result<(), ShimError> {
    // SAFETY: the caller's contract.
    let f = unsafe { real::function::<F>(name)? };
    real::count(false);
    real::check(name, real::within(|| call_it(f)))
}

/// A call that belongs to the real NCCL as it is (a handle of its own, or the real NCCL calling
/// its own API): its function with the same arguments, its result unchanged.
///
/// # Safety
/// As [`forward`].
pub unsafe fn pass_through<F: Copy>(
    name: &'static str,
    call_it: impl FnOnce(F) -> NcclResult,
) -> NcclResult {
    // SAFETY: the caller's contract.
    match unsafe { real::function::<F>(name) } {
        Ok(f) => real::within(|| call_it(f)),
        Err(e) => error::record(&e),
    }
}

/// Defines exports of the form `(buffers and scalars.., comm, stream)` forwarded as they are,
/// the handle replaced by its real twin.
macro_rules! forward_comm_calls {
    ($( $(#[$doc:meta])* fn $name:ident($($arg:ident: $ty:ty),*) ; )*) => {$(
        $(#[$doc])*
        ///
        /// # Safety
        /// NCCL's contract for this call; `comm` is NULL or a live handle of this library.
        #[no_mangle]
        pub unsafe extern "C" fn $name($($arg: $ty,)* comm: NcclComm, stream: Ptr) -> NcclResult {
            type F = unsafe extern "C" fn($($ty,)* Ptr, Ptr) -> NcclResult;
            // SAFETY: the caller's contract; F is the 2.28 prototype.
            error::result(unsafe { twin(comm, stringify!($name)) }.and_then(|(_, rc)| unsafe {
                forward::<F>(stringify!($name), |f| f($($arg,)* rc.0, stream))
            }))
        }
    )*};
}

/// A call the real twin runs when there is one; on a communicator of ours without one (ranks
/// sharing a GPU, or forwarding off) doorbell runs it (`native`), and what doorbell cannot run
/// says why there is no real NCCL too.
///
/// # Safety
/// `comm` is NULL, a live handle of this library or one of the real NCCL's; `F` is `name`'s
/// 2.28 prototype and `real_call` passes valid arguments with the communicator given.
unsafe fn twin_or_doorbell<F: Copy>(
    comm: NcclComm,
    name: &'static str,
    real_call: impl FnOnce(F, Ptr) -> NcclResult,
    native: impl FnOnce(&Comm) -> Result<(), ShimError>,
) -> NcclResult {
    if crate::comm::is_foreign(comm) {
        // SAFETY: the real NCCL's own handle, as it is.
        return unsafe { pass_through::<F>(name, |f| real_call(f, comm as Ptr)) };
    }
    let r = (|| {
        // SAFETY: the caller's contract.
        let c = unsafe { crate::handle(comm, name) }?;
        match c.real(name) {
            // SAFETY: the caller's contract.
            Ok(rc) => unsafe { forward::<F>(name, |f| real_call(f, rc.0)) },
            Err(why) if !c.forward_only => {
                real::count(true);
                native(c).map_err(|e| {
                    if e.code == abi::INVALID_USAGE {
                        ShimError::new(e.code, format!("{}; {}", e.message, why.message))
                    } else {
                        e
                    }
                })
            }
            Err(why) => Err(why),
        }
    })();
    error::result(r)
}

/// Defines exports of the form `(buffers and scalars.., comm, stream)` that the real twin runs
/// when there is one and doorbell (`$native`, given the communicator and the stream as an
/// address) where there is none ([`twin_or_doorbell`]).
macro_rules! twin_or_doorbell_calls {
    ($( $(#[$doc:meta])* fn $name:ident($($arg:ident: $ty:ty),*) => |$c:ident, $s:ident| $native:expr ; )*) => {$(
        $(#[$doc])*
        ///
        /// # Safety
        /// NCCL's contract; `comm` is NULL, a live handle of this library or one of the real
        /// NCCL's.
        #[no_mangle]
        pub unsafe extern "C" fn $name($($arg: $ty,)* comm: NcclComm, stream: Ptr) -> NcclResult {
            type F = unsafe extern "C" fn($($ty,)* Ptr, Ptr) -> NcclResult;
            // SAFETY: the caller's contract; F is the 2.28 prototype.
            unsafe {
                twin_or_doorbell::<F>(
                    comm,
                    stringify!($name),
                    |f, rc| f($($arg,)* rc, stream),
                    |$c| {
                        let $s = stream as u64;
                        $native
                    },
                )
            }
        }
    )*};
}

twin_or_doorbell_calls! {
    /// `ncclAllGather(sendbuff, recvbuff, sendcount, datatype, comm, stream)`: the real twin's,
    /// else doorbell's ([`crate::moved::all_gather`]).
    fn ncclAllGather(sendbuff: CPtr, recvbuff: Ptr, sendcount: usize, datatype: c_int) => |c, s| {
        crate::moved::all_gather(c, sendbuff as u64, recvbuff as u64, sendcount, datatype, s)
    };
    /// `ncclReduceScatter(sendbuff, recvbuff, recvcount, datatype, op, comm, stream)`: the real
    /// twin's, else doorbell's for sums of bf16, f16 and f32 ([`crate::moved::reduce_scatter`]).
    fn ncclReduceScatter(sendbuff: CPtr, recvbuff: Ptr, recvcount: usize, datatype: c_int, op: c_int) => |c, s| {
        crate::moved::reduce_scatter(c, sendbuff as u64, recvbuff as u64, recvcount, datatype, op, s)
    };
    /// `ncclBroadcast(sendbuff, recvbuff, count, datatype, root, comm, stream)`: the real twin's,
    /// else doorbell's ([`crate::moved::broadcast`]).
    fn ncclBroadcast(sendbuff: CPtr, recvbuff: Ptr, count: usize, datatype: c_int, root: c_int) => |c, s| {
        crate::moved::broadcast(c, sendbuff as u64, recvbuff as u64, count, datatype, root, s)
    };
    /// `ncclBcast(buff, count, datatype, root, comm, stream)`: the in-place broadcast.
    fn ncclBcast(buff: Ptr, count: usize, datatype: c_int, root: c_int) => |c, s| {
        crate::moved::broadcast(c, buff as u64, buff as u64, count, datatype, root, s)
    };
}

forward_comm_calls! {
    /// `ncclReduce(sendbuff, recvbuff, count, datatype, op, root, comm, stream)`.
    fn ncclReduce(sendbuff: CPtr, recvbuff: Ptr, count: usize, datatype: c_int, op: c_int, root: c_int);
    /// `ncclGather(sendbuff, recvbuff, count, datatype, root, comm, stream)`.
    fn ncclGather(sendbuff: CPtr, recvbuff: Ptr, count: usize, datatype: c_int, root: c_int);
    /// `ncclScatter(sendbuff, recvbuff, count, datatype, root, comm, stream)`.
    fn ncclScatter(sendbuff: CPtr, recvbuff: Ptr, count: usize, datatype: c_int, root: c_int);
}

/// Defines exports of the form `(comm, rest..)` forwarded with the real twin.
macro_rules! forward_comm_first {
    ($( $(#[$doc:meta])* fn $name:ident($($arg:ident: $ty:ty),*) ; )*) => {$(
        $(#[$doc])*
        ///
        /// # Safety
        /// NCCL's contract for this call; `comm` is NULL or a live handle of this library.
        #[no_mangle]
        pub unsafe extern "C" fn $name(comm: NcclComm $(, $arg: $ty)*) -> NcclResult {
            type F = unsafe extern "C" fn(Ptr $(, $ty)*) -> NcclResult;
            // SAFETY: the caller's contract; F is the 2.28 prototype.
            error::result(unsafe { twin(comm, stringify!($name)) }.and_then(|(_, rc)| unsafe {
                forward::<F>(stringify!($name), |f| f(rc.0 $(, $arg)*))
            }))
        }
    )*};
}

forward_comm_first! {
    /// `ncclCommRegister(comm, buff, size, handle)`.
    fn ncclCommRegister(buff: Ptr, size: usize, handle: *mut Ptr);
    /// `ncclCommDeregister(comm, handle)`.
    fn ncclCommDeregister(handle: Ptr);
    /// `ncclCommWindowRegister(comm, buff, size, win, winFlags)`.
    fn ncclCommWindowRegister(buff: Ptr, size: usize, win: *mut Ptr, win_flags: c_int);
    /// `ncclCommWindowDeregister(comm, win)`.
    fn ncclCommWindowDeregister(win: Ptr);
    /// `ncclDevCommCreate(comm, reqs, outDevComm)`.
    fn ncclDevCommCreate(reqs: CPtr, out_dev_comm: Ptr);
    /// `ncclDevCommDestroy(comm, devComm)`.
    fn ncclDevCommDestroy(dev_comm: CPtr);
}

/// `ncclRedOpCreatePreMulSum(op, scalar, datatype, residence, comm)`: an op of the real NCCL
/// (an AllReduce given it is forwarded there).
///
/// # Safety
/// NCCL's contract; `comm` is NULL or a live handle of this library.
#[no_mangle]
pub unsafe extern "C" fn ncclRedOpCreatePreMulSum(
    op: *mut c_int,
    scalar: Ptr,
    datatype: c_int,
    residence: c_int,
    comm: NcclComm,
) -> NcclResult {
    type F = unsafe extern "C" fn(*mut c_int, Ptr, c_int, c_int, Ptr) -> NcclResult;
    const NAME: &str = "ncclRedOpCreatePreMulSum";
    // SAFETY: the caller's contract; F is the 2.28 prototype.
    error::result(unsafe { twin(comm, NAME) }.and_then(|(_, rc)| unsafe {
        forward::<F>(NAME, |f| f(op, scalar, datatype, residence, rc.0))
    }))
}

/// `ncclRedOpDestroy(op, comm)`.
///
/// # Safety
/// NCCL's contract; `comm` is NULL or a live handle of this library.
#[no_mangle]
pub unsafe extern "C" fn ncclRedOpDestroy(op: c_int, comm: NcclComm) -> NcclResult {
    type F = unsafe extern "C" fn(c_int, Ptr) -> NcclResult;
    // SAFETY: as above.
    error::result(
        unsafe { twin(comm, "ncclRedOpDestroy") }
            .and_then(|(_, rc)| unsafe { forward::<F>("ncclRedOpDestroy", |f| f(op, rc.0)) }),
    )
}

/// `ncclCommFinalize(comm)`: the real twin's (doorbell's own work is done when its stream's is).
///
/// # Safety
/// `comm` is NULL or a live handle of this library.
#[no_mangle]
pub unsafe extern "C" fn ncclCommFinalize(comm: NcclComm) -> NcclResult {
    type F = unsafe extern "C" fn(Ptr) -> NcclResult;
    if crate::comm::is_foreign(comm) {
        // SAFETY: the real NCCL's own handle, as it is.
        return unsafe { pass_through::<F>("ncclCommFinalize", |f| f(comm as Ptr)) };
    }
    // SAFETY: the caller's contract.
    let r = unsafe { crate::handle(comm, "ncclCommFinalize") }.and_then(|c| {
        match c.real("ncclCommFinalize") {
            // SAFETY: ncclCommFinalize(ncclComm_t).
            Ok(rc) => unsafe { forward::<F>("ncclCommFinalize", |f| f(rc.0)) },
            Err(_) => Ok(()),
        }
    });
    error::result(r)
}

/// `ncclMemAlloc(ptr, size)`: the real NCCL's.
///
/// # Safety
/// NCCL's contract.
#[no_mangle]
pub unsafe extern "C" fn ncclMemAlloc(ptr: *mut Ptr, size: usize) -> NcclResult {
    type F = unsafe extern "C" fn(*mut Ptr, usize) -> NcclResult;
    // SAFETY: the caller's contract; F is the 2.28 prototype.
    error::result(unsafe { forward::<F>("ncclMemAlloc", |f| f(ptr, size)) })
}

/// `ncclMemFree(ptr)`: the real NCCL's.
///
/// # Safety
/// NCCL's contract.
#[no_mangle]
pub unsafe extern "C" fn ncclMemFree(ptr: Ptr) -> NcclResult {
    type F = unsafe extern "C" fn(Ptr) -> NcclResult;
    // SAFETY: as above.
    error::result(unsafe { forward::<F>("ncclMemFree", |f| f(ptr)) })
}

/// `ncclGroupSimulateEnd(simInfo)`: the real NCCL's estimate of its own calls in the group
/// (doorbell's are not in it); nothing to say without one.
///
/// # Safety
/// NCCL's contract.
#[no_mangle]
pub unsafe extern "C" fn ncclGroupSimulateEnd(sim_info: Ptr) -> NcclResult {
    type F = unsafe extern "C" fn(Ptr) -> NcclResult;
    if !real::loaded() {
        return abi::SUCCESS;
    }
    // SAFETY: as above.
    error::result(unsafe { forward::<F>("ncclGroupSimulateEnd", |f| f(sim_info)) })
}

/// A communicator the real NCCL made from `parent` (NULL for a rank left out), as a handle of
/// ours: every call on it is forwarded. With no parent of ours (the real NCCL splitting its own)
/// the real handle itself.
fn adopt(parent: Option<&Comm>, made: Ptr, out: *mut NcclComm) -> Result<(), ShimError> {
    type Query = unsafe extern "C" fn(Ptr, *mut c_int) -> NcclResult;
    let Some(parent) = parent else {
        // SAFETY: `out` was checked non-NULL by the caller.
        unsafe { out.write(made as NcclComm) };
        return Ok(());
    };
    if made.is_null() {
        // SAFETY: `out` was checked non-NULL by the caller.
        unsafe { out.write(std::ptr::null()) };
        return Ok(());
    }
    let (mut rank, mut nranks) = (0, 0);
    // SAFETY: ncclCommUserRank/ncclCommCount(ncclComm_t, int*) with writable ints.
    unsafe {
        forward::<Query>("ncclCommUserRank", |f| f(made, &mut rank))?;
        forward::<Query>("ncclCommCount", |f| f(made, &mut nranks))?;
    }
    let c = Comm::forward_only(
        RealComm(made),
        rank as usize,
        nranks as usize,
        parent.device,
    );
    // SAFETY: as above.
    unsafe { out.write(crate::comm::publish(Arc::new(c))) };
    Ok(())
}

/// A communicator the real NCCL derives from `comm`'s twin (`ncclCommSplit`, `ncclCommShrink`):
/// `call(f, twin, place)` forwards with the twin's handle and the place for the new one, which
/// is then adopted into `newcomm` (see [`adopt`]).
///
/// # Safety
/// NCCL's contract; `comm` is NULL or a live handle of this library; `F` is `name`'s prototype.
unsafe fn derive<F: Copy>(
    comm: NcclComm,
    newcomm: *mut NcclComm,
    name: &'static str,
    call: impl FnOnce(F, Ptr, *mut Ptr) -> NcclResult,
) -> NcclResult {
    let r = (|| {
        if newcomm.is_null() {
            return Err(ShimError::invalid_argument(format!(
                "{name}: newcomm is NULL"
            )));
        }
        // SAFETY: the caller's contract.
        let (c, rc) = unsafe { twin(comm, name) }?;
        let mut made: Ptr = std::ptr::null_mut();
        // SAFETY: the caller's contract; `made` is writable.
        unsafe { forward::<F>(name, |f| call(f, rc.0, &mut made)) }?;
        adopt(c, made, newcomm)
    })();
    error::result(r)
}

/// `ncclCommSplit(comm, color, key, newcomm, config)`: the real NCCL splits the real twin; the
/// new communicator is the real NCCL's only (doorbell's collectives stay on the parent).
///
/// # Safety
/// NCCL's contract; `comm` is NULL or a live handle of this library.
#[no_mangle]
pub unsafe extern "C" fn ncclCommSplit(
    comm: NcclComm,
    color: c_int,
    key: c_int,
    newcomm: *mut NcclComm,
    config: *const NcclConfig,
) -> NcclResult {
    type F = unsafe extern "C" fn(Ptr, c_int, c_int, *mut Ptr, *const NcclConfig) -> NcclResult;
    // SAFETY: the caller's contract; F is the 2.28 prototype.
    unsafe {
        derive::<F>(comm, newcomm, "ncclCommSplit", |f, real, made| {
            f(real, color, key, made, config)
        })
    }
}

/// `ncclCommShrink(comm, excludeRanksList, excludeRanksCount, newcomm, config, shrinkFlags)`:
/// as [`ncclCommSplit`].
///
/// # Safety
/// NCCL's contract; `comm` is NULL or a live handle of this library.
#[no_mangle]
pub unsafe extern "C" fn ncclCommShrink(
    comm: NcclComm,
    exclude: *mut c_int,
    exclude_count: c_int,
    newcomm: *mut NcclComm,
    config: *const NcclConfig,
    flags: c_int,
) -> NcclResult {
    type F = unsafe extern "C" fn(
        Ptr,
        *mut c_int,
        c_int,
        *mut Ptr,
        *const NcclConfig,
        c_int,
    ) -> NcclResult;
    // SAFETY: the caller's contract; F is the 2.28 prototype.
    unsafe {
        derive::<F>(comm, newcomm, "ncclCommShrink", |f, real, made| {
            f(real, exclude, exclude_count, made, config, flags)
        })
    }
}

/// `ncclCommInitRankScalable(newcomm, nranks, myrank, nId, commIds, config)`: with one id, as
/// `ncclCommInitRankConfig`; several ids (NCCL's faster bootstrap) are refused by name.
///
/// # Safety
/// NCCL's contract: `comm_ids` holds `n_id` ids.
#[no_mangle]
pub unsafe extern "C" fn ncclCommInitRankScalable(
    newcomm: *mut NcclComm,
    nranks: c_int,
    myrank: c_int,
    n_id: c_int,
    comm_ids: *const NcclUniqueId,
    config: *const NcclConfig,
) -> NcclResult {
    if n_id != 1 || comm_ids.is_null() {
        return error::record(&ShimError::new(
            abi::INVALID_USAGE,
            format!(
                "ncclCommInitRankScalable: {n_id} unique ids; doorbell's rendezvous takes one \
                 (set TORCH_NCCL_RANKS_PER_ROOT high enough for one root)"
            ),
        ));
    }
    // SAFETY: one readable id (checked non-NULL); the rest as ncclCommInitRankConfig's contract.
    unsafe {
        crate::init(
            newcomm,
            nranks,
            &*comm_ids,
            myrank,
            config,
            "ncclCommInitRankScalable",
        )
    }
}
