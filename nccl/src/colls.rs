//! The collectives doorbell runs itself: `ncclAllReduce` (sum and average of bf16, f16 or f32;
//! maximum and minimum where no real NCCL runs them),
//! `ncclAlltoAll`, and a group's sends and receives that form an all-to-all(v) ([`crate::p2p`]).
//! Their doorbell objects are built with the communicator, so a call only queues work (one thread
//! may drive several ranks, as nccl-tests does). Every other type or op goes to the real NCCL
//! ([`crate::real`]); without one such a call fails with `ncclInvalidUsage` naming what it asked
//! for and why there is none.

use crate::abi::{self, dtype, op};
use crate::comm::Comm;
use crate::error::ShimError;
use cudarc::driver::sys;
use doorbell::collectives::elementwise::Extremum;
use doorbell::collectives::DataType;
use std::ffi::c_int;
use std::sync::Arc;

pub fn type_name(t: c_int) -> String {
    match t {
        dtype::INT8 => "int8".into(),
        dtype::UINT8 => "uint8".into(),
        dtype::INT32 => "int32".into(),
        dtype::UINT32 => "uint32".into(),
        dtype::INT64 => "int64".into(),
        dtype::UINT64 => "uint64".into(),
        dtype::FLOAT16 => "float16".into(),
        dtype::FLOAT32 => "float32".into(),
        dtype::FLOAT64 => "float64".into(),
        dtype::BFLOAT16 => "bfloat16".into(),
        dtype::FLOAT8_E4M3 => "float8e4m3".into(),
        dtype::FLOAT8_E5M2 => "float8e5m2".into(),
        other => format!("type {other}"),
    }
}

pub fn op_name(o: c_int) -> String {
    match o {
        op::SUM => "sum".into(),
        op::PROD => "prod".into(),
        op::MAX => "max".into(),
        op::MIN => "min".into(),
        op::AVG => "avg".into(),
        other => format!("op {other}"),
    }
}

/// The element size of a valid type, or an invalid-argument error naming the call.
pub fn element(call: &str, t: c_int) -> Result<usize, ShimError> {
    dtype::size(t).ok_or_else(|| {
        ShimError::invalid_argument(format!(
            "{call}: datatype {t} is no NCCL type (0..{})",
            dtype::COUNT
        ))
    })
}

/// Bytes of `count` elements of type `t`, or an invalid-argument error naming the call (no
/// such type, or a count that overflows).
pub fn bytes_of(call: &str, count: usize, t: c_int) -> Result<usize, ShimError> {
    count
        .checked_mul(element(call, t)?)
        .ok_or_else(|| ShimError::invalid_argument(format!("{call}: {count} elements overflow")))
}

fn not_native(call: &str, what: String) -> ShimError {
    ShimError::new(
        abi::INVALID_USAGE,
        format!(
            "{call} {what}: doorbell does not run this itself (the real NCCL does, where the \
             communicator has one)"
        ),
    )
}

/// Checks buffers of `bytes` bytes: given (non-NULL) when there is anything to move.
fn buffers(call: &str, bytes: usize, bufs: &[(&str, u64)]) -> Result<(), ShimError> {
    if bytes == 0 {
        return Ok(());
    }
    match bufs.iter().find(|(_, p)| *p == 0) {
        Some((what, _)) => Err(ShimError::invalid_argument(format!(
            "{call}: {what} is NULL with {bytes} bytes to move"
        ))),
        None => Ok(()),
    }
}

/// The caller's stream as doorbell takes it (not owned; NULL is the legacy default stream).
pub(crate) fn stream(
    c: &doorbell::communicator::Communicator,
    s: u64,
) -> Result<Arc<cudarc::driver::CudaStream>, ShimError> {
    c.gpu().bind().map_err(|e| ShimError::from_doorbell(&e))?;
    // SAFETY: NCCL's contract: a stream of the communicator's device (or NULL).
    Ok(unsafe { c.gpu().context().wrap_borrowed_stream(s as sys::CUstream) })
}

/// Whether doorbell runs an allreduce of type `t` with op `o` whatever else the communicator
/// has: the sum and the average (the sum scaled by 1 / ranks, in place) of bf16, f16 or f32.
pub fn all_reduce_native(t: c_int, o: c_int) -> bool {
    float_type(t) && matches!(o, op::SUM | op::AVG)
}

/// Whether doorbell runs an allreduce of type `t` with op `o` where no real NCCL does (ranks
/// sharing a GPU, forwarding off): [`all_reduce_native`]'s, and the maximum and minimum of bf16,
/// f16 or f32 as an all-gather into scratch and a reduction of the gathered inputs (not under
/// CUDA graph capture: the all-gather's counts come from host memory). With a real NCCL those
/// two are its.
pub fn all_reduce_doorbell(t: c_int, o: c_int) -> bool {
    float_type(t) && matches!(o, op::SUM | op::AVG | op::MAX | op::MIN)
}

fn float_type(t: c_int) -> bool {
    matches!(t, dtype::BFLOAT16 | dtype::FLOAT16 | dtype::FLOAT32)
}

/// `ncclAllReduce`: sum, average, maximum or minimum of bf16, f16 or f32 ([`all_reduce_doorbell`]).
#[allow(clippy::too_many_arguments)]
pub fn all_reduce(
    comm: &Comm,
    send: u64,
    recv: u64,
    count: usize,
    t: c_int,
    o: c_int,
    s: u64,
) -> Result<(), ShimError> {
    const CALL: &str = "ncclAllReduce";
    let bytes = bytes_of(CALL, count, t)?;
    if o < 0 {
        return Err(ShimError::invalid_argument(format!(
            "{CALL}: op {o} is no NCCL op"
        )));
    }
    buffers(CALL, bytes, &[("sendbuff", send), ("recvbuff", recv)])?;
    let dt = match t {
        dtype::BFLOAT16 => DataType::Bf16,
        dtype::FLOAT16 => DataType::F16,
        dtype::FLOAT32 => DataType::F32,
        _ => {
            return Err(not_native(
                CALL,
                format!("of {} ({})", type_name(t), op_name(o)),
            ))
        }
    };
    let extremum = match o {
        op::SUM | op::AVG => None,
        op::MAX => Some(Extremum::Max),
        op::MIN => Some(Extremum::Min),
        _ => {
            return Err(not_native(
                CALL,
                format!("with {} ({})", op_name(o), type_name(t)),
            ))
        }
    };
    if let Some(which) = extremum {
        return crate::moved::all_reduce_extremum(comm, send, recv, count, t, dt, which, s);
    }
    let (c, ar) = comm.all_reduce()?;
    let st = stream(c, s)?;
    // SAFETY: NCCL's contract: the buffers hold `count` elements on this device, valid until the
    // stream's work completes.
    unsafe { ar.run_raw(&st, send, recv, count, dt) }.map_err(|e| comm.failed(&e))?;
    if o == op::AVG && comm.nranks > 1 {
        let (_, ew) = comm.elementwise()?;
        let factor = 1.0 / comm.nranks as f32;
        // SAFETY: `recv` holds `count` elements of `dt` (NCCL's contract), the sum just queued
        // before the scaling on the same stream.
        unsafe { ew.scale_raw(&st, recv, count as u64, dt, factor) }
            .map_err(|e| ShimError::from_doorbell(&e))?;
    }
    Ok(())
}

/// `ncclAlltoAll`: `count` elements to and from each rank.
pub fn all_to_all(
    comm: &Comm,
    send: u64,
    recv: u64,
    count: usize,
    t: c_int,
    s: u64,
) -> Result<(), ShimError> {
    const CALL: &str = "ncclAlltoAll";
    let per_peer = bytes_of(CALL, count, t)?;
    let Some(total) = per_peer.checked_mul(comm.nranks) else {
        return Err(ShimError::invalid_argument(format!(
            "{CALL}: {count} elements per rank overflow"
        )));
    };
    buffers(CALL, per_peer, &[("sendbuff", send), ("recvbuff", recv)])?;
    let (c, a2a) = comm.all_to_all()?;
    let st = stream(c, s)?;
    // In place (or overlapping), as NCCL runs it too: the input copied aside first (scratch
    // freed in stream order after the kernel; both capturable).
    let (input, _aside) = crate::moved::apart(CALL, &st, send, total, (recv, total))?;
    // SAFETY: NCCL's contract: `nranks * count` elements each, on this device, valid until the
    // stream's work completes; `input` does not overlap `recv` (copied aside where it did).
    unsafe { a2a.run_raw(&st, input, recv, per_peer) }.map_err(|e| comm.failed(&e))
}

/// `ncclSend` / `ncclRecv` checked and held in the group (outside a group they are not doorbell's
/// to run).
#[allow(clippy::too_many_arguments)]
pub fn p2p(
    comm: Arc<Comm>,
    send: bool,
    buf: u64,
    count: usize,
    t: c_int,
    peer: c_int,
    s: u64,
) -> Result<(), ShimError> {
    let call = if send { "ncclSend" } else { "ncclRecv" };
    let bytes = bytes_of(call, count, t)?;
    if peer < 0 || peer as usize >= comm.nranks {
        return Err(ShimError::invalid_argument(format!(
            "{call}: peer {peer} of {} ranks",
            comm.nranks
        )));
    }
    buffers(
        call,
        bytes,
        &[(if send { "sendbuff" } else { "recvbuff" }, buf)],
    )?;
    if !crate::group::inside() {
        return Err(not_native(
            call,
            "outside a group (doorbell runs grouped sends and receives that form an all-to-all)"
                .into(),
        ));
    }
    crate::group::hold_p2p(
        comm,
        crate::p2p::P2pOp {
            send,
            peer: peer as usize,
            ptr: buf,
            bytes,
            stream: s,
        },
    );
    Ok(())
}

/// A group's sends and receives as doorbell runs them: the plan and the stream, or why doorbell
/// does not run them (another pattern, or CUDA graph capture). Nothing is launched.
pub fn grouped_plan(
    comm: &Comm,
    ops: &[crate::p2p::P2pOp],
) -> Result<(crate::p2p::AllToAllV, Arc<cudarc::driver::CudaStream>), ShimError> {
    const CALL: &str = "ncclGroupEnd (ncclSend/ncclRecv)";
    let plan = crate::p2p::plan(ops, comm.nranks, comm.rank)
        .map_err(|why| not_native(CALL, format!("of this pattern ({why})")))?;
    let (c, _) = comm.all_to_all()?;
    let st = stream(c, plan.stream)?;
    if doorbell::gpu::signature::capturing(&st) {
        // The counts go to the device by a copy from host memory, which a graph cannot hold.
        return Err(not_native(CALL, "under CUDA graph capture".into()));
    }
    Ok((plan, st))
}

/// A communicator's sends and receives of one group, at its end: one doorbell all-to-all(v).
pub fn grouped_p2p(comm: &Comm, ops: &[crate::p2p::P2pOp]) -> Result<(), ShimError> {
    grouped_p2p_planned(comm, grouped_plan(comm, ops)?)
}

/// [`grouped_p2p`] with its plan made.
pub fn grouped_p2p_planned(
    comm: &Comm,
    (plan, st): (crate::p2p::AllToAllV, Arc<cudarc::driver::CudaStream>),
) -> Result<(), ShimError> {
    const CALL: &str = "ncclGroupEnd (ncclSend/ncclRecv)";
    let (_, a2a) = comm.all_to_all()?;
    let counts = st.clone_htod(&plan.counts).map_err(|e| {
        ShimError::new(
            abi::UNHANDLED_CUDA_ERROR,
            format!("{CALL}: copying the counts: {e}"),
        )
    })?;
    let (at, _guard) = cudarc::driver::DevicePtr::device_ptr(&counts, &st);
    // SAFETY: the plan's regions are the caller's send and receive buffers (NCCL's contract:
    // valid until the stream's work completes) and do not overlap (checked); `counts` holds
    // 4 x world values and is freed in stream order after the kernel.
    unsafe {
        a2a.run_v_raw(
            &st,
            plan.input,
            plan.input_bytes,
            plan.output,
            plan.output_bytes,
            at,
        )
    }
    .map_err(|e| comm.failed(&e))
}
