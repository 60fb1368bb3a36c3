//! Allreduce (sum) over the ranks of one node, on the caller's cudarc stream.
//!
//! Three algorithms (kernels in `cuda/kernels/allreduce.cu`, protocol comments there):
//! - one-shot with LL packets: every rank pushes its input to every peer, each reduces all of
//!   it; one NVLink crossing, for small messages;
//! - two-shot with LL packets: reduce-scatter then all-gather in one kernel, no barrier; for
//!   medium messages;
//! - pipelined: reduce-scatter + all-gather in tiles through a scratch ring, synchronized with
//!   semaphores, many blocks (lanes) in flight; for large messages.
//!
//! The choice comes from [`Algorithm::choose`], a table of measured crossovers by rank count
//! and size, overridden by [`AllReduceOptions::algorithm`] or `DOORBELL_ALLREDUCE_ALGO`.
//! Scratch and semaphores are allocated once, in [`AllReduce::new`]; every call reads its
//! per-call state (epochs) from device memory, so calls are stream-ordered and CUDA-graph
//! capturable with any number of replays.
//!
//! Every rank must call with the same count, type and algorithm choice inputs, in the same
//! order. `DOORBELL_HOST_CALL_CHECK=1` (or [`AllReduceOptions::check_args`]) verifies that on every call
//! and names the odd rank instead of hanging.

use crate::channel::semaphore::Semaphores;
use crate::channel::symmetric::SymmetricBuffer;
use crate::collectives::{DataType, ReduceOp};
use crate::communicator::Communicator;
use crate::device_api::limits::PIPE_DEPTH;
use crate::device_api::{
    AllReduceArgs, AllReduceDirectArgs, LamportState, SemaphoreHandle, MAX_RANKS,
};
use crate::error::{Error, Result};
use crate::gpu::cuda::cuda_err;
use crate::gpu::memory::Buffer;
use crate::gpu::signature::{self, CallChecker, CallKind};
use cudarc::driver::{CudaFunction, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, LaunchConfig};
use std::collections::HashMap;
use std::sync::Arc;

mod algorithm;
mod window;

use algorithm::TILES_PER_LANE;
pub use algorithm::{Algorithm, AllReduceOptions, Element, Plan};
use window::{direct_signature, locate, Direct, Span, Window};

/// Allreduce state of one communicator: scratch every peer maps, semaphores, device epochs and
/// the kernels. Build it once (collective) and call it as often as needed.
pub struct AllReduce {
    comm: Arc<Communicator>,
    opts: AllReduceOptions,
    forced: Option<Algorithm>,
    check_args: bool,
    base: AllReduceArgs,
    lanes: u32,
    ll_blocks: u32,
    max_tile_bytes: usize,
    kernels: HashMap<(Algorithm, bool, DataType), CudaFunction>,
    _scratch: SymmetricBuffer,
    _semaphores: Semaphores,
    _sems_dev: CudaSlice<SemaphoreHandle>,
    _epochs: CudaSlice<u32>,
    _sentinel_state: CudaSlice<u8>,
    /// Counts calls and makes each call's word (the call check, `coll/call_check.cuh`).
    calls: CallChecker,
    /// Launch with programmatic dependent launch (`DOORBELL_PDL`, sm_90 and later).
    overlap: bool,
    /// Registered windows, in registration order (the same on every rank).
    windows: std::sync::Mutex<Vec<Window>>,
}

impl AllReduce {
    /// Allocates scratch, maps every peer's, builds the semaphores and loads the kernels.
    /// Collective: every rank calls it, with the same options.
    pub fn new(comm: &Arc<Communicator>, opts: AllReduceOptions) -> Result<AllReduce> {
        let world = comm.world_size();
        let rank = comm.rank();
        if world > MAX_RANKS {
            return Err(Error::invalid(
                "world size",
                format!("{world} ranks: the single-node allreduce handles at most {MAX_RANKS}"),
            ));
        }
        if opts
            .max_tile_bytes
            .is_some_and(|b| b % 16 != 0 || b < opts.min_tile_bytes)
            || opts.min_tile_bytes % 16 != 0
            || opts.min_tile_bytes == 0
        {
            return Err(Error::invalid(
                "tile bytes",
                "min and max tile bytes must be positive multiples of 16, min <= max",
            ));
        }
        if !(128..=512).contains(&opts.pipeline_threads) || opts.pipeline_threads % 32 != 0 {
            return Err(Error::invalid(
                "pipeline_threads",
                format!(
                    "{}: must be a multiple of 32 in [128, 512] (the kernel splits its warps into three groups)",
                    opts.pipeline_threads
                ),
            ));
        }
        if !(32..=512).contains(&opts.ll_threads) || opts.ll_threads % 32 != 0 {
            return Err(Error::invalid(
                "ll_threads",
                format!("{}: must be a multiple of 32 in [32, 512]", opts.ll_threads),
            ));
        }
        if opts.sentinel_slot_bytes < 16 || opts.sentinel_slot_bytes % 16 != 0 {
            return Err(Error::invalid(
                "sentinel_slot_bytes",
                "must be a positive multiple of 16",
            ));
        }
        if opts.ll_slot_bytes < 16 || opts.ll_slot_bytes % 16 != 0 {
            return Err(Error::invalid(
                "ll_slot_bytes",
                "must be a positive multiple of 16",
            ));
        }
        let settings = comm.settings();
        let forced = match (opts.algorithm, &settings.allreduce_algo) {
            (Some(a), _) => Some(a),
            (None, Some(s)) => Some(s.parse()?),
            (None, None) => None,
        };
        let check_args = opts.check_args.unwrap_or(settings.check_args);
        let gpu = comm.gpu().clone();
        let sms = gpu.sm_count()?;
        let lanes = opts.max_lanes.clamp(1, sms) as usize;
        let ll_blocks = opts.ll_blocks.clamp(1, sms);
        // A lane holds PIPE_DEPTH slots of [RS | AG] x world shards.
        let per_shard_budget = opts.pipeline_scratch_bytes / (lanes * PIPE_DEPTH * 2 * world);
        let max_tile_bytes = opts
            .max_tile_bytes
            .unwrap_or((per_shard_budget / 16 * 16).min(256 << 10))
            .max(opts.min_tile_bytes);

        let ll_half = 2 * world * opts.ll_slot_bytes;
        let ll_bytes = 2 * ll_half;
        let lane_bytes = PIPE_DEPTH * 2 * world * max_tile_bytes;
        let sentinel_buf = 2 * world * opts.sentinel_slot_bytes;
        let sentinel_offset = ll_bytes + lanes * lane_bytes;
        // The call check's inbox sits after the sentinel buffers (zeroed, never filled).
        let inbox_offset = sentinel_offset + 3 * sentinel_buf;
        let scratch = comm.alloc(inbox_offset + signature::INBOX_BYTES)?;
        // The sentinel region starts empty: all ones.
        scratch.fill(sentinel_offset, 3 * sentinel_buf, 0xFF)?;
        let scratch = comm.share(&scratch)?;
        // Sets [0, lanes) say "reduce-scatter part arrived", [lanes, 2 lanes) "reduced shard
        // arrived".
        let semaphores = comm.semaphores(2 * lanes)?;

        let stream = gpu.new_stream()?;
        let sems_dev = stream
            .clone_htod(semaphores.handles())
            .map_err(cuda_err("cuMemcpyHtoD"))?;
        let epochs = stream
            .alloc_zeros::<u32>(ll_blocks as usize)
            .map_err(cuda_err("cuMemAlloc"))?;
        let sentinel_state = stream
            .alloc_zeros::<u8>(ll_blocks as usize * std::mem::size_of::<LamportState>())
            .map_err(cuda_err("cuMemAlloc"))?;
        let scratch_ptrs = scratch.bases("the allreduce")?;
        let inbox = scratch.bases_at(inbox_offset, "the allreduce")?;
        let sems_ptr = sems_dev.device_ptr(&stream).0;
        let base = AllReduceArgs {
            scratch: scratch_ptrs,
            rs_sems: sems_ptr,
            ag_sems: sems_ptr + (lanes * world * std::mem::size_of::<SemaphoreHandle>()) as u64,
            epochs: epochs.device_ptr(&stream).0,
            ll_offset: 0,
            ll_half_bytes: ll_half as u64,
            ll_slot_bytes: opts.ll_slot_bytes as u64,
            pipe_offset: ll_bytes as u64,
            pipe_lane_bytes: lane_bytes as u64,
            lamport_offset: sentinel_offset as u64,
            lamport_buf_bytes: sentinel_buf as u64,
            lamport_slot_bytes: opts.sentinel_slot_bytes as u64,
            lamport_state: sentinel_state.device_ptr(&stream).0,
            rank: rank as u32,
            world: world as u32,
            site: comm.diagnostics().site(-1, u32::MAX),
            ..Default::default()
        };
        stream
            .synchronize()
            .map_err(cuda_err("cuStreamSynchronize"))?;

        let mut kernels = HashMap::new();
        for dtype in DataType::ALL {
            let suffix = match dtype {
                DataType::Bf16 => "bf16",
                DataType::F16 => "f16",
                DataType::F32 => "f32",
            };
            for algo in Algorithm::ALL {
                if matches!(algo, Algorithm::Pipelined | Algorithm::TwoShotDirect) {
                    for vec in [true, false] {
                        let name = format!(
                            "{}_{}_{suffix}",
                            algo.kernel_stem(),
                            if vec { "vec" } else { "scalar" }
                        );
                        kernels.insert((algo, vec, dtype), gpu.function("allreduce", &name)?);
                    }
                } else {
                    let name = format!("{}_{suffix}", algo.kernel_stem());
                    kernels.insert((algo, false, dtype), gpu.function("allreduce", &name)?);
                }
            }
        }
        // Every peer has mapped our scratch before anyone launches into it.
        comm.bootstrap().barrier()?;
        Ok(AllReduce {
            comm: comm.clone(),
            opts,
            forced,
            check_args,
            base,
            lanes: lanes as u32,
            ll_blocks,
            max_tile_bytes,
            kernels,
            _scratch: scratch,
            _semaphores: semaphores,
            _sems_dev: sems_dev,
            _epochs: epochs,
            _sentinel_state: sentinel_state,
            calls: CallChecker::new(inbox, settings.call_check, comm.bootstrap().call_counter()),
            overlap: settings.pdl && gpu.overlapping_launch()?,
            windows: std::sync::Mutex::new(Vec::new()),
        })
    }

    /// Registers `buffer` (from [`Communicator::alloc`]) as a window: every peer maps it, and
    /// calls whose input and output both lie in windows, at the same offsets on every rank
    /// (ranks whose buffers sit elsewhere fail the call check, naming the rank), run
    /// [`Algorithm::TwoShotDirect`] where the pipeline would run (no staging through scratch; NCCL's
    /// registered windows, torch's symmetric memory). Collective: every rank registers its
    /// buffers in the same order with the same sizes (checked). The window stays registered as
    /// long as this allreduce lives.
    pub fn register_window(&self, buffer: &Arc<Buffer>) -> Result<()> {
        let rank = self.comm.rank();
        let sizes = self
            .comm
            .bootstrap()
            .all_gather(&(buffer.len() as u64).to_le_bytes())?;
        let odd: Vec<String> = sizes
            .iter()
            .enumerate()
            .filter(|(_, b)| b.as_slice() != (buffer.len() as u64).to_le_bytes())
            .map(|(r, b)| {
                let n = b.as_slice().try_into().map_or(0, u64::from_le_bytes);
                format!("rank {r} registered {n} bytes")
            })
            .collect();
        if !odd.is_empty() {
            return Err(Error::invalid(
                "window",
                format!(
                    "every rank registers the same size: rank {rank} registered {} bytes, {}",
                    buffer.len(),
                    odd.join(", ")
                ),
            ));
        }
        let shared = self.comm.share(buffer)?;
        let mapped = shared.bases("an allreduce window")?;
        // Every peer has mapped this window before anyone launches into it.
        self.comm.bootstrap().barrier()?;
        self.windows
            .lock()
            .map_err(|_| Error::invalid("window", "the window table was poisoned by a panic"))?
            .push(Window {
                span: Span {
                    base: buffer.device_ptr(),
                    bytes: buffer.len() as u64,
                    mapped,
                },
                _shared: shared,
            });
        Ok(())
    }

    /// Every rank's input and output as mapped here, when both of this call's buffers lie in
    /// registered windows (16-byte aligned).
    fn direct(&self, input: u64, output: u64, bytes: usize) -> Option<Direct> {
        if input % 16 != 0 || output % 16 != 0 || self.comm.world_size() < 2 {
            return None;
        }
        let windows = self.windows.lock().ok()?;
        let spans = || windows.iter().map(|w| &w.span);
        let (wi, oi, input) = locate(spans(), input, bytes as u64)?;
        let (wo, oo, output) = locate(spans(), output, bytes as u64)?;
        Some(Direct {
            input,
            output,
            at: ((wi, oi), (wo, oo)),
        })
    }

    /// The communicator.
    pub fn communicator(&self) -> &Arc<Communicator> {
        &self.comm
    }

    /// Largest message (bytes) `algorithm` can take with this scratch.
    pub fn max_bytes(&self, algorithm: Algorithm) -> usize {
        if algorithm == Algorithm::TwoShotSentinel {
            return self.opts.sentinel_slot_bytes * self.comm.world_size();
        }
        match algorithm.packet() {
            None => usize::MAX,
            Some((pkt, payload)) => {
                let packets = self.opts.ll_slot_bytes / pkt;
                match algorithm {
                    Algorithm::OneShotLl8 | Algorithm::OneShotLl16 => packets * payload,
                    _ => packets * payload * self.comm.world_size(),
                }
            }
        }
    }

    /// How a call of `count` elements of `dtype` on 16-byte aligned buffers would run.
    pub fn plan(&self, count: usize, dtype: DataType) -> Result<Plan> {
        self.plan_for(count, dtype, true, false)
    }

    /// How a call of `count` elements of `dtype` would run with both buffers in registered
    /// windows ([`AllReduce::register_window`]).
    pub fn plan_registered(&self, count: usize, dtype: DataType) -> Result<Plan> {
        self.plan_for(count, dtype, true, true)
    }

    fn plan_for(
        &self,
        count: usize,
        dtype: DataType,
        aligned: bool,
        registered: bool,
    ) -> Result<Plan> {
        let world = self.comm.world_size();
        let bytes = count
            .checked_mul(dtype.size())
            .ok_or_else(|| Error::invalid("count", format!("{count} elements overflow")))?;
        let mut algorithm = self.forced.unwrap_or_else(|| {
            if registered {
                Algorithm::choose_registered(world, bytes)
            } else {
                Algorithm::choose(world, bytes)
            }
        });
        if algorithm == Algorithm::TwoShotDirect && !registered {
            // The documented fallback, forced or not.
            algorithm = Algorithm::Pipelined;
        }
        if algorithm == Algorithm::TwoShotSentinel && (!aligned || bytes % 16 != 0) {
            // The documented fallback, forced or not.
            algorithm = if bytes <= self.max_bytes(Algorithm::TwoShotLl16) {
                Algorithm::TwoShotLl16
            } else {
                Algorithm::Pipelined
            };
        }
        if self.forced.is_none() && bytes > self.max_bytes(algorithm) {
            algorithm = Algorithm::Pipelined;
        }
        if bytes > self.max_bytes(algorithm) {
            return Err(Error::invalid(
                "count",
                format!(
                    "{bytes} bytes exceed {}'s limit of {} bytes with this scratch (raise ll_slot_bytes)",
                    algorithm.name(),
                    self.max_bytes(algorithm)
                ),
            ));
        }
        Ok(match algorithm.packet() {
            // Every LL and sentinel launch has the same grid (see the kernels' epoch argument).
            Some(_) => Plan {
                algorithm,
                blocks: self.ll_blocks,
                threads: self.opts.ll_threads,
                tile_elems: 0,
            },
            None if algorithm == Algorithm::TwoShotDirect => {
                // Four 16-byte vectors per thread of each block, over the shard; at most the
                // pipeline's lanes (their semaphores are the handshakes).
                let per_block = 4 * 16 * self.opts.pipeline_threads as usize;
                let shard = bytes.div_ceil(world);
                Plan {
                    algorithm,
                    blocks: shard.div_ceil(per_block).clamp(1, self.lanes as usize) as u32,
                    threads: self.opts.pipeline_threads,
                    tile_elems: 0,
                }
            }
            None if algorithm == Algorithm::TwoShotSentinel => Plan {
                algorithm,
                blocks: self.ll_blocks,
                threads: self.opts.ll_threads,
                tile_elems: 0,
            },
            None => {
                let size = dtype.size();
                let vec_elems = 16 / size;
                let lanes = self.lanes as usize;
                let min_e = self.opts.min_tile_bytes / size;
                let max_e = self.max_tile_bytes / size;
                let want = count
                    .div_ceil(world * lanes * TILES_PER_LANE)
                    .next_multiple_of(vec_elems);
                let ke = want.clamp(min_e, max_e);
                let ntiles = count.div_ceil(ke * world).max(1);
                Plan {
                    algorithm,
                    blocks: ntiles.min(lanes) as u32,
                    threads: self.opts.pipeline_threads,
                    tile_elems: ke as u64,
                }
            }
        })
    }

    /// Sums `count` elements of `dtype` at `input` over all ranks into `output` (which may equal
    /// `input`), on `stream`.
    ///
    /// # Safety
    /// `input` and `output` must be device memory of this rank's GPU holding `count` elements,
    /// valid until the work on `stream` completes, and not overlapping unless equal.
    pub unsafe fn run_raw(
        &self,
        stream: &CudaStream,
        input: u64,
        output: u64,
        count: usize,
        dtype: DataType,
    ) -> Result<()> {
        self.comm.check_health()?;
        if self.check_args {
            self.agree(count, dtype)?;
        }
        let aligned = input % 16 == 0 && output % 16 == 0;
        let direct = self.direct(input, output, count.saturating_mul(dtype.size()));
        // Every call takes the next index, launched or not, so ranks stay in step.
        let plan = self.plan_for(count.max(1), dtype, aligned, direct.is_some());
        // A direct call's word also says where its buffers sit (`direct_signature`).
        let word_count = match (&plan, &direct) {
            (Ok(p), Some(d)) if p.algorithm == Algorithm::TwoShotDirect => {
                direct_signature(count as u64, d.at.0, d.at.1)
            }
            _ => count as u64,
        };
        let call = self.calls.next(
            CallKind::AllReduce,
            dtype.code(),
            plan.as_ref().map_or(15, |p| p.algorithm.code()),
            ReduceOp::Sum.code(),
            word_count,
            signature::capturing(stream),
        );
        if count == 0 {
            return Ok(());
        }
        let elem = dtype.size() as u64;
        if input % elem != 0 || output % elem != 0 {
            return Err(Error::invalid(
                "buffer",
                format!("pointers must be aligned to the element size ({elem} bytes)"),
            ));
        }
        if self.comm.world_size() == 1 {
            if input != output {
                self.comm.gpu().bind()?;
                // SAFETY: the caller guarantees both ranges hold `count` elements.
                unsafe {
                    crate::gpu::cuda::copy_async(stream, output, input, count * dtype.size())
                }?;
            }
            return Ok(());
        }
        let plan = plan?;
        let vec = matches!(
            plan.algorithm,
            Algorithm::Pipelined | Algorithm::TwoShotDirect
        ) && aligned;
        let f = self
            .kernels
            .get(&(plan.algorithm, vec, dtype))
            .ok_or_else(|| Error::invalid("allreduce", "kernel missing"))?;
        let mut args = AllReduceArgs {
            input,
            output,
            count: count as u64,
            tile_elems: plan.tile_elems,
            call,
            ..self.base
        };
        let mut direct_args = direct.map(|d| AllReduceDirectArgs {
            base: args,
            peer_input: d.input,
            peer_output: d.output,
        });
        let param: *mut std::ffi::c_void = match (&mut direct_args, plan.algorithm) {
            (Some(d), Algorithm::TwoShotDirect) => (d as *mut AllReduceDirectArgs).cast(),
            _ => (&mut args as *mut AllReduceArgs).cast(),
        };
        let cfg = LaunchConfig {
            grid_dim: (plan.blocks, 1, 1),
            block_dim: (plan.threads, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: the one parameter is the kernel's AllReduceArgs or AllReduceDirectArgs
        // (layout-tested), alive through the launch; every allreduce kernel begins with
        // wait_previous_grid (allreduce.cu); the caller vouches for the buffers; scratch and
        // semaphores live as long as `self`.
        self.comm.cuda_result(
            unsafe { crate::gpu::cuda::launch(stream, f, cfg, &mut [param], self.overlap) },
            "cuLaunchKernelEx",
        )
    }

    /// Sums `input` over all ranks into `output`.
    pub fn run<T: Element, I: DevicePtr<T>, O: DevicePtrMut<T>>(
        &self,
        stream: &CudaStream,
        input: &I,
        output: &mut O,
    ) -> Result<()> {
        if input.len() != output.len() {
            return Err(Error::invalid(
                "output",
                format!("{} elements in, {} out", input.len(), output.len()),
            ));
        }
        let count = input.len();
        let (i, _gi) = input.device_ptr(stream);
        let (o, _go) = output.device_ptr_mut(stream);
        // SAFETY: both come from live cudarc allocations of `count` elements on this context;
        // distinct borrows, so they do not alias.
        unsafe { self.run_raw(stream, i, o, count, T::DTYPE) }
    }

    /// Sums `buf` over all ranks in place.
    pub fn run_in_place<T: Element, B: DevicePtrMut<T>>(
        &self,
        stream: &CudaStream,
        buf: &mut B,
    ) -> Result<()> {
        let count = buf.len();
        let (p, _g) = buf.device_ptr_mut(stream);
        // SAFETY: a live cudarc allocation of `count` elements on this context.
        unsafe { self.run_raw(stream, p, p, count, T::DTYPE) }
    }

    /// Checks that every rank makes the same call; names the ranks that differ from the
    /// majority (or from rank 0 on a tie).
    fn agree(&self, count: usize, dtype: DataType) -> Result<()> {
        let call = self.calls.calls();
        let mut mine = Vec::with_capacity(24);
        mine.extend_from_slice(&call.to_le_bytes());
        mine.extend_from_slice(&(count as u64).to_le_bytes());
        mine.extend_from_slice(&dtype.code().to_le_bytes());
        mine.extend_from_slice(&ReduceOp::Sum.code().to_le_bytes());
        let all = self.comm.bootstrap().all_gather(&mine)?;
        let describe = |b: &[u8]| -> String {
            if b.len() != 24 {
                return "a malformed call record".into();
            }
            let n = u64::from_le_bytes(b[8..16].try_into().unwrap_or_default());
            let t = u32::from_le_bytes(b[16..20].try_into().unwrap_or_default());
            let dtype = DataType::ALL
                .into_iter()
                .find(|d| d.code() == t)
                .map_or("?", |d| d.name());
            let call = u64::from_le_bytes(b[0..8].try_into().unwrap_or_default());
            format!("call #{call}: {n} x {dtype}, sum")
        };
        // The majority value is taken as right.
        let mut counts: HashMap<&[u8], usize> = HashMap::new();
        for b in &all {
            *counts.entry(b.as_slice()).or_default() += 1;
        }
        let best = counts.values().copied().max().unwrap_or(0);
        let majority: &[u8] = if counts.values().filter(|&&c| c == best).count() > 1 {
            all[0].as_slice()
        } else {
            counts
                .iter()
                .find(|(_, &c)| c == best)
                .map(|(k, _)| *k)
                .unwrap_or(&all[0])
        };
        let odd: Vec<String> = all
            .iter()
            .enumerate()
            .filter(|(_, b)| b.as_slice() != majority)
            .map(|(r, b)| format!("rank {r} ({})", describe(b)))
            .collect();
        if odd.is_empty() {
            return Ok(());
        }
        Err(Error::invalid(
            "allreduce arguments",
            format!(
                "ranks disagree: {} while the others made {}",
                odd.join(", "),
                describe(majority)
            ),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn choice_follows_the_measured_table() {
        use Algorithm::*;
        let table: &[(usize, usize, Algorithm)] = &[
            (2, 8, OneShotLl16),
            (2, 256 << 10, OneShotLl16),
            (2, (256 << 10) + 1, TwoShotSentinel),
            (2, 4 << 20, TwoShotSentinel),
            (2, (4 << 20) + 1, Pipelined),
            (4, 64 << 10, OneShotLl16),
            (4, 128 << 10, TwoShotLl16),
            (4, 256 << 10, TwoShotLl16),
            (4, 512 << 10, TwoShotSentinel),
            (4, 2 << 20, TwoShotSentinel),
            (4, 4 << 20, Pipelined),
            (3, 1 << 20, TwoShotSentinel),
            (8, 32 << 10, OneShotLl16),
            (8, 1 << 30, Pipelined),
        ];
        for &(world, bytes, want) in table {
            assert_eq!(
                Algorithm::choose(world, bytes),
                want,
                "{world} ranks, {bytes} bytes"
            );
        }
    }

    #[test]
    fn registered_windows_take_the_direct_two_shot_where_the_pipeline_was() {
        use Algorithm::*;
        assert_eq!(Algorithm::choose_registered(2, 8), OneShotLl16);
        assert_eq!(Algorithm::choose_registered(2, 4 << 20), TwoShotSentinel);
        assert_eq!(
            Algorithm::choose_registered(2, (4 << 20) + 16),
            TwoShotDirect
        );
        assert_eq!(Algorithm::choose_registered(4, 1 << 30), TwoShotDirect);
    }

    #[test]
    fn windows_hold_a_call_only_when_the_whole_range_fits_one() {
        let span = |base: u64, bytes: u64, peer: u64| Span {
            base,
            bytes,
            mapped: {
                let mut m = [0u64; MAX_RANKS];
                m[0] = base;
                m[1] = peer;
                m
            },
        };
        let spans = [span(0x1000, 0x1000, 0x9000), span(0x4000, 0x800, 0xa000)];
        // Inside the first, to its last byte: every rank's address at the same offset.
        let (index, offset, at) = locate(&spans, 0x1100, 0xf00).unwrap();
        assert_eq!((index, offset), (0, 0x100));
        assert_eq!((at[0], at[1], at[2]), (0x1100, 0x9100, 0));
        // One byte past its end, before it, between the two, straddling: not held.
        assert!(locate(&spans, 0x1100, 0xf01).is_none());
        assert!(locate(&spans, 0x0ff0, 0x10).is_none());
        assert!(locate(&spans, 0x2000, 0x10).is_none());
        assert!(locate(&spans, 0x1ff0, 0x2010).is_none());
        // The second window; a size that would overflow the address is refused, not wrapped.
        assert_eq!(
            locate(&spans, 0x4000, 0x800).unwrap(),
            (1, 0, {
                let mut m = [0u64; MAX_RANKS];
                m[0] = 0x4000;
                m[1] = 0xa000;
                m
            })
        );
        assert!(locate(&spans, 0x4010, u64::MAX).is_none());
        assert!(locate(&[], 0x1000, 1).is_none());
    }

    #[test]
    fn direct_words_differ_when_counts_windows_or_offsets_do() {
        let base = direct_signature(1 << 20, (0, 0), (1, 0));
        assert_eq!(base, direct_signature(1 << 20, (0, 0), (1, 0)));
        assert!(base < 1 << 32);
        for other in [
            direct_signature((1 << 20) + 1, (0, 0), (1, 0)),
            direct_signature(1 << 20, (0, 4096), (1, 0)),
            direct_signature(1 << 20, (0, 0), (1, 4096)),
            direct_signature(1 << 20, (1, 0), (0, 0)),
            direct_signature(1 << 21, (0, 0), (1, 0)),
        ] {
            assert_ne!(base, other);
        }
    }

    #[test]
    fn call_words_name_the_algorithms_as_they_are_called() {
        for a in Algorithm::ALL {
            assert_eq!(signature::ALLREDUCE_VARIANTS[a.code() as usize], a.name());
        }
    }

    #[test]
    fn names_round_trip_and_bad_names_are_errors() {
        for a in Algorithm::ALL {
            assert_eq!(a.name().parse::<Algorithm>().unwrap(), a);
        }
        let e = "ring".parse::<Algorithm>().unwrap_err().to_string();
        assert!(e.contains("twoshot-sentinel"), "{e}");
    }
}
