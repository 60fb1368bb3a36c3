//! All-to-all with equal blocks (`alltoall`) and with per-peer counts and offsets (`alltoallv`)
//! over the ranks of one node, on the caller's cudarc stream, CUDA-graph capturable.
//!
//! Kernel and protocol: `cuda/kernels/alltoall.cu`. Each peer's block crosses NVLink into the
//! receiver's scratch ring by SM stores and the receiver copies it out, tile by tile, with credit
//! flow control; every count lives in device memory, so graph replays need no host work. Blocks of
//! at most [`AllToAllOptions::ll_max_bytes`] go as LL16 packets instead (a flag in every 16
//! bytes: one NVLink crossing, no semaphores): for equal blocks the whole call, for `alltoallv`
//! each pair by its own size, decided on the device (both sides of a pair read the same count,
//! while no rank knows the other pairs'). An `alltoallv` checks its device counts against the
//! buffers before writing anything and each pair's two counts against each other (the call
//! check), naming a disagreement on both ranks of the pair. Sizes are bytes underneath: any
//! element type works, raw bytes included.

use crate::channel::semaphore::Semaphores;
use crate::channel::symmetric::SymmetricBuffer;
use crate::communicator::Communicator;
use crate::device_api::{AllToAllArgs, SemaphoreHandle, MAX_RANKS};
use crate::error::{Error, Result};
use crate::gpu::cuda::cuda_err;
use crate::gpu::signature::{self, CallChecker, CallKind};
use cudarc::driver::{
    CudaFunction, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr, LaunchConfig,
    PushKernelArg,
};
use std::sync::{Arc, Mutex};

/// Knobs of an [`AllToAll`].
#[derive(Debug, Clone)]
pub struct AllToAllOptions {
    /// Blocks per peer (default: the SMs left by `own_lanes` divided among the peers, so the whole
    /// grid is resident at once, which the cross-GPU waits need).
    pub lanes: Option<u32>,
    /// Blocks that copy this rank's own block (a local copy; default: 12 / peers, at least 4,
    /// or as many as a peer gets when `lanes` is given).
    pub own_lanes: Option<u32>,
    /// Bytes per tile (a multiple of 16).
    pub tile_bytes: usize,
    /// Slots per (source, lane) ring.
    pub depth: u32,
    /// Threads per block (a multiple of 64).
    pub threads: u32,
    /// Threads of each block that send, the rest receiving (a multiple of 32 below `threads`;
    /// default: half).
    pub send_threads: Option<u32>,
    /// Blocks of at most this many bytes per peer go as LL16 packets (one NVLink crossing, no
    /// semaphores): equal blocks take the LL kernel, `alltoallv` pairs go so inside the tile
    /// kernel (only with the call check on, which keeps ranks in step); 0 turns it off. Default
    /// ([`AllToAllOptions::default_ll_max`]): 512 KiB on 2 ranks, 64 KiB on more.
    pub ll_max_bytes: Option<usize>,
    /// Blocks of the LL kernel (fixed per communicator: each packet index always belongs to the
    /// same block, which keeps its own epoch).
    pub ll_blocks: u32,
}

impl Default for AllToAllOptions {
    /// 64 KiB tiles, 6 slots: the fastest from 8 MiB to 1 GiB of the tile/depth sweep on 4 x
    /// H200 in `docs/performance.md` (128 KiB x 3 before: 4-10% slower from 16 to 256 MiB).
    fn default() -> Self {
        AllToAllOptions {
            lanes: None,
            own_lanes: None,
            tile_bytes: 64 << 10,
            depth: 6,
            threads: 512,
            send_threads: None,
            ll_max_bytes: None,
            ll_blocks: 64,
        }
    }
}

impl AllToAllOptions {
    /// The largest block per peer that goes as LL16 packets by default on `world` ranks. On 2 x
    /// H100 (`--ll-max` sweep, graph, 2026-11-25) the LL kernel beat the tile kernel up to blocks
    /// of 512 KiB: 256 KiB in total 3.8 us against 8.8 (NCCL 8.4), 1 MiB 8.1 against 10.5, 2 MiB
    /// even (12.8 / 13.0); 64 KiB on 4 x H200, where 3 peers' packets share each GPU's links
    /// (larger limits not measured there).
    pub fn default_ll_max(world: usize) -> usize {
        if world <= 2 {
            512 << 10
        } else {
            64 << 10
        }
    }
}

/// Per-peer counts and offsets of an `alltoallv`, in elements.
#[derive(Debug, Clone, Default)]
pub struct Counts {
    /// Elements I send to each rank.
    pub send_counts: Vec<usize>,
    /// Where each rank's block starts in my input.
    pub send_offsets: Vec<usize>,
    /// Elements I receive from each rank.
    pub recv_counts: Vec<usize>,
    /// Where each rank's block lands in my output.
    pub recv_offsets: Vec<usize>,
}

impl Counts {
    /// Contiguous blocks: offsets are the running sums of the counts.
    pub fn packed(send_counts: Vec<usize>, recv_counts: Vec<usize>) -> Counts {
        let offsets = |c: &[usize]| {
            c.iter()
                .scan(0, |acc, &n| {
                    let o = *acc;
                    *acc += n;
                    Some(o)
                })
                .collect()
        };
        Counts {
            send_offsets: offsets(&send_counts),
            recv_offsets: offsets(&recv_counts),
            send_counts,
            recv_counts,
        }
    }
}

/// All-to-all state of one communicator: scratch every peer maps, semaphores and the kernel.
/// Build it once (collective) and call it as often as needed; every rank calls in the same order.
pub struct AllToAll {
    comm: Arc<Communicator>,
    opts: AllToAllOptions,
    base: AllToAllArgs,
    kernel: CudaFunction,
    ll_kernel: CudaFunction,
    v_kernel: CudaFunction,
    /// Blocks of the tile kernel that copy this rank's own block.
    own_lanes: u32,
    /// Counts calls and makes each call's word (the call check, `coll/call_check.cuh`).
    calls: CallChecker,
    _epochs: CudaSlice<u32>,
    /// Device `[4][world]` byte counts for [`AllToAll::run_v`].
    counts: Mutex<CudaSlice<u64>>,
    _pair_epochs: CudaSlice<u32>,
    _scratch: SymmetricBuffer,
    _data: Semaphores,
    _credit: Semaphores,
    _sems: CudaSlice<SemaphoreHandle>,
}

impl AllToAll {
    /// Allocates the scratch rings, maps every peer's, builds the semaphores. Collective.
    pub fn new(comm: &Arc<Communicator>, opts: AllToAllOptions) -> Result<AllToAll> {
        let world = comm.world_size();
        let rank = comm.rank();
        if world > MAX_RANKS {
            return Err(Error::invalid(
                "world size",
                format!("{world} ranks: the single-node all-to-all handles at most {MAX_RANKS}"),
            ));
        }
        if opts.tile_bytes == 0 || opts.tile_bytes % 16 != 0 {
            return Err(Error::invalid(
                "tile_bytes",
                "must be a positive multiple of 16",
            ));
        }
        if opts.depth == 0 {
            return Err(Error::invalid("depth", "must be at least 1"));
        }
        if !(64..=512).contains(&opts.threads) || opts.threads % 64 != 0 {
            return Err(Error::invalid(
                "threads",
                format!("{}: must be a multiple of 64 in [64, 512]", opts.threads),
            ));
        }
        let send_threads = opts.send_threads.unwrap_or(opts.threads / 2);
        if send_threads == 0 || send_threads % 32 != 0 || send_threads >= opts.threads {
            return Err(Error::invalid(
                "send_threads",
                format!(
                    "{send_threads}: must be a multiple of 32 below the {} threads (the rest \
                     receive)",
                    opts.threads
                ),
            ));
        }
        let gpu = comm.gpu().clone();
        let sms = gpu.sm_count()?;
        let peers = world as u32 - 1;
        let (lanes, own_lanes) = match (opts.lanes, opts.own_lanes) {
            (Some(l), o) => (l, o.unwrap_or(l)),
            // Alone: no peers, every block copies.
            (None, o) if peers == 0 => (1, o.unwrap_or(sms)),
            (None, Some(o)) => (sms.saturating_sub(o) / peers, o),
            // A local copy needs far fewer SMs than an NVLink stream: on 4 x H200, 4 blocks
            // copying the own block (a quarter of the data) were 6% faster at 1 GiB than one
            // peer's share (docs/performance.md). With fewer peers the own block is a larger
            // share (half of it on 2 ranks) and 4 blocks (about 42 GB/s of copy each, 2 x H100)
            // became the bound: 12 / peers blocks, at least 4.
            (None, None) => {
                let o = 12u32.div_ceil(peers).max(4).min(sms / world as u32).max(1);
                ((sms - o) / peers, o)
            }
        };
        if lanes == 0 || own_lanes == 0 || peers * lanes + own_lanes > sms {
            return Err(Error::invalid(
                "lanes",
                format!(
                    "{lanes} lanes x {peers} peers + {own_lanes} own lanes: the grid must fit the \
                     GPU's {sms} SMs at once (blocks wait on other GPUs' blocks)"
                ),
            ));
        }
        if opts.ll_blocks == 0 || opts.ll_blocks > sms {
            return Err(Error::invalid(
                "ll_blocks",
                format!("{}: must be in 1..={sms}", opts.ll_blocks),
            ));
        }
        let call_check = comm.settings().call_check;
        let ll_max = opts
            .ll_max_bytes
            .unwrap_or(AllToAllOptions::default_ll_max(world));
        // Ring layout, tiles, teams and protocols must be the same on every rank.
        super::agree(
            comm,
            format!(
                "an all-to-all of {lanes} lanes per peer, {} B tiles x {} slots, {send_threads} \
                 of {} threads sending, LL up to {ll_max} B on {} blocks, call check {}",
                opts.tile_bytes,
                opts.depth,
                opts.threads,
                opts.ll_blocks,
                if call_check { "on" } else { "off" }
            ),
        )?;
        let ring_bytes = world * lanes as usize * opts.depth as usize * opts.tile_bytes;
        // LL16 packets carry 8 bytes in 16.
        let opts = AllToAllOptions {
            ll_max_bytes: Some(ll_max),
            ..opts
        };
        let ll_slot_bytes = (ll_max.div_ceil(8) * 16).max(16);
        // Two LL areas (equal blocks, alltoallv pairs), then the call check's inbox.
        let inbox_offset = ring_bytes + 4 * world * ll_slot_bytes;
        let scratch = comm.alloc_symmetric(inbox_offset + signature::INBOX_BYTES)?;
        let lanes_us = lanes as usize;
        let data = comm.semaphores(lanes_us)?;
        let credit = comm.semaphores(lanes_us)?;
        let stream = gpu.new_stream()?;
        let mut all = data.handles().to_vec();
        // The own entry of lane 0 carries no semaphore, only the site the kernel reports refused
        // counts from (`alltoall.cu`, counts_in_range).
        all[rank].site = comm.diagnostics().site(-1, u32::MAX);
        all.extend_from_slice(credit.handles());
        let sems = stream.clone_htod(&all).map_err(cuda_err("cuMemcpyHtoD"))?;
        let counts = stream
            .alloc_zeros::<u64>(4 * world)
            .map_err(cuda_err("cuMemAlloc"))?;
        let epochs = stream
            .alloc_zeros::<u32>(opts.ll_blocks as usize)
            .map_err(cuda_err("cuMemAlloc"))?;
        let pair_epochs = stream
            .alloc_zeros::<u32>(2 * world * lanes_us)
            .map_err(cuda_err("cuMemAlloc"))?;
        let scratch_ptrs = scratch.bases("the all-to-all")?;
        let inbox = scratch.bases_at(inbox_offset, "the all-to-all")?;
        let sems_ptr = sems.device_ptr(&stream).0;
        let base = AllToAllArgs {
            scratch: scratch_ptrs,
            data: sems_ptr,
            credit: sems_ptr + (lanes_us * world * std::mem::size_of::<SemaphoreHandle>()) as u64,
            tile: opts.tile_bytes as u64,
            rank: rank as u32,
            world: world as u32,
            lanes,
            depth: opts.depth,
            send_threads,
            ll_offset: ring_bytes as u64,
            ll_slot_bytes: ll_slot_bytes as u64,
            epochs: epochs.device_ptr(&stream).0,
            // Reusing a pair's packet area needs every rank to wait for every peer's call word,
            // which only the call check does (`alltoall.cu`, pair_packets).
            pair_ll_max: if call_check { ll_max as u64 } else { 0 },
            pair_epochs: pair_epochs.device_ptr(&stream).0,
            ..Default::default()
        };
        stream
            .synchronize()
            .map_err(cuda_err("cuStreamSynchronize"))?;
        let kernel = gpu.function("alltoall", "alltoall_tiles")?;
        let ll_kernel = gpu.function("alltoall", "alltoall_ll16")?;
        let v_kernel = gpu.function("alltoall", "alltoallv_tiles")?;
        // Every peer has mapped our scratch before anyone writes into it.
        comm.bootstrap().barrier()?;
        Ok(AllToAll {
            comm: comm.clone(),
            opts,
            base,
            kernel,
            ll_kernel,
            v_kernel,
            own_lanes,
            calls: CallChecker::new(inbox, call_check, comm.bootstrap().call_counter()),
            _epochs: epochs,
            counts: Mutex::new(counts),
            _pair_epochs: pair_epochs,
            _scratch: scratch,
            _data: data,
            _credit: credit,
            _sems: sems,
        })
    }

    /// Blocks per peer.
    pub fn lanes(&self) -> u32 {
        self.base.lanes
    }

    /// SMs a call occupies (one block per SM: lanes per peer plus the own lanes).
    pub fn sms(&self) -> u32 {
        self.base.lanes * (self.base.world - 1) + self.own_lanes
    }

    /// Launches the LL kernel for equal blocks of at most `ll_max_bytes`, else the tile kernel;
    /// every `alltoallv` the tile kernel's alltoallv form (each pair picks packets or tiles on
    /// the device).
    fn launch(&self, stream: &CudaStream, args: AllToAllArgs) -> Result<()> {
        self.comm.check_health()?;
        let ll_max = self.opts.ll_max_bytes.unwrap_or(0) as u64;
        let ll = args.counts == 0 && args.equal_bytes <= ll_max;
        // Equal blocks name their size; variable ones only their kind (their counts travel
        // beside the word, pair by pair).
        let (kind, count) = if args.counts == 0 {
            (CallKind::AllToAll, args.equal_bytes)
        } else {
            (CallKind::AllToAllV, 0)
        };
        let args = AllToAllArgs {
            call: self.calls.next(
                kind,
                signature::BYTES,
                u32::from(ll),
                0,
                count,
                signature::capturing(stream),
            ),
            ..args
        };
        let f = match (ll, args.counts) {
            (true, _) => &self.ll_kernel,
            (false, 0) => &self.kernel,
            _ => &self.v_kernel,
        };
        let mut b = stream.launch_builder(f);
        b.arg(&args);
        let cfg = LaunchConfig {
            grid_dim: (if ll { self.opts.ll_blocks } else { self.sms() }, 1, 1),
            block_dim: (if ll { 512 } else { self.opts.threads }, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: the arguments match all three kernels (AllToAllArgs is layout-tested); scratch and
        // semaphores live as long as `self`; the caller vouches for the buffers.
        self.comm
            .cuda_result(unsafe { b.launch(cfg) }.map(|_| ()), "cuLaunchKernel")
    }

    /// Equal blocks: block `p` of `input` (`[p * bytes_per_peer, +bytes_per_peer)`) goes to rank
    /// `p`, and block `p` of `output` comes from rank `p`.
    ///
    /// # Safety
    /// `input` and `output` are device memory of this rank's GPU holding `world * bytes_per_peer`
    /// bytes each, not overlapping, valid until the work on `stream` completes.
    pub unsafe fn run_raw(
        &self,
        stream: &CudaStream,
        input: u64,
        output: u64,
        bytes_per_peer: usize,
    ) -> Result<()> {
        if bytes_per_peer == 0 {
            return Ok(());
        }
        self.launch(
            stream,
            AllToAllArgs {
                input,
                output,
                counts: 0,
                equal_bytes: bytes_per_peer as u64,
                ..self.base
            },
        )
    }

    /// Per-peer counts read by the kernel from device memory: `counts` is a device array of
    /// `4 * world` u64 byte values (send counts, send offsets, recv counts, recv offsets, each
    /// indexed by rank). Capture it in a graph and change the counts between replays freely.
    ///
    /// Checked on the device, every call: a range outside `input_bytes` / `output_bytes`, or an
    /// own block sent and received at different sizes, fails the call with
    /// [`Error::InvalidArgument`] before anything is written (the peers then fail naming this
    /// rank); what rank `p` sends me must equal what I expect from `p`, else both ranks fail with
    /// [`Error::ArgumentMismatch`] naming the pair and both counts.
    ///
    /// # Safety
    /// `counts` is such an array, `input` and `output` are device memory of this GPU of
    /// `input_bytes` and `output_bytes`, not overlapping, all valid until the work on `stream`
    /// completes.
    pub unsafe fn run_v_raw(
        &self,
        stream: &CudaStream,
        input: u64,
        input_bytes: usize,
        output: u64,
        output_bytes: usize,
        counts: u64,
    ) -> Result<()> {
        self.launch(
            stream,
            AllToAllArgs {
                input,
                output,
                counts,
                input_bytes: input_bytes as u64,
                output_bytes: output_bytes as u64,
                ..self.base
            },
        )
    }

    /// Equal blocks of `input.len() / world` elements.
    pub fn run<T: DeviceRepr, I: DevicePtr<T>, O: DevicePtrMut<T>>(
        &self,
        stream: &CudaStream,
        input: &I,
        output: &mut O,
    ) -> Result<()> {
        let world = self.comm.world_size();
        if input.len() != output.len() || input.len() % world != 0 {
            return Err(Error::invalid(
                "buffers",
                format!(
                    "{} elements in, {} out: both must be the same multiple of {world} ranks",
                    input.len(),
                    output.len()
                ),
            ));
        }
        let bytes = input.num_bytes() / world;
        let (i, _gi) = input.device_ptr(stream);
        let (o, _go) = output.device_ptr_mut(stream);
        // SAFETY: live cudarc allocations of world * bytes each; distinct borrows.
        unsafe { self.run_raw(stream, i, o, bytes) }
    }

    /// `alltoallv` with counts and offsets in elements, uploaded (stream-ordered) into a device
    /// array this object owns; checked like [`AllToAll::run_v_raw`] (on the device, so that a bad
    /// range fails every rank at once, not only this one). Calls of one `AllToAll` must then stay
    /// on one stream; for CUDA graphs with changing counts use [`AllToAll::run_v_raw`] with your
    /// own device array.
    pub fn run_v<T: DeviceRepr, I: DevicePtr<T>, O: DevicePtrMut<T>>(
        &self,
        stream: &CudaStream,
        input: &I,
        output: &mut O,
        counts: &Counts,
    ) -> Result<()> {
        let world = self.comm.world_size();
        let size = std::mem::size_of::<T>();
        let mut all = Vec::with_capacity(4 * world);
        for (what, c) in [
            ("send_counts", &counts.send_counts),
            ("send_offsets", &counts.send_offsets),
            ("recv_counts", &counts.recv_counts),
            ("recv_offsets", &counts.recv_offsets),
        ] {
            if c.len() != world {
                return Err(Error::invalid(
                    what,
                    format!("{} values for {world} ranks", c.len()),
                ));
            }
            // Saturated: a range past the buffer stays past it, and the kernel refuses it.
            all.extend(c.iter().map(|&v| v.saturating_mul(size) as u64));
        }
        // Held until the launch: no other call rewrites the counts in between.
        let dev = self.counts.lock().unwrap_or_else(|p| p.into_inner());
        let (ptr, _gc) = dev.device_ptr(stream);
        self.comm.gpu().bind()?;
        // SAFETY: `ptr` holds 4 * world u64 (allocated in `new`); from pageable memory the copy
        // is staged before the call returns, so `all` may go away after it.
        unsafe { cudarc::driver::result::memcpy_htod_async(ptr, &all, stream.cu_stream()) }
            .map_err(cuda_err("cuMemcpyHtoD"))?;
        let (in_bytes, out_bytes) = (input.num_bytes(), output.num_bytes());
        let (i, _gi) = input.device_ptr(stream);
        let (o, _go) = output.device_ptr_mut(stream);
        // SAFETY: live cudarc allocations of the sizes given (the kernel checks every range
        // against them); the counts array is ours and the upload is ordered before the kernel.
        unsafe { self.run_v_raw(stream, i, in_bytes, o, out_bytes, ptr) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ll_limit_follows_the_rank_count_unless_set() {
        assert_eq!(AllToAllOptions::default().ll_max_bytes, None);
        assert_eq!(AllToAllOptions::default_ll_max(2), 512 << 10);
        assert_eq!(AllToAllOptions::default_ll_max(3), 64 << 10);
        assert_eq!(AllToAllOptions::default_ll_max(8), 64 << 10);
    }

    #[test]
    fn packed_offsets_are_running_sums() {
        let c = Counts::packed(vec![3, 0, 5], vec![1, 2, 0]);
        assert_eq!(c.send_offsets, vec![0, 3, 3]);
        assert_eq!(c.recv_offsets, vec![0, 1, 3]);
    }
}
