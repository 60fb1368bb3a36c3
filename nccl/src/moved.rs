//! All-gather, broadcast and reduce-scatter on doorbell's kernels, for communicators without a
//! real NCCL behind them (ranks sharing a GPU, which NCCL refuses, or forwarding off): the first
//! two as doorbell's all-to-all(v) (each rank's block to every rank; the root's block to every
//! rank), the third as doorbell's allreduce into a scratch buffer and this rank's block copied
//! out (sum, average, maximum or minimum of bf16, f16 or f32); and the allreduce's maximum and
//! minimum, as an all-gather and a reduction of the gathered inputs. A block that is already in
//! place is not moved; an input that lies inside the output is copied aside first (the
//! all-to-all's input and output may not overlap). Counts go to the GPU by a copy from host
//! memory, which a CUDA graph cannot hold: under capture these calls are refused by name.

use crate::abi;
use crate::colls::{bytes_of, stream};
use crate::comm::Comm;
use crate::error::ShimError;
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
use doorbell::collectives::elementwise::Extremum;
use doorbell::collectives::DataType;
use std::ffi::c_int;
use std::sync::Arc;

fn cuda(call: &str, what: &str, e: impl std::fmt::Display) -> ShimError {
    ShimError::new(abi::UNHANDLED_CUDA_ERROR, format!("{call}: {what}: {e}"))
}

/// `bytes` copied from `src` to `dst` on `st` (device memory of this GPU).
fn copy(call: &str, st: &CudaStream, dst: u64, src: u64, bytes: usize) -> Result<(), ShimError> {
    if bytes == 0 || dst == src {
        return Ok(());
    }
    // SAFETY: both ranges are the caller's device memory of `bytes` (NCCL's contract), and the
    // copy is queued on the caller's stream.
    unsafe { doorbell::gpu::cuda::copy_async(st, dst, src, bytes) }
        .map_err(|e| cuda(call, "a copy", e))
}

/// A scratch buffer of `bytes` on `st` (freed in stream order when dropped).
fn scratch(call: &str, st: &Arc<CudaStream>, bytes: usize) -> Result<CudaSlice<u8>, ShimError> {
    // SAFETY: the contents are written before they are read.
    unsafe { st.alloc::<u8>(bytes.max(16)) }.map_err(|e| cuda(call, "a scratch buffer", e))
}

/// The caller's stream `s` in the all-to-all communicator's context, for a call moved onto
/// doorbell's all-to-all(v): refused under CUDA graph capture.
fn uncaptured_stream(comm: &Comm, call: &str, s: u64) -> Result<Arc<CudaStream>, ShimError> {
    let (c, _) = comm.all_to_all()?;
    let st = stream(c, s)?;
    if doorbell::gpu::signature::capturing(&st) {
        return Err(ShimError::new(
            abi::INVALID_USAGE,
            format!(
                "{call} on doorbell (no real NCCL here) under CUDA graph capture: its counts are \
                 copied from host memory, which a graph cannot hold"
            ),
        ));
    }
    Ok(st)
}

/// One all-to-all(v) of `counts` (send counts, send offsets, receive counts, receive offsets,
/// in bytes, by rank) from `input` to `output`.
#[allow(clippy::too_many_arguments)]
fn all_to_all_v(
    call: &str,
    comm: &Comm,
    st: &Arc<CudaStream>,
    input: (u64, usize),
    output: (u64, usize),
    counts: &[u64],
) -> Result<(), ShimError> {
    let (_, a2a) = comm.all_to_all()?;
    let dev = st
        .clone_htod(counts)
        .map_err(|e| cuda(call, "copying the counts", e))?;
    let (at, _guard) = dev.device_ptr(st);
    // SAFETY: the regions are the caller's (or scratch) device memory of the sizes given, not
    // overlapping (the callers copy an input inside the output aside); `dev` holds 4 x world
    // values and is freed in stream order after the kernel.
    unsafe { a2a.run_v_raw(st, input.0, input.1, output.0, output.1, at) }
        .map_err(|e| comm.failed(&e))
}

/// `send` (`bytes`) as an all-to-all's input beside `output`: itself, or, where it lies inside
/// the output, a copy aside (the buffer returned keeps it until the stream's work is done).
pub(crate) fn apart(
    call: &str,
    st: &Arc<CudaStream>,
    send: u64,
    bytes: usize,
    output: (u64, usize),
) -> Result<(u64, Option<CudaSlice<u8>>), ShimError> {
    if !overlap(send, bytes, output.0, output.1) {
        return Ok((send, None));
    }
    let aside = scratch(call, st, bytes)?;
    let p = aside.device_ptr(st).0;
    copy(call, st, p, send, bytes)?;
    Ok((p, Some(aside)))
}

/// Whether `[a, a + n)` and `[b, b + m)` overlap.
pub fn overlap(a: u64, n: usize, b: u64, m: usize) -> bool {
    n > 0 && m > 0 && a < b + m as u64 && b < a + n as u64
}

/// The all-to-all(v) counts of an all-gather of `block` bytes a rank, for rank `me` of `world`:
/// my block (from the start of my input) to every other rank, each other rank's block received
/// at its place. My own block is not in it (copied, or in place).
pub fn gather_counts(world: usize, me: usize, block: usize) -> Vec<u64> {
    let mut counts = vec![0u64; 4 * world];
    for p in (0..world).filter(|&p| p != me) {
        counts[p] = block as u64;
        counts[2 * world + p] = block as u64;
        counts[3 * world + p] = (p * block) as u64;
    }
    counts
}

/// The all-to-all(v) counts of a broadcast of `bytes` from `root`, for rank `me` of `world`:
/// the root sends its input to every other rank; the others receive it at the start.
pub fn broadcast_counts(world: usize, me: usize, root: usize, bytes: usize) -> Vec<u64> {
    let mut counts = vec![0u64; 4 * world];
    if me == root {
        for p in (0..world).filter(|&p| p != root) {
            counts[p] = bytes as u64;
        }
    } else {
        counts[2 * world + root] = bytes as u64;
    }
    counts
}

/// `ncclAllGather(sendbuff, recvbuff, sendcount, datatype, comm, stream)` on doorbell.
pub fn all_gather(
    comm: &Comm,
    send: u64,
    recv: u64,
    count: usize,
    t: c_int,
    s: u64,
) -> Result<(), ShimError> {
    const CALL: &str = "ncclAllGather";
    let block = bytes_of(CALL, count, t)?;
    let world = comm.nranks;
    block.checked_mul(world).ok_or_else(|| {
        ShimError::invalid_argument(format!("{CALL}: {count} x {world} overflow"))
    })?;
    if block == 0 {
        return Ok(());
    }
    let st = uncaptured_stream(comm, CALL, s)?;
    gather(CALL, comm, &st, send, recv, block)
}

/// Every rank's `block` bytes at `send` into `recv` (`world x block`), in rank order, on `st`.
fn gather(
    call: &str,
    comm: &Comm,
    st: &Arc<CudaStream>,
    send: u64,
    recv: u64,
    block: usize,
) -> Result<(), ShimError> {
    let (world, me) = (comm.nranks, comm.rank);
    let total = block * world;
    // In place (my block at my place in the output) the input is copied aside first.
    let (input, _aside) = apart(call, st, send, block, (recv, total))?;
    // My own block: copied (nothing to do in place).
    if send != recv + (me * block) as u64 {
        copy(call, st, recv + (me * block) as u64, input, block)?;
    }
    let counts = gather_counts(world, me, block);
    all_to_all_v(call, comm, st, (input, block), (recv, total), &counts)
}

/// `ncclAllReduce` with max or min (`which`) of `count` elements of `dt` on doorbell: every
/// rank's input gathered into scratch as [`all_gather`] does, then the maximum or minimum over
/// the ranks' slices into `recv` ([`doorbell::collectives::elementwise`]). Refused under CUDA
/// graph capture, as the all-gather is.
#[allow(clippy::too_many_arguments)]
pub fn all_reduce_extremum(
    comm: &Comm,
    send: u64,
    recv: u64,
    count: usize,
    t: c_int,
    dt: DataType,
    which: Extremum,
    s: u64,
) -> Result<(), ShimError> {
    const CALL: &str = "ncclAllReduce";
    let block = bytes_of(CALL, count, t)?;
    let world = comm.nranks;
    let total = block.checked_mul(world).ok_or_else(|| {
        ShimError::invalid_argument(format!("{CALL}: {count} x {world} overflow"))
    })?;
    if block == 0 {
        return Ok(());
    }
    let st = uncaptured_stream(comm, CALL, s)?;
    let gathered = scratch(CALL, &st, total)?;
    let at = gathered.device_ptr(&st).0;
    gather(CALL, comm, &st, send, at, block)?;
    let (_, ew) = comm.elementwise()?;
    // SAFETY: `gathered` holds `world` slices of `count` elements (freed in stream order after
    // the kernel), `recv` `count` elements (NCCL's contract), apart from the scratch.
    unsafe { ew.reduce_slices_raw(&st, at, world as u32, count as u64, dt, which, recv) }
        .map_err(|e| ShimError::from_doorbell(&e))
}

/// `ncclBroadcast(sendbuff, recvbuff, count, datatype, root, comm, stream)` on doorbell
/// (`ncclBcast` is the in-place one).
#[allow(clippy::too_many_arguments)]
pub fn broadcast(
    comm: &Comm,
    send: u64,
    recv: u64,
    count: usize,
    t: c_int,
    root: c_int,
    s: u64,
) -> Result<(), ShimError> {
    const CALL: &str = "ncclBroadcast";
    let bytes = bytes_of(CALL, count, t)?;
    let (world, me) = (comm.nranks, comm.rank);
    if root < 0 || root as usize >= world {
        return Err(ShimError::invalid_argument(format!(
            "{CALL}: root {root} of {world} ranks"
        )));
    }
    if bytes == 0 {
        return Ok(());
    }
    let root = root as usize;
    let st = uncaptured_stream(comm, CALL, s)?;
    let counts = broadcast_counts(world, me, root, bytes);
    let mut input = (0u64, 0usize);
    let mut _aside = None;
    if me == root {
        let (p, kept) = apart(CALL, &st, send, bytes, (recv, bytes))?;
        (input, _aside) = ((p, bytes), kept);
        if send != recv {
            copy(CALL, &st, recv, p, bytes)?;
        }
    }
    all_to_all_v(CALL, comm, &st, input, (recv, bytes), &counts)
}

/// `ncclReduceScatter(sendbuff, recvbuff, recvcount, datatype, op, comm, stream)` on doorbell:
/// the sum of bf16, f16 or f32 (doorbell's allreduce into scratch, then my block).
#[allow(clippy::too_many_arguments)]
pub fn reduce_scatter(
    comm: &Comm,
    send: u64,
    recv: u64,
    count: usize,
    t: c_int,
    o: c_int,
    s: u64,
) -> Result<(), ShimError> {
    const CALL: &str = "ncclReduceScatter";
    let block = bytes_of(CALL, count, t)?;
    let world = comm.nranks;
    let total_count = count.checked_mul(world).ok_or_else(|| {
        ShimError::invalid_argument(format!("{CALL}: {count} x {world} overflow"))
    })?;
    if !crate::colls::all_reduce_doorbell(t, o) {
        return Err(ShimError::new(
            abi::INVALID_USAGE,
            format!(
                "{CALL} of {} ({}): doorbell reduces bf16, f16 or f32 only (sum, avg, max, min)",
                crate::colls::type_name(t),
                crate::colls::op_name(o)
            ),
        ));
    }
    if block == 0 {
        return Ok(());
    }
    let (c, _) = comm.all_to_all()?;
    let st = stream(c, s)?;
    let sum = scratch(CALL, &st, block * world)?;
    let p = sum.device_ptr(&st).0;
    crate::colls::all_reduce(comm, send, p, total_count, t, o, s)?;
    copy(CALL, &st, recv, p + (comm.rank * block) as u64, block)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gathers_and_broadcasts_become_the_right_all_to_all_v_counts() {
        // 3 ranks, 8-byte blocks, rank 1: its block to 0 and 2; theirs at 0 and 16.
        assert_eq!(
            gather_counts(3, 1, 8),
            vec![8, 0, 8, 0, 0, 0, 8, 0, 8, 0, 0, 16]
        );
        // What every pair sends is what its peer expects (the kernel checks it too).
        for world in 1..6 {
            let all: Vec<Vec<u64>> = (0..world).map(|r| gather_counts(world, r, 4)).collect();
            for (a, mine) in all.iter().enumerate() {
                for (b, theirs) in all.iter().enumerate() {
                    assert_eq!(mine[b], theirs[2 * world + a], "{a} to {b} of {world}");
                }
            }
            for root in 0..world {
                let all: Vec<Vec<u64>> = (0..world)
                    .map(|r| broadcast_counts(world, r, root, 12))
                    .collect();
                for (a, mine) in all.iter().enumerate() {
                    for (b, theirs) in all.iter().enumerate() {
                        assert_eq!(mine[b], theirs[2 * world + a], "root {root}: {a} to {b}");
                    }
                }
                // Every other rank gets the root's bytes once; offsets all 0.
                for b in (0..world).filter(|&b| b != root) {
                    assert_eq!(all[b][2 * world + root], 12);
                }
                assert!(all
                    .iter()
                    .all(|c| c[world..2 * world].iter().all(|&o| o == 0)));
            }
        }
    }

    #[test]
    fn overlap_is_any_shared_byte() {
        assert!(overlap(100, 10, 105, 10));
        assert!(overlap(105, 10, 100, 10));
        assert!(!overlap(100, 10, 110, 10));
        assert!(
            !overlap(100, 0, 100, 10),
            "nothing to move overlaps nothing"
        );
        // In place all-gather: my block inside the output.
        assert!(overlap(100 + 2 * 8, 8, 100, 32));
    }
}
